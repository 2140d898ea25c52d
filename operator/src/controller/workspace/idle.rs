//! Scale to zero (`spec.idle`, pko-rs only): a workspace whose pod has run no operation for
//! `idle.after` is stopped (its StatefulSet scaled to 0 replicas) and started again when an
//! Update names it; meanwhile it is `Ready=False` with reason `Idle`, neither reconciling nor
//! stalled (kstatus, which takes any `Ready=False` for progress, reads it as `InProgress`
//! with the `Idle` message, never `Failed`; docs/execution.md, "Scale to zero").
//!
//! Everything the decision reads survives an operator restart, so a restart neither wakes an
//! idle workspace nor restarts its clock: whether it is stopped (its `Idle` condition), when it
//! last did something (the end of its last finished Update, or when it became ready), and
//! whether an Update waits for it (an unfinished Update naming it). [`decide`] is the pure
//! decision; [`phase`] gathers its facts (the Updates only when the clock may have run out, or
//! the workspace is stopped) and carries it out. What the pod held is not kept: a woken pod
//! fetches the source again at the digest the spec pins and installs the plugins again
//! (docs/execution.md, "Scale to zero").

use std::time::Duration;

use k8s_openapi::api::apps::v1::StatefulSet;
use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, ListParams, Patch, PatchParams};
use kube::runtime::controller::Action;
use kube::runtime::events::EventType;
use kube::{Client, Resource, ResourceExt};
use pko_api::update::Update;
use pko_api::workspace::{Workspace, WorkspaceStatus};
use tracing::info;

use super::phases::{End, Phase, READY_RECHECK, Run};
use super::status::{self, READY, STALLED};
use super::{WorkspaceError, pod};
use crate::controller::conditions;
use crate::controller::keys::{IDLE, IDLE_MANAGER, RECONCILING, WAKING};
use crate::controller::kit::FromKube;

/// The shortest wait before the clock is looked at again.
const MIN_RECHECK: Duration = Duration::from_secs(1);
/// A stop that found an Update made meanwhile looks again at once (and wakes for it).
const RACED_RECHECK: Duration = Duration::from_millis(100);

/// `idle.after` as a duration: a Go duration of more than zero.
pub(super) fn parse_after(text: &str) -> Result<Duration, String> {
    match pko_api::duration::parse_go_duration(text) {
        Ok(d) if d.is_zero() => Err(format!("spec.idle.after {text:?}: must be longer than 0")),
        Ok(d) => Ok(d),
        Err(e) => Err(format!("spec.idle.after {text:?}: {e}")),
    }
}

/// Whether `status` says the pod is stopped by `spec.idle` (of whatever generation).
pub fn idle_status(status: &WorkspaceStatus) -> bool {
    conditions::get(&status.conditions, READY)
        .is_some_and(|c| c.status == "False" && c.reason == IDLE)
}

/// Whether `ws` is stopped by `spec.idle` as of its current spec: usable by an Update, which
/// starts it again.
pub fn stopped(ws: &Workspace) -> bool {
    ws.status
        .as_ref()
        .is_some_and(|s| s.observed_generation == ws.metadata.generation && idle_status(s))
}

/// When the workspace became ready, if it is ready at `generation`.
fn ready_since(status: &WorkspaceStatus, generation: Option<i64>) -> Option<Timestamp> {
    if status.observed_generation != generation {
        return None;
    }
    conditions::get(&status.conditions, READY)
        .filter(|c| c.status == "True")
        .map(|c| c.last_transition_time.0)
}

/// What the workspace's Updates say.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(super) struct Activity {
    /// An Update naming the workspace that has not completed (the first found).
    pub(super) pending: Option<String>,
    /// When the last completed one ended.
    pub(super) last_end: Option<Timestamp>,
}

/// The [`Activity`] of workspace `workspace` among `updates` (those of its namespace).
pub(super) fn activity_of(updates: &[Update], workspace: &str) -> Activity {
    let mut activity = Activity::default();
    for u in updates
        .iter()
        .filter(|u| u.spec.workspace_name.as_deref() == Some(workspace))
    {
        let status = u.status.as_ref();
        let complete = status.is_some_and(|s| conditions::is_true(&s.conditions, "Complete"));
        if !complete {
            if u.meta().deletion_timestamp.is_none() && activity.pending.is_none() {
                activity.pending = Some(u.name_any());
            }
            continue;
        }
        let end = status.and_then(|s| s.end_time.as_ref().or(s.start_time.as_ref()));
        if let Some(end) = end {
            activity.last_end = activity.last_end.max(Some(end.0));
        }
    }
    activity
}

