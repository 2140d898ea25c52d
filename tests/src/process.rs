//! Child processes that never outlive the test process.
//!
//! Three layers, because each one alone has a gap:
//! * `PR_SET_PDEATHSIG = SIGKILL`: the kernel kills the child when its parent dies, even on
//!   `kill -9` of the test binary, where no destructor or exit handler runs. The signal fires
//!   when the *thread* that forked the child exits, and libtest runs every test in its own
//!   short-lived thread, so all children are forked by one spawner thread that lives as long
//!   as the process.
//! * Each child leads its own process group, so dropping a [`ChildGuard`] kills whatever the
//!   child started too, and a Ctrl-C in the terminal reaches only the test binary.
//! * [`ChildGuard`] kills the group on drop, which covers panics and normal ends of tests.

use std::fs::{File, OpenOptions};
use std::io::{self, Read, Seek, SeekFrom};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::OnceLock;
use std::sync::mpsc;
use std::time::{Duration, Instant};

use crate::HarnessError;

struct SpawnRequest {
    cmd: Command,
    reply: mpsc::Sender<io::Result<Child>>,
}

/// The sender of the spawner thread; never dropped, so the thread never ends.
static SPAWNER: OnceLock<Result<mpsc::Sender<SpawnRequest>, String>> = OnceLock::new();

fn spawner() -> Result<&'static mpsc::Sender<SpawnRequest>, String> {
    SPAWNER
        .get_or_init(|| {
            let (tx, rx) = mpsc::channel::<SpawnRequest>();
            std::thread::Builder::new()
                .name("pko-tests-spawner".into())
                .spawn(move || {
                    for SpawnRequest { cmd, reply } in rx {
                        // The requester may have gone away; its child is then dropped here,
                        // which does not kill it, but the request only ends with the process.
                        let _ = reply.send(spawn_with_death_signal(cmd));
                    }
                })
                .map(|_| tx)
                .map_err(|e| format!("cannot start the spawner thread: {e}"))
        })
        .as_ref()
        .map_err(Clone::clone)
}

/// Runs on the spawner thread: forks with a pre-exec hook that asks the kernel to SIGKILL the
/// child when this thread (and so the process) dies.
fn spawn_with_death_signal(mut cmd: Command) -> io::Result<Child> {
    // getpid() is the thread group id; getppid() in the child returns the same value.
    let parent = std::process::id() as libc::pid_t;
    // SAFETY: the hook only makes async-signal-safe system calls and does not allocate.
    unsafe {
        cmd.pre_exec(move || {
            if libc::prctl(
                libc::PR_SET_PDEATHSIG,
                libc::SIGKILL as libc::c_ulong,
                0 as libc::c_ulong,
                0 as libc::c_ulong,
                0 as libc::c_ulong,
            ) == -1
            {
                return Err(io::Error::last_os_error());
            }
            // The parent may have died between fork and prctl; the signal would never come.
            if libc::getppid() != parent {
                return Err(io::Error::from_raw_os_error(libc::ESRCH));
            }
            Ok(())
        });
    }
    cmd.spawn()
}

/// Starts `cmd` with stdin from /dev/null and stdout + stderr appended to `log_path`.
///
/// The child is killed (with its process group) when the guard is dropped, and by the kernel
/// when the test process dies for any reason. `name` is used in error messages.
pub fn spawn_guarded(
    mut cmd: Command,
    name: &str,
    log_path: &Path,
) -> Result<ChildGuard, HarnessError> {
    if let Some(parent) = log_path.parent() {
        std::fs::create_dir_all(parent).map_err(|e| {
            HarnessError::io(format!("creating log folder {}", parent.display()), e)
        })?;
    }
    let open_log = || {
        OpenOptions::new()
            .create(true)
            .append(true)
            .open(log_path)
            .map_err(|e| HarnessError::io(format!("opening log {}", log_path.display()), e))
    };
    cmd.stdin(Stdio::null())
        .stdout(open_log()?)
        .stderr(open_log()?)
        .process_group(0);
    let program = cmd.get_program().to_string_lossy().into_owned();
    let spawn_error = |source: io::Error| HarnessError::Spawn {
        name: name.to_string(),
        program: program.clone(),
        source,
    };
    let (reply, answer) = mpsc::channel();
    spawner()
        .map_err(|e| spawn_error(io::Error::other(e)))?
        .send(SpawnRequest { cmd, reply })
        .map_err(|_| spawn_error(io::Error::other("the spawner thread is gone")))?;
    let child = answer
        .recv()
        .map_err(|_| spawn_error(io::Error::other("the spawner thread did not answer")))?
        .map_err(spawn_error)?;
    Ok(ChildGuard {
        name: name.to_string(),
        pid: child.id(),
        log_path: log_path.to_path_buf(),
        child: Some(child),
        exited: None,
    })
}

