//! `ProgramTransform` (namespaced) and `ClusterProgramTransform` (cluster-scoped), in
//! `pko-rs.dev/v1alpha1`: a WebAssembly plugin (`wit/transform.wit`) that rewrites the specs of
//! the Programs it selects before their artifacts are built.
//!
//! The module is pinned by sha256 and comes from a ConfigMap key or an `https://`/`file://` URL.
//! Transforms that select a Program run in ascending `priority` (ties by name); each sees the
//! previous one's output.

#![allow(
    unreachable_pub,
    clippy::too_many_lines,
    reason = "the KubeSchema derive copies each struct into a private module of its own"
)]

use k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelector;
use kube::{CustomResource, KubeSchema};
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::common::Condition;

/// CEL rule on a module source: exactly one of `configMap`, `url` and `oci`.
pub const SOURCE_RULE: &str =
    "[has(self.configMap), has(self.url), has(self.oci)].filter(x, x).size() == 1";
/// Message of [`SOURCE_RULE`].
pub const SOURCE_MESSAGE: &str = "set exactly one of configMap, url and oci";
/// CEL rule on an OCI manifest digest.
pub const OCI_DIGEST_RULE: &str = "self.matches('^sha256:[0-9a-f]{64}$')";
/// Message of [`OCI_DIGEST_RULE`].
pub const OCI_DIGEST_MESSAGE: &str = "digest must be sha256: and 64 lowercase hex characters";
/// CEL rule on an OCI reference: a registry host and a repository, no scheme.
pub const OCI_REFERENCE_RULE: &str = "self.matches('^[a-zA-Z0-9.-]+(:[0-9]+)?/[a-z0-9]+([._/-]+[a-z0-9]+)*(:[A-Za-z0-9_][A-Za-z0-9._-]{0,127})?$')";
/// Message of [`OCI_REFERENCE_RULE`].
pub const OCI_REFERENCE_MESSAGE: &str = "reference must be host[:port]/repository[:tag], without a scheme or a digest (the digest goes in digest)";
/// CEL rule on `verify.cosign`: exactly one of `publicKeySecretRef` and `keys`.
pub const COSIGN_RULE: &str = "has(self.publicKeySecretRef) != has(self.keys)";
/// Message of [`COSIGN_RULE`].
pub const COSIGN_MESSAGE: &str = "set exactly one of publicKeySecretRef and keys";
/// CEL rule on a spec: signatures are checked on OCI sources only.
pub const VERIFY_RULE: &str = "!has(self.verify) || has(self.source.oci)";
/// Message of [`VERIFY_RULE`].
pub const VERIFY_MESSAGE: &str = "verify applies to source.oci only";
/// CEL rule on a ProgramTransform's spec: its pull Secret is in its own namespace.
pub const LOCAL_PULL_SECRET_RULE: &str = "!has(self.source.oci) || !has(self.source.oci.pullSecretRef) || !has(self.source.oci.pullSecretRef.__namespace__)";
/// Message of [`LOCAL_PULL_SECRET_RULE`].
pub const LOCAL_PULL_SECRET_MESSAGE: &str = "a ProgramTransform reads its pull Secret from its own namespace: leave out pullSecretRef.namespace";
/// CEL rule on a ClusterProgramTransform's spec: its pull Secret names its namespace.
pub const CLUSTER_PULL_SECRET_RULE: &str = "!has(self.source.oci) || !has(self.source.oci.pullSecretRef) || has(self.source.oci.pullSecretRef.__namespace__)";
/// Message of [`CLUSTER_PULL_SECRET_RULE`].
pub const CLUSTER_PULL_SECRET_MESSAGE: &str =
    "a ClusterProgramTransform's pullSecretRef names its namespace";
/// CEL rule on `sha256`.
pub const SHA256_RULE: &str = "self.matches('^(sha256:)?[0-9a-fA-F]{64}$')";
/// Message of [`SHA256_RULE`].
pub const SHA256_MESSAGE: &str =
    "sha256 must be 64 hex characters, optionally prefixed with sha256:";
/// CEL rule on `url`.
pub const URL_RULE: &str = "self.startsWith('https://') || self.startsWith('file:///')";
/// Message of [`URL_RULE`].
pub const URL_MESSAGE: &str = "url must start with https:// or file:///";

