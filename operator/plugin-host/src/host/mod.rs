//! The wasmtime host: one engine, compiled modules keyed by sha256, a fresh store per call.
//!
//! Every call gets a new `Store` from the pooling allocator with its own fuel, epoch deadline
//! and memory cap, so nothing a plugin does survives the call, and a trap (which poisons an
//! instance) never affects the next call. The guest runs on the caller's task (on a wasmtime
//! stack of its own) and yields at every epoch tick, so a call costs no thread hand-off. A
//! semaphore bounds the calls running at once; a `tokio::time::timeout` around each call backs
//! up the epoch deadline.

mod call;
mod engine;
mod sandbox;
mod shares;

pub use shares::{Shares, default_share, share};

pub(crate) use engine::child_engine;

use std::collections::{BTreeMap, HashMap};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use sha2::{Digest, Sha256};
use tokio::sync::Semaphore;
use tracing::debug;
use wasmtime::Engine;
use wasmtime::component::Linker;

use crate::compiler::Compiler;
use crate::errors::PluginError;
use crate::limits::Limits;
use crate::metrics::{LoadLabels, PluginMetrics};
use sandbox::CallState;

mod bindings {
    wasmtime::component::bindgen!({
        path: "../../wit",
        world: "plugin",
        // Calls run as futures on the caller's task (see `call`).
        exports: { default: async },
    });
}

/// The WIT package this host implements.
pub const WIT_PACKAGE: &str = "pko:transform@0.1.0";

/// Host-wide settings.
#[derive(Debug, Clone)]
pub struct HostConfig {
    /// Plugin calls running at once (also sizes the instance pool).
    pub max_concurrent_calls: u32,
    /// Of those, the most one namespace's calls may hold (see [`CallSite::in_namespace`]).
    pub max_concurrent_calls_per_namespace: u32,
    /// Limits of a plugin that sets none.
    pub default_limits: Limits,
    /// Highest limits a plugin may ask for.
    pub ceiling: Limits,
    /// Folder of precompiled modules (`None`: compile every module at every start).
    pub cache_dir: Option<PathBuf>,
    /// Bytes of precompiled modules kept there (least recently used evicted first).
    pub cache_max_bytes: u64,
    /// Largest module accepted, in bytes.
    pub max_module_bytes: u64,
    /// Memory every call running at once may use together: a call reserves its memory cap
    /// from it before it starts, so calls with big caps run fewer at a time, and a cap larger
    /// than the whole budget is refused.
    pub memory_budget_bytes: u64,
    /// Where modules are compiled (the operator: a bounded child process).
    pub compiler: Compiler,
}

impl Default for HostConfig {
    fn default() -> Self {
        Self {
            max_concurrent_calls: 4,
            max_concurrent_calls_per_namespace: default_share(4),
            default_limits: Limits::DEFAULT,
            ceiling: Limits::CEILING,
            cache_dir: None,
            cache_max_bytes: 512 << 20,
            max_module_bytes: 32 << 20,
            memory_budget_bytes: 4 * Limits::CEILING.memory_bytes,
            compiler: Compiler::InProcess,
        }
    }
}

/// What a plugin says about itself.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PluginInfo {
    pub name: String,
    pub version: String,
    pub description: String,
}

/// Where a module's machine code came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LoadSource {
    Compiled,
    Cache,
}

impl LoadSource {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Compiled => "compiled",
            Self::Cache => "cache",
        }
    }
}

/// A compiled, linked and identified plugin. Calls hold an `Arc` to it, so a module replaced
/// while calls run stays alive until they finish.
pub struct Module {
    digest: String,
    info: PluginInfo,
    pre: bindings::PluginPre<CallState>,
    source: LoadSource,
    load_time: Duration,
    size: u64,
}

impl std::fmt::Debug for Module {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Module")
            .field("digest", &self.digest)
            .field("info", &self.info)
            .field("source", &self.source)
            .finish_non_exhaustive()
    }
}

impl Module {
    /// `sha256:<hex>` of the module bytes.
    pub fn digest(&self) -> &str {
        &self.digest
    }

    pub fn info(&self) -> &PluginInfo {
        &self.info
    }

    /// Whether the machine code was compiled now or read from the precompiled cache.
    pub fn source(&self) -> LoadSource {
        self.source
    }

    /// Time spent compiling or deserializing.
    pub fn load_time(&self) -> Duration {
        self.load_time
    }

    /// Size of the module bytes.
    pub fn size(&self) -> u64 {
        self.size
    }
}

/// The Program a plugin transforms.
#[derive(Debug, Clone, PartialEq)]
pub struct ProgramInput {
    pub namespace: String,
    pub name: String,
    pub labels: BTreeMap<String, String>,
    /// The `program` field as a JSON object.
    pub spec: serde_json::Value,
}

