//! pko-rs with PKO v2.9's agent contract, on the real apiserver: our agent binary takes the
//! command lines PKO's manager gives it (`tini agent -- serve --auth-mode kube …`, `init` in
//! `sh -c`) and reviews every caller's token with the real TokenReview and
//! SubjectAccessReview.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use pko_agent::client::{Target, connect};
use pko_agent::proto as pb;
use pko_tests::agent::{StaticServer, agent_binary, free_port, pulumi_env};
use pko_tests::{ControlPlane, kubeauth, spawn_guarded, wait_for};
use sha2::{Digest, Sha256};
use tonic::Code;

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
