//! Reaching workspace agents: per-workspace credentials (bearer token + TLS key pair, minted
//! here, kept in a Secret the pod mounts) and cached gRPC connections. Under PKO's contract
//! (`controller/workspace/compat.rs`) the agent is called over plaintext with a token of the
//! operator's own service account for the workspace's audience, minted by TokenRequest and
//! cached until five minutes before it expires, as PKO's manager does.
//!
//! A connection unused for [`CONNECTION_IDLE`] is dropped from the cache (the heap profile of
//! a 40-Stack fleet: each open connection held about 85 KiB of TLS and HTTP/2 buffers, the
//! largest cost of an idle Stack); the next call dials again.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use k8s_openapi::ByteString;
use k8s_openapi::api::apps::v1::StatefulSet;
use k8s_openapi::api::authentication::v1::{TokenRequest, TokenRequestSpec};
use k8s_openapi::api::core::v1::{Secret, ServiceAccount};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference;
use kube::api::{Api, PostParams};
use kube::{Client, ResourceExt};
use pko_agent_api::client::{AgentClient, ConnectError, Target, connect};
use sha2::{Digest, Sha256};

use crate::controller::keys::DEV_PORT_ANNOTATION;
use crate::controller::workspace::pod;

/// Failures to reach an agent.
#[derive(Debug, thiserror::Error)]
pub enum AgentError {
    #[error("cannot read or create the agent credentials {name}: {source}")]
    Credentials {
        name: String,
        #[source]
        source: kube::Error,
    },
    #[error("the agent credentials {0} are incomplete (token, tls.crt, tls.key)")]
    BadCredentials(String),
    #[error("cannot mint a certificate: {0}")]
    Mint(#[from] rcgen::Error),
    #[error("no development port annotation ({DEV_PORT_ANNOTATION}) on {0} yet")]
    NoDevPort(String),
    #[error(transparent)]
    Connect(#[from] ConnectError),
    #[error(
        "the workspace asks for PKO's auth mode, but the operator does not know its own service account: set --service-account-name (POD_SA_NAME) and --service-account-namespace (POD_NAMESPACE)"
    )]
    NoServiceAccount,
    #[error(
        "the apiserver minted no token of the service account {account} for audience {audience}"
    )]
    NoToken { account: String, audience: String },
    #[error(
        "cannot mint a token of the service account {account} for audience {audience}: {source}"
    )]
    TokenRequest {
        account: String,
        audience: String,
        #[source]
        source: kube::Error,
    },
}

/// How the operator proves itself to one workspace's agent.
#[derive(Clone, Debug)]
pub enum AgentAuth {
    /// pko-rs's: TLS pinned to the workspace's certificate, its random token.
    Pinned(Credentials),
    /// PKO's: plaintext, a token of the operator's service account for this audience.
    Kube { audience: String },
}

/// The operator's service account, whose tokens PKO-mode agents review.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ServiceAccountRef {
    pub namespace: String,
    pub name: String,
}

impl std::fmt::Display for ServiceAccountRef {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}/{}", self.namespace, self.name)
    }
}

/// A token is renewed this long before it expires (PKO's leeway).
const TOKEN_LEEWAY: Duration = Duration::from_secs(300);
/// Tokens asked for live this long.
const TOKEN_LIFETIME_SECONDS: i64 = 3600;
/// A cached token unused this long is dropped (PKO prunes after two hours).
const TOKEN_UNUSED: Duration = Duration::from_secs(2 * 3600);

/// A cached agent connection unused this long is dropped (a call in flight keeps its own).
/// Shorter than the Workspace controller's minute between checks of a ready agent, so a fleet
/// at rest holds no connection between them: each check dials again (one TLS handshake a
/// minute per workspace, against ~85 KiB held per workspace all the time).
pub const CONNECTION_IDLE: Duration = Duration::from_secs(40);

/// One cached connection: who it was made for (address and credentials), when last handed out.
struct CachedClient {
    identity: String,
    client: AgentClient,
    used: Instant,
}

/// Whether a connection last handed out at `used` has been idle long enough to drop at `now`.
fn idle(used: Instant, now: Instant) -> bool {
    now.saturating_duration_since(used) >= CONNECTION_IDLE
}

/// One cached token: its text, when it must be renewed, when it was last used.
struct CachedToken {
    token: String,
    renew_at: Instant,
    expires_at: Instant,
    used: Instant,
}

/// The agent credentials of one workspace.
#[derive(Clone, Debug)]
pub struct Credentials {
    pub token: String,
    pub cert_pem: Vec<u8>,
    /// Short hash of the certificate: changes when the credentials are re-minted.
    pub fingerprint: String,
}

/// Connections to agents, cached per workspace.
pub struct Agents {
    client: Client,
    localhost: Option<String>,
    cache: Mutex<HashMap<String, CachedClient>>,
    service_account: Option<ServiceAccountRef>,
    /// Audience → token of [`Self::service_account`].
    tokens: Mutex<HashMap<String, CachedToken>>,
}

