//! Health as GitOps tools read it: each kind's objects, read from the apiserver, are given to
//! sigs.k8s.io/cli-utils' kstatus (`status.Compute`, what Flux's Kustomization `wait` and Argo
//! CD use; `tools/kstatus`), and what it concludes is asserted: a served Program is `Current`,
//! a spec not yet observed is `InProgress`, one whose artifact cannot be built is `Failed`
//! (`Stalled=True`, not a `Ready=False` kstatus takes for progress), and a fix brings it back;
//! a Workspace likewise with a pod template it refuses, and one stopped by `spec.idle`
//! (`Ready=False, reason=Idle`, neither kstatus condition) is `InProgress` with the Idle
//! message (kstatus takes any `Ready=False` for progress), never `Failed`.

use std::time::Duration;

use k8s_openapi::api::core::v1::Secret;
use kube::Api;
use kube::api::{Patch, PatchParams, PostParams};
use pko_api::program::Program;
use pko_api::workspace::Workspace;
use pko_tests::execution::Execution;
use pko_tests::fixtures;
use pko_tests::kstatus::{self, Health};
use pko_tests::operator::{Operator, OperatorOptions};
use pko_tests::{ControlPlane, wait_for};
use serde_json::{Value, json};

const WAIT: Duration = Duration::from_secs(90);

/// The object at `path` as the apiserver returns it (text: the deep Program is past
/// serde_json's depth limit; kstatus reads it all the same).
async fn get_text(client: &kube::Client, path: &str) -> Option<String> {
    let request = http::Request::get(path).body(Vec::new()).ok()?;
    client.request_text(request).await.ok()
}

async fn merge_patch(client: &kube::Client, path: &str, body: String) {
    let request = http::Request::patch(path)
        .header(http::header::CONTENT_TYPE, "application/merge-patch+json")
        .body(body.into_bytes())
        .expect("request");
    client.request_text(request).await.expect("merge patch");
}

/// Waits until kstatus, on the object at `path`, says `expected` and `also` holds of the object
/// (parsed, when it parses); returns the verdict and the object's text.
async fn health_becomes(
    client: &kube::Client,
    path: &str,
    expected: &str,
    also: impl Fn(&Value) -> bool,
) -> (Health, String) {
    let last = std::sync::Mutex::new(None);
    let found = wait_for(&format!("kstatus {expected} for {path}"), WAIT, || async {
        let text = get_text(client, path).await?;
        let health = kstatus::compute(&text).expect("kstatus runs");
        let holds = health.status == expected
            && serde_json::from_str::<Value>(&text).map_or(true, |v| also(&v));
        let seen = (health.clone(), text.chars().take(4000).collect::<String>());
        *last
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = Some(seen);
        holds.then_some((health, text))
    })
    .await;
    match found {
        Ok(found) => found,
        Err(e) => panic!("{e}; last verdict and object: {:?}", last.lock()),
    }
}

fn condition<'a>(object: &'a Value, type_: &str) -> Option<&'a Value> {
    object["status"]["conditions"]
        .as_array()?
        .iter()
        .find(|c| c["type"] == type_)
}

fn env_of(object: &Value) -> Vec<Value> {
    object["spec"]["env"]
        .as_array()
        .cloned()
        .unwrap_or_default()
}

fn observed(object: &Value, generation: i64) -> bool {
    object["metadata"]["generation"] == generation
        && object["status"]["observedGeneration"] == generation
}

