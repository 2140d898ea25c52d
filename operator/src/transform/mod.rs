//! Transform objects as every replica sees them: watched, their modules loaded and their
//! configurations validated, and resolved into the ordered chain of each Program.
//!
//! Every replica runs this (its file server builds artifacts too), so every replica loads the
//! same modules and computes the same chains. When a transform's state changes (object applied
//! or deleted, module loaded, namespace labels changed), the chain of every Program is
//! recomputed in memory and exactly the Programs whose chain fingerprint changed are sent to the
//! Program controller.

pub mod source;

use std::collections::{BTreeMap, HashMap, HashSet};
use std::fmt;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use futures::StreamExt;
use k8s_openapi::api::core::v1::Namespace;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelector;
use kube::core::{Selector, SelectorExt};
use kube::runtime::reflector::{ObjectRef, Store};
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Api, Client, Resource, ResourceExt};
use pko_api::program::Program;
use pko_api::transform::{
    ClusterProgramTransform, FailurePolicy as ApiPolicy, ProgramTransform, ResolvedSource,
    TransformStatus, TransformView,
};
use pko_plugin_host::chain::{Chain, FailurePolicy, Step};
use pko_plugin_host::{
    CallSite, HostConfig, LimitOverrides, Limits, Module, PluginError, PluginHost, PluginMetrics,
};
use serde_json::Value;
use tokio::sync::{broadcast, watch};
use tokio::task::AbortHandle;
use tracing::{debug, info, warn};

pub use source::ModuleFetcher;

use crate::egress::EgressPolicy;

/// How long a build waits for the transform watches' first list.
const SYNC_WAIT: Duration = Duration::from_secs(30);
/// How long a build waits for a module that is still loading.
const LOAD_WAIT: Duration = Duration::from_secs(60);
/// Retry delays of loads that failed for a reason that may go away (a missing ConfigMap, a
/// busy host, a digest mismatch that a ConfigMap update may fix).
const RETRY_FIRST: Duration = Duration::from_secs(5);
const RETRY_MAX: Duration = Duration::from_secs(300);
/// Buffered triggers; a lagging receiver gets a full resync instead.
const TRIGGER_CAPACITY: usize = 4096;

/// Plugin settings of the operator.
#[derive(clap::Args, Debug, Clone)]
pub struct PluginArgs {
    /// Run transform plugins (false: ProgramTransforms are ignored and no wasm runs).
    #[arg(
        long = "plugins",
        env = "PLUGINS_ENABLED",
        default_value_t = true,
        action = clap::ArgAction::Set
    )]
    pub plugins_enabled: bool,
    /// The folder `file:///` module URLs may point into (unset: file URLs are refused).
    #[arg(long, env = "PLUGIN_FILE_ROOT")]
    pub plugin_file_root: Option<PathBuf>,
    /// Folder of precompiled modules, reused across restarts (unset: compile at every start).
    #[arg(long, env = "PLUGIN_CACHE_DIR")]
    pub plugin_cache_dir: Option<PathBuf>,
    /// Bytes of precompiled modules kept in --plugin-cache-dir; the least recently used are
    /// evicted (keep it below the volume's size).
    #[arg(long, env = "PLUGIN_CACHE_MAX_BYTES", default_value_t = 128 << 20)]
    pub plugin_cache_max_bytes: u64,
    /// Extra PEM CA certificates for https module URLs (the OS's roots are always trusted).
    #[arg(long, env = "PLUGIN_CA_FILE")]
    pub plugin_ca_file: Option<PathBuf>,
    /// Plugin calls running at once.
    #[arg(long, env = "PLUGIN_MAX_CONCURRENT_CALLS", default_value_t = 4)]
    pub plugin_max_concurrent_calls: u32,
    /// Fuel per call of a plugin that sets no limit.
    #[arg(long, env = "PLUGIN_DEFAULT_FUEL", default_value_t = Limits::DEFAULT.fuel)]
    pub plugin_default_fuel: u64,
    /// Wall-clock budget per call, in milliseconds, of a plugin that sets no limit.
    #[arg(long, env = "PLUGIN_DEFAULT_TIMEOUT_MILLIS", default_value_t = 2000)]
    pub plugin_default_timeout_millis: u64,
    /// Linear memory, in MiB, of a plugin that sets no limit.
    #[arg(long, env = "PLUGIN_DEFAULT_MEMORY_MIB", default_value_t = 64)]
    pub plugin_default_memory_mib: u64,
    /// Output size, in KiB, of a plugin that sets no limit.
    #[arg(long, env = "PLUGIN_DEFAULT_OUTPUT_KIB", default_value_t = 4096)]
    pub plugin_default_output_kib: u64,
    /// Largest module accepted, in bytes.
    #[arg(long, env = "PLUGIN_MAX_MODULE_BYTES", default_value_t = 32 << 20)]
    pub plugin_max_module_bytes: u64,
    /// Memory, in MiB, every plugin call running at once may use together; each call reserves
    /// its memory cap from it. Unset: half of what the container's memory limit leaves (see
    /// docs/operations.md), or every slot at the ceiling when no limit is known.
    #[arg(long, env = "PLUGIN_MEMORY_BUDGET_MIB")]
    pub plugin_memory_budget_mib: Option<u64>,
}

