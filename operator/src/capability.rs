//! Capability URLs for artifacts: `status.artifact.url` carries a token that only the operator
//! can mint, bound to the Program's namespace, name, generation and artifact digest.
//!
//! Whoever may read a Program's status (Kubernetes RBAC) learns the URL and can fetch it; no one
//! else can, from any namespace, and a request without a valid token gets the same answer as a
//! Program that does not exist. The token is an HMAC-SHA256 under a key kept in a Secret of the
//! operator's own namespace, shared by every replica (each one reads it by name, never lists or
//! watches Secrets). Keys rotate with an overlap: a new key is added, used for signing only once
//! every replica has had time to read it, and the old one is kept until every Program has been
//! re-signed and the workspaces fetching with old URLs are done.
//!
//! URL shape: `<advertised>/programs/<ns>/<name>/<generation>?digest=<digest>&token=<kid>.<mac>`.
//! It stays a plain HTTP GET, so any Flux-style fetcher, PKO's agent included, uses it unchanged.

use std::collections::BTreeMap;
use std::sync::{Arc, RwLock};
use std::time::Duration;

use base64::Engine as _;
use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use k8s_openapi::ByteString;
use k8s_openapi::api::core::v1::Secret;
use kube::api::{Patch, PatchParams, PostParams};
use kube::{Api, Client};
use rand::RngCore;
use ring::hmac;
use serde_json::json;
use tracing::{info, warn};

/// Domain separation of the MAC input, and its version.
const CONTEXT: &str = "pko-rs/artifact-url/v1";
/// Key bytes (HMAC-SHA256's block-size-independent recommended minimum is the output size).
const KEY_BYTES: usize = 32;
/// MAC bytes kept in the token (the full SHA-256 output).
const MAC_BYTES: usize = 32;
/// A new key signs only after this long, so every replica (which re-reads the keys more often
/// than this) already knows it when the first URL signed with it is published.
pub const ACTIVATION_DELAY: Duration = Duration::from_secs(60);
/// How often every replica re-reads the keys.
pub const REFRESH_INTERVAL: Duration = Duration::from_secs(10);

/// Errors of key loading and rotation.
#[derive(Debug, thiserror::Error)]
pub enum CapabilityError {
    #[error("cannot read artifact keys from Secret {secret}: {source}")]
    Read {
        secret: String,
        #[source]
        source: kube::Error,
    },
    #[error("cannot write artifact keys to Secret {secret}: {source}")]
    Write {
        secret: String,
        #[source]
        source: kube::Error,
    },
    #[error(
        "Secret {0} holds no usable artifact key (keys are named k<unix seconds> and hold 32 bytes)"
    )]
    NoKey(String),
}

/// One signing key. The id says when it was made: `k<unix seconds>`.
#[derive(Clone)]
struct Key {
    id: String,
    created: i64,
    key: hmac::Key,
}

/// The keys a replica signs and verifies with: one signs, all verify.
#[derive(Clone, Default)]
pub struct KeySet {
    /// Newest first.
    keys: Vec<Key>,
}

impl std::fmt::Debug for KeySet {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let ids: Vec<&str> = self.keys.iter().map(|k| k.id.as_str()).collect();
        f.debug_struct("KeySet").field("ids", &ids).finish()
    }
}

impl KeySet {
    /// Keys from a Secret's data; entries that are not keys are ignored.
    pub fn from_data(data: &BTreeMap<String, ByteString>) -> Self {
        let mut keys: Vec<Key> = data
            .iter()
            .filter_map(|(id, bytes)| {
                let created = key_created(id)?;
                (bytes.0.len() == KEY_BYTES).then(|| Key {
                    id: id.clone(),
                    created,
                    key: hmac::Key::new(hmac::HMAC_SHA256, &bytes.0),
                })
            })
            .collect();
        keys.sort_by(|a, b| b.created.cmp(&a.created).then_with(|| b.id.cmp(&a.id)));
        Self { keys }
    }

