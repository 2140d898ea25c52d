//! PKO's Stack gauges (`stacks_active`, `stacks_failing`, `stacks_reconciling`), fed by a Stack
//! watch on every replica.
//!
//! Every replica (not only the leader) runs this watch, like the Program watch behind
//! `programs_active`, so any replica's `/metrics` answers and a scrape of the Service never sees
//! zeros from a follower. Only the two flags per Stack are kept, not the objects, so the cost is a
//! watch connection and one small map entry per Stack. Unlike PKO, a deleted Stack's series are
//! removed (PKO sets them to 0 forever), and `stacks_reconciling` is actually registered.

use std::collections::HashSet;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use futures::TryStreamExt;
use kube::Api;
use kube::api::DynamicObject;
use kube::runtime::watcher;
use serde_json::Value;
use tracing::warn;

use crate::metrics::{Metrics, StackLabels};

/// What the gauges say about one Stack.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct StackFlags {
    /// `status.lastUpdate.state == "failed"`.
    pub failing: bool,
    /// A `Reconciling` condition with status `True`.
    pub reconciling: bool,
}

impl StackFlags {
    /// The flags of a Stack, read from its (untyped) `status`.
    pub fn of(status: Option<&Value>) -> Self {
        let Some(status) = status else {
            return Self::default();
        };
        let failing = status
            .pointer("/lastUpdate/state")
            .and_then(Value::as_str)
            .is_some_and(|state| state == "failed");
        let reconciling = status
            .get("conditions")
            .and_then(Value::as_array)
            .is_some_and(|conditions| {
                conditions.iter().any(|c| {
                    c.get("type").and_then(Value::as_str) == Some("Reconciling")
                        && c.get("status").and_then(Value::as_str) == Some("True")
                })
            });
        Self {
            failing,
            reconciling,
        }
    }
}

/// The gauges plus the set of Stacks they describe.
struct StackGauges {
    metrics: Metrics,
    known: HashSet<StackLabels>,
    /// Stacks seen during a relist, swapped into `known` when the relist ends.
    relisting: HashSet<StackLabels>,
}

impl StackGauges {
    fn set(&mut self, object: &DynamicObject, relist: bool) {
        let Some(labels) = labels_of(object) else {
            return;
        };
        let flags = StackFlags::of(object.data.get("status"));
        self.metrics
            .stacks_failing
            .get_or_create(&labels)
            .set(i64::from(flags.failing));
        self.metrics
            .stacks_reconciling
            .get_or_create(&labels)
            .set(i64::from(flags.reconciling));
        if relist {
            self.relisting.insert(labels.clone());
        }
        self.known.insert(labels);
    }

    fn remove(&mut self, labels: &StackLabels) {
        self.metrics.stacks_failing.remove(labels);
        self.metrics.stacks_reconciling.remove(labels);
        self.known.remove(labels);
    }

    fn observe(&mut self, event: &watcher::Event<DynamicObject>) {
        match event {
            watcher::Event::Init => self.relisting.clear(),
            watcher::Event::InitApply(object) => self.set(object, true),
            watcher::Event::InitDone => {
                // Stacks deleted while the watch was down are absent from the relist.
                let gone: Vec<StackLabels> =
                    self.known.difference(&self.relisting).cloned().collect();
                for labels in &gone {
                    self.remove(labels);
                }
                self.relisting.clear();
            }
            watcher::Event::Apply(object) => self.set(object, false),
            watcher::Event::Delete(object) => {
                if let Some(labels) = labels_of(object) {
                    self.remove(&labels);
                }
            }
        }
        self.metrics
            .stacks_active
            .set(i64::try_from(self.known.len()).unwrap_or(i64::MAX));
    }
}

fn labels_of(object: &DynamicObject) -> Option<StackLabels> {
    Some(StackLabels {
        namespace: object.metadata.namespace.clone()?,
        name: object.metadata.name.clone()?,
    })
}

