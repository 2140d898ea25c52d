//! `stacks.pulumi.com`: a Pulumi stack to deploy continuously. `v1` is the storage version;
//! [`v1alpha1`] is still served (deprecated) with the same spec and a smaller status.

use std::collections::BTreeMap;

use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};

use crate::Error;
use crate::common::{
    Condition, ConditionApply, ObjectMetaApply, ProjectInfo, ResourceRef, custom_resource,
};
use crate::crd::{RootSchema, column, crd, root_schema, version};
use crate::update::UpdateSpecApply;
use crate::workspace::{WorkspaceSpecApply, WorkspaceStatusApply};

custom_resource! {
    /// Stack is the Schema for the stacks API
    root Stack {
        group: "pulumi.com",
        version: "v1",
        kind: "Stack",
        plural: "stacks",
        /// Desired state of the stack.
        spec: StackSpec,
        status: StackStatus,
        crd: stack_crd,
    }
}

/// The Stack finalizer, under PKO's name, so a Stack handed over from PKO is cleaned up the
/// same way.
pub const STACK_FINALIZER: &str = "finalizer.stack.pulumi.com";

/// CEL rule (on the spec of both versions): the controller picks one source by precedence
/// (git > flux > program) and silently ignores the others in PKO; refusing the ambiguity at
/// admission avoids deploying a different program than the user expects.
pub const SOURCE_EXCLUSIVITY_RULE: &str = "(has(self.projectRepo) ? 1 : 0) + (has(self.fluxSource) ? 1 : 0) + (has(self.programRef) ? 1 : 0) <= 1";
/// Message of [`SOURCE_EXCLUSIVITY_RULE`].
pub const SOURCE_EXCLUSIVITY_MESSAGE: &str =
    "projectRepo, fluxSource and programRef are mutually exclusive";
/// CEL rule (on the spec): a git source names exactly one of `commit` and `branch`. PKO only
/// finds out in the controller; an empty string counts as unset, as there.
pub const GIT_REVISION_RULE: &str = "!has(self.projectRepo) || (has(self.commit) && size(self.commit) > 0 ? 1 : 0) + (has(self.branch) && size(self.branch) > 0 ? 1 : 0) == 1";
/// Message of [`GIT_REVISION_RULE`].
pub const GIT_REVISION_MESSAGE: &str = "projectRepo needs exactly one of commit and branch";
/// CEL rule (on the spec): an approval gate holds back ups, and a `preview` stack runs none.
pub const APPROVAL_PREVIEW_RULE: &str =
    "!has(self.approval) || !has(self.preview) || !self.preview";
/// Message of [`APPROVAL_PREVIEW_RULE`].
pub const APPROVAL_PREVIEW_MESSAGE: &str =
    "approval gates ups, and a preview stack runs none: set approval or preview, not both";
/// PKO's CEL rule on the `v1` root: the workspace pod's `controller-revision-hash` label
/// (`<name>-workspace-<hash>`) must fit in 63 characters.
pub const NAME_LENGTH_RULE: &str = "size(self.metadata.name) <= 42";
/// Message of [`NAME_LENGTH_RULE`], as in PKO.
pub const NAME_LENGTH_MESSAGE: &str = "Stack name must be no more than 42 characters in length.";

