//! The admission webhook: AdmissionReview v1 on `POST /validate` and `POST /mutate`.
//!
//! `/validate` evaluates `pko/admission/decision` with the request's tenancy data and turns
//! each violation into what its enforcement action asks for: `deny` refuses the request and
//! lists every denying violation with its field path; `warn` admits it with a warning per
//! violation; `dryrun` admits it and records the violation (metric, log, audit annotation).
//! `/mutate` evaluates `pko/defaults/patch` and returns the JSON Patch. `/namespaces` answers
//! namespace DELETEs with the namespace guard (see [`crate::namespaces`]).
//!
//! A body that is not an AdmissionReview v1 gets a 400 with the reason. A failed evaluation
//! (timeout, trap, tenancy lookup) is logged, counted and answered according to the
//! configured failure policy; the server keeps serving either way.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::sync::Semaphore;

use axum::Router;
use axum::extract::{DefaultBodyLimit, State};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use http::StatusCode;
use http_body_util::BodyExt;
use kube::core::Status;
use kube::core::admission::AdmissionResponse;
use kube::core::response::{StatusCause, StatusDetails};
use pko_api::tenancy::EnforcementAction;
use serde::{Deserialize, Serialize};
use serde_json::Value;
use tracing::{error, info, warn};

use crate::bundle::{DECISION_ENTRYPOINT, DEFAULTS_ENTRYPOINT};
use crate::engine::{EngineError, PolicyData, PolicyEngine, Slot};
use crate::metrics::{
    AdmissionMetrics, EntrypointLabels, ErrorLabels, ProtocolLabels, ViolationLabels,
};
use crate::namespaces::{NamespaceGuard, Verdict};
use crate::tenancy::{Coverage, Tenancy, TenancyError};

pub use crate::errors::WebhookError;
pub use crate::review::{
    MetaHead, ObjectHead, RequestHead, Review, json_values_upper_bound, parse_review,
    parse_review_bounded,
};

/// Warnings longer than this (256 characters) are cut by the apiserver; keep them readable.
const MAX_WARNING_BYTES: usize = 250;

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

/// Bounds on request bodies, taken before anything is parsed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ReviewLimits {
    /// Largest body accepted (413 above).
    pub max_body_bytes: usize,
    /// Bytes of bodies being read or parsed at once, across connections (429 above).
    pub body_budget_bytes: usize,
    /// JSON values (objects, arrays, scalars, keys) a body may hold (413 above): bounds the
    /// parsed tree, whatever the body's shape.
    pub max_json_values: usize,
    /// Time the whole body may take to arrive (408 above).
    pub body_timeout: Duration,
    /// Slowest rate a body may arrive at after [`BODY_RATE_GRACE`] (408 below): a client
    /// trickling a body holds a connection and a handler for no more than its bytes buy.
    pub min_body_bytes_per_sec: usize,
}

/// Time a body may take before its rate is checked (a slow start is not a slow body).
pub const BODY_RATE_GRACE: Duration = Duration::from_secs(1);

impl ReviewLimits {
    /// The apiserver accepts request bodies of up to 3 MiB and etcd stores objects of up to
    /// 1.5 MiB: a review carries the new object and the stored old one, plus a few KiB of
    /// request metadata. 6 MiB leaves room for both with margin; nothing legitimate is larger.
    pub const DEFAULT: ReviewLimits = ReviewLimits {
        max_body_bytes: 6 << 20,
        body_budget_bytes: 24 << 20,
        max_json_values: 250_000,
        // The apiserver sends a review at once and waits 10 s by default for the answer.
        body_timeout: Duration::from_secs(10),
        min_body_bytes_per_sec: 64 << 10,
    };

    /// Memory one parsed body may take: the bytes, the value tree (at most ~100 bytes per
    /// value with its map entry), and the serialised copy handed to the wasm instance.
    pub fn parsed_bytes(&self) -> usize {
        self.max_body_bytes
            .saturating_mul(2)
            .saturating_add(self.max_json_values.saturating_mul(100))
    }
}

impl Default for ReviewLimits {
    fn default() -> Self {
        Self::DEFAULT
    }
}

/// A policy's value when it was evaluated in the same trip as the parse.
type Early = Option<Result<Value, EngineError>>;

