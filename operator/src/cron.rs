//! Standard 5-field cron schedules (minute, hour, day of month, month, day of week) with an
//! optional `CRON_TZ=<IANA zone> ` prefix, for a Stack's drift detection schedules: the next
//! tick after a time, and the latest tick at or before one. Pure: no clock is read here.
//!
//! Fields take `*`, numbers, lists (`1,15`), ranges (`1-5`), steps (`*/15`, `10-40/10`, `5/20`)
//! and the names `JAN`–`DEC` and `SUN`–`SAT`; day of week 0 and 7 are Sunday. As in Vixie cron,
//! when both day fields are restricted a day matching either runs; `@hourly`, `@daily`
//! (`@midnight`), `@weekly`, `@monthly` and `@yearly` (`@annually`) are accepted too.
//!
//! Ticks are civil times in the schedule's zone (UTC without a prefix): a time skipped by a
//! daylight-saving jump runs as much later as the jump (02:30 → 03:30), a time repeated runs
//! once, the first time.

use jiff::civil::{Date, DateTime};
use jiff::tz::TimeZone;
use jiff::{Timestamp, ToSpan};

/// Why a schedule cannot be used.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CronError {
    #[error("expected 5 fields (minute hour day-of-month month day-of-week), found {0}")]
    FieldCount(usize),
    #[error("{field} field {text:?}: {why}")]
    Field {
        field: &'static str,
        text: String,
        why: String,
    },
    #[error("unknown time zone {zone:?} in CRON_TZ: {why}")]
    Zone { zone: String, why: String },
    #[error(
        "unknown macro {0:?} (known: @yearly, @annually, @monthly, @weekly, @daily, @midnight, @hourly)"
    )]
    Macro(String),
}

/// One field's allowed values, bit `n` for value `n`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Field {
    bits: u64,
    /// Written as `*` (or `*/n`): for the day fields' either-or rule.
    star: bool,
}

impl Field {
    fn has(self, n: u8) -> bool {
        n < 64 && self.bits & (1 << n) != 0
    }
}

/// A parsed schedule.
#[derive(Debug, Clone)]
pub struct Schedule {
    minutes: Field,
    hours: Field,
    days: Field,
    months: Field,
    weekdays: Field,
    zone: TimeZone,
}

/// How far a search looks before giving up: a schedule such as `0 0 30 2 *` (February 30th)
/// never fires, and the search must end.
const SEARCH_YEARS: i16 = 8;

const MONTHS: [&str; 12] = [
    "JAN", "FEB", "MAR", "APR", "MAY", "JUN", "JUL", "AUG", "SEP", "OCT", "NOV", "DEC",
];
const WEEKDAYS: [&str; 7] = ["SUN", "MON", "TUE", "WED", "THU", "FRI", "SAT"];

impl Schedule {
    /// Parses `[CRON_TZ=<zone> ]<5 fields>` (or a macro after the optional prefix).
    pub fn parse(text: &str) -> Result<Self, CronError> {
        let text = text.trim();
        let (zone, rest) = match text.strip_prefix("CRON_TZ=") {
            Some(rest) => {
                let (name, rest) = rest.split_once(char::is_whitespace).unwrap_or((rest, ""));
                let zone = TimeZone::get(name).map_err(|e| CronError::Zone {
                    zone: name.to_owned(),
                    why: e.to_string(),
                })?;
                (zone, rest.trim())
            }
            None => (TimeZone::UTC, text),
        };
        let expanded = match rest {
            "@yearly" | "@annually" => "0 0 1 1 *",
            "@monthly" => "0 0 1 * *",
            "@weekly" => "0 0 * * 0",
            "@daily" | "@midnight" => "0 0 * * *",
            "@hourly" => "0 * * * *",
            other if other.starts_with('@') => return Err(CronError::Macro(other.to_owned())),
            other => other,
        };
        let fields: Vec<&str> = expanded.split_whitespace().collect();
        let [minute, hour, day, month, weekday] = fields[..] else {
            return Err(CronError::FieldCount(fields.len()));
        };
        let mut weekdays = field("day-of-week", weekday, 0, 7, &WEEKDAYS)?;
        // 7 is Sunday too.
        if weekdays.has(7) {
            weekdays.bits = (weekdays.bits | 1) & !(1 << 7);
        }
        Ok(Self {
            minutes: field("minute", minute, 0, 59, &[])?,
            hours: field("hour", hour, 0, 23, &[])?,
            days: field("day-of-month", day, 1, 31, &[])?,
            months: field("month", month, 1, 12, &MONTHS)?,
            weekdays,
            zone,
        })
    }

