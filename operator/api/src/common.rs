//! Types shared by several kinds, and the macro that defines the root object of each kind.

use std::collections::BTreeMap;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

/// Re-exported so every kind uses the same `metav1.Condition` type as PKO.
pub use k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition;

/// Defines the root object of a kind (`metadata` + desired state + optional `status`) and the
/// trait impls that `#[derive(CustomResource)]` would generate.
///
/// Written by hand because PKO's `Program` keeps its desired state under `program` instead of
/// `spec`, and because the CRD of every kind is built from [`crate::crd`] (with PKO's
/// Kubernetes list/map markers), so `CustomResourceExt::crd()` must return that CRD too.
macro_rules! custom_resource {
    (
        $(#[$meta:meta])*
        root $root:ident {
            group: $group:literal,
            version: $version:literal,
            kind: $kind:literal,
            plural: $plural:literal,
            $(#[$spec_meta:meta])*
            $spec_field:ident: $spec:ty,
            status: $status:ty,
            crd: $crd:path $(,)?
        }
    ) => {
        $(#[$meta])*
        #[derive(Clone, Debug, PartialEq, ::serde::Deserialize)]
        #[serde(rename_all = "camelCase")]
        pub struct $root {
            /// Standard object metadata (`managedFields` without their field sets: see [`crate::decode`]).
            #[serde(deserialize_with = "crate::decode::object_meta")]
            pub metadata: ::k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta,
            $(#[$spec_meta])*
            pub $spec_field: $spec,
            /// Observed state, written by the controller through the status subresource.
            #[serde(default, skip_serializing_if = "Option::is_none")]
            pub status: Option<$status>,
        }

        impl $root {
            /// Creates an object named `name` (no namespace, no status).
            pub fn new(name: &str, $spec_field: $spec) -> Self {
                Self {
                    metadata: ::k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta {
                        name: Some(name.to_owned()),
                        ..Default::default()
                    },
                    $spec_field,
                    status: None,
                }
            }
        }

        impl ::serde::Serialize for $root {
            fn serialize<S: ::serde::Serializer>(&self, ser: S) -> Result<S::Ok, S::Error> {
                use ::serde::ser::SerializeStruct as _;
                let mut obj =
                    ser.serialize_struct(stringify!($root), 4 + usize::from(self.status.is_some()))?;
                obj.serialize_field("apiVersion", concat!($group, "/", $version))?;
                obj.serialize_field("kind", $kind)?;
                obj.serialize_field("metadata", &self.metadata)?;
                obj.serialize_field(stringify!($spec_field), &self.$spec_field)?;
                if let Some(status) = &self.status {
                    obj.serialize_field("status", status)?;
                }
                obj.end()
            }
        }

        impl ::kube::Resource for $root {
            type DynamicType = ();
            type Scope = ::kube::core::NamespaceResourceScope;

            fn kind(_: &()) -> ::std::borrow::Cow<'_, str> {
                $kind.into()
            }
            fn group(_: &()) -> ::std::borrow::Cow<'_, str> {
                $group.into()
            }
            fn version(_: &()) -> ::std::borrow::Cow<'_, str> {
                $version.into()
            }
            fn api_version(_: &()) -> ::std::borrow::Cow<'_, str> {
                concat!($group, "/", $version).into()
            }
            fn plural(_: &()) -> ::std::borrow::Cow<'_, str> {
                $plural.into()
            }
            fn meta(&self) -> &::k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta {
                &self.metadata
            }
            fn meta_mut(
                &mut self,
            ) -> &mut ::k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta {
                &mut self.metadata
            }
        }

        impl ::kube::core::object::HasSpec for $root {
            type Spec = $spec;

            fn spec(&self) -> &$spec {
                &self.$spec_field
            }
            fn spec_mut(&mut self) -> &mut $spec {
                &mut self.$spec_field
            }
        }

        impl ::kube::core::object::HasStatus for $root {
            type Status = $status;

            fn status(&self) -> Option<&$status> {
                self.status.as_ref()
            }
            fn status_mut(&mut self) -> &mut Option<$status> {
                &mut self.status
            }
        }

        impl ::kube::CustomResourceExt for $root {
            /// The complete CRD of this kind, exactly as written to `deploy/crds/`.
            fn crd() -> ::k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition {
                $crd()
            }
            fn crd_name() -> &'static str {
                concat!($plural, ".", $group)
            }
            fn api_resource() -> ::kube::core::ApiResource {
                ::kube::core::ApiResource::erase::<Self>(&())
            }
            fn shortnames() -> &'static [&'static str] {
                &[]
            }
        }
    };
}
pub(crate) use custom_resource;