impl Agents {
    /// `localhost`: PKO's `WORKSPACE_LOCALHOST` (development): `host:port` sends every call
    /// there; a bare `host` uses the port the development kubelet annotates.
    /// `service_account`: the operator's own, for PKO's auth mode.
    pub fn new(
        client: Client,
        localhost: Option<String>,
        service_account: Option<ServiceAccountRef>,
    ) -> Self {
        Self {
            client,
            localhost: localhost.filter(|l| !l.is_empty()),
            cache: Mutex::new(HashMap::new()),
            service_account,
            tokens: Mutex::new(HashMap::new()),
        }
    }

    /// The operator's service account, if known.
    pub fn service_account(&self) -> Option<&ServiceAccountRef> {
        self.service_account.as_ref()
    }

    /// A token of the operator's service account for `audience`: the cached one until five
    /// minutes before it expires, then a new one (the old one while it lasts if the apiserver
    /// cannot mint one).
    pub async fn token_for(&self, audience: &str) -> Result<String, AgentError> {
        let account = self
            .service_account
            .clone()
            .ok_or(AgentError::NoServiceAccount)?;
        let now = Instant::now();
        let stale = {
            let mut tokens = self.tokens_lock();
            tokens.retain(|_, t| now.duration_since(t.used) < TOKEN_UNUSED);
            match tokens.get_mut(audience) {
                Some(t) if now < t.renew_at => {
                    t.used = now;
                    return Ok(t.token.clone());
                }
                Some(t) if now < t.expires_at => Some(t.token.clone()),
                _ => None,
            }
        };
        let api: Api<ServiceAccount> = Api::namespaced(self.client.clone(), &account.namespace);
        let request = TokenRequest {
            spec: TokenRequestSpec {
                audiences: vec![audience.to_owned()],
                expiration_seconds: Some(TOKEN_LIFETIME_SECONDS),
                bound_object_ref: None,
            },
            ..TokenRequest::default()
        };
        let minted = match api
            .create_token_request(&account.name, &PostParams::default(), &request)
            .await
        {
            Ok(minted) => minted,
            Err(e) => {
                return stale.ok_or_else(|| AgentError::TokenRequest {
                    account: account.to_string(),
                    audience: audience.to_owned(),
                    source: e,
                });
            }
        };
        let Some(status) = minted.status else {
            return stale.ok_or_else(|| AgentError::NoToken {
                account: account.to_string(),
                audience: audience.to_owned(),
            });
        };
        // What the apiserver granted (it may shorten the lifetime asked for); a time already
        // past counts as none.
        let lifetime = status
            .expiration_timestamp
            .0
            .duration_since(jiff::Timestamp::now());
        let lifetime = Duration::try_from(lifetime).unwrap_or_default();
        let cached = CachedToken {
            token: status.token.clone(),
            renew_at: now + lifetime.saturating_sub(TOKEN_LEEWAY),
            expires_at: now + lifetime,
            used: now,
        };
        self.tokens_lock().insert(audience.to_owned(), cached);
        Ok(status.token)
    }

