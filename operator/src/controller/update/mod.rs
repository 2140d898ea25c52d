//! Update controller: runs one Pulumi operation (preview, up, destroy, refresh) through the
//! workspace's agent.
//!
//! Beyond PKO: the operation runs in its own task, so a reconcile worker is never held for the
//! length of a Pulumi run (PKO caps all Updates cluster-wide at its worker count); engine events
//! become Events and a bounded summary in `status.message` (PKO drops them); an Update found
//! `Progressing` after an operator restart is resumed (run again: the agent interrupted the
//! first run when the connection went away) instead of being marked `Aborted`; a lost agent
//! connection fails the Update with a reason that says so.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use futures::StreamExt;
use futures::channel::mpsc::{UnboundedReceiver, UnboundedSender, unbounded};
use k8s_openapi::api::core::v1::Secret;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use k8s_openapi::jiff::{SignedDuration, Timestamp};
use kube::api::{Api, DeleteParams, Patch, PatchParams, PostParams};
use kube::runtime::controller::{self, Action, Controller};
use kube::runtime::events::{EventType, Recorder};
use kube::runtime::reflector::ObjectRef;
use kube::runtime::watcher;
use kube::{Client, Resource, ResourceExt};
use pko_agent_api::client::AgentClient;
use pko_agent_api::proto as pb;
use pko_api::common::ProjectInfo;
use pko_api::duration::{DurationError, parse_go_duration};
use pko_api::update::{Update, UpdateStatus, UpdateType};
use pko_api::workspace::Workspace;
use serde_json::{Value, json};
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use crate::agent_client::{AgentError, Agents};
use crate::controller::backoff::{self, Backoff, Verdict};
use crate::controller::conditions;
use crate::controller::keys::{SECRETS_ANNOTATION, UPDATE_NAME_LABEL, UPDATE_STATUS_MANAGER};
use crate::controller::kit::{self, FromKube, Kit};
use crate::metrics::Metrics;

const CONTROLLER: &str = "update";
const PROGRESSING: &str = "Progressing";
const FAILED: &str = "Failed";
const COMPLETE: &str = "Complete";
/// Set only by [`report_stalled`]: the controller itself keeps failing on this Update.
const STALLED: &str = "Stalled";
/// Default of `--max-operations-in-flight`.
pub const DEFAULT_MAX_OPERATIONS_IN_FLIGHT: u32 = 64;
/// Reason of an Update waiting for an operation slot.
pub const QUEUED: &str = "Queued";
/// Reason of an Update failed because an answer of the agent was over the message limit.
pub const RESPONSE_TOO_LARGE: &str = pko_agent_api::errors::RESPONSE_TOO_LARGE;
/// Default of `--max-event-bytes-per-operation`: far more than the events of a large stack (the
/// agent cuts every string of an event at 64 KiB), far less than an agent can stream forever.
pub const DEFAULT_MAX_EVENT_BYTES_PER_OPERATION: u64 = 512 << 20;
/// Reason of an Update failed because its operation streamed more event bytes than allowed.
pub const EVENTS_TOO_LARGE: &str = "EventsTooLarge";
/// A queued Update is looked at again after this long even when no slot frees (it is woken as
/// soon as one does).
const QUEUED_RECHECK: Duration = Duration::from_secs(30);
/// Resource-change Events published per Update at most.
const MAX_RESOURCE_EVENTS: usize = 25;
const MESSAGE_LIMIT: usize = 2000;

/// Failures of one reconcile.
#[derive(Debug, thiserror::Error)]
pub enum UpdateError {
    #[error("update has no namespace")]
    NoNamespace,
    #[error("{what}: {source}")]
    Kube {
        what: String,
        #[source]
        source: kube::Error,
    },
    #[error("invalid ttlAfterCompleted: {0}")]
    BadTtl(#[source] DurationError),
    /// The workspace agent cannot be reached; already reported in the Progressing condition.
    #[error("{0}")]
    AgentUnavailable(String),
}

impl UpdateError {
    /// Whether retrying may help (see [`backoff`]).
    fn verdict(&self) -> Verdict {
        match self {
            Self::Kube { source, .. } => backoff::classify(source),
            Self::NoNamespace | Self::BadTtl(_) => Verdict::Permanent,
            Self::AgentUnavailable(_) => Verdict::Transient,
        }
    }

    /// What the status and the Event say: the apiserver's own message for its refusals.
    fn message(&self) -> String {
        match self {
            Self::Kube { what, source } => format!("{what}: {}", backoff::describe(source)),
            other => other.to_string(),
        }
    }
}

impl kit::FromKube for UpdateError {
    fn from_kube(what: String, source: kube::Error) -> Self {
        Self::Kube { what, source }
    }
}

impl kit::MetricLabel for UpdateError {
    fn metric_label(&self) -> &'static str {
        "reconcile"
    }
}

/// What every reconcile needs.
pub struct UpdateContext {
    pub client: Client,
    pub recorder: Recorder,
    pub agents: Arc<Agents>,
    pub metrics: Metrics,
    /// Failed reconciles per Update.
    pub backoff: Backoff,
    /// Updates whose operation runs in this process: uid → cancel token.
    running: Mutex<HashMap<String, CancellationToken>>,
    /// Operations that may run at once (`--max-operations-in-flight`).
    max_in_flight: usize,
    /// Engine-event bytes one operation may stream (`--max-event-bytes-per-operation`).
    max_event_bytes: u64,
    /// Updates waiting for an operation slot: uid → reference, woken when a slot frees.
    queued: Mutex<HashMap<String, ObjectRef<Update>>>,
    wake: UnboundedSender<ObjectRef<Update>>,
    /// Taken by [`run`], which reconciles what is sent on `wake`.
    woken: Mutex<Option<UnboundedReceiver<ObjectRef<Update>>>>,
}

