//! pko-rs with PKO v2.9's agent contract, on the real apiserver:
//! - our agent binary takes the command lines PKO's manager gives it (`tini agent -- serve
//!   --auth-mode kube …`, `init` in `sh -c`) and reviews every caller's token with the real
//!   TokenReview and SubjectAccessReview;
//! - a Stack whose Workspace asks for PKO's contract runs `up`, `preview`, `refresh` and
//!   `destroy` through PKO's real agent binary (built by `tools/build.sh pko`), the environment
//!   moved to the pod spec once since PKO's agent has no `SetEnvironmentVariables`;
//! - a call the agent refuses (no `system:auth-delegator` for the workspace's account, no
//!   `workspaces/rpc` for the operator's) is a condition that says what to fix.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use k8s_openapi::api::apps::v1::StatefulSet;
use k8s_openapi::api::core::v1::Event;
use kube::Api;
use kube::api::{DeleteParams, ListParams, PostParams};
use pko_agent::client::{Target, connect};
use pko_agent::proto as pb;
use pko_api::stack::Stack;
use pko_api::update::Update;
use pko_api::workspace::Workspace;
use pko_tests::agent::{StaticServer, agent_binary, free_port, pulumi_env};
use pko_tests::execution::Execution;
use pko_tests::{ControlPlane, kubeauth, spawn_guarded, wait_for};
use serde_json::{Value, json};
use sha2::{Digest, Sha256};
use tonic::Code;

const WAIT: Duration = Duration::from_secs(180);

/// Copies the agent as PKO's bootstrap does (`cp /agent /tini /share/`): one binary, two names.
fn bootstrap(share: &Path) -> (PathBuf, PathBuf) {
    std::fs::create_dir_all(share).expect("share");
    let (agent, tini) = (share.join("agent"), share.join("tini"));
    for to in [&agent, &tini] {
        std::fs::copy(agent_binary().expect("agent binary"), to).expect("copy the agent");
    }
    (agent, tini)
}

/// A plaintext client of the agent at `port` presenting `token`.
async fn call_version(port: u16, token: Option<String>) -> Result<String, tonic::Status> {
    let mut client = connect(&Target {
        address: format!("127.0.0.1:{port}"),
        ca_pem: None,
        server_name: None,
        token,
        connect_timeout: Duration::from_secs(5),
    })
    .await
    .map_err(|e| tonic::Status::unavailable(e.to_string()))?;
    client
        .pulumi_version(pb::PulumiVersionRequest {})
        .await
        .map(|r| r.into_inner().version)
}

/// `tini agent -- serve …` as PKO's manager writes it, with the pod's service account as
/// `KUBECONFIG`; returns the process and its port once it listens.
async fn serve_as_pko_does(
    plane: &ControlPlane,
    ns: &str,
    pod_account: &str,
    workspace: &str,
    dir: &Path,
) -> (pko_tests::ChildGuard, u16) {
    let share = dir.join("share");
    let (agent, tini) = bootstrap(&share);
    let project = share.join("workspace");
    std::fs::create_dir_all(&project).expect("project");
    std::fs::write(project.join("Pulumi.yaml"), "name: p\nruntime: yaml\n").expect("Pulumi.yaml");
    let token = kubeauth::token(&plane.client(), ns, pod_account, None)
        .await
        .expect("pod token");
    let kubeconfig = kubeauth::kubeconfig_with_token(plane, &token, &dir.join("kubeconfig"))
        .expect("kubeconfig");
    let port = free_port().expect("port");
    let mut cmd = std::process::Command::new(&tini);
    cmd.arg(&agent)
        .args(["--", "serve", "--workspace"])
        .arg(&project)
        .args(["--skip-install", "--env-file"])
        .arg(share.join(".env"))
        .args(["--auth-mode", "kube", "--kube-audience"])
        .arg(format!("{workspace}.{ns}"))
        .args([
            "--kube-workspace-namespace",
            ns,
            "--kube-workspace-name",
            workspace,
        ])
        .args(["--pulumi-log-level", "1", "--host", "127.0.0.1", "--port"])
        .arg(port.to_string())
        .envs(pulumi_env(dir).expect("pulumi env"))
        .env("KUBECONFIG", &kubeconfig)
        .env("POD_NAMESPACE", ns)
        .env("POD_SA_NAME", pod_account)
        .env("AGENT_MEMLIMIT", "67108864")
        .env("PULUMI_ENV", share.join(".env"));
    let log = dir.join("agent.log");
    let mut guard = spawn_guarded(cmd, "tini agent -- serve", &log).expect("spawn");
    let listening = wait_for("the agent to listen", Duration::from_secs(30), || {
        let exited = guard.try_wait().ok().flatten();
        async move {
            if exited.is_some() {
                return Some(false);
            }
            tokio::net::TcpStream::connect(("127.0.0.1", port))
                .await
                .ok()
                .map(|_| true)
        }
    })
    .await;
    assert!(
        matches!(listening, Ok(true)),
        "{listening:?}:\n{}",
        guard.log_tail(30)
    );
    (guard, port)
}