/// Watch Stacks through `apis` (one per watched namespace, or one cluster-wide) and keep the gauges current. Returns the "initial list received"
/// flag (for `/readyz`) and the future that drives the watch; the caller spawns it.
pub fn watch(
    apis: Vec<Api<DynamicObject>>,
    metrics: Metrics,
) -> (Arc<AtomicBool>, impl std::future::Future<Output = ()>) {
    let synced = Arc::new(AtomicBool::new(false));
    let driver = {
        let synced = synced.clone();
        async move {
            let mut gauges = StackGauges {
                metrics,
                known: HashSet::new(),
                relisting: HashSet::new(),
            };
            let events = crate::scope::merged_watch(
                apis,
                watcher::Config::default().any_semantic(),
                crate::scope::Known::Keep,
            );
            let mut events = std::pin::pin!(events);
            loop {
                match events.try_next().await {
                    Ok(Some(event)) => {
                        gauges.observe(&event);
                        if matches!(event, watcher::Event::InitDone) {
                            synced.store(true, Ordering::Release);
                        }
                    }
                    Ok(None) => break,
                    Err(err) => warn!(error = %err, "stack watch failed; retrying"),
                }
            }
        }
    };
    (synced, driver)
}

#[cfg(test)]
mod tests {
    use super::*;
    use kube::api::ObjectMeta;
    use serde_json::json;

    fn stack(namespace: &str, name: &str, status: Value) -> DynamicObject {
        DynamicObject {
            types: None,
            metadata: ObjectMeta {
                namespace: Some(namespace.into()),
                name: Some(name.into()),
                ..ObjectMeta::default()
            },
            data: json!({ "status": status }),
        }
    }

    fn gauge(
        family: &prometheus_client::metrics::family::Family<
            StackLabels,
            prometheus_client::metrics::gauge::Gauge,
        >,
        ns: &str,
        name: &str,
    ) -> Option<i64> {
        family
            .get(&StackLabels {
                namespace: ns.into(),
                name: name.into(),
            })
            .map(|g| g.get())
    }

    #[test]
    fn flags_follow_pko() {
        assert_eq!(StackFlags::of(None), StackFlags::default());
        let failed = json!({"lastUpdate": {"state": "failed"}});
        assert!(StackFlags::of(Some(&failed)).failing);
        let ok = json!({"lastUpdate": {"state": "succeeded"},
            "conditions": [{"type": "Ready", "status": "True"}]});
        assert_eq!(StackFlags::of(Some(&ok)), StackFlags::default());
        let busy = json!({"conditions": [
            {"type": "Ready", "status": "False"},
            {"type": "Reconciling", "status": "True"}]});
        assert!(StackFlags::of(Some(&busy)).reconciling);
        let idle = json!({"conditions": [{"type": "Reconciling", "status": "False"}]});
        assert!(!StackFlags::of(Some(&idle)).reconciling);
    }

    #[test]
    fn series_follow_events_and_relists() {
        let metrics = Metrics::new();
        let mut gauges = StackGauges {
            metrics: metrics.clone(),
            known: HashSet::new(),
            relisting: HashSet::new(),
        };
        let failing = stack("ns", "a", json!({"lastUpdate": {"state": "failed"}}));
        let busy = stack(
            "ns",
            "b",
            json!({"conditions": [{"type": "Reconciling", "status": "True"}]}),
        );
        gauges.observe(&watcher::Event::Init);
        gauges.observe(&watcher::Event::InitApply(failing.clone()));
        gauges.observe(&watcher::Event::InitApply(busy.clone()));
        gauges.observe(&watcher::Event::InitDone);
        assert_eq!(metrics.stacks_active.get(), 2);
        assert_eq!(gauge(&metrics.stacks_failing, "ns", "a"), Some(1));
        assert_eq!(gauge(&metrics.stacks_reconciling, "ns", "a"), Some(0));
        assert_eq!(gauge(&metrics.stacks_reconciling, "ns", "b"), Some(1));

        // A status change flips the gauge; a delete removes the series.
        gauges.observe(&watcher::Event::Apply(stack("ns", "a", json!({}))));
        assert_eq!(gauge(&metrics.stacks_failing, "ns", "a"), Some(0));
        gauges.observe(&watcher::Event::Delete(busy));
        assert_eq!(metrics.stacks_active.get(), 1);
        assert_eq!(gauge(&metrics.stacks_reconciling, "ns", "b"), None);

        // A relist that no longer contains "a" (deleted while the watch was down) drops it.
        gauges.observe(&watcher::Event::Init);
        gauges.observe(&watcher::Event::InitApply(stack("ns", "c", json!({}))));
        gauges.observe(&watcher::Event::InitDone);
        assert_eq!(metrics.stacks_active.get(), 1);
        assert_eq!(gauge(&metrics.stacks_failing, "ns", "a"), None);
        assert_eq!(gauge(&metrics.stacks_failing, "ns", "c"), Some(0));
    }
}