impl PluginArgs {
    /// The memory cap of a plugin that sets none, as the host will apply it.
    pub fn default_memory_bytes(&self) -> u64 {
        (self.plugin_default_memory_mib << 20).min(Limits::CEILING.memory_bytes)
    }

    /// The budget when nothing limits memory: every slot at the ceiling.
    pub fn unlimited_memory_budget_bytes(&self) -> u64 {
        u64::from(self.plugin_max_concurrent_calls.max(1)) * Limits::CEILING.memory_bytes
    }

    /// The host settings these flags describe (defaults are capped by the host's ceilings),
    /// with the memory budget the start-up plan decided.
    pub fn host_config(&self, memory_budget_bytes: u64) -> HostConfig {
        let ceiling = Limits::CEILING;
        HostConfig {
            memory_budget_bytes,
            max_concurrent_calls: self.plugin_max_concurrent_calls.max(1),
            default_limits: Limits {
                fuel: self.plugin_default_fuel,
                timeout: Duration::from_millis(self.plugin_default_timeout_millis),
                memory_bytes: self.plugin_default_memory_mib << 20,
                output_bytes: self.plugin_default_output_kib << 10,
            }
            .with(&LimitOverrides::default(), &ceiling),
            ceiling,
            cache_dir: self.plugin_cache_dir.clone(),
            cache_max_bytes: self.plugin_cache_max_bytes,
            max_module_bytes: self.plugin_max_module_bytes,
        }
    }
}

/// Failures starting the transform machinery.
#[derive(Debug, thiserror::Error)]
pub enum TransformError {
    #[error("cannot start the plugin host: {0}")]
    Host(#[source] PluginError),
    #[error(transparent)]
    Fetcher(#[from] source::FetcherError),
    /// The transform watches have not listed their objects yet.
    #[error("transform objects are not synced yet")]
    NotSynced,
}

/// The two kinds, cluster-scoped first (the tie-break order).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum TransformKind {
    Cluster,
    Namespaced,
}

impl TransformKind {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Cluster => "ClusterProgramTransform",
            Self::Namespaced => "ProgramTransform",
        }
    }
}

/// Identity of a transform object.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct TransformKey {
    pub kind: TransformKind,
    pub namespace: Option<String>,
    pub name: String,
}

impl fmt::Display for TransformKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.namespace {
            Some(ns) => write!(f, "{}/{ns}/{}", self.kind.as_str(), self.name),
            None => write!(f, "{}/{}", self.kind.as_str(), self.name),
        }
    }
}

/// Where a transform's module stands.
#[derive(Clone, Debug)]
pub enum LoadState {
    Loading,
    Ready(Arc<Module>),
    Failed(PluginError),
}

impl LoadState {
    fn same(&self, other: &LoadState) -> bool {
        match (self, other) {
            (Self::Loading, Self::Loading) => true,
            (Self::Ready(a), Self::Ready(b)) => Arc::ptr_eq(a, b),
            (Self::Failed(a), Self::Failed(b)) => a == b,
            _ => false,
        }
    }
}

/// Everything that decides what loading a transform produces.
#[derive(Clone, Debug, PartialEq)]
struct LoadSpec {
    source: Option<ResolvedSource>,
    sha256: String,
    config: Value,
    limits: Limits,
}

struct Entry {
    uid: String,
    generation: i64,
    priority: i32,
    policy: FailurePolicy,
    namespace_selector: Option<Selector>,
    program_selector: Option<Selector>,
    selector_error: Option<String>,
    load: LoadSpec,
    state: watch::Sender<LoadState>,
    task: Option<AbortHandle>,
    status: Option<TransformStatus>,
}

impl Entry {
    fn selects(
        &self,
        key: &TransformKey,
        namespace: &str,
        namespace_labels: &BTreeMap<String, String>,
        labels: &BTreeMap<String, String>,
    ) -> bool {
        if self.selector_error.is_some() {
            return false;
        }
        let namespace_ok = match key.kind {
            TransformKind::Namespaced => key.namespace.as_deref() == Some(namespace),
            TransformKind::Cluster => self
                .namespace_selector
                .as_ref()
                .is_none_or(|s| s.matches(namespace_labels)),
        };
        namespace_ok
            && self
                .program_selector
                .as_ref()
                .is_none_or(|s| s.matches(labels))
    }
}

impl Drop for Entry {
    fn drop(&mut self) {
        if let Some(task) = self.task.take() {
            task.abort();
        }
    }
}

/// A transform's state for its status writer.
#[derive(Clone, Debug)]
pub struct Snapshot {
    pub key: TransformKey,
    pub generation: i64,
    pub state: LoadState,
    pub selector_error: Option<String>,
    /// The status as last seen on the object.
    pub status: Option<TransformStatus>,
}

