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

use std::collections::BTreeMap;
use std::panic::AssertUnwindSafe;
use std::sync::Arc;
use std::time::Duration;

use futures::{FutureExt, StreamExt};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};
use k8s_openapi::jiff::Timestamp;
use kube::api::{Patch, PatchParams};
use kube::runtime::events::{Event, EventType, Recorder};
use kube::runtime::reflector::ObjectRef;
use kube::{Api, Client, Resource, ResourceExt};
use pko_api::program::{Artifact, Program, ProgramStatus};
use pko_plugin_host::chain::{Applied, Skipped};
use serde::Serialize;
use tokio::sync::broadcast;
use tracing::{info, instrument, warn};

use crate::artifact::index::{BuildError, BuildResult, Built, ChainReport, ProgramIndex};
use crate::artifact::stored::StoredProgram;
use crate::capability::{ArtifactRef, KeyRing, unix_now};
use crate::config::{AdvertisedAddress, artifact_path};
use crate::controller::backoff::{self, Backoff, Verdict};
use crate::controller::conditions::{self, truncate};
use crate::controller::keys::{
    ARTIFACT_FAILED, PROGRAM_STATUS_MANAGER, RECONCILING, RETRYING_BUILD, STALLED, TRANSFORM_FAILED,
};
use crate::controller::kit::{self, Kit};
use crate::controller::queue::WorkQueue;
use crate::controller::takeover::{self, Part};
use crate::metrics::Metrics;
use crate::runtime_metrics::{self, ControllerProbe, ObjectKey, ReconcileResult};

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
/// Delay before looking again while the transforms are not known yet (their watch has not
/// listed them): there is nothing true to report meanwhile, and they usually arrive in seconds.
const TRANSFORMS_UNKNOWN_REQUEUE: Duration = Duration::from_secs(5);

/// What to compare the desired status with after a failed write, given the Program as the
/// apiserver holds it now.
#[derive(Debug, PartialEq)]
enum Reread {
    /// Its status: the store's generation is current.
    Compare(ProgramStatus),
    /// Deleted meanwhile.
    Gone,
    /// A newer generation than the store's: wait for the store rather than write an older
    /// generation's status over it.
    StoreBehind,
}

fn reread_status(stored_generation: i64, fresh: Option<Program>) -> Reread {
    match fresh {
        None => Reread::Gone,
        Some(p) if p.metadata.generation.unwrap_or(0) > stored_generation => Reread::StoreBehind,
        Some(p) => Reread::Compare(p.status.unwrap_or_default()),
    }
}