    fn tokens_lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, CachedToken>> {
        self.tokens
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Reads the workspace's credentials Secret, creating it (owned by the Workspace) if missing.
    pub async fn ensure_credentials(
        &self,
        workspace: &str,
        namespace: &str,
        owner: Option<&OwnerReference>,
    ) -> Result<Credentials, AgentError> {
        let name = pod::credentials_name(workspace);
        let api: Api<Secret> = Api::namespaced(self.client.clone(), namespace);
        let err = |source| AgentError::Credentials {
            name: name.clone(),
            source,
        };
        let secret = match api.get_opt(&name).await.map_err(err)? {
            Some(s) => s,
            None => {
                let minted = mint(workspace, namespace, owner)?;
                match api.create(&PostParams::default(), &minted).await {
                    Ok(s) => s,
                    // Another replica (or a retry) made it first.
                    Err(kube::Error::Api(e)) if e.code == 409 => {
                        api.get(&name).await.map_err(err)?
                    }
                    Err(e) => return Err(err(e)),
                }
            }
        };
        let data = secret.data.unwrap_or_default();
        let field = |k: &str| data.get(k).map(|b| b.0.clone()).filter(|b| !b.is_empty());
        match (field("token"), field("tls.crt"), field("tls.key")) {
            (Some(token), Some(cert), Some(_)) => Ok(Credentials {
                token: String::from_utf8_lossy(&token).trim().to_owned(),
                fingerprint: hex::encode(Sha256::digest(&cert))[..16].to_owned(),
                cert_pem: cert,
            }),
            _ => Err(AgentError::BadCredentials(name)),
        }
    }

    /// The address dialed for a workspace (written to `status.address`).
    pub fn address(
        &self,
        workspace: &str,
        namespace: &str,
        sts: &StatefulSet,
    ) -> Result<String, AgentError> {
        match &self.localhost {
            Some(l) if l.contains(':') => Ok(l.clone()),
            Some(host) => {
                let port = sts
                    .annotations()
                    .get(DEV_PORT_ANNOTATION)
                    .ok_or_else(|| AgentError::NoDevPort(sts.name_any()))?;
                Ok(format!("{host}:{port}"))
            }
            None => Ok(format!(
                "{}.{namespace}:{}",
                pod::workload_name(workspace),
                pod::AGENT_PORT
            )),
        }
    }

    /// A client for the workspace's agent (cached while address and credentials stay).
    pub async fn client(
        &self,
        workspace: &str,
        namespace: &str,
        address: &str,
        auth: &AgentAuth,
    ) -> Result<AgentClient, AgentError> {
        let key = format!("{namespace}/{workspace}");
        let target = match auth {
            AgentAuth::Pinned(credentials) => Target {
                address: address.to_owned(),
                ca_pem: Some(credentials.cert_pem.clone()),
                server_name: Some(pod::server_name(workspace, namespace)),
                token: Some(credentials.token.clone()),
                connect_timeout: Duration::from_secs(5),
            },
            AgentAuth::Kube { audience } => Target {
                address: address.to_owned(),
                ca_pem: None,
                server_name: None,
                token: Some(self.token_for(audience).await?),
                connect_timeout: Duration::from_secs(5),
            },
        };
        // A renewed token or re-minted credentials make a new connection.
        let secret = match auth {
            AgentAuth::Pinned(c) => c.fingerprint.clone(),
            AgentAuth::Kube { .. } => {
                let token = target.token.as_deref().unwrap_or_default();
                hex::encode(Sha256::digest(token.as_bytes()))[..16].to_owned()
            }
        };
        let identity = format!("{address}|{secret}");
        if let Some(cached) = self.lock().get_mut(&key)
            && cached.identity == identity
        {
            cached.used = Instant::now();
            return Ok(cached.client.clone());
        }
        let client = connect(&target).await?;
        let cached = CachedClient {
            identity,
            client: client.clone(),
            used: Instant::now(),
        };
        self.lock().insert(key, cached);
        Ok(client)
    }

    /// Drops the connections idle for [`CONNECTION_IDLE`]; how many.
    pub fn close_idle(&self) -> usize {
        let now = Instant::now();
        let mut cache = self.lock();
        let before = cache.len();
        cache.retain(|_, c| !idle(c.used, now));
        before - cache.len()
    }

    /// Drops idle connections every quarter [`CONNECTION_IDLE`] until `agents` is dropped.
    pub fn spawn_idle_sweep(agents: &std::sync::Arc<Self>) {
        let weak = std::sync::Arc::downgrade(agents);
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(CONNECTION_IDLE / 4);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tick.tick().await;
                let Some(agents) = weak.upgrade() else { return };
                let closed = agents.close_idle();
                if closed > 0 {
                    tracing::debug!(closed, "closed idle agent connections");
                }
            }
        });
    }

    /// Drops a cached connection (after a transport error).
    pub fn forget(&self, workspace: &str, namespace: &str) {
        self.lock().remove(&format!("{namespace}/{workspace}"));
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, CachedClient>> {
        self.cache
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

/// A new credentials Secret: a random 256-bit token and a self-signed certificate for the
/// workspace's Service name.
fn mint(
    workspace: &str,
    namespace: &str,
    owner: Option<&OwnerReference>,
) -> Result<Secret, AgentError> {
    let service = pod::workload_name(workspace);
    let names = vec![
        pod::server_name(workspace, namespace),
        format!("{service}.{namespace}.svc"),
        format!("{service}.{namespace}.svc.cluster.local"),
    ];
    let cert = rcgen::generate_simple_self_signed(names)?;
    let token = hex::encode(rand::random::<[u8; 32]>());
    Ok(Secret {
        metadata: kube::api::ObjectMeta {
            name: Some(pod::credentials_name(workspace)),
            namespace: Some(namespace.to_owned()),
            labels: Some(pod::labels(workspace)),
            owner_references: owner.map(|o| vec![o.clone()]),
            ..Default::default()
        },
        type_: Some("Opaque".into()),
        data: Some(
            [
                ("token", token.into_bytes()),
                ("tls.crt", cert.cert.pem().into_bytes()),
                ("tls.key", cert.signing_key.serialize_pem().into_bytes()),
            ]
            .into_iter()
            .map(|(k, v)| (k.to_owned(), ByteString(v)))
            .collect(),
        ),
        ..Default::default()
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_connection_is_idle_after_the_idle_period_and_not_before() {
        let used = Instant::now();
        assert!(!idle(used, used));
        assert!(!idle(
            used,
            used + CONNECTION_IDLE - Duration::from_millis(1)
        ));
        assert!(idle(used, used + CONNECTION_IDLE));
        // A use stamped after `now` (a racing hand-out) is not idle.
        assert!(!idle(used + Duration::from_secs(1), used));
    }
}