/// Everything a webhook call needs.
pub struct Admission {
    engine: PolicyEngine,
    tenancy: Tenancy,
    metrics: AdmissionMetrics,
    failure_policy: FailurePolicy,
    limits: ReviewLimits,
    /// Body bytes in flight, in KiB units.
    body_budget: Arc<Semaphore>,
    /// The shared data document, rebuilt after the tenancy stores change.
    prepared: std::sync::Mutex<Option<Arc<Prepared>>>,
    /// Answers `/namespaces`; without one, every namespace DELETE is allowed.
    namespaces: Option<NamespaceGuard>,
}

/// The shared data document as of a count of tenancy changes.
struct Prepared {
    changes: u64,
    data: Arc<PolicyData>,
    coverage: Coverage,
}

/// The data document a request is evaluated with.
#[derive(Clone, Debug)]
pub enum RequestData {
    /// The shared document (pooled instances hold it).
    Shared(Arc<PolicyData>),
    /// A document of this request's own (a namespace the watch has not seen yet).
    Own(Arc<Value>),
}

impl Admission {
    pub fn new(
        engine: PolicyEngine,
        tenancy: Tenancy,
        metrics: AdmissionMetrics,
        failure_policy: FailurePolicy,
    ) -> Self {
        Self::with_limits(
            engine,
            tenancy,
            metrics,
            failure_policy,
            ReviewLimits::DEFAULT,
        )
    }

    pub fn with_limits(
        engine: PolicyEngine,
        tenancy: Tenancy,
        metrics: AdmissionMetrics,
        failure_policy: FailurePolicy,
        limits: ReviewLimits,
    ) -> Self {
        let units = kib(limits.body_budget_bytes.max(limits.max_body_bytes));
        Self {
            engine,
            tenancy,
            metrics,
            failure_policy,
            limits,
            body_budget: Arc::new(Semaphore::new(units as usize)),
            prepared: std::sync::Mutex::new(None),
            namespaces: None,
        }
    }

    /// With the namespace deletion guard on `/namespaces`.
    pub fn with_namespace_guard(mut self, guard: NamespaceGuard) -> Self {
        self.namespaces = Some(guard);
        self
    }

    pub fn engine(&self) -> &PolicyEngine {
        &self.engine
    }

    /// The tenancy data `/validate` evaluates a request in `namespace` with: the shared
    /// document when it is exact for the namespace, else one built for this request.
    pub async fn data_for(&self, namespace: &str) -> Result<RequestData, TenancyError> {
        let prepared = self.prepared();
        if prepared.coverage.covers(namespace) {
            return Ok(RequestData::Shared(prepared.data.clone()));
        }
        let own = self
            .tenancy
            .data_for(self.engine.bundle_data(), namespace)
            .await?;
        Ok(RequestData::Own(Arc::new(own)))
    }

    /// The shared data document, rebuilt first if the tenancy stores changed since it was
    /// built. An unchanged document keeps its version, so pooled instances stay loaded.
    fn prepared(&self) -> Arc<Prepared> {
        // Read before the stores: the document then holds at least every counted change.
        let changes = self.tenancy.changes();
        let mut current = self
            .prepared
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if let Some(prepared) = current.as_ref()
            && prepared.changes == changes
        {
            return prepared.clone();
        }
        let document = self.tenancy.shared_document(self.engine.bundle_data());
        let data = match current.as_ref() {
            Some(old) if old.data.value() == &document.value => old.data.clone(),
            _ => PolicyData::new(document.value),
        };
        let prepared = Arc::new(Prepared {
            changes,
            data,
            coverage: document.coverage,
        });
        *current = Some(prepared.clone());
        prepared
    }

    /// Evaluates `entrypoint` in `slot`, recording the evaluation's time (in its thread) and
    /// the hop to that thread and back.
    async fn timed(
        &self,
        slot: &Slot,
        webhook: &'static str,
        entrypoint: &'static str,
        input: Arc<Value>,
        data: RequestData,
    ) -> Result<Value, EngineError> {
        let started = Instant::now();
        let result = slot
            .run(move |evaluator| {
                let began = Instant::now();
                let result = match &data {
                    RequestData::Shared(data) => evaluator.evaluate(entrypoint, &input, data),
                    RequestData::Own(data) => evaluator.evaluate_once(entrypoint, &input, data),
                };
                (result, began.elapsed())
            })
            .await;
        let took = started.elapsed();
        self.metrics
            .evaluation_duration
            .get_or_create(&EntrypointLabels {
                entrypoint: entrypoint.to_owned(),
            })
            .observe(took.as_secs_f64());
        match result {
            Ok((result, in_thread)) => {
                self.metrics.phase(webhook, "eval", in_thread);
                self.metrics
                    .phase(webhook, "hop", took.saturating_sub(in_thread));
                result
            }
            Err(e) => Err(e),
        }
    }

