//! One reconcile of a Stack, as phases in order: the finalizer, the Update in flight, the
//! source, the sync decision, then either a launch (Workspace, then Update) or the settled
//! conditions. Each phase goes on or [`Stop`]s; the status is written once, at the end.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::api::core::v1::{Namespace, Secret};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, DeleteParams, ListParams, Patch, PatchParams, PostParams};
use kube::runtime::controller::Action;
use kube::runtime::events::EventType;
use kube::runtime::reflector::ObjectRef;
use kube::{Client, Resource, ResourceExt};
use pko_agent_api::errors::PLAN_NOT_FOUND;
use pko_api::decode::MAX_DOCUMENT_DEPTH;
use pko_api::stack::{
    ApprovalStatus, CurrentStackUpdate, Stack, StackStatus, WorkspaceReclaimPolicy,
};
use pko_api::update::{Update, UpdateStatus, UpdateType};
use pko_api::workspace::Workspace;
use serde_json::{Value, json};
use tracing::{info, warn};

use super::approval::{self, Preview, Step};
use super::outcome::{self, Outcome, StackError, Stop};
use super::source::{self, Reader, Resolved, WorkspaceSource};
use super::sync::{self, Prerequisite, UpdateState};
use super::{CONTROLLER, StackContext, drift, history, update, workspace};
use crate::controller::backoff;
use crate::controller::conditions;
use crate::controller::keys::{
    APPLY_MANAGER, DRIFT_CHECK_FAILED_EVENT, RECONCILE_REQUEST_ANNOTATION, SECRETS_ANNOTATION,
    STACK_FINALIZER, STACK_NAME_LABEL, STACK_STATUS_MANAGER,
};
use crate::controller::kit;
use crate::controller::kit::FromKube;
use crate::controller::takeover::{self, Part};
use crate::controller::workspace::idle;

/// While an Update runs, the stack is looked at again this often (its changes also trigger it).
const UPDATE_POLL: Duration = Duration::from_secs(300);
/// An unsatisfied prerequisite is checked again after this long.
const PREREQUISITE_POLL: Duration = Duration::from_secs(60);
/// A stack stalled by its terminating namespace is looked at again after this long.
const TERMINATING_POLL: Duration = Duration::from_secs(30);

pub(super) async fn reconcile(
    stack: Arc<Stack>,
    ctx: Arc<StackContext>,
) -> Result<Action, StackError> {
    let _measure = kit::measure(&ctx.metrics, CONTROLLER);
    // A reconcile queued behind a status write never decides on the view before it.
    let fresh = ctx.own_writes.fresher(&ctx.client, stack).await;
    let Some(stack) = fresh.map_err(StackError::kube(
        "reading the Stack after its last status write",
    ))?
    else {
        return Ok(Action::await_change());
    };
    let result = reconcile_inner(&stack, &ctx).await;
    let failure = ctx
        .backoff
        .record(&stack.metadata, &result, StackError::verdict);
    if let (Some(failure), Err(err)) = (failure, &result)
        && failure.stall
    {
        report_stalled(&stack, &ctx, err).await;
    }
    result
}

/// `Stalled=True` ([`backoff::REASON`]) with the error's message, and a Warning Event when that
/// is news; written only when it changes the status.
async fn report_stalled(stack: &Stack, ctx: &StackContext, err: &StackError) {
    let Some(namespace) = stack.namespace() else {
        return;
    };
    let writer = StatusWriter::new(&ctx.client, stack, &namespace);
    let mut status = writer.before.clone();
    let message = conditions::truncate(&err.message(), conditions::MESSAGE_LIMIT);
    let known = conditions::get(&writer.before.conditions, "Stalled")
        .is_some_and(|c| c.status == "True" && c.reason == backoff::REASON && c.message == message);
    if !known {
        ctx.event(stack, EventType::Warning, backoff::REASON, message.clone())
            .await;
    }
    Outcome::stalled(backoff::REASON, message).apply(&mut status, stack.metadata.generation);
    if let Err(e) = writer.write(&status, &ctx.own_writes).await {
        warn!(error = %e, "cannot report the stalled stack");
    }
}

async fn reconcile_inner(stack: &Stack, ctx: &StackContext) -> Result<Action, StackError> {
    let mut run = Run::new(ctx, stack)?;
    let outcome = match run.phases().await {
        Ok(outcome) | Err(Stop::Status(outcome)) => outcome,
        Err(Stop::Quiet) => return Ok(Action::await_change()),
        Err(Stop::Failed(err)) => return Err(err),
    };
    let action = outcome.apply(&mut run.status, run.generation);
    run.writer.write(&run.status, &ctx.own_writes).await?;
    Ok(action)
}

/// The one writer of the Stack status: a server-side apply of the whole status, sent only when
/// it differs from what the reconcile started from (transition times aside).
struct StatusWriter {
    api: Api<Stack>,
    name: String,
    before: StackStatus,
    /// PKO's status writer still owns some of the status: the next write takes that over and
    /// is made even if nothing else changed.
    pkos: bool,
}

impl StatusWriter {
    fn new(client: &Client, stack: &Stack, namespace: &str) -> Self {
        Self {
            api: Api::namespaced(client.clone(), namespace),
            name: stack.name_any(),
            before: stack.status.clone().unwrap_or_default(),
            pkos: takeover::pko_owns(stack.meta(), Part::Status),
        }
    }

    /// Writes `after` when it says something new, and remembers the version written.
    async fn write(&self, after: &StackStatus, own: &kit::OwnWrites) -> Result<(), StackError> {
        let before = &self.before;
        let same = before.observed_generation == after.observed_generation
            && before.observed_reconcile_request == after.observed_reconcile_request
            && before.outputs == after.outputs
            && before.last_update == after.last_update
            && before.current_update == after.current_update
            && before.project_info == after.project_info
            && before.drift_detection == after.drift_detection
            && before.approval == after.approval
            && conditions::same(&before.conditions, &after.conditions);
        if same && !self.pkos {
            return Ok(());
        }
        if self.pkos {
            takeover::take_over(&self.api, &self.name, STACK_STATUS_MANAGER, Part::Status)
                .await
                .map_err(StackError::kube("taking over PKO's Stack status"))?;
        }
        let patch = kit::StatusPatch::new::<Stack>(after);
        let written = self
            .api
            .patch_status(
                &self.name,
                &PatchParams::apply(STACK_STATUS_MANAGER).force(),
                &Patch::Apply(&patch),
            )
            .await
            .map_err(StackError::kube("writing the Stack status"))?;
        own.record(&written.metadata);
        Ok(())
    }
}

/// One reconcile in progress: the stack, what it asks for, and the status being built.
struct Run<'a> {
    ctx: &'a StackContext,
    stack: &'a Stack,
    namespace: String,
    name: String,
    generation: Option<i64>,
    request: Option<String>,
    deleting: bool,
    status: StackStatus,
    writer: StatusWriter,
}

