//! etcd + kube-apiserver on loopback, with CRDs installed.

use std::collections::BTreeMap;
use std::fmt;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::{LazyLock, Mutex, MutexGuard, Once, OnceLock, PoisonError};
use std::time::{Duration, Instant, SystemTime};

use k8s_openapi::api::core::v1::Namespace;
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::api::{Api, ObjectMeta, Patch, PatchParams, PostParams};
use kube::config::{KubeConfigOptions, Kubeconfig};
use rand::Rng;
use serde::Deserialize;
use tempfile::TempDir;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::sync::Notify;

use crate::process::{ChildGuard, process_alive, process_start_time, spawn_guarded};
use crate::{HarnessError, LogTail, pki, repo_root, tool_dir, wait_for};

/// Field manager of every server-side apply done by the harness.
pub const FIELD_MANAGER: &str = "pko-tests";
/// Label (value `"true"`) put on every namespace made by [`ControlPlane::namespace`], so they
/// can be told apart from the built-in ones.
pub const NAMESPACE_LABEL: &str = "pko-tests";

/// Prefix of temporary state folders; the owner's pid follows, so stale ones can be found.
const STATE_PREFIX: &str = "pko-rs-harness-";
const ETCD_READY_TIMEOUT: Duration = Duration::from_secs(30);
const APISERVER_READY_TIMEOUT: Duration = Duration::from_secs(60);
const CRD_ESTABLISHED_TIMEOUT: Duration = Duration::from_secs(60);
/// Another process may take one of the free ports between our probe and the bind.
const LAUNCH_ATTEMPTS: usize = 3;
const LOG_TAIL_LINES: usize = 40;
/// Headroom for large CRDs: PKO's Stack CRD is ~0.7 MB as stored JSON, half of etcd's
/// 1.5 MiB default request limit, and ours may grow.
const ETCD_MAX_REQUEST_BYTES: u64 = 8 * 1024 * 1024;

/// How to start a private control plane.
#[derive(Debug, Clone, Default)]
pub struct StartOptions {
    /// Keep state (kubeconfig, pki, logs, etcd data) here instead of in a temporary folder.
    /// The folder is kept after stop; etcd data in it is wiped at each start.
    pub dir: Option<PathBuf>,
    /// CRD manifests to install after start; default `<repo>/deploy/crds`. A missing or empty
    /// folder installs nothing.
    pub crds_dir: Option<PathBuf>,
    /// Write the apiserver's audit log (every request, at the Metadata level, JSON lines) to
    /// `logs/audit.log` in the state folder; see [`ControlPlane::audit_log`].
    pub audit_log: bool,
    /// Run etcd and kube-apiserver inside a real node's namespaces (see [`crate::node`]), with
    /// the host's loopback ports forwarded to them, so the apiserver reaches pods (webhooks,
    /// kubelet) and pods reach it through the `kubernetes` Service.
    pub in_node: Option<InNode>,
}

/// Where and how a control plane runs inside a node's namespaces.
#[derive(Debug, Clone)]
pub struct InNode {
    pub netns: std::sync::Arc<crate::netns::Netns>,
    /// The node's address: the `kubernetes` Service's endpoint.
    pub address: String,
}

/// The audit policy of [`StartOptions::audit_log`]: who did what to which object, and the
/// answer's code; no bodies.
const AUDIT_POLICY: &str = "apiVersion: audit.k8s.io/v1
kind: Policy
omitStages: [RequestReceived]
rules:
  - level: Metadata
";

/// A running etcd + kube-apiserver pair.
///
/// Admin access is a bearer token in `system:masters`; TLS uses a CA generated per start.
/// Processes are killed on drop (and by the kernel if the test process dies).
pub struct ControlPlane {
    dir: PathBuf,
    config: kube::Config,
    kubeconfig_path: PathBuf,
    server_url: String,
    kubectl_path: PathBuf,
    startup_time: Duration,
    /// etcd first, then kube-apiserver: stopped in reverse order.
    processes: Mutex<Vec<ChildGuard>>,
    /// How kube-apiserver was started, to start it again on the same port.
    apiserver_cmd: StoredCommand,
    /// `Some` when the state lives in a temporary folder, removed on stop.
    temp: Mutex<Option<TempDir>>,
    /// Host loopback forwards into a node's namespaces ([`StartOptions::in_node`]).
    forwards: Mutex<Vec<crate::netns::Forward>>,
}

impl fmt::Debug for ControlPlane {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ControlPlane")
            .field("server_url", &self.server_url)
            .field("dir", &self.dir)
            .finish_non_exhaustive()
    }
}

/// A control plane shared by the tests of this binary: the plane (or the message of its failed
/// start), set once by its init thread.
struct SharedSlot {
    plane: OnceLock<Result<ControlPlane, String>>,
    init: Once,
    set: LazyLock<Notify>,
    /// Name of the init thread.
    thread: &'static str,
}

impl SharedSlot {
    const fn new(thread: &'static str) -> Self {
        SharedSlot {
            plane: OnceLock::new(),
            init: Once::new(),
            set: LazyLock::new(Notify::new),
            thread,
        }
    }