#[tokio::test]
async fn our_agent_takes_pkos_command_line_and_reviews_every_token_with_the_apiserver() {
    let _machine = pko_tests::serial::shared().await;
    let plane = ControlPlane::shared().await;
    let ns = plane.namespace("interop-kube").await.expect("namespace");
    let client = plane.client();
    for account in ["workspace", "undelegated", "operator", "stranger"] {
        kubeauth::service_account(&client, &ns, account)
            .await
            .expect("service account");
    }
    kubeauth::bind_auth_delegator(&client, &ns, "workspace")
        .await
        .expect("auth-delegator");
    kubeauth::grant_workspace_rpc(&client, &ns, &ns, "operator")
        .await
        .expect("rpc grant");
    let tmp = tempfile::tempdir().expect("tmp");
    let (mut agent, port) = serve_as_pko_does(plane, &ns, "workspace", "ws1", tmp.path()).await;
    let token = |account: &'static str, audience: Option<String>| {
        let (client, ns) = (client.clone(), ns.clone());
        async move {
            kubeauth::token(&client, &ns, account, audience.as_deref())
                .await
                .expect("token")
        }
    };
    let audience = Some(format!("ws1.{ns}"));

    // The operator's token for this workspace's audience: answered.
    let version = call_version(port, Some(token("operator", audience.clone()).await))
        .await
        .expect("the operator is let in");
    assert!(version.starts_with("v3."), "{version}");
    // No token.
    let none = call_version(port, None).await.expect_err("no token");
    assert_eq!(none.code(), Code::Unauthenticated);
    assert_eq!(none.message(), "Request unauthenticated with Bearer");
    // The apiserver's own audience, or another workspace's: not for this agent.
    for other in [None, Some(format!("ws2.{ns}"))] {
        let refused = call_version(port, Some(token("operator", other.clone()).await))
            .await
            .expect_err("wrong audience");
        assert_eq!(
            refused.code(),
            Code::Unauthenticated,
            "{other:?}: {refused:?}"
        );
    }
    // Someone whom RBAC does not let use the workspace.
    let denied = call_version(port, Some(token("stranger", audience.clone()).await))
        .await
        .expect_err("no workspaces/rpc");
    assert_eq!(denied.code(), Code::PermissionDenied);
    assert!(
        denied
            .message()
            .contains(&format!("may not use workspaces/rpc of {ns}/ws1")),
        "{denied:?}"
    );

    // SIGTERM to tini alone (as a container runtime sends it to PID 1) reaches the agent,
    // which stops; tini exits with its status. Waited for on this runtime, which also closes
    // the clients' connections the agent's graceful stop waits for.
    let sent = std::process::Command::new("kill")
        .args(["-TERM", &agent.pid().to_string()])
        .status()
        .expect("kill");
    assert!(sent.success());
    let status = wait_for("tini to exit", Duration::from_secs(60), || {
        let exited = agent.try_wait().ok().flatten();
        async move { exited }
    })
    .await
    .unwrap_or_else(|e| panic!("{e}: {}", agent.log_tail(20)));
    assert!(status.success(), "{status}: {}", agent.log_tail(20));
    let log = agent.log_tail(40);
    assert!(log.contains("stopped"), "{log}");

    // A pod whose service account may not review tokens refuses everyone, and says why.
    let other = tmp.path().join("undelegated");
    let (undelegated, port) = serve_as_pko_does(plane, &ns, "undelegated", "ws1", &other).await;
    let refused = call_version(port, Some(token("operator", audience).await))
        .await
        .expect_err("no auth-delegator");
    assert_eq!(refused.code(), Code::Unauthenticated);
    assert_eq!(refused.message(), "TokenReview API is unavailable");
    let log = undelegated.log_tail(40);
    assert!(
        log.contains(&format!(
            "{ns}/undelegated may not create TokenReviews or SubjectAccessReviews: bind it to the ClusterRole system:auth-delegator"
        )),
        "{log}"
    );
}

