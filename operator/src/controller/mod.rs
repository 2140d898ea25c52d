//! Controllers: reconcile + error_policy per kind.

pub mod program;
