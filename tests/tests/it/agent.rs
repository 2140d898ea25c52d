//! The workspace agent against the real `pulumi` CLI (offline `file://` backend): RPCs,
//! streaming, auth, and `init`'s artifact checks.

use std::collections::HashMap;
use std::io::Write;
use std::path::Path;
use tokio::process::Command;

use pko_agent::proto::{self as pb, config_item};
use pko_tests::agent::{AgentOptions, AgentProcess, StaticServer, agent_binary};
use serde_json::{Value, json};
use sha2::{Digest, Sha256};
use tonic::Code;

const PROGRAM: &str = r#"name: greeter
runtime: yaml
config:
  greeting:
    type: string
  password:
    type: string
variables:
  msg: ${greeting}-world
outputs:
  message: ${msg}
  secretOut: ${password}
  count: 3
"#;

fn project(dir: &Path, yaml: &str) {
    std::fs::create_dir_all(dir).expect("project dir");
    std::fs::write(dir.join("Pulumi.yaml"), yaml).expect("Pulumi.yaml");
}

async fn start(tmp: &Path, tls: bool, token: Option<&str>) -> AgentProcess {
    let ws = tmp.join("workspace");
    project(&ws, PROGRAM);
    AgentProcess::start(AgentOptions {
        workspace: ws,
        state: tmp.to_path_buf(),
        tls,
        token: token.map(str::to_owned),
    })
    .await
    .expect("agent starts")
}

fn literal(key: &str, value: &str, secret: bool) -> pb::ConfigItem {
    pb::ConfigItem {
        key: key.into(),
        path: None,
        v: Some(config_item::V::Value(pko_agent::values::to_pb(&json!(
            value
        )))),
        secret: Some(secret),
    }
}

/// Reads a server stream to its end: (events as JSON, the final message).
async fn drain<T>(
    mut stream: tonic::Streaming<T>,
    event_of: impl Fn(&T) -> Option<Value>,
) -> Result<(Vec<Value>, T), tonic::Status> {
    let mut events = Vec::new();
    let mut last = None;
    while let Some(msg) = stream.message().await? {
        match event_of(&msg) {
            Some(e) => events.push(e),
            None => last = Some(msg),
        }
    }
    Ok((events, last.expect("a result message ends the stream")))
}

fn has_event(events: &[Value], kind: &str) -> bool {
    events.iter().any(|e| e.get(kind).is_some())
}

/// The CLI commands the agent ran, in order, from its log (it logs each at debug level).
fn cli_calls(log: &str) -> Vec<String> {
    log.lines()
        .filter_map(|line| {
            let (_, rest) = line.split_once(" command=")?;
            Some(rest.trim_matches('"').to_owned())
        })
        .collect()
}

/// A plaintext agent serving the project in `ws`, with stack `dev` created and selected.
async fn agent_with_dev_stack(
    state: &Path,
    ws: &Path,
) -> (AgentProcess, pko_agent::client::AgentClient) {
    let agent = AgentProcess::start(AgentOptions {
        workspace: ws.to_path_buf(),
        state: state.to_path_buf(),
        tls: false,
        token: Some("tok".into()),
    })
    .await
    .expect("agent");
    let mut client = agent.client().await.expect("client");
    client
        .select_stack(pb::SelectStackRequest {
            stack_name: "dev".into(),
            create: Some(true),
            secrets_provider: None,
            skip_summary: None,
        })
        .await
        .expect("select");
    (agent, client)
}

