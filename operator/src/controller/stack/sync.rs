//! The Stack controller's decisions, as pure functions of the Stack, its status and the objects
//! read: whether the last update covers the stack (`isSynced`), the retry cooldown, how a
//! finished Update is recorded, whether a prerequisite is met, and what an up-to-date stack
//! reports.

use std::time::Duration;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use k8s_openapi::jiff::Timestamp;
use kube::ResourceExt;
use pko_api::stack::{CurrentStackUpdate, PrerequisiteRef, Stack, StackStatus, StackUpdateState};
use pko_api::update::{UpdateStatus, UpdateType};

use super::outcome::Outcome;
use crate::controller::conditions;
use crate::controller::keys::RECONCILE_REQUEST_ANNOTATION;

/// PKO's hard-coded limit: after this many consecutive failures the stack stalls.
pub(super) const MAX_FAILURES: i64 = 3;
const DEFAULT_MAX_BACKOFF: i64 = 86_400;

/// `lastUpdate.state`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum UpdateState {
    Succeeded,
    Failed,
}

impl UpdateState {
    pub(super) fn as_str(self) -> &'static str {
        match self {
            Self::Succeeded => "succeeded",
            Self::Failed => "failed",
        }
    }

    /// The state a last update records, if it is one of ours.
    pub(super) fn of(last: &StackUpdateState) -> Option<Self> {
        match last.state.as_deref()? {
            "succeeded" => Some(Self::Succeeded),
            "failed" => Some(Self::Failed),
            _ => None,
        }
    }
}

/// `lastUpdate.type`, if it names an operation.
pub(super) fn update_type(last: &StackUpdateState) -> Option<UpdateType> {
    let recorded = last.type_.as_deref()?;
    [
        UpdateType::Preview,
        UpdateType::Up,
        UpdateType::Destroy,
        UpdateType::Refresh,
    ]
    .into_iter()
    .find(|t| t.as_str() == recorded)
}

pub(super) fn cooldown(stack: &Stack, failures: i64) -> Duration {
    let cap = stack
        .spec
        .retry_max_backoff_duration_seconds
        .filter(|s| *s > 0)
        .unwrap_or(DEFAULT_MAX_BACKOFF);
    let secs = 10i64
        .saturating_mul(3i64.saturating_pow(failures.clamp(0, 20) as u32))
        .min(cap);
    Duration::from_secs(secs.max(0) as u64)
}

pub(super) fn resync_frequency(stack: &Stack) -> Duration {
    Duration::from_secs(stack.spec.resync_frequency_seconds.unwrap_or(60).max(60) as u64)
}

pub(super) fn since(t: Option<&Time>) -> Duration {
    t.map(|t| Duration::try_from(Timestamp::now().duration_since(t.0)).unwrap_or(Duration::ZERO))
        .unwrap_or(Duration::MAX)
}

/// The stack's reconcile request (the annotation's value).
pub(super) fn request(stack: &Stack) -> Option<String> {
    stack
        .annotations()
        .get(RECONCILE_REQUEST_ANNOTATION)
        .cloned()
}

/// A stack PKO deployed records `revision` (PKO's commit for this content) where we record
/// `commit`: the last update's commits that are that revision, rewritten as `commit`, so the
/// same content is not run again after a switch-over and a later change of `commit` (a
/// transform) is seen. `None` when nothing is PKO's.
pub(super) fn handed_over(
    last: &StackUpdateState,
    commit: &str,
    revision: Option<&str>,
) -> Option<StackUpdateState> {
    let revision = revision.filter(|r| *r != commit)?;
    let is_revision = |c: &Option<String>| c.as_deref() == Some(revision);
    if !is_revision(&last.last_successful_commit) && !is_revision(&last.last_attempted_commit) {
        return None;
    }
    let mut adopted = last.clone();
    for c in [
        &mut adopted.last_successful_commit,
        &mut adopted.last_attempted_commit,
    ] {
        if is_revision(c) {
            *c = Some(commit.to_owned());
        }
    }
    Some(adopted)
}