/// Failures of one reconcile.
#[derive(Debug, thiserror::Error)]
pub enum ProgramError {
    #[error("program has no namespace")]
    NoNamespace,
    #[error("cannot write program status: {0}")]
    Status(#[source] kube::Error),
    #[error("cannot read the program its store has not caught up with: {0}")]
    Reread(#[source] kube::Error),
    #[error("cannot encode the transforms of the artifact metadata: {0}")]
    Encode(#[source] serde_json::Error),
}

impl kit::MetricLabel for ProgramError {
    fn metric_label(&self) -> &'static str {
        match self {
            Self::NoNamespace => "no_namespace",
            Self::Status(_) => "status_write",
            Self::Reread(_) => "status_reread",
            Self::Encode(_) => "encode",
        }
    }
}

impl ProgramError {
    /// Every value of its metric label, exported at zero from the start.
    pub const KINDS: &'static [&'static str] =
        &["no_namespace", "status_write", "status_reread", "encode"];

    /// Whether retrying may help (see [`backoff`]).
    fn verdict(&self) -> Verdict {
        match self {
            Self::Status(source) | Self::Reread(source) => backoff::classify(source),
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
    /// By Program uid, the store's resourceVersion a status write was made (or tried) on top
    /// of. While the store still holds that version it has not seen the write, which may have
    /// landed all the same: a relist served from the apiserver's cache can predate it, and a
    /// write can land with its answer lost (an apiserver restart).
    written_over: std::sync::Mutex<std::collections::HashMap<String, String>>,
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
            written_over: std::sync::Mutex::default(),
        }
    }

    fn written_over(&self) -> std::sync::MutexGuard<'_, std::collections::HashMap<String, String>> {
        self.written_over
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Whether the store still holds the version of `program` a status write was made on top
    /// of; forgets the write once the store has moved on.
    fn store_behind_own_write(&self, program: &StoredProgram) -> bool {
        let (Some(uid), Some(version)) =
            (&program.metadata.uid, &program.metadata.resource_version)
        else {
            return false;
        };
        let mut written = self.written_over();
        match written.get(uid) {
            Some(base) if base == version => true,
            Some(_) => {
                written.remove(uid);
                false
            }
            None => false,
        }
    }

    /// Notes a status write on top of the stored `program`; forgets deleted Programs' notes
    /// when they outnumber the stored Programs.
    fn note_write(&self, program: &StoredProgram) {
        let (Some(uid), Some(version)) =
            (&program.metadata.uid, &program.metadata.resource_version)
        else {
            return;
        };
        let mut written = self.written_over();
        written.insert(uid.clone(), version.clone());
        let stored = self.index.programs().len();
        if written.len() > stored.saturating_mul(2).max(1024) {
            let live: std::collections::HashSet<String> = self
                .index
                .programs()
                .state()
                .iter()
                .filter_map(|p| p.metadata.uid.clone())
                .collect();
            written.retain(|uid, _| live.contains(uid));
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

/// The conditions a build result calls for: `Ready`, and beside it kstatus's `Reconciling`
/// or `Stalled` (with `Ready`'s message) while the artifact is not served.
#[derive(Debug, Clone, PartialEq)]
struct Ready {
    status: bool,
    reason: String,
    message: String,
    /// Whether the failure is retried, or waits for a change.
    progress: Progress,
}

/// What kstatus is told beside `Ready`.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Progress {
    /// Served: neither `Reconciling` nor `Stalled`.
    Done,
    /// `Reconciling=True` (reason [`RETRYING_BUILD`]): the build is retried by itself.
    Retrying,
    /// `Stalled=True` with this reason: only a change (of the Program or a transform) helps.
    Stalled(&'static str),
}

/// Run the controller until `shutdown` resolves; reconciles in progress then finish.
///
/// The controller has no watch of its own: it is driven from the replica's one Program store
/// (the file server's), so every generation it publishes is already in the store the file
/// server answers from, and the replica holds one copy of every Program, not two. Programs are
/// served first come, first served ([`WorkQueue`]), `concurrency` at a time.
pub async fn run(
    ctx: Arc<ProgramContext>,
    concurrency: u16,
    shutdown: impl std::future::Future<Output = ()> + Send + Sync + 'static,
) {
    ctx.metrics.init_controller(CONTROLLER, ProgramError::KINDS);
    let probe = ctx
        .metrics
        .runtime
        .controller(runtime_metrics::names::PROGRAM, concurrency.max(1));
    let queue = WorkQueue::observed(probe.clone(), |key: &ObjectRef<StoredProgram>| {
        ObjectKey::from(key)
    });
    let workers = futures::future::join_all(
        (0..concurrency.max(1)).map(|_| work(ctx.clone(), queue.clone(), probe.clone())),
    );
    let feed = {
        let queue = queue.clone();
        async move {
            tokio::select! {
                () = shutdown => {}
                () = feed(&ctx, &queue) => {}
            }
            queue.shut_down();
        }
    };
    futures::join!(workers, feed);
}

/// Queues every Program the store says changed, and those whose transform chain changed (a
/// receiver of those that fell behind queues every Program).
async fn feed(ctx: &ProgramContext, queue: &WorkQueue<ObjectRef<StoredProgram>>) {
    let changed = ctx
        .index
        .triggers()
        .map(|program| ObjectRef::from_obj(program.as_ref()));
    let rechained = match ctx.index.transforms() {
        Some(transforms) => {
            let store = ctx.index.programs().clone();
            futures::stream::unfold(
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
            .flat_map(futures::stream::iter)
            .boxed()
        }
        None => futures::stream::empty().boxed(),
    };
    futures::stream::select(changed, rechained)
        .for_each(|key| {
            queue.add(key);
            std::future::ready(())
        })
        .await;
}

/// One worker: reconciles the oldest queued Program, as the store holds it now, until the
/// queue shuts down.
async fn work(
    ctx: Arc<ProgramContext>,
    queue: WorkQueue<ObjectRef<StoredProgram>>,
    probe: ControllerProbe,
) {
    while let Some(key) = queue.next().await {
        let again = match ctx.index.programs().get(&key) {
            Some(program) => {
                let run = probe.start(ObjectKey::from(&key));
                match AssertUnwindSafe(reconcile(program, ctx.clone()))
                    .catch_unwind()
                    .await
                {
                    Ok((result, again)) => {
                        run.finish(result);
                        again
                    }
                    Err(panic) => {
                        run.panicked();
                        std::panic::resume_unwind(panic)
                    }
                }
            }
            // Gone from the store: deleted since it was queued (kube's controllers drop such
            // a request without a reconcile too).
            None => {
                probe.forget(&ObjectKey::from(&key));
                None
            }
        };
        queue.done(&key);
        if let Some(delay) = again {
            queue.add_after(key, delay);
        }
    }
}

/// Reconciles one Program; returns how it ended and when to look at it again, if no change
/// comes first.
#[instrument(skip_all, fields(program = %format!("{}/{}", program.namespace().unwrap_or_default(), program.name_any())))]
async fn reconcile(
    program: Arc<StoredProgram>,
    ctx: Arc<ProgramContext>,
) -> (ReconcileResult, Option<Duration>) {
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
    match result {
        Ok(Some(next)) => (ReconcileResult::RequeueAfter, Some(next)),
        Ok(None) => (ReconcileResult::Success, None),
        Err(err) => (
            ReconcileResult::Error,
            Some(kit::failure_delay(
                CONTROLLER,
                &*program,
                &err,
                &ctx.metrics,
                &ctx.backoff,
            )),
        ),
    }
}

async fn reconcile_inner(
    program: &Arc<StoredProgram>,
    ctx: &ProgramContext,
) -> Result<Option<Duration>, ProgramError> {
    if program.meta().deletion_timestamp.is_some() {
        return Ok(None);
    }
    let namespace = program.namespace().ok_or(ProgramError::NoNamespace)?;
    let name = program.name_any();
    let generation = program.metadata.generation.unwrap_or(0);
    let none = ProgramStatus::default();
    let api = Api::<Program>::namespaced(ctx.client.clone(), &namespace);
    let reread;
    let current = if ctx.store_behind_own_write(program) {
        // Compared with the store, a write of ours that landed unseen would be made again,
        // with a new lastUpdateTime: compare with what the apiserver holds instead.
        tracing::debug!("the store has not shown our last status write; reading the Program");
        let fresh = match api.get_status(&name).await {
            Ok(fresh) => Some(fresh),
            Err(kube::Error::Api(status)) if status.code == 404 => None,
            Err(err) => return Err(ProgramError::Reread(err)),
        };
        match reread_status(generation, fresh) {
            Reread::Compare(status) => {
                reread = status;
                &reread
            }
            // Deleted, or the store lags behind a newer generation whose event brings the next
            // reconcile.
            Reread::Gone | Reread::StoreBehind => return Ok(None),
        }
    } else {
        program.status.as_ref().unwrap_or(&none)
    };

    let built = ctx.index.artifact_for(program.clone()).await;
    if let Err(err) = &built
        && matches!(**err, BuildError::Transforms(_))
    {
        // Nothing true to report yet: look again shortly.
        return Ok(Some(TRANSFORMS_UNKNOWN_REQUEUE));
    }
    // A result shaped by a timeout or a busy host is built again later.
    let next = match &built {
        Ok(b) if b.chain.transient() => Some(TRANSIENT_REQUEUE),
        Err(e) if e.is_transient() => Some(TRANSIENT_REQUEUE),
        _ => None,
    };
    let now = Time(Timestamp::now());
    let (artifact, ready) = outcome(ctx, &namespace, &name, generation, &built, current, now)?;
    let desired = desired_status(current, generation, artifact, &ready);
    // Status fields only PKO's writer owns go with our next write, made even if unchanged.
    let pkos = takeover::pko_owns(program.meta(), Part::Status);
    if unchanged(current, &desired) && !pkos {
        return Ok(next);
    }

    // Server-side apply, by measurement: the same client's N bare status patches take about
    // 12% longer as JSON merge patches on this apiserver (docs/benchmarks.md).
    let params = PatchParams::apply(PROGRAM_STATUS_MANAGER).force();
    let body = kit::StatusPatch::new::<Program>(&desired);
    ctx.note_write(program);
    api.patch_status(&name, &params, &Patch::Apply(&body))
        .await
        .map_err(ProgramError::Status)?;
    // Our artifact first, then what PKO alone still owns: a Stack that sees PKO's writer gone
    // sees our artifact too (it waits while PKO's is there).
    if pkos
        && takeover::take_over(&api, &name, PROGRAM_STATUS_MANAGER, Part::Status)
            .await
            .map_err(ProgramError::Status)?
    {
        ctx.note_write(program);
        api.patch_status(&name, &params, &Patch::Apply(&body))
            .await
            .map_err(ProgramError::Status)?;
    }

    let was_ready = conditions::get(&current.conditions, READY).map(|c| c.status == "True");
    for event in events(ctx, &namespace, &name, generation, &built, was_ready) {
        if let Err(err) = ctx.recorder.publish(&event, &program.object_ref(&())).await {
            warn!(error = %err, "cannot publish event");
        }
    }
    Ok(next)
}

/// The Events of a status change: a failure, a recovery from one, one per skipped transform and
/// one per transform that returned warnings. A plain success writes no Event: the status says
/// it, and an Event per generation would double the apiserver writes of every Program.
fn events(
    ctx: &ProgramContext,
    namespace: &str,
    name: &str,
    generation: i64,
    built: &BuildResult,
    was_ready: Option<bool>,
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
            let mut out = Vec::new();
            if was_ready == Some(false) {
                out.push(event(
                    EventType::Normal,
                    "ArtifactReady",
                    // Events are readable more widely than status: the URL's token stays out.
                    format!(
                        "recovered: generation {generation} is served at {} ({})",
                        ctx.advertised.program_url(namespace, name, generation),
                        artifact.digest
                    ),
                ));
            }
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
            vec![event(
                EventType::Warning,
                stall_reason(err),
                format!("generation {generation}: {err}"),
            )]
        }
    }
}

/// The artifact and the `Ready` condition of a build result. A fresh artifact is dated `now`
/// ([`desired_status`] keeps the old date when the bytes did not change); a failed build keeps
/// the last good artifact visible, so workspaces already using it keep working.
fn outcome(
    ctx: &ProgramContext,
    namespace: &str,
    name: &str,
    generation: i64,
    built: &BuildResult,
    current: &ProgramStatus,
    now: Time,
) -> Result<(Option<Artifact>, Ready), ProgramError> {
    match built {
        Ok(built) => {
            let artifact = &built.artifact;
            let fresh = Artifact {
                path: artifact_path(namespace, name, generation),
                url: ctx.artifact_url(namespace, name, generation, &artifact.digest),
                revision: generation.to_string(),
                digest: Some(artifact.digest.clone()),
                last_update_time: now,
                // An artifact is far smaller than i64::MAX bytes.
                size: Some(i64::try_from(artifact.size()).unwrap_or(i64::MAX)),
                metadata: chain_metadata(&built.chain)?,
            };
            Ok((Some(fresh), ready_of_build(generation, built)))
        }
        Err(err) => Ok((current.artifact.clone(), ready_of_failure(generation, err))),
    }
}

fn ready_of_build(generation: i64, built: &Built) -> Ready {
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
    Ready {
        status: true,
        reason: "ArtifactReady".into(),
        message: truncate(&message, 1000),
        progress: Progress::Done,
    }
}

fn ready_of_failure(generation: i64, err: &BuildError) -> Ready {
    let progress = if err.is_transient() {
        Progress::Retrying
    } else {
        Progress::Stalled(stall_reason(err))
    };
    let (reason, message) = match err {
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
    Ready {
        status: false,
        reason,
        message: truncate(&message, 1000),
        progress,
    }
}

/// The `Stalled` reason (and Warning Event reason) of a failed build.
fn stall_reason(err: &BuildError) -> &'static str {
    match err {
        BuildError::Transform(_) => TRANSFORM_FAILED,
        _ => ARTIFACT_FAILED,
    }
}

/// The status this controller writes: `observedGeneration`, the artifact and the `Ready`,
/// `Reconciling` and `Stalled` conditions, with their times kept from `current` when nothing
/// they date changed.
fn desired_status(
    current: &ProgramStatus,
    generation: i64,
    artifact: Option<Artifact>,
    ready: &Ready,
) -> ProgramStatus {
    let artifact = artifact.map(|mut artifact| {
        // lastUpdateTime moves only when the artifact itself changes (a URL re-signed with a
        // new key is the same artifact).
        if let Some(old) = &current.artifact
            && same_bytes(old, &artifact)
        {
            artifact.last_update_time = old.last_update_time.clone();
        }
        artifact
    });
    // Only Ready, Reconciling and Stalled are this field manager's: other conditions stay out
    // of the apply (and one it leaves out of the apply is removed).
    let mut list: Vec<Condition> = owned(&current.conditions).cloned().collect();
    conditions::set(
        &mut list,
        READY,
        ready.status,
        &ready.reason,
        &ready.message,
        Some(generation),
    );
    // kstatus's conditions are present only while true (abnormal-true).
    let (reconciling, stalled) = match ready.progress {
        Progress::Done => (None, None),
        Progress::Retrying => (Some(RETRYING_BUILD), None),
        Progress::Stalled(reason) => (None, Some(reason)),
    };
    for (type_, reason) in [(RECONCILING, reconciling), (STALLED, stalled)] {
        match reason {
            Some(reason) => conditions::set(
                &mut list,
                type_,
                true,
                reason,
                &ready.message,
                Some(generation),
            ),
            None => conditions::remove(&mut list, type_),
        }
    }
    ProgramStatus {
        observed_generation: Some(generation),
        artifact,
        conditions: list,
    }
}

/// Whether writing `desired` would change nothing but timestamps (then nothing is written, so a
/// restart rewrites no Program).
fn unchanged(current: &ProgramStatus, desired: &ProgramStatus) -> bool {
    let artifact_same = match (&current.artifact, &desired.artifact) {
        (Some(old), Some(new)) => same_artifact(old, new),
        (None, None) => true,
        _ => false,
    };
    artifact_same
        && current.observed_generation == desired.observed_generation
        && conditions::same(
            &owned(&current.conditions).cloned().collect::<Vec<_>>(),
            &owned(&desired.conditions).cloned().collect::<Vec<_>>(),
        )
}

/// The conditions this controller writes (others are not its own).
fn owned(list: &[Condition]) -> impl Iterator<Item = &Condition> {
    list.iter()
        .filter(|c| [READY, RECONCILING, STALLED].contains(&c.type_.as_str()))
}

/// One applied transform in [`METADATA_APPLIED`] (field order is the wire order).
#[derive(Serialize)]
struct AppliedEntry<'a> {
    transform: &'a str,
    plugin: &'a str,
    module: &'a str,
    config: &'a str,
}

/// One skipped transform in [`METADATA_SKIPPED`] (field order is the wire order).
#[derive(Serialize)]
struct SkippedEntry<'a> {
    transform: &'a str,
    reason: &'a str,
    message: String,
}

/// `status.artifact.metadata` for an artifact built through transforms (`None` without).
fn chain_metadata(chain: &ChainReport) -> Result<Option<BTreeMap<String, String>>, ProgramError> {
    if chain.fingerprint.is_empty() {
        return Ok(None);
    }
    let mut map = BTreeMap::new();
    map.insert(METADATA_CHAIN.to_owned(), chain.fingerprint.clone());
    map.insert(METADATA_APPLIED.to_owned(), applied_json(&chain.applied)?);
    if !chain.skipped.is_empty() {
        map.insert(METADATA_SKIPPED.to_owned(), skipped_json(&chain.skipped)?);
    }
    Ok(Some(map))
}

fn applied_json(applied: &[Applied]) -> Result<String, ProgramError> {
    let entries: Vec<AppliedEntry<'_>> = applied
        .iter()
        .map(|a| AppliedEntry {
            transform: &a.id,
            plugin: &a.plugin,
            module: &a.module,
            config: &a.config,
        })
        .collect();
    serde_json::to_string(&entries).map_err(ProgramError::Encode)
}

fn skipped_json(skipped: &[Skipped]) -> Result<String, ProgramError> {
    let entries: Vec<SkippedEntry<'_>> = skipped
        .iter()
        .map(|s| SkippedEntry {
            transform: &s.id,
            reason: s.error.kind().camel(),
            message: truncate(&s.error.to_string(), 300),
        })
        .collect();
    serde_json::to_string(&entries).map_err(ProgramError::Encode)
}

/// Equal in every field except `lastUpdateTime`.
fn same_artifact(old: &Artifact, new: &Artifact) -> bool {
    same_bytes(old, new) && old.url == new.url
}

/// The same artifact, whatever its URL's token.
fn same_bytes(old: &Artifact, new: &Artifact) -> bool {
    old.path == new.path
        && old.revision == new.revision
        && old.digest == new.digest
        && old.size == new.size
        && old.metadata == new.metadata
}

#[cfg(test)]
mod tests {
    use pko_plugin_host::errors::PluginError;
    use serde_json::json;

