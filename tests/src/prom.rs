//! Histograms read from a Prometheus (or OpenMetrics) text exposition, for benchmarks that
//! compare two scrapes: bucket deltas, their count and sum, and quantiles interpolated inside
//! the buckets the way `histogram_quantile` does.

/// One cumulative histogram: `(upper bound, observations at or below it)` in ascending
/// order (the last bound is `+Inf`), with the sum of the observations.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Histogram {
    pub buckets: Vec<(f64, f64)>,
    pub sum: f64,
}

impl Histogram {
    /// The series of `family` whose labels (besides `le`) satisfy `keep`, summed bucket by
    /// bucket. Series with other bucket bounds than the first kept one are skipped.
    pub fn scrape(text: &str, family: &str, keep: impl Fn(&Labels) -> bool) -> Histogram {
        let mut out = Histogram::default();
        let bucket = format!("{family}_bucket");
        let sum = format!("{family}_sum");
        for line in text.lines().filter(|l| !l.starts_with('#')) {
            let Some((name, labels, value)) = sample(line) else {
                continue;
            };
            if name != bucket && name != sum {
                continue;
            }
            let Ok(value) = value.parse::<f64>() else {
                continue;
            };
            if !keep(&labels) {
                continue;
            }
            if name == sum {
                out.sum += value;
                continue;
            }
            let Some(le) = labels.get("le").and_then(parse_bound) else {
                continue;
            };
            match out.buckets.iter_mut().find(|(b, _)| *b == le) {
                Some((_, count)) => *count += value,
                None => out.buckets.push((le, value)),
            }
        }
        out.buckets.sort_by(|a, b| a.0.total_cmp(&b.0));
        out
    }

    /// Observations in the histogram.
    pub fn count(&self) -> f64 {
        self.buckets.last().map_or(0.0, |(_, c)| *c)
    }

    /// Mean of the observations, if any.
    pub fn mean(&self) -> Option<f64> {
        let count = self.count();
        (count > 0.0).then(|| self.sum / count)
    }

    /// `self - before`, bucket by bucket (bounds of `self`).
    pub fn since(&self, before: &Histogram) -> Histogram {
        Histogram {
            buckets: self
                .buckets
                .iter()
                .map(|(le, c)| {
                    let earlier = before
                        .buckets
                        .iter()
                        .find(|(b, _)| b == le)
                        .map_or(0.0, |(_, c)| *c);
                    (*le, (c - earlier).max(0.0))
                })
                .collect(),
            sum: self.sum - before.sum,
        }
    }

    /// Adds `other`'s observations (same bounds, or `self` empty).
    pub fn add(&mut self, other: &Histogram) {
        if self.buckets.is_empty() {
            self.buckets = other.buckets.clone();
        } else {
            for (le, c) in &mut self.buckets {
                if let Some((_, more)) = other.buckets.iter().find(|(b, _)| b == le) {
                    *c += more;
                }
            }
        }
        self.sum += other.sum;
    }

    /// The `q` quantile, interpolated linearly inside its bucket, and that bucket's upper
    /// bound. In the `+Inf` bucket, the largest finite bound is returned for both.
    pub fn quantile(&self, q: f64) -> Option<(f64, f64)> {
        let count = self.count();
        if count <= 0.0 {
            return None;
        }
        let rank = q * count;
        let (mut lower, mut below) = (0.0, 0.0);
        for (le, c) in &self.buckets {
            if *c >= rank && *c > below {
                if le.is_infinite() {
                    return Some((lower, lower));
                }
                return Some((lower + (le - lower) * (rank - below) / (c - below), *le));
            }
            (lower, below) = (*le, *c);
        }
        Some((lower, lower))
    }
}

/// The value of a counter (or gauge) summed over the series of `name` whose labels satisfy
/// `keep`.
pub fn scrape_sum(text: &str, name: &str, keep: impl Fn(&Labels) -> bool) -> f64 {
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .filter_map(sample)
        .filter(|(n, labels, _)| *n == name && keep(labels))
        .filter_map(|(_, _, v)| v.parse::<f64>().ok())
        .sum()
}

/// Every sample of an exposition: `(name, labels, value)`, comments and unparsable lines
/// skipped.
pub fn samples(text: &str) -> Vec<(String, Labels, f64)> {
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .filter_map(sample)
        .filter_map(|(name, labels, value)| {
            let value = match value {
                "+Inf" | "Inf" => f64::INFINITY,
                "-Inf" => f64::NEG_INFINITY,
                other => other.parse().ok()?,
            };
            Some((name.to_owned(), labels, value))
        })
        .collect()
}

