//! `git ls-remote` over SSH, without an `ssh` or `git` binary in the operator image: an SSH
//! client in-process (russh) runs `git-upload-pack '<path>'` on the server and reads the refs it
//! advertises first (protocol v0: pkt-lines up to a flush), then says it wants nothing.
//!
//! The host key is checked before anything is sent: against the `knownHosts` lines of the
//! Secret that holds the key, or, with `--git-ssh-accept-new-host-keys`, trusted on first use
//! and remembered for the operator's lifetime (a changed key is refused). Without either, the
//! server is refused, since the operator image has no known_hosts of its own.
//!
//! The URL, the key, its passphrase and the known_hosts text are a tenant's: the path reaches
//! the remote command quoted, the host and user are checked, the answer is bounded, and
//! failures are told by class (see `gitremote`).

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use base64::Engine;
use russh::keys::{PrivateKeyWithHashAlg, PublicKeyBase64};

/// Longest wait for the connection, the handshake, the login and the refs together.
pub const TIMEOUT: Duration = Duration::from_secs(30);
/// known_hosts text a Secret may hold (GitHub's is under 1 KiB).
const MAX_KNOWN_HOSTS_BYTES: usize = 256 * 1024;

#[derive(Debug, thiserror::Error)]
pub enum SshError {
    #[error("not an SSH repository URL")]
    NotSsh,
    #[error("invalid SSH repository URL: {0}")]
    BadUrl(&'static str),
    #[error("invalid known_hosts (the Secret's `knownHosts` key), line {line}: {detail}")]
    BadKnownHosts { line: usize, detail: &'static str },
    #[error("the known_hosts given (the Secret's `knownHosts` key) lists no host key")]
    EmptyKnownHosts,
    #[error("the known_hosts given (the Secret's `knownHosts` key) is larger than 256 KiB")]
    KnownHostsTooLarge,
    #[error(
        "the SSH key is encrypted: give its passphrase (gitAuth.sshAuth.password, or `password` in gitAuthSecret)"
    )]
    KeyNeedsPassphrase,
    #[error(
        "cannot read the SSH key with the passphrase given (a wrong passphrase, or not an OpenSSH, PKCS#8 or PEM private key)"
    )]
    KeyUndecryptable,
    #[error("the SSH key is not an OpenSSH, PKCS#8 or PEM private key")]
    KeyUnreadable,
    #[error("{0}")]
    HostKey(HostKeyVerdict),
    #[error("the SSH login was refused")]
    AuthRefused,
    #[error("no SSH connection")]
    Connection(#[source] Box<dyn std::error::Error + Send + Sync>),
    #[error("the server sent no refs (no such repository, or no access to it)")]
    NoRefs,
    #[error("the server sent more than {0} bytes of refs")]
    TooLarge(usize),
    #[error("the server's refs are not pkt-lines")]
    BadAnswer,
}

fn connection(e: impl std::error::Error + Send + Sync + 'static) -> SshError {
    SshError::Connection(Box::new(e))
}

/// An SSH repository: `ssh://[user@]host[:port]/path` (also `git+ssh://`, `ssh+git://`) or
/// scp-like `[user@]host:path`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SshUrl {
    pub user: String,
    pub host: String,
    pub port: u16,
    pub path: String,
}

