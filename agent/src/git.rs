//! `init` from a git repository: the `git` CLI of the workspace image checks out one revision.
//!
//! The CLI (in every image Pulumi publishes: `pulumi/pulumi`, `pulumi-base` on Debian and UBI,
//! and the language images built on it) speaks every transport and credential helper git does,
//! so the agent carries no git implementation. An image without it (or, for an SSH URL, without
//! `ssh`) is told so before anything else, by name. Credentials come from the pod's env (the
//! Workspace's `git.auth` Secret keys, PKO's `GIT_*` names) and never appear on a command line:
//! HTTP credentials go in an `Authorization` header set through `GIT_CONFIG_*` env, an SSH key
//! and its passphrase in 0600 files (ssh asks this binary for the passphrase: see
//! [`askpass`]). GitHub App credentials are exchanged for an installation token first. Nothing
//! is left in the target folder when a step fails.

use std::path::{Path, PathBuf};
use std::time::Duration;

use base64::Engine;
use tokio::process::Command;
use tracing::info;

use crate::askpass;

/// How long one git command may take (a clone of a large repository over a slow link).
const GIT_TIMEOUT: Duration = Duration::from_secs(600);

#[derive(Debug, thiserror::Error)]
pub enum GitError {
    #[error("invalid git revision {0:?}")]
    BadRevision(String),
    #[error("GitHub App credentials: {0}")]
    GithubApp(#[from] pko_git::github_app::GithubAppError),
    #[error(
        "GitHub App credentials are incomplete: {0} is empty (the Secret keys of git.auth.githubApp)"
    )]
    GithubAppIncomplete(&'static str),
    #[error("cannot build the HTTPS client for the GitHub API: {0}")]
    HttpClient(String),
    #[error(
        "the workspace image has no `{program}` on its PATH: git sources are checked out with the image's git CLI{}; use an image that has it (every pulumi/pulumi image does) or a Program or Flux source",
        if .program == "ssh" { " over ssh" } else { "" }
    )]
    MissingTool { program: String },
    #[error("cannot run {program}: {source} (the workspace image needs the git CLI)")]
    Spawn {
        program: String,
        #[source]
        source: std::io::Error,
    },
    #[error("git {step} failed ({status}): {stderr}")]
    Failed {
        step: String,
        status: String,
        stderr: String,
    },
    #[error(
        "git {step}: the git server's SSH host key is not trusted ({stderr}); put the server's known_hosts lines in the `knownHosts` key of the Secret holding the SSH key, or start the operator with --git-ssh-accept-new-host-keys to trust a key on first use"
    )]
    UntrustedHostKey { step: String, stderr: String },
    #[error("invalid known_hosts (the Secret's `knownHosts` key), line {line}: {detail}")]
    BadKnownHosts { line: usize, detail: String },
    #[error("the known_hosts given (the Secret's `knownHosts` key) lists no host key")]
    EmptyKnownHosts,
    #[error("git {step} did not finish within {secs} s", secs = GIT_TIMEOUT.as_secs())]
    Timeout { step: String },
    #[error("{what}: {source}")]
    Io {
        what: String,
        #[source]
        source: std::io::Error,
    },
}

fn io(what: impl Into<String>) -> impl FnOnce(std::io::Error) -> GitError {
    let what = what.into();
    move |source| GitError::Io { what, source }
}

/// Credentials, as PKO's fetch container receives them (`GIT_*` env of the init container).
#[derive(Debug, Clone, Default)]
pub struct GitAuth {
    pub username: Option<String>,
    pub password: Option<String>,
    pub token: Option<String>,
    pub ssh_private_key: Option<String>,
    /// OpenSSH `known_hosts` lines the server's host key must match.
    pub ssh_known_hosts: Option<String>,
    /// With no `ssh_known_hosts`: trust the host key seen first (ssh's `accept-new`) instead of
    /// refusing a host the image does not know.
    pub ssh_accept_new_host_keys: bool,
    pub github_app: Option<GithubApp>,
}

/// GitHub App credentials (`GIT_GITHUB_APP_*`) and where to exchange them.
#[derive(Clone, Default)]
pub struct GithubApp {
    pub app_id: String,
    pub installation_id: String,
    pub private_key: String,
    pub api_url: String,
}

impl std::fmt::Debug for GithubApp {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GithubApp")
            .field("app_id", &self.app_id)
            .field("installation_id", &self.installation_id)
            .field("api_url", &self.api_url)
            .finish_non_exhaustive()
    }
}

