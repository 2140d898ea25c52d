//! Reconciles interrupted: the operator `kill -9`'d at random points while Programs
//! reconcile, and the apiserver killed and started again mid-reconcile. Every Program must
//! converge to an artifact whose bytes match its digest, with no status written twice.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use futures::StreamExt;
use kube::Api;
use kube::api::ListParams;
use kube::runtime::{WatchStreamExt, watcher};
use pko_api::program::Program;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use super::{Row, Scale, Section, create_programs, published, start_operator, verify_artifacts};
use crate::operator::Operator;
use crate::{ControlPlane, HarnessError, StartOptions, wait_for};

/// How long all Programs may take to converge once the disruptions are over.
const CONVERGE: Duration = Duration::from_secs(600);

/// `kill -9` of the operator `scale.kills` times at random points (seeded) while
/// `scale.programs` Programs are created and reconciled, then one operator to the end.
pub async fn kills(
    plane: &ControlPlane,
    scale: &Scale,
    seed: u64,
) -> Result<Section, HarnessError> {
    let ns = plane.namespace("chaos-kill").await?;
    let api: Api<Program> = Api::namespaced(plane.try_client()?, &ns);
    let writes = StatusWrites::watch(api.clone());
    let args = vec![format!("--watch-namespace={ns}")];
    let started = Instant::now();
    let creating = tokio::spawn({
        let (api, count) = (api.clone(), scale.programs);
        async move { create_programs(&api, count, CONVERGE).await }
    });
    let mut rng = StdRng::seed_from_u64(seed);
    let mut killed_at = Vec::new();
    let mut crashed = Vec::new();
    for _ in 0..scale.kills {
        let mut operator = start_operator(plane, args.clone()).await?;
        // The fault schedule, not a wait for a condition: a random point of the reconcile.
        tokio::time::sleep(Duration::from_millis(rng.random_range(50..1500))).await;
        killed_at.push(converged(&api).await);
        if let Some(status) = operator.exited() {
            crashed.push(status.to_string());
        }
        operator.kill();
    }
    let mut operator = start_operator(plane, args).await?;
    let last_start = Instant::now();
    let created = creating
        .await
        .map_err(|e| HarnessError::io("creating Programs", std::io::Error::other(e)))?;
    created?;
    let outcome = converge(&api, &mut operator, scale.programs).await;
    let after_last = last_start.elapsed();
    let total = started.elapsed();
    let writes = writes.finish(scale.programs).await;

    let mut section = Section {
        title: format!(
            "Operator `kill -9` × {} while {} Programs reconcile",
            scale.kills, scale.programs
        ),
        setup: format!(
            "Programs created 32 at a time while an operator runs; it is `kill -9`'d 50–1500 ms \
             after it is ready (seed {seed}), {} times, then one more runs to the end. Programs \
             with their artifact published at each kill: {:?}. Status writes counted by a watch \
             (a write is an event whose `.status` differs from the last one seen).",
            scale.kills, killed_at
        ),
        ..Section::default()
    };
    outcome.rows(&mut section, &writes, scale.programs);
    section.rows.push(Row::new(
        "converged after the last start / from the first create",
        format!(
            "{:.1} s / {:.1} s",
            after_last.as_secs_f64(),
            total.as_secs_f64()
        ),
        "recorded",
    ));
    section.check(crashed.is_empty(), || {
        format!("an operator exited on its own before its kill: {crashed:?}")
    });
    outcome.check(&mut section, &writes, scale.programs);
    section.check(operator.exited().is_none(), || {
        "the last operator exited".into()
    });
    Ok(section)
}

