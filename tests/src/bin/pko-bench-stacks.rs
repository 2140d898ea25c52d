//! `make bench`, Stacks (issue 27): the path users run, Stack → Workspace → Update → pulumi,
//! pko-rs and PKO v2.9.0 side by side in the same run. Each operator runs alone on a fresh
//! private control plane with its own CRDs; the harness plays the kubelet (pko-rs's pods run
//! its agent, PKO's pods run PKO's own pod spec with PKO's agent, as the switch-over tests do),
//! with the same pulumi CLI, YAML host and `file://` backend. Per N (`--stacks`):
//! - N new `programRef` Stacks (one Program each) → all Ready: wall time, per-Stack p50/p99
//!   (create → first Ready status with its `up` succeeded, from a watch), Updates run;
//! - one Program edit → its Stack's new `up` done on its warm workspace, over `--edits` edits
//!   (round robin over the Stacks), p50/p99, with the operator's apiserver writes per `up`
//!   (from the audit log: each operator runs as a user of its own, impersonated);
//! - idle: operator RSS, and RSS per workspace (agent + what it started), idle and at its peak
//!   during the edits' `up`s;
//! - operator and kube-apiserver CPU per Stack deployed (the N new Stacks phase);
//! - operator restart (SIGTERM, a new process) with N Ready Stacks: spawn → every Stack and
//!   Workspace reconciled by the new process, nothing queued or running, all Ready; installs
//!   (each operator's own log line for a `pulumi install`) and Updates started;
//! - leader failover with N Ready Stacks: two replicas with leader election, the leader
//!   `kill -9`'d; → the standby leads, → it has reconciled every Stack and Workspace and all are
//!   Ready; installs and Updates started;
//! - the steady state over one `--idle-seconds` window (at the Ns of `--windows-at`), the first
//!   half of the Stacks with `continueResyncOnCommitMatch` off (the default), the second half
//!   with it on (and `resyncFrequencySeconds: 60`): per Stack per hour, Updates run, `pulumi`
//!   processes started below its agent, and the operator's apiserver writes to its objects.
//!
//! pko-rs's beyond-PKO phases, at the Ns of `--drift-at` and `--idle-at` (all when not given),
//! after the steady state: `--drift` measures one round of drift checks alone (every Stack on a schedule
//! of every minute: the tick → all finished, the check's mean duration, and per check the
//! operator's writes, `pulumi` processes and CPU); after the failover, `--idle` gives every
//! workspace `spec.idle`, times `--cold-starts` cold starts (20; each edit waits for its Stack's workspace to be
//! stopped first), then the RSS of the fleet with every workspace stopped, beside the
//! always-on fleets of both operators.
//!
//! `--musl-operator <path>` adds a third column: the static musl build the images ship
//! (`make dist`), run the same way as the glibc release build beside it (at the Ns of
//! `--musl-at`, or all).
//!
//! `--pulumi-calls` logs pko-rs's `pulumi` commands (a shell wrapper: not for figures) and
//! prints the last edit's and each steady-state window's: where its `pulumi` processes come from.
//!
//! `--pko-rs-only` runs pko-rs alone and prints its measures raw (a quick look; nothing written,
//! PKO not needed).
//!
//! `--short` runs N=3 with 3 edits and prints its table only (`make bench-check`, with `--check`
//! against the ratios `make bench` adds to docs/bench-baseline.json with `--write-baseline`).
//! Otherwise the section goes into `--out` (docs/benchmarks.md) between its markers, leaving
//! the rest of the file alone.
#![allow(
    clippy::disallowed_methods,
    reason = "a test process is configured by its environment (make sets the tool and fixture paths)"
)]

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use futures::StreamExt;
use k8s_openapi::api::coordination::v1::Lease;
use kube::api::{ListParams, Patch, PatchParams, PostParams};
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Api, Client, ResourceExt};
use pko_api::program::Program;
use pko_api::stack::Stack;
use pko_api::update::Update;
use pko_tests::bench_baseline::{Baseline, STACKS_PREFIX};
use pko_tests::kubelet::{AgentPids, ApiAccess, Kubelet, KubeletOptions, PodNetwork};
use pko_tests::measure::{self, percentile};
use pko_tests::pko_peer::{self, LeaseSettings, Peer, PeerBinaries, PeerOptions, RunningPeer};
use pko_tests::prom::{self, Labels};
use pko_tests::{ControlPlane, StartOptions, fixtures, kubeauth, wait_for};
use serde_json::{Value, json};

const BEGIN: &str = "<!-- stack benchmarks: begin -->";
const END: &str = "<!-- stack benchmarks: end -->";
/// How long one phase may take before the bench gives up.
const PHASE_TIMEOUT: Duration = Duration::from_secs(1800);
/// SIGTERM grace of the operator being restarted.
const STOP_GRACE: Duration = Duration::from_secs(30);
/// The user each operator runs as (impersonated, in `system:masters`): its requests in the
/// audit log.
const OPERATOR_USER: &str = "pko-bench-operator";
/// The controllers' names in both operators' metrics.
const STACKS: &str = "stack-controller";
const WORKSPACES: &str = "workspace-controller";
/// The shipped static build's column.
const MUSL: &str = "pko-rs musl (shipped)";
const WRITE_VERBS: [&str; 5] = ["create", "update", "patch", "delete", "deletecollection"];

struct Args {
    out: Option<PathBuf>,
    stacks: Vec<usize>,
    edits: usize,
    short: bool,
    /// Adds this run's ratios to a baseline file (`make bench`, after `pko-bench` wrote it).
    write_baseline: Option<PathBuf>,
    /// Fails when a ratio of this run falls more than `tolerance` below the baseline's.
    check: Option<PathBuf>,
    tolerance: f64,
    /// The steady-state window; 0 skips it.
    idle_seconds: u64,
    /// The Ns with a steady-state window (all of `--stacks` when empty).
    windows_at: Vec<usize>,
    /// The Ns of `--idle` and `--drift` (all of `--stacks` when empty).
    idle_at: Vec<usize>,
    drift_at: Vec<usize>,
    /// How many cold starts `--idle` times.
    cold_starts: usize,
    /// The shipped static (musl) `pko-operator`, measured beside the glibc release build.
    musl: Option<PathBuf>,
    /// The Ns the musl build runs at (all of `--stacks` when empty).
    musl_at: Vec<usize>,
    /// pko-rs's cold starts from an idle workspace (`spec.idle`), beside its warm edits.
    cold: bool,
    /// pko-rs's drift checks: one round's cost.
    drift: bool,
    /// pko-rs alone, its measures printed raw and nothing written (a quick look, no PKO build).
    pko_rs_only: bool,
    /// pko-rs's `pulumi` commands logged (through a shell wrapper, so not for figures), and
    /// each steady-state window's printed: where its processes come from.
    pulumi_calls: bool,
}

/// A comma-separated list of Ns.
fn ns(value: &str, flag: &str) -> anyhow::Result<Vec<usize>> {
    value
        .split(',')
        .map(|n| n.trim().parse::<usize>().with_context(|| flag.to_owned()))
        .collect()
}

fn parse_args() -> anyhow::Result<Args> {
    let mut args = Args {
        out: Some(PathBuf::from("docs/benchmarks.md")),
        stacks: vec![10, 50],
        edits: 20,
        short: false,
        write_baseline: None,
        check: None,
        tolerance: 0.25,
        idle_seconds: 600,
        windows_at: Vec::new(),
        idle_at: Vec::new(),
        drift_at: Vec::new(),
        cold_starts: 20,
        musl: None,
        musl_at: Vec::new(),
        cold: false,
        drift: false,
        pko_rs_only: false,
        pulumi_calls: false,
    };
    let mut out_given = false;
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        if flag == "--short" {
            args.short = true;
            continue;
        }
        if flag == "--idle" {
            args.cold = true;
            continue;
        }
        if flag == "--drift" {
            args.drift = true;
            continue;
        }
        if flag == "--pko-rs-only" {
            args.pko_rs_only = true;
            continue;
        }
        if flag == "--pulumi-calls" {
            args.pulumi_calls = true;
            continue;
        }
        let value = it.next().with_context(|| format!("{flag} needs a value"))?;
        match flag.as_str() {
            "--out" => {
                args.out = Some(PathBuf::from(value));
                out_given = true;
            }
            "--stacks" => {
                args.stacks = value
                    .split(',')
                    .map(|n| n.trim().parse::<usize>().context("--stacks"))
                    .collect::<anyhow::Result<_>>()?;
            }
            "--edits" => args.edits = value.parse().context("--edits")?,
            "--write-baseline" => args.write_baseline = Some(PathBuf::from(value)),
            "--check" => args.check = Some(PathBuf::from(value)),
            "--tolerance" => args.tolerance = value.parse().context("--tolerance")?,
            "--idle-seconds" => args.idle_seconds = value.parse().context("--idle-seconds")?,
            "--windows-at" => args.windows_at = ns(&value, "--windows-at")?,
            "--idle-at" => args.idle_at = ns(&value, "--idle-at")?,
            "--drift-at" => args.drift_at = ns(&value, "--drift-at")?,
            "--cold-starts" => args.cold_starts = value.parse().context("--cold-starts")?,
            "--musl-operator" => args.musl = Some(PathBuf::from(value)),
            "--musl-at" => args.musl_at = ns(&value, "--musl-at")?,
            other => bail!("unknown flag {other}"),
        }
    }
    if args.short {
        args.stacks = vec![3];
        args.edits = 3;
        args.idle_seconds = 0;
        if !out_given {
            args.out = None;
        }
    }
    if args.stacks.contains(&0) || args.edits == 0 {
        bail!("--stacks and --edits must be at least 1");
    }
    Ok(args)
}

