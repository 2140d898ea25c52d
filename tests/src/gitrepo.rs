//! A real git repository served over HTTP for git-source tests: commits are made with the real
//! `git` CLI into a bare repository, which a small static file server on loopback serves the way
//! git's "dumb" HTTP transport reads it (`info/refs`, `objects/…`, after
//! `git update-server-info`). Both the operator's refs listing and the agent's `git` clone talk
//! to it as to any git host. Optional basic auth checks that credentials travel.
//!
//! [`GitRepo::start_smart`] also speaks git's "smart" HTTP protocol, through the real `git
//! http-backend` run as a CGI program: go-git (PKO's operator and agent) speaks no other.

use std::path::{Component, Path, PathBuf};
use std::process::Command;
use std::sync::Arc;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;

use crate::HarnessError;

/// Where the HTTPS server serves the repository: an owner and a name, as a git host's URL
/// has (PKO refuses a URL with a one-part path).
const HTTPS_PATH: &str = "/pko-tests/repo.git";

pub struct GitRepo {
    work: PathBuf,
    bare: PathBuf,
    port: u16,
    /// With TLS: the certificate (PEM) clients must trust.
    tls_cert: Option<String>,
    /// Requests served, by path (for asserting who fetched what).
    log: Arc<std::sync::Mutex<Vec<String>>>,
    task: tokio::task::JoinHandle<()>,
}

fn git(dir: &Path, args: &[&str]) -> Result<String, HarnessError> {
    let out = Command::new("git")
        .arg("-C")
        .arg(dir)
        .args([
            "-c",
            "user.name=pko-tests",
            "-c",
            "user.email=tests@pko.invalid",
        ])
        .args(args)
        .env("GIT_CONFIG_GLOBAL", "/dev/null")
        .env("GIT_CONFIG_NOSYSTEM", "1")
        .output()
        .map_err(|e| HarnessError::io(format!("running git {}", args.join(" ")), e))?;
    if !out.status.success() {
        return Err(HarnessError::io(
            format!("git {}", args.join(" ")),
            std::io::Error::other(String::from_utf8_lossy(&out.stderr).into_owned()),
        ));
    }
    Ok(String::from_utf8_lossy(&out.stdout).trim().to_owned())
}

impl GitRepo {
    /// An empty repository (branch `main`) under `dir`, served on a free loopback port;
    /// `basic_auth` (`user`, `password`) makes every request need those credentials.
    pub async fn start(dir: &Path, basic_auth: Option<(&str, &str)>) -> Result<Self, HarnessError> {
        Self::start_serving(dir, basic_auth, false).await
    }

    /// [`Self::start`] over HTTPS (a self-signed certificate for 127.0.0.1, see
    /// [`Self::tls_cert`]), also serving the smart protocol (`info/refs?service=git-upload-pack`
    /// and `git-upload-pack`) with `git http-backend`: what PKO, which takes `https` and `ssh`
    /// repositories only and clones with go-git, needs.
    pub async fn start_smart_https(
        dir: &Path,
        basic_auth: Option<(&str, &str)>,
    ) -> Result<Self, HarnessError> {
        Self::start_serving(dir, basic_auth, true).await
    }

    /// The certificate an HTTPS server presents (PEM), to trust.
    pub fn tls_cert(&self) -> Option<&str> {
        self.tls_cert.as_deref()
    }

    async fn start_serving(
        dir: &Path,
        basic_auth: Option<(&str, &str)>,
        smart: bool,
    ) -> Result<Self, HarnessError> {
        let work = dir.join("work");
        let bare = dir.join("repo.git");
        std::fs::create_dir_all(&work)
            .map_err(|e| HarnessError::io(format!("creating {}", work.display()), e))?;
        git(&work, &["init", "-q", "-b", "main"])?;
        git(dir, &["init", "-q", "--bare", "-b", "main", "repo.git"])?;
        git(
            &work,
            &["remote", "add", "origin", &bare.display().to_string()],
        )?;
        let listener = TcpListener::bind("127.0.0.1:0")
            .await
            .map_err(|e| HarnessError::io("binding the git server", e))?;
        let port = listener
            .local_addr()
            .map_err(|e| HarnessError::io("git server address", e))?
            .port();
        let expected = basic_auth.map(|(u, p)| {
            use base64::Engine;
            format!(
                "Basic {}",
                base64::engine::general_purpose::STANDARD.encode(format!("{u}:{p}"))
            )
        });
        let log = Arc::new(std::sync::Mutex::new(Vec::new()));
        let (tls_cert, acceptor) = if smart {
            let (cert, key) = crate::agent::self_signed(&["127.0.0.1", "localhost"])?;
            (Some(cert.clone()), Some(tls_acceptor(&cert, &key)?))
        } else {
            (None, None)
        };
        let task = tokio::spawn(serve(
            listener,
            bare.clone(),
            expected,
            log.clone(),
            acceptor,
        ));
        Ok(Self {
            work,
            bare,
            port,
            tls_cert,
            log,
            task,
        })
    }

