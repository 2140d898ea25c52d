//! Where the operator watches: every namespace, or a list of them (`--watch-namespaces`).
//!
//! A kube-runtime watcher takes one `Api`: one namespace or all of them. For several namespaces
//! [`merged_watch`] runs one watcher per namespace and merges them into one stream that a single
//! store (a reflector, or a consumer's own state) can follow: one initial list for all of them,
//! and a later re-list of one namespace turned into applies and deletes of that namespace only.

use std::collections::{HashMap, HashSet};
use std::fmt::Debug;
use std::pin::Pin;

use futures::{Stream, StreamExt, stream};
use kube::api::{Api, ApiResource, DynamicObject, Resource};
use kube::runtime::WatchStreamExt;
use kube::runtime::reflector::Store;
use kube::runtime::watcher::{self, Event, watcher};
use kube::{Client, ResourceExt};
use serde::de::DeserializeOwned;

/// The namespaces the operator's namespaced watches cover.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub enum WatchScope {
    /// Every namespace (cluster-wide list/watch).
    #[default]
    All,
    /// These namespaces only; never empty, no duplicates.
    Namespaces(Vec<String>),
}

impl WatchScope {
    /// `names` as given on the command line: empty entries are dropped; none left means all.
    pub fn from_names<I, S>(names: I) -> Self
    where
        I: IntoIterator<Item = S>,
        S: AsRef<str>,
    {
        let mut list: Vec<String> = Vec::new();
        for name in names {
            let name = name.as_ref().trim();
            if !name.is_empty() && !list.iter().any(|n| n == name) {
                list.push(name.to_owned());
            }
        }
        if list.is_empty() {
            Self::All
        } else {
            Self::Namespaces(list)
        }
    }

    /// The namespaces, or `[None]` for all of them: one entry per watcher to run.
    pub fn each(&self) -> Vec<Option<String>> {
        match self {
            Self::All => vec![None],
            Self::Namespaces(list) => list.iter().cloned().map(Some).collect(),
        }
    }

    /// One `Api` per namespace (one cluster-wide `Api` for all).
    pub fn apis<K>(&self, client: &Client) -> Vec<Api<K>>
    where
        K: Resource<Scope = kube::core::NamespaceResourceScope>,
        K::DynamicType: Default,
    {
        self.each()
            .into_iter()
            .map(|ns| match ns {
                Some(ns) => Api::namespaced(client.clone(), &ns),
                None => Api::all(client.clone()),
            })
            .collect()
    }

    /// [`Self::apis`] for a dynamic type.
    pub fn apis_with(&self, client: &Client, resource: &ApiResource) -> Vec<Api<DynamicObject>> {
        self.each()
            .into_iter()
            .map(|ns| match ns {
                Some(ns) => Api::namespaced_with(client.clone(), &ns, resource),
                None => Api::all_with(client.clone(), resource),
            })
            .collect()
    }
}

/// How [`merged_watch`] finds what a namespace held before its re-list, to delete what the new
/// list no longer has.
pub enum Known<K: Resource + Clone + 'static>
where
    K::DynamicType: Eq + std::hash::Hash + Clone,
{
    /// The reflector store the merged stream feeds.
    Store(Store<K>),
    /// The merged stream keeps the objects itself (for consumers without a store).
    Keep,
}

type EventStream<K> = Pin<Box<dyn Stream<Item = Result<Event<K>, watcher::Error>> + Send>>;

/// One watcher per `Api` (with the default backoff), merged as described in the module docs.
/// With one `Api` it is that watcher unchanged.
pub fn merged_watch<K>(
    apis: Vec<Api<K>>,
    config: watcher::Config,
    known: Known<K>,
) -> EventStream<K>
where
    K: Resource + Clone + DeserializeOwned + Debug + Send + Sync + 'static,
    K::DynamicType: Eq + std::hash::Hash + Clone + Send + Sync,
{
    let mut apis = apis;
    if apis.len() == 1
        && let Some(api) = apis.pop()
    {
        return watcher(api, config).default_backoff().boxed();
    }
    let count = apis.len();
    let streams = apis.into_iter().enumerate().map(|(i, api)| {
        watcher(api, config.clone())
            .default_backoff()
            .map(move |event| (i, event))
            .boxed()
    });
    let mut merger = Merger::new(count, known);
    stream::select_all(streams)
        .flat_map(move |(i, event)| stream::iter(merger.translate(i, event)))
        .boxed()
}

/// The state that turns per-namespace watcher events into one coherent stream.
struct Merger<K: Resource + Clone + 'static>
where
    K::DynamicType: Eq + std::hash::Hash + Clone,
{
    started: bool,
    /// Watchers whose first list is not complete yet; the merged InitDone waits for all.
    initial: HashSet<usize>,
    /// Watchers re-listing after their first list: the names seen so far.
    relisting: HashMap<usize, HashSet<String>>,
    /// The namespace of each watcher, learned from its objects.
    namespaces: HashMap<usize, String>,
    known: Known<K>,
    /// With [`Known::Keep`]: each watcher's objects by name.
    kept: HashMap<usize, HashMap<String, K>>,
}

