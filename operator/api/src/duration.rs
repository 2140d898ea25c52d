//! Go duration strings, as Go's `time.ParseDuration` reads them: the one parser of every
//! duration pko-rs takes from outside (operator and webhook flags, `ttlAfterCompleted`,
//! `stack.spec.retryMaxBackoffDuration` and the like).
//!
//! PKO is written in Go and its users write Go durations, so the grammar and the limits are
//! Go's: a sequence of decimal numbers, each with an optional fraction and a unit (`ns`, `us`,
//! `µs`, `μs`, `ms`, `s`, `m`, `h`), such as `300ms`, `1.5h` or `2h45m`; `0` alone needs no
//! unit; no spaces; at most 2^63-1 nanoseconds (about 292 years), more is an error. A fraction
//! is resolved to nanoseconds exactly as Go does (through a float64), so both give the same
//! value for the same text.
//!
//! One difference: a leading `-` is refused (even `-0`). Every duration pko-rs reads is a
//! timeout, an interval or a time to live, where a negative value has no meaning; Go would
//! return it and leave the caller to misbehave. A leading `+` is accepted, as in Go.

use std::time::Duration;

/// Nanoseconds per unit, as in Go's `unitMap`.
const UNITS: [(&str, u64); 8] = [
    ("ns", 1),
    ("us", 1_000),
    ("µs", 1_000), // U+00B5 micro sign
    ("μs", 1_000), // U+03BC Greek small letter mu
    ("ms", 1_000_000),
    ("s", 1_000_000_000),
    ("m", 60_000_000_000),
    ("h", 3_600_000_000_000),
];

/// The largest duration Go can hold: `time.Duration` is an int64 of nanoseconds.
pub const MAX_NANOS: u64 = i64::MAX as u64;

/// Why a text is not a Go duration.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DurationError {
    #[error("invalid duration {0:?}: expected a Go duration such as 30s, 1m30s, 1.5h or 500ms")]
    Invalid(String),
    #[error("missing unit in duration {0:?}: add one of ns, us, ms, s, m, h (for example 30s)")]
    MissingUnit(String),
    #[error("unknown unit {unit:?} in duration {text:?}: use ns, us (µs), ms, s, m or h")]
    UnknownUnit { unit: String, text: String },
    #[error("duration {0:?} is negative: a timeout, interval or time to live must not be")]
    Negative(String),
    #[error("duration {0:?} is too long: at most 2562047h47m16.854775807s (Go's limit)")]
    Overflow(String),
}

/// Parses `text` as Go's `time.ParseDuration` does, refusing negative values (see the module
/// documentation).
pub fn parse_go_duration(text: &str) -> Result<Duration, DurationError> {
    let invalid = || DurationError::Invalid(text.to_owned());
    let overflow = || DurationError::Overflow(text.to_owned());
    let negative = || DurationError::Negative(text.to_owned());
    let mut s = text.as_bytes();
    let sign = s.first().copied();
    if matches!(sign, Some(b'-' | b'+')) {
        s = &s[1..];
    }
    // Refused only once the rest is known to be a duration, so "-x" is reported as invalid.
    let is_negative = sign == Some(b'-');
    if s == b"0" {
        return if is_negative {
            Err(negative())
        } else {
            Ok(Duration::ZERO)
        };
    }
    if s.is_empty() {
        return Err(invalid());
    }
    let mut total: u64 = 0;
    while !s.is_empty() {
        if !(s[0] == b'.' || s[0].is_ascii_digit()) {
            return Err(invalid());
        }
        let before = s.len();
        let (mut value, rest) = leading_int(s).ok_or_else(overflow)?;
        s = rest;
        let pre = before != s.len();
        let (mut fraction, mut scale, mut post) = (0u64, 1f64, false);
        if let Some((b'.', rest)) = s.split_first() {
            let before = rest.len();
            let (f, sc, rest) = leading_fraction(rest);
            (fraction, scale, s) = (f, sc, rest);
            post = before != s.len();
        }
        if !pre && !post {
            // No digits at all, such as ".s".
            return Err(invalid());
        }
        let unit_len = s
            .iter()
            .position(|&c| c == b'.' || c.is_ascii_digit())
            .unwrap_or(s.len());
        if unit_len == 0 {
            return Err(DurationError::MissingUnit(text.to_owned()));
        }
        let (unit, rest) = s.split_at(unit_len);
        s = rest;
        let Some(&(_, nanos)) = UNITS.iter().find(|(name, _)| name.as_bytes() == unit) else {
            return Err(DurationError::UnknownUnit {
                unit: String::from_utf8_lossy(unit).into_owned(),
                text: text.to_owned(),
            });
        };
        if value > (1 << 63) / nanos {
            return Err(overflow());
        }
        value *= nanos;
        if fraction > 0 {
            // Go's arithmetic, float64 included, so a fraction gives Go's nanosecond: the
            // product is at most 3.6e12 (a fraction of an hour), well inside u64.
            value += (fraction as f64 * (nanos as f64 / scale)) as u64;
            if value > 1 << 63 {
                return Err(overflow());
            }
        }
        total += value;
        if total > 1 << 63 {
            return Err(overflow());
        }
    }
    if is_negative {
        return Err(negative());
    }
    if total > MAX_NANOS {
        return Err(overflow());
    }
    Ok(Duration::from_nanos(total))
}