impl GitAuth {
    /// Reads PKO's `GIT_USERNAME`, `GIT_PASSWORD` (also an SSH key's passphrase), `GIT_TOKEN`,
    /// `GIT_SSH_PRIVATE_KEY`, `GIT_GITHUB_APP_ID`, `GIT_GITHUB_APP_INSTALLATION_ID`,
    /// `GIT_GITHUB_APP_PRIVATE_KEY`, and ours: `GIT_SSH_KNOWN_HOSTS`, `GIT_GITHUB_API_URL`
    /// (default GitHub's); empty values count as unset. `ssh_accept_new_host_keys` is left
    /// false (a flag of `init` sets it).
    #[allow(
        clippy::disallowed_methods,
        reason = "the pod's environment is where a workspace's git credentials are mounted"
    )]
    pub fn from_env() -> Self {
        let var = |k: &str| std::env::var(k).ok().filter(|v| !v.is_empty());
        Self {
            username: var("GIT_USERNAME"),
            password: var("GIT_PASSWORD"),
            token: var("GIT_TOKEN"),
            ssh_private_key: var("GIT_SSH_PRIVATE_KEY"),
            ssh_known_hosts: var("GIT_SSH_KNOWN_HOSTS"),
            ssh_accept_new_host_keys: false,
            github_app: var("GIT_GITHUB_APP_ID").map(|app_id| GithubApp {
                app_id,
                installation_id: var("GIT_GITHUB_APP_INSTALLATION_ID").unwrap_or_default(),
                private_key: var("GIT_GITHUB_APP_PRIVATE_KEY").unwrap_or_default(),
                api_url: var("GIT_GITHUB_API_URL")
                    .unwrap_or_else(|| pko_git::github_app::DEFAULT_API_URL.to_owned()),
            }),
        }
    }

    /// The HTTP `Authorization` header value, if these are HTTP credentials (a token wins over a
    /// username and password, as in PKO).
    fn http_header(&self) -> Option<String> {
        let basic = |user: &str, pass: &str| {
            let raw = format!("{user}:{pass}");
            format!(
                "Authorization: Basic {}",
                base64::engine::general_purpose::STANDARD.encode(raw)
            )
        };
        if let Some(token) = &self.token {
            return Some(basic(self.username.as_deref().unwrap_or("git"), token));
        }
        match (&self.username, &self.password) {
            (Some(u), Some(p)) => Some(basic(u, p)),
            _ => None,
        }
    }
}

/// What to check out.
#[derive(Debug, Clone)]
pub struct GitFetch {
    pub url: String,
    /// A commit SHA (what the Stack controller passes), a branch or a tag.
    pub revision: String,
    pub shallow: bool,
    pub auth: GitAuth,
    /// The `git` executable.
    pub program: PathBuf,
}

fn is_commit(revision: &str) -> bool {
    (revision.len() == 40 || revision.len() == 64)
        && revision.bytes().all(|b| b.is_ascii_hexdigit())
}

/// A revision git cannot take for an option or a refspec trick.
fn check_revision(revision: &str) -> Result<(), GitError> {
    let bad = revision.is_empty()
        || revision.starts_with('-')
        || revision.contains("..")
        || revision
            .chars()
            .any(|c| c.is_whitespace() || c.is_control() || ":~^?*[\\".contains(c));
    if bad {
        Err(GitError::BadRevision(revision.to_owned()))
    } else {
        Ok(())
    }
}

/// How ssh checks the git server's host key.
#[derive(Debug, Clone, PartialEq, Eq)]
enum HostKeys {
    /// Only the keys of this known_hosts file (from the Secret).
    Known(PathBuf),
    /// The key seen first is trusted (and recorded in this file, new for each fetch).
    AcceptNew(PathBuf),
    /// Only the keys the image's own known_hosts files list.
    Image,
}

