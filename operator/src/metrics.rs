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

use crate::runtime_metrics::RuntimeMetrics;

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
    /// `GET`, `HEAD` or `OTHER`: the method comes from the client, and any token is a method.
    pub method: &'static str,
    pub code: u16,
}

impl RequestLabels {
    /// Labels of one request; every method but GET and HEAD counts as `OTHER`, so clients
    /// cannot add series.
    pub fn new(method: &http::Method, code: http::StatusCode) -> Self {
        let method = match *method {
            http::Method::GET => "GET",
            http::Method::HEAD => "HEAD",
            _ => "OTHER",
        };
        Self {
            method,
            code: code.as_u16(),
        }
    }
}

/// How a file-server request for a Program this replica had not seen yet ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PublishWaitOutcome {
    /// The replica's watch delivered it within the wait.
    Seen,
    /// Still unknown when the wait ended: answered 404.
    NotSeen,
    /// Too many requests were waiting already: answered at once.
    Overflow,
}

impl PublishWaitOutcome {
    const ALL: [Self; 3] = [Self::Seen, Self::NotSeen, Self::Overflow];

    pub fn labels(self) -> OutcomeLabels {
        OutcomeLabels {
            outcome: match self {
                Self::Seen => "seen",
                Self::NotSeen => "not_seen",
                Self::Overflow => "overflow",
            },
        }
    }
}

/// Why the file server refused an artifact request (answered like an unknown Program).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RefusalReason {
    /// No `digest` and `token` in the URL.
    NoToken,
    /// A token that these keys did not mint for this artifact.
    BadToken,
}

impl RefusalReason {
    const ALL: [Self; 2] = [Self::NoToken, Self::BadToken];

    pub fn labels(self) -> ReasonLabels {
        ReasonLabels {
            reason: match self {
                Self::NoToken => "no_token",
                Self::BadToken => "bad_token",
            },
        }
    }
}

/// Labels of refusal counters (a fixed set of values).
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ReasonLabels {
    pub reason: &'static str,
}

/// Labels of outcome counters (a fixed set of values).
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct OutcomeLabels {
    pub outcome: &'static str,
}

/// Whether per-object series name their object (`--metrics-object-labels`). Whoever reads
/// `/metrics` reads every label, so in a cluster shared by tenants the names stay out.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum ObjectLabels {
    /// PKO's series: `stacks_failing{namespace,name}` per Stack, and `pko_plugin_*` by
    /// transform object and plugin name. One series per object, removed with it.
    #[default]
    Names,
    /// No namespace, name or plugin name in any label: the per-Stack gauges become counts
    /// of Stacks, and the plugin series are by transform kind. A fixed set of series.
    None,
}

/// PKO's per-Stack gauges, or their counts when object labels are off.
#[derive(Clone)]
pub enum StackSeries {
    /// `stacks_failing{namespace,name}` and `stacks_reconciling{namespace,name}`: 0 or 1 per
    /// Stack.
    PerStack {
        failing: Family<StackLabels, Gauge>,
        reconciling: Family<StackLabels, Gauge>,
        /// `stacks_drifted{namespace,name}` (pko-rs): the last drift check found changes.
        drifted: Family<StackLabels, Gauge>,
        /// `stacks_awaiting_approval{namespace,name}` (pko-rs): a plan awaits approval.
        awaiting_approval: Family<StackLabels, Gauge>,
    },
    /// `stacks_failing`, `stacks_reconciling`, `stacks_drifted` and
    /// `stacks_awaiting_approval` without labels: how many Stacks are.
    Counted {
        failing: Gauge,
        reconciling: Gauge,
        drifted: Gauge,
        awaiting_approval: Gauge,
    },
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
    /// PKO's `stacks_failing` (the Stack's last update failed) and `stacks_reconciling` (the
    /// Stack is `Reconciling=True`), per Stack or counted.
    pub stacks: StackSeries,
    /// How long the drift checks of Stacks took, from the start of their operation to its end.
    pub drift_check_duration: Histogram,
    /// `workspaces_idle`: Workspaces whose pod `spec.idle` has stopped (`Ready=False`, reason
    /// `Idle`), counted by a Workspace watch on every replica.
    pub workspaces_idle: Gauge,
    /// How long Updates waited for an idle workspace: from first finding it stopped to their
    /// operation running.
    pub workspace_wake_duration: Histogram,
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
    /// Requests for a Program or generation not seen yet, by how the wait for the watch ended.
    pub fileserver_publish_waits: Family<OutcomeLabels, Counter>,
    /// How long those requests waited.
    pub fileserver_publish_wait_duration: Histogram,
    /// Artifact requests refused for lack of a valid capability token.
    pub fileserver_refused: Family<ReasonLabels, Counter>,
    /// Transform plugin calls, errors, latency and fuel (`pko_plugin_*`).
    pub plugins: pko_plugin_host::PluginMetrics,
    /// PKO's controller-runtime, work-queue, REST-client and `resource_created_at_seconds`
    /// series.
    pub runtime: RuntimeMetrics,
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    pub fn new() -> Self {
        Self::with_extra(ObjectLabels::Names, |_| {})
    }

