//! Taking over the fields PKO's managers own, so a switch-over leaves nothing of PKO's behind.
//!
//! Server-side apply removes a field only when the manager that owned it applies without it.
//! PKO wrote under `pulumi-kubernetes-operator[/…]`; after a switch nobody applies as PKO
//! again, so every field only PKO owned (an init container's `args`, PKO's env on the agent, a
//! `Stalled` condition, removed outputs, a `currentUpdate`) would stay forever. As client-go's
//! `csaupgrade` does for client-side apply, the field sets of PKO's entries are moved into our
//! manager's Apply entry (same subresource) with one compare-and-swap patch of
//! `managedFields`; the next apply then owns them and drops what it no longer sets.

use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::api::{Api, GetParams, Patch, PatchParams};
use kube::core::Request;
use pko_api::decode::bounded_value;
use serde::{Deserialize, Serialize};
use serde_json::value::RawValue;
use serde_json::{Map, Value};
use tracing::info;

/// Which part of an object a manager writes: the main resource or its status.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Part {
    Main,
    Status,
}

impl Part {
    fn subresource(self) -> Option<&'static str> {
        match self {
            Part::Main => None,
            Part::Status => Some("status"),
        }
    }
}

pub use pko_api::decode::is_pko_manager as is_pkos;

/// Whether PKO's managers own anything of `part` on the object (read from the watched object,
/// whose entries carry no field sets): its writer must then write even when nothing else
/// changed, so what only PKO set goes.
pub fn pko_owns(meta: &ObjectMeta, part: Part) -> bool {
    meta.managed_fields.as_ref().is_some_and(|entries| {
        entries.iter().any(|e| {
            e.subresource.as_deref() == part.subresource()
                && e.manager.as_deref().is_some_and(is_pkos)
        })
    })
}

/// A `managedFields` entry as the apiserver sends it, its field set kept as raw text: a
/// tenant's entry nested past serde_json's limit is passed back untouched.
#[derive(Clone, Debug, Deserialize, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Entry {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub api_version: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fields_type: Option<String>,
    #[serde(default, rename = "fieldsV1", skip_serializing_if = "Option::is_none")]
    pub fields_v1: Option<Box<RawValue>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub manager: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub operation: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub subresource: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub time: Option<String>,
}

/// A field set that is no bounded JSON object: told as the decode failure it is (the callers
/// report apiserver calls, and this is one's answer).
fn unreadable(manager: &str) -> kube::Error {
    kube::Error::SerdeError(serde::de::Error::custom(format!(
        "the field set of {manager} in managedFields is not a bounded JSON object"
    )))
}

/// The entries with every PKO entry of `part` folded into `ours`' Apply entry of the same
/// part; `None` when PKO owns nothing there. Entries of the other part, and everyone else's,
/// are kept as they are.
pub fn taken_over(
    entries: &[Entry],
    ours: &str,
    part: Part,
) -> Result<Option<Vec<Entry>>, kube::Error> {
    let of_part = |e: &Entry| e.subresource.as_deref() == part.subresource();
    let theirs = |e: &Entry| of_part(e) && e.manager.as_deref().is_some_and(is_pkos);
    if !entries.iter().any(theirs) {
        return Ok(None);
    }
    let is_ours = |e: &Entry| {
        of_part(e) && e.manager.as_deref() == Some(ours) && e.operation.as_deref() == Some("Apply")
    };
    let mut fields = Value::Object(Map::new());
    let mut api_version = None;
    let mut time = None;
    for e in entries.iter().filter(|e| theirs(e) || is_ours(e)) {
        if let Some(raw) = &e.fields_v1 {
            let set = bounded_value(raw.get())
                .ok_or_else(|| unreadable(e.manager.as_deref().unwrap_or_default()))?;
            union(&mut fields, &set);
        }
        // Our entry's version wins; PKO's objects are all at the one version both serve.
        if api_version.is_none() || is_ours(e) {
            api_version.clone_from(&e.api_version);
        }
        // RFC 3339 in UTC: the text orders as the time.
        time = time.max(e.time.clone());
    }
    let fields = RawValue::from_string(fields.to_string()).map_err(kube::Error::SerdeError)?;
    let mut kept: Vec<Entry> = entries
        .iter()
        .filter(|e| !theirs(e) && !is_ours(e))
        .cloned()
        .collect();
    kept.push(Entry {
        api_version,
        fields_type: Some("FieldsV1".to_owned()),
        fields_v1: Some(fields),
        manager: Some(ours.to_owned()),
        operation: Some("Apply".to_owned()),
        subresource: part.subresource().map(str::to_owned),
        time,
    });
    Ok(Some(kept))
}

