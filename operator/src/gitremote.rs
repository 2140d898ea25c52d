//! `git ls-remote` over HTTP(S): which commit a branch or tag of a repository points at.
//!
//! The Stack controller tracks a branch by asking the server for its refs (the first request of
//! a fetch: `GET <repo>/info/refs?service=git-upload-pack`), no clone and no git binary in the
//! operator image. Smart servers answer with pkt-lines; plain file servers ("dumb" HTTP, a bare
//! repository after `git update-server-info`) with `<sha>\t<ref>` lines; both are read. Answers
//! are cached briefly so many Stacks tracking one branch cost one request per interval.
//!
//! The URL is a tenant's and the error reaches its Stack's status: a failure is told by its
//! class ([`Failure`]), never a status code, a port or an answer, with the detail in the
//! operator's log only.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use sha2::{Digest, Sha256};

use crate::egress::{self, EgressPolicy, Failure};

/// Largest refs advertisement read (repositories with many tags stay far below).
const MAX_BYTES: usize = 16 * 1024 * 1024;
const TIMEOUT: Duration = Duration::from_secs(30);

#[derive(Debug, thiserror::Error)]
pub enum GitRemoteError {
    #[error(
        "cannot track a branch of {0:?}: only http(s) repositories can be polled; pin `commit` instead"
    )]
    UnsupportedUrl(String),
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
}

impl Resolver {
    /// `http` must follow `egress` for names and redirects ([`EgressPolicy::client_builder`]);
    /// when it failed to build, every lookup fails saying so.
    pub fn new(
        http: Result<reqwest::Client, String>,
        egress: Arc<EgressPolicy>,
        ttl: Duration,
    ) -> Self {
        Self {
            http,
            egress,
            ttl,
            cache: Mutex::new(HashMap::new()),
        }
    }

    /// The commit `reference` (a branch or tag, short or full name) points at. `fresh` skips the
    /// cache (a sync the user asked for).
    pub async fn resolve(
        &self,
        url: &str,
        reference: &str,
        auth: Option<&HttpAuth>,
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

    async fn list(&self, url: &str, auth: Option<&HttpAuth>) -> Result<Refs, GitRemoteError> {
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

fn auth_digest(auth: Option<&HttpAuth>) -> String {
    auth.map(|a| {
        let mut h = Sha256::new();
        h.update(a.username.as_bytes());
        h.update([0]);
        h.update(a.password.as_bytes());
        hex::encode(h.finalize())
    })
    .unwrap_or_default()
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
