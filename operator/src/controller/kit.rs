//! What every controller shares: the apiserver client and the metrics, an Event recorder
//! named after the controller (the pod's name read once, in `main`), a guard that counts a
//! reconcile and records how long it took, best-effort Event publishing, the mapping of a
//! failed apiserver call into a controller's error, and the error policy.

use std::borrow::Cow;
use std::fmt::Display;
use std::time::{Duration, Instant};

use futures::{Stream, StreamExt};
use k8s_openapi::api::core::v1::ObjectReference;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference;
use kube::runtime::controller::Action;
use kube::runtime::events::{Event, EventType, Recorder, Reporter};
use kube::{Client, Resource};
use serde::Serialize;
use tracing::warn;

use crate::controller::backoff::{self, Backoff};
use crate::controller::conditions;
use crate::metrics::{ControllerLabels, ErrorLabels, Metrics};

/// The base every controller context is built from.
#[derive(Clone)]
pub struct Kit {
    pub client: Client,
    pub metrics: Metrics,
    /// The pod's name (`$POD_NAME`), reported as the Events' instance.
    instance: Option<String>,
}

impl Kit {
    pub fn new(client: Client, metrics: Metrics, instance: Option<String>) -> Self {
        Self {
            client,
            metrics,
            instance,
        }
    }

    /// A recorder reporting as `pko-rs-<controller>-controller`.
    pub fn recorder(&self, controller: &str) -> Recorder {
        Recorder::new(
            self.client.clone(),
            Reporter {
                controller: format!("pko-rs-{controller}-controller"),
                instance: self.instance.clone(),
            },
        )
    }
}

/// Drives a controller's stream until the controller shuts down, logging what the runtime
/// reports there (watch and queue errors; reconcile errors are logged by the error policy).
pub async fn drive<T, E: Display>(
    controller: &'static str,
    stream: impl Stream<Item = Result<T, E>>,
) {
    stream
        .for_each(|result| async move {
            if let Err(err) = result {
                warn!(controller, error = %err, "controller event");
            }
        })
        .await;
}

/// One reconcile of a controller: counted when made, its duration recorded when dropped, so
/// every controller reports both whatever path its reconcile returns by.
#[must_use = "the duration is recorded when the guard is dropped"]
pub struct Measure {
    metrics: Metrics,
    labels: ControllerLabels,
    started: Instant,
}

/// Counts one reconcile of `controller` and times it until the guard is dropped.
pub fn measure(metrics: &Metrics, controller: &str) -> Measure {
    let labels = metrics.controller(controller);
    metrics.reconciles.get_or_create(&labels).inc();
    Measure {
        metrics: metrics.clone(),
        labels,
        started: Instant::now(),
    }
}

impl Drop for Measure {
    fn drop(&mut self) {
        self.metrics
            .reconcile_duration
            .get_or_create(&self.labels)
            .observe(self.started.elapsed().as_secs_f64());
    }
}

/// Publishes an Event about `object`, its note cut to the conditions' limit. Events are best
/// effort: a failure to publish is logged, never fails the reconcile.
pub async fn publish(
    recorder: &Recorder,
    object: &ObjectReference,
    type_: EventType,
    reason: &str,
    action: &str,
    note: &str,
) {
    let event = Event {
        type_,
        reason: reason.to_owned(),
        note: Some(conditions::truncate(note, conditions::MESSAGE_LIMIT)),
        action: action.to_owned(),
        secondary: None,
    };
    if let Err(e) = recorder.publish(&event, object).await {
        warn!(reason, error = %e, "cannot publish event");
    }
}

/// Tells a stall by one Warning Event ([`backoff::REASON`]): for the kinds whose status is
/// what cannot be written, so no condition can carry it.
pub async fn publish_stall(
    recorder: &Recorder,
    object: &ObjectReference,
    action: &str,
    note: &str,
) {
    publish(
        recorder,
        object,
        EventType::Warning,
        backoff::REASON,
        action,
        note,
    )
    .await;
}

/// The controller reference to put on an object made for `owner`, blocking the owner's
/// foreground deletion until the object is gone; `None` for an object without a uid (one the
/// apiserver never returned).
pub fn controller_owner<K: Resource<DynamicType = ()>>(owner: &K) -> Option<OwnerReference> {
    let mut reference = owner.controller_owner_ref(&())?;
    reference.block_owner_deletion = Some(true);
    Some(reference)
}

/// The body of a status-only server-side apply of kind `K`: `apiVersion`, `kind` and `status`,
/// nothing else, so the status field manager never owns (or clears) any of the spec.
#[derive(Debug, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct StatusPatch<'a, S> {
    api_version: Cow<'static, str>,
    kind: Cow<'static, str>,
    status: &'a S,
}

impl<'a, S: Serialize> StatusPatch<'a, S> {
    pub fn new<K: Resource<DynamicType = ()>>(status: &'a S) -> Self {
        Self {
            api_version: K::api_version(&()),
            kind: K::kind(&()),
            status,
        }
    }
}

/// A reconcile error as `pko_reconcile_errors_total` labels it: one of a small fixed set per
/// controller, so a tenant's input never becomes a series.
pub trait MetricLabel {
    fn metric_label(&self) -> &'static str;
}

/// A controller error with a variant for a failed apiserver call, saying what was being done.
pub trait FromKube: Sized {
    fn from_kube(what: String, source: kube::Error) -> Self;