/// One of the `--max-operations-in-flight` slots, held by one Update's operation; freed (and
/// the waiting Updates woken) on drop, however the operation ends.
struct Slot {
    ctx: Arc<UpdateContext>,
    uid: String,
    token: CancellationToken,
}

impl Drop for Slot {
    fn drop(&mut self) {
        self.ctx.release(&self.uid);
    }
}

impl UpdateContext {
    /// `max_in_flight`: operations that may run at once (at least one is always allowed);
    /// `max_event_bytes`: engine-event bytes one operation may stream.
    pub fn new(kit: &Kit, agents: Arc<Agents>, max_in_flight: usize, max_event_bytes: u64) -> Self {
        let (wake, woken) = unbounded();
        Self {
            client: kit.client.clone(),
            recorder: kit.recorder(CONTROLLER),
            agents,
            metrics: kit.metrics.clone(),
            backoff: Backoff::default(),
            running: Mutex::new(HashMap::new()),
            max_in_flight: max_in_flight.max(1),
            max_event_bytes,
            queued: Mutex::new(HashMap::new()),
            wake,
            woken: Mutex::new(Some(woken)),
        }
    }

    fn running(&self) -> std::sync::MutexGuard<'_, HashMap<String, CancellationToken>> {
        self.running.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn queued(&self) -> std::sync::MutexGuard<'_, HashMap<String, ObjectRef<Update>>> {
        self.queued.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// An operation slot for `update`; `None` (and `update` queued for a wake-up) when all are
    /// taken.
    fn acquire(self: &Arc<Self>, uid: &str, update: &Update) -> Option<Slot> {
        let mut running = self.running();
        if running.len() >= self.max_in_flight {
            // Queued while `running` is held: a release, which takes `running` first, cannot
            // miss it.
            self.queued()
                .insert(uid.to_owned(), ObjectRef::from_obj(update));
            return None;
        }
        let token = CancellationToken::new();
        running.insert(uid.to_owned(), token.clone());
        drop(running);
        self.queued().remove(uid);
        Some(Slot {
            ctx: self.clone(),
            uid: uid.to_owned(),
            token,
        })
    }

    fn release(&self, uid: &str) {
        self.running().remove(uid);
        // Every waiting Update is looked at again: the first to reconcile takes the slot, the
        // others queue again (an Update deleted meanwhile drops out here).
        let waiting: Vec<ObjectRef<Update>> = self.queued().drain().map(|(_, r)| r).collect();
        for update in waiting {
            let _ = self.wake.unbounded_send(update);
        }
    }

    async fn event(&self, update: &Update, type_: EventType, reason: &str, note: String) {
        let object = update.object_ref(&());
        kit::publish(&self.recorder, &object, type_, reason, "Update", &note).await;
    }
}