/// Condition type of a transform's state.
pub const READY: &str = "Ready";

/// ProgramTransform runs a WebAssembly plugin over the Programs of its namespace that match
/// `programSelector`, before their artifacts are built.
#[derive(CustomResource, KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[kube(
    group = "pko-rs.dev",
    version = "v1alpha1",
    kind = "ProgramTransform",
    plural = "programtransforms",
    shortname = "ptf",
    category = "pko-rs",
    namespaced,
    status = "TransformStatus",
    doc = "ProgramTransform runs a WebAssembly plugin over the Programs of its namespace before their artifacts are built.",
    printcolumn = r#"{"name":"Priority","type":"integer","jsonPath":".spec.priority"}"#,
    printcolumn = r#"{"name":"Policy","type":"string","jsonPath":".spec.failurePolicy"}"#,
    printcolumn = r#"{"name":"Plugin","type":"string","jsonPath":".status.plugin.name"}"#,
    printcolumn = r#"{"name":"Ready","type":"string","jsonPath":".status.conditions[?(@.type==\"Ready\")].status"}"#,
    printcolumn = r#"{"name":"Reason","type":"string","jsonPath":".status.conditions[?(@.type==\"Ready\")].reason"}"#,
    printcolumn = r#"{"name":"Age","type":"date","jsonPath":".metadata.creationTimestamp"}"#
)]
#[serde(rename_all = "camelCase")]
#[x_kube(validation = Rule::new(VERIFY_RULE).message(VERIFY_MESSAGE))]
#[x_kube(validation = Rule::new(LOCAL_PULL_SECRET_RULE).message(LOCAL_PULL_SECRET_MESSAGE))]
pub struct ProgramTransformSpec {
    /// Where the module comes from.
    pub source: ModuleSource,
    /// Signatures the module must carry before it is compiled (OCI sources only).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub verify: Option<Verify>,
    /// sha256 of the module bytes (hex, optionally prefixed with `sha256:`). A module with
    /// another digest is not loaded.
    #[x_kube(validation = Rule::new(SHA256_RULE).message(SHA256_MESSAGE))]
    #[schemars(length(max = 71))]
    pub sha256: String,
    /// Programs of this namespace the plugin applies to (empty: all of them).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub program_selector: Option<LabelSelector>,
    #[serde(flatten)]
    pub common: TransformCommon,
}

/// ClusterProgramTransform runs a WebAssembly plugin over the Programs of every namespace that
/// matches `namespaceSelector` (and `programSelector`), before their artifacts are built.
#[derive(CustomResource, KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[kube(
    group = "pko-rs.dev",
    version = "v1alpha1",
    kind = "ClusterProgramTransform",
    plural = "clusterprogramtransforms",
    shortname = "cptf",
    category = "pko-rs",
    status = "TransformStatus",
    doc = "ClusterProgramTransform runs a WebAssembly plugin over the Programs of the selected namespaces before their artifacts are built.",
    printcolumn = r#"{"name":"Priority","type":"integer","jsonPath":".spec.priority"}"#,
    printcolumn = r#"{"name":"Policy","type":"string","jsonPath":".spec.failurePolicy"}"#,
    printcolumn = r#"{"name":"Plugin","type":"string","jsonPath":".status.plugin.name"}"#,
    printcolumn = r#"{"name":"Ready","type":"string","jsonPath":".status.conditions[?(@.type==\"Ready\")].status"}"#,
    printcolumn = r#"{"name":"Reason","type":"string","jsonPath":".status.conditions[?(@.type==\"Ready\")].reason"}"#,
    printcolumn = r#"{"name":"Age","type":"date","jsonPath":".metadata.creationTimestamp"}"#
)]
#[serde(rename_all = "camelCase")]
#[x_kube(validation = Rule::new(VERIFY_RULE).message(VERIFY_MESSAGE))]
#[x_kube(validation = Rule::new(CLUSTER_PULL_SECRET_RULE).message(CLUSTER_PULL_SECRET_MESSAGE))]
pub struct ClusterProgramTransformSpec {
    /// Where the module comes from (a ConfigMap names its namespace).
    pub source: ClusterModuleSource,
    /// Signatures the module must carry before it is compiled (OCI sources only; a Secret
    /// names its namespace).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub verify: Option<ClusterVerify>,
    /// sha256 of the module bytes (hex, optionally prefixed with `sha256:`). A module with
    /// another digest is not loaded.
    #[x_kube(validation = Rule::new(SHA256_RULE).message(SHA256_MESSAGE))]
    #[schemars(length(max = 71))]
    pub sha256: String,
    /// Namespaces whose Programs the plugin applies to (empty: every namespace).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub namespace_selector: Option<LabelSelector>,
    /// Programs (in the selected namespaces) the plugin applies to (empty: all of them).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub program_selector: Option<LabelSelector>,
    #[serde(flatten)]
    pub common: TransformCommon,
}

