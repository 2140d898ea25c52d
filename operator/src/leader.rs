//! Leader election on a `coordination.k8s.io/v1` Lease, with kube-lease-manager.
//!
//! Only the controllers need a single writer; the file server, probes, metrics and the watches
//! behind them run on every replica. [`spawn_election`] keeps a [`Leadership`] flag current and
//! [`run_while_leader`] starts the controllers when this replica becomes leader and stops them
//! when it is not any more.
//!
//! Safety over availability: any error while talking to the apiserver about the lease makes
//! this replica step down at once (controllers stop) and start over; if it still holds the lease
//! it is leader again on the next attempt. Every request of the lease client is bounded (not its
//! idle connections) so a hung request cannot keep a stale leader running. On shutdown the
//! lease is released after the controllers have drained, so the next leader starts without
//! waiting for it to expire.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::api::coordination::v1::Lease;
use kube::{Api, Client};
use kube_lease_manager::{LeaseCreateMode, LeaseManager, LeaseManagerError, LeaseParams};
use tokio::sync::watch;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use crate::metrics::Metrics;

/// Longest time spent releasing the lease on shutdown.
const RELEASE_TIMEOUT: Duration = Duration::from_secs(5);
/// Pause before restarting controllers that ended on their own while still leader.
const RESTART_DELAY: Duration = Duration::from_secs(1);
/// After losing the lease another replica may already reconcile: in-flight reconciles get
/// only this long (at most) before they are dropped.
const LOST_LEASE_DRAIN: Duration = Duration::from_secs(5);

/// Invalid leader-election settings.
#[derive(Debug, thiserror::Error)]
pub enum LeaderError {
    #[error("the lease duration must be at least 2s, got {0:?}")]
    LeaseDuration(Duration),
    #[error(
        "the renew deadline ({renew_deadline:?}) must be at least 1s and at least 1s shorter \
         than the lease duration ({lease_duration:?})"
    )]
    RenewDeadline {
        renew_deadline: Duration,
        lease_duration: Duration,
    },
    #[error("the retry period must be more than zero")]
    RetryPeriod,
    #[error("the lease name and namespace must not be empty")]
    Name,
}

/// Settings of the election; flag names follow PKO (`--leader-election-*`).
#[derive(Clone, Debug)]
pub struct ElectionConfig {
    /// Name of the Lease object.
    pub lease_name: String,
    /// Namespace of the Lease object.
    pub namespace: String,
    /// This replica's `holderIdentity`; unique per process.
    pub identity: String,
    /// How long a lease is valid after its last renewal; a dead leader is replaced after at
    /// most this long.
    pub lease_duration: Duration,
    /// The leader renews this long after its last renewal (PKO: how long it keeps trying).
    pub renew_deadline: Duration,
    /// Pause before trying again after an apiserver error.
    pub retry_period: Duration,
}

/// Lease duration and grace in whole seconds, as kube-lease-manager counts them: the holder
/// renews `grace` seconds before expiry, that is `renew_deadline` after the last renewal.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LeaseTimings {
    pub duration_secs: u64,
    pub grace_secs: u64,
}

impl ElectionConfig {
    /// Checks the settings (kube-lease-manager panics on bad ones) and converts them to whole
    /// seconds: the lease duration rounds up, the renew deadline down.
    pub fn timings(&self) -> Result<LeaseTimings, LeaderError> {
        if self.lease_name.is_empty() || self.namespace.is_empty() {
            return Err(LeaderError::Name);
        }
        if self.retry_period.is_zero() {
            return Err(LeaderError::RetryPeriod);
        }
        let duration_secs =
            self.lease_duration.as_secs() + u64::from(self.lease_duration.subsec_nanos() > 0);
        if duration_secs < 2 {
            return Err(LeaderError::LeaseDuration(self.lease_duration));
        }
        let renew_secs = self.renew_deadline.as_secs();
        if renew_secs == 0 || renew_secs >= duration_secs {
            return Err(LeaderError::RenewDeadline {
                renew_deadline: self.renew_deadline,
                lease_duration: self.lease_duration,
            });
        }
        Ok(LeaseTimings {
            duration_secs,
            grace_secs: duration_secs - renew_secs,
        })
    }
}

