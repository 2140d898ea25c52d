//! PKO's Stack gauges (`stacks_active`, `stacks_failing`, `stacks_reconciling`) and pko-rs's
//! `stacks_drifted` (`DriftDetected=True`) and `stacks_awaiting_approval` (a plan awaits
//! approval), fed by a Stack watch on every replica.
//!
//! Every replica (not only the leader) runs this watch, like the Program watch behind
//! `programs_active`, so any replica's `/metrics` answers and a scrape of the Service never sees
//! zeros from a follower. Only the two flags per Stack are kept, not the objects, so the cost is a
//! watch connection and one small map entry per Stack. Unlike PKO, a deleted Stack's series are
//! removed (PKO sets them to 0 forever), and `stacks_reconciling` is actually registered. With
//! object labels off ([`crate::metrics::ObjectLabels::None`]) the two gauges count Stacks, so no
//! tenant's Stack name reaches `/metrics`; the flags kept per Stack make the counts exact.
//!
//! The same watch keeps operator-lib's `resource_created_at_seconds{name,namespace,group,
//! version,kind}` of each Stack (PKO's Stack controller sets it from its watch), only with
//! object labels on, since it names every Stack.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use futures::TryStreamExt;
use kube::Api;
use kube::api::DynamicObject;
use kube::runtime::watcher;
use serde_json::Value;
use tracing::warn;

use crate::controller::keys::{PLAN_APPROVED, PLAN_AWAITING, PLAN_REFUSED};
use crate::metrics::{Metrics, StackLabels, StackSeries};
use crate::runtime_metrics::CreatedLabels;

/// What the gauges say about one Stack.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct StackFlags {
    /// `status.lastUpdate.state == "failed"`.
    pub failing: bool,
    /// A `Reconciling` condition with status `True`.
    pub reconciling: bool,
    /// A `DriftDetected` condition with status `True`.
    pub drifted: bool,
    /// A `PlanApproved` condition saying a plan awaits approval.
    pub awaiting_approval: bool,
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
        let condition = |type_: &str| {
            status
                .get("conditions")
                .and_then(Value::as_array)
                .and_then(|conditions| {
                    conditions
                        .iter()
                        .find(|c| c.get("type").and_then(Value::as_str) == Some(type_))
                })
        };
        let awaiting_approval = condition(PLAN_APPROVED)
            .and_then(|c| c.get("reason").and_then(Value::as_str))
            .is_some_and(|reason| reason == PLAN_AWAITING || reason == PLAN_REFUSED);
        let is_true = |type_: &str| {
            status
                .get("conditions")
                .and_then(Value::as_array)
                .is_some_and(|conditions| {
                    conditions.iter().any(|c| {
                        c.get("type").and_then(Value::as_str) == Some(type_)
                            && c.get("status").and_then(Value::as_str) == Some("True")
                    })
                })
        };
        Self {
            failing,
            reconciling: is_true("Reconciling"),
            drifted: is_true("DriftDetected"),
            awaiting_approval,
        }
    }
}

/// The gauges plus the Stacks they describe, with the flags last exported for each.
struct StackGauges {
    metrics: Metrics,
    known: HashMap<StackLabels, StackFlags>,
    /// Stacks seen during a relist, swapped into `known` when the relist ends.
    relisting: HashSet<StackLabels>,
}

impl StackGauges {
    fn new(metrics: Metrics) -> Self {
        Self {
            metrics,
            known: HashMap::new(),
            relisting: HashSet::new(),
        }
    }