    /// The clone URL.
    pub fn url(&self) -> String {
        match self.tls_cert {
            Some(_) => format!("https://127.0.0.1:{}{HTTPS_PATH}", self.port),
            None => format!("http://127.0.0.1:{}/repo.git", self.port),
        }
    }

    /// Writes `files` (path → content), commits them on `branch` and pushes; returns the SHA.
    pub fn commit(&self, branch: &str, files: &[(&str, &str)]) -> Result<String, HarnessError> {
        let current = git(&self.work, &["rev-parse", "--abbrev-ref", "HEAD"]).unwrap_or_default();
        if current != branch {
            // A new branch starts from the current commit; an existing one is checked out.
            if git(&self.work, &["checkout", "-q", branch]).is_err() {
                git(&self.work, &["checkout", "-q", "-b", branch])?;
            }
        }
        for (path, content) in files {
            let file = self.work.join(path);
            if let Some(parent) = file.parent() {
                std::fs::create_dir_all(parent)
                    .map_err(|e| HarnessError::io(format!("creating {}", parent.display()), e))?;
            }
            std::fs::write(&file, content)
                .map_err(|e| HarnessError::io(format!("writing {}", file.display()), e))?;
        }
        git(&self.work, &["add", "-A"])?;
        git(
            &self.work,
            &["commit", "-q", "--allow-empty", "-m", "change"],
        )?;
        git(&self.work, &["push", "-q", "origin", branch])?;
        git(&self.bare, &["update-server-info"])?;
        git(&self.work, &["rev-parse", "HEAD"])
    }

    /// The bare repository (what a git server over SSH serves).
    pub fn bare(&self) -> &Path {
        &self.bare
    }

    /// Paths requested so far.
    pub fn requests(&self) -> Vec<String> {
        self.log
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone()
    }
}

impl Drop for GitRepo {
    fn drop(&mut self) {
        self.task.abort();
    }
}

fn tls_acceptor(cert: &str, key: &str) -> Result<tokio_rustls::TlsAcceptor, HarnessError> {
    use rustls::pki_types::pem::PemObject;
    use rustls::pki_types::{CertificateDer, PrivateKeyDer};
    crate::ensure_crypto_provider();
    let bad =
        |e: String| HarnessError::io("the git server's certificate", std::io::Error::other(e));
    let chain =
        vec![CertificateDer::from_pem_slice(cert.as_bytes()).map_err(|e| bad(e.to_string()))?];
    let key = PrivateKeyDer::from_pem_slice(key.as_bytes()).map_err(|e| bad(e.to_string()))?;
    let config = rustls::ServerConfig::builder()
        .with_no_client_auth()
        .with_single_cert(chain, key)
        .map_err(|e| bad(e.to_string()))?;
    Ok(tokio_rustls::TlsAcceptor::from(Arc::new(config)))
}

async fn serve(
    listener: TcpListener,
    root: PathBuf,
    auth: Option<String>,
    log: Arc<std::sync::Mutex<Vec<String>>>,
    tls: Option<tokio_rustls::TlsAcceptor>,
) {
    while let Ok((conn, _)) = listener.accept().await {
        let root = root.clone();
        let auth = auth.clone();
        let log = log.clone();
        let tls = tls.clone();
        tokio::spawn(async move {
            match tls {
                Some(tls) => {
                    if let Ok(conn) = tls.accept(conn).await {
                        answer(conn, &root, auth.as_deref(), &log, true).await;
                    }
                }
                None => answer(conn, &root, auth.as_deref(), &log, false).await,
            }
        });
    }
}

