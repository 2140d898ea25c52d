//! A kube `Controller` fed through its `*_stream` inputs, so every reconcile request it
//! schedules is seen on the way in, and its reconciler and error policy wrapped, so every
//! run and requeue is seen: what PKO's controller-runtime and work-queue series are made of
//! ([`crate::runtime_metrics`]). The requests themselves are exactly those
//! `Controller::new`, `owns` and `watches` would make, and nothing about scheduling changes,
//! except that [`controller_of_changes`] leaves out changes of status alone.

use std::hash::{DefaultHasher, Hash, Hasher};
use std::panic::AssertUnwindSafe;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use std::fmt::Debug;

use futures::channel::mpsc::{UnboundedReceiver, UnboundedSender, unbounded};
use futures::future::BoxFuture;
use futures::{FutureExt, Stream, StreamExt, TryStreamExt};
use kube::Resource;
use kube::api::{Api, PartialObjectMeta};
use kube::runtime::controller::{Action, Controller, Error as ControllerError};
use kube::runtime::reflector::{self, ObjectRef};
use kube::runtime::{PredicateConfig, WatchStreamExt, watcher};
use serde::de::DeserializeOwned;
use tracing::warn;

use crate::runtime_metrics::{ControllerProbe, ObjectKey, ReconcileResult};

/// `Controller::new(api, wc)`, each object of its watch seen as queued.
pub fn controller<K>(probe: &ControllerProbe, api: Api<K>, wc: watcher::Config) -> Controller<K>
where
    K: Resource<DynamicType = ()> + Clone + DeserializeOwned + Debug + Send + Sync + 'static,
{
    let (reader, writer) = reflector::store();
    let objects_of = watcher(api, wc).reflect(writer).applied_objects();
    Controller::for_stream(objects(probe, objects_of), reader)
}

/// [`controller`] for a kind whose reconciles write its status: a change of the status alone
/// queues nothing. The reconcile that wrote it has acted already, and a reconcile its own write
/// queued may start before the write reaches the cache: it would redo the attempt from the
/// status before (a failed step retried at once and in a loop, not after its wait).
pub fn controller_of_changes<K>(
    probe: &ControllerProbe,
    api: Api<K>,
    wc: watcher::Config,
) -> Controller<K>
where
    K: Resource<DynamicType = ()> + Clone + DeserializeOwned + Debug + Send + Sync + 'static,
{
    let (reader, writer) = reflector::store();
    let objects_of = watcher(api, wc)
        .reflect(writer)
        .applied_objects()
        .predicate_filter(not_status, PredicateConfig::default());
    Controller::for_stream(objects(probe, objects_of), reader)
}

/// What of an object a status write leaves as it is: the spec (its generation), labels,
/// annotations, finalizers and deletion.
fn not_status<K: Resource>(object: &K) -> Option<u64> {
    let meta = object.meta();
    let mut hasher = DefaultHasher::new();
    (
        &meta.uid,
        meta.generation,
        &meta.labels,
        &meta.annotations,
        &meta.finalizers,
        meta.deletion_timestamp.is_some(),
    )
        .hash(&mut hasher);
    Some(hasher.finish())
}

/// `owns`, `watches` and `reconcile_on`, their requests seen as queued.
pub trait Observed<K: Resource<DynamicType = ()>>: Sized {
    /// `Controller::owns`: a change of a child of kind `C` (its metadata watched) queues its
    /// owners of kind `K`.
    fn owns_observed<C>(
        self,
        probe: &ControllerProbe,
        api: Api<PartialObjectMeta<C>>,
        wc: watcher::Config,
    ) -> Self
    where
        C: Resource<DynamicType = ()> + Clone + DeserializeOwned + Debug + Send + Sync + 'static;

    /// `Controller::watches`.
    fn watches_observed<O, I>(
        self,
        probe: &ControllerProbe,
        api: Api<O>,
        wc: watcher::Config,
        mapper: impl Fn(O) -> I + Send + Sync + 'static,
    ) -> Self
    where
        O: Resource<DynamicType = ()> + Clone + DeserializeOwned + Debug + Send + Sync + 'static,
        I: IntoIterator<Item = ObjectRef<K>> + 'static;

