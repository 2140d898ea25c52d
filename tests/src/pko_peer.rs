//! The operators `make bench` measures side by side — pko-rs's release `pko-operator` and PKO
//! v2.9.0's manager (built by `tools/build.sh pko`) — started the same way against a control
//! plane, plus what the benchmark reads from their processes: CPU time, readiness, and a bare
//! HTTP server answering fixed bytes (the machine's limit for the file-server load).

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::io::{AsyncReadExt, AsyncWriteExt};

use crate::cluster_dns::{ClusterDns, private_mounts};
use crate::{ChildGuard, ControlPlane, HarnessError, LogTail, spawn_guarded, tool_dir};

/// How long an operator gets from spawn to a 200 from `/readyz`.
const READY_TIMEOUT: Duration = Duration::from_secs(120);
/// How often readiness is polled: the start → ready figure is this coarse.
const READY_POLL: Duration = Duration::from_millis(5);

/// One of the two operators under measurement.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Peer {
    /// PKO v2.9.0's manager (`operator/cmd`).
    Pko,
    /// This project's `pko-operator`.
    PkoRs,
}

impl Peer {
    /// The name tables use.
    pub fn label(self) -> &'static str {
        match self {
            Peer::Pko => "PKO v2.9.0",
            Peer::PkoRs => "pko-rs",
        }
    }
}

/// Where both operators' binaries and CRDs are.
#[derive(Clone, Debug)]
pub struct PeerBinaries {
    pub pko_rs: PathBuf,
    pub pko_rs_crds: PathBuf,
    pub pko_manager: PathBuf,
    pub pko_crds: PathBuf,
}

impl PeerBinaries {
    /// `pko_rs` is the `pko-operator` binary to run (the release build next to the bench);
    /// PKO's manager and CRDs come from `tools/build.sh dir pko` (or `PKO_TOOLS_PKO_DIR`).
    pub fn find(pko_rs: PathBuf) -> Result<Self, HarnessError> {
        let pko = tool_dir("pko")?;
        let bins = PeerBinaries {
            pko_rs,
            pko_rs_crds: crate::repo_root().join("deploy/crds"),
            pko_manager: pko.join("pko-manager"),
            pko_crds: pko.join("crds"),
        };
        for (path, how) in [
            (&bins.pko_rs, "cargo build --release -p pko-operator"),
            (&bins.pko_manager, "make pko"),
        ] {
            if !path.is_file() {
                return Err(HarnessError::Missing {
                    what: format!("{} (build it with `{how}`)", path.display()),
                });
            }
        }
        if !bins.pko_crds.is_dir() {
            return Err(HarnessError::Missing {
                what: format!("PKO's CRDs in {} (`make pko`)", bins.pko_crds.display()),
            });
        }
        Ok(bins)
    }

    /// The CRDs `peer` is deployed with.
    pub fn crds_dir(&self, peer: Peer) -> &Path {
        match peer {
            Peer::Pko => &self.pko_crds,
            Peer::PkoRs => &self.pko_rs_crds,
        }
    }
}

/// A running operator process (killed on drop).
pub struct RunningPeer {
    pub peer: Peer,
    guard: ChildGuard,
    pub fs_port: u16,
    pub probe_port: u16,
    /// Where `/metrics` is served (pko-rs: the probe port).
    pub metrics_port: u16,
    /// From spawn to the first 200 of `/readyz`.
    pub spawn_to_ready: Duration,
    /// When the process was spawned.
    pub spawned: Instant,
}

impl RunningPeer {
    pub fn pid(&self) -> u32 {
        self.guard.pid()
    }

    /// SIGTERM, then SIGKILL after `grace`.
    pub fn stop(&mut self, grace: Duration) {
        self.guard.terminate(grace);
    }

    pub fn log_tail(&self, lines: usize) -> String {
        self.guard.log_tail(lines)
    }

    /// `kill -9`: no shutdown code runs, the leader lease is not released.
    pub fn kill(&mut self) {
        let _ = self.guard.kill();
    }
}

