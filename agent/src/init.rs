//! `init`: puts the program into the workspace before the agent serves.
//!
//! A Flux-style artifact (our file server's, or source-controller's) is downloaded, checked
//! against its `sha256:<hex>` digest, and unpacked with limits: total size, entry count, no
//! absolute paths or `..`, no special files, links that stay inside the target folder. Nothing
//! is left in the target folder when any check fails.

use std::io::Read;
use std::path::{Component, Path, PathBuf};
use std::time::Duration;

use futures::StreamExt;
use sha2::{Digest, Sha256};
use tracing::{info, warn};

/// PKO's (Flux's) default limit of an unpacked artifact.
pub const DEFAULT_MAX_BYTES: u64 = 100 * 1024 * 1024;
/// Entries an artifact may hold.
const MAX_ENTRIES: usize = 100_000;
/// Symlinks followed in all when checking where one link points: Linux's MAXSYMLINKS, past
/// which the kernel itself refuses the path (ELOOP). A count, not a depth: links whose targets
/// name other links several times would otherwise cost exponential time.
const MAX_LINK_FOLLOWS: usize = 40;
/// Bytes of tar stream allowed per entry besides its data: its header and padding, and any
/// PAX or GNU long-name records before it (names are at most 4 KiB on Linux). The tar reader
/// holds such records in memory, so a compressed bomb in one must stop here.
pub const ENTRY_OVERHEAD_BYTES: u64 = 64 * 1024;
const ATTEMPTS: u32 = 3;

/// Failures of `init`.
#[derive(Debug, thiserror::Error)]
pub enum InitError {
    #[error("invalid digest {0:?}: expected sha256:<64 hex digits>")]
    BadDigest(String),
    #[error("invalid URL {url:?}: {detail}")]
    BadUrl { url: String, detail: String },
    #[error("cannot download {url}: {detail}")]
    Download { url: String, detail: String },
    #[error("artifact digest mismatch for {url}: expected {expected}, got {actual}")]
    DigestMismatch {
        url: String,
        expected: String,
        actual: String,
    },
    #[error("artifact is larger than the limit of {limit} bytes")]
    TooLarge { limit: u64 },
    #[error("artifact has more than {0} entries")]
    TooManyEntries(usize),
    #[error(
        "artifact holds more than its entries account for: over {ENTRY_OVERHEAD_BYTES} bytes of headers or metadata records for one entry, or data in an entry that has none"
    )]
    UnaccountedBytes,
    #[error("unsafe path in artifact: {path:?} ({reason})")]
    UnsafePath { path: String, reason: String },
    #[error("unsupported entry {path:?} in artifact ({kind})")]
    UnsupportedEntry { path: String, kind: String },
    #[error("invalid artifact (not a gzipped tar): {0}")]
    Archive(String),
    #[error("{what}: {source}")]
    Io {
        what: String,
        #[source]
        source: std::io::Error,
    },
    #[error("invalid --dir {0:?}: must be a relative path inside the source")]
    BadDir(String),
}

fn io(what: impl Into<String>) -> impl FnOnce(std::io::Error) -> InitError {
    let what = what.into();
    move |source| InitError::Io { what, source }
}

/// Where and how to fetch a Flux-style artifact.
#[derive(Debug, Clone)]
pub struct FluxFetch {
    pub url: String,
    pub digest: String,
    /// `None`: no limit.
    pub max_bytes: Option<u64>,
    /// Development: replaces the URL's `host[:port]` (PKO's `SOURCE_CONTROLLER_LOCALHOST`).
    pub host_override: Option<String>,
}