    use super::*;

    fn time(text: &str) -> Time {
        Time(text.parse().unwrap())
    }

    fn artifact(digest: &str, url: &str, updated: &str) -> Artifact {
        Artifact {
            path: "programs/ns/p/3.tar.gz".into(),
            url: url.into(),
            revision: "3".into(),
            digest: Some(digest.into()),
            last_update_time: time(updated),
            size: Some(42),
            metadata: None,
        }
    }

    fn ready(status: bool, reason: &str) -> Ready {
        Ready {
            status,
            reason: reason.into(),
            message: format!("{reason} message"),
            progress: if status {
                Progress::Done
            } else {
                Progress::Stalled(ARTIFACT_FAILED)
            },
        }
    }

    fn condition(status: &str, reason: &str, generation: i64, since: &str) -> Condition {
        Condition {
            type_: READY.into(),
            status: status.into(),
            reason: reason.into(),
            message: format!("{reason} message"),
            observed_generation: Some(generation),
            last_transition_time: time(since),
        }
    }

    /// A status as this controller last wrote it for generation 3.
    fn written() -> ProgramStatus {
        ProgramStatus {
            observed_generation: Some(3),
            artifact: Some(artifact(
                "sha256:a",
                "http://x/a?t=1",
                "2025-01-01T00:00:00Z",
            )),
            conditions: vec![condition(
                "True",
                "ArtifactReady",
                3,
                "2025-01-01T00:00:00Z",
            )],
        }
    }

