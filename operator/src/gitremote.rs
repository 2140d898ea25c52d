//! `git ls-remote`: which commit a branch or tag of a repository points at, over HTTP(S) or SSH.
//!
//! The Stack controller tracks a branch by asking the server for its refs (the first request of
//! a fetch: `GET <repo>/info/refs?service=git-upload-pack`, or `git-upload-pack` over SSH, see
//! [`crate::gitssh`]), no clone and no git binary in the operator image. Smart servers answer
//! with pkt-lines; plain file servers ("dumb" HTTP, a bare repository after
//! `git update-server-info`) with `<sha>\t<ref>` lines; both are read. Answers are cached
//! briefly so many Stacks tracking one branch cost one request per interval. GitHub App
//! credentials become an installation token here, cached until shortly before it expires.
//!
//! The URL is a tenant's and the error reaches its Stack's status: a failure is told by its
//! class ([`Failure`]), never a status code, a port or an answer, with the detail in the
//! operator's log only.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use sha2::{Digest, Sha256};

use jiff::Timestamp;
use pko_git::github_app::{self, AppCredentials, GithubAppError, TokenCache};

use crate::egress::{self, EgressPolicy, Failure};
use crate::gitssh::{self, HostKeyRule, KnownHosts, SshError, SshKey, SshUrl};

/// Largest refs advertisement read (repositories with many tags stay far below).
const MAX_BYTES: usize = 16 * 1024 * 1024;
const TIMEOUT: Duration = Duration::from_secs(30);

#[derive(Debug, thiserror::Error)]
pub enum GitRemoteError {
    #[error(
        "cannot track a branch of {0:?}: only http(s) and ssh repositories can be polled; pin `commit` instead"
    )]
    UnsupportedUrl(String),
    #[error("cannot list the refs of {url}: {error}")]
    Ssh { url: String, error: SshError },
    #[error("cannot get a GitHub App installation token: {0}")]
    GithubApp(GithubAppError),
    #[error("cannot get a GitHub App installation token from the GitHub API: {failure}{}", hint(*failure))]
    GithubAppFailed { failure: Failure },
    #[error("cannot list the refs of {url}: {failure}{}", hint(*failure))]
    Failed { url: String, failure: Failure },
    #[error("cannot list the refs of {url}: more than {MAX_BYTES} bytes of refs")]
    TooLarge { url: String },
    #[error(
        "cannot list the refs of {url}: the operator has no HTTP client for branch lookups \
         ({detail}); see the operator's log"
    )]
    NoClient { url: String, detail: String },
    #[error("cannot read the refs of {url}: {detail}")]
    Parse { url: String, detail: String },
    #[error("no branch or tag {reference:?} in {url}")]
    NotFound { url: String, reference: String },
}

/// What the tenant can do about a failure of its class.
fn hint(failure: Failure) -> &'static str {
    match failure {
        Failure::Unauthorized => "; check the git credentials",
        Failure::NotFound => "; check the repository URL",
        _ => "",
    }
}

/// HTTP credentials (a token is sent as the password of user `git`, as git hosts expect).
#[derive(Clone, Default, PartialEq, Eq)]
pub struct HttpAuth {
    pub username: String,
    pub password: String,
}

impl std::fmt::Debug for HttpAuth {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HttpAuth")
            .field("username", &self.username)
            .finish_non_exhaustive()
    }
}

/// How a lookup logs in.
#[derive(Clone, Debug, Default)]
pub enum RemoteAuth {
    #[default]
    None,
    Http(HttpAuth),
    /// An SSH key (none: the server is asked for an anonymous login) and the Secret's
    /// `knownHosts` lines.
    Ssh {
        key: Option<SshKey>,
        known_hosts: Option<String>,
    },
}

/// Settings of the operator (flags), not of a tenant.
#[derive(Clone, Debug)]
pub struct RemoteOptions {
    /// The GitHub API root installation tokens are minted at.
    pub github_api: String,
    /// SSH: trust a host's first key when the Secret has no `knownHosts`.
    pub ssh_accept_new_host_keys: bool,
}

