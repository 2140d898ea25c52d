//! `make bench`: measures the Program controller and file server on a private control plane and
//! writes the numbers to a Markdown file (docs/benchmarks.md).
//!
//! - reconcile wall time: N new Programs created → all `status.artifact` set for generation 1,
//!   next to the time the same client takes for N bare status patches (the apiserver's limit);
//! - file server: requests/s and latency percentiles for GETs spread over 1,000 Programs, from a
//!   closed-loop load generator on loopback;
//! - operator peak RSS (VmHWM).
#![allow(
    clippy::disallowed_methods,
    reason = "a test process is configured by its environment (make sets the tool and fixture paths)"
)]

use std::collections::BTreeSet;
use std::fmt::Write as _;
use std::net::TcpListener;
use std::path::PathBuf;
use std::process::Command;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use futures::{StreamExt, TryStreamExt};
use kube::Api;
use kube::api::{Patch, PatchParams, PostParams};
use kube::runtime::{WatchStreamExt, watcher};
use pko_api::program::Program;
use pko_tests::{ControlPlane, StartOptions, measure, spawn_guarded, wait_for};
use serde_json::json;

const IN_FLIGHT: usize = 32;

struct Args {
    out: PathBuf,
    counts: Vec<usize>,
    load_programs: usize,
    load_seconds: u64,
    connections: usize,
}

fn parse_args() -> anyhow::Result<Args> {
    let mut args = Args {
        out: PathBuf::from("docs/benchmarks.md"),
        counts: vec![1000, 5000],
        load_programs: 1000,
        load_seconds: 10,
        connections: 32,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let value = it.next().with_context(|| format!("{flag} needs a value"))?;
        match flag.as_str() {
            "--out" => args.out = PathBuf::from(value),
            "--counts" => {
                args.counts = value
                    .split(',')
                    .map(|c| c.parse().context("--counts takes numbers"))
                    .collect::<anyhow::Result<_>>()?
            }
            "--load-programs" => args.load_programs = value.parse()?,
            "--load-seconds" => args.load_seconds = value.parse()?,
            "--connections" => args.connections = value.parse()?,
            other => bail!("unknown flag {other}"),
        }
    }
    Ok(args)
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let _ = rustls::crypto::ring::default_provider().install_default();
    let args = parse_args()?;
    let state = tempfile::Builder::new().prefix("pko-rs-bench-").tempdir()?;
    let plane = ControlPlane::start(StartOptions {
        dir: Some(state.path().to_path_buf()),
        crds_dir: None,
    })
    .await?;
    let mut report = String::new();
    writeln!(report, "# Benchmarks\n")?;
    writeln!(
        report,
        "Measured by `make bench` (release build) on {} — {}. \
         Control plane: kube-apiserver + etcd built by `tools/` on loopback.\n",
        jiff::Timestamp::now().strftime("%Y-%m-%d %H:%M UTC"),
        measure::machine(),
    )?;

    writeln!(
        report,
        "## Program reconcile: new Programs to artifact-ready\n"
    )?;
    writeln!(
        report,
        "| Programs | create (client, {IN_FLIGHT} in flight) | all artifacts ready (from first create) | programs/s | bare status patches, same client | patches/s | operator peak RSS |"
    )?;
    writeln!(report, "|---:|---:|---:|---:|---:|---:|---:|")?;
    let mut load_section = String::new();
    for &count in &args.counts {
        // Bare patches first, in a namespace no operator watches.
        let patches = status_patch_run(&plane, count).await?;
        let ns = plane.namespace(&format!("bench-{count}")).await?;
        let (operator, fs_port, pid) = start_operator(&plane, &ns, state.path()).await?;
        let (create, ready) = reconcile_run(&plane, &ns, count).await?;
        let peak = measure::peak_rss_kib(pid).unwrap_or(0);
        writeln!(
            report,
            "| {count} | {:.2} s | {:.2} s | {:.0} | {:.2} s | {:.0} | {:.1} MiB |",
            create.as_secs_f64(),
            ready.as_secs_f64(),
            count as f64 / ready.as_secs_f64(),
            patches.as_secs_f64(),
            count as f64 / patches.as_secs_f64(),
            peak as f64 / 1024.0,
        )?;
        println!(
            "reconcile {count}: create {create:?}, ready {ready:?}, bare patches {patches:?}, peak RSS {peak} KiB"
        );
        if count >= args.load_programs && load_section.is_empty() {
            let programs = args.load_programs;
            let load = load_run(
                &plane,
                fs_port,
                &ns,
                programs,
                args.connections,
                args.load_seconds,
            )
            .await?;
            writeln!(load_section, "## File server: GET of artifacts\n")?;
            writeln!(
                load_section,
                "{programs} Programs, {} keep-alive connections, {} s closed loop on loopback, \
                 Programs requested round-robin (artifacts warm in the cache).\n",
                args.connections, args.load_seconds
            )?;
            writeln!(
                load_section,
                "| requests | errors | requests/s | p50 | p99 | max |"
            )?;
            writeln!(load_section, "|---:|---:|---:|---:|---:|---:|")?;
            writeln!(
                load_section,
                "| {} | {} | {:.0} | {} | {} | {} |\n",
                load.requests,
                load.errors,
                load.requests as f64 / load.elapsed.as_secs_f64(),
                micros(load.p50),
                micros(load.p99),
                micros(load.max),
            )?;
            println!(
                "load: {} requests, {:.0}/s, p50 {:?} p99 {:?}",
                load.requests,
                load.requests as f64 / load.elapsed.as_secs_f64(),
                load.p50,
                load.p99
            );
        }
        drop(operator);
    }
    writeln!(
        report,
        "\nEach row runs a fresh operator process watching only that row's namespace. The \
         bare-patch column is the apiserver's own rate for N server-side-apply status patches with \
         the same concurrency and no artifact work: the floor any controller writing N statuses \
         can reach on this control plane. The client and the operator share the machine's cores \
         with etcd and kube-apiserver.\n\n\
         Each replica holds one store of Programs (without managedFields), which the file server \
         answers from and the Program controller is driven from. With a store each (before \
         2026-12-01, same benchmark, another machine of this kind), 5,000 Programs peaked at \
         165.6 MiB and 1,000 at 62.9 MiB.\n"
    )?;
    report.push_str(&load_section);
    // The other benchmarks own marked sections of the same file (`<!-- … begin -->`): keep them.
    if let Ok(current) = std::fs::read_to_string(&args.out)
        && let Some(start) = current.find("<!-- ")
    {
        report = format!("{}\n\n{}", report.trim_end(), &current[start..]);
    }
    std::fs::write(&args.out, report).with_context(|| format!("writing {}", args.out.display()))?;
    println!("wrote {}", args.out.display());
    Ok(())
}