    /// The decision for a parsed review, in a slot of its own.
    pub async fn decision(&self, review: &Review) -> Result<Decision, WebhookError> {
        let slot = self.engine.slot(Instant::now()).await?;
        self.decide(&slot, review, None).await
    }

    /// The decision for a parsed review: `early` when it was evaluated with the parse,
    /// else evaluated now.
    async fn decide(
        &self,
        slot: &Slot,
        review: &Review,
        early: Early,
    ) -> Result<Decision, WebhookError> {
        let value = match early {
            Some(result) => result?,
            None => {
                let namespace = review.request.namespace.as_deref().unwrap_or_default();
                let began = Instant::now();
                let data = self.data_for(namespace).await?;
                self.metrics.phase("validate", "data", began.elapsed());
                self.timed(
                    slot,
                    "validate",
                    DECISION_ENTRYPOINT,
                    review.input.clone(),
                    data,
                )
                .await?
            }
        };
        serde_json::from_value(value).map_err(|e| WebhookError::Output {
            what: "decision",
            reason: e.to_string(),
        })
    }

    /// The JSON Patch of defaults for a parsed review: `early` when it was evaluated with
    /// the parse, else evaluated now.
    async fn defaults(
        &self,
        slot: &Slot,
        review: &Review,
        early: Early,
    ) -> Result<Value, WebhookError> {
        let value = match early {
            Some(result) => result?,
            None => {
                // The defaults read no tenancy data: the shared document serves every
                // namespace, and the instances that hold it serve both webhooks.
                let data = RequestData::Shared(self.prepared().data.clone());
                self.timed(
                    slot,
                    "mutate",
                    DEFAULTS_ENTRYPOINT,
                    review.input.clone(),
                    data,
                )
                .await?
            }
        };
        if value.is_array() {
            Ok(value)
        } else {
            Err(WebhookError::Output {
                what: "patch",
                reason: format!("expected a JSON Patch array, got {value}"),
            })
        }
    }

    /// The answer of `/validate`.
    async fn validate(&self, slot: &Slot, review: &Review, early: Early) -> AdmissionResponse {
        match self.decide(slot, review, early).await {
            Ok(decision) => self.enforce(&review.request, decision),
            Err(err) => self.failed("validate", DECISION_ENTRYPOINT, &review.request, &err),
        }
    }

    /// The answer of `/mutate`.
    async fn mutate(&self, slot: &Slot, review: &Review, early: Early) -> AdmissionResponse {
        let request = &review.request;
        let patch = match self.defaults(slot, review, early).await {
            Ok(patch) => patch,
            Err(err) => return self.failed("mutate", DEFAULTS_ENTRYPOINT, request, &err),
        };
        let response = request.response();
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

    /// One webhook call, from the raw HTTP request to the answer. The order bounds memory:
    /// the declared size is checked, the body is read with a cap, a deadline and a minimum
    /// rate, each chunk charged to a shared budget as it arrives (a declared length reserves
    /// nothing: a slow client holds only what it sent), and only once an evaluation slot is
    /// taken is the body parsed (once, on the blocking pool) and evaluated.
    async fn handle(&self, webhook: &'static str, request: axum::extract::Request) -> Response {
        let started = Instant::now();
        self.metrics
            .requests
            .get_or_create(&ProtocolLabels {
                version: format!("{:?}", request.version()),
            })
            .inc();
        let max = self.limits.max_body_bytes;
        let declared = request
            .headers()
            .get(http::header::CONTENT_LENGTH)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.trim().parse::<u64>().ok());
        if let Some(length) = declared
            && length > max as u64
        {
            return self.refuse(
                webhook,
                Refusal::TooLarge {
                    length: Some(length),
                    max,
                },
            );
        }
        let (body, _reservation) = match self.body(webhook, request).await {
            Ok(read) => read,
            Err(answer) => return *answer,
        };
        self.metrics.phase(webhook, "read", started.elapsed());
        let waited = Instant::now();
        let slot = match self.engine.slot(started).await {
            Ok(slot) => slot,
            Err(e) => return self.refuse(webhook, Refusal::Engine(e)),
        };
        self.metrics.phase(webhook, "slot", waited.elapsed());
        let (parsed, early) = self.parse_and_evaluate(webhook, &slot, body).await;
        drop(_reservation);
        let review = match parsed {
            Ok(review) => review,
            Err(WebhookError::TooManyValues { max }) => {
                return self.refuse(webhook, Refusal::TooManyValues { max });
            }
            Err(err @ WebhookError::TooDeep { .. }) => {
                return axum::Json(self.too_deep(webhook, &err).into_review()).into_response();
            }
            // The parse ran out of the slot's time (a loaded machine, a slow body): the
            // caller's review may be fine, so it is a refusal to retry, not a malformed body.
            Err(WebhookError::Engine(e)) => return self.refuse(webhook, Refusal::Engine(e)),
            Err(e) => return invalid(&self.metrics, webhook, e),
        };
        // Checked before anything reads the namespace's labels from the apiserver.
        if let Some(reason) = review.request.namespace_problem() {
            self.metrics.decision(webhook, "denied");
            warn!(webhook, "{reason}");
            let mut response = AdmissionResponse::invalid(reason);
            response.uid = review.request.uid.clone();
            return axum::Json(response.into_review()).into_response();
        }
        let response = if webhook == "validate" {
            self.validate(&slot, &review, early).await
        } else {
            self.mutate(&slot, &review, early).await
        };
        let began = Instant::now();
        let answer = axum::Json(response.into_review()).into_response();
        self.metrics.phase(webhook, "respond", began.elapsed());
        self.metrics.phase(webhook, "total", started.elapsed());
        answer
    }