/// PKO's `isSynced`: whether the last update covers the current spec, request and source.
/// `Err(reason)` says why a new Update is needed.
pub(super) fn is_synced(
    stack: &Stack,
    status: &StackStatus,
    commit: &str,
    request: Option<&str>,
    deleting: bool,
) -> Result<(), String> {
    let Some(last) = &status.last_update else {
        return Err("Initial stack update".into());
    };
    let state = UpdateState::of(last);
    if deleting {
        let destroy = update_type(last) == Some(UpdateType::Destroy);
        return match state {
            Some(UpdateState::Succeeded) if destroy => Ok(()),
            _ if destroy
                && since(last.last_resync_time.as_ref())
                    < cooldown(stack, last.failures.unwrap_or(0)) =>
            {
                Ok(())
            }
            _ => Err("Stack marked for deletion".into()),
        };
    }
    if last.generation != stack.metadata.generation {
        return Err(format!(
            "New stack generation: {}",
            stack.metadata.generation.unwrap_or(0)
        ));
    }
    // PKO records no request as "".
    let recorded = last.reconcile_request.as_deref().filter(|r| !r.is_empty());
    if recorded != request.filter(|r| !r.is_empty()) {
        return Err(format!("Sync request: {:?}", request.unwrap_or_default()));
    }
    // PKO leaves an empty commit (a source-less stack) out of the status.
    let commit_of = |c: &Option<String>| c.clone().unwrap_or_default();
    if state == Some(UpdateState::Succeeded) {
        if commit_of(&last.last_successful_commit) != commit {
            return Err(format!("New commit detected: {commit:?}"));
        }
        if stack.spec.continue_resync_on_commit_match == Some(true)
            && since(last.last_resync_time.as_ref()) >= resync_frequency(stack)
        {
            return Err("Resync time elapsed".into());
        }
        return Ok(());
    }
    if commit_of(&last.last_attempted_commit) != commit {
        return Err(format!("New commit detected: {commit:?}"));
    }
    let failures = last.failures.unwrap_or(0);
    if failures >= MAX_FAILURES {
        return Ok(());
    }
    if since(last.last_resync_time.as_ref()) >= cooldown(stack, failures) {
        return Err(format!("Backoff time elapsed: {failures} failure(s)"));
    }
    Ok(())
}

/// The operation a new Update of the stack performs.
pub(super) fn operation(stack: &Stack, deleting: bool) -> UpdateType {
    if deleting {
        UpdateType::Destroy
    } else if stack.spec.preview == Some(true) {
        UpdateType::Preview
    } else {
        UpdateType::Up
    }
}

/// A finished Update, as `lastUpdate` records it, with PKO's count: a failure in the same run
/// (generation and reconcile request) as the last update counts one more than it did, a
/// success included (so a success then a failure counts 1); the first failure of a run counts
/// 0, and a success resets the count.
pub(super) fn finished(
    current: &CurrentStackUpdate,
    previous: Option<&StackUpdateState>,
    type_: Option<UpdateType>,
    update: &UpdateStatus,
) -> StackUpdateState {
    let succeeded = !conditions::is_true(&update.conditions, "Failed");
    let message = conditions::get(&update.conditions, "Failed")
        .map(|c| c.message.clone())
        .filter(|m| !m.is_empty())
        .or(update.message.clone());
    let last = previous.cloned().unwrap_or_default();
    let same_run = last.generation == current.generation
        && last.reconcile_request == current.reconcile_request;
    let failures = if succeeded {
        0
    } else if previous.is_some() && same_run {
        last.failures.unwrap_or(0) + 1
    } else {
        0
    };
    let state = if succeeded {
        UpdateState::Succeeded
    } else {
        UpdateState::Failed
    };
    StackUpdateState {
        generation: current.generation,
        reconcile_request: current.reconcile_request.clone(),
        name: Some(current.name.clone().unwrap_or_default()),
        type_: type_.map(|t| t.as_str().to_owned()),
        state: Some(state.as_str().into()),
        message,
        last_attempted_commit: current.commit.clone(),
        last_successful_commit: if succeeded {
            current.commit.clone()
        } else {
            last.last_successful_commit.clone()
        },
        permalink: update.permalink.clone(),
        last_resync_time: Some(Time(Timestamp::now())),
        failures: Some(failures),
    }
}

