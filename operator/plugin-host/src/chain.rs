//! An ordered chain of plugins run over one Program spec.
//!
//! The output is a pure function of the input and the chain: each step is identified by its
//! transform, module digest, configuration and limits, which together make the chain's
//! [fingerprint](Chain::fingerprint). Each step's output must be a valid Program spec; the
//! next step sees it normalised exactly as the artifact will render it.

use std::fmt;
use std::sync::Arc;

use pko_api::program::ProgramSpec;
use serde_json::{Map, Value, json};
use sha2::{Digest, Sha256};

use crate::errors::PluginError;
use crate::host::{CallSite, Module, PluginHost, ProgramInput};
use crate::json;
use crate::limits::Limits;

/// Top-level keys of a Program spec (the fields of [`ProgramSpec`]).
pub const SPEC_KEYS: [&str; 5] = [
    "configuration",
    "resources",
    "variables",
    "outputs",
    "packages",
];

/// What happens to a Program when a step fails.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum FailurePolicy {
    /// The Program is not served; its status says why.
    Fail,
    /// The step is skipped (the Program is served without it) and a Warning is recorded.
    Ignore,
}

impl FailurePolicy {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Fail => "Fail",
            Self::Ignore => "Ignore",
        }
    }
}

/// One plugin in a chain.
#[derive(Debug, Clone)]
pub struct Step {
    /// The transform object, e.g. `ProgramTransform/<ns>/<name>`.
    pub id: String,
    pub priority: i32,
    pub policy: FailurePolicy,
    /// The loaded module, or why it could not be loaded (or its configuration was refused):
    /// such a step fails every Program it applies to.
    pub module: Result<Arc<Module>, PluginError>,
    /// The configuration handed to the plugin (`null` when none).
    pub config: Value,
    pub limits: Limits,
}

impl Step {
    /// `sha256:<hex>` of the canonical configuration.
    pub fn config_digest(&self) -> String {
        format!(
            "sha256:{}",
            hex::encode(Sha256::digest(json::canonical_string(&self.config)))
        )
    }

    fn describe(&self) -> Value {
        let module = match &self.module {
            Ok(module) => json!(module.digest()),
            Err(err) => json!({"error": err.kind().as_str(), "message": err.to_string()}),
        };
        json!({
            "id": self.id,
            "priority": self.priority,
            "policy": self.policy.as_str(),
            "module": module,
            "config": json::canonical(&self.config),
            "limits": {
                "fuel": self.limits.fuel,
                "timeoutMillis": u64::try_from(self.limits.timeout.as_millis()).unwrap_or(u64::MAX),
                "memoryBytes": self.limits.memory_bytes,
                "outputBytes": self.limits.output_bytes,
            },
        })
    }
}

/// The ordered plugins that apply to one Program.
#[derive(Debug, Clone, Default)]
pub struct Chain {
    pub steps: Vec<Step>,
}

impl Chain {
    pub fn is_empty(&self) -> bool {
        self.steps.is_empty()
    }

    /// Identity of everything that can change the chain's output: `""` for an empty chain
    /// (so Programs without transforms keep their plain artifact), else `sha256:<hex>`.
    pub fn fingerprint(&self) -> String {
        if self.steps.is_empty() {
            return String::new();
        }
        let described: Vec<Value> = self.steps.iter().map(Step::describe).collect();
        format!(
            "sha256:{}",
            hex::encode(Sha256::digest(json::canonical_string(&Value::Array(
                described
            ))))
        )
    }
}

/// A step that ran.
#[derive(Debug, Clone, PartialEq)]
pub struct Applied {
    pub id: String,
    pub plugin: String,
    pub module: String,
    pub config: String,
    pub warnings: Vec<String>,
    pub fuel: u64,
}

/// A step skipped under [`FailurePolicy::Ignore`].
#[derive(Debug, Clone, PartialEq)]
pub struct Skipped {
    pub id: String,
    pub error: PluginError,
}

/// The result of a chain that did not fail.
#[derive(Debug, Clone)]
pub struct ChainOutput {
    pub spec: ProgramSpec,
    pub applied: Vec<Applied>,
    pub skipped: Vec<Skipped>,
}

impl ChainOutput {
    /// A step was skipped for a reason that may not recur (a timeout, a busy host): the result
    /// should be computed again soon.
    pub fn transient(&self) -> bool {
        self.skipped.iter().any(|s| s.error.kind().is_transient())
    }
}

/// The step that failed a chain under [`FailurePolicy::Fail`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StepFailure {
    pub id: String,
    pub error: PluginError,
}

impl fmt::Display for StepFailure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.id, self.error)
    }
}

