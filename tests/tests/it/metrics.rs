//! `/metrics` of the real operator: every documented name is exposed, the values follow
//! Programs and Stacks as they are created, changed and deleted, and with
//! `--metrics-object-labels=none` no tenant's namespace or object name is exported.

use std::time::Duration;

use k8s_openapi::ByteString;
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::ConfigMap;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::MicroTime;
use kube::Api;
use kube::api::{DeleteParams, ObjectMeta, Patch, PatchParams, PostParams};
use pko_api::program::Program;
use pko_api::stack::Stack;
use pko_api::transform::ProgramTransform;
use pko_tests::fixtures::{self, config_map_program as program};
use pko_tests::operator::{Operator, OperatorOptions, metric_value};
use pko_tests::plugins::{module, shared_cache_dir};
use pko_tests::{ControlPlane, wait_for};
use serde_json::{Value, json};

const WAIT: Duration = Duration::from_secs(60);

/// Every metric family docs/operations.md lists, by the name in its `# TYPE` line.
const FAMILIES: &[&str] = &[
    "programs_active",
    "stacks_active",
    "stacks_failing",
    "stacks_reconciling",
    "stacks_drifted",
    "stacks_awaiting_approval",
    "pko_drift_check_duration_seconds",
    "workspaces_idle",
    "pko_workspace_wake_duration_seconds",
    "pko_leader",
    "pko_reconciles",
    "pko_reconcile_errors",
    "pko_reconcile_duration_seconds",
    "pko_fileserver_requests",
    "pko_fileserver_request_duration_seconds",
    "pko_fileserver_cache_hits",
    "pko_fileserver_cache_misses",
    "pko_fileserver_cache_bytes",
    // An info metric: `# TYPE pko_build info`, sample `pko_build_info{version=…} 1`.
    "pko_build",
    // PKO's controller-runtime, work-queue, REST-client and operator-lib families.
    "controller_runtime_reconcile",
    "controller_runtime_reconcile_errors",
    "controller_runtime_reconcile_panics",
    "controller_runtime_reconcile_time_seconds",
    "controller_runtime_max_concurrent_reconciles",
    "controller_runtime_active_workers",
    "workqueue_depth",
    "workqueue_adds",
    "workqueue_queue_duration_seconds",
    "workqueue_work_duration_seconds",
    "workqueue_unfinished_work_seconds",
    "workqueue_longest_running_processor_seconds",
    "workqueue_retries",
    "rest_client_requests",
    "rest_client_request_duration_seconds",
    "resource_created_at_seconds",
    // The process series of every Prometheus client.
    "process_cpu_seconds",
    "process_resident_memory_bytes",
    "process_virtual_memory_bytes",
    "process_open_fds",
    "process_max_fds",
    "process_start_time_seconds",
];

/// A Stack `name` for stack `dev/<name>`, which no operator here ever runs.
fn stack(name: &str) -> Stack {
    fixtures::stack(name, json!({"stack": format!("dev/{name}")}))
}

/// Waits until the sample `series` reads `want` (`None`: the series is absent).
async fn until_metric(op: &Operator, series: &str, want: Option<f64>) {
    let result = wait_for(&format!("{series} = {want:?}"), WAIT, || async {
        let text = op.metrics_text().await?;
        (metric_value(&text, series) == want).then_some(())
    })
    .await;
    if let Err(e) = result {
        panic!(
            "{e}; /metrics:\n{}",
            op.metrics_text().await.unwrap_or_default()
        );
    }
}

fn typed_families(text: &str) -> Vec<&str> {
    text.lines()
        .filter_map(|l| l.strip_prefix("# TYPE "))
        .filter_map(|l| l.split_whitespace().next())
        .collect()
}