/// Go's `leadingInt`: the leading digits as a number, `None` past 2^63.
fn leading_int(s: &[u8]) -> Option<(u64, &[u8])> {
    let mut x: u64 = 0;
    let mut i = 0;
    while let Some(&c) = s.get(i).filter(|c| c.is_ascii_digit()) {
        if x > (1 << 63) / 10 {
            return None;
        }
        x = x * 10 + u64::from(c - b'0');
        if x > 1 << 63 {
            return None;
        }
        i += 1;
    }
    Some((x, &s[i..]))
}

/// Go's `leadingFraction`: the digits after the point, and 10^(digits kept); digits past
/// what a u64 holds are consumed and ignored.
fn leading_fraction(s: &[u8]) -> (u64, f64, &[u8]) {
    let (mut x, mut scale, mut overflowed) = (0u64, 1f64, false);
    let mut i = 0;
    while let Some(&c) = s.get(i).filter(|c| c.is_ascii_digit()) {
        i += 1;
        if overflowed {
            continue;
        }
        if x > ((1 << 63) - 1) / 10 {
            overflowed = true;
            continue;
        }
        let y = x * 10 + u64::from(c - b'0');
        if y > 1 << 63 {
            overflowed = true;
            continue;
        }
        x = y;
        scale *= 10.0;
    }
    (x, scale, &s[i..])
}

#[cfg(test)]
mod tests {
    use super::*;

    const SECOND: u64 = 1_000_000_000;
    const MILLI: u64 = 1_000_000;
    const MINUTE: u64 = 60 * SECOND;
    const HOUR: u64 = 60 * MINUTE;

    fn nanos(text: &str) -> Result<u64, DurationError> {
        parse_go_duration(text).map(|d| d.as_nanos() as u64)
    }

    /// Go's own `parseDurationTests` (src/time/time_test.go), the non-negative ones.
    #[test]
    fn gos_valid_cases() {
        for (text, want) in [
            ("0", 0),
            ("5s", 5 * SECOND),
            ("30s", 30 * SECOND),
            ("1478s", 1478 * SECOND),
            ("+5s", 5 * SECOND),
            ("+0", 0),
            ("5.0s", 5 * SECOND),
            ("5.6s", 5 * SECOND + 600 * MILLI),
            ("5.s", 5 * SECOND),
            (".5s", 500 * MILLI),
            ("1.0s", SECOND),
            ("1.00s", SECOND),
            ("1.004s", SECOND + 4 * MILLI),
            ("1.0040s", SECOND + 4 * MILLI),
            ("100.00100s", 100 * SECOND + MILLI),
            ("10ns", 10),
            ("11us", 11_000),
            ("12µs", 12_000),
            ("12μs", 12_000),
            ("13ms", 13 * MILLI),
            ("14s", 14 * SECOND),
            ("15m", 15 * MINUTE),
            ("16h", 16 * HOUR),
            ("3h30m", 3 * HOUR + 30 * MINUTE),
            ("10.5s4m", 4 * MINUTE + 10 * SECOND + 500 * MILLI),
            (
                "1h2m3s4ms5us6ns",
                HOUR + 2 * MINUTE + 3 * SECOND + 4 * MILLI + 5_000 + 6,
            ),
            (
                "39h9m14.425s",
                39 * HOUR + 9 * MINUTE + 14 * SECOND + 425 * MILLI,
            ),
            ("52763797000ns", 52_763_797_000),
            ("0.3333333333333333333h", 20 * MINUTE),
            ("9007199254740993ns", (1 << 53) + 1),
            ("9223372036854775807ns", MAX_NANOS),
            ("9223372036854775.807us", MAX_NANOS),
            ("9223372036s854ms775us807ns", MAX_NANOS),
            ("0.100000000000000000000h", 6 * MINUTE),
            (
                "0.830103483285477580700h",
                49 * MINUTE + 48 * SECOND + 372_539_827,
            ),
            // time.Duration(math.MaxInt64).String(): Go's round trip of the largest value.
            ("2562047h47m16.854775807s", MAX_NANOS),
        ] {
            assert_eq!(nanos(text), Ok(want), "{text:?}");
        }
    }

