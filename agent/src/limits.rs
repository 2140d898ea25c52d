//! Size bounds of what the agent sends: one gRPC message, one log line, one output value.
//!
//! A program that prints one huge line or exports a huge value must not cost the operator (which
//! holds every message it receives in memory) more than these bounds. Text past a bound is cut
//! on a UTF-8 character boundary and ends with a marker saying how much was cut.

use std::borrow::Cow;

use serde_json::Value;

pub use pko_agent_api::MAX_MESSAGE_BYTES;
/// Default bound of one log line: a line of the CLI's output, or one string of an engine event
/// (a diagnostic message, a property value).
pub const DEFAULT_MAX_LOG_LINE_BYTES: usize = 64 * 1024;
/// Default bound of one stack output value (its JSON encoding). The operator stores outputs in
/// one Secret, and Kubernetes caps a Secret at 1 MiB in all.
pub const DEFAULT_MAX_OUTPUT_VALUE_BYTES: usize = 512 * 1024;
/// Smallest bound accepted for a log line or an output value: room for some text and the marker.
pub const MIN_BOUND_BYTES: usize = 1024;

/// The bounds an agent applies.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    pub max_log_line_bytes: usize,
    pub max_output_value_bytes: usize,
}

impl Default for Limits {
    fn default() -> Self {
        Self {
            max_log_line_bytes: DEFAULT_MAX_LOG_LINE_BYTES,
            max_output_value_bytes: DEFAULT_MAX_OUTPUT_VALUE_BYTES,
        }
    }
}

/// The marker that ends a cut text.
pub fn marker(cut_bytes: usize) -> String {
    format!("… [truncated {cut_bytes} bytes]")
}

/// The longest prefix of `s` of at most `max` bytes that ends on a character boundary.
fn prefix(s: &str, max: usize) -> &str {
    if s.len() <= max {
        return s;
    }
    let mut end = max;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    &s[..end]
}

/// `s` when it is at most `max` bytes; otherwise its first bytes (whole characters) and the
/// marker, `max` bytes or fewer before the marker.
pub fn truncate(s: &str, max: usize) -> Cow<'_, str> {
    if s.len() <= max {
        return Cow::Borrowed(s);
    }
    let kept = prefix(s, max);
    let mut out = String::with_capacity(kept.len() + 32);
    out.push_str(kept);
    out.push_str(&marker(s.len() - kept.len()));
    Cow::Owned(out)
}

/// Cuts every string of `value` (object keys excepted) longer than `max` bytes; returns how
/// many were cut.
pub fn truncate_strings(value: &mut Value, max: usize) -> usize {
    match value {
        Value::String(s) => {
            if s.len() > max {
                let cut = truncate(s, max).into_owned();
                *s = cut;
                1
            } else {
                0
            }
        }
        Value::Array(items) => items.iter_mut().map(|v| truncate_strings(v, max)).sum(),
        Value::Object(map) => map.values_mut().map(|v| truncate_strings(v, max)).sum(),
        Value::Null | Value::Bool(_) | Value::Number(_) => 0,
    }
}

/// The JSON encoding of an output value, bounded: a value whose encoding is longer than `max`
/// bytes becomes a JSON string, the value's first `max` bytes (a string's text, or another
/// value's JSON text) and the marker. Returns the encoding and whether it was cut.
pub fn output_value(value: &Value, max: usize) -> (Vec<u8>, bool) {
    let encoded = serde_json::to_vec(value).unwrap_or_default();
    if encoded.len() <= max {
        return (encoded, false);
    }
    let text = match value {
        Value::String(s) => s.clone(),
        _ => String::from_utf8_lossy(&encoded).into_owned(),
    };
    let cut = truncate(&text, max).into_owned();
    (
        serde_json::to_vec(&Value::String(cut)).unwrap_or_default(),
        true,
    )
}

/// Collects a line of at most `max` bytes from chunks of a longer one, counting what it drops,
/// so reading a huge line never holds more than `max` bytes of it.
#[derive(Debug)]
pub struct BoundedLine {
    max: usize,
    kept: Vec<u8>,
    dropped: usize,
}