    /// The request's body, read with the limits and charged to the budget; or the answer
    /// that refuses it.
    async fn body(
        &self,
        webhook: &str,
        request: axum::extract::Request,
    ) -> Result<(bytes::Bytes, Reserved), Box<Response>> {
        read_body(
            &self.limits,
            &self.body_budget,
            &self.metrics,
            request.into_body(),
        )
        .await
        .map_err(|e| {
            Box::new(match e {
                BodyError::Refused(refusal) => self.refuse(webhook, refusal),
                BodyError::Read(e) => invalid(
                    &self.metrics,
                    webhook,
                    WebhookError::InvalidReview(format!("cannot read the body: {e}")),
                ),
            })
        })
    }

    /// One `/namespaces` call: the body read with the same limits as the policies' webhooks,
    /// then a namespace DELETE answered by the guard. Anything else is allowed: the guard
    /// decides nothing but namespace deletions.
    async fn handle_namespaces(&self, request: axum::extract::Request) -> Response {
        const WEBHOOK: &str = "namespaces";
        let started = Instant::now();
        let (body, reservation) = match self.body(WEBHOOK, request).await {
            Ok(read) => read,
            Err(answer) => return *answer,
        };
        let max_values = self.limits.max_json_values;
        let parsed =
            tokio::task::spawn_blocking(move || parse_review_bounded(&body, max_values)).await;
        drop(reservation);
        let request = match parsed {
            Ok(Ok(review)) => review.request,
            Ok(Err(WebhookError::TooManyValues { max })) => {
                return self.refuse(WEBHOOK, Refusal::TooManyValues { max });
            }
            Ok(Err(WebhookError::TooDeep { request, .. })) => *request,
            Ok(Err(e)) => return invalid(&self.metrics, WEBHOOK, e),
            Err(e) => {
                return invalid(
                    &self.metrics,
                    WEBHOOK,
                    WebhookError::InvalidReview(format!("the parse did not finish: {e}")),
                );
            }
        };
        let response = self.namespace_answer(&request).await;
        self.metrics.phase(WEBHOOK, "total", started.elapsed());
        axum::Json(response.into_review()).into_response()
    }

    async fn namespace_answer(&self, request: &RequestHead) -> AdmissionResponse {
        const WEBHOOK: &str = "namespaces";
        let response = request.response();
        let deleting_a_namespace = request.operation == "DELETE"
            && request.kind.group.is_empty()
            && request.kind.kind == "Namespace";
        let Some(guard) = self.namespaces.as_ref().filter(|_| deleting_a_namespace) else {
            self.metrics.decision(WEBHOOK, "allowed");
            return response;
        };
        let message = match guard.check(&request.name).await {
            Ok(Verdict::Allow) => {
                self.metrics.decision(WEBHOOK, "allowed");
                return response;
            }
            Ok(Verdict::Refuse(message)) => {
                self.metrics.decision(WEBHOOK, "denied");
                info!(namespace = %request.name, "namespace deletion refused: {message}");
                message
            }
            // Unchecked is refused: a retry costs a moment, a namespace deleted under its
            // stacks costs their resources.
            Err(e) => {
                self.metrics.decision(WEBHOOK, "error");
                warn!(namespace = %request.name, error = %e, "namespace deletion not checked");
                format!("pko-rs could not check the namespace's Stacks before its deletion: {e}")
            }
        };
        let mut response = response;
        response.allowed = false;
        response.result = Status::failure(&message, "Forbidden").with_code(403);
        response
    }

