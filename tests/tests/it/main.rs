//! The integration tests: one test binary, one module per area, so the whole stack is linked
//! once instead of once per file.
//!
//! All modules share this process, hence one shared control plane
//! ([`pko_tests::ControlPlane::shared`]) and the test harness's threads.
#![allow(
    clippy::disallowed_methods,
    reason = "a test process is configured by its environment (make sets the tool and fixture paths)"
)]

mod admission;
mod admission_crosscheck;
mod agent;
mod chaos;
mod crds;
mod deploy;
mod deploy_webhook;
mod harness_smoke;
mod leader;
mod metrics;
mod plugin_cli;
mod program;
mod stack;
mod stall;
mod transforms;
mod update;
mod workspace;
