//! The admission webhook under hostile load: waves of maximum-size AdmissionReviews while a
//! storm of slow clients holds connections open, stalling or trickling their headers.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use k8s_openapi::api::coordination::v1::Lease;
use kube::Api;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use super::{MEMORY_LIMIT_MIB, Poller, Row, Scale, Section, mib, ms, start_operator};
use crate::operator::Operator;
use crate::webhook::{Registration, WebhookOptions, policy_bundle};
use crate::{ControlPlane, HarnessError, wait_for};

/// JSON values in each big body: most of the webhook's value bound (250,000), so each body
/// is at both bounds at once (bytes and parsed tree).
const BIG_BODY_VALUES: usize = 200_000;
/// The webhook's lease settings: a storm that starved the runtime for longer than the renew
/// deadline would lose the lease.
const LEASE: [&str; 3] = ["15s", "10s", "2s"];
const LEASE_NAME: &str = "pko-rs-operator";

/// The slow clients' source address: another pod than the caller of the legitimate reviews
/// (127.0.0.1, the apiserver's stand-in). Linux routes all of 127/8 to loopback.
const ATTACKER: [u8; 4] = [127, 0, 0, 2];
/// A slow client's pause before it connects again: without it, connections closed at accept
/// would be reopened as fast as the kernel allows and spend every loopback port of the
/// machine in TIME_WAIT.
const RECONNECT_PAUSE: Duration = Duration::from_millis(250);

/// Runs the storm and returns its figures.
pub async fn storm(plane: &ControlPlane, scale: &Scale) -> Result<Section, HarnessError> {
    let ns = plane.namespace("chaos-webhook").await?;
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
    let result = storm_on(plane, scale, &ns, &registration).await;
    registration.remove(plane).await;
    result
}