/// The `ssh` command git runs: the key, and the host key rule. An unknown host is refused
/// unless accepting new keys was asked for.
fn ssh_command(key: Option<&Path>, host_keys: &HostKeys) -> String {
    // Only the key logs in: ssh never asks for a password (the askpass answers passphrases).
    let mut cmd =
        String::from("ssh -o PasswordAuthentication=no -o KbdInteractiveAuthentication=no");
    if let Some(key) = key {
        cmd.push_str(&format!(" -i '{}' -o IdentitiesOnly=yes", key.display()));
    }
    match host_keys {
        HostKeys::Known(file) => cmd.push_str(&format!(
            " -o StrictHostKeyChecking=yes -o UserKnownHostsFile='{}'",
            file.display()
        )),
        HostKeys::AcceptNew(file) => cmd.push_str(&format!(
            " -o StrictHostKeyChecking=accept-new -o UserKnownHostsFile='{}'",
            file.display()
        )),
        HostKeys::Image => cmd.push_str(" -o StrictHostKeyChecking=yes"),
    }
    cmd
}

/// Checks known_hosts text line by line: `[@marker] hosts keytype key [comment]`.
fn check_known_hosts(text: &str) -> Result<(), GitError> {
    let mut entries = 0;
    for (i, line) in text.lines().enumerate() {
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let fields: Vec<&str> = line.split_whitespace().collect();
        let fields = match fields.first() {
            Some(m) if m.starts_with('@') => &fields[1..],
            _ => &fields[..],
        };
        if fields.len() < 3 {
            return Err(GitError::BadKnownHosts {
                line: i + 1,
                detail: "expected `hosts keytype base64-key`".into(),
            });
        }
        if base64::engine::general_purpose::STANDARD
            .decode(fields[2])
            .is_err()
        {
            return Err(GitError::BadKnownHosts {
                line: i + 1,
                detail: "the key is not base64".into(),
            });
        }
        entries += 1;
    }
    if entries == 0 {
        return Err(GitError::EmptyKnownHosts);
    }
    Ok(())
}

struct Runner<'a> {
    fetch: &'a GitFetch,
    dir: &'a Path,
    ssh_key: Option<PathBuf>,
    host_keys: HostKeys,
    /// The file [`askpass`] answers ssh's passphrase prompt from, and the program ssh runs for
    /// it (this binary).
    askpass: Option<(PathBuf, PathBuf)>,
}

impl Runner<'_> {
    fn command(&self, args: &[&str]) -> Command {
        let mut cmd = Command::new(&self.fetch.program);
        cmd.arg("-C").arg(self.dir);
        // Transports that can run commands are refused whatever the URL says.
        cmd.args(["-c", "protocol.ext.allow=never"]);
        cmd.args(args);
        // The fetch container's env has PKO's GIT_DIR (the project folder), which git would
        // take for its repository path.
        for var in [
            "GIT_DIR",
            "GIT_WORK_TREE",
            "GIT_INDEX_FILE",
            "GIT_OBJECT_DIRECTORY",
            "GIT_ALTERNATE_OBJECT_DIRECTORIES",
            "GIT_CEILING_DIRECTORIES",
        ] {
            cmd.env_remove(var);
        }
        cmd.env("GIT_TERMINAL_PROMPT", "0")
            .env("GIT_CONFIG_NOSYSTEM", "1")
            .env("GIT_CONFIG_GLOBAL", "/dev/null")
            .kill_on_drop(true);
        if let Some(header) = self.fetch.auth.http_header() {
            cmd.env("GIT_CONFIG_COUNT", "1")
                .env("GIT_CONFIG_KEY_0", "http.extraHeader")
                .env("GIT_CONFIG_VALUE_0", header);
        }
        cmd.env(
            "GIT_SSH_COMMAND",
            ssh_command(self.ssh_key.as_deref(), &self.host_keys),
        );
        match &self.askpass {
            Some((file, program)) => {
                cmd.env(askpass::FILE_ENV, file)
                    .env("SSH_ASKPASS", program)
                    .env("SSH_ASKPASS_REQUIRE", "force");
            }
            None => {
                cmd.env_remove(askpass::FILE_ENV);
            }
        }
        cmd
    }

    async fn run(&self, step: &str, args: &[&str]) -> Result<String, GitError> {
        let out = tokio::time::timeout(GIT_TIMEOUT, self.command(args).output())
            .await
            .map_err(|_| GitError::Timeout { step: step.into() })?
            .map_err(|source| GitError::Spawn {
                program: self.fetch.program.display().to_string(),
                source,
            })?;
        if out.status.success() {
            Ok(String::from_utf8_lossy(&out.stdout).trim().to_owned())
        } else {
            Err(failure(
                step,
                out.status.to_string(),
                String::from_utf8_lossy(&out.stderr).trim().to_owned(),
            ))
        }
    }
}

