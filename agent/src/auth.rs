//! Authentication of the operator's calls.
//!
//! PKO's agent checks a Kubernetes token with TokenReview + SubjectAccessReview, over plaintext
//! gRPC; every workspace service account then needs a cluster-wide `system:auth-delegator`
//! binding, and the bearer token crosses the network in clear. Here the operator mints, per
//! Workspace, a random bearer token and a self-signed TLS certificate, stores them in a Secret
//! of the Workspace's namespace and mounts that Secret into the pod: the agent serves TLS with
//! that certificate and accepts only that token; the operator pins that certificate. No
//! apiserver call is needed on either side, and a token opens exactly one workspace.

use tonic::metadata::MetadataMap;
use tonic::{Request, Status};

/// Checks `authorization: Bearer <token>` on every call.
#[derive(Clone)]
pub struct TokenAuth {
    token: Option<Vec<u8>>,
}

impl TokenAuth {
    /// `None` accepts every call (development only; `serve --auth-mode none`).
    pub fn new(token: Option<String>) -> Self {
        Self {
            token: token.map(|t| t.trim().as_bytes().to_vec()),
        }
    }

    pub fn check(&self, metadata: &MetadataMap) -> Result<(), Status> {
        let Some(expected) = &self.token else {
            return Ok(());
        };
        let header = metadata
            .get("authorization")
            .and_then(|v| v.to_str().ok())
            .ok_or_else(|| Status::unauthenticated("Request unauthenticated with Bearer"))?;
        let presented = header
            .strip_prefix("Bearer ")
            .or_else(|| header.strip_prefix("bearer "))
            .ok_or_else(|| Status::unauthenticated("Request unauthenticated with Bearer"))?;
        if constant_time_eq(presented.trim().as_bytes(), expected) {
            Ok(())
        } else {
            Err(Status::unauthenticated("invalid bearer token"))
        }
    }
}

impl tonic::service::Interceptor for TokenAuth {
    fn call(&mut self, request: Request<()>) -> Result<Request<()>, Status> {
        self.check(request.metadata())?;
        Ok(request)
    }
}

/// Equal without an early exit, so timing does not reveal how much of a guess was right.
fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    if a.len() != b.len() {
        return false;
    }
    a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

#[cfg(test)]
mod tests {
    use super::*;

    fn metadata(value: Option<&str>) -> MetadataMap {
        let mut m = MetadataMap::new();
        if let Some(v) = value
            && let Ok(v) = v.parse()
        {
            m.insert("authorization", v);
        }
        m
    }

    #[test]
    fn token_is_required_and_compared() {
        let auth = TokenAuth::new(Some("s3cret\n".into()));
        assert!(auth.check(&metadata(Some("Bearer s3cret"))).is_ok());
        let missing = auth.check(&metadata(None)).expect_err("no header");
        assert_eq!(missing.code(), tonic::Code::Unauthenticated);
        let basic = auth
            .check(&metadata(Some("Basic czNjcmV0")))
            .expect_err("basic");
        assert_eq!(basic.message(), "Request unauthenticated with Bearer");
        let wrong = auth
            .check(&metadata(Some("Bearer s3cre")))
            .expect_err("wrong");
        assert_eq!(wrong.message(), "invalid bearer token");
        assert!(TokenAuth::new(None).check(&metadata(None)).is_ok());
    }
}