#[derive(Default)]
struct State {
    entries: BTreeMap<TransformKey, Entry>,
    namespaces: HashMap<String, BTreeMap<String, String>>,
    /// The chain fingerprint each Program was last built with.
    fingerprints: HashMap<ObjectRef<Program>, String>,
    /// Keys seen during a re-list, per kind (`None` outside a re-list).
    relist: [Option<HashSet<TransformKey>>; 2],
    synced: [bool; 3],
}

/// The transforms known to this replica.
pub struct TransformRegistry {
    host: PluginHost,
    fetcher: ModuleFetcher,
    state: Mutex<State>,
    programs: OnceLock<Store<Program>>,
    program_triggers: broadcast::Sender<ObjectRef<Program>>,
    status_triggers: broadcast::Sender<TransformKey>,
    synced: watch::Sender<bool>,
    synced_flag: Arc<AtomicBool>,
}

impl TransformRegistry {
    /// A registry running plugins on `host`, fetching modules with `fetcher`.
    pub fn new(host: PluginHost, fetcher: ModuleFetcher) -> Arc<Self> {
        Arc::new(Self {
            host,
            fetcher,
            state: Mutex::new(State::default()),
            programs: OnceLock::new(),
            program_triggers: broadcast::channel(TRIGGER_CAPACITY).0,
            status_triggers: broadcast::channel(TRIGGER_CAPACITY).0,
            synced: watch::channel(false).0,
            synced_flag: Arc::new(AtomicBool::new(false)),
        })
    }

    /// Builds the host and the fetcher from the operator's flags.
    pub fn from_args(
        args: &PluginArgs,
        client: Client,
        metrics: PluginMetrics,
        egress: Arc<EgressPolicy>,
        memory_budget_bytes: u64,
    ) -> Result<Arc<Self>, TransformError> {
        let host = PluginHost::new(args.host_config(memory_budget_bytes), metrics)
            .map_err(TransformError::Host)?;
        let fetcher = ModuleFetcher::new(
            Some(client),
            args.plugin_file_root.clone(),
            args.plugin_ca_file.as_deref(),
            args.plugin_max_module_bytes,
            egress,
        )?;
        Ok(Self::new(host, fetcher))
    }

    pub fn host(&self) -> &PluginHost {
        &self.host
    }

    /// Gives the registry the Program store, for recomputing chains.
    pub fn attach_programs(&self, store: Store<Program>) {
        let _ = self.programs.set(store);
    }

    /// Programs whose chain changed.
    pub fn subscribe_programs(&self) -> broadcast::Receiver<ObjectRef<Program>> {
        self.program_triggers.subscribe()
    }

    /// Transforms whose state or object changed.
    pub fn subscribe_status(&self) -> broadcast::Receiver<TransformKey> {
        self.status_triggers.subscribe()
    }

    /// Asks the status writer to look at `key` again (after a failed write).
    pub fn retrigger_status(&self, key: TransformKey) {
        let _ = self.status_triggers.send(key);
    }

    /// Set once every transform watch has listed its objects (for readiness).
    pub fn synced_flag(&self) -> Arc<AtomicBool> {
        self.synced_flag.clone()
    }

    /// Every known transform.
    pub fn keys(&self) -> Vec<TransformKey> {
        lock(&self.state).entries.keys().cloned().collect()
    }

    /// The state of one transform.
    pub fn snapshot(&self, key: &TransformKey) -> Option<Snapshot> {
        let state = lock(&self.state);
        let entry = state.entries.get(key)?;
        Some(Snapshot {
            key: key.clone(),
            generation: entry.generation,
            state: entry.state.borrow().clone(),
            selector_error: entry.selector_error.clone(),
            status: entry.status.clone(),
        })
    }

    /// Forgets a deleted Program.
    pub fn forget(&self, program: &ObjectRef<Program>) {
        lock(&self.state).fingerprints.remove(program);
    }

    /// The ordered chain of `program`, once the transform watches have synced and the modules
    /// it needs have loaded (or failed to). Records the chain's fingerprint for the Program.
    pub async fn chain_for(&self, program: &Program) -> Result<Chain, TransformError> {
        let mut synced = self.synced.subscribe();
        if tokio::time::timeout(SYNC_WAIT, synced.wait_for(|s| *s))
            .await
            .ok()
            .and_then(Result::ok)
            .is_none()
        {
            return Err(TransformError::NotSynced);
        }
        let namespace = program.namespace().unwrap_or_default();
        let labels = program.labels().clone();
        // A module may start loading again while we wait (its object changed): a few rounds.
        for _ in 0..3 {
            let pending = {
                let state = lock(&self.state);
                matching(&state, &namespace, &labels)
                    .into_iter()
                    .filter(|(_, e)| matches!(*e.state.borrow(), LoadState::Loading))
                    .map(|(_, e)| e.state.subscribe())
                    .collect::<Vec<_>>()
            };
            if pending.is_empty() {
                break;
            }
            for mut rx in pending {
                let _ = tokio::time::timeout(
                    LOAD_WAIT,
                    rx.wait_for(|s| !matches!(s, LoadState::Loading)),
                )
                .await;
            }
        }
        let mut state = lock(&self.state);
        let chain = resolve(&state, &namespace, &labels);
        state
            .fingerprints
            .insert(ObjectRef::from_obj(program), chain.fingerprint());
        Ok(chain)
    }

