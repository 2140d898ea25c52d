//! What a Stack's own fields make its updates do, on the real control plane with the harness
//! as kubelet, the real agent and pulumi CLI, and the Kubernetes provider creating ConfigMaps
//! in the test apiserver: `configRef`, `secrets`, `secretsRef` and `envs`; `targets`, `targetDependents` and
//! `refresh`; `runProgram` and `useLocalStackOnly`; `prerequisites` with
//! `succeededWithinDuration`, and `fluxSource.dir`; `gitAuthSecret`, `shallow`,
//! `continueResyncOnCommitMatch` and `resyncFrequencySeconds`; `gitAuth.accessToken`;
//! `serviceAccountName`. Each test asserts what pulumi did (objects in the apiserver, outputs,
//! the stack in the backend, the updates run), not the Workspace's or Update's shape.

use std::path::PathBuf;
use std::time::Duration;

use k8s_openapi::api::core::v1::{ConfigMap, Secret};
use kube::Api;
use kube::api::{DeleteParams, ListParams, Patch, PatchParams, PostParams};
use pko_api::program::Program;
use pko_api::stack::{Stack, StackStatus};
use pko_api::update::Update;
use pko_tests::execution::Execution;
use pko_tests::fixtures::{self, labelled_config_map as config_map};
use pko_tests::gitrepo::GitRepo;
use pko_tests::wait_for;
use serde_json::{Value, json};

const WAIT: Duration = Duration::from_secs(180);

struct Env {
    e: Execution,
    stacks: Api<Stack>,
}

impl Env {
    async fn start(prefix: &str) -> Self {
        Self::with(Execution::start(prefix, &[]).await)
    }

    fn with(e: Execution) -> Self {
        let stacks = Api::namespaced(e.plane.client(), &e.ns);
        Self { e, stacks }
    }

    fn client(&self) -> kube::Client {
        self.e.plane.client()
    }

    fn backend(&self) -> PathBuf {
        self.e.tmp.path().join("backend")
    }

    /// Creates Program `name` with config `ns` (and `configuration` added) and `resources`.
    async fn program(&self, name: &str, configuration: Value, resources: Value, outputs: Value) {
        let mut declared = json!({"ns": {"type": "String"}});
        if let (Some(all), Value::Object(more)) = (declared.as_object_mut(), configuration) {
            all.extend(more);
        }
        let programs: Api<Program> = Api::namespaced(self.client(), &self.e.ns);
        programs
            .create(
                &PostParams::default(),
                &fixtures::program(
                    name,
                    json!({"configuration": declared, "resources": resources, "outputs": outputs}),
                ),
            )
            .await
            .expect("create program");
    }

    /// The environment of a Stack on the test backend whose provider reaches the test
    /// apiserver.
    fn env_refs(&self) -> Value {
        let literal = |v: &str| json!({"type": "Literal", "literal": {"value": v}});
        json!({
            "PULUMI_CONFIG_PASSPHRASE": literal(fixtures::PASSPHRASE),
            "KUBECONFIG": literal(&self.e.plane.kubeconfig_path().display().to_string()),
        })
    }

    /// Creates Stack `name` for pulumi stack `dev` (unless `spec` names another) on the file
    /// backend, with config `ns` and [`Env::env_refs`] (unless `spec` has its own) and `spec`.
    async fn stack(&self, name: &str, spec: Value) {
        let base = json!({"stack": "dev", "config": {"ns": self.e.ns}, "envRefs": self.env_refs()});
        self.stacks
            .create(
                &PostParams::default(),
                &fixtures::file_backend_stack(name, &self.backend(), fixtures::merged(base, spec)),
            )
            .await
            .expect("create stack");
    }

    async fn patch(&self, name: &str, patch: Value) {
        self.stacks
            .patch(name, &PatchParams::default(), &Patch::Merge(patch))
            .await
            .expect("patch stack");
    }

    /// Waits for Stack `name`'s last update to be for its current generation and finished, and
    /// checks it ended in `state` (`succeeded` or `failed`); its status.
    async fn settled(&self, name: &str, state: &str) -> StackStatus {
        let done = wait_for(&format!("stack {name}'s update to end"), WAIT, || async {
            let stack = self.stacks.get(name).await.ok()?;
            let status = stack.status?;
            let last = status.last_update.as_ref()?;
            (last.generation == stack.metadata.generation
                && status.current_update.is_none()
                && matches!(last.state.as_deref(), Some("succeeded" | "failed")))
            .then_some(status)
        })
        .await;
        let status = match done {
            Ok(status) => status,
            Err(e) => panic!(
                "{e}: {:?}\n{}",
                self.stacks.get(name).await.ok().and_then(|s| s.status),
                self.e.kubelet.logs(name)
            ),
        };
        let last = status.last_update.as_ref().and_then(|l| l.state.as_deref());
        assert_eq!(
            last,
            Some(state),
            "{:?}\n{}",
            status.last_update,
            self.e.kubelet.logs(name)
        );
        status
    }

