//! The leader's side: the election, and the controllers that run while this replica leads.

use std::sync::Arc;
use std::time::Duration;

use pko_operator::capability::{self, KeySecret, RotationPolicy};
use pko_operator::controller::kit::Kit;
use pko_operator::controller::program::{self, ProgramContext};
use pko_operator::egress::EgressPolicy;
use pko_operator::leader::{self, ElectionConfig, Leadership};
use pko_operator::metrics::Metrics;
use pko_operator::transform::TransformRegistry;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use super::{AppError, PodEnv, kube_client};
use crate::RunArgs;

/// The leadership the controllers run under: a lease with --leader-elect, else always.
pub(super) async fn elect(
    args: &RunArgs,
    env: &PodEnv,
    metrics: &Metrics,
    election_stop: &CancellationToken,
) -> Result<(Leadership, Option<JoinHandle<()>>), AppError> {
    if !args.leader_elect {
        metrics.leader.set(1);
        return Ok((Leadership::always(), None));
    }
    let name = env.pod_name.as_deref().filter(|n| !n.is_empty());
    let config = election_config(args, env, name.or(env.hostname.as_deref()))?;
    let lease_client = kube_client(
        args,
        Some(config.retry_period.max(Duration::from_secs(1))),
        metrics,
    )
    .await?;
    let (leadership, task) =
        leader::spawn_election(lease_client, config, metrics.clone(), election_stop.clone())?;
    Ok((leadership, Some(task)))
}

/// Every controller; they run on the leader only, and stop when leadership ends.
pub(super) struct Controllers {
    pub(super) kit: Kit,
    pub(super) ctx: Arc<ProgramContext>,
    pub(super) concurrency: u16,
    pub(super) execution_args: pko_operator::controller::execution::ExecutionArgs,
    /// One set of execution controllers per watched namespace (a watcher covers one namespace
    /// or all of them).
    pub(super) scope: pko_operator::scope::WatchScope,
    pub(super) egress: Arc<EgressPolicy>,
    pub(super) file_server: pko_admission::tenancy::FileServerNames,
    pub(super) transforms: Option<Arc<TransformRegistry>>,
    pub(super) tenancy_status: bool,
    pub(super) key_secret: Option<KeySecret>,
    pub(super) rotation: RotationPolicy,
}

impl Controllers {
    /// One term of leadership: every controller until `stop`.
    pub(super) fn start(&self, stop: CancellationToken) -> impl Future<Output = ()> + Send + use<> {
        use pko_operator::controller::{execution, tenancy, transform_status};
        let ctx = self.ctx.clone();
        let concurrency = self.concurrency;
        // One set of operation slots for every watched namespace.
        let slots = self.execution_args.operation_slots();
        let execution = futures::future::join_all(self.scope.each().into_iter().map(|namespace| {
            execution::run(
                self.kit.clone(),
                namespace,
                self.execution_args.clone(),
                concurrency,
                execution::TenantBounds {
                    egress: self.egress.clone(),
                    file_server: self.file_server.clone(),
                    slots: slots.clone(),
                },
                stop.clone(),
            )
        }));
        let transform_status = self.transforms.clone().map(|registry| {
            transform_status::run(registry, self.kit.clone(), stop.clone().cancelled_owned())
        });
        let tenancy = self.tenancy_status.then(|| {
            tenancy::run(
                Arc::new(tenancy::TenancyContext::new(&self.kit)),
                stop.clone().cancelled_owned(),
            )
        });
        let rotate = self
            .key_secret
            .clone()
            .map(|secret| capability::rotate(secret, self.rotation, stop.clone()));
        async move {
            if let Some(rotate) = rotate {
                tokio::spawn(rotate);
            }
            let programs = program::run(ctx, concurrency, stop.cancelled_owned());
            let programs = async move {
                match tenancy {
                    Some(tenancy) => {
                        tokio::join!(programs, execution, tenancy);
                    }
                    None => {
                        tokio::join!(programs, execution);
                    }
                }
            };
            match transform_status {
                Some(status) => {
                    tokio::join!(programs, status);
                }
                None => programs.await,
            }
        }
    }
}

/// `name`: the pod's name, else the host's, in the holder identity.
fn election_config(
    args: &RunArgs,
    env: &PodEnv,
    name: Option<&str>,
) -> Result<ElectionConfig, AppError> {
    let namespace = args
        .leader_election_namespace
        .clone()
        .filter(|n| !n.is_empty())
        .or_else(|| env.pod_namespace.clone().filter(|n| !n.is_empty()))
        .or_else(|| {
            std::fs::read_to_string("/var/run/secrets/kubernetes.io/serviceaccount/namespace")
                .ok()
                .map(|n| n.trim().to_owned())
                .filter(|n| !n.is_empty())
        })
        .ok_or(AppError::NoLeaseNamespace)?;
    let config = ElectionConfig {
        lease_name: args.leader_election_id.clone(),
        namespace,
        identity: leader::default_identity(name),
        lease_duration: args.leader_election_lease_duration,
        renew_deadline: args.leader_election_renew_deadline,
        retry_period: args.leader_election_retry_period,
    };
    config.timings()?;
    Ok(config)
}
