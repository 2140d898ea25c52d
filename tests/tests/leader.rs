//! Leader election with two real operator processes on the real control plane: controllers run
//! on the leader only, a `kill -9`'d leader is replaced within the lease duration while the file
//! server keeps answering on the survivor, and SIGTERM releases the lease for a fast handover.
//!
//! Each test uses its own namespace for its Programs and its Lease.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use k8s_openapi::api::coordination::v1::Lease;
use kube::Api;
use kube::api::PostParams;
use pko_api::program::Program;
use pko_tests::operator::{Operator, OperatorOptions};
use pko_tests::{ControlPlane, HarnessError, wait_for};
use serde_json::json;

const LEASE: &str = "pko-rs-operator";
const WAIT: Duration = Duration::from_secs(60);
const RECONCILES: &str = "pko_reconciles_total{controller=\"program\"}";

fn election_args(ns: &str, duration: &str, renew: &str, retry: &str) -> Vec<String> {
    vec![
        format!("--watch-namespace={ns}"),
        "--leader-elect".into(),
        format!("--leader-election-namespace={ns}"),
        format!("--leader-election-lease-duration={duration}"),
        format!("--leader-election-renew-deadline={renew}"),
        format!("--leader-election-retry-period={retry}"),
    ]
}

async fn start(plane: &ControlPlane, args: Vec<String>) -> Operator {
    Operator::start(
        plane,
        OperatorOptions {
            advertised: None,
            args,
        },
    )
    .await
    .expect("operator starts")
}

fn program(name: &str) -> Program {
    serde_json::from_value(json!({
        "apiVersion": "pulumi.com/v1",
        "kind": "Program",
        "metadata": {"name": name},
        "program": {"resources": {"r": {"type": "kubernetes:core/v1:ConfigMap"}}},
    }))
    .expect("valid Program")
}

/// Waits until the Program's status carries the artifact of generation 1 (a leader wrote it).
async fn artifact_written(api: &Api<Program>, name: &str) {
    wait_for(&format!("artifact of {name}"), WAIT, || async {
        let p = api.get(name).await.ok()?;
        let status = serde_json::to_value(p.status?).ok()?;
        (status.pointer("/artifact/revision")?.as_str()? == "1").then_some(())
    })
    .await
    .expect("artifact written");
}