/// A unique `holderIdentity`: the pod (or host) name, then the process id and start time, so two
/// processes on one host, or a restarted container, never share an identity.
pub fn default_identity(name: Option<&str>) -> String {
    let host = name
        .filter(|n| !n.is_empty())
        .map(str::to_owned)
        .unwrap_or_else(|| "pko-rs".to_owned());
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos())
        .unwrap_or_default();
    format!("{host}_{}_{nanos:x}", std::process::id())
}

/// Whether this replica is the leader, as a watchable flag.
#[derive(Clone)]
pub struct Leadership {
    rx: watch::Receiver<bool>,
    /// Keeps the sender of [`Leadership::always`] alive: a closed channel would read as "no
    /// change will ever come" and hide the current value.
    _always: Option<Arc<watch::Sender<bool>>>,
}

impl Leadership {
    /// Leader from the start and for good (`--leader-elect=false`, one replica).
    pub fn always() -> Self {
        let (tx, rx) = watch::channel(true);
        Self {
            rx,
            _always: Some(Arc::new(tx)),
        }
    }

    pub fn is_leader(&self) -> bool {
        *self.rx.borrow()
    }

    /// Resolves once this replica is leader; `false` if the election ended first.
    pub async fn acquired(&mut self) -> bool {
        self.rx.wait_for(|leader| *leader).await.is_ok()
    }

    /// Resolves once this replica is not leader any more (or the election ended).
    pub async fn lost(&mut self) {
        let _ = self.rx.wait_for(|leader| !*leader).await;
    }
}

/// Start the election task. It keeps the returned [`Leadership`] current until `stop` is
/// cancelled, then releases the lease (if held) and ends. Cancel `stop` only after the
/// controllers have stopped, so two replicas never reconcile at once.
pub fn spawn_election(
    client: Client,
    config: ElectionConfig,
    metrics: Metrics,
    stop: CancellationToken,
) -> Result<(Leadership, JoinHandle<()>), LeaderError> {
    let timings = config.timings()?;
    let (tx, rx) = watch::channel(false);
    metrics.leader.set(0);
    let task = tokio::spawn(election_loop(client, config, timings, tx, metrics, stop));
    Ok((Leadership { rx, _always: None }, task))
}

enum Outcome {
    Stopped,
    Failed(LeaseManagerError),
    /// A follower saw the lease free or expired: start over with fresh state right away.
    Resync,
}

async fn election_loop(
    client: Client,
    config: ElectionConfig,
    timings: LeaseTimings,
    tx: watch::Sender<bool>,
    metrics: Metrics,
    stop: CancellationToken,
) {
    info!(
        lease = %config.lease_name,
        namespace = %config.namespace,
        identity = %config.identity,
        duration_secs = timings.duration_secs,
        grace_secs = timings.grace_secs,
        "leader election started"
    );
    let leases: Api<Lease> = Api::namespaced(client.clone(), &config.namespace);
    loop {
        let params = LeaseParams::new(
            config.identity.clone(),
            timings.duration_secs,
            timings.grace_secs,
        );
        let built = tokio::select! {
            () = stop.cancelled() => return,
            built = LeaseManager::new(
                client.clone(),
                config.lease_name.clone(),
                config.namespace.clone(),
                params,
                LeaseCreateMode::AutoCreate,
            ) => built,
        };
        let outcome = match built {
            Ok(manager) => {
                let outcome = follow(&manager, &leases, &config, &tx, &metrics, &stop).await;
                // The lease state is unknown after an error: step down first.
                set_leader(&tx, &metrics, false);
                if matches!(outcome, Outcome::Stopped) {
                    release(manager).await;
                    return;
                }
                outcome
            }
            Err(err) => Outcome::Failed(err),
        };
        match outcome {
            Outcome::Failed(err) => {
                warn!(error = %err, retry_in = ?config.retry_period, "leader election failed; stepped down");
            }
            Outcome::Resync | Outcome::Stopped => continue,
        }
        tokio::select! {
            () = stop.cancelled() => return,
            () = tokio::time::sleep(config.retry_period) => {}
        }
    }
}

