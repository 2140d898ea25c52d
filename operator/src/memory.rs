//! How the container's memory is shared, decided once at start-up.
//!
//! Five things grow with load: the operator's own state (watch caches, buffers), the artifact
//! cache, transform plugin calls (each reserves its memory cap from a shared budget),
//! admission evaluations (each slot holds a parsed review and a policy instance) and module
//! compilers (child processes, each under its own data limit). With a known
//! limit (the cgroup's, or `--memory-limit`), unset shares are derived so the sum fits, and a
//! configuration that cannot fit is refused before anything starts, with every term named.
//! Without a limit the configured values are used as they are.

use std::path::Path;

/// What the operator itself needs besides the budgets below (watch caches, HTTP and gRPC
/// buffers, the runtime): measured at ~40 MiB with a thousand Programs, doubled for headroom.
pub const BASELINE_BYTES: u64 = 96 << 20;
/// The artifact cache when nothing sets it and no limit is known.
pub const DEFAULT_ARTIFACT_CACHE_BYTES: u64 = 256 << 20;
/// Admission evaluations at once when derived from memory.
pub const MAX_DERIVED_ADMISSION_SLOTS: usize = 16;
/// Admission evaluations at once when no limit is known and none is set.
pub const DEFAULT_ADMISSION_SLOTS: usize = 4;
/// A module compiler's data limit when none is set: an eighth of the container within these
/// bounds (a Rust plugin of a few hundred KiB compiles in about 24 MiB), the upper one when
/// no limit is known.
pub const COMPILE_MEMORY_BOUNDS: (u64, u64) = (32 << 20, 256 << 20);
const MIB: u64 = 1 << 20;

/// Errors of the memory plan.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum MemoryError {
    #[error("invalid memory quantity {0:?} (bytes, or a number with Ki, Mi, Gi, K, M or G)")]
    Quantity(String),
    #[error(
        "the configuration needs {needed} MiB but the container has {limit} MiB: {terms}. Raise the memory limit, or lower the terms named (flags: --artifact-cache-bytes, --plugin-memory-budget-mib, --plugin-compile-memory-mib, --plugin-max-concurrent-loads, --policy-concurrency, --policy-memory-mib, --webhook-body-budget-mib)"
    )]
    DoesNotFit {
        needed: u64,
        limit: u64,
        terms: String,
    },
    #[error(
        "plugin memory budget of {budget} MiB is below the default plugin memory cap of {cap} MiB: no plugin could run. Raise the memory limit or --plugin-memory-budget-mib, or lower --plugin-default-memory-mib"
    )]
    PluginsStarved { budget: u64, cap: u64 },
}

/// What the configuration asks for; `None` means "derive it".
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Demands {
    /// `--artifact-cache-bytes`.
    pub artifact_cache_bytes: Option<u64>,
    /// `--plugin-memory-budget-mib`, in bytes; `Some(0)` when plugins are off.
    pub plugin_budget_bytes: Option<u64>,
    /// The memory cap of a plugin that sets none (the budget must hold at least one).
    pub plugin_default_bytes: u64,
    /// Without a limit: the budget plugins get (every slot at the ceiling).
    pub plugin_unlimited_bytes: u64,
    /// The webhook's needs, when it runs.
    pub admission: Option<AdmissionDemand>,
    /// Module compilers at once (children of the operator, in the same container); 0 when
    /// plugins are off.
    pub compile_slots: u64,
    /// `--plugin-compile-memory-mib`, in bytes: each compiler's data limit.
    pub compile_memory_bytes: Option<u64>,
}

/// What the admission webhook needs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AdmissionDemand {
    /// Memory of one evaluation slot (policy instance + parsed review).
    pub per_slot_bytes: u64,
    /// Memory of bodies being read, whatever the slots.
    pub fixed_bytes: u64,
    /// `--policy-concurrency`.
    pub slots: Option<usize>,
}

/// The shares decided.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Plan {
    pub limit_bytes: Option<u64>,
    pub artifact_cache_bytes: u64,
    pub plugin_budget_bytes: u64,
    pub admission_slots: usize,
    /// Each module compiler's data limit.
    pub compile_memory_bytes: u64,
}

