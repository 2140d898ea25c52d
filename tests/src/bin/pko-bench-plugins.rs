//! `make bench`, transform plugins: writes its section of docs/benchmarks.md (between its
//! markers, leaving the rest of the file alone). In-process; see `pko_tests::plugin_bench`.
#![allow(
    clippy::disallowed_methods,
    reason = "a test process is configured by its environment (make sets the tool and fixture paths)"
)]

use std::fmt::Write as _;
use std::path::PathBuf;

use anyhow::{Context, bail};

const BEGIN: &str = "<!-- plugin benchmarks: begin -->";
const END: &str = "<!-- plugin benchmarks: end -->";

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let mut out = PathBuf::from("docs/benchmarks.md");
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let value = it.next().with_context(|| format!("{flag} needs a value"))?;
        match flag.as_str() {
            "--out" => out = PathBuf::from(value),
            other => bail!("unknown flag {other}"),
        }
    }
    let body = pko_tests::plugin_bench::run().await?;
    let load = pko_tests::plugin_bench::load_average();
    let mut section = String::new();
    writeln!(section, "{BEGIN}")?;
    section.push_str(&body);
    writeln!(
        section,
        "Load average when the run ended: {load} (the machine's 2 cores are shared with \
         whatever else runs; p99s move most).\n"
    )?;
    writeln!(section, "{END}")?;
    let current = std::fs::read_to_string(&out).unwrap_or_else(|_| "# Benchmarks\n".into());
    let updated = match (current.find(BEGIN), current.find(END)) {
        (Some(begin), Some(end)) if end > begin => format!(
            "{}{}{}",
            &current[..begin],
            section.trim_end(),
            &current[end + END.len()..]
        ),
        _ => format!("{}\n{}", current.trim_end(), section),
    };
    std::fs::write(&out, updated).with_context(|| format!("writing {}", out.display()))?;
    println!("wrote the plugin section of {}", out.display());
    Ok(())
}
