//! Program controller: every generation of a Program gets an artifact whose URL and digest are
//! written to `status.artifact`, with a `Ready` condition and Events.
//!
//! Beyond PKO: the status is written only when something changed (PKO rewrites
//! `lastUpdateTime = now` on every reconcile, so each operator restart rewrites every Program), and
//! a Program whose artifact cannot be built says so in a condition and an Event.
//!
//! Transforms: the Program's transform chain runs before the artifact is built; the applied
//! chain is recorded in `status.artifact.metadata` (a field PKO defines and never sets). A
//! transform failing under `failurePolicy: Fail` makes `Ready=False` with a reason naming the
//! cause (`TransformTimeout`, `TransformFuelExhausted`, …) and a Warning event; one skipped under
//! `Ignore` leaves the Program served without it, with a Warning event. When a transform changes,
//! the Programs whose chain changed are reconciled again (see `crate::transform`).

use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use k8s_openapi::jiff::Timestamp;
use kube::api::{Patch, PatchParams};
use kube::runtime::controller::{self, Action, Controller};
use kube::runtime::events::{Event, EventType, Recorder};
use kube::runtime::reflector::ObjectRef;
use kube::{Api, Client, Resource, ResourceExt};
use pko_api::program::Program;
use serde_json::{Value, json};
use tokio::sync::broadcast;
use tracing::{info, instrument, warn};

use crate::artifact::index::{BuildError, BuildResult, Built, ProgramIndex};
use crate::capability::{ArtifactRef, KeyRing, unix_now};
use crate::config::{AdvertisedAddress, artifact_path};
use crate::controller::backoff::{self, Backoff, Verdict};
use crate::controller::conditions::truncate;
use crate::controller::keys::PROGRAM_STATUS_MANAGER;
use crate::controller::kit::{self, Kit};
use crate::metrics::Metrics;

const CONTROLLER: &str = "program";
const READY: &str = "Ready";
/// `status.artifact.metadata` key: the fingerprint of the chain the artifact was built with.
pub const METADATA_CHAIN: &str = "transforms.pko-rs.dev/chain";
/// `status.artifact.metadata` key: the transforms applied, in order, as a JSON array of
/// `{transform, plugin, module, config}` (module and config digests).
pub const METADATA_APPLIED: &str = "transforms.pko-rs.dev/applied";
/// `status.artifact.metadata` key: transforms skipped under `failurePolicy: Ignore`, as a JSON
/// array of `{transform, reason, message}`.
pub const METADATA_SKIPPED: &str = "transforms.pko-rs.dev/skipped";
/// Delay before building again after a failure that may not recur (a timeout, a busy host).
const TRANSIENT_REQUEUE: Duration = Duration::from_secs(30);

/// Failures of one reconcile.
#[derive(Debug, thiserror::Error)]
pub enum ProgramError {
    #[error("program has no namespace")]
    NoNamespace,
    #[error("cannot write program status: {0}")]
    Status(#[source] kube::Error),
    #[error("cannot encode program status: {0}")]
    Encode(#[source] serde_json::Error),
}

impl kit::MetricLabel for ProgramError {
    fn metric_label(&self) -> &'static str {
        match self {
            Self::NoNamespace => "no_namespace",
            Self::Status(_) => "status_write",
            Self::Encode(_) => "encode",
        }
    }
}

impl ProgramError {
    /// Every value of its metric label, exported at zero from the start.
    pub const KINDS: &'static [&'static str] = &["no_namespace", "status_write", "encode"];

    /// Whether retrying may help (see [`backoff`]).
    fn verdict(&self) -> Verdict {
        match self {
            Self::Status(source) => backoff::classify(source),
            Self::NoNamespace | Self::Encode(_) => Verdict::Permanent,
        }
    }

    /// What the Event says: the apiserver's own message for its refusals.
    fn message(&self) -> String {
        match self {
            Self::Status(source) => {
                format!("cannot write program status: {}", backoff::describe(source))
            }
            other => other.to_string(),
        }
    }
}

