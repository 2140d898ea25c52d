//! How long an operation may run: the operator's `--operation-timeout` and the Update's own
//! `spec.operationTimeout`, whichever is shorter.
//!
//! A tenant may shorten the operator's bound, never lengthen it: the bound is what keeps one
//! tenant's hung operations from holding slots for ever.

use std::time::Duration;

use pko_api::duration::{DurationError, parse_go_duration};

/// The bound of one operation: the shorter of `operator` and the Update's `spec` (a Go
/// duration); zero, or nothing given, is no bound of its own.
pub(super) fn effective(
    operator: Option<Duration>,
    spec: Option<&str>,
) -> Result<Option<Duration>, DurationError> {
    let spec = spec
        .map(parse_go_duration)
        .transpose()?
        .filter(|d| !d.is_zero());
    let operator = operator.filter(|d| !d.is_zero());
    Ok(match (operator, spec) {
        (Some(a), Some(b)) => Some(a.min(b)),
        (a, b) => a.or(b),
    })
}

/// The Failed condition's message of an operation stopped at `timeout`.
pub(super) fn message(timeout: Duration) -> String {
    format!(
        "the operation ran longer than its timeout of {} (spec.operationTimeout, at most --operation-timeout) and was canceled at the workspace agent",
        humantime(timeout)
    )
}

/// `90s`, `1.5s`, `250ms`: short and exact enough for a message.
fn humantime(d: Duration) -> String {
    if d.subsec_nanos() == 0 {
        format!("{}s", d.as_secs())
    } else if d < Duration::from_secs(1) {
        format!("{}ms", d.as_millis())
    } else {
        format!("{:.3}s", d.as_secs_f64())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const S: fn(u64) -> Duration = Duration::from_secs;

    #[test]
    fn the_shorter_bound_wins_and_a_tenant_cannot_lengthen_the_operators() {
        assert_eq!(effective(None, None), Ok(None));
        assert_eq!(effective(Some(S(3600)), None), Ok(Some(S(3600))));
        assert_eq!(effective(None, Some("90s")), Ok(Some(S(90))));
        assert_eq!(effective(Some(S(3600)), Some("90s")), Ok(Some(S(90))));
        assert_eq!(effective(Some(S(60)), Some("1000h")), Ok(Some(S(60))));
        // Zero is no bound of its own, on either side.
        assert_eq!(effective(Some(S(60)), Some("0")), Ok(Some(S(60))));
        assert_eq!(
            effective(Some(Duration::ZERO), Some("5m")),
            Ok(Some(S(300)))
        );
        assert_eq!(effective(Some(Duration::ZERO), None), Ok(None));
    }

    #[test]
    fn a_bad_duration_is_refused_with_the_parsers_reason() {
        for bad in ["", "ten minutes", "-5m", "5"] {
            let err = effective(Some(S(60)), Some(bad)).expect_err(bad);
            assert!(!err.to_string().is_empty(), "{bad}");
        }
    }

    #[test]
    fn the_message_names_the_timeout_and_both_knobs() {
        let m = message(S(2));
        assert!(m.contains("timeout of 2s"), "{m}");
        assert!(m.contains("spec.operationTimeout") && m.contains("--operation-timeout"));
        assert!(message(Duration::from_millis(250)).contains("250ms"));
        assert!(message(Duration::from_millis(1500)).contains("1.500s"));
    }
}
