//! The admission webhook: AdmissionReview v1 on `POST /validate` and `POST /mutate`.
//!
//! `/validate` evaluates `pko/admission/decision` with the request's tenancy data and turns
//! each violation into what its enforcement action asks for: `deny` refuses the request and
//! lists every denying violation with its field path; `warn` admits it with a warning per
//! violation; `dryrun` admits it and records the violation (metric, log, audit annotation).
//! `/mutate` evaluates `pko/defaults/patch` and returns the JSON Patch.
//!
//! A body that is not an AdmissionReview v1 gets a 400 with the reason. A failed evaluation
//! (timeout, trap, tenancy lookup) is logged, counted and answered according to the
//! configured failure policy; the server keeps serving either way.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Instant;

use axum::Router;
use axum::body::Bytes;
use axum::extract::{DefaultBodyLimit, State};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use http::StatusCode;
use kube::core::admission::{AdmissionRequest, AdmissionResponse, AdmissionReview};
use kube::core::response::{StatusCause, StatusDetails};
use kube::core::{DynamicObject, Status};
use pko_api::tenancy::EnforcementAction;
use serde::{Deserialize, Serialize};
use serde_json::Value;
use tracing::{error, info, warn};

use crate::bundle::{DECISION_ENTRYPOINT, DEFAULTS_ENTRYPOINT};
use crate::engine::{EngineError, PolicyEngine};
use crate::metrics::{AdmissionMetrics, EntrypointLabels, ErrorLabels, ViolationLabels};
use crate::tenancy::{Tenancy, TenancyError};

/// An AdmissionReview carries an object and its old version; etcd caps objects at 1.5 MiB.
pub const MAX_REVIEW_BYTES: usize = 8 * 1024 * 1024;
/// Warnings longer than this are cut by the apiserver; keep them readable.
const MAX_WARNING_CHARS: usize = 250;

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
}

impl WebhookError {
    fn kind(&self) -> &'static str {
        match self {
            WebhookError::Engine(e) => e.kind(),
            WebhookError::Tenancy(_) => "tenancy",
            WebhookError::Output { .. } => "output",
            WebhookError::InvalidReview(_) => "invalid",
        }
    }
}

/// What to answer when a policy cannot be evaluated.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum FailurePolicy {
    /// Refuse the request (isolation must not silently lapse).
    #[default]
    Fail,
    /// Admit the request with a warning.
    Ignore,
}

impl std::str::FromStr for FailurePolicy {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "Fail" | "fail" => Ok(FailurePolicy::Fail),
            "Ignore" | "ignore" => Ok(FailurePolicy::Ignore),
            other => Err(format!("unknown failure policy {other:?} (Fail or Ignore)")),
        }
    }
}

/// The decision document of `pko/admission/decision`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Decision {
    pub allowed: bool,
    #[serde(default)]
    pub violations: Vec<Violation>,
}

/// One violation, as the policies report it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Violation {
    /// `restricted` or `isolation`.
    pub policy: String,
    /// The rule.
    pub code: String,
    /// Field path in the object, e.g. `spec.podTemplate.spec.containers[0].image`.
    pub path: String,
    pub message: String,
    pub action: EnforcementAction,
    /// The TenancyPolicy whose allowance list made the violation.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tenancy_policy: Option<String>,
}

impl Violation {
    fn line(&self) -> String {
        format!(
            "{}: {} [{}/{}]",
            self.path, self.message, self.policy, self.code
        )
    }
}

/// Everything a webhook call needs.
pub struct Admission {
    engine: Arc<PolicyEngine>,
    tenancy: Tenancy,
    metrics: AdmissionMetrics,
    failure_policy: FailurePolicy,
}

impl Admission {
    pub fn new(
        engine: Arc<PolicyEngine>,
        tenancy: Tenancy,
        metrics: AdmissionMetrics,
        failure_policy: FailurePolicy,
    ) -> Self {
        Self {
            engine,
            tenancy,
            metrics,
            failure_policy,
        }
    }

    /// The tenancy data `/validate` evaluates a request in `namespace` with.
    pub async fn data_for(&self, namespace: &str) -> Result<Value, TenancyError> {
        self.tenancy
            .data_for(self.engine.bundle_data(), namespace)
            .await
    }

    /// The decision for a parsed review (`input` is the review exactly as received).
    pub async fn decide(
        &self,
        input: &Value,
        request: &AdmissionRequest<DynamicObject>,
    ) -> Result<Decision, WebhookError> {
        let namespace = request.namespace.as_deref().unwrap_or_default();
        let data = self.data_for(namespace).await?;
        let value = self
            .timed(DECISION_ENTRYPOINT, input, &data)
            .await
            .map_err(WebhookError::Engine)?;
        serde_json::from_value(value).map_err(|e| WebhookError::Output {
            what: "decision",
            reason: e.to_string(),
        })
    }

    /// The JSON Patch of defaults for a parsed review.
    pub async fn defaults(&self, input: &Value) -> Result<Value, WebhookError> {
        let value = self
            .timed(DEFAULTS_ENTRYPOINT, input, self.engine.bundle_data())
            .await?;
        if value.is_array() {
            Ok(value)
        } else {
            Err(WebhookError::Output {
                what: "patch",
                reason: format!("expected a JSON Patch array, got {value}"),
            })
        }
    }