impl<'a> Run<'a> {
    fn new(ctx: &'a StackContext, stack: &'a Stack) -> Result<Self, StackError> {
        let namespace = stack.namespace().ok_or(StackError::NoNamespace)?;
        let writer = StatusWriter::new(&ctx.client, stack, &namespace);
        let generation = stack.metadata.generation;
        let request = sync::request(stack);
        let mut status = writer.before.clone();
        status.observed_generation = generation;
        status.observed_reconcile_request = request.clone();
        Ok(Self {
            ctx,
            stack,
            name: stack.name_any(),
            namespace,
            generation,
            request,
            deleting: stack.meta().deletion_timestamp.is_some(),
            status,
            writer,
        })
    }

    async fn phases(&mut self) -> Result<Outcome, Stop> {
        self.finalizer().await?;
        self.adopt_pkos_workspace().await?;
        self.current_update().await?;
        let drift = self.drift_check().await?;
        let schedules = self.drift_schedules().await?;
        self.let_go().await?;
        let Resolved {
            workspace_source,
            commit,
            revision,
            poll,
        } = self.source().await?;
        self.hand_over(&commit, revision.as_deref()).await;
        let gated = approval::gated(self.stack) && !self.deleting;
        if !gated {
            self.status.approval = None;
            conditions::remove(&mut self.status.conditions, approval::CONDITION);
        }
        let synced = sync::is_synced(
            self.stack,
            &self.status,
            &commit,
            self.request.as_deref(),
            self.deleting,
        );
        // Read from the status, so a remediation that could not start yet is not lost.
        let remediate = drift::remediation(&self.status, &schedules);
        let remediating = synced.is_ok() && remediate.is_some();
        let why = match (synced, remediate) {
            (Err(why), _) => why,
            (Ok(()), Some(why)) if !self.deleting => why,
            (Ok(()), _) => {
                return self
                    .settle_and_check(poll, workspace_source, &schedules, drift.running)
                    .await;
            }
        };
        // Never two operations at once on a stack: the update waits for the drift check.
        if let Some(check) = drift.running {
            let message = format!("{why}; waiting for drift check {check} to finish");
            return Err(Outcome::reconciling("StackProcessing", message)
                .after(UPDATE_POLL)
                .into());
        }
        if !self.deleting {
            self.prerequisites().await?;
        }
        let applied = self.workspace(workspace_source).await?;
        if gated && sync::operation(self.stack, false) == UpdateType::Up {
            return self.gate(&applied, commit, &why, remediating).await;
        }
        self.launch(&applied, commit, &why, remediating, None).await
    }

    /// The approval gate (see [`approval`]): the plan's preview is read, then the stack makes
    /// a plan, waits for its preview or for an approval, or runs the approved plan. The
    /// `PlanApproved` condition says which, and an Event tells each new plan and refusal.
    async fn gate(
        &mut self,
        applied: &Workspace,
        commit: String,
        why: &str,
        remediating: bool,
    ) -> Result<Outcome, Stop> {
        let approved = approval::approved(self.stack).map(str::to_owned);
        let pending = self
            .status
            .approval
            .as_ref()
            .filter(|p| p.summary.is_none() && p.failed.is_none() && p.applied != p.plan_id)
            .and_then(|p| p.plan_id.clone());
        let preview = match pending {
            Some(id) => Some(self.plan_preview(&id).await?),
            None => None,
        };
        if let (Some(plan), Some(result)) = (self.status.approval.as_mut(), &preview) {
            match result {
                Preview::Made(summary) => plan.summary = Some(summary.clone()),
                Preview::Failed(why) => plan.failed = Some(why.clone()),
                Preview::Running | Preview::Gone => {}
            }
        }
        let inputs = approval::Inputs {
            commit: &commit,
            generation: self.generation,
            request: self.request.as_deref(),
        };
        let step = approval::decide(
            self.status.approval.as_ref(),
            preview.as_ref(),
            &inputs,
            approved.as_deref(),
        );
        let outcome = match &step {
            Step::Plan { refused } => {
                if let Some((id, refusal)) = refused {
                    self.refuse_approval(id, refusal);
                }
                self.make_plan(applied, &commit, why, remediating).await?;
                None
            }
            Step::Apply(id) => {
                let plan = self.status.approval.clone().unwrap_or_default();
                let why = plan.reason.as_deref().unwrap_or(why).to_owned();
                let remediating = plan.remediation == Some(true);
                let outcome = self
                    .launch(
                        applied,
                        commit.clone(),
                        &why,
                        remediating,
                        Some(id.as_str()),
                    )
                    .await?;
                if let Some(plan) = self.status.approval.as_mut() {
                    plan.applied = Some(id.clone());
                }
                self.event(
                    EventType::Normal,
                    approval::APPROVED,
                    format!("plan {id} approved: running it"),
                )
                .await;
                Some(outcome)
            }
            Step::Wait | Step::Await | Step::Failed(_) => None,
        };
        // After a new plan, the condition speaks of it: its preview runs.
        let shown = match step {
            Step::Plan { .. } => Step::Wait,
            other => other,
        };
        let message = self.show_gate(&shown, approved.as_deref()).await;
        if let Some(outcome) = outcome {
            return Ok(outcome);
        }
        Ok(match shown {
            Step::Failed(_) => Outcome::stalled(approval::FAILED, message),
            Step::Await => Outcome::reconciling(approval::AWAITING, message),
            _ => Outcome::reconciling("StackProcessing", message).after(UPDATE_POLL),
        })
    }

    /// Sets the `PlanApproved` condition for the gate's `shown` step, with an Event when it
    /// says something new a user must act on; returns its message.
    async fn show_gate(&mut self, shown: &Step, approved: Option<&str>) -> String {
        let plan = self.status.approval.clone().unwrap_or_default();
        let id = plan.plan_id.clone().unwrap_or_default();
        let hint = approval::how_to_approve(&self.name, &self.namespace, &id);
        let (reason, message) = approval::condition(&plan, shown, approved, &hint);
        let before = conditions::get(&self.status.conditions, approval::CONDITION)
            .map(|c| (c.reason.clone(), c.message.clone()));
        let news = before.as_ref() != Some(&(reason.to_owned(), message.clone()));
        let first_refusal = reason == approval::REFUSED
            && before.as_ref().is_none_or(|(r, _)| r != approval::REFUSED);
        conditions::set(
            &mut self.status.conditions,
            approval::CONDITION,
            reason == approval::APPROVED,
            reason,
            &message,
            self.generation,
        );
        if news && (matches!(shown, Step::Await | Step::Failed(_)) || first_refusal) {
            let type_ = if reason == approval::FAILED || reason == approval::REFUSED {
                EventType::Warning
            } else {
                EventType::Normal
            };
            self.event(type_, reason, message.clone()).await;
        }
        message
    }

