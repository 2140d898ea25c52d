//! The `AutomationService` implementation over the `pulumi` CLI.
//!
//! One operation at a time per workspace: every call that changes the workspace (stack
//! selection, config, install, engine operations) takes the workspace lock, so a second
//! operation waits for the first instead of racing it on the same files (PKO relies on the
//! backend's lock alone). An operation whose client goes away is interrupted.

use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::{Arc, Mutex, PoisonError};

use futures::Stream;
use serde_json::{Map, Value, json};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;
use tonic::metadata::MetadataValue;
use tonic::{Code, Request, Response, Status};
use tracing::{info, warn};

use crate::inflight::{self, Inflight};
use crate::limits::{self, Limits, MAX_MESSAGE_BYTES};
use crate::proto::automation_service_server::AutomationService;
use crate::proto::{self as pb, config_item, config_value_from};
use crate::pulumi::{Cli, Output, PulumiError, tail};
use crate::values;
use pko_agent_api::INSTANCE_HEADER;
use pko_agent_api::errors::{RESPONSE_TOO_LARGE, with_error_info};

type RpcStream<T> = Pin<Box<dyn Stream<Item = Result<T, Status>> + Send + 'static>>;

/// Events buffered between the CLI and a slow client.
const EVENT_BUFFER: usize = 256;

/// Failures of the agent's own steps (the CLI's are [`PulumiError`]).
#[derive(Debug, thiserror::Error)]
pub enum ServerError {
    #[error("cannot read the project file in {dir}: {detail}")]
    Project { dir: String, detail: String },
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
}