/// Create `count` Programs and wait until every one has its artifact. Returns (create time, ready time).
async fn reconcile_run(
    plane: &ControlPlane,
    ns: &str,
    count: usize,
) -> anyhow::Result<(Duration, Duration)> {
    let api: Api<Program> = Api::namespaced(plane.client(), ns);
    let watch_api = api.clone();
    let (ready_tx, ready_rx) = tokio::sync::oneshot::channel();
    let watcher_task = tokio::spawn(async move {
        let mut ready = BTreeSet::new();
        let mut stream =
            std::pin::pin!(watcher(watch_api, watcher::Config::default()).applied_objects());
        while let Ok(Some(p)) = stream.try_next().await {
            let done = p
                .status
                .as_ref()
                .and_then(|s| serde_json::to_value(s).ok())
                .and_then(|s| s.get("artifact").map(|a| !a.is_null()))
                .unwrap_or(false);
            if done {
                ready.insert(p.metadata.name.unwrap_or_default());
                if ready.len() == count {
                    break;
                }
            }
        }
        let _ = ready_tx.send(Instant::now());
    });
    let start = Instant::now();
    create_programs(&api, "p", count).await?;
    let created = start.elapsed();
    let done = tokio::time::timeout(Duration::from_secs(900), ready_rx)
        .await
        .context("timed out waiting for artifacts")??;
    watcher_task.abort();
    Ok((created, done - start))
}

/// Create `count` Programs named `<prefix>-<i>`, each a small but real program.
async fn create_programs(api: &Api<Program>, prefix: &str, count: usize) -> anyhow::Result<()> {
    futures::stream::iter(0..count)
        .map(|i| {
            let api = api.clone();
            async move {
                let p: Program = serde_json::from_value(json!({
                    "apiVersion": "pulumi.com/v1", "kind": "Program",
                    "metadata": {"name": format!("{prefix}-{i:05}")},
                    "program": {
                        "configuration": {"size": {"type": "Number", "default": i}},
                        "resources": {"r": {"type": "random:index:RandomString", "properties": {"length": "${size}"}}},
                        "outputs": {"value": "${r.result}"},
                    },
                }))?;
                api.create(&PostParams::default(), &p).await?;
                anyhow::Ok(())
            }
        })
        .buffer_unordered(IN_FLIGHT)
        .try_collect::<Vec<_>>()
        .await?;
    Ok(())
}

/// N server-side-apply status patches (no operator work) with the same concurrency.
async fn status_patch_run(plane: &ControlPlane, count: usize) -> anyhow::Result<Duration> {
    let ns = plane.namespace(&format!("bench-patch-{count}")).await?;
    let api: Api<Program> = Api::namespaced(plane.client(), &ns);
    // Objects first (not timed), the same as in the reconcile run; only the patches are measured.
    create_programs(&api, "q", count).await?;
    let params = PatchParams::apply("pko-bench").force();
    let start = Instant::now();
    futures::stream::iter(0..count)
        .map(|i| {
            let api = api.clone();
            let params = params.clone();
            async move {
                let patch = json!({
                    "apiVersion": "pulumi.com/v1", "kind": "Program",
                    "status": {"observedGeneration": 1, "artifact": {
                        "path": "x", "url": "x", "revision": "1",
                        "digest": "sha256:0000", "lastUpdateTime": "2026-01-01T00:00:00Z", "size": i,
                    }},
                });
                api.patch_status(&format!("q-{i:05}"), &params, &Patch::Apply(&patch))
                    .await?;
                anyhow::Ok(())
            }
        })
        .buffer_unordered(IN_FLIGHT)
        .try_collect::<Vec<_>>()
        .await?;
    Ok(start.elapsed())
}

