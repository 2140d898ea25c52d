//! `workspaces.auto.pulumi.com/v1alpha1`: an execution context (a pod running the agent) for one
//! Pulumi project and its stacks.

use k8s_openapi::api::core::v1::{
    EnvFromSource, EnvVar, PodSpec, ResourceRequirements, SecretKeySelector,
};
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};

use crate::Error;
use crate::common::{
    Condition, ConditionApply, EmbeddedObjectMeta, ProjectInfo, ProjectInfoApply, custom_resource,
};
use crate::crd::{RootSchema, column, crd, root_schema, version};

custom_resource! {
    /// Workspace is the Schema for the workspaces API
    /// A Workspace is an execution context containing a single Pulumi project, a program, and
    /// multiple stacks.
    root Workspace {
        group: "auto.pulumi.com",
        version: "v1alpha1",
        kind: "Workspace",
        plural: "workspaces",
        /// Desired state of the workspace.
        spec: WorkspaceSpec,
        status: WorkspaceStatus,
        crd: workspace_crd,
    }
}

/// Longest Workspace name: its StatefulSet `<name>-workspace` puts
/// `controller-revision-hash: <name>-workspace-<10-char hash>` on its pod, a label value of at
/// most 63 characters (the limit of the Stack name in PKO, for the same reason).
pub const NAME_MAX_LENGTH: usize = 42;
/// CEL rule on the root: the name fits [`NAME_MAX_LENGTH`].
pub const NAME_LENGTH_RULE: &str = "size(self.metadata.name) <= 42";
/// Message of [`NAME_LENGTH_RULE`].
pub const NAME_LENGTH_MESSAGE: &str = "Workspace name must be no more than 42 characters in length: its StatefulSet <name>-workspace and the pod's controller-revision-hash label must fit in 63 characters.";
/// CEL rule on the root: the name is a DNS-1035 label, as the Service `<name>-workspace` must
/// be, and as the `auto.pulumi.com/workspace-name` label value must end.
pub const NAME_FORMAT_RULE: &str = "self.metadata.name.matches('^[a-z]([-a-z0-9]*[a-z0-9])?$')";
/// Message of [`NAME_FORMAT_RULE`].
pub const NAME_FORMAT_MESSAGE: &str = "Workspace name must consist of lowercase letters, digits and '-', start with a letter and end with a letter or digit (its Service <name>-workspace must be a DNS-1035 label).";

/// Why `name` cannot name a Workspace ([`NAME_LENGTH_RULE`], [`NAME_FORMAT_RULE`]), if it cannot.
pub fn name_problem(name: &str) -> Option<&'static str> {
    let b = name.as_bytes();
    let inner_ok = b
        .iter()
        .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || *c == b'-');
    let ends_ok = b.first().is_some_and(u8::is_ascii_lowercase)
        && b.last()
            .is_some_and(|c| c.is_ascii_lowercase() || c.is_ascii_digit());
    if !(inner_ok && ends_ok) {
        Some(NAME_FORMAT_MESSAGE)
    } else if name.len() > NAME_MAX_LENGTH {
        Some(NAME_LENGTH_MESSAGE)
    } else {
        None
    }
}

/// Default `serviceAccountName` of a Workspace, as in PKO.
pub const DEFAULT_SERVICE_ACCOUNT_NAME: &str = "default";

