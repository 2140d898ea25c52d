//! Deeply nested objects on the real control plane: a Program nested past serde_json's depth
//! limit (through the apiserver's `managedFields` mirror of it) and a Stack whose
//! `status.outputs` are, written the way an older operator could write them, must not keep a
//! restarted operator from listing, becoming ready and serving everything else.

use std::time::Duration;

use kube::Api;
use kube::api::PostParams;
use pko_api::program::Program;
use pko_api::stack::Stack;
use pko_tests::fixtures::{self, status_of};
use pko_tests::operator::{Operator, OperatorOptions};
use pko_tests::{ControlPlane, wait_for};
use serde_json::json;

const WAIT: Duration = Duration::from_secs(60);

/// `{"a":{"a":...1...}}`, `depth` objects deep.
fn nested(depth: usize) -> String {
    format!("{}1{}", r#"{"a":"#.repeat(depth), "}".repeat(depth))
}

/// Sends `body` as JSON with `method` to `path`, never decoding the answer as an object (the
/// typed clients cannot read the deep ones back: that is the point).
async fn raw(
    client: &kube::Client,
    method: http::Method,
    path: &str,
    content_type: &str,
    body: String,
) -> Result<String, kube::Error> {
    let request = http::Request::builder()
        .method(method)
        .uri(path)
        .header(http::header::CONTENT_TYPE, content_type)
        .body(body.into_bytes())
        .map_err(kube::Error::HttpError)?;
    client.request_text(request).await
}

async fn create_deep_program(
    client: &kube::Client,
    ns: &str,
    name: &str,
    depth: usize,
) -> Result<String, kube::Error> {
    let body = format!(
        r#"{{"apiVersion":"pulumi.com/v1","kind":"Program","metadata":{{"name":"{name}"}},
        "program":{{"variables":{}}}}}"#,
        nested(depth)
    );
    let path = format!("/apis/pulumi.com/v1/namespaces/{ns}/programs?fieldManager=tenant");
    raw(client, http::Method::POST, &path, "application/json", body).await
}

async fn operator_for(plane: &ControlPlane, ns: &str) -> Operator {
    Operator::start(
        plane,
        OperatorOptions {
            advertised: None,
            args: vec![format!("--watch-namespace={ns}")],
        },
    )
    .await
    .expect("operator starts and becomes ready")
}

/// The message of the Stack's `Stalled=True` condition, once it has one.
async fn stalled(stacks: &Api<Stack>, name: &str) -> String {
    wait_for(&format!("stack {name} to stall"), WAIT, || async {
        let status = stacks.get(name).await.ok()?.status?;
        status
            .conditions
            .iter()
            .find(|c| c.type_ == "Stalled" && c.status == "True")
            .map(|c| c.message.clone())
    })
    .await
    .expect("stalled")
}

#[tokio::test]
async fn deep_programs_and_stack_outputs_do_not_keep_a_restarted_operator_from_serving() {
    let _machine = pko_tests::serial::shared().await;
    let plane = ControlPlane::shared().await;
    let ns = plane.namespace("depth").await.expect("namespace");
    let client = plane.client();
    let programs: Api<Program> = Api::namespaced(client.clone(), &ns);
    let stacks: Api<Stack> = Api::namespaced(client.clone(), &ns);

    let mut op = operator_for(plane, &ns).await;
    programs
        .create(
            &PostParams::default(),
            &fixtures::config_map_program("good"),
        )
        .await
        .expect("create good program");

    // A namespace-scoped install has no webhook: the apiserver takes a Program 120 deep.
    create_deep_program(&client, &ns, "deep-120", 120)
        .await
        .expect("the apiserver accepts a Program 120 deep");
    // 10,000 deep: the apiserver may refuse it itself; then the deepest it takes stands in.
    match create_deep_program(&client, &ns, "deep-10000", 10_000).await {
        Ok(_) => {}
        Err(kube::Error::Api(e)) => {
            // Measured: 400, "... json parse error: ... exceeded max depth ...".
            assert!(e.message.contains("max depth"), "{e:?}");
            create_deep_program(&client, &ns, "deep-1000", 1_000)
                .await
                .expect("the apiserver accepts a Program 1,000 deep");
        }
        Err(e) => panic!("creating a Program 10,000 deep: {e}"),
    }

    // A Stack whose outputs an older operator wrote 127 deep (status subresource).
    let spec = json!({"stack": "dev", "programRef": {"name": "missing"}});
    stacks
        .create(
            &PostParams::default(),
            &fixtures::stack("deep-outputs", spec.clone()),
        )
        .await
        .expect("create stack");
    let patch = format!(r#"{{"status":{{"outputs":{{"deep":{}}}}}}}"#, nested(127));
    raw(
        &client,
        http::Method::PATCH,
        &format!("/apis/pulumi.com/v1/namespaces/{ns}/stacks/deep-outputs/status"),
        "application/merge-patch+json",
        patch,
    )
    .await
    .expect("status patch with outputs 127 deep");

    // Restart: the new operator lists all of it and becomes ready (`operator_for` waits for
    // `/readyz` 200 and fails after 60 s).
    op.stop();
    let op = operator_for(plane, &ns).await;

    // The good Program keeps its artifact, and the restarted file server serves it.
    let artifact = wait_for("the good Program's artifact", WAIT, || async {
        let p = programs.get("good").await.ok()?;
        status_of(&p).get("artifact").cloned()
    })
    .await
    .expect("artifact");
    let url = artifact["url"].as_str().expect("url");
    let served = reqwest::get(op.fs_url_of(url))
        .await
        .expect("fetch artifact");
    assert_eq!(served.status(), 200, "log: {}", op.log_text());

    // A good Stack beside the deep one reconciles, and so does the deep one (its outputs read).
    stacks
        .create(&PostParams::default(), &fixtures::stack("good", spec))
        .await
        .expect("create good stack");
    let good = stalled(&stacks, "good").await;
    let deep = stalled(&stacks, "deep-outputs").await;
    assert_eq!(deep, good);

    // The Program too deep to build says so on its own condition.
    let failed = wait_for("the 1,000-deep Program's condition", WAIT, || async {
        let text = raw_get(
            &client,
            &format!("/apis/pulumi.com/v1/namespaces/{ns}/programs/deep-1000"),
        )
        .await?;
        let ready = status_head(&text)?
            .conditions
            .into_iter()
            .find(|c| c["type"] == "Ready")?;
        (ready["status"] == "False").then_some(ready)
    })
    .await
    .expect("a Ready=False condition");
    assert_eq!(failed["reason"], "ArtifactFailed", "{failed}");
    assert!(
        failed["message"]
            .as_str()
            .is_some_and(|m| m.contains("recursion limit")),
        "{failed}"
    );
}

async fn raw_get(client: &kube::Client, path: &str) -> Option<String> {
    raw(
        client,
        http::Method::GET,
        path,
        "application/json",
        String::new(),
    )
    .await
    .ok()
}

#[derive(serde::Deserialize)]
struct StatusHead {
    #[serde(default)]
    conditions: Vec<serde_json::Value>,
}

/// The status of an object whose spec is too deep to decode (everything else is skipped).
fn status_head(text: &str) -> Option<StatusHead> {
    #[derive(serde::Deserialize)]
    struct Head {
        status: Option<StatusHead>,
    }
    serde_json::from_str::<Head>(text).ok()?.status
}
