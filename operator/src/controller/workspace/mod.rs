//! Workspace controller: a Workspace becomes a Service + StatefulSet running the agent; once the
//! agent answers, the Workspace's stacks are selected and configured through its RPCs.
//!
//! Beyond PKO: the pod is rolled only when what it runs changes (the revision hash covers the
//! pod template, not the stacks), so a config change is pushed over RPC instead of restarting
//! the pod; the agent has a readiness probe; a restarted agent (new instance id in its answers)
//! is initialized again without touching the pod; a pod template that would make a restricted
//! workspace run as root is refused with a Stalled condition; a failed init container (bad
//! artifact digest, …) is reported in the Ready condition.
//!
//! Layout: `reconcile` runs the `phases` in order and writes the status they draft once
//! (`status`, the one writer); `rules` holds the decisions that need no apiserver or agent;
//! `pod` builds the Service and StatefulSet, `env` the variables pushed to the agent; `idle`
//! stops and starts the pod of a workspace with `spec.idle` (scale to zero).

pub mod compat;
pub mod env;
pub mod idle;
pub mod merge;
mod phases;
pub mod pod;
mod reconcile;
pub mod restricted;
mod rules;
mod status;
#[cfg(test)]
mod tests;

use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError};

use futures::channel::mpsc::UnboundedSender;
use k8s_openapi::api::apps::v1::StatefulSet;
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, PartialObjectMeta};
use kube::runtime::controller::{self, Action};
use kube::runtime::events::{EventType, Recorder};
use kube::runtime::reflector::ObjectRef;
use kube::runtime::watcher;
use kube::{Client, Resource, ResourceExt};
use pko_agent_api::proto as pb;
use pko_api::workspace::{ConfigItem, Workspace};

use crate::agent_client::{AgentAuth, AgentError, Agents};
use crate::controller::backoff::{self, Backoff, Verdict};
use crate::controller::instrument::{self, Observed, Wakeup};
use crate::controller::keys::{INITIALIZED_ANNOTATION, WORKSPACE_COMPONENT_LABEL};
use crate::controller::kit::{self, Kit};
use crate::metrics::Metrics;
use crate::runtime_metrics::names;
use rules::Initialized;

pub use pod::PodSettings;

const CONTROLLER: &str = "workspace";

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

impl kit::FromKube for WorkspaceError {
    fn from_kube(what: String, source: kube::Error) -> Self {
        Self::Kube { what, source }
    }
}

impl kit::MetricLabel for WorkspaceError {
    fn metric_label(&self) -> &'static str {
        match self {
            Self::NoNamespace => "no_namespace",
            Self::Kube { .. } => "kube",
            Self::Agent(_) => "agent",
            Self::Pod(_) => "pod",
            Self::Encode(_) => "encode",
            Self::AgentUnavailable { .. } => "agent_unavailable",
        }
    }
}

