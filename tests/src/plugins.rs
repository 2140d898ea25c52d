//! The transform plugins built by `make plugins`, for tests and benchmarks.

use std::path::PathBuf;

use sha2::{Digest, Sha256};

use crate::HarnessError;

/// Where `make plugins` writes the components: `$PKO_PLUGINS_DIR` (set by the Makefile), else
/// the Makefile's default.
pub fn plugins_dir() -> PathBuf {
    match std::env::var_os("PKO_PLUGINS_DIR").filter(|v| !v.is_empty()) {
        Some(dir) => PathBuf::from(dir),
        None => {
            let home = std::env::var_os("HOME")
                .map(PathBuf::from)
                .unwrap_or_default();
            home.join(".cache/pko-rs/plugins-target/wasm32-wasip2/release")
        }
    }
}

/// A built component.
#[derive(Debug, Clone)]
pub struct PluginModule {
    pub path: PathBuf,
    pub bytes: Vec<u8>,
    /// Lowercase hex sha256 of `bytes`.
    pub sha256: String,
}

/// The component `<name>.wasm` (crate name with `_`, e.g. `default_tags`).
pub fn module(name: &str) -> Result<PluginModule, HarnessError> {
    let path = plugins_dir().join(format!("{name}.wasm"));
    let bytes = std::fs::read(&path).map_err(|e| HarnessError::Missing {
        what: format!(
            "plugin component {} ({e}): run `make plugins` (or set PKO_PLUGINS_DIR)",
            path.display()
        ),
    })?;
    let sha256 = hex::encode(Sha256::digest(&bytes));
    Ok(PluginModule {
        path,
        bytes,
        sha256,
    })
}

/// A precompiled-module folder shared by the operators of tests, so each module is compiled
/// once (debug builds compile slowly). Entries are keyed by module digest and engine build, so
/// reusing the folder across runs is safe: it is what `--plugin-cache-dir` is for.
pub fn shared_cache_dir() -> PathBuf {
    std::env::temp_dir().join("pko-rs-plugin-cache")
}