    /// A set of one fresh random key (a replica with nowhere to keep keys; tests).
    pub fn ephemeral(now: i64) -> Self {
        let (id, bytes) = new_key(now);
        Self::from_data(&BTreeMap::from([(id, ByteString(bytes))]))
    }

    pub fn is_empty(&self) -> bool {
        self.keys.is_empty()
    }

    /// Key ids and creation times, newest first.
    pub fn ids(&self) -> Vec<(String, i64)> {
        self.keys
            .iter()
            .map(|k| (k.id.clone(), k.created))
            .collect()
    }

    /// The key that signs at `now`: the newest one old enough that every replica knows it, or
    /// the oldest one when none is (a fresh install).
    fn signing(&self, now: i64) -> Option<&Key> {
        let activation = i64::try_from(ACTIVATION_DELAY.as_secs()).unwrap_or(i64::MAX);
        self.keys
            .iter()
            .find(|k| now.saturating_sub(k.created) >= activation)
            .or_else(|| self.keys.last())
    }

    /// The id of the key that signs at `now`.
    pub fn signing_id(&self, now: i64) -> Option<&str> {
        self.signing(now).map(|k| k.id.as_str())
    }

    /// The token for one artifact, signed at `now`.
    pub fn sign(&self, now: i64, artifact: &ArtifactRef<'_>) -> Option<String> {
        let key = self.signing(now)?;
        let tag = hmac::sign(&key.key, artifact.message().as_bytes());
        Some(format!(
            "{}.{}",
            key.id,
            URL_SAFE_NO_PAD.encode(&tag.as_ref()[..MAC_BYTES])
        ))
    }

    /// True when `token` was minted by one of these keys for exactly this artifact. The MAC is
    /// compared in constant time; a malformed token is refused before any key is tried.
    pub fn verify(&self, token: &str, artifact: &ArtifactRef<'_>) -> bool {
        let Some((id, mac)) = token.split_once('.') else {
            return false;
        };
        let Ok(mac) = URL_SAFE_NO_PAD.decode(mac) else {
            return false;
        };
        let Some(key) = self.keys.iter().find(|k| k.id == id) else {
            return false;
        };
        hmac::verify(&key.key, artifact.message().as_bytes(), &mac).is_ok()
    }
}

/// What a token is bound to.
#[derive(Clone, Copy, Debug)]
pub struct ArtifactRef<'a> {
    pub namespace: &'a str,
    pub name: &'a str,
    pub generation: i64,
    pub digest: &'a str,
}

impl ArtifactRef<'_> {
    /// Names and digests cannot hold a NUL, so the fields cannot run into each other.
    fn message(&self) -> String {
        format!(
            "{CONTEXT}\0{}\0{}\0{}\0{}",
            self.namespace, self.name, self.generation, self.digest
        )
    }

    /// The query of the capability URL.
    pub fn query(&self, token: &str) -> String {
        format!("digest={}&token={token}", self.digest)
    }
}

/// `k<unix seconds>` → seconds.
fn key_created(id: &str) -> Option<i64> {
    let digits = id.strip_prefix('k')?;
    if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    digits.parse().ok()
}

fn new_key(now: i64) -> (String, Vec<u8>) {
    let mut bytes = vec![0u8; KEY_BYTES];
    rand::rng().fill_bytes(&mut bytes);
    (format!("k{now}"), bytes)
}

/// When keys are added and dropped.
#[derive(Clone, Copy, Debug)]
pub struct RotationPolicy {
    /// A new key is added when the newest one is this old.
    pub max_age: Duration,
    /// A key is dropped this long after a newer key started signing.
    pub overlap: Duration,
}

/// One change of the key Secret.
#[derive(Debug, PartialEq, Eq)]
pub enum Rotation {
    /// Add a key made at this time.
    Add(i64),
    /// Drop this key.
    Drop(String),
}

