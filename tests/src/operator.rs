//! Runs the real `pko-operator` binary as a process against a control plane.

use std::net::TcpListener;
use std::path::PathBuf;
use std::process::Command;
use std::time::Duration;

use crate::cluster_dns::{ClusterDns, private_mounts};
use crate::{ChildGuard, ControlPlane, HarnessError, spawn_guarded};

/// Options of one operator process.
#[derive(Clone, Debug, Default)]
pub struct OperatorOptions {
    /// `--program-fs-adv-addr`; default: the bound loopback address.
    pub advertised: Option<String>,
    /// Extra arguments.
    pub args: Vec<String>,
}

/// A running operator process, killed on drop.
pub struct Operator {
    guard: Option<ChildGuard>,
    pub fs_port: u16,
    pub probe_port: u16,
    pub log: PathBuf,
}

impl Operator {
    /// Start the operator against `plane` and wait until `/readyz` answers 200.
    ///
    /// Its ports are picked free, then bound by the operator: in between, another process
    /// (a parallel test's operator, agent or client socket) may take one. Such a start is
    /// tried again on new ports; any other exit fails at once.
    pub async fn start(plane: &ControlPlane, opts: OperatorOptions) -> Result<Self, HarnessError> {
        Self::start_with_env(plane, opts, &[]).await
    }

    /// [`Self::start`] with `env` (name, value) added to the process's environment (e.g. a
    /// proxy the operator must ignore).
    pub async fn start_with_env(
        plane: &ControlPlane,
        opts: OperatorOptions,
        env: &[(&str, &str)],
    ) -> Result<Self, HarnessError> {
        Self::start_retrying(plane, &opts, env, None).await
    }

    /// [`Self::start`] resolving names with the [`ClusterDns`], so the operator reaches agents
    /// at `<ws>-workspace.<ns>:50051` as in a cluster (pods of a kubelet with
    /// [`crate::kubelet::PodNetwork::Cluster`]; no `--workspace-localhost`).
    pub async fn start_with_cluster_dns(
        plane: &ControlPlane,
        opts: OperatorOptions,
    ) -> Result<Self, HarnessError> {
        let dns = ClusterDns::shared()?;
        Self::start_retrying(plane, &opts, &[], Some(dns)).await
    }

    async fn start_retrying(
        plane: &ControlPlane,
        opts: &OperatorOptions,
        env: &[(&str, &str)],
        dns: Option<&ClusterDns>,
    ) -> Result<Self, HarnessError> {
        let mut attempt = 1;
        loop {
            match Self::start_once(plane, opts, env, dns).await {
                Err(HarnessError::Exited { log, .. })
                    if attempt < PORT_ATTEMPTS && lost_a_port(&log.path) =>
                {
                    attempt += 1;
                }
                other => return other,
            }
        }
    }

