//! What one warm `up` (a Program edit of a Ready Stack) writes and runs, counted on the real
//! control plane with the real agent and pulumi CLI, never timed (issue 27):
//! - the Stack status moves through its three states once each (waiting for its Workspace, the
//!   Update running, Ready with the new `lastUpdate`), and is not written again once Ready;
//! - the Workspace status is written once per state, the pod's rollout once (not once per
//!   rollout step), and its Service not at all (only the StatefulSet's pod template moved);
//! - the Update's stack selection is not repeated by the agent that just selected it, and the
//!   agent asks `pulumi version` once;
//! - a reconcile of the Stack and its Workspace with nothing changed writes no status and runs
//!   no `pulumi` command.
//!
//! Status writes are read from a watch of each object (an unchanged status is no write: the
//! apiserver drops a no-op patch).

use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use futures::StreamExt;
use k8s_openapi::api::core::v1::Service;
use kube::api::{Patch, PatchParams, PostParams, WatchEvent, WatchParams};
use kube::{Api, Resource};
use pko_api::program::Program;
use pko_api::stack::Stack;
use pko_api::workspace::Workspace;
use pko_tests::execution::Execution;
use pko_tests::operator::Operator;
use pko_tests::{fixtures, wait_for};
use serde::Serialize;
use serde::de::DeserializeOwned;
use serde_json::{Value, json};

const WAIT: Duration = Duration::from_secs(180);
const NAME: &str = "warm";
const STACKS: &str = "stack-controller";
const WORKSPACES: &str = "workspace-controller";

fn program(message: &str) -> Value {
    json!({
        "configuration": {"greeting": {"type": "String"}},
        "outputs": {"message": format!("${{greeting}}-{message}")},
    })
}

/// Each status the object had after `from`, in order, as the watch saw it change.
#[derive(Clone, Default)]
struct Statuses(Arc<Mutex<Vec<Value>>>);

