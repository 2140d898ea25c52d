//! The Workspace status: what each outcome of a reconcile sets on the drafted status, and the
//! one writer that sends it.

use kube::Client;
use kube::api::{Api, Patch, PatchParams};
use pko_api::workspace::{Workspace, WorkspaceStatus};

use super::{WorkspaceError, rules};
use crate::controller::keys::{
    INITIALIZATION_FAILED, INSTALLATION_FAILED, RECONCILING, WORKSPACE_STATUS_MANAGER,
};
use crate::controller::kit;
use crate::controller::kit::FromKube;
use crate::controller::{backoff, conditions};

pub(super) const READY: &str = "Ready";
pub(super) use crate::controller::keys::STALLED;

/// The status a reconcile of `ws` starts from: the current one, for this generation.
pub(super) fn draft(ws: &Workspace) -> WorkspaceStatus {
    let mut status = ws.status.clone().unwrap_or_default();
    status.observed_generation = ws.metadata.generation;
    status
}

/// A stall reported after failed attempts holds until an attempt gets further: the outcomes
/// that write a status of their own clear it.
pub(super) fn clear_failure_stall(status: &mut WorkspaceStatus) {
    if conditions::get(&status.conditions, STALLED).is_some_and(|c| c.reason == backoff::REASON) {
        conditions::remove(&mut status.conditions, STALLED);
    }
}

/// Whether the last attempt at an agent step (install, stack initialization) of `generation`
/// failed, so the running attempt is a retry of it.
pub(super) fn retrying_a_failed_step(status: &WorkspaceStatus, generation: Option<i64>) -> bool {
    conditions::get(&status.conditions, STALLED).is_some_and(|c| {
        c.status == "True"
            && [INSTALLATION_FAILED, INITIALIZATION_FAILED].contains(&c.reason.as_str())
            && c.observed_generation == generation
    })
}