impl Plan {
    /// One log line's worth.
    pub fn describe(&self) -> String {
        format!(
            "memory limit {}, baseline {} MiB, artifact cache {} MiB, plugin budget {} MiB, admission slots {}, module compiler {} MiB each",
            self.limit_bytes
                .map_or("none".to_owned(), |l| format!("{} MiB", l / MIB)),
            BASELINE_BYTES / MIB,
            self.artifact_cache_bytes / MIB,
            self.plugin_budget_bytes / MIB,
            self.admission_slots,
            self.compile_memory_bytes / MIB
        )
    }
}

/// The shares for `demands` within `limit` (pure: the caller reads the limit).
pub fn plan(limit: Option<u64>, demands: &Demands) -> Result<Plan, MemoryError> {
    let (low, high) = COMPILE_MEMORY_BOUNDS;
    let compile_memory = demands
        .compile_memory_bytes
        .unwrap_or_else(|| limit.map_or(high, |l| (l / 8).clamp(low, high)));
    let compile_bytes = demands.compile_slots * compile_memory;
    let Some(limit) = limit else {
        return Ok(Plan {
            limit_bytes: None,
            artifact_cache_bytes: demands
                .artifact_cache_bytes
                .unwrap_or(DEFAULT_ARTIFACT_CACHE_BYTES),
            plugin_budget_bytes: demands
                .plugin_budget_bytes
                .unwrap_or(demands.plugin_unlimited_bytes),
            admission_slots: demands
                .admission
                .map_or(0, |a| a.slots.unwrap_or(DEFAULT_ADMISSION_SLOTS).max(1)),
            compile_memory_bytes: compile_memory,
        });
    };
    // A quarter of the container at most, unless set.
    let cache = demands
        .artifact_cache_bytes
        .unwrap_or_else(|| DEFAULT_ARTIFACT_CACHE_BYTES.min(limit / 4));
    let fixed = demands.admission.map_or(0, |a| a.fixed_bytes) + compile_bytes;
    let available = limit.saturating_sub(BASELINE_BYTES + cache + fixed);
    let (slots, plugins) = match demands.admission {
        None => (0, demands.plugin_budget_bytes.unwrap_or(available)),
        Some(admission) => {
            let per_slot = admission.per_slot_bytes.max(1);
            match (admission.slots, demands.plugin_budget_bytes) {
                (Some(slots), Some(plugins)) => (slots.max(1), plugins),
                (Some(slots), None) => {
                    let slots = slots.max(1);
                    (slots, available.saturating_sub(per_slot * slots as u64))
                }
                (None, Some(plugins)) => {
                    let slots = available.saturating_sub(plugins) / per_slot;
                    (derived_slots(slots), plugins)
                }
                // Half each (plugins off say `Some(0)` and take the arm above).
                (None, None) => {
                    let slots = derived_slots(available / 2 / per_slot);
                    (slots, available.saturating_sub(per_slot * slots as u64))
                }
            }
        }
    };
    let admission_bytes = demands
        .admission
        .map_or(0, |a| a.per_slot_bytes * slots as u64 + a.fixed_bytes);
    let needed = BASELINE_BYTES + cache + plugins + admission_bytes + compile_bytes;
    if needed > limit {
        let mut terms = vec![
            format!("baseline {} MiB", BASELINE_BYTES / MIB),
            format!("artifact cache {} MiB", cache / MIB),
            format!("plugin budget {} MiB", plugins / MIB),
        ];
        if compile_bytes > 0 {
            terms.push(format!(
                "module compilers {} × {} MiB",
                demands.compile_slots,
                compile_memory / MIB
            ));
        }
        if let Some(a) = demands.admission {
            terms.push(format!(
                "admission {slots} slot(s) × {} MiB + {} MiB of bodies",
                a.per_slot_bytes / MIB,
                a.fixed_bytes / MIB
            ));
        }
        return Err(MemoryError::DoesNotFit {
            needed: needed.div_ceil(MIB),
            limit: limit / MIB,
            terms: terms.join(", "),
        });
    }
    if demands.plugin_budget_bytes != Some(0) && plugins < demands.plugin_default_bytes {
        return Err(MemoryError::PluginsStarved {
            budget: plugins / MIB,
            cap: demands.plugin_default_bytes / MIB,
        });
    }
    Ok(Plan {
        limit_bytes: Some(limit),
        artifact_cache_bytes: cache,
        plugin_budget_bytes: plugins,
        admission_slots: slots,
        compile_memory_bytes: compile_memory,
    })
}