/// The apiserver `kill -9`'d and started again (same port, same etcd) once a third of the
/// Programs are published; the operator keeps running throughout. Uses a private control
/// plane: the shared one must not go away under other tests.
pub async fn apiserver_restart(scale: &Scale) -> Result<Section, HarnessError> {
    let state = tempfile::Builder::new()
        .prefix("pko-rs-chaos-")
        .tempdir()
        .map_err(|e| HarnessError::io("a state folder", e))?;
    let plane = ControlPlane::start(StartOptions {
        dir: Some(state.path().to_path_buf()),
        crds_dir: None,
        ..StartOptions::default()
    })
    .await?;
    let ns = plane.namespace("chaos-restart").await?;
    let api: Api<Program> = Api::namespaced(plane.try_client()?, &ns);
    let writes = StatusWrites::watch(api.clone());
    let mut operator = start_operator(&plane, vec![format!("--watch-namespace={ns}")]).await?;
    let started = Instant::now();
    let creating = tokio::spawn({
        let (api, count) = (api.clone(), scale.restart_programs);
        async move { create_programs(&api, count, CONVERGE).await }
    });
    let third = scale.restart_programs / 3;
    wait_for("a third of the Programs published", CONVERGE, || async {
        (converged(&api).await >= third).then_some(())
    })
    .await?;
    let at_restart = converged(&api).await;
    let down = plane.restart_apiserver().await?;
    let back = Instant::now();
    let created = creating
        .await
        .map_err(|e| HarnessError::io("creating Programs", std::io::Error::other(e)))?;
    created?;
    let outcome = converge(&api, &mut operator, scale.restart_programs).await;
    let after_restart = back.elapsed();
    let total = started.elapsed();
    let writes = writes.finish(scale.restart_programs).await;

    let mut section = Section {
        title: format!(
            "kube-apiserver restarted while {} Programs reconcile",
            scale.restart_programs
        ),
        setup: format!(
            "A private control plane; Programs created 32 at a time (creates retried while the \
             apiserver is away). Once {at_restart} were published, kube-apiserver was \
             `kill -9`'d and started again on the same port with the same etcd; it answered \
             `/readyz` again {:.1} s later. The operator ran throughout.",
            down.as_secs_f64()
        ),
        ..Section::default()
    };
    outcome.rows(&mut section, &writes, scale.restart_programs);
    section.rows.push(Row::new(
        "converged after the apiserver was back / from the first create",
        format!(
            "{:.1} s / {:.1} s",
            after_restart.as_secs_f64(),
            total.as_secs_f64()
        ),
        "recorded",
    ));
    outcome.check(&mut section, &writes, scale.restart_programs);
    section.check(operator.exited().is_none(), || {
        format!(
            "the operator exited when the apiserver went away:\n{}",
            operator.log_text()
        )
    });
    Ok(section)
}

/// Programs whose artifact for their generation is in their status.
async fn converged(api: &Api<Program>) -> usize {
    match api.list(&ListParams::default()).await {
        Ok(list) => list.items.iter().filter(|p| published(p).is_some()).count(),
        Err(_) => 0,
    }
}

/// Where the Programs ended.
struct Outcome {
    converged: usize,
    fetch_failures: usize,
    mismatches: usize,
    error: Option<String>,
}

/// Waits until all `count` Programs are published (or [`CONVERGE`] passes), then checks every
/// artifact's bytes against its digest through `operator`'s file server.
async fn converge(api: &Api<Program>, operator: &mut Operator, count: usize) -> Outcome {
    let all = wait_for("every Program published", CONVERGE, || async {
        let list = api.list(&ListParams::default()).await.ok()?;
        let done = list.items.iter().filter(|p| published(p).is_some()).count();
        (done == count).then_some(list.items)
    })
    .await;
    let programs = match all {
        Ok(programs) => programs,
        Err(e) => {
            return Outcome {
                converged: converged(api).await,
                fetch_failures: 0,
                mismatches: 0,
                error: Some(e.to_string()),
            };
        }
    };
    match verify_artifacts(operator, &programs).await {
        Ok((fetch_failures, mismatches)) => Outcome {
            converged: programs.len(),
            fetch_failures,
            mismatches,
            error: None,
        },
        Err(e) => Outcome {
            converged: programs.len(),
            fetch_failures: 0,
            mismatches: 0,
            error: Some(e.to_string()),
        },
    }
}

