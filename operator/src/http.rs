//! A hardened HTTP/1.1 listener for axum routers: header-read and request timeouts, a bounded
//! header buffer, a cap on connection lifetime and on open connections, and a graceful drain.
//!
//! PKO's file server has no timeouts at all and shuts down with an already-cancelled context;
//! this one drains in-flight requests for a bounded time.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use hyper::server::conn::http1;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::server::graceful::GracefulShutdown;
use hyper_util::service::TowerToHyperService;
use tokio::net::TcpListener;
use tokio::sync::Semaphore;
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

/// Serve `app` on `listener` until `shutdown` resolves, then drain.
pub async fn serve(
    name: &'static str,
    listener: TcpListener,
    app: Router,
    limits: ServerLimits,
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
        let _ = stream.set_nodelay(true);
        let service = TowerToHyperService::new(app.clone());
        let mut builder = http1::Builder::new();
        builder
            .timer(TokioTimer::new())
            .header_read_timeout(limits.header_read_timeout)
            .max_buf_size(limits.max_header_bytes.max(8192))
            .keep_alive(true);
        let connection = graceful.watch(builder.serve_connection(TokioIo::new(stream), service));
        let max_age = limits.max_connection_age;
        tokio::spawn(async move {
            let _permit = permit;
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
}