fn targz(files: &[(&str, &[u8])]) -> Vec<u8> {
    let gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::default());
    let mut builder = tar::Builder::new(gz);
    for (path, data) in files {
        let mut header = tar::Header::new_gnu();
        header.set_size(data.len() as u64);
        header.set_mode(0o644);
        builder
            .append_data(&mut header, path, *data)
            .expect("append");
    }
    builder.into_inner().expect("tar").finish().expect("gzip")
}

#[tokio::test]
async fn pkos_fetch_scripts_run_our_agent_init() {
    let _machine = pko_tests::serial::shared().await;
    let tmp = tempfile::tempdir().expect("tmp");
    let share = tmp.path().join("share");
    let (agent, _) = bootstrap(&share);
    let artifact = targz(&[("proj/Pulumi.yaml", b"name: fetched\nruntime: yaml\n")]);
    let digest = format!("sha256:{}", hex::encode(Sha256::digest(&artifact)));
    let server = StaticServer::start(HashMap::from([("/a.tar.gz".to_owned(), artifact)]))
        .await
        .expect("server");
    // PKO's flux script, with its paths in this test's folder.
    let script = format!(
        "{a} init -t {s}/source --flux-url \"$FLUX_URL\" --flux-digest \"$FLUX_DIGEST\" &&\nln -s \"{s}/source/$FLUX_DIR\" {s}/workspace",
        a = agent.display(),
        s = share.display()
    );
    let out = tokio::process::Command::new("sh")
        .args(["-c", &script])
        .env("FLUX_URL", server.url("/a.tar.gz"))
        .env("FLUX_DIGEST", &digest)
        .env("FLUX_DIR", "proj")
        .env("PULUMI_ENV", share.join(".env"))
        .stdin(Stdio::null())
        .output()
        .await
        .expect("sh");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let project = std::fs::read_to_string(share.join("workspace/Pulumi.yaml")).expect("linked");
    assert!(project.contains("name: fetched"), "{project}");

    // The project-info script writes a project file with PKO's flags.
    let info = tmp.path().join("info");
    let out = tokio::process::Command::new("sh")
        .args([
            "-c",
            &format!(
                "{} init -t {} --project-name \"$PROJECT_NAME\" --project-runtime \"$PROJECT_RUNTIME\"",
                agent.display(),
                info.display()
            ),
        ])
        .env("PROJECT_NAME", "named")
        .env("PROJECT_RUNTIME", "yaml")
        .output()
        .await
        .expect("sh");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let written = std::fs::read_to_string(info.join("Pulumi.yaml")).expect("project file");
    assert!(written.contains("named"), "{written}");

    // PKO's `version` subcommand, and a bad digest fails the script as PKO's does.
    let out = tokio::process::Command::new(&agent)
        .arg("version")
        .output()
        .await
        .expect("version");
    assert!(String::from_utf8_lossy(&out.stdout).starts_with("pko-agent "));
    let out = tokio::process::Command::new("sh")
        .args(["-c", &script.replace("/source", "/other")])
        .env("FLUX_URL", server.url("/a.tar.gz"))
        .env("FLUX_DIGEST", format!("sha256:{}", "0".repeat(64)))
        .env("FLUX_DIR", "proj")
        .output()
        .await
        .expect("sh");
    assert!(!out.status.success());
}

