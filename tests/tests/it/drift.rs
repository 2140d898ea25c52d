//! Drift detection (`spec.driftDetection`) on the real control plane with the harness as
//! kubelet, the real agent and pulumi CLI, and the Kubernetes provider creating a ConfigMap in
//! the test apiserver: a check is a preview-only refresh that finds nothing, then, once the
//! ConfigMap is changed behind Pulumi's back, finds it changed and says so without running an
//! `up`; with `autoRemediate` the drift starts an `up` that puts the ConfigMap back. A schedule
//! the controller cannot use stalls the Stack naming it; one the CRD can tell is refused.

use std::path::PathBuf;
use std::time::Duration;

use k8s_openapi::api::core::v1::{ConfigMap, Event};
use kube::Api;
use kube::api::{ListParams, Patch, PatchParams, PostParams};
use pko_api::program::Program;
use pko_api::stack::{Stack, StackStatus};
use pko_api::update::{Update, UpdateType};
use pko_tests::execution::Execution;
use pko_tests::fixtures::{self, labelled_config_map as config_map};
use serde_json::{Value, json};

/// Checks run every minute: a wait covers the update, two ticks and the check itself.
const WAIT: Duration = Duration::from_secs(300);
const EVERY_MINUTE: &str = "* * * * *";

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

    /// Program `drift` declares one ConfigMap labelled `drifting` with `v: declared`; Stack
    /// `name` deploys it with `driftDetection`.
    async fn stack(&self, name: &str, drift_detection: Value) {
        let programs: Api<Program> = Api::namespaced(self.client(), &self.e.ns);
        let program = fixtures::program(
            "drift",
            json!({
                "configuration": {"ns": {"type": "String"}},
                "resources": {"d": config_map("drifting", json!({"v": "declared"}))},
            }),
        );
        programs
            .create(&PostParams::default(), &program)
            .await
            .expect("create program");
        let literal = |v: &str| json!({"type": "Literal", "literal": {"value": v}});
        let spec = json!({
            "programRef": {"name": "drift"},
            "config": {"ns": self.e.ns},
            "envRefs": {
                "PULUMI_CONFIG_PASSPHRASE": literal(fixtures::PASSPHRASE),
                "KUBECONFIG": literal(&self.e.plane.kubeconfig_path().display().to_string()),
            },
            "driftDetection": drift_detection,
        });
        self.stacks
            .create(
                &PostParams::default(),
                &fixtures::file_backend_stack(name, &self.backend(), spec),
            )
            .await
            .expect("create stack");
    }

    /// The deployed ConfigMap.
    async fn config_map(&self) -> ConfigMap {
        let found = fixtures::labelled(self.client(), &self.e.ns, "drifting").await;
        assert_eq!(found.len(), 1, "{found:?}");
        found.into_iter().next().expect("one")
    }

    /// Changes the ConfigMap's data behind Pulumi's back.
    async fn tamper(&self) {
        let name = self.config_map().await.metadata.name.expect("name");
        Api::<ConfigMap>::namespaced(self.client(), &self.e.ns)
            .patch(
                &name,
                &PatchParams::default(),
                &Patch::Merge(json!({"data": {"v": "changed by hand"}})),
            )
            .await
            .expect("tamper");
    }

    async fn updates(&self, name: &str) -> Vec<Update> {
        Api::<Update>::namespaced(self.client(), &self.e.ns)
            .list(&ListParams::default().labels(&format!("pulumi.com/stack-name={name}")))
            .await
            .expect("list updates")
            .items
    }
}

/// The `DriftDetected` condition's `(status, reason, message)`.
fn drift(status: &StackStatus) -> Option<(String, String, String)> {
    status
        .conditions
        .iter()
        .find(|c| c.type_ == "DriftDetected")
        .map(|c| (c.status.clone(), c.reason.clone(), c.message.clone()))
}

fn data(cm: &ConfigMap) -> Option<String> {
    cm.data.as_ref()?.get("v").cloned()
}

const URN: &str = "urn:pulumi:dev::drift::kubernetes:core/v1:ConfigMap::d";