/// WorkspaceSpec defines the desired state of Workspace
#[derive(Serialize, Deserialize, JsonSchema, Clone, Debug, PartialEq, Default)]
#[serde(rename_all = "camelCase")]
pub struct WorkspaceSpec {
    /// ServiceAccountName is the Kubernetes service account identity of the workspace.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(extend("default" = DEFAULT_SERVICE_ACCOUNT_NAME))]
    #[schemars(length(min = 1, max = 253), regex(pattern = crate::names::DNS1123_SUBDOMAIN))]
    pub service_account_name: Option<String>,
    /// SecurityProfile applies a security profile to the workspace. The restricted profile
    /// (default) runs the pod as a non-root user and with a security context that conforms
    /// with the Restricted policy of the Pod Security Standards. The baseline profile runs the
    /// pod as the root user and with a security context that conforms with the Baseline policy
    /// of the Pod Security Standards.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(extend("default" = "restricted"))]
    pub security_profile: Option<SecurityProfile>,
    /// Image is the container image containing the 'pulumi' executable. If no image is
    /// provided, the default image is used based on the securityProfile: for 'baseline', it
    /// defaults to 'pulumi/pulumi:latest'; for 'restricted', it defaults to
    /// 'pulumi/pulumi:latest-nonroot'.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub image: Option<String>,
    /// Image pull policy. One of Always, Never, IfNotPresent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub image_pull_policy: Option<String>,
    /// Git is the git source containing the Pulumi program.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub git: Option<GitSource>,
    /// Flux is the flux source containing the Pulumi program.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub flux: Option<FluxSource>,
    /// Local is the local source containing the Pulumi program.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub local: Option<LocalSource>,
    /// ProjectInfo instructs the workspace to bypass source fetching entirely and bootstrap
    /// with a minimal Pulumi.yaml derived from the project-info fields. This is used by the
    /// Stack controller to destroy a stack when the upstream source artifact is unavailable.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub project_info: Option<ProjectInfo>,
    /// List of sources to populate environment variables in the workspace.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(extend("x-kubernetes-list-type" = "atomic"))]
    pub env_from: Vec<EnvFromSource>,
    /// List of environment variables to set in the container.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(extend(
        "x-kubernetes-list-type" = "map",
        "x-kubernetes-list-map-keys" = ["name"],
    ))]
    pub env: Vec<EnvVar>,
    /// Compute Resources required by this workspace.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub resources: Option<ResourceRequirements>,
    /// PodTemplate defines a PodTemplateSpec for Workspace's pods.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pod_template: Option<EmbeddedPodTemplateSpec>,
    /// ServiceTemplate defines a template for the Workspace's Service metadata. Use this to
    /// add annotations or labels to the headless Service that fronts the Workspace's pods.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub service_template: Option<EmbeddedServiceTemplateSpec>,
    /// PulumiLogVerbosity is the log verbosity level to use for the Pulumi CLI. If unset,
    /// verbose logging is disabled.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pulumi_log_level: Option<i32>,
    /// List of stacks this workspace manages.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(extend(
        "x-kubernetes-list-type" = "map",
        "x-kubernetes-list-map-keys" = ["name"],
    ))]
    pub stacks: Vec<WorkspaceStack>,
    /// pko-rs only (PKO has no such field): Idle stops the workspace's pod (its StatefulSet is
    /// scaled to 0) once no operation has run for `after`, and starts it again when an Update
    /// needs it. While stopped the workspace is `Ready=False` with reason `Idle`, which is not
    /// an error: nothing is reconciling or stalled. Unset: the pod runs for as long as the
    /// workspace exists, as in PKO.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub idle: Option<IdleSpec>,
}

/// Pattern of `idle.after`: a Go duration of whole units (`90s`, `10m`, `1h30m`).
pub const IDLE_AFTER_PATTERN: &str = r"^([0-9]+(\.[0-9]+)?(ns|us|µs|ms|s|m|h))+$";

/// When an idle workspace's pod is stopped.
#[derive(Serialize, Deserialize, JsonSchema, Clone, Debug, PartialEq, Default)]
#[serde(rename_all = "camelCase")]
pub struct IdleSpec {
    /// After is how long the workspace stays up with no operation (since the last one ended, or
    /// since it became ready) before its pod is stopped: a Go duration such as `10m`.
    #[schemars(length(min = 1, max = 64), regex(pattern = IDLE_AFTER_PATTERN))]
    pub after: String,
}

/// Security profile of the workspace pod.
#[derive(Serialize, Deserialize, JsonSchema, Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
#[serde(rename_all = "lowercase")]
pub enum SecurityProfile {
    /// Runs the pod as root, conforming to the Baseline Pod Security Standard.
    Baseline,
    /// Runs the pod as non-root, conforming to the Restricted Pod Security Standard.
    #[default]
    Restricted,
}

