//! A hardened HTTP/1.1 listener for axum routers: header-read and request timeouts, a bounded
//! header buffer, a cap on connection lifetime, on open connections and on the connections
//! of one client address, idle and write timers on every connection, and a graceful drain.
//!
//! [`serve_tls`] is the same listener over TLS (the secure `/metrics`).
//!
//! These listeners speak HTTP/1.1 only (an HTTP/2 preface is refused), so HTTP/2's idle
//! connections cannot be held here; the webhook, which speaks both, shares the same timers
//! (`pko_admission::conn`).
//!
//! PKO's file server has no timeouts at all and shuts down with an already-cancelled context;
//! this one drains in-flight requests for a bounded time.

use std::future::Future;
use std::sync::{Arc, PoisonError, RwLock};
use std::time::Duration;

use pko_admission::conn::{self, ConnLimits};
use pko_admission::server::PerClient;

use axum::Router;
use hyper::server::conn::http1;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::server::graceful::GracefulShutdown;
use hyper_util::service::TowerToHyperService;
use tokio::net::TcpListener;
use tokio::sync::Semaphore;
use tokio_rustls::TlsAcceptor;
use tower::ServiceBuilder;
use tower_http::limit::RequestBodyLimitLayer;
use tower_http::timeout::TimeoutLayer;
use tracing::{debug, info, warn};

/// Limits of one listener.
#[derive(Clone, Debug)]
pub struct ServerLimits {
    /// Time a client gets to send a complete request head (also bounds idle keep-alive waits).
    pub header_read_timeout: Duration,
    /// Time a handler gets to produce a response.
    pub request_timeout: Duration,
    /// Longest life of one connection, however busy.
    pub max_connection_age: Duration,
    /// Largest accepted request head (request line + headers).
    pub max_header_bytes: usize,
    /// Largest accepted request body.
    pub max_body_bytes: usize,
    /// Connections served at once; further connections wait in the accept backlog.
    pub max_connections: usize,
    /// Connections one client address may hold at once; more from it are closed as soon as
    /// accepted, so one pod cannot take the slots the kubelet's probes or other tenants need.
    pub max_connections_per_client: usize,
    /// Idle (no request in flight) and write (the peer does not read) timers.
    pub conn: ConnLimits,
    /// Time in-flight requests get to finish after shutdown starts.
    pub drain_timeout: Duration,
}

impl Default for ServerLimits {
    fn default() -> Self {
        Self {
            header_read_timeout: Duration::from_secs(10),
            request_timeout: Duration::from_secs(30),
            max_connection_age: Duration::from_secs(300),
            max_header_bytes: 16 * 1024,
            max_body_bytes: 64 * 1024,
            max_connections: 1024,
            max_connections_per_client: 16,
            conn: ConnLimits {
                idle_timeout: Duration::from_secs(30),
                write_timeout: Duration::from_secs(10),
            },
            drain_timeout: Duration::from_secs(20),
        }
    }
}

/// Errors of the listener itself (handler failures are responses, not errors).
#[derive(Debug, thiserror::Error)]
pub enum ServerError {
    #[error("cannot bind {addr}: {source}")]
    Bind {
        addr: String,
        #[source]
        source: std::io::Error,
    },
}

/// Bind `addr` ("host:port"; an empty host means every interface, as in Go's ":9090").
pub async fn bind(addr: &str) -> Result<TcpListener, ServerError> {
    let normalized = match addr.strip_prefix(':') {
        Some(port) => format!("0.0.0.0:{port}"),
        None => addr.to_owned(),
    };
    TcpListener::bind(&normalized)
        .await
        .map_err(|source| ServerError::Bind {
            addr: addr.to_owned(),
            source,
        })
}

/// The TLS configuration of an HTTPS listener; replaced (a reloaded certificate) without a
/// restart, each new connection taking the current one. Cheap to clone.
#[derive(Clone)]
pub struct TlsSource(Arc<RwLock<Arc<rustls::ServerConfig>>>);

impl TlsSource {
    /// `config`, which must offer HTTP/1.1 only (these listeners speak nothing else).
    pub fn new(config: Arc<rustls::ServerConfig>) -> Self {
        Self(Arc::new(RwLock::new(config)))
    }

    pub fn replace(&self, config: Arc<rustls::ServerConfig>) {
        *self.0.write().unwrap_or_else(PoisonError::into_inner) = config;
    }

