//! pko-rs transform plugin host.
//!
//! Plugins are WebAssembly components implementing the WIT world `pko:transform/plugin`
//! (`wit/transform.wit`). The [`host::PluginHost`] compiles each module once per sha256 (with an
//! optional on-disk precompiled cache), links it once (`InstancePre`) and runs every call on a
//! fresh `Store` from a pooling allocator, under fuel, an epoch deadline, a memory cap and an
//! outer timeout, with a semaphore bounding concurrent calls. [`chain`] runs an ordered list
//! of plugins over a Program spec; [`conformance`] runs fixture cases against a module (the
//! `plugin test` command).

pub mod chain;
pub mod compiler;
pub mod conformance;
pub mod diskcache;
pub mod errors;
pub mod host;
pub mod json;
pub mod limits;
pub mod metrics;

pub use errors::{ErrorKind, PluginError};
pub use host::{CallSite, HostConfig, LoadSource, Module, PluginHost, PluginInfo, ProgramInput};
pub use limits::{LimitOverrides, Limits};
pub use metrics::PluginMetrics;
