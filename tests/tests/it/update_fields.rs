//! What each Update field makes pulumi do, on the real control plane with the harness as
//! kubelet, the real agent and pulumi CLI, and the Kubernetes provider creating ConfigMaps in
//! the test apiserver: `target` and `targetDependents`, `expectNoChanges`, `replace`, `refresh`,
//! `continueOnError`, `parallel`, `message`, `runProgram` and `remove`. Each test asserts what
//! pulumi did (objects in the apiserver, the stack in the backend), not the Update's shape.

use std::path::{Path, PathBuf};
use std::time::Duration;

use k8s_openapi::api::core::v1::ConfigMap;
use kube::Api;
use kube::api::{DeleteParams, PostParams};
use pko_api::program::Program;
use pko_api::update::Update;
use pko_api::workspace::Workspace;
use pko_tests::execution::Execution;
use pko_tests::fixtures::labelled_config_map as config_map;
use pko_tests::{fixtures, wait_for};
use serde_json::{Value, json};

const WAIT: Duration = Duration::from_secs(180);
const PROJECT: &str = "effects";

fn urn(resource: &str) -> String {
    format!("urn:pulumi:dev::{PROJECT}::kubernetes:core/v1:ConfigMap::{resource}")
}

struct Env {
    e: Execution,
}

impl Env {
    /// A namespace, its kubelet and operator, Program `effects` with `resources` (and config
    /// `file`, read into a variable when `reads_file`), and its Workspace on the file backend
    /// with stack `dev` (config `ns`, and `file` when given), ready. `agent_env` goes to the
    /// agent container's own env.
    async fn start(
        prefix: &str,
        resources: Value,
        file: Option<&Path>,
        agent_env: &[(&str, &str)],
    ) -> Self {
        let e = Execution::start(prefix, &[]).await;
        let mut program = json!({
            "configuration": {"ns": {"type": "String"}},
            "resources": resources,
        });
        let mut config = vec![json!({"key": "ns", "value": e.ns})];
        if let Some(file) = file {
            program["configuration"]["file"] = json!({"type": "String"});
            program["variables"] = json!({"content": {"fn::readFile": "${file}"}});
            config.push(json!({"key": "file", "value": file.display().to_string()}));
        }
        let programs: Api<Program> = Api::namespaced(e.plane.client(), &e.ns);
        let (url, digest) = fixtures::published_program(&programs, PROJECT, program, WAIT)
            .await
            .expect("artifact");
        let mut spec = json!({
            "flux": {"url": url, "digest": digest},
            "env": [
                {"name": "PULUMI_BACKEND_URL", "value": format!("file://{}", e.tmp.path().join("backend").display())},
                {"name": "PULUMI_CONFIG_PASSPHRASE", "value": "pko-tests"},
                {"name": "KUBECONFIG", "value": e.plane.kubeconfig_path().display().to_string()},
            ],
            "stacks": [{"name": "dev", "create": true, "config": config}],
        });
        if !agent_env.is_empty() {
            let env: Vec<Value> = agent_env
                .iter()
                .map(|(name, value)| json!({"name": name, "value": value}))
                .collect();
            spec["podTemplate"] = json!({"spec": {"containers": [{"name": "pulumi", "env": env}]}});
        }
        let workspaces: Api<Workspace> = Api::namespaced(e.plane.client(), &e.ns);
        workspaces
            .create(&PostParams::default(), &fixtures::workspace(PROJECT, spec))
            .await
            .expect("create workspace");
        let env = Self { e };
        let ready = wait_for("the workspace to be ready", WAIT, || async {
            let s = workspaces.get(PROJECT).await.ok()?.status?;
            s.conditions
                .iter()
                .any(|c| c.type_ == "Ready" && c.status == "True")
                .then_some(())
        })
        .await;
        if let Err(err) = ready {
            panic!("{err}\n{}", env.e.kubelet.logs(PROJECT));
        }
        env
    }

    fn client(&self) -> kube::Client {
        self.e.plane.client()
    }

    /// Runs Update `name` with `spec` (on stack `dev` of the Workspace) to completion: whether
    /// it succeeded, and its status message.
    async fn run(&self, name: &str, spec: Value) -> (bool, String) {
        let workspaces: Api<Workspace> = Api::namespaced(self.client(), &self.e.ns);
        let uid = workspaces
            .get(PROJECT)
            .await
            .expect("workspace")
            .metadata
            .uid
            .expect("uid");
        let spec = fixtures::merged(json!({"workspaceName": PROJECT, "stackName": "dev"}), spec);
        let updates: Api<Update> = Api::namespaced(self.client(), &self.e.ns);
        updates
            .create(
                &PostParams::default(),
                &fixtures::update(name, PROJECT, &uid, spec),
            )
            .await
            .expect("create update");
        let done = wait_for(&format!("update {name} to complete"), WAIT, || async {
            let status = updates.get(name).await.ok()?.status?;
            status
                .conditions
                .iter()
                .any(|c| c.type_ == "Complete" && c.status == "True")
                .then_some(status)
        })
        .await;
        let status = match done {
            Ok(status) => status,
            Err(err) => panic!(
                "{err}: {:?}\n{}",
                updates.get(name).await.ok().and_then(|u| u.status),
                self.e.kubelet.logs(PROJECT)
            ),
        };
        let succeeded = status
            .conditions
            .iter()
            .any(|c| c.type_ == "Failed" && c.status == "False");
        (succeeded, status.message.unwrap_or_default())
    }