/// Answers one request on `conn`.
async fn answer<S>(
    mut conn: S,
    root: &Path,
    auth: Option<&str>,
    log: &std::sync::Mutex<Vec<String>>,
    smart: bool,
) where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin,
{
    {
        let mut head = Vec::new();
        let mut buf = [0u8; 1024];
        while !head.windows(4).any(|w| w == b"\r\n\r\n") && head.len() < 64 * 1024 {
            match conn.read(&mut buf).await {
                Ok(0) | Err(_) => return,
                Ok(n) => head.extend_from_slice(&buf[..n]),
            }
        }
        let text = String::from_utf8_lossy(&head).into_owned();
        let target = text
            .lines()
            .next()
            .and_then(|l| l.split_whitespace().nth(1))
            .unwrap_or("/")
            .to_owned();
        let authorized = auth.is_none_or(|want| {
            text.lines().any(|l| {
                l.split_once(':').is_some_and(|(k, v)| {
                    k.eq_ignore_ascii_case("authorization") && v.trim() == want
                })
            })
        });
        let path = target.split('?').next().unwrap_or("/").to_owned();
        if let Ok(mut l) = log.lock() {
            l.push(path.clone());
        }
        // Over HTTPS the repository sits under an owner: the rest is the same.
        let path = match path.strip_prefix(HTTPS_PATH.trim_end_matches("/repo.git")) {
            Some(rest) if smart => rest.to_owned(),
            _ => path,
        };
        let query = target.split_once('?').map(|(_, q)| q).unwrap_or_default();
        let wants_smart = path.ends_with("/git-upload-pack")
            || (path.ends_with("/info/refs") && query.contains("service=git-upload-pack"));
        let response = if !authorized {
            reply(401, "text/plain", b"unauthorized\n".to_vec(), true)
        } else if smart && wants_smart {
            match smart_http(&mut conn, root, &text, &head, &path, query).await {
                Ok(response) => response,
                Err(e) => reply(500, "text/plain", format!("{e}\n").into_bytes(), false),
            }
        } else {
            match file_under(root, &path).and_then(|f| std::fs::read(f).ok()) {
                Some(body) => reply(200, "application/octet-stream", body, false),
                None => reply(404, "text/plain", b"not found\n".to_vec(), false),
            }
        };
        let _ = conn.write_all(&response).await;
        let _ = conn.shutdown().await;
    }
}

/// `/repo.git/<rest>` → a file of the bare repository; nothing outside it.
fn file_under(root: &Path, path: &str) -> Option<PathBuf> {
    let rest = path.strip_prefix("/repo.git/")?;
    let rel = Path::new(rest);
    if rel.components().any(|c| !matches!(c, Component::Normal(_))) {
        return None;
    }
    let file = root.join(rel);
    file.is_file().then_some(file)
}

