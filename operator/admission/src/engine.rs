//! Evaluates the OPA-compiled policy module with opa-wasm on wasmtime.
//!
//! The module is compiled once. Instances are kept in a small pool (one per evaluation slot),
//! each in its own `Store`, with its data document loaded once: OPA's `opa_eval` resets the
//! heap pointer (and with it the allocator's free lists and builtin caches) to the mark taken
//! after the data was loaded, so every evaluation on a pooled instance starts from the same
//! heap state. An instance is pooled only after an evaluation that ended normally: one that
//! trapped, timed out, hit its memory cap or failed in any other way is dropped. An instance
//! is reused only for the data document (by version) it loaded.
//!
//! Each evaluation is bounded: a deadline checked at every epoch tick stops the wasm code, a
//! `StoreLimits` cap bounds its memory, a fixed number of slots bounds how many run at once
//! and how many may wait, and the wasm runs on tokio's blocking pool, never on the async
//! workers that answer probes and renew the leader lease.

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use serde_json::Value;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use wasmtime::{
    Config, Engine, Module, ResourceLimiter, Store, StoreLimits, StoreLimitsBuilder, UpdateDeadline,
};

use crate::bundle::Bundle;

/// How often the epoch advances; the deadline's resolution.
const EPOCH_TICK: Duration = Duration::from_millis(5);
/// Budget of the instantiation check at start-up.
const STARTUP_DEADLINE: Duration = Duration::from_secs(30);
/// Table elements one instance may have (an OPA module has one small function table).
const MAX_TABLE_ELEMENTS: usize = 100_000;
/// An instance whose memory grew past this (a huge review) is dropped after its evaluation
/// rather than pooled: pooled memory stays resident.
const MAX_POOLED_MEMORY: usize = 32 * 1024 * 1024;

/// Versions of data documents, unique in the process.
static NEXT_DATA_VERSION: AtomicU64 = AtomicU64::new(1);

/// A data document and its version. Pooled instances hold the document they loaded and are
/// reused only for the same version, so a new document is never evaluated with an old one.
#[derive(Debug)]
pub struct PolicyData {
    version: u64,
    value: Value,
}

impl PolicyData {
    /// `value` under a version of its own.
    pub fn new(value: Value) -> Arc<Self> {
        Arc::new(Self {
            version: NEXT_DATA_VERSION.fetch_add(1, Ordering::Relaxed),
            value,
        })
    }

    pub fn version(&self) -> u64 {
        self.version
    }

    pub fn value(&self) -> &Value {
        &self.value
    }
}

/// Errors of policy loading and evaluation.
#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    #[error("cannot compile the policy module: {0}")]
    Compile(String),
    #[error("the policy module does not load: {0}")]
    Load(String),
    #[error("the policy bundle lacks entrypoint {0}")]
    MissingEntrypoint(String),
    #[error("policy evaluation timed out after {0:?}")]
    Timeout(Duration),
    #[error("policy evaluation exceeded its memory limit of {0} bytes")]
    Memory(usize),
    #[error("policy evaluation failed: {0}")]
    Evaluation(String),
    #[error("entrypoint {0} is undefined for this input")]
    Undefined(String),
    #[error("the policy engine is shut down")]
    Closed,
    /// Every slot is taken and the queue is full.
    #[error("{running} policy evaluations are running and {waiting} are waiting; try again")]
    Busy { running: usize, waiting: usize },
    /// No slot freed up within the evaluation budget.
    #[error("no policy evaluation slot became free within {0:?}")]
    NoSlot(Duration),
}

impl EngineError {
    /// Short label for metrics (`error` label of the evaluation-errors counter).
    pub fn kind(&self) -> &'static str {
        match self {
            EngineError::Compile(_) | EngineError::Load(_) | EngineError::MissingEntrypoint(_) => {
                "load"
            }
            EngineError::Timeout(_) => "timeout",
            EngineError::Memory(_) => "memory",
            EngineError::Evaluation(_) => "evaluation",
            EngineError::Undefined(_) => "undefined",
            EngineError::Closed => "closed",
            EngineError::Busy { .. } => "busy",
            EngineError::NoSlot(_) => "no_slot",
        }
    }
}

