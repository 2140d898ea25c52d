//! The images `make image` writes (OCI layouts in `$PKO_IMAGE_DIR`), unpacked with umoci and
//! run with runc as the user 65532 on a read-only root filesystem, in the host's network
//! namespace: the operator image gets ready against the test apiserver, the agent image runs
//! `pko-agent --version` and `pulumi version`, and the agent image runs the pod PKO's manager
//! lays out (`cp /agent /tini /share/`, the `sh -c` fetch, `tini agent -- serve --auth-mode
//! kube` reviewing a token with the apiserver as a mounted service account). Both match the
//! Dockerfile's last stages (paths, user, entrypoint or command).
//!
//! runc needs root. crun 1.8.1 (Debian 12) cannot run on the project's machines at all ("cgroups
//! in hybrid mode not supported, drop all controllers from cgroupv2", even with
//! `--cgroup-manager=disabled`), so runc it is (`PKO_OCI_RUNTIME` names another); a runtime that
//! fails fails the test with its own error output.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use base64::Engine;
use kube::config::Kubeconfig;
use pko_tests::command::run;
use pko_tests::{ControlPlane, repo_root, spawn_guarded};
use serde_json::{Value, json};

const TAG: &str = "latest";
const NONROOT: u32 = 65532;

/// The OCI runtime: runc, or `$PKO_OCI_RUNTIME` (e.g. `crun`, to see how it fails here).
fn runtime() -> String {
    std::env::var("PKO_OCI_RUNTIME")
        .ok()
        .filter(|v| !v.is_empty())
        .unwrap_or_else(|| "runc".to_owned())
}

fn image_dir() -> PathBuf {
    match std::env::var_os("PKO_IMAGE_DIR").filter(|v| !v.is_empty()) {
        Some(dir) => PathBuf::from(dir),
        None => PathBuf::from(std::env::var_os("HOME").expect("HOME")).join(".cache/pko-rs/images"),
    }
}

/// An image unpacked into a runtime bundle (`config.json` + `rootfs/`), removed on drop.
struct Bundle {
    dir: tempfile::TempDir,
    /// The runtime config umoci derived from the image's config.
    config: Value,
    /// The arguments of the last [`Bundle::prepare`].
    args: Vec<String>,
}

impl Bundle {
    fn unpack(name: &str) -> Self {
        let layout = image_dir().join(name);
        assert!(
            layout.join("index.json").is_file(),
            "no OCI layout at {}: run `make image`",
            layout.display()
        );
        let dir = tempfile::Builder::new()
            .prefix("pko-image-")
            .tempdir()
            .expect("bundle folder");
        let bundle = dir.path().join("bundle");
        run(
            Command::new("umoci")
                .arg("unpack")
                .arg("--image")
                .arg(format!("{}:{TAG}", layout.display()))
                .arg(&bundle),
            None,
            &format!("umoci unpack {name}"),
        );
        let text = std::fs::read_to_string(bundle.join("config.json")).expect("config.json");
        let config = serde_json::from_str(&text).expect("config.json parses");
        Self {
            dir,
            config,
            args: Vec::new(),
        }
    }

    fn path(&self) -> PathBuf {
        self.dir.path().join("bundle")
    }

    fn rootfs(&self) -> PathBuf {
        self.path().join("rootfs")
    }

    /// The image's entrypoint + cmd, as umoci put them in the runtime config.
    fn image_args(&self) -> Vec<String> {
        strings(&self.config["process"]["args"])
    }

    /// What a restricted pod does to the image's config: the root filesystem read-only, the
    /// image's user, no new privileges, `args` run with `env` added; plus the host's network
    /// namespace (the test apiserver listens on loopback), a tmpfs at /tmp and `mounts`.
    fn prepare(&mut self, args: &[String], env: &[String], mounts: &[Value]) {
        self.prepare_as(None, true, args, env, mounts);
    }