    /// Go's own `parseDurationErrorTests`, each with the reason given here.
    #[test]
    fn gos_invalid_cases() {
        use DurationError::*;
        let unknown = |unit: &str, text: &str| UnknownUnit {
            unit: unit.into(),
            text: text.into(),
        };
        let s = |t: &str| t.to_owned();
        for (text, want) in [
            ("", Invalid(s(""))),
            ("3", MissingUnit(s("3"))),
            ("-", Invalid(s("-"))),
            ("s", Invalid(s("s"))),
            (".", Invalid(s("."))),
            ("-.", Invalid(s("-."))),
            (".s", Invalid(s(".s"))),
            ("+.s", Invalid(s("+.s"))),
            ("1d", unknown("d", "1d")),
            ("\u{FFFD}", Invalid(s("\u{FFFD}"))),
            (
                "9223372036854775810ns",
                Overflow(s("9223372036854775810ns")),
            ),
            (
                "9223372036854775808ns",
                Overflow(s("9223372036854775808ns")),
            ),
            ("9223372036854776us", Overflow(s("9223372036854776us"))),
            ("3000000h", Overflow(s("3000000h"))),
            (
                "9223372036854775.808us",
                Overflow(s("9223372036854775.808us")),
            ),
            (
                "9223372036854ms775us808ns",
                Overflow(s("9223372036854ms775us808ns")),
            ),
        ] {
            assert_eq!(parse_go_duration(text), Err(want), "{text:?}");
        }
    }

    /// Go returns these; pko-rs refuses them (module documentation).
    #[test]
    fn negative_durations_are_refused() {
        for text in ["-5s", "-0", "-2m3.4s", "-9223372036854775808ns"] {
            assert_eq!(
                parse_go_duration(text),
                Err(DurationError::Negative(text.into())),
                "{text:?}"
            );
        }
    }

    /// What the three parsers this one replaced disagreed on, and what holds now.
    #[test]
    fn former_disagreements_follow_go() {
        // Bare numbers were seconds for the flags; Go asks for a unit (except for 0).
        assert!(matches!(
            parse_go_duration("15"),
            Err(DurationError::MissingUnit(_))
        ));
        // Fractions were refused by the operator's flags.
        assert_eq!(nanos("1.5s"), Ok(1_500 * MILLI));
        // ns and us were unknown to the flags; sequences to the webhook's flags.
        assert_eq!(nanos("2us"), Ok(2_000));
        assert_eq!(nanos("1m30s"), Ok(90 * SECOND));
        // The TTL parser refused "0" and trimmed spaces; Go does neither.
        assert_eq!(nanos("0"), Ok(0));
        assert!(parse_go_duration(" 1s").is_err());
        assert!(parse_go_duration("1s ").is_err());
        assert!(parse_go_duration("1 s").is_err());
        // Too long: the TTL parser panicked, the flags' parser capped at u64 milliseconds.
        assert!(matches!(
            parse_go_duration("99999999999999999999h"),
            Err(DurationError::Overflow(_))
        ));
        assert!(matches!(
            parse_go_duration("2562048h"),
            Err(DurationError::Overflow(_))
        ));
    }

    #[test]
    fn errors_say_what_to_write() {
        let message = |t: &str| parse_go_duration(t).expect_err(t).to_string();
        assert!(message("15").contains("for example 30s"));
        assert!(message("2 days").contains("unknown unit \" days\""));
        assert!(message("-1s").contains("negative"));
        assert!(message("3000000h").contains("too long"));
        assert!(message("abc").contains("expected a Go duration"));
    }

