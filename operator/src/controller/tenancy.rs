//! TenancyPolicy status: how many namespaces a policy selects, and whether the webhook can use
//! all of it.
//!
//! The webhook (on every replica) evaluates the policies; this controller (on the leader) only
//! reports. An invalid `namespaceSelector` would otherwise fail silently: the webhook logs it and
//! the selector selects nothing, so the status says so (`Ready=False`,
//! `InvalidNamespaceSelector`). A namespace created, deleted or relabelled updates the counts.

use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::api::core::v1::Namespace;
use kube::api::{Api, Patch, PatchParams};
use kube::core::{PartialObjectMeta, Selector};
use kube::runtime::controller::{self, Action, Controller};
use kube::runtime::events::Recorder;
use kube::runtime::reflector::{self, ObjectRef, Store};
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Client, Resource, ResourceExt};
use pko_api::tenancy::{TenancyPolicy, TenancyPolicyStatus};

use crate::controller::backoff::{self, Backoff};
use crate::controller::conditions;
use crate::controller::keys::TENANCY_STATUS_MANAGER;
use crate::controller::kit::{self, FromKube, Kit};
use crate::metrics::Metrics;

const CONTROLLER: &str = "tenancy";

#[derive(Debug, thiserror::Error)]
pub enum TenancyStatusError {
    #[error("the namespace watch stopped before listing namespaces")]
    NamespacesNotListed,
    #[error("{what}: {source}")]
    Kube {
        what: String,
        #[source]
        source: kube::Error,
    },
}

impl kit::FromKube for TenancyStatusError {
    fn from_kube(what: String, source: kube::Error) -> Self {
        Self::Kube { what, source }
    }
}

impl kit::MetricLabel for TenancyStatusError {
    fn metric_label(&self) -> &'static str {
        "kube"
    }
}

impl TenancyStatusError {
    fn verdict(&self) -> backoff::Verdict {
        match self {
            Self::Kube { source, .. } => backoff::classify(source),
            Self::NamespacesNotListed => backoff::Verdict::Transient,
        }
    }
}

pub struct TenancyContext {
    pub client: Client,
    pub metrics: Metrics,
    /// Failed reconciles per policy. Every failure is a failed status write (or the namespace
    /// watch not ready), so there is no status to report it in: it is logged, retried, and a
    /// stall is told by an Event.
    pub backoff: Backoff,
    pub recorder: Recorder,
}

impl TenancyContext {
    pub fn new(kit: &Kit) -> Self {
        Self {
            client: kit.client.clone(),
            metrics: kit.metrics.clone(),
            backoff: Backoff::default(),
            recorder: kit.recorder(CONTROLLER),
        }
    }
}

/// What a reconcile reads: the context, and the namespaces (names and labels) as the
/// controller's own watch sees them, so a reconcile lists nothing.
pub struct Shared {
    ctx: Arc<TenancyContext>,
    namespaces: Store<PartialObjectMeta<Namespace>>,
}

/// Runs until `shutdown` resolves.
pub async fn run(
    ctx: Arc<TenancyContext>,
    shutdown: impl std::future::Future<Output = ()> + Send + Sync + 'static,
) {
    let client = ctx.client.clone();
    let controller = Controller::new(
        Api::<TenancyPolicy>::all(client.clone()),
        watcher::Config::default().any_semantic(),
    );
    let policies = controller.store();
    let (namespaces, writer) = reflector::store::<PartialObjectMeta<Namespace>>();
    // Metadata only: names and labels are all a selector needs.
    let namespace_changes = watcher(
        Api::<PartialObjectMeta<Namespace>>::all(client.clone()),
        watcher::Config::default(),
    )
    .default_backoff()
    .reflect(writer)
    .touched_objects();
    let events = controller
        // Any namespace change may change any policy's count.
        .watches_stream(namespace_changes, move |_| {
            policies
                .state()
                .iter()
                .map(|p| ObjectRef::from_obj(p.as_ref()))
                .collect::<Vec<_>>()
        })
        .with_config(controller::Config::default().debounce(Duration::from_millis(500)))
        .graceful_shutdown_on(shutdown)
        .run(
            reconcile,
            error_policy,
            Arc::new(Shared { ctx, namespaces }),
        );
    kit::drive(CONTROLLER, events).await;
}

fn error_policy(
    policy: Arc<TenancyPolicy>,
    err: &TenancyStatusError,
    shared: Arc<Shared>,
) -> Action {
    let ctx = &shared.ctx;
    kit::error_policy(CONTROLLER, &*policy, err, &ctx.metrics, &ctx.backoff)
}

