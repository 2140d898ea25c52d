//! The HTTPS listener of the webhook (axum-server + rustls with the ring provider), with a
//! connection cap and timeouts for slow clients.

use std::collections::HashMap;
use std::net::{IpAddr, SocketAddr, TcpListener};
use std::pin::Pin;
use std::sync::{Arc, Mutex, PoisonError};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use axum::Router;
use axum_server::Handle;
use axum_server::accept::Accept;
use axum_server::tls_rustls::{RustlsAcceptor, RustlsConfig};
use hyper_util::rt::TokioTimer;
use prometheus_client::metrics::gauge::Gauge;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tower_http::timeout::TimeoutLayer;
use tracing::{debug, info, warn};

use crate::conn::{self, ConnLimits, Guarded, Tracked};
use crate::metrics::AdmissionMetrics;

/// The apiserver waits at most 30 s for a webhook; nothing we do takes that long.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(30);
/// A TLS handshake, from accept.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(5);
/// The first request of a connection, from the end of the handshake.
const FIRST_REQUEST_TIMEOUT: Duration = Duration::from_secs(10);
/// The headers of each request.
const HEADER_READ_TIMEOUT: Duration = Duration::from_secs(10);
/// A connection without a request in flight (HTTP/1 keep-alive and HTTP/2 alike) is closed.
/// Above the apiserver's own idle timeout (client-go's 90 s), so in normal operation the
/// apiserver closes its idle connections first and never races our close with a request;
/// a client holding connections open without using them gives them back this soon.
pub const IDLE_TIMEOUT: Duration = Duration::from_secs(120);
/// One write the peer does not read.
pub const WRITE_TIMEOUT: Duration = Duration::from_secs(10);
/// HTTP/2 PINGs: a peer that does not answer one in time is gone.
const H2_KEEP_ALIVE_INTERVAL: Duration = Duration::from_secs(30);
const H2_KEEP_ALIVE_TIMEOUT: Duration = Duration::from_secs(10);

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
    /// Connections one client address may hold open at once: one pod holding connections
    /// open cannot fill the whole cap and lock the apiserver out.
    pub max_connections_per_client: usize,
    /// A TLS handshake, from accept.
    pub handshake_timeout: Duration,
    /// The first request of a connection, from the end of the handshake.
    pub first_request_timeout: Duration,
    /// The headers of each request.
    pub header_read_timeout: Duration,
    /// Idle and write timers of each connection.
    pub conn: ConnLimits,
}

impl Bounds {
    /// `drain` and `max_connections` with the default timeouts and a quarter of the cap per
    /// client address.
    pub fn new(drain: Duration, max_connections: usize) -> Self {
        Self {
            drain,
            max_connections,
            max_connections_per_client: (max_connections / 4).max(1),
            handshake_timeout: HANDSHAKE_TIMEOUT,
            first_request_timeout: FIRST_REQUEST_TIMEOUT,
            header_read_timeout: HEADER_READ_TIMEOUT,
            conn: ConnLimits {
                idle_timeout: IDLE_TIMEOUT,
                write_timeout: WRITE_TIMEOUT,
            },
        }
    }
}

/// Serves `app` over TLS until `shutdown`, then drains in-flight requests for up to
/// `bounds.drain`. Slow clients are bounded at every step: the TLS handshake, the first
/// request, each request's headers, the whole request (body included), the time between
/// requests and each write of the answer.
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
        per_client: Arc::new(PerClient::new(bounds.max_connections_per_client)),
        metrics: metrics.clone(),
        limits: bounds.conn,
    };
    let acceptor = Handshakes {
        inner: RustlsAcceptor::new(tls)
            .handshake_timeout(bounds.handshake_timeout)
            .acceptor(capped),
        metrics: metrics.clone(),
    };
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
    server
        .http_builder()
        .http2()
        .timer(TokioTimer::new())
        .keep_alive_interval(Some(H2_KEEP_ALIVE_INTERVAL))
        .keep_alive_timeout(H2_KEEP_ALIVE_TIMEOUT);
    info!(
        addr,
        max_connections = bounds.max_connections,
        max_connections_per_client = bounds.max_connections_per_client,
        idle_timeout = ?bounds.conn.idle_timeout,
        write_timeout = ?bounds.conn.write_timeout,
        "admission webhook listening (HTTPS)"
    );
    if let Err(e) = server.handle(handle).serve(app.into_make_service()).await {
        warn!(addr, error = %e, "webhook listener failed");
    }
    info!(addr, "admission webhook stopped");
}

