//! `--auth-mode kube`: PKO's way of checking the operator's calls, which PKO's manager starts
//! every agent with.
//!
//! Each call must carry a bearer token, which the apiserver is asked about twice, as the
//! workspace pod's service account:
//! * a TokenReview with the workspace's audience (`<ws>.<ns>`): who the token is, and only if it
//!   was minted for this workspace (so a token meant for another workspace, or for the
//!   apiserver itself, opens nothing);
//! * a SubjectAccessReview: may that identity `use` `workspaces/rpc` (group `auto.pulumi.com`)
//!   of this Workspace's namespace and name.
//!
//! Answers are cached as PKO's agent caches them (an authenticated token for an hour, a refused
//! one for a minute; an allowed decision for five minutes, a denied one for five seconds), in
//! caches of bounded size keyed by the SHA-256 of the token (never the token itself). A review
//! the apiserver cannot answer (5xx, timeout, connection) is retried with backoff (500 ms × 1.5,
//! five tries) and never cached.
//!
//! Failures are gRPC statuses that say what is wrong: `Unauthenticated` for a missing, invalid
//! or wrong-audience token and when the reviews themselves are forbidden to the pod's service
//! account (which then needs the `system:auth-delegator` ClusterRole: the agent's log says
//! which binding to add), `PermissionDenied` with the authorizer's reason when the identity may
//! not use the workspace.

pub mod api;
mod cache;

use std::time::{Duration, Instant};

use serde_json::{Value, json};
use sha2::{Digest, Sha256};
use tonic::Status;
use tracing::{debug, error, warn};

pub use api::{ApiError, ApiServer, InCluster};
use cache::{MAX_ENTRIES, TtlCache};

const TOKEN_REVIEWS: &str = "/apis/authentication.k8s.io/v1/tokenreviews";
const ACCESS_REVIEWS: &str = "/apis/authorization.k8s.io/v1/subjectaccessreviews";

/// PKO's cache lifetimes (its agent's `NewKubeAuth`).
const AUTHENTICATED_TTL: Duration = Duration::from_secs(3600);
const UNAUTHENTICATED_TTL: Duration = Duration::from_secs(60);
const ALLOWED_TTL: Duration = Duration::from_secs(300);
const DENIED_TTL: Duration = Duration::from_secs(5);
/// PKO's retry of a review the apiserver did not answer: 500 ms, × 1.5, five tries.
const RETRY_FIRST: Duration = Duration::from_millis(500);
const RETRY_TRIES: u32 = 5;

/// The group, resource and verb a caller must be allowed (PKO's).
pub const RPC_GROUP: &str = "auto.pulumi.com";
pub const RPC_VERSION: &str = "v1alpha1";
pub const RPC_RESOURCE: &str = "workspaces";
pub const RPC_SUBRESOURCE: &str = "rpc";
pub const RPC_VERB: &str = "use";

/// What `serve --auth-mode kube` was given.
#[derive(Debug, Clone)]
pub struct KubeAuthOptions {
    /// `--kube-audience` (at least one).
    pub audiences: Vec<String>,
    /// `--kube-workspace-namespace`, `--kube-workspace-name`.
    pub workspace_namespace: String,
    pub workspace_name: String,
    /// The pod's namespace and service account (`POD_NAMESPACE`, `POD_SA_NAME`), named in the
    /// hint logged when the reviews are forbidden.
    pub pod_service_account: Option<(String, String)>,
}

/// A user the apiserver vouched for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct User {
    pub name: String,
    pub uid: String,
    pub groups: Vec<String>,
    pub extra: serde_json::Map<String, Value>,
}

/// What the apiserver said about a token.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TokenVerdict {
    Authenticated(User),
    /// With the apiserver's reason, if it gave one.
    Refused(String),
}

/// What the authorizer said about a user.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum AccessVerdict {
    Allowed,
    Denied(String),
}

/// A review that did not come back with an answer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ReviewFailure {
    /// 403: the pod's service account may not create reviews.
    Forbidden,
    /// Anything else (after the retries), with a description.
    Unavailable(String),
}

/// The check of `--auth-mode kube`.
pub struct KubeAuth {
    api: ApiServer,
    options: KubeAuthOptions,
    tokens: TtlCache<[u8; 32], TokenVerdict>,
    decisions: TtlCache<String, AccessVerdict>,
}

impl KubeAuth {
    pub fn new(api: ApiServer, options: KubeAuthOptions) -> Self {
        Self {
            api,
            options,
            tokens: TtlCache::new(MAX_ENTRIES),
            decisions: TtlCache::new(MAX_ENTRIES),
        }
    }