/// StackSpec defines the desired state of Pulumi Stack being managed by this operator.
#[derive(Serialize, Deserialize, JsonSchema, Clone, Debug, PartialEq, Default)]
#[serde(rename_all = "camelCase")]
#[schemars(extend("x-kubernetes-validations" = [{
    "rule": SOURCE_EXCLUSIVITY_RULE,
    "message": SOURCE_EXCLUSIVITY_MESSAGE,
}, {
    "rule": GIT_REVISION_RULE,
    "message": GIT_REVISION_MESSAGE,
}, {
    "rule": APPROVAL_PREVIEW_RULE,
    "message": APPROVAL_PREVIEW_MESSAGE,
}]))]
pub struct StackSpec {
    /// Stack is the fully qualified name of the stack to deploy (<org>/<stack>).
    pub stack: String,
    /// (optional) Backend is an optional backend URL to use for all Pulumi operations
    /// (e.g. `https://app.pulumi.com`, `s3://<bucket>`, `file://./dir`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub backend: Option<String>,
    /// (optional) SecretsProvider is used to initialize a Stack with alternative encryption
    /// (e.g. `awskms://...`, `gcpkms://...`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub secrets_provider: Option<String>,
    /// (optional) AccessTokenSecret is the name of a Secret containing the PULUMI_ACCESS_TOKEN
    /// for Pulumi access.
    /// Deprecated: use EnvRefs with a "secret" entry with the key PULUMI_ACCESS_TOKEN instead.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 253), regex(pattern = crate::names::DNS1123_SUBDOMAIN))]
    pub access_token_secret: Option<String>,
    /// (optional) Envs is an optional array of config maps containing environment variables
    /// to set. Deprecated: use EnvRefs instead.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(inner(length(min = 1, max = 253), regex(pattern = crate::names::DNS1123_SUBDOMAIN)))]
    pub envs: Vec<String>,
    /// (optional) SecretEnvs is an optional array of Secret names containing environment
    /// variables to set. Deprecated: use EnvRefs instead.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(inner(length(min = 1, max = 253), regex(pattern = crate::names::DNS1123_SUBDOMAIN)))]
    pub env_secrets: Vec<String>,
    /// (optional) EnvRefs is an optional map containing environment variables as keys and
    /// stores descriptors to where the variables' values should be loaded from (one of
    /// literal, environment variable, file on the filesystem, or Kubernetes Secret) as values.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub env_refs: BTreeMap<String, ResourceRef>,
    /// (optional) Config is the configuration for this stack, which can be optionally
    /// specified inline. If this is omitted, configuration is assumed to be checked in and
    /// taken from the source repository. Supports both simple string values and structured
    /// values (objects, arrays, numbers, booleans).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    #[schemars(schema_with = "crate::schema::any_object")]
    pub config: BTreeMap<String, Value>,
    /// (optional) Secrets is the secret configuration for this stack, which can be optionally
    /// specified inline. Deprecated: use SecretRefs instead.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub secrets: BTreeMap<String, String>,
    /// (optional) ConfigRef allows specifying configuration values from ConfigMaps.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub config_ref: BTreeMap<String, ConfigMapRef>,
    /// (optional) SecretRefs is the secret configuration for this stack which can be
    /// specified through ResourceRef. If this is omitted, secrets configuration is assumed to
    /// be checked in and taken from the source repository.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub secrets_ref: BTreeMap<String, ResourceRef>,
    /// (optional) Environment specifies the Pulumi ESC environment(s) to use for this stack.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(extend("x-kubernetes-list-type" = "atomic"))]
    pub environment: Vec<String>,

    /// ProjectRepo is the git source control repository from which we fetch the project code
    /// and configuration.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 2048), regex(pattern = crate::common::NO_SPACE))]
    pub project_repo: Option<String>,
    /// (optional) GitAuthSecret is the the name of a Secret containing an authentication
    /// option for the git repository (keys `sshPrivateKey`/`password`, `accessToken`, or
    /// `username`/`password`). Deprecated. Use GitAuth instead.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 253), regex(pattern = crate::names::DNS1123_SUBDOMAIN))]
    pub git_auth_secret: Option<String>,
    /// (optional) GitAuth allows configuring git authentication options.
    /// There are 4 different authentication options: SSH private key (and its optional
    /// password), personal access token, basic auth username and password, and GitHub App.
    /// Only one authentication mode will be considered if more than one option is specified,
    /// with ssh private key/password preferred first, then personal access token, and
    /// finally basic auth credentials.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub git_auth: Option<GitAuthConfig>,
    /// (optional) RepoDir is the directory to work from in the project's source repository
    /// where Pulumi.yaml is located. It is used in case Pulumi.yaml is not in the project
    /// source root.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 4096), regex(pattern = crate::common::PLAIN_PATH))]
    pub repo_dir: Option<String>,
    /// (optional) Commit is the hash of the commit to deploy. If used, HEAD will be in
    /// detached mode. This is mutually exclusive with the Branch setting.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub commit: Option<String>,
    /// (optional) Branch is the branch name to deploy, either the simple or fully qualified
    /// ref name, e.g. refs/heads/master. This is mutually exclusive with the Commit setting.
    /// When specified, the operator will periodically poll to check if the branch has any
    /// new commits, every ResyncFrequencySeconds (default 60 seconds).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 1024), regex(pattern = crate::common::GIT_REF))]
    pub branch: Option<String>,
    /// Shallow controls whether the workspace uses a shallow checkout or whether all history
    /// is cloned.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub shallow: Option<bool>,

