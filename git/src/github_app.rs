//! GitHub App installation tokens, as PKO mints them: an RS256 JWT signed with the App's private
//! key (`iat` 60 s in the past for clock skew, `exp` 10 minutes ahead, `iss` the App id) is
//! exchanged at `<api>/app/installations/<id>/access_tokens` (201 Created) for a token that
//! reads the installation's repositories over HTTPS for about an hour.
//!
//! Every input is a tenant's Secret: ids are checked before they reach a URL, the key before it
//! is used, the answer is read within a size bound, and a token never appears in a `Debug`
//! output, an error or a log line (the remote's own words are cut to a short message).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use base64::Engine;
use jiff::Timestamp;
use ring::signature::RsaKeyPair;
use rustls_pki_types::PrivateKeyDer;
use rustls_pki_types::pem::PemObject;
use sha2::{Digest, Sha256};

/// GitHub.com's API; GitHub Enterprise Server's is `https://<host>/api/v3`.
pub const DEFAULT_API_URL: &str = "https://api.github.com";
/// The API version the exchange is written against (GitHub's header).
const API_VERSION: &str = "2022-11-28";
/// A PEM private key is a few KiB; anything far larger is not one.
const MAX_KEY_BYTES: usize = 16 * 1024;
/// An access-token answer is well under 4 KiB (the token, its expiry, permissions).
const MAX_ANSWER_BYTES: usize = 64 * 1024;
/// GitHub's tokens are 40–100 characters; a much longer one is not a token.
const MAX_TOKEN_CHARS: usize = 1024;
/// Characters of the remote's `message` kept in an error.
const MAX_MESSAGE_CHARS: usize = 200;
/// A token is not used this close to its expiry (a clone may take minutes).
pub const REFRESH_MARGIN: Duration = Duration::from_secs(5 * 60);
/// The JWT's validity around now, as PKO signs it.
const JWT_BACKDATE_SECS: i64 = 60;
const JWT_LIFETIME_SECS: i64 = 10 * 60;
/// Tokens a cache keeps at most (one per App installation and key).
const MAX_CACHED: usize = 4096;

#[derive(Debug, thiserror::Error)]
pub enum GithubAppError {
    #[error("the GitHub App id is empty")]
    EmptyAppId,
    #[error(
        "the GitHub App id must be the App's numeric id or client id (letters, digits, `.`, `_`, `-`; at most 64)"
    )]
    BadAppId,
    #[error("the GitHub App installation id must be a number (at most 20 digits)")]
    BadInstallationId,
    #[error("the GitHub App private key is larger than {MAX_KEY_BYTES} bytes")]
    KeyTooLarge,
    #[error("the GitHub App private key is not a PEM private key")]
    KeyNotPem,
    #[error(
        "the GitHub App private key is not an RSA key (GitHub App keys are RSA, PKCS#1 or PKCS#8 PEM)"
    )]
    KeyNotRsa,
    #[error("the GitHub App private key is refused: {0}")]
    KeyRejected(String),
    #[error("cannot sign the GitHub App JWT")]
    Sign,
    #[error("invalid GitHub API URL {0:?}: expected an http(s) URL")]
    BadApiUrl(String),
    #[error("cannot reach the GitHub API")]
    Request(#[source] reqwest::Error),
    #[error("the GitHub API refused the installation token (HTTP {status}){}", message_suffix(.message))]
    Status { status: u16, message: String },
    #[error("the GitHub API answered more than {MAX_ANSWER_BYTES} bytes")]
    AnswerTooLarge,
    #[error("the GitHub API's answer has no usable token ({0})")]
    BadAnswer(&'static str),
}

fn message_suffix(message: &str) -> String {
    if message.is_empty() {
        String::new()
    } else {
        format!(": {message}")
    }
}

/// An App installation's credentials, checked.
#[derive(Clone)]
pub struct AppCredentials {
    app_id: String,
    installation_id: String,
    key: Arc<RsaKeyPair>,
    /// SHA-256 of everything above: tells two Secrets' credentials apart in a cache.
    digest: String,
}

impl std::fmt::Debug for AppCredentials {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AppCredentials")
            .field("app_id", &self.app_id)
            .field("installation_id", &self.installation_id)
            .finish_non_exhaustive()
    }
}

