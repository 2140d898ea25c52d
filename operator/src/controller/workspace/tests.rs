//! Phases of the reconcile against a mocked apiserver: each test scripts the requests it
//! expects, in order, and what the apiserver answers.

use std::sync::Arc;
use std::time::Duration;

use http::{Method, Request, Response};
use http_body_util::BodyExt;
use kube::Client;
use kube::client::Body;
use kube::runtime::controller::Action;
use pko_api::workspace::{Workspace, WorkspaceStatus};
use serde_json::{Value, json};
use tokio::task::JoinHandle;

use super::phases::{self, End, Phase, Run};
use super::status::{self, READY, STALLED, write_status};
use super::{PodSettings, WorkspaceContext, pod, reconcile};
use crate::agent_client::Agents;
use crate::controller::conditions;
use crate::controller::kit::Kit;
use crate::metrics::Metrics;

type Handle = tower_test::mock::Handle<Request<Body>, Response<Body>>;

/// The scripted apiserver side of a mocked client.
struct Apiserver(Handle);

impl Apiserver {
    /// Receives the next request, checks its method and path, answers `response` and returns
    /// the request's query and JSON body.
    async fn expect(&mut self, method: Method, path: &str, response: Value) -> (String, Value) {
        let (request, send) = self.0.next_request().await.expect("a request");
        assert_eq!(request.method(), method, "{}", request.uri());
        assert_eq!(request.uri().path(), path);
        let query = request.uri().query().unwrap_or_default().to_owned();
        let bytes = request
            .into_body()
            .collect()
            .await
            .expect("request body")
            .to_bytes();
        let body = if bytes.is_empty() {
            Value::Null
        } else {
            serde_json::from_slice(&bytes).expect("JSON body")
        };
        let answer = serde_json::to_vec(&response).expect("response");
        send.send_response(
            Response::builder()
                .body(Body::from(answer))
                .expect("response"),
        );
        (query, body)
    }

    /// A server-side apply patch by `manager` to `path`; returns its body.
    async fn expect_apply(&mut self, path: &str, manager: &str, response: Value) -> Value {
        let (query, body) = self.expect(Method::PATCH, path, response).await;
        assert!(query.contains("force=true"), "{query}");
        let manager = format!("fieldManager={}", manager.replace('/', "%2F"));
        assert!(query.contains(&manager), "{query}");
        body
    }

    /// An Event created in namespace `ns`, echoed back; returns it.
    async fn expect_event(&mut self) -> Value {
        let (request, send) = self.0.next_request().await.expect("an event");
        assert_eq!(request.method(), Method::POST);
        assert_eq!(
            request.uri().path(),
            "/apis/events.k8s.io/v1/namespaces/ns/events"
        );
        let bytes = request
            .into_body()
            .collect()
            .await
            .expect("event body")
            .to_bytes();
        send.send_response(
            Response::builder()
                .body(Body::from(bytes.to_vec()))
                .expect("response"),
        );
        serde_json::from_slice(&bytes).expect("event")
    }

    /// Checks that no request comes (once every client is dropped).
    async fn expect_nothing(mut self) {
        assert!(self.0.next_request().await.is_none(), "unexpected request");
    }
}

fn mock() -> (Client, Apiserver) {
    let (service, handle) = tower_test::mock::pair::<Request<Body>, Response<Body>>();
    (Client::new(service, "default"), Apiserver(handle))
}

fn context(client: &Client) -> WorkspaceContext {
    let kit = Kit::new(client.clone(), Metrics::new(), None);
    let agents = Arc::new(Agents::new(client.clone(), None, None));
    let settings = PodSettings {
        file_server: pko_admission::tenancy::FileServerNames::default(),
        agent_image: "agent:1".into(),
        agent_image_pull_policy: "IfNotPresent".into(),
        pko_agent_image: "pko:2.9".into(),
        max_artifact_bytes: None,
        git_ssh_accept_new_host_keys: false,
        github_api_url: pko_git::github_app::DEFAULT_API_URL.into(),
    };
    WorkspaceContext::new(&kit, agents, settings)
}

