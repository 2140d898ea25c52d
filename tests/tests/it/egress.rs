//! Egress by default (issue 23) on the real apiserver: what a tenant's URL makes the operator
//! do, and what the tenant's status then says. The environment's proxy is not used, and a
//! failed branch lookup is named by its class, never by a status code, a connection error or
//! the server's words.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use kube::Api;
use kube::api::PostParams;
use pko_api::stack::Stack;
use pko_api::workspace::Workspace;
use pko_tests::operator::{Operator, OperatorOptions};
use pko_tests::{ControlPlane, fixtures, wait_for};
use serde_json::json;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

const WAIT: Duration = Duration::from_secs(120);
const COMMIT: &str = "0123456789abcdef0123456789abcdef01234567";

/// A loopback listener that answers every request with `answer` and records the first line
/// of each (what a proxy would have been asked). Stops when dropped.
struct Answering {
    port: u16,
    seen: Arc<Mutex<Vec<String>>>,
    task: tokio::task::JoinHandle<()>,
}

impl Answering {
    async fn start(answer: String) -> Self {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let port = listener.local_addr().expect("addr").port();
        let seen = Arc::new(Mutex::new(Vec::new()));
        let log = seen.clone();
        let task = tokio::spawn(async move {
            while let Ok((mut sock, _)) = listener.accept().await {
                let (log, answer) = (log.clone(), answer.clone());
                tokio::spawn(async move {
                    let mut buf = Vec::new();
                    let mut chunk = [0u8; 1024];
                    while !buf.windows(4).any(|w| w == b"\r\n\r\n") && buf.len() < 16 * 1024 {
                        match sock.read(&mut chunk).await {
                            Ok(0) | Err(_) => break,
                            Ok(n) => buf.extend_from_slice(&chunk[..n]),
                        }
                    }
                    let head = String::from_utf8_lossy(&buf);
                    log.lock()
                        .unwrap_or_else(|e| e.into_inner())
                        .push(head.lines().next().unwrap_or_default().to_owned());
                    let _ = sock.write_all(answer.as_bytes()).await;
                    let _ = sock.shutdown().await;
                });
            }
        });
        Self { port, seen, task }
    }

    fn url(&self, path: &str) -> String {
        format!("http://127.0.0.1:{}{path}", self.port)
    }

    fn seen(&self) -> Vec<String> {
        self.seen.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }
}