/// One N's runs: PKO, pko-rs's glibc release build, and optionally the shipped musl build.
struct Trio {
    pko: PeerRun,
    ours: PeerRun,
    musl: Option<PeerRun>,
}

/// What one operator's run at one N measured.
#[derive(Debug, Default)]
struct PeerRun {
    n: usize,
    /// Create of the first Stack → every Stack deployed.
    all_ready: Duration,
    /// Each Stack's create → deployed.
    per_stack: Vec<Duration>,
    first_updates: usize,
    /// Each edit → its Stack's new `up` done.
    edits: Vec<Duration>,
    edit_updates: usize,
    /// The operator's apiserver writes over the edits, by resource.
    edit_writes: BTreeMap<String, usize>,
    operator_rss_kib: u64,
    /// Agent + what it started, per workspace.
    workspace_rss_kib: Vec<u64>,
    /// Spawn → every Stack and Workspace reconciled by the new process and Ready.
    restart: Duration,
    restart_installs: usize,
    restart_updates: usize,
    /// How each operator says it installs a workspace's program.
    installs_first: usize,
    /// Operator and kube-apiserver CPU seconds over the N new Stacks phase.
    operator_cpu_first: f64,
    apiserver_cpu_first: f64,
    /// Per edited workspace, its peak RSS (agent + children) during the edits.
    workspace_rss_up_kib: Vec<u64>,
    /// The steady state, resync on commit match off and on.
    idle_off: Option<Window>,
    idle_on: Option<Window>,
    failover: FailedOver,
    /// pko-rs's beyond-PKO phases: a round of drift checks, cold starts from idle workspaces,
    /// and the fleet's RSS once every workspace is stopped.
    drift: Option<DriftCost>,
    cold_starts: Vec<Duration>,
    fleet_idle_kib: Option<u64>,
}

/// What a steady-state window of `seconds` saw.
#[derive(Debug, Default, Clone)]
struct Window {
    seconds: f64,
    /// The Stacks it watched.
    stacks: usize,
    updates: usize,
    pulumi_started: usize,
    writes: usize,
}

impl Window {
    /// `count` per Stack per hour.
    fn per_stack_hour(&self, count: usize) -> f64 {
        if self.seconds <= 0.0 || self.stacks == 0 {
            return 0.0;
        }
        count as f64 / self.stacks as f64 * 3600.0 / self.seconds
    }
}

/// Deployed: `Ready=True` for the current generation, its last `up` succeeded; the last
/// Update's name.
fn deployed(stack: &Stack) -> Option<String> {
    let status = stack.status.as_ref()?;
    let last = status.last_update.as_ref()?;
    let ready = status.observed_generation == stack.metadata.generation
        && last.generation == stack.metadata.generation
        && status.current_update.is_none()
        && last.state.as_deref() == Some("succeeded")
        && status
            .conditions
            .iter()
            .any(|c| c.type_ == "Ready" && c.status == "True");
    ready.then(|| last.name.clone().unwrap_or_default())
}

/// What the watches saw: when each Stack was first seen deployed by each Update, and every
/// Update created.
#[derive(Default)]
struct Seen {
    deployed: HashMap<(String, String), Instant>,
    latest: HashMap<String, String>,
    updates: BTreeSet<String>,
}

#[derive(Clone, Default)]
struct Observer(Arc<Mutex<Seen>>);

impl Observer {
    fn start(client: &Client, ns: &str) -> (Self, Vec<tokio::task::JoinHandle<()>>) {
        let me = Self::default();
        let stacks: Api<Stack> = Api::namespaced(client.clone(), ns);
        let updates: Api<Update> = Api::namespaced(client.clone(), ns);
        let seen = me.clone();
        let a = tokio::spawn(async move {
            let mut events = watcher(stacks, watcher::Config::default())
                .default_backoff()
                .applied_objects()
                .boxed();
            while let Some(event) = events.next().await {
                let Ok(stack) = event else { continue };
                if let Some(update) = deployed(&stack) {
                    let now = Instant::now();
                    let mut s = seen.lock();
                    s.deployed
                        .entry((stack.name_any(), update.clone()))
                        .or_insert(now);
                    s.latest.insert(stack.name_any(), update);
                }
            }
        });
        let seen = me.clone();
        let b = tokio::spawn(async move {
            let mut events = watcher(updates, watcher::Config::default())
                .default_backoff()
                .applied_objects()
                .boxed();
            while let Some(event) = events.next().await {
                if let Ok(update) = event {
                    seen.lock().updates.insert(update.name_any());
                }
            }
        });
        (me, vec![a, b])
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Seen> {
        self.0.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn updates(&self) -> usize {
        self.lock().updates.len()
    }

    /// The Updates of `stacks` (each named `<stack>-…`).
    fn updates_of(&self, stacks: &[String]) -> usize {
        let s = self.lock();
        s.updates
            .iter()
            .filter(|u| stacks.iter().any(|st| named_after(u, st)))
            .count()
    }

    fn latest(&self, stack: &str) -> Option<String> {
        self.lock().latest.get(stack).cloned()
    }

    /// When `stack` was first deployed by an Update other than `not`.
    fn deployed_other_than(&self, stack: &str, not: Option<&str>) -> Option<Instant> {
        let s = self.lock();
        s.deployed
            .iter()
            .filter(|((name, update), _)| name == stack && Some(update.as_str()) != not)
            .map(|(_, at)| *at)
            .min()
    }

    fn deployed_count(&self, stacks: &[String]) -> usize {
        let s = self.lock();
        stacks.iter().filter(|n| s.latest.contains_key(*n)).count()
    }
}

fn stack_name(i: usize) -> String {
    format!("s{i:03}")
}

fn program(i: usize, edit: usize) -> Value {
    json!({
        "configuration": {"greeting": {"type": "String"}},
        "outputs": {"message": format!("${{greeting}}-{i}-{edit}")},
    })
}

/// A copy of the plane's kubeconfig impersonating [`OPERATOR_USER`] in `system:masters`.
fn operator_kubeconfig(plane: &ControlPlane, out: &Path) -> anyhow::Result<PathBuf> {
    let text = std::fs::read_to_string(plane.kubeconfig_path())?;
    let mut config: Value = yaml_serde::from_str(&text)?;
    for entry in config["users"].as_array_mut().context("kubeconfig users")? {
        entry["user"]["as"] = json!(OPERATOR_USER);
        entry["user"]["as-groups"] = json!(["system:masters"]);
    }
    std::fs::write(out, yaml_serde::to_string(&config)?)?;
    Ok(out.to_path_buf())
}

/// The operator's writes in the audit log after line `from`, by resource(/subresource); each
/// one (time, verb, resource, name) is listed in `trace`.
/// The operator's apiserver writes from line `from` of the audit log on, by resource.
fn operator_writes(audit: &Path, from: usize, trace: &Path) -> BTreeMap<String, usize> {
    let mut by = BTreeMap::new();
    for (resource, _) in operator_writes_to(audit, from, trace) {
        *by.entry(resource).or_default() += 1;
    }
    by
}

/// The operator's apiserver writes from line `from` of the audit log on, each as (resource,
/// object name); listed in `trace` with their times and verbs.
fn operator_writes_to(audit: &Path, from: usize, trace: &Path) -> Vec<(String, String)> {
    let text = std::fs::read_to_string(audit).unwrap_or_default();
    let mut writes = Vec::new();
    let mut listed = String::new();
    for line in text.lines().skip(from) {
        let Ok(e) = serde_json::from_str::<Value>(line) else {
            continue;
        };
        if e["impersonatedUser"]["username"] != OPERATOR_USER {
            continue;
        }
        let verb = e["verb"].as_str().unwrap_or_default();
        if !WRITE_VERBS.contains(&verb) {
            continue;
        }
        let r = &e["objectRef"];
        let mut resource = r["resource"].as_str().unwrap_or("?").to_owned();
        if let Some(sub) = r["subresource"].as_str() {
            resource = format!("{resource}/{sub}");
        }
        let name = r["name"].as_str().unwrap_or_default().to_owned();
        let _ = writeln!(
            listed,
            "{} {verb} {resource} {name}",
            e["requestReceivedTimestamp"].as_str().unwrap_or_default(),
        );
        writes.push((resource, name));
    }
    let _ = std::fs::write(trace, listed);
    writes
}

fn audit_lines(audit: &Path) -> usize {
    std::fs::read_to_string(audit)
        .map(|t| t.lines().count())
        .unwrap_or(0)
}

/// One reading of /proc: each process's parent, name and start time (clock ticks since boot,
/// so a reused pid is a different process).
struct Procs {
    parent: HashMap<u32, u32>,
    children: HashMap<u32, Vec<u32>>,
    comm: HashMap<u32, String>,
    start: HashMap<u32, u64>,
}

impl Procs {
    fn read() -> Self {
        let mut me = Procs {
            parent: HashMap::new(),
            children: HashMap::new(),
            comm: HashMap::new(),
            start: HashMap::new(),
        };
        let Ok(entries) = std::fs::read_dir("/proc") else {
            return me;
        };
        for entry in entries.flatten() {
            let Some(pid) = entry.file_name().to_str().and_then(|n| n.parse().ok()) else {
                continue;
            };
            let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
                continue;
            };
            let (Some(open), Some(close)) = (stat.find('('), stat.rfind(')')) else {
                continue;
            };
            // After the name: state (0), ppid (1), ... starttime (19).
            let rest: Vec<&str> = stat[close + 1..].split_whitespace().collect();
            if let Some(parent) = rest.get(1).and_then(|p| p.parse::<u32>().ok()) {
                me.parent.insert(pid, parent);
                me.children.entry(parent).or_default().push(pid);
            }
            if let Some(start) = rest.get(19).and_then(|t| t.parse::<u64>().ok()) {
                me.start.insert(pid, start);
            }
            me.comm.insert(pid, stat[open + 1..close].to_owned());
        }
        me
    }

    /// `pid` and every process below it.
    fn tree(&self, pid: u32) -> Vec<u32> {
        let mut out = Vec::new();
        let mut todo = vec![pid];
        while let Some(p) = todo.pop() {
            out.push(p);
            todo.extend(self.children.get(&p).into_iter().flatten());
        }
        out
    }

    /// Resident memory of `pid` and every process below it, in KiB.
    fn tree_rss_kib(&self, pid: u32) -> u64 {
        self.tree(pid)
            .into_iter()
            .map(|p| measure::proc_status_kib(p, "VmRSS").unwrap_or(0))
            .sum()
    }

    /// The `pulumi` CLI processes below any of `agents`, as (pid, start time).
    fn pulumi_below(&self, agents: &HashSet<u32>) -> Vec<(u32, u64)> {
        agents
            .iter()
            .flat_map(|&a| self.tree(a))
            .filter(|p| self.comm.get(p).is_some_and(|c| c == "pulumi"))
            .map(|p| (p, self.start.get(&p).copied().unwrap_or(0)))
            .collect()
    }
}

fn tree_rss_kib(pid: u32) -> u64 {
    Procs::read().tree_rss_kib(pid)
}

/// Samples each workspace's tree RSS (its agent and every process below it) every 50 ms until
/// finished, keeping each one's peak: the workspaces' memory during their `up`s. The agent is
/// looked up by workspace on every tick: a Program edit rolls the pod, so the `up` runs in an
/// agent started after the sampler (sampling the pids seen at the start read processes gone by
/// then, and reported nothing).
struct PeakSampler {
    stop: Arc<std::sync::atomic::AtomicBool>,
    thread: Option<std::thread::JoinHandle<HashMap<String, u64>>>,
}

impl PeakSampler {
    fn start(agents: AgentPids, workspaces: Vec<String>) -> Self {
        let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let flag = stop.clone();
        let thread = std::thread::spawn(move || {
            let mut peak: HashMap<String, u64> = HashMap::new();
            while !flag.load(std::sync::atomic::Ordering::Relaxed) {
                let procs = Procs::read();
                for ws in &workspaces {
                    let Some(pid) = agents.pid(ws) else {
                        continue;
                    };
                    let rss = procs.tree_rss_kib(pid);
                    let e = peak.entry(ws.clone()).or_default();
                    *e = (*e).max(rss);
                }
                std::thread::sleep(Duration::from_millis(50));
            }
            peak
        });
        Self {
            stop,
            thread: Some(thread),
        }
    }

