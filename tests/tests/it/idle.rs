//! Scale to zero (`spec.idle`) on the real control plane, with the harness as kubelet (which
//! stops a StatefulSet's pod at 0 replicas and starts a new one when it is scaled up again),
//! the real agent and pulumi CLI: a workspace with no operation for its idle period has no
//! agent process left and is `Ready=False, reason=Idle` (kstatus: `InProgress` with the `Idle`
//! message, never `Failed`, as cli-utils reads any `Ready=False`); an
//! operator restart leaves it stopped; the next Update starts it and runs on the state left
//! before. Through a Stack's `workspaceTemplate`, the Stack stays Ready while its workspace is
//! idle, and a Program edit wakes it without recreating what the stack deployed.

use std::time::Duration;

use k8s_openapi::api::apps::v1::StatefulSet;
use k8s_openapi::api::core::v1::{Event, Pod};
use kube::Api;
use kube::api::{ListParams, Patch, PatchParams, PostParams};
use pko_api::program::Program;
use pko_api::stack::{Stack, StackStatus};
use pko_api::workspace::Workspace;
use pko_tests::execution::Execution;
use pko_tests::fixtures::{self, labelled_config_map as config_map};
use pko_tests::kstatus;
use pko_tests::operator::{Operator, OperatorOptions};
use pko_tests::wait_for;
use serde_json::json;

const WAIT: Duration = Duration::from_secs(180);
/// Short, so the tests wait little for the pods to stop.
const IDLE_AFTER: &str = "3s";

/// `(status, reason)` of the Workspace's condition `type_`.
fn condition(ws: &Workspace, type_: &str) -> Option<(String, String)> {
    ws.status
        .as_ref()?
        .conditions
        .iter()
        .find(|c| c.type_ == type_)
        .map(|c| (c.status.clone(), c.reason.clone()))
}

fn idle_now(ws: &Workspace) -> bool {
    ws.status.as_ref().and_then(|s| s.observed_generation) == ws.metadata.generation
        && condition(ws, "Ready") == Some(("False".into(), "Idle".into()))
}

/// Waits for Workspace `name` to be idle at its current generation.
async fn until_idle(e: &Execution, name: &str) -> Workspace {
    let api: Api<Workspace> = Api::namespaced(e.plane.client(), &e.ns);
    let found = wait_for(&format!("workspace {name} to go idle"), WAIT, || async {
        api.get(name).await.ok().filter(idle_now)
    })
    .await;
    match found {
        Ok(ws) => ws,
        Err(err) => panic!(
            "{err}: {:?}\n{}",
            api.get(name).await.ok().and_then(|w| w.status),
            e.kubelet.logs(name)
        ),
    }
}

/// The workspace's pod is gone: no agent process in the harness, no Pod object, and its
/// StatefulSet at 0 replicas.
async fn assert_stopped(e: &Execution, name: &str) {
    let client = e.plane.client();
    wait_for("the agent process to stop", WAIT, || async {
        e.kubelet.agent_pid(name).is_none().then_some(())
    })
    .await
    .expect("no agent process");
    let pods: Api<Pod> = Api::namespaced(client.clone(), &e.ns);
    wait_for("the pod to be deleted", WAIT, || async {
        pods.get_opt(&format!("{name}-workspace-0"))
            .await
            .ok()?
            .is_none()
            .then_some(())
    })
    .await
    .expect("no pod");
    let sts: StatefulSet = Api::namespaced(client, &e.ns)
        .get(&format!("{name}-workspace"))
        .await
        .expect("statefulset");
    assert_eq!(sts.spec.and_then(|s| s.replicas), Some(0));
}

/// kstatus's verdict on the object at `kind_path`.
async fn kstatus_of(e: &Execution, kind_path: &str) -> kstatus::Health {
    let request = http::Request::get(kind_path)
        .body(Vec::new())
        .expect("request");
    let text = e
        .plane
        .client()
        .request_text(request)
        .await
        .expect("object");
    kstatus::compute(&text).expect("kstatus runs")
}

/// A metric of `operator` once it reads at least `at_least`.
async fn metric_at_least(operator: &Operator, series: &str, at_least: f64) -> f64 {
    wait_for(&format!("{series} >= {at_least}"), WAIT, || async {
        operator.metric(series).await.filter(|v| *v >= at_least)
    })
    .await
    .unwrap_or_else(|e| panic!("{e}"))
}

const PROGRAM: &str = r#"{"outputs": {"message": "hi"}}"#;

