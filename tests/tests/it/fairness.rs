//! Fairness between tenants on the real control plane, with the harness as kubelet and the
//! real agent and pulumi CLI: one namespace's sleeping Updates hold at most its share of the
//! operation slots, and an operation past its timeout is canceled at the agent.
//!
//! A "sleeping" Update runs a program that reads a named pipe nobody writes to yet.

use std::path::{Path, PathBuf};
use std::time::Duration;

use kube::Api;
use kube::api::PostParams;
use pko_api::program::Program;
use pko_api::stack::Stack;
use pko_api::update::Update;
use pko_api::workspace::Workspace;
use pko_tests::execution::Execution;
use pko_tests::kubelet::Kubelet;
use pko_tests::operator::{Operator, OperatorOptions};
use pko_tests::{ControlPlane, fifo, fixtures, wait_for};
use serde_json::{Value, json};

const WAIT: Duration = Duration::from_secs(120);
/// The operator's default operation slots, and a namespace's default share of them.
const SLOTS: usize = pko_operator::controller::update::DEFAULT_MAX_OPERATIONS_IN_FLIGHT as usize;
const SHARE: usize = SLOTS / 4;

/// Reads the file named by config `file` (a named pipe blocks the program until written to).
const PROGRAM: &str = r#"{
  "configuration": {"file": {"type": "String"}},
  "variables": {"content": {"fn::readFile": "${file}"}},
  "outputs": {"content": "${content}"}
}"#;

/// One tenant: a namespace, its kubelet, a state backend.
struct Tenant {
    ns: String,
    client: kube::Client,
    kubelet: Kubelet,
    tmp: tempfile::TempDir,
}

impl Tenant {
    async fn new(plane: &ControlPlane, prefix: &str) -> Self {
        let ns = plane.namespace(prefix).await.expect("namespace");
        let tmp = tempfile::tempdir().expect("tmp");
        std::fs::create_dir_all(tmp.path().join("backend")).expect("backend");
        let kubelet =
            Kubelet::start(plane.client(), &ns, &tmp.path().join("pods")).expect("kubelet");
        Self {
            ns,
            client: plane.client(),
            kubelet,
            tmp,
        }
    }

    fn updates(&self) -> Api<Update> {
        Api::namespaced(self.client.clone(), &self.ns)
    }

    /// The reader Program, and a ready Workspace `reader` whose stacks read `files` (stack
    /// name → file).
    async fn workspace(&self, files: &[(&str, &Path)]) {
        let programs: Api<Program> = Api::namespaced(self.client.clone(), &self.ns);
        let (url, digest) = fixtures::published_program(
            &programs,
            "reader",
            serde_json::from_str(PROGRAM).expect("json"),
            WAIT,
        )
        .await
        .expect("artifact");
        let stacks: Vec<Value> = files
            .iter()
            .map(|(name, file)| {
                json!({"name": name, "create": true,
                    "config": [{"key": "file", "value": file.display().to_string()}]})
            })
            .collect();
        let spec = json!({
            "flux": {"url": url, "digest": digest},
            "env": [
                {"name": "PULUMI_BACKEND_URL", "value": format!("file://{}", self.tmp.path().join("backend").display())},
                {"name": "PULUMI_CONFIG_PASSPHRASE", "value": "pko-tests"},
            ],
            "stacks": stacks,
        });
        let workspaces: Api<Workspace> = Api::namespaced(self.client.clone(), &self.ns);
        workspaces
            .create(&PostParams::default(), &fixtures::workspace("reader", spec))
            .await
            .expect("create workspace");
        let ready = wait_for("the workspace to be ready", WAIT, || async {
            let s = workspaces.get("reader").await.ok()?.status?;
            s.conditions
                .iter()
                .any(|c| c.type_ == "Ready" && c.status == "True")
                .then_some(())
        })
        .await;
        if let Err(e) = ready {
            panic!("{e}\n{}", self.kubelet.logs("reader"));
        }
    }

    async fn update(&self, name: &str, stack: &str, extra: Value) {
        let mut spec = json!({"workspaceName": "reader", "stackName": stack, "type": "up"});
        if let (Some(spec), Some(extra)) = (spec.as_object_mut(), extra.as_object()) {
            spec.extend(extra.clone());
        }
        let workspaces: Api<Workspace> = Api::namespaced(self.client.clone(), &self.ns);
        let uid = workspaces
            .get("reader")
            .await
            .expect("workspace reader")
            .metadata
            .uid
            .expect("uid");
        let update = fixtures::update(name, "reader", &uid, spec);
        self.updates()
            .create(&PostParams::default(), &update)
            .await
            .expect("create update");
    }