    /// Every `#[tokio::test]` has its own runtime, which ends with the test, so the start runs
    /// on a dedicated thread with its own runtime and callers only wait for its result.
    async fn get(&'static self) -> Result<&'static ControlPlane, HarnessError> {
        self.init.call_once(|| {
            WATCHDOG.call_once(start_watchdog);
            let spawned = std::thread::Builder::new()
                .name(self.thread.into())
                .spawn(move || {
                    let result = match tokio::runtime::Builder::new_current_thread()
                        .enable_all()
                        .build()
                    {
                        Ok(rt) => rt
                            .block_on(ControlPlane::start(StartOptions::default()))
                            .map_err(|e| e.to_string()),
                        Err(e) => Err(format!("cannot build a tokio runtime: {e}")),
                    };
                    let started = result.is_ok();
                    let _ = self.plane.set(result);
                    if started {
                        // Statics are never dropped: stop the processes and remove the
                        // temporary folder when the test binary exits normally.
                        AT_EXIT.call_once(|| {
                            // SAFETY: registers a plain `extern "C"` function.
                            unsafe { libc::atexit(stop_shared_at_exit) };
                        });
                    }
                    self.set.notify_waiters();
                });
            if let Err(e) = spawned {
                let _ = self
                    .plane
                    .set(Err(format!("cannot start the init thread: {e}")));
            }
        });
        loop {
            // Register interest before looking, so a result set in between is not missed.
            let notified = self.set.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            if let Some(result) = self.plane.get() {
                return result.as_ref().map_err(|e| HarnessError::Shared(e.clone()));
            }
            notified.await;
        }
    }
}

static SHARED: SharedSlot = SharedSlot::new("pko-tests-shared-plane");
static APART: SharedSlot = SharedSlot::new("pko-tests-apart-plane");
static WATCHDOG: Once = Once::new();
static AT_EXIT: Once = Once::new();

impl ControlPlane {
    /// Shared control plane for this test binary: started on first call (etcd + kube-apiserver
    /// on loopback with free random ports, in a temp dir), CRDs from `deploy/crds/*.yaml`
    /// installed by server-side apply (field manager `pko-tests`) and Established. Later calls
    /// return the same one.
    ///
    /// Panics if it cannot start (a test cannot go on without it); see [`Self::try_shared`].
    pub async fn shared() -> &'static ControlPlane {
        match Self::try_shared().await {
            Ok(plane) => plane,
            Err(e) => panic!("{e}"),
        }
    }