/// What an up-to-date stack reports: ready, stalled after [`MAX_FAILURES`], or waiting for the
/// cooldown before the next attempt. A polled source (`poll`) is looked at again on its own
/// schedule unless the stack is being deleted.
pub(super) fn settled(
    stack: &Stack,
    last: &StackUpdateState,
    poll: Option<Duration>,
    deleting: bool,
) -> Outcome {
    let failures = last.failures.unwrap_or(0);
    let outcome = if UpdateState::of(last) == Some(UpdateState::Succeeded) {
        let requeue = (stack.spec.continue_resync_on_commit_match == Some(true))
            .then(|| resync_frequency(stack));
        Outcome::Ready { requeue }
    } else if failures >= MAX_FAILURES {
        // PKO's words and count (the count of the last update, see [`finished`]).
        let message = format!(
            "{} failed {failures} times; not retrying until the spec or source changes",
            last.type_.clone().unwrap_or_default(),
        );
        Outcome::stalled("UpdateFailed", message)
    } else {
        let (reason, message) = if update_type(last) == Some(UpdateType::Preview) {
            (
                "PreviewFailed",
                format!("preview failed ({failures} attempt(s))"),
            )
        } else {
            (
                "RetryingAfterFailure",
                format!("{failures} update failure(s)"),
            )
        };
        let wait = cooldown(stack, failures).saturating_sub(since(last.last_resync_time.as_ref()));
        Outcome::reconciling(reason, message).after(wait.max(Duration::from_secs(1)))
    };
    match poll {
        Some(poll) if !deleting => outcome.after(poll),
        _ => outcome,
    }
}

/// A stack being deleted that never ran an update: nothing of it can have been deployed by
/// this Stack (PKO lets such a stack go when its workspace cannot run).
pub(super) fn never_ran(status: &StackStatus, deleting: bool) -> bool {
    deleting && status.last_update.is_none() && status.current_update.is_none()
}

/// Whether the last update destroyed the stack.
pub(super) fn destroyed(last: &StackUpdateState) -> bool {
    update_type(last) == Some(UpdateType::Destroy)
        && UpdateState::of(last) == Some(UpdateState::Succeeded)
}

/// Where a prerequisite stands (PKO's rules).
#[derive(Debug, PartialEq)]
pub(super) enum Prerequisite {
    Met,
    /// Not met, for this reason.
    Unmet(String),
    /// Succeeded longer ago than allowed: it is asked to run again by setting its reconcile
    /// request to `touch` (`None`: already asked).
    Stale {
        touch: Option<String>,
        message: String,
    },
}

/// A prerequisite stack (`None`: not found) against its requirement: it exists and its last
/// update, for its current generation and reconcile request, succeeded (within
/// `succeededWithinDuration` if given).
pub(super) fn prerequisite(prerequisite: &PrerequisiteRef, other: Option<&Stack>) -> Prerequisite {
    let name = &prerequisite.name;
    let Some(other) = other else {
        return Prerequisite::Unmet(format!("prerequisite {name} not found"));
    };
    let status = other.status.clone().unwrap_or_default();
    let Some(last) = status.last_update else {
        return Prerequisite::Unmet(format!("prerequisite {name} has not run yet"));
    };
    let request = request(other);
    if last.generation != other.metadata.generation || last.reconcile_request != request {
        return Prerequisite::Unmet(format!("prerequisite {name} is being updated"));
    }
    if UpdateState::of(&last) != Some(UpdateState::Succeeded) {
        return Prerequisite::Unmet(format!("prerequisite {name} failed"));
    }
    let within = match prerequisite
        .requirement
        .as_ref()
        .and_then(|r| r.succeeded_within_duration.as_deref())
    {
        Some(text) => match pko_api::duration::parse_go_duration(text) {
            Ok(within) => Some(within),
            Err(e) => {
                return Prerequisite::Unmet(format!(
                    "prerequisite {name}: invalid succeededWithinDuration: {e}"
                ));
            }
        },
        None => None,
    };
    match within {
        Some(within) if since(last.last_resync_time.as_ref()) > within => {
            let touch = format!("after-{}", last.name.clone().unwrap_or_default());
            Prerequisite::Stale {
                touch: (request.as_deref() != Some(touch.as_str())).then_some(touch),
                message: format!(
                    "prerequisite {name} last succeeded more than {within:?} ago; it was asked to run again"
                ),
            }
        }
        _ => Prerequisite::Met,
    }
}