#[tokio::test]
async fn up_preview_destroy_with_config_and_outputs_over_tls() {
    let _machine = pko_tests::serial::shared().await;
    let tmp = tempfile::tempdir().expect("tmp");
    let agent = start(tmp.path(), true, Some("t0ken-for-tests")).await;
    let mut client = agent.client().await.expect("client");

    let version = client
        .pulumi_version(pb::PulumiVersionRequest {})
        .await
        .expect("version");
    assert!(
        version.metadata().get(pko_agent::INSTANCE_HEADER).is_some(),
        "every answer names the agent instance"
    );
    assert_eq!(version.into_inner().version, "v3.274.1");
    let who = client
        .who_am_i(pb::WhoAmIRequest {})
        .await
        .expect("whoami")
        .into_inner();
    assert!(who.url.starts_with("file://"), "{who:?}");

    // No stack selected yet.
    let err = client.info(pb::InfoRequest {}).await.expect_err("no stack");
    assert_eq!(err.code(), Code::FailedPrecondition);
    // A name the CLI could read as a flag never reaches it (`--help` would "select" nothing
    // and succeed).
    for name in ["--help", "-s", "dev/-x"] {
        let err = client
            .select_stack(pb::SelectStackRequest {
                stack_name: name.into(),
                create: Some(true),
                secrets_provider: None,
                skip_summary: None,
            })
            .await
            .expect_err("refused");
        assert_eq!(err.code(), Code::InvalidArgument, "{name}");
    }
    let err = client
        .select_stack(pb::SelectStackRequest {
            stack_name: "dev".into(),
            create: Some(false),
            secrets_provider: None,
            skip_summary: None,
        })
        .await
        .expect_err("missing stack");
    assert_eq!(err.code(), Code::NotFound);
    let selected = client
        .select_stack(pb::SelectStackRequest {
            stack_name: "dev".into(),
            create: Some(true),
            secrets_provider: None,
            skip_summary: None,
        })
        .await
        .expect("select")
        .into_inner();
    assert_eq!(selected.summary.expect("summary").name, "dev");
    // Selected again without the summary: no CLI call at all (the selection is this
    // process's, and the summary's `stack ls` is skipped).
    let calls_before = cli_calls(&agent.log_text());
    assert!(
        calls_before.iter().any(|c| c.starts_with("stack ls")),
        "the summary is the stack's line of `stack ls`: {calls_before:?}"
    );
    let again = client
        .select_stack(pb::SelectStackRequest {
            stack_name: "dev".into(),
            create: Some(true),
            secrets_provider: None,
            skip_summary: Some(true),
        })
        .await
        .expect("select again")
        .into_inner();
    assert!(again.summary.is_none(), "{again:?}");
    assert_eq!(cli_calls(&agent.log_text()), calls_before);

    client
        .set_all_config(pb::SetAllConfigRequest {
            config: vec![
                literal("greeting", "hello", false),
                literal("password", "hunter2", true),
            ],
        })
        .await
        .expect("config");
    let config = std::fs::read_to_string(tmp.path().join("workspace/Pulumi.dev.yaml"))
        .expect("stack config");
    assert!(config.contains("greeter:greeting: hello"), "{config}");
    assert!(
        !config.contains("hunter2"),
        "secrets are encrypted: {config}"
    );

    let preview = client
        .preview(pb::PreviewRequest::default())
        .await
        .expect("preview")
        .into_inner();
    let (events, result) = drain(preview, |m: &pb::PreviewStream| match &m.response {
        Some(pb::preview_stream::Response::Event(e)) => {
            Some(Value::Object(pko_agent::values::from_struct(e)))
        }
        _ => None,
    })
    .await
    .expect("preview stream");
    assert!(
        has_event(&events, "preludeEvent") && has_event(&events, "summaryEvent"),
        "{events:?}\n{}",
        agent.log_text()
    );
    let Some(pb::preview_stream::Response::Result(preview)) = result.response else {
        panic!("preview result")
    };
    assert_eq!(preview.summary.expect("summary").result, "succeeded");
    assert_eq!(preview.project_info.expect("project").name, "greeter");

    let calls_before = cli_calls(&agent.log_text()).len();
    let up = client
        .up(pb::UpRequest::default())
        .await
        .expect("up")
        .into_inner();
    let (events, result) = drain(up, |m: &pb::UpStream| match &m.response {
        Some(pb::up_stream::Response::Event(e)) => {
            Some(Value::Object(pko_agent::values::from_struct(e)))
        }
        _ => None,
    })
    .await
    .expect("up stream");
    assert!(has_event(&events, "resOutputsEvent"), "{events:?}");
    let Some(pb::up_stream::Response::Result(up)) = result.response else {
        panic!("up result")
    };
    let summary = up.summary.expect("summary");
    assert_eq!(summary.result, "succeeded");
    assert!(summary.start_time.is_some() && summary.end_time.is_some());
    let output = |k: &str| {
        let o = &up.outputs[k];
        (
            serde_json::from_slice::<Value>(&o.value).expect("json"),
            o.secret,
        )
    };
    assert_eq!(output("message"), (json!("hello-world"), false));
    assert_eq!(output("secretOut"), (json!("hunter2"), true));
    assert_eq!(output("count"), (json!(3), false));
    // Which outputs are secret came from the up's own engine events: one `stack output`,
    // not a second, masked one to compare with.
    let calls = cli_calls(&agent.log_text());
    let outputs_read = calls[calls_before..]
        .iter()
        .filter(|c| c.starts_with("stack output"))
        .count();
    assert_eq!(outputs_read, 1, "{:?}", &calls[calls_before..]);
    // The secret went through `config set-all`, the program and the outputs: the agent's log,
    // at its most verbose, never shows it.
    let log = agent.log_text();
    assert!(log.contains("config set-all"), "the commands are logged");
    assert!(
        !log.contains("hunter2"),
        "a secret in the agent's log:\n{log}"
    );
    assert!(up.stdout.contains("hello-world"), "{}", up.stdout);

    let info = client
        .info(pb::InfoRequest {})
        .await
        .expect("info")
        .into_inner();
    let summary = info.summary.expect("summary");
    assert_eq!(summary.resource_count, Some(1));
    assert!(summary.last_update.is_some());

    let destroy = client
        .destroy(pb::DestroyRequest::default())
        .await
        .expect("destroy")
        .into_inner();
    let (_, result) = drain(destroy, |m: &pb::DestroyStream| match &m.response {
        Some(pb::destroy_stream::Response::Event(e)) => {
            Some(Value::Object(pko_agent::values::from_struct(e)))
        }
        _ => None,
    })
    .await
    .expect("destroy stream");
    let Some(pb::destroy_stream::Response::Result(destroy)) = result.response else {
        panic!("destroy result")
    };
    assert_eq!(destroy.summary.expect("summary").result, "succeeded");
    let info = client
        .info(pb::InfoRequest {})
        .await
        .expect("info")
        .into_inner();
    assert_eq!(info.summary.expect("summary").resource_count, Some(0));

    // Refresh of the (empty) stack also streams and completes.
    let refresh = client
        .refresh(pb::RefreshRequest::default())
        .await
        .expect("refresh")
        .into_inner();
    let (_, result) = drain(refresh, |m: &pb::RefreshStream| match &m.response {
        Some(pb::refresh_stream::Response::Event(e)) => {
            Some(Value::Object(pko_agent::values::from_struct(e)))
        }
        _ => None,
    })
    .await
    .expect("refresh stream");
    assert!(matches!(
        result.response,
        Some(pb::refresh_stream::Response::Result(_))
    ));
}