    /// [`Self::shared`] that returns the start error instead of panicking.
    pub async fn try_shared() -> Result<&'static ControlPlane, HarnessError> {
        SHARED.get().await
    }

    /// A second shared control plane, started like [`Self::shared`], for the tests whose
    /// cluster-wide objects must not reach the others: `deploy/` installs a validating webhook
    /// (failure policy Fail) for Stacks and Workspaces in every namespace, and without a
    /// kubelet no operator pod ever answers it.
    ///
    /// Panics if it cannot start.
    pub async fn shared_apart() -> &'static ControlPlane {
        match APART.get().await {
            Ok(plane) => plane,
            Err(e) => panic!("{e}"),
        }
    }

    /// Start a fresh, private control plane (for `make run` / benchmarks); stopped on drop.
    pub async fn start(opts: StartOptions) -> Result<ControlPlane, HarnessError> {
        let started = Instant::now();
        let bins = KubeBinaries::find()?;
        let (dir, mut temp) = match &opts.dir {
            Some(dir) => {
                std::fs::create_dir_all(dir).map_err(|e| {
                    HarnessError::io(format!("creating state folder {}", dir.display()), e)
                })?;
                let dir = std::path::absolute(dir).map_err(|e| {
                    HarnessError::io(format!("resolving state folder {}", dir.display()), e)
                })?;
                // A killed earlier run of `make run` may have left its processes (only if
                // the death signal failed); they would hold the etcd data.
                kill_leftovers(&dir);
                (dir, None)
            }
            None => {
                let temp = new_state_dir()?;
                (temp.path().to_path_buf(), Some(temp))
            }
        };

        let token = random_lowercase(32);
        write_state_files(&dir, &pki::generate()?, &token)?;

        let mut attempt = 1;
        let launched = loop {
            match launch(&bins, &dir, &token, &opts).await {
                Ok(launched) => break launched,
                Err(e) if attempt < LAUNCH_ATTEMPTS && is_port_clash(&e) => attempt += 1,
                Err(e) => {
                    // Keep the logs for a look; the next run's stale-folder sweep removes them.
                    if let Some(temp) = temp.take() {
                        let _ = temp.keep();
                    }
                    return Err(e);
                }
            }
        };

        let mut plane = ControlPlane {
            dir,
            config: launched.config,
            kubeconfig_path: launched.kubeconfig_path,
            server_url: launched.server_url,
            kubectl_path: bins.kubectl,
            startup_time: Duration::ZERO,
            processes: Mutex::new(launched.processes),
            apiserver_cmd: launched.apiserver_cmd,
            temp: Mutex::new(temp),
            forwards: Mutex::new(launched.forwards),
        };
        let crds_dir = opts
            .crds_dir
            .unwrap_or_else(|| repo_root().join("deploy/crds"));
        plane.install_crds(&crds_dir).await?;
        plane.startup_time = started.elapsed();
        eprintln!(
            "pko-tests: control plane {} ready in {:.1}s (state in {})",
            plane.server_url,
            plane.startup_time.as_secs_f64(),
            plane.dir.display()
        );
        Ok(plane)
    }

    /// A new client on the calling runtime; must be called inside a tokio runtime.
    ///
    /// Clients hold connections and tasks of the runtime that built them, so they are never
    /// shared between tests. Panics only if the configuration, checked at start, stops
    /// producing a client; see [`Self::try_client`].
    pub fn client(&self) -> kube::Client {
        match self.try_client() {
            Ok(client) => client,
            Err(e) => panic!("{e}"),
        }
    }

    pub fn try_client(&self) -> Result<kube::Client, HarnessError> {
        crate::ensure_crypto_provider();
        kube::Client::try_from(self.config.clone())
            .map_err(|e| HarnessError::kube("building a kube client", e))
    }

    pub fn kube_config(&self) -> kube::Config {
        self.config.clone()
    }

    /// A kubeconfig file accepted by kube-rs and by `kubectl --kubeconfig`.
    pub fn kubeconfig_path(&self) -> &Path {
        &self.kubeconfig_path
    }

    pub fn server_url(&self) -> String {
        self.server_url.clone()
    }

    /// The apiserver's CA certificate (PEM).
    pub fn ca_path(&self) -> PathBuf {
        self.dir().join("pki").join("ca.crt")
    }

    /// The built kubectl with `--kubeconfig` set.
    pub fn kubectl(&self) -> Command {
        let mut cmd = Command::new(&self.kubectl_path);
        cmd.arg("--kubeconfig").arg(&self.kubeconfig_path);
        cmd
    }

    /// The apiserver's audit log (JSON lines), when started with [`StartOptions::audit_log`].
    pub fn audit_log(&self) -> PathBuf {
        self.dir.join("logs").join("audit.log")
    }

    /// The state folder: `kubeconfig`, `pki/`, `logs/{etcd,kube-apiserver}.log`, `etcd/`.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Time from the start call until the apiserver was ready and the CRDs Established.
    pub fn startup_time(&self) -> Duration {
        self.startup_time
    }

    /// A fresh namespace with a unique name derived from `prefix`; created and returned.
    ///
    /// Named `<prefix>-<6 random [a-z0-9]>` (the prefix is lowercased, cut to fit and
    /// stripped of characters a namespace name cannot have) and labelled
    /// `pko-tests=true`. Namespaces are never deleted: without a controller-manager they
    /// would stay Terminating anyway.
    pub async fn namespace(&self, prefix: &str) -> Result<String, HarnessError> {
        let base = namespace_base(prefix);
        let api: Api<Namespace> = Api::all(self.try_client()?);
        let mut last = None;
        for _ in 0..5 {
            let name = format!("{base}-{}", random_lowercase(6));
            let ns = Namespace {
                metadata: ObjectMeta {
                    name: Some(name.clone()),
                    labels: Some(BTreeMap::from([(
                        NAMESPACE_LABEL.to_string(),
                        "true".to_string(),
                    )])),
                    ..ObjectMeta::default()
                },
                ..Namespace::default()
            };
            match api.create(&PostParams::default(), &ns).await {
                Ok(_) => return Ok(name),
                Err(kube::Error::Api(status)) if status.is_already_exists() => {
                    last = Some(kube::Error::Api(status));
                }
                Err(e) => return Err(HarnessError::kube(format!("creating namespace {name}"), e)),
            }
        }
        Err(match last {
            Some(e) => HarnessError::kube(format!("creating a namespace for {prefix:?}"), e),
            None => HarnessError::Timeout {
                what: format!("a free namespace name for {prefix:?}"),
                timeout: Duration::ZERO,
            },
        })
    }

    /// Server-side applies every CustomResourceDefinition in `dir/*.{yaml,yml,json}` (field
    /// manager `pko-tests`, forced) and waits until each is Established. A missing or empty
    /// folder is a no-op; another kind of object in it is an error.
    pub async fn install_crds(&self, dir: &Path) -> Result<(), HarnessError> {
        let crds = read_crds(dir)?;
        if crds.is_empty() {
            return Ok(());
        }
        let api: Api<CustomResourceDefinition> = Api::all(self.try_client()?);
        let params = PatchParams::apply(FIELD_MANAGER).force();
        for (path, name, doc) in &crds {
            api.patch(name, &params, &Patch::Apply(doc))
                .await
                .map_err(|e| {
                    HarnessError::kube(format!("applying CRD {name} from {}", path.display()), e)
                })?;
        }
        for (_, name, _) in &crds {
            let api = api.clone();
            wait_for(
                &format!("CRD {name} to be Established"),
                CRD_ESTABLISHED_TIMEOUT,
                move || {
                    let api = api.clone();
                    let name = name.clone();
                    async move {
                        let crd = api.get_opt(&name).await.ok().flatten()?;
                        crd_established(&crd).then_some(())
                    }
                },
            )
            .await?;
        }
        Ok(())
    }

    /// `kill -9` of kube-apiserver, then a new one with the same flags on the same port (etcd
    /// and its data stay): a control-plane crash as clients see it. Returns how long the
    /// apiserver was away. Not for the shared plane: other tests would see the outage.
    pub async fn restart_apiserver(&self) -> Result<Duration, HarnessError> {
        let taken = std::mem::take(&mut *lock(&self.processes));
        let [etcd, apiserver]: [ChildGuard; 2] =
            taken.try_into().map_err(|_| HarnessError::Missing {
                what: "a running etcd and kube-apiserver to restart".into(),
            })?;
        let mut etcd = etcd;
        let mut old = apiserver;
        let down = Instant::now();
        old.kill();
        let log = old.log_path().to_path_buf();
        drop(old);
        let mut apiserver = spawn_guarded(self.apiserver_cmd.command(), "kube-apiserver", &log)?;
        write_pid_file(&self.dir, &apiserver)?;
        wait_apiserver(&mut apiserver, &mut etcd, &self.config, &self.server_url).await?;
        lock(&self.processes).extend([etcd, apiserver]);
        Ok(down.elapsed())
    }

    /// Kills kube-apiserver, then etcd, and removes a temporary state folder. Idempotent;
    /// also run at exit for the shared plane and on drop.
    fn stop(&self) {
        let mut processes = lock(&self.processes);
        while let Some(mut process) = processes.pop() {
            process.kill();
            let _ = std::fs::remove_file(pid_file(&self.dir, process.name()));
        }
        drop(processes);
        lock(&self.forwards).clear();
        let temp = lock(&self.temp).take();
        // PKO_TESTS_KEEP_STATE=1 keeps the logs and state for a look after the run.
        if std::env::var_os("PKO_TESTS_KEEP_STATE").is_some_and(|v| v == "1")
            && let Some(temp) = temp
        {
            eprintln!("pko-tests: state kept in {}", temp.keep().display());
            return;
        }
        drop(temp);
    }
}

