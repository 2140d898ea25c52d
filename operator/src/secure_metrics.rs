//! `/metrics` over HTTPS for authenticated and authorized clients only (`--metrics-secure`), as
//! PKO serves it: the bearer token of each request is authenticated by a TokenReview, its user
//! authorized by a SubjectAccessReview for `get` on the non-resource URL `/metrics` (what a
//! `metrics-reader` ClusterRole grants), both answered by the apiserver. No token is 401, a
//! token the apiserver does not accept is 401, a user without the grant is 403, each with a
//! body that says what to do.
//!
//! Decisions are cached for short times (a token's review for a minute, an allowed user for a
//! minute, a denied one for ten seconds), in bounded caches keyed by hashes (no token is kept),
//! so a scraper costs the apiserver about one review of each kind per minute and replica; at
//! most [`MAX_REVIEWS`] reviews run at once, so a client sending random tokens waits on them
//! rather than flooding the apiserver. The TLS certificate is a mounted one (`tls.crt`,
//! `tls.key`, reloaded when they change) or, without one, self-signed at start.

use std::collections::{BTreeMap, HashMap};
use std::hash::Hash;
use std::path::PathBuf;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use axum::Router;
use axum::extract::{Request, State};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use http::{HeaderValue, StatusCode, header};
use k8s_openapi::api::authentication::v1::{TokenReview, TokenReviewSpec};
use k8s_openapi::api::authorization::v1::{
    NonResourceAttributes, SubjectAccessReview, SubjectAccessReviewSpec,
};
use kube::Client;
use kube::api::{Api, PostParams};
use pko_admission::tls::{CertBundle, CertFiles};
use sha2::{Digest, Sha256};
use tokio::sync::Semaphore;
use tracing::{debug, info};

use crate::http::TlsSource;
use crate::metrics::Metrics;

/// Reviews (TokenReview or SubjectAccessReview) in flight at once.
pub const MAX_REVIEWS: usize = 4;
/// Entries of each decision cache.
const MAX_ENTRIES: usize = 1024;
/// Longest token accepted (service account tokens are ~1 KiB).
const MAX_TOKEN_BYTES: usize = 8192;

/// Errors of the secure metrics setup.
#[derive(Debug, thiserror::Error)]
pub enum SecureMetricsError {
    #[error("metrics TLS certificate: {0}")]
    Tls(#[from] pko_admission::tls::TlsError),
    #[error("cannot make a self-signed metrics certificate: {0}")]
    SelfSigned(#[from] rcgen::Error),
}

/// How long decisions are reused.
#[derive(Clone, Copy, Debug)]
pub struct Ttls {
    /// A token's review (accepted or not).
    pub token: Duration,
    /// A user allowed to read.
    pub allowed: Duration,
    /// A user denied.
    pub denied: Duration,
}

impl Default for Ttls {
    fn default() -> Self {
        Self {
            token: Duration::from_secs(60),
            allowed: Duration::from_secs(60),
            denied: Duration::from_secs(10),
        }
    }
}

/// Who a token belongs to, as the apiserver's TokenReview says.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Identity {
    pub username: String,
    pub uid: Option<String>,
    pub groups: Vec<String>,
    pub extra: BTreeMap<String, Vec<String>>,
}

/// Why a request is not answered.
#[derive(Debug, PartialEq, Eq)]
pub enum Refusal {
    /// No `Authorization: Bearer` header.
    NoToken,
    /// A token the apiserver did not authenticate (or not a token at all).
    BadToken,
    /// The user may not `get` the path.
    Forbidden { user: String, path: String },
    /// A review could not be made.
    Unavailable(String),
}

impl Refusal {
    fn status(&self) -> StatusCode {
        match self {
            Self::NoToken | Self::BadToken => StatusCode::UNAUTHORIZED,
            Self::Forbidden { .. } => StatusCode::FORBIDDEN,
            Self::Unavailable(_) => StatusCode::INTERNAL_SERVER_ERROR,
        }
    }