    /// [`Bundle::prepare`] with another user and a choice of read-only root.
    fn prepare_as(
        &mut self,
        user: Option<u32>,
        read_only: bool,
        args: &[String],
        env: &[String],
        mounts: &[Value],
    ) {
        self.args = args.to_vec();
        let mut config = self.config.clone();
        let c = &mut config;
        if let Some(id) = user {
            c["process"]["user"] = json!({"uid": id, "gid": id});
        }
        c["root"]["readonly"] = json!(read_only);
        c["process"]["terminal"] = json!(false);
        c["process"]["noNewPrivileges"] = json!(true);
        c["process"]["args"] = json!(args);
        let mut all_env = strings(&c["process"]["env"]);
        all_env.extend(env.iter().cloned());
        c["process"]["env"] = json!(all_env);
        let namespaces = c["linux"]["namespaces"]
            .as_array()
            .expect("linux.namespaces")
            .iter()
            .filter(|n| n["type"] != "network")
            .cloned()
            .collect::<Vec<_>>();
        c["linux"]["namespaces"] = json!(namespaces);
        let list = c["mounts"].as_array_mut().expect("mounts");
        list.push(tmpfs("/tmp", "mode=1777"));
        list.extend(mounts.iter().cloned());
        let text = serde_json::to_string_pretty(&config).expect("config json");
        std::fs::write(self.path().join("config.json"), text).expect("write config.json");
    }
}

fn strings(v: &Value) -> Vec<String> {
    v.as_array()
        .map(|a| {
            a.iter()
                .filter_map(Value::as_str)
                .map(str::to_owned)
                .collect()
        })
        .unwrap_or_default()
}

fn tmpfs(destination: &str, extra: &str) -> Value {
    json!({
        "destination": destination,
        "type": "tmpfs",
        "source": "tmpfs",
        "options": ["nosuid", "nodev", "noexec", "size=64m", extra],
    })
}

fn container_id() -> String {
    static NEXT: AtomicU32 = AtomicU32::new(0);
    format!(
        "pko-image-test-{}-{}",
        std::process::id(),
        NEXT.fetch_add(1, Ordering::Relaxed)
    )
}

/// `runc delete --force` on drop: killing a foreground `runc run` leaves its container running.
struct Container {
    id: String,
}

impl Drop for Container {
    fn drop(&mut self) {
        let _ = Command::new(runtime())
            .args(["delete", "--force", &self.id])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status();
    }
}

/// Runs the bundle to completion; returns its stdout (the test fails with the runtime's
/// output if it does not exit 0).
fn run_to_end(bundle: &Bundle) -> String {
    let container = Container { id: container_id() };
    run(
        Command::new(runtime())
            .arg("run")
            .arg("--bundle")
            .arg(bundle.path())
            .arg(&container.id),
        None,
        &format!("{} run {}", runtime(), bundle.args.join(" ")),
    )
}

/// The instructions of the Dockerfile stage that starts with `from` (up to the next `FROM`).
fn dockerfile_stage(from: &str) -> Vec<String> {
    let text = std::fs::read_to_string(repo_root().join("Dockerfile")).expect("Dockerfile");
    let joined = text.replace("\\\n", " ");
    joined
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty() && !l.starts_with('#'))
        .skip_while(|l| *l != from)
        .skip(1)
        .take_while(|l| !l.starts_with("FROM "))
        .map(str::to_owned)
        .collect()
}

/// The Dockerfile stage builds what `make image` assembled: every file it copies is at the same
/// path, and the user, entrypoint and PATH are the same.
fn assert_matches_dockerfile(bundle: &Bundle, from: &str) {
    let stage = dockerfile_stage(from);
    assert!(!stage.is_empty(), "no Dockerfile stage `{from}`");
    let mut copied = Vec::new();
    for line in stage.iter().filter(|l| l.starts_with("COPY ")) {
        let words: Vec<&str> = line
            .split_whitespace()
            .skip(1)
            .filter(|w| !w.starts_with("--"))
            .collect();
        let (dest, sources) = words.split_last().expect("COPY sources destination");
        for source in sources {
            copied.push(if source.ends_with('/') {
                (*dest).to_owned()
            } else if dest.ends_with('/') {
                let base = Path::new(source).file_name().expect("file name");
                format!("{dest}{}", base.to_string_lossy())
            } else {
                (*dest).to_owned()
            });
        }
    }
    assert!(!copied.is_empty(), "{stage:?}");
    for path in &copied {
        // A folder's contents copied over the root: checked by what the image runs.
        if path == "/" {
            continue;
        }
        let inside = bundle.rootfs().join(path.trim_start_matches('/'));
        assert!(
            inside.exists(),
            "{path} (Dockerfile `{from}`) is not in the image"
        );
    }
    let value = |key: &str| {
        stage
            .iter()
            .find_map(|l| l.strip_prefix(key))
            .map(str::trim)
            .unwrap_or_else(|| panic!("no {key}in Dockerfile `{from}`"))
            .to_owned()
    };
    let user = &bundle.config["process"]["user"];
    assert_eq!(
        value("USER "),
        format!("{}:{}", user["uid"], user["gid"]),
        "user"
    );
    // ENTRYPOINT, or CMD alone (an image whose containers' bare `args` run as they are).
    let instruction = stage
        .iter()
        .find_map(|l| {
            l.strip_prefix("ENTRYPOINT ")
                .or_else(|| l.strip_prefix("CMD "))
        })
        .unwrap_or_else(|| panic!("no ENTRYPOINT or CMD in Dockerfile `{from}`"));
    let entrypoint: Vec<String> = serde_json::from_str(instruction.trim()).expect("exec form");
    assert_eq!(bundle.image_args(), entrypoint, "entrypoint or command");
    let path = value("ENV ");
    let path = path
        .split_whitespace()
        .find(|kv| kv.starts_with("PATH="))
        .expect("ENV PATH=");
    assert!(
        strings(&bundle.config["process"]["env"]).contains(&path.to_owned()),
        "{path}: {}",
        bundle.config["process"]["env"]
    );
    assert_eq!(user["uid"], NONROOT);
}