#[cfg(test)]
mod tests {
    use k8s_openapi::jiff::SignedDuration;
    use pko_api::common::Condition;
    use pko_api::stack::RequirementSpec;
    use serde_json::json;

    use super::*;

    fn stack(generation: i64) -> Stack {
        let mut s: Stack = serde_json::from_value(json!({
            "apiVersion": "pulumi.com/v1", "kind": "Stack",
            "metadata": {"name": "s", "namespace": "ns"},
            "spec": {"stack": "dev", "programRef": {"name": "p"}},
        }))
        .expect("stack");
        s.metadata.generation = Some(generation);
        s
    }

    #[test]
    fn the_revision_pko_deployed_is_recorded_as_our_commit_once() {
        let pkos = last("succeeded", "3", 0, 10).last_update.expect("last");
        // PKO recorded generation 3; our artifact of generation 3 is sha256:d.
        let adopted = handed_over(&pkos, "sha256:d", Some("3")).expect("PKO's revision");
        assert_eq!(adopted.last_successful_commit.as_deref(), Some("sha256:d"));
        assert_eq!(adopted.last_attempted_commit.as_deref(), Some("sha256:d"));
        assert_eq!(adopted.state, pkos.state);
        // Then it is ours: nothing more to adopt, and a new digest is a new commit.
        assert_eq!(handed_over(&adopted, "sha256:d", Some("3")), None);
        assert_eq!(handed_over(&adopted, "sha256:e", Some("3")), None);
        // Another revision than PKO's is a change, as is a transformed artifact (no revision).
        assert_eq!(handed_over(&pkos, "sha256:d", Some("4")), None);
        assert_eq!(handed_over(&pkos, "sha256:d", None), None);
        // A failed update at that revision: its attempt is adopted, its last success is not.
        let failed = last("failed", "3", 2, 10).last_update.expect("last");
        let adopted = handed_over(&failed, "sha256:d", Some("3")).expect("attempt");
        assert_eq!(adopted.last_attempted_commit.as_deref(), Some("sha256:d"));
        assert_eq!(adopted.last_successful_commit, None);
        assert_eq!(adopted.failures, Some(2));
    }

    fn ago(secs: i64) -> Time {
        Time(Timestamp::now() - SignedDuration::from_secs(secs))
    }

    fn last(state: &str, commit: &str, failures: i64, ago_secs: i64) -> StackStatus {
        StackStatus {
            last_update: Some(StackUpdateState {
                generation: Some(1),
                type_: Some("up".into()),
                state: Some(state.into()),
                last_attempted_commit: Some(commit.into()),
                last_successful_commit: (state == "succeeded").then(|| commit.into()),
                last_resync_time: Some(ago(ago_secs)),
                failures: Some(failures),
                ..Default::default()
            }),
            ..Default::default()
        }
    }

