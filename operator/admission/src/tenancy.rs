//! Tenancy data for the policies, from TenancyPolicy objects and namespace labels.
//!
//! Both are watched (reflectors), so a change to a TenancyPolicy or to a namespace's labels
//! applies to the next request, with no restart and no pause. Every watch event counts as a
//! change ([`Tenancy::changes`]); the shared data document ([`Tenancy::shared_document`]) is
//! rebuilt from the stores only after one, and lists, per TenancyPolicy, every namespace it
//! selects among those the watch knows. A namespace the watch has not seen yet (created a
//! moment ago) is read directly and gets a document of its own, so a selector never misses it.

use std::collections::{BTreeMap, BTreeSet, HashSet};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use futures::StreamExt;
use k8s_openapi::api::core::v1::Namespace;
use kube::core::{PartialObjectMeta, Selector, SelectorExt};
use kube::runtime::reflector::{self, ObjectRef, Store};
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Api, Client, ResourceExt};
use pko_api::tenancy::{EnforcementAction, TenancyPolicy, TenancyPolicySpec};
use serde_json::{Map, Value, json};
use tracing::warn;

/// A namespace GET on a watch miss must not eat the evaluation budget.
const NAMESPACE_LOOKUP_TIMEOUT: Duration = Duration::from_secs(1);
/// How long a namespace the apiserver said does not exist is taken as absent. Absent means no
/// labels, so no label selector picks it: the strictest rules apply meanwhile.
const ABSENT_TTL: Duration = Duration::from_secs(10);
/// Absent namespaces remembered at once (names come from unauthenticated requests).
const MAX_ABSENT: usize = 4096;
/// Namespace GETs in flight at once; more misses are answered as lookup failures.
const MAX_LOOKUPS: usize = 4;

/// Errors while building the tenancy data of a request.
#[derive(Debug, thiserror::Error)]
pub enum TenancyError {
    #[error("cannot read the labels of namespace {namespace}: {reason}")]
    NamespaceLookup { namespace: String, reason: String },
}

/// Settings that apply to every namespace.
#[derive(Clone, Debug)]
pub struct TenancySettings {
    /// Action of violations in namespaces that no TenancyPolicy selects.
    pub default_action: EnforcementAction,
    /// Every name and port the operator's file server answers to.
    pub file_server: FileServerNames,
}

impl Default for TenancySettings {
    fn default() -> Self {
        Self {
            default_action: EnforcementAction::Deny,
            file_server: FileServerNames::default(),
        }
    }
}

/// The addresses of the operator's file server, as the policies compare parsed URLs with them
/// (see [`crate::urls`]): no host means any host (the `/programs/<ns>/...` path alone then
/// identifies a Program URL), no port any port.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct FileServerNames {
    pub hosts: Vec<String>,
    pub ports: Vec<u16>,
}

impl FileServerNames {
    /// Adds a host and a port once each.
    pub fn add(&mut self, host: String, port: Option<u16>) {
        if !self.hosts.contains(&host) {
            self.hosts.push(host);
        }
        if let Some(port) = port {
            self.add_port(port);
        }
    }

    pub fn add_port(&mut self, port: u16) {
        if !self.ports.contains(&port) {
            self.ports.push(port);
        }
    }

    /// Every DNS name of Service `name` in `namespace`: the short name (from its own
    /// namespace), `<name>.<namespace>`, `.svc` and `.svc.<cluster domain>`.
    pub fn add_service(&mut self, name: &str, namespace: &str, cluster_domain: &str) {
        for host in [
            name.to_owned(),
            format!("{name}.{namespace}"),
            format!("{name}.{namespace}.svc"),
            format!(
                "{name}.{namespace}.svc.{}",
                cluster_domain.trim_matches('.')
            ),
        ] {
            self.add(host.to_ascii_lowercase(), None);
        }
    }
}

/// Where namespace labels come from.
#[derive(Clone)]
enum Labels {
    /// A namespace watch, with a direct read on a miss.
    Watched(Arc<WatchedLabels>),
    /// A fixed map (tests, offline evaluation).
    Fixed(Arc<BTreeMap<String, BTreeMap<String, String>>>),
}