/// Runs the controller until `shutdown` resolves.
pub async fn run(
    api: Api<Update>,
    workspaces: Api<Workspace>,
    ctx: Arc<UpdateContext>,
    concurrency: u16,
    shutdown: impl std::future::Future<Output = ()> + Send + Sync + 'static,
) {
    let controller = Controller::new(api, watcher::Config::default().any_semantic());
    let store = controller.store();
    let woken = ctx
        .woken
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
        .take();
    let controller = match woken {
        Some(woken) => controller.reconcile_on(woken),
        None => controller,
    };
    controller
        // A Workspace becoming ready starts the Updates waiting for it.
        .watches(
            workspaces,
            watcher::Config::default(),
            move |ws: Workspace| {
                let ns = ws.namespace();
                let name = ws.name_any();
                store
                    .state()
                    .into_iter()
                    .filter(|u| {
                        u.namespace() == ns
                            && u.spec.workspace_name.as_deref() == Some(name.as_str())
                            && !u
                                .status
                                .as_ref()
                                .is_some_and(|s| conditions::is_true(&s.conditions, COMPLETE))
                    })
                    .map(|u| ObjectRef::from_obj(&*u))
                    .collect::<Vec<_>>()
            },
        )
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

fn error_policy(update: Arc<Update>, err: &UpdateError, ctx: Arc<UpdateContext>) -> Action {
    kit::error_policy(CONTROLLER, &*update, err, &ctx.metrics, &ctx.backoff)
}

fn stack_name(update: &Update) -> String {
    update.spec.stack_name.clone().unwrap_or_default()
}

async fn reconcile(update: Arc<Update>, ctx: Arc<UpdateContext>) -> Result<Action, UpdateError> {
    let _measure = kit::measure(&ctx.metrics, CONTROLLER);
    let result = reconcile_inner(update.clone(), ctx.clone()).await;
    let failure = ctx
        .backoff
        .record(&update.metadata, &result, UpdateError::verdict);
    if let (Some(failure), Err(err)) = (failure, &result)
        && failure.stall
    {
        report_stalled(&update, &ctx, err).await;
    }
    result
}

/// `Stalled=True` ([`backoff::REASON`]) with the error's message, and a Warning Event when that
/// is news; written only when it changes the status.
async fn report_stalled(update: &Update, ctx: &UpdateContext, err: &UpdateError) {
    let Some(namespace) = update.namespace() else {
        return;
    };
    let before = update.status.clone().unwrap_or_default();
    let mut status = before.clone();
    let message = conditions::truncate(&err.message(), conditions::MESSAGE_LIMIT);
    let known = conditions::get(&before.conditions, STALLED)
        .is_some_and(|c| c.status == "True" && c.reason == backoff::REASON && c.message == message);
    if !known {
        ctx.event(update, EventType::Warning, backoff::REASON, message.clone())
            .await;
    }
    conditions::set(
        &mut status.conditions,
        STALLED,
        true,
        backoff::REASON,
        &message,
        update.metadata.generation,
    );
    if let Err(e) = write_status(
        &ctx.client,
        &namespace,
        &update.name_any(),
        &before,
        &status,
    )
    .await
    {
        warn!(error = %e, "cannot report the stalled update");
    }
}

/// The Update being reconciled and the status it had when read.
struct Current {
    namespace: String,
    name: String,
    uid: String,
    generation: Option<i64>,
    before: UpdateStatus,
}

impl Current {
    /// Writes `status` (nothing when it equals what was read).
    async fn write(&self, ctx: &UpdateContext, status: &UpdateStatus) -> Result<(), UpdateError> {
        write_status(
            &ctx.client,
            &self.namespace,
            &self.name,
            &self.before,
            status,
        )
        .await
    }

    /// `Progressing=False` with why the operation cannot start yet.
    fn waiting(&self, reason: &str, message: &str) -> UpdateStatus {
        let mut s = self.before.clone();
        s.observed_generation = self.generation;
        conditions::set(
            &mut s.conditions,
            PROGRESSING,
            false,
            reason,
            message,
            self.generation,
        );
        s
    }
}

/// The phases in order: a finished, deleted or running Update → its Workspace ready → a slot
/// among the operations in flight → the agent connected → the operation started.
async fn reconcile_inner(
    update: Arc<Update>,
    ctx: Arc<UpdateContext>,
) -> Result<Action, UpdateError> {
    let current = Current {
        namespace: update.namespace().ok_or(UpdateError::NoNamespace)?,
        name: update.name_any(),
        uid: update.metadata.uid.clone().unwrap_or_default(),
        generation: update.metadata.generation,
        before: update.status.clone().unwrap_or_default(),
    };
    if let Some(action) = settled(&update, &ctx, &current).await? {
        return Ok(action);
    }
    let (ws, address) = match ready_workspace(&update, &ctx, &current).await? {
        Ok(ready) => ready,
        Err(waiting) => {
            // A stall reported after failed attempts holds until an attempt gets further: a
            // failing one keeps it, so it writes nothing new (and triggers no reconcile of its
            // own).
            let mut s = waiting;
            conditions::remove(&mut s.conditions, STALLED);
            current.write(&ctx, &s).await?;
            return Ok(Action::await_change());
        }
    };
    let Some(slot) = ctx.acquire(&current.uid, &update) else {
        let s = current.waiting(
            QUEUED,
            &format!(
                "queued: {} operations are in flight, the most allowed (--max-operations-in-flight); it starts when one ends",
                ctx.max_in_flight
            ),
        );
        current.write(&ctx, &s).await?;
        return Ok(Action::requeue(QUEUED_RECHECK));
    };
    let ws_name = ws.name_any();
    let client = match connect(&ctx, &ws, &ws_name, &current.namespace, &address).await {
        Ok(c) => c,
        Err(e) => {
            let message = format!("cannot reach the workspace agent: {e}");
            let s = current.waiting("TransientFailure", &message);
            current.write(&ctx, &s).await?;
            return Err(UpdateError::AgentUnavailable(message));
        }
    };
    let status = start(&update, &ctx, &current).await?;
    launch(ctx, update, current, status, slot, client);
    Ok(Action::await_change())
}

/// What to do with an Update that will not start an operation here: expire a completed one,
/// cancel or mark canceled a deleted one, wait for a running one.
async fn settled(
    update: &Update,
    ctx: &UpdateContext,
    current: &Current,
) -> Result<Option<Action>, UpdateError> {
    if conditions::is_true(&current.before.conditions, COMPLETE) {
        let api: Api<Update> = Api::namespaced(ctx.client.clone(), &current.namespace);
        return expire(update, ctx, &api, &current.before).await.map(Some);
    }
    if update.meta().deletion_timestamp.is_some() {
        if let Some(token) = ctx.running().get(&current.uid) {
            token.cancel();
            return Ok(Some(Action::await_change()));
        }
        let mut status = current.before.clone();
        finish(
            &mut status,
            current.generation,
            false,
            "Canceled",
            "the update was deleted before it completed",
        );
        current.write(ctx, &status).await?;
        return Ok(Some(Action::await_change()));
    }
    if ctx.running().contains_key(&current.uid) {
        return Ok(Some(Action::await_change()));
    }
    if update.spec.workspace_name.is_none() {
        let mut status = current.before.clone();
        status.observed_generation = current.generation;
        finish(
            &mut status,
            current.generation,
            false,
            "InvalidSpec",
            "spec.workspaceName is required",
        );
        current.write(ctx, &status).await?;
        return Ok(Some(Action::await_change()));
    }
    Ok(None)
}

/// The Update's Workspace and its agent's address once it is ready, or the status saying what
/// the Update waits for.
async fn ready_workspace(
    update: &Update,
    ctx: &UpdateContext,
    current: &Current,
) -> Result<Result<(Workspace, String), UpdateStatus>, UpdateError> {
    let ws_name = update.spec.workspace_name.clone().unwrap_or_default();
    let workspaces: Api<Workspace> = Api::namespaced(ctx.client.clone(), &current.namespace);
    let Some(ws) = workspaces
        .get_opt(&ws_name)
        .await
        .map_err(UpdateError::kube("reading the Workspace"))?
    else {
        let message = format!("workspace {ws_name} not found");
        return Ok(Err(current.waiting("WorkspaceNotFound", &message)));
    };
    let ws_status = ws.status.clone().unwrap_or_default();
    let ws_ready = ws.meta().deletion_timestamp.is_none()
        && ws_status.observed_generation == ws.metadata.generation
        && conditions::is_true(&ws_status.conditions, "Ready");
    match ws_status.address.filter(|_| ws_ready) {
        Some(address) => Ok(Ok((ws, address))),
        None => {
            let message = format!("waiting for workspace {ws_name} to be ready");
            Ok(Err(current.waiting("WorkspaceNotReady", &message)))
        }
    }
}

/// Marks the operation started (`Progressing=True`, a new start time) and says so when it
/// resumes one the operator was running when it stopped.
async fn start(
    update: &Update,
    ctx: &UpdateContext,
    current: &Current,
) -> Result<UpdateStatus, UpdateError> {
    let resumed = conditions::is_true(&current.before.conditions, PROGRESSING);
    let generation = current.generation;
    let mut status = current.before.clone();
    status.observed_generation = generation;
    let message = if resumed {
        "resumed after an operator restart"
    } else {
        ""
    };
    conditions::set(
        &mut status.conditions,
        PROGRESSING,
        true,
        "Progressing",
        message,
        generation,
    );
    conditions::set(
        &mut status.conditions,
        FAILED,
        false,
        "Progressing",
        "",
        generation,
    );
    conditions::set(
        &mut status.conditions,
        COMPLETE,
        false,
        "Progressing",
        "",
        generation,
    );
    conditions::remove(&mut status.conditions, STALLED);
    status.start_time = Some(Time(Timestamp::now()));
    status.end_time = None;
    current.write(ctx, &status).await?;
    if resumed {
        ctx.event(
            update,
            EventType::Normal,
            "Resumed",
            "the operation was in flight when the operator stopped; running it again".into(),
        )
        .await;
    }
    Ok(status)
}

/// Runs the operation in its own task, holding `slot` until its result is stored.
fn launch(
    ctx: Arc<UpdateContext>,
    update: Arc<Update>,
    current: Current,
    mut status: UpdateStatus,
    slot: Slot,
    client: AgentClient,
) {
    let token = slot.token.clone();
    tokio::spawn(async move {
        let started = std::time::Instant::now();
        let outcome = tokio::select! {
            outcome = operate(&ctx, &update, client) => outcome,
            () = token.cancelled() => Outcome::failed("Canceled", "the update was canceled".into()),
        };
        apply_outcome(&ctx, &update, &mut status, outcome).await;
        let Current {
            namespace,
            name,
            before,
            ..
        } = &current;
        store_result(&ctx, &update, namespace, name, before, &status).await;
        drop(slot);
        ctx.metrics
            .reconcile_duration
            .get_or_create(&ctx.metrics.controller("update-operation"))
            .observe(started.elapsed().as_secs_f64());
    });
}

/// Writes an operation's outcome until it is stored: lost, it would leave the Update in
/// flight, and the next operator would run the operation again. A transient failure (the
/// apiserver away) is retried with the controllers' backoff for as long as it lasts; a refusal
/// that will not heal is told in an Event; a deleted Update has nobody left to tell.
async fn store_result(
    ctx: &UpdateContext,
    update: &Update,
    namespace: &str,
    name: &str,
    before: &UpdateStatus,
    status: &UpdateStatus,
) {
    let policy = backoff::Policy::default();
    let mut attempt = 0u32;
    loop {
        let err = match write_status(&ctx.client, namespace, name, before, status).await {
            Ok(()) => return,
            Err(err) => err,
        };
        if let UpdateError::Kube {
            source: kube::Error::Api(e),
            ..
        } = &err
            && e.code == 404
        {
            return;
        }
        if err.verdict() == Verdict::Permanent {
            warn!(update = %name, error = %err, "the update result cannot be stored");
            ctx.event(update, EventType::Warning, backoff::REASON, err.message())
                .await;
            return;
        }
        attempt = attempt.saturating_add(1);
        let delay = policy.delay(attempt, &mut rand::rng());
        warn!(update = %name, attempt, ?delay, error = %err, "cannot write the update result; retrying");
        tokio::time::sleep(delay).await;
    }
}

async fn connect(
    ctx: &UpdateContext,
    ws: &Workspace,
    ws_name: &str,
    namespace: &str,
    address: &str,
) -> Result<AgentClient, AgentError> {
    let owner = crate::controller::workspace::owner_reference(ws);
    let credentials = ctx
        .agents
        .ensure_credentials(ws_name, namespace, &owner)
        .await?;
    ctx.agents
        .client(ws_name, namespace, address, &credentials)
        .await
}

/// Deletes a completed Update once its `ttlAfterCompleted` has passed.
async fn expire(
    update: &Update,
    ctx: &UpdateContext,
    api: &Api<Update>,
    status: &UpdateStatus,
) -> Result<Action, UpdateError> {
    let Some(ttl) = update
        .spec
        .ttl_after_completed
        .as_deref()
        .filter(|t| !t.is_empty())
    else {
        return Ok(Action::await_change());
    };
    if update.meta().deletion_timestamp.is_some() {
        return Ok(Action::await_change());
    }
    let ttl = parse_go_duration(ttl).map_err(UpdateError::BadTtl)?;
    let completed = conditions::get(&status.conditions, COMPLETE)
        .map(|c| c.last_transition_time.0)
        .unwrap_or_else(Timestamp::now);
    let elapsed = Timestamp::now().duration_since(completed);
    let ttl_signed = SignedDuration::try_from(ttl).unwrap_or(SignedDuration::MAX);
    if elapsed >= ttl_signed {
        api.delete(&update.name_any(), &DeleteParams::background())
            .await
            .map_err(UpdateError::kube("deleting the expired Update"))?;
        ctx.event(
            update,
            EventType::Normal,
            "UpdateExpired",
            "ttl expired and was deleted".into(),
        )
        .await;
        return Ok(Action::await_change());
    }
    let remaining = Duration::try_from(ttl_signed - elapsed).unwrap_or(Duration::from_secs(1));
    Ok(Action::requeue(remaining + Duration::from_millis(100)))
}

/// The result of one operation.
struct Outcome {
    succeeded: bool,
    reason: String,
    message: String,
    summary: Option<pb::UpdateSummary>,
    permalink: Option<String>,
    project: Option<pb::ProjectInfo>,
    outputs: Option<HashMap<String, pb::OutputValue>>,
}

impl Outcome {
    fn failed(reason: &str, message: String) -> Self {
        Self {
            succeeded: false,
            reason: reason.into(),
            message,
            summary: None,
            permalink: None,
            project: None,
            outputs: None,
        }
    }
}

/// Counts of resource operations and the errors the engine reported.
#[derive(Default)]
struct EventDigest {
    ops: BTreeMap<String, u64>,
    errors: Vec<String>,
    published: usize,
    /// Encoded bytes of the events received.
    bytes: u64,
    /// The bytes allowed (`--max-event-bytes-per-operation`).
    budget: u64,
}

impl EventDigest {
    fn new(budget: u64) -> Self {
        Self {
            budget,
            ..Self::default()
        }
    }

    /// Counts an event's bytes; whether the operation is still within its budget.
    fn admit(&mut self, event: &prost_types::Struct) -> bool {
        self.bytes = self
            .bytes
            .saturating_add(prost::Message::encoded_len(event) as u64);
        over_event_budget(self.bytes, self.budget).is_none()
    }

    async fn observe(&mut self, ctx: &UpdateContext, update: &Update, event: &prost_types::Struct) {
        let event = Value::Object(pko_agent_api::values::from_struct(event));
        if let Some(meta) = event.pointer("/resOutputsEvent/metadata") {
            let op = meta["op"].as_str().unwrap_or("same").to_owned();
            if op != "same" && self.published < MAX_RESOURCE_EVENTS {
                self.published += 1;
                let note = format!(
                    "{op} {} ({})",
                    meta["urn"].as_str().unwrap_or_default(),
                    meta["type"].as_str().unwrap_or_default()
                );
                ctx.event(update, EventType::Normal, "ResourceChanged", note)
                    .await;
            }
            *self.ops.entry(op).or_default() += 1;
        }
        if let Some(diag) = event.get("diagnosticEvent")
            && diag["severity"] == "error"
        {
            let message = diag["message"]
                .as_str()
                .unwrap_or_default()
                .trim()
                .to_owned();
            if !message.is_empty() && self.errors.len() < 5 {
                self.errors.push(message);
            }
        }
    }

    fn summary(&self) -> String {
        if self.ops.is_empty() {
            return "no resource changes".into();
        }
        self.ops
            .iter()
            .map(|(op, n)| format!("{op}: {n}"))
            .collect::<Vec<_>>()
            .join(", ")
    }
}

macro_rules! stream_op {
    ($ctx:expr, $update:expr, $digest:expr, $call:expr, $module:ident) => {{
        let mut stream = match $call.await {
            Ok(s) => s.into_inner(),
            Err(s) => return Err(s),
        };
        let mut result = None;
        while let Some(msg) = stream.message().await? {
            match msg.response {
                // Past the budget the call is dropped, which stops the operation in the agent.
                Some(pb::$module::Response::Event(e)) if !$digest.admit(&e) => {
                    return Err(tonic::Status::resource_exhausted(
                        "engine events over budget",
                    ));
                }
                Some(pb::$module::Response::Event(e)) => $digest.observe($ctx, $update, &e).await,
                Some(pb::$module::Response::Result(r)) => result = Some(r),
                None => {}
            }
        }
        result
            .ok_or_else(|| tonic::Status::unknown("the agent closed the stream without a result"))?
    }};
}

async fn operate(ctx: &UpdateContext, update: &Update, mut client: AgentClient) -> Outcome {
    let stack = stack_name(update);
    if let Err(s) = client
        .select_stack(pb::SelectStackRequest {
            stack_name: stack.clone(),
            create: Some(true),
            secrets_provider: None,
        })
        .await
    {
        return status_outcome(ctx, update, &s);
    }
    let mut digest = EventDigest::new(ctx.max_event_bytes);
    let result = run_operation(ctx, update, &mut client, &mut digest).await;
    match result {
        Ok(mut outcome) => {
            let changes = digest.summary();
            outcome.message = match &outcome.summary {
                Some(s) if !s.message.is_empty() => format!("{}: {changes}", s.message),
                _ => changes,
            };
            outcome
        }
        Err(s) => {
            let mut outcome = over_event_budget(digest.bytes, digest.budget)
                .unwrap_or_else(|| status_outcome(ctx, update, &s));
            if !digest.errors.is_empty() {
                outcome.message =
                    format!("{} (engine: {})", outcome.message, digest.errors.join("; "));
            }
            outcome.message = conditions::truncate(&outcome.message, MESSAGE_LIMIT);
            outcome
        }
    }
}

async fn run_operation(
    ctx: &UpdateContext,
    update: &Update,
    client: &mut AgentClient,
    digest: &mut EventDigest,
) -> Result<Outcome, tonic::Status> {
    let spec = &update.spec;
    let ok = |summary: Option<pb::UpdateSummary>, permalink, project| {
        let succeeded = summary.as_ref().is_none_or(|s| s.result == "succeeded");
        Outcome {
            succeeded,
            reason: if succeeded {
                "UpdateSucceeded".into()
            } else {
                "UpdateFailed".into()
            },
            message: String::new(),
            summary,
            permalink,
            project,
            outputs: None,
        }
    };
    match spec.type_.unwrap_or(UpdateType::Up) {
        UpdateType::Preview => {
            let r = stream_op!(
                ctx,
                update,
                digest,
                client.preview(pb::PreviewRequest {
                    parallel: spec.parallel,
                    message: spec.message.clone(),
                    expect_no_changes: spec.expect_no_changes,
                    replace: spec.replace.clone(),
                    target: spec.target.clone(),
                    target_dependents: spec.target_dependents,
                    policy_pack: vec![],
                    refresh: spec.refresh,
                }),
                preview_stream
            );
            Ok(ok(r.summary, r.permalink, r.project_info))
        }
        UpdateType::Up => {
            let r = stream_op!(
                ctx,
                update,
                digest,
                client.up(pb::UpRequest {
                    parallel: spec.parallel,
                    message: spec.message.clone(),
                    expect_no_changes: spec.expect_no_changes,
                    replace: spec.replace.clone(),
                    target: spec.target.clone(),
                    target_dependents: spec.target_dependents,
                    policy_pack: vec![],
                    refresh: spec.refresh,
                    continue_on_error: spec.continue_on_error,
                }),
                up_stream
            );
            let mut outcome = ok(r.summary, r.permalink, r.project_info);
            outcome.outputs = Some(r.outputs);
            Ok(outcome)
        }
        UpdateType::Refresh => {
            let r = stream_op!(
                ctx,
                update,
                digest,
                client.refresh(pb::RefreshRequest {
                    parallel: spec.parallel,
                    message: spec.message.clone(),
                    expect_no_changes: spec.expect_no_changes,
                    target: spec.target.clone(),
                    preview_only: None,
                    run_program: spec.run_program,
                }),
                refresh_stream
            );
            Ok(ok(r.summary, r.permalink, r.project_info))
        }
        UpdateType::Destroy => {
            let r = stream_op!(
                ctx,
                update,
                digest,
                client.destroy(pb::DestroyRequest {
                    parallel: spec.parallel,
                    message: spec.message.clone(),
                    target: spec.target.clone(),
                    target_dependents: spec.target_dependents,
                    refresh: spec.refresh,
                    continue_on_error: spec.continue_on_error,
                    remove: spec.remove,
                    run_program: spec.run_program,
                }),
                destroy_stream
            );
            Ok(ok(r.summary, r.permalink, r.project_info))
        }
    }
}

/// A failed RPC as an outcome: PKO's `PulumiErrorInfo` reason when attached, a clear reason when
/// the agent went away, `Unknown` otherwise.
fn status_outcome(ctx: &UpdateContext, update: &Update, s: &tonic::Status) -> Outcome {
    if let Some(info) = pko_agent_api::errors::error_info(s) {
        return Outcome::failed(&info.reason, s.message().to_owned());
    }
    if let Some(outcome) = too_large(s) {
        return outcome;
    }
    let text = s.message().to_ascii_lowercase();
    let lost = matches!(s.code(), tonic::Code::Unavailable | tonic::Code::Cancelled)
        || [
            "transport",
            "connection",
            "broken pipe",
            "stream closed",
            "h2 protocol",
            "error reading a body",
        ]
        .iter()
        .any(|p| text.contains(p));
    if lost {
        if let Some(ws) = &update.spec.workspace_name
            && let Some(ns) = update.namespace()
        {
            ctx.agents.forget(ws, &ns);
        }
        return Outcome::failed(
            "AgentUnavailable",
            format!(
                "the connection to the workspace agent was lost during the operation ({:?}: {})",
                s.code(),
                s.message()
            ),
        );
    }
    let message = if s.message().is_empty() {
        "An unknown error occurred".to_owned()
    } else {
        s.message().to_owned()
    };
    Outcome::failed("Unknown", message)
}

/// An answer the transport refused for its size (over 16 MiB, either end): the operation may
/// have run, but its result cannot be had, so running it again would not help.
fn too_large(s: &tonic::Status) -> Option<Outcome> {
    let refused =
        s.code() == tonic::Code::OutOfRange || s.message().contains("message length too large");
    refused.then(|| {
        Outcome::failed(
            RESPONSE_TOO_LARGE,
            format!(
                "an answer of the workspace agent is over the {} MiB message limit: {}",
                pko_agent_api::MAX_MESSAGE_BYTES / (1024 * 1024),
                s.message()
            ),
        )
    })
}

/// An operation whose engine events came to `received` bytes, over the `budget` of one
/// operation: an agent streaming without end (each event under the message limit) would hold
/// an operation slot and the operator's CPU for as long as it likes.
fn over_event_budget(received: u64, budget: u64) -> Option<Outcome> {
    (received > budget).then(|| {
        Outcome::failed(
            EVENTS_TOO_LARGE,
            format!(
                "the workspace agent streamed over {} MiB ({budget} bytes) of engine events in one operation, the most allowed (--max-event-bytes-per-operation); the operation was stopped",
                budget / (1024 * 1024)
            ),
        )
    })
}

fn finish(
    status: &mut UpdateStatus,
    generation: Option<i64>,
    succeeded: bool,
    reason: &str,
    message: &str,
) {
    conditions::remove(&mut status.conditions, STALLED);
    conditions::set(
        &mut status.conditions,
        PROGRESSING,
        false,
        if succeeded { "Complete" } else { "Failed" },
        "",
        generation,
    );
    conditions::set(
        &mut status.conditions,
        FAILED,
        !succeeded,
        reason,
        message,
        generation,
    );
    conditions::set(
        &mut status.conditions,
        COMPLETE,
        true,
        if succeeded { "Updated" } else { "Failed" },
        "",
        generation,
    );
    status.message = Some(message.to_owned());
    status.end_time = Some(Time(Timestamp::now()));
}

fn pb_time(t: &prost_types::Timestamp) -> Option<Time> {
    Timestamp::new(t.seconds, t.nanos).ok().map(Time)
}

async fn apply_outcome(
    ctx: &UpdateContext,
    update: &Update,
    status: &mut UpdateStatus,
    outcome: Outcome,
) {
    let generation = update.metadata.generation;
    let name = update.name_any();
    let verb = match update.spec.type_.unwrap_or(UpdateType::Up) {
        UpdateType::Preview => ("Previewed", "preview"),
        UpdateType::Up => ("Updated", "update"),
        UpdateType::Refresh => ("Refreshed", "refresh"),
        UpdateType::Destroy => ("Destroyed", "destroy"),
    };
    let mut succeeded = outcome.succeeded;
    let mut reason = outcome.reason.clone();
    let mut message = outcome.message.clone();
    if succeeded && let Some(outputs) = &outcome.outputs {
        match write_outputs(ctx, update, outputs).await {
            Ok(secret) => status.outputs = Some(secret),
            Err(e) => {
                succeeded = false;
                reason = "OutputsUnavailable".into();
                message = format!("the outputs could not be stored: {e}");
            }
        }
    }
    finish(
        status,
        generation,
        succeeded,
        &reason,
        &conditions::truncate(&message, MESSAGE_LIMIT),
    );
    if let Some(summary) = &outcome.summary {
        if let Some(t) = summary.start_time.as_ref().and_then(pb_time) {
            status.start_time = Some(t);
        }
        if let Some(t) = summary.end_time.as_ref().and_then(pb_time) {
            status.end_time = Some(t);
        }
    }
    status.permalink = outcome.permalink.clone().or(status.permalink.take());
    if let Some(p) = &outcome.project {
        status.project_info = Some(ProjectInfo {
            name: p.name.clone(),
            runtime: p.runtime.clone(),
        });
    }
    let stack = stack_name(update);
    if succeeded {
        info!(update = %name, "operation succeeded");
        ctx.event(
            update,
            EventType::Normal,
            "UpdateSucceeded",
            format!("{} stack \"{stack}\"", verb.0),
        )
        .await;
    } else {
        warn!(update = %name, %reason, %message, "operation failed");
        ctx.event(
            update,
            EventType::Warning,
            "UpdateFailed",
            format!("Failed to {} stack \"{stack}\": {message}", verb.1),
        )
        .await;
    }
}

/// `[^-._a-zA-Z0-9]` → `_`, as Secret keys must be (PKO's rule).
pub fn sanitize_key(key: &str) -> String {
    key.chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || matches!(c, '-' | '.' | '_') {
                c
            } else {
                '_'
            }
        })
        .collect()
}

