//! The webhook listener on a real TLS socket: the connection caps (all and per client address)
//! and the idle timer, over HTTP/1.1 and HTTP/2.
#![allow(
    clippy::disallowed_methods,
    reason = "a test process is configured by its environment (make sets the tool and fixture paths)"
)]

use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::routing::get;
use axum_server::tls_rustls::RustlsConfig;
use pko_admission::CertSettings;
use pko_admission::conn::ConnLimits;
use pko_admission::metrics::AdmissionMetrics;
use pko_admission::server::{self, Bounds};
use pko_admission::tls::{self, Assessment};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio_util::sync::CancellationToken;

fn refused(metrics: &AdmissionMetrics) -> u64 {
    refused_for(metrics, "connections")
}

fn refused_for(metrics: &AdmissionMetrics, reason: &str) -> u64 {
    metrics
        .refused
        .get_or_create(&pko_admission::metrics::RefusedLabels {
            reason: reason.into(),
        })
        .get()
}

/// A TCP connection to `addr` from the loopback address `source` (Linux routes 127/8 to
/// loopback): another client address on one machine.
async fn connect_from(source: [u8; 4], addr: std::net::SocketAddr) -> TcpStream {
    let socket = tokio::net::TcpSocket::new_v4().expect("socket");
    socket
        .bind((std::net::Ipv4Addr::from(source), 0).into())
        .expect("bind");
    socket.connect(addr).await.expect("connect")
}

