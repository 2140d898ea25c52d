//! A hostile module server: one tenant's transforms point at an https server that answers
//! with everything a module fetch and compile must survive (a compile memory bomb, an endless
//! body, a lying Content-Length, bytes that are not the pinned module, a trickle), while
//! another tenant loads a real plugin from a ConfigMap. Each hostile transform must fail with
//! its own reason, the other tenant's must become ready, and the operator must neither restart
//! nor grow past its memory limit.

use std::time::{Duration, Instant};

use axum::body::Body;
use axum::http::{HeaderValue, header};
use axum::response::Response;
use axum::routing::get;
use futures::StreamExt;
use k8s_openapi::ByteString;
use k8s_openapi::api::core::v1::ConfigMap;
use kube::Api;
use kube::api::{ObjectMeta, PostParams};
use pko_api::transform::{ProgramTransform, TransformStatus};
use serde_json::json;

use super::{MEMORY_LIMIT_MIB, Row, Scale, Section, mib, start_operator};
use crate::plugins::{PluginModule, costly, module};
use crate::{ControlPlane, HarnessError, wait_for};

/// Units of the compile bomb: about 2 MB of wasm that asks the compiler for over 200 MiB,
/// past the derived bound of the chaos operator (an eighth of its limit).
const BOMB_UNITS: usize = 300_000;
/// How long one hostile transform may take to report its failure (the trickle ends at the
/// fetch's 30 s timeout; the tenant's loads run one at a time, its share).
const REPORTED_WITHIN: Duration = Duration::from_secs(600);

/// One hostile answer: the path, what the transform must then say, and a note for the report.
struct Hostile {
    path: &'static str,
    reason: &'static str,
    /// A part of the message the status must carry.
    says: &'static str,
    what: &'static str,
}

const HOSTILE: [Hostile; 5] = [
    Hostile {
        path: "/bomb.wasm",
        reason: "Compile",
        says: "--plugin-compile-memory-mib",
        what: "a 2 MB component whose one function needs over 200 MiB to compile",
    },
    Hostile {
        path: "/endless.wasm",
        reason: "ModuleTooLarge",
        says: "more than the limit",
        what: "200 OK without a length, zeros forever",
    },
    Hostile {
        path: "/liar.wasm",
        reason: "ModuleTooLarge",
        says: "more than the limit",
        what: "a Content-Length of 1 TiB",
    },
    Hostile {
        path: "/wrong.wasm",
        reason: "DigestMismatch",
        says: "is pinned",
        what: "a real plugin, not the pinned bytes",
    },
    Hostile {
        path: "/trickle.wasm",
        reason: "Source",
        says: "https://",
        what: "one byte every 100 ms",
    },
];