/// A successful transform.
#[derive(Debug, Clone, PartialEq)]
pub struct TransformOutput {
    /// The new `program` field.
    pub spec: serde_json::Map<String, serde_json::Value>,
    pub warnings: Vec<String>,
    /// Fuel the call consumed.
    pub fuel: u64,
    /// Time spent creating the call's store and instance.
    pub instantiate: Duration,
}

/// Who is calling: names the call in logs, spans and metrics.
#[derive(Debug, Clone)]
pub struct CallSite {
    /// The transform object (`ProgramTransform/<ns>/<name>`), or any label outside the operator.
    pub transform: String,
    /// The tenant the call is for (the Program's namespace, or a ProgramTransform's): its
    /// calls share [`HostConfig::max_concurrent_calls_per_namespace`]. `None`: the cluster's
    /// own calls, bounded by the slots alone.
    pub namespace: Option<String>,
}

impl CallSite {
    pub fn new(transform: impl Into<String>) -> Self {
        Self {
            transform: transform.into(),
            namespace: None,
        }
    }

    /// The call is made for `namespace` and counts against its share.
    pub fn in_namespace(mut self, namespace: impl Into<String>) -> Self {
        self.namespace = Some(namespace.into());
        self
    }
}

/// The plugin host. Cheap to clone.
#[derive(Clone)]
pub struct PluginHost {
    inner: Arc<Inner>,
}

struct Inner {
    engine: Engine,
    allocation: engine::Allocation,
    /// Each linear memory's reservation: a compiler child's engine must use the same.
    memory_reservation: u64,
    linker: Linker<CallState>,
    slots: Arc<Semaphore>,
    /// Each namespace's share of `slots`.
    shares: shares::Shares,
    /// The memory budget, one permit per MiB.
    memory: Arc<Semaphore>,
    config: HostConfig,
    metrics: PluginMetrics,
    /// Loaded modules by digest; weak so that modules no transform uses are freed.
    modules: Mutex<HashMap<String, Weak<Module>>>,
    /// `<cache_dir>/<engine compatibility hash>`.
    cache_dir: Option<PathBuf>,
    ticker: Arc<AtomicBool>,
}

impl Drop for Inner {
    fn drop(&mut self) {
        self.ticker.store(true, Ordering::Release);
    }
}

impl PluginHost {
    /// Creates the engine, the instance pool, the linker and the epoch ticker.
    /// The host's metrics (the operator records its module loads there too).
    pub fn metrics(&self) -> &PluginMetrics {
        &self.inner.metrics
    }

    pub fn new(config: HostConfig, metrics: PluginMetrics) -> Result<Self, PluginError> {
        let (engine, allocation, memory_reservation) =
            engine::engine(&config).map_err(|e| PluginError::Host(format!("{e:#}")))?;
        debug!(allocation = allocation.as_str(), "plugin engine created");
        let linker = sandbox::linker(&engine).map_err(|e| PluginError::Host(format!("{e:#}")))?;
        let cache_dir = config
            .cache_dir
            .as_ref()
            .map(|dir| engine::cache_folder(&engine, dir));
        let ticker = engine::start_ticker(&engine)?;
        let slots = Arc::new(Semaphore::new(config.max_concurrent_calls.max(1) as usize));
        let shares = shares::Shares::new(shares::share(
            config.max_concurrent_calls,
            config.max_concurrent_calls_per_namespace,
        ));
        let memory = Arc::new(Semaphore::new(call::budget_permits(
            config.memory_budget_bytes,
        )));
        Ok(Self {
            inner: Arc::new(Inner {
                engine,
                allocation,
                memory_reservation,
                linker,
                slots,
                shares,
                memory,
                config,
                metrics,
                modules: Mutex::new(HashMap::new()),
                cache_dir,
                ticker,
            }),
        })
    }

    /// Drops the metric series of `transform` (see [`PluginMetrics::forget`]).
    pub fn forget_transform(&self, transform: &str) {
        self.inner.metrics.forget(transform);
    }

    /// Whether instances come from the pre-reserved pool (`false`: the pool could not be
    /// reserved and every call maps its memory anew).
    pub fn pooled(&self) -> bool {
        self.inner.allocation == engine::Allocation::Pooling
    }

    pub fn config(&self) -> &HostConfig {
        &self.inner.config
    }

    /// The limits of a plugin with `overrides`, clamped to the host's ceiling.
    pub fn limits(&self, overrides: &crate::limits::LimitOverrides) -> Limits {
        self.inner
            .config
            .default_limits
            .with(overrides, &self.inner.config.ceiling)
    }