/// One `up` through the agent: its result, or the status that ended the stream.
async fn up_once(
    client: &mut pko_agent::client::AgentClient,
) -> Result<pb::UpResult, tonic::Status> {
    let stream = client.up(pb::UpRequest::default()).await?.into_inner();
    let (_, last) = drain(stream, |m: &pb::UpStream| match &m.response {
        Some(pb::up_stream::Response::Event(_)) => Some(Value::Null),
        _ => None,
    })
    .await?;
    match last.response {
        Some(pb::up_stream::Response::Result(r)) => Ok(r),
        other => panic!("up ended with {other:?}"),
    }
}

/// Selection without the summary is not checked against the backend: a stack removed behind
/// the agent fails the next operation with the CLI's own words, and the selection after it
/// asks the CLI again (and creates the stack when asked to).
#[tokio::test]
async fn a_stack_removed_behind_the_agent_is_selected_again() {
    let _machine = pko_tests::serial::shared().await;
    let tmp = tempfile::tempdir().expect("tmp");
    let agent = start(tmp.path(), false, None).await;
    let mut client = agent.client().await.expect("client");
    let select = pb::SelectStackRequest {
        stack_name: "dev".into(),
        create: Some(true),
        secrets_provider: None,
        skip_summary: Some(true),
    };
    client.select_stack(select.clone()).await.expect("select");
    client
        .set_all_config(pb::SetAllConfigRequest {
            config: vec![
                literal("greeting", "hi", false),
                literal("password", "pw", true),
            ],
        })
        .await
        .expect("config");
    up_once(&mut client).await.expect("first up");

    let removed = Command::new("pulumi")
        .args(["stack", "rm", "--yes", "--force", "dev"])
        .current_dir(tmp.path().join("workspace"))
        .envs(pko_tests::agent::pulumi_env(tmp.path()).expect("env"))
        .output()
        .await
        .expect("pulumi stack rm");
    assert!(removed.status.success(), "{removed:?}");

    // Still selected in the agent, unchecked: the operation says what happened.
    client
        .select_stack(select.clone())
        .await
        .expect("select, cached");
    let err = up_once(&mut client).await.expect_err("the stack is gone");
    assert!(
        err.message().contains("no stack named"),
        "{}\n{}",
        err.message(),
        agent.log_text()
    );
    // Forgotten: the next selection runs the CLI, which creates the stack again.
    client.select_stack(select).await.expect("select, created");
    client
        .set_all_config(pb::SetAllConfigRequest {
            config: vec![
                literal("greeting", "again", false),
                literal("password", "pw", true),
            ],
        })
        .await
        .expect("config");
    let up = up_once(&mut client)
        .await
        .expect("up after the stack came back");
    assert_eq!(up.outputs["message"].value, br#""again-world""#.to_vec());
    assert!(up.outputs["secretOut"].secret);
}

#[tokio::test]
async fn failed_update_is_an_error_with_the_cli_diagnosis() {
    let _machine = pko_tests::serial::shared().await;
    let tmp = tempfile::tempdir().expect("tmp");
    let agent = start(tmp.path(), false, None).await;
    let mut client = agent.client().await.expect("client");
    client
        .select_stack(pb::SelectStackRequest {
            stack_name: "dev".into(),
            create: Some(true),
            secrets_provider: None,
            skip_summary: None,
        })
        .await
        .expect("select");
    // `greeting` and `password` are required config: the program fails.
    let stream = client
        .up(pb::UpRequest::default())
        .await
        .expect("up")
        .into_inner();
    let err = drain(stream, |m: &pb::UpStream| match &m.response {
        Some(pb::up_stream::Response::Event(_)) => Some(Value::Null),
        _ => None,
    })
    .await
    .expect_err("up fails");
    assert_eq!(err.code(), Code::Unknown);
    assert!(err.message().starts_with("up failed:"), "{}", err.message());
    assert!(
        err.message().contains("greeting"),
        "the CLI's diagnosis is kept: {}",
        err.message()
    );
}

#[tokio::test]
async fn calls_without_the_token_are_refused() {
    let _machine = pko_tests::serial::shared().await;
    let tmp = tempfile::tempdir().expect("tmp");
    let agent = start(tmp.path(), true, Some("right-token")).await;
    let mut target = agent.target();
    target.token = None;
    let mut anonymous = pko_agent::client::connect(&target).await.expect("connect");
    let err = anonymous
        .pulumi_version(pb::PulumiVersionRequest {})
        .await
        .expect_err("no token");
    assert_eq!(err.code(), Code::Unauthenticated);
    target.token = Some("wrong-token".into());
    let mut wrong = pko_agent::client::connect(&target).await.expect("connect");
    let err = wrong
        .pulumi_version(pb::PulumiVersionRequest {})
        .await
        .expect_err("wrong token");
    assert_eq!(err.code(), Code::Unauthenticated);
    // TLS is pinned: a client that trusts another certificate cannot connect.
    let (other_cert, _) =
        pko_tests::agent::self_signed(&[pko_tests::agent::TEST_SERVER_NAME]).expect("cert");
    let mut target = agent.target();
    target.ca_pem = Some(other_cert.into_bytes());
    let result = match pko_agent::client::connect(&target).await {
        Ok(mut c) => c
            .pulumi_version(pb::PulumiVersionRequest {})
            .await
            .map(|_| ()),
        Err(e) => Err(tonic::Status::unavailable(e.to_string())),
    };
    assert!(result.is_err(), "an unpinned certificate is refused");
}

fn targz(entries: &[(&str, &[u8])]) -> Vec<u8> {
    let gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::default());
    let mut builder = tar::Builder::new(gz);
    for (path, data) in entries {
        let mut header = tar::Header::new_gnu();
        header.set_entry_type(tar::EntryType::Regular);
        header.set_size(data.len() as u64);
        header.set_mode(0o644);
        // Written by hand so that unsafe names (`../x`) get through.
        let name = &mut header.as_old_mut().name;
        name[..path.len()].copy_from_slice(path.as_bytes());
        header.set_cksum();
        builder.append(&header, *data).expect("append");
    }
    let gz = builder.into_inner().expect("tar");
    let mut out = gz.finish().expect("gzip");
    out.flush().expect("flush");
    out
}