    /// FluxSource specifies how to fetch source code from a Flux source object.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub flux_source: Option<FluxSource>,
    /// ProgramRef refers to a Program object, to be used as the source for the stack.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub program_ref: Option<ProgramReference>,

    /// (optional) Targets is a list of URNs of resources to update exclusively. If supplied,
    /// only resources mentioned will be updated.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub targets: Vec<String>,
    /// TargetDependents indicates that dependent resources should be updated as well, when
    /// using Targets.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub target_dependents: Option<bool>,
    /// (optional) Prerequisites is a list of references to other stacks, each with a
    /// constraint on how long ago it must have succeeded. This can be used to make sure e.g.,
    /// state is re-evaluated before running a stack that depends on it.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub prerequisites: Vec<PrerequisiteRef>,
    /// (optional) ContinueResyncOnCommitMatch - when true - informs the operator to continue
    /// trying to update stacks even if the revision of the source matches. The resync
    /// frequency is controlled by ResyncFrequencySeconds (default 60s).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub continue_resync_on_commit_match: Option<bool>,
    /// (optional) ResyncFrequencySeconds controls how often to re-run the stack when
    /// ContinueResyncOnCommitMatch is true, and how often to poll a git branch for new
    /// commits. Values below 60 (including 0) are treated as 60; unset means 60.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub resync_frequency_seconds: Option<i64>,
    /// (optional) Refresh can be set to true to refresh the stack before it is updated.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub refresh: Option<bool>,
    /// (optional) ExpectNoRefreshChanges can be set to true if a stack is not expected to
    /// have changes during a refresh before the update is run.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub expect_no_refresh_changes: Option<bool>,
    /// (optional) DestroyOnFinalize can be set to true to destroy the stack completely upon
    /// deletion of the Stack custom resource. Destroy runs in a workspace pod, which cannot be
    /// created in a Terminating namespace.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub destroy_on_finalize: Option<bool>,
    /// (optional) RunProgram runs the program during destroy operations (when
    /// destroyOnFinalize is set), for programs whose setup is needed by the destroy.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub run_program: Option<bool>,
    /// (optional) RetryOnUpdateConflict issues a stack update retry reconciliation loop in
    /// the event that the update hits a HTTP 409 conflict due to another update in progress.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub retry_on_update_conflict: Option<bool>,
    /// (optional) UseLocalStackOnly can be set to true to prevent the operator from creating
    /// stacks that do not exist in the tracking git repo.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub use_local_stack_only: Option<bool>,
    /// RetryMaxBackoffDurationSeconds controls the maximum number of seconds to wait before
    /// retrying a failed update (exponential backoff). Defaults to 86400 (24 hours).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub retry_max_backoff_duration_seconds: Option<i64>,
    /// (optional) Preview when set to true runs only preview operations, never actual
    /// updates.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub preview: Option<bool>,

    /// ServiceAccountName is the Kubernetes service account identity of the stack's
    /// workspace.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 253), regex(pattern = crate::names::DNS1123_SUBDOMAIN))]
    pub service_account_name: Option<String>,
    /// WorkspaceTemplate customizes the Workspace generated for this Stack. It is applied as
    /// a strategic merge patch on top of the underlying Workspace. Use this to customize the
    /// Workspace's metadata, image, resources, volumes, etc.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub workspace_template: Option<EmbeddedWorkspaceTemplateSpec>,
    /// WorkspaceReclaimPolicy specifies whether the workspace should be deleted or retained
    /// after the Stack is successfully updated. The default behavior is to retain the
    /// workspace.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub workspace_reclaim_policy: Option<WorkspaceReclaimPolicy>,
    /// UpdateTemplate customizes the Updates generated for this Stack. It is applied as a
    /// strategic merge patch on top of the underlying Update.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub update_template: Option<EmbeddedUpdateTemplateSpec>,
    /// (pko-rs) UpdateHistoryLimit is how many finished Updates of this stack are kept, the
    /// newest; older ones are deleted with their outputs Secrets when the next one finishes.
    /// Defaults to 10. The Updates the status names (current and last) are always kept.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = 1000))]
    pub update_history_limit: Option<i32>,
    /// DriftDetection runs a refresh that changes nothing (`pulumi refresh --preview-only`) on
    /// a schedule, and reports what changed outside Pulumi in the `DriftDetected` condition
    /// (the shape of PKO's draft, PKO #1037).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub drift_detection: Option<DriftDetectionSpec>,
    /// (pko-rs) Approval gates every up on a person's approval of its plan: each change first
    /// runs a preview that saves an update plan, summarised in `status.approval`, and the up
    /// runs that plan once its ID is approved with the `pko-rs.dev/approve-plan` annotation.
    /// A destroy is not gated.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub approval: Option<ApprovalSpec>,
}