/// What `spec.idle` asks of the workspace now.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum Decision {
    /// The pod runs (as without the setting); the clock is looked at again after `recheck`.
    Run { recheck: Option<Duration> },
    /// The decision needs the workspace's Updates ([`Activity`]).
    LookUp,
    /// The stopped pod starts again, for the Update named (none: the setting was removed).
    Wake { update: Option<String> },
    /// The pod ran no operation for the whole period: it stops.
    Stop,
    /// The pod stays stopped.
    StayStopped,
}

/// The decision for a workspace with setting `after` (none: no `spec.idle`), `stopped` or not,
/// ready since `ready_since` (none: not ready), with its Updates' `activity` when looked up,
/// at `now`. A workspace that is not ready (starting, failing) is never stopped: its status
/// says what is wrong, and the clock starts once it is ready.
pub(super) fn decide(
    after: Option<Duration>,
    stopped: bool,
    ready_since: Option<Timestamp>,
    activity: Option<&Activity>,
    now: Timestamp,
) -> Decision {
    let Some(after) = after else {
        return if stopped {
            Decision::Wake { update: None }
        } else {
            Decision::Run { recheck: None }
        };
    };
    if !stopped {
        let Some(since) = ready_since else {
            return Decision::Run {
                recheck: Some(after),
            };
        };
        // Ready for less than the period: no Update can make it idle sooner.
        if let Some(left) = remaining(since, after, now) {
            return Decision::Run {
                recheck: Some(left),
            };
        }
    }
    let Some(activity) = activity else {
        return Decision::LookUp;
    };
    if let Some(update) = &activity.pending {
        return if stopped {
            Decision::Wake {
                update: Some(update.clone()),
            }
        } else {
            Decision::Run {
                recheck: Some(after),
            }
        };
    }
    if stopped {
        return Decision::StayStopped;
    }
    let since = ready_since.max(activity.last_end).unwrap_or(now);
    match remaining(since, after, now) {
        Some(left) => Decision::Run {
            recheck: Some(left),
        },
        None => Decision::Stop,
    }
}

/// How long until `after` has passed since `since` (at least [`MIN_RECHECK`]), or `None` when
/// it has.
fn remaining(since: Timestamp, after: Duration, now: Timestamp) -> Option<Duration> {
    // A `since` ahead of this clock (skew) counts as now.
    let elapsed = Duration::try_from(now.duration_since(since)).unwrap_or(Duration::ZERO);
    after
        .checked_sub(elapsed)
        .filter(|left| !left.is_zero())
        .map(|left| left.max(MIN_RECHECK))
}

/// The `Idle` condition's message.
fn idle_message(after: Option<Duration>) -> String {
    match after {
        Some(after) => format!(
            "no operation for {}: the workspace pod is stopped, and the next Update starts it again",
            humantime(after)
        ),
        None => "the workspace pod is stopped, and the next Update starts it again".to_owned(),
    }
}

/// `1h2m3s` as Go writes durations (whole seconds; `0s` for less).
fn humantime(d: Duration) -> String {
    let s = d.as_secs();
    let (h, m, s) = (s / 3600, (s / 60) % 60, s % 60);
    let mut out = String::new();
    if h > 0 {
        out.push_str(&format!("{h}h"));
    }
    if h > 0 || m > 0 {
        out.push_str(&format!("{m}m"));
    }
    out.push_str(&format!("{s}s"));
    out
}

/// `Ready=False` with reason `Idle`, nothing reconciling or stalled, no address.
pub(super) fn mark_idle(status: &mut WorkspaceStatus, message: &str, generation: Option<i64>) {
    status.address = None;
    conditions::remove(&mut status.conditions, STALLED);
    conditions::remove(&mut status.conditions, RECONCILING);
    conditions::set(
        &mut status.conditions,
        READY,
        false,
        IDLE,
        message,
        generation,
    );
}

/// The ready end of a reconcile, looked at again by the time the idle clock runs out.
pub(super) fn ready_end(end: End, recheck: Option<Duration>) -> End {
    match (end, recheck) {
        (End::Report(_), Some(wait)) if wait < READY_RECHECK => End::Report(Action::requeue(wait)),
        (end, _) => end,
    }
}

