//! A small fleet of Stacks, the invariants `make bench`'s Stack section (pko-bench-stacks)
//! measures the times of (issue 27), never times: N `programRef` Stacks on the real control
//! plane with the harness as kubelet, the real agent and pulumi CLI on a file backend.
//! - every Stack gets Ready with exactly one Update;
//! - an operator restart (SIGTERM, then a new process) with the fleet Ready installs nothing,
//!   initializes no workspace again, restarts no agent, and starts no Update;
//! - an idle resync window with `continueResyncOnCommitMatch` off starts no Update and no
//!   pulumi operation. Such a `programRef` Stack has no resync timer (in PKO neither: it waits
//!   for a Program change or the informer's resync), so the window is made of what does run
//!   while a fleet idles: every Workspace's periodic recheck, and a reconcile of every Stack
//!   (here brought by a label, as a relist or an informer resync brings one). The operator's
//!   own reconcile counters are the evidence that both ran.

use std::collections::BTreeMap;
use std::path::Path;
use std::time::Duration;

use kube::api::{ListParams, Patch, PatchParams, PostParams};
use kube::{Api, ResourceExt};
use pko_api::program::Program;
use pko_api::stack::{Stack, StackUpdateState};
use pko_api::update::Update;
use pko_tests::execution::Execution;
use pko_tests::fixtures;
use pko_tests::operator::{Operator, OperatorOptions};
use pko_tests::wait_for;
use serde_json::json;

/// The fleet: enough Stacks to run side by side, few enough for `make test`.
const N: usize = 3;
const WAIT: Duration = Duration::from_secs(300);
/// SIGTERM grace of the operator being restarted.
const STOP_GRACE: Duration = Duration::from_secs(30);
/// What the operator logs each time it has installed and initialized (or re-initialized) a
/// workspace's agent (the count pko-bench-workspaces reports).
const INITIALIZED: &str = "workspace initialized";
/// What the agent logs for each stack selection (a `pulumi stack select`/`init`).
const SELECTED: &str = "stack selected";
/// What the agent logs for each operation (`up`, `preview`, `refresh`, `destroy`).
const OPERATION: &str = "operation started";
/// The stack controller's and the workspace controller's names in the operator's metrics.
const STACKS: &str = "stack-controller";
const WORKSPACES: &str = "workspace-controller";

fn name(i: usize) -> String {
    format!("s{i}")
}

fn program(i: usize) -> serde_json::Value {
    json!({
        "configuration": {"greeting": {"type": "String"}},
        "outputs": {"message": format!("${{greeting}}-{i}")},
    })
}

/// Deployed: `Ready=True` for the current generation, and the last `up` succeeded.
fn deployed(stack: &Stack) -> Option<StackUpdateState> {
    let status = stack.status.as_ref()?;
    let last = status.last_update.clone()?;
    let ready = status.observed_generation == stack.metadata.generation
        && last.generation == stack.metadata.generation
        && status.current_update.is_none()
        && last.state.as_deref() == Some("succeeded")
        && status
            .conditions
            .iter()
            .any(|c| c.type_ == "Ready" && c.status == "True");
    ready.then_some(last)
}

/// Every Stack's last update once all N are deployed.
async fn all_deployed(stacks: &Api<Stack>) -> Option<BTreeMap<String, StackUpdateState>> {
    let list = stacks.list(&ListParams::default()).await.ok()?.items;
    let done: BTreeMap<String, StackUpdateState> = list
        .iter()
        .filter_map(|s| Some((s.name_any(), deployed(s)?)))
        .collect();
    (done.len() == N).then_some(done)
}

/// The names of the Updates of each Stack.
async fn updates(updates: &Api<Update>) -> BTreeMap<String, Vec<String>> {
    let mut by_stack: BTreeMap<String, Vec<String>> = (0..N).map(|i| (name(i), vec![])).collect();
    for u in updates
        .list(&ListParams::default())
        .await
        .expect("list updates")
        .items
    {
        let stack = u
            .labels()
            .get("pulumi.com/stack-name")
            .cloned()
            .unwrap_or_default();
        by_stack.entry(stack).or_default().push(u.name_any());
    }
    for names in by_stack.values_mut() {
        names.sort();
    }
    by_stack
}

