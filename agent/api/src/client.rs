//! Connecting to an agent: TLS pinned to the workspace's own certificate, bearer token on every
//! call. Used by the operator and the tests.

use std::time::Duration;

use tonic::metadata::{Ascii, MetadataValue};
use tonic::service::interceptor::InterceptedService;
use tonic::transport::{Certificate, Channel, ClientTlsConfig, Endpoint};
use tonic::{Request, Status};

use crate::proto::automation_service_client::AutomationServiceClient;

/// A connected client.
pub type AgentClient = AutomationServiceClient<InterceptedService<Channel, BearerToken>>;

/// Failures to connect.
#[derive(Debug, thiserror::Error)]
pub enum ConnectError {
    #[error("invalid agent address {address:?}: {detail}")]
    Address { address: String, detail: String },
    #[error("invalid TLS settings: {0}")]
    Tls(String),
    #[error("cannot connect to the agent at {address}: {detail}")]
    Connect { address: String, detail: String },
    #[error("the bearer token is not a valid header value")]
    Token,
}

/// How to reach one agent.
#[derive(Clone, Debug)]
pub struct Target {
    /// `host:port`.
    pub address: String,
    /// PEM certificate the agent must present (pinned as the only trusted root); plaintext
    /// when `None`.
    pub ca_pem: Option<Vec<u8>>,
    /// Name checked against the certificate (also sent as SNI).
    pub server_name: Option<String>,
    pub token: Option<String>,
    pub connect_timeout: Duration,
}

/// Adds `authorization: Bearer <token>` to every call.
#[derive(Clone)]
pub struct BearerToken(Option<MetadataValue<Ascii>>);

impl tonic::service::Interceptor for BearerToken {
    fn call(&mut self, mut request: Request<()>) -> Result<Request<()>, Status> {
        if let Some(v) = &self.0 {
            request.metadata_mut().insert("authorization", v.clone());
        }
        Ok(request)
    }
}

/// Connects (eagerly, so a dead agent is reported here rather than at the first call).
pub async fn connect(target: &Target) -> Result<AgentClient, ConnectError> {
    let scheme = if target.ca_pem.is_some() {
        "https"
    } else {
        "http"
    };
    let uri = format!("{scheme}://{}", target.address);
    let mut endpoint = Endpoint::from_shared(uri).map_err(|e| ConnectError::Address {
        address: target.address.clone(),
        detail: e.to_string(),
    })?;
    endpoint = endpoint
        .connect_timeout(target.connect_timeout)
        .tcp_nodelay(true)
        .http2_keep_alive_interval(Duration::from_secs(30))
        .keep_alive_timeout(Duration::from_secs(20))
        .keep_alive_while_idle(true);
    if let Some(ca) = &target.ca_pem {
        let mut tls = ClientTlsConfig::new().ca_certificate(Certificate::from_pem(ca));
        if let Some(name) = &target.server_name {
            tls = tls.domain_name(name.clone());
        }
        endpoint = endpoint
            .tls_config(tls)
            .map_err(|e| ConnectError::Tls(e.to_string()))?;
    }
    let channel = endpoint
        .connect()
        .await
        .map_err(|e| ConnectError::Connect {
            address: target.address.clone(),
            detail: error_chain(&e),
        })?;
    let token = match &target.token {
        Some(t) => Some(
            format!("Bearer {}", t.trim())
                .parse::<MetadataValue<Ascii>>()
                .map_err(|_| ConnectError::Token)?,
        ),
        None => None,
    };
    // One bound both ways: an answer over it fails its call (OutOfRange) instead of costing
    // the caller its memory.
    Ok(
        AutomationServiceClient::with_interceptor(channel, BearerToken(token))
            .max_decoding_message_size(crate::MAX_MESSAGE_BYTES)
            .max_encoding_message_size(crate::MAX_MESSAGE_BYTES),
    )
}

/// An error with its sources, for messages that say why a connection failed.
pub fn error_chain(e: &dyn std::error::Error) -> String {
    let mut text = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        let s_text = s.to_string();
        if !text.contains(&s_text) {
            text.push_str(": ");
            text.push_str(&s_text);
        }
        source = s.source();
    }
    text
}