    /// The Update once `Complete=True`.
    async fn completed(&self, name: &str) -> Update {
        let api = self.updates();
        let result = wait_for(&format!("update {name} to complete"), WAIT, || async {
            let u = api.get(name).await.ok()?;
            is(&u, "Complete", "True").then_some(u)
        })
        .await;
        match result {
            Ok(u) => u,
            Err(e) => panic!(
                "{e}: {:?}\n{}",
                api.get(name).await.ok().and_then(|u| u.status),
                self.kubelet.logs("reader")
            ),
        }
    }
}

fn condition(u: &Update, type_: &str) -> Option<(String, String, String)> {
    u.status
        .as_ref()?
        .conditions
        .iter()
        .find(|c| c.type_ == type_)
        .map(|c| (c.status.clone(), c.reason.clone(), c.message.clone()))
}

fn is(u: &Update, type_: &str, status: &str) -> bool {
    condition(u, type_).is_some_and(|c| c.0 == status)
}

fn queued(u: &Update) -> Option<String> {
    condition(u, "Progressing").and_then(|(s, r, m)| (s == "False" && r == "Queued").then_some(m))
}

fn pipe(dir: &Path) -> PathBuf {
    let path = dir.join("pipe");
    fifo::make(&path).expect("mkfifo");
    path
}

/// An operator with the default operation slots (64, a namespace's share a quarter: 16),
/// watching tenants a and b. Tenant a starts 64 Updates (as many as there are slots) that sleep:
/// 16 hold slots (one runs at the agent, which runs one operation per workspace at a time; the
/// others wait for it), 48 wait with reason `Queued` and a message naming the namespace share.
/// Tenant b's Update then runs to the end at once, while a's are still held. Fed, a's 64 all
/// succeed: the queued ones lost nothing.
#[tokio::test]
async fn one_tenants_sleeping_updates_leave_another_tenants_update_running() {
    let _machine = pko_tests::serial::shared().await;
    let plane = ControlPlane::shared().await;
    let a = Tenant::new(plane, "fair-a").await;
    let b = Tenant::new(plane, "fair-b").await;
    let _operator = Operator::start(
        plane,
        OperatorOptions {
            advertised: None,
            args: vec![
                format!("--watch-namespaces={},{}", a.ns, b.ns),
                "--workspace-localhost=127.0.0.1".into(),
            ],
        },
    )
    .await
    .expect("operator");
    let a_pipe = pipe(a.tmp.path());
    let b_file = b.tmp.path().join("content.txt");
    std::fs::write(&b_file, "b\n").expect("file");
    a.workspace(&[("dev", &a_pipe)]).await;
    b.workspace(&[("dev", &b_file)]).await;

    let names: Vec<String> = (1..=SLOTS).map(|i| format!("sleep-{i:02}")).collect();
    for name in &names {
        a.update(name, "dev", json!({})).await;
    }
    // Every one of a's Updates is either running or queued, and stays so (nothing feeds the
    // pipe): the split is then final.
    let held = || async {
        let mut running = Vec::new();
        let mut waiting = Vec::new();
        for name in &names {
            let u = a.updates().get(name).await.ok()?;
            if let Some(message) = queued(&u) {
                waiting.push((name, message));
            } else if is(&u, "Progressing", "True") {
                running.push(name);
            } else {
                return None;
            }
        }
        Some((running, waiting))
    };
    let (running, waiting) = wait_for("tenant a's updates to run or queue", WAIT, held)
        .await
        .expect("held");
    assert_eq!(
        (running.len(), waiting.len()),
        (SHARE, SLOTS - SHARE),
        "tenant a holds its share of {SHARE} slots, the rest wait: running {running:?}, waiting {waiting:?}"
    );
    for (name, message) in &waiting {
        assert!(
            message.contains("--max-operations-in-flight-per-namespace") && message.contains(&a.ns),
            "{name}: {message}"
        );
    }

    b.update("other", "dev", json!({})).await;
    // Queued behind a's Updates is the failure this test is about: said at once.
    let other = wait_for("tenant b's update to complete", WAIT, || async {
        let u = b.updates().get("other").await.ok()?;
        if let Some(message) = queued(&u) {
            return Some(Err(message));
        }
        is(&u, "Complete", "True").then_some(Ok(u))
    })
    .await
    .expect("tenant b's update ends");
    let other = match other {
        Ok(u) => u,
        Err(message) => panic!("tenant b's update waits behind tenant a's: {message}"),
    };
    assert_eq!(
        condition(&other, "Failed").map(|c| (c.0, c.1)),
        Some(("False".into(), "UpdateSucceeded".into())),
        "{:?}\n{}",
        other.status,
        b.kubelet.logs("reader")
    );
    // a's are still held as they were: none ended, the same two wait.
    let (still_running, still_waiting) = held().await.expect("still held");
    assert_eq!(still_running, running);
    assert_eq!(
        still_waiting.iter().map(|w| w.0).collect::<Vec<_>>(),
        waiting.iter().map(|w| w.0).collect::<Vec<_>>()
    );

    let feeder = fifo::Feeder::start(a_pipe, "fed\n", WAIT * 4);
    for name in &names {
        let u = a.completed(name).await;
        assert_eq!(
            condition(&u, "Failed").map(|c| (c.0, c.1)),
            Some(("False".into(), "UpdateSucceeded".into())),
            "{name}: {:?}",
            u.status
        );
    }
    drop(feeder);
}

