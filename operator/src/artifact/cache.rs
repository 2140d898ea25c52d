//! A bounded, least-recently-used cache of built artifacts, keyed by Program uid, generation and
//! transform-chain fingerprint.
//!
//! The uid (not the name) is part of the key so a Program deleted and re-created under the same
//! name never sees the old object's bytes; the chain fingerprint, so a changed transform never
//! serves bytes built with the old one.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};

use super::built::Built;

/// Identity of one artifact: one generation of one Program object, through one transform chain.
#[derive(Clone, Debug, Hash, PartialEq, Eq)]
pub struct CacheKey {
    pub uid: String,
    pub generation: i64,
    /// The chain's fingerprint (`""`: no transform).
    pub chain: String,
}

struct Slot {
    artifact: Arc<Built>,
    tick: u64,
}

#[derive(Default)]
struct Inner {
    slots: HashMap<CacheKey, Slot>,
    /// Access order: oldest tick first.
    order: BTreeMap<u64, CacheKey>,
    tick: u64,
    bytes: u64,
}

/// LRU cache bounded by the total size of the artifacts it holds.
pub struct ArtifactCache {
    inner: Mutex<Inner>,
    capacity_bytes: u64,
}

impl ArtifactCache {
    pub fn new(capacity_bytes: u64) -> Self {
        Self {
            inner: Mutex::new(Inner::default()),
            capacity_bytes,
        }
    }

    /// The artifact for `key`, marking it recently used.
    pub fn get(&self, key: &CacheKey) -> Option<Arc<Built>> {
        let mut inner = self.lock();
        inner.tick += 1;
        let tick = inner.tick;
        let slot = inner.slots.get_mut(key)?;
        let old = std::mem::replace(&mut slot.tick, tick);
        let artifact = slot.artifact.clone();
        inner.order.remove(&old);
        inner.order.insert(tick, key.clone());
        Some(artifact)
    }

    /// Store an artifact, evicting the least recently used ones beyond capacity, and the same
    /// generation built through another chain (only the newest chain is served). An artifact
    /// larger than the whole capacity is not stored (it is still served, built per request).
    pub fn insert(&self, key: CacheKey, artifact: Arc<Built>) {
        let size = artifact.size();
        if size > self.capacity_bytes {
            return;
        }
        let mut inner = self.lock();
        let other_chains: Vec<CacheKey> = inner
            .slots
            .keys()
            .filter(|k| k.uid == key.uid && k.generation == key.generation && k.chain != key.chain)
            .cloned()
            .collect();
        for old in other_chains {
            if let Some(slot) = inner.slots.remove(&old) {
                inner.order.remove(&slot.tick);
                inner.bytes -= slot.artifact.size();
            }
        }
        inner.tick += 1;
        let tick = inner.tick;
        if let Some(old) = inner.slots.insert(key.clone(), Slot { artifact, tick }) {
            inner.order.remove(&old.tick);
            inner.bytes -= old.artifact.size();
        }
        inner.order.insert(tick, key);
        inner.bytes += size;
        while inner.bytes > self.capacity_bytes {
            let Some((_, oldest)) = inner.order.pop_first() else {
                break;
            };
            if let Some(slot) = inner.slots.remove(&oldest) {
                inner.bytes -= slot.artifact.size();
            }
        }
    }

    /// Drop every generation of one Program object.
    pub fn remove_uid(&self, uid: &str) {
        self.remove_where(|k| k.uid == uid);
    }

    /// Drop the generations of one Program object other than `generation`.
    pub fn retain_generation(&self, uid: &str, generation: i64) {
        self.remove_where(|k| k.uid == uid && k.generation != generation);
    }

    fn remove_where(&self, doomed: impl Fn(&CacheKey) -> bool) {
        let mut inner = self.lock();
        let keys: Vec<CacheKey> = inner.slots.keys().filter(|k| doomed(k)).cloned().collect();
        for key in keys {
            if let Some(slot) = inner.slots.remove(&key) {
                inner.order.remove(&slot.tick);
                inner.bytes -= slot.artifact.size();
            }
        }
    }

    /// Total bytes held.
    pub fn bytes(&self) -> u64 {
        self.lock().bytes
    }

    /// Number of artifacts held.
    pub fn len(&self) -> usize {
        self.lock().slots.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        // A panic while holding the lock cannot leave the maps inconsistent in a way that
        // matters more than losing the cache, so recover the guard instead of propagating.
        self.inner
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

#[cfg(test)]
mod tests {
    use bytes::Bytes;

    use super::*;
    use crate::artifact::Artifact;

    fn artifact(len: usize) -> Arc<Built> {
        Arc::new(Built {
            artifact: Artifact {
                bytes: Bytes::from(vec![0u8; len]),
                digest: format!("sha256:{len}"),
            },
            chain: Default::default(),
        })
    }

    fn key(uid: &str, generation: i64) -> CacheKey {
        CacheKey {
            uid: uid.into(),
            generation,
            chain: String::new(),
        }
    }

    #[test]
    fn a_new_chain_replaces_the_old_one_for_the_same_generation() {
        let cache = ArtifactCache::new(1000);
        let with = |chain: &str| CacheKey {
            chain: chain.into(),
            ..key("a", 1)
        };
        cache.insert(with(""), artifact(10));
        cache.insert(key("a", 2), artifact(20));
        cache.insert(with("sha256:x"), artifact(30));
        assert!(cache.get(&with("")).is_none());
        assert!(cache.get(&with("sha256:x")).is_some());
        assert!(cache.get(&key("a", 2)).is_some());
        assert_eq!(cache.bytes(), 50);
    }

    #[test]
    fn evicts_least_recently_used_beyond_capacity() {
        let cache = ArtifactCache::new(100);
        cache.insert(key("a", 1), artifact(40));
        cache.insert(key("b", 1), artifact(40));
        assert!(cache.get(&key("a", 1)).is_some()); // a is now newer than b
        cache.insert(key("c", 1), artifact(40));
        assert!(cache.get(&key("b", 1)).is_none());
        assert!(cache.get(&key("a", 1)).is_some());
        assert!(cache.get(&key("c", 1)).is_some());
        assert_eq!(cache.bytes(), 80);
    }

    #[test]
    fn oversized_artifacts_are_not_stored() {
        let cache = ArtifactCache::new(10);
        cache.insert(key("a", 1), artifact(11));
        assert!(cache.is_empty());
        assert_eq!(cache.bytes(), 0);
    }

    #[test]
    fn replacing_and_removing_keep_byte_count_exact() {
        let cache = ArtifactCache::new(1000);
        cache.insert(key("a", 1), artifact(10));
        cache.insert(key("a", 1), artifact(30));
        cache.insert(key("a", 2), artifact(5));
        cache.insert(key("b", 1), artifact(7));
        assert_eq!(cache.bytes(), 42);
        cache.retain_generation("a", 2);
        assert_eq!(cache.bytes(), 12);
        cache.remove_uid("a");
        assert_eq!(cache.bytes(), 7);
        assert_eq!(cache.len(), 1);
    }
}