/// Downloads, verifies and unpacks an artifact into `target` (replaced as a whole).
pub async fn fetch_flux(fetch: &FluxFetch, target: &Path) -> Result<(), InitError> {
    let expected = parse_digest(&fetch.digest)?;
    let url = rewrite_host(&fetch.url, fetch.host_override.as_deref())?;
    let bytes = download_with_retries(&url, fetch.max_bytes).await?;
    let actual = hex::encode(Sha256::digest(&bytes));
    if actual != expected {
        return Err(InitError::DigestMismatch {
            url,
            expected: format!("sha256:{expected}"),
            actual: format!("sha256:{actual}"),
        });
    }
    info!(%url, bytes = bytes.len(), "artifact verified");
    let staged = target.to_path_buf();
    let limit = fetch.max_bytes;
    tokio::task::spawn_blocking(move || unpack_into(&bytes, &staged, limit))
        .await
        .map_err(|e| InitError::Archive(format!("unpack task failed: {e}")))??;
    // Beside the source, not in it: the next revision replaces the folder as a whole.
    let marker = digest_marker(target);
    std::fs::write(&marker, format!("sha256:{expected}"))
        .map_err(io(format!("writing {}", marker.display())))
}

/// The file beside a fetched source that names its digest, so an agent restarted in the same
/// pod knows which revision it serves (the init container does not run again).
pub fn digest_marker(target: &Path) -> PathBuf {
    let name = target
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_else(|| "source".into());
    target.with_file_name(format!(".{name}.digest"))
}

/// The digest of the source fetched into `target`, if it was fetched by this agent.
pub fn current_digest(target: &Path) -> Option<String> {
    let text = std::fs::read_to_string(digest_marker(target)).ok()?;
    parse_digest(text.trim())
        .ok()
        .map(|hex| format!("sha256:{hex}"))
}

/// Whether `digest` is the one `current` names (either may be upper or lower case).
pub fn same_digest(current: Option<&str>, digest: &str) -> bool {
    match (current.map(parse_digest), parse_digest(digest)) {
        (Some(Ok(a)), Ok(b)) => a == b,
        _ => false,
    }
}

/// The project folder `dir` of a source unpacked into `root` (`root` itself when empty).
pub fn project_dir(root: &Path, dir: Option<&str>) -> Result<PathBuf, InitError> {
    let mut target = root.to_path_buf();
    if let Some(dir) = dir.filter(|d| !d.is_empty()) {
        let rel = safe_relative(Path::new(dir)).map_err(|_| InitError::BadDir(dir.to_owned()))?;
        target.push(rel);
    }
    Ok(target)
}

fn parse_digest(digest: &str) -> Result<String, InitError> {
    let hex = digest
        .strip_prefix("sha256:")
        .ok_or_else(|| InitError::BadDigest(digest.to_owned()))?;
    if hex.len() != 64 || !hex.bytes().all(|b| b.is_ascii_hexdigit()) {
        return Err(InitError::BadDigest(digest.to_owned()));
    }
    Ok(hex.to_ascii_lowercase())
}

fn rewrite_host(url: &str, host: Option<&str>) -> Result<String, InitError> {
    let mut parsed = reqwest::Url::parse(url).map_err(|e| InitError::BadUrl {
        url: url.to_owned(),
        detail: e.to_string(),
    })?;
    if let Some(host) = host.filter(|h| !h.is_empty()) {
        let (name, port) = match host.rsplit_once(':') {
            Some((n, p)) => (n, p.parse::<u16>().ok()),
            None => (host, None),
        };
        let bad = |detail: String| InitError::BadUrl {
            url: url.to_owned(),
            detail,
        };
        parsed
            .set_host(Some(name))
            .map_err(|e| bad(format!("host override {host:?}: {e}")))?;
        parsed
            .set_port(port)
            .map_err(|()| bad(format!("host override {host:?}: cannot set the port")))?;
    }
    Ok(parsed.to_string())
}

async fn download_with_retries(url: &str, limit: Option<u64>) -> Result<Vec<u8>, InitError> {
    let client = reqwest::Client::builder()
        .connect_timeout(Duration::from_secs(10))
        .timeout(Duration::from_secs(300))
        .build()
        .map_err(|e| InitError::Download {
            url: url.to_owned(),
            detail: e.to_string(),
        })?;
    let mut attempt = 1;
    loop {
        match download(&client, url, limit).await {
            Ok(bytes) => return Ok(bytes),
            // Size and 4xx answers do not improve with another try.
            Err(e @ InitError::TooLarge { .. }) => return Err(e),
            Err(e) if attempt >= ATTEMPTS || is_client_error(&e) => return Err(e),
            Err(e) => {
                warn!(attempt, error = %e, "download failed; retrying");
                tokio::time::sleep(Duration::from_millis(500 * u64::from(attempt))).await;
                attempt += 1;
            }
        }
    }
}