fn workspace(metadata: Value, spec: Value) -> Workspace {
    let mut meta = json!({"name": "w", "namespace": "ns", "uid": "u", "generation": 2});
    if let (Some(m), Value::Object(extra)) = (meta.as_object_mut(), metadata) {
        m.extend(extra);
    }
    serde_json::from_value(json!({
        "apiVersion": "auto.pulumi.com/v1alpha1", "kind": "Workspace",
        "metadata": meta, "spec": spec,
    }))
    .expect("workspace")
}

fn credentials() -> Value {
    // "t", "c", "k" in base64.
    json!({"apiVersion": "v1", "kind": "Secret",
        "metadata": {"name": pod::credentials_name("w"), "namespace": "ns"},
        "data": {"token": "dA==", "tls.crt": "Yw==", "tls.key": "aw=="}})
}

async fn served(apiserver: JoinHandle<()>) {
    tokio::time::timeout(Duration::from_secs(5), apiserver)
        .await
        .expect("the apiserver script ends")
        .expect("the apiserver script passes");
}

fn ready(status: &WorkspaceStatus) -> (String, String, String) {
    let c = conditions::get(&status.conditions, READY).expect("Ready");
    (c.status.clone(), c.reason.clone(), c.message.clone())
}

#[tokio::test]
async fn apply_sends_the_service_then_the_statefulset() {
    let (client, mut apiserver) = mock();
    let ctx = context(&client);
    let ws = workspace(json!({}), json!({}));
    let script = tokio::spawn(async move {
        let secret = format!(
            "/api/v1/namespaces/ns/secrets/{}",
            pod::credentials_name("w")
        );
        apiserver.expect(Method::GET, &secret, credentials()).await;
        let service = apiserver
            .expect_apply(
                "/api/v1/namespaces/ns/services/w-workspace",
                "pko-rs",
                json!({"apiVersion": "v1", "kind": "Service", "metadata": {"name": "w-workspace"}}),
            )
            .await;
        assert_eq!(service["kind"], "Service");
        assert_eq!(service["metadata"]["ownerReferences"][0]["uid"], "u");
        let sts = apiserver
            .expect_apply(
                "/apis/apps/v1/namespaces/ns/statefulsets/w-workspace",
                "pko-rs",
                json!({"apiVersion": "apps/v1", "kind": "StatefulSet",
                    "metadata": {"name": "w-workspace", "generation": 1}}),
            )
            .await;
        assert_eq!(sts["kind"], "StatefulSet");
        assert_eq!(sts["metadata"]["ownerReferences"][0]["name"], "w");
    });
    let mut run = Run::new(&ws, &ctx).expect("run");
    let applied = match phases::apply(&mut run).await.expect("applied") {
        Phase::Continue(applied) => applied,
        Phase::Done(end) => panic!("ended: {end:?}"),
    };
    served(script).await;
    assert_eq!(applied.statefulset.metadata.generation, Some(1));
    match &applied.auth {
        crate::agent_client::AgentAuth::Pinned(credentials) => assert_eq!(credentials.token, "t"),
        other => panic!("{other:?}"),
    }
    assert_eq!(
        serde_json::to_value(&run.status).expect("status"),
        serde_json::to_value(status::draft(&ws)).expect("status"),
        "the status is left alone"
    );
}

#[tokio::test]
async fn a_pod_the_restricted_profile_forbids_stalls_without_applying() {
    let (client, mut apiserver) = mock();
    let ctx = context(&client);
    let spec = json!({"podTemplate": {"spec": {"hostNetwork": true}}});
    let ws = workspace(json!({}), spec);
    let script = tokio::spawn(async move {
        let secret = format!(
            "/api/v1/namespaces/ns/secrets/{}",
            pod::credentials_name("w")
        );
        apiserver.expect(Method::GET, &secret, credentials()).await;
        let event = apiserver.expect_event().await;
        assert_eq!(event["reason"], "SpecInvalid");
        assert_eq!(event["type"], "Warning");
    });
    let mut run = Run::new(&ws, &ctx).expect("run");
    let phase = phases::apply(&mut run).await.expect("no failure");
    served(script).await;
    assert!(
        matches!(phase, Phase::Done(End::Report(ref a)) if *a == Action::await_change()),
        "{phase:?}"
    );
    assert!(conditions::is_true(&run.status.conditions, STALLED));
    assert_eq!(ready(&run.status).1, "SpecInvalid");
}

