//! The `--max-operations-in-flight` slots, each namespace's share of them, and the Updates
//! queued for one.
//!
//! A namespace holds at most `--max-operations-in-flight-per-namespace` of the slots, so one
//! tenant's Updates that sleep (a program waiting on something, a slow provider) can never
//! queue another tenant's: the slots left over are always there for the other namespaces.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use futures::channel::mpsc::UnboundedSender;
use kube::runtime::reflector::ObjectRef;
use pko_api::update::Update;
use tokio_util::sync::CancellationToken;

/// How many operations may run at once, in all and per namespace.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SlotLimits {
    /// `--max-operations-in-flight` (at least 1).
    pub total: usize,
    /// `--max-operations-in-flight-per-namespace` (at least 1, at most `total`).
    pub per_namespace: usize,
}

impl SlotLimits {
    /// `total` slots (at least one), of which a namespace holds `per_namespace` at most: a
    /// quarter of them when not given ([`default_share`]), never more than all of them.
    pub fn new(total: usize, per_namespace: Option<usize>) -> Self {
        let total = total.max(1);
        let per_namespace = per_namespace
            .unwrap_or_else(|| default_share(total))
            .clamp(1, total);
        Self {
            total,
            per_namespace,
        }
    }
}

/// A namespace's share when none is configured: a quarter of the slots, at least one (64 → 16).
fn default_share(total: usize) -> usize {
    (total / 4).max(1)
}

/// Whether an Update may take a slot.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Admission {
    Granted,
    /// Every slot is taken.
    AllTaken,
    /// Its namespace holds its whole share.
    ShareTaken,
}

/// The slot decision: `in_flight` operations run, `in_namespace` of them in the Update's own
/// namespace. The namespace share is checked first, so an Update that would wait for its
/// share anyway says so rather than blaming the other tenants; a share of every slot is no
/// share, and waiting then is for the total.
pub(super) fn admit(in_flight: usize, in_namespace: usize, limits: SlotLimits) -> Admission {
    let share_full = in_namespace >= limits.per_namespace;
    if share_full && limits.per_namespace < limits.total {
        Admission::ShareTaken
    } else if in_flight >= limits.total {
        Admission::AllTaken
    } else if share_full {
        Admission::ShareTaken
    } else {
        Admission::Granted
    }
}

/// An operation that runs in this process.
pub(super) struct Running {
    namespace: String,
    pub(super) token: CancellationToken,
}

/// An Update waiting for a slot, and the controller that reconciles it when one frees.
struct Waiting {
    update: ObjectRef<Update>,
    wake: UnboundedSender<ObjectRef<Update>>,
}

/// The slots of one operator: shared by the Update controllers of every namespace it watches
/// (a namespace-scoped install runs one per namespace), so the bounds hold across all of them.
pub struct OperationSlots {
    limits: SlotLimits,
    /// Updates whose operation runs in this process: uid → namespace and cancel token.
    running: Mutex<HashMap<String, Running>>,
    /// Updates waiting for a slot: uid → reference, woken when a slot frees.
    queued: Mutex<HashMap<String, Waiting>>,
}

impl std::fmt::Debug for OperationSlots {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("OperationSlots")
            .field("limits", &self.limits)
            .finish_non_exhaustive()
    }
}

impl OperationSlots {
    pub fn new(limits: SlotLimits) -> Self {
        Self {
            limits,
            running: Mutex::new(HashMap::new()),
            queued: Mutex::new(HashMap::new()),
        }
    }

    pub fn limits(&self) -> SlotLimits {
        self.limits
    }

