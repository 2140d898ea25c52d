//! The wasmtime host: one engine, compiled modules keyed by sha256, a fresh store per call.
//!
//! Every call gets a new `Store` from the pooling allocator with its own fuel, epoch deadline
//! and memory cap, so nothing a plugin does survives the call, and a trap (which poisons an
//! instance) never affects the next call. A semaphore bounds the calls running at once; a
//! `tokio::time::timeout` around each call backs up the epoch deadline.

use std::collections::{BTreeMap, HashMap};
use std::hash::{Hash, Hasher};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant};

use sha2::{Digest, Sha256};
use tokio::sync::Semaphore;
use tracing::{Instrument, debug, info_span, warn};
use wasmtime::component::{Component, HasData, HasSelf, Linker, ResourceTable};
use wasmtime::{
    Config, Engine, InstanceAllocationStrategy, PoolingAllocationConfig, ResourceLimiter, Store,
    Trap,
};
use wasmtime_wasi::p2::pipe::MemoryOutputPipe;
use wasmtime_wasi::{Deterministic, HostWallClock, WasiCtx, WasiCtxBuilder, WasiCtxView, WasiView};

use crate::errors::PluginError;
use crate::json;
use crate::limits::Limits;
use crate::metrics::{LoadLabels, PluginMetrics};

mod bindings {
    wasmtime::component::bindgen!({
        path: "../../wit",
        world: "plugin",
    });
}

use bindings::exports::pko::transform::transformer as wit;
use bindings::pko::transform::log::Level;

/// The WIT package this host implements.
pub const WIT_PACKAGE: &str = "pko:transform@0.1.0";
/// The interface a plugin must export (any 0.1.x is accepted by the linker's semver matching).
const EXPORT: &str = "pko:transform/transformer@0.1.0";

/// Interfaces a plugin may import: what a Rust `wasm32-wasip2` guest needs to start (stdio,
/// environment, exit, clocks, random) plus the plugin log. Stdio goes nowhere (stderr is kept
/// for error messages), the environment is empty, clocks are fixed and random is a fixed
/// sequence. Filesystem, sockets, HTTP and everything else are refused at load.
const GRANTED: [(&str, &[&str]); 5] = [
    ("wasi:io", &["error", "poll", "streams"]),
    (
        "wasi:cli",
        &[
            "environment",
            "exit",
            "stdin",
            "stdout",
            "stderr",
            "terminal-input",
            "terminal-output",
            "terminal-stdin",
            "terminal-stdout",
            "terminal-stderr",
        ],
    ),
    ("wasi:clocks", &["wall-clock", "monotonic-clock"]),
    ("wasi:random", &["random", "insecure", "insecure-seed"]),
    ("pko:transform", &["log", "types"]),
];

/// How often the epoch advances; the granularity of timeouts.
const EPOCH_TICK: Duration = Duration::from_millis(10);
/// Extra time the outer timeout gives the epoch deadline before declaring the call lost.
const TIMEOUT_GRACE: Duration = Duration::from_millis(500);
/// Guest log budget per call; the rest is dropped (with one note).
const LOG_BYTES_PER_CALL: usize = 16 * 1024;
/// Guest stderr kept per call (panic messages end up there).
const STDERR_BYTES: usize = 4 * 1024;
/// Warnings kept per call, and bytes per warning.
const MAX_WARNINGS: usize = 32;
const MAX_WARNING_BYTES: usize = 1024;
/// Wasm table elements an instance may grow to.
const MAX_TABLE_ELEMENTS: usize = 100_000;
/// Core instances, memories and tables per component instance (a Rust guest uses a handful).
const MAX_CORE_INSTANCES: u32 = 32;
const MAX_MEMORIES: u32 = 4;
const MAX_TABLES: u32 = 8;
/// Fixed seed of every random source a plugin sees.
const RANDOM_SEED: [u8; 16] = *b"pko-rs-transform";

/// Host-wide settings.
#[derive(Debug, Clone)]
pub struct HostConfig {
    /// Plugin calls running at once (also sizes the instance pool).
    pub max_concurrent_calls: u32,
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
}

