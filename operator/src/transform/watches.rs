//! The watches that feed the registry: transforms of both kinds and namespace labels, each
//! applied as it changes, with module loads retried and chains recomputed.

use super::*;
use crate::scope::{Known, WatchScope, merged_watch};

impl TransformRegistry {
    /// Runs the watches of both kinds and of namespaces until the stream ends. ProgramTransforms
    /// are watched in `scope`. With `cluster` false nothing cluster-scoped is watched (no
    /// ClusterProgramTransforms, no Namespace labels): the namespace-scoped install has no
    /// right to them. With `cluster` and one namespace, only that Namespace's labels are watched.
    pub async fn run(self: Arc<Self>, client: Client, scope: WatchScope, cluster: bool) {
        let config = watcher::Config::default().any_semantic();
        let transforms: Vec<Api<ProgramTransform>> = scope.apis(&client);
        let transforms = self
            .clone()
            .watch_transforms(merged_watch(transforms, config.clone(), Known::Keep), 0);
        if !cluster {
            self.mark_synced(1);
            self.mark_synced(2);
            transforms.await;
            return;
        }
        let ns_config = match &scope {
            WatchScope::Namespaces(list) if list.len() == 1 => {
                config.clone().fields(&format!("metadata.name={}", list[0]))
            }
            _ => config.clone(),
        };
        let namespaces: Api<Namespace> = Api::all(client.clone());
        let clusters: Api<ClusterProgramTransform> = Api::all(client);
        tokio::join!(
            transforms,
            self.clone()
                .watch_transforms(watcher(clusters, config).default_backoff().boxed(), 1),
            self.clone().watch_namespaces(namespaces, ns_config),
        );
    }

