//! `--log-format=json`: every line the operator prints, from start-up to shutdown, is one JSON
//! object with the fields log pipelines index on (timestamp, level, target, message), and a
//! reconcile's lines carry the Program they are about.

use std::collections::BTreeSet;
use std::time::Duration;

use kube::Api;
use kube::api::PostParams;
use pko_api::program::Program;
use pko_tests::fixtures::config_map_program as program;
use pko_tests::operator::{Operator, OperatorOptions};
use pko_tests::{ControlPlane, wait_for};
use serde_json::Value;

const WAIT: Duration = Duration::from_secs(60);

#[tokio::test]
async fn json_logs_are_one_object_per_line_from_start_to_shutdown() {
    let _machine = pko_tests::serial::shared().await;
    let plane = ControlPlane::shared().await;
    let ns = plane.namespace("logs-json").await.expect("namespace");
    let mut op = Operator::start(
        plane,
        OperatorOptions {
            args: vec!["--log-format=json".into()],
            ..OperatorOptions::default()
        },
    )
    .await
    .expect("operator starts");
    let api = Api::<Program>::namespaced(plane.client(), &ns);
    api.create(&PostParams::default(), &program("p"))
        .await
        .expect("create");
    wait_for("the Program's artifact", WAIT, || async {
        api.get("p").await.ok()?.status?.artifact.map(|_| ())
    })
    .await
    .unwrap_or_else(|e| panic!("{e}; log:\n{}", op.log_text()));
    // The line follows the status write, which the test can see before the operator has its
    // answer: wait for it rather than stop the operator between the two.
    wait_for("the artifact ready line", WAIT, || async {
        op.log_text().contains("artifact ready").then_some(())
    })
    .await
    .unwrap_or_else(|e| panic!("{e}; log:\n{}", op.log_text()));
    let exit = op.terminate(Duration::from_secs(30));
    assert!(
        exit.is_some_and(|s| s.success()),
        "SIGTERM → {exit:?}; log:\n{}",
        op.log_text()
    );

    let text = op.log_text();
    let mut levels = BTreeSet::new();
    let mut messages = BTreeSet::new();
    let mut reconcile_of_p = false;
    for (n, line) in text
        .lines()
        .enumerate()
        .filter(|(_, l)| !l.trim().is_empty())
    {
        let n = n + 1;
        let value: Value = serde_json::from_str(line)
            .unwrap_or_else(|e| panic!("line {n} is not JSON ({e}): {line}"));
        let object = value
            .as_object()
            .unwrap_or_else(|| panic!("line {n} is not a JSON object: {line}"));
        let field = |key: &str| object.get(key).and_then(Value::as_str);
        let timestamp = field("timestamp").unwrap_or_else(|| panic!("line {n}: no timestamp"));
        timestamp
            .parse::<jiff::Timestamp>()
            .unwrap_or_else(|e| panic!("line {n}: timestamp {timestamp:?} is not RFC 3339: {e}"));
        let level = field("level").unwrap_or_else(|| panic!("line {n}: no level: {line}"));
        assert!(
            ["TRACE", "DEBUG", "INFO", "WARN", "ERROR"].contains(&level),
            "line {n}: level {level:?}"
        );
        assert!(
            field("target").is_some_and(|t| !t.is_empty()),
            "line {n}: no target: {line}"
        );
        let message = field("message").unwrap_or_else(|| panic!("line {n}: no message: {line}"));
        levels.insert(level.to_owned());
        messages.insert(message.to_owned());
        // The reconcile span names the Program: `"span": {"program": "<ns>/p", …}`.
        let program = format!("{ns}/p");
        if message == "artifact ready"
            && object
                .get("span")
                .and_then(|s| s.get("program"))
                .and_then(Value::as_str)
                == Some(program.as_str())
        {
            reconcile_of_p = true;
        }
    }
    assert!(levels.contains("INFO"), "no INFO line in:\n{text}");
    assert!(
        messages.contains("shutting down"),
        "the shutdown is not logged:\n{text}"
    );
    assert!(
        reconcile_of_p,
        "no \"artifact ready\" line in the span of {ns}/p:\n{text}"
    );
}

/// The log filter is replaced while the operator runs, through the loopback admin listener:
/// `PUT /log-level debug` brings the reconciles' debug lines, a filter that does not parse is
/// refused with the parser's message and the one in force kept, and `GET` says which it is.
/// The admin listener refuses any address but loopback at start.
#[tokio::test]
async fn the_log_level_is_changed_at_run_time_on_loopback_only() {
    let _machine = pko_tests::serial::shared().await;
    let plane = ControlPlane::shared().await;
    let refused = Operator::start(
        plane,
        OperatorOptions {
            args: vec!["--admin-bind-address=0.0.0.0:1".into()],
            ..OperatorOptions::default()
        },
    )
    .await;
    let Err(err) = refused else {
        panic!("an admin listener on every interface was started")
    };
    assert!(err.to_string().contains("not a loopback address"), "{err}");

    let ns = plane.namespace("logs-level").await.expect("namespace");
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("a free port")
        .port();
    let op = Operator::start(
        plane,
        OperatorOptions {
            args: vec![
                format!("--admin-bind-address=127.0.0.1:{port}"),
                "--log-level=info".into(),
                format!("--watch-namespace={ns}"),
            ],
            ..OperatorOptions::default()
        },
    )
    .await
    .expect("operator starts");
    let url = format!("http://127.0.0.1:{port}/log-level");
    let http = reqwest::Client::new();
    let get = || async {
        let resp = http.get(&url).send().await.expect("GET");
        (resp.status().as_u16(), resp.text().await.expect("body"))
    };
    let put = |body: &'static str| {
        let (http, url) = (http.clone(), url.clone());
        async move {
            let resp = http.put(&url).body(body).send().await.expect("PUT");
            (resp.status().as_u16(), resp.text().await.expect("body"))
        }
    };
    assert_eq!(get().await, (200, "info\n".to_owned()));
    let api = Api::<Program>::namespaced(plane.client(), &ns);
    api.create(&PostParams::default(), &program("before"))
        .await
        .expect("create");
    wait_for("the first artifact", WAIT, || async {
        api.get("before").await.ok()?.status?.artifact.map(|_| ())
    })
    .await
    .unwrap_or_else(|e| panic!("{e}; log:\n{}", op.log_text()));
    assert!(!op.log_text().contains(" DEBUG "), "debug lines at info");

    assert_eq!(put("debug").await, (200, "debug\n".to_owned()));
    api.create(&PostParams::default(), &program("after"))
        .await
        .expect("create");
    wait_for("a debug line", WAIT, || async {
        op.log_text().contains(" DEBUG ").then_some(())
    })
    .await
    .unwrap_or_else(|e| panic!("{e}; log:\n{}", op.log_text()));

    let (code, body) = put("debug,=[").await;
    assert_eq!(code, 400, "{body}");
    assert!(body.contains("invalid log filter"), "{body}");
    assert_eq!(get().await, (200, "debug\n".to_owned()));
}