fn derived_slots(fit: u64) -> usize {
    usize::try_from(fit)
        .unwrap_or(usize::MAX)
        .clamp(1, MAX_DERIVED_ADMISSION_SLOTS)
}

/// The container's memory limit from its cgroup (v2, then v1); `None` when unlimited or
/// unknown.
pub fn cgroup_limit() -> Option<u64> {
    cgroup_limit_in(Path::new("/sys/fs/cgroup"))
}

fn cgroup_limit_in(root: &Path) -> Option<u64> {
    let candidates = [
        root.join("memory.max"),
        root.join("memory").join("memory.limit_in_bytes"),
    ];
    candidates
        .iter()
        .find_map(|path| std::fs::read_to_string(path).ok())
        .and_then(|text| parse_cgroup_value(&text))
}

/// `max` or a byte count; cgroup v1 says "unlimited" with a page-rounded 2^63.
fn parse_cgroup_value(text: &str) -> Option<u64> {
    let text = text.trim();
    if text == "max" {
        return None;
    }
    text.parse::<u64>().ok().filter(|&v| v > 0 && v < 1 << 60)
}

/// A Kubernetes-style memory quantity: `536870912`, `512Mi`, `1Gi`, `500M`.
pub fn parse_quantity(text: &str) -> Result<u64, MemoryError> {
    let text = text.trim();
    let split = text
        .find(|c: char| !c.is_ascii_digit())
        .unwrap_or(text.len());
    let (number, unit) = text.split_at(split);
    let number: u64 = number
        .parse()
        .map_err(|_| MemoryError::Quantity(text.to_owned()))?;
    let factor: u64 = match unit {
        "" => 1,
        "Ki" => 1 << 10,
        "Mi" => 1 << 20,
        "Gi" => 1 << 30,
        "K" | "k" => 1_000,
        "M" => 1_000_000,
        "G" => 1_000_000_000,
        _ => return Err(MemoryError::Quantity(text.to_owned())),
    };
    number
        .checked_mul(factor)
        .filter(|&v| v > 0)
        .ok_or_else(|| MemoryError::Quantity(text.to_owned()))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn admission(slots: Option<usize>) -> Option<AdmissionDemand> {
        Some(AdmissionDemand {
            per_slot_bytes: 165 * MIB,
            fixed_bytes: 24 * MIB,
            slots,
        })
    }

    fn demands() -> Demands {
        Demands {
            artifact_cache_bytes: None,
            plugin_budget_bytes: None,
            plugin_default_bytes: 64 * MIB,
            plugin_unlimited_bytes: 2048 * MIB,
            admission: admission(None),
            compile_slots: 2,
            compile_memory_bytes: None,
        }
    }

    #[test]
    fn without_a_limit_the_configuration_is_used_as_is() {
        let plan = plan(None, &demands()).expect("plan");
        assert_eq!(plan.artifact_cache_bytes, DEFAULT_ARTIFACT_CACHE_BYTES);
        assert_eq!(plan.plugin_budget_bytes, 2048 * MIB);
        assert_eq!(plan.admission_slots, DEFAULT_ADMISSION_SLOTS);
    }

    #[test]
    fn derived_shares_fit_the_default_deployment() {
        // deploy/operator/deployment.yaml: 768Mi.
        let plan = plan(Some(768 * MIB), &demands()).expect("plan");
        assert_eq!(plan.artifact_cache_bytes, 192 * MIB);
        assert_eq!(plan.admission_slots, 1);
        assert_eq!(plan.compile_memory_bytes, 96 * MIB);
        let total = BASELINE_BYTES
            + plan.artifact_cache_bytes
            + plan.plugin_budget_bytes
            + 165 * MIB
            + 24 * MIB
            + 2 * plan.compile_memory_bytes;
        assert!(total <= 768 * MIB, "{}", plan.describe());
        assert!(plan.plugin_budget_bytes >= 64 * MIB, "{}", plan.describe());
        // More memory, more slots, up to the cap.
        let big = super::plan(Some(8 << 30), &demands()).expect("plan");
        assert_eq!(big.admission_slots, MAX_DERIVED_ADMISSION_SLOTS);
    }

    #[test]
    fn what_cannot_fit_is_refused_with_every_term() {
        let mut d = demands();
        d.plugin_budget_bytes = Some(512 * MIB);
        let err = plan(Some(512 * MIB), &d).expect_err("does not fit");
        let text = err.to_string();
        assert!(
            text.contains("plugin budget 512 MiB") && text.contains("container has 512 MiB"),
            "{text}"
        );
        let mut d = demands();
        d.admission = admission(Some(16));
        assert!(matches!(
            plan(Some(1024 * MIB), &d),
            Err(MemoryError::DoesNotFit { .. })
        ));
    }

    #[test]
    fn plugins_need_room_for_one_default_call() {
        let mut d = demands();
        d.admission = admission(Some(1));
        d.artifact_cache_bytes = Some(250 * MIB);
        // 96 + 250 + 24 + 165 + 2 × 96 (compilers) leaves 41 MiB.
        let err = plan(Some(768 * MIB), &d).expect_err("starved");
        assert!(matches!(err, MemoryError::PluginsStarved { .. }), "{err}");
        // Plugins off: no plugin budget and no compilers needed.
        d.plugin_budget_bytes = Some(0);
        d.compile_slots = 0;
        assert!(plan(Some(768 * MIB), &d).is_ok());
    }

    #[test]
    fn module_compilers_are_counted_once_per_load_slot() {
        let d = demands();
        // An eighth of the limit each, within 32–256 MiB; 256 MiB without a limit.
        assert_eq!(
            plan(None, &d).expect("plan").compile_memory_bytes,
            256 * MIB
        );
        let small = Demands {
            admission: None,
            plugin_budget_bytes: Some(0),
            ..d.clone()
        };
        let small = plan(Some(256 * MIB), &small);
        assert_eq!(small.expect("plan").compile_memory_bytes, 32 * MIB);
        let big = plan(Some(8 << 30), &d).expect("plan");
        assert_eq!(big.compile_memory_bytes, 256 * MIB);
        // Set: used as it is, and refused with the term named when it cannot fit.
        let set = Demands {
            compile_memory_bytes: Some(300 * MIB),
            ..d
        };
        let text = plan(Some(768 * MIB), &set)
            .expect_err("too big")
            .to_string();
        assert!(text.contains("module compilers 2 × 300 MiB"), "{text}");
        assert!(text.contains("--plugin-compile-memory-mib"), "{text}");
    }

    #[test]
    fn cgroup_values_and_quantities() {
        assert_eq!(parse_cgroup_value("max\n"), None);
        assert_eq!(parse_cgroup_value("9223372036854771712\n"), None);
        assert_eq!(parse_cgroup_value("536870912\n"), Some(512 * MIB));
        assert_eq!(parse_cgroup_value("garbage"), None);
        let dir = tempfile::tempdir().expect("dir");
        assert_eq!(cgroup_limit_in(dir.path()), None);
        std::fs::write(dir.path().join("memory.max"), "1073741824\n").expect("write");
        assert_eq!(cgroup_limit_in(dir.path()), Some(1024 * MIB));
        assert_eq!(parse_quantity("512Mi"), Ok(512 * MIB));
        assert_eq!(parse_quantity("1Gi"), Ok(1024 * MIB));
        assert_eq!(parse_quantity("1000"), Ok(1000));
        assert_eq!(parse_quantity("1M"), Ok(1_000_000));
        assert!(parse_quantity("1.5Gi").is_err());
        assert!(parse_quantity("Mi").is_err());
        assert!(parse_quantity("99999999999999Gi").is_err());
    }
}
