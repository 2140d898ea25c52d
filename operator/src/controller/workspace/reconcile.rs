//! One reconcile of a Workspace: the phases in order, the drafted status written once, and a
//! failure reported once retrying stops helping.

use std::sync::Arc;

use kube::api::Api;
use kube::runtime::controller::Action;
use kube::runtime::events::EventType;
use kube::{Resource, ResourceExt};
use pko_api::workspace::{Workspace, WorkspaceStatus};
use tracing::{instrument, warn};

use super::phases::{self, End, Run, proceed};
use super::status;
use super::{CONTROLLER, WorkspaceContext, WorkspaceError};
use super::{idle, rules};
use crate::controller::keys::{APPLY_MANAGER, WORKSPACE_STATUS_MANAGER};
use crate::controller::kit::FromKube;
use crate::controller::takeover::{self, Part};
use crate::controller::{backoff, kit};

#[instrument(skip_all, fields(workspace = %format!("{}/{}", ws.namespace().unwrap_or_default(), ws.name_any())))]
pub(super) async fn reconcile(
    ws: Arc<Workspace>,
    ctx: Arc<WorkspaceContext>,
) -> Result<Action, WorkspaceError> {
    let _measure = kit::measure(&ctx.metrics, CONTROLLER);
    // A reconcile queued behind a status write never decides on the view before it.
    let fresh = ctx.own_writes.fresher(&ctx.client, ws).await;
    let Some(ws) = fresh.map_err(WorkspaceError::kube(
        "reading the Workspace after its last status write",
    ))?
    else {
        return Ok(Action::await_change());
    };
    let result = reconcile_inner(&ws, &ctx).await;
    if result.is_err()
        && let Some(uid) = &ws.metadata.uid
    {
        // A failure (an agent not reached through its Service, …) applies the workload again
        // next time, which restores whatever was deleted behind this process's back.
        ctx.set_workload(uid, None);
    }
    let failure = ctx
        .backoff
        .record(&ws.metadata, &result, WorkspaceError::verdict);
    if let (Some(failure), Err(err)) = (failure, &result) {
        report_failure(&ws, &ctx, err, failure.stall).await;
    }
    result
}

/// How often a Workspace PKO applied looks again for its Stack's apply (which comes with an
/// event of its own; this only covers a Stack that cannot resolve its source yet).
const PKO_WORKSPACE_WAIT: std::time::Duration = std::time::Duration::from_secs(30);

pub(super) async fn reconcile_inner(
    ws: &Workspace,
    ctx: &WorkspaceContext,
) -> Result<Action, WorkspaceError> {
    let mut run = Run::new(ws, ctx)?;
    // Status fields only PKO's writer owns go with our next write, made even if unchanged.
    let pkos = takeover::pko_owns(ws.meta(), Part::Status);
    if pkos {
        let api: Api<Workspace> = Api::namespaced(ctx.client.clone(), &run.namespace);
        takeover::take_over(&api, &run.name, WORKSPACE_STATUS_MANAGER, Part::Status)
            .await
            .map_err(WorkspaceError::kube("taking over PKO's Workspace status"))?;
    }
    // A Stack's Workspace as PKO's Stack controller applied it names PKO's source: its Stack
    // applies it again with ours (taking PKO's fields over), which brings the next reconcile.
    // Waiting for that keeps the pod from restarting twice (and from fetching from PKO).
    if rules::waits_for_its_stack(ws) {
        return Ok(Action::requeue(PKO_WORKSPACE_WAIT));
    }
    // The spec PKO's Stack controller applied is ours to apply from now on (the Stack
    // controller applies as APPLY_MANAGER), so what only PKO set goes with its next apply.
    if takeover::pko_owns(ws.meta(), Part::Main) {
        let api: Api<Workspace> = Api::namespaced(ctx.client.clone(), &run.namespace);
        takeover::take_over(&api, &run.name, APPLY_MANAGER, Part::Main)
            .await
            .map_err(WorkspaceError::kube("taking over PKO's Workspace fields"))?;
    }
    match run_phases(&mut run).await? {
        End::Report(action) => {
            let unwritten = WorkspaceStatus::default();
            let before = if pkos { &unwritten } else { &run.before };
            ctx.write_status(&run.namespace, &run.name, before, &run.status)
                .await?;
            Ok(action)
        }
        End::Quiet(action) => Ok(action),
    }
}

/// The phases in order, up to the first that ends the reconcile.
async fn run_phases(run: &mut Run<'_>) -> Result<End, WorkspaceError> {
    if run.ws.meta().deletion_timestamp.is_some() {
        return Ok(phases::deleting(run));
    }
    let recheck = proceed!(idle::phase(run).await?);
    let applied = proceed!(phases::apply(run).await?);
    proceed!(phases::pod_ready(run, &applied.statefulset).await?);
    let mut agent = proceed!(phases::connect(run, &applied).await?);
    proceed!(phases::check_version(run, &agent).await);
    let env = proceed!(phases::environment(run).await);
    let pending = proceed!(phases::initialise(run, &mut agent, env).await?);
    proceed!(phases::stacks(run, &mut agent, pending).await?);
    Ok(idle::ready_end(phases::ready(run), recheck))
}

/// Reports a failed reconcile (see [`status::failure_report`]): the Warning Event first when
/// that is news, then the status. The status is derived from the error alone, so the same
/// failure again writes nothing (and triggers no reconcile of its own).
async fn report_failure(ws: &Workspace, ctx: &WorkspaceContext, err: &WorkspaceError, stall: bool) {
    let Some(namespace) = ws.namespace() else {
        return;
    };
    let before = ws.status.clone().unwrap_or_default();
    let Some(report) = status::failure_report(&before, ws.metadata.generation, err, stall) else {
        return;
    };
    if let Some(note) = report.event {
        ctx.event(ws, EventType::Warning, backoff::REASON, note)
            .await;
    }
    let name = ws.name_any();
    let written = ctx.write_status(&namespace, &name, &before, &report.status);
    if let Err(e) = written.await {
        warn!(error = %e, "cannot report the stalled workspace");
    }
}