fn is_client_error(e: &InitError) -> bool {
    matches!(e, InitError::Download { detail, .. } if detail.starts_with("HTTP 4"))
}

async fn download(
    client: &reqwest::Client,
    url: &str,
    limit: Option<u64>,
) -> Result<Vec<u8>, InitError> {
    let err = |detail: String| InitError::Download {
        url: url.to_owned(),
        detail,
    };
    let resp = client
        .get(url)
        .send()
        .await
        // reqwest's own text hides the cause ("connection refused", DNS): add the chain.
        .map_err(|e| err(crate::client::error_chain(&e)))?;
    let status = resp.status();
    if !status.is_success() {
        let body = resp.text().await.unwrap_or_default();
        let body: String = body.chars().take(300).collect();
        return Err(err(format!("HTTP {}: {}", status.as_u16(), body.trim())));
    }
    if let (Some(limit), Some(len)) = (limit, resp.content_length())
        && len > limit
    {
        return Err(InitError::TooLarge { limit });
    }
    let mut bytes = Vec::new();
    let mut body = resp.bytes_stream();
    while let Some(chunk) = body.next().await {
        let chunk = chunk.map_err(|e| err(crate::client::error_chain(&e)))?;
        bytes.extend_from_slice(&chunk);
        if limit.is_some_and(|l| bytes.len() as u64 > l) {
            return Err(InitError::TooLarge {
                limit: limit.unwrap_or_default(),
            });
        }
    }
    Ok(bytes)
}

/// Unpacks a tar.gz into `target`, which is replaced only when the whole archive is safe.
pub fn unpack_into(targz: &[u8], target: &Path, limit: Option<u64>) -> Result<(), InitError> {
    let parent = target
        .parent()
        .filter(|p| !p.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    std::fs::create_dir_all(parent).map_err(io(format!("creating {}", parent.display())))?;
    let staging = parent.join(format!(
        ".{}.unpack-{:08x}",
        target
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_else(|| "source".into()),
        rand::random::<u32>()
    ));
    std::fs::create_dir(&staging).map_err(io(format!("creating {}", staging.display())))?;
    let result = unpack(targz, &staging, limit).and_then(|()| {
        if target.exists() {
            std::fs::remove_dir_all(target)
                .map_err(io(format!("removing {}", target.display())))?;
        }
        std::fs::rename(&staging, target).map_err(io(format!("moving into {}", target.display())))
    });
    if result.is_err() {
        let _ = std::fs::remove_dir_all(&staging);
    }
    result
}

/// A relative, `..`-free path, or why not.
fn safe_relative(path: &Path) -> Result<PathBuf, String> {
    let mut out = PathBuf::new();
    for c in path.components() {
        match c {
            Component::Normal(part) => out.push(part),
            Component::CurDir => {}
            Component::ParentDir => return Err("contains ..".into()),
            Component::RootDir | Component::Prefix(_) => return Err("absolute path".into()),
        }
    }
    Ok(out)
}

/// The decompressed tar stream, readable only as far as the entries seen so far account for:
/// each entry's data plus [`ENTRY_OVERHEAD_BYTES`]. Bounds the memory the tar reader spends on
/// metadata records and the time it spends skipping data of entries that have none.
struct Budgeted<R> {
    inner: R,
    budget: std::rc::Rc<std::cell::Cell<Budget>>,
}

#[derive(Clone, Copy, Default)]
struct Budget {
    left: u64,
    exceeded: bool,
}

impl<R: Read> Read for Budgeted<R> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        let mut budget = self.budget.get();
        if budget.left == 0 && !buf.is_empty() {
            budget.exceeded = true;
            self.budget.set(budget);
            return Err(std::io::Error::other("artifact exceeds its byte budget"));
        }
        let want = buf
            .len()
            .min(usize::try_from(budget.left).unwrap_or(usize::MAX));
        let read = self.inner.read(&mut buf[..want])?;
        budget.left -= read as u64;
        self.budget.set(budget);
        Ok(read)
    }
}