/// GitSource specifies how to fetch from a git repository directly.
#[derive(Serialize, Deserialize, JsonSchema, Clone, Debug, PartialEq, Default)]
#[serde(rename_all = "camelCase")]
pub struct GitSource {
    /// URL is the git source control repository from which we fetch the project code and
    /// configuration.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 2048), regex(pattern = crate::common::NO_SPACE))]
    pub url: Option<String>,
    /// Ref is the git ref (tag, branch, or commit SHA) to fetch.
    #[serde(default, rename = "ref", skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 1024), regex(pattern = crate::common::GIT_REF))]
    pub ref_: Option<String>,
    /// Dir is the directory to work from in the project's source repository where
    /// Pulumi.yaml is located.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 4096), regex(pattern = crate::common::PLAIN_PATH))]
    pub dir: Option<String>,
    /// Auth contains optional authentication information to use when cloning the
    /// repository.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub auth: Option<GitAuth>,
    /// Shallow controls whether the workspace uses a shallow clone or whether all history is
    /// cloned.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub shallow: Option<bool>,
}

/// GitAuth specifies git authentication configuration options. There are 3 different
/// authentication options: SSH private key (and its optional password), personal access
/// token, basic auth username and password, plus GitHub App credentials.
#[derive(Serialize, Deserialize, JsonSchema, Clone, Debug, PartialEq, Default)]
#[serde(rename_all = "camelCase")]
pub struct GitAuth {
    /// SSHPrivateKey should contain a private key for access to the git repo. When using
    /// `SSHPrivateKey`, the URL of the repository must be in the format
    /// git@github.com:org/repository.git.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ssh_private_key: Option<SecretKeySelector>,
    /// Username is the username to use when authenticating to a git repository.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub username: Option<SecretKeySelector>,
    /// The password that pairs with a username or as part of an SSH Private Key.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub password: Option<SecretKeySelector>,
    /// Token is a Git personal access token in replacement of your password.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub token: Option<SecretKeySelector>,
    /// GitHubApp configures GitHub App-based authentication.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub github_app: Option<GitHubAppAuth>,
}

/// GitHub App credentials, each stored in a Secret.
#[derive(Serialize, Deserialize, JsonSchema, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct GitHubAppAuth {
    /// AppID is a reference to the GitHub App ID (stored as a string) in a Kubernetes
    /// Secret.
    #[serde(rename = "appID")]
    pub app_id: SecretKeySelector,
    /// InstallationID is a reference to the GitHub App installation ID (stored as a string)
    /// in a Kubernetes Secret.
    #[serde(rename = "installationID")]
    pub installation_id: SecretKeySelector,
    /// PrivateKey is a reference to the PEM-encoded RSA private key of the GitHub App in a
    /// Kubernetes Secret.
    pub private_key: SecretKeySelector,
}

/// FluxSource specifies how to fetch a Flux-style artifact (a gzipped tarball).
#[derive(Serialize, Deserialize, JsonSchema, Clone, Debug, PartialEq, Default)]
#[serde(rename_all = "camelCase")]
pub struct FluxSource {
    /// URL is the URL of the artifact to fetch.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 4096), regex(pattern = crate::common::NO_SPACE))]
    pub url: Option<String>,
    /// Digest is the digest of the artifact to fetch.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub digest: Option<String>,
    /// Dir gives the subdirectory containing the Pulumi project (i.e., containing
    /// Pulumi.yaml) of interest, within the fetched artifact.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 4096), regex(pattern = crate::common::PLAIN_PATH))]
    pub dir: Option<String>,
}

/// LocalSource specifies how to use a source already present in the workspace image.
#[derive(Serialize, Deserialize, JsonSchema, Clone, Debug, PartialEq, Default)]
#[serde(rename_all = "camelCase")]
pub struct LocalSource {
    /// Dir gives the subdirectory containing the Pulumi project (i.e., containing
    /// Pulumi.yaml) of interest, within the workspace image.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 4096), regex(pattern = crate::common::PLAIN_PATH))]
    pub dir: Option<String>,
}