/// Fields both kinds share.
#[derive(Serialize, Deserialize, JsonSchema, Clone, Debug, PartialEq, Default)]
#[serde(rename_all = "camelCase")]
pub struct TransformCommon {
    /// Order among the transforms that select a Program: lower runs first; ties are broken by
    /// name (then kind, cluster-scoped first).
    #[serde(default)]
    pub priority: i32,
    /// Configuration handed to the plugin as JSON; checked by the plugin's `validate-config`
    /// when the transform is loaded.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(schema_with = "any_json")]
    pub config: Option<Value>,
    /// What happens to a Program when the plugin fails on it (or cannot be loaded): `Fail`
    /// keeps the Program from being served and says why in its status; `Ignore` serves it
    /// without this plugin and records a Warning event.
    #[serde(default)]
    pub failure_policy: FailurePolicy,
    /// Per-call limits (defaults and ceilings are set by the operator).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub limits: Option<TransformLimits>,
}

/// Where a namespaced transform's module comes from.
#[derive(Serialize, Deserialize, KubeSchema, Clone, Debug, PartialEq, Default)]
#[serde(rename_all = "camelCase")]
#[x_kube(validation = Rule::new(SOURCE_RULE).message(SOURCE_MESSAGE))]
pub struct ModuleSource {
    /// A key of a ConfigMap in the transform's namespace (`binaryData`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub config_map: Option<ConfigMapKey>,
    /// An `https://` URL, or a `file:///` path under the operator's plugin folder.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[x_kube(validation = Rule::new(URL_RULE).message(URL_MESSAGE))]
    #[schemars(length(max = 2048), regex(pattern = crate::common::NO_SPACE))]
    pub url: Option<String>,
    /// An OCI Wasm artifact in a registry, pinned by its manifest digest.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub oci: Option<OciSource>,
}

/// Where a cluster-scoped transform's module comes from.
#[derive(Serialize, Deserialize, KubeSchema, Clone, Debug, PartialEq, Default)]
#[serde(rename_all = "camelCase")]
#[x_kube(validation = Rule::new(SOURCE_RULE).message(SOURCE_MESSAGE))]
pub struct ClusterModuleSource {
    /// A key of a ConfigMap (`binaryData`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub config_map: Option<NamespacedConfigMapKey>,
    /// An `https://` URL, or a `file:///` path under the operator's plugin folder.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[x_kube(validation = Rule::new(URL_RULE).message(URL_MESSAGE))]
    #[schemars(length(max = 2048), regex(pattern = crate::common::NO_SPACE))]
    pub url: Option<String>,
    /// An OCI Wasm artifact in a registry, pinned by its manifest digest.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub oci: Option<OciSource>,
}

/// An OCI Wasm artifact (an `application/wasm` layer and an `application/vnd.wasm.config`
/// config), pulled over https by manifest digest.
#[derive(Serialize, Deserialize, KubeSchema, Clone, Debug, PartialEq, Eq, Hash, Default)]
#[serde(rename_all = "camelCase")]
pub struct OciSource {
    /// `host[:port]/repository`, optionally with a tag that is informational only (the
    /// digest decides what is pulled).
    #[x_kube(validation = Rule::new(OCI_REFERENCE_RULE).message(OCI_REFERENCE_MESSAGE))]
    #[schemars(length(min = 3, max = 512), regex(pattern = crate::common::NO_SPACE))]
    pub reference: String,
    /// `sha256:<hex>` of the artifact's manifest.
    #[x_kube(validation = Rule::new(OCI_DIGEST_RULE).message(OCI_DIGEST_MESSAGE))]
    #[schemars(length(max = 71))]
    pub digest: String,
    /// A `kubernetes.io/dockerconfigjson` Secret holding credentials for the registry (a
    /// ProgramTransform's is in its own namespace; a ClusterProgramTransform's names it).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pull_secret_ref: Option<PullSecretRef>,
}

