//! Transform objects as every replica sees them: watched, their modules loaded and their
//! configurations validated, and resolved into the ordered chain of each Program.
//!
//! Every replica runs this (its file server builds artifacts too), so every replica loads the
//! same modules and computes the same chains. When a transform's state changes (object applied
//! or deleted, module loaded, namespace labels changed), the chain of every Program is
//! recomputed in memory and exactly the Programs whose chain fingerprint changed are sent to the
//! Program controller.

mod args;
mod selection;
pub mod source;
mod watches;

use std::collections::{BTreeMap, HashMap, HashSet};
use std::fmt;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use crate::artifact::stored::StoredProgram;
use futures::StreamExt;
use k8s_openapi::api::core::v1::Namespace;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelector;
use kube::core::{Selector, SelectorExt};
use kube::runtime::reflector::{ObjectRef, Store};
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Api, Client, Resource, ResourceExt};
use pko_api::transform::{
    ClusterProgramTransform, FailurePolicy as ApiPolicy, ProgramTransform, ResolvedSource,
    TransformStatus, TransformView,
};
use pko_plugin_host::chain::{Chain, FailurePolicy, Step};
use pko_plugin_host::host::{Shares, default_share, share};
use pko_plugin_host::{
    CallSite, LimitOverrides, Limits, Module, PluginError, PluginHost, PluginMetrics,
};
use serde_json::Value;
use tokio::sync::{broadcast, watch};
use tokio::task::AbortHandle;
use tracing::{debug, info, warn};

pub use args::{PluginArgs, PluginPlan};
use selection::{matching, overrides, resolve, selectors};
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
    /// The transform changed and its new module cannot be fetched (a registry or ConfigMap
    /// out of reach): the module it had keeps running, with the settings it was loaded with,
    /// while the new one is retried.
    Previous {
        previous: Arc<Previous>,
        error: PluginError,
    },
}

/// A transform's module as it was loaded before the transform changed.
#[derive(Debug)]
pub struct Previous {
    pub module: Arc<Module>,
    config: Value,
    limits: Limits,
}

impl LoadState {
    fn same(&self, other: &LoadState) -> bool {
        match (self, other) {
            (Self::Loading, Self::Loading) => true,
            (Self::Ready(a), Self::Ready(b)) => Arc::ptr_eq(a, b),
            (Self::Failed(a), Self::Failed(b)) => a == b,
            (
                Self::Previous {
                    previous: a,
                    error: ea,
                },
                Self::Previous {
                    previous: b,
                    error: eb,
                },
            ) => Arc::ptr_eq(a, b) && ea == eb,
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
    fingerprints: HashMap<ObjectRef<StoredProgram>, String>,
    /// Keys seen during a re-list, per kind (`None` outside a re-list).
    relist: [Option<HashSet<TransformKey>>; 2],
    synced: [bool; 3],
}

/// The transforms known to this replica.
pub struct TransformRegistry {
    host: PluginHost,
    fetcher: ModuleFetcher,
    state: Mutex<State>,
    programs: OnceLock<Store<StoredProgram>>,
    program_triggers: broadcast::Sender<ObjectRef<StoredProgram>>,
    status_triggers: broadcast::Sender<TransformKey>,
    synced: watch::Sender<bool>,
    synced_flag: Arc<AtomicBool>,
    /// Module loads at once (fetch and compile), for every transform together.
    loads: Arc<tokio::sync::Semaphore>,
    /// Each namespace's share of `loads`.
    load_shares: Arc<Shares>,
    /// Budget of one load once it holds a slot.
    load_timeout: Duration,
}

/// How many module loads run at once, and for how long each may.
#[derive(Debug, Clone, Copy)]
pub struct LoadLimits {
    pub concurrent: u32,
    /// Of `concurrent`, the most one namespace's loads hold.
    pub per_namespace: u32,
    pub timeout: Duration,
}

impl LoadLimits {
    /// The flags' defaults.
    pub const DEFAULT: Self = Self {
        concurrent: 2,
        per_namespace: 1,
        timeout: Duration::from_secs(60),
    };
}

impl TransformRegistry {
    /// A registry running plugins on `host`, fetching modules with `fetcher`.
    pub fn new(host: PluginHost, fetcher: ModuleFetcher) -> Arc<Self> {
        Self::with_load_limits(host, fetcher, LoadLimits::DEFAULT)
    }

    /// [`Self::new`] with `limits` on module loads.
    pub fn with_load_limits(
        host: PluginHost,
        fetcher: ModuleFetcher,
        limits: LoadLimits,
    ) -> Arc<Self> {
        Arc::new(Self {
            loads: Arc::new(tokio::sync::Semaphore::new(
                limits.concurrent.max(1) as usize
            )),
            load_shares: Arc::new(Shares::new(share(
                limits.concurrent.max(1),
                limits.per_namespace,
            ))),
            load_timeout: limits.timeout,
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
        plan: PluginPlan,
    ) -> Result<Arc<Self>, TransformError> {
        // The compiler child is this binary: the same engine settings, whatever the install.
        let operator = std::env::current_exe().map_err(|e| {
            TransformError::Host(PluginError::Host(format!(
                "cannot find the operator binary to run the compiler: {e}"
            )))
        })?;
        let host = PluginHost::new(args.host_config(&plan, operator), metrics)
            .map_err(TransformError::Host)?;
        let fetcher = ModuleFetcher::new(
            Some(client),
            args.plugin_file_root.clone(),
            args.plugin_ca_file.as_deref(),
            args.plugin_max_module_bytes,
            egress,
        )?;
        let limits = LoadLimits {
            concurrent: args.plugin_max_concurrent_loads,
            per_namespace: args
                .plugin_max_concurrent_loads_per_namespace
                .unwrap_or_else(|| default_share(args.plugin_max_concurrent_loads)),
            timeout: Duration::from_secs(args.plugin_load_timeout_seconds),
        };
        Ok(Self::with_load_limits(host, fetcher, limits))
    }

    pub fn host(&self) -> &PluginHost {
        &self.host
    }

    /// Gives the registry the Program store, for recomputing chains.
    pub fn attach_programs(&self, store: Store<StoredProgram>) {
        let _ = self.programs.set(store);
    }

    /// Programs whose chain changed.
    pub fn subscribe_programs(&self) -> broadcast::Receiver<ObjectRef<StoredProgram>> {
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
    pub fn forget(&self, program: &ObjectRef<StoredProgram>) {
        lock(&self.state).fingerprints.remove(program);
    }

    /// The ordered chain of `program`, once the transform watches have synced and the modules
    /// it needs have loaded (or failed to). Records the chain's fingerprint for the Program.
    pub async fn chain_for(&self, program: &StoredProgram) -> Result<Chain, TransformError> {
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
    use pko_plugin_host::HostConfig;

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

    fn program(ns: &str, name: &str, labels: &[(&str, &str)]) -> StoredProgram {
        let mut p = pko_api::program::Program::new(name, Default::default());
        p.metadata.namespace = Some(ns.into());
        p.metadata.labels = Some(self::labels(labels));
        StoredProgram::from_program(&p).expect("stores")
    }

    /// Drains what the registry sent to the Program controller.
    fn sent(rx: &mut broadcast::Receiver<ObjectRef<StoredProgram>>) -> Vec<String> {
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
        let (store, mut writer) = kube::runtime::reflector::store::<StoredProgram>();
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