    fn finish(mut self) -> HashMap<String, u64> {
        self.stop.store(true, std::sync::atomic::Ordering::Relaxed);
        self.thread
            .take()
            .and_then(|t| t.join().ok())
            .unwrap_or_default()
    }
}

/// What a controller has done and is doing, from an operator's `/metrics`.
#[derive(Debug, Clone, Copy)]
struct Progress {
    reconciles: f64,
    busy: f64,
}

fn progress(text: &str, controller: &str) -> Progress {
    let of = |l: &Labels| l.is("controller", controller) || l.is("name", controller);
    Progress {
        reconciles: prom::scrape_sum(text, "controller_runtime_reconcile_total", of),
        busy: prom::scrape_sum(text, "workqueue_depth", of)
            + prom::scrape_sum(text, "controller_runtime_active_workers", of),
    }
}

async fn metrics_text(op: &RunningPeer) -> Option<String> {
    let url = format!("http://127.0.0.1:{}/metrics", op.metrics_port);
    let resp = reqwest::get(url).await.ok()?;
    resp.status()
        .is_success()
        .then_some(resp)?
        .text()
        .await
        .ok()
}

/// How often [`quiet`] reads the metrics: the restart and failover times are read off it, so
/// at a fixed fine step (not `wait_for`'s backoff, whose 500 ms steps would be the figure).
const QUIET_POLL: Duration = Duration::from_millis(25);

/// Waits until both controllers have run at least `n` reconciles each (since the process
/// started) and have nothing queued or running.
async fn quiet(op: &RunningPeer, n: usize, what: &str) -> anyhow::Result<()> {
    let deadline = Instant::now() + PHASE_TIMEOUT;
    loop {
        if let Some(text) = metrics_text(op).await {
            let s = progress(&text, STACKS);
            let w = progress(&text, WORKSPACES);
            if s.reconciles >= n as f64
                && w.reconciles >= n as f64
                && s.busy == 0.0
                && w.busy == 0.0
            {
                return Ok(());
            }
        }
        if Instant::now() > deadline {
            bail!(
                "timed out after {PHASE_TIMEOUT:?} waiting for {what}\n{}",
                op.log_tail(40)
            );
        }
        tokio::time::sleep(QUIET_POLL).await;
    }
}

/// The line each operator logs when it runs `pulumi install` for a workspace.
fn install_line(peer: Peer) -> &'static str {
    match peer {
        Peer::Pko => "Running pulumi install",
        Peer::PkoRs => "workspace initialized",
    }
}

fn count_in(log: &Path, line: &str) -> usize {
    std::fs::read_to_string(log)
        .map(|t| t.matches(line).count())
        .unwrap_or(0)
}

/// What one peer run does beyond its fixed phases.
#[derive(Clone, Copy)]
struct Plan {
    /// Program edits, each a warm `up`.
    edits: usize,
    /// Each steady-state window; zero skips them.
    idle: Duration,
    /// `--idle`: cold starts from idle workspaces (pko-rs only).
    cold: bool,
    /// `--pulumi-calls`.
    pulumi_calls: bool,
    /// `--drift` at this N.
    drift: bool,
    /// How many cold starts `cold` times.
    cold_starts: usize,
}