/// Runs the scenario.
pub async fn section(plane: &ControlPlane, _scale: &Scale) -> Result<Section, HarnessError> {
    let hostile_ns = plane.namespace("chaos-mod-hostile").await?;
    let ok_ns = plane.namespace("chaos-mod-ok").await?;
    let tags = module("default_tags")?;
    let bomb = costly::memory_bomb(BOMB_UNITS);
    let (port, ca_pem) = serve(bomb.bytes.clone(), tags.bytes.clone()).await?;
    let ca_file = plane.dir().join("chaos-modules-ca.pem");
    std::fs::write(&ca_file, ca_pem).map_err(|e| HarnessError::io("writing the CA", e))?;
    let mut operator = start_operator(
        plane,
        vec![
            format!("--watch-namespaces={hostile_ns},{ok_ns}"),
            format!("--plugin-ca-file={}", ca_file.display()),
            // Only the bounds under test end a load: no deadline can come first.
            "--plugin-compile-timeout-seconds=3600".into(),
            "--plugin-load-timeout-seconds=3600".into(),
        ],
    )
    .await?;
    let pid = operator.pid();
    let client = plane.try_client()?;
    let hostile_api: Api<ProgramTransform> = Api::namespaced(client.clone(), &hostile_ns);
    let started = Instant::now();
    // The bomb pins its own digest, so its bytes reach the compiler; the others pin one that
    // nothing they send matches.
    let elsewhere = tags_pinned_elsewhere(&tags);
    for (i, hostile) in HOSTILE.iter().enumerate() {
        let pinned = if hostile.path == "/bomb.wasm" {
            &bomb
        } else {
            &elsewhere
        };
        let spec = json!({
            "source": {"url": format!("https://127.0.0.1:{port}{}", hostile.path)},
            "sha256": pinned.sha256,
            "config": {"tags": {"t": "x"}, "targets": [{"typePrefix": "aws:"}]},
        });
        hostile_api
            .create(&PostParams::default(), &transform(&format!("h{i}"), spec)?)
            .await
            .map_err(|e| HarnessError::kube("creating a hostile transform", e))?;
    }
    // The other tenant's real plugin, while the hostile loads run.
    let ok_started = Instant::now();
    config_map(&client, &ok_ns, &tags).await?;
    let ok_api: Api<ProgramTransform> = Api::namespaced(client.clone(), &ok_ns);
    let spec = json!({
        "source": {"configMap": {"name": "plugins", "key": "tags"}},
        "sha256": tags.sha256,
        "config": {"tags": {"t": "ok"}, "targets": [{"typePrefix": "aws:"}]},
    });
    ok_api
        .create(&PostParams::default(), &transform("ok", spec)?)
        .await
        .map_err(|e| HarnessError::kube("creating the tenant's transform", e))?;
    let ok_ready = wait_for(
        "the other tenant's transform ready",
        REPORTED_WITHIN,
        || {
            let api = ok_api.clone();
            async move { ready(&api.get("ok").await.ok()?.status?).filter(|r| r.0 == "True") }
        },
    )
    .await
    .map(|_| ok_started.elapsed());

    // Watched together, so each time is its own.
    let outcomes = futures::future::join_all((0..HOSTILE.len()).map(|i| {
        let api = hostile_api.clone();
        async move {
            let name = format!("h{i}");
            wait_for(&format!("{name} to fail"), REPORTED_WITHIN, || {
                let (api, name) = (api.clone(), name.clone());
                async move {
                    let (status, reason, message) = ready(&api.get(&name).await.ok()?.status?)?;
                    (status == "False" && reason != "Loading").then_some((reason, message))
                }
            })
            .await
            .map(|found| (found, started.elapsed()))
        }
    }))
    .await;
    let peak = operator.peak_rss_kib().unwrap_or(0);
    let exited = operator.exited();
    let same_process = operator.pid() == pid;

    let mut section = Section {
        title: "Module loads: a hostile module server".into(),
        setup: format!(
            "One tenant's {} transforms fetch from an https server that answers each with \
             something hostile; the other tenant loads `default_tags` from a ConfigMap once they \
             are created. Two load slots, one per namespace; compile bound derived from the \
             limit (an eighth), deadlines far away so only the bound under test ends a load.",
            HOSTILE.len()
        ),
        ..Section::default()
    };
    for (hostile, outcome) in HOSTILE.iter().zip(&outcomes) {
        let value = match outcome {
            Ok(((reason, _), took)) => format!("`{reason}` after {:.1} s", took.as_secs_f64()),
            Err(e) => format!("no failure reported: {e}"),
        };
        section.rows.push(Row::new(
            hostile.what,
            value,
            &format!("`{}`", hostile.reason),
        ));
        let holds = matches!(outcome, Ok(((reason, message), _))
            if reason == hostile.reason && message.contains(hostile.says));
        section.check(holds, || {
            format!(
                "{}: expected {} saying {:?}, got {outcome:?}",
                hostile.path, hostile.reason, hostile.says
            )
        });
    }
    section.rows.push(Row::new(
        "the other tenant's transform ready after",
        match &ok_ready {
            Ok(took) => format!("{:.1} s", took.as_secs_f64()),
            Err(e) => format!("never: {e}"),
        },
        "ready while the hostile loads run",
    ));
    section.rows.push(Row::new(
        "operator peak RSS (the compiler is a child of its own)",
        mib(peak),
        &format!("< {MEMORY_LIMIT_MIB} MiB, no restart"),
    ));
    section.check(ok_ready.is_ok(), || {
        format!("the other tenant's transform: {ok_ready:?}")
    });
    section.check(exited.is_none() && same_process, || {
        format!("the operator restarted or exited: {exited:?}")
    });
    section.check(peak < MEMORY_LIMIT_MIB * 1024, || {
        format!("peak RSS {} over the limit", mib(peak))
    });
    Ok(section)
}