/// A registry credentials Secret.
#[derive(Serialize, Deserialize, JsonSchema, Clone, Debug, PartialEq, Eq, Hash, Default)]
#[serde(rename_all = "camelCase")]
pub struct PullSecretRef {
    /// Name of the Secret.
    #[schemars(length(min = 1, max = 253), regex(pattern = crate::names::DNS1123_SUBDOMAIN))]
    pub name: String,
    /// Namespace of the Secret (ClusterProgramTransforms only, where it is required).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 63), regex(pattern = crate::names::DNS1123_LABEL))]
    pub namespace: Option<String>,
}

/// Signature checks of a module.
#[derive(Serialize, Deserialize, JsonSchema, Clone, Debug, PartialEq, Default)]
#[serde(rename_all = "camelCase")]
pub struct Verify {
    /// cosign signatures (the `sha256-<digest>.sig` tag next to the artifact), checked
    /// offline against public keys.
    pub cosign: CosignVerify,
}

/// Public keys, one of which must have signed the artifact's manifest digest.
#[derive(Serialize, Deserialize, KubeSchema, Clone, Debug, PartialEq, Default)]
#[serde(rename_all = "camelCase")]
#[x_kube(validation = Rule::new(COSIGN_RULE).message(COSIGN_MESSAGE))]
pub struct CosignVerify {
    /// A key of a Secret in the transform's namespace holding PEM public keys (`cosign.pub`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub public_key_secret_ref: Option<SecretKeyRef>,
    /// PEM public keys (ECDSA P-256, as `cosign generate-key-pair` writes them).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 16), inner(length(max = 4096)))]
    pub keys: Option<Vec<String>>,
}

/// Signature checks of a cluster-scoped transform's module.
#[derive(Serialize, Deserialize, JsonSchema, Clone, Debug, PartialEq, Default)]
#[serde(rename_all = "camelCase")]
pub struct ClusterVerify {
    /// cosign signatures (the `sha256-<digest>.sig` tag next to the artifact), checked
    /// offline against public keys.
    pub cosign: ClusterCosignVerify,
}

/// Public keys, one of which must have signed the artifact's manifest digest.
#[derive(Serialize, Deserialize, KubeSchema, Clone, Debug, PartialEq, Default)]
#[serde(rename_all = "camelCase")]
#[x_kube(validation = Rule::new(COSIGN_RULE).message(COSIGN_MESSAGE))]
pub struct ClusterCosignVerify {
    /// A key of a Secret holding PEM public keys (`cosign.pub`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub public_key_secret_ref: Option<NamespacedSecretKeyRef>,
    /// PEM public keys (ECDSA P-256, as `cosign generate-key-pair` writes them).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 16), inner(length(max = 4096)))]
    pub keys: Option<Vec<String>>,
}

/// A key of a Secret in the same namespace.
#[derive(Serialize, Deserialize, JsonSchema, Clone, Debug, PartialEq, Default)]
#[serde(rename_all = "camelCase")]
pub struct SecretKeyRef {
    /// Name of the Secret.
    #[schemars(length(min = 1, max = 253), regex(pattern = crate::names::DNS1123_SUBDOMAIN))]
    pub name: String,
    /// Key under `data`.
    #[schemars(length(min = 1, max = 253))]
    pub key: String,
}

/// A key of a Secret in a named namespace.
#[derive(Serialize, Deserialize, JsonSchema, Clone, Debug, PartialEq, Default)]
#[serde(rename_all = "camelCase")]
pub struct NamespacedSecretKeyRef {
    /// Namespace of the Secret.
    #[schemars(length(min = 1, max = 63), regex(pattern = crate::names::DNS1123_LABEL))]
    pub namespace: String,
    /// Name of the Secret.
    #[schemars(length(min = 1, max = 253), regex(pattern = crate::names::DNS1123_SUBDOMAIN))]
    pub name: String,
    /// Key under `data`.
    #[schemars(length(min = 1, max = 253))]
    pub key: String,
}

