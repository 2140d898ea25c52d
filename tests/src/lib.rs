//! Control-plane harness: a real etcd + kube-apiserver on loopback for integration tests,
//! benchmarks and `make run`.
//!
//! A real apiserver (instead of a mock) is used so that server-side apply, CRD validation,
//! CEL rules and watch semantics behave exactly as in a cluster. There is no kubelet and no
//! controller-manager: pods never run, namespaces are never finalized and there is no garbage
//! collection.
//!
//! Processes started here never outlive the test process (see [`spawn_guarded`]).
#![allow(
    unsafe_code,
    reason = "the harness signals and reaps the processes it starts; each block says why it holds"
)]
#![allow(
    clippy::disallowed_methods,
    reason = "a test process is configured by its environment (make sets the tool and fixture paths)"
)]

pub mod agent;
pub mod bench_baseline;
pub mod chaos;
pub mod cluster_dns;
pub mod command;
mod control_plane;
pub mod execution;
pub mod fifo;
pub mod fixtures;
pub mod flux;
pub mod githubapi;
pub mod gitrepo;
pub mod kstatus;
pub mod kubeauth;
pub mod kubelet;
pub mod measure;
pub mod netns;
pub mod node;
pub mod operator;
mod pki;
pub mod pko_peer;
pub mod plugin_bench;
pub mod plugins;
mod process;
pub mod prom;
pub mod promtool;
pub mod proto;
pub mod refusal;
pub mod registry;
pub mod serial;
pub mod sshgit;
pub mod vault;
pub mod webhook;

use std::future::Future;
use std::path::PathBuf;
use std::process::Command;
use std::time::Duration;

pub use control_plane::{ControlPlane, FIELD_MANAGER, InNode, NAMESPACE_LABEL, StartOptions};
pub use process::{ChildGuard, process_alive, spawn_guarded};

/// Everything that can go wrong while running the harness.
///
/// `Debug` prints the same text as `Display`, so `.expect()` in tests shows a readable
/// message with real line breaks in quoted logs.
#[derive(thiserror::Error)]
pub enum HarnessError {
    /// The prebuilt Go binaries (etcd, kube-apiserver, kubectl, …) are not there.
    #[error("{component} tools not found: {detail}; run `make tools` (or set {env_var})")]
    ToolsMissing {
        component: String,
        detail: String,
        env_var: String,
    },
    #[error("{what}: {source}")]
    Io {
        what: String,
        #[source]
        source: std::io::Error,
    },
    #[error("cannot start {name} ({program}): {source}")]
    Spawn {
        name: String,
        program: String,
        #[source]
        source: std::io::Error,
    },
    /// A child process ended while we were waiting for it to become ready.
    #[error("{name} exited with {status} before it was ready; {log}")]
    Exited {
        name: String,
        status: String,
        log: Box<LogTail>,
    },
    /// A child process did not become ready in time.
    #[error("{name} was not ready at {endpoint} after {waited:?} ({last}); {log}")]
    NotReady {
        name: String,
        endpoint: String,
        waited: Duration,
        last: String,
        log: Box<LogTail>,
    },
    /// [`wait_for`] gave up.
    #[error("timed out after {timeout:?} waiting for {what}")]
    Timeout { what: String, timeout: Duration },
    #[error("{context}: {}", kube_summary(source))]
    Kube {
        context: String,
        #[source]
        source: kube::Error,
    },
    #[error("kubeconfig {path}: {source}")]
    Kubeconfig {
        path: PathBuf,
        #[source]
        source: kube::config::KubeconfigError,
    },
    #[error("generating certificates: {0}")]
    Pki(#[from] rcgen::Error),
    /// Something a test needs (a binary, a file) is not there; `what` says what and how to
    /// get it.
    #[error("missing {what}")]
    Missing { what: String },
    #[error("CRD manifest {path}: {message}")]
    Manifest { path: PathBuf, message: String },
    /// The one shared control plane of this test binary failed to start; every later call
    /// reports the same first failure instead of trying again.
    #[error("the shared control plane failed to start: {0}")]
    Shared(String),
}

impl std::fmt::Debug for HarnessError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        std::fmt::Display::fmt(self, f)
    }
}