#[tokio::test]
async fn metrics_follow_programs_reconciles_and_fetches() {
    let _machine = pko_tests::serial::shared().await;
    let plane = ControlPlane::shared().await;
    let ns = plane.namespace("metrics-prog").await.expect("namespace");
    let op = Operator::start(
        plane,
        OperatorOptions {
            advertised: None,
            args: vec![format!("--watch-namespace={ns}")],
        },
    )
    .await
    .expect("operator starts");

    let text = op.metrics_text().await.expect("/metrics answers");
    assert_eq!(metric_value(&text, "programs_active"), Some(0.0));
    // A controller's series exist at zero from its start, errors included.
    assert_eq!(
        metric_value(
            &text,
            "pko_reconcile_errors_total{controller=\"program\",error=\"status_write\"}"
        ),
        Some(0.0),
        "{text}"
    );
    assert_eq!(
        metric_value(&text, "pko_leader"),
        Some(1.0),
        "no election: leader"
    );
    assert_eq!(
        metric_value(
            &text,
            &format!(
                "pko_build_info{{version=\"{}\"}}",
                env!("CARGO_PKG_VERSION")
            )
        ),
        Some(1.0),
        "{text}"
    );

    let api: Api<Program> = Api::namespaced(plane.client(), &ns);
    for name in ["one", "two", "three"] {
        api.create(&PostParams::default(), &program(name))
            .await
            .expect("create");
    }
    until_metric(&op, "programs_active", Some(3.0)).await;
    // Each Program is reconciled at least once (and timed).
    wait_for("three reconciles", WAIT, || async {
        let text = op.metrics_text().await?;
        let runs = metric_value(&text, "pko_reconciles_total{controller=\"program\"}")?;
        let timed = metric_value(
            &text,
            "pko_reconcile_duration_seconds_count{controller=\"program\"}",
        )?;
        (runs >= 3.0 && timed >= 3.0).then_some(())
    })
    .await
    .expect("reconciles counted");
    // The same under PKO's names: successful reconciles of the program-controller, each one
    // an add to its work queue and a work item timed, nothing left queued or running.
    let controller = r#"{controller="program-controller"}"#;
    let queue = r#"{name="program-controller",controller="program-controller"}"#;
    wait_for("PKO's series of three reconciles", WAIT, || async {
        let text = op.metrics_text().await?;
        let value = |series: String| metric_value(&text, &series);
        let ok = value(
            r#"controller_runtime_reconcile_total{controller="program-controller",result="success"}"#
                .to_owned(),
        )? >= 3.0
            && value(format!("controller_runtime_reconcile_time_seconds_count{controller}"))?
                >= 3.0
            && value(format!("controller_runtime_reconcile_errors_total{controller}"))? == 0.0
            && value(format!("controller_runtime_active_workers{controller}"))? == 0.0
            && value(format!("controller_runtime_max_concurrent_reconciles{controller}"))?
                == 25.0
            && value(format!("workqueue_adds_total{queue}"))? >= 3.0
            && value(format!("workqueue_work_duration_seconds_count{queue}"))? >= 3.0
            && value(format!("workqueue_depth{queue}"))? == 0.0
            && value(format!("workqueue_unfinished_work_seconds{queue}"))? == 0.0;
        ok.then_some(())
    })
    .await
    .unwrap_or_else(|e| panic!("{e}"));

    // A fetch shows in the file-server series and is a cache hit (artifacts are pre-built).
    let before = op.metrics_text().await.expect("/metrics");
    let hits_before = metric_value(&before, "pko_fileserver_cache_hits_total").unwrap_or(0.0);
    let url = wait_for("the artifact URL of one", WAIT, || async {
        let status = serde_json::to_value(api.get("one").await.ok()?.status?).ok()?;
        Some(status.pointer("/artifact/url")?.as_str()?.to_owned())
    })
    .await
    .expect("artifact URL");
    let resp = reqwest::get(op.fs_url_of(&url)).await.expect("fetch");
    assert_eq!(resp.status(), 200);
    let missing = reqwest::get(op.fs_url(&format!("/programs/{ns}/nope/1")))
        .await
        .expect("fetch");
    assert_eq!(missing.status(), 404);
    let after = op.metrics_text().await.expect("/metrics");
    assert!(
        metric_value(
            &after,
            "pko_fileserver_requests_total{method=\"GET\",code=\"200\"}"
        )
        .unwrap_or(0.0)
            >= 1.0,
        "{after}"
    );
    assert!(
        metric_value(
            &after,
            "pko_fileserver_requests_total{method=\"GET\",code=\"404\"}"
        )
        .unwrap_or(0.0)
            >= 1.0,
        "{after}"
    );
    assert!(
        metric_value(&after, "pko_fileserver_request_duration_seconds_count").unwrap_or(0.0) >= 2.0
    );
    assert!(metric_value(&after, "pko_fileserver_cache_hits_total").unwrap_or(0.0) > hits_before);
    assert!(metric_value(&after, "pko_fileserver_cache_bytes").unwrap_or(0.0) > 0.0);

    api.delete("two", &DeleteParams::default())
        .await
        .expect("delete");
    until_metric(&op, "programs_active", Some(2.0)).await;
    api.delete("one", &DeleteParams::default())
        .await
        .expect("delete");
    until_metric(&op, "programs_active", Some(1.0)).await;

    // With a Stack around (per-Stack families have no series without one), every documented
    // family is exported.
    Api::<Stack>::namespaced(plane.client(), &ns)
        .create(&PostParams::default(), &stack("gamma"))
        .await
        .expect("create stack");
    until_metric(&op, "stacks_active", Some(1.0)).await;
    let text = op.metrics_text().await.expect("/metrics");
    let families = typed_families(&text);
    for family in FAMILIES {
        assert!(families.contains(family), "{family} missing:\n{text}");
    }

    // The process series say what the kernel says of the operator's process.
    let pid = op.pid().expect("the operator's pid");
    let proc_text = |file: &str| {
        std::fs::read_to_string(format!("/proc/{pid}/{file}")).expect("/proc of the operator")
    };
    let value = |series: &str| metric_value(&text, series).unwrap_or_else(|| panic!("{series}"));
    let vm_rss = proc_text("status")
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next()?.parse::<f64>().ok())
        .expect("VmRSS")
        * 1024.0;
    let rss = value("process_resident_memory_bytes");
    assert!(
        rss > vm_rss / 2.0 && rss < vm_rss * 2.0,
        "process_resident_memory_bytes {rss}, VmRSS {vm_rss}"
    );
    let fds = std::fs::read_dir(format!("/proc/{pid}/fd"))
        .expect("fds")
        .count() as f64;
    let open = value("process_open_fds");
    assert!(
        (open - fds).abs() <= 32.0,
        "process_open_fds {open}, /proc {fds}"
    );
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .expect("clock")
        .as_secs_f64();
    let started = value("process_start_time_seconds");
    assert!(
        started <= now + 1.0 && now - started < 3600.0,
        "process_start_time_seconds {started}, now {now}"
    );
    assert!(value("process_cpu_seconds_total") > 0.0, "{text}");
}