/// A key of a ConfigMap in the same namespace.
#[derive(Serialize, Deserialize, JsonSchema, Clone, Debug, PartialEq, Default)]
#[serde(rename_all = "camelCase")]
pub struct ConfigMapKey {
    /// Name of the ConfigMap.
    #[schemars(length(min = 1, max = 253), regex(pattern = crate::names::DNS1123_SUBDOMAIN))]
    pub name: String,
    /// Key under `binaryData` holding the module.
    #[schemars(length(min = 1, max = 253))]
    pub key: String,
}

/// A key of a ConfigMap in a named namespace.
#[derive(Serialize, Deserialize, JsonSchema, Clone, Debug, PartialEq, Default)]
#[serde(rename_all = "camelCase")]
pub struct NamespacedConfigMapKey {
    /// Namespace of the ConfigMap.
    #[schemars(length(min = 1, max = 63), regex(pattern = crate::names::DNS1123_LABEL))]
    pub namespace: String,
    /// Name of the ConfigMap.
    #[schemars(length(min = 1, max = 253), regex(pattern = crate::names::DNS1123_SUBDOMAIN))]
    pub name: String,
    /// Key under `binaryData` holding the module.
    #[schemars(length(min = 1, max = 253))]
    pub key: String,
}

/// What happens to a Program when a transform fails on it.
#[derive(Serialize, Deserialize, JsonSchema, Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum FailurePolicy {
    /// The Program is not served; its Ready condition says why.
    #[default]
    Fail,
    /// The Program is served without this transform, with a Warning event.
    Ignore,
}

/// Per-call limits of a plugin; unset fields take the operator's defaults, and every value is
/// capped by the operator's ceilings.
#[derive(Serialize, Deserialize, JsonSchema, Clone, Copy, Debug, PartialEq, Eq, Default)]
#[serde(rename_all = "camelCase")]
pub struct TransformLimits {
    /// Fuel per call (about one unit per wasm instruction). Deterministic: a plugin that runs
    /// out does so on every replica.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1))]
    pub fuel: Option<i64>,
    /// Wall-clock budget per call, in milliseconds.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = 30000))]
    pub timeout_millis: Option<i64>,
    /// Linear memory of the plugin, in MiB.
    #[serde(default, rename = "memoryMiB", skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = 512))]
    pub memory_mib: Option<i64>,
    /// Size of the output (spec and warnings), in KiB.
    #[serde(default, rename = "outputKiB", skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = 16384))]
    pub output_kib: Option<i64>,
}

/// Observed state of a transform (both kinds).
#[derive(Serialize, Deserialize, JsonSchema, Clone, Debug, PartialEq, Default)]
#[serde(rename_all = "camelCase")]
pub struct TransformStatus {
    /// The generation the status describes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,
    /// `Ready`: the module is loaded and the configuration accepted; otherwise the reason
    /// (`DigestMismatch`, `ForbiddenImport`, `InvalidConfig`, `Source`, …) and a message.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(extend(
        "x-kubernetes-list-type" = "map",
        "x-kubernetes-list-map-keys" = ["type"],
    ))]
    pub conditions: Vec<Condition>,
    /// `sha256:<hex>` of the loaded module.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub digest: Option<String>,
    /// What the loaded plugin says about itself.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub plugin: Option<PluginStatus>,
}

/// A plugin's self-description.
#[derive(Serialize, Deserialize, JsonSchema, Clone, Debug, PartialEq, Default)]
#[serde(rename_all = "camelCase")]
pub struct PluginStatus {
    pub name: String,
    pub version: String,
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub description: String,
}

/// Any JSON value, kept as is by the apiserver.
fn any_json(_: &mut schemars::SchemaGenerator) -> schemars::Schema {
    schemars::json_schema!({ "x-kubernetes-preserve-unknown-fields": true })
}

/// A module source with the ConfigMap's namespace resolved.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum ResolvedSource {
    ConfigMap {
        namespace: String,
        name: String,
        key: String,
    },
    Url(String),
    Oci {
        artifact: OciSource,
        verify: Option<ResolvedKeys>,
        /// The credentials Secret, as (namespace, name).
        pull_secret: Option<(String, String)>,
    },
}