fn unpack(targz: &[u8], root: &Path, limit: Option<u64>) -> Result<(), InitError> {
    let budget = std::rc::Rc::new(std::cell::Cell::new(Budget {
        left: ENTRY_OVERHEAD_BYTES,
        exceeded: false,
    }));
    let stream = Budgeted {
        inner: flate2::read::GzDecoder::new(targz),
        budget: budget.clone(),
    };
    let over_budget = |e: std::io::Error| {
        if budget.get().exceeded {
            InitError::UnaccountedBytes
        } else {
            InitError::Archive(e.to_string())
        }
    };
    let mut archive = tar::Archive::new(stream);
    let entries = archive.entries().map_err(over_budget)?;
    let mut total: u64 = 0;
    let mut links: Vec<(PathBuf, PathBuf)> = Vec::new();
    for (index, entry) in entries.enumerate() {
        if index >= MAX_ENTRIES {
            return Err(InitError::TooManyEntries(MAX_ENTRIES));
        }
        let mut entry = entry.map_err(over_budget)?;
        // This entry may read its own data (regular files only; the size limit is checked
        // below before any is read), then the next entry its header and records.
        let data = match entry.header().entry_type() {
            tar::EntryType::Regular | tar::EntryType::Continuous => entry.size(),
            _ => 0,
        };
        budget.set(Budget {
            left: data
                .div_ceil(512)
                .saturating_mul(512)
                .saturating_add(ENTRY_OVERHEAD_BYTES),
            exceeded: false,
        });
        let raw = entry
            .path()
            .map_err(|e| InitError::Archive(e.to_string()))?
            .into_owned();
        let shown = raw.display().to_string();
        let rel = safe_relative(&raw).map_err(|reason| InitError::UnsafePath {
            path: shown.clone(),
            reason,
        })?;
        if rel.as_os_str().is_empty() {
            continue;
        }
        let dest = root.join(&rel);
        let kind = entry.header().entry_type();
        match kind {
            tar::EntryType::Directory => {
                ensure_real_dirs(root, &rel, true)?;
            }
            tar::EntryType::Regular | tar::EntryType::Continuous => {
                // The size the reader goes by (a PAX record may override the header's).
                total = total.saturating_add(data);
                if limit.is_some_and(|l| total > l) {
                    return Err(InitError::TooLarge {
                        limit: limit.unwrap_or_default(),
                    });
                }
                new_file_place(root, &rel, &shown)?;
                let mode = entry.header().mode().unwrap_or(0o644);
                let mut bytes = Vec::new();
                // The size is checked above; read no more than it says.
                (&mut entry)
                    .take(data)
                    .read_to_end(&mut bytes)
                    .map_err(over_budget)?;
                write_file(&dest, &bytes, mode)?;
            }
            tar::EntryType::Symlink => {
                let target = link_target(entry.link_name(), &shown, "symlink")?;
                if target.is_absolute() {
                    return Err(InitError::UnsafePath {
                        path: shown,
                        reason: format!("symlink to absolute path {}", target.display()),
                    });
                }
                // Created after every file, so nothing is ever written through a link.
                links.push((rel, target));
            }
            tar::EntryType::Link => {
                let target = link_target(entry.link_name(), &shown, "hard link")?;
                hard_link(root, &rel, &target, &shown)?;
            }
            tar::EntryType::XGlobalHeader
            | tar::EntryType::XHeader
            | tar::EntryType::GNULongName
            | tar::EntryType::GNULongLink => {}
            other => {
                return Err(InitError::UnsupportedEntry {
                    path: shown,
                    kind: format!("{other:?}"),
                });
            }
        }
    }
    make_symlinks(root, &links)
}