    /// Authenticates and authorizes the `authorization` header of one call.
    pub async fn check(&self, authorization: Option<&str>) -> Result<User, Status> {
        let token = bearer(authorization)?;
        let user = match self.review_token(token).await {
            Ok(TokenVerdict::Authenticated(user)) => user,
            Ok(TokenVerdict::Refused(reason)) => {
                warn!(%reason, "authentication failed");
                return Err(Status::unauthenticated(refused_message(&reason)));
            }
            Err(ReviewFailure::Forbidden) => {
                error!("{}", self.delegator_hint());
                return Err(Status::unauthenticated("TokenReview API is unavailable"));
            }
            Err(ReviewFailure::Unavailable(detail)) => {
                warn!(%detail, "authentication failed with an error");
                return Err(Status::unauthenticated(format!(
                    "the token could not be reviewed: {detail}"
                )));
            }
        };
        match self.review_access(&user).await {
            Ok(AccessVerdict::Allowed) => {
                debug!(user = %user.name, "authorized");
                Ok(user)
            }
            Ok(AccessVerdict::Denied(reason)) => {
                warn!(user = %user.name, %reason, "access denied");
                Err(Status::permission_denied(denied_message(
                    &user.name,
                    &reason,
                    &self.options,
                )))
            }
            Err(ReviewFailure::Forbidden) => {
                error!("{}", self.delegator_hint());
                Err(Status::unauthenticated(
                    "SubjectAccessReview API is unavailable",
                ))
            }
            Err(ReviewFailure::Unavailable(detail)) => {
                error!(%detail, user = %user.name, "authorization failed with an error");
                Err(Status::unavailable(format!(
                    "the access could not be reviewed: {detail}"
                )))
            }
        }
    }

    async fn review_token(&self, token: &str) -> Result<TokenVerdict, ReviewFailure> {
        let key: [u8; 32] = Sha256::digest(token.as_bytes()).into();
        if let Some(verdict) = self.tokens.get(&key, Instant::now()) {
            return Ok(verdict);
        }
        let body = json!({
            "apiVersion": "authentication.k8s.io/v1",
            "kind": "TokenReview",
            "spec": {"token": token, "audiences": self.options.audiences},
        });
        let answer = self.post_with_retries(TOKEN_REVIEWS, &body).await?;
        let verdict = token_verdict(&answer, &self.options.audiences);
        let ttl = match verdict {
            TokenVerdict::Authenticated(_) => AUTHENTICATED_TTL,
            TokenVerdict::Refused(_) => UNAUTHENTICATED_TTL,
        };
        self.tokens.put(key, verdict.clone(), ttl, Instant::now());
        Ok(verdict)
    }

    async fn review_access(&self, user: &User) -> Result<AccessVerdict, ReviewFailure> {
        let spec = access_review_spec(user, &self.options);
        let key = spec.to_string();
        if let Some(verdict) = self.decisions.get(&key, Instant::now()) {
            return Ok(verdict);
        }
        let body = json!({
            "apiVersion": "authorization.k8s.io/v1",
            "kind": "SubjectAccessReview",
            "spec": spec,
        });
        let answer = self.post_with_retries(ACCESS_REVIEWS, &body).await?;
        let verdict = access_verdict(&answer)?;
        let ttl = match verdict {
            AccessVerdict::Allowed => ALLOWED_TTL,
            AccessVerdict::Denied(_) => DENIED_TTL,
        };
        self.decisions
            .put(key, verdict.clone(), ttl, Instant::now());
        Ok(verdict)
    }

    async fn post_with_retries(
        &self,
        path: &str,
        body: &Value,
    ) -> Result<api::Answer, ReviewFailure> {
        let mut wait = RETRY_FIRST;
        let mut tries = 0;
        loop {
            tries += 1;
            let failure = match self.api.post(path, body).await {
                Ok(answer) => match classify(answer.status) {
                    Attempt::Answered => return Ok(answer),
                    Attempt::Forbidden => return Err(ReviewFailure::Forbidden),
                    Attempt::Final => return Err(ReviewFailure::Unavailable(status_text(&answer))),
                    Attempt::Retry => status_text(&answer),
                },
                Err(e) => e.to_string(),
            };
            if tries >= RETRY_TRIES {
                return Err(ReviewFailure::Unavailable(failure));
            }
            // ±20 % jitter, as PKO's backoff.
            let jitter = 0.8 + rand::random::<f64>() * 0.4;
            tokio::time::sleep(wait.mul_f64(jitter)).await;
            wait = wait.mul_f64(1.5);
        }
    }