    /// Parses the review and, when the shared document serves it, evaluates the webhook's
    /// policy in the same trip to the evaluation thread.
    async fn parse_and_evaluate(
        &self,
        webhook: &'static str,
        slot: &Slot,
        body: bytes::Bytes,
    ) -> (Result<Review, WebhookError>, Early) {
        let max_values = self.limits.max_json_values;
        // The shared document is taken before the trip to the evaluation thread: when it
        // covers the review's namespace (the usual case; the defaults read no tenancy data),
        // the review is parsed and evaluated in one trip. Each trip is a thread wake-up on
        // the way there and one back, which on a busy machine costs more than the work.
        let began = Instant::now();
        let shared = self.prepared();
        self.metrics.phase(webhook, "data", began.elapsed());
        let hop = Instant::now();
        let trip = slot
            .run(move |evaluator| {
                let began = Instant::now();
                let parsed = parse_review_bounded(&body, max_values);
                let parse = began.elapsed();
                let entrypoint = match (&parsed, webhook) {
                    (Ok(_), "mutate") => Some(DEFAULTS_ENTRYPOINT),
                    (Ok(review), _)
                        if shared
                            .coverage
                            .covers(review.request.namespace.as_deref().unwrap_or_default()) =>
                    {
                        Some(DECISION_ENTRYPOINT)
                    }
                    _ => None,
                };
                let early = match (&parsed, entrypoint) {
                    (Ok(review), Some(entrypoint)) => {
                        let began = Instant::now();
                        let value = evaluator.evaluate(entrypoint, &review.input, &shared.data);
                        Some((entrypoint, value, began.elapsed()))
                    }
                    _ => None,
                };
                (parsed, parse, early, began.elapsed())
            })
            .await;
        match trip {
            Ok((parsed, parse, early, in_thread)) => {
                self.metrics.phase(webhook, "parse", parse);
                self.metrics
                    .phase(webhook, "hop", hop.elapsed().saturating_sub(in_thread));
                let early = early.map(|(entrypoint, value, took)| {
                    self.metrics.phase(webhook, "eval", took);
                    self.metrics
                        .evaluation_duration
                        .get_or_create(&EntrypointLabels {
                            entrypoint: entrypoint.to_owned(),
                        })
                        .observe(took.as_secs_f64());
                    value
                });
                (parsed, early)
            }
            Err(e) => (Err(WebhookError::Engine(e)), None),
        }
    }

    /// An answer over a limit: a status code and one line saying which limit.
    fn refuse(&self, webhook: &str, refusal: Refusal) -> Response {
        let (status, reason) = (refusal.status(), refusal.reason());
        self.metrics.refused(reason);
        self.metrics.decision(webhook, "refused");
        warn!(webhook, status = status.as_u16(), "{refusal}");
        let mut response = (status, format!("{refusal}\n")).into_response();
        if status != StatusCode::PAYLOAD_TOO_LARGE {
            response.headers_mut().insert(
                http::header::RETRY_AFTER,
                http::HeaderValue::from_static("1"),
            );
        }
        response
    }

