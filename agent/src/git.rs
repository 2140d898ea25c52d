//! `init` from a git repository: the `git` CLI of the workspace image checks out one revision.
//!
//! The CLI (present in every Pulumi image) speaks every transport and credential helper git
//! does, so the agent carries no git implementation. Credentials come from the pod's env (the
//! Workspace's `git.auth` Secret keys) and never appear on a command line: HTTP credentials go in
//! an `Authorization` header set through `GIT_CONFIG_*` env, an SSH key in a 0600 file. Nothing
//! is left in the target folder when a step fails.

use std::path::{Path, PathBuf};
use std::time::Duration;

use base64::Engine;
use tokio::process::Command;
use tracing::info;

/// How long one git command may take (a clone of a large repository over a slow link).
const GIT_TIMEOUT: Duration = Duration::from_secs(600);

#[derive(Debug, thiserror::Error)]
pub enum GitError {
    #[error("invalid git revision {0:?}")]
    BadRevision(String),
    #[error("git authentication with a GitHub App is not supported by this agent; use a token")]
    GithubAppUnsupported,
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
    pub github_app: bool,
}

impl GitAuth {
    /// Reads `GIT_USERNAME`, `GIT_PASSWORD`, `GIT_TOKEN`, `GIT_SSH_PRIVATE_KEY` and the GitHub
    /// App variables; empty values count as unset.
    pub fn from_env() -> Self {
        let var = |k: &str| std::env::var(k).ok().filter(|v| !v.is_empty());
        Self {
            username: var("GIT_USERNAME"),
            password: var("GIT_PASSWORD"),
            token: var("GIT_TOKEN"),
            ssh_private_key: var("GIT_SSH_PRIVATE_KEY"),
            github_app: var("GIT_GITHUB_APP_ID").is_some(),
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

struct Runner<'a> {
    fetch: &'a GitFetch,
    dir: &'a Path,
    ssh_key: Option<PathBuf>,
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
        if let Some(key) = &self.ssh_key {
            cmd.env(
                "GIT_SSH_COMMAND",
                format!(
                    "ssh -i '{}' -o IdentitiesOnly=yes -o StrictHostKeyChecking=accept-new",
                    key.display()
                ),
            );
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
            Err(GitError::Failed {
                step: step.into(),
                status: out.status.to_string(),
                stderr: String::from_utf8_lossy(&out.stderr).trim().to_owned(),
            })
        }
    }
}

/// Checks `fetch.revision` of `fetch.url` out into `target` (replaced as a whole) and returns the
/// commit SHA that was checked out.
pub async fn clone(fetch: &GitFetch, target: &Path) -> Result<String, GitError> {
    check_revision(&fetch.revision)?;
    if fetch.auth.github_app {
        return Err(GitError::GithubAppUnsupported);
    }
    let parent = target.parent().unwrap_or(Path::new("."));
    std::fs::create_dir_all(parent).map_err(io(format!("creating {}", parent.display())))?;
    let staging = tempfile::Builder::new()
        .prefix(".git-fetch-")
        .tempdir_in(parent)
        .map_err(io(format!("creating a folder in {}", parent.display())))?;
    let work = staging.path().join("source");
    std::fs::create_dir_all(&work).map_err(io("creating the checkout folder"))?;
    let ssh_key = match &fetch.auth.ssh_private_key {
        Some(key) => Some(write_key(staging.path(), key)?),
        None => None,
    };
    let git = Runner {
        fetch,
        dir: &work,
        ssh_key,
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

/// Writes an SSH key where only we can read it (ssh refuses group/world-readable keys).
fn write_key(dir: &Path, key: &str) -> Result<PathBuf, GitError> {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    let path = dir.join("ssh-key");
    let mut file = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(&path)
        .map_err(io("writing the SSH key"))?;
    let mut text = key.to_owned();
    if !text.ends_with('\n') {
        text.push('\n');
    }
    file.write_all(text.as_bytes())
        .map_err(io("writing the SSH key"))?;
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
