//! Transform modules as OCI Wasm artifacts: pulled by manifest digest, their cosign signatures
//! checked against public keys before the module is compiled, and published by
//! `pko-operator plugin push`.
//!
//! The registry protocol is spoken over the operator's own https client rather than through
//! the `oci-client` crate: that crate builds a client of its own (on another reqwest), which
//! would bypass the egress rules every tenant-given address goes through. Signatures are
//! checked with the `ring` the operator already links, rather than with the `sigstore` crate,
//! which brings Fulcio, Rekor and OAuth clients and a second crypto stack for what is, offline
//! with keys, one ECDSA verification and a payload check.

pub mod cosign;
mod errors;
pub mod push;
pub mod reference;
pub mod registry;

pub use errors::OciError;
pub use reference::Reference;

/// Media type of an OCI image manifest.
pub const MANIFEST_TYPE: &str = "application/vnd.oci.image.manifest.v1+json";
/// Media type of the Wasm artifact's config (the CNCF Wasm OCI artifact layout).
pub const WASM_CONFIG_TYPE: &str = "application/vnd.wasm.config.v0+json";
/// Media type of the Wasm artifact's single layer.
pub const WASM_LAYER_TYPE: &str = "application/wasm";
/// Layer type of the older wasm-to-oci layout, also accepted when pulling.
const LEGACY_LAYER_TYPE: &str = "application/vnd.wasm.content.layer.v1+wasm";
/// Config types accepted when pulling.
const CONFIG_TYPES: [&str; 2] = [WASM_CONFIG_TYPE, "application/vnd.wasm.config.v1+json"];

/// `sha256:<hex>` of `bytes`.
pub fn sha256_digest(bytes: &[u8]) -> String {
    use sha2::{Digest, Sha256};
    format!("sha256:{}", hex::encode(Sha256::digest(bytes)))
}

/// Whether `digest` is `sha256:` and 64 lowercase hex characters (the only form accepted).
pub fn is_digest(digest: &str) -> bool {
    digest.strip_prefix("sha256:").is_some_and(|hex| {
        hex.len() == 64
            && hex
                .bytes()
                .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
    })
}
