//! The wasmtime engine: its settings and instance pool, the epoch ticker, and turning module
//! bytes into a component (compiled now or read from the precompiled cache) that exports the
//! transformer interface.

use std::hash::{Hash, Hasher};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use tracing::warn;
use wasmtime::component::Component;
use wasmtime::{Config, Enabled, Engine, InstanceAllocationStrategy, PoolingAllocationConfig};

use super::sandbox::{MAX_CORE_INSTANCES, MAX_MEMORIES, MAX_TABLE_ELEMENTS, MAX_TABLES};
use super::{HostConfig, Inner, LoadSource, WIT_PACKAGE, bounded};
use crate::compiler::{self, Compiler};
use crate::diskcache;
use crate::errors::PluginError;

/// The interface a plugin must export (any 0.1.x is accepted by the linker's semver matching).
const EXPORT: &str = "pko:transform/transformer@0.1.0";

/// How often the epoch advances; the granularity of timeouts.
pub(super) const EPOCH_TICK: Duration = Duration::from_millis(10);

/// Address space reserved per linear memory: wasmtime's default for 64-bit hosts, which lets
/// compiled code skip explicit bounds checks on 32-bit memories.
const MEMORY_RESERVATION: u64 = 4 << 30;
/// Guard region after each linear memory (and before the first), also wasmtime's default.
const MEMORY_GUARD: u64 = 32 << 20;
/// Dirty bytes of a linear memory reset in place (instead of being returned to the kernel)
/// when a pool slot is freed, so the next call on the slot takes no page faults for them. A
/// Rust guest transforming a typical Program dirties a few hundred KiB; what is over the
/// budget is decommitted as usual.
const KEEP_RESIDENT: usize = 2 << 20;

/// Native stack of a call (wasmtime's default); guest recursion is bounded well below it by
/// `max_wasm_stack`.
const ASYNC_STACK: u64 = 2 << 20;

/// How instances get their memories and tables.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Allocation {
    /// From a pool reserved once, each memory mapped copy-on-write from the module's image
    /// and reset in place when the call ends.
    Pooling,
    /// Mapped and unmapped for every call: slower, but reserves nothing up front.
    OnDemand,
}

impl Allocation {
    pub(super) fn as_str(self) -> &'static str {
        match self {
            Self::Pooling => "pooling",
            Self::OnDemand => "on-demand",
        }
    }
}

/// Sizes of the instance pool, from the host's settings.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct PoolPlan {
    /// Component instances at once: one per call slot.
    pub(super) slots: u32,
    pub(super) memories: u32,
    pub(super) tables: u32,
    /// Largest linear memory: the operator-wide memory ceiling.
    pub(super) max_memory_bytes: u64,
}

impl PoolPlan {
    pub(super) fn new(config: &HostConfig) -> Self {
        let slots = config.max_concurrent_calls.max(1);
        Self {
            slots,
            memories: slots.saturating_mul(MAX_MEMORIES),
            tables: slots.saturating_mul(MAX_TABLES),
            max_memory_bytes: config.ceiling.memory_bytes.min(MEMORY_RESERVATION),
        }
    }

    /// Virtual address space the pool reserves when the engine is created (inaccessible
    /// until a call uses it, so it costs no memory, but it counts against `RLIMIT_AS`).
    pub(super) fn reservation_bytes(&self) -> u64 {
        let memories = u64::from(self.memories)
            .saturating_mul(MEMORY_RESERVATION.saturating_add(MEMORY_GUARD))
            .saturating_add(MEMORY_GUARD);
        let stacks = u64::from(self.slots).saturating_mul(ASYNC_STACK + (64 << 10));
        let tables = u64::from(self.tables)
            .saturating_mul(MAX_TABLE_ELEMENTS as u64)
            .saturating_mul(std::mem::size_of::<usize>() as u64);
        memories.saturating_add(tables).saturating_add(stacks)
    }

