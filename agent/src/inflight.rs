//! A marker file that outlives a crashed agent: it says which stack an operation was running on.
//!
//! Pulumi's self-managed (`file://`, bucket) backends lock a stack for the length of an operation
//! and unlock it when the CLI ends normally. When the container dies mid-operation (OOM kill,
//! node pressure, SIGKILL), the lock stays and every later operation fails with "the stack is
//! currently locked". The marker lives in the project folder (on the pod's shared volume, which
//! survives container restarts); the next operation of the restarted agent finds it and releases
//! the lock its predecessor left with `pulumi cancel`. Only a marker written by this workspace's
//! agent triggers this, so a lock held by anyone else is never broken.

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

/// File name in the project folder.
pub const MARKER: &str = ".pko-agent-operation.json";

#[derive(Debug, thiserror::Error)]
pub enum InflightError {
    #[error("cannot write the operation marker {path}: {source}")]
    Write {
        path: String,
        #[source]
        source: std::io::Error,
    },
}

/// What was running when the marker was written.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Inflight {
    pub operation: String,
    pub stack: String,
    /// The writing agent's instance id (pids repeat across container restarts: often 1).
    pub instance: String,
}

pub fn marker_path(project: &Path) -> PathBuf {
    project.join(MARKER)
}

/// The marker left by an agent that did not finish its operation, if any. An unreadable marker
/// is treated as absent (and removed by the next [`write`]).
pub fn read(project: &Path) -> Option<Inflight> {
    let text = std::fs::read_to_string(marker_path(project)).ok()?;
    serde_json::from_str(&text).ok()
}

/// Records `inflight` before the CLI starts (written to a temporary file, then renamed, so a
/// crash never leaves half a marker).
pub fn write(project: &Path, inflight: &Inflight) -> Result<(), InflightError> {
    let path = marker_path(project);
    let tmp = project.join(format!("{MARKER}.tmp"));
    let err = |source| InflightError::Write {
        path: path.display().to_string(),
        source,
    };
    let text = serde_json::to_vec(inflight).map_err(|e| err(std::io::Error::other(e)))?;
    std::fs::write(&tmp, text).map_err(err)?;
    std::fs::rename(&tmp, &path).map_err(err)
}

/// Removes the marker once the CLI has ended (successfully or not: it unlocked the stack).
pub fn clear(project: &Path) {
    let _ = std::fs::remove_file(marker_path(project));
}

/// This machine's host name (a workspace pod's name, stable across pod re-creation).
#[allow(unsafe_code, reason = "gethostname into a buffer of ours; see SAFETY")]
pub fn hostname() -> Option<String> {
    let mut buf = [0u8; 256];
    // SAFETY: the buffer is valid for its length; gethostname NUL-terminates within it or
    // truncates, and we stop at the first NUL.
    let rc = unsafe { libc::gethostname(buf.as_mut_ptr().cast(), buf.len()) };
    if rc != 0 {
        return None;
    }
    let end = buf.iter().position(|b| *b == 0).unwrap_or(buf.len());
    std::str::from_utf8(&buf[..end]).ok().map(str::to_owned)
}

/// Whether `output` (a failed operation's) says the stack is locked and every lock it lists was
/// taken on `host` before `started` (when this agent started). A workspace's pod keeps its name
/// when it is re-created and only one pod of that name runs at a time, so such locks belong to a
/// predecessor pod that died mid-operation (its marker was lost with its volume) and can be
/// released. A lock taken while this agent runs is never one of them.
pub fn stale_locks_of(output: &str, host: &str, started: jiff::Timestamp) -> bool {
    if !output.contains("the stack is currently locked") {
        return false;
    }
    let owners: Vec<&str> = output
        .lines()
        .filter_map(|l| l.split_once(": created by ").map(|(_, rest)| rest))
        .collect();
    !owners.is_empty()
        && owners.iter().all(|rest| {
            // `user@host (pid N) at 2026-11-30T09:52:43Z`
            let on_host = rest
                .split_once(" (pid ")
                .and_then(|(who, _)| who.rsplit_once('@'))
                .is_some_and(|(_, h)| h == host);
            let before_us = rest
                .rsplit_once(" at ")
                .and_then(|(_, at)| at.trim().parse::<jiff::Timestamp>().ok())
                .is_some_and(|at| at < started);
            on_host && before_us
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_marker_round_trips_and_clears() {
        let dir = tempfile::tempdir().expect("tmp");
        assert_eq!(read(dir.path()), None);
        let m = Inflight {
            operation: "up".into(),
            stack: "dev".into(),
            instance: "a1".into(),
        };
        write(dir.path(), &m).expect("write");
        assert_eq!(read(dir.path()), Some(m));
        clear(dir.path());
        assert_eq!(read(dir.path()), None);
    }

    #[test]
    fn only_older_locks_of_this_host_count_as_stale() {
        let started: jiff::Timestamp = "2026-11-30T10:00:00Z".parse().expect("time");
        let one = "error: the stack is currently locked by 1 lock(s). Either wait for the other process(es) to end or delete the lock file with `pulumi cancel`.\n  file:///b/.pulumi/locks/organization/p/dev/1.json: created by pulumi@ws-workspace-0 (pid 41) at 2026-11-30T09:52:43Z";
        assert!(stale_locks_of(one, "ws-workspace-0", started));
        assert!(!stale_locks_of(one, "other-0", started));
        let early: jiff::Timestamp = "2026-11-30T09:00:00Z".parse().expect("time");
        assert!(
            !stale_locks_of(one, "ws-workspace-0", early),
            "taken after we started"
        );
        let two = format!(
            "{one}\n  s3://b/.pulumi/locks/organization/p/dev/2.json: created by me@laptop (pid 7) at 2026-11-30T09:52:44Z"
        );
        assert!(
            !stale_locks_of(&two, "ws-workspace-0", started),
            "someone else holds one"
        );
        assert!(!stale_locks_of(
            "error: update failed",
            "ws-workspace-0",
            started
        ));
        assert!(
            !stale_locks_of("the stack is currently locked by 1 lock(s).", "h", started),
            "owner unknown"
        );
    }

    #[test]
    fn a_torn_marker_reads_as_absent() {
        let dir = tempfile::tempdir().expect("tmp");
        std::fs::write(marker_path(dir.path()), "{\"operation\":").expect("write");
        assert_eq!(read(dir.path()), None);
    }
}