/// The union of two field sets (`fieldsV1` tries: a key per field, `{}` at the leaves).
fn union(into: &mut Value, from: &Value) {
    let (Value::Object(into), Value::Object(from)) = (into, from) else {
        return;
    };
    for (key, value) in from {
        match into.get_mut(key) {
            Some(existing) => union(existing, value),
            None => {
                into.insert(key.clone(), value.clone());
            }
        }
    }
}

#[derive(Deserialize)]
struct Fetched {
    metadata: FetchedMeta,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct FetchedMeta {
    resource_version: Option<String>,
    #[serde(default)]
    managed_fields: Vec<Entry>,
}

#[derive(Debug, Serialize)]
struct TakeoverPatch<'a> {
    metadata: TakeoverMeta<'a>,
}

#[derive(Debug, Serialize)]
#[serde(rename_all = "camelCase")]
struct TakeoverMeta<'a> {
    managed_fields: &'a [Entry],
    resource_version: Option<&'a str>,
}

/// Moves PKO's fields of `part` on object `name` to `ours`, if PKO owns any; true when it did.
/// The field sets are read fresh (watched objects carry none) and written back
/// compare-and-swap on that resource version: a write in between fails this (the reconcile
/// retries) rather than losing another writer's entry.
pub async fn take_over<K>(
    api: &Api<K>,
    name: &str,
    ours: &str,
    part: Part,
) -> Result<bool, kube::Error>
where
    K: Clone + serde::de::DeserializeOwned + std::fmt::Debug + kube::Resource,
{
    take_over_parts(api, name, &[(ours, part)]).await
}

/// [`take_over`] of several parts at once, each to its manager, in one write.
pub async fn take_over_parts<K>(
    api: &Api<K>,
    name: &str,
    parts: &[(&str, Part)],
) -> Result<bool, kube::Error>
where
    K: Clone + serde::de::DeserializeOwned + std::fmt::Debug + kube::Resource,
{
    let client = api.clone().into_client();
    let request = Request::new(api.resource_url())
        .get_metadata(name, &GetParams::default())
        .map_err(kube::Error::BuildRequest)?;
    let fetched: Fetched = client.request(request).await?;
    let mut entries = None;
    for (ours, part) in parts {
        let current = entries
            .as_deref()
            .unwrap_or(fetched.metadata.managed_fields.as_slice());
        if let Some(next) = taken_over(current, ours, *part)? {
            entries = Some(next);
        }
    }
    let Some(entries) = entries else {
        return Ok(false);
    };
    let patch = TakeoverPatch {
        metadata: TakeoverMeta {
            managed_fields: &entries,
            resource_version: fetched.metadata.resource_version.as_deref(),
        },
    };
    api.patch(name, &PatchParams::default(), &Patch::Merge(&patch))
        .await?;
    info!(object = %name, "took over the fields PKO's managers owned");
    Ok(true)
}