    // PKO's TestIsSynced cases that apply.
    #[test]
    fn sync_rules() {
        let s = stack(1);
        assert!(
            is_synced(&s, &StackStatus::default(), "d1", None, false)
                .is_err_and(|r| r == "Initial stack update")
        );
        assert!(is_synced(&s, &last("succeeded", "d1", 0, 5), "d1", None, false).is_ok());
        assert!(
            is_synced(&s, &last("succeeded", "d1", 0, 5), "d2", None, false)
                .is_err_and(|r| r.starts_with("New commit"))
        );
        assert!(
            is_synced(&stack(2), &last("succeeded", "d1", 0, 5), "d1", None, false)
                .is_err_and(|r| r.starts_with("New stack generation"))
        );
        assert!(
            is_synced(&s, &last("succeeded", "d1", 0, 5), "d1", Some("now"), false)
                .is_err_and(|r| r.starts_with("Sync request"))
        );
        // Failed: wait for the cooldown (10 s × 3^failures), stop after 3 failures.
        assert!(is_synced(&s, &last("failed", "d1", 0, 5), "d1", None, false).is_ok());
        assert!(
            is_synced(&s, &last("failed", "d1", 0, 11), "d1", None, false)
                .is_err_and(|r| r.starts_with("Backoff"))
        );
        assert!(is_synced(&s, &last("failed", "d1", 3, 100_000), "d1", None, false).is_ok());
        assert!(is_synced(&s, &last("failed", "d1", 3, 5), "d2", None, false).is_err());
        // Deleting: a destroy is needed unless one succeeded.
        assert!(
            is_synced(&s, &last("succeeded", "d1", 0, 5), "d1", None, true)
                .is_err_and(|r| r == "Stack marked for deletion")
        );
    }

    #[test]
    fn deleting_waits_for_a_destroy_or_its_cooldown() {
        let s = stack(1);
        let mut status = last("succeeded", "d1", 0, 5);
        if let Some(l) = status.last_update.as_mut() {
            l.type_ = Some("destroy".into());
        }
        assert!(is_synced(&s, &status, "d1", None, true).is_ok());
        let mut failed = last("failed", "d1", 0, 5);
        if let Some(l) = failed.last_update.as_mut() {
            l.type_ = Some("destroy".into());
        }
        assert!(is_synced(&s, &failed, "d1", None, true).is_ok());
        let mut failed = last("failed", "d1", 0, 11);
        if let Some(l) = failed.last_update.as_mut() {
            l.type_ = Some("destroy".into());
        }
        assert!(is_synced(&s, &failed, "d1", None, true).is_err());
    }

    #[test]
    fn cooldown_grows_and_is_capped() {
        let mut s = stack(1);
        assert_eq!(cooldown(&s, 0), Duration::from_secs(10));
        assert_eq!(cooldown(&s, 2), Duration::from_secs(90));
        s.spec.retry_max_backoff_duration_seconds = Some(30);
        assert_eq!(cooldown(&s, 5), Duration::from_secs(30));
    }

    #[test]
    fn names_match_the_wire() {
        for t in [
            UpdateType::Preview,
            UpdateType::Up,
            UpdateType::Destroy,
            UpdateType::Refresh,
        ] {
            assert_eq!(serde_json::to_value(t).expect("type"), json!(t.as_str()));
            let last = StackUpdateState {
                type_: Some(t.to_string()),
                ..Default::default()
            };
            assert_eq!(update_type(&last), Some(t));
        }
        let last = StackUpdateState {
            state: Some("failed".into()),
            ..Default::default()
        };
        assert_eq!(UpdateState::of(&last), Some(UpdateState::Failed));
        assert_eq!(UpdateState::Succeeded.as_str(), "succeeded");
    }

    #[test]
    fn the_operation_follows_deletion_and_preview() {
        let mut s = stack(1);
        assert_eq!(operation(&s, false), UpdateType::Up);
        assert_eq!(operation(&s, true), UpdateType::Destroy);
        s.spec.preview = Some(true);
        assert_eq!(operation(&s, false), UpdateType::Preview);
        assert_eq!(operation(&s, true), UpdateType::Destroy);
    }

    fn condition(type_: &str, message: &str) -> Condition {
        Condition {
            type_: type_.into(),
            status: "True".into(),
            reason: "R".into(),
            message: message.into(),
            observed_generation: None,
            last_transition_time: ago(0),
        }
    }