    /// Offline use (the `render` command): takes these objects as the whole cluster, as if
    /// the watches had listed them.
    pub fn load_offline(
        self: &Arc<Self>,
        transforms: &[ProgramTransform],
        clusters: &[ClusterProgramTransform],
        namespaces: &[Namespace],
    ) {
        {
            let mut state = lock(&self.state);
            for ns in namespaces {
                // The apiserver adds this label to every namespace; manifests usually lack it.
                let mut labels = ns.labels().clone();
                labels
                    .entry("kubernetes.io/metadata.name".into())
                    .or_insert_with(|| ns.name_any());
                state.namespaces.insert(ns.name_any(), labels);
            }
        }
        for transform in transforms {
            self.apply(transform);
        }
        for cluster in clusters {
            self.apply(cluster);
        }
        for part in 0..3 {
            self.mark_synced(part);
        }
    }

    /// Runs the watches of both kinds and of namespaces until the stream ends. With
    /// `namespace`, only that namespace's ProgramTransforms and labels are watched.
    pub async fn run(self: Arc<Self>, client: Client, namespace: Option<String>) {
        let config = watcher::Config::default().any_semantic();
        let (transforms, namespaces): (Api<ProgramTransform>, Api<Namespace>) = match &namespace {
            Some(ns) => (
                Api::namespaced(client.clone(), ns),
                Api::all(client.clone()),
            ),
            None => (Api::all(client.clone()), Api::all(client.clone())),
        };
        let ns_config = match &namespace {
            Some(ns) => config.clone().fields(&format!("metadata.name={ns}")),
            None => config.clone(),
        };
        let clusters: Api<ClusterProgramTransform> = Api::all(client);
        tokio::join!(
            self.clone().watch_transforms(transforms, config.clone(), 0),
            self.clone().watch_transforms(clusters, config, 1),
            self.clone().watch_namespaces(namespaces, ns_config),
        );
    }

    async fn watch_transforms<K>(self: Arc<Self>, api: Api<K>, config: watcher::Config, part: usize)
    where
        K: TransformObject,
    {
        let events = watcher(api, config).default_backoff();
        let mut events = std::pin::pin!(events);
        while let Some(event) = events.next().await {
            match event {
                Ok(watcher::Event::Init) => {
                    lock(&self.state).relist[part] = Some(HashSet::new());
                }
                Ok(watcher::Event::InitApply(obj)) => {
                    if let Some(seen) = lock(&self.state).relist[part].as_mut() {
                        seen.insert(obj.key());
                    }
                    self.apply(&obj);
                }
                Ok(watcher::Event::Apply(obj)) => self.apply(&obj),
                Ok(watcher::Event::Delete(obj)) => self.remove(&obj.key()),
                Ok(watcher::Event::InitDone) => {
                    // Objects deleted while the watch was down are gone from the new list.
                    let stale: Vec<TransformKey> = {
                        let mut state = lock(&self.state);
                        let seen = state.relist[part].take().unwrap_or_default();
                        state
                            .entries
                            .keys()
                            .filter(|k| k.kind == K::KIND && !seen.contains(k))
                            .cloned()
                            .collect()
                    };
                    for key in stale {
                        self.remove(&key);
                    }
                    self.mark_synced(part);
                }
                Err(err) => {
                    warn!(kind = K::KIND.as_str(), error = %err, "transform watch failed; retrying")
                }
            }
        }
    }

    async fn watch_namespaces(self: Arc<Self>, api: Api<Namespace>, config: watcher::Config) {
        let events = watcher(api, config).default_backoff();
        let mut events = std::pin::pin!(events);
        while let Some(event) = events.next().await {
            match event {
                Ok(watcher::Event::Apply(ns) | watcher::Event::InitApply(ns)) => {
                    let name = ns.name_any();
                    let labels = ns.labels().clone();
                    let changed = {
                        let mut state = lock(&self.state);
                        state.namespaces.insert(name.clone(), labels.clone()) != Some(labels)
                    };
                    if changed {
                        self.recompute(Some(&name));
                    }
                }
                Ok(watcher::Event::Delete(ns)) => {
                    lock(&self.state).namespaces.remove(&ns.name_any());
                }
                Ok(watcher::Event::InitDone) => self.mark_synced(2),
                Ok(watcher::Event::Init) => {}
                Err(err) => warn!(error = %err, "namespace watch failed; retrying"),
            }
        }
    }

    fn mark_synced(&self, part: usize) {
        let all = {
            let mut state = lock(&self.state);
            state.synced[part] = true;
            state.synced.iter().all(|s| *s)
        };
        if all && !self.synced_flag.swap(true, Ordering::AcqRel) {
            info!("transforms synced");
            self.synced.send_replace(true);
        }
    }