    fn pooling_config(&self) -> PoolingAllocationConfig {
        let mut pool = PoolingAllocationConfig::default();
        pool.total_component_instances(self.slots)
            .total_core_instances(self.slots.saturating_mul(MAX_CORE_INSTANCES))
            .total_memories(self.memories)
            .total_tables(self.tables)
            .max_core_instances_per_component(MAX_CORE_INSTANCES)
            .max_memories_per_component(MAX_MEMORIES)
            .max_tables_per_component(MAX_TABLES)
            .table_elements(MAX_TABLE_ELEMENTS)
            // One execution stack per call slot (calls run on stacks of their own).
            .total_stacks(self.slots)
            .max_memory_size(usize::try_from(self.max_memory_bytes).unwrap_or(usize::MAX))
            // Reset only the pages a call dirtied (Linux 6.7+; elsewhere wasmtime ignores it)
            // and keep them mapped, so the next call on the slot starts without page faults.
            .pagemap_scan(Enabled::Auto)
            .linear_memory_keep_resident(KEEP_RESIDENT)
            .table_keep_resident(KEEP_RESIDENT);
        pool
    }
}

/// Pooling, unless the pool's reservation would take more than half of a limited address
/// space (`RLIMIT_AS`), which would leave too little for the rest of the process.
pub(super) fn choose_allocation(reservation: u64, address_space_limit: Option<u64>) -> Allocation {
    match address_space_limit {
        Some(limit) if reservation > limit / 2 => Allocation::OnDemand,
        _ => Allocation::Pooling,
    }
}

/// The process's address-space limit (`RLIMIT_AS`), from `/proc/self/limits`; `None` when
/// unlimited or unknown.
fn address_space_limit() -> Option<u64> {
    let limits = std::fs::read_to_string("/proc/self/limits").ok()?;
    parse_address_space_limit(&limits)
}

fn parse_address_space_limit(limits: &str) -> Option<u64> {
    let line = limits
        .lines()
        .find(|line| line.starts_with("Max address space"))?;
    // "Max address space   <soft>   <hard>   bytes": the soft limit is what mmap checks.
    line.trim_start_matches("Max address space")
        .split_whitespace()
        .next()?
        .parse()
        .ok()
}

/// The engine, with its instance pool when the pool can be reserved; otherwise (a limited
/// address space, or the reservation failing) on-demand allocation, with a warning. Also
/// returns each memory's reservation, which a compiler child must use too.
pub(super) fn engine(config: &HostConfig) -> wasmtime::Result<(Engine, Allocation, u64)> {
    let plan = PoolPlan::new(config);
    let reservation = plan.reservation_bytes();
    let limit = address_space_limit();
    match choose_allocation(reservation, limit) {
        Allocation::Pooling => {
            match Engine::new(&wasm_config(
                InstanceAllocationStrategy::Pooling(plan.pooling_config()),
                MEMORY_RESERVATION,
            )) {
                Ok(engine) => return Ok((engine, Allocation::Pooling, MEMORY_RESERVATION)),
                Err(e) => warn!(
                    error = %format!("{e:#}"),
                    reservation,
                    "cannot reserve the plugin instance pool; allocating instances on demand (slower calls)"
                ),
            }
        }
        Allocation::OnDemand => warn!(
            reservation,
            address_space_limit = limit,
            "the plugin instance pool does not fit the address-space limit; allocating instances on demand (slower calls)"
        ),
    }
    // Each memory reserves only what the memory ceiling allows, not 4 GiB: the address space
    // is what is short here (the compiled code then checks bounds explicitly).
    let engine = child_engine(plan.max_memory_bytes)?;
    Ok((engine, Allocation::OnDemand, plan.max_memory_bytes))
}

/// An engine with the host's compile settings and no instance pool: what a compiler child
/// uses (it runs nothing), and the host itself when the pool does not fit. How instances are
/// allocated is not part of the compiled code, so both engines' code is interchangeable.
pub(crate) fn child_engine(memory_reservation: u64) -> wasmtime::Result<Engine> {
    Engine::new(&wasm_config(
        InstanceAllocationStrategy::OnDemand,
        memory_reservation,
    ))
}

