//! PKO's metric names beside ours: the series controller-runtime and client-go export in PKO
//! (`controller_runtime_*`, `workqueue_*`, `rest_client_*`) and operator-lib's
//! `resource_created_at_seconds`, so dashboards and alerts written for PKO keep working.
//!
//! Same names, labels, buckets and meaning as controller-runtime v0.22 (PKO v2.9's), for
//! controllers of another shape: the Stack, Workspace and Update controllers run on kube's
//! scheduler, the Program controller on our FIFO ([`crate::controller::queue`]). What a work
//! queue's series mean is kept by following each key as client-go's queue would count it
//! ([`QueueState`]): a key is *added* when it becomes due (a trigger now, a requeue when its
//! delay ends), counts in the *depth* while due and not taken by a worker (also while it
//! runs and was triggered again), its *queue duration* runs from due to taken, its *work
//! duration* from taken to done, and every delayed requeue (after an error or a requested
//! requeue) is a *retry*. Keys are merged as the scheduler merges them (one entry per object,
//! the earliest due time wins), so these series describe the reconciles that actually run.
//!
//! Every label value is a controller name, a result, an HTTP method, a status code or the
//! apiserver's host: a fixed set whatever tenants create. `resource_created_at_seconds` names
//! each Stack, so it exists only with `--metrics-object-labels=names`.

use std::collections::HashMap;
use std::sync::atomic::AtomicU64;
use std::sync::{Arc, Mutex, PoisonError, Weak};
use std::time::{Duration, Instant};

use kube::runtime::reflector::{Lookup, ObjectRef};
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;

use crate::metrics::ObjectLabels;

/// PKO's controller names (controller-runtime's `controller` and work queue `name` labels).
pub mod names {
    pub const PROGRAM: &str = "program-controller";
    pub const STACK: &str = "stack-controller";
    pub const WORKSPACE: &str = "workspace-controller";
    pub const UPDATE: &str = "update-controller";
}

/// controller-runtime's `controller_runtime_reconcile_time_seconds` buckets.
const RECONCILE_BUCKETS: [f64; 40] = [
    0.005, 0.01, 0.025, 0.05, 0.1, 0.15, 0.2, 0.25, 0.3, 0.35, 0.4, 0.45, 0.5, 0.6, 0.7, 0.8, 0.9,
    1.0, 1.25, 1.5, 1.75, 2.0, 2.5, 3.0, 3.5, 4.0, 4.5, 5.0, 6.0, 7.0, 8.0, 9.0, 10.0, 15.0, 20.0,
    25.0, 30.0, 40.0, 50.0, 60.0,
];

/// client-go's `rest_client_request_duration_seconds` buckets.
const REST_BUCKETS: [f64; 12] = [
    0.005, 0.025, 0.1, 0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 15.0, 30.0, 60.0,
];

fn reconcile_histogram() -> Histogram {
    Histogram::new(RECONCILE_BUCKETS)
}

/// client-go's work queue buckets: 10 ns to 1,000 s, by tens.
fn queue_histogram() -> Histogram {
    Histogram::new(exponential_buckets(1e-8, 10.0, 12))
}

fn rest_histogram() -> Histogram {
    Histogram::new(REST_BUCKETS)
}

/// `{controller}`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ControllerLabel {
    pub controller: &'static str,
}

/// `{controller,result}` of `controller_runtime_reconcile_total`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ResultLabels {
    pub controller: &'static str,
    pub result: &'static str,
}

/// `{name,controller}` of the work queue series (controller-runtime sets both to the
/// controller's name).
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct QueueLabels {
    pub name: &'static str,
    pub controller: &'static str,
}

/// `{code,method,host}` of `rest_client_requests_total`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct RequestLabels {
    /// The status code, or `<error>` when no response came (client-go's value).
    pub code: String,
    pub method: &'static str,
    pub host: Arc<String>,
}