/// `Ready=False` for `reason`; with `stalled`, also `Stalled=True` (a state that retrying soon
/// will not fix), else `Reconciling=True` (on its way, as kstatus reads it) unless a stall the
/// caller kept holds. kstatus's conditions are present only while true.
pub(super) fn mark_not_ready(
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
    // A stall is about the generation it observed: a later one that got this far is not
    // stalled by it (else kstatus would read a fixed spec as Failed until it is Ready).
    if !stalled
        && conditions::get(&status.conditions, STALLED)
            .is_some_and(|c| c.observed_generation != generation)
    {
        conditions::remove(&mut status.conditions, STALLED);
    }
    if conditions::is_true(&status.conditions, STALLED) {
        conditions::remove(&mut status.conditions, RECONCILING);
    } else {
        conditions::set(
            &mut status.conditions,
            RECONCILING,
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

/// The Workspace is going away: no address, not ready (kstatus reads the deletion itself).
pub(super) fn mark_deleting(status: &mut WorkspaceStatus, generation: Option<i64>) {
    clear_failure_stall(status);
    conditions::remove(&mut status.conditions, RECONCILING);
    status.address = None;
    conditions::set(
        &mut status.conditions,
        READY,
        false,
        "Deleting",
        "Workspace is being deleted",
        generation,
    );
}

/// The pod (or its rollout) is not ready: not stalled, whatever stalled it before.
pub(super) fn mark_pod_not_ready(
    status: &mut WorkspaceStatus,
    reason: &str,
    message: &str,
    generation: Option<i64>,
) {
    status.address = None;
    conditions::remove(&mut status.conditions, STALLED);
    mark_not_ready(status, false, reason, message, generation);
}

/// Whether `before` already reports the pod of `generation` on its way ([`mark_pod_not_ready`]
/// with one of [`rules::not_ready`]'s messages, nothing stalled): a reconcile that finds the pod
/// still on its way, with no failure to name, writes nothing. A rollout then costs one status
/// write, not one per step (observed, updating, starting), which a reader would not act on.
pub(super) fn pod_wait_reported(before: &WorkspaceStatus, generation: Option<i64>) -> bool {
    let waiting = [
        rules::STS_UNOBSERVED,
        rules::POD_UPDATING,
        rules::POD_STARTING,
    ];
    before.observed_generation == generation
        && before.address.is_none()
        && !conditions::is_true(&before.conditions, STALLED)
        && conditions::is_true(&before.conditions, RECONCILING)
        && conditions::get(&before.conditions, READY).is_some_and(|c| {
            c.status == "False"
                && c.observed_generation == generation
                && waiting.contains(&c.message.as_str())
        })
}

/// The agent was told the workspace: ready, nothing stalled or in progress.
pub(super) fn mark_ready(status: &mut WorkspaceStatus, generation: Option<i64>) {
    conditions::remove(&mut status.conditions, STALLED);
    conditions::remove(&mut status.conditions, RECONCILING);
    conditions::set(
        &mut status.conditions,
        READY,
        true,
        "Succeeded",
        "",
        generation,
    );
}

/// Whether writing `after` over `before` would change nothing the operator owns.
pub(super) fn unchanged(before: &WorkspaceStatus, after: &WorkspaceStatus) -> bool {
    before.observed_generation == after.observed_generation
        && before.address == after.address
        && before.pulumi_version == after.pulumi_version
        && conditions::same(&before.conditions, &after.conditions)
}

/// What a failed reconcile reports: the status, and the Warning Event's note when that is news.
#[derive(Debug)]
pub(super) struct FailureReport {
    pub(super) status: WorkspaceStatus,
    pub(super) event: Option<String>,
}

/// The report of `err` (`stall`: retrying stopped helping), or `None` when the failure is
/// not reported yet. Derived from the error alone, so the same failure again changes nothing.
pub(super) fn failure_report(
    before: &WorkspaceStatus,
    generation: Option<i64>,
    err: &WorkspaceError,
    stall: bool,
) -> Option<FailureReport> {
    let mut status = before.clone();
    status.observed_generation = generation;
    let message = conditions::truncate(&err.message(), conditions::MESSAGE_LIMIT);
    if let WorkspaceError::AgentUnavailable { reason, .. } = err {
        status.address = None;
        if !stall {
            mark_not_ready(&mut status, false, reason, &message, generation);
        }
    } else if !stall {
        return None;
    }
    let mut event = None;
    if stall {
        let known = conditions::get(&before.conditions, STALLED).is_some_and(|c| {
            c.status == "True" && c.reason == backoff::REASON && c.message == message
        });
        if !known {
            event = Some(message.clone());
        }
        mark_not_ready(&mut status, true, backoff::REASON, &message, generation);
    }
    Some(FailureReport { status, event })
}

/// Writes `after` as the Workspace status (server-side apply of the whole status), unless it
/// says what `before` says; returns the Workspace as written.
pub(super) async fn write_status(
    client: &Client,
    namespace: &str,
    name: &str,
    before: &WorkspaceStatus,
    after: &WorkspaceStatus,
) -> Result<Option<Workspace>, WorkspaceError> {
    if unchanged(before, after) {
        return Ok(None);
    }
    let patch = kit::StatusPatch::new::<Workspace>(after);
    let api: Api<Workspace> = Api::namespaced(client.clone(), namespace);
    let written = api
        .patch_status(
            name,
            &PatchParams::apply(WORKSPACE_STATUS_MANAGER).force(),
            &Patch::Apply(&patch),
        )
        .await
        .map_err(WorkspaceError::kube("writing the Workspace status"))?;
    Ok(Some(written))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ready(status: &WorkspaceStatus) -> Option<(String, String, String)> {
        conditions::get(&status.conditions, READY)
            .map(|c| (c.status.clone(), c.reason.clone(), c.message.clone()))
    }

    fn failure_stalled() -> WorkspaceStatus {
        let mut status = WorkspaceStatus::default();
        mark_not_ready(&mut status, true, backoff::REASON, "boom", Some(1));
        status
    }

    #[test]
    fn deleting_clears_a_failure_stall_and_the_address() {
        let mut status = failure_stalled();
        status.address = Some("a:1".into());
        mark_deleting(&mut status, Some(2));
        assert_eq!(status.address, None);
        assert!(conditions::get(&status.conditions, STALLED).is_none());
        assert_eq!(
            ready(&status),
            Some((
                "False".into(),
                "Deleting".into(),
                "Workspace is being deleted".into()
            ))
        );
    }

    #[test]
    fn only_a_failure_stall_is_cleared_by_progress() {
        let mut spec_invalid = WorkspaceStatus::default();
        mark_not_ready(&mut spec_invalid, true, "SpecInvalid", "bad", Some(1));
        clear_failure_stall(&mut spec_invalid);
        assert!(conditions::is_true(&spec_invalid.conditions, STALLED));
        let mut failed = failure_stalled();
        clear_failure_stall(&mut failed);
        assert!(conditions::get(&failed.conditions, STALLED).is_none());
    }

    #[test]
    fn only_a_failed_step_of_the_same_generation_is_a_retry() {
        let mut status = WorkspaceStatus::default();
        assert!(!retrying_a_failed_step(&status, Some(1)));
        mark_not_ready(&mut status, true, INITIALIZATION_FAILED, "no", Some(1));
        assert!(retrying_a_failed_step(&status, Some(1)));
        assert!(!retrying_a_failed_step(&status, Some(2)), "a new spec");
        mark_not_ready(&mut status, true, INSTALLATION_FAILED, "no", Some(2));
        assert!(retrying_a_failed_step(&status, Some(2)));
        mark_not_ready(&mut status, true, "SpecInvalid", "bad", Some(2));
        assert!(!retrying_a_failed_step(&status, Some(2)), "not a step");
        mark_ready(&mut status, Some(2));
        assert!(!retrying_a_failed_step(&status, Some(2)));
    }

    #[test]
    fn a_pod_not_ready_and_a_ready_workspace_are_not_stalled() {
        let mut status = WorkspaceStatus::default();
        mark_not_ready(&mut status, true, "SpecInvalid", "bad", Some(1));
        status.address = Some("a:1".into());
        assert!(conditions::get(&status.conditions, RECONCILING).is_none());
        mark_pod_not_ready(&mut status, "WaitingForReplicas", "waiting", Some(1));
        assert_eq!(status.address, None);
        assert!(conditions::get(&status.conditions, STALLED).is_none());
        let reconciling = conditions::get(&status.conditions, RECONCILING).expect("Reconciling");
        assert_eq!(
            (reconciling.status.as_str(), reconciling.reason.as_str()),
            ("True", "WaitingForReplicas")
        );
        mark_not_ready(&mut status, true, INSTALLATION_FAILED, "no", Some(1));
        assert!(conditions::get(&status.conditions, RECONCILING).is_none());
        mark_not_ready(&mut status, false, "Installing", "installing", Some(1));
        assert!(
            conditions::get(&status.conditions, RECONCILING).is_none(),
            "a kept stall is not also in progress"
        );
        mark_not_ready(
            &mut status,
            false,
            "EnvironmentUnavailable",
            "later",
            Some(2),
        );
        assert!(
            conditions::get(&status.conditions, STALLED).is_none(),
            "a stall of generation 1 does not hold generation 2"
        );
        assert!(conditions::is_true(&status.conditions, RECONCILING));
        mark_ready(&mut status, Some(2));
        assert!(conditions::get(&status.conditions, STALLED).is_none());
        assert!(conditions::get(&status.conditions, RECONCILING).is_none());
        assert_eq!(
            ready(&status),
            Some(("True".into(), "Succeeded".into(), String::new()))
        );
    }

    #[test]
    fn only_owned_fields_count_as_a_change() {
        let before = failure_stalled();
        let mut after = before.clone();
        assert!(unchanged(&before, &after));
        after.pulumi_version = Some("v3".into());
        assert!(!unchanged(&before, &after));
    }

    #[test]
    fn an_unavailable_agent_is_reported_before_it_stalls() {
        let err = WorkspaceError::AgentUnavailable {
            reason: "ConnectionFailed".into(),
            message: "no answer".into(),
        };
        let mut before = WorkspaceStatus {
            address: Some("a:1".into()),
            ..Default::default()
        };
        let report = failure_report(&before, Some(1), &err, false).expect("reported");
        assert_eq!(report.event, None);
        assert_eq!(report.status.address, None);
        assert_eq!(
            ready(&report.status),
            Some((
                "False".into(),
                "ConnectionFailed".into(),
                "no answer".into()
            ))
        );

        let stalled = failure_report(&before, Some(1), &err, true).expect("reported");
        assert_eq!(stalled.event.as_deref(), Some("no answer"));
        assert!(conditions::is_true(&stalled.status.conditions, STALLED));
        // Already stalled with the same message: no second Event.
        before = stalled.status;
        let again = failure_report(&before, Some(1), &err, true).expect("reported");
        assert_eq!(again.event, None);
        assert!(unchanged(&before, &again.status));
    }

    #[test]
    fn other_failures_are_reported_only_once_stalled() {
        let err = WorkspaceError::NoNamespace;
        assert!(failure_report(&WorkspaceStatus::default(), Some(1), &err, false).is_none());
        let report =
            failure_report(&WorkspaceStatus::default(), Some(1), &err, true).expect("reported");
        assert_eq!(report.event.as_deref(), Some("workspace has no namespace"));
        assert_eq!(
            ready(&report.status).map(|r| r.1),
            Some(backoff::REASON.to_owned())
        );
    }

    #[test]
    fn a_pod_on_its_way_is_reported_once_per_generation() {
        let mut updating = WorkspaceStatus {
            observed_generation: Some(2),
            ..WorkspaceStatus::default()
        };
        mark_pod_not_ready(&mut updating, "RollingUpdate", rules::POD_UPDATING, Some(2));
        assert!(pod_wait_reported(&updating, Some(2)));
        // A new generation, an init failure named, a stall, or a ready pod: written again.
        assert!(!pod_wait_reported(&updating, Some(3)));
        let mut failed = updating.clone();
        mark_pod_not_ready(
            &mut failed,
            "WaitingForReplicas",
            "init container x failed",
            Some(2),
        );
        assert!(!pod_wait_reported(&failed, Some(2)));
        let mut stalled = updating.clone();
        mark_not_ready(
            &mut stalled,
            true,
            "SpecInvalid",
            rules::POD_UPDATING,
            Some(2),
        );
        assert!(!pod_wait_reported(&stalled, Some(2)));
        let mut ready = updating.clone();
        mark_ready(&mut ready, Some(2));
        assert!(!pod_wait_reported(&ready, Some(2)));
        let mut reached = updating;
        reached.address = Some("a:1".into());
        assert!(!pod_wait_reported(&reached, Some(2)));
    }
}