    /// Adds or updates a transform; starts loading its module when what it loads changed.
    fn apply<K: TransformObject>(self: &Arc<Self>, obj: &K) {
        let key = obj.key();
        // An object being deleted is gone for the chains: its finalizers may keep it around,
        // and whoever holds one could otherwise change its module after admission let go of it.
        if obj.meta().deletion_timestamp.is_some() {
            self.remove(&key);
            return;
        }
        let view = obj.view();
        let uid = obj.meta().uid.clone().unwrap_or_default();
        let generation = obj.meta().generation.unwrap_or(0);
        let (namespace_selector, program_selector, selector_error) = selectors(&view);
        let limits = self.host.limits(&overrides(&view));
        let load = LoadSpec {
            source: view.source.clone(),
            sha256: view.sha256.to_owned(),
            config: view.common.config.clone().unwrap_or(Value::Null),
            limits,
        };
        let policy = match view.common.failure_policy {
            ApiPolicy::Fail => FailurePolicy::Fail,
            ApiPolicy::Ignore => FailurePolicy::Ignore,
        };
        let priority = view.common.priority;
        let status = obj.status().cloned();

        let mut state = lock(&self.state);
        let reuse = state
            .entries
            .get(&key)
            .is_some_and(|e| e.uid == uid && e.load == load);
        let relevant = if reuse {
            let Some(entry) = state.entries.get_mut(&key) else {
                return;
            };
            let relevant = entry.priority != priority
                || entry.policy != policy
                || entry.namespace_selector != namespace_selector
                || entry.program_selector != program_selector
                || entry.selector_error != selector_error;
            entry.generation = generation;
            entry.priority = priority;
            entry.policy = policy;
            entry.namespace_selector = namespace_selector;
            entry.program_selector = program_selector;
            entry.selector_error = selector_error;
            entry.status = status;
            relevant
        } else {
            // Another module (or a new object of the name): its old series go.
            if state.entries.contains_key(&key) {
                self.host.forget_transform(&key.to_string());
            }
            let (tx, _) = watch::channel(LoadState::Loading);
            let task = self.spawn_load(key.clone(), load.clone(), tx.clone());
            debug!(transform = %key, generation, "loading transform");
            state.entries.insert(
                key.clone(),
                Entry {
                    uid,
                    generation,
                    priority,
                    policy,
                    namespace_selector,
                    program_selector,
                    selector_error,
                    load,
                    state: tx,
                    task: Some(task),
                    status,
                },
            );
            // Programs are re-checked when the load settles.
            false
        };
        drop(state);
        if relevant {
            self.recompute(key.namespace.as_deref());
        }
        let _ = self.status_triggers.send(key);
    }

    fn remove(&self, key: &TransformKey) {
        let removed = lock(&self.state).entries.remove(key).is_some();
        if removed {
            self.host.forget_transform(&key.to_string());
            debug!(transform = %key, "transform removed");
            self.recompute(key.namespace.as_deref());
        }
    }

    fn spawn_load(
        self: &Arc<Self>,
        key: TransformKey,
        load: LoadSpec,
        tx: watch::Sender<LoadState>,
    ) -> AbortHandle {
        let this = Arc::downgrade(self);
        tokio::spawn(async move {
            let mut delay = RETRY_FIRST;
            loop {
                let Some(registry) = this.upgrade() else {
                    return;
                };
                let result = registry.load(&key, &load).await;
                let retry = match &result {
                    Ok(_) => false,
                    Err(e) => {
                        e.kind().is_transient()
                            || e.kind() == pko_plugin_host::ErrorKind::DigestMismatch
                    }
                };
                let next = match result {
                    Ok(module) => {
                        info!(transform = %key, plugin = %module.info().name, digest = %module.digest(), "transform ready");
                        LoadState::Ready(module)
                    }
                    Err(err) => {
                        warn!(transform = %key, error = %err, "transform not ready");
                        LoadState::Failed(err)
                    }
                };
                let changed = !tx.borrow().same(&next);
                tx.send_replace(next);
                if changed {
                    registry.recompute(key.namespace.as_deref());
                    let _ = registry.status_triggers.send(key.clone());
                }
                drop(registry);
                if !retry {
                    return;
                }
                tokio::time::sleep(delay).await;
                delay = (delay * 2).min(RETRY_MAX);
            }
        })
        .abort_handle()
    }

    async fn load(&self, key: &TransformKey, load: &LoadSpec) -> Result<Arc<Module>, PluginError> {
        let site = CallSite::new(key.to_string());
        // Always read the source, even when a module with this digest is already loaded: a
        // transform is ready only if its own source holds the pinned bytes (a digest alone does
        // not grant another namespace's module). Loading known bytes costs only their sha256.
        let source = load
            .source
            .as_ref()
            .ok_or_else(|| PluginError::Source("set exactly one of configMap and url".into()))?;
        let bytes = self.fetcher.fetch(source, &load.sha256).await?;
        let module = self.host.load(bytes, &load.sha256, &site).await?;
        self.host
            .validate_config(&module, &load.config, load.limits, &site)
            .await?;
        Ok(module)
    }