    /// `map_err` for an apiserver call: `.map_err(StackError::kube("reading the Workspace"))?`
    /// (named by its type: `?` alone could not tell which error to build).
    fn kube(what: impl Into<String>) -> impl FnOnce(kube::Error) -> Self {
        let what = what.into();
        move |source| Self::from_kube(what, source)
    }
}

/// The error policy of every controller: log, count by the error's label, and retry after the
/// object's own backoff (stalling, when retries stop helping, is the reconcile's job: it owns
/// the status).
pub fn error_policy<K, E>(
    controller: &'static str,
    object: &K,
    err: &E,
    metrics: &Metrics,
    backoff: &Backoff,
) -> Action
where
    K: Resource,
    E: MetricLabel + Display,
{
    Action::requeue(failure_delay(controller, object, err, metrics, backoff))
}

/// What [`error_policy`] does, for a controller on its own queue: logs and counts the failure,
/// and returns how long to wait before the next attempt.
pub fn failure_delay<K, E>(
    controller: &'static str,
    object: &K,
    err: &E,
    metrics: &Metrics,
    backoff: &Backoff,
) -> Duration
where
    K: Resource,
    E: MetricLabel + Display,
{
    let meta = object.meta();
    warn!(
        controller,
        namespace = meta.namespace.as_deref().unwrap_or_default(),
        name = meta.name.as_deref().unwrap_or_default(),
        error = %err,
        "reconcile failed"
    );
    metrics
        .reconcile_errors
        .get_or_create(&ErrorLabels {
            controller: controller.to_owned(),
            error: err.metric_label().to_owned(),
        })
        .inc();
    backoff.delay(&backoff::key(meta))
}

/// The resourceVersions of a controller's own writes, per object uid. A reconcile can start
/// from a cache the watch has not yet brought up to the last write (a reconcile queued while
/// the previous one ran starts as soon as it ends); decisions that depend on what that write
/// said, such as keeping a stall while a failed step is retried, read the object again then.
#[derive(Default)]
pub struct OwnWrites(std::sync::Mutex<std::collections::HashMap<String, u64>>);

impl OwnWrites {
    /// Remembers the version a write returned; an object being deleted is forgotten, as its
    /// last reconciles need no fresher read and its uid would otherwise be kept forever.
    pub fn record(&self, written: &kube::api::ObjectMeta) {
        let Some(uid) = written.uid.clone() else {
            return;
        };
        let mut map = self
            .0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        match (&written.deletion_timestamp, version(written)) {
            (None, Some(v)) => map.insert(uid, v),
            _ => map.remove(&uid),
        };
    }

    /// The object as a reconcile must see it: `cached`, or read again (namespaced, by name)
    /// when it is older than this controller's last write; `None` once it is gone.
    pub async fn fresher<K>(
        &self,
        client: &Client,
        cached: std::sync::Arc<K>,
    ) -> Result<Option<std::sync::Arc<K>>, kube::Error>
    where
        K: Resource<DynamicType = (), Scope = k8s_openapi::NamespaceResourceScope>
            + Clone
            + serde::de::DeserializeOwned
            + std::fmt::Debug,
    {
        if !self.behind(cached.meta()) {
            return Ok(Some(cached));
        }
        let namespace = cached.meta().namespace.clone().unwrap_or_default();
        let name = cached.meta().name.clone().unwrap_or_default();
        let api: kube::Api<K> = kube::Api::namespaced(client.clone(), &namespace);
        Ok(api.get_opt(&name).await?.map(std::sync::Arc::new))
    }

    /// Whether `cached` is older than this controller's last write of the same object.
    pub fn behind(&self, cached: &kube::api::ObjectMeta) -> bool {
        let Some(uid) = cached.uid.as_deref() else {
            return false;
        };
        let written = self
            .0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .get(uid)
            .copied();
        is_behind(version(cached), written)
    }
}

/// The resourceVersion as the number etcd gives it; `None` for a server whose versions are not
/// numbers, whose cache is then never taken for stale.
fn version(meta: &kube::api::ObjectMeta) -> Option<u64> {
    meta.resource_version.as_deref()?.parse().ok()
}

/// A cached version is behind a write only when both are known and the write is newer.
pub fn is_behind(cached: Option<u64>, written: Option<u64>) -> bool {
    matches!((cached, written), (Some(c), Some(w)) if c < w)
}

#[cfg(test)]
mod own_writes_tests {
    use super::*;
    use kube::api::ObjectMeta;

    fn meta(uid: &str, rv: &str) -> ObjectMeta {
        ObjectMeta {
            uid: Some(uid.into()),
            resource_version: Some(rv.into()),
            ..ObjectMeta::default()
        }
    }

    #[test]
    fn a_cache_older_than_the_last_write_is_behind() {
        let writes = OwnWrites::default();
        assert!(!writes.behind(&meta("a", "5")), "nothing written yet");
        writes.record(&meta("a", "7"));
        assert!(writes.behind(&meta("a", "5")));
        assert!(!writes.behind(&meta("a", "7")));
        assert!(!writes.behind(&meta("a", "9")), "someone wrote after us");
        assert!(!writes.behind(&meta("b", "1")), "another object");
        assert!(!writes.behind(&meta("a", "opaque")), "not a number");
    }

    #[test]
    fn a_write_to_an_object_being_deleted_forgets_it() {
        let writes = OwnWrites::default();
        writes.record(&meta("a", "7"));
        let mut deleting = meta("a", "8");
        deleting.deletion_timestamp = Some(k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(
            jiff::Timestamp::UNIX_EPOCH,
        ));
        writes.record(&deleting);
        assert!(!writes.behind(&meta("a", "5")));
    }
}