impl Drop for ControlPlane {
    fn drop(&mut self) {
        self.stop();
    }
}

extern "C" fn stop_shared_at_exit() {
    for slot in [&SHARED, &APART] {
        if let Some(Ok(plane)) = slot.plane.get() {
            plane.stop();
        }
    }
}

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}

fn crd_established(crd: &CustomResourceDefinition) -> bool {
    crd.status
        .as_ref()
        .and_then(|s| s.conditions.as_ref())
        .is_some_and(|conditions| {
            conditions
                .iter()
                .any(|c| c.type_ == "Established" && c.status == "True")
        })
}

struct KubeBinaries {
    etcd: PathBuf,
    apiserver: PathBuf,
    kubectl: PathBuf,
}

impl KubeBinaries {
    fn find() -> Result<Self, HarnessError> {
        let dir = tool_dir("kube")?;
        let find = |name: &str| {
            let path = dir.join(name);
            if path.is_file() {
                Ok(path)
            } else {
                Err(HarnessError::ToolsMissing {
                    component: "kube".into(),
                    detail: format!("{} is missing", path.display()),
                    env_var: "PKO_TOOLS_KUBE_DIR".into(),
                })
            }
        };
        Ok(KubeBinaries {
            etcd: find("etcd")?,
            apiserver: find("kube-apiserver")?,
            kubectl: find("kubectl")?,
        })
    }
}

/// A command's program and arguments (a `Command` cannot be cloned or run twice).
#[derive(Debug, Clone)]
struct StoredCommand {
    program: PathBuf,
    args: Vec<std::ffi::OsString>,
}

impl StoredCommand {
    fn of(cmd: &Command) -> Self {
        Self {
            program: PathBuf::from(cmd.get_program()),
            args: cmd.get_args().map(ToOwned::to_owned).collect(),
        }
    }

    fn command(&self) -> Command {
        let mut cmd = Command::new(&self.program);
        cmd.args(&self.args);
        cmd
    }
}

struct Launched {
    processes: Vec<ChildGuard>,
    forwards: Vec<crate::netns::Forward>,
    apiserver_cmd: StoredCommand,
    config: kube::Config,
    kubeconfig_path: PathBuf,
    server_url: String,
}