    /// Where the preview of plan `id` stands.
    async fn plan_preview(&self, id: &str) -> Result<Preview, Stop> {
        let found = Api::<Update>::namespaced(self.ctx.client.clone(), &self.namespace)
            .get_opt(id)
            .await
            .map_err(StackError::kube("reading the plan's Update"))?;
        let Some(update) = found else {
            warn!(stack = %self.name, update = %id, "the plan's preview is gone; planning again");
            return Ok(Preview::Gone);
        };
        let status = update.status.unwrap_or_default();
        if !conditions::is_true(&status.conditions, "Complete") {
            return Ok(Preview::Running);
        }
        if conditions::is_true(&status.conditions, "Failed") {
            let why = conditions::get(&status.conditions, "Failed")
                .map(|c| format!("{}: {}", c.reason, c.message))
                .unwrap_or_default();
            return Ok(Preview::Failed(why));
        }
        Ok(Preview::Made(status.plan.unwrap_or_default()))
    }

    /// An approval the gate will not run: recorded (the condition, and its Event, say why).
    fn refuse_approval(&mut self, id: &str, why: &str) {
        info!(stack = %self.name, plan = %id, %why, "approval refused");
        let plan = self.status.approval.get_or_insert_with(Default::default);
        plan.refused = Some(id.to_owned());
        plan.refusal = Some(why.to_owned());
    }

    /// Starts a plan: a preview that saves its update plan under its own name (the plan ID).
    /// One already in flight (the status write after its create was lost) is adopted, but
    /// what it was made on is not known: it is recorded as made on nothing, so it is never run
    /// and a new plan follows it (one operation at a time).
    async fn make_plan(
        &mut self,
        applied: &Workspace,
        commit: &str,
        why: &str,
        remediating: bool,
    ) -> Result<(), Stop> {
        let in_flight = self.unfinished_updates().await?.into_iter().find(|u| {
            u.spec.type_ == Some(UpdateType::Preview)
                && u.spec.plan.as_deref() == Some(u.name_any().as_str())
        });
        let (name, adopted) = match in_flight {
            Some(u) => (u.name_any(), true),
            None => {
                let name = format!("{}-{:x}", self.name, Timestamp::now().as_millisecond());
                let mut update = update::object(&update::Request {
                    stack: self.stack,
                    workspace: applied,
                    name: name.clone(),
                    type_: UpdateType::Preview,
                    why: &format!("Plan for approval: {why}"),
                    check: false,
                })?;
                // Whatever the template says: a preview that saves this plan.
                update.spec.type_ = Some(UpdateType::Preview);
                update.spec.plan = Some(name.clone());
                if remediating {
                    update.spec.refresh = Some(true);
                }
                let updates: Api<Update> =
                    Api::namespaced(self.ctx.client.clone(), &self.namespace);
                if let Err(e) = updates.create(&PostParams::default(), &update).await {
                    return Err(self.refused(e, "Update").await);
                }
                info!(stack = %self.name, plan = %name, %why, "plan started");
                (name, false)
            }
        };
        let previous = self.status.approval.take().unwrap_or_default();
        self.status.approval = Some(ApprovalStatus {
            plan_id: Some(name),
            commit: (!adopted).then(|| commit.to_owned()),
            generation: self.generation.filter(|_| !adopted),
            reconcile_request: self.request.clone().filter(|_| !adopted),
            reason: Some(why.to_owned()),
            remediation: remediating.then_some(true),
            applied: previous.applied,
            refused: previous.refused,
            refusal: previous.refusal,
            ..Default::default()
        });
        Ok(())
    }

    /// The drift check in flight, if any. Still running: say so. Finished: its finding goes
    /// into the `DriftDetected` condition, `status.driftDetection` and an Event (a drift found
    /// by a schedule that remediates then asks for an update, see [`drift::remediation`]).
    /// Gone: forgotten (the next tick checks again).
    async fn drift_check(&mut self) -> Result<DriftNow, Stop> {
        let Some(name) = self
            .status
            .drift_detection
            .as_ref()
            .and_then(|d| d.current_check.clone())
        else {
            return Ok(DriftNow::default());
        };
        let found = Api::<Update>::namespaced(self.ctx.client.clone(), &self.namespace)
            .get_opt(&name)
            .await
            .map_err(StackError::kube("reading the drift check's Update"))?;
        let Some(update) = found else {
            warn!(stack = %self.name, update = %name, "the drift check's update is gone");
            if let Some(d) = self.status.drift_detection.as_mut() {
                d.current_check = None;
            }
            return Ok(DriftNow::default());
        };
        let update_status = update.status.unwrap_or_default();
        if !conditions::is_true(&update_status.conditions, "Complete") {
            return Ok(DriftNow {
                running: Some(name),
            });
        }
        let finding = drift::Finding::of(&update_status);
        let (state, reason, message) = finding.condition();
        let state = match state {
            Some(true) => "True",
            Some(false) => "False",
            None => "Unknown",
        };
        conditions::set_status(
            &mut self.status.conditions,
            drift::CONDITION,
            state,
            reason,
            &message,
            self.generation,
        );
        if let (Some(start), Some(end)) = (&update_status.start_time, &update_status.end_time)
            && let Ok(took) = Duration::try_from(end.0.duration_since(start.0))
        {
            self.ctx
                .metrics
                .drift_check_duration
                .observe(took.as_secs_f64());
        }
        let d = self
            .status
            .drift_detection
            .get_or_insert_with(Default::default);
        d.current_check = None;
        d.last_check = Some(name.clone());
        (d.change_count, d.changed_resources) = match &finding {
            drift::Finding::NoChanges => (Some(0), Vec::new()),
            drift::Finding::Changes { count, resources } => (Some(*count), resources.clone()),
            drift::Finding::Failed(_) => (None, Vec::new()),
        };
        info!(stack = %self.name, update = %name, %message, "drift check finished");
        match &finding {
            drift::Finding::Changes { .. } => {
                self.event(EventType::Warning, drift::CONDITION, message)
                    .await;
            }
            drift::Finding::Failed(_) => {
                self.event(EventType::Warning, DRIFT_CHECK_FAILED_EVENT, message)
                    .await;
            }
            drift::Finding::NoChanges => {}
        }
        self.prune_history(&name).await;
        Ok(DriftNow::default())
    }

    /// The drift schedules, parsed; a bad one stalls the stack saying which (a stack being
    /// deleted checks nothing, so its schedules do not matter).
    async fn drift_schedules(&self) -> Result<Vec<drift::Parsed>, Stop> {
        if self.deleting {
            return Ok(Vec::new());
        }
        match drift::schedules(self.stack) {
            Ok(schedules) => Ok(schedules),
            Err(message) => {
                let known = conditions::get(&self.status.conditions, "Stalled")
                    .is_some_and(|c| c.status == "True" && c.message == message);
                if !known {
                    self.event(EventType::Warning, "StackConfigInvalid", message.clone())
                        .await;
                }
                Err(Outcome::stalled("SpecInvalid", message).into())
            }
        }
    }

