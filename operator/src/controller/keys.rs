//! Every label, annotation, finalizer and field manager the controllers write or match on, in
//! one place: these names are what users, PKO tooling and `kubectl` see, so they change only
//! deliberately (PKO's own where the object is PKO's).

// Field managers: one per status writer, so `managedFields` tells who wrote what; objects the
// operator owns (Workspace, Update, Service, StatefulSet) are applied by one manager.
pub const APPLY_MANAGER: &str = "pko-rs";
pub const PROGRAM_STATUS_MANAGER: &str = "pko-rs/program-status";
pub const STACK_STATUS_MANAGER: &str = "pko-rs/stack-status";
pub const WORKSPACE_STATUS_MANAGER: &str = "pko-rs/workspace-status";
pub const UPDATE_STATUS_MANAGER: &str = "pko-rs/update-status";
pub const TENANCY_STATUS_MANAGER: &str = "pko-rs/tenancy-status";
pub const TRANSFORM_STATUS_MANAGER: &str = "pko-rs/transform-status";
/// PKO's field manager, and the prefix of its status writers' (`…/stack-status`): what it
/// owns is taken over at a switch-over (`controller/takeover.rs`).
pub use pko_api::decode::PKO_MANAGER;

/// PKO's Stack finalizer: kept so a Stack handed over from PKO is cleaned up the same way.
pub use pko_api::stack::STACK_FINALIZER;

/// On the Workspace and Update a Stack makes: `stack`.
pub const STACK_COMPONENT_LABEL: &str = "pulumi.com/component";
/// On the Workspace and Update a Stack makes: the Stack's name.
pub const STACK_NAME_LABEL: &str = "pulumi.com/stack-name";
/// On a Workspace's Service, StatefulSet and pod: `workspace`.
pub const WORKSPACE_COMPONENT_LABEL: &str = "auto.pulumi.com/component";
/// On a Workspace's Service, StatefulSet and pod: the Workspace's name.
pub const WORKSPACE_NAME_LABEL: &str = "auto.pulumi.com/workspace-name";
/// On the outputs Secret of an Update: the Update's name.
pub const UPDATE_NAME_LABEL: &str = "auto.pulumi.com/update-name";

/// A Stack annotation whose new value asks for a reconcile (PKO's, also set by prerequisites).
pub const RECONCILE_REQUEST_ANNOTATION: &str = "pulumi.com/reconciliation-request";
/// On an Update's outputs Secret: which outputs are secret (PKO's).
pub const SECRETS_ANNOTATION: &str = "pulumi.com/secrets";
/// On a workspace pod template: the digest of what the pod runs, so a change rolls the pod.
pub const REVISION_HASH_ANNOTATION: &str = "auto.pulumi.com/revision-hash";
/// Development only: the local port of an agent run outside the cluster (set by `pko-dev`).
pub const DEV_PORT_ANNOTATION: &str = "pko-rs.dev/dev-agent-port";
/// On a workspace pod: what its agent was initialized with (agent instance, Workspace
/// generation, environment digest), so a restarted operator does not install and initialize
/// every workspace again (PKO keeps `auto.pulumi.com/initialized: "true"` for the same reason).
pub const INITIALIZED_ANNOTATION: &str = "pko-rs.dev/initialized";