    /// Recomputes the chains of the Programs in `namespace` (all when `None`) and sends those
    /// whose fingerprint differs from the one they were last built with.
    fn recompute(&self, namespace: Option<&str>) {
        let Some(store) = self.programs.get() else {
            return;
        };
        let programs = store.state();
        let changed: Vec<ObjectRef<Program>> = {
            let state = lock(&self.state);
            programs
                .iter()
                .filter(|p| namespace.is_none_or(|ns| p.namespace().as_deref() == Some(ns)))
                .filter_map(|p| {
                    let r = ObjectRef::from_obj(p.as_ref());
                    let old = state.fingerprints.get(&r)?;
                    let now = resolve(&state, &p.namespace().unwrap_or_default(), p.labels())
                        .fingerprint();
                    (*old != now).then_some(r)
                })
                .collect()
        };
        for program in changed {
            debug!(program = %program, "transform chain changed");
            let _ = self.program_triggers.send(program);
        }
    }
}

/// The transforms selecting a Program, in chain order.
fn matching<'a>(
    state: &'a State,
    namespace: &str,
    labels: &BTreeMap<String, String>,
) -> Vec<(&'a TransformKey, &'a Entry)> {
    let default_labels;
    let namespace_labels = match state.namespaces.get(namespace) {
        Some(labels) => labels,
        None => {
            // The apiserver sets this label on every namespace; assume it before the watch
            // has seen the namespace.
            default_labels = BTreeMap::from([(
                "kubernetes.io/metadata.name".to_owned(),
                namespace.to_owned(),
            )]);
            &default_labels
        }
    };
    let mut selected: Vec<(&TransformKey, &Entry)> = state
        .entries
        .iter()
        .filter(|(key, entry)| entry.selects(key, namespace, namespace_labels, labels))
        .collect();
    selected.sort_by(|(ka, a), (kb, b)| {
        (a.priority, &ka.name, ka.kind, &ka.namespace).cmp(&(
            b.priority,
            &kb.name,
            kb.kind,
            &kb.namespace,
        ))
    });
    selected
}

/// The chain of a Program from the current states (a module still loading fails its step
/// with a transient error).
fn resolve(state: &State, namespace: &str, labels: &BTreeMap<String, String>) -> Chain {
    let steps = matching(state, namespace, labels)
        .into_iter()
        .map(|(key, entry)| Step {
            id: key.to_string(),
            priority: entry.priority,
            policy: entry.policy,
            module: match &*entry.state.borrow() {
                LoadState::Ready(module) => Ok(module.clone()),
                LoadState::Failed(err) => Err(err.clone()),
                LoadState::Loading => {
                    Err(PluginError::Source("the module is still loading".into()))
                }
            },
            config: entry.load.config.clone(),
            limits: entry.load.limits,
        })
        .collect();
    Chain { steps }
}

fn selectors(view: &TransformView<'_>) -> (Option<Selector>, Option<Selector>, Option<String>) {
    let parse = |s: Option<&LabelSelector>, what: &str| -> Result<Option<Selector>, String> {
        s.cloned()
            .map(Selector::try_from)
            .transpose()
            .map_err(|e| format!("{what}: {e}"))
    };
    match (
        parse(view.namespace_selector, "namespaceSelector"),
        parse(view.program_selector, "programSelector"),
    ) {
        (Ok(ns), Ok(program)) => (ns, program, None),
        (Err(e), _) | (_, Err(e)) => (None, None, Some(e)),
    }
}

fn overrides(view: &TransformView<'_>) -> LimitOverrides {
    let positive = |v: Option<i64>| v.and_then(|v| u64::try_from(v).ok()).filter(|v| *v > 0);
    match view.common.limits {
        Some(limits) => LimitOverrides {
            fuel: positive(limits.fuel),
            timeout: positive(limits.timeout_millis).map(Duration::from_millis),
            memory_bytes: positive(limits.memory_mib).map(|m| m << 20),
            output_bytes: positive(limits.output_kib).map(|k| k << 10),
        },
        None => LimitOverrides::default(),
    }
}

/// What the registry needs from either kind.
pub trait TransformObject:
    Resource<DynamicType = ()>
    + Clone
    + fmt::Debug
    + serde::de::DeserializeOwned
    + Send
    + Sync
    + 'static
{
    const KIND: TransformKind;
    fn key(&self) -> TransformKey;
    fn view(&self) -> TransformView<'_>;
    fn status(&self) -> Option<&TransformStatus>;
}

impl TransformObject for ProgramTransform {
    const KIND: TransformKind = TransformKind::Namespaced;

    fn key(&self) -> TransformKey {
        TransformKey {
            kind: Self::KIND,
            namespace: self.namespace(),
            name: self.name_any(),
        }
    }

    fn view(&self) -> TransformView<'_> {
        ProgramTransform::view(self)
    }

    fn status(&self) -> Option<&TransformStatus> {
        self.status.as_ref()
    }
}

impl TransformObject for ClusterProgramTransform {
    const KIND: TransformKind = TransformKind::Cluster;