/// What every reconcile needs.
pub struct ProgramContext {
    pub client: Client,
    pub recorder: Recorder,
    pub advertised: AdvertisedAddress,
    pub index: Arc<ProgramIndex>,
    pub metrics: Metrics,
    /// Signs the artifact URLs.
    pub keys: KeyRing,
    /// Failed reconciles per Program.
    pub backoff: Backoff,
}

impl ProgramContext {
    pub fn new(
        kit: &Kit,
        advertised: AdvertisedAddress,
        index: Arc<ProgramIndex>,
        keys: KeyRing,
    ) -> Self {
        Self {
            client: kit.client.clone(),
            recorder: kit.recorder(CONTROLLER),
            advertised,
            index,
            metrics: kit.metrics.clone(),
            keys,
            backoff: Backoff::default(),
        }
    }

    /// The capability URL of one artifact (see [`crate::capability`]).
    fn artifact_url(&self, namespace: &str, name: &str, generation: i64, digest: &str) -> String {
        let url = self.advertised.program_url(namespace, name, generation);
        let artifact = ArtifactRef {
            namespace,
            name,
            generation,
            digest,
        };
        match self.keys.get().sign(unix_now(), &artifact) {
            Some(token) => format!("{url}?{}", artifact.query(&token)),
            // No key (cannot happen once started): a URL nobody can fetch, rather than none.
            None => url,
        }
    }
}

/// The status fields this controller owns, computed for one Program.
#[derive(Debug, PartialEq)]
struct Desired {
    generation: i64,
    artifact: Option<Value>,
    ready: Condition,
}

#[derive(Debug, PartialEq)]
struct Condition {
    status: &'static str,
    reason: String,
    message: String,
}

/// Run the controller until `shutdown` resolves.
///
/// The controller has no watch of its own: it is driven from the replica's one Program store
/// (the file server's), so every generation it publishes is already in the store the file
/// server answers from, and the replica holds one copy of every Program, not two.
pub async fn run(
    ctx: Arc<ProgramContext>,
    concurrency: u16,
    shutdown: impl std::future::Future<Output = ()> + Send + Sync + 'static,
) {
    ctx.metrics.init_controller(CONTROLLER, ProgramError::KINDS);
    let controller =
        Controller::for_shared_stream(ctx.index.triggers(), ctx.index.programs().clone());
    // Programs whose transform chain changed are reconciled again; a receiver that fell behind
    // gets every Program instead.
    let controller = match ctx.index.transforms() {
        Some(transforms) => {
            let store = controller.store();
            let triggers = futures::stream::unfold(
                (transforms.subscribe_programs(), store),
                |(mut rx, store)| async move {
                    let programs = match rx.recv().await {
                        Ok(program) => vec![program],
                        Err(broadcast::error::RecvError::Lagged(_)) => store
                            .state()
                            .iter()
                            .map(|p| ObjectRef::from_obj(p.as_ref()))
                            .collect(),
                        Err(broadcast::error::RecvError::Closed) => return None,
                    };
                    Some((programs, (rx, store)))
                },
            )
            .flat_map(futures::stream::iter);
            controller.reconcile_on(triggers)
        }
        None => controller,
    };
    controller
        .with_config(controller::Config::default().concurrency(concurrency))
        .graceful_shutdown_on(shutdown)
        .run(reconcile, error_policy, ctx)
        .for_each(|result| async move {
            if let Err(err) = result {
                // Reconcile errors are logged in error_policy; these are queue/watch errors.
                warn!(controller = CONTROLLER, error = %err, "controller event");
            }
        })
        .await;
}

