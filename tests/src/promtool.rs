//! PromQL evaluated by Prometheus's own engine over series scraped from a running operator:
//! what a dashboard or an alert would show. `promtool test rules` (built by
//! `tools/build.sh promtool`) loads the scrapes as its input series, one scrape per interval,
//! and evaluates each check at the last scrape.
//!
//! A check is a query that must return exactly one sample without labels, valued 1: write it
//! as `min(<query> <op> bool <bound>)` (the query returns data and each of its series is
//! within the bound) or `count(<query>) == bool <n>`. An empty query makes the check return
//! nothing, which fails it, so a dashboard panel that would be blank fails the test.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::process::Command;
use std::time::Duration;

use serde_json::json;

use crate::prom;

/// Scrapes of one target, in order; every sample gets the target's labels (as Prometheus
/// adds `job` and `instance`).
#[derive(Debug, Default)]
pub struct Scrapes {
    target: Vec<(String, String)>,
    series: BTreeMap<String, Vec<Option<f64>>>,
    count: usize,
}

impl Scrapes {
    pub fn new(target: &[(&str, &str)]) -> Self {
        Self {
            target: target
                .iter()
                .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
                .collect(),
            ..Self::default()
        }
    }

    /// Adds one scrape (an OpenMetrics or Prometheus text exposition).
    pub fn add(&mut self, text: &str) {
        for (name, labels, value) in prom::samples(text) {
            let pairs: Vec<(String, String)> = labels
                .pairs()
                .iter()
                .cloned()
                .chain(self.target.iter().cloned())
                .collect();
            let values = self.series.entry(series_text(&name, &pairs)).or_default();
            values.resize(self.count, None);
            values.push(Some(value));
        }
        self.count += 1;
    }

    /// Scrapes added.
    pub fn len(&self) -> usize {
        self.count
    }

    pub fn is_empty(&self) -> bool {
        self.count == 0
    }

    /// Whether some series has this name (at any scrape).
    pub fn has(&self, name: &str) -> bool {
        self.series
            .keys()
            .any(|s| s == name || s.starts_with(&format!("{name}{{")))
    }

    /// promtool's `input_series`: each series' values, `_` where a scrape lacked it.
    fn input_series(&self) -> Vec<serde_json::Value> {
        self.series
            .iter()
            .map(|(series, values)| {
                let values: Vec<String> = (0..self.count)
                    .map(|i| match values.get(i).copied().flatten() {
                        Some(v) => number(v),
                        None => "_".to_owned(),
                    })
                    .collect();
                json!({"series": series, "values": values.join(" ")})
            })
            .collect()
    }
}

/// `name{a="x",b="y"}` with PromQL's string escapes.
fn series_text(name: &str, labels: &[(String, String)]) -> String {
    if labels.is_empty() {
        return name.to_owned();
    }
    let inner: Vec<String> = labels
        .iter()
        .map(|(k, v)| {
            let escaped = v
                .replace('\\', "\\\\")
                .replace('"', "\\\"")
                .replace('\n', "\\n");
            format!("{k}=\"{escaped}\"")
        })
        .collect();
    format!("{name}{{{}}}", inner.join(","))
}

/// A value as promtool's series notation reads it.
fn number(v: f64) -> String {
    if v.is_nan() {
        "NaN".to_owned()
    } else if v == f64::INFINITY {
        "Inf".to_owned()
    } else if v == f64::NEG_INFINITY {
        "-Inf".to_owned()
    } else {
        format!("{v}")
    }
}

/// promtool's binary.
pub fn promtool() -> Result<PathBuf, crate::HarnessError> {
    Ok(crate::tool_dir("promtool")?.join("promtool"))
}

/// Evaluates every `(name, expr)` check at the last of `scrapes` (placed `interval` apart);
/// each must return one sample `{}` valued 1. `Err` holds promtool's report: every failed
/// check with what it returned.
pub fn check(
    scrapes: &Scrapes,
    interval: Duration,
    checks: &[(&str, String)],
) -> Result<String, String> {
    let last = interval.as_secs() * (scrapes.len().max(1) as u64 - 1);
    let tests: Vec<serde_json::Value> = checks
        .iter()
        .map(|(_, expr)| {
            json!({
                "expr": expr,
                "eval_time": format!("{last}s"),
                "exp_samples": [{"labels": "{}", "value": 1}],
            })
        })
        .collect();
    let file = json!({
        "rule_files": [],
        "evaluation_interval": format!("{}s", interval.as_secs()),
        "tests": [{
            "name": "pko-rs scrapes",
            "interval": format!("{}s", interval.as_secs()),
            "input_series": scrapes.input_series(),
            "promql_expr_test": tests,
        }],
    });
    let dir = tempfile::tempdir().map_err(|e| format!("temp dir: {e}"))?;
    let path = dir.path().join("checks.yaml");
    // JSON is YAML.
    std::fs::write(
        &path,
        serde_json::to_string_pretty(&file).map_err(|e| e.to_string())?,
    )
    .map_err(|e| format!("writing {}: {e}", path.display()))?;
    let promtool = promtool().map_err(|e| e.to_string())?;
    let out = Command::new(&promtool)
        .args(["test", "rules"])
        .arg(&path)
        .output()
        .map_err(|e| format!("running {}: {e}", promtool.display()))?;
    let report = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    if out.status.success() {
        Ok(report)
    } else {
        let names: Vec<String> = checks
            .iter()
            .map(|(name, expr)| format!("  {name}: {expr}"))
            .collect();
        Err(format!("{report}\nchecks:\n{}", names.join("\n")))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn scrapes_become_series_with_gaps() {
        let mut scrapes = Scrapes::new(&[("job", "pko-rs")]);
        scrapes.add("a_total{x=\"1\"} 1\n# EOF\n");
        scrapes.add("a_total{x=\"1\"} 3\nb{y=\"q\\\"\"} 0.5\n");
        let series = scrapes.input_series();
        assert_eq!(
            series,
            vec![
                json!({"series": "a_total{x=\"1\",job=\"pko-rs\"}", "values": "1 3"}),
                json!({"series": "b{y=\"q\\\"\",job=\"pko-rs\"}", "values": "_ 0.5"}),
            ]
        );
        assert!(scrapes.has("a_total") && !scrapes.has("a"));
    }
}
