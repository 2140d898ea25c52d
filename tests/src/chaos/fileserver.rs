//! The file server under requests with invented methods and 10 KB paths: the metric series
//! must not grow with what clients invent, and memory must stay flat.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::StreamExt;
use kube::Api;
use kube::api::PostParams;
use pko_api::program::Program;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use super::{MEMORY_LIMIT_MIB, Row, Scale, Section, mib, program, published, start_operator};
use crate::operator::Operator;
use crate::{ControlPlane, HarnessError, wait_for};

const IN_FLIGHT: usize = 32;
/// Distinct long paths the requests pick from.
const PATHS: usize = 256;

/// Runs the scenario with a seeded generator (the seed is in the report).
pub async fn invented_methods(
    plane: &ControlPlane,
    scale: &Scale,
    seed: u64,
) -> Result<Section, HarnessError> {
    let ns = plane.namespace("chaos-fs").await?;
    let mut operator = start_operator(plane, vec![format!("--watch-namespace={ns}")]).await?;
    let api: Api<Program> = Api::namespaced(plane.try_client()?, &ns);
    api.create(&PostParams::default(), &program("served")?)
        .await
        .map_err(|e| HarnessError::kube("creating a Program", e))?;
    let url = wait_for("the artifact", Duration::from_secs(60), || async {
        published(&api.get("served").await.ok()?).map(|(url, _)| url)
    })
    .await?;
    let artifact = operator.fs_url_of(&url);
    let served_before = status_of(&artifact).await;

    let series_before = series(&operator).await;
    let rss_before = operator.rss_kib().unwrap_or(0);
    let client = reqwest::Client::builder()
        .timeout(Duration::from_secs(30))
        .build()
        .map_err(|e| HarnessError::io("http client", std::io::Error::other(e)))?;
    let mut rng = StdRng::seed_from_u64(seed);
    // A pool of long paths (a path costs the server the same whether or not it repeats; 50k
    // distinct 10 KB paths would cost this driver 500 MB) and a fresh method per request.
    let paths: Vec<Arc<str>> = (0..PATHS)
        .map(|_| Arc::from(long_path(&mut rng, scale.fs_path_bytes)))
        .collect();
    let requests: Vec<(String, Arc<str>)> = (0..scale.fs_requests)
        .map(|_| {
            let path = paths[rng.random_range(0..paths.len())].clone();
            (invented_method(&mut rng), path)
        })
        .collect();
    let distinct = requests
        .iter()
        .map(|(m, _)| m.as_str())
        .collect::<std::collections::BTreeSet<_>>()
        .len();
    let half = requests.len() / 2;
    let started = Instant::now();
    let mut answers = send_all(&client, operator.fs_port, &requests[..half]).await;
    let series_half = series(&operator).await;
    for (status, n) in send_all(&client, operator.fs_port, &requests[half..]).await {
        *answers.entry(status).or_default() += n;
    }
    let took = started.elapsed();
    let series_after = series(&operator).await;
    let served_after = status_of(&artifact).await;
    let rss_after = operator.rss_kib().unwrap_or(0);
    let peak = operator.peak_rss_kib().unwrap_or(0);
    let exited = operator.exited();

    let summary = answers
        .iter()
        .map(|(status, n)| format!("{n}× {status}"))
        .collect::<Vec<_>>()
        .join(", ");
    let mut section = Section {
        title: "File server: invented methods and long paths".into(),
        setup: format!(
            "{} requests, {IN_FLIGHT} in flight, each with a method of 3–12 random capital \
             letters ({distinct} distinct) and one of {PATHS} random paths of {} bytes under \
             /programs/ (with `%2F` escapes), seed {seed}; `/metrics` series counted before, at half and after. {:.1} s.",
            scale.fs_requests,
            scale.fs_path_bytes,
            took.as_secs_f64()
        ),
        ..Section::default()
    };
    section.rows = vec![
        Row::new("answers", summary, "4xx, no 5xx, no dropped request"),
        Row::new(
            "`pko_fileserver_*` series before / at half / after",
            format!("{series_before} / {series_half} / {series_after}"),
            "the same at half and after: clients cannot add series",
        ),
        Row::new(
            "operator RSS before → after (peak)",
            format!("{} → {} ({})", mib(rss_before), mib(rss_after), mib(peak)),
            &format!("peak < {MEMORY_LIMIT_MIB} MiB"),
        ),
        Row::new(
            "a real artifact before / after",
            format!("{served_before} / {served_after}"),
            "200 / 200",
        ),
    ];
    section.check(exited.is_none(), || {
        format!("the operator exited: {exited:?}")
    });
    section.check(series_half == series_after, || {
        format!("series grew from {series_half} to {series_after} in the second half")
    });
    section.check(answers.keys().all(|s| (400..500).contains(s)), || {
        format!("answers outside 4xx: {answers:?}")
    });
    section.check(served_before == 200 && served_after == 200, || {
        format!("the real artifact answered {served_before} before and {served_after} after")
    });
    section.check(peak < MEMORY_LIMIT_MIB * 1024, || {
        format!("peak RSS {} over the limit", mib(peak))
    });
    Ok(section)
}