/// The approval gate.
#[derive(Serialize, Deserialize, JsonSchema, Clone, Debug, PartialEq, Default)]
#[serde(rename_all = "camelCase")]
pub struct ApprovalSpec {
    /// Required turns the gate on (the default); `false` turns it off without removing it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub required: Option<bool>,
}

/// Pattern of a drift schedule's `cron`: five fields (or an `@` macro), after an optional
/// `CRON_TZ=<zone> `. The controller parses the fields themselves and reports a bad one.
pub const CRON_PATTERN: &str =
    r"^(CRON_TZ=[A-Za-z0-9_+/-]+[ \t]+)?(@[a-z]+|[^ \t]+([ \t]+[^ \t]+){4})$";

/// When drift checks run.
#[derive(Serialize, Deserialize, JsonSchema, Clone, Debug, PartialEq, Default)]
#[serde(rename_all = "camelCase")]
pub struct DriftDetectionSpec {
    /// Schedules of the checks: a check runs when any of them ticks.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 16), extend("x-kubernetes-list-type" = "atomic"))]
    pub schedules: Vec<DriftSchedule>,
}

/// One drift-check schedule.
#[derive(Serialize, Deserialize, JsonSchema, Clone, Debug, PartialEq, Default)]
#[serde(rename_all = "camelCase")]
pub struct DriftSchedule {
    /// Cron is a standard 5-field cron expression (minute hour day-of-month month
    /// day-of-week), in UTC unless prefixed with `CRON_TZ=<IANA zone> `, e.g.
    /// `CRON_TZ=Europe/Paris 0 9 * * MON-FRI`.
    #[schemars(length(min = 1, max = 256), regex(pattern = CRON_PATTERN))]
    pub cron: String,
    /// AutoRemediate runs an `up` when a check of this schedule finds drift, putting the
    /// resources back as the program declares them. Defaults to false: drift is only reported.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub auto_remediate: Option<bool>,
}

impl StackSpec {
    /// A spec for the stack `stack` with everything else unset.
    pub fn new(stack: &str) -> Self {
        Self {
            stack: stack.to_owned(),
            ..Default::default()
        }
    }
}

/// ConfigMapRef identifies information to load from a Kubernetes ConfigMap.
#[derive(Serialize, Deserialize, JsonSchema, Clone, Debug, PartialEq, Default)]
#[serde(rename_all = "camelCase")]
pub struct ConfigMapRef {
    /// Name of the ConfigMap
    #[schemars(length(min = 1, max = 253), regex(pattern = crate::names::DNS1123_SUBDOMAIN))]
    pub name: String,
    /// Key within the ConfigMap to use
    pub key: String,
    /// JSON indicates the referenced value should be parsed as JSON (structured data);
    /// otherwise it is a raw string.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub json: Option<bool>,
}

/// Git authentication options; each credential is a [`ResourceRef`] (only `Secret` works in v2).
#[derive(Serialize, Deserialize, JsonSchema, Clone, Debug, PartialEq, Default)]
#[serde(rename_all = "camelCase")]
pub struct GitAuthConfig {
    /// Personal access token.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub access_token: Option<ResourceRef>,
    /// SSH private key and its optional password.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ssh_auth: Option<SshAuth>,
    /// Basic auth username and password.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub basic_auth: Option<BasicAuth>,
    /// GitHub App credentials; an installation token is minted from them.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub github_app: Option<GitHubAppAuth>,
}

/// SSHAuth configures ssh-based auth for git authentication. SSHPrivateKey is required but
/// password is optional.
#[derive(Serialize, Deserialize, JsonSchema, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct SshAuth {
    /// The SSH private key.
    pub ssh_private_key: ResourceRef,
    /// The password of the private key, if it has one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub password: Option<ResourceRef>,
}