/// Bounds of evaluations.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct EngineLimits {
    /// Wall-clock budget of one evaluation, waiting for a slot included. Keep it below the
    /// webhook's `timeoutSeconds` so the operator answers before the apiserver gives up.
    pub timeout: Duration,
    /// Memory (linear memory) one instance may grow to.
    pub memory_bytes: usize,
    /// Evaluations running at once (each on a blocking thread).
    pub concurrency: usize,
    /// Requests that may wait for a slot; more are refused at once.
    pub max_waiting: usize,
}

impl EngineLimits {
    /// The defaults when nothing says how much memory the container has.
    pub const DEFAULT: EngineLimits = EngineLimits {
        timeout: Duration::from_secs(2),
        memory_bytes: 128 * 1024 * 1024,
        concurrency: 4,
        max_waiting: 64,
    };
}

impl Default for EngineLimits {
    fn default() -> Self {
        Self::DEFAULT
    }
}

/// Why an instance was stopped by the epoch callback.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Stopped {
    Deadline,
    Closed,
}

struct StoreState {
    limits: StoreLimits,
    /// Deadline of the evaluation running now; set before each one.
    deadline: Instant,
    stopped: Option<Stopped>,
    /// Size the linear memory has grown to.
    memory_bytes: usize,
}

/// The memory cap, and a record of how large the memory grew.
impl ResourceLimiter for StoreState {
    fn memory_growing(
        &mut self,
        current: usize,
        desired: usize,
        maximum: Option<usize>,
    ) -> wasmtime::Result<bool> {
        let allowed = self.limits.memory_growing(current, desired, maximum)?;
        if allowed {
            self.memory_bytes = self.memory_bytes.max(desired);
        }
        Ok(allowed)
    }

    fn memory_grow_failed(&mut self, error: wasmtime::Error) -> wasmtime::Result<()> {
        self.limits.memory_grow_failed(error)
    }

    fn table_growing(
        &mut self,
        current: usize,
        desired: usize,
        maximum: Option<usize>,
    ) -> wasmtime::Result<bool> {
        self.limits.table_growing(current, desired, maximum)
    }

    fn table_grow_failed(&mut self, error: wasmtime::Error) -> wasmtime::Result<()> {
        self.limits.table_grow_failed(error)
    }

    fn instances(&self) -> usize {
        self.limits.instances()
    }

    fn tables(&self) -> usize {
        self.limits.tables()
    }

    fn memories(&self) -> usize {
        self.limits.memories()
    }
}

/// An OPA instance with its data loaded, in a store of its own.
struct Instance {
    store: Store<StoreState>,
    policy: opa_wasm::Policy<opa_wasm::DefaultContext>,
    /// Version of the data document loaded.
    data_version: u64,
}

/// Ready instances, at most one per slot.
struct Pool {
    idle: Mutex<Vec<Instance>>,
    capacity: usize,
}

impl Pool {
    fn lock(&self) -> std::sync::MutexGuard<'_, Vec<Instance>> {
        self.idle.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// An idle instance holding data `version`, if any. Instances of older data are dropped
    /// on the way (versions only grow): the pool never holds more instances than slots.
    fn take(&self, version: u64) -> Option<Instance> {
        let (found, stale) = {
            let mut idle = self.lock();
            let mut stale = Vec::new();
            if idle.iter().any(|i| i.data_version < version) {
                let kept;
                (stale, kept) = std::mem::take(&mut *idle)
                    .into_iter()
                    .partition(|i| i.data_version < version);
                *idle = kept;
            }
            let found = idle
                .iter()
                .position(|i| i.data_version == version)
                .map(|at| idle.swap_remove(at));
            (found, stale)
        };
        // Freed outside the lock: dropping an instance unmaps its memory.
        drop(stale);
        found
    }

    /// Keeps an instance that ended an evaluation normally. Instances of older data go first
    /// (versions only grow), and the pool never holds more than its capacity.
    fn put(&self, instance: Instance) {
        let mut idle = self.lock();
        idle.retain(|i| i.data_version >= instance.data_version);
        if idle.len() < self.capacity {
            idle.push(instance);
        }
    }