/// A Lease held for an hour by someone else: an operator started with election against it
/// stays a follower, so no controller touches the objects this test writes.
async fn foreign_lease(plane: &ControlPlane, ns: &str) {
    let lease: Lease = serde_json::from_value(json!({
        "apiVersion": "coordination.k8s.io/v1",
        "kind": "Lease",
        "metadata": {"name": "pko-rs-operator"},
        "spec": {
            "holderIdentity": "someone-else",
            "leaseDurationSeconds": 3600,
            "renewTime": MicroTime(k8s_openapi::jiff::Timestamp::now()),
        },
    }))
    .expect("lease");
    Api::<Lease>::namespaced(plane.client(), ns)
        .create(&PostParams::default(), &lease)
        .await
        .expect("create lease");
}

async fn set_stack_status(api: &Api<Stack>, name: &str, status: Value) {
    api.patch_status(
        name,
        &PatchParams::default(),
        &Patch::Merge(json!({ "status": status })),
    )
    .await
    .expect("patch stack status");
}

fn condition(type_: &str, status: &str) -> Value {
    json!({
        "type": type_,
        "status": status,
        "reason": "Test",
        "message": "set by the test",
        "lastTransitionTime": "2025-01-01T00:00:00Z",
    })
}

#[tokio::test]
async fn stack_gauges_follow_stacks_on_a_follower() {
    let _machine = pko_tests::serial::shared().await;
    let plane = ControlPlane::shared().await;
    let ns = plane.namespace("metrics-stack").await.expect("namespace");
    foreign_lease(plane, &ns).await;
    let op = Operator::start(
        plane,
        OperatorOptions {
            advertised: None,
            args: vec![
                format!("--watch-namespace={ns}"),
                "--leader-elect".into(),
                format!("--leader-election-namespace={ns}"),
            ],
        },
    )
    .await
    .expect("operator starts");
    // Ready although not leader: followers serve and report too.
    until_metric(&op, "pko_leader", Some(0.0)).await;
    until_metric(&op, "stacks_active", Some(0.0)).await;

    let api: Api<Stack> = Api::namespaced(plane.client(), &ns);
    for name in ["alpha", "beta"] {
        api.create(&PostParams::default(), &stack(name))
            .await
            .expect("create stack");
    }
    let failing = |name: &str| format!("stacks_failing{{namespace=\"{ns}\",name=\"{name}\"}}");
    let reconciling =
        |name: &str| format!("stacks_reconciling{{namespace=\"{ns}\",name=\"{name}\"}}");
    until_metric(&op, "stacks_active", Some(2.0)).await;
    until_metric(&op, &failing("alpha"), Some(0.0)).await;
    until_metric(&op, &reconciling("beta"), Some(0.0)).await;

    set_stack_status(
        &api,
        "alpha",
        json!({"lastUpdate": {"state": "failed", "generation": 1}}),
    )
    .await;
    until_metric(&op, &failing("alpha"), Some(1.0)).await;
    set_stack_status(
        &api,
        "beta",
        json!({"conditions": [condition("Ready", "False"), condition("Reconciling", "True")]}),
    )
    .await;
    until_metric(&op, &reconciling("beta"), Some(1.0)).await;
    set_stack_status(&api, "alpha", json!({"lastUpdate": {"state": "succeeded"}})).await;
    until_metric(&op, &failing("alpha"), Some(0.0)).await;

    // Deleting a Stack removes its series (PKO leaves them at 0 forever).
    api.delete("beta", &DeleteParams::default())
        .await
        .expect("delete stack");
    until_metric(&op, "stacks_active", Some(1.0)).await;
    until_metric(&op, &reconciling("beta"), None).await;
    until_metric(&op, &failing("beta"), None).await;

    // Programs are counted on followers too, but never reconciled there.
    Api::<Program>::namespaced(plane.client(), &ns)
        .create(&PostParams::default(), &program("p"))
        .await
        .expect("create program");
    until_metric(&op, "programs_active", Some(1.0)).await;
    // A negative check: the sleep is a guess, but a slow machine only makes it pass more easily
    // (the foreign lease keeps this replica a follower for the whole test).
    tokio::time::sleep(Duration::from_millis(500)).await;
    let text = op.metrics_text().await.expect("/metrics");
    assert_eq!(
        metric_value(&text, "pko_reconciles_total{controller=\"program\"}"),
        None,
        "a follower reconciled"
    );
}