/// A URL or remote reference: no whitespace or control characters (it is parsed and checked
/// against the egress rules where it is used).
pub const NO_SPACE: &str = r"^[^\s\x00-\x1f\x7f]+$";
/// A git ref: what `git check-ref-format` refuses anywhere in a name is refused here.
pub const GIT_REF: &str = r"^[^\s\x00-\x1f\x7f~^:?*\[\\]+$";
/// A directory inside a checkout or artifact: no control characters or backslashes.
pub const PLAIN_PATH: &str = r"^[^\x00-\x1f\x7f\\]*$";

/// ResourceRef identifies a resource from which information can be loaded.
/// Environment variables, files on the filesystem, Kubernetes Secrets and literal
/// strings are currently supported; `type` selects which of the other fields is used.
#[derive(Serialize, Deserialize, JsonSchema, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct ResourceRef {
    /// SelectorType is required and signifies the type of selector. Must be one of:
    /// Env, FS, Secret, Literal
    #[serde(rename = "type")]
    pub selector_type: ResourceSelectorType,
    /// FileSystem selects a file on the operator's file system
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub filesystem: Option<FsSelector>,
    /// Env selects an environment variable set on the operator process
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub env: Option<EnvSelector>,
    /// SecretRef refers to a Kubernetes Secret
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub secret: Option<SecretSelector>,
    /// LiteralRef refers to a literal value
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub literal: Option<LiteralRef>,
}

impl ResourceRef {
    /// A reference to `key` in the Secret `name` (in the object's own namespace).
    pub fn secret(name: &str, key: &str) -> Self {
        Self {
            selector_type: ResourceSelectorType::Secret,
            filesystem: None,
            env: None,
            secret: Some(SecretSelector {
                namespace: None,
                name: name.to_owned(),
                key: key.to_owned(),
            }),
            literal: None,
        }
    }

    /// A literal value.
    pub fn literal(value: &str) -> Self {
        Self {
            selector_type: ResourceSelectorType::Literal,
            filesystem: None,
            env: None,
            secret: None,
            literal: Some(LiteralRef {
                value: value.to_owned(),
            }),
        }
    }
}

/// The kind of source a [`ResourceRef`] selects. PKO v2 only resolves `Secret` and `Literal`;
/// `Env` and `FS` (operator-process environment and file system) are refused by the controller.
#[derive(Serialize, Deserialize, JsonSchema, Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ResourceSelectorType {
    /// An environment variable of the operator process.
    Env,
    /// A file on the operator's file system.
    #[serde(rename = "FS")]
    Fs,
    /// A key of a Kubernetes Secret.
    Secret,
    /// A literal string.
    Literal,
}

/// FSSelector identifies the path to load information from.
#[derive(Serialize, Deserialize, JsonSchema, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct FsSelector {
    /// Path on the filesystem to use to load information from.
    pub path: String,
}

/// EnvSelector identifies the environment variable to load information from.
#[derive(Serialize, Deserialize, JsonSchema, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct EnvSelector {
    /// Name of the environment variable
    pub name: String,
}

/// SecretSelector identifies the information to load from a Kubernetes Secret.
#[derive(Serialize, Deserialize, JsonSchema, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct SecretSelector {
    /// Namespace where the Secret is stored. Deprecated; non-empty values will be considered invalid
    /// unless namespace isolation is disabled in the controller.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 63), regex(pattern = crate::names::DNS1123_LABEL))]
    pub namespace: Option<String>,
    /// Name of the Secret
    #[schemars(length(min = 1, max = 253), regex(pattern = crate::names::DNS1123_SUBDOMAIN))]
    pub name: String,
    /// Key within the Secret to use.
    pub key: String,
}