/// How often every agent logged `what`, by Stack.
fn agent_logged(pods: &Path, what: &str) -> BTreeMap<String, usize> {
    (0..N)
        .map(|i| {
            let log = pods.join(format!("{}-workspace/agent.log", name(i)));
            let text = std::fs::read_to_string(log).unwrap_or_default();
            (name(i), text.matches(what).count())
        })
        .collect()
}

/// The sum of a metric's samples whose name and labels start with `prefix`.
fn metric_sum(text: &str, prefix: &str) -> f64 {
    text.lines()
        .filter(|l| l.starts_with(prefix))
        .filter_map(|l| l.rsplit_once(' ')?.1.parse::<f64>().ok())
        .sum()
}

/// What a controller of the operator has done and is doing.
#[derive(Debug, Clone, Copy, PartialEq)]
struct Progress {
    reconciles: f64,
    queued: f64,
    active: f64,
}

fn progress(text: &str, controller: &str) -> Progress {
    Progress {
        reconciles: metric_sum(
            text,
            &format!("controller_runtime_reconcile_total{{controller=\"{controller}\""),
        ),
        queued: metric_sum(text, &format!("workqueue_depth{{name=\"{controller}\"")),
        active: metric_sum(
            text,
            &format!("controller_runtime_active_workers{{controller=\"{controller}\""),
        ),
    }
}

/// Waits until both controllers have run at least `stacks` and `workspaces` reconciles in all
/// and have nothing queued or running: every object queued by then has been reconciled.
async fn quiet_after(operator: &Operator, stacks: f64, workspaces: f64, what: &str) {
    let reached = wait_for(what, WAIT, || async {
        let text = operator.metrics_text().await?;
        let s = progress(&text, STACKS);
        let w = progress(&text, WORKSPACES);
        let idle = |p: Progress| p.queued == 0.0 && p.active == 0.0;
        (s.reconciles >= stacks && w.reconciles >= workspaces && idle(s) && idle(w)).then_some(())
    })
    .await;
    if let Err(e) = reached {
        let text = operator.metrics_text().await.unwrap_or_default();
        panic!(
            "{e}: stacks {:?}, workspaces {:?}\n{}",
            progress(&text, STACKS),
            progress(&text, WORKSPACES),
            tail(&operator.log_text(), 60)
        );
    }
}

async fn reconciles(operator: &Operator, controller: &str) -> f64 {
    let text = operator
        .metrics_text()
        .await
        .expect("the operator's metrics");
    progress(&text, controller).reconciles
}

fn tail(text: &str, lines: usize) -> String {
    let all: Vec<&str> = text.lines().collect();
    all[all.len().saturating_sub(lines)..].join("\n")
}

