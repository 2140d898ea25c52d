use pko_plugin_host::PluginError;

use crate::egress::Failure;

/// Failures pulling, checking or pushing an OCI artifact.
#[derive(Debug, thiserror::Error)]
pub enum OciError {
    #[error("invalid OCI reference {reference:?}: {reason}")]
    Reference { reference: String, reason: String },
    #[error("{url}: {reason}")]
    Unreachable { url: String, reason: String },
    /// A request that failed: its class for a tenant, the client's words for a person.
    #[error("{url}: {failure} ({detail})")]
    Request {
        url: String,
        failure: Failure,
        detail: String,
    },
    #[error("{url}: the registry answered {status}")]
    Status { url: String, status: u16 },
    #[error("{what} is larger than {limit} bytes")]
    TooLarge { what: String, limit: u64 },
    #[error("{what} has digest {actual}, not {expected}")]
    Digest {
        what: String,
        expected: String,
        actual: String,
    },
    #[error("not a Wasm artifact: {0}")]
    NotWasm(String),
    #[error("no cosign signature: {0}")]
    Unsigned(String),
    #[error("{0}")]
    Signature(String),
    #[error("invalid public key: {0}")]
    Key(String),
    #[error("registry authentication: {0}")]
    Auth(String),
}

/// A transform's pull, whose message reaches the tenant's status: a failed request or an
/// answer is told by its class, never its status code or connection error (those stay in the
/// operator's log).
impl From<OciError> for PluginError {
    fn from(err: OciError) -> Self {
        match err {
            OciError::Request {
                url,
                failure,
                detail,
            } => {
                tracing::info!(%url, %failure, %detail, "registry request failed");
                PluginError::Source(format!("{url}: {failure}"))
            }
            OciError::Status { url, status } => {
                let failure = Failure::of_status(status).unwrap_or(Failure::Unexpected);
                tracing::info!(%url, %failure, status, "registry request failed");
                PluginError::Source(format!("{url}: the registry: {failure}"))
            }
            OciError::Unsigned(_) | OciError::Signature(_) | OciError::Key(_) => {
                PluginError::Signature(err.to_string())
            }
            OciError::TooLarge { .. }
            | OciError::Reference { .. }
            | OciError::Unreachable { .. }
            | OciError::Digest { .. }
            | OciError::NotWasm(_)
            | OciError::Auth(_) => PluginError::Source(err.to_string()),
        }
    }
}