    async fn timed(
        &self,
        entrypoint: &str,
        input: &Value,
        data: &Value,
    ) -> Result<Value, EngineError> {
        let started = Instant::now();
        let result = self.engine.evaluate(entrypoint, input, data).await;
        self.metrics
            .evaluation_duration
            .get_or_create(&EntrypointLabels {
                entrypoint: entrypoint.to_owned(),
            })
            .observe(started.elapsed().as_secs_f64());
        result
    }

    /// The answer of `/validate`.
    pub async fn validate(
        &self,
        input: &Value,
        request: &AdmissionRequest<DynamicObject>,
    ) -> AdmissionResponse {
        match self.decide(input, request).await {
            Ok(decision) => self.enforce(request, decision),
            Err(err) => self.failed("validate", DECISION_ENTRYPOINT, request, &err),
        }
    }

    /// The answer of `/mutate`.
    pub async fn mutate(
        &self,
        input: &Value,
        request: &AdmissionRequest<DynamicObject>,
    ) -> AdmissionResponse {
        let patch = match self.defaults(input).await {
            Ok(patch) => patch,
            Err(err) => return self.failed("mutate", DEFAULTS_ENTRYPOINT, request, &err),
        };
        let response = AdmissionResponse::from(request);
        if patch.as_array().is_some_and(|ops| ops.is_empty()) {
            self.metrics.decision("mutate", "allowed");
            return response;
        }
        let parsed = serde_json::from_value::<json_patch::Patch>(patch)
            .map_err(|e| WebhookError::Output {
                what: "patch",
                reason: e.to_string(),
            })
            .and_then(|patch| {
                response
                    .clone()
                    .with_patch(patch)
                    .map_err(|e| WebhookError::Output {
                        what: "patch",
                        reason: e.to_string(),
                    })
            });
        match parsed {
            Ok(patched) => {
                self.metrics.decision("mutate", "patched");
                patched
            }
            Err(err) => self.failed("mutate", DEFAULTS_ENTRYPOINT, request, &err),
        }
    }

    fn enforce(
        &self,
        request: &AdmissionRequest<DynamicObject>,
        decision: Decision,
    ) -> AdmissionResponse {
        let mut response = AdmissionResponse::from(request);
        let object = object_name(request);
        let mut denied = Vec::new();
        let mut warnings = Vec::new();
        let mut recorded = Vec::new();
        for violation in &decision.violations {
            self.metrics
                .violations
                .get_or_create(&ViolationLabels {
                    policy: violation.policy.clone(),
                    code: violation.code.clone(),
                    action: violation.action.as_str().to_owned(),
                })
                .inc();
            match violation.action {
                EnforcementAction::Deny => denied.push(violation),
                EnforcementAction::Warn => {
                    warnings.push(truncate(&format!("pko-rs policy: {}", violation.line())))
                }
                EnforcementAction::Dryrun => {
                    info!(
                        object = %object,
                        policy = %violation.policy,
                        code = %violation.code,
                        path = %violation.path,
                        tenancy_policy = violation.tenancy_policy.as_deref().unwrap_or_default(),
                        message = %violation.message,
                        "dryrun violation (admitted)"
                    );
                    recorded.push(violation);
                }
            }
        }
        if !recorded.is_empty() {
            let value = serde_json::to_string(&recorded).unwrap_or_default();
            response.audit_annotations = HashMap::from([("dryrun-violations".to_owned(), value)]);
        }
        if !warnings.is_empty() {
            response.warnings = Some(warnings);
        }
        if decision.allowed && denied.is_empty() {
            let result = if response.warnings.is_some() {
                "warned"
            } else {
                "allowed"
            };
            self.metrics.decision("validate", result);
            return response;
        }
        let message = denial_message(&object, &denied);
        info!(object = %object, violations = denied.len(), "denied: {message}");
        self.metrics.decision("validate", "denied");
        let causes = denied
            .iter()
            .map(|v| StatusCause {
                reason: format!("{}/{}", v.policy, v.code),
                message: v.message.clone(),
                field: v.path.clone(),
            })
            .collect();
        let mut status = Status::failure(&message, "Forbidden").with_code(403);
        status = status.with_details(StatusDetails {
            name: request.name.clone(),
            group: request.kind.group.clone(),
            kind: request.kind.kind.clone(),
            uid: String::new(),
            causes,
            retry_after_seconds: 0,
        });
        response.allowed = false;
        response.result = status;
        response
    }

