//! Deleting a completed Update once its `ttlAfterCompleted` has passed.

use std::time::Duration;

use k8s_openapi::jiff::{SignedDuration, Timestamp};
use kube::api::{Api, DeleteParams};
use kube::runtime::controller::Action;
use kube::runtime::events::EventType;
use kube::{Resource, ResourceExt};
use pko_api::duration::parse_go_duration;
use pko_api::update::{Update, UpdateStatus};

use super::{COMPLETE, UpdateContext, UpdateError};
use crate::controller::conditions;
use crate::controller::kit::FromKube;

/// Deletes a completed Update once its `ttlAfterCompleted` has passed.
pub(super) async fn expire(
    update: &Update,
    ctx: &UpdateContext,
    api: &Api<Update>,
    status: &UpdateStatus,
) -> Result<Action, UpdateError> {
    let Some(ttl) = update
        .spec
        .ttl_after_completed
        .as_deref()
        .filter(|t| !t.is_empty())
    else {
        return Ok(Action::await_change());
    };
    if update.meta().deletion_timestamp.is_some() {
        return Ok(Action::await_change());
    }
    let ttl = parse_go_duration(ttl).map_err(UpdateError::BadTtl)?;
    let completed = conditions::get(&status.conditions, COMPLETE)
        .map(|c| c.last_transition_time.0)
        .unwrap_or_else(Timestamp::now);
    let elapsed = Timestamp::now().duration_since(completed);
    let ttl_signed = SignedDuration::try_from(ttl).unwrap_or(SignedDuration::MAX);
    if elapsed >= ttl_signed {
        api.delete(&update.name_any(), &DeleteParams::background())
            .await
            .map_err(UpdateError::kube("deleting the expired Update"))?;
        ctx.event(
            update,
            EventType::Normal,
            "UpdateExpired",
            "ttl expired and was deleted".into(),
        )
        .await;
        return Ok(Action::await_change());
    }
    let remaining = Duration::try_from(ttl_signed - elapsed).unwrap_or(Duration::from_secs(1));
    Ok(Action::requeue(remaining + Duration::from_millis(100)))
}