/// `GET /ping` over TLS; the whole answer.
async fn ping(addr: std::net::SocketAddr, ca_pem: &str) -> String {
    let mut roots = rustls::RootCertStore::empty();
    for cert in rustls_pemfile_certs(ca_pem) {
        roots.add(cert).expect("root");
    }
    let config = rustls::ClientConfig::builder()
        .with_root_certificates(roots)
        .with_no_client_auth();
    let connector = tokio_rustls::TlsConnector::from(Arc::new(config));
    let tcp = TcpStream::connect(addr).await.expect("connect");
    let name = rustls::pki_types::ServerName::try_from("127.0.0.1").expect("name");
    let mut stream = connector.connect(name, tcp).await.expect("handshake");
    stream
        .write_all(b"GET /ping HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        .await
        .expect("write");
    let mut answer = String::new();
    stream.read_to_string(&mut answer).await.ok();
    answer
}

async fn until(what: &str, mut condition: impl FnMut() -> bool) {
    // A condition, not a time: the loop ends when the server has done it.
    for _ in 0..100_000 {
        if condition() {
            return;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    panic!("never: {what}");
}

/// The listener serving `app` over TLS on a loopback port, with `bounds`.
struct Listening {
    addr: std::net::SocketAddr,
    ca_pem: String,
    metrics: AdmissionMetrics,
    stop: CancellationToken,
}

fn listen(app: Router, bounds: Bounds) -> Listening {
    let _ = rustls::crypto::ring::default_provider().install_default();
    let settings = CertSettings::new("ns".into(), "s".into(), vec!["127.0.0.1".into()]);
    let now = time::OffsetDateTime::now_utc().unix_timestamp();
    let bundle =
        tls::issue(None, &Assessment::RenewCa("test".into()), &settings, now).expect("issue");
    let tls = RustlsConfig::from_config(bundle.server_config().expect("server config"));
    let listener = server::bind("127.0.0.1:0").expect("bind");
    let addr = listener.local_addr().expect("addr");
    let metrics = AdmissionMetrics::new();
    let stop = CancellationToken::new();
    tokio::spawn(server::serve(
        listener,
        app,
        tls,
        bounds,
        metrics.clone(),
        stop.clone().cancelled_owned(),
    ));
    Listening {
        addr,
        ca_pem: bundle.ca_pem,
        metrics,
        stop,
    }
}

#[tokio::test]
async fn connections_over_the_cap_are_closed_at_once_and_counted() {
    let Listening {
        addr,
        ca_pem,
        metrics,
        stop,
    } = listen(
        Router::new().route("/ping", get(|| async { "pong" })),
        // Idle clients hold their place until the cap is checked, however slow the machine.
        // Every client here is 127.0.0.1: its own cap is above the whole cap.
        Bounds {
            handshake_timeout: Duration::from_secs(3600),
            max_connections_per_client: 3,
            ..Bounds::new(Duration::from_secs(1), 2)
        },
    );

    // Two idle clients (no handshake) fill the cap.
    let first = TcpStream::connect(addr).await.expect("connect");
    let _second = TcpStream::connect(addr).await.expect("connect");
    until("two connections open", || metrics.connections.get() == 2).await;
    // A third is closed without a byte.
    let mut third = TcpStream::connect(addr).await.expect("connect");
    let mut byte = [0u8; 1];
    let read = third.read(&mut byte).await;
    assert!(matches!(read, Ok(0) | Err(_)), "{read:?}");
    assert_eq!(refused(&metrics), 1);
    assert_eq!(metrics.connections.get(), 2);

    // One leaves: a real client gets through and is answered.
    drop(first);
    until("one connection left", || metrics.connections.get() == 1).await;
    let answer = ping(addr, &ca_pem).await;
    assert!(
        answer.starts_with("HTTP/1.1 200") && answer.ends_with("pong"),
        "{answer}"
    );
    assert_eq!(refused(&metrics), 1);
    stop.cancel();
}

/// One address (a pod) holding idle connections gets at most its share; another address (the
/// apiserver) is still served.
#[tokio::test]
async fn one_client_address_cannot_take_every_connection() {
    let Listening {
        addr,
        ca_pem,
        metrics,
        stop,
    } = listen(
        Router::new().route("/ping", get(|| async { "pong" })),
        Bounds {
            handshake_timeout: Duration::from_secs(3600),
            max_connections_per_client: 2,
            ..Bounds::new(Duration::from_secs(1), 8)
        },
    );
    let _first = connect_from([127, 0, 0, 2], addr).await;
    let _second = connect_from([127, 0, 0, 2], addr).await;
    until("two connections open", || metrics.connections.get() == 2).await;
    let mut third = connect_from([127, 0, 0, 2], addr).await;
    let mut byte = [0u8; 1];
    let read = third.read(&mut byte).await;
    assert!(matches!(read, Ok(0) | Err(_)), "{read:?}");
    assert_eq!(refused_for(&metrics, "client_connections"), 1);
    assert_eq!(refused(&metrics), 0, "the whole cap was never reached");

    let answer = ping(addr, &ca_pem).await;
    assert!(
        answer.starts_with("HTTP/1.1 200") && answer.ends_with("pong"),
        "another address is served: {answer}"
    );
    stop.cancel();
}

#[tokio::test]
async fn a_client_that_never_finishes_its_handshake_is_dropped() {
    let Listening {
        addr,
        metrics,
        stop,
        ..
    } = listen(
        Router::new(),
        Bounds {
            handshake_timeout: Duration::from_millis(100),
            ..Bounds::new(Duration::from_secs(1), 2)
        },
    );
    // A slow client sends nothing: the server closes the connection by itself (no upper bound
    // on when; the read ends because the server closed it).
    let mut idle = TcpStream::connect(addr).await.expect("connect");
    let mut byte = [0u8; 1];
    let read = idle.read(&mut byte).await;
    assert!(matches!(read, Ok(0) | Err(_)), "{read:?}");
    until("the slot is free again", || metrics.connections.get() == 0).await;
    stop.cancel();
}

/// An HTTP/2 connection over TLS from the loopback address `source`, or `None` when the
/// server closed it first (refused, or idle before the handshake ended).
async fn h2_connect(
    source: [u8; 4],
    addr: std::net::SocketAddr,
    ca_pem: &str,
) -> Option<(
    h2::client::SendRequest<bytes::Bytes>,
    tokio::task::JoinHandle<Result<(), h2::Error>>,
)> {
    let mut roots = rustls::RootCertStore::empty();
    for cert in rustls_pemfile_certs(ca_pem) {
        roots.add(cert).expect("root");
    }
    let mut config = rustls::ClientConfig::builder()
        .with_root_certificates(roots)
        .with_no_client_auth();
    config.alpn_protocols = vec![b"h2".to_vec()];
    let connector = tokio_rustls::TlsConnector::from(Arc::new(config));
    let tcp = connect_from(source, addr).await;
    let name = rustls::pki_types::ServerName::try_from("127.0.0.1").expect("name");
    let stream = connector.connect(name, tcp).await.ok()?;
    let (send, connection) = h2::client::handshake(stream).await.ok()?;
    Some((send, tokio::spawn(connection)))
}

/// `GET path` on an HTTP/2 connection: the status, once the whole answer is in.
async fn h2_get(send: &mut h2::client::SendRequest<bytes::Bytes>, path: &str) -> Option<u16> {
    let request = http::Request::get(format!("https://127.0.0.1{path}"))
        .body(())
        .expect("request");
    let mut ready = send.clone().ready().await.ok()?;
    let (response, _) = ready.send_request(request, true).ok()?;
    let response = response.await.ok()?;
    let status = response.status().as_u16();
    let mut body = response.into_body();
    while let Some(chunk) = body.data().await {
        let chunk = chunk.ok()?;
        let _ = body.flow_control().release_capacity(chunk.len());
    }
    Some(status)
}

/// One pod opening HTTP/2 connections and leaving them idle: beyond its share they are closed
/// at once, and the ones it holds are closed once no request has been in flight for the idle
/// timeout (the timer covers every request, not only the first); its places then come back.
#[tokio::test]
async fn idle_http2_connections_are_capped_and_closed() {
    // `/hold` keeps its request in flight until the test opens the gate.
    let entered = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let gate = Arc::new(tokio::sync::Semaphore::new(0));
    let app = Router::new()
        .route("/ping", get(|| async { "pong" }))
        .route(
            "/hold",
            get({
                let (entered, gate) = (entered.clone(), gate.clone());
                move || {
                    let (entered, gate) = (entered.clone(), gate.clone());
                    async move {
                        entered.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                        let _ = gate.acquire().await.map(|p| p.forget());
                        "released"
                    }
                }
            }),
        );
    let Listening {
        addr,
        ca_pem,
        metrics,
        stop,
    } = listen(
        app,
        Bounds {
            max_connections_per_client: 2,
            conn: ConnLimits {
                idle_timeout: Duration::from_secs(1),
                write_timeout: Duration::from_secs(3600),
            },
            ..Bounds::new(Duration::from_secs(1), 8)
        },
    );
    let pod = [127, 0, 0, 2];
    // Two connections, each with a request in flight. A connection the idle timer closes
    // before its first request (a slow machine) is replaced: that is the timer working.
    let mut held = Vec::new();
    for _ in 0..1000 {
        if held.len() == 2 {
            break;
        }
        let before = entered.load(std::sync::atomic::Ordering::SeqCst);
        let Some((mut send, task)) = h2_connect(pod, addr, &ca_pem).await else {
            continue;
        };
        let request = tokio::spawn(async move {
            let status = h2_get(&mut send, "/hold").await;
            (status, send)
        });
        // Either the handler has the request, or the request failed.
        while entered.load(std::sync::atomic::Ordering::SeqCst) == before && !request.is_finished()
        {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        if entered.load(std::sync::atomic::Ordering::SeqCst) > before {
            held.push((request, task));
        }
    }
    assert_eq!(held.len(), 2, "two connections with a request in flight");
    // A third from the pod is closed without a byte.
    let mut third = connect_from(pod, addr).await;
    let mut byte = [0u8; 1];
    let read = third.read(&mut byte).await;
    assert!(matches!(read, Ok(0) | Err(_)), "{read:?}");
    assert_eq!(refused_for(&metrics, "client_connections"), 1);
    // The requests are answered; the connections are idle from then on, and the server
    // closes them (their connection tasks end). The bound is far above the idle timeout;
    // without the timer they stay open for good.
    gate.add_permits(2);
    for (request, task) in held {
        let (status, _send) = request.await.expect("join");
        assert_eq!(status, Some(200));
        let ended = tokio::time::timeout(Duration::from_secs(60), task).await;
        assert!(ended.is_ok(), "an idle HTTP/2 connection is still open");
    }
    until("every place is back", || metrics.connections.get() == 0).await;
    // The pod is served again (retried only if the idle timer beats a slow handshake).
    let mut served = false;
    for _ in 0..100 {
        if let Some((mut send, _task)) = h2_connect(pod, addr, &ca_pem).await
            && h2_get(&mut send, "/ping").await == Some(200)
        {
            served = true;
            break;
        }
    }
    assert!(served, "the pod is served again");
    stop.cancel();
}

fn rustls_pemfile_certs(pem: &str) -> Vec<rustls::pki_types::CertificateDer<'static>> {
    use rustls::pki_types::pem::PemObject;
    rustls::pki_types::CertificateDer::pem_slice_iter(pem.as_bytes())
        .collect::<Result<Vec<_>, _>>()
        .expect("pem")
}
