//! Per-plugin Prometheus metrics.

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;

/// Labels of per-plugin series: the transform object and the plugin it runs.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct PluginLabels {
    /// `ProgramTransform/<ns>/<name>` or `ClusterProgramTransform/<name>`.
    pub transform: String,
    /// The plugin's own name (from `info`).
    pub plugin: String,
}

/// Labels of calls: which function, and how it ended (`ok` or an error kind).
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct CallLabels {
    pub transform: String,
    pub plugin: String,
    pub function: String,
    pub outcome: String,
}

/// Labels of failed calls and loads.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ErrorLabels {
    pub transform: String,
    pub plugin: String,
    pub kind: String,
}

/// Labels of module loads: compiled now, or read from the precompiled cache.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct LoadLabels {
    pub source: String,
}

/// Every plugin metric. Clones share the series.
#[derive(Clone)]
pub struct PluginMetrics {
    pub calls: Family<CallLabels, Counter>,
    pub errors: Family<ErrorLabels, Counter>,
    pub duration: Family<PluginLabels, Histogram>,
    pub fuel: Family<PluginLabels, Histogram>,
    pub fuel_total: Family<PluginLabels, Counter>,
    pub loads: Family<LoadLabels, Counter>,
    pub load_duration: Family<LoadLabels, Histogram>,
}

impl Default for PluginMetrics {
    fn default() -> Self {
        Self::new()
    }
}

impl PluginMetrics {
    /// Unregistered metrics (see [`Self::register`]).
    pub fn new() -> Self {
        Self {
            calls: Family::default(),
            errors: Family::default(),
            // 10 µs … ~40 s: a warm call is tens of microseconds, the timeout ceiling 30 s.
            duration: Family::new_with_constructor(|| {
                Histogram::new(exponential_buckets(0.000_01, 2.0, 22))
            }),
            // 10k … ~50G units.
            fuel: Family::new_with_constructor(|| {
                Histogram::new(exponential_buckets(10_000.0, 4.0, 12))
            }),
            fuel_total: Family::default(),
            loads: Family::default(),
            // 100 µs … ~6 s: a cache load is sub-millisecond, a compile tens of milliseconds.
            load_duration: Family::new_with_constructor(|| {
                Histogram::new(exponential_buckets(0.000_1, 2.0, 16))
            }),
        }
    }

    /// Adds every series to `registry`.
    pub fn register(&self, registry: &mut Registry) {
        registry.register(
            "pko_plugin_calls",
            "Plugin calls, by transform, plugin, function and outcome (ok or an error kind)",
            self.calls.clone(),
        );
        registry.register(
            "pko_plugin_errors",
            "Plugin failures (calls and loads), by transform, plugin and error kind",
            self.errors.clone(),
        );
        registry.register(
            "pko_plugin_call_duration_seconds",
            "Plugin call latency including instantiation, by transform and plugin",
            self.duration.clone(),
        );
        registry.register(
            "pko_plugin_fuel_consumed",
            "Fuel consumed per plugin call, by transform and plugin",
            self.fuel.clone(),
        );
        registry.register(
            "pko_plugin_fuel",
            "Fuel consumed by plugin calls in total, by transform and plugin",
            self.fuel_total.clone(),
        );
        registry.register(
            "pko_plugin_module_loads",
            "Plugin modules loaded, by source (compiled or cache)",
            self.loads.clone(),
        );
        registry.register(
            "pko_plugin_module_load_duration_seconds",
            "Time to compile or deserialize a plugin module, by source",
            self.load_duration.clone(),
        );
    }
}
