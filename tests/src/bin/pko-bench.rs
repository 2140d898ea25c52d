//! `make bench`: pko-rs's operator and PKO v2.9.0's manager measured side by side, each alone
//! on a fresh private control plane (etcd + kube-apiserver) with its own CRDs, driven by the
//! same client with the same load; the numbers go to a Markdown file (docs/benchmarks.md) and
//! the pko-rs/PKO ratios to a baseline (docs/bench-baseline.json).
//!
//! - reconcile: N Programs created with 32 in flight → every `status.artifact` set; and a
//!   backlog: N Programs exist before the operator starts;
//! - per-Program create → ready p50/p99 (create response to the first status with an artifact
//!   for generation 1, from a watch);
//! - operator and kube-apiserver CPU seconds over each run, operator peak RSS (VmHWM);
//! - start → ready (spawn to a 200 from `/readyz`), median of several starts;
//! - file server: closed-loop GETs, and the same load against a bare HTTP server answering a
//!   fixed body of the same size (the machine's limit);
//! - status writes after a restart with N ready Programs;
//! - the apiserver's own rate for N bare status patches (server-side apply and JSON merge
//!   patch) from the same client, no operator running.
//!
//! `--musl-operator <path>` runs pko-rs a second time with the static musl build the images ship
//! (`make dist`), the same way as the glibc release build (at the counts of `--musl-at`, or
//! all); the table gets its figures and their ratio to the glibc build's. The baseline and
//! `--check` stay PKO ÷ pko-rs glibc.
//!
//! `--check BASELINE` (`make bench-check`) runs a short version and fails when a ratio falls
//! more than `--tolerance` below the recorded one.
#![allow(
    clippy::disallowed_methods,
    reason = "a test process is configured by its environment (make sets the tool and fixture paths)"
)]

use std::collections::{BTreeMap, HashMap};
use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use futures::{StreamExt, TryStreamExt};
use k8s_openapi::api::coordination::v1::Lease;
use kube::Api;
use kube::api::{ApiResource, DynamicObject, ListParams, Patch, PatchParams, PostParams};
use kube::core::{GroupVersionKind, WatchEvent};
use kube::runtime::{WatchStreamExt, watcher};
use pko_tests::bench_baseline::{Baseline, STACKS_PREFIX};
use pko_tests::pko_peer::{self, LeaseSettings, Peer, PeerBinaries, PeerOptions, RunningPeer};
use pko_tests::{ControlPlane, StartOptions, measure, spawn_guarded};
use serde_json::{Value, json};

const IN_FLIGHT: usize = 32;
/// How long a run may take before the bench gives up on it.
const RUN_TIMEOUT: Duration = Duration::from_secs(1200);
/// SIGTERM grace of an operator being stopped.
const STOP_GRACE: Duration = Duration::from_secs(30);
/// The shipped build's label (its column, sections and log files).
const MUSL: &str = "pko-rs musl (shipped)";

struct Args {
    out: Option<PathBuf>,
    counts: Vec<usize>,
    load_programs: usize,
    load_seconds: u64,
    connections: usize,
    starts: usize,
    quiet_seconds: u64,
    write_baseline: Option<PathBuf>,
    check: Option<PathBuf>,
    tolerance: f64,
    /// `--only …`: one part of the bench, printed, no report (to iterate on one side).
    only: Option<Only>,
    /// The shipped static (musl) `pko-operator`, measured beside the glibc release build.
    musl: Option<PathBuf>,
    /// The counts the musl build runs at (all of `--counts` when empty).
    musl_at: Vec<usize>,
}

/// What `--only` runs.
#[derive(Clone, Copy)]
enum Only {
    /// `pko-rs` or `pko`: that operator's runs.
    Peer(Peer),
    /// `musl`: the runs of `--musl-operator`'s build.
    Musl,
    /// `patches`: the bare status patch runs.
    Patches,
}

fn parse_args(mut it: impl Iterator<Item = String>) -> anyhow::Result<Args> {
    let mut args = Args {
        out: None,
        counts: vec![1000, 5000],
        load_programs: 1000,
        load_seconds: 10,
        // pko-rs's listeners take at most 16 connections from one client address by default
        // (`--listener-max-connections-per-client`) and close the rest at accept: one client
        // over it measures refusals (a run at 32 failed 39% of its requests), not serving. At
        // 16 the client's pool now and then dials before a finished connection is back in it
        // (one reset in 147,000 requests), so the load stays below the cap.
        connections: 12,
        starts: 5,
        quiet_seconds: 5,
        write_baseline: None,
        check: None,
        tolerance: 0.25,
        only: None,
        musl: None,
        musl_at: Vec::new(),
    };
    let mut out_given = false;
    let mut with_10k = false;
    while let Some(flag) = it.next() {
        if flag == "--with-10k" {
            with_10k = true;
            continue;
        }
        let value = it.next().with_context(|| format!("{flag} needs a value"))?;
        match flag.as_str() {
            "--out" => {
                out_given = true;
                args.out = Some(PathBuf::from(value));
            }
            "--counts" => args.counts = counts(&value, "--counts")?,
            "--load-programs" => args.load_programs = value.parse()?,
            "--load-seconds" => args.load_seconds = value.parse()?,
            "--connections" => args.connections = value.parse()?,
            "--starts" => args.starts = value.parse()?,
            "--quiet-seconds" => args.quiet_seconds = value.parse()?,
            "--write-baseline" => args.write_baseline = Some(PathBuf::from(value)),
            "--check" => args.check = Some(PathBuf::from(value)),
            "--tolerance" => args.tolerance = value.parse()?,
            "--only" => {
                args.only = Some(match value.as_str() {
                    "pko-rs" => Only::Peer(Peer::PkoRs),
                    "pko" => Only::Peer(Peer::Pko),
                    "musl" => Only::Musl,
                    "patches" => Only::Patches,
                    other => bail!("--only takes pko-rs, pko, musl or patches, not {other}"),
                })
            }
            "--musl-operator" => args.musl = Some(PathBuf::from(value)),
            "--musl-at" => args.musl_at = counts(&value, "--musl-at")?,
            other => bail!("unknown flag {other}"),
        }
    }
    if with_10k && !args.counts.contains(&10_000) {
        args.counts.push(10_000);
    }
    args.counts.sort_unstable();
    args.counts.dedup();
    if args.counts.is_empty() || args.counts.contains(&0) {
        bail!("--counts needs at least one count above zero");
    }
    if args.starts == 0 {
        bail!("--starts must be at least 1");
    }
    if let Some(path) = &args.musl
        && !path.is_file()
    {
        bail!(
            "--musl-operator {}: no such file (`make dist`)",
            path.display()
        );
    }
    if matches!(args.only, Some(Only::Musl)) && args.musl.is_none() {
        bail!("--only musl needs --musl-operator");
    }
    if !args.musl_at.is_empty() && args.musl.is_none() {
        bail!("--musl-at needs --musl-operator");
    }
    // A count the bench does not run would leave the musl column empty without a word.
    if let Some(n) = args.musl_at.iter().find(|n| !args.counts.contains(n)) {
        bail!("--musl-at {n}: not one of the counts ({:?})", args.counts);
    }
    // A check prints its comparison; it writes a report only when asked to.
    if !out_given && args.check.is_none() && args.only.is_none() {
        args.out = Some(PathBuf::from("docs/benchmarks.md"));
    }
    Ok(args)
}

/// Whether the run at `count` also takes the file-server load: at `--load-programs`, or at the
/// first count when the bench does not run that one.
fn with_load(args: &Args, count: usize) -> bool {
    count == args.load_programs
        || (count == args.counts[0] && !args.counts.contains(&args.load_programs))
}

/// A comma-separated list of Program counts.
fn counts(value: &str, flag: &str) -> anyhow::Result<Vec<usize>> {
    value
        .split(',')
        .map(|c| {
            c.trim()
                .parse()
                .with_context(|| format!("{flag} takes numbers"))
        })
        .collect()
}

fn main() -> anyhow::Result<()> {
    let mut argv = std::env::args().skip(1).peekable();
    if argv.peek().map(String::as_str) == Some("serve-bare") {
        argv.next();
        return serve_bare(argv);
    }
    let args = parse_args(argv)?;
    tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?
        .block_on(run(args))
}

