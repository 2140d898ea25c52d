//! The webhook's HTTP contract, in-process with the real policy bundle (`make policies`;
//! the path comes from PKO_POLICY_BUNDLE).
#![allow(
    clippy::disallowed_methods,
    reason = "a test process is configured by its environment (make sets the tool and fixture paths)"
)]

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Arc;

use axum::Router;
use axum::body::Body;
use http::{Request, StatusCode};
use http_body_util::BodyExt;
use pko_admission::metrics::AdmissionMetrics;
use pko_admission::tenancy::{Tenancy, TenancySettings};
use pko_admission::webhook::{self, Admission, FailurePolicy, ReviewLimits};
use pko_admission::{Bundle, EngineLimits, PolicyEngine};
use pko_api::tenancy::{EnforcementAction, TenancyPolicy, TenancyPolicySpec};
use serde_json::{Value, json};
use tower::ServiceExt;

fn bundle_path() -> PathBuf {
    match std::env::var_os("PKO_POLICY_BUNDLE").filter(|v| !v.is_empty()) {
        Some(path) => PathBuf::from(path),
        None => panic!(
            "PKO_POLICY_BUNDLE is not set: run `make policies` (or `make test`, which sets it) \
             and export PKO_POLICY_BUNDLE=~/.cache/pko-rs/policies/policies.tar.gz"
        ),
    }
}

struct App {
    router: Router,
    metrics: AdmissionMetrics,
    engine: PolicyEngine,
}

async fn app(policies: Vec<TenancyPolicy>, limits: EngineLimits, failure: FailurePolicy) -> App {
    app_with(policies, limits, failure, ReviewLimits::DEFAULT).await
}

async fn app_with(
    policies: Vec<TenancyPolicy>,
    limits: EngineLimits,
    failure: FailurePolicy,
    review_limits: ReviewLimits,
) -> App {
    let bundle = Bundle::load(&bundle_path()).expect("bundle loads");
    let engine = PolicyEngine::new(&bundle, limits).await.expect("engine");
    let tenancy = Tenancy::fixed(policies, BTreeMap::new(), TenancySettings::default());
    let metrics = AdmissionMetrics::new();
    let admission = Arc::new(Admission::with_limits(
        engine.clone(),
        tenancy,
        metrics.clone(),
        failure,
        review_limits,
    ));
    App {
        router: webhook::router(admission),
        metrics,
        engine,
    }
}

async fn post(router: &Router, path: &str, body: impl Into<Body>) -> (StatusCode, Vec<u8>) {
    let response = router
        .clone()
        .oneshot(
            Request::post(path)
                .header("content-type", "application/json")
                .body(body.into())
                .expect("request"),
        )
        .await
        .expect("response");
    let status = response.status();
    let bytes = response
        .into_body()
        .collect()
        .await
        .expect("body")
        .to_bytes()
        .to_vec();
    (status, bytes)
}

async fn review_response(router: &Router, path: &str, review: &Value) -> Value {
    let (status, body) = post(router, path, review.to_string()).await;
    assert_eq!(status, StatusCode::OK, "{}", String::from_utf8_lossy(&body));
    let value: Value = serde_json::from_slice(&body).expect("JSON answer");
    assert_eq!(value["apiVersion"], "admission.k8s.io/v1");
    assert_eq!(value["kind"], "AdmissionReview");
    assert_eq!(value["response"]["uid"], review["request"]["uid"]);
    value["response"].clone()
}

fn review(namespace: &str, spec: Value) -> Value {
    json!({
        "apiVersion": "admission.k8s.io/v1",
        "kind": "AdmissionReview",
        "request": {
            "uid": "6a0c6b4e-5d1c-4b8e-9d3e-000000000001",
            "kind": {"group": "auto.pulumi.com", "version": "v1alpha1", "kind": "Workspace"},
            "resource": {"group": "auto.pulumi.com", "version": "v1alpha1", "resource": "workspaces"},
            "name": "w",
            "namespace": namespace,
            "operation": "CREATE",
            "userInfo": {"username": "alice"},
            "object": {
                "apiVersion": "auto.pulumi.com/v1alpha1",
                "kind": "Workspace",
                "metadata": {"name": "w", "namespace": namespace},
                "spec": spec,
            },
            "oldObject": null,
            "dryRun": false,
        },
    })
}

