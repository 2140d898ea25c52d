//! Bounds the on-disk cache of precompiled modules.
//!
//! Precompiled code is several times the size of the wasm it comes from, and every module
//! digest ever loaded adds a file; in a pod the folder is an emptyDir whose `sizeLimit` evicts
//! the pod when exceeded. So the cache keeps at most `max_bytes`: the least recently used files
//! go first (a read refreshes a file's modification time), folders of other engine builds (an
//! upgraded operator cannot use them) and stale temporary files are removed at start.
//!
//! A cache file is the sha256 of the serialized component followed by the serialized
//! component; a file that does not match its checksum is not loaded.

use std::path::Path;
use std::time::{Duration, SystemTime};

use sha2::{Digest, Sha256};
use tracing::{debug, warn};
use wasmtime::Engine;
use wasmtime::component::Component;

/// Temporary files older than this are left over from a crash.
const STALE_TMP: Duration = Duration::from_secs(3600);

/// Whether `dir` looks like a cache folder of some engine build: named by a 16-hex-digit hash
/// and holding only precompiled modules and temporaries. Nothing else is ever deleted, so a
/// cache folder pointed at a shared place cannot lose anyone's files.
fn is_engine_folder(dir: &Path) -> bool {
    let named = dir
        .file_name()
        .and_then(|n| n.to_str())
        .is_some_and(|n| n.len() == 16 && n.bytes().all(|b| b.is_ascii_hexdigit()));
    named
        && std::fs::read_dir(dir).is_ok_and(|entries| {
            entries.flatten().all(|e| {
                e.file_type().is_ok_and(|t| t.is_file())
                    && e.file_name()
                        .to_str()
                        .is_some_and(|n| n.ends_with(".cwasm") || n.ends_with(".tmp"))
            })
        })
}

/// Removes the cache folders of other engine builds next to `current` (an upgraded operator
/// cannot use them) and, inside `current`, temporary files left by a crashed writer.
pub fn clean_at_start(root: &Path, current: &Path) {
    if let Ok(entries) = std::fs::read_dir(root) {
        for entry in entries.flatten() {
            let path = entry.path();
            if path == current || !is_engine_folder(&path) {
                continue;
            }
            match std::fs::remove_dir_all(&path) {
                Ok(()) => {
                    debug!(path = %path.display(), "removed a precompiled cache of another engine")
                }
                Err(e) => {
                    warn!(path = %path.display(), error = %e, "cannot clean the plugin cache")
                }
            }
        }
    }
    let Ok(entries) = std::fs::read_dir(current) else {
        return;
    };
    let now = SystemTime::now();
    for entry in entries.flatten() {
        let name = entry.file_name();
        let is_tmp = name.to_str().is_some_and(|n| n.ends_with(".tmp"));
        let old = entry
            .metadata()
            .and_then(|m| m.modified())
            .is_ok_and(|t| now.duration_since(t).unwrap_or_default() > STALE_TMP);
        if is_tmp && old {
            let _ = std::fs::remove_file(entry.path());
        }
    }
}

/// Marks `path` as just used (its modification time is the LRU clock).
pub fn touch(path: &Path) {
    if let Ok(file) = std::fs::File::options().append(true).open(path) {
        let _ = file.set_modified(SystemTime::now());
    }
}

/// Deletes the least recently used `.cwasm` files of `dir` until the rest fit in `max_bytes`;
/// `keep` (the file just written) is never deleted. Returns the bytes freed.
pub fn prune(dir: &Path, max_bytes: u64, keep: &Path) -> u64 {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return 0;
    };
    let mut files: Vec<(SystemTime, u64, std::path::PathBuf)> = entries
        .flatten()
        .filter(|e| e.path().extension().is_some_and(|x| x == "cwasm"))
        .filter_map(|e| {
            let meta = e.metadata().ok()?;
            Some((meta.modified().ok()?, meta.len(), e.path()))
        })
        .collect();
    let mut total: u64 = files.iter().map(|(_, len, _)| len).sum();
    if total <= max_bytes {
        return 0;
    }
    files.sort();
    let mut freed = 0;
    for (_, len, path) in files {
        if total <= max_bytes {
            break;
        }
        if path == keep {
            continue;
        }
        if std::fs::remove_file(&path).is_ok() {
            debug!(path = %path.display(), bytes = len, "evicted a precompiled module");
            total -= len;
            freed += len;
        }
    }
    freed
}