/// BasicAuth configures git authentication through basic auth, i.e. username and password.
/// Both UserName and Password are required.
#[derive(Serialize, Deserialize, JsonSchema, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct BasicAuth {
    /// The user name.
    pub user_name: ResourceRef,
    /// The password.
    pub password: ResourceRef,
}

/// GitHubAppAuth configures GitHub App-based authentication.
#[derive(Serialize, Deserialize, JsonSchema, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct GitHubAppAuth {
    /// AppID is the GitHub App ID.
    #[serde(rename = "appID")]
    pub app_id: ResourceRef,
    /// InstallationID is the GitHub App installation ID.
    #[serde(rename = "installationID")]
    pub installation_id: ResourceRef,
    /// PrivateKey is the PEM-encoded RSA private key of the GitHub App.
    pub private_key: ResourceRef,
}

/// FluxSource specifies how to fetch source code from a Flux source object.
#[derive(Serialize, Deserialize, JsonSchema, Clone, Debug, PartialEq, Default)]
#[serde(rename_all = "camelCase")]
pub struct FluxSource {
    /// The Flux source object (e.g. a GitRepository) whose artifact is deployed.
    pub source_ref: FluxSourceReference,
    /// Dir gives the subdirectory containing the Pulumi project (i.e., containing
    /// Pulumi.yaml) of interest, within the fetched source.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 4096), regex(pattern = crate::common::PLAIN_PATH))]
    pub dir: Option<String>,
}

/// Reference to a Flux source object in the Stack's namespace.
#[derive(Serialize, Deserialize, JsonSchema, Clone, Debug, PartialEq, Default)]
#[serde(rename_all = "camelCase")]
pub struct FluxSourceReference {
    /// API version of the source, e.g. `source.toolkit.fluxcd.io/v1`: `group/version`, the
    /// group a DNS subdomain. The operator builds a request path from it, so nothing else
    /// (no second `/`, no `?`, `#` or `%`) is accepted.
    #[schemars(
        length(min = 3, max = 317),
        regex(
            pattern = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/v[1-9][0-9]*((alpha|beta)[1-9][0-9]*)?$"
        )
    )]
    pub api_version: String,
    /// Kind of the source: one of the Flux kinds that carry `status.artifact`.
    #[schemars(extend("enum" = FLUX_SOURCE_KINDS))]
    pub kind: String,
    /// Name of the source (a DNS-1123 subdomain).
    #[schemars(length(min = 1, max = 253), regex(pattern = crate::names::DNS1123_SUBDOMAIN))]
    pub name: String,
}

/// The Flux kinds whose objects carry a `status.artifact` a Stack may deploy.
pub const FLUX_SOURCE_KINDS: [&str; 6] = [
    "GitRepository",
    "OCIRepository",
    "Bucket",
    "HelmChart",
    "HelmRepository",
    "ExternalArtifact",
];

/// Reference to a Program in the Stack's namespace.
#[derive(Serialize, Deserialize, JsonSchema, Clone, Debug, PartialEq, Default)]
#[serde(rename_all = "camelCase")]
pub struct ProgramReference {
    /// Name of the Program.
    #[schemars(length(min = 1, max = 253), regex(pattern = crate::names::DNS1123_SUBDOMAIN))]
    pub name: String,
}

/// PrerequisiteRef refers to another stack, and gives requirements for the prerequisite to
/// be considered satisfied.
#[derive(Serialize, Deserialize, JsonSchema, Clone, Debug, PartialEq, Default)]
#[serde(rename_all = "camelCase")]
pub struct PrerequisiteRef {
    /// Name is the name of the Stack resource that is a prerequisite.
    #[schemars(length(min = 1, max = 253), regex(pattern = crate::names::DNS1123_SUBDOMAIN))]
    pub name: String,
    /// Requirement gives specific requirements for the prerequisite; the base requirement is
    /// that the referenced stack is in a successful state.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub requirement: Option<RequirementSpec>,
}

/// Requirements a prerequisite stack must meet.
#[derive(Serialize, Deserialize, JsonSchema, Clone, Debug, PartialEq, Default)]
#[serde(rename_all = "camelCase")]
pub struct RequirementSpec {
    /// SucceededWithinDuration gives a duration within which the prerequisite must have
    /// reached a succeeded state; e.g., "1h" means "the prerequisite must be successful, and
    /// have become so in the last hour".
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub succeeded_within_duration: Option<String>,
}

