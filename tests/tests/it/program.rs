//! Program controller and file server, on the real control plane with the real operator binary;
//! and a Program's `packages` reaching the `pulumi install` of a workspace (with the harness as
//! kubelet, the real agent and pulumi CLI).
//!
//! Each test gets its own namespace and its own operator process watching only that namespace.

use std::collections::BTreeMap;
use std::io::Read;
use std::time::Duration;

use kube::Api;
use kube::api::{DeleteParams, Patch, PatchParams, PostParams};
use pko_api::program::Program;
use pko_tests::fixtures::{program, sha256, status_of};
use pko_tests::operator::{Operator, OperatorOptions};
use pko_tests::{ControlPlane, wait_for};
use serde_json::{Value, json};

const WAIT: Duration = Duration::from_secs(60);
/// A workspace fetches its program and runs `pulumi install` within this.
const STACK_WAIT: Duration = Duration::from_secs(180);

fn pod_program(name: &str) -> Program {
    program(
        name,
        json!({"resources": {"test-resource": {"type": "kubernetes:core/v1:Pod"}}}),
    )
}

async fn operator_for(plane: &ControlPlane, ns: &str, advertised: Option<&str>) -> Operator {
    Operator::start(
        plane,
        OperatorOptions {
            advertised: advertised.map(str::to_owned),
            args: vec![format!("--watch-namespace={ns}")],
        },
    )
    .await
    .expect("operator starts")
}

/// Wait until the Program's status reports an artifact for `generation`.
async fn artifact_at(api: &Api<Program>, name: &str, generation: i64) -> (Program, Value) {
    wait_for(
        &format!("artifact of {name} at generation {generation}"),
        WAIT,
        || async {
            let p = api.get(name).await.ok()?;
            let status = status_of(&p);
            let artifact = status.get("artifact")?;
            (status.get("observedGeneration")?.as_i64()? == generation
                && artifact.get("revision")?.as_str()? == generation.to_string())
            .then(|| (p.clone(), artifact.clone()))
        },
    )
    .await
    .expect("artifact appears")
}

fn untar(bytes: &[u8]) -> Vec<(String, String)> {
    let mut archive = tar::Archive::new(flate2::read::GzDecoder::new(bytes));
    archive
        .entries()
        .expect("tar entries")
        .map(|e| {
            let mut e = e.expect("entry");
            let path = e.path().expect("path").display().to_string();
            let mut text = String::new();
            e.read_to_string(&mut text).expect("utf8 entry");
            (path, text)
        })
        .collect()
}

/// An artifact URL's address (before `?`), after checking that its query is the capability
/// the file server asks for: the artifact's digest and a token.
fn url_base(artifact: &Value) -> String {
    let url = artifact["url"].as_str().expect("url");
    let digest = artifact["digest"].as_str().expect("digest");
    let (base, query) = url.split_once('?').expect("a capability query");
    let token = query
        .strip_prefix(&format!("digest={digest}&token="))
        .unwrap_or_else(|| panic!("query {query:?}"));
    assert!(token.starts_with('k') && token.contains('.'), "{token}");
    base.to_owned()
}

#[tokio::test]
async fn artifact_fields_for_generation_1_and_2() {
    let _machine = pko_tests::serial::shared().await;
    let plane = ControlPlane::shared().await;
    let ns = plane.namespace("prog-gen").await.expect("namespace");
    let _op = operator_for(plane, &ns, Some("http://fake-svc.fake-namespace")).await;
    let api: Api<Program> = Api::namespaced(plane.client(), &ns);
    api.create(&PostParams::default(), &pod_program("test-program"))
        .await
        .expect("create");

    let (p, artifact) = artifact_at(&api, "test-program", 1).await;
    assert_eq!(
        artifact["path"],
        format!("programs/{ns}/test-program/1.tar.gz")
    );
    assert_eq!(
        url_base(&artifact),
        format!("http://fake-svc.fake-namespace/programs/{ns}/test-program/1")
    );
    assert_eq!(artifact["revision"], "1");
    let digest = artifact["digest"].as_str().expect("digest");
    assert!(
        digest.starts_with("sha256:") && digest.len() == 71,
        "{digest}"
    );
    assert!(artifact["size"].as_i64().expect("size") > 0);
    assert!(artifact["lastUpdateTime"].as_str().is_some());
    let status = status_of(&p);
    let ready = &status["conditions"][0];
    assert_eq!(ready["type"], "Ready");
    assert_eq!(ready["status"], "True");
    assert_eq!(ready["observedGeneration"], 1);

    api.patch(
        "test-program",
        &PatchParams::default(),
        &Patch::Merge(json!({"program": {"resources": {"test-resource": {"type": "kubernetes:core/v1:Service"}}}})),
    )
    .await
    .expect("patch");
    let (_, artifact2) = artifact_at(&api, "test-program", 2).await;
    assert_eq!(
        artifact2["path"],
        format!("programs/{ns}/test-program/2.tar.gz")
    );
    assert_eq!(
        url_base(&artifact2),
        format!("http://fake-svc.fake-namespace/programs/{ns}/test-program/2")
    );
    assert_eq!(artifact2["revision"], "2");
    assert_ne!(artifact2["digest"], artifact["digest"]);
}

