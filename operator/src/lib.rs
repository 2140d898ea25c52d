//! pko-rs operator library: artifacts, the Program file server, controllers, metrics.
//!
//! Data flows one way: Program → transform chain → artifact → cache → file server → workspace.

pub mod agents;
pub mod artifact;
pub mod capability;
pub mod cli;
pub mod config;
pub mod controller;
pub mod egress;
pub mod fileserver;
pub mod gitremote;
pub mod leader;
pub mod memory;
pub mod metrics;
pub mod probes;
pub mod stack_metrics;
pub mod telemetry;
pub mod transform;