async fn storm_on(
    plane: &ControlPlane,
    scale: &Scale,
    ns: &str,
    registration: &Registration,
) -> Result<Section, HarnessError> {
    let mut args = registration.operator_args(&policy_bundle()?);
    args.push(format!("--watch-namespace={ns}"));
    args.extend(super::leader_election(ns, LEASE));
    let mut operator = start_operator(plane, args).await?;
    let ca = registration
        .wait_ca_injected(plane, Duration::from_secs(60))
        .await?;
    let leases: Api<Lease> = Api::namespaced(plane.try_client()?, ns);
    let holder_before = wait_for("the lease to be held", Duration::from_secs(60), || async {
        let holder = leases.get(LEASE_NAME).await.ok()?.spec?.holder_identity?;
        (operator.metric("pko_leader").await == Some(1.0)).then_some(holder)
    })
    .await?;

    let client = reqwest::Client::builder()
        .add_root_certificate(certificate(&ca)?)
        .timeout(Duration::from_secs(30))
        .build()
        .map_err(|e| HarnessError::io("webhook client", std::io::Error::other(e)))?;
    let url = format!("https://127.0.0.1:{}/validate", registration.port);
    let body = big_review(
        ns,
        pko_admission::webhook::ReviewLimits::DEFAULT.max_body_bytes - 4096,
    );
    let small = big_review(ns, 0);
    // The webhook answers before the storm: the run measures a working server.
    let first = client
        .post(&url)
        .header("content-type", "application/json")
        .body(small.clone())
        .send()
        .await
        .map_err(|e| HarnessError::io("a first review", std::io::Error::other(e)))?;
    let first_status = first.status().as_u16();

    let rss_before = operator.rss_kib().unwrap_or(0);
    let health = Poller::start(
        vec![operator.probe_url("/healthz")],
        Duration::from_millis(100),
    );
    let stop = Arc::new(AtomicBool::new(false));
    let slow = SlowClients::start(
        scale.slow_clients,
        registration.port,
        ca.clone(),
        stop.clone(),
    )?;
    let leader = LeaderWatch::start(&operator, stop.clone());

    let started = Instant::now();
    let mut big = Answers::default();
    let mut small_answers = Answers::default();
    let mut waves = 0;
    while started.elapsed() < scale.storm {
        waves += 1;
        let wave = (0..scale.webhook_bodies).map(|_| send(&client, &url, body.clone()));
        let probe = send(&client, &url, small.clone());
        let (answers, small_answer) = tokio::join!(futures::future::join_all(wave), probe);
        for answer in answers {
            big.record(answer);
        }
        small_answers.record(small_answer);
    }
    stop.store(true, Ordering::Release);
    let slow = slow.finish().await;
    let leader_samples = leader.finish().await;
    let health = health.finish().await;
    let storm_time = started.elapsed();

    // After the storm the webhook serves again.
    let recovered = wait_for(
        "a review answered after the storm",
        Duration::from_secs(60),
        || {
            let request = send(&client, &url, small.clone());
            async move { (request.await.status == Some(200)).then_some(()) }
        },
    )
    .await
    .is_ok();
    let holder_after = leases
        .get(LEASE_NAME)
        .await
        .ok()
        .and_then(|l| l.spec?.holder_identity);
    let peak = operator.peak_rss_kib().unwrap_or(0);
    let exited = operator.exited();

    let mut section = Section {
        title: "Webhook: maximum-size reviews and a slow-client storm".into(),
        setup: format!(
            "{} AdmissionReviews of {:.1} MiB ({BIG_BODY_VALUES} JSON values each) sent at once, \
             in waves for {:.0} s, while {} clients hold connections to the webhook: half \
             connect and send nothing, half finish the TLS handshake and trickle a header byte \
             every 500 ms; each reconnects 250 ms after it is closed. They come from \
             127.0.0.2, one pod; the reviews come from 127.0.0.1, the apiserver. One small \
             review per wave measures what a legitimate caller sees. `/healthz` polled every 100 ms, the leader lease \
             ({}/{}/{}) watched throughout.",
            scale.webhook_bodies,
            body.len() as f64 / 1048576.0,
            storm_time.as_secs_f64(),
            scale.slow_clients,
            LEASE[0],
            LEASE[1],
            LEASE[2],
        ),
        ..Section::default()
    };
    section.rows = vec![
        Row::new(
            "maximum-size reviews sent (waves)",
            format!("{} ({waves})", big.total()),
            "recorded",
        ),
        Row::new(
            "their answers",
            big.summary(),
            "200, or 413/429/503 with a reason (a refusal before the body is read closes the connection); never a hang",
        ),
        Row::new(
            "small reviews from another address during the storm",
            small_answers.summary(),
            "all answered: the storm's address holds at most its share of connections",
        ),
        Row::new(
            "slow connections opened / closed by the server",
            format!("{} / {}", slow.opened, slow.closed_by_server),
            "closed: at accept over the cap, else by the handshake/request timeouts",
        ),
        Row::new(
            "operator RSS before → peak",
            format!("{} → {}", mib(rss_before), mib(peak)),
            &format!("peak < {MEMORY_LIMIT_MIB} MiB (`--memory-limit`)"),
        ),
        Row::new(
            "`/healthz` during the storm: answers, p99, max",
            format!(
                "{} ok, {} failed, {}, {}",
                health.ok,
                health.errors.len(),
                ms(health.p99()),
                ms(health.max())
            ),
            "every probe answered; p99 < 1 s (kubelet's timeout)",
        ),
        Row::new(
            "lease: samples not leader, holder before → after",
            format!(
                "{} of {}, {} → {}",
                leader_samples.lost,
                leader_samples.samples,
                holder_before,
                holder_after.as_deref().unwrap_or("none")
            ),
            "held throughout",
        ),
        Row::new(
            "review answered after the storm",
            if recovered { "yes" } else { "no" },
            "yes",
        ),
    ];
    section.check(first_status == 200, || {
        format!("the first review before the storm was answered {first_status}")
    });
    section.check(exited.is_none(), || {
        format!("the operator exited: {exited:?}")
    });
    section.check(peak < MEMORY_LIMIT_MIB * 1024, || {
        format!(
            "peak RSS {} over the {MEMORY_LIMIT_MIB} MiB limit",
            mib(peak)
        )
    });
    section.check(big.unexpected().is_empty(), || {
        format!("unexpected answers to big reviews: {:?}", big.unexpected())
    });
    section.check(big.timeouts == 0, || {
        format!("{} big reviews got no answer within 30 s", big.timeouts)
    });
    section.check(health.errors.is_empty(), || {
        format!("/healthz failed during the storm: {:?}", health.errors)
    });
    section.check(
        leader_samples.lost == 0 && holder_after.as_deref() == Some(holder_before.as_str()),
        || {
            format!(
                "the lease was not held throughout: {} samples not leader, holder {holder_before} → {holder_after:?}",
                leader_samples.lost
            )
        },
    );
    section.check(recovered, || {
        "no review was answered after the storm".into()
    });
    Ok(section)
}

pub(super) fn certificate(pem: &[u8]) -> Result<reqwest::Certificate, HarnessError> {
    reqwest::Certificate::from_pem(pem)
        .map_err(|e| HarnessError::io("the webhook CA", std::io::Error::other(e)))
}

