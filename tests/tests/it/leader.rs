//! Leader election with two real operator processes on the real control plane: controllers run
//! on the leader only, a `kill -9`'d leader is replaced within the lease duration while the file
//! server keeps answering on the survivor, and SIGTERM releases the lease for a fast handover.
//!
//! Each test uses its own namespace for its Programs and its Lease.

use std::time::{Duration, Instant};

use k8s_openapi::api::coordination::v1::Lease;
use kube::Api;
use kube::api::PostParams;
use pko_api::program::Program;
use pko_tests::chaos::{Polled, Poller};
use pko_tests::fixtures::config_map_program as program;
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

/// The artifact URL in the Program's status.
async fn artifact_url(api: &Api<Program>, name: &str) -> String {
    let p = api.get(name).await.expect("program");
    let status = serde_json::to_value(p.status).expect("status");
    status
        .pointer("/artifact/url")
        .and_then(serde_json::Value::as_str)
        .expect("artifact url")
        .to_owned()
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

#[tokio::test]
async fn killed_leader_is_replaced_within_the_lease_duration_while_the_survivor_serves() {
    let _machine = pko_tests::serial::shared().await;
    const LEASE_DURATION: Duration = Duration::from_secs(4);
    const RETRY_PERIOD: Duration = Duration::from_secs(1);
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

    // Only the leader reconciles; the follower serves and reports. A negative check: the sleep
    // is a guess, but a slow machine only makes it pass more easily.
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(second.metric("pko_leader").await, Some(0.0));
    assert_eq!(second.metric(RECONCILES).await, None, "follower reconciled");
    // Counted when a reconcile starts: certain once the artifact is written.
    assert!(first.metric(RECONCILES).await.unwrap_or(0.0) >= 1.0);

    let url = second.fs_url_of(&artifact_url(&programs, "before").await);
    let poller = Poller::start(vec![url], Duration::from_millis(20));
    // The survivor's file server answers before the kill (waited for, not slept for).
    poller
        .until_ok_above(0, WAIT)
        .await
        .expect("the file server answers");

    let renewed = leases
        .get(LEASE)
        .await
        .ok()
        .and_then(|l| l.spec?.renew_time)
        .map(|t| std::time::SystemTime::from(t.0));
    first.kill();
    let killed = std::time::SystemTime::now();
    let takeover = until_leader(&second, true, WAIT).await;
    let ok_at_takeover = poller.ok();
    let since_renewal = renewed.and_then(|r| killed.duration_since(r).ok());

    let new_identity = holder(&leases).await.expect("a holder");
    assert_ne!(new_identity, first_identity);
    // The bound follows the configured durations, not the machine: the lease expires at most a
    // lease duration after the kill, the follower looks at it every retry period, and
    // kube-lease-manager waits 0.1–1 s after clearing an expired lease before taking it. Two
    // more lease durations are headroom for a loaded machine; a follower that ignored the
    // configured lease (PKO's default is 60 s) still fails.
    let bound = LEASE_DURATION * 3 + RETRY_PERIOD + Duration::from_secs(1);
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

    // The survivor kept answering through the failover (no failure at any time) and still
    // answers after it; how many requests fit in between depends on the machine.
    poller
        .until_ok_above(ok_at_takeover, WAIT)
        .await
        .expect("the file server answers");
    let Polled { ok, errors, .. } = poller.finish().await;
    let failed = errors.len();
    eprintln!(
        "failover: survivor leader {:.2}s after kill -9 (lease last renewed {:.2}s before the \
         kill; lease duration {}s); survivor file server: {ok} requests OK, {failed} failed",
        takeover.as_secs_f64(),
        since_renewal.map(|d| d.as_secs_f64()).unwrap_or(f64::NAN),
        LEASE_DURATION.as_secs(),
    );
    assert_eq!(failed, 0, "file server failed on the survivor: {errors:?}");
}

#[tokio::test]
async fn sigterm_drains_and_releases_the_lease_for_a_fast_handover() {
    let _machine = pko_tests::serial::shared().await;
    // A lease long enough that only a released lease explains a quick takeover.
    const LEASE_DURATION: Duration = Duration::from_secs(60);
    const RENEW_DEADLINE: Duration = Duration::from_secs(30);
    let plane = ControlPlane::shared().await;
    let ns = plane.namespace("leader-term").await.expect("namespace");
    let leases: Api<Lease> = Api::namespaced(plane.client(), &ns);
    let args = election_args(&ns, "60s", "30s", "1s");

    let mut first = start(plane, args.clone()).await;
    until_leader(&first, true, WAIT).await;
    let second = start(plane, args).await;
    // A negative check (a follower while the lease is held): the sleep is a guess, but a slow
    // machine only makes it pass more easily.
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
    // Idle, the shutdown waits for nothing: no drain ran into a deadline (checked in the log,
    // not by how long it took, which depends on the machine).
    let log = first.log_text();
    for timed_out in ["did not stop", "shutdown timed out"] {
        assert!(!log.contains(timed_out), "{log}");
    }
    assert!(log.contains("leader lease released"), "{log}");
    assert_ne!(
        holder(&leases).await.as_deref(),
        Some(first_identity.as_str())
    );

    let takeover = until_leader(&second, true, WAIT).await;
    let handover = started.elapsed();
    eprintln!(
        "handover: SIGTERM'd leader exited in {:.2}s; follower leader {:.2}s later (lease duration {}s)",
        stopped.as_secs_f64(),
        takeover.as_secs_f64(),
        LEASE_DURATION.as_secs()
    );
    // Ordering, not speed: the leader renews every renew deadline, so an unreleased lease would
    // stay valid for at least LEASE_DURATION - RENEW_DEADLINE (30 s) after the SIGTERM. A
    // follower leading sooner took the released lease (it looks every retry period, 1 s).
    let bound = LEASE_DURATION - RENEW_DEADLINE;
    assert!(
        handover < bound,
        "handover took {handover:?} (bound {bound:?}); log:\n{}",
        second.log_text()
    );
}

#[tokio::test]
async fn invalid_election_settings_fail_at_start() {
    let _machine = pko_tests::serial::shared().await;
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
    let _machine = pko_tests::serial::shared().await;
    let plane = ControlPlane::shared().await;
    let ns = plane.namespace("leader-lost").await.expect("namespace");
    let programs: Api<Program> = Api::namespaced(plane.client(), &ns);
    let leases: Api<Lease> = Api::namespaced(plane.client(), &ns);
    let op = start(plane, election_args(&ns, "4s", "2s", "1s")).await;
    until_leader(&op, true, WAIT).await;

    // Someone else takes the lease (as a replica whose clock ran ahead might): the operator
    // notices at its next renewal and stops its controllers, without restarting. The thief's
    // lease lasts until the test ends it, so it cannot run out during the checks below however
    // slow the machine.
    leases
        .patch(
            LEASE,
            &kube::api::PatchParams::default(),
            &kube::api::Patch::Merge(json!({"spec": {
                "holderIdentity": "thief",
                "renewTime": k8s_openapi::apimachinery::pkg::apis::meta::v1::MicroTime(
                    k8s_openapi::jiff::Timestamp::now()
                ),
                "leaseDurationSeconds": 3600,
            }})),
        )
        .await
        .expect("steal the lease");
    until_leader(&op, false, WAIT).await;
    programs
        .create(&PostParams::default(), &program("meanwhile"))
        .await
        .expect("create");
    // A negative check: the sleep is a guess, but a slow machine only makes it pass more easily
    // (the thief holds the lease throughout).
    tokio::time::sleep(Duration::from_millis(1000)).await;
    let status = programs.get("meanwhile").await.expect("get").status;
    assert!(
        status.is_none_or(|s| serde_json::to_value(s).is_ok_and(|v| v.get("artifact").is_none())),
        "a replica that lost the lease reconciled"
    );

    // The thief never renews: once its lease expires the operator takes it back and its
    // restarted controllers catch up. Shortened to one second, the lease has expired already
    // (it was renewed before the sleep above).
    leases
        .patch(
            LEASE,
            &kube::api::PatchParams::default(),
            &kube::api::Patch::Merge(json!({"spec": {"leaseDurationSeconds": 1}})),
        )
        .await
        .expect("let the thief's lease expire");
    until_leader(&op, true, WAIT).await;
    artifact_written(&programs, "meanwhile").await;
    assert_ne!(holder(&leases).await.as_deref(), Some("thief"));
    let log = op.log_text();
    assert!(log.contains("lost_leadership=true"), "{log}");
    assert!(log.matches("starting controllers").count() >= 2, "{log}");
}
