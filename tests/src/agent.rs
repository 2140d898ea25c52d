//! The workspace agent as a local process, with the real `pulumi` CLI and an offline `file://`
//! backend; plus a tiny static HTTP server for artifacts.

use std::collections::HashMap;
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;
use std::time::Duration;

use pko_agent::client::{AgentClient, Target, connect};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use crate::{ChildGuard, HarnessError, spawn_guarded, tool_dir};

/// Environment variable marking every process started for one agent or pod (inherited by
/// pulumi and its plugins), so the whole process tree can be killed the way a container runtime
/// kills a container's cgroup, orphans included.
pub const POD_MARKER: &str = "PKO_TESTS_POD";

/// SIGKILLs every process whose environment holds `PKO_TESTS_POD=<marker>`.
pub fn kill_marked(marker: &str) {
    let needle = format!("{POD_MARKER}={marker}");
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return;
    };
    for entry in entries.flatten() {
        let Some(pid) = entry
            .file_name()
            .to_str()
            .and_then(|p| p.parse::<i32>().ok())
        else {
            continue;
        };
        let Ok(environ) = std::fs::read(entry.path().join("environ")) else {
            continue;
        };
        if environ.split(|b| *b == 0).any(|v| v == needle.as_bytes()) {
            // SAFETY: plain system call on a process this harness started (it carries the
            // marker only because the harness put it in the environment).
            unsafe { libc::kill(pid, libc::SIGKILL) };
        }
    }
}

/// Names the agent binary to run; `make test` sets it to the static (musl) build, the one the
/// image ships.
pub const AGENT_BINARY_ENV: &str = "PKO_AGENT_BINARY";

/// The `pko-agent` binary: `$PKO_AGENT_BINARY`, else the one from the same target folder as the
/// running test.
pub fn agent_binary() -> Result<PathBuf, HarnessError> {
    match std::env::var_os(AGENT_BINARY_ENV) {
        Some(path) => {
            let path = PathBuf::from(path);
            if path.is_file() {
                Ok(path)
            } else {
                Err(HarnessError::Missing {
                    what: format!(
                        "{} (named by {AGENT_BINARY_ENV}); run `make agent-static`",
                        path.display()
                    ),
                })
            }
        }
        None => sibling_binary("pko-agent"),
    }
}

/// Whether the ELF file at `path` asks for a dynamic loader (a `PT_INTERP` program header).
pub fn needs_dynamic_loader(path: &Path) -> Result<bool, HarnessError> {
    let bytes = std::fs::read(path)
        .map_err(|e| HarnessError::io(format!("reading {}", path.display()), e))?;
    let bad = || HarnessError::Missing {
        what: format!("an ELF64 little-endian file at {}", path.display()),
    };
    if bytes.len() < 64 || &bytes[..4] != b"\x7fELF" || bytes[4] != 2 || bytes[5] != 1 {
        return Err(bad());
    }
    let u16_at = |o: usize| u16::from_le_bytes([bytes[o], bytes[o + 1]]) as usize;
    let mut off = [0u8; 8];
    off.copy_from_slice(&bytes[0x20..0x28]);
    let phoff = u64::from_le_bytes(off) as usize;
    let (entry_size, count) = (u16_at(0x36), u16_at(0x38));
    const PT_INTERP: u32 = 3;
    for i in 0..count {
        let at = phoff + i * entry_size;
        let header = bytes.get(at..at + 4).ok_or_else(bad)?;
        if u32::from_le_bytes([header[0], header[1], header[2], header[3]]) == PT_INTERP {
            return Ok(true);
        }
    }
    Ok(false)
}

pub(crate) fn sibling_binary(name: &str) -> Result<PathBuf, HarnessError> {
    let exe =
        std::env::current_exe().map_err(|e| HarnessError::io("locating the test binary", e))?;
    let candidates: Vec<PathBuf> = exe
        .ancestors()
        .skip(1)
        .take(3)
        .map(|d| d.join(name))
        .collect();
    candidates
        .iter()
        .find(|p| p.is_file())
        .cloned()
        .ok_or_else(|| HarnessError::Missing {
            what: format!(
                "{name} binary (looked in {candidates:?}); run `cargo build --workspace`"
            ),
        })
}