/// The immutable outputs Secret `<update>-stack-outputs`, as PKO writes it.
async fn write_outputs(
    ctx: &UpdateContext,
    update: &Update,
    outputs: &HashMap<String, pb::OutputValue>,
) -> Result<String, String> {
    let namespace = update.namespace().unwrap_or_default();
    let name = format!("{}-stack-outputs", update.name_any());
    let uid = update.metadata.uid.clone().unwrap_or_default();
    let mut secret_keys: Vec<String> = outputs
        .iter()
        .filter(|(_, v)| v.secret)
        .map(|(k, _)| sanitize_key(k))
        .collect();
    secret_keys.sort();
    let data: BTreeMap<String, k8s_openapi::ByteString> = outputs
        .iter()
        .map(|(k, v)| (sanitize_key(k), k8s_openapi::ByteString(v.value.clone())))
        .collect();
    let owner = json!({
        "apiVersion": "auto.pulumi.com/v1alpha1",
        "kind": "Update",
        "name": update.name_any(),
        "uid": uid,
        "controller": true,
        "blockOwnerDeletion": true,
    });
    let secret = Secret {
        metadata: kube::api::ObjectMeta {
            name: Some(name.clone()),
            namespace: Some(namespace.clone()),
            labels: Some(BTreeMap::from([
                ("auto.pulumi.com/component".to_owned(), "update".to_owned()),
                (UPDATE_NAME_LABEL.to_owned(), update.name_any()),
            ])),
            annotations: Some(BTreeMap::from([(
                SECRETS_ANNOTATION.to_owned(),
                serde_json::to_string(&secret_keys).unwrap_or_else(|_| "[]".into()),
            )])),
            owner_references: serde_json::from_value(json!([owner])).ok(),
            ..Default::default()
        },
        immutable: Some(true),
        data: Some(data),
        type_: Some("Opaque".into()),
        ..Default::default()
    };
    let api: Api<Secret> = Api::namespaced(ctx.client.clone(), &namespace);
    match api.create(&PostParams::default(), &secret).await {
        Ok(_) => Ok(name),
        Err(kube::Error::Api(e)) if e.code == 409 => {
            // Left by a run interrupted after this step (a resumed Update): replaced, but only
            // when it is this Update's own (a tenant's Secret of that name is left alone).
            let existing = api.get(&name).await.map_err(|e| e.to_string())?;
            if !owned_by(&existing, &uid) {
                return Err(format!(
                    "Secret {name} exists and is not this Update's (no controller reference to it); it was left as it is"
                ));
            }
            let params = DeleteParams {
                preconditions: Some(kube::api::Preconditions {
                    uid: existing.metadata.uid.clone(),
                    resource_version: None,
                }),
                ..DeleteParams::default()
            };
            api.delete(&name, &params)
                .await
                .map_err(|e| e.to_string())?;
            api.create(&PostParams::default(), &secret)
                .await
                .map_err(|e| e.to_string())?;
            Ok(name)
        }
        Err(e) => Err(e.to_string()),
    }
}