    /// Phase 4, up to date, with drift detection: the settled conditions, then a drift check
    /// when a schedule ticked since the last one (only after a successful update, with no
    /// check running), and the stack looked at again at the next tick. Without schedules the
    /// drift status goes (once no check runs).
    async fn settle_and_check(
        &mut self,
        poll: Option<Duration>,
        source: WorkspaceSource,
        schedules: &[drift::Parsed],
        running: Option<String>,
    ) -> Result<Outcome, Stop> {
        let now = Timestamp::now();
        let last = self.status.last_update.clone().unwrap_or_default();
        let healthy = UpdateState::of(&last) == Some(UpdateState::Succeeded)
            && sync::update_type(&last) != Some(UpdateType::Destroy)
            && !self.deleting;
        let since = drift::since(self.stack, self.status.drift_detection.as_ref());
        let due = if healthy && running.is_none() {
            drift::due(schedules, since, now).cloned()
        } else {
            None
        };
        // A reclaimed workspace would take the check's Update with it.
        let outcome = self
            .settle(poll, running.is_some() || due.is_some())
            .await?;
        if schedules.is_empty() {
            if running.is_none() {
                self.status.drift_detection = None;
                conditions::remove(&mut self.status.conditions, drift::CONDITION);
            }
            return Ok(outcome);
        }
        // A stack that cannot be checked now is looked at again when its update ends.
        let outcome = match drift::next_tick(schedules, now).filter(|_| healthy) {
            Some(wait) => outcome.sooner(wait),
            None => outcome,
        };
        let Some(due) = due else {
            return Ok(outcome);
        };
        let applied = self.workspace(source).await?;
        self.launch_check(&applied, &due, now).await?;
        Ok(outcome)
    }

    /// The stack's Updates not yet complete nor being deleted: one of them may be an
    /// operation whose status write was lost, to adopt rather than start again.
    async fn unfinished_updates(&self) -> Result<Vec<Update>, Stop> {
        let updates: Api<Update> = Api::namespaced(self.ctx.client.clone(), &self.namespace);
        Ok(updates
            .list(&ListParams::default().labels(&format!("{STACK_NAME_LABEL}={}", self.name)))
            .await
            .map_err(StackError::kube("listing the stack's Updates"))?
            .items
            .into_iter()
            .filter(|u| u.meta().deletion_timestamp.is_none())
            .filter(|u| {
                !u.status
                    .as_ref()
                    .is_some_and(|s| conditions::is_true(&s.conditions, "Complete"))
            })
            .collect())
    }

    /// Starts a drift check: an Update that refreshes without changing the state. One already
    /// in flight (the status write after its create was lost) is adopted.
    async fn launch_check(
        &mut self,
        applied: &Workspace,
        due: &drift::Parsed,
        now: Timestamp,
    ) -> Result<(), Stop> {
        let in_flight = self
            .unfinished_updates()
            .await?
            .into_iter()
            .find(|u| u.spec.preview_only == Some(true));
        let name = match in_flight {
            Some(u) => u.name_any(),
            None => {
                let name = format!("{}-{:x}", self.name, now.as_millisecond());
                let why = format!("Drift check (schedule {:?})", due.cron);
                let update = update::object(&update::Request {
                    stack: self.stack,
                    workspace: applied,
                    name: name.clone(),
                    type_: UpdateType::Refresh,
                    why: &why,
                    check: true,
                })?;
                let updates: Api<Update> =
                    Api::namespaced(self.ctx.client.clone(), &self.namespace);
                if let Err(e) = updates.create(&PostParams::default(), &update).await {
                    return Err(self.refused(e, "Update").await);
                }
                info!(stack = %self.name, update = %name, schedule = %due.cron, "drift check started");
                name
            }
        };
        let d = self
            .status
            .drift_detection
            .get_or_insert_with(Default::default);
        d.current_check = Some(name);
        d.last_check_time = Some(Time(now));
        d.schedule = Some(due.cron.clone());
        Ok(())
    }

    async fn event(&self, type_: EventType, reason: &str, note: String) {
        self.ctx.event(self.stack, type_, reason, note).await;
    }

    /// After a switch-over: the revision PKO deployed is our commit for the same content, so
    /// it is recorded as such and not run again.
    async fn hand_over(&mut self, commit: &str, revision: Option<&str>) {
        let adopted = self
            .status
            .last_update
            .as_ref()
            .and_then(|last| sync::handed_over(last, commit, revision));
        if let Some(adopted) = adopted {
            let note = format!(
                "revision {:?} deployed by PKO is artifact {commit}: recorded as its commit, no update needed",
                revision.unwrap_or_default()
            );
            info!(stack = %self.name, namespace = %self.namespace, "{note}");
            self.event(EventType::Normal, "RevisionAdopted", note).await;
            self.status.last_update = Some(adopted);
        }
    }

    /// Phase 1: the finalizer is added first (the change brings the next reconcile); a stack
    /// being deleted without it is not ours any more.
    async fn finalizer(&self) -> Result<(), Stop> {
        // After a switch-over, PKO's managers still own the finalizer (and what else PKO
        // wrote); ours from now on. The patch brings the next reconcile.
        if takeover::pko_owns(self.stack.meta(), Part::Main) {
            let api = Api::<Stack>::namespaced(self.ctx.client.clone(), &self.namespace);
            // Nothing taken (the watched object was behind a write that took it): go on.
            if takeover::take_over(&api, &self.name, APPLY_MANAGER, Part::Main)
                .await
                .map_err(StackError::kube("taking over PKO's Stack fields"))?
            {
                return Err(Stop::Quiet);
            }
        }
        if self.stack.finalizers().iter().any(|f| f == STACK_FINALIZER) {
            return Ok(());
        }
        if !self.deleting {
            set_finalizer(self.ctx, self.stack, true).await?;
        }
        Err(Stop::Quiet)
    }

    /// After a switch-over, the Workspace PKO's Stack controller applied still names PKO's
    /// source (a Program's artifact on PKO's file server, gone with PKO): applied again with
    /// this operator's source at once, before anything waits for it (an Update PKO left in
    /// flight runs on it). Its Workspace controller waits for this apply (one pod restart, not
    /// two). A source not resolvable yet leaves it for a later reconcile.
    async fn adopt_pkos_workspace(&mut self) -> Result<(), Stop> {
        let key = ObjectRef::<Workspace>::new(&self.name).within(&self.namespace);
        let pkos = self
            .ctx
            .workspaces
            .get(&key)
            .is_some_and(|ws| takeover::pko_owns(ws.meta(), Part::Main));
        if !pkos || self.deleting {
            return Ok(());
        }
        let Ok(resolved) = self.source().await else {
            return Ok(());
        };
        let spec = workspace::spec(self.stack, &self.namespace, resolved.workspace_source)
            .map_err(|message| Stop::from(Outcome::stalled("SpecInvalid", message)))?;
        let ws = workspace::object(self.stack, &self.namespace, spec)?;
        let workspaces = Api::<Workspace>::namespaced(self.ctx.client.clone(), &self.namespace);
        if let Err(e) = takeover::apply(&workspaces, &self.name, APPLY_MANAGER, &ws).await {
            return Err(self.refused(e, "Workspace").await);
        }
        info!(stack = %self.name, namespace = %self.namespace, "applied the Workspace PKO made with this operator's source");
        Ok(())
    }