async fn reconcile(
    policy: Arc<TenancyPolicy>,
    shared: Arc<Shared>,
) -> Result<Action, TenancyStatusError> {
    let _measure = kit::measure(&shared.ctx.metrics, CONTROLLER);
    let result = reconcile_inner(&policy, &shared).await;
    let ctx = &shared.ctx;
    let failure = ctx
        .backoff
        .record(&policy.metadata, &result, TenancyStatusError::verdict);
    // The status is what cannot be written: a stall is told by an Event, once.
    if let (Some(failure), Err(err)) = (failure, &result)
        && failure.first_stall
    {
        let object = policy.object_ref(&());
        kit::publish_stall(&ctx.recorder, &object, "WriteStatus", &err.to_string()).await;
    }
    result
}

/// The status a policy should have, given every namespace's name and labels.
pub fn status_for<'a>(
    policy: &TenancyPolicy,
    namespaces: impl IntoIterator<Item = &'a PartialObjectMeta<Namespace>>,
) -> TenancyPolicyStatus {
    let name = policy.name_any();
    let generation = policy.metadata.generation;
    let selected = namespaces
        .into_iter()
        .filter(|ns| {
            pko_admission::tenancy::selects(&name, &policy.spec, &ns.name_any(), ns.labels())
        })
        .count();
    let mut status = policy.status.clone().unwrap_or_default();
    status.observed_generation = generation;
    status.selected_namespaces = Some(selected as i64);
    let invalid = policy
        .spec
        .namespace_selector
        .clone()
        .map(Selector::try_from)
        .and_then(Result::err);
    let (ok, reason, message) = match invalid {
        Some(e) => (
            false,
            "InvalidNamespaceSelector",
            format!(
                "namespaceSelector is invalid ({e}): it selects nothing, only spec.namespaces apply"
            ),
        ),
        None => (true, "Accepted", format!("selects {selected} namespace(s)")),
    };
    conditions::set(
        &mut status.conditions,
        "Ready",
        ok,
        reason,
        &message,
        generation,
    );
    status
}

async fn reconcile_inner(
    policy: &TenancyPolicy,
    shared: &Shared,
) -> Result<Action, TenancyStatusError> {
    let ctx = &shared.ctx;
    // Counting before the namespace watch has listed everything would report too few.
    shared
        .namespaces
        .wait_until_ready()
        .await
        .map_err(|_| TenancyStatusError::NamespacesNotListed)?;
    let namespaces = shared.namespaces.state();
    let status = status_for(policy, namespaces.iter().map(AsRef::as_ref));
    let before = policy.status.clone().unwrap_or_default();
    let same = before.observed_generation == status.observed_generation
        && before.selected_namespaces == status.selected_namespaces
        && conditions::same(&before.conditions, &status.conditions);
    if !same {
        let patch = kit::StatusPatch::new::<TenancyPolicy>(&status);
        Api::<TenancyPolicy>::all(ctx.client.clone())
            .patch_status(
                &policy.name_any(),
                &PatchParams::apply(TENANCY_STATUS_MANAGER).force(),
                &Patch::Apply(&patch),
            )
            .await
            .map_err(TenancyStatusError::kube("writing the TenancyPolicy status"))?;
    }
    Ok(Action::await_change())
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::Value;
    use serde_json::json;

    fn ns(name: &str, labels: Value) -> PartialObjectMeta<Namespace> {
        serde_json::from_value(json!({
            "apiVersion": "v1", "kind": "Namespace",
            "metadata": {"name": name, "labels": labels},
        }))
        .expect("namespace")
    }

    fn policy(spec: Value) -> TenancyPolicy {
        let mut p: TenancyPolicy = serde_json::from_value(json!({
            "apiVersion": "pko-rs.dev/v1alpha1", "kind": "TenancyPolicy",
            "metadata": {"name": "p"}, "spec": spec,
        }))
        .expect("policy");
        p.metadata.generation = Some(3);
        p
    }

    fn ready(status: &TenancyPolicyStatus) -> (String, String) {
        let c = conditions::get(&status.conditions, "Ready").expect("Ready");
        (c.status.clone(), c.reason.clone())
    }

    #[test]
    fn counts_names_and_labels_once_each() {
        let all = [
            ns("a", json!({"team": "blue"})),
            ns("b", json!({"team": "blue"})),
            ns("c", json!({})),
        ];
        let p = policy(
            json!({"namespaces": ["a", "c"], "namespaceSelector": {"matchLabels": {"team": "blue"}}}),
        );
        let status = status_for(&p, &all);
        assert_eq!(status.selected_namespaces, Some(3));
        assert_eq!(status.observed_generation, Some(3));
        assert_eq!(ready(&status), ("True".into(), "Accepted".into()));
    }

    #[test]
    fn an_invalid_selector_is_reported() {
        let all = [ns("a", json!({"team": "blue"}))];
        let p = policy(json!({
            "namespaces": ["a"],
            "namespaceSelector": {"matchExpressions": [{"key": "team", "operator": "Near", "values": ["blue"]}]},
        }));
        let status = status_for(&p, &all);
        assert_eq!(status.selected_namespaces, Some(1), "names still apply");
        assert_eq!(
            ready(&status),
            ("False".into(), "InvalidNamespaceSelector".into())
        );
    }
}
