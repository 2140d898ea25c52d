//! An operation's outcome: the status it leaves, its Events, the outputs Secret, and writing
//! the status until it is stored.

use std::collections::{BTreeMap, HashMap};

use k8s_openapi::api::core::v1::Secret;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, DeleteParams, Patch, PatchParams, PostParams};
use kube::runtime::events::EventType;
use kube::{Client, ResourceExt};
use pko_agent_api::proto as pb;
use pko_api::common::ProjectInfo;
use pko_api::update::{PlanSummary, ResourceChanges, Update, UpdateStatus, UpdateType};
use tracing::{info, warn};

use super::{
    COMPLETE, FAILED, MESSAGE_LIMIT, PROGRESSING, STALLED, UpdateContext, UpdateError, stack_name,
};
use crate::controller::backoff::{self, Verdict};
use crate::controller::conditions;
use crate::controller::keys::{SECRETS_ANNOTATION, UPDATE_NAME_LABEL, UPDATE_STATUS_MANAGER};
use crate::controller::kit;
use crate::controller::kit::FromKube;

/// The result of one operation.
pub(super) struct Outcome {
    pub(super) succeeded: bool,
    pub(super) reason: String,
    pub(super) message: String,
    pub(super) summary: Option<pb::UpdateSummary>,
    pub(super) permalink: Option<String>,
    pub(super) project: Option<pb::ProjectInfo>,
    pub(super) outputs: Option<HashMap<String, pb::OutputValue>>,
    /// What a preview-only refresh found changed.
    pub(super) changes: Option<ResourceChanges>,
    /// What the plan a preview saved would do.
    pub(super) plan: Option<PlanSummary>,
}

impl Outcome {
    /// An operation the agent ran to its end: succeeded unless its summary says otherwise.
    pub(super) fn ended(
        summary: Option<pb::UpdateSummary>,
        permalink: Option<String>,
        project: Option<pb::ProjectInfo>,
    ) -> Self {
        let succeeded = summary.as_ref().is_none_or(|s| s.result == "succeeded");
        Self {
            succeeded,
            reason: if succeeded {
                "UpdateSucceeded".into()
            } else {
                "UpdateFailed".into()
            },
            message: String::new(),
            summary,
            permalink,
            project,
            outputs: None,
            changes: None,
            plan: None,
        }
    }

    pub(super) fn failed(reason: &str, message: String) -> Self {
        Self {
            succeeded: false,
            reason: reason.into(),
            message,
            summary: None,
            permalink: None,
            project: None,
            outputs: None,
            changes: None,
            plan: None,
        }
    }
}

/// Writes an operation's outcome until it is stored: lost, it would leave the Update in
/// flight, and the next operator would run the operation again. A transient failure (the
/// apiserver away) is retried with the controllers' backoff for as long as it lasts; a refusal
/// that will not heal is told in an Event; a deleted Update has nobody left to tell.
pub(super) async fn store_result(
    ctx: &UpdateContext,
    update: &Update,
    namespace: &str,
    name: &str,
    before: &UpdateStatus,
    status: &UpdateStatus,
) {
    let policy = backoff::Policy::default();
    let mut attempt = 0u32;
    loop {
        let err = match write_status(&ctx.client, namespace, name, before, status).await {
            Ok(()) => return,
            Err(err) => err,
        };
        if let UpdateError::Kube {
            source: kube::Error::Api(e),
            ..
        } = &err
            && e.code == 404
        {
            return;
        }
        if err.verdict() == Verdict::Permanent {
            warn!(update = %name, error = %err, "the update result cannot be stored");
            ctx.event(update, EventType::Warning, backoff::REASON, err.message())
                .await;
            return;
        }
        attempt = attempt.saturating_add(1);
        let delay = policy.delay(attempt, &mut rand::rng());
        warn!(update = %name, attempt, ?delay, error = %err, "cannot write the update result; retrying");
        tokio::time::sleep(delay).await;
    }
}