/// A running child process, killed with its process group on drop.
#[derive(Debug)]
pub struct ChildGuard {
    name: String,
    pid: u32,
    log_path: PathBuf,
    /// `None` once killed and reaped.
    child: Option<Child>,
    /// Set once the child is reaped.
    exited: Option<ExitStatus>,
}

impl ChildGuard {
    pub fn pid(&self) -> u32 {
        self.pid
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    pub fn log_path(&self) -> &Path {
        &self.log_path
    }

    /// The last `lines` lines of the log (for error messages).
    pub fn log_tail(&self, lines: usize) -> String {
        log_tail(&self.log_path, lines)
    }

    /// The exit status if the child has ended (it is then reaped), `None` while it runs.
    pub fn try_wait(&mut self) -> io::Result<Option<ExitStatus>> {
        if self.exited.is_none()
            && let Some(child) = self.child.as_mut()
        {
            self.exited = child.try_wait()?;
        }
        Ok(self.exited)
    }

    /// Sends SIGTERM to the process group, waits up to `grace` for the child, then SIGKILLs
    /// what is left. For graceful-shutdown tests; dropping the guard kills at once.
    pub fn terminate(&mut self, grace: Duration) -> Option<ExitStatus> {
        self.child.as_ref()?;
        self.signal(libc::SIGTERM);
        let deadline = Instant::now() + grace;
        while Instant::now() < deadline {
            if let Ok(Some(_)) = self.try_wait() {
                break;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        self.kill()
    }

    /// SIGKILLs the process group, reaps the child and returns its exit status. Idempotent.
    pub fn kill(&mut self) -> Option<ExitStatus> {
        self.signal(libc::SIGKILL);
        if let Some(mut child) = self.child.take()
            && self.exited.is_none()
        {
            self.exited = child.wait().ok();
        }
        self.exited
    }

    /// Signals the process group, and the child alone if it left its group. Does nothing once
    /// the child is gone for good, so a reused pid is never hit.
    fn signal(&self, signal: libc::c_int) {
        if self.child.is_none() {
            return;
        }
        let Ok(pid) = libc::pid_t::try_from(self.pid) else {
            return;
        };
        // SAFETY: plain system calls. The group id is our child's pid. Linux does not hand
        // out a pid that is still some group's id, so while members of the group live the id
        // is ours; the child alone is signalled only while it is not reaped.
        unsafe {
            libc::kill(-pid, signal);
            if self.exited.is_none() {
                libc::kill(pid, signal);
            }
        }
    }
}

impl Drop for ChildGuard {
    fn drop(&mut self) {
        self.kill();
    }
}

/// Whether `pid` names a live (not zombie) process. Zombies count as dead: in a container,
/// pid 1 may never reap the orphans it inherits.
pub fn process_alive(pid: u32) -> bool {
    let Ok(raw) = libc::pid_t::try_from(pid) else {
        return false;
    };
    // SAFETY: signal 0 only checks for existence and permission.
    if unsafe { libc::kill(raw, 0) } == -1
        && io::Error::last_os_error().raw_os_error() == Some(libc::ESRCH)
    {
        return false;
    }
    match proc_stat_fields(pid) {
        Some(fields) => !matches!(fields.first().map(String::as_str), Some("Z" | "X")),
        None => false,
    }
}

/// Fields of `/proc/<pid>/stat` after the command name, starting with the state (field 3).
pub(crate) fn proc_stat_fields(pid: u32) -> Option<Vec<String>> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let rest = &stat[stat.rfind(')')? + 1..];
    Some(rest.split_whitespace().map(str::to_string).collect())
}

/// The start time of `pid` in clock ticks since boot (field 22 of `/proc/<pid>/stat`); with the
/// pid it identifies a process even after pid reuse.
pub(crate) fn process_start_time(pid: u32) -> Option<u64> {
    proc_stat_fields(pid)?.get(19)?.parse().ok()
}

/// The last `lines` lines of a log file, reading at most its last 64 KiB.
pub(crate) fn log_tail(path: &Path, lines: usize) -> String {
    const MAX: u64 = 64 * 1024;
    let read = || -> io::Result<String> {
        let mut file = File::open(path)?;
        let len = file.metadata()?.len();
        file.seek(SeekFrom::Start(len.saturating_sub(MAX)))?;
        let mut buf = Vec::new();
        file.read_to_end(&mut buf)?;
        Ok(String::from_utf8_lossy(&buf).into_owned())
    };
    match read() {
        Ok(text) => {
            let all: Vec<&str> = text.lines().collect();
            all[all.len().saturating_sub(lines)..].join("\n")
        }
        Err(e) => format!("(cannot read {}: {e})", path.display()),
    }
}