#[instrument(skip_all, fields(program = %format!("{}/{}", program.namespace().unwrap_or_default(), program.name_any())))]
async fn reconcile(
    program: Arc<Program>,
    ctx: Arc<ProgramContext>,
) -> Result<Action, ProgramError> {
    let _measure = kit::measure(&ctx.metrics, CONTROLLER);
    let result = reconcile_inner(&program, &ctx).await;
    let failure = ctx
        .backoff
        .record(&program.metadata, &result, ProgramError::verdict);
    // What fails is the status write itself, so the stall is told by an Event, once.
    if let (Some(failure), Err(err)) = (failure, &result)
        && failure.first_stall
    {
        let object = program.object_ref(&());
        kit::publish_stall(&ctx.recorder, &object, "Reconcile", &err.message()).await;
    }
    result
}

async fn reconcile_inner(
    program: &Arc<Program>,
    ctx: &ProgramContext,
) -> Result<Action, ProgramError> {
    if program.meta().deletion_timestamp.is_some() {
        return Ok(Action::await_change());
    }
    let namespace = program.namespace().ok_or(ProgramError::NoNamespace)?;
    let name = program.name_any();
    let generation = program.metadata.generation.unwrap_or(0);
    let current = current_status(program)?;

    let built = ctx.index.artifact_for(program.clone()).await;
    if let Err(err) = &built
        && matches!(**err, BuildError::Transforms(_))
    {
        // The transforms are not known yet: nothing true to report; look again shortly.
        return Ok(Action::requeue(Duration::from_secs(5)));
    }
    // A result shaped by a timeout or a busy host is built again later.
    let next = match &built {
        Ok(b) if b.chain.transient() => Action::requeue(TRANSIENT_REQUEUE),
        Err(e) if e.is_transient() => Action::requeue(TRANSIENT_REQUEUE),
        _ => Action::await_change(),
    };
    let desired = desired_status(ctx, &namespace, &name, generation, &built, &current);
    if current.matches(&desired) {
        return Ok(next);
    }

    let now = Timestamp::now().to_string();
    let artifact = desired.artifact.clone().map(|mut artifact| {
        // lastUpdateTime moves only when the artifact itself changes (a URL re-signed with a
        // new key is the same artifact).
        let unchanged = current
            .artifact
            .as_ref()
            .is_some_and(|old| same_bytes(old, &artifact));
        let time = match (&current.artifact, unchanged) {
            (Some(old), true) => old
                .get("lastUpdateTime")
                .cloned()
                .unwrap_or_else(|| json!(now)),
            _ => json!(now),
        };
        if let Value::Object(map) = &mut artifact {
            map.insert("lastUpdateTime".into(), time);
        }
        artifact
    });
    let transition = match &current.ready {
        Some((status, _, _, time)) if *status == desired.ready.status => time.clone(),
        _ => now.clone(),
    };
    let mut status = json!({
        "observedGeneration": generation,
        "conditions": [{
            "type": READY,
            "status": desired.ready.status,
            "reason": desired.ready.reason,
            "message": desired.ready.message,
            "observedGeneration": generation,
            "lastTransitionTime": transition,
        }],
    });
    if let (Some(artifact), Value::Object(map)) = (artifact, &mut status) {
        map.insert("artifact".into(), artifact);
    }
    let patch = json!({
        "apiVersion": "pulumi.com/v1",
        "kind": "Program",
        "status": status,
    });
    let api = Api::<Program>::namespaced(ctx.client.clone(), &namespace);
    api.patch_status(
        &name,
        &PatchParams::apply(PROGRAM_STATUS_MANAGER).force(),
        &Patch::Apply(&patch),
    )
    .await
    .map_err(ProgramError::Status)?;

    for event in events(ctx, &namespace, &name, generation, &built) {
        if let Err(err) = ctx.recorder.publish(&event, &program.object_ref(&())).await {
            warn!(error = %err, "cannot publish event");
        }
    }
    Ok(next)
}

