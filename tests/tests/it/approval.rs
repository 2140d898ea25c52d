//! The approval gate (`spec.approval`) on the real control plane with the harness as kubelet,
//! the real agent and pulumi CLI, and the Kubernetes provider creating a ConfigMap in the test
//! apiserver: a gated Stack previews and saves a plan, shows its summary and ID, and creates
//! nothing until the `pko-rs.dev/approve-plan` annotation names that ID; the up then runs that
//! plan. An approval of a plan made before the Program changed is refused and nothing is
//! applied; drift found by a remediating schedule becomes a plan awaiting approval.

use std::path::PathBuf;
use std::time::Duration;

use k8s_openapi::api::core::v1::{ConfigMap, Event};
use kube::Api;
use kube::api::{ListParams, Patch, PatchParams, PostParams};
use pko_api::program::Program;
use pko_api::stack::{ApprovalStatus, Stack, StackStatus};
use pko_api::update::{Update, UpdateType};
use pko_tests::execution::Execution;
use pko_tests::fixtures::{self, labelled_config_map as config_map};
use serde_json::{Value, json};

const WAIT: Duration = Duration::from_secs(300);
const ANNOTATION: &str = "pko-rs.dev/approve-plan";
const URN: &str = "urn:pulumi:dev::gated::kubernetes:core/v1:ConfigMap::d";

struct Env {
    e: Execution,
    stacks: Api<Stack>,
}

impl Env {
    async fn start(prefix: &str) -> Self {
        let e = Execution::start(prefix, &[]).await;
        let stacks = Api::namespaced(e.plane.client(), &e.ns);
        Self { e, stacks }
    }

    fn client(&self) -> kube::Client {
        self.e.plane.client()
    }

    fn backend(&self) -> PathBuf {
        self.e.tmp.path().join("backend")
    }

    /// Program `gated`: one ConfigMap labelled `gated` with `v: value`.
    fn program(value: &str) -> Value {
        json!({
            "configuration": {"ns": {"type": "String"}},
            "resources": {"d": config_map("gated", json!({"v": value}))},
        })
    }

    /// Stack `name` deploys Program `gated` behind an approval gate, with `extra` in its spec.
    async fn stack(&self, name: &str, extra: Value) {
        let programs: Api<Program> = Api::namespaced(self.client(), &self.e.ns);
        programs
            .create(
                &PostParams::default(),
                &fixtures::program("gated", Self::program("declared")),
            )
            .await
            .expect("create program");
        let literal = |v: &str| json!({"type": "Literal", "literal": {"value": v}});
        let mut spec = json!({
            "programRef": {"name": "gated"},
            "config": {"ns": self.e.ns},
            "envRefs": {
                "PULUMI_CONFIG_PASSPHRASE": literal(fixtures::PASSPHRASE),
                "KUBECONFIG": literal(&self.e.plane.kubeconfig_path().display().to_string()),
            },
            "approval": {},
        });
        if let (Some(spec), Some(extra)) = (spec.as_object_mut(), extra.as_object()) {
            spec.extend(extra.clone());
        }
        self.stacks
            .create(
                &PostParams::default(),
                &fixtures::file_backend_stack(name, &self.backend(), spec),
            )
            .await
            .expect("create stack");
    }

    /// The plan awaiting approval, once its summary is there: `(plan, condition reason,
    /// condition message)`.
    async fn awaiting(&self, name: &str, not: Option<&str>) -> (ApprovalStatus, String, String) {
        self.e
            .until_stack(name, "a plan awaiting approval", WAIT, |s| {
                let plan = s.approval.clone()?;
                let (status, reason, message) = gate(s)?;
                let waits = status == "False"
                    && (reason == "AwaitingApproval" || reason == "ApprovalRefused")
                    && plan.summary.is_some()
                    && plan.plan_id.as_deref() != not;
                waits.then_some((plan, reason, message))
            })
            .await
    }