/// Runs `chain` over `spec` in order.
pub async fn run(
    host: &PluginHost,
    chain: &Chain,
    namespace: &str,
    name: &str,
    labels: &std::collections::BTreeMap<String, String>,
    spec: &ProgramSpec,
) -> Result<ChainOutput, StepFailure> {
    let mut current = spec.clone();
    let mut applied = Vec::new();
    let mut skipped = Vec::new();
    for step in &chain.steps {
        let outcome = match &step.module {
            Ok(module) => run_step(host, step, module, namespace, name, labels, &current).await,
            Err(err) => Err(err.clone()),
        };
        match outcome {
            Ok((next, mut record)) => {
                current = next;
                record.config = step.config_digest();
                applied.push(record);
            }
            Err(error) => match step.policy {
                FailurePolicy::Fail => {
                    return Err(StepFailure {
                        id: step.id.clone(),
                        error,
                    });
                }
                FailurePolicy::Ignore => skipped.push(Skipped {
                    id: step.id.clone(),
                    error,
                }),
            },
        }
    }
    Ok(ChainOutput {
        spec: current,
        applied,
        skipped,
    })
}

async fn run_step(
    host: &PluginHost,
    step: &Step,
    module: &Arc<Module>,
    namespace: &str,
    name: &str,
    labels: &std::collections::BTreeMap<String, String>,
    spec: &ProgramSpec,
) -> Result<(ProgramSpec, Applied), PluginError> {
    let input = ProgramInput {
        namespace: namespace.to_owned(),
        name: name.to_owned(),
        labels: labels.clone(),
        spec: serde_json::to_value(spec)
            .map_err(|e| PluginError::Host(format!("cannot encode the spec: {e}")))?,
    };
    let output = host
        .transform(
            module,
            &input,
            &step.config,
            step.limits,
            &CallSite::new(&step.id).in_namespace(namespace),
        )
        .await?;
    let next = validate_spec(output.spec)?;
    Ok((
        next,
        Applied {
            id: step.id.clone(),
            plugin: module.info().name.clone(),
            module: module.digest().to_owned(),
            config: String::new(),
            warnings: output.warnings,
            fuel: output.fuel,
        },
    ))
}

/// A plugin's output as a Program spec: only the spec's own top-level keys, and each of them
/// of the right shape.
pub fn validate_spec(spec: Map<String, Value>) -> Result<ProgramSpec, PluginError> {
    if let Some(key) = spec.keys().find(|k| !SPEC_KEYS.contains(&k.as_str())) {
        return Err(PluginError::InvalidOutput(format!(
            "unknown top-level key {key:?} (a Program spec has {})",
            SPEC_KEYS.join(", ")
        )));
    }
    serde_json::from_value(Value::Object(spec))
        .map_err(|e| PluginError::InvalidOutput(format!("not a Program spec: {e}")))
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    fn step(id: &str, config: Value) -> Step {
        Step {
            id: id.into(),
            priority: 0,
            policy: FailurePolicy::Fail,
            module: Err(PluginError::Source("not loaded".into())),
            config,
            limits: Limits::DEFAULT,
        }
    }

    #[test]
    fn spec_keys_are_the_fields_of_program_spec() {
        let full: ProgramSpec = serde_json::from_value(json!({
            "configuration": {"a": {"type": "String"}},
            "resources": {"r": {"type": "t"}},
            "variables": {"v": 1},
            "outputs": {"o": 1},
            "packages": {"p": "x"},
        }))
        .expect("spec");
        let value = serde_json::to_value(full).expect("json");
        let mut keys: Vec<&str> = value
            .as_object()
            .expect("object")
            .keys()
            .map(String::as_str)
            .collect();
        keys.sort();
        let mut expected = SPEC_KEYS.to_vec();
        expected.sort();
        assert_eq!(keys, expected);
    }

    #[test]
    fn outputs_must_be_program_specs() {
        let bad_key = json!({"resources": {}, "name": "x"});
        let err = validate_spec(bad_key.as_object().cloned().expect("map")).expect_err("name");
        assert!(err.to_string().contains("\"name\""), "{err}");
        let bad_shape = json!({"resources": {"r": {"properties": {}}}});
        let err = validate_spec(bad_shape.as_object().cloned().expect("map")).expect_err("type");
        assert!(err.to_string().contains("type"), "{err}");
    }

    #[test]
    fn fingerprint_changes_with_every_input_and_not_with_key_order() {
        let empty = Chain::default();
        assert_eq!(empty.fingerprint(), "");
        let a = Chain {
            steps: vec![step("T/a", json!({"x": 1, "y": 2}))],
        };
        let reordered = Chain {
            steps: vec![step(
                "T/a",
                serde_json::from_str(r#"{"y":2,"x":1}"#).expect("json"),
            )],
        };
        assert_eq!(a.fingerprint(), reordered.fingerprint());
        let mut changed = a.clone();
        changed.steps[0].config = json!({"x": 2, "y": 2});
        assert_ne!(a.fingerprint(), changed.fingerprint());
        let mut changed = a.clone();
        changed.steps[0].limits.timeout = Duration::from_secs(9);
        assert_ne!(a.fingerprint(), changed.fingerprint());
        let mut changed = a.clone();
        changed.steps[0].policy = FailurePolicy::Ignore;
        assert_ne!(a.fingerprint(), changed.fingerprint());
        let two = Chain {
            steps: vec![step("T/a", json!(null)), step("T/b", json!(null))],
        };
        let swapped = Chain {
            steps: vec![step("T/b", json!(null)), step("T/a", json!(null))],
        };
        assert_ne!(two.fingerprint(), swapped.fingerprint());
    }
}