/// Starts etcd, waits for it, starts kube-apiserver, waits for `/readyz`. On error the guards
/// drop and kill what was started.
async fn launch(
    bins: &KubeBinaries,
    dir: &Path,
    token: &str,
    opts: &StartOptions,
) -> Result<Launched, HarnessError> {
    let node = opts.in_node.as_ref();
    let command = |program: &Path| match node {
        Some(node) => node.netns.command(program),
        None => Command::new(program),
    };
    let mut forwards = Vec::new();
    let [client_port, peer_port, api_port] = free_ports()?;
    let etcd_data = dir.join("etcd");
    if etcd_data.exists() {
        std::fs::remove_dir_all(&etcd_data).map_err(|e| {
            HarnessError::io(format!("wiping etcd data {}", etcd_data.display()), e)
        })?;
    }
    let logs = dir.join("logs");

    let client_url = format!("http://127.0.0.1:{client_port}");
    let peer_url = format!("http://127.0.0.1:{peer_port}");
    let mut etcd_cmd = command(&bins.etcd);
    etcd_cmd
        .arg("--name=default")
        .arg(format!("--data-dir={}", etcd_data.display()))
        .arg(format!("--listen-client-urls={client_url}"))
        .arg(format!("--advertise-client-urls={client_url}"))
        .arg(format!("--listen-peer-urls={peer_url}"))
        .arg(format!("--initial-advertise-peer-urls={peer_url}"))
        .arg(format!("--initial-cluster=default={peer_url}"))
        .arg("--unsafe-no-fsync")
        .arg(format!("--max-request-bytes={ETCD_MAX_REQUEST_BYTES}"))
        .arg("--log-level=warn");
    let mut etcd = spawn_guarded(etcd_cmd, "etcd", &logs.join("etcd.log"))?;
    write_pid_file(dir, &etcd)?;
    if let Some(node) = node {
        forwards.push(node.netns.forward_in(client_port, loopback(client_port))?);
    }
    wait_etcd(&mut etcd, client_port).await?;

    let pki = dir.join("pki");
    let server_url = format!("https://127.0.0.1:{api_port}");
    let mut api_cmd = command(&bins.apiserver);
    api_cmd.arg(format!("--etcd-servers={client_url}"));
    match node {
        // Pods reach it through the `kubernetes` Service (the node's address), the kubelet
        // with its client certificate, authorized by the Node authorizer; pods get service
        // account tokens.
        Some(node) => api_cmd
            .arg("--bind-address=0.0.0.0")
            .arg(format!("--advertise-address={}", node.address))
            .arg(format!("--client-ca-file={}", pki.join("ca.crt").display()))
            .arg("--authorization-mode=Node,RBAC")
            .arg("--enable-admission-plugins=NodeRestriction")
            // Logs and exec reach the kubelet by the node's address: its name is in no DNS.
            .arg("--kubelet-preferred-address-types=InternalIP"),
        None => api_cmd
            .arg("--bind-address=127.0.0.1")
            .arg("--advertise-address=127.0.0.1")
            .arg("--authorization-mode=RBAC")
            .arg("--disable-admission-plugins=ServiceAccount"),
    };
    api_cmd
        .arg(format!("--secure-port={api_port}"))
        .arg(format!("--cert-dir={}", pki.display()))
        .arg(format!(
            "--tls-cert-file={}",
            pki.join("apiserver.crt").display()
        ))
        .arg(format!(
            "--tls-private-key-file={}",
            pki.join("apiserver.key").display()
        ))
        .arg("--service-cluster-ip-range=10.0.0.0/24")
        .arg(format!("--service-account-issuer={server_url}"))
        .arg(format!(
            "--service-account-key-file={}",
            pki.join("sa.pub").display()
        ))
        .arg(format!(
            "--service-account-signing-key-file={}",
            pki.join("sa.key").display()
        ))
        .arg(format!(
            "--token-auth-file={}",
            dir.join("tokens.csv").display()
        ))
        .arg("--allow-privileged=true")
        .arg("--enable-priority-and-fairness=false")
        .arg("--profiling=false");
    if opts.audit_log {
        let policy = dir.join("audit-policy.yaml");
        std::fs::write(&policy, AUDIT_POLICY)
            .map_err(|e| HarnessError::io(format!("writing {}", policy.display()), e))?;
        api_cmd
            .arg(format!("--audit-policy-file={}", policy.display()))
            .arg(format!(
                "--audit-log-path={}",
                logs.join("audit.log").display()
            ))
            .arg("--audit-log-format=json")
            // Written as each request completes, so a test reads every request made so far.
            .arg("--audit-log-mode=blocking");
    }
    let apiserver_cmd = StoredCommand::of(&api_cmd);
    let mut apiserver = spawn_guarded(api_cmd, "kube-apiserver", &logs.join("kube-apiserver.log"))?;
    write_pid_file(dir, &apiserver)?;
    if let Some(node) = node {
        forwards.push(node.netns.forward_in(api_port, loopback(api_port))?);
    }

    let kubeconfig_path = dir.join("kubeconfig");
    write_kubeconfig(
        &kubeconfig_path,
        &server_url,
        &pki.join("ca.crt"),
        token,
        "default",
    )?;
    let kubeconfig =
        Kubeconfig::read_from(&kubeconfig_path).map_err(|source| HarnessError::Kubeconfig {
            path: kubeconfig_path.clone(),
            source,
        })?;
    let config = kube::Config::from_custom_kubeconfig(kubeconfig, &KubeConfigOptions::default())
        .await
        .map_err(|source| HarnessError::Kubeconfig {
            path: kubeconfig_path.clone(),
            source,
        })?;
    wait_apiserver(&mut apiserver, &mut etcd, &config, &server_url).await?;
    Ok(Launched {
        processes: vec![etcd, apiserver],
        forwards,
        apiserver_cmd,
        config,
        kubeconfig_path,
        server_url,
    })
}