    fn set(&mut self, object: &DynamicObject, relist: bool) {
        let Some(labels) = labels_of(object) else {
            return;
        };
        let flags = StackFlags::of(object.data.get("status"));
        match &self.metrics.stacks {
            StackSeries::PerStack {
                failing,
                reconciling,
                drifted,
                awaiting_approval,
            } => {
                failing.get_or_create(&labels).set(i64::from(flags.failing));
                reconciling
                    .get_or_create(&labels)
                    .set(i64::from(flags.reconciling));
                drifted.get_or_create(&labels).set(i64::from(flags.drifted));
                awaiting_approval
                    .get_or_create(&labels)
                    .set(i64::from(flags.awaiting_approval));
            }
            StackSeries::Counted {
                failing,
                reconciling,
                drifted,
                awaiting_approval,
            } => {
                let before = self.known.get(&labels).copied().unwrap_or_default();
                failing.inc_by(i64::from(flags.failing) - i64::from(before.failing));
                reconciling.inc_by(i64::from(flags.reconciling) - i64::from(before.reconciling));
                drifted.inc_by(i64::from(flags.drifted) - i64::from(before.drifted));
                awaiting_approval.inc_by(
                    i64::from(flags.awaiting_approval) - i64::from(before.awaiting_approval),
                );
            }
        }
        if let (Some(created), Some(at)) = (
            &self.metrics.runtime.created,
            object.metadata.creation_timestamp.as_ref(),
        ) {
            // Whole seconds, as Kubernetes stores them.
            #[allow(clippy::cast_precision_loss, reason = "seconds since 1970 fit an f64")]
            let seconds = at.0.as_second() as f64;
            created.get_or_create(&created_labels(&labels)).set(seconds);
        }
        if relist {
            self.relisting.insert(labels.clone());
        }
        self.known.insert(labels, flags);
    }

    fn remove(&mut self, labels: &StackLabels) {
        let Some(before) = self.known.remove(labels) else {
            return;
        };
        if let Some(created) = &self.metrics.runtime.created {
            created.remove(&created_labels(labels));
        }
        match &self.metrics.stacks {
            StackSeries::PerStack {
                failing,
                reconciling,
                drifted,
                awaiting_approval,
            } => {
                failing.remove(labels);
                reconciling.remove(labels);
                drifted.remove(labels);
                awaiting_approval.remove(labels);
            }
            StackSeries::Counted {
                failing,
                reconciling,
                drifted,
                awaiting_approval,
            } => {
                failing.dec_by(i64::from(before.failing));
                reconciling.dec_by(i64::from(before.reconciling));
                drifted.dec_by(i64::from(before.drifted));
                awaiting_approval.dec_by(i64::from(before.awaiting_approval));
            }
        }
    }

