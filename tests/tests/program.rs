//! Program controller and file server, on the real control plane with the real operator binary.
//!
//! Each test gets its own namespace and its own operator process watching only that namespace.

use std::collections::BTreeMap;
use std::io::Read;
use std::time::Duration;

use kube::Api;
use kube::api::{DeleteParams, Patch, PatchParams, PostParams};
use pko_api::program::Program;
use pko_tests::operator::{Operator, OperatorOptions};
use pko_tests::{ControlPlane, wait_for};
use serde_json::{Value, json};
use sha2::{Digest, Sha256};

const WAIT: Duration = Duration::from_secs(60);

fn program(name: &str, spec: Value) -> Program {
    serde_json::from_value(json!({
        "apiVersion": "pulumi.com/v1",
        "kind": "Program",
        "metadata": {"name": name},
        "program": spec,
    }))
    .expect("valid Program")
}

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

fn status_of(p: &Program) -> Value {
    p.status
        .as_ref()
        .map(|s| serde_json::to_value(s).expect("status json"))
        .unwrap_or(Value::Null)
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

fn sha256(bytes: &[u8]) -> String {
    format!("sha256:{}", hex::encode(Sha256::digest(bytes)))
}

#[tokio::test]
async fn artifact_fields_for_generation_1_and_2() {
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
        artifact["url"],
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
        artifact2["url"],
        format!("http://fake-svc.fake-namespace/programs/{ns}/test-program/2")
    );
    assert_eq!(artifact2["revision"], "2");
    assert_ne!(artifact2["digest"], artifact["digest"]);
}

#[tokio::test]
async fn advertised_https_is_kept_and_http_is_added() {
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
            artifact["url"],
            format!("{scheme_host}/programs/{ns}/p/1"),
            "advertised {advertised}"
        );
    }
}

#[tokio::test]
async fn served_artifact_matches_status_and_carries_the_spec() {
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
    assert_eq!(url, op.fs_url(&format!("/programs/{ns}/with-packages/1")));

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
    let same = reqwest::get(format!("{url}.tar.gz"))
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
    let plane = ControlPlane::shared().await;
    let ns = plane.namespace("prog-bad").await.expect("namespace");
    let op = operator_for(plane, &ns, None).await;
    let api: Api<Program> = Api::namespaced(plane.client(), &ns);
    api.create(&PostParams::default(), &pod_program("p"))
        .await
        .expect("create");
    artifact_at(&api, "p", 1).await;
    api.patch(
        "p",
        &PatchParams::default(),
        &Patch::Merge(json!({"program": {"outputs": {"x": "1"}}})),
    )
    .await
    .expect("patch");
    artifact_at(&api, "p", 2).await;

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
        (
            reqwest::Method::GET,
            format!("/programs/{ns}/missing/1"),
            404,
            "not found",
        ),
        (
            reqwest::Method::GET,
            format!("/programs/{ns}/p/3"),
            404,
            "current generation is 2",
        ),
        (
            reqwest::Method::GET,
            format!("/programs/{ns}/p/1"),
            410,
            "superseded",
        ),
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
    let url = op.fs_url(&format!("/programs/{ns}/p/2"));
    wait_for("404 after delete", WAIT, || async {
        let resp = reqwest::get(&url).await.ok()?;
        (resp.status() == 404).then_some(())
    })
    .await
    .expect("deleted program answers 404");
}

#[tokio::test]
async fn two_operators_serve_identical_bytes() {
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
    let path = format!("/programs/{ns}/shared/1");
    let mut bodies = Vec::new();
    for op in [&first, &second] {
        let url = op.fs_url(&path);
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
    wait_for("a reconcile by the restarted operator", WAIT, || async {
        let text = reqwest::get(&metrics_url).await.ok()?.text().await.ok()?;
        text.lines()
            .any(|l| {
                l.starts_with("pko_reconciles_total{controller=\"program\"} ") && !l.ends_with(" 0")
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
    let body = reqwest::get(op.fs_url(&format!("/programs/{ns}/big/1")))
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
    let plane = ControlPlane::shared().await;
    let ns = plane.namespace("prog-burst").await.expect("namespace");
    let op = operator_for(plane, &ns, None).await;
    let api: Api<Program> = Api::namespaced(plane.client(), &ns);
    api.create(&PostParams::default(), &pod_program("p"))
        .await
        .expect("create");
    artifact_at(&api, "p", 1).await;
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
    let ok = reqwest::get(op.fs_url(&format!("/programs/{ns}/p/1")))
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