/// The changes the keys need at `now` (pure, so it is tested without a clock or a cluster).
/// `keys` are (id, created), any order.
pub fn plan_rotation(keys: &[(String, i64)], now: i64, policy: RotationPolicy) -> Vec<Rotation> {
    let secs = |d: Duration| i64::try_from(d.as_secs()).unwrap_or(i64::MAX);
    let mut keys = keys.to_vec();
    keys.sort_by_key(|k| std::cmp::Reverse(k.1));
    let Some((_, newest)) = keys.first() else {
        return vec![Rotation::Add(now)];
    };
    let mut plan = Vec::new();
    if now.saturating_sub(*newest) >= secs(policy.max_age) && *newest < now {
        plan.push(Rotation::Add(now));
    }
    // A key is replaced once a newer key signs (created + activation); it is kept for the
    // overlap after that, so URLs signed with it keep working until re-signed and used.
    let activation = secs(ACTIVATION_DELAY);
    for pair in keys.windows(2) {
        let (newer, older) = (&pair[0], &pair[1]);
        let replaced_at = newer.1.saturating_add(activation);
        if now >= replaced_at.saturating_add(secs(policy.overlap)) {
            plan.push(Rotation::Drop(older.0.clone()));
        }
    }
    plan
}

/// The keys every part of a replica shares; replaced whole when the Secret changes.
#[derive(Clone, Default)]
pub struct KeyRing {
    current: Arc<RwLock<Arc<KeySet>>>,
}

impl KeyRing {
    pub fn new(keys: KeySet) -> Self {
        Self {
            current: Arc::new(RwLock::new(Arc::new(keys))),
        }
    }

    pub fn get(&self) -> Arc<KeySet> {
        self.current
            .read()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone()
    }

    /// Replaces the keys when they changed.
    fn set(&self, keys: KeySet) {
        let mut current = self
            .current
            .write()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if current.ids() != keys.ids() {
            *current = Arc::new(keys);
        }
    }
}

/// The Secret holding the keys, read by name.
#[derive(Clone)]
pub struct KeySecret {
    api: Api<Secret>,
    namespace: String,
    name: String,
}

impl KeySecret {
    pub fn new(client: Client, namespace: &str, name: &str) -> Self {
        Self {
            api: Api::namespaced(client, namespace),
            namespace: namespace.to_owned(),
            name: name.to_owned(),
        }
    }

    fn display(&self) -> String {
        format!("{}/{}", self.namespace, self.name)
    }

    /// Reads the keys, creating the Secret with one key when it does not exist yet (another
    /// replica may create it at the same time: its keys are read back then).
    pub async fn load_or_create(&self, now: i64) -> Result<KeySet, CapabilityError> {
        if let Some(keys) = self.read().await? {
            return Ok(keys);
        }
        let (id, bytes) = new_key(now);
        let secret = Secret {
            metadata: kube::api::ObjectMeta {
                name: Some(self.name.clone()),
                labels: Some(BTreeMap::from([(
                    "app.kubernetes.io/managed-by".to_owned(),
                    "pko-rs".to_owned(),
                )])),
                annotations: Some(BTreeMap::from([(
                    "pko-rs.dev/purpose".to_owned(),
                    "signing keys of artifact URLs".to_owned(),
                )])),
                ..Default::default()
            },
            type_: Some("Opaque".to_owned()),
            data: Some(BTreeMap::from([(id, ByteString(bytes))])),
            ..Default::default()
        };
        match self.api.create(&PostParams::default(), &secret).await {
            Ok(_) => info!(secret = %self.display(), "created the artifact URL keys"),
            Err(kube::Error::Api(e)) if e.code == 409 => {}
            Err(source) => {
                return Err(CapabilityError::Write {
                    secret: self.display(),
                    source,
                });
            }
        }
        self.read()
            .await?
            .ok_or_else(|| CapabilityError::NoKey(self.display()))
    }

