//! Update history: a Stack keeps at most `spec.updateHistoryLimit` finished Updates (default
//! [`DEFAULT_LIMIT`]), the newest; older ones are deleted with their outputs Secrets when the
//! next one finishes. The TTL alone lets Updates pile up for a day: a Stack resyncing every
//! minute would hold 1,440 (PKO #1060, #859). The Updates the status names (current and last)
//! are never deleted here, nor by the TTL (`update/expire.rs`, which leaves an expired one the
//! Stack still names to this pruning, once the Stack names another).

use k8s_openapi::api::core::v1::Secret;
use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, DeleteParams, ListParams, Preconditions};
use kube::{Resource, ResourceExt};
use pko_api::stack::Stack;
use pko_api::update::Update;
use tracing::{info, warn};

use super::outcome::StackError;
use crate::controller::conditions;
use crate::controller::keys::{STACK_COMPONENT_LABEL, STACK_NAME_LABEL};
use crate::controller::kit::FromKube;

/// Finished Updates kept per Stack when `spec.updateHistoryLimit` is unset.
pub(super) const DEFAULT_LIMIT: usize = 10;

/// What the decision reads of a finished Update.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) struct Finished {
    pub name: String,
    /// When its `Complete` condition turned true.
    pub completed: Option<Timestamp>,
    pub created: Option<Timestamp>,
    /// Its `ttlAfterCompleted` has passed.
    pub expired: bool,
}

/// The limit `spec.updateHistoryLimit` asks for (the CRD allows 1 and up).
pub(super) fn limit(stack: &Stack) -> usize {
    stack
        .spec
        .update_history_limit
        .and_then(|n| usize::try_from(n).ok())
        .filter(|n| *n > 0)
        .unwrap_or(DEFAULT_LIMIT)
}

/// The Updates to delete: all finished ones but the newest `limit` (by completion, then
/// creation, then name, so the answer never depends on list order), and the expired ones;
/// never one named in `keep`. A kept one counts toward the limit.
pub(super) fn beyond_limit(
    mut finished: Vec<Finished>,
    limit: usize,
    keep: &[&str],
) -> Vec<String> {
    finished
        .sort_by(|a, b| (b.completed, b.created, &b.name).cmp(&(a.completed, a.created, &a.name)));
    finished
        .into_iter()
        .enumerate()
        .filter(|(i, f)| *i >= limit || f.expired)
        .map(|(_, f)| f.name)
        .filter(|name| !keep.contains(&name.as_str()))
        .collect()
}

/// Its `ttlAfterCompleted` has passed since `completed` (an unreadable TTL never expires here;
/// the Update controller reports it).
fn expired(ttl: Option<&str>, completed: Timestamp, now: Timestamp) -> bool {
    let Some(ttl) = ttl.filter(|t| !t.is_empty()) else {
        return false;
    };
    let Ok(ttl) = pko_api::duration::parse_go_duration(ttl) else {
        return false;
    };
    let Ok(ttl) = k8s_openapi::jiff::SignedDuration::try_from(ttl) else {
        return false;
    };
    now.duration_since(completed) >= ttl
}

/// Deletes this stack's finished Updates beyond its limit, with their outputs Secrets. Only
/// Updates this Stack owns are counted (labels can be set by anyone; the owner's uid cannot).
pub(super) async fn prune(
    client: &kube::Client,
    stack: &Stack,
    namespace: &str,
    keep: &[&str],
) -> Result<usize, StackError> {
    let Some(uid) = stack.meta().uid.as_deref() else {
        return Ok(0);
    };
    let updates: Api<Update> = Api::namespaced(client.clone(), namespace);
    let selector = format!(
        "{STACK_COMPONENT_LABEL}=stack,{STACK_NAME_LABEL}={}",
        stack.name_any()
    );
    let listed = updates
        .list(&ListParams::default().labels(&selector))
        .await
        .map_err(StackError::kube("listing the stack's Updates"))?;
    let now = Timestamp::now();
    let finished: Vec<Finished> = listed
        .items
        .iter()
        .filter(|u| u.meta().deletion_timestamp.is_none())
        .filter(|u| u.owner_references().iter().any(|o| o.uid == uid))
        .filter_map(|u| {
            let status = u.status.as_ref()?;
            let complete =
                conditions::get(&status.conditions, "Complete").filter(|c| c.status == "True")?;
            let completed = complete.last_transition_time.0;
            Some(Finished {
                name: u.name_any(),
                completed: Some(completed),
                created: u.meta().creation_timestamp.as_ref().map(|t| t.0),
                expired: expired(u.spec.ttl_after_completed.as_deref(), completed, now),
            })
        })
        .collect();
    let doomed = beyond_limit(finished, limit(stack), keep);
    let secrets: Api<Secret> = Api::namespaced(client.clone(), namespace);
    for name in &doomed {
        let Some(update) = listed.items.iter().find(|u| &u.name_any() == name) else {
            continue;
        };
        delete_outputs(&secrets, update).await;
        match updates
            .delete(
                name,
                &DeleteParams::background().preconditions(uid_of(update)),
            )
            .await
        {
            Ok(_) => {}
            Err(kube::Error::Api(e)) if e.code == 404 || e.code == 409 => {}
            Err(e) => {
                return Err(StackError::kube(
                    "deleting an Update beyond the history limit",
                )(e));
            }
        }
    }
    if !doomed.is_empty() {
        info!(stack = %stack.name_any(), namespace, deleted = doomed.len(), "Updates beyond the history limit deleted");
    }
    Ok(doomed.len())
}