impl SshUrl {
    /// `Err(NotSsh)` for URLs of other transports (http(s), file paths, …).
    pub fn parse(url: &str) -> Result<Self, SshError> {
        let (authority, path) = if let Some(rest) = ["ssh://", "git+ssh://", "ssh+git://"]
            .iter()
            .find_map(|p| url.strip_prefix(p))
        {
            let (authority, path) = rest.split_once('/').ok_or(SshError::BadUrl("no path"))?;
            // `ssh://host/~user/repo` is `~user/repo` on the server, as git reads it.
            let path = if path.starts_with('~') {
                path.to_owned()
            } else {
                format!("/{path}")
            };
            (authority.to_owned(), path)
        } else if url.contains("://") {
            return Err(SshError::NotSsh);
        } else {
            // scp-like: a colon before any slash (`./a:b` and `/x:y` are local paths).
            match url.split_once(':') {
                Some((authority, path)) if !authority.contains('/') && !authority.is_empty() => {
                    (authority.to_owned(), path.to_owned())
                }
                _ => return Err(SshError::NotSsh),
            }
        };
        let (user, hostport) = match authority.rsplit_once('@') {
            Some((user, host)) => (user.to_owned(), host.to_owned()),
            None => ("git".to_owned(), authority),
        };
        let (host, port) = split_port(&hostport)?;
        let name_ok = |s: &str| {
            !s.is_empty()
                && !s.starts_with('-')
                && s.bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b"._-:".contains(&b))
        };
        if !name_ok(&host) {
            return Err(SshError::BadUrl("the host is not a name or an address"));
        }
        if !name_ok(&user) || user.contains(':') {
            return Err(SshError::BadUrl("the user is not a plain name"));
        }
        if path.is_empty() || path == "/" {
            return Err(SshError::BadUrl("no path"));
        }
        if path.len() > 4096 || path.chars().any(char::is_control) {
            return Err(SshError::BadUrl("the path has control characters"));
        }
        Ok(Self {
            user,
            host,
            port,
            path,
        })
    }

    /// The name known_hosts lists this server under: `host`, or `[host]:port` off port 22.
    pub fn known_hosts_name(&self) -> String {
        if self.port == 22 {
            self.host.clone()
        } else {
            format!("[{}]:{}", self.host, self.port)
        }
    }

    /// The command the server runs, the path quoted for its shell (as git quotes it).
    pub fn upload_pack_command(&self) -> String {
        format!("git-upload-pack '{}'", self.path.replace('\'', "'\\''"))
    }
}

fn split_port(hostport: &str) -> Result<(String, u16), SshError> {
    if let Some(rest) = hostport.strip_prefix('[') {
        let (host, after) = rest.split_once(']').ok_or(SshError::BadUrl("unclosed ["))?;
        let port = match after.strip_prefix(':') {
            Some(p) => p.parse().map_err(|_| SshError::BadUrl("bad port"))?,
            None if after.is_empty() => 22,
            None => return Err(SshError::BadUrl("bad port")),
        };
        return Ok((host.to_owned(), port));
    }
    match hostport.split_once(':') {
        Some((host, port)) => Ok((
            host.to_owned(),
            port.parse().map_err(|_| SshError::BadUrl("bad port"))?,
        )),
        None => Ok((hostport.to_owned(), 22)),
    }
}

/// What the host key check found.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum HostKeyVerdict {
    #[error("the server's SSH host key is trusted")]
    Trusted,
    #[error(
        "the git server's SSH host key is not trusted: knownHosts (in the Secret holding the SSH key) lists no key for it"
    )]
    Unknown,
    #[error(
        "the git server's SSH host key does not match the one knownHosts lists for it (in the Secret holding the SSH key): the key changed, or this is another server"
    )]
    Mismatch,
    #[error("the git server's SSH host key is marked @revoked in knownHosts")]
    Revoked,
    #[error(
        "the git server's SSH host key changed since the operator first saw it (--git-ssh-accept-new-host-keys trusts a host's first key only)"
    )]
    Changed,
    #[error(
        "the git server's SSH host key is not trusted: put the server's known_hosts lines in the `knownHosts` key of the Secret holding the SSH key, or start the operator with --git-ssh-accept-new-host-keys to trust a key on first use"
    )]
    NoRule,
    #[error("the git server offered an SSH host certificate; only plain host keys are checked")]
    Certificate,
}

/// Parsed known_hosts lines.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KnownHosts {
    entries: Vec<Entry>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