    fn len(&self) -> usize {
        self.lock().len()
    }

    fn clear(&self) {
        // Dropped outside the lock: freeing instances takes a while.
        let idle = std::mem::take(&mut *self.lock());
        drop(idle);
    }
}

/// Stops the epoch thread when the engine is dropped.
struct EpochTicker {
    stop: Arc<AtomicBool>,
}

impl EpochTicker {
    fn start(engine: &Engine) -> Self {
        let stop = Arc::new(AtomicBool::new(false));
        let (flag, engine) = (stop.clone(), engine.clone());
        // A plain thread: the epoch must advance whatever the runtimes are doing.
        let spawned = std::thread::Builder::new()
            .name("pko-policy-epoch".into())
            .spawn(move || {
                while !flag.load(Ordering::Relaxed) {
                    std::thread::sleep(EPOCH_TICK);
                    engine.increment_epoch();
                }
            });
        if let Err(e) = spawned {
            // Without the thread deadlines never fire; the async wait still bounds answers.
            tracing::error!(error = %e, "cannot start the policy epoch thread");
        }
        Self { stop }
    }
}

impl Drop for EpochTicker {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
    }
}

struct Inner {
    engine: Engine,
    module: Module,
    bundle_data: Arc<PolicyData>,
    entrypoints: Vec<String>,
    digest: String,
    limits: EngineLimits,
    slots: Arc<Semaphore>,
    waiting: AtomicUsize,
    closed: Arc<AtomicBool>,
    pool: Pool,
    _ticker: EpochTicker,
}

/// The compiled policy module and the limits of its evaluations. Cheap to clone (shared).
#[derive(Clone)]
pub struct PolicyEngine {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for PolicyEngine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PolicyEngine")
            .field("digest", &self.inner.digest)
            .field("entrypoints", &self.inner.entrypoints)
            .field("limits", &self.inner.limits)
            .finish_non_exhaustive()
    }
}

impl PolicyEngine {
    /// Compiles the bundle's module (on the blocking pool: cranelift is CPU-heavy) and checks
    /// that it instantiates with the bundle's data. Call it once at start-up.
    pub async fn new(bundle: &Bundle, limits: EngineLimits) -> Result<Self, EngineError> {
        let mut config = Config::new();
        config.epoch_interruption(true);
        let engine = Engine::new(&config).map_err(|e| EngineError::Compile(format!("{e:#}")))?;
        let (compiler, wasm) = (engine.clone(), bundle.wasm.clone());
        let module = tokio::task::spawn_blocking(move || Module::new(&compiler, &wasm))
            .await
            .map_err(|e| EngineError::Compile(format!("the compile task ended abnormally: {e}")))?
            .map_err(|e| EngineError::Compile(format!("{e:#}")))?;
        let limits = EngineLimits {
            concurrency: limits.concurrency.max(1),
            ..limits
        };
        let policy = Self {
            inner: Arc::new(Inner {
                _ticker: EpochTicker::start(&engine),
                engine,
                module,
                bundle_data: PolicyData::new(bundle.data.clone()),
                entrypoints: bundle.entrypoints.clone(),
                digest: bundle.digest.clone(),
                limits,
                slots: Arc::new(Semaphore::new(limits.concurrency)),
                waiting: AtomicUsize::new(0),
                closed: Arc::new(AtomicBool::new(false)),
                pool: Pool {
                    idle: Mutex::new(Vec::with_capacity(limits.concurrency)),
                    capacity: limits.concurrency,
                },
            }),
        };
        // Instantiating once proves every builtin the module needs is provided. Not bounded by
        // the per-request timeout: a cold start may be slower than a request.
        let inner = policy.inner.clone();
        tokio::task::spawn_blocking(move || {
            let data = inner.bundle_data.clone();
            let instance = inner
                .instance(&data.value, data.version, Instant::now() + STARTUP_DEADLINE)
                .map_err(|e| match e {
                    EngineError::Evaluation(message) => EngineError::Load(message),
                    other => other,
                })?;
            let found = instance.policy.entrypoints();
            if let Some(missing) = inner
                .entrypoints
                .iter()
                .find(|e| !found.contains(e.as_str()))
            {
                return Err(EngineError::MissingEntrypoint(missing.clone()));
            }
            inner.pool.put(instance);
            Ok(())
        })
        .await
        .map_err(|e| EngineError::Load(format!("the load task ended abnormally: {e}")))??;
        Ok(policy)
    }

