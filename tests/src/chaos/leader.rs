//! Two replicas; the leader is `kill -9`'d. The standby must take the lease, reconcile what
//! arrives next, and serve every artifact throughout.

use std::time::{Duration, Instant};

use kube::Api;
use kube::api::{ListParams, PostParams};
use pko_api::program::Program;

use super::{Poller, Row, Scale, Section, create_programs, program, published, start_operator};
use crate::operator::Operator;
use crate::{ControlPlane, HarnessError, wait_for};

/// Lease settings of both replicas (duration, renew deadline, retry period).
const LEASE: [&str; 3] = ["4s", "3s", "500ms"];
const WAIT: Duration = Duration::from_secs(120);

/// Runs the failover and returns its figures.
pub async fn failover(plane: &ControlPlane, scale: &Scale) -> Result<Section, HarnessError> {
    let ns = plane.namespace("chaos-leader").await?;
    let mut args = vec![format!("--watch-namespace={ns}")];
    args.extend(super::leader_election(&ns, LEASE));
    let mut first = start_operator(plane, args.clone()).await?;
    until_leader(&first).await?;
    let mut second = start_operator(plane, args).await?;
    let api: Api<Program> = Api::namespaced(plane.try_client()?, &ns);
    create_programs(&api, scale.leader_programs, WAIT).await?;
    let urls = wait_for("every Program published", WAIT, || async {
        let list = api.list(&ListParams::default()).await.ok()?;
        let urls: Vec<String> = list
            .items
            .iter()
            .filter_map(published)
            .map(|(url, _)| second.fs_url_of(&url))
            .collect();
        (urls.len() == scale.leader_programs).then_some(urls)
    })
    .await?;

    // The survivor's file server, polled through the kill and the handover.
    let poller = Poller::start(urls, Duration::from_millis(10));
    poller.until_ok_above(0, WAIT).await?;
    let killed = Instant::now();
    first.kill();
    let failover = until_leader(&second).await?;
    let failover = failover.saturating_duration_since(killed);
    // What a user sees: a Program created after the kill gets its artifact from the new leader.
    api.create(&PostParams::default(), &program("after-failover")?)
        .await
        .map_err(|e| HarnessError::kube("creating a Program after the kill", e))?;
    wait_for("the new leader to publish", WAIT, || async {
        published(&api.get("after-failover").await.ok()?)
    })
    .await?;
    let published_after = killed.elapsed();
    // A few more answers after the handover, then stop.
    let seen = poller.ok();
    poller.until_ok_above(seen + 20, WAIT).await?;
    let polled = poller.finish().await;
    let exited = second.exited();

    let mut section = Section {
        title: "Leader `kill -9`'d with 2 replicas".into(),
        setup: format!(
            "Two replicas with leader election ({}/{}/{}); {} Programs published; the standby's \
             file server polled every 10 ms across all their artifacts while the leader is \
             `kill -9`'d (its lease is not released); then a new Program is created.",
            LEASE[0], LEASE[1], LEASE[2], scale.leader_programs
        ),
        ..Section::default()
    };
    section.rows = vec![
        Row::new(
            "kill → standby leads",
            format!("{:.2} s", failover.as_secs_f64()),
            "≤ lease duration + retry period (4.5 s)",
        ),
        Row::new(
            "kill → a new Program's artifact published",
            format!("{:.2} s", published_after.as_secs_f64()),
            "recorded",
        ),
        Row::new(
            "file-server answers during the failover: 200 / errors",
            format!("{} / {}", polled.ok, polled.errors.len()),
            "errors 0: the standby serves throughout",
        ),
        Row::new(
            "file-server latency p99 / max",
            format!("{} / {}", super::ms(polled.p99()), super::ms(polled.max())),
            "recorded",
        ),
    ];
    section.check(polled.errors.is_empty(), || {
        format!(
            "the survivor's file server failed {} requests: {:?}",
            polled.errors.len(),
            polled.errors.iter().take(5).collect::<Vec<_>>()
        )
    });
    section.check(exited.is_none(), || {
        format!("the survivor exited: {exited:?}")
    });
    Ok(section)
}

/// Polls `pko_leader` every 25 ms (finer than `wait_for`'s backoff: this is the measured
/// figure) until it reads 1; returns when it did.
async fn until_leader(operator: &Operator) -> Result<Instant, HarnessError> {
    let started = Instant::now();
    loop {
        if operator.metric("pko_leader").await == Some(1.0) {
            return Ok(Instant::now());
        }
        if started.elapsed() > WAIT {
            return Err(HarnessError::Timeout {
                what: "a leader".into(),
                timeout: WAIT,
            });
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
}