struct Entry {
    revoked: bool,
    hosts: Hosts,
    /// The key blob (the base64 field decoded).
    key: Vec<u8>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum Hosts {
    /// `|1|salt|hash`: HMAC-SHA1 of the name under the salt.
    Hashed { salt: Vec<u8>, hash: Vec<u8> },
    /// Comma-separated patterns (`*`, `?`), `!` negates.
    Patterns(Vec<(bool, String)>),
}

impl KnownHosts {
    /// OpenSSH's format: `[@marker] hosts keytype base64-key [comment]`, `#` comments.
    /// `@cert-authority` lines are skipped (certificates are not checked).
    pub fn parse(text: &str) -> Result<Self, SshError> {
        if text.len() > MAX_KNOWN_HOSTS_BYTES {
            return Err(SshError::KnownHostsTooLarge);
        }
        let b64 = base64::engine::general_purpose::STANDARD;
        let mut entries = Vec::new();
        for (i, line) in text.lines().enumerate() {
            let bad = |detail| SshError::BadKnownHosts {
                line: i + 1,
                detail,
            };
            let line = line.trim();
            if line.is_empty() || line.starts_with('#') {
                continue;
            }
            let mut fields: Vec<&str> = line.split_whitespace().collect();
            let marker = fields
                .first()
                .filter(|f| f.starts_with('@'))
                .map(|m| m.to_string());
            if marker.is_some() {
                fields.remove(0);
            }
            if fields.len() < 3 {
                return Err(bad("expected `hosts keytype base64-key`"));
            }
            let key = b64
                .decode(fields[2])
                .map_err(|_| bad("the key is not base64"))?;
            let revoked = match marker.as_deref() {
                None => false,
                Some("@revoked") => true,
                Some("@cert-authority") => continue,
                Some(_) => return Err(bad("unknown marker (only @revoked, @cert-authority)")),
            };
            let hosts = if let Some(hashed) = fields[0].strip_prefix("|1|") {
                let (salt, hash) = hashed
                    .split_once('|')
                    .ok_or(bad("a hashed host is |1|salt|hash"))?;
                Hosts::Hashed {
                    salt: b64.decode(salt).map_err(|_| bad("bad hashed host"))?,
                    hash: b64.decode(hash).map_err(|_| bad("bad hashed host"))?,
                }
            } else {
                Hosts::Patterns(
                    fields[0]
                        .split(',')
                        .filter(|p| !p.is_empty())
                        .map(|p| match p.strip_prefix('!') {
                            Some(p) => (true, p.to_ascii_lowercase()),
                            None => (false, p.to_ascii_lowercase()),
                        })
                        .collect(),
                )
            };
            entries.push(Entry {
                revoked,
                hosts,
                key,
            });
        }
        if entries.is_empty() {
            return Err(SshError::EmptyKnownHosts);
        }
        Ok(Self { entries })
    }