/// A failed git command: an untrusted host key is told apart, since its fix is not in git.
fn failure(step: &str, status: String, stderr: String) -> GitError {
    if stderr.contains("Host key verification failed") {
        GitError::UntrustedHostKey {
            step: step.into(),
            stderr,
        }
    } else {
        GitError::Failed {
            step: step.into(),
            status,
            stderr,
        }
    }
}

/// Checks `fetch.revision` of `fetch.url` out into `target` (replaced as a whole) and returns the
/// commit SHA that was checked out.
pub async fn clone(fetch: &GitFetch, target: &Path) -> Result<String, GitError> {
    check_revision(&fetch.revision)?;
    require_tool(&fetch.program)?;
    if is_ssh_url(&fetch.url) {
        require_tool(Path::new("ssh"))?;
    }
    let minted;
    let fetch = match &fetch.auth.github_app {
        Some(app) => {
            let token = github_app_token(app).await?;
            minted = GitFetch {
                auth: GitAuth {
                    username: Some(pko_git::github_app::TOKEN_USER.to_owned()),
                    token: Some(token),
                    github_app: None,
                    ..fetch.auth.clone()
                },
                ..fetch.clone()
            };
            &minted
        }
        None => fetch,
    };
    let parent = target.parent().unwrap_or(Path::new("."));
    std::fs::create_dir_all(parent).map_err(io(format!("creating {}", parent.display())))?;
    let staging = tempfile::Builder::new()
        .prefix(".git-fetch-")
        .tempdir_in(parent)
        .map_err(io(format!("creating a folder in {}", parent.display())))?;
    let work = staging.path().join("source");
    std::fs::create_dir_all(&work).map_err(io("creating the checkout folder"))?;
    let ssh_key = match &fetch.auth.ssh_private_key {
        Some(key) => Some(write_key(staging.path(), "ssh-key", key)?),
        None => None,
    };
    let host_keys = match &fetch.auth.ssh_known_hosts {
        Some(text) => {
            check_known_hosts(text)?;
            HostKeys::Known(write_key(staging.path(), "known_hosts", text)?)
        }
        None if fetch.auth.ssh_accept_new_host_keys => {
            HostKeys::AcceptNew(staging.path().join("known_hosts"))
        }
        None => HostKeys::Image,
    };
    // PKO's one `password`: with an SSH key, the key's passphrase.
    let askpass = match (&ssh_key, &fetch.auth.password) {
        (Some(_), Some(passphrase)) => {
            let program = std::env::current_exe().map_err(io("finding the agent binary"))?;
            Some((
                write_key(staging.path(), "passphrase", passphrase)?,
                program,
            ))
        }
        _ => None,
    };
    let git = Runner {
        fetch,
        dir: &work,
        ssh_key,
        host_keys,
        askpass,
    };
    git.run("init", &["init", "-q"]).await?;
    git.run("remote add", &["remote", "add", "origin", &fetch.url])
        .await?;
    let rev = fetch.revision.as_str();
    let fetched = if fetch.shallow {
        // Servers that allow fetching a commit by id (GitHub, GitLab, smart HTTP with
        // uploadpack.allowReachableSHA1InWant) give one commit; others need the full history.
        git.run("fetch", &["fetch", "-q", "--depth=1", "origin", rev])
            .await
            .is_ok()
    } else {
        false
    };
    if !fetched {
        if is_commit(rev) {
            git.run(
                "fetch",
                &[
                    "fetch",
                    "-q",
                    "--tags",
                    "origin",
                    "+refs/heads/*:refs/remotes/origin/*",
                ],
            )
            .await?;
        } else {
            git.run("fetch", &["fetch", "-q", "origin", rev]).await?;
        }
    }
    let checkout = if is_commit(rev) && !fetched {
        rev
    } else {
        "FETCH_HEAD"
    };
    git.run(
        "checkout",
        &[
            "-c",
            "advice.detachedHead=false",
            "checkout",
            "-q",
            "--detach",
            checkout,
        ],
    )
    .await?;
    let commit = git.run("rev-parse", &["rev-parse", "HEAD"]).await?;
    if is_commit(rev) && !commit.eq_ignore_ascii_case(rev) {
        return Err(GitError::Failed {
            step: "checkout".into(),
            status: "wrong commit".into(),
            stderr: format!("asked for {rev}, got {commit}"),
        });
    }
    if target.symlink_metadata().is_ok() {
        std::fs::remove_dir_all(target).map_err(io(format!("replacing {}", target.display())))?;
    }
    std::fs::rename(&work, target)
        .map_err(io(format!("moving the checkout to {}", target.display())))?;
    info!(url = %fetch.url, revision = %rev, %commit, "git source checked out");
    Ok(commit)
}