    /// The loaded module with this digest, if any transform still holds it.
    pub fn cached(&self, digest: &str) -> Option<Arc<Module>> {
        lock(&self.inner.modules)
            .get(digest)
            .and_then(Weak::upgrade)
    }

    /// Loads a module: checks its sha256 against `expected_sha256` (hex, with or without a
    /// `sha256:` prefix), compiles it (or reads it from the precompiled cache), checks its
    /// imports and exports, links it and asks it for its [`PluginInfo`].
    pub async fn load(
        &self,
        bytes: Vec<u8>,
        expected_sha256: &str,
        site: &CallSite,
    ) -> Result<Arc<Module>, PluginError> {
        let expected = normalize_digest(expected_sha256);
        let size = bytes.len() as u64;
        if size > self.inner.config.max_module_bytes {
            return Err(PluginError::ModuleTooLarge {
                size,
                limit: self.inner.config.max_module_bytes,
            });
        }
        let actual = format!("sha256:{}", hex::encode(Sha256::digest(&bytes)));
        if actual != expected {
            return Err(PluginError::DigestMismatch { expected, actual });
        }
        if let Some(module) = self.cached(&actual) {
            return Ok(module);
        }
        let (component, source, load_time) = engine::compile(&self.inner, bytes, &actual).await?;
        let labels = LoadLabels {
            source: source.as_str().to_owned(),
        };
        self.inner.metrics.loads.get_or_create(&labels).inc();
        self.inner
            .metrics
            .load_duration
            .get_or_create(&labels)
            .observe(load_time.as_secs_f64());

        sandbox::check_imports(&component, &self.inner.engine)?;
        engine::check_exports(&component, &self.inner.engine)?;
        // The shared linker plus failing stubs of the denied interfaces this module imports.
        let linker = sandbox::with_denied_stubs(&self.inner.linker, &component, &self.inner.engine)
            .map_err(|e| PluginError::NotAPlugin(format!("{e:#}")))?;
        let pre = linker
            .instantiate_pre(&component)
            .map_err(|e| PluginError::NotAPlugin(format!("{e:#}")))?;
        let pre =
            bindings::PluginPre::new(pre).map_err(|e| PluginError::NotAPlugin(format!("{e:#}")))?;

        let staged = Arc::new(Module {
            digest: actual.clone(),
            info: PluginInfo {
                name: String::new(),
                version: String::new(),
                description: String::new(),
            },
            pre,
            source,
            load_time,
            size,
        });
        let limits = self.inner.config.default_limits;
        let info = match self
            .call(&staged, limits, site, call::Request::Info)
            .await?
        {
            (call::Response::Info(info), _) => info,
            _ => return Err(PluginError::Host("info answered another call".into())),
        };
        let module = Arc::new(Module {
            digest: actual.clone(),
            info: PluginInfo {
                name: bounded(info.name, 128),
                version: bounded(info.version, 64),
                description: bounded(info.description, 512),
            },
            pre: staged.pre.clone(),
            source,
            load_time,
            size,
        });
        let mut modules = lock(&self.inner.modules);
        modules.retain(|_, weak| weak.strong_count() > 0);
        // Another task may have loaded the same bytes meanwhile: keep one.
        if let Some(existing) = modules.get(&actual).and_then(Weak::upgrade) {
            return Ok(existing);
        }
        modules.insert(actual, Arc::downgrade(&module));
        debug!(digest = %module.digest, plugin = %module.info.name, source = source.as_str(), ?load_time, "plugin module loaded");
        Ok(module)
    }
}

/// `sha256:<lowercase hex>` from `<hex>` or `sha256:<hex>`.
pub fn normalize_digest(raw: &str) -> String {
    let hex = raw
        .trim()
        .trim_start_matches("sha256:")
        .to_ascii_lowercase();
    format!("sha256:{hex}")
}

fn bounded(mut s: String, max: usize) -> String {
    if s.len() > max {
        let mut end = max;
        while !s.is_char_boundary(end) {
            end -= 1;
        }
        s.truncate(end);
        s.push('…');
    }
    s
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    // The maps stay consistent even if a holder panicked; keep going with them.
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn digests_are_normalized() {
        assert_eq!(normalize_digest("ABcd"), "sha256:abcd");
        assert_eq!(normalize_digest("sha256:abcd "), "sha256:abcd");
    }

    #[test]
    fn bounded_keeps_char_boundaries() {
        assert_eq!(bounded("héllo".into(), 2), "h…");
        assert_eq!(bounded("abc".into(), 3), "abc");
    }

    #[test]
    fn error_kind_transience() {
        assert!(crate::ErrorKind::Timeout.is_transient());
        assert!(!crate::ErrorKind::FuelExhausted.is_transient());
    }
}
