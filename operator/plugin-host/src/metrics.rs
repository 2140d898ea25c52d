//! Per-plugin Prometheus metrics: by transform object and plugin name, or (without object
//! labels) by transform kind only, so no tenant's names reach `/metrics`.

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
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

/// The label values one transform's calls used: (plugin, function, outcome).
type Seen = std::collections::HashMap<String, std::collections::HashSet<(String, String, String)>>;

/// Every plugin metric. Clones share the series.
#[derive(Clone)]
pub struct PluginMetrics {
    /// What each transform recorded, so its series go when it does.
    seen: std::sync::Arc<std::sync::Mutex<Seen>>,
    /// Whether series name the transform object and the plugin (see [`Self::new`] and
    /// [`Self::without_object_labels`]).
    object_labels: bool,
    pub calls: Family<CallLabels, Counter>,
    pub errors: Family<ErrorLabels, Counter>,
    pub duration: Family<PluginLabels, Histogram>,
    pub fuel: Family<PluginLabels, Histogram>,
    pub fuel_total: Family<PluginLabels, Counter>,
    pub loads: Family<LoadLabels, Counter>,
    pub load_duration: Family<LoadLabels, Histogram>,
    /// Module loads (fetch and compile) holding one of the load slots.
    pub loads_in_flight: Gauge,
    /// Module loads waiting for a load slot.
    pub loads_waiting: Gauge,
}

impl Default for PluginMetrics {
    fn default() -> Self {
        Self::new()
    }
}

impl PluginMetrics {
    /// Unregistered metrics (see [`Self::register`]) whose series name the transform object
    /// and the plugin, and go when the transform does ([`Self::forget`]).
    pub fn new() -> Self {
        Self::build(true)
    }

    /// Like [`Self::new`], but the `transform` label is only the object's kind
    /// (`ProgramTransform`, `ClusterProgramTransform`, or `other`) and the `plugin` label is
    /// empty: a fixed set of series that name no namespace, object or guest-chosen plugin
    /// name, kept for the life of the process.
    pub fn without_object_labels() -> Self {
        Self::build(false)
    }

    fn build(object_labels: bool) -> Self {
        Self {
            seen: std::sync::Arc::default(),
            object_labels,
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
            loads_in_flight: Gauge::default(),
            loads_waiting: Gauge::default(),
        }
    }

    /// Records one call of `transform`'s `plugin`: its latency, and its fuel or its error kind.
    pub fn record_call(
        &self,
        transform: &str,
        plugin: &str,
        function: &str,
        elapsed: std::time::Duration,
        result: Result<u64, &str>,
    ) {
        let (transform, plugin) = if self.object_labels {
            (transform.to_owned(), label_value(plugin))
        } else {
            (kind_of(transform).to_owned(), String::new())
        };
        let transform = transform.as_str();
        let labels = PluginLabels {
            transform: transform.to_owned(),
            plugin: plugin.clone(),
        };
        self.duration
            .get_or_create(&labels)
            .observe(elapsed.as_secs_f64());
        let outcome = match result {
            Ok(fuel) => {
                self.fuel.get_or_create(&labels).observe(fuel as f64);
                self.fuel_total.get_or_create(&labels).inc_by(fuel);
                "ok"
            }
            Err(kind) => {
                self.errors
                    .get_or_create(&ErrorLabels {
                        transform: transform.to_owned(),
                        plugin: plugin.clone(),
                        kind: kind.to_owned(),
                    })
                    .inc();
                kind
            }
        };
        self.calls
            .get_or_create(&CallLabels {
                transform: transform.to_owned(),
                plugin: plugin.clone(),
                function: function.to_owned(),
                outcome: outcome.to_owned(),
            })
            .inc();
        // Series by kind are shared by every transform of the kind: none of them owns them.
        if !self.object_labels {
            return;
        }
        self.seen
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .entry(transform.to_owned())
            .or_default()
            .insert((plugin, function.to_owned(), outcome.to_owned()));
    }

