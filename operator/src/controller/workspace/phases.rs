//! The phases of a Workspace reconcile, in order: apply the Service and StatefulSet, wait for
//! the pod, connect to the agent and check its Pulumi version, resolve the environment and
//! initialise the agent, configure the stacks. Each phase either continues with what it found
//! or ends the reconcile; the status it drafted is written once, by the caller.

use std::collections::BTreeMap;
use std::time::Duration;

use k8s_openapi::api::apps::v1::StatefulSet;
use k8s_openapi::api::core::v1::{Pod, Service};
use kube::api::{Api, DeleteParams, Patch, PatchParams, Preconditions};
use kube::runtime::controller::Action;
use kube::runtime::events::EventType;
use kube::{Client, ResourceExt};
use pko_agent_api::client::AgentClient;
use pko_agent_api::proto as pb;
use pko_api::workspace::{Workspace, WorkspaceStatus};
use tracing::{debug, info};

use super::compat::{self, AgentMode, EnvDelivery, Features};
use super::rules::{self, Initialization, Initialized};
use super::status::{self, STALLED};
use super::{AgentFacts, WorkspaceContext, WorkspaceError, env, pod, to_pb_item};
use crate::agent_client::{AgentAuth, AgentError};
use crate::controller::conditions;
use crate::controller::keys::{
    APPLY_MANAGER, ENV_IN_POD_ANNOTATION, INITIALIZATION_FAILED, INITIALIZED_ANNOTATION,
    INITIALIZING, INSTALLATION_FAILED, INSTALLING,
};
use crate::controller::kit::FromKube;
use crate::controller::takeover;

/// No pod watch: look again this soon for an init container failure or for readiness.
pub(super) const POD_NOT_READY_REQUEUE: Duration = Duration::from_secs(10);
/// The development kubelet annotates the agent's port right after it starts the pod.
pub(super) const DEV_PORT_REQUEUE: Duration = Duration::from_secs(2);
/// Like a pod whose Secret is missing: look again for the Secret or ConfigMap to appear.
pub(super) const ENV_UNAVAILABLE_REQUEUE: Duration = Duration::from_secs(15);
/// A failed install or stack initialisation is stalled: retry now and then, not in a loop.
pub(super) const INITIALIZATION_RETRY: Duration = Duration::from_secs(60);
/// Notices an agent that restarted without a StatefulSet change.
pub(super) const READY_RECHECK: Duration = Duration::from_secs(60);
// An agent connection idle since the last check is closed (and its sweep run) before the next
// check: a fleet at rest keeps no connection open between checks.
const _: () = assert!(
    crate::agent_client::CONNECTION_IDLE.as_secs()
        + crate::agent_client::CONNECTION_IDLE.as_secs() / 4
        < READY_RECHECK.as_secs()
);
/// The environment moves to the pod spec: apply the new StatefulSet at once.
pub(super) const ENV_TO_POD_REQUEUE: Duration = Duration::from_millis(100);

/// Where a phase leaves the reconcile.
#[derive(Debug)]
pub(super) enum Phase<T> {
    /// On to the next phase with what this one found.
    Continue(T),
    /// The reconcile ends here.
    Done(End),
}

/// How a reconcile ends.
#[derive(Debug, PartialEq, Eq)]
pub(super) enum End {
    /// The drafted status is written, then the action.
    Report(Action),
    /// Nothing learned: the status is left as it is.
    Quiet(Action),
}

/// The value of a phase that continues; from one that does not, returns its end.
macro_rules! proceed {
    ($phase:expr) => {
        match $phase {
            $crate::controller::workspace::phases::Phase::Continue(value) => value,
            $crate::controller::workspace::phases::Phase::Done(end) => return Ok(end),
        }
    };
}
pub(super) use proceed;

/// One reconcile of a Workspace: what every phase reads, and the status they draft.
pub(super) struct Run<'a> {
    pub(super) ws: &'a Workspace,
    pub(super) ctx: &'a WorkspaceContext,
    pub(super) namespace: String,
    pub(super) name: String,
    pub(super) uid: String,
    pub(super) generation: Option<i64>,
    /// The status as read.
    pub(super) before: WorkspaceStatus,
    /// The status to write.
    pub(super) status: WorkspaceStatus,
    /// The pod differs from the template by the source revision alone: its agent is given
    /// the new one ([`rules::Rollout::NewRevision`]).
    pub(super) new_revision: bool,
    /// The workspace pod as the pod phase read it (`None`: not read yet).
    pub(super) pod: Option<Option<Pod>>,
}

