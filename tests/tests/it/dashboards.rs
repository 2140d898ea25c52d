//! Queries PKO users run on their dashboards and alerts, evaluated by Prometheus's own PromQL
//! engine (promtool) over series scraped from a running operator that did real work: two
//! Programs (one whose status writes the apiserver answers with 500), a Stack whose `up`
//! succeeds and one whose `up` fails. Every query returns data, and its values follow what the
//! test did.

use std::time::Duration;

use k8s_openapi::api::admissionregistration::v1::ValidatingWebhookConfiguration;
use kube::Api;
use kube::api::{DeleteParams, PostParams};
use pko_api::program::Program;
use pko_api::stack::Stack;
use pko_tests::execution::Execution;
use pko_tests::operator::metric_value;
use pko_tests::promtool::{self, Scrapes};
use pko_tests::{fixtures, wait_for};
use serde_json::json;

const WAIT: Duration = Duration::from_secs(120);
/// Where the scrapes sit on promtool's timeline (any interval Prometheus could scrape at).
const INTERVAL: Duration = Duration::from_secs(60);

/// A validating webhook nobody serves, for `programs/status` writes of labelled Programs in
/// one namespace: the apiserver answers them 500 (failurePolicy Fail).
struct DeadWebhook {
    api: Api<ValidatingWebhookConfiguration>,
    name: String,
}

impl DeadWebhook {
    async fn install(client: kube::Client, ns: &str) -> Self {
        let name = format!("pko-tests-dead-{ns}");
        let config: ValidatingWebhookConfiguration = serde_json::from_value(json!({
            "apiVersion": "admissionregistration.k8s.io/v1",
            "kind": "ValidatingWebhookConfiguration",
            "metadata": {"name": name},
            "webhooks": [{
                "name": "dead.pko-tests.dev",
                // Port 1 on loopback: nothing listens, the call fails at once.
                "clientConfig": {"url": "https://127.0.0.1:1/never"},
                "rules": [{
                    "apiGroups": ["pulumi.com"], "apiVersions": ["*"],
                    "operations": ["UPDATE"], "resources": ["programs/status"],
                }],
                "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": ns}},
                "objectSelector": {"matchLabels": {"pko-tests/status-writes": "fail"}},
                "failurePolicy": "Fail",
                "sideEffects": "None",
                "admissionReviewVersions": ["v1"],
                "timeoutSeconds": 2,
            }],
        }))
        .expect("webhook configuration");
        let api: Api<ValidatingWebhookConfiguration> = Api::all(client);
        api.create(&PostParams::default(), &config)
            .await
            .expect("create the dead webhook");
        Self { api, name }
    }

    async fn remove(self) {
        let _ = self.api.delete(&self.name, &DeleteParams::default()).await;
    }
}

/// The apiserver's 5xx answers so far, as `rest_client_requests_total` counts them.
fn refused(text: &str) -> f64 {
    text.lines()
        .filter(|l| l.starts_with("rest_client_requests_total{code=\"5"))
        .filter_map(|l| l.rsplit_once(' ')?.1.parse::<f64>().ok())
        .sum()
}