    /// Phase 2: the Update in flight, if any. Still running: wait for it. Finished: record it
    /// in `lastUpdate`. Gone: start over (PKO waits forever here, #1292).
    async fn current_update(&mut self) -> Result<(), Stop> {
        let Some(current) = self.status.current_update.clone() else {
            return Ok(());
        };
        let update_name = current.name.clone().unwrap_or_default();
        let found = Api::<Update>::namespaced(self.ctx.client.clone(), &self.namespace)
            .get_opt(&update_name)
            .await
            .map_err(StackError::kube("reading the current Update"))?;
        let Some(update) = found else {
            warn!(stack = %self.name, update = %update_name, "the current update is gone; starting over");
            self.event(
                EventType::Warning,
                "UpdateLost",
                format!("update {update_name} disappeared before it completed; a new one will run"),
            )
            .await;
            self.status.current_update = None;
            return Ok(());
        };
        let update_status = update.status.unwrap_or_default();
        if !conditions::is_true(&update_status.conditions, "Complete") {
            return Err(processing().into());
        }
        self.record(&current, update.spec.type_, &update_status)
            .await;
        if let Some(plan) = &update.spec.plan {
            self.plan_lost(plan, &update_status);
        }
        self.prune_history(&update_name).await;
        Ok(())
    }

    /// An up whose plan the workspace no longer held (its agent restarted since the preview)
    /// ran nothing: the approval is refused as such, and the next sync makes a new plan.
    fn plan_lost(&mut self, plan: &str, update: &UpdateStatus) {
        let lost = conditions::get(&update.conditions, "Failed")
            .is_some_and(|c| c.status == "True" && c.reason == PLAN_NOT_FOUND);
        if lost {
            let why = "the workspace no longer holds the plan (its agent restarted since the preview that made it)";
            self.refuse_approval(plan, why);
        }
    }

    /// After an Update finished: the stack's Updates beyond its history limit go. A failure
    /// is logged and left for the next finish (the TTL still bounds them); it never holds the
    /// stack back.
    async fn prune_history(&self, finished: &str) {
        let last = self
            .status
            .last_update
            .as_ref()
            .and_then(|l| l.name.as_deref());
        let drift = self.status.drift_detection.as_ref();
        let checks = [
            drift.and_then(|d| d.current_check.as_deref()),
            drift.and_then(|d| d.last_check.as_deref()),
        ];
        let plan = self
            .status
            .approval
            .as_ref()
            .and_then(|a| a.plan_id.as_deref());
        let keep: Vec<&str> = [Some(finished), last, plan]
            .into_iter()
            .chain(checks)
            .flatten()
            .collect();
        if let Err(e) = history::prune(&self.ctx.client, self.stack, &self.namespace, &keep).await {
            warn!(stack = %self.name, namespace = %self.namespace, error = %e, "the update history was not pruned");
        }
    }

    /// A finished Update becomes `lastUpdate`; a success also brings its outputs and project.
    async fn record(
        &mut self,
        current: &CurrentStackUpdate,
        type_: Option<UpdateType>,
        update: &UpdateStatus,
    ) {
        let last = sync::finished(current, self.status.last_update.as_ref(), type_, update);
        let succeeded = UpdateState::of(&last) == Some(UpdateState::Succeeded);
        let message = last.message.clone();
        self.status.last_update = Some(last);
        if succeeded {
            if type_ == Some(UpdateType::Up)
                && let Some(secret) = &update.outputs
                && let Some(outputs) = read_outputs(&self.ctx.client, &self.namespace, secret).await
            {
                self.status.outputs = outputs;
            }
            // A destroy keeps the last outputs, as PKO does.
            if update.project_info.is_some() {
                self.status.project_info = update.project_info.clone();
            }
            self.event(
                EventType::Normal,
                "StackCreated",
                "Successfully updated stack".into(),
            )
            .await;
        } else {
            self.event(
                EventType::Warning,
                "StackUpdateFailure",
                format!("Failed to update Stack: {}", message.unwrap_or_default()),
            )
            .await;
        }
        self.status.current_update = None;
    }

    /// Nothing to destroy: the Stack is let go. No status is written before the finalizer
    /// goes: were its removal refused, that write would clear the stall the refusal reports,
    /// on every attempt, and each write would trigger the next attempt at once.
    async fn let_go(&self) -> Result<(), Stop> {
        let spec = &self.stack.spec;
        if self.deleting && (spec.destroy_on_finalize != Some(true) || spec.preview == Some(true)) {
            set_finalizer(self.ctx, self.stack, false).await?;
            return Err(Stop::Quiet);
        }
        Ok(())
    }

    /// Phase 3: the source (a sync the user asked for looks at the branch afresh). A stack
    /// being destroyed whose source is gone destroys from its last project (PKO #1222);
    /// without one, the stall says how to let the stack go.
    async fn source(&self) -> Result<Resolved, Stop> {
        let fresh =
            self.request.is_some() && self.request != self.writer.before.observed_reconcile_request;
        let reader = Reader {
            client: &self.ctx.client,
            git: &self.ctx.git,
            flux: &self.ctx.flux,
        };
        let stop = match source::resolve(&reader, self.stack, &self.namespace, fresh).await {
            Ok(resolved) => return Ok(resolved),
            Err(stop) => stop,
        };
        if !self.deleting || !source::unavailable(&stop) {
            return Err(stop);
        }
        if let Some(resolved) = source::project_info_fallback(self.stack, self.deleting) {
            info!(stack = %self.name, "the source is gone; destroying from the last project");
            return Ok(resolved);
        }
        Err(match stop {
            Stop::Status(Outcome::Stalled {
                reason,
                message,
                requeue,
            }) => Stop::Status(Outcome::Stalled {
                reason,
                message: format!(
                    "{message}; the stack cannot be destroyed without its source (no project was recorded); {}",
                    self.let_go_hint()
                ),
                requeue,
            }),
            other => other,
        })
    }

    /// How a user lets the stack go without a destroy.
    fn let_go_hint(&self) -> String {
        format!(
            "to let it go without a destroy, remove the finalizer: kubectl patch stack {} -n {} --type=merge -p '{{\"metadata\":{{\"finalizers\":null}}}}'",
            self.name, self.namespace
        )
    }

