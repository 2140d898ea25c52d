//! The HTTPS listener of the webhook (axum-server + rustls with the ring provider), with a
//! connection cap and timeouts for slow clients.

use std::net::{SocketAddr, TcpListener};
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use axum::Router;
use axum_server::Handle;
use axum_server::accept::Accept;
use axum_server::tls_rustls::{RustlsAcceptor, RustlsConfig};
use hyper_util::rt::TokioTimer;
use prometheus_client::metrics::gauge::Gauge;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tower_http::timeout::TimeoutLayer;
use tracing::{info, warn};

use crate::metrics::AdmissionMetrics;

/// The apiserver waits at most 30 s for a webhook; nothing we do takes that long.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(30);
/// A TLS handshake, from accept.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(5);
/// The first request of a connection, from the end of the handshake.
const FIRST_REQUEST_TIMEOUT: Duration = Duration::from_secs(10);
/// The headers of each request.
const HEADER_READ_TIMEOUT: Duration = Duration::from_secs(10);

/// Errors of the listener.
#[derive(Debug, thiserror::Error)]
pub enum ServerError {
    #[error("invalid webhook address {addr:?}: {reason}")]
    Address { addr: String, reason: String },
    #[error("cannot listen on {addr}: {source}")]
    Bind {
        addr: String,
        #[source]
        source: std::io::Error,
    },
}

/// `":9443"` (every interface), `"127.0.0.1:9443"` or `"[::1]:9443"`.
pub fn parse_addr(addr: &str) -> Result<SocketAddr, ServerError> {
    let full = if addr.starts_with(':') {
        format!("0.0.0.0{addr}")
    } else {
        addr.to_owned()
    };
    full.parse()
        .map_err(|e: std::net::AddrParseError| ServerError::Address {
            addr: addr.to_owned(),
            reason: e.to_string(),
        })
}

/// Binds now, so a taken port fails the start instead of a background task.
pub fn bind(addr: &str) -> Result<TcpListener, ServerError> {
    let socket = parse_addr(addr)?;
    let listener = TcpListener::bind(socket).map_err(|source| ServerError::Bind {
        addr: addr.to_owned(),
        source,
    })?;
    listener
        .set_nonblocking(true)
        .map_err(|source| ServerError::Bind {
            addr: addr.to_owned(),
            source,
        })?;
    Ok(listener)
}

/// How the listener bounds its clients.
#[derive(Clone, Copy, Debug)]
pub struct Bounds {
    /// How long in-flight requests may finish after shutdown starts.
    pub drain: Duration,
    /// Connections open at once; more are closed as soon as accepted.
    pub max_connections: usize,
    /// A TLS handshake, from accept.
    pub handshake_timeout: Duration,
    /// The first request of a connection, from the end of the handshake.
    pub first_request_timeout: Duration,
    /// The headers of each request.
    pub header_read_timeout: Duration,
}

impl Bounds {
    /// `drain` and `max_connections` with the default timeouts.
    pub fn new(drain: Duration, max_connections: usize) -> Self {
        Self {
            drain,
            max_connections,
            handshake_timeout: HANDSHAKE_TIMEOUT,
            first_request_timeout: FIRST_REQUEST_TIMEOUT,
            header_read_timeout: HEADER_READ_TIMEOUT,
        }
    }
}

/// Serves `app` over TLS until `shutdown`, then drains in-flight requests for up to
/// `bounds.drain`. Slow clients are bounded at every step: the TLS handshake, the first
/// request, each request's headers, and the whole request (body included).
pub async fn serve(
    listener: TcpListener,
    app: Router,
    tls: RustlsConfig,
    bounds: Bounds,
    metrics: AdmissionMetrics,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) {
    let addr = listener
        .local_addr()
        .map(|a| a.to_string())
        .unwrap_or_default();
    let handle: Handle<SocketAddr> = Handle::new();
    let stopper = handle.clone();
    let drain = bounds.drain;
    tokio::spawn(async move {
        shutdown.await;
        stopper.graceful_shutdown(Some(drain));
    });
    let app = app.layer(TimeoutLayer::with_status_code(
        http::StatusCode::REQUEST_TIMEOUT,
        REQUEST_TIMEOUT,
    ));
    let capped = ConnectionCap {
        permits: Arc::new(Semaphore::new(bounds.max_connections.max(1))),
        metrics,
    };
    let acceptor = RustlsAcceptor::new(tls)
        .handshake_timeout(bounds.handshake_timeout)
        .acceptor(capped);
    let mut server = match axum_server::from_tcp(listener) {
        Ok(server) => server
            .acceptor(acceptor)
            .first_request_timeout(bounds.first_request_timeout),
        Err(e) => {
            warn!(addr, error = %e, "webhook listener failed");
            return;
        }
    };
    server
        .http_builder()
        .http1()
        .timer(TokioTimer::new())
        .header_read_timeout(bounds.header_read_timeout);
    info!(
        addr,
        max_connections = bounds.max_connections,
        "admission webhook listening (HTTPS)"
    );
    if let Err(e) = server.handle(handle).serve(app.into_make_service()).await {
        warn!(addr, error = %e, "webhook listener failed");
    }
    info!(addr, "admission webhook stopped");
}

/// Admits a connection only while fewer than the cap are open; the permit lives as long as
/// the connection's stream.
#[derive(Clone)]
struct ConnectionCap {
    permits: Arc<Semaphore>,
    metrics: AdmissionMetrics,
}

impl<I, S> Accept<I, S> for ConnectionCap {
    type Stream = Counted<I>;
    type Service = S;
    type Future = std::future::Ready<std::io::Result<(Counted<I>, S)>>;

    fn accept(&self, stream: I, service: S) -> Self::Future {
        match self.permits.clone().try_acquire_owned() {
            Ok(permit) => {
                self.metrics.connections.inc();
                std::future::ready(Ok((
                    Counted {
                        inner: stream,
                        _permit: permit,
                        gauge: self.metrics.connections.clone(),
                    },
                    service,
                )))
            }
            Err(_) => {
                self.metrics.refused("connections");
                // Dropping the stream closes it: no handshake, no buffers.
                std::future::ready(Err(std::io::Error::other(
                    "webhook connection cap reached; connection closed",
                )))
            }
        }
    }
}

/// A connection's stream, holding its place under the cap.
struct Counted<I> {
    inner: I,
    _permit: OwnedSemaphorePermit,
    gauge: Gauge,
}

impl<I> Drop for Counted<I> {
    fn drop(&mut self) {
        self.gauge.dec();
    }
}

impl<I: AsyncRead + Unpin> AsyncRead for Counted<I> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_read(cx, buf)
    }
}

impl<I: AsyncWrite + Unpin> AsyncWrite for Counted<I> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }
}