#[test]
fn agent_image_runs_the_agent_and_pulumi_read_only_as_nonroot() {
    let _machine = pko_tests::serial::shared_blocking();
    let mut bundle = Bundle::unpack("pko-rs-agent");
    assert_matches_dockerfile(&bundle, "FROM scratch AS agent");
    // pulumi writes under $HOME/.pulumi: on a read-only root it needs a volume there.
    let home = tmpfs("/home/nonroot", &format!("uid={NONROOT},gid={NONROOT}"));

    bundle.prepare(
        &["/usr/local/bin/pko-agent".into(), "--version".into()],
        &[],
        std::slice::from_ref(&home),
    );
    let version = run_to_end(&bundle);
    assert!(version.starts_with("pko-agent "), "{version}");

    bundle.prepare(
        &["pulumi".into(), "version".into()],
        &[],
        std::slice::from_ref(&home),
    );
    let pulumi = run_to_end(&bundle);
    assert!(pulumi.trim().starts_with("v3."), "{pulumi}");

    // The language host is on PATH, where pulumi looks for it.
    bundle.prepare(
        &["pulumi-language-yaml".into(), "--help".into()],
        &[],
        std::slice::from_ref(&home),
    );
    let container = Container { id: container_id() };
    let out = Command::new(runtime())
        .arg("run")
        .arg("--bundle")
        .arg(bundle.path())
        .arg(&container.id)
        .stdin(Stdio::null())
        .output()
        .expect("runc run");
    drop(container);
    let text =
        String::from_utf8_lossy(&out.stderr).into_owned() + &String::from_utf8_lossy(&out.stdout);
    assert!(
        text.contains("pulumi-language-yaml"),
        "{}: {text}",
        out.status
    );

    // As a restricted workspace pod runs it (PKO's pulumi user 1000:1000, the image's root
    // filesystem writable, no volume at $HOME): pulumi writes its credentials under
    // $HOME/.pulumi.
    bundle.prepare_as(
        Some(1000),
        false,
        &["pulumi".into(), "login".into(), "--local".into()],
        &[],
        &[],
    );
    let login = run_to_end(&bundle);
    assert!(login.contains("Logged in"), "{login}");
    let credentials = bundle
        .rootfs()
        .join("home/nonroot/.pulumi/credentials.json");
    assert!(credentials.is_file(), "{login}");
}

/// The kubeconfig of `plane` with the CA certificate inline, for a container that sees none of
/// the host's files.
fn inline_kubeconfig(plane: &ControlPlane) -> String {
    let mut config = Kubeconfig::read_from(plane.kubeconfig_path()).expect("kubeconfig");
    for named in &mut config.clusters {
        let cluster = named.cluster.as_mut().expect("cluster");
        if let Some(ca) = cluster.certificate_authority.take() {
            let pem = std::fs::read(&ca).expect("CA certificate");
            cluster.certificate_authority_data =
                Some(base64::engine::general_purpose::STANDARD.encode(pem));
        }
    }
    // JSON is YAML.
    serde_json::to_string(&config).expect("kubeconfig json")
}

