//! The replica's one view of Programs: a watch-fed reflector plus the artifact cache.
//!
//! Every replica runs one watch of Programs. Its store feeds both the file server and, on the
//! leader, the Program controller ([`ProgramIndex::triggers`]), so a generation the controller
//! has published is one the file server has seen: no second copy of every Program, and no window
//! where a freshly published URL answers 404. A replica whose watch lags (a standby) waits a
//! bounded time for it ([`ProgramIndex::lookup_published`]). Artifacts being deterministic, every
//! replica serves the bytes whose digest the leader wrote to the Program's status.
//!
//! With transforms, an artifact is a pure function of the Program's spec and its transform chain
//! (transform names, module digests, configurations, limits): the cache key carries the chain's
//! fingerprint, so a changed chain never serves stale bytes, and every replica computes the same
//! chain from the same objects.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures::{Stream, StreamExt, TryStreamExt};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::runtime::reflector::{self, ObjectRef, Store};
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Api, ResourceExt};
use pko_api::decode::is_pko_manager;
use pko_api::program::ProgramSpec;
use pko_plugin_host::chain::{self, Chain, StepFailure};
use tokio::sync::{OnceCell, Semaphore, broadcast, watch as notify};
use tracing::{debug, warn};

pub use super::built::{Built, ChainReport};
use super::cache::{ArtifactCache, CacheKey};
use super::stored::{StoredError, StoredProgram};
use crate::artifact::{self, ArtifactError};
use crate::metrics::{Metrics, PublishWaitOutcome};
use crate::transform::{TransformError, TransformRegistry};

/// Artifacts pre-built at once after Program events.
const PREBUILDS: usize = 4;
/// How long a failure that may not recur (a timeout, a busy host) is remembered.
const TRANSIENT_FAILURE_TTL: Duration = Duration::from_secs(10);
/// Failures remembered at most (they are small; the bound only guards against churn).
const MAX_FAILURES: usize = 10_000;
/// How long a request for a Program, or a generation, that this replica has not seen yet waits
/// for the replica's watch before the answer is 404: longer than a watch event takes to arrive
/// under load, short enough that a wrong URL fails fast.
pub const PUBLISH_WAIT: Duration = Duration::from_secs(2);
/// Requests waiting for the watch at once; more are answered at once, so strangers asking for
/// Programs that do not exist cannot pile up waiting connections.
const MAX_WAITERS: usize = 1024;
/// Program changes queued for the controller; one that falls behind reconciles every Program.
const TRIGGER_BUFFER: usize = 4096;

/// What the replica's Program watch tells the controller.
#[derive(Clone, Debug)]
enum Change {
    /// A Program was created or changed (the store already holds it).
    Applied(ObjectRef<StoredProgram>),
    /// The store was (re)filled from a full list: every Program may have changed.
    Resynced,
}