    fn day_matches(&self, date: Date) -> bool {
        let day = self.days.has(date.day() as u8);
        let weekday = self
            .weekdays
            .has(date.weekday().to_sunday_zero_offset() as u8);
        if self.days.star || self.weekdays.star {
            day && weekday
        } else {
            day || weekday
        }
    }

    /// The instant of a civil time in the schedule's zone (a skipped time is shifted by the
    /// jump, a repeated one is its first occurrence).
    fn instant(&self, at: DateTime) -> Option<Timestamp> {
        self.zone.to_ambiguous_timestamp(at).compatible().ok()
    }

    /// The first tick strictly after `after`; `None` when the schedule never fires (within
    /// [`SEARCH_YEARS`]).
    pub fn next_after(&self, after: Timestamp) -> Option<Timestamp> {
        let start = self.zone.to_datetime(after);
        let mut at = truncate(start).checked_add(1.minute()).ok()?;
        let limit = start.year().saturating_add(SEARCH_YEARS);
        while at.year() <= limit {
            if !self.months.has(at.month() as u8) {
                at = at
                    .date()
                    .first_of_month()
                    .checked_add(1.month())
                    .ok()?
                    .at(0, 0, 0, 0);
            } else if !self.day_matches(at.date()) {
                at = at.date().tomorrow().ok()?.at(0, 0, 0, 0);
            } else if !self.hours.has(at.hour() as u8) {
                at = at
                    .date()
                    .at(at.hour(), 0, 0, 0)
                    .checked_add(1.hour())
                    .ok()?;
            } else if !self.minutes.has(at.minute() as u8) {
                at = at.checked_add(1.minute()).ok()?;
            } else {
                match self.instant(at) {
                    Some(t) if t > after => return Some(t),
                    _ => at = at.checked_add(1.minute()).ok()?,
                }
            }
        }
        None
    }

    /// The latest tick at or before `now`; `None` when there is none (within
    /// [`SEARCH_YEARS`]).
    pub fn latest_at_or_before(&self, now: Timestamp) -> Option<Timestamp> {
        let start = self.zone.to_datetime(now);
        let mut at = truncate(start);
        let limit = start.year().saturating_sub(SEARCH_YEARS);
        while at.year() >= limit {
            if !self.months.has(at.month() as u8) {
                at = at
                    .date()
                    .first_of_month()
                    .yesterday()
                    .ok()?
                    .at(23, 59, 0, 0);
            } else if !self.day_matches(at.date()) {
                at = at.date().yesterday().ok()?.at(23, 59, 0, 0);
            } else if !self.hours.has(at.hour() as u8) {
                at = at
                    .date()
                    .at(at.hour(), 0, 0, 0)
                    .checked_sub(1.minute())
                    .ok()?;
            } else if !self.minutes.has(at.minute() as u8) {
                at = at.checked_sub(1.minute()).ok()?;
            } else {
                match self.instant(at) {
                    Some(t) if t <= now => return Some(t),
                    _ => at = at.checked_sub(1.minute()).ok()?,
                }
            }
        }
        None
    }
}

fn truncate(at: DateTime) -> DateTime {
    at.date().at(at.hour(), at.minute(), 0, 0)
}