struct WatchedLabels {
    store: Store<PartialObjectMeta<Namespace>>,
    api: Api<Namespace>,
    absent: std::sync::Mutex<AbsentNamespaces>,
    lookups: tokio::sync::Semaphore,
}

/// Namespaces the apiserver recently said do not exist, so that requests naming invented
/// namespaces cost one GET per name per [`ABSENT_TTL`] at most, in bounded memory.
#[derive(Debug, Default)]
pub struct AbsentNamespaces {
    since: std::collections::HashMap<String, Instant>,
}

impl AbsentNamespaces {
    /// Whether `namespace` was found absent less than [`ABSENT_TTL`] before `now`.
    pub fn is_absent(&self, namespace: &str, now: Instant) -> bool {
        self.since
            .get(namespace)
            .is_some_and(|&at| now.saturating_duration_since(at) < ABSENT_TTL)
    }

    /// Remembers `namespace` as absent at `now`; when full, forgets expired entries first and
    /// remembers nothing more if none has expired.
    pub fn insert(&mut self, namespace: &str, now: Instant) {
        if self.since.len() >= MAX_ABSENT && !self.since.contains_key(namespace) {
            self.since
                .retain(|_, &mut at| now.saturating_duration_since(at) < ABSENT_TTL);
            if self.since.len() >= MAX_ABSENT {
                return;
            }
        }
        self.since.insert(namespace.to_owned(), now);
    }

    pub fn len(&self) -> usize {
        self.since.len()
    }

    pub fn is_empty(&self) -> bool {
        self.since.is_empty()
    }
}

/// The TenancyPolicies and namespace labels the policies are evaluated against.
#[derive(Clone)]
pub struct Tenancy {
    policies: PolicySource,
    labels: Labels,
    settings: Arc<TenancySettings>,
    synced: Arc<AtomicBool>,
    /// Counts changes to the stores; bumped after each change is in its store.
    changes: Arc<AtomicU64>,
}

#[derive(Clone)]
enum PolicySource {
    Watched(Store<TenancyPolicy>),
    Fixed(Arc<std::sync::Mutex<Vec<Arc<TenancyPolicy>>>>),
}

/// The namespaces a shared data document is exact for.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Coverage {
    /// Every namespace: no TenancyPolicy selects by label.
    All,
    /// The namespaces whose labels were known when the document was built (and cluster-scoped
    /// requests, which no policy selects).
    Known(HashSet<String>),
}

impl Coverage {
    pub fn covers(&self, namespace: &str) -> bool {
        match self {
            Coverage::All => true,
            Coverage::Known(names) => namespace.is_empty() || names.contains(namespace),
        }
    }
}

/// The data document shared by every request, and the namespaces it is exact for.
#[derive(Clone, Debug)]
pub struct SharedDocument {
    pub value: Value,
    pub coverage: Coverage,
}