    /// `sha256:<hex>` of the bundle the module came from.
    pub fn digest(&self) -> &str {
        &self.inner.digest
    }

    /// The bundle's own data document.
    pub fn bundle_data(&self) -> &Value {
        &self.inner.bundle_data.value
    }

    /// The same, versioned (instances that loaded it are reused).
    pub fn shared_bundle_data(&self) -> Arc<PolicyData> {
        self.inner.bundle_data.clone()
    }

    pub fn limits(&self) -> EngineLimits {
        self.inner.limits
    }

    /// Evaluations running now.
    pub fn running(&self) -> usize {
        self.inner.limits.concurrency - self.inner.slots.available_permits()
    }

    /// Requests waiting for a slot now.
    pub fn waiting(&self) -> usize {
        self.inner.waiting.load(Ordering::Acquire)
    }

    /// Ready instances in the pool now.
    pub fn pooled(&self) -> usize {
        self.inner.pool.len()
    }

    /// Linear memory of each pooled instance, in bytes (the largest it grew to).
    pub fn pooled_memory(&self) -> Vec<usize> {
        self.inner
            .pool
            .lock()
            .iter()
            .map(|i| i.store.data().memory_bytes)
            .collect()
    }

    /// Stops every running evaluation at its next epoch tick, refuses new ones and frees the
    /// pooled instances.
    pub fn close(&self) {
        self.inner.closed.store(true, Ordering::Release);
        self.inner.slots.close();
        self.inner.pool.clear();
    }

    /// Takes an evaluation slot for a request that started at `started`: at once when one is
    /// free, else waiting in a bounded queue until the request's budget is spent.
    pub async fn slot(&self, started: Instant) -> Result<Slot, EngineError> {
        let inner = &self.inner;
        if inner.closed.load(Ordering::Acquire) {
            return Err(EngineError::Closed);
        }
        let deadline = started + inner.limits.timeout;
        let permit = match inner.slots.clone().try_acquire_owned() {
            Ok(permit) => permit,
            Err(tokio::sync::TryAcquireError::Closed) => return Err(EngineError::Closed),
            Err(tokio::sync::TryAcquireError::NoPermits) => {
                let waiting = inner.waiting.fetch_add(1, Ordering::AcqRel);
                let _queued = Queued(&inner.waiting);
                if waiting >= inner.limits.max_waiting {
                    return Err(EngineError::Busy {
                        running: inner.limits.concurrency,
                        waiting,
                    });
                }
                let wait = deadline.saturating_duration_since(Instant::now());
                match tokio::time::timeout(wait, inner.slots.clone().acquire_owned()).await {
                    Ok(Ok(permit)) => permit,
                    Ok(Err(_)) => return Err(EngineError::Closed),
                    Err(_) => return Err(EngineError::NoSlot(inner.limits.timeout)),
                }
            }
        };
        Ok(Slot {
            engine: self.clone(),
            permit: Arc::new(permit),
            deadline,
        })
    }

    /// Evaluates `entrypoint` on a fresh instance holding `data`, with `input`: takes a slot,
    /// then runs on the blocking pool. The instance is not pooled.
    pub async fn evaluate(
        &self,
        entrypoint: &str,
        input: &Value,
        data: &Value,
    ) -> Result<Value, EngineError> {
        let slot = self.slot(Instant::now()).await?;
        let (entrypoint, input, data) = (entrypoint.to_owned(), input.clone(), data.clone());
        slot.run(move |evaluator| evaluator.evaluate_once(&entrypoint, &input, &data))
            .await?
    }

    /// Evaluates `entrypoint` with `input` on a pooled instance holding `data` (one is loaded
    /// when none is ready): takes a slot, then runs on the blocking pool.
    pub async fn evaluate_with(
        &self,
        entrypoint: &str,
        input: &Value,
        data: &Arc<PolicyData>,
    ) -> Result<Value, EngineError> {
        let slot = self.slot(Instant::now()).await?;
        let (entrypoint, input, data) = (entrypoint.to_owned(), input.clone(), data.clone());
        slot.run(move |evaluator| evaluator.evaluate(&entrypoint, &input, &data))
            .await?
    }
}