/// The service accounts PKO's auth mode needs, in namespace `ns`: `pulumi` for the workspace
/// pods (with `system:auth-delegator` when `delegated`), `pko-rs-operator` for the operator
/// (allowed to use `workspaces/rpc` when `granted`).
async fn accounts(plane: &ControlPlane, ns: &str, delegated: bool, granted: bool) {
    let client = plane.client();
    for account in ["pulumi", "pko-rs-operator"] {
        kubeauth::service_account(&client, ns, account)
            .await
            .expect("service account");
    }
    if delegated {
        kubeauth::bind_auth_delegator(&client, ns, "pulumi")
            .await
            .expect("auth-delegator");
    }
    if granted {
        kubeauth::grant_workspace_rpc(&client, ns, ns, "pko-rs-operator")
            .await
            .expect("rpc grant");
    }
}

/// An execution environment whose operator mints tokens of `pko-rs-operator` in the test's
/// namespace, with `extra` arguments.
async fn pko_mode_execution(prefix: &str, extra: &[&str]) -> Execution {
    Execution::start_with(prefix, |ns| {
        let mut args = vec![
            "--service-account-name=pko-rs-operator".to_owned(),
            format!("--service-account-namespace={ns}"),
        ];
        args.extend(extra.iter().map(|a| (*a).to_owned()));
        args
    })
    .await
}

fn pko_stack(backend: &Path, spec: Value) -> Stack {
    pko_tests::fixtures::file_backend_stack(
        "interop",
        backend,
        pko_tests::fixtures::merged(
            json!({
                "programRef": {"name": "interop"},
                "config": {"greeting": "hello"},
                "workspaceTemplate": {
                    "metadata": {"annotations": {"pko-rs.dev/agent": "pko"}},
                    "spec": {"serviceAccountName": "pulumi"},
                },
            }),
            spec,
        ),
    )
}

/// Waits for the Update `name` to complete; returns whether it failed and its message.
async fn completed(updates: &Api<Update>, name: &str) -> (bool, String) {
    wait_for(&format!("update {name} to complete"), WAIT, || async {
        let status = updates.get(name).await.ok()?.status?;
        let complete = status
            .conditions
            .iter()
            .any(|c| c.type_ == "Complete" && c.status == "True");
        let failed = status
            .conditions
            .iter()
            .any(|c| c.type_ == "Failed" && c.status == "True");
        complete.then(|| (failed, status.message.clone().unwrap_or_default()))
    })
    .await
    .expect("complete")
}