impl Tenancy {
    /// Watches TenancyPolicies and namespace metadata cluster-wide. Returns the view and the
    /// future that drives both watches (the caller spawns it).
    pub fn watch(
        client: Client,
        settings: TenancySettings,
    ) -> (Self, impl std::future::Future<Output = ()> + Send + 'static) {
        let (policy_store, policy_writer) = reflector::store::<TenancyPolicy>();
        let (ns_store, ns_writer) = reflector::store::<PartialObjectMeta<Namespace>>();
        let synced = Arc::new(AtomicBool::new(false));
        let changes = Arc::new(AtomicU64::new(0));
        let tenancy = Self {
            changes: changes.clone(),
            policies: PolicySource::Watched(policy_store.clone()),
            labels: Labels::Watched(Arc::new(WatchedLabels {
                store: ns_store.clone(),
                api: Api::all(client.clone()),
                absent: std::sync::Mutex::new(AbsentNamespaces::default()),
                lookups: tokio::sync::Semaphore::new(MAX_LOOKUPS),
            })),
            settings: Arc::new(settings),
            synced: synced.clone(),
        };
        let policies_api: Api<TenancyPolicy> = Api::all(client.clone());
        // Metadata only: labels are all we need.
        let namespaces_api: Api<PartialObjectMeta<Namespace>> = Api::all(client);
        // Every event, a relist's included, is in the store when `reflect` passes it on; the
        // change is counted only then, so a request that sees the count sees the change.
        let policy_changes = changes.clone();
        let driver = async move {
            let policies = watcher(policies_api, watcher::Config::default().any_semantic())
                .default_backoff()
                .reflect(policy_writer)
                .for_each(|event| {
                    match event {
                        Ok(_) => {
                            policy_changes.fetch_add(1, Ordering::AcqRel);
                        }
                        Err(err) => warn!(error = %err, "TenancyPolicy watch failed; retrying"),
                    }
                    std::future::ready(())
                });
            let namespaces = watcher(namespaces_api, watcher::Config::default().any_semantic())
                .default_backoff()
                .reflect(ns_writer)
                .for_each(|event| {
                    match event {
                        Ok(_) => {
                            changes.fetch_add(1, Ordering::AcqRel);
                        }
                        Err(err) => warn!(error = %err, "namespace watch failed; retrying"),
                    }
                    std::future::ready(())
                });
            let ready = async move {
                if policy_store.wait_until_ready().await.is_ok()
                    && ns_store.wait_until_ready().await.is_ok()
                {
                    synced.store(true, Ordering::Release);
                }
                futures::future::pending::<()>().await;
            };
            tokio::select! {
                () = policies => {},
                () = namespaces => {},
                () = ready => {},
            }
        };
        (tenancy, driver)
    }

    /// The given policies, with namespace labels read from the apiserver on demand (a direct
    /// read per namespace, no watch): for tests of the lookup itself.
    pub fn looking_up(
        client: Client,
        policies: Vec<TenancyPolicy>,
        settings: TenancySettings,
    ) -> Self {
        Self {
            policies: PolicySource::Fixed(Arc::new(std::sync::Mutex::new(
                policies.into_iter().map(Arc::new).collect(),
            ))),
            labels: Labels::Watched(Arc::new(WatchedLabels {
                store: reflector::store::<PartialObjectMeta<Namespace>>().0,
                api: Api::all(client),
                absent: std::sync::Mutex::new(AbsentNamespaces::default()),
                lookups: tokio::sync::Semaphore::new(MAX_LOOKUPS),
            })),
            settings: Arc::new(settings),
            synced: Arc::new(AtomicBool::new(true)),
            changes: Arc::new(AtomicU64::new(0)),
        }
    }

    /// A fixed view: the given policies and namespace labels (for tests and offline runs).
    pub fn fixed(
        policies: Vec<TenancyPolicy>,
        labels: BTreeMap<String, BTreeMap<String, String>>,
        settings: TenancySettings,
    ) -> Self {
        Self {
            policies: PolicySource::Fixed(Arc::new(std::sync::Mutex::new(
                policies.into_iter().map(Arc::new).collect(),
            ))),
            labels: Labels::Fixed(Arc::new(labels)),
            settings: Arc::new(settings),
            synced: Arc::new(AtomicBool::new(true)),
            changes: Arc::new(AtomicU64::new(0)),
        }
    }

    /// Replaces the policies of a fixed view (tests, offline runs); a watched view ignores it.
    pub fn set_policies(&self, policies: Vec<TenancyPolicy>) {
        if let PolicySource::Fixed(list) = &self.policies {
            *lock(list) = policies.into_iter().map(Arc::new).collect();
            self.changes.fetch_add(1, Ordering::AcqRel);
        }
    }

    /// How many changes the stores have seen: the shared document needs rebuilding only
    /// when this moved.
    pub fn changes(&self) -> u64 {
        self.changes.load(Ordering::Acquire)
    }

    fn all_policies(&self) -> Vec<Arc<TenancyPolicy>> {
        match &self.policies {
            PolicySource::Watched(store) => store.state(),
            PolicySource::Fixed(list) => lock(list).clone(),
        }
    }

