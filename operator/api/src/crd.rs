//! The pieces every CRD of the crate is built from (root schema, printer columns, versions, the
//! CRD itself). A leaf: each kind's file builds its own CRD from these, and `crdgen` only
//! collects and renders them, so no type file and `crdgen` import each other.

use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::{
    CustomResourceColumnDefinition, CustomResourceDefinition, CustomResourceDefinitionNames,
    CustomResourceDefinitionSpec, CustomResourceDefinitionVersion, CustomResourceSubresourceStatus,
    CustomResourceSubresources, CustomResourceValidation, JSONSchemaProps,
};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use schemars::JsonSchema;
use serde_json::{Value, json};

use crate::Error;
use crate::schema::schema_value_for;

/// Category shared by all kinds, so `kubectl get pulumi` lists them.
pub const CATEGORY: &str = "pulumi";

/// `apiVersion` description of every root schema (as in controller-gen output).
const API_VERSION_DESCRIPTION: &str = "APIVersion defines the versioned schema of this representation of an object.\nServers should convert recognized schemas to the latest internal value, and\nmay reject unrecognized values.\nMore info: https://git.k8s.io/community/contributors/devel/sig-architecture/api-conventions.md#resources";
/// `kind` description of every root schema (as in controller-gen output).
const KIND_DESCRIPTION: &str = "Kind is a string value representing the REST resource this object represents.\nServers may infer this from the endpoint the client submits requests to.\nCannot be updated.\nIn CamelCase.\nMore info: https://git.k8s.io/community/contributors/devel/sig-architecture/api-conventions.md#types-kinds";

/// What differs between the root schemas of the kinds.
pub(crate) struct RootSchema {
    pub(crate) description: &'static str,
    /// `spec`, or `program` for Program.
    pub(crate) spec_key: &'static str,
    /// Whether the desired-state key is required. The typed clients need it for Stack,
    /// Workspace and Update (their spec is not optional in Rust); Program's body defaults to
    /// empty, so it stays optional as in PKO.
    pub(crate) spec_required: bool,
    /// CEL rules on the root object.
    pub(crate) validations: Vec<Value>,
}

pub(crate) fn root_schema<Spec: JsonSchema, Status: JsonSchema>(
    root: RootSchema,
) -> Result<JSONSchemaProps, Error> {
    let spec = schema_value_for::<Spec>()?;
    let status = schema_value_for::<Status>()?;
    let mut schema = json!({
        "description": root.description,
        "type": "object",
        "properties": {
            "apiVersion": { "description": API_VERSION_DESCRIPTION, "type": "string" },
            "kind": { "description": KIND_DESCRIPTION, "type": "string" },
            "metadata": { "type": "object" },
            root.spec_key: spec,
            "status": status,
        },
    });
    if let Value::Object(obj) = &mut schema {
        if root.spec_required {
            obj.insert("required".to_owned(), json!([root.spec_key]));
        }
        if !root.validations.is_empty() {
            obj.insert(
                "x-kubernetes-validations".to_owned(),
                Value::Array(root.validations),
            );
        }
    }
    serde_json::from_value(schema).map_err(|source| Error::SchemaJson {
        type_name: Spec::schema_name().into_owned(),
        source,
    })
}

pub(crate) fn column(
    name: &str,
    type_: &str,
    json_path: &str,
    priority: Option<i32>,
) -> CustomResourceColumnDefinition {
    CustomResourceColumnDefinition {
        name: name.to_owned(),
        type_: type_.to_owned(),
        json_path: json_path.to_owned(),
        priority,
        description: None,
        format: None,
    }
}

pub(crate) fn version(
    name: &str,
    storage: bool,
    columns: Vec<CustomResourceColumnDefinition>,
    schema: JSONSchemaProps,
) -> CustomResourceDefinitionVersion {
    CustomResourceDefinitionVersion {
        name: name.to_owned(),
        served: true,
        storage,
        deprecated: None,
        deprecation_warning: None,
        additional_printer_columns: (!columns.is_empty()).then_some(columns),
        schema: Some(CustomResourceValidation {
            open_api_v3_schema: Some(schema),
        }),
        selectable_fields: None,
        subresources: Some(CustomResourceSubresources {
            scale: None,
            status: Some(CustomResourceSubresourceStatus(json!({}))),
        }),
    }
}

pub(crate) fn crd(
    group: &str,
    kind: &str,
    plural: &str,
    versions: Vec<CustomResourceDefinitionVersion>,
) -> CustomResourceDefinition {
    CustomResourceDefinition {
        metadata: ObjectMeta {
            name: Some(format!("{plural}.{group}")),
            ..Default::default()
        },
        spec: CustomResourceDefinitionSpec {
            group: group.to_owned(),
            names: CustomResourceDefinitionNames {
                categories: Some(vec![CATEGORY.to_owned()]),
                kind: kind.to_owned(),
                list_kind: Some(format!("{kind}List")),
                plural: plural.to_owned(),
                short_names: None,
                singular: Some(kind.to_lowercase()),
            },
            scope: "Namespaced".to_owned(),
            versions,
            conversion: None,
            preserve_unknown_fields: None,
        },
        status: None,
    }
}