#[tokio::test]
async fn advertised_https_is_kept_and_http_is_added() {
    let _machine = pko_tests::serial::shared().await;
    let plane = ControlPlane::shared().await;
    for (advertised, scheme_host) in [
        ("https://fake-address", "https://fake-address"),
        ("fake-address", "http://fake-address"),
    ] {
        let ns = plane.namespace("prog-url").await.expect("namespace");
        let _op = operator_for(plane, &ns, Some(advertised)).await;
        let api: Api<Program> = Api::namespaced(plane.client(), &ns);
        api.create(&PostParams::default(), &pod_program("p"))
            .await
            .expect("create");
        let (_, artifact) = artifact_at(&api, "p", 1).await;
        assert_eq!(
            url_base(&artifact),
            format!("{scheme_host}/programs/{ns}/p/1"),
            "advertised {advertised}"
        );
    }
}

#[tokio::test]
async fn served_artifact_matches_status_and_carries_the_spec() {
    let _machine = pko_tests::serial::shared().await;
    let plane = ControlPlane::shared().await;
    let ns = plane.namespace("prog-serve").await.expect("namespace");
    let op = operator_for(plane, &ns, None).await;
    let api: Api<Program> = Api::namespaced(plane.client(), &ns);
    let packages = json!({
        "talos-go-component": "https://github.com/dirien/pulumi-talos-go-component@0.0.0-x5ed2",
        "custom-component": "file://./custom",
        "parameterized-component": "https://example.com/pkg@v1.0.0",
    });
    api.create(
        &PostParams::default(),
        &program(
            "with-packages",
            json!({
                "packages": packages,
                "resources": {"test-resource": {"type": "kubernetes:core/v1:Pod", "properties": {"metadata": {"name": "x"}}}},
                "outputs": {"name": "${test-resource.metadata.name}"},
            }),
        ),
    )
    .await
    .expect("create");
    let (_, artifact) = artifact_at(&api, "with-packages", 1).await;
    // The advertised address defaults to the bound loopback address, so the URL is fetchable.
    let url = artifact["url"].as_str().expect("url");
    assert_eq!(
        url_base(&artifact),
        op.fs_url(&format!("/programs/{ns}/with-packages/1"))
    );

    let resp = reqwest::get(url).await.expect("GET");
    assert_eq!(resp.status(), 200);
    let headers = resp.headers().clone();
    assert_eq!(headers["content-type"], "application/gzip");
    let etag = headers["etag"].to_str().expect("etag").to_owned();
    let body = resp.bytes().await.expect("body");
    assert_eq!(headers["content-length"], body.len().to_string().as_str());
    assert_eq!(sha256(&body), artifact["digest"].as_str().expect("digest"));
    assert_eq!(
        etag,
        format!("\"{}\"", artifact["digest"].as_str().expect("digest"))
    );
    assert_eq!(artifact["size"].as_u64(), Some(body.len() as u64));

    let entries = untar(&body);
    assert_eq!(entries.len(), 1, "exactly one entry");
    assert_eq!(entries[0].0, "Pulumi.yaml");
    let project: Value = yaml_serde::from_str(&entries[0].1).expect("yaml");
    assert_eq!(project["name"], "with-packages");
    assert_eq!(project["runtime"], "yaml");
    assert_eq!(project["packages"], packages);
    assert_eq!(
        project["resources"]["test-resource"]["type"],
        "kubernetes:core/v1:Pod"
    );
    assert_eq!(project["outputs"]["name"], "${test-resource.metadata.name}");

    // The .tar.gz form of the path serves the same bytes.
    let same = reqwest::get(url.replacen('?', ".tar.gz?", 1))
        .await
        .expect("GET .tar.gz")
        .bytes()
        .await
        .expect("body");
    assert_eq!(same, body);

    let client = reqwest::Client::new();
    let not_modified = client
        .get(url)
        .header("if-none-match", etag.as_str())
        .send()
        .await
        .expect("conditional GET");
    assert_eq!(not_modified.status(), 304);
    assert_eq!(not_modified.headers()["etag"], etag.as_str());
    assert!(not_modified.bytes().await.expect("body").is_empty());
    let other_etag = client
        .get(url)
        .header("if-none-match", "\"sha256:other\"")
        .send()
        .await
        .expect("conditional GET");
    assert_eq!(other_etag.status(), 200);

    let head = client.head(url).send().await.expect("HEAD");
    assert_eq!(head.status(), 200);
    assert_eq!(head.headers()["content-type"], "application/gzip");
    assert_eq!(
        head.headers()["content-length"],
        body.len().to_string().as_str()
    );
    assert_eq!(head.headers()["etag"], etag.as_str());
    assert!(head.bytes().await.expect("body").is_empty());
}