/// LiteralRef refers to a literal value
#[derive(Serialize, Deserialize, JsonSchema, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct LiteralRef {
    /// Value to load
    pub value: String,
}

/// The Pulumi project name and runtime, cached so a stack can be destroyed without its source.
#[derive(Serialize, Deserialize, JsonSchema, Clone, Debug, PartialEq, Default)]
#[serde(rename_all = "camelCase")]
pub struct ProjectInfo {
    /// Name is the Pulumi project name.
    pub name: String,
    /// Runtime is the Pulumi project runtime (e.g. `yaml`, `nodejs`).
    pub runtime: String,
}

/// Labels and annotations of an object embedded in a spec (a pod or service template).
#[derive(Serialize, Deserialize, JsonSchema, Clone, Debug, PartialEq, Default)]
#[serde(rename_all = "camelCase")]
pub struct EmbeddedObjectMeta {
    /// Map of string keys and values that can be used to organize and categorize
    /// (scope and select) objects.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub labels: BTreeMap<String, String>,
    /// Annotations is an unstructured key value map stored with a resource that may be
    /// set by external tools to store and retrieve arbitrary metadata.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub annotations: BTreeMap<String, String>,
}

/// Declarative (apply) form of `ObjectMeta`, used by the Stack's workspace and update templates.
///
/// Every field is optional because a template only states what it overrides.
#[derive(Serialize, Deserialize, JsonSchema, Clone, Debug, PartialEq, Default)]
#[serde(rename_all = "camelCase")]
pub struct ObjectMetaApply {
    /// Name of the object.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    /// Prefix for a server-generated name.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub generate_name: Option<String>,
    /// Namespace of the object.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub namespace: Option<String>,
    /// UID of the object.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub uid: Option<String>,
    /// Resource version of the object.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub resource_version: Option<String>,
    /// Generation of the object.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub generation: Option<i64>,
    /// Creation timestamp of the object.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub creation_timestamp: Option<Time>,
    /// Deletion timestamp of the object.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub deletion_timestamp: Option<Time>,
    /// Grace period of a pending deletion.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub deletion_grace_period_seconds: Option<i64>,
    /// Labels to add to the object.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub labels: BTreeMap<String, String>,
    /// Annotations to add to the object.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub annotations: BTreeMap<String, String>,
    /// Owner references to add to the object.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub owner_references: Vec<OwnerReferenceApply>,
    /// Finalizers to add to the object.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub finalizers: Vec<String>,
}

/// Declarative (apply) form of `OwnerReference`; every field optional.
#[derive(Serialize, Deserialize, JsonSchema, Clone, Debug, PartialEq, Default)]
#[serde(rename_all = "camelCase")]
pub struct OwnerReferenceApply {
    /// API version of the owner.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub api_version: Option<String>,
    /// Kind of the owner.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kind: Option<String>,
    /// Name of the owner.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    /// UID of the owner.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub uid: Option<String>,
    /// Whether the owner is the managing controller.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub controller: Option<bool>,
    /// Whether the owner cannot be deleted before this object.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub block_owner_deletion: Option<bool>,
}

/// A condition in a template (apply configuration of `metav1.Condition`; every field optional).
#[derive(Serialize, Deserialize, JsonSchema, Clone, Debug, PartialEq, Default)]
#[serde(rename_all = "camelCase")]
pub struct ConditionApply {
    /// Type of the condition.
    #[serde(default, rename = "type", skip_serializing_if = "Option::is_none")]
    pub type_: Option<String>,
    /// Status of the condition: True, False or Unknown.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub status: Option<String>,
    /// Generation the condition was set for.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,
    /// Last time the condition changed status.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_transition_time: Option<Time>,
    /// Machine-readable reason of the last transition.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
    /// Human-readable message of the last transition.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub message: Option<String>,
}

/// Project name and runtime in a template (every field optional).
#[derive(Serialize, Deserialize, JsonSchema, Clone, Debug, PartialEq, Default)]
#[serde(rename_all = "camelCase")]
pub struct ProjectInfoApply {
    /// Pulumi project name.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    /// Pulumi project runtime.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub runtime: Option<String>,
}