    #[test]
    fn the_same_outcome_again_is_unchanged_whatever_the_times() {
        let current = written();
        let fresh = artifact("sha256:a", "http://x/a?t=1", "2026-06-06T00:00:00Z");
        let desired = desired_status(&current, 3, Some(fresh), &ready(true, "ArtifactReady"));
        assert!(unchanged(&current, &desired));
        // Nothing it dates changed: both times are the old ones.
        assert_eq!(desired, current);
    }

    #[test]
    fn a_resigned_url_is_written_but_keeps_the_artifact_time() {
        let current = written();
        let fresh = artifact("sha256:a", "http://x/a?t=2", "2026-06-06T00:00:00Z");
        let desired = desired_status(&current, 3, Some(fresh), &ready(true, "ArtifactReady"));
        assert!(!unchanged(&current, &desired));
        let artifact = desired.artifact.as_ref().unwrap();
        assert_eq!(artifact.url, "http://x/a?t=2");
        assert_eq!(artifact.last_update_time, time("2025-01-01T00:00:00Z"));
    }

    #[test]
    fn new_bytes_are_dated_now() {
        let current = written();
        let fresh = artifact("sha256:b", "http://x/b?t=1", "2026-06-06T00:00:00Z");
        let desired = desired_status(&current, 3, Some(fresh), &ready(true, "ArtifactReady"));
        assert!(!unchanged(&current, &desired));
        let artifact = desired.artifact.as_ref().unwrap();
        assert_eq!(artifact.last_update_time, time("2026-06-06T00:00:00Z"));
        // Ready stayed True: its transition time is kept.
        assert_eq!(
            desired.conditions[0].last_transition_time,
            time("2025-01-01T00:00:00Z")
        );
    }