/// Whether a Stack's Workspace is kept after a successful update.
#[derive(Serialize, Deserialize, JsonSchema, Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub enum WorkspaceReclaimPolicy {
    /// Keep the workspace (and its pod) running between updates.
    #[default]
    Retain,
    /// Delete the workspace after a successful update.
    Delete,
}

/// A Workspace apply configuration, strategic-merge-patched onto the Stack's Workspace.
#[derive(Serialize, Deserialize, JsonSchema, Clone, Debug, PartialEq, Default)]
#[serde(rename_all = "camelCase")]
pub struct EmbeddedWorkspaceTemplateSpec {
    /// API version (ignored; the Workspace's own is used).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub api_version: Option<String>,
    /// Kind (ignored).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kind: Option<String>,
    /// Metadata to merge into the Workspace's (labels, annotations, ...).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub metadata: Option<ObjectMetaApply>,
    /// Spec fields to merge into the Workspace's spec.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub spec: Option<WorkspaceSpecApply>,
    /// Status (accepted for compatibility; not used).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub status: Option<WorkspaceStatusApply>,
}

/// An Update apply configuration, strategic-merge-patched onto the Stack's Updates.
#[derive(Serialize, Deserialize, JsonSchema, Clone, Debug, PartialEq, Default)]
#[serde(rename_all = "camelCase")]
pub struct EmbeddedUpdateTemplateSpec {
    /// API version (ignored; the Update's own is used).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub api_version: Option<String>,
    /// Kind (ignored).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kind: Option<String>,
    /// Metadata to merge into the Update's (labels, annotations, ...).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub metadata: Option<ObjectMetaApply>,
    /// Spec fields to merge into the Update's spec.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub spec: Option<UpdateSpecApply>,
    /// Status (accepted for compatibility; not used).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub status: Option<UpdateStatusApply>,
}

/// Update status in a template (every field optional).
#[derive(Serialize, Deserialize, JsonSchema, Clone, Debug, PartialEq, Default)]
#[serde(rename_all = "camelCase")]
pub struct UpdateStatusApply {
    /// Generation the status was computed for.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,
    /// Start of the operation.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub start_time: Option<Time>,
    /// End of the operation.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub end_time: Option<Time>,
    /// Pulumi Cloud permalink of the operation.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub permalink: Option<String>,
    /// Result message.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub message: Option<String>,
    /// Name of the Secret holding the stack outputs.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub outputs: Option<String>,
    /// Conditions of the Update.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub conditions: Vec<ConditionApply>,
    /// Project name and runtime seen by the agent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub project_info: Option<crate::common::ProjectInfoApply>,
}

/// StackStatus defines the observed state of Stack
#[derive(Serialize, Deserialize, JsonSchema, Clone, Debug, PartialEq, Default)]
#[serde(rename_all = "camelCase")]
pub struct StackStatus {
    /// ObservedGeneration records the value of .meta.generation at the point the controller
    /// last processed this object.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,
    /// ObservedReconcileRequest records the value of the annotation named by
    /// `pulumi.com/reconciliation-request` at the point the controller last processed this
    /// object.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_reconcile_request: Option<String>,
    /// Outputs contains the exported stack output variables resulting from a deployment
    /// (secret outputs are shown as `[secret]`).
    #[serde(
        default,
        skip_serializing_if = "BTreeMap::is_empty",
        deserialize_with = "crate::decode::tolerant_values"
    )]
    pub outputs: BTreeMap<String, Value>,
    /// LastUpdate contains details of the status of the last update.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_update: Option<StackUpdateState>,
    /// CurrentUpdate contains details of the status of the current update, if any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub current_update: Option<CurrentStackUpdate>,
    /// Conditions of the Stack (`Ready`, `Reconciling`, `Stalled`), kstatus-compatible.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(extend(
        "x-kubernetes-list-type" = "map",
        "x-kubernetes-list-map-keys" = ["type"],
    ))]
    pub conditions: Vec<Condition>,
    /// ProjectInfo records the Pulumi project name and runtime observed during the last
    /// successful update, so the stack can be destroyed without its source.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub project_info: Option<ProjectInfo>,
    /// DriftDetection records the drift checks (`spec.driftDetection`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub drift_detection: Option<DriftDetectionStatus>,
    /// Approval records the plan awaiting approval (`spec.approval`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub approval: Option<ApprovalStatus>,
}