    /// The namespaces whose labels are known, with their labels.
    fn known_namespaces(&self) -> Vec<(String, BTreeMap<String, String>)> {
        match &self.labels {
            Labels::Fixed(map) => map.iter().map(|(k, v)| (k.clone(), v.clone())).collect(),
            Labels::Watched(watched) => watched
                .store
                .state()
                .iter()
                .map(|ns| (ns.name_any(), ns.labels().clone()))
                .collect(),
        }
    }

    /// The data document shared by every request: `base` (the bundle's data) plus `tenancy`,
    /// where each TenancyPolicy lists every namespace it selects (by name, or by label among
    /// the namespaces whose labels are known). Read [`Tenancy::changes`] before calling it.
    pub fn shared_document(&self, base: &Value) -> SharedDocument {
        let mut policies = self.all_policies();
        policies.sort_by_key(|p| p.name_any());
        let by_label = policies.iter().any(|p| p.spec.namespace_selector.is_some());
        let known = if by_label {
            self.known_namespaces()
        } else {
            Vec::new()
        };
        let entries = policies
            .iter()
            .filter_map(|p| {
                let name = p.name_any();
                let mut selected: BTreeSet<&str> = p
                    .spec
                    .namespaces
                    .iter()
                    .flatten()
                    .map(String::as_str)
                    .filter(|n| !n.is_empty())
                    .collect();
                if let Some(selector) = &p.spec.namespace_selector {
                    match Selector::try_from(selector.clone()) {
                        Ok(selector) => selected.extend(
                            known
                                .iter()
                                .filter(|(_, labels)| selector.matches(labels))
                                .map(|(ns, _)| ns.as_str()),
                        ),
                        Err(e) => {
                            warn!(policy = %name, error = %e, "invalid namespaceSelector; it selects nothing")
                        }
                    }
                }
                (!selected.is_empty()).then(|| policy_entry(p, selected.into_iter().collect()))
            })
            .collect();
        let coverage = if by_label {
            Coverage::Known(known.into_iter().map(|(ns, _)| ns).collect())
        } else {
            Coverage::All
        };
        SharedDocument {
            value: document(base, &self.settings, entries),
            coverage,
        }
    }

    /// Set once both watches have listed everything (readiness).
    pub fn synced_flag(&self) -> Arc<AtomicBool> {
        self.synced.clone()
    }

    /// `data` for a request in `namespace`: `base` (the bundle's data) plus `tenancy`.
    pub async fn data_for(&self, base: &Value, namespace: &str) -> Result<Value, TenancyError> {
        let policies = self.selecting(namespace).await?;
        Ok(data_document(base, &self.settings, namespace, &policies))
    }

    /// The TenancyPolicies that select `namespace`, sorted by name.
    async fn selecting(&self, namespace: &str) -> Result<Vec<Arc<TenancyPolicy>>, TenancyError> {
        let all = self.all_policies();
        if namespace.is_empty() || all.is_empty() {
            return Ok(Vec::new());
        }
        // Labels are read only when some policy selects by label.
        let needs_labels = all.iter().any(|p| p.spec.namespace_selector.is_some());
        let labels = if needs_labels {
            self.labels_of(namespace).await?
        } else {
            BTreeMap::new()
        };
        let mut selecting: Vec<_> = all
            .into_iter()
            .filter(|p| selects(&p.name_any(), &p.spec, namespace, &labels))
            .collect();
        selecting.sort_by_key(|p| p.name_any());
        Ok(selecting)
    }

