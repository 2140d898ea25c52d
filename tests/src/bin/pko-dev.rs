//! `make run`: a local control plane, our CRDs, the operator, and the product's three parts at
//! work, end to end.
//!
//! Starts etcd + kube-apiserver on loopback, installs deploy/crds, starts `pko-operator` with its
//! admission webhook (the Rego policies compiled to wasm), applies examples/program.yaml with
//! kubectl, waits for its artifact, fetches it with curl, checks its sha256 against the status,
//! prints the Pulumi.yaml, deploys examples/stack.yaml; then runs the `default-tags` transform
//! plugin (examples/transform.yaml) and prints the transformed Pulumi.yaml and the chain in the
//! status; then sends examples/refused.yaml (refused, with the webhook's messages) and, under a
//! TenancyPolicy in warn mode (examples/tenancy.yaml), examples/warned.yaml (admitted with a
//! warning); then prints where to look next and keeps running until Ctrl-C. `pko-dev check` does
//! the same and exits: `make test` runs it, so the README's main command cannot break unseen.
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
use k8s_openapi::ByteString;
use k8s_openapi::api::core::v1::{ConfigMap, Namespace};
use kube::Api;
use kube::api::PostParams;
use pko_api::program::Program;
use pko_tests::webhook::{Registration, WebhookOptions, policy_bundle};
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

    // The admission webhook, registered for the namespaces `enroll`ed below.
    let webhook = Registration::create(&plane, "run", WebhookOptions::default())
        .await
        .context("registering the admission webhook")?;
    let bundle = policy_bundle().context("the admission policy bundle (make policies)")?;
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
        .arg("--artifact-keys-namespace=default")
        .args(webhook.operator_args(&bundle));
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

    println!("==> curl -fsS {url}");
    let bytes = curl(&url, &state.path().join("hello.tar.gz"))?;
    let actual = format!("sha256:{}", hex::encode(Sha256::digest(&bytes)));
    if actual != digest {
        bail!("digest mismatch: served {actual}, status says {digest}");
    }
    println!("    sha256 verified ({} bytes)", bytes.len());
    println!("==> Pulumi.yaml\n{}", pulumi_yaml(&bytes)?);
    let _kubelet = deploy_stack(&plane, state.path()).await?;
    transform(&plane, &programs, state.path()).await?;
    admission(&plane, &webhook).await?;
    if mode == Mode::Check {
        println!("==> check passed");
        return Ok(());
    }
    let kubectl = format!(
        "{} --kubeconfig {}",
        plane.kubectl().get_program().to_string_lossy(),
        plane.kubeconfig_path().display()
    );
    println!("==> where to look next");
    println!("  kubeconfig:  {}", plane.kubeconfig_path().display());
    println!("  {kubectl} get programs,stacks,workspaces,updates -A");
    println!("  {kubectl} get program tagged -o jsonpath='{{.status.artifact.metadata}}'");
    println!("  {kubectl} get programtransforms,tenancypolicies -A");
    println!("  {kubectl} get events -n default");
    println!("  operator log: {}", log.display());
    println!(
        "  file server: http://127.0.0.1:{fs_port}   probes and metrics: http://127.0.0.1:{probe_port}/metrics"
    );
    println!(
        "  docs: docs/plugins.md (transforms), docs/policies.md (tenancy), docs/execution.md (Stacks)"
    );
    println!("Running; press Ctrl-C to stop.");
    tokio::signal::ctrl_c()
        .await
        .context("waiting for Ctrl-C")?;
    println!("stopping");
    Ok(())
}

