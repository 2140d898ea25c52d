//! What one build produced: the artifact, and what the transform chain did to the Program.
//! The index builds it, the cache holds it, the file server serves it.

use pko_plugin_host::chain::{Applied, Skipped};

use super::Artifact;

/// An artifact and the transform chain that shaped it.
#[derive(Debug, Clone, PartialEq)]
pub struct Built {
    pub artifact: Artifact,
    pub chain: ChainReport,
}

impl Built {
    /// Bytes held in memory (the artifact).
    pub fn size(&self) -> u64 {
        self.artifact.size()
    }
}

/// What the transform chain did to a Program.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ChainReport {
    /// The chain's fingerprint (`""` when no transform applies).
    pub fingerprint: String,
    pub applied: Vec<Applied>,
    /// Transforms skipped under `failurePolicy: Ignore`.
    pub skipped: Vec<Skipped>,
}

impl ChainReport {
    /// A transform was skipped for a reason that may not recur: build again soon.
    pub fn transient(&self) -> bool {
        self.skipped.iter().any(|s| s.error.kind().is_transient())
    }
}