/// A tenant's ProgramTransform running the `default_tags` module from a ConfigMap.
async fn tenant_transform(plane: &ControlPlane, ns: &str, name: &str) {
    let tags = module("default_tags").expect("module");
    let cm = ConfigMap {
        metadata: ObjectMeta {
            name: Some("plugins".into()),
            ..ObjectMeta::default()
        },
        binary_data: Some(
            [("tags.wasm".to_owned(), ByteString(tags.bytes.clone()))]
                .into_iter()
                .collect(),
        ),
        ..ConfigMap::default()
    };
    Api::<ConfigMap>::namespaced(plane.client(), ns)
        .create(&PostParams::default(), &cm)
        .await
        .expect("module ConfigMap");
    let transform: ProgramTransform = serde_json::from_value(json!({
        "apiVersion": "pko-rs.dev/v1alpha1",
        "kind": "ProgramTransform",
        "metadata": {"name": name},
        "spec": {
            "source": {"configMap": {"name": "plugins", "key": "tags.wasm"}},
            "sha256": tags.sha256,
            "config": {"tags": {"managed-by": "pko-rs"}, "targets": [{"typePrefix": "aws:"}]},
        },
    }))
    .expect("ProgramTransform");
    Api::<ProgramTransform>::namespaced(plane.client(), ns)
        .create(&PostParams::default(), &transform)
        .await
        .expect("create transform");
}