    async fn approve(&self, name: &str, plan: &str) {
        self.stacks
            .patch(
                name,
                &PatchParams::default(),
                &Patch::Merge(json!({"metadata": {"annotations": {ANNOTATION: plan}}})),
            )
            .await
            .expect("approve");
    }

    async fn config_maps(&self) -> Vec<ConfigMap> {
        fixtures::labelled(self.client(), &self.e.ns, "gated").await
    }

    async fn updates(&self, name: &str, type_: UpdateType) -> Vec<Update> {
        Api::<Update>::namespaced(self.client(), &self.e.ns)
            .list(&ListParams::default().labels(&format!("pulumi.com/stack-name={name}")))
            .await
            .expect("list updates")
            .items
            .into_iter()
            .filter(|u| u.spec.type_ == Some(type_))
            .collect()
    }

    /// Waits for a succeeded up other than `after`; returns its Update.
    async fn up_after(&self, name: &str, after: Option<&str>) -> Update {
        let last = self
            .e
            .until_stack(name, "the approved up to succeed", WAIT, |s| {
                let last = s.last_update.as_ref()?;
                (last.state.as_deref() == Some("succeeded")
                    && last.type_.as_deref() == Some("up")
                    && last.name.as_deref() != after)
                    .then(|| last.name.clone())
                    .flatten()
            })
            .await;
        Api::<Update>::namespaced(self.client(), &self.e.ns)
            .get(&last)
            .await
            .expect("the up")
    }

    async fn events(&self, reason: &str) -> Vec<Event> {
        Api::<Event>::namespaced(self.client(), &self.e.ns)
            .list(&ListParams::default())
            .await
            .expect("events")
            .items
            .into_iter()
            .filter(|ev| ev.reason.as_deref() == Some(reason))
            .collect()
    }
}

/// The `PlanApproved` condition's `(status, reason, message)`.
fn gate(status: &StackStatus) -> Option<(String, String, String)> {
    status
        .conditions
        .iter()
        .find(|c| c.type_ == "PlanApproved")
        .map(|c| (c.status.clone(), c.reason.clone(), c.message.clone()))
}

fn data(cm: &ConfigMap) -> Option<String> {
    cm.data.as_ref()?.get("v").cloned()
}

/// A gated Stack previews, shows the plan's summary and ID, and creates nothing; approving
/// that ID runs the up with the saved plan, and the ConfigMap appears.
#[tokio::test]
async fn a_gated_stack_creates_nothing_until_its_plan_is_approved() {
    let _machine = pko_tests::serial::shared().await;
    let env = Env::start("approval-gate").await;
    env.stack("gated", json!({})).await;
    let (plan, reason, message) = env.awaiting("gated", None).await;
    let id = plan.plan_id.clone().expect("a plan ID");
    assert_eq!(reason, "AwaitingApproval");
    assert!(
        message.starts_with(&format!("plan {id} awaits approval: create: ")),
        "{message}"
    );
    assert!(
        message.contains(&format!(
            "kubectl annotate stack gated -n {} --overwrite {ANNOTATION}={id}",
            env.e.ns
        )),
        "{message}"
    );
    let summary = plan.summary.expect("summary");
    assert!(
        summary.counts.get("create").is_some_and(|n| *n >= 1),
        "{summary:?}"
    );
    assert!(
        summary.changes.contains(&format!("create {URN}")),
        "{summary:?}"
    );
    assert!(plan.commit.is_some() && plan.generation.is_some());
    // The preview saved the plan: it is the Update the ID names.
    let preview = Api::<Update>::namespaced(env.client(), &env.e.ns)
        .get(&id)
        .await
        .expect("the plan's preview");
    assert_eq!(preview.spec.type_, Some(UpdateType::Preview));
    assert_eq!(preview.spec.plan.as_deref(), Some(id.as_str()));
    // Nothing was applied.
    assert!(
        env.config_maps().await.is_empty(),
        "no ConfigMap before approval"
    );
    assert!(
        env.updates("gated", UpdateType::Up).await.is_empty(),
        "no up"
    );
    let status = env.e.stack_status("gated").await.expect("status");
    assert!(status.last_update.is_none(), "{status:?}");
    assert!(
        !env.events("AwaitingApproval").await.is_empty(),
        "an Event tells the plan"
    );

    env.approve("gated", &id).await;
    let up = env.up_after("gated", None).await;
    assert_eq!(
        up.spec.plan.as_deref(),
        Some(id.as_str()),
        "the up ran the plan"
    );
    let found = env.config_maps().await;
    assert_eq!(found.len(), 1, "{found:?}");
    assert_eq!(data(&found[0]).as_deref(), Some("declared"));
    let status = env.e.stack_status("gated").await.expect("status");
    let (state, reason, _) = gate(&status).expect("the condition");
    assert_eq!((state.as_str(), reason.as_str()), ("True", "Approved"));
    assert_eq!(
        status.approval.and_then(|a| a.applied).as_deref(),
        Some(id.as_str())
    );
    assert_eq!(
        env.updates("gated", UpdateType::Up).await.len(),
        1,
        "one up"
    );
}

