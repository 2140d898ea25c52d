//! The `AutomationService` implementation over the `pulumi` CLI.
//!
//! One operation at a time per workspace: every call that changes the workspace (stack
//! selection, config, install, engine operations) takes the workspace lock, so a second
//! operation waits for the first instead of racing it on the same files (PKO relies on the
//! backend's lock alone). An operation whose client goes away is interrupted.

mod config;
mod locks;
mod operation;
mod service;
mod status;

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, PoisonError};

use serde_json::Value;
use tokio_util::sync::CancellationToken;
use tonic::metadata::MetadataValue;
use tonic::{Response, Status};
use tracing::{info, warn};

use crate::limits::Limits;
use crate::proto as pb;
use crate::pulumi::{Cli, PulumiError};
use pko_agent_api::INSTANCE_HEADER;

pub use status::{OpReport, to_status};

/// Failures of the agent's own steps (the CLI's are [`PulumiError`]).
#[derive(Debug, thiserror::Error)]
pub enum ServerError {
    #[error("cannot read the project file in {dir}: {detail}")]
    Project { dir: String, detail: String },
}

/// Where the pod's source was unpacked (`serve --source-dir`, the fetch container's target), so
/// `UpdateSource` can put a new revision there.
#[derive(Debug, Clone)]
pub struct SourceDir {
    pub root: PathBuf,
    /// Development: replaces the artifact URL's host (PKO's `SOURCE_CONTROLLER_LOCALHOST`).
    pub host_override: Option<String>,
}

/// The service: one per workspace (process).
#[derive(Clone)]
pub struct Agent {
    inner: Arc<Inner>,
}

struct Inner {
    cli: Cli,
    stack: Mutex<Option<String>>,
    lock: tokio::sync::Mutex<()>,
    shutdown: CancellationToken,
    instance: String,
    limits: Limits,
    /// When this process started: stack locks taken before it may be a dead predecessor's.
    started: jiff::Timestamp,
    /// `pulumi version`, asked once: the CLI does not change under a running agent, and the
    /// operator asks on every Workspace reconcile (a CLI start each time, nothing else).
    version: tokio::sync::OnceCell<String>,
    /// `None`: the source cannot be replaced (not a Flux-style source, or not told where).
    source: Option<SourceDir>,
}

impl Agent {
    /// `shutdown` interrupts running operations (agent termination); `limits` bound what is
    /// sent (the CLI's own lines are bounded by the [`Cli`]).
    pub fn new(
        cli: Cli,
        shutdown: CancellationToken,
        limits: Limits,
        source: Option<SourceDir>,
    ) -> Self {
        Self {
            inner: Arc::new(Inner {
                cli,
                stack: Mutex::new(None),
                lock: tokio::sync::Mutex::new(()),
                shutdown,
                instance: format!("{:016x}", rand::random::<u64>()),
                limits,
                started: jiff::Timestamp::now(),
                version: tokio::sync::OnceCell::new(),
                source,
            }),
        }
    }

    /// The random id sent in [`INSTANCE_HEADER`].
    pub fn instance(&self) -> &str {
        &self.inner.instance
    }

    fn respond<T>(&self, message: T) -> Response<T> {
        let mut response = Response::new(message);
        if let Ok(value) = MetadataValue::try_from(self.inner.instance.as_str()) {
            response.metadata_mut().insert(INSTANCE_HEADER, value);
        }
        response
    }