fn digest(bytes: &[u8]) -> String {
    format!("sha256:{}", hex::encode(Sha256::digest(bytes)))
}

/// Runs `pko-agent init` (asynchronously: the artifact server runs on this test's runtime).
async fn init(target: &Path, url: &str, digest: &str, link: &Path) -> std::process::Output {
    Command::new(agent_binary().expect("agent binary"))
        .args(["init", "--target-dir"])
        .arg(target)
        .args([
            "--flux-url",
            url,
            "--flux-digest",
            digest,
            "--dir",
            "proj",
            "--link",
        ])
        .arg(link)
        .output()
        .await
        .expect("run init")
}

#[tokio::test]
async fn init_fetches_verifies_and_links_the_artifact() {
    let _machine = pko_tests::serial::shared().await;
    let good = targz(&[
        ("proj/Pulumi.yaml", PROGRAM.as_bytes()),
        ("proj/extra.txt", b"x"),
    ]);
    let server = StaticServer::start(HashMap::from([("/a.tar.gz".to_owned(), good.clone())]))
        .await
        .expect("server");
    let tmp = tempfile::tempdir().expect("tmp");
    let (target, link) = (tmp.path().join("source"), tmp.path().join("workspace"));
    let out = init(&target, &server.url("/a.tar.gz"), &digest(&good), &link).await;
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(
        std::fs::read_to_string(link.join("Pulumi.yaml")).expect("linked project"),
        PROGRAM
    );
}

#[tokio::test]
async fn init_fails_clearly_on_a_digest_mismatch() {
    let _machine = pko_tests::serial::shared().await;
    let good = targz(&[("proj/Pulumi.yaml", PROGRAM.as_bytes())]);
    let mut corrupted = good.clone();
    let last = corrupted.len() - 1;
    corrupted[last] ^= 0xff;
    let server = StaticServer::start(HashMap::from([("/a.tar.gz".to_owned(), corrupted)]))
        .await
        .expect("server");
    let tmp = tempfile::tempdir().expect("tmp");
    let (target, link) = (tmp.path().join("source"), tmp.path().join("workspace"));
    let out = init(&target, &server.url("/a.tar.gz"), &digest(&good), &link).await;
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("artifact digest mismatch") && stderr.contains(&digest(&good)),
        "{stderr}"
    );
    assert!(!target.exists() && !link.exists(), "nothing is unpacked");
}