#[tokio::test]
async fn a_stack_runs_up_preview_refresh_and_destroy_through_pkos_agent() {
    let _machine = pko_tests::serial::shared().await;
    let e = pko_mode_execution("interop-pko", &[]).await;
    let (plane, ns) = (e.plane, e.ns.clone());
    accounts(plane, &ns, true, true).await;
    let client = plane.client();
    let backend = e.tmp.path().join("backend");
    let programs: Api<pko_api::program::Program> = Api::namespaced(client.clone(), &ns);
    programs
        .create(
            &PostParams::default(),
            &pko_tests::fixtures::program(
                "interop",
                json!({
                    "configuration": {"greeting": {"type": "String"}},
                    "outputs": {"message": "${greeting}-from-pkos-agent"},
                }),
            ),
        )
        .await
        .expect("program");
    let stacks: Api<Stack> = Api::namespaced(client.clone(), &ns);
    stacks
        .create(
            &PostParams::default(),
            &pko_stack(&backend, json!({"destroyOnFinalize": true})),
        )
        .await
        .expect("stack");

    // up
    let status = wait_for("the stack's outputs", WAIT, || async {
        let status = stacks.get("interop").await.ok()?.status?;
        let ready = status
            .conditions
            .iter()
            .any(|c| c.type_ == "Ready" && c.status == "True");
        (ready && status.outputs.get("message") == Some(&json!("hello-from-pkos-agent")))
            .then_some(status)
    })
    .await
    .unwrap_or_else(|err| {
        panic!(
            "{err}: {:?}\n{}",
            futures::executor::block_on(stacks.get("interop"))
                .ok()
                .and_then(|s| s.status),
            e.kubelet.logs("interop")
        )
    });
    let last = status.last_update.expect("lastUpdate");
    assert_eq!(
        (last.type_.as_deref(), last.state.as_deref()),
        (Some("up"), Some("succeeded"))
    );

    // The pod is PKO's layout, with PKO's agent, and the environment on the container.
    let sts: Api<StatefulSet> = Api::namespaced(client.clone(), &ns);
    let pod = sts
        .get("interop-workspace")
        .await
        .expect("statefulset")
        .spec
        .expect("spec")
        .template;
    let pod = serde_json::to_value(&pod).expect("json");
    let bootstrap = &pod["spec"]["initContainers"][0];
    assert_eq!(
        bootstrap["args"],
        json!(["cp", "/agent", "/tini", "/share/"])
    );
    assert!(
        bootstrap["image"]
            .as_str()
            .is_some_and(|i| i.contains("pulumi-kubernetes-operator")),
        "{bootstrap}"
    );
    let agent = &pod["spec"]["containers"][0];
    assert_eq!(agent["command"][0], "/share/tini");
    assert!(
        agent["env"]
            .as_array()
            .is_some_and(|env| env.iter().any(|v| v["name"] == "PULUMI_BACKEND_URL")),
        "{agent}"
    );
    assert!(
        pod["metadata"]["annotations"]["pko-rs.dev/env-in-pod-spec"]
            .as_str()
            .is_some_and(|i| i.contains("pulumi-kubernetes-operator")),
        "{pod}"
    );
    let logs = e.kubelet.logs("interop");
    assert!(
        logs.contains("Pulumi Kubernetes Agent"),
        "PKO's agent ran:\n{logs}"
    );
    let events: Api<Event> = Api::namespaced(client.clone(), &ns);
    let moved = events
        .list(&ListParams::default())
        .await
        .expect("events")
        .items
        .into_iter()
        .filter(|ev| ev.reason.as_deref() == Some("EnvironmentOnPod"))
        .count();
    assert_eq!(moved, 1, "the environment moved to the pod once");

    // preview and refresh, as Updates of the workspace.
    let updates: Api<Update> = Api::namespaced(client.clone(), &ns);
    let workspace_uid = Api::<Workspace>::namespaced(client.clone(), &ns)
        .get("interop")
        .await
        .expect("workspace")
        .metadata
        .uid
        .expect("uid");
    for kind in ["preview", "refresh"] {
        let name = format!("interop-{kind}");
        // Owned by the Workspace: an Update without a controller is canceled, as PKO does.
        let update = pko_tests::fixtures::update(
            &name,
            "interop",
            &workspace_uid,
            json!({"workspaceName": "interop", "stackName": "dev", "type": kind}),
        );
        updates
            .create(&PostParams::default(), &update)
            .await
            .expect("create update");
        let (failed, message) = completed(&updates, &name).await;
        assert!(!failed, "{kind}: {message}\n{}", e.kubelet.logs("interop"));
    }

    // A drift check (a preview-only refresh) is refused by name: PKO's agent would ignore
    // `preview_only` and refresh for real, writing the state. Nothing ran: the backend's
    // history of the stack is as it was.
    let history = || pko_tests::fixtures::files_under(&backend.join(".pulumi/history")).len();
    let before = history();
    let check = pko_tests::fixtures::update(
        "interop-check",
        "interop",
        &workspace_uid,
        json!({"workspaceName": "interop", "stackName": "dev", "type": "refresh", "previewOnly": true}),
    );
    updates
        .create(&PostParams::default(), &check)
        .await
        .expect("create the check");
    let (failed, message) = completed(&updates, "interop-check").await;
    assert!(failed, "{message}");
    assert!(
        message.contains("refresh-preview-only") && message.contains("nothing was run"),
        "{message}"
    );
    let reason = updates
        .get("interop-check")
        .await
        .expect("check")
        .status
        .expect("status")
        .conditions
        .into_iter()
        .find(|c| c.type_ == "Failed")
        .map(|c| c.reason);
    assert_eq!(reason.as_deref(), Some("PreviewOnlyUnsupported"));
    assert!(before > 0, "the history is where the test looks");
    assert_eq!(history(), before, "no refresh ran");

    // destroy: the finalizer runs it through the same agent.
    stacks
        .delete("interop", &DeleteParams::default())
        .await
        .expect("delete");
    wait_for("the stack to be gone", WAIT, || async {
        stacks
            .get_opt("interop")
            .await
            .ok()?
            .is_none()
            .then_some(())
    })
    .await
    .expect("destroyed and gone");
    let destroy = updates
        .list(&ListParams::default())
        .await
        .expect("updates")
        .items
        .into_iter()
        .find(|u| {
            u.spec
                .type_
                .is_some_and(|t| serde_json::to_value(t).ok() == Some(json!("destroy")))
        })
        .expect("a destroy update");
    let conditions = destroy.status.expect("status").conditions;
    assert!(
        conditions
            .iter()
            .any(|c| c.type_ == "Failed" && c.status == "False"),
        "{conditions:?}"
    );
}