/// Where the public keys of a cosign check are, with the Secret's namespace resolved.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum ResolvedKeys {
    Inline(Vec<String>),
    Secret {
        namespace: String,
        name: String,
        key: String,
    },
}

/// The fields of either kind, in one shape.
#[derive(Debug, Clone, PartialEq)]
pub struct TransformView<'a> {
    pub source: Option<ResolvedSource>,
    pub sha256: &'a str,
    /// `None`: every namespace (namespaced transforms: their own, checked by the caller).
    pub namespace_selector: Option<&'a LabelSelector>,
    pub program_selector: Option<&'a LabelSelector>,
    pub common: &'a TransformCommon,
}

impl ProgramTransform {
    /// The spec in the shape both kinds share.
    pub fn view(&self) -> TransformView<'_> {
        let namespace = self.metadata.namespace.clone().unwrap_or_default();
        TransformView {
            source: resolve(
                self.spec
                    .source
                    .config_map
                    .as_ref()
                    .map(|c| ResolvedSource::ConfigMap {
                        namespace: namespace.clone(),
                        name: c.name.clone(),
                        key: c.key.clone(),
                    }),
                self.spec.source.url.as_deref(),
                self.spec
                    .source
                    .oci
                    .as_ref()
                    .map(|artifact| ResolvedSource::Oci {
                        artifact: artifact.clone(),
                        pull_secret: artifact
                            .pull_secret_ref
                            .as_ref()
                            .map(|r| (namespace.clone(), r.name.clone())),
                        verify: self.spec.verify.as_ref().map(|v| match &v.cosign {
                            CosignVerify {
                                public_key_secret_ref: Some(r),
                                ..
                            } => ResolvedKeys::Secret {
                                namespace: namespace.clone(),
                                name: r.name.clone(),
                                key: r.key.clone(),
                            },
                            CosignVerify { keys, .. } => {
                                ResolvedKeys::Inline(keys.clone().unwrap_or_default())
                            }
                        }),
                    }),
            ),
            sha256: &self.spec.sha256,
            namespace_selector: None,
            program_selector: self.spec.program_selector.as_ref(),
            common: &self.spec.common,
        }
    }
}

impl ClusterProgramTransform {
    /// The spec in the shape both kinds share.
    pub fn view(&self) -> TransformView<'_> {
        TransformView {
            source: resolve(
                self.spec
                    .source
                    .config_map
                    .as_ref()
                    .map(|c| ResolvedSource::ConfigMap {
                        namespace: c.namespace.clone(),
                        name: c.name.clone(),
                        key: c.key.clone(),
                    }),
                self.spec.source.url.as_deref(),
                self.spec
                    .source
                    .oci
                    .as_ref()
                    .map(|artifact| ResolvedSource::Oci {
                        artifact: artifact.clone(),
                        pull_secret: artifact
                            .pull_secret_ref
                            .as_ref()
                            .map(|r| (r.namespace.clone().unwrap_or_default(), r.name.clone())),
                        verify: self.spec.verify.as_ref().map(|v| match &v.cosign {
                            ClusterCosignVerify {
                                public_key_secret_ref: Some(r),
                                ..
                            } => ResolvedKeys::Secret {
                                namespace: r.namespace.clone(),
                                name: r.name.clone(),
                                key: r.key.clone(),
                            },
                            ClusterCosignVerify { keys, .. } => {
                                ResolvedKeys::Inline(keys.clone().unwrap_or_default())
                            }
                        }),
                    }),
            ),
            sha256: &self.spec.sha256,
            namespace_selector: self.spec.namespace_selector.as_ref(),
            program_selector: self.spec.program_selector.as_ref(),
            common: &self.spec.common,
        }
    }
}