/// `{verb,host}` of `rest_client_request_duration_seconds`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct LatencyLabels {
    pub verb: &'static str,
    pub host: Arc<String>,
}

/// `{name,namespace,group,version,kind}` of `resource_created_at_seconds`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct CreatedLabels {
    pub name: String,
    pub namespace: String,
    pub group: &'static str,
    pub version: &'static str,
    pub kind: &'static str,
}

/// How one reconcile ended, as `controller_runtime_reconcile_total{result}` says it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ReconcileResult {
    /// The reconcile failed (it is retried after the object's backoff).
    Error,
    /// It succeeded and asked to be run again after a delay.
    RequeueAfter,
    /// It asked to be run again at once, rate limited; none of our controllers does.
    Requeue,
    /// It succeeded and waits for the next change.
    Success,
}

impl ReconcileResult {
    const ALL: [Self; 4] = [
        Self::Error,
        Self::RequeueAfter,
        Self::Requeue,
        Self::Success,
    ];

    fn label(self) -> &'static str {
        match self {
            Self::Error => "error",
            Self::RequeueAfter => "requeue_after",
            Self::Requeue => "requeue",
            Self::Success => "success",
        }
    }
}

/// An object as a work queue key.
#[derive(Clone, Debug, Hash, PartialEq, Eq)]
pub struct ObjectKey {
    pub namespace: Option<String>,
    pub name: String,
}

impl<K: Lookup + ?Sized> From<&ObjectRef<K>> for ObjectKey {
    fn from(r: &ObjectRef<K>) -> Self {
        Self {
            namespace: r.namespace.clone(),
            name: r.name.clone(),
        }
    }
}

/// A key waiting in the queue.
#[derive(Clone, Copy, Debug)]
struct Pending {
    /// When it is (or becomes) due.
    due: Instant,
    /// Whether it has been counted as an add (once due).
    counted: bool,
}

/// One queue's bookkeeping, free of any clock or metric: the keys waiting and running, as
/// client-go's work queue counts them.
#[derive(Debug, Default)]
pub struct QueueState {
    pending: HashMap<ObjectKey, Pending>,
    running: HashMap<ObjectKey, Instant>,
}

/// What the queue says at one instant.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct QueueSnapshot {
    /// Keys due and not taken by a worker.
    pub depth: i64,
    /// Keys that became due since the last look, not yet counted as adds.
    pub new_adds: u64,
    /// Seconds the running keys have run, together.
    pub unfinished_seconds: f64,
    /// Seconds the longest-running key has run.
    pub longest_seconds: f64,
}

/// What taking a key off the queue counted.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Taken {
    /// The key was not counted as an add yet (it became due since the last look).
    pub new_add: bool,
    /// Seconds from due to taken.
    pub waited: f64,
}

impl QueueState {
    /// Queues `key` due at `due`; a key already queued keeps the earlier due time, as kube's
    /// scheduler and client-go's delaying queue both do.
    pub fn schedule(&mut self, key: ObjectKey, due: Instant) {
        self.pending
            .entry(key)
            .and_modify(|p| {
                if due < p.due {
                    p.due = due;
                }
            })
            .or_insert(Pending {
                due,
                counted: false,
            });
    }

    /// A worker takes `key` at `now`.
    pub fn take(&mut self, key: &ObjectKey, now: Instant) -> Taken {
        let taken = match self.pending.remove(key) {
            Some(p) => Taken {
                new_add: !p.counted,
                waited: now.saturating_duration_since(p.due).as_secs_f64(),
            },
            // Not seen queued (a trigger outside the watched streams): an add that waited
            // for nothing measurable.
            None => Taken {
                new_add: true,
                waited: 0.0,
            },
        };
        self.running.insert(key.clone(), now);
        taken
    }

    /// The worker is done with `key` at `now`; returns how long it ran.
    pub fn done(&mut self, key: &ObjectKey, now: Instant) -> Option<f64> {
        let started = self.running.remove(key)?;
        Some(now.saturating_duration_since(started).as_secs_f64())
    }

