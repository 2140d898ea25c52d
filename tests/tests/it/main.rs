//! The integration tests: one test binary, one module per area, so the whole stack is linked
//! once instead of once per file.
//!
//! All modules share this process, hence one shared control plane
//! ([`pko_tests::ControlPlane::shared`]) and the test harness's threads. What only held while
//! each file was a process of its own is made explicit:
//! - every test holds [`pko_tests::serial::shared`] for its whole run, and the chaos scenarios
//!   hold [`pko_tests::serial::alone`], so a scenario still has the machine to itself;
//! - the tests that apply `deploy/` (its validating webhook refuses Stack and Workspace writes
//!   in every other namespace, as no operator pod answers it) use a control plane of their own,
//!   [`pko_tests::ControlPlane::shared_apart`];
//! - no test sets an environment variable or relies on a fixed port, and every namespace has a
//!   random name, so the modules' objects never meet.
#![allow(
    clippy::disallowed_methods,
    reason = "a test process is configured by its environment (make sets the tool and fixture paths)"
)]

mod admission;
mod admission_crosscheck;
mod agent;
mod approval;
mod chaos;
mod chart;
mod crds;
mod dashboards;
mod deploy;
mod deploy_scope;
mod deploy_webhook;
mod depth;
mod drift;
mod e2e;
mod egress;
mod examples;
mod fairness;
mod fields;
mod flux;
mod gitauth;
mod harness_smoke;
mod helm;
mod idle;
mod image;
mod interop;
mod kstatus;
mod leader;
mod logs;
mod metrics;
mod pko_examples;
mod plugin_cli;
mod program;
mod refs;
mod restricted_crosscheck;
mod stack;
mod stack_fields;
mod stacks_at_scale;
mod stall;
mod switchover;
mod transforms;
mod update;
mod update_fields;
mod warm_up;
mod wire;
mod workspace;
mod workspace_fields;
