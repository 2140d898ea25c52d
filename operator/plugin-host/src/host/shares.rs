//! Each namespace's share of a pool of slots: a namespace's calls (its Programs' transforms,
//! its ProgramTransforms' checks) run at most `max_concurrent_calls_per_namespace` at once, and
//! its module loads at most their own share of the load slots, so one tenant's slow plugins,
//! slow module servers or many Programs never hold every slot and starve another tenant.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError, Weak};

use tokio::sync::Semaphore;

/// A namespace's share when none is configured: half of the slots, at least one (4 → 2).
pub fn default_share(total: u32) -> u32 {
    (total / 2).max(1)
}

/// The share applied: at least one call, never more than all the slots.
pub fn share(total: u32, configured: u32) -> u32 {
    configured.clamp(1, total.max(1))
}

/// One semaphore per namespace with calls running or waiting; a namespace's is dropped with
/// its last call, so the map holds only the namespaces that call right now.
pub struct Shares {
    per_namespace: u32,
    namespaces: Mutex<HashMap<String, Weak<Semaphore>>>,
}

impl Shares {
    pub fn new(per_namespace: u32) -> Self {
        Self {
            per_namespace: per_namespace.max(1),
            namespaces: Mutex::new(HashMap::new()),
        }
    }

    pub fn per_namespace(&self) -> u32 {
        self.per_namespace
    }

    /// The semaphore of `namespace`'s share (its permits are held by what runs).
    pub fn of(&self, namespace: &str) -> Arc<Semaphore> {
        let mut namespaces = self
            .namespaces
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        if let Some(semaphore) = namespaces.get(namespace).and_then(Weak::upgrade) {
            return semaphore;
        }
        namespaces.retain(|_, w| w.strong_count() > 0);
        let semaphore = Arc::new(Semaphore::new(self.per_namespace as usize));
        namespaces.insert(namespace.to_owned(), Arc::downgrade(&semaphore));
        semaphore
    }

    #[cfg(test)]
    fn tracked(&self) -> usize {
        let namespaces = self
            .namespaces
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        namespaces.values().filter(|w| w.strong_count() > 0).count()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_namespace_gets_half_of_the_slots_unless_told_otherwise() {
        assert_eq!(default_share(4), 2);
        assert_eq!(default_share(1), 1);
        assert_eq!(default_share(0), 1);
        assert_eq!(default_share(9), 4);
        assert_eq!(share(4, 3), 3);
        assert_eq!(share(4, 10), 4);
        assert_eq!(share(4, 0), 1);
    }

    #[test]
    fn a_namespace_past_its_share_waits_while_another_runs() {
        let shares = Shares::new(1);
        let a = shares.of("team-a");
        let held = a.clone().try_acquire_owned().expect("a's first call");
        assert!(
            shares.of("team-a").try_acquire_owned().is_err(),
            "a's second call waits"
        );
        let b = shares
            .of("team-b")
            .try_acquire_owned()
            .expect("b's call runs");
        drop((held, b, a));
        // Nothing held: nothing tracked, and the share is whole again.
        assert_eq!(shares.tracked(), 0);
        assert!(shares.of("team-a").try_acquire_owned().is_ok());
    }
}