/// Waits until `/metrics` of `op` satisfies `pred`; returns that text.
async fn until_text(op: &Operator, what: &str, pred: impl Fn(&str) -> bool) -> String {
    let result = wait_for(what, WAIT, || async {
        let text = op.metrics_text().await?;
        pred(&text).then_some(text)
    })
    .await;
    match result {
        Ok(text) => text,
        Err(e) => panic!(
            "{e}; /metrics:\n{}",
            op.metrics_text().await.unwrap_or_default()
        ),
    }
}

#[tokio::test]
async fn without_object_labels_no_tenant_name_is_exported_and_the_counts_remain() {
    let _machine = pko_tests::serial::shared().await;
    let plane = ControlPlane::shared().await;
    let ns = plane.namespace("metrics-tenant").await.expect("namespace");
    // Both replicas stay followers: the Stack statuses below are the test's, not a controller's.
    foreign_lease(plane, &ns).await;
    let start = |labels: &'static str| {
        let ns = ns.clone();
        async move {
            Operator::start(
                plane,
                OperatorOptions {
                    advertised: None,
                    args: vec![
                        format!("--watch-namespace={ns}"),
                        "--leader-elect".into(),
                        format!("--leader-election-namespace={ns}"),
                        format!("--plugin-cache-dir={}", shared_cache_dir().display()),
                        format!("--metrics-object-labels={labels}"),
                    ],
                },
            )
            .await
            .expect("operator starts")
        }
    };
    let hidden = start("none").await;
    let named = start("names").await;

    let stacks: Api<Stack> = Api::namespaced(plane.client(), &ns);
    for name in ["acme-payroll", "acme-billing"] {
        stacks
            .create(&PostParams::default(), &stack(name))
            .await
            .expect("create stack");
    }
    set_stack_status(
        &stacks,
        "acme-payroll",
        json!({"lastUpdate": {"state": "failed", "generation": 1}}),
    )
    .await;
    set_stack_status(
        &stacks,
        "acme-billing",
        json!({"conditions": [condition("Ready", "False"), condition("Reconciling", "True")]}),
    )
    .await;
    tenant_transform(plane, &ns, "acme-secret-tags").await;

    // The counts say what the names would: two Stacks, one failing, one reconciling, and the
    // tenant's transform loaded and its configuration checked.
    let config_checked = "pko_plugin_calls_total{transform=\"ProgramTransform\",plugin=\"\",function=\"validate-config\",outcome=\"ok\"}";
    let text = until_text(&hidden, "counts without names", |text| {
        metric_value(text, "stacks_active") == Some(2.0)
            && metric_value(text, "stacks_failing") == Some(1.0)
            && metric_value(text, "stacks_reconciling") == Some(1.0)
            && metric_value(text, config_checked).is_some_and(|n| n >= 1.0)
    })
    .await;
    for name in [
        ns.as_str(),
        "acme-payroll",
        "acme-billing",
        "acme-secret-tags",
        "default-tags",
    ] {
        assert!(!text.contains(name), "{name} exported:\n{text}");
    }
    // operator-lib's creation time names each Stack: not exported at all.
    assert!(!text.contains("resource_created_at_seconds"), "{text}");

    // The same objects with names: PKO's per-Stack series and the transform's own.
    let transform = format!("transform=\"ProgramTransform/{ns}/acme-secret-tags\"");
    let text = until_text(&named, "series with names", |text| {
        metric_value(
            text,
            &format!("stacks_failing{{namespace=\"{ns}\",name=\"acme-payroll\"}}"),
        ) == Some(1.0)
            && metric_value(
                text,
                &format!("stacks_reconciling{{namespace=\"{ns}\",name=\"acme-billing\"}}"),
            ) == Some(1.0)
            && text.contains(&transform)
    })
    .await;
    assert!(text.contains("plugin=\"default-tags\""), "{text}");
    let created = format!(
        "resource_created_at_seconds{{name=\"acme-payroll\",namespace=\"{ns}\",group=\"pulumi.com\",version=\"v1\",kind=\"Stack\"}}"
    );
    let stack_created = stacks
        .get("acme-payroll")
        .await
        .expect("stack")
        .metadata
        .creation_timestamp
        .expect("created")
        .0
        .as_second();
    #[allow(clippy::cast_precision_loss, reason = "seconds since 1970")]
    let stack_created = stack_created as f64;
    assert_eq!(metric_value(&text, &created), Some(stack_created), "{text}");

    // A Stack deleted leaves the counts, as its series leave with names.
    stacks
        .delete("acme-payroll", &DeleteParams::default())
        .await
        .expect("delete stack");
    until_text(&hidden, "one Stack counted", |text| {
        metric_value(text, "stacks_active") == Some(1.0)
            && metric_value(text, "stacks_failing") == Some(0.0)
            && metric_value(text, "stacks_reconciling") == Some(1.0)
    })
    .await;
    until_text(&named, "the deleted Stack's creation time gone", |text| {
        metric_value(text, &created).is_none()
    })
    .await;
}

