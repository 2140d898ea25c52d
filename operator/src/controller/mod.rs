//! Controllers: reconcile + error_policy per kind.

pub mod backoff;
pub mod conditions;
pub mod execution;
pub mod instrument;
pub mod keys;
pub mod kit;
pub mod program;
pub mod queue;
pub mod stack;
pub mod takeover;
pub mod tenancy;
pub mod transform_status;
pub mod update;
pub mod workspace;
