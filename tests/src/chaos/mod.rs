//! Chaos and hostile-load scenarios: `make chaos` runs them at full scale and writes
//! docs/reliability.md; `make test` runs each at a short scale (tests/tests/it/chaos.rs).
//!
//! Every scenario drives the real operator binary against the real control plane on loopback,
//! with bounded loops that stop by themselves, and returns its figures as a [`Section`]. A
//! section's `violations` are the invariants that did not hold (a crash, unbounded memory, no
//! convergence, an error a client saw); times are recorded, never asserted.

pub mod agent;
pub mod fileserver;
pub mod leader;
pub mod listeners;
pub mod modules;
pub mod reconcile;
pub mod webhook;

use std::fmt::Write as _;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use kube::Api;
use pko_api::program::Program;
use serde_json::json;
use sha2::{Digest, Sha256};

use crate::measure::percentile;
use crate::operator::{Operator, OperatorOptions};
use crate::{ControlPlane, HarnessError};

/// The memory limit every chaos operator runs with (`--memory-limit`): its memory plan sizes
/// caches, admission slots and plugin slots inside it, and the run checks the peak against it.
pub const MEMORY_LIMIT_MIB: u64 = 768;

/// How hard each scenario pushes.
#[derive(Clone, Debug)]
pub struct Scale {
    pub name: &'static str,
    /// Maximum-size AdmissionReviews sent at once, in waves while the storm lasts.
    pub webhook_bodies: usize,
    /// Clients that open connections to the webhook and then trickle or stall.
    pub slow_clients: usize,
    /// How long the webhook storm lasts.
    pub storm: Duration,
    /// Requests with invented methods and long paths sent to the file server.
    pub fs_requests: usize,
    pub fs_path_bytes: usize,
    /// Programs reconciled while the operator is killed, and how many kills.
    pub programs: usize,
    pub kills: usize,
    /// Programs reconciled across an apiserver restart.
    pub restart_programs: usize,
    /// Programs whose artifacts the surviving replica serves while the leader is killed.
    pub leader_programs: usize,
    pub agent: agent::AgentScale,
}

impl Scale {
    /// `make chaos`: the figures of docs/reliability.md.
    pub const FULL: Scale = Scale {
        name: "full",
        webhook_bodies: 8,
        slow_clients: 400,
        storm: Duration::from_secs(20),
        fs_requests: 50_000,
        fs_path_bytes: 10 * 1024,
        programs: 1_000,
        kills: 10,
        restart_programs: 1_000,
        leader_programs: 100,
        agent: agent::AgentScale::FULL,
    };

    /// `make test`: the same scenarios, small enough for CI on 2 cores.
    pub const SHORT: Scale = Scale {
        name: "short",
        webhook_bodies: 8,
        slow_clients: 160,
        storm: Duration::from_secs(6),
        fs_requests: 4_000,
        fs_path_bytes: 10 * 1024,
        programs: 120,
        kills: 3,
        restart_programs: 120,
        leader_programs: 20,
        agent: agent::AgentScale::SHORT,
    };
}

/// One measured figure and the goal it is held to.
#[derive(Clone, Debug)]
pub struct Row {
    pub measure: String,
    pub value: String,
    pub goal: String,
}

impl Row {
    pub fn new(measure: impl Into<String>, value: impl Into<String>, goal: &str) -> Self {
        Self {
            measure: measure.into(),
            value: value.into(),
            goal: goal.to_owned(),
        }
    }
}

/// One scenario's figures.
#[derive(Clone, Debug, Default)]
pub struct Section {
    pub title: String,
    /// What was done, in one paragraph.
    pub setup: String,
    pub rows: Vec<Row>,
    /// Invariants that did not hold; empty when the scenario passed.
    pub violations: Vec<String>,
}

impl Section {
    /// Records a violation unless `holds`.
    pub fn check(&mut self, holds: bool, violation: impl FnOnce() -> String) {
        if !holds {
            self.violations.push(violation());
        }
    }

    /// The section as Markdown.
    pub fn markdown(&self) -> String {
        let mut out = String::new();
        let _ = writeln!(out, "## {}\n\n{}\n", self.title, self.setup);
        let _ = writeln!(out, "| measure | value | goal |\n|---|---:|---|");
        for row in &self.rows {
            let _ = writeln!(out, "| {} | {} | {} |", row.measure, row.value, row.goal);
        }
        if self.violations.is_empty() {
            let _ = writeln!(out, "\nEvery invariant held.");
        } else {
            let _ = writeln!(out, "\n**Invariants that did not hold:**\n");
            for v in &self.violations {
                let _ = writeln!(out, "- {v}");
            }
        }
        out
    }
}