/// The Events of a status change: the outcome, plus one per skipped transform and per
/// transform that returned warnings.
fn events(
    ctx: &ProgramContext,
    namespace: &str,
    name: &str,
    generation: i64,
    built: &BuildResult,
) -> Vec<Event> {
    let event = |type_, reason: &str, note: String| Event {
        type_,
        reason: reason.into(),
        note: Some(truncate(&note, 1000)),
        action: "BuildArtifact".into(),
        secondary: None,
    };
    match built {
        Ok(built) => {
            let artifact = &built.artifact;
            info!(generation, digest = %artifact.digest, transforms = built.chain.applied.len(), "artifact ready");
            let mut out = vec![event(
                EventType::Normal,
                "ArtifactReady",
                // Events are readable more widely than status: the URL's token stays out.
                format!(
                    "generation {generation} is served at {} ({})",
                    ctx.advertised.program_url(namespace, name, generation),
                    artifact.digest
                ),
            )];
            for skipped in &built.chain.skipped {
                warn!(generation, transform = %skipped.id, error = %skipped.error, "transform skipped");
                out.push(event(
                    EventType::Warning,
                    "TransformSkipped",
                    format!(
                        "generation {generation}: transform {} skipped (failurePolicy Ignore): {}",
                        skipped.id, skipped.error
                    ),
                ));
            }
            for applied in built
                .chain
                .applied
                .iter()
                .filter(|a| !a.warnings.is_empty())
            {
                out.push(event(
                    EventType::Warning,
                    "TransformWarning",
                    format!("{}: {}", applied.id, applied.warnings.join("; ")),
                ));
            }
            out
        }
        Err(err) => {
            warn!(generation, error = %err, "artifact cannot be built");
            let reason = match &**err {
                BuildError::Transform(_) => "TransformFailed",
                _ => "ArtifactFailed",
            };
            vec![event(
                EventType::Warning,
                reason,
                format!("generation {generation}: {err}"),
            )]
        }
    }
}

fn error_policy(program: Arc<Program>, err: &ProgramError, ctx: Arc<ProgramContext>) -> Action {
    kit::error_policy(CONTROLLER, &*program, err, &ctx.metrics, &ctx.backoff)
}

/// The status fields as they are now.
#[derive(Debug, Default)]
struct Current {
    observed_generation: Option<i64>,
    artifact: Option<Value>,
    /// (status, reason, message, lastTransitionTime) of the Ready condition.
    ready: Option<(String, String, String, String)>,
    ready_generation: Option<i64>,
}

impl Current {
    fn matches(&self, desired: &Desired) -> bool {
        let artifact_same = match (&self.artifact, &desired.artifact) {
            (Some(old), Some(new)) => same_artifact(old, new),
            (None, None) => true,
            _ => false,
        };
        artifact_same
            && self.observed_generation == Some(desired.generation)
            && self.ready_generation == Some(desired.generation)
            && self
                .ready
                .as_ref()
                .is_some_and(|(status, reason, message, _)| {
                    status == desired.ready.status
                        && *reason == desired.ready.reason
                        && *message == desired.ready.message
                })
    }
}

fn current_status(program: &Program) -> Result<Current, ProgramError> {
    let Some(status) = &program.status else {
        return Ok(Current::default());
    };
    let status = serde_json::to_value(status).map_err(ProgramError::Encode)?;
    let ready = status
        .get("conditions")
        .and_then(Value::as_array)
        .and_then(|conditions| {
            conditions
                .iter()
                .find(|c| c.get("type").and_then(Value::as_str) == Some(READY))
        });
    let field = |c: &Value, k: &str| {
        c.get(k)
            .and_then(Value::as_str)
            .unwrap_or_default()
            .to_owned()
    };
    Ok(Current {
        observed_generation: status.get("observedGeneration").and_then(Value::as_i64),
        artifact: status.get("artifact").filter(|a| !a.is_null()).cloned(),
        ready: ready.map(|c| {
            (
                field(c, "status"),
                field(c, "reason"),
                field(c, "message"),
                field(c, "lastTransitionTime"),
            )
        }),
        ready_generation: ready
            .and_then(|c| c.get("observedGeneration"))
            .and_then(Value::as_i64),
    })
}