#[tokio::test]
async fn a_failed_init_container_is_the_not_ready_message() {
    let (client, mut apiserver) = mock();
    let ctx = context(&client);
    let ws = workspace(json!({}), json!({}));
    let sts = serde_json::from_value(json!({"metadata": {"generation": 1},
        "status": {"replicas": 1, "observedGeneration": 1}}))
    .expect("statefulset");
    let script = tokio::spawn(async move {
        let pod = json!({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "w-workspace-0"},
            "status": {"initContainerStatuses": [{"name": "fetch", "image": "i", "imageID": "",
                "ready": false, "restartCount": 0,
                "state": {"terminated": {"exitCode": 2, "message": "bad digest"}}}]}});
        let path = "/api/v1/namespaces/ns/pods/w-workspace-0";
        apiserver.expect(Method::GET, path, pod).await;
        let event = apiserver.expect_event().await;
        assert_eq!(event["reason"], "InitializationFailure");
    });
    let mut run = Run::new(&ws, &ctx).expect("run");
    let phase = phases::pod_ready(&mut run, &sts).await.expect("no failure");
    served(script).await;
    let requeue = Action::requeue(phases::POD_NOT_READY_REQUEUE);
    assert!(
        matches!(phase, Phase::Done(End::Report(ref a)) if *a == requeue),
        "{phase:?}"
    );
    assert_eq!(
        ready(&run.status),
        (
            "False".into(),
            "WaitingForReplicas".into(),
            "init container fetch failed (exit code 2): bad digest".into()
        )
    );
}

#[tokio::test]
async fn the_status_writer_sends_one_apply_patch_of_the_status() {
    let (client, mut apiserver) = mock();
    let before = WorkspaceStatus::default();
    let mut after = before.clone();
    after.observed_generation = Some(2);
    status::mark_ready(&mut after, Some(2));
    let script = tokio::spawn(async move {
        let body = apiserver
            .expect_apply(
                "/apis/auto.pulumi.com/v1alpha1/namespaces/ns/workspaces/w/status",
                "pko-rs/workspace-status",
                json!({"apiVersion": "auto.pulumi.com/v1alpha1", "kind": "Workspace",
                    "metadata": {"name": "w"}, "spec": {}}),
            )
            .await;
        assert_eq!(body["kind"], "Workspace");
        assert_eq!(body["status"]["observedGeneration"], 2);
        let conditions = &body["status"]["conditions"];
        assert_eq!(conditions[0]["type"], "Ready");
        assert_eq!(conditions[0]["status"], "True");
        assert_eq!(conditions[0]["reason"], "Succeeded");
        apiserver.expect_nothing().await;
    });
    write_status(&client, "ns", "w", &before, &after)
        .await
        .expect("written");
    drop(client);
    served(script).await;
}

#[tokio::test]
async fn an_unchanged_status_is_not_written() {
    let (client, apiserver) = mock();
    let mut before = WorkspaceStatus::default();
    status::mark_ready(&mut before, Some(2));
    write_status(&client, "ns", "w", &before, &before.clone())
        .await
        .expect("nothing to write");
    drop(client);
    served(tokio::spawn(apiserver.expect_nothing())).await;
}

#[tokio::test]
async fn a_deleted_workspace_only_reports_deleting() {
    let (client, mut apiserver) = mock();
    let ctx = context(&client);
    let meta = json!({"deletionTimestamp": "2025-01-01T00:00:00Z", "finalizers": ["f"]});
    let ws = workspace(meta, json!({}));
    let script = tokio::spawn(async move {
        let body = apiserver
            .expect_apply(
                "/apis/auto.pulumi.com/v1alpha1/namespaces/ns/workspaces/w/status",
                "pko-rs/workspace-status",
                json!({"apiVersion": "auto.pulumi.com/v1alpha1", "kind": "Workspace",
                    "metadata": {"name": "w"}, "spec": {}}),
            )
            .await;
        let ready = &body["status"]["conditions"][0];
        assert_eq!(ready["reason"], "Deleting");
        assert_eq!(ready["message"], "Workspace is being deleted");
    });
    let action = reconcile::reconcile_inner(&ws, &ctx)
        .await
        .expect("reconciled");
    served(script).await;
    assert_eq!(action, Action::await_change());
}