/// The Program changes after the plan was made: approving the old plan's ID is refused with
/// `ApprovalRefused`, no up runs and nothing is applied, and a new plan awaits approval.
#[tokio::test]
async fn an_approval_of_a_plan_made_before_the_program_changed_is_refused() {
    let _machine = pko_tests::serial::shared().await;
    let env = Env::start("approval-stale").await;
    env.stack("stale", json!({})).await;
    let (plan, _, _) = env.awaiting("stale", None).await;
    let old = plan.plan_id.expect("a plan ID");
    let programs: Api<Program> = Api::namespaced(env.client(), &env.e.ns);
    programs
        .patch(
            "gated",
            &PatchParams::default(),
            &Patch::Merge(json!({"program": Env::program("changed")})),
        )
        .await
        .expect("change the program");
    env.approve("stale", &old).await;
    let (plan, reason, message) = env
        .e
        .until_stack("stale", "the stale approval to be refused", WAIT, |s| {
            let plan = s.approval.clone()?;
            let (status, reason, message) = gate(s)?;
            (status == "False"
                && reason == "ApprovalRefused"
                && plan.summary.is_some()
                && plan.plan_id.as_deref() != Some(old.as_str()))
            .then_some((plan, reason, message))
        })
        .await;
    let new = plan.plan_id.clone().expect("a new plan");
    assert_eq!(reason, "ApprovalRefused");
    assert!(
        message.starts_with(&format!("the approval of plan {old} was refused: ")),
        "{message}"
    );
    assert!(
        message.contains(&format!("plan {new} awaits approval")),
        "{message}"
    );
    assert!(
        env.events("ApprovalRefused")
            .await
            .iter()
            .any(|ev| ev.type_.as_deref() == Some("Warning")),
        "a Warning Event tells the refusal"
    );
    // Nothing ran: no up, no ConfigMap.
    assert!(
        env.updates("stale", UpdateType::Up).await.is_empty(),
        "no up"
    );
    assert!(env.config_maps().await.is_empty(), "nothing applied");
    // The new plan is what the changed Program declares, and its approval runs it.
    env.approve("stale", &new).await;
    let up = env.up_after("stale", None).await;
    assert_eq!(up.spec.plan.as_deref(), Some(new.as_str()));
    let found = env.config_maps().await;
    assert_eq!(found.len(), 1, "{found:?}");
    assert_eq!(data(&found[0]).as_deref(), Some("changed"));
}