impl<'a> Run<'a> {
    pub(super) fn new(
        ws: &'a Workspace,
        ctx: &'a WorkspaceContext,
    ) -> Result<Self, WorkspaceError> {
        Ok(Self {
            ws,
            ctx,
            namespace: ws.namespace().ok_or(WorkspaceError::NoNamespace)?,
            name: ws.name_any(),
            uid: ws.metadata.uid.clone().unwrap_or_default(),
            generation: ws.metadata.generation,
            before: ws.status.clone().unwrap_or_default(),
            status: status::draft(ws),
            new_revision: false,
            pod: None,
        })
    }

    async fn warn(&self, reason: &str, note: String) {
        self.ctx
            .event(self.ws, EventType::Warning, reason, note)
            .await;
    }

    /// Ends the reconcile `Stalled=True`/`Ready=False` for `reason`, with a Warning Event
    /// (`event_reason`) unless the workspace is already stalled.
    async fn stall_on_spec(&mut self, event_reason: &str, reason: &str, message: String) -> End {
        if !conditions::is_true(&self.status.conditions, STALLED) {
            self.warn(event_reason, message.clone()).await;
        }
        status::mark_not_ready(&mut self.status, true, reason, &message, self.generation);
        End::Report(Action::await_change())
    }

    /// Reports a step as PKO does while it runs (`Installing`, `Initializing`): `Ready=False`
    /// with `reason`, nothing stalled, written now. Not while a failed step of this generation
    /// is retried: its stall stays, rather than flip to the step and back on every retry.
    async fn report_step(&mut self, reason: &str, message: &str) -> Result<(), WorkspaceError> {
        if status::retrying_a_failed_step(&self.status, self.generation) {
            return Ok(());
        }
        conditions::remove(&mut self.status.conditions, STALLED);
        status::mark_not_ready(&mut self.status, false, reason, message, self.generation);
        self.ctx
            .write_status(&self.namespace, &self.name, &self.before, &self.status)
            .await?;
        self.before = self.status.clone();
        Ok(())
    }

    /// Ends the reconcile `Stalled=True`/`Ready=False` after a failed agent call, retried
    /// after [`INITIALIZATION_RETRY`]; a Warning Event unless the same stall is reported.
    async fn stall_on_agent(&mut self, event_reason: &str, reason: &str, message: String) -> End {
        let known = conditions::get(&self.status.conditions, STALLED)
            .is_some_and(|c| c.status == "True" && c.reason == reason && c.message == message);
        if !known {
            self.warn(event_reason, message.clone()).await;
        }
        status::mark_not_ready(&mut self.status, true, reason, &message, self.generation);
        End::Report(Action::requeue(INITIALIZATION_RETRY))
    }
}

/// The Workspace is being deleted: the agent is forgotten and the status says so.
pub(super) fn deleting(run: &mut Run<'_>) -> End {
    status::mark_deleting(&mut run.status, run.generation);
    run.ctx.set_initialized(&run.uid, None);
    run.ctx.set_workload(&run.uid, None);
    run.ctx.set_facts(&run.uid, None);
    End::Report(Action::await_change())
}

/// What the apply phase made.
#[derive(Debug)]
pub(super) struct Applied {
    /// How the agent is called.
    pub(super) auth: AgentAuth,
    pub(super) layout: pod::AgentLayout,
    pub(super) statefulset: StatefulSet,
}