    /// What the pod's service account needs, as PKO's agent logs it.
    fn delegator_hint(&self) -> String {
        let (ns, sa) = self
            .options
            .pod_service_account
            .clone()
            .unwrap_or_else(|| ("<namespace>".into(), "<service account>".into()));
        format!(
            "the workspace's service account {ns}/{sa} may not create TokenReviews or SubjectAccessReviews: bind it to the ClusterRole system:auth-delegator (kind: ClusterRoleBinding, name: {ns}:{sa}:system:auth-delegator, roleRef ClusterRole system:auth-delegator, subject ServiceAccount {sa} in {ns})"
        )
    }
}

/// How a review call ended, by its HTTP status.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Attempt {
    Answered,
    Forbidden,
    /// Another answer that will not change (400, 401, 404, …).
    Final,
    /// The apiserver may answer next time (429, 5xx).
    Retry,
}

fn classify(status: u16) -> Attempt {
    match status {
        200 | 201 => Attempt::Answered,
        403 => Attempt::Forbidden,
        429 | 500..=599 => Attempt::Retry,
        _ => Attempt::Final,
    }
}

fn status_text(answer: &api::Answer) -> String {
    match answer.body["message"].as_str() {
        Some(m) => format!("HTTP {}: {m}", answer.status),
        None => format!("HTTP {}", answer.status),
    }
}

/// The token of an `authorization: Bearer …` header.
pub fn bearer(header: Option<&str>) -> Result<&str, Status> {
    let refused = || Status::unauthenticated("Request unauthenticated with Bearer");
    let value = header.ok_or_else(refused)?;
    let (scheme, token) = value.split_once(' ').ok_or_else(refused)?;
    let token = token.trim();
    if !scheme.eq_ignore_ascii_case("bearer") || token.is_empty() {
        return Err(refused());
    }
    Ok(token)
}

/// A TokenReview's answer: authenticated only for one of `audiences` (a token of another
/// audience is refused even when the apiserver, asked for none, would accept it).
pub fn token_verdict(answer: &api::Answer, audiences: &[String]) -> TokenVerdict {
    let status = &answer.body["status"];
    if status["authenticated"] != true {
        let reason = status["error"].as_str().unwrap_or_default();
        return TokenVerdict::Refused(reason.to_owned());
    }
    let granted: Vec<&str> = status["audiences"]
        .as_array()
        .map(|a| a.iter().filter_map(Value::as_str).collect())
        .unwrap_or_default();
    if !audiences.iter().any(|a| granted.contains(&a.as_str())) {
        return TokenVerdict::Refused(format!(
            "the token's audiences {granted:?} do not include {audiences:?}"
        ));
    }
    let user = &status["user"];
    let strings = |v: &Value| -> Vec<String> {
        v.as_array()
            .map(|a| {
                a.iter()
                    .filter_map(Value::as_str)
                    .map(str::to_owned)
                    .collect()
            })
            .unwrap_or_default()
    };
    TokenVerdict::Authenticated(User {
        name: user["username"].as_str().unwrap_or_default().to_owned(),
        uid: user["uid"].as_str().unwrap_or_default().to_owned(),
        groups: strings(&user["groups"]),
        extra: user["extra"].as_object().cloned().unwrap_or_default(),
    })
}

/// The SubjectAccessReview spec asking whether `user` may use the workspace's RPC.
pub fn access_review_spec(user: &User, options: &KubeAuthOptions) -> Value {
    json!({
        "user": user.name,
        "uid": user.uid,
        "groups": user.groups,
        "extra": user.extra,
        "resourceAttributes": {
            "namespace": options.workspace_namespace,
            "name": options.workspace_name,
            "group": RPC_GROUP,
            "version": RPC_VERSION,
            "resource": RPC_RESOURCE,
            "subresource": RPC_SUBRESOURCE,
            "verb": RPC_VERB,
        },
    })
}

/// A SubjectAccessReview's answer. An evaluation error with no decision is not a denial the
/// caller could act on: it is reported as unavailable, and not cached.
pub fn access_verdict(answer: &api::Answer) -> Result<AccessVerdict, ReviewFailure> {
    let status = &answer.body["status"];
    if status["allowed"] == true {
        return Ok(AccessVerdict::Allowed);
    }
    let reason = status["reason"].as_str().unwrap_or_default();
    if status["denied"] != true
        && reason.is_empty()
        && let Some(error) = status["evaluationError"].as_str().filter(|e| !e.is_empty())
    {
        return Err(ReviewFailure::Unavailable(error.to_owned()));
    }
    Ok(AccessVerdict::Denied(reason.to_owned()))
}

fn refused_message(reason: &str) -> String {
    if reason.is_empty() {
        "unauthenticated".to_owned()
    } else {
        format!("unauthenticated: {reason}")
    }
}

