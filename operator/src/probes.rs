//! Health, readiness and metrics endpoints.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use axum::Router;
use axum::extract::State;
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use http::{StatusCode, header};

use crate::metrics::Metrics;

/// Readiness inputs: every flag must be set before `/readyz` answers 200.
#[derive(Clone, Default)]
pub struct Readiness {
    checks: Arc<Vec<(&'static str, Arc<AtomicBool>)>>,
    /// Set on SIGTERM: load balancers stop sending new requests while in-flight ones drain.
    draining: Arc<AtomicBool>,
}

impl Readiness {
    pub fn new(checks: Vec<(&'static str, Arc<AtomicBool>)>) -> Self {
        Self {
            checks: Arc::new(checks),
            draining: Arc::new(AtomicBool::new(false)),
        }
    }

    /// From now on `/readyz` answers 503 "shutting down".
    pub fn start_draining(&self) {
        self.draining.store(true, Ordering::Release);
    }

    fn is_draining(&self) -> bool {
        self.draining.load(Ordering::Acquire)
    }

    fn pending(&self) -> Vec<&'static str> {
        self.checks
            .iter()
            .filter(|(_, ok)| !ok.load(Ordering::Acquire))
            .map(|(name, _)| *name)
            .collect()
    }
}

#[derive(Clone)]
struct ProbeState {
    readiness: Readiness,
    metrics: Metrics,
}

/// `/healthz`, `/readyz`, and `/metrics` when `with_metrics`.
pub fn router(readiness: Readiness, metrics: Metrics, with_metrics: bool) -> Router {
    let router = Router::new()
        .route("/healthz", get(|| async { "ok\n" }))
        .route("/readyz", get(readyz));
    let router = if with_metrics {
        router.route("/metrics", get(metrics_text))
    } else {
        router
    };
    router.with_state(ProbeState { readiness, metrics })
}

async fn readyz(State(state): State<ProbeState>) -> Response {
    if state.readiness.is_draining() {
        return (
            StatusCode::SERVICE_UNAVAILABLE,
            "not ready: shutting down\n",
        )
            .into_response();
    }
    let pending = state.readiness.pending();
    if pending.is_empty() {
        (StatusCode::OK, "ok\n").into_response()
    } else {
        (
            StatusCode::SERVICE_UNAVAILABLE,
            format!("not ready: waiting for {}\n", pending.join(", ")),
        )
            .into_response()
    }
}

async fn metrics_text(State(state): State<ProbeState>) -> Response {
    metrics_response(&state.metrics)
}

/// The answer of `/metrics`: every metric in the OpenMetrics text format.
pub fn metrics_response(metrics: &Metrics) -> Response {
    match metrics.encode() {
        Ok(body) => (
            [(
                header::CONTENT_TYPE,
                "application/openmetrics-text; version=1.0.0; charset=utf-8",
            )],
            body,
        )
            .into_response(),
        Err(_) => (StatusCode::INTERNAL_SERVER_ERROR, "cannot encode metrics\n").into_response(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn ready_only_after_every_cache_and_not_while_draining() {
        let programs = Arc::new(AtomicBool::new(false));
        let stacks = Arc::new(AtomicBool::new(false));
        let readiness = Readiness::new(vec![
            ("program cache", programs.clone()),
            ("stack cache", stacks.clone()),
        ]);
        let state = ProbeState {
            readiness: readiness.clone(),
            metrics: Metrics::new(),
        };
        let status = |state: ProbeState| async move { readyz(State(state)).await.status() };
        assert_eq!(status(state.clone()).await, StatusCode::SERVICE_UNAVAILABLE);
        programs.store(true, Ordering::Release);
        assert_eq!(readiness.pending(), ["stack cache"]);
        assert_eq!(status(state.clone()).await, StatusCode::SERVICE_UNAVAILABLE);
        stacks.store(true, Ordering::Release);
        assert_eq!(status(state.clone()).await, StatusCode::OK);
        readiness.start_draining();
        assert_eq!(status(state).await, StatusCode::SERVICE_UNAVAILABLE);
    }

    #[tokio::test]
    async fn metrics_leave_the_probe_listener_when_they_have_their_own() {
        use tower::ServiceExt;
        let get = |router: Router, path: &'static str| async move {
            let request = http::Request::get(path)
                .body(axum::body::Body::empty())
                .expect("request");
            router.oneshot(request).await.expect("answer").status()
        };
        let probes_only = router(Readiness::new(vec![]), Metrics::new(), false);
        assert_eq!(get(probes_only.clone(), "/healthz").await, StatusCode::OK);
        assert_eq!(get(probes_only.clone(), "/readyz").await, StatusCode::OK);
        assert_eq!(get(probes_only, "/metrics").await, StatusCode::NOT_FOUND);
        let with_metrics = router(Readiness::new(vec![]), Metrics::new(), true);
        assert_eq!(get(with_metrics, "/metrics").await, StatusCode::OK);
    }
}