    /// [`Env::run`], which must succeed.
    async fn ok(&self, name: &str, spec: Value) -> String {
        let (succeeded, message) = self.run(name, spec).await;
        assert!(
            succeeded,
            "update {name} failed: {message}\n{}",
            self.e.kubelet.logs(PROJECT)
        );
        message
    }

    /// The ConfigMaps labelled `effect: <label>`.
    async fn labelled(&self, label: &str) -> Vec<ConfigMap> {
        fixtures::labelled(self.client(), &self.e.ns, label).await
    }

    async fn count(&self, label: &str) -> usize {
        self.labelled(label).await.len()
    }

    fn backend(&self) -> PathBuf {
        self.e.tmp.path().join("backend/.pulumi")
    }
}

/// `a`; `b`, whose data names `a` (so it depends on it); `c`, on its own.
fn three_config_maps() -> Value {
    json!({
        "a": config_map("a", json!({"v": "a"})),
        "b": config_map("b", json!({"a": "${a.metadata.name}"})),
        "c": config_map("c", json!({"v": "c"})),
    })
}

/// `target` deploys only the targeted resource; `targetDependents` adds what depends on it;
/// `expectNoChanges` fails an up that would change something and passes one that would not.
#[tokio::test]
async fn targets_dependents_and_expect_no_changes_shape_an_up() {
    let _machine = pko_tests::serial::shared().await;
    let env = Env::start("upf-target", three_config_maps(), None, &[]).await;

    env.ok("target-a", json!({"type": "up", "target": [urn("a")]}))
        .await;
    assert_eq!(
        (
            env.count("a").await,
            env.count("b").await,
            env.count("c").await
        ),
        (1, 0, 0),
        "only the target is deployed"
    );

    env.ok(
        "target-a-dependents",
        json!({"type": "up", "target": [urn("a")], "targetDependents": true}),
    )
    .await;
    assert_eq!(
        (
            env.count("a").await,
            env.count("b").await,
            env.count("c").await
        ),
        (1, 1, 0),
        "the target's dependent is deployed too, nothing else"
    );

    let (succeeded, message) = env
        .run(
            "expect-none",
            json!({"type": "up", "expectNoChanges": true}),
        )
        .await;
    assert!(!succeeded, "c is still to create: {message}");
    assert!(
        message.contains("no changes were expected"),
        "the CLI's reason: {message}"
    );

    env.ok("all", json!({"type": "up"})).await;
    assert_eq!(env.count("c").await, 1);
    env.ok(
        "expect-none-again",
        json!({"type": "up", "expectNoChanges": true}),
    )
    .await;
}

/// `replace` replaces the resource (a new object); `refresh` finds a deletion made behind
/// Pulumi's back, which an up without it does not see.
#[tokio::test]
async fn replace_replaces_and_refresh_finds_what_changed_behind_pulumis_back() {
    let _machine = pko_tests::serial::shared().await;
    let env = Env::start("upf-replace", three_config_maps(), None, &[]).await;
    env.ok("up", json!({"type": "up"})).await;
    let uid = |cms: Vec<ConfigMap>| {
        assert_eq!(cms.len(), 1, "{cms:?}");
        cms[0].metadata.uid.clone().expect("uid")
    };
    let (a, c) = (uid(env.labelled("a").await), uid(env.labelled("c").await));

    env.ok("replace-a", json!({"type": "up", "replace": [urn("a")]}))
        .await;
    assert_ne!(uid(env.labelled("a").await), a, "a is a new object");
    assert_eq!(uid(env.labelled("c").await), c, "c is untouched");

    let api: Api<ConfigMap> = Api::namespaced(env.client(), &env.e.ns);
    let name = env.labelled("c").await[0]
        .metadata
        .name
        .clone()
        .expect("name");
    api.delete(&name, &DeleteParams::background())
        .await
        .expect("delete c behind Pulumi's back");
    wait_for("c to be gone", WAIT, || async {
        api.get_opt(&name).await.ok()?.is_none().then_some(())
    })
    .await
    .expect("gone");

    env.ok("up-unaware", json!({"type": "up"})).await;
    assert_eq!(
        env.count("c").await,
        0,
        "without refresh, the state says c exists"
    );
    env.ok("up-refresh", json!({"type": "up", "refresh": true}))
        .await;
    assert_eq!(
        env.count("c").await,
        1,
        "the refresh found c gone: made again"
    );
}