pub(super) fn finish(
    status: &mut UpdateStatus,
    generation: Option<i64>,
    succeeded: bool,
    reason: &str,
    message: &str,
) {
    conditions::remove(&mut status.conditions, STALLED);
    conditions::set(
        &mut status.conditions,
        PROGRESSING,
        false,
        if succeeded { "Complete" } else { "Failed" },
        "",
        generation,
    );
    conditions::set(
        &mut status.conditions,
        FAILED,
        !succeeded,
        reason,
        message,
        generation,
    );
    conditions::set(
        &mut status.conditions,
        COMPLETE,
        true,
        if succeeded { "Updated" } else { "Failed" },
        "",
        generation,
    );
    status.message = Some(message.to_owned());
    status.end_time = Some(Time(Timestamp::now()));
}

fn pb_time(t: &prost_types::Timestamp) -> Option<Time> {
    Timestamp::new(t.seconds, t.nanos).ok().map(Time)
}

pub(super) async fn apply_outcome(
    ctx: &UpdateContext,
    update: &Update,
    status: &mut UpdateStatus,
    outcome: Outcome,
) {
    let generation = update.metadata.generation;
    let name = update.name_any();
    let verb = match update.spec.type_.unwrap_or(UpdateType::Up) {
        UpdateType::Preview => ("Previewed", "preview"),
        UpdateType::Up => ("Updated", "update"),
        UpdateType::Refresh => ("Refreshed", "refresh"),
        UpdateType::Destroy => ("Destroyed", "destroy"),
    };
    let mut succeeded = outcome.succeeded;
    let mut reason = outcome.reason.clone();
    let mut message = outcome.message.clone();
    if succeeded && let Some(outputs) = &outcome.outputs {
        match write_outputs(ctx, update, outputs).await {
            Ok(secret) => status.outputs = Some(secret),
            Err(e) => {
                succeeded = false;
                reason = "OutputsUnavailable".into();
                message = format!("the outputs could not be stored: {e}");
            }
        }
    }
    finish(
        status,
        generation,
        succeeded,
        &reason,
        &conditions::truncate(&message, MESSAGE_LIMIT),
    );
    if let Some(summary) = &outcome.summary {
        if let Some(t) = summary.start_time.as_ref().and_then(pb_time) {
            status.start_time = Some(t);
        }
        if let Some(t) = summary.end_time.as_ref().and_then(pb_time) {
            status.end_time = Some(t);
        }
    }
    status.permalink = outcome.permalink.clone().or(status.permalink.take());
    if outcome.plan.is_some() {
        status.plan = outcome.plan.clone();
    }
    if outcome.changes.is_some() {
        status.changes = outcome.changes.clone();
    }
    if let Some(p) = &outcome.project {
        status.project_info = Some(ProjectInfo {
            name: p.name.clone(),
            runtime: p.runtime.clone(),
        });
    }
    let stack = stack_name(update);
    if succeeded {
        info!(update = %name, "operation succeeded");
        ctx.event(
            update,
            EventType::Normal,
            "UpdateSucceeded",
            format!("{} stack \"{stack}\"", verb.0),
        )
        .await;
    } else {
        warn!(update = %name, %reason, %message, "operation failed");
        ctx.event(
            update,
            EventType::Warning,
            "UpdateFailed",
            format!("Failed to {} stack \"{stack}\": {message}", verb.1),
        )
        .await;
    }
}

/// `[^-._a-zA-Z0-9]` → `_`, as Secret keys must be (PKO's rule).
pub fn sanitize_key(key: &str) -> String {
    key.chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || matches!(c, '-' | '.' | '_') {
                c
            } else {
                '_'
            }
        })
        .collect()
}