/// Makes the folders for a file at `rel`, refusing a second entry for the same path.
fn new_file_place(root: &Path, rel: &Path, shown: &str) -> Result<(), InitError> {
    ensure_real_dirs(root, rel, false)?;
    if root.join(rel).symlink_metadata().is_ok() {
        return Err(InitError::UnsafePath {
            path: shown.to_owned(),
            reason: "duplicate entry".into(),
        });
    }
    Ok(())
}

/// Writes one regular file, keeping only its execute bits.
fn write_file(dest: &Path, bytes: &[u8], mode: u32) -> Result<(), InitError> {
    use std::os::unix::fs::PermissionsExt;
    std::fs::write(dest, bytes).map_err(io(format!("writing {}", dest.display())))?;
    // Keep the execute bits; drop setuid/setgid/sticky and write for others.
    let perms = std::fs::Permissions::from_mode(if mode & 0o111 != 0 { 0o755 } else { 0o644 });
    std::fs::set_permissions(dest, perms)
        .map_err(io(format!("setting permissions of {}", dest.display())))
}

/// The target a link entry names; `what` says which kind of link for the error.
fn link_target(
    name: std::io::Result<Option<std::borrow::Cow<'_, Path>>>,
    shown: &str,
    what: &str,
) -> Result<PathBuf, InitError> {
    Ok(name
        .map_err(|e| InitError::Archive(e.to_string()))?
        .ok_or_else(|| InitError::UnsafePath {
            path: shown.to_owned(),
            reason: format!("{what} without a target"),
        })?
        .into_owned())
}

/// A hard link at `rel` to a regular file already extracted inside `root`.
fn hard_link(root: &Path, rel: &Path, target: &Path, shown: &str) -> Result<(), InitError> {
    let target_rel = safe_relative(target).map_err(|reason| InitError::UnsafePath {
        path: shown.to_owned(),
        reason: format!("hard link target {}: {reason}", target.display()),
    })?;
    let source = root.join(&target_rel);
    let is_file = source
        .symlink_metadata()
        .map(|m| m.file_type().is_file())
        .unwrap_or(false);
    if !is_file {
        return Err(InitError::UnsafePath {
            path: shown.to_owned(),
            reason: format!(
                "hard link to {} which is not an extracted file",
                target.display()
            ),
        });
    }
    ensure_real_dirs(root, rel, false)?;
    let dest = root.join(rel);
    std::fs::hard_link(&source, &dest).map_err(io(format!("linking {}", dest.display())))
}

/// Creates the symlinks once every file is written, then checks each resolves inside `root`.
fn make_symlinks(root: &Path, links: &[(PathBuf, PathBuf)]) -> Result<(), InitError> {
    for (rel, target) in links {
        ensure_real_dirs(root, rel, false)?;
        let dest = root.join(rel);
        if dest.symlink_metadata().is_ok() {
            return Err(InitError::UnsafePath {
                path: rel.display().to_string(),
                reason: "duplicate entry".into(),
            });
        }
        std::os::unix::fs::symlink(target, &dest)
            .map_err(io(format!("linking {}", dest.display())))?;
    }
    // Checked once the tree is final: a link may point through links made after it.
    for (rel, target) in links {
        resolve_inside(root, rel).map_err(|reason| InitError::UnsafePath {
            path: rel.display().to_string(),
            reason: format!("symlink to {} {reason}", target.display()),
        })?;
    }
    Ok(())
}

/// Creates the parent folders of `rel` (and `rel` itself when `include_self`), refusing to go
/// through anything that is not a real directory.
fn ensure_real_dirs(root: &Path, rel: &Path, include_self: bool) -> Result<(), InitError> {
    let parts: Vec<_> = rel.components().collect();
    let upto = if include_self {
        parts.len()
    } else {
        parts.len().saturating_sub(1)
    };
    let mut current = root.to_path_buf();
    for part in &parts[..upto] {
        current.push(part);
        match current.symlink_metadata() {
            Ok(m) if m.file_type().is_dir() => {}
            Ok(_) => {
                return Err(InitError::UnsafePath {
                    path: rel.display().to_string(),
                    reason: format!("{} is not a directory", current.display()),
                });
            }
            Err(_) => std::fs::create_dir(&current)
                .map_err(io(format!("creating {}", current.display())))?,
        }
    }
    Ok(())
}