    /// Whether `key` (a key blob) may be `name`'s (as [`SshUrl::known_hosts_name`] gives it).
    pub fn check(&self, name: &str, key: &[u8]) -> HostKeyVerdict {
        let name = name.to_ascii_lowercase();
        let matching: Vec<&Entry> = self
            .entries
            .iter()
            .filter(|e| e.hosts.matches(&name))
            .collect();
        // A revoked key is refused wherever its line is.
        if matching.iter().any(|e| e.revoked && e.key == key) {
            return HostKeyVerdict::Revoked;
        }
        let listed: Vec<&&Entry> = matching.iter().filter(|e| !e.revoked).collect();
        if listed.iter().any(|e| e.key == key) {
            HostKeyVerdict::Trusted
        } else if listed.is_empty() {
            HostKeyVerdict::Unknown
        } else {
            HostKeyVerdict::Mismatch
        }
    }
}

impl Hosts {
    fn matches(&self, name: &str) -> bool {
        match self {
            Hosts::Hashed { salt, hash } => {
                let key = ring::hmac::Key::new(ring::hmac::HMAC_SHA1_FOR_LEGACY_USE_ONLY, salt);
                ring::hmac::verify(&key, name.as_bytes(), hash).is_ok()
            }
            Hosts::Patterns(patterns) => {
                let mut hit = false;
                for (negated, pattern) in patterns {
                    if glob(pattern.as_bytes(), name.as_bytes()) {
                        if *negated {
                            return false;
                        }
                        hit = true;
                    }
                }
                hit
            }
        }
    }
}

/// OpenSSH's host patterns: `*` any run, `?` one character. Iterative, so a hostile pattern
/// costs O(pattern × name).
fn glob(pattern: &[u8], text: &[u8]) -> bool {
    let (mut p, mut t) = (0, 0);
    let mut star: Option<(usize, usize)> = None;
    while t < text.len() {
        match pattern.get(p) {
            Some(b'*') => {
                star = Some((p, t));
                p += 1;
            }
            Some(&c) if c == b'?' || c == text[t] => {
                p += 1;
                t += 1;
            }
            _ => match star {
                Some((sp, st)) => {
                    p = sp + 1;
                    t = st + 1;
                    star = Some((sp, st + 1));
                }
                None => return false,
            },
        }
    }
    pattern[p..].iter().all(|&c| c == b'*')
}

/// How a server's host key is judged.
#[derive(Clone)]
pub enum HostKeyRule {
    /// Only keys these lines list.
    Known(Arc<KnownHosts>),
    /// The first key seen for a host name is kept here and required from then on.
    AcceptNew(Arc<Mutex<HashMap<String, Vec<u8>>>>),
    /// Nothing to check against: refused.
    None,
}

impl HostKeyRule {
    /// The verdict on `key` for `name`; a first key under `AcceptNew` is remembered.
    pub fn judge(&self, name: &str, key: &[u8]) -> HostKeyVerdict {
        match self {
            HostKeyRule::Known(known) => known.check(name, key),
            HostKeyRule::AcceptNew(seen) => {
                let mut seen = seen.lock().unwrap_or_else(|e| e.into_inner());
                match seen.get(name) {
                    Some(first) if first.as_slice() == key => HostKeyVerdict::Trusted,
                    Some(_) => HostKeyVerdict::Changed,
                    None => {
                        seen.insert(name.to_owned(), key.to_vec());
                        HostKeyVerdict::Trusted
                    }
                }
            }
            HostKeyRule::None => HostKeyVerdict::NoRule,
        }
    }
}

/// The SSH key and its passphrase.
#[derive(Clone)]
pub struct SshKey {
    pub private_key: String,
    pub passphrase: Option<String>,
}

impl std::fmt::Debug for SshKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SshKey").finish_non_exhaustive()
    }
}

/// Decodes the key (OpenSSH, PKCS#8, PEM; encrypted ones with the passphrase).
fn decode_key(key: &SshKey) -> Result<russh::keys::PrivateKey, SshError> {
    let passphrase = key.passphrase.as_deref().filter(|p| !p.is_empty());
    russh::keys::decode_secret_key(key.private_key.trim(), passphrase).map_err(|e| match e {
        russh::keys::Error::KeyIsEncrypted => SshError::KeyNeedsPassphrase,
        _ if passphrase.is_some() => SshError::KeyUndecryptable,
        _ => SshError::KeyUnreadable,
    })
}

/// Checks the server's key, and keeps the verdict for the error.
struct Checker {
    name: String,
    rule: HostKeyRule,
    verdict: Arc<Mutex<Option<HostKeyVerdict>>>,
}

impl russh::client::Handler for Checker {
    type Error = russh::Error;

    async fn check_server_key(
        &mut self,
        key: &russh::keys::PublicKeyOrCertificate,
    ) -> Result<bool, Self::Error> {
        let verdict = match key {
            russh::keys::PublicKeyOrCertificate::PublicKey { key, .. } => {
                self.rule.judge(&self.name, &key.public_key_bytes())
            }
            russh::keys::PublicKeyOrCertificate::Certificate(_) => HostKeyVerdict::Certificate,
        };
        *self.verdict.lock().unwrap_or_else(|e| e.into_inner()) = Some(verdict);
        Ok(verdict == HostKeyVerdict::Trusted)
    }
}