    fn enforce(&self, request: &RequestHead, decision: Decision) -> AdmissionResponse {
        let mut response = request.response();
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

    /// A denial of a review nested past [`crate::review::MAX_REVIEW_DEPTH`].
    fn too_deep(&self, webhook: &str, err: &WebhookError) -> AdmissionResponse {
        let WebhookError::TooDeep { request, .. } = err else {
            return AdmissionResponse::invalid(err.to_string());
        };
        let object = object_name(request);
        info!(webhook, object = %object, "denied: {err}");
        self.metrics.decision(webhook, "denied");
        let mut response = request.response();
        response.allowed = false;
        response.result =
            Status::failure(&format!("pko-rs: {object}: {err}"), "Forbidden").with_code(403);
        response
    }

    fn failed(
        &self,
        webhook: &str,
        entrypoint: &str,
        request: &RequestHead,
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
        let response = request.response();
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
fn object_name(request: &RequestHead) -> String {
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
    pko_api::text::truncate(s, MAX_WARNING_BYTES)
}

/// Why a request was refused before evaluation.
#[derive(Debug, thiserror::Error)]
enum Refusal {
    #[error("{}the limit is {max} bytes", match length { Some(l) => format!("the body is {l} bytes; "), None => "the body is too large; ".to_owned() })]
    TooLarge { length: Option<u64>, max: usize },
    #[error("the body holds more than {max} JSON values")]
    TooManyValues { max: usize },
    #[error("too many review bytes are being read at once (budget {budget} bytes); try again")]
    BodyBudget { budget: usize },
    #[error(
        "the body arrived too slowly ({received} bytes so far; it must arrive within {timeout:?} and at {min_rate} bytes/s or more)"
    )]
    SlowBody {
        received: usize,
        timeout: Duration,
        min_rate: usize,
    },
    #[error("{0}")]
    Engine(EngineError),
}

impl Refusal {
    fn status(&self) -> StatusCode {
        match self {
            Refusal::TooLarge { .. } | Refusal::TooManyValues { .. } => {
                StatusCode::PAYLOAD_TOO_LARGE
            }
            Refusal::BodyBudget { .. } | Refusal::Engine(EngineError::Busy { .. }) => {
                StatusCode::TOO_MANY_REQUESTS
            }
            Refusal::SlowBody { .. } => StatusCode::REQUEST_TIMEOUT,
            Refusal::Engine(_) => StatusCode::SERVICE_UNAVAILABLE,
        }
    }

    /// The `reason` label of the refused counter (a fixed set).
    fn reason(&self) -> &'static str {
        match self {
            Refusal::TooLarge { .. } => "body_too_large",
            Refusal::TooManyValues { .. } => "too_many_values",
            Refusal::BodyBudget { .. } => "body_budget",
            Refusal::SlowBody { .. } => "slow_body",
            Refusal::Engine(e) => e.kind(),
        }
    }
}

/// `POST /validate`, `POST /mutate` and `POST /namespaces`. Body limits are the handler's own (see
/// [`ReviewLimits`]), so axum's default limit is off.
pub fn router(admission: Arc<Admission>) -> Router {
    Router::new()
        .route("/validate", post(validate))
        .route("/mutate", post(mutate))
        .route("/namespaces", post(namespaces))
        .layer(DefaultBodyLimit::disable())
        .with_state(admission)
}

async fn validate(
    State(admission): State<Arc<Admission>>,
    request: axum::extract::Request,
) -> Response {
    admission.handle("validate", request).await
}

async fn mutate(
    State(admission): State<Arc<Admission>>,
    request: axum::extract::Request,
) -> Response {
    admission.handle("mutate", request).await
}

async fn namespaces(
    State(admission): State<Arc<Admission>>,
    request: axum::extract::Request,
) -> Response {
    admission.handle_namespaces(request).await
}

fn invalid(metrics: &AdmissionMetrics, webhook: &str, e: WebhookError) -> Response {
    metrics.decision(webhook, "invalid");
    warn!(webhook, error = %e, "malformed AdmissionReview");
    (StatusCode::BAD_REQUEST, format!("{e}\n")).into_response()
}

/// Reads a body as it arrives: at most `max_body_bytes`, within `body_timeout`, never
/// slower than `min_body_bytes_per_sec` after the grace, each chunk charged to the shared
/// budget before it is kept.
async fn read_body(
    limits: &ReviewLimits,
    budget: &Arc<Semaphore>,
    metrics: &AdmissionMetrics,
    mut body: axum::body::Body,
) -> Result<(bytes::Bytes, Reserved), BodyError> {
    let began = tokio::time::Instant::now();
    let mut reserved = Reserved::new(metrics);
    let mut kept = bytes::BytesMut::new();
    loop {
        let received = kept.len();
        let rate_deadline =
            began + BODY_RATE_GRACE + rate_time(received, limits.min_body_bytes_per_sec);
        let deadline = rate_deadline.min(began + limits.body_timeout);
        let frame = match tokio::time::timeout_at(deadline, body.frame()).await {
            Ok(None) => break,
            Ok(Some(frame)) => frame.map_err(BodyError::Read)?,
            Err(_) => {
                return Err(BodyError::Refused(Refusal::SlowBody {
                    received,
                    timeout: limits.body_timeout,
                    min_rate: limits.min_body_bytes_per_sec,
                }));
            }
        };
        let Ok(data) = frame.into_data() else {
            continue;
        };
        let total = received.saturating_add(data.len());
        if total > limits.max_body_bytes {
            return Err(BodyError::Refused(Refusal::TooLarge {
                length: None,
                max: limits.max_body_bytes,
            }));
        }
        let more = kib(total).saturating_sub(kib(received));
        if more > 0 {
            let Ok(permit) = budget.clone().try_acquire_many_owned(more) else {
                return Err(BodyError::Refused(Refusal::BodyBudget {
                    budget: limits.body_budget_bytes,
                }));
            };
            reserved.add(permit, total - received);
        }
        kept.extend_from_slice(&data);
    }
    Ok((kept.freeze(), reserved))
}

