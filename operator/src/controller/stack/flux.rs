//! Flux sources watched per kind, as PKO's lazy watch does: the first reconcile of a Stack
//! whose `fluxSource` names a kind of Flux's group starts one watch of that kind, and a new
//! artifact (revision or digest) of a source re-runs the stacks that use it within seconds.
//! Polling stays as a fallback only: slow while the kind is watched, every minute until then.
//!
//! Bounded by construction: at most one watch per Flux kind a Stack may name
//! ([`FLUX_SOURCE_KINDS`]) in each watched namespace (all of them for a cluster-wide install),
//! always in Flux's own group at the version the apiserver prefers, whatever version a Stack
//! spells; the RBAC in `deploy/` and the chart grants `list`/`watch` on exactly these kinds.
//! References to other groups (which a tenant may spell, and RBAC denies) are never watched.
//! The watches live inside the Stack controller's run, so they stop with it (leadership lost).

use std::collections::{HashMap, HashSet};
use std::hash::{Hash, Hasher};
use std::sync::{Mutex, PoisonError};
use std::time::{Duration, Instant};

use futures::channel::mpsc::{UnboundedReceiver, UnboundedSender, unbounded};
use futures::stream::FuturesUnordered;
use futures::{StreamExt, TryStreamExt};
use kube::api::{Api, ApiResource, DynamicObject};
use kube::runtime::WatchStreamExt;
use kube::runtime::reflector::{ObjectRef, Store};
use kube::runtime::watcher::{self, Event};
use kube::{Client, ResourceExt};
use pko_api::stack::{FLUX_SOURCE_KINDS, Stack};
use serde_json::Value;
use tracing::{info, warn};

/// Flux's source group: the only one whose kinds are watched.
pub(crate) const FLUX_GROUP: &str = "source.toolkit.fluxcd.io";

/// How often a source of a watched kind is read anyway (a missed event, a watch restarting).
pub(super) const WATCHED_POLL: Duration = Duration::from_secs(600);
/// How often a source is read while its kind is not watched (yet): PKO's own retry.
pub(super) const UNWATCHED_POLL: Duration = Duration::from_secs(60);

/// A kind the apiserver does not serve (Flux not installed) is looked for again after this
/// long, at the earliest.
const NOT_SERVED_RETRY: Duration = Duration::from_secs(60);

/// Where the watch of one kind stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Watch {
    /// Asked for: discovery or the first list is under way.
    Starting,
    /// Listed: its events reach the stacks.
    Live,
    /// Not served when last looked for: asked for again from this instant.
    NotServed(Instant),
}

/// The kinds watched (or being started) by one Stack controller, and the requests to start
/// new ones; [`drive`] runs them.
pub struct FluxWatches {
    kinds: Mutex<HashMap<&'static str, Watch>>,
    requests: UnboundedSender<&'static str>,
    /// Taken by [`drive`].
    pending: Mutex<Option<UnboundedReceiver<&'static str>>>,
}

impl Default for FluxWatches {
    fn default() -> Self {
        let (requests, pending) = unbounded();
        Self {
            kinds: Mutex::default(),
            requests,
            pending: Mutex::new(Some(pending)),
        }
    }
}

impl FluxWatches {
    /// Asks for a watch of `kind` (of Flux's group) unless one runs or starts; how often a
    /// source of that kind should still be polled.
    pub(super) fn want(&self, kind: &'static str) -> Duration {
        let mut kinds = self.kinds.lock().unwrap_or_else(PoisonError::into_inner);
        match kinds.get(kind) {
            Some(Watch::Live) => WATCHED_POLL,
            Some(Watch::Starting) => UNWATCHED_POLL,
            Some(Watch::NotServed(retry)) if Instant::now() < *retry => UNWATCHED_POLL,
            Some(Watch::NotServed(_)) | None => {
                // A closed channel means the controller is stopping: nothing to start.
                if self.requests.unbounded_send(kind).is_ok() {
                    kinds.insert(kind, Watch::Starting);
                }
                UNWATCHED_POLL
            }
        }
    }

    fn set(&self, kind: &'static str, state: Option<Watch>) {
        let mut kinds = self.kinds.lock().unwrap_or_else(PoisonError::into_inner);
        match state {
            Some(state) => kinds.insert(kind, state),
            None => kinds.remove(kind),
        };
    }
}