    /// `Controller::watches_stream`: a watch the caller made (reflected into a store of its
    /// own, say).
    fn watches_stream_observed<O, I>(
        self,
        probe: &ControllerProbe,
        stream: impl Stream<Item = Result<O, watcher::Error>> + Send + 'static,
        mapper: impl Fn(O) -> I + Send + Sync + 'static,
    ) -> Self
    where
        O: Resource<DynamicType = ()> + Clone + DeserializeOwned + Debug + Send + Sync + 'static,
        I: IntoIterator<Item = ObjectRef<K>> + 'static;

    /// `Controller::reconcile_on`.
    fn reconcile_on_observed(
        self,
        probe: &ControllerProbe,
        trigger: impl Stream<Item = ObjectRef<K>> + Send + 'static,
    ) -> Self;

    /// Reconciles what is sent to `wakeup`, when this is the first controller to take it.
    fn woken_by(self, probe: &ControllerProbe, wakeup: &Wakeup<K>) -> Self;
}

/// Where other parts of the operator ask a controller to reconcile an object now (a slot
/// freed, an agent found restarted): senders anyone may clone, and one receiver the
/// controller's `run` takes ([`Observed::woken_by`]).
pub struct Wakeup<K: Resource> {
    sender: UnboundedSender<ObjectRef<K>>,
    receiver: Mutex<Option<UnboundedReceiver<ObjectRef<K>>>>,
}

impl<K: Resource> Wakeup<K> {
    pub fn new() -> Self {
        let (sender, receiver) = unbounded();
        Self {
            sender,
            receiver: Mutex::new(Some(receiver)),
        }
    }

    /// A sender of objects to reconcile now.
    pub fn sender(&self) -> UnboundedSender<ObjectRef<K>> {
        self.sender.clone()
    }

    fn take(&self) -> Option<UnboundedReceiver<ObjectRef<K>>> {
        self.receiver
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take()
    }
}

impl<K: Resource> Default for Wakeup<K> {
    fn default() -> Self {
        Self::new()
    }
}

impl<K> Observed<K> for Controller<K>
where
    K: Resource<DynamicType = ()> + Clone + DeserializeOwned + Debug + Send + Sync + 'static,
{
    fn owns_observed<C>(
        self,
        probe: &ControllerProbe,
        api: Api<PartialObjectMeta<C>>,
        wc: watcher::Config,
    ) -> Self
    where
        C: Resource<DynamicType = ()> + Clone + DeserializeOwned + Debug + Send + Sync + 'static,
    {
        self.watches_stream(
            watcher(api, wc).touched_objects(),
            owners::<PartialObjectMeta<C>, K>(probe),
        )
    }

    fn watches_observed<O, I>(
        self,
        probe: &ControllerProbe,
        api: Api<O>,
        wc: watcher::Config,
        mapper: impl Fn(O) -> I + Send + Sync + 'static,
    ) -> Self
    where
        O: Resource<DynamicType = ()> + Clone + DeserializeOwned + Debug + Send + Sync + 'static,
        I: IntoIterator<Item = ObjectRef<K>> + 'static,
    {
        self.watches_stream(watcher(api, wc).touched_objects(), mapped(probe, mapper))
    }

    fn watches_stream_observed<O, I>(
        self,
        probe: &ControllerProbe,
        stream: impl Stream<Item = Result<O, watcher::Error>> + Send + 'static,
        mapper: impl Fn(O) -> I + Send + Sync + 'static,
    ) -> Self
    where
        O: Resource<DynamicType = ()> + Clone + DeserializeOwned + Debug + Send + Sync + 'static,
        I: IntoIterator<Item = ObjectRef<K>> + 'static,
    {
        self.watches_stream(stream, mapped(probe, mapper))
    }

    fn reconcile_on_observed(
        self,
        probe: &ControllerProbe,
        trigger: impl Stream<Item = ObjectRef<K>> + Send + 'static,
    ) -> Self {
        self.reconcile_on(refs(probe, trigger))
    }

    fn woken_by(self, probe: &ControllerProbe, wakeup: &Wakeup<K>) -> Self {
        match wakeup.take() {
            Some(woken) => self.reconcile_on_observed(probe, woken),
            None => self,
        }
    }
}