/// Follows the symlink at `rel` (and any links on the way) on disk, component by component;
/// errs when the walk leaves `root`.
fn resolve_inside(root: &Path, rel: &Path) -> Result<(), String> {
    // The path walked so far, as components below root.
    fn walk(
        root: &Path,
        stack: &mut Vec<std::ffi::OsString>,
        path: &Path,
        follows: &mut usize,
    ) -> Result<(), String> {
        for c in path.components() {
            match c {
                Component::CurDir => {}
                Component::ParentDir => {
                    if stack.pop().is_none() {
                        return Err("points outside the source".into());
                    }
                }
                Component::RootDir | Component::Prefix(_) => {
                    return Err("points to an absolute path".into());
                }
                Component::Normal(part) => {
                    stack.push(part.to_owned());
                    let here: PathBuf = stack.iter().fold(root.to_path_buf(), |p, s| p.join(s));
                    if let Ok(meta) = here.symlink_metadata()
                        && meta.file_type().is_symlink()
                    {
                        *follows += 1;
                        if *follows > MAX_LINK_FOLLOWS {
                            return Err("goes through too many links".into());
                        }
                        let target = std::fs::read_link(&here).map_err(|e| e.to_string())?;
                        stack.pop();
                        walk(root, stack, &target, follows)?;
                    }
                }
            }
        }
        Ok(())
    }
    let mut stack = Vec::new();
    walk(root, &mut stack, rel, &mut 0)
}

/// Points `link` at `source/dir` (PKO does this with `ln -s` in a shell; no shell is needed).
pub fn link_workspace(source: &Path, dir: Option<&str>, link: &Path) -> Result<PathBuf, InitError> {
    let target = project_dir(source, dir)?;
    if link.symlink_metadata().is_ok() {
        std::fs::remove_file(link).map_err(io(format!("replacing {}", link.display())))?;
    }
    std::os::unix::fs::symlink(&target, link).map_err(io(format!("linking {}", link.display())))?;
    Ok(target)
}

/// Writes a minimal `Pulumi.yaml` (PKO's project-info source: destroy without the program).
pub fn write_project(target: &Path, name: &str, runtime: &str) -> Result<(), InitError> {
    std::fs::create_dir_all(target).map_err(io(format!("creating {}", target.display())))?;
    let doc = serde_json::json!({"name": name, "runtime": runtime});
    let text = yaml_serde::to_string(&doc).map_err(|e| InitError::Io {
        what: "encoding Pulumi.yaml".into(),
        source: std::io::Error::other(e.to_string()),
    })?;
    let path = target.join("Pulumi.yaml");
    std::fs::write(&path, text).map_err(io(format!("writing {}", path.display())))
}

#[cfg(test)]
mod tests {
    use super::*;

    enum E<'a> {
        File(&'a str, &'a [u8]),
        Dir(&'a str),
        Symlink(&'a str, &'a str),
        RawPath(&'a str, &'a [u8]),
    }

    fn targz(entries: &[E]) -> Vec<u8> {
        let gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
        let mut b = tar::Builder::new(gz);
        for e in entries {
            let mut h = tar::Header::new_gnu();
            match e {
                E::File(p, data) => {
                    h.set_entry_type(tar::EntryType::Regular);
                    h.set_size(data.len() as u64);
                    h.set_mode(0o644);
                    b.append_data(&mut h, p, *data).expect("file");
                }
                E::Dir(p) => {
                    h.set_entry_type(tar::EntryType::Directory);
                    h.set_size(0);
                    h.set_mode(0o755);
                    b.append_data(&mut h, p, std::io::empty()).expect("dir");
                }
                E::Symlink(p, t) => {
                    h.set_entry_type(tar::EntryType::Symlink);
                    h.set_size(0);
                    b.append_link(&mut h, p, t).expect("link");
                }
                E::RawPath(p, data) => {
                    // tar::Builder refuses `..`; write the name bytes directly.
                    h.set_entry_type(tar::EntryType::Regular);
                    h.set_size(data.len() as u64);
                    let name = &mut h.as_old_mut().name;
                    name[..p.len()].copy_from_slice(p.as_bytes());
                    h.set_cksum();
                    b.append(&h, *data).expect("raw");
                }
            }
        }
        b.into_inner().expect("tar").finish().expect("gz")
    }

