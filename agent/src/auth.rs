//! Authentication of the operator's calls, in one of three modes (`serve --auth-mode`).
//!
//! * `token` (pko-rs's default): PKO's agent checks a Kubernetes token with TokenReview +
//!   SubjectAccessReview, over plaintext gRPC; every workspace service account then needs a
//!   cluster-wide `system:auth-delegator` binding, and the bearer token crosses the network in
//!   clear. Here the operator mints, per Workspace, a random bearer token and a self-signed TLS
//!   certificate, stores them in a Secret of the Workspace's namespace and mounts that Secret
//!   into the pod: the agent serves TLS with that certificate and accepts only that token; the
//!   operator pins that certificate. No apiserver call is needed on either side, and a token
//!   opens exactly one workspace.
//! * `kube` (PKO's, which PKO's manager starts every agent with): the token is reviewed by the
//!   apiserver ([`crate::kubeauth`]).
//! * `none`: every call is accepted (local development only).
//!
//! [`Authenticated`] wraps the gRPC service and checks every call before it reaches it.

use std::convert::Infallible;
use std::sync::Arc;

use tonic::body::Body;
use tonic::codegen::{BoxFuture, Context, Poll, Service, http};
use tonic::server::NamedService;

use crate::kubeauth::KubeAuth;
use tonic::Status;
use tonic::metadata::MetadataMap;

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

/// [`TokenAuth`] as a tonic interceptor (for a server that needs no other mode).
impl tonic::service::Interceptor for TokenAuth {
    fn call(&mut self, request: tonic::Request<()>) -> Result<tonic::Request<()>, Status> {
        self.check(request.metadata())?;
        Ok(request)
    }
}

/// How calls are checked.
pub enum Auth {
    None,
    Token(TokenAuth),
    Kube(Box<KubeAuth>),
}

impl Auth {
    /// Checks one call's headers.
    pub async fn check(&self, headers: &http::HeaderMap) -> Result<(), Status> {
        match self {
            Auth::None => Ok(()),
            Auth::Token(token) => token.check(&MetadataMap::from_headers(headers.clone())),
            Auth::Kube(kube) => {
                let header = headers
                    .get(http::header::AUTHORIZATION)
                    .and_then(|v| v.to_str().ok());
                kube.check(header).await.map(|_| ())
            }
        }
    }
}

/// The gRPC service behind [`Auth`]: a refused call is answered with its status and never
/// reaches the service.
#[derive(Clone)]
pub struct Authenticated<S> {
    inner: S,
    auth: Arc<Auth>,
}

impl<S> Authenticated<S> {
    pub fn new(inner: S, auth: Arc<Auth>) -> Self {
        Self { inner, auth }
    }
}

impl<S: NamedService> NamedService for Authenticated<S> {
    const NAME: &'static str = S::NAME;
}

impl<S> Service<http::Request<Body>> for Authenticated<S>
where
    S: Service<http::Request<Body>, Response = http::Response<Body>, Error = Infallible>
        + Clone
        + Send
        + 'static,
    S::Future: Send + 'static,
{
    type Response = http::Response<Body>;
    type Error = Infallible;
    type Future = BoxFuture<Self::Response, Self::Error>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: http::Request<Body>) -> Self::Future {
        // The service that was polled ready serves this call; a clone takes its place.
        let clone = self.inner.clone();
        let mut inner = std::mem::replace(&mut self.inner, clone);
        let auth = self.auth.clone();
        Box::pin(async move {
            match auth.check(request.headers()).await {
                Ok(()) => inner.call(request).await,
                Err(status) => Ok(status.into_http()),
            }
        })
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
