//! Running one call: its namespace's share of the slots, a slot and a share of the memory
//! budget, a fresh store with its fuel and epoch deadline run on the calling task under an
//! outer timeout, then the failure named and the output checked.

use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::sync::Semaphore;
use tracing::{Instrument, debug, info_span, warn};
use wasmtime::{Store, Trap, UpdateDeadline};

use super::bindings;
use super::bindings::exports::pko::transform::transformer as wit;
use super::engine::EPOCH_TICK;
use super::sandbox::{CallState, DeniedCall, Output};
use super::{CallSite, Inner, Module, PluginHost, ProgramInput, TransformOutput, bounded};
use crate::errors::PluginError;
use crate::json;
use crate::limits::Limits;

/// Extra time the outer timeout gives the epoch deadline before declaring the call lost.
const TIMEOUT_GRACE: Duration = Duration::from_millis(500);
/// Warnings kept per call, and bytes per warning.
const MAX_WARNINGS: usize = 32;
const MAX_WARNING_BYTES: usize = 1024;

/// What a call asks of the guest.
pub(super) enum Request {
    Info,
    ValidateConfig {
        config_json: String,
    },
    Transform {
        program: wit::Program,
        config_json: String,
    },
}

/// What the guest answered.
pub(super) enum Response {
    Info(wit::PluginInfo),
    Validated,
    Transformed(TransformOutput),
}

/// How a call went, besides its result.
#[derive(Debug, Clone, Copy, Default)]
pub(super) struct CallStats {
    /// Fuel consumed.
    pub(super) fuel: u64,
    /// Time to create the store and instantiate the module.
    pub(super) instantiate: Duration,
}

impl PluginHost {
    /// Runs `validate-config` on `config` (JSON; `null` when none is given).
    pub async fn validate_config(
        &self,
        module: &Arc<Module>,
        config: &serde_json::Value,
        limits: Limits,
        site: &CallSite,
    ) -> Result<(), PluginError> {
        let request = Request::ValidateConfig {
            config_json: json::canonical_string(config),
        };
        self.call(module, limits, site, request).await.map(|_| ())
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
        let request = Request::Transform {
            program: wit::Program {
                namespace: input.namespace.clone(),
                name: input.name.clone(),
                labels: input
                    .labels
                    .iter()
                    .map(|(k, v)| (k.clone(), v.clone()))
                    .collect(),
                spec_json: json::canonical_string(&input.spec),
            },
            config_json: json::canonical_string(config),
        };
        match self.call(module, limits, site, request).await? {
            (Response::Transformed(mut output), stats) => {
                output.fuel = stats.fuel;
                output.instantiate = stats.instantiate;
                Ok(output)
            }
            _ => Err(PluginError::Host("transform answered another call".into())),
        }
    }

