//! The `--max-operations-in-flight` slots and the Updates queued for one.

use std::collections::HashMap;
use std::sync::{Arc, PoisonError};

use kube::runtime::reflector::ObjectRef;
use pko_api::update::Update;
use tokio_util::sync::CancellationToken;

use super::UpdateContext;

/// One of the `--max-operations-in-flight` slots, held by one Update's operation; freed (and
/// the waiting Updates woken) on drop, however the operation ends.
pub(super) struct Slot {
    ctx: Arc<UpdateContext>,
    uid: String,
    pub(super) token: CancellationToken,
}

impl Drop for Slot {
    fn drop(&mut self) {
        self.ctx.release(&self.uid);
    }
}

impl UpdateContext {
    fn queued(&self) -> std::sync::MutexGuard<'_, HashMap<String, ObjectRef<Update>>> {
        self.queued.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// An operation slot for `update`; `None` (and `update` queued for a wake-up) when all are
    /// taken.
    pub(super) fn acquire(self: &Arc<Self>, uid: &str, update: &Update) -> Option<Slot> {
        let mut running = self.running();
        if running.len() >= self.max_in_flight {
            // Queued while `running` is held: a release, which takes `running` first, cannot
            // miss it.
            self.queued()
                .insert(uid.to_owned(), ObjectRef::from_obj(update));
            return None;
        }
        let token = CancellationToken::new();
        running.insert(uid.to_owned(), token.clone());
        drop(running);
        self.queued().remove(uid);
        Some(Slot {
            ctx: self.clone(),
            uid: uid.to_owned(),
            token,
        })
    }

    fn release(&self, uid: &str) {
        self.running().remove(uid);
        // Every waiting Update is looked at again: the first to reconcile takes the slot, the
        // others queue again (an Update deleted meanwhile drops out here).
        let waiting: Vec<ObjectRef<Update>> = self.queued().drain().map(|(_, r)| r).collect();
        for update in waiting {
            let _ = self.wake.unbounded_send(update);
        }
    }
}