impl AppCredentials {
    /// Checks the three values (as read from Secrets; surrounding whitespace is dropped).
    pub fn new(
        app_id: &str,
        installation_id: &str,
        private_key_pem: &str,
    ) -> Result<Self, GithubAppError> {
        let app_id = check_app_id(app_id)?;
        let installation_id = check_installation_id(installation_id)?;
        let key = parse_key(private_key_pem)?;
        let mut h = Sha256::new();
        for part in [app_id.as_bytes(), installation_id.as_bytes()] {
            h.update(part);
            h.update([0]);
        }
        h.update(private_key_pem.trim().as_bytes());
        Ok(Self {
            app_id,
            installation_id,
            key: Arc::new(key),
            digest: hex::encode(h.finalize()),
        })
    }

    pub fn app_id(&self) -> &str {
        &self.app_id
    }

    pub fn installation_id(&self) -> &str {
        &self.installation_id
    }

    /// The App's JWT at `now`: RS256, `iat` = now − 60 s, `exp` = now + 10 min, `iss` = App id.
    pub fn jwt(&self, now: Timestamp) -> Result<String, GithubAppError> {
        let b64 = base64::engine::general_purpose::URL_SAFE_NO_PAD;
        let header = serde_json::json!({"alg": "RS256", "typ": "JWT"});
        let claims = serde_json::json!({
            "iat": now.as_second() - JWT_BACKDATE_SECS,
            "exp": now.as_second() + JWT_LIFETIME_SECS,
            "iss": self.app_id,
        });
        let signing_input = format!(
            "{}.{}",
            b64.encode(header.to_string()),
            b64.encode(claims.to_string())
        );
        let mut signature = vec![0; self.key.public().modulus_len()];
        self.key
            .sign(
                &ring::signature::RSA_PKCS1_SHA256,
                &ring::rand::SystemRandom::new(),
                signing_input.as_bytes(),
                &mut signature,
            )
            .map_err(|_| GithubAppError::Sign)?;
        Ok(format!("{signing_input}.{}", b64.encode(signature)))
    }

    /// Where this installation's token is minted, under `api` (GitHub's or an Enterprise
    /// server's API root).
    pub fn token_url(&self, api: &str) -> Result<url::Url, GithubAppError> {
        let bad = || GithubAppError::BadApiUrl(api.to_owned());
        let base = url::Url::parse(api.trim()).map_err(|_| bad())?;
        if !matches!(base.scheme(), "http" | "https")
            || base.host().is_none()
            || base.query().is_some()
            || !base.username().is_empty()
        {
            return Err(bad());
        }
        let path = format!(
            "{}/app/installations/{}/access_tokens",
            base.path().trim_end_matches('/'),
            self.installation_id
        );
        let mut url = base;
        url.set_path(&path);
        Ok(url)
    }

    /// The cache key of this installation's tokens from `api`.
    fn cache_key(&self, api: &str) -> String {
        format!("{}\0{}", api.trim().trim_end_matches('/'), self.digest)
    }
}

fn check_app_id(text: &str) -> Result<String, GithubAppError> {
    let id = text.trim();
    if id.is_empty() {
        return Err(GithubAppError::EmptyAppId);
    }
    let ok = id.len() <= 64
        && id
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"._-".contains(&b));
    if ok {
        Ok(id.to_owned())
    } else {
        Err(GithubAppError::BadAppId)
    }
}

fn check_installation_id(text: &str) -> Result<String, GithubAppError> {
    let id = text.trim();
    if !id.is_empty() && id.len() <= 20 && id.bytes().all(|b| b.is_ascii_digit()) {
        Ok(id.to_owned())
    } else {
        Err(GithubAppError::BadInstallationId)
    }
}

/// An RSA private key from PEM: PKCS#1 (`RSA PRIVATE KEY`, what GitHub hands out) or PKCS#8
/// (`PRIVATE KEY`).
fn parse_key(pem: &str) -> Result<RsaKeyPair, GithubAppError> {
    if pem.len() > MAX_KEY_BYTES {
        return Err(GithubAppError::KeyTooLarge);
    }
    let der =
        PrivateKeyDer::from_pem_slice(pem.as_bytes()).map_err(|_| GithubAppError::KeyNotPem)?;
    let rejected = |e: ring::error::KeyRejected| GithubAppError::KeyRejected(e.to_string());
    match der {
        PrivateKeyDer::Pkcs1(k) => RsaKeyPair::from_der(k.secret_pkcs1_der()).map_err(rejected),
        // A PKCS#8 key of another algorithm is told apart from a broken RSA one.
        PrivateKeyDer::Pkcs8(k) => RsaKeyPair::from_pkcs8(k.secret_pkcs8_der()).map_err(|e| {
            if e.to_string() == "WrongAlgorithm" {
                GithubAppError::KeyNotRsa
            } else {
                rejected(e)
            }
        }),
        _ => Err(GithubAppError::KeyNotRsa),
    }
}

