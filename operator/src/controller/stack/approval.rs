//! The approval gate's decisions (`spec.approval`), as pure functions: what a Stack whose
//! last update does not cover it does next (make a plan, wait for it, wait for approval, run
//! the approved plan), and what its `PlanApproved` condition says.
//!
//! A change first runs a preview that saves an update plan under an ID (the preview Update's
//! name); its summary goes into `status.approval`. The up runs only when the
//! `pko-rs.dev/approve-plan` annotation names that ID and the stack is still what the plan was
//! made on (commit, generation, reconcile request): an approval of a plan made on anything
//! else is refused and a new plan is made, so what runs is what was approved. The up runs the
//! saved plan (`pulumi up --plan`), which the CLI refuses to stretch to anything the preview
//! did not show. A plan is used once; a failed up needs a new plan and a new approval.

use pko_api::stack::{ApprovalStatus, Stack};
use pko_api::update::PlanSummary;

use crate::controller::conditions;

pub(super) use crate::controller::keys::{
    APPROVE_PLAN_ANNOTATION as ANNOTATION, PLAN_APPROVED as CONDITION,
    PLAN_APPROVED_REASON as APPROVED, PLAN_AWAITING as AWAITING, PLAN_FAILED as FAILED,
    PLAN_PLANNING as PLANNING, PLAN_REFUSED as REFUSED,
};

/// Changes a condition message names at most.
const MESSAGE_CHANGES: usize = 5;
/// Bytes of an approval's value a message repeats: the annotation is the tenant's text, up to
/// the apiserver's 256 KiB of annotations.
const SHOWN_ID: usize = 64;

/// Whether the stack's ups wait for approval.
pub(super) fn gated(stack: &Stack) -> bool {
    stack
        .spec
        .approval
        .as_ref()
        .is_some_and(|a| a.required != Some(false))
}

/// The plan ID the annotation approves, if any.
pub(super) fn approved(stack: &Stack) -> Option<&str> {
    stack
        .metadata
        .annotations
        .as_ref()
        .and_then(|a| a.get(ANNOTATION))
        .map(|v| v.trim())
        .filter(|v| !v.is_empty())
}

/// What the stack is now: the inputs a plan is made on.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Inputs<'a> {
    pub commit: &'a str,
    pub generation: Option<i64>,
    pub request: Option<&'a str>,
}

/// Where the current plan's preview stands (read from its Update while no result is recorded).
#[derive(Debug, Clone, PartialEq)]
pub(super) enum Preview {
    /// Still running.
    Running,
    /// Succeeded: what the plan would do.
    Made(PlanSummary),
    /// Failed, with why.
    Failed(String),
    /// Its Update is gone before it finished.
    Gone,
}

/// What the gate does next.
#[derive(Debug, Clone, PartialEq)]
pub(super) enum Step {
    /// Make a new plan; `refused`: the approval refused on the way, its plan ID and why.
    Plan { refused: Option<(String, String)> },
    /// The plan's preview runs: wait for it.
    Wait,
    /// The plan's preview failed: a new plan comes with the next change of the stack.
    Failed(String),
    /// The plan awaits approval.
    Await,
    /// Approved: run the up with this plan.
    Apply(String),
}

/// How the stack differs from what the plan was made on (`None`: the same).
pub(super) fn changed_since(plan: &ApprovalStatus, now: &Inputs<'_>) -> Option<String> {
    let commit = plan.commit.as_deref().unwrap_or_default();
    if commit != now.commit {
        return Some(format!(
            "the source changed (commit {commit:?} → {:?})",
            now.commit
        ));
    }
    if plan.generation != now.generation {
        return Some(format!(
            "the spec changed (generation {} → {})",
            plan.generation.unwrap_or(0),
            now.generation.unwrap_or(0)
        ));
    }
    let request = |r: Option<&str>| r.filter(|r| !r.is_empty()).map(str::to_owned);
    if request(plan.reconcile_request.as_deref()) != request(now.request) {
        return Some("a new sync was requested".into());
    }
    None
}