#[tokio::test]
async fn a_fleet_deploys_once_and_a_restart_or_an_idle_resync_runs_nothing() {
    let _machine = pko_tests::serial::shared().await;
    let mut e = Execution::start("scale", &[]).await;
    let client = e.plane.client();
    let programs: Api<Program> = Api::namespaced(client.clone(), &e.ns);
    let stacks: Api<Stack> = Api::namespaced(client.clone(), &e.ns);
    let updates_api: Api<Update> = Api::namespaced(client.clone(), &e.ns);
    let backend = e.tmp.path().join("backend");
    let pods = e.tmp.path().join("pods");
    let pp = PostParams::default();
    for i in 0..N {
        programs
            .create(&pp, &fixtures::program(&name(i), program(i)))
            .await
            .expect("create program");
        let spec = json!({
            "programRef": {"name": name(i)},
            "config": {"greeting": name(i)},
            "continueResyncOnCommitMatch": false,
            "resyncFrequencySeconds": 60,
        });
        stacks
            .create(&pp, &fixtures::file_backend_stack(&name(i), &backend, spec))
            .await
            .expect("create stack");
    }

    // Every Stack Ready, with exactly one Update each.
    let first = match wait_for("every Stack deployed", WAIT, || all_deployed(&stacks)).await {
        Ok(first) => first,
        Err(err) => panic!(
            "{err}: {:?}\n{}\n{}",
            stacks.list(&ListParams::default()).await.map(|l| l
                .items
                .into_iter()
                .map(|s| s.status)
                .collect::<Vec<_>>()),
            e.kubelet.logs(&name(0)),
            tail(&e.operator.log_text(), 60)
        ),
    };
    let ran = updates(&updates_api).await;
    for (stack, names) in &ran {
        assert_eq!(names.len(), 1, "Stack {stack}: one Update, not {names:?}");
        assert_eq!(
            first[stack].name.as_ref(),
            names.first(),
            "Stack {stack}: its last update is its one Update"
        );
    }
    // The counters the checks below rest on see what they count.
    assert_eq!(
        e.operator.log_text().matches(INITIALIZED).count(),
        N,
        "one initialization per workspace"
    );
    let selected = agent_logged(&pods, SELECTED);
    let operations = agent_logged(&pods, OPERATION);
    for i in 0..N {
        assert!(selected[&name(i)] >= 1, "{selected:?}");
        assert_eq!(operations[&name(i)], 1, "one `up` each: {operations:?}");
    }
    let agents: Vec<Option<u32>> = (0..N).map(|i| e.kubelet.agent_pid(&name(i))).collect();

    // An operator restart with the fleet Ready: every Stack and Workspace reconciled by the
    // new process, nothing run.
    e.operator.terminate(STOP_GRACE);
    let restarted = Operator::start(
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
    .expect("the operator again");
    quiet_after(
        &restarted,
        N as f64,
        N as f64,
        "every Stack and Workspace reconciled by the new operator",
    )
    .await;
    let after_restart = all_deployed(&stacks).await;
    assert_eq!(
        after_restart.as_ref(),
        Some(&first),
        "every Stack Ready, its last update the same"
    );
    assert_eq!(
        restarted.log_text().matches(INITIALIZED).count(),
        0,
        "no workspace installed or initialized again:\n{}",
        tail(&restarted.log_text(), 60)
    );
    assert_eq!(updates(&updates_api).await, ran, "no Update started");
    assert_eq!(agent_logged(&pods, SELECTED), selected, "no stack selected");
    assert_eq!(agent_logged(&pods, OPERATION), operations, "no operation");
    let agents_now: Vec<Option<u32>> = (0..N).map(|i| e.kubelet.agent_pid(&name(i))).collect();
    assert_eq!(agents_now, agents, "no agent restarted");

    // The idle window: every Workspace rechecked on its own schedule, every Stack reconciled
    // with nothing changed.
    let stack_reconciles = reconciles(&restarted, STACKS).await;
    let workspace_reconciles = reconciles(&restarted, WORKSPACES).await;
    for i in 0..N {
        stacks
            .patch(
                &name(i),
                &PatchParams::default(),
                &Patch::Merge(json!({"metadata": {"labels": {"resync": "idle"}}})),
            )
            .await
            .expect("label the stack");
    }
    quiet_after(
        &restarted,
        stack_reconciles + N as f64,
        workspace_reconciles + N as f64,
        "every Stack reconciled again and every Workspace rechecked",
    )
    .await;
    assert_eq!(
        all_deployed(&stacks).await.as_ref(),
        Some(&first),
        "every Stack Ready, its last update (and resync time) the same"
    );
    assert_eq!(updates(&updates_api).await, ran, "no Update started");
    assert_eq!(restarted.log_text().matches(INITIALIZED).count(), 0);
    assert_eq!(agent_logged(&pods, SELECTED), selected, "no stack selected");
    assert_eq!(agent_logged(&pods, OPERATION), operations, "no operation");
}