/// An Update whose `spec.operationTimeout` (3s) is shorter than the operator's
/// `--operation-timeout` (10m): its sleeping operation fails with `OperationTimedOut` and a
/// message naming the timeout, and is canceled at the agent. The proof of the cancel: the next
/// Update in the same Workspace, which the agent runs only once the first operation has ended,
/// then runs to the end though the pipe was never fed.
#[tokio::test]
async fn an_operation_past_its_timeout_fails_clearly_and_is_canceled_at_the_agent() {
    let _machine = pko_tests::serial::shared().await;
    let e = Execution::start("upd-timeout", &["--operation-timeout=10m"]).await;
    let tenant = Tenant {
        ns: e.ns.clone(),
        client: e.plane.client(),
        kubelet: e.kubelet,
        tmp: e.tmp,
    };
    let pipe = pipe(tenant.tmp.path());
    let file = tenant.tmp.path().join("content.txt");
    std::fs::write(&file, "after\n").expect("file");
    tenant.workspace(&[("dev", &pipe), ("other", &file)]).await;

    tenant
        .update("sleeper", "dev", json!({"operationTimeout": "3s"}))
        .await;
    let sleeper = tenant.completed("sleeper").await;
    let (failed, reason, message) = condition(&sleeper, "Failed").expect("failed");
    assert_eq!(
        (failed.as_str(), reason.as_str()),
        ("True", "OperationTimedOut"),
        "{message}\n{}",
        e.operator.log_text()
    );
    assert!(
        message.contains("timeout of 3s") && message.contains("--operation-timeout"),
        "{message}"
    );

    tenant.update("after", "other", json!({})).await;
    let after = tenant.completed("after").await;
    assert_eq!(
        condition(&after, "Failed").map(|c| (c.0, c.1)),
        Some(("False".into(), "UpdateSucceeded".into())),
        "{:?}\n{}",
        after.status,
        tenant.kubelet.logs("reader")
    );
}

/// A Stack sets its Updates' timeout through `spec.updateTemplate.spec.operationTimeout`: its
/// sleeping `up` fails with `OperationTimedOut`, and the Stack's `lastUpdate` says failed with
/// the timeout in its message.
#[tokio::test]
async fn a_stacks_operation_timeout_fails_its_update_and_the_stack_says_why() {
    let _machine = pko_tests::serial::shared().await;
    let e = Execution::start("stack-timeout", &[]).await;
    let client = e.plane.client();
    let programs: Api<Program> = Api::namespaced(client.clone(), &e.ns);
    programs
        .create(
            &PostParams::default(),
            &fixtures::program(
                "reader",
                serde_json::from_str::<Value>(PROGRAM).expect("json"),
            ),
        )
        .await
        .expect("create program");
    let pipe = pipe(e.tmp.path());
    let stacks: Api<Stack> = Api::namespaced(client.clone(), &e.ns);
    stacks
        .create(
            &PostParams::default(),
            &fixtures::file_backend_stack(
                "sleepy",
                &e.tmp.path().join("backend"),
                json!({
                    "programRef": {"name": "reader"},
                    "config": {"file": pipe.display().to_string()},
                    "updateTemplate": {"spec": {"operationTimeout": "3s"}},
                }),
            ),
        )
        .await
        .expect("create stack");
    let last = wait_for("the stack to record a failed update", WAIT, || async {
        let last = stacks.get("sleepy").await.ok()?.status?.last_update?;
        (last.state.as_deref() == Some("failed")).then_some(last)
    })
    .await
    .unwrap_or_else(|err| panic!("{err}\n{}", e.kubelet.logs("sleepy")));
    let message = last.message.clone().unwrap_or_default();
    assert!(message.contains("timeout of 3s"), "{last:?}");
    let update = Api::<Update>::namespaced(client, &e.ns)
        .get(last.name.as_deref().unwrap_or_default())
        .await
        .expect("the failed update");
    assert_eq!(
        condition(&update, "Failed").map(|c| (c.0, c.1)),
        Some(("True".into(), "OperationTimedOut".into())),
        "{:?}",
        update.status
    );
}