impl Inner {
    fn store(&self, deadline: Instant) -> Store<StoreState> {
        let limits = StoreLimitsBuilder::new()
            .memory_size(self.limits.memory_bytes)
            .table_elements(MAX_TABLE_ELEMENTS)
            .trap_on_grow_failure(true)
            .build();
        let mut store = Store::new(
            &self.engine,
            StoreState {
                limits,
                deadline,
                stopped: None,
                memory_bytes: 0,
            },
        );
        store.limiter(|state| state as &mut dyn ResourceLimiter);
        // One tick at a time: the callback decides, so a closed engine stops its evaluations
        // too, not only an expired deadline. The deadline is the store's current evaluation's.
        store.set_epoch_deadline(1);
        let closed = self.closed.clone();
        store.epoch_deadline_callback(move |mut ctx| {
            let state = ctx.data_mut();
            let stopped = if closed.load(Ordering::Acquire) {
                Some(Stopped::Closed)
            } else if Instant::now() >= state.deadline {
                Some(Stopped::Deadline)
            } else {
                None
            };
            match stopped {
                Some(reason) => {
                    state.stopped = Some(reason);
                    Ok(UpdateDeadline::Interrupt)
                }
                None => Ok(UpdateDeadline::Continue(1)),
            }
        });
        store
    }

    /// A new instance holding `data` (of version `version`), loaded within `deadline`.
    fn instance(
        &self,
        data: &Value,
        version: u64,
        deadline: Instant,
    ) -> Result<Instance, EngineError> {
        let mut store = self.store(deadline);
        // opa-wasm's API is async, but with a synchronous wasmtime configuration it never
        // waits on anything: polling it here runs the wasm on this thread.
        let loaded = futures::executor::block_on(async {
            let runtime = opa_wasm::Runtime::new(&mut store, &self.module).await?;
            runtime.with_data(&mut store, data).await
        });
        match loaded {
            Ok(policy) => Ok(Instance {
                store,
                policy,
                data_version: version,
            }),
            Err(e) => Err(self.classify(&format!("{e:#}"), store.data().stopped)),
        }
    }

    fn classify(&self, message: &str, stopped: Option<Stopped>) -> EngineError {
        let limits = self.limits;
        let lower = message.to_ascii_lowercase();
        match stopped {
            Some(Stopped::Closed) => EngineError::Closed,
            Some(Stopped::Deadline) => EngineError::Timeout(limits.timeout),
            None if lower.contains("growing memory")
                || lower.contains("memory limit")
                || lower.contains("forcing trap when growing") =>
            {
                EngineError::Memory(limits.memory_bytes)
            }
            None if lower.contains("could not find entrypoint") => {
                EngineError::MissingEntrypoint(message.to_owned())
            }
            None => EngineError::Evaluation(message.to_owned()),
        }
    }
}

/// Counts a request in the queue while it waits.
struct Queued<'a>(&'a AtomicUsize);

impl Drop for Queued<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

/// A taken evaluation slot. Work run with [`Slot::run`] holds it until that work ends, even
/// when the caller stops waiting for it.
pub struct Slot {
    engine: PolicyEngine,
    permit: Arc<OwnedSemaphorePermit>,
    deadline: Instant,
}

impl Slot {
    /// When the request's budget runs out.
    pub fn deadline(&self) -> Instant {
        self.deadline
    }