/// Exactly one source, else `None` (the CRD rule makes that unreachable for stored objects).
fn resolve(
    config_map: Option<ResolvedSource>,
    url: Option<&str>,
    oci: Option<ResolvedSource>,
) -> Option<ResolvedSource> {
    match (config_map, url, oci) {
        (Some(cm), None, None) => Some(cm),
        (None, Some(url), None) => Some(ResolvedSource::Url(url.to_owned())),
        (None, None, Some(oci)) => Some(oci),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use kube::CustomResourceExt;
    use serde_json::json;

    use super::*;

    fn spec_schema(crd: &Value) -> &Value {
        &crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    }

    #[test]
    fn crds_are_in_our_group_with_the_right_scope() {
        let ns = serde_json::to_value(ProgramTransform::crd()).expect("crd");
        assert_eq!(ns["metadata"]["name"], "programtransforms.pko-rs.dev");
        assert_eq!(ns["spec"]["scope"], "Namespaced");
        let cluster = serde_json::to_value(ClusterProgramTransform::crd()).expect("crd");
        assert_eq!(
            cluster["metadata"]["name"],
            "clusterprogramtransforms.pko-rs.dev"
        );
        assert_eq!(cluster["spec"]["scope"], "Cluster");
        for crd in [&ns, &cluster] {
            assert_eq!(crd["spec"]["versions"][0]["name"], "v1alpha1");
            assert!(
                crd["spec"]["versions"][0]["subresources"]["status"].is_object(),
                "status subresource"
            );
            let spec = spec_schema(crd);
            let required: Vec<&str> = spec["required"]
                .as_array()
                .expect("required")
                .iter()
                .filter_map(Value::as_str)
                .collect();
            assert!(required.contains(&"sha256") && required.contains(&"source"));
            assert_eq!(
                spec["properties"]["sha256"]["x-kubernetes-validations"][0]["rule"],
                SHA256_RULE
            );
            assert_eq!(
                spec["properties"]["source"]["x-kubernetes-validations"][0]["rule"],
                SOURCE_RULE
            );
            assert_eq!(
                spec["properties"]["config"],
                json!({"x-kubernetes-preserve-unknown-fields": true, "description": spec["properties"]["config"]["description"]})
            );
            assert_eq!(
                spec["properties"]["failurePolicy"]["enum"],
                json!(["Fail", "Ignore"])
            );
        }
        assert!(spec_schema(&cluster)["properties"]["namespaceSelector"].is_object());
        assert!(spec_schema(&ns)["properties"]["namespaceSelector"].is_null());
        let cm = &spec_schema(&cluster)["properties"]["source"]["properties"]["configMap"];
        assert_eq!(cm["required"], json!(["key", "name", "namespace"]));
    }

    #[test]
    fn specs_round_trip_and_resolve_their_sources() {
        let pt: ProgramTransform = serde_json::from_value(json!({
            "apiVersion": "pko-rs.dev/v1alpha1",
            "kind": "ProgramTransform",
            "metadata": {"name": "tags", "namespace": "team-a"},
            "spec": {
                "source": {"configMap": {"name": "plugins", "key": "tags.wasm"}},
                "sha256": "ab".repeat(32),
                "priority": 5,
                "config": {"tags": {"a": "b"}},
                "failurePolicy": "Ignore",
                "limits": {"fuel": 1000, "memoryMiB": 8},
            },
        }))
        .expect("parses");
        let view = pt.view();
        assert_eq!(
            view.source,
            Some(ResolvedSource::ConfigMap {
                namespace: "team-a".into(),
                name: "plugins".into(),
                key: "tags.wasm".into()
            })
        );
        assert_eq!(view.common.priority, 5);
        assert_eq!(view.common.failure_policy, FailurePolicy::Ignore);
        assert_eq!(view.common.limits.and_then(|l| l.memory_mib), Some(8));
        let back = serde_json::to_value(&pt).expect("serializes");
        assert_eq!(
            back["spec"]["limits"],
            json!({"fuel": 1000, "memoryMiB": 8})
        );
        assert_eq!(back["spec"]["config"], json!({"tags": {"a": "b"}}));

        let cpt: ClusterProgramTransform = serde_json::from_value(json!({
            "apiVersion": "pko-rs.dev/v1alpha1",
            "kind": "ClusterProgramTransform",
            "metadata": {"name": "allow"},
            "spec": {"source": {"url": "file:///plugins/a.wasm"}, "sha256": "cd".repeat(32)},
        }))
        .expect("parses");
        let view = cpt.view();
        assert_eq!(
            view.source,
            Some(ResolvedSource::Url("file:///plugins/a.wasm".into()))
        );
        assert_eq!(view.common.failure_policy, FailurePolicy::Fail);
        assert_eq!(view.common.config, None);
    }
}
