//! Evaluates the OPA-compiled policy module with opa-wasm on wasmtime.
//!
//! The module is compiled once. Every evaluation gets a fresh `Store` and a fresh OPA runtime
//! instance with its own data document, so no state survives from one request to the next and
//! a trapped instance is simply dropped. Each evaluation is bounded: an epoch deadline stops
//! the wasm code at `timeout`, a `StoreLimits` cap bounds its memory and a semaphore bounds how
//! many run at once.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use serde_json::Value;
use tokio::sync::Semaphore;
use wasmtime::{Config, Engine, Module, Store, StoreLimits, StoreLimitsBuilder};

use crate::bundle::Bundle;

/// How often the epoch advances; the timeout's resolution.
const EPOCH_TICK: Duration = Duration::from_millis(5);
/// Budget of the instantiation check at start-up.
const STARTUP_DEADLINE: Duration = Duration::from_secs(30);

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
        }
    }
}

/// Bounds of one evaluation.
#[derive(Clone, Copy, Debug)]
pub struct EngineLimits {
    /// Wall-clock budget of one evaluation, waiting for a slot included. Keep it below the
    /// webhook's `timeoutSeconds` so the operator answers before the apiserver gives up.
    pub timeout: Duration,
    /// Linear memory one instance may grow to.
    pub memory_bytes: usize,
    /// Evaluations running at once.
    pub concurrency: usize,
}

impl Default for EngineLimits {
    fn default() -> Self {
        Self {
            timeout: Duration::from_secs(2),
            memory_bytes: 128 * 1024 * 1024,
            concurrency: 16,
        }
    }
}

struct StoreState {
    limits: StoreLimits,
}

/// Stops the epoch thread when the engine is dropped.
struct EpochTicker {
    stop: Arc<AtomicBool>,
}

impl EpochTicker {
    fn start(engine: &Engine) -> Self {
        let stop = Arc::new(AtomicBool::new(false));
        let (flag, engine) = (stop.clone(), engine.clone());
        // A plain thread: the epoch must advance even when every tokio worker is busy.
        let spawned = std::thread::Builder::new()
            .name("pko-policy-epoch".into())
            .spawn(move || {
                while !flag.load(Ordering::Relaxed) {
                    std::thread::sleep(EPOCH_TICK);
                    engine.increment_epoch();
                }
            });
        if let Err(e) = spawned {
            // Without the thread deadlines never fire; the tokio timeout still bounds waits.
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

/// The compiled policy module and the limits of its evaluations. Cheap to share (`Arc`).
pub struct PolicyEngine {
    engine: Engine,
    module: Module,
    bundle_data: Value,
    entrypoints: Vec<String>,
    digest: String,
    limits: EngineLimits,
    permits: Semaphore,
    _ticker: EpochTicker,
}

impl std::fmt::Debug for PolicyEngine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PolicyEngine")
            .field("digest", &self.digest)
            .field("entrypoints", &self.entrypoints)
            .field("limits", &self.limits)
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
        let policy = Self {
            _ticker: EpochTicker::start(&engine),
            engine,
            module,
            bundle_data: bundle.data.clone(),
            entrypoints: bundle.entrypoints.clone(),
            digest: bundle.digest.clone(),
            limits,
            permits: Semaphore::new(limits.concurrency.max(1)),
        };
        // Instantiating once proves every builtin the module needs is provided. Not bounded by
        // the per-request timeout: a cold start may be slower than a request.
        let mut store = policy.store();
        store.set_epoch_deadline(deadline_ticks(STARTUP_DEADLINE));
        let runtime = opa_wasm::Runtime::new(&mut store, &policy.module)
            .await
            .map_err(|e| EngineError::Load(format!("{e:#}")))?;
        let found = runtime.entrypoints();
        if let Some(missing) = policy
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
        &self.digest
    }

    /// The bundle's own data document.
    pub fn bundle_data(&self) -> &Value {
        &self.bundle_data
    }

    pub fn limits(&self) -> EngineLimits {
        self.limits
    }

    fn store(&self) -> Store<StoreState> {
        let limits = StoreLimitsBuilder::new()
            .memory_size(self.limits.memory_bytes)
            .trap_on_grow_failure(true)
            .build();
        let mut store = Store::new(&self.engine, StoreState { limits });
        store.limiter(|state| &mut state.limits);
        store.set_epoch_deadline(deadline_ticks(self.limits.timeout));
        store
    }

    /// Evaluates `entrypoint` on a fresh instance holding `data`, with `input`, and returns
    /// the entrypoint's value.
    pub async fn evaluate(
        &self,
        entrypoint: &str,
        input: &Value,
        data: &Value,
    ) -> Result<Value, EngineError> {
        let started = Instant::now();
        let timeout = self.limits.timeout;
        let run = async {
            let _permit = self
                .permits
                .acquire()
                .await
                .map_err(|_| EngineError::Closed)?;
            // The deadline counts from here: waiting for a slot used part of the budget.
            let mut store = self.store();
            store.set_epoch_deadline(deadline_ticks(timeout.saturating_sub(started.elapsed())));
            let runtime = opa_wasm::Runtime::new(&mut store, &self.module)
                .await
                .map_err(|e| self.classify(&format!("{e:#}"), started))?;
            let policy = runtime
                .with_data(&mut store, data)
                .await
                .map_err(|e| self.classify(&format!("{e:#}"), started))?;
            let results: Value = policy
                .evaluate(&mut store, entrypoint, input)
                .await
                .map_err(|e| self.classify(&format!("{e:#}"), started))?;
            first_result(entrypoint, results)
        };
        match tokio::time::timeout(timeout, run).await {
            Ok(result) => result,
            Err(_) => Err(EngineError::Timeout(timeout)),
        }
    }

    fn classify(&self, message: &str, started: Instant) -> EngineError {
        let lower = message.to_ascii_lowercase();
        if lower.contains("interrupt") || started.elapsed() >= self.limits.timeout {
            EngineError::Timeout(self.limits.timeout)
        } else if lower.contains("growing memory") || lower.contains("memory limit") {
            EngineError::Memory(self.limits.memory_bytes)
        } else if lower.contains("could not find entrypoint") {
            EngineError::MissingEntrypoint(message.to_owned())
        } else {
            EngineError::Evaluation(message.to_owned())
        }
    }
}

/// Epoch ticks covering `d` (at least one).
fn deadline_ticks(d: Duration) -> u64 {
    u64::try_from(d.as_millis() / EPOCH_TICK.as_millis() + 1).unwrap_or(u64::MAX)
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