/// Track the lease until `stop`, an error, or (as a follower) a free lease.
///
/// kube-lease-manager's follower sleeps until the lease it last saw expires, so a lease released
/// by a leader that shut down cleanly would sit unused for up to a lease duration. Followers
/// therefore also look at the Lease every retry period (as client-go's elector does) and start
/// over at once when it is free or expired.
async fn follow(
    manager: &LeaseManager,
    leases: &Api<Lease>,
    config: &ElectionConfig,
    tx: &watch::Sender<bool>,
    metrics: &Metrics,
    stop: &CancellationToken,
) -> Outcome {
    // Kept across iterations: dropping it halfway through a lock attempt would lose track of a
    // lease this replica just took.
    let mut changed = Box::pin(manager.changed());
    loop {
        let follower = !*tx.borrow();
        tokio::select! {
            () = stop.cancelled() => return Outcome::Stopped,
            result = &mut changed => {
                match result {
                    Ok(leader) => set_leader(tx, metrics, leader),
                    Err(err) => return Outcome::Failed(err),
                }
                changed = Box::pin(manager.changed());
            }
            () = tokio::time::sleep(config.retry_period), if follower => {
                if lease_free(leases, &config.lease_name).await {
                    return Outcome::Resync;
                }
            }
        }
    }
}

/// Whether the Lease has no holder or its holder let it expire. Errors count as "no": the
/// lease manager's own loop reports them.
async fn lease_free(leases: &Api<Lease>, name: &str) -> bool {
    let Ok(Some(lease)) = leases.get_opt(name).await else {
        return false;
    };
    let Some(spec) = lease.spec else {
        return true;
    };
    if spec.holder_identity.as_deref().is_none_or(str::is_empty) {
        return true;
    }
    match (spec.renew_time, spec.lease_duration_seconds) {
        (Some(renewed), Some(seconds)) => {
            let expiry = std::time::SystemTime::from(renewed.0)
                + Duration::from_secs(u64::try_from(seconds).unwrap_or(0));
            std::time::SystemTime::now() > expiry
        }
        _ => true,
    }
}

fn set_leader(tx: &watch::Sender<bool>, metrics: &Metrics, leader: bool) {
    let was = tx.send_replace(leader);
    metrics.leader.set(i64::from(leader));
    if was != leader {
        if leader {
            info!("became leader");
        } else {
            info!("not leader any more");
        }
    }
}

/// Release the lease if held, so a successor need not wait for it to expire. Runs in its own
/// task: a panic inside the lease library must not take the shutdown path down with it.
async fn release(manager: LeaseManager) {
    let task = tokio::spawn(async move { manager.release().await });
    match tokio::time::timeout(RELEASE_TIMEOUT, task).await {
        Ok(Ok(Ok(()))) => info!("leader lease released"),
        Ok(Ok(Err(err))) => warn!(error = %err, "cannot release the leader lease"),
        Ok(Err(join)) => warn!(error = %join, "releasing the leader lease failed"),
        Err(_) => warn!("releasing the leader lease timed out"),
    }
}