/// `pko-bench serve-bare --port P --bytes N`: the bare HTTP server, as a process of its own so
/// its CPU time is measured like an operator's.
fn serve_bare(mut it: impl Iterator<Item = String>) -> anyhow::Result<()> {
    let (mut port, mut bytes) = (None, None);
    while let Some(flag) = it.next() {
        let value = it.next().with_context(|| format!("{flag} needs a value"))?;
        match flag.as_str() {
            "--port" => port = Some(value.parse::<u16>()?),
            "--bytes" => bytes = Some(value.parse::<usize>()?),
            other => bail!("unknown flag {other}"),
        }
    }
    let port = port.context("serve-bare needs --port")?;
    let body = vec![0x5a; bytes.context("serve-bare needs --bytes")?];
    tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?
        .block_on(async move {
            let listener = tokio::net::TcpListener::bind(("127.0.0.1", port)).await?;
            pko_peer::serve_bare(listener, &body).await?;
            anyhow::Ok(())
        })
}

/// One measured stretch of the run, with the machine's load around it.
struct Section {
    what: String,
    load_start: String,
    load_end: String,
    took: Duration,
}

#[derive(Default)]
struct Sections(Vec<Section>);

impl Sections {
    async fn run<T>(
        &mut self,
        what: String,
        f: impl std::future::Future<Output = anyhow::Result<T>>,
    ) -> anyhow::Result<T> {
        let load_start = measure::load_average();
        let started = Instant::now();
        println!("== {what} (load {load_start})");
        let out = f.await.with_context(|| what.clone())?;
        let took = started.elapsed();
        let load_end = measure::load_average();
        println!("   {what}: {:.1} s (load {load_end})", took.as_secs_f64());
        self.0.push(Section {
            what,
            load_start,
            load_end,
            took,
        });
        Ok(out)
    }
}

struct InFlight {
    create: Duration,
    ready: Duration,
    p50: Duration,
    p99: Duration,
    operator_cpu: f64,
    apiserver_cpu: f64,
    peak_kib: u64,
}

struct Backlog {
    ready: Duration,
    operator_cpu: f64,
    apiserver_cpu: f64,
    peak_kib: u64,
}

struct Restart {
    /// SIGTERM → exit of the process before the restart.
    stop_took: Duration,
    writes: usize,
    spawn_to_ready: Duration,
    last_write: Option<Duration>,
}

struct Load {
    requests: u64,
    /// Each kind of failed request once (status, or the client's error chain), with its count.
    error_kinds: std::collections::BTreeMap<String, u64>,
    elapsed: Duration,
    p50: Duration,
    p99: Duration,
    max: Duration,
    cpu_seconds: f64,
    body_bytes: usize,
}

impl Load {
    fn errors(&self) -> u64 {
        self.error_kinds.values().sum()
    }
    fn per_second(&self) -> f64 {
        self.requests as f64 / self.elapsed.as_secs_f64()
    }
    fn cpu_per_request(&self) -> Duration {
        Duration::from_secs_f64(self.cpu_seconds / (self.requests.max(1) as f64))
    }
}

/// Two replicas with leader election; the leader is `kill -9`'d.
struct Failover {
    /// kill → the Lease names another holder.
    to_leader: Duration,
    /// kill → a Program created right after the kill has its artifact.
    to_ready: Duration,
    /// GETs of published artifacts from the surviving replica between the kill and `to_ready`.
    served: u64,
    failed: u64,
}

struct PeerRun {
    failover: Option<Failover>,
    starts: Vec<Duration>,
    in_flight: InFlight,
    backlog: Backlog,
    restart: Restart,
    load: Option<Load>,
}

struct Patches {
    apply: Duration,
    merge: Duration,
    /// kube-apiserver CPU seconds for the N creates, the N applies and the N merge patches.
    create_cpu: f64,
    apply_cpu: f64,
    merge_cpu: f64,
}

struct CountRun {
    count: usize,
    patches: Patches,
    pko: PeerRun,
    ours: PeerRun,
    /// The shipped musl build's run, where `--musl-operator` and `--musl-at` ask for it.
    musl: Option<PeerRun>,
}

async fn run(args: Args) -> anyhow::Result<()> {
    let _ = rustls::crypto::ring::default_provider().install_default();
    let began = Instant::now();
    let bins = PeerBinaries::find(std::env::current_exe()?.with_file_name("pko-operator"))?;
    // The same peer, pko-rs, with the shipped binary: CRDs and PKO's manager stay the same.
    let musl_bins = args.musl.as_ref().map(|path| PeerBinaries {
        pko_rs: path.clone(),
        ..bins.clone()
    });
    let state = tempfile::Builder::new().prefix("pko-rs-bench-").tempdir()?;
    let mut sections = Sections::default();
    let mut runs = Vec::new();
    let mut bare = None;
    let first = args.counts[0];
    if matches!(args.only, Some(Only::Patches)) {
        for &count in &args.counts {
            patch_runs(&bins, count).await?;
        }
        return Ok(());
    }
    if let Some(only) = args.only {
        if args.out.is_some() || args.check.is_some() || args.write_baseline.is_some() {
            bail!("--only prints one operator's runs; it writes no report, baseline or check");
        }
        let (bins, peer, label) = match (only, &musl_bins) {
            (Only::Peer(peer), _) => (&bins, peer, peer.label()),
            (Only::Musl, Some(mb)) => (mb, Peer::PkoRs, MUSL),
            // parse_args refuses `--only musl` without `--musl-operator`; patches returned above.
            (Only::Musl | Only::Patches, _) => bail!("nothing to run for this --only"),
        };
        for &count in &args.counts {
            peer_run(
                &mut sections,
                bins,
                state.path(),
                &args,
                (peer, label),
                count,
                count == first,
                with_load(&args, count),
            )
            .await?;
        }
        println!("whole run: {:.0} s", began.elapsed().as_secs_f64());
        return Ok(());
    }
    for &count in &args.counts {
        let patches = sections
            .run(
                format!("bare status patches, {count}"),
                patch_runs(&bins, count),
            )
            .await?;
        let with_load = with_load(&args, count);
        let mut peers = Vec::new();
        for peer in [Peer::Pko, Peer::PkoRs] {
            let run = peer_run(
                &mut sections,
                &bins,
                state.path(),
                &args,
                (peer, peer.label()),
                count,
                count == first,
                with_load,
            )
            .await?;
            if peer == Peer::PkoRs
                && let Some(load) = &run.load
            {
                bare = Some(
                    sections
                        .run(
                            "file server load: bare HTTP server".into(),
                            bare_load(&args, state.path(), load.body_bytes),
                        )
                        .await?,
                );
            }
            peers.push(run);
        }
        let (Some(ours), Some(pko)) = (peers.pop(), peers.pop()) else {
            bail!("a peer run is missing");
        };
        // The shipped build last, every phase the glibc build ran (the bare server's load
        // above is the limit for both).
        let musl = match &musl_bins {
            Some(mb) if args.musl_at.is_empty() || args.musl_at.contains(&count) => Some(
                peer_run(
                    &mut sections,
                    mb,
                    state.path(),
                    &args,
                    (Peer::PkoRs, MUSL),
                    count,
                    count == first,
                    with_load,
                )
                .await?,
            ),
            _ => None,
        };
        runs.push(CountRun {
            count,
            patches,
            pko,
            ours,
            musl,
        });
    }
    let total = began.elapsed();
    let rows = rows(&runs);
    let ratios: BTreeMap<String, f64> = rows
        .iter()
        .filter(|r| r.guarded)
        .map(|r| (r.key.clone(), r.advantage))
        .collect();
    let report = report(&args, &runs, bare.as_ref(), &rows, &sections, total)?;
    println!("\n{report}");
    println!("whole bench: {:.0} s", total.as_secs_f64());

    if let Some(out) = &args.out {
        write_report(out, report)?;
        println!("wrote {}", out.display());
    }
    if let Some(path) = &args.write_baseline {
        // The Stack section's ratios, recorded by its own run, stay; this section's are new.
        let mut all: BTreeMap<String, f64> = Baseline::read(path)
            .map(|b| b.ratios)
            .unwrap_or_default()
            .into_iter()
            .filter(|(key, _)| key.starts_with(STACKS_PREFIX))
            .collect();
        all.extend(ratios.clone());
        Baseline {
            about: "pko-rs's advantage over PKO v2.9.0 per measure (> 1: pko-rs better), \
                    written by `make bench`; `make bench-check` fails when a ratio falls more \
                    than 25% below its value here."
                .into(),
            recorded: jiff::Timestamp::now()
                .strftime("%Y-%m-%d %H:%M UTC")
                .to_string(),
            machine: measure::machine(),
            ratios: all,
        }
        .write(path)?;
        println!("wrote {}", path.display());
    }
    if let Some(path) = &args.check {
        let baseline = Baseline::read(path)?;
        let outcome = baseline.check(&ratios, args.tolerance);
        println!(
            "\nbench-check against {} (recorded {}):",
            path.display(),
            baseline.recorded
        );
        for (key, then, now) in &outcome.compared {
            println!("  {key:<40} baseline {then:>7.3}×  now {now:>7.3}×");
        }
        for key in &outcome.unrecorded {
            println!("  {key:<40} not in the baseline (not checked)");
        }
        if outcome.compared.is_empty() {
            bail!(
                "bench-check: no ratio of this run is in {}: refresh it with `make bench`",
                path.display()
            );
        }
        if !outcome.regressions.is_empty() {
            let list: Vec<String> = outcome.regressions.iter().map(|r| r.to_string()).collect();
            bail!(
                "bench-check: {} ratio(s) fell more than {:.0}% below the baseline:\n  {}",
                list.len(),
                args.tolerance * 100.0,
                list.join("\n  ")
            );
        }
        println!(
            "bench-check: all {} ratios within {:.0}% of the baseline",
            outcome.compared.len(),
            args.tolerance * 100.0
        );
    }
    Ok(())
}

