//! A first-in, first-out work queue of object keys, for controllers whose objects must be served
//! in the order their changes arrived.
//!
//! kube-runtime's scheduler hands out requests that are due at the same instant in no set order
//! (its delay queue keeps already-due entries on a stack), so under a backlog the first Program
//! created could wait for every later one. Here a key is served in arrival order, is queued at
//! most once, and never runs twice at once: a key triggered while it runs goes to the back of the
//! queue when that run ends.

use std::collections::{HashSet, VecDeque};
use std::hash::Hash;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use tokio::sync::Notify;

use crate::runtime_metrics::{ControllerProbe, ObjectKey};

/// The queue's bookkeeping, free of any runtime: every decision is made here.
#[derive(Debug)]
struct State<K> {
    /// Keys waiting, oldest first.
    ready: VecDeque<K>,
    /// The keys in `ready` (a key is queued once however often it is triggered).
    queued: HashSet<K>,
    /// Keys handed to a worker and not done yet.
    running: HashSet<K>,
    /// Running keys triggered again: queued when their run ends.
    dirty: HashSet<K>,
    closed: bool,
}

impl<K: Clone + Eq + Hash> State<K> {
    fn new() -> Self {
        Self {
            ready: VecDeque::new(),
            queued: HashSet::new(),
            running: HashSet::new(),
            dirty: HashSet::new(),
            closed: false,
        }
    }

    /// Returns whether a worker should be woken.
    fn add(&mut self, key: K) -> bool {
        if self.closed || self.queued.contains(&key) {
            return false;
        }
        if self.running.contains(&key) {
            self.dirty.insert(key);
            return false;
        }
        self.queued.insert(key.clone());
        self.ready.push_back(key);
        true
    }

    fn take(&mut self) -> Option<K> {
        let key = self.ready.pop_front()?;
        self.queued.remove(&key);
        self.running.insert(key.clone());
        Some(key)
    }

    /// Returns whether the key was queued again (a worker should be woken).
    fn done(&mut self, key: &K) -> bool {
        self.running.remove(key);
        if self.dirty.remove(key) {
            return self.add(key.clone());
        }
        false
    }
}

/// A FIFO work queue shared by a controller's feeders and workers. Cheap to clone.
#[derive(Clone)]
pub struct WorkQueue<K> {
    state: Arc<Mutex<State<K>>>,
    wake: Arc<Notify>,
    /// Sees every add and delayed add, for the work-queue series.
    observer: Option<Observer<K>>,
}

/// The controller's series and how a key names its object.
struct Observer<K> {
    probe: ControllerProbe,
    key: fn(&K) -> ObjectKey,
}

impl<K> Clone for Observer<K> {
    fn clone(&self) -> Self {
        Self {
            probe: self.probe.clone(),
            key: self.key,
        }
    }
}

impl<K: Clone + Eq + Hash + Send + 'static> Default for WorkQueue<K> {
    fn default() -> Self {
        Self::new()
    }
}

impl<K: Clone + Eq + Hash + Send + 'static> WorkQueue<K> {
    pub fn new() -> Self {
        Self {
            state: Arc::new(Mutex::new(State::new())),
            wake: Arc::new(Notify::new()),
            observer: None,
        }
    }

    /// A queue whose adds and delayed adds `probe` sees (`key` names a key's object); the
    /// workers report what they take to the same probe.
    pub fn observed(probe: ControllerProbe, key: fn(&K) -> ObjectKey) -> Self {
        Self {
            observer: Some(Observer { probe, key }),
            ..Self::new()
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State<K>> {
        // The state stays consistent even if a holder panicked (no method can panic midway).
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Queues `key` at the back, unless it is queued already.
    pub fn add(&self, key: K) {
        let mut state = self.lock();
        if state.closed {
            return;
        }
        if let Some(observer) = &self.observer {
            observer.probe.trigger((observer.key)(&key));
        }
        let wake = state.add(key);
        drop(state);
        if wake {
            self.wake.notify_one();
        }
    }

    /// Queues `key` after `delay` (a requeue, or a retry after a failure).
    pub fn add_after(&self, key: K, delay: Duration) {
        if let Some(observer) = &self.observer {
            observer.probe.retry();
        }
        let queue = self.clone();
        tokio::spawn(async move {
            tokio::time::sleep(delay).await;
            queue.add(key);
        });
    }

    /// The oldest queued key, waiting for one; `None` once the queue is shut down. The key
    /// counts as running until [`Self::done`].
    pub async fn next(&self) -> Option<K> {
        loop {
            // Registered before looking, so an `add` in between still wakes this worker.
            let woken = self.wake.notified();
            {
                let mut state = self.lock();
                if state.closed {
                    return None;
                }
                if let Some(key) = state.take() {
                    let more = !state.ready.is_empty();
                    drop(state);
                    // Pass the wake-up on: one `add` may have raced with several takers.
                    if more {
                        self.wake.notify_one();
                    }
                    return Some(key);
                }
            }
            woken.await;
        }
    }

    /// Ends the run of `key`; a trigger that came while it ran queues it again.
    pub fn done(&self, key: &K) {
        if self.lock().done(key) {
            self.wake.notify_one();
        }
    }

    /// Keys waiting now.
    pub fn len(&self) -> usize {
        self.lock().ready.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Stops handing out keys: every [`Self::next`] returns `None` (runs in progress finish).
    pub fn shut_down(&self) {
        self.lock().closed = true;
        self.wake.notify_waiters();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_come_out_in_arrival_order_once_each() {
        let mut state = State::new();
        for key in [3, 1, 2, 1, 3] {
            state.add(key);
        }
        let order: Vec<i32> = std::iter::from_fn(|| state.take()).collect();
        assert_eq!(order, [3, 1, 2]);
    }

    #[test]
    fn a_key_triggered_while_it_runs_runs_again_after_later_keys() {
        let mut state = State::new();
        state.add("a");
        assert_eq!(state.take(), Some("a"));
        // Triggered while running: not handed out twice at once.
        assert!(!state.add("a"));
        state.add("b");
        assert_eq!(state.take(), Some("b"));
        assert_eq!(state.take(), None);
        assert!(state.done(&"a"));
        assert_eq!(state.take(), Some("a"));
        // Done without a new trigger: not queued again.
        assert!(!state.done(&"a"));
        assert_eq!(state.take(), None);
    }

    #[test]
    fn a_closed_queue_takes_nothing_new() {
        let mut state = State::new();
        state.closed = true;
        assert!(!state.add(1));
        assert_eq!(state.take(), None);
    }

    #[tokio::test]
    async fn workers_share_the_queue_and_stop_on_shut_down() {
        let queue = WorkQueue::new();
        let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
        let workers: Vec<_> = (0..3)
            .map(|_| {
                let (queue, tx) = (queue.clone(), tx.clone());
                tokio::spawn(async move {
                    while let Some(key) = queue.next().await {
                        let _ = tx.send(key);
                        queue.done(&key);
                    }
                })
            })
            .collect();
        for key in 0..100 {
            queue.add(key);
        }
        let mut seen = Vec::new();
        while seen.len() < 100 {
            seen.push(rx.recv().await.expect("a worker sends each key"));
        }
        seen.sort_unstable();
        assert_eq!(seen, (0..100).collect::<Vec<_>>());
        queue.shut_down();
        for worker in workers {
            worker.await.expect("worker ends");
        }
    }
}