/// Environment for running Pulumi offline: its own `PULUMI_HOME`, a `file://` backend, a fixed
/// passphrase, no update checks and no plugin downloads; the CLI and YAML host on `PATH`.
pub fn pulumi_env(state: &Path) -> Result<Vec<(String, String)>, HarnessError> {
    let bin = tool_dir("pulumi")?;
    let home = state.join("pulumi-home");
    let backend = state.join("backend");
    for dir in [&home, &backend] {
        std::fs::create_dir_all(dir)
            .map_err(|e| HarnessError::io(format!("creating {}", dir.display()), e))?;
    }
    let path = format!(
        "{}:{}",
        bin.display(),
        std::env::var("PATH").unwrap_or_else(|_| "/usr/bin:/bin".into())
    );
    Ok(vec![
        ("PATH".into(), path),
        ("PULUMI_HOME".into(), home.display().to_string()),
        (
            "PULUMI_BACKEND_URL".into(),
            format!("file://{}", backend.display()),
        ),
        ("PULUMI_CONFIG_PASSPHRASE".into(), "pko-tests".into()),
        ("PULUMI_SKIP_UPDATE_CHECK".into(), "true".into()),
        (
            "PULUMI_DISABLE_AUTOMATIC_PLUGIN_ACQUISITION".into(),
            "true".into(),
        ),
    ])
}

/// A self-signed certificate and key (PEM) valid for `names`.
pub fn self_signed(names: &[&str]) -> Result<(String, String), HarnessError> {
    let names: Vec<String> = names.iter().map(|s| (*s).to_owned()).collect();
    let cert = rcgen::generate_simple_self_signed(names)?;
    Ok((cert.cert.pem(), cert.signing_key.serialize_pem()))
}

/// Options of [`AgentProcess::start`].
#[derive(Clone, Debug)]
pub struct AgentOptions {
    /// Project folder (holding Pulumi.yaml).
    pub workspace: PathBuf,
    /// State folder (pulumi home, backend, certificates, log).
    pub state: PathBuf,
    /// Serve TLS with a fresh self-signed certificate.
    pub tls: bool,
    /// Require this bearer token (`None`: `--auth-mode none`).
    pub token: Option<String>,
}

/// A running `pko-agent serve`, killed on drop.
pub struct AgentProcess {
    pub guard: ChildGuard,
    marker: String,
    pub port: u16,
    pub token: Option<String>,
    pub cert_pem: Option<String>,
    pub log: PathBuf,
}

/// Name the test certificates are issued for (checked by the client, sent as SNI).
pub const TEST_SERVER_NAME: &str = "agent.pko-tests.invalid";

impl AgentProcess {
    pub async fn start(opts: AgentOptions) -> Result<Self, HarnessError> {
        Self::start_with_args(opts, &[]).await
    }