async fn peer_run(
    bins: &PeerBinaries,
    peer: Peer,
    label: &str,
    n: usize,
    plan: Plan,
    logs: &Path,
) -> anyhow::Result<PeerRun> {
    let Plan {
        edits,
        idle,
        cold,
        pulumi_calls,
        drift,
        cold_starts: cold_count,
    } = plan;
    let log = |what: &str| logs.join(format!("{}-{n}-{what}.log", slug(label)));
    let plane = ControlPlane::start(StartOptions {
        crds_dir: Some(bins.crds_dir(peer).to_path_buf()),
        audit_log: true,
        ..StartOptions::default()
    })
    .await?;
    let client = plane.try_client()?;
    let system = plane.namespace("operator-system").await?;
    let ns = plane.namespace("bench-stacks").await?;
    let tmp = tempfile::Builder::new()
        .prefix("pko-bench-stacks-")
        .tempdir()?;
    let backend = tmp.path().join("backend");
    std::fs::create_dir_all(&backend)?;
    let kubeconfig = operator_kubeconfig(&plane, &tmp.path().join("operator-kubeconfig"))?;
    let mut kubelet_options = KubeletOptions {
        api: Some(ApiAccess::of(&plane)),
        log_pulumi_calls: pulumi_calls,
        ..KubeletOptions::default()
    };
    let mut opts = PeerOptions {
        kubeconfig: Some(kubeconfig),
        info_log: true,
        ..PeerOptions::default()
    };
    match peer {
        Peer::Pko => {
            // PKO's install: its manager's account, and workspace pods whose agent reviews
            // the manager's tokens; its manager dials `<ws>-workspace.<ns>:50051`.
            pko_peer::install_manager_identity(&client, &system).await?;
            kubeauth::service_account(&client, &ns, "default").await?;
            kubeauth::bind_auth_delegator(&client, &ns, "default").await?;
            kubelet_options.network = PodNetwork::Cluster;
            opts.cluster_dns = true;
        }
        Peer::PkoRs => {
            opts.args = vec!["--workspace-localhost=127.0.0.1".into()];
        }
    }
    let kubelet = Kubelet::start_with(
        client.clone(),
        &ns,
        &tmp.path().join("pods"),
        kubelet_options,
    )?;
    let first_log = log("first");
    let mut op = pko_peer::start_with(peer, bins, &plane, &system, &first_log, &opts).await?;
    let (observer, watches) = Observer::start(&client, &ns);
    let programs: Api<Program> = Api::namespaced(client.clone(), &ns);
    let stacks: Api<Stack> = Api::namespaced(client.clone(), &ns);
    let names: Vec<String> = (0..n).map(stack_name).collect();
    let pp = PostParams::default();
    for (i, name) in names.iter().enumerate() {
        programs
            .create(&pp, &fixtures::program(name, program(i, 0)))
            .await?;
    }
    wait_for("every Program's artifact", PHASE_TIMEOUT, || async {
        let list = programs.list(&ListParams::default()).await.ok()?;
        let ready = list
            .items
            .iter()
            .filter(|p| p.status.as_ref().is_some_and(|s| s.artifact.is_some()))
            .count();
        (ready == n).then_some(())
    })
    .await
    .with_context(|| op.log_tail(40))?;

    // N new Stacks → all Ready.
    println!("   {label}: {n} Stacks");
    let apiserver =
        pko_peer::plane_pid(&plane, "kube-apiserver").context("kube-apiserver's pid")?;
    let cpu = |pid: u32| pko_peer::cpu_seconds(pid).unwrap_or(0.0);
    let (op_cpu0, api_cpu0) = (cpu(op.pid()), cpu(apiserver));
    let started = Instant::now();
    let mut created = Vec::new();
    for (i, name) in names.iter().enumerate() {
        let spec = json!({"programRef": {"name": name}, "config": {"greeting": format!("g{i}")}});
        created.push(Instant::now());
        stacks
            .create(&pp, &fixtures::file_backend_stack(name, &backend, spec))
            .await?;
    }
    if let Err(e) = wait_for("every Stack deployed", PHASE_TIMEOUT, || async {
        (observer.deployed_count(&names) == n).then_some(())
    })
    .await
    {
        bail!("{e}\n{}\n{}", op.log_tail(40), kubelet.logs(&names[0]));
    }
    let all_ready = started.elapsed();
    let operator_cpu_first = cpu(op.pid()) - op_cpu0;
    let apiserver_cpu_first = cpu(apiserver) - api_cpu0;
    let mut per_stack = Vec::new();
    for (name, at) in names.iter().zip(&created) {
        let done = observer
            .deployed_other_than(name, None)
            .context("a deployed Stack")?;
        per_stack.push(done.saturating_duration_since(*at));
    }
    let first_updates = observer.updates();
    let installs_first = count_in(&first_log, install_line(peer));

    // Edits: one Program at a time, its Stack's new `up` on a warm workspace.
    println!("   {label}: {edits} edits");
    let audit = plane.audit_log();
    let audit_from = audit_lines(&audit);
    let updates_before = observer.updates();
    let sampler = PeakSampler::start(kubelet.agents(), names.clone());
    let mut edited = BTreeSet::new();
    let mut edit_times = Vec::new();
    for k in 0..edits {
        let i = k % n;
        let name = &names[i];
        let before = observer.latest(name);
        let patch = json!({"program": program(i, k + 1)});
        let at = Instant::now();
        let wall = unix_now();
        programs
            .patch(name, &PatchParams::default(), &Patch::Merge(&patch))
            .await?;
        let done = wait_for(
            &format!("Stack {name}'s up after edit {k}"),
            PHASE_TIMEOUT,
            || async { observer.deployed_other_than_after(name, before.as_deref(), at) },
        )
        .await
        .with_context(|| format!("{}\n{}", op.log_tail(40), kubelet.logs(name)))?;
        edit_times.push(done.saturating_duration_since(at));
        edited.insert(name.clone());
        // The last edit's calls: what one edit costs in CLI processes, offset from the edit.
        if pulumi_calls && k + 1 == edits {
            println!(
                "   {label}: the last edit's pulumi calls (s after the edit; done at {:.2} s)",
                done.saturating_duration_since(at).as_secs_f64()
            );
            for call in kubelet.pulumi_calls(name) {
                if let Some((t, rest)) = call.split_once(' ')
                    && let Ok(t) = t.parse::<f64>()
                    && t >= wall
                {
                    println!("     +{:.2} {rest}", t - wall);
                }
            }
        }
    }
    let peaks = sampler.finish();
    let workspace_rss_up_kib = edited
        .iter()
        .filter_map(|a| peaks.get(a).copied())
        .collect();
    let edit_updates = observer.updates() - updates_before;
    let edit_writes = operator_writes(&audit, audit_from, &log("edit-writes"));

    // Idle memory, once nothing is queued or running.
    quiet(&op, n, "the operator idle after the edits").await?;
    let operator_rss_kib = tree_rss_kib(op.pid());
    let workspace_rss_kib = names
        .iter()
        .filter_map(|name| kubelet.agent_pid(name))
        .map(tree_rss_kib)
        .collect();

    // Restart with N Ready Stacks.
    println!("   {label}: restart");
    let fs_port = op.fs_port;
    op.stop(STOP_GRACE);
    let updates_before = observer.updates();
    let restart_log = log("restart");
    let mut restarted = pko_peer::start_with(
        peer,
        bins,
        &plane,
        &system,
        &restart_log,
        &PeerOptions {
            fs_port: Some(fs_port),
            ..opts.clone()
        },
    )
    .await?;
    quiet(&restarted, n, "every Stack and Workspace reconciled again").await?;
    let reready = stacks
        .list(&ListParams::default())
        .await?
        .items
        .iter()
        .filter(|s| deployed(s).is_some())
        .count();
    if reready != n {
        bail!("{reready} of {n} Stacks Ready after the restart");
    }
    let restart = restarted.spawned.elapsed();
    let restart_installs = count_in(&restart_log, install_line(peer));
    let restart_updates = observer.updates() - updates_before;

    // The steady state, one window for both settings: the first half of the Stacks keeps
    // resync on commit match off (the default), the second half turns it on.
    let (mut idle_off, mut idle_on) = (None, None);
    if !idle.is_zero() {
        let (off, on) = names.split_at(n / 2);
        let patch =
            json!({"spec": {"continueResyncOnCommitMatch": true, "resyncFrequencySeconds": 60}});
        for name in on {
            stacks
                .patch(name, &PatchParams::default(), &Patch::Merge(&patch))
                .await?;
        }
        all_settled(&stacks, "every Stack Ready with its resync setting")
            .await
            .with_context(|| restarted.log_tail(40))?;
        println!(
            "   {label}: {} s steady, resync on commit match off for {} Stacks, on for {}",
            idle.as_secs(),
            off.len(),
            on.len()
        );
        let steady = Steady {
            op: &restarted,
            observer: &observer,
            kubelet: &kubelet,
            audit: &audit,
            pulumi_calls,
        };
        let [w_off, w_on] = steady.window(idle, [off, on]).await;
        (idle_off, idle_on) = (Some(w_off), Some(w_on));
        // Back to the default, so the resyncs do not run through the phases after.
        let patch =
            json!({"spec": {"continueResyncOnCommitMatch": null, "resyncFrequencySeconds": null}});
        for name in on {
            stacks
                .patch(name, &PatchParams::default(), &Patch::Merge(&patch))
                .await?;
        }
        all_settled(&stacks, "every Stack Ready with resync off again")
            .await
            .with_context(|| restarted.log_tail(40))?;
    }
    let drift = if drift && peer == Peer::PkoRs {
        println!("   {label}: drift checks");
        Some(
            DriftPhase {
                stacks: &stacks,
                names: &names,
                kubelet: &kubelet,
                op: &restarted,
                audit: &audit,
                apiserver,
            }
            .run()
            .await?,
        )
    } else {
        None
    };
    // Leader failover with N Ready Stacks.
    println!("   {label}: leader failover");
    restarted.stop(STOP_GRACE);
    drop(restarted);
    // The standby, leading now, runs the phases after.
    let (failover, leader, service) = Failover {
        bins,
        peer,
        plane: &plane,
        system: &system,
        opts: &opts,
        fs_port,
        observer: &observer,
        stacks: &stacks,
        n,
    }
    .run(&log("failover"))
    .await?;
    let (mut cold_starts, mut fleet_idle_kib) = (Vec::new(), None);
    if cold && peer == Peer::PkoRs {
        println!("   {label}: {cold_count} cold starts from idle workspaces");
        let starts = Cold {
            programs: &programs,
            stacks: &stacks,
            workspaces: &Api::namespaced(client.clone(), &ns),
            observer: &observer,
            kubelet: &kubelet,
            names: &names,
            op: &leader,
        }
        .run(cold_count)
        .await?;
        let (cold, warm) = (sorted(&starts.0), sorted(&edit_times));
        println!(
            "   {label}: cold start (Program edit on an idle workspace → up done) p50 {}, p99 {}; warm edit p50 {}",
            secs(percentile(&cold, 0.5)),
            secs(percentile(&cold, 0.99)),
            secs(percentile(&warm, 0.5))
        );
        (cold_starts, fleet_idle_kib) = (starts.0, Some(starts.1));
    }
    for w in watches {
        w.abort();
    }
    service.abort();
    drop(leader);
    drop(kubelet);
    Ok(PeerRun {
        n,
        all_ready,
        per_stack,
        first_updates,
        edits: edit_times,
        edit_updates,
        edit_writes,
        operator_rss_kib,
        workspace_rss_kib,
        restart,
        restart_installs,
        restart_updates,
        installs_first,
        operator_cpu_first,
        apiserver_cpu_first,
        workspace_rss_up_kib,
        idle_off,
        idle_on,
        failover,
        drift,
        cold_starts,
        fleet_idle_kib,
    })
}

/// A Service's stand-in: loopback port `listen` (the killed leader's file server, which every
/// artifact URL names) forwarded to port `to`, so a pod started later fetches its program.
async fn forward(listen: u16, to: u16) -> anyhow::Result<tokio::task::JoinHandle<()>> {
    // The killed process's socket is closed once it has exited; give that a moment.
    let listener = wait_for("the killed leader's port free", STOP_GRACE, || async {
        tokio::net::TcpListener::bind(("127.0.0.1", listen))
            .await
            .ok()
    })
    .await?;
    Ok(tokio::spawn(async move {
        while let Ok((mut inbound, _)) = listener.accept().await {
            tokio::spawn(async move {
                if let Ok(mut outbound) = tokio::net::TcpStream::connect(("127.0.0.1", to)).await {
                    let _ = tokio::io::copy_bidirectional(&mut inbound, &mut outbound).await;
                }
            });
        }
    }))
}

/// Waits until every Stack is Ready for its generation with no Update in flight.
async fn all_settled(stacks: &Api<Stack>, what: &str) -> anyhow::Result<()> {
    wait_for(what, PHASE_TIMEOUT, || async {
        let list = stacks.list(&ListParams::default()).await.ok()?;
        list.items.iter().all(settled).then_some(())
    })
    .await?;
    Ok(())
}

