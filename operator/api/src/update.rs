//! `updates.auto.pulumi.com/v1alpha1`: one Pulumi operation (preview, up, destroy, refresh) run
//! in a Workspace.

use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::Error;
use crate::common::{Condition, ProjectInfo, custom_resource};
use crate::crd::{RootSchema, column, crd, root_schema, version};

custom_resource! {
    /// Update is the Schema for the updates API
    root Update {
        group: "auto.pulumi.com",
        version: "v1alpha1",
        kind: "Update",
        plural: "updates",
        /// Desired operation.
        spec: UpdateSpec,
        status: UpdateStatus,
        crd: update_crd,
    }
}

/// UpdateSpec defines the desired state of Update
#[derive(Serialize, Deserialize, JsonSchema, Clone, Debug, PartialEq, Default)]
#[serde(rename_all = "camelCase")]
pub struct UpdateSpec {
    /// WorkspaceName is the workspace to update.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 253), regex(pattern = crate::names::DNS1123_SUBDOMAIN))]
    pub workspace_name: Option<String>,
    /// Specify the Pulumi stack to select for the update.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stack_name: Option<String>,
    /// Type of the update to perform.
    #[serde(default, rename = "type", skip_serializing_if = "Option::is_none")]
    pub type_: Option<UpdateType>,
    /// TTL for a completed update object (a Go duration such as `1h`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ttl_after_completed: Option<String>,
    /// Parallel is the number of resource operations to run in parallel at once
    /// (1 for no parallelism). Defaults to unbounded.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub parallel: Option<i32>,
    /// Message (optional) to associate with the preview operation
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub message: Option<String>,
    /// Return an error if any changes occur during this update
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub expect_no_changes: Option<bool>,
    /// Specify resources to replace
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub replace: Vec<String>,
    /// Specify an exclusive list of resource URNs to update
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub target: Vec<String>,
    /// TargetDependents allows updating of dependent targets discovered but not specified in
    /// the Target list
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub target_dependents: Option<bool>,
    /// refresh will run a refresh before the update.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub refresh: Option<bool>,
    /// ContinueOnError will continue to perform the update operation despite the occurrence
    /// of errors.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub continue_on_error: Option<bool>,
    /// Remove the stack and its configuration after all resources in the stack have been
    /// deleted.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub remove: Option<bool>,
    /// RunProgram runs the program before performing the operation.
    /// Applicable to destroy and refresh operations.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub run_program: Option<bool>,
    /// pko-rs only (PKO has no such field): the longest the operation may run, a Go duration
    /// such as `30m`. Past it the operation is canceled at the workspace agent and the Update
    /// fails with the reason `OperationTimedOut`. The operator's `--operation-timeout` bounds
    /// it: the shorter of the two applies. Unset or `0`: only the operator's bound.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 64))]
    pub operation_timeout: Option<String>,
    /// pko-rs only: with `type: refresh`, compute what a refresh would change and change
    /// nothing (`pulumi refresh --preview-only`): what a Stack's drift check runs. Only an
    /// agent that lists the `refresh-preview-only` feature runs it; with another agent (PKO's)
    /// the Update fails rather than run a refresh that writes the state.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub preview_only: Option<bool>,
    /// pko-rs only: an update plan, by its ID. With `type: preview`, the plan the preview
    /// proposes is saved under this ID in the workspace (`pulumi preview --save-plan`), and
    /// `status.plan` summarises it; with `type: up`, the up runs that saved plan (`pulumi up
    /// --plan`), so it does only what the preview showed, and fails without running when the
    /// workspace no longer holds it (reason `PlanNotFound`). Only an agent that lists the
    /// `update-plans` feature runs it; with another the Update fails (`PlansUnsupported`).
    /// An ID (at most 240 characters, so that it stays a file name in the agent) of a DNS
    /// subdomain's characters.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 240), regex(pattern = crate::names::DNS1123_SUBDOMAIN))]
    pub plan: Option<String>,
}

/// The operation an Update performs.
#[derive(Serialize, Deserialize, JsonSchema, Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[serde(rename_all = "lowercase")]
pub enum UpdateType {
    /// `pulumi preview`.
    Preview,
    /// `pulumi up`.
    Up,
    /// `pulumi destroy`.
    Destroy,
    /// `pulumi refresh`.
    Refresh,
}

impl UpdateType {
    /// The wire name (`preview`, `up`, `destroy`, `refresh`), as `Stack.status.lastUpdate.type`
    /// records it.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Preview => "preview",
            Self::Up => "up",
            Self::Destroy => "destroy",
            Self::Refresh => "refresh",
        }
    }
}