/// Ensures the agent credentials (pko-rs's contract), then applies the Service and the
/// StatefulSet; a pod template that cannot be run, or an unknown agent contract, stalls the
/// workspace.
pub(super) async fn apply(run: &mut Run<'_>) -> Result<Phase<Applied>, WorkspaceError> {
    let mode = match compat::agent_mode(run.ws.metadata.annotations.as_ref()) {
        Ok(mode) => mode,
        Err(message) => {
            run.status.address = None;
            let end = run
                .stall_on_spec("SpecInvalid", "SpecInvalid", message)
                .await;
            return Ok(Phase::Done(end));
        }
    };
    let workload_owner = pod::controller_owner(run.ws)?;
    let (layout, auth) = match mode {
        AgentMode::PkoRs => {
            let credentials = run
                .ctx
                .agents
                .ensure_credentials(&run.name, &run.namespace, Some(&workload_owner))
                .await?;
            (
                pod::AgentLayout::pinned(&credentials.fingerprint),
                AgentAuth::Pinned(credentials),
            )
        }
        AgentMode::Pko => {
            let image = &run.ctx.settings.pko_agent_image;
            let marked = marked_env_image(&run.ctx.client, &run.namespace, &run.name).await?;
            let learned = run.ctx.facts_for(&run.uid);
            let env_in_pod = compat::env_in_pod_spec(
                mode,
                image,
                learned.as_ref().map(|f| (f.image.as_str(), f.features)),
                marked.as_deref(),
            );
            (
                pod::AgentLayout::Pko { env_in_pod },
                AgentAuth::Kube {
                    audience: compat::audience(&run.name, &run.namespace),
                },
            )
        }
    };
    let desired = match pod::desired_statefulset(
        run.ws,
        &run.name,
        &run.namespace,
        &workload_owner,
        &run.ctx.settings,
        &layout,
    ) {
        Ok(sts) => sts,
        Err(
            e @ (pod::PodError::Restricted(_)
            | pod::PodError::CrossNamespaceProgram { .. }
            | pod::PodError::InvalidFluxUrl(_)),
        ) => {
            run.status.address = None;
            let end = run
                .stall_on_spec("SpecInvalid", "SpecInvalid", e.to_string())
                .await;
            return Ok(Phase::Done(end));
        }
        Err(e) => return Err(e.into()),
    };
    let service = pod::desired_service(run.ws, &run.name, &run.namespace, &workload_owner);
    let statefulset = ensure_workload(run, &service, &desired).await?;
    Ok(Phase::Continue(Applied {
        auth,
        layout,
        statefulset,
    }))
}

/// The agent image the current StatefulSet's pod template marks as unable to take the
/// environment over RPC (none when there is no StatefulSet yet).
async fn marked_env_image(
    client: &Client,
    namespace: &str,
    workspace: &str,
) -> Result<Option<String>, WorkspaceError> {
    let statefulsets: Api<StatefulSet> = Api::namespaced(client.clone(), namespace);
    let current = statefulsets
        .get_opt(&pod::workload_name(workspace))
        .await
        .map_err(WorkspaceError::kube("reading the workspace StatefulSet"))?;
    Ok(current
        .and_then(|sts| sts.spec)
        .and_then(|spec| spec.template.metadata)
        .and_then(|meta| meta.annotations)
        .and_then(|mut a| a.remove(ENV_IN_POD_ANNOTATION)))
}

/// Server-side applies the Service, then the StatefulSet (returned as the apiserver has it).
/// The workspace's StatefulSet as it is, each object applied only unless this process applied
/// the same one and it has not moved since: a reconcile of a running workspace reads both
/// instead of writing them again, and a new pod template (a Program edit) writes the
/// StatefulSet alone.
async fn ensure_workload(
    run: &Run<'_>,
    service: &Service,
    desired: &StatefulSet,
) -> Result<StatefulSet, WorkspaceError> {
    let (service_digest, sts_digest) = (digest(service), digest(desired));
    let name = pod::workload_name(&run.name);
    let services: Api<Service> = Api::namespaced(run.ctx.client.clone(), &run.namespace);
    let statefulsets: Api<StatefulSet> = Api::namespaced(run.ctx.client.clone(), &run.namespace);
    let (live, must) = match run.ctx.workload_for(&run.uid) {
        Some(last) => {
            let (live, present) = futures::try_join!(
                async {
                    statefulsets
                        .get_opt(&name)
                        .await
                        .map_err(WorkspaceError::kube("reading the workspace StatefulSet"))
                },
                async {
                    services
                        .get_metadata_opt(&name)
                        .await
                        .map_err(WorkspaceError::kube("reading the workspace Service"))
                },
            )?;
            let generation = live.as_ref().and_then(|s| s.metadata.generation);
            let must = rules::must_apply(
                Some(&last),
                service_digest,
                sts_digest,
                generation,
                present.is_some(),
            );
            (live, must)
        }
        None => (None, rules::must_apply(None, 0, 0, None, false)),
    };
    if must.service {
        takeover::apply(&services, &name, APPLY_MANAGER, service)
            .await
            .map_err(WorkspaceError::kube("applying the workspace Service"))?;
    }
    let applied = match live {
        Some(live) if !must.statefulset => live,
        _ => apply_statefulset(&statefulsets, &name, desired).await?,
    };
    let record = rules::AppliedWorkload {
        service: service_digest,
        statefulset: sts_digest,
        generation: applied.metadata.generation,
    };
    run.ctx.set_workload(&run.uid, Some(record));
    Ok(applied)
}