/// A pod template embedded in the Workspace; strategic-merge-patched onto the generated pod.
#[derive(Serialize, Deserialize, JsonSchema, Clone, Debug, PartialEq, Default)]
#[serde(rename_all = "camelCase")]
pub struct EmbeddedPodTemplateSpec {
    /// Labels and annotations of the pod.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub metadata: Option<EmbeddedObjectMeta>,
    /// Specification of the desired behavior of the pod.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub spec: Option<PodSpec>,
}

/// Metadata template for the Workspace's headless Service.
#[derive(Serialize, Deserialize, JsonSchema, Clone, Debug, PartialEq, Default)]
#[serde(rename_all = "camelCase")]
pub struct EmbeddedServiceTemplateSpec {
    /// Metadata contains the labels and annotations to apply to the Service.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub metadata: Option<EmbeddedObjectMeta>,
}

/// A stack the workspace creates or selects when it starts.
#[derive(Serialize, Deserialize, JsonSchema, Clone, Debug, PartialEq, Default)]
#[serde(rename_all = "camelCase")]
pub struct WorkspaceStack {
    /// Name of the stack.
    pub name: String,
    /// Create the stack if it does not exist.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub create: Option<bool>,
    /// SecretsProvider is the name of the secret provider to use for the stack.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub secrets_provider: Option<String>,
    /// Config is a list of confguration values to set on the stack.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(extend(
        "x-kubernetes-list-type" = "map",
        "x-kubernetes-list-map-keys" = ["key"],
    ))]
    pub config: Vec<ConfigItem>,
    /// Environment is a list of Pulumi ESC environments to import into the stack.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(extend("x-kubernetes-list-type" = "atomic"))]
    pub environment: Vec<String>,
}

/// A config value of a workspace stack.
#[derive(Serialize, Deserialize, JsonSchema, Clone, Debug, PartialEq, Default)]
#[serde(rename_all = "camelCase")]
#[schemars(extend("x-kubernetes-map-type" = "atomic"))]
pub struct ConfigItem {
    /// Key is the configuration key or path to set.
    pub key: String,
    /// Path indicates the key contains a path to a property in a map or list. Incompatible
    /// with structured values (objects, arrays).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub path: Option<bool>,
    /// Value is the configuration value to set. Supports strings, numbers, booleans, objects,
    /// and arrays.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub value: Option<Value>,
    /// ValueFrom is a reference to a value from the environment or from a file.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub value_from: Option<ConfigValueFrom>,
    /// Secret marks the configuration value as a secret.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub secret: Option<bool>,
}

/// Where a config value is read from inside the workspace pod.
#[derive(Serialize, Deserialize, JsonSchema, Clone, Debug, PartialEq, Default)]
#[serde(rename_all = "camelCase")]
#[schemars(extend("x-kubernetes-map-type" = "atomic"))]
pub struct ConfigValueFrom {
    /// Env is an environment variable in the pulumi container to use as the value.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub env: Option<String>,
    /// Path is a path to a file in the pulumi container containing the value.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub path: Option<String>,
    /// JSON indicates that the value is JSON (structured config).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub json: Option<bool>,
}

/// WorkspaceStatus defines the observed state of Workspace
#[derive(Serialize, Deserialize, JsonSchema, Clone, Debug, PartialEq, Default)]
#[serde(rename_all = "camelCase")]
pub struct WorkspaceStatus {
    /// observedGeneration represents the .metadata.generation that the status was set based
    /// upon.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 0))]
    pub observed_generation: Option<i64>,
    /// Address is the gRPC address of the workspace's agent (`<ws>-workspace.<ns>:50051`);
    /// empty while the workspace is not ready.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub address: Option<String>,
    /// PulumiVersion is the version of the Pulumi CLI in the workspace.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pulumi_version: Option<String>,
    /// Represents the observations of a workspace's current state.
    /// Known .status.conditions.type are: "Ready", "Reconciling", "Stalled"
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(extend(
        "x-kubernetes-list-type" = "map",
        "x-kubernetes-list-map-keys" = ["type"],
    ))]
    pub conditions: Vec<Condition>,
}

