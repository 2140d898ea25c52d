//! The conformance kit behind `pko-operator plugin test DIR`: runs a module against fixture
//! cases, each giving an input, a configuration and the expected output or error.
//!
//! A case is a YAML (or JSON) document; a file may hold several (`---`):
//!
//! ```yaml
//! name: adds the team tag            # default: file name and position
//! config: {tags: {team: blue}, targets: [{typePrefix: "aws:"}]}
//! limits: {fuel: 1000000, timeoutMillis: 500, memoryMiB: 16, outputKiB: 64}   # optional
//! input:
//!   namespace: team-a                # default "default"
//!   name: web                        # default "program"
//!   labels: {team: blue}
//!   program: {resources: {b: {type: "aws:s3:Bucket"}}}
//! expect:
//!   program: {resources: {b: {type: "aws:s3:Bucket", properties: {tags: {team: blue}}}}}
//!   warnings: []                     # optional: exact list
//!   # or, instead of program/warnings:
//!   error: {kind: rejected, contains: "aws:ec2"}
//! ```
//!
//! `validate-config` runs first; an invalid configuration is an `invalid-config` error. The
//! output is checked the way the operator checks it (a valid Program spec) and compared after
//! normalisation, so key order and empty maps do not matter.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use serde::Deserialize;
use serde_json::Value;

use crate::chain::validate_spec;
use crate::errors::{ErrorKind, PluginError};
use crate::host::{CallSite, Module, PluginHost, ProgramInput};
use crate::json;
use crate::limits::LimitOverrides;

/// Failures reading fixtures (a failing case is a [`CaseResult`], not an error).
#[derive(Debug, thiserror::Error)]
pub enum ConformanceError {
    #[error("cannot read {}: {source}", path.display())]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{}: document {index}: {message}", path.display())]
    Parse {
        path: PathBuf,
        index: usize,
        message: String,
    },
    #[error("no cases (*.yaml, *.yml, *.json) in {}", .0.display())]
    Empty(PathBuf),
}

/// One fixture case.
#[derive(Debug, Clone, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Case {
    #[serde(default)]
    pub name: Option<String>,
    #[serde(default)]
    pub config: Value,
    #[serde(default)]
    pub limits: Option<CaseLimits>,
    pub input: CaseInput,
    pub expect: Expect,
}

/// Limits of one case (defaults: the host's).
#[derive(Debug, Clone, Copy, Default, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct CaseLimits {
    pub fuel: Option<u64>,
    pub timeout_millis: Option<u64>,
    #[serde(rename = "memoryMiB")]
    pub memory_mib: Option<u64>,
    #[serde(rename = "outputKiB")]
    pub output_kib: Option<u64>,
}

/// The Program of one case.
#[derive(Debug, Clone, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct CaseInput {
    #[serde(default = "default_namespace")]
    pub namespace: String,
    #[serde(default = "default_name")]
    pub name: String,
    #[serde(default)]
    pub labels: BTreeMap<String, String>,
    #[serde(default)]
    pub program: Value,
}

fn default_namespace() -> String {
    "default".into()
}

fn default_name() -> String {
    "program".into()
}

/// What the case expects.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Expect {
    #[serde(default)]
    pub program: Option<Value>,
    #[serde(default)]
    pub warnings: Option<Vec<String>>,
    #[serde(default)]
    pub error: Option<ExpectError>,
}

/// An expected failure: its kind (`rejected`, `invalid-config`, `trap`, …) and optionally a
/// substring of its message.
#[derive(Debug, Clone, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct ExpectError {
    pub kind: String,
    #[serde(default)]
    pub contains: Option<String>,
}

/// The outcome of one case.
#[derive(Debug, Clone)]
pub struct CaseResult {
    pub file: PathBuf,
    pub name: String,
    /// `Err` says how the actual result differs from the expected one.
    pub outcome: Result<(), String>,
}