/// The controller's own objects as triggers (what `Controller::new` does with its watch),
/// each one seen as queued.
fn objects<K, S>(
    probe: &ControllerProbe,
    stream: S,
) -> impl Stream<Item = Result<K, watcher::Error>> + Send + 'static
where
    K: Resource<DynamicType = ()> + Send + 'static,
    S: Stream<Item = Result<K, watcher::Error>> + Send + 'static,
{
    let probe = probe.clone();
    stream.inspect_ok(move |object| probe.trigger(key_of(&ObjectRef::from_obj(object))))
}

/// A `watches` mapper whose requests are seen as queued.
fn mapped<O, K, I>(
    probe: &ControllerProbe,
    mapper: impl Fn(O) -> I + Send + Sync + 'static,
) -> impl Fn(O) -> Vec<ObjectRef<K>> + Send + Sync + 'static
where
    K: Resource<DynamicType = ()>,
    I: IntoIterator<Item = ObjectRef<K>>,
{
    let probe = probe.clone();
    move |other| {
        let refs: Vec<ObjectRef<K>> = mapper(other).into_iter().collect();
        for r in &refs {
            probe.trigger(key_of(r));
        }
        refs
    }
}

/// The mapper of `owns`: every owner reference of kind `K` on a child (as kube's
/// `trigger_owners` maps them).
fn owners<C, K>(probe: &ControllerProbe) -> impl Fn(C) -> Vec<ObjectRef<K>> + Send + Sync + 'static
where
    C: Resource,
    K: Resource<DynamicType = ()>,
{
    mapped(probe, |child: C| {
        let meta = child.meta();
        let ns = meta.namespace.clone();
        meta.owner_references
            .iter()
            .flatten()
            .filter_map(|owner| ObjectRef::from_owner_ref(ns.as_deref(), owner, ()))
            .collect::<Vec<_>>()
    })
}

/// A `reconcile_on` stream whose requests are seen as queued.
fn refs<K>(
    probe: &ControllerProbe,
    stream: impl Stream<Item = ObjectRef<K>> + Send + 'static,
) -> impl Stream<Item = ObjectRef<K>> + Send + 'static
where
    K: Resource<DynamicType = ()> + 'static,
{
    let probe = probe.clone();
    stream.inspect(move |r| probe.trigger(key_of(r)))
}

/// The reconciler, counted: taken off the queue when kube calls it, its result, time and
/// panics recorded, and a requested requeue scheduled like kube's scheduler does.
pub fn reconciler<K, Ctx, E, Fut>(
    probe: &ControllerProbe,
    reconcile: impl Fn(Arc<K>, Arc<Ctx>) -> Fut + Send + 'static,
) -> impl FnMut(Arc<K>, Arc<Ctx>) -> BoxFuture<'static, Result<Action, E>>
where
    K: Resource<DynamicType = ()> + Send + Sync + 'static,
    Ctx: Send + Sync + 'static,
    E: Send + 'static,
    Fut: Future<Output = Result<Action, E>> + Send + 'static,
{
    let probe = probe.clone();
    move |object: Arc<K>, ctx: Arc<Ctx>| {
        let key = key_of(&ObjectRef::from_obj(&*object));
        let run = probe.start(key.clone());
        let probe = probe.clone();
        let fut = reconcile(object, ctx);
        async move {
            match AssertUnwindSafe(fut).catch_unwind().await {
                Ok(Ok(action)) => {
                    if action == Action::await_change() {
                        run.finish(ReconcileResult::Success);
                    } else {
                        run.finish(ReconcileResult::RequeueAfter);
                        requeue(&probe, key, &action);
                    }
                    Ok(action)
                }
                // The retry is scheduled by the error policy, as kube does.
                Ok(Err(err)) => {
                    run.finish(ReconcileResult::Error);
                    Err(err)
                }
                Err(panic) => {
                    run.panicked();
                    std::panic::resume_unwind(panic)
                }
            }
        }
        .boxed()
    }
}