#[tokio::test]
async fn file_server_rejects_bad_requests_clearly() {
    let _machine = pko_tests::serial::shared().await;
    let plane = ControlPlane::shared().await;
    let ns = plane.namespace("prog-bad").await.expect("namespace");
    let op = operator_for(plane, &ns, None).await;
    let api: Api<Program> = Api::namespaced(plane.client(), &ns);
    api.create(&PostParams::default(), &pod_program("p"))
        .await
        .expect("create");
    let (_, first) = artifact_at(&api, "p", 1).await;
    api.patch(
        "p",
        &PatchParams::default(),
        &Patch::Merge(json!({"program": {"outputs": {"x": "1"}}})),
    )
    .await
    .expect("patch");
    let (_, second) = artifact_at(&api, "p", 2).await;
    // The status URLs' paths and capability queries.
    let path_of = |artifact: &Value| {
        let url = artifact["url"].as_str().expect("url");
        url[url.find("/programs/").expect("path")..].to_owned()
    };
    let (first, second) = (path_of(&first), path_of(&second));

    let client = reqwest::Client::new();
    let cases: Vec<(reqwest::Method, String, u16, &str)> = vec![
        (
            reqwest::Method::GET,
            "/programs/".into(),
            400,
            "malformed path",
        ),
        (
            reqwest::Method::GET,
            "/programs".into(),
            400,
            "malformed path",
        ),
        (
            reqwest::Method::GET,
            format!("/programs/{ns}/p"),
            400,
            "malformed path",
        ),
        (
            reqwest::Method::GET,
            format!("/programs/{ns}/p/2/extra"),
            400,
            "malformed path",
        ),
        (
            reqwest::Method::GET,
            format!("/programs/{ns}/p/abc"),
            400,
            "invalid generation",
        ),
        (
            reqwest::Method::GET,
            format!("/programs/{ns}/p/0"),
            400,
            "invalid generation",
        ),
        (
            reqwest::Method::GET,
            format!("/programs/{ns}/p/1.zip"),
            400,
            "invalid generation",
        ),
        (
            reqwest::Method::GET,
            format!("/programs/{ns}/P/1"),
            400,
            "invalid program name",
        ),
        // Without the URL's token, an existing Program and generation is answered exactly
        // like a missing one.
        (
            reqwest::Method::GET,
            format!("/programs/{ns}/missing/1"),
            404,
            "artifact not found",
        ),
        (
            reqwest::Method::GET,
            format!("/programs/{ns}/p/2"),
            404,
            "artifact not found",
        ),
        (
            reqwest::Method::GET,
            second.replacen("/p/2?", "/p/3?", 1),
            404,
            "artifact not found",
        ),
        (reqwest::Method::GET, first.clone(), 410, "superseded"),
        (reqwest::Method::GET, "/elsewhere".into(), 404, "not found"),
        (
            reqwest::Method::POST,
            format!("/programs/{ns}/p/2"),
            405,
            "method not allowed",
        ),
        (
            reqwest::Method::DELETE,
            format!("/programs/{ns}/p/2"),
            405,
            "method not allowed",
        ),
        (
            reqwest::Method::PUT,
            "/programs/x".into(),
            405,
            "method not allowed",
        ),
    ];
    for (method, path, code, needle) in cases {
        let resp = client
            .request(method.clone(), op.fs_url(&path))
            .send()
            .await
            .expect("request");
        let status = resp.status().as_u16();
        let allow = resp.headers().get("allow").cloned();
        let body = resp.text().await.expect("body");
        assert_eq!(status, code, "{method} {path}: {body}");
        assert!(
            body.contains(needle),
            "{method} {path}: {body:?} lacks {needle:?}"
        );
        if code == 405 {
            assert_eq!(allow.expect("Allow header"), "GET,HEAD");
        }
    }

    // A deleted Program is gone from the file server.
    api.delete("p", &DeleteParams::default())
        .await
        .expect("delete");
    let url = op.fs_url(&second);
    wait_for("404 after delete", WAIT, || async {
        let resp = reqwest::get(&url).await.ok()?;
        (resp.status() == 404).then_some(())
    })
    .await
    .expect("deleted program answers 404");
}

