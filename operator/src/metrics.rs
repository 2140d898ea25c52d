//! Prometheus metrics, served on `/metrics` of the probe/metrics listener.
//!
//! One registry per process; every component gets a cheap clone of the families it updates.

use std::sync::Arc;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::metrics::info::Info;
use prometheus_client::registry::Registry;

/// Labels of per-controller series.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ControllerLabels {
    pub controller: String,
}

/// Labels of reconcile errors.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ErrorLabels {
    pub controller: String,
    pub error: String,
}

/// Labels of file-server requests.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct RequestLabels {
    pub method: String,
    pub code: u16,
}

/// Labels of per-Stack series (PKO's `stacks_failing` / `stacks_reconciling`).
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct StackLabels {
    pub namespace: String,
    pub name: String,
}

/// Labels of the build-info series.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct BuildLabels {
    pub version: String,
}

fn latency_histogram() -> Histogram {
    // 100 µs … ~13 s: file-server hits are sub-millisecond, reconciles up to seconds.
    Histogram::new(exponential_buckets(0.0001, 2.0, 18))
}

/// Every metric the operator exports.
#[derive(Clone)]
pub struct Metrics {
    registry: Arc<Registry>,
    /// PKO's `programs_active`: Programs currently known to this replica.
    pub programs_active: Gauge,
    /// PKO's `stacks_active`: Stacks currently known to this replica.
    pub stacks_active: Gauge,
    /// PKO's `stacks_failing{namespace,name}`: 1 while the Stack's last update failed.
    pub stacks_failing: Family<StackLabels, Gauge>,
    /// PKO's `stacks_reconciling{namespace,name}`: 1 while the Stack is `Reconciling=True`.
    pub stacks_reconciling: Family<StackLabels, Gauge>,
    /// 1 while this replica holds the leader lease (or runs without leader election).
    pub leader: Gauge,
    pub reconciles: Family<ControllerLabels, Counter>,
    pub reconcile_errors: Family<ErrorLabels, Counter>,
    pub reconcile_duration: Family<ControllerLabels, Histogram>,
    pub fileserver_requests: Family<RequestLabels, Counter>,
    pub fileserver_duration: Histogram,
    pub fileserver_cache_hits: Counter,
    pub fileserver_cache_misses: Counter,
    pub fileserver_cache_bytes: Gauge,
    /// Transform plugin calls, errors, latency and fuel (`pko_plugin_*`).
    pub plugins: pko_plugins::PluginMetrics,
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    pub fn new() -> Self {
        Self::with_extra(|_| {})
    }

    /// Like [`Self::new`], with more metrics registered by `extra` (components living in
    /// other crates, e.g. the admission webhook), served on the same `/metrics`.
    pub fn with_extra(extra: impl FnOnce(&mut Registry)) -> Self {
        let mut registry = Registry::default();
        extra(&mut registry);
        let plugins = pko_plugins::PluginMetrics::new();
        plugins.register(&mut registry);
        let programs_active = Gauge::default();
        registry.register(
            "programs_active",
            "Number of Program objects known to the operator",
            programs_active.clone(),
        );
        let stacks_active = Gauge::default();
        registry.register(
            "stacks_active",
            "Number of stacks currently tracked by the operator",
            stacks_active.clone(),
        );
        let stacks_failing = Family::<StackLabels, Gauge>::default();
        registry.register(
            "stacks_failing",
            "1 for each stack whose last update failed, 0 otherwise",
            stacks_failing.clone(),
        );
        let stacks_reconciling = Family::<StackLabels, Gauge>::default();
        registry.register(
            "stacks_reconciling",
            "1 for each stack with Reconciling=True, 0 otherwise",
            stacks_reconciling.clone(),
        );
        let leader = Gauge::default();
        registry.register(
            "pko_leader",
            "1 while this replica is the leader and runs the controllers",
            leader.clone(),
        );
        let reconciles = Family::<ControllerLabels, Counter>::default();
        registry.register(
            "pko_reconciles",
            "Reconciliations run, by controller",
            reconciles.clone(),
        );
        let reconcile_errors = Family::<ErrorLabels, Counter>::default();
        registry.register(
            "pko_reconcile_errors",
            "Reconciliations that failed, by controller and error kind",
            reconcile_errors.clone(),
        );
        let reconcile_duration =
            Family::<ControllerLabels, Histogram>::new_with_constructor(latency_histogram);
        registry.register(
            "pko_reconcile_duration_seconds",
            "Duration of reconciliations, by controller",
            reconcile_duration.clone(),
        );
        let fileserver_requests = Family::<RequestLabels, Counter>::default();
        registry.register(
            "pko_fileserver_requests",
            "Program file-server requests, by method and status code",
            fileserver_requests.clone(),
        );
        let fileserver_duration = latency_histogram();
        registry.register(
            "pko_fileserver_request_duration_seconds",
            "Program file-server request latency",
            fileserver_duration.clone(),
        );
        let fileserver_cache_hits = Counter::default();
        registry.register(
            "pko_fileserver_cache_hits",
            "Artifact requests answered from the artifact cache",
            fileserver_cache_hits.clone(),
        );
        let fileserver_cache_misses = Counter::default();
        registry.register(
            "pko_fileserver_cache_misses",
            "Artifact requests that had to build the artifact",
            fileserver_cache_misses.clone(),
        );
        let fileserver_cache_bytes = Gauge::default();
        registry.register(
            "pko_fileserver_cache_bytes",
            "Bytes of artifacts held in the artifact cache",
            fileserver_cache_bytes.clone(),
        );
        registry.register(
            "pko_build",
            "Build information",
            Info::new(BuildLabels {
                version: env!("CARGO_PKG_VERSION").to_owned(),
            }),
        );
        Self {
            registry: Arc::new(registry),
            programs_active,
            stacks_active,
            stacks_failing,
            stacks_reconciling,
            leader,
            reconciles,
            reconcile_errors,
            reconcile_duration,
            fileserver_requests,
            fileserver_duration,
            fileserver_cache_hits,
            fileserver_cache_misses,
            fileserver_cache_bytes,
            plugins,
        }
    }

    /// The OpenMetrics text exposition of every registered metric.
    pub fn encode(&self) -> Result<String, std::fmt::Error> {
        let mut out = String::new();
        prometheus_client::encoding::text::encode(&mut out, &self.registry)?;
        Ok(out)
    }

    /// Creates a controller's series at zero, so they are exported (and `rate()` works) before
    /// its first reconcile or error. Called when the controller starts, i.e. on the leader.
    pub fn init_controller(&self, controller: &str, error_kinds: &[&str]) {
        let labels = self.controller(controller);
        drop(self.reconciles.get_or_create(&labels));
        drop(self.reconcile_duration.get_or_create(&labels));
        for kind in error_kinds {
            drop(self.reconcile_errors.get_or_create(&ErrorLabels {
                controller: controller.to_owned(),
                error: (*kind).to_owned(),
            }));
        }
    }

    pub fn controller(&self, name: &str) -> ControllerLabels {
        ControllerLabels {
            controller: name.to_owned(),
        }
    }
}