    #[test]
    fn a_failure_keeps_the_artifact_and_moves_the_transition_time() {
        let current = written();
        let desired = desired_status(
            &current,
            4,
            current.artifact.clone(),
            &ready(false, "ArtifactFailed"),
        );
        assert!(!unchanged(&current, &desired));
        assert_eq!(desired.artifact, current.artifact);
        assert_eq!(desired.observed_generation, Some(4));
        let ready = &desired.conditions[0];
        assert_eq!(
            (ready.status.as_str(), ready.reason.as_str()),
            ("False", "ArtifactFailed")
        );
        assert_eq!(ready.observed_generation, Some(4));
        assert!(ready.last_transition_time > time("2025-01-01T00:00:00Z"));
    }

    fn kstatus(status: &ProgramStatus) -> Vec<(String, String, String)> {
        let mut out: Vec<_> = status
            .conditions
            .iter()
            .filter(|c| c.type_ != READY)
            .map(|c| (c.type_.clone(), c.status.clone(), c.reason.clone()))
            .collect();
        out.sort();
        out
    }

    #[test]
    fn a_failure_stalls_or_reconciles_and_a_success_clears_both() {
        let current = written();
        let stalled = desired_status(
            &current,
            4,
            current.artifact.clone(),
            &ready(false, "ArtifactFailed"),
        );
        assert_eq!(
            kstatus(&stalled),
            vec![("Stalled".into(), "True".into(), ARTIFACT_FAILED.into())]
        );
        let c = conditions::get(&stalled.conditions, STALLED).unwrap();
        assert_eq!(
            (c.message.as_str(), c.observed_generation),
            ("ArtifactFailed message", Some(4))
        );
        // The same failure again: nothing to write.
        let again = desired_status(
            &stalled,
            4,
            current.artifact.clone(),
            &ready(false, "ArtifactFailed"),
        );
        assert!(unchanged(&stalled, &again));

        let retrying = desired_status(
            &stalled,
            4,
            current.artifact.clone(),
            &Ready {
                progress: Progress::Retrying,
                ..ready(false, "TransformTimeout")
            },
        );
        assert!(!unchanged(&stalled, &retrying));
        assert_eq!(
            kstatus(&retrying),
            vec![("Reconciling".into(), "True".into(), RETRYING_BUILD.into())]
        );

        let fixed = desired_status(
            &retrying,
            5,
            current.artifact.clone(),
            &ready(true, "ArtifactReady"),
        );
        assert_eq!(kstatus(&fixed), vec![]);
        assert!(!unchanged(&retrying, &fixed));
    }

