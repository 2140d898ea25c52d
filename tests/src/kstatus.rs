//! An object's health as GitOps tools compute it: sigs.k8s.io/cli-utils' kstatus
//! (`status.Compute`, what Flux's `wait`, Argo CD and kpt use), run as `tools/kstatus` (built by
//! `tools/build.sh kstatus`) on the objects the tests read from the apiserver. The rules are
//! the library's own, not a copy of them.

use std::io::Write;
use std::path::PathBuf;
use std::process::{Command, Stdio};

use serde::Deserialize;

/// What kstatus computes for one object.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
pub struct Health {
    /// `Current`, `InProgress`, `Failed`, `Terminating` or `Unknown`.
    pub status: String,
    pub message: String,
}

/// The kstatus command's binary.
pub fn binary() -> Result<PathBuf, crate::HarnessError> {
    Ok(crate::tool_dir("kstatus")?.join("kstatus"))
}

/// kstatus's verdict on `object`, given as the JSON text the apiserver returned (text, so
/// objects too deep for serde_json are judged too).
pub fn compute(object: &str) -> Result<Health, String> {
    let binary = binary().map_err(|e| e.to_string())?;
    let mut child = Command::new(&binary)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| format!("running {}: {e}", binary.display()))?;
    child
        .stdin
        .take()
        .ok_or("no stdin")?
        .write_all(object.as_bytes())
        .map_err(|e| format!("writing to kstatus: {e}"))?;
    let out = child
        .wait_with_output()
        .map_err(|e| format!("waiting for kstatus: {e}"))?;
    if !out.status.success() {
        return Err(format!(
            "kstatus failed ({}): {}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
        ));
    }
    serde_json::from_slice(&out.stdout).map_err(|e| {
        format!(
            "kstatus's answer {:?}: {e}",
            String::from_utf8_lossy(&out.stdout)
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The library's rules as Flux relies on them, on hand-made objects: a generation not yet
    /// observed is in progress, `Stalled=True` fails, `Ready=True` is current. Needs the tool.
    #[test]
    fn the_library_reads_observed_generation_and_conditions() {
        let object = |generation: i64, observed: i64, conditions: &str| {
            format!(
                r#"{{"apiVersion":"pulumi.com/v1","kind":"Program","metadata":{{"name":"p","generation":{generation}}},
                "status":{{"observedGeneration":{observed},"conditions":[{conditions}]}}}}"#
            )
        };
        let ready = r#"{"type":"Ready","status":"True","reason":"ArtifactReady","message":""}"#;
        let stalled = r#"{"type":"Ready","status":"False","reason":"ArtifactFailed","message":"m"},
            {"type":"Stalled","status":"True","reason":"ArtifactFailed","message":"boom"}"#;
        let health = |o: String| compute(&o).expect("kstatus").status;
        assert_eq!(health(object(1, 1, ready)), "Current");
        assert_eq!(health(object(2, 1, ready)), "InProgress");
        assert_eq!(health(object(1, 1, stalled)), "Failed");
        assert_eq!(
            compute(&object(1, 1, stalled)).expect("kstatus").message,
            "boom"
        );
    }
}