#[tokio::test]
async fn an_idle_workspace_stops_stays_stopped_across_a_restart_and_wakes_for_the_next_update() {
    let _machine = pko_tests::serial::shared().await;
    let mut e = Execution::start("idle-ws", &[]).await;
    let client = e.plane.client();
    let programs: Api<Program> = Api::namespaced(client.clone(), &e.ns);
    let (url, digest) = fixtures::published_program(
        &programs,
        "prog",
        serde_json::from_str(PROGRAM).expect("json"),
        WAIT,
    )
    .await
    .expect("artifact");
    let backend = e.tmp.path().join("backend");
    let workspaces: Api<Workspace> = Api::namespaced(client.clone(), &e.ns);
    workspaces
        .create(
            &PostParams::default(),
            &fixtures::workspace(
                "ws",
                json!({
                    "flux": {"url": url, "digest": digest},
                    "env": [
                        {"name": "PULUMI_BACKEND_URL", "value": format!("file://{}", backend.display())},
                        {"name": "PULUMI_CONFIG_PASSPHRASE", "value": fixtures::PASSPHRASE},
                    ],
                    "stacks": [{"name": "dev", "create": true}],
                    "idle": {"after": IDLE_AFTER},
                }),
            ),
        )
        .await
        .expect("create workspace");
    fixtures::ready_workspace(&workspaces, "ws", WAIT, || e.kubelet.logs("ws")).await;
    let first = fixtures::completed_update(
        client.clone(),
        &e.ns,
        ("ws", "dev"),
        "first",
        json!({"type": "up"}),
        WAIT,
        || e.kubelet.logs("ws"),
    )
    .await;
    let outputs = fixtures::update_outputs(client.clone(), &e.ns, &first).await;
    assert_eq!(outputs.get("message"), Some(&json!("hi")), "{first:?}");

    // No operation for the period: stopped, Ready=False reason Idle, nothing else.
    let ws = until_idle(&e, "ws").await;
    assert_stopped(&e, "ws").await;
    let status = ws.status.clone().expect("status");
    assert_eq!(status.address, None);
    assert_eq!(condition(&ws, "Reconciling"), None, "{status:?}");
    assert_eq!(condition(&ws, "Stalled"), None, "{status:?}");
    let path = format!(
        "/apis/auto.pulumi.com/v1alpha1/namespaces/{}/workspaces/ws",
        e.ns
    );
    // cli-utils' kstatus takes any `Ready=False` for progress (its `checkReadyCondition`), absent
    // `Reconciling`/`Stalled` or not: in progress with the Idle message, never failed.
    let health = kstatus_of(&e, &path).await;
    assert_eq!(health.status, "InProgress", "{health:?}");
    assert!(
        health.message.starts_with("no operation for 3s"),
        "{health:?}"
    );
    metric_at_least(&e.operator, "workspaces_idle", 1.0).await;
    let events: Api<Event> = Api::namespaced(client.clone(), &e.ns);
    let stopped_event = events
        .list(&ListParams::default())
        .await
        .expect("events")
        .items
        .into_iter()
        .any(|ev| {
            ev.reason.as_deref() == Some("Idle")
                && ev
                    .message
                    .as_deref()
                    .is_some_and(|m| m.contains("ws-workspace-0"))
        });
    assert!(stopped_event, "a Normal Event says the pod was stopped");

    // A restarted operator reads the workspace (and the finished Update) and leaves it stopped.
    e.operator.stop();
    let operator = Operator::start(
        e.plane,
        OperatorOptions {
            advertised: None,
            args: vec![
                format!("--watch-namespace={}", e.ns),
                "--workspace-localhost=127.0.0.1".into(),
            ],
        },
    )
    .await
    .expect("operator restarts");
    metric_at_least(
        &operator,
        "pko_reconcile_duration_seconds_count{controller=\"workspace\"}",
        1.0,
    )
    .await;
    metric_at_least(
        &operator,
        "pko_reconcile_duration_seconds_count{controller=\"update\"}",
        1.0,
    )
    .await;
    metric_at_least(&operator, "workspaces_idle", 1.0).await;
    let ws = workspaces.get("ws").await.expect("workspace");
    assert!(idle_now(&ws), "{:?}", ws.status);
    assert_stopped(&e, "ws").await;

    // The harness's new operator serves artifacts on a port of its own (a cluster's Service
    // keeps its address): the Workspace names it. A spec change does not start the pod either.
    workspaces
        .patch(
            "ws",
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": {"flux": {"url": operator.fs_url_of(&url)}}})),
        )
        .await
        .expect("new artifact address");
    let ws = until_idle(&e, "ws").await;
    assert_eq!(ws.metadata.generation, Some(2));
    assert_stopped(&e, "ws").await;

    // The next Update starts the pod again and runs on the state left before: the stack
    // `dev` is there (no `create` needed from the program's view) and keeps its outputs.
    let second = fixtures::completed_update(
        client.clone(),
        &e.ns,
        ("ws", "dev"),
        "second",
        json!({"type": "up"}),
        WAIT,
        || e.kubelet.logs("ws"),
    )
    .await;
    let failed = second
        .conditions
        .iter()
        .any(|c| c.type_ == "Failed" && c.status == "True");
    assert!(!failed, "{second:?}");
    let outputs = fixtures::update_outputs(client.clone(), &e.ns, &second).await;
    assert_eq!(outputs.get("message"), Some(&json!("hi")), "{second:?}");
    let woken = events
        .list(&ListParams::default())
        .await
        .expect("events")
        .items
        .into_iter()
        .any(|ev| {
            ev.reason.as_deref() == Some("Waking")
                && ev.message.as_deref().is_some_and(|m| m.contains("second"))
        });
    assert!(
        woken,
        "a Normal Event says the pod was started for the Update"
    );
    metric_at_least(&operator, "pko_workspace_wake_duration_seconds_count", 1.0).await;
    // And it goes idle again.
    until_idle(&e, "ws").await;
    assert_stopped(&e, "ws").await;
}