    fn body(&self) -> String {
        match self {
            Self::NoToken => "Unauthorized: /metrics needs a bearer token (Authorization: Bearer <service account token>)\n".to_owned(),
            Self::BadToken => "Unauthorized: the bearer token was not authenticated by the Kubernetes API server (TokenReview)\n".to_owned(),
            Self::Forbidden { user, path } => format!(
                "Forbidden: user {user:?} may not get {path} (bind it to a ClusterRole granting nonResourceURLs [{path}] verbs [get], such as pko-rs-metrics-reader)\n"
            ),
            Self::Unavailable(why) => format!("Authentication or authorization failed: {why}\n"),
        }
    }
}

impl IntoResponse for Refusal {
    fn into_response(self) -> Response {
        let mut response = (self.status(), self.body()).into_response();
        if self.status() == StatusCode::UNAUTHORIZED {
            response.headers_mut().insert(
                header::WWW_AUTHENTICATE,
                HeaderValue::from_static("Bearer realm=\"pko-rs metrics\""),
            );
        }
        response
    }
}

/// The token of an `Authorization: Bearer <token>` header.
pub fn bearer_token(value: Option<&HeaderValue>) -> Result<&str, Refusal> {
    let value = value.ok_or(Refusal::NoToken)?;
    let text = value.to_str().map_err(|_| Refusal::BadToken)?;
    let (scheme, token) = text.split_once(' ').ok_or(Refusal::NoToken)?;
    if !scheme.eq_ignore_ascii_case("bearer") {
        return Err(Refusal::NoToken);
    }
    let token = token.trim();
    if token.is_empty() || token.len() > MAX_TOKEN_BYTES {
        return Err(Refusal::BadToken);
    }
    Ok(token)
}

/// A map whose entries expire, bounded: when full, expired entries go first, then the one
/// closest to expiring.
#[derive(Debug)]
pub struct TtlCache<K, V> {
    entries: HashMap<K, (Instant, V)>,
    max: usize,
}

impl<K: Hash + Eq + Clone, V: Clone> TtlCache<K, V> {
    pub fn new(max: usize) -> Self {
        Self {
            entries: HashMap::new(),
            max: max.max(1),
        }
    }

    pub fn get(&mut self, key: &K, now: Instant) -> Option<V> {
        match self.entries.get(key) {
            Some((expires, value)) if *expires > now => Some(value.clone()),
            Some(_) => {
                self.entries.remove(key);
                None
            }
            None => None,
        }
    }

    pub fn insert(&mut self, key: K, value: V, ttl: Duration, now: Instant) {
        if self.entries.len() >= self.max && !self.entries.contains_key(&key) {
            self.entries.retain(|_, (expires, _)| *expires > now);
            if self.entries.len() >= self.max
                && let Some(soonest) = self
                    .entries
                    .iter()
                    .min_by_key(|(_, (expires, _))| *expires)
                    .map(|(k, _)| k.clone())
            {
                self.entries.remove(&soonest);
            }
        }
        self.entries.insert(key, (now + ttl, value));
    }

    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }
}

type Digest32 = [u8; 32];

/// Authenticates and authorizes requests through the apiserver, with cached decisions.
pub struct MetricsAuth {
    client: Client,
    ttls: Ttls,
    tokens: Mutex<TtlCache<Digest32, Option<Identity>>>,
    decisions: Mutex<TtlCache<Digest32, bool>>,
    reviews: Semaphore,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    // A cache is consistent after every call; a panic elsewhere does not poison it.
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

fn digest(parts: &[&[u8]]) -> Digest32 {
    let mut hasher = Sha256::new();
    for part in parts {
        // Length-prefixed, so no two part lists hash alike.
        hasher.update((part.len() as u64).to_be_bytes());
        hasher.update(part);
    }
    hasher.finalize().into()
}

impl MetricsAuth {
    pub fn new(client: Client, ttls: Ttls) -> Self {
        Self {
            client,
            ttls,
            tokens: Mutex::new(TtlCache::new(MAX_ENTRIES)),
            decisions: Mutex::new(TtlCache::new(MAX_ENTRIES)),
            reviews: Semaphore::new(MAX_REVIEWS),
        }
    }

    /// Whether the request with this `Authorization` header may `verb` `path`.
    pub async fn authorize(
        &self,
        authorization: Option<&HeaderValue>,
        verb: &str,
        path: &str,
    ) -> Result<Identity, Refusal> {
        let token = bearer_token(authorization)?;
        let identity = self.authenticate(token).await?.ok_or(Refusal::BadToken)?;
        if self.allowed(&identity, verb, path).await? {
            Ok(identity)
        } else {
            Err(Refusal::Forbidden {
                user: identity.username,
                path: path.to_owned(),
            })
        }
    }

    async fn authenticate(&self, token: &str) -> Result<Option<Identity>, Refusal> {
        let key = digest(&[token.as_bytes()]);
        if let Some(known) = lock(&self.tokens).get(&key, Instant::now()) {
            return Ok(known);
        }
        let _slot = self
            .reviews
            .acquire()
            .await
            .map_err(|_| Refusal::Unavailable("the operator is shutting down".to_owned()))?;
        let review = TokenReview {
            spec: TokenReviewSpec {
                token: Some(token.to_owned()),
                ..TokenReviewSpec::default()
            },
            ..TokenReview::default()
        };
        let answer = Api::<TokenReview>::all(self.client.clone())
            .create(&PostParams::default(), &review)
            .await
            .map_err(|e| Refusal::Unavailable(format!("TokenReview: {e}")))?;
        let identity = answer
            .status
            .filter(|s| s.authenticated == Some(true))
            .and_then(|s| s.user)
            .and_then(|user| {
                Some(Identity {
                    username: user.username.filter(|u| !u.is_empty())?,
                    uid: user.uid,
                    groups: user.groups.unwrap_or_default(),
                    extra: user.extra.unwrap_or_default(),
                })
            });
        lock(&self.tokens).insert(key, identity.clone(), self.ttls.token, Instant::now());
        Ok(identity)
    }

