//! The ratios `make bench` records (pko-rs against PKO v2.9.0, each oriented so that more is
//! better for pko-rs) and the guard `make bench-check` applies to a later, shorter run: a
//! ratio may not fall more than a given fraction below its recorded value. Only ratios are
//! compared, never absolute times, so a slower or busier machine does not fail the check.

use std::collections::BTreeMap;
use std::path::Path;

use serde::{Deserialize, Serialize};

use crate::HarnessError;

/// The key prefix of the Stack section's ratios (`pko-bench-stacks` adds them to the file the
/// Program section writes first; each keeps the other's).
pub const STACKS_PREFIX: &str = "stacks-";

/// A recorded set of ratios, keyed by measure (`reconcile-in-flight/1000`, …).
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct Baseline {
    /// What the file is and how to refresh it.
    #[serde(default)]
    pub about: String,
    /// When the ratios were measured (UTC).
    #[serde(default)]
    pub recorded: String,
    /// The machine they were measured on.
    #[serde(default)]
    pub machine: String,
    /// pko-rs's advantage per measure: > 1 means pko-rs did better than PKO v2.9.0.
    pub ratios: BTreeMap<String, f64>,
}

/// One ratio that fell below its floor.
#[derive(Clone, Debug, PartialEq)]
pub struct Regression {
    pub key: String,
    pub baseline: f64,
    pub current: f64,
    pub floor: f64,
}

impl std::fmt::Display for Regression {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{}: pko-rs/PKO advantage {:.3}× is below {:.3}× (baseline {:.3}×, {:.0}% lower)",
            self.key,
            self.current,
            self.floor,
            self.baseline,
            (1.0 - self.current / self.baseline) * 100.0
        )
    }
}

/// What a check compared.
#[derive(Clone, Debug, Default)]
pub struct CheckOutcome {
    /// Keys present in both, with (baseline, current).
    pub compared: Vec<(String, f64, f64)>,
    /// Keys of the current run the baseline lacks (not checked).
    pub unrecorded: Vec<String>,
    pub regressions: Vec<Regression>,
}

impl Baseline {
    pub fn read(path: &Path) -> Result<Self, HarnessError> {
        let text = std::fs::read_to_string(path)
            .map_err(|e| HarnessError::io(format!("reading baseline {}", path.display()), e))?;
        serde_json::from_str(&text).map_err(|e| HarnessError::Manifest {
            path: path.to_path_buf(),
            message: format!("not a bench baseline: {e}"),
        })
    }

    pub fn write(&self, path: &Path) -> Result<(), HarnessError> {
        let mut text = serde_json::to_string_pretty(self).map_err(|e| {
            HarnessError::io(
                format!("encoding baseline {}", path.display()),
                std::io::Error::other(e),
            )
        })?;
        text.push('\n');
        std::fs::write(path, text)
            .map_err(|e| HarnessError::io(format!("writing baseline {}", path.display()), e))
    }

    /// Compares `current` with the recorded ratios: a key fails when its current ratio is
    /// below `(1 - tolerance) ×` the recorded one. Non-finite values are never compared.
    pub fn check(&self, current: &BTreeMap<String, f64>, tolerance: f64) -> CheckOutcome {
        let mut outcome = CheckOutcome::default();
        for (key, &now) in current {
            let Some(&then) = self.ratios.get(key) else {
                outcome.unrecorded.push(key.clone());
                continue;
            };
            if !now.is_finite() || !then.is_finite() || then <= 0.0 {
                continue;
            }
            outcome.compared.push((key.clone(), then, now));
            let floor = then * (1.0 - tolerance);
            if now < floor {
                outcome.regressions.push(Regression {
                    key: key.clone(),
                    baseline: then,
                    current: now,
                    floor,
                });
            }
        }
        outcome
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_ratio_more_than_the_tolerance_below_fails_and_others_pass() {
        let baseline = Baseline {
            ratios: BTreeMap::from([
                ("a".to_string(), 2.0),
                ("b".to_string(), 1.0),
                ("c".to_string(), 1.0),
            ]),
            ..Baseline::default()
        };
        let current = BTreeMap::from([
            ("a".to_string(), 1.49),
            ("b".to_string(), 0.76),
            ("c".to_string(), f64::INFINITY),
            ("d".to_string(), 0.1),
        ]);
        let outcome = baseline.check(&current, 0.25);
        assert_eq!(outcome.regressions.len(), 1);
        assert_eq!(outcome.regressions[0].key, "a");
        assert_eq!(outcome.unrecorded, vec!["d".to_string()]);
        assert_eq!(outcome.compared.len(), 2);
    }
}
