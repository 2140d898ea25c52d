//! `make run`: a local control plane, our CRDs, the operator, and the sample Program, end to end.
//!
//! Starts etcd + kube-apiserver on loopback, installs deploy/crds, starts `pko-operator`, applies
//! examples/program.yaml with kubectl, waits for its artifact, fetches it with curl, checks its
//! sha256 against the status, prints the Pulumi.yaml, deploys examples/stack.yaml, then keeps
//! running until Ctrl-C. `pko-dev check` does the same and exits: `make test` runs it, so the
//! README's main command cannot break unseen.
#![allow(
    clippy::disallowed_methods,
    reason = "a test process is configured by its environment (make sets the tool and fixture paths)"
)]

use std::io::Read;
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use anyhow::{Context, bail};
use kube::Api;
use pko_api::program::Program;
use pko_tests::{ControlPlane, StartOptions, repo_root, spawn_guarded, wait_for};
use sha2::{Digest, Sha256};

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let _ = rustls::crypto::ring::default_provider().install_default();
    let args: Vec<String> = std::env::args().skip(1).collect();
    match args.first().map(String::as_str) {
        None | Some("run") => run(Mode::Serve).await,
        Some("check") => run(Mode::Check).await,
        Some(other) => bail!("unknown command {other:?}; usage: pko-dev [run|check]"),
    }
}

/// What happens once everything is up.
#[derive(Clone, Copy, PartialEq)]
enum Mode {
    /// Keep running until Ctrl-C (`make run`).
    Serve,
    /// Stop and exit 0 (the test of `make run`).
    Check,
}

async fn run(mode: Mode) -> anyhow::Result<()> {
    let root = repo_root();
    let state = tempfile::Builder::new()
        .prefix("pko-rs-run-")
        .tempdir()
        .context("creating a state folder")?;
    println!(
        "==> starting etcd + kube-apiserver in {}",
        state.path().display()
    );
    let plane = ControlPlane::start(StartOptions {
        dir: Some(state.path().to_path_buf()),
        crds_dir: None,
        ..StartOptions::default()
    })
    .await
    .context("starting the local control plane")?;
    println!("    apiserver {} (CRDs installed)", plane.server_url());

    let fs_port = free_port()?;
    let probe_port = free_port()?;
    let operator = sibling_binary("pko-operator")?;
    let mut cmd = Command::new(&operator);
    cmd.arg("--kubeconfig")
        .arg(plane.kubeconfig_path())
        .arg(format!("--program-fs-addr=127.0.0.1:{fs_port}"))
        .arg(format!(
            "--health-probe-bind-address=127.0.0.1:{probe_port}"
        ))
        // Workspace agents run as local processes (see below) on loopback ports.
        .arg("--workspace-localhost=127.0.0.1")
        .arg("--artifact-keys-namespace=default");
    let log = state.path().join("operator.log");
    println!("==> starting the operator (log: {})", log.display());
    let _operator = spawn_guarded(cmd, "pko-operator", &log)?;
    let ready_url = format!("http://127.0.0.1:{probe_port}/readyz");
    wait_for("operator readiness", Duration::from_secs(60), || {
        let url = ready_url.clone();
        async move {
            let resp = reqwest::get(&url).await.ok()?;
            resp.status().is_success().then_some(())
        }
    })
    .await?;

    let example = root.join("examples/program.yaml");
    println!("==> kubectl apply --server-side -f {}", example.display());
    let status = plane
        .kubectl()
        .args(["apply", "--server-side", "-f"])
        .arg(&example)
        .status()
        .context("running kubectl")?;
    if !status.success() {
        bail!("kubectl apply failed ({status})");
    }

    let programs: Api<Program> = Api::namespaced(plane.client(), "default");
    let artifact = wait_for(
        "the artifact of default/hello",
        Duration::from_secs(60),
        || {
            let programs = programs.clone();
            async move {
                let program = programs.get("hello").await.ok()?;
                let status = serde_json::to_value(program.status?).ok()?;
                let artifact = status.get("artifact")?.clone();
                let url = artifact.get("url")?.as_str()?.to_owned();
                let digest = artifact.get("digest")?.as_str()?.to_owned();
                Some((url, digest))
            }
        },
    )
    .await?;
    let (url, digest) = artifact;
    println!("    status.artifact.url    = {url}");
    println!("    status.artifact.digest = {digest}");

    let download = state.path().join("hello.tar.gz");
    println!("==> curl -fsS {url}");
    let status = Command::new("curl")
        .args(["-fsS", "-o"])
        .arg(&download)
        .arg(&url)
        .status()
        .context("running curl")?;
    if !status.success() {
        bail!("curl failed ({status})");
    }
    let bytes = std::fs::read(&download).context("reading the download")?;
    let actual = format!("sha256:{}", hex::encode(Sha256::digest(&bytes)));
    if actual != digest {
        bail!("digest mismatch: served {actual}, status says {digest}");
    }
    println!("    sha256 verified ({} bytes)", bytes.len());
    println!("==> Pulumi.yaml\n{}", pulumi_yaml(&bytes)?);
    let _kubelet = deploy_stack(&plane, state.path()).await?;
    if mode == Mode::Check {
        println!("==> check passed");
        return Ok(());
    }
    println!("kubeconfig: {}", plane.kubeconfig_path().display());
    let kubectl = plane.kubectl();
    println!(
        "  try: {} --kubeconfig {} get programs -A",
        kubectl.get_program().to_string_lossy(),
        plane.kubeconfig_path().display()
    );
    println!("file server: http://127.0.0.1:{fs_port}   probes: http://127.0.0.1:{probe_port}");
    println!("Running; press Ctrl-C to stop.");
    tokio::signal::ctrl_c()
        .await
        .context("waiting for Ctrl-C")?;
    println!("stopping");
    Ok(())
}

