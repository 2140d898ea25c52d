//! The namespace deletion guard (`/namespaces`): a namespace is not deleted while a Stack in
//! it still has resources to destroy (`spec.destroyOnFinalize`).
//!
//! Once a namespace is terminating, the apiserver refuses new objects in it and the namespace
//! controller deletes the workspace pods, so no destroy can run there any more: the Stack
//! would stall `NamespaceTerminating` and its resources would be left behind. So the DELETE is
//! refused, and the message says what to run first; once the Stacks are gone, the same DELETE
//! passes.
//!
//! The answer has no side effect. Anyone who can reach the webhook port can post a review, so
//! a review proves nothing: acting on one (deleting Stacks, recording an intent) would let a
//! forged review destroy another tenant's stacks. A refusal is the only safe act. What a
//! forged review learns is one bit (does that namespace hold such a Stack), which the message
//! does not widen: it names no Stack and counts none.
//!
//! The webhook is registered with `failurePolicy: Ignore` (deploy/webhook/validating.yaml):
//! a stopped operator must not block every namespace deletion in the cluster. Deleted then,
//! the Stacks stall as above, and their message prints the finalizer patch.

use std::time::Duration;

use kube::api::ListParams;
use kube::{Api, Client};
use pko_api::names::is_dns1123_label;
use pko_api::stack::{STACK_FINALIZER, Stack};
use tokio::sync::Semaphore;

/// Stack lists in flight at once: a flood of reviews cannot turn into a flood of lists.
const MAX_LISTS: usize = 4;
/// How long a review waits for a list slot, and how long a list may take.
const LIST_TIMEOUT: Duration = Duration::from_secs(2);
/// Stacks per list page: a namespace with many Stacks is read in bounded pieces.
const PAGE: u32 = 200;

/// What the guard reads of a Stack.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct StackFacts {
    /// `spec.destroyOnFinalize`.
    pub destroy_on_finalize: bool,
    /// The Stack's finalizer is on it: the operator still has work to do before it goes.
    pub finalizer: bool,
    /// It is being deleted already (its destroy may be running).
    pub deleting: bool,
}

impl StackFacts {
    pub fn of(stack: &Stack) -> Self {
        Self {
            destroy_on_finalize: stack.spec.destroy_on_finalize == Some(true),
            finalizer: stack
                .metadata
                .finalizers
                .as_ref()
                .is_some_and(|f| f.iter().any(|f| f == STACK_FINALIZER)),
            deleting: stack.metadata.deletion_timestamp.is_some(),
        }
    }

    /// Deleting the namespace now would leave this Stack's resources behind.
    fn destroy_pending(self) -> bool {
        self.destroy_on_finalize && self.finalizer
    }
}

/// What to answer a namespace DELETE.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Verdict {
    Allow,
    /// Refused, with the message the user sees.
    Refuse(String),
}

/// The answer for a namespace holding `stacks`. Pure, so every case is unit-tested.
pub fn verdict(namespace: &str, stacks: impl IntoIterator<Item = StackFacts>) -> Verdict {
    let mut pending = stacks
        .into_iter()
        .filter(|s| s.destroy_pending())
        .peekable();
    let Some(first) = pending.peek().copied() else {
        return Verdict::Allow;
    };
    let all_deleting = first.deleting && pending.all(|s| s.deleting);
    let why = format!(
        "namespace {namespace} holds Stacks with spec.destroyOnFinalize whose resources are not \
         destroyed yet, and a namespace being deleted can run no destroy"
    );
    Verdict::Refuse(if all_deleting {
        format!(
            "{why}: they are being destroyed now; wait for them (kubectl wait --for=delete \
             stacks --all -n {namespace} --timeout=30m), then delete the namespace again"
        )
    } else {
        format!(
            "{why}: destroy them first with `kubectl delete stacks --all -n {namespace}` (it \
             returns once they are destroyed), then delete the namespace again; to keep their \
             resources instead, set spec.destroyOnFinalize to false on them first"
        )
    })
}

/// Errors while reading a namespace's Stacks.
#[derive(Debug, thiserror::Error)]
pub enum GuardError {
    #[error("{0:?} is not a namespace name (a DNS-1123 label)")]
    Name(String),
    #[error("too many namespace deletions are being checked at once; retry")]
    Busy,
    #[error("listing the Stacks of namespace {namespace} took longer than {timeout:?}; retry")]
    Timeout {
        namespace: String,
        timeout: Duration,
    },
    #[error("cannot list the Stacks of namespace {namespace}: {source}")]
    List {
        namespace: String,
        source: kube::Error,
    },
}

