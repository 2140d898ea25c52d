//! The execution controllers (Workspace, Update, Stack) and their settings.

use std::sync::Arc;

use k8s_openapi::api::apps::v1::StatefulSet;
use kube::Api;
use kube::api::PartialObjectMeta;
use pko_api::update::Update;
use pko_api::workspace::Workspace;
use tokio_util::sync::CancellationToken;

use crate::agent_client::{Agents, ServiceAccountRef};
use crate::controller::kit::Kit;
use crate::controller::stack::{self, StackContext};
use crate::controller::update::{self, OperationSlots, SlotLimits, UpdateContext, UpdateSettings};
use crate::controller::workspace::{self, PodSettings, WorkspaceContext};
use crate::egress::EgressPolicy;

/// Operator flags of the execution controllers (PKO's names where PKO has them).
#[derive(clap::Args, Debug, Clone)]
pub struct ExecutionArgs {
    /// Image whose /usr/local/bin/pko-agent is copied into workspace pods (the operator's own).
    #[arg(long, env = "AGENT_IMAGE", default_value = "pko-rs:latest")]
    pub agent_image: String,
    /// Pull policy of the agent image.
    #[arg(long, env = "AGENT_IMAGE_PULL_POLICY", default_value = "IfNotPresent")]
    pub agent_image_pull_policy: String,
    /// Image PKO's pod layout copies `/agent` and `/tini` from, for Workspaces annotated
    /// `pko-rs.dev/agent: pko`: PKO's own image (its agent), or pko-rs's agent image (ours, which
    /// answers the same layout).
    #[arg(
        long,
        env = "PKO_AGENT_IMAGE",
        default_value = "pulumi/pulumi-kubernetes-operator:v2.9.0"
    )]
    pub pko_agent_image: String,
    /// The operator's own service account, whose tokens (TokenRequest, one audience per
    /// workspace) a workspace under PKO's auth mode reviews (PKO's POD_SA_NAME).
    #[arg(long, env = "POD_SA_NAME")]
    pub service_account_name: Option<String>,
    /// Namespace of --service-account-name (default: the operator's, $POD_NAMESPACE).
    #[arg(long, env = "SERVICE_ACCOUNT_NAMESPACE")]
    pub service_account_namespace: Option<String>,
    /// Development only: dial workspace agents here instead of their Service. `host:port` sends
    /// every call to one agent (PKO's WORKSPACE_LOCALHOST); a bare host uses the port a local
    /// kubelet stand-in annotates on each StatefulSet.
    #[arg(long, env = "WORKSPACE_LOCALHOST")]
    pub workspace_localhost: Option<String>,
    /// Largest artifact a workspace accepts (bytes; passed to the fetch container).
    #[arg(long, env = "FLUX_MAX_UNTAR_SIZE_BYTES")]
    pub max_artifact_bytes: Option<String>,
    /// Update operations (preview, up, refresh, destroy) running at once; more Updates wait,
    /// with the reason `Queued`, until one ends.
    #[arg(
        long,
        env = "MAX_OPERATIONS_IN_FLIGHT",
        default_value_t = update::DEFAULT_MAX_OPERATIONS_IN_FLIGHT,
        value_parser = clap::value_parser!(u32).range(1..),
    )]
    pub max_operations_in_flight: u32,
    /// Of those, the most one namespace's Updates may hold, so one tenant's sleeping Updates
    /// never queue another's; more wait, with the reason `Queued`. Default: a quarter of
    /// `--max-operations-in-flight` (at least 1).
    #[arg(
        long,
        env = "MAX_OPERATIONS_IN_FLIGHT_PER_NAMESPACE",
        value_parser = clap::value_parser!(u32).range(1..),
    )]
    pub max_operations_in_flight_per_namespace: Option<u32>,
    /// Longest an Update's operation may run (a Go duration); past it the operation is
    /// canceled at the agent and the Update fails with the reason `OperationTimedOut`. An
    /// Update's `spec.operationTimeout` may shorten it. `0`: no bound (PKO's behaviour).
    #[arg(
        long,
        env = "OPERATION_TIMEOUT",
        default_value = "0",
        value_parser = pko_api::duration::parse_go_duration,
    )]
    pub operation_timeout: std::time::Duration,
    /// Engine-event bytes one operation may stream; past them the operation is stopped and its
    /// Update fails with the reason `EventsTooLarge` (each event is also under the 16 MiB
    /// message limit).
    #[arg(
        long,
        env = "MAX_EVENT_BYTES_PER_OPERATION",
        default_value_t = update::DEFAULT_MAX_EVENT_BYTES_PER_OPERATION,
        value_parser = clap::value_parser!(u64).range(1..),
    )]
    pub max_event_bytes_per_operation: u64,
    /// Git over SSH: trust a server's host key seen for the first time when the Secret with
    /// the SSH key has no `knownHosts` key. Off: such a server is refused.
    #[arg(long, env = "GIT_SSH_ACCEPT_NEW_HOST_KEYS")]
    pub git_ssh_accept_new_host_keys: bool,
    /// The GitHub API root where GitHub App credentials (`gitAuth.githubApp`) are exchanged for
    /// installation tokens, by the operator (branch lookups, through the egress rules) and by
    /// workspace pods (checkouts). GitHub Enterprise Server: `https://<host>/api/v3`.
    #[arg(long, env = "GITHUB_API_URL", default_value = pko_git::github_app::DEFAULT_API_URL)]
    pub github_api_url: String,
}