/// Drift found by a remediating schedule on a gated Stack makes a plan awaiting approval (that
/// refreshes first), not an up: the ConfigMap keeps the change until the plan is approved.
#[tokio::test]
async fn drift_on_a_gated_stack_makes_a_plan_awaiting_approval() {
    let _machine = pko_tests::serial::shared().await;
    let env = Env::start("approval-drift").await;
    env.stack(
        "drifting",
        json!({"driftDetection": {"schedules": [{"cron": "* * * * *", "autoRemediate": true}]}}),
    )
    .await;
    let (plan, _, _) = env.awaiting("drifting", None).await;
    let first = plan.plan_id.expect("a plan ID");
    env.approve("drifting", &first).await;
    let up = env.up_after("drifting", None).await;
    let up_name = up.metadata.name.clone();
    let cm = env
        .config_maps()
        .await
        .into_iter()
        .next()
        .expect("deployed");
    Api::<ConfigMap>::namespaced(env.client(), &env.e.ns)
        .patch(
            cm.metadata.name.as_deref().expect("name"),
            &PatchParams::default(),
            &Patch::Merge(json!({"data": {"v": "changed by hand"}})),
        )
        .await
        .expect("tamper");
    let (plan, reason, _) = env.awaiting("drifting", Some(&first)).await;
    assert_eq!(reason, "AwaitingApproval");
    assert_eq!(plan.remediation, Some(true), "{plan:?}");
    assert!(
        plan.reason
            .as_deref()
            .is_some_and(|r| r.starts_with("Drift detected by schedule") && r.contains(URN)),
        "{plan:?}"
    );
    // The Kubernetes provider replaces a ConfigMap whose data changed; the refresh the plan ran
    // first is no change.
    let summary = plan.summary.clone().expect("summary");
    assert_eq!(summary.counts.get("replace"), Some(&1), "{summary:?}");
    assert!(
        summary.changes.contains(&format!("replace {URN}")),
        "{summary:?}"
    );
    assert!(
        summary.changes.iter().all(|c| !c.starts_with("refresh ")),
        "{summary:?}"
    );
    let status = env.e.stack_status("drifting").await.expect("status");
    assert!(
        status
            .conditions
            .iter()
            .any(|c| c.type_ == "DriftDetected" && c.status == "True"),
        "{status:?}"
    );
    // No up ran for the drift.
    assert_eq!(env.updates("drifting", UpdateType::Up).await.len(), 1);
    let cm = env
        .config_maps()
        .await
        .into_iter()
        .next()
        .expect("deployed");
    assert_eq!(data(&cm).as_deref(), Some("changed by hand"));
    // Approved, the plan puts the declared data back.
    let id = plan.plan_id.expect("a plan ID");
    env.approve("drifting", &id).await;
    let up = env.up_after("drifting", up_name.as_deref()).await;
    assert_eq!(up.spec.plan.as_deref(), Some(id.as_str()));
    assert_eq!(up.spec.refresh, Some(true));
    let cm = env
        .config_maps()
        .await
        .into_iter()
        .next()
        .expect("deployed");
    assert_eq!(data(&cm).as_deref(), Some("declared"));
}

/// `approval: {required: false}` turns the gate off: the stack runs its up at once, with no
/// plan, no `PlanApproved` condition and no `status.approval`, as a stack without the field.
#[tokio::test]
async fn a_gate_turned_off_runs_ups_as_without_it() {
    let _machine = pko_tests::serial::shared().await;
    let env = Env::start("approval-off").await;
    env.stack("open", json!({"approval": {"required": false}}))
        .await;
    let up = env.up_after("open", None).await;
    assert_eq!(up.spec.plan, None, "no plan");
    let found = env.config_maps().await;
    assert_eq!(found.len(), 1, "{found:?}");
    let status = env.e.stack_status("open").await.expect("status");
    assert!(gate(&status).is_none(), "{status:?}");
    assert_eq!(status.approval, None);
    assert!(
        env.updates("open", UpdateType::Preview).await.is_empty(),
        "no plan was made"
    );
}