impl<K> Merger<K>
where
    K: Resource + Clone + 'static,
    K::DynamicType: Eq + std::hash::Hash + Clone,
{
    fn new(count: usize, known: Known<K>) -> Self {
        Self {
            started: false,
            initial: (0..count).collect(),
            relisting: HashMap::new(),
            namespaces: HashMap::new(),
            known,
            kept: HashMap::new(),
        }
    }

    fn translate(
        &mut self,
        i: usize,
        event: Result<Event<K>, watcher::Error>,
    ) -> Vec<Result<Event<K>, watcher::Error>> {
        let mut out = Vec::new();
        if !self.started {
            self.started = true;
            out.push(Ok(Event::Init));
        }
        let event = match event {
            Ok(event) => event,
            Err(err) => {
                out.push(Err(err));
                return out;
            }
        };
        let initial_open = !self.initial.is_empty();
        match event {
            Event::Init => {
                if !self.initial.contains(&i) {
                    self.relisting.insert(i, HashSet::new());
                }
            }
            Event::InitApply(obj) => {
                self.note(i, &obj);
                if let Some(seen) = self.relisting.get_mut(&i) {
                    seen.insert(obj.name_any());
                }
                // While the merged first list is open, the store is still buffering it.
                out.push(Ok(if initial_open {
                    Event::InitApply(obj)
                } else {
                    Event::Apply(obj)
                }));
            }
            Event::InitDone => {
                if self.initial.remove(&i) {
                    if self.initial.is_empty() {
                        out.push(Ok(Event::InitDone));
                    }
                } else if let Some(seen) = self.relisting.remove(&i) {
                    for gone in self.stale(i, &seen) {
                        self.forget(i, &gone);
                        out.push(Ok(Event::Delete(gone)));
                    }
                }
            }
            Event::Apply(obj) => {
                self.note(i, &obj);
                out.push(Ok(Event::Apply(obj)));
            }
            Event::Delete(obj) => {
                self.forget(i, &obj);
                out.push(Ok(Event::Delete(obj)));
            }
        }
        out
    }

    fn note(&mut self, i: usize, obj: &K) {
        if let Some(ns) = obj.meta().namespace.as_ref() {
            self.namespaces.entry(i).or_insert_with(|| ns.clone());
        }
        if matches!(self.known, Known::Keep) {
            self.kept
                .entry(i)
                .or_default()
                .insert(obj.name_any(), obj.clone());
        }
    }

    fn forget(&mut self, i: usize, obj: &K) {
        if let Some(kept) = self.kept.get_mut(&i) {
            kept.remove(&obj.name_any());
        }
    }

    /// What watcher `i` held before its re-list and did not list again.
    fn stale(&self, i: usize, seen: &HashSet<String>) -> Vec<K> {
        let held: Vec<K> = match &self.known {
            Known::Keep => self
                .kept
                .get(&i)
                .map(|m| m.values().cloned().collect())
                .unwrap_or_default(),
            Known::Store(store) => match self.namespaces.get(&i) {
                Some(ns) => store
                    .state()
                    .into_iter()
                    .filter(|o| o.meta().namespace.as_deref() == Some(ns.as_str()))
                    .map(|o| (*o).clone())
                    .collect(),
                // Nothing was ever listed there, so nothing can be stale.
                None => Vec::new(),
            },
        };
        held.into_iter()
            .filter(|o| !seen.contains(&o.name_any()))
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use k8s_openapi::api::core::v1::ConfigMap;
    use kube::api::ObjectMeta;

    use super::*;

    fn cm(ns: &str, name: &str) -> ConfigMap {
        ConfigMap {
            metadata: ObjectMeta {
                namespace: Some(ns.into()),
                name: Some(name.into()),
                ..ObjectMeta::default()
            },
            ..ConfigMap::default()
        }
    }

    fn kinds(events: &[Result<Event<ConfigMap>, watcher::Error>]) -> Vec<String> {
        events
            .iter()
            .map(|e| match e {
                Ok(Event::Init) => "init".to_owned(),
                Ok(Event::InitApply(o)) => format!("initapply {}", o.name_any()),
                Ok(Event::InitDone) => "initdone".to_owned(),
                Ok(Event::Apply(o)) => format!("apply {}", o.name_any()),
                Ok(Event::Delete(o)) => format!("delete {}", o.name_any()),
                Err(_) => "error".to_owned(),
            })
            .collect()
    }

    #[test]
    fn scope_from_names() {
        assert_eq!(
            WatchScope::from_names(Vec::<String>::new()),
            WatchScope::All
        );
        assert_eq!(WatchScope::from_names(["", " "]), WatchScope::All);
        assert_eq!(
            WatchScope::from_names(["a", "b", "a", ""]),
            WatchScope::Namespaces(vec!["a".into(), "b".into()])
        );
    }

    #[test]
    fn one_initial_list_for_all_namespaces_then_relists_are_per_namespace() {
        let mut m = Merger::<ConfigMap>::new(2, Known::Keep);
        let mut all = Vec::new();
        for (i, e) in [
            (0, Event::Init),
            (1, Event::Init),
            (0, Event::InitApply(cm("a", "x"))),
            (0, Event::InitDone),
            (1, Event::InitApply(cm("b", "y"))),
            (1, Event::InitApply(cm("b", "z"))),
            (1, Event::InitDone),
        ] {
            all.extend(m.translate(i, Ok(e)));
        }
        assert_eq!(
            kinds(&all),
            [
                "init",
                "initapply x",
                "initapply y",
                "initapply z",
                "initdone"
            ]
        );
        // Namespace b re-lists without z: z is deleted, a is untouched.
        let mut relist = Vec::new();
        for e in [Event::Init, Event::InitApply(cm("b", "y")), Event::InitDone] {
            relist.extend(m.translate(1, Ok(e)));
        }
        assert_eq!(kinds(&relist), ["apply y", "delete z"]);
    }
}
