//! pko-rs workspace agent.
//!
//! One small binary that runs inside a workspace pod (any image with the `pulumi` CLI):
//! * `init` fetches the program (a Flux-style tar.gz, checked against its digest) or writes a
//!   minimal project, before the agent serves;
//! * `serve` is the gRPC `AutomationService` (PKO's API) implemented over the `pulumi` CLI, one
//!   operation at a time, streaming engine events.
//!
//! It links neither kube nor wasmtime nor opa, so it stays small and quick to build.

pub mod auth;
pub mod git;
pub mod inflight;
pub mod init;
pub mod limits;
pub mod pulumi;
pub mod server;

// The API both ends share lives in its own crate (the operator links only that).
pub use pko_agent_api::{DEFAULT_PORT, INSTANCE_HEADER, client, proto, values};