    /// Runs `work` on the blocking pool with an [`Evaluator`] bound to this slot. The answer
    /// is awaited until the deadline (plus one tick for the interrupt to land).
    pub async fn run<R, F>(&self, work: F) -> Result<R, EngineError>
    where
        F: FnOnce(&Evaluator) -> R + Send + 'static,
        R: Send + 'static,
    {
        let evaluator = Evaluator {
            engine: self.engine.clone(),
            deadline: self.deadline,
            _permit: self.permit.clone(),
        };
        let timeout = self.engine.inner.limits.timeout;
        let task = tokio::task::spawn_blocking(move || work(&evaluator));
        let grace = self.deadline.saturating_duration_since(Instant::now()) + EPOCH_TICK * 4;
        match tokio::time::timeout(grace, task).await {
            Ok(Ok(value)) => Ok(value),
            Ok(Err(e)) => Err(EngineError::Evaluation(format!(
                "the evaluation task ended abnormally: {e}"
            ))),
            // The wasm stops at the next tick; its thread still holds the slot until then.
            Err(_) => Err(EngineError::Timeout(timeout)),
        }
    }
}

/// Evaluates on the current (blocking) thread, within a slot's deadline.
pub struct Evaluator {
    engine: PolicyEngine,
    deadline: Instant,
    _permit: Arc<OwnedSemaphorePermit>,
}

impl Evaluator {
    /// Evaluates `entrypoint` with `input` on a pooled instance holding `data` (a new one
    /// when none is ready) and returns the entrypoint's value. The instance goes back to the
    /// pool only if the evaluation succeeded. Blocks the thread: call it from [`Slot::run`].
    pub fn evaluate(
        &self,
        entrypoint: &str,
        input: &Value,
        data: &PolicyData,
    ) -> Result<Value, EngineError> {
        let inner = &self.engine.inner;
        let mut instance = match inner.pool.take(data.version) {
            Some(instance) => instance,
            None => inner.instance(&data.value, data.version, self.deadline)?,
        };
        let result = self.run(&mut instance, entrypoint, input);
        if result.is_ok()
            && instance.store.data().memory_bytes <= MAX_POOLED_MEMORY
            && !inner.closed.load(Ordering::Acquire)
        {
            inner.pool.put(instance);
        }
        result
    }

    /// Evaluates `entrypoint` on a fresh instance holding `data`, with `input`, and drops the
    /// instance (for data documents used once). Blocks the thread: call it from
    /// [`Slot::run`].
    pub fn evaluate_once(
        &self,
        entrypoint: &str,
        input: &Value,
        data: &Value,
    ) -> Result<Value, EngineError> {
        let mut instance = self.engine.inner.instance(data, 0, self.deadline)?;
        self.run(&mut instance, entrypoint, input)
    }

    /// One evaluation on `instance`, under this slot's deadline. `opa_eval` starts from the
    /// heap mark taken after the data was loaded, whatever earlier evaluations allocated.
    fn run(
        &self,
        instance: &mut Instance,
        entrypoint: &str,
        input: &Value,
    ) -> Result<Value, EngineError> {
        let state = instance.store.data_mut();
        state.deadline = self.deadline;
        state.stopped = None;
        instance.store.set_epoch_deadline(1);
        let result = futures::executor::block_on(instance.policy.evaluate(
            &mut instance.store,
            entrypoint,
            input,
        ));
        match result {
            Ok(results) => first_result(entrypoint, results),
            Err(e) => Err(self
                .engine
                .inner
                .classify(&format!("{e:#}"), instance.store.data().stopped)),
        }
    }
}

/// OPA returns a result set: `[{"result": <value>}]`, or `[]` when the rule is undefined.
fn first_result(entrypoint: &str, results: Value) -> Result<Value, EngineError> {
    match results {
        Value::Array(items) => match items.into_iter().next() {
            Some(Value::Object(mut first)) => first
                .remove("result")
                .ok_or_else(|| EngineError::Undefined(entrypoint.to_owned())),
            Some(other) => Err(EngineError::Evaluation(format!(
                "unexpected result entry {other}"
            ))),
            None => Err(EngineError::Undefined(entrypoint.to_owned())),
        },
        other => Err(EngineError::Evaluation(format!(
            "unexpected result set {other}"
        ))),
    }
}
#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    #[test]
    fn result_sets() {
        assert_eq!(
            first_result("e", json!([{"result": {"a": 1}}])).expect("value"),
            json!({"a": 1})
        );
        assert!(matches!(
            first_result("e", json!([])),
            Err(EngineError::Undefined(_))
        ));
        assert!(matches!(
            first_result("e", json!({"x": 1})),
            Err(EngineError::Evaluation(_))
        ));
    }
}