/// Leader election settings, the same flags on both operators.
#[derive(Clone, Copy, Debug)]
pub struct LeaseSettings {
    pub lease_duration: Duration,
    pub renew_deadline: Duration,
    pub retry_period: Duration,
}

impl LeaseSettings {
    fn flags(&self) -> [String; 4] {
        let go = |d: Duration| format!("{}ms", d.as_millis());
        [
            "--leader-elect=true".into(),
            format!(
                "--leader-election-lease-duration={}",
                go(self.lease_duration)
            ),
            format!(
                "--leader-election-renew-deadline={}",
                go(self.renew_deadline)
            ),
            format!("--leader-election-retry-period={}", go(self.retry_period)),
        ]
    }

    /// The Lease `peer` holds while it leads, in `system_ns`.
    pub fn lease_name(peer: Peer) -> &'static str {
        match peer {
            Peer::Pko => "operator.pulumi.com",
            Peer::PkoRs => "pko-rs-operator",
        }
    }

    /// What the benchmarks' failovers give both operators: the usual Kubernetes client
    /// defaults (PKO's own are 60 s / 45 s / 10 s).
    pub const FAILOVER: LeaseSettings = LeaseSettings {
        lease_duration: Duration::from_secs(15),
        renew_deadline: Duration::from_secs(10),
        retry_period: Duration::from_secs(2),
    };
}

