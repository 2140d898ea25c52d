//! Drift detection's decisions, as pure functions: the Stack's schedules parsed (a bad one named),
//! whether a check is due and when the next is, and what a finished check reports.
//!
//! A check is due when the latest tick of any schedule is after the last check (or, before the
//! first, the Stack's creation): ticks missed while the operator was down make one check, not
//! one per tick. A check is an Update of type `refresh` with `previewOnly`, so it changes no
//! state; it starts only when the stack is up to date and no Update of it runs, and an update
//! that becomes due meanwhile waits for it to end.

use std::time::Duration;

use k8s_openapi::jiff::Timestamp;
use pko_api::stack::{DriftDetectionStatus, Stack, StackStatus};
use pko_api::update::UpdateStatus;

use crate::controller::conditions;
use crate::cron::Schedule;

pub(super) use crate::controller::keys::{
    DRIFT_CHANGES as CHANGES, DRIFT_CHECK_FAILED as CHECK_FAILED, DRIFT_DETECTED as CONDITION,
    DRIFT_NO_CHANGES as NO_CHANGES,
};
/// URNs a condition message names at most.
const MESSAGE_URNS: usize = 5;
/// A requeue at a tick comes this much after it, so the reconcile sees the tick as past.
const TICK_MARGIN: Duration = Duration::from_secs(1);

/// One schedule of `spec.driftDetection`, parsed.
#[derive(Debug, Clone)]
pub(super) struct Parsed {
    pub cron: String,
    pub auto_remediate: bool,
    schedule: Schedule,
}

/// The Stack's schedules (none without `spec.driftDetection`); `Err` names the first bad one.
pub(super) fn schedules(stack: &Stack) -> Result<Vec<Parsed>, String> {
    let Some(spec) = &stack.spec.drift_detection else {
        return Ok(Vec::new());
    };
    spec.schedules
        .iter()
        .enumerate()
        .map(|(i, s)| {
            Schedule::parse(&s.cron)
                .map(|schedule| Parsed {
                    cron: s.cron.clone(),
                    auto_remediate: s.auto_remediate == Some(true),
                    schedule,
                })
                .map_err(|e| format!("spec.driftDetection.schedules[{i}].cron {:?}: {e}", s.cron))
        })
        .collect()
}

/// Since when ticks count: the last check, else the Stack's creation (a new Stack is not
/// checked for the ticks before it existed), else the beginning of time.
pub(super) fn since(stack: &Stack, status: Option<&DriftDetectionStatus>) -> Timestamp {
    status
        .and_then(|d| d.last_check_time.as_ref())
        .or(stack.metadata.creation_timestamp.as_ref())
        .map_or(Timestamp::MIN, |t| t.0)
}

/// The schedule a check is due for: of those whose latest tick at or before `now` is after
/// `since`, the one with the latest tick (one that remediates when two tick together).
pub(super) fn due(schedules: &[Parsed], since: Timestamp, now: Timestamp) -> Option<&Parsed> {
    schedules
        .iter()
        .filter_map(|p| {
            let tick = p.schedule.latest_at_or_before(now)?;
            (tick > since).then_some((tick, p.auto_remediate, p))
        })
        .max_by_key(|(tick, remediate, _)| (*tick, *remediate))
        .map(|(_, _, p)| p)
}

/// How long until the first tick of any schedule after `now` (and a margin); `None` when none
/// ever ticks again.
pub(super) fn next_tick(schedules: &[Parsed], now: Timestamp) -> Option<Duration> {
    let next = schedules
        .iter()
        .filter_map(|p| p.schedule.next_after(now))
        .min()?;
    let wait = Duration::try_from(next.duration_since(now)).unwrap_or(Duration::ZERO);
    Some(wait + TICK_MARGIN)
}

/// What a finished check found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum Finding {
    NoChanges,
    Changes {
        count: i64,
        resources: Vec<String>,
    },
    /// The check did not run to the end; why.
    Failed(String),
}

impl Finding {
    /// A finished check Update's status.
    pub(super) fn of(update: &UpdateStatus) -> Self {
        if conditions::is_true(&update.conditions, "Failed") {
            let message = conditions::get(&update.conditions, "Failed")
                .map(|c| format!("{}: {}", c.reason, c.message))
                .unwrap_or_default();
            return Self::Failed(message);
        }
        match &update.changes {
            Some(c) if c.count > 0 => Self::Changes {
                count: c.count,
                resources: c.resources.clone(),
            },
            Some(_) => Self::NoChanges,
            None => Self::Failed(
                "the check reported no result (an agent without preview-only refresh?)".into(),
            ),
        }
    }

    /// The `DriftDetected` condition: its status (`None`: Unknown), reason and message.
    pub(super) fn condition(&self) -> (Option<bool>, &'static str, String) {
        match self {
            Self::NoChanges => (
                Some(false),
                NO_CHANGES,
                "no resource changed outside Pulumi".into(),
            ),
            Self::Changes { count, resources } => {
                (Some(true), CHANGES, changes_message(*count, resources))
            }
            Self::Failed(why) => (None, CHECK_FAILED, format!("the drift check failed: {why}")),
        }
    }
}

