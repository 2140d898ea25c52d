//! The file server's view of Programs: a watch-fed reflector plus the artifact cache.
//!
//! Every replica runs its own watch, so every replica can answer without asking the apiserver per
//! request, and (artifacts being deterministic) every replica serves the bytes whose digest the
//! leader wrote to the Program's status.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use futures::TryStreamExt;
use kube::runtime::reflector::{self, ObjectRef, Store};
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Api, ResourceExt};
use pko_api::program::Program;
use tracing::{debug, warn};

use super::cache::{ArtifactCache, CacheKey};
use crate::artifact::{self, Artifact, ArtifactError};
use crate::metrics::Metrics;

/// The outcome of looking up one generation of one Program.
#[derive(Debug)]
pub enum Lookup {
    Found(Arc<Artifact>),
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
    Failed(ArtifactError),
}

/// Programs known to this replica, and their artifacts.
pub struct ProgramIndex {
    store: Store<Program>,
    cache: ArtifactCache,
    synced: Arc<AtomicBool>,
    metrics: Metrics,
}

impl ProgramIndex {
    pub fn new(store: Store<Program>, cache_bytes: u64, metrics: Metrics) -> Self {
        Self {
            store,
            cache: ArtifactCache::new(cache_bytes),
            synced: Arc::new(AtomicBool::new(false)),
            metrics,
        }
    }

    /// True once the initial list of Programs has been received.
    pub fn is_synced(&self) -> bool {
        self.synced.load(Ordering::Acquire)
    }

    /// The flag behind [`Self::is_synced`], for readiness checks.
    pub fn synced_flag(&self) -> Arc<AtomicBool> {
        self.synced.clone()
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
    pub async fn artifact_for(
        &self,
        program: Arc<Program>,
    ) -> Result<Arc<Artifact>, ArtifactError> {
        let key = cache_key(&program);
        if let Some(hit) = self.cache.get(&key) {
            self.metrics.fileserver_cache_hits.inc();
            return Ok(hit);
        }
        self.metrics.fileserver_cache_misses.inc();
        // Building a large Program takes milliseconds of CPU: keep it off the async workers.
        let built = tokio::task::spawn_blocking(move || build_program(&program))
            .await
            .unwrap_or_else(|join| Err(ArtifactError::Archive(std::io::Error::other(join))))?;
        let built = Arc::new(built);
        self.cache.insert(key, built.clone());
        self.metrics
            .fileserver_cache_bytes
            .set(i64::try_from(self.cache.bytes()).unwrap_or(i64::MAX));
        Ok(built)
    }

    fn observe(&self, event: &watcher::Event<Program>) {
        match event {
            watcher::Event::Delete(program) => {
                if let Some(uid) = program.uid() {
                    self.cache.remove_uid(&uid);
                }
            }
            watcher::Event::Apply(program) | watcher::Event::InitApply(program) => {
                if let Some(uid) = program.uid() {
                    self.cache
                        .retain_generation(&uid, program.metadata.generation.unwrap_or(0));
                }
            }
            watcher::Event::InitDone => {
                self.synced.store(true, Ordering::Release);
            }
            watcher::Event::Init => {}
        }
        self.metrics
            .programs_active
            .set(i64::try_from(self.store.len()).unwrap_or(i64::MAX));
        self.metrics
            .fileserver_cache_bytes
            .set(i64::try_from(self.cache.bytes()).unwrap_or(i64::MAX));
    }
}

/// The one function that turns a Program into its artifact, used by the controller (for the
/// digest in status) and by the file server (for the bytes it serves).
pub fn build_program(program: &Program) -> Result<Artifact, ArtifactError> {
    artifact::build_typed(&program.name_any(), &program.program)
}

fn cache_key(program: &Program) -> CacheKey {
    CacheKey {
        uid: program.uid().unwrap_or_default(),
        generation: program.metadata.generation.unwrap_or(0),
    }
}

/// Start watching Programs cluster-wide. Returns the index and the future that drives the watch;
/// the caller spawns it. Applied Programs are pre-built so requests are served from memory.
pub fn watch(
    api: Api<Program>,
    cache_bytes: u64,
    metrics: Metrics,
) -> (Arc<ProgramIndex>, impl std::future::Future<Output = ()>) {
    let (store, writer) = reflector::store::<Program>();
    let index = Arc::new(ProgramIndex::new(store, cache_bytes, metrics));
    let driver = {
        let index = index.clone();
        async move {
            let events = watcher(api, watcher::Config::default().any_semantic())
                .default_backoff()
                .reflect(writer)
                .inspect_ok(|event| index.observe(event))
                .applied_objects();
            let mut events = std::pin::pin!(events);
            loop {
                match events.try_next().await {
                    Ok(Some(program)) => {
                        let name = program.name_any();
                        if let Err(err) = index.artifact_for(Arc::new(program)).await {
                            // Served as a 500 with this reason; the controller reports it too.
                            debug!(program = %name, error = %err, "artifact cannot be built");
                        }
                    }
                    Ok(None) => break,
                    Err(err) => warn!(error = %err, "program watch failed; retrying"),
                }
            }
        }
    };
    (index, driver)
}
