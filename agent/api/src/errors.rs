//! The error details the agent attaches to a failed call (PKO's `PulumiErrorInfo` in
//! `grpc-status-details-bin`), written by the agent and read by the operator.

use prost::Message;
use tonic::{Code, Status};

use crate::proto as pb;

/// Reason of the `PulumiErrorInfo` of an answer over the message limit.
pub const RESPONSE_TOO_LARGE: &str = "ResponseTooLarge";

/// Reason of the `PulumiErrorInfo` of an up whose update plan the agent does not hold (it
/// restarted since the preview that saved it).
pub const PLAN_NOT_FOUND: &str = "PlanNotFound";

/// A status carrying `PulumiErrorInfo` in `grpc-status-details-bin` (a `google.rpc.Status`).
pub fn with_error_info(code: Code, message: String, info_code: i32, reason: &str) -> Status {
    let info = pb::PulumiErrorInfo {
        code: info_code,
        reason: reason.to_owned(),
        message: message.clone(),
    };
    let details = pb::RpcStatus {
        code: code as i32,
        message: message.clone(),
        details: vec![prost_types::Any {
            type_url: "type.googleapis.com/agent.PulumiErrorInfo".into(),
            value: info.encode_to_vec(),
        }],
    };
    Status::with_details(code, message, details.encode_to_vec().into())
}

/// The `PulumiErrorInfo` attached to a status, if any.
pub fn error_info(status: &Status) -> Option<pb::PulumiErrorInfo> {
    let envelope = pb::RpcStatus::decode(status.details()).ok()?;
    envelope
        .details
        .iter()
        .find(|a| a.type_url.ends_with("agent.PulumiErrorInfo"))
        .and_then(|a| pb::PulumiErrorInfo::decode(a.value.as_slice()).ok())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn error_info_round_trips() {
        let status = with_error_info(
            Code::Unknown,
            "up failed: locked".into(),
            409,
            "UpdateConflict",
        );
        let info = error_info(&status).expect("info");
        assert_eq!(info.code, 409);
        assert_eq!(info.reason, "UpdateConflict");
        assert!(error_info(&Status::unknown("x")).is_none());
    }
}