    #[test]
    fn failures_of_one_run_are_counted_and_a_success_resets_them() {
        let current = CurrentStackUpdate {
            generation: Some(1),
            reconcile_request: None,
            name: Some("s-1".into()),
            commit: Some("d2".into()),
        };
        let failed = UpdateStatus {
            conditions: vec![condition("Complete", ""), condition("Failed", "boom")],
            ..Default::default()
        };
        let previous = last("failed", "d1", 1, 5).last_update;
        let record = finished(&current, previous.as_ref(), Some(UpdateType::Up), &failed);
        assert_eq!(record.state.as_deref(), Some("failed"));
        assert_eq!(record.failures, Some(2));
        assert_eq!(record.message.as_deref(), Some("boom"));
        assert_eq!(record.last_attempted_commit.as_deref(), Some("d2"));
        assert_eq!(record.last_successful_commit, None);
        assert_eq!(record.type_.as_deref(), Some("up"));
        // Another generation starts counting again.
        let other = CurrentStackUpdate {
            generation: Some(2),
            ..current.clone()
        };
        let record = finished(&other, previous.as_ref(), Some(UpdateType::Up), &failed);
        assert_eq!(record.failures, Some(0));
        let succeeded = UpdateStatus {
            conditions: vec![condition("Complete", "")],
            message: Some("done".into()),
            permalink: Some("https://p".into()),
            ..Default::default()
        };
        let record = finished(
            &current,
            previous.as_ref(),
            Some(UpdateType::Up),
            &succeeded,
        );
        assert_eq!(record.state.as_deref(), Some("succeeded"));
        assert_eq!(record.failures, Some(0));
        assert_eq!(record.message.as_deref(), Some("done"));
        assert_eq!(record.last_successful_commit.as_deref(), Some("d2"));
        assert_eq!(record.permalink.as_deref(), Some("https://p"));
        // PKO's count: a failure after a success of the same run counts 1, the first failure
        // of a stack 0.
        let success = last("succeeded", "d1", 0, 5).last_update;
        let record = finished(&current, success.as_ref(), Some(UpdateType::Up), &failed);
        assert_eq!(record.failures, Some(1));
        assert_eq!(record.last_successful_commit.as_deref(), Some("d1"));
        let record = finished(&current, None, Some(UpdateType::Up), &failed);
        assert_eq!(record.failures, Some(0));
    }

    #[test]
    fn an_empty_commit_is_one_pko_left_out() {
        let s = stack(1);
        let mut status = last("succeeded", "", 0, 5);
        assert!(is_synced(&s, &status, "", None, false).is_ok());
        if let Some(l) = status.last_update.as_mut() {
            l.last_successful_commit = None;
            l.last_attempted_commit = None;
        }
        assert!(is_synced(&s, &status, "", None, false).is_ok());
        assert!(is_synced(&s, &status, "d1", None, false).is_err());
    }

    #[test]
    fn only_a_deleted_stack_that_never_ran_is_let_go() {
        assert!(never_ran(&StackStatus::default(), true));
        assert!(!never_ran(&StackStatus::default(), false));
        assert!(!never_ran(&last("failed", "d1", 0, 5), true));
        let running = StackStatus {
            current_update: Some(CurrentStackUpdate::default()),
            ..Default::default()
        };
        assert!(!never_ran(&running, true));
    }

