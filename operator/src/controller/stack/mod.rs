//! Stack controller: a Stack becomes a Workspace (its program, config and env) and one Update per
//! change; results come back into `status` (`lastUpdate`, outputs with secrets masked, PKO's
//! Ready/Reconciling/Stalled conditions).
//!
//! Beyond PKO: a Program source re-runs when its digest changes, not only its revision; a
//! `currentUpdate` whose Update is gone is dropped and the stack carries on (PKO waits forever,
//! #1292); `currentUpdate` is saved only once its Update exists.
//!
//! Sources (see [`source`]): `programRef` (watched), `fluxSource` (watched per kind, see
//! [`flux`]), `projectRepo` (a pinned commit, or a branch polled without cloning), or none (the
//! program is in the workspace image: `workspaceTemplate.spec.local`).
//!
//! Layout: [`reconcile`] runs the phases in order (finalizer, current Update, source, sync
//! decision, the approval gate of [`approval`], launch) and writes the status once; [`sync`] holds the pure decisions;
//! [`workspace`] and [`update`] build the typed objects; [`outcome`] is what a reconcile ends
//! with.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use kube::api::Api;
use kube::runtime::controller::{self, Action};
use kube::runtime::events::{EventType, Recorder};
use kube::runtime::reflector::{self, ObjectRef, Store, store::Writer};
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Client, Resource, ResourceExt};
use pko_api::program::Program;
use pko_api::stack::Stack;
use pko_api::update::Update;
use pko_api::workspace::Workspace;

use crate::controller::backoff::Backoff;
use crate::controller::instrument::{self, Observed};
use crate::controller::keys::{STACK_COMPONENT_LABEL, STACK_NAME_LABEL};
use crate::controller::kit::{self, Kit};
use crate::egress::EgressPolicy;
use crate::gitremote;
use crate::metrics::Metrics;
use crate::runtime_metrics::names;

mod approval;
mod drift;
mod flux;
mod history;
mod outcome;
mod reconcile;
mod source;
mod sync;
mod update;
mod workspace;

pub use flux::FluxWatches;
pub use outcome::StackError;

const CONTROLLER: &str = "stack";

/// What every reconcile needs.
pub struct StackContext {
    pub client: Client,
    pub recorder: Recorder,
    pub metrics: Metrics,
    /// Branch → commit lookups, shared by every stack.
    pub git: gitremote::Resolver,
    /// Failed reconciles per Stack.
    pub backoff: Backoff,
    /// The Flux source kinds watched for this controller's stacks.
    pub flux: FluxWatches,
    /// The Stacks' Workspaces as watched, holding PKO's `managedFields` entries only: a
    /// Workspace PKO's Stack controller applied is applied again with this operator's source
    /// after a switch-over (`reconcile.rs`).
    pub workspaces: Store<Workspace>,
    /// Feeds `workspaces`; taken by [`run`].
    workspaces_writer: std::sync::Mutex<Option<Writer<Workspace>>>,
    /// What this process last applied to each Stack's Workspace (see [`workspace::Applied`]).
    applied: workspace::AppliedWorkspaces,
    /// The status writes of this controller, so a reconcile never decides on an older view.
    own_writes: kit::OwnWrites,
}

impl StackContext {
    pub fn new(kit: &Kit, egress: Arc<EgressPolicy>, git: gitremote::RemoteOptions) -> Self {
        Self {
            client: kit.client.clone(),
            recorder: kit.recorder(CONTROLLER),
            metrics: kit.metrics.clone(),
            git: gitremote::Resolver::new(
                git_http_client(&egress),
                egress.clone(),
                GIT_REFS_TTL,
                git,
            ),
            backoff: Backoff::default(),
            ..Self::without_workspaces(kit.client.clone(), kit.recorder(CONTROLLER))
        }
    }

    /// A context whose Workspace store nothing feeds (for tests), and the base of [`Self::new`].
    pub(crate) fn without_workspaces(client: Client, recorder: Recorder) -> Self {
        let (workspaces, writer) = reflector::store();
        Self {
            client,
            recorder,
            metrics: Metrics::default(),
            git: gitremote::Resolver::new(
                git_http_client(&Arc::new(EgressPolicy::default())),
                Arc::new(EgressPolicy::default()),
                GIT_REFS_TTL,
                gitremote::RemoteOptions::default(),
            ),
            backoff: Backoff::default(),
            workspaces,
            workspaces_writer: std::sync::Mutex::new(Some(writer)),
            applied: workspace::AppliedWorkspaces::default(),
            own_writes: kit::OwnWrites::default(),
            flux: FluxWatches::default(),
        }
    }

    async fn event(&self, stack: &Stack, type_: EventType, reason: &str, note: String) {
        let object = stack.object_ref(&());
        kit::publish(&self.recorder, &object, type_, reason, "Reconcile", &note).await;
    }
}

/// How long a branch lookup is reused (stacks polling one branch share the request).
const GIT_REFS_TTL: Duration = Duration::from_secs(20);