/// Counts and times TLS handshakes: a client that opens a connection per request pays a
/// handshake per request, which shows here.
#[derive(Clone)]
struct Handshakes<A> {
    inner: A,
    metrics: AdmissionMetrics,
}

impl<A, S> Accept<tokio::net::TcpStream, S> for Handshakes<A>
where
    A: Accept<tokio::net::TcpStream, S>,
    A::Future: Send + 'static,
{
    type Stream = A::Stream;
    type Service = A::Service;
    type Future =
        Pin<Box<dyn std::future::Future<Output = std::io::Result<(A::Stream, A::Service)>> + Send>>;

    fn accept(&self, stream: tokio::net::TcpStream, service: S) -> Self::Future {
        let started = Instant::now();
        let handshake = self.inner.accept(stream, service);
        let metrics = self.metrics.clone();
        Box::pin(async move {
            let accepted = handshake.await;
            match &accepted {
                Ok(_) => {
                    metrics.tls_handshakes.inc();
                    metrics
                        .tls_handshake_duration
                        .observe(started.elapsed().as_secs_f64());
                }
                Err(_) => {
                    metrics.tls_handshake_failures.inc();
                }
            }
            accepted
        })
    }
}

/// Admits a connection only while fewer than the cap are open, and fewer than the
/// per-client cap from its address; both places live as long as the connection's stream,
/// which the idle and write timers end.
#[derive(Clone)]
struct ConnectionCap {
    permits: Arc<Semaphore>,
    per_client: Arc<PerClient>,
    metrics: AdmissionMetrics,
    limits: ConnLimits,
}

impl<S> Accept<tokio::net::TcpStream, S> for ConnectionCap {
    type Stream = Guarded<Counted<tokio::net::TcpStream>>;
    type Service = Tracked<S>;
    type Future = std::future::Ready<std::io::Result<(Self::Stream, Self::Service)>>;

    fn accept(&self, stream: tokio::net::TcpStream, service: S) -> Self::Future {
        // The apiserver keeps HTTP/2 connections open and sends request after request: with
        // Nagle's algorithm a response's last small segment waits for the client's delayed ACK
        // (~40 ms per request). The unsent-bytes bound makes a client that does not read meet
        // the write timer.
        if let Err(e) = conn::tune(&stream) {
            debug!(error = %e, "cannot tune a webhook connection");
        }
        // Dropping the stream on a refusal closes it: no handshake, no buffers.
        let refuse = |reason: &'static str, message: &'static str| {
            self.metrics.refused(reason);
            std::future::ready(Err(std::io::Error::other(message)))
        };
        let client = match stream.peer_addr() {
            Ok(addr) => match PerClient::admit(&self.per_client, addr.ip()) {
                Some(place) => place,
                None => {
                    return refuse(
                        "client_connections",
                        "webhook connection cap of one client address reached; connection closed",
                    );
                }
            },
            // The peer is already gone.
            Err(_) => return refuse("connections", "the peer address is unknown"),
        };
        match self.permits.clone().try_acquire_owned() {
            Ok(permit) => {
                self.metrics.connections.inc();
                let counted = Counted {
                    inner: stream,
                    _permit: permit,
                    _client: client,
                    gauge: self.metrics.connections.clone(),
                };
                std::future::ready(Ok(conn::guard(counted, service, self.limits)))
            }
            Err(_) => refuse(
                "connections",
                "webhook connection cap reached; connection closed",
            ),
        }
    }
}

