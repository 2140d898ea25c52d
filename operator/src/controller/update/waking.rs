//! Updates whose workspace `spec.idle` stopped: the Workspace controller is asked to start it
//! (again now and then, so a lost request only delays it), and the time from the Update first
//! finding it stopped to its operation running is observed as the wake-up latency
//! (`pko_workspace_wake_duration_seconds`). The start times are this process's only: an Update
//! an operator restart finds waiting is observed from the restart.

use std::collections::HashMap;
use std::sync::{Mutex, PoisonError};
use std::time::{Duration, Instant};

use kube::runtime::controller::Action;

use crate::metrics::Metrics;

/// A waiting Update asks again this often (the Workspace watch brings it back sooner, once its
/// workspace is ready).
pub(super) const WAKE_RECHECK: Duration = Duration::from_secs(30);

/// Update uid → when it first found its workspace stopped.
#[derive(Default)]
pub(super) struct Waking {
    since: Mutex<HashMap<String, Instant>>,
}

impl Waking {
    fn map(&self) -> std::sync::MutexGuard<'_, HashMap<String, Instant>> {
        self.since.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Update `uid` found its workspace stopped (the first time counts).
    pub(super) fn note(&self, uid: &str, now: Instant) {
        self.map().entry(uid.to_owned()).or_insert(now);
    }

    /// Whether Update `uid` waits for its workspace to wake.
    pub(super) fn waits(&self, uid: &str) -> bool {
        self.map().contains_key(uid)
    }

    /// What a waiting Update does next: asks again after [`WAKE_RECHECK`] while its workspace
    /// wakes, else waits for the Workspace watch.
    pub(super) fn waiting_action(&self, uid: &str) -> Action {
        if self.waits(uid) {
            Action::requeue(WAKE_RECHECK)
        } else {
            Action::await_change()
        }
    }

    /// Update `uid`'s operation starts: how long it waited for the wake, if it did.
    pub(super) fn waited(&self, uid: &str, now: Instant) -> Option<Duration> {
        self.map()
            .remove(uid)
            .map(|since| now.saturating_duration_since(since))
    }

    /// Update `uid`'s operation starts: a wait for the wake goes into the wake-up histogram.
    pub(super) fn started(&self, uid: &str, now: Instant, metrics: &Metrics) {
        if let Some(waited) = self.waited(uid, now) {
            metrics
                .workspace_wake_duration
                .observe(waited.as_secs_f64());
        }
    }

    /// Update `uid` will not start (finished, deleted).
    pub(super) fn forget(&self, uid: &str) {
        self.map().remove(uid);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_wait_runs_from_the_first_sight_of_the_stopped_workspace() {
        let waking = Waking::default();
        let t0 = Instant::now();
        assert!(!waking.waits("u"));
        waking.note("u", t0);
        waking.note("u", t0 + Duration::from_secs(5));
        assert!(waking.waits("u"));
        assert_eq!(waking.waiting_action("u"), Action::requeue(WAKE_RECHECK));
        assert_eq!(
            waking.waited("u", t0 + Duration::from_secs(12)),
            Some(Duration::from_secs(12))
        );
        assert!(!waking.waits("u"));
        assert_eq!(waking.waiting_action("u"), Action::await_change());
        // A warm start waited for nothing.
        assert_eq!(waking.waited("u", t0), None);
        waking.note("v", t0);
        waking.forget("v");
        assert_eq!(waking.waited("v", t0), None);
        // The histogram gets the wait of a woken start only.
        let metrics = Metrics::new();
        waking.note("w", t0);
        waking.started("w", t0 + Duration::from_secs(3), &metrics);
        waking.started("x", t0, &metrics);
        let text = metrics.encode().expect("encode");
        assert!(
            text.contains("pko_workspace_wake_duration_seconds_count 1"),
            "{text}"
        );
    }
}