    /// Before an update (not a destroy): every prerequisite stack is met; one that succeeded
    /// too long ago is asked to run again.
    async fn prerequisites(&self) -> Result<(), Stop> {
        let stacks: Api<Stack> = Api::namespaced(self.ctx.client.clone(), &self.namespace);
        for prerequisite in &self.stack.spec.prerequisites {
            let name =
                pko_api::names::checked_name("spec.prerequisites[].name", &prerequisite.name)
                    .map_err(|e| Stop::from(Outcome::stalled("SpecInvalid", e.to_string())))?;
            let other = stacks
                .get_opt(name)
                .await
                .map_err(StackError::kube("reading a prerequisite Stack"))?;
            let message = match sync::prerequisite(prerequisite, other.as_ref()) {
                Prerequisite::Met => continue,
                Prerequisite::Unmet(message) => message,
                Prerequisite::Stale { touch, message } => {
                    if let Some(touch) = touch {
                        let patch = json!({"metadata": {"annotations": {RECONCILE_REQUEST_ANNOTATION: touch}}});
                        stacks
                            .patch(
                                &prerequisite.name,
                                &PatchParams::default(),
                                &Patch::Merge(&patch),
                            )
                            .await
                            .map_err(StackError::kube("requesting a prerequisite's update"))?;
                    }
                    message
                }
            };
            let waiting = Outcome::reconciling("PrerequisiteNotSatisfied", message);
            return Err(waiting.after(PREREQUISITE_POLL).into());
        }
        Ok(())
    }

    /// Phase 4a: the stack's Workspace, applied and ready.
    async fn workspace(&mut self, source: WorkspaceSource) -> Result<Workspace, Stop> {
        // The Workspace is named after the stack: a name it cannot have stalls here, with a
        // message that says so, instead of an apiserver refusal on every attempt.
        if let Some(problem) = pko_api::workspace::name_problem(&self.name) {
            let message = format!(
                "the stack's Workspace would be named {}: {problem}",
                self.name
            );
            if !conditions::is_true(&self.status.conditions, "Stalled") {
                self.event(EventType::Warning, "StackConfigInvalid", message.clone())
                    .await;
            }
            return Err(Outcome::stalled("SpecInvalid", message).into());
        }
        let parts = match workspace::spec(self.stack, &self.namespace, source) {
            Ok(parts) => parts,
            Err(message) => {
                self.event(EventType::Warning, "StackConfigInvalid", message.clone())
                    .await;
                return Err(Outcome::stalled("SpecInvalid", message).into());
            }
        };
        let ws = workspace::object(self.stack, &self.namespace, parts)?;
        let waiting = "waiting for workspace readiness";
        outcome::reconciling(
            &mut self.status,
            self.generation,
            "StackProcessing",
            waiting,
        );
        let key = ObjectRef::<Workspace>::new(&self.name).within(&self.namespace);
        let last = self.ctx.applied.get(&self.namespace, &self.name);
        let watched = self.ctx.workspaces.get(&key).filter(|observed| {
            !takeover::pko_owns(observed.meta(), Part::Main)
                && last.as_ref().is_some_and(|l| l.covers(&ws, observed))
        });
        let applied = match watched {
            Some(observed) => (*observed).clone(),
            None => {
                let workspaces =
                    Api::<Workspace>::namespaced(self.ctx.client.clone(), &self.namespace);
                match takeover::apply(&workspaces, &self.name, APPLY_MANAGER, &ws).await {
                    Ok(applied) => {
                        let record = workspace::Applied::new(&ws, &applied);
                        self.ctx.applied.set(&self.namespace, &self.name, record);
                        applied
                    }
                    Err(e) => return Err(self.refused(e, "Workspace").await),
                }
            }
        };
        let ws_status = applied.status.clone().unwrap_or_default();
        let ready = ws_status.observed_generation == applied.metadata.generation
            && conditions::is_true(&ws_status.conditions, "Ready");
        // A workspace stopped by `spec.idle` is started by the Update that needs it.
        if ready || idle::stopped(&applied) {
            return Ok(applied);
        }
        let stalled =
            conditions::get(&ws_status.conditions, "Stalled").filter(|c| c.status == "True");
        // A workspace that cannot run, of a stack that never ran an update: nothing to
        // destroy, so the stack goes (PKO's rule).
        if stalled.is_some() && sync::never_ran(&self.status, self.deleting) {
            info!(stack = %self.name, "the workspace is stalled and the stack never ran; letting it go");
            set_finalizer(self.ctx, self.stack, false).await?;
            return Err(Stop::Quiet);
        }
        Err(match stalled {
            Some(c) => {
                let reason = if c.reason == "IncompatibleConfiguration" {
                    "PulumiVersionTooLow"
                } else {
                    "WorkspaceFailed"
                };
                Outcome::stalled(reason, format!("{}: {}", c.reason, c.message))
            }
            None => Outcome::reconciling("StackProcessing", waiting),
        }
        .into())
    }

    /// Phase 4b: the Update. One of this stack still in flight is adopted rather than doubled:
    /// the cache may not show our last status write yet, or the operator stopped between create
    /// and status write. `currentUpdate` is saved only once the Update exists (PKO saves it
    /// before creating it).
    async fn launch(
        &mut self,
        applied: &Workspace,
        commit: String,
        why: &str,
        remediating: bool,
        plan: Option<&str>,
    ) -> Result<Outcome, Stop> {
        let type_ = sync::operation(self.stack, self.deleting);
        let in_flight = self
            .unfinished_updates()
            .await?
            .into_iter()
            .find(|u| u.spec.type_ == Some(type_) && u.spec.preview_only != Some(true));
        if let Some(u) = in_flight {
            self.status.current_update = Some(self.current(u.name_any(), commit));
            return Ok(processing());
        }
        let update_name = format!("{}-{:x}", self.name, Timestamp::now().as_millisecond());
        let mut update = update::object(&update::Request {
            stack: self.stack,
            workspace: applied,
            name: update_name.clone(),
            type_,
            why,
            check: false,
        })?;
        // The state still says what was deployed: only a refresh first lets the up see the drift
        // (`pulumi up --refresh`, as Pulumi Cloud remediates).
        if remediating {
            update.spec.refresh = Some(true);
        }
        // An approved plan: the up runs it, whatever the template says.
        if let Some(plan) = plan {
            update.spec.plan = Some(plan.to_owned());
        }
        let updates: Api<Update> = Api::namespaced(self.ctx.client.clone(), &self.namespace);
        if let Err(e) = updates.create(&PostParams::default(), &update).await {
            return Err(self.refused(e, "Update").await);
        }
        info!(stack = %self.name, update = %update_name, %why, "update created");
        self.event(EventType::Normal, "StackUpdateDetected", why.to_owned())
            .await;
        self.status.current_update = Some(self.current(update_name, commit));
        Ok(processing())
    }

    fn current(&self, name: String, commit: String) -> CurrentStackUpdate {
        CurrentStackUpdate {
            generation: self.generation,
            reconcile_request: self.request.clone(),
            name: Some(name),
            commit: Some(commit),
        }
    }