    async fn watch_transforms<K>(
        self: Arc<Self>,
        events: impl futures::Stream<Item = Result<watcher::Event<K>, watcher::Error>>,
        part: usize,
    ) where
        K: TransformObject,
    {
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

    pub(super) fn mark_synced(&self, part: usize) {
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
    pub(super) fn apply<K: TransformObject>(self: &Arc<Self>, obj: &K) {
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
            // The same object's running module stays at hand, for when the new one cannot
            // be fetched.
            let previous = state
                .entries
                .get(&key)
                .filter(|e| e.uid == uid)
                .and_then(|e| match &*e.state.borrow() {
                    LoadState::Ready(module) => Some(Arc::new(Previous {
                        module: module.clone(),
                        config: e.load.config.clone(),
                        limits: e.load.limits,
                    })),
                    LoadState::Previous { previous, .. } => Some(previous.clone()),
                    LoadState::Loading | LoadState::Failed(_) => None,
                });
            let (tx, _) = watch::channel(LoadState::Loading);
            let task = self.spawn_load(key.clone(), load.clone(), tx.clone(), previous);
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

    pub(super) fn remove(&self, key: &TransformKey) {
        let removed = lock(&self.state).entries.remove(key).is_some();
        if removed {
            self.host.forget_transform(&key.to_string());
            debug!(transform = %key, "transform removed");
            self.recompute(key.namespace.as_deref());
        }
    }

    pub(super) fn spawn_load(
        self: &Arc<Self>,
        key: TransformKey,
        load: LoadSpec,
        tx: watch::Sender<LoadState>,
        previous: Option<Arc<Previous>>,
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
                    // A digest mismatch or a missing signature may be fixed at the source
                    // (a ConfigMap updated, an artifact signed) without the object changing.
                    Err(e) => {
                        e.kind().is_transient()
                            || e.kind() == pko_plugin_host::ErrorKind::DigestMismatch
                            || e.kind() == pko_plugin_host::ErrorKind::Signature
                    }
                };
                let next = match result {
                    Ok(module) => {
                        info!(transform = %key, plugin = %module.info().name, digest = %module.digest(), "transform ready");
                        LoadState::Ready(module)
                    }
                    Err(err) => match &previous {
                        // Only an unreachable source keeps the old module: anything the
                        // fetched bytes themselves fail (digest, signature, compile) does not.
                        Some(previous) if err.kind() == pko_plugin_host::ErrorKind::Source => {
                            warn!(transform = %key, error = %err, digest = %previous.module.digest(), "new module out of reach; the previous one keeps serving");
                            LoadState::Previous {
                                previous: previous.clone(),
                                error: err,
                            }
                        }
                        _ => {
                            warn!(transform = %key, error = %err, "transform not ready");
                            LoadState::Failed(err)
                        }
                    },
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

    pub(super) async fn load(
        &self,
        key: &TransformKey,
        load: &LoadSpec,
    ) -> Result<Arc<Module>, PluginError> {
        // A ProgramTransform's checks count against its namespace's share of the plugin slots.
        let site = match &key.namespace {
            Some(ns) => CallSite::new(key.to_string()).in_namespace(ns.as_str()),
            None => CallSite::new(key.to_string()),
        };
        // Always read the source, even when a module with this digest is already loaded: a
        // transform is ready only if its own source holds the pinned bytes (a digest alone does
        // not grant another namespace's module). Loading known bytes costs only their sha256.
        let source = load.source.as_ref().ok_or_else(|| {
            PluginError::Source("set exactly one of configMap, url and oci".into())
        })?;
        let module = self.load_in_slot(source, &load.sha256, &site).await?;
        self.host
            .validate_config(&module, &load.config, load.limits, &site)
            .await?;
        Ok(module)
    }

    /// Fetches and compiles a module while holding one of the load slots, within the load
    /// budget. The slot bounds the bytes held (a source answers at most the module limit) and
    /// the compilers running: one moves with the work, so a load that outlasts its budget
    /// still holds it until the compile ends, and returns the error at once.
    async fn load_in_slot(
        &self,
        source: &ResolvedSource,
        sha256: &str,
        site: &CallSite,
    ) -> Result<Arc<Module>, PluginError> {
        let metrics = self.host.metrics();
        let closed = |_| PluginError::Host("the module load slots are closed".into());
        let (share, permit) = {
            let _waiting = GaugeGuard::new(&metrics.loads_waiting);
            // The namespace's share first: a tenant past it waits without holding a slot
            // another tenant's load could use.
            let share = match &site.namespace {
                Some(ns) => Some(
                    self.load_shares
                        .of(ns)
                        .acquire_owned()
                        .await
                        .map_err(closed)?,
                ),
                None => None,
            };
            (
                share,
                self.loads.clone().acquire_owned().await.map_err(closed)?,
            )
        };
        let in_flight = GaugeGuard::new(&metrics.loads_in_flight);
        let (fetcher, host) = (self.fetcher.clone(), self.host.clone());
        let (source, sha256, site) = (source.clone(), sha256.to_owned(), site.clone());
        let work = tokio::spawn(async move {
            let _slot = (share, permit, in_flight);
            let bytes = fetcher.fetch(&source, &sha256).await?;
            host.load(bytes, &sha256, &site).await
        });
        match tokio::time::timeout(self.load_timeout, work).await {
            Ok(Ok(result)) => result,
            Ok(Err(e)) => Err(PluginError::Host(format!(
                "the module load task failed: {e}"
            ))),
            Err(_) => Err(PluginError::LoadTimedOut(self.load_timeout)),
        }
    }

    /// Recomputes the chains of the Programs in `namespace` (all when `None`) and sends those
    /// whose fingerprint differs from the one they were last built with.
    pub(super) fn recompute(&self, namespace: Option<&str>) {
        let Some(store) = self.programs.get() else {
            return;
        };
        let programs = store.state();
        let changed: Vec<ObjectRef<StoredProgram>> = {
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

/// Counts one unit on a gauge for as long as it lives (a load waiting, a load running).
struct GaugeGuard(prometheus_client::metrics::gauge::Gauge);

impl GaugeGuard {
    fn new(gauge: &prometheus_client::metrics::gauge::Gauge) -> Self {
        gauge.inc();
        Self(gauge.clone())
    }
}

impl Drop for GaugeGuard {
    fn drop(&mut self) {
        self.0.dec();
    }
}