    fn current_stack(&self) -> Option<String> {
        self.inner
            .stack
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    fn set_stack(&self, stack: Option<String>) {
        *self
            .inner
            .stack
            .lock()
            .unwrap_or_else(PoisonError::into_inner) = stack;
    }

    /// A CLI failure on the selected stack as a status. A stack the CLI no longer finds (removed
    /// behind this process) is forgotten, so the next selection asks the CLI again.
    fn stack_failure(&self, op: &str, e: PulumiError) -> Status {
        if is_stack_missing(&e) {
            warn!(
                operation = op,
                "the selected stack is gone; it will be selected again"
            );
            self.set_stack(None);
        }
        to_status(op, e)
    }

    fn require_stack(&self) -> Result<String, Status> {
        self.current_stack()
            .ok_or_else(|| Status::failed_precondition("no stack is selected"))
    }

    /// Selects `name`, creating it when asked. Used by the RPC and by `serve --stack`. A
    /// failure is logged too: the operator retries it, and on-call reads the pod's log.
    pub async fn select(
        &self,
        name: &str,
        create: bool,
        secrets_provider: Option<&str>,
    ) -> Result<(), Status> {
        let selected = self.select_or_create(name, create, secrets_provider).await;
        if let Err(s) = &selected {
            warn!(stack = name, message = s.message(), "stack not selected");
        }
        selected
    }

    async fn select_or_create(
        &self,
        name: &str,
        create: bool,
        secrets_provider: Option<&str>,
    ) -> Result<(), Status> {
        if name.trim().is_empty() {
            return Err(Status::invalid_argument("stack_name is required"));
        }
        check_name("stack_name", name)?;
        let _guard = self.inner.lock.lock().await;
        // Selected by this process, with the same environment (a new one forgets it): the
        // stack exists and nothing else runs the CLI here, so `stack select` would say so again
        // (the operator selects before every operation).
        if self.current_stack().as_deref() == Some(name) {
            return Ok(());
        }
        let cli = &self.inner.cli;
        // Names go after `--`: whatever they are, the CLI never reads them as flags.
        match cli.run(&args(["stack", "select", "--", name])).await {
            Ok(_) => {}
            Err(e) if is_stack_missing(&e) => {
                if !create {
                    return Err(Status::not_found("stack not found"));
                }
                let mut init = args(["stack", "init"]);
                if let Some(provider) = secrets_provider.filter(|p| !p.is_empty()) {
                    init.push(format!("--secrets-provider={provider}"));
                }
                init.extend(args(["--", name]));
                cli.run(&init)
                    .await
                    .map_err(|e| to_status("stack init", e))?;
            }
            Err(e) => return Err(to_status("stack select", e)),
        }
        info!(stack = name, "stack selected");
        self.set_stack(Some(name.to_owned()));
        Ok(())
    }

    pub(super) fn project(&self) -> Result<pb::ProjectInfo, Status> {
        project_info(self.inner.cli.workdir())
            .map_err(|e| Status::failed_precondition(e.to_string()))
    }
}

/// A stack or environment name as Pulumi writes them: `[org/][project/]name`, each part of
/// letters, digits, `-`, `_` and `.`, none starting with `-` (which the CLI would read as a flag).
fn check_name(what: &str, name: &str) -> Result<(), Status> {
    let part_ok = |part: &str| {
        !part.is_empty()
            && !part.starts_with('-')
            && part
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.'))
    };
    if name.len() <= 400 && name.split('/').count() <= 3 && name.split('/').all(part_ok) {
        Ok(())
    } else {
        Err(Status::invalid_argument(format!(
            "{what} {name:?} is not a valid name: [org/][project/]name of letters, digits, '-', '_' and '.', no part starting with '-'"
        )))
    }
}

fn args<const N: usize>(parts: [&str; N]) -> Vec<String> {
    parts.iter().map(|s| (*s).to_owned()).collect()
}

fn is_stack_missing(e: &PulumiError) -> bool {
    let text = e.output_text().to_ascii_lowercase();
    text.contains("no stack named") || text.contains("stack not found")
}

/// Project name and runtime from `Pulumi.yaml` (or `Pulumi.yml`) in `dir`.
pub fn project_info(dir: &Path) -> Result<pb::ProjectInfo, ServerError> {
    let err = |detail: String| ServerError::Project {
        dir: dir.display().to_string(),
        detail,
    };
    let path = ["Pulumi.yaml", "Pulumi.yml"]
        .iter()
        .map(|f| dir.join(f))
        .find(|p| p.is_file())
        .ok_or_else(|| err("no Pulumi.yaml".into()))?;
    let text = std::fs::read_to_string(&path).map_err(|e| err(e.to_string()))?;
    let doc: Value = yaml_serde::from_str(&text).map_err(|e| err(e.to_string()))?;
    let name = doc
        .get("name")
        .and_then(Value::as_str)
        .ok_or_else(|| err("Pulumi.yaml has no name".into()))?;
    let runtime = match doc.get("runtime") {
        Some(Value::String(r)) => r.clone(),
        Some(Value::Object(r)) => r
            .get("name")
            .and_then(Value::as_str)
            .unwrap_or_default()
            .to_owned(),
        _ => String::new(),
    };
    Ok(pb::ProjectInfo {
        name: name.to_owned(),
        runtime,
    })
}

/// Where the agent keeps transient files (event logs).
pub fn default_state_dir() -> PathBuf {
    std::env::temp_dir().join(format!("pko-agent-{}", std::process::id()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_that_could_be_flags_or_paths_are_refused() {
        for good in ["dev", "org/proj/dev", "proj/my-stack_1.2", "a-b"] {
            assert!(check_name("stack_name", good).is_ok(), "{good}");
        }
        for bad in [
            "-h",
            "--help",
            "dev/-x",
            "a//b",
            "a/b/c/d",
            "dev stack",
            "dev;rm",
            "",
            "/dev",
            "ü",
        ] {
            assert!(check_name("stack_name", bad).is_err(), "{bad:?}");
        }
    }
}
