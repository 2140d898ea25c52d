//! pko-rs operator library: artifacts, the Program file server, controllers, metrics.
//!
//! Data flows one way, and the modules follow it: Program → transform chain ([`transform`],
//! over the `pko-plugin-host` crate) → artifact ([`artifact`]: the build, the replica's index of
//! Programs and the cache) → file server ([`fileserver`], on the hardened listener of [`http`])
//! → workspace ([`controller`], reaching agents through [`agent_client`] and the
//! `pko-agent-api` crate).

pub mod admin;
pub mod agent_client;
pub mod artifact;
pub mod capability;
pub mod config;
pub mod controller;
pub mod cron;
pub mod egress;
pub mod fileserver;
pub mod gitremote;
pub mod gitssh;
pub mod http;
pub mod leader;
pub mod memory;
pub mod metrics;
pub mod oci;
pub mod offline;
pub mod probes;
pub mod process_metrics;
pub mod rest_metrics;
pub mod runtime_metrics;
pub mod scope;
pub mod secure_metrics;
pub mod stack_metrics;
pub mod telemetry;
pub mod transform;
pub mod workspace_metrics;
