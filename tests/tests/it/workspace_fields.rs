//! What Workspace fields make the agent and pulumi do, on the real control plane with the
//! harness as kubelet, the real agent and pulumi CLI: `flux.dir`, config by property path, from
//! a file and as JSON, `pulumiLogLevel`, `serviceTemplate`; a git source fetched shallow with a
//! token; a stack's secrets kept by a `hashivault://` secrets provider. Each test asserts the
//! effect (the program's outputs, the clone, the logs, the Service, the state in the backend).
//!
//! `valueFrom.path` is read by the agent in its own file system: the harness runs the agent on
//! the host, so the tests name a host file where a pod would name a mounted one.

use std::time::Duration;

use base64::Engine;
use k8s_openapi::api::core::v1::{Secret, Service};
use kube::Api;
use kube::api::{Patch, PatchParams, PostParams};
use pko_api::program::Program;
use pko_api::stack::Stack;
use pko_api::workspace::Workspace;
use pko_tests::execution::Execution;
use pko_tests::flux::FluxSource;
use pko_tests::gitrepo::GitRepo;
use pko_tests::vault::Vault;
use pko_tests::{fixtures, wait_for};
use serde_json::{Value, json};

const WAIT: Duration = Duration::from_secs(180);

/// At the artifact's root: what runs if `flux.dir` is ignored.
const ROOT_PROGRAM: &str = "name: fields\nruntime: yaml\noutputs:\n  which: root\n";

/// In `app/`: every config the test sets, each with a default so either stack runs it.
const APP_PROGRAM: &str = r"name: fields
runtime: yaml
config:
  nested:
    type: object
    default: {}
  fromFile:
    type: string
    default: unset
  doc:
    type: object
    default: {}
outputs:
  which: app
  inner: ${nested.inner}
  fromFile: ${fromFile}
  doc: ${doc}
";

fn env_var(name: &str, value: &str) -> Value {
    json!({"name": name, "value": value})
}

fn backend_env(e: &Execution) -> Vec<Value> {
    vec![
        env_var(
            "PULUMI_BACKEND_URL",
            &format!("file://{}", e.tmp.path().join("backend").display()),
        ),
        env_var("PULUMI_CONFIG_PASSPHRASE", fixtures::PASSPHRASE),
    ]
}

async fn create_workspace(e: &Execution, name: &str, spec: Value) {
    let api: Api<Workspace> = Api::namespaced(e.plane.client(), &e.ns);
    api.create(&PostParams::default(), &fixtures::workspace(name, spec))
        .await
        .expect("create workspace");
}

async fn create_secret(e: &Execution, name: &str, key: &str, value: &str) {
    let secret: Secret = serde_json::from_value(json!({
        "apiVersion": "v1", "kind": "Secret", "metadata": {"name": name},
        "stringData": {key: value},
    }))
    .expect("secret");
    Api::<Secret>::namespaced(e.plane.client(), &e.ns)
        .create(&PostParams::default(), &secret)
        .await
        .expect("create secret");
}