/// An installation token and when it expires.
#[derive(Clone)]
pub struct InstallationToken {
    secret: String,
    pub expires_at: Timestamp,
}

impl std::fmt::Debug for InstallationToken {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("InstallationToken")
            .field("expires_at", &self.expires_at)
            .finish_non_exhaustive()
    }
}

impl InstallationToken {
    /// The token: the password of HTTPS git requests (user `x-access-token`).
    pub fn secret(&self) -> &str {
        &self.secret
    }

    /// Whether it may still be handed out at `now` (not within [`REFRESH_MARGIN`] of expiry).
    pub fn usable_at(&self, now: Timestamp) -> bool {
        let margin = jiff::SignedDuration::try_from(REFRESH_MARGIN).unwrap_or_default();
        now.checked_add(margin)
            .is_ok_and(|later| later < self.expires_at)
    }
}

/// The user name GitHub expects with an installation token over HTTPS.
pub const TOKEN_USER: &str = "x-access-token";

/// Asks `url` (from [`AppCredentials::token_url`]) for an installation token with `jwt`.
/// `client` decides where it may connect (the operator's follows its egress rules).
pub async fn exchange(
    client: &reqwest::Client,
    url: url::Url,
    jwt: &str,
    now: Timestamp,
) -> Result<InstallationToken, GithubAppError> {
    let mut response = client
        .post(url)
        .bearer_auth(jwt)
        .header(reqwest::header::ACCEPT, "application/vnd.github+json")
        .header("X-GitHub-Api-Version", API_VERSION)
        // GitHub refuses requests without a user agent.
        .header(
            reqwest::header::USER_AGENT,
            concat!("pko-rs/", env!("CARGO_PKG_VERSION")),
        )
        .send()
        .await
        .map_err(GithubAppError::Request)?;
    let status = response.status().as_u16();
    let mut body = Vec::new();
    while let Some(chunk) = response.chunk().await.map_err(GithubAppError::Request)? {
        if body.len() + chunk.len() > MAX_ANSWER_BYTES {
            return Err(GithubAppError::AnswerTooLarge);
        }
        body.extend_from_slice(&chunk);
    }
    if status != 201 {
        return Err(GithubAppError::Status {
            status,
            message: remote_message(&body),
        });
    }
    parse_answer(&body, now)
}

/// GitHub's `message` of an error answer, short and printable; nothing else of the body.
fn remote_message(body: &[u8]) -> String {
    #[derive(serde::Deserialize)]
    struct Answer {
        message: Option<String>,
    }
    serde_json::from_slice::<Answer>(body)
        .ok()
        .and_then(|a| a.message)
        .map(|m| {
            m.chars()
                .filter(|c| !c.is_control())
                .take(MAX_MESSAGE_CHARS)
                .collect()
        })
        .unwrap_or_default()
}

/// The token of a 201 answer; without an expiry it is kept for [`JWT_LIFETIME_SECS`] only.
fn parse_answer(body: &[u8], now: Timestamp) -> Result<InstallationToken, GithubAppError> {
    #[derive(serde::Deserialize)]
    struct Answer {
        token: Option<String>,
        expires_at: Option<String>,
    }
    let answer: Answer =
        serde_json::from_slice(body).map_err(|_| GithubAppError::BadAnswer("not JSON"))?;
    let token = answer
        .token
        .filter(|t| !t.is_empty())
        .ok_or(GithubAppError::BadAnswer("no token"))?;
    // It goes into an Authorization header and a git config value.
    if token.len() > MAX_TOKEN_CHARS || !token.bytes().all(|b| b.is_ascii_graphic()) {
        return Err(GithubAppError::BadAnswer("not a token"));
    }
    let fallback = now
        .checked_add(jiff::SignedDuration::from_secs(JWT_LIFETIME_SECS))
        .unwrap_or(now);
    let expires_at = match answer.expires_at {
        Some(text) => text
            .parse::<Timestamp>()
            .map_err(|_| GithubAppError::BadAnswer("expires_at is not a time"))?,
        None => fallback,
    };
    Ok(InstallationToken {
        secret: token,
        expires_at,
    })
}

