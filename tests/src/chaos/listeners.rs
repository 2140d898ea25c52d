//! Every listener (probes, metrics, file server, webhook) under clients that hold connections
//! without using them: slow readers that pipeline requests and never read the answers, and
//! idle connections (HTTP/1.1 keep-alive; HTTP/2 on the webhook), all from one pod, while the
//! kubelet's probes and legitimate clients of each port are measured from another address.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use kube::Api;
use kube::api::PostParams;
use pko_api::program::Program;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

use super::webhook::{big_review, certificate, connect_from, tls_connector};
use super::{Poller, Row, Scale, Section, ms, program, published, start_operator};
use crate::agent::free_port;
use crate::measure::percentile;
use crate::webhook::{Registration, WebhookOptions, policy_bundle};
use crate::{ControlPlane, HarnessError, wait_for};

/// The pod holding connections; the legitimate clients are 127.0.0.1.
const ATTACKER: [u8; 4] = [127, 0, 0, 2];
/// Connections of each kind the pod opens to each port: twice the per-client cap (16).
const PER_KIND: usize = 32;
/// Timers shorter than their defaults (30 s / 60 s idle, 10 s write) so that a short run shows
/// them firing; the mechanism is the same.
const IDLE_TIMEOUT: &str = "4s";
const WRITE_TIMEOUT: &str = "2s";
/// How long the run waits after the load for the server to close what is left.
const GRACE: Duration = Duration::from_secs(30);

/// What became of one attacking connection.
#[derive(Clone, Copy, Debug)]
enum Fate {
    /// Closed before any answer (over the per-client cap, at accept).
    Refused,
    /// Closed by the server this long after it began to hold it.
    Closed(Duration),
    /// Still open when the run ended.
    Open,
}

/// The connections one kind of attacker opened to one port.
#[derive(Default)]
struct Fates {
    refused: usize,
    closed: Vec<Duration>,
    open: usize,
}

impl Fates {
    fn of(fates: &[Fate]) -> Self {
        let mut out = Fates::default();
        for fate in fates {
            match fate {
                Fate::Refused => out.refused += 1,
                Fate::Closed(after) => out.closed.push(*after),
                Fate::Open => out.open += 1,
            }
        }
        out.closed.sort();
        out
    }

    fn summary(&self) -> String {
        format!(
            "{} / {} (median {}, max {}) / {}",
            self.refused,
            self.closed.len(),
            ms(percentile(&self.closed, 0.5)),
            ms(self.closed.last().copied().unwrap_or_default()),
            self.open
        )
    }
}

/// A port under attack, and how to speak to it.
#[derive(Clone)]
struct Port {
    name: &'static str,
    port: u16,
    /// The request the slow readers pipeline and the idle connections send once.
    path: String,
    tls: Option<tokio_rustls::TlsConnector>,
}

/// Runs the scenario and returns its figures.
pub async fn section(plane: &ControlPlane, scale: &Scale) -> Result<Section, HarnessError> {
    let ns = plane.namespace("chaos-listeners").await?;
    let registration = Registration::create(
        plane,
        &ns,
        WebhookOptions {
            failure_policy: "Ignore",
            timeout_seconds: 10,
            mutating: false,
        },
    )
    .await?;
    let result = run(plane, scale, &ns, &registration).await;
    registration.remove(plane).await;
    result
}