#[tokio::test]
async fn pko_dashboard_and_alert_queries_return_data_from_pko_rs() {
    let _machine = pko_tests::serial::shared().await;
    let env = Execution::start("dash", &["--metrics-object-labels=names"]).await;
    let (plane, ns) = (env.plane, env.ns.clone());
    let op = &env.operator;
    let mut scrapes = Scrapes::new(&[("job", "pko-rs"), ("instance", "pko-rs-0")]);

    // 0: started, idle; every controller's series exist.
    let first = wait_for("the controllers' series", WAIT, || async {
        let text = op.metrics_text().await?;
        metric_value(
            &text,
            "controller_runtime_reconcile_total{controller=\"update-controller\",result=\"success\"}",
        )
        .map(|_| text)
    })
    .await
    .expect("controllers started");
    scrapes.add(&first);

    // The work: a Program whose status cannot be written (500 from the apiserver), a good one,
    // a Stack that deploys it and one whose `up` fails (its config names a missing file).
    // Its namespace selector keeps it harmless to other tests if this one fails before the end.
    let dead = DeadWebhook::install(plane.client(), &ns).await;
    let programs: Api<Program> = Api::namespaced(plane.client(), &ns);
    let mut broken = fixtures::config_map_program("broken");
    broken
        .metadata
        .labels
        .get_or_insert_default()
        .insert("pko-tests/status-writes".into(), "fail".into());
    programs
        .create(&PostParams::default(), &broken)
        .await
        .expect("broken program");
    programs
        .create(
            &PostParams::default(),
            &fixtures::program(
                "reader",
                json!({
                    "configuration": {"file": {"type": "String"}},
                    "variables": {"content": {"fn::readFile": "${file}"}},
                    "outputs": {"content": "${content}"},
                }),
            ),
        )
        .await
        .expect("reader program");
    let present = env.tmp.path().join("present.txt");
    std::fs::write(&present, "here\n").expect("file");
    let backend = env.tmp.path().join("backend");
    let stacks: Api<Stack> = Api::namespaced(plane.client(), &ns);
    for (name, file) in [
        ("ok", present.clone()),
        ("failing", env.tmp.path().join("missing.txt")),
    ] {
        stacks
            .create(
                &PostParams::default(),
                &fixtures::file_backend_stack(
                    name,
                    &backend,
                    json!({
                        "stack": "dev", "programRef": {"name": "reader"},
                        "config": {"file": file.display().to_string()},
                    }),
                ),
            )
            .await
            .expect("create stack");
    }
    // 1: the first refused writes. A counter's first sample is no increase to Prometheus, so
    // the rate needs a later scrape with more of them.
    let first_refusals = wait_for("the first refused status writes", WAIT, || async {
        let text = op.metrics_text().await?;
        (refused(&text) >= 1.0).then_some(text)
    })
    .await
    .expect("refused writes");
    scrapes.add(&first_refusals);
    // 2: one Stack Ready, one failed, the Program controller still retrying its refused writes.
    let settled = wait_for(
        "one Stack Ready, one failed, more refused writes",
        WAIT,
        || async {
            let ok = stacks.get("ok").await.ok()?.status?;
            let ready = ok
                .conditions
                .iter()
                .any(|c| c.type_ == "Ready" && c.status == "True");
            let failed = stacks
                .get("failing")
                .await
                .ok()?
                .status?
                .last_update
                .is_some_and(|u| u.state.as_deref() == Some("failed"));
            let text = op.metrics_text().await?;
            let errors = metric_value(
                &text,
                "controller_runtime_reconcile_errors_total{controller=\"program-controller\"}",
            )?;
            let more = refused(&text) > refused(&first_refusals);
            (ready && failed && more && errors >= 2.0).then_some(text)
        },
    )
    .await;
    let second = match settled {
        Ok(text) => text,
        Err(e) => panic!(
            "{e}\nok: {:?}\nfailing: {:?}\n{}",
            stacks.get("ok").await.ok().and_then(|s| s.status),
            stacks.get("failing").await.ok().and_then(|s| s.status),
            env.kubelet.logs("failing")
        ),
    };
    scrapes.add(&second);
    // 3: a last look, as a dashboard refreshed later would have.
    scrapes.add(&op.metrics_text().await.expect("/metrics"));

    let job = "job=\"pko-rs\"";
    let controllers = 4;
    let reconcile_rate =
        format!("sum by (controller) (rate(controller_runtime_reconcile_total{{{job}}}[5m]))");
    let error_rate = format!(
        "sum by (controller) (rate(controller_runtime_reconcile_errors_total{{{job}}}[5m]))"
    );
    let p99 = format!(
        "histogram_quantile(0.99, sum by (controller, le) (rate(controller_runtime_reconcile_time_seconds_bucket{{{job}}}[5m])))"
    );
    let depth = format!("sum by (name) (workqueue_depth{{{job}}})");
    let queue_p99 = format!(
        "histogram_quantile(0.99, sum by (name, le) (rate(workqueue_queue_duration_seconds_bucket{{{job}}}[5m])))"
    );
    let rest_5xx = format!("sum(rate(rest_client_requests_total{{{job},code=~\"5..\"}}[5m]))");
    let rest_all = format!("sum(rate(rest_client_requests_total{{{job}}}[5m]))");
    let checks: Vec<(&str, String)> = vec![
        // Reconcile rate per controller: every controller of PKO reconciled.
        (
            "reconciles per controller",
            format!("count({reconcile_rate} > 0) == bool {controllers}"),
        ),
        // Two Programs were created: at least two Program reconciles since the first scrape.
        (
            "program reconciles grew",
            format!(
                "sum(increase(controller_runtime_reconcile_total{{{job},controller=\"program-controller\"}}[5m])) >= bool 2"
            ),
        ),
        // Error rate: a series per controller (zero where nothing failed), and the refused
        // status writes show on the Program controller's.
        (
            "error rate per controller",
            format!("count({error_rate}) == bool {controllers}"),
        ),
        (
            "program errors",
            format!(
                "min(rate(controller_runtime_reconcile_errors_total{{{job},controller=\"program-controller\"}}[5m]) > bool 0)"
            ),
        ),
        (
            "error ratio alert",
            format!(
                "min(sum(rate(controller_runtime_reconcile_errors_total{{{job}}}[5m])) / sum(rate(controller_runtime_reconcile_total{{{job}}}[5m])) > bool 0)"
            ),
        ),
        // p99 reconcile time per controller: a number of seconds, within the buckets.
        (
            "p99 reconcile time",
            format!("count(({p99} > 0) and ({p99} <= 60)) == bool {controllers}"),
        ),
        // Work queues: one per controller, their depth a count, their adds following the work.
        (
            "work queue depth",
            format!("count({depth} >= 0) == bool {controllers}"),
        ),
        (
            "stack queue adds",
            format!(
                "sum(increase(workqueue_adds_total{{{job},name=\"stack-controller\"}}[5m])) >= bool 2"
            ),
        ),
        (
            "queue wait p99",
            format!("count({queue_p99} >= 0) == bool {controllers}"),
        ),
        (
            "retries",
            format!(
                "sum(increase(workqueue_retries_total{{{job},name=\"program-controller\"}}[5m])) > bool 0"
            ),
        ),
        (
            "workers",
            format!(
                "min(controller_runtime_max_concurrent_reconciles{{{job}}} >= bool controller_runtime_active_workers{{{job}}})"
            ),
        ),
        // PKO's failing-stack alert: exactly the Stack whose up failed.
        (
            "stacks failing",
            format!("sum(stacks_failing{{{job}}}) == bool 1"),
        ),
        (
            "the failing stack",
            format!("max(stacks_failing{{{job},name=\"failing\"}}) == bool 1"),
        ),
        (
            "the good stack",
            format!("max(stacks_failing{{{job},name=\"ok\"}}) == bool 0"),
        ),
        // REST client 5xx rate: the refused writes, a share of all requests.
        ("rest 5xx rate", format!("{rest_5xx} > bool 0")),
        (
            "rest 5xx ratio",
            format!("({rest_5xx} / {rest_all} > bool 0) * ({rest_5xx} / {rest_all} < bool 1)"),
        ),
        (
            "rest latency p99",
            format!(
                "count(histogram_quantile(0.99, sum by (verb, le) (rate(rest_client_request_duration_seconds_bucket{{{job}}}[5m]))) > 0) >= bool 2"
            ),
        ),
        // operator-lib's creation time, one per Stack.
        (
            "stack creation times",
            format!(
                "count(resource_created_at_seconds{{{job},group=\"pulumi.com\",version=\"v1\",kind=\"Stack\"}}) == bool 2"
            ),
        ),
    ];
    // The chart's alerts over the same scrapes: the failing Stack fires PkoRsStacksFailing;
    // the leader, several leaders and an absent operator stay quiet (their `for` aside).
    let panels = dashboard_exprs();
    let mut checks = checks;
    let alert = |name: &str| alert_expr(name);
    checks.push((
        "alert PkoRsStacksFailing",
        format!("count({}) == bool 1", alert("PkoRsStacksFailing")),
    ));
    for quiet in [
        "PkoRsNoLeader",
        "PkoRsSeveralLeaders",
        "PkoRsOperatorAbsent",
    ] {
        checks.push((quiet, format!("absent({})", alert(quiet))));
    }
    // Every panel of the chart's Grafana dashboard shows data (the admission panel aside: no
    // webhook runs here; tests/tests/it/admission.rs covers its series).
    for (title, expr) in &panels {
        if !expr.contains("pko_admission_") {
            checks.push((title.as_str(), format!("count({expr}) > bool 0")));
        }
    }
    dead.remove().await;
    if let Err(report) = promtool::check(&scrapes, INTERVAL, &checks) {
        panic!("{report}\nlast scrape:\n{second}");
    }
}