/// "2 resource(s) changed outside Pulumi: urn:a, urn:b", naming at most [`MESSAGE_URNS`].
fn changes_message(count: i64, resources: &[String]) -> String {
    let named: Vec<&str> = resources
        .iter()
        .take(MESSAGE_URNS)
        .map(String::as_str)
        .collect();
    let unnamed = count - i64::try_from(named.len()).unwrap_or(i64::MAX);
    let mut message = format!(
        "{count} resource(s) changed outside Pulumi: {}",
        named.join(", ")
    );
    if unnamed > 0 {
        message.push_str(&format!(" and {unnamed} more"));
    }
    message
}

/// Why an update runs to remediate drift, if it must: the last check found drift, the
/// schedule that started it remediates, and no update finished since it started. Read from
/// the status alone, so a remediation that could not start at once (a prerequisite unmet) is
/// not lost, and one that ran (even failed: its retries are the update's own) is not repeated.
pub(super) fn remediation(status: &StackStatus, schedules: &[Parsed]) -> Option<String> {
    let d = status.drift_detection.as_ref()?;
    if d.current_check.is_some() || !remediates(schedules, d.schedule.as_deref()) {
        return None;
    }
    let found = conditions::get(&status.conditions, CONDITION)
        .filter(|c| c.status == "True" && c.reason == CHANGES)?;
    let checked = d.last_check_time.as_ref()?.0;
    let updated_since = status
        .last_update
        .as_ref()
        .and_then(|l| l.last_resync_time.as_ref())
        .is_some_and(|t| t.0 > checked);
    (!updated_since).then(|| {
        format!(
            "Drift detected by schedule {:?}, remediating: {}",
            d.schedule.clone().unwrap_or_default(),
            found.message
        )
    })
}

/// The schedule named `cron` remediates drift.
fn remediates(schedules: &[Parsed], cron: Option<&str>) -> bool {
    cron.is_some_and(|cron| schedules.iter().any(|p| p.cron == cron && p.auto_remediate))
}

#[cfg(test)]
mod tests {
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
    use pko_api::common::Condition;
    use pko_api::update::ResourceChanges;
    use serde_json::json;

    use super::*;

    fn at(text: &str) -> Timestamp {
        text.parse().expect("timestamp")
    }

    fn stack(schedules: serde_json::Value) -> Stack {
        serde_json::from_value(json!({
            "apiVersion": "pulumi.com/v1", "kind": "Stack",
            "metadata": {"name": "s", "namespace": "ns", "creationTimestamp": "2026-01-01T00:00:30Z"},
            "spec": {"stack": "dev", "driftDetection": {"schedules": schedules}},
        }))
        .expect("stack")
    }

    fn parsed(schedules: serde_json::Value) -> Vec<Parsed> {
        super::schedules(&stack(schedules)).expect("valid")
    }

    #[test]
    fn a_bad_schedule_is_named() {
        let err = super::schedules(&stack(json!([
            {"cron": "* * * * *"},
            {"cron": "CRON_TZ=Nowhere/Land 0 9 * * *"},
        ])))
        .expect_err("bad zone");
        assert!(
            err.starts_with("spec.driftDetection.schedules[1].cron \"CRON_TZ=Nowhere/Land 0 9 * * *\": unknown time zone"),
            "{err}"
        );
        let mut none = stack(json!([]));
        none.spec.drift_detection = None;
        assert!(super::schedules(&none).expect("none").is_empty());
    }

    #[test]
    fn missed_ticks_make_one_check() {
        let hourly = parsed(json!([{"cron": "0 * * * *"}]));
        // Checked at 10:00; the operator was down until 13:20: the ticks at 11, 12 and 13 are
        // one check, due now.
        let last = at("2026-01-01T10:00:05Z");
        let now = at("2026-01-01T13:20:00Z");
        assert!(due(&hourly, last, now).is_some());
        // That check is recorded at `now`: nothing more is due until the next tick.
        assert!(due(&hourly, now, at("2026-01-01T13:59:59Z")).is_none());
        assert!(due(&hourly, now, at("2026-01-01T14:00:00Z")).is_some());
        assert_eq!(
            next_tick(&hourly, now),
            Some(Duration::from_secs(40 * 60 + 1))
        );
    }

    #[test]
    fn a_new_stack_waits_for_the_first_tick_after_its_creation() {
        let s = stack(json!([{"cron": "0 0 * * *"}]));
        let daily = super::schedules(&s).expect("valid");
        let since = super::since(&s, None);
        assert_eq!(since, at("2026-01-01T00:00:30Z"));
        assert!(due(&daily, since, at("2026-01-01T12:00:00Z")).is_none());
        assert!(due(&daily, since, at("2026-01-02T00:00:00Z")).is_some());
        let checked = DriftDetectionStatus {
            last_check_time: Some(Time(at("2026-01-02T00:00:02Z"))),
            ..Default::default()
        };
        assert_eq!(super::since(&s, Some(&checked)), at("2026-01-02T00:00:02Z"));
    }