fn denied_message(user: &str, reason: &str, options: &KubeAuthOptions) -> String {
    let what = format!(
        "{user} may not {RPC_VERB} {RPC_RESOURCE}/{RPC_SUBRESOURCE} of {}/{} ({RPC_GROUP})",
        options.workspace_namespace, options.workspace_name
    );
    if reason.is_empty() {
        format!("forbidden: {what}")
    } else {
        format!("{reason}: {what}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn answer(status: u16, body: Value) -> api::Answer {
        api::Answer { status, body }
    }

    fn options() -> KubeAuthOptions {
        KubeAuthOptions {
            audiences: vec!["ws.ns".into()],
            workspace_namespace: "ns".into(),
            workspace_name: "ws".into(),
            pod_service_account: None,
        }
    }

    #[test]
    fn the_bearer_token_is_required() {
        assert_eq!(bearer(Some("Bearer abc")).ok(), Some("abc"));
        assert_eq!(bearer(Some("bearer  abc ")).ok(), Some("abc"));
        for bad in [None, Some("Basic abc"), Some("Bearer"), Some("Bearer  ")] {
            let status = bearer(bad).expect_err("refused");
            assert_eq!(status.code(), tonic::Code::Unauthenticated);
            assert_eq!(status.message(), "Request unauthenticated with Bearer");
        }
    }

    #[test]
    fn a_token_counts_only_for_the_workspaces_audience() {
        let ok = answer(
            201,
            json!({"status": {"authenticated": true, "audiences": ["ws.ns"],
                "user": {"username": "system:serviceaccount:sys:op", "uid": "u1",
                         "groups": ["system:serviceaccounts"], "extra": {"k": ["v"]}}}}),
        );
        match token_verdict(&ok, &options().audiences) {
            TokenVerdict::Authenticated(user) => {
                assert_eq!(user.name, "system:serviceaccount:sys:op");
                assert_eq!(user.groups, ["system:serviceaccounts"]);
                assert_eq!(user.extra["k"], json!(["v"]));
            }
            other => panic!("{other:?}"),
        }
        let other_audience = answer(
            201,
            json!({"status": {"authenticated": true, "audiences": ["api"], "user": {"username": "x"}}}),
        );
        assert!(matches!(
            token_verdict(&other_audience, &options().audiences),
            TokenVerdict::Refused(r) if r.contains("do not include")
        ));
        let refused = answer(
            201,
            json!({"status": {"authenticated": false, "error": "token audiences invalid"}}),
        );
        assert_eq!(
            token_verdict(&refused, &options().audiences),
            TokenVerdict::Refused("token audiences invalid".into())
        );
    }

    #[test]
    fn the_access_review_asks_pkos_question() {
        let user = User {
            name: "alice".into(),
            uid: "u".into(),
            groups: vec!["g".into()],
            extra: serde_json::Map::new(),
        };
        let spec = access_review_spec(&user, &options());
        assert_eq!(
            spec["resourceAttributes"],
            json!({"namespace": "ns", "name": "ws", "group": "auto.pulumi.com",
                   "version": "v1alpha1", "resource": "workspaces", "subresource": "rpc",
                   "verb": "use"})
        );
        assert_eq!(spec["user"], "alice");
        assert_eq!(spec["groups"], json!(["g"]));
    }

    #[test]
    fn access_answers_and_review_failures_are_told_apart() {
        let allowed = answer(201, json!({"status": {"allowed": true}}));
        assert_eq!(access_verdict(&allowed), Ok(AccessVerdict::Allowed));
        let denied = answer(
            201,
            json!({"status": {"allowed": false, "reason": "no RBAC"}}),
        );
        assert_eq!(
            access_verdict(&denied),
            Ok(AccessVerdict::Denied("no RBAC".into()))
        );
        let silent = answer(201, json!({"status": {"allowed": false}}));
        assert_eq!(
            access_verdict(&silent),
            Ok(AccessVerdict::Denied(String::new()))
        );
        let broken = answer(
            201,
            json!({"status": {"allowed": false, "evaluationError": "webhook down"}}),
        );
        assert_eq!(
            access_verdict(&broken),
            Err(ReviewFailure::Unavailable("webhook down".into()))
        );
        assert_eq!(classify(201), Attempt::Answered);
        assert_eq!(classify(403), Attempt::Forbidden);
        assert_eq!(classify(503), Attempt::Retry);
        assert_eq!(classify(429), Attempt::Retry);
        assert_eq!(classify(401), Attempt::Final);
        let message = denied_message("alice", "", &options());
        assert_eq!(
            message,
            "forbidden: alice may not use workspaces/rpc of ns/ws (auto.pulumi.com)"
        );
    }
}
