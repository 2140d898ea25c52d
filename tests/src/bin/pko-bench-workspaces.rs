//! `make bench`, workspaces: what an operator restart costs with N initialized Workspaces. The
//! harness plays the kubelet (real agents, real `pulumi`); N Workspaces are created and
//! initialized (`pulumi install`, stack selection), then the operator is stopped (SIGTERM)
//! and started again. Measured: spawn → every Workspace reconciled by the new operator and
//! Ready, and how many it initialized again (the pod records what its agent was initialized
//! with, so the answer should be none). Writes its section of docs/benchmarks.md between its
//! markers, leaving the rest of the file alone.
#![allow(
    clippy::disallowed_methods,
    reason = "a test process is configured by its environment (make sets the tool and fixture paths)"
)]

use std::fmt::Write as _;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use kube::Api;
use kube::api::PostParams;
use pko_api::program::Program;
use pko_api::workspace::Workspace;
use pko_tests::kubelet::Kubelet;
use pko_tests::operator::{Operator, OperatorOptions};
use pko_tests::{ControlPlane, StartOptions, fixtures, wait_for};
use serde_json::json;

const BEGIN: &str = "<!-- workspace benchmarks: begin -->";
const END: &str = "<!-- workspace benchmarks: end -->";
/// How long one phase may take before the bench gives up.
const PHASE_TIMEOUT: Duration = Duration::from_secs(900);
/// SIGTERM grace of the operator being restarted.
const STOP_GRACE: Duration = Duration::from_secs(30);
/// What the operator logs once it has installed and initialized a workspace's agent.
const INITIALIZED: &str = "workspace initialized";
const PROGRAM: &str =
    r#"{"configuration": {"greeting": {"type": "String"}}, "outputs": {"message": "${greeting}"}}"#;

struct Args {
    out: PathBuf,
    workspaces: usize,
}

fn parse_args() -> anyhow::Result<Args> {
    let mut args = Args {
        out: PathBuf::from("docs/benchmarks.md"),
        workspaces: 20,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let value = it.next().with_context(|| format!("{flag} needs a value"))?;
        match flag.as_str() {
            "--out" => args.out = PathBuf::from(value),
            "--workspaces" => args.workspaces = value.parse().context("--workspaces")?,
            other => bail!("unknown flag {other}"),
        }
    }
    if args.workspaces == 0 {
        bail!("--workspaces must be at least 1");
    }
    Ok(args)
}

/// What one run measured.
struct Run {
    workspaces: usize,
    /// Create → every Workspace Ready, the first time (each installed and initialized).
    first: Duration,
    first_initialized: usize,
    /// Spawn of the new operator → every Workspace reconciled by it and Ready.
    restart: Duration,
    restart_initialized: usize,
    /// The new operator's CPU over the restart.
    restart_cpu: f64,
}

fn ready(ws: &Workspace) -> bool {
    ws.status.as_ref().is_some_and(|s| {
        s.observed_generation == ws.metadata.generation
            && s.conditions
                .iter()
                .any(|c| c.type_ == "Ready" && c.status == "True")
    })
}

async fn all_ready(api: &Api<Workspace>, count: usize) -> Option<()> {
    let list = api.list(&Default::default()).await.ok()?;
    (list.items.iter().filter(|w| ready(w)).count() >= count).then_some(())
}

fn operator_args(ns: &str) -> Vec<String> {
    vec![
        format!("--watch-namespace={ns}"),
        "--workspace-localhost=127.0.0.1".into(),
    ]
}