/// Workspace spec fields of a Stack's workspace template. Every field is optional and has no
/// default, so a template only overrides what it states.
#[derive(Serialize, Deserialize, JsonSchema, Clone, Debug, PartialEq, Default)]
#[serde(rename_all = "camelCase")]
pub struct WorkspaceSpecApply {
    /// Service account of the workspace pod.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub service_account_name: Option<String>,
    /// Security profile of the workspace pod (`baseline` or `restricted`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub security_profile: Option<SecurityProfile>,
    /// Image containing the `pulumi` executable.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub image: Option<String>,
    /// Image pull policy.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub image_pull_policy: Option<String>,
    /// Git source.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub git: Option<GitSourceApply>,
    /// Flux source.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub flux: Option<FluxSource>,
    /// Local source.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub local: Option<LocalSource>,
    /// Project info (bypasses source fetching).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub project_info: Option<ProjectInfoApply>,
    /// Environment sources of the pulumi container.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub env_from: Vec<EnvFromSource>,
    /// Environment variables of the pulumi container.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub env: Vec<EnvVar>,
    /// Compute resources of the pulumi container.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub resources: Option<ResourceRequirements>,
    /// Pod template.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pod_template: Option<EmbeddedPodTemplateSpec>,
    /// Service metadata template.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub service_template: Option<EmbeddedServiceTemplateSpec>,
    /// Pulumi CLI log verbosity.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pulumi_log_level: Option<i32>,
    /// Stacks of the workspace.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub stacks: Vec<WorkspaceStackApply>,
    /// Stops the workspace's pod after a period with no operation (pko-rs only).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub idle: Option<IdleSpec>,
}

/// Git source of the workspace template (every field optional).
#[derive(Serialize, Deserialize, JsonSchema, Clone, Debug, PartialEq, Default)]
#[serde(rename_all = "camelCase")]
pub struct GitSourceApply {
    /// Repository URL.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub url: Option<String>,
    /// Git ref.
    #[serde(default, rename = "ref", skip_serializing_if = "Option::is_none")]
    pub ref_: Option<String>,
    /// Project directory.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dir: Option<String>,
    /// Credentials.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub auth: Option<GitAuthApply>,
    /// Shallow clone.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub shallow: Option<bool>,
}

/// Git credentials of the workspace template (every field optional).
#[derive(Serialize, Deserialize, JsonSchema, Clone, Debug, PartialEq, Default)]
#[serde(rename_all = "camelCase")]
pub struct GitAuthApply {
    /// SSH private key.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ssh_private_key: Option<SecretKeySelector>,
    /// Username.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub username: Option<SecretKeySelector>,
    /// Password.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub password: Option<SecretKeySelector>,
    /// Personal access token.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub token: Option<SecretKeySelector>,
    /// GitHub App credentials.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub github_app: Option<GitHubAppAuthApply>,
}

/// GitHub App credentials of the workspace template (every field optional).
#[derive(Serialize, Deserialize, JsonSchema, Clone, Debug, PartialEq, Default)]
#[serde(rename_all = "camelCase")]
pub struct GitHubAppAuthApply {
    /// GitHub App ID.
    #[serde(default, rename = "appID", skip_serializing_if = "Option::is_none")]
    pub app_id: Option<SecretKeySelector>,
    /// Installation ID.
    #[serde(
        default,
        rename = "installationID",
        skip_serializing_if = "Option::is_none"
    )]
    pub installation_id: Option<SecretKeySelector>,
    /// Private key.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub private_key: Option<SecretKeySelector>,
}

/// A stack of the workspace template (every field optional).
#[derive(Serialize, Deserialize, JsonSchema, Clone, Debug, PartialEq, Default)]
#[serde(rename_all = "camelCase")]
pub struct WorkspaceStackApply {
    /// Stack name.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    /// Create the stack if missing.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub create: Option<bool>,
    /// Secrets provider.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub secrets_provider: Option<String>,
    /// Config values.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub config: Vec<ConfigItemApply>,
    /// ESC environments.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub environment: Vec<String>,
}