/// The kind of Flux's group a reference names, if it is one that may be watched.
pub(super) fn watchable(api_version: &str, kind: &str) -> Option<&'static str> {
    let (group, _version) = api_version.split_once('/')?;
    (group == FLUX_GROUP)
        .then(|| FLUX_SOURCE_KINDS.iter().copied().find(|k| *k == kind))
        .flatten()
}

/// Whether `stack` deploys the source `kind`/`name` of `namespace` (any version of the kind).
fn uses(stack: &Stack, kind: &str, namespace: Option<&str>, name: &str) -> bool {
    let Some(source) = &stack.spec.flux_source else {
        return false;
    };
    let r = &source.source_ref;
    stack.namespace().as_deref() == namespace
        && r.name == name
        && watchable(&r.api_version, &r.kind) == Some(kind)
}

/// What identifies a source's artifact: its revision and digest (none without an artifact).
fn fingerprint(object: &DynamicObject) -> Option<u64> {
    let artifact = object.data.pointer("/status/artifact")?;
    let field = |name: &str| {
        artifact
            .get(name)
            .and_then(Value::as_str)
            .unwrap_or_default()
    };
    let mut hasher = std::collections::hash_map::DefaultHasher::new();
    (field("revision"), field("digest")).hash(&mut hasher);
    Some(hasher.finish())
}

/// What one kind's watch remembers: the artifact last seen of each source a stack uses, so
/// only a new artifact (or a source appearing or going) re-runs the stacks, not every status
/// write of Flux's controller (PKO's `SourceRevisionChangePredicate`).
#[derive(Default)]
struct Seen(HashMap<(Option<String>, String), Option<u64>>);

impl Seen {
    /// Whether `object`'s artifact is news (`deleted`: the source went away).
    fn changed(&mut self, object: &DynamicObject, deleted: bool) -> bool {
        let key = (object.namespace(), object.name_any());
        if deleted {
            return self.0.remove(&key).is_some();
        }
        let now = fingerprint(object);
        self.0.insert(key, now) != Some(now)
    }
}

/// The stacks to reconcile for an event of `object`.
fn stacks_of(
    stacks: &Store<Stack>,
    kind: &str,
    object: &DynamicObject,
) -> HashSet<ObjectRef<Stack>> {
    let namespace = object.namespace();
    let name = object.name_any();
    stacks
        .state()
        .iter()
        .filter(|s| uses(s, kind, namespace.as_deref(), &name))
        .map(|s| ObjectRef::from_obj(&**s))
        .collect()
}

/// What every watch of one Stack controller shares.
pub(super) struct Scope {
    pub client: Client,
    /// The namespace the controller watches; `None`: all.
    pub namespace: Option<String>,
    /// The controller's Stacks.
    pub stacks: Store<Stack>,
    /// Reconciles the Stacks sent.
    pub trigger: UnboundedSender<ObjectRef<Stack>>,
}

/// Runs the watches asked for until the caller drops it (with the controller it serves).
pub(super) async fn drive(watches: &FluxWatches, scope: Scope) {
    let pending = watches
        .pending
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
        .take();
    let Some(mut pending) = pending else {
        return std::future::pending().await;
    };
    let mut running = FuturesUnordered::new();
    loop {
        tokio::select! {
            Some(kind) = pending.next() => running.push(watch_kind(watches, &scope, kind)),
            Some(()) = running.next(), if !running.is_empty() => {}
            else => return std::future::pending().await,
        }
    }
}

/// The served resource of `kind` in Flux's group, at the version the apiserver prefers.
async fn discover(client: &Client, kind: &str) -> Result<ApiResource, String> {
    let group = kube::discovery::oneshot::group(client, FLUX_GROUP)
        .await
        .map_err(|e| format!("discovering {FLUX_GROUP}: {e}"))?;
    group
        .recommended_kind(kind)
        .map(|(resource, _)| resource)
        .ok_or_else(|| format!("{FLUX_GROUP} serves no {kind}"))
}

