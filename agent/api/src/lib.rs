//! The workspace agent's gRPC API, as both ends use it: the generated types and stubs of
//! `proto/agent.proto`, the client (TLS pinned, bearer token), JSON ↔ protobuf values, and the
//! error details the agent attaches to a failed call.
//!
//! The operator depends on this crate alone, never on the agent's server (pulumi driver, git,
//! fetcher).

pub mod client;
pub mod errors;
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

/// Largest gRPC message, both ways, on both ends (agent server and operator client).
pub const MAX_MESSAGE_BYTES: usize = 16 * 1024 * 1024;