    #[test]
    fn failures_are_told_apart_by_whether_retrying_helps() {
        use pko_plugin_host::chain::StepFailure;
        let transient = BuildError::Transform(StepFailure {
            id: "ns/t".into(),
            error: PluginError::Timeout(Duration::from_secs(1)),
        });
        let refused = BuildError::Transform(StepFailure {
            id: "ns/t".into(),
            error: PluginError::Rejected("no".into()),
        });
        assert_eq!(ready_of_failure(2, &transient).progress, Progress::Retrying);
        assert_eq!(
            ready_of_failure(2, &refused).progress,
            Progress::Stalled(TRANSFORM_FAILED)
        );
    }

    #[test]
    fn a_first_status_has_every_field() {
        let current = ProgramStatus::default();
        let fresh = artifact("sha256:a", "http://x/a?t=1", "2026-06-06T00:00:00Z");
        let desired = desired_status(&current, 1, Some(fresh), &ready(true, "ArtifactReady"));
        assert!(!unchanged(&current, &desired));
        assert_eq!(desired.observed_generation, Some(1));
        assert_eq!(desired.conditions.len(), 1);
        assert_eq!(desired.conditions[0].observed_generation, Some(1));
    }

    #[test]
    fn unchanged_needs_every_owned_field_current() {
        let base = written();
        let desired = base.clone();
        assert!(unchanged(&base, &desired));

        let mut stale = base.clone();
        stale.observed_generation = Some(2);
        assert!(!unchanged(&stale, &desired));

        let mut stale = base.clone();
        stale.conditions[0].observed_generation = Some(2);
        assert!(!unchanged(&stale, &desired));

        let mut stale = base.clone();
        stale.conditions[0].message = "other".into();
        assert!(!unchanged(&stale, &desired));

        let mut stale = base.clone();
        stale.conditions.clear();
        assert!(!unchanged(&stale, &desired));

        let mut stale = base.clone();
        stale.artifact = None;
        assert!(!unchanged(&stale, &desired));
        assert!(!unchanged(&base, &stale));

        let mut stale = base.clone();
        if let Some(a) = stale.artifact.as_mut() {
            a.metadata = Some(BTreeMap::from([(METADATA_CHAIN.into(), "f".into())]));
        }
        assert!(!unchanged(&stale, &desired));

        // Only times differ: nothing to write.
        let mut older = base.clone();
        older.conditions[0].last_transition_time = time("2020-01-01T00:00:00Z");
        if let Some(a) = older.artifact.as_mut() {
            a.last_update_time = time("2020-01-01T00:00:00Z");
        }
        assert!(unchanged(&older, &desired));

        // A condition of another type is not this controller's to compare (or to write).
        let mut other = base.clone();
        other.conditions.insert(
            0,
            Condition {
                type_: "Other".into(),
                ..condition("False", "X", 1, "2020-01-01T00:00:00Z")
            },
        );
        assert!(unchanged(&other, &desired));
        let rewritten = desired_status(
            &other,
            3,
            base.artifact.clone(),
            &ready(true, "ArtifactReady"),
        );
        assert_eq!(rewritten.conditions.len(), 1);
        assert_eq!(rewritten.conditions[0].type_, READY);
    }