#[tokio::test]
async fn init_rejects_path_traversal() {
    let _machine = pko_tests::serial::shared().await;
    let evil = targz(&[
        ("proj/Pulumi.yaml", PROGRAM.as_bytes()),
        ("../escaped.txt", b"pwned"),
    ]);
    let server = StaticServer::start(HashMap::from([("/e.tar.gz".to_owned(), evil.clone())]))
        .await
        .expect("server");
    let tmp = tempfile::tempdir().expect("tmp");
    let outer = tmp.path().join("outer");
    std::fs::create_dir_all(&outer).expect("outer");
    let (target, link) = (outer.join("source"), outer.join("workspace"));
    let out = init(&target, &server.url("/e.tar.gz"), &digest(&evil), &link).await;
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("unsafe path in artifact: \"../escaped.txt\""),
        "{stderr}"
    );
    assert!(!outer.join("escaped.txt").exists() && !tmp.path().join("escaped.txt").exists());
    assert!(!target.exists());
}

#[tokio::test]
async fn init_reports_http_errors() {
    let _machine = pko_tests::serial::shared().await;
    let server = StaticServer::start(HashMap::new()).await.expect("server");
    let tmp = tempfile::tempdir().expect("tmp");
    let (target, link) = (tmp.path().join("source"), tmp.path().join("workspace"));
    let out = init(
        &target,
        &server.url("/missing.tar.gz"),
        &format!("sha256:{}", "0".repeat(64)),
        &link,
    )
    .await;
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("HTTP 404"), "{stderr}");
}

/// `fn::readFile` of a named pipe blocks the program until something writes to the pipe: an
/// operation that runs as long as the test wants, with no provider plugin.
const BLOCKING_PROGRAM: &str = r#"name: blocker
runtime: yaml
config:
  file:
    type: string
variables:
  content:
    fn::readFile: ${file}
outputs:
  content: ${content}
"#;

#[tokio::test]
async fn a_disconnected_client_cancels_its_operation_and_frees_the_workspace() {
    let _machine = pko_tests::serial::shared().await;
    let tmp = tempfile::tempdir().expect("tmp");
    let ws = tmp.path().join("workspace");
    project(&ws, BLOCKING_PROGRAM);
    std::fs::write(ws.join("plain.txt"), "hi\n").expect("plain file");
    let pipe = ws.join("pipe");
    pko_tests::fifo::make(&pipe).expect("mkfifo");
    let (agent, mut client) = agent_with_dev_stack(tmp.path(), &ws).await;
    let set_file = |file: &str| pb::SetAllConfigRequest {
        config: vec![literal("file", file, false)],
    };
    client
        .set_all_config(set_file("./pipe"))
        .await
        .expect("config");

    let mut stream = client
        .up(pb::UpRequest::default())
        .await
        .expect("up")
        .into_inner();
    let first = stream
        .message()
        .await
        .expect("an event")
        .expect("not the end");
    assert!(matches!(
        first.response,
        Some(pb::up_stream::Response::Event(_))
    ));
    // The client goes away while the program is blocked. The deadlines below only bound a
    // hang: pulumi may still be starting its language host on a loaded machine.
    drop(stream);
    pko_tests::wait_for(
        "the agent to interrupt pulumi",
        std::time::Duration::from_secs(120),
        || async {
            agent
                .log_text()
                .contains("interrupting pulumi")
                .then_some(())
        },
    )
    .await
    .expect("interrupted");
    // Feed the pipe to whoever opens it, so a program blocked on it can finish canceling (and
    // unlock the stack). Whether the program got to the pipe before the interrupt depends on
    // how fast pulumi started, so the wait is for the canceled operation's end, not a read.
    let feeder =
        pko_tests::fifo::Feeder::start(pipe.clone(), "late\n", std::time::Duration::from_secs(240));
    pko_tests::wait_for(
        "the canceled up to end",
        std::time::Duration::from_secs(240),
        || async { agent.log_text().contains("up was canceled").then_some(()) },
    )
    .await
    .expect("the first up ends canceled");
    drop(feeder);

    // The workspace is free again: the next operation runs (after the canceled one ends).
    client
        .set_all_config(set_file("./plain.txt"))
        .await
        .expect("config");
    let stream = client
        .up(pb::UpRequest::default())
        .await
        .expect("up")
        .into_inner();
    let (_, result) = drain(stream, |m: &pb::UpStream| match &m.response {
        Some(pb::up_stream::Response::Event(_)) => Some(Value::Null),
        _ => None,
    })
    .await
    .expect("second up");
    let Some(pb::up_stream::Response::Result(up)) = result.response else {
        panic!("up result")
    };
    assert_eq!(
        serde_json::from_slice::<Value>(&up.outputs["content"].value).expect("json"),
        json!("hi\n")
    );
    assert!(
        agent.log_text().contains("up was canceled"),
        "the first update ended canceled: {}",
        agent.log_text()
    );
}