/// Server-side applies `object` as `manager` (forced). When the answer shows fields PKO's
/// managers own, takes them over and applies again, so what only PKO set goes now.
pub async fn apply<K, P>(
    api: &Api<K>,
    name: &str,
    manager: &str,
    object: &P,
) -> Result<K, kube::Error>
where
    K: Clone + serde::de::DeserializeOwned + std::fmt::Debug + kube::Resource,
    P: serde::Serialize + std::fmt::Debug,
{
    let params = PatchParams::apply(manager).force();
    let applied = api.patch(name, &params, &Patch::Apply(object)).await?;
    if !pko_owns(applied.meta(), Part::Main) || !take_over(api, name, manager, Part::Main).await? {
        return Ok(applied);
    }
    api.patch(name, &params, &Patch::Apply(object)).await
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn entry(manager: &str, operation: &str, sub: Option<&str>, fields: Value) -> Entry {
        Entry {
            api_version: Some("apps/v1".to_owned()),
            fields_type: Some("FieldsV1".to_owned()),
            fields_v1: RawValue::from_string(fields.to_string()).ok(),
            manager: Some(manager.to_owned()),
            operation: Some(operation.to_owned()),
            subresource: sub.map(str::to_owned),
            time: Some("2026-01-01T00:00:00Z".to_owned()),
        }
    }

    fn by<'a>(entries: &'a [Entry], manager: &str) -> Option<&'a Entry> {
        entries
            .iter()
            .find(|e| e.manager.as_deref() == Some(manager))
    }

    fn set(e: &Entry) -> Value {
        serde_json::from_str(e.fields_v1.as_ref().expect("fields").get()).expect("json")
    }

    #[test]
    fn only_pkos_managers_are_pkos() {
        assert!(is_pkos("pulumi-kubernetes-operator"));
        assert!(is_pkos("pulumi-kubernetes-operator/stack-status"));
        assert!(!is_pkos("pulumi-kubernetes-operator-fork"));
        assert!(!is_pkos("pko-rs"));
        assert!(!is_pkos("kubectl"));
    }

    #[test]
    fn pkos_fields_join_ours_and_the_rest_stay() {
        let init = |fields: Value| {
            json!({"f:spec": {"f:template": {"f:spec": {"f:initContainers": {
                "k:{\"name\":\"bootstrap\"}": fields}}}}})
        };
        let pko = entry(
            "pulumi-kubernetes-operator",
            "Apply",
            None,
            init(json!({"f:args": {}, "f:command": {}})),
        );
        let pko_status = entry(
            "pulumi-kubernetes-operator/workspace-status",
            "Apply",
            Some("status"),
            json!({"f:status": {"f:conditions": {}}}),
        );
        let ours = entry(
            "pko-rs",
            "Apply",
            None,
            init(json!({"f:command": {}, "f:image": {}})),
        );
        // A tenant's entry nested past serde_json's limit is passed on as it came.
        let deep = format!(
            "{}{}",
            "{\"f:a\":".repeat(200),
            "{}".to_owned() + &"}".repeat(200)
        );
        let mut user = entry("kubectl-edit", "Update", None, json!({}));
        user.fields_v1 = RawValue::from_string(deep.clone()).ok();
        let entries = [pko, pko_status.clone(), ours, user];

        let main = taken_over(&entries, "pko-rs", Part::Main)
            .expect("bounded")
            .expect("PKO owns main fields");
        assert_eq!(main.len(), 3);
        assert!(by(&main, "pulumi-kubernetes-operator").is_none());
        assert!(
            by(&main, "pulumi-kubernetes-operator/workspace-status").is_some(),
            "the status part is its own writer's to take"
        );
        let user = by(&main, "kubectl-edit").expect("a user's entry is never taken");
        assert_eq!(
            user.fields_v1.as_ref().map(|r| r.get()),
            Some(deep.as_str())
        );
        let merged = by(&main, "pko-rs").expect("our entry");
        assert_eq!(merged.operation.as_deref(), Some("Apply"));
        assert_eq!(
            set(merged),
            init(json!({"f:args": {}, "f:command": {}, "f:image": {}}))
        );

        // Status: PKO's entry becomes a new one of ours on the status subresource.
        let status = taken_over(&main, "pko-rs/workspace-status", Part::Status)
            .expect("bounded")
            .expect("status");
        let ours = by(&status, "pko-rs/workspace-status").expect("our status entry");
        assert_eq!(ours.subresource.as_deref(), Some("status"));
        assert_eq!(set(ours), set(&pko_status));
        assert!(
            !status
                .iter()
                .any(|e| e.manager.as_deref().is_some_and(is_pkos))
        );

        // Nothing of PKO's left: nothing to do.
        assert!(matches!(
            taken_over(&status, "pko-rs", Part::Main),
            Ok(None)
        ));
    }
}
