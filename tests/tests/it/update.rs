//! Update controller on the real control plane, with the harness as kubelet and the real agent
//! and pulumi CLI: outputs Secret and PKO's conditions, failures, a killed agent mid-update.

use std::path::Path;
use std::time::Duration;

use k8s_openapi::api::core::v1::Secret;
use kube::Api;
use kube::api::PostParams;
use pko_api::program::Program;
use pko_api::update::Update;
use pko_api::workspace::Workspace;
use pko_tests::execution::Execution;
use pko_tests::fixtures;
use pko_tests::kubelet::Kubelet;
use pko_tests::operator::{Operator, OperatorOptions, metric_value};
use pko_tests::{ControlPlane, fifo, wait_for};
use serde_json::{Value, json};

const WAIT: Duration = Duration::from_secs(120);

struct Env {
    ns: String,
    client: kube::Client,
    operator: Operator,
    kubelet: Kubelet,
    tmp: tempfile::TempDir,
}

async fn env(prefix: &str) -> Env {
    env_with(prefix, &[]).await
}

/// [`env`] with more operator arguments.
async fn env_with(prefix: &str, operator_args: &[&str]) -> Env {
    let e = Execution::start(prefix, operator_args).await;
    Env {
        ns: e.ns,
        client: e.plane.client(),
        operator: e.operator,
        kubelet: e.kubelet,
        tmp: e.tmp,
    }
}

/// Reads the file named by config `file` (a named pipe blocks the program until written to).
const PROGRAM: &str = r#"{
  "configuration": {"file": {"type": "String"}, "password": {"type": "String", "default": "pw"}},
  "variables": {"content": {"fn::readFile": "${file}"}},
  "outputs": {"content": "${content}", "with whitespace": {"fn::secret": "${password}"}, "count": 3}
}"#;

impl Env {
    fn client(&self) -> kube::Client {
        self.client.clone()
    }

    async fn program(&self) -> (String, String) {
        let api: Api<Program> = Api::namespaced(self.client(), &self.ns);
        fixtures::published_program(
            &api,
            "reader",
            serde_json::from_str(PROGRAM).expect("json"),
            WAIT,
        )
        .await
        .expect("artifact")
    }

    fn workspace_spec(&self, url: &str, digest: &str, file: &Path) -> Value {
        json!({
            "flux": {"url": url, "digest": digest},
            "env": [
                {"name": "PULUMI_BACKEND_URL", "value": format!("file://{}", self.tmp.path().join("backend").display())},
                {"name": "PULUMI_CONFIG_PASSPHRASE", "value": "pko-tests"},
            ],
            "stacks": [{"name": "dev", "create": true, "config": [{"key": "file", "value": file.display().to_string()}]}],
        })
    }

    async fn workspace(&self, url: &str, digest: &str, file: &Path) {
        self.workspace_with_agent_env(url, digest, file, &[]).await;
    }

    /// [`Env::workspace`] with variables in the agent container's own env (its limits), set
    /// through the pod template.
    async fn workspace_with_agent_env(
        &self,
        url: &str,
        digest: &str,
        file: &Path,
        agent_env: &[(&str, &str)],
    ) {
        let api: Api<Workspace> = Api::namespaced(self.client(), &self.ns);
        let mut spec = self.workspace_spec(url, digest, file);
        if !agent_env.is_empty() {
            let env: Vec<Value> = agent_env
                .iter()
                .map(|(name, value)| json!({"name": name, "value": value}))
                .collect();
            spec["podTemplate"] = json!({"spec": {"containers": [{"name": "pulumi", "env": env}]}});
        }
        let ws = fixtures::workspace("reader", spec);
        api.create(&PostParams::default(), &ws)
            .await
            .expect("create workspace");
        self.wait_workspace(1).await;
    }

    async fn wait_workspace(&self, generation: i64) {
        let api: Api<Workspace> = Api::namespaced(self.client(), &self.ns);
        let result = wait_for("the workspace to be ready", WAIT, || async {
            let ws = api.get("reader").await.ok()?;
            let s = ws.status?;
            (s.observed_generation == Some(generation)
                && s.conditions
                    .iter()
                    .any(|c| c.type_ == "Ready" && c.status == "True"))
            .then_some(())
        })
        .await;
        if let Err(e) = result {
            panic!(
                "{e}: {:?}\n{}",
                api.get("reader").await.ok().and_then(|w| w.status),
                self.kubelet.logs("reader")
            );
        }
    }