/// The next step, from the recorded plan (`None`: none yet), where its preview stands
/// (`None` once its result is recorded in `plan`), the stack now and the approved ID.
pub(super) fn decide(
    plan: Option<&ApprovalStatus>,
    preview: Option<&Preview>,
    now: &Inputs<'_>,
    approved: Option<&str>,
) -> Step {
    let Some((plan, id)) = plan.and_then(|p| Some((p, p.plan_id.as_deref()?))) else {
        return Step::Plan { refused: None };
    };
    // A plan is run once: an up that ran it (and failed, or the stack changed since) needs a
    // new one.
    if plan.applied.as_deref() == Some(id) {
        return Step::Plan { refused: None };
    }
    let running = preview == Some(&Preview::Running);
    if let Some(why) = changed_since(plan, now) {
        // The preview in flight finishes first: never two operations at once.
        if running {
            return Step::Wait;
        }
        let refused = (approved == Some(id)).then(|| (id.to_owned(), why));
        return Step::Plan { refused };
    }
    match preview {
        Some(Preview::Running) => return Step::Wait,
        Some(Preview::Gone) => return Step::Plan { refused: None },
        Some(Preview::Failed(why)) => return Step::Failed(why.clone()),
        Some(Preview::Made(_)) | None => {}
    }
    if let Some(why) = &plan.failed {
        return Step::Failed(why.clone());
    }
    if plan.summary.is_none() {
        // Recorded as made but without a result: made again.
        return Step::Plan { refused: None };
    }
    if approved == Some(id) {
        Step::Apply(id.to_owned())
    } else {
        Step::Await
    }
}

/// "create: 1, update: 2 (create urn:a, update urn:b, …)", naming at most [`MESSAGE_CHANGES`].
pub(super) fn describe(summary: &PlanSummary) -> String {
    let counts: Vec<String> = summary
        .counts
        .iter()
        .filter(|(op, _)| pko_api::update::is_change(op))
        .map(|(op, n)| format!("{op}: {n}"))
        .collect();
    if counts.is_empty() {
        return "no resource changes".into();
    }
    let mut text = counts.join(", ");
    if !summary.changes.is_empty() {
        let named: Vec<&str> = summary
            .changes
            .iter()
            .take(MESSAGE_CHANGES)
            .map(String::as_str)
            .collect();
        let more = if summary.changes.len() > MESSAGE_CHANGES {
            ", …"
        } else {
            ""
        };
        text.push_str(&format!(" ({}{more})", named.join(", ")));
    }
    text
}

/// How a user approves plan `id` of the stack.
pub(super) fn how_to_approve(stack: &str, namespace: &str, id: &str) -> String {
    format!("kubectl annotate stack {stack} -n {namespace} --overwrite {ANNOTATION}={id}")
}