impl std::fmt::Display for UpdateType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// UpdateStatus defines the observed state of Update
#[derive(Serialize, Deserialize, JsonSchema, Clone, Debug, PartialEq, Default)]
#[serde(rename_all = "camelCase")]
pub struct UpdateStatus {
    /// observedGeneration represents the .metadata.generation that the status was set based
    /// upon.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 0))]
    pub observed_generation: Option<i64>,
    /// The start time of the operation.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub start_time: Option<Time>,
    /// The end time of the operation.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub end_time: Option<Time>,
    /// Represents the permalink URL in the Pulumi Console for the operation. Not available
    /// for DIY backends.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub permalink: Option<String>,
    /// Result message of the operation.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub message: Option<String>,
    /// Outputs names a secret containing the outputs for this update.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub outputs: Option<String>,
    /// Represents the observations of an update's current state.
    /// Known .status.conditions.type are: "Complete", "Failed", and "Progressing"
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(extend(
        "x-kubernetes-list-type" = "map",
        "x-kubernetes-list-map-keys" = ["type"],
    ))]
    pub conditions: Vec<Condition>,
    /// ProjectInfo records the Pulumi project name and runtime as observed by the agent
    /// during this update. The Stack controller copies this to Stack.Status.ProjectInfo so
    /// that subsequent destroy operations can proceed without the source artifact.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub project_info: Option<ProjectInfo>,
    /// pko-rs only: the resources a `previewOnly` refresh found changed outside Pulumi.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub changes: Option<ResourceChanges>,
    /// pko-rs only: what the plan a preview with `spec.plan` saved would do.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub plan: Option<PlanSummary>,
}

/// What an update plan would do (pko-rs only).
#[derive(Serialize, Deserialize, JsonSchema, Clone, Debug, PartialEq, Default)]
#[serde(rename_all = "camelCase")]
pub struct PlanSummary {
    /// How many resources each operation touches (`create`, `update`, `delete`, `replace`,
    /// `same`, ...), as the engine names them.
    #[serde(default, skip_serializing_if = "std::collections::BTreeMap::is_empty")]
    pub counts: std::collections::BTreeMap<String, i64>,
    /// The first changes (at most 20), each `<operation> <urn>`; `same`, `refresh` and `read`
    /// (no change of a resource) are not listed.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(extend("x-kubernetes-list-type" = "atomic"))]
    pub changes: Vec<String>,
}

/// Whether an engine operation changes a resource: `same`, and the `refresh` and `read` of a
/// preview that refreshes first, do not.
pub fn is_change(op: &str) -> bool {
    !matches!(op, "same" | "refresh" | "read")
}

/// Resources an operation found changed (pko-rs only).
#[derive(Serialize, Deserialize, JsonSchema, Clone, Debug, PartialEq, Default)]
#[serde(rename_all = "camelCase")]
pub struct ResourceChanges {
    /// How many resources changed.
    pub count: i64,
    /// The URNs of the first of them (at most 20).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(extend("x-kubernetes-list-type" = "atomic"))]
    pub resources: Vec<String>,
}

/// Update spec fields of a Stack's update template. `UpdateSpec` is already all-optional and
/// default-free, so the same type serves.
pub type UpdateSpecApply = UpdateSpec;

/// The `updates.auto.pulumi.com` CRD. Panics only if schema generation is broken (tested).
pub fn update_crd() -> CustomResourceDefinition {
    try_update_crd().unwrap_or_else(|e| panic!("pko-api CRD generation is broken: {e}"))
}

/// The `updates.auto.pulumi.com` CRD.
pub fn try_update_crd() -> Result<CustomResourceDefinition, Error> {
    let schema = root_schema::<UpdateSpec, UpdateStatus>(RootSchema {
        description: "Update is the Schema for the updates API",
        spec_key: "spec",
        spec_required: true,
        validations: vec![],
    })?;
    let condition = |t: &str| format!(".status.conditions[?(@.type==\"{t}\")].status");
    let version = version(
        "v1alpha1",
        true,
        vec![
            column("Workspace", "string", ".spec.workspaceName", None),
            column("Type", "string", ".spec.type", Some(10)),
            column("Start Time", "date", ".status.startTime", Some(10)),
            column("End Time", "date", ".status.endTime", Some(10)),
            column("Progressing", "string", &condition("Progressing"), None),
            column("Failed", "string", &condition("Failed"), None),
            column("Complete", "string", &condition("Complete"), None),
            column("URL", "string", ".status.permalink", None),
        ],
        schema,
    );
    Ok(crd("auto.pulumi.com", "Update", "updates", vec![version]))
}
