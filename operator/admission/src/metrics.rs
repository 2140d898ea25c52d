//! Admission metrics. Registered into the operator's registry by [`AdmissionMetrics::register`].

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;

/// Labels of a webhook answer.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct DecisionLabels {
    /// `validate` or `mutate`.
    pub webhook: String,
    /// `allowed`, `denied`, `warned` (admitted with warnings), `patched`, `error_allowed`
    /// (evaluation failed, admitted by failure policy Ignore), `error_denied`, `invalid`
    /// (malformed AdmissionReview) or `refused` (over a limit, answered 413/429/503).
    pub result: String,
}

/// Labels of one violation.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ViolationLabels {
    /// `restricted` or `isolation`.
    pub policy: String,
    /// The rule, e.g. `run-as-user-root`.
    pub code: String,
    /// `deny`, `warn` or `dryrun`.
    pub action: String,
}

/// Labels of evaluation latency.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct EntrypointLabels {
    pub entrypoint: String,
}

/// Labels of evaluation failures.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ErrorLabels {
    pub entrypoint: String,
    /// `timeout`, `memory`, `evaluation`, `undefined`, `tenancy`, `load`, ...
    pub error: String,
}

/// Labels of a request refused over a limit.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct RefusedLabels {
    /// `body_too_large`, `too_many_values`, `body_budget`, `busy`, `no_slot`, `closed`,
    /// `connections` (a fixed set).
    pub reason: String,
}

/// Labels of one part of a webhook request's handling.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct PhaseLabels {
    /// `validate` or `mutate`.
    pub webhook: String,
    /// `read` (the body), `slot` (waiting for an evaluation slot), `parse` (the review, on
    /// the evaluation thread), `data` (the tenancy document), `eval` (the policy, on the
    /// evaluation thread), `hop` (to the evaluation thread and back, for parse and eval),
    /// `respond` (the answer to JSON) or `total` (the handler, from the headers to the
    /// answer's bytes).
    pub phase: String,
}

/// Labels of a webhook request's protocol.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ProtocolLabels {
    /// `HTTP/1.1` or `HTTP/2.0`.
    pub version: String,
}

/// Every admission metric.
#[derive(Clone, Debug)]
pub struct AdmissionMetrics {
    pub decisions: Family<DecisionLabels, Counter>,
    pub violations: Family<ViolationLabels, Counter>,
    pub evaluation_duration: Family<EntrypointLabels, Histogram, fn() -> Histogram>,
    pub evaluation_errors: Family<ErrorLabels, Counter>,
    /// Unix time at which the serving certificate expires.
    pub certificate_expiry: Gauge,
    pub certificate_rotations: Counter,
    pub refused: Family<RefusedLabels, Counter>,
    /// Open connections to the webhook listener.
    pub connections: Gauge,
    /// Bytes of request bodies reserved from the body budget (being read or parsed).
    pub body_bytes_reserved: Gauge,
    /// Where a webhook request's time goes, by webhook and phase.
    pub request_phases: Family<PhaseLabels, Histogram, fn() -> Histogram>,
    /// Webhook requests by HTTP version: with few TLS handshakes, many requests share a
    /// connection.
    pub requests: Family<ProtocolLabels, Counter>,
    /// TLS handshakes completed: each is a new connection from a client.
    pub tls_handshakes: Counter,
    /// TLS handshakes that failed or timed out.
    pub tls_handshake_failures: Counter,
    /// Time from accept to the end of the TLS handshake.
    pub tls_handshake_duration: Histogram,
}

fn evaluation_histogram() -> Histogram {
    // 20 µs … ~1.3 s: a fresh instance plus evaluation is ~0.1 ms, a timeout is seconds.
    Histogram::new(exponential_buckets(0.00002, 2.0, 17))
}

fn phase_histogram() -> Histogram {
    // 2 µs … ~4 s: the parts of one request range from microseconds (data) to the request
    // timeout.
    Histogram::new(exponential_buckets(0.000002, 2.0, 22))
}