    /// `key` left the queue without running (its object is gone); returns whether it was an
    /// add not counted yet.
    pub fn forget(&mut self, key: &ObjectKey, now: Instant) -> bool {
        self.pending
            .remove(key)
            .is_some_and(|p| !p.counted && p.due <= now)
    }

    /// The queue at `now`; keys due since the last look are counted as adds from now on.
    pub fn snapshot(&mut self, now: Instant) -> QueueSnapshot {
        let mut out = QueueSnapshot::default();
        for p in self.pending.values_mut().filter(|p| p.due <= now) {
            out.depth += 1;
            if !p.counted {
                p.counted = true;
                out.new_adds += 1;
            }
        }
        for started in self.running.values() {
            let age = now.saturating_duration_since(*started).as_secs_f64();
            out.unfinished_seconds += age;
            out.longest_seconds = out.longest_seconds.max(age);
        }
        out
    }
}

/// The families, registered once per process.
#[derive(Clone)]
struct Families {
    reconcile_total: Family<ResultLabels, Counter>,
    reconcile_errors: Family<ControllerLabel, Counter>,
    reconcile_panics: Family<ControllerLabel, Counter>,
    reconcile_time: Family<ControllerLabel, Histogram>,
    max_concurrent: Family<ControllerLabel, Gauge>,
    active_workers: Family<ControllerLabel, Gauge>,
    depth: Family<QueueLabels, Gauge>,
    adds: Family<QueueLabels, Counter>,
    queue_duration: Family<QueueLabels, Histogram>,
    work_duration: Family<QueueLabels, Histogram>,
    unfinished: Family<QueueLabels, Gauge<f64, AtomicU64>>,
    longest: Family<QueueLabels, Gauge<f64, AtomicU64>>,
    retries: Family<QueueLabels, Counter>,
}

/// The queues of running controllers; a queue leaves when its controller stops.
#[derive(Default)]
struct Queues {
    live: Vec<(QueueLabels, Weak<Mutex<QueueState>>)>,
    /// Every queue that ever ran, so its gauges drop to zero when it stops.
    known: Vec<QueueLabels>,
}

/// PKO's controller-runtime, work-queue, REST-client and resource series. Cheap to clone.
#[derive(Clone)]
pub struct RuntimeMetrics {
    families: Families,
    queues: Arc<Mutex<Queues>>,
    /// `rest_client_requests_total` and `rest_client_request_duration_seconds`.
    pub rest: RestMetrics,
    /// `resource_created_at_seconds` of each Stack; `None` without object labels.
    pub created: Option<Family<CreatedLabels, Gauge<f64, AtomicU64>>>,
}

/// The REST client families (the apiserver client's requests).
#[derive(Clone)]
pub struct RestMetrics {
    pub requests: Family<RequestLabels, Counter>,
    pub duration: Family<LatencyLabels, Histogram>,
}