impl WorkspaceError {
    /// Whether retrying may help (see [`backoff`]).
    fn verdict(&self) -> Verdict {
        match self {
            Self::Kube { source, .. }
            | Self::Agent(
                AgentError::Credentials { source, .. } | AgentError::TokenRequest { source, .. },
            ) => backoff::classify(source),
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
    /// Workspace uid → what its pod's agent can do (asked once per pod).
    facts: Mutex<HashMap<String, AgentFacts>>,
    /// Where others (the Update controller, finding an agent not initialized) ask for a
    /// Workspace to be reconciled now.
    wakeup: Wakeup<Workspace>,
    /// The status writes of this controller, so a reconcile never decides on an older view.
    own_writes: kit::OwnWrites,
    /// Workspace uid → the Service and StatefulSet this process last applied for it.
    workloads: Mutex<HashMap<String, rules::AppliedWorkload>>,
}

/// What one workspace pod's agent can do, and the image it came from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct AgentFacts {
    pub(crate) pod_uid: String,
    pub(crate) image: String,
    pub(crate) features: compat::Features,
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
            facts: Mutex::new(HashMap::new()),
            wakeup: Wakeup::new(),
            own_writes: Default::default(),
            workloads: Mutex::new(HashMap::new()),
        }
    }

    /// Sends a Workspace to be reconciled now (see [`Self::wakeup`]).
    pub fn waker(&self) -> UnboundedSender<ObjectRef<Workspace>> {
        self.wakeup.sender()
    }

    /// Writes a drafted status (see [`status::write_status`]) and remembers the version written.
    async fn write_status(
        &self,
        namespace: &str,
        name: &str,
        before: &pko_api::workspace::WorkspaceStatus,
        after: &pko_api::workspace::WorkspaceStatus,
    ) -> Result<(), WorkspaceError> {
        let written = status::write_status(&self.client, namespace, name, before, after).await?;
        if let Some(ws) = written {
            self.own_writes.record(&ws.metadata);
        }
        Ok(())
    }

    fn workload_for(&self, uid: &str) -> Option<rules::AppliedWorkload> {
        self.workloads
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .get(uid)
            .copied()
    }

    fn set_workload(&self, uid: &str, value: Option<rules::AppliedWorkload>) {
        let mut map = self
            .workloads
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        match value {
            Some(v) => map.insert(uid.to_owned(), v),
            None => map.remove(uid),
        };
    }

    fn facts_for(&self, uid: &str) -> Option<AgentFacts> {
        self.facts
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .get(uid)
            .cloned()
    }

    fn set_facts(&self, uid: &str, value: Option<AgentFacts>) {
        let mut map = self.facts.lock().unwrap_or_else(PoisonError::into_inner);
        match value {
            Some(v) => map.insert(uid.to_owned(), v),
            None => map.remove(uid),
        };
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
    statefulsets: Api<PartialObjectMeta<StatefulSet>>,
    ctx: Arc<WorkspaceContext>,
    concurrency: u16,
    shutdown: impl std::future::Future<Output = ()> + Send + Sync + 'static,
) {
    let probe = ctx
        .metrics
        .runtime
        .controller(names::WORKSPACE, concurrency.max(1));
    let owned =
        watcher::Config::default().labels(&format!("{}=workspace", WORKSPACE_COMPONENT_LABEL));
    let controller =
        instrument::controller_of_changes(&probe, api, watcher::Config::default().any_semantic());
    let controller = controller.woken_by(&probe, &ctx.wakeup);
    let events = controller
        .owns_observed(&probe, statefulsets, owned)
        .with_config(controller::Config::default().concurrency(concurrency))
        .graceful_shutdown_on(shutdown)
        .run(
            instrument::reconciler(&probe, reconcile::reconcile),
            instrument::error_policy(&probe, error_policy),
            ctx,
        );
    instrument::drive(CONTROLLER, &probe, events).await;
}

fn error_policy(ws: Arc<Workspace>, err: &WorkspaceError, ctx: Arc<WorkspaceContext>) -> Action {
    kit::error_policy(CONTROLLER, &*ws, err, &ctx.metrics, &ctx.backoff)
}

/// How the operator proves itself to the workspace's agent, by its contract (`compat.rs`): the
/// workspace's credentials (made when missing) or a token for its audience. A Workspace whose
/// annotation names no contract is stalled by its controller before any agent is called; here
/// it counts as pko-rs's.
pub async fn agent_auth(
    agents: &Agents,
    ws: &Workspace,
    name: &str,
    namespace: &str,
) -> Result<AgentAuth, AgentError> {
    match compat::agent_mode(ws.metadata.annotations.as_ref()).unwrap_or_default() {
        compat::AgentMode::Pko => Ok(AgentAuth::Kube {
            audience: compat::audience(name, namespace),
        }),
        compat::AgentMode::PkoRs => {
            let owner = crate::controller::kit::controller_owner(ws);
            let credentials = agents
                .ensure_credentials(name, namespace, owner.as_ref())
                .await?;
            Ok(AgentAuth::Pinned(credentials))
        }
    }
}

/// The agent instance the Workspace controller last initialized in the workspace's pod, from
/// the pod's annotation (none before the first initialization).
pub fn initialized_instance(pod: &Pod) -> Option<String> {
    Initialized::from_annotation(pod.annotations().get(INITIALIZED_ANNOTATION)?)
        .map(|told| told.instance)
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