/// The approval gate's plans.
#[derive(Serialize, Deserialize, JsonSchema, Clone, Debug, PartialEq, Default)]
#[serde(rename_all = "camelCase")]
pub struct ApprovalStatus {
    /// PlanID is the ID of the current plan (the name of the preview Update that made it):
    /// approve it by setting the `pko-rs.dev/approve-plan` annotation to it.
    #[serde(default, rename = "planID", skip_serializing_if = "Option::is_none")]
    pub plan_id: Option<String>,
    /// Summary says what the plan would do, once its preview succeeded.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub summary: Option<crate::update::PlanSummary>,
    /// Failed is why the plan's preview failed, if it did.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub failed: Option<String>,
    /// Commit is the source commit the plan was made on.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub commit: Option<String>,
    /// Generation is the Stack generation the plan was made on.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub generation: Option<i64>,
    /// ReconcileRequest is the reconcile request the plan was made on.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reconcile_request: Option<String>,
    /// Reason is why the update is needed (what the up will say).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
    /// Remediation says the plan remediates drift (its preview and up refresh first).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub remediation: Option<bool>,
    /// Applied is the ID of the last plan approved and run.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub applied: Option<String>,
    /// Refused is the ID of the last plan whose approval was refused: the stack changed since
    /// it was made, or the workspace no longer held it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub refused: Option<String>,
    /// Refusal says why that approval was refused.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub refusal: Option<String>,
}

/// What the drift checks found.
#[derive(Serialize, Deserialize, JsonSchema, Clone, Debug, PartialEq, Default)]
#[serde(rename_all = "camelCase")]
pub struct DriftDetectionStatus {
    /// LastCheckTime is when the last drift check started; the next runs at the first tick of
    /// a schedule after it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_check_time: Option<Time>,
    /// CurrentCheck names the Update of the drift check in flight, if any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub current_check: Option<String>,
    /// LastCheck names the Update of the last finished drift check.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_check: Option<String>,
    /// Schedule is the `cron` of the schedule that started the current or last check.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub schedule: Option<String>,
    /// ChangeCount is how many resources the last check found changed outside Pulumi.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub change_count: Option<i64>,
    /// ChangedResources names the first of them (URNs, at most 20).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(extend("x-kubernetes-list-type" = "atomic"))]
    pub changed_resources: Vec<String>,
}

/// StackUpdateState is the status of a stack update
#[derive(Serialize, Deserialize, JsonSchema, Clone, Debug, PartialEq, Default)]
#[serde(rename_all = "camelCase")]
pub struct StackUpdateState {
    /// Generation is the stack generation associated with the update.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub generation: Option<i64>,
    /// ReconcileRequest is the stack reconcile request associated with the update.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reconcile_request: Option<String>,
    /// Name is the name of the update object.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    /// Type is the type of update (`preview`, `up`, `destroy`, `refresh`).
    #[serde(default, rename = "type", skip_serializing_if = "Option::is_none")]
    pub type_: Option<String>,
    /// State is the state of the stack update: `succeeded` or `failed`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub state: Option<String>,
    /// Message is the message surfacing any errors or additional information about the
    /// update.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub message: Option<String>,
    /// Last commit attempted
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_attempted_commit: Option<String>,
    /// Last commit successfully applied
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_successful_commit: Option<String>,
    /// Permalink is the Pulumi Console URL of the stack operation.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub permalink: Option<String>,
    /// LastResyncTime contains a timestamp for the last time a resync of the stack took
    /// place.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_resync_time: Option<Time>,
    /// Failures records how many times the update has been attempted and failed; used for
    /// exponential backoff.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub failures: Option<i64>,
}

/// The update in progress, if any.
#[derive(Serialize, Deserialize, JsonSchema, Clone, Debug, PartialEq, Default)]
#[serde(rename_all = "camelCase")]
pub struct CurrentStackUpdate {
    /// Generation is the stack generation associated with the update.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub generation: Option<i64>,
    /// ReconcileRequest is the stack reconcile request associated with the update.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reconcile_request: Option<String>,
    /// Name is the name of the update object.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    /// Commit is the commit SHA of the planned update.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub commit: Option<String>,
}

/// `stacks.pulumi.com/v1alpha1`: deprecated, served for old clients; same spec as `v1`.
pub mod v1alpha1 {
    use std::collections::BTreeMap;