impl Default for HostConfig {
    fn default() -> Self {
        Self {
            max_concurrent_calls: 4,
            default_limits: Limits::DEFAULT,
            ceiling: Limits::CEILING,
            cache_dir: None,
            cache_max_bytes: 128 << 20,
            max_module_bytes: 32 << 20,
            memory_budget_bytes: 4 * Limits::CEILING.memory_bytes,
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
}

/// Who is calling: names the call in logs, spans and metrics.
#[derive(Debug, Clone)]
pub struct CallSite {
    /// The transform object (`ProgramTransform/<ns>/<name>`), or any label outside the operator.
    pub transform: String,
}

impl CallSite {
    pub fn new(transform: impl Into<String>) -> Self {
        Self {
            transform: transform.into(),
        }
    }
}

/// The plugin host. Cheap to clone.
#[derive(Clone)]
pub struct PluginHost {
    inner: Arc<Inner>,
}

struct Inner {
    engine: Engine,
    linker: Linker<CallState>,
    slots: Arc<Semaphore>,
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
    pub fn new(config: HostConfig, metrics: PluginMetrics) -> Result<Self, PluginError> {
        let engine = engine(&config).map_err(|e| PluginError::Host(format!("{e:#}")))?;
        let linker = linker(&engine).map_err(|e| PluginError::Host(format!("{e:#}")))?;
        let cache_dir = config.cache_dir.as_ref().map(|dir| {
            let mut hasher = std::collections::hash_map::DefaultHasher::new();
            engine.precompile_compatibility_hash().hash(&mut hasher);
            let current = dir.join(format!("{:016x}", hasher.finish()));
            crate::diskcache::clean_at_start(dir, &current);
            current
        });
        let ticker = Arc::new(AtomicBool::new(false));
        {
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
        }
        let slots = Arc::new(Semaphore::new(config.max_concurrent_calls.max(1) as usize));
        let memory = Arc::new(Semaphore::new(budget_permits(config.memory_budget_bytes)));
        Ok(Self {
            inner: Arc::new(Inner {
                engine,
                linker,
                slots,
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
        let inner = self.inner.clone();
        let digest = actual.clone();
        // Compiling takes tens of milliseconds of CPU: keep it off the async workers.
        let (component, source, load_time) =
            tokio::task::spawn_blocking(move || compile(&inner, &bytes, &digest))
                .await
                .map_err(|e| PluginError::Host(format!("compile task failed: {e}")))??;
        let labels = LoadLabels {
            source: source.as_str().to_owned(),
        };
        self.inner.metrics.loads.get_or_create(&labels).inc();
        self.inner
            .metrics
            .load_duration
            .get_or_create(&labels)
            .observe(load_time.as_secs_f64());

        check_imports(&component, &self.inner.engine)?;
        check_exports(&component, &self.inner.engine)?;
        let pre = self
            .inner
            .linker
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
        let (info, _) = self
            .call(&staged, limits, site, "info", |plugin, store| {
                plugin.pko_transform_transformer().call_info(store).map(Ok)
            })
            .await?;
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

    /// Runs `validate-config` on `config` (JSON; `null` when none is given).
    pub async fn validate_config(
        &self,
        module: &Arc<Module>,
        config: &serde_json::Value,
        limits: Limits,
        site: &CallSite,
    ) -> Result<(), PluginError> {
        let config_json = json::canonical_string(config);
        self.call(
            module,
            limits,
            site,
            "validate-config",
            move |plugin, store| {
                plugin
                    .pko_transform_transformer()
                    .call_validate_config(store, &config_json)
                    .map(|r| r.map_err(guest_error))
            },
        )
        .await
        .map(|_| ())
    }

    /// Runs `transform` and checks its output: size, JSON, an object.
    pub async fn transform(
        &self,
        module: &Arc<Module>,
        input: &ProgramInput,
        config: &serde_json::Value,
        limits: Limits,
        site: &CallSite,
    ) -> Result<TransformOutput, PluginError> {
        let program = wit::Program {
            namespace: input.namespace.clone(),
            name: input.name.clone(),
            labels: input
                .labels
                .iter()
                .map(|(k, v)| (k.clone(), v.clone()))
                .collect(),
            spec_json: json::canonical_string(&input.spec),
        };
        let config_json = json::canonical_string(config);
        // Checked inside the call, so a bad output counts as a failed call in the metrics.
        let (mut output, fuel) = self
            .call(module, limits, site, "transform", move |plugin, store| {
                plugin
                    .pko_transform_transformer()
                    .call_transform(store, &program, &config_json)
                    .map(|r| {
                        r.map_err(guest_error)
                            .and_then(|out| checked_output(out, limits))
                    })
            })
            .await?;
        output.fuel = fuel;
        Ok(output)
    }

    /// One call on a fresh instance: waits for a slot, runs `f` on a blocking thread under the
    /// limits, classifies failures, records metrics. Returns the result and the fuel consumed.
    async fn call<R, F>(
        &self,
        module: &Arc<Module>,
        limits: Limits,
        site: &CallSite,
        function: &'static str,
        f: F,
    ) -> Result<(R, u64), PluginError>
    where
        R: Send + 'static,
        F: FnOnce(
                &bindings::Plugin,
                &mut Store<CallState>,
            ) -> wasmtime::Result<Result<R, PluginError>>
            + Send
            + 'static,
    {
        let started = Instant::now();
        let span = info_span!(
            "plugin.call",
            transform = %site.transform,
            plugin = %module.info.name,
            digest = %module.digest,
            function,
            fuel = tracing::field::Empty,
            outcome = tracing::field::Empty,
        );
        let result = self
            .call_inner(module.clone(), limits, site, function, f)
            .instrument(span.clone())
            .await;
        let recorded = match &result {
            Ok((_, fuel)) => {
                span.record("fuel", fuel);
                Ok(*fuel)
            }
            Err(err) => Err(err.kind().as_str()),
        };
        span.record("outcome", recorded.err().unwrap_or("ok"));
        self.inner.metrics.record_call(
            &site.transform,
            &module.info.name,
            function,
            started.elapsed(),
            recorded,
        );
        result
    }

    async fn call_inner<R, F>(
        &self,
        module: Arc<Module>,
        limits: Limits,
        site: &CallSite,
        function: &'static str,
        f: F,
    ) -> Result<(R, u64), PluginError>
    where
        R: Send + 'static,
        F: FnOnce(
                &bindings::Plugin,
                &mut Store<CallState>,
            ) -> wasmtime::Result<Result<R, PluginError>>
            + Send
            + 'static,
    {
        // Waiting for a slot counts against the call's budget.
        let deadline = tokio::time::Instant::now() + limits.timeout;
        let permit = tokio::time::timeout_at(deadline, self.inner.slots.clone().acquire_owned())
            .await
            .map_err(|_| PluginError::Busy(limits.timeout))?
            .map_err(|_| PluginError::Host("the plugin host is shutting down".into()))?;
        // Then its memory cap, from the budget every running call shares.
        let asked = mib_permits(limits.memory_bytes);
        if asked as usize > budget_permits(self.inner.config.memory_budget_bytes) {
            return Err(PluginError::OverMemoryBudget {
                asked: limits.memory_bytes,
                budget: self.inner.config.memory_budget_bytes,
            });
        }
        let reserved = tokio::time::timeout_at(
            deadline,
            self.inner.memory.clone().acquire_many_owned(asked),
        )
        .await
        .map_err(|_| PluginError::Busy(limits.timeout))?
        .map_err(|_| PluginError::Host("the plugin host is shutting down".into()))?;
        let remaining = deadline.saturating_duration_since(tokio::time::Instant::now());
        let inner = self.inner.clone();
        let transform: Arc<str> = Arc::from(site.transform.as_str());
        let span = tracing::Span::current();
        let task = tokio::task::spawn_blocking(move || {
            // The slot is held until the guest has really stopped, also after a timeout.
            let _permit = permit;
            let _reserved = reserved;
            let _entered = span.enter();
            run_blocking(&inner, &module, limits, remaining, transform, function, f)
        });
        match tokio::time::timeout(remaining + TIMEOUT_GRACE, task).await {
            Ok(Ok(result)) => result,
            Ok(Err(join)) => Err(PluginError::Host(format!("plugin task failed: {join}"))),
            Err(_) => {
                warn!(function, "plugin call outlived its epoch deadline");
                Err(PluginError::Timeout(limits.timeout))
            }
        }
    }
}

/// Per-call store data.
struct CallState {
    wasi: WasiCtx,
    table: ResourceTable,
    limiter: MemoryLimiter,
    log: GuestLog,
}

impl WasiView for CallState {
    fn ctx(&mut self) -> WasiCtxView<'_> {
        WasiCtxView {
            ctx: &mut self.wasi,
            table: &mut self.table,
        }
    }
}

impl bindings::pko::transform::log::Host for CallState {
    fn log(&mut self, level: Level, message: String) {
        self.log.write(level, &message);
    }
}

impl bindings::pko::transform::types::Host for CallState {}

/// Forwards guest log lines to tracing, up to a byte budget per call.
struct GuestLog {
    transform: Arc<str>,
    budget: usize,
    truncated: bool,
}

impl GuestLog {
    fn write(&mut self, level: Level, message: &str) {
        if message.len() > self.budget {
            if !self.truncated {
                self.truncated = true;
                tracing::warn!(target: "pko_plugin_host::guest", transform = %self.transform, "plugin log budget exhausted; further lines dropped");
            }
            return;
        }
        self.budget -= message.len();
        let transform = &*self.transform;
        match level {
            Level::Trace => {
                tracing::trace!(target: "pko_plugin_host::guest", transform, "{message}")
            }
            Level::Debug => {
                tracing::debug!(target: "pko_plugin_host::guest", transform, "{message}")
            }
            Level::Info => tracing::info!(target: "pko_plugin_host::guest", transform, "{message}"),
            Level::Warn => tracing::warn!(target: "pko_plugin_host::guest", transform, "{message}"),
            Level::Error => {
                tracing::error!(target: "pko_plugin_host::guest", transform, "{message}")
            }
        }
    }
}

/// Caps the memory of one instance, every linear memory and table of it together (a
/// component may have several), and remembers whether the cap was hit: a refused growth with
/// `Err` traps, and the flag tells that trap apart from others without parsing messages.
struct MemoryLimiter {
    max_bytes: usize,
    /// Bytes of every memory and table of the instance so far.
    used: usize,
    hit: bool,
}

/// What one table element costs (a reference).
const TABLE_ELEMENT_BYTES: usize = std::mem::size_of::<usize>();

impl MemoryLimiter {
    fn new(max_bytes: usize) -> Self {
        Self {
            max_bytes,
            used: 0,
            hit: false,
        }
    }

    /// Accounts for growing one memory or table by `delta` bytes.
    fn grow(&mut self, delta: usize) -> wasmtime::Result<bool> {
        let total = self.used.saturating_add(delta);
        if total > self.max_bytes {
            self.hit = true;
            return Err(wasmtime::Error::msg(format!(
                "memory limit of {} bytes exceeded (the instance would use {total})",
                self.max_bytes
            )));
        }
        self.used = total;
        Ok(true)
    }
}

impl ResourceLimiter for MemoryLimiter {
    fn memory_growing(
        &mut self,
        current: usize,
        desired: usize,
        _maximum: Option<usize>,
    ) -> wasmtime::Result<bool> {
        self.grow(desired.saturating_sub(current))
    }

    fn table_growing(
        &mut self,
        current: usize,
        desired: usize,
        _maximum: Option<usize>,
    ) -> wasmtime::Result<bool> {
        if desired > MAX_TABLE_ELEMENTS {
            return Ok(false);
        }
        self.grow(
            desired
                .saturating_sub(current)
                .saturating_mul(TABLE_ELEMENT_BYTES),
        )
    }

    fn instances(&self) -> usize {
        MAX_CORE_INSTANCES as usize
    }

    fn tables(&self) -> usize {
        MAX_TABLES as usize
    }

    fn memories(&self) -> usize {
        MAX_MEMORIES as usize
    }
}

/// MiB permits covering `bytes` (rounded up).
fn mib_permits(bytes: u64) -> u32 {
    u32::try_from(bytes.div_ceil(1 << 20)).unwrap_or(u32::MAX)
}

/// Permits of a budget of `bytes` (whole MiB), within what a semaphore can hold.
fn budget_permits(bytes: u64) -> usize {
    usize::try_from(bytes >> 20)
        .unwrap_or(usize::MAX)
        .min(Semaphore::MAX_PERMITS)
}

/// The wall clock every plugin sees: the Unix epoch, forever.
struct FixedWallClock;

impl HostWallClock for FixedWallClock {
    fn resolution(&self) -> Duration {
        Duration::from_secs(1)
    }

    fn now(&self) -> Duration {
        Duration::ZERO
    }
}

/// The monotonic clock every plugin sees: frozen at zero, and every timer it subscribes to is
/// already due. A plugin therefore cannot wait in a host call (a sleep returns at once): the
/// only way to spend time is to run wasm code, which fuel and the epoch deadline stop. (With
/// real timers, a sleeping guest would hold its slot and thread past any wasm-level deadline.)
struct FrozenMonotonic<'a> {
    table: &'a mut ResourceTable,
}

/// Marker for [`FrozenMonotonic`] in the linker.
struct HasFrozenMonotonic;

impl HasData for HasFrozenMonotonic {
    type Data<'a> = FrozenMonotonic<'a>;
}

/// A timer that has already fired.
struct Due;

#[wasmtime_wasi::async_trait]
impl wasmtime_wasi::p2::Pollable for Due {
    async fn ready(&mut self) {}
}

impl wasmtime_wasi::p2::bindings::clocks::monotonic_clock::Host for FrozenMonotonic<'_> {
    fn now(&mut self) -> wasmtime::Result<u64> {
        Ok(0)
    }

    fn resolution(&mut self) -> wasmtime::Result<u64> {
        Ok(1)
    }

    fn subscribe_instant(
        &mut self,
        _when: u64,
    ) -> wasmtime::Result<wasmtime::component::Resource<wasmtime_wasi::p2::DynPollable>> {
        let due = self.table.push(Due)?;
        wasmtime_wasi::p2::subscribe(self.table, due)
    }

    fn subscribe_duration(
        &mut self,
        _duration: u64,
    ) -> wasmtime::Result<wasmtime::component::Resource<wasmtime_wasi::p2::DynPollable>> {
        let due = self.table.push(Due)?;
        wasmtime_wasi::p2::subscribe(self.table, due)
    }
}

fn run_blocking<R, F>(
    inner: &Inner,
    module: &Module,
    limits: Limits,
    budget: Duration,
    transform: Arc<str>,
    function: &'static str,
    f: F,
) -> Result<(R, u64), PluginError>
where
    F: FnOnce(&bindings::Plugin, &mut Store<CallState>) -> wasmtime::Result<Result<R, PluginError>>,
{
    let stderr = MemoryOutputPipe::new(STDERR_BYTES);
    let wasi = WasiCtxBuilder::new()
        .stderr(stderr.clone())
        .wall_clock(FixedWallClock)
        .secure_random(Deterministic::new(RANDOM_SEED.to_vec()))
        .insecure_random(Deterministic::new(RANDOM_SEED.to_vec()))
        .insecure_random_seed(u128::from_le_bytes(RANDOM_SEED))
        .build();
    let memory_bytes = usize::try_from(limits.memory_bytes).unwrap_or(usize::MAX);
    let mut store = Store::new(
        &inner.engine,
        CallState {
            wasi,
            table: ResourceTable::new(),
            limiter: MemoryLimiter::new(memory_bytes),
            log: GuestLog {
                transform,
                budget: LOG_BYTES_PER_CALL,
                truncated: false,
            },
        },
    );
    store.limiter(|state| &mut state.limiter);
    store
        .set_fuel(limits.fuel)
        .map_err(|e| PluginError::Host(format!("cannot set fuel: {e:#}")))?;
    let ticks = budget.as_millis().div_ceil(EPOCH_TICK.as_millis()).max(1);
    store.set_epoch_deadline(u64::try_from(ticks).unwrap_or(u64::MAX));
    store.epoch_deadline_trap();

    let outcome = module
        .pre
        .instantiate(&mut store)
        .and_then(|plugin| f(&plugin, &mut store));
    let fuel = limits.fuel.saturating_sub(store.get_fuel().unwrap_or(0));
    match outcome {
        Ok(Ok(value)) => Ok((value, fuel)),
        Ok(Err(refused)) => Err(refused),
        Err(err) => {
            let err = classify(&err, &store, limits, &stderr);
            debug!(function, error = %err, fuel, "plugin call failed");
            Err(err)
        }
    }
}

/// Names the cause of a failed call: the memory cap (our flag), fuel and epoch traps, other
/// traps (with what the guest wrote to stderr, e.g. a panic message).
fn classify(
    err: &wasmtime::Error,
    store: &Store<CallState>,
    limits: Limits,
    stderr: &MemoryOutputPipe,
) -> PluginError {
    if store.data().limiter.hit {
        return PluginError::MemoryLimit(limits.memory_bytes);
    }
    match err.downcast_ref::<Trap>() {
        Some(Trap::OutOfFuel) => PluginError::FuelExhausted(limits.fuel),
        Some(Trap::Interrupt) => PluginError::Timeout(limits.timeout),
        Some(trap) => {
            let said = String::from_utf8_lossy(&stderr.contents())
                .trim()
                .to_owned();
            if said.is_empty() {
                PluginError::Trap(trap.to_string())
            } else {
                PluginError::Trap(format!("{trap}; stderr: {}", bounded(said, 1024)))
            }
        }
        None => PluginError::Trap(bounded(format!("{err:#}"), 2048)),
    }
}

/// The output within its size limit, its spec a JSON object, its warnings bounded.
fn checked_output(output: wit::Output, limits: Limits) -> Result<TransformOutput, PluginError> {
    let size =
        output.spec_json.len() as u64 + output.warnings.iter().map(|w| w.len() as u64).sum::<u64>();
    if size > limits.output_bytes {
        return Err(PluginError::OutputTooLarge {
            size,
            limit: limits.output_bytes,
        });
    }
    let spec = match serde_json::from_str::<serde_json::Value>(&output.spec_json) {
        Ok(serde_json::Value::Object(map)) => map,
        Ok(other) => {
            return Err(PluginError::InvalidOutput(format!(
                "the spec must be a JSON object, not {}",
                json::kind(&other)
            )));
        }
        Err(e) => {
            return Err(PluginError::InvalidOutput(format!(
                "the spec is not JSON: {e}"
            )));
        }
    };
    let warnings = output
        .warnings
        .into_iter()
        .take(MAX_WARNINGS)
        .map(|w| bounded(w, MAX_WARNING_BYTES))
        .collect();
    Ok(TransformOutput {
        spec,
        warnings,
        fuel: 0,
    })
}

fn guest_error(err: wit::TransformError) -> PluginError {
    match err {
        wit::TransformError::InvalidConfig(m) => PluginError::InvalidConfig(bounded(m, 4096)),
        wit::TransformError::Rejected(m) => PluginError::Rejected(bounded(m, 4096)),
        wit::TransformError::Internal(m) => PluginError::Internal(bounded(m, 4096)),
    }
}

fn engine(config: &HostConfig) -> wasmtime::Result<Engine> {
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

/// Marker for the `wasi:io` bindings, which only need the resource table.
struct HasIo;

impl HasData for HasIo {
    type Data<'a> = &'a mut ResourceTable;
}

/// Only the granted interfaces are linked: a module importing anything else cannot be
/// instantiated even if the import check were bypassed.
fn linker(engine: &Engine) -> wasmtime::Result<Linker<CallState>> {
    use wasmtime_wasi::cli::{WasiCli, WasiCliView};
    use wasmtime_wasi::clocks::{WasiClocks, WasiClocksView};
    use wasmtime_wasi::p2::bindings::sync::io as sync_io;
    use wasmtime_wasi::p2::bindings::{cli, clocks, random};
    use wasmtime_wasi::random::WasiRandom;

    let mut linker = Linker::<CallState>::new(engine);
    let l = &mut linker;
    sync_io::error::add_to_linker::<CallState, HasIo>(l, |t| &mut t.table)?;
    sync_io::poll::add_to_linker::<CallState, HasIo>(l, |t| &mut t.table)?;
    sync_io::streams::add_to_linker::<CallState, HasIo>(l, |t| &mut t.table)?;
    clocks::wall_clock::add_to_linker::<CallState, WasiClocks>(l, CallState::clocks)?;
    clocks::monotonic_clock::add_to_linker::<CallState, HasFrozenMonotonic>(l, |t| {
        FrozenMonotonic {
            table: &mut t.table,
        }
    })?;
    random::random::add_to_linker::<CallState, WasiRandom>(l, |t| t.wasi.random())?;
    random::insecure::add_to_linker::<CallState, WasiRandom>(l, |t| t.wasi.random())?;
    random::insecure_seed::add_to_linker::<CallState, WasiRandom>(l, |t| t.wasi.random())?;
    cli::exit::add_to_linker::<CallState, WasiCli>(l, CallState::cli)?;
    cli::environment::add_to_linker::<CallState, WasiCli>(l, CallState::cli)?;
    cli::stdin::add_to_linker::<CallState, WasiCli>(l, CallState::cli)?;
    cli::stdout::add_to_linker::<CallState, WasiCli>(l, CallState::cli)?;
    cli::stderr::add_to_linker::<CallState, WasiCli>(l, CallState::cli)?;
    cli::terminal_input::add_to_linker::<CallState, WasiCli>(l, CallState::cli)?;
    cli::terminal_output::add_to_linker::<CallState, WasiCli>(l, CallState::cli)?;
    cli::terminal_stdin::add_to_linker::<CallState, WasiCli>(l, CallState::cli)?;
    cli::terminal_stdout::add_to_linker::<CallState, WasiCli>(l, CallState::cli)?;
    cli::terminal_stderr::add_to_linker::<CallState, WasiCli>(l, CallState::cli)?;
    bindings::Plugin::add_to_linker::<CallState, HasSelf<CallState>>(l, |t| t)?;
    Ok(linker)
}

/// Every import must be a granted interface; the first one that is not is named.
fn check_imports(component: &Component, engine: &Engine) -> Result<(), PluginError> {
    for (name, _) in component.component_type().imports(engine) {
        if !is_granted(name) {
            return Err(PluginError::ForbiddenImport {
                import: name.to_owned(),
                granted: granted_list(),
            });
        }
    }
    Ok(())
}

fn check_exports(component: &Component, engine: &Engine) -> Result<(), PluginError> {
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

/// `wasi:io/streams@0.2.6` → granted when the package and interface are listed (any version of
/// the package's major line: 0.2.x for WASI, 0.1.x for ours).
fn is_granted(import: &str) -> bool {
    let (path, version) = match import.split_once('@') {
        Some((path, version)) => (path, Some(version)),
        None => (import, None),
    };
    let Some((package, interface)) = path.split_once('/') else {
        return false;
    };
    let Some((_, interfaces)) = GRANTED.iter().find(|(p, _)| *p == package) else {
        return false;
    };
    let line_ok = match (package, version) {
        ("pko:transform", Some(v)) => v.starts_with("0.1."),
        (_, Some(v)) => v.starts_with("0.2."),
        (_, None) => false,
    };
    line_ok && interfaces.contains(&interface)
}

fn granted_list() -> String {
    GRANTED
        .iter()
        .map(|(package, interfaces)| format!("{package}/{{{}}}", interfaces.join(",")))
        .collect::<Vec<_>>()
        .join(" ")
}

/// Compiles `bytes`, or reads the machine code from the precompiled cache when it is there and
/// intact. Returns the component, where it came from and how long that took.
fn compile(
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
        match read_cached(&inner.engine, path) {
            Ok(Some(component)) => {
                crate::diskcache::touch(path);
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
        match write_cached(&component, path) {
            Ok(()) => {
                if let Some(dir) = path.parent() {
                    crate::diskcache::prune(dir, inner.config.cache_max_bytes, path);
                }
            }
            Err(e) => {
                warn!(path = %path.display(), error = %e, "cannot write the precompiled module")
            }
        }
    }
    Ok((component, LoadSource::Compiled, load_time))
}

/// A cache file is the sha256 of the serialized component followed by the serialized
/// component; a file that does not match its checksum is not loaded.
#[allow(
    unsafe_code,
    reason = "deserializes precompiled code this host wrote; see SAFETY"
)]
fn read_cached(engine: &Engine, path: &Path) -> Result<Option<Component>, String> {
    let data = match std::fs::read(path) {
        Ok(data) => data,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(e.to_string()),
    };
    if data.len() < 32 {
        return Err("truncated".into());
    }
    let (sum, body) = data.split_at(32);
    if Sha256::digest(body).as_slice() != sum {
        return Err("checksum mismatch".into());
    }
    // SAFETY: the bytes were produced by `Component::serialize` of this host (the folder is
    // keyed by the engine's compatibility hash, and wasmtime checks its version and settings
    // again) and are unchanged since (checksum above). The folder belongs to the operator;
    // whoever can write it can already change the operator's own code.
    unsafe { Component::deserialize(engine, body) }
        .map(Some)
        .map_err(|e| format!("{e:#}"))
}

fn write_cached(component: &Component, path: &Path) -> Result<(), String> {
    let body = component.serialize().map_err(|e| format!("{e:#}"))?;
    let dir = path.parent().ok_or("no parent folder")?;
    std::fs::create_dir_all(dir).map_err(|e| e.to_string())?;
    let mut data = Vec::with_capacity(body.len() + 32);
    data.extend_from_slice(&Sha256::digest(&body));
    data.extend_from_slice(&body);
    // Write then rename, so a reader never sees half a file.
    let tmp = dir.join(format!(
        ".{}.{}.tmp",
        path.file_name()
            .and_then(|n| n.to_str())
            .unwrap_or("module"),
        std::process::id()
    ));
    std::fs::write(&tmp, &data).map_err(|e| e.to_string())?;
    std::fs::rename(&tmp, path).map_err(|e| {
        let _ = std::fs::remove_file(&tmp);
        e.to_string()
    })
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
    fn the_memory_cap_covers_every_memory_and_table_of_an_instance() {
        let mut limiter = MemoryLimiter::new(100 << 20);
        // Two memories of 60 MiB: each alone is under the cap, together they are not.
        assert!(matches!(
            limiter.memory_growing(0, 60 << 20, None),
            Ok(true)
        ));
        assert!(limiter.memory_growing(0, 60 << 20, None).is_err());
        assert!(limiter.hit);
        // Growth counts only what is added; tables count too.
        let mut limiter = MemoryLimiter::new(100 << 20);
        assert!(matches!(
            limiter.memory_growing(0, 50 << 20, None),
            Ok(true)
        ));
        assert!(matches!(
            limiter.memory_growing(50 << 20, 90 << 20, None),
            Ok(true)
        ));
        assert!(matches!(limiter.table_growing(0, 1000, None), Ok(true)));
        assert_eq!(limiter.used, (90 << 20) + 1000 * TABLE_ELEMENT_BYTES);
        assert!(matches!(
            limiter.table_growing(0, MAX_TABLE_ELEMENTS + 1, None),
            Ok(false)
        ));
        assert!(limiter.memory_growing(90 << 20, 100 << 20, None).is_err());
        assert!(!limiter.hit || limiter.used <= 100 << 20);
    }

    #[test]
    fn budget_permits_round_caps_up_and_budgets_down() {
        assert_eq!(mib_permits(1), 1);
        assert_eq!(mib_permits(64 << 20), 64);
        assert_eq!(mib_permits((64 << 20) + 1), 65);
        assert_eq!(budget_permits((100 << 20) + 5), 100);
        assert_eq!(budget_permits(u64::MAX), (u64::MAX >> 20) as usize);
    }

    #[test]
    fn grants_what_a_rust_guest_needs_and_nothing_else() {
        for ok in [
            "wasi:io/streams@0.2.6",
            "wasi:io/error@0.2.0",
            "wasi:cli/environment@0.2.6",
            "wasi:cli/terminal-stdout@0.2.6",
            "wasi:clocks/wall-clock@0.2.6",
            "wasi:random/insecure-seed@0.2.4",
            "pko:transform/log@0.1.0",
            "pko:transform/types@0.1.3",
        ] {
            assert!(is_granted(ok), "{ok}");
        }
        for refused in [
            "wasi:filesystem/preopens@0.2.6",
            "wasi:filesystem/types@0.2.6",
            "wasi:sockets/tcp@0.2.6",
            "wasi:http/outgoing-handler@0.2.6",
            "wasi:io/streams@0.3.0",
            "wasi:io/streams",
            "pko:transform/log@0.2.0",
            "pko:transform/secrets@0.1.0",
            "env",
        ] {
            assert!(!is_granted(refused), "{refused}");
        }
    }

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