struct Load {
    requests: u64,
    errors: u64,
    elapsed: Duration,
    p50: Duration,
    p99: Duration,
    max: Duration,
}

async fn load_run(
    plane: &ControlPlane,
    port: u16,
    ns: &str,
    programs: usize,
    connections: usize,
    seconds: u64,
) -> anyhow::Result<Load> {
    // The capability URLs from the Programs' status, as workspaces fetch them.
    let api: kube::Api<pko_api::program::Program> = kube::Api::namespaced(plane.client(), ns);
    let mut paths = Vec::with_capacity(programs);
    for i in 0..programs {
        let status = serde_json::to_value(api.get(&format!("p-{i:05}")).await?.status)?;
        let url = status
            .pointer("/artifact/url")
            .and_then(serde_json::Value::as_str)
            .context("a Program without an artifact URL")?;
        let path = &url[url
            .find("/programs/")
            .context("an artifact URL without a path")?..];
        paths.push(format!("http://127.0.0.1:{port}{path}"));
    }
    let paths: Arc<Vec<String>> = Arc::new(paths);
    // Warm-up: one pass so every artifact is in the cache, as in steady state.
    let client = reqwest::Client::builder()
        .pool_max_idle_per_host(connections)
        .build()?;
    for url in paths.iter() {
        client.get(url).send().await?.bytes().await?;
    }
    let deadline = Instant::now() + Duration::from_secs(seconds);
    let start = Instant::now();
    let mut workers = tokio::task::JoinSet::new();
    for w in 0..connections {
        let paths = paths.clone();
        let client = client.clone();
        workers.spawn(async move {
            let mut latencies = Vec::new();
            let mut errors = 0u64;
            let mut i = w;
            while Instant::now() < deadline {
                let url = &paths[i % paths.len()];
                i += connections;
                let t = Instant::now();
                match client.get(url).send().await {
                    Ok(resp) if resp.status() == 200 => {
                        if resp.bytes().await.is_err() {
                            errors += 1;
                        }
                    }
                    _ => errors += 1,
                }
                latencies.push(t.elapsed());
            }
            (latencies, errors)
        });
    }
    let mut all = Vec::new();
    let mut errors = 0;
    while let Some(done) = workers.join_next().await {
        let (lat, err) = done?;
        all.extend(lat);
        errors += err;
    }
    let elapsed = start.elapsed();
    all.sort();
    let pct = |p: f64| {
        all.get(((all.len() as f64 * p) as usize).min(all.len().saturating_sub(1)))
            .copied()
            .unwrap_or_default()
    };
    Ok(Load {
        requests: all.len() as u64,
        errors,
        elapsed,
        p50: pct(0.50),
        p99: pct(0.99),
        max: all.last().copied().unwrap_or_default(),
    })
}

fn micros(d: Duration) -> String {
    if d < Duration::from_millis(1) {
        format!("{} µs", d.as_micros())
    } else {
        format!("{:.2} ms", d.as_secs_f64() * 1000.0)
    }
}

/// A release operator process watching `ns`; returns it with its file-server port and pid.
async fn start_operator(
    plane: &ControlPlane,
    ns: &str,
    dir: &std::path::Path,
) -> anyhow::Result<(pko_tests::ChildGuard, u16, u32)> {
    let fs_port = free_port()?;
    let probe_port = free_port()?;
    let operator_bin = std::env::current_exe()?.with_file_name("pko-operator");
    let mut cmd = Command::new(&operator_bin);
    cmd.arg("--kubeconfig")
        .arg(plane.kubeconfig_path())
        .arg(format!("--program-fs-addr=127.0.0.1:{fs_port}"))
        .arg(format!(
            "--health-probe-bind-address=127.0.0.1:{probe_port}"
        ))
        .arg(format!("--watch-namespace={ns}"))
        .arg("--log-level=warn");
    let operator = spawn_guarded(cmd, "pko-operator", &dir.join(format!("operator-{ns}.log")))?;
    let pid = operator.pid();
    wait_for("operator readiness", Duration::from_secs(60), || async {
        let resp = reqwest::get(format!("http://127.0.0.1:{probe_port}/readyz"))
            .await
            .ok()?;
        resp.status().is_success().then_some(())
    })
    .await?;
    Ok((operator, fs_port, pid))
}

fn free_port() -> anyhow::Result<u16> {
    Ok(TcpListener::bind("127.0.0.1:0")?.local_addr()?.port())
}
