use pko_plugin_host::PluginError;

/// Failures pulling, checking or pushing an OCI artifact.
#[derive(Debug, thiserror::Error)]
pub enum OciError {
    #[error("invalid OCI reference {reference:?}: {reason}")]
    Reference { reference: String, reason: String },
    #[error("{url}: {reason}")]
    Unreachable { url: String, reason: String },
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

impl From<OciError> for PluginError {
    fn from(err: OciError) -> Self {
        match err {
            OciError::Unsigned(_) | OciError::Signature(_) | OciError::Key(_) => {
                PluginError::Signature(err.to_string())
            }
            OciError::TooLarge { .. }
            | OciError::Reference { .. }
            | OciError::Unreachable { .. }
            | OciError::Status { .. }
            | OciError::Digest { .. }
            | OciError::NotWasm(_)
            | OciError::Auth(_) => PluginError::Source(err.to_string()),
        }
    }
}