/// The idle phase, before the workload is applied: continues (with when to look at the clock
/// again) while the pod is to run, ends the reconcile while it is stopped.
pub(super) async fn phase(run: &mut Run<'_>) -> Result<Phase<Option<Duration>>, WorkspaceError> {
    let after = match run.ws.spec.idle.as_ref().map(|i| parse_after(&i.after)) {
        None => None,
        Some(Ok(after)) => Some(after),
        Some(Err(message)) => return Ok(Phase::Done(invalid(run, message).await)),
    };
    let stopped = idle_status(&run.before);
    let since = ready_since(&run.before, run.generation);
    let now = Timestamp::now();
    let mut decision = decide(after, stopped, since, None, now);
    if decision == Decision::LookUp {
        let activity = activity(&run.ctx.client, &run.namespace, &run.name).await?;
        decision = decide(after, stopped, since, Some(&activity), now);
    }
    match decision {
        Decision::Run { recheck } => Ok(Phase::Continue(recheck)),
        Decision::LookUp => Ok(Phase::Continue(after)),
        Decision::Wake { update } => {
            let note = match update {
                Some(update) => format!("Starting the idle workspace's pod for Update {update}"),
                None => "Starting the workspace's pod: spec.idle was removed".to_owned(),
            };
            info!(workspace = %run.name, %note, "waking");
            run.ctx.event(run.ws, EventType::Normal, WAKING, note).await;
            Ok(Phase::Continue(after))
        }
        Decision::StayStopped => {
            scale_to_zero(&run.ctx.client, &run.namespace, &run.name).await?;
            forget(run);
            mark_idle(&mut run.status, &idle_message(after), run.generation);
            Ok(Phase::Done(End::Report(Action::await_change())))
        }
        Decision::Stop => stop(run, after).await,
    }
}

/// A setting the controller cannot use (past the CRD's pattern: too long a duration, or 0)
/// stalls the workspace, with a Warning Event unless it is stalled already.
async fn invalid(run: &mut Run<'_>, message: String) -> End {
    if !conditions::is_true(&run.status.conditions, STALLED) {
        run.ctx
            .event(run.ws, EventType::Warning, "SpecInvalid", message.clone())
            .await;
    }
    status::mark_not_ready(
        &mut run.status,
        true,
        "SpecInvalid",
        &message,
        run.generation,
    );
    End::Report(Action::await_change())
}

/// Stops the pod. The status says `Idle` first, then the Updates are looked at again: one made
/// before that write may have seen the workspace ready and be starting on this pod, so the pod
/// stays and the next reconcile wakes the workspace for it; one made after waits for the pod.
async fn stop(
    run: &mut Run<'_>,
    after: Option<Duration>,
) -> Result<Phase<Option<Duration>>, WorkspaceError> {
    mark_idle(&mut run.status, &idle_message(after), run.generation);
    run.ctx
        .write_status(&run.namespace, &run.name, &run.before, &run.status)
        .await?;
    run.before = run.status.clone();
    let activity = activity(&run.ctx.client, &run.namespace, &run.name).await?;
    if let Some(update) = activity.pending {
        info!(workspace = %run.name, %update, "an Update came as the workspace went idle; keeping its pod");
        return Ok(Phase::Done(End::Quiet(Action::requeue(RACED_RECHECK))));
    }
    scale_to_zero(&run.ctx.client, &run.namespace, &run.name).await?;
    forget(run);
    let note = format!(
        "Stopped the workspace's pod {}-0: {}",
        pod::workload_name(&run.name),
        idle_message(after)
    );
    info!(workspace = %run.name, "idle: pod stopped");
    run.ctx.event(run.ws, EventType::Normal, IDLE, note).await;
    Ok(Phase::Done(End::Quiet(Action::await_change())))
}

/// The Updates of the workspace's namespace, as [`Activity`].
async fn activity(
    client: &Client,
    namespace: &str,
    workspace: &str,
) -> Result<Activity, WorkspaceError> {
    let updates: Api<Update> = Api::namespaced(client.clone(), namespace);
    let list = updates
        .list(&ListParams::default())
        .await
        .map_err(WorkspaceError::kube(
            "listing the Updates of the workspace's namespace",
        ))?;
    Ok(activity_of(&list.items, workspace))
}

/// Scales the workspace's StatefulSet to 0 (a merge patch of `spec.replicas`, which needs no
/// permission beyond the StatefulSet's own), unless it is already (or gone). The next apply of
/// the workload sets one replica again.
async fn scale_to_zero(
    client: &Client,
    namespace: &str,
    workspace: &str,
) -> Result<(), WorkspaceError> {
    let statefulsets: Api<StatefulSet> = Api::namespaced(client.clone(), namespace);
    let name = pod::workload_name(workspace);
    let live = statefulsets
        .get_opt(&name)
        .await
        .map_err(WorkspaceError::kube("reading the workspace StatefulSet"))?;
    let replicas = live.and_then(|s| s.spec).map(|s| s.replicas.unwrap_or(1));
    if replicas.is_none_or(|r| r == 0) {
        return Ok(());
    }
    let params = PatchParams {
        field_manager: Some(IDLE_MANAGER.to_owned()),
        ..PatchParams::default()
    };
    let patch = serde_json::json!({"spec": {"replicas": 0}});
    statefulsets
        .patch(&name, &params, &Patch::Merge(&patch))
        .await
        .map_err(WorkspaceError::kube(
            "scaling the workspace StatefulSet to 0",
        ))?;
    Ok(())
}

