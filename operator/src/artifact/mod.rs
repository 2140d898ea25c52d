//! Program → `Pulumi.yaml` → deterministic tar.gz → digest.
//!
//! The artifact bytes are a pure function of the Program's name and spec (and, later, of the
//! transform chain applied to the spec). Every replica and every process builds the same bytes, so
//! the digest written to `status.artifact` always matches what any file server replica serves.
//! Determinism rules: keys sorted at every depth (after `name` and `runtime`), one tar entry with
//! fixed header fields, and a gzip header with no name and mtime 0.

pub mod built;
pub mod cache;
pub mod index;
pub mod stored;

use std::io::Write;

use bytes::Bytes;
use flate2::{Compression, GzBuilder};
use serde_json::{Map, Value};
use sha2::{Digest, Sha256};

/// The only file in every artifact.
pub const PROJECT_FILE: &str = "Pulumi.yaml";
/// Fixed file mode of the project file inside the tar.
const FILE_MODE: u32 = 0o644;
/// "Unknown" OS byte in the gzip header (RFC 1952); fixed so the host OS never leaks in.
const GZIP_OS_UNKNOWN: u8 = 255;
/// Fixed compression level: changing it changes every digest.
const GZIP_LEVEL: u32 = 6;

/// Failures while building an artifact.
#[derive(Debug, thiserror::Error)]
pub enum ArtifactError {
    #[error("program spec cannot be represented as JSON: {0}")]
    Spec(#[source] serde_json::Error),
    #[error("program spec must be a JSON object, found {0}")]
    NotAnObject(&'static str),
    #[error("program spec sets reserved project key {0:?}")]
    ReservedKey(String),
    #[error("cannot render Pulumi.yaml: {0}")]
    Yaml(#[source] yaml_serde::Error),
    #[error("cannot write artifact archive: {0}")]
    Archive(#[source] std::io::Error),
}

/// A built artifact: the gzip bytes and their identity.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Artifact {
    /// The tar.gz bytes as served.
    pub bytes: Bytes,
    /// `sha256:<hex>` of `bytes`, as in `status.artifact.digest`.
    pub digest: String,
}

impl Artifact {
    /// Compressed length, as in `status.artifact.size`.
    pub fn size(&self) -> u64 {
        self.bytes.len() as u64
    }
}

/// Build the artifact of a Program from its name and spec (the value under `program:`).
pub fn build(name: &str, spec: &Value) -> Result<Artifact, ArtifactError> {
    let yaml = render_project(name, spec)?;
    pack(yaml.as_bytes())
}

/// Build the artifact of a typed Program spec.
pub fn build_typed<S: serde::Serialize>(name: &str, spec: &S) -> Result<Artifact, ArtifactError> {
    let value = serde_json::to_value(spec).map_err(ArtifactError::Spec)?;
    build(name, &value)
}

/// Render `Pulumi.yaml`: `name`, `runtime: yaml`, then the spec's fields, keys sorted at every depth.
pub fn render_project(name: &str, spec: &Value) -> Result<String, ArtifactError> {
    let fields = match spec {
        Value::Object(map) => map,
        Value::Null => &Map::new(),
        other => return Err(ArtifactError::NotAnObject(json_kind(other))),
    };
    let mut project = Map::new();
    project.insert("name".into(), Value::String(name.to_owned()));
    project.insert("runtime".into(), Value::String("yaml".into()));
    let mut keys: Vec<&String> = fields.keys().collect();
    keys.sort();
    for key in keys {
        if key == "name" || key == "runtime" {
            return Err(ArtifactError::ReservedKey(key.clone()));
        }
        if let Some(value) = fields.get(key) {
            project.insert(key.clone(), pko_plugin_host::json::canonical(value));
        }
    }
    yaml_serde::to_string(&Value::Object(project)).map_err(ArtifactError::Yaml)
}

/// Pack one `Pulumi.yaml` into a deterministic tar.gz and digest it.
pub fn pack(pulumi_yaml: &[u8]) -> Result<Artifact, ArtifactError> {
    let mut header = tar::Header::new_ustar();
    header
        .set_path(PROJECT_FILE)
        .map_err(ArtifactError::Archive)?;
    header.set_size(pulumi_yaml.len() as u64);
    header.set_mode(FILE_MODE);
    header.set_mtime(0);
    header.set_uid(0);
    header.set_gid(0);
    header.set_username("").map_err(ArtifactError::Archive)?;
    header.set_groupname("").map_err(ArtifactError::Archive)?;
    header.set_entry_type(tar::EntryType::Regular);
    header.set_cksum();

    let gz = GzBuilder::new()
        .mtime(0)
        .operating_system(GZIP_OS_UNKNOWN)
        .write(
            Vec::with_capacity(pulumi_yaml.len() / 2 + 256),
            Compression::new(GZIP_LEVEL),
        );
    let mut tar = tar::Builder::new(gz);
    tar.mode(tar::HeaderMode::Deterministic);
    tar.append(&header, pulumi_yaml)
        .map_err(ArtifactError::Archive)?;
    let mut gz = tar.into_inner().map_err(ArtifactError::Archive)?;
    gz.flush().map_err(ArtifactError::Archive)?;
    let bytes = gz.finish().map_err(ArtifactError::Archive)?;
    let digest = format!("sha256:{}", hex::encode(Sha256::digest(&bytes)));
    Ok(Artifact {
        bytes: Bytes::from(bytes),
        digest,
    })
}

fn json_kind(value: &Value) -> &'static str {
    match value {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

#[cfg(test)]
mod tests {
    use std::io::Read;

    use serde_json::json;

    use super::*;

    fn unpack(bytes: &[u8]) -> Vec<(tar::Header, Vec<u8>)> {
        let gz = flate2::read::GzDecoder::new(bytes);
        let mut archive = tar::Archive::new(gz);
        let mut out = Vec::new();
        for entry in archive.entries().expect("entries") {
            let mut entry = entry.expect("entry");
            let mut body = Vec::new();
            entry.read_to_end(&mut body).expect("read");
            out.push((entry.header().clone(), body));
        }
        out
    }

    fn sample() -> Value {
        json!({
            "resources": {"bucket": {"type": "aws:s3:Bucket", "properties": {"z": 1, "a": [3, 1, 2]}}},
            "outputs": {"name": "${bucket.id}"},
            "configuration": {"region": {"type": "String", "default": "eu"}},
        })
    }

    #[test]
    fn project_starts_with_name_and_runtime_and_sorts_keys() {
        let yaml = render_project("web", &sample()).expect("render");
        let expected = "name: web\nruntime: yaml\nconfiguration:\n  region:\n    default: eu\n    type: String\noutputs:\n  name: ${bucket.id}\nresources:\n  bucket:\n    properties:\n      a:\n      - 3\n      - 1\n      - 2\n      z: 1\n    type: aws:s3:Bucket\n";
        assert_eq!(yaml, expected);
    }

    #[test]
    fn same_spec_same_bytes_regardless_of_key_order() {
        let a = build("web", &sample()).expect("build a");
        let reordered: Value = serde_json::from_str(
            r#"{"configuration":{"region":{"default":"eu","type":"String"}},"outputs":{"name":"${bucket.id}"},"resources":{"bucket":{"properties":{"a":[3,1,2],"z":1},"type":"aws:s3:Bucket"}}}"#,
        )
        .expect("json");
        let b = build("web", &reordered).expect("build b");
        assert_eq!(a, b);
        assert_eq!(a.digest.len(), "sha256:".len() + 64);
        assert_eq!(
            a.digest,
            format!("sha256:{}", hex::encode(Sha256::digest(&a.bytes)))
        );
    }

    #[test]
    fn different_spec_or_name_changes_digest() {
        let a = build("web", &sample()).expect("a");
        let b = build("web2", &sample()).expect("b");
        let c = build("web", &json!({"outputs": {"x": 1}})).expect("c");
        assert_ne!(a.digest, b.digest);
        assert_ne!(a.digest, c.digest);
    }

    #[test]
    fn archive_has_one_entry_with_fixed_header() {
        let artifact = build("web", &sample()).expect("build");
        let entries = unpack(&artifact.bytes);
        assert_eq!(entries.len(), 1);
        let (header, body) = &entries[0];
        assert_eq!(header.path().expect("path").to_str(), Some(PROJECT_FILE));
        assert_eq!(header.mtime().expect("mtime"), 0);
        assert_eq!(header.uid().expect("uid"), 0);
        assert_eq!(header.gid().expect("gid"), 0);
        assert_eq!(header.mode().expect("mode"), FILE_MODE);
        assert_eq!(header.username().expect("user"), Some(""));
        assert_eq!(header.groupname().expect("group"), Some(""));
        assert_eq!(
            std::str::from_utf8(body).expect("utf8"),
            render_project("web", &sample()).expect("render")
        );
        // gzip header: magic, deflate, no flags (no name), mtime 0, OS unknown.
        assert_eq!(&artifact.bytes[..4], &[0x1f, 0x8b, 8, 0]);
        assert_eq!(&artifact.bytes[4..8], &[0, 0, 0, 0]);
        assert_eq!(artifact.bytes[9], GZIP_OS_UNKNOWN);
    }

    #[test]
    fn empty_spec_is_a_valid_project() {
        let yaml = render_project("empty", &Value::Null).expect("render");
        assert_eq!(yaml, "name: empty\nruntime: yaml\n");
    }

    #[test]
    fn reserved_keys_and_non_objects_are_rejected() {
        assert!(matches!(
            render_project("x", &json!({"name": "other"})),
            Err(ArtifactError::ReservedKey(k)) if k == "name"
        ));
        assert!(matches!(
            render_project("x", &json!([1])),
            Err(ArtifactError::NotAnObject("an array"))
        ));
    }

    #[test]
    fn known_digest_is_stable_across_builds() {
        // Pinned so that a dependency bump that changes the bytes is noticed: every digest in
        // every cluster would change with it.
        let artifact = build("pinned", &json!({"outputs": {"greeting": "hello"}})).expect("build");
        assert_eq!(
            artifact.digest,
            "sha256:3be778aaba331e76da127228e588e0ab5c7cd5015312f2509c8272b03f426c95"
        );
        let entries = unpack(&artifact.bytes);
        assert_eq!(
            String::from_utf8(entries[0].1.clone()).expect("utf8"),
            "name: pinned\nruntime: yaml\noutputs:\n  greeting: hello\n"
        );
    }
}