/// Reads the precompiled component at `path`: `None` when there is none, an error when the
/// file is unusable (damaged, or from another engine).
#[allow(
    unsafe_code,
    reason = "deserializes precompiled code this host wrote; see SAFETY"
)]
pub(crate) fn read_precompiled(engine: &Engine, path: &Path) -> Result<Option<Component>, String> {
    let data = match std::fs::read(path) {
        Ok(data) => data,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(e.to_string()),
    };
    if data.len() < 32 {
        return Err("truncated".into());
    }
    let (sum, body) = data.split_at(32);
    if Sha256::digest(body).as_slice() != sum {
        return Err("checksum mismatch".into());
    }
    // The folder is keyed by the engine's compatibility hash, and the bytes are unchanged
    // since this host wrote them (checksum above). The folder belongs to the operator;
    // whoever can write it can already change the operator's own code.
    deserialize_own(engine, body).map(Some)
}

/// Machine code that this host's own binary produced (here, from the cache, or from a
/// compiler child fed the module), loaded into `engine`.
#[allow(
    unsafe_code,
    reason = "deserializes precompiled code this host's binary wrote; see SAFETY"
)]
pub(crate) fn deserialize_own(engine: &Engine, body: &[u8]) -> Result<Component, String> {
    // SAFETY: `body` was produced by `Engine::precompile_component` or `Component::serialize`
    // of this binary (the callers' guarantee), never by a tenant, and wasmtime checks its
    // version and compile settings again before using it.
    unsafe { Component::deserialize(engine, body) }.map_err(|e| format!("{e:#}"))
}

/// Writes serialized machine code to `path` in the format [`read_precompiled`] reads.
pub(crate) fn write_serialized(body: &[u8], path: &Path) -> Result<(), String> {
    let dir = path.parent().ok_or("no parent folder")?;
    std::fs::create_dir_all(dir).map_err(|e| e.to_string())?;
    let mut data = Vec::with_capacity(body.len() + 32);
    data.extend_from_slice(&Sha256::digest(body));
    data.extend_from_slice(body);
    // Write then rename, so a reader never sees half a file.
    let tmp = dir.join(format!(
        ".{}.{}.tmp",
        path.file_name()
            .and_then(|n| n.to_str())
            .unwrap_or("module"),
        std::process::id()
    ));
    std::fs::write(&tmp, &data).map_err(|e| e.to_string())?;
    std::fs::rename(&tmp, path).map_err(|e| {
        let _ = std::fs::remove_file(&tmp);
        e.to_string()
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn file(dir: &Path, name: &str, len: usize, age_secs: u64) -> std::path::PathBuf {
        let path = dir.join(name);
        std::fs::write(&path, vec![0u8; len]).expect("write");
        let file = std::fs::File::options()
            .append(true)
            .open(&path)
            .expect("open");
        file.set_modified(SystemTime::now() - Duration::from_secs(age_secs))
            .expect("mtime");
        path
    }

    #[test]
    fn the_least_recently_used_go_first_and_the_new_file_stays() {
        let dir = tempfile::tempdir().expect("tmp");
        let old = file(dir.path(), "a.cwasm", 100, 300);
        let used = file(dir.path(), "b.cwasm", 100, 200);
        let newest = file(dir.path(), "c.cwasm", 100, 0);
        touch(&used);
        assert_eq!(prune(dir.path(), 250, &newest), 100);
        assert!(!old.exists(), "the oldest was evicted");
        assert!(used.exists() && newest.exists());
        // Under the bound: nothing happens.
        assert_eq!(prune(dir.path(), 250, &newest), 0);
        // The kept file survives even when it alone is over the bound.
        assert_eq!(prune(dir.path(), 50, &newest), 100);
        assert!(newest.exists() && !used.exists());
    }

    #[test]
    fn other_engines_and_stale_temporaries_are_cleaned_at_start() {
        let root = tempfile::tempdir().expect("tmp");
        let current = root.path().join("00000000000000aa");
        let other = root.path().join("00000000000000bb");
        // Not ours: a folder with another name, and an engine-like one holding something else.
        let unrelated = root.path().join("notes");
        let lookalike = root.path().join("00000000000000cc");
        for d in [&current, &other, &unrelated, &lookalike] {
            std::fs::create_dir_all(d).expect("dir");
        }
        file(&other, "x.cwasm", 10, 0);
        let kept_note = file(&unrelated, "x.cwasm", 10, 0);
        let kept_doc = file(&lookalike, "readme.txt", 10, 0);
        let loose = file(root.path(), "loose.txt", 10, 0);
        let stale = file(&current, ".x.cwasm.1.tmp", 10, 7200);
        let fresh = file(&current, ".y.cwasm.2.tmp", 10, 0);
        let module = file(&current, "z.cwasm", 10, 7200);
        clean_at_start(root.path(), &current);
        assert!(!other.exists() && !stale.exists());
        assert!(fresh.exists() && module.exists());
        assert!(kept_note.exists() && kept_doc.exists() && loose.exists());
    }
}