    fn observe(&mut self, event: &watcher::Event<DynamicObject>) {
        match event {
            watcher::Event::Init => self.relisting.clear(),
            watcher::Event::InitApply(object) => self.set(object, true),
            watcher::Event::InitDone => {
                // Stacks deleted while the watch was down are absent from the relist.
                let gone: Vec<StackLabels> = self
                    .known
                    .keys()
                    .filter(|labels| !self.relisting.contains(*labels))
                    .cloned()
                    .collect();
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

/// operator-lib's labels of a Stack's `resource_created_at_seconds`.
fn created_labels(stack: &StackLabels) -> CreatedLabels {
    CreatedLabels {
        name: stack.name.clone(),
        namespace: stack.namespace.clone(),
        group: "pulumi.com",
        version: "v1",
        kind: "Stack",
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
            let mut gauges = StackGauges::new(metrics);
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
    use crate::metrics::ObjectLabels;
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

    /// A Stack's `(failing, reconciling)` series, `None` when it has none.
    fn series(metrics: &Metrics, ns: &str, name: &str) -> Option<(i64, i64)> {
        let StackSeries::PerStack {
            failing,
            reconciling,
            ..
        } = &metrics.stacks
        else {
            panic!("per-Stack series expected");
        };
        let labels = StackLabels {
            namespace: ns.into(),
            name: name.into(),
        };
        Some((failing.get(&labels)?.get(), reconciling.get(&labels)?.get()))
    }

    /// The counts exported with object labels off: `(failing, reconciling)`.
    fn counts(metrics: &Metrics) -> (i64, i64) {
        let StackSeries::Counted {
            failing,
            reconciling,
            ..
        } = &metrics.stacks
        else {
            panic!("counted series expected");
        };
        (failing.get(), reconciling.get())
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
    fn drifted_follows_the_drift_detected_condition() {
        let drifted = |status: &str| {
            json!({"conditions": [{"type": "Ready", "status": "True"},
                {"type": "DriftDetected", "status": status}]})
        };
        assert!(StackFlags::of(Some(&drifted("True"))).drifted);
        assert!(!StackFlags::of(Some(&drifted("False"))).drifted);
        assert!(!StackFlags::of(Some(&drifted("Unknown"))).drifted);

        let metrics = Metrics::new();
        let mut gauges = StackGauges::new(metrics.clone());
        gauges.observe(&watcher::Event::Apply(stack("ns", "a", drifted("True"))));
        let text = metrics.encode().expect("encode");
        assert!(
            text.contains("stacks_drifted{namespace=\"ns\",name=\"a\"} 1"),
            "{text}"
        );
        gauges.observe(&watcher::Event::Apply(stack("ns", "a", drifted("False"))));
        let text = metrics.encode().expect("encode");
        assert!(
            text.contains("stacks_drifted{namespace=\"ns\",name=\"a\"} 0"),
            "{text}"
        );

        let metrics = Metrics::with_extra(ObjectLabels::None, |_| {});
        let mut gauges = StackGauges::new(metrics.clone());
        gauges.observe(&watcher::Event::Apply(stack("ns", "a", drifted("True"))));
        gauges.observe(&watcher::Event::Apply(stack("ns", "b", drifted("True"))));
        gauges.observe(&watcher::Event::Delete(stack("ns", "a", json!({}))));
        let text = metrics.encode().expect("encode");
        assert!(text.contains("stacks_drifted 1"), "{text}");
    }

    #[test]
    fn awaiting_approval_follows_the_plan_approved_condition() {
        let gate = |status: &str, reason: &str| json!({"conditions": [{"type": "PlanApproved", "status": status, "reason": reason}]});
        assert!(StackFlags::of(Some(&gate("False", "AwaitingApproval"))).awaiting_approval);
        assert!(StackFlags::of(Some(&gate("False", "ApprovalRefused"))).awaiting_approval);
        assert!(!StackFlags::of(Some(&gate("False", "Planning"))).awaiting_approval);
        assert!(!StackFlags::of(Some(&gate("True", "Approved"))).awaiting_approval);
        assert!(!StackFlags::of(Some(&json!({}))).awaiting_approval);

        let metrics = Metrics::new();
        let mut gauges = StackGauges::new(metrics.clone());
        let awaiting = gate("False", "AwaitingApproval");
        gauges.observe(&watcher::Event::Apply(stack("ns", "a", awaiting.clone())));
        let text = metrics.encode().expect("encode");
        assert!(
            text.contains("stacks_awaiting_approval{namespace=\"ns\",name=\"a\"} 1"),
            "{text}"
        );
        let metrics = Metrics::with_extra(ObjectLabels::None, |_| {});
        let mut gauges = StackGauges::new(metrics.clone());
        gauges.observe(&watcher::Event::Apply(stack("ns", "a", awaiting.clone())));
        gauges.observe(&watcher::Event::Apply(stack("ns", "b", awaiting)));
        gauges.observe(&watcher::Event::Apply(stack(
            "ns",
            "a",
            gate("True", "Approved"),
        )));
        let text = metrics.encode().expect("encode");
        assert!(text.contains("stacks_awaiting_approval 1"), "{text}");
    }

    #[test]
    fn series_follow_events_and_relists() {
        let metrics = Metrics::new();
        let mut gauges = StackGauges::new(metrics.clone());
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
        assert_eq!(series(&metrics, "ns", "a"), Some((1, 0)));
        assert_eq!(series(&metrics, "ns", "b"), Some((0, 1)));

        // A status change flips the gauge; a delete removes the series.
        gauges.observe(&watcher::Event::Apply(stack("ns", "a", json!({}))));
        assert_eq!(series(&metrics, "ns", "a"), Some((0, 0)));
        gauges.observe(&watcher::Event::Delete(busy));
        assert_eq!(metrics.stacks_active.get(), 1);
        assert_eq!(series(&metrics, "ns", "b"), None);

        // A relist that no longer contains "a" (deleted while the watch was down) drops it.
        gauges.observe(&watcher::Event::Init);
        gauges.observe(&watcher::Event::InitApply(stack("ns", "c", json!({}))));
        gauges.observe(&watcher::Event::InitDone);
        assert_eq!(metrics.stacks_active.get(), 1);
        assert_eq!(series(&metrics, "ns", "a"), None);
        assert_eq!(series(&metrics, "ns", "c"), Some((0, 0)));
    }

    #[test]
    fn each_stack_has_its_creation_time_until_it_goes_and_none_without_names() {
        let created = |metrics: &Metrics, name: &str| {
            let family = metrics.runtime.created.as_ref().expect("names: exported");
            let labels = created_labels(&StackLabels {
                namespace: "ns".into(),
                name: name.into(),
            });
            family.get(&labels).map(|g| g.get())
        };
        let at = |s: &str| {
            k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(s.parse().expect("time"))
        };
        let mut a = stack("ns", "a", json!({}));
        a.metadata.creation_timestamp = Some(at("2024-05-01T10:00:00Z"));
        let metrics = Metrics::new();
        let mut gauges = StackGauges::new(metrics.clone());
        gauges.observe(&watcher::Event::Apply(a.clone()));
        assert_eq!(created(&metrics, "a"), Some(1_714_557_600.0));
        let text = metrics.encode().expect("encode");
        assert!(
            text.contains("resource_created_at_seconds{name=\"a\",namespace=\"ns\",group=\"pulumi.com\",version=\"v1\",kind=\"Stack\"} 1714557600.0"),
            "{text}"
        );
        gauges.observe(&watcher::Event::Delete(a.clone()));
        assert_eq!(created(&metrics, "a"), None);

        let metrics = Metrics::with_extra(ObjectLabels::None, |_| {});
        let mut gauges = StackGauges::new(metrics.clone());
        gauges.observe(&watcher::Event::Apply(a));
        assert!(metrics.runtime.created.is_none());
        let text = metrics.encode().expect("encode");
        assert!(!text.contains("resource_created_at_seconds"), "{text}");
    }

    #[test]
    fn counts_follow_events_and_relists_without_names() {
        let metrics = Metrics::with_extra(ObjectLabels::None, |_| {});
        let mut gauges = StackGauges::new(metrics.clone());
        let failed = json!({"lastUpdate": {"state": "failed"}});
        let busy = json!({"conditions": [{"type": "Reconciling", "status": "True"}]});
        gauges.observe(&watcher::Event::Init);
        gauges.observe(&watcher::Event::InitApply(stack("ns", "a", failed.clone())));
        gauges.observe(&watcher::Event::InitApply(stack("ns", "b", busy.clone())));
        gauges.observe(&watcher::Event::InitApply(stack(
            "other",
            "a",
            failed.clone(),
        )));
        gauges.observe(&watcher::Event::InitDone);
        assert_eq!(metrics.stacks_active.get(), 3);
        assert_eq!(counts(&metrics), (2, 1));

        // The same status again counts once; a change moves the Stack between counts.
        gauges.observe(&watcher::Event::Apply(stack("ns", "a", failed.clone())));
        assert_eq!(counts(&metrics), (2, 1));
        gauges.observe(&watcher::Event::Apply(stack("ns", "a", busy.clone())));
        assert_eq!(counts(&metrics), (1, 2));
        gauges.observe(&watcher::Event::Delete(stack("ns", "b", json!({}))));
        assert_eq!(counts(&metrics), (1, 1));
        // A delete of a Stack never seen changes nothing.
        gauges.observe(&watcher::Event::Delete(stack("ns", "zz", failed.clone())));
        assert_eq!(counts(&metrics), (1, 1));

        // A relist without "other/a" takes it out of the counts.
        gauges.observe(&watcher::Event::Init);
        gauges.observe(&watcher::Event::InitApply(stack("ns", "a", busy)));
        gauges.observe(&watcher::Event::InitDone);
        assert_eq!(metrics.stacks_active.get(), 1);
        assert_eq!(counts(&metrics), (0, 1));

        // No namespace or name in the exposition.
        let text = metrics.encode().expect("encode");
        assert!(text.contains("stacks_failing 0"), "{text}");
        assert!(text.contains("stacks_reconciling 1"), "{text}");
        assert!(
            !text.contains("namespace=") && !text.contains("\"ns\""),
            "{text}"
        );
    }
}
