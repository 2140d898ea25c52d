//! pko-rs operator library: artifacts, the Program file server, controllers, metrics.
//!
//! Data flows one way: Program → artifact → cache → file server → workspace.

pub mod artifact;
pub mod config;
pub mod controller;
pub mod fileserver;
pub mod metrics;
pub mod probes;
pub mod telemetry;