/// The engine's settings; every memory reserves `memory_reservation` bytes of address space.
fn wasm_config(strategy: InstanceAllocationStrategy, memory_reservation: u64) -> Config {
    let mut wasm = Config::new();
    wasm.wasm_component_model(true)
        .consume_fuel(true)
        .epoch_interruption(true)
        // Same floating-point results on every CPU, so every replica computes the same output.
        .cranelift_nan_canonicalization(true)
        .wasm_relaxed_simd(false)
        .parallel_compilation(true)
        // Set explicitly: the pool's reservation is computed from them.
        .memory_reservation(memory_reservation)
        .memory_guard_size(MEMORY_GUARD)
        .guard_before_linear_memory(true)
        // Memories start as copy-on-write mappings of the module's initial image instead of
        // copying its data segments in on every call.
        .memory_init_cow(true)
        .async_stack_size(usize::try_from(ASYNC_STACK).unwrap_or(usize::MAX))
        .allocation_strategy(strategy);
    wasm
}

/// `<root>/<engine compatibility hash>`: the folder of this engine build's precompiled modules.
/// The folders of other builds under `root` are removed.
pub(super) fn cache_folder(engine: &Engine, root: &Path) -> PathBuf {
    let mut hasher = std::collections::hash_map::DefaultHasher::new();
    engine.precompile_compatibility_hash().hash(&mut hasher);
    let current = root.join(format!("{:016x}", hasher.finish()));
    diskcache::clean_at_start(root, &current);
    current
}

/// Advances the engine's epoch every [`EPOCH_TICK`] until the returned flag is set.
pub(super) fn start_ticker(engine: &Engine) -> Result<Arc<AtomicBool>, PluginError> {
    let ticker = Arc::new(AtomicBool::new(false));
    let stop = ticker.clone();
    let engine = engine.clone();
    std::thread::Builder::new()
        .name("pko-plugin-epoch".into())
        .spawn(move || {
            while !stop.load(Ordering::Acquire) {
                std::thread::sleep(EPOCH_TICK);
                engine.increment_epoch();
            }
        })
        .map_err(|e| PluginError::Host(format!("cannot start the epoch ticker: {e}")))?;
    Ok(ticker)
}

/// Compiles `bytes` (in a child process when the host has one) or reads the machine code
/// from the precompiled cache when it is there and intact. Returns the component, where it
/// came from and how long that took.
pub(super) async fn compile(
    inner: &Arc<Inner>,
    bytes: Vec<u8>,
    digest: &str,
) -> Result<(Component, LoadSource, Duration), PluginError> {
    let cache_file = inner
        .cache_dir
        .as_ref()
        .map(|dir| dir.join(format!("{}.cwasm", digest.trim_start_matches("sha256:"))));
    if let Some(path) = cache_file.clone() {
        let started = Instant::now();
        let engine = inner.engine.clone();
        match blocking(move || diskcache::read_precompiled(&engine, &path).map(|c| (c, path)))
            .await?
        {
            Ok((Some(component), path)) => {
                diskcache::touch(&path);
                return Ok((component, LoadSource::Cache, started.elapsed()));
            }
            Ok((None, _)) => {}
            Err(reason) => {
                if let Some(path) = &cache_file {
                    warn!(path = %path.display(), %reason, "precompiled module unusable; compiling again");
                    let _ = std::fs::remove_file(path);
                }
            }
        }
    }
    if bytes.len() >= 8 && bytes[..4] == *b"\0asm" && bytes[4..8] == [1, 0, 0, 0] {
        return Err(PluginError::Compile(
            "this is a core wasm module, not a component: build it for wasm32-wasip2".into(),
        ));
    }
    let started = Instant::now();
    let (component, serialized) = match &inner.config.compiler {
        Compiler::InProcess => {
            let engine = inner.engine.clone();
            // Compiling takes tens of milliseconds of CPU: off the async workers.
            blocking(move || {
                let component = Component::from_binary(&engine, &bytes)
                    .map_err(|e| PluginError::Compile(bounded(format!("{e:#}"), 2048)))?;
                let serialized = component.serialize().ok();
                Ok::<_, PluginError>((component, serialized))
            })
            .await??
        }
        Compiler::Child { command, bounds } => {
            let code =
                compiler::compile_in_child(command, *bounds, inner.memory_reservation, bytes)
                    .await
                    .map_err(|e| match e {
                        PluginError::Compile(reason) => PluginError::Compile(bounded(reason, 2048)),
                        other => other,
                    })?;
            let engine = inner.engine.clone();
            blocking(move || {
                let component = diskcache::deserialize_own(&engine, &code)
                    .map_err(|e| PluginError::Host(format!("the compiler's code: {e}")))?;
                Ok::<_, PluginError>((component, Some(code)))
            })
            .await??
        }
    };
    let load_time = started.elapsed();
    if let (Some(path), Some(serialized)) = (cache_file, serialized) {
        let max_bytes = inner.config.cache_max_bytes;
        // Best effort: a module that cannot be cached is compiled again at the next start.
        let _ = blocking(
            move || match diskcache::write_serialized(&serialized, &path) {
                Ok(()) => {
                    if let Some(dir) = path.parent() {
                        diskcache::prune(dir, max_bytes, &path);
                    }
                }
                Err(e) => {
                    warn!(path = %path.display(), error = %e, "cannot write the precompiled module")
                }
            },
        )
        .await;
    }
    Ok((component, LoadSource::Compiled, load_time))
}

