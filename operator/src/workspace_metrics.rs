//! `workspaces_idle`: how many Workspaces `spec.idle` has stopped (`Ready=False` with reason
//! `Idle`), fed by a Workspace watch on every replica, as the Stack gauges are
//! (`stack_metrics.rs`), so any replica's `/metrics` answers. A count without labels: only the
//! names of the idle Workspaces are kept, to count each once.

use std::collections::HashSet;

use futures::TryStreamExt;
use kube::Api;
use kube::api::DynamicObject;
use kube::runtime::watcher;
use serde_json::Value;
use tracing::warn;

use crate::controller::keys::IDLE;
use crate::metrics::Metrics;

/// Whether a Workspace's (untyped) `status` says its pod is stopped by `spec.idle`.
pub fn idle(status: Option<&Value>) -> bool {
    status
        .and_then(|s| s.get("conditions"))
        .and_then(Value::as_array)
        .is_some_and(|conditions| {
            conditions.iter().any(|c| {
                c.get("type").and_then(Value::as_str) == Some("Ready")
                    && c.get("status").and_then(Value::as_str) == Some("False")
                    && c.get("reason").and_then(Value::as_str) == Some(IDLE)
            })
        })
}

/// `(namespace, name)` of a Workspace.
type Key = (String, String);

/// The idle Workspaces, and those seen idle during a relist.
struct IdleCount {
    metrics: Metrics,
    idle: HashSet<Key>,
    relisting: Option<HashSet<Key>>,
}

fn key(object: &DynamicObject) -> Option<Key> {
    Some((
        object.metadata.namespace.clone()?,
        object.metadata.name.clone()?,
    ))
}

impl IdleCount {
    fn new(metrics: Metrics) -> Self {
        Self {
            metrics,
            idle: HashSet::new(),
            relisting: None,
        }
    }

    fn set(&mut self, object: &DynamicObject) {
        let Some(key) = key(object) else {
            return;
        };
        if idle(object.data.get("status")) {
            self.idle.insert(key);
        } else {
            self.idle.remove(&key);
        }
    }

    fn observe(&mut self, event: &watcher::Event<DynamicObject>) {
        match event {
            watcher::Event::Init => self.relisting = Some(HashSet::new()),
            watcher::Event::InitApply(object) => {
                if let (Some(seen), Some(key)) = (self.relisting.as_mut(), key(object))
                    && idle(object.data.get("status"))
                {
                    seen.insert(key);
                }
            }
            // Workspaces deleted or woken while the watch was down are absent from the relist.
            watcher::Event::InitDone => {
                if let Some(seen) = self.relisting.take() {
                    self.idle = seen;
                }
            }
            watcher::Event::Apply(object) => self.set(object),
            watcher::Event::Delete(object) => {
                if let Some(key) = key(object) {
                    self.idle.remove(&key);
                }
            }
        }
        self.metrics
            .workspaces_idle
            .set(i64::try_from(self.idle.len()).unwrap_or(i64::MAX));
    }
}

/// Watches Workspaces through `apis` (one per watched namespace, or one cluster-wide) and keeps
/// `workspaces_idle` current (the caller spawns it).
pub async fn watch(apis: Vec<Api<DynamicObject>>, metrics: Metrics) {
    let mut count = IdleCount::new(metrics);
    let events = crate::scope::merged_watch(
        apis,
        watcher::Config::default().any_semantic(),
        crate::scope::Known::Keep,
    );
    let mut events = std::pin::pin!(events);
    loop {
        match events.try_next().await {
            Ok(Some(event)) => count.observe(&event),
            Ok(None) => break,
            Err(err) => warn!(error = %err, "workspace watch failed; retrying"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kube::api::ObjectMeta;
    use serde_json::json;

    fn workspace(name: &str, reason: &str, status: &str) -> DynamicObject {
        DynamicObject {
            types: None,
            metadata: ObjectMeta {
                namespace: Some("ns".into()),
                name: Some(name.into()),
                ..ObjectMeta::default()
            },
            data: json!({"status": {"conditions": [
                {"type": "Ready", "status": status, "reason": reason}]}}),
        }
    }

    #[test]
    fn idle_is_ready_false_with_reason_idle() {
        assert!(idle(workspace("a", "Idle", "False").data.get("status")));
        assert!(!idle(
            workspace("a", "Succeeded", "True").data.get("status")
        ));
        assert!(!idle(
            workspace("a", "WaitingForReplicas", "False")
                .data
                .get("status")
        ));
        assert!(!idle(None));
    }

    #[test]
    fn the_gauge_counts_idle_workspaces_through_events_and_relists() {
        let metrics = Metrics::new();
        let mut count = IdleCount::new(metrics.clone());
        count.observe(&watcher::Event::Init);
        count.observe(&watcher::Event::InitApply(workspace("a", "Idle", "False")));
        count.observe(&watcher::Event::InitApply(workspace("b", "Idle", "False")));
        count.observe(&watcher::Event::InitApply(workspace(
            "c",
            "Succeeded",
            "True",
        )));
        count.observe(&watcher::Event::InitDone);
        assert_eq!(metrics.workspaces_idle.get(), 2);
        // Woken, the same status again, deleted.
        count.observe(&watcher::Event::Apply(workspace(
            "a",
            "WaitingForReplicas",
            "False",
        )));
        count.observe(&watcher::Event::Apply(workspace("b", "Idle", "False")));
        assert_eq!(metrics.workspaces_idle.get(), 1);
        count.observe(&watcher::Event::Apply(workspace("c", "Idle", "False")));
        count.observe(&watcher::Event::Delete(workspace("b", "Idle", "False")));
        assert_eq!(metrics.workspaces_idle.get(), 1);
        // A relist without "c" (deleted while the watch was down) drops it.
        count.observe(&watcher::Event::Init);
        count.observe(&watcher::Event::InitApply(workspace("a", "Idle", "False")));
        count.observe(&watcher::Event::InitDone);
        assert_eq!(metrics.workspaces_idle.get(), 1);
        let text = metrics.encode().expect("encode");
        assert!(text.contains("workspaces_idle 1"), "{text}");
    }
}