/// The `Uid:` line of a process.
fn uids(pid: u64) -> String {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .expect("/proc/<pid>/status")
        .lines()
        .find(|l| l.starts_with("Uid:"))
        .expect("Uid line")
        .to_owned()
}

/// The options of the mount at `/` in the process's mount namespace.
fn root_mount_options(pid: u64) -> String {
    std::fs::read_to_string(format!("/proc/{pid}/mountinfo"))
        .expect("/proc/<pid>/mountinfo")
        .lines()
        .find_map(|l| {
            let fields: Vec<&str> = l.split_whitespace().collect();
            (fields.get(4) == Some(&"/")).then(|| fields.get(5).copied().unwrap_or("").to_owned())
        })
        .expect("a mount at /")
}

#[tokio::test]
async fn operator_image_gets_ready_read_only_as_nonroot() {
    let _machine = pko_tests::serial::shared().await;
    let plane = ControlPlane::shared().await;
    let namespace = plane.namespace("image").await.expect("namespace");
    let mut bundle = Bundle::unpack("pko-rs");
    assert_matches_dockerfile(&bundle, "FROM scratch");

    let kubeconfig = bundle.dir.path().join("kubeconfig");
    std::fs::write(&kubeconfig, inline_kubeconfig(plane)).expect("write kubeconfig");
    // Readable by the container's user (tempfile makes its folder 0700, the file is bound alone).
    std::fs::set_permissions(
        &kubeconfig,
        std::os::unix::fs::PermissionsExt::from_mode(0o644),
    )
    .expect("chmod kubeconfig");
    let fs_port = pko_tests::agent::free_port().expect("port");
    let probe_port = pko_tests::agent::free_port().expect("port");
    // The Deployment's flags (deploy/operator), on loopback ports of the host network.
    let args: Vec<String> = vec![
        "/usr/local/bin/pko-operator".into(),
        "--kubeconfig=/etc/pko-rs/kubeconfig".into(),
        format!("--program-fs-addr=127.0.0.1:{fs_port}"),
        format!("--health-probe-bind-address=127.0.0.1:{probe_port}"),
        "--log-format=json".into(),
        format!("--watch-namespace={namespace}"),
        format!("--artifact-keys-namespace={namespace}"),
        "--policy-bundle=/usr/local/share/pko-rs/policies.tar.gz".into(),
        "--plugin-file-root=/usr/local/share/pko-rs/plugins".into(),
        "--plugin-cache-dir=/var/cache/pko-rs/plugins".into(),
    ];
    let mounts = [
        json!({
            "destination": "/etc/pko-rs/kubeconfig",
            "type": "bind",
            "source": kubeconfig,
            "options": ["bind", "ro"],
        }),
        tmpfs(
            "/var/cache/pko-rs/plugins",
            &format!("uid={NONROOT},gid={NONROOT}"),
        ),
    ];
    bundle.prepare(&args, &[format!("POD_NAMESPACE={namespace}")], &mounts);

    let container = Container { id: container_id() };
    let mut cmd = Command::new(runtime());
    cmd.arg("run")
        .arg("--bundle")
        .arg(bundle.path())
        .arg(&container.id)
        .stdin(Stdio::null());
    let log = plane.dir().join(format!("{}.log", container.id));
    let mut running = spawn_guarded(cmd, "runc run pko-rs", &log).expect("runc run");

    let url = format!("http://127.0.0.1:{probe_port}/readyz");
    let ready = pko_tests::wait_for(
        "the operator image's /readyz",
        Duration::from_secs(120),
        || {
            let url = url.clone();
            let exited = running.try_wait().ok().flatten();
            async move {
                if exited.is_some() {
                    return Some(false);
                }
                let resp = reqwest::get(&url).await.ok()?;
                resp.status().is_success().then_some(true)
            }
        },
    )
    .await;
    let log_text = || std::fs::read_to_string(&log).unwrap_or_default();
    match ready {
        Ok(true) => {}
        Ok(false) => panic!(
            "{} run exited before /readyz answered:\n{}",
            runtime(),
            log_text()
        ),
        Err(e) => panic!("{e}:\n{}", log_text()),
    }

    // The process that answered is the container's: the image's user, a read-only root.
    let state: Value = serde_json::from_str(&run(
        Command::new(runtime()).args(["state", &container.id]),
        None,
        "runc state",
    ))
    .expect("runc state json");
    let pid = state["pid"].as_u64().expect("pid");
    assert_eq!(
        uids(pid),
        format!("Uid:\t{NONROOT}\t{NONROOT}\t{NONROOT}\t{NONROOT}")
    );
    let options = root_mount_options(pid);
    assert!(
        options.split(',').any(|o| o == "ro"),
        "root mounted {options}"
    );
    drop(container);
    drop(running);
}