fn policy(name: &str, namespace: &str, action: EnforcementAction) -> TenancyPolicy {
    TenancyPolicy::new(
        name,
        TenancyPolicySpec {
            enforcement_action: action,
            namespaces: Some(vec![namespace.to_owned()]),
            ..TenancyPolicySpec::default()
        },
    )
}

#[tokio::test]
async fn malformed_reviews_get_400_with_a_reason() {
    let app = app(vec![], EngineLimits::default(), FailurePolicy::Fail).await;
    let cases = [
        ("not json".to_owned(), "not JSON"),
        (
            json!({"apiVersion": "admission.k8s.io/v1beta1", "kind": "AdmissionReview"}).to_string(),
            "expected an admission.k8s.io/v1 AdmissionReview",
        ),
        (
            json!({"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview"}).to_string(),
            "has no request",
        ),
        (
            json!({"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "request": {"uid": 5}})
                .to_string(),
            "malformed AdmissionReview",
        ),
    ];
    for (body, reason) in cases {
        for path in ["/validate", "/mutate"] {
            let (status, answer) = post(&app.router, path, body.clone()).await;
            let text = String::from_utf8_lossy(&answer);
            assert_eq!(status, StatusCode::BAD_REQUEST, "{path} {body}: {text}");
            assert!(text.contains(reason), "{path} {body}: {text}");
        }
    }
    let metrics = encode(&app.metrics);
    assert!(
        metrics
            .contains("pko_admission_decisions_total{webhook=\"validate\",result=\"invalid\"} 4"),
        "{metrics}"
    );
    // Anything but POST is refused by the router.
    let response = app
        .router
        .clone()
        .oneshot(
            Request::get("/validate")
                .body(Body::empty())
                .expect("request"),
        )
        .await
        .expect("response");
    assert_eq!(response.status(), StatusCode::METHOD_NOT_ALLOWED);
}

#[tokio::test]
async fn denials_list_every_violation_with_its_path() {
    let app = app(vec![], EngineLimits::default(), FailurePolicy::Fail).await;
    let spec = json!({
        "securityProfile": "baseline",
        "podTemplate": {"spec": {
            "hostNetwork": true,
            "securityContext": {"runAsNonRoot": true, "seccompProfile": {"type": "RuntimeDefault"}},
            "containers": [{"name": "pulumi", "securityContext": {"allowPrivilegeEscalation": false, "capabilities": {"drop": ["ALL"]}}}],
        }},
    });
    let response = review_response(&app.router, "/validate", &review("team-a", spec)).await;
    assert_eq!(response["allowed"], false);
    assert_eq!(response["status"]["code"], 403);
    let message = response["status"]["message"].as_str().expect("message");
    assert!(
        message.starts_with("Workspace team-a/w violates 2 pko-rs admission policy rules:"),
        "{message}"
    );
    assert!(message.contains("- spec.podTemplate.spec.hostNetwork: sharing the host's namespaces is not allowed [restricted/host-namespaces]"), "{message}");
    assert!(message.contains("- spec.securityProfile: "), "{message}");
    let causes = response["status"]["details"]["causes"]
        .as_array()
        .expect("causes");
    assert_eq!(causes.len(), 2);
    assert!(
        causes.iter().any(|c| c["field"] == "spec.securityProfile"
            && c["reason"] == "restricted/baseline-profile")
    );
}

#[tokio::test]
async fn warn_and_dryrun_admit() {
    let app = app(
        vec![
            policy("trial", "team-w", EnforcementAction::Warn),
            policy("audit", "team-d", EnforcementAction::Dryrun),
        ],
        EngineLimits::default(),
        FailurePolicy::Fail,
    )
    .await;
    let baseline = json!({"securityProfile": "baseline"});
    let warned = review_response(
        &app.router,
        "/validate",
        &review("team-w", baseline.clone()),
    )
    .await;
    assert_eq!(warned["allowed"], true);
    let warnings = warned["warnings"].as_array().expect("warnings");
    assert_eq!(warnings.len(), 1);
    assert!(
        warnings[0]
            .as_str()
            .is_some_and(|w| w.starts_with("pko-rs policy: spec.securityProfile:")
                && w.ends_with("[restricted/baseline-profile]"))
    );
    assert!(warned.get("auditAnnotations").is_none());

    let recorded = review_response(&app.router, "/validate", &review("team-d", baseline)).await;
    assert_eq!(recorded["allowed"], true);
    assert!(recorded.get("warnings").is_none());
    let audit: Value = serde_json::from_str(
        recorded["auditAnnotations"]["dryrun-violations"]
            .as_str()
            .expect("audit annotation"),
    )
    .expect("annotation JSON");
    assert_eq!(audit[0]["code"], "baseline-profile");
    assert_eq!(audit[0]["action"], "dryrun");

    let metrics = encode(&app.metrics);
    for line in [
        "pko_admission_decisions_total{webhook=\"validate\",result=\"warned\"} 1",
        "pko_admission_decisions_total{webhook=\"validate\",result=\"allowed\"} 1",
        "pko_admission_violations_total{policy=\"restricted\",code=\"baseline-profile\",action=\"dryrun\"} 1",
        "pko_admission_violations_total{policy=\"restricted\",code=\"baseline-profile\",action=\"warn\"} 1",
    ] {
        assert!(metrics.contains(line), "{line} missing in\n{metrics}");
    }
    assert!(metrics.contains(
        "pko_admission_evaluation_duration_seconds_count{entrypoint=\"pko/admission/decision\"} 2"
    ));
}

#[tokio::test]
async fn mutate_returns_a_json_patch() {
    let app = app(vec![], EngineLimits::default(), FailurePolicy::Fail).await;
    let response = review_response(&app.router, "/mutate", &review("team-a", json!({}))).await;
    assert_eq!(response["allowed"], true);
    assert_eq!(response["patchType"], "JSONPatch");
    // kube serializes the patch bytes as a JSON array of numbers, which the apiserver reads.
    let bytes: Vec<u8> = serde_json::from_value(response["patch"].clone()).expect("patch bytes");
    let ops: Value = serde_json::from_slice(&bytes).expect("JSON Patch");
    assert_eq!(
        ops,
        json!([
            {"op": "add", "path": "/spec/securityProfile", "value": "restricted"},
            {"op": "add", "path": "/spec/resources", "value": {"requests": {"cpu": "100m", "memory": "64Mi"}}},
        ])
    );
    let unchanged = review_response(
        &app.router,
        "/mutate",
        &review("team-a", json!({"securityProfile": "restricted", "resources": {"requests": {"cpu": "1", "memory": "1Gi"}}})),
    )
    .await;
    assert!(unchanged.get("patch").is_none(), "{unchanged}");
}

#[tokio::test]
async fn failed_evaluations_follow_the_failure_policy_and_serving_goes_on() {
    // Only the memory cap may fail these evaluations: the deadline is out of reach, so a slow
    // machine cannot turn the memory error into a timeout.
    let small = EngineLimits {
        memory_bytes: 1024 * 1024,
        timeout: std::time::Duration::from_secs(3600),
        ..EngineLimits::default()
    };
    let big = review(
        "team-a",
        json!({"env": [{"name": "X", "value": "x".repeat(2_000_000)}]}),
    );

    let fail = app(vec![], small, FailurePolicy::Fail).await;
    let refused = review_response(&fail.router, "/validate", &big).await;
    assert_eq!(refused["allowed"], false);
    assert_eq!(refused["status"]["code"], 500);
    let message = refused["status"]["message"].as_str().unwrap_or_default();
    assert!(
        message.contains("memory limit") && message.contains("failure policy Fail"),
        "{message}"
    );
    let fine = review_response(&fail.router, "/validate", &review("team-a", json!({}))).await;
    assert_eq!(fine["allowed"], true);

    let ignore = app(vec![], small, FailurePolicy::Ignore).await;
    let admitted = review_response(&ignore.router, "/mutate", &big).await;
    assert_eq!(admitted["allowed"], true);
    assert!(
        admitted["warnings"][0]
            .as_str()
            .is_some_and(|w| w.contains("failure policy Ignore"))
    );
    let metrics = encode(&ignore.metrics);
    assert!(metrics.contains("pko_admission_evaluation_errors_total{entrypoint=\"pko/defaults/patch\",error=\"memory\"} 1"), "{metrics}");
    assert!(
        metrics.contains(
            "pko_admission_decisions_total{webhook=\"mutate\",result=\"error_allowed\"} 1"
        ),
        "{metrics}"
    );
}

fn encode(metrics: &AdmissionMetrics) -> String {
    let mut registry = prometheus_client::registry::Registry::default();
    metrics.register(&mut registry);
    let mut out = String::new();
    prometheus_client::encoding::text::encode(&mut out, &registry).expect("encode");
    out
}

fn metric(metrics: &AdmissionMetrics, line_start: &str) -> Option<String> {
    encode(metrics)
        .lines()
        .find(|l| l.starts_with(line_start))
        .map(str::to_owned)
}

#[tokio::test]
async fn bodies_over_the_limits_get_413_before_they_are_parsed() {
    let app = app(vec![], EngineLimits::default(), FailurePolicy::Fail).await;
    let max = ReviewLimits::DEFAULT.max_body_bytes;
    // Declared too large: refused on the header alone.
    let (status, answer) = post(&app.router, "/validate", vec![b' '; max + 1]).await;
    let text = String::from_utf8_lossy(&answer);
    assert_eq!(status, StatusCode::PAYLOAD_TOO_LARGE, "{text}");
    assert!(
        text.contains(&format!("the limit is {max} bytes")),
        "{text}"
    );
    // No declared length (a stream): cut at the limit while reading.
    let chunks = (0..7).map(|_| Ok::<_, std::io::Error>(vec![b' '; 1 << 20]));
    let stream = Body::from_stream(futures::stream::iter(chunks));
    let (status, answer) = post(&app.router, "/mutate", stream).await;
    assert_eq!(
        status,
        StatusCode::PAYLOAD_TOO_LARGE,
        "{}",
        String::from_utf8_lossy(&answer)
    );
    // Small but with too many values: refused before the tree is built.
    let many = format!(
        "{{\"a\":[{}0]}}",
        "0,".repeat(ReviewLimits::DEFAULT.max_json_values)
    );
    assert!(many.len() < max);
    let (status, answer) = post(&app.router, "/validate", many).await;
    let text = String::from_utf8_lossy(&answer);
    assert_eq!(status, StatusCode::PAYLOAD_TOO_LARGE, "{text}");
    assert!(text.contains("JSON values"), "{text}");
    assert_eq!(
        metric(
            &app.metrics,
            "pko_admission_refused_total{reason=\"body_too_large\"}"
        )
        .as_deref(),
        Some("pko_admission_refused_total{reason=\"body_too_large\"} 2")
    );
    assert!(
        metric(
            &app.metrics,
            "pko_admission_refused_total{reason=\"too_many_values\"} 1"
        )
        .is_some()
    );
    // The webhook still answers.
    let fine = review_response(&app.router, "/validate", &review("team-a", json!({}))).await;
    assert_eq!(fine["allowed"], true);
}

#[test]
fn the_value_bound_counts_every_value_and_ignores_strings() {
    use pko_admission::webhook::json_values_upper_bound as bound;
    assert_eq!(bound(b"1"), 1);
    assert_eq!(bound(b"[1,2,3]"), 4);
    assert_eq!(bound(br#"{"a":1,"b":[true]}"#), 5);
    // Structural characters inside strings, escaped quotes included, are not values.
    assert_eq!(bound(br#"{"a":"[,:\"[,:"}"#), 2);
    let parsed: Value =
        serde_json::from_str(r#"{"k":[{"x":[1,2]},[],{}],"s":"a,b"}"#).expect("json");
    fn count(v: &Value) -> usize {
        1 + match v {
            Value::Array(items) => items.iter().map(count).sum(),
            Value::Object(map) => map.values().map(|v| 1 + count(v)).sum(),
            _ => 0,
        }
    }
    let text = parsed.to_string();
    assert!(bound(text.as_bytes()) >= count(&parsed) - 1);
}

#[tokio::test]
async fn the_body_budget_holds_bytes_that_arrived_never_a_declared_length() {
    // Only the budget can refuse here: no body deadline or rate a slow machine could reach.
    let limits = ReviewLimits {
        body_budget_bytes: ReviewLimits::DEFAULT.max_body_bytes,
        body_timeout: std::time::Duration::from_secs(3600),
        min_body_bytes_per_sec: 0,
        ..ReviewLimits::DEFAULT
    };
    let app = app_with(vec![], EngineLimits::default(), FailurePolicy::Fail, limits).await;
    let slow_request = |sent: Vec<u8>| {
        let (sender, receiver) = tokio::sync::mpsc::channel::<Result<Vec<u8>, std::io::Error>>(1);
        let router = app.router.clone();
        let body = Body::from_stream(tokio_stream::wrappers::ReceiverStream::new(receiver));
        let task = tokio::spawn(async move {
            router
                .oneshot(
                    Request::post("/validate")
                        .header("content-length", limits.max_body_bytes.to_string())
                        .body(body)
                        .expect("request"),
                )
                .await
                .expect("response")
                .status()
        });
        async move {
            sender.send(Ok(sent)).await.expect("send");
            (sender, task)
        }
    };
    // A client that declares the largest body and sends one byte holds one KiB: a review
    // from the apiserver is answered (with the budget reserved from the declared length, it
    // found no room).
    let (declared_only, declared_task) = slow_request(b"{".to_vec()).await;
    while app.metrics.body_bytes_reserved.get() == 0 {
        tokio::task::yield_now().await;
    }
    let fine = review_response(&app.router, "/validate", &review("team-a", json!({}))).await;
    assert_eq!(fine["allowed"], true);
    drop(declared_only);
    assert_eq!(declared_task.await.expect("task"), StatusCode::BAD_REQUEST);
    // A client that has sent all but the last half KiB holds every KiB of the budget (it is
    // charged by the started KiB): a review finds no room.
    let sent = limits.max_body_bytes - 512;
    let (held, held_task) = slow_request(vec![b' '; sent]).await;
    while app.metrics.body_bytes_reserved.get() < sent as i64 {
        tokio::task::yield_now().await;
    }
    let small = review("team-a", json!({})).to_string();
    let (status, answer) = post(&app.router, "/validate", small).await;
    let refused = String::from_utf8_lossy(&answer).into_owned();
    assert_eq!(status, StatusCode::TOO_MANY_REQUESTS, "{refused}");
    assert!(refused.contains("review bytes"), "{refused}");
    // The slow client goes away: its bytes are returned.
    drop(held);
    assert_eq!(held_task.await.expect("task"), StatusCode::BAD_REQUEST);
    let fine = review_response(&app.router, "/validate", &review("team-a", json!({}))).await;
    assert_eq!(fine["allowed"], true);
}

#[tokio::test]
async fn busy_slots_answer_429_then_503_and_never_parse_the_body() {
    let limits = EngineLimits {
        concurrency: 1,
        max_waiting: 1,
        timeout: std::time::Duration::from_millis(300),
        ..EngineLimits::default()
    };
    let app = app(vec![], limits, FailurePolicy::Fail).await;
    // The only slot is taken (as by a long evaluation).
    let held = app
        .engine
        .slot(std::time::Instant::now())
        .await
        .expect("slot");
    // One request may wait: it waits its whole budget, then gets 503.
    let waiting = {
        let router = app.router.clone();
        let body = review("team-a", json!({})).to_string();
        tokio::spawn(async move { post(&router, "/validate", body).await })
    };
    while app.engine.waiting() == 0 {
        tokio::task::yield_now().await;
    }
    // A second one finds the queue full: 429 at once.
    let (status, answer) = post(&app.router, "/mutate", "not even json").await;
    let busy = String::from_utf8_lossy(&answer).into_owned();
    assert_eq!(status, StatusCode::TOO_MANY_REQUESTS, "{busy}");
    assert!(
        busy.contains("running") && busy.contains("waiting"),
        "{busy}"
    );
    let (status, answer) = waiting.await.expect("task");
    let text = String::from_utf8_lossy(&answer);
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE, "{text}");
    assert!(text.contains("no policy evaluation slot"), "{text}");
    // Nothing was parsed: no request was counted as malformed.
    assert!(
        metric(
            &app.metrics,
            "pko_admission_decisions_total{webhook=\"mutate\",result=\"invalid\"}"
        )
        .is_none()
    );
    drop(held);
    let fine = review_response(&app.router, "/validate", &review("team-a", json!({}))).await;
    assert_eq!(fine["allowed"], true);
}

// One runtime thread: work run in a slot must leave it free.
#[tokio::test(flavor = "current_thread")]
async fn slot_work_runs_on_the_blocking_pool() {
    let app = app(vec![], EngineLimits::default(), FailurePolicy::Fail).await;
    let slot = app
        .engine
        .slot(std::time::Instant::now())
        .await
        .expect("slot");
    let (release, wait) = std::sync::mpsc::channel::<()>();
    let (started_tx, started) = tokio::sync::oneshot::channel::<()>();
    let work = tokio::spawn(async move {
        slot.run(move |_| {
            let _ = started_tx.send(());
            // Blocks its thread until the async side answers.
            wait.recv().is_ok()
        })
        .await
    });
    started.await.expect("work started");
    // This runs on the runtime thread while the work still blocks its own thread.
    release.send(()).expect("release");
    assert!(work.await.expect("task").expect("ran"));
}

#[tokio::test]
async fn a_tenancy_change_applies_to_the_next_evaluation() {
    let bundle = Bundle::load(&bundle_path()).expect("bundle loads");
    // One slot: every evaluation runs on the same pooled instance while the data stays.
    let engine = PolicyEngine::new(
        &bundle,
        EngineLimits {
            concurrency: 1,
            ..EngineLimits::default()
        },
    )
    .await
    .expect("engine");
    let labels = BTreeMap::from([(
        "team-a".to_owned(),
        BTreeMap::from([("team".to_owned(), "a".to_owned())]),
    )]);
    let tenancy = Tenancy::fixed(vec![], labels, TenancySettings::default());
    let router = webhook::router(Arc::new(Admission::new(
        engine.clone(),
        tenancy.clone(),
        AdmissionMetrics::new(),
        FailurePolicy::Fail,
    )));
    let image = |ns: &str| review(ns, json!({"image": "evil.example/pulumi:3"}));
    let allowed = |response: Value| response["allowed"] == true;

    assert!(allowed(
        review_response(&router, "/validate", &image("team-a")).await
    ));
    assert_eq!(engine.pooled(), 1);

    // By name.
    let mut by_name = policy("images", "team-a", EnforcementAction::Deny);
    by_name.spec.allowed_image_prefixes = Some(vec!["registry.example/".into()]);
    tenancy.set_policies(vec![by_name]);
    let denied = review_response(&router, "/validate", &image("team-a")).await;
    assert!(!allowed(denied.clone()), "{denied}");
    assert!(
        denied["status"]["message"]
            .as_str()
            .is_some_and(|m| m.contains("TenancyPolicy images)")),
        "{denied}"
    );
    assert!(allowed(
        review_response(&router, "/validate", &image("team-b")).await
    ));

    // By label: a namespace with known labels, and one whose labels are not known (its own
    // document), both selected by an empty selector.
    let mut by_label = TenancyPolicy::new(
        "everyone",
        TenancyPolicySpec {
            namespace_selector: Some(Default::default()),
            allowed_image_prefixes: Some(vec!["registry.example/".into()]),
            ..TenancyPolicySpec::default()
        },
    );
    tenancy.set_policies(vec![by_label.clone()]);
    assert!(!allowed(
        review_response(&router, "/validate", &image("team-a")).await
    ));
    assert!(!allowed(
        review_response(&router, "/validate", &image("team-z")).await
    ));

    // An allowance that admits the image, then no policy at all.
    by_label.spec.allowed_image_prefixes = Some(vec!["evil.example/".into()]);
    tenancy.set_policies(vec![by_label]);
    assert!(allowed(
        review_response(&router, "/validate", &image("team-a")).await
    ));
    tenancy.set_policies(vec![]);
    assert!(allowed(
        review_response(&router, "/validate", &image("team-z")).await
    ));
    assert_eq!(engine.pooled(), 1);
}

/// A review whose `request.namespace` is not a DNS label is denied with the reason, and the
/// namespace never reaches the apiserver: the stand-in apiserver counts every connection.
#[tokio::test]
async fn a_namespace_that_is_not_a_dns_label_is_denied_without_an_apiserver_request() {
    use std::sync::atomic::{AtomicUsize, Ordering};
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let address = listener.local_addr().expect("address");
    let connections = Arc::new(AtomicUsize::new(0));
    let counted = connections.clone();
    tokio::spawn(async move {
        // Accepted and dropped: a lookup fails fast, and is counted.
        while let Ok((_socket, _)) = listener.accept().await {
            counted.fetch_add(1, Ordering::SeqCst);
        }
    });
    let config = kube::Config::new(format!("http://{address}").parse().expect("url"));
    let client = kube::Client::try_from(config).expect("client");
    // No watch: every label read is a direct lookup. A policy that selects namespaces by
    // label makes every review need its namespace's labels.
    let policy = TenancyPolicy::new(
        "everyone",
        TenancyPolicySpec {
            namespace_selector: Some(Default::default()),
            allowed_image_prefixes: Some(vec!["registry.example/".into()]),
            ..TenancyPolicySpec::default()
        },
    );
    let tenancy = Tenancy::looking_up(client, vec![policy], TenancySettings::default());
    let bundle = Bundle::load(&bundle_path()).expect("bundle loads");
    let engine = PolicyEngine::new(&bundle, EngineLimits::default())
        .await
        .expect("engine");
    let metrics = AdmissionMetrics::new();
    let admission = Arc::new(Admission::with_limits(
        engine,
        tenancy,
        metrics.clone(),
        FailurePolicy::Ignore,
        ReviewLimits::DEFAULT,
    ));
    let router = webhook::router(admission);
    for namespace in [
        "../kube-system",
        "team-a?watch=true",
        "a/b",
        "team-a#x",
        "team-a%2fb",
        "Team-A",
        "-a",
        &"a".repeat(64),
    ] {
        for path in ["/validate", "/mutate"] {
            let response = review_response(&router, path, &review(namespace, json!({}))).await;
            assert_eq!(response["allowed"], false, "{path} {namespace}: {response}");
            let message = response["status"]["message"].as_str().unwrap_or_default();
            assert!(
                message.contains("is not a DNS-1123 label"),
                "{path} {namespace}: {response}"
            );
        }
    }
    assert_eq!(connections.load(Ordering::SeqCst), 0);
    // A namespace that is a label is looked up (the stand-in fails it; Ignore admits).
    let response = review_response(&router, "/validate", &review("team-a", json!({}))).await;
    assert_eq!(response["allowed"], true, "{response}");
    assert!(connections.load(Ordering::SeqCst) > 0);
}