impl Default for RemoteOptions {
    fn default() -> Self {
        Self {
            github_api: github_app::DEFAULT_API_URL.to_owned(),
            ssh_accept_new_host_keys: false,
        }
    }
}

/// `true` for a full commit id (SHA-1 or SHA-256), which needs no lookup.
pub fn is_commit(reference: &str) -> bool {
    matches!(reference.len(), 40 | 64) && reference.bytes().all(|b| b.is_ascii_hexdigit())
}

/// Ref name → commit.
type Refs = HashMap<String, String>;
/// (url, credentials digest) → (when listed, refs).
type RefsCache = HashMap<(String, String), (Instant, Refs)>;

/// Refs of a repository, shared by every Stack of the operator.
pub struct Resolver {
    /// The client, or why it could not be built: never a client without the egress rules.
    http: Result<reqwest::Client, String>,
    egress: Arc<EgressPolicy>,
    ttl: Duration,
    cache: Mutex<RefsCache>,
    options: RemoteOptions,
    tokens: TokenCache,
    /// Host keys first seen under `--git-ssh-accept-new-host-keys`, by known_hosts name.
    seen_host_keys: Arc<Mutex<HashMap<String, Vec<u8>>>>,
}

impl Resolver {
    /// `http` must follow `egress` for names and redirects ([`EgressPolicy::client_builder`]);
    /// when it failed to build, every lookup fails saying so.
    pub fn new(
        http: Result<reqwest::Client, String>,
        egress: Arc<EgressPolicy>,
        ttl: Duration,
        options: RemoteOptions,
    ) -> Self {
        Self {
            http,
            egress,
            ttl,
            cache: Mutex::new(HashMap::new()),
            options,
            tokens: TokenCache::default(),
            seen_host_keys: Arc::default(),
        }
    }

    /// HTTP credentials from a GitHub App installation: a cached token, or a new one minted at
    /// the GitHub API (an operator setting; the installation id in its path is checked).
    pub async fn github_token(&self, creds: &AppCredentials) -> Result<HttpAuth, GitRemoteError> {
        let api = &self.options.github_api;
        let now = Timestamp::now();
        let auth = |t: github_app::InstallationToken| HttpAuth {
            username: github_app::TOKEN_USER.to_owned(),
            password: t.secret().to_owned(),
        };
        if let Some(token) = self.tokens.get(api, creds, now) {
            return Ok(auth(token));
        }
        let url = creds.token_url(api).map_err(GitRemoteError::GithubApp)?;
        let failed = |failure| GitRemoteError::GithubAppFailed { failure };
        self.egress
            .check_url(&url)
            .map_err(|refused| failed(Failure::Refused(refused)))?;
        let http = self
            .http
            .as_ref()
            .map_err(|detail| GitRemoteError::NoClient {
                url: url.to_string(),
                detail: detail.clone(),
            })?;
        let jwt = creds.jwt(now).map_err(GitRemoteError::GithubApp)?;
        let app = creds.app_id();
        match github_app::exchange(http, url, &jwt, now).await {
            Ok(token) => {
                tracing::debug!(app, expires_at = %token.expires_at, "GitHub App installation token minted");
                self.tokens.put(api, creds, token.clone(), now);
                Ok(auth(token))
            }
            // The detail is the operator's; the tenant gets the class.
            Err(GithubAppError::Request(e)) => {
                let failure = egress::classify(&e);
                tracing::info!(app, %failure, detail = egress::describe(&e), "GitHub App token request failed");
                Err(failed(failure))
            }
            Err(GithubAppError::Status { status, message }) => {
                let failure = Failure::of_status(status).unwrap_or(Failure::Unexpected);
                tracing::info!(app, status, message, "GitHub App token refused");
                Err(failed(failure))
            }
            Err(e) => Err(GitRemoteError::GithubApp(e)),
        }
    }