#[tokio::test]
async fn two_operators_serve_identical_bytes() {
    let _machine = pko_tests::serial::shared().await;
    let plane = ControlPlane::shared().await;
    let ns = plane.namespace("prog-two").await.expect("namespace");
    let first = operator_for(plane, &ns, None).await;
    let second = operator_for(plane, &ns, None).await;
    let api: Api<Program> = Api::namespaced(plane.client(), &ns);
    let mut spec = json!({"variables": {}, "outputs": {}});
    for i in 0..50 {
        spec["variables"][format!("v{i:02}")] = json!({"nested": {"z": i, "a": [i, "x"]}});
        spec["outputs"][format!("o{i:02}")] = json!(format!("${{v{i:02}}}"));
    }
    api.create(&PostParams::default(), &program("shared", spec))
        .await
        .expect("create");
    let (_, artifact) = artifact_at(&api, "shared", 1).await;
    let digest = artifact["digest"].as_str().expect("digest").to_owned();
    let status_url = artifact["url"].as_str().expect("url").to_owned();
    let mut bodies = Vec::new();
    for op in [&first, &second] {
        let url = op.fs_url_of(&status_url);
        let body = wait_for("artifact served", WAIT, || async {
            let resp = reqwest::get(&url).await.ok()?;
            if resp.status() != 200 {
                return None;
            }
            resp.bytes().await.ok()
        })
        .await
        .expect("served");
        assert_eq!(sha256(&body), digest);
        bodies.push(body);
    }
    assert_eq!(bodies[0], bodies[1]);
}

#[tokio::test]
async fn status_survives_label_edits_and_restarts_without_rewrites() {
    let _machine = pko_tests::serial::shared().await;
    let plane = ControlPlane::shared().await;
    let ns = plane.namespace("prog-ssa").await.expect("namespace");
    // Same advertised address across the restart (the bound port changes).
    let advertised = Some("http://pko-rs-fileserver.test");
    let mut op = operator_for(plane, &ns, advertised).await;
    let api: Api<Program> = Api::namespaced(plane.client(), &ns);
    api.create(&PostParams::default(), &pod_program("p"))
        .await
        .expect("create");
    let (_, artifact) = artifact_at(&api, "p", 1).await;

    // Another client edits labels: status and the label both stay.
    api.patch(
        "p",
        &PatchParams::default(),
        &Patch::Merge(json!({"metadata": {"labels": {"team": "blue"}}})),
    )
    .await
    .expect("label patch");
    let labelled = api.get("p").await.expect("get");
    assert_eq!(
        labelled
            .metadata
            .labels
            .as_ref()
            .and_then(|l| l.get("team")),
        Some(&"blue".to_owned())
    );
    assert_eq!(status_of(&labelled)["artifact"], artifact);
    let before = labelled.metadata.resource_version.clone();
    let before_json = serde_json::to_string_pretty(&labelled).expect("json");

    // A restarted operator reconciles the Program and writes nothing: same resourceVersion.
    op.stop();
    let restarted = operator_for(plane, &ns, advertised).await;
    let metrics_url = restarted.probe_url("/metrics");
    // The duration is observed when a reconcile has returned, so after any write it made (the
    // reconcile counter goes up when one starts, which would let the check below run early).
    wait_for("a reconcile by the restarted operator", WAIT, || async {
        let text = reqwest::get(&metrics_url).await.ok()?.text().await.ok()?;
        text.lines()
            .any(|l| {
                l.starts_with("pko_reconcile_duration_seconds_count{controller=\"program\"} ")
                    && !l.ends_with(" 0")
            })
            .then_some(())
    })
    .await
    .expect("restarted operator reconciled");
    let after = api.get("p").await.expect("get");
    assert_eq!(
        after.metadata.resource_version,
        before,
        "status was rewritten:\nbefore: {before_json}\nafter: {}\nlog: {}",
        serde_json::to_string_pretty(&after).expect("json"),
        restarted.log_text()
    );
    assert_eq!(status_of(&after)["artifact"], artifact);
    let labels: BTreeMap<String, String> = after.metadata.labels.unwrap_or_default();
    assert_eq!(labels.get("team").map(String::as_str), Some("blue"));
}