/// An API error as `<code> <reason>: <message>`; kube's own text repeats the whole status.
fn kube_summary(e: &kube::Error) -> String {
    match e {
        kube::Error::Api(status) => {
            format!("{} {}: {}", status.code, status.reason, status.message)
        }
        other => other.to_string(),
    }
}

/// The end of a process log, quoted in errors so a failed start explains itself.
#[derive(Debug, Clone)]
pub struct LogTail {
    pub path: PathBuf,
    pub tail: String,
}

impl std::fmt::Display for LogTail {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "log {}:\n{}", self.path.display(), self.tail)
    }
}

impl HarnessError {
    pub(crate) fn io(what: impl Into<String>, source: std::io::Error) -> Self {
        HarnessError::Io {
            what: what.into(),
            source,
        }
    }

    pub(crate) fn kube(context: impl Into<String>, source: kube::Error) -> Self {
        HarnessError::Kube {
            context: context.into(),
            source,
        }
    }
}

/// Installs ring as the process-wide rustls provider unless one is set. rustls refuses to
/// pick one itself when more than one is compiled in (feature unification across the
/// workspace can add aws-lc-rs), and kube clients would then panic.
pub(crate) fn ensure_crypto_provider() {
    let _ = rustls::crypto::ring::default_provider().install_default();
}

/// The workspace root (the folder holding the top `Cargo.toml`, `deploy/`, `tools/`).
pub fn repo_root() -> PathBuf {
    let manifest = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    match manifest.parent() {
        Some(parent) => parent.to_path_buf(),
        None => manifest,
    }
}

/// The folder holding the prebuilt binaries of `component` (`kube`, `opa`, `pulumi`).
///
/// `PKO_TOOLS_<COMPONENT>_DIR` overrides it (for CI caches or hand-built binaries); otherwise
/// `tools/build.sh dir <component>` names it, so the folder always matches the pinned versions.
pub fn tool_dir(component: &str) -> Result<PathBuf, HarnessError> {
    let env_var = format!(
        "PKO_TOOLS_{}_DIR",
        component.to_ascii_uppercase().replace('-', "_")
    );
    let missing = |detail: String| HarnessError::ToolsMissing {
        component: component.to_string(),
        detail,
        env_var: env_var.clone(),
    };
    let dir = match std::env::var_os(&env_var).filter(|v| !v.is_empty()) {
        Some(dir) => PathBuf::from(dir),
        None => {
            let script = repo_root().join("tools/build.sh");
            let out = Command::new("bash")
                .arg(&script)
                .args(["dir", component])
                .output()
                .map_err(|e| missing(format!("cannot run {}: {e}", script.display())))?;
            if !out.status.success() {
                return Err(missing(format!(
                    "`{} dir {component}` failed ({}): {}",
                    script.display(),
                    out.status,
                    String::from_utf8_lossy(&out.stderr).trim()
                )));
            }
            PathBuf::from(String::from_utf8_lossy(&out.stdout).trim())
        }
    };
    if !dir.is_dir() {
        return Err(missing(format!("{} does not exist", dir.display())));
    }
    Ok(dir)
}

/// Polls `f` until it returns `Some`, backing off from 20 ms to 500 ms between calls.
///
/// A call of `f` that is still pending at the deadline is abandoned, so a hung request cannot
/// stretch the timeout. The error names `what`, so a failing test says what it was waiting for.
pub async fn wait_for<T, F, Fut>(what: &str, timeout: Duration, mut f: F) -> Result<T, HarnessError>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Option<T>>,
{
    let timed_out = || HarnessError::Timeout {
        what: what.to_string(),
        timeout,
    };
    let deadline = tokio::time::Instant::now() + timeout;
    let mut delay = Duration::from_millis(20);
    loop {
        match tokio::time::timeout_at(deadline, f()).await {
            Ok(Some(value)) => return Ok(value),
            Ok(None) => {}
            Err(_) => return Err(timed_out()),
        }
        let now = tokio::time::Instant::now();
        if now >= deadline {
            return Err(timed_out());
        }
        tokio::time::sleep(delay.min(deadline - now)).await;
        delay = (delay * 2).min(Duration::from_millis(500));
    }
}