/// The expression of the chart's alert `name` (deploy/helm/pko-rs/files/prometheus-rules.yaml).
fn alert_expr(name: &str) -> String {
    let path = pko_tests::repo_root().join("deploy/helm/pko-rs/files/prometheus-rules.yaml");
    let text = std::fs::read_to_string(&path).expect("the chart's rules");
    let rules: serde_json::Value = yaml_serde::from_str(&text).expect("rules parse");
    rules["groups"]
        .as_array()
        .into_iter()
        .flatten()
        .flat_map(|g| g["rules"].as_array().into_iter().flatten())
        .find(|r| r["alert"] == name)
        .and_then(|r| r["expr"].as_str())
        .unwrap_or_else(|| panic!("no alert {name}"))
        .to_owned()
}

/// Every `(panel title, expr)` of the chart's Grafana dashboard.
fn dashboard_exprs() -> Vec<(String, String)> {
    let path = pko_tests::repo_root().join("deploy/helm/pko-rs/files/grafana-dashboard.json");
    let text = std::fs::read_to_string(&path).expect("the chart's dashboard");
    let dashboard: serde_json::Value = serde_json::from_str(&text).expect("dashboard JSON");
    let mut out = Vec::new();
    for panel in dashboard["panels"].as_array().expect("panels") {
        let title = panel["title"].as_str().unwrap_or("?");
        for target in panel["targets"].as_array().expect("targets") {
            let expr = target["expr"].as_str().expect("expr");
            out.push((title.to_owned(), expr.to_owned()));
        }
    }
    out
}