    /// A create refused because the namespace is being deleted (the apiserver's
    /// NamespaceLifecycle admission) stalls the stack with `NamespaceTerminating` and says how
    /// to let it go; any other error is returned. Objects that already exist keep working: a
    /// destroy whose Update was created before the namespace started terminating still runs.
    async fn refused(&self, err: kube::Error, kind: &str) -> Stop {
        let namespace = &self.namespace;
        let forbidden = matches!(&err, kube::Error::Api(e) if e.code == 403);
        let terminating = forbidden
            && Api::<Namespace>::all(self.ctx.client.clone())
                .get_opt(namespace)
                .await
                .ok()
                .flatten()
                .is_some_and(|n| n.metadata.deletion_timestamp.is_some());
        if !terminating {
            let what = if kind == "Workspace" {
                "applying the Workspace"
            } else {
                "creating the Update"
            };
            return StackError::kube(what)(err).into();
        }
        let message = format!(
            "namespace {namespace} is being deleted, so no {kind} can be created and the stack cannot be \
             destroyed; to let the namespace go without a destroy, remove the finalizer: kubectl patch \
             stack {} -n {namespace} --type=merge -p '{{\"metadata\":{{\"finalizers\":null}}}}'",
            self.name
        );
        if !conditions::is_true(&self.status.conditions, "Stalled") {
            self.event(EventType::Warning, "NamespaceTerminating", message.clone())
                .await;
        }
        Outcome::stalled("NamespaceTerminating", message)
            .after(TERMINATING_POLL)
            .into()
    }

    /// Phase 4, up to date: the settled conditions; a reclaimed Workspace goes once the stack
    /// is up to date (unless a drift check needs it: `hold`), and a destroyed stack records the destroy, then lets its finalizer go.
    async fn settle(&mut self, poll: Option<Duration>, hold: bool) -> Result<Outcome, Stop> {
        let last = self.status.last_update.clone().unwrap_or_default();
        let outcome = sync::settled(self.stack, &last, poll, self.deleting);
        if UpdateState::of(&last) == Some(UpdateState::Succeeded)
            && !self.deleting
            && !hold
            && self.stack.spec.workspace_reclaim_policy == Some(WorkspaceReclaimPolicy::Delete)
        {
            self.reclaim_workspace().await?;
        }
        if self.deleting && sync::destroyed(&last) {
            // The destroy is recorded first, as PKO does (another finalizer may keep the Stack
            // readable), with the conditions as they are: were the finalizer's removal
            // refused, a write of new conditions would clear the stall that reports it, and
            // trigger the next attempt at once, on every attempt.
            self.writer
                .write(&self.status, &self.ctx.own_writes)
                .await?;
            set_finalizer(self.ctx, self.stack, false).await?;
            return Err(Stop::Quiet);
        }
        Ok(outcome)
    }

    /// `workspaceReclaimPolicy: Delete`: the workspace (and its pod) goes once the stack is up
    /// to date; the next sync makes a new one.
    async fn reclaim_workspace(&self) -> Result<(), StackError> {
        let workspaces: Api<Workspace> = Api::namespaced(self.ctx.client.clone(), &self.namespace);
        let existing = workspaces
            .get_opt(&self.name)
            .await
            .map_err(StackError::kube("reading the Workspace"))?;
        if existing.is_some_and(|w| w.meta().deletion_timestamp.is_none()) {
            workspaces
                .delete(&self.name, &DeleteParams::background())
                .await
                .map_err(StackError::kube("deleting the Workspace"))?;
            self.event(
                EventType::Normal,
                "WorkspaceDeleted",
                format!(
                    "Deleted workspace {} (workspaceReclaimPolicy: Delete)",
                    self.name
                ),
            )
            .await;
        }
        Ok(())
    }
}

/// Where the drift check stands at the start of a reconcile.
#[derive(Debug, Default)]
struct DriftNow {
    /// The check still running, by its Update's name.
    running: Option<String>,
}

/// An Update is running: look again in a while (its completion also triggers a reconcile).
fn processing() -> Outcome {
    Outcome::reconciling("StackProcessing", "stack is being processed").after(UPDATE_POLL)
}

async fn set_finalizer(ctx: &StackContext, stack: &Stack, present: bool) -> Result<(), StackError> {
    let mut finalizers = stack.finalizers().to_vec();
    let has = finalizers.iter().any(|f| f == STACK_FINALIZER);
    if has == present {
        return Ok(());
    }
    if present {
        finalizers.push(STACK_FINALIZER.into());
    } else {
        finalizers.retain(|f| f != STACK_FINALIZER);
    }
    // The resource version makes this a compare-and-swap: other finalizers are never lost.
    let patch = json!({"metadata": {"finalizers": finalizers, "resourceVersion": stack.resource_version()}});
    Api::<Stack>::namespaced(ctx.client.clone(), &stack.namespace().unwrap_or_default())
        .patch(
            &stack.name_any(),
            &PatchParams::default(),
            &Patch::Merge(&patch),
        )
        .await
        .map_err(StackError::kube("updating the Stack finalizers"))?;
    if !present {
        ctx.applied
            .forget(&stack.namespace().unwrap_or_default(), &stack.name_any());
    }
    Ok(())
}