    async fn read(&self) -> Result<Option<KeySet>, CapabilityError> {
        let secret =
            self.api
                .get_opt(&self.name)
                .await
                .map_err(|source| CapabilityError::Read {
                    secret: self.display(),
                    source,
                })?;
        let Some(secret) = secret else {
            return Ok(None);
        };
        let keys = KeySet::from_data(&secret.data.unwrap_or_default());
        if keys.is_empty() {
            return Err(CapabilityError::NoKey(self.display()));
        }
        Ok(Some(keys))
    }

    /// Applies a rotation plan (leader only).
    async fn apply(&self, plan: &[Rotation]) -> Result<(), CapabilityError> {
        let mut data = serde_json::Map::new();
        for step in plan {
            match step {
                Rotation::Add(now) => {
                    let (id, bytes) = new_key(*now);
                    data.insert(
                        id,
                        json!(base64::engine::general_purpose::STANDARD.encode(bytes)),
                    );
                }
                Rotation::Drop(id) => {
                    data.insert(id.clone(), serde_json::Value::Null);
                }
            }
        }
        self.api
            .patch(
                &self.name,
                &PatchParams::default(),
                &Patch::Merge(json!({"data": data})),
            )
            .await
            .map_err(|source| CapabilityError::Write {
                secret: self.display(),
                source,
            })?;
        info!(secret = %self.display(), ?plan, "rotated the artifact URL keys");
        Ok(())
    }
}

/// Re-reads the keys every [`REFRESH_INTERVAL`] into `ring` until `stop` (every replica).
/// `on_signing_change` runs when the key that signs changes (a rotation, or a new key coming
/// of age), so every Program gets a URL signed with it.
pub async fn refresh(
    secret: KeySecret,
    ring: KeyRing,
    on_signing_change: impl Fn() + Send,
    stop: tokio_util::sync::CancellationToken,
) {
    let mut signing = ring.get().signing_id(unix_now()).map(str::to_owned);
    loop {
        tokio::select! {
            () = stop.cancelled() => return,
            () = tokio::time::sleep(REFRESH_INTERVAL) => {}
        }
        match secret.read().await {
            Ok(Some(keys)) => ring.set(keys),
            Ok(None) => {
                warn!(secret = %secret.display(), "the artifact URL keys are gone; keeping the last ones read");
            }
            Err(err) => {
                warn!(error = %err, "cannot refresh the artifact URL keys; keeping the last ones read")
            }
        }
        let now_signing = ring.get().signing_id(unix_now()).map(str::to_owned);
        if now_signing != signing {
            info!(key = ?now_signing, "artifact URLs are now signed with a new key");
            signing = now_signing;
            on_signing_change();
        }
    }
}

/// Rotates the keys by `policy` until `stop` (the leader only).
pub async fn rotate(
    secret: KeySecret,
    policy: RotationPolicy,
    stop: tokio_util::sync::CancellationToken,
) {
    loop {
        match secret.read().await {
            Ok(Some(keys)) => {
                let plan = plan_rotation(&keys.ids(), unix_now(), policy);
                if !plan.is_empty()
                    && let Err(err) = secret.apply(&plan).await
                {
                    warn!(error = %err, "cannot rotate the artifact URL keys");
                }
            }
            Ok(None) => {
                if let Err(err) = secret.load_or_create(unix_now()).await {
                    warn!(error = %err, "cannot re-create the artifact URL keys");
                }
            }
            Err(err) => warn!(error = %err, "cannot read the artifact URL keys to rotate them"),
        }
        tokio::select! {
            () = stop.cancelled() => return,
            () = tokio::time::sleep(REFRESH_INTERVAL) => {}
        }
    }
}