/// `object` is controlled by the object with this uid.
fn owned_by(object: &Secret, uid: &str) -> bool {
    !uid.is_empty()
        && object
            .metadata
            .owner_references
            .iter()
            .flatten()
            .any(|o| o.controller == Some(true) && o.uid == uid)
}

async fn write_status(
    client: &Client,
    namespace: &str,
    name: &str,
    before: &UpdateStatus,
    after: &UpdateStatus,
) -> Result<(), UpdateError> {
    if before == after {
        return Ok(());
    }
    let patch = json!({
        "apiVersion": "auto.pulumi.com/v1alpha1",
        "kind": "Update",
        "status": after,
    });
    Api::<Update>::namespaced(client.clone(), namespace)
        .patch_status(
            name,
            &PatchParams::apply(UPDATE_STATUS_MANAGER).force(),
            &Patch::Apply(&patch),
        )
        .await
        .map_err(UpdateError::kube("writing the Update status"))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_a_secret_this_update_controls_is_replaced() {
        let secret = |refs: serde_json::Value| -> Secret {
            serde_json::from_value(json!({
                "metadata": {"name": "u-stack-outputs", "ownerReferences": refs},
            }))
            .expect("secret")
        };
        let owner = |uid: &str, controller: bool| {
            json!({"apiVersion": "auto.pulumi.com/v1alpha1", "kind": "Update", "name": "u",
                   "uid": uid, "controller": controller})
        };
        assert!(owned_by(&secret(json!([owner("u1", true)])), "u1"));
        assert!(!owned_by(&secret(json!([owner("u2", true)])), "u1"));
        assert!(!owned_by(&secret(json!([owner("u1", false)])), "u1"));
        assert!(!owned_by(&secret(json!([])), "u1"));
        assert!(!owned_by(&secret(json!([owner("", true)])), ""));
    }

    #[test]
    fn an_answer_over_the_message_limit_is_response_too_large() {
        for status in [
            tonic::Status::out_of_range(
                "Error, decoded message length too large: found 17000000 bytes, the limit is: 16777216 bytes",
            ),
            tonic::Status::internal("Error, encoded message length too large: found 1 bytes"),
        ] {
            let outcome = too_large(&status).expect("too large");
            assert!(!outcome.succeeded);
            assert_eq!(outcome.reason, "ResponseTooLarge");
            assert!(
                outcome.message.contains("16 MiB") && outcome.message.contains(status.message()),
                "{}",
                outcome.message
            );
        }
        assert!(too_large(&tonic::Status::unavailable("connection reset")).is_none());
        assert!(too_large(&tonic::Status::unknown("up failed")).is_none());
    }

    #[test]
    fn events_past_the_budget_of_an_operation_fail_it() {
        assert!(over_event_budget(0, 1).is_none());
        assert!(over_event_budget(32 << 20, 32 << 20).is_none());
        let outcome = over_event_budget((32 << 20) + 1, 32 << 20).expect("over");
        assert!(!outcome.succeeded);
        assert_eq!(outcome.reason, "EventsTooLarge");
        assert!(
            outcome.message.contains("32 MiB (33554432 bytes)")
                && outcome.message.contains("--max-event-bytes-per-operation"),
            "{}",
            outcome.message
        );

        // Each event encodes to 55 bytes.
        let mut digest = EventDigest::new(120);
        let event = prost_types::Struct {
            fields: [(
                "message".to_owned(),
                prost_types::Value {
                    kind: Some(prost_types::value::Kind::StringValue("x".repeat(40))),
                },
            )]
            .into_iter()
            .collect(),
        };
        assert!(digest.admit(&event));
        assert!(digest.admit(&event));
        assert!(!digest.admit(&event), "{} bytes", digest.bytes);
    }

    #[test]
    fn keys_are_sanitized_like_pko() {
        assert_eq!(sanitize_key("with whitespace"), "with_whitespace");
        assert_eq!(sanitize_key("a.b-c_d"), "a.b-c_d");
        assert_eq!(sanitize_key("x/y:z"), "x_y_z");
    }
}