/// A digest no answer matches: the real plugin's, one hex digit changed.
fn tags_pinned_elsewhere(tags: &PluginModule) -> PluginModule {
    let mut sha = tags.sha256.clone().into_bytes();
    sha[0] = if sha[0] == b'0' { b'1' } else { b'0' };
    PluginModule {
        path: tags.path.clone(),
        bytes: Vec::new(),
        sha256: String::from_utf8_lossy(&sha).into_owned(),
    }
}

fn transform(name: &str, spec: serde_json::Value) -> Result<ProgramTransform, HarnessError> {
    serde_json::from_value(json!({
        "apiVersion": "pko-rs.dev/v1alpha1",
        "kind": "ProgramTransform",
        "metadata": {"name": name},
        "spec": spec,
    }))
    .map_err(|e| HarnessError::Missing {
        what: format!("a valid ProgramTransform: {e}"),
    })
}

async fn config_map(
    client: &kube::Client,
    ns: &str,
    tags: &PluginModule,
) -> Result<(), HarnessError> {
    let cm = ConfigMap {
        metadata: ObjectMeta {
            name: Some("plugins".into()),
            ..Default::default()
        },
        binary_data: Some([("tags".to_owned(), ByteString(tags.bytes.clone()))].into()),
        ..Default::default()
    };
    Api::<ConfigMap>::namespaced(client.clone(), ns)
        .create(&PostParams::default(), &cm)
        .await
        .map_err(|e| HarnessError::kube("creating the module ConfigMap", e))?;
    Ok(())
}

/// The Ready condition's (status, reason, message).
fn ready(status: &TransformStatus) -> Option<(String, String, String)> {
    let c = status.conditions.iter().find(|c| c.type_ == "Ready")?;
    Some((c.status.clone(), c.reason.clone(), c.message.clone()))
}

/// The hostile server on loopback (TLS, HTTP/1.1 and HTTP/2); returns its port and CA.
async fn serve(bomb: Vec<u8>, tags: Vec<u8>) -> Result<(u16, String), HarnessError> {
    use pko_admission::tls::{Assessment, CertSettings, issue};
    let failed = |what: &str, e: String| HarnessError::io(what, std::io::Error::other(e));
    let settings = CertSettings::new("unused".into(), "unused".into(), vec!["127.0.0.1".into()]);
    let now = jiff::Timestamp::now().as_second();
    let certs = issue(None, &Assessment::RenewCa("first".into()), &settings, now)
        .map_err(|e| failed("issuing the module server's certificate", e.to_string()))?;
    let tls = axum_server::tls_rustls::RustlsConfig::from_config(
        certs
            .server_config()
            .map_err(|e| failed("the module server's TLS", e.to_string()))?,
    );
    let app = axum::Router::new()
        .route("/bomb.wasm", get(move || async move { bomb.clone() }))
        .route("/wrong.wasm", get(move || async move { tags.clone() }))
        .route("/endless.wasm", get(|| async { endless() }))
        .route("/liar.wasm", get(|| async { liar() }))
        .route("/trickle.wasm", get(|| async { trickle() }));
    let listener = std::net::TcpListener::bind("127.0.0.1:0")
        .map_err(|e| HarnessError::io("binding the module server", e))?;
    let port = listener
        .local_addr()
        .map_err(|e| HarnessError::io("the module server's address", e))?
        .port();
    listener
        .set_nonblocking(true)
        .map_err(|e| HarnessError::io("the module server's socket", e))?;
    let server = axum_server::from_tcp_rustls(listener, tls)
        .map_err(|e| HarnessError::io("the module server", e))?;
    tokio::spawn(server.serve(app.into_make_service()));
    Ok((port, certs.ca_pem.clone()))
}

fn endless() -> Response {
    let zeros = futures::stream::repeat_with(|| {
        Ok::<_, std::io::Error>(axum::body::Bytes::from_static(&[0u8; 64 << 10]))
    });
    Response::new(Body::from_stream(zeros))
}

fn liar() -> Response {
    let mut response = endless();
    response.headers_mut().insert(
        header::CONTENT_LENGTH,
        HeaderValue::from_static("1099511627776"),
    );
    response
}

fn trickle() -> Response {
    let bytes = futures::stream::unfold((), |()| async {
        tokio::time::sleep(Duration::from_millis(100)).await;
        Some((
            Ok::<_, std::io::Error>(axum::body::Bytes::from_static(b"\0")),
            (),
        ))
    })
    .boxed();
    Response::new(Body::from_stream(bytes))
}
