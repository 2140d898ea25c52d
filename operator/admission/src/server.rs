//! The HTTPS listener of the webhook (axum-server + rustls with the ring provider).

use std::net::{SocketAddr, TcpListener};
use std::time::Duration;

use axum::Router;
use axum_server::Handle;
use axum_server::tls_rustls::RustlsConfig;
use tower_http::timeout::TimeoutLayer;
use tracing::{info, warn};

/// The apiserver waits at most 30 s for a webhook; nothing we do takes that long.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(30);

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

/// Serves `app` over TLS until `shutdown`, then drains in-flight requests for up to `drain`.
pub async fn serve(
    listener: TcpListener,
    app: Router,
    tls: RustlsConfig,
    drain: Duration,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) {
    let addr = listener
        .local_addr()
        .map(|a| a.to_string())
        .unwrap_or_default();
    let handle: Handle<SocketAddr> = Handle::new();
    let stopper = handle.clone();
    tokio::spawn(async move {
        shutdown.await;
        stopper.graceful_shutdown(Some(drain));
    });
    let app = app.layer(TimeoutLayer::with_status_code(
        http::StatusCode::REQUEST_TIMEOUT,
        REQUEST_TIMEOUT,
    ));
    let server = match axum_server::from_tcp_rustls(listener, tls) {
        Ok(server) => server,
        Err(e) => {
            warn!(addr, error = %e, "webhook listener failed");
            return;
        }
    };
    info!(addr, "admission webhook listening (HTTPS)");
    if let Err(e) = server.handle(handle).serve(app.into_make_service()).await {
        warn!(addr, error = %e, "webhook listener failed");
    }
    info!(addr, "admission webhook stopped");
}