/// The refs advertisement of `url`'s repository from the server at `addr` (already allowed by
/// the egress rules), at most `max_bytes` of it.
pub async fn advertised_refs(
    addr: SocketAddr,
    url: &SshUrl,
    key: Option<&SshKey>,
    rule: HostKeyRule,
    max_bytes: usize,
) -> Result<Vec<u8>, SshError> {
    // The key is read before any connection: a bad one is the tenant's to fix, not the server's.
    let private = key.map(decode_key).transpose()?;
    let stream = tokio::net::TcpStream::connect(addr)
        .await
        .map_err(connection)?;
    let verdict = Arc::new(Mutex::new(None));
    let checker = Checker {
        name: url.known_hosts_name(),
        rule,
        verdict: verdict.clone(),
    };
    let config = Arc::new(russh::client::Config {
        inactivity_timeout: Some(TIMEOUT),
        ..russh::client::Config::default()
    });
    let mut session = match russh::client::connect_stream(config, stream, checker).await {
        Ok(s) => s,
        Err(e) => {
            let verdict = *verdict.lock().unwrap_or_else(|e| e.into_inner());
            return Err(match verdict {
                Some(v) if v != HostKeyVerdict::Trusted => SshError::HostKey(v),
                _ => connection(e),
            });
        }
    };
    let auth = match private {
        Some(private) => {
            let hash = session
                .best_supported_rsa_hash()
                .await
                .map_err(connection)?
                .flatten();
            session
                .authenticate_publickey(
                    url.user.clone(),
                    PrivateKeyWithHashAlg::new(Arc::new(private), hash),
                )
                .await
        }
        None => session.authenticate_none(url.user.clone()).await,
    }
    .map_err(connection)?;
    if !auth.success() {
        return Err(SshError::AuthRefused);
    }
    let mut channel = session.channel_open_session().await.map_err(connection)?;
    channel
        .exec(true, url.upload_pack_command())
        .await
        .map_err(connection)?;
    let mut refs = Vec::new();
    let end = loop {
        let Some(msg) = channel.wait().await else {
            break None;
        };
        match msg {
            russh::ChannelMsg::Data { data } => {
                if refs.len() + data.len() > max_bytes {
                    return Err(SshError::TooLarge(max_bytes));
                }
                refs.extend_from_slice(&data);
                if let Some(end) = advertisement_end(&refs)? {
                    break Some(end);
                }
            }
            russh::ChannelMsg::Eof | russh::ChannelMsg::Close => break None,
            _ => {}
        }
    };
    let Some(end) = end else {
        return Err(SshError::NoRefs);
    };
    refs.truncate(end);
    // Nothing wanted: a flush ends the exchange cleanly on the server's side.
    let _ = channel.data_bytes(&b"0000"[..]).await;
    let _ = channel.eof().await;
    let _ = session
        .disconnect(russh::Disconnect::ByApplication, "", "en")
        .await;
    Ok(refs)
}

