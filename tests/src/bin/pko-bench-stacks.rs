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
//! - idle: operator RSS, and RSS per workspace (agent + what it started);
//! - operator restart (SIGTERM, a new process) with N Ready Stacks: spawn → every Stack and
//!   Workspace reconciled by the new process, nothing queued or running, all Ready; installs
//!   (each operator's own log line for a `pulumi install`) and Updates started.
//!
//! `--short` runs N=3 with 3 edits and prints its table only (`make bench-check`, with `--check`
//! against the ratios `make bench` adds to docs/bench-baseline.json with `--write-baseline`).
//! Otherwise the section goes into `--out` (docs/benchmarks.md) between its markers, leaving
//! the rest of the file alone.
#![allow(
    clippy::disallowed_methods,
    reason = "a test process is configured by its environment (make sets the tool and fixture paths)"
)]

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use futures::StreamExt;
use kube::api::{ListParams, Patch, PatchParams, PostParams};
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Api, Client, ResourceExt};
use pko_api::program::Program;
use pko_api::stack::Stack;
use pko_api::update::Update;
use pko_tests::bench_baseline::Baseline;
use pko_tests::kubelet::{ApiAccess, Kubelet, KubeletOptions, PodNetwork};
use pko_tests::measure::{self, percentile};
use pko_tests::pko_peer::{self, Peer, PeerBinaries, PeerOptions, RunningPeer};
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
    };
    let mut out_given = false;
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        if flag == "--short" {
            args.short = true;
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
            other => bail!("unknown flag {other}"),
        }
    }
    if args.short {
        args.stacks = vec![3];
        args.edits = 3;
        if !out_given {
            args.out = None;
        }
    }
    if args.stacks.contains(&0) || args.edits == 0 {
        bail!("--stacks and --edits must be at least 1");
    }
    Ok(args)
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
fn operator_writes(audit: &Path, from: usize, trace: &Path) -> BTreeMap<String, usize> {
    let text = std::fs::read_to_string(audit).unwrap_or_default();
    let mut by = BTreeMap::new();
    let mut listed = String::new();
    let mut lines = 0;
    for line in text.lines() {
        lines += 1;
        if lines <= from {
            continue;
        }
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
        let _ = writeln!(
            listed,
            "{} {verb} {resource} {}",
            e["requestReceivedTimestamp"].as_str().unwrap_or_default(),
            r["name"].as_str().unwrap_or_default()
        );
        *by.entry(resource).or_default() += 1;
    }
    let _ = std::fs::write(trace, listed);
    by
}

fn audit_lines(audit: &Path) -> usize {
    std::fs::read_to_string(audit)
        .map(|t| t.lines().count())
        .unwrap_or(0)
}

