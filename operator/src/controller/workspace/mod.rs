//! Workspace controller: a Workspace becomes a Service + StatefulSet running the agent; once the
//! agent answers, the Workspace's stacks are selected and configured through its RPCs.
//!
//! Beyond PKO: the pod is rolled only when what it runs changes (the revision hash covers the
//! pod template, not the stacks), so a config change is pushed over RPC instead of restarting
//! the pod; the agent has a readiness probe; a restarted agent (new instance id in its answers)
//! is initialized again without touching the pod; a pod template that would make a restricted
//! workspace run as root is refused with a Stalled condition; a failed init container (bad
//! artifact digest, …) is reported in the Ready condition.

pub mod env;
pub mod merge;
pub mod pod;

use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use futures::StreamExt;
use k8s_openapi::api::apps::v1::StatefulSet;
use k8s_openapi::api::core::v1::{Pod, Service};
use kube::api::{Api, Patch, PatchParams};
use kube::runtime::controller::{self, Action, Controller};
use kube::runtime::events::{EventType, Recorder};
use kube::runtime::watcher;
use kube::{Client, Resource, ResourceExt};
use pko_agent_api::proto as pb;
use pko_api::workspace::{ConfigItem, Workspace, WorkspaceStatus};
use serde_json::{Value, json};
use tracing::{info, instrument, warn};

use crate::agent_client::{AgentError, Agents};
use crate::controller::backoff::{self, Backoff, Verdict};
use crate::controller::conditions;
use crate::controller::kit::{self, Kit};
use crate::metrics::{ErrorLabels, Metrics};

pub use pod::PodSettings;

/// Field manager of the Workspace status.
pub const STATUS_MANAGER: &str = "pko-rs/workspace-status";
/// Field manager of the objects the operator applies.
pub const APPLY_MANAGER: &str = "pko-rs";
const CONTROLLER: &str = "workspace";
const READY: &str = "Ready";
const STALLED: &str = "Stalled";
/// Structured config (objects, arrays, JSON values) needs `config set-all --json`.
const STRUCTURED_CONFIG_MIN_VERSION: (u64, u64, u64) = (3, 202, 0);