impl Agent {
    /// `shutdown` interrupts running operations (agent termination); `limits` bound what is
    /// sent (the CLI's own lines are bounded by the [`Cli`]).
    pub fn new(cli: Cli, shutdown: CancellationToken, limits: Limits) -> Self {
        Self {
            inner: Arc::new(Inner {
                cli,
                stack: Mutex::new(None),
                lock: tokio::sync::Mutex::new(()),
                shutdown,
                instance: format!("{:016x}", rand::random::<u64>()),
                limits,
                started: jiff::Timestamp::now(),
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

    fn require_stack(&self) -> Result<String, Status> {
        self.current_stack()
            .ok_or_else(|| Status::failed_precondition("no stack is selected"))
    }

    /// Selects `name`, creating it when asked. Used by the RPC and by `serve --stack`.
    pub async fn select(
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

    async fn summary(&self) -> Result<pb::StackSummary, Status> {
        let stack = self.require_stack()?;
        let list = self
            .inner
            .cli
            .run_json(&args(["stack", "ls", "--json"]))
            .await
            .map_err(|e| to_status("stack ls", e))?;
        let entry = list
            .as_array()
            .into_iter()
            .flatten()
            .find(|s| {
                s.get("name")
                    .and_then(Value::as_str)
                    .is_some_and(|n| same_stack(n, &stack))
            })
            .ok_or_else(|| Status::not_found(format!("stack {stack} not found")))?;
        Ok(pb::StackSummary {
            name: entry
                .get("name")
                .and_then(Value::as_str)
                .unwrap_or(&stack)
                .to_owned(),
            last_update: entry
                .get("lastUpdate")
                .and_then(Value::as_str)
                .and_then(timestamp),
            update_in_progress: entry
                .get("updateInProgress")
                .and_then(Value::as_bool)
                .unwrap_or(false),
            resource_count: entry
                .get("resourceCount")
                .and_then(Value::as_i64)
                .and_then(|n| i32::try_from(n).ok()),
            url: entry.get("url").and_then(Value::as_str).map(str::to_owned),
        })
    }

    fn project(&self) -> Result<pb::ProjectInfo, Status> {
        project_info(self.inner.cli.workdir())
            .map_err(|e| Status::failed_precondition(e.to_string()))
    }

    /// Runs one engine operation in a task that owns the workspace lock, streaming its events
    /// through `wrap_event` and its result through `finish`.
    fn operation<T, F, Fut>(
        &self,
        kind: &'static str,
        cli_args: Vec<String>,
        wrap_event: fn(prost_types::Struct) -> T,
        finish: F,
    ) -> Result<Response<RpcStream<T>>, Status>
    where
        T: prost::Message + Send + 'static,
        F: FnOnce(Agent, String, Output, OpTimes) -> Fut + Send + 'static,
        Fut: std::future::Future<Output = Result<T, Status>> + Send,
    {
        let stack = self.require_stack()?;
        let (tx, rx) = mpsc::channel::<Result<T, Status>>(EVENT_BUFFER);
        let agent = self.clone();
        tokio::spawn(async move {
            let _guard = agent.inner.lock.lock().await;
            let (events_tx, mut events_rx) = mpsc::channel::<Value>(EVENT_BUFFER);
            let forward_tx = tx.clone();
            // Ends when the CLI stops writing events, or when the client is gone; dropping
            // events_rx then tells the CLI runner to interrupt pulumi.
            let forward = tokio::spawn(async move {
                loop {
                    // A blocked program writes no events: notice the client leaving anyway.
                    let event = tokio::select! {
                        event = events_rx.recv() => event,
                        () = forward_tx.closed() => break,
                    };
                    let Some(event) = event else { break };
                    let Value::Object(map) = event else { continue };
                    let message = wrap_event(values::to_struct(&map));
                    // Its strings are bounded already; only an event of very many of them
                    // gets here, and sending it would end the whole stream.
                    let size = message.encoded_len();
                    if size > MAX_MESSAGE_BYTES {
                        warn!(
                            operation = kind,
                            size,
                            limit = MAX_MESSAGE_BYTES,
                            "engine event dropped: over the message limit"
                        );
                        continue;
                    }
                    if forward_tx.send(Ok(message)).await.is_err() {
                        break;
                    }
                }
            });
            let project = agent.inner.cli.workdir().to_path_buf();
            agent.release_lock_of_crashed_run(&project).await;
            let marker = Inflight {
                operation: kind.to_owned(),
                stack: stack.clone(),
                instance: agent.inner.instance.clone(),
            };
            if let Err(e) = inflight::write(&project, &marker) {
                // Only crash recovery depends on it; the operation itself can go on.
                warn!(error = %e, "operation marker not written");
            }
            let started = jiff::Timestamp::now();
            info!(operation = kind, %stack, "operation started");
            let mut full = cli_args;
            full.push(format!("--stack={stack}"));
            let cancel = agent.inner.shutdown.child_token();
            let mut result = agent
                .inner
                .cli
                .operation(&full, events_tx.clone(), cancel.clone())
                .await;
            let retry = match &result {
                Err(e) => agent.release_stale_locks_of_this_pod(&stack, e).await,
                Ok(_) => false,
            };
            if retry {
                result = agent.inner.cli.operation(&full, events_tx, cancel).await;
            } else {
                // The forwarder ends when the last sender is gone.
                drop(events_tx);
            }
            // The CLI has ended (it unlocked the stack), whatever the result.
            inflight::clear(&project);
            let _ = forward.await;
            let times = OpTimes {
                start: started,
                end: jiff::Timestamp::now(),
            };
            let message = match result {
                Ok(output) => finish(agent.clone(), stack, output, times)
                    .await
                    .and_then(|m| within_message_limit(kind, m)),
                Err(e) => Err(to_status(kind, e)),
            };
            if let Err(status) = &message {
                warn!(operation = kind, code = ?status.code(), message = status.message(), "operation failed");
            } else {
                info!(operation = kind, "operation finished");
            }
            let _ = tx.send(message).await;
        });
        let stream = tokio_stream::wrappers::ReceiverStream::new(rx);
        Ok(self.respond(Box::pin(stream) as RpcStream<T>))
    }

    /// Releases the stack lock left by an earlier agent of this workspace that died during an
    /// operation (see [`crate::inflight`]). Called with the workspace lock held, so no operation
    /// of ours is running.
    async fn release_lock_of_crashed_run(&self, project: &Path) {
        let Some(previous) = inflight::read(project) else {
            return;
        };
        if previous.instance == self.inner.instance {
            // Our own marker: a previous operation of this process ended without clearing it.
            inflight::clear(project);
            return;
        }
        let cancel = args(["cancel", "--yes", "--stack", &previous.stack]);
        match self.inner.cli.run(&cancel).await {
            Ok(_) => warn!(
                operation = %previous.operation,
                stack = %previous.stack,
                agent = %previous.instance,
                "released the stack lock left by an agent that stopped during an operation"
            ),
            Err(e) => warn!(
                stack = %previous.stack,
                error = %e,
                "could not release the lock left by an interrupted operation"
            ),
        }
        inflight::clear(project);
    }

    /// After an operation refused because the stack is locked: when every lock was taken on
    /// this pod's host before this agent started (a predecessor pod with this name died
    /// mid-operation, and its marker went with its volume), releases them and says to run again. Called with the workspace lock
    /// held, so none of them is ours.
    async fn release_stale_locks_of_this_pod(&self, stack: &str, err: &PulumiError) -> bool {
        let Some(host) = inflight::hostname() else {
            return false;
        };
        if !inflight::stale_locks_of(&err.output_text(), &host, self.inner.started) {
            return false;
        }
        let cancel = args(["cancel", "--yes", "--stack", stack]);
        match self.inner.cli.run(&cancel).await {
            Ok(_) => {
                warn!(%stack, %host, "released stack locks left by an earlier pod of this workspace; running again");
                true
            }
            Err(e) => {
                warn!(%stack, error = %e, "could not release stale stack locks");
                false
            }
        }
    }

    /// Outputs of the stack as `stack output --json` shows them, with secrets marked.
    async fn outputs(
        &self,
        stack: &str,
    ) -> Result<std::collections::HashMap<String, pb::OutputValue>, Status> {
        let cli = &self.inner.cli;
        let stack_flag = format!("--stack={stack}");
        let plain = cli
            .run_json(&args([
                "stack",
                "output",
                "--json",
                "--show-secrets",
                &stack_flag,
            ]))
            .await
            .map_err(|e| to_status("stack output", e))?;
        let masked = cli
            .run_json(&args(["stack", "output", "--json", &stack_flag]))
            .await
            .map_err(|e| to_status("stack output", e))?;
        let mut outputs = std::collections::HashMap::new();
        if let Value::Object(map) = plain {
            for (key, value) in map {
                // The Automation API's rule: a secret shows as "[secret]" without --show-secrets.
                let secret =
                    masked.get(&key) == Some(&json!("[secret]")) && value != json!("[secret]");
                let (bytes, cut) =
                    limits::output_value(&value, self.inner.limits.max_output_value_bytes);
                if cut {
                    warn!(
                        output = %key,
                        limit = self.inner.limits.max_output_value_bytes,
                        "stack output value truncated"
                    );
                }
                outputs.insert(
                    key,
                    pb::OutputValue {
                        value: bytes,
                        secret,
                    },
                );
            }
        }
        Ok(outputs)
    }

    /// The last history entry of the stack as an `UpdateSummary`; the local times when the
    /// backend keeps no history entry (e.g. after `destroy --remove`).
    async fn last_summary(&self, stack: &str, times: &OpTimes) -> pb::UpdateSummary {
        let history = self
            .inner
            .cli
            .run_json(&args([
                "stack",
                "history",
                "--json",
                "--page-size=1",
                &format!("--stack={stack}"),
            ]))
            .await;
        let entry = history
            .ok()
            .and_then(|h| h.as_array().and_then(|a| a.first().cloned()));
        match entry {
            Some(e) => pb::UpdateSummary {
                start_time: e
                    .get("startTime")
                    .and_then(Value::as_str)
                    .and_then(timestamp)
                    .or_else(|| Some(pb_time(times.start))),
                end_time: e
                    .get("endTime")
                    .and_then(Value::as_str)
                    .and_then(timestamp)
                    .or_else(|| Some(pb_time(times.end))),
                result: e
                    .get("result")
                    .and_then(Value::as_str)
                    .unwrap_or("succeeded")
                    .to_owned(),
                message: e
                    .get("message")
                    .and_then(Value::as_str)
                    .unwrap_or_default()
                    .to_owned(),
            },
            None => local_summary(times, ""),
        }
    }
}

/// `message` when it fits in one gRPC message; else a status that says so (the transport would
/// fail the stream with a bare "encoded message length too large").
fn within_message_limit<T: prost::Message>(kind: &str, message: T) -> Result<T, Status> {
    let size = message.encoded_len();
    if size <= MAX_MESSAGE_BYTES {
        return Ok(message);
    }
    Err(with_error_info(
        Code::OutOfRange,
        format!(
            "the result of {kind} is {size} bytes, over the {MAX_MESSAGE_BYTES}-byte message limit (its outputs or CLI output are too large together; each output value is cut at --max-output-value-bytes)"
        ),
        413,
        RESPONSE_TOO_LARGE,
    ))
}

/// Wall-clock bounds of one operation, measured by the agent.
pub struct OpTimes {
    start: jiff::Timestamp,
    end: jiff::Timestamp,
}

fn local_summary(times: &OpTimes, message: &str) -> pb::UpdateSummary {
    pb::UpdateSummary {
        start_time: Some(pb_time(times.start)),
        end_time: Some(pb_time(times.end)),
        result: "succeeded".into(),
        message: message.into(),
    }
}

fn pb_time(t: jiff::Timestamp) -> prost_types::Timestamp {
    prost_types::Timestamp {
        seconds: t.as_second(),
        nanos: t.subsec_nanosecond(),
    }
}

fn timestamp(text: &str) -> Option<prost_types::Timestamp> {
    text.parse::<jiff::Timestamp>().ok().map(pb_time)
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

/// `dev` and `org/project/dev` name the same stack.
fn same_stack(listed: &str, wanted: &str) -> bool {
    listed == wanted
        || listed.rsplit('/').next() == Some(wanted)
        || wanted.rsplit('/').next() == Some(listed)
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

/// A CLI failure as a gRPC status, with PKO's `PulumiErrorInfo` detail when the cause is known.
pub fn to_status(op: &str, err: PulumiError) -> Status {
    match &err {
        PulumiError::Canceled { .. } => return Status::cancelled(format!("{op} was canceled")),
        PulumiError::Spawn { .. } | PulumiError::Io { .. } => {
            return Status::unavailable(format!("{op} failed: {err}"));
        }
        _ => {}
    }
    let message = match &err {
        PulumiError::Failed { detail, .. } => format!("{op} failed: {detail}"),
        other => format!("{op} failed: {other}"),
    };
    let text = err.output_text().to_ascii_lowercase();
    let info = if text.contains("another update is currently in progress")
        || text.contains("the stack is currently locked")
    {
        Some((409, "UpdateConflict"))
    } else if text.contains("invalid access token") {
        Some((401, "InvalidAccessToken"))
    } else {
        None
    };
    match info {
        Some((code, reason)) => with_error_info(Code::Unknown, message, code, reason),
        None => Status::unknown(message),
    }
}

fn push_opt(out: &mut Vec<String>, flag: &str, value: Option<impl ToString>) {
    if let Some(v) = value {
        out.push(format!("--{flag}={}", v.to_string()));
    }
}

fn push_flag(out: &mut Vec<String>, flag: &str, on: Option<bool>) {
    if on == Some(true) {
        out.push(format!("--{flag}"));
    }
}

fn push_each(out: &mut Vec<String>, flag: &str, values: &[String]) {
    for v in values {
        out.push(format!("--{flag}={v}"));
    }
}

/// A config item resolved to a value inside the agent.
struct Resolved {
    key: String,
    path: bool,
    secret: bool,
    value: Value,
}

/// `env` looks a variable up as a Pulumi command would see it.
fn resolve_item(
    item: &pb::ConfigItem,
    env: impl Fn(&str) -> Option<String>,
) -> Result<Resolved, Status> {
    let value = match &item.v {
        Some(config_item::V::Value(v)) => values::from_pb(v),
        Some(config_item::V::ValueFrom(from)) => {
            let raw = match &from.f {
                Some(config_value_from::F::Env(name)) => env(name).ok_or_else(|| {
                    Status::invalid_argument(format!(
                        "config {}: environment variable {name} is not set",
                        item.key
                    ))
                })?,
                Some(config_value_from::F::Path(path)) => {
                    std::fs::read_to_string(path).map_err(|e| {
                        Status::invalid_argument(format!(
                            "config {}: cannot read {path}: {e}",
                            item.key
                        ))
                    })?
                }
                None => {
                    return Err(Status::invalid_argument(format!(
                        "config {}: value_from names neither env nor path",
                        item.key
                    )));
                }
            };
            if from.json == Some(true) {
                serde_json::from_str(&raw).map_err(|e| {
                    Status::invalid_argument(format!("config {}: invalid JSON: {e}", item.key))
                })?
            } else {
                Value::String(raw)
            }
        }
        None => {
            return Err(Status::invalid_argument(format!(
                "config {}: no value",
                item.key
            )));
        }
    };
    Ok(Resolved {
        key: item.key.clone(),
        path: item.path == Some(true),
        secret: item.secret == Some(true),
        value,
    })
}

/// `config set-all` arguments for `items` in project `project`.
///
/// Structured values (objects, arrays, JSON from a file/env) need `--json` (CLI ≥ 3.202), which
/// cannot express property paths; plain values use `--path` with non-path keys quoted so a dot
/// in a key is not read as a path separator.
fn set_all_args(project: &str, items: &[Resolved]) -> Result<Vec<String>, Status> {
    let namespaced = |key: &str| {
        if key.contains(':') {
            key.to_owned()
        } else {
            format!("{project}:{key}")
        }
    };
    let structured = items
        .iter()
        .any(|i| matches!(i.value, Value::Object(_) | Value::Array(_)));
    let mut out = args(["config", "set-all"]);
    if structured {
        if let Some(i) = items.iter().find(|i| i.path) {
            return Err(Status::invalid_argument(format!(
                "config {}: path keys cannot be combined with structured values",
                i.key
            )));
        }
        let mut doc = Map::new();
        for i in items {
            let entry = match &i.value {
                Value::Object(_) | Value::Array(_) => json!({
                    "value": i.value.to_string(),
                    "objectValue": i.value,
                    "secret": i.secret,
                }),
                scalar => json!({
                    "value": values::scalar_text(scalar).unwrap_or_default(),
                    "secret": i.secret,
                }),
            };
            doc.insert(namespaced(&i.key), entry);
        }
        out.push(format!("--json={}", Value::Object(doc)));
        return Ok(out);
    }
    out.push("--path".into());
    for i in items {
        let key = if i.path {
            namespaced(&i.key)
        } else {
            let (ns, name) = match i.key.split_once(':') {
                Some((ns, name)) => (ns.to_owned(), name.to_owned()),
                None => (project.to_owned(), i.key.clone()),
            };
            format!("{ns}:[{}]", Value::String(name))
        };
        let text = values::scalar_text(&i.value).unwrap_or_default();
        let flag = if i.secret { "--secret" } else { "--plaintext" };
        out.push(flag.into());
        out.push(format!("{key}={text}"));
    }
    Ok(out)
}

#[tonic::async_trait]
impl AutomationService for Agent {
    async fn who_am_i(
        &self,
        _request: Request<pb::WhoAmIRequest>,
    ) -> Result<Response<pb::WhoAmIResult>, Status> {
        let who = self
            .inner
            .cli
            .run_json(&args(["whoami", "--json"]))
            .await
            .map_err(|e| to_status("whoami", e))?;
        Ok(self.respond(pb::WhoAmIResult {
            user: who
                .get("user")
                .and_then(Value::as_str)
                .unwrap_or_default()
                .to_owned(),
            organizations: who
                .get("organizations")
                .and_then(Value::as_array)
                .into_iter()
                .flatten()
                .filter_map(Value::as_str)
                .map(str::to_owned)
                .collect(),
            url: who
                .get("url")
                .and_then(Value::as_str)
                .unwrap_or_default()
                .to_owned(),
        }))
    }

    async fn select_stack(
        &self,
        request: Request<pb::SelectStackRequest>,
    ) -> Result<Response<pb::SelectStackResult>, Status> {
        let req = request.into_inner();
        self.select(
            &req.stack_name,
            req.create == Some(true),
            req.secrets_provider.as_deref(),
        )
        .await?;
        let summary = self.summary().await?;
        Ok(self.respond(pb::SelectStackResult {
            summary: Some(summary),
        }))
    }

    async fn info(
        &self,
        _request: Request<pb::InfoRequest>,
    ) -> Result<Response<pb::InfoResult>, Status> {
        let summary = self.summary().await?;
        Ok(self.respond(pb::InfoResult {
            summary: Some(summary),
        }))
    }

    async fn set_all_config(
        &self,
        request: Request<pb::SetAllConfigRequest>,
    ) -> Result<Response<pb::SetAllConfigResult>, Status> {
        let stack = self.require_stack()?;
        let items = request
            .into_inner()
            .config
            .iter()
            .map(|item| resolve_item(item, |name| self.inner.cli.env_var(name)))
            .collect::<Result<Vec<_>, _>>()?;
        if items.is_empty() {
            return Ok(self.respond(pb::SetAllConfigResult {}));
        }
        let project = self.project()?;
        let mut cli_args = set_all_args(&project.name, &items)?;
        cli_args.push(format!("--stack={stack}"));
        let _guard = self.inner.lock.lock().await;
        self.inner
            .cli
            .run(&cli_args)
            .await
            .map_err(|e| to_status("config set-all", e))?;
        Ok(self.respond(pb::SetAllConfigResult {}))
    }

    async fn add_environments(
        &self,
        request: Request<pb::AddEnvironmentsRequest>,
    ) -> Result<Response<pb::AddEnvironmentsResult>, Status> {
        let stack = self.require_stack()?;
        let envs = request.into_inner().environment;
        if envs.is_empty() {
            return Ok(self.respond(pb::AddEnvironmentsResult {}));
        }
        for env in &envs {
            check_name("environment", env)?;
        }
        let mut cli_args = args(["config", "env", "add", "--yes"]);
        cli_args.push(format!("--stack={stack}"));
        cli_args.push("--".into());
        cli_args.extend(envs);
        let _guard = self.inner.lock.lock().await;
        self.inner
            .cli
            .run(&cli_args)
            .await
            .map_err(|e| to_status("config env add", e))?;
        Ok(self.respond(pb::AddEnvironmentsResult {}))
    }

    async fn set_environment_variables(
        &self,
        request: Request<pb::SetEnvironmentVariablesRequest>,
    ) -> Result<Response<pb::SetEnvironmentVariablesResult>, Status> {
        let env: std::collections::BTreeMap<String, String> =
            request.into_inner().env.into_iter().collect();
        if let Some(bad) = env
            .keys()
            .find(|k| k.is_empty() || k.contains('=') || k.contains('\0'))
        {
            return Err(Status::invalid_argument(format!(
                "invalid environment variable name {bad:?}"
            )));
        }
        if let Some((k, _)) = env.iter().find(|(_, v)| v.contains('\0')) {
            return Err(Status::invalid_argument(format!(
                "the value of {k} contains a NUL byte"
            )));
        }
        // Waits for a running operation: its process keeps the variables it started with.
        let _guard = self.inner.lock.lock().await;
        let names: Vec<&String> = env.keys().collect();
        info!(?names, "environment variables set");
        self.inner.cli.set_pushed_env(env);
        Ok(self.respond(pb::SetEnvironmentVariablesResult {}))
    }

    async fn install(
        &self,
        _request: Request<pb::InstallRequest>,
    ) -> Result<Response<pb::InstallResult>, Status> {
        let _guard = self.inner.lock.lock().await;
        self.inner.cli.run(&args(["install"])).await.map_err(|e| {
            Status::aborted(format!("install failed: {}", tail(&e.to_string(), 2000)))
        })?;
        Ok(self.respond(pb::InstallResult {}))
    }

    type PreviewStream = RpcStream<pb::PreviewStream>;

    async fn preview(
        &self,
        request: Request<pb::PreviewRequest>,
    ) -> Result<Response<Self::PreviewStream>, Status> {
        let req = request.into_inner();
        let mut a = args(["preview", "--diff"]);
        push_opt(&mut a, "parallel", req.parallel);
        push_opt(&mut a, "message", req.message.as_deref());
        push_flag(&mut a, "expect-no-changes", req.expect_no_changes);
        push_each(&mut a, "replace", &req.replace);
        push_each(&mut a, "target", &req.target);
        push_flag(&mut a, "target-dependents", req.target_dependents);
        push_flag(&mut a, "refresh", req.refresh);
        self.operation(
            "preview",
            a,
            |s| pb::PreviewStream {
                response: Some(pb::preview_stream::Response::Event(s)),
            },
            |agent: Agent, _stack, output: Output, times| async move {
                Ok(pb::PreviewStream {
                    response: Some(pb::preview_stream::Response::Result(pb::PreviewResult {
                        summary: Some(local_summary(&times, "")),
                        permalink: permalink(&output.stdout),
                        project_info: agent.project().ok(),
                        stdout: output.stdout,
                        stderr: output.stderr,
                    })),
                })
            },
        )
    }

    type RefreshStream = RpcStream<pb::RefreshStream>;

    async fn refresh(
        &self,
        request: Request<pb::RefreshRequest>,
    ) -> Result<Response<Self::RefreshStream>, Status> {
        let req = request.into_inner();
        let mut a = args(["refresh", "--yes", "--skip-preview"]);
        push_opt(&mut a, "parallel", req.parallel);
        push_opt(&mut a, "message", req.message.as_deref());
        push_flag(&mut a, "expect-no-changes", req.expect_no_changes);
        push_each(&mut a, "target", &req.target);
        push_flag(&mut a, "preview-only", req.preview_only);
        push_flag(&mut a, "run-program", req.run_program);
        self.operation(
            "refresh",
            a,
            |s| pb::RefreshStream {
                response: Some(pb::refresh_stream::Response::Event(s)),
            },
            |agent: Agent, stack, output: Output, times| async move {
                let summary = agent.last_summary(&stack, &times).await;
                Ok(pb::RefreshStream {
                    response: Some(pb::refresh_stream::Response::Result(pb::RefreshResult {
                        summary: Some(summary),
                        permalink: permalink(&output.stdout),
                        project_info: agent.project().ok(),
                        stdout: output.stdout,
                        stderr: output.stderr,
                    })),
                })
            },
        )
    }

    type UpStream = RpcStream<pb::UpStream>;

    async fn up(
        &self,
        request: Request<pb::UpRequest>,
    ) -> Result<Response<Self::UpStream>, Status> {
        let req = request.into_inner();
        let mut a = args([
            "up",
            "--yes",
            "--skip-preview",
            "--suppress-progress",
            "--diff",
        ]);
        push_opt(&mut a, "parallel", req.parallel);
        push_opt(&mut a, "message", req.message.as_deref());
        push_flag(&mut a, "expect-no-changes", req.expect_no_changes);
        push_each(&mut a, "replace", &req.replace);
        push_each(&mut a, "target", &req.target);
        push_flag(&mut a, "target-dependents", req.target_dependents);
        push_flag(&mut a, "refresh", req.refresh);
        push_flag(&mut a, "continue-on-error", req.continue_on_error);
        self.operation(
            "up",
            a,
            |s| pb::UpStream {
                response: Some(pb::up_stream::Response::Event(s)),
            },
            |agent: Agent, stack, output: Output, times| async move {
                let summary = agent.last_summary(&stack, &times).await;
                let outputs = agent.outputs(&stack).await?;
                Ok(pb::UpStream {
                    response: Some(pb::up_stream::Response::Result(pb::UpResult {
                        summary: Some(summary),
                        permalink: permalink(&output.stdout),
                        outputs,
                        project_info: agent.project().ok(),
                        stdout: output.stdout,
                        stderr: output.stderr,
                    })),
                })
            },
        )
    }

    type DestroyStream = RpcStream<pb::DestroyStream>;

    async fn destroy(
        &self,
        request: Request<pb::DestroyRequest>,
    ) -> Result<Response<Self::DestroyStream>, Status> {
        let req = request.into_inner();
        let remove = req.remove == Some(true);
        let mut a = args(["destroy", "--yes", "--skip-preview"]);
        push_opt(&mut a, "parallel", req.parallel);
        push_opt(&mut a, "message", req.message.as_deref());
        push_each(&mut a, "target", &req.target);
        push_flag(&mut a, "target-dependents", req.target_dependents);
        push_flag(&mut a, "refresh", req.refresh);
        push_flag(&mut a, "continue-on-error", req.continue_on_error);
        push_flag(&mut a, "remove", req.remove);
        push_flag(&mut a, "run-program", req.run_program);
        self.operation(
            "destroy",
            a,
            |s| pb::DestroyStream {
                response: Some(pb::destroy_stream::Response::Event(s)),
            },
            move |agent: Agent, stack, output: Output, times| async move {
                let summary = if remove {
                    // The stack and its history are gone.
                    agent.set_stack(None);
                    local_summary(&times, "")
                } else {
                    agent.last_summary(&stack, &times).await
                };
                Ok(pb::DestroyStream {
                    response: Some(pb::destroy_stream::Response::Result(pb::DestroyResult {
                        summary: Some(summary),
                        permalink: permalink(&output.stdout),
                        project_info: agent.project().ok(),
                        stdout: output.stdout,
                        stderr: output.stderr,
                    })),
                })
            },
        )
    }

    async fn pulumi_version(
        &self,
        _request: Request<pb::PulumiVersionRequest>,
    ) -> Result<Response<pb::PulumiVersionResult>, Status> {
        let out = self
            .inner
            .cli
            .run(&args(["version"]))
            .await
            .map_err(|e| to_status("version", e))?;
        Ok(self.respond(pb::PulumiVersionResult {
            version: out.stdout.trim().to_owned(),
        }))
    }
}

/// The Pulumi Cloud link the CLI prints (`View in Browser: …` / `View Live: …`); DIY backends
/// print none.
fn permalink(stdout: &str) -> Option<String> {
    stdout.lines().find_map(|line| {
        let line = line.trim();
        [
            "View in Browser (Ctrl+O): ",
            "View in Browser: ",
            "View Live: ",
        ]
        .iter()
        .find_map(|p| line.strip_prefix(p))
        .map(|url| url.trim().to_owned())
        .filter(|url| url.starts_with("http"))
    })
}

/// Where the agent keeps transient files (event logs).
pub fn default_state_dir() -> PathBuf {
    std::env::temp_dir().join(format!("pko-agent-{}", std::process::id()))
}

#[cfg(test)]
mod tests {
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

    use super::*;

    fn item(key: &str, path: bool, secret: bool, value: Value) -> Resolved {
        Resolved {
            key: key.into(),
            path,
            secret,
            value,
        }
    }

    #[test]
    fn plain_config_uses_path_mode_with_quoted_keys() {
        let a = set_all_args(
            "proj",
            &[
                item("a.b", false, false, json!("x")),
                item("list[0]", true, false, json!(1)),
                item("aws:region", false, true, json!("eu")),
            ],
        )
        .expect("args");
        assert_eq!(
            a,
            vec![
                "config",
                "set-all",
                "--path",
                "--plaintext",
                "proj:[\"a.b\"]=x",
                "--plaintext",
                "proj:list[0]=1",
                "--secret",
                "aws:[\"region\"]=eu",
            ]
        );
    }

    #[test]
    fn structured_config_uses_json_mode() {
        let a = set_all_args(
            "proj",
            &[
                item("obj", false, false, json!({"k": [1, 2]})),
                item("n", false, true, json!(3)),
            ],
        )
        .expect("args");
        let doc: Value = serde_json::from_str(a[2].trim_start_matches("--json=")).expect("json");
        assert_eq!(doc["proj:obj"]["objectValue"], json!({"k": [1, 2]}));
        assert_eq!(doc["proj:n"], json!({"value": "3", "secret": true}));
        let err = set_all_args(
            "proj",
            &[
                item("obj", false, false, json!([1])),
                item("p.q", true, false, json!("x")),
            ],
        )
        .expect_err("path + structured");
        assert_eq!(err.code(), Code::InvalidArgument);
    }

    #[test]
    fn permalink_is_found() {
        assert_eq!(
            permalink("x\n    View in Browser (Ctrl+O): https://app.pulumi.com/o/p/s/updates/1\n"),
            Some("https://app.pulumi.com/o/p/s/updates/1".into())
        );
        assert_eq!(permalink("no link"), None);
    }
}