/// Reads a namespace's Stacks for [`verdict`].
pub struct NamespaceGuard {
    client: Client,
    lists: Semaphore,
}

impl NamespaceGuard {
    pub fn new(client: Client) -> Self {
        Self {
            client,
            lists: Semaphore::new(MAX_LISTS),
        }
    }

    /// The verdict for a DELETE of `namespace`. A namespace whose Stacks the operator may
    /// not list (a namespace-scoped install) holds none it manages, so it is allowed.
    pub async fn check(&self, namespace: &str) -> Result<Verdict, GuardError> {
        // The name goes into a request path.
        if !is_dns1123_label(namespace) {
            return Err(GuardError::Name(namespace.chars().take(80).collect()));
        }
        let _slot = tokio::time::timeout(LIST_TIMEOUT, self.lists.acquire())
            .await
            .map_err(|_| GuardError::Busy)?
            .map_err(|_| GuardError::Busy)?;
        tokio::time::timeout(LIST_TIMEOUT, self.facts(namespace))
            .await
            .map_err(|_| GuardError::Timeout {
                namespace: namespace.to_owned(),
                timeout: LIST_TIMEOUT,
            })?
    }

    async fn facts(&self, namespace: &str) -> Result<Verdict, GuardError> {
        let stacks: Api<Stack> = Api::namespaced(self.client.clone(), namespace);
        let mut params = ListParams::default().limit(PAGE);
        let mut facts = Vec::new();
        loop {
            let page = match stacks.list(&params).await {
                Ok(page) => page,
                Err(kube::Error::Api(e)) if e.code == 403 || e.code == 404 => {
                    return Ok(Verdict::Allow);
                }
                Err(source) => {
                    return Err(GuardError::List {
                        namespace: namespace.to_owned(),
                        source,
                    });
                }
            };
            facts.extend(page.items.iter().map(StackFacts::of));
            // One Stack still to be destroyed (not yet being deleted) settles the message.
            if facts.iter().any(|f| f.destroy_pending() && !f.deleting) {
                break;
            }
            match page.metadata.continue_.filter(|c| !c.is_empty()) {
                Some(token) => params = params.continue_token(&token),
                None => break,
            }
        }
        Ok(verdict(namespace, facts))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stack(destroy_on_finalize: bool, finalizer: bool, deleting: bool) -> StackFacts {
        StackFacts {
            destroy_on_finalize,
            finalizer,
            deleting,
        }
    }

    #[test]
    fn a_namespace_without_stacks_to_destroy_goes() {
        assert_eq!(verdict("a", []), Verdict::Allow);
        // Without destroyOnFinalize nothing is destroyed, so nothing is lost.
        assert_eq!(verdict("a", [stack(false, true, false)]), Verdict::Allow);
        // Not reconciled yet (no finalizer): the operator never deployed it.
        assert_eq!(verdict("a", [stack(true, false, false)]), Verdict::Allow);
        // Destroyed, its finalizer gone: only the object is left.
        assert_eq!(verdict("a", [stack(true, false, true)]), Verdict::Allow);
    }

    #[test]
    fn a_stack_to_destroy_holds_the_namespace_and_the_message_says_what_to_run() {
        let Verdict::Refuse(message) = verdict(
            "team-a",
            [stack(false, true, false), stack(true, true, false)],
        ) else {
            panic!("allowed");
        };
        assert!(
            message.contains("kubectl delete stacks --all -n team-a"),
            "{message}"
        );
        assert!(message.contains("destroyOnFinalize to false"), "{message}");
    }

    #[test]
    fn stacks_being_destroyed_hold_the_namespace_until_they_are_gone() {
        let Verdict::Refuse(message) =
            verdict("b", [stack(true, true, true), stack(true, true, true)])
        else {
            panic!("allowed");
        };
        assert!(message.contains("kubectl wait --for=delete"), "{message}");
        // One not yet deleted: the user has something to delete, not only to wait for.
        let Verdict::Refuse(message) =
            verdict("b", [stack(true, true, true), stack(true, true, false)])
        else {
            panic!("allowed");
        };
        assert!(message.contains("kubectl delete stacks"), "{message}");
    }

    #[tokio::test]
    async fn a_name_that_is_no_label_is_refused_before_any_request() {
        // No apiserver behind this client: a request would fail with a connection error.
        let config = kube::Config::new("http://127.0.0.1:9".parse().expect("uri"));
        let client = Client::try_from(config).expect("client");
        let guard = NamespaceGuard::new(client);
        for name in ["../kube-system", "a/b", "A", ""] {
            assert!(
                matches!(guard.check(name).await, Err(GuardError::Name(_))),
                "{name}"
            );
        }
    }
}