    pub(super) fn running(&self) -> MutexGuard<'_, HashMap<String, Running>> {
        self.running.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn queued(&self) -> MutexGuard<'_, HashMap<String, Waiting>> {
        self.queued.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// An operation slot for `update` in `namespace`; else why not (and `update` queued, to be
    /// sent on `wake` when a slot frees).
    pub(super) fn acquire(
        self: &Arc<Self>,
        uid: &str,
        namespace: &str,
        update: &Update,
        wake: &UnboundedSender<ObjectRef<Update>>,
    ) -> Result<Slot, Admission> {
        let mut running = self.running();
        let in_namespace = running
            .values()
            .filter(|r| r.namespace == namespace)
            .count();
        match admit(running.len(), in_namespace, self.limits) {
            Admission::Granted => {}
            refused => {
                // Queued while `running` is held: a release, which takes `running` first,
                // cannot miss it.
                self.queued().insert(
                    uid.to_owned(),
                    Waiting {
                        update: ObjectRef::from_obj(update),
                        wake: wake.clone(),
                    },
                );
                return Err(refused);
            }
        }
        let token = CancellationToken::new();
        running.insert(
            uid.to_owned(),
            Running {
                namespace: namespace.to_owned(),
                token: token.clone(),
            },
        );
        drop(running);
        self.queued().remove(uid);
        Ok(Slot {
            slots: self.clone(),
            uid: uid.to_owned(),
            token,
        })
    }

    fn release(&self, uid: &str) {
        self.running().remove(uid);
        // Every waiting Update is looked at again: the first to reconcile takes the slot, the
        // others queue again (an Update deleted meanwhile drops out here).
        let waiting: Vec<Waiting> = self.queued().drain().map(|(_, w)| w).collect();
        for w in waiting {
            let _ = w.wake.unbounded_send(w.update);
        }
    }
}

/// One of the `--max-operations-in-flight` slots, held by one Update's operation; freed (and
/// the waiting Updates woken) on drop, however the operation ends.
pub(super) struct Slot {
    slots: Arc<OperationSlots>,
    uid: String,
    pub(super) token: CancellationToken,
}

impl Drop for Slot {
    fn drop(&mut self) {
        self.slots.release(&self.uid);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_namespace_gets_a_quarter_of_the_slots_unless_told_otherwise() {
        assert_eq!(SlotLimits::new(64, None).per_namespace, 16);
        assert_eq!(SlotLimits::new(4, None).per_namespace, 1);
        assert_eq!(SlotLimits::new(3, None).per_namespace, 1);
        assert_eq!(SlotLimits::new(1, None), SlotLimits::new(0, None));
        assert_eq!(SlotLimits::new(0, None).total, 1);
        assert_eq!(SlotLimits::new(64, Some(8)).per_namespace, 8);
        // Never more than all the slots, never none.
        assert_eq!(SlotLimits::new(8, Some(100)).per_namespace, 8);
        assert_eq!(SlotLimits::new(8, Some(0)).per_namespace, 1);
    }

    #[test]
    fn a_namespace_past_its_share_waits_while_others_still_start() {
        let limits = SlotLimits::new(64, None);
        assert_eq!(admit(0, 0, limits), Admission::Granted);
        assert_eq!(admit(15, 15, limits), Admission::Granted);
        // One tenant's 16 sleeping operations: its 17th waits, another tenant's starts.
        assert_eq!(admit(16, 16, limits), Admission::ShareTaken);
        assert_eq!(admit(16, 0, limits), Admission::Granted);
        // All taken by four full tenants: a fifth waits for the total.
        assert_eq!(admit(64, 0, limits), Admission::AllTaken);
        assert_eq!(admit(63, 15, limits), Admission::Granted);
        // Both full: the namespace's own share is what it waits for.
        assert_eq!(admit(64, 16, limits), Admission::ShareTaken);
    }

    #[test]
    fn a_share_of_every_slot_waits_for_the_total() {
        for limits in [SlotLimits::new(1, None), SlotLimits::new(8, Some(8))] {
            assert_eq!(admit(0, 0, limits), Admission::Granted);
            let all = limits.total;
            assert_eq!(admit(all, all, limits), Admission::AllTaken);
            assert_eq!(admit(all, 0, limits), Admission::AllTaken);
        }
    }
}