#[tokio::test]
async fn program_near_the_etcd_size_limit_gets_an_artifact() {
    let _machine = pko_tests::serial::shared().await;
    let plane = ControlPlane::shared().await;
    let ns = plane.namespace("prog-big").await.expect("namespace");
    let op = operator_for(plane, &ns, None).await;
    let api: Api<Program> = Api::namespaced(plane.client(), &ns);
    // ~1.2 MB of variables: close to the apiserver's 1.5 MiB request limit.
    let mut variables = serde_json::Map::new();
    for i in 0..1200 {
        variables.insert(format!("v{i:04}"), json!("x".repeat(1000)));
    }
    api.create(
        &PostParams::default(),
        &program("big", json!({"variables": variables})),
    )
    .await
    .expect("create a 1.2 MB Program");
    let (_, artifact) = artifact_at(&api, "big", 1).await;
    let body = reqwest::get(op.fs_url_of(artifact["url"].as_str().expect("url")))
        .await
        .expect("GET")
        .bytes()
        .await
        .expect("body");
    assert_eq!(sha256(&body), artifact["digest"].as_str().expect("digest"));
    let entries = untar(&body);
    let project: Value = yaml_serde::from_str(&entries[0].1).expect("yaml");
    assert_eq!(
        project["variables"].as_object().map(|m| m.len()),
        Some(1200)
    );
}

#[tokio::test]
async fn burst_of_random_paths_leaves_the_server_healthy() {
    let _machine = pko_tests::serial::shared().await;
    let plane = ControlPlane::shared().await;
    let ns = plane.namespace("prog-burst").await.expect("namespace");
    let op = operator_for(plane, &ns, None).await;
    let api: Api<Program> = Api::namespaced(plane.client(), &ns);
    api.create(&PostParams::default(), &pod_program("p"))
        .await
        .expect("create");
    let (_, artifact) = artifact_at(&api, "p", 1).await;
    let rss_before = op.rss_kib().expect("rss");

    let client = reqwest::Client::new();
    let mut codes = BTreeMap::<u16, usize>::new();
    let mut tasks = tokio::task::JoinSet::new();
    for i in 0..1000u32 {
        let client = client.clone();
        let url = op.fs_url(&random_path(i, &ns));
        tasks.spawn(async move { client.get(url).send().await.map(|r| r.status().as_u16()) });
        if tasks.len() >= 64
            && let Some(done) = tasks.join_next().await
        {
            *codes
                .entry(done.expect("join").expect("response"))
                .or_default() += 1;
        }
    }
    while let Some(done) = tasks.join_next().await {
        *codes
            .entry(done.expect("join").expect("response"))
            .or_default() += 1;
    }
    assert_eq!(codes.values().sum::<usize>(), 1000);
    assert!(
        codes.keys().all(|c| [200, 400, 404, 405, 410].contains(c)),
        "unexpected codes {codes:?}"
    );
    assert!(!codes.contains_key(&500), "{codes:?}");

    let health = reqwest::get(op.probe_url("/healthz"))
        .await
        .expect("healthz");
    assert_eq!(health.status(), 200);
    let ok = reqwest::get(op.fs_url_of(artifact["url"].as_str().expect("url")))
        .await
        .expect("GET");
    assert_eq!(ok.status(), 200);
    let rss_after = op.rss_kib().expect("rss");
    assert!(
        rss_after < rss_before + 64 * 1024,
        "RSS grew from {rss_before} KiB to {rss_after} KiB"
    );
}

/// Deterministic pseudo-random paths: malformed, unknown, oversized and valid.
fn random_path(i: u32, ns: &str) -> String {
    let x = i.wrapping_mul(2_654_435_761);
    match x % 7 {
        0 => format!("/programs/{ns}/p/{}", x % 5),
        1 => format!("/programs/{ns}/missing-{x}/1"),
        2 => format!("/programs/{}", "a/".repeat((x % 50) as usize)),
        3 => format!("/programs/{ns}/p/{}", "9".repeat((x % 40) as usize + 1)),
        4 => format!("/{}", "z".repeat((x % 2000) as usize)),
        5 => format!("/programs/ns-{x}/name/1.tar.gz"),
        _ => format!("/programs/{ns}/p/1?x={x}"),
    }
}