/// One kind's watch: discovered, listed, then each new artifact re-runs its stacks. A kind
/// the apiserver does not serve is asked for again by a reconcile after [`NOT_SERVED_RETRY`]
/// (its stacks are polled meanwhile).
async fn watch_kind(watches: &FluxWatches, scope: &Scope, kind: &'static str) {
    let resource = match discover(&scope.client, kind).await {
        Ok(resource) => resource,
        Err(e) => {
            info!(kind, error = %e, "Flux source kind not served; its stacks are polled");
            watches.set(
                kind,
                Some(Watch::NotServed(Instant::now() + NOT_SERVED_RETRY)),
            );
            return;
        }
    };
    let api: Api<DynamicObject> = match &scope.namespace {
        Some(ns) => Api::namespaced_with(scope.client.clone(), ns, &resource),
        None => Api::all_with(scope.client.clone(), &resource),
    };
    info!(kind, version = %resource.version, namespace = ?scope.namespace, "watching Flux sources");
    let mut seen = Seen::default();
    let mut events = watcher::watcher(api, watcher::Config::default())
        .default_backoff()
        .boxed();
    loop {
        let event = match events.try_next().await {
            Ok(Some(event)) => event,
            Ok(None) => break,
            Err(e) => {
                warn!(kind, error = %e, "Flux source watch");
                continue;
            }
        };
        let (object, deleted) = match event {
            Event::Apply(o) | Event::InitApply(o) => (o, false),
            Event::Delete(o) => (o, true),
            Event::InitDone => {
                watches.set(kind, Some(Watch::Live));
                continue;
            }
            Event::Init => continue,
        };
        let stacks = stacks_of(&scope.stacks, kind, &object);
        if stacks.is_empty() || !seen.changed(&object, deleted) {
            continue;
        }
        for stack in stacks {
            // Closed: the controller is stopping, and this future with it.
            let _ = scope.trigger.unbounded_send(stack);
        }
    }
    watches.set(kind, None);
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    fn source(name: &str, ns: &str, artifact: Value) -> DynamicObject {
        serde_json::from_value(json!({
            "apiVersion": "source.toolkit.fluxcd.io/v1", "kind": "GitRepository",
            "metadata": {"name": name, "namespace": ns},
            "status": {"artifact": artifact},
        }))
        .expect("source")
    }

    fn stack(ns: &str, api_version: &str, kind: &str, name: &str) -> Stack {
        serde_json::from_value(json!({
            "apiVersion": "pulumi.com/v1", "kind": "Stack",
            "metadata": {"name": "s", "namespace": ns},
            "spec": {"stack": "dev", "fluxSource": {"sourceRef": {
                "apiVersion": api_version, "kind": kind, "name": name}}},
        }))
        .expect("stack")
    }

    #[test]
    fn only_kinds_of_fluxs_group_are_watched_whatever_their_version() {
        assert_eq!(
            watchable("source.toolkit.fluxcd.io/v1", "GitRepository"),
            Some("GitRepository")
        );
        assert_eq!(
            watchable("source.toolkit.fluxcd.io/v1beta2", "OCIRepository"),
            Some("OCIRepository")
        );
        assert_eq!(watchable("example.com/v1", "GitRepository"), None);
        assert_eq!(watchable("source.toolkit.fluxcd.io/v1", "Secret"), None);
        assert_eq!(watchable("source.toolkit.fluxcd.io", "GitRepository"), None);
        for kind in FLUX_SOURCE_KINDS {
            assert_eq!(watchable("source.toolkit.fluxcd.io/v1", kind), Some(kind));
        }
    }

    #[test]
    fn a_source_maps_to_the_stacks_of_its_namespace_that_name_it() {
        let s = stack(
            "a",
            "source.toolkit.fluxcd.io/v1beta2",
            "GitRepository",
            "repo",
        );
        assert!(uses(&s, "GitRepository", Some("a"), "repo"));
        assert!(!uses(&s, "GitRepository", Some("b"), "repo"));
        assert!(!uses(&s, "GitRepository", Some("a"), "other"));
        assert!(!uses(&s, "OCIRepository", Some("a"), "repo"));
        let foreign = stack("a", "example.com/v1", "GitRepository", "repo");
        assert!(!uses(&foreign, "GitRepository", Some("a"), "repo"));
    }

    #[test]
    fn only_a_new_artifact_or_a_source_coming_or_going_is_news() {
        let mut seen = Seen::default();
        let first = source(
            "repo",
            "a",
            json!({"revision": "main@sha1:1", "digest": "sha256:1"}),
        );
        assert!(seen.changed(&first, false), "a source seen first");
        assert!(!seen.changed(&first, false), "the same artifact again");
        let mut conditions = first.clone();
        conditions.data["status"]["conditions"] = json!([{"type": "Ready"}]);
        assert!(
            !seen.changed(&conditions, false),
            "a status write without a new artifact"
        );
        let revision = source(
            "repo",
            "a",
            json!({"revision": "main@sha1:2", "digest": "sha256:1"}),
        );
        assert!(seen.changed(&revision, false), "a new revision");
        let digest = source(
            "repo",
            "a",
            json!({"revision": "main@sha1:2", "digest": "sha256:2"}),
        );
        assert!(seen.changed(&digest, false), "a new digest");
        let mut bare = digest.clone();
        bare.data["status"] = json!({});
        assert!(seen.changed(&bare, false), "the artifact gone");
        assert!(seen.changed(&digest, false), "an artifact again");
        assert!(seen.changed(&digest, true), "the source deleted");
        assert!(!seen.changed(&digest, true), "deleted once");
        let other_ns = source(
            "repo",
            "b",
            json!({"revision": "main@sha1:2", "digest": "sha256:2"}),
        );
        assert!(
            seen.changed(&other_ns, false),
            "another namespace's source of that name"
        );
    }

    #[tokio::test]
    async fn a_kind_is_asked_for_once_and_polled_slowly_once_live() {
        let watches = FluxWatches::default();
        assert_eq!(watches.want("GitRepository"), UNWATCHED_POLL);
        assert_eq!(watches.want("GitRepository"), UNWATCHED_POLL);
        assert_eq!(watches.want("OCIRepository"), UNWATCHED_POLL);
        let mut pending = watches
            .pending
            .lock()
            .expect("lock")
            .take()
            .expect("receiver");
        assert_eq!(pending.next().await, Some("GitRepository"));
        assert_eq!(pending.next().await, Some("OCIRepository"));
        assert!(pending.try_recv().is_err(), "asked once each");
        watches.set("GitRepository", Some(Watch::Live));
        assert_eq!(watches.want("GitRepository"), WATCHED_POLL);
        // A kind not served is asked for again, but not before its retry.
        let later = Instant::now() + Duration::from_secs(3600);
        watches.set("OCIRepository", Some(Watch::NotServed(later)));
        assert_eq!(watches.want("OCIRepository"), UNWATCHED_POLL);
        assert!(pending.try_recv().is_err(), "not yet");
        watches.set("OCIRepository", Some(Watch::NotServed(Instant::now())));
        assert_eq!(watches.want("OCIRepository"), UNWATCHED_POLL);
        assert_eq!(pending.next().await, Some("OCIRepository"));
    }

    /// The RBAC of every install grants `list`/`watch` on exactly the kinds that may be
    /// watched (and `get`, to read one), nothing more in Flux's group.
    #[test]
    fn rbac_allows_exactly_what_is_watched() {
        let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
        let mut expected: Vec<String> = FLUX_SOURCE_KINDS
            .iter()
            .map(|kind| {
                let gvk = kube::api::GroupVersionKind::gvk(FLUX_GROUP, "v1", kind);
                ApiResource::from_gvk(&gvk).plural
            })
            .collect();
        expected.sort();
        for file in [
            "deploy/rbac/cluster_role.yaml",
            "deploy/overlays/namespaced/role.yaml",
        ] {
            let text = std::fs::read_to_string(root.join(file)).expect(file);
            let mut rules = Vec::new();
            for doc in text.split("\n---") {
                let object: Value = yaml_serde::from_str(doc).expect("YAML");
                if let Some(r) = object["rules"].as_array() {
                    rules.extend(r.iter().cloned());
                }
            }
            let flux: Vec<&Value> = rules
                .iter()
                .filter(|r| r["apiGroups"] == json!([FLUX_GROUP]))
                .collect();
            assert_eq!(flux.len(), 1, "{file}: one rule for Flux's group");
            let strings = |v: &Value| -> Vec<String> {
                let mut v: Vec<String> = v
                    .as_array()
                    .expect("list")
                    .iter()
                    .filter_map(Value::as_str)
                    .map(str::to_owned)
                    .collect();
                v.sort();
                v
            };
            assert_eq!(strings(&flux[0]["resources"]), expected, "{file}");
            assert_eq!(
                strings(&flux[0]["verbs"]),
                ["get", "list", "watch"],
                "{file}"
            );
        }
    }
}