/// A service account `name` in `ns` and a token of it (TokenRequest, the apiserver's audience).
async fn service_account_token(plane: &ControlPlane, ns: &str, name: &str) -> String {
    use k8s_openapi::api::authentication::v1::{TokenRequest, TokenRequestSpec};
    use k8s_openapi::api::core::v1::ServiceAccount;
    let accounts: Api<ServiceAccount> = Api::namespaced(plane.client(), ns);
    let account: ServiceAccount =
        serde_json::from_value(json!({"metadata": {"name": name}})).expect("account");
    accounts
        .create(&PostParams::default(), &account)
        .await
        .expect("create service account");
    let request = TokenRequest {
        spec: TokenRequestSpec {
            audiences: vec![],
            expiration_seconds: Some(3600),
            ..TokenRequestSpec::default()
        },
        ..TokenRequest::default()
    };
    accounts
        .create_token_request(name, &PostParams::default(), &request)
        .await
        .expect("token request")
        .status
        .expect("token")
        .token
}

/// `--metrics-secure`: /metrics over HTTPS on its own address; no token is 401, a token the
/// apiserver does not know is 401, a service account without the reader role is 403 (named
/// in the body), one bound to it gets the metrics; plain HTTP gets nothing there, and the
/// probe listener does not serve /metrics.
#[tokio::test]
async fn secure_metrics_answer_authorized_scrapers_only() {
    use k8s_openapi::api::rbac::v1::{ClusterRole, ClusterRoleBinding};
    let _machine = pko_tests::serial::shared().await;
    let plane = ControlPlane::shared().await;
    let ns = plane.namespace("metrics-secure").await.expect("namespace");
    let reader = format!("pko-tests-metrics-reader-{ns}");
    let role: ClusterRole = serde_json::from_value(json!({
        "metadata": {"name": reader},
        "rules": [{"nonResourceURLs": ["/metrics"], "verbs": ["get"]}],
    }))
    .expect("role");
    let binding: ClusterRoleBinding = serde_json::from_value(json!({
        "metadata": {"name": reader},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": reader},
        "subjects": [{"kind": "ServiceAccount", "name": "scraper", "namespace": ns}],
    }))
    .expect("binding");
    let roles: Api<ClusterRole> = Api::all(plane.client());
    let bindings: Api<ClusterRoleBinding> = Api::all(plane.client());
    roles
        .create(&PostParams::default(), &role)
        .await
        .expect("role");
    bindings
        .create(&PostParams::default(), &binding)
        .await
        .expect("binding");
    let scraper = service_account_token(plane, &ns, "scraper").await;
    let stranger = service_account_token(plane, &ns, "stranger").await;

    let port = pko_tests::agent::free_port().expect("port");
    let op = Operator::start(
        plane,
        OperatorOptions {
            advertised: None,
            args: vec![
                format!("--watch-namespace={ns}"),
                format!("--metrics-bind-address=127.0.0.1:{port}"),
                "--metrics-secure".into(),
            ],
        },
    )
    .await
    .expect("operator starts");
    let client = reqwest::Client::builder()
        // The certificate is self-signed at start.
        .danger_accept_invalid_certs(true)
        .build()
        .expect("client");
    let url = format!("https://127.0.0.1:{port}/metrics");
    let get = |token: Option<String>| {
        let (client, url) = (client.clone(), url.clone());
        async move {
            let mut request = client.get(&url);
            if let Some(token) = token {
                request = request.bearer_auth(token);
            }
            let response = request.send().await.expect("HTTPS answer");
            let status = response.status().as_u16();
            (status, response.text().await.unwrap_or_default())
        }
    };

    let (status, body) = get(None).await;
    assert_eq!(status, 401, "{body}");
    assert!(body.contains("needs a bearer token"), "{body}");
    let (status, body) = get(Some("not-a-token".into())).await;
    assert_eq!(status, 401, "{body}");
    assert!(body.contains("not authenticated"), "{body}");
    let (status, body) = get(Some(stranger)).await;
    assert_eq!(status, 403, "{body}");
    assert!(
        body.contains(&format!("system:serviceaccount:{ns}:stranger"))
            && body.contains("may not get /metrics"),
        "{body}"
    );
    let (status, body) = get(Some(scraper.clone())).await;
    assert_eq!(status, 200, "{body}");
    assert!(
        body.contains("controller_runtime_reconcile_total{controller=\"program-controller\""),
        "{body}"
    );
    // A second scrape is answered from the cached decisions just the same.
    assert_eq!(get(Some(scraper)).await.0, 200);

    // Plain HTTP on the secure port is no way in; the probe listener has no /metrics.
    let plain = reqwest::get(format!("http://127.0.0.1:{port}/metrics")).await;
    assert!(
        !plain.as_ref().is_ok_and(|r| r.status().is_success()),
        "{plain:?}"
    );
    let probe = reqwest::get(op.probe_url("/metrics")).await.expect("probe");
    assert_eq!(probe.status().as_u16(), 404);

    let _ = bindings.delete(&reader, &DeleteParams::default()).await;
    let _ = roles.delete(&reader, &DeleteParams::default()).await;
}

/// `--metrics-secure` without a metrics address of its own is refused at start, saying why.
#[tokio::test]
async fn secure_metrics_need_their_own_address() {
    let _machine = pko_tests::serial::shared().await;
    let plane = ControlPlane::shared().await;
    let ns = plane
        .namespace("metrics-secure-addr")
        .await
        .expect("namespace");
    let started = Operator::start(
        plane,
        OperatorOptions {
            advertised: None,
            args: vec![format!("--watch-namespace={ns}"), "--metrics-secure".into()],
        },
    )
    .await;
    let Err(err) = started else {
        panic!("an operator with --metrics-secure and no metrics address started");
    };
    let text = format!("{err:?}");
    assert!(
        text.contains("--metrics-secure needs a --metrics-bind-address of its own"),
        "{text}"
    );
}