/// Server-side applies the StatefulSet. One made with `RollingUpdate` (by PKO, or by an
/// earlier pko-rs) holds the `rollingUpdate` its defaulting added, which no apply owns and
/// `OnDelete` forbids: it is cleared by a merge patch, and the apply made again.
async fn apply_statefulset(
    statefulsets: &Api<StatefulSet>,
    name: &str,
    desired: &StatefulSet,
) -> Result<StatefulSet, WorkspaceError> {
    let what = "applying the workspace StatefulSet";
    match takeover::apply(statefulsets, name, APPLY_MANAGER, desired).await {
        Err(kube::Error::Api(e)) if rules::rolling_update_left(e.code, &e.message) => {
            info!(
                statefulset = name,
                "clearing the rolling update of a StatefulSet that now updates OnDelete"
            );
            let patch = serde_json::json!({"spec": {"updateStrategy": {
                "type": pod::ON_DELETE, "rollingUpdate": null}}});
            statefulsets
                .patch(name, &PatchParams::default(), &Patch::Merge(&patch))
                .await
                .map_err(WorkspaceError::kube(what))?;
            takeover::apply(statefulsets, name, APPLY_MANAGER, desired)
                .await
                .map_err(WorkspaceError::kube(what))
        }
        other => other.map_err(WorkspaceError::kube(what)),
    }
}

/// A digest of an object as built (stable within this process, which is all it is kept for).
fn digest(object: &impl serde::Serialize) -> u64 {
    use std::hash::{DefaultHasher, Hash, Hasher};
    let mut hasher = DefaultHasher::new();
    // Serializing objects built here cannot fail; an empty value would only force an apply.
    serde_json::to_vec(object)
        .unwrap_or_default()
        .hash(&mut hasher);
    hasher.finish()
}

/// Continues once the StatefulSet is ready; until then `Ready=False` says why, naming a
/// failed init container (with a Warning Event when that is news).
pub(super) async fn pod_ready(
    run: &mut Run<'_>,
    sts: &StatefulSet,
) -> Result<Phase<()>, WorkspaceError> {
    let observed = sts
        .status
        .as_ref()
        .is_some_and(|s| s.observed_generation == sts.metadata.generation);
    // Under OnDelete the operator compares the pod with the template (PKO's layout leaves it to
    // the StatefulSet controller).
    if observed && rules::on_delete(sts) {
        let pod = workspace_pod(&run.ctx.client, &run.namespace, &run.name).await;
        match rules::rollout(sts, pod.as_ref()) {
            rules::Rollout::Current => {}
            rules::Rollout::NewRevision => run.new_revision = true,
            rules::Rollout::Replace => return Ok(Phase::Done(replace_pod(run, pod).await?)),
        }
        run.pod = Some(pod);
    }
    let Some((reason, mut message)) = rules::not_ready(sts) else {
        return Ok(Phase::Continue(()));
    };
    let failure = init_failure(&run.ctx.client, &run.namespace, &run.name).await;
    if failure.is_none() && status::pod_wait_reported(&run.before, run.generation) {
        return Ok(Phase::Done(End::Quiet(Action::requeue(
            POD_NOT_READY_REQUEUE,
        ))));
    }
    if let Some(failure) = failure {
        let known = conditions::get(&run.status.conditions, status::READY)
            .is_some_and(|c| c.message == failure);
        if !known {
            run.warn("InitializationFailure", failure.clone()).await;
        }
        message = failure;
    }
    status::mark_pod_not_ready(&mut run.status, reason, &message, run.generation);
    Ok(Phase::Done(End::Report(Action::requeue(
        POD_NOT_READY_REQUEUE,
    ))))
}

/// Deletes a workspace pod made from an older template (the StatefulSet makes a new one from
/// the current template); `Ready=False` says the pod is being updated.
async fn replace_pod(run: &mut Run<'_>, pod: Option<Pod>) -> Result<End, WorkspaceError> {
    if let Some(pod) = pod.filter(|p| p.metadata.deletion_timestamp.is_none()) {
        let pods: Api<Pod> = Api::namespaced(run.ctx.client.clone(), &run.namespace);
        let name = pod.name_any();
        // Only this pod: one the StatefulSet made since is current already.
        let params = DeleteParams {
            preconditions: Some(Preconditions {
                uid: pod.metadata.uid.clone(),
                resource_version: None,
            }),
            ..DeleteParams::default()
        };
        match pods.delete(&name, &params).await {
            Ok(_) => info!(pod = %name, "replacing the workspace pod: its template changed"),
            Err(kube::Error::Api(e)) if e.code == 404 || e.code == 409 => {}
            Err(e) => {
                return Err(WorkspaceError::kube("deleting the outdated workspace pod")(
                    e,
                ));
            }
        }
    }
    run.ctx.set_initialized(&run.uid, None);
    status::mark_pod_not_ready(
        &mut run.status,
        "RollingUpdate",
        rules::POD_UPDATING,
        run.generation,
    );
    Ok(End::Report(Action::requeue(POD_NOT_READY_REQUEUE)))
}

