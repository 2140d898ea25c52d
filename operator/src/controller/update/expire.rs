//! Deleting a completed Update once its `ttlAfterCompleted` has passed, never one its Stack's
//! status still names (PKO #1060: a TTL racing the Stack orphans its result).

use std::time::Duration;

use k8s_openapi::jiff::{SignedDuration, Timestamp};
use kube::api::{Api, DeleteParams};
use kube::runtime::controller::Action;
use kube::runtime::events::EventType;
use kube::{Resource, ResourceExt};
use pko_api::duration::parse_go_duration;
use pko_api::stack::Stack;
use pko_api::update::{Update, UpdateStatus};
use tracing::info;

use super::{COMPLETE, UpdateContext, UpdateError};
use crate::controller::conditions;
use crate::controller::kit::FromKube;

/// An expired Update its Stack still names is looked at again after this long (the Stack's
/// next finished Update changes what it names).
const STILL_NAMED_POLL: Duration = Duration::from_secs(600);

/// Deletes a completed Update once its `ttlAfterCompleted` has passed, unless its Stack's
/// status still names it (`currentUpdate`: a result not yet read, which would be run again;
/// `lastUpdate`: what the status points at).
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
        if named_by_its_stack(update, ctx).await? {
            // The Stack deletes it once its next Update has finished (stack/history.rs).
            info!(update = %update.name_any(), "kept past its ttlAfterCompleted: its Stack's status names it");
            return Ok(Action::requeue(STILL_NAMED_POLL));
        }
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

/// The Update's owning Stack (by owner uid) names it in `currentUpdate` or `lastUpdate`.
async fn named_by_its_stack(update: &Update, ctx: &UpdateContext) -> Result<bool, UpdateError> {
    let Some(owner) = update
        .owner_references()
        .iter()
        .find(|o| o.kind == "Stack" && o.api_version.starts_with("pulumi.com/"))
    else {
        return Ok(false);
    };
    let Some(namespace) = update.namespace() else {
        return Ok(false);
    };
    let stacks: Api<Stack> = Api::namespaced(ctx.client.clone(), &namespace);
    let stack = stacks
        .get_opt(&owner.name)
        .await
        .map_err(UpdateError::kube("reading the Update's Stack"))?;
    let Some(stack) = stack.filter(|s| s.meta().uid.as_deref() == Some(owner.uid.as_str())) else {
        return Ok(false);
    };
    Ok(names(&stack.status.unwrap_or_default(), &update.name_any()))
}

/// The Stack status names Update `name` (its current or its last).
pub(crate) fn names(status: &pko_api::stack::StackStatus, name: &str) -> bool {
    let current = status
        .current_update
        .as_ref()
        .and_then(|c| c.name.as_deref());
    let last = status.last_update.as_ref().and_then(|l| l.name.as_deref());
    current == Some(name) || last == Some(name)
}

#[cfg(test)]
mod tests {
    use pko_api::stack::{CurrentStackUpdate, StackStatus, StackUpdateState};

    use super::names;

    #[test]
    fn the_current_and_the_last_update_are_named() {
        let mut status = StackStatus::default();
        assert!(!names(&status, "u1"));
        status.current_update = Some(CurrentStackUpdate {
            name: Some("u2".into()),
            ..Default::default()
        });
        status.last_update = Some(StackUpdateState {
            name: Some("u1".into()),
            ..Default::default()
        });
        assert!(names(&status, "u1") && names(&status, "u2"));
        assert!(!names(&status, "u0"));
    }
}