/// The agent runs inside any image that has the pulumi CLI (Debian, Alpine, distroless…), so it
/// must not need a dynamic loader. `make test` points `PKO_AGENT_BINARY` at the static build, the
/// one every test here (and the image) runs.
#[test]
fn the_agent_under_test_is_statically_linked() {
    let _machine = pko_tests::serial::shared_blocking();
    let binary = agent_binary().expect("agent binary");
    assert!(
        std::env::var_os(pko_tests::agent::AGENT_BINARY_ENV).is_some(),
        "{} is not set: run the tests with `make test` (it builds the static agent)",
        pko_tests::agent::AGENT_BINARY_ENV
    );
    assert!(
        !pko_tests::agent::needs_dynamic_loader(&binary).expect("an ELF file"),
        "{} needs a dynamic loader",
        binary.display()
    );
    // A dynamically linked executable is told apart, so the check above can fail.
    let dynamic = std::env::current_exe().expect("this test binary");
    assert!(pko_tests::agent::needs_dynamic_loader(&dynamic).expect("an ELF file"));
}

const STRUCTURED_PROGRAM: &str = r#"name: shapes
runtime: yaml
configuration:
  settings:
    type: Object
  replicas:
    type: Number
  tags:
    type: List<String>
outputs:
  settings: ${settings}
  replicas: ${replicas}
  tags: ${tags}
"#;

/// Structured values (objects, lists, numbers) reach the program typed, by value and from a
/// file read as JSON, through the real CLI (`config set-all --json`).
#[tokio::test]
async fn structured_config_reaches_the_program_typed() {
    let _machine = pko_tests::serial::shared().await;
    let tmp = tempfile::tempdir().expect("tmp");
    let ws = tmp.path().join("workspace");
    project(&ws, STRUCTURED_PROGRAM);
    std::fs::write(tmp.path().join("replicas.json"), "3").expect("file");
    let (agent, mut client) = agent_with_dev_stack(tmp.path(), &ws).await;
    let value = |key: &str, v: Value| pb::ConfigItem {
        key: key.into(),
        path: None,
        v: Some(config_item::V::Value(pko_agent::values::to_pb(&v))),
        secret: None,
    };
    client
        .set_all_config(pb::SetAllConfigRequest {
            config: vec![
                value("settings", json!({"size": "large", "ports": [80, 443]})),
                value("tags", json!(["a", "b"])),
                pb::ConfigItem {
                    key: "replicas".into(),
                    path: None,
                    v: Some(config_item::V::ValueFrom(pb::ConfigValueFrom {
                        f: Some(pko_agent::proto::config_value_from::F::Path(
                            tmp.path().join("replicas.json").display().to_string(),
                        )),
                        json: Some(true),
                    })),
                    secret: None,
                },
            ],
        })
        .await
        .expect("structured config");
    let up = client
        .up(pb::UpRequest::default())
        .await
        .expect("up")
        .into_inner();
    let (_, result) = drain(up, |_: &pb::UpStream| None::<Value>)
        .await
        .expect("up stream");
    let Some(pb::up_stream::Response::Result(up)) = result.response else {
        panic!("up result: {}", agent.log_text())
    };
    let output = |k: &str| serde_json::from_slice::<Value>(&up.outputs[k].value).expect("json");
    assert_eq!(
        output("settings"),
        json!({"size": "large", "ports": [80, 443]})
    );
    assert_eq!(output("replicas"), json!(3));
    assert_eq!(output("tags"), json!(["a", "b"]));
}

/// `text`, when cut by the agent at `max` bytes: (the kept text, the bytes cut); `None` when it
/// carries no marker.
fn cut_at(text: &str, max: usize) -> Option<(&str, usize)> {
    let at = text.rfind("… [truncated ")?;
    let (kept, marker) = text.split_at(at);
    let cut: usize = marker
        .strip_prefix("… [truncated ")?
        .strip_suffix(" bytes]")?
        .parse()
        .ok()?;
    assert!(kept.len() <= max, "{} bytes kept, over {max}", kept.len());
    assert!(!kept.contains('\u{FFFD}'), "a character was split");
    Some((kept, cut))
}

/// Every string of a JSON value.
fn strings(value: &Value, out: &mut Vec<String>) {
    match value {
        Value::String(s) => out.push(s.clone()),
        Value::Array(items) => items.iter().for_each(|v| strings(v, out)),
        Value::Object(map) => map.values().for_each(|v| strings(v, out)),
        _ => {}
    }
}