/// An AdmissionReview of a Stack creation, padded to about `bytes` with an array of
/// [`BIG_BODY_VALUES`] strings (no padding when `bytes` is 0).
pub(super) fn big_review(ns: &str, bytes: usize) -> Vec<u8> {
    let head = format!(
        r#"{{"apiVersion":"admission.k8s.io/v1","kind":"AdmissionReview","request":{{"uid":"chaos","kind":{{"group":"pulumi.com","version":"v1","kind":"Stack"}},"resource":{{"group":"pulumi.com","version":"v1","resource":"stacks"}},"namespace":"{ns}","name":"big","operation":"CREATE","userInfo":{{"username":"chaos"}},"object":{{"apiVersion":"pulumi.com/v1","kind":"Stack","metadata":{{"name":"big","namespace":"{ns}"}},"spec":{{"stack":"dev","programRef":{{"name":"p"}},"config":{{"pad":["#
    );
    let tail = "]}}}}}";
    let mut out = head.into_bytes();
    if bytes > 0 {
        let room = bytes.saturating_sub(out.len() + tail.len());
        // Each item is `"xxx…",`: its text plus three bytes.
        let each = (room / BIG_BODY_VALUES).saturating_sub(3).max(1);
        let item = "x".repeat(each);
        for i in 0..BIG_BODY_VALUES {
            if i > 0 {
                out.push(b',');
            }
            out.push(b'"');
            out.extend_from_slice(item.as_bytes());
            out.push(b'"');
        }
    }
    out.extend_from_slice(tail.as_bytes());
    out
}

/// One review's outcome.
struct Answer {
    status: Option<u16>,
    timed_out: bool,
}

async fn send(client: &reqwest::Client, url: &str, body: Vec<u8>) -> Answer {
    let sent = client
        .post(url)
        .header("content-type", "application/json")
        .body(body)
        .send()
        .await;
    match sent {
        Ok(resp) => {
            let status = resp.status().as_u16();
            let _ = resp.bytes().await;
            Answer {
                status: Some(status),
                timed_out: false,
            }
        }
        Err(e) => Answer {
            status: None,
            timed_out: e.is_timeout(),
        },
    }
}

/// Answers counted by status; connections closed before an answer counted apart (closed at
/// accept, or a refusal sent before the body was read: the server then closes the
/// connection while the client is still sending, and the client may miss the answer).
#[derive(Default)]
struct Answers {
    by_status: BTreeMap<u16, u64>,
    closed: u64,
    timeouts: u64,
}

impl Answers {
    fn record(&mut self, answer: Answer) {
        match (answer.status, answer.timed_out) {
            (Some(status), _) => *self.by_status.entry(status).or_default() += 1,
            (None, true) => self.timeouts += 1,
            (None, false) => self.closed += 1,
        }
    }

    fn total(&self) -> u64 {
        self.by_status.values().sum::<u64>() + self.closed + self.timeouts
    }

    fn summary(&self) -> String {
        let mut parts: Vec<String> = self
            .by_status
            .iter()
            .map(|(status, n)| format!("{n}× {status}"))
            .collect();
        if self.closed > 0 {
            parts.push(format!(
                "{}× connection closed before an answer",
                self.closed
            ));
        }
        if self.timeouts > 0 {
            parts.push(format!("{}× no answer in 30 s", self.timeouts));
        }
        parts.join(", ")
    }

    /// Statuses the webhook should never give.
    fn unexpected(&self) -> Vec<u16> {
        self.by_status
            .keys()
            .copied()
            .filter(|s| ![200, 413, 429, 503].contains(s))
            .collect()
    }
}

/// The slow-client storm.
struct SlowClients {
    tasks: Vec<tokio::task::JoinHandle<()>>,
    opened: Arc<AtomicU64>,
    closed_by_server: Arc<AtomicU64>,
}

struct SlowFigures {
    opened: u64,
    closed_by_server: u64,
}

impl SlowClients {
    fn start(
        count: usize,
        port: u16,
        ca: Vec<u8>,
        stop: Arc<AtomicBool>,
    ) -> Result<Self, HarnessError> {
        let tls = tls_connector(&ca)?;
        let opened = Arc::new(AtomicU64::new(0));
        let closed_by_server = Arc::new(AtomicU64::new(0));
        let tasks = (0..count)
            .map(|i| {
                let (tls, stop) = (tls.clone(), stop.clone());
                let (opened, closed) = (opened.clone(), closed_by_server.clone());
                tokio::spawn(async move {
                    while !stop.load(Ordering::Acquire) {
                        let Ok(tcp) = connect_from(ATTACKER, port).await else {
                            tokio::time::sleep(RECONNECT_PAUSE).await;
                            continue;
                        };
                        opened.fetch_add(1, Ordering::Relaxed);
                        let server_closed = if i % 2 == 0 {
                            stall(tcp, &stop).await
                        } else {
                            trickle(tcp, &tls, &stop).await
                        };
                        if server_closed {
                            closed.fetch_add(1, Ordering::Relaxed);
                        }
                        tokio::time::sleep(RECONNECT_PAUSE).await;
                    }
                })
            })
            .collect();
        Ok(Self {
            tasks,
            opened,
            closed_by_server,
        })
    }

