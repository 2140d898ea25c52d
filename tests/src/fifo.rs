//! Named pipes that block a Pulumi program until the test lets it go.
//!
//! A program that runs `fn::readFile` on a FIFO waits for a writer. Writers here never block:
//! they open the pipe with `O_NONBLOCK`, which fails with `ENXIO` while nobody reads, and retry.
//! A blocking `open` would hang the test (and the tokio runtime's shutdown) forever when the
//! reader is already gone.

use std::fs::OpenOptions;
use std::io::Write;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::HarnessError;

const POLL: Duration = Duration::from_millis(50);

/// Creates a named pipe at `path`.
pub fn make(path: &Path) -> Result<(), HarnessError> {
    let status = std::process::Command::new("mkfifo")
        .arg(path)
        .status()
        .map_err(|source| HarnessError::Io {
            what: format!("mkfifo {}", path.display()),
            source,
        })?;
    if status.success() {
        Ok(())
    } else {
        Err(HarnessError::Io {
            what: format!("mkfifo {}", path.display()),
            source: std::io::Error::other(status.to_string()),
        })
    }
}

/// Whether a process below `ancestor` waits in `open(2)` for the other end of a pipe (its
/// kernel wait channel is `wait_for_partner`): a program blocked on a test's pipe. The open has
/// not returned, so the pipe is in no fd table yet; and a test's own probe that opened the pipe
/// would hand the program an end of file.
pub fn reader_waiting_below(ancestor: u32) -> bool {
    let Ok(procs) = std::fs::read_dir("/proc") else {
        return false;
    };
    let parents: std::collections::HashMap<u32, u32> = procs
        .flatten()
        .filter_map(|entry| {
            let pid: u32 = entry.file_name().to_str()?.parse().ok()?;
            let stat = std::fs::read_to_string(entry.path().join("stat")).ok()?;
            // `pid (comm) state ppid …`: comm may hold spaces and parentheses.
            let ppid = stat
                .rsplit_once(')')?
                .1
                .split_whitespace()
                .nth(1)?
                .parse()
                .ok()?;
            Some((pid, ppid))
        })
        .collect();
    let below = |mut pid: u32| {
        while let Some(&parent) = parents.get(&pid) {
            if parent == ancestor {
                return true;
            }
            if parent == 0 || parent == pid {
                return false;
            }
            pid = parent;
        }
        false
    };
    parents.keys().filter(|pid| below(**pid)).any(|pid| {
        std::fs::read_dir(format!("/proc/{pid}/task"))
            .into_iter()
            .flatten()
            .flatten()
            .any(|task| {
                std::fs::read_to_string(task.path().join("wchan"))
                    .is_ok_and(|w| w.trim() == "wait_for_partner")
            })
    })
}

/// One write attempt: `Ok(true)` when a reader got `data`, `Ok(false)` when nobody reads.
fn try_write(path: &Path, data: &[u8]) -> std::io::Result<bool> {
    match OpenOptions::new()
        .write(true)
        .custom_flags(libc::O_NONBLOCK)
        .open(path)
    {
        Ok(mut pipe) => {
            // A reader that went away mid-write is the same as no reader.
            Ok(pipe.write_all(data).is_ok())
        }
        Err(e) if e.raw_os_error() == Some(libc::ENXIO) => Ok(false),
        Err(e) => Err(e),
    }
}

/// Writes `data` to the first reader that opens the pipe within `timeout`; `false` if none did.
pub async fn write_within(path: &Path, data: &str, timeout: Duration) -> bool {
    let deadline = Instant::now() + timeout;
    loop {
        match try_write(path, data.as_bytes()) {
            Ok(true) => return true,
            Ok(false) if Instant::now() < deadline => tokio::time::sleep(POLL).await,
            _ => return false,
        }
    }
}

/// Feeds every reader of a pipe until dropped (or `limit` elapses), counting the reads served.
pub struct Feeder {
    stop: Arc<AtomicBool>,
    fed: Arc<AtomicUsize>,
    thread: Option<JoinHandle<()>>,
}

impl Feeder {
    pub fn start(path: PathBuf, data: &str, limit: Duration) -> Self {
        let stop = Arc::new(AtomicBool::new(false));
        let fed = Arc::new(AtomicUsize::new(0));
        let data = data.as_bytes().to_vec();
        let thread = {
            let (stop, fed) = (stop.clone(), fed.clone());
            std::thread::spawn(move || {
                let deadline = Instant::now() + limit;
                while !stop.load(Ordering::Relaxed) && Instant::now() < deadline {
                    match try_write(&path, &data) {
                        Ok(true) => {
                            fed.fetch_add(1, Ordering::Relaxed);
                            // Let this reader close before the next open, so one read gets one
                            // writer's bytes and then end-of-file.
                            std::thread::sleep(POLL);
                        }
                        Ok(false) => std::thread::sleep(POLL),
                        Err(_) => return,
                    }
                }
            })
        };
        Self {
            stop,
            fed,
            thread: Some(thread),
        }
    }

    /// How many readers were served so far.
    pub fn fed(&self) -> usize {
        self.fed.load(Ordering::Relaxed)
    }
}

impl Drop for Feeder {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(thread) = self.thread.take() {
            // The loop never blocks for longer than one poll, so this join is short.
            let _ = thread.join();
        }
    }
}