/// `n` MiB with one decimal.
pub fn mib(kib: u64) -> String {
    format!("{:.1} MiB", kib as f64 / 1024.0)
}

/// A duration in ms with one decimal.
pub fn ms(d: Duration) -> String {
    format!("{:.1} ms", d.as_secs_f64() * 1000.0)
}

/// The address every chaos operator advertises in artifact URLs, as replicas behind one
/// Service do: a restarted operator (on another loopback port) then writes the same URL.
/// Fetches go to the operator's own port with the URL's path and token.
pub const ADVERTISED: &str = "http://pko-rs-fileserver.pko-system.svc.cluster.local";

/// An operator for a chaos scenario, with `--memory-limit` [`MEMORY_LIMIT_MIB`].
pub async fn start_operator(
    plane: &ControlPlane,
    args: Vec<String>,
) -> Result<Operator, HarnessError> {
    Operator::start(
        plane,
        OperatorOptions {
            advertised: Some(ADVERTISED.to_owned()),
            args: std::iter::once(format!("--memory-limit={MEMORY_LIMIT_MIB}Mi"))
                .chain(args)
                .collect(),
        },
    )
    .await
}

/// Leader election in `ns` with `lease` = (duration, renew deadline, retry period).
pub fn leader_election(ns: &str, lease: [&str; 3]) -> Vec<String> {
    vec![
        "--leader-elect".to_owned(),
        format!("--leader-election-namespace={ns}"),
        format!("--leader-election-lease-duration={}", lease[0]),
        format!("--leader-election-renew-deadline={}", lease[1]),
        format!("--leader-election-retry-period={}", lease[2]),
    ]
}

/// A Program whose artifact is small and unique to its name.
pub fn program(name: &str) -> Result<Program, HarnessError> {
    serde_json::from_value(json!({
        "apiVersion": "pulumi.com/v1",
        "kind": "Program",
        "metadata": {"name": name},
        "program": {
            "resources": {"r": {
                "type": "kubernetes:core/v1:ConfigMap",
                "properties": {"data": {"name": name}},
            }},
        },
    }))
    .map_err(|e| HarnessError::Missing {
        what: format!("a valid Program: {e}"),
    })
}

/// `program-00042`-style names, sorted as created.
pub fn program_name(i: usize) -> String {
    format!("program-{i:05}")
}

/// Creates Programs `0..count` with 32 creates in flight; a create that fails (the apiserver
/// away) is tried again until `deadline`, and one that exists already counts as created.
pub async fn create_programs(
    api: &Api<Program>,
    count: usize,
    deadline: Duration,
) -> Result<(), HarnessError> {
    use futures::StreamExt;
    let started = Instant::now();
    let results = futures::stream::iter(0..count)
        .map(|i| {
            let api = api.clone();
            async move {
                let object = program(&program_name(i))?;
                loop {
                    match api.create(&Default::default(), &object).await {
                        Ok(_) => return Ok(()),
                        Err(kube::Error::Api(status)) if status.code == 409 => return Ok(()),
                        Err(e) if started.elapsed() > deadline => {
                            return Err(HarnessError::kube(
                                format!("creating {}", program_name(i)),
                                e,
                            ));
                        }
                        Err(_) => tokio::time::sleep(Duration::from_millis(200)).await,
                    }
                }
            }
        })
        .buffer_unordered(32)
        .collect::<Vec<Result<(), HarnessError>>>()
        .await;
    results.into_iter().collect()
}

/// The `(url, digest)` of a Program's artifact for its current generation, once written.
pub fn published(p: &Program) -> Option<(String, String)> {
    let generation = p.metadata.generation?;
    let status = p.status.as_ref()?;
    let artifact = status.artifact.as_ref()?;
    (status.observed_generation == Some(generation) && artifact.revision == generation.to_string())
        .then(|| Some((artifact.url.clone(), artifact.digest.clone()?)))
        .flatten()
}

/// Fetches every published artifact through `operator`'s file server and compares its sha256
/// with the status digest; returns (fetch failures, digest mismatches).
pub async fn verify_artifacts(
    operator: &Operator,
    programs: &[Program],
) -> Result<(usize, usize), HarnessError> {
    use futures::StreamExt;
    let client = reqwest::Client::new();
    let outcomes = futures::stream::iter(programs.iter().filter_map(published))
        .map(|(url, digest)| {
            let client = client.clone();
            let url = operator.fs_url_of(&url);
            async move {
                let resp = client.get(&url).send().await.ok()?;
                if !resp.status().is_success() {
                    return None;
                }
                let body = resp.bytes().await.ok()?;
                Some(format!("sha256:{}", hex::encode(Sha256::digest(&body))) == digest)
            }
        })
        .buffer_unordered(16)
        .collect::<Vec<Option<bool>>>()
        .await;
    let failures = outcomes.iter().filter(|o| o.is_none()).count();
    let mismatches = outcomes.iter().filter(|o| **o == Some(false)).count();
    Ok((failures, mismatches))
}