/// Run `start(stop)` whenever this replica is leader; cancel `stop` when leadership is lost or
/// `shutdown` is cancelled, and wait up to `drain` (at most 5 s after a lost lease) for it to
/// finish before abandoning it.
/// Returns after `shutdown`, once the controllers have stopped.
pub async fn run_while_leader<F, Fut>(
    mut leadership: Leadership,
    shutdown: CancellationToken,
    drain: Duration,
    mut start: F,
) where
    F: FnMut(CancellationToken) -> Fut,
    Fut: Future<Output = ()> + Send + 'static,
{
    loop {
        let acquired = tokio::select! {
            () = shutdown.cancelled() => return,
            acquired = leadership.acquired() => acquired,
        };
        if !acquired {
            // The election ended (shutdown in progress): nothing more to run.
            shutdown.cancelled().await;
            return;
        }
        info!("starting controllers");
        let stop = shutdown.child_token();
        let mut running = tokio::spawn(start(stop.clone()));
        let lost = loop {
            tokio::select! {
                () = leadership.lost() => break true,
                () = shutdown.cancelled() => break false,
                ended = &mut running => {
                    // Controllers end only when told to; restart them while still leader.
                    warn!(error = ?ended.err(), "controllers ended on their own; restarting");
                    tokio::select! {
                        () = shutdown.cancelled() => return,
                        () = leadership.lost() => break true,
                        () = tokio::time::sleep(RESTART_DELAY) => {}
                    }
                    running = tokio::spawn(start(stop.clone()));
                }
            }
        };
        info!(lost_leadership = lost, "stopping controllers");
        stop.cancel();
        let bound = if lost {
            drain.min(LOST_LEASE_DRAIN)
        } else {
            drain
        };
        if tokio::time::timeout(bound, &mut running).await.is_err() {
            warn!(?bound, "controllers did not stop in time; abandoning them");
            running.abort();
        }
        if !lost {
            return;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};

    fn config(lease: u64, renew: u64) -> ElectionConfig {
        ElectionConfig {
            lease_name: "l".into(),
            namespace: "ns".into(),
            identity: "me".into(),
            lease_duration: Duration::from_secs(lease),
            renew_deadline: Duration::from_secs(renew),
            retry_period: Duration::from_secs(1),
        }
    }

    #[test]
    fn timings_match_pko_defaults_and_reject_bad_ones() {
        assert_eq!(
            config(60, 45).timings().ok(),
            Some(LeaseTimings {
                duration_secs: 60,
                grace_secs: 15
            })
        );
        assert!(config(1, 0).timings().is_err());
        assert!(config(10, 10).timings().is_err());
        assert!(config(10, 0).timings().is_err());
        let mut sub_second = config(4, 2);
        sub_second.lease_duration = Duration::from_millis(3500);
        assert_eq!(sub_second.timings().map(|t| t.duration_secs).ok(), Some(4));
        let mut no_retry = config(4, 2);
        no_retry.retry_period = Duration::ZERO;
        assert!(no_retry.timings().is_err());
    }

    #[test]
    fn identities_differ() {
        let a = default_identity(Some("pod"));
        std::thread::sleep(Duration::from_millis(2));
        let b = default_identity(Some("pod"));
        assert!(a.starts_with("pod_"), "{a}");
        assert_ne!(a, b);
    }

    /// Polls `done` until it holds; fails naming `what` after a deadline far above any wait.
    async fn eventually(what: &str, done: impl Fn() -> bool) {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
        while !done() {
            assert!(
                tokio::time::Instant::now() < deadline,
                "timed out waiting: {what}"
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    #[tokio::test]
    async fn controllers_follow_leadership() {
        let (tx, rx) = watch::channel(false);
        let leadership = Leadership { rx, _always: None };
        let shutdown = CancellationToken::new();
        let starts = Arc::new(AtomicUsize::new(0));
        let running = Arc::new(AtomicUsize::new(0));
        let supervisor = tokio::spawn(run_while_leader(
            leadership,
            shutdown.clone(),
            Duration::from_secs(5),
            {
                let starts = starts.clone();
                let running = running.clone();
                move |stop: CancellationToken| {
                    starts.fetch_add(1, Ordering::SeqCst);
                    let running = running.clone();
                    async move {
                        running.fetch_add(1, Ordering::SeqCst);
                        stop.cancelled().await;
                        running.fetch_sub(1, Ordering::SeqCst);
                    }
                }
            },
        ));
        // A negative check: nothing may start before leadership. The sleep is a guess, but a
        // slow machine only makes it pass more easily.
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert_eq!(starts.load(Ordering::SeqCst), 0, "not leader yet");
        tx.send_replace(true);
        eventually("controllers running", || {
            running.load(Ordering::SeqCst) == 1
        })
        .await;
        tx.send_replace(false);
        eventually("stopped on loss", || running.load(Ordering::SeqCst) == 0).await;
        tx.send_replace(true);
        eventually("restarted on re-election", || {
            starts.load(Ordering::SeqCst) == 2
        })
        .await;
        shutdown.cancel();
        tokio::time::timeout(Duration::from_secs(5), supervisor)
            .await
            .expect("supervisor returns after shutdown")
            .expect("no panic");
        assert_eq!(running.load(Ordering::SeqCst), 0, "stopped on shutdown");
    }

    #[tokio::test]
    async fn always_leader_runs_at_once() {
        let mut leadership = Leadership::always();
        assert!(leadership.is_leader());
        assert!(
            tokio::time::timeout(Duration::from_secs(1), leadership.acquired())
                .await
                .unwrap_or(false)
        );
    }
}
