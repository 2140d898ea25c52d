//! A private network, mount and pid namespace for a test node, and TCP forwards between it and
//! the host's loopback.
//!
//! The namespaces are held by one process (`unshare … sleep infinity`, pid 1 of the new pid
//! namespace). Every process of the node enters them with `nsenter`. When the holder dies (the
//! guard drops, or the test process dies and the kernel's death signal kills it) the kernel
//! kills every process left in the pid namespace, containerd's shims and the containers
//! included, and the network and mount namespaces go with the last of them: nothing of a node
//! outlives its test, and nothing of it is ever seen on the host's network.
//!
//! Forwards carry TCP between the host's loopback and the namespace: a listening socket is
//! bound in one namespace, the outgoing connections are made in the other, by a thread that
//! entered it (`setns` moves only the calling thread).

use std::ffi::OsStr;
use std::fs::File;
use std::net::{SocketAddr, TcpListener};
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use crate::process::{ChildGuard, spawn_guarded};
use crate::{HarnessError, wait_for};

/// How long the holder may take to make its namespaces.
const HOLDER_WAIT: Duration = Duration::from_secs(10);

/// The namespaces of one node; dropped, every process in them is killed.
pub struct Netns {
    holder: std::sync::Mutex<ChildGuard>,
    /// The holder's pid (pid 1 inside), as the host sees it.
    pid: u32,
}

impl std::fmt::Debug for Netns {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Netns").field("pid", &self.pid).finish()
    }
}

impl Netns {
    /// New network, mount (private propagation) and pid namespaces, with loopback up.
    pub async fn create(log_dir: &Path) -> Result<Self, HarnessError> {
        let mut cmd = Command::new("unshare");
        cmd.args([
            "--net",
            "--mount",
            "--propagation=private",
            "--pid",
            "--fork",
            "--kill-child",
            "--mount-proc",
            "sleep",
            "infinity",
        ]);
        let holder = spawn_guarded(cmd, "namespace holder", &log_dir.join("netns.log"))?;
        let parent = holder.pid();
        // `unshare --fork` runs `sleep` as its child: pid 1 of the new pid namespace.
        let pid = wait_for("the node's namespaces", HOLDER_WAIT, || async move {
            let children =
                std::fs::read_to_string(format!("/proc/{parent}/task/{parent}/children")).ok()?;
            let child: u32 = children.split_whitespace().next()?.parse().ok()?;
            let ours = std::fs::read_link(format!("/proc/{child}/ns/net")).ok()?;
            let host = std::fs::read_link("/proc/self/ns/net").ok()?;
            (ours != host).then_some(child)
        })
        .await?;
        let ns = Self {
            holder: std::sync::Mutex::new(holder),
            pid,
        };
        ns.run(["ip", "link", "set", "lo", "up"])?;
        Ok(ns)
    }

    /// The holder's pid as the host sees it.
    pub fn pid(&self) -> u32 {
        self.pid
    }

    /// The network namespace's file, for `setns`.
    pub fn net_path(&self) -> PathBuf {
        PathBuf::from(format!("/proc/{}/ns/net", self.pid))
    }

    /// `program` run inside the namespaces (nsenter forks it into the pid namespace).
    pub fn command(&self, program: impl AsRef<OsStr>) -> Command {
        let mut cmd = Command::new("nsenter");
        cmd.arg(format!("--target={}", self.pid))
            .args(["--net", "--mount", "--pid", "--"])
            .arg(program);
        cmd
    }

    /// Runs a short command inside the namespaces; its output, or an error with it.
    pub fn run<I, S>(&self, args: I) -> Result<String, HarnessError>
    where
        I: IntoIterator<Item = S>,
        S: AsRef<OsStr>,
    {
        let mut args = args.into_iter();
        let Some(program) = args.next() else {
            return Ok(String::new());
        };
        let mut cmd = self.command(program);
        cmd.args(args);
        let shown = format!("{cmd:?}");
        let out = cmd
            .output()
            .map_err(|e| HarnessError::io(format!("running {shown}"), e))?;
        if !out.status.success() {
            return Err(HarnessError::Missing {
                what: format!(
                    "a successful {shown} ({}): {}{}",
                    out.status,
                    String::from_utf8_lossy(&out.stdout),
                    String::from_utf8_lossy(&out.stderr)
                ),
            });
        }
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    }

    /// Host `127.0.0.1:host_port` → `target` inside the namespace.
    pub fn forward_in(&self, host_port: u16, target: SocketAddr) -> Result<Forward, HarnessError> {
        let listener = TcpListener::bind(("127.0.0.1", host_port))
            .map_err(|e| HarnessError::io(format!("binding 127.0.0.1:{host_port}"), e))?;
        Forward::start(listener, target, Some(self.net_path()))
    }

    /// `listen` inside the namespace → `target` on the host.
    pub fn forward_out(
        &self,
        listen: SocketAddr,
        target: SocketAddr,
    ) -> Result<Forward, HarnessError> {
        let listener = bind_in(&self.net_path(), listen)?;
        Forward::start(listener, target, None)
    }
}