    /// One call on a fresh instance: waits for a slot and a share of the memory budget, runs
    /// the guest under the limits, classifies failures, records metrics.
    pub(super) async fn call(
        &self,
        module: &Arc<Module>,
        limits: Limits,
        site: &CallSite,
        request: Request,
    ) -> Result<(Response, CallStats), PluginError> {
        let started = Instant::now();
        let function = request.function();
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
            .call_inner(module, limits, site, request)
            .instrument(span.clone())
            .await;
        let recorded = match &result {
            Ok((_, stats)) => {
                span.record("fuel", stats.fuel);
                Ok(stats.fuel)
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

    async fn call_inner(
        &self,
        module: &Module,
        limits: Limits,
        site: &CallSite,
        request: Request,
    ) -> Result<(Response, CallStats), PluginError> {
        // Waiting for a slot counts against the call's budget.
        let deadline = tokio::time::Instant::now() + limits.timeout;
        // First the namespace's share, so a call waiting for it holds none of the slots other
        // namespaces need.
        let _share = match &site.namespace {
            Some(namespace) => Some(
                tokio::time::timeout_at(deadline, self.inner.shares.of(namespace).acquire_owned())
                    .await
                    .map_err(|_| PluginError::ShareBusy {
                        namespace: namespace.clone(),
                        share: self.inner.shares.per_namespace(),
                        waited: limits.timeout,
                    })?
                    .map_err(|_| PluginError::Host("the plugin host is shutting down".into()))?,
            ),
            None => None,
        };
        let _permit = tokio::time::timeout_at(deadline, self.inner.slots.acquire())
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
        let _reserved = tokio::time::timeout_at(deadline, self.inner.memory.acquire_many(asked))
            .await
            .map_err(|_| PluginError::Busy(limits.timeout))?
            .map_err(|_| PluginError::Host("the plugin host is shutting down".into()))?;
        let remaining = deadline.saturating_duration_since(tokio::time::Instant::now());
        let transform: Arc<str> = Arc::from(site.transform.as_str());
        let function = request.function();
        // The guest runs on this task (wasmtime switches to a stack of its own) and yields at
        // every epoch tick, so it needs no thread of its own and this timeout stays able to
        // fire. Dropping the future drops the store: the slot is free once the guest stopped.
        let run = run(&self.inner, module, limits, remaining, transform, request);
        match tokio::time::timeout(remaining + TIMEOUT_GRACE, run).await {
            Ok(result) => result,
            Err(_) => {
                warn!(function, "plugin call outlived its epoch deadline");
                Err(PluginError::Timeout(limits.timeout))
            }
        }
    }
}

impl Request {
    fn function(&self) -> &'static str {
        match self {
            Self::Info => "info",
            Self::ValidateConfig { .. } => "validate-config",
            Self::Transform { .. } => "transform",
        }
    }
}

/// MiB permits covering `bytes` (rounded up).
fn mib_permits(bytes: u64) -> u32 {
    u32::try_from(bytes.div_ceil(1 << 20)).unwrap_or(u32::MAX)
}

/// Permits of a budget of `bytes` (whole MiB), within what a semaphore can hold.
pub(super) fn budget_permits(bytes: u64) -> usize {
    usize::try_from(bytes >> 20)
        .unwrap_or(usize::MAX)
        .min(Semaphore::MAX_PERMITS)
}

/// Epoch ticks in `budget` (at least one).
fn ticks(budget: Duration) -> u64 {
    u64::try_from(budget.as_millis().div_ceil(EPOCH_TICK.as_millis()).max(1)).unwrap_or(u64::MAX)
}

/// A fresh store with the call's fuel, memory cap and deadline; the module instantiated in
/// it; the request run; failures named.
async fn run(
    inner: &Inner,
    module: &Module,
    limits: Limits,
    budget: Duration,
    transform: Arc<str>,
    request: Request,
) -> Result<(Response, CallStats), PluginError> {
    let started = Instant::now();
    let memory_bytes = usize::try_from(limits.memory_bytes).unwrap_or(usize::MAX);
    let (state, output) = CallState::new(transform, memory_bytes);
    let mut store = Store::new(&inner.engine, state);
    store.limiter(|state| &mut state.limiter);
    store
        .set_fuel(limits.fuel)
        .map_err(|e| PluginError::Host(format!("cannot set fuel: {e:#}")))?;
    // Yield to the executor at every tick, trap at the last one.
    let mut ticks_left = ticks(budget);
    store.set_epoch_deadline(1);
    store.epoch_deadline_callback(move |_| {
        ticks_left = ticks_left.saturating_sub(1);
        if ticks_left == 0 {
            return Ok(UpdateDeadline::Interrupt);
        }
        Ok(UpdateDeadline::YieldCustom(
            1,
            Box::pin(tokio::task::yield_now()),
        ))
    });

    let function = request.function();
    let mut stats = CallStats::default();
    let outcome = match module.pre.instantiate_async(&mut store).await {
        Ok(plugin) => {
            stats.instantiate = started.elapsed();
            invoke(&plugin, &mut store, request, limits).await
        }
        Err(err) => Err(err),
    };
    stats.fuel = limits.fuel.saturating_sub(store.get_fuel().unwrap_or(0));
    store.data_mut().log_output(&output);
    match outcome {
        Ok(Ok(value)) => Ok((value, stats)),
        Ok(Err(refused)) => Err(refused),
        Err(err) => {
            let err = classify(&err, &store, limits, &output);
            debug!(function, error = %err, fuel = stats.fuel, "plugin call failed");
            Err(err)
        }
    }
}

/// Calls the export `request` names; the outer `Err` is a trap, the inner one a refusal (by
/// the guest, or of its output).
async fn invoke(
    plugin: &bindings::Plugin,
    store: &mut Store<CallState>,
    request: Request,
    limits: Limits,
) -> wasmtime::Result<Result<Response, PluginError>> {
    let exports = plugin.pko_transform_transformer();
    Ok(match request {
        Request::Info => Ok(Response::Info(exports.call_info(store).await?)),
        Request::ValidateConfig { config_json } => exports
            .call_validate_config(store, &config_json)
            .await?
            .map(|()| Response::Validated)
            .map_err(guest_error),
        Request::Transform {
            program,
            config_json,
        } => exports
            .call_transform(store, &program, &config_json)
            .await?
            .map_err(guest_error)
            // Checked inside the call, so a bad output counts as a failed call in the metrics.
            .and_then(|out| checked_output(out, limits))
            .map(Response::Transformed),
    })
}

/// Names the cause of a failed call: the memory cap (our flag), fuel and epoch traps, other
/// traps (with what the guest wrote to stderr, e.g. a panic message), calls into a denied
/// interface (named).
fn classify(
    err: &wasmtime::Error,
    store: &Store<CallState>,
    limits: Limits,
    output: &Output,
) -> PluginError {
    if store.data().limiter.hit {
        return PluginError::MemoryLimit(limits.memory_bytes);
    }
    if let Some(denied) = err.downcast_ref::<DeniedCall>() {
        return PluginError::Denied(denied.to_string());
    }
    match err.downcast_ref::<Trap>() {
        Some(Trap::OutOfFuel) => PluginError::FuelExhausted(limits.fuel),
        Some(Trap::Interrupt) => PluginError::Timeout(limits.timeout),
        Some(trap) => {
            let said = String::from_utf8_lossy(&output.stderr.contents())
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
        instantiate: Duration::ZERO,
    })
}

fn guest_error(err: wit::TransformError) -> PluginError {
    match err {
        wit::TransformError::InvalidConfig(m) => PluginError::InvalidConfig(bounded(m, 4096)),
        wit::TransformError::Rejected(m) => PluginError::Rejected(bounded(m, 4096)),
        wit::TransformError::Internal(m) => PluginError::Internal(bounded(m, 4096)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn budget_permits_round_caps_up_and_budgets_down() {
        assert_eq!(mib_permits(1), 1);
        assert_eq!(mib_permits(64 << 20), 64);
        assert_eq!(mib_permits((64 << 20) + 1), 65);
        assert_eq!(budget_permits((100 << 20) + 5), 100);
        assert_eq!(budget_permits(u64::MAX), (u64::MAX >> 20) as usize);
    }
}