/// The error policy, its retry seen as a requeue.
pub fn error_policy<K, Ctx, E>(
    probe: &ControllerProbe,
    policy: impl Fn(Arc<K>, &E, Arc<Ctx>) -> Action + Send + Sync + 'static,
) -> impl Fn(Arc<K>, &E, Arc<Ctx>) -> Action
where
    K: Resource<DynamicType = ()>,
{
    let probe = probe.clone();
    move |object: Arc<K>, err: &E, ctx: Arc<Ctx>| {
        let key = key_of(&ObjectRef::from_obj(&*object));
        let action = policy(object, err, ctx);
        requeue(&probe, key, &action);
        action
    }
}

/// [`crate::controller::kit::drive`], also taking the requests whose object was gone when
/// they came due (kube drops them without a reconcile) off the queue.
pub async fn drive<T, E1, E2>(
    controller: &'static str,
    probe: &ControllerProbe,
    stream: impl Stream<Item = Result<T, ControllerError<E1, E2>>>,
) where
    E1: std::error::Error + 'static,
    E2: std::error::Error + 'static,
{
    stream
        .for_each(|result| async move {
            match result {
                Ok(_) => {}
                Err(ControllerError::ObjectNotFound(object)) => {
                    probe.forget(&ObjectKey {
                        namespace: object.namespace.clone(),
                        name: object.name.clone(),
                    });
                }
                Err(err) => warn!(controller, error = %err, "controller event"),
            }
        })
        .await;
}

fn key_of<K: Resource<DynamicType = ()>>(r: &ObjectRef<K>) -> ObjectKey {
    ObjectKey::from(r)
}

fn requeue(probe: &ControllerProbe, key: ObjectKey, action: &Action) {
    match requeue_after(action) {
        Some(delay) => probe.requeue(key, delay),
        // A delay we cannot read: still a retry; the key counts as added when it runs.
        None if *action != Action::await_change() => probe.retry(),
        None => {}
    }
}

/// The delay of a requeue `action`. kube keeps it private; its `Debug` form (`Action {
/// requeue_after: Some(1.5s) }`, std's `Duration` format) is the only way to read it, and
/// a unit test pins that form.
pub fn requeue_after(action: &Action) -> Option<Duration> {
    let text = format!("{action:?}");
    let inner = text.split_once("Some(")?.1.split_once(')')?.0;
    parse_debug_duration(inner)
}

/// Parses std's `Debug` of a `Duration`: a decimal number and `s`, `ms`, `µs` or `ns`.
fn parse_debug_duration(text: &str) -> Option<Duration> {
    let (number, scale) = [("ns", 1e-9), ("µs", 1e-6), ("ms", 1e-3), ("s", 1.0)]
        .into_iter()
        .find_map(|(unit, scale)| Some((text.strip_suffix(unit)?, scale)))?;
    let value: f64 = number.parse().ok()?;
    Duration::try_from_secs_f64(value * scale).ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_delay_of_an_action_is_read_back() {
        for delay in [
            Duration::from_secs(3600),
            Duration::from_millis(1500),
            Duration::from_millis(100),
            Duration::from_micros(250),
            Duration::from_nanos(7),
            Duration::from_nanos(1_000_000_001),
            Duration::ZERO,
        ] {
            let read = requeue_after(&Action::requeue(delay)).expect("a delay");
            let error = read.as_secs_f64() - delay.as_secs_f64();
            assert!(error.abs() < 1e-9, "{delay:?} read as {read:?}");
        }
        assert_eq!(requeue_after(&Action::await_change()), None);
    }
}