    fn failed(
        &self,
        webhook: &str,
        entrypoint: &str,
        request: &AdmissionRequest<DynamicObject>,
        err: &WebhookError,
    ) -> AdmissionResponse {
        let object = object_name(request);
        self.metrics
            .evaluation_errors
            .get_or_create(&ErrorLabels {
                entrypoint: entrypoint.to_owned(),
                error: err.kind().to_owned(),
            })
            .inc();
        let response = AdmissionResponse::from(request);
        match self.failure_policy {
            FailurePolicy::Fail => {
                error!(webhook, object = %object, error = %err, "policy evaluation failed; refusing (failure policy Fail)");
                self.metrics.decision(webhook, "error_denied");
                let mut response = response;
                response.allowed = false;
                response.result = Status::failure(
                    &format!(
                        "pko-rs could not evaluate its admission policies ({err}); the request is refused (failure policy Fail)"
                    ),
                    "InternalError",
                )
                .with_code(500);
                response
            }
            FailurePolicy::Ignore => {
                warn!(webhook, object = %object, error = %err, "policy evaluation failed; admitting (failure policy Ignore)");
                self.metrics.decision(webhook, "error_allowed");
                let mut response = response;
                response.warnings = Some(vec![truncate(&format!(
                    "pko-rs could not evaluate its admission policies and admitted the request (failure policy Ignore): {err}"
                ))]);
                response
            }
        }
    }
}

/// `Kind namespace/name` for logs and messages.
fn object_name(request: &AdmissionRequest<DynamicObject>) -> String {
    let name = if request.name.is_empty() {
        request
            .object
            .as_ref()
            .and_then(|o| o.metadata.generate_name.clone())
            .map(|g| format!("{g}*"))
            .unwrap_or_default()
    } else {
        request.name.clone()
    };
    match request.namespace.as_deref() {
        Some(ns) if !ns.is_empty() => format!("{} {ns}/{name}", request.kind.kind),
        _ => format!("{} {name}", request.kind.kind),
    }
}

/// Every denying violation, one per line, each with its field path.
fn denial_message(object: &str, denied: &[&Violation]) -> String {
    if denied.is_empty() {
        return format!("{object} is refused by the pko-rs admission policies");
    }
    let lines: Vec<String> = denied.iter().map(|v| format!("- {}", v.line())).collect();
    format!(
        "{object} violates {} pko-rs admission polic{}:\n{}",
        denied.len(),
        if denied.len() == 1 {
            "y rule"
        } else {
            "y rules"
        },
        lines.join("\n")
    )
}

fn truncate(s: &str) -> String {
    if s.chars().count() <= MAX_WARNING_CHARS {
        return s.to_owned();
    }
    let mut out: String = s.chars().take(MAX_WARNING_CHARS - 1).collect();
    out.push('…');
    out
}

/// Parses a webhook body: the raw JSON (the policies' input) and the typed request.
pub fn parse_review(body: &[u8]) -> Result<(Value, AdmissionRequest<DynamicObject>), WebhookError> {
    let mut input: Value = serde_json::from_slice(body)
        .map_err(|e| WebhookError::InvalidReview(format!("the body is not JSON: {e}")))?;
    let api_version = input.get("apiVersion").and_then(Value::as_str);
    let kind = input.get("kind").and_then(Value::as_str);
    if kind != Some("AdmissionReview") || api_version != Some("admission.k8s.io/v1") {
        return Err(WebhookError::InvalidReview(format!(
            "expected an admission.k8s.io/v1 AdmissionReview, got apiVersion {:?} kind {:?}",
            api_version.unwrap_or_default(),
            kind.unwrap_or_default()
        )));
    }
    let review: AdmissionReview<DynamicObject> = serde_json::from_value(input.clone())
        .map_err(|e| WebhookError::InvalidReview(format!("malformed AdmissionReview: {e}")))?;
    let request: AdmissionRequest<DynamicObject> = review
        .try_into()
        .map_err(|_| WebhookError::InvalidReview("the AdmissionReview has no request".into()))?;
    if request.uid.is_empty() {
        return Err(WebhookError::InvalidReview(
            "the AdmissionReview request has no uid".into(),
        ));
    }
    // The policies judge fetched URLs by what the fetcher will parse, never by their spelling.
    crate::urls::annotate(&mut input);
    Ok((input, request))
}

/// `POST /validate` and `POST /mutate`.
pub fn router(admission: Arc<Admission>) -> Router {
    Router::new()
        .route("/validate", post(validate))
        .route("/mutate", post(mutate))
        .layer(DefaultBodyLimit::max(MAX_REVIEW_BYTES))
        .with_state(admission)
}

async fn validate(State(admission): State<Arc<Admission>>, body: Bytes) -> Response {
    match parse_review(&body) {
        Ok((input, request)) => {
            let response = admission.validate(&input, &request).await;
            axum::Json(response.into_review()).into_response()
        }
        Err(e) => invalid(&admission, "validate", e),
    }
}

async fn mutate(State(admission): State<Arc<Admission>>, body: Bytes) -> Response {
    match parse_review(&body) {
        Ok((input, request)) => {
            let response = admission.mutate(&input, &request).await;
            axum::Json(response.into_review()).into_response()
        }
        Err(e) => invalid(&admission, "mutate", e),
    }
}

fn invalid(admission: &Admission, webhook: &str, e: WebhookError) -> Response {
    admission.metrics.decision(webhook, "invalid");
    warn!(webhook, error = %e, "malformed AdmissionReview");
    (StatusCode::BAD_REQUEST, format!("{e}\n")).into_response()
}