    async fn labelled(&self, label: &str) -> Vec<ConfigMap> {
        fixtures::labelled(self.client(), &self.e.ns, label).await
    }

    async fn count(&self, label: &str) -> usize {
        self.labelled(label).await.len()
    }

    /// The Updates the operator made for Stack `name`.
    async fn updates(&self, name: &str) -> Vec<Update> {
        let api: Api<Update> = Api::namespaced(self.client(), &self.e.ns);
        api.list(&ListParams::default().labels(&format!("pulumi.com/stack-name={name}")))
            .await
            .expect("list updates")
            .items
    }

    async fn config_map_object(&self, name: &str, data: Value) {
        let api: Api<ConfigMap> = Api::namespaced(self.client(), &self.e.ns);
        let cm: ConfigMap = serde_json::from_value(
            json!({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": name}, "data": data}),
        )
        .expect("config map");
        api.create(&PostParams::default(), &cm)
            .await
            .expect("create config map");
    }

    async fn secret_object(&self, name: &str, data: Value) {
        let api: Api<Secret> = Api::namespaced(self.client(), &self.e.ns);
        let secret: Secret = serde_json::from_value(
            json!({"apiVersion": "v1", "kind": "Secret", "metadata": {"name": name}, "stringData": data}),
        )
        .expect("secret");
        api.create(&PostParams::default(), &secret)
            .await
            .expect("create secret");
    }
}

fn ready(status: &StackStatus) -> bool {
    status
        .conditions
        .iter()
        .any(|c| c.type_ == "Ready" && c.status == "True")
}

/// `configRef` reads config from a ConfigMap's key (`name`, `key`), as plain config, and
/// parsed as JSON with `json`; `secrets` and `secretsRef` (a Secret's key) are secret config; `envs` puts a ConfigMap's keys in
/// the environment (here `KUBECONFIG`, without which the provider reaches no cluster).
#[tokio::test]
async fn config_refs_secrets_and_envs_reach_the_program() {
    let _machine = pko_tests::serial::shared().await;
    let env = Env::start("stf-config").await;
    env.config_map_object(
        "settings",
        json!({"plain": "from-a-config-map", "structured": r#"{"greeting": "hola", "count": 2}"#}),
    )
    .await;
    env.config_map_object(
        "stack-env",
        json!({"KUBECONFIG": env.e.plane.kubeconfig_path().display().to_string()}),
    )
    .await;
    env.program(
        "config",
        json!({"plain": {"type": "String"}, "token": {"type": "String"}, "apiKey": {"type": "String"}}),
        json!({"made": config_map("made", json!({
            "plain": "${plain}",
            "greeting": "${structured.greeting}",
            "token": "${token}",
            "apiKey": "${apiKey}",
        }))}),
        json!({"plain": "${plain}", "token": "${token}", "apiKey": "${apiKey}"}),
    )
    .await;
    env.secret_object("stack-secrets", json!({"apiKey": "k3y"}))
        .await;
    let literal = |v: &str| json!({"type": "Literal", "literal": {"value": v}});
    env.stack(
        "config",
        json!({
            "programRef": {"name": "config"},
            "configRef": {
                "plain": {"name": "settings", "key": "plain"},
                "structured": {"name": "settings", "key": "structured", "json": true},
            },
            "secrets": {"token": "s3cret-token"},
            "secretsRef": {"apiKey": {"type": "Secret", "secret": {"name": "stack-secrets", "key": "apiKey"}}},
            "envs": ["stack-env"],
            // No KUBECONFIG here: it comes from `envs`.
            "envRefs": {"PULUMI_CONFIG_PASSPHRASE": literal(fixtures::PASSPHRASE)},
        }),
    )
    .await;
    let status = env.settled("config", "succeeded").await;
    let made = env.labelled("made").await;
    assert_eq!(made.len(), 1, "the provider reached the cluster: {made:?}");
    let data = made[0].data.clone().unwrap_or_default();
    assert_eq!(
        data.get("plain").map(String::as_str),
        Some("from-a-config-map")
    );
    assert_eq!(
        data.get("greeting").map(String::as_str),
        Some("hola"),
        "the JSON value is structured config"
    );
    assert_eq!(data.get("token").map(String::as_str), Some("s3cret-token"));
    assert_eq!(data.get("apiKey").map(String::as_str), Some("k3y"));
    assert_eq!(
        status.outputs.get("plain"),
        Some(&json!("from-a-config-map")),
        "configRef is plain config"
    );
    // The config the update ran with, as the backend's history records it: Pulumi YAML reads
    // a JSON text as structured anyway, the stack's config tells them apart.
    let config = fixtures::files_under(&env.backend().join(".pulumi/history"))
        .into_iter()
        .filter(|f| f.to_string_lossy().ends_with(".history.json"))
        .filter_map(|f| std::fs::read_to_string(f).ok())
        .filter_map(|text| serde_json::from_str::<Value>(&text).ok())
        .find_map(|h| h.get("config").cloned())
        .expect("a history entry with config");
    // Plain values are strings, structured ones objects, secrets `{"secure": ...}`.
    assert_eq!(
        config["config:structured"],
        json!({"greeting": "hola", "count": 2}),
        "{config}"
    );
    assert_eq!(config["config:plain"], json!("from-a-config-map"));
    assert!(
        config["config:token"].get("secure").is_some()
            && config["config:apiKey"].get("secure").is_some(),
        "{config}"
    );
}

/// `targets` deploys only the targeted resources; `targetDependents` adds what depends on them;
/// `refresh` finds a deletion made behind Pulumi's back, which an update without it misses.
#[tokio::test]
async fn targets_dependents_and_refresh_shape_the_stacks_updates() {
    let _machine = pko_tests::serial::shared().await;
    let env = Env::start("stf-target").await;
    env.program(
        "targets",
        json!({"round": {"type": "String", "default": "0"}}),
        json!({
            "a": config_map("a", json!({"v": "a"})),
            "b": config_map("b", json!({"a": "${a.metadata.name}"})),
            "c": config_map("c", json!({"v": "c"})),
        }),
        json!({"round": "${round}"}),
    )
    .await;
    let urn = |r: &str| format!("urn:pulumi:dev::targets::kubernetes:core/v1:ConfigMap::{r}");
    env.stack(
        "targets",
        json!({"programRef": {"name": "targets"}, "targets": [urn("a")]}),
    )
    .await;
    env.settled("targets", "succeeded").await;
    let counts = || async {
        (
            env.count("a").await,
            env.count("b").await,
            env.count("c").await,
        )
    };
    assert_eq!(counts().await, (1, 0, 0), "only the target is deployed");

    env.patch("targets", json!({"spec": {"targetDependents": true}}))
        .await;
    env.settled("targets", "succeeded").await;
    assert_eq!(
        counts().await,
        (1, 1, 0),
        "the target's dependent is deployed too, nothing else"
    );

    env.patch(
        "targets",
        json!({"spec": {"targets": null, "targetDependents": null}}),
    )
    .await;
    env.settled("targets", "succeeded").await;
    assert_eq!(counts().await, (1, 1, 1));

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

    // A new update (a config change) without refresh: the state says c exists.
    let config = |round: &str| json!({"spec": {"config": {"ns": env.e.ns, "round": round}}});
    env.patch("targets", config("1")).await;
    env.settled("targets", "succeeded").await;
    assert_eq!(
        env.count("c").await,
        0,
        "without refresh, c is not seen gone"
    );

    env.patch("targets", json!({"spec": {"refresh": true}}))
        .await;
    env.settled("targets", "succeeded").await;
    assert_eq!(
        env.count("c").await,
        1,
        "the refresh found c gone: made again"
    );
}

/// `runProgram` makes the destroy on deletion run the program: with the file it reads gone,
/// that destroy fails and nothing is destroyed; without it the destroy works from the state.
/// `useLocalStackOnly` never creates the stack: a Stack naming one the backend has runs on it,
/// one naming a stack the backend lacks does not run and creates none.
#[tokio::test]
async fn run_program_destroys_with_the_program_and_use_local_stack_only_creates_no_stack() {
    let _machine = pko_tests::serial::shared().await;
    let env = Env::start("stf-destroy").await;
    let file = env.e.tmp.path().join("content.txt");
    std::fs::write(&file, "hello\n").expect("file");
    let programs: Api<Program> = Api::namespaced(env.client(), &env.e.ns);
    programs
        .create(
            &PostParams::default(),
            &fixtures::program(
                "reads",
                json!({
                    "configuration": {"ns": {"type": "String"}, "file": {"type": "String"}},
                    "variables": {"content": {"fn::readFile": "${file}"}},
                    "resources": {"a": config_map("a", json!({"content": "${content}"}))},
                }),
            ),
        )
        .await
        .expect("program");
    let config = json!({"ns": env.e.ns, "file": file.display().to_string()});
    env.stack(
        "reads",
        json!({
            "programRef": {"name": "reads"}, "config": config,
            "destroyOnFinalize": true, "runProgram": true,
        }),
    )
    .await;
    env.settled("reads", "succeeded").await;
    assert_eq!(env.count("a").await, 1);

    std::fs::remove_file(&file).expect("remove the file");
    env.stacks
        .delete("reads", &DeleteParams::default())
        .await
        .expect("delete the stack");
    let failed = wait_for("the destroy to fail", WAIT, || async {
        let last = env.stacks.get("reads").await.ok()?.status?.last_update?;
        (last.type_.as_deref() == Some("destroy") && last.state.as_deref() == Some("failed"))
            .then_some(last)
    })
    .await;
    if let Err(e) = failed {
        panic!(
            "{e}: {:?}\n{}",
            env.stacks.get("reads").await.ok().and_then(|s| s.status),
            env.e.kubelet.logs("reads")
        );
    }
    assert_eq!(env.count("a").await, 1, "nothing destroyed");

    env.patch("reads", json!({"spec": {"runProgram": false}}))
        .await;
    wait_for("the stack to be destroyed and gone", WAIT, || async {
        env.stacks
            .get_opt("reads")
            .await
            .ok()?
            .is_none()
            .then_some(())
    })
    .await
    .expect("gone");
    assert_eq!(env.count("a").await, 0, "destroyed from the state");

    // The destroy keeps pulumi stack `dev` in the backend, with its config.
    let checkpoints = |stack: &str| {
        fixtures::files_under(&env.backend().join(".pulumi/stacks"))
            .into_iter()
            .filter(|f| {
                f.file_name().is_some_and(|n| {
                    n.to_string_lossy() == format!("{stack}.json")
                        || n.to_string_lossy() == format!("{stack}.json.gz")
                })
            })
            .count()
    };
    assert_eq!(checkpoints("dev"), 1);
    std::fs::write(&file, "again\n").expect("file");
    env.stack(
        "local",
        json!({"programRef": {"name": "reads"}, "config": config, "useLocalStackOnly": true}),
    )
    .await;
    env.settled("local", "succeeded").await;
    assert_eq!(
        env.labelled("a").await[0]
            .data
            .clone()
            .unwrap_or_default()
            .get("content")
            .map(String::as_str),
        Some("again\n"),
        "the existing stack ran"
    );
    env.stack(
        "absent",
        json!({
            "stack": "absent", "programRef": {"name": "reads"}, "config": config,
            "useLocalStackOnly": true,
        }),
    )
    .await;
    let workspaces: Api<pko_api::workspace::Workspace> = Api::namespaced(env.client(), &env.e.ns);
    let message = wait_for("the absent stack's workspace to stall", WAIT, || async {
        let status = workspaces.get("absent").await.ok()?.status?;
        status
            .conditions
            .iter()
            .find(|c| c.type_ == "Stalled" && c.status == "True")
            .map(|c| c.message.clone())
    })
    .await;
    let message = match message {
        Ok(m) => m,
        Err(e) => panic!("{e}\n{}", env.e.kubelet.logs("absent")),
    };
    assert!(message.contains("absent"), "{message}");
    assert_eq!(checkpoints("absent"), 0, "no stack created");
    assert!(env.updates("absent").await.is_empty(), "nothing ran");
}

/// A Flux source's `dir` is where the program is in its artifact. A prerequisite that
/// succeeded within `succeededWithinDuration` lets its dependent run as it is; one that
/// succeeded longer ago is run again first.
#[tokio::test]
async fn flux_dir_and_a_stale_prerequisite_run_again() {
    let _machine = pko_tests::serial::shared().await;
    pko_tests::flux::install_crds(pko_tests::ControlPlane::shared().await.client(), WAIT)
        .await
        .expect("Flux CRDs");
    let env = Env::start("stf-prereq").await;
    let mut source = pko_tests::flux::FluxSource::new();
    let project = "name: nested\nruntime: yaml\nconfiguration:\n  ns:\n    type: String\noutputs:\n  where: in-app\n";
    let artifact = source
        .publish(
            "main@sha1:1111111111111111111111111111111111111111",
            &[
                ("app/Pulumi.yaml", project),
                (
                    "Pulumi.yaml",
                    "name: root\nruntime: yaml\noutputs:\n  where: at-root\n",
                ),
            ],
        )
        .await
        .expect("artifact");
    pko_tests::flux::set_git_repository(env.client(), &env.e.ns, "repo", &artifact)
        .await
        .expect("GitRepository");
    env.stack(
        "first",
        json!({"fluxSource": {
            "sourceRef": {"apiVersion": "source.toolkit.fluxcd.io/v1", "kind": "GitRepository", "name": "repo"},
            "dir": "app",
        }}),
    )
    .await;
    let status = env.settled("first", "succeeded").await;
    assert_eq!(
        status.outputs.get("where"),
        Some(&json!("in-app")),
        "the program in dir ran"
    );
    let first_update = status.last_update.and_then(|l| l.name).expect("name");

    env.program("second", json!({}), json!({}), json!({"ran": "yes"}))
        .await;
    let within = |duration: &str| json!([{"name": "first", "requirement": {"succeededWithinDuration": duration}}]);
    env.stack(
        "second",
        json!({
            "stack": "second", "programRef": {"name": "second"},
            "prerequisites": within("1h"),
        }),
    )
    .await;
    env.settled("second", "succeeded").await;
    assert_eq!(
        env.stacks
            .get("first")
            .await
            .expect("first")
            .status
            .and_then(|s| s.last_update)
            .and_then(|l| l.name),
        Some(first_update.clone()),
        "a recent enough prerequisite is not run again"
    );
    assert_eq!(env.updates("first").await.len(), 1);

    // Once the prerequisite's success is more than a second old, a requirement of one second
    // runs it again.
    wait_for(
        "the first stack's success to be a second old",
        WAIT,
        || async {
            let last = env.stacks.get("first").await.ok()?.status?.last_update?;
            let at = last.last_resync_time?.0;
            let age = jiff::Timestamp::now().duration_since(at);
            (age > jiff::SignedDuration::from_secs(1)).then_some(())
        },
    )
    .await
    .expect("old enough");
    env.patch("second", json!({"spec": {"prerequisites": within("1s")}}))
        .await;
    let rerun = wait_for("the prerequisite to run again", WAIT, || async {
        let last = env.stacks.get("first").await.ok()?.status?.last_update?;
        (last.name.as_deref() != Some(first_update.as_str())
            && last.state.as_deref() == Some("succeeded"))
        .then_some(())
    })
    .await;
    if let Err(e) = rerun {
        panic!(
            "{e}: {:?}",
            env.stacks.get("second").await.ok().and_then(|s| s.status)
        );
    }
    assert!(env.updates("first").await.len() >= 2);
}

fn git_program(message: &str) -> String {
    format!(
        "name: from-git\nruntime: yaml\nconfiguration:\n  ns:\n    type: String\noutputs:\n  message: {message}\n"
    )
}

/// `gitAuthSecret` (a Secret's `username`/`password`) authenticates the clone; `shallow`
/// fetches one commit of the two; `continueResyncOnCommitMatch` runs the stack again at the
/// same commit, `resyncFrequencySeconds` after the last run.
#[tokio::test]
async fn git_auth_secret_shallow_and_resync_at_the_same_commit() {
    let _machine = pko_tests::serial::shared().await;
    // Smart HTTP (a dumb server cannot serve a shallow fetch), over HTTPS.
    let git_dir = tempfile::tempdir().expect("tmp");
    let repo = GitRepo::start_smart_https(git_dir.path(), Some(("pko", "s3cret")))
        .await
        .expect("git repo");
    let env = Env::with(
        Execution::start_trusting("stf-git", repo.tls_cert().expect("a certificate")).await,
    );
    repo.commit("main", &[("app/Pulumi.yaml", &git_program("one"))])
        .expect("first commit");
    let commit = repo
        .commit("main", &[("app/Pulumi.yaml", &git_program("two"))])
        .expect("second commit");
    env.secret_object(
        "git-creds",
        json!({"username": "pko", "password": "s3cret"}),
    )
    .await;
    // Well above the 60s floor, so the default could not pass for it.
    const RESYNC: u64 = 100;
    env.stack(
        "tracked",
        json!({
            "projectRepo": repo.url(), "branch": "main", "repoDir": "app",
            "gitAuthSecret": "git-creds", "shallow": true,
            "continueResyncOnCommitMatch": true, "resyncFrequencySeconds": RESYNC,
        }),
    )
    .await;
    let status = env.settled("tracked", "succeeded").await;
    assert!(ready(&status));
    assert_eq!(status.outputs.get("message"), Some(&json!("two")));
    let first = status.last_update.expect("last update");
    assert_eq!(
        first.last_successful_commit.as_deref(),
        Some(commit.as_str())
    );

    let shallow: Vec<_> = fixtures::files_under(&env.e.tmp.path().join("pods"))
        .into_iter()
        .filter(|f| f.ends_with(".git/shallow"))
        .collect();
    assert!(!shallow.is_empty(), "the clone is shallow");

    let again = wait_for(
        "the stack to run again at the same commit",
        Duration::from_secs(RESYNC) + WAIT,
        || async {
            let last = env.stacks.get("tracked").await.ok()?.status?.last_update?;
            (last.name != first.name && last.state.as_deref() == Some("succeeded")).then_some(last)
        },
    )
    .await
    .expect("a resync");
    assert_eq!(
        again.last_successful_commit.as_deref(),
        Some(commit.as_str())
    );
    let (before, after) = (
        first.last_resync_time.expect("time").0,
        again.last_resync_time.expect("time").0,
    );
    assert!(
        after.duration_since(before) >= jiff::SignedDuration::from_secs(RESYNC as i64),
        "resynced after {:?}, not before {RESYNC}s",
        after.duration_since(before)
    );
}

/// A file backend's stack without `PULUMI_CONFIG_PASSPHRASE`: pulumi cannot make or open the
/// stack, and the Stack says so, stalled, instead of waiting forever.
#[tokio::test]
async fn a_stack_without_its_passphrase_stalls_saying_so() {
    let _machine = pko_tests::serial::shared().await;
    let env = Env::start("stf-nopass").await;
    env.program(
        "plain",
        json!({}),
        json!({"made": config_map("nopass", json!({"k": "v"}))}),
        json!({}),
    )
    .await;
    let kubeconfig = env.e.plane.kubeconfig_path().display().to_string();
    env.stack(
        "nopass",
        json!({"programRef": {"name": "plain"},
            "envRefs": {"KUBECONFIG": {"type": "Literal", "literal": {"value": kubeconfig}}}}),
    )
    .await;
    let (reason, message) = fixtures::stalled_stack(&env.stacks, "nopass", WAIT).await;
    assert!(
        message.contains("PULUMI_CONFIG_PASSPHRASE"),
        "{reason}: {message}"
    );
    assert_eq!(env.count("nopass").await, 0);
    eprintln!(
        "STALLED {reason}: {message}\n{}",
        env.e.kubelet.logs("nopass")
    );
}

/// The name of Stack `name`'s last Update.
async fn last_update_name(env: &Env, name: &str) -> String {
    env.stacks
        .get(name)
        .await
        .expect("stack")
        .status
        .and_then(|s| s.last_update)
        .and_then(|l| l.name)
        .expect("last update")
}

/// The finished Updates of Stack `name` (and their outputs Secrets), by name.
async fn finished_updates(env: &Env, name: &str) -> (Vec<String>, Vec<String>) {
    let mut updates: Vec<String> = env
        .updates(name)
        .await
        .into_iter()
        .filter(|u| u.metadata.deletion_timestamp.is_none())
        .filter_map(|u| u.metadata.name)
        .collect();
    updates.sort();
    let secrets: Api<Secret> = Api::namespaced(env.client(), &env.e.ns);
    let mut outputs: Vec<String> = secrets
        .list(&ListParams::default())
        .await
        .expect("list secrets")
        .items
        .into_iter()
        .filter_map(|s| s.metadata.name)
        .filter(|n| n.ends_with("-stack-outputs") && n.starts_with(name))
        .collect();
    outputs.sort();
    (updates, outputs)
}

/// `updateHistoryLimit` (unset: 10): after 30 changes a Stack keeps exactly its 10 newest
/// Updates and their outputs Secrets, the last one among them; with a set limit, that many. An
/// Update past its `ttlAfterCompleted` stays while the Stack's status names it, and goes once
/// the next one has finished.
#[tokio::test]
async fn update_history_is_bounded_and_the_last_update_stays() {
    let _machine = pko_tests::serial::shared().await;
    let env = Env::start("stf-history").await;
    env.program(
        "counted",
        json!({"n": {"type": "String"}}),
        json!({}),
        json!({"n": "${n}"}),
    )
    .await;
    env.stack(
        "counted",
        json!({"programRef": {"name": "counted"}, "config": {"ns": env.e.ns, "n": "0"}}),
    )
    .await;
    env.settled("counted", "succeeded").await;
    for n in 1..30 {
        env.patch("counted", json!({"spec": {"config": {"n": n.to_string()}}}))
            .await;
        let status = env.settled("counted", "succeeded").await;
        // Pulumi YAML reads the digits back as a number.
        let seen = status
            .outputs
            .get("n")
            .map(|v| v.to_string().replace('"', ""));
        assert_eq!(seen, Some(n.to_string()));
    }
    let last = last_update_name(&env, "counted").await;
    let kept = wait_for("the history at its default of 10", WAIT, || async {
        let (updates, outputs) = finished_updates(&env, "counted").await;
        (updates.len() == 10 && outputs.len() == 10).then_some((updates, outputs))
    })
    .await;
    let (updates, outputs) = match kept {
        Ok(kept) => kept,
        Err(e) => panic!("{e}: {:?}", finished_updates(&env, "counted").await),
    };
    assert!(updates.contains(&last), "{last} kept: {updates:?}");
    let expected: Vec<String> = updates
        .iter()
        .map(|u| format!("{u}-stack-outputs"))
        .collect();
    assert_eq!(outputs, expected, "each kept Update keeps its outputs");

    // A limit of 2, and a TTL of one second on each new Update.
    env.patch(
        "counted",
        json!({"spec": {"updateHistoryLimit": 2, "config": {"n": "30"},
            "updateTemplate": {"spec": {"ttlAfterCompleted": "1s"}}}}),
    )
    .await;
    env.settled("counted", "succeeded").await;
    let (updates, _) = wait_for("the history at its limit of 2", WAIT, || async {
        let found = finished_updates(&env, "counted").await;
        (found.0.len() == 2 && found.1.len() == 2).then_some(found)
    })
    .await
    .expect("two kept");
    let named = last_update_name(&env, "counted").await;
    assert!(updates.contains(&named));
    // Its TTL has passed, and the Update controller has looked: it stays, since it is the last.
    wait_for("the expired last Update kept", WAIT, || async {
        env.e
            .operator
            .log_text()
            .lines()
            .any(|l| l.contains("kept past its ttlAfterCompleted") && l.contains(&named))
            .then_some(())
    })
    .await
    .expect("the TTL looked at the last Update");
    let (updates, _) = finished_updates(&env, "counted").await;
    assert!(updates.contains(&named), "{named} kept: {updates:?}");
    // The next one finishes: the expired one is no longer named, and goes.
    env.patch("counted", json!({"spec": {"config": {"n": "31"}}}))
        .await;
    env.settled("counted", "succeeded").await;
    wait_for("the expired Update gone", WAIT, || async {
        let (updates, _) = finished_updates(&env, "counted").await;
        (!updates.contains(&named)).then_some(())
    })
    .await
    .expect("gone once not named");
}

/// `commit` pins the source: the Stack deploys that commit, not the branch head after it, and
/// a new `commit` deploys that one.
#[tokio::test]
async fn a_pinned_commit_is_deployed_not_the_branch_head() {
    let _machine = pko_tests::serial::shared().await;
    let git_dir = tempfile::tempdir().expect("tmp");
    let repo = GitRepo::start_smart_https(git_dir.path(), None)
        .await
        .expect("git repo");
    let env = Env::with(
        Execution::start_trusting("stf-commit", repo.tls_cert().expect("a certificate")).await,
    );
    let first = repo
        .commit("main", &[("app/Pulumi.yaml", &git_program("one"))])
        .expect("first commit");
    let head = repo
        .commit("main", &[("app/Pulumi.yaml", &git_program("two"))])
        .expect("second commit");
    env.stack(
        "pinned",
        json!({"projectRepo": repo.url(), "commit": first, "repoDir": "app"}),
    )
    .await;
    let status = env.settled("pinned", "succeeded").await;
    assert_eq!(status.outputs.get("message"), Some(&json!("one")));
    let last = status.last_update.expect("last update");
    assert_eq!(last.last_successful_commit.as_deref(), Some(first.as_str()));

    env.patch("pinned", json!({"spec": {"commit": head}})).await;
    let status = env.settled("pinned", "succeeded").await;
    assert_eq!(status.outputs.get("message"), Some(&json!("two")));
    let last = status.last_update.expect("last update");
    assert_eq!(last.last_successful_commit.as_deref(), Some(head.as_str()));
}

/// `gitAuth.accessToken` (a Secret's key) opens a repository that refuses anonymous clones:
/// the operator lists the branch with it and the workspace clones with it (the server checks
/// every request), and the program runs. Without `gitAuth`, or with a wrong token, the server
/// refuses the listing and the Stack stalls saying so; pinned to a commit (no listing) with a
/// wrong token, the workspace's clone is refused and its Workspace says so.
#[tokio::test]
async fn git_access_token_opens_the_repository_and_a_wrong_or_missing_one_is_refused() {
    let _machine = pko_tests::serial::shared().await;
    let token = format!("glpat-{}", hex::encode(rand::random::<[u8; 12]>()));
    let git_dir = tempfile::tempdir().expect("tmp");
    // A token travels as the password of user `git`, as git hosts take it.
    let repo = GitRepo::start_smart_https(git_dir.path(), Some(("git", &token)))
        .await
        .expect("git repo");
    let env = Env::with(
        Execution::start_trusting("stf-token", repo.tls_cert().expect("a certificate")).await,
    );
    let commit = repo
        .commit("main", &[("app/Pulumi.yaml", &git_program("tokened"))])
        .expect("commit");
    env.secret_object(
        "git-token",
        json!({"token": token, "wrong": format!("glpat-{}", "0".repeat(24))}),
    )
    .await;
    let token_ref = |key: &str| json!({"accessToken": {"type": "Secret", "secret": {"name": "git-token", "key": key}}});
    let tracked = |auth: Value| json!({"projectRepo": repo.url(), "branch": "main", "repoDir": "app", "gitAuth": auth});
    env.stack("tokened", tracked(token_ref("token"))).await;
    env.stack("wrong-token", tracked(token_ref("wrong"))).await;
    env.stack(
        "anonymous",
        json!({"projectRepo": repo.url(), "branch": "main", "repoDir": "app"}),
    )
    .await;
    env.stack(
        "pinned-wrong",
        json!({"projectRepo": repo.url(), "commit": commit, "repoDir": "app",
            "gitAuth": token_ref("wrong")}),
    )
    .await;

    let status = env.settled("tokened", "succeeded").await;
    assert!(ready(&status));
    assert_eq!(status.outputs.get("message"), Some(&json!("tokened")));
    let last = status.last_update.expect("last update");
    assert_eq!(
        last.last_successful_commit.as_deref(),
        Some(commit.as_str())
    );

    for name in ["wrong-token", "anonymous"] {
        let (reason, message) = fixtures::stalled_stack(&env.stacks, name, WAIT).await;
        assert_eq!(reason, "SourceUnavailable", "{name}: {message}");
        assert!(
            message.contains("authentication required or refused; check the git credentials"),
            "{name}: {message}"
        );
    }
    // No listing for a pinned commit: the wrong token reaches the clone, which the server
    // refuses.
    let workspaces: Api<pko_api::workspace::Workspace> = Api::namespaced(env.client(), &env.e.ns);
    let message = wait_for("the clone with a wrong token to fail", WAIT, || async {
        let ws = workspaces.get("pinned-wrong").await.ok()?;
        let ready = ws
            .status?
            .conditions
            .into_iter()
            .find(|c| c.type_ == "Ready")?;
        (ready.status == "False" && ready.message.contains("init container fetch failed"))
            .then_some(ready.message)
    })
    .await
    .unwrap_or_else(|err| panic!("{err}\n{}", env.e.kubelet.logs("pinned-wrong")));
    // git's word for a 401 its credentials could not answer.
    assert!(message.contains("could not read Username"), "{message}");
    assert!(!message.contains(&token), "{message}");
    let runs = env.updates("pinned-wrong").await;
    assert!(runs.is_empty(), "nothing ran: {runs:?}");
}

/// `serviceAccountName` is the identity the workspace runs as: the pod (as the StatefulSet's
/// template has it) gets a token of that account (the harness kubelet mints it, as a kubelet
/// projects one), and the program's provider, given no other credentials, reaches the
/// apiserver as that account. RBAC lets `deployer` write ConfigMaps: its stack creates one. The
/// same program under `bystander`, which RBAC lets do nothing, is refused, and the apiserver's
/// refusal names `system:serviceaccount:<ns>:bystander`.
#[tokio::test]
async fn the_workspace_runs_as_the_stacks_service_account() {
    let _machine = pko_tests::serial::shared().await;
    let env = Env::start("stf-sa").await;
    let client = env.client();
    let ns = env.e.ns.clone();
    for account in ["deployer", "bystander"] {
        pko_tests::kubeauth::service_account(&client, &ns, account)
            .await
            .expect("service account");
    }
    let role: k8s_openapi::api::rbac::v1::Role = serde_json::from_value(json!({
        "metadata": {"name": "config-maps"},
        "rules": [{"apiGroups": [""], "resources": ["configmaps"], "verbs": ["*"]}],
    }))
    .expect("role");
    Api::<k8s_openapi::api::rbac::v1::Role>::namespaced(client.clone(), &ns)
        .create(&PostParams::default(), &role)
        .await
        .expect("create role");
    let binding: k8s_openapi::api::rbac::v1::RoleBinding = serde_json::from_value(json!({
        "metadata": {"name": "deployer-config-maps"},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "config-maps"},
        "subjects": [{"kind": "ServiceAccount", "namespace": ns, "name": "deployer"}],
    }))
    .expect("binding");
    Api::<k8s_openapi::api::rbac::v1::RoleBinding>::namespaced(client.clone(), &ns)
        .create(&PostParams::default(), &binding)
        .await
        .expect("create binding");
    env.program(
        "as-account",
        json!({}),
        json!({"made": config_map("as-account", json!({"k": "v"}))}),
        json!({}),
    )
    .await;
    let literal = |v: &str| json!({"type": "Literal", "literal": {"value": v}});
    for (stack, account) in [("as-deployer", "deployer"), ("as-bystander", "bystander")] {
        env.stack(
            stack,
            json!({
                "programRef": {"name": "as-account"},
                // One pulumi stack each: they share the program and the backend.
                "stack": account,
                "serviceAccountName": account,
                // No KUBECONFIG: the provider takes the pod's own (its account's token).
                "envRefs": {"PULUMI_CONFIG_PASSPHRASE": literal(fixtures::PASSPHRASE)},
            }),
        )
        .await;
    }

    env.settled("as-deployer", "succeeded").await;
    assert_eq!(
        env.count("as-account").await,
        1,
        "deployer made the ConfigMap"
    );
    let status = env.settled("as-bystander", "failed").await;
    let message = status
        .last_update
        .and_then(|l| l.message)
        .unwrap_or_default();
    let logs = env.e.kubelet.logs("as-bystander");
    let refused = format!("User \"system:serviceaccount:{ns}:bystander\" cannot");
    assert!(
        message.contains(&refused) || logs.contains(&refused),
        "{message}\n{logs}"
    );
    assert_eq!(env.count("as-account").await, 1, "bystander made none");
    let sts: Api<k8s_openapi::api::apps::v1::StatefulSet> = Api::namespaced(client.clone(), &ns);
    let pods: Api<k8s_openapi::api::core::v1::Pod> = Api::namespaced(client.clone(), &ns);
    let workspaces: Api<pko_api::workspace::Workspace> = Api::namespaced(client.clone(), &ns);
    for (stack, account) in [("as-deployer", "deployer"), ("as-bystander", "bystander")] {
        let ws = workspaces.get(stack).await.expect("workspace");
        assert_eq!(ws.spec.service_account_name.as_deref(), Some(account));
        let template = sts
            .get(&format!("{stack}-workspace"))
            .await
            .expect("statefulset")
            .spec
            .expect("spec")
            .template
            .spec
            .expect("pod spec");
        assert_eq!(template.service_account_name.as_deref(), Some(account));
        let pod = pods
            .get(&format!("{stack}-workspace-0"))
            .await
            .expect("pod")
            .spec
            .expect("pod spec");
        assert_eq!(pod.service_account_name.as_deref(), Some(account));
    }
}