/// A tar.gz of one project file at `proj/Pulumi.yaml`.
fn project_artifact() -> Vec<u8> {
    let gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::default());
    let mut builder = tar::Builder::new(gz);
    let data = b"name: fetched\nruntime: yaml\n";
    let mut header = tar::Header::new_gnu();
    header.set_size(data.len() as u64);
    header.set_mode(0o644);
    builder
        .append_data(&mut header, "proj/Pulumi.yaml", &data[..])
        .expect("append");
    builder.into_inner().expect("tar").finish().expect("gzip")
}

fn bind(destination: &str, source: &Path, read_only: bool) -> Value {
    let mut options = vec!["bind"];
    if read_only {
        options.push("ro");
    }
    json!({"destination": destination, "type": "bind", "source": source, "options": options})
}

#[tokio::test]
async fn agent_image_runs_the_pod_pkos_manager_lays_out() {
    use pko_tests::kubeauth;
    use sha2::Digest;

    let _machine = pko_tests::serial::shared().await;
    let plane = ControlPlane::shared().await;
    let ns = plane.namespace("image-pko").await.expect("namespace");
    let client = plane.client();
    for account in ["pulumi", "operator"] {
        kubeauth::service_account(&client, &ns, account)
            .await
            .expect("service account");
    }
    kubeauth::bind_auth_delegator(&client, &ns, "pulumi")
        .await
        .expect("auth-delegator");
    kubeauth::grant_workspace_rpc(&client, &ns, &ns, "operator")
        .await
        .expect("rpc grant");
    let mut bundle = Bundle::unpack("pko-rs-agent");
    let tmp = tempfile::tempdir().expect("tmp");
    let share = tmp.path().join("share");
    std::fs::create_dir(&share).expect("share");
    // An emptyDir: writable by the pod's user.
    std::fs::set_permissions(&share, std::os::unix::fs::PermissionsExt::from_mode(0o777))
        .expect("chmod share");
    let share_mount = bind("/share", &share, false);
    let home = tmpfs("/home/nonroot", &format!("uid={NONROOT},gid={NONROOT}"));

    // bootstrap: bare args, no entrypoint.
    let words = |list: &[&str]| list.iter().map(|s| (*s).to_owned()).collect::<Vec<_>>();
    bundle.prepare(
        &words(&["cp", "/agent", "/tini", "/share/"]),
        &[],
        std::slice::from_ref(&share_mount),
    );
    run_to_end(&bundle);
    for name in ["agent", "tini"] {
        let meta = std::fs::symlink_metadata(share.join(name)).expect("copied");
        assert!(meta.file_type().is_file(), "{name} is a copy, not a link");
    }

    // fetch: PKO's script in a real shell.
    let artifact = project_artifact();
    let digest = format!("sha256:{}", hex::encode(sha2::Sha256::digest(&artifact)));
    let server = pko_tests::agent::StaticServer::start(std::collections::HashMap::from([(
        "/a.tar.gz".to_owned(),
        artifact,
    )]))
    .await
    .expect("artifact server");
    bundle.prepare(
        &words(&[
            "sh",
            "-c",
            "/share/agent init -t /share/source --flux-url \"$FLUX_URL\" --flux-digest \"$FLUX_DIGEST\" &&\nln -s \"/share/source/$FLUX_DIR\" /share/workspace",
        ]),
        &[
            format!("FLUX_URL={}", server.url("/a.tar.gz")),
            format!("FLUX_DIGEST={digest}"),
            "FLUX_DIR=proj".into(),
            "PULUMI_ENV=/share/.env".into(),
        ],
        std::slice::from_ref(&share_mount),
    );
    // Run without blocking this runtime, which serves the artifact.
    let container = Container { id: container_id() };
    let fetched = tokio::process::Command::new(runtime())
        .arg("run")
        .arg("--bundle")
        .arg(bundle.path())
        .arg(&container.id)
        .stdin(Stdio::null())
        .output()
        .await
        .expect("runc run");
    drop(container);
    assert!(
        fetched.status.success(),
        "{}{}",
        String::from_utf8_lossy(&fetched.stdout),
        String::from_utf8_lossy(&fetched.stderr)
    );
    assert!(share.join("source/proj/Pulumi.yaml").is_file());

    // pulumi: tini, the agent, PKO's serve flags; the service account mounted where the
    // kubelet mounts it.
    let account = tmp.path().join("serviceaccount");
    std::fs::create_dir(&account).expect("account dir");
    let token = kubeauth::token(&client, &ns, "pulumi", None)
        .await
        .expect("pod token");
    std::fs::write(account.join("token"), token).expect("token");
    std::fs::copy(plane.ca_path(), account.join("ca.crt")).expect("ca");
    std::fs::write(account.join("namespace"), &ns).expect("namespace");
    for entry in std::fs::read_dir(&account)
        .expect("account files")
        .flatten()
    {
        std::fs::set_permissions(
            entry.path(),
            std::os::unix::fs::PermissionsExt::from_mode(0o644),
        )
        .expect("chmod");
    }
    std::fs::set_permissions(
        &account,
        std::os::unix::fs::PermissionsExt::from_mode(0o755),
    )
    .expect("chmod");
    let api_port = plane
        .server_url()
        .rsplit(':')
        .next()
        .expect("port")
        .trim_end_matches('/')
        .to_owned();
    let port = pko_tests::agent::free_port().expect("port");
    let mut args = words(&[
        "/share/tini",
        "/share/agent",
        "--",
        "serve",
        "--workspace",
        "/share/workspace",
        "--skip-install",
        "--env-file",
        "/share/.env",
        "--auth-mode",
        "kube",
        "--kube-audience",
    ]);
    args.extend([
        format!("ws.{ns}"),
        "--kube-workspace-namespace".into(),
        ns.clone(),
        "--kube-workspace-name".into(),
        "ws".into(),
        "--host".into(),
        "127.0.0.1".into(),
        "--port".into(),
        port.to_string(),
    ]);
    bundle.prepare(
        &args,
        &[
            "KUBERNETES_SERVICE_HOST=127.0.0.1".into(),
            format!("KUBERNETES_SERVICE_PORT={api_port}"),
            format!("POD_NAMESPACE={ns}"),
            "POD_SA_NAME=pulumi".into(),
            "AGENT_MEMLIMIT=67108864".into(),
            "PULUMI_ENV=/share/.env".into(),
        ],
        &[
            share_mount,
            home,
            bind(
                "/var/run/secrets/kubernetes.io/serviceaccount",
                &account,
                true,
            ),
        ],
    );
    let container = Container { id: container_id() };
    let mut cmd = Command::new(runtime());
    cmd.arg("run")
        .arg("--bundle")
        .arg(bundle.path())
        .arg(&container.id)
        .stdin(Stdio::null());
    let log = tmp.path().join("serve.log");
    let mut running = spawn_guarded(cmd, "runc run pko-rs-agent serve", &log).expect("runc run");
    let listening = pko_tests::wait_for("the agent to listen", Duration::from_secs(60), || {
        let exited = running.try_wait().ok().flatten();
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
    let log_text = || std::fs::read_to_string(&log).unwrap_or_default();
    assert!(
        matches!(listening, Ok(true)),
        "{listening:?}: {}",
        log_text()
    );
    let call = |token: String| async move {
        let mut agent = pko_agent::client::connect(&pko_agent::client::Target {
            address: format!("127.0.0.1:{port}"),
            ca_pem: None,
            server_name: None,
            token: Some(token),
            connect_timeout: Duration::from_secs(5),
        })
        .await
        .expect("connect");
        agent
            .pulumi_version(pko_agent::proto::PulumiVersionRequest {})
            .await
            .map(|r| r.into_inner().version)
    };
    let operator = kubeauth::token(&client, &ns, "operator", Some(&format!("ws.{ns}")))
        .await
        .expect("operator token");
    let version = call(operator)
        .await
        .unwrap_or_else(|s| panic!("{s:?}: {}", log_text()));
    assert!(version.starts_with("v3."), "{version}");
    let elsewhere = kubeauth::token(&client, &ns, "operator", Some("other.ns"))
        .await
        .expect("token");
    let refused = call(elsewhere).await.expect_err("another audience");
    assert_eq!(refused.code(), tonic::Code::Unauthenticated);
    drop(container);
    drop(running);
}