    async fn update(&self, name: &str, type_: &str) -> Api<Update> {
        self.update_with(
            name,
            json!({"workspaceName": "reader", "stackName": "dev", "type": type_}),
        )
        .await
    }

    /// Creates Update `name` with `spec`, controlled by the Workspace `reader`.
    async fn update_with(&self, name: &str, spec: Value) -> Api<Update> {
        let api: Api<Update> = Api::namespaced(self.client(), &self.ns);
        let uid = self.reader_uid().await;
        api.create(
            &PostParams::default(),
            &fixtures::update(name, "reader", &uid, spec),
        )
        .await
        .expect("create update");
        api
    }

    async fn reader_uid(&self) -> String {
        let workspaces: Api<Workspace> = Api::namespaced(self.client(), &self.ns);
        workspaces
            .get("reader")
            .await
            .expect("workspace reader")
            .metadata
            .uid
            .expect("uid")
    }

    async fn completed(&self, api: &Api<Update>, name: &str) -> Update {
        let result = wait_for(&format!("update {name} to complete"), WAIT, || async {
            let u = api.get(name).await.ok()?;
            u.status
                .as_ref()?
                .conditions
                .iter()
                .any(|c| c.type_ == "Complete" && c.status == "True")
                .then_some(u)
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

fn condition(u: &Update, type_: &str) -> (String, String, String) {
    let c = u
        .status
        .as_ref()
        .and_then(|s| s.conditions.iter().find(|c| c.type_ == type_))
        .unwrap_or_else(|| panic!("no {type_} condition: {:?}", u.status));
    (c.status.clone(), c.reason.clone(), c.message.clone())
}

/// Whether some file below `dir` (at any depth) satisfies `pred`.
fn any_file(dir: &Path, pred: &dyn Fn(&Path) -> bool) -> bool {
    std::fs::read_dir(dir)
        .into_iter()
        .flatten()
        .flatten()
        .any(|entry| {
            let path = entry.path();
            if path.is_dir() {
                any_file(&path, pred)
            } else {
                pred(&path)
            }
        })
}

/// Whether pulumi holds a lock on a stack of the file backend at `backend`
/// (`.pulumi/locks/<org>/<project>/<stack>/<id>.json`).
fn stack_locked(backend: &Path) -> bool {
    any_file(&backend.join(".pulumi/locks"), &|path| {
        path.extension().is_some_and(|e| e == "json")
    })
}

/// Whether the file backend at `backend` is part way through a write: a temporary file, or an
/// empty metadata sidecar (gocloud's fileblob renames the data into place but writes its
/// `.attrs` in place, so a kill at that moment leaves a stack the CLI cannot load: "failed to
/// load checkpoint: EOF").
fn backend_writing(backend: &Path) -> bool {
    any_file(&backend.join(".pulumi"), &|path| {
        let name = path.file_name().unwrap_or_default().to_string_lossy();
        name.ends_with(".tmp")
            || (name.ends_with(".attrs") && std::fs::metadata(path).is_ok_and(|m| m.len() == 0))
    })
}

#[tokio::test]
async fn up_preview_destroy_with_outputs_secret_and_pko_conditions() {
    let _machine = pko_tests::serial::shared().await;
    let env = env("upd-ok").await;
    let (url, digest) = env.program().await;
    let plain = env.tmp.path().join("plain.txt");
    std::fs::write(&plain, "hi\n").expect("plain");
    env.workspace(&url, &digest, &plain).await;

    let api = env.update("up-1", "up").await;
    let up = env.completed(&api, "up-1").await;
    assert_eq!(condition(&up, "Failed").0, "False", "{:?}", up.status);
    assert_eq!(condition(&up, "Failed").1, "UpdateSucceeded");
    assert_eq!(condition(&up, "Complete").1, "Updated");
    assert_eq!(condition(&up, "Progressing").0, "False");
    let status = up.status.clone().expect("status");
    assert_eq!(status.outputs.as_deref(), Some("up-1-stack-outputs"));
    assert!(status.start_time.is_some() && status.end_time.is_some());
    assert_eq!(
        status.project_info.as_ref().map(|p| p.name.as_str()),
        Some("reader")
    );
    assert!(
        status
            .message
            .as_deref()
            .is_some_and(|m| m.contains("create: 1")),
        "{:?}",
        status.message
    );

    let secrets: Api<Secret> = Api::namespaced(env.client(), &env.ns);
    let secret = secrets
        .get("up-1-stack-outputs")
        .await
        .expect("outputs secret");
    assert_eq!(secret.immutable, Some(true));
    let annotations = secret.metadata.annotations.clone().unwrap_or_default();
    assert_eq!(
        annotations.get("pulumi.com/secrets").map(String::as_str),
        Some(r#"["with_whitespace"]"#)
    );
    let labels = secret.metadata.labels.clone().unwrap_or_default();
    assert_eq!(
        labels
            .get("auto.pulumi.com/update-name")
            .map(String::as_str),
        Some("up-1")
    );
    let data = secret.data.unwrap_or_default();
    let value = |k: &str| serde_json::from_slice::<Value>(&data[k].0).expect("json");
    assert_eq!(value("content"), json!("hi\n"));
    assert_eq!(value("with_whitespace"), json!("pw"));
    assert_eq!(value("count"), json!(3));

    let preview = env.update("preview-1", "preview").await;
    let p = env.completed(&preview, "preview-1").await;
    assert_eq!(condition(&p, "Failed").1, "UpdateSucceeded");
    assert!(p.status.as_ref().and_then(|s| s.outputs.clone()).is_none());

    let destroy = env.update("destroy-1", "destroy").await;
    let d = env.completed(&destroy, "destroy-1").await;
    assert_eq!(
        condition(&d, "Failed").1,
        "UpdateSucceeded",
        "{:?}",
        d.status
    );
    assert!(
        d.status
            .as_ref()
            .and_then(|s| s.message.clone())
            .is_some_and(|m| m.contains("delete: 1")),
        "{:?}",
        d.status
    );
}

#[tokio::test]
async fn a_failing_program_fails_the_update_with_the_cli_diagnosis() {
    let _machine = pko_tests::serial::shared().await;
    let env = env("upd-fail").await;
    let (url, digest) = env.program().await;
    env.workspace(&url, &digest, &env.tmp.path().join("does-not-exist.txt"))
        .await;
    let api = env.update("up-bad", "up").await;
    let up = env.completed(&api, "up-bad").await;
    let (failed, reason, message) = condition(&up, "Failed");
    assert_eq!(
        (failed.as_str(), reason.as_str()),
        ("True", "Unknown"),
        "{message}"
    );
    assert!(
        message.contains("up failed") && message.contains("does-not-exist.txt"),
        "{message}"
    );
    assert_eq!(condition(&up, "Complete").1, "Failed");

    // As PKO: an Update without an operation is refused, and one without a controller owner
    // (made without one, or orphaned from its Workspace) is canceled; neither starts.
    env.update_with(
        "no-type",
        json!({"workspaceName": "reader", "stackName": "dev"}),
    )
    .await;
    let ownerless: Update = serde_json::from_value(json!({
        "apiVersion": "auto.pulumi.com/v1alpha1", "kind": "Update",
        "metadata": {"name": "ownerless"},
        "spec": {"workspaceName": "reader", "stackName": "dev", "type": "up"},
    }))
    .expect("update");
    api.create(&PostParams::default(), &ownerless)
        .await
        .expect("create");
    for (name, reason, says) in [
        ("no-type", "InvalidSpec", "spec.type is required"),
        ("ownerless", "Canceled", "no controller owner"),
    ] {
        let u = env.completed(&api, name).await;
        let (failed, got, message) = condition(&u, "Failed");
        assert_eq!(
            (failed.as_str(), got.as_str()),
            ("True", reason),
            "{message}"
        );
        assert!(message.contains(says), "{message}");
        let status = u.status.expect("status");
        assert!(
            status.start_time.is_none(),
            "{name} never started: {status:?}"
        );
    }
}

#[tokio::test]
async fn a_killed_agent_fails_the_update_clearly_and_the_workspace_recovers() {
    let _machine = pko_tests::serial::shared().await;
    killed_agent_then_next_update(
        "upd-kill",
        false,
        "released the stack lock left by an agent that stopped during an operation",
    )
    .await;
}

/// A re-created pod has a fresh volume, so no marker: the locks taken under this pod's host name
/// are recognised in the CLI's refusal instead.
#[tokio::test]
async fn a_recreated_pod_releases_the_locks_of_its_predecessor() {
    let _machine = pko_tests::serial::shared().await;
    killed_agent_then_next_update(
        "upd-recreated",
        true,
        "released stack locks left by an earlier pod of this workspace",
    )
    .await;
}

/// Kills the agent during `up`, optionally loses its volume's marker, then requires the next
/// `up` to succeed and the agent log to say `released`.
async fn killed_agent_then_next_update(prefix: &str, lose_marker: bool, released: &str) {
    let env = env(prefix).await;
    let (url, digest) = env.program().await;
    let pipe = env.tmp.path().join("pipe");
    fifo::make(&pipe).expect("mkfifo");
    env.workspace(&url, &digest, &pipe).await;

    let api = env.update("up-blocked", "up").await;
    wait_for("pulumi up to start", WAIT, || async {
        env.kubelet
            .logs("reader")
            .contains("operation started")
            .then_some(())
    })
    .await
    .expect("operation started");
    // "operation started" is logged before pulumi runs: kill only once pulumi holds the stack
    // lock (it keeps it, as the program blocks on the pipe), since a lock left behind is the
    // point; and only once the program waits on the pipe with no backend write half done (the
    // stack's registration writes the checkpoint just before), which a real kill could
    // interrupt too but this test is not about.
    let backend = env.tmp.path().join("backend");
    wait_for(
        "the program blocked on the pipe, the stack locked",
        WAIT,
        || async {
            let blocked = env
                .kubelet
                .agent_pid("reader")
                .is_some_and(fifo::reader_waiting_below);
            (blocked && stack_locked(&backend) && !backend_writing(&backend)).then_some(())
        },
    )
    .await
    .expect("stack locked");
    assert!(env.kubelet.kill_agent("reader"));

    let up = env.completed(&api, "up-blocked").await;
    let (failed, reason, message) = condition(&up, "Failed");
    assert_eq!(
        (failed.as_str(), reason.as_str()),
        ("True", "AgentUnavailable"),
        "{message}"
    );
    assert!(
        message.contains("connection to the workspace agent was lost"),
        "{message}"
    );

    // The kubelet restarts the agent; the workspace becomes ready again with the new one.
    let pid = env.kubelet.agent_pid("reader");
    wait_for("a restarted agent", WAIT, || async {
        env.kubelet.agent_pid("reader").filter(|p| Some(*p) != pid)
    })
    .await
    .ok();
    env.wait_workspace(1).await;
    if lose_marker {
        let marker = env
            .tmp
            .path()
            .join("pods/reader-workspace/volumes/share/workspace")
            .join(pko_agent::inflight::MARKER);
        std::fs::remove_file(&marker)
            .unwrap_or_else(|e| panic!("the dead run's marker {}: {e}", marker.display()));
    }

    // The next update recovers: the lock the dead run left on the stack is released first.
    let feeder = fifo::Feeder::start(pipe, "fed\n", WAIT);
    let api = env.update("up-after-crash", "up").await;
    let up = env.completed(&api, "up-after-crash").await;
    let (failed, reason, message) = condition(&up, "Failed");
    assert_eq!(
        (failed.as_str(), reason.as_str()),
        ("False", "UpdateSucceeded"),
        "{message}\n{}",
        env.kubelet.logs("reader")
    );
    drop(feeder);
    assert!(
        env.kubelet.logs("reader").contains(released),
        "{}",
        env.kubelet.logs("reader")
    );
}

/// An agent restarted where nothing has noticed yet (the kubelet's report is late, so the
/// Workspace still shows its old `Ready=True`): an Update created then does not run on the new
/// agent until the Workspace has told it the environment and stacks again, and succeeds. Before,
/// it ran at once on an agent without its environment (no backend URL: "PULUMI_ACCESS_TOKEN
/// must be set") and failed.
#[tokio::test]
async fn an_update_waits_for_a_restarted_agent_to_be_initialized_again() {
    let _machine = pko_tests::serial::shared().await;
    let env = env("upd-restart").await;
    let (url, digest) = env.program().await;
    let plain = env.tmp.path().join("plain.txt");
    std::fs::write(&plain, "hi\n").expect("plain");
    env.workspace(&url, &digest, &plain).await;
    // The Workspace controller's own writes of its status make it look once more; the restart
    // comes once a look found the agent told everything (and so wrote nothing) and none is
    // queued or running: nothing is left to make it look again.
    let controller = r#"{controller="workspace-controller"}"#;
    let queue = r#"{name="workspace-controller",controller="workspace-controller"}"#;
    wait_for("the workspace controller to settle", WAIT, || async {
        let told = env
            .operator
            .log_text()
            .contains("the agent knows the workspace already");
        let text = env.operator.metrics_text().await?;
        let value = |series: String| metric_value(&text, &series);
        (told
            && value(format!("controller_runtime_active_workers{controller}"))? == 0.0
            && value(format!("workqueue_depth{queue}"))? == 0.0)
            .then_some(())
    })
    .await
    .expect("the workspace controller settles");
    let workspaces: Api<Workspace> = Api::namespaced(env.client(), &env.ns);
    let before = workspaces.get("reader").await.expect("workspace").status;
    let pid = env.kubelet.agent_pid("reader");
    assert!(env.kubelet.restart_agent_unreported("reader"));
    wait_for("the restarted agent", WAIT, || async {
        env.kubelet.agent_pid("reader").filter(|p| Some(*p) != pid)
    })
    .await
    .expect("restarted");
    // Nothing was reported: the Workspace still says what it said of the old agent.
    let after = workspaces.get("reader").await.expect("workspace").status;
    assert_eq!(after, before, "the restart is not visible in the Workspace");

    let api = env.update("up-after-restart", "up").await;
    let up = env.completed(&api, "up-after-restart").await;
    let (failed, reason, message) = condition(&up, "Failed");
    assert_eq!(
        (failed.as_str(), reason.as_str()),
        ("False", "UpdateSucceeded"),
        "{message}\n{}",
        env.kubelet.logs("reader")
    );
    // The new agent was told its environment before the operation ran.
    let log = std::fs::read_to_string(env.tmp.path().join("pods/reader-workspace/agent.log"))
        .expect("agent log");
    let told = log.rfind("environment variables set").expect("told");
    let ran = log.rfind("operation started").expect("ran");
    assert!(told < ran, "{log}");
}

#[tokio::test]
async fn an_update_in_flight_when_the_operator_restarts_is_resumed_not_aborted() {
    let _machine = pko_tests::serial::shared().await;
    let mut env = env("upd-resume").await;
    let (url, digest) = env.program().await;
    let pipe = env.tmp.path().join("pipe");
    fifo::make(&pipe).expect("mkfifo");
    env.workspace(&url, &digest, &pipe).await;

    let api = env.update("up-resumed", "up").await;
    wait_for("pulumi up to start", WAIT, || async {
        env.kubelet
            .logs("reader")
            .contains("operation started")
            .then_some(())
    })
    .await
    .expect("operation started");
    wait_for("the update to be Progressing", WAIT, || async {
        let u = api.get("up-resumed").await.ok()?;
        (condition(&u, "Progressing").0 == "True").then_some(())
    })
    .await
    .expect("progressing");

    // The operator dies mid-operation; the agent interrupts the run it was streaming.
    env.operator.stop();
    wait_for("the agent to interrupt pulumi", WAIT, || async {
        env.kubelet
            .logs("reader")
            .contains("interrupting pulumi")
            .then_some(())
    })
    .await
    .expect("interrupted");
    let plane = ControlPlane::shared().await;
    env.operator = Operator::start(
        plane,
        OperatorOptions {
            advertised: None,
            args: vec![
                format!("--watch-namespace={}", env.ns),
                "--workspace-localhost=127.0.0.1".into(),
            ],
        },
    )
    .await
    .expect("operator restarts");
    // Feed every read: the interrupted run may read once to finish canceling; the resumed run reads.
    let feeder = fifo::Feeder::start(pipe, "fed\n", WAIT);
    let up = env.completed(&api, "up-resumed").await;
    let (failed, reason, message) = condition(&up, "Failed");
    assert_eq!(
        (failed.as_str(), reason.as_str()),
        ("False", "UpdateSucceeded"),
        "{message}"
    );
    assert_eq!(
        up.status.as_ref().and_then(|s| s.outputs.as_deref()),
        Some("up-resumed-stack-outputs")
    );
    drop(feeder);
    let events: Api<k8s_openapi::api::events::v1::Event> = Api::namespaced(env.client(), &env.ns);
    let resumed = events
        .list(&Default::default())
        .await
        .expect("events")
        .items
        .iter()
        .any(|e| e.reason.as_deref() == Some("Resumed"));
    assert!(resumed, "a Resumed event explains the second run");
}

#[tokio::test]
async fn a_completed_update_is_deleted_after_its_ttl() {
    let _machine = pko_tests::serial::shared().await;
    let env = env("upd-ttl").await;
    let (url, digest) = env.program().await;
    let plain = env.tmp.path().join("plain.txt");
    std::fs::write(&plain, "hi\n").expect("plain");
    env.workspace(&url, &digest, &plain).await;
    let api = env
        .update_with(
            "short-lived",
            json!({"workspaceName": "reader", "stackName": "dev", "type": "preview", "ttlAfterCompleted": "2s"}),
        )
        .await;
    env.completed(&api, "short-lived").await;
    wait_for("the expired update to be deleted", WAIT, || async {
        api.get_opt("short-lived")
            .await
            .ok()?
            .is_none()
            .then_some(())
    })
    .await
    .expect("deleted after its ttl");
}

/// `text` ends with the agent's marker after at most `max` bytes: the bytes it says were cut.
fn cut_at(text: &str, max: usize) -> Option<usize> {
    let at = text.rfind("… [truncated ")?;
    let (kept, marker) = text.split_at(at);
    assert!(kept.len() <= max, "{} bytes kept, over {max}", kept.len());
    marker
        .strip_prefix("… [truncated ")?
        .strip_suffix(" bytes]")?
        .parse()
        .ok()
}

/// A 3 MiB output (over the agent's default 512 KiB per value, and over what one Secret can
/// hold) is stored cut, with the marker, and the Update succeeds.
#[tokio::test]
async fn an_output_over_the_agent_bound_is_stored_cut_with_a_marker() {
    let _machine = pko_tests::serial::shared().await;
    let env = env("upd-bigout").await;
    let (url, digest) = env.program().await;
    let big = env.tmp.path().join("big.txt");
    let content = "y".repeat(3 * 1024 * 1024);
    std::fs::write(&big, &content).expect("big file");
    env.workspace(&url, &digest, &big).await;

    let api = env.update("up-big", "up").await;
    let up = env.completed(&api, "up-big").await;
    let (failed, reason, message) = condition(&up, "Failed");
    assert_eq!(
        (failed.as_str(), reason.as_str()),
        ("False", "UpdateSucceeded"),
        "{message}"
    );
    let secrets: Api<Secret> = Api::namespaced(env.client(), &env.ns);
    let data = secrets
        .get("up-big-stack-outputs")
        .await
        .expect("outputs secret")
        .data
        .unwrap_or_default();
    let stored: Value = serde_json::from_slice(&data["content"].0).expect("json");
    let stored = stored.as_str().expect("a string");
    let cut = cut_at(stored, 512 * 1024).expect("the stored value carries the marker");
    let kept = stored.rfind("… [truncated ").expect("marker");
    assert_eq!(kept + cut, content.len(), "the marker counts what was cut");
    assert!(stored.starts_with(&content[..512 * 1024]));
    // The other outputs are whole.
    assert_eq!(
        serde_json::from_slice::<Value>(&data["count"].0).expect("json"),
        json!(3)
    );
}

/// One output allowed up to 16 MiB by the agent's env (pod template), and a 17 MiB file: the answer cannot
/// travel. The Update fails once, with ResponseTooLarge and the sizes; the operator stays up and
/// does not run the operation again.
#[tokio::test]
async fn an_answer_over_the_message_limit_fails_the_update_cleanly() {
    let _machine = pko_tests::serial::shared().await;
    let env = env("upd-toolarge").await;
    let (url, digest) = env.program().await;
    let big = env.tmp.path().join("big.txt");
    std::fs::write(&big, "z".repeat(17 * 1024 * 1024)).expect("big file");
    env.workspace_with_agent_env(
        &url,
        &digest,
        &big,
        &[("AGENT_MAX_OUTPUT_VALUE_BYTES", "16777216")],
    )
    .await;

    let api = env.update("up-huge", "up").await;
    let up = env.completed(&api, "up-huge").await;
    let (failed, reason, message) = condition(&up, "Failed");
    assert_eq!(
        (failed.as_str(), reason.as_str()),
        ("True", "ResponseTooLarge"),
        "{message}\n{}",
        env.kubelet.logs("reader")
    );
    assert!(message.contains("16777216-byte message limit"), "{message}");
    assert_eq!(condition(&up, "Complete").0, "True");
    assert!(
        up.status
            .as_ref()
            .and_then(|s| s.outputs.as_ref())
            .is_none(),
        "no outputs Secret is named"
    );
    let ready = reqwest::get(env.operator.probe_url("/readyz"))
        .await
        .expect("the operator answers");
    assert!(ready.status().is_success(), "{}", env.operator.log_text());
    let logs = env.kubelet.logs("reader");
    assert_eq!(
        logs.matches("operation started").count(),
        1,
        "the operation ran once:\n{logs}"
    );
}

/// With `--max-operations-in-flight=1`, a second Update waits (Progressing False, reason
/// Queued) while the first runs, then runs when it ends; neither fails.
#[tokio::test]
async fn updates_beyond_the_in_flight_bound_wait_queued_then_run() {
    let _machine = pko_tests::serial::shared().await;
    let env = env_with("upd-queue", &["--max-operations-in-flight=1"]).await;
    let (url, digest) = env.program().await;
    let pipe = env.tmp.path().join("pipe");
    fifo::make(&pipe).expect("mkfifo");
    env.workspace(&url, &digest, &pipe).await;

    let api = env.update("up-first", "up").await;
    let progressing = |u: &Update| {
        u.status
            .as_ref()?
            .conditions
            .iter()
            .find(|c| c.type_ == "Progressing")
            .map(|c| (c.status.clone(), c.reason.clone(), c.message.clone()))
    };
    wait_for("the first update to be Progressing", WAIT, || async {
        let u = api.get("up-first").await.ok()?;
        (progressing(&u)?.0 == "True").then_some(())
    })
    .await
    .expect("progressing");
    env.update("up-second", "up").await;
    let queued = wait_for("the second update to be queued", WAIT, || async {
        let u = api.get("up-second").await.ok()?;
        let (status, reason, message) = progressing(&u)?;
        (status == "False" && reason == "Queued").then_some(message)
    })
    .await
    .expect("queued");
    assert!(queued.contains("--max-operations-in-flight"), "{queued}");
    // Still queued while the first one is blocked on the pipe.
    let first = api.get("up-first").await.expect("first");
    assert_eq!(condition(&first, "Progressing").0, "True");

    let feeder = fifo::Feeder::start(pipe, "fed\n", WAIT);
    for name in ["up-first", "up-second"] {
        let u = env.completed(&api, name).await;
        let (failed, reason, message) = condition(&u, "Failed");
        assert_eq!(
            (failed.as_str(), reason.as_str()),
            ("False", "UpdateSucceeded"),
            "{name}: {message}"
        );
    }
    drop(feeder);
}

/// An `<update>-stack-outputs` Secret already there: a tenant's own (no controller reference to
/// the Update) is left as it is and the Update fails with OutputsUnavailable saying why; one
/// controlled by the Update (left by an interrupted run) is replaced.
#[tokio::test]
async fn an_outputs_secret_is_replaced_only_when_it_is_the_updates_own() {
    let _machine = pko_tests::serial::shared().await;
    let env = env("upd-owned").await;
    let (url, digest) = env.program().await;
    let pipe = env.tmp.path().join("pipe");
    fifo::make(&pipe).expect("mkfifo");
    env.workspace(&url, &digest, &pipe).await;
    let secrets: Api<Secret> = Api::namespaced(env.client(), &env.ns);
    let secret = |name: &str, owner: Option<Value>| -> Secret {
        let mut metadata = json!({"name": name});
        if let Some(owner) = owner {
            metadata["ownerReferences"] = json!([owner]);
        }
        serde_json::from_value(json!({
            "apiVersion": "v1", "kind": "Secret", "metadata": metadata,
            "stringData": {"content": "\"stale\""},
        }))
        .expect("secret")
    };

    let foreign = secrets
        .create(
            &PostParams::default(),
            &secret("up-foreign-stack-outputs", None),
        )
        .await
        .expect("a tenant's secret");
    let feeder = fifo::Feeder::start(pipe.clone(), "fed\n", WAIT);
    let api = env.update("up-foreign", "up").await;
    let up = env.completed(&api, "up-foreign").await;
    drop(feeder);
    let (failed, reason, message) = condition(&up, "Failed");
    assert_eq!(
        (failed.as_str(), reason.as_str()),
        ("True", "OutputsUnavailable"),
        "{message}"
    );
    assert!(
        message.contains("up-foreign-stack-outputs") && message.contains("is not this Update's"),
        "{message}"
    );
    let after = secrets
        .get("up-foreign-stack-outputs")
        .await
        .expect("still there");
    assert_eq!(after.metadata.uid, foreign.metadata.uid, "not replaced");
    assert_eq!(
        after.metadata.resource_version, foreign.metadata.resource_version,
        "not changed"
    );

    // The next Update blocks on the pipe until a Secret controlled by it is in place.
    let api = env.update("up-ours", "up").await;
    let uid = wait_for("the update to be Progressing", WAIT, || async {
        let u = api.get("up-ours").await.ok()?;
        let progressing = u
            .status
            .as_ref()?
            .conditions
            .iter()
            .any(|c| c.type_ == "Progressing" && c.status == "True");
        progressing.then(|| u.metadata.uid.clone()).flatten()
    })
    .await
    .expect("progressing");
    let ours = secrets
        .create(
            &PostParams::default(),
            &secret(
                "up-ours-stack-outputs",
                Some(json!({
                    "apiVersion": "auto.pulumi.com/v1alpha1", "kind": "Update",
                    "name": "up-ours", "uid": uid, "controller": true,
                })),
            ),
        )
        .await
        .expect("a secret of the update");
    let feeder = fifo::Feeder::start(pipe, "fed\n", WAIT);
    let up = env.completed(&api, "up-ours").await;
    drop(feeder);
    let (failed, reason, message) = condition(&up, "Failed");
    assert_eq!(
        (failed.as_str(), reason.as_str()),
        ("False", "UpdateSucceeded"),
        "{message}"
    );
    let replaced = secrets.get("up-ours-stack-outputs").await.expect("outputs");
    assert_ne!(replaced.metadata.uid, ours.metadata.uid, "replaced");
    let data = replaced.data.unwrap_or_default();
    assert_eq!(
        serde_json::from_slice::<Value>(&data["content"].0).expect("json"),
        json!("fed\n")
    );
}

/// Updates as PKO leaves them at a switch-over, made before pko-rs starts: each carries PKO's
/// Stack finalizer, which only PKO's Stack controller removes. A completed one with a TTL is
/// released and then expires (404); one deleted under PKO (Terminating) is released and goes;
/// one still running under it keeps the finalizer until it completes. Before, the first two
/// stayed for ever and blocked their namespace's deletion.
#[tokio::test]
async fn updates_pko_left_with_its_finalizer_expire_and_go() {
    use kube::api::{DeleteParams, Patch, PatchParams};
    let _machine = pko_tests::serial::shared().await;
    let plane = ControlPlane::shared().await;
    let ns = plane.namespace("upd-pko-fin").await.expect("namespace");
    let api: Api<Update> = Api::namespaced(plane.client(), &ns);
    for (name, ttl) in [("done", Some("1s")), ("deleted", None), ("running", None)] {
        let mut spec = json!({"workspaceName": "gone", "stackName": "dev", "type": "up"});
        if let Some(ttl) = ttl {
            spec["ttlAfterCompleted"] = json!(ttl);
        }
        // As PKO makes them: controlled by their Workspace (gone here; no garbage collector
        // runs on this plane).
        let update: Update = serde_json::from_value(json!({
            "apiVersion": "auto.pulumi.com/v1alpha1", "kind": "Update",
            "metadata": {"name": name, "finalizers": ["finalizer.stack.pulumi.com"],
                "ownerReferences": [fixtures::controller_of("gone", "00000000-0000-0000-0000-000000000000")]},
            "spec": spec,
        }))
        .expect("update");
        api.create(&PostParams::default(), &update)
            .await
            .expect("create");
    }
    // PKO's result on "done", as its Update controller writes it.
    let status = json!({"status": {"observedGeneration": 1, "conditions": [
        {"type": "Progressing", "status": "False", "reason": "Complete", "message": "", "lastTransitionTime": "2026-01-01T00:00:00Z"},
        {"type": "Complete", "status": "True", "reason": "Updated", "message": "", "lastTransitionTime": "2026-01-01T00:00:00Z"},
        {"type": "Failed", "status": "False", "reason": "UpdateSucceeded", "message": "", "lastTransitionTime": "2026-01-01T00:00:00Z"},
    ]}});
    api.patch_status("done", &PatchParams::default(), &Patch::Merge(&status))
        .await
        .expect("status");
    api.delete("deleted", &DeleteParams::default())
        .await
        .expect("delete");
    let terminating = api.get("deleted").await.expect("still there");
    assert!(terminating.metadata.deletion_timestamp.is_some());

    let _operator = Operator::start(
        plane,
        OperatorOptions {
            advertised: None,
            args: vec![format!("--watch-namespace={ns}")],
        },
    )
    .await
    .expect("operator");
    for name in ["done", "deleted"] {
        wait_for(&format!("{name} to be gone"), WAIT, || async {
            api.get_opt(name).await.ok()?.is_none().then_some(())
        })
        .await
        .expect("released and expired");
    }
    let running = api.get("running").await.expect("running");
    assert_eq!(
        running.metadata.finalizers,
        Some(vec!["finalizer.stack.pulumi.com".to_owned()]),
        "an Update still running under PKO's finalizer keeps it"
    );
}