/// One smart-protocol request answered by `git http-backend` (CGI): the request's body (sized
/// or chunked) is its input, its headers and output the response.
async fn smart_http<S: tokio::io::AsyncRead + Unpin>(
    conn: &mut S,
    bare: &Path,
    head_text: &str,
    head: &[u8],
    path: &str,
    query: &str,
) -> std::io::Result<Vec<u8>> {
    let header = |name: &str| {
        head_text.lines().skip(1).find_map(|l| {
            let (k, v) = l.split_once(':')?;
            k.trim()
                .eq_ignore_ascii_case(name)
                .then(|| v.trim().to_owned())
        })
    };
    let method = head_text
        .split_whitespace()
        .next()
        .unwrap_or("GET")
        .to_owned();
    let body_start = head
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .map_or(head.len(), |p| p + 4);
    let mut body = head[body_start..].to_vec();
    let chunked = header("transfer-encoding").is_some_and(|v| v.eq_ignore_ascii_case("chunked"));
    let length: usize = header("content-length")
        .and_then(|v| v.parse().ok())
        .unwrap_or(0);
    let mut buf = [0u8; 16 * 1024];
    loop {
        let complete = if chunked {
            dechunk(&body).is_some()
        } else {
            body.len() >= length
        };
        if complete || body.len() > 64 << 20 {
            break;
        }
        let n = conn.read(&mut buf).await?;
        if n == 0 {
            break;
        }
        body.extend_from_slice(&buf[..n]);
    }
    let input = if chunked {
        dechunk(&body).unwrap_or_default()
    } else {
        body.truncate(length);
        body
    };
    let (Some(project_root), Some(repo)) = (bare.parent(), bare.file_name()) else {
        return Err(std::io::Error::other("the bare repository has no parent"));
    };
    let path_info = match path.strip_prefix("/repo.git") {
        Some(rest) => format!("/{}{rest}", repo.to_string_lossy()),
        None => return Err(std::io::Error::other(format!("no repository at {path}"))),
    };
    let mut cgi = tokio::process::Command::new("git");
    cgi.arg("http-backend")
        .env_clear()
        .env("PATH", std::env::var_os("PATH").unwrap_or_default())
        .env("GIT_PROJECT_ROOT", project_root)
        .env("GIT_HTTP_EXPORT_ALL", "1")
        .env("GIT_CONFIG_NOSYSTEM", "1")
        .env("GIT_CONFIG_GLOBAL", "/dev/null")
        .env("REQUEST_METHOD", &method)
        .env("PATH_INFO", &path_info)
        .env("QUERY_STRING", query)
        .env("CONTENT_LENGTH", input.len().to_string())
        .env("REMOTE_ADDR", "127.0.0.1")
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null())
        .kill_on_drop(true);
    if let Some(t) = header("content-type") {
        cgi.env("CONTENT_TYPE", t);
    }
    if let Some(e) = header("content-encoding") {
        cgi.env("HTTP_CONTENT_ENCODING", e);
    }
    if let Some(p) = header("git-protocol") {
        cgi.env("GIT_PROTOCOL", p);
    }
    let mut child = cgi.spawn()?;
    let mut stdin = child
        .stdin
        .take()
        .ok_or_else(|| std::io::Error::other("no stdin"))?;
    let writer = tokio::spawn(async move {
        let _ = stdin.write_all(&input).await;
    });
    let out = child.wait_with_output().await?;
    let _ = writer.await;
    let split = out
        .stdout
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .map(|p| (p, p + 4))
        .or_else(|| {
            out.stdout
                .windows(2)
                .position(|w| w == b"\n\n")
                .map(|p| (p, p + 2))
        })
        .ok_or_else(|| std::io::Error::other("git http-backend wrote no headers"))?;
    let cgi_head = String::from_utf8_lossy(&out.stdout[..split.0]).into_owned();
    let body = out.stdout[split.1..].to_vec();
    let mut status = "200 OK".to_owned();
    let mut response = String::new();
    for line in cgi_head.lines() {
        match line.split_once(':') {
            Some((k, v)) if k.eq_ignore_ascii_case("status") => status = v.trim().to_owned(),
            Some(_) => {
                response.push_str(line.trim_end());
                response.push_str("\r\n");
            }
            None => {}
        }
    }
    let mut out = format!(
        "HTTP/1.1 {status}\r\n{response}Content-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    )
    .into_bytes();
    out.extend_from_slice(&body);
    Ok(out)
}

/// The body of a complete chunked transfer, `None` while chunks are missing.
fn dechunk(mut data: &[u8]) -> Option<Vec<u8>> {
    let mut out = Vec::new();
    loop {
        let line_end = data.windows(2).position(|w| w == b"\r\n")?;
        let size_text = String::from_utf8_lossy(&data[..line_end]);
        let size = usize::from_str_radix(size_text.split(';').next()?.trim(), 16).ok()?;
        data = &data[line_end + 2..];
        if size == 0 {
            return Some(out);
        }
        out.extend_from_slice(data.get(..size)?);
        data = data.get(size + 2..)?;
    }
}

fn reply(status: u16, content_type: &str, body: Vec<u8>, challenge: bool) -> Vec<u8> {
    let reason = match status {
        200 => "OK",
        401 => "Unauthorized",
        500 => "Internal Server Error",
        _ => "Not Found",
    };
    let mut head = format!(
        "HTTP/1.1 {status} {reason}\r\nContent-Type: {content_type}\r\nContent-Length: {}\r\nConnection: close\r\n",
        body.len()
    );
    if challenge {
        head.push_str("WWW-Authenticate: Basic realm=\"git\"\r\n");
    }
    head.push_str("\r\n");
    let mut out = head.into_bytes();
    out.extend_from_slice(&body);
    out
}