/// The Program resource, addressed without the typed struct so both CRD sets read the same.
fn program_resource() -> ApiResource {
    ApiResource::from_gvk_with_plural(
        &GroupVersionKind::gvk("pulumi.com", "v1", "Program"),
        "programs",
    )
}

fn programs(plane: &ControlPlane, ns: &str) -> anyhow::Result<Api<DynamicObject>> {
    Ok(Api::namespaced_with(
        plane.try_client()?,
        ns,
        &program_resource(),
    ))
}

async fn fresh_plane(crds: &Path) -> anyhow::Result<ControlPlane> {
    Ok(ControlPlane::start(StartOptions {
        dir: None,
        crds_dir: Some(crds.to_path_buf()),
        ..StartOptions::default()
    })
    .await?)
}

#[allow(clippy::too_many_arguments, reason = "one run's settings, read once")]
async fn peer_run(
    sections: &mut Sections,
    bins: &PeerBinaries,
    logs: &Path,
    args: &Args,
    (peer, label): (Peer, &str),
    count: usize,
    measure_starts: bool,
    with_load: bool,
) -> anyhow::Result<PeerRun> {
    let log = |what: &str| logs.join(format!("{}-{count}-{what}.log", slug(label)));
    // A plane for the creates in flight, the file-server load and the restart.
    let plane = fresh_plane(bins.crds_dir(peer)).await?;
    let system_ns = plane.namespace("operator-system").await?;
    let starts = if measure_starts {
        sections
            .run(format!("{label}: start → ready ×{}", args.starts), async {
                let mut starts = Vec::new();
                for i in 0..args.starts {
                    let mut op = pko_peer::start(
                        peer,
                        bins,
                        &plane,
                        &system_ns,
                        &log(&format!("start{i}")),
                        None,
                    )
                    .await?;
                    starts.push(op.spawn_to_ready);
                    // No work to finish: SIGTERM and SIGKILL at once, so starts do not wait.
                    op.stop(Duration::ZERO);
                }
                anyhow::Ok(starts)
            })
            .await?
    } else {
        Vec::new()
    };
    let mut op = pko_peer::start(peer, bins, &plane, &system_ns, &log("in-flight"), None).await?;
    let ns = plane.namespace("bench").await?;
    let in_flight = sections
        .run(
            format!("{label}: {count} Programs, {IN_FLIGHT} creates in flight"),
            in_flight_run(&plane, &op, &ns, count),
        )
        .await?;
    let load = if with_load {
        Some(
            sections
                .run(
                    format!("{label}: file server load"),
                    load_run(
                        &plane,
                        &op,
                        &ns,
                        count.min(args.load_programs),
                        args.connections,
                        args.load_seconds,
                    ),
                )
                .await?,
        )
    } else {
        None
    };
    let stopping = Instant::now();
    op.stop(STOP_GRACE);
    let stop_took = stopping.elapsed();
    println!(
        "   {label}: SIGTERM → exit {:.2} s (SIGKILL after {} s)",
        stop_took.as_secs_f64(),
        STOP_GRACE.as_secs()
    );
    let restart = sections
        .run(
            format!("{label}: restart with {count} ready Programs"),
            restart_run(
                &plane,
                bins,
                peer,
                &system_ns,
                &ns,
                &log("restart"),
                op.fs_port,
                args.quiet_seconds,
            ),
        )
        .await?;
    let restart = Restart {
        stop_took,
        ..restart
    };
    drop(plane);

    // A plane of its own for the backlog: the operator starts after the Programs exist.
    let plane = fresh_plane(bins.crds_dir(peer)).await?;
    let system_ns = plane.namespace("operator-system").await?;
    let ns = plane.namespace("bench").await?;
    let backlog = sections
        .run(
            format!("{label}: backlog of {count} Programs"),
            backlog_run(&plane, bins, peer, &system_ns, &ns, count, &log("backlog")),
        )
        .await?;
    drop(plane);
    let failover = if measure_starts {
        Some(
            sections
                .run(
                    format!("{label}: failover (2 replicas, leader kill -9'd)"),
                    failover_run(bins, peer, &log("failover")),
                )
                .await?,
        )
    } else {
        None
    };
    Ok(PeerRun {
        failover,
        starts,
        in_flight,
        backlog,
        restart,
        load,
    })
}

fn slug(label: &str) -> String {
    label
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() {
                c.to_ascii_lowercase()
            } else {
                '-'
            }
        })
        .collect()
}

/// Whether a Program's status carries the artifact of its current generation.
fn artifact_ready(p: &DynamicObject) -> bool {
    let Some(status) = p.data.get("status") else {
        return false;
    };
    let has_artifact = status
        .get("artifact")
        .is_some_and(|a| a.is_object() && !a.as_object().is_some_and(|o| o.is_empty()));
    let generation = p.metadata.generation.unwrap_or(1);
    let observed = status
        .get("observedGeneration")
        .and_then(Value::as_i64)
        .unwrap_or(generation);
    has_artifact && observed >= generation
}

/// Watches `api` until `count` Programs have their artifact; returns when each first did.
fn watch_ready(
    api: Api<DynamicObject>,
    count: usize,
) -> tokio::task::JoinHandle<HashMap<String, Instant>> {
    tokio::spawn(async move {
        let mut ready = HashMap::with_capacity(count);
        let mut stream = std::pin::pin!(
            watcher(api, watcher::Config::default())
                .default_backoff()
                .applied_objects()
        );
        loop {
            match stream.next().await {
                Some(Ok(p)) => {
                    if artifact_ready(&p) {
                        let name = p.metadata.name.unwrap_or_default();
                        ready.entry(name).or_insert_with(Instant::now);
                        if ready.len() >= count {
                            break;
                        }
                    }
                }
                Some(Err(_)) => continue,
                None => break,
            }
        }
        ready
    })
}

async fn wait_ready(
    task: tokio::task::JoinHandle<HashMap<String, Instant>>,
    count: usize,
) -> anyhow::Result<HashMap<String, Instant>> {
    let ready = tokio::time::timeout(RUN_TIMEOUT, task)
        .await
        .context("timed out waiting for artifacts")??;
    if ready.len() < count {
        bail!("only {} of {count} Programs got an artifact", ready.len());
    }
    Ok(ready)
}

fn cpu(pid: Option<u32>) -> f64 {
    pid.and_then(pko_peer::cpu_seconds).unwrap_or(0.0)
}

async fn in_flight_run(
    plane: &ControlPlane,
    op: &RunningPeer,
    ns: &str,
    count: usize,
) -> anyhow::Result<InFlight> {
    let api = programs(plane, ns)?;
    let apiserver = pko_peer::plane_pid(plane, "kube-apiserver");
    let watch = watch_ready(api.clone(), count);
    let (op_cpu0, api_cpu0) = (cpu(Some(op.pid())), cpu(apiserver));
    let start = Instant::now();
    let created = create_programs(&api, "p", count).await?;
    let create = start.elapsed();
    let ready = wait_ready(watch, count).await?;
    let done = ready.values().max().copied().unwrap_or(start);
    let (op_cpu, api_cpu) = (cpu(Some(op.pid())), cpu(apiserver));
    let mut latencies: Vec<Duration> = created
        .iter()
        .filter_map(|(name, at)| ready.get(name).map(|r| r.saturating_duration_since(*at)))
        .collect();
    latencies.sort_unstable();
    let peak_kib = measure::peak_rss_kib(op.pid()).unwrap_or(0);
    let run = InFlight {
        create,
        ready: done.saturating_duration_since(start),
        p50: measure::percentile(&latencies, 0.50),
        p99: measure::percentile(&latencies, 0.99),
        operator_cpu: op_cpu - op_cpu0,
        apiserver_cpu: api_cpu - api_cpu0,
        peak_kib,
    };
    println!(
        "   created in {:.2} s, all ready {:.2} s, per-Program p50 {:.0} ms p99 {:.0} ms, \
         operator CPU {:.2} s, apiserver CPU {:.2} s, peak RSS {:.1} MiB",
        run.create.as_secs_f64(),
        run.ready.as_secs_f64(),
        ms(run.p50),
        ms(run.p99),
        run.operator_cpu,
        run.apiserver_cpu,
        run.peak_kib as f64 / 1024.0
    );
    Ok(run)
}