/// Why a body was not read.
enum BodyError {
    Refused(Refusal),
    Read(axum::Error),
}

/// Time `bytes` take at `rate` bytes per second, at most a day (a rate of 0 never runs out;
/// the body's deadline is the bound then).
fn rate_time(bytes: usize, rate: usize) -> Duration {
    const DAY: Duration = Duration::from_secs(86_400);
    if rate == 0 {
        return DAY;
    }
    Duration::from_secs_f64(bytes as f64 / rate as f64).min(DAY)
}

/// Body bytes charged to the budget so far, shown on a gauge while held.
struct Reserved {
    permit: Option<tokio::sync::OwnedSemaphorePermit>,
    gauge: prometheus_client::metrics::gauge::Gauge,
    bytes: i64,
}

impl Reserved {
    fn new(metrics: &AdmissionMetrics) -> Self {
        Self {
            permit: None,
            gauge: metrics.body_bytes_reserved.clone(),
            bytes: 0,
        }
    }

    fn add(&mut self, permit: tokio::sync::OwnedSemaphorePermit, bytes: usize) {
        let bytes = i64::try_from(bytes).unwrap_or(i64::MAX);
        self.gauge.inc_by(bytes);
        self.bytes = self.bytes.saturating_add(bytes);
        match &mut self.permit {
            Some(held) => held.merge(permit),
            None => self.permit = Some(permit),
        }
    }
}

impl Drop for Reserved {
    fn drop(&mut self) {
        self.gauge.dec_by(self.bytes);
    }
}

/// Bytes in KiB permits (rounded up), as the budget semaphore counts them.
fn kib(bytes: usize) -> u32 {
    u32::try_from(bytes.div_ceil(1024)).unwrap_or(u32::MAX)
}

#[cfg(test)]
mod tests {
    //! Body reading on a real socket (no policy bundle needed: a refused body never reaches
    //! an evaluation).

    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::net::TcpStream;

    use super::*;

    struct Reader {
        addr: std::net::SocketAddr,
        metrics: AdmissionMetrics,
    }

    /// `POST /read` reads the body as `/validate` does and answers 200 with its length, or
    /// the refusal's status and message.
    async fn reader(limits: ReviewLimits) -> Reader {
        let metrics = AdmissionMetrics::new();
        let budget = Arc::new(Semaphore::new(kib(limits.body_budget_bytes) as usize));
        let app = Router::new().route(
            "/read",
            post({
                let metrics = metrics.clone();
                move |request: axum::extract::Request| {
                    let (metrics, budget) = (metrics.clone(), budget.clone());
                    async move {
                        match read_body(&limits, &budget, &metrics, request.into_body()).await {
                            Ok((body, _held)) => (StatusCode::OK, body.len().to_string()),
                            Err(BodyError::Refused(r)) => (r.status(), r.to_string()),
                            Err(BodyError::Read(e)) => (StatusCode::BAD_REQUEST, e.to_string()),
                        }
                    }
                }
            }),
        );
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let addr = listener.local_addr().expect("addr");
        tokio::spawn(async move { axum::serve(listener, app).await });
        Reader { addr, metrics }
    }

    /// A client that declares `declared` bytes and sends `sent` of them, then waits.
    async fn slow_client(addr: std::net::SocketAddr, declared: usize, sent: usize) -> TcpStream {
        let mut stream = TcpStream::connect(addr).await.expect("connect");
        let head = format!("POST /read HTTP/1.1\r\nHost: x\r\nContent-Length: {declared}\r\n\r\n");
        stream.write_all(head.as_bytes()).await.expect("head");
        stream.write_all(&vec![b' '; sent]).await.expect("body");
        stream
    }