/// A program's huge output and huge printed message reach the client cut at the agent's bounds,
/// with the marker, on a character boundary ("x" then 2-byte characters: every even bound falls
/// inside one): the output value, the engine events' strings, the CLI's output lines.
#[tokio::test]
async fn huge_outputs_and_lines_reach_the_client_cut_with_a_marker() {
    let _machine = pko_tests::serial::shared().await;
    const LINE: usize = 4096;
    const VALUE: usize = 8192;
    let tmp = tempfile::tempdir().expect("tmp");
    let ws = tmp.path().join("workspace");
    let big = tmp.path().join("big.txt");
    let content = format!("x{}", "é".repeat(150_000));
    std::fs::write(&big, &content).expect("big file");
    let program = |output: &str| {
        format!(
            "name: big\nruntime: yaml\nvariables:\n  huge:\n    fn::readFile: {}\noutputs:\n  small: ok\n  big: {output}\n",
            big.display()
        )
    };
    project(&ws, &program("${huge}"));
    let agent = AgentProcess::start_with_args(
        AgentOptions {
            workspace: ws.clone(),
            state: tmp.path().to_path_buf(),
            tls: false,
            token: Some("tok".into()),
        },
        &[
            format!("--max-log-line-bytes={LINE}"),
            format!("--max-output-value-bytes={VALUE}"),
        ],
    )
    .await
    .expect("agent");
    let mut client = agent.client().await.expect("client");
    client
        .select_stack(pb::SelectStackRequest {
            stack_name: "dev".into(),
            create: Some(true),
            secrets_provider: None,
            skip_summary: None,
        })
        .await
        .expect("select");

    let up = client
        .up(pb::UpRequest::default())
        .await
        .expect("up")
        .into_inner();
    let (events, result) = drain(up, |m: &pb::UpStream| match &m.response {
        Some(pb::up_stream::Response::Event(e)) => {
            Some(Value::Object(pko_agent::values::from_struct(e)))
        }
        _ => None,
    })
    .await
    .unwrap_or_else(|e| panic!("up stream: {e:?}\n{}", agent.log_text()));
    let Some(pb::up_stream::Response::Result(up)) = result.response else {
        panic!("up result")
    };
    let output = |k: &str| serde_json::from_slice::<Value>(&up.outputs[k].value).expect("json");
    assert_eq!(output("small"), json!("ok"));
    let big_out = output("big");
    let big_out = big_out.as_str().expect("a string");
    let (kept, cut) = cut_at(big_out, VALUE).expect("the output value carries the marker");
    assert!(content.starts_with(kept), "the value's beginning is kept");
    assert_eq!(
        kept.len() + cut,
        content.len(),
        "the marker counts what was cut"
    );
    assert!(kept.len() > VALUE - 2, "as much as fits is kept");

    // The value travels in the engine's events too (the stack's outputs): cut at the line bound.
    let mut texts = Vec::new();
    events.iter().for_each(|e| strings(e, &mut texts));
    let cut_strings: Vec<&String> = texts.iter().filter(|t| t.contains("[truncated ")).collect();
    assert!(!cut_strings.is_empty(), "some event string was cut");
    for text in &texts {
        assert!(
            text.len() <= LINE || cut_at(text, LINE).is_some(),
            "an event string of {} bytes",
            text.len()
        );
    }
    // No line of the CLI's output passes the bound either.
    for line in up.stdout.lines() {
        assert!(
            line.len() <= LINE || cut_at(line, LINE).is_some(),
            "a stdout line of {} bytes",
            line.len()
        );
    }

    // A message the program prints: the language host's error quotes the whole file.
    project(&ws, &program("{\"fn::fromBase64\": \"${huge}\"}"));
    let preview = client
        .preview(pb::PreviewRequest::default())
        .await
        .expect("preview")
        .into_inner();
    let mut stream = preview;
    let mut diagnostics = Vec::new();
    let end = loop {
        match stream.message().await {
            Ok(Some(pb::PreviewStream {
                response: Some(pb::preview_stream::Response::Event(e)),
            })) => {
                let event = Value::Object(pko_agent::values::from_struct(&e));
                if let Some(m) = event
                    .pointer("/diagnosticEvent/message")
                    .and_then(Value::as_str)
                {
                    diagnostics.push(m.to_owned());
                }
            }
            Ok(Some(_)) => {}
            Ok(None) => break None,
            Err(status) => break Some(status),
        }
    };
    let status = end.expect("the preview fails: the file is no base64");
    assert!(status.message().len() < 4000, "{}", status.message().len());
    let quoted = diagnostics
        .iter()
        .find(|m| m.starts_with("fn::fromBase64 unable to decode"))
        .unwrap_or_else(|| panic!("no diagnostic quoting the file: {diagnostics:?}"));
    let (kept, _) = cut_at(quoted, LINE).expect("the printed message carries the marker");
    assert!(kept.len() > LINE - 2, "{}", kept.len());
}

