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
use wasmtime::{Config, Engine, InstanceAllocationStrategy, PoolingAllocationConfig};

use super::sandbox::{MAX_CORE_INSTANCES, MAX_MEMORIES, MAX_TABLE_ELEMENTS, MAX_TABLES};
use super::{HostConfig, Inner, LoadSource, WIT_PACKAGE, bounded};
use crate::diskcache;
use crate::errors::PluginError;

/// The interface a plugin must export (any 0.1.x is accepted by the linker's semver matching).
const EXPORT: &str = "pko:transform/transformer@0.1.0";

/// How often the epoch advances; the granularity of timeouts.
pub(super) const EPOCH_TICK: Duration = Duration::from_millis(10);

pub(super) fn engine(config: &HostConfig) -> wasmtime::Result<Engine> {
    let slots = config.max_concurrent_calls.max(1);
    let mut pool = PoolingAllocationConfig::default();
    pool.total_component_instances(slots)
        .total_core_instances(slots * MAX_CORE_INSTANCES)
        .total_memories(slots * MAX_MEMORIES)
        .total_tables(slots * MAX_TABLES)
        .max_core_instances_per_component(MAX_CORE_INSTANCES)
        .max_memories_per_component(MAX_MEMORIES)
        .max_tables_per_component(MAX_TABLES)
        .table_elements(MAX_TABLE_ELEMENTS)
        .max_memory_size(usize::try_from(config.ceiling.memory_bytes).unwrap_or(usize::MAX));
    let mut wasm = Config::new();
    wasm.wasm_component_model(true)
        .consume_fuel(true)
        .epoch_interruption(true)
        // Same floating-point results on every CPU, so every replica computes the same output.
        .cranelift_nan_canonicalization(true)
        .wasm_relaxed_simd(false)
        .parallel_compilation(true)
        .allocation_strategy(InstanceAllocationStrategy::Pooling(pool));
    Engine::new(&wasm)
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

/// Compiles `bytes`, or reads the machine code from the precompiled cache when it is there and
/// intact. Returns the component, where it came from and how long that took.
pub(super) fn compile(
    inner: &Inner,
    bytes: &[u8],
    digest: &str,
) -> Result<(Component, LoadSource, Duration), PluginError> {
    let cache_file = inner
        .cache_dir
        .as_ref()
        .map(|dir| dir.join(format!("{}.cwasm", digest.trim_start_matches("sha256:"))));
    if let Some(path) = &cache_file {
        let started = Instant::now();
        match diskcache::read_precompiled(&inner.engine, path) {
            Ok(Some(component)) => {
                diskcache::touch(path);
                return Ok((component, LoadSource::Cache, started.elapsed()));
            }
            Ok(None) => {}
            Err(reason) => {
                warn!(path = %path.display(), %reason, "precompiled module unusable; compiling again");
                let _ = std::fs::remove_file(path);
            }
        }
    }
    if bytes.len() >= 8 && bytes[..4] == *b"\0asm" && bytes[4..8] == [1, 0, 0, 0] {
        return Err(PluginError::Compile(
            "this is a core wasm module, not a component: build it for wasm32-wasip2".into(),
        ));
    }
    let started = Instant::now();
    let component = Component::from_binary(&inner.engine, bytes)
        .map_err(|e| PluginError::Compile(bounded(format!("{e:#}"), 2048)))?;
    let load_time = started.elapsed();
    if let Some(path) = &cache_file {
        match diskcache::write_precompiled(&component, path) {
            Ok(()) => {
                if let Some(dir) = path.parent() {
                    diskcache::prune(dir, inner.config.cache_max_bytes, path);
                }
            }
            Err(e) => {
                warn!(path = %path.display(), error = %e, "cannot write the precompiled module")
            }
        }
    }
    Ok((component, LoadSource::Compiled, load_time))
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