async fn run(args: &Args) -> anyhow::Result<Run> {
    let plane = ControlPlane::start(StartOptions::default()).await?;
    let ns = plane.namespace("bench-ws").await?;
    let tmp = tempfile::tempdir()?;
    let backend = tmp.path().join("backend");
    std::fs::create_dir_all(&backend)?;
    let kubelet = Kubelet::start(plane.try_client()?, &ns, &tmp.path().join("pods"))?;
    let operator = Operator::start(
        &plane,
        OperatorOptions {
            advertised: None,
            args: operator_args(&ns),
        },
    )
    .await?;
    let programs: Api<Program> = Api::namespaced(plane.try_client()?, &ns);
    let (url, digest) = fixtures::published_program(
        &programs,
        "hello",
        serde_json::from_str(PROGRAM)?,
        PHASE_TIMEOUT,
    )
    .await?;
    let api: Api<Workspace> = Api::namespaced(plane.try_client()?, &ns);
    let started = Instant::now();
    for i in 0..args.workspaces {
        let name = format!("w{i:03}");
        let ws = fixtures::workspace(
            &name,
            json!({
                "flux": {"url": url, "digest": digest},
                "env": [
                    {"name": "PULUMI_BACKEND_URL", "value": format!("file://{}", backend.display())},
                    {"name": "PULUMI_CONFIG_PASSPHRASE", "value": fixtures::PASSPHRASE},
                ],
                "stacks": [{"name": "dev", "create": true, "config": [{"key": "greeting", "value": name}]}],
            }),
        );
        api.create(&PostParams::default(), &ws).await?;
    }
    if let Err(e) = wait_for("every Workspace Ready", PHASE_TIMEOUT, || {
        all_ready(&api, args.workspaces)
    })
    .await
    {
        bail!("{e}\n{}", kubelet.logs("w000"));
    }
    let first = started.elapsed();
    let first_initialized = operator.log_text().matches(INITIALIZED).count();

    let mut operator = operator;
    operator.terminate(STOP_GRACE);
    let spawned = Instant::now();
    let restarted = Operator::start(
        &plane,
        OperatorOptions {
            advertised: None,
            args: operator_args(&ns),
        },
    )
    .await?;
    let reconciled = "pko_reconcile_duration_seconds_count{controller=\"workspace\"}";
    let count = args.workspaces as f64;
    wait_for(
        "every Workspace reconciled by the new operator and Ready",
        PHASE_TIMEOUT,
        || async {
            let done = restarted.metric(reconciled).await?;
            if done < count {
                return None;
            }
            all_ready(&api, args.workspaces).await
        },
    )
    .await
    .with_context(|| restarted.log_text())?;
    let restart = spawned.elapsed();
    let restart_cpu = restarted
        .pid()
        .and_then(pko_tests::pko_peer::cpu_seconds)
        .unwrap_or(0.0);
    let restart_initialized = restarted.log_text().matches(INITIALIZED).count();
    drop(kubelet);
    Ok(Run {
        workspaces: args.workspaces,
        first,
        first_initialized,
        restart,
        restart_initialized,
        restart_cpu,
    })
}

fn section(run: &Run) -> anyhow::Result<String> {
    let n = run.workspaces;
    let mut s = String::new();
    writeln!(s, "{BEGIN}")?;
    writeln!(s, "## Operator restart with initialized workspaces\n")?;
    writeln!(
        s,
        "{n} Workspaces of one small YAML program, each with a `file://` backend and one stack, \
         on a private control plane with the harness as kubelet (real agents and `pulumi`). They \
         are created and initialized (`pulumi install`, stack selection, config), then the \
         operator is stopped (SIGTERM) and started again. *Initializations* counts the \
         operator's `workspace initialized` log lines: each is an install and a stack \
         initialization. After the restart, each pod's `pko-rs.dev/initialized` annotation \
         says what its agent was initialized with, so none is needed. The first row's time \
         is mostly `pulumi install` and stack creation on 2 shared cores.\n"
    )?;
    // The operator is the binary next to this one: the same build profile.
    let build = if cfg!(debug_assertions) {
        "debug build (`cargo run --bin pko-bench-workspaces`)"
    } else {
        "release build (`make bench`)"
    };
    writeln!(s, "Operator: {build}.\n")?;
    writeln!(s, "| measure | time | initializations | operator CPU |")?;
    writeln!(s, "|---|---:|---:|---:|")?;
    writeln!(
        s,
        "| {n} Workspaces created → all Ready | {:.2} s | {} | |",
        run.first.as_secs_f64(),
        run.first_initialized
    )?;
    writeln!(
        s,
        "| operator restart with {n} initialized Workspaces: spawn → every one reconciled and Ready | {:.2} s | {} | {:.2} s |",
        run.restart.as_secs_f64(),
        run.restart_initialized,
        run.restart_cpu
    )?;
    writeln!(
        s,
        "\nLoad average when the run ended: {}.\n",
        pko_tests::measure::load_average()
    )?;
    writeln!(s, "{END}")?;
    Ok(s)
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = parse_args()?;
    let run = run(&args).await?;
    if run.restart_initialized > 0 {
        eprintln!(
            "warning: the restarted operator initialized {} workspaces again",
            run.restart_initialized
        );
    }
    let section = section(&run)?;
    print!("{section}");
    let current = std::fs::read_to_string(&args.out).unwrap_or_else(|_| "# Benchmarks\n".into());
    let updated = match (current.find(BEGIN), current.find(END)) {
        (Some(begin), Some(end)) if end > begin => format!(
            "{}{}{}",
            &current[..begin],
            section.trim_end(),
            &current[end + END.len()..]
        ),
        _ => format!("{}\n{}", current.trim_end(), section),
    };
    std::fs::write(&args.out, updated)
        .with_context(|| format!("writing {}", args.out.display()))?;
    println!("wrote the workspace section of {}", args.out.display());
    Ok(())
}