/// Tokens by installation, API and key, handed out until [`REFRESH_MARGIN`] before they expire.
#[derive(Default)]
pub struct TokenCache {
    tokens: Mutex<HashMap<String, InstallationToken>>,
}

impl TokenCache {
    /// A usable token of `creds` from `api`, if one is cached.
    pub fn get(
        &self,
        api: &str,
        creds: &AppCredentials,
        now: Timestamp,
    ) -> Option<InstallationToken> {
        let tokens = self.tokens.lock().unwrap_or_else(|e| e.into_inner());
        tokens
            .get(&creds.cache_key(api))
            .filter(|t| t.usable_at(now))
            .cloned()
    }

    /// Keeps `token`; expired entries go first, and the cache never holds more than
    /// [`MAX_CACHED`] (the soonest to expire leaves).
    pub fn put(&self, api: &str, creds: &AppCredentials, token: InstallationToken, now: Timestamp) {
        let mut tokens = self.tokens.lock().unwrap_or_else(|e| e.into_inner());
        tokens.retain(|_, t| t.usable_at(now));
        if tokens.len() >= MAX_CACHED
            && let Some(first) = tokens
                .iter()
                .min_by_key(|(_, t)| t.expires_at)
                .map(|(k, _)| k.clone())
        {
            tokens.remove(&first);
        }
        tokens.insert(creds.cache_key(api), token);
    }