    async fn allowed(&self, who: &Identity, verb: &str, path: &str) -> Result<bool, Refusal> {
        let extra = serde_json::to_vec(&who.extra).unwrap_or_default();
        let groups = who.groups.join("\n");
        let key = digest(&[
            who.username.as_bytes(),
            who.uid.as_deref().unwrap_or_default().as_bytes(),
            groups.as_bytes(),
            &extra,
            verb.as_bytes(),
            path.as_bytes(),
        ]);
        if let Some(known) = lock(&self.decisions).get(&key, Instant::now()) {
            return Ok(known);
        }
        let _slot = self
            .reviews
            .acquire()
            .await
            .map_err(|_| Refusal::Unavailable("the operator is shutting down".to_owned()))?;
        let review = SubjectAccessReview {
            spec: SubjectAccessReviewSpec {
                user: Some(who.username.clone()),
                uid: who.uid.clone(),
                groups: Some(who.groups.clone()),
                extra: Some(who.extra.clone()),
                non_resource_attributes: Some(NonResourceAttributes {
                    path: Some(path.to_owned()),
                    verb: Some(verb.to_owned()),
                }),
                ..SubjectAccessReviewSpec::default()
            },
            ..SubjectAccessReview::default()
        };
        let answer = Api::<SubjectAccessReview>::all(self.client.clone())
            .create(&PostParams::default(), &review)
            .await
            .map_err(|e| Refusal::Unavailable(format!("SubjectAccessReview: {e}")))?;
        let allowed = answer
            .status
            .is_some_and(|s| s.allowed && s.denied != Some(true));
        let ttl = if allowed {
            self.ttls.allowed
        } else {
            self.ttls.denied
        };
        lock(&self.decisions).insert(key, allowed, ttl, Instant::now());
        Ok(allowed)
    }
}

/// The secure listener's router: `/metrics` for authorized clients, nothing else.
pub fn router(metrics: Metrics, auth: Arc<MetricsAuth>) -> Router {
    Router::new()
        .route(
            "/metrics",
            get(|State(metrics): State<Metrics>| async move {
                crate::probes::metrics_response(&metrics)
            }),
        )
        .with_state(metrics)
        .route_layer(axum::middleware::from_fn_with_state(auth, guard))
}

async fn guard(State(auth): State<Arc<MetricsAuth>>, request: Request, next: Next) -> Response {
    let verb = request.method().as_str().to_ascii_lowercase();
    let path = request.uri().path().to_owned();
    match auth
        .authorize(request.headers().get(header::AUTHORIZATION), &verb, &path)
        .await
    {
        Ok(_) => next.run(request).await,
        Err(refusal) => {
            debug!(?refusal, "metrics request refused");
            refusal.into_response()
        }
    }
}

/// The serving certificate: from `dir` (`tls.crt`, `tls.key`), or self-signed for `hosts`.
pub fn certificate(
    dir: Option<&PathBuf>,
    hosts: Vec<String>,
) -> Result<(TlsSource, Option<CertWatch>), SecureMetricsError> {
    match dir {
        Some(dir) => {
            let files = CertFiles::new(dir);
            let bundle = files.load()?;
            let source = TlsSource::new(http1_only(&bundle)?);
            let watch = CertWatch {
                files,
                dir: dir.clone(),
                current: bundle,
                source: source.clone(),
            };
            Ok((source, Some(watch)))
        }
        None => {
            let key = rcgen::KeyPair::generate()?;
            let mut params = rcgen::CertificateParams::new(hosts)?;
            params
                .distinguished_name
                .push(rcgen::DnType::CommonName, "pko-rs-metrics");
            let cert = params.self_signed(&key)?;
            let bundle = CertBundle {
                cert_pem: cert.pem(),
                key_pem: key.serialize_pem(),
                ca_pem: String::new(),
                ca_key_pem: None,
            };
            Ok((TlsSource::new(http1_only(&bundle)?), None))
        }
    }
}

/// The bundle's configuration, offering HTTP/1.1 only (the listener speaks nothing else).
fn http1_only(
    bundle: &CertBundle,
) -> Result<Arc<rustls::ServerConfig>, pko_admission::tls::TlsError> {
    let mut config = (*bundle.server_config()?).clone();
    config.alpn_protocols = vec![b"http/1.1".to_vec()];
    Ok(Arc::new(config))
}

/// A mounted certificate, reloaded into the listener when its files change.
pub struct CertWatch {
    files: CertFiles,
    dir: PathBuf,
    current: CertBundle,
    source: TlsSource,
}

impl CertWatch {
    /// Checks the files every `interval` until `shutdown`.
    pub async fn run(mut self, interval: Duration, shutdown: impl Future<Output = ()>) {
        let mut shutdown = std::pin::pin!(shutdown);
        let mut tick = tokio::time::interval(interval);
        loop {
            tokio::select! {
                () = &mut shutdown => return,
                _ = tick.tick() => {}
            }
            match self.files.load() {
                Ok(bundle) if bundle != self.current => {
                    if let Ok(config) = http1_only(&bundle) {
                        self.source.replace(config);
                        info!(dir = %self.dir.display(), "metrics serving certificate reloaded");
                        self.current = bundle;
                    }
                }
                Ok(_) => {}
                // Mid-rotation files can be briefly inconsistent; keep serving the old one.
                Err(e) => debug!(error = %e, "metrics certificate files not loadable yet"),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_bearer_token_is_read_and_anything_else_refused() {
        let header = |s: &str| HeaderValue::from_str(s).expect("header");
        assert_eq!(bearer_token(Some(&header("Bearer abc"))), Ok("abc"));
        assert_eq!(bearer_token(Some(&header("bearer  abc "))), Ok("abc"));
        assert_eq!(bearer_token(None), Err(Refusal::NoToken));
        assert_eq!(
            bearer_token(Some(&header("Basic dXNlcjpwYXNz"))),
            Err(Refusal::NoToken)
        );
        assert_eq!(bearer_token(Some(&header("Bearer"))), Err(Refusal::NoToken));
        assert_eq!(
            bearer_token(Some(&header("Bearer  "))),
            Err(Refusal::BadToken)
        );
        let long = format!("Bearer {}", "a".repeat(MAX_TOKEN_BYTES + 1));
        assert_eq!(bearer_token(Some(&header(&long))), Err(Refusal::BadToken));
    }

    #[test]
    fn refusals_say_what_is_missing() {
        assert_eq!(Refusal::NoToken.status(), StatusCode::UNAUTHORIZED);
        assert_eq!(Refusal::BadToken.status(), StatusCode::UNAUTHORIZED);
        let forbidden = Refusal::Forbidden {
            user: "system:serviceaccount:mon:prom".into(),
            path: "/metrics".into(),
        };
        assert_eq!(forbidden.status(), StatusCode::FORBIDDEN);
        assert!(
            forbidden
                .body()
                .contains("\"system:serviceaccount:mon:prom\" may not get /metrics"),
            "{}",
            forbidden.body()
        );
        let response = Refusal::NoToken.into_response();
        assert!(response.headers().contains_key(header::WWW_AUTHENTICATE));
    }

    #[test]
    fn cached_decisions_expire_and_the_cache_stays_bounded() {
        let t0 = Instant::now();
        let mut cache = TtlCache::new(2);
        cache.insert("a", 1, Duration::from_secs(10), t0);
        assert_eq!(cache.get(&"a", t0 + Duration::from_secs(9)), Some(1));
        assert_eq!(cache.get(&"a", t0 + Duration::from_secs(10)), None);
        assert!(cache.is_empty(), "an expired entry is dropped when read");
        cache.insert("a", 1, Duration::from_secs(30), t0);
        cache.insert("b", 2, Duration::from_secs(20), t0);
        // Full: the entry closest to expiring makes room.
        cache.insert("c", 3, Duration::from_secs(40), t0);
        assert_eq!(cache.len(), 2);
        assert_eq!(cache.get(&"b", t0), None);
        assert_eq!(cache.get(&"a", t0), Some(1));
        // Expired entries go before live ones.
        cache.insert("d", 4, Duration::from_secs(5), t0 + Duration::from_secs(31));
        assert_eq!(cache.get(&"c", t0 + Duration::from_secs(31)), Some(3));
        assert_eq!(cache.get(&"d", t0 + Duration::from_secs(31)), Some(4));
    }

    #[test]
    fn a_self_signed_certificate_serves_http1_only() {
        let _ = rustls::crypto::ring::default_provider().install_default();
        let (source, watch) =
            certificate(None, vec!["localhost".into(), "127.0.0.1".into()]).expect("cert");
        assert!(watch.is_none());
        let config = source.current();
        assert_eq!(config.alpn_protocols, vec![b"http/1.1".to_vec()]);
    }
}