/// Reads every case in `dir` (sorted by file name, then position).
pub fn read_cases(dir: &Path) -> Result<Vec<(PathBuf, String, Case)>, ConformanceError> {
    let io = |source| ConformanceError::Io {
        path: dir.to_path_buf(),
        source,
    };
    let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
        .map_err(io)?
        .filter_map(Result::ok)
        .map(|e| e.path())
        .filter(|p| {
            p.is_file()
                && p.extension()
                    .and_then(|e| e.to_str())
                    .is_some_and(|e| matches!(e, "yaml" | "yml" | "json"))
        })
        .collect();
    files.sort();
    let mut cases = Vec::new();
    for path in files {
        let text = std::fs::read_to_string(&path).map_err(|source| ConformanceError::Io {
            path: path.clone(),
            source,
        })?;
        let stem = path
            .file_stem()
            .and_then(|s| s.to_str())
            .unwrap_or("case")
            .to_owned();
        let documents: Vec<Value> = yaml_serde::Deserializer::from_str(&text)
            .enumerate()
            .map(|(index, doc)| {
                Value::deserialize(doc).map_err(|e| ConformanceError::Parse {
                    path: path.clone(),
                    index,
                    message: e.to_string(),
                })
            })
            .collect::<Result<_, _>>()?;
        let documents: Vec<Value> = documents.into_iter().filter(|d| !d.is_null()).collect();
        let many = documents.len() > 1;
        for (index, doc) in documents.into_iter().enumerate() {
            let case: Case = serde_json::from_value(doc).map_err(|e| ConformanceError::Parse {
                path: path.clone(),
                index,
                message: e.to_string(),
            })?;
            let name = case.name.clone().unwrap_or_else(|| {
                if many {
                    format!("{stem}[{index}]")
                } else {
                    stem.clone()
                }
            });
            cases.push((path.clone(), name, case));
        }
    }
    if cases.is_empty() {
        return Err(ConformanceError::Empty(dir.to_path_buf()));
    }
    Ok(cases)
}

/// Runs every case in `dir` against `module`.
pub async fn run_dir(
    host: &PluginHost,
    module: &Arc<Module>,
    dir: &Path,
) -> Result<Vec<CaseResult>, ConformanceError> {
    let mut results = Vec::new();
    for (file, name, case) in read_cases(dir)? {
        let outcome = run_case(host, module, &case).await;
        results.push(CaseResult {
            file,
            name,
            outcome,
        });
    }
    Ok(results)
}

/// Runs one case; `Err` describes the mismatch.
pub async fn run_case(host: &PluginHost, module: &Arc<Module>, case: &Case) -> Result<(), String> {
    if case.expect.error.is_some() == (case.expect.program.is_some()) {
        return Err("expect needs exactly one of program or error".into());
    }
    let overrides = case
        .limits
        .map(|l| LimitOverrides {
            fuel: l.fuel,
            timeout: l.timeout_millis.map(Duration::from_millis),
            memory_bytes: l.memory_mib.map(|m| m << 20),
            output_bytes: l.output_kib.map(|k| k << 10),
        })
        .unwrap_or_default();
    let limits = host.limits(&overrides);
    let site = CallSite::new("plugin-test");
    let actual = async {
        host.validate_config(module, &case.config, limits, &site)
            .await?;
        let output = host
            .transform(
                module,
                &ProgramInput {
                    namespace: case.input.namespace.clone(),
                    name: case.input.name.clone(),
                    labels: case.input.labels.clone(),
                    spec: case.input.program.clone(),
                },
                &case.config,
                limits,
                &site,
            )
            .await?;
        let spec = validate_spec(output.spec)?;
        Ok::<_, PluginError>((spec, output.warnings))
    }
    .await;
    match (&case.expect.error, actual) {
        (Some(want), Err(got)) => {
            let kind = ErrorKind::parse(&want.kind)
                .ok_or_else(|| format!("unknown error kind {:?}", want.kind))?;
            if got.kind() != kind {
                return Err(format!(
                    "expected a {} error, got {}: {got}",
                    want.kind,
                    got.kind().as_str()
                ));
            }
            match &want.contains {
                Some(needle) if !got.to_string().contains(needle.as_str()) => {
                    Err(format!("the error does not contain {needle:?}: {got}"))
                }
                _ => Ok(()),
            }
        }
        (Some(want), Ok((spec, _))) => Err(format!(
            "expected a {} error, got a program: {}",
            want.kind,
            json::canonical_string(&serde_json::to_value(spec).unwrap_or_default())
        )),
        (None, Err(got)) => Err(format!(
            "expected a program, got {}: {got}",
            got.kind().as_str()
        )),
        (None, Ok((spec, warnings))) => {
            let want = case.expect.program.clone().unwrap_or_default();
            let want = match want {
                Value::Object(map) => validate_spec(map)
                    .map_err(|e| format!("expect.program is not a valid Program spec: {e}"))?,
                Value::Null => Default::default(),
                other => {
                    return Err(format!(
                        "expect.program must be an object, not {}",
                        json::kind(&other)
                    ));
                }
            };
            let got = json::canonical_string(&serde_json::to_value(&spec).unwrap_or_default());
            let want = json::canonical_string(&serde_json::to_value(&want).unwrap_or_default());
            if got != want {
                return Err(format!("program differs:\n  want {want}\n  got  {got}"));
            }
            if let Some(want) = &case.expect.warnings
                && *want != warnings
            {
                return Err(format!(
                    "warnings differ:\n  want {want:?}\n  got  {warnings:?}"
                ));
            }
            Ok(())
        }
    }
}
