//! The chaos and hostile-load scenarios of `make chaos` at a short scale: each must keep its
//! invariants (no crash, bounded memory, convergence, no error a client sees). Times are
//! recorded in the printed report, never asserted.

use pko_tests::ControlPlane;
use pko_tests::chaos::{self, Scale, Section};

/// A fixed seed: a failure here can be replayed with `pko-chaos --seed`.
const SEED: u64 = 20_261_201;

fn holds(section: Section) {
    println!("{}", section.markdown());
    assert!(
        section.violations.is_empty(),
        "{}: {:#?}",
        section.title,
        section.violations
    );
}

#[tokio::test]
async fn the_webhook_survives_maximum_bodies_and_a_slow_client_storm() {
    // Alone in the binary: each scenario measures one operator's memory and latencies, and
    // any other test would load the same two cores.
    let _alone = pko_tests::serial::alone().await;
    let plane = ControlPlane::shared().await;
    holds(
        chaos::webhook::storm(plane, &Scale::SHORT)
            .await
            .expect("scenario runs"),
    );
}

#[tokio::test]
async fn invented_methods_and_long_paths_add_no_metric_series() {
    // Alone in the binary: each scenario measures one operator's memory and latencies, and
    // any other test would load the same two cores.
    let _alone = pko_tests::serial::alone().await;
    let plane = ControlPlane::shared().await;
    holds(
        chaos::fileserver::invented_methods(plane, &Scale::SHORT, SEED)
            .await
            .expect("scenario runs"),
    );
}

#[tokio::test]
async fn slow_readers_and_idle_connections_hold_no_listener() {
    // Alone in the binary: each scenario measures one operator's memory and latencies, and
    // any other test would load the same two cores.
    let _alone = pko_tests::serial::alone().await;
    let plane = ControlPlane::shared().await;
    holds(
        chaos::listeners::section(plane, &Scale::SHORT)
            .await
            .expect("scenario runs"),
    );
}

#[tokio::test]
async fn a_hostile_module_server_fails_only_its_own_transforms() {
    // Alone in the binary: each scenario measures one operator's memory and latencies, and
    // any other test would load the same two cores.
    let _alone = pko_tests::serial::alone().await;
    let plane = ControlPlane::shared().await;
    holds(
        chaos::modules::section(plane, &Scale::SHORT)
            .await
            .expect("scenario runs"),
    );
}

#[tokio::test]
async fn programs_converge_with_one_status_write_across_operator_kills() {
    // Alone in the binary: each scenario measures one operator's memory and latencies, and
    // any other test would load the same two cores.
    let _alone = pko_tests::serial::alone().await;
    let plane = ControlPlane::shared().await;
    holds(
        chaos::reconcile::kills(plane, &Scale::SHORT, SEED)
            .await
            .expect("scenario runs"),
    );
}

#[tokio::test]
async fn programs_converge_across_an_apiserver_restart() {
    // Alone in the binary: each scenario measures one operator's memory and latencies, and
    // any other test would load the same two cores.
    let _alone = pko_tests::serial::alone().await;
    holds(
        chaos::reconcile::apiserver_restart(&Scale::SHORT)
            .await
            .expect("scenario runs"),
    );
}

#[tokio::test]
async fn the_standby_takes_over_and_serves_throughout_a_leader_kill() {
    // Alone in the binary: each scenario measures one operator's memory and latencies, and
    // any other test would load the same two cores.
    let _alone = pko_tests::serial::alone().await;
    let plane = ControlPlane::shared().await;
    holds(
        chaos::leader::failover(plane, &Scale::SHORT)
            .await
            .expect("scenario runs"),
    );
}

#[tokio::test]
async fn a_hostile_agent_fails_its_update_cleanly_and_the_operator_stays_up() {
    // Alone in the binary: each scenario measures one operator's memory and latencies, and
    // any other test would load the same two cores.
    let _alone = pko_tests::serial::alone().await;
    let plane = ControlPlane::shared().await;
    holds(
        chaos::agent::section(plane, &Scale::SHORT)
            .await
            .expect("scenario runs"),
    );
}
