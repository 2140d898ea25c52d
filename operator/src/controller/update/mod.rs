//! Update controller: runs one Pulumi operation (preview, up, destroy, refresh) through the
//! workspace's agent.
//!
//! Beyond PKO: the operation runs in its own task, so a reconcile worker is never held for the
//! length of a Pulumi run (PKO caps all Updates cluster-wide at its worker count); engine events
//! become Events and a bounded summary in `status.message` (PKO drops them); an Update found
//! `Progressing` after an operator restart is resumed (run again: the agent interrupted the
//! first run when the connection went away) instead of being marked `Aborted`; a lost agent
//! connection fails the Update with a reason that says so.

use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::channel::mpsc::UnboundedSender;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use k8s_openapi::jiff::Timestamp;
use kube::api::Api;
use kube::runtime::controller::{self, Action};
use kube::runtime::events::{EventType, Recorder};
use kube::runtime::reflector::ObjectRef;
use kube::runtime::watcher;
use kube::{Client, Resource, ResourceExt};
use pko_agent_api::client::AgentClient;
use pko_api::duration::DurationError;
use pko_api::update::{Update, UpdateStatus, UpdateType};
use pko_api::workspace::Workspace;
use tracing::warn;

use crate::agent_client::Agents;
use crate::controller::backoff::{self, Backoff, Verdict};
use crate::controller::conditions;
use crate::controller::instrument::{self, Observed, Wakeup};
use crate::controller::kit::{self, FromKube, Kit};
use crate::controller::workspace::compat::Features;
use crate::controller::workspace::idle;
use crate::metrics::Metrics;
use crate::runtime_metrics::names;

mod expire;
mod handover;
mod instance;
mod operate;
mod outcome;
mod slots;
mod timeout;
mod waking;

use expire::expire;
use instance::AgentCheck;
use operate::{connect, operate};
pub use outcome::sanitize_key;
use outcome::{Outcome, apply_outcome, finish, store_result, write_status};
use slots::{Admission, Slot};
pub use slots::{OperationSlots, SlotLimits};

const CONTROLLER: &str = "update";
const PROGRESSING: &str = "Progressing";
const FAILED: &str = "Failed";
const COMPLETE: &str = "Complete";
/// Set only by [`report_stalled`]: the controller itself keeps failing on this Update.
const STALLED: &str = "Stalled";
/// Default of `--max-operations-in-flight`.
pub const DEFAULT_MAX_OPERATIONS_IN_FLIGHT: u32 = 64;
/// Reason of an Update waiting for an operation slot (all taken, or its namespace's share).
pub const QUEUED: &str = "Queued";
/// Reason of an Update failed because its operation ran past its timeout.
pub const OPERATION_TIMED_OUT: &str = "OperationTimedOut";
/// Reason of an Update failed because it asks for a preview-only refresh of an agent that cannot
/// run one.
pub const PREVIEW_ONLY_UNSUPPORTED: &str = "PreviewOnlyUnsupported";
/// Reason of an Update failed because it saves or runs an update plan (`spec.plan`) with an
/// agent that cannot.
pub const PLANS_UNSUPPORTED: &str = "PlansUnsupported";
/// Reason of an Update failed because an answer of the agent was over the message limit.
pub const RESPONSE_TOO_LARGE: &str = pko_agent_api::errors::RESPONSE_TOO_LARGE;
/// Default of `--max-event-bytes-per-operation`: far more than the events of a large stack (the
/// agent cuts every string of an event at 64 KiB), far less than an agent can stream forever.
pub const DEFAULT_MAX_EVENT_BYTES_PER_OPERATION: u64 = 512 << 20;
/// Reason of an Update failed because its operation streamed more event bytes than allowed.
pub const EVENTS_TOO_LARGE: &str = "EventsTooLarge";
/// Reason of an Update failed because one engine event was over [`MAX_EVENT_DECODED_BYTES`].
pub const EVENT_TOO_LARGE: &str = "EventTooLarge";
/// Decoded size one engine event may have: the agent cuts every string at 64 KiB, so a real
/// event is far smaller; an event of millions of empty lists (4 bytes each on the wire, 64 in
/// memory) is refused before it is converted.
pub const MAX_EVENT_DECODED_BYTES: u64 = 32 << 20;
/// A queued Update is looked at again after this long even when no slot frees (it is woken as
/// soon as one does).
const QUEUED_RECHECK: Duration = Duration::from_secs(30);
/// An Update whose agent restarted is looked at again after this long even when the
/// Workspace's status does not change (it is woken as soon as it does).
const NOT_INITIALIZED_RECHECK: Duration = Duration::from_secs(5);
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
    /// The operator's operation slots (shared with the other namespaces' controllers).
    slots: Arc<OperationSlots>,
    /// Engine-event bytes one operation may stream (`--max-event-bytes-per-operation`).
    max_event_bytes: u64,
    /// Longest an operation may run (`--operation-timeout`; `None`: no bound).
    operation_timeout: Option<Duration>,
    /// Where the slots send this controller's Updates when a slot frees.
    wakeup: Wakeup<Update>,
    /// Asks the Workspace controller to reconcile a Workspace now.
    workspace_wake: UnboundedSender<ObjectRef<Workspace>>,
    /// Updates waiting for an idle workspace to start.
    waking: waking::Waking,
}

