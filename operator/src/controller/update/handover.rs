//! Updates made by PKO carry its Stack finalizer (`finalizer.stack.pulumi.com`), which only
//! PKO's Stack controller removes once it has read the result. After a switch-over nothing
//! else would, so a completed Update would never expire and a deleted one would stay
//! Terminating (and block its namespace's deletion). Released here once the Update is complete
//! (the Stack controller reads results from the Update's status, finalizer or not) or
//! deleted.
//!
//! The fields PKO's managers own on an Update (its spec, written at creation, and its status)
//! pass to ours the first time the controller sees it (`controller/takeover.rs`): a run resumed
//! after the switch then writes a status with nothing of PKO's left beside it.

use kube::api::{Api, Patch, PatchParams};
use kube::{Resource, ResourceExt};
use pko_api::update::Update;
use serde_json::json;
use tracing::info;

use super::{COMPLETE, UpdateContext, UpdateError};
use crate::controller::conditions;
use crate::controller::keys::{APPLY_MANAGER, STACK_FINALIZER, UPDATE_STATUS_MANAGER};
use crate::controller::kit::FromKube;
use crate::controller::takeover::{self, Part};

/// Whether PKO's managers own fields of the Update (read from the watched object).
pub(super) fn pko_owned(update: &Update) -> bool {
    takeover::pko_owns(update.meta(), Part::Main) || takeover::pko_owns(update.meta(), Part::Status)
}

/// Moves what PKO's managers own on the Update to ours (spec to the apply manager, status to
/// the status writer), in one compare-and-swap write; false when a fresh read finds nothing of
/// PKO's left (the watched object was behind).
pub(super) async fn take_over(ctx: &UpdateContext, update: &Update) -> Result<bool, UpdateError> {
    let namespace = update.namespace().unwrap_or_default();
    let api = Api::<Update>::namespaced(ctx.client.clone(), &namespace);
    let parts = [
        (APPLY_MANAGER, Part::Main),
        (UPDATE_STATUS_MANAGER, Part::Status),
    ];
    takeover::take_over_parts(&api, &update.name_any(), &parts)
        .await
        .map_err(UpdateError::kube("taking over the fields PKO owned"))
}

/// The finalizers the Update keeps when PKO's is to be released now; `None` to leave them.
pub(super) fn released(update: &Update) -> Option<Vec<String>> {
    let finalizers = update.finalizers();
    if !finalizers.iter().any(|f| f == STACK_FINALIZER) {
        return None;
    }
    let complete = update
        .status
        .as_ref()
        .is_some_and(|s| conditions::is_true(&s.conditions, COMPLETE));
    let deleting = update.meta().deletion_timestamp.is_some();
    (complete || deleting).then(|| {
        finalizers
            .iter()
            .filter(|f| *f != STACK_FINALIZER)
            .cloned()
            .collect()
    })
}

/// Writes `keep` as the Update's finalizers, compare-and-swap on its resource version so a
/// finalizer added meanwhile is never lost.
pub(super) async fn release(
    ctx: &UpdateContext,
    update: &Update,
    keep: Vec<String>,
) -> Result<(), UpdateError> {
    let namespace = update.namespace().unwrap_or_default();
    let patch =
        json!({"metadata": {"finalizers": keep, "resourceVersion": update.resource_version()}});
    Api::<Update>::namespaced(ctx.client.clone(), &namespace)
        .patch(
            &update.name_any(),
            &PatchParams::default(),
            &Patch::Merge(&patch),
        )
        .await
        .map_err(UpdateError::kube("releasing PKO's finalizer"))?;
    info!(update = %update.name_any(), %namespace, "released the Stack finalizer PKO left on the Update");
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
    use serde_json::Value;

    fn update(finalizers: &[&str], complete: bool, deleting: bool) -> Update {
        let mut u: Value = json!({
            "apiVersion": "auto.pulumi.com/v1alpha1", "kind": "Update",
            "metadata": {"name": "u", "namespace": "n", "finalizers": finalizers},
            "spec": {"workspaceName": "w", "type": "up"},
        });
        if complete {
            u["status"] = json!({"conditions": [{"type": "Complete", "status": "True",
                "reason": "Updated", "message": "", "lastTransitionTime": "2026-01-01T00:00:00Z"}]});
        }
        let mut u: Update = serde_json::from_value(u).expect("update");
        if deleting {
            u.metadata.deletion_timestamp = Some(Time(k8s_openapi::jiff::Timestamp::UNIX_EPOCH));
        }
        u
    }

    #[test]
    fn an_update_with_fields_of_pkos_managers_is_pkos() {
        use k8s_openapi::apimachinery::pkg::apis::meta::v1::ManagedFieldsEntry;
        let entry = |manager: &str, sub: Option<&str>| ManagedFieldsEntry {
            manager: Some(manager.to_owned()),
            subresource: sub.map(str::to_owned),
            ..ManagedFieldsEntry::default()
        };
        let mut u = update(&[], true, false);
        assert!(!pko_owned(&u));
        u.metadata.managed_fields = Some(vec![entry("pko-rs/update-status", Some("status"))]);
        assert!(!pko_owned(&u));
        u.metadata.managed_fields = Some(vec![entry(
            "pulumi-kubernetes-operator/update-status",
            Some("status"),
        )]);
        assert!(pko_owned(&u));
        u.metadata.managed_fields = Some(vec![entry("pulumi-kubernetes-operator", None)]);
        assert!(pko_owned(&u));
    }

    #[test]
    fn pkos_finalizer_goes_once_the_update_is_complete_or_deleted() {
        // Running under PKO's finalizer: kept until the result is in the status.
        assert_eq!(released(&update(&[STACK_FINALIZER], false, false)), None);
        assert_eq!(
            released(&update(&[STACK_FINALIZER, "other.io/keep"], true, false)),
            Some(vec!["other.io/keep".to_owned()])
        );
        assert_eq!(
            released(&update(&[STACK_FINALIZER], false, true)),
            Some(vec![])
        );
        // Without it, nothing to do, whatever the state.
        assert_eq!(released(&update(&["other.io/keep"], true, true)), None);
    }
}
