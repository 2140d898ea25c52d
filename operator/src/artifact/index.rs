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
use kube::runtime::reflector::{self, ObjectRef, Store};
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Api, ResourceExt};
use pko_api::program::Program;
use pko_plugin_host::chain::{self, Chain, StepFailure};
use tokio::sync::{OnceCell, Semaphore, broadcast, watch as notify};
use tracing::{debug, warn};

pub use super::built::{Built, ChainReport};
use super::cache::{ArtifactCache, CacheKey};
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
    Applied(ObjectRef<Program>),
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
}

impl BuildError {
    /// The same build may succeed later (a timeout, a busy host, transforms not synced yet).
    pub fn is_transient(&self) -> bool {
        match self {
            Self::Artifact(_) => false,
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
    store: Store<Program>,
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
    pub fn new(store: Store<Program>, cache_bytes: u64, metrics: Metrics) -> Self {
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
    pub fn programs(&self) -> &Store<Program> {
        &self.store
    }

    /// The Programs to reconcile, for `Controller::for_shared_stream` over [`Self::programs`]:
    /// every Program once the store is filled, then each one the watch applies, and every one
    /// again after a re-list or when the controller falls behind. Each object comes from the
    /// store the file server answers from, so whatever the controller publishes is served.
    pub fn triggers(&self) -> impl Stream<Item = Arc<Program>> + Send + 'static {
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
                store.state()
            })
        };
        let updates = futures::stream::unfold((changes, store), |(mut rx, store)| async move {
            let programs = match rx.recv().await {
                Ok(Change::Applied(key)) => store.get(&key).into_iter().collect(),
                Ok(Change::Resynced) | Err(broadcast::error::RecvError::Lagged(_)) => store.state(),
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
        let key = ObjectRef::<Program>::new(name).within(namespace);
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
    pub async fn artifact_for(&self, program: Arc<Program>) -> BuildResult {
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
                build_program(&program, &chain, host.as_ref())
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

    /// Takes note of a watch event the store has just applied.
    pub(crate) fn observe(&self, event: &watcher::Event<Program>) {
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
                if matches!(event, watcher::Event::Apply(_)) {
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

/// The one function that turns a Program into its artifact, used by the controller (for the
/// digest in status) and by the file server (for the bytes it serves): the chain runs over the
/// spec, then the result is rendered and packed.
pub async fn build_program(
    program: &Program,
    chain: &Chain,
    host: Option<&pko_plugin_host::PluginHost>,
) -> Result<Built, BuildError> {
    let name = program.name_any();
    let (spec, report) = match host {
        Some(host) if !chain.is_empty() => {
            let namespace = program.namespace().unwrap_or_default();
            let out = chain::run(
                host,
                chain,
                &namespace,
                &name,
                program.labels(),
                &program.program,
            )
            .await
            .map_err(BuildError::Transform)?;
            let report = ChainReport {
                fingerprint: chain.fingerprint(),
                applied: out.applied,
                skipped: out.skipped,
            };
            (out.spec, report)
        }
        _ => (program.program.clone(), ChainReport::default()),
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

fn cache_key(program: &Program, chain: &Chain) -> CacheKey {
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

/// Start watching Programs cluster-wide. Returns the index and the future that drives the watch;
/// the caller spawns it. Applied Programs are pre-built so requests are served from memory.
/// With `transforms`, each Program's chain runs before its artifact is built.
pub fn watch(
    api: Api<Program>,
    options: IndexOptions,
    metrics: Metrics,
    transforms: Option<Arc<TransformRegistry>>,
) -> (Arc<ProgramIndex>, impl std::future::Future<Output = ()>) {
    let (store, writer) = reflector::store::<Program>();
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
            let events = watcher(api, watcher::Config::default().any_semantic())
                .default_backoff()
                // managedFields are often the largest part of a small object and nothing here
                // reads them: drop them before they reach the store.
                .modify(|program| program.managed_fields_mut().clear())
                .reflect(writer)
                .inspect_ok(|event| index.observe(event))
                .applied_objects();
            let mut events = std::pin::pin!(events);
            loop {
                match events.try_next().await {
                    Ok(Some(program)) => {
                        let index = index.clone();
                        let prebuilds = prebuilds.clone();
                        tokio::spawn(async move {
                            let Ok(_permit) = prebuilds.acquire().await else {
                                return;
                            };
                            // Skip generations superseded while waiting.
                            let key = ObjectRef::from_obj(&program);
                            let current = index.store.get(&key);
                            if current.as_ref().and_then(|p| p.metadata.generation)
                                != program.metadata.generation
                            {
                                return;
                            }
                            let name = program.name_any();
                            if let Err(err) = index.artifact_for(Arc::new(program)).await {
                                // Served as an error with this reason; the controller reports it too.
                                debug!(program = %name, error = %err, "artifact cannot be built");
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