async fn run(
    plane: &ControlPlane,
    scale: &Scale,
    ns: &str,
    registration: &Registration,
) -> Result<Section, HarnessError> {
    let metrics_port = free_port()?;
    let mut args = registration.operator_args(&policy_bundle()?);
    args.extend([
        format!("--watch-namespace={ns}"),
        format!("--metrics-bind-address=127.0.0.1:{metrics_port}"),
        // The default, stated: the harness lifts the cap for tests that are not about it.
        "--listener-max-connections-per-client=16".to_owned(),
        format!("--listener-idle-timeout={IDLE_TIMEOUT}"),
        format!("--listener-write-timeout={WRITE_TIMEOUT}"),
        format!("--webhook-idle-timeout={IDLE_TIMEOUT}"),
        format!("--webhook-write-timeout={WRITE_TIMEOUT}"),
    ]);
    let mut operator = start_operator(plane, args).await?;
    let ca = registration
        .wait_ca_injected(plane, Duration::from_secs(60))
        .await?;
    let api: Api<Program> = Api::namespaced(plane.try_client()?, ns);
    api.create(&PostParams::default(), &program("served")?)
        .await
        .map_err(|e| HarnessError::kube("creating a Program", e))?;
    let url = wait_for("the artifact", Duration::from_secs(60), || async {
        published(&api.get("served").await.ok()?).map(|(url, _)| url)
    })
    .await?;
    let artifact = operator.fs_url_of(&url);
    let artifact_path = artifact
        .find("/programs/")
        .map_or("/".to_owned(), |at| artifact[at..].to_owned());
    let metrics_url = format!("http://127.0.0.1:{metrics_port}/metrics");
    let review_url = format!("https://127.0.0.1:{}/validate", registration.port);

    let ports = [
        Port {
            name: "probes",
            port: operator.probe_port,
            path: "/healthz".into(),
            tls: None,
        },
        Port {
            name: "metrics",
            port: metrics_port,
            path: "/metrics".into(),
            tls: None,
        },
        Port {
            name: "file server",
            port: operator.fs_port,
            path: artifact_path,
            tls: None,
        },
        Port {
            name: "webhook",
            port: registration.port,
            path: "/validate".into(),
            tls: Some(tls_connector(&ca)?),
        },
    ];

    // The legitimate side: the kubelet's probes, a scraper, a tenant's fetch, the apiserver.
    let probes = Poller::start(
        vec![
            operator.probe_url("/healthz"),
            operator.probe_url("/readyz"),
        ],
        Duration::from_millis(100),
    );
    let scrapes = Poller::start(vec![metrics_url], Duration::from_millis(250));
    let fetches = Poller::start(vec![artifact], Duration::from_millis(100));
    let stop = Arc::new(AtomicBool::new(false));
    let reviews = tokio::spawn(reviews(
        review_url,
        certificate(&ca)?,
        big_review(ns, 0),
        stop.clone(),
    ));

    // The pod: slow readers and idle connections on every port, all at once.
    let started = Instant::now();
    let mut attacks = Vec::new();
    for port in &ports {
        for _ in 0..PER_KIND {
            attacks.push((
                port.name,
                "slow readers",
                tokio::spawn(slow_reader(port.clone(), stop.clone())),
            ));
            attacks.push((
                port.name,
                if port.tls.is_some() {
                    "idle HTTP/2 connections"
                } else {
                    "idle keep-alive connections"
                },
                tokio::spawn(idle(port.clone(), stop.clone())),
            ));
        }
    }
    // The load lasts the storm; then the server gets a grace to close what is left.
    tokio::time::sleep(scale.storm).await;
    let deadline = Instant::now() + GRACE;
    while Instant::now() < deadline && attacks.iter().any(|(_, _, t)| !t.is_finished()) {
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    stop.store(true, Ordering::Release);
    let mut fates: BTreeMap<(&str, &str), Vec<Fate>> = BTreeMap::new();
    for (port, kind, task) in attacks {
        let fate = task.await.unwrap_or(Fate::Open);
        fates.entry((port, kind)).or_default().push(fate);
    }
    let took = started.elapsed();
    let probes = probes.finish().await;
    let scrapes = scrapes.finish().await;
    let fetches = fetches.finish().await;
    let reviews = reviews.await.unwrap_or_default();
    let exited = operator.exited();

    let mut section = Section {
        title: "Listeners: slow readers and idle connections on every port".into(),
        setup: format!(
            "One pod (127.0.0.2) opens {PER_KIND} slow readers and {PER_KIND} idle connections to \
             each of the probe, metrics, file-server and webhook ports at once: a slow reader \
             pipelines requests (`/healthz`, `/metrics`, the artifact, `/validate` over TLS) \
             and never reads an answer; an idle connection sends one request, reads its answer \
             and then holds the connection (HTTP/1.1 keep-alive; HTTP/2 over TLS on the \
             webhook). Per-client cap 16 per port; `--listener-idle-timeout` and \
             `--webhook-idle-timeout` {IDLE_TIMEOUT}, `--listener-write-timeout` and \
             `--webhook-write-timeout` {WRITE_TIMEOUT} (shortened from their defaults so the run \
             shows them firing). Meanwhile, from 127.0.0.1: `/healthz` and `/readyz` every \
             100 ms (the kubelet), `/metrics` every 250 ms, the artifact every 100 ms, a review \
             every 200 ms. Load for {:.0} s, then up to {:.0} s for the server to close the \
             rest; {:.1} s in all.",
            scale.storm.as_secs_f64(),
            GRACE.as_secs_f64(),
            took.as_secs_f64()
        ),
        ..Section::default()
    };
    for ((port, kind), list) in &fates {
        let fates = Fates::of(list);
        section.rows.push(Row::new(
            format!("{port}: {kind} refused at accept / closed by the server / still open"),
            fates.summary(),
            "over the cap refused; the rest closed by the write or idle timer; 0 open",
        ));
        section.check(fates.open == 0, || {
            format!("{port}: {} {kind} still open after the grace", fates.open)
        });
    }
    section.rows.push(Row::new(
        "probes (`/healthz`, `/readyz`): ok, failed, p99, max",
        format!(
            "{} ok, {} failed, {}, {}",
            probes.ok,
            probes.errors.len(),
            ms(probes.p99()),
            ms(probes.max())
        ),
        "every probe answered; p99 < 1 s (kubelet's timeout)",
    ));
    for (what, polled) in [
        ("`/metrics` scrapes", &scrapes),
        ("artifact fetches", &fetches),
    ] {
        section.rows.push(Row::new(
            format!("{what}: ok, failed, p99"),
            format!(
                "{} ok, {} failed, {}",
                polled.ok,
                polled.errors.len(),
                ms(polled.p99())
            ),
            "every one answered",
        ));
        section.check(polled.errors.is_empty() && polled.ok > 0, || {
            format!("{what} failed: {:?}", polled.errors)
        });
    }
    let review_summary = reviews
        .iter()
        .map(|(status, n)| format!("{n}× {status}"))
        .collect::<Vec<_>>()
        .join(", ");
    section.rows.push(Row::new(
        "reviews from the apiserver's address",
        review_summary,
        "all 200",
    ));
    section.check(
        !reviews.is_empty() && reviews.keys().all(|s| s == "200"),
        || format!("reviews: {reviews:?}"),
    );
    section.check(probes.errors.is_empty() && probes.ok > 0, || {
        format!("probes failed: {:?}", probes.errors)
    });
    section.check(exited.is_none(), || {
        format!("the operator exited: {exited:?}")
    });
    Ok(section)
}

/// A connection from the pod to `port`, through TLS when the port speaks it.
async fn open(port: &Port, alpn: &[u8]) -> Option<Box<dyn AsyncReadWrite + Send + Unpin>> {
    let tcp = connect_from(ATTACKER, port.port).await.ok()?;
    match &port.tls {
        None => Some(Box::new(tcp)),
        Some(tls) => {
            let mut config = (**tls.config()).clone();
            config.alpn_protocols = vec![alpn.to_vec()];
            let connector = tokio_rustls::TlsConnector::from(Arc::new(config));
            let name = rustls::pki_types::ServerName::try_from("127.0.0.1").ok()?;
            Some(Box::new(connector.connect(name, tcp).await.ok()?))
        }
    }
}

trait AsyncReadWrite: AsyncRead + AsyncWrite {}
impl<T: AsyncRead + AsyncWrite> AsyncReadWrite for T {}

/// Pipelines requests and never reads: ends when a write fails (the server closed the
/// connection) or when the run stops.
async fn slow_reader(port: Port, stop: Arc<AtomicBool>) -> Fate {
    let Some(mut stream) = open(&port, b"http/1.1").await else {
        return Fate::Refused;
    };
    let began = Instant::now();
    let requests = format!("GET {} HTTP/1.1\r\nHost: x\r\n\r\n", port.path).repeat(64);
    let requests = requests.as_bytes();
    // Where the next write starts: a write cut short must not split a request.
    let mut at = 0;
    loop {
        if stop.load(Ordering::Acquire) {
            return Fate::Open;
        }
        // Bounded so that a write the server never drains still sees `stop`.
        match tokio::time::timeout(Duration::from_millis(500), stream.write(&requests[at..])).await
        {
            Ok(Ok(0) | Err(_)) => return Fate::Closed(began.elapsed()),
            Ok(Ok(n)) => at = (at + n) % requests.len(),
            Err(_) => {}
        }
    }
}

/// Sends one request, reads its answer, then holds the connection until the server closes it.
async fn idle(port: Port, stop: Arc<AtomicBool>) -> Fate {
    if port.tls.is_some() {
        return idle_h2(port, stop).await;
    }
    let Some(mut stream) = open(&port, b"http/1.1").await else {
        return Fate::Refused;
    };
    let request = format!("GET {} HTTP/1.1\r\nHost: x\r\n\r\n", port.path);
    if stream.write_all(request.as_bytes()).await.is_err() {
        return Fate::Refused;
    }
    let mut buf = [0u8; 16 * 1024];
    match stream.read(&mut buf).await {
        Ok(0) | Err(_) => return Fate::Refused,
        Ok(_) => {}
    }
    let began = Instant::now();
    loop {
        if stop.load(Ordering::Acquire) {
            return Fate::Open;
        }
        // The rest of the answer, then nothing until the server closes.
        let read = tokio::time::timeout(Duration::from_millis(250), stream.read(&mut buf)).await;
        if let Ok(Ok(0) | Err(_)) = read {
            return Fate::Closed(began.elapsed());
        }
    }
}

/// An HTTP/2 connection with one request answered, then held until the server closes it.
async fn idle_h2(port: Port, stop: Arc<AtomicBool>) -> Fate {
    let Some(stream) = open(&port, b"h2").await else {
        return Fate::Refused;
    };
    let Ok((send, connection)) = h2::client::handshake(stream).await else {
        return Fate::Refused;
    };
    let mut connection = tokio::spawn(connection);
    let answered = async {
        let request = http::Request::get(format!("https://127.0.0.1{}", port.path))
            .body(())
            .ok()?;
        let mut ready = send.clone().ready().await.ok()?;
        let (response, _) = ready.send_request(request, true).ok()?;
        let mut body = response.await.ok()?.into_body();
        while let Some(chunk) = body.data().await {
            let _ = body.flow_control().release_capacity(chunk.ok()?.len());
        }
        Some(())
    };
    if answered.await.is_none() {
        return Fate::Refused;
    }
    let began = Instant::now();
    loop {
        if stop.load(Ordering::Acquire) {
            return Fate::Open;
        }
        if tokio::time::timeout(Duration::from_millis(250), &mut connection)
            .await
            .is_ok()
        {
            drop(send);
            return Fate::Closed(began.elapsed());
        }
    }
}

/// Small reviews from the apiserver's address until stopped: answers by status.
async fn reviews(
    url: String,
    ca: reqwest::Certificate,
    body: Vec<u8>,
    stop: Arc<AtomicBool>,
) -> BTreeMap<String, u64> {
    let mut answers = BTreeMap::new();
    let client = match reqwest::Client::builder()
        .add_root_certificate(ca)
        .timeout(Duration::from_secs(10))
        .build()
    {
        Ok(client) => client,
        Err(e) => {
            answers.insert(format!("no client: {e}"), 1);
            return answers;
        }
    };
    while !stop.load(Ordering::Acquire) {
        let answer = client
            .post(&url)
            .header("content-type", "application/json")
            .body(body.clone())
            .send()
            .await;
        let key = match answer {
            Ok(resp) => resp.status().as_u16().to_string(),
            Err(e) if e.is_timeout() => "no answer in 10 s".to_owned(),
            Err(_) => "connection failed".to_owned(),
        };
        *answers.entry(key).or_default() += 1;
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    answers
}