impl BoundedLine {
    pub fn new(max: usize) -> Self {
        Self {
            max,
            kept: Vec::new(),
            dropped: 0,
        }
    }

    /// Adds a piece of the current line (no newline in it).
    pub fn push(&mut self, piece: &[u8]) {
        let room = self.max.saturating_sub(self.kept.len());
        let take = room.min(piece.len());
        self.kept.extend_from_slice(&piece[..take]);
        self.dropped += piece.len() - take;
    }

    /// Whether nothing was pushed since the last [`BoundedLine::take`].
    pub fn is_empty(&self) -> bool {
        self.kept.is_empty() && self.dropped == 0
    }

    /// The line so far (lossy UTF-8, with the marker when bytes were dropped), and a fresh start.
    pub fn take(&mut self) -> String {
        let total = self.kept.len() + self.dropped;
        let kept = std::mem::take(&mut self.kept);
        self.dropped = 0;
        if total <= self.max {
            return String::from_utf8_lossy(&kept).into_owned();
        }
        // A character cut in two at the bound is dropped whole rather than shown as U+FFFD.
        let valid = match std::str::from_utf8(&kept) {
            Ok(_) => kept.len(),
            Err(e) if e.error_len().is_none() => e.valid_up_to(),
            Err(_) => kept.len(),
        };
        let mut line = String::from_utf8_lossy(&kept[..valid]).into_owned();
        line.push_str(&marker(total - valid));
        line
    }
}

/// The longest engine-event line the agent reads. A longer one is dropped as it is read (a
/// JSON document cut short cannot be parsed) and reported by a warning diagnostic, so a
/// program that logs a huge event costs the agent at most this much.
pub const MAX_EVENT_LINE_BYTES: usize = 32 * 1024 * 1024;

/// One line of the engine event log, as [`EventLines`] gives it.
#[derive(Debug, PartialEq, Eq)]
pub enum EventLine {
    /// A line of at most the bound, without its newline.
    Whole(Vec<u8>),
    /// A line over the bound: only its size was counted.
    Dropped { bytes: usize },
}

/// Splits chunks of the event log into lines of at most `max` bytes; a longer line is counted,
/// never kept, so reading it holds at most `max` bytes.
#[derive(Debug)]
pub struct EventLines {
    max: usize,
    partial: Vec<u8>,
    /// Bytes of the current line once it went over the bound.
    skipped: Option<usize>,
}

impl EventLines {
    pub fn new(max: usize) -> Self {
        Self {
            max,
            partial: Vec::new(),
            skipped: None,
        }
    }