/// Outputs of a succeeded Update: raw JSON values, secrets as `"[secret]"` (PKO's rule), a
/// value nested deeper than [`MAX_DOCUMENT_DEPTH`] as its JSON text.
async fn read_outputs(
    client: &Client,
    namespace: &str,
    secret_name: &str,
) -> Option<BTreeMap<String, Value>> {
    // The name is the Update's status, which whoever may write Updates' status can set.
    let secret_name = pko_api::names::checked_name("status.outputs", secret_name).ok()?;
    let secret = Api::<Secret>::namespaced(client.clone(), namespace)
        .get_opt(secret_name)
        .await
        .ok()??;
    let secret_keys: Vec<String> = secret
        .annotations()
        .get(SECRETS_ANNOTATION)
        .and_then(|a| serde_json::from_str(a).ok())
        .unwrap_or_default();
    Some(
        secret
            .data
            .unwrap_or_default()
            .into_iter()
            .map(|(k, v)| {
                let value = if secret_keys.contains(&k) {
                    Value::String("[secret]".into())
                } else if pko_api::decode::json_depth(&v.0) > MAX_DOCUMENT_DEPTH {
                    // Kept as its JSON text: written as a tree, the Stack would be past the
                    // depth any client (this one included) can read back.
                    Value::String(String::from_utf8_lossy(&v.0).into_owned())
                } else {
                    serde_json::from_slice(&v.0).unwrap_or(Value::Null)
                };
                (k, value)
            })
            .collect(),
    )
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use http::{Method, Request, Response};
    use kube::client::Body;
    use kube::runtime::events::{Recorder, Reporter};
    use serde_json::json;
    use tower_test::mock;

    use super::*;
    use crate::egress::EgressPolicy;
    use crate::gitremote;

    type Handle = mock::Handle<Request<Body>, Response<Body>>;

    fn context() -> (StackContext, Handle) {
        let (service, handle) = mock::pair::<Request<Body>, Response<Body>>();
        let client = Client::new(service, "default");
        let recorder = Recorder::new(
            client.clone(),
            Reporter {
                controller: "test".into(),
                instance: None,
            },
        );
        let ctx = StackContext {
            git: gitremote::Resolver::new(
                crate::controller::stack::git_http_client(&Arc::new(EgressPolicy::default())),
                Arc::new(EgressPolicy::default()),
                Duration::from_secs(1),
                crate::gitremote::RemoteOptions::default(),
            ),
            ..StackContext::without_workspaces(client, recorder)
        };
        (ctx, handle)
    }

    fn stack(finalized: bool, status: Value) -> Stack {
        let finalizers = if finalized {
            json!([STACK_FINALIZER])
        } else {
            json!([])
        };
        serde_json::from_value(json!({
            "apiVersion": "pulumi.com/v1", "kind": "Stack",
            "metadata": {"name": "s", "namespace": "ns", "uid": "u-1", "generation": 3,
                "resourceVersion": "7", "finalizers": finalizers},
            "spec": {"stack": "dev", "programRef": {"name": "p"}},
            "status": status,
        }))
        .expect("stack")
    }

    fn not_found(kind: &str, name: &str) -> (u16, Value) {
        (
            404,
            json!({"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
                "message": format!("{kind} {name:?} not found"), "reason": "NotFound", "code": 404}),
        )
    }

    /// Answers the next request, after checking its method and path; returns what was sent.
    async fn answer(
        handle: &mut Handle,
        method: Method,
        path: &str,
        (status, body): (u16, Value),
    ) -> (Request<()>, Value) {
        let (request, send) = handle.next_request().await.expect("a request");
        assert_eq!(request.method(), method, "{}", request.uri());
        assert_eq!(request.uri().path(), path);
        let (parts, body_sent) = request.into_parts();
        let bytes = body_sent.collect_bytes().await.expect("body");
        let sent = if bytes.is_empty() {
            Value::Null
        } else {
            serde_json::from_slice(&bytes).expect("a JSON body")
        };
        let response = Response::builder()
            .status(status)
            .header("content-type", "application/json")
            .body(Body::from(serde_json::to_vec(&body).expect("json")))
            .expect("response");
        send.send_response(response);
        (Request::from_parts(parts, ()), sent)
    }

    fn conditions(patch: &Value) -> Vec<(String, String, String)> {
        let mut c: Vec<_> = patch["status"]["conditions"]
            .as_array()
            .expect("conditions")
            .iter()
            .map(|c| {
                let s = |k: &str| c[k].as_str().unwrap_or_default().to_owned();
                (s("type"), s("status"), s("reason"))
            })
            .collect();
        c.sort();
        c
    }

    #[tokio::test]
    async fn the_finalizer_comes_first_as_a_compare_and_swap() {
        let (ctx, mut handle) = context();
        let stack = stack(false, Value::Null);
        let reply = serde_json::to_value(&stack).expect("json");
        let server = tokio::spawn(async move {
            let path = "/apis/pulumi.com/v1/namespaces/ns/stacks/s";
            answer(&mut handle, Method::PATCH, path, (200, reply)).await
        });
        let action = reconcile_inner(&stack, &ctx).await.expect("reconciled");
        assert_eq!(action, Action::await_change());
        let (request, patch) = server.await.expect("server");
        assert_eq!(
            request.headers()["content-type"],
            "application/merge-patch+json"
        );
        assert_eq!(
            patch,
            json!({"metadata": {"finalizers": [STACK_FINALIZER], "resourceVersion": "7"}})
        );
    }

    #[tokio::test]
    async fn a_missing_program_stalls_the_stack_in_one_status_write() {
        let (ctx, mut handle) = context();
        let stack = stack(true, Value::Null);
        let reply = serde_json::to_value(&stack).expect("json");
        let server = tokio::spawn(async move {
            let program = "/apis/pulumi.com/v1/namespaces/ns/programs/p";
            answer(
                &mut handle,
                Method::GET,
                program,
                not_found("programs", "p"),
            )
            .await;
            let status = "/apis/pulumi.com/v1/namespaces/ns/stacks/s/status";
            answer(&mut handle, Method::PATCH, status, (200, reply)).await
        });
        let action = reconcile_inner(&stack, &ctx).await.expect("reconciled");
        assert_eq!(action, Action::requeue(Duration::from_secs(30)));
        let (request, patch) = server.await.expect("server");
        let query = request.uri().query().unwrap_or_default();
        assert!(
            query.contains("fieldManager=pko-rs%2Fstack-status") && query.contains("force=true"),
            "{query}"
        );
        assert_eq!(
            request.headers()["content-type"],
            "application/apply-patch+yaml"
        );
        assert_eq!(patch["apiVersion"], "pulumi.com/v1");
        assert_eq!(patch["kind"], "Stack");
        assert_eq!(patch["status"]["observedGeneration"], 3);
        assert_eq!(
            conditions(&patch),
            vec![
                ("Ready".into(), "False".into(), "NotReadyStalled".into()),
                ("Stalled".into(), "True".into(), "SourceUnavailable".into()),
            ]
        );
        let stalled = patch["status"]["conditions"]
            .as_array()
            .and_then(|c| c.iter().find(|c| c["type"] == "Stalled"))
            .expect("stalled");
        assert_eq!(stalled["message"], "unable to retrieve program for stack");
    }

    #[tokio::test]
    async fn a_running_update_keeps_the_stack_reconciling() {
        let (ctx, mut handle) = context();
        let stack = stack(
            true,
            json!({"observedGeneration": 3, "currentUpdate": {"generation": 3, "name": "s-1", "commit": "d1"}}),
        );
        let reply = serde_json::to_value(&stack).expect("json");
        let update = json!({"apiVersion": "auto.pulumi.com/v1alpha1", "kind": "Update",
            "metadata": {"name": "s-1", "namespace": "ns"}, "spec": {"type": "up"}});
        let server = tokio::spawn(async move {
            let path = "/apis/auto.pulumi.com/v1alpha1/namespaces/ns/updates/s-1";
            answer(&mut handle, Method::GET, path, (200, update)).await;
            let status = "/apis/pulumi.com/v1/namespaces/ns/stacks/s/status";
            answer(&mut handle, Method::PATCH, status, (200, reply)).await
        });
        let action = reconcile_inner(&stack, &ctx).await.expect("reconciled");
        assert_eq!(action, Action::requeue(Duration::from_secs(300)));
        let (_, patch) = server.await.expect("server");
        assert_eq!(
            conditions(&patch),
            vec![
                ("Ready".into(), "False".into(), "NotReadyInProgress".into()),
                (
                    "Reconciling".into(),
                    "True".into(),
                    "StackProcessing".into()
                ),
            ]
        );
        assert_eq!(patch["status"]["currentUpdate"]["name"], "s-1");
    }

    #[tokio::test]
    async fn an_unchanged_status_is_not_written() {
        let (ctx, mut handle) = context();
        let stack = stack(true, Value::Null);
        let writer = StatusWriter::new(&ctx.client, &stack, "ns");
        writer
            .write(&StackStatus::default(), &ctx.own_writes)
            .await
            .expect("nothing to write");
        // No request reached the apiserver.
        drop(ctx);
        drop(writer);
        assert!(handle.next_request().await.is_none());
    }
}