/// The immutable outputs Secret `<update>-stack-outputs`, as PKO writes it.
async fn write_outputs(
    ctx: &UpdateContext,
    update: &Update,
    outputs: &HashMap<String, pb::OutputValue>,
) -> Result<String, String> {
    let namespace = update.namespace().unwrap_or_default();
    let name = format!("{}-stack-outputs", update.name_any());
    let uid = update.metadata.uid.clone().unwrap_or_default();
    let mut secret_keys: Vec<String> = outputs
        .iter()
        .filter(|(_, v)| v.secret)
        .map(|(k, _)| sanitize_key(k))
        .collect();
    secret_keys.sort();
    let data: BTreeMap<String, k8s_openapi::ByteString> = outputs
        .iter()
        .map(|(k, v)| (sanitize_key(k), k8s_openapi::ByteString(v.value.clone())))
        .collect();
    let secret = Secret {
        metadata: kube::api::ObjectMeta {
            name: Some(name.clone()),
            namespace: Some(namespace.clone()),
            labels: Some(BTreeMap::from([
                ("auto.pulumi.com/component".to_owned(), "update".to_owned()),
                (UPDATE_NAME_LABEL.to_owned(), update.name_any()),
            ])),
            annotations: Some(BTreeMap::from([(
                SECRETS_ANNOTATION.to_owned(),
                serde_json::to_string(&secret_keys).unwrap_or_else(|_| "[]".into()),
            )])),
            owner_references: kit::controller_owner(update).map(|o| vec![o]),
            ..Default::default()
        },
        immutable: Some(true),
        data: Some(data),
        type_: Some("Opaque".into()),
        ..Default::default()
    };
    let api: Api<Secret> = Api::namespaced(ctx.client.clone(), &namespace);
    match api.create(&PostParams::default(), &secret).await {
        Ok(_) => Ok(name),
        Err(kube::Error::Api(e)) if e.code == 409 => {
            // Left by a run interrupted after this step (a resumed Update): replaced, but only
            // when it is this Update's own (a tenant's Secret of that name is left alone).
            let existing = api.get(&name).await.map_err(|e| e.to_string())?;
            if !owned_by(&existing, &uid) {
                return Err(format!(
                    "Secret {name} exists and is not this Update's (no controller reference to it); it was left as it is"
                ));
            }
            let params = DeleteParams {
                preconditions: Some(kube::api::Preconditions {
                    uid: existing.metadata.uid.clone(),
                    resource_version: None,
                }),
                ..DeleteParams::default()
            };
            api.delete(&name, &params)
                .await
                .map_err(|e| e.to_string())?;
            api.create(&PostParams::default(), &secret)
                .await
                .map_err(|e| e.to_string())?;
            Ok(name)
        }
        Err(e) => Err(e.to_string()),
    }
}

/// `object` is controlled by the object with this uid.
fn owned_by(object: &Secret, uid: &str) -> bool {
    !uid.is_empty()
        && object
            .metadata
            .owner_references
            .iter()
            .flatten()
            .any(|o| o.controller == Some(true) && o.uid == uid)
}

pub(super) async fn write_status(
    client: &Client,
    namespace: &str,
    name: &str,
    before: &UpdateStatus,
    after: &UpdateStatus,
) -> Result<(), UpdateError> {
    if before == after {
        return Ok(());
    }
    let patch = kit::StatusPatch::new::<Update>(after);
    Api::<Update>::namespaced(client.clone(), namespace)
        .patch_status(
            name,
            &PatchParams::apply(UPDATE_STATUS_MANAGER).force(),
            &Patch::Apply(&patch),
        )
        .await
        .map_err(UpdateError::kube("writing the Update status"))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn only_a_secret_this_update_controls_is_replaced() {
        let secret = |refs: serde_json::Value| -> Secret {
            serde_json::from_value(json!({
                "metadata": {"name": "u-stack-outputs", "ownerReferences": refs},
            }))
            .expect("secret")
        };
        let owner = |uid: &str, controller: bool| {
            json!({"apiVersion": "auto.pulumi.com/v1alpha1", "kind": "Update", "name": "u",
                   "uid": uid, "controller": controller})
        };
        assert!(owned_by(&secret(json!([owner("u1", true)])), "u1"));
        assert!(!owned_by(&secret(json!([owner("u2", true)])), "u1"));
        assert!(!owned_by(&secret(json!([owner("u1", false)])), "u1"));
        assert!(!owned_by(&secret(json!([])), "u1"));
        assert!(!owned_by(&secret(json!([owner("", true)])), ""));
    }

    #[test]
    fn keys_are_sanitized_like_pko() {
        assert_eq!(sanitize_key("with whitespace"), "with_whitespace");
        assert_eq!(sanitize_key("a.b-c_d"), "a.b-c_d");
        assert_eq!(sanitize_key("x/y:z"), "x_y_z");
    }
}