/// Polls a URL in a loop until stopped, recording each answer's latency and counting the
/// answers that are not 200 (with their text).
pub struct Poller {
    stop: Arc<AtomicBool>,
    ok: Arc<AtomicU64>,
    task: tokio::task::JoinHandle<Polled>,
}

/// What a [`Poller`] saw.
#[derive(Debug, Default)]
pub struct Polled {
    pub ok: u64,
    pub errors: Vec<String>,
    /// Latencies of every answer, sorted.
    pub latencies: Vec<Duration>,
}

impl Polled {
    pub fn p99(&self) -> Duration {
        percentile(&self.latencies, 0.99)
    }

    pub fn max(&self) -> Duration {
        self.latencies.last().copied().unwrap_or_default()
    }
}

impl Poller {
    /// Starts polling `urls` in turn, one request per `every`, each bounded by 2 s.
    pub fn start(urls: Vec<String>, every: Duration) -> Self {
        let stop = Arc::new(AtomicBool::new(false));
        let ok = Arc::new(AtomicU64::new(0));
        let task = tokio::spawn({
            let (stop, ok) = (stop.clone(), ok.clone());
            async move {
                let mut polled = Polled::default();
                let client = match reqwest::Client::builder()
                    .timeout(Duration::from_secs(2))
                    .build()
                {
                    Ok(client) => client,
                    Err(e) => {
                        polled.errors.push(format!("http client: {e}"));
                        return polled;
                    }
                };
                for url in urls.iter().cycle() {
                    if stop.load(Ordering::Acquire) {
                        break;
                    }
                    let sent = Instant::now();
                    match client.get(url).send().await {
                        Ok(resp) if resp.status() == 200 => {
                            // The body too: a served artifact is only served when it arrived.
                            match resp.bytes().await {
                                Ok(_) => {
                                    ok.fetch_add(1, Ordering::Relaxed);
                                }
                                Err(e) => polled.errors.push(format!("{url}: body: {e}")),
                            }
                        }
                        Ok(resp) => polled.errors.push(format!("{url}: {}", resp.status())),
                        Err(e) => polled.errors.push(format!("{url}: {e}")),
                    }
                    polled.latencies.push(sent.elapsed());
                    tokio::time::sleep(every).await;
                }
                polled.ok = ok.load(Ordering::Relaxed);
                polled.latencies.sort();
                polled
            }
        });
        Self { stop, ok, task }
    }

    /// Answers with 200 so far.
    pub fn ok(&self) -> u64 {
        self.ok.load(Ordering::Relaxed)
    }

    /// Waits until more than `count` answers were 200.
    pub async fn until_ok_above(&self, count: u64, timeout: Duration) -> Result<(), HarnessError> {
        let what = format!("more than {count} answers of 200");
        crate::wait_for(&what, timeout, || async {
            (self.ok() > count).then_some(())
        })
        .await
    }

    pub async fn finish(self) -> Polled {
        self.stop.store(true, Ordering::Release);
        self.task.await.unwrap_or_else(|e| Polled {
            errors: vec![format!("the poller task failed: {e}")],
            ..Polled::default()
        })
    }
}

/// The whole report: a header and every section.
pub fn report(scale: &Scale, sections: &[Section], elapsed: Duration) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "# Reliability under chaos and hostile load\n\n\
         Measured by `make chaos` ({} scale, debug build of the operator, as `make test` runs it) \
         on {} — {}, in {:.0} s. Control plane: kube-apiserver + etcd built by `tools/` on \
         loopback. Every operator runs with `--memory-limit={MEMORY_LIMIT_MIB}Mi`. `make test` \
         runs each scenario at a short scale (tests/tests/it/chaos.rs) and asserts the same \
         invariants, never the times.\n",
        scale.name,
        jiff::Timestamp::now().strftime("%Y-%m-%d %H:%M UTC"),
        crate::measure::machine(),
        elapsed.as_secs_f64(),
    );
    for section in sections {
        out.push_str(&section.markdown());
        out.push('\n');
    }
    out
}
