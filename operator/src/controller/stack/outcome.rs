//! How a reconcile ends: the [`Outcome`] the conditions report, or a [`Stop`] that ends it
//! early. A leaf module: the phases, the source and the status writer all share these types.

use std::time::Duration;

use kube::runtime::controller::Action;
use pko_api::stack::StackStatus;

use crate::controller::backoff::{self, Verdict};
use crate::controller::conditions;
use crate::controller::kit;

/// Failures of one reconcile.
#[derive(Debug, thiserror::Error)]
pub enum StackError {
    #[error("stack has no namespace")]
    NoNamespace,
    #[error("{0} has no uid")]
    NoUid(&'static str),
    #[error("{what}: {source}")]
    Kube {
        what: String,
        #[source]
        source: kube::Error,
    },
    #[error("cannot encode: {0}")]
    Encode(#[from] serde_json::Error),
}

impl StackError {
    /// Whether retrying may help (see [`backoff`]).
    pub fn verdict(&self) -> Verdict {
        match self {
            Self::Kube { source, .. } => backoff::classify(source),
            Self::NoNamespace | Self::NoUid(_) | Self::Encode(_) => Verdict::Permanent,
        }
    }

    /// What the status and the Event say: the apiserver's own message for its refusals.
    pub fn message(&self) -> String {
        match self {
            Self::Kube { what, source } => format!("{what}: {}", backoff::describe(source)),
            other => other.to_string(),
        }
    }
}

impl kit::FromKube for StackError {
    fn from_kube(what: String, source: kube::Error) -> Self {
        Self::Kube { what, source }
    }
}

impl kit::MetricLabel for StackError {
    fn metric_label(&self) -> &'static str {
        "reconcile"
    }
}

/// What the status says at the end of a reconcile (kstatus: Ready, Reconciling, Stalled), and
/// when to look again (`None`: on the next change).
#[derive(Debug, Clone, PartialEq)]
pub(super) enum Outcome {
    /// Up to date.
    Ready { requeue: Option<Duration> },
    /// In progress, or waiting for something that will change by itself.
    Reconciling {
        reason: &'static str,
        message: String,
        requeue: Option<Duration>,
    },
    /// Cannot go on until the spec (or the world) changes.
    Stalled {
        reason: &'static str,
        message: String,
        requeue: Option<Duration>,
    },
}

impl Outcome {
    pub(super) fn reconciling(reason: &'static str, message: impl Into<String>) -> Self {
        Self::Reconciling {
            reason,
            message: message.into(),
            requeue: None,
        }
    }

    pub(super) fn stalled(reason: &'static str, message: impl Into<String>) -> Self {
        Self::Stalled {
            reason,
            message: message.into(),
            requeue: None,
        }
    }

    /// The same outcome, looked at again after `after`.
    pub(super) fn after(mut self, after: Duration) -> Self {
        match &mut self {
            Self::Ready { requeue }
            | Self::Reconciling { requeue, .. }
            | Self::Stalled { requeue, .. } => *requeue = Some(after),
        }
        self
    }

    /// The same outcome, looked at again after `at_most` or sooner if it already says so.
    pub(super) fn sooner(mut self, at_most: Duration) -> Self {
        match &mut self {
            Self::Ready { requeue }
            | Self::Reconciling { requeue, .. }
            | Self::Stalled { requeue, .. } => {
                *requeue = Some(requeue.map_or(at_most, |r| r.min(at_most)));
            }
        }
        self
    }

    /// Sets the conditions it stands for and says when to reconcile again.
    pub(super) fn apply(&self, status: &mut StackStatus, generation: Option<i64>) -> Action {
        let requeue = match self {
            Self::Ready { requeue } => {
                ready(status, generation);
                requeue
            }
            Self::Reconciling {
                reason,
                message,
                requeue,
            } => {
                reconciling(status, generation, reason, message);
                requeue
            }
            Self::Stalled {
                reason,
                message,
                requeue,
            } => {
                stalled(status, generation, reason, message);
                requeue
            }
        };
        requeue.map_or_else(Action::await_change, Action::requeue)
    }
}

/// Why the phases end before the last one.
#[derive(Debug)]
pub(super) enum Stop {
    /// The status says it: written, then requeued as the outcome says.
    Status(Outcome),
    /// Nothing to write (a finalizer was added or removed, or the stack is not ours to handle):
    /// the change itself brings the next reconcile.
    Quiet,
    /// A failure: nothing written, the error policy retries.
    Failed(StackError),
}

impl From<StackError> for Stop {
    fn from(err: StackError) -> Self {
        Self::Failed(err)
    }
}

impl From<Outcome> for Stop {
    fn from(outcome: Outcome) -> Self {
        Self::Status(outcome)
    }
}

// The ready protocol (kstatus), as PKO's helpers.
pub(super) fn reconciling(
    status: &mut StackStatus,
    generation: Option<i64>,
    reason: &str,
    message: &str,
) {
    conditions::remove(&mut status.conditions, "Stalled");
    conditions::set(
        &mut status.conditions,
        "Ready",
        false,
        "NotReadyInProgress",
        "reconciliation is in progress",
        generation,
    );
    conditions::set(
        &mut status.conditions,
        "Reconciling",
        true,
        reason,
        message,
        generation,
    );
}

pub(super) fn stalled(
    status: &mut StackStatus,
    generation: Option<i64>,
    reason: &str,
    message: &str,
) {
    conditions::remove(&mut status.conditions, "Reconciling");
    conditions::set(
        &mut status.conditions,
        "Ready",
        false,
        "NotReadyStalled",
        message,
        generation,
    );
    conditions::set(
        &mut status.conditions,
        "Stalled",
        true,
        reason,
        message,
        generation,
    );
}

fn ready(status: &mut StackStatus, generation: Option<i64>) {
    conditions::remove(&mut status.conditions, "Reconciling");
    conditions::remove(&mut status.conditions, "Stalled");
    conditions::set(
        &mut status.conditions,
        "Ready",
        true,
        "ProcessingCompleted",
        "the stack has been processed and is up to date",
        generation,
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    fn types(status: &StackStatus) -> Vec<(String, String, String)> {
        let mut v: Vec<_> = status
            .conditions
            .iter()
            .map(|c| (c.type_.clone(), c.status.clone(), c.reason.clone()))
            .collect();
        v.sort();
        v
    }

    #[test]
    fn outcomes_set_the_kstatus_conditions_and_the_requeue() {
        let mut status = StackStatus::default();
        let action = Outcome::stalled("SpecInvalid", "bad").apply(&mut status, Some(2));
        assert_eq!(action, Action::await_change());
        assert_eq!(
            types(&status),
            vec![
                ("Ready".into(), "False".into(), "NotReadyStalled".into()),
                ("Stalled".into(), "True".into(), "SpecInvalid".into()),
            ]
        );
        let action = Outcome::reconciling("StackProcessing", "busy")
            .after(Duration::from_secs(300))
            .apply(&mut status, Some(2));
        assert_eq!(action, Action::requeue(Duration::from_secs(300)));
        assert_eq!(
            types(&status),
            vec![
                ("Ready".into(), "False".into(), "NotReadyInProgress".into()),
                (
                    "Reconciling".into(),
                    "True".into(),
                    "StackProcessing".into()
                ),
            ]
        );
        let action = Outcome::Ready { requeue: None }.apply(&mut status, Some(2));
        assert_eq!(action, Action::await_change());
        assert_eq!(
            types(&status),
            vec![("Ready".into(), "True".into(), "ProcessingCompleted".into())]
        );
    }
}