/// Issue: a URL just written to `status.artifact` must be served at once, by the replica whose
/// controller wrote it and by a standby replica that runs only the file server. Each of 300
/// Programs is fetched once, the instant a watch sees its status, from both replicas: every
/// answer is 200 with the digest of the status. No retries: one 404 fails the test.
#[tokio::test]
async fn published_artifacts_are_served_at_once_by_the_leader_and_a_standby() {
    let _machine = pko_tests::serial::shared().await;
    use futures::{StreamExt, TryStreamExt};
    use kube::runtime::{WatchStreamExt, watcher};

    const PROGRAMS: usize = 300;
    let plane = ControlPlane::shared().await;
    let ns = plane.namespace("prog-published").await.expect("namespace");
    let args = vec![
        format!("--watch-namespace={ns}"),
        "--leader-elect".to_owned(),
        format!("--leader-election-namespace={ns}"),
        // The standby's watch may lag under load on a small machine: its wait is generous so
        // the test shows the mechanism, not the machine's speed.
        "--artifact-publish-wait=60s".to_owned(),
    ];
    let start = |args: Vec<String>| async move {
        Operator::start(
            plane,
            OperatorOptions {
                advertised: None,
                args,
            },
        )
        .await
        .expect("operator starts")
    };
    let leader = start(args.clone()).await;
    wait_for("the first replica to lead", WAIT, || async {
        (leader.metric("pko_leader").await == Some(1.0)).then_some(())
    })
    .await
    .expect("leader");
    let standby = start(args).await;

    let api: Api<Program> = Api::namespaced(plane.client(), &ns);
    let http = reqwest::Client::new();
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
    let watch = tokio::spawn({
        let (api, http, standby_port) = (api.clone(), http.clone(), standby.fs_port);
        async move {
            let mut seen = std::collections::HashSet::new();
            let events = watcher(api, watcher::Config::default()).applied_objects();
            let mut events = std::pin::pin!(events);
            while let Ok(Some(p)) = events.try_next().await {
                let status = status_of(&p);
                let (Some(url), Some(digest)) = (
                    status.pointer("/artifact/url").and_then(Value::as_str),
                    status.pointer("/artifact/digest").and_then(Value::as_str),
                ) else {
                    continue;
                };
                let name = p.metadata.name.clone().unwrap_or_default();
                if !seen.insert(name.clone()) {
                    continue;
                }
                let path = url
                    .split_once("/programs/")
                    .map(|(_, rest)| format!("/programs/{rest}"))
                    .expect("artifact URL path");
                let standby_url = format!("http://127.0.0.1:{standby_port}{path}");
                for (replica, url) in [("leader", url.to_owned()), ("standby", standby_url)] {
                    let (http, tx, name, digest) =
                        (http.clone(), tx.clone(), name.clone(), digest.to_owned());
                    tokio::spawn(async move {
                        let answer = match http.get(&url).send().await {
                            Ok(resp) => {
                                let code = resp.status().as_u16();
                                let body = resp.bytes().await.unwrap_or_default();
                                if code == 200 && sha256(&body) != digest {
                                    format!("200 with a digest other than {digest}")
                                } else {
                                    code.to_string()
                                }
                            }
                            Err(e) => e.to_string(),
                        };
                        let _ = tx.send((replica, name, answer));
                    });
                }
            }
        }
    });
    futures::stream::iter(0..PROGRAMS)
        .for_each_concurrent(16, |i| {
            let api = api.clone();
            async move {
                api.create(&PostParams::default(), &pod_program(&format!("p{i:03}")))
                    .await
                    .expect("create");
            }
        })
        .await;

    let mut answers = Vec::new();
    let collect = async {
        while answers.len() < 2 * PROGRAMS {
            match rx.recv().await {
                Some(answer) => answers.push(answer),
                None => break,
            }
        }
    };
    tokio::time::timeout(Duration::from_secs(600), collect)
        .await
        .unwrap_or_else(|_| panic!("only {} of {} answers", answers.len(), 2 * PROGRAMS));
    watch.abort();
    let failures: Vec<_> = answers.iter().filter(|(_, _, a)| a != "200").collect();
    assert!(
        failures.is_empty(),
        "{} of {} fetches were not 200: {:?}",
        failures.len(),
        answers.len(),
        &failures[..failures.len().min(20)]
    );
    for replica in ["leader", "standby"] {
        assert_eq!(
            answers.iter().filter(|(r, _, _)| *r == replica).count(),
            PROGRAMS,
            "{replica}"
        );
    }
    // The standby served everything without running a controller.
    assert_eq!(standby.metric("pko_leader").await, Some(0.0));
    assert_eq!(
        standby
            .metric("pko_reconciles_total{controller=\"program\"}")
            .await
            .unwrap_or(0.0),
        0.0
    );
}