/// `true` for the URLs git reaches over ssh: `ssh://`, `git+ssh://`, `ssh+git://`, or scp-like
/// `[user@]host:path` (a colon before any slash).
fn is_ssh_url(url: &str) -> bool {
    if let Some((scheme, _)) = url.split_once("://") {
        return matches!(scheme, "ssh" | "git+ssh" | "ssh+git");
    }
    url.split_once(':')
        .is_some_and(|(host, _)| !host.is_empty() && !host.contains('/'))
}

/// Fails with a clear message when `program` (a bare name) is on no folder of `PATH`; a path is
/// left to the spawn to judge.
fn require_tool(program: &Path) -> Result<(), GitError> {
    if program.components().count() > 1 {
        return Ok(());
    }
    #[allow(
        clippy::disallowed_methods,
        reason = "the PATH git and ssh are looked up in is the init container's own"
    )]
    let path = std::env::var_os("PATH").unwrap_or_default();
    if on_path(program, &path) {
        Ok(())
    } else {
        Err(GitError::MissingTool {
            program: program.display().to_string(),
        })
    }
}

fn on_path(program: &Path, path: &std::ffi::OsStr) -> bool {
    use std::os::unix::fs::PermissionsExt;
    std::env::split_paths(path).any(|dir| {
        std::fs::metadata(dir.join(program))
            .is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
    })
}

/// An installation token for `app`, from its API (the system's CA certificates, and those of
/// `SSL_CERT_FILE`/`SSL_CERT_DIR`).
async fn github_app_token(app: &GithubApp) -> Result<String, GitError> {
    use pko_git::github_app::{AppCredentials, exchange};
    for (what, value) in [
        ("the installation id", &app.installation_id),
        ("the private key", &app.private_key),
    ] {
        if value.is_empty() {
            return Err(GitError::GithubAppIncomplete(what));
        }
    }
    let creds = AppCredentials::new(&app.app_id, &app.installation_id, &app.private_key)?;
    let url = creds.token_url(&app.api_url)?;
    let now = jiff::Timestamp::now();
    let jwt = creds.jwt(now)?;
    let client = https_client()?;
    let token = exchange(&client, url, &jwt, now).await?;
    info!(app = creds.app_id(), expires_at = %token.expires_at, "GitHub App installation token minted");
    Ok(token.secret().to_owned())
}

fn https_client() -> Result<reqwest::Client, GitError> {
    let mut builder = reqwest::Client::builder()
        .connect_timeout(Duration::from_secs(10))
        .timeout(Duration::from_secs(60))
        .redirect(reqwest::redirect::Policy::limited(5));
    let found = rustls_native_certs::load_native_certs();
    for cert in found.certs {
        if let Ok(cert) = reqwest::Certificate::from_der(cert.as_ref()) {
            builder = builder.add_root_certificate(cert);
        }
    }
    builder
        .build()
        .map_err(|e| GitError::HttpClient(e.to_string()))
}