/// Ready for its generation, with no Update in flight.
fn settled(s: &Stack) -> bool {
    s.status.as_ref().is_some_and(|st| {
        st.observed_generation == s.metadata.generation
            && st.current_update.is_none()
            && st
                .conditions
                .iter()
                .any(|c| c.type_ == "Ready" && c.status == "True")
    })
}

/// `--drift`: what a round of drift checks costs pko-rs. Every Stack gets a schedule of every
/// minute; the first round (due at once) and the new generation's `up`s are let finish, then
/// the next tick's round is measured alone: nothing else runs.
struct DriftPhase<'a> {
    stacks: &'a Api<Stack>,
    names: &'a [String],
    kubelet: &'a Kubelet,
    op: &'a RunningPeer,
    audit: &'a Path,
    apiserver: u32,
}

/// One round of drift checks, measured.
#[derive(Debug, Default, Clone)]
struct DriftCost {
    checks: usize,
    /// The tick → every check of it finished.
    round: Duration,
    /// Start → end of a check, the mean (the operator's histogram).
    mean_check: f64,
    writes: usize,
    pulumi: usize,
    operator_cpu: f64,
    apiserver_cpu: f64,
}

const EVERY_MINUTE: &str = "* * * * *";

impl DriftPhase<'_> {
    /// Whether every Stack is settled with a finished check that started at `since` or later.
    async fn checked_since(&self, since: k8s_openapi::jiff::Timestamp) -> bool {
        let Ok(list) = self.stacks.list(&ListParams::default()).await else {
            return false;
        };
        list.items.len() == self.names.len()
            && list.items.iter().all(|s| {
                let d = s.status.as_ref().and_then(|st| st.drift_detection.as_ref());
                settled(s)
                    && d.is_some_and(|d| {
                        d.current_check.is_none()
                            && d.last_check.is_some()
                            && d.last_check_time.as_ref().is_some_and(|t| t.0 >= since)
                    })
            })
    }

    async fn histogram(&self) -> (f64, f64) {
        let text = metrics_text(self.op).await.unwrap_or_default();
        let all = |_: &Labels| true;
        (
            prom::scrape_sum(&text, "pko_drift_check_duration_seconds_sum", all),
            prom::scrape_sum(&text, "pko_drift_check_duration_seconds_count", all),
        )
    }

    async fn run(&self) -> anyhow::Result<DriftCost> {
        use k8s_openapi::jiff::{SignedDuration, Timestamp};
        let set = |cron: Option<&str>| match cron {
            Some(cron) => json!({"spec": {"driftDetection": {"schedules": [{"cron": cron}]}}}),
            None => json!({"spec": {"driftDetection": null}}),
        };
        let began = Timestamp::now();
        for name in self.names {
            self.stacks
                .patch(
                    name,
                    &PatchParams::default(),
                    &Patch::Merge(&set(Some(EVERY_MINUTE))),
                )
                .await?;
        }
        // The round due at once: the Stacks are older than the last tick.
        let first = began
            .checked_sub(SignedDuration::from_secs(began.as_second().rem_euclid(60)))
            .unwrap_or(began);
        wait_for("the first round of drift checks", PHASE_TIMEOUT, || async {
            self.checked_since(first).await.then_some(())
        })
        .await
        .with_context(|| self.op.log_tail(40))?;
        // The next tick with at least 3 s to spare, waited for: the round is measured from it.
        let now = Timestamp::now().as_second();
        let mut tick = now - now.rem_euclid(60) + 60;
        if tick - now < 3 {
            tick += 60;
        }
        let tick_at = Instant::now() + Duration::from_secs((tick - now - 2).max(0) as u64);
        tokio::time::sleep_until(tick_at.into()).await;
        let from = audit_lines(self.audit);
        let cpu = |pid: u32| pko_peer::cpu_seconds(pid).unwrap_or(0.0);
        let (op0, api0) = (cpu(self.op.pid()), cpu(self.apiserver));
        let (sum0, count0) = self.histogram().await;
        let agents: HashSet<u32> = self
            .names
            .iter()
            .filter_map(|n| self.kubelet.agent_pid(n))
            .collect();
        let tick_ts = Timestamp::from_second(tick).unwrap_or(Timestamp::now());
        let mut pulumi = HashSet::new();
        let deadline = Instant::now() + PHASE_TIMEOUT;
        let finished = loop {
            pulumi.extend(Procs::read().pulumi_below(&agents));
            if Timestamp::now() >= tick_ts && self.checked_since(tick_ts).await {
                break Instant::now();
            }
            if Instant::now() > deadline {
                bail!(
                    "the drift checks of the tick did not finish\n{}",
                    self.op.log_tail(40)
                );
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        };
        let round = finished.saturating_duration_since(tick_at + Duration::from_secs(2));
        let (sum1, count1) = self.histogram().await;
        let writes = operator_writes_to(self.audit, from, &self.audit.with_extension("drift"));
        let cost = DriftCost {
            checks: (count1 - count0).max(0.0) as usize,
            round,
            mean_check: (sum1 - sum0) / (count1 - count0).max(1.0),
            writes: writes.len(),
            pulumi: pulumi.len(),
            operator_cpu: cpu(self.op.pid()) - op0,
            apiserver_cpu: cpu(self.apiserver) - api0,
        };
        println!("   drift checks: {cost:?}");
        for name in self.names {
            self.stacks
                .patch(name, &PatchParams::default(), &Patch::Merge(&set(None)))
                .await?;
        }
        all_settled(self.stacks, "every Stack Ready without drift detection")
            .await
            .with_context(|| self.op.log_tail(40))?;
        Ok(cost)
    }
}

/// The leader failover phase: what it needs of the run.
struct Failover<'a> {
    bins: &'a PeerBinaries,
    peer: Peer,
    plane: &'a ControlPlane,
    system: &'a str,
    opts: &'a PeerOptions,
    /// The file server's port of the run (the Programs' artifact URLs name it).
    fs_port: u16,
    observer: &'a Observer,
    stacks: &'a Api<Stack>,
    n: usize,
}

/// What a leader failover measured.
#[derive(Debug, Default, Clone)]
struct FailedOver {
    /// `kill -9` of the leader → the standby holds the Lease.
    to_leader: Duration,
    /// `kill -9` of the leader → every Stack and Workspace reconciled by the standby, nothing
    /// queued or running, every Stack Ready.
    to_ready: Duration,
    installs: usize,
    updates: usize,
}

impl Failover<'_> {
    /// Two replicas with leader election ([`LeaseSettings::FAILOVER`], both advertising the
    /// run's file-server address, as behind a Service): the first leads and reconciles the
    /// Ready Stacks (a restart), the second stands by; the leader is `kill -9`'d (its lease is
    /// not released), and the standby is timed until it has reconciled them all. Returns the
    /// standby, the leader now, with the file-server address forwarded to it.
    async fn run(
        &self,
        log: &Path,
    ) -> anyhow::Result<(FailedOver, RunningPeer, tokio::task::JoinHandle<()>)> {
        let leases: Api<Lease> = Api::namespaced(self.plane.try_client()?, self.system);
        let lease_name = LeaseSettings::lease_name(self.peer);
        let replica = |fs_port: Option<u16>| PeerOptions {
            fs_port,
            advertised: Some(format!("127.0.0.1:{}", self.fs_port)),
            lease: Some(LeaseSettings::FAILOVER),
            ..self.opts.clone()
        };
        let start = |which: &str, fs_port| {
            let log = log.with_extension(format!("{which}.log"));
            let opts = replica(fs_port);
            async move {
                pko_peer::start_with(self.peer, self.bins, self.plane, self.system, &log, &opts)
                    .await
            }
        };
        let mut leader = start("a", Some(self.fs_port)).await?;
        let holder = pko_peer::lease_holder(&leases, lease_name, None, PHASE_TIMEOUT).await?;
        quiet(
            &leader,
            self.n,
            "the first replica leading, every Stack reconciled",
        )
        .await?;
        let standby_log = log.with_extension("b.log");
        let standby = start("b", None).await?;
        let updates_before = self.observer.updates();
        let killed = Instant::now();
        leader.kill();
        // The Service's part: the address every artifact URL names reaches the standby now.
        let service = forward(self.fs_port, standby.fs_port).await?;
        pko_peer::lease_holder(&leases, lease_name, Some(&holder), PHASE_TIMEOUT).await?;
        let to_leader = killed.elapsed();
        quiet(
            &standby,
            self.n,
            "the standby leading, every Stack reconciled",
        )
        .await?;
        let ready = self
            .stacks
            .list(&ListParams::default())
            .await?
            .items
            .iter()
            .filter(|s| deployed(s).is_some())
            .count();
        let to_ready = killed.elapsed();
        if ready != self.n {
            bail!("{ready} of {} Stacks Ready after the failover", self.n);
        }
        let measured = FailedOver {
            to_leader,
            to_ready,
            installs: count_in(&standby_log, install_line(self.peer)),
            updates: self.observer.updates() - updates_before,
        };
        Ok((measured, standby, service))
    }
}

/// What a steady-state window watches.
struct Steady<'a> {
    op: &'a RunningPeer,
    observer: &'a Observer,
    kubelet: &'a Kubelet,
    audit: &'a Path,
    pulumi_calls: bool,
}