    /// The commit `reference` (a branch or tag, short or full name) points at. `fresh` skips the
    /// cache (a sync the user asked for).
    pub async fn resolve(
        &self,
        url: &str,
        reference: &str,
        auth: &RemoteAuth,
        fresh: bool,
    ) -> Result<String, GitRemoteError> {
        if is_commit(reference) {
            return Ok(reference.to_ascii_lowercase());
        }
        let key = (url.to_owned(), auth_digest(auth));
        let cached = (!fresh)
            .then(|| {
                let cache = self.cache.lock().unwrap_or_else(|e| e.into_inner());
                cache
                    .get(&key)
                    .filter(|(at, _)| at.elapsed() < self.ttl)
                    .map(|(_, refs)| refs.clone())
            })
            .flatten();
        let refs = match cached {
            Some(refs) => refs,
            None => {
                let refs = self.list(url, auth).await?;
                let mut cache = self.cache.lock().unwrap_or_else(|e| e.into_inner());
                cache.retain(|_, (at, _)| at.elapsed() < self.ttl);
                cache.insert(key, (Instant::now(), refs.clone()));
                refs
            }
        };
        find(&refs, reference).ok_or_else(|| GitRemoteError::NotFound {
            url: url.to_owned(),
            reference: reference.to_owned(),
        })
    }

    async fn list(&self, url: &str, auth: &RemoteAuth) -> Result<Refs, GitRemoteError> {
        match SshUrl::parse(url) {
            Ok(ssh) => return self.list_ssh(url, &ssh, auth).await,
            Err(SshError::NotSsh) => {}
            Err(error) => {
                return Err(GitRemoteError::Ssh {
                    url: url.to_owned(),
                    error,
                });
            }
        }
        let http = match auth {
            RemoteAuth::Http(a) => Some(a),
            _ => None,
        };
        self.list_http(url, http).await
    }

    async fn list_ssh(
        &self,
        url: &str,
        ssh: &SshUrl,
        auth: &RemoteAuth,
    ) -> Result<Refs, GitRemoteError> {
        let ssh_err = |error| GitRemoteError::Ssh {
            url: url.to_owned(),
            error,
        };
        let failed = |failure: Failure| GitRemoteError::Failed {
            url: url.to_owned(),
            failure,
        };
        let (key, known_hosts) = match auth {
            RemoteAuth::Ssh { key, known_hosts } => (key.as_ref(), known_hosts.as_deref()),
            _ => (None, None),
        };
        let rule = match known_hosts {
            Some(text) => HostKeyRule::Known(Arc::new(KnownHosts::parse(text).map_err(ssh_err)?)),
            None if self.options.ssh_accept_new_host_keys => {
                HostKeyRule::AcceptNew(self.seen_host_keys.clone())
            }
            None => HostKeyRule::None,
        };
        let addrs = self
            .egress
            .resolve(&ssh.host, ssh.port)
            .await
            .map_err(failed)?;
        let addr = *addrs.first().ok_or(failed(Failure::Unreachable))?;
        let listed = tokio::time::timeout(
            gitssh::TIMEOUT,
            gitssh::advertised_refs(addr, ssh, key, rule, MAX_BYTES),
        )
        .await
        .map_err(|_| failed(Failure::Unreachable))?;
        let body = match listed {
            Ok(body) => body,
            Err(SshError::Connection(e)) => {
                tracing::info!(url, error = %e, "branch lookup over SSH failed");
                return Err(failed(Failure::Unreachable));
            }
            Err(SshError::AuthRefused) => return Err(failed(Failure::Unauthorized)),
            Err(SshError::NoRefs) => return Err(failed(Failure::NotFound)),
            Err(SshError::TooLarge(_)) => {
                return Err(GitRemoteError::TooLarge {
                    url: url.to_owned(),
                });
            }
            Err(error) => return Err(ssh_err(error)),
        };
        parse_smart(&body).map_err(|detail| GitRemoteError::Parse {
            url: url.to_owned(),
            detail,
        })
    }