/// `fails` has a name the apiserver refuses; `goes-on` needs `first`'s name, so it is
/// registered only once `first` is deployed, after `fails` is queued. With `parallel: 1` one
/// step runs at a time, in the order queued, so `fails` runs before `goes-on` whatever the
/// order of `fails` and `first`: without `continueOnError` the up stops at the failure and
/// `goes-on` is never deployed; with it, `goes-on` is deployed and the up still fails.
#[tokio::test]
async fn continue_on_error_deploys_past_a_failing_resource() {
    let _machine = pko_tests::serial::shared().await;
    let mut failing = config_map("fails", json!({"v": "x"}));
    failing["properties"]["metadata"]["name"] = json!("Not_A_Valid_Name");
    let resources = json!({
        "fails": failing,
        "first": config_map("first", json!({"v": "y"})),
        "goes-on": config_map("goes-on", json!({"after": "${first.metadata.name}"})),
    });
    let env = Env::start("upf-continue", resources, None, &[]).await;

    let (succeeded, message) = env.run("stop", json!({"type": "up", "parallel": 1})).await;
    assert!(!succeeded, "{message}");
    assert_eq!(env.count("goes-on").await, 0, "stopped at the failure");

    let (succeeded, message) = env
        .run(
            "go-on",
            json!({"type": "up", "parallel": 1, "continueOnError": true}),
        )
        .await;
    assert!(
        !succeeded,
        "the failing resource still fails the up: {message}"
    );
    assert_eq!(env.count("goes-on").await, 1, "went on past the failure");
}

/// `message` is the update's message in the stack's history (the backend); `parallel` is on
/// the CLI's command line (the agent logs it at debug).
#[tokio::test]
async fn message_and_parallel_reach_the_cli() {
    let _machine = pko_tests::serial::shared().await;
    let env = Env::start(
        "upf-message",
        three_config_maps(),
        None,
        &[("AGENT_LOG_LEVEL", "info,pko_agent=debug")],
    )
    .await;
    let message = "deployed by update_fields, parallel 2";
    env.ok(
        "up",
        json!({"type": "up", "message": message, "parallel": 2}),
    )
    .await;
    let history = fixtures::files_under(&env.backend().join("history"));
    let recorded = history.iter().any(|f| {
        f.to_string_lossy().ends_with(".history.json")
            && std::fs::read_to_string(f).is_ok_and(|text| {
                serde_json::from_str::<Value>(&text)
                    .is_ok_and(|h| h.pointer("/message").and_then(Value::as_str) == Some(message))
            })
    });
    assert!(recorded, "no history entry with the message: {history:?}");
    let logs = env.e.kubelet.logs(PROJECT);
    assert!(
        logs.lines().any(|l| l.contains("pulumi operation")
            && l.contains("up ")
            && l.contains("--parallel=2")),
        "{logs}"
    );
}

/// `runProgram` runs the program during a destroy: with the file it reads gone, that destroy
/// fails and one without it succeeds. `remove` removes the stack from the backend after the
/// destroy; a destroy without it keeps it.
#[tokio::test]
async fn destroy_runs_the_program_on_request_and_remove_removes_the_stack() {
    let _machine = pko_tests::serial::shared().await;
    let tmp = tempfile::tempdir().expect("tmp");
    let file = tmp.path().join("content.txt");
    std::fs::write(&file, "hello\n").expect("file");
    let resources = json!({"a": config_map("a", json!({"content": "${content}"}))});
    let env = Env::start("upf-destroy", resources, Some(&file), &[]).await;
    env.ok("up", json!({"type": "up"})).await;
    assert_eq!(env.count("a").await, 1);

    std::fs::remove_file(&file).expect("remove the file");
    let (succeeded, message) = env
        .run(
            "destroy-run",
            json!({"type": "destroy", "runProgram": true}),
        )
        .await;
    assert!(
        !succeeded,
        "the program ran and could not read its file: {message}"
    );
    assert_eq!(env.count("a").await, 1, "nothing destroyed");

    env.ok("destroy", json!({"type": "destroy"})).await;
    assert_eq!(env.count("a").await, 0);
    let stack_files = || {
        fixtures::files_under(&env.backend().join("stacks"))
            .into_iter()
            // The checkpoint itself: pulumi keeps `.bak` and `.attrs` files beside it.
            .filter(|f| {
                f.file_name()
                    .is_some_and(|n| n == "dev.json" || n == "dev.json.gz")
            })
            .count()
    };
    assert_eq!(stack_files(), 1, "a destroy keeps the stack");

    env.ok("remove", json!({"type": "destroy", "remove": true}))
        .await;
    assert_eq!(stack_files(), 0, "the stack is removed");
}