/// The labels of one sample.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Labels(Vec<(String, String)>);

impl Labels {
    /// `(name, value)` in the order of the exposition.
    pub fn pairs(&self) -> &[(String, String)] {
        &self.0
    }

    pub fn get(&self, name: &str) -> Option<&str> {
        self.0
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v.as_str())
    }

    /// Whether label `name` is `value`.
    pub fn is(&self, name: &str, value: &str) -> bool {
        self.get(name) == Some(value)
    }
}

fn parse_bound(le: &str) -> Option<f64> {
    match le {
        "+Inf" | "Inf" => Some(f64::INFINITY),
        other => other.parse().ok(),
    }
}

/// `name{labels} value [timestamp]` → its parts.
fn sample(line: &str) -> Option<(&str, Labels, &str)> {
    let line = line.trim();
    let (name, labels, rest) = match line.find('{') {
        Some(open) if line[..open].find(' ').is_none() => {
            let (labels, after) = labels(&line[open + 1..])?;
            (&line[..open], labels, after)
        }
        _ => {
            let (name, rest) = line.split_once(' ')?;
            (name, Labels::default(), rest)
        }
    };
    let value = rest.split_whitespace().next()?;
    Some((name, labels, value))
}

/// Parses `a="x",b="y\"z"}` up to the closing brace; returns the labels and what follows.
fn labels(mut s: &str) -> Option<(Labels, &str)> {
    let mut out = Vec::new();
    loop {
        s = s.trim_start_matches([',', ' ']);
        if let Some(rest) = s.strip_prefix('}') {
            return Some((Labels(out), rest));
        }
        let eq = s.find('=')?;
        let name = s[..eq].trim().to_owned();
        s = s[eq + 1..].strip_prefix('"')?;
        let mut value = String::new();
        let mut chars = s.char_indices();
        let end = loop {
            let (i, c) = chars.next()?;
            match c {
                '\\' => match chars.next()?.1 {
                    'n' => value.push('\n'),
                    other => value.push(other),
                },
                '"' => break i,
                other => value.push(other),
            }
        };
        out.push((name, value));
        s = &s[end + 1..];
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const TEXT: &str = r#"# HELP x_seconds x
x_seconds_bucket{name="a",le="0.005"} 8
x_seconds_bucket{name="a",le="0.025"} 10
x_seconds_bucket{name="a",le="+Inf"} 10
x_seconds_sum{name="a"} 0.04
x_seconds_count{name="a"} 10
x_seconds_bucket{name="b\"c",le="0.005"} 1
x_seconds_bucket{name="b\"c",le="0.025"} 1
x_seconds_bucket{name="b\"c",le="+Inf"} 2
x_seconds_sum{name="b\"c"} 1.5
requests_total{version="HTTP/2.0"} 7
requests_total 3
"#;

    #[test]
    fn sums_kept_series_and_interpolates() {
        let a = Histogram::scrape(TEXT, "x_seconds", |l| l.is("name", "a"));
        assert_eq!(a.count(), 10.0);
        assert_eq!(a.mean(), Some(0.004));
        let (p50, bound) = a.quantile(0.5).expect("p50");
        assert!((p50 - 0.003125).abs() < 1e-9 && bound == 0.005);
        let (p90, bound) = a.quantile(0.9).expect("p90");
        assert!((p90 - 0.015).abs() < 1e-9 && bound == 0.025);
        let all = Histogram::scrape(TEXT, "x_seconds", |_| true);
        assert_eq!(all.count(), 12.0);
        assert_eq!(all.quantile(1.0), Some((0.025, 0.025)));
        let b = Histogram::scrape(TEXT, "x_seconds", |l| l.is("name", "b\"c"));
        assert_eq!(b.count(), 2.0);
        assert_eq!(scrape_sum(TEXT, "requests_total", |_| true), 10.0);
    }

    #[test]
    fn deltas_between_scrapes() {
        let before = Histogram::scrape(TEXT, "x_seconds", |l| l.is("name", "a"));
        let mut after = before.clone();
        after.buckets[1].1 += 4.0;
        after.buckets[2].1 += 4.0;
        after.sum += 0.08;
        let delta = after.since(&before);
        assert_eq!(delta.count(), 4.0);
        assert!((delta.mean().expect("mean") - 0.02).abs() < 1e-9);
        let mut total = Histogram::default();
        total.add(&delta);
        total.add(&delta);
        assert_eq!(total.count(), 8.0);
        assert_eq!(Histogram::default().quantile(0.5), None);
    }
}