    async fn labels_of(&self, namespace: &str) -> Result<BTreeMap<String, String>, TenancyError> {
        match &self.labels {
            Labels::Fixed(map) => Ok(map.get(namespace).cloned().unwrap_or_default()),
            Labels::Watched(watched) => {
                if let Some(ns) = watched.store.get(&ObjectRef::new(namespace)) {
                    return Ok(ns.labels().clone());
                }
                // The name goes into a request path: a label or no request.
                if !pko_api::names::is_dns1123_label(namespace) {
                    return Err(TenancyError::NamespaceLookup {
                        namespace: namespace.chars().take(128).collect(),
                        reason: "the name is not a DNS-1123 label".into(),
                    });
                }
                if lock(&watched.absent).is_absent(namespace, Instant::now()) {
                    return Ok(BTreeMap::new());
                }
                let Ok(_lookup) = watched.lookups.try_acquire() else {
                    return Err(TenancyError::NamespaceLookup {
                        namespace: namespace.to_owned(),
                        reason: format!(
                            "{MAX_LOOKUPS} lookups of namespaces the watch has not seen are in flight"
                        ),
                    });
                };
                let lookup = tokio::time::timeout(
                    NAMESPACE_LOOKUP_TIMEOUT,
                    watched.api.get_metadata_opt(namespace),
                )
                .await;
                match lookup {
                    Ok(Ok(Some(ns))) => Ok(ns.labels().clone()),
                    // A namespace that does not exist has no labels; the apiserver rejects the
                    // request for it anyway.
                    Ok(Ok(None)) => {
                        lock(&watched.absent).insert(namespace, Instant::now());
                        Ok(BTreeMap::new())
                    }
                    Ok(Err(e)) => Err(TenancyError::NamespaceLookup {
                        namespace: namespace.to_owned(),
                        reason: e.to_string(),
                    }),
                    Err(_) => Err(TenancyError::NamespaceLookup {
                        namespace: namespace.to_owned(),
                        reason: format!("no answer within {NAMESPACE_LOOKUP_TIMEOUT:?}"),
                    }),
                }
            }
        }
    }
}