/// Seconds since the Unix epoch.
pub fn unix_now() -> i64 {
    jiff::Timestamp::now().as_second()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn artifact(generation: i64) -> ArtifactRef<'static> {
        ArtifactRef {
            namespace: "team-a",
            name: "hello",
            generation,
            digest: "sha256:abc",
        }
    }

    #[test]
    fn a_token_verifies_only_for_what_it_was_minted_for() {
        let keys = KeySet::ephemeral(1_000);
        let token = keys.sign(1_000, &artifact(1)).expect("token");
        assert!(keys.verify(&token, &artifact(1)));
        assert!(!keys.verify(&token, &artifact(2)));
        for other in [
            ArtifactRef {
                namespace: "team-b",
                ..artifact(1)
            },
            ArtifactRef {
                name: "other",
                ..artifact(1)
            },
            ArtifactRef {
                digest: "sha256:abd",
                ..artifact(1)
            },
        ] {
            assert!(!keys.verify(&token, &other), "{other:?}");
        }
        // Another key set (another install) never verifies it.
        assert!(!KeySet::ephemeral(1_000).verify(&token, &artifact(1)));
        for bad in [
            "",
            ".",
            "k1000",
            "k1000.",
            "x.y",
            "k1000.!!!",
            &token[..token.len() - 2],
        ] {
            assert!(!keys.verify(bad, &artifact(1)), "{bad:?}");
        }
    }

    #[test]
    fn a_new_key_signs_only_after_its_activation_delay_and_old_tokens_still_verify() {
        let (old_id, old_bytes) = new_key(1_000);
        let (new_id, new_bytes) = new_key(5_000);
        let old = KeySet::from_data(&BTreeMap::from([(
            old_id.clone(),
            ByteString(old_bytes.clone()),
        )]));
        let old_token = old.sign(2_000, &artifact(1)).expect("token");
        let both = KeySet::from_data(&BTreeMap::from([
            (old_id.clone(), ByteString(old_bytes)),
            (new_id.clone(), ByteString(new_bytes)),
        ]));
        assert_eq!(both.signing_id(5_000), Some(old_id.as_str()));
        assert_eq!(both.signing_id(5_059), Some(old_id.as_str()));
        assert_eq!(both.signing_id(5_060), Some(new_id.as_str()));
        assert!(both.verify(&old_token, &artifact(1)));
        let new_token = both.sign(5_060, &artifact(1)).expect("token");
        assert_ne!(new_token, old_token);
        assert!(both.verify(&new_token, &artifact(1)));
        assert!(!old.verify(&new_token, &artifact(1)));
    }

    #[test]
    fn key_ids_are_strict() {
        assert_eq!(key_created("k12"), Some(12));
        for bad in ["k", "12", "k-1", "k1a", "K12", "k+1"] {
            assert_eq!(key_created(bad), None, "{bad}");
        }
        let data = BTreeMap::from([
            ("k1".to_owned(), ByteString(vec![0; 31])),
            ("note".to_owned(), ByteString(vec![0; 32])),
        ]);
        assert!(KeySet::from_data(&data).is_empty());
    }

    #[test]
    fn rotation_adds_at_max_age_and_drops_after_the_overlap() {
        let policy = RotationPolicy {
            max_age: Duration::from_secs(1_000),
            overlap: Duration::from_secs(100),
        };
        let key = |id: &str, at: i64| (id.to_owned(), at);
        assert_eq!(plan_rotation(&[], 7, policy), vec![Rotation::Add(7)]);
        assert!(plan_rotation(&[key("k0", 0)], 999, policy).is_empty());
        assert_eq!(
            plan_rotation(&[key("k0", 0)], 1_000, policy),
            vec![Rotation::Add(1_000)]
        );
        // The newer key signs at 1_060; the old one goes 100 s later, not before.
        let both = [key("k0", 0), key("k1000", 1_000)];
        assert!(plan_rotation(&both, 1_159, policy).is_empty());
        assert_eq!(
            plan_rotation(&both, 1_160, policy),
            vec![Rotation::Drop("k0".into())]
        );
    }
}