/// A failed init container of the workspace pod (none when the pod cannot be read).
async fn init_failure(client: &Client, namespace: &str, workspace: &str) -> Option<String> {
    let pods: Api<Pod> = Api::namespaced(client.clone(), namespace);
    let pod = pods
        .get_opt(&format!("{}-0", pod::workload_name(workspace)))
        .await
        .ok()??;
    rules::init_failure(&pod)
}

/// What the workspace pod's annotation says its agent was told (none when unreadable).
async fn told_on_pod(client: &Client, namespace: &str, workspace: &str) -> Option<Initialized> {
    let pods: Api<Pod> = Api::namespaced(client.clone(), namespace);
    let pod = pods
        .get_opt(&format!("{}-0", pod::workload_name(workspace)))
        .await
        .ok()??;
    Initialized::from_annotation(pod.annotations().get(INITIALIZED_ANNOTATION)?)
}

/// Annotates the workspace pod with what its agent was told. The Update controller runs an
/// operation only on the agent instance named there, so a failed write fails the reconcile
/// (and the agent is told again on the next one) rather than leave Updates waiting.
async fn record_on_pod(
    client: &Client,
    namespace: &str,
    workspace: &str,
    told: &Initialized,
) -> Result<(), WorkspaceError> {
    let pods: Api<Pod> = Api::namespaced(client.clone(), namespace);
    let name = format!("{}-0", pod::workload_name(workspace));
    let patch = serde_json::json!({"metadata": {"annotations": {INITIALIZED_ANNOTATION: told.annotation()}}});
    pods.patch(&name, &PatchParams::default(), &Patch::Merge(&patch))
        .await
        .map_err(WorkspaceError::kube(format!(
            "recording the initialization on pod {name}"
        )))?;
    Ok(())
}

/// A connected agent and what it said of itself.
pub(super) struct Agent {
    pub(super) client: AgentClient,
    /// Changes when the agent restarts.
    pub(super) instance: String,
    /// Its Pulumi CLI version.
    pub(super) version: String,
    /// What it can do beyond PKO's protocol.
    pub(super) features: Features,
    /// `spec.env` is on its container.
    pub(super) env_in_pod: bool,
}

/// Connects to the agent, asks its Pulumi version and (once per pod) its capabilities; the
/// address and the version go to the status.
pub(super) async fn connect(
    run: &mut Run<'_>,
    applied: &Applied,
) -> Result<Phase<Agent>, WorkspaceError> {
    let agents = &run.ctx.agents;
    let address = match agents.address(&run.name, &run.namespace, &applied.statefulset) {
        Ok(a) => a,
        Err(AgentError::NoDevPort(_)) => {
            return Ok(Phase::Done(End::Quiet(Action::requeue(DEV_PORT_REQUEUE))));
        }
        Err(e) => return Err(e.into()),
    };
    let connected = agents
        .client(&run.name, &run.namespace, &address, &applied.auth)
        .await;
    let mut client = match connected {
        Ok(c) => c,
        Err(e @ (AgentError::NoServiceAccount | AgentError::TokenRequest { .. })) => {
            return Err(e.into());
        }
        Err(e) => {
            let message = format!("cannot connect to the workspace agent at {address}: {e}");
            run.warn("ConnectionFailure", message.clone()).await;
            return Err(WorkspaceError::AgentUnavailable {
                reason: "ConnectionFailed".into(),
                message,
            });
        }
    };
    let answer = match client.pulumi_version(pb::PulumiVersionRequest {}).await {
        Ok(v) => v,
        Err(s) => {
            agents.forget(&run.name, &run.namespace);
            return Err(refused_or_unavailable(run, "PulumiVersion", &s));
        }
    };
    let header = answer
        .metadata()
        .get(pko_agent_api::INSTANCE_HEADER)
        .and_then(|v| v.to_str().ok())
        .map(str::to_owned);
    let version = answer.into_inner().version;
    let pod = match run.pod.take() {
        Some(pod) => pod,
        None => workspace_pod(&run.ctx.client, &run.namespace, &run.name).await,
    };
    let features = capabilities(run, &mut client, pod.as_ref()).await?;
    run.status.pulumi_version = Some(version.clone());
    run.status.address = Some(address);
    Ok(Phase::Continue(Agent {
        client,
        instance: compat::instance_of(header.as_deref(), pod.as_ref()),
        version,
        features,
        env_in_pod: applied.layout == (pod::AgentLayout::Pko { env_in_pod: true }),
    }))
}