impl RuntimeMetrics {
    /// Registers every family in `registry`.
    #[allow(
        clippy::too_many_lines,
        reason = "one registration per metric, in the order /metrics lists them"
    )]
    pub fn register(registry: &mut Registry, object_labels: ObjectLabels) -> Self {
        let families = Families {
            reconcile_total: Family::default(),
            reconcile_errors: Family::default(),
            reconcile_panics: Family::default(),
            reconcile_time: Family::new_with_constructor(reconcile_histogram),
            max_concurrent: Family::default(),
            active_workers: Family::default(),
            depth: Family::default(),
            adds: Family::default(),
            queue_duration: Family::new_with_constructor(queue_histogram),
            work_duration: Family::new_with_constructor(queue_histogram),
            unfinished: Family::default(),
            longest: Family::default(),
            retries: Family::default(),
        };
        registry.register(
            "controller_runtime_reconcile",
            "Total number of reconciliations per controller",
            families.reconcile_total.clone(),
        );
        registry.register(
            "controller_runtime_reconcile_errors",
            "Total number of reconciliation errors per controller",
            families.reconcile_errors.clone(),
        );
        registry.register(
            "controller_runtime_reconcile_panics",
            "Total number of reconciliation panics per controller",
            families.reconcile_panics.clone(),
        );
        registry.register(
            "controller_runtime_reconcile_time_seconds",
            "Length of time per reconciliation per controller",
            families.reconcile_time.clone(),
        );
        registry.register(
            "controller_runtime_max_concurrent_reconciles",
            "Maximum number of concurrent reconciles per controller",
            families.max_concurrent.clone(),
        );
        registry.register(
            "controller_runtime_active_workers",
            "Number of currently used workers per controller",
            families.active_workers.clone(),
        );
        registry.register(
            "workqueue_depth",
            "Current depth of workqueue",
            families.depth.clone(),
        );
        registry.register(
            "workqueue_adds",
            "Total number of adds handled by workqueue",
            families.adds.clone(),
        );
        registry.register(
            "workqueue_queue_duration_seconds",
            "How long in seconds an item stays in workqueue before being requested",
            families.queue_duration.clone(),
        );
        registry.register(
            "workqueue_work_duration_seconds",
            "How long in seconds processing an item from workqueue takes",
            families.work_duration.clone(),
        );
        registry.register(
            "workqueue_unfinished_work_seconds",
            "How many seconds of work has been done that is in progress and hasn't been observed by work_duration",
            families.unfinished.clone(),
        );
        registry.register(
            "workqueue_longest_running_processor_seconds",
            "How many seconds has the longest running processor for workqueue been running",
            families.longest.clone(),
        );
        registry.register(
            "workqueue_retries",
            "Total number of retries handled by workqueue",
            families.retries.clone(),
        );
        let rest = RestMetrics {
            requests: Family::default(),
            duration: Family::new_with_constructor(rest_histogram),
        };
        registry.register(
            "rest_client_requests",
            "Number of HTTP requests, partitioned by status code, method, and host",
            rest.requests.clone(),
        );
        registry.register(
            "rest_client_request_duration_seconds",
            "Request latency in seconds, broken down by verb and host",
            rest.duration.clone(),
        );
        let created = match object_labels {
            ObjectLabels::Names => {
                let family = Family::<CreatedLabels, Gauge<f64, AtomicU64>>::default();
                registry.register(
                    "resource_created_at_seconds",
                    "Timestamp at which a resource was created",
                    family.clone(),
                );
                Some(family)
            }
            ObjectLabels::None => None,
        };
        Self {
            families,
            queues: Arc::new(Mutex::new(Queues::default())),
            rest,
            created,
        }
    }

    /// A controller starting with `concurrency` workers: its series exist from now on, at
    /// zero (as controller-runtime creates them when a controller starts). Each running
    /// instance (one per watched namespace) has its own probe; they add up.
    pub fn controller(&self, name: &'static str, concurrency: u16) -> ControllerProbe {
        let controller = ControllerLabel { controller: name };
        let queue = QueueLabels {
            name,
            controller: name,
        };
        let f = &self.families;
        for result in ReconcileResult::ALL {
            drop(f.reconcile_total.get_or_create(&ResultLabels {
                controller: name,
                result: result.label(),
            }));
        }
        drop(f.reconcile_errors.get_or_create(&controller));
        drop(f.reconcile_panics.get_or_create(&controller));
        drop(f.reconcile_time.get_or_create(&controller));
        drop(f.active_workers.get_or_create(&controller));
        f.max_concurrent
            .get_or_create(&controller)
            .inc_by(i64::from(concurrency));
        drop(f.depth.get_or_create(&queue));
        drop(f.adds.get_or_create(&queue));
        drop(f.queue_duration.get_or_create(&queue));
        drop(f.work_duration.get_or_create(&queue));
        drop(f.unfinished.get_or_create(&queue));
        drop(f.longest.get_or_create(&queue));
        drop(f.retries.get_or_create(&queue));
        let state = Arc::new(Mutex::new(QueueState::default()));
        {
            let mut queues = lock(&self.queues);
            queues.live.push((queue.clone(), Arc::downgrade(&state)));
            if !queues.known.contains(&queue) {
                queues.known.push(queue.clone());
            }
        }
        ControllerProbe {
            inner: Arc::new(ProbeInner {
                families: self.families.clone(),
                controller,
                queue,
                concurrency,
                state,
            }),
        }
    }

    /// Brings the work-queue gauges (depth, unfinished work, longest running) and adds up to
    /// `now`; called before every scrape.
    pub fn refresh(&self, now: Instant) {
        let mut totals: HashMap<QueueLabels, QueueSnapshot> = HashMap::new();
        let known = {
            let mut queues = lock(&self.queues);
            queues.live.retain(|(_, state)| state.strong_count() > 0);
            for (labels, state) in &queues.live {
                let Some(state) = state.upgrade() else {
                    continue;
                };
                let snapshot = lock(&state).snapshot(now);
                let total = totals.entry(labels.clone()).or_default();
                total.depth += snapshot.depth;
                total.new_adds += snapshot.new_adds;
                total.unfinished_seconds += snapshot.unfinished_seconds;
                total.longest_seconds = total.longest_seconds.max(snapshot.longest_seconds);
            }
            queues.known.clone()
        };
        let f = &self.families;
        for labels in known {
            let total = totals.remove(&labels).unwrap_or_default();
            f.depth.get_or_create(&labels).set(total.depth);
            f.adds.get_or_create(&labels).inc_by(total.new_adds);
            f.unfinished
                .get_or_create(&labels)
                .set(total.unfinished_seconds);
            f.longest.get_or_create(&labels).set(total.longest_seconds);
        }
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    // Every update leaves the state consistent; a panic elsewhere does not poison it.
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

struct ProbeInner {
    families: Families,
    controller: ControllerLabel,
    queue: QueueLabels,
    concurrency: u16,
    state: Arc<Mutex<QueueState>>,
}

impl Drop for ProbeInner {
    fn drop(&mut self) {
        self.families
            .max_concurrent
            .get_or_create(&self.controller)
            .dec_by(i64::from(self.concurrency));
    }
}

/// One running controller's view of its series: what it feeds as keys are queued, taken
/// and done. Cheap to clone; the controller's queue leaves the gauges when the last clone
/// goes.
#[derive(Clone)]
pub struct ControllerProbe {
    inner: Arc<ProbeInner>,
}

impl ControllerProbe {
    /// `key` triggered now (a watch event, a mapped change).
    pub fn trigger(&self, key: ObjectKey) {
        lock(&self.inner.state).schedule(key, Instant::now());
    }

    /// `key` requeued to run after `delay` (after an error, or as its reconcile asked): a
    /// retry, and an add once due.
    pub fn requeue(&self, key: ObjectKey, delay: Duration) {
        self.retry();
        let now = Instant::now();
        let due = now.checked_add(delay).unwrap_or(now + FAR_FUTURE);
        lock(&self.inner.state).schedule(key, due);
    }

    /// A delayed add whose key comes back through [`Self::trigger`] when due (our FIFO
    /// queue's requeues).
    pub fn retry(&self) {
        self.inner
            .families
            .retries
            .get_or_create(&self.inner.queue)
            .inc();
    }

    /// `key` left the queue without running: its object is gone.
    pub fn forget(&self, key: &ObjectKey) {
        if lock(&self.inner.state).forget(key, Instant::now()) {
            self.inner
                .families
                .adds
                .get_or_create(&self.inner.queue)
                .inc();
        }
    }

    /// A worker takes `key`: the work until the returned [`Run`] ends or is dropped.
    pub fn start(&self, key: ObjectKey) -> Run {
        let now = Instant::now();
        let taken = lock(&self.inner.state).take(&key, now);
        let f = &self.inner.families;
        if taken.new_add {
            f.adds.get_or_create(&self.inner.queue).inc();
        }
        f.queue_duration
            .get_or_create(&self.inner.queue)
            .observe(taken.waited);
        f.active_workers.get_or_create(&self.inner.controller).inc();
        Run {
            probe: self.clone(),
            key: Some(key),
            started: now,
        }
    }
}

/// A requeue delay past which a key counts as never due.
const FAR_FUTURE: Duration = Duration::from_secs(365 * 24 * 3600);

/// One reconcile in a worker. Its end is recorded by [`Run::finish`]; dropped without it (the
/// reconcile was canceled at shutdown, or panicked), only the queue's side is.
#[must_use = "the reconcile's result is recorded by finish"]
pub struct Run {
    probe: ControllerProbe,
    key: Option<ObjectKey>,
    started: Instant,
}

impl Run {
    /// The reconcile ended with `result`.
    pub fn finish(self, result: ReconcileResult) {
        let f = &self.probe.inner.families;
        let controller = &self.probe.inner.controller;
        f.reconcile_total
            .get_or_create(&ResultLabels {
                controller: controller.controller,
                result: result.label(),
            })
            .inc();
        if result == ReconcileResult::Error {
            f.reconcile_errors.get_or_create(controller).inc();
        }
        f.reconcile_time
            .get_or_create(controller)
            .observe(self.started.elapsed().as_secs_f64());
    }

    /// The reconcile panicked.
    pub fn panicked(self) {
        let f = &self.probe.inner.families;
        f.reconcile_panics
            .get_or_create(&self.probe.inner.controller)
            .inc();
    }
}

impl Drop for Run {
    fn drop(&mut self) {
        let Some(key) = self.key.take() else {
            return;
        };
        let inner = &self.probe.inner;
        if let Some(seconds) = lock(&inner.state).done(&key, Instant::now()) {
            inner
                .families
                .work_duration
                .get_or_create(&inner.queue)
                .observe(seconds);
        }
        inner
            .families
            .active_workers
            .get_or_create(&inner.controller)
            .dec();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(name: &str) -> ObjectKey {
        ObjectKey {
            namespace: Some("ns".into()),
            name: name.into(),
        }
    }

    #[test]
    fn a_due_key_counts_in_depth_and_once_as_an_add() {
        let t0 = Instant::now();
        let mut q = QueueState::default();
        q.schedule(key("a"), t0);
        q.schedule(key("a"), t0);
        q.schedule(key("b"), t0);
        let s = q.snapshot(t0);
        assert_eq!((s.depth, s.new_adds), (2, 2));
        // Already counted: a second look adds nothing.
        assert_eq!(q.snapshot(t0).new_adds, 0);
        let taken = q.take(&key("a"), t0 + Duration::from_secs(2));
        assert_eq!(
            taken,
            Taken {
                new_add: false,
                waited: 2.0
            }
        );
        assert_eq!(q.snapshot(t0 + Duration::from_secs(2)).depth, 1);
    }

    #[test]
    fn a_delayed_requeue_is_no_add_and_no_depth_until_due() {
        let t0 = Instant::now();
        let mut q = QueueState::default();
        q.schedule(key("a"), t0 + Duration::from_secs(10));
        let before = q.snapshot(t0 + Duration::from_secs(9));
        assert_eq!((before.depth, before.new_adds), (0, 0));
        let after = q.snapshot(t0 + Duration::from_secs(11));
        assert_eq!((after.depth, after.new_adds), (1, 1));
        // Queue duration counts from due, not from the requeue.
        let taken = q.take(&key("a"), t0 + Duration::from_secs(12));
        assert!((taken.waited - 2.0).abs() < 1e-9, "{taken:?}");
    }

    #[test]
    fn the_earlier_due_time_wins() {
        let t0 = Instant::now();
        let mut q = QueueState::default();
        q.schedule(key("a"), t0 + Duration::from_secs(30));
        // A watch event before the requeue is due: the key is due now.
        q.schedule(key("a"), t0);
        assert_eq!(q.snapshot(t0).depth, 1);
        // A later requeue does not postpone it.
        q.schedule(key("a"), t0 + Duration::from_secs(60));
        assert_eq!(q.snapshot(t0).depth, 1);
    }

    #[test]
    fn a_key_triggered_while_it_runs_is_due_again_and_work_is_timed() {
        let t0 = Instant::now();
        let mut q = QueueState::default();
        q.schedule(key("a"), t0);
        let taken = q.take(&key("a"), t0);
        assert!(taken.new_add, "taken before any look: counted at take");
        q.schedule(key("a"), t0 + Duration::from_secs(1));
        let s = q.snapshot(t0 + Duration::from_secs(3));
        assert_eq!(s.depth, 1, "triggered while running counts in depth");
        assert!((s.unfinished_seconds - 3.0).abs() < 1e-9);
        assert!((s.longest_seconds - 3.0).abs() < 1e-9);
        assert_eq!(q.done(&key("a"), t0 + Duration::from_secs(4)), Some(4.0));
        assert_eq!(q.done(&key("a"), t0 + Duration::from_secs(4)), None);
        let s = q.snapshot(t0 + Duration::from_secs(4));
        assert_eq!((s.unfinished_seconds, s.longest_seconds), (0.0, 0.0));
    }

    #[test]
    fn a_forgotten_key_leaves_the_queue() {
        let t0 = Instant::now();
        let mut q = QueueState::default();
        q.schedule(key("gone"), t0);
        assert!(q.forget(&key("gone"), t0), "due and not counted: an add");
        assert_eq!(q.snapshot(t0).depth, 0);
        assert!(!q.forget(&key("gone"), t0));
    }

    fn registry(labels: ObjectLabels) -> (Registry, RuntimeMetrics) {
        let mut registry = Registry::default();
        let metrics = RuntimeMetrics::register(&mut registry, labels);
        (registry, metrics)
    }

    fn text(registry: &Registry) -> String {
        let mut out = String::new();
        prometheus_client::encoding::text::encode(&mut out, registry).expect("encode");
        out
    }

    #[test]
    fn a_controller_exports_controller_runtimes_series_at_zero_from_its_start() {
        let (registry, metrics) = registry(ObjectLabels::Names);
        let probe = metrics.controller(names::STACK, 25);
        metrics.refresh(Instant::now());
        let out = text(&registry);
        for line in [
            "controller_runtime_reconcile_total{controller=\"stack-controller\",result=\"error\"} 0",
            "controller_runtime_reconcile_total{controller=\"stack-controller\",result=\"requeue_after\"} 0",
            "controller_runtime_reconcile_total{controller=\"stack-controller\",result=\"requeue\"} 0",
            "controller_runtime_reconcile_total{controller=\"stack-controller\",result=\"success\"} 0",
            "controller_runtime_reconcile_errors_total{controller=\"stack-controller\"} 0",
            "controller_runtime_reconcile_panics_total{controller=\"stack-controller\"} 0",
            "controller_runtime_max_concurrent_reconciles{controller=\"stack-controller\"} 25",
            "controller_runtime_active_workers{controller=\"stack-controller\"} 0",
            "controller_runtime_reconcile_time_seconds_bucket{le=\"60.0\",controller=\"stack-controller\"} 0",
            "workqueue_depth{name=\"stack-controller\",controller=\"stack-controller\"} 0",
            "workqueue_adds_total{name=\"stack-controller\",controller=\"stack-controller\"} 0",
            "workqueue_retries_total{name=\"stack-controller\",controller=\"stack-controller\"} 0",
            "workqueue_unfinished_work_seconds{name=\"stack-controller\",controller=\"stack-controller\"} 0.0",
            "workqueue_longest_running_processor_seconds{name=\"stack-controller\",controller=\"stack-controller\"} 0.0",
            "workqueue_queue_duration_seconds_count{name=\"stack-controller\",controller=\"stack-controller\"} 0",
            "workqueue_work_duration_seconds_count{name=\"stack-controller\",controller=\"stack-controller\"} 0",
        ] {
            assert!(out.contains(line), "missing {line}:\n{out}");
        }
        assert!(!out.contains("resource_created_at_seconds{"), "{out}");
        drop(probe);
        let out = text(&registry);
        assert!(
            out.contains(
                "controller_runtime_max_concurrent_reconciles{controller=\"stack-controller\"} 0"
            ),
            "{out}"
        );
    }

    #[test]
    fn runs_are_counted_by_result_and_the_queue_follows_them() {
        let (registry, metrics) = registry(ObjectLabels::None);
        let probe = metrics.controller(names::PROGRAM, 2);
        probe.trigger(key("a"));
        probe.trigger(key("b"));
        metrics.refresh(Instant::now());
        let out = text(&registry);
        let queue = "{name=\"program-controller\",controller=\"program-controller\"}";
        assert!(out.contains(&format!("workqueue_depth{queue} 2")), "{out}");
        assert!(
            out.contains(&format!("workqueue_adds_total{queue} 2")),
            "{out}"
        );
        let run = probe.start(key("a"));
        metrics.refresh(Instant::now());
        let out = text(&registry);
        assert!(out.contains(&format!("workqueue_depth{queue} 1")), "{out}");
        assert!(
            out.contains("controller_runtime_active_workers{controller=\"program-controller\"} 1"),
            "{out}"
        );
        run.finish(ReconcileResult::Error);
        probe.requeue(key("a"), Duration::from_secs(3600));
        probe.start(key("b")).finish(ReconcileResult::Success);
        metrics.refresh(Instant::now());
        let out = text(&registry);
        for line in [
            "controller_runtime_reconcile_total{controller=\"program-controller\",result=\"error\"} 1",
            "controller_runtime_reconcile_total{controller=\"program-controller\",result=\"success\"} 1",
            "controller_runtime_reconcile_errors_total{controller=\"program-controller\"} 1",
            "controller_runtime_active_workers{controller=\"program-controller\"} 0",
            "controller_runtime_reconcile_time_seconds_count{controller=\"program-controller\"} 2",
        ] {
            assert!(out.contains(line), "missing {line}:\n{out}");
        }
        // The requeue is a retry, not yet an add, and not in the depth.
        assert!(
            out.contains(&format!("workqueue_retries_total{queue} 1")),
            "{out}"
        );
        assert!(
            out.contains(&format!("workqueue_adds_total{queue} 2")),
            "{out}"
        );
        assert!(out.contains(&format!("workqueue_depth{queue} 0")), "{out}");
        assert!(
            out.contains(&format!("workqueue_work_duration_seconds_count{queue} 2")),
            "{out}"
        );
    }

    #[test]
    fn two_instances_of_one_controller_add_up_and_a_stopped_one_leaves_zeros() {
        let (registry, metrics) = registry(ObjectLabels::None);
        let a = metrics.controller(names::UPDATE, 3);
        let b = metrics.controller(names::UPDATE, 3);
        a.trigger(key("x"));
        b.trigger(key("y"));
        metrics.refresh(Instant::now());
        let out = text(&registry);
        assert!(
            out.contains(
                "controller_runtime_max_concurrent_reconciles{controller=\"update-controller\"} 6"
            ),
            "{out}"
        );
        assert!(
            out.contains(
                "workqueue_depth{name=\"update-controller\",controller=\"update-controller\"} 2"
            ),
            "{out}"
        );
        drop((a, b));
        metrics.refresh(Instant::now());
        let out = text(&registry);
        assert!(
            out.contains(
                "workqueue_depth{name=\"update-controller\",controller=\"update-controller\"} 0"
            ),
            "{out}"
        );
    }
}