/// A stack config value of the workspace template (every field optional).
#[derive(Serialize, Deserialize, JsonSchema, Clone, Debug, PartialEq, Default)]
#[serde(rename_all = "camelCase")]
pub struct ConfigItemApply {
    /// Config key or path.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub key: Option<String>,
    /// Whether the key is a property path.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub path: Option<bool>,
    /// Literal value (any JSON).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub value: Option<Value>,
    /// Where to read the value from.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub value_from: Option<ConfigValueFromApply>,
    /// Whether the value is secret.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub secret: Option<bool>,
}

/// Where a config value of the workspace template is read from (every field optional).
#[derive(Serialize, Deserialize, JsonSchema, Clone, Debug, PartialEq, Default)]
#[serde(rename_all = "camelCase")]
pub struct ConfigValueFromApply {
    /// Environment variable name.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub env: Option<String>,
    /// File path.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub path: Option<String>,
    /// Parse as JSON.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub json: Option<bool>,
}

/// Workspace status in a template (every field optional).
#[derive(Serialize, Deserialize, JsonSchema, Clone, Debug, PartialEq, Default)]
#[serde(rename_all = "camelCase")]
pub struct WorkspaceStatusApply {
    /// Generation the status was computed for.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,
    /// Agent address.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub address: Option<String>,
    /// Pulumi CLI version.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pulumi_version: Option<String>,
    /// Conditions.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub conditions: Vec<ConditionApply>,
}

/// The `workspaces.auto.pulumi.com` CRD. Panics only if schema generation is broken (tested).
pub fn workspace_crd() -> CustomResourceDefinition {
    try_workspace_crd().unwrap_or_else(|e| panic!("pko-api CRD generation is broken: {e}"))
}

/// The `workspaces.auto.pulumi.com` CRD.
pub fn try_workspace_crd() -> Result<CustomResourceDefinition, Error> {
    let schema = root_schema::<WorkspaceSpec, WorkspaceStatus>(RootSchema {
        description: "Workspace is the Schema for the workspaces API\nA Workspace is an execution context containing a single Pulumi project, a program, and multiple stacks.",
        spec_key: "spec",
        spec_required: true,
        validations: vec![
            json!({
                "rule": NAME_LENGTH_RULE,
                "message": NAME_LENGTH_MESSAGE,
            }),
            json!({
                "rule": NAME_FORMAT_RULE,
                "message": NAME_FORMAT_MESSAGE,
            }),
        ],
    })?;
    let version = version(
        "v1alpha1",
        true,
        vec![
            column("Image", "string", ".spec.image", None),
            column(
                "Ready",
                "string",
                ".status.conditions[?(@.type==\"Ready\")].status",
                None,
            ),
            column("Address", "string", ".status.address", None),
        ],
        schema,
    );
    Ok(crd(
        "auto.pulumi.com",
        "Workspace",
        "workspaces",
        vec![version],
    ))
}

#[cfg(test)]
mod name_tests {
    use super::*;

    #[test]
    fn workspace_names_must_make_valid_object_names() {
        for ok in ["a", "my-stack", "s3", "a-b-c", &"a".repeat(NAME_MAX_LENGTH)] {
            assert_eq!(name_problem(ok), None, "{ok}");
        }
        for format in ["a.b", "db.creds", "1abc", "-a", "a-", "A", "my_stack", ""] {
            assert_eq!(name_problem(format), Some(NAME_FORMAT_MESSAGE), "{format}");
        }
        assert_eq!(
            name_problem(&"a".repeat(NAME_MAX_LENGTH + 1)),
            Some(NAME_LENGTH_MESSAGE)
        );
        // The longest name keeps the revision-hash label within 63 characters.
        assert_eq!(
            format!("{}-workspace-{}", "a".repeat(NAME_MAX_LENGTH), "0123456789").len(),
            63
        );
    }
}