/// The operator's bounds on Update operations.
#[derive(Clone)]
pub struct UpdateSettings {
    /// Operations that may run at once, in all and per namespace.
    pub slots: Arc<OperationSlots>,
    /// Engine-event bytes one operation may stream.
    pub max_event_bytes: u64,
    /// Longest an operation may run; `None`: as long as it takes (PKO's behaviour).
    pub operation_timeout: Option<Duration>,
    /// Asks the Workspace controller to reconcile a Workspace now (its agent restarted, or
    /// `spec.idle` stopped its pod).
    pub workspace_wake: UnboundedSender<ObjectRef<Workspace>>,
}

impl UpdateContext {
    pub fn new(kit: &Kit, agents: Arc<Agents>, settings: UpdateSettings) -> Self {
        Self {
            client: kit.client.clone(),
            recorder: kit.recorder(CONTROLLER),
            agents,
            metrics: kit.metrics.clone(),
            backoff: Backoff::default(),
            slots: settings.slots,
            max_event_bytes: settings.max_event_bytes,
            operation_timeout: settings.operation_timeout,
            wakeup: Wakeup::new(),
            workspace_wake: settings.workspace_wake,
            waking: waking::Waking::default(),
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
    let probe = ctx
        .metrics
        .runtime
        .controller(names::UPDATE, concurrency.max(1));
    let controller = instrument::controller(&probe, api, watcher::Config::default().any_semantic());
    let store = controller.store();
    let controller = controller.woken_by(&probe, &ctx.wakeup);
    let events = controller
        // A Workspace becoming ready starts the Updates waiting for it.
        .watches_observed(
            &probe,
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
        .run(
            instrument::reconciler(&probe, reconcile),
            instrument::error_policy(&probe, error_policy),
            ctx,
        );
    instrument::drive(CONTROLLER, &probe, events).await;
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
    // Its removal is an event of its own: the next reconcile goes on from there.
    if let Some(keep) = handover::released(&update) {
        handover::release(&ctx, &update, keep).await?;
        return Ok(Action::await_change());
    }
    // So is the taking over of PKO's fields (a switch-over), before anything else is written.
    if handover::pko_owned(&update) && handover::take_over(&ctx, &update).await? {
        return Ok(Action::await_change());
    }
    if let Some(action) = settled(&update, &ctx, &current).await? {
        return Ok(action);
    }
    let timeout = match timeout::effective(
        ctx.operation_timeout,
        update.spec.operation_timeout.as_deref(),
    ) {
        Ok(timeout) => timeout,
        Err(e) => {
            let mut status = current.before.clone();
            status.observed_generation = current.generation;
            let message = format!("spec.operationTimeout: {e}");
            finish(
                &mut status,
                current.generation,
                false,
                "InvalidSpec",
                &message,
            );
            current.write(&ctx, &status).await?;
            return Ok(Action::await_change());
        }
    };
    let (ws, address) = match ready_workspace(&update, &ctx, &current).await? {
        Ok(ready) => ready,
        Err(waiting) => {
            // A stall reported after failed attempts holds until an attempt gets further: a
            // failing one keeps it, so it writes nothing new (and triggers no reconcile of its
            // own).
            let mut s = waiting;
            conditions::remove(&mut s.conditions, STALLED);
            current.write(&ctx, &s).await?;
            return Ok(ctx.waking.waiting_action(&current.uid));
        }
    };
    let slot = match ctx.slots.acquire(
        &current.uid,
        &current.namespace,
        &update,
        &ctx.wakeup.sender(),
    ) {
        Ok(slot) => slot,
        Err(refused) => {
            let message = queued_message(refused, ctx.slots.limits(), &current.namespace);
            let s = current.waiting(QUEUED, &message);
            current.write(&ctx, &s).await?;
            return Ok(Action::requeue(QUEUED_RECHECK));
        }
    };
    let ws_name = ws.name_any();
    let connected = match connect(&ctx, &ws, &ws_name, &current.namespace, &address).await {
        Ok(mut client) => instance::check(&mut client, &ctx.client, &current.namespace, &ws_name)
            .await?
            .map(|check| (client, check)),
        Err(e) => Err(e.to_string()),
    };
    let client = match connected {
        Ok((_, AgentCheck::Initialized(features)))
            if missing_feature(&update, features).is_some() =>
        {
            return refuse_unsupported(&ctx, &current, &update, features, &ws_name).await;
        }
        Ok((client, AgentCheck::Initialized(_))) => client,
        Ok((_, AgentCheck::NotInitialized(message))) => {
            // The Workspace controller learns of the restart now, not at its next recheck.
            if ctx
                .workspace_wake
                .unbounded_send(ObjectRef::from_obj(&ws))
                .is_err()
            {
                warn!(workspace = %ws_name, "the workspace controller is not running");
            }
            let s = current.waiting("WorkspaceNotReady", &message);
            current.write(&ctx, &s).await?;
            return Ok(Action::requeue(NOT_INITIALIZED_RECHECK));
        }
        Err(e) => {
            let message = format!("cannot reach the workspace agent: {e}");
            let s = current.waiting("TransientFailure", &message);
            current.write(&ctx, &s).await?;
            return Err(UpdateError::AgentUnavailable(message));
        }
    };
    let status = start(&update, &ctx, &current).await?;
    ctx.waking
        .started(&current.uid, Instant::now(), &ctx.metrics);
    launch(ctx, update, current, status, slot, client, timeout);
    Ok(Action::await_change())
}

/// What a queued Update's `Progressing` condition says it waits for.
fn queued_message(refused: Admission, slots: SlotLimits, namespace: &str) -> String {
    match refused {
        Admission::ShareTaken => format!(
            "queued: namespace {namespace} runs {} operations, its share of the {} operation slots (--max-operations-in-flight-per-namespace); it starts when one of them ends",
            slots.per_namespace, slots.total
        ),
        Admission::AllTaken | Admission::Granted => format!(
            "queued: {} operations are in flight, the most allowed (--max-operations-in-flight); it starts when one ends",
            slots.total
        ),
    }
}

/// [`settled_as_is`]; an Update that will not start waits for no wake either.
async fn settled(
    update: &Update,
    ctx: &UpdateContext,
    current: &Current,
) -> Result<Option<Action>, UpdateError> {
    let settled = settled_as_is(update, ctx, current).await?;
    Ok(settled.inspect(|_| ctx.waking.forget(&current.uid)))
}

/// What to do with an Update that will not start an operation here: expire a completed one,
/// cancel or mark canceled a deleted one, wait for a running one.
async fn settled_as_is(
    update: &Update,
    ctx: &UpdateContext,
    current: &Current,
) -> Result<Option<Action>, UpdateError> {
    if conditions::is_true(&current.before.conditions, COMPLETE) {
        let api: Api<Update> = Api::namespaced(ctx.client.clone(), &current.namespace);
        return expire(update, ctx, &api, &current.before).await.map(Some);
    }
    if update.meta().deletion_timestamp.is_some() {
        if let Some(running) = ctx.slots.running().get(&current.uid) {
            running.token.cancel();
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
    if ctx.slots.running().contains_key(&current.uid) {
        return Ok(Some(Action::await_change()));
    }
    if let Some((reason, message)) = refusal(update) {
        let mut status = current.before.clone();
        status.observed_generation = current.generation;
        finish(&mut status, current.generation, false, reason, message);
        current.write(ctx, &status).await?;
        return Ok(Some(Action::await_change()));
    }
    Ok(None)
}

/// Why an Update never starts, as PKO decides it: one without a managing controller (made
/// without an owner, or orphaned by a Workspace deleted with `--cascade=orphan`) is canceled,
/// and one without a workspace or an operation is refused (PKO fails it once its workspace
/// answers; here it fails at once, saying why).
fn refusal(update: &Update) -> Option<(&'static str, &'static str)> {
    let controlled = update
        .owner_references()
        .iter()
        .any(|o| o.controller == Some(true));
    if !controlled {
        return Some((
            "Canceled",
            "the update has no controller owner: an Update runs only when owned by its Workspace (or a Stack's); orphaned Updates are canceled",
        ));
    }
    if update.spec.workspace_name.is_none() {
        return Some(("InvalidSpec", "spec.workspaceName is required"));
    }
    if update.spec.type_.is_none() {
        return Some((
            "InvalidSpec",
            "spec.type is required: one of preview, up, refresh, destroy",
        ));
    }
    if update.spec.preview_only == Some(true) && update.spec.type_ != Some(UpdateType::Refresh) {
        return Some((
            "InvalidSpec",
            "spec.previewOnly applies to type refresh only",
        ));
    }
    if update.spec.plan.is_some()
        && !matches!(
            update.spec.type_,
            Some(UpdateType::Preview | UpdateType::Up)
        )
    {
        return Some((
            "InvalidSpec",
            "spec.plan applies to types preview and up only",
        ));
    }
    None
}

/// An update plan asked of an agent that does not list the feature.
fn unsupported_plan(update: &Update, features: Features) -> bool {
    update.spec.plan.is_some() && !features.update_plans
}

/// What the Update asks of its agent that the agent does not list (PKO's agent, or an older
/// one): the reason and message it fails with, before anything runs. Sent anyway, the unknown
/// field would be ignored: a preview-only refresh would write the state, and an up would run
/// what nobody approved.
fn missing_feature(update: &Update, features: Features) -> Option<(&'static str, &'static str)> {
    if unsupported_preview_only(update, features) {
        return Some((
            PREVIEW_ONLY_UNSUPPORTED,
            pko_agent_api::features::REFRESH_PREVIEW_ONLY,
        ));
    }
    if unsupported_plan(update, features) {
        return Some((PLANS_UNSUPPORTED, pko_agent_api::features::UPDATE_PLANS));
    }
    None
}

/// Fails an Update whose agent lacks a feature it needs ([`missing_feature`]).
async fn refuse_unsupported(
    ctx: &UpdateContext,
    current: &Current,
    update: &Update,
    features: Features,
    ws_name: &str,
) -> Result<Action, UpdateError> {
    let Some((reason, feature)) = missing_feature(update, features) else {
        return Ok(Action::await_change());
    };
    let field = if reason == PLANS_UNSUPPORTED {
        "spec.plan"
    } else {
        "spec.previewOnly"
    };
    let mut status = current.before.clone();
    status.observed_generation = current.generation;
    finish(
        &mut status,
        current.generation,
        false,
        reason,
        &format!(
            "{field}: the agent of workspace {ws_name} does not list the {feature:?} feature (PKO's agent, or an older one); nothing was run"
        ),
    );
    current.write(ctx, &status).await?;
    Ok(Action::await_change())
}

/// A preview-only refresh asked of an agent that does not list the feature: sent anyway, PKO's
/// agent would ignore the unknown field and run a refresh that writes the state.
fn unsupported_preview_only(update: &Update, features: Features) -> bool {
    update.spec.preview_only == Some(true) && !features.refresh_preview_only
}

/// The Update's Workspace and its agent's address once it is ready, or the status saying what
/// the Update waits for.
async fn ready_workspace(
    update: &Update,
    ctx: &UpdateContext,
    current: &Current,
) -> Result<Result<(Workspace, String), UpdateStatus>, UpdateError> {
    let ws_name = update.spec.workspace_name.clone().unwrap_or_default();
    if let Err(e) = pko_api::names::checked_name("spec.workspaceName", &ws_name) {
        return Ok(Err(current.waiting("SpecInvalid", &e.to_string())));
    }
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
    let stopped = idle::idle_status(&ws_status) && ws.meta().deletion_timestamp.is_none();
    match ws_status.address.filter(|_| ws_ready) {
        Some(address) => Ok(Ok((ws, address))),
        None if stopped => {
            // Stopped by `spec.idle`: its controller starts it for this Update.
            ctx.waking.note(&current.uid, Instant::now());
            if ctx
                .workspace_wake
                .unbounded_send(ObjectRef::from_obj(&ws))
                .is_err()
            {
                warn!(workspace = %ws_name, "the workspace controller is not running");
            }
            let message = format!(
                "waiting for workspace {ws_name} to start: spec.idle stopped its pod after a period without operations"
            );
            Ok(Err(current.waiting("WorkspaceNotReady", &message)))
        }
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

/// Runs the operation in its own task, holding `slot` until its result is stored. Past
/// `timeout` the operation is dropped, which cancels its call: the agent interrupts pulumi.
fn launch(
    ctx: Arc<UpdateContext>,
    update: Arc<Update>,
    current: Current,
    mut status: UpdateStatus,
    slot: Slot,
    client: AgentClient,
    timeout: Option<Duration>,
) {
    let token = slot.token.clone();
    tokio::spawn(async move {
        let started = std::time::Instant::now();
        let expired = async {
            match timeout {
                Some(t) => tokio::time::sleep(t).await,
                None => std::future::pending().await,
            }
        };
        let outcome = tokio::select! {
            outcome = operate(&ctx, &update, client) => outcome,
            () = token.cancelled() => Outcome::failed("Canceled", "the update was canceled".into()),
            () = expired => Outcome::failed(OPERATION_TIMED_OUT, timeout::message(timeout.unwrap_or_default())),
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

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    fn update(owners: serde_json::Value, spec: serde_json::Value) -> Update {
        serde_json::from_value(json!({
            "apiVersion": "auto.pulumi.com/v1alpha1", "kind": "Update",
            "metadata": {"name": "u", "namespace": "ns", "ownerReferences": owners},
            "spec": spec,
        }))
        .expect("update")
    }

    #[test]
    fn an_update_runs_only_controlled_with_a_workspace_and_a_type() {
        let controller = json!([{"apiVersion": "auto.pulumi.com/v1alpha1", "kind": "Workspace",
            "name": "ws", "uid": "w", "controller": true}]);
        let full = json!({"workspaceName": "ws", "stackName": "dev", "type": "up"});
        assert_eq!(refusal(&update(controller.clone(), full.clone())), None);
        let (reason, _) = refusal(&update(json!([]), full.clone())).expect("ownerless");
        assert_eq!(reason, "Canceled");
        let owner_only = json!([{"apiVersion": "pulumi.com/v1", "kind": "Stack",
            "name": "s", "uid": "s"}]);
        let (reason, _) = refusal(&update(owner_only, full)).expect("no controller");
        assert_eq!(reason, "Canceled");
        let (reason, message) = refusal(&update(
            controller.clone(),
            json!({"workspaceName": "ws", "stackName": "dev"}),
        ))
        .expect("no type");
        assert_eq!(reason, "InvalidSpec");
        assert!(message.contains("spec.type"), "{message}");
        let (_, message) =
            refusal(&update(controller.clone(), json!({"type": "up"}))).expect("no workspace");
        assert!(message.contains("spec.workspaceName"), "{message}");
        let (reason, message) = refusal(&update(
            controller.clone(),
            json!({"workspaceName": "ws", "type": "up", "previewOnly": true}),
        ))
        .expect("preview-only up");
        assert_eq!(reason, "InvalidSpec");
        assert!(message.contains("previewOnly"), "{message}");
        let check = json!({"workspaceName": "ws", "type": "refresh", "previewOnly": true});
        assert_eq!(refusal(&update(controller, check)), None);
    }

    #[test]
    fn a_preview_only_refresh_runs_only_on_an_agent_that_lists_it() {
        let check = update(json!([]), json!({"type": "refresh", "previewOnly": true}));
        let refresh = update(json!([]), json!({"type": "refresh"}));
        let ours = Features {
            refresh_preview_only: true,
            ..Features::PKO
        };
        assert!(unsupported_preview_only(&check, Features::PKO));
        assert!(!unsupported_preview_only(&check, ours));
        assert!(!unsupported_preview_only(&refresh, Features::PKO));
    }

    #[test]
    fn an_update_plan_runs_only_on_an_agent_that_lists_it() {
        let planned = update(json!([]), json!({"type": "up", "plan": "s-1"}));
        let plain = update(json!([]), json!({"type": "up"}));
        let ours = Features {
            update_plans: true,
            ..Features::PKO
        };
        assert!(unsupported_plan(&planned, Features::PKO));
        assert!(!unsupported_plan(&planned, ours));
        assert!(!unsupported_plan(&plain, Features::PKO));
        let controller = json!([{"apiVersion": "auto.pulumi.com/v1alpha1", "kind": "Workspace",
            "name": "ws", "uid": "w", "controller": true}]);
        let (reason, _) = refusal(&update(
            controller,
            json!({"workspaceName": "ws", "type": "refresh", "plan": "s-1"}),
        ))
        .expect("a refresh with a plan");
        assert_eq!(reason, "InvalidSpec");
    }
}