impl Steady<'_> {
    /// Watches `groups` of Stacks for `length` (the window is the measurement, so it is waited
    /// out): per group, the Updates created, the `pulumi` processes seen below its agents
    /// (polled every 100 ms; a CLI run lives far longer), and the operator's apiserver writes
    /// to its objects (each object of a Stack is named after it: its Workspace, Updates,
    /// outputs Secrets, StatefulSet, Service, pod and Events).
    async fn window<const G: usize>(
        &self,
        length: Duration,
        groups: [&[String]; G],
    ) -> [Window; G] {
        let from = audit_lines(self.audit);
        let updates = groups.map(|g| self.observer.updates_of(g));
        let agents = groups.map(|g| {
            g.iter()
                .filter_map(|n| self.kubelet.agent_pid(n))
                .collect::<HashSet<u32>>()
        });
        let mut pulumi: [HashSet<(u32, u64)>; G] = std::array::from_fn(|_| HashSet::new());
        let began = Instant::now();
        while began.elapsed() < length {
            let procs = Procs::read();
            for (seen, agents) in pulumi.iter_mut().zip(&agents) {
                seen.extend(procs.pulumi_below(agents));
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        let seconds = began.elapsed().as_secs_f64();
        if self.pulumi_calls {
            let from = unix_now() - seconds;
            for name in groups.iter().flat_map(|g| g.iter()) {
                for call in self.kubelet.pulumi_calls(name) {
                    let at = call
                        .split(' ')
                        .next()
                        .and_then(|t| t.parse::<f64>().ok())
                        .unwrap_or(0.0);
                    if at >= from {
                        println!("     {name}: pulumi {call}");
                    }
                }
            }
        }
        let trace = self
            .audit
            .with_extension(format!("steady-{}", self.op.pid()));
        let writes = operator_writes_to(self.audit, from, &trace);
        let mut out = std::array::from_fn(|_| Window::default());
        for (i, group) in groups.iter().enumerate() {
            out[i] = Window {
                seconds,
                stacks: group.len(),
                updates: self.observer.updates_of(group) - updates[i],
                pulumi_started: pulumi[i].len(),
                writes: writes
                    .iter()
                    .filter(|(_, object)| group.iter().any(|g| named_after(object, g)))
                    .count(),
            };
        }
        out
    }
}

/// Whether object `name` is Stack `stack`'s (its own name, or `<stack>-…` / `<stack>.…`: the
/// bench's Stacks are all named `sNNN`, so no Stack's name starts another's).
fn named_after(name: &str, stack: &str) -> bool {
    name.strip_prefix(stack)
        .is_some_and(|rest| rest.is_empty() || rest.starts_with(['-', '.']))
}

/// `--idle`: pko-rs's scale to zero, measured where users feel it. Every Stack's workspace gets
/// `spec.idle` (through its `workspaceTemplate`); then, one Stack at a time, once its pod is
/// stopped (no agent process left), its Program is edited and the time to its new `up` done is
/// taken: a pod start, a fetch, a plugin install and the `up`, beside a warm edit's `up`.
struct Cold<'a> {
    programs: &'a Api<Program>,
    stacks: &'a Api<Stack>,
    workspaces: &'a Api<pko_api::workspace::Workspace>,
    observer: &'a Observer,
    kubelet: &'a Kubelet,
    names: &'a [String],
    op: &'a RunningPeer,
}

/// The cold starts' edit numbers start here, above any warm edit's: an edit that left the
/// Program as it was would start no `up`.
const COLD_EDITS_FROM: usize = 1_000_000;

/// How long an idle workspace of the cold-start phase waits before its pod is stopped.
const COLD_IDLE_AFTER: &str = "5s";

impl Cold<'_> {
    /// Whether `name`'s workspace is stopped by `spec.idle`: `Ready=False, reason=Idle` for
    /// its generation, and no agent process left.
    async fn stopped(&self, name: &str) -> bool {
        let Ok(ws) = self.workspaces.get(name).await else {
            return false;
        };
        let idle = ws.status.as_ref().is_some_and(|status| {
            status.observed_generation == ws.metadata.generation
                && status
                    .conditions
                    .iter()
                    .any(|c| c.type_ == "Ready" && c.status == "False" && c.reason == "Idle")
        });
        idle && self.kubelet.agent_pid(name).is_none()
    }

    /// `starts` cold starts, round robin over the Stacks; then, once every workspace is stopped,
    /// the fleet's RSS (the operator and every process left below the agents: none).
    async fn run(&self, starts: usize) -> anyhow::Result<(Vec<Duration>, u64)> {
        let patch =
            json!({"spec": {"workspaceTemplate": {"spec": {"idle": {"after": COLD_IDLE_AFTER}}}}});
        for name in self.names {
            self.stacks
                .patch(name, &PatchParams::default(), &Patch::Merge(&patch))
                .await?;
        }
        let mut times = Vec::new();
        for k in 0..starts {
            let i = k % self.names.len();
            let name = &self.names[i];
            wait_for(&format!("workspace {name} idle"), PHASE_TIMEOUT, || async {
                self.stopped(name).await.then_some(())
            })
            .await
            .with_context(|| self.op.log_tail(40))?;
            let before = self.observer.latest(name);
            let patch = json!({"program": program(i, COLD_EDITS_FROM + k)});
            let at = Instant::now();
            self.programs
                .patch(name, &PatchParams::default(), &Patch::Merge(&patch))
                .await?;
            let done = wait_for(
                &format!("Stack {name}'s up after a cold start"),
                PHASE_TIMEOUT,
                || async {
                    self.observer
                        .deployed_other_than_after(name, before.as_deref(), at)
                },
            )
            .await
            .with_context(|| format!("{}\n{}", self.op.log_tail(40), self.kubelet.logs(name)))?;
            times.push(done.saturating_duration_since(at));
        }
        wait_for("every workspace idle", PHASE_TIMEOUT, || async {
            for name in self.names {
                if !self.stopped(name).await {
                    return None;
                }
            }
            Some(())
        })
        .await
        .with_context(|| self.op.log_tail(40))?;
        let agents: u64 = self
            .names
            .iter()
            .filter_map(|name| self.kubelet.agent_pid(name))
            .map(tree_rss_kib)
            .sum();
        Ok((times, tree_rss_kib(self.op.pid()) + agents))
    }
}

