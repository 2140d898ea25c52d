//! `programs.pulumi.com/v1`: an inline Pulumi YAML program, served to workspaces as an artifact.

use std::collections::BTreeMap;

use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::Error;
use crate::common::{Condition, custom_resource};
use crate::crd::{RootSchema, column, crd, root_schema, version};

custom_resource! {
    /// Program is the schema for the inline YAML program API.
    ///
    /// Unlike the other kinds, the desired state lives under the top-level key `program`
    /// (not `spec`), as in PKO.
    root Program {
        group: "pulumi.com",
        version: "v1",
        kind: "Program",
        plural: "programs",
        /// The Pulumi YAML program body.
        #[serde(default)]
        program: ProgramSpec,
        status: ProgramStatus,
        crd: program_crd,
    }
}

/// The body of a Pulumi YAML program (`Pulumi.yaml` without the project header).
#[derive(Serialize, Deserialize, JsonSchema, Clone, Debug, PartialEq, Default)]
#[serde(rename_all = "camelCase")]
pub struct ProgramSpec {
    /// configuration specifies the Pulumi config inputs to the deployment.
    /// Either type or default is required.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub configuration: BTreeMap<String, Configuration>,
    /// resources declares the Pulumi resources that will be deployed and managed by the program.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub resources: BTreeMap<String, Resource>,
    /// variables specifies intermediate values of the program; the values of variables are
    /// expressions that can be re-used.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub variables: BTreeMap<String, Value>,
    /// outputs specifies the Pulumi stack outputs of the program and how they are computed from
    /// the resources.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub outputs: BTreeMap<String, Value>,
    /// packages specifies external packages to be installed before running the program.
    /// This allows declaring parameterized packages and VCS-based components.
    /// Keys are package names, values are package specifications (URLs, versions, etc.).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub packages: BTreeMap<String, String>,
}

/// Configuration is a config input of the program; either type or default is required.
//
// PKO documents "type or default is required" without enforcing it; pko-rs enforces it at
// admission. Not with CEL: `default` holds any JSON, so its schema has no `type`, and the
// apiserver hides untyped fields from CEL (`has(self.default)` does not compile). The
// structural-schema `anyOf` of `required` lists does the same check; the apiserver reports
// `must validate at least one schema (anyOf)` plus `<path>.type: Required value`.
#[derive(Serialize, Deserialize, JsonSchema, Clone, Debug, PartialEq, Default)]
#[serde(rename_all = "camelCase")]
#[schemars(extend("anyOf" = [{ "required": ["type"] }, { "required": ["default"] }]))]
pub struct Configuration {
    /// type is the (required) data type for the parameter.
    #[serde(default, rename = "type", skip_serializing_if = "Option::is_none")]
    pub type_: Option<ConfigurationType>,
    /// default is a value of the appropriate type for the template to use if no value is
    /// specified.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub default: Option<Value>,
}

/// Data type of a program config input.
#[derive(Serialize, Deserialize, JsonSchema, Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ConfigurationType {
    /// A string.
    String,
    /// A number.
    Number,
    /// A list of numbers.
    #[serde(rename = "List<Number>")]
    ListNumber,
    /// A list of strings.
    #[serde(rename = "List<String>")]
    ListString,
}

/// Resource declares a Pulumi resource of the program; get and properties are mutually
/// exclusive.
//
// PKO documents `get` and `properties` as mutually exclusive without enforcing it; pko-rs
// enforces it at admission. Not with CEL: the values of `properties` are untyped, which hides
// the whole map from CEL. `not: {required: [get, properties]}` does the check; the apiserver
// reports `must not validate the schema (not)`.
#[derive(Serialize, Deserialize, JsonSchema, Clone, Debug, PartialEq, Default)]
#[serde(rename_all = "camelCase")]
#[schemars(extend("not" = { "required": ["get", "properties"] }))]
pub struct Resource {
    /// type is the Pulumi type token for this resource.
    #[serde(rename = "type")]
    #[schemars(length(min = 1))]
    pub type_: String,
    /// properties contains the primary resource-specific keys and values to initialize the
    /// resource state.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub properties: BTreeMap<String, Value>,
    /// options contains all resource options supported by Pulumi.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub options: Option<Options>,
    /// A getter function for the resource. Supplying get is mutually exclusive to properties.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub get: Option<Getter>,
}