/// `make run`'s own code path (`pko-dev check`): its own control plane, the CRDs, the operator,
/// examples/program.yaml fetched and verified, examples/stack.yaml deployed to Ready, the
/// default-tags transform in a Program's artifact and status, examples/refused.yaml refused
/// with both rules named, and examples/warned.yaml admitted with a TenancyPolicy's warning.
#[tokio::test]
async fn the_make_run_path_works_end_to_end() {
    let _machine = pko_tests::serial::shared().await;
    let output = tokio::task::spawn_blocking(|| {
        std::process::Command::new(env!("CARGO_BIN_EXE_pko-dev"))
            .arg("check")
            .stdin(std::process::Stdio::null())
            .output()
    })
    .await
    .expect("join")
    .expect("pko-dev runs");
    let stdout = String::from_utf8_lossy(&output.stdout);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        output.status.success(),
        "pko-dev check failed ({}):\n{stdout}\n{stderr}",
        output.status
    );
    for step in [
        "sha256 verified",
        "stack Ready",
        "transforms.pko-rs.dev/applied",
        "transform applied",
        "[isolation/cross-namespace-secret]",
        "[restricted/run-as-user-root]",
        "Warning: pko-rs policy",
        "check passed",
    ] {
        assert!(stdout.contains(step), "no {step:?} in:\n{stdout}");
    }
}

/// Artifact requests the operator refused for want of a valid token, every reason.
async fn refusals(op: &Operator) -> f64 {
    let mut total = 0.0;
    for reason in ["bad_token", "no_token"] {
        let series = format!("pko_fileserver_refused_total{{reason=\"{reason}\"}}");
        total += op.metric(&series).await.unwrap_or(0.0);
    }
    total
}

/// Runs the real agent's `init` (a workspace pod's first step) on `url`: the fetch exactly as a
/// tenant's workspace makes it. Returns (success, output).
fn agent_init(url: &str, digest: &str) -> (bool, String) {
    let target = tempfile::tempdir().expect("tempdir");
    let out = std::process::Command::new(pko_tests::agent::agent_binary().expect("agent binary"))
        .args([
            "init",
            "--flux-url",
            url,
            "--flux-digest",
            digest,
            "--target-dir",
        ])
        .arg(target.path().join("src"))
        .output()
        .expect("pko-agent init runs");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status.success(), text)
}

/// Issue: any tenant could read any namespace's artifact, and the 404/410 answers told a
/// stranger whether a Program existed and its generation. Now an artifact URL carries a token
/// bound to its namespace, name, generation and digest, which only readers of the Program's
/// status learn. Tenant B's workspace tries tenant A's artifact every way it can: each try gets
/// exactly the answer of a Program that does not exist, and is counted; B's own URL works.
#[tokio::test]
async fn a_tenant_cannot_fetch_another_tenants_artifact_by_any_url() {
    let _machine = pko_tests::serial::shared().await;
    let plane = ControlPlane::shared().await;
    let (a, b) = (
        plane.namespace("tenant-a").await.expect("namespace a"),
        plane.namespace("tenant-b").await.expect("namespace b"),
    );
    // One replica per tenant namespace, sharing the install's keys (as replicas do).
    let op_a = operator_for(plane, &a, None).await;
    let op_b = operator_for(plane, &b, None).await;
    let (api_a, api_b): (Api<Program>, Api<Program>) = (
        Api::namespaced(plane.client(), &a),
        Api::namespaced(plane.client(), &b),
    );
    for api in [&api_a, &api_b] {
        api.create(&PostParams::default(), &pod_program("app"))
            .await
            .expect("create");
    }
    let (_, art_a) = artifact_at(&api_a, "app", 1).await;
    let (_, art_b) = artifact_at(&api_b, "app", 1).await;
    let url_a = op_a.fs_url_of(art_a["url"].as_str().expect("url"));
    let url_b = op_b.fs_url_of(art_b["url"].as_str().expect("url"));
    let digest_a = art_a["digest"].as_str().expect("digest");
    let digest_b = art_b["digest"].as_str().expect("digest");
    // Same spec, same name: the same bytes, so a digest proves nothing on its own.
    assert_eq!(digest_a, digest_b);
    let query_b = url_b.split_once('?').expect("query").1;
    let path_a = format!("/programs/{a}/app/1");

    // What an unknown Program gets.
    let unknown = reqwest::get(op_a.fs_url(&format!("/programs/{a}/nothing/1?{query_b}")))
        .await
        .expect("GET");
    assert_eq!(unknown.status(), 404);
    let unknown = unknown.text().await.expect("body");
    let refused_before = refusals(&op_a).await;
    let host_a = format!("127.0.0.1:{}", op_a.fs_port);
    let tries = [
        // No token at all, in the path's PKO spellings.
        format!("http://{host_a}{path_a}"),
        format!("http://{host_a}{path_a}.tar.gz"),
        // B's token (and digest) on A's path.
        format!("http://{host_a}{path_a}?{query_b}"),
        format!("http://{host_a}{path_a}.tar.gz?{query_b}"),
        // A guessed generation, with B's token.
        format!("http://{host_a}/programs/{a}/app/2?{query_b}"),
        // Other spellings of A's path that the fetcher resolves to it.
        format!("http://{host_a}/programs/{b}/../{a}/app/1?{query_b}"),
        format!(
            "HTTP://{host_a}/programs/%{:02x}{}/app/1?{query_b}",
            a.as_bytes()[0],
            &a[1..]
        ),
        format!("http://user:pw@{host_a}/programs/{a}/app/1?{query_b}"),
        // B's token with A's digest added.
        format!("http://{host_a}{path_a}?{query_b}&digest={digest_a}"),
    ];
    for url in &tries {
        let resp = reqwest::get(url).await.expect("GET");
        let status = resp.status().as_u16();
        let body = resp.text().await.expect("body");
        assert_eq!((status, body.as_str()), (404, unknown.as_str()), "{url}");
    }
    // The workspace's own fetcher (the agent's init) refuses too, and gets no byte.
    let (ok, out) = agent_init(&format!("http://{host_a}{path_a}?{query_b}"), digest_a);
    assert!(!ok, "{out}");
    assert!(out.contains("404"), "{out}");
    let refused_after = refusals(&op_a).await;
    assert_eq!(
        refused_after - refused_before,
        (tries.len() + 1) as f64,
        "every refusal is counted"
    );
    // B's own workspace fetch works, by the URL in its status.
    let (ok, out) = agent_init(&url_b, digest_b);
    assert!(ok, "{out}");
    // And so does A's own, by its URL.
    let (ok, out) = agent_init(&url_a, digest_a);
    assert!(ok, "{out}");
}