/// Resident memory of `pid` and every process below it, in KiB.
fn tree_rss_kib(pid: u32) -> u64 {
    let mut children: HashMap<u32, Vec<u32>> = HashMap::new();
    if let Ok(entries) = std::fs::read_dir("/proc") {
        for entry in entries.flatten() {
            let Some(child) = entry.file_name().to_str().and_then(|n| n.parse().ok()) else {
                continue;
            };
            let Ok(stat) = std::fs::read_to_string(format!("/proc/{child}/stat")) else {
                continue;
            };
            let parent = stat
                .rfind(')')
                .and_then(|at| stat[at + 1..].split_whitespace().nth(1))
                .and_then(|p| p.parse::<u32>().ok());
            if let Some(parent) = parent {
                children.entry(parent).or_default().push(child);
            }
        }
    }
    let mut total = 0;
    let mut todo = vec![pid];
    while let Some(p) = todo.pop() {
        total += measure::proc_status_kib(p, "VmRSS").unwrap_or(0);
        todo.extend(children.get(&p).into_iter().flatten());
    }
    total
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

/// Waits until both controllers have run at least `n` reconciles each (since the process
/// started) and have nothing queued or running.
async fn quiet(op: &RunningPeer, n: usize, what: &str) -> anyhow::Result<()> {
    wait_for(what, PHASE_TIMEOUT, || async {
        let text = metrics_text(op).await?;
        let s = progress(&text, STACKS);
        let w = progress(&text, WORKSPACES);
        (s.reconciles >= n as f64 && w.reconciles >= n as f64 && s.busy == 0.0 && w.busy == 0.0)
            .then_some(())
    })
    .await
    .with_context(|| op.log_tail(40))
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

async fn peer_run(
    bins: &PeerBinaries,
    peer: Peer,
    n: usize,
    edits: usize,
    logs: &Path,
) -> anyhow::Result<PeerRun> {
    let label = peer.label();
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
    let mut edit_times = Vec::new();
    for k in 0..edits {
        let i = k % n;
        let name = &names[i];
        let before = observer.latest(name);
        let patch = json!({"program": program(i, k + 1)});
        let at = Instant::now();
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
    }
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
    let restarted = pko_peer::start_with(
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
    for w in watches {
        w.abort();
    }
    drop(restarted);
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
    })
}

impl Observer {
    /// When `stack` was first deployed by an Update other than `not`, if that was after `at`.
    fn deployed_other_than_after(
        &self,
        stack: &str,
        not: Option<&str>,
        at: Instant,
    ) -> Option<Instant> {
        self.deployed_other_than(stack, not).filter(|t| *t >= at)
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
fn ratios(runs: &[(PeerRun, PeerRun)]) -> BTreeMap<String, f64> {
    let mut out = BTreeMap::new();
    for (pko, ours) in runs {
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
        ] {
            if a > 0.0 && b > 0.0 {
                out.insert(format!("stacks-{key}/{n}"), a / b);
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

fn section(args: &Args, runs: &[(PeerRun, PeerRun)]) -> anyhow::Result<String> {
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
         (audit log; each operator runs as a user of its own), divided by the edits. \
         *Restart*: SIGTERM, a new process; spawn → every Stack and Workspace reconciled by it \
         with nothing queued or running and every Stack Ready. *Installs*: the operator's log \
         lines for a workspace installed (pko-rs: `workspace initialized`; PKO: `Running \
         pulumi install`). RSS: idle, after the edits; per workspace: the agent and every \
         process below it. Advantage: PKO ÷ pko-rs.\n",
        args.edits
    )?;
    let build = if cfg!(debug_assertions) {
        "debug build (`cargo run --bin pko-bench-stacks`)"
    } else {
        "release build (`make bench`)"
    };
    writeln!(s, "Operator: {build}. Machine: {}.\n", measure::machine())?;
    writeln!(s, "| N | measure | PKO v2.9.0 | pko-rs | advantage |")?;
    writeln!(s, "|---:|---|---:|---:|---:|")?;
    for (pko, ours) in runs {
        let n = ours.n;
        let mut row = |what: &str, a: String, b: String, adv: String| {
            writeln!(s, "| {n} | {what} | {a} | {b} | {adv} |")
        };
        let t = |d: Duration| d.as_secs_f64();
        row(
            &format!("{n} new Stacks → all Ready"),
            secs(pko.all_ready),
            secs(ours.all_ready),
            advantage(t(pko.all_ready), t(ours.all_ready)),
        )?;
        for (q, name) in [(0.5, "p50"), (0.99, "p99")] {
            let a = percentile(&sorted(&pko.per_stack), q);
            let b = percentile(&sorted(&ours.per_stack), q);
            row(
                &format!("per Stack create → Ready, {name}"),
                secs(a),
                secs(b),
                advantage(t(a), t(b)),
            )?;
        }
        row(
            "Updates run for the new Stacks",
            pko.first_updates.to_string(),
            ours.first_updates.to_string(),
            String::new(),
        )?;
        for (q, name) in [(0.5, "p50"), (0.99, "p99")] {
            let a = percentile(&sorted(&pko.edits), q);
            let b = percentile(&sorted(&ours.edits), q);
            row(
                &format!("Program edit → its Stack's `up` done, {name}"),
                secs(a),
                secs(b),
                advantage(t(a), t(b)),
            )?;
        }
        row(
            "Updates run for the edits",
            pko.edit_updates.to_string(),
            ours.edit_updates.to_string(),
            String::new(),
        )?;
        let (wa, _) = writes_per_up(pko);
        let (wb, _) = writes_per_up(ours);
        row(
            "operator's apiserver writes per `up`",
            format!("{wa:.1}"),
            format!("{wb:.1}"),
            advantage(wa, wb),
        )?;
        row(
            "operator RSS, idle",
            mib(pko.operator_rss_kib),
            mib(ours.operator_rss_kib),
            advantage(pko.operator_rss_kib as f64, ours.operator_rss_kib as f64),
        )?;
        let per_ws = |r: &PeerRun| {
            r.workspace_rss_kib.iter().sum::<u64>() / r.workspace_rss_kib.len().max(1) as u64
        };
        row(
            "RSS per workspace (agent + children), idle",
            mib(per_ws(pko)),
            mib(per_ws(ours)),
            advantage(per_ws(pko) as f64, per_ws(ours) as f64),
        )?;
        row(
            &format!("restart with {n} Ready Stacks: spawn → all reconciled and Ready"),
            secs(pko.restart),
            secs(ours.restart),
            advantage(t(pko.restart), t(ours.restart)),
        )?;
        row(
            "installs after the restart (first deploy)",
            format!("{} ({})", pko.restart_installs, pko.installs_first),
            format!("{} ({})", ours.restart_installs, ours.installs_first),
            String::new(),
        )?;
        row(
            "Updates started by the restart",
            pko.restart_updates.to_string(),
            ours.restart_updates.to_string(),
            String::new(),
        )?;
    }
    writeln!(s)?;
    for (pko, ours) in runs {
        for (label, run) in [("PKO v2.9.0", pko), ("pko-rs", ours)] {
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

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let _ = rustls::crypto::ring::default_provider().install_default();
    let args = parse_args()?;
    let bins = PeerBinaries::find(std::env::current_exe()?.with_file_name("pko-operator"))?;
    let logs = tempfile::Builder::new()
        .prefix("pko-bench-stacks-logs-")
        .tempdir()?
        .keep();
    println!("operator logs: {}", logs.display());
    let began = Instant::now();
    let mut runs = Vec::new();
    for &n in &args.stacks {
        let pko = peer_run(&bins, Peer::Pko, n, args.edits, &logs).await?;
        let ours = peer_run(&bins, Peer::PkoRs, n, args.edits, &logs).await?;
        runs.push((pko, ours));
    }
    let section = section(&args, &runs)?;
    print!("{section}");
    println!("whole run: {:.0} s", began.elapsed().as_secs_f64());
    baseline(&args, &ratios(&runs))?;
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