    /// A cached token, else one minted by `mint` (called with the JWT and the token URL) and
    /// cached.
    pub async fn token<F, Fut>(
        &self,
        api: &str,
        creds: &AppCredentials,
        mint: F,
    ) -> Result<InstallationToken, GithubAppError>
    where
        F: FnOnce(url::Url, String) -> Fut,
        Fut: std::future::Future<Output = Result<InstallationToken, GithubAppError>>,
    {
        let now = Timestamp::now();
        if let Some(token) = self.get(api, creds, now) {
            return Ok(token);
        }
        let url = creds.token_url(api)?;
        let token = mint(url, creds.jwt(now)?).await?;
        self.put(api, creds, token.clone(), now);
        Ok(token)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const PKCS1: &str = include_str!("../testdata/app-key-pkcs1.pem");
    const PKCS8: &str = include_str!("../testdata/app-key-pkcs8.pem");
    const EC: &str = include_str!("../testdata/ec-key.pem");

    fn decode(part: &str) -> Vec<u8> {
        base64::engine::general_purpose::URL_SAFE_NO_PAD
            .decode(part)
            .expect("base64url")
    }

    /// Checks the JWT as GitHub does: the signature with the App's public key, then the claims.
    fn verify(jwt: &str, key: &RsaKeyPair) -> serde_json::Value {
        let parts: Vec<&str> = jwt.split('.').collect();
        assert_eq!(parts.len(), 3, "{jwt}");
        let public = ring::signature::UnparsedPublicKey::new(
            &ring::signature::RSA_PKCS1_2048_8192_SHA256,
            key.public().as_ref().to_vec(),
        );
        public
            .verify(
                format!("{}.{}", parts[0], parts[1]).as_bytes(),
                &decode(parts[2]),
            )
            .expect("signature");
        let header: serde_json::Value = serde_json::from_slice(&decode(parts[0])).expect("header");
        assert_eq!(header, serde_json::json!({"alg": "RS256", "typ": "JWT"}));
        serde_json::from_slice(&decode(parts[1])).expect("claims")
    }

    #[test]
    fn the_jwt_is_signed_and_claims_as_pko_makes_it() {
        let now = Timestamp::from_second(1_700_000_000).expect("time");
        for pem in [PKCS1, PKCS8] {
            let creds = AppCredentials::new(" 12345\n", "678\n", pem).expect("creds");
            let claims = verify(&creds.jwt(now).expect("jwt"), &creds.key);
            assert_eq!(
                claims,
                serde_json::json!({"iat": 1_700_000_000 - 60, "exp": 1_700_000_000 + 600, "iss": "12345"})
            );
        }
        // One key in either encoding signs alike (PKCS#1 v1.5 is deterministic).
        let a = AppCredentials::new("1", "2", PKCS1).expect("pkcs1");
        let b = AppCredentials::new("1", "2", PKCS8).expect("pkcs8");
        assert_eq!(a.jwt(now).expect("a"), b.jwt(now).expect("b"));
    }

    #[test]
    fn bad_values_are_refused_before_any_request() {
        let err = |a: &str, i: &str, k: &str| AppCredentials::new(a, i, k).expect_err("refused");
        assert!(matches!(err("", "1", PKCS1), GithubAppError::EmptyAppId));
        assert!(matches!(
            err("1/../x", "1", PKCS1),
            GithubAppError::BadAppId
        ));
        for id in ["", "12/../../user", "1 2", "-1", &"9".repeat(21)] {
            assert!(
                matches!(err("1", id, PKCS1), GithubAppError::BadInstallationId),
                "{id:?}"
            );
        }
        assert!(matches!(
            err("1", "2", "not a key"),
            GithubAppError::KeyNotPem
        ));
        assert!(matches!(err("1", "2", EC), GithubAppError::KeyNotRsa));
        let huge = format!("{PKCS1}{}", " ".repeat(MAX_KEY_BYTES));
        assert!(matches!(err("1", "2", &huge), GithubAppError::KeyTooLarge));
        assert!(AppCredentials::new("Iv1.abc_DEF-9", "42", PKCS1).is_ok());
    }

    #[test]
    fn the_token_url_is_under_the_api_root() {
        let creds = AppCredentials::new("1", "42", PKCS1).expect("creds");
        let url = |api: &str| creds.token_url(api).map(|u| u.to_string());
        assert_eq!(
            url("https://api.github.com").expect("github"),
            "https://api.github.com/app/installations/42/access_tokens"
        );
        assert_eq!(
            url("https://ghe.example.com/api/v3/").expect("enterprise"),
            "https://ghe.example.com/api/v3/app/installations/42/access_tokens"
        );
        for bad in [
            "file:///etc",
            "not a url",
            "https://u:p@h/",
            "https://h/?q=1",
        ] {
            assert!(url(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn answers_are_read_strictly_and_never_shown() {
        let now = Timestamp::from_second(1_700_000_000).expect("time");
        let ok = parse_answer(
            br#"{"token":"ghs_abc","expires_at":"2023-11-14T23:13:20Z","permissions":{}}"#,
            now,
        )
        .expect("token");
        assert_eq!(ok.secret(), "ghs_abc");
        assert!(!format!("{ok:?}").contains("ghs_abc"));
        let no_expiry = parse_answer(br#"{"token":"t"}"#, now).expect("token");
        assert_eq!(no_expiry.expires_at.as_second(), 1_700_000_000 + 600);
        for bad in [
            &b"<html>"[..],
            br#"{"token":""}"#,
            br#"{"token":"a b"}"#,
            br#"{"token":"t","expires_at":"soon"}"#,
        ] {
            assert!(parse_answer(bad, now).is_err());
        }
        assert_eq!(
            remote_message(br#"{"message":"A JSON web token could not be decoded\n"}"#),
            "A JSON web token could not be decoded"
        );
        assert_eq!(remote_message(b"secret stuff"), "");
    }

    #[test]
    fn a_token_is_cached_until_shortly_before_it_expires() {
        let creds = AppCredentials::new("1", "2", PKCS1).expect("creds");
        let other = AppCredentials::new("1", "3", PKCS1).expect("creds");
        let t0 = Timestamp::from_second(1_700_000_000).expect("time");
        let at = |secs: i64| Timestamp::from_second(1_700_000_000 + secs).expect("time");
        let cache = TokenCache::default();
        let token = InstallationToken {
            secret: "t".into(),
            expires_at: at(3600),
        };
        cache.put("https://api", &creds, token, t0);
        assert!(cache.get("https://api/", &creds, at(10)).is_some());
        assert!(
            cache.get("https://api", &other, at(10)).is_none(),
            "another installation"
        );
        assert!(
            cache.get("https://ghe", &creds, at(10)).is_none(),
            "another API"
        );
        assert!(cache.get("https://api", &creds, at(3600 - 301)).is_some());
        assert!(
            cache.get("https://api", &creds, at(3600 - 300)).is_none(),
            "margin"
        );
    }
}
