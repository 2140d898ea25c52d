//! A small cache of review answers: each entry lives for its own TTL (an allowed answer longer
//! than a refusal, as PKO's agent keeps them), and the cache holds at most a fixed number of
//! entries, so a caller presenting endless distinct tokens costs the agent bounded memory.

use std::collections::HashMap;
use std::hash::Hash;
use std::sync::{Mutex, PoisonError};
use std::time::{Duration, Instant};

/// Entries kept at most; past it the entry closest to expiry goes first.
pub(crate) const MAX_ENTRIES: usize = 1024;

pub(crate) struct TtlCache<K, V> {
    entries: Mutex<HashMap<K, (Instant, V)>>,
    capacity: usize,
}

impl<K: Eq + Hash + Clone, V: Clone> TtlCache<K, V> {
    pub(crate) fn new(capacity: usize) -> Self {
        Self {
            entries: Mutex::new(HashMap::new()),
            capacity: capacity.max(1),
        }
    }

    /// The value of `key`, unless it expired by `now`.
    pub(crate) fn get(&self, key: &K, now: Instant) -> Option<V> {
        let mut entries = self.entries.lock().unwrap_or_else(PoisonError::into_inner);
        match entries.get(key) {
            Some((expires, value)) if *expires > now => Some(value.clone()),
            Some(_) => {
                entries.remove(key);
                None
            }
            None => None,
        }
    }

    /// Keeps `value` until `now + ttl`, making room first when the cache is full.
    pub(crate) fn put(&self, key: K, value: V, ttl: Duration, now: Instant) {
        let mut entries = self.entries.lock().unwrap_or_else(PoisonError::into_inner);
        if !entries.contains_key(&key) && entries.len() >= self.capacity {
            entries.retain(|_, (expires, _)| *expires > now);
            if entries.len() >= self.capacity
                && let Some(soonest) = entries
                    .iter()
                    .min_by_key(|(_, (expires, _))| *expires)
                    .map(|(k, _)| k.clone())
            {
                entries.remove(&soonest);
            }
        }
        entries.insert(key, (now + ttl, value));
    }

    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        self.entries
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn entries_expire_and_the_cache_stays_bounded() {
        let cache = TtlCache::new(3);
        let t0 = Instant::now();
        cache.put("a", 1, Duration::from_secs(10), t0);
        cache.put("b", 2, Duration::from_secs(1), t0);
        assert_eq!(cache.get(&"a", t0), Some(1));
        assert_eq!(cache.get(&"b", t0 + Duration::from_secs(2)), None);
        cache.put("b", 2, Duration::from_secs(5), t0);
        cache.put("c", 3, Duration::from_secs(20), t0);
        // Full: the entry closest to its end goes.
        cache.put("d", 4, Duration::from_secs(30), t0);
        assert_eq!(cache.len(), 3);
        assert_eq!(cache.get(&"b", t0), None);
        assert_eq!(cache.get(&"d", t0), Some(4));
        // Expired entries make room before live ones are evicted.
        cache.put("e", 5, Duration::from_secs(1), t0 + Duration::from_secs(15));
        assert_eq!(cache.get(&"c", t0 + Duration::from_secs(15)), Some(3));
        assert_eq!(cache.get(&"d", t0 + Duration::from_secs(15)), Some(4));
        for i in 0..100 {
            cache.put("x".repeat(i % 7 + 1).leak(), i, Duration::from_secs(60), t0);
        }
        assert!(cache.len() <= 3);
    }
}