    /// Removes every series of `transform` (deleted, or now running another module), so
    /// transforms that come and go leave no series behind.
    pub fn forget(&self, transform: &str) {
        let seen = self
            .seen
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .remove(transform)
            .unwrap_or_default();
        for (plugin, function, outcome) in seen {
            let labels = PluginLabels {
                transform: transform.to_owned(),
                plugin: plugin.clone(),
            };
            self.duration.remove(&labels);
            self.fuel.remove(&labels);
            self.fuel_total.remove(&labels);
            self.errors.remove(&ErrorLabels {
                transform: transform.to_owned(),
                plugin: plugin.clone(),
                kind: outcome.clone(),
            });
            self.calls.remove(&CallLabels {
                transform: transform.to_owned(),
                plugin,
                function,
                outcome,
            });
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
        registry.register(
            "pko_plugin_module_loads_in_flight",
            "Module loads (fetch and compile) holding one of the --plugin-max-concurrent-loads slots",
            self.loads_in_flight.clone(),
        );
        registry.register(
            "pko_plugin_module_loads_waiting",
            "Module loads waiting for a load slot",
            self.loads_waiting.clone(),
        );
    }
}

/// The kind of a transform label `<Kind>/...`: one of a fixed set, whatever the caller passes.
fn kind_of(transform: &str) -> &'static str {
    match transform.split_once('/') {
        Some(("ProgramTransform", _)) => "ProgramTransform",
        Some(("ClusterProgramTransform", _)) => "ClusterProgramTransform",
        _ => "other",
    }
}

/// A plugin's own name as a label value: the guest chooses it, so it is cut to 63 characters
/// of `[A-Za-z0-9._-]` (others become `_`), and an empty one is `unknown`.
fn label_value(name: &str) -> String {
    if name.is_empty() {
        return "unknown".into();
    }
    name.chars()
        .take(63)
        .map(|c| {
            if c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-') {
                c
            } else {
                '_'
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn encode(metrics: &PluginMetrics) -> String {
        let mut registry = Registry::default();
        metrics.register(&mut registry);
        let mut out = String::new();
        prometheus_client::encoding::text::encode(&mut out, &registry).expect("encode");
        out
    }

    #[test]
    fn a_forgotten_transform_leaves_no_series_and_names_are_bounded() {
        let metrics = PluginMetrics::new();
        let elapsed = std::time::Duration::from_millis(1);
        metrics.record_call("ProgramTransform/a/t", "tags", "transform", elapsed, Ok(10));
        metrics.record_call(
            "ProgramTransform/a/t",
            "tags",
            "transform",
            elapsed,
            Err("trap"),
        );
        metrics.record_call(
            "ProgramTransform/b/u",
            "tags",
            "validate-config",
            elapsed,
            Ok(5),
        );
        let hostile = format!("{}\"}} evil", "x".repeat(500));
        metrics.record_call(
            "ProgramTransform/a/t",
            &hostile,
            "transform",
            elapsed,
            Ok(1),
        );
        let text = encode(&metrics);
        assert!(
            text.contains(&format!("plugin=\"{}\"", "x".repeat(63))),
            "{text}"
        );
        assert!(!text.contains(&"x".repeat(64)), "{text}");
        assert!(!text.contains("evil"), "{text}");

        metrics.forget("ProgramTransform/a/t");
        let text = encode(&metrics);
        assert!(!text.contains("ProgramTransform/a/t"), "{text}");
        assert!(text.contains("ProgramTransform/b/u"), "{text}");
        assert_eq!(label_value(""), "unknown");
        assert_eq!(label_value("naming-policy_1.0"), "naming-policy_1.0");
    }

    #[test]
    fn without_object_labels_series_are_by_kind_and_outlive_transforms() {
        let metrics = PluginMetrics::without_object_labels();
        let elapsed = std::time::Duration::from_millis(1);
        metrics.record_call(
            "ProgramTransform/team-a/t",
            "acme-tags",
            "transform",
            elapsed,
            Ok(10),
        );
        metrics.record_call(
            "ProgramTransform/team-b/u",
            "beta-tags",
            "transform",
            elapsed,
            Ok(5),
        );
        metrics.record_call(
            "ClusterProgramTransform/naming",
            "naming",
            "transform",
            elapsed,
            Err("trap"),
        );
        metrics.record_call("plugin-test", "x", "info", elapsed, Ok(1));
        let text = encode(&metrics);
        for name in ["team-a", "team-b", "acme", "beta", "naming", "plugin-test"] {
            assert!(!text.contains(name), "{name} in:\n{text}");
        }
        let calls = "pko_plugin_calls_total{transform=\"ProgramTransform\",plugin=\"\",function=\"transform\",outcome=\"ok\"} 2";
        assert!(text.contains(calls), "{text}");
        assert!(
            text.contains("pko_plugin_fuel_total{transform=\"ProgramTransform\",plugin=\"\"} 15"),
            "{text}"
        );
        assert!(
            text.contains("pko_plugin_errors_total{transform=\"ClusterProgramTransform\",plugin=\"\",kind=\"trap\"} 1"),
            "{text}"
        );
        assert!(text.contains("transform=\"other\""), "{text}");
        // One transform going leaves the counts of its kind alone.
        metrics.forget("ProgramTransform/team-a/t");
        assert!(encode(&metrics).contains(calls));
    }
}