/// Fetches `url` with curl into `download`, as a user would, and returns its bytes.
fn curl(url: &str, download: &Path) -> anyhow::Result<Vec<u8>> {
    let status = Command::new("curl")
        .args(["-fsS", "-o"])
        .arg(download)
        .arg(url)
        .status()
        .context("running curl")?;
    if !status.success() {
        bail!("curl failed ({status})");
    }
    std::fs::read(download).context("reading the download")
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

/// Runs the `default-tags` plugin: its module into a ConfigMap, examples/transform.yaml applied
/// with the module's sha256 filled in, then the `tagged` Program's artifact fetched and shown
/// with the chain its status records.
async fn transform(
    plane: &ControlPlane,
    programs: &Api<Program>,
    state: &Path,
) -> anyhow::Result<()> {
    let dir = std::env::var_os("PKO_PLUGINS_DIR")
        .map(PathBuf::from)
        .context("PKO_PLUGINS_DIR is not set: run `make run`, which builds the plugins")?;
    let module_path = dir.join("default_tags.wasm");
    let module = std::fs::read(&module_path)
        .with_context(|| format!("reading {} (make plugins)", module_path.display()))?;
    let sha256 = hex::encode(Sha256::digest(&module));
    println!(
        "==> the default-tags plugin ({} bytes, sha256 {sha256}) into ConfigMap default/plugins",
        module.len()
    );
    let config_map: ConfigMap = serde_json::from_value(serde_json::json!({
        "metadata": {"name": "plugins", "namespace": "default"},
    }))?;
    let config_map = ConfigMap {
        binary_data: Some([("default-tags.wasm".to_owned(), ByteString(module))].into()),
        ..config_map
    };
    Api::<ConfigMap>::namespaced(plane.client(), "default")
        .create(&PostParams::default(), &config_map)
        .await
        .context("creating ConfigMap default/plugins")?;
    let example = repo_root().join("examples/transform.yaml");
    let manifest = std::fs::read_to_string(&example)
        .with_context(|| format!("reading {}", example.display()))?
        .replace("SHA256_OF_DEFAULT_TAGS_WASM", &sha256);
    println!(
        "==> kubectl apply --server-side -f {} (sha256 filled in)",
        example.display()
    );
    kubectl_stdin(plane, &["apply", "--server-side", "-f", "-"], &manifest)?;
    let (url, metadata) = wait_for(
        "the transformed artifact of default/tagged",
        Duration::from_secs(60),
        || {
            let programs = programs.clone();
            async move {
                let artifact = programs.get("tagged").await.ok()?.status?.artifact?;
                let metadata = artifact.metadata?;
                Some((artifact.url, metadata))
            }
        },
    )
    .await?;
    for (key, value) in &metadata {
        println!("    status.artifact.metadata[{key}] = {value}");
    }
    let yaml = pulumi_yaml(&curl(&url, &state.join("tagged.tar.gz"))?)?;
    println!("==> the transformed Pulumi.yaml\n{yaml}");
    if !yaml.contains("managed-by: pko-rs") {
        bail!("the transform's label is not in the artifact");
    }
    println!("    transform applied: the ConfigMap resource carries managed-by and tenant labels");
    Ok(())
}

/// The webhook at work: team-a (no TenancyPolicy, so violations are denied) refuses
/// examples/refused.yaml; team-b, under examples/tenancy.yaml's warn policy, admits
/// examples/warned.yaml with a warning. Both are sent as server-side dry runs.
async fn admission(plane: &ControlPlane, webhook: &Registration) -> anyhow::Result<()> {
    println!("==> admission: namespaces team-a and team-b under the webhook");
    let namespaces: Api<Namespace> = Api::all(plane.client());
    for name in ["team-a", "team-b"] {
        let ns: Namespace =
            serde_json::from_value(serde_json::json!({"metadata": {"name": name}}))?;
        namespaces
            .create(&PostParams::default(), &ns)
            .await
            .with_context(|| format!("creating namespace {name}"))?;
        webhook
            .enroll(plane, name, &[])
            .await
            .with_context(|| format!("enrolling namespace {name}"))?;
    }
    webhook
        .wait_ca_injected(plane, Duration::from_secs(60))
        .await
        .context("the webhook's CA bundle")?;
    let refused = repo_root().join("examples/refused.yaml");
    println!(
        "==> kubectl apply --server-side --dry-run=server -f {}",
        refused.display()
    );
    let out = kubectl_file(plane, &refused)?;
    print!("{}", indent(&out.text));
    if out.success {
        bail!("examples/refused.yaml was admitted");
    }
    for code in ["cross-namespace-secret", "run-as-user-root"] {
        if !out.text.contains(code) {
            bail!("the refusal does not name {code}");
        }
    }
    let policy = repo_root().join("examples/tenancy.yaml");
    println!("==> kubectl apply --server-side -f {}", policy.display());
    let applied = kubectl_file_as(plane, &policy, false)?;
    if !applied.success {
        bail!("applying the TenancyPolicy failed:\n{}", applied.text);
    }
    let warned = repo_root().join("examples/warned.yaml");
    println!(
        "==> kubectl apply --server-side --dry-run=server -f {}",
        warned.display()
    );
    // The operator reads TenancyPolicies from a watch: the policy applies once it has seen it.
    let out = wait_for(
        "the warn policy to apply",
        Duration::from_secs(30),
        || async {
            let out = kubectl_file(plane, &warned).ok()?;
            (out.success && out.text.contains("Warning")).then_some(out)
        },
    )
    .await?;
    print!("{}", indent(&out.text));
    Ok(())
}

/// What a kubectl run printed (stdout and stderr) and whether it succeeded.
struct Kubectl {
    success: bool,
    text: String,
}

/// `kubectl apply --server-side --dry-run=server -f file`.
fn kubectl_file(plane: &ControlPlane, file: &Path) -> anyhow::Result<Kubectl> {
    kubectl_file_as(plane, file, true)
}

fn kubectl_file_as(plane: &ControlPlane, file: &Path, dry_run: bool) -> anyhow::Result<Kubectl> {
    let mut cmd = plane.kubectl();
    cmd.args(["apply", "--server-side"]);
    if dry_run {
        cmd.arg("--dry-run=server");
    }
    let out = cmd
        .arg("-f")
        .arg(file)
        .output()
        .context("running kubectl")?;
    Ok(Kubectl {
        success: out.status.success(),
        text: format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        ),
    })
}

/// Runs kubectl with `input` on its stdin; fails with its output when it fails.
fn kubectl_stdin(plane: &ControlPlane, args: &[&str], input: &str) -> anyhow::Result<()> {
    use std::io::Write;
    let mut child = plane
        .kubectl()
        .args(args)
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .context("running kubectl")?;
    child
        .stdin
        .take()
        .context("kubectl's stdin")?
        .write_all(input.as_bytes())
        .context("writing to kubectl")?;
    let out = child.wait_with_output().context("waiting for kubectl")?;
    print!("{}", indent(&String::from_utf8_lossy(&out.stdout)));
    if !out.status.success() {
        bail!(
            "kubectl failed ({}): {}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
        );
    }
    Ok(())
}

fn indent(text: &str) -> String {
    text.lines().map(|l| format!("    {l}\n")).collect()
}