fn uid_of(object: &impl Resource) -> Preconditions {
    Preconditions {
        uid: object.meta().uid.clone(),
        resource_version: None,
    }
}

/// The Update's outputs Secret (`<update>-stack-outputs`), deleted now: a garbage collector
/// would take it with its Update, but only where one runs, and only later. A Secret of that
/// name that the Update does not control is someone else's and stays.
async fn delete_outputs(secrets: &Api<Secret>, update: &Update) {
    let name = format!("{}-stack-outputs", update.name_any());
    let Some(update_uid) = update.meta().uid.as_deref() else {
        return;
    };
    let secret = match secrets.get_opt(&name).await {
        Ok(Some(secret)) => secret,
        Ok(None) => return,
        Err(e) => {
            warn!(secret = %name, error = %e, "cannot read an outputs Secret beyond the history limit");
            return;
        }
    };
    let ours = secret
        .owner_references()
        .iter()
        .any(|o| o.controller == Some(true) && o.uid == update_uid);
    if !ours {
        return;
    }
    if let Err(e) = secrets
        .delete(
            &name,
            &DeleteParams::background().preconditions(uid_of(&secret)),
        )
        .await
        && !matches!(&e, kube::Error::Api(s) if s.code == 404 || s.code == 409)
    {
        warn!(secret = %name, error = %e, "cannot delete an outputs Secret beyond the history limit");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(seconds: i64) -> Option<Timestamp> {
        Timestamp::from_second(seconds).ok()
    }

    fn finished(name: &str, completed: i64) -> Finished {
        Finished {
            name: name.into(),
            completed: at(completed),
            created: at(completed - 5),
            expired: false,
        }
    }

    #[test]
    fn the_newest_are_kept_and_the_rest_deleted() {
        let all = (1..=6)
            .map(|i| finished(&format!("u{i}"), i * 10))
            .collect();
        assert_eq!(beyond_limit(all, 3, &[]), ["u3", "u2", "u1"]);
    }

    #[test]
    fn within_the_limit_nothing_goes() {
        let all = vec![finished("a", 1), finished("b", 2)];
        assert!(beyond_limit(all.clone(), 2, &[]).is_empty());
        assert!(beyond_limit(all, 10, &[]).is_empty());
    }

    #[test]
    fn an_update_the_status_names_is_never_deleted() {
        // The last update finished long ago (a stack stuck on a running one since): kept.
        let all = vec![
            finished("old-last", 1),
            finished("b", 20),
            finished("c", 30),
        ];
        assert_eq!(beyond_limit(all, 1, &["old-last"]), ["b"]);
    }

    #[test]
    fn expired_updates_go_unless_the_status_names_them() {
        let mut all = vec![finished("a", 1), finished("b", 2), finished("c", 3)];
        for f in &mut all {
            f.expired = true;
        }
        assert_eq!(beyond_limit(all, 10, &["c"]), ["b", "a"]);
    }

    #[test]
    fn a_ttl_expires_once_it_has_passed() {
        let (done, now) = (at(100).expect("t"), at(160).expect("t"));
        assert!(expired(Some("1m"), done, now));
        assert!(!expired(Some("61s"), done, now));
        assert!(!expired(None, done, now));
        assert!(!expired(Some(""), done, now));
        assert!(!expired(Some("soon"), done, now));
    }

    #[test]
    fn the_order_does_not_depend_on_the_list() {
        let a = vec![finished("x", 5), finished("y", 5), finished("z", 1)];
        let mut b = a.clone();
        b.reverse();
        assert_eq!(beyond_limit(a, 1, &[]), beyond_limit(b, 1, &[]));
    }

    #[test]
    fn an_unset_or_invalid_limit_is_the_default() {
        let mut stack = Stack::new("s", pko_api::stack::StackSpec::new("dev"));
        assert_eq!(limit(&stack), DEFAULT_LIMIT);
        stack.spec.update_history_limit = Some(0);
        assert_eq!(limit(&stack), DEFAULT_LIMIT);
        stack.spec.update_history_limit = Some(3);
        assert_eq!(limit(&stack), 3);
    }
}