impl Observer {
    /// When `stack` was first deployed by an Update other than `not`, if that was after `at`.
    fn deployed_other_than_after(
        &self,
        stack: &str,
        not: Option<&str>,
        at: Instant,
    ) -> Option<Instant> {
        // The first deploy by an Update other than `not` seen after `at`: older Updates of the
        // same Stack were first seen before it.
        let s = self.lock();
        s.deployed
            .iter()
            .filter(|((name, update), seen)| {
                name == stack && Some(update.as_str()) != not && **seen >= at
            })
            .map(|(_, seen)| *seen)
            .min()
    }
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

fn secs(d: Duration) -> String {
    format!("{:.2} s", d.as_secs_f64())
}

fn sorted(d: &[Duration]) -> Vec<Duration> {
    let mut d = d.to_vec();
    d.sort();
    d
}

fn mib(kib: u64) -> String {
    format!("{:.1} MiB", kib as f64 / 1024.0)
}

/// PKO ÷ pko-rs, as `1.23×`.
fn advantage(pko: f64, ours: f64) -> String {
    if ours > 0.0 {
        format!("{:.2}×", pko / ours)
    } else {
        "–".into()
    }
}

fn writes_per_up(run: &PeerRun) -> (f64, String) {
    let ups = run.edits.len().max(1) as f64;
    let total: usize = run.edit_writes.values().sum();
    let detail = run
        .edit_writes
        .iter()
        .map(|(r, c)| format!("{r} {:.1}", *c as f64 / ups))
        .collect::<Vec<_>>()
        .join(", ");
    (total as f64 / ups, detail)
}

/// The ratios `make bench-check` guards, keyed `stacks-<measure>/<N>` (PKO ÷ pko-rs: more is
/// better for pko-rs, as every ratio of the baseline).
fn ratios(runs: &[Trio]) -> BTreeMap<String, f64> {
    let mut out = BTreeMap::new();
    for Trio { pko, ours, .. } in runs {
        let n = ours.n;
        let t = |d: Duration| d.as_secs_f64();
        let p99 = |d: &[Duration]| t(percentile(&sorted(d), 0.99));
        let per_ws = |r: &PeerRun| {
            r.workspace_rss_kib.iter().sum::<u64>() as f64 / r.workspace_rss_kib.len().max(1) as f64
        };
        for (key, a, b) in [
            ("all-ready", t(pko.all_ready), t(ours.all_ready)),
            ("edit-p99", p99(&pko.edits), p99(&ours.edits)),
            ("writes-per-up", writes_per_up(pko).0, writes_per_up(ours).0),
            (
                "operator-rss",
                pko.operator_rss_kib as f64,
                ours.operator_rss_kib as f64,
            ),
            ("workspace-rss", per_ws(pko), per_ws(ours)),
            (
                "operator-cpu-per-stack",
                pko.operator_cpu_first,
                ours.operator_cpu_first,
            ),
        ] {
            if a > 0.0 && b > 0.0 {
                out.insert(format!("{STACKS_PREFIX}{key}/{n}"), a / b);
            }
        }
    }
    out
}

/// `--write-baseline` and `--check`.
fn baseline(args: &Args, ratios: &BTreeMap<String, f64>) -> anyhow::Result<()> {
    if let Some(path) = &args.write_baseline {
        let mut baseline = Baseline::read(path).unwrap_or_default();
        baseline.ratios.extend(ratios.clone());
        baseline.write(path)?;
        println!("added the Stack ratios to {}", path.display());
    }
    let Some(path) = &args.check else {
        return Ok(());
    };
    let baseline = Baseline::read(path)?;
    let outcome = baseline.check(ratios, args.tolerance);
    println!("\nbench-check (Stacks) against {}:", path.display());
    for (key, then, now) in &outcome.compared {
        println!("  {key:<40} baseline {then:>7.3}×  now {now:>7.3}×");
    }
    for key in &outcome.unrecorded {
        println!("  {key:<40} not in the baseline (not checked; `make bench` records it)");
    }
    if !outcome.regressions.is_empty() {
        let list: Vec<String> = outcome.regressions.iter().map(|r| r.to_string()).collect();
        bail!(
            "bench-check: {} Stack ratio(s) fell more than {:.0}% below the baseline:\n  {}",
            list.len(),
            args.tolerance * 100.0,
            list.join("\n  ")
        );
    }
    Ok(())
}

fn section(args: &Args, runs: &[Trio]) -> anyhow::Result<String> {
    let mut s = String::new();
    writeln!(s, "{BEGIN}")?;
    writeln!(s, "## Stacks at fleet scale, next to PKO v2.9.0\n")?;
    writeln!(
        s,
        "`pko-bench-stacks`: each operator alone on a fresh control plane (audit log on) with \
         its own CRDs, the harness as kubelet (pko-rs's pods run its agent; PKO's pods run PKO's \
         own pod spec and agent), the same pulumi CLI, YAML host and `file://` backend. N \
         `programRef` Stacks, one small YAML Program each. *Edit*: a Program's output changed, \
         until its Stack's new `up` is done (round robin over the Stacks, {} edits). *Writes \
         per up*: the operator's own create/update/patch/delete requests during the edits \
         (audit log; each operator runs as a user of its own), divided by the edits. *CPU per \
         Stack*: the operator's and kube-apiserver's CPU time over the N new Stacks phase, \
         divided by N. *Restart*: SIGTERM, a new process; spawn → every Stack and Workspace \
         reconciled by it with nothing queued or running and every Stack Ready. *Failover*: two \
         replicas with leader election (lease 15 s, renew deadline 10 s, retry 2 s), the first \
         leading; it is `kill -9`'d, and the standby is timed until it holds the Lease and \
         until it has reconciled every Stack and Workspace with every Stack Ready. *Installs*: the \
         operator's log lines for a workspace installed (pko-rs: `workspace initialized`; PKO: \
         `Running pulumi install`). RSS: idle, after the edits; per workspace: the agent and \
         every process below it, idle, and its peak during its edit's `up` (sampled every 50 \
         ms). *Steady state*: after the restart, one {} s window in which the first half of the \
         Stacks keeps `continueResyncOnCommitMatch` off (the default) and the second half has it \
         on with `resyncFrequencySeconds: 60` (N = {}); per Stack per hour: Updates, `pulumi` \
         processes started below its agent, and the operator's apiserver writes to its objects \
         (each named after the Stack). Advantage: PKO ÷ pko-rs.{}\n",
        args.edits,
        args.idle_seconds,
        if args.windows_at.is_empty() {
            "every N".to_owned()
        } else {
            args.windows_at
                .iter()
                .map(usize::to_string)
                .collect::<Vec<_>>()
                .join(", ")
        },
        if args.musl.is_some() {
            format!(
                " *{MUSL}*: the static x86_64-unknown-linux-musl release binary `make dist` \
                 builds and the images ship, run the same way (the timed phases: the steady \
                 window counts operations, the same in either build); *musl ÷ glibc* is its \
                 figure over the glibc build's (above 1: the shipped build costs more)."
            )
        } else {
            String::new()
        }
    )?;
    let build = if cfg!(debug_assertions) {
        "debug build (`cargo run --bin pko-bench-stacks`)"
    } else {
        "release build (`make bench`)"
    };
    // The agent pko-rs's pods run (PKO's run its own release agent).
    let agent = match pko_tests::agent::agent_binary() {
        Ok(path) if path.components().any(|c| c.as_os_str() == "debug") => {
            "debug build (`make agent-static`)"
        }
        Ok(_) => "release build (`make dist`, as the image ships it)",
        Err(_) => "not found",
    };
    writeln!(
        s,
        "Operator: {build}. pko-rs's workspace agent: {agent}. Machine: {}.\n",
        measure::machine()
    )?;
    let musl = runs.iter().any(|t| t.musl.is_some());
    if musl {
        writeln!(
            s,
            "| N | measure | PKO v2.9.0 | pko-rs | advantage | {MUSL} | musl ÷ glibc |"
        )?;
        writeln!(s, "|---:|---|---:|---:|---:|---:|---:|")?;
    } else {
        writeln!(s, "| N | measure | PKO v2.9.0 | pko-rs | advantage |")?;
        writeln!(s, "|---:|---|---:|---:|---:|")?;
    }
    for trio in runs {
        let n = trio.ours.n;
        let mut rows: Vec<Row> = Vec::new();
        rows.extend(rows_of(trio, n));
        for row in rows {
            let third = match (&trio.musl, row.musl) {
                (Some(_), Some((text, ratio))) => format!(" {text} | {ratio} |"),
                (Some(_), None) => " | |".to_owned(),
                (None, _) if musl => " – | |".to_owned(),
                (None, _) => String::new(),
            };
            writeln!(
                s,
                "| {n} | {} | {} | {} | {} |{third}",
                row.what, row.pko, row.ours, row.advantage
            )?;
        }
    }
    writeln!(s)?;
    for trio in runs {
        let mut each = vec![("PKO v2.9.0", &trio.pko), ("pko-rs", &trio.ours)];
        if let Some(m) = &trio.musl {
            each.push((MUSL, m));
        }
        for (label, run) in each {
            let (_, detail) = writes_per_up(run);
            writeln!(s, "- N={}, {label}, writes per `up`: {detail}", run.n)?;
        }
    }
    writeln!(
        s,
        "\nLoad average when the run ended: {}.\n",
        measure::load_average()
    )?;
    writeln!(s, "{END}")?;
    Ok(s)
}

/// One table row: the measure, PKO's and pko-rs's figures, the advantage, and the shipped
/// build's figure with its ratio to the glibc build's.
struct Row {
    what: String,
    pko: String,
    ours: String,
    advantage: String,
    musl: Option<(String, String)>,
}

/// What a steady-state row counts.
type Count = fn(&Window) -> usize;

/// A figure of one run, as text and as a number (for the ratios).
type Figure = fn(&PeerRun) -> (String, f64);

fn rows_of(trio: &Trio, n: usize) -> Vec<Row> {
    let figures: Vec<(String, Figure, bool)> = vec![
        (
            format!("{n} new Stacks → all Ready"),
            |r| (secs(r.all_ready), r.all_ready.as_secs_f64()),
            true,
        ),
        (
            "per Stack create → Ready, p50".into(),
            |r| {
                let d = percentile(&sorted(&r.per_stack), 0.5);
                (secs(d), d.as_secs_f64())
            },
            true,
        ),
        (
            "per Stack create → Ready, p99".into(),
            |r| {
                let d = percentile(&sorted(&r.per_stack), 0.99);
                (secs(d), d.as_secs_f64())
            },
            true,
        ),
        (
            "Updates run for the new Stacks".into(),
            |r| (r.first_updates.to_string(), 0.0),
            false,
        ),
        (
            "operator CPU per Stack deployed".into(),
            |r| cpu_per(r.operator_cpu_first, r.n),
            true,
        ),
        (
            "kube-apiserver CPU per Stack deployed".into(),
            |r| cpu_per(r.apiserver_cpu_first, r.n),
            true,
        ),
        (
            "Program edit → its Stack's `up` done, p50".into(),
            |r| {
                let d = percentile(&sorted(&r.edits), 0.5);
                (secs(d), d.as_secs_f64())
            },
            true,
        ),
        (
            "Program edit → its Stack's `up` done, p99".into(),
            |r| {
                let d = percentile(&sorted(&r.edits), 0.99);
                (secs(d), d.as_secs_f64())
            },
            true,
        ),
        (
            "Updates run for the edits".into(),
            |r| (r.edit_updates.to_string(), 0.0),
            false,
        ),
        (
            "operator's apiserver writes per `up`".into(),
            |r| {
                let (w, _) = writes_per_up(r);
                (format!("{w:.1}"), w)
            },
            true,
        ),
        (
            "operator RSS, idle".into(),
            |r| (mib(r.operator_rss_kib), r.operator_rss_kib as f64),
            true,
        ),
        (
            "RSS per workspace (agent + children), idle".into(),
            |r| {
                let m = r.workspace_rss_kib.iter().sum::<u64>()
                    / r.workspace_rss_kib.len().max(1) as u64;
                (mib(m), m as f64)
            },
            true,
        ),
        (
            "RSS per workspace, peak during its `up`".into(),
            |r| {
                let m = r.workspace_rss_up_kib.iter().sum::<u64>()
                    / r.workspace_rss_up_kib.len().max(1) as u64;
                (mib(m), m as f64)
            },
            true,
        ),
        (
            format!("restart with {n} Ready Stacks: spawn → all reconciled and Ready"),
            |r| (secs(r.restart), r.restart.as_secs_f64()),
            true,
        ),
        (
            "installs after the restart (first deploy)".into(),
            |r| {
                (
                    format!("{} ({})", r.restart_installs, r.installs_first),
                    0.0,
                )
            },
            false,
        ),
        (
            "Updates started by the restart".into(),
            |r| (r.restart_updates.to_string(), 0.0),
            false,
        ),
        (
            format!("leader failover with {n} Ready Stacks: kill -9 → standby leads"),
            |r| {
                let d = r.failover.to_leader;
                (secs(d), d.as_secs_f64())
            },
            true,
        ),
        (
            format!("leader failover with {n} Ready Stacks: kill -9 → all reconciled and Ready"),
            |r| {
                let d = r.failover.to_ready;
                (secs(d), d.as_secs_f64())
            },
            true,
        ),
        (
            "installs and Updates started by the failover".into(),
            |r| {
                (
                    format!("{} and {}", r.failover.installs, r.failover.updates),
                    0.0,
                )
            },
            false,
        ),
    ];
    let mut rows: Vec<Row> = figures
        .into_iter()
        .map(|(what, f, ratio)| {
            let (a, av) = f(&trio.pko);
            let (b, bv) = f(&trio.ours);
            let musl = trio.musl.as_ref().map(|m| {
                let (c, cv) = f(m);
                let r = if ratio && bv > 0.0 {
                    format!("{:.2}", cv / bv)
                } else {
                    String::new()
                };
                (c, r)
            });
            Row {
                what,
                pko: a,
                ours: b,
                advantage: if ratio {
                    advantage(av, bv)
                } else {
                    String::new()
                },
                musl,
            }
        })
        .collect();
    rows.extend(extra_rows(trio, n));
    for (when, pick) in [
        (
            "off",
            (|r: &PeerRun| r.idle_off.clone()) as fn(&PeerRun) -> Option<Window>,
        ),
        ("on", |r: &PeerRun| r.idle_on.clone()),
    ] {
        let counts: [(&str, Count); 3] = [
            ("Updates", |w| w.updates),
            ("`pulumi` processes started", |w| w.pulumi_started),
            ("operator's apiserver writes", |w| w.writes),
        ];
        for (what, count) in counts {
            let cell = |r: &PeerRun| {
                pick(r).map(|w| {
                    let v = w.per_stack_hour(count(&w));
                    (format!("{v:.1}"), v)
                })
            };
            let (Some((a, av)), Some((b, bv))) = (cell(&trio.pko), cell(&trio.ours)) else {
                continue;
            };
            rows.push(Row {
                what: format!("steady, resync on commit match {when}: {what} per Stack per hour"),
                pko: a,
                ours: b,
                advantage: advantage(av, bv),
                musl: trio.musl.as_ref().and_then(cell).map(|(c, cv)| {
                    let r = if bv > 0.0 {
                        format!("{:.2}", cv / bv)
                    } else {
                        String::new()
                    };
                    (c, r)
                }),
            });
        }
    }
    rows
}

/// pko-rs's beyond-PKO rows (drift checks, cold starts, the fleet with workspaces stopped),
/// where its run measured them; PKO has none of these.
fn extra_rows(trio: &Trio, n: usize) -> Vec<Row> {
    let (pko, ours) = (&trio.pko, &trio.ours);
    let only_ours = |what: String, ours: String, pko: &str| Row {
        what,
        pko: pko.to_owned(),
        ours,
        advantage: String::new(),
        musl: None,
    };
    let mut rows = Vec::new();
    if let Some(d) = &ours.drift {
        let per = |x: f64| x / d.checks.max(1) as f64;
        let none = "– (no drift detection)";
        rows.push(only_ours(
            format!(
                "drift checks (refresh, preview only), {} due at one tick: tick → all finished",
                d.checks
            ),
            secs(d.round),
            none,
        ));
        rows.push(only_ours(
            "drift check, start → end, mean (the Update's times: whole seconds)".into(),
            format!("{:.2} s", d.mean_check),
            none,
        ));
        rows.push(only_ours(
            "drift check: operator's apiserver writes per check".into(),
            format!("{:.1}", per(d.writes as f64)),
            none,
        ));
        rows.push(only_ours(
            "drift check: `pulumi` processes started per check".into(),
            format!("{:.1}", per(d.pulumi as f64)),
            none,
        ));
        rows.push(only_ours(
            "drift check: operator CPU per check".into(),
            format!("{:.0} ms", per(d.operator_cpu) * 1000.0),
            none,
        ));
        rows.push(only_ours(
            "drift check: kube-apiserver CPU per check".into(),
            format!("{:.0} ms", per(d.apiserver_cpu) * 1000.0),
            none,
        ));
    }
    if !ours.cold_starts.is_empty() {
        let cold = sorted(&ours.cold_starts);
        let always = "– (always on)";
        for (q, label) in [(0.5, "p50"), (0.99, "p99")] {
            rows.push(only_ours(
                format!("cold start, workspace stopped by `spec.idle`: Program edit → its Stack's `up` done, {label}"),
                secs(percentile(&cold, q)),
                always,
            ));
        }
    }
    if let Some(stopped) = ours.fleet_idle_kib {
        let always_on = |r: &PeerRun| r.operator_rss_kib + r.workspace_rss_kib.iter().sum::<u64>();
        rows.push(Row {
            what: format!(
                "{n} idle Stacks, workspaces always on: operator + every workspace process, RSS"
            ),
            pko: mib(always_on(pko)),
            ours: mib(always_on(ours)),
            advantage: advantage(always_on(pko) as f64, always_on(ours) as f64),
            musl: None,
        });
        rows.push(Row {
            what: format!(
                "{n} idle Stacks, pko-rs's workspaces stopped by `spec.idle`: the same RSS"
            ),
            pko: format!("{} (always on)", mib(always_on(pko))),
            ours: mib(stopped),
            advantage: advantage(always_on(pko) as f64, stopped as f64),
            musl: None,
        });
    }
    rows
}

fn cpu_per(seconds: f64, n: usize) -> (String, f64) {
    let ms = seconds * 1000.0 / n.max(1) as f64;
    (format!("{ms:.0} ms"), ms)
}

/// Prints the section and puts it into `--out` between its markers.
fn write_section(args: &Args, runs: &[Trio]) -> anyhow::Result<()> {
    let section = section(args, runs)?;
    print!("{section}");
    if let Some(out) = &args.out {
        let current = std::fs::read_to_string(out).unwrap_or_else(|_| "# Benchmarks\n".into());
        let updated = match (current.find(BEGIN), current.find(END)) {
            (Some(begin), Some(end)) if end > begin => format!(
                "{}{}{}",
                &current[..begin],
                section.trim_end(),
                &current[end + END.len()..]
            ),
            _ => format!("{}\n{}", current.trim_end(), section),
        };
        std::fs::write(out, updated).with_context(|| format!("writing {}", out.display()))?;
        println!("wrote the Stack section of {}", out.display());
    }
    Ok(())
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let _ = rustls::crypto::ring::default_provider().install_default();
    let args = parse_args()?;
    let ours = std::env::current_exe()?.with_file_name("pko-operator");
    let bins = if args.pko_rs_only {
        PeerBinaries {
            pko_rs: ours,
            pko_rs_crds: pko_tests::repo_root().join("deploy/crds"),
            pko_manager: PathBuf::new(),
            pko_crds: PathBuf::new(),
        }
    } else {
        PeerBinaries::find(ours)?
    };
    let logs = tempfile::Builder::new()
        .prefix("pko-bench-stacks-logs-")
        .tempdir()?
        .keep();
    println!("operator logs: {}", logs.display());
    let began = Instant::now();
    let plan = Plan {
        edits: args.edits,
        idle: Duration::from_secs(args.idle_seconds),
        cold: args.cold,
        pulumi_calls: args.pulumi_calls,
        drift: args.drift,
        cold_starts: args.cold_starts,
    };
    let musl_bins = args.musl.as_ref().map(|path| PeerBinaries {
        pko_rs: path.clone(),
        ..bins.clone()
    });
    if let Some(path) = &args.musl
        && !path.is_file()
    {
        bail!(
            "--musl-operator {}: no such file (`make dist`)",
            path.display()
        );
    }
    let mut runs = Vec::new();
    for &n in &args.stacks {
        let windowed = args.windows_at.is_empty() || args.windows_at.contains(&n);
        let plan = Plan {
            idle: if windowed { plan.idle } else { Duration::ZERO },
            cold: plan.cold && (args.idle_at.is_empty() || args.idle_at.contains(&n)),
            drift: plan.drift && (args.drift_at.is_empty() || args.drift_at.contains(&n)),
            ..plan
        };
        // The shipped build runs the timed phases only: the window and the beyond-PKO phases
        // count operations, which the same code makes in either build.
        let musl_plan = Plan {
            idle: Duration::ZERO,
            cold: false,
            drift: false,
            ..plan
        };
        if args.pko_rs_only {
            let label = Peer::PkoRs.label();
            let ours = peer_run(&bins, Peer::PkoRs, label, n, plan, &logs).await?;
            println!("{ours:#?}");
            continue;
        }
        let pko = peer_run(&bins, Peer::Pko, Peer::Pko.label(), n, plan, &logs).await?;
        let ours = peer_run(&bins, Peer::PkoRs, Peer::PkoRs.label(), n, plan, &logs).await?;
        let musl = match &musl_bins {
            Some(mb) if args.musl_at.is_empty() || args.musl_at.contains(&n) => {
                Some(peer_run(mb, Peer::PkoRs, MUSL, n, musl_plan, &logs).await?)
            }
            _ => None,
        };
        runs.push(Trio { pko, ours, musl });
        // Written after each N, so a run cut short still leaves what it measured.
        write_section(&args, &runs)?;
    }
    println!("whole run: {:.0} s", began.elapsed().as_secs_f64());
    if args.pko_rs_only {
        return Ok(());
    }
    baseline(&args, &ratios(&runs))?;
    Ok(())
}

/// Seconds since the epoch, as the `pulumi` call log stamps its lines.
fn unix_now() -> f64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}