#[tokio::test]
async fn a_stack_stays_ready_while_its_workspace_is_idle_and_a_program_edit_wakes_it() {
    let _machine = pko_tests::serial::shared().await;
    let e = Execution::start("idle-stack", &[]).await;
    let client = e.plane.client();
    let programs: Api<Program> = Api::namespaced(client.clone(), &e.ns);
    let program = |outputs: serde_json::Value| {
        json!({
            "configuration": {"ns": {"type": "String"}},
            "resources": {"cm": config_map("idle", json!({"v": "kept"}))},
            "outputs": outputs,
        })
    };
    programs
        .create(
            &PostParams::default(),
            &fixtures::program("prog", program(json!({"first": "one"}))),
        )
        .await
        .expect("create program");
    let literal = |v: &str| json!({"type": "Literal", "literal": {"value": v}});
    let stacks: Api<Stack> = Api::namespaced(client.clone(), &e.ns);
    stacks
        .create(
            &PostParams::default(),
            &fixtures::file_backend_stack(
                "s",
                &e.tmp.path().join("backend"),
                json!({
                    "programRef": {"name": "prog"},
                    "config": {"ns": e.ns},
                    "envRefs": {
                        "PULUMI_CONFIG_PASSPHRASE": literal(fixtures::PASSPHRASE),
                        "KUBECONFIG": literal(&e.plane.kubeconfig_path().display().to_string()),
                    },
                    "workspaceTemplate": {"spec": {"idle": {"after": IDLE_AFTER}}},
                }),
            ),
        )
        .await
        .expect("create stack");
    let first = stack_until(&e, &stacks, "the first up", succeeded).await;
    let deployed = fixtures::labelled(client.clone(), &e.ns, "idle").await;
    assert_eq!(deployed.len(), 1, "{deployed:?}");
    let uid = deployed[0].metadata.uid.clone().expect("uid");

    // The workspace goes idle; the Stack stays Ready (and Current for kstatus).
    until_idle(&e, "s").await;
    assert_stopped(&e, "s").await;
    let stack = stacks.get("s").await.expect("stack");
    let status = stack.status.clone().expect("status");
    assert!(
        status
            .conditions
            .iter()
            .any(|c| c.type_ == "Ready" && c.status == "True"),
        "{status:?}"
    );
    let path = format!("/apis/pulumi.com/v1/namespaces/{}/stacks/s", e.ns);
    let health = kstatus_of(&e, &path).await;
    assert_eq!(health.status, "Current", "{health:?}");

    // A Program edit: a new artifact, a new Workspace spec, an Update that wakes the pod.
    programs
        .patch(
            "prog",
            &PatchParams::default(),
            &Patch::Merge(json!({"program": program(json!({"first": "one", "second": "two"}))})),
        )
        .await
        .expect("edit program");
    let second = stack_until(&e, &stacks, "an up after the edit", |s| {
        let name = succeeded(s)?;
        (name != first && s.outputs.contains_key("second")).then(|| s.clone())
    })
    .await;
    assert_eq!(
        second.outputs.get("first"),
        Some(&json!("one")),
        "{second:?}"
    );
    assert_eq!(
        second.outputs.get("second"),
        Some(&json!("two")),
        "{second:?}"
    );
    // The state from before the stop was used: the ConfigMap was not created again.
    let after = fixtures::labelled(client.clone(), &e.ns, "idle").await;
    assert_eq!(after.len(), 1, "{after:?}");
    assert_eq!(after[0].metadata.uid.as_deref(), Some(uid.as_str()));
    let data = after[0].data.clone().unwrap_or_default();
    assert_eq!(data.get("v").map(String::as_str), Some("kept"));
}

/// The name of the Stack's last update once it succeeded.
fn succeeded(s: &StackStatus) -> Option<String> {
    let last = s.last_update.as_ref()?;
    (last.state.as_deref() == Some("succeeded")).then(|| last.name.clone().unwrap_or_default())
}

/// Waits for what `check` finds in Stack `s`'s status, showing the status and the workspace's
/// logs when it never comes.
async fn stack_until<T>(
    e: &Execution,
    stacks: &Api<Stack>,
    what: &str,
    check: impl Fn(&StackStatus) -> Option<T>,
) -> T {
    let found = wait_for(what, WAIT, || async {
        check(&stacks.get("s").await.ok()?.status?)
    })
    .await;
    match found {
        Ok(found) => found,
        Err(err) => panic!(
            "{err}: {:?}\n{}",
            stacks.get("s").await.ok().and_then(|s| s.status),
            e.kubelet.logs("s")
        ),
    }
}