impl Statuses {
    fn watch<K>(api: Api<K>, from: &K) -> (Self, tokio::task::JoinHandle<()>)
    where
        K: Resource + Clone + DeserializeOwned + Serialize + std::fmt::Debug + Send + 'static,
    {
        let me = Self::default();
        let seen = me.clone();
        let status = |o: &K| serde_json::to_value(o).map(|v| v["status"].clone());
        let mut last = status(from).unwrap_or_default();
        let version = from.meta().resource_version.clone().unwrap_or_default();
        let name = from.meta().name.clone().unwrap_or_default();
        let task = tokio::spawn(async move {
            let params = WatchParams::default()
                .fields(&format!("metadata.name={name}"))
                .timeout(290);
            let Ok(stream) = api.watch(&params, &version).await else {
                return;
            };
            let mut stream = std::pin::pin!(stream);
            while let Some(Ok(event)) = stream.next().await {
                let WatchEvent::Modified(o) = event else {
                    continue;
                };
                let Ok(now) = status(&o) else { continue };
                if now != last {
                    seen.lock().push(now.clone());
                    last = now;
                }
            }
        });
        (me, task)
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Vec<Value>> {
        self.0.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn all(&self) -> Vec<Value> {
        self.lock().clone()
    }
}

/// (status, reason) of condition `type_` of a status, as JSON.
fn condition(status: &Value, type_: &str) -> (String, String) {
    let c = find(status, type_);
    (text(&c["status"]), text(&c["reason"]))
}

/// The message of condition `type_` ("" when absent).
fn message(status: &Value, type_: &str) -> String {
    text(&find(status, type_)["message"])
}

fn find(status: &Value, type_: &str) -> Value {
    status["conditions"]
        .as_array()
        .into_iter()
        .flatten()
        .find(|c| c["type"] == type_)
        .cloned()
        .unwrap_or_default()
}

fn text(v: &Value) -> String {
    v.as_str().unwrap_or_default().to_owned()
}

fn metric_sum(text: &str, prefix: &str) -> f64 {
    text.lines()
        .filter(|l| l.starts_with(prefix))
        .filter_map(|l| l.rsplit_once(' ')?.1.parse::<f64>().ok())
        .sum()
}

/// (reconciles so far, queued or running now) of a controller.
async fn progress(operator: &Operator, controller: &str) -> Option<(f64, f64)> {
    let text = operator.metrics_text().await?;
    let done = metric_sum(
        &text,
        &format!("controller_runtime_reconcile_total{{controller=\"{controller}\""),
    );
    let busy = metric_sum(&text, &format!("workqueue_depth{{name=\"{controller}\""))
        + metric_sum(
            &text,
            &format!("controller_runtime_active_workers{{controller=\"{controller}\""),
        );
    Some((done, busy))
}

/// The Stack deployed with `message`: Ready, its `up` recorded and none running.
async fn deployed(stacks: &Api<Stack>, message: &str) -> Option<Stack> {
    let s = stacks.get(NAME).await.ok()?;
    let status = s.status.as_ref()?;
    let ready = status
        .conditions
        .iter()
        .any(|c| c.type_ == "Ready" && c.status == "True");
    (ready
        && status.current_update.is_none()
        && status.outputs.get("message") == Some(&json!(format!("hi-{message}"))))
    .then_some(s)
}

#[tokio::test]
async fn a_warm_up_writes_each_state_once_and_an_idle_reconcile_runs_nothing() {
    let _machine = pko_tests::serial::shared().await;
    let e = Execution::start_logging_pulumi("warm-up").await;
    let client = e.plane.client();
    let programs: Api<Program> = Api::namespaced(client.clone(), &e.ns);
    let stacks: Api<Stack> = Api::namespaced(client.clone(), &e.ns);
    let workspaces: Api<Workspace> = Api::namespaced(client.clone(), &e.ns);
    let pp = PostParams::default();
    programs
        .create(&pp, &fixtures::program(NAME, program("one")))
        .await
        .expect("create program");
    let spec = json!({"programRef": {"name": NAME}, "config": {"greeting": "hi"}});
    let backend = e.tmp.path().join("backend");
    stacks
        .create(&pp, &fixtures::file_backend_stack(NAME, &backend, spec))
        .await
        .expect("create stack");
    let first = wait_for("the first up", WAIT, || deployed(&stacks, "one"))
        .await
        .unwrap_or_else(|err| panic!("{err}\n{}", e.kubelet.logs(NAME)));
    let ws = workspaces.get(NAME).await.expect("workspace");
    let (stack_writes, stack_watch) = Statuses::watch(stacks.clone(), &first);
    let (ws_writes, ws_watch) = Statuses::watch(workspaces.clone(), &ws);
    let services: Api<Service> = Api::namespaced(client.clone(), &e.ns);
    let service_version = |s: Service| s.metadata.resource_version;
    let service_before = services
        .get(&format!("{NAME}-workspace"))
        .await
        .map(service_version);
    let calls_before = e.kubelet.pulumi_calls(NAME).len();
    assert!(
        calls_before > 0,
        "the kubelet logs the agent's pulumi calls"
    );

    // The warm up: a Program edit (the Workspace's pod rolls to fetch it).
    programs
        .patch(
            NAME,
            &PatchParams::default(),
            &Patch::Merge(json!({"program": program("two")})),
        )
        .await
        .expect("edit program");
    let second = wait_for("the up after the edit", WAIT, || deployed(&stacks, "two"))
        .await
        .unwrap_or_else(|err| panic!("{err}\n{}", e.kubelet.logs(NAME)));
    let last_name = |s: &Stack| s.status.as_ref()?.last_update.as_ref()?.name.clone();
    assert_ne!(last_name(&second), last_name(&first), "a new Update ran");
    // The last write seen is the one read: the watch has caught up.
    wait_for("the watch to see the Stack Ready", WAIT, || async {
        let last = stack_writes.all().last().cloned()?;
        (condition(&last, "Ready").0 == "True").then_some(())
    })
    .await
    .expect("watched");
    let states: Vec<(String, String, bool)> = stack_writes
        .all()
        .iter()
        .map(|s| {
            let (ready, _) = condition(s, "Ready");
            (
                ready,
                message(s, "Reconciling"),
                !s["currentUpdate"].is_null(),
            )
        })
        .collect();
    assert_eq!(
        states,
        vec![
            (
                "False".into(),
                "waiting for workspace readiness".into(),
                false
            ),
            ("False".into(), "stack is being processed".into(), true),
            ("True".into(), String::new(), false),
        ],
        "the Stack status: waiting for its Workspace, the Update running, Ready; once each:\n{:#?}",
        stack_writes.all()
    );
    let ws_states: Vec<(String, String)> = ws_writes
        .all()
        .iter()
        .map(|s| condition(s, "Ready"))
        .collect();
    let pod_waits = ws_states
        .iter()
        .filter(|(_, r)| r == "RollingUpdate" || r == "WaitingForReplicas")
        .count();
    assert_eq!(pod_waits, 1, "the rollout written once: {ws_states:?}");
    for pair in ws_states.windows(2) {
        assert_ne!(
            pair[0], pair[1],
            "a Workspace write repeats a state: {ws_states:?}"
        );
    }
    assert_eq!(
        ws_states.last().map(|(s, r)| (s.as_str(), r.as_str())),
        Some(("True", "Succeeded")),
        "{ws_states:?}"
    );
    assert_eq!(
        services
            .get(&format!("{NAME}-workspace"))
            .await
            .map(service_version)
            .ok(),
        service_before.ok(),
        "the new source went to the pod, the Service was not written"
    );
    let calls: Vec<String> = e.kubelet.pulumi_calls(NAME)[calls_before..].to_vec();
    let count = |what: &str| calls.iter().filter(|c| c.contains(what)).count();
    assert_eq!(
        (count("version"), count("install"), count("stack select")),
        (0, 1, 1),
        "the running agent takes the new source (its version is not asked again), installs it and selects the stack once: {calls:#?}"
    );

    // Nothing changed: a reconcile of each (brought by metadata alone) writes and runs nothing.
    let (stack_done, _) = progress(&e.operator, STACKS).await.expect("metrics");
    let (ws_done, _) = progress(&e.operator, WORKSPACES).await.expect("metrics");
    let (stack_seen, ws_seen) = (stack_writes.all().len(), ws_writes.all().len());
    let touch = json!({"metadata": {"labels": {"touched": "idle"}}});
    stacks
        .patch(NAME, &PatchParams::default(), &Patch::Merge(&touch))
        .await
        .expect("label the stack");
    workspaces
        .patch(NAME, &PatchParams::default(), &Patch::Merge(&touch))
        .await
        .expect("label the workspace");
    wait_for(
        "the Stack and its Workspace reconciled again",
        WAIT,
        || async {
            let (s, s_busy) = progress(&e.operator, STACKS).await?;
            let (w, w_busy) = progress(&e.operator, WORKSPACES).await?;
            (s > stack_done && w > ws_done && s_busy == 0.0 && w_busy == 0.0).then_some(())
        },
    )
    .await
    .expect("reconciled");
    assert_eq!(
        (stack_writes.all().len(), ws_writes.all().len()),
        (stack_seen, ws_seen),
        "no status written: {:#?}",
        (stack_writes.all(), ws_writes.all())
    );
    let idle: Vec<String> = e.kubelet.pulumi_calls(NAME)[calls_before + calls.len()..].to_vec();
    assert!(idle.is_empty(), "no pulumi command while idle: {idle:?}");
    assert_eq!(
        stacks.get(NAME).await.ok().as_ref().and_then(last_name),
        last_name(&second),
        "no Update"
    );
    stack_watch.abort();
    ws_watch.abort();
}
