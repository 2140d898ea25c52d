//! pko-rs workspace agent.
//!
//! One small binary that runs inside a workspace pod (any image with the `pulumi` CLI):
//! * `init` fetches the program (a Flux-style tar.gz, checked against its digest) or writes a
//!   minimal project, before the agent serves;
//! * `serve` is the gRPC `AutomationService` (PKO's API) implemented over the `pulumi` CLI, one
//!   operation at a time, streaming engine events; calls are checked with a per-workspace token
//!   over TLS (pko-rs's default) or, as PKO's agent does, by the Kubernetes API
//!   (`--auth-mode kube`);
//! * as `tini`, it is the workspace container's PID 1 in the pod PKO's manager lays out.
//!
//! It links neither kube nor wasmtime nor opa, so it stays small and quick to build.

pub mod askpass;
pub mod auth;
pub mod git;
pub mod inflight;
pub mod init;
pub mod kubeauth;
pub mod limits;
pub mod pulumi;
pub mod server;
pub mod tini;

/// This build's version (`pko-agent version`).
pub const VERSION: &str = env!("CARGO_PKG_VERSION");

// The API both ends share lives in its own crate (the operator links only that).
pub use pko_agent_api::{DEFAULT_PORT, INSTANCE_HEADER, client, features, proto, values};