/// One field: `*`, values, names, ranges and steps, comma-separated, within `min..=max`.
fn field(
    name: &'static str,
    text: &str,
    min: u8,
    max: u8,
    names: &[&str],
) -> Result<Field, CronError> {
    let bad = |why: String| CronError::Field {
        field: name,
        text: text.to_owned(),
        why,
    };
    let value = |v: &str| -> Result<u8, CronError> {
        // Names count from `min` (JAN is 1, SUN is 0).
        if let Some(i) = names.iter().position(|n| n.eq_ignore_ascii_case(v)) {
            return Ok(min + i as u8);
        }
        let n: u8 = v
            .parse()
            .map_err(|_| bad(format!("{v:?} is not a number or a known name")))?;
        if n < min || n > max {
            return Err(bad(format!("{n} is outside {min}-{max}")));
        }
        Ok(n)
    };
    let mut out = Field {
        bits: 0,
        star: false,
    };
    for item in text.split(',') {
        let (range, step) = match item.split_once('/') {
            Some((range, step)) => {
                let step: u8 = step
                    .parse()
                    .ok()
                    .filter(|s| *s > 0)
                    .ok_or_else(|| bad(format!("step {step:?} is not a positive number")))?;
                (range, Some(step))
            }
            None => (item, None),
        };
        let (low, high) = if range == "*" {
            out.star = true;
            (min, max)
        } else if let Some((a, b)) = range.split_once('-') {
            let (a, b) = (value(a)?, value(b)?);
            if a > b {
                return Err(bad(format!("range {a}-{b} runs backwards")));
            }
            (a, b)
        } else {
            let a = value(range)?;
            // `5/20` is `5-<max>/20`.
            (a, if step.is_some() { max } else { a })
        };
        let step = step.unwrap_or(1);
        let mut n = low;
        while n <= high {
            out.bits |= 1 << n;
            n = match n.checked_add(step) {
                Some(next) => next,
                None => break,
            };
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(text: &str) -> Timestamp {
        text.parse().expect("timestamp")
    }

    fn next(cron: &str, after: &str) -> String {
        Schedule::parse(cron)
            .expect("schedule")
            .next_after(at(after))
            .expect("a tick")
            .to_string()
    }

    fn latest(cron: &str, now: &str) -> String {
        Schedule::parse(cron)
            .expect("schedule")
            .latest_at_or_before(at(now))
            .expect("a tick")
            .to_string()
    }

    #[test]
    fn every_minute_ticks_on_the_minute() {
        assert_eq!(
            next("* * * * *", "2026-01-01T10:00:00Z"),
            "2026-01-01T10:01:00Z"
        );
        assert_eq!(
            next("* * * * *", "2026-01-01T10:00:30Z"),
            "2026-01-01T10:01:00Z"
        );
        assert_eq!(
            latest("* * * * *", "2026-01-01T10:00:30Z"),
            "2026-01-01T10:00:00Z"
        );
        // A tick exactly now is the latest.
        assert_eq!(
            latest("* * * * *", "2026-01-01T10:00:00Z"),
            "2026-01-01T10:00:00Z"
        );
    }

    #[test]
    fn lists_ranges_steps_and_names() {
        assert_eq!(
            next("*/15 * * * *", "2026-01-01T10:16:00Z"),
            "2026-01-01T10:30:00Z"
        );
        assert_eq!(
            next("10-40/10 * * * *", "2026-01-01T10:41:00Z"),
            "2026-01-01T11:10:00Z"
        );
        assert_eq!(
            next("5/20 * * * *", "2026-01-01T10:46:00Z"),
            "2026-01-01T11:05:00Z"
        );
        assert_eq!(
            next("0 9,17 * * *", "2026-01-01T09:00:00Z"),
            "2026-01-01T17:00:00Z"
        );
        // 2026-01-01 is a Thursday: the next weekday morning is Friday, then Monday.
        assert_eq!(
            next("30 8 * * MON-FRI", "2026-01-01T09:00:00Z"),
            "2026-01-02T08:30:00Z"
        );
        assert_eq!(
            next("30 8 * * mon-fri", "2026-01-02T09:00:00Z"),
            "2026-01-05T08:30:00Z"
        );
        assert_eq!(
            next("0 0 1 jan,jul *", "2026-01-02T00:00:00Z"),
            "2026-07-01T00:00:00Z"
        );
        // Sunday is 0 and 7.
        assert_eq!(
            next("0 0 * * 7", "2026-01-01T00:00:00Z"),
            "2026-01-04T00:00:00Z"
        );
        assert_eq!(
            latest("0 0 * * SUN", "2026-01-03T00:00:00Z"),
            "2025-12-28T00:00:00Z"
        );
        assert_eq!(
            next("@daily", "2026-01-01T00:00:00Z"),
            "2026-01-02T00:00:00Z"
        );
        assert_eq!(
            latest("@monthly", "2026-03-15T12:00:00Z"),
            "2026-03-01T00:00:00Z"
        );
    }

    #[test]
    fn restricted_day_fields_run_on_either() {
        // The 13th, or any Friday: 2026-01-02 is a Friday, before the 13th.
        assert_eq!(
            next("0 0 13 * FRI", "2026-01-01T00:00:00Z"),
            "2026-01-02T00:00:00Z"
        );
        // With one day field a star, both must hold: Friday the 13th (February 2026).
        assert_eq!(
            next("0 0 13 * *", "2026-01-14T00:00:00Z"),
            "2026-02-13T00:00:00Z"
        );
        assert_eq!(
            next("0 0 */1 * FRI", "2026-01-03T00:00:00Z"),
            "2026-01-09T00:00:00Z"
        );
    }

    #[test]
    fn leap_days_and_impossible_dates() {
        assert_eq!(
            next("0 0 29 2 *", "2026-01-01T00:00:00Z"),
            "2028-02-29T00:00:00Z"
        );
        assert_eq!(
            latest("0 0 29 2 *", "2027-01-01T00:00:00Z"),
            "2024-02-29T00:00:00Z"
        );
        let never = Schedule::parse("0 0 30 2 *").expect("valid fields");
        assert_eq!(never.next_after(at("2026-01-01T00:00:00Z")), None);
        assert_eq!(never.latest_at_or_before(at("2026-01-01T00:00:00Z")), None);
    }

    #[test]
    fn cron_tz_ticks_in_the_zone_across_daylight_saving() {
        // 09:00 in Paris is 08:00 UTC in winter, 07:00 UTC in summer.
        let cron = "CRON_TZ=Europe/Paris 0 9 * * *";
        assert_eq!(next(cron, "2026-01-10T12:00:00Z"), "2026-01-11T08:00:00Z");
        assert_eq!(next(cron, "2026-07-10T12:00:00Z"), "2026-07-11T07:00:00Z");
        assert_eq!(latest(cron, "2026-07-10T06:59:00Z"), "2026-07-09T07:00:00Z");
        // 02:30 does not exist on 2026-03-29 in Paris (02:00 → 03:00): it runs at 03:30 local.
        let skipped = "CRON_TZ=Europe/Paris 30 2 * * *";
        assert_eq!(
            next(skipped, "2026-03-28T12:00:00Z"),
            "2026-03-29T01:30:00Z"
        );
        // 02:30 happens twice on 2026-10-25 (03:00 → 02:00): it runs once, the first time.
        assert_eq!(
            next(skipped, "2026-10-24T12:00:00Z"),
            "2026-10-25T00:30:00Z"
        );
        assert_eq!(
            next(skipped, "2026-10-25T00:30:00Z"),
            "2026-10-26T01:30:00Z"
        );
    }

    #[test]
    fn bad_schedules_say_what_is_wrong() {
        let err = |text: &str| Schedule::parse(text).expect_err(text).to_string();
        assert_eq!(
            err("* * * *"),
            "expected 5 fields (minute hour day-of-month month day-of-week), found 4"
        );
        assert_eq!(err("60 * * * *"), "minute field \"60\": 60 is outside 0-59");
        assert_eq!(
            err("* * 0 * *"),
            "day-of-month field \"0\": 0 is outside 1-31"
        );
        assert_eq!(
            err("*/0 * * * *"),
            "minute field \"*/0\": step \"0\" is not a positive number"
        );
        assert_eq!(
            err("* 5-1 * * *"),
            "hour field \"5-1\": range 5-1 runs backwards"
        );
        assert_eq!(
            err("* * * FOO *"),
            "month field \"FOO\": \"FOO\" is not a number or a known name"
        );
        assert!(
            err("CRON_TZ=Mars/Olympus * * * * *").starts_with("unknown time zone \"Mars/Olympus\"")
        );
        assert!(err("@fortnightly").starts_with("unknown macro"));
        assert_eq!(
            err("CRON_TZ=UTC"),
            "expected 5 fields (minute hour day-of-month month day-of-week), found 0"
        );
    }
}