/// Workspace `Ready=False` reasons written while the agent installs the program's packages
/// and plugins, then selects and configures the stacks (PKO's).
pub const INSTALLING: &str = "Installing";
pub const INITIALIZING: &str = "Initializing";
/// Workspace Event reasons once its agent knows the workspace: a new agent initialized, a new
/// source revision taken by the running agent, or the environment and stacks told again. Apart,
/// because Events of one object and reason are folded into one series (the first note stays).
pub const INITIALIZED: &str = "Initialized";
pub const SOURCE_UPDATED: &str = "SourceUpdated";
pub const RECONFIGURED: &str = "Reconfigured";
/// Workspace `Stalled=True` reasons when those steps failed; they are retried.
pub const INSTALLATION_FAILED: &str = "InstallationFailed";
pub const INITIALIZATION_FAILED: &str = "InitializationFailed";
/// On a Workspace (a Stack sets it through `workspaceTemplate.metadata.annotations`): the agent
/// contract of its pod. `pko` lays the pod out as PKO's manager does (agent and tini copied
/// from `--pko-agent-image`, `serve --auth-mode kube`) and calls the agent over plaintext with
/// a token of the operator's service account; `pko-rs` (or no annotation) is pko-rs's own (TLS
/// pinned to the workspace's certificate, a random token in a Secret).
pub const AGENT_ANNOTATION: &str = "pko-rs.dev/agent";
/// On a workspace pod template under PKO's contract: the agent image whose agent could not take
/// the environment over RPC, so `spec.env` is on the container (remembered across operator
/// restarts; asked again when the image changes).
pub const ENV_IN_POD_ANNOTATION: &str = "pko-rs.dev/env-in-pod-spec";
/// On a workspace pod template under pko-rs's contract with a Flux-style source: the digest of
/// the template without the source's revision (URL and digest). A pod whose value matches the
/// template's differs from it by the revision alone, and its agent takes the new one
/// (`UpdateSource`) instead of the pod being replaced.
pub const TEMPLATE_SHAPE_ANNOTATION: &str = "pko-rs.dev/template-shape";

/// kstatus's condition types (sigs.k8s.io/cli-utils `pkg/kstatus`), which GitOps tools (Flux's
/// `wait`, Argo CD, `kpt live status`) read beside `Ready`: `Reconciling=True` while the
/// object is being brought to its spec, `Stalled=True` while it cannot get there without a
/// change. Both are present only while true.
pub const RECONCILING: &str = "Reconciling";
pub const STALLED: &str = "Stalled";
/// Program `Stalled=True` reasons (also their Warning Events' reasons): the artifact cannot be
/// built from the spec, or a transform under `failurePolicy: Fail` refused it.
pub const ARTIFACT_FAILED: &str = "ArtifactFailed";
pub const TRANSFORM_FAILED: &str = "TransformFailed";
/// Program `Reconciling=True` reason: a build that failed for a reason that may pass (a
/// transform's timeout, a busy plugin host) is retried.
pub const RETRYING_BUILD: &str = "RetryingBuild";

/// Stack condition set by each finished drift check (`spec.driftDetection`; PKO's draft's name),
/// and the Warning Event's reason when one finds drift.
pub const DRIFT_DETECTED: &str = "DriftDetected";
/// `DriftDetected=True`: resources changed outside Pulumi.
pub const DRIFT_CHANGES: &str = "Changes";
/// `DriftDetected=False`: nothing changed.
pub const DRIFT_NO_CHANGES: &str = "NoChanges";
/// `DriftDetected=Unknown`: the check itself failed.
pub const DRIFT_CHECK_FAILED: &str = "CheckFailed";
/// The Warning Event's reason when a drift check failed.
pub const DRIFT_CHECK_FAILED_EVENT: &str = "DriftCheckFailed";

/// Workspace `Ready=False` reason while `spec.idle` has its pod stopped (not an error: neither
/// `Reconciling` nor `Stalled` is set, so kstatus never reads it `Failed`); also the Normal
/// Event's reason when the pod is stopped.
pub const IDLE: &str = "Idle";
/// The Normal Event's reason when an idle workspace's pod is started for an Update.
pub const WAKING: &str = "Waking";
/// Field manager of the StatefulSet `spec.replicas` writes that stop an idle workspace's pod
/// (the next apply, which sets one replica again, takes the field back).
pub const IDLE_MANAGER: &str = "pko-rs/idle";
/// Annotation approving a Stack's plan (`spec.approval`): its value is the plan ID
/// (`status.approval.planID`) the up may run.
pub const APPROVE_PLAN_ANNOTATION: &str = "pko-rs.dev/approve-plan";
/// Stack condition of the approval gate, and the reasons it gives: a plan is being made, awaits
/// approval, was approved, failed, or an approval was refused (stale, or its plan gone).
pub const PLAN_APPROVED: &str = "PlanApproved";
pub const PLAN_PLANNING: &str = "Planning";
pub const PLAN_AWAITING: &str = "AwaitingApproval";
pub const PLAN_APPROVED_REASON: &str = "Approved";
pub const PLAN_FAILED: &str = "PlanFailed";
pub const PLAN_REFUSED: &str = "ApprovalRefused";