/// Where the refs advertisement in `buf` ends (just past its flush packet), `None` while it is
/// incomplete. An `ERR` packet means the server refused the repository.
fn advertisement_end(buf: &[u8]) -> Result<Option<usize>, SshError> {
    let mut at = 0;
    while buf.len() >= at + 4 {
        let len = std::str::from_utf8(&buf[at..at + 4])
            .ok()
            .and_then(|t| usize::from_str_radix(t, 16).ok())
            .ok_or(SshError::BadAnswer)?;
        if len == 0 {
            return Ok(Some(at + 4));
        }
        if len < 4 {
            return Err(SshError::BadAnswer);
        }
        if buf.len() < at + len {
            return Ok(None);
        }
        if buf[at + 4..at + len].starts_with(b"ERR ") {
            return Err(SshError::NoRefs);
        }
        at += len;
    }
    Ok(None)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ssh_urls_of_both_forms() {
        let u = SshUrl::parse("ssh://deploy@git.example.com:2222/org/repo.git").expect("url");
        assert_eq!(
            u,
            SshUrl {
                user: "deploy".into(),
                host: "git.example.com".into(),
                port: 2222,
                path: "/org/repo.git".into()
            }
        );
        assert_eq!(u.known_hosts_name(), "[git.example.com]:2222");
        let scp = SshUrl::parse("git@github.com:org/repo.git").expect("scp");
        assert_eq!((scp.port, scp.path.as_str()), (22, "org/repo.git"));
        assert_eq!(scp.known_hosts_name(), "github.com");
        let v6 = SshUrl::parse("ssh://[::1]:22/r").expect("v6");
        assert_eq!((v6.host.as_str(), v6.port), ("::1", 22));
        assert_eq!(SshUrl::parse("ssh://h/~u/r").expect("home").path, "~u/r");
        assert_eq!(SshUrl::parse("git+ssh://h/r").expect("git+ssh").user, "git");
        for other in ["https://h/r", "/srv/repo", "./a:b", "file:///r"] {
            assert!(
                matches!(SshUrl::parse(other), Err(SshError::NotSsh)),
                "{other}"
            );
        }
        for bad in [
            "ssh://-oProxyCommand=x/r",
            "ssh://h:99999/r",
            "ssh://h",
            "ssh://u@h/r\nx",
            "ssh://a b@h/r",
            "-oProxyCommand=x:r",
        ] {
            assert!(
                matches!(SshUrl::parse(bad), Err(SshError::BadUrl(_))),
                "{bad}"
            );
        }
    }

    #[test]
    fn the_path_is_one_quoted_argument() {
        let u = SshUrl::parse("ssh://h/it's; rm -rf ~").expect("url");
        assert_eq!(
            u.upload_pack_command(),
            r"git-upload-pack '/it'\''s; rm -rf ~'"
        );
    }

    const ED: &str = "AAAAC3NzaC1lZDI1NTE5AAAAIOMqqnkVzrm0SdG6UOoqKLsabgH5C9okWi0dh2l9GKJl";
    const OTHER: &str = "AAAAC3NzaC1lZDI1NTE5AAAAIBzz7YHRzrYaCEWwKl0Km0Bn9jW6W4vNQ5kUhI6JxJbq";

    fn blob(b64: &str) -> Vec<u8> {
        base64::engine::general_purpose::STANDARD
            .decode(b64)
            .expect("b64")
    }

    #[test]
    fn known_hosts_names_patterns_ports_and_markers() {
        let text = format!(
            "# comment\ngithub.com,140.82.112.3 ssh-ed25519 {ED}\n[git.local]:2222 ssh-ed25519 {ED}\n*.corp,!bad.corp ssh-ed25519 {ED}\n@cert-authority *.ca ssh-ed25519 {ED}\n@revoked old.corp ssh-ed25519 {OTHER}\n"
        );
        let k = KnownHosts::parse(&text).expect("parse");
        let (ed, other) = (blob(ED), blob(OTHER));
        assert_eq!(k.check("github.com", &ed), HostKeyVerdict::Trusted);
        assert_eq!(k.check("GitHub.com", &ed), HostKeyVerdict::Trusted);
        assert_eq!(k.check("github.com", &other), HostKeyVerdict::Mismatch);
        assert_eq!(
            k.check("git.local", &ed),
            HostKeyVerdict::Unknown,
            "port 22 is another entry"
        );
        assert_eq!(k.check("[git.local]:2222", &ed), HostKeyVerdict::Trusted);
        assert_eq!(k.check("a.corp", &ed), HostKeyVerdict::Trusted);
        assert_eq!(k.check("bad.corp", &ed), HostKeyVerdict::Unknown);
        assert_eq!(
            k.check("x.ca", &ed),
            HostKeyVerdict::Unknown,
            "CA lines are skipped"
        );
        assert_eq!(k.check("old.corp", &other), HostKeyVerdict::Revoked);
    }

    #[test]
    fn hashed_known_hosts_lines_match_their_name_only() {
        // `ssh-keygen -H` form: HMAC-SHA1(salt, name).
        let salt = b"0123456789abcdefghij";
        let key = ring::hmac::Key::new(ring::hmac::HMAC_SHA1_FOR_LEGACY_USE_ONLY, salt);
        let tag = ring::hmac::sign(&key, b"[git.local]:2222");
        let b64 = base64::engine::general_purpose::STANDARD;
        let line = format!(
            "|1|{}|{} ssh-ed25519 {ED}",
            b64.encode(salt),
            b64.encode(tag.as_ref())
        );
        let k = KnownHosts::parse(&line).expect("parse");
        assert_eq!(
            k.check("[git.local]:2222", &blob(ED)),
            HostKeyVerdict::Trusted
        );
        assert_eq!(k.check("git.local", &blob(ED)), HostKeyVerdict::Unknown);
    }

    #[test]
    fn bad_known_hosts_are_refused_with_their_line() {
        for (text, line) in [
            ("h ssh-ed25519\n", 1),
            (&*format!("h ssh-ed25519 {ED}\nh2 ssh-rsa not*base64\n"), 2),
            (&*format!("@weird h ssh-ed25519 {ED}\n"), 1),
            ("|1|abc h ssh-ed25519 AAAA\n", 1),
        ] {
            match KnownHosts::parse(text) {
                Err(SshError::BadKnownHosts { line: l, .. }) => assert_eq!(l, line, "{text}"),
                other => panic!("{text}: {other:?}"),
            }
        }
        assert!(matches!(
            KnownHosts::parse("# none\n"),
            Err(SshError::EmptyKnownHosts)
        ));
        let huge = "#".repeat(MAX_KNOWN_HOSTS_BYTES + 1);
        assert!(matches!(
            KnownHosts::parse(&huge),
            Err(SshError::KnownHostsTooLarge)
        ));
    }

    #[test]
    fn patterns_are_globbed_without_exponential_backtracking() {
        assert!(glob(b"*.example.com", b"git.example.com"));
        assert!(glob(b"git?.example.com", b"git1.example.com"));
        assert!(!glob(b"*.example.com", b"example.com"));
        // A naive recursive matcher takes exponential time to refuse this one.
        let evil = "*a".repeat(2000);
        let many = "a".repeat(5000);
        assert!(glob(evil.as_bytes(), many.as_bytes()));
        assert!(!glob(evil.as_bytes(), format!("{many}b").as_bytes()));
    }

    #[test]
    fn accept_new_trusts_the_first_key_and_refuses_a_change() {
        let rule = HostKeyRule::AcceptNew(Arc::default());
        assert_eq!(rule.judge("h", b"k1"), HostKeyVerdict::Trusted);
        assert_eq!(rule.judge("h", b"k1"), HostKeyVerdict::Trusted);
        assert_eq!(rule.judge("h", b"k2"), HostKeyVerdict::Changed);
        assert_eq!(rule.judge("[h]:2222", b"k2"), HostKeyVerdict::Trusted);
        assert_eq!(HostKeyRule::None.judge("h", b"k1"), HostKeyVerdict::NoRule);
        assert!(
            HostKeyVerdict::NoRule
                .to_string()
                .contains("--git-ssh-accept-new-host-keys")
        );
    }

    #[test]
    fn the_advertisement_ends_at_its_flush() {
        let adv = b"003d1111111111111111111111111111111111111111 refs/heads/main\n0000";
        assert_eq!(advertisement_end(&adv[..20]).expect("partial"), None);
        assert_eq!(advertisement_end(adv).expect("whole"), Some(adv.len()));
        assert!(matches!(
            advertisement_end(b"000dERR nope\n"),
            Err(SshError::NoRefs)
        ));
        assert!(matches!(
            advertisement_end(b"zzzz"),
            Err(SshError::BadAnswer)
        ));
    }
}