/// 3–12 capital letters that are not a method the server knows.
fn invented_method(rng: &mut StdRng) -> String {
    loop {
        let len = rng.random_range(3..=12);
        let method: String = (0..len)
            .map(|_| char::from(b'A' + rng.random_range(0..26u8)))
            .collect();
        if ![
            "GET", "HEAD", "PUT", "POST", "DELETE", "PATCH", "TRACE", "OPTIONS", "CONNECT",
        ]
        .contains(&method.as_str())
        {
            return method;
        }
    }
}

/// `/programs/` and random URL-safe text (slashes and percent escapes included) up to `bytes`.
fn long_path(rng: &mut StdRng, bytes: usize) -> String {
    const ALPHABET: &[u8] = b"abcdefghijklmnopqrstuvwxyz0123456789-._~/";
    let mut path = String::from("/programs/");
    while path.len() < bytes {
        if rng.random_ratio(1, 50) {
            path.push_str("%2F");
        } else {
            path.push(char::from(ALPHABET[rng.random_range(0..ALPHABET.len())]));
        }
    }
    path
}

/// Sends `requests` with [`IN_FLIGHT`] at once; answers counted by status (0: no answer).
async fn send_all(
    client: &reqwest::Client,
    port: u16,
    requests: &[(String, Arc<str>)],
) -> BTreeMap<u16, u64> {
    let statuses = futures::stream::iter(requests)
        .map(|(method, path)| {
            let client = client.clone();
            async move {
                let Ok(method) = reqwest::Method::from_bytes(method.as_bytes()) else {
                    return 0;
                };
                let url = format!("http://127.0.0.1:{port}{path}");
                match client.request(method, url).send().await {
                    Ok(resp) => {
                        let status = resp.status().as_u16();
                        let _ = resp.bytes().await;
                        status
                    }
                    Err(_) => 0,
                }
            }
        })
        .buffer_unordered(IN_FLIGHT)
        .collect::<Vec<u16>>()
        .await;
    let mut counts = BTreeMap::new();
    for status in statuses {
        *counts.entry(status).or_default() += 1;
    }
    counts
}

async fn status_of(url: &str) -> u16 {
    match reqwest::get(url).await {
        Ok(resp) => resp.status().as_u16(),
        Err(_) => 0,
    }
}

/// The file server's samples in `/metrics` (other controllers may add series of their own
/// meanwhile; only these are what clients of the file server could inflate).
async fn series(operator: &Operator) -> usize {
    operator
        .metrics_text()
        .await
        .unwrap_or_default()
        .lines()
        .filter(|l| l.starts_with("pko_fileserver"))
        .count()
}
