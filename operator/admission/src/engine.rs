//! Evaluates the OPA-compiled policy module with opa-wasm on wasmtime.
//!
//! The module is compiled once. Every evaluation gets a fresh `Store` and a fresh OPA runtime
//! instance with its own data document, so no state survives from one request to the next and
//! a trapped instance is simply dropped. Each evaluation is bounded: a deadline checked at every
//! epoch tick stops the wasm code, a `StoreLimits` cap bounds its memory, a fixed number of slots
//! bounds how many run at once and how many may wait, and the wasm runs on tokio's blocking
//! pool, never on the async workers that answer probes and renew the leader lease.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use serde_json::Value;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use wasmtime::{Config, Engine, Module, Store, StoreLimits, StoreLimitsBuilder, UpdateDeadline};

use crate::bundle::Bundle;

/// How often the epoch advances; the deadline's resolution.
const EPOCH_TICK: Duration = Duration::from_millis(5);
/// Budget of the instantiation check at start-up.
const STARTUP_DEADLINE: Duration = Duration::from_secs(30);
/// Table elements one instance may have (an OPA module has one small function table).
const MAX_TABLE_ELEMENTS: usize = 100_000;

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
    stopped: Option<Stopped>,
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
    bundle_data: Arc<Value>,
    entrypoints: Vec<String>,
    digest: String,
    limits: EngineLimits,
    slots: Arc<Semaphore>,
    waiting: AtomicUsize,
    closed: Arc<AtomicBool>,
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
    /// Compiles the bundle's module and checks that it instantiates. CPU-heavy (cranelift):
    /// call it once at start-up.
    pub async fn new(bundle: &Bundle, limits: EngineLimits) -> Result<Self, EngineError> {
        let mut config = Config::new();
        config.epoch_interruption(true);
        let engine = Engine::new(&config).map_err(|e| EngineError::Compile(format!("{e:#}")))?;
        let module = Module::new(&engine, &bundle.wasm)
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
                bundle_data: Arc::new(bundle.data.clone()),
                entrypoints: bundle.entrypoints.clone(),
                digest: bundle.digest.clone(),
                limits,
                slots: Arc::new(Semaphore::new(limits.concurrency)),
                waiting: AtomicUsize::new(0),
                closed: Arc::new(AtomicBool::new(false)),
            }),
        };
        // Instantiating once proves every builtin the module needs is provided. Not bounded by
        // the per-request timeout: a cold start may be slower than a request.
        let mut store = policy.store(Instant::now() + STARTUP_DEADLINE);
        let runtime = opa_wasm::Runtime::new(&mut store, &policy.inner.module)
            .await
            .map_err(|e| EngineError::Load(format!("{e:#}")))?;
        let found = runtime.entrypoints();
        if let Some(missing) = policy
            .inner
            .entrypoints
            .iter()
            .find(|e| !found.contains(e.as_str()))
        {
            return Err(EngineError::MissingEntrypoint(missing.clone()));
        }
        Ok(policy)
    }

    /// `sha256:<hex>` of the bundle the module came from.
    pub fn digest(&self) -> &str {
        &self.inner.digest
    }

    /// The bundle's own data document.
    pub fn bundle_data(&self) -> &Value {
        &self.inner.bundle_data
    }

    /// The same, shared (handed to evaluations without a copy).
    pub fn shared_bundle_data(&self) -> Arc<Value> {
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

    /// Stops every running evaluation at its next epoch tick and refuses new ones.
    pub fn close(&self) {
        self.inner.closed.store(true, Ordering::Release);
        self.inner.slots.close();
    }

    fn store(&self, deadline: Instant) -> Store<StoreState> {
        let limits = StoreLimitsBuilder::new()
            .memory_size(self.inner.limits.memory_bytes)
            .table_elements(MAX_TABLE_ELEMENTS)
            .trap_on_grow_failure(true)
            .build();
        let mut store = Store::new(
            &self.inner.engine,
            StoreState {
                limits,
                stopped: None,
            },
        );
        store.limiter(|state| &mut state.limits);
        // One tick at a time: the callback decides, so a closed engine stops its evaluations
        // too, not only an expired deadline.
        store.set_epoch_deadline(1);
        let closed = self.inner.closed.clone();
        store.epoch_deadline_callback(move |mut ctx| {
            let stopped = if closed.load(Ordering::Acquire) {
                Some(Stopped::Closed)
            } else if Instant::now() >= deadline {
                Some(Stopped::Deadline)
            } else {
                None
            };
            match stopped {
                Some(reason) => {
                    ctx.data_mut().stopped = Some(reason);
                    Ok(UpdateDeadline::Interrupt)
                }
                None => Ok(UpdateDeadline::Continue(1)),
            }
        });
        store
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
    /// then runs on the blocking pool.
    pub async fn evaluate(
        &self,
        entrypoint: &str,
        input: &Value,
        data: &Value,
    ) -> Result<Value, EngineError> {
        let slot = self.slot(Instant::now()).await?;
        let (entrypoint, input, data) = (entrypoint.to_owned(), input.clone(), data.clone());
        slot.run(move |evaluator| evaluator.evaluate(&entrypoint, &input, &data))
            .await?
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
    /// Evaluates `entrypoint` on a fresh instance holding `data`, with `input`, and returns
    /// the entrypoint's value. Blocks the thread: call it from [`Slot::run`].
    pub fn evaluate(
        &self,
        entrypoint: &str,
        input: &Value,
        data: &Value,
    ) -> Result<Value, EngineError> {
        let inner = &self.engine.inner;
        let mut store = self.engine.store(self.deadline);
        // opa-wasm's API is async, but with a synchronous wasmtime configuration it never
        // waits on anything: polling it here runs the wasm on this thread.
        let result = futures::executor::block_on(async {
            let runtime = opa_wasm::Runtime::new(&mut store, &inner.module).await?;
            let policy = runtime.with_data(&mut store, data).await?;
            policy.evaluate(&mut store, entrypoint, input).await
        });
        match result {
            Ok(results) => first_result(entrypoint, results),
            Err(e) => Err(self.classify(&format!("{e:#}"), store.data().stopped)),
        }
    }

    fn classify(&self, message: &str, stopped: Option<Stopped>) -> EngineError {
        let limits = self.engine.inner.limits;
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