/// `packages` reaches pulumi as written: the Pulumi.yaml the workspace fetched carries the
/// Program's packages exactly, and the workspace's `pulumi install` acts on them. The package
/// here names a local folder (a source pulumi resolves offline) that holds no provider: the
/// install fails naming that folder, and the Workspace stalls saying so. Without the field,
/// nothing would be installed and the workspace would be Ready.
#[tokio::test]
async fn packages_reach_the_workspaces_pulumi_install() {
    let _machine = pko_tests::serial::shared().await;
    let e = pko_tests::execution::Execution::start("prog-packages", &[]).await;
    let missing = e.tmp.path().join("no-provider-here");
    let packages = json!({"kubernetes": missing.display().to_string()});
    let client = e.plane.client();
    Api::<Program>::namespaced(client.clone(), &e.ns)
        .create(
            &PostParams::default(),
            &program(
                "packaged",
                json!({"packages": packages, "outputs": {"greeting": "hello"}}),
            ),
        )
        .await
        .expect("create program");
    let backend = e.tmp.path().join("backend");
    Api::<pko_api::stack::Stack>::namespaced(client.clone(), &e.ns)
        .create(
            &PostParams::default(),
            &pko_tests::fixtures::file_backend_stack(
                "packaged",
                &backend,
                json!({"programRef": {"name": "packaged"}}),
            ),
        )
        .await
        .expect("create stack");

    let workspaces: Api<pko_api::workspace::Workspace> = Api::namespaced(client, &e.ns);
    let ready = wait_for("the workspace's install to end", STACK_WAIT, || async {
        let ws = workspaces.get("packaged").await.ok()?;
        ws.status?.conditions.into_iter().find(|c| {
            c.type_ == "Ready" && (c.status == "True" || c.reason == "InstallationFailed")
        })
    })
    .await
    .unwrap_or_else(|err| panic!("{err}\n{}", e.kubelet.logs("packaged")));
    assert_eq!(
        (ready.status.as_str(), ready.reason.as_str()),
        ("False", "InstallationFailed"),
        "{}\n{}",
        ready.message,
        e.kubelet.logs("packaged")
    );
    assert!(
        ready
            .message
            .contains(&format!("no folder at path '{}'", missing.display())),
        "{}",
        ready.message
    );

    let fetched = e
        .tmp
        .path()
        .join("pods/packaged-workspace/volumes/share/source/Pulumi.yaml");
    let project: Value =
        yaml_serde::from_str(&std::fs::read_to_string(&fetched).expect("the fetched project"))
            .expect("yaml");
    assert_eq!(project["packages"], packages);
}