fn lock<T>(m: &std::sync::Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// Whether a policy selects a namespace: by name, or by a label selector. An invalid selector
/// selects nothing (and says so in the log).
pub fn selects(
    policy: &str,
    spec: &TenancyPolicySpec,
    namespace: &str,
    labels: &BTreeMap<String, String>,
) -> bool {
    if spec
        .namespaces
        .as_ref()
        .is_some_and(|names| names.iter().any(|n| n == namespace))
    {
        return true;
    }
    match &spec.namespace_selector {
        Some(selector) => match Selector::try_from(selector.clone()) {
            Ok(selector) => selector.matches(labels),
            Err(e) => {
                warn!(policy, error = %e, "invalid namespaceSelector; it selects nothing");
                false
            }
        },
        None => false,
    }
}

/// The data document of one request (documented in docs/policies.md): `base` with
/// `tenancy = {defaultAction, fileServer: {hosts, ports}, policies: [...]}`, where each selecting
/// policy lists the request's namespace in `namespaces`. The policies decide the same with it as
/// with the shared document, which lists every namespace a policy selects.
pub fn data_document(
    base: &Value,
    settings: &TenancySettings,
    namespace: &str,
    policies: &[Arc<TenancyPolicy>],
) -> Value {
    let entries = policies
        .iter()
        .map(|p| policy_entry(p, vec![namespace]))
        .collect();
    document(base, settings, entries)
}

/// One TenancyPolicy in `data.tenancy.policies`, selecting `namespaces`.
fn policy_entry(p: &TenancyPolicy, namespaces: Vec<&str>) -> Value {
    let mut entry = Map::new();
    entry.insert("name".into(), json!(p.name_any()));
    entry.insert("action".into(), json!(p.spec.enforcement_action.as_str()));
    entry.insert("namespaces".into(), json!(namespaces));
    entry.insert(
        "exemptFromRestricted".into(),
        json!(p.spec.exempt_from_restricted.unwrap_or(false)),
    );
    let lists = [
        ("allowedServiceAccounts", &p.spec.allowed_service_accounts),
        ("allowedImagePrefixes", &p.spec.allowed_image_prefixes),
        ("allowedTransformDigests", &p.spec.allowed_transform_digests),
        (
            "allowedTransformRegistries",
            &p.spec.allowed_transform_registries,
        ),
        ("allowedTransformKeys", &p.spec.allowed_transform_keys),
    ];
    for (key, list) in lists {
        if let Some(list) = list {
            entry.insert(key.into(), json!(list));
        }
    }
    Value::Object(entry)
}

/// `base` with `tenancy` holding the settings and `policies`.
fn document(base: &Value, settings: &TenancySettings, policies: Vec<Value>) -> Value {
    let mut data = match base {
        Value::Object(map) => map.clone(),
        _ => Map::new(),
    };
    data.insert(
        "tenancy".into(),
        json!({
            "defaultAction": settings.default_action.as_str(),
            "fileServer": {
                "hosts": settings.file_server.hosts,
                "ports": settings.file_server.ports,
            },
            "policies": policies,
        }),
    );
    Value::Object(data)
}

#[cfg(test)]
mod tests {
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::{LabelSelector, LabelSelectorRequirement};

    use super::*;

    #[test]
    fn absent_namespaces_expire_and_stay_bounded() {
        let mut absent = AbsentNamespaces::default();
        let t0 = Instant::now();
        absent.insert("ghost", t0);
        assert!(absent.is_absent("ghost", t0 + Duration::from_secs(1)));
        assert!(!absent.is_absent("ghost", t0 + ABSENT_TTL));
        assert!(!absent.is_absent("other", t0));
        for i in 0..MAX_ABSENT + 100 {
            absent.insert(&format!("ns-{i}"), t0);
        }
        assert_eq!(absent.len(), MAX_ABSENT);
        // Expired entries make room.
        absent.insert("late", t0 + ABSENT_TTL);
        assert_eq!(absent.len(), 1);
        assert!(absent.is_absent("late", t0 + ABSENT_TTL));
    }

    fn policy(name: &str, spec: TenancyPolicySpec) -> TenancyPolicy {
        TenancyPolicy::new(name, spec)
    }

    fn labels(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
        pairs
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect()
    }

    #[test]
    fn selects_by_name_and_by_labels() {
        let by_name = TenancyPolicySpec {
            namespaces: Some(vec!["a".into()]),
            ..Default::default()
        };
        assert!(selects("p", &by_name, "a", &BTreeMap::new()));
        assert!(!selects("p", &by_name, "b", &BTreeMap::new()));
        let by_label = TenancyPolicySpec {
            namespace_selector: Some(LabelSelector {
                match_labels: Some(labels(&[("team", "a")])),
                match_expressions: Some(vec![LabelSelectorRequirement {
                    key: "tier".into(),
                    operator: "NotIn".into(),
                    values: Some(vec!["system".into()]),
                }]),
            }),
            ..Default::default()
        };
        assert!(selects("p", &by_label, "x", &labels(&[("team", "a")])));
        assert!(!selects(
            "p",
            &by_label,
            "x",
            &labels(&[("team", "a"), ("tier", "system")])
        ));
        assert!(!selects("p", &by_label, "x", &labels(&[("team", "b")])));
        let everything = TenancyPolicySpec {
            namespace_selector: Some(LabelSelector::default()),
            ..Default::default()
        };
        assert!(selects("p", &everything, "x", &BTreeMap::new()));
        let invalid = TenancyPolicySpec {
            namespace_selector: Some(LabelSelector {
                match_expressions: Some(vec![LabelSelectorRequirement {
                    key: "k".into(),
                    operator: "Sometimes".into(),
                    values: None,
                }]),
                match_labels: None,
            }),
            ..Default::default()
        };
        assert!(!selects("p", &invalid, "x", &BTreeMap::new()));
    }

    #[tokio::test]
    async fn data_lists_only_selecting_policies_sorted() {
        let tenancy = Tenancy::fixed(
            vec![
                policy(
                    "z-images",
                    TenancyPolicySpec {
                        enforcement_action: EnforcementAction::Warn,
                        namespace_selector: Some(LabelSelector {
                            match_labels: Some(labels(&[("team", "a")])),
                            match_expressions: None,
                        }),
                        allowed_image_prefixes: Some(vec!["registry/".into()]),
                        ..Default::default()
                    },
                ),
                policy(
                    "a-legacy",
                    TenancyPolicySpec {
                        namespaces: Some(vec!["team-a".into()]),
                        exempt_from_restricted: Some(true),
                        ..Default::default()
                    },
                ),
                policy(
                    "other",
                    TenancyPolicySpec {
                        namespaces: Some(vec!["team-b".into()]),
                        ..Default::default()
                    },
                ),
            ],
            BTreeMap::from([("team-a".to_owned(), labels(&[("team", "a")]))]),
            TenancySettings {
                default_action: EnforcementAction::Dryrun,
                file_server: FileServerNames {
                    hosts: vec!["fs".into()],
                    ports: vec![80],
                },
            },
        );
        let data = tenancy
            .data_for(&json!({"static": 1}), "team-a")
            .await
            .expect("data");
        assert_eq!(
            data,
            json!({
                "static": 1,
                "tenancy": {
                    "defaultAction": "dryrun",
                    "fileServer": {"hosts": ["fs"], "ports": [80]},
                    "policies": [
                        {"name": "a-legacy", "action": "deny", "namespaces": ["team-a"], "exemptFromRestricted": true},
                        {"name": "z-images", "action": "warn", "namespaces": ["team-a"], "exemptFromRestricted": false, "allowedImagePrefixes": ["registry/"]},
                    ],
                },
            })
        );
        let none = tenancy.data_for(&json!({}), "team-c").await.expect("data");
        assert_eq!(none["tenancy"]["policies"], json!([]));
    }

    #[test]
    fn the_shared_document_lists_every_namespace_a_policy_selects() {
        let by_label = |name: &str| {
            policy(
                name,
                TenancyPolicySpec {
                    namespaces: Some(vec!["named".into(), String::new()]),
                    namespace_selector: Some(LabelSelector {
                        match_labels: Some(labels(&[("team", "a")])),
                        match_expressions: None,
                    }),
                    ..Default::default()
                },
            )
        };
        let nobody = policy(
            "nobody",
            TenancyPolicySpec {
                namespace_selector: Some(LabelSelector {
                    match_labels: Some(labels(&[("team", "none")])),
                    match_expressions: None,
                }),
                ..Default::default()
            },
        );
        let tenancy = Tenancy::fixed(
            vec![by_label("b-team"), nobody, by_label("a-team")],
            BTreeMap::from([
                ("x".to_owned(), labels(&[("team", "a")])),
                ("y".to_owned(), labels(&[("team", "b")])),
                ("w".to_owned(), labels(&[("team", "a")])),
            ]),
            TenancySettings::default(),
        );
        let shared = tenancy.shared_document(&json!({}));
        let entries = shared.value["tenancy"]["policies"]
            .as_array()
            .expect("policies")
            .clone();
        let listed: Vec<(Value, Value)> = entries
            .iter()
            .map(|e| (e["name"].clone(), e["namespaces"].clone()))
            .collect();
        assert_eq!(
            listed,
            vec![
                (json!("a-team"), json!(["named", "w", "x"])),
                (json!("b-team"), json!(["named", "w", "x"])),
            ]
        );
        // Labels are known for x, y, w only; a cluster-scoped request is never selected.
        for ns in ["x", "y", "w", ""] {
            assert!(shared.coverage.covers(ns), "{ns}");
        }
        assert!(!shared.coverage.covers("named"));
        assert!(!shared.coverage.covers("new"));

        // Without label selectors the document is exact for every namespace.
        let before = tenancy.changes();
        tenancy.set_policies(vec![policy(
            "names",
            TenancyPolicySpec {
                namespaces: Some(vec!["a".into()]),
                ..Default::default()
            },
        )]);
        assert!(tenancy.changes() > before);
        let shared = tenancy.shared_document(&json!({}));
        assert_eq!(shared.coverage, Coverage::All);
        assert_eq!(
            shared.value["tenancy"]["policies"][0]["namespaces"],
            json!(["a"])
        );
    }
}