    /// [`AgentProcess::start`] with more `serve` arguments (limits, for instance).
    pub async fn start_with_args(
        opts: AgentOptions,
        extra: &[String],
    ) -> Result<Self, HarnessError> {
        let port = free_port()?;
        let mut cmd = Command::new(agent_binary()?);
        cmd.arg("serve")
            .arg("--workspace")
            .arg(&opts.workspace)
            .args([
                "--host",
                "127.0.0.1",
                "--port",
                &port.to_string(),
                "--skip-install",
            ])
            // The most the agent logs: a secret must not show even here.
            .arg("--log-level=info,pko_agent=trace,pulumi=trace")
            .args(["--cancel-grace-seconds", "20"])
            .args(extra)
            .envs(pulumi_env(&opts.state)?)
            .env(POD_MARKER, opts.state.display().to_string());
        let mut cert_pem = None;
        if opts.tls {
            let (cert, key) = self_signed(&[TEST_SERVER_NAME])?;
            let cert_path = opts.state.join("tls.crt");
            let key_path = opts.state.join("tls.key");
            std::fs::write(&cert_path, &cert)
                .map_err(|e| HarnessError::io("writing tls.crt", e))?;
            std::fs::write(&key_path, &key).map_err(|e| HarnessError::io("writing tls.key", e))?;
            cmd.arg("--tls-cert-file")
                .arg(&cert_path)
                .arg("--tls-key-file")
                .arg(&key_path);
            cert_pem = Some(cert);
        }
        match &opts.token {
            Some(token) => {
                let path = opts.state.join("token");
                std::fs::write(&path, token).map_err(|e| HarnessError::io("writing token", e))?;
                cmd.arg("--auth-token-file").arg(&path);
            }
            None => {
                cmd.args(["--auth-mode", "none"]);
            }
        }
        let log = opts.state.join(format!("agent-{port}.log"));
        let mut guard = spawn_guarded(cmd, "pko-agent", &log)?;
        let deadline = std::time::Instant::now() + Duration::from_secs(30);
        loop {
            if let Ok(Some(status)) = guard.try_wait() {
                return Err(HarnessError::Exited {
                    name: "pko-agent".into(),
                    status: status.to_string(),
                    log: Box::new(crate::LogTail {
                        path: log.clone(),
                        tail: guard.log_tail(40),
                    }),
                });
            }
            if tokio::net::TcpStream::connect(("127.0.0.1", port))
                .await
                .is_ok()
            {
                break;
            }
            if std::time::Instant::now() > deadline {
                return Err(HarnessError::NotReady {
                    name: "pko-agent".into(),
                    endpoint: format!("127.0.0.1:{port}"),
                    waited: Duration::from_secs(30),
                    last: "port closed".into(),
                    log: Box::new(crate::LogTail {
                        path: log.clone(),
                        tail: guard.log_tail(40),
                    }),
                });
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        Ok(Self {
            guard,
            marker: opts.state.display().to_string(),
            port,
            token: opts.token,
            cert_pem,
            log,
        })
    }

    /// How to reach this agent with its own credentials.
    pub fn target(&self) -> Target {
        Target {
            address: format!("127.0.0.1:{}", self.port),
            ca_pem: self.cert_pem.as_ref().map(|c| c.as_bytes().to_vec()),
            server_name: self.cert_pem.as_ref().map(|_| TEST_SERVER_NAME.to_owned()),
            token: self.token.clone(),
            connect_timeout: Duration::from_secs(5),
        }
    }

    pub async fn client(&self) -> Result<AgentClient, HarnessError> {
        connect(&self.target())
            .await
            .map_err(|e| HarnessError::Missing {
                what: format!("a connection to the agent: {e}"),
            })
    }

    pub fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }
}

impl Drop for AgentProcess {
    fn drop(&mut self) {
        self.guard.kill();
        kill_marked(&self.marker);
    }
}

/// A loopback port nothing listens on, below the kernel's ephemeral range. A port from that
/// range (what binding port 0 gives) can be taken as the source port of any outgoing
/// connection between this probe and the server binding it, and tests that open hundreds of
/// connections lose that race now and then (the server then exits: address in use). Ports
/// come from a per-process sequence starting at a random offset, so two picks of one test
/// process never repeat, and each is checked free by binding it.
pub fn free_port() -> Result<u16, HarnessError> {
    use std::sync::OnceLock;
    use std::sync::atomic::{AtomicU32, Ordering};
    const LOW: u32 = 10_000;
    static NEXT: OnceLock<AtomicU32> = OnceLock::new();
    let high = ephemeral_low().clamp(LOW + 1_000, u32::from(u16::MAX));
    let span = high - LOW;
    let next = NEXT.get_or_init(|| AtomicU32::new(rand::random_range(0..span)));
    let mut last = None;
    for _ in 0..span {
        let offset = next.fetch_add(1, Ordering::Relaxed) % span;
        let Ok(port) = u16::try_from(LOW + offset) else {
            continue;
        };
        match TcpListener::bind(("127.0.0.1", port)) {
            Ok(_) => return Ok(port),
            Err(e) => last = Some(e),
        }
    }
    Err(HarnessError::io(
        "finding a free loopback port below the ephemeral range",
        last.unwrap_or_else(|| std::io::Error::other("no port left")),
    ))
}

/// The first port of the kernel's ephemeral range (Linux's default when unreadable).
fn ephemeral_low() -> u32 {
    std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|text| text.split_whitespace().next()?.parse().ok())
        .unwrap_or(32_768)
}

/// Serves fixed bodies over HTTP/1.1 on loopback (GET only; 404 otherwise). Stops on drop.
pub struct StaticServer {
    pub port: u16,
    task: tokio::task::JoinHandle<()>,
}

impl StaticServer {
    pub async fn start(routes: HashMap<String, Vec<u8>>) -> Result<Self, HarnessError> {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .map_err(|e| HarnessError::io("binding the static server", e))?;
        let port = listener
            .local_addr()
            .map_err(|e| HarnessError::io("static server address", e))?
            .port();
        let routes = Arc::new(routes);
        let task = tokio::spawn(async move {
            while let Ok((mut sock, _)) = listener.accept().await {
                let routes = routes.clone();
                tokio::spawn(async move {
                    let mut buf = Vec::new();
                    let mut chunk = [0u8; 1024];
                    while !buf.windows(4).any(|w| w == b"\r\n\r\n") && buf.len() < 16 * 1024 {
                        match sock.read(&mut chunk).await {
                            Ok(0) | Err(_) => return,
                            Ok(n) => buf.extend_from_slice(&chunk[..n]),
                        }
                    }
                    let head = String::from_utf8_lossy(&buf);
                    let path = head.split_whitespace().nth(1).unwrap_or("/").to_owned();
                    let (status, body) = match routes.get(&path) {
                        Some(body) => ("200 OK", body.clone()),
                        None => ("404 Not Found", b"not found".to_vec()),
                    };
                    let header = format!(
                        "HTTP/1.1 {status}\r\nContent-Length: {}\r\nContent-Type: application/gzip\r\nConnection: close\r\n\r\n",
                        body.len()
                    );
                    let _ = sock.write_all(header.as_bytes()).await;
                    let _ = sock.write_all(&body).await;
                    let _ = sock.shutdown().await;
                });
            }
        });
        Ok(Self { port, task })
    }

    pub fn url(&self, path: &str) -> String {
        format!("http://127.0.0.1:{}{path}", self.port)
    }
}

impl Drop for StaticServer {
    fn drop(&mut self) {
        self.task.abort();
    }
}