impl Netns {
    /// Kills the holder, so the kernel kills every process in the namespaces, and waits (at
    /// most 10 s, a cleanup) until its pid 1 is gone. Idempotent.
    pub fn stop(&self) {
        self.holder
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .kill();
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while crate::process_alive(self.pid) && std::time::Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for Netns {
    fn drop(&mut self) {
        self.stop();
    }
}

/// Moves the calling thread into the network namespace at `path`.
fn enter(path: &Path) -> Result<(), HarnessError> {
    let file =
        File::open(path).map_err(|e| HarnessError::io(format!("opening {}", path.display()), e))?;
    // SAFETY: setns on an open namespace file; it changes only this thread's namespace.
    if unsafe { libc::setns(file.as_raw_fd(), libc::CLONE_NEWNET) } == -1 {
        return Err(HarnessError::io(
            format!("entering {}", path.display()),
            std::io::Error::last_os_error(),
        ));
    }
    Ok(())
}

/// A listening socket bound inside the network namespace at `path` (by a short-lived thread:
/// the socket stays in the namespace it was made in).
fn bind_in(path: &Path, addr: SocketAddr) -> Result<TcpListener, HarnessError> {
    let path = path.to_path_buf();
    std::thread::spawn(move || {
        enter(&path)?;
        TcpListener::bind(addr)
            .map_err(|e| HarnessError::io(format!("binding {addr} in {}", path.display()), e))
    })
    .join()
    .map_err(|_| HarnessError::Missing {
        what: "a listener thread that did not panic".into(),
    })?
}

/// A TCP forward; stops (its connections cut) on drop.
pub struct Forward {
    local: SocketAddr,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
}

impl Forward {
    /// Accepts on `listener`; connects to `target` from the namespace `connect_in` (the
    /// host's when `None`). Runs on a thread of its own with its own runtime, so it serves
    /// across tests and the connecting thread's namespace is its own.
    fn start(
        listener: TcpListener,
        target: SocketAddr,
        connect_in: Option<PathBuf>,
    ) -> Result<Self, HarnessError> {
        let local = listener
            .local_addr()
            .map_err(|e| HarnessError::io("a forward's address", e))?;
        listener
            .set_nonblocking(true)
            .map_err(|e| HarnessError::io("a forward's listener", e))?;
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let (ready, started) = std::sync::mpsc::channel::<Result<(), HarnessError>>();
        std::thread::Builder::new()
            .name(format!("pko-tests-forward-{}", local.port()))
            .spawn(move || {
                if let Some(path) = &connect_in
                    && let Err(e) = enter(path)
                {
                    let _ = ready.send(Err(e));
                    return;
                }
                let rt = match tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                {
                    Ok(rt) => rt,
                    Err(e) => {
                        let _ = ready.send(Err(HarnessError::io("a forward's runtime", e)));
                        return;
                    }
                };
                rt.block_on(async move {
                    let listener = match tokio::net::TcpListener::from_std(listener) {
                        Ok(l) => l,
                        Err(e) => {
                            let _ = ready.send(Err(HarnessError::io("a forward's listener", e)));
                            return;
                        }
                    };
                    let _ = ready.send(Ok(()));
                    tokio::select! {
                        () = serve(listener, target) => {}
                        _ = stopped => {}
                    }
                });
            })
            .map_err(|e| HarnessError::io("starting a forward thread", e))?;
        started.recv().map_err(|_| HarnessError::Missing {
            what: "a forward thread that reports its start".into(),
        })??;
        Ok(Self {
            local,
            stop: Some(stop),
        })
    }

    /// Where it listens.
    pub fn local_addr(&self) -> SocketAddr {
        self.local
    }
}

impl Drop for Forward {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
    }
}

async fn serve(listener: tokio::net::TcpListener, target: SocketAddr) {
    loop {
        let Ok((mut inbound, _)) = listener.accept().await else {
            // Out of descriptors, most likely: let some connections end.
            tokio::time::sleep(Duration::from_millis(50)).await;
            continue;
        };
        tokio::spawn(async move {
            // A refused connection closes the inbound one: the client sees what it would.
            if let Ok(mut outbound) = tokio::net::TcpStream::connect(target).await {
                let _ = tokio::io::copy_bidirectional(&mut inbound, &mut outbound).await;
            }
        });
    }
}

/// Whether a TCP connection to `target` is accepted from inside the network namespace at
/// `path` (a pod's, for NetworkPolicy checks), within `timeout`.
pub fn connects_from(
    path: &Path,
    target: SocketAddr,
    timeout: Duration,
) -> Result<bool, HarnessError> {
    let path = path.to_path_buf();
    std::thread::spawn(move || {
        enter(&path)?;
        Ok(std::net::TcpStream::connect_timeout(&target, timeout).is_ok())
    })
    .join()
    .map_err(|_| HarnessError::Missing {
        what: "a probe thread that did not panic".into(),
    })?
}