/// A failed call as the workspace's error: under PKO's auth mode a refusal says what to fix.
fn refused_or_unavailable(run: &Run<'_>, call: &str, s: &tonic::Status) -> WorkspaceError {
    let account = format!(
        "{}/{}",
        run.namespace,
        run.ws
            .spec
            .service_account_name
            .as_deref()
            .filter(|n| !n.is_empty())
            .unwrap_or(pko_api::workspace::DEFAULT_SERVICE_ACCOUNT_NAME)
    );
    let operator = run.ctx.agents.service_account().map(ToString::to_string);
    let message = compat::refusal(s.code(), s.message(), &account, operator.as_deref())
        .unwrap_or_else(|| format!("{call} failed: {}", s.message()));
    WorkspaceError::AgentUnavailable {
        reason: format!("{:?}", s.code()),
        message,
    }
}

/// The workspace pod (none when it cannot be read).
async fn workspace_pod(client: &Client, namespace: &str, workspace: &str) -> Option<Pod> {
    let pods: Api<Pod> = Api::namespaced(client.clone(), namespace);
    pods.get_opt(&format!("{}-0", pod::workload_name(workspace)))
        .await
        .ok()
        .flatten()
}

/// What the agent can do: known for this pod already, or asked (`Capabilities`; PKO's agent
/// answers Unimplemented) and remembered for it.
async fn capabilities(
    run: &Run<'_>,
    client: &mut AgentClient,
    pod: Option<&Pod>,
) -> Result<Features, WorkspaceError> {
    let pod_uid = pod.and_then(|p| p.metadata.uid.clone()).unwrap_or_default();
    if let Some(facts) = run.ctx.facts_for(&run.uid)
        && !pod_uid.is_empty()
        && facts.pod_uid == pod_uid
    {
        return Ok(facts.features);
    }
    let answer = client.capabilities(pb::CapabilitiesRequest {}).await;
    let features =
        match compat::features(answer.as_ref().map(|r| r.get_ref()).map_err(|s| s.code())) {
            Some(f) => f,
            None => {
                run.ctx.agents.forget(&run.name, &run.namespace);
                let s = answer.err().unwrap_or_else(|| tonic::Status::unknown(""));
                return Err(refused_or_unavailable(run, "Capabilities", &s));
            }
        };
    let image = pod
        .and_then(bootstrap_image)
        .unwrap_or_else(|| run.ctx.settings.pko_agent_image.clone());
    info!(?features, %image, "agent capabilities");
    run.ctx.set_facts(
        &run.uid,
        Some(AgentFacts {
            pod_uid,
            image,
            features,
        }),
    );
    Ok(features)
}

/// The image the pod's agent was copied from.
fn bootstrap_image(pod: &Pod) -> Option<String> {
    pod.spec
        .as_ref()?
        .init_containers
        .as_ref()?
        .iter()
        .find(|c| c.name == "bootstrap")?
        .image
        .clone()
}

/// Stalls the workspace when the agent's Pulumi cannot take the stacks' config.
pub(super) async fn check_version(run: &mut Run<'_>, agent: &Agent) -> Phase<()> {
    match rules::unsupported_config(&run.ws.spec, &agent.version) {
        None => Phase::Continue(()),
        Some(message) => Phase::Done(
            run.stall_on_spec(
                "StackInitializationFailure",
                "IncompatibleConfiguration",
                message,
            )
            .await,
        ),
    }
}

/// Resolves the variables pushed to the agent; a missing source makes the workspace not
/// ready (not stalled) until it appears.
pub(super) async fn environment(run: &mut Run<'_>) -> Phase<BTreeMap<String, String>> {
    match env::resolve(&run.ctx.client, &run.namespace, &run.ws.spec.env).await {
        Ok(e) => Phase::Continue(e),
        Err(message) => {
            status::clear_failure_stall(&mut run.status);
            status::mark_not_ready(
                &mut run.status,
                false,
                "EnvironmentUnavailable",
                &message,
                run.generation,
            );
            Phase::Done(End::Report(Action::requeue(ENV_UNAVAILABLE_REQUEUE)))
        }
    }
}