    async fn list_http(&self, url: &str, auth: Option<&HttpAuth>) -> Result<Refs, GitRemoteError> {
        let endpoint = format!(
            "{}/info/refs?service=git-upload-pack",
            url.trim_end_matches('/')
        );
        // Parsed as the client will parse it, so the checks see the address it connects to.
        let endpoint = reqwest::Url::parse(&endpoint)
            .ok()
            .filter(|u| matches!(u.scheme(), "http" | "https"))
            .ok_or_else(|| GitRemoteError::UnsupportedUrl(url.to_owned()))?;
        let failed = |failure: Failure| GitRemoteError::Failed {
            url: url.to_owned(),
            failure,
        };
        self.egress
            .check_url(&endpoint)
            .map_err(|refused| failed(Failure::Refused(refused)))?;
        let http = self
            .http
            .as_ref()
            .map_err(|detail| GitRemoteError::NoClient {
                url: url.to_owned(),
                detail: detail.clone(),
            })?;
        // The detail is the operator's to read; the tenant gets the class.
        let request_err = |e: reqwest::Error| {
            let failure = egress::classify(&e);
            tracing::info!(url, %failure, detail = egress::describe(&e), "branch lookup failed");
            failed(failure)
        };
        let mut request = http.get(endpoint).timeout(TIMEOUT);
        if let Some(a) = auth {
            request = request.basic_auth(&a.username, Some(&a.password));
        }
        let mut response = request.send().await.map_err(request_err)?;
        let status = response.status();
        if let Some(failure) = Failure::of_status(status.as_u16()) {
            tracing::info!(url, %failure, status = status.as_u16(), "branch lookup failed");
            return Err(failed(failure));
        }
        let smart = response
            .headers()
            .get(reqwest::header::CONTENT_TYPE)
            .and_then(|v| v.to_str().ok())
            .is_some_and(|v| v.starts_with("application/x-git-upload-pack-advertisement"));
        let mut body = Vec::new();
        while let Some(chunk) = response.chunk().await.map_err(request_err)? {
            if body.len() + chunk.len() > MAX_BYTES {
                return Err(GitRemoteError::TooLarge {
                    url: url.to_owned(),
                });
            }
            body.extend_from_slice(&chunk);
        }
        let parsed = if smart {
            parse_smart(&body)
        } else {
            parse_dumb(&body)
        };
        parsed.map_err(|detail| GitRemoteError::Parse {
            url: url.to_owned(),
            detail,
        })
    }
}

/// Tells credentials apart in the refs cache, without keeping them.
fn auth_digest(auth: &RemoteAuth) -> String {
    let parts: Vec<&str> = match auth {
        RemoteAuth::None => return String::new(),
        RemoteAuth::Http(a) => vec!["http", &a.username, &a.password],
        RemoteAuth::Ssh { key, known_hosts } => vec![
            "ssh",
            key.as_ref().map_or("", |k| k.private_key.as_str()),
            key.as_ref()
                .and_then(|k| k.passphrase.as_deref())
                .unwrap_or_default(),
            known_hosts.as_deref().unwrap_or_default(),
        ],
    };
    let mut h = Sha256::new();
    for part in parts {
        h.update(part.as_bytes());
        h.update([0]);
    }
    hex::encode(h.finalize())
}

/// The commit of `reference`: an exact ref name, else `refs/heads/<r>`, `refs/tags/<r>` (peeled
/// to the commit of an annotated tag), `refs/<r>`.
fn find(refs: &Refs, reference: &str) -> Option<String> {
    let candidates = [
        reference.to_owned(),
        format!("refs/heads/{reference}"),
        format!("refs/tags/{reference}"),
        format!("refs/{reference}"),
    ];
    candidates.iter().find_map(|name| {
        refs.get(&format!("{name}^{{}}"))
            .or_else(|| refs.get(name))
            .cloned()
    })
}