    async fn finish(self) -> SlowFigures {
        for task in self.tasks {
            let _ = task.await;
        }
        SlowFigures {
            opened: self.opened.load(Ordering::Relaxed),
            closed_by_server: self.closed_by_server.load(Ordering::Relaxed),
        }
    }
}

pub(super) async fn connect_from(source: [u8; 4], port: u16) -> std::io::Result<TcpStream> {
    let socket = tokio::net::TcpSocket::new_v4()?;
    socket.bind((std::net::Ipv4Addr::from(source), 0).into())?;
    socket.connect(([127, 0, 0, 1], port).into()).await
}

pub(super) fn tls_connector(ca: &[u8]) -> Result<tokio_rustls::TlsConnector, HarnessError> {
    use rustls::pki_types::CertificateDer;
    use rustls::pki_types::pem::PemObject;
    let bad_ca = |e: String| HarnessError::io("the webhook CA", std::io::Error::other(e));
    let mut roots = rustls::RootCertStore::empty();
    for cert in CertificateDer::pem_slice_iter(ca) {
        roots
            .add(cert.map_err(|e| bad_ca(e.to_string()))?)
            .map_err(|e| bad_ca(e.to_string()))?;
    }
    let config = rustls::ClientConfig::builder()
        .with_root_certificates(roots)
        .with_no_client_auth();
    Ok(tokio_rustls::TlsConnector::from(Arc::new(config)))
}

/// Sends nothing; true when the server closed the connection before the storm ended.
async fn stall(mut tcp: TcpStream, stop: &AtomicBool) -> bool {
    let mut buf = [0u8; 64];
    loop {
        if stop.load(Ordering::Acquire) {
            return false;
        }
        match tokio::time::timeout(Duration::from_millis(250), tcp.read(&mut buf)).await {
            Ok(Ok(0)) | Ok(Err(_)) => return true,
            Ok(Ok(_)) | Err(_) => {}
        }
    }
}

/// Completes the TLS handshake, then sends a request head one byte every 500 ms; true when
/// the server closed the connection before the storm ended.
async fn trickle(tcp: TcpStream, tls: &tokio_rustls::TlsConnector, stop: &AtomicBool) -> bool {
    let Ok(name) = rustls::pki_types::ServerName::try_from("127.0.0.1") else {
        return false;
    };
    let Ok(mut stream) = tls.connect(name.to_owned(), tcp).await else {
        // Refused or dropped during the handshake: the server's doing.
        return true;
    };
    let head = b"POST /validate HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: ";
    if stream.write_all(head).await.is_err() {
        return true;
    }
    let mut buf = [0u8; 64];
    loop {
        if stop.load(Ordering::Acquire) {
            return false;
        }
        if stream.write_all(b"a").await.is_err() || stream.flush().await.is_err() {
            return true;
        }
        match tokio::time::timeout(Duration::from_millis(500), stream.read(&mut buf)).await {
            Ok(Ok(0)) | Ok(Err(_)) => return true,
            // An answer (408/431) ends the exchange too.
            Ok(Ok(_)) => return true,
            Err(_) => {}
        }
    }
}

/// Samples `pko_leader` every 500 ms until stopped.
struct LeaderWatch {
    task: tokio::task::JoinHandle<LeaderSamples>,
}

#[derive(Default)]
struct LeaderSamples {
    samples: u64,
    lost: u64,
}

impl LeaderWatch {
    fn start(operator: &Operator, stop: Arc<AtomicBool>) -> Self {
        let url = operator.probe_url("/metrics");
        let task = tokio::spawn(async move {
            let mut samples = LeaderSamples::default();
            let client = reqwest::Client::new();
            while !stop.load(Ordering::Acquire) {
                let text = match client.get(&url).send().await {
                    Ok(resp) => resp.text().await.unwrap_or_default(),
                    Err(_) => String::new(),
                };
                samples.samples += 1;
                if crate::operator::metric_value(&text, "pko_leader") != Some(1.0) {
                    samples.lost += 1;
                }
                tokio::time::sleep(Duration::from_millis(500)).await;
            }
            samples
        });
        Self { task }
    }

    async fn finish(self) -> LeaderSamples {
        self.task.await.unwrap_or_default()
    }
}