/// `UpdateSource`: a new revision of the source goes where the pod's source was unpacked, in
/// the running agent; a revision that fails its checks changes nothing, and the agent keeps
/// serving the one it had.
#[tokio::test]
async fn a_new_source_revision_replaces_the_program_in_the_running_agent() {
    let _machine = pko_tests::serial::shared().await;
    let first = targz(&[("proj/Pulumi.yaml", PROGRAM.as_bytes())]);
    let moon = PROGRAM.replace("-world", "-moon");
    let second = targz(&[("proj/Pulumi.yaml", moon.as_bytes())]);
    let server = StaticServer::start(HashMap::from([
        ("/1.tar.gz".to_owned(), first.clone()),
        ("/2.tar.gz".to_owned(), second.clone()),
    ]))
    .await
    .expect("server");
    let tmp = tempfile::tempdir().expect("tmp");
    let (source, link) = (tmp.path().join("source"), tmp.path().join("workspace"));
    let out = init(&source, &server.url("/1.tar.gz"), &digest(&first), &link).await;
    assert!(out.status.success(), "{out:?}");
    let agent = AgentProcess::start_with_args(
        AgentOptions {
            workspace: link.clone(),
            state: tmp.path().to_path_buf(),
            tls: false,
            token: None,
        },
        &[format!("--source-dir={}", source.display())],
    )
    .await
    .expect("agent starts");
    let mut client = agent.client().await.expect("client");
    let features = client
        .capabilities(pb::CapabilitiesRequest {})
        .await
        .expect("capabilities")
        .into_inner()
        .features;
    assert!(
        features.iter().any(|f| f == "update-source"),
        "{features:?}"
    );
    let base = client.clone();
    let configure_and_up = |greeting: &'static str| {
        let mut client = base.clone();
        async move {
            let select = pb::SelectStackRequest {
                stack_name: "dev".into(),
                create: Some(true),
                secrets_provider: None,
                skip_summary: Some(true),
            };
            client.select_stack(select).await.expect("select");
            client
                .set_all_config(pb::SetAllConfigRequest {
                    config: vec![
                        literal("greeting", greeting, false),
                        literal("password", "pw", true),
                    ],
                })
                .await
                .expect("config");
            let up = up_once(&mut client).await.expect("up");
            String::from_utf8(up.outputs["message"].value.clone()).expect("utf-8")
        }
    };
    assert_eq!(configure_and_up("hi").await, r#""hi-world""#);
    let request = |path: &str, digest: String, dir: &str| pb::UpdateSourceRequest {
        url: server.url(path),
        digest,
        dir: dir.into(),
        max_size_bytes: None,
    };

    // The revision the pod fetched: nothing to do.
    let same = client
        .update_source(request("/1.tar.gz", digest(&first), "proj"))
        .await
        .expect("the same revision")
        .into_inner();
    assert!(!same.changed);

    // Bytes that are not the digest's, a folder that is not the served one, a bad digest: refused,
    // and the program served stays whole.
    let mismatch = client
        .update_source(request("/2.tar.gz", digest(b"other bytes"), "proj"))
        .await
        .expect_err("a digest mismatch");
    assert_eq!(mismatch.code(), Code::Unavailable, "{mismatch:?}");
    assert!(
        mismatch.message().contains("digest mismatch"),
        "{mismatch:?}"
    );
    let elsewhere = client
        .update_source(request("/2.tar.gz", digest(&second), "other"))
        .await
        .expect_err("another project folder");
    assert_eq!(elsewhere.code(), Code::InvalidArgument, "{elsewhere:?}");
    let malformed = client
        .update_source(request("/2.tar.gz", "sha256:xyz".into(), "proj"))
        .await
        .expect_err("a malformed digest");
    assert_eq!(malformed.code(), Code::InvalidArgument, "{malformed:?}");
    assert_eq!(
        std::fs::read_to_string(link.join("Pulumi.yaml")).expect("project"),
        PROGRAM
    );
    assert_eq!(configure_and_up("still").await, r#""still-world""#);

    // The new revision: the next operation runs it, in the same agent process.
    let changed = client
        .update_source(request("/2.tar.gz", digest(&second), "proj"))
        .await
        .expect("a new revision")
        .into_inner();
    assert!(changed.changed);
    assert_eq!(configure_and_up("hi").await, r#""hi-moon""#);
    assert!(pko_tests::process_alive(agent.guard.pid()));
    let marker = std::fs::read_to_string(tmp.path().join(".source.digest")).expect("marker");
    assert_eq!(marker, digest(&second));

    // An agent not told where its source is cannot take a revision: its pod must go.
    let other = tempfile::tempdir().expect("tmp");
    let plain = start(other.path(), false, None).await;
    let refused = plain
        .client()
        .await
        .expect("client")
        .update_source(request("/2.tar.gz", digest(&second), "proj"))
        .await
        .expect_err("no source folder");
    assert_eq!(refused.code(), Code::FailedPrecondition, "{refused:?}");
}