async fn backlog_run(
    plane: &ControlPlane,
    bins: &PeerBinaries,
    peer: Peer,
    system_ns: &str,
    ns: &str,
    count: usize,
    log: &Path,
) -> anyhow::Result<Backlog> {
    let api = programs(plane, ns)?;
    create_programs(&api, "p", count).await?;
    let apiserver = pko_peer::plane_pid(plane, "kube-apiserver");
    let watch = watch_ready(api.clone(), count);
    let api_cpu0 = cpu(apiserver);
    let op = pko_peer::start(peer, bins, plane, system_ns, log, None).await?;
    let ready = wait_ready(watch, count).await?;
    let done = ready.values().max().copied().unwrap_or(op.spawned);
    let run = Backlog {
        ready: done.saturating_duration_since(op.spawned),
        operator_cpu: cpu(Some(op.pid())),
        apiserver_cpu: cpu(apiserver) - api_cpu0,
        peak_kib: measure::peak_rss_kib(op.pid()).unwrap_or(0),
    };
    println!(
        "   all ready {:.2} s after spawn, operator CPU {:.2} s, apiserver CPU {:.2} s, peak RSS {:.1} MiB",
        run.ready.as_secs_f64(),
        run.operator_cpu,
        run.apiserver_cpu,
        run.peak_kib as f64 / 1024.0
    );
    Ok(run)
}

/// Starts the operator again (file server on the same port, so the artifact URLs stay the
/// same) with every Program ready and counts the Program writes a watch sees until `quiet`
/// seconds pass without one (after readiness).
#[allow(clippy::too_many_arguments, reason = "one run's settings, read once")]
async fn restart_run(
    plane: &ControlPlane,
    bins: &PeerBinaries,
    peer: Peer,
    system_ns: &str,
    ns: &str,
    log: &Path,
    fs_port: u16,
    quiet: u64,
) -> anyhow::Result<Restart> {
    let api = programs(plane, ns)?;
    let rv = api
        .list(&ListParams::default().limit(1))
        .await?
        .metadata
        .resource_version
        .context("a list without a resourceVersion")?;
    let writes: Arc<Mutex<Vec<Instant>>> = Arc::default();
    let seen = writes.clone();
    let watch_api = api.clone();
    let counter = tokio::spawn(async move {
        let mut rv = rv;
        loop {
            let params = kube::api::WatchParams::default().timeout(290);
            let Ok(stream) = watch_api.watch(&params, &rv).await else {
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            };
            let mut stream = std::pin::pin!(stream);
            while let Some(event) = stream.next().await {
                match event {
                    Ok(WatchEvent::Modified(p)) => {
                        if let Ok(mut w) = seen.lock() {
                            w.push(Instant::now());
                        }
                        if let Some(v) = p.metadata.resource_version {
                            rv = v;
                        }
                    }
                    Ok(WatchEvent::Added(p) | WatchEvent::Deleted(p)) => {
                        if let Some(v) = p.metadata.resource_version {
                            rv = v;
                        }
                    }
                    Ok(WatchEvent::Bookmark(b)) => rv = b.metadata.resource_version,
                    Ok(WatchEvent::Error(_)) | Err(_) => break,
                }
            }
        }
    });
    let op = pko_peer::start(peer, bins, plane, system_ns, log, Some(fs_port)).await?;
    let quiet = Duration::from_secs(quiet);
    let deadline = Instant::now() + Duration::from_secs(300);
    loop {
        tokio::time::sleep(Duration::from_millis(200)).await;
        let last = writes
            .lock()
            .ok()
            .and_then(|w| w.last().copied())
            .unwrap_or(op.spawned)
            .max(op.spawned + op.spawn_to_ready);
        if last.elapsed() >= quiet || Instant::now() > deadline {
            break;
        }
    }
    counter.abort();
    let seen = writes.lock().map(|w| w.clone()).unwrap_or_default();
    let run = Restart {
        stop_took: Duration::ZERO,
        writes: seen.len(),
        spawn_to_ready: op.spawn_to_ready,
        last_write: seen.last().map(|t| t.saturating_duration_since(op.spawned)),
    };
    println!(
        "   {} Program writes after the restart (ready in {:.3} s)",
        run.writes,
        run.spawn_to_ready.as_secs_f64()
    );
    Ok(run)
}

/// Creates `count` Programs named `<prefix>-<i>`, each a small but real program; returns when
/// each create's response arrived.
async fn create_programs(
    api: &Api<DynamicObject>,
    prefix: &str,
    count: usize,
) -> anyhow::Result<HashMap<String, Instant>> {
    let ar = program_resource();
    let created = futures::stream::iter(0..count)
        .map(|i| {
            let api = api.clone();
            let ar = ar.clone();
            async move {
                let name = format!("{prefix}-{i:05}");
                let p: DynamicObject = serde_json::from_value(json!({
                    "apiVersion": ar.api_version, "kind": ar.kind,
                    "metadata": {"name": name},
                    "program": {
                        "configuration": {"size": {"type": "Number", "default": i}},
                        "resources": {"r": {"type": "random:index:RandomString", "properties": {"length": "${size}"}}},
                        "outputs": {"value": "${r.result}"},
                    },
                }))?;
                api.create(&PostParams::default(), &p).await?;
                anyhow::Ok((name, Instant::now()))
            }
        })
        .buffer_unordered(IN_FLIGHT)
        .try_collect::<HashMap<_, _>>()
        .await?;
    Ok(created)
}

/// N status patches of fresh Programs, no operator running, with the same concurrency: as
/// server-side apply and as JSON merge patch (each on Programs of its own).
async fn patch_runs(bins: &PeerBinaries, count: usize) -> anyhow::Result<Patches> {
    let plane = fresh_plane(bins.crds_dir(Peer::PkoRs)).await?;
    let apply = status_patch_run(&plane, count, true).await?;
    let merge = status_patch_run(&plane, count, false).await?;
    println!(
        "   server-side apply {:.2} s ({:.0}/s, apiserver CPU {:.2} s), JSON merge patch {:.2} s \
         ({:.0}/s, apiserver CPU {:.2} s); creates: apiserver CPU {:.2} s",
        apply.took.as_secs_f64(),
        count as f64 / apply.took.as_secs_f64(),
        apply.patch_cpu,
        merge.took.as_secs_f64(),
        count as f64 / merge.took.as_secs_f64(),
        merge.patch_cpu,
        (apply.create_cpu + merge.create_cpu) / 2.0,
    );
    Ok(Patches {
        apply: apply.took,
        merge: merge.took,
        create_cpu: (apply.create_cpu + merge.create_cpu) / 2.0,
        apply_cpu: apply.patch_cpu,
        merge_cpu: merge.patch_cpu,
    })
}

struct PatchRun {
    took: Duration,
    create_cpu: f64,
    patch_cpu: f64,
}

async fn status_patch_run(
    plane: &ControlPlane,
    count: usize,
    apply: bool,
) -> anyhow::Result<PatchRun> {
    let ns = plane
        .namespace(if apply { "patch-apply" } else { "patch-merge" })
        .await?;
    let api = programs(plane, &ns)?;
    let apiserver = pko_peer::plane_pid(plane, "kube-apiserver");
    // Objects first (their CPU apart); the time is the patches'.
    let cpu0 = cpu(apiserver);
    create_programs(&api, "q", count).await?;
    let cpu1 = cpu(apiserver);
    let ar = program_resource();
    let params = if apply {
        PatchParams::apply("pko-bench").force()
    } else {
        PatchParams::default()
    };
    let start = Instant::now();
    futures::stream::iter(0..count)
        .map(|i| {
            let api = api.clone();
            let params = params.clone();
            let ar = ar.clone();
            async move {
                let status = json!({"observedGeneration": 1, "artifact": {
                    "path": "x", "url": "x", "revision": "1",
                    "digest": "sha256:0000", "lastUpdateTime": "2026-01-01T00:00:00Z", "size": i,
                }});
                let name = format!("q-{i:05}");
                if apply {
                    let patch =
                        json!({"apiVersion": ar.api_version, "kind": ar.kind, "status": status});
                    api.patch_status(&name, &params, &Patch::Apply(&patch))
                        .await?;
                } else {
                    let patch = json!({"status": status});
                    api.patch_status(&name, &params, &Patch::Merge(&patch))
                        .await?;
                }
                anyhow::Ok(())
            }
        })
        .buffer_unordered(IN_FLIGHT)
        .try_collect::<Vec<_>>()
        .await?;
    let took = start.elapsed();
    Ok(PatchRun {
        took,
        create_cpu: cpu1 - cpu0,
        patch_cpu: cpu(apiserver) - cpu1,
    })
}