fn loopback(port: u16) -> std::net::SocketAddr {
    std::net::SocketAddr::from(([127, 0, 0, 1], port))
}

fn log_tail(process: &ChildGuard) -> Box<LogTail> {
    Box::new(LogTail {
        path: process.log_path().to_path_buf(),
        tail: process.log_tail(LOG_TAIL_LINES),
    })
}

/// An error from a process that has exited, or `None` while it runs.
fn exited(process: &mut ChildGuard) -> Option<HarnessError> {
    let status = match process.try_wait() {
        Ok(Some(status)) => status.to_string(),
        Ok(None) => return None,
        Err(e) => format!("unknown status ({e})"),
    };
    Some(HarnessError::Exited {
        name: process.name().to_string(),
        status,
        log: log_tail(process),
    })
}

fn not_ready(
    process: &ChildGuard,
    endpoint: String,
    waited: Duration,
    last: String,
) -> HarnessError {
    HarnessError::NotReady {
        name: process.name().to_string(),
        endpoint,
        waited,
        last,
        log: log_tail(process),
    }
}

/// Waits for etcd's `/health` to report healthy (plain HTTP on the client port).
async fn wait_etcd(etcd: &mut ChildGuard, port: u16) -> Result<(), HarnessError> {
    let started = Instant::now();
    let mut last;
    loop {
        if let Some(e) = exited(etcd) {
            return Err(e);
        }
        match tokio::time::timeout(Duration::from_secs(2), etcd_health(port)).await {
            Ok(Ok(body)) if body.contains(r#""health":"true""#) => return Ok(()),
            Ok(Ok(body)) => last = format!("answer: {}", body.trim()),
            Ok(Err(e)) => last = e.to_string(),
            Err(_) => last = "no answer within 2s".into(),
        }
        if started.elapsed() > ETCD_READY_TIMEOUT {
            return Err(not_ready(
                etcd,
                format!("http://127.0.0.1:{port}/health"),
                started.elapsed(),
                last,
            ));
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

async fn etcd_health(port: u16) -> std::io::Result<String> {
    let mut stream = tokio::net::TcpStream::connect(("127.0.0.1", port)).await?;
    stream
        .write_all(b"GET /health HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n")
        .await?;
    let mut response = Vec::new();
    stream.read_to_end(&mut response).await?;
    Ok(String::from_utf8_lossy(&response).into_owned())
}

/// Waits until `/readyz` answers 200 through kube-rs, which also proves that the kubeconfig,
/// its CA and the token work.
async fn wait_apiserver(
    apiserver: &mut ChildGuard,
    etcd: &mut ChildGuard,
    config: &kube::Config,
    server_url: &str,
) -> Result<(), HarnessError> {
    let started = Instant::now();
    crate::ensure_crypto_provider();
    let client = kube::Client::try_from(config.clone())
        .map_err(|e| HarnessError::kube("building a kube client", e))?;
    let mut last;
    loop {
        if let Some(e) = exited(apiserver).or_else(|| exited(etcd)) {
            return Err(e);
        }
        let request = http::Request::get("/readyz")
            .body(Vec::new())
            .map_err(|e| HarnessError::io("building /readyz request", std::io::Error::other(e)))?;
        match tokio::time::timeout(Duration::from_secs(5), client.request_text(request)).await {
            Ok(Ok(_)) => return Ok(()),
            Ok(Err(e)) => last = e.to_string(),
            Err(_) => last = "no answer within 5s".into(),
        }
        if started.elapsed() > APISERVER_READY_TIMEOUT {
            return Err(not_ready(
                apiserver,
                format!("{server_url}/readyz"),
                started.elapsed(),
                last,
            ));
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// A port clash shows as a bind error in the log of the process that lost the race.
fn is_port_clash(e: &HarnessError) -> bool {
    match e {
        HarnessError::Exited { log, .. } | HarnessError::NotReady { log, .. } => {
            log.tail.contains("address already in use")
        }
        _ => false,
    }
}

/// Free loopback ports, all different (see [`crate::agent::free_port`]).
fn free_ports<const N: usize>() -> Result<[u16; N], HarnessError> {
    let mut ports = [0u16; N];
    for port in &mut ports {
        *port = crate::agent::free_port()?;
    }
    Ok(ports)
}

fn write_file(path: &Path, contents: &str, private: bool) -> Result<(), HarnessError> {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    let mut options = std::fs::OpenOptions::new();
    options.write(true).create(true).truncate(true);
    if private {
        options.mode(0o600);
    }
    options
        .open(path)
        .and_then(|mut f| f.write_all(contents.as_bytes()))
        .map_err(|e| HarnessError::io(format!("writing {}", path.display()), e))
}

fn write_state_files(dir: &Path, pki: &pki::Pki, token: &str) -> Result<(), HarnessError> {
    let pki_dir = dir.join("pki");
    std::fs::create_dir_all(&pki_dir)
        .map_err(|e| HarnessError::io(format!("creating {}", pki_dir.display()), e))?;
    write_file(&pki_dir.join("ca.crt"), &pki.ca_cert_pem, false)?;
    write_file(&pki_dir.join("apiserver.crt"), &pki.serving_cert_pem, false)?;
    write_file(&pki_dir.join("apiserver.key"), &pki.serving_key_pem, true)?;
    write_file(&pki_dir.join("sa.key"), &pki.sa_key_pem, true)?;
    write_file(&pki_dir.join("sa.pub"), &pki.sa_pub_pem, false)?;
    write_file(
        &pki_dir.join("node-client.crt"),
        &pki.node_client_cert_pem,
        false,
    )?;
    write_file(
        &pki_dir.join("node-client.key"),
        &pki.node_client_key_pem,
        true,
    )?;
    // token,user,uid,"groups"
    write_file(
        &dir.join("tokens.csv"),
        &format!("{token},admin,admin,\"system:masters\"\n"),
        true,
    )
}

pub(crate) fn write_kubeconfig(
    path: &Path,
    server: &str,
    ca: &Path,
    token: &str,
    namespace: &str,
) -> Result<(), HarnessError> {
    // JSON strings are valid YAML scalars and need no further escaping.
    let quote = |s: &str| serde_json::Value::String(s.to_string()).to_string();
    let text = format!(
        "apiVersion: v1
kind: Config
clusters:
- name: pko-tests
  cluster:
    server: {server}
    certificate-authority: {ca}
users:
- name: admin
  user:
    token: {token}
contexts:
- name: pko-tests
  context:
    cluster: pko-tests
    user: admin
    namespace: {namespace}
current-context: pko-tests
preferences: {{}}
",
        server = quote(server),
        ca = quote(&ca.to_string_lossy()),
        token = quote(token),
        namespace = quote(namespace),
    );
    write_file(path, &text, true)
}

fn pid_file(dir: &Path, name: &str) -> PathBuf {
    dir.join(format!("{name}.pid"))
}

fn write_pid_file(dir: &Path, process: &ChildGuard) -> Result<(), HarnessError> {
    write_file(
        &pid_file(dir, process.name()),
        &format!("{}\n", process.pid()),
        false,
    )
}

/// SIGKILLs processes named in `dir/*.pid` whose command line still mentions `dir` (so a
/// reused pid of an unrelated process is never hit).
fn kill_leftovers(dir: &Path) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    let needle = dir.to_string_lossy().into_owned();
    for entry in entries.flatten() {
        let path = entry.path();
        if path.extension().is_none_or(|ext| ext != "pid") {
            continue;
        }
        let Some(pid) = std::fs::read_to_string(&path)
            .ok()
            .and_then(|s| s.trim().parse::<u32>().ok())
        else {
            continue;
        };
        let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
        if process_alive(pid)
            && String::from_utf8_lossy(&cmdline).contains(&needle)
            && let Ok(pid) = libc::pid_t::try_from(pid)
        {
            // SAFETY: plain system call on a pid checked just above.
            unsafe { libc::kill(pid, libc::SIGKILL) };
        }
        let _ = std::fs::remove_file(&path);
    }
}

/// A new `$TMPDIR/pko-rs-harness-<pid>-XXXXXX` folder with an `owner` file, after removing
/// the folders of earlier runs whose owner is dead (killed test binaries leave them).
fn new_state_dir() -> Result<TempDir, HarnessError> {
    let base = std::env::temp_dir();
    clean_stale_state_dirs(&base);
    let pid = std::process::id();
    let temp = tempfile::Builder::new()
        .prefix(&format!("{STATE_PREFIX}{pid}-"))
        .tempdir_in(&base)
        .map_err(|e| {
            HarnessError::io(format!("creating a state folder in {}", base.display()), e)
        })?;
    let start = process_start_time(pid).unwrap_or(0);
    write_file(
        &temp.path().join("owner"),
        &format!("{pid} {start}\n"),
        false,
    )?;
    Ok(temp)
}

fn clean_stale_state_dirs(base: &Path) {
    let Ok(entries) = std::fs::read_dir(base) else {
        return;
    };
    for entry in entries.flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        let Some(rest) = name.strip_prefix(STATE_PREFIX) else {
            continue;
        };
        let path = entry.path();
        if !path.is_dir() || owner_alive(&path, rest) {
            continue;
        }
        kill_leftovers(&path);
        let _ = std::fs::remove_dir_all(&path);
    }
}

/// Whether the process that made a state folder still runs. `name_rest` is the folder name
/// after the prefix (`<pid>-XXXXXX`), used while the `owner` file is not written yet.
fn owner_alive(dir: &Path, name_rest: &str) -> bool {
    if let Ok(owner) = std::fs::read_to_string(dir.join("owner")) {
        let mut parts = owner.split_whitespace().map(str::parse::<u64>);
        if let (Some(Ok(pid)), Some(Ok(start))) = (parts.next(), parts.next()) {
            let Ok(pid) = u32::try_from(pid) else {
                return false;
            };
            return process_alive(pid) && (start == 0 || process_start_time(pid) == Some(start));
        }
    }
    let pid = name_rest
        .split('-')
        .next()
        .and_then(|p| p.parse::<u32>().ok());
    if pid.is_some_and(process_alive) {
        return true;
    }
    // No owner file and a dead pid: only a folder being set up right now is young.
    std::fs::metadata(dir)
        .and_then(|m| m.modified())
        .ok()
        .and_then(|t| SystemTime::now().duration_since(t).ok())
        .is_none_or(|age| age < Duration::from_secs(60))
}

fn random_lowercase(len: usize) -> String {
    const CHARS: &[u8] = b"abcdefghijklmnopqrstuvwxyz0123456789";
    let mut rng = rand::rng();
    (0..len)
        .map(|_| char::from(CHARS[rng.random_range(0..CHARS.len())]))
        .collect()
}

/// `prefix` made fit for a DNS-1123 label with room for `-` and a 6-character suffix.
fn namespace_base(prefix: &str) -> String {
    let mapped: String = prefix
        .to_ascii_lowercase()
        .chars()
        .map(|c| if c.is_ascii_alphanumeric() { c } else { '-' })
        .collect();
    let mut base: String = mapped.trim_matches('-').chars().take(63 - 7).collect();
    while base.ends_with('-') {
        base.pop();
    }
    if base.is_empty() {
        base = "test".into();
    }
    base
}

/// Every CRD document in the manifests of `dir`, sorted by file name: (file, name, object).
fn read_crds(dir: &Path) -> Result<Vec<(PathBuf, String, serde_json::Value)>, HarnessError> {
    let entries = match std::fs::read_dir(dir) {
        Ok(entries) => entries,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(HarnessError::io(format!("reading {}", dir.display()), e)),
    };
    let mut files: Vec<PathBuf> = entries
        .flatten()
        .map(|e| e.path())
        .filter(|p| {
            p.is_file()
                && p.extension()
                    .is_some_and(|ext| ext == "yaml" || ext == "yml" || ext == "json")
        })
        .collect();
    files.sort();
    let mut crds = Vec::new();
    for path in files {
        let bad = |message: String| HarnessError::Manifest {
            path: path.clone(),
            message,
        };
        let text = std::fs::read_to_string(&path)
            .map_err(|e| HarnessError::io(format!("reading {}", path.display()), e))?;
        for doc in yaml_serde::Deserializer::from_str(&text) {
            let value = serde_json::Value::deserialize(doc).map_err(|e| bad(e.to_string()))?;
            if value.is_null() {
                continue;
            }
            let kind = value.get("kind").and_then(|k| k.as_str()).unwrap_or("");
            if kind != "CustomResourceDefinition" {
                return Err(bad(format!(
                    "expected only CustomResourceDefinitions, found kind {kind:?}"
                )));
            }
            let name = value
                .pointer("/metadata/name")
                .and_then(|n| n.as_str())
                .ok_or_else(|| bad("a CRD without metadata.name".into()))?
                .to_string();
            crds.push((path.clone(), name, value));
        }
    }
    Ok(crds)
}

/// How long one test binary may run before the watchdog ends it (`PKO_TEST_BINARY_TIMEOUT`,
/// seconds; default 45 minutes). The integration tests are one binary, so this bounds them all:
/// about 20 minutes on 2 cores when they pass, so the bound catches a hang, not a slow machine.
const BINARY_TIMEOUT_DEFAULT: Duration = Duration::from_secs(45 * 60);

/// Ends a test binary that runs far longer than it should, so a hung test fails with a message
/// (and the next binary runs) instead of stalling the whole `make test` until CI gives up.
fn start_watchdog() {
    let limit = std::env::var("PKO_TEST_BINARY_TIMEOUT")
        .ok()
        .and_then(|v| v.parse::<u64>().ok())
        .map(Duration::from_secs)
        .unwrap_or(BINARY_TIMEOUT_DEFAULT);
    let _ = std::thread::Builder::new()
        .name("pko-tests-watchdog".into())
        .spawn(move || {
            std::thread::sleep(limit);
            // Straight to the process's stderr: `eprintln!` in a thread spawned by a test goes
            // to that test's captured output, which is lost when the process exits.
            use std::io::Write as _;
            let _ = writeln!(
                std::io::stderr(),
                "pko-tests watchdog: this test binary is still running after {}s; a test hangs. \
                 Exiting with failure (set PKO_TEST_BINARY_TIMEOUT to change the limit).",
                limit.as_secs()
            );
            // `exit` runs the atexit hook that stops the shared control plane.
            std::process::exit(101);
        });
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn namespace_base_is_a_valid_label_prefix() {
        assert_eq!(namespace_base("My_Test"), "my-test");
        assert_eq!(namespace_base("--"), "test");
        let long = namespace_base(&"a".repeat(100));
        assert_eq!(long.len(), 56);
    }

    #[test]
    fn random_names_are_lowercase_alphanumeric() {
        let s = random_lowercase(64);
        assert_eq!(s.len(), 64);
        assert!(
            s.chars()
                .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit())
        );
    }

    #[test]
    fn missing_crd_folder_is_empty() {
        let crds = read_crds(Path::new("/nonexistent/pko-tests-crds")).expect("no error");
        assert!(crds.is_empty());
    }
}