fn desired_status(
    ctx: &ProgramContext,
    namespace: &str,
    name: &str,
    generation: i64,
    built: &BuildResult,
    current: &Current,
) -> Desired {
    match built {
        Ok(built) => {
            let artifact = &built.artifact;
            let mut value = json!({
                "path": artifact_path(namespace, name, generation),
                "url": ctx.artifact_url(namespace, name, generation, &artifact.digest),
                "revision": generation.to_string(),
                "digest": artifact.digest,
                "size": artifact.size(),
            });
            if let (Some(metadata), Value::Object(map)) = (chain_metadata(built), &mut value) {
                map.insert("metadata".into(), metadata);
            }
            let mut message = format!("artifact of generation {generation} is available");
            if !built.chain.applied.is_empty() {
                let ids: Vec<&str> = built.chain.applied.iter().map(|a| a.id.as_str()).collect();
                message.push_str(&format!("; transformed by {}", ids.join(", ")));
            }
            if !built.chain.skipped.is_empty() {
                let skipped: Vec<String> = built
                    .chain
                    .skipped
                    .iter()
                    .map(|s| format!("{} ({})", s.id, s.error.kind().camel()))
                    .collect();
                message.push_str(&format!("; skipped {}", skipped.join(", ")));
            }
            Desired {
                generation,
                artifact: Some(value),
                ready: Condition {
                    status: "True",
                    reason: "ArtifactReady".into(),
                    message: truncate(&message, 1000),
                },
            }
        }
        Err(err) => {
            let (reason, message) = match &**err {
                BuildError::Transform(failure) => (
                    format!("Transform{}", failure.error.kind().camel()),
                    format!(
                        "artifact of generation {generation} is not served: transform {failure} (failurePolicy Fail)"
                    ),
                ),
                other => (
                    "ArtifactFailed".to_owned(),
                    format!("artifact of generation {generation} cannot be built: {other}"),
                ),
            };
            Desired {
                generation,
                // Keep the last good artifact visible: workspaces already using it keep working.
                artifact: current.artifact.clone(),
                ready: Condition {
                    status: "False",
                    reason,
                    message: truncate(&message, 1000),
                },
            }
        }
    }
}

/// `status.artifact.metadata` for an artifact built through transforms (`None` without).
fn chain_metadata(built: &Built) -> Option<Value> {
    let chain = &built.chain;
    if chain.fingerprint.is_empty() {
        return None;
    }
    let applied: Vec<Value> = chain
        .applied
        .iter()
        .map(|a| {
            json!({
                "transform": a.id,
                "plugin": a.plugin,
                "module": a.module,
                "config": a.config,
            })
        })
        .collect();
    let mut map = serde_json::Map::new();
    map.insert(METADATA_CHAIN.into(), json!(chain.fingerprint));
    map.insert(
        METADATA_APPLIED.into(),
        json!(Value::Array(applied).to_string()),
    );
    if !chain.skipped.is_empty() {
        let skipped: Vec<Value> = chain
            .skipped
            .iter()
            .map(|s| {
                json!({
                    "transform": s.id,
                    "reason": s.error.kind().camel(),
                    "message": truncate(&s.error.to_string(), 300),
                })
            })
            .collect();
        map.insert(
            METADATA_SKIPPED.into(),
            json!(Value::Array(skipped).to_string()),
        );
    }
    Some(Value::Object(map))
}

/// Equal in every field except `lastUpdateTime`.
fn same_artifact(old: &Value, new: &Value) -> bool {
    same_bytes(old, new) && old.get("url") == new.get("url")
}

/// The same artifact, whatever its URL's token.
fn same_bytes(old: &Value, new: &Value) -> bool {
    ["path", "revision", "digest", "size", "metadata"]
        .iter()
        .all(|k| old.get(*k) == new.get(*k))
}
