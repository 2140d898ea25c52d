//! `make chaos`: the chaos and hostile-load scenarios at full scale on a private control
//! plane, written to docs/reliability.md. Exits non-zero when an invariant did not hold (the
//! report is written either way).
//!
//! Flags: `--out <file>`, `--scale full|short`, `--only webhook,fileserver,listeners,modules,agent,kill,apiserver,leader`,
//! `--seed <n>` (random by default; printed in the report).
#![allow(
    clippy::disallowed_methods,
    reason = "a test process is configured by its environment (make sets the tool and fixture paths)"
)]

use std::path::PathBuf;
use std::time::Instant;

use anyhow::{Context, bail};
use pko_tests::chaos::{self, Scale, Section};
use pko_tests::{ControlPlane, StartOptions};

const SCENARIOS: [&str; 8] = [
    "webhook",
    "fileserver",
    "listeners",
    "modules",
    "agent",
    "kill",
    "apiserver",
    "leader",
];

struct Args {
    out: PathBuf,
    scale: Scale,
    only: Vec<String>,
    seed: u64,
}

fn parse_args() -> anyhow::Result<Args> {
    let mut args = Args {
        out: PathBuf::from("docs/reliability.md"),
        scale: Scale::FULL,
        only: SCENARIOS.iter().map(|s| (*s).to_owned()).collect(),
        seed: rand::random(),
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let value = it.next().with_context(|| format!("{flag} needs a value"))?;
        match flag.as_str() {
            "--out" => args.out = PathBuf::from(value),
            "--scale" => {
                args.scale = match value.as_str() {
                    "full" => Scale::FULL,
                    "short" => Scale::SHORT,
                    other => bail!("--scale is full or short, not {other}"),
                }
            }
            "--only" => {
                args.only = value.split(',').map(str::to_owned).collect();
                if let Some(unknown) = args.only.iter().find(|s| !SCENARIOS.contains(&s.as_str())) {
                    bail!("unknown scenario {unknown}; known: {}", SCENARIOS.join(","));
                }
            }
            "--seed" => args.seed = value.parse().context("--seed takes a number")?,
            other => bail!("unknown flag {other}"),
        }
    }
    Ok(args)
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let _ = rustls::crypto::ring::default_provider().install_default();
    let args = parse_args()?;
    // A private plane in a temporary folder of its own, removed when it stops.
    let plane = ControlPlane::start(StartOptions::default()).await?;
    let started = Instant::now();
    let mut sections: Vec<Section> = Vec::new();
    for name in &args.only {
        println!("chaos: {name} ({} scale)…", args.scale.name);
        let scale = &args.scale;
        let section = match name.as_str() {
            "webhook" => chaos::webhook::storm(&plane, scale).await,
            "fileserver" => chaos::fileserver::invented_methods(&plane, scale, args.seed).await,
            "listeners" => chaos::listeners::section(&plane, scale).await,
            "modules" => chaos::modules::section(&plane, scale).await,
            "agent" => chaos::agent::section(&plane, scale).await,
            "kill" => chaos::reconcile::kills(&plane, scale, args.seed).await,
            "apiserver" => chaos::reconcile::apiserver_restart(scale).await,
            "leader" => chaos::leader::failover(&plane, scale).await,
            other => bail!("unknown scenario {other}"),
        }
        .with_context(|| format!("scenario {name}"))?;
        println!("{}", section.markdown());
        sections.push(section);
    }
    let report = chaos::report(&args.scale, &sections, started.elapsed());
    std::fs::write(&args.out, report).with_context(|| format!("writing {}", args.out.display()))?;
    println!("wrote {}", args.out.display());
    let failed: Vec<&str> = sections
        .iter()
        .filter(|s| !s.violations.is_empty())
        .map(|s| s.title.as_str())
        .collect();
    if !failed.is_empty() {
        bail!("invariants did not hold in: {}", failed.join("; "));
    }
    Ok(())
}