    fn key(&self) -> TransformKey {
        TransformKey {
            kind: Self::KIND,
            namespace: None,
            name: self.name_any(),
        }
    }

    fn view(&self) -> TransformView<'_> {
        ClusterProgramTransform::view(self)
    }

    fn status(&self) -> Option<&TransformStatus> {
        self.status.as_ref()
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    // The maps stay consistent even if a holder panicked; keep going with them.
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    fn entry(priority: i32, program_selector: Option<Selector>, ns: Option<Selector>) -> Entry {
        Entry {
            uid: "u".into(),
            generation: 1,
            priority,
            policy: FailurePolicy::Fail,
            namespace_selector: ns,
            program_selector,
            selector_error: None,
            load: LoadSpec {
                source: None,
                sha256: String::new(),
                config: json!({"p": priority}),
                limits: Limits::DEFAULT,
            },
            state: watch::channel(LoadState::Failed(PluginError::Source("x".into()))).0,
            task: None,
            status: None,
        }
    }

    fn key(kind: TransformKind, ns: Option<&str>, name: &str) -> TransformKey {
        TransformKey {
            kind,
            namespace: ns.map(str::to_owned),
            name: name.into(),
        }
    }

    fn selector(labels: &[(&str, &str)]) -> Selector {
        Selector::try_from(LabelSelector {
            match_labels: Some(
                labels
                    .iter()
                    .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
                    .collect(),
            ),
            match_expressions: None,
        })
        .expect("selector")
    }

    fn labels(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
        pairs
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect()
    }

    #[test]
    fn chains_are_selected_and_ordered_by_priority_name_and_kind() {
        let mut state = State::default();
        state
            .namespaces
            .insert("a".into(), labels(&[("tier", "gold")]));
        state
            .namespaces
            .insert("b".into(), labels(&[("tier", "free")]));
        use TransformKind::{Cluster, Namespaced};
        state
            .entries
            .insert(key(Namespaced, Some("a"), "zeta"), entry(1, None, None));
        state
            .entries
            .insert(key(Namespaced, Some("a"), "alpha"), entry(1, None, None));
        state
            .entries
            .insert(key(Cluster, None, "alpha"), entry(1, None, None));
        state
            .entries
            .insert(key(Namespaced, Some("a"), "late"), entry(9, None, None));
        state
            .entries
            .insert(key(Namespaced, Some("a"), "first"), entry(-5, None, None));
        state.entries.insert(
            key(Namespaced, Some("a"), "web-only"),
            entry(0, Some(selector(&[("app", "web")])), None),
        );
        state.entries.insert(
            key(Cluster, None, "gold"),
            entry(0, None, Some(selector(&[("tier", "gold")]))),
        );
        state
            .entries
            .insert(key(Namespaced, Some("b"), "other-ns"), entry(0, None, None));

        let ids = |ns: &str, l: &[(&str, &str)]| -> Vec<String> {
            resolve(&state, ns, &labels(l))
                .steps
                .into_iter()
                .map(|s| s.id)
                .collect()
        };
        assert_eq!(
            ids("a", &[("app", "web")]),
            [
                "ProgramTransform/a/first",
                "ClusterProgramTransform/gold",
                "ProgramTransform/a/web-only",
                "ClusterProgramTransform/alpha",
                "ProgramTransform/a/alpha",
                "ProgramTransform/a/zeta",
                "ProgramTransform/a/late",
            ]
        );
        assert_eq!(
            ids("a", &[]),
            [
                "ProgramTransform/a/first",
                "ClusterProgramTransform/gold",
                "ClusterProgramTransform/alpha",
                "ProgramTransform/a/alpha",
                "ProgramTransform/a/zeta",
                "ProgramTransform/a/late",
            ]
        );
        assert_eq!(
            ids("b", &[]),
            [
                "ProgramTransform/b/other-ns",
                "ClusterProgramTransform/alpha"
            ]
        );
        // An unseen namespace matches only selectors on its name label.
        assert_eq!(ids("c", &[]), ["ClusterProgramTransform/alpha"]);
    }

    #[test]
    fn a_bad_selector_selects_nothing_and_says_why() {
        let view_spec: ProgramTransform = serde_json::from_value(json!({
            "apiVersion": "pko-rs.dev/v1alpha1",
            "kind": "ProgramTransform",
            "metadata": {"name": "x", "namespace": "a"},
            "spec": {
                "source": {"url": "file:///x.wasm"},
                "sha256": "ab".repeat(32),
                "programSelector": {"matchExpressions": [{"key": "k", "operator": "Near"}]},
            },
        }))
        .expect("parses");
        let (ns, program, error) = selectors(&view_spec.view());
        assert!(ns.is_none() && program.is_none());
        assert!(error.expect("error").contains("programSelector"));
        let mut e = entry(0, None, None);
        e.selector_error = Some("bad".into());
        assert!(!e.selects(
            &key(TransformKind::Namespaced, Some("a"), "x"),
            "a",
            &BTreeMap::new(),
            &BTreeMap::new()
        ));
    }

    fn program(ns: &str, name: &str, labels: &[(&str, &str)]) -> Program {
        let mut p = Program::new(name, Default::default());
        p.metadata.namespace = Some(ns.into());
        p.metadata.labels = Some(self::labels(labels));
        p
    }

    /// Drains what the registry sent to the Program controller.
    fn sent(rx: &mut broadcast::Receiver<ObjectRef<Program>>) -> Vec<String> {
        let mut out = Vec::new();
        while let Ok(r) = rx.try_recv() {
            out.push(format!("{}/{}", r.namespace.unwrap_or_default(), r.name));
        }
        out.sort();
        out
    }

    #[tokio::test]
    async fn exactly_the_programs_whose_chain_changed_are_reconciled_again() {
        let host = PluginHost::new(HostConfig::default(), PluginMetrics::new()).expect("host");
        let registry = TransformRegistry::new(
            host,
            ModuleFetcher::offline(None, 1, Vec::new(), HashMap::new()),
        );
        let (store, mut writer) = kube::runtime::reflector::store::<Program>();
        let programs = [
            program("a", "web", &[("app", "web")]),
            program("a", "db", &[("app", "db")]),
            program("b", "web", &[("app", "web")]),
        ];
        for p in &programs {
            writer.apply_watcher_event(&watcher::Event::Apply(p.clone()));
        }
        registry.attach_programs(store);
        let mut rx = registry.subscribe_programs();
        // Every Program built once, with no transform.
        {
            let mut state = lock(&registry.state);
            for p in &programs {
                let chain = resolve(&state, &p.namespace().unwrap_or_default(), p.labels());
                state
                    .fingerprints
                    .insert(ObjectRef::from_obj(p), chain.fingerprint());
            }
        }

        // A namespaced transform for app=web in `a`: only a/web.
        lock(&registry.state).entries.insert(
            key(TransformKind::Namespaced, Some("a"), "t"),
            entry(0, Some(selector(&[("app", "web")])), None),
        );
        registry.recompute(Some("a"));
        assert_eq!(sent(&mut rx), ["a/web"]);

        // A cluster transform for namespaces labelled tier=gold: none yet.
        lock(&registry.state).entries.insert(
            key(TransformKind::Cluster, None, "gold"),
            entry(0, None, Some(selector(&[("tier", "gold")]))),
        );
        registry.recompute(None);
        // a/web still differs from what it was built with; nothing else changed.
        assert_eq!(sent(&mut rx), ["a/web"]);

        // Labelling namespace b brings its Program in.
        lock(&registry.state)
            .namespaces
            .insert("b".into(), labels(&[("tier", "gold")]));
        registry.recompute(Some("b"));
        assert_eq!(sent(&mut rx), ["b/web"]);
    }

    #[tokio::test]
    async fn an_object_being_deleted_is_never_loaded() {
        let host = PluginHost::new(HostConfig::default(), PluginMetrics::new()).expect("host");
        let registry = TransformRegistry::new(
            host,
            ModuleFetcher::offline(None, 1, Vec::new(), HashMap::new()),
        );
        let mut pt: ProgramTransform = serde_json::from_value(json!({
            "apiVersion": "pko-rs.dev/v1alpha1",
            "kind": "ProgramTransform",
            "metadata": {"name": "t", "namespace": "a", "uid": "u1",
                         "deletionTimestamp": "2026-01-01T00:00:00Z"},
            "spec": {"source": {"configMap": {"name": "m", "key": "k"}},
                     "sha256": format!("sha256:{}", "1".repeat(64))},
        }))
        .expect("transform");
        let loaded = |registry: &TransformRegistry| lock(&registry.state).entries.len();
        registry.apply(&pt);
        assert_eq!(loaded(&registry), 0, "held by a finalizer, being deleted");
        let deleting = pt.metadata.deletion_timestamp.take();
        registry.apply(&pt);
        assert_eq!(loaded(&registry), 1);
        pt.metadata.deletion_timestamp = deleting;
        registry.apply(&pt);
        assert_eq!(loaded(&registry), 0, "dropped once it is being deleted");
    }

    #[test]
    fn limits_come_from_the_object_within_the_ceiling() {
        let pt: ProgramTransform = serde_json::from_value(json!({
            "apiVersion": "pko-rs.dev/v1alpha1",
            "kind": "ProgramTransform",
            "metadata": {"name": "x", "namespace": "a"},
            "spec": {
                "source": {"url": "file:///x.wasm"},
                "sha256": "ab".repeat(32),
                "limits": {"fuel": 10, "timeoutMillis": 250, "memoryMiB": 1024, "outputKiB": 2},
            },
        }))
        .expect("parses");
        let o = overrides(&pt.view());
        assert_eq!(o.fuel, Some(10));
        assert_eq!(o.timeout, Some(Duration::from_millis(250)));
        assert_eq!(o.memory_bytes, Some(1024 << 20));
        assert_eq!(o.output_bytes, Some(2048));
        let limits = Limits::DEFAULT.with(&o, &Limits::CEILING);
        assert_eq!(limits.memory_bytes, Limits::CEILING.memory_bytes);
    }
}