/// Runs `work` on the blocking pool.
async fn blocking<T: Send + 'static>(
    work: impl FnOnce() -> T + Send + 'static,
) -> Result<T, PluginError> {
    tokio::task::spawn_blocking(work)
        .await
        .map_err(|e| PluginError::Host(format!("compile task failed: {e}")))
}

pub(super) fn check_exports(component: &Component, engine: &Engine) -> Result<(), PluginError> {
    let exports: Vec<String> = component
        .component_type()
        .exports(engine)
        .map(|(name, _)| name.to_owned())
        .collect();
    let wanted = EXPORT.split('@').next().unwrap_or(EXPORT);
    match exports.iter().find(|e| e.split('@').next() == Some(wanted)) {
        Some(found) if version_of(found).is_some_and(|v| v.starts_with("0.1.")) => Ok(()),
        Some(found) => Err(PluginError::NotAPlugin(format!(
            "the module exports {found}; this operator implements {EXPORT} (WIT package {WIT_PACKAGE})"
        ))),
        None => Err(PluginError::NotAPlugin(format!(
            "the module does not export {EXPORT}; it exports [{}]",
            exports.join(", ")
        ))),
    }
}

fn version_of(name: &str) -> Option<&str> {
    name.split_once('@').map(|(_, v)| v)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_pool_is_sized_from_the_call_slots_and_the_memory_ceiling() {
        let plan = PoolPlan::new(&HostConfig::default());
        assert_eq!(plan.slots, 4);
        assert_eq!(plan.memories, 4 * MAX_MEMORIES);
        assert_eq!(plan.tables, 4 * MAX_TABLES);
        assert_eq!(plan.max_memory_bytes, 512 << 20);
        // 16 memories of 4 GiB plus guards: about 64.5 GiB of address space, no memory.
        let reservation = plan.reservation_bytes();
        assert!(
            reservation > 64 << 30 && reservation < 66 << 30,
            "{reservation}"
        );
    }

    #[test]
    fn the_pool_gives_way_to_a_limited_address_space() {
        let reservation = 65 << 30;
        assert_eq!(choose_allocation(reservation, None), Allocation::Pooling);
        assert_eq!(
            choose_allocation(reservation, Some(1 << 40)),
            Allocation::Pooling
        );
        assert_eq!(
            choose_allocation(reservation, Some(100 << 30)),
            Allocation::OnDemand
        );
        assert_eq!(
            choose_allocation(reservation, Some(8 << 30)),
            Allocation::OnDemand
        );
    }

    #[test]
    fn the_address_space_limit_is_read_from_proc() {
        let unlimited = "Limit                     Soft Limit           Hard Limit           Units\n\
                         Max cpu time              unlimited            unlimited            seconds\n\
                         Max address space         unlimited            unlimited            bytes\n";
        assert_eq!(parse_address_space_limit(unlimited), None);
        let limited = "Max address space         8589934592           unlimited            bytes\n";
        assert_eq!(parse_address_space_limit(limited), Some(8 << 30));
        assert_eq!(parse_address_space_limit(""), None);
    }
}