/// `flux.dir` picks the program in the artifact's folder; a config item with `path` sets a
/// nested value, `valueFrom.path` reads a file, `valueFrom.json` makes an object of it, all in
/// one stack (pulumi takes JSON values and property paths in separate calls); the outputs say
/// so. `pulumiLogLevel` 3 makes pulumi log at verbosity 3 (lines tagged `"v":3` in the
/// agent's log of pulumi's stderr, none without it); `serviceTemplate.metadata`'s labels and
/// annotations are on the Service.
#[tokio::test]
async fn flux_dir_config_paths_files_json_log_level_and_service_metadata_take_effect() {
    let _machine = pko_tests::serial::shared().await;
    let e = &Execution::start("wsf-config", &[]).await;
    let mut flux = FluxSource::new();
    let artifact = flux
        .publish(
            "main@sha1:0123456789abcdef0123456789abcdef01234567",
            &[
                ("Pulumi.yaml", ROOT_PROGRAM),
                ("app/Pulumi.yaml", APP_PROGRAM),
            ],
        )
        .await
        .expect("artifact");
    let value_file = e.tmp.path().join("value.txt");
    std::fs::write(&value_file, "from a file").expect("value file");
    let doc_file = e.tmp.path().join("doc.json");
    std::fs::write(&doc_file, r#"{"name": "json-doc", "replicas": 2}"#).expect("doc file");
    let agent_env = [env_var("AGENT_LOG_LEVEL", "info,pulumi=debug")];
    create_workspace(
        e,
        "fields",
        json!({
            "flux": {"url": artifact.url, "digest": artifact.digest, "dir": "app"},
            "env": backend_env(e),
            "pulumiLogLevel": 3,
            "podTemplate": {"spec": {"containers": [{"name": "pulumi", "env": agent_env}]}},
            "serviceTemplate": {"metadata": {
                "labels": {"team": "fields"},
                "annotations": {"example.com/owner": "workspace-fields"},
            }},
            "stacks": [
                {"name": "dev", "create": true, "config": [
                    {"key": "nested.inner", "path": true, "value": "deep"},
                    {"key": "fromFile", "valueFrom": {"path": value_file.display().to_string()}},
                    {"key": "doc", "valueFrom": {"path": doc_file.display().to_string(), "json": true}},
                ]},
            ],
        }),
    )
    .await;
    let workspaces: Api<Workspace> = Api::namespaced(e.plane.client(), &e.ns);
    let logs = || e.kubelet.logs("fields");
    fixtures::ready_workspace(&workspaces, "fields", WAIT, logs).await;

    let up = |stack: &'static str| {
        let name = format!("up-{stack}");
        async move {
            let status = fixtures::completed_update(
                e.plane.client(),
                &e.ns,
                ("fields", stack),
                &name,
                json!({"type": "up"}),
                WAIT,
                logs,
            )
            .await;
            assert!(
                status
                    .conditions
                    .iter()
                    .any(|c| c.type_ == "Failed" && c.status == "False"),
                "{status:?}\n{}",
                logs()
            );
            fixtures::update_outputs(e.plane.client(), &e.ns, &status).await
        }
    };
    let dev = up("dev").await;
    assert_eq!(dev.get("which"), Some(&json!("app")), "{dev:?}");
    assert_eq!(dev.get("inner"), Some(&json!("deep")), "{dev:?}");
    assert_eq!(dev.get("fromFile"), Some(&json!("from a file")), "{dev:?}");
    assert_eq!(
        dev.get("doc"),
        Some(&json!({"name": "json-doc", "replicas": 2})),
        "{dev:?}"
    );

    let agent_log = std::fs::read_to_string(e.tmp.path().join("pods/fields-workspace/agent.log"))
        .expect("agent log");
    assert!(
        agent_log.lines().any(|l| l.contains(r#""v":3"#)),
        "pulumi logged at verbosity 3:\n{}",
        logs()
    );

    let service: Service = Api::namespaced(e.plane.client(), &e.ns)
        .get("fields-workspace")
        .await
        .expect("service");
    let labels = service.metadata.labels.unwrap_or_default();
    assert_eq!(labels.get("team").map(String::as_str), Some("fields"));
    assert_eq!(
        labels.get("auto.pulumi.com/component").map(String::as_str),
        Some("workspace"),
        "the system labels stay"
    );
    let annotations = service.metadata.annotations.unwrap_or_default();
    assert_eq!(
        annotations.get("example.com/owner").map(String::as_str),
        Some("workspace-fields")
    );
}

/// `git.shallow` fetches the one commit asked for (a clone of depth 1 from a repository of two
/// commits); `git.auth.token` opens a repository that refuses anonymous clones (a Workspace
/// without it fails init with the server's 401).
#[tokio::test]
async fn a_git_source_is_fetched_shallow_with_a_token() {
    let _machine = pko_tests::serial::shared().await;
    let dir = tempfile::tempdir().expect("tmp");
    let token = format!("glpat-{}", hex::encode(rand::random::<[u8; 12]>()));
    // Smart HTTP: the dumb protocol cannot fetch a shallow history.
    let repo = GitRepo::start_smart_https(&dir.path().join("git"), Some(("git", &token)))
        .await
        .expect("git server");
    let program =
        |which: &str| format!("name: shallow\nruntime: yaml\noutputs:\n  which: {which}\n");
    repo.commit("main", &[("Pulumi.yaml", &program("first"))])
        .expect("first commit");
    let head = repo
        .commit("main", &[("Pulumi.yaml", &program("second"))])
        .expect("second commit");
    let e = Execution::start_trusting("wsf-git", repo.tls_cert().expect("a certificate")).await;
    create_secret(&e, "git-token", "token", &token).await;
    let git = |auth: Value| {
        json!({
            "git": {"url": repo.url(), "ref": "main", "shallow": true, "auth": auth},
            "env": backend_env(&e),
            "stacks": [{"name": "dev", "create": true}],
        })
    };
    create_workspace(
        &e,
        "shallow",
        git(json!({"token": {"name": "git-token", "key": "token"}})),
    )
    .await;
    let workspaces: Api<Workspace> = Api::namespaced(e.plane.client(), &e.ns);
    fixtures::ready_workspace(&workspaces, "shallow", WAIT, || e.kubelet.logs("shallow")).await;

    let source = e
        .tmp
        .path()
        .join("pods/shallow-workspace/volumes/share/source");
    let git_out = |args: &[&str]| {
        let out = std::process::Command::new("git")
            .arg("-C")
            .arg(&source)
            .args(args)
            .env("GIT_CONFIG_GLOBAL", "/dev/null")
            .output()
            .expect("git");
        assert!(out.status.success(), "{out:?}");
        String::from_utf8_lossy(&out.stdout).trim().to_owned()
    };
    assert_eq!(git_out(&["rev-parse", "HEAD"]), head);
    assert_eq!(
        git_out(&["rev-list", "--count", "HEAD"]),
        "1",
        "one commit of two fetched"
    );
    assert_eq!(git_out(&["rev-parse", "--is-shallow-repository"]), "true");

    // Without the token the server refuses the clone.
    create_workspace(&e, "anonymous", git(Value::Null)).await;
    let message = wait_for("the anonymous clone to fail init", WAIT, || async {
        let ws = workspaces.get("anonymous").await.ok()?;
        let ready = ws
            .status?
            .conditions
            .into_iter()
            .find(|c| c.type_ == "Ready")?;
        (ready.status == "False" && ready.message.contains("init container fetch failed"))
            .then_some(ready.message)
    })
    .await
    .unwrap_or_else(|err| panic!("{err}\n{}", e.kubelet.logs("anonymous")));
    // git's word for a 401 with no credentials to answer it.
    assert!(message.contains("could not read Username"), "{message}");
}

/// A Stack with `secretsProvider: hashivault://<key>` keeps its secrets with that Vault key
/// (here the transit stand-in, [`Vault`]): the field travels to the Workspace's
/// `stacks[].secretsProvider`, from which the agent's `stack init` takes it; the server
/// encrypts the stack's data key and the state in the file backend records the cloud provider
/// with that very ciphertext; the program gets the secret config's plaintext (decrypted with
/// the key the server gives back), and the plaintext is nowhere in the state. No passphrase is
/// given: none is needed.
#[tokio::test]
async fn a_stack_keeps_its_secrets_with_a_hashivault_secrets_provider() {
    let _machine = pko_tests::serial::shared().await;
    let vault_token = format!("hvs.{}", hex::encode(rand::random::<[u8; 12]>()));
    let vault = Vault::start(&vault_token).await.expect("vault");
    let e = Execution::start("wsf-vault", &[]).await;
    let programs: Api<Program> = Api::namespaced(e.plane.client(), &e.ns);
    fixtures::published_program(
        &programs,
        "vaulted",
        json!({
            "configuration": {"password": {"type": "String"}},
            "outputs": {"password": "${password}"},
        }),
        WAIT,
    )
    .await
    .expect("artifact");
    let password = format!("pw-{}", hex::encode(rand::random::<[u8; 8]>()));
    create_secret(&e, "db", "password", &password).await;
    let literal = |v: &str| json!({"type": "Literal", "literal": {"value": v}});
    let backend = e.tmp.path().join("backend");
    let stack = fixtures::stack(
        "vaulted",
        json!({
            "stack": "dev",
            "backend": format!("file://{}", backend.display()),
            "programRef": {"name": "vaulted"},
            "secretsProvider": "hashivault://pko-stack",
            "secretsRef": {"password": {"type": "Secret", "secret": {"name": "db", "key": "password"}}},
            "envRefs": {
                "VAULT_ADDR": literal(&vault.url()),
                "VAULT_TOKEN": literal(&vault_token),
            },
        }),
    );
    let stacks: Api<Stack> = Api::namespaced(e.plane.client(), &e.ns);
    stacks
        .create(&PostParams::default(), &stack)
        .await
        .expect("create stack");
    let status = wait_for("the stack to be Ready", WAIT, || async {
        let status = stacks.get("vaulted").await.ok()?.status?;
        status
            .conditions
            .iter()
            .any(|c| c.type_ == "Ready" && c.status == "True")
            .then_some(status)
    })
    .await;
    let status = match status {
        Ok(status) => status,
        Err(err) => {
            let stack = stacks.get("vaulted").await.ok().and_then(|s| s.status);
            let ws = Api::<Workspace>::namespaced(e.plane.client(), &e.ns)
                .get("vaulted")
                .await
                .ok()
                .and_then(|w| w.status);
            panic!(
                "{err}; vault saw {:?}\nstack {stack:?}\nworkspace {ws:?}\n{}",
                vault.seen(),
                e.kubelet.logs("vaulted"),
            )
        }
    };
    assert_eq!(status.outputs.get("password"), Some(&json!("[secret]")));

    // The Stack's field is the Workspace's, for its one stack: the agent reads it from there.
    let ws = Api::<Workspace>::namespaced(e.plane.client(), &e.ns)
        .get("vaulted")
        .await
        .expect("workspace");
    let ws_stacks: Vec<(&str, Option<&str>)> = ws
        .spec
        .stacks
        .iter()
        .map(|s| (s.name.as_str(), s.secrets_provider.as_deref()))
        .collect();
    assert_eq!(ws_stacks, [("dev", Some("hashivault://pko-stack"))]);

    let update = status
        .last_update
        .and_then(|u| u.name)
        .expect("last update");
    let updates: Api<pko_api::update::Update> = Api::namespaced(e.plane.client(), &e.ns);
    let update = updates
        .get(&update)
        .await
        .expect("update")
        .status
        .expect("update status");
    let outputs = fixtures::update_outputs(e.plane.client(), &e.ns, &update).await;
    assert_eq!(
        outputs.get("password"),
        Some(&json!(password)),
        "the program got the plaintext"
    );

    let seen = vault.seen();
    assert!(seen.refused.is_empty(), "{seen:?}");
    let issued: Vec<&str> = seen
        .encrypted
        .iter()
        .filter(|(key, _)| key == "pko-stack")
        .map(|(_, ciphertext)| ciphertext.as_str())
        .collect();
    assert!(
        !issued.is_empty(),
        "the server encrypted the data key: {seen:?}"
    );
    assert!(
        seen.decrypted.iter().any(|k| k == "pko-stack"),
        "the server decrypted it for a command: {seen:?}"
    );

    let state_file = backend.join(".pulumi/stacks/vaulted/dev.json");
    let text = std::fs::read_to_string(&state_file).expect("state file");
    assert!(
        !text.contains(&password),
        "the plaintext is not in the state"
    );
    let state: Value = serde_json::from_str(&text).expect("state json");
    let provider = &state["checkpoint"]["latest"]["secrets_providers"];
    assert_eq!(provider["type"], json!("cloud"), "{provider}");
    assert_eq!(
        provider["state"]["url"],
        json!("hashivault://pko-stack"),
        "{provider}"
    );
    let key = provider["state"]["encryptedkey"]
        .as_str()
        .and_then(|k| base64::engine::general_purpose::STANDARD.decode(k).ok())
        .map(|k| String::from_utf8_lossy(&k).into_owned())
        .expect("encryptedkey");
    assert!(
        issued.contains(&key.as_str()),
        "the data key's ciphertext is one the server issued: {key} not in {issued:?}"
    );
}

/// A stack that cannot be initialized (a file backend without its passphrase) stalls the
/// Workspace `InitializationFailed`, naming the cause. A retry of the same failure keeps that
/// stall and writes nothing, rather than flip to `Initializing` and back on every retry.
#[tokio::test]
async fn a_failed_stack_initialization_stays_stalled_while_it_is_retried() {
    let _machine = pko_tests::serial::shared().await;
    let e = &Execution::start("wsf-nopass", &[]).await;
    let mut flux = FluxSource::new();
    let artifact = flux
        .publish(
            "main@sha1:89abcdef0123456789abcdef0123456789abcdef",
            &[("Pulumi.yaml", ROOT_PROGRAM)],
        )
        .await
        .expect("artifact");
    let backend = format!("file://{}", e.tmp.path().join("backend").display());
    create_workspace(
        e,
        "nopass",
        json!({
            "flux": {"url": artifact.url, "digest": artifact.digest},
            "env": [env_var("PULUMI_BACKEND_URL", &backend)],
            "stacks": [{"name": "dev", "create": true}],
        }),
    )
    .await;
    let workspaces: Api<Workspace> = Api::namespaced(e.plane.client(), &e.ns);
    let stalled = wait_for("the workspace to stall", WAIT, || async {
        let status = workspaces.get("nopass").await.ok()?.status?;
        status
            .conditions
            .into_iter()
            .find(|c| c.type_ == "Stalled" && c.status == "True")
    })
    .await
    .unwrap_or_else(|err| panic!("{err}\n{}", e.kubelet.logs("nopass")));
    assert_eq!(stalled.reason, "InitializationFailed", "{stalled:?}");
    assert!(
        stalled.message.contains("PULUMI_CONFIG_PASSPHRASE"),
        "{stalled:?}"
    );

    let failures = || {
        e.kubelet
            .logs("nopass")
            .matches("stack not selected")
            .count()
    };
    let before = failures();
    // Any change to the object wakes the controller, which tries again at once.
    let poked = workspaces
        .patch(
            "nopass",
            &PatchParams::default(),
            &Patch::Merge(json!({"metadata": {"annotations": {"example.com/poke": "1"}}})),
        )
        .await
        .expect("poke");
    wait_for("the retry to fail too", WAIT, || async {
        (failures() > before).then_some(())
    })
    .await
    .unwrap_or_else(|err| panic!("{err}\n{}", e.kubelet.logs("nopass")));
    let after = workspaces.get("nopass").await.expect("get");
    assert_eq!(
        after.metadata.resource_version, poked.metadata.resource_version,
        "the retry wrote the Workspace: {:?}",
        after.status
    );
}