fn pulumi_yaml(targz: &[u8]) -> anyhow::Result<String> {
    let mut archive = tar::Archive::new(flate2::read::GzDecoder::new(targz));
    for entry in archive.entries().context("reading the archive")? {
        let mut entry = entry.context("reading an entry")?;
        if entry.path().ok().as_deref() == Some(Path::new("Pulumi.yaml")) {
            let mut text = String::new();
            entry
                .read_to_string(&mut text)
                .context("reading Pulumi.yaml")?;
            return Ok(text);
        }
    }
    bail!("the artifact holds no Pulumi.yaml")
}

fn free_port() -> anyhow::Result<u16> {
    let listener = TcpListener::bind("127.0.0.1:0").context("finding a free port")?;
    Ok(listener.local_addr()?.port())
}

/// A binary built into the same target folder as this one.
fn sibling_binary(name: &str) -> anyhow::Result<PathBuf> {
    let me = std::env::current_exe().context("locating pko-dev")?;
    let path = me.with_file_name(name);
    if !path.exists() {
        bail!(
            "{} not found: run `cargo build --workspace` first",
            path.display()
        );
    }
    Ok(path)
}

/// Deploys examples/stack.yaml (the `hello` Program as a Stack) with the harness playing the
/// kubelet: the workspace pod's agent runs here with the real pulumi CLI and a local `file://`
/// backend. Returns the kubelet, which stops the agent when dropped.
async fn deploy_stack(
    plane: &ControlPlane,
    state: &Path,
) -> anyhow::Result<pko_tests::kubelet::Kubelet> {
    let kubelet =
        pko_tests::kubelet::Kubelet::start(plane.client(), "default", &state.join("pods"))
            .context("starting the local kubelet (needs `make tools` for pulumi)")?;
    let backend = state.join("backend");
    std::fs::create_dir_all(&backend).context("creating the backend folder")?;
    let example = repo_root().join("examples/stack.yaml");
    println!("==> kubectl apply --server-side -f {}", example.display());
    let status = plane
        .kubectl()
        .args(["apply", "--server-side", "-f"])
        .arg(&example)
        .status()
        .context("running kubectl")?;
    if !status.success() {
        bail!("kubectl apply failed ({status})");
    }
    let stacks: Api<pko_api::stack::Stack> = Api::namespaced(plane.client(), "default");
    let backend_url = format!("file://{}", backend.display());
    stacks
        .patch(
            "hello",
            &kube::api::PatchParams::default(),
            &kube::api::Patch::Merge(serde_json::json!({"spec": {"backend": backend_url}})),
        )
        .await
        .context("setting the stack's backend")?;
    println!("    backend {backend_url}; waiting for the stack (Workspace → agent → Update)");
    let outputs = wait_for(
        "stack default/hello to be Ready",
        Duration::from_secs(180),
        || {
            let stacks = stacks.clone();
            async move {
                let status = stacks.get("hello").await.ok()?.status?;
                let ready = status
                    .conditions
                    .iter()
                    .any(|c| c.type_ == "Ready" && c.status == "True");
                (ready && !status.outputs.is_empty()).then_some(status.outputs)
            }
        },
    )
    .await
    .map_err(|e| anyhow::anyhow!("{e}\n{}", kubelet.logs("hello")))?;
    println!(
        "    stack Ready; status.outputs = {}",
        serde_json::to_string(&outputs)?
    );
    Ok(kubelet)
}