    fn unpack_err(entries: &[E]) -> String {
        let dir = tempfile::tempdir().expect("tmp");
        let target = dir.path().join("source");
        let err = unpack_into(&targz(entries), &target, Some(1 << 20)).expect_err("must fail");
        assert!(!target.exists(), "nothing is left behind on failure");
        err.to_string()
    }

    #[test]
    fn unpacks_files_dirs_and_inner_links() {
        let dir = tempfile::tempdir().expect("tmp");
        let target = dir.path().join("source");
        let bytes = targz(&[
            E::Dir("proj"),
            E::File("proj/Pulumi.yaml", b"name: p\nruntime: yaml\n"),
            E::Symlink("current", "proj"),
        ]);
        unpack_into(&bytes, &target, None).expect("unpack");
        let text = std::fs::read_to_string(target.join("current/Pulumi.yaml")).expect("read");
        assert!(text.contains("name: p"));
        // A second init replaces the folder.
        unpack_into(&targz(&[E::File("x", b"1")]), &target, None).expect("again");
        assert!(!target.join("proj").exists());
    }

    #[test]
    fn rejects_traversal_absolute_and_escaping_links() {
        assert!(unpack_err(&[E::RawPath("../evil", b"x")]).contains("contains .."));
        assert!(unpack_err(&[E::RawPath("/etc/evil", b"x")]).contains("absolute path"));
        assert!(unpack_err(&[E::Symlink("l", "/etc")]).contains("absolute"));
        assert!(unpack_err(&[E::Symlink("l", "../..")]).contains("outside"));
        // Each link alone stays inside; together they leave the folder.
        let chained = unpack_err(&[
            E::Dir("x"),
            E::Symlink("y", "x/z/.."),
            E::Symlink("x/z", ".."),
        ]);
        assert!(chained.contains("outside"), "{chained}");
    }

    /// Links naming other links several times: each alone is shallow, but resolving the last
    /// takes 121 follows. Counting depth accepted it (exponential work as the chain grows);
    /// the kernel refuses the same tree (ELOOP), and so does unpacking now.
    #[test]
    fn link_fan_out_is_bounded_like_the_kernel() {
        let fan = |n: usize| format!("L{n}/../L{n}/../L{n}");
        let (l1, l2, l3) = (fan(0), fan(1), fan(2));
        let l4 = fan(3);
        let entries = [
            E::Dir("d/x"),
            E::Symlink("d/L0", "x"),
            E::Symlink("d/L1", &l1),
            E::Symlink("d/L2", &l2),
            E::Symlink("d/L3", &l3),
            E::Symlink("d/L4", &l4),
        ];
        let err = unpack_err(&entries);
        assert!(
            err.contains("d/L4") && err.contains("too many links"),
            "{err}"
        );
        // Four levels (40 follows) are fine.
        let dir = tempfile::tempdir().expect("tmp");
        let target = dir.path().join("source");
        unpack_into(&targz(&entries[..5]), &target, None).expect("40 follows");
        assert!(
            target.join("d/L3").is_dir(),
            "the kernel resolves 40 follows"
        );
        std::os::unix::fs::symlink(&l4, target.join("d/L4")).expect("link");
        let loop_error = std::fs::metadata(target.join("d/L4")).expect_err("ELOOP");
        assert_eq!(loop_error.raw_os_error(), Some(libc::ELOOP));
    }