/// The `PlanApproved` condition while the stack waits on its gate: its reason and message.
/// An approval of any plan but the current one (nor the last one run) is told as refused,
/// with why when the gate refused it itself: whether the stack moved on before or after the
/// approval came, it does not run.
pub(super) fn condition(
    plan: &ApprovalStatus,
    step: &Step,
    approved: Option<&str>,
    approve_hint: &str,
) -> (&'static str, String) {
    let id = plan.plan_id.as_deref().unwrap_or_default();
    let (reason, message) = match step {
        Step::Plan { .. } | Step::Wait => (PLANNING, format!("making plan {id}")),
        Step::Failed(why) => (
            FAILED,
            format!(
                "the preview of plan {id} failed (a change of the stack makes a new plan): {why}"
            ),
        ),
        Step::Await => {
            let summary = plan.summary.as_ref().map(describe).unwrap_or_default();
            (
                AWAITING,
                format!("plan {id} awaits approval: {summary}; to approve: {approve_hint}"),
            )
        }
        Step::Apply(_) => (APPROVED, format!("plan {id} approved: the up runs it")),
    };
    let message = conditions::truncate(&message, conditions::MESSAGE_LIMIT);
    let Some(other) = approved.filter(|a| *a != id) else {
        return (reason, message);
    };
    let why = match (&plan.refused, &plan.refusal) {
        (Some(refused), Some(why)) if refused == other => why.as_str(),
        // The annotation still names the plan last run.
        _ if plan.applied.as_deref() == Some(other) => return (reason, message),
        _ => "it is not the current plan (the stack changed since it was made)",
    };
    let other = conditions::truncate(other, SHOWN_ID);
    let message = format!("the approval of plan {other} was refused: {why}; {message}");
    (
        REFUSED,
        conditions::truncate(&message, conditions::MESSAGE_LIMIT),
    )
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use serde_json::json;

    use super::*;

    fn now() -> Inputs<'static> {
        Inputs {
            commit: "c2",
            generation: Some(2),
            request: None,
        }
    }

    fn summary() -> PlanSummary {
        PlanSummary {
            counts: BTreeMap::from([("create".into(), 1), ("same".into(), 3)]),
            changes: vec!["create urn:cm".into()],
        }
    }

    fn plan(made: bool) -> ApprovalStatus {
        ApprovalStatus {
            plan_id: Some("s-1".into()),
            summary: made.then(summary),
            commit: Some("c2".into()),
            generation: Some(2),
            ..Default::default()
        }
    }

    #[test]
    fn the_gate_is_opt_in_and_the_annotation_names_the_plan() {
        let stack = |spec: serde_json::Value, annotations: serde_json::Value| -> Stack {
            serde_json::from_value(json!({
                "apiVersion": "pulumi.com/v1", "kind": "Stack",
                "metadata": {"name": "s", "namespace": "ns", "annotations": annotations},
                "spec": spec,
            }))
            .expect("stack")
        };
        let plain = stack(json!({"stack": "dev"}), json!({}));
        assert!(!gated(&plain));
        assert!(gated(&stack(
            json!({"stack": "dev", "approval": {}}),
            json!({})
        )));
        assert!(!gated(&stack(
            json!({"stack": "dev", "approval": {"required": false}}),
            json!({})
        )));
        assert_eq!(approved(&plain), None);
        let approving = stack(json!({"stack": "dev"}), json!({ANNOTATION: " s-1 "}));
        assert_eq!(approved(&approving), Some("s-1"));
        assert_eq!(
            approved(&stack(json!({"stack": "dev"}), json!({ANNOTATION: ""}))),
            None
        );
    }

    #[test]
    fn a_change_is_planned_then_awaits_approval_then_runs_the_approved_plan() {
        assert_eq!(
            decide(None, None, &now(), None),
            Step::Plan { refused: None }
        );
        let making = plan(false);
        assert_eq!(
            decide(Some(&making), Some(&Preview::Running), &now(), None),
            Step::Wait
        );
        let made = plan(true);
        assert_eq!(decide(Some(&made), None, &now(), None), Step::Await);
        // An approval of another ID does nothing.
        assert_eq!(decide(Some(&made), None, &now(), Some("s-0")), Step::Await);
        assert_eq!(
            decide(Some(&made), None, &now(), Some("s-1")),
            Step::Apply("s-1".into())
        );
        // Once run, the plan is spent: the next change makes a new one.
        let applied = ApprovalStatus {
            applied: Some("s-1".into()),
            ..made
        };
        assert_eq!(
            decide(Some(&applied), None, &now(), Some("s-1")),
            Step::Plan { refused: None }
        );
    }

    #[test]
    fn an_approval_of_a_plan_made_on_another_stack_is_refused() {
        let made = plan(true);
        let moved = Inputs {
            commit: "c3",
            ..now()
        };
        let Step::Plan {
            refused: Some((id, why)),
        } = decide(Some(&made), None, &moved, Some("s-1"))
        else {
            panic!("refused");
        };
        assert_eq!(id, "s-1");
        assert_eq!(why, "the source changed (commit \"c2\" → \"c3\")");
        // Not approved: simply planned again.
        assert_eq!(
            decide(Some(&made), None, &moved, None),
            Step::Plan { refused: None }
        );
        let edited = Inputs {
            generation: Some(3),
            ..now()
        };
        assert_eq!(
            changed_since(&made, &edited).as_deref(),
            Some("the spec changed (generation 2 → 3)")
        );
        let requested = Inputs {
            request: Some("r1"),
            ..now()
        };
        assert_eq!(
            changed_since(&made, &requested).as_deref(),
            Some("a new sync was requested")
        );
        // A preview in flight finishes before the next plan starts.
        assert_eq!(
            decide(
                Some(&plan(false)),
                Some(&Preview::Running),
                &moved,
                Some("s-1")
            ),
            Step::Wait
        );
    }

    #[test]
    fn a_failed_or_lost_preview() {
        let making = plan(false);
        assert_eq!(
            decide(
                Some(&making),
                Some(&Preview::Failed("boom".into())),
                &now(),
                None
            ),
            Step::Failed("boom".into())
        );
        let failed = ApprovalStatus {
            failed: Some("boom".into()),
            ..making.clone()
        };
        assert_eq!(
            decide(Some(&failed), None, &now(), Some("s-1")),
            Step::Failed("boom".into())
        );
        // A change of the stack makes a new plan.
        let moved = Inputs {
            generation: Some(3),
            ..now()
        };
        assert!(matches!(
            decide(Some(&failed), None, &moved, None),
            Step::Plan { .. }
        ));
        assert_eq!(
            decide(Some(&making), Some(&Preview::Gone), &now(), None),
            Step::Plan { refused: None }
        );
    }

    #[test]
    fn the_condition_says_what_awaits_and_what_was_refused() {
        let made = plan(true);
        let hint = how_to_approve("s", "ns", "s-1");
        assert_eq!(
            hint,
            "kubectl annotate stack s -n ns --overwrite pko-rs.dev/approve-plan=s-1"
        );
        let (reason, message) = condition(&made, &Step::Await, None, &hint);
        assert_eq!(reason, AWAITING);
        assert_eq!(
            message,
            format!("plan s-1 awaits approval: create: 1 (create urn:cm); to approve: {hint}")
        );
        let refused = ApprovalStatus {
            refused: Some("s-0".into()),
            refusal: Some("the source changed".into()),
            ..made
        };
        let (reason, message) = condition(&refused, &Step::Await, Some("s-0"), &hint);
        assert_eq!(reason, REFUSED);
        assert!(
            message.starts_with(
                "the approval of plan s-0 was refused: the source changed; plan s-1 awaits approval"
            ),
            "{message}"
        );
        // Once the new plan is approved, the refusal is history.
        let (reason, _) = condition(&refused, &Step::Apply("s-1".into()), Some("s-1"), &hint);
        assert_eq!(reason, APPROVED);
        // An approval of a plan the stack moved past before the approval came: refused too.
        let (reason, message) = condition(&refused, &Step::Await, Some("s-00"), &hint);
        assert_eq!(reason, REFUSED);
        assert!(
            message
                .starts_with("the approval of plan s-00 was refused: it is not the current plan"),
            "{message}"
        );
        // The annotation still naming the plan last run is no refusal.
        let ran = ApprovalStatus {
            applied: Some("s-0".into()),
            ..plan(true)
        };
        let (reason, _) = condition(&ran, &Step::Await, Some("s-0"), &hint);
        assert_eq!(reason, AWAITING);
        let refreshed = PlanSummary {
            counts: BTreeMap::from([
                ("refresh".into(), 2),
                ("same".into(), 1),
                ("update".into(), 1),
            ]),
            changes: vec!["update urn:cm".into()],
        };
        assert_eq!(describe(&refreshed), "update: 1 (update urn:cm)");
        let many = PlanSummary {
            counts: BTreeMap::from([("create".into(), 7)]),
            changes: (0..7).map(|i| format!("create urn:{i}")).collect(),
        };
        assert_eq!(
            describe(&many),
            "create: 7 (create urn:0, create urn:1, create urn:2, create urn:3, create urn:4, …)"
        );
        assert_eq!(describe(&PlanSummary::default()), "no resource changes");
    }

    #[test]
    fn a_huge_approval_or_failure_is_cut_in_the_message() {
        let made = plan(true);
        let hint = how_to_approve("s", "ns", "s-1");
        let huge = "x".repeat(200_000);
        let (reason, message) = condition(&made, &Step::Await, Some(&huge), &hint);
        assert_eq!(reason, REFUSED);
        assert!(
            message.len() <= conditions::MESSAGE_LIMIT + 3,
            "{}",
            message.len()
        );
        assert!(
            message.starts_with(&format!(
                "the approval of plan {}… was refused",
                "x".repeat(SHOWN_ID)
            )),
            "{message}"
        );
        let failed = Step::Failed("y".repeat(10_000));
        let (reason, message) = condition(&made, &failed, None, &hint);
        assert_eq!(reason, FAILED);
        assert!(
            message.len() <= conditions::MESSAGE_LIMIT + 3,
            "{}",
            message.len()
        );
    }
}