/// The holder of Lease `name`, once it has one other than `not` (polled every 20 ms: a
/// failover's time is read off it).
pub async fn lease_holder(
    leases: &kube::Api<k8s_openapi::api::coordination::v1::Lease>,
    name: &str,
    not: Option<&str>,
    timeout: Duration,
) -> Result<String, HarnessError> {
    let deadline = Instant::now() + timeout;
    loop {
        if let Ok(lease) = leases.get(name).await
            && let Some(holder) = lease.spec.and_then(|s| s.holder_identity)
            && !holder.is_empty()
            && Some(holder.as_str()) != not
        {
            return Ok(holder);
        }
        if Instant::now() > deadline {
            return Err(HarnessError::Timeout {
                what: format!("a (new) holder of Lease {name}"),
                timeout,
            });
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// How [`start_with`] starts an operator beyond [`start`]'s defaults.
#[derive(Clone, Debug, Default)]
pub struct PeerOptions {
    /// The file server's port; a free loopback port when `None`.
    pub fs_port: Option<u16>,
    /// The advertised file-server address (as behind a Service); the bound one when `None`.
    pub advertised: Option<String>,
    /// Leader election on, with these settings; off when `None`.
    pub lease: Option<LeaseSettings>,
    /// Names resolve with the [`ClusterDns`] (PKO's manager dials
    /// `<ws>-workspace.<ns>:50051`, served by a kubelet with the cluster network).
    pub cluster_dns: bool,
    /// PKO's manager lays its workspace pods out with this agent image (`AGENT_IMAGE`); its
    /// own image when `None`.
    pub agent_image: Option<String>,
    /// The kubeconfig the operator runs with; the plane's own when `None` (e.g. one
    /// impersonating a user of its own, so the apiserver's audit log tells its requests).
    pub kubeconfig: Option<PathBuf>,
    /// Log at `info` (what either operator logs by default in a deployment, and what a bench
    /// counting log lines reads) instead of warnings and errors only.
    pub info_log: bool,
    /// More arguments, after the ones both operators get.
    pub args: Vec<String>,
}

/// PKO's manager names no leader-election namespace, so controller-runtime reads it from the
/// in-cluster service-account file; outside a pod that file is provided in a private mount
/// namespace of the process (`cluster_dns::private_mounts`), holding `system_ns`.
/// Starts `peer` against `plane` watching every namespace, with its file server on `fs_port`
/// (a free loopback port when `None`) advertised as that address, leader election off,
/// logging warnings and errors only; `system_ns` stands for the operator's own namespace.
/// Waits for `/readyz`. A restart passes the port of the process before it, so the artifact
/// URLs stay the same, as behind a Service.
pub async fn start(
    peer: Peer,
    bins: &PeerBinaries,
    plane: &ControlPlane,
    system_ns: &str,
    log: &Path,
    fs_port: Option<u16>,
) -> Result<RunningPeer, HarnessError> {
    let opts = PeerOptions {
        fs_port,
        ..PeerOptions::default()
    };
    start_with(peer, bins, plane, system_ns, log, &opts).await
}

/// [`start`], with an advertised address and leader election when `opts` asks for them.
pub async fn start_with(
    peer: Peer,
    bins: &PeerBinaries,
    plane: &ControlPlane,
    system_ns: &str,
    log: &Path,
    opts: &PeerOptions,
) -> Result<RunningPeer, HarnessError> {
    let fs_port = match opts.fs_port {
        Some(port) => port,
        None => free_port()?,
    };
    let probe_port = free_port()?;
    let fs_addr = format!("127.0.0.1:{fs_port}");
    let advertised = opts.advertised.clone().unwrap_or_else(|| fs_addr.clone());
    let election: Vec<String> = match &opts.lease {
        Some(lease) => lease.flags().into(),
        None => vec!["--leader-elect=false".into()],
    };
    let mut metrics_port = probe_port;
    let mut cmd = match peer {
        Peer::PkoRs => {
            let mut cmd = Command::new(&bins.pko_rs);
            cmd.arg(format!("--program-fs-addr={fs_addr}"))
                .arg(format!("--program-fs-adv-addr={advertised}"))
                .arg(format!(
                    "--health-probe-bind-address=127.0.0.1:{probe_port}"
                ))
                // The URL-signing keys live in a Secret, as in a deployment, so a restarted
                // process keeps verifying (and does not re-sign) the URLs it published.
                .arg(format!("--artifact-keys-namespace={system_ns}"))
                .arg(format!("--leader-election-namespace={system_ns}"))
                .args(&election)
                .arg(if opts.info_log {
                    "--log-level=info"
                } else {
                    "--log-level=warn"
                });
            cmd
        }
        Peer::Pko => {
            metrics_port = free_port()?;
            let dns = if opts.cluster_dns {
                Some(ClusterDns::shared()?)
            } else {
                None
            };
            let mut cmd = if opts.lease.is_some() || dns.is_some() {
                let in_cluster = opts.lease.is_some().then_some(system_ns);
                private_mounts(&bins.pko_manager, dns, in_cluster)
            } else {
                Command::new(&bins.pko_manager)
            };
            cmd.arg(format!("--program-fs-addr={fs_addr}"))
                .arg(format!("--program-fs-adv-addr={advertised}"))
                .arg(format!(
                    "--health-probe-bind-address=127.0.0.1:{probe_port}"
                ))
                .arg(format!("--metrics-bind-address=127.0.0.1:{metrics_port}"))
                .arg("--metrics-secure=false")
                .args(&election)
                .arg(if opts.info_log {
                    "--zap-log-level=info"
                } else {
                    "--zap-log-level=error"
                })
                .env("POD_NAMESPACE", system_ns)
                .env("POD_SA_NAME", PKO_MANAGER_ACCOUNT);
            if let Some(image) = &opts.agent_image {
                cmd.env("AGENT_IMAGE", image);
            }
            cmd
        }
    };
    cmd.args(&opts.args);
    match &opts.kubeconfig {
        Some(path) => cmd.env("KUBECONFIG", path),
        None => cmd.env("KUBECONFIG", plane.kubeconfig_path()),
    };
    let spawned = Instant::now();
    let mut guard = spawn_guarded(cmd, peer.label(), log)?;
    let url = format!("http://127.0.0.1:{probe_port}/readyz");
    let client = reqwest::Client::builder()
        .timeout(Duration::from_secs(2))
        .build()
        .map_err(|e| HarnessError::io("building an HTTP client", std::io::Error::other(e)))?;
    let tail = |guard: &ChildGuard| {
        Box::new(LogTail {
            path: log.to_path_buf(),
            tail: guard.log_tail(40),
        })
    };
    loop {
        if let Ok(Some(status)) = guard.try_wait() {
            return Err(HarnessError::Exited {
                name: peer.label().into(),
                status: status.to_string(),
                log: tail(&guard),
            });
        }
        if let Ok(resp) = client.get(&url).send().await
            && resp.status().is_success()
        {
            break;
        }
        if spawned.elapsed() > READY_TIMEOUT {
            return Err(HarnessError::NotReady {
                name: peer.label().into(),
                endpoint: url,
                waited: READY_TIMEOUT,
                last: "no 200 from /readyz".into(),
                log: tail(&guard),
            });
        }
        tokio::time::sleep(READY_POLL).await;
    }
    Ok(RunningPeer {
        peer,
        spawn_to_ready: spawned.elapsed(),
        spawned,
        guard,
        fs_port,
        probe_port,
        metrics_port,
    })
}

/// User + system CPU time a process has used so far (all its threads), from
/// `/proc/<pid>/stat`; `None` once it is gone.
pub fn cpu_seconds(pid: u32) -> Option<f64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // Fields after the command name (which may hold spaces) start at field 3 (state);
    // utime and stime are fields 14 and 15.
    let rest = &stat[stat.rfind(')')? + 1..];
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let utime: u64 = fields.get(11)?.parse().ok()?;
    let stime: u64 = fields.get(12)?.parse().ok()?;
    Some((utime + stime) as f64 / clock_ticks())
}

fn clock_ticks() -> f64 {
    // SAFETY: sysconf reads a constant of the running system and has no preconditions.
    let ticks = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
    if ticks > 0 { ticks as f64 } else { 100.0 }
}

/// The pid of `name` (`kube-apiserver`, `etcd`) of a control plane, from its pid file.
pub fn plane_pid(plane: &ControlPlane, name: &str) -> Option<u32> {
    std::fs::read_to_string(plane.dir().join(format!("{name}.pid")))
        .ok()?
        .trim()
        .parse()
        .ok()
}

pub use crate::agent::free_port;

/// A minimal HTTP/1.1 keep-alive server: every request (headers only, as GETs send) gets
/// the same `200` with `body`. What the machine can serve at most, next to the file servers.
pub async fn serve_bare(listener: tokio::net::TcpListener, body: &[u8]) -> std::io::Result<()> {
    let mut response = format!(
        "HTTP/1.1 200 OK\r\ncontent-type: application/gzip\r\ncontent-length: {}\r\n\r\n",
        body.len()
    )
    .into_bytes();
    response.extend_from_slice(body);
    let response: Arc<[u8]> = response.into();
    loop {
        let (stream, _) = listener.accept().await?;
        let _ = stream.set_nodelay(true);
        let response = response.clone();
        tokio::spawn(async move {
            let _ = answer_bare(stream, &response).await;
        });
    }
}

async fn answer_bare(mut stream: tokio::net::TcpStream, response: &[u8]) -> std::io::Result<()> {
    const MAX_HEADER: usize = 64 * 1024;
    let mut pending = Vec::with_capacity(4096);
    let mut chunk = [0u8; 4096];
    loop {
        let n = stream.read(&mut chunk).await?;
        if n == 0 {
            return Ok(());
        }
        pending.extend_from_slice(&chunk[..n]);
        while let Some(end) = pending.windows(4).position(|w| w == b"\r\n\r\n") {
            pending.drain(..end + 4);
            stream.write_all(response).await?;
        }
        if pending.len() > MAX_HEADER {
            return Ok(());
        }
    }
}

/// The service account PKO's manager runs as (`POD_SA_NAME`); its tokens are what PKO's
/// manager sends to PKO's agents.
pub const PKO_MANAGER_ACCOUNT: &str = "controller-manager";

/// What PKO's install gives its manager beyond the admin access the harness runs it with: the
/// service account `controller-manager` in `system_ns`, whose tokens it mints (TokenRequest)
/// for every agent call, allowed to `use` `workspaces/rpc` (the rule of PKO's ClusterRole that
/// PKO's agent checks with a SubjectAccessReview).
pub async fn install_manager_identity(
    client: &kube::Client,
    system_ns: &str,
) -> Result<(), HarnessError> {
    crate::kubeauth::service_account(client, system_ns, PKO_MANAGER_ACCOUNT).await?;
    crate::kubeauth::grant_workspace_rpc_everywhere(client, system_ns, PKO_MANAGER_ACCOUNT).await
}
