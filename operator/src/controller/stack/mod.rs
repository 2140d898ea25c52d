//! Stack controller: a Stack becomes a Workspace (its program, config and env) and one Update per
//! change; results come back into `status` (`lastUpdate`, outputs with secrets masked, PKO's
//! Ready/Reconciling/Stalled conditions).
//!
//! Beyond PKO: a Program source re-runs when its digest changes, not only its revision; a
//! `currentUpdate` whose Update is gone is dropped and the stack carries on (PKO waits forever,
//! #1292); `currentUpdate` is saved only once its Update exists.
//!
//! Sources (see [`source`]): `programRef` (watched), `fluxSource` (polled), `projectRepo`
//! (a pinned commit, or a branch polled without cloning).

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use k8s_openapi::api::core::v1::Secret;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, Patch, PatchParams, PostParams};
use kube::runtime::controller::{self, Action, Controller};
use kube::runtime::events::{EventType, Recorder};
use kube::runtime::reflector::ObjectRef;
use kube::runtime::watcher;
use kube::{Client, Resource, ResourceExt};
use pko_api::common::{ResourceRef, ResourceSelectorType};
use pko_api::program::Program;
use pko_api::stack::{
    CurrentStackUpdate, Stack, StackStatus, StackUpdateState, WorkspaceReclaimPolicy,
};
use pko_api::update::Update;
use pko_api::workspace::Workspace;
use serde_json::{Value, json};
use tracing::{info, warn};

use crate::controller::backoff::{self, Backoff, Verdict};
use crate::controller::conditions;
use crate::controller::kit::{self, Kit};
use crate::controller::update::SECRETS_ANNOTATION;
use crate::controller::workspace::{APPLY_MANAGER, merge, pod};
use crate::egress::EgressPolicy;
use crate::gitremote;
use crate::metrics::{ErrorLabels, Metrics};

mod source;

pub const STATUS_MANAGER: &str = "pko-rs/stack-status";
pub const FINALIZER: &str = "finalizer.stack.pulumi.com";
pub const RECONCILE_REQUEST_ANNOTATION: &str = "pulumi.com/reconciliation-request";
pub const COMPONENT_LABEL: &str = "pulumi.com/component";
pub const STACK_NAME_LABEL: &str = "pulumi.com/stack-name";
const CONTROLLER: &str = "stack";
/// PKO's hard-coded limit: after this many consecutive failures the stack stalls.
const MAX_FAILURES: i64 = 3;
const DEFAULT_MAX_BACKOFF: i64 = 86_400;

/// Failures of one reconcile.
#[derive(Debug, thiserror::Error)]
pub enum StackError {
    #[error("stack has no namespace")]
    NoNamespace,
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
    fn verdict(&self) -> Verdict {
        match self {
            Self::Kube { source, .. } => backoff::classify(source),
            Self::NoNamespace | Self::Encode(_) => Verdict::Permanent,
        }
    }

    /// What the status and the Event say: the apiserver's own message for its refusals.
    fn message(&self) -> String {
        match self {
            Self::Kube { what, source } => format!("{what}: {}", backoff::describe(source)),
            other => other.to_string(),
        }
    }
}

fn kube_err(what: impl Into<String>) -> impl FnOnce(kube::Error) -> StackError {
    let what = what.into();
    move |source| StackError::Kube { what, source }
}

/// What every reconcile needs.
pub struct StackContext {
    pub client: Client,
    pub recorder: Recorder,
    pub metrics: Metrics,
    /// Branch → commit lookups, shared by every stack.
    pub git: gitremote::Resolver,
    /// Failed reconciles per Stack.
    pub backoff: Backoff,
}