/// What this process knew of the stopped pod's agent: a woken pod is a new agent.
fn forget(run: &Run<'_>) {
    run.ctx.set_initialized(&run.uid, None);
    run.ctx.set_facts(&run.uid, None);
    run.ctx.set_workload(&run.uid, None);
    run.ctx.agents.forget(&run.name, &run.namespace);
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    const MIN: Duration = Duration::from_secs(60);

    fn at(s: &str) -> Timestamp {
        s.parse().expect("timestamp")
    }

    fn activity(pending: Option<&str>, last_end: Option<&str>) -> Activity {
        Activity {
            pending: pending.map(str::to_owned),
            last_end: last_end.map(at),
        }
    }

    #[test]
    fn without_the_setting_the_pod_runs_and_a_stopped_one_starts() {
        let now = at("2026-01-01T10:00:00Z");
        assert_eq!(
            decide(None, false, Some(now), None, now),
            Decision::Run { recheck: None }
        );
        assert_eq!(
            decide(None, true, None, None, now),
            Decision::Wake { update: None }
        );
    }

    #[test]
    fn the_clock_runs_from_the_later_of_ready_and_the_last_update() {
        let ready = Some(at("2026-01-01T10:00:00Z"));
        // Ready for less than the period: no Updates read, looked at again when it runs out.
        assert_eq!(
            decide(Some(MIN), false, ready, None, at("2026-01-01T10:00:45Z")),
            Decision::Run {
                recheck: Some(Duration::from_secs(15))
            }
        );
        let now = at("2026-01-01T10:01:30Z");
        assert_eq!(decide(Some(MIN), false, ready, None, now), Decision::LookUp);
        // Nothing ran since it became ready: it stops.
        assert_eq!(
            decide(Some(MIN), false, ready, Some(&activity(None, None)), now),
            Decision::Stop
        );
        // An Update ended 50 s ago: 10 s left.
        let recent = activity(None, Some("2026-01-01T10:00:40Z"));
        assert_eq!(
            decide(Some(MIN), false, ready, Some(&recent), now),
            Decision::Run {
                recheck: Some(Duration::from_secs(10))
            }
        );
        // One ended long enough ago.
        let old = activity(None, Some("2026-01-01T10:00:20Z"));
        assert_eq!(
            decide(Some(MIN), false, ready, Some(&old), now),
            Decision::Stop
        );
        // Exactly the period: stops (the deadline is reached, not passed).
        assert_eq!(
            decide(
                Some(MIN),
                false,
                ready,
                Some(&activity(None, None)),
                at("2026-01-01T10:01:00Z")
            ),
            Decision::Stop
        );
    }

    #[test]
    fn a_pending_update_keeps_the_pod_and_wakes_a_stopped_one() {
        let ready = Some(at("2026-01-01T10:00:00Z"));
        let now = at("2026-01-01T11:00:00Z");
        let pending = activity(Some("u1"), Some("2026-01-01T10:00:10Z"));
        assert_eq!(
            decide(Some(MIN), false, ready, Some(&pending), now),
            Decision::Run { recheck: Some(MIN) }
        );
        assert_eq!(
            decide(Some(MIN), true, None, Some(&pending), now),
            Decision::Wake {
                update: Some("u1".into())
            }
        );
    }

    #[test]
    fn a_stopped_workspace_stays_stopped_until_an_update_needs_it() {
        let now = at("2026-01-01T11:00:00Z");
        // Stopped: the Updates are always read (a new one wakes it), whatever the clock says.
        assert_eq!(decide(Some(MIN), true, None, None, now), Decision::LookUp);
        assert_eq!(
            decide(Some(MIN), true, None, Some(&activity(None, None)), now),
            Decision::StayStopped
        );
        // A recent Update that completed (the one it woke for) does not wake it again.
        let done = activity(None, Some("2026-01-01T10:59:59Z"));
        assert_eq!(
            decide(Some(MIN), true, None, Some(&done), now),
            Decision::StayStopped
        );
    }

    #[test]
    fn a_workspace_that_is_not_ready_is_never_stopped() {
        let now = at("2026-01-01T11:00:00Z");
        assert_eq!(
            decide(Some(MIN), false, None, Some(&activity(None, None)), now),
            Decision::Run { recheck: Some(MIN) }
        );
    }

    fn update(name: &str, workspace: &str, status: serde_json::Value) -> Update {
        serde_json::from_value(json!({
            "apiVersion": "auto.pulumi.com/v1alpha1", "kind": "Update",
            "metadata": {"name": name},
            "spec": {"workspaceName": workspace, "type": "up"},
            "status": status,
        }))
        .expect("update")
    }

    #[test]
    fn activity_is_read_from_the_workspaces_updates_only() {
        let complete = |end: &str| {
            json!({"endTime": end, "startTime": "2026-01-01T09:00:00Z",
                "conditions": [{"type": "Complete", "status": "True", "reason": "Updated",
                    "message": "", "lastTransitionTime": end}]})
        };
        let updates = [
            update("a", "ws", complete("2026-01-01T10:00:00Z")),
            update("b", "ws", complete("2026-01-01T10:05:00Z")),
            update("c", "other", complete("2026-01-01T11:00:00Z")),
            update("d", "other", json!({})),
        ];
        assert_eq!(
            activity_of(&updates, "ws"),
            activity(None, Some("2026-01-01T10:05:00Z"))
        );
        let mut with_running = updates.to_vec();
        with_running.push(update(
            "e",
            "ws",
            json!({"conditions": [
            {"type": "Progressing", "status": "True", "reason": "Progressing", "message": "",
             "lastTransitionTime": "2026-01-01T10:06:00Z"}]}),
        ));
        assert_eq!(
            activity_of(&with_running, "ws"),
            activity(Some("e"), Some("2026-01-01T10:05:00Z"))
        );
        // One being deleted waits for nothing.
        let mut deleted = update("f", "ws", json!({}));
        deleted.metadata.deletion_timestamp = Some(
            k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(at("2026-01-01T10:07:00Z")),
        );
        assert_eq!(activity_of(&[deleted], "ws").pending, None);
    }

    #[test]
    fn the_idle_condition_is_ready_false_and_nothing_else() {
        let mut status = WorkspaceStatus {
            address: Some("a:1".into()),
            ..Default::default()
        };
        conditions::set(&mut status.conditions, RECONCILING, true, "x", "", Some(1));
        conditions::set(&mut status.conditions, STALLED, true, "x", "", Some(1));
        mark_idle(
            &mut status,
            &idle_message(Some(Duration::from_secs(600))),
            Some(2),
        );
        assert!(idle_status(&status));
        assert_eq!(status.address, None);
        assert!(conditions::get(&status.conditions, RECONCILING).is_none());
        assert!(conditions::get(&status.conditions, STALLED).is_none());
        let ready = conditions::get(&status.conditions, READY).expect("Ready");
        assert_eq!(
            ready.message,
            "no operation for 10m0s: the workspace pod is stopped, and the next Update starts it again"
        );
        // The reconcile's draft carries the generation it observed.
        status.observed_generation = Some(2);
        let ws = |generation: i64| -> Workspace {
            let mut ws = Workspace::new("w", Default::default());
            ws.metadata.generation = Some(generation);
            ws.status = Some(status.clone());
            ws
        };
        assert!(stopped(&ws(2)));
        assert!(!stopped(&ws(3)), "a spec not observed yet");
        conditions::set(
            &mut status.conditions,
            READY,
            false,
            "WaitingForReplicas",
            "",
            Some(2),
        );
        assert!(!idle_status(&status));
    }

    #[test]
    fn after_must_be_a_positive_go_duration() {
        assert_eq!(parse_after("10m"), Ok(Duration::from_secs(600)));
        assert_eq!(parse_after("1h30m"), Ok(Duration::from_secs(5400)));
        assert!(parse_after("0s").is_err());
        assert!(parse_after("ten minutes").is_err());
        assert_eq!(humantime(Duration::from_secs(3723)), "1h2m3s");
        assert_eq!(humantime(Duration::from_secs(5)), "5s");
    }

    #[test]
    fn only_a_shorter_clock_shortens_the_ready_recheck() {
        let ready = || End::Report(Action::requeue(READY_RECHECK));
        assert_eq!(
            ready_end(ready(), Some(Duration::from_secs(5))),
            End::Report(Action::requeue(Duration::from_secs(5)))
        );
        assert_eq!(ready_end(ready(), Some(Duration::from_secs(3600))), ready());
        assert_eq!(ready_end(ready(), None), ready());
    }
}