/// Why an artifact cannot be built.
#[derive(Debug, thiserror::Error)]
pub enum BuildError {
    #[error(transparent)]
    Artifact(#[from] ArtifactError),
    /// A transform failed under `failurePolicy: Fail`.
    #[error("transform {0}")]
    Transform(StepFailure),
    #[error(transparent)]
    Transforms(#[from] TransformError),
    #[error(transparent)]
    Spec(#[from] StoredError),
}

impl BuildError {
    /// The same build may succeed later (a timeout, a busy host, transforms not synced yet).
    pub fn is_transient(&self) -> bool {
        match self {
            Self::Artifact(_) | Self::Spec(_) => false,
            Self::Transform(failure) => failure.error.kind().is_transient(),
            Self::Transforms(_) => true,
        }
    }
}

/// The outcome of a build, shared by everyone who asked for it.
pub type BuildResult = Result<Arc<Built>, Arc<BuildError>>;

/// The outcome of looking up one generation of one Program.
#[derive(Debug)]
pub enum Lookup {
    Found(Arc<Built>),
    /// No Program of that name in that namespace.
    ProgramNotFound,
    /// The Program exists but has moved past this generation.
    Superseded {
        current: i64,
    },
    /// The Program exists but has not reached this generation (or this replica has not seen it).
    UnknownGeneration {
        current: i64,
    },
    /// The Program's artifact cannot be built.
    Failed(Arc<BuildError>),
}

impl Lookup {
    /// This replica may simply not have seen the Program, or this generation, yet.
    fn not_seen_yet(&self) -> bool {
        matches!(self, Self::ProgramNotFound | Self::UnknownGeneration { .. })
    }
}

/// Programs known to this replica, and their artifacts.
pub struct ProgramIndex {
    store: Store<StoredProgram>,
    cache: ArtifactCache,
    synced: Arc<AtomicBool>,
    metrics: Metrics,
    transforms: Option<Arc<TransformRegistry>>,
    /// Builds in progress: concurrent requests for one key share one build.
    inflight: Mutex<HashMap<CacheKey, Arc<OnceCell<BuildResult>>>>,
    /// Recent failures, so a failing Program does not run its plugins on every request.
    failures: Mutex<HashMap<CacheKey, (Instant, Arc<BuildError>)>>,
    /// Bumped after every change of the store: wakes requests waiting for a Program.
    version: notify::Sender<u64>,
    /// Changes for the controller (see [`Self::triggers`]).
    changes: broadcast::Sender<Change>,
    /// Bounds the requests waiting for the watch.
    waiters: Semaphore,
    publish_wait: Duration,
}

impl ProgramIndex {
    pub fn new(store: Store<StoredProgram>, cache_bytes: u64, metrics: Metrics) -> Self {
        Self {
            store,
            cache: ArtifactCache::new(cache_bytes),
            synced: Arc::new(AtomicBool::new(false)),
            metrics,
            transforms: None,
            inflight: Mutex::new(HashMap::new()),
            failures: Mutex::new(HashMap::new()),
            version: notify::Sender::new(0),
            changes: broadcast::Sender::new(TRIGGER_BUFFER),
            waiters: Semaphore::new(MAX_WAITERS),
            publish_wait: PUBLISH_WAIT,
        }
    }

    /// How long [`Self::lookup_published`] waits for a Program this replica has not seen.
    pub fn with_publish_wait(mut self, wait: Duration) -> Self {
        self.publish_wait = wait;
        self
    }

    /// The Programs this replica knows (the one store of the replica).
    pub fn programs(&self) -> &Store<StoredProgram> {
        &self.store
    }

    /// The Programs to reconcile, for `Controller::for_shared_stream` over [`Self::programs`]:
    /// every Program once the store is filled, then each one the watch applies, and every one
    /// again after a re-list or when the controller falls behind. Each object comes from the
    /// store the file server answers from, so whatever the controller publishes is served.
    pub fn triggers(&self) -> impl Stream<Item = Arc<StoredProgram>> + Send + 'static {
        // Subscribe before reading the store, so no change falls between the two.
        let changes = self.changes.subscribe();
        let store = self.store.clone();
        let initial = {
            let (store, synced, mut version) =
                (store.clone(), self.synced.clone(), self.version.subscribe());
            futures::stream::once(async move {
                // Not `Store::wait_until_ready`: its readiness wakes only one of the tasks
                // waiting on it, and the controller itself waits on it too.
                while !synced.load(Ordering::Acquire) {
                    if version.changed().await.is_err() {
                        break;
                    }
                }
                oldest_first(store.state())
            })
        };
        let updates = futures::stream::unfold((changes, store), |(mut rx, store)| async move {
            let programs = match rx.recv().await {
                Ok(Change::Applied(key)) => store.get(&key).into_iter().collect(),
                Ok(Change::Resynced) | Err(broadcast::error::RecvError::Lagged(_)) => {
                    oldest_first(store.state())
                }
                Err(broadcast::error::RecvError::Closed) => return None,
            };
            Some((programs, (rx, store)))
        });
        initial.chain(updates).flat_map(futures::stream::iter)
    }

    /// Runs each Program's transform chain before building its artifact.
    pub fn with_transforms(mut self, transforms: Option<Arc<TransformRegistry>>) -> Self {
        self.transforms = transforms;
        self
    }

    /// The transforms, when plugins are enabled.
    pub fn transforms(&self) -> Option<&Arc<TransformRegistry>> {
        self.transforms.as_ref()
    }

    /// True once the initial list of Programs has been received.
    pub fn is_synced(&self) -> bool {
        self.synced.load(Ordering::Acquire)
    }

    /// The flag behind [`Self::is_synced`], for readiness checks.
    pub fn synced_flag(&self) -> Arc<AtomicBool> {
        self.synced.clone()
    }

    /// Like [`Self::lookup`], but a Program or generation this replica has not seen yet is
    /// waited for (at most the publish wait) before it is answered as unknown: the controller
    /// may have published it from a replica whose watch is ahead of this one.
    pub async fn lookup_published(&self, namespace: &str, name: &str, generation: i64) -> Lookup {
        // Subscribed before the first look, so a change in between still wakes us.
        let mut version = self.version.subscribe();
        let first = self.lookup(namespace, name, generation).await;
        if !first.not_seen_yet() || self.publish_wait.is_zero() {
            return first;
        }
        let Ok(_permit) = self.waiters.try_acquire() else {
            self.record_wait(PublishWaitOutcome::Overflow, Duration::ZERO);
            return first;
        };
        let started = Instant::now();
        let deadline = tokio::time::Instant::now() + self.publish_wait;
        loop {
            let changed = tokio::time::timeout_at(deadline, version.changed()).await;
            let found = self.lookup(namespace, name, generation).await;
            if !found.not_seen_yet() {
                self.record_wait(PublishWaitOutcome::Seen, started.elapsed());
                return found;
            }
            if !matches!(changed, Ok(Ok(()))) {
                self.record_wait(PublishWaitOutcome::NotSeen, started.elapsed());
                return found;
            }
        }
    }

    fn record_wait(&self, outcome: PublishWaitOutcome, waited: Duration) {
        self.metrics
            .fileserver_publish_waits
            .get_or_create(&outcome.labels())
            .inc();
        if outcome != PublishWaitOutcome::Overflow {
            self.metrics
                .fileserver_publish_wait_duration
                .observe(waited.as_secs_f64());
        }
    }

    /// Look up the artifact of `namespace/name` at `generation`, building it on a cache miss.
    pub async fn lookup(&self, namespace: &str, name: &str, generation: i64) -> Lookup {
        let key = ObjectRef::<StoredProgram>::new(name).within(namespace);
        let Some(program) = self.store.get(&key) else {
            return Lookup::ProgramNotFound;
        };
        let current = program.metadata.generation.unwrap_or(0);
        if generation < current {
            return Lookup::Superseded { current };
        }
        if generation > current {
            return Lookup::UnknownGeneration { current };
        }
        match self.artifact_for(program).await {
            Ok(artifact) => Lookup::Found(artifact),
            Err(err) => Lookup::Failed(err),
        }
    }

    /// The artifact of the Program's current generation, from the cache or freshly built.
    pub async fn artifact_for(&self, program: Arc<StoredProgram>) -> BuildResult {
        let chain = match &self.transforms {
            Some(transforms) => transforms
                .chain_for(&program)
                .await
                .map_err(|e| Arc::new(BuildError::from(e)))?,
            None => Chain::default(),
        };
        let key = cache_key(&program, &chain);
        if let Some(hit) = self.cache.get(&key) {
            self.metrics.fileserver_cache_hits.inc();
            return Ok(hit);
        }
        if let Some(failure) = self.recent_failure(&key) {
            return Err(failure);
        }
        self.metrics.fileserver_cache_misses.inc();
        let cell = lock(&self.inflight).entry(key.clone()).or_default().clone();
        let host = self.transforms.as_ref().map(|t| t.host().clone());
        let result = cell
            .get_or_init(|| async move {
                build_stored(&program, &chain, host.as_ref())
                    .await
                    .map(Arc::new)
                    .map_err(Arc::new)
            })
            .await
            .clone();
        {
            let mut inflight = lock(&self.inflight);
            if inflight.get(&key).is_some_and(|c| Arc::ptr_eq(c, &cell)) {
                inflight.remove(&key);
            }
        }
        match &result {
            // A result with a transform skipped for a transient reason is not kept: the next
            // request builds again and may get the full chain.
            Ok(built) if !built.chain.transient() => {
                self.cache.insert(key, built.clone());
                self.metrics
                    .fileserver_cache_bytes
                    .set(i64::try_from(self.cache.bytes()).unwrap_or(i64::MAX));
            }
            Ok(_) => {}
            Err(err) => {
                let mut failures = lock(&self.failures);
                if failures.len() >= MAX_FAILURES {
                    failures.clear();
                }
                failures.insert(key, (Instant::now(), err.clone()));
            }
        }
        result
    }

    fn recent_failure(&self, key: &CacheKey) -> Option<Arc<BuildError>> {
        let mut failures = lock(&self.failures);
        let (at, err) = failures.get(key)?;
        if err.is_transient() && at.elapsed() > TRANSIENT_FAILURE_TTL {
            failures.remove(key);
            return None;
        }
        Some(err.clone())
    }

    /// Has the controller reconcile every Program (e.g. their URLs need signing anew).
    pub fn resync(&self) {
        let _ = self.changes.send(Change::Resynced);
    }

    /// Requests waiting for the watch now.
    pub fn waiting(&self) -> usize {
        MAX_WAITERS - self.waiters.available_permits()
    }

    /// Whether the controller must see `event`, judged before the store applies it (so the
    /// store still holds the previous version). See [`reconcile_needed`].
    fn needs_reconcile(&self, event: &watcher::Event<StoredProgram>) -> bool {
        match event {
            watcher::Event::Apply(program) => {
                let old = self.store.get(&ObjectRef::from_obj(program));
                reconcile_needed(old.as_deref(), program)
            }
            _ => true,
        }
    }

    /// Takes note of a watch event the store has just applied (tests feed the index by hand).
    #[cfg(test)]
    pub(crate) fn observe(&self, event: &watcher::Event<StoredProgram>) {
        self.observe_judged(event, true);
    }

    /// [`Self::observe`], with the verdict of [`Self::needs_reconcile`]: an applied Program
    /// reaches the controller only when it must.
    fn observe_judged(&self, event: &watcher::Event<StoredProgram>, needs_reconcile: bool) {
        // The store already holds this event (the reflector wrote it before us).
        match event {
            watcher::Event::Delete(program) => {
                if let Some(uid) = program.uid() {
                    self.cache.remove_uid(&uid);
                    lock(&self.failures).retain(|k, _| k.uid != uid);
                }
                if let Some(transforms) = &self.transforms {
                    transforms.forget(&ObjectRef::from_obj(program));
                }
            }
            watcher::Event::Apply(program) | watcher::Event::InitApply(program) => {
                if let Some(uid) = program.uid() {
                    let generation = program.metadata.generation.unwrap_or(0);
                    self.cache.retain_generation(&uid, generation);
                    lock(&self.failures).retain(|k, _| k.uid != uid || k.generation == generation);
                }
                // Objects of a (re)list reach the controller with `InitDone`, all at once.
                if matches!(event, watcher::Event::Apply(_)) && needs_reconcile {
                    let _ = self
                        .changes
                        .send(Change::Applied(ObjectRef::from_obj(program)));
                }
            }
            watcher::Event::InitDone => {
                self.synced.store(true, Ordering::Release);
                let _ = self.changes.send(Change::Resynced);
            }
            watcher::Event::Init => {}
        }
        self.metrics
            .programs_active
            .set(i64::try_from(self.store.len()).unwrap_or(i64::MAX));
        self.metrics
            .fileserver_cache_bytes
            .set(i64::try_from(self.cache.bytes()).unwrap_or(i64::MAX));
        // Last: whoever wakes on it sees the store and the synced flag of this event.
        self.version.send_modify(|v| *v = v.wrapping_add(1));
    }
}

/// Programs in the order they were created (then by name), so a controller serving them first
/// come, first served after a (re)list makes no Program wait behind later ones.
fn oldest_first(mut programs: Vec<Arc<StoredProgram>>) -> Vec<Arc<StoredProgram>> {
    fn key(
        p: &StoredProgram,
    ) -> (
        Option<k8s_openapi::jiff::Timestamp>,
        Option<&str>,
        Option<&str>,
    ) {
        let meta = &p.metadata;
        let created = meta.creation_timestamp.as_ref().map(|t| t.0);
        (created, meta.namespace.as_deref(), meta.name.as_deref())
    }
    programs.sort_by(|a, b| key(a).cmp(&key(b)));
    programs
}

/// Whether a change of a Program, from `old` (as the store held it) to `new`, can change what the
/// controller writes: another object under the same name, a new generation (the spec), labels
/// (they select transforms), deletion, or a write by one of PKO's field managers (its fields
/// are the controller's to take over, `controller/takeover.rs`). Status and other metadata are
/// left out, so the controller's own status writes never re-queue their Program.
pub(crate) fn reconcile_needed(old: Option<&StoredProgram>, new: &StoredProgram) -> bool {
    let Some(old) = old else { return true };
    old.metadata.uid != new.metadata.uid
        || old.metadata.generation != new.metadata.generation
        || old.metadata.labels != new.metadata.labels
        || old.metadata.deletion_timestamp != new.metadata.deletion_timestamp
        || pko_wrote(&old.metadata, &new.metadata)
}

/// Whether `new` carries an entry of PKO's managers that `old` did not have as it is (a write
/// of PKO's since: its entry's time moves with each write). Entries that only went away (taken
/// over) need nothing, so a takeover never re-queues its own Program.
fn pko_wrote(old: &ObjectMeta, new: &ObjectMeta) -> bool {
    let pkos = |meta: &ObjectMeta| {
        meta.managed_fields
            .iter()
            .flatten()
            .filter(|e| e.manager.as_deref().is_some_and(is_pko_manager))
            .map(|e| {
                (
                    e.manager.clone(),
                    e.operation.clone(),
                    e.subresource.clone(),
                    e.time.clone(),
                )
            })
            .collect::<Vec<_>>()
    };
    let before = pkos(old);
    pkos(new).iter().any(|entry| !before.contains(entry))
}

/// Builds the artifact of a stored Program: its spec is parsed from the stored text here, once
/// per generation (the cache answers after that).
async fn build_stored(
    program: &StoredProgram,
    chain: &Chain,
    host: Option<&pko_plugin_host::PluginHost>,
) -> Result<Built, BuildError> {
    let spec = program.spec()?;
    build_program(&program.metadata, spec, chain, host).await
}

/// The one function that turns a Program into its artifact, used by the controller (for the
/// digest in status) and by the file server (for the bytes it serves): the chain runs over the
/// spec, then the result is rendered and packed.
pub async fn build_program(
    meta: &ObjectMeta,
    spec: ProgramSpec,
    chain: &Chain,
    host: Option<&pko_plugin_host::PluginHost>,
) -> Result<Built, BuildError> {
    let name = meta.name.clone().unwrap_or_default();
    let (spec, report) = match host {
        Some(host) if !chain.is_empty() => {
            let namespace = meta.namespace.clone().unwrap_or_default();
            let labels = meta.labels.clone().unwrap_or_default();
            let out = chain::run(host, chain, &namespace, &name, &labels, &spec)
                .await
                .map_err(BuildError::Transform)?;
            let report = ChainReport {
                fingerprint: chain.fingerprint(),
                applied: out.applied,
                skipped: out.skipped,
            };
            (out.spec, report)
        }
        _ => (spec, ChainReport::default()),
    };
    // Building a large Program takes milliseconds of CPU: keep it off the async workers.
    let artifact = tokio::task::spawn_blocking(move || artifact::build_typed(&name, &spec))
        .await
        .unwrap_or_else(|join| Err(ArtifactError::Archive(std::io::Error::other(join))))?;
    Ok(Built {
        artifact,
        chain: report,
    })
}

fn cache_key(program: &StoredProgram, chain: &Chain) -> CacheKey {
    CacheKey {
        uid: program.uid().unwrap_or_default(),
        generation: program.metadata.generation.unwrap_or(0),
        chain: chain.fingerprint(),
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    // The maps stay consistent even if a holder panicked; keep going with them.
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// Settings of the replica's Program index.
#[derive(Clone, Copy, Debug)]
pub struct IndexOptions {
    /// Bytes of built artifacts kept in memory.
    pub cache_bytes: u64,
    /// See [`ProgramIndex::lookup_published`].
    pub publish_wait: Duration,
}

/// Start watching Programs through `apis` (one per watched namespace, or one cluster-wide, see
/// [`crate::scope`]), into one store. Returns the index and the future that drives the watch;
/// the caller spawns it. Applied Programs are pre-built so requests are served from memory.
/// With `transforms`, each Program's chain runs before its artifact is built.
pub fn watch(
    apis: Vec<Api<StoredProgram>>,
    options: IndexOptions,
    metrics: Metrics,
    transforms: Option<Arc<TransformRegistry>>,
) -> (Arc<ProgramIndex>, impl std::future::Future<Output = ()>) {
    let (store, writer) = reflector::store::<StoredProgram>();
    if let Some(transforms) = &transforms {
        transforms.attach_programs(store.clone());
    }
    let index = Arc::new(
        ProgramIndex::new(store, options.cache_bytes, metrics)
            .with_publish_wait(options.publish_wait)
            .with_transforms(transforms),
    );
    // Pre-builds run beside the watch, a few at a time: a slow chain never holds up the
    // store (and so the file server's view of Programs).
    let prebuilds = Arc::new(tokio::sync::Semaphore::new(PREBUILDS));
    let driver = {
        let index = index.clone();
        async move {
            // Judged before the store applies an event, used after: one task runs both.
            let needs = Arc::new(AtomicBool::new(true));
            let events = crate::scope::merged_watch(
                apis,
                watcher::Config::default().any_semantic(),
                crate::scope::Known::Store(index.store.clone()),
            )
            // managedFields are often the largest part of a small object: drop them before
            // they reach the store, but for PKO's, which the Program controller takes over
            // after a switch-over (controller/takeover.rs).
            .modify(|program| {
                program
                    .managed_fields_mut()
                    .retain(|e| e.manager.as_deref().is_some_and(is_pko_manager));
            })
            .inspect_ok({
                let (index, needs) = (index.clone(), needs.clone());
                move |event| needs.store(index.needs_reconcile(event), Ordering::Relaxed)
            })
            .reflect(writer)
            .inspect_ok({
                let (index, needs) = (index.clone(), needs.clone());
                move |event| index.observe_judged(event, needs.load(Ordering::Relaxed))
            })
            // A status write changes no artifact: nothing to pre-build. A pre-build waiting
            // for its turn holds the name and generation only: the store has the object.
            .try_filter_map(|event| {
                let program = match event {
                    watcher::Event::Apply(p) if needs.load(Ordering::Relaxed) => Some(p),
                    watcher::Event::InitApply(p) => Some(p),
                    _ => None,
                };
                let wanted = program.map(|p| (ObjectRef::from_obj(&p), p.metadata.generation));
                std::future::ready(Ok(wanted))
            });
            let mut events = std::pin::pin!(events);
            loop {
                match events.try_next().await {
                    Ok(Some((key, generation))) => {
                        let index = index.clone();
                        let prebuilds = prebuilds.clone();
                        tokio::spawn(async move {
                            let Ok(_permit) = prebuilds.acquire().await else {
                                return;
                            };
                            // Skip generations superseded (or Programs deleted) while waiting.
                            let Some(program) = index
                                .store
                                .get(&key)
                                .filter(|p| p.metadata.generation == generation)
                            else {
                                return;
                            };
                            if let Err(err) = index.artifact_for(program).await {
                                // Served as an error with this reason; the controller reports it too.
                                debug!(program = %key, error = %err, "artifact cannot be built");
                            }
                        });
                    }
                    Ok(None) => break,
                    Err(err) => warn!(error = %err, "program watch failed; retrying"),
                }
            }
        }
    };
    (index, driver)
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
    use pko_api::program::{Program, ProgramSpec, ProgramStatus};

    use super::*;

    fn program(generation: i64) -> StoredProgram {
        let mut p = Program::new("p", ProgramSpec::default());
        p.metadata.namespace = Some("ns".into());
        p.metadata.generation = Some(generation);
        p.metadata.uid = Some("uid-1".into());
        p.metadata.resource_version = Some("10".into());
        StoredProgram::from_program(&p).unwrap()
    }

    #[test]
    fn own_status_writes_do_not_need_a_reconcile() {
        let old = program(3);
        let mut new = old.clone();
        new.status = Some(ProgramStatus {
            observed_generation: Some(3),
            ..ProgramStatus::default()
        });
        new.metadata.resource_version = Some("11".into());
        new.metadata.annotations = Some(BTreeMap::from([("a".into(), "b".into())]));
        assert!(!reconcile_needed(Some(&old), &new));
    }

    #[test]
    fn spec_labels_identity_and_deletion_need_a_reconcile() {
        let old = program(3);
        assert!(reconcile_needed(None, &old));
        assert!(reconcile_needed(Some(&old), &program(4)));

        let mut labelled = old.clone();
        labelled.metadata.labels = Some(BTreeMap::from([("team".into(), "a".into())]));
        assert!(reconcile_needed(Some(&old), &labelled));
        assert!(reconcile_needed(Some(&labelled), &old));

        let mut recreated = old.clone();
        recreated.metadata.uid = Some("uid-2".into());
        assert!(reconcile_needed(Some(&old), &recreated));

        let mut deleted = old.clone();
        deleted.metadata.deletion_timestamp = Some(Time(k8s_openapi::jiff::Timestamp::UNIX_EPOCH));
        assert!(reconcile_needed(Some(&old), &deleted));
    }

    fn pko_entry(time: i64) -> k8s_openapi::apimachinery::pkg::apis::meta::v1::ManagedFieldsEntry {
        k8s_openapi::apimachinery::pkg::apis::meta::v1::ManagedFieldsEntry {
            manager: Some("pulumi-kubernetes-operator/program-status".into()),
            operation: Some("Apply".into()),
            subresource: Some("status".into()),
            time: Some(Time(
                k8s_openapi::jiff::Timestamp::from_second(time).unwrap(),
            )),
            ..Default::default()
        }
    }

    #[test]
    fn a_write_of_pkos_needs_a_reconcile_and_its_takeover_does_not() {
        let old = program(3);
        // PKO's status writer applies after the store had the Program (PKO still stopping
        // while pko-rs starts): its entry is to be taken over.
        let mut written = old.clone();
        written.metadata.managed_fields = Some(vec![pko_entry(1)]);
        assert!(reconcile_needed(Some(&old), &written));
        // It writes again: a new time.
        let mut again = written.clone();
        again.metadata.managed_fields = Some(vec![pko_entry(2)]);
        assert!(reconcile_needed(Some(&written), &again));
        // Our own status write leaves PKO's entry as it was; the takeover removes it.
        assert!(!reconcile_needed(Some(&again), &again.clone()));
        assert!(!reconcile_needed(Some(&again), &old));
        // Anyone else's entry is no reason (the store keeps PKO's only, but the rule says so).
        let mut kubectl = old.clone();
        let mut entry = pko_entry(3);
        entry.manager = Some("kubectl".into());
        kubectl.metadata.managed_fields = Some(vec![entry]);
        assert!(!reconcile_needed(Some(&old), &kubectl));
    }

    #[test]
    fn the_verdict_is_taken_against_the_store_before_it_applies_the_event() {
        let (store, mut writer) = reflector::store::<StoredProgram>();
        let index = ProgramIndex::new(store, 1 << 20, Metrics::new());
        let mut rx = index.changes.subscribe();

        // A new Program, then its own status write, then a new generation.
        let first = program(1);
        let mut written = first.clone();
        written.status = Some(ProgramStatus {
            observed_generation: Some(1),
            ..ProgramStatus::default()
        });
        for event in [first, written, program(2)].map(watcher::Event::Apply) {
            let needs = index.needs_reconcile(&event);
            writer.apply_watcher_event(&event);
            index.observe_judged(&event, needs);
        }
        let mut triggers = 0;
        while let Ok(change) = rx.try_recv() {
            assert!(matches!(change, Change::Applied(ref key) if key.name == "p"));
            triggers += 1;
        }
        // Creation and generation 2; not the status write.
        assert_eq!(triggers, 2);
    }
}