    /// Like [`Self::new`], with per-object series as `object_labels` says, and more metrics
    /// registered by `extra` (components living in other crates, e.g. the admission webhook),
    /// served on the same `/metrics`.
    #[allow(
        clippy::too_many_lines,
        reason = "one registration per metric, in the order /metrics lists them"
    )]
    pub fn with_extra(object_labels: ObjectLabels, extra: impl FnOnce(&mut Registry)) -> Self {
        let mut registry = Registry::default();
        extra(&mut registry);
        registry.register_collector(Box::new(crate::process_metrics::ProcessCollector));
        let plugins = match object_labels {
            ObjectLabels::Names => pko_plugin_host::PluginMetrics::new(),
            ObjectLabels::None => pko_plugin_host::PluginMetrics::without_object_labels(),
        };
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
        let stacks = match object_labels {
            ObjectLabels::Names => {
                let failing = Family::<StackLabels, Gauge>::default();
                registry.register(
                    "stacks_failing",
                    "1 for each stack whose last update failed, 0 otherwise",
                    failing.clone(),
                );
                let reconciling = Family::<StackLabels, Gauge>::default();
                registry.register(
                    "stacks_reconciling",
                    "1 for each stack with Reconciling=True, 0 otherwise",
                    reconciling.clone(),
                );
                let drifted = Family::<StackLabels, Gauge>::default();
                registry.register(
                    "stacks_drifted",
                    "1 for each stack whose last drift check found resources changed outside Pulumi (DriftDetected=True), 0 otherwise",
                    drifted.clone(),
                );
                let awaiting_approval = Family::<StackLabels, Gauge>::default();
                registry.register(
                    "stacks_awaiting_approval",
                    "1 for each stack whose plan awaits approval (spec.approval; PlanApproved=False, reason AwaitingApproval or ApprovalRefused), 0 otherwise",
                    awaiting_approval.clone(),
                );
                StackSeries::PerStack {
                    failing,
                    reconciling,
                    drifted,
                    awaiting_approval,
                }
            }
            ObjectLabels::None => {
                let failing = Gauge::default();
                registry.register(
                    "stacks_failing",
                    "Number of stacks whose last update failed",
                    failing.clone(),
                );
                let reconciling = Gauge::default();
                registry.register(
                    "stacks_reconciling",
                    "Number of stacks with Reconciling=True",
                    reconciling.clone(),
                );
                let drifted = Gauge::default();
                registry.register(
                    "stacks_drifted",
                    "Number of stacks whose last drift check found resources changed outside Pulumi",
                    drifted.clone(),
                );
                let awaiting_approval = Gauge::default();
                registry.register(
                    "stacks_awaiting_approval",
                    "Number of stacks whose plan awaits approval (spec.approval)",
                    awaiting_approval.clone(),
                );
                StackSeries::Counted {
                    failing,
                    reconciling,
                    drifted,
                    awaiting_approval,
                }
            }
        };
        // 1 s … ~68 min: a refresh takes seconds for a small stack, minutes for a large one.
        let drift_check_duration = Histogram::new(exponential_buckets(1.0, 2.0, 13));
        registry.register(
            "pko_drift_check_duration_seconds",
            "Duration of Stack drift checks (preview-only refreshes), start to end of the operation",
            drift_check_duration.clone(),
        );
        let workspaces_idle = Gauge::default();
        registry.register(
            "workspaces_idle",
            "Number of workspaces whose pod is stopped by spec.idle (Ready=False, reason Idle)",
            workspaces_idle.clone(),
        );
        // 0.5 s … ~68 min: a wake is a pod start, a source fetch and a plugin install.
        let workspace_wake_duration = Histogram::new(exponential_buckets(0.5, 2.0, 14));
        registry.register(
            "pko_workspace_wake_duration_seconds",
            "How long Updates waited for an idle workspace (spec.idle): from finding its pod stopped to their operation running",
            workspace_wake_duration.clone(),
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
        let fileserver_publish_waits = Family::<OutcomeLabels, Counter>::default();
        for outcome in PublishWaitOutcome::ALL {
            drop(fileserver_publish_waits.get_or_create(&outcome.labels()));
        }
        registry.register(
            "pko_fileserver_publish_waits",
            "Requests for a Program or generation this replica had not seen yet, by how the wait for its watch ended",
            fileserver_publish_waits.clone(),
        );
        let fileserver_publish_wait_duration = latency_histogram();
        registry.register(
            "pko_fileserver_publish_wait_duration_seconds",
            "How long requests waited for this replica's watch to deliver a Program",
            fileserver_publish_wait_duration.clone(),
        );
        let fileserver_refused = Family::<ReasonLabels, Counter>::default();
        for reason in RefusalReason::ALL {
            drop(fileserver_refused.get_or_create(&reason.labels()));
        }
        registry.register(
            "pko_fileserver_refused",
            "Artifact requests refused for lack of a valid URL token, by reason (answered as 404)",
            fileserver_refused.clone(),
        );
        registry.register(
            "pko_build",
            "Build information",
            Info::new(BuildLabels {
                version: env!("CARGO_PKG_VERSION").to_owned(),
            }),
        );
        let runtime = RuntimeMetrics::register(&mut registry, object_labels);
        Self {
            registry: Arc::new(registry),
            programs_active,
            stacks_active,
            stacks,
            drift_check_duration,
            workspaces_idle,
            workspace_wake_duration,
            leader,
            reconciles,
            reconcile_errors,
            reconcile_duration,
            fileserver_requests,
            fileserver_duration,
            fileserver_cache_hits,
            fileserver_cache_misses,
            fileserver_cache_bytes,
            fileserver_publish_waits,
            fileserver_publish_wait_duration,
            fileserver_refused,
            plugins,
            runtime,
        }
    }

    /// The OpenMetrics text exposition of every registered metric.
    pub fn encode(&self) -> Result<String, std::fmt::Error> {
        // The work-queue gauges are read off the queues now, as client-go's are every 500 ms.
        self.runtime.refresh(std::time::Instant::now());
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
