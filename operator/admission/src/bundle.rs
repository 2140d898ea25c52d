//! The policy bundle written by `opa build -t wasm` (`make policies`): a tar.gz holding
//! `/policy.wasm`, `/data.json` and `/.manifest`.

use std::io::Read;
use std::path::{Path, PathBuf};

use serde::Deserialize;
use serde_json::Value;
use sha2::{Digest, Sha256};

/// Entrypoint of the validating webhook: `{allowed, violations}`.
pub const DECISION_ENTRYPOINT: &str = "pko/admission/decision";
/// Entrypoint of the mutating webhook: a JSON Patch (possibly empty).
pub const DEFAULTS_ENTRYPOINT: &str = "pko/defaults/patch";

/// Bundles are a few hundred KiB; anything far larger is not one of ours.
const MAX_ENTRY_BYTES: u64 = 64 * 1024 * 1024;

/// Errors while reading a bundle.
#[derive(Debug, thiserror::Error)]
pub enum BundleError {
    #[error("cannot read policy bundle {}: {source}", path.display())]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("policy bundle {}: {message}", path.display())]
    Invalid { path: PathBuf, message: String },
}

/// A loaded bundle.
#[derive(Clone, Debug)]
pub struct Bundle {
    /// The compiled policy module.
    pub wasm: Vec<u8>,
    /// The bundle's own data document (`data.json`; the tenancy data is added per request).
    pub data: Value,
    /// Entrypoints declared in the manifest.
    pub entrypoints: Vec<String>,
    /// `sha256:<hex>` of the bundle file, logged so a running operator names its policies.
    pub digest: String,
}

#[derive(Deserialize)]
struct Manifest {
    #[serde(default)]
    wasm: Vec<ManifestWasm>,
}

#[derive(Deserialize)]
struct ManifestWasm {
    entrypoint: String,
}

impl Bundle {
    /// Reads and checks a bundle: one wasm module that has both entrypoints.
    pub fn load(path: &Path) -> Result<Self, BundleError> {
        let bytes = std::fs::read(path).map_err(|source| BundleError::Io {
            path: path.to_path_buf(),
            source,
        })?;
        Self::from_bytes(&bytes).map_err(|message| BundleError::Invalid {
            path: path.to_path_buf(),
            message,
        })
    }

    /// Parses the bytes of a bundle; the error says what is wrong.
    pub fn from_bytes(bytes: &[u8]) -> Result<Self, String> {
        Self::with_entrypoints(bytes, &[DECISION_ENTRYPOINT, DEFAULTS_ENTRYPOINT])
    }

    /// [`Self::from_bytes`] for a bundle that must have the entrypoints `needed` (tests build
    /// bundles of their own policies).
    pub fn with_entrypoints(bytes: &[u8], needed: &[&str]) -> Result<Self, String> {
        let mut archive = tar::Archive::new(flate2::read::GzDecoder::new(bytes));
        let (mut wasm, mut data, mut manifest) = (None, None, None);
        let entries = archive
            .entries()
            .map_err(|e| format!("not a valid tar.gz: {e}"))?;
        for entry in entries {
            let entry = entry.map_err(|e| format!("not a valid tar.gz: {e}"))?;
            let name = entry
                .path()
                .map_err(|e| format!("bad entry name: {e}"))?
                .to_string_lossy()
                .trim_start_matches('/')
                .to_owned();
            let slot = match name.as_str() {
                "policy.wasm" => &mut wasm,
                "data.json" => &mut data,
                ".manifest" => &mut manifest,
                _ => continue,
            };
            let mut buf = Vec::new();
            entry
                .take(MAX_ENTRY_BYTES)
                .read_to_end(&mut buf)
                .map_err(|e| format!("cannot read {name}: {e}"))?;
            *slot = Some(buf);
        }
        let wasm = wasm.ok_or("no /policy.wasm: build it with `opa build -t wasm`")?;
        let data = match data {
            Some(raw) => {
                serde_json::from_slice(&raw).map_err(|e| format!("invalid data.json: {e}"))?
            }
            None => Value::Object(Default::default()),
        };
        if !data.is_object() {
            return Err("data.json is not a JSON object".into());
        }
        let manifest: Manifest = match manifest {
            Some(raw) => {
                serde_json::from_slice(&raw).map_err(|e| format!("invalid .manifest: {e}"))?
            }
            None => return Err("no /.manifest".into()),
        };
        let entrypoints: Vec<String> = manifest.wasm.into_iter().map(|w| w.entrypoint).collect();
        for &needed in needed {
            if !entrypoints.iter().any(|e| e == needed) {
                return Err(format!(
                    "entrypoint {needed} is missing (has: {}); build with `make policies`",
                    entrypoints.join(", ")
                ));
            }
        }
        Ok(Self {
            wasm,
            data,
            entrypoints,
            digest: format!("sha256:{}", hex::encode(Sha256::digest(bytes))),
        })
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// A tar.gz with the given (name, bytes) entries.
    pub(crate) fn archive(entries: &[(&str, &[u8])]) -> Vec<u8> {
        let mut builder = tar::Builder::new(flate2::write::GzEncoder::new(
            Vec::new(),
            flate2::Compression::fast(),
        ));
        for (name, bytes) in entries {
            let mut header = tar::Header::new_gnu();
            header.set_size(bytes.len() as u64);
            header.set_mode(0o644);
            header.set_cksum();
            builder
                .append_data(&mut header, name, *bytes)
                .expect("append");
        }
        builder
            .into_inner()
            .and_then(|gz| gz.finish())
            .expect("finish")
    }

    const MANIFEST: &[u8] = br#"{"wasm":[{"entrypoint":"pko/admission/decision","module":"/policy.wasm"},{"entrypoint":"pko/defaults/patch","module":"/policy.wasm"}]}"#;

    #[test]
    fn reads_a_bundle() {
        let bytes = archive(&[
            (".manifest", MANIFEST),
            ("policy.wasm", b"\0asm"),
            ("data.json", br#"{"a":1}"#),
        ]);
        let bundle = Bundle::from_bytes(&bytes).expect("valid");
        assert_eq!(bundle.wasm, b"\0asm");
        assert_eq!(bundle.data, serde_json::json!({"a": 1}));
        assert_eq!(bundle.entrypoints.len(), 2);
        assert!(bundle.digest.starts_with("sha256:"));
    }

    #[test]
    fn says_what_is_wrong() {
        let no_wasm = archive(&[(".manifest", MANIFEST)]);
        assert!(
            Bundle::from_bytes(&no_wasm)
                .unwrap_err()
                .contains("policy.wasm")
        );
        let one_entrypoint = archive(&[
            (
                ".manifest",
                br#"{"wasm":[{"entrypoint":"pko/admission/decision"}]}"#,
            ),
            ("policy.wasm", b"\0asm"),
        ]);
        assert!(
            Bundle::from_bytes(&one_entrypoint)
                .unwrap_err()
                .contains("pko/defaults/patch")
        );
        assert!(
            Bundle::from_bytes(b"not gzip")
                .unwrap_err()
                .contains("tar.gz")
        );
        let err = Bundle::load(Path::new("/nonexistent/bundle.tar.gz")).unwrap_err();
        assert!(err.to_string().contains("/nonexistent/bundle.tar.gz"));
    }
}