/// Resource options supported by Pulumi YAML.
#[derive(Serialize, Deserialize, JsonSchema, Clone, Debug, PartialEq, Default)]
#[serde(rename_all = "camelCase")]
pub struct Options {
    /// additionalSecretOutputs specifies properties that must be encrypted as secrets.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub additional_secret_outputs: Vec<String>,
    /// aliases specifies names that this resource used to have, so that renaming or
    /// refactoring doesn't replace it.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub aliases: Vec<String>,
    /// customTimeouts overrides the default retry/timeout behavior for resource provisioning.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub custom_timeouts: Option<CustomTimeouts>,
    /// deleteBeforeReplace overrides the default create-before-delete behavior when replacing.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub delete_before_replace: Option<bool>,
    /// dependsOn adds explicit dependencies in addition to the ones in the dependency graph.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub depends_on: Vec<Value>,
    /// ignoreChanges declares that changes to certain properties should be ignored when
    /// diffing.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub ignore_changes: Vec<String>,
    /// import adopts an existing resource from your cloud account under the control of Pulumi.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub import: Option<String>,
    /// parent resource option specifies a parent for a resource. It is used to associate
    /// children with the parents that encapsulate or are responsible for them.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub parent: Option<Value>,
    /// protect prevents accidental deletion of a resource.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub protect: Option<bool>,
    /// provider resource option sets a provider for the resource.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub provider: Option<Value>,
    /// providers resource option sets a map of providers for the resource and its children.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub providers: BTreeMap<String, Value>,
    /// version specifies a provider plugin version that should be used when operating on a
    /// resource.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub version: Option<String>,
}

/// Custom timeouts of a resource's operations (Go duration strings such as `5m`).
#[derive(Serialize, Deserialize, JsonSchema, Clone, Debug, PartialEq, Default)]
#[serde(rename_all = "camelCase")]
pub struct CustomTimeouts {
    /// create is the custom timeout for create operations.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub create: Option<String>,
    /// delete is the custom timeout for delete operations.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub delete: Option<String>,
    /// update is the custom timeout for update operations.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub update: Option<String>,
}

/// Reads an existing resource instead of managing it.
#[derive(Serialize, Deserialize, JsonSchema, Clone, Debug, PartialEq, Default)]
#[serde(rename_all = "camelCase")]
pub struct Getter {
    /// The ID of the resource to import.
    #[schemars(length(min = 1))]
    pub id: String,
    /// state contains the known properties (input & output) of the resource. This assists
    /// the provider in figuring out the correct resource.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub state: BTreeMap<String, Value>,
}

/// ProgramStatus defines the observed state of Program.
#[derive(Serialize, Deserialize, JsonSchema, Clone, Debug, PartialEq, Default)]
#[serde(rename_all = "camelCase")]
pub struct ProgramStatus {
    /// ObservedGeneration is the last observed generation of the Program object.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,
    /// Artifact represents the last successful artifact generated by program reconciliation.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub artifact: Option<Artifact>,
    /// Conditions of the Program: Ready (the artifact of this generation is served), and
    /// while it is not, kstatus's Reconciling (a failed build is retried) or Stalled (the
    /// artifact cannot be built until the Program or a transform changes).
    // pko-rs addition (PKO's Program has no conditions): surfaces render/publish failures.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(extend(
        "x-kubernetes-list-type" = "map",
        "x-kubernetes-list-map-keys" = ["type"],
    ))]
    pub conditions: Vec<Condition>,
}

/// A Flux `source.toolkit.fluxcd.io/v1`-compatible artifact: the packaged program served by
/// the operator's file server, so Flux-style consumers can fetch it.
#[derive(Serialize, Deserialize, JsonSchema, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct Artifact {
    /// Path is the relative file path of the Artifact (`programs/<ns>/<name>/<generation>.tar.gz`).
    pub path: String,
    /// URL is the HTTP address of the Artifact as exposed by the controller managing the Source.
    pub url: String,
    /// Revision is a human-readable identifier traceable in the origin source system (the
    /// Program's generation).
    pub revision: String,
    /// Digest is the digest of the file in the form of '<algorithm>:<checksum>'.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(regex(pattern = r"^[a-z0-9]+(?:[.+_-][a-z0-9]+)*:[a-zA-Z0-9=_-]+$"))]
    pub digest: Option<String>,
    /// LastUpdateTime is the timestamp corresponding to the last update of the Artifact.
    pub last_update_time: Time,
    /// Size is the number of bytes in the file.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub size: Option<i64>,
    /// Metadata holds upstream information such as OCI annotations.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub metadata: Option<BTreeMap<String, String>>,
}

/// The `programs.pulumi.com` CRD. Panics only if schema generation is broken (tested).
pub fn program_crd() -> CustomResourceDefinition {
    try_program_crd().unwrap_or_else(|e| panic!("pko-api CRD generation is broken: {e}"))
}

/// The `programs.pulumi.com` CRD.
pub fn try_program_crd() -> Result<CustomResourceDefinition, Error> {
    let schema = root_schema::<ProgramSpec, ProgramStatus>(RootSchema {
        description: "Program is the schema for the inline YAML program API.",
        spec_key: "program",
        spec_required: false,
        validations: vec![],
    })?;
    let version = version(
        "v1",
        true,
        vec![
            column(
                "Ready",
                "string",
                ".status.conditions[?(@.type==\"Ready\")].status",
                None,
            ),
            column("Age", "date", ".metadata.creationTimestamp", None),
            // The URL carries its capability token: shown only with `-o wide`.
            column("URL", "string", ".status.artifact.url", Some(1)),
        ],
        schema,
    );
    Ok(crd("pulumi.com", "Program", "programs", vec![version]))
}