    #[test]
    fn settled_stacks_are_ready_stalled_or_cooling_down() {
        let mut s = stack(1);
        let ok = last("succeeded", "d1", 0, 5)
            .last_update
            .unwrap_or_default();
        assert_eq!(
            settled(&s, &ok, None, false),
            Outcome::Ready { requeue: None }
        );
        assert_eq!(
            settled(&s, &ok, Some(Duration::from_secs(60)), false),
            Outcome::Ready {
                requeue: Some(Duration::from_secs(60))
            }
        );
        assert_eq!(
            settled(&s, &ok, Some(Duration::from_secs(60)), true),
            Outcome::Ready { requeue: None }
        );
        s.spec.continue_resync_on_commit_match = Some(true);
        s.spec.resync_frequency_seconds = Some(120);
        assert_eq!(
            settled(&s, &ok, None, false),
            Outcome::Ready {
                requeue: Some(Duration::from_secs(120))
            }
        );
        let stalled = last("failed", "d1", 3, 5).last_update.unwrap_or_default();
        assert_eq!(
            settled(&s, &stalled, None, false),
            Outcome::stalled(
                "UpdateFailed",
                "up failed 3 times; not retrying until the spec or source changes"
            )
        );
        let failed = last("failed", "d1", 1, 5).last_update.unwrap_or_default();
        let Outcome::Reconciling {
            reason,
            message,
            requeue: Some(wait),
        } = settled(&s, &failed, None, false)
        else {
            panic!("cooling down");
        };
        assert_eq!(
            (reason, message.as_str()),
            ("RetryingAfterFailure", "1 update failure(s)")
        );
        assert!(
            wait > Duration::from_secs(20) && wait <= Duration::from_secs(25),
            "{wait:?}"
        );
        let mut preview = failed.clone();
        preview.type_ = Some("preview".into());
        preview.last_resync_time = Some(ago(1000));
        assert_eq!(
            settled(&s, &preview, None, false),
            Outcome::reconciling("PreviewFailed", "preview failed (1 attempt(s))")
                .after(Duration::from_secs(1))
        );
    }

    fn prerequisite_stack(state: &str, resynced_ago: i64, request: Option<&str>) -> Stack {
        let mut s = stack(1);
        s.metadata.name = Some("pre".into());
        if let Some(r) = request {
            s.metadata.annotations = Some(
                [(RECONCILE_REQUEST_ANNOTATION.to_owned(), r.to_owned())]
                    .into_iter()
                    .collect(),
            );
        }
        let mut status = last(state, "d1", 0, resynced_ago);
        if let Some(l) = status.last_update.as_mut() {
            l.name = Some("pre-1".into());
            l.reconcile_request = request.map(str::to_owned);
        }
        s.status = Some(status);
        s
    }

    #[test]
    fn prerequisite_rules() {
        let mut p = PrerequisiteRef {
            name: "pre".into(),
            requirement: None,
        };
        assert_eq!(
            prerequisite(&p, None),
            Prerequisite::Unmet("prerequisite pre not found".into())
        );
        let mut never = stack(1);
        never.status = None;
        assert_eq!(
            prerequisite(&p, Some(&never)),
            Prerequisite::Unmet("prerequisite pre has not run yet".into())
        );
        let ok = prerequisite_stack("succeeded", 100, None);
        assert_eq!(prerequisite(&p, Some(&ok)), Prerequisite::Met);
        let mut newer = ok.clone();
        newer.metadata.generation = Some(2);
        assert_eq!(
            prerequisite(&p, Some(&newer)),
            Prerequisite::Unmet("prerequisite pre is being updated".into())
        );
        assert_eq!(
            prerequisite(&p, Some(&prerequisite_stack("failed", 100, None))),
            Prerequisite::Unmet("prerequisite pre failed".into())
        );
        p.requirement = Some(RequirementSpec {
            succeeded_within_duration: Some("1m".into()),
        });
        let Prerequisite::Stale { touch, message } = prerequisite(&p, Some(&ok)) else {
            panic!("stale");
        };
        assert_eq!(touch.as_deref(), Some("after-pre-1"));
        assert!(message.contains("asked to run again"), "{message}");
        // Already asked: not asked twice.
        let asked = prerequisite_stack("succeeded", 100, Some("after-pre-1"));
        assert!(matches!(
            prerequisite(&p, Some(&asked)),
            Prerequisite::Stale { touch: None, .. }
        ));
        p.requirement = Some(RequirementSpec {
            succeeded_within_duration: Some("soon".into()),
        });
        assert!(matches!(
            prerequisite(&p, Some(&ok)),
            Prerequisite::Unmet(m) if m.contains("invalid succeededWithinDuration")
        ));
    }
}
