//! cosign's key-based signatures, checked offline: a signature manifest at the tag
//! `sha256-<hex>.sig` holds "simple signing" payload layers, each with the base64 ECDSA
//! signature of its bytes in an annotation. A payload counts when one of the trusted keys
//! signed it and it names the artifact's manifest digest. Transparency-log entries are not
//! consulted (as `cosign verify --insecure-ignore-tlog`): the trust is in the keys.

use base64::Engine;
use base64::engine::general_purpose::STANDARD;
use ring::signature::{ECDSA_P256_SHA256_ASN1, UnparsedPublicKey};
use serde::Deserialize;

use super::OciError;

/// Layer media type of a cosign payload.
pub const PAYLOAD_TYPE: &str = "application/vnd.dev.cosign.simplesigning.v1+json";
/// Annotation holding a payload's signature.
pub const SIGNATURE_ANNOTATION: &str = "dev.cosignproject.cosign/signature";
/// The payload's `critical.type`.
const PAYLOAD_KIND: &str = "cosign container image signature";
/// SubjectPublicKeyInfo prefix of an uncompressed ECDSA P-256 key (id-ecPublicKey,
/// prime256v1, a 66-byte bit string); the 65-byte point follows.
const P256_SPKI_PREFIX: [u8; 26] = [
    0x30, 0x59, 0x30, 0x13, 0x06, 0x07, 0x2a, 0x86, 0x48, 0xce, 0x3d, 0x02, 0x01, 0x06, 0x08, 0x2a,
    0x86, 0x48, 0xce, 0x3d, 0x03, 0x01, 0x07, 0x03, 0x42, 0x00,
];
/// Most keys accepted from one source.
pub const MAX_KEYS: usize = 16;

/// A trusted ECDSA P-256 public key.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PublicKey {
    point: Vec<u8>,
    /// `sha256:<hex>` of the key's DER, to name it in messages.
    pub fingerprint: String,
}

/// Parses every `PUBLIC KEY` PEM block of `text` (at least one, at most [`MAX_KEYS`]).
pub fn parse_keys(text: &str) -> Result<Vec<PublicKey>, OciError> {
    let mut keys = Vec::new();
    let mut rest = text;
    while let Some(start) = rest.find("-----BEGIN ") {
        let block = &rest[start..];
        let header_end = block
            .find('\n')
            .ok_or_else(|| OciError::Key("unterminated PEM header".into()))?;
        let label = block[..header_end]
            .trim()
            .trim_start_matches("-----BEGIN ")
            .trim_end_matches("-----");
        let end_marker = format!("-----END {label}-----");
        let end = block
            .find(&end_marker)
            .ok_or_else(|| OciError::Key(format!("no {end_marker} line")))?;
        if label != "PUBLIC KEY" {
            return Err(OciError::Key(format!(
                "a {label} block; expected PUBLIC KEY (cosign.pub)"
            )));
        }
        let body: String = block[header_end..end]
            .chars()
            .filter(|c| !c.is_whitespace())
            .collect();
        let der = STANDARD
            .decode(body.as_bytes())
            .map_err(|e| OciError::Key(format!("PEM body is not base64: {e}")))?;
        keys.push(from_spki(&der)?);
        if keys.len() > MAX_KEYS {
            return Err(OciError::Key(format!("more than {MAX_KEYS} keys")));
        }
        rest = &block[end + end_marker.len()..];
    }
    if keys.is_empty() {
        return Err(OciError::Key("no PEM PUBLIC KEY block".into()));
    }
    Ok(keys)
}

fn from_spki(der: &[u8]) -> Result<PublicKey, OciError> {
    match der.strip_prefix(&P256_SPKI_PREFIX[..]) {
        Some(point) if point.len() == 65 && point[0] == 0x04 => Ok(PublicKey {
            point: point.to_vec(),
            fingerprint: super::sha256_digest(der),
        }),
        _ => Err(OciError::Key(
            "only ECDSA P-256 keys are supported (cosign generate-key-pair's kind)".into(),
        )),
    }
}

/// The first key that signed `payload` with the base64 DER signature `signature`.
pub fn signer<'k>(payload: &[u8], signature: &str, keys: &'k [PublicKey]) -> Option<&'k PublicKey> {
    let signature = STANDARD.decode(signature.trim().as_bytes()).ok()?;
    keys.iter().find(|key| {
        UnparsedPublicKey::new(&ECDSA_P256_SHA256_ASN1, &key.point)
            .verify(payload, &signature)
            .is_ok()
    })
}