/// What tenants' objects may make the execution controllers reach.
#[derive(Clone, Debug)]
pub struct TenantBounds {
    /// Addresses the operator may connect to for a tenant's URL (git refs).
    pub egress: Arc<EgressPolicy>,
    /// The file server's names: a Workspace's flux URL on it must stay in its namespace.
    pub file_server: pko_admission::tenancy::FileServerNames,
    /// The operation slots, one set for every namespace the operator watches (see
    /// [`ExecutionArgs::operation_slots`]).
    pub slots: Arc<OperationSlots>,
}

impl ExecutionArgs {
    /// The operation slots these flags describe; made once and shared by the controllers of
    /// every watched namespace, so `--max-operations-in-flight` bounds them all together.
    pub fn operation_slots(&self) -> Arc<OperationSlots> {
        let as_usize = |n: u32| usize::try_from(n).unwrap_or(usize::MAX);
        Arc::new(OperationSlots::new(SlotLimits::new(
            as_usize(self.max_operations_in_flight),
            self.max_operations_in_flight_per_namespace.map(as_usize),
        )))
    }
}

/// Runs the execution controllers until `stop` is canceled.
pub async fn run(
    kit: Kit,
    namespace: Option<String>,
    args: ExecutionArgs,
    concurrency: u16,
    bounds: TenantBounds,
    stop: CancellationToken,
) {
    let TenantBounds {
        egress,
        file_server,
        slots,
    } = bounds;
    let client = kit.client.clone();
    let service_account = args
        .service_account_name
        .clone()
        .filter(|n| !n.is_empty())
        .zip(
            args.service_account_namespace
                .clone()
                .filter(|n| !n.is_empty()),
        )
        .map(|(name, namespace)| ServiceAccountRef { namespace, name });
    let agents = Arc::new(Agents::new(
        client.clone(),
        args.workspace_localhost.clone(),
        service_account,
    ));
    Agents::spawn_idle_sweep(&agents);
    let settings = PodSettings {
        file_server,
        agent_image: args.agent_image.clone(),
        agent_image_pull_policy: args.agent_image_pull_policy.clone(),
        pko_agent_image: args.pko_agent_image.clone(),
        max_artifact_bytes: args.max_artifact_bytes.clone(),
        git_ssh_accept_new_host_keys: args.git_ssh_accept_new_host_keys,
        github_api_url: args.github_api_url.clone(),
    };
    let (workspaces, statefulsets): (Api<Workspace>, Api<PartialObjectMeta<StatefulSet>>) =
        match namespace.as_deref() {
            Some(ns) => (
                Api::namespaced(client.clone(), ns),
                Api::namespaced(client.clone(), ns),
            ),
            None => (Api::all(client.clone()), Api::all(client.clone())),
        };
    let updates: Api<Update> = match namespace.as_deref() {
        Some(ns) => Api::namespaced(client.clone(), ns),
        None => Api::all(client.clone()),
    };
    let ws_ctx = Arc::new(WorkspaceContext::new(&kit, agents.clone(), settings));
    let update_ctx = Arc::new(UpdateContext::new(
        &kit,
        agents.clone(),
        UpdateSettings {
            slots,
            max_event_bytes: args.max_event_bytes_per_operation,
            operation_timeout: Some(args.operation_timeout).filter(|t| !t.is_zero()),
            workspace_wake: ws_ctx.waker(),
        },
    ));
    let stack_ctx = Arc::new(StackContext::new(
        &kit,
        egress,
        crate::gitremote::RemoteOptions {
            github_api: args.github_api_url.clone(),
            ssh_accept_new_host_keys: args.git_ssh_accept_new_host_keys,
        },
    ));
    tokio::join!(
        stack::run(
            client.clone(),
            namespace.clone(),
            stack_ctx,
            concurrency,
            stop.clone().cancelled_owned()
        ),
        workspace::run(
            workspaces.clone(),
            statefulsets,
            ws_ctx,
            concurrency,
            stop.clone().cancelled_owned()
        ),
        update::run(
            updates,
            workspaces,
            update_ctx,
            concurrency,
            stop.clone().cancelled_owned()
        ),
    );
}