impl Drop for Answering {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// An HTTP answer with `status` and `body`.
fn answer(status: &str, body: &str) -> String {
    format!(
        "HTTP/1.1 {status}\r\nContent-Length: {}\r\nContent-Type: text/plain\r\nX-Debug: {body}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    )
}

async fn operator(plane: &ControlPlane, ns: &str, env: &[(&str, &str)]) -> Operator {
    Operator::start_with_env(
        plane,
        OperatorOptions {
            advertised: None,
            args: vec![format!("--watch-namespace={ns}")],
        },
        env,
    )
    .await
    .expect("operator")
}

/// Issue 23: reqwest honoured HTTP(S)_PROXY, so a proxy in the operator's environment made
/// the connections for tenants' URLs, past the egress checks. Now the environment's proxy is
/// ignored (unless --egress-use-env-proxy): the branch lookup goes straight to the repository
/// and the proxy never hears of it. (HTTPS_PROXY is left out: the apiserver client reads it
/// too, and has no proxy support built in.)
#[tokio::test]
async fn a_proxy_in_the_environment_is_not_used_for_a_branch_lookup() {
    let _machine = pko_tests::serial::shared().await;
    let plane = ControlPlane::shared().await;
    let ns = plane.namespace("egress-proxy").await.expect("namespace");
    let proxy = Answering::start(answer("502 Bad Gateway", "proxied")).await;
    let repo = pko_tests::agent::StaticServer::start(HashMap::from([(
        "/repo/info/refs?service=git-upload-pack".to_owned(),
        format!("{COMMIT}\trefs/heads/main\n").into_bytes(),
    )]))
    .await
    .expect("repository");
    let proxy_url = proxy.url("");
    let op = operator(
        plane,
        &ns,
        &[
            ("HTTP_PROXY", &proxy_url),
            ("http_proxy", &proxy_url),
            ("ALL_PROXY", &proxy_url),
            ("all_proxy", &proxy_url),
        ],
    )
    .await;
    let tmp = tempfile::tempdir().expect("tmp");
    let stacks: Api<Stack> = Api::namespaced(plane.client(), &ns);
    let spec = json!({"projectRepo": repo.url("/repo"), "branch": "main"});
    stacks
        .create(
            &PostParams::default(),
            &fixtures::file_backend_stack("direct", tmp.path(), spec),
        )
        .await
        .expect("create stack");
    // The branch was resolved (the Workspace is pinned to its commit): the lookup went direct.
    let workspaces: Api<Workspace> = Api::namespaced(plane.client(), &ns);
    let pinned = wait_for(
        "the Workspace pinned to the branch's commit",
        WAIT,
        || async {
            let ws = workspaces.get_opt("direct").await.ok()??;
            let git = ws.spec.git?;
            (git.ref_.as_deref() == Some(COMMIT)).then_some(())
        },
    )
    .await;
    if let Err(e) = pinned {
        panic!(
            "{e}: {:?}\nproxy saw {:?}\n{}",
            stacks.get("direct").await.ok().and_then(|s| s.status),
            proxy.seen(),
            op.log_text()
        );
    }
    assert!(
        proxy.seen().is_empty(),
        "the proxy was used: {:?}",
        proxy.seen()
    );
}

/// Issue 23: `http://` branch lookups reported exact status codes (and connection errors), a
/// port and status oracle from the operator's network position. A lookup that meets a teapot,
/// a failing server or a closed port is named by its class only; the code, the server's words
/// and the connection error stay out of the status and the Events.
#[tokio::test]
async fn a_failed_branch_lookup_names_its_class_never_the_status_or_the_answer() {
    const SECRET: &str = "BODY-SECRET-9d2e";
    let _machine = pko_tests::serial::shared().await;
    let plane = ControlPlane::shared().await;
    let ns = plane.namespace("egress-class").await.expect("namespace");
    let teapot = Answering::start(answer("418 I'm a teapot", SECRET)).await;
    let failing = Answering::start(answer("503 Service Unavailable", SECRET)).await;
    let closed = {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        listener.local_addr().expect("addr").port()
    };
    let _op = operator(plane, &ns, &[]).await;
    let tmp = tempfile::tempdir().expect("tmp");
    let stacks: Api<Stack> = Api::namespaced(plane.client(), &ns);
    let cases = [
        (
            "teapot",
            teapot.url("/repo"),
            "the request was refused by the server",
            "418",
        ),
        ("failing", failing.url("/repo"), "the server failed", "503"),
        (
            "closed",
            format!("http://127.0.0.1:{closed}/repo"),
            "unreachable (no connection, or no answer in time)",
            "refused (os error",
        ),
    ];
    for (name, url, _, _) in &cases {
        let spec = json!({"projectRepo": url, "branch": "main"});
        stacks
            .create(
                &PostParams::default(),
                &fixtures::file_backend_stack(name, tmp.path(), spec),
            )
            .await
            .expect("create stack");
    }
    for (name, url, class, code) in &cases {
        let message = pko_tests::fixtures::stalled_stack(&stacks, name, WAIT).await;
        assert_eq!(message.0, "SourceUnavailable", "{name}: {message:?}");
        let message = message.1;
        assert_eq!(
            message,
            format!("cannot list the refs of {url}: {class}"),
            "{name}"
        );
        // The URL is the tenant's own (its port may hold any digits): judged without it.
        let said = message.replace(url.as_str(), "");
        for leak in [*code, SECRET, "teapot", "os error", "tcp connect"] {
            assert!(!said.contains(leak), "{name}: {leak:?} in {message}");
        }
    }
    let events = plane
        .kubectl()
        .args(["get", "events", "-n", &ns, "-o", "json"])
        .output()
        .expect("kubectl");
    let events = String::from_utf8_lossy(&events.stdout);
    for leak in [SECRET, "teapot", "Service Unavailable", "os error"] {
        assert!(!events.contains(leak), "an Event says {leak:?}: {events}");
    }
    // The servers were asked (the classes come from real answers).
    assert!(!teapot.seen().is_empty() && !failing.seen().is_empty());
}