/// The message of the workspace's condition that names `needle`, once there is one.
async fn condition_naming(workspaces: &Api<Workspace>, needle: &str) -> (String, String) {
    wait_for(&format!("a condition naming {needle}"), WAIT, || async {
        let status = workspaces.get("interop").await.ok()?.status?;
        status
            .conditions
            .iter()
            .find(|c| c.status != "True" || c.type_ == "Stalled")
            .filter(|c| c.message.contains(needle))
            .map(|c| (c.reason.clone(), c.message.clone()))
    })
    .await
    .expect("condition")
}

#[tokio::test]
async fn a_refused_call_says_what_to_fix() {
    let _machine = pko_tests::serial::shared().await;
    let e = pko_mode_execution("interop-refused", &[]).await;
    let (plane, ns) = (e.plane, e.ns.clone());
    // Neither the auth-delegator binding nor the workspaces/rpc grant yet.
    accounts(plane, &ns, false, false).await;
    let client = plane.client();
    let backend = e.tmp.path().join("backend");
    let programs: Api<pko_api::program::Program> = Api::namespaced(client.clone(), &ns);
    programs
        .create(
            &PostParams::default(),
            &pko_tests::fixtures::program(
                "interop",
                json!({"configuration": {"greeting": {"type": "String"}}, "outputs": {"m": "${greeting}"}}),
            ),
        )
        .await
        .expect("program");
    let stacks: Api<Stack> = Api::namespaced(client.clone(), &ns);
    stacks
        .create(&PostParams::default(), &pko_stack(&backend, json!({})))
        .await
        .expect("stack");
    let workspaces: Api<Workspace> = Api::namespaced(client.clone(), &ns);

    let (reason, message) = condition_naming(&workspaces, "system:auth-delegator").await;
    assert!(
        message.contains(&format!(
            "bind the workspace's service account {ns}/pulumi to the ClusterRole system:auth-delegator"
        )),
        "{reason}: {message}"
    );
    kubeauth::bind_auth_delegator(&client, &ns, "pulumi")
        .await
        .expect("auth-delegator");
    let (reason, message) = condition_naming(&workspaces, "workspaces/rpc").await;
    assert!(
        message.contains(&format!("{ns}/pko-rs-operator"))
            && message.contains("use on workspaces/rpc"),
        "{reason}: {message}"
    );
    kubeauth::grant_workspace_rpc(&client, &ns, &ns, "pko-rs-operator")
        .await
        .expect("rpc grant");
    wait_for("the workspace to be ready", WAIT, || async {
        let status = workspaces.get("interop").await.ok()?.status?;
        status
            .conditions
            .iter()
            .any(|c| c.type_ == "Ready" && c.status == "True")
            .then_some(())
    })
    .await
    .unwrap_or_else(|err| {
        panic!(
            "{err}: {:?}",
            futures::executor::block_on(workspaces.get("interop"))
                .ok()
                .and_then(|w| w.status)
        )
    });
}