/// Writes an SSH file (a key, known_hosts) where only we can read it (ssh refuses
/// group/world-readable keys).
fn write_key(dir: &Path, name: &str, key: &str) -> Result<PathBuf, GitError> {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    let path = dir.join(name);
    let mut file = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(&path)
        .map_err(io(format!("writing {name}")))?;
    let mut text = key.to_owned();
    if !text.ends_with('\n') {
        text.push('\n');
    }
    file.write_all(text.as_bytes())
        .map_err(io(format!("writing {name}")))?;
    Ok(path)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn revisions_that_could_be_options_are_refused() {
        for bad in [
            "",
            "-u",
            "--upload-pack=x",
            "a..b",
            "main:other",
            "a b",
            "x^",
        ] {
            assert!(check_revision(bad).is_err(), "{bad}");
        }
        for good in ["main", "release/1.2", "v1.0.0", &"a".repeat(40)] {
            assert!(check_revision(good).is_ok(), "{good}");
        }
    }

    #[test]
    fn unknown_hosts_are_refused_unless_keys_are_given_or_new_ones_accepted() {
        let key = Path::new("/s/ssh-key");
        let ssh = "ssh -o PasswordAuthentication=no -o KbdInteractiveAuthentication=no";
        assert_eq!(
            ssh_command(Some(key), &HostKeys::Known("/s/known_hosts".into())),
            format!(
                "{ssh} -i '/s/ssh-key' -o IdentitiesOnly=yes -o StrictHostKeyChecking=yes -o UserKnownHostsFile='/s/known_hosts'"
            )
        );
        assert_eq!(
            ssh_command(None, &HostKeys::AcceptNew("/s/known_hosts".into())),
            format!(
                "{ssh} -o StrictHostKeyChecking=accept-new -o UserKnownHostsFile='/s/known_hosts'"
            )
        );
        assert_eq!(
            ssh_command(Some(key), &HostKeys::Image),
            format!("{ssh} -i '/s/ssh-key' -o IdentitiesOnly=yes -o StrictHostKeyChecking=yes")
        );
    }

    #[test]
    fn known_hosts_lines_are_checked() {
        let good = "# comment\ngithub.com ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIOMqqnkVzrm0SdG6UOoqKLsabgH5C9okWi0dh2l9GKJl\n@cert-authority *.example.com ssh-rsa AAAA\n";
        assert!(check_known_hosts(good).is_ok());
        for (bad, line) in [
            ("github.com ssh-ed25519\n", 1),
            ("a ssh-rsa AAAA\nb ssh-rsa not*base64\n", 2),
        ] {
            match check_known_hosts(bad) {
                Err(GitError::BadKnownHosts { line: l, .. }) => assert_eq!(l, line, "{bad:?}"),
                other => panic!("{bad:?}: {other:?}"),
            }
        }
        for empty in ["# only a comment\n", ""] {
            assert!(matches!(
                check_known_hosts(empty),
                Err(GitError::EmptyKnownHosts)
            ));
        }
    }

    #[test]
    fn a_host_key_refusal_says_how_to_fix_it() {
        let e = failure(
            "fetch",
            "exit status: 128".into(),
            "Host key verification failed.\nfatal: Could not read from remote repository.".into(),
        );
        assert!(matches!(e, GitError::UntrustedHostKey { .. }), "{e:?}");
        let text = e.to_string();
        assert!(
            text.contains("knownHosts") && text.contains("--git-ssh-accept-new-host-keys"),
            "{text}"
        );
        assert!(matches!(
            failure("fetch", "1".into(), "fatal: not found".into()),
            GitError::Failed { .. }
        ));
    }

    #[test]
    fn ssh_urls_are_told_from_others() {
        for ssh in [
            "git@github.com:o/r.git",
            "ssh://h/r",
            "git+ssh://h/r",
            "h:r",
        ] {
            assert!(is_ssh_url(ssh), "{ssh}");
        }
        for other in ["https://h/r", "/srv/r", "./a:b", "file:///r", "git://h/r"] {
            assert!(!is_ssh_url(other), "{other}");
        }
    }

    #[test]
    fn a_missing_git_or_ssh_is_named() {
        let dir = tempfile::tempdir().expect("tmp");
        let path = dir.path().as_os_str();
        assert!(!on_path(Path::new("git"), path));
        std::fs::write(dir.path().join("git"), "").expect("write");
        assert!(!on_path(Path::new("git"), path), "not executable");
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(
            dir.path().join("git"),
            std::fs::Permissions::from_mode(0o755),
        )
        .expect("chmod");
        assert!(on_path(Path::new("git"), path));
        let text = GitError::MissingTool {
            program: "ssh".into(),
        }
        .to_string();
        assert!(
            text.contains("no `ssh` on its PATH") && text.contains("over ssh"),
            "{text}"
        );
    }

    #[test]
    fn a_token_wins_over_basic_credentials() {
        let auth = GitAuth {
            username: Some("u".into()),
            password: Some("p".into()),
            token: Some("t".into()),
            ..Default::default()
        };
        let header = auth.http_header().expect("header");
        let encoded = header.trim_start_matches("Authorization: Basic ");
        let decoded = base64::engine::general_purpose::STANDARD
            .decode(encoded)
            .expect("base64");
        assert_eq!(decoded, b"u:t");
        assert_eq!(GitAuth::default().http_header(), None);
    }
}
