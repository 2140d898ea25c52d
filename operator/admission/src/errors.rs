//! Errors of a single webhook call, shared by the review parser and the handlers.

use crate::engine::EngineError;
use crate::tenancy::TenancyError;

/// Errors of a single webhook call.
#[derive(Debug, thiserror::Error)]
pub enum WebhookError {
    #[error("{0}")]
    Engine(#[from] EngineError),
    #[error("{0}")]
    Tenancy(#[from] TenancyError),
    #[error("the policy returned an unexpected {what}: {reason}")]
    Output { what: &'static str, reason: String },
    /// A request body that is not an AdmissionReview v1 (answered with HTTP 400).
    #[error("{0}")]
    InvalidReview(String),
    /// A body with more JSON values than allowed (answered with HTTP 413).
    #[error("the body holds more than {max} JSON values")]
    TooManyValues { max: usize },
    /// A review nested deeper than allowed: answered with a denial of its request, which is
    /// read without building the tree (serde_json skips what it ignores without recursion).
    #[error("it is nested {depth} levels deep; pko-rs allows at most {max} (see docs/policies.md)")]
    TooDeep {
        request: Box<crate::review::RequestHead>,
        depth: usize,
        max: usize,
    },
}

impl WebhookError {
    pub(crate) fn kind(&self) -> &'static str {
        match self {
            WebhookError::Engine(e) => e.kind(),
            WebhookError::Tenancy(_) => "tenancy",
            WebhookError::Output { .. } => "output",
            WebhookError::InvalidReview(_)
            | WebhookError::TooManyValues { .. }
            | WebhookError::TooDeep { .. } => "invalid",
        }
    }
}