    /// A compressed run of zeros as a GNU long name or as a folder's data: the tar reader would
    /// hold the name in memory, or inflate the data to skip it, however large.
    #[test]
    fn bytes_no_entry_accounts_for_are_refused() {
        let bomb = |kind: tar::EntryType, size: usize| {
            let mut h = tar::Header::new_gnu();
            h.set_entry_type(kind);
            h.set_size(size as u64);
            h.as_old_mut().name[..3].copy_from_slice(b"big");
            h.set_cksum();
            let mut tar = h.as_bytes().to_vec();
            tar.resize(512 + size.div_ceil(512) * 512, b'a');
            let mut file = tar::Header::new_gnu();
            file.set_entry_type(tar::EntryType::Regular);
            file.set_size(0);
            file.as_old_mut().name[..1].copy_from_slice(b"f");
            file.set_cksum();
            tar.extend_from_slice(file.as_bytes());
            tar.resize(tar.len() + 1024, 0);
            let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
            std::io::Write::write_all(&mut gz, &tar).expect("gzip");
            gz.finish().expect("gzip")
        };
        let dir = tempfile::tempdir().expect("tmp");
        for kind in [tar::EntryType::GNULongName, tar::EntryType::Directory] {
            let target = dir.path().join(format!("{kind:?}"));
            let err = unpack_into(&bomb(kind, 8 << 20), &target, None).expect_err("refused");
            assert!(
                matches!(err, InitError::UnaccountedBytes),
                "{kind:?}: {err}"
            );
            assert!(!target.exists());
            // Within the allowance, both are ordinary archives.
            unpack_into(&bomb(kind, 100), &target, None).expect("small records");
        }
    }

    #[test]
    fn enforces_the_size_limit() {
        let dir = tempfile::tempdir().expect("tmp");
        let big = vec![0u8; 4096];
        let err = unpack_into(
            &targz(&[E::File("big", &big)]),
            &dir.path().join("s"),
            Some(1024),
        )
        .expect_err("too big");
        assert!(
            err.to_string()
                .contains("larger than the limit of 1024 bytes"),
            "{err}"
        );
        unpack_into(
            &targz(&[E::File("big", &big)]),
            &dir.path().join("s"),
            Some(1 << 20),
        )
        .expect("fits");
    }

    #[test]
    fn the_digest_beside_a_source_names_what_it_holds() {
        let dir = tempfile::tempdir().expect("tmp");
        let source = dir.path().join("source");
        assert_eq!(digest_marker(&source), dir.path().join(".source.digest"));
        assert_eq!(current_digest(&source), None);
        let hex = "Ab".repeat(32);
        std::fs::write(digest_marker(&source), format!("sha256:{hex}\n")).expect("marker");
        let lower = format!("sha256:{}", hex.to_ascii_lowercase());
        assert_eq!(current_digest(&source).as_deref(), Some(lower.as_str()));
        assert!(same_digest(Some(&lower), &format!("sha256:{hex}")));
        assert!(!same_digest(
            Some(&lower),
            &format!("sha256:{}", "0".repeat(64))
        ));
        assert!(!same_digest(None, &lower));
        assert!(!same_digest(Some("sha256:zz"), "sha256:zz"));
        std::fs::write(digest_marker(&source), "garbage").expect("marker");
        assert_eq!(current_digest(&source), None);
    }

    #[test]
    fn digest_and_dir_are_validated() {
        assert!(parse_digest("md5:abc").is_err());
        assert!(parse_digest(&format!("sha256:{}", "a".repeat(64))).is_ok());
        let dir = tempfile::tempdir().expect("tmp");
        let link = dir.path().join("ws");
        assert!(link_workspace(dir.path(), Some("../x"), &link).is_err());
        let t = link_workspace(dir.path(), Some("sub"), &link).expect("link");
        assert_eq!(t, dir.path().join("sub"));
        assert_eq!(
            rewrite_host("http://svc.ns/programs/a/b/1", Some("127.0.0.1:9090")).expect("url"),
            "http://127.0.0.1:9090/programs/a/b/1"
        );
    }
}