/// Programs published before the leader is killed.
const FAILOVER_PROGRAMS: usize = 100;

/// Two replicas of `peer` with leader election, both advertising the first one's file-server
/// address (as behind a Service); the first leads. After 100 Programs are published, the leader
/// is `kill -9`'d (its lease is not released), a Program is created, and the surviving replica's
/// file server is asked for the published artifacts every 10 ms until that Program is ready.
async fn failover_run(bins: &PeerBinaries, peer: Peer, log: &Path) -> anyhow::Result<Failover> {
    let plane = fresh_plane(bins.crds_dir(peer)).await?;
    let system_ns = plane.namespace("operator-system").await?;
    let ns = plane.namespace("bench").await?;
    let leases: Api<Lease> = Api::namespaced(plane.try_client()?, &system_ns);
    let lease_name = LeaseSettings::lease_name(peer);
    let first_port = pko_peer::free_port()?;
    let opts = |fs_port| PeerOptions {
        fs_port,
        advertised: Some(format!("127.0.0.1:{first_port}")),
        lease: Some(LeaseSettings::FAILOVER),
        ..PeerOptions::default()
    };
    let mut leader = pko_peer::start_with(
        peer,
        bins,
        &plane,
        &system_ns,
        &log.with_extension("a.log"),
        &opts(Some(first_port)),
    )
    .await?;
    // The first replica leads before the second exists.
    let holder = pko_peer::lease_holder(&leases, lease_name, None, RUN_TIMEOUT).await?;
    let survivor = pko_peer::start_with(
        peer,
        bins,
        &plane,
        &system_ns,
        &log.with_extension("b.log"),
        &opts(None),
    )
    .await?;
    let api = programs(&plane, &ns)?;
    let watch = watch_ready(api.clone(), FAILOVER_PROGRAMS);
    create_programs(&api, "p", FAILOVER_PROGRAMS).await?;
    wait_ready(watch, FAILOVER_PROGRAMS).await?;
    let urls = artifact_urls(&plane, survivor.fs_port, &ns, FAILOVER_PROGRAMS).await?;

    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let poller = tokio::spawn({
        let stop = stop.clone();
        async move {
            let client = reqwest::Client::builder()
                .timeout(Duration::from_secs(1))
                .build()?;
            let (mut served, mut failed) = (0u64, 0u64);
            for url in urls.iter().cycle() {
                if stop.load(std::sync::atomic::Ordering::Relaxed) {
                    break;
                }
                match client.get(url).send().await {
                    Ok(resp) if resp.status().is_success() => served += 1,
                    _ => failed += 1,
                }
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
            anyhow::Ok((served, failed))
        }
    });
    let killed = Instant::now();
    leader.kill();
    create_programs(&api, "f", 1).await?;
    let new_leader = async {
        pko_peer::lease_holder(&leases, lease_name, Some(&holder), RUN_TIMEOUT).await?;
        anyhow::Ok(killed.elapsed())
    };
    let new_ready = async {
        let deadline = killed + RUN_TIMEOUT;
        loop {
            if let Ok(p) = api.get("f-00000").await
                && artifact_ready(&p)
            {
                return anyhow::Ok(killed.elapsed());
            }
            if Instant::now() > deadline {
                bail!("the Program created after the kill got no artifact");
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    };
    let (to_leader, to_ready) = tokio::join!(new_leader, new_ready);
    let (to_leader, to_ready) = (to_leader?, to_ready?);
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let (served, failed) = poller.await??;
    println!(
        "   kill → new leader {:.2} s, → new Program ready {:.2} s; survivor's file server: {served} served, {failed} failed",
        to_leader.as_secs_f64(),
        to_ready.as_secs_f64()
    );
    drop(survivor);
    Ok(Failover {
        to_leader,
        to_ready,
        served,
        failed,
    })
}

/// How long a single apiserver read of the bench may go unanswered before the run fails.
const APISERVER_ANSWER: Duration = Duration::from_secs(120);

/// The file server's artifact URLs of the first `programs` Programs, on loopback.
async fn artifact_urls(
    plane: &ControlPlane,
    port: u16,
    ns: &str,
    programs: usize,
) -> anyhow::Result<Vec<String>> {
    let api = self::programs(plane, ns)?;
    let mut urls = Vec::with_capacity(programs);
    for i in 0..programs {
        // kube's client sets no read timeout: a lost answer would stall the whole run (one run
        // stalled in this phase with no request to the file server open).
        let name = format!("p-{i:05}");
        let p = tokio::time::timeout(APISERVER_ANSWER, api.get(&name))
            .await
            .with_context(|| {
                format!("no answer to GET Program {name} in {APISERVER_ANSWER:?}")
            })??;
        let url = p
            .data
            .pointer("/status/artifact/url")
            .and_then(Value::as_str)
            .context("a Program without an artifact URL")?;
        let path = &url[url
            .find("/programs/")
            .context("an artifact URL without a path")?..];
        urls.push(format!("http://127.0.0.1:{port}{path}"));
    }
    Ok(urls)
}

async fn load_run(
    plane: &ControlPlane,
    op: &RunningPeer,
    ns: &str,
    programs: usize,
    connections: usize,
    seconds: u64,
) -> anyhow::Result<Load> {
    let urls = artifact_urls(plane, op.fs_port, ns, programs).await?;
    let load = http_load(urls, op.pid(), connections, seconds).await?;
    print_load(&load);
    Ok(load)
}

/// The same load against the bare HTTP server answering `bytes` bytes.
async fn bare_load(args: &Args, logs: &Path, bytes: usize) -> anyhow::Result<Load> {
    let port = pko_peer::free_port()?;
    let mut cmd = Command::new(std::env::current_exe()?);
    cmd.args([
        "serve-bare",
        "--port",
        &port.to_string(),
        "--bytes",
        &bytes.to_string(),
    ]);
    let server = spawn_guarded(cmd, "bare HTTP server", &logs.join("bare-http.log"))?;
    pko_tests::wait_for("the bare HTTP server", Duration::from_secs(10), || async {
        tokio::net::TcpStream::connect(("127.0.0.1", port))
            .await
            .ok()
            .map(|_| ())
    })
    .await?;
    let urls = (0..args.load_programs.max(1))
        .map(|i| format!("http://127.0.0.1:{port}/programs/bench/p-{i:05}/1"))
        .collect();
    let load = http_load(urls, server.pid(), args.connections, args.load_seconds).await?;
    print_load(&load);
    drop(server);
    Ok(load)
}

fn print_load(load: &Load) {
    println!(
        "   {} requests ({} errors), {:.0}/s, p50 {} p99 {}, CPU {:.1} µs/request, {} B bodies",
        load.requests,
        load.errors(),
        load.per_second(),
        micros(load.p50),
        micros(load.p99),
        load.cpu_per_request().as_secs_f64() * 1e6,
        load.body_bytes
    );
    for (kind, n) in &load.error_kinds {
        println!("   {n} failed: {kind}");
    }
}

/// A closed loop of GETs over `urls` (round-robin) on `connections` keep-alive connections
/// for `seconds`, after one warm-up pass; `pid`'s CPU time is taken over the loop only.
async fn http_load(
    urls: Vec<String>,
    pid: u32,
    connections: usize,
    seconds: u64,
) -> anyhow::Result<Load> {
    let urls = Arc::new(urls);
    let client = reqwest::Client::builder()
        .pool_max_idle_per_host(connections)
        .build()?;
    let mut body_bytes = 0usize;
    for url in urls.iter() {
        let resp = client.get(url).send().await?;
        if !resp.status().is_success() {
            bail!("GET {url}: {}", resp.status());
        }
        body_bytes += resp.bytes().await?.len();
    }
    let body_bytes = body_bytes / urls.len().max(1);
    let cpu0 = cpu(Some(pid));
    let deadline = Instant::now() + Duration::from_secs(seconds);
    let start = Instant::now();
    let mut workers = tokio::task::JoinSet::new();
    for w in 0..connections {
        let urls = urls.clone();
        let client = client.clone();
        workers.spawn(async move {
            let mut latencies = Vec::new();
            let mut errors = std::collections::BTreeMap::<String, u64>::new();
            let mut i = w;
            while Instant::now() < deadline {
                let url = &urls[i % urls.len()];
                i += connections;
                let t = Instant::now();
                let failed = match client.get(url).send().await {
                    Ok(resp) if resp.status() == 200 => resp
                        .bytes()
                        .await
                        .err()
                        .map(|e| format!("{:#}", anyhow::Error::new(e.without_url()))),
                    Ok(resp) => Some(format!("status {}", resp.status())),
                    Err(e) => Some(format!("{:#}", anyhow::Error::new(e.without_url()))),
                };
                if let Some(kind) = failed {
                    *errors.entry(kind).or_default() += 1;
                }
                latencies.push(t.elapsed());
            }
            (latencies, errors)
        });
    }
    let mut all = Vec::new();
    let mut error_kinds = std::collections::BTreeMap::<String, u64>::new();
    while let Some(done) = workers.join_next().await {
        let (lat, err) = done?;
        all.extend(lat);
        for (kind, n) in err {
            *error_kinds.entry(kind).or_default() += n;
        }
    }
    let elapsed = start.elapsed();
    let cpu_seconds = cpu(Some(pid)) - cpu0;
    all.sort_unstable();
    Ok(Load {
        requests: all.len() as u64,
        error_kinds,
        elapsed,
        p50: measure::percentile(&all, 0.50),
        p99: measure::percentile(&all, 0.99),
        max: all.last().copied().unwrap_or_default(),
        cpu_seconds,
        body_bytes,
    })
}

/// One line of the comparison table.
struct Row {
    measure: String,
    key: String,
    pko: String,
    ours: String,
    /// pko-rs's advantage: > 1 means pko-rs did better.
    advantage: f64,
    /// How the advantage was computed.
    way: Way,
    /// The advantage pko-rs aims for.
    goal: f64,
    /// Whether `make bench-check` guards it.
    guarded: bool,
    /// The shipped musl build's figure and what it costs over the glibc build's (> 1: more;
    /// none when the glibc figure is zero), where it ran.
    musl: Option<(String, Option<f64>)>,
}

/// Which way a measure is better.
#[derive(Clone, Copy)]
enum Way {
    /// Times, CPU and memory.
    Lower,
    /// Rates and shares.
    Higher,
}

impl Way {
    /// How the advantage is computed, as the table says it.
    fn label(self) -> &'static str {
        match self {
            Way::Lower => "PKO ÷ pko-rs",
            Way::Higher => "pko-rs ÷ PKO",
        }
    }
}

/// A figure of one run: its text, and its value for the ratios.
type Figure = (String, f64);

impl Row {
    /// A guarded row with the goal of its key; callers unguard the ones `bench-check` skips.
    fn new(
        measure: String,
        key: String,
        way: Way,
        (pko, pv): Figure,
        (ours, ov): Figure,
        musl: Option<Figure>,
    ) -> Row {
        let advantage = match way {
            Way::Lower => ratio_lower(pv, ov),
            Way::Higher => ratio_higher(pv, ov),
        };
        // What the shipped build costs: musl ÷ glibc for lower-is-better measures, glibc ÷
        // musl for rates, so above 1 it does worse either way.
        let musl = musl.map(|(text, mv)| {
            let cost = match way {
                Way::Lower => (ov > 0.0).then(|| mv / ov),
                Way::Higher => (mv > 0.0).then(|| ov / mv),
            };
            (text, cost)
        });
        Row {
            goal: goal(&key),
            measure,
            key,
            pko,
            ours,
            advantage,
            way,
            guarded: true,
            musl,
        }
    }

    /// `figure` of each operator's run of `r`.
    fn of(
        r: &CountRun,
        measure: String,
        key: String,
        way: Way,
        figure: impl Fn(&PeerRun) -> Figure,
    ) -> Row {
        Row::new(
            measure,
            key,
            way,
            figure(&r.pko),
            figure(&r.ours),
            r.musl.as_ref().map(figure),
        )
    }

    fn unguarded(self) -> Row {
        Row {
            guarded: false,
            ..self
        }
    }
}

fn ratio_lower(pko: f64, ours: f64) -> f64 {
    if ours > 0.0 {
        pko / ours
    } else {
        f64::INFINITY
    }
}

fn ratio_higher(pko: f64, ours: f64) -> f64 {
    if pko > 0.0 { ours / pko } else { f64::INFINITY }
}

/// The advantage a measure aims for: at most 0.7× PKO's apiserver CPU, at most a quarter of
/// its memory, at least as good as PKO everywhere else.
fn goal(key: &str) -> f64 {
    if key.starts_with("apiserver-cpu") {
        1.0 / 0.7
    } else if key.starts_with("peak-rss") {
        4.0
    } else {
        1.0
    }
}

fn seconds(d: Duration) -> Figure {
    (secs(d), d.as_secs_f64())
}

fn cpu_seconds(s: f64) -> Figure {
    (format!("{s:.2} s"), s)
}

fn rss(kib: u64) -> Figure {
    (mib(kib), kib as f64)
}

fn rows(runs: &[CountRun]) -> Vec<Row> {
    let mut rows = Vec::new();
    for r in runs {
        let n = r.count;
        let mut row = |measure: String, key: String, figure: fn(&PeerRun) -> Figure| {
            rows.push(Row::of(r, measure, key, Way::Lower, figure));
        };
        row(
            format!("reconcile, {n} created ({IN_FLIGHT} in flight): first create → all ready"),
            format!("reconcile-in-flight/{n}"),
            |p| seconds(p.in_flight.ready),
        );
        row(
            format!("per-Program create → ready p50, {n} in flight"),
            format!("program-ready-p50/{n}"),
            |p| seconds(p.in_flight.p50),
        );
        row(
            format!("per-Program create → ready p99, {n} in flight"),
            format!("program-ready-p99/{n}"),
            |p| seconds(p.in_flight.p99),
        );
        row(
            format!("operator CPU, {n} in flight"),
            format!("operator-cpu-in-flight/{n}"),
            |p| cpu_seconds(p.in_flight.operator_cpu),
        );
        row(
            format!("kube-apiserver CPU, {n} in flight"),
            format!("apiserver-cpu-in-flight/{n}"),
            |p| cpu_seconds(p.in_flight.apiserver_cpu),
        );
        row(
            format!("operator peak RSS, {n} in flight"),
            format!("peak-rss/{n}"),
            |p| rss(p.in_flight.peak_kib),
        );
        row(
            format!("backlog of {n}: operator spawn → all ready"),
            format!("backlog/{n}"),
            |p| seconds(p.backlog.ready),
        );
        row(
            format!("operator CPU, backlog of {n}"),
            format!("operator-cpu-backlog/{n}"),
            |p| cpu_seconds(p.backlog.operator_cpu),
        );
        row(
            format!("kube-apiserver CPU, backlog of {n}"),
            format!("apiserver-cpu-backlog/{n}"),
            |p| cpu_seconds(p.backlog.apiserver_cpu),
        );
        row(
            format!("operator peak RSS, backlog of {n}"),
            format!("peak-rss-backlog/{n}"),
            |p| rss(p.backlog.peak_kib),
        );
    }
    if let (Some(lo), Some(hi)) = (runs.first(), runs.last())
        && hi.count > lo.count
    {
        let per = |a: &PeerRun, b: &PeerRun| {
            let bytes = (b.in_flight.peak_kib.saturating_sub(a.in_flight.peak_kib) as f64 * 1024.0)
                / (hi.count - lo.count) as f64;
            (format!("{bytes:.0} B"), bytes)
        };
        rows.push(Row::new(
            format!(
                "peak RSS per added Program ({} → {}, in flight)",
                lo.count, hi.count
            ),
            format!("bytes-per-program/{}-{}", lo.count, hi.count),
            Way::Lower,
            per(&lo.pko, &hi.pko),
            per(&lo.ours, &hi.ours),
            // Only when the shipped build ran at both ends.
            lo.musl
                .as_ref()
                .zip(hi.musl.as_ref())
                .map(|(a, b)| per(a, b)),
        ));
    }
    if let Some(first) = runs.first() {
        rows.push(Row::of(
            first,
            format!(
                "start → ready (`/readyz` 200), no Programs, median of {}",
                first.ours.starts.len()
            ),
            "start-to-ready".into(),
            Way::Lower,
            |p| {
                let m = median(&p.starts);
                (millis(m), m.as_secs_f64())
            },
        ));
    }
    if let Some(first) = runs.first()
        && let (Some(p), Some(o)) = (&first.pko.failover, &first.ours.failover)
    {
        let m = first.musl.as_ref().and_then(|m| m.failover.as_ref());
        let to_leader = |f: &Failover| seconds(f.to_leader);
        let to_ready = |f: &Failover| seconds(f.to_ready);
        for (what, key, figure) in [
            (
                "standby leads",
                "failover-to-leader",
                &to_leader as &dyn Fn(&Failover) -> Figure,
            ),
            (
                "a Program created after the kill is ready",
                "failover-to-ready",
                &to_ready,
            ),
        ] {
            rows.push(
                Row::new(
                    format!(
                        "failover, 2 replicas, lease 15 s / 10 s / 2 s: leader kill -9 → {what}"
                    ),
                    key.into(),
                    Way::Lower,
                    figure(p),
                    figure(o),
                    m.map(figure),
                )
                .unguarded(),
            );
        }
        let served = |f: &Failover| {
            (
                format!("{} of {}", f.served, f.served + f.failed),
                f.served as f64 / (f.served + f.failed).max(1) as f64,
            )
        };
        rows.push(
            Row::new(
                "failover: artifacts the surviving replica served between the kill and the new Program ready".into(),
                "failover-served".into(),
                Way::Higher,
                served(p),
                served(o),
                m.map(served),
            )
            .unguarded(),
        );
    }
    for r in runs {
        rows.push(
            Row::of(
                r,
                format!(
                    "start → ready with {} ready Programs (one restart)",
                    r.count
                ),
                format!("restart-start-to-ready/{}", r.count),
                Way::Lower,
                |p| {
                    let d = p.restart.spawn_to_ready;
                    (millis(d), d.as_secs_f64())
                },
            )
            .unguarded(),
        );
    }
    for r in runs {
        rows.push(
            Row::of(
                r,
                format!(
                    "SIGTERM → exit with {} ready Programs (SIGKILL after {} s)",
                    r.count,
                    STOP_GRACE.as_secs()
                ),
                format!("sigterm-to-exit/{}", r.count),
                Way::Lower,
                |p| {
                    let d = p.restart.stop_took;
                    (millis(d), d.as_secs_f64())
                },
            )
            .unguarded(),
        );
    }
    if let Some(r) = runs.iter().find(|r| r.pko.load.is_some())
        && let (Some(p), Some(o)) = (&r.pko.load, &r.ours.load)
    {
        let m = r.musl.as_ref().and_then(|m| m.load.as_ref());
        let mut row = |measure: &str, key: &str, way, figure: fn(&Load) -> Figure| {
            rows.push(Row::new(
                measure.into(),
                key.into(),
                way,
                figure(p),
                figure(o),
                m.map(figure),
            ));
        };
        row(
            "file server requests/s",
            "fileserver-rps",
            Way::Higher,
            |l| (format!("{:.0}", l.per_second()), l.per_second()),
        );
        row("file server p50", "fileserver-p50", Way::Lower, |l| {
            (micros(l.p50), l.p50.as_secs_f64())
        });
        row("file server p99", "fileserver-p99", Way::Lower, |l| {
            (micros(l.p99), l.p99.as_secs_f64())
        });
        row(
            "file server CPU per request",
            "fileserver-cpu-per-request",
            Way::Lower,
            |l| {
                (
                    micros(l.cpu_per_request()),
                    l.cpu_seconds / l.requests.max(1) as f64,
                )
            },
        );
    }
    rows
}

fn report(
    args: &Args,
    runs: &[CountRun],
    bare: Option<&Load>,
    rows: &[Row],
    sections: &Sections,
    total: Duration,
) -> anyhow::Result<String> {
    let mut out = String::new();
    let w = &mut out;
    writeln!(w, "# Benchmarks\n")?;
    writeln!(
        w,
        "Measured by `make bench` (release build) on {} — {}, in {:.1} min; load average {} \
         when it ended. pko-rs and PKO v2.9.0 (its manager built from its source by `make pko`) \
         each run alone on a fresh private control plane (kube-apiserver + etcd built by \
         `tools/`, on loopback) with its own CRDs, both watching every namespace, leader \
         election off, logging warnings and errors only; the same client drives both with \
         the same load. The client, the operator, kube-apiserver and etcd share the \
         machine's cores.\n",
        jiff::Timestamp::now().strftime("%Y-%m-%d %H:%M UTC"),
        measure::machine(),
        total.as_secs_f64() / 60.0,
        measure::load_average(),
    )?;
    writeln!(w, "## pko-rs next to PKO v2.9.0\n")?;
    writeln!(
        w,
        "Every Program is a small YAML program (one `random:index:RandomString`); ready means \
         `status.artifact` is set for generation 1. *In flight*: the operator runs, then N \
         Programs are created with {IN_FLIGHT} creates in flight; the time runs from the first \
         create to the last artifact, per-Program times from each create's response to the \
         first status a watch sees with the artifact. *Backlog*: the N Programs exist before \
         the operator starts; the time runs from the operator's spawn. CPU is user + system \
         time from `/proc/<pid>/stat` over the run. *Advantage* is pko-rs's: PKO ÷ pko-rs \
         for times, CPU and memory, pko-rs ÷ PKO for rates, so above 1 pko-rs does better; \
         the goal is the advantage pko-rs aims for.{}\n",
        musl_text(args, runs)
    )?;
    let musl = runs.iter().any(|r| r.musl.is_some());
    if musl {
        writeln!(
            w,
            "| measure | PKO v2.9.0 | pko-rs | advantage | computed as | goal | met | {MUSL} | musl ÷ glibc |"
        )?;
        writeln!(w, "|---|---:|---:|---:|---|---:|---|---:|---:|")?;
    } else {
        writeln!(
            w,
            "| measure | PKO v2.9.0 | pko-rs | advantage | computed as | goal | met |"
        )?;
        writeln!(w, "|---|---:|---:|---:|---|---:|---|")?;
    }
    for r in rows {
        let third = match &r.musl {
            Some((text, Some(cost))) => format!(" {text} | {cost:.2} |"),
            Some((text, None)) => format!(" {text} | |"),
            None if musl => " – | |".to_owned(),
            None => String::new(),
        };
        writeln!(
            w,
            "| {} | {} | {} | {} | {} | ≥ {:.2}× | {} |{third}",
            r.measure,
            r.pko,
            r.ours,
            times(r.advantage),
            r.way.label(),
            r.goal,
            if r.advantage >= r.goal { "yes" } else { "no" },
        )?;
    }
    writeln!(w)?;

    writeln!(w, "### Status writes after a restart\n")?;
    writeln!(
        w,
        "The operator of the in-flight run is stopped (SIGTERM) and started again with every \
         Program ready; a watch from the last resourceVersion counts the Program writes \
         (MODIFIED events) until {} s pass without one after readiness. Goal: none.\n",
        args.quiet_seconds
    )?;
    if musl {
        writeln!(
            w,
            "| ready Programs | PKO v2.9.0 writes | last write after spawn | pko-rs writes | last write after spawn | {MUSL} writes | last write after spawn |"
        )?;
        writeln!(w, "|---:|---:|---:|---:|---:|---:|---:|")?;
    } else {
        writeln!(
            w,
            "| ready Programs | PKO v2.9.0 writes | last write after spawn | pko-rs writes | last write after spawn |"
        )?;
        writeln!(w, "|---:|---:|---:|---:|---:|")?;
    }
    for r in runs {
        let last = |r: &Restart| r.last_write.map(secs).unwrap_or_else(|| "—".into());
        let third = match &r.musl {
            Some(m) => format!(" {} | {} |", m.restart.writes, last(&m.restart)),
            None if musl => " – | – |".to_owned(),
            None => String::new(),
        };
        writeln!(
            w,
            "| {} | {} | {} | {} | {} |{third}",
            r.count,
            r.pko.restart.writes,
            last(&r.pko.restart),
            r.ours.restart.writes,
            last(&r.ours.restart)
        )?;
    }
    writeln!(w)?;

    writeln!(w, "### Reconcile figures in full\n")?;
    writeln!(
        w,
        "| Programs | operator | create ({IN_FLIGHT} in flight) | in flight: all ready | programs/s | backlog: all ready | programs/s |"
    )?;
    writeln!(w, "|---:|---|---:|---:|---:|---:|---:|")?;
    for r in runs {
        let mut each = vec![(Peer::Pko.label(), &r.pko), (Peer::PkoRs.label(), &r.ours)];
        if let Some(m) = &r.musl {
            each.push((MUSL, m));
        }
        for (label, p) in each {
            writeln!(
                w,
                "| {} | {label} | {} | {} | {:.0} | {} | {:.0} |",
                r.count,
                secs(p.in_flight.create),
                secs(p.in_flight.ready),
                r.count as f64 / p.in_flight.ready.as_secs_f64(),
                secs(p.backlog.ready),
                r.count as f64 / p.backlog.ready.as_secs_f64(),
            )?;
        }
    }
    writeln!(w)?;

    writeln!(w, "## Bare status patches: the apiserver's own rate\n")?;
    writeln!(
        w,
        "N status patches of existing Programs by the same client, {IN_FLIGHT} in flight, no \
         operator running (a fresh control plane with pko-rs's CRDs): the floor any \
         controller writing N statuses can reach here. Each patch sets `observedGeneration` \
         and an `artifact`; server-side apply (field manager `pko-bench`, forced) and JSON \
         merge patch each patch Programs of their own. The kube-apiserver CPU of the N creates \
         before them is shown too: what every Program costs the apiserver whoever reconciles it.\n"
    )?;
    writeln!(
        w,
        "| Programs | server-side apply | patches/s | apiserver CPU per apply | JSON merge patch | patches/s | apiserver CPU per merge patch | merge ÷ apply time | apiserver CPU per create |"
    )?;
    writeln!(w, "|---:|---:|---:|---:|---:|---:|---:|---:|---:|")?;
    for r in runs {
        let n = r.count as f64;
        let per = |cpu: f64| format!("{:.2} ms", cpu * 1000.0 / n);
        writeln!(
            w,
            "| {} | {} | {:.0} | {} | {} | {:.0} | {} | {:.2} | {} |",
            r.count,
            secs(r.patches.apply),
            n / r.patches.apply.as_secs_f64(),
            per(r.patches.apply_cpu),
            secs(r.patches.merge),
            n / r.patches.merge.as_secs_f64(),
            per(r.patches.merge_cpu),
            r.patches.merge.as_secs_f64() / r.patches.apply.as_secs_f64(),
            per(r.patches.create_cpu),
        )?;
    }
    writeln!(w)?;

    if let Some(r) = runs.iter().find(|r| r.pko.load.is_some())
        && let (Some(p), Some(o)) = (&r.pko.load, &r.ours.load)
    {
        writeln!(w, "## File server: GET of artifacts\n")?;
        writeln!(
            w,
            "{} Programs, {} keep-alive connections, {} s closed loop on loopback after one \
             warm-up pass, Programs requested round-robin. The bare server is a minimal \
             HTTP/1.1 keep-alive server (a process of its own, tokio, two threads) that \
             answers every request with the same {} bytes, the size of a pko-rs artifact: \
             what this machine and this client can do at most. CPU is the server process's \
             over the loop. The client stays below pko-rs's per-client connection cap (16 by \
             default, `--listener-max-connections-per-client`); connections over it are closed \
             at accept, and a request that fails is counted in *errors* with its cause below.\n",
            args.load_programs.min(r.count),
            args.connections,
            args.load_seconds,
            o.body_bytes
        )?;
        writeln!(
            w,
            "| server | body | requests | errors | requests/s | p50 | p99 | max | CPU per request |"
        )?;
        writeln!(w, "|---|---:|---:|---:|---:|---:|---:|---:|---:|")?;
        let mut line = |name: &str, l: &Load| {
            writeln!(
                w,
                "| {name} | {} B | {} | {} | {:.0} | {} | {} | {} | {} |",
                l.body_bytes,
                l.requests,
                l.errors(),
                l.per_second(),
                micros(l.p50),
                micros(l.p99),
                micros(l.max),
                micros(l.cpu_per_request()),
            )
        };
        let musl = r.musl.as_ref().and_then(|m| m.load.as_ref());
        let rows = [
            ("PKO v2.9.0", Some(p)),
            ("pko-rs", Some(o)),
            (MUSL, musl),
            ("bare HTTP server", bare),
        ];
        let rows = rows.iter().filter_map(|(name, l)| Some((*name, (*l)?)));
        for (name, l) in rows.clone() {
            line(name, l)?;
        }
        writeln!(w)?;
        let failures: Vec<String> = rows
            .flat_map(|(name, l)| {
                l.error_kinds
                    .iter()
                    .map(move |(kind, n)| format!("- {name}: {n} failed: {kind}\n"))
            })
            .collect();
        if !failures.is_empty() {
            writeln!(w, "{}", failures.concat())?;
        }
    }

    writeln!(w, "## Run sections and machine load\n")?;
    writeln!(
        w,
        "The 1-minute load average at the start and end of each section (the machine is shared; \
         compare the ratios of one run rather than absolute times across runs).\n"
    )?;
    writeln!(w, "| section | load at start | load at end | took |")?;
    writeln!(w, "|---|---:|---:|---:|")?;
    for s in &sections.0 {
        writeln!(
            w,
            "| {} | {} | {} | {} |",
            s.what,
            s.load_start,
            s.load_end,
            secs(s.took)
        )?;
    }
    writeln!(w)?;
    writeln!(w, "## Refreshing the baseline\n")?;
    writeln!(
        w,
        "`make bench` writes this file and `docs/bench-baseline.json`: pko-rs's advantage per \
         guarded measure. `make bench-check` reruns a short version (1,000 Programs only, \
         fewer starts) and fails, naming the ratio, when any advantage falls more than 25% below its \
         recorded value; absolute times are never compared. After a change that moves a ratio \
         on purpose, run `make bench` on a quiet machine and commit both files. Restart \
         writes, the single restart start and SIGTERM → exit are not guarded.\n"
    )?;
    Ok(out)
}

/// What the musl column is, for the table's text (empty without `--musl-operator`).
fn musl_text(args: &Args, runs: &[CountRun]) -> String {
    if args.musl.is_none() {
        return String::new();
    }
    let ran: Vec<String> = runs
        .iter()
        .filter(|r| r.musl.is_some())
        .map(|r| r.count.to_string())
        .collect();
    let at = if ran.len() == runs.len() {
        "at every count".to_owned()
    } else if ran.is_empty() {
        "at none of this run's counts".to_owned()
    } else {
        format!("at {} Programs only (`--musl-at`)", ran.join(", "))
    };
    format!(
        " *{MUSL}*: the static x86_64-unknown-linux-musl release binary `make dist` builds \
         and the images ship, run after the glibc build the same way, {at}: in flight, \
         backlog and restart, and the starts, the failover and the file-server load at the \
         count where the glibc build runs them, if it runs there (the bare status patches run \
         no operator; the bare HTTP server's load is the limit for both builds). *musl ÷ glibc* is its figure over the glibc \
         build's for times, CPU and memory, glibc ÷ musl for rates and shares, so above 1 the \
         shipped build costs more; – where it did not run. The advantage, the goal and the \
         baseline stay PKO next to the glibc build."
    )
}

/// Writes `report`, keeping the marked sections other benchmarks own (`<!-- … begin -->`).
fn write_report(out: &Path, mut report: String) -> anyhow::Result<()> {
    if let Ok(current) = std::fs::read_to_string(out)
        && let Some(start) = current.find("<!-- ")
    {
        report = format!("{}\n\n{}", report.trim_end(), &current[start..]);
    }
    std::fs::write(out, report).with_context(|| format!("writing {}", out.display()))
}

fn median(d: &[Duration]) -> Duration {
    let mut v = d.to_vec();
    v.sort_unstable();
    v.get(v.len() / 2).copied().unwrap_or_default()
}

fn times(r: f64) -> String {
    if r.is_finite() {
        format!("{r:.2}×")
    } else {
        "∞".into()
    }
}

fn secs(d: Duration) -> String {
    format!("{:.2} s", d.as_secs_f64())
}

fn millis(d: Duration) -> String {
    format!("{:.0} ms", d.as_secs_f64() * 1000.0)
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}

fn mib(kib: u64) -> String {
    format!("{:.1} MiB", kib as f64 / 1024.0)
}

fn micros(d: Duration) -> String {
    if d < Duration::from_millis(1) {
        format!("{:.1} µs", d.as_secs_f64() * 1e6)
    } else {
        format!("{:.2} ms", d.as_secs_f64() * 1000.0)
    }
}
