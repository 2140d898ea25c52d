//! client-go's REST client series for the apiserver client: `rest_client_requests_total{code,
//! method,host}` and `rest_client_request_duration_seconds{verb,host}`, counted by a tower
//! layer on the kube client, outside its retries and timeouts, so each request counts once
//! with its final answer, as client-go counts it.

use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Instant;

use futures::FutureExt;
use futures::future::BoxFuture;
use http::{Method, Request, Response};
use tower::{Layer, Service};

use crate::runtime_metrics::{LatencyLabels, RequestLabels, RestMetrics};

/// The layer; `host` is the apiserver's `host:port` (client-go's label is its base URL's host).
#[derive(Clone)]
pub struct RestMetricsLayer {
    metrics: RestMetrics,
    host: Arc<String>,
}

impl RestMetricsLayer {
    pub fn new(metrics: RestMetrics, cluster_url: &http::Uri) -> Self {
        let host = cluster_url
            .authority()
            .map_or("none", |a| a.as_str())
            .to_owned();
        Self {
            metrics,
            host: Arc::new(host),
        }
    }
}

impl<S> Layer<S> for RestMetricsLayer {
    type Service = RestMetricsService<S>;

    fn layer(&self, inner: S) -> Self::Service {
        RestMetricsService {
            inner,
            metrics: self.metrics.clone(),
            host: self.host.clone(),
        }
    }
}

/// The counting service.
#[derive(Clone)]
pub struct RestMetricsService<S> {
    inner: S,
    metrics: RestMetrics,
    host: Arc<String>,
}

/// The method as a label: the client only sends these; anything else is `OTHER`.
fn method_label(method: &Method) -> &'static str {
    match *method {
        Method::GET => "GET",
        Method::POST => "POST",
        Method::PUT => "PUT",
        Method::PATCH => "PATCH",
        Method::DELETE => "DELETE",
        Method::HEAD => "HEAD",
        Method::OPTIONS => "OPTIONS",
        _ => "OTHER",
    }
}

/// client-go's `code` label: the status, or `<error>` when no response came.
fn code_label<B, E>(result: &Result<Response<B>, E>) -> String {
    match result {
        Ok(response) => response.status().as_u16().to_string(),
        Err(_) => "<error>".to_owned(),
    }
}

impl<S, ReqBody, ResBody> Service<Request<ReqBody>> for RestMetricsService<S>
where
    S: Service<Request<ReqBody>, Response = Response<ResBody>>,
    S::Future: Send + 'static,
    S::Error: 'static,
    ResBody: 'static,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = BoxFuture<'static, Result<S::Response, S::Error>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: Request<ReqBody>) -> Self::Future {
        let method = method_label(request.method());
        let started = Instant::now();
        let metrics = self.metrics.clone();
        let host = self.host.clone();
        self.inner
            .call(request)
            .map(move |result| {
                metrics
                    .duration
                    .get_or_create(&LatencyLabels {
                        verb: method,
                        host: host.clone(),
                    })
                    .observe(started.elapsed().as_secs_f64());
                metrics
                    .requests
                    .get_or_create(&RequestLabels {
                        code: code_label(&result),
                        method,
                        host,
                    })
                    .inc();
                result
            })
            .boxed()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn labels_are_client_gos() {
        assert_eq!(method_label(&Method::PATCH), "PATCH");
        let custom = Method::from_bytes(b"BREW").expect("method");
        assert_eq!(method_label(&custom), "OTHER");
        let ok: Result<Response<()>, ()> =
            Ok(Response::builder().status(503).body(()).expect("response"));
        assert_eq!(code_label(&ok), "503");
        let failed: Result<Response<()>, ()> = Err(());
        assert_eq!(code_label(&failed), "<error>");
    }

    #[test]
    fn the_host_is_the_apiservers() {
        let layer = RestMetricsLayer::new(
            crate::metrics::Metrics::new().runtime.rest.clone(),
            &"https://10.96.0.1:443".parse().expect("uri"),
        );
        assert_eq!(layer.host.as_str(), "10.96.0.1:443");
    }
}
