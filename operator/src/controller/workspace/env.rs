//! A Workspace's `env` pushed to the agent instead of set on the container.
//!
//! PKO puts `spec.env` on the pod, so a changed variable (a Stack's `envRefs`) restarts the pod,
//! re-fetches the program and loses the workspace's warm state. Here every variable with a
//! plain value or a Secret/ConfigMap key is resolved by the operator and sent with
//! `SetEnvironmentVariables` (over the workspace's TLS channel), so a change applies to the next
//! Pulumi command without a restart. Variables the kubelet must resolve (`fieldRef`,
//! `resourceFieldRef`, values with `$(VAR)` references) stay on the container.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::{ConfigMap, EnvVar, Secret};
use kube::{Api, Client};
use pko_api::names::checked_name;
use sha2::{Digest, Sha256};

/// Whether the operator resolves `var` (and pushes it) rather than the kubelet.
pub fn is_pushed(var: &EnvVar) -> bool {
    match (&var.value, &var.value_from) {
        (Some(v), _) => !v.contains("$("),
        (None, Some(from)) => {
            (from.secret_key_ref.is_some() || from.config_map_key_ref.is_some())
                && from.field_ref.is_none()
                && from.resource_field_ref.is_none()
        }
        (None, None) => true,
    }
}

/// The pushed variables' values, read now (namespaced, uncached: a rotated Secret is picked up
/// at the next reconcile). A missing required Secret, ConfigMap or key is an error naming it.
pub async fn resolve(
    client: &Client,
    namespace: &str,
    vars: &[EnvVar],
) -> Result<BTreeMap<String, String>, String> {
    let secrets: Api<Secret> = Api::namespaced(client.clone(), namespace);
    let config_maps: Api<ConfigMap> = Api::namespaced(client.clone(), namespace);
    let mut out = BTreeMap::new();
    for var in vars.iter().filter(|v| is_pushed(v)) {
        let value = match (&var.value, &var.value_from) {
            (Some(v), _) => Some(v.clone()),
            (None, Some(from)) => {
                if let Some(r) = &from.secret_key_ref {
                    let field = format!("env {}: valueFrom.secretKeyRef.name", var.name);
                    checked_name(&field, &r.name).map_err(|e| e.to_string())?;
                    let secret = secrets.get_opt(&r.name).await.map_err(|e| {
                        format!("env {}: cannot read Secret {}: {e}", var.name, r.name)
                    })?;
                    let found = secret.as_ref().map(|s| {
                        s.data
                            .as_ref()
                            .and_then(|d| d.get(&r.key))
                            .map(|b| String::from_utf8_lossy(&b.0).into_owned())
                    });
                    required(&var.name, "Secret", &r.name, &r.key, r.optional, found)?
                } else if let Some(r) = &from.config_map_key_ref {
                    let field = format!("env {}: valueFrom.configMapKeyRef.name", var.name);
                    checked_name(&field, &r.name).map_err(|e| e.to_string())?;
                    let map = config_maps.get_opt(&r.name).await.map_err(|e| {
                        format!("env {}: cannot read ConfigMap {}: {e}", var.name, r.name)
                    })?;
                    let found = map
                        .as_ref()
                        .map(|m| m.data.as_ref().and_then(|d| d.get(&r.key)).cloned());
                    required(&var.name, "ConfigMap", &r.name, &r.key, r.optional, found)?
                } else {
                    None
                }
            }
            (None, None) => Some(String::new()),
        };
        if let Some(v) = value {
            out.insert(var.name.clone(), v);
        }
    }
    Ok(out)
}

/// `found`: `None` when the object is missing, `Some(None)` when the key is.
fn required(
    var: &str,
    kind: &str,
    name: &str,
    key: &str,
    optional: Option<bool>,
    found: Option<Option<String>>,
) -> Result<Option<String>, String> {
    match found {
        Some(Some(v)) => Ok(Some(v)),
        _ if optional == Some(true) => Ok(None),
        None => Err(format!("env {var}: {kind} {name} not found")),
        Some(None) => Err(format!("env {var}: {kind} {name} has no key {key:?}")),
    }
}

/// A digest of the resolved variables: when it changes they are pushed again.
pub fn digest(env: &BTreeMap<String, String>) -> String {
    let mut h = Sha256::new();
    for (k, v) in env {
        h.update(k.as_bytes());
        h.update([0]);
        h.update(v.as_bytes());
        h.update([0]);
    }
    hex::encode(h.finalize())
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn var(v: serde_json::Value) -> EnvVar {
        serde_json::from_value(v).expect("env var")
    }

    #[test]
    fn what_the_kubelet_must_resolve_stays_on_the_container() {
        assert!(is_pushed(&var(json!({"name": "A", "value": "x"}))));
        assert!(is_pushed(&var(json!({"name": "A"}))));
        assert!(is_pushed(&var(
            json!({"name": "A", "valueFrom": {"secretKeyRef": {"name": "s", "key": "k"}}})
        )));
        assert!(is_pushed(&var(
            json!({"name": "A", "valueFrom": {"configMapKeyRef": {"name": "c", "key": "k"}}})
        )));
        assert!(!is_pushed(&var(json!({"name": "A", "value": "$(B)/x"}))));
        assert!(!is_pushed(&var(
            json!({"name": "A", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}})
        )));
        assert!(!is_pushed(&var(
            json!({"name": "A", "valueFrom": {"resourceFieldRef": {"resource": "limits.cpu"}}})
        )));
    }

    #[test]
    fn missing_sources_are_named_unless_optional() {
        assert_eq!(
            required("A", "Secret", "s", "k", None, None),
            Err("env A: Secret s not found".into())
        );
        assert_eq!(
            required("A", "Secret", "s", "k", None, Some(None)),
            Err("env A: Secret s has no key \"k\"".into())
        );
        assert_eq!(
            required("A", "Secret", "s", "k", Some(true), None),
            Ok(None)
        );
    }

    #[test]
    fn the_digest_follows_names_and_values() {
        let a = BTreeMap::from([("A".to_owned(), "1".to_owned())]);
        let b = BTreeMap::from([("A".to_owned(), "2".to_owned())]);
        assert_ne!(digest(&a), digest(&b));
        assert_eq!(digest(&a), digest(&a.clone()));
    }
}