/// Polls `pko_leader` every 25 ms until it reads `want`; returns the time it took.
async fn until_leader(op: &Operator, want: bool, timeout: Duration) -> Duration {
    let started = Instant::now();
    let want = if want { 1.0 } else { 0.0 };
    loop {
        if op.metric("pko_leader").await == Some(want) {
            return started.elapsed();
        }
        assert!(
            started.elapsed() < timeout,
            "pko_leader did not become {want} within {timeout:?}; log:\n{}",
            op.log_text()
        );
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
}

async fn holder(leases: &Api<Lease>) -> Option<String> {
    leases.get(LEASE).await.ok()?.spec?.holder_identity
}

/// Fetches one artifact from `url` in a loop until stopped; counts answers that are not 200.
struct Poller {
    stop: Arc<AtomicBool>,
    ok: Arc<AtomicU64>,
    failed: Arc<AtomicU64>,
    task: tokio::task::JoinHandle<Vec<String>>,
}

impl Poller {
    fn start(url: String) -> Self {
        let stop = Arc::new(AtomicBool::new(false));
        let ok = Arc::new(AtomicU64::new(0));
        let failed = Arc::new(AtomicU64::new(0));
        let task = tokio::spawn({
            let (stop, ok, failed) = (stop.clone(), ok.clone(), failed.clone());
            async move {
                let client = reqwest::Client::builder()
                    .timeout(Duration::from_secs(2))
                    .build()
                    .expect("http client");
                let mut errors = Vec::new();
                while !stop.load(Ordering::Acquire) {
                    match client.get(&url).send().await {
                        Ok(resp) if resp.status() == 200 => {
                            ok.fetch_add(1, Ordering::Relaxed);
                        }
                        Ok(resp) => {
                            failed.fetch_add(1, Ordering::Relaxed);
                            errors.push(format!("status {}", resp.status()));
                        }
                        Err(e) => {
                            failed.fetch_add(1, Ordering::Relaxed);
                            errors.push(e.to_string());
                        }
                    }
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
                errors
            }
        });
        Self {
            stop,
            ok,
            failed,
            task,
        }
    }

    async fn finish(self) -> (u64, u64, Vec<String>) {
        self.stop.store(true, Ordering::Release);
        let errors = self.task.await.expect("poller");
        (
            self.ok.load(Ordering::Relaxed),
            self.failed.load(Ordering::Relaxed),
            errors,
        )
    }
}

#[tokio::test]
async fn killed_leader_is_replaced_within_the_lease_duration_while_the_survivor_serves() {
    const LEASE_DURATION: Duration = Duration::from_secs(4);
    let plane = ControlPlane::shared().await;
    let ns = plane.namespace("leader-kill").await.expect("namespace");
    let programs: Api<Program> = Api::namespaced(plane.client(), &ns);
    let leases: Api<Lease> = Api::namespaced(plane.client(), &ns);
    let args = election_args(&ns, "4s", "2s", "1s");
    programs
        .create(&PostParams::default(), &program("before"))
        .await
        .expect("create");

    let mut first = start(plane, args.clone()).await;
    until_leader(&first, true, WAIT).await;
    let second = start(plane, args).await;
    artifact_written(&programs, "before").await;
    let first_identity = holder(&leases).await.expect("a holder");

    // Only the leader reconciles; the follower serves and reports.
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(second.metric("pko_leader").await, Some(0.0));
    assert_eq!(second.metric(RECONCILES).await, None, "follower reconciled");
    assert!(first.metric(RECONCILES).await.unwrap_or(0.0) >= 1.0);

    let url = second.fs_url(&format!("/programs/{ns}/before/1"));
    let poller = Poller::start(url);
    tokio::time::sleep(Duration::from_millis(500)).await;

    let renewed = leases
        .get(LEASE)
        .await
        .ok()
        .and_then(|l| l.spec?.renew_time)
        .map(|t| std::time::SystemTime::from(t.0));
    first.kill();
    let killed = std::time::SystemTime::now();
    let takeover = until_leader(&second, true, Duration::from_secs(30)).await;
    let since_renewal = renewed.and_then(|r| killed.duration_since(r).ok());

    let new_identity = holder(&leases).await.expect("a holder");
    assert_ne!(new_identity, first_identity);
    // The lease must expire first (up to the lease duration after its last renewal), then
    // kube-lease-manager waits 0.1–1 s after clearing an expired lease before taking it; the
    // rest is headroom for a loaded machine.
    let bound = LEASE_DURATION + Duration::from_secs(3);
    assert!(
        takeover <= bound,
        "takeover took {takeover:?} (bound {bound:?}); survivor log:\n{}",
        second.log_text()
    );

    // The survivor now runs the controllers.
    programs
        .create(&PostParams::default(), &program("after"))
        .await
        .expect("create");
    artifact_written(&programs, "after").await;
    assert!(second.metric(RECONCILES).await.unwrap_or(0.0) >= 1.0);

    let (ok, failed, errors) = poller.finish().await;
    eprintln!(
        "failover: survivor leader {:.2}s after kill -9 (lease last renewed {:.2}s before the \
         kill; lease duration {}s); survivor file server: {ok} requests OK, {failed} failed",
        takeover.as_secs_f64(),
        since_renewal.map(|d| d.as_secs_f64()).unwrap_or(f64::NAN),
        LEASE_DURATION.as_secs(),
    );
    assert_eq!(failed, 0, "file server failed on the survivor: {errors:?}");
    assert!(ok >= 20, "only {ok} requests");
}

#[tokio::test]
async fn sigterm_drains_and_releases_the_lease_for_a_fast_handover() {
    // A lease long enough that only a released lease explains a quick takeover.
    const LEASE_DURATION: Duration = Duration::from_secs(30);
    let plane = ControlPlane::shared().await;
    let ns = plane.namespace("leader-term").await.expect("namespace");
    let leases: Api<Lease> = Api::namespaced(plane.client(), &ns);
    let args = election_args(&ns, "30s", "20s", "1s");

    let mut first = start(plane, args.clone()).await;
    until_leader(&first, true, WAIT).await;
    let second = start(plane, args).await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(second.metric("pko_leader").await, Some(0.0));
    let first_identity = holder(&leases).await.expect("a holder");

    let started = Instant::now();
    let status = first
        .terminate(Duration::from_secs(40))
        .expect("exit status");
    let stopped = started.elapsed();
    assert!(
        status.success(),
        "SIGTERM exit: {status}; log:\n{}",
        first.log_text()
    );
    // Graceful shutdown is bounded by --graceful-shutdown-timeout (30 s); idle, it is quick.
    assert!(
        stopped < Duration::from_secs(10),
        "shutdown took {stopped:?}"
    );
    let log = first.log_text();
    assert!(log.contains("leader lease released"), "{log}");
    assert_ne!(
        holder(&leases).await.as_deref(),
        Some(first_identity.as_str())
    );

    let takeover = until_leader(&second, true, LEASE_DURATION).await;
    eprintln!(
        "handover: SIGTERM'd leader exited in {:.2}s; follower leader {:.2}s later (lease duration {}s)",
        stopped.as_secs_f64(),
        takeover.as_secs_f64(),
        LEASE_DURATION.as_secs()
    );
    // Followers look at the lease every retry period (1 s), so a released lease is taken at once.
    assert!(
        takeover < Duration::from_secs(5),
        "takeover took {takeover:?}; log:\n{}",
        second.log_text()
    );
}

#[tokio::test]
async fn invalid_election_settings_fail_at_start() {
    let plane = ControlPlane::shared().await;
    let ns = plane.namespace("leader-bad").await.expect("namespace");
    let result = Operator::start(
        plane,
        OperatorOptions {
            advertised: None,
            // The renew deadline must be shorter than the lease duration.
            args: election_args(&ns, "10s", "10s", "1s"),
        },
    )
    .await;
    let Err(HarnessError::Exited { log, .. }) = result else {
        panic!("an operator with renew deadline = lease duration did not exit at start");
    };
    let text = std::fs::read_to_string(&log.path).expect("operator log");
    assert!(text.contains("renew deadline"), "{text}");
}

#[tokio::test]
async fn a_lost_lease_stops_the_controllers_until_it_is_won_back() {
    let plane = ControlPlane::shared().await;
    let ns = plane.namespace("leader-lost").await.expect("namespace");
    let programs: Api<Program> = Api::namespaced(plane.client(), &ns);
    let leases: Api<Lease> = Api::namespaced(plane.client(), &ns);
    let op = start(plane, election_args(&ns, "4s", "2s", "1s")).await;
    until_leader(&op, true, WAIT).await;

    // Someone else takes the lease (as a replica whose clock ran ahead might): the operator
    // notices at its next renewal and stops its controllers, without restarting.
    leases
        .patch(
            LEASE,
            &kube::api::PatchParams::default(),
            &kube::api::Patch::Merge(json!({"spec": {
                "holderIdentity": "thief",
                "renewTime": k8s_openapi::apimachinery::pkg::apis::meta::v1::MicroTime(
                    k8s_openapi::jiff::Timestamp::now()
                ),
                "leaseDurationSeconds": 4,
            }})),
        )
        .await
        .expect("steal the lease");
    until_leader(&op, false, Duration::from_secs(10)).await;
    programs
        .create(&PostParams::default(), &program("meanwhile"))
        .await
        .expect("create");
    tokio::time::sleep(Duration::from_millis(1000)).await;
    let status = programs.get("meanwhile").await.expect("get").status;
    assert!(
        status.is_none_or(|s| serde_json::to_value(s).is_ok_and(|v| v.get("artifact").is_none())),
        "a replica that lost the lease reconciled"
    );

    // The thief never renews: once its lease expires the operator takes it back and its
    // restarted controllers catch up.
    until_leader(&op, true, Duration::from_secs(20)).await;
    artifact_written(&programs, "meanwhile").await;
    assert_ne!(holder(&leases).await.as_deref(), Some("thief"));
    let log = op.log_text();
    assert!(log.contains("lost_leadership=true"), "{log}");
    assert!(log.matches("starting controllers").count() >= 2, "{log}");
}