/// `{"a":{"a":...1...}}`, `depth` objects deep: a Program variable no artifact can be built
/// from (serde_json's recursion limit), which the apiserver accepts.
fn nested(depth: usize) -> String {
    format!("{}1{}", r#"{"a":"#.repeat(depth), "}".repeat(depth))
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
    .expect("operator starts")
}

fn kubectl_get_programs(plane: &ControlPlane, ns: &str, wide: bool) -> String {
    let mut cmd = plane.kubectl();
    cmd.args(["get", "programs", "-n", ns]);
    if wide {
        cmd.args(["-o", "wide"]);
    }
    let out = cmd.output().expect("kubectl");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

#[tokio::test]
async fn a_program_is_current_failed_and_current_again_as_kstatus_reads_it() {
    let _machine = pko_tests::serial::shared().await;
    let plane = ControlPlane::shared().await;
    let ns = plane.namespace("kstatus-prog").await.expect("namespace");
    let client = plane.client();
    let programs: Api<Program> = Api::namespaced(client.clone(), &ns);
    let path = format!("/apis/pulumi.com/v1/namespaces/{ns}/programs/p");

    let mut op = operator_for(plane, &ns).await;
    programs
        .create(&PostParams::default(), &fixtures::config_map_program("p"))
        .await
        .expect("create");
    let (_, text) = health_becomes(&client, &path, "Current", |o| {
        observed(o, 1) && o["status"]["artifact"].is_object()
    })
    .await;
    let object: Value = serde_json::from_str(&text).expect("json");
    assert_eq!(
        condition(&object, "Ready").expect("Ready")["status"],
        "True"
    );
    assert!(condition(&object, "Stalled").is_none(), "{object}");
    assert!(condition(&object, "Reconciling").is_none(), "{object}");

    // `kubectl get programs`: Ready, no URL (its token) but with `-o wide`.
    let plain = kubectl_get_programs(plane, &ns, false);
    let header: Vec<&str> = plain
        .lines()
        .next()
        .unwrap_or("")
        .split_whitespace()
        .collect();
    assert_eq!(header, ["NAME", "READY", "AGE"], "{plain}");
    assert!(
        plain
            .lines()
            .nth(1)
            .is_some_and(|l| l.split_whitespace().nth(1) == Some("True")),
        "{plain}"
    );
    let wide = kubectl_get_programs(plane, &ns, true);
    assert!(
        wide.lines().next().is_some_and(|h| h.contains("URL")),
        "{wide}"
    );
    let url = object["status"]["artifact"]["url"].as_str().expect("url");
    assert!(wide.contains(url), "{wide}");

    // A spec the operator has not seen yet: in progress, as kstatus reads observedGeneration.
    op.stop();
    merge_patch(
        &client,
        &path,
        format!(r#"{{"program":{{"variables":{}}}}}"#, nested(1000)),
    )
    .await;
    let text = get_text(&client, &path).await.expect("read");
    let health = kstatus::compute(&text).expect("kstatus");
    assert_eq!(health.status, "InProgress", "{health:?}");
    assert!(
        health.message.contains("latest observed generation is 1"),
        "{health:?}"
    );

    // The operator cannot build it: Failed, with the Stalled condition's message.
    let op = operator_for(plane, &ns).await;
    let (health, _) = health_becomes(&client, &path, "Failed", |_| true).await;
    assert!(
        health
            .message
            .contains("artifact of generation 2 cannot be built")
            && health.message.contains("recursion limit"),
        "{health:?}"
    );

    // Fixed: Current again, with neither kstatus condition left.
    merge_patch(
        &client,
        &path,
        r#"{"program":{"variables":{"a":1}}}"#.to_owned(),
    )
    .await;
    let (_, text) = health_becomes(&client, &path, "Current", |o| {
        observed(o, 3) && o["status"]["artifact"]["revision"] == "3"
    })
    .await;
    let object: Value = serde_json::from_str(&text).expect("json");
    assert!(condition(&object, "Stalled").is_none(), "{object}");
    assert!(condition(&object, "Reconciling").is_none(), "{object}");
    assert_eq!(
        condition(&object, "Ready").expect("Ready")["status"],
        "True"
    );
    drop(op);
}

#[tokio::test]
async fn a_workspace_is_current_failed_and_current_again_as_kstatus_reads_it() {
    let _machine = pko_tests::serial::shared().await;
    let env = Execution::start("kstatus-ws", &[]).await;
    let plane = env.plane;
    let client = plane.client();
    let programs: Api<Program> = Api::namespaced(client.clone(), &env.ns);
    let (url, digest) = fixtures::published_program(
        &programs,
        "prog",
        json!({"outputs": {"message": "hi"}}),
        WAIT,
    )
    .await
    .expect("artifact");
    let backend = env.tmp.path().join("backend");
    let workspaces: Api<Workspace> = Api::namespaced(client.clone(), &env.ns);
    workspaces
        .create(
            &PostParams::default(),
            &fixtures::workspace(
                "ws",
                json!({
                    "flux": {"url": url, "digest": digest},
                    "env": [
                        {"name": "PULUMI_BACKEND_URL", "value": format!("file://{}", backend.display())},
                        {"name": "PULUMI_CONFIG_PASSPHRASE", "value": fixtures::PASSPHRASE},
                    ],
                    "stacks": [{"name": "dev", "create": true}],
                }),
            ),
        )
        .await
        .expect("create");
    let path = format!(
        "/apis/auto.pulumi.com/v1alpha1/namespaces/{}/workspaces/ws",
        env.ns
    );
    let ready = |generation: i64| {
        move |o: &Value| {
            observed(o, generation) && condition(o, "Ready").is_some_and(|c| c["status"] == "True")
        }
    };
    let current = health_becomes(&client, &path, "Current", ready(1)).await;
    let object: Value = serde_json::from_str(&current.1).expect("json");
    assert!(condition(&object, "Reconciling").is_none(), "{object}");

    // A pod template it will not run: Failed, with the Stalled condition's message.
    workspaces
        .patch(
            "ws",
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": {"podTemplate": {"spec": {
                "securityContext": {"runAsUser": 0},
                "containers": [{"name": "pulumi"}],
            }}}})),
        )
        .await
        .expect("root template");
    let (health, _) = health_becomes(&client, &path, "Failed", |o| observed(o, 2)).await;
    assert!(
        health.message.contains("must not be 0 (root)"),
        "{health:?}"
    );

    // Back to a template it runs, with a variable from a Secret not there yet: in progress
    // (`Reconciling=True`, not stalled) until the Secret appears, then Current again.
    let mut env_vars = env_of(&object);
    env_vars.push(
        json!({"name": "LATER", "valueFrom": {"secretKeyRef": {"name": "later", "key": "k"}}}),
    );
    workspaces
        .patch(
            "ws",
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": {"podTemplate": null, "env": env_vars}})),
        )
        .await
        .expect("template removed");
    let (health, text) = health_becomes(&client, &path, "InProgress", |o| {
        observed(o, 3) && condition(o, "Reconciling").is_some()
    })
    .await;
    let object: Value = serde_json::from_str(&text).expect("json");
    let reconciling = condition(&object, "Reconciling").expect("Reconciling");
    assert_eq!(
        (&reconciling["status"], &reconciling["reason"]),
        (&json!("True"), &json!("EnvironmentUnavailable")),
        "{object}"
    );
    assert_eq!(health.message, reconciling["message"], "{health:?}");
    assert!(condition(&object, "Stalled").is_none(), "{object}");
    let secrets: Api<Secret> = Api::namespaced(client.clone(), &env.ns);
    secrets
        .create(
            &PostParams::default(),
            &serde_json::from_value(
                json!({"metadata": {"name": "later"}, "stringData": {"k": "v"}}),
            )
            .expect("secret"),
        )
        .await
        .expect("create secret");
    let (_, text) = health_becomes(&client, &path, "Current", ready(3)).await;
    let object: Value = serde_json::from_str(&text).expect("json");
    assert!(condition(&object, "Stalled").is_none(), "{object}");
    assert!(condition(&object, "Reconciling").is_none(), "{object}");

    // `spec.idle`: with no operation for the period its pod is stopped, `Ready=False` with
    // reason `Idle` and neither kstatus condition. kstatus's last rule (`checkReadyCondition`)
    // takes any `Ready=False` for progress: `InProgress` with the Idle message, not `Failed`.
    workspaces
        .patch(
            "ws",
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": {"idle": {"after": "1s"}}})),
        )
        .await
        .expect("idle");
    let (health, text) = health_becomes(&client, &path, "InProgress", |o| {
        observed(o, 4)
            && condition(o, "Ready")
                .is_some_and(|c| c["status"] == "False" && c["reason"] == "Idle")
    })
    .await;
    let object: Value = serde_json::from_str(&text).expect("json");
    assert_eq!(
        health.message,
        condition(&object, "Ready").expect("Ready")["message"],
        "{health:?}"
    );
    assert!(condition(&object, "Stalled").is_none(), "{object}");
    assert!(condition(&object, "Reconciling").is_none(), "{object}");
}