    /// The status line and body of the answer on `stream`.
    async fn answer(stream: &mut TcpStream) -> String {
        let mut buf = Vec::new();
        // Connection: close is not sent by the slow clients: read what arrives until the
        // server closes or a complete answer is in (a generous bound, never reached by a
        // server that answers).
        let _ = tokio::time::timeout(Duration::from_secs(30), async {
            let mut chunk = [0u8; 4096];
            loop {
                match stream.read(&mut chunk).await {
                    Ok(0) | Err(_) => break,
                    Ok(n) => buf.extend_from_slice(&chunk[..n]),
                }
                let text = String::from_utf8_lossy(&buf);
                if let Some((head, body)) = text.split_once("\r\n\r\n")
                    && let Some(length) = head
                        .lines()
                        .find_map(|l| l.strip_prefix("content-length: "))
                        .and_then(|l| l.trim().parse::<usize>().ok())
                    && body.len() >= length
                {
                    break;
                }
            }
        })
        .await;
        String::from_utf8_lossy(&buf).into_owned()
    }

    async fn post_body(addr: std::net::SocketAddr, bytes: usize) -> String {
        let mut stream = slow_client(addr, bytes, bytes).await;
        answer(&mut stream).await
    }

    async fn until(what: &str, mut condition: impl FnMut() -> bool) {
        for _ in 0..100_000 {
            if condition() {
                return;
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        panic!("never: {what}");
    }

    /// Limits where only the budget can refuse: no deadline or rate a slow machine reaches.
    fn patient() -> ReviewLimits {
        ReviewLimits {
            body_timeout: Duration::from_secs(3600),
            min_body_bytes_per_sec: 0,
            ..ReviewLimits::DEFAULT
        }
    }

    #[tokio::test]
    async fn a_declared_length_holds_nothing_it_has_not_sent() {
        let limits = patient();
        let server = reader(limits).await;
        // Four clients declare the largest body and send 1 KiB each: with the budget reserved
        // from the declared length, they would hold all 24 MiB of it.
        let mut slow = Vec::new();
        for _ in 0..4 {
            slow.push(slow_client(server.addr, limits.max_body_bytes, 1024).await);
        }
        until("the slow bodies' bytes are charged", || {
            server.metrics.body_bytes_reserved.get() == 4 * 1024
        })
        .await;
        let answer = post_body(server.addr, 64 << 10).await;
        assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
        assert!(answer.ends_with(&(64 << 10).to_string()), "{answer}");
        drop(slow);
    }

    #[tokio::test]
    async fn bytes_that_arrived_are_charged_and_given_back() {
        let limits = ReviewLimits {
            body_budget_bytes: ReviewLimits::DEFAULT.max_body_bytes,
            ..patient()
        };
        let server = reader(limits).await;
        // One client sends all but the last KiB of the largest body: the budget is spent.
        let sent = limits.max_body_bytes - 1024;
        let mut slow = slow_client(server.addr, limits.max_body_bytes, sent).await;
        until("the sent bytes are charged", || {
            server.metrics.body_bytes_reserved.get() == sent as i64
        })
        .await;
        let refused = post_body(server.addr, 64 << 10).await;
        assert!(refused.starts_with("HTTP/1.1 429"), "{refused}");
        assert!(refused.contains("review bytes"), "{refused}");
        // It finishes: its bytes go back, and the next body is read.
        slow.write_all(&[b' '; 1024]).await.expect("rest");
        let done = answer(&mut slow).await;
        assert!(done.starts_with("HTTP/1.1 200"), "{done}");
        until("the budget is back", || {
            server.metrics.body_bytes_reserved.get() == 0
        })
        .await;
        let answer = post_body(server.addr, 64 << 10).await;
        assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
    }

    #[tokio::test]
    async fn a_body_slower_than_the_minimum_rate_gets_408() {
        let server = reader(ReviewLimits {
            min_body_bytes_per_sec: 1 << 20,
            ..patient()
        })
        .await;
        let mut slow = slow_client(server.addr, 6 << 20, 10).await;
        let answer = answer(&mut slow).await;
        assert!(answer.starts_with("HTTP/1.1 408"), "{answer}");
        assert!(answer.contains("too slowly"), "{answer}");
        assert_eq!(server.metrics.body_bytes_reserved.get(), 0);
    }

    #[tokio::test]
    async fn a_body_past_its_deadline_gets_408() {
        let server = reader(ReviewLimits {
            body_timeout: Duration::from_millis(300),
            ..patient()
        })
        .await;
        let mut slow = slow_client(server.addr, 1024, 10).await;
        let answer = answer(&mut slow).await;
        assert!(answer.starts_with("HTTP/1.1 408"), "{answer}");
        assert!(answer.contains("too slowly"), "{answer}");
    }
}
