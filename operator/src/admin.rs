//! The admin listener: `GET`/`PUT /log-level` reads and replaces the log filter while the
//! operator runs. It has no authentication, so it binds loopback only: inside a pod it is
//! reached with `kubectl port-forward`, which the pods/portforward RBAC right guards.

use std::net::SocketAddr;

use axum::Router;
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use http::StatusCode;

use crate::telemetry;

/// Why an admin address is refused.
#[derive(Debug, thiserror::Error)]
pub enum AdminError {
    #[error(
        "--admin-bind-address {0} is not a loopback address: the admin listener has no authentication, reach it with kubectl port-forward"
    )]
    NotLoopback(String),
}

/// The address to bind, or `None` for "0" (off); anything but a loopback `ip:port` is refused.
pub fn address(arg: &str) -> Result<Option<SocketAddr>, AdminError> {
    if arg == "0" {
        return Ok(None);
    }
    match arg.parse::<SocketAddr>() {
        Ok(addr) if addr.ip().is_loopback() => Ok(Some(addr)),
        _ => Err(AdminError::NotLoopback(arg.to_owned())),
    }
}

pub fn router() -> Router {
    Router::new().route("/log-level", get(current).put(replace))
}

async fn current() -> Response {
    match telemetry::current_filter() {
        Some(filter) => (StatusCode::OK, format!("{filter}\n")).into_response(),
        None => (StatusCode::SERVICE_UNAVAILABLE, "no log subscriber\n").into_response(),
    }
}

async fn replace(body: String) -> Response {
    let filter = body.trim();
    if filter.is_empty() {
        return (
            StatusCode::BAD_REQUEST,
            "send a level (debug) or a RUST_LOG directive (info,pko_operator=debug)\n",
        )
            .into_response();
    }
    match telemetry::set_filter(filter) {
        Ok(()) => (StatusCode::OK, format!("{filter}\n")).into_response(),
        Err(err @ telemetry::TelemetryError::Filter { .. }) => {
            (StatusCode::BAD_REQUEST, format!("{err}\n")).into_response()
        }
        Err(err) => (StatusCode::SERVICE_UNAVAILABLE, format!("{err}\n")).into_response(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_loopback_addresses_or_off_are_taken() {
        assert_eq!(address("0").ok(), Some(None));
        assert!(matches!(address("127.0.0.1:8084"), Ok(Some(_))));
        assert!(matches!(address("[::1]:8084"), Ok(Some(_))));
        for refused in [
            "0.0.0.0:8084",
            ":8084",
            "10.0.0.1:8084",
            "localhost:8084",
            "x",
        ] {
            assert!(address(refused).is_err(), "{refused}");
        }
    }
}