/// What the stacks phase still has to do once the agent has its environment.
pub(super) struct Pending {
    wanted: Initialized,
    fresh: bool,
    /// The source revision the agent was given in place, if it took a new one.
    revision: Option<String>,
}

/// The Workspace's Flux-style source as an `UpdateSource` request.
fn revision_request(run: &Run<'_>) -> Option<pb::UpdateSourceRequest> {
    let flux = run.ws.spec.flux.as_ref()?;
    Some(pb::UpdateSourceRequest {
        url: flux.url.clone().unwrap_or_default(),
        digest: flux.digest.clone().unwrap_or_default(),
        dir: flux.dir.clone().unwrap_or_default(),
        max_size_bytes: run
            .ctx
            .settings
            .max_artifact_bytes
            .as_deref()
            .and_then(|m| m.trim().parse().ok()),
    })
}

/// Pushes the environment (first, as every later command may need it) and installs the
/// program's dependencies on a fresh agent; nothing when the agent knows it all.
pub(super) async fn initialise(
    run: &mut Run<'_>,
    agent: &mut Agent,
    env: BTreeMap<String, String>,
) -> Result<Phase<Option<Pending>>, WorkspaceError> {
    let revision = run.new_revision.then(|| revision_request(run)).flatten();
    let wanted = Initialized {
        instance: agent.instance.clone(),
        generation: run.generation.unwrap_or(0),
        env_digest: env::digest(&env),
        source: revision.as_ref().map(|r| r.digest.clone()),
    };
    // After an operator restart, memory is empty: the pod says what its agent was told.
    let done = match run.ctx.initialized_for(&run.uid) {
        Some(done) => Some(done),
        None => told_on_pod(&run.ctx.client, &run.namespace, &run.name).await,
    };
    let give_revision = rules::needs_revision(done.as_ref(), &wanted);
    let mut fresh = match rules::initialization(done.as_ref(), &wanted) {
        Initialization::UpToDate => {
            debug!(instance = %agent.instance, "the agent knows the workspace already");
            return Ok(Phase::Continue(None));
        }
        Initialization::Fresh => true,
        Initialization::Reconfigure => false,
    };
    match compat::env_delivery(agent.features, agent.env_in_pod) {
        EnvDelivery::Rpc => {
            let request = pb::SetEnvironmentVariablesRequest {
                env: env.into_iter().collect(),
            };
            if let Err(s) = agent.client.set_environment_variables(request).await {
                run.ctx.agents.forget(&run.name, &run.namespace);
                return Err(WorkspaceError::AgentUnavailable {
                    reason: INITIALIZATION_FAILED.into(),
                    message: format!("Failed to set the environment: {}", s.message()),
                });
            }
        }
        EnvDelivery::OnPod => {}
        EnvDelivery::MoveToPod => return Ok(Phase::Done(move_env_to_pod(run).await)),
    }
    let mut given = None;
    if give_revision && let Some(request) = revision {
        match new_revision(run, agent, request).await? {
            Phase::Continue(Some(digest)) => {
                // A new program: installed and configured as in a new pod.
                fresh = true;
                given = Some(digest);
            }
            Phase::Continue(None) => {}
            Phase::Done(end) => return Ok(Phase::Done(end)),
        }
    }
    if fresh {
        run.report_step(
            INSTALLING,
            "Installing packages and plugins required by the program",
        )
        .await?;
    }
    if fresh && let Err(s) = agent.client.install(pb::InstallRequest {}).await {
        let message = format!("Installation failed: {}", s.message());
        let end = run
            .stall_on_agent("InstallationFailure", INSTALLATION_FAILED, message)
            .await;
        return Ok(Phase::Done(end));
    }
    Ok(Phase::Continue(Some(Pending {
        wanted,
        fresh,
        revision: given,
    })))
}