    async fn start_once(
        plane: &ControlPlane,
        opts: &OperatorOptions,
        env: &[(&str, &str)],
        dns: Option<&ClusterDns>,
    ) -> Result<Self, HarnessError> {
        let fs_port = free_port()?;
        let probe_port = free_port()?;
        let mut cmd = match dns {
            Some(dns) => private_mounts(&operator_binary()?, Some(dns), None),
            None => Command::new(operator_binary()?),
        };
        cmd.envs(env.iter().copied());
        // A test may run the operator with a kubeconfig of its own (e.g. impersonating a
        // service account); otherwise the plane's admin one.
        if !opts.args.iter().any(|a| a.starts_with("--kubeconfig")) {
            cmd.arg("--kubeconfig").arg(plane.kubeconfig_path());
        }
        cmd.arg(format!("--program-fs-addr=127.0.0.1:{fs_port}"))
            .arg(format!(
                "--health-probe-bind-address=127.0.0.1:{probe_port}"
            ))
            // The error an operator exits with is the first thing its log should show, not
            // a backtrace of where it was built (panics still print theirs).
            .env("RUST_LIB_BACKTRACE", "0")
            .args(&opts.args);
        if !opts.args.iter().any(|a| a.starts_with("--log-level")) {
            cmd.arg("--log-level=info,pko_operator=debug");
        }
        // Every operator of a control plane shares one key Secret, so any replica verifies the
        // artifact URLs any other one signed (as replicas of one install do).
        if !opts
            .args
            .iter()
            .any(|a| a.starts_with("--artifact-keys-namespace"))
        {
            cmd.arg("--artifact-keys-namespace=default");
        }
        // Test servers (git, https modules) listen on loopback, which the operator refuses for
        // tenants' URLs by default. A test that passes any `--egress-` flag of its own gets
        // the production rules (loopback refused).
        if !opts.args.iter().any(|a| a.starts_with("--egress-")) {
            cmd.arg("--egress-allow-loopback");
        }
        // Every client of a test connects from 127.0.0.1, where a cluster has one address per
        // workspace pod: the per-client cap would count a whole fleet as one client. A test
        // that sets the cap (the listener chaos run) gets its own.
        if !opts
            .args
            .iter()
            .any(|a| a.starts_with("--listener-max-connections-per-client"))
        {
            cmd.arg("--listener-max-connections-per-client=100000");
        }
        if let Some(adv) = &opts.advertised {
            cmd.arg(format!("--program-fs-adv-addr={adv}"));
        }
        let log = plane.dir().join(format!(
            "operator-{fs_port}-{}-{}.log",
            std::process::id(),
            STARTS.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
        ));
        let mut guard = spawn_guarded(cmd, "pko-operator", &log)?;
        let url = format!("http://127.0.0.1:{probe_port}/readyz");
        let deadline = std::time::Instant::now() + Duration::from_secs(60);
        loop {
            // An operator that exits (bad flag, panic) fails the start at once, with its log.
            if let Ok(Some(status)) = guard.try_wait() {
                return Err(HarnessError::Exited {
                    name: "pko-operator".into(),
                    status: status.to_string(),
                    log: Box::new(crate::LogTail {
                        path: log.clone(),
                        tail: guard.log_tail(40),
                    }),
                });
            }
            if let Ok(resp) = reqwest::get(&url).await
                && resp.status().is_success()
            {
                break;
            }
            if std::time::Instant::now() > deadline {
                return Err(HarnessError::NotReady {
                    name: "pko-operator".into(),
                    endpoint: url,
                    waited: Duration::from_secs(60),
                    last: "no 200 from /readyz".into(),
                    log: Box::new(crate::LogTail {
                        path: log.clone(),
                        tail: guard.log_tail(40),
                    }),
                });
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        Ok(Self {
            guard: Some(guard),
            fs_port,
            probe_port,
            log,
        })
    }

    /// `http://127.0.0.1:<fs port><path>`.
    pub fn fs_url(&self, path: &str) -> String {
        format!("http://127.0.0.1:{}{path}", self.fs_port)
    }

    /// `url` (an artifact URL from a Program's status) with this operator's file server as its
    /// host: same path, same token.
    pub fn fs_url_of(&self, url: &str) -> String {
        let path = url.find("/programs/").map(|at| &url[at..]).unwrap_or(url);
        self.fs_url(path)
    }

    /// `http://127.0.0.1:<probe port><path>`.
    pub fn probe_url(&self, path: &str) -> String {
        format!("http://127.0.0.1:{}{path}", self.probe_port)
    }

    /// The operator's log so far (for assertion messages).
    pub fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// Resident memory of the process, in KiB (VmRSS).
    pub fn rss_kib(&self) -> Option<u64> {
        crate::measure::proc_status_kib(self.pid()?, "VmRSS")
    }

    /// Peak resident memory of the process so far, in KiB (VmHWM).
    pub fn peak_rss_kib(&self) -> Option<u64> {
        crate::measure::peak_rss_kib(self.pid()?)
    }

    /// The exit status if the process has ended on its own (crash, panic, OOM), `None` while
    /// it runs.
    pub fn exited(&mut self) -> Option<std::process::ExitStatus> {
        self.guard.as_mut()?.try_wait().ok().flatten()
    }

    /// Stop the process now.
    pub fn stop(&mut self) {
        self.guard.take();
    }

    /// The process id while the process runs under this guard.
    pub fn pid(&self) -> Option<u32> {
        self.guard.as_ref().map(ChildGuard::pid)
    }

    /// `kill -9`: no shutdown code runs (the leader lease is not released).
    pub fn kill(&mut self) -> Option<std::process::ExitStatus> {
        self.guard.as_mut()?.kill()
    }

    /// SIGTERM, then up to `grace` for a clean exit before SIGKILL; returns the exit status.
    pub fn terminate(&mut self, grace: Duration) -> Option<std::process::ExitStatus> {
        self.guard.as_mut()?.terminate(grace)
    }

    /// The text of `/metrics`, or `None` if the process does not answer.
    pub async fn metrics_text(&self) -> Option<String> {
        let resp = reqwest::get(self.probe_url("/metrics")).await.ok()?;
        if !resp.status().is_success() {
            return None;
        }
        resp.text().await.ok()
    }

    /// The value of the sample `series` (name plus labels exactly as exposed, e.g.
    /// `stacks_failing{namespace="a",name="b"}`) in `/metrics`.
    pub async fn metric(&self, series: &str) -> Option<f64> {
        metric_value(&self.metrics_text().await?, series)
    }
}

/// The value of the sample `series` in a Prometheus/OpenMetrics text exposition.
pub fn metric_value(text: &str, series: &str) -> Option<f64> {
    text.lines()
        .filter(|line| !line.starts_with('#'))
        .find_map(|line| {
            let (name, value) = line.rsplit_once(' ')?;
            (name == series).then(|| value.parse().ok()).flatten()
        })
}

/// The `pko-operator` binary from the same target folder as the running test.
pub fn operator_binary() -> Result<PathBuf, HarnessError> {
    let exe = std::env::current_exe().map_err(|e| HarnessError::Io {
        what: "locating the test binary".into(),
        source: e,
    })?;
    // target/<profile>/deps/<test> → target/<profile>/pko-operator
    let candidates = exe
        .ancestors()
        .skip(1)
        .take(3)
        .map(|dir| dir.join("pko-operator"))
        .collect::<Vec<_>>();
    candidates
        .iter()
        .find(|p| p.is_file())
        .cloned()
        .ok_or_else(|| HarnessError::Missing {
            what: format!(
                "pko-operator binary (looked in {:?}); run `cargo build --workspace`",
                candidates
            ),
        })
}

/// Numbers each start, so two starts (of two tests that drew one port) never share a log.
static STARTS: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);

/// Starts tried before a port clash fails the test; each clash needs a race lost again.
const PORT_ATTEMPTS: u32 = 5;

/// Whether the operator logged at `log` exited because one of its addresses was taken.
fn lost_a_port(log: &std::path::Path) -> bool {
    std::fs::read_to_string(log)
        .map(|text| text.contains("Address already in use"))
        .unwrap_or(false)
}

fn free_port() -> Result<u16, HarnessError> {
    let listener = TcpListener::bind("127.0.0.1:0").map_err(|e| HarnessError::Io {
        what: "finding a free port".into(),
        source: e,
    })?;
    listener
        .local_addr()
        .map(|a| a.port())
        .map_err(|e| HarnessError::Io {
            what: "finding a free port".into(),
            source: e,
        })
}