impl Default for AdmissionMetrics {
    fn default() -> Self {
        Self::new()
    }
}

impl AdmissionMetrics {
    pub fn new() -> Self {
        Self {
            decisions: Family::default(),
            violations: Family::default(),
            evaluation_duration: Family::new_with_constructor(evaluation_histogram),
            evaluation_errors: Family::default(),
            certificate_expiry: Gauge::default(),
            certificate_rotations: Counter::default(),
            refused: Family::default(),
            connections: Gauge::default(),
            body_bytes_reserved: Gauge::default(),
            request_phases: Family::new_with_constructor(phase_histogram),
            requests: Family::default(),
            tls_handshakes: Counter::default(),
            tls_handshake_failures: Counter::default(),
            tls_handshake_duration: phase_histogram(),
        }
    }

    /// Registers every family in `registry` (names prefixed `pko_admission_`).
    pub fn register(&self, registry: &mut Registry) {
        registry.register(
            "pko_admission_decisions",
            "Admission webhook answers, by webhook and result",
            self.decisions.clone(),
        );
        registry.register(
            "pko_admission_violations",
            "Policy violations found at admission, by policy, rule and enforcement action",
            self.violations.clone(),
        );
        registry.register(
            "pko_admission_evaluation_duration_seconds",
            "Policy evaluation latency (fresh instance + data + evaluation), by entrypoint",
            self.evaluation_duration.clone(),
        );
        registry.register(
            "pko_admission_evaluation_errors",
            "Policy evaluations that failed, by entrypoint and error kind",
            self.evaluation_errors.clone(),
        );
        registry.register(
            "pko_admission_certificate_expiry_timestamp_seconds",
            "Unix time at which the webhook's serving certificate expires",
            self.certificate_expiry.clone(),
        );
        registry.register(
            "pko_admission_certificate_rotations",
            "Webhook serving certificates issued or loaded after a change",
            self.certificate_rotations.clone(),
        );
        registry.register(
            "pko_admission_refused",
            "Webhook requests refused over a limit (413, 429, 503, closed connections), by reason",
            self.refused.clone(),
        );
        registry.register(
            "pko_admission_connections",
            "Open connections to the webhook listener",
            self.connections.clone(),
        );
        registry.register(
            "pko_admission_body_bytes_reserved",
            "Bytes of webhook request bodies being read or parsed (reserved from the body budget)",
            self.body_bytes_reserved.clone(),
        );
        registry.register(
            "pko_admission_request_phase_duration_seconds",
            "Where a webhook request's time goes in the operator, by webhook and phase",
            self.request_phases.clone(),
        );
        registry.register(
            "pko_admission_requests",
            "Webhook requests, by HTTP version",
            self.requests.clone(),
        );
        registry.register(
            "pko_admission_tls_handshakes",
            "TLS handshakes completed on the webhook listener (new connections)",
            self.tls_handshakes.clone(),
        );
        registry.register(
            "pko_admission_tls_handshake_failures",
            "TLS handshakes on the webhook listener that failed or timed out",
            self.tls_handshake_failures.clone(),
        );
        registry.register(
            "pko_admission_tls_handshake_duration_seconds",
            "Time from accept to the end of the TLS handshake on the webhook listener",
            self.tls_handshake_duration.clone(),
        );
    }

    pub(crate) fn phase(&self, webhook: &str, phase: &str, took: std::time::Duration) {
        self.request_phases
            .get_or_create(&PhaseLabels {
                webhook: webhook.to_owned(),
                phase: phase.to_owned(),
            })
            .observe(took.as_secs_f64());
    }

    pub(crate) fn refused(&self, reason: &'static str) {
        self.refused
            .get_or_create(&RefusedLabels {
                reason: reason.to_owned(),
            })
            .inc();
    }

    pub(crate) fn decision(&self, webhook: &str, result: &str) {
        self.decisions
            .get_or_create(&DecisionLabels {
                webhook: webhook.to_owned(),
                result: result.to_owned(),
            })
            .inc();
    }
}