#[tokio::test]
async fn our_agent_in_pkos_layout_takes_the_environment_over_rpc_without_a_restart() {
    let _machine = pko_tests::serial::shared().await;
    // pko-rs's agent image answers PKO's layout: /agent and /tini are ours.
    let e = pko_mode_execution("interop-ours", &["--pko-agent-image=pko-rs-agent:latest"]).await;
    let (plane, ns) = (e.plane, e.ns.clone());
    accounts(plane, &ns, true, true).await;
    let client = plane.client();
    let backend = e.tmp.path().join("backend");
    let programs: Api<pko_api::program::Program> = Api::namespaced(client.clone(), &ns);
    programs
        .create(
            &PostParams::default(),
            &pko_tests::fixtures::program(
                "interop",
                json!({"configuration": {"greeting": {"type": "String"}}, "outputs": {"m": "${greeting}-ours"}}),
            ),
        )
        .await
        .expect("program");
    let stacks: Api<Stack> = Api::namespaced(client.clone(), &ns);
    stacks
        .create(&PostParams::default(), &pko_stack(&backend, json!({})))
        .await
        .expect("stack");
    wait_for("the stack's outputs", WAIT, || async {
        let status = stacks.get("interop").await.ok()?.status?;
        (status.outputs.get("m") == Some(&json!("hello-ours"))).then_some(())
    })
    .await
    .unwrap_or_else(|err| panic!("{err}\n{}", e.kubelet.logs("interop")));
    // The environment went over RPC: not on the container, no mark, no move, one pod.
    let sts: Api<StatefulSet> = Api::namespaced(client.clone(), &ns);
    let sts = sts.get("interop-workspace").await.expect("statefulset");
    let pod = serde_json::to_value(&sts.spec.expect("spec").template).expect("json");
    assert_eq!(
        pod["spec"]["initContainers"][0]["args"],
        json!(["cp", "/agent", "/tini", "/share/"])
    );
    let agent = &pod["spec"]["containers"][0];
    assert!(
        agent["env"]
            .as_array()
            .is_some_and(|env| !env.iter().any(|v| v["name"] == "PULUMI_BACKEND_URL")),
        "{agent}"
    );
    assert_eq!(
        pod["metadata"]["annotations"]["pko-rs.dev/env-in-pod-spec"],
        Value::Null
    );
    let events: Api<Event> = Api::namespaced(client.clone(), &ns);
    let moved = events
        .list(&ListParams::default())
        .await
        .expect("events")
        .items
        .iter()
        .any(|ev| ev.reason.as_deref() == Some("EnvironmentOnPod"));
    assert!(!moved, "our agent takes the environment over RPC");
    assert_eq!(sts.metadata.generation, Some(1), "the pod was never rolled");
}