impl Outcome {
    fn rows(&self, section: &mut Section, writes: &WriteCounts, count: usize) {
        section.rows.extend([
            Row::new(
                "Programs converged",
                format!("{} of {count}", self.converged),
                "all",
            ),
            Row::new(
                "artifacts fetched / digest mismatches",
                format!(
                    "{} / {}",
                    self.converged.saturating_sub(self.fetch_failures),
                    self.mismatches
                ),
                "all / 0",
            ),
            Row::new(
                "status writes (Programs written more than once)",
                format!("{} ({})", writes.total, writes.programs_written_twice),
                &format!("{count} (0): one write per Program generation"),
            ),
        ]);
    }

    fn check(&self, section: &mut Section, writes: &WriteCounts, count: usize) {
        section.check(self.error.is_none(), || {
            format!("{} of {count} converged: {:?}", self.converged, self.error)
        });
        section.check(self.fetch_failures == 0, || {
            format!("{} artifacts could not be fetched", self.fetch_failures)
        });
        section.check(self.mismatches == 0, || {
            format!("{} artifacts do not match their digest", self.mismatches)
        });
        section.check(writes.programs_written_twice == 0, || {
            format!(
                "{} Programs had their status written more than once; the first: {:#?}",
                writes.programs_written_twice, writes.example
            )
        });
    }
}

/// Counts status writes per Program from a watch.
struct StatusWrites {
    state: Arc<Mutex<HashMap<String, Written>>>,
    task: tokio::task::JoinHandle<()>,
}

/// What the watch saw of one Program.
#[derive(Default)]
struct Written {
    /// The statuses written, in order (the first few: enough to tell why a Program was
    /// written twice).
    history: Vec<serde_json::Value>,
    writes: u64,
    published: bool,
}

/// The few statuses kept per Program.
const HISTORY: usize = 4;

struct WriteCounts {
    total: u64,
    programs_written_twice: usize,
    /// The first Program written more than once, with the statuses it had.
    example: Option<(String, Vec<serde_json::Value>)>,
}

impl StatusWrites {
    fn watch(api: Api<Program>) -> Self {
        let state: Arc<Mutex<HashMap<String, Written>>> = Arc::default();
        let task = tokio::spawn({
            let state = state.clone();
            async move {
                // Backoff: the stream reconnects (and relists) when the apiserver comes back.
                let mut events = watcher(api, watcher::Config::default())
                    .default_backoff()
                    .applied_objects()
                    .boxed();
                while let Some(event) = events.next().await {
                    let Ok(p) = event else { continue };
                    let Some(name) = p.metadata.name.clone() else {
                        continue;
                    };
                    let status = match &p.status {
                        Some(status) => serde_json::to_value(status).unwrap_or_default(),
                        None => continue,
                    };
                    let mut state = state.lock().unwrap_or_else(PoisonError::into_inner);
                    let seen = state.entry(name).or_default();
                    if seen.history.last() != Some(&status) {
                        seen.writes += 1;
                        if seen.history.len() < HISTORY {
                            seen.history.push(status);
                        } else if let Some(last) = seen.history.last_mut() {
                            *last = status;
                        }
                    }
                    seen.published = published(&p).is_some();
                }
            }
        });
        Self { state, task }
    }

    /// Waits until the watch has seen `count` Programs published (it may lag behind the
    /// lists that saw them converge), then stops it.
    async fn finish(self, count: usize) -> WriteCounts {
        let _ = wait_for(
            "the watch to see every Program published",
            CONVERGE,
            || async {
                let state = self.state.lock().unwrap_or_else(PoisonError::into_inner);
                (state.values().filter(|w| w.published).count() >= count).then_some(())
            },
        )
        .await;
        self.task.abort();
        let state = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        let mut twice: Vec<(&String, &Written)> =
            state.iter().filter(|(_, w)| w.writes > 1).collect();
        twice.sort_by_key(|(name, _)| *name);
        WriteCounts {
            total: state.values().map(|w| w.writes).sum(),
            programs_written_twice: twice.len(),
            example: twice
                .first()
                .map(|(name, w)| ((*name).clone(), w.history.clone())),
        }
    }
}