impl StackContext {
    pub fn new(kit: &Kit, egress: Arc<EgressPolicy>) -> Self {
        Self {
            client: kit.client.clone(),
            recorder: kit.recorder(CONTROLLER),
            metrics: kit.metrics.clone(),
            git: gitremote::Resolver::new(git_http_client(&egress), egress.clone(), GIT_REFS_TTL),
            backoff: Backoff::default(),
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
/// allow (the URL is the tenant's).
fn git_http_client(egress: &Arc<EgressPolicy>) -> reqwest::Client {
    egress
        .client_builder(5)
        .user_agent(concat!("pko-rs/", env!("CARGO_PKG_VERSION"), " git/2"))
        .build()
        .unwrap_or_default()
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
    let controller = Controller::new(
        api::<Stack>(&client, ns),
        watcher::Config::default().any_semantic(),
    );
    let store = controller.store();
    let dependents_store = store.clone();
    let by_label = |obj_ns: Option<String>, labels: &BTreeMap<String, String>| {
        labels
            .get(STACK_NAME_LABEL)
            .zip(obj_ns)
            .map(|(name, ns)| ObjectRef::<Stack>::new(name).within(&ns))
    };
    let stack_selector = format!("{COMPONENT_LABEL}=stack");
    controller
        .watches(
            api::<Workspace>(&client, ns),
            watcher::Config::default().labels(&stack_selector),
            move |ws: Workspace| by_label(ws.namespace(), ws.labels()),
        )
        .watches(
            api::<Update>(&client, ns),
            watcher::Config::default().labels(&stack_selector),
            move |u: Update| by_label(u.namespace(), u.labels()),
        )
        // A new artifact (revision or digest) of a Program re-runs the stacks using it.
        .watches(
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
        .watches(
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
        .run(reconcile, error_policy, ctx)
        .for_each(|result| async move {
            if let Err(err) = result {
                warn!(controller = CONTROLLER, error = %err, "controller event");
            }
        })
        .await;
}

fn error_policy(stack: Arc<Stack>, err: &StackError, ctx: Arc<StackContext>) -> Action {
    warn!(stack = %stack.name_any(), error = %err, "reconcile failed");
    ctx.metrics
        .reconcile_errors
        .get_or_create(&ErrorLabels {
            controller: CONTROLLER.into(),
            error: "reconcile".into(),
        })
        .inc();
    Action::requeue(ctx.backoff.delay(&backoff::key(&stack.metadata)))
}

// The ready protocol (kstatus), as PKO's helpers.
fn reconciling(status: &mut StackStatus, generation: Option<i64>, reason: &str, message: &str) {
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

fn stalled(status: &mut StackStatus, generation: Option<i64>, reason: &str, message: &str) {
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

fn cooldown(stack: &Stack, failures: i64) -> Duration {
    let cap = stack
        .spec
        .retry_max_backoff_duration_seconds
        .filter(|s| *s > 0)
        .unwrap_or(DEFAULT_MAX_BACKOFF);
    let secs = 10i64
        .saturating_mul(3i64.saturating_pow(failures.clamp(0, 20) as u32))
        .min(cap);
    Duration::from_secs(secs.max(0) as u64)
}

pub(crate) fn resync_frequency(stack: &Stack) -> Duration {
    Duration::from_secs(stack.spec.resync_frequency_seconds.unwrap_or(60).max(60) as u64)
}

fn since(t: Option<&Time>) -> Duration {
    t.map(|t| Duration::try_from(Timestamp::now().duration_since(t.0)).unwrap_or(Duration::ZERO))
        .unwrap_or(Duration::MAX)
}

/// PKO's `isSynced`: whether the last update covers the current spec, request and source.
/// `Err(reason)` says why a new Update is needed.
fn is_synced(
    stack: &Stack,
    status: &StackStatus,
    commit: &str,
    request: Option<&str>,
    deleting: bool,
) -> Result<(), String> {
    let Some(last) = &status.last_update else {
        return Err("Initial stack update".into());
    };
    if deleting {
        return match (last.type_.as_deref(), last.state.as_deref()) {
            (Some("destroy"), Some("succeeded")) => Ok(()),
            (Some("destroy"), _)
                if since(last.last_resync_time.as_ref())
                    < cooldown(stack, last.failures.unwrap_or(0)) =>
            {
                Ok(())
            }
            _ => Err("Stack marked for deletion".into()),
        };
    }
    if last.generation != stack.metadata.generation {
        return Err(format!(
            "New stack generation: {}",
            stack.metadata.generation.unwrap_or(0)
        ));
    }
    if last.reconcile_request.as_deref() != request {
        return Err(format!("Sync request: {:?}", request.unwrap_or_default()));
    }
    if last.state.as_deref() == Some("succeeded") {
        if last.last_successful_commit.as_deref() != Some(commit) {
            return Err(format!("New commit detected: {commit:?}"));
        }
        if stack.spec.continue_resync_on_commit_match == Some(true)
            && since(last.last_resync_time.as_ref()) >= resync_frequency(stack)
        {
            return Err("Resync time elapsed".into());
        }
        return Ok(());
    }
    if last.last_attempted_commit.as_deref() != Some(commit) {
        return Err(format!("New commit detected: {commit:?}"));
    }
    let failures = last.failures.unwrap_or(0);
    if failures >= MAX_FAILURES {
        return Ok(());
    }
    if since(last.last_resync_time.as_ref()) >= cooldown(stack, failures) {
        return Err(format!("Backoff time elapsed: {failures} failure(s)"));
    }
    Ok(())
}

async fn set_finalizer(ctx: &StackContext, stack: &Stack, present: bool) -> Result<(), StackError> {
    let mut finalizers = stack.finalizers().to_vec();
    let has = finalizers.iter().any(|f| f == FINALIZER);
    if has == present {
        return Ok(());
    }
    if present {
        finalizers.push(FINALIZER.into());
    } else {
        finalizers.retain(|f| f != FINALIZER);
    }
    // The resource version makes this a compare-and-swap: other finalizers are never lost.
    let patch = json!({"metadata": {"finalizers": finalizers, "resourceVersion": stack.resource_version()}});
    Api::<Stack>::namespaced(ctx.client.clone(), &stack.namespace().unwrap_or_default())
        .patch(
            &stack.name_any(),
            &PatchParams::default(),
            &Patch::Merge(&patch),
        )
        .await
        .map_err(kube_err("updating the Stack finalizers"))?;
    Ok(())
}

/// Outputs of a succeeded Update: raw JSON values, secrets as `"[secret]"` (PKO's rule).
async fn read_outputs(
    ctx: &StackContext,
    namespace: &str,
    secret_name: &str,
) -> Option<BTreeMap<String, Value>> {
    let secret = Api::<Secret>::namespaced(ctx.client.clone(), namespace)
        .get_opt(secret_name)
        .await
        .ok()??;
    let secret_keys: Vec<String> = secret
        .annotations()
        .get(SECRETS_ANNOTATION)
        .and_then(|a| serde_json::from_str(a).ok())
        .unwrap_or_default();
    Some(
        secret
            .data
            .unwrap_or_default()
            .into_iter()
            .map(|(k, v)| {
                let value = if secret_keys.contains(&k) {
                    json!("[secret]")
                } else {
                    serde_json::from_slice(&v.0).unwrap_or(Value::Null)
                };
                (k, value)
            })
            .collect(),
    )
}

/// The Workspace spec of a stack (PKO's `setupWorkspace`), or a reason the spec is invalid.
fn workspace_spec(stack: &Stack, namespace: &str, source: Value) -> Result<Value, String> {
    let spec = &stack.spec;
    let mut env = Vec::new();
    if let Some(backend) = &spec.backend {
        env.push(json!({"name": "PULUMI_BACKEND_URL", "value": backend}));
    }
    if let Some(secret) = &spec.access_token_secret {
        env.push(json!({"name": "PULUMI_ACCESS_TOKEN", "valueFrom": {"secretKeyRef": {"name": secret, "key": "accessToken"}}}));
    }
    let secret_ref = |what: &str, r: &ResourceRef| -> Result<Value, String> {
        match r.selector_type {
            ResourceSelectorType::Literal => Ok(
                json!({"value": r.literal.as_ref().map(|l| l.value.clone()).unwrap_or_default()}),
            ),
            ResourceSelectorType::Secret => {
                let s = source::own_secret(what, r, namespace)?;
                Ok(json!({"secret": {"name": s.name, "key": s.key}}))
            }
            other => Err(format!(
                "{what}: {other:?} references are not supported (only Literal and Secret)"
            )),
        }
    };
    for (name, r) in &spec.env_refs {
        match secret_ref(&format!("envRefs.{name}"), r)? {
            v if v.get("value").is_some() => env.push(json!({"name": name, "value": v["value"]})),
            v => env.push(json!({"name": name, "valueFrom": {"secretKeyRef": v["secret"]}})),
        }
    }
    let mut config = Vec::new();
    for (key, value) in &spec.config {
        config.push(json!({"key": key, "value": value}));
    }
    let mut volumes = Vec::new();
    let mut mounts = Vec::new();
    for (key, r) in &spec.config_ref {
        let dir = format!(
            "/var/run/configmaps/stacks.pulumi.com/configmaps/{}",
            r.name
        );
        let volume = pod::volume_name("configmap", &r.name);
        if !volumes.iter().any(|v: &Value| v["name"] == volume) {
            volumes.push(json!({"name": volume, "configMap": {"name": r.name}}));
            mounts.push(json!({"name": volume, "mountPath": dir}));
        }
        config.push(
            json!({"key": key, "valueFrom": {"path": format!("{dir}/{}", r.key), "json": r.json}}),
        );
    }
    for (key, value) in &spec.secrets {
        config.push(json!({"key": key, "value": value, "secret": true}));
    }
    for (key, r) in &spec.secrets_ref {
        match secret_ref(&format!("secretsRef.{key}"), r)? {
            v if v.get("value").is_some() => {
                config.push(json!({"key": key, "value": v["value"], "secret": true}))
            }
            v => {
                let name = v["secret"]["name"].as_str().unwrap_or_default().to_owned();
                let dir = format!("/var/run/secrets/stacks.pulumi.com/secrets/{name}");
                let volume = pod::volume_name("secret", &name);
                if !volumes.iter().any(|vol: &Value| vol["name"] == volume) {
                    volumes.push(json!({"name": volume, "secret": {"secretName": name}}));
                    mounts.push(json!({"name": volume, "mountPath": dir}));
                }
                config.push(json!({"key": key, "valueFrom": {"path": format!("{dir}/{}", v["secret"]["key"].as_str().unwrap_or_default())}, "secret": true}));
            }
        }
    }
    let mut ws = json!({
        "env": env,
        "stacks": [{
            "name": spec.stack,
            "create": spec.use_local_stack_only != Some(true),
            "secretsProvider": spec.secrets_provider,
            "environment": spec.environment,
            "config": config,
        }],
        "podTemplate": {"spec": {"containers": [{"name": "pulumi"}]}},
    });
    if let (Some(ws), Value::Object(source)) = (ws.as_object_mut(), source) {
        ws.extend(source);
    }
    if let Some(sa) = &spec.service_account_name {
        ws["serviceAccountName"] = json!(sa);
    }
    if !volumes.is_empty() {
        ws["podTemplate"]["spec"]["volumes"] = json!(volumes);
        ws["podTemplate"]["spec"]["containers"][0]["volumeMounts"] = json!(mounts);
    }
    let env_from: Vec<Value> = spec
        .envs
        .iter()
        .map(|c| json!({"configMapRef": {"name": c}}))
        .chain(
            spec.env_secrets
                .iter()
                .map(|s| json!({"secretRef": {"name": s}})),
        )
        .collect();
    if !env_from.is_empty() {
        ws["envFrom"] = json!(env_from);
    }
    if let Some(template) = stack
        .spec
        .workspace_template
        .as_ref()
        .and_then(|t| t.spec.as_ref())
    {
        let overlay = serde_json::to_value(template).map_err(|e| e.to_string())?;
        merge::merge(&mut ws, &overlay);
    }
    strip_nulls(&mut ws);
    Ok(ws)
}

fn strip_nulls(v: &mut Value) {
    match v {
        Value::Object(map) => {
            map.retain(|_, v| !v.is_null());
            map.values_mut().for_each(strip_nulls);
        }
        Value::Array(items) => items.iter_mut().for_each(strip_nulls),
        _ => {}
    }
}

async fn reconcile(stack: Arc<Stack>, ctx: Arc<StackContext>) -> Result<Action, StackError> {
    let _measure = kit::measure(&ctx.metrics, CONTROLLER);
    let result = reconcile_inner(stack.clone(), ctx.clone()).await;
    let failure = ctx
        .backoff
        .record(&stack.metadata, &result, StackError::verdict);
    if let (Some(failure), Err(err)) = (failure, &result)
        && failure.stall
    {
        report_stalled(&stack, &ctx, err).await;
    }
    result
}

/// `Stalled=True` ([`backoff::REASON`]) with the error's message, and a Warning Event when that
/// is news; written only when it changes the status.
async fn report_stalled(stack: &Stack, ctx: &StackContext, err: &StackError) {
    let Some(namespace) = stack.namespace() else {
        return;
    };
    let generation = stack.metadata.generation;
    let before = stack.status.clone().unwrap_or_default();
    let mut status = before.clone();
    let message = conditions::truncate(&err.message(), conditions::MESSAGE_LIMIT);
    let known = conditions::get(&before.conditions, "Stalled")
        .is_some_and(|c| c.status == "True" && c.reason == backoff::REASON && c.message == message);
    if !known {
        ctx.event(stack, EventType::Warning, backoff::REASON, message.clone())
            .await;
    }
    stalled(&mut status, generation, backoff::REASON, &message);
    if let Err(e) = write_status(ctx, &namespace, &stack.name_any(), &before, &status).await {
        warn!(error = %e, "cannot report the stalled stack");
    }
}

async fn reconcile_inner(stack: Arc<Stack>, ctx: Arc<StackContext>) -> Result<Action, StackError> {
    let namespace = stack.namespace().ok_or(StackError::NoNamespace)?;
    let name = stack.name_any();
    let generation = stack.metadata.generation;
    let request = stack
        .annotations()
        .get(RECONCILE_REQUEST_ANNOTATION)
        .cloned();
    let deleting = stack.meta().deletion_timestamp.is_some();
    let has_finalizer = stack.finalizers().iter().any(|f| f == FINALIZER);
    if deleting && !has_finalizer {
        return Ok(Action::await_change());
    }
    if !deleting && !has_finalizer {
        set_finalizer(&ctx, &stack, true).await?;
        return Ok(Action::await_change());
    }
    let before = stack.status.clone().unwrap_or_default();
    let mut status = before.clone();
    status.observed_generation = generation;
    status.observed_reconcile_request = request.clone();
    let updates: Api<Update> = Api::namespaced(ctx.client.clone(), &namespace);

    // 1. The Update in flight, if any.
    if let Some(current) = status.current_update.clone() {
        let update_name = current.name.clone().unwrap_or_default();
        match updates
            .get_opt(&update_name)
            .await
            .map_err(kube_err("reading the current Update"))?
        {
            None => {
                // PKO waits forever here (#1292); the Update is gone, so run a new one.
                warn!(stack = %name, update = %update_name, "the current update is gone; starting over");
                ctx.event(
                    &stack,
                    EventType::Warning,
                    "UpdateLost",
                    format!(
                        "update {update_name} disappeared before it completed; a new one will run"
                    ),
                )
                .await;
                status.current_update = None;
            }
            Some(u) => {
                let u_status = u.status.clone().unwrap_or_default();
                if !conditions::is_true(&u_status.conditions, "Complete") {
                    reconciling(
                        &mut status,
                        generation,
                        "StackProcessing",
                        "stack is being processed",
                    );
                    write_status(&ctx, &namespace, &name, &before, &status).await?;
                    return Ok(Action::requeue(Duration::from_secs(300)));
                }
                let succeeded = !conditions::is_true(&u_status.conditions, "Failed");
                let message = conditions::get(&u_status.conditions, "Failed")
                    .map(|c| c.message.clone())
                    .filter(|m| !m.is_empty())
                    .or(u_status.message.clone());
                let last = status.last_update.clone().unwrap_or_default();
                let same_run = last.generation == current.generation
                    && last.reconcile_request == current.reconcile_request;
                let failures = if succeeded {
                    0
                } else if same_run && last.state.as_deref() == Some("failed") {
                    last.failures.unwrap_or(0) + 1
                } else {
                    0
                };
                let type_ = u.spec.type_.map(|t| {
                    serde_json::to_value(t)
                        .ok()
                        .and_then(|v| v.as_str().map(str::to_owned))
                        .unwrap_or_default()
                });
                status.last_update = Some(StackUpdateState {
                    generation: current.generation,
                    reconcile_request: current.reconcile_request.clone(),
                    name: Some(update_name.clone()),
                    type_: type_.clone(),
                    state: Some(if succeeded { "succeeded" } else { "failed" }.into()),
                    message: message.clone(),
                    last_attempted_commit: current.commit.clone(),
                    last_successful_commit: if succeeded {
                        current.commit.clone()
                    } else {
                        last.last_successful_commit.clone()
                    },
                    permalink: u_status.permalink.clone(),
                    last_resync_time: Some(Time(Timestamp::now())),
                    failures: Some(failures),
                });
                if succeeded {
                    if type_.as_deref() == Some("up")
                        && let Some(secret) = &u_status.outputs
                        && let Some(outputs) = read_outputs(&ctx, &namespace, secret).await
                    {
                        status.outputs = outputs;
                    }
                    if type_.as_deref() == Some("destroy") {
                        status.outputs.clear();
                    }
                    if u_status.project_info.is_some() {
                        status.project_info = u_status.project_info.clone();
                    }
                    ctx.event(
                        &stack,
                        EventType::Normal,
                        "StackCreated",
                        "Successfully updated stack".into(),
                    )
                    .await;
                } else {
                    ctx.event(
                        &stack,
                        EventType::Warning,
                        "StackUpdateFailure",
                        format!("Failed to update Stack: {}", message.unwrap_or_default()),
                    )
                    .await;
                }
                status.current_update = None;
            }
        }
    }

    // Nothing to destroy: the Stack is let go. No status is written before the finalizer
    // goes: were its removal refused, that write would clear the stall the refusal reports,
    // on every attempt, and each write would trigger the next attempt at once.
    if deleting
        && (stack.spec.destroy_on_finalize != Some(true) || stack.spec.preview == Some(true))
    {
        set_finalizer(&ctx, &stack, false).await?;
        return Ok(Action::await_change());
    }

    // 2. The source (a sync the user asked for looks at the branch afresh).
    let fresh = request.is_some() && request != before.observed_reconcile_request;
    let source::Resolved {
        workspace_source,
        commit,
        poll,
    } = match source::resolve(&ctx, &stack, &namespace, fresh).await? {
        Ok(resolved) => resolved,
        Err((reason, message, requeue)) => {
            stalled(&mut status, generation, reason, &message);
            write_status(&ctx, &namespace, &name, &before, &status).await?;
            return Ok(requeue.map_or_else(Action::await_change, Action::requeue));
        }
    };

    // 3. Up to date?
    if let Err(why) = is_synced(&stack, &status, &commit, request.as_deref(), deleting) {
        if !deleting && let Err(message) = prerequisites_satisfied(&ctx, &stack, &namespace).await?
        {
            reconciling(
                &mut status,
                generation,
                "PrerequisiteNotSatisfied",
                &message,
            );
            write_status(&ctx, &namespace, &name, &before, &status).await?;
            return Ok(Action::requeue(Duration::from_secs(60)));
        }
        return run_update(
            &ctx,
            &stack,
            &namespace,
            &name,
            before,
            status,
            workspace_source,
            commit,
            why,
        )
        .await;
    }
    let last = status.last_update.clone().unwrap_or_default();
    let failures = last.failures.unwrap_or(0);
    let mut action = Action::await_change();
    match last.state.as_deref() {
        Some("succeeded") => {
            ready(&mut status, generation);
            if stack.spec.continue_resync_on_commit_match == Some(true) {
                action = Action::requeue(resync_frequency(&stack));
            }
            if !deleting
                && stack.spec.workspace_reclaim_policy == Some(WorkspaceReclaimPolicy::Delete)
            {
                reclaim_workspace(&ctx, &stack, &namespace, &name).await?;
            }
        }
        _ if failures >= MAX_FAILURES => {
            let message = format!(
                "{} failed {} times; not retrying until the spec or source changes",
                last.type_.clone().unwrap_or_default(),
                failures + 1
            );
            stalled(&mut status, generation, "UpdateFailed", &message);
        }
        _ => {
            let reason = if last.type_.as_deref() == Some("preview") {
                "PreviewFailed"
            } else {
                "RetryingAfterFailure"
            };
            reconciling(
                &mut status,
                generation,
                reason,
                &format!("{} update failure(s)", failures + 1),
            );
            let wait =
                cooldown(&stack, failures).saturating_sub(since(last.last_resync_time.as_ref()));
            action = Action::requeue(wait.max(Duration::from_secs(1)));
        }
    }
    // Destroyed: the finalizer goes first, for the same reason as above.
    if deleting
        && last.type_.as_deref() == Some("destroy")
        && last.state.as_deref() == Some("succeeded")
    {
        set_finalizer(&ctx, &stack, false).await?;
        return Ok(Action::await_change());
    }
    write_status(&ctx, &namespace, &name, &before, &status).await?;
    if let Some(poll) = poll
        && !deleting
    {
        action = Action::requeue(poll);
    }
    Ok(action)
}

#[allow(clippy::too_many_arguments)]
async fn run_update(
    ctx: &StackContext,
    stack: &Stack,
    namespace: &str,
    name: &str,
    before: StackStatus,
    mut status: StackStatus,
    workspace_source: Value,
    commit: String,
    why: String,
) -> Result<Action, StackError> {
    let generation = stack.metadata.generation;
    // The Workspace is named after the stack: a name it cannot have stalls here, with a message
    // that says so, instead of an apiserver refusal on every attempt.
    if let Some(problem) = pko_api::workspace::name_problem(name) {
        let message = format!("the stack's Workspace would be named {name}: {problem}");
        if !conditions::is_true(&status.conditions, "Stalled") {
            ctx.event(
                stack,
                EventType::Warning,
                "StackConfigInvalid",
                message.clone(),
            )
            .await;
        }
        stalled(&mut status, generation, "SpecInvalid", &message);
        write_status(ctx, namespace, name, &before, &status).await?;
        return Ok(Action::await_change());
    }
    let ws_spec = match workspace_spec(stack, namespace, workspace_source) {
        Ok(s) => s,
        Err(message) => {
            ctx.event(
                stack,
                EventType::Warning,
                "StackConfigInvalid",
                message.clone(),
            )
            .await;
            stalled(&mut status, generation, "SpecInvalid", &message);
            write_status(ctx, namespace, name, &before, &status).await?;
            return Ok(Action::await_change());
        }
    };
    let labels = json!({COMPONENT_LABEL: "stack", STACK_NAME_LABEL: name});
    let stack_owner = json!({
        "apiVersion": "pulumi.com/v1", "kind": "Stack", "name": name,
        "uid": stack.metadata.uid.clone().unwrap_or_default(), "blockOwnerDeletion": true,
    });
    let mut ws_meta = json!({"name": name, "namespace": namespace, "labels": labels,
        "ownerReferences": [{"apiVersion": "pulumi.com/v1", "kind": "Stack", "name": name, "uid": stack.metadata.uid.clone().unwrap_or_default(), "controller": true, "blockOwnerDeletion": true}]});
    if let Some(meta) = stack
        .spec
        .workspace_template
        .as_ref()
        .and_then(|t| t.metadata.as_ref())
    {
        if !meta.labels.is_empty() {
            let mut l = meta.labels.clone();
            l.insert(COMPONENT_LABEL.into(), "stack".into());
            l.insert(STACK_NAME_LABEL.into(), name.into());
            ws_meta["labels"] = json!(l);
        }
        if !meta.annotations.is_empty() {
            ws_meta["annotations"] = json!(meta.annotations);
        }
    }
    let ws = json!({"apiVersion": "auto.pulumi.com/v1alpha1", "kind": "Workspace", "metadata": ws_meta, "spec": ws_spec});
    reconciling(
        &mut status,
        generation,
        "StackProcessing",
        "waiting for workspace readiness",
    );
    let workspaces: Api<Workspace> = Api::namespaced(ctx.client.clone(), namespace);
    let applied = match workspaces
        .patch(
            name,
            &PatchParams::apply(APPLY_MANAGER).force(),
            &Patch::Apply(&ws),
        )
        .await
    {
        Ok(applied) => applied,
        Err(e) => {
            return stall_if_namespace_terminating(
                ctx,
                stack,
                (namespace, name),
                (&before, status),
                e,
                "Workspace",
            )
            .await;
        }
    };
    let ws_status = applied.status.clone().unwrap_or_default();
    let ws_ready = ws_status.observed_generation == applied.metadata.generation
        && conditions::is_true(&ws_status.conditions, "Ready");
    if !ws_ready {
        if let Some(c) =
            conditions::get(&ws_status.conditions, "Stalled").filter(|c| c.status == "True")
        {
            let reason = if c.reason == "IncompatibleConfiguration" {
                "PulumiVersionTooLow"
            } else {
                "WorkspaceFailed"
            };
            stalled(
                &mut status,
                generation,
                reason,
                &format!("{}: {}", c.reason, c.message),
            );
        }
        write_status(ctx, namespace, name, &before, &status).await?;
        return Ok(Action::await_change());
    }
    let deleting = stack.meta().deletion_timestamp.is_some();
    let type_ = if deleting {
        "destroy"
    } else if stack.spec.preview == Some(true) {
        "preview"
    } else {
        "up"
    };
    // An Update of this stack still in flight is adopted rather than doubled: the cache may not
    // show our last status write yet, or the operator stopped between create and status write.
    let updates: Api<Update> = Api::namespaced(ctx.client.clone(), namespace);
    let in_flight = updates
        .list(&kube::api::ListParams::default().labels(&format!("{STACK_NAME_LABEL}={name}")))
        .await
        .map_err(kube_err("listing the stack's Updates"))?
        .items
        .into_iter()
        .filter(|u| u.meta().deletion_timestamp.is_none())
        .filter(|u| {
            !u.status
                .as_ref()
                .is_some_and(|s| conditions::is_true(&s.conditions, "Complete"))
        })
        .find(|u| u.spec.type_.and_then(|t| serde_json::to_value(t).ok()) == Some(json!(type_)));
    if let Some(u) = in_flight {
        status.current_update = Some(CurrentStackUpdate {
            generation,
            reconcile_request: stack
                .annotations()
                .get(RECONCILE_REQUEST_ANNOTATION)
                .cloned(),
            name: Some(u.name_any()),
            commit: Some(commit),
        });
        reconciling(
            &mut status,
            generation,
            "StackProcessing",
            "stack is being processed",
        );
        write_status(ctx, namespace, name, &before, &status).await?;
        return Ok(Action::requeue(Duration::from_secs(300)));
    }
    let update_name = format!("{name}-{:x}", Timestamp::now().as_millisecond());
    let mut spec = json!({
        "workspaceName": name, "stackName": stack.spec.stack, "type": type_,
        "ttlAfterCompleted": "24h", "message": why,
    });
    if type_ == "destroy" {
        spec["runProgram"] = json!(stack.spec.run_program);
    } else {
        spec["target"] = json!(stack.spec.targets);
        spec["targetDependents"] = json!(stack.spec.target_dependents);
        spec["refresh"] = json!(stack.spec.refresh);
    }
    let mut update = json!({
        "apiVersion": "auto.pulumi.com/v1alpha1", "kind": "Update",
        "metadata": {
            "name": update_name, "namespace": namespace, "labels": labels,
            "ownerReferences": [
                {"apiVersion": "auto.pulumi.com/v1alpha1", "kind": "Workspace", "name": name, "uid": applied.metadata.uid.clone().unwrap_or_default(), "controller": true, "blockOwnerDeletion": true},
                stack_owner,
            ],
        },
        "spec": spec,
    });
    if let Some(template) = stack
        .spec
        .update_template
        .as_ref()
        .and_then(|t| t.spec.as_ref())
    {
        merge::merge(&mut update["spec"], &serde_json::to_value(template)?);
    }
    strip_nulls(&mut update);
    let update: Update = serde_json::from_value(update)?;
    if let Err(e) = updates.create(&PostParams::default(), &update).await {
        return stall_if_namespace_terminating(
            ctx,
            stack,
            (namespace, name),
            (&before, status),
            e,
            "Update",
        )
        .await;
    }
    info!(stack = %name, update = %update_name, %why, "update created");
    ctx.event(stack, EventType::Normal, "StackUpdateDetected", why)
        .await;
    // Saved only now that the Update exists (PKO saves it before creating it).
    status.current_update = Some(CurrentStackUpdate {
        generation,
        reconcile_request: stack
            .annotations()
            .get(RECONCILE_REQUEST_ANNOTATION)
            .cloned(),
        name: Some(update_name),
        commit: Some(commit),
    });
    reconciling(
        &mut status,
        generation,
        "StackProcessing",
        "stack is being processed",
    );
    write_status(ctx, namespace, name, &before, &status).await?;
    Ok(Action::requeue(Duration::from_secs(300)))
}

/// A create refused because the namespace is being deleted (the apiserver's NamespaceLifecycle
/// admission) stalls the stack with `NamespaceTerminating` and says how to let it go; any other
/// error is returned. Objects that already exist keep working: a destroy whose Update was
/// created before the namespace started terminating still runs.
async fn stall_if_namespace_terminating(
    ctx: &StackContext,
    stack: &Stack,
    (namespace, name): (&str, &str),
    (before, mut status): (&StackStatus, StackStatus),
    err: kube::Error,
    kind: &str,
) -> Result<Action, StackError> {
    let forbidden = matches!(&err, kube::Error::Api(e) if e.code == 403);
    let terminating = forbidden
        && Api::<k8s_openapi::api::core::v1::Namespace>::all(ctx.client.clone())
            .get_opt(namespace)
            .await
            .ok()
            .flatten()
            .is_some_and(|n| n.metadata.deletion_timestamp.is_some());
    if !terminating {
        let what = if kind == "Workspace" {
            "applying the Workspace"
        } else {
            "creating the Update"
        };
        return Err(kube_err(what)(err));
    }
    let message = format!(
        "namespace {namespace} is being deleted, so no {kind} can be created and the stack cannot be \
         destroyed; to let the namespace go without a destroy, remove the finalizer: kubectl patch \
         stack {name} -n {namespace} --type=merge -p '{{\"metadata\":{{\"finalizers\":null}}}}'"
    );
    if !conditions::is_true(&status.conditions, "Stalled") {
        ctx.event(
            stack,
            EventType::Warning,
            "NamespaceTerminating",
            message.clone(),
        )
        .await;
    }
    stalled(
        &mut status,
        stack.metadata.generation,
        "NamespaceTerminating",
        &message,
    );
    write_status(ctx, namespace, name, before, &status).await?;
    Ok(Action::requeue(Duration::from_secs(30)))
}

/// PKO's prerequisite rules: each prerequisite stack exists and its last update, for its current
/// generation and reconcile request, succeeded (within `succeededWithinDuration` if given). A
/// prerequisite that is merely out of date is asked to run again (its reconcile-request
/// annotation is set to `after-<last update>`, idempotently). `Ok(Err(reason))` when not met.
async fn prerequisites_satisfied(
    ctx: &StackContext,
    stack: &Stack,
    namespace: &str,
) -> Result<Result<(), String>, StackError> {
    let stacks: Api<Stack> = Api::namespaced(ctx.client.clone(), namespace);
    for prerequisite in &stack.spec.prerequisites {
        let Some(other) = stacks
            .get_opt(&prerequisite.name)
            .await
            .map_err(kube_err("reading a prerequisite Stack"))?
        else {
            return Ok(Err(format!("prerequisite {} not found", prerequisite.name)));
        };
        let status = other.status.clone().unwrap_or_default();
        let Some(last) = status.last_update.clone() else {
            return Ok(Err(format!(
                "prerequisite {} has not run yet",
                prerequisite.name
            )));
        };
        let request = other
            .annotations()
            .get(RECONCILE_REQUEST_ANNOTATION)
            .cloned();
        if last.generation != other.metadata.generation || last.reconcile_request != request {
            return Ok(Err(format!(
                "prerequisite {} is being updated",
                prerequisite.name
            )));
        }
        if last.state.as_deref() != Some("succeeded") {
            return Ok(Err(format!("prerequisite {} failed", prerequisite.name)));
        }
        let within = match prerequisite
            .requirement
            .as_ref()
            .and_then(|r| r.succeeded_within_duration.as_deref())
        {
            Some(text) => match pko_api::duration::parse_go_duration(text) {
                Ok(within) => Some(within),
                Err(e) => {
                    return Ok(Err(format!(
                        "prerequisite {}: invalid succeededWithinDuration: {e}",
                        prerequisite.name
                    )));
                }
            },
            None => None,
        };
        if let Some(within) = within
            && since(last.last_resync_time.as_ref()) > within
        {
            let touch = format!("after-{}", last.name.clone().unwrap_or_default());
            if request.as_deref() != Some(touch.as_str()) {
                let patch =
                    json!({"metadata": {"annotations": {RECONCILE_REQUEST_ANNOTATION: touch}}});
                stacks
                    .patch(
                        &prerequisite.name,
                        &PatchParams::default(),
                        &Patch::Merge(&patch),
                    )
                    .await
                    .map_err(kube_err("requesting a prerequisite's update"))?;
            }
            return Ok(Err(format!(
                "prerequisite {} last succeeded more than {within:?} ago; it was asked to run again",
                prerequisite.name
            )));
        }
    }
    Ok(Ok(()))
}

/// `workspaceReclaimPolicy: Delete`: the workspace (and its pod) goes once the stack is up to
/// date; the next sync makes a new one.
async fn reclaim_workspace(
    ctx: &StackContext,
    stack: &Stack,
    namespace: &str,
    name: &str,
) -> Result<(), StackError> {
    let workspaces: Api<Workspace> = Api::namespaced(ctx.client.clone(), namespace);
    let existing = workspaces
        .get_opt(name)
        .await
        .map_err(kube_err("reading the Workspace"))?;
    if existing.is_some_and(|w| w.meta().deletion_timestamp.is_none()) {
        workspaces
            .delete(name, &kube::api::DeleteParams::background())
            .await
            .map_err(kube_err("deleting the Workspace"))?;
        ctx.event(
            stack,
            EventType::Normal,
            "WorkspaceDeleted",
            format!("Deleted workspace {name} (workspaceReclaimPolicy: Delete)"),
        )
        .await;
    }
    Ok(())
}

async fn write_status(
    ctx: &StackContext,
    namespace: &str,
    name: &str,
    before: &StackStatus,
    after: &StackStatus,
) -> Result<(), StackError> {
    let same = before.observed_generation == after.observed_generation
        && before.observed_reconcile_request == after.observed_reconcile_request
        && before.outputs == after.outputs
        && before.last_update == after.last_update
        && before.current_update == after.current_update
        && before.project_info == after.project_info
        && conditions::same(&before.conditions, &after.conditions);
    if same {
        return Ok(());
    }
    let patch = json!({"apiVersion": "pulumi.com/v1", "kind": "Stack", "status": after});
    Api::<Stack>::namespaced(ctx.client.clone(), namespace)
        .patch_status(
            name,
            &PatchParams::apply(STATUS_MANAGER).force(),
            &Patch::Apply(&patch),
        )
        .await
        .map_err(kube_err("writing the Stack status"))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stack(generation: i64) -> Stack {
        let mut s: Stack = serde_json::from_value(json!({
            "apiVersion": "pulumi.com/v1", "kind": "Stack",
            "metadata": {"name": "s", "namespace": "ns"},
            "spec": {"stack": "dev", "programRef": {"name": "p"}},
        }))
        .expect("stack");
        s.metadata.generation = Some(generation);
        s
    }

    fn last(state: &str, commit: &str, failures: i64, ago: i64) -> StackStatus {
        StackStatus {
            last_update: Some(StackUpdateState {
                generation: Some(1),
                type_: Some("up".into()),
                state: Some(state.into()),
                last_attempted_commit: Some(commit.into()),
                last_successful_commit: (state == "succeeded").then(|| commit.into()),
                last_resync_time: Some(Time(
                    Timestamp::now() - k8s_openapi::jiff::SignedDuration::from_secs(ago),
                )),
                failures: Some(failures),
                ..Default::default()
            }),
            ..Default::default()
        }
    }

    // PKO's TestIsSynced cases that apply.
    #[test]
    fn sync_rules() {
        let s = stack(1);
        assert!(
            is_synced(&s, &StackStatus::default(), "d1", None, false)
                .is_err_and(|r| r == "Initial stack update")
        );
        assert!(is_synced(&s, &last("succeeded", "d1", 0, 5), "d1", None, false).is_ok());
        assert!(
            is_synced(&s, &last("succeeded", "d1", 0, 5), "d2", None, false)
                .is_err_and(|r| r.starts_with("New commit"))
        );
        assert!(
            is_synced(&stack(2), &last("succeeded", "d1", 0, 5), "d1", None, false)
                .is_err_and(|r| r.starts_with("New stack generation"))
        );
        assert!(
            is_synced(&s, &last("succeeded", "d1", 0, 5), "d1", Some("now"), false)
                .is_err_and(|r| r.starts_with("Sync request"))
        );
        // Failed: wait for the cooldown (10 s × 3^failures), stop after 3 failures.
        assert!(is_synced(&s, &last("failed", "d1", 0, 5), "d1", None, false).is_ok());
        assert!(
            is_synced(&s, &last("failed", "d1", 0, 11), "d1", None, false)
                .is_err_and(|r| r.starts_with("Backoff"))
        );
        assert!(is_synced(&s, &last("failed", "d1", 3, 100_000), "d1", None, false).is_ok());
        assert!(is_synced(&s, &last("failed", "d1", 3, 5), "d2", None, false).is_err());
        // Deleting: a destroy is needed unless one succeeded.
        assert!(
            is_synced(&s, &last("succeeded", "d1", 0, 5), "d1", None, true)
                .is_err_and(|r| r == "Stack marked for deletion")
        );
    }

    #[test]
    fn cooldown_grows_and_is_capped() {
        let mut s = stack(1);
        assert_eq!(cooldown(&s, 0), Duration::from_secs(10));
        assert_eq!(cooldown(&s, 2), Duration::from_secs(90));
        s.spec.retry_max_backoff_duration_seconds = Some(30);
        assert_eq!(cooldown(&s, 5), Duration::from_secs(30));
    }

    #[test]
    fn workspace_spec_follows_setup_workspace() {
        let mut s = stack(1);
        s.spec.backend = Some("file:///state".into());
        s.spec.config.insert("greeting".into(), json!("hi"));
        s.spec.secrets.insert("pw".into(), "x".into());
        s.spec.use_local_stack_only = Some(true);
        let ws =
            workspace_spec(&s, "ns", json!({"flux": {"url": "u", "digest": "d"}})).expect("spec");
        assert_eq!(ws["flux"], json!({"url": "u", "digest": "d"}));
        assert_eq!(
            ws["env"][0],
            json!({"name": "PULUMI_BACKEND_URL", "value": "file:///state"})
        );
        assert_eq!(ws["stacks"][0]["create"], false);
        assert_eq!(
            ws["stacks"][0]["config"][0],
            json!({"key": "greeting", "value": "hi"})
        );
        assert_eq!(
            ws["stacks"][0]["config"][1],
            json!({"key": "pw", "value": "x", "secret": true})
        );
        s.spec.env_refs.insert(
            "X".into(),
            pko_api::common::ResourceRef {
                selector_type: ResourceSelectorType::Env,
                filesystem: None,
                env: None,
                secret: None,
                literal: None,
            },
        );
        let err = workspace_spec(&s, "ns", json!({})).expect_err("Env refs are refused");
        assert!(err.contains("not supported"), "{err}");
    }
}