/// A check finds nothing, then the ConfigMap changed by hand: `DriftDetected=True` naming it,
/// a Warning Event, and no `up` ran (the ConfigMap keeps the change, the last update stays).
#[tokio::test]
async fn a_change_behind_pulumis_back_is_reported_without_an_up() {
    let _machine = pko_tests::serial::shared().await;
    let env = Env::start("drift-report").await;
    env.stack("report", json!({"schedules": [{"cron": EVERY_MINUTE}]}))
        .await;
    let (first_check, last_update) = env
        .e
        .until_stack("report", "a check that finds no drift", WAIT, |s| {
            let (status, reason, _) = drift(s)?;
            let d = s.drift_detection.as_ref()?;
            (status == "False" && reason == "NoChanges" && d.current_check.is_none())
                .then(|| (d.last_check.clone(), s.last_update.clone()))
        })
        .await;
    let status = env.e.stack_status("report").await.expect("status");
    let d = status.drift_detection.expect("drift status");
    assert!(d.last_check_time.is_some());
    assert_eq!(d.change_count, Some(0));
    assert_eq!(d.schedule.as_deref(), Some(EVERY_MINUTE));
    let last_update = last_update.expect("the first up");
    assert_eq!(last_update.type_.as_deref(), Some("up"));

    env.tamper().await;
    let message = env
        .e
        .until_stack("report", "the drift to be reported", WAIT, |s| {
            let (status, reason, message) = drift(s)?;
            (status == "True" && reason == "Changes").then_some(message)
        })
        .await;
    assert!(
        message.starts_with("1 resource(s) changed outside Pulumi") && message.contains(URN),
        "{message}"
    );
    let status = env.e.stack_status("report").await.expect("status");
    let d = status.drift_detection.expect("drift status");
    assert_eq!(d.change_count, Some(1));
    assert_eq!(d.changed_resources, vec![URN.to_owned()]);
    assert_ne!(d.last_check, first_check, "a later check found it");
    // The check changed nothing: no up ran, the ConfigMap keeps the change.
    assert_eq!(status.last_update, Some(last_update));
    let ups = env
        .updates("report")
        .await
        .into_iter()
        .filter(|u| u.spec.type_ == Some(UpdateType::Up))
        .count();
    assert_eq!(ups, 1, "only the first up ran");
    assert_eq!(
        data(&env.config_map().await).as_deref(),
        Some("changed by hand")
    );
    let checks: Vec<Update> = env
        .updates("report")
        .await
        .into_iter()
        .filter(|u| u.spec.type_ == Some(UpdateType::Refresh))
        .collect();
    assert!(
        !checks.is_empty() && checks.iter().all(|u| u.spec.preview_only == Some(true)),
        "{checks:?}"
    );
    // The check wrote no state: the next one finds the same drift (a real refresh would have
    // taken the change into the state, and the next check would find nothing).
    let found_by = d.last_check.clone();
    let again = env
        .e
        .until_stack("report", "the next check", WAIT, |s| {
            let d = s.drift_detection.as_ref()?;
            (d.current_check.is_none() && d.last_check != found_by).then(|| drift(s))
        })
        .await;
    assert_eq!(
        again.map(|(status, reason, _)| (status, reason)),
        Some(("True".to_owned(), "Changes".to_owned()))
    );
    let events: Api<Event> = Api::namespaced(env.client(), &env.e.ns);
    let warned = events
        .list(&ListParams::default())
        .await
        .expect("events")
        .items
        .into_iter()
        .any(|ev| {
            ev.reason.as_deref() == Some("DriftDetected")
                && ev.type_.as_deref() == Some("Warning")
                && ev.message.as_deref().is_some_and(|m| m.contains(URN))
        });
    assert!(warned, "a Warning Event names the drifted resource");
}

/// With `autoRemediate`, the drift a check finds starts an `up` that puts the ConfigMap's data
/// back as the program declares it.
#[tokio::test]
async fn auto_remediate_puts_the_resource_back_with_an_up() {
    let _machine = pko_tests::serial::shared().await;
    let env = Env::start("drift-remediate").await;
    env.stack(
        "remediate",
        json!({"schedules": [{"cron": EVERY_MINUTE, "autoRemediate": true}]}),
    )
    .await;
    let first = env
        .e
        .until_stack("remediate", "the first up", WAIT, |s| {
            let last = s.last_update.as_ref()?;
            (last.state.as_deref() == Some("succeeded")).then(|| last.name.clone())
        })
        .await;
    assert_eq!(data(&env.config_map().await).as_deref(), Some("declared"));
    env.tamper().await;
    let remediation = env
        .e
        .until_stack("remediate", "an up after the drift", WAIT, |s| {
            let last = s.last_update.as_ref()?;
            (last.name != first && last.state.as_deref() == Some("succeeded")).then(|| last.clone())
        })
        .await;
    assert_eq!(remediation.type_.as_deref(), Some("up"));
    let update = Api::<Update>::namespaced(env.client(), &env.e.ns)
        .get(remediation.name.as_deref().expect("name"))
        .await
        .expect("the remediating update");
    let why = update.spec.message.unwrap_or_default();
    assert!(
        why.starts_with("Drift detected by schedule") && why.contains(URN),
        "{why}"
    );
    assert_eq!(
        data(&env.config_map().await).as_deref(),
        Some("declared"),
        "the up put the declared data back"
    );
}

/// A schedule whose zone does not exist passes the CRD's pattern and stalls the Stack naming
/// it (no update runs); one that is not five fields is refused by the CRD.
#[tokio::test]
async fn a_bad_schedule_stalls_the_stack_or_is_refused() {
    let _machine = pko_tests::serial::shared().await;
    let env = Env::start("drift-invalid").await;
    env.stack(
        "invalid",
        json!({"schedules": [{"cron": EVERY_MINUTE}, {"cron": "CRON_TZ=Nowhere/Land 0 9 * * *"}]}),
    )
    .await;
    let (reason, message) = env
        .e
        .until_stack("invalid", "the stall", WAIT, |s| {
            let c = s
                .conditions
                .iter()
                .find(|c| c.type_ == "Stalled" && c.status == "True")?;
            Some((c.reason.clone(), c.message.clone()))
        })
        .await;
    assert_eq!(reason, "SpecInvalid");
    assert!(
        message.starts_with("spec.driftDetection.schedules[1].cron \"CRON_TZ=Nowhere/Land 0 9 * * *\": unknown time zone"),
        "{message}"
    );
    assert!(env.updates("invalid").await.is_empty(), "nothing ran");

    let refused = env
        .stacks
        .create(
            &PostParams::default(),
            &fixtures::file_backend_stack(
                "short",
                &env.backend(),
                json!({"programRef": {"name": "drift"},
                    "driftDetection": {"schedules": [{"cron": "* * *"}]}}),
            ),
        )
        .await
        .expect_err("three fields");
    assert!(
        refused
            .to_string()
            .contains("spec.driftDetection.schedules[0].cron"),
        "{refused}"
    );
}