    #[test]
    fn the_patch_sets_what_it_set_before() {
        let status = written();
        let body = serde_json::to_value(kit::StatusPatch::new::<Program>(&status)).unwrap();
        assert_eq!(
            body,
            json!({
                "apiVersion": "pulumi.com/v1",
                "kind": "Program",
                "status": {
                    "observedGeneration": 3,
                    "conditions": [{
                        "type": "Ready",
                        "status": "True",
                        "reason": "ArtifactReady",
                        "message": "ArtifactReady message",
                        "observedGeneration": 3,
                        "lastTransitionTime": "2025-01-01T00:00:00Z",
                    }],
                    "artifact": {
                        "path": "programs/ns/p/3.tar.gz",
                        "url": "http://x/a?t=1",
                        "revision": "3",
                        "digest": "sha256:a",
                        "size": 42,
                        "lastUpdateTime": "2025-01-01T00:00:00Z",
                    },
                },
            })
        );
        // Without an artifact, none is sent (the field stays the previous owner's business).
        let bare = ProgramStatus {
            artifact: None,
            ..written()
        };
        let body = serde_json::to_value(kit::StatusPatch::new::<Program>(&bare)).unwrap();
        assert!(body["status"].get("artifact").is_none());
    }

    #[test]
    fn chain_metadata_strings_keep_their_format() {
        let chain = ChainReport {
            fingerprint: "fp".into(),
            applied: vec![Applied {
                id: "ns/t".into(),
                plugin: "p 1.0".into(),
                module: "sha256:m".into(),
                config: "sha256:c".into(),
                warnings: vec!["w".into()],
                fuel: 7,
            }],
            skipped: vec![Skipped {
                id: "ns/u".into(),
                error: PluginError::Rejected("no".into()),
            }],
        };
        let metadata = chain_metadata(&chain).unwrap().unwrap();
        assert_eq!(metadata[METADATA_CHAIN], "fp");
        // Compared byte for byte on every reconcile: any change rewrites every Program.
        assert_eq!(
            metadata[METADATA_APPLIED],
            r#"[{"transform":"ns/t","plugin":"p 1.0","module":"sha256:m","config":"sha256:c"}]"#
        );
        assert_eq!(
            metadata[METADATA_SKIPPED],
            r#"[{"transform":"ns/u","reason":"Rejected","message":"rejected: no"}]"#
        );
        // The same text as the json! form it replaced.
        let a = &chain.applied[0];
        let old = serde_json::Value::Array(vec![json!({
            "transform": a.id, "plugin": a.plugin, "module": a.module, "config": a.config,
        })]);
        assert_eq!(metadata[METADATA_APPLIED], old.to_string());

        let plain = ChainReport::default();
        assert_eq!(chain_metadata(&plain).unwrap(), None);
        let nothing_skipped = ChainReport {
            skipped: vec![],
            ..chain
        };
        let metadata = chain_metadata(&nothing_skipped).unwrap().unwrap();
        assert!(!metadata.contains_key(METADATA_SKIPPED));
    }

    fn stored(generation: i64, status: Option<ProgramStatus>) -> Program {
        let mut p = Program::new("p", pko_api::program::ProgramSpec::default());
        p.metadata.generation = Some(generation);
        p.status = status;
        p
    }

    #[test]
    fn after_a_failed_write_the_apiservers_status_is_compared() {
        let written = ProgramStatus {
            observed_generation: Some(3),
            artifact: Some(artifact("sha256:a", "u", "2025-01-01T00:00:00Z")),
            ..ProgramStatus::default()
        };
        assert_eq!(
            reread_status(3, Some(stored(3, Some(written.clone())))),
            Reread::Compare(written)
        );
        assert_eq!(
            reread_status(3, Some(stored(3, None))),
            Reread::Compare(ProgramStatus::default())
        );
        assert_eq!(reread_status(3, None), Reread::Gone);
        // Never an older generation's status written over a newer one.
        assert_eq!(reread_status(3, Some(stored(4, None))), Reread::StoreBehind);
    }
}