    /// The lines `chunk` completes, in order; the rest waits for the next chunk.
    pub fn push(&mut self, mut chunk: &[u8]) -> Vec<EventLine> {
        let mut lines = Vec::new();
        while !chunk.is_empty() {
            let newline = chunk.iter().position(|b| *b == b'\n');
            let piece = &chunk[..newline.unwrap_or(chunk.len())];
            match &mut self.skipped {
                Some(skipped) => *skipped += piece.len(),
                None if self.partial.len() + piece.len() > self.max => {
                    self.skipped = Some(self.partial.len() + piece.len());
                    self.partial = Vec::new();
                }
                None => self.partial.extend_from_slice(piece),
            }
            let Some(at) = newline else { break };
            chunk = &chunk[at + 1..];
            lines.push(match self.skipped.take() {
                Some(bytes) => EventLine::Dropped { bytes },
                None => EventLine::Whole(std::mem::take(&mut self.partial)),
            });
        }
        lines
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn event_lines_split_across_chunks_and_drop_only_the_long_one() {
        let mut lines = EventLines::new(8);
        assert_eq!(
            lines.push(b"{\"a\":1}\n{\"b"),
            vec![EventLine::Whole(b"{\"a\":1}".to_vec())]
        );
        assert_eq!(lines.push(b"\":2}"), vec![]);
        // 12345678 fits; the next line goes over in its second chunk and is counted whole.
        assert_eq!(
            lines.push(b"\n12345678\nabcdef"),
            vec![
                EventLine::Whole(b"{\"b\":2}".to_vec()),
                EventLine::Whole(b"12345678".to_vec())
            ]
        );
        assert_eq!(lines.push(b"ghijkl"), vec![]);
        assert!(lines.partial.is_empty(), "nothing of the long line is held");
        assert_eq!(
            lines.push(b"mn\n\nlast"),
            vec![
                EventLine::Dropped { bytes: 14 },
                EventLine::Whole(Vec::new())
            ]
        );
        assert_eq!(lines.push(b"\n"), vec![EventLine::Whole(b"last".to_vec())]);
    }

    #[test]
    fn short_text_is_left_alone() {
        assert!(matches!(truncate("abc", 3), Cow::Borrowed("abc")));
        assert_eq!(truncate("", 0), "");
    }

    #[test]
    fn long_text_is_cut_on_a_character_boundary_with_the_marker() {
        // "é" is 2 bytes: a bound of 5 falls inside the third one.
        let s = "ééééé";
        let cut = truncate(s, 5);
        assert_eq!(cut, format!("éé{}", marker(6)));
        assert!(cut.is_char_boundary(4));
        // 4-byte characters, every bound inside one.
        let crabs = "🦀🦀🦀";
        for max in 0..crabs.len() {
            let cut = truncate(crabs, max);
            let kept = max / 4 * 4;
            assert_eq!(
                cut,
                format!("{}{}", &crabs[..kept], marker(crabs.len() - kept))
            );
        }
        assert_eq!(truncate(&"x".repeat(10), 4), format!("xxxx{}", marker(6)));
    }

    #[test]
    fn every_long_string_of_an_event_is_cut() {
        let mut event = json!({
            "sequence": 3,
            "diagnosticEvent": {"message": "a".repeat(100), "severity": "info"},
            "resOutputsEvent": {"outputs": ["b".repeat(11), "short", {"k": "c".repeat(50)}]},
        });
        assert_eq!(truncate_strings(&mut event, 10), 3);
        assert_eq!(
            event["diagnosticEvent"]["message"],
            json!(format!("{}{}", "a".repeat(10), marker(90)))
        );
        assert_eq!(event["diagnosticEvent"]["severity"], json!("info"));
        assert_eq!(event["resOutputsEvent"]["outputs"][1], json!("short"));
        assert_eq!(event["sequence"], json!(3));
    }

    #[test]
    fn output_values_are_bounded_and_stay_json() {
        let (small, cut) = output_value(&json!({"a": 1}), 100);
        assert!(!cut);
        assert_eq!(small, br#"{"a":1}"#);

        let (bytes, cut) = output_value(&json!("ü".repeat(100)), 9);
        assert!(cut);
        let back: Value = serde_json::from_slice(&bytes).expect("json");
        assert_eq!(back, json!(format!("üüüü{}", marker(192))));

        let (bytes, cut) = output_value(&json!([1, 2, 3, 4, 5]), 4);
        assert!(cut);
        let back: Value = serde_json::from_slice(&bytes).expect("json");
        assert_eq!(back, json!(format!("[1,2{}", marker(7))));
    }

    #[test]
    fn a_line_read_in_pieces_keeps_at_most_the_bound() {
        let mut line = BoundedLine::new(5);
        assert!(line.is_empty());
        line.push(b"abc");
        assert_eq!(line.take(), "abc");
        assert!(line.is_empty());
        line.push(b"abcd");
        line.push(b"efgh");
        assert!(!line.is_empty());
        assert_eq!(line.take(), format!("abcde{}", marker(3)));
        // "é" = C3 A9: the bound of 5 splits the third one, which is dropped whole.
        line.push("ééé".as_bytes());
        assert_eq!(line.take(), format!("éé{}", marker(2)));
        line.push("é".as_bytes());
        assert_eq!(line.take(), "é");
    }
}