    #[test]
    fn the_latest_tick_decides_and_a_remediating_schedule_wins_a_tie() {
        let both = parsed(json!([
            {"cron": "*/30 * * * *"},
            {"cron": "0 * * * *", "autoRemediate": true},
        ]));
        let since = at("2026-01-01T09:00:00Z");
        let due_at = |now: &str| due(&both, since, at(now)).map(|p| p.cron.clone());
        assert_eq!(
            due_at("2026-01-01T09:45:00Z").as_deref(),
            Some("*/30 * * * *")
        );
        assert_eq!(due_at("2026-01-01T10:05:00Z").as_deref(), Some("0 * * * *"));
        assert_eq!(
            next_tick(&both, at("2026-01-01T10:05:00Z")),
            Some(Duration::from_secs(25 * 60 + 1))
        );
        assert_eq!(next_tick(&[], at("2026-01-01T10:05:00Z")), None);
    }

    #[test]
    fn drift_found_by_a_remediating_schedule_asks_for_one_update() {
        let schedules = parsed(json!([
            {"cron": "0 * * * *", "autoRemediate": true},
            {"cron": "30 * * * *"},
        ]));
        let condition = |status: &str, reason: &str| Condition {
            type_: CONDITION.into(),
            status: status.into(),
            reason: reason.into(),
            message: "1 resource(s) changed outside Pulumi: urn:a".into(),
            observed_generation: None,
            last_transition_time: Time(at("2026-01-01T10:00:30Z")),
        };
        let status = |schedule: &str, drifted: bool, updated: &str| StackStatus {
            conditions: vec![if drifted {
                condition("True", CHANGES)
            } else {
                condition("False", NO_CHANGES)
            }],
            drift_detection: Some(DriftDetectionStatus {
                last_check_time: Some(Time(at("2026-01-01T10:00:01Z"))),
                schedule: Some(schedule.into()),
                ..Default::default()
            }),
            last_update: Some(pko_api::stack::StackUpdateState {
                last_resync_time: Some(Time(at(updated))),
                ..Default::default()
            }),
            ..Default::default()
        };
        let why = remediation(
            &status("0 * * * *", true, "2026-01-01T09:00:00Z"),
            &schedules,
        )
        .expect("remediate");
        assert_eq!(
            why,
            "Drift detected by schedule \"0 * * * *\", remediating: 1 resource(s) changed outside Pulumi: urn:a"
        );
        // An update finished since the check started: done (or failed, and retried as any).
        assert_eq!(
            remediation(
                &status("0 * * * *", true, "2026-01-01T10:02:00Z"),
                &schedules
            ),
            None
        );
        // No drift, or found by a schedule that only reports.
        assert_eq!(
            remediation(
                &status("0 * * * *", false, "2026-01-01T09:00:00Z"),
                &schedules
            ),
            None
        );
        assert_eq!(
            remediation(
                &status("30 * * * *", true, "2026-01-01T09:00:00Z"),
                &schedules
            ),
            None
        );
        // The schedule was since removed from the spec.
        assert_eq!(
            remediation(&status("0 * * * *", true, "2026-01-01T09:00:00Z"), &[]),
            None
        );
    }

    fn finished(failed: Option<&str>, changes: Option<(i64, &[&str])>) -> UpdateStatus {
        let condition = |t: &str, status: &str, reason: &str, message: &str| Condition {
            type_: t.into(),
            status: status.into(),
            reason: reason.into(),
            message: message.into(),
            observed_generation: None,
            last_transition_time: Time(Timestamp::now()),
        };
        let mut conditions = vec![condition("Complete", "True", "Updated", "")];
        if let Some(message) = failed {
            conditions.push(condition("Failed", "True", "UpdateFailed", message));
        }
        UpdateStatus {
            conditions,
            changes: changes.map(|(count, urns)| ResourceChanges {
                count,
                resources: urns.iter().map(|u| (*u).to_owned()).collect(),
            }),
            ..Default::default()
        }
    }

    #[test]
    fn a_finished_check_reports_changes_none_or_its_failure() {
        assert_eq!(
            Finding::of(&finished(None, Some((0, &[])))).condition(),
            (
                Some(false),
                NO_CHANGES,
                "no resource changed outside Pulumi".into()
            )
        );
        let urns: Vec<String> = (0..20).map(|i| format!("urn:{i}")).collect();
        let refs: Vec<&str> = urns.iter().map(String::as_str).collect();
        let (status, reason, message) = Finding::of(&finished(None, Some((23, &refs)))).condition();
        assert_eq!((status, reason), (Some(true), CHANGES));
        assert_eq!(
            message,
            "23 resource(s) changed outside Pulumi: urn:0, urn:1, urn:2, urn:3, urn:4 and 18 more"
        );
        let (status, reason, message) = Finding::of(&finished(Some("boom"), None)).condition();
        assert_eq!((status, reason), (None, CHECK_FAILED));
        assert_eq!(message, "the drift check failed: UpdateFailed: boom");
        // Succeeded without a result: not a silent "no changes".
        assert!(matches!(
            Finding::of(&finished(None, None)),
            Finding::Failed(_)
        ));
    }
}
