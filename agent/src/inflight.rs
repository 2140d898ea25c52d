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
    fn a_torn_marker_reads_as_absent() {
        let dir = tempfile::tempdir().expect("tmp");
        std::fs::write(marker_path(dir.path()), "{\"operation\":").expect("write");
        assert_eq!(read(dir.path()), None);
    }
}