#[derive(Deserialize)]
struct Payload {
    critical: Critical,
}

#[derive(Deserialize)]
struct Critical {
    image: Image,
    #[serde(rename = "type")]
    kind: String,
}

#[derive(Deserialize)]
struct Image {
    #[serde(rename = "docker-manifest-digest")]
    digest: String,
}

/// Checks that a signed payload is a cosign signature of `digest`.
pub fn check_payload(payload: &[u8], digest: &str) -> Result<(), OciError> {
    let payload: Payload = serde_json::from_slice(payload)
        .map_err(|e| OciError::Signature(format!("a signed payload is not cosign's: {e}")))?;
    if payload.critical.kind != PAYLOAD_KIND {
        return Err(OciError::Signature(format!(
            "a signed payload has type {:?}, not {PAYLOAD_KIND:?}",
            payload.critical.kind
        )));
    }
    if payload.critical.image.digest != digest {
        return Err(OciError::Signature(format!(
            "a signature by a trusted key is for {}, not {digest}",
            payload.critical.image.digest
        )));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use ring::rand::SystemRandom;
    use ring::signature::{ECDSA_P256_SHA256_ASN1_SIGNING, EcdsaKeyPair, KeyPair};

    fn pem(point: &[u8]) -> String {
        let mut der = P256_SPKI_PREFIX.to_vec();
        der.extend_from_slice(point);
        format!(
            "-----BEGIN PUBLIC KEY-----\n{}\n-----END PUBLIC KEY-----\n",
            STANDARD.encode(der)
        )
    }

    fn pair() -> EcdsaKeyPair {
        let rng = SystemRandom::new();
        let pkcs8 =
            EcdsaKeyPair::generate_pkcs8(&ECDSA_P256_SHA256_ASN1_SIGNING, &rng).expect("generate");
        EcdsaKeyPair::from_pkcs8(&ECDSA_P256_SHA256_ASN1_SIGNING, pkcs8.as_ref(), &rng)
            .expect("pair")
    }

    #[test]
    fn a_signature_verifies_with_its_key_only() {
        let (a, b) = (pair(), pair());
        let keys = parse_keys(&format!(
            "{}{}",
            pem(b.public_key().as_ref()),
            pem(a.public_key().as_ref())
        ))
        .expect("keys");
        assert_eq!(keys.len(), 2);
        let payload = br#"{"critical":{"identity":{"docker-reference":"r.example/a"},"image":{"docker-manifest-digest":"sha256:ab"},"type":"cosign container image signature"},"optional":null}"#;
        let sig = a.sign(&SystemRandom::new(), payload).expect("sign");
        let sig = STANDARD.encode(sig.as_ref());
        assert_eq!(signer(payload, &sig, &keys), Some(&keys[1]));
        assert_eq!(signer(payload, &sig, &keys[..1]), None);
        let mut tampered = payload.to_vec();
        tampered[60] ^= 1;
        assert_eq!(signer(&tampered, &sig, &keys), None);
        assert_eq!(signer(payload, "not base64!", &keys), None);
        check_payload(payload, "sha256:ab").expect("digest matches");
        assert!(check_payload(payload, "sha256:cd").is_err());
        assert!(check_payload(b"{}", "sha256:ab").is_err());
    }

    #[test]
    fn keys_other_than_p256_public_keys_are_refused() {
        assert!(parse_keys("").is_err());
        assert!(parse_keys("-----BEGIN PUBLIC KEY-----\nAAAA\n-----END PUBLIC KEY-----").is_err());
        assert!(
            parse_keys("-----BEGIN ENCRYPTED SIGSTORE PRIVATE KEY-----\nAAAA\n-----END ENCRYPTED SIGSTORE PRIVATE KEY-----")
                .is_err()
        );
        assert!(parse_keys("-----BEGIN PUBLIC KEY-----\nAAAA\n").is_err());
        let key = pem(pair().public_key().as_ref());
        assert!(parse_keys(&key.repeat(MAX_KEYS)).is_ok());
        assert!(parse_keys(&key.repeat(MAX_KEYS + 1)).is_err());
    }
}