/// Smart HTTP: pkt-lines `<4 hex length><sha> <ref>[\0capabilities]\n`, a service header and
/// flush packets (`0000`) around them.
fn parse_smart(body: &[u8]) -> Result<Refs, String> {
    let mut refs = HashMap::new();
    let mut rest = body;
    while rest.len() >= 4 {
        let len_text = std::str::from_utf8(&rest[..4]).map_err(|_| "bad pkt-line length")?;
        let len = usize::from_str_radix(len_text, 16).map_err(|_| "bad pkt-line length")?;
        if len == 0 {
            rest = &rest[4..];
            continue;
        }
        if len < 4 || len > rest.len() {
            return Err(format!("truncated pkt-line of {len} bytes"));
        }
        let line = String::from_utf8_lossy(&rest[4..len]);
        rest = &rest[len..];
        let line = line.trim_end_matches('\n');
        if line.starts_with('#') {
            continue;
        }
        let line = line.split('\0').next().unwrap_or_default();
        if let Some((sha, name)) = line.split_once(' ')
            && is_commit(sha)
        {
            refs.insert(name.to_owned(), sha.to_ascii_lowercase());
        }
    }
    if refs.is_empty() && !body.is_empty() && !body.starts_with(b"001e# service") {
        return Err("not a git refs advertisement".into());
    }
    Ok(refs)
}

/// Dumb HTTP: the `info/refs` file, `<sha>\t<ref>` per line.
fn parse_dumb(body: &[u8]) -> Result<Refs, String> {
    let text = std::str::from_utf8(body).map_err(|_| "refs are not UTF-8 text")?;
    let mut refs = HashMap::new();
    for (n, line) in text
        .lines()
        .enumerate()
        .filter(|(_, l)| !l.trim().is_empty())
    {
        // What the server said is never repeated (it ends up in a Stack's status): only where.
        let (sha, name) = line
            .split_once('\t')
            .filter(|(sha, _)| is_commit(sha))
            .ok_or_else(|| {
                format!(
                    "not a git refs listing (line {} is not <sha>TAB<ref>)",
                    n + 1
                )
            })?;
        refs.insert(name.trim().to_owned(), sha.to_ascii_lowercase());
    }
    Ok(refs)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pkt(line: &str) -> String {
        format!("{:04x}{line}", line.len() + 4)
    }

    const A: &str = "1111111111111111111111111111111111111111";
    const B: &str = "2222222222222222222222222222222222222222";
    const C: &str = "3333333333333333333333333333333333333333";

    #[test]
    fn smart_advertisement_with_peeled_tags() {
        let body = format!(
            "{}0000{}{}{}{}0000",
            pkt("# service=git-upload-pack\n"),
            pkt(&format!(
                "{A} HEAD\0multi_ack symref=HEAD:refs/heads/main\n"
            )),
            pkt(&format!("{A} refs/heads/main\n")),
            pkt(&format!("{B} refs/tags/v1\n")),
            pkt(&format!("{C} refs/tags/v1^{{}}\n")),
        );
        let refs = parse_smart(body.as_bytes()).expect("parse");
        assert_eq!(find(&refs, "main").as_deref(), Some(A));
        assert_eq!(find(&refs, "refs/heads/main").as_deref(), Some(A));
        assert_eq!(
            find(&refs, "v1").as_deref(),
            Some(C),
            "annotated tag peeled"
        );
        assert_eq!(find(&refs, "HEAD").as_deref(), Some(A));
        assert_eq!(find(&refs, "nope"), None);
    }

    #[test]
    fn dumb_refs_file() {
        let body = format!("{A}\trefs/heads/main\n{B}\trefs/heads/release/1\n");
        let refs = parse_dumb(body.as_bytes()).expect("parse");
        assert_eq!(find(&refs, "release/1").as_deref(), Some(B));
        assert!(parse_dumb(b"<html>login</html>").is_err());
    }

    #[test]
    fn truncated_or_garbage_smart_answers_fail() {
        assert!(parse_smart(b"00ffshort").is_err());
        assert!(parse_smart(b"zzzz").is_err());
    }

    #[test]
    fn commits_need_no_lookup() {
        assert!(is_commit(A));
        assert!(!is_commit("main"));
        assert!(!is_commit(&A[..39]));
    }
}