/// Open connections per client address. An address is in the table only while it holds a
/// connection, so the table never has more entries than the connection cap.
#[derive(Debug)]
pub struct PerClient {
    max: usize,
    open: Mutex<HashMap<IpAddr, usize>>,
}

/// One connection's place in [`PerClient`], given back on drop.
#[derive(Debug)]
pub struct ClientPlace {
    table: Arc<PerClient>,
    ip: IpAddr,
}

impl PerClient {
    pub fn new(max: usize) -> Self {
        Self {
            max: max.max(1),
            open: Mutex::new(HashMap::new()),
        }
    }

    /// A place for one more connection from `ip`, or `None` when it holds the most allowed.
    pub fn admit(table: &Arc<PerClient>, ip: IpAddr) -> Option<ClientPlace> {
        let mut open = table.open.lock().unwrap_or_else(PoisonError::into_inner);
        let count = open.entry(ip).or_insert(0);
        if *count >= table.max {
            return None;
        }
        *count += 1;
        Some(ClientPlace {
            table: table.clone(),
            ip,
        })
    }

    /// Connections `ip` holds now.
    pub fn open(&self, ip: IpAddr) -> usize {
        let open = self.open.lock().unwrap_or_else(PoisonError::into_inner);
        open.get(&ip).copied().unwrap_or(0)
    }

    /// Addresses holding connections now.
    pub fn clients(&self) -> usize {
        self.open
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .len()
    }
}

impl Drop for ClientPlace {
    fn drop(&mut self) {
        let mut open = self
            .table
            .open
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        if let Some(count) = open.get_mut(&self.ip) {
            *count = count.saturating_sub(1);
            if *count == 0 {
                open.remove(&self.ip);
            }
        }
    }
}

/// A connection's stream, holding its place under both caps.
struct Counted<I> {
    inner: I,
    _permit: OwnedSemaphorePermit,
    _client: ClientPlace,
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_address_holds_at_most_its_share_and_gets_places_back() {
        let table = Arc::new(PerClient::new(2));
        let pod: IpAddr = [10, 0, 0, 7].into();
        let apiserver: IpAddr = [10, 0, 0, 1].into();
        let first = PerClient::admit(&table, pod).expect("first");
        let _second = PerClient::admit(&table, pod).expect("second");
        assert!(
            PerClient::admit(&table, pod).is_none(),
            "a third is refused"
        );
        // Another address is not affected.
        let _other = PerClient::admit(&table, apiserver).expect("another address");
        assert_eq!((table.open(pod), table.clients()), (2, 2));
        drop(first);
        assert_eq!(table.open(pod), 1);
        assert!(PerClient::admit(&table, pod).is_some(), "a place came back");
    }

    #[tokio::test]
    async fn accepted_connections_send_without_delay() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let addr = listener.local_addr().expect("address");
        let client = tokio::net::TcpStream::connect(addr);
        let (accepted, _client) = tokio::join!(listener.accept(), client);
        let (stream, _) = accepted.expect("accepted");
        assert!(!stream.nodelay().expect("nodelay"), "off by default");
        let cap = ConnectionCap {
            permits: Arc::new(Semaphore::new(1)),
            per_client: Arc::new(PerClient::new(1)),
            metrics: AdmissionMetrics::new(),
            limits: Bounds::new(Duration::from_secs(1), 1).conn,
        };
        let (counted, _) = Accept::<_, ()>::accept(&cap, stream, ())
            .await
            .expect("admitted");
        assert!(counted.get_ref().inner.nodelay().expect("nodelay"));
    }

    #[test]
    fn addresses_without_connections_leave_the_table() {
        let table = Arc::new(PerClient::new(1));
        for last in 0..=255u8 {
            let place = PerClient::admit(&table, [10, 0, 1, last].into()).expect("admitted");
            drop(place);
        }
        assert_eq!(table.clients(), 0);
        // A refused address adds nothing either.
        let ip: IpAddr = [10, 0, 2, 1].into();
        let _held = PerClient::admit(&table, ip).expect("admitted");
        assert!(PerClient::admit(&table, ip).is_none());
        assert_eq!(table.clients(), 1);
    }
}