/// Gives the running agent the Workspace's source revision; the digest when it took a new one
/// (`None`: it had it). An agent that cannot take it (another image's) has its pod replaced.
async fn new_revision(
    run: &mut Run<'_>,
    agent: &mut Agent,
    request: pb::UpdateSourceRequest,
) -> Result<Phase<Option<String>>, WorkspaceError> {
    if !agent.features.update_source {
        let pod = workspace_pod(&run.ctx.client, &run.namespace, &run.name).await;
        return Ok(Phase::Done(replace_pod(run, pod).await?));
    }
    let digest = request.digest.clone();
    match agent.client.update_source(request).await {
        Ok(answer) => Ok(Phase::Continue(
            answer.into_inner().changed.then_some(digest),
        )),
        Err(s) if s.code() == tonic::Code::FailedPrecondition => {
            // Started without a source folder it may replace.
            info!(
                message = s.message(),
                "the agent cannot take the new source revision"
            );
            let pod = workspace_pod(&run.ctx.client, &run.namespace, &run.name).await;
            Ok(Phase::Done(replace_pod(run, pod).await?))
        }
        Err(s) => {
            let message = format!("Failed to fetch source {digest}: {}", s.message());
            let end = run
                .stall_on_agent("InitializationFailure", INITIALIZATION_FAILED, message)
                .await;
            Ok(Phase::Done(end))
        }
    }
}

/// The agent cannot take the environment over RPC (PKO's agent): the next apply puts it on the
/// container, which restarts the pod once; nothing is initialized before.
async fn move_env_to_pod(run: &mut Run<'_>) -> End {
    let message = "the workspace agent has no SetEnvironmentVariables (PKO's agent): the environment goes on the pod spec, which restarts the pod once".to_owned();
    run.ctx
        .event(
            run.ws,
            EventType::Normal,
            "EnvironmentOnPod",
            message.clone(),
        )
        .await;
    status::mark_not_ready(
        &mut run.status,
        false,
        "RollingUpdate",
        &message,
        run.generation,
    );
    End::Report(Action::requeue(ENV_TO_POD_REQUEUE))
}

/// Selects and configures every stack, then remembers what the agent was told.
pub(super) async fn stacks(
    run: &mut Run<'_>,
    agent: &mut Agent,
    pending: Option<Pending>,
) -> Result<Phase<()>, WorkspaceError> {
    let Some(Pending {
        wanted,
        fresh,
        revision,
    }) = pending
    else {
        return Ok(Phase::Continue(()));
    };
    run.report_step(INITIALIZING, "Initializing and selecting a Pulumi stack")
        .await?;
    if let Err(message) = initialize_stacks(&mut agent.client, run.ws).await {
        let end = run
            .stall_on_agent("StackInitializationFailure", INITIALIZATION_FAILED, message)
            .await;
        return Ok(Phase::Done(end));
    }
    let generation = wanted.generation;
    record_on_pod(&run.ctx.client, &run.namespace, &run.name, &wanted).await?;
    run.ctx.set_initialized(&run.uid, Some(wanted));
    info!(instance = %agent.instance, generation, "workspace initialized");
    let (reason, note) = rules::initialized_note(fresh, revision.as_deref(), &run.name, generation);
    run.ctx.event(run.ws, EventType::Normal, reason, note).await;
    Ok(Phase::Continue(()))
}

/// Selects and configures every stack of the workspace.
async fn initialize_stacks(client: &mut AgentClient, ws: &Workspace) -> Result<(), String> {
    for stack in &ws.spec.stacks {
        let failed =
            |what: &str, s: tonic::Status| format!("{what} {}: {}", stack.name, s.message());
        client
            .select_stack(pb::SelectStackRequest {
                stack_name: stack.name.clone(),
                create: stack.create,
                secrets_provider: stack.secrets_provider.clone(),
                // Never read here; it costs the agent a `stack ls`.
                skip_summary: Some(true),
            })
            .await
            .map_err(|s| failed("Failed to initialize stack", s))?;
        if !stack.config.is_empty() {
            client
                .set_all_config(pb::SetAllConfigRequest {
                    config: stack.config.iter().map(to_pb_item).collect(),
                })
                .await
                .map_err(|s| failed("Failed to set config of stack", s))?;
        }
        if !stack.environment.is_empty() {
            client
                .add_environments(pb::AddEnvironmentsRequest {
                    environment: stack.environment.clone(),
                })
                .await
                .map_err(|s| failed("Failed to add environments to stack", s))?;
        }
    }
    Ok(())
}

/// The agent knows the workspace: ready, looked at again after [`READY_RECHECK`].
pub(super) fn ready(run: &mut Run<'_>) -> End {
    status::mark_ready(&mut run.status, run.generation);
    End::Report(Action::requeue(READY_RECHECK))
}