    use schemars::JsonSchema;
    use serde::{Deserialize, Serialize};
    use serde_json::Value;

    use super::StackUpdateState;
    use crate::common::custom_resource;

    pub use super::StackSpec;

    custom_resource! {
        /// Stack is the Schema for the stacks API.
        /// Deprecated: Note Stacks from pulumi.com/v1alpha1 is deprecated in favor of
        /// pulumi.com/v1. It is completely backward compatible. Users are strongly encouraged
        /// to switch to pulumi.com/v1.
        root Stack {
            group: "pulumi.com",
            version: "v1alpha1",
            kind: "Stack",
            plural: "stacks",
            /// Desired state of the stack.
            spec: StackSpec,
            status: StackStatus,
            crd: super::stack_crd,
        }
    }

    /// StackStatus defines the observed state of Stack (v1alpha1: outputs and last update
    /// only).
    #[derive(Serialize, Deserialize, JsonSchema, Clone, Debug, PartialEq, Default)]
    #[serde(rename_all = "camelCase")]
    pub struct StackStatus {
        /// Outputs contains the exported stack output variables resulting from a deployment.
        #[serde(
            default,
            skip_serializing_if = "BTreeMap::is_empty",
            deserialize_with = "crate::decode::tolerant_values"
        )]
        pub outputs: BTreeMap<String, Value>,
        /// LastUpdate contains details of the status of the last update.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        pub last_update: Option<StackUpdateState>,
    }
}

/// The `stacks.pulumi.com` CRD (`v1` storage + `v1alpha1`). Panics only if schema generation
/// is broken (tested).
pub fn stack_crd() -> CustomResourceDefinition {
    try_stack_crd().unwrap_or_else(|e| panic!("pko-api CRD generation is broken: {e}"))
}

/// The `stacks.pulumi.com` CRD (`v1` storage + `v1alpha1`).
pub fn try_stack_crd() -> Result<CustomResourceDefinition, Error> {
    let v1 = root_schema::<StackSpec, StackStatus>(RootSchema {
        description: "Stack is the Schema for the stacks API",
        spec_key: "spec",
        spec_required: true,
        validations: vec![json!({
            "rule": NAME_LENGTH_RULE,
            "message": NAME_LENGTH_MESSAGE,
        })],
    })?;
    let v1 = version(
        "v1",
        true,
        vec![
            column("Stack", "string", ".spec.stack", Some(10)),
            column("Last Update", "string", ".status.lastUpdate.state", None),
            column("Age", "date", ".status.lastUpdate.lastResyncTime", None),
            column(
                "Last Commit",
                "string",
                ".status.lastUpdate.lastAttemptedCommit",
                Some(10),
            ),
            column(
                "Ready",
                "string",
                ".status.conditions[?(@.type==\"Ready\")].status",
                None,
            ),
            column(
                "Reconciling",
                "string",
                ".status.conditions[?(@.type==\"Reconciling\")].reason",
                None,
            ),
            column(
                "Stalled",
                "string",
                ".status.conditions[?(@.type==\"Stalled\")].reason",
                None,
            ),
            column("Permalink", "string", ".status.lastUpdate.permalink", None),
        ],
        v1,
    );

    let v1alpha1 = root_schema::<StackSpec, v1alpha1::StackStatus>(RootSchema {
        description: "Stack is the Schema for the stacks API.\nDeprecated: Note Stacks from pulumi.com/v1alpha1 is deprecated in favor of pulumi.com/v1.\nIt is completely backward compatible. Users are strongly encouraged to switch to pulumi.com/v1.",
        spec_key: "spec",
        spec_required: true,
        validations: vec![],
    })?;
    let mut v1alpha1 = version("v1alpha1", false, vec![], v1alpha1);
    v1alpha1.deprecated = Some(true);
    v1alpha1.deprecation_warning =
        Some("pulumi.com/v1alpha1 Stack is deprecated; use pulumi.com/v1 Stack".to_owned());

    // One CRD per version, merged the way kube does it for derived kinds.
    let merged = kube::core::crd::merge_crds(
        vec![
            crd("pulumi.com", "Stack", "stacks", vec![v1]),
            crd("pulumi.com", "Stack", "stacks", vec![v1alpha1]),
        ],
        "v1",
    )?;
    Ok(merged)
}