/// Failures of one reconcile (retried with backoff).
#[derive(Debug, thiserror::Error)]
pub enum WorkspaceError {
    #[error("workspace has no namespace")]
    NoNamespace,
    #[error("{what}: {source}")]
    Kube {
        what: String,
        #[source]
        source: kube::Error,
    },
    #[error(transparent)]
    Agent(#[from] AgentError),
    #[error(transparent)]
    Pod(#[from] pod::PodError),
    #[error("cannot encode: {0}")]
    Encode(#[from] serde_json::Error),
    /// The agent did not answer as it should: `Ready=False` with `reason` until it stalls.
    #[error("{message}")]
    AgentUnavailable { reason: String, message: String },
}

impl WorkspaceError {
    fn kind(&self) -> &'static str {
        match self {
            Self::NoNamespace => "no_namespace",
            Self::Kube { .. } => "kube",
            Self::Agent(_) => "agent",
            Self::Pod(_) => "pod",
            Self::Encode(_) => "encode",
            Self::AgentUnavailable { .. } => "agent_unavailable",
        }
    }

    /// Whether retrying may help (see [`backoff`]).
    fn verdict(&self) -> Verdict {
        match self {
            Self::Kube { source, .. } | Self::Agent(AgentError::Credentials { source, .. }) => {
                backoff::classify(source)
            }
            Self::NoNamespace | Self::Pod(_) | Self::Encode(_) => Verdict::Permanent,
            Self::Agent(_) | Self::AgentUnavailable { .. } => Verdict::Transient,
        }
    }

    /// What the status and the Event say: the apiserver's own message for its refusals.
    fn message(&self) -> String {
        match self {
            Self::Kube { what, source } => format!("{what}: {}", backoff::describe(source)),
            Self::Agent(AgentError::Credentials { name, source }) => format!(
                "cannot read or create the agent credentials {name}: {}",
                backoff::describe(source)
            ),
            other => other.to_string(),
        }
    }
}

fn kube_err(what: impl Into<String>) -> impl FnOnce(kube::Error) -> WorkspaceError {
    let what = what.into();
    move |source| WorkspaceError::Kube { what, source }
}

/// What every reconcile needs.
pub struct WorkspaceContext {
    pub client: Client,
    pub recorder: Recorder,
    pub agents: Arc<Agents>,
    pub settings: PodSettings,
    pub metrics: Metrics,
    /// Failed reconciles per Workspace.
    pub backoff: Backoff,
    /// Workspace uid → what its agent was last initialized with.
    initialized: Mutex<HashMap<String, Initialized>>,
}

impl WorkspaceContext {
    pub fn new(kit: &Kit, agents: Arc<Agents>, settings: PodSettings) -> Self {
        Self {
            client: kit.client.clone(),
            recorder: kit.recorder(CONTROLLER),
            agents,
            settings,
            metrics: kit.metrics.clone(),
            backoff: Backoff::default(),
            initialized: Mutex::new(HashMap::new()),
        }
    }

    fn initialized_for(&self, uid: &str) -> Option<Initialized> {
        self.initialized
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .get(uid)
            .cloned()
    }

    fn set_initialized(&self, uid: &str, value: Option<Initialized>) {
        let mut map = self
            .initialized
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        match value {
            Some(v) => map.insert(uid.to_owned(), v),
            None => map.remove(uid),
        };
    }

    async fn event(&self, ws: &Workspace, type_: EventType, reason: &str, note: String) {
        let object = ws.object_ref(&());
        kit::publish(&self.recorder, &object, type_, reason, "Reconcile", &note).await;
    }
}

/// Runs the controller until `shutdown` resolves.
pub async fn run(
    api: Api<Workspace>,
    statefulsets: Api<StatefulSet>,
    ctx: Arc<WorkspaceContext>,
    concurrency: u16,
    shutdown: impl std::future::Future<Output = ()> + Send + Sync + 'static,
) {
    let owned = watcher::Config::default().labels(&format!("{}=workspace", pod::COMPONENT_LABEL));
    Controller::new(api, watcher::Config::default().any_semantic())
        .owns(statefulsets, owned)
        .with_config(controller::Config::default().concurrency(concurrency))
        .graceful_shutdown_on(shutdown)
        .run(reconcile, error_policy, ctx)
        .for_each(|result| async move {
            if let Err(err) = result {
                warn!(controller = CONTROLLER, error = %err, "controller event");
            }
        })
        .await;
}

fn error_policy(ws: Arc<Workspace>, err: &WorkspaceError, ctx: Arc<WorkspaceContext>) -> Action {
    warn!(workspace = %ws.name_any(), error = %err, "reconcile failed");
    ctx.metrics
        .reconcile_errors
        .get_or_create(&ErrorLabels {
            controller: CONTROLLER.into(),
            error: err.kind().into(),
        })
        .inc();
    Action::requeue(ctx.backoff.delay(&backoff::key(&ws.metadata)))
}

/// The controller owner reference to put on every object made for `ws`.
pub fn owner_reference(ws: &Workspace) -> Value {
    json!({
        "apiVersion": "auto.pulumi.com/v1alpha1",
        "kind": "Workspace",
        "name": ws.name_any(),
        "uid": ws.metadata.uid.clone().unwrap_or_default(),
        "controller": true,
        "blockOwnerDeletion": true,
    })
}

/// Why a StatefulSet is not ready yet, or `None` when it is (PKO's rule).
fn not_ready(sts: &StatefulSet) -> Option<(&'static str, String)> {
    let generation = sts.metadata.generation;
    let Some(status) = &sts.status else {
        return Some((
            "RollingUpdate",
            "waiting for the StatefulSet to be observed".into(),
        ));
    };
    if status.observed_generation != generation
        || status.update_revision.is_some() && status.update_revision != status.current_revision
    {
        return Some(("RollingUpdate", "the workspace pod is being updated".into()));
    }
    if status.available_replicas.unwrap_or(0) < 1 {
        return Some((
            "WaitingForReplicas",
            "waiting for the workspace pod to be ready".into(),
        ));
    }
    None
}

/// A failed init container of the workspace pod, as the kubelet reports it.
async fn init_failure(client: &Client, namespace: &str, workspace: &str) -> Option<String> {
    let pods: Api<Pod> = Api::namespaced(client.clone(), namespace);
    let pod = pods
        .get_opt(&format!("{}-0", pod::workload_name(workspace)))
        .await
        .ok()??;
    let statuses = pod.status?.init_container_statuses?;
    statuses.iter().find_map(|s| {
        let state = s.state.as_ref()?;
        let terminated = state
            .terminated
            .as_ref()
            .or_else(|| s.last_state.as_ref()?.terminated.as_ref())
            .filter(|t| t.exit_code != 0)?;
        let message = terminated
            .message
            .as_deref()
            .map(str::trim)
            .filter(|m| !m.is_empty())
            .unwrap_or("no message");
        Some(format!(
            "init container {} failed (exit code {}): {}",
            s.name, terminated.exit_code, message
        ))
    })
}

fn parse_version(v: &str) -> Option<(u64, u64, u64)> {
    let core = v.trim().trim_start_matches('v');
    let core = core.split(['-', '+']).next()?;
    let mut parts = core.split('.').map(|p| p.parse::<u64>().ok());
    Some((
        parts.next()??,
        parts.next()??,
        parts.next().flatten().unwrap_or(0),
    ))
}

fn structured(item: &ConfigItem) -> bool {
    matches!(item.value, Some(Value::Object(_) | Value::Array(_)))
        || item
            .value_from
            .as_ref()
            .is_some_and(|f| f.json == Some(true))
}

/// A Workspace config item as the agent's.
pub fn to_pb_item(item: &ConfigItem) -> pb::ConfigItem {
    let v = match (&item.value, &item.value_from) {
        (Some(value), _) => Some(pb::config_item::V::Value(pko_agent_api::values::to_pb(
            value,
        ))),
        (None, Some(from)) => Some(pb::config_item::V::ValueFrom(pb::ConfigValueFrom {
            f: match (&from.env, &from.path) {
                (Some(env), _) => Some(pb::config_value_from::F::Env(env.clone())),
                (None, Some(path)) => Some(pb::config_value_from::F::Path(path.clone())),
                (None, None) => None,
            },
            json: from.json,
        })),
        (None, None) => None,
    };
    pb::ConfigItem {
        key: item.key.clone(),
        path: item.path,
        v,
        secret: item.secret,
    }
}

/// `Ready=False` for `reason`; with `stalled`, also `Stalled=True` (a state that retrying soon
/// will not fix).
fn mark_not_ready(
    status: &mut WorkspaceStatus,
    stalled: bool,
    reason: &str,
    message: &str,
    generation: Option<i64>,
) {
    if stalled {
        conditions::set(
            &mut status.conditions,
            STALLED,
            true,
            reason,
            message,
            generation,
        );
    }
    conditions::set(
        &mut status.conditions,
        READY,
        false,
        reason,
        message,
        generation,
    );
}

/// What an agent was told: it is told again when any part changes (a restarted agent has a new
/// instance id and remembers nothing).
#[derive(Debug, Clone, PartialEq, Eq)]
struct Initialized {
    instance: String,
    generation: i64,
    env_digest: String,
}

/// Selects and configures every stack of the workspace.
async fn initialize_stacks(
    client: &mut pko_agent_api::client::AgentClient,
    ws: &Workspace,
) -> Result<(), String> {
    for stack in &ws.spec.stacks {
        client
            .select_stack(pb::SelectStackRequest {
                stack_name: stack.name.clone(),
                create: stack.create,
                secrets_provider: stack.secrets_provider.clone(),
            })
            .await
            .map_err(|s| format!("Failed to initialize stack {}: {}", stack.name, s.message()))?;
        if !stack.config.is_empty() {
            client
                .set_all_config(pb::SetAllConfigRequest {
                    config: stack.config.iter().map(to_pb_item).collect(),
                })
                .await
                .map_err(|s| {
                    format!(
                        "Failed to set config of stack {}: {}",
                        stack.name,
                        s.message()
                    )
                })?;
        }
        if !stack.environment.is_empty() {
            client
                .add_environments(pb::AddEnvironmentsRequest {
                    environment: stack.environment.clone(),
                })
                .await
                .map_err(|s| {
                    format!(
                        "Failed to add environments to stack {}: {}",
                        stack.name,
                        s.message()
                    )
                })?;
        }
    }
    Ok(())
}

#[instrument(skip_all, fields(workspace = %format!("{}/{}", ws.namespace().unwrap_or_default(), ws.name_any())))]
async fn reconcile(
    ws: Arc<Workspace>,
    ctx: Arc<WorkspaceContext>,
) -> Result<Action, WorkspaceError> {
    let _measure = kit::measure(&ctx.metrics, CONTROLLER);
    let result = reconcile_inner(&ws, &ctx).await;
    let failure = ctx
        .backoff
        .record(&ws.metadata, &result, WorkspaceError::verdict);
    if let (Some(failure), Err(err)) = (failure, &result) {
        report_failure(&ws, &ctx, err, failure.stall).await;
    }
    result
}

/// Reports a failed reconcile: `stall` makes it `Stalled=True`/`Ready=False`
/// ([`backoff::REASON`]) with the error's message and a Warning Event when that is news; an
/// agent that does not answer is `Ready=False` with its own reason before that. The status is
/// derived from the error alone, so the same failure again writes nothing (and triggers no
/// reconcile of its own).
async fn report_failure(ws: &Workspace, ctx: &WorkspaceContext, err: &WorkspaceError, stall: bool) {
    let Some(namespace) = ws.namespace() else {
        return;
    };
    let generation = ws.metadata.generation;
    let before = ws.status.clone().unwrap_or_default();
    let mut status = before.clone();
    status.observed_generation = generation;
    let message = conditions::truncate(&err.message(), conditions::MESSAGE_LIMIT);
    if let WorkspaceError::AgentUnavailable { reason, .. } = err {
        status.address = None;
        if !stall {
            mark_not_ready(&mut status, false, reason, &message, generation);
        }
    } else if !stall {
        return;
    }
    if stall {
        let known = conditions::get(&before.conditions, STALLED).is_some_and(|c| {
            c.status == "True" && c.reason == backoff::REASON && c.message == message
        });
        if !known {
            ctx.event(ws, EventType::Warning, backoff::REASON, message.clone())
                .await;
        }
        mark_not_ready(&mut status, true, backoff::REASON, &message, generation);
    }
    if let Err(e) = write_status(ctx, &namespace, &ws.name_any(), &before, &status).await {
        warn!(error = %e, "cannot report the stalled workspace");
    }
}

async fn reconcile_inner(ws: &Workspace, ctx: &WorkspaceContext) -> Result<Action, WorkspaceError> {
    let namespace = ws.namespace().ok_or(WorkspaceError::NoNamespace)?;
    let name = ws.name_any();
    let uid = ws.metadata.uid.clone().unwrap_or_default();
    let generation = ws.metadata.generation;
    let before = ws.status.clone().unwrap_or_default();
    let mut status = before.clone();
    status.observed_generation = generation;
    // A stall reported after failed attempts holds until an attempt gets further: the paths
    // below that write a status of their own clear it.
    let clear_failure_stall = |status: &mut WorkspaceStatus| {
        if conditions::get(&status.conditions, STALLED).is_some_and(|c| c.reason == backoff::REASON)
        {
            conditions::remove(&mut status.conditions, STALLED);
        }
    };

    if ws.meta().deletion_timestamp.is_some() {
        clear_failure_stall(&mut status);
        status.address = None;
        conditions::set(
            &mut status.conditions,
            READY,
            false,
            "Deleting",
            "Workspace is being deleted",
            generation,
        );
        ctx.set_initialized(&uid, None);
        write_status(ctx, &namespace, &name, &before, &status).await?;
        return Ok(Action::await_change());
    }

    let owner = owner_reference(ws);
    let credentials = ctx
        .agents
        .ensure_credentials(&name, &namespace, &owner)
        .await?;
    let desired = match pod::desired_statefulset(
        ws,
        &name,
        &namespace,
        &owner,
        &ctx.settings,
        &credentials.fingerprint,
    ) {
        Ok(sts) => sts,
        Err(
            e @ (pod::PodError::Restricted(_)
            | pod::PodError::CrossNamespaceProgram { .. }
            | pod::PodError::InvalidFluxUrl(_)),
        ) => {
            let message = e.to_string();
            if !conditions::is_true(&status.conditions, STALLED) {
                ctx.event(ws, EventType::Warning, "SpecInvalid", message.clone())
                    .await;
            }
            status.address = None;
            mark_not_ready(&mut status, true, "SpecInvalid", &message, generation);
            write_status(ctx, &namespace, &name, &before, &status).await?;
            return Ok(Action::await_change());
        }
        Err(e) => return Err(e.into()),
    };
    let apply = PatchParams::apply(APPLY_MANAGER).force();
    let services: Api<Service> = Api::namespaced(ctx.client.clone(), &namespace);
    let service = pod::desired_service(ws, &name, &namespace, &owner);
    services
        .patch(&pod::workload_name(&name), &apply, &Patch::Apply(&service))
        .await
        .map_err(kube_err("applying the workspace Service"))?;
    let statefulsets: Api<StatefulSet> = Api::namespaced(ctx.client.clone(), &namespace);
    let sts = statefulsets
        .patch(&pod::workload_name(&name), &apply, &Patch::Apply(&desired))
        .await
        .map_err(kube_err("applying the workspace StatefulSet"))?;

    if let Some((reason, mut message)) = not_ready(&sts) {
        if let Some(failure) = init_failure(&ctx.client, &namespace, &name).await {
            if conditions::get(&status.conditions, READY).is_none_or(|c| c.message != failure) {
                ctx.event(
                    ws,
                    EventType::Warning,
                    "InitializationFailure",
                    failure.clone(),
                )
                .await;
            }
            message = failure;
        }
        status.address = None;
        conditions::remove(&mut status.conditions, STALLED);
        conditions::set(
            &mut status.conditions,
            READY,
            false,
            reason,
            &message,
            generation,
        );
        write_status(ctx, &namespace, &name, &before, &status).await?;
        // No pod watch: look again for an init failure or readiness.
        return Ok(Action::requeue(Duration::from_secs(10)));
    }

    let address = match ctx.agents.address(&name, &namespace, &sts) {
        Ok(a) => a,
        Err(AgentError::NoDevPort(_)) => return Ok(Action::requeue(Duration::from_secs(2))),
        Err(e) => return Err(e.into()),
    };
    let mut client = match ctx
        .agents
        .client(&name, &namespace, &address, &credentials)
        .await
    {
        Ok(c) => c,
        Err(e) => {
            let message = format!("cannot connect to the workspace agent at {address}: {e}");
            ctx.event(ws, EventType::Warning, "ConnectionFailure", message.clone())
                .await;
            return Err(WorkspaceError::AgentUnavailable {
                reason: "ConnectionFailed".into(),
                message,
            });
        }
    };
    let version = match client.pulumi_version(pb::PulumiVersionRequest {}).await {
        Ok(v) => v,
        Err(s) => {
            ctx.agents.forget(&name, &namespace);
            return Err(WorkspaceError::AgentUnavailable {
                reason: format!("{:?}", s.code()),
                message: format!("PulumiVersion failed: {}", s.message()),
            });
        }
    };
    let instance = version
        .metadata()
        .get(pko_agent_api::INSTANCE_HEADER)
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default()
        .to_owned();
    let version = version.into_inner().version;
    status.pulumi_version = Some(version.clone());
    status.address = Some(address.clone());

    let needs_structured = ws
        .spec
        .stacks
        .iter()
        .flat_map(|s| &s.config)
        .any(structured);
    if needs_structured && parse_version(&version).is_none_or(|v| v < STRUCTURED_CONFIG_MIN_VERSION)
    {
        let message = format!(
            "structured configuration needs Pulumi CLI v{}.{}.{} or later; the workspace has {version}",
            STRUCTURED_CONFIG_MIN_VERSION.0,
            STRUCTURED_CONFIG_MIN_VERSION.1,
            STRUCTURED_CONFIG_MIN_VERSION.2
        );
        if !conditions::is_true(&status.conditions, STALLED) {
            ctx.event(
                ws,
                EventType::Warning,
                "StackInitializationFailure",
                message.clone(),
            )
            .await;
        }
        mark_not_ready(
            &mut status,
            true,
            "IncompatibleConfiguration",
            &message,
            generation,
        );
        write_status(ctx, &namespace, &name, &before, &status).await?;
        return Ok(Action::await_change());
    }

    let pushed_env = match env::resolve(&ctx.client, &namespace, &ws.spec.env).await {
        Ok(e) => e,
        Err(message) => {
            // Like a pod whose Secret is missing: not ready until it appears.
            clear_failure_stall(&mut status);
            mark_not_ready(
                &mut status,
                false,
                "EnvironmentUnavailable",
                &message,
                generation,
            );
            write_status(ctx, &namespace, &name, &before, &status).await?;
            return Ok(Action::requeue(Duration::from_secs(15)));
        }
    };
    let done = ctx.initialized_for(&uid);
    let generation_value = generation.unwrap_or(0);
    let wanted = Initialized {
        instance: instance.clone(),
        generation: generation_value,
        env_digest: env::digest(&pushed_env),
    };
    if done.as_ref() != Some(&wanted) {
        let fresh_agent = done.as_ref().is_none_or(|d| d.instance != instance);
        // First, as every later command (install, stack selection) may need it.
        if let Err(s) = client
            .set_environment_variables(pb::SetEnvironmentVariablesRequest {
                env: pushed_env.clone().into_iter().collect(),
            })
            .await
        {
            ctx.agents.forget(&name, &namespace);
            return Err(WorkspaceError::AgentUnavailable {
                reason: "InitializationFailed".into(),
                message: format!("Failed to set the environment: {}", s.message()),
            });
        }
        if fresh_agent && let Err(s) = client.install(pb::InstallRequest {}).await {
            let message = format!("Installation failed: {}", s.message());
            ctx.event(
                ws,
                EventType::Warning,
                "InstallationFailure",
                message.clone(),
            )
            .await;
            mark_not_ready(
                &mut status,
                true,
                "InstallationFailed",
                &message,
                generation,
            );
            write_status(ctx, &namespace, &name, &before, &status).await?;
            return Ok(Action::requeue(Duration::from_secs(60)));
        }
        if let Err(message) = initialize_stacks(&mut client, ws).await {
            ctx.event(
                ws,
                EventType::Warning,
                "StackInitializationFailure",
                message.clone(),
            )
            .await;
            mark_not_ready(
                &mut status,
                true,
                "InitializationFailed",
                &message,
                generation,
            );
            write_status(ctx, &namespace, &name, &before, &status).await?;
            return Ok(Action::requeue(Duration::from_secs(60)));
        }
        ctx.set_initialized(&uid, Some(wanted));
        info!(%instance, generation = generation_value, "workspace initialized");
        let note = if fresh_agent {
            format!("Initialized workspace pod {}-0", pod::workload_name(&name))
        } else {
            format!(
                "Configured the environment and stacks of generation {generation_value} without restarting the pod"
            )
        };
        ctx.event(ws, EventType::Normal, "Initialized", note).await;
    }
    conditions::remove(&mut status.conditions, STALLED);
    conditions::set(
        &mut status.conditions,
        READY,
        true,
        "Succeeded",
        "",
        generation,
    );
    write_status(ctx, &namespace, &name, &before, &status).await?;
    // Notices an agent that restarted without a StatefulSet change.
    Ok(Action::requeue(Duration::from_secs(60)))
}

async fn write_status(
    ctx: &WorkspaceContext,
    namespace: &str,
    name: &str,
    before: &WorkspaceStatus,
    after: &WorkspaceStatus,
) -> Result<(), WorkspaceError> {
    if before.observed_generation == after.observed_generation
        && before.address == after.address
        && before.pulumi_version == after.pulumi_version
        && conditions::same(&before.conditions, &after.conditions)
    {
        return Ok(());
    }
    let patch = json!({
        "apiVersion": "auto.pulumi.com/v1alpha1",
        "kind": "Workspace",
        "status": after,
    });
    let api: Api<Workspace> = Api::namespaced(ctx.client.clone(), namespace);
    api.patch_status(
        name,
        &PatchParams::apply(STATUS_MANAGER).force(),
        &Patch::Apply(&patch),
    )
    .await
    .map_err(kube_err("writing the Workspace status"))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn versions_compare() {
        assert_eq!(parse_version("v3.274.1"), Some((3, 274, 1)));
        assert!(parse_version("v3.197.0").is_some_and(|v| v < STRUCTURED_CONFIG_MIN_VERSION));
        assert!(
            parse_version("3.202.0-alpha.1").is_some_and(|v| v >= STRUCTURED_CONFIG_MIN_VERSION)
        );
        assert_eq!(parse_version("garbage"), None);
    }
}
