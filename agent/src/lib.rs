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
pub mod client;
pub mod git;
pub mod inflight;
pub mod init;
pub mod limits;
pub mod pulumi;
pub mod server;
pub mod values;

/// Generated gRPC types and stubs of `proto/agent.proto` (package `agent`).
#[allow(clippy::all, missing_docs)]
pub mod proto {
    tonic::include_proto!("agent");
}

/// Port the agent listens on in a workspace pod (PKO's).
pub const DEFAULT_PORT: u16 = 50051;

/// Response header carrying the agent's instance id: a random value chosen at start, so a
/// client can tell that the agent restarted (and lost what it was told) since its last call.
pub const INSTANCE_HEADER: &str = "x-pko-agent-instance";