    /// Bounded in `make test`; `make fuzz-long` raises it with PKO_PROPTEST_CASES. Failures are
    /// not persisted: proptest prints the shrunk input, which becomes a unit test here.
    #[allow(
        clippy::disallowed_methods,
        reason = "the case count is the test process's setting"
    )]
    fn config(default_cases: u32) -> proptest::test_runner::Config {
        let cases = match std::env::var("PKO_PROPTEST_CASES") {
            Ok(v) => v
                .parse()
                .unwrap_or_else(|_| panic!("PKO_PROPTEST_CASES={v:?}: expected a case count")),
            Err(_) => default_cases,
        };
        proptest::test_runner::Config {
            cases,
            failure_persistence: None,
            ..Default::default()
        }
    }

    mod properties {
        use proptest::prelude::*;

        use super::*;

        /// Text near the grammar: digits, points, signs, unit letters, micro signs, spaces.
        fn near_go() -> impl Strategy<Value = String> {
            proptest::string::string_regex("[+-]?[0-9.nuµμmsh d]{0,24}").expect("regex")
        }

        fn unit() -> impl Strategy<Value = (&'static str, u64)> {
            proptest::sample::select(&UNITS[..])
        }

        proptest! {
            #![proptest_config(config(1024))]

            #[test]
            fn never_panics(text in any::<String>(), near in near_go()) {
                let _ = parse_go_duration(&text);
                let _ = parse_go_duration(&near);
            }

            /// Integer parts in any units add up exactly, up to Go's limit and never past it.
            #[test]
            fn sequences_add_up(parts in proptest::collection::vec((0u64..10_000_000_000, unit()), 1..6)) {
                let text: String = parts.iter().map(|(v, (u, _))| format!("{v}{u}")).collect();
                let sum: u128 = parts.iter().map(|(v, (_, n))| u128::from(*v) * u128::from(*n)).sum();
                match parse_go_duration(&text) {
                    Ok(d) => prop_assert_eq!(d.as_nanos(), sum),
                    Err(DurationError::Overflow(_)) => prop_assert!(sum > u128::from(MAX_NANOS)),
                    Err(e) => prop_assert!(false, "{text:?}: {e}"),
                }
            }

            /// Every representable duration, written as Go's Duration.String() writes it, reads
            /// back as itself; with `+` too, and refused with `-`.
            #[test]
            fn go_strings_round_trip(n in 0..=MAX_NANOS) {
                let text = go_string(n);
                prop_assert_eq!(nanos(&text), Ok(n), "{}", text);
                prop_assert_eq!(nanos(&format!("+{text}")), Ok(n));
                prop_assert_eq!(
                    parse_go_duration(&format!("-{text}")),
                    Err(DurationError::Negative(format!("-{text}")))
                );
            }

            /// An accepted text stays accepted with the same value when a zero part is added.
            #[test]
            fn zero_parts_change_nothing(text in near_go(), (u, _) in unit()) {
                if let Ok(d) = parse_go_duration(&text) && text != "0" && text != "+0" {
                    prop_assert_eq!(parse_go_duration(&format!("{text}0{u}")), Ok(d));
                }
            }
        }

        /// Go's `Duration.String()` (src/time/time.go), for non-negative values.
        fn go_string(n: u64) -> String {
            if n < 1_000_000_000 {
                let (unit, per) = match n {
                    0 => return "0s".into(),
                    1..1_000 => return format!("{n}ns"),
                    1_000..1_000_000 => ("µs", 1_000),
                    _ => ("ms", 1_000_000),
                };
                return format!("{}{unit}", decimal(n, per));
            }
            let (h, rest) = (n / HOUR, n % HOUR);
            let (m, rest) = (rest / MINUTE, rest % MINUTE);
            let s = decimal(rest, SECOND);
            match (h, m) {
                (0, 0) => format!("{s}s"),
                (0, m) => format!("{m}m{s}s"),
                (h, m) => format!("{h}h{m}m{s}s"),
            }
        }

        /// `n / per` with the fraction's trailing zeros dropped.
        fn decimal(n: u64, per: u64) -> String {
            let digits = per.ilog10() as usize;
            let fraction = format!("{:0digits$}", n % per);
            let fraction = fraction.trim_end_matches('0');
            if fraction.is_empty() {
                format!("{}", n / per)
            } else {
                format!("{}.{fraction}", n / per)
            }
        }
    }
}