    /// The configuration new connections get.
    pub fn current(&self) -> Arc<rustls::ServerConfig> {
        self.0
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    fn acceptor(&self) -> TlsAcceptor {
        TlsAcceptor::from(self.current())
    }
}

/// Serve `app` on `listener` until `shutdown` resolves, then drain.
pub async fn serve(
    name: &'static str,
    listener: TcpListener,
    app: Router,
    limits: ServerLimits,
    shutdown: impl Future<Output = ()>,
) {
    serve_with(name, listener, app, limits, None, shutdown).await;
}

/// [`serve`] over TLS: the handshake has the header-read timeout, and every other bound holds
/// as for plain HTTP.
pub async fn serve_tls(
    name: &'static str,
    listener: TcpListener,
    app: Router,
    limits: ServerLimits,
    tls: TlsSource,
    shutdown: impl Future<Output = ()>,
) {
    serve_with(name, listener, app, limits, Some(tls), shutdown).await;
}

#[allow(
    clippy::too_many_lines,
    reason = "the accept loop: each bound where the connection reaches it"
)]
async fn serve_with(
    name: &'static str,
    listener: TcpListener,
    app: Router,
    limits: ServerLimits,
    tls: Option<TlsSource>,
    shutdown: impl Future<Output = ()>,
) {
    let app = ServiceBuilder::new()
        .layer(TimeoutLayer::with_status_code(
            http::StatusCode::SERVICE_UNAVAILABLE,
            limits.request_timeout,
        ))
        .layer(RequestBodyLimitLayer::new(limits.max_body_bytes))
        .service(app);
    let graceful = GracefulShutdown::new();
    let slots = Arc::new(Semaphore::new(limits.max_connections));
    let per_client = Arc::new(PerClient::new(limits.max_connections_per_client));
    let mut shutdown = std::pin::pin!(shutdown);
    if let Ok(addr) = listener.local_addr() {
        info!(server = name, %addr, "listening");
    }
    loop {
        let permit = tokio::select! {
            permit = slots.clone().acquire_owned() => permit,
            () = &mut shutdown => break,
        };
        let Ok(permit) = permit else { break };
        let (stream, peer) = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok(accepted) => accepted,
                Err(err) => {
                    // EMFILE and friends: back off instead of spinning.
                    warn!(server = name, error = %err, "accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
            () = &mut shutdown => break,
        };
        // Dropping the stream closes it before anything is read: a client over its share
        // holds nothing, and a global slot is only taken by an admitted connection.
        let Some(place) = PerClient::admit(&per_client, peer.ip()) else {
            debug!(server = name, %peer, "connection cap of one client address reached; closed");
            drop(stream);
            drop(permit);
            continue;
        };
        if let Err(err) = conn::tune(&stream) {
            debug!(server = name, %peer, error = %err, "cannot tune the connection");
        }
        let (stream, service) = conn::guard(stream, app.clone(), limits.conn);
        let service = TowerToHyperService::new(service);
        let mut builder = http1::Builder::new();
        builder
            .timer(TokioTimer::new())
            .header_read_timeout(limits.header_read_timeout)
            .max_buf_size(limits.max_header_bytes.max(8192))
            .keep_alive(true);
        let max_age = limits.max_connection_age;
        let Some(tls) = &tls else {
            let connection =
                graceful.watch(builder.serve_connection(TokioIo::new(stream), service));
            tokio::spawn(async move {
                let _permit = permit;
                let _place = place;
                match tokio::time::timeout(max_age, connection).await {
                    Ok(Ok(())) => {}
                    Ok(Err(err)) => debug!(server = name, %peer, error = %err, "connection ended"),
                    Err(_) => debug!(server = name, %peer, "connection reached its maximum age"),
                }
            });
            continue;
        };
        let (acceptor, watcher) = (tls.acceptor(), graceful.watcher());
        let handshake_timeout = limits.header_read_timeout;
        tokio::spawn(async move {
            let _permit = permit;
            let _place = place;
            let stream =
                match tokio::time::timeout(handshake_timeout, acceptor.accept(stream)).await {
                    Ok(Ok(stream)) => stream,
                    Ok(Err(err)) => {
                        debug!(server = name, %peer, error = %err, "TLS handshake failed");
                        return;
                    }
                    Err(_) => {
                        debug!(server = name, %peer, "TLS handshake timed out");
                        return;
                    }
                };
            let connection = watcher.watch(builder.serve_connection(TokioIo::new(stream), service));
            match tokio::time::timeout(max_age, connection).await {
                Ok(Ok(())) => {}
                Ok(Err(err)) => debug!(server = name, %peer, error = %err, "connection ended"),
                Err(_) => debug!(server = name, %peer, "connection reached its maximum age"),
            }
        });
    }
    drop(listener);
    info!(server = name, "draining");
    if tokio::time::timeout(limits.drain_timeout, graceful.shutdown())
        .await
        .is_err()
    {
        warn!(
            server = name,
            "drain timed out; closing remaining connections"
        );
    }
}

#[cfg(test)]
mod tests {
    use std::time::Instant;

    use axum::routing::get;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::net::TcpStream;

    use super::*;

    /// Timeouts no test reaches unless it is about that timeout: a slow machine must not cut
    /// off a client that is merely slow to write, or a handler the test holds.
    fn limits() -> ServerLimits {
        ServerLimits {
            header_read_timeout: Duration::from_secs(60),
            request_timeout: Duration::from_secs(60),
            drain_timeout: Duration::from_secs(60),
            conn: ConnLimits {
                idle_timeout: Duration::from_secs(600),
                write_timeout: Duration::from_secs(600),
            },
            ..ServerLimits::default()
        }
    }

    async fn start(
        app: Router,
        limits: ServerLimits,
    ) -> (
        std::net::SocketAddr,
        tokio::sync::oneshot::Sender<()>,
        tokio::task::JoinHandle<()>,
    ) {
        let listener = bind("127.0.0.1:0").await.expect("bind");
        let addr = listener.local_addr().expect("addr");
        let (tx, rx) = tokio::sync::oneshot::channel::<()>();
        let handle = tokio::spawn(serve("test", listener, app, limits, async move {
            let _ = rx.await;
        }));
        (addr, tx, handle)
    }

    #[tokio::test]
    async fn slow_request_heads_are_cut_off() {
        let header_read_timeout = Duration::from_millis(300);
        let limits = ServerLimits {
            header_read_timeout,
            ..limits()
        };
        let app = Router::new().route("/", get(|| async { "ok" }));
        let (addr, _stop, _handle) = start(app, limits).await;
        // Before connecting: the server's header timer cannot start earlier than this.
        let started = Instant::now();
        let mut stream = TcpStream::connect(addr).await.expect("connect");
        stream
            .write_all(b"GET / HTTP/1.1\r\nHost: x\r\n")
            .await
            .expect("write");
        let mut buf = Vec::new();
        // The server closes the connection (read returns EOF) once the header timeout passes.
        // Only the header timeout can close it this soon (the other limits are a minute and
        // more); the bound is 100 times that timeout, so it only catches a connection that
        // stays open, never a slow machine.
        let read =
            tokio::time::timeout(Duration::from_secs(30), stream.read_to_end(&mut buf)).await;
        assert!(read.is_ok(), "connection still open after 30 s");
        assert!(
            started.elapsed() >= header_read_timeout,
            "closed after {:?}, before the header timeout",
            started.elapsed()
        );
    }

    /// Over TLS, a client that never finishes its handshake is cut off at the header-read
    /// timeout, as a client that never sends its request head is over plain HTTP.
    #[tokio::test]
    async fn a_silent_tls_client_is_cut_off() {
        let _ = rustls::crypto::ring::default_provider().install_default();
        let (tls, _) = crate::secure_metrics::certificate(None, vec!["localhost".into()])
            .expect("certificate");
        let header_read_timeout = Duration::from_millis(300);
        let limits = ServerLimits {
            header_read_timeout,
            ..limits()
        };
        let listener = bind("127.0.0.1:0").await.expect("bind");
        let addr = listener.local_addr().expect("addr");
        let app = Router::new().route("/", get(|| async { "ok" }));
        let (_stop, rx) = tokio::sync::oneshot::channel::<()>();
        tokio::spawn(serve_tls("test", listener, app, limits, tls, async move {
            let _ = rx.await;
        }));
        let started = Instant::now();
        let mut stream = TcpStream::connect(addr).await.expect("connect");
        let mut buf = Vec::new();
        // Only the handshake timeout can close it this soon (every other limit is a minute).
        let read =
            tokio::time::timeout(Duration::from_secs(30), stream.read_to_end(&mut buf)).await;
        assert!(read.is_ok(), "connection still open after 30 s");
        assert!(
            started.elapsed() >= header_read_timeout,
            "closed after {:?}, before the handshake timeout",
            started.elapsed()
        );
    }

    #[tokio::test]
    async fn oversized_request_heads_are_rejected() {
        let app = Router::new().route("/", get(|| async { "ok" }));
        let (addr, _stop, _handle) = start(app, limits()).await;
        let mut stream = TcpStream::connect(addr).await.expect("connect");
        let huge = format!(
            "GET / HTTP/1.1\r\nHost: x\r\nX-Big: {}\r\n\r\n",
            "a".repeat(64 * 1024)
        );
        let _ = stream.write_all(huge.as_bytes()).await;
        let mut buf = Vec::new();
        let _ = tokio::time::timeout(Duration::from_secs(5), stream.read_to_end(&mut buf)).await;
        let text = String::from_utf8_lossy(&buf);
        assert!(text.starts_with("HTTP/1.1 431"), "{text}");
    }

    #[tokio::test]
    async fn shutdown_drains_in_flight_requests() {
        // The handler says when the request is in flight and holds it until the test lets it
        // go, so shutdown starts mid-request however slow the machine (no sleeps).
        let entered = Arc::new(tokio::sync::Notify::new());
        let release = Arc::new(tokio::sync::Notify::new());
        let app = Router::new().route(
            "/slow",
            get({
                let (entered, release) = (entered.clone(), release.clone());
                move || {
                    let (entered, release) = (entered.clone(), release.clone());
                    async move {
                        entered.notify_one();
                        release.notified().await;
                        "done"
                    }
                }
            }),
        );
        let (addr, stop, handle) = start(app, limits()).await;
        let request = tokio::spawn(async move {
            let mut stream = TcpStream::connect(addr).await.expect("connect");
            stream
                .write_all(b"GET /slow HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
                .await
                .expect("write");
            let mut buf = Vec::new();
            stream.read_to_end(&mut buf).await.expect("read");
            String::from_utf8_lossy(&buf).into_owned()
        });
        tokio::time::timeout(Duration::from_secs(30), entered.notified())
            .await
            .expect("the request reaches the handler");
        let _ = stop.send(());
        // Shutdown has started once the listener is closed; only then may the request finish.
        tokio::time::timeout(Duration::from_secs(30), async {
            while TcpStream::connect(addr).await.is_ok() {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        })
        .await
        .expect("the listener closes when shutdown starts");
        release.notify_one();
        let response = request.await.expect("join");
        assert!(response.starts_with("HTTP/1.1 200"), "{response}");
        assert!(response.ends_with("done"), "{response}");
        tokio::time::timeout(Duration::from_secs(5), handle)
            .await
            .expect("server stops after draining")
            .expect("join");
        assert!(
            TcpStream::connect(addr).await.is_err(),
            "still accepting after shutdown"
        );
    }

    /// The probe listener's router, /metrics included (as on a single probe address).
    fn probes() -> Router {
        crate::probes::router(
            crate::probes::Readiness::new(vec![]),
            crate::metrics::Metrics::new(),
            true,
        )
    }

    /// A TCP connection from the loopback address `source` (Linux routes 127/8 to loopback):
    /// another client address on one machine.
    async fn connect_from(source: [u8; 4], addr: std::net::SocketAddr) -> TcpStream {
        let socket = tokio::net::TcpSocket::new_v4().expect("socket");
        socket
            .bind((std::net::Ipv4Addr::from(source), 0).into())
            .expect("bind");
        socket.connect(addr).await.expect("connect")
    }

    /// `GET path` with Connection: close from 127.0.0.1; the whole answer, or what arrived
    /// within a bound no answering server comes near.
    async fn get_answer(addr: std::net::SocketAddr, path: &str) -> String {
        let exchange = async {
            let mut stream = TcpStream::connect(addr).await.ok()?;
            let request = format!("GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n");
            stream.write_all(request.as_bytes()).await.ok()?;
            let mut buf = Vec::new();
            stream.read_to_end(&mut buf).await.ok()?;
            Some(String::from_utf8_lossy(&buf).into_owned())
        };
        match tokio::time::timeout(Duration::from_secs(20), exchange).await {
            Ok(Some(answer)) => answer,
            Ok(None) => "connection failed".to_owned(),
            Err(_) => "no answer within 20 s".to_owned(),
        }
    }

    /// One address holding connections open gets its share; the kubelet (another address)
    /// is still answered.
    #[tokio::test]
    async fn one_client_address_cannot_take_every_slot() {
        let limits = ServerLimits {
            max_connections: 4,
            max_connections_per_client: 2,
            ..limits()
        };
        let (addr, _stop, _handle) = start(probes(), limits).await;
        // Eight silent connections from one pod; without a per-client cap the first four take
        // every slot for as long as the header timeout (a minute here).
        let mut held = Vec::new();
        for _ in 0..8 {
            held.push(connect_from([127, 0, 0, 2], addr).await);
        }
        let answer = get_answer(addr, "/readyz").await;
        assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
        // The pod's connections beyond its share were closed without a byte.
        let mut closed = 0;
        for stream in &mut held {
            let mut byte = [0u8; 1];
            if let Ok(Ok(0) | Err(_)) =
                tokio::time::timeout(Duration::from_millis(50), stream.read(&mut byte)).await
            {
                closed += 1;
            }
        }
        assert!(closed >= 6, "{closed} of 8 closed");
    }

    /// A reader that does not read (pipelined /metrics requests, answers never read) is cut
    /// off by the write timeout, so its connection and place come back.
    #[tokio::test]
    async fn a_slow_reader_of_metrics_is_cut_off() {
        let limits = ServerLimits {
            conn: ConnLimits {
                write_timeout: Duration::from_millis(300),
                ..limits().conn
            },
            ..limits()
        };
        let (addr, _stop, _handle) = start(probes(), limits).await;
        let mut stream = connect_from([127, 0, 0, 2], addr).await;
        let writer = tokio::spawn(async move {
            let requests = "GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n".repeat(256);
            // Ends once the server has closed the connection (the write fails); a server
            // that waits on the reader forever leaves it blocked.
            loop {
                if let Err(err) = stream.write_all(requests.as_bytes()).await {
                    return err;
                }
            }
        });
        // Meanwhile the probe is answered.
        let answer = get_answer(addr, "/healthz").await;
        assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
        let ended = tokio::time::timeout(Duration::from_secs(60), writer).await;
        assert!(ended.is_ok(), "the slow reader still holds its connection");
    }

    /// A reader that pipelines requests for tiny answers and never reads meets the write timer
    /// after a bounded number of answers: its own receive window, the unsent-bytes bound and
    /// hyper's buffer. Without the bound the kernel's autotuned send buffer (up to 4 MiB by
    /// default) took every answer, and the server produced megabytes of them before any write
    /// blocked. The measure is bytes produced, so the machine's speed does not enter.
    #[tokio::test]
    async fn a_slow_reader_of_tiny_answers_gets_a_bounded_share_before_it_is_cut_off() {
        let answered = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let app = Router::new().route(
            "/tiny",
            get({
                let answered = answered.clone();
                move || {
                    answered.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    async { "ok" }
                }
            }),
        );
        let limits = ServerLimits {
            conn: ConnLimits {
                write_timeout: Duration::from_millis(300),
                ..limits().conn
            },
            ..limits()
        };
        let (addr, _stop, _handle) = start(app, limits).await;
        let one = get_answer(addr, "/tiny").await;
        assert!(one.starts_with("HTTP/1.1 200"), "{one}");
        answered.store(0, std::sync::atomic::Ordering::Relaxed);

        // The client's receive buffer is fixed, so the bound does not follow the host's
        // tcp_rmem default.
        let socket = tokio::net::TcpSocket::new_v4().expect("socket");
        socket.set_recv_buffer_size(64 * 1024).expect("SO_RCVBUF");
        let mut stream = socket.connect(addr).await.expect("connect");
        let writer = tokio::spawn(async move {
            let requests = "GET /tiny HTTP/1.1\r\nHost: x\r\n\r\n".repeat(256);
            loop {
                if let Err(err) = stream.write_all(requests.as_bytes()).await {
                    return err;
                }
            }
        });
        // Only catches a connection that stays open: the timer is 300 ms.
        let ended = tokio::time::timeout(Duration::from_secs(120), writer).await;
        assert!(ended.is_ok(), "the slow reader still holds its connection");
        let produced = answered.load(std::sync::atomic::Ordering::Relaxed) * one.len();
        assert!(
            produced < 1024 * 1024,
            "{produced} bytes of answers produced for a reader that reads none"
        );
    }

    /// A keep-alive connection without a request in flight is closed after the idle timeout.
    #[tokio::test]
    async fn an_idle_keep_alive_connection_is_closed() {
        let limits = ServerLimits {
            conn: ConnLimits {
                idle_timeout: Duration::from_millis(300),
                ..limits().conn
            },
            ..limits()
        };
        let (addr, _stop, _handle) = start(probes(), limits).await;
        let mut stream = TcpStream::connect(addr).await.expect("connect");
        stream
            .write_all(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
            .await
            .expect("write");
        let mut buf = Vec::new();
        let mut chunk = [0u8; 1024];
        while !String::from_utf8_lossy(&buf).ends_with("\r\n\r\nok\n") {
            let n = stream.read(&mut chunk).await.expect("read");
            assert!(n > 0, "closed before the answer");
            buf.extend_from_slice(&chunk[..n]);
        }
        // Idle now: the server closes it (a minute before the header timeout would).
        let read = tokio::time::timeout(Duration::from_secs(30), stream.read(&mut chunk)).await;
        assert!(
            matches!(read, Ok(Ok(0) | Err(_))),
            "still open after 30 s: {read:?}"
        );
    }
}