/// The HTTP client for refs listings: the system's trusted roots, no cookies, a bounded number
/// of redirects (hosts redirect `/repo` to `/repo.git`), and only addresses the egress rules
/// allow (the URL is the tenant's). A client that fails to build is never replaced by one
/// without those rules: branch lookups then fail with the reason (SourceUnavailable), and the
/// operator logs it once here.
fn git_http_client(egress: &Arc<EgressPolicy>) -> Result<reqwest::Client, String> {
    egress
        .client_builder(5)
        .user_agent(concat!("pko-rs/", env!("CARGO_PKG_VERSION"), " git/2"))
        .build()
        .map_err(|e| {
            let detail = crate::egress::describe(&e);
            tracing::error!(error = %detail, "cannot build the HTTP client for branch lookups");
            detail
        })
}

/// Runs the controller until `shutdown` resolves.
pub async fn run(
    client: Client,
    namespace: Option<String>,
    ctx: Arc<StackContext>,
    concurrency: u16,
    shutdown: impl std::future::Future<Output = ()> + Send + Sync + 'static,
) {
    fn api<K: Resource<Scope = kube::core::NamespaceResourceScope, DynamicType = ()>>(
        client: &Client,
        ns: Option<&str>,
    ) -> Api<K> {
        match ns {
            Some(ns) => Api::namespaced(client.clone(), ns),
            None => Api::all(client.clone()),
        }
    }
    let ns = namespace.as_deref();
    let probe = ctx
        .metrics
        .runtime
        .controller(names::STACK, concurrency.max(1));
    let controller = instrument::controller(
        &probe,
        api::<Stack>(&client, ns),
        watcher::Config::default().any_semantic(),
    );
    let store = controller.store();
    let dependents_store = store.clone();
    // Stacks whose Flux source has a new artifact (see [`flux`]).
    let (trigger, triggered) = futures::channel::mpsc::unbounded();
    let flux_scope = flux::Scope {
        client: client.clone(),
        namespace: namespace.clone(),
        stacks: store.clone(),
        trigger,
    };
    let controller = controller.reconcile_on_observed(&probe, triggered);
    let by_label = |obj_ns: Option<String>, labels: &BTreeMap<String, String>| {
        labels
            .get(STACK_NAME_LABEL)
            .zip(obj_ns)
            .map(|(name, ns)| ObjectRef::<Stack>::new(name).within(&ns))
    };
    let stack_selector = format!("{STACK_COMPONENT_LABEL}=stack");
    let workspace_changes = workspace_changes(
        &ctx,
        api::<Workspace>(&client, ns),
        watcher::Config::default().labels(&stack_selector),
    );
    let events = controller
        .watches_stream_observed(&probe, workspace_changes, move |ws: Workspace| {
            by_label(ws.namespace(), ws.labels())
        })
        .watches_observed(
            &probe,
            api::<Update>(&client, ns),
            watcher::Config::default().labels(&stack_selector),
            move |u: Update| by_label(u.namespace(), u.labels()),
        )
        // A new artifact (revision or digest) of a Program re-runs the stacks using it.
        .watches_observed(
            &probe,
            api::<Program>(&client, ns),
            watcher::Config::default(),
            move |p: Program| {
                let name = p.name_any();
                let ns = p.namespace();
                store
                    .state()
                    .into_iter()
                    .filter(|s| {
                        s.namespace() == ns
                            && s.spec.program_ref.as_ref().is_some_and(|r| r.name == name)
                    })
                    .map(|s| ObjectRef::from_obj(&*s))
                    .collect::<Vec<_>>()
            },
        )
        // A stack that changes (e.g. becomes ready) re-checks the stacks that depend on it.
        .watches_observed(
            &probe,
            api::<Stack>(&client, ns),
            watcher::Config::default(),
            move |prerequisite: Stack| {
                let name = prerequisite.name_any();
                let ns = prerequisite.namespace();
                dependents_store
                    .state()
                    .into_iter()
                    .filter(|s| {
                        s.namespace() == ns && s.spec.prerequisites.iter().any(|p| p.name == name)
                    })
                    .map(|s| ObjectRef::from_obj(&*s))
                    .collect::<Vec<_>>()
            },
        )
        .with_config(controller::Config::default().concurrency(concurrency))
        .graceful_shutdown_on(shutdown)
        .run(
            instrument::reconciler(&probe, reconcile::reconcile),
            instrument::error_policy(&probe, error_policy),
            ctx.clone(),
        );
    // The watches end with the controller (they never end before it).
    tokio::select! {
        () = instrument::drive(CONTROLLER, &probe, events) => {}
        () = flux::drive(&ctx.flux, flux_scope) => {}
    }
}

/// The Stacks' Workspaces, watched into the context's store with PKO's `managedFields`
/// entries only (to tell a Workspace PKO applied; the rest is dropped).
fn workspace_changes(
    ctx: &StackContext,
    api: Api<Workspace>,
    config: watcher::Config,
) -> impl futures::Stream<Item = Result<Workspace, watcher::Error>> + Send + 'static {
    let writer = ctx
        .workspaces_writer
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
        .take()
        .unwrap_or_else(|| reflector::store().1);
    watcher::watcher(api, config)
        .default_backoff()
        .modify(|ws| {
            ws.managed_fields_mut().retain(|e| {
                e.manager
                    .as_deref()
                    .is_some_and(pko_api::decode::is_pko_manager)
            });
        })
        .reflect(writer)
        .touched_objects()
}

fn error_policy(stack: Arc<Stack>, err: &StackError, ctx: Arc<StackContext>) -> Action {
    kit::error_policy(CONTROLLER, &*stack, err, &ctx.metrics, &ctx.backoff)
}
