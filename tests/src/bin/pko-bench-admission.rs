//! `make bench`, admission part: the latency the pko-rs webhook adds to a create, next to an
//! equivalent ValidatingAdmissionPolicy (CEL, evaluated inside the apiserver) on the same
//! apiserver, and the in-process cost of one policy evaluation.
//!
//! Writes its section into the benchmarks file (between its own markers, replacing an earlier
//! run's), so it can run after `pko-bench`, which rewrites the file.
#![allow(
    clippy::disallowed_methods,
    reason = "a test process is configured by its environment (make sets the tool and fixture paths)"
)]

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use k8s_openapi::api::admissionregistration::v1::{
    ValidatingAdmissionPolicy, ValidatingAdmissionPolicyBinding, ValidatingWebhookConfiguration,
};
use kube::api::{Api, DynamicObject, PostParams};
use kube::core::{ApiResource, GroupVersionKind};
use pko_admission::bundle::{Bundle, DECISION_ENTRYPOINT, DEFAULTS_ENTRYPOINT};
use pko_admission::engine::{EngineLimits, PolicyData, PolicyEngine};
use pko_admission::metrics::AdmissionMetrics;
use pko_admission::tenancy::{Tenancy, TenancySettings};
use pko_admission::webhook::{Admission, FailurePolicy, RequestData};
use pko_api::tenancy::{TenancyPolicy, TenancyPolicySpec};
use pko_tests::measure::{load_average, percentile};
use pko_tests::operator::{Operator, OperatorOptions};
use pko_tests::prom::{Histogram, Labels, scrape_sum};
use pko_tests::webhook::{Registration, WebhookOptions, free_port, policy_bundle};
use pko_tests::{ControlPlane, StartOptions, wait_for};
use serde_json::{Value, json};

const BEGIN: &str = "<!-- admission benchmarks: begin -->";
const END: &str = "<!-- admission benchmarks: end -->";
const VAP_LABEL: &str = "pko-bench.vap";

struct Args {
    out: PathBuf,
    rates: Vec<f64>,
    /// Seconds of load per row and rate, at least (see `min_creates`).
    seconds: f64,
    /// Creates per row and rate, at least: low rates run longer so a p99 means something.
    min_creates: f64,
    evaluations: usize,
    /// Whether to run the section that drives a real apiserver (`--apiserver false`: only the
    /// in-process evaluations).
    apiserver: bool,
}

fn parse_args() -> anyhow::Result<Args> {
    let mut args = Args {
        out: PathBuf::from("docs/benchmarks.md"),
        rates: vec![10.0, 50.0, 100.0, 200.0],
        seconds: 8.0,
        min_creates: 200.0,
        evaluations: 5000,
        apiserver: true,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let value = it.next().with_context(|| format!("{flag} needs a value"))?;
        match flag.as_str() {
            "--out" => args.out = PathBuf::from(value),
            "--rates" => args.rates = value.split(',').map(str::parse).collect::<Result<_, _>>()?,
            "--seconds" => args.seconds = value.parse()?,
            "--min-creates" => args.min_creates = value.parse()?,
            "--evaluations" => args.evaluations = value.parse()?,
            "--apiserver" => args.apiserver = value.parse()?,
            other => bail!("unknown flag {other}"),
        }
    }
    Ok(args)
}

/// A compliant Workspace with a pod template: every configuration admits it, after checking.
fn workspace(name: &str) -> Value {
    json!({
        "apiVersion": "auto.pulumi.com/v1alpha1",
        "kind": "Workspace",
        "metadata": {"name": name},
        "spec": {
            "image": "pulumi/pulumi:3.150.0-nonroot",
            "securityProfile": "restricted",
            "resources": {"requests": {"cpu": "100m", "memory": "64Mi"}},
            "podTemplate": {"spec": {
                "securityContext": {"runAsNonRoot": true, "seccompProfile": {"type": "RuntimeDefault"}},
                "containers": [{
                    "name": "pulumi",
                    "securityContext": {"allowPrivilegeEscalation": false, "capabilities": {"drop": ["ALL"]}},
                }],
            }},
        },
    })
}

fn workspaces(client: kube::Client, namespace: &str) -> Api<DynamicObject> {
    let resource = ApiResource::from_gvk_with_plural(
        &GroupVersionKind::gvk("auto.pulumi.com", "v1alpha1", "Workspace"),
        "workspaces",
    );
    Api::namespaced_with(client, namespace, &resource)
}

/// The restricted rules and the image allowance, as CEL in the apiserver.
async fn install_vap(plane: &ControlPlane) -> anyhow::Result<usize> {
    let pod = "object.spec.podTemplate.spec";
    let has_pod = "has(object.spec.podTemplate) && has(object.spec.podTemplate.spec)";
    let validations = vec![
        (
            "!has(object.spec.securityProfile) || object.spec.securityProfile != 'baseline'"
                .to_owned(),
            "baseline profile",
        ),
        (
            format!(
                "!({has_pod}) || !has({pod}.securityContext) || !has({pod}.securityContext.runAsNonRoot) || {pod}.securityContext.runAsNonRoot"
            ),
            "runAsNonRoot",
        ),
        (
            format!(
                "!({has_pod}) || !has({pod}.securityContext) || !has({pod}.securityContext.runAsUser) || {pod}.securityContext.runAsUser != 0"
            ),
            "runAsUser 0",
        ),
        (
            format!(
                "!({has_pod}) || {pod}.containers.all(c, has(c.securityContext) && has(c.securityContext.allowPrivilegeEscalation) && !c.securityContext.allowPrivilegeEscalation)"
            ),
            "allowPrivilegeEscalation",
        ),
        (
            format!(
                "!({has_pod}) || {pod}.containers.all(c, !has(c.securityContext) || !has(c.securityContext.privileged) || !c.securityContext.privileged)"
            ),
            "privileged",
        ),
        (
            format!(
                "!({has_pod}) || {pod}.containers.all(c, has(c.securityContext) && has(c.securityContext.capabilities) && has(c.securityContext.capabilities.drop) && 'ALL' in c.securityContext.capabilities.drop && (!has(c.securityContext.capabilities.add) || c.securityContext.capabilities.add.all(a, a == 'NET_BIND_SERVICE')))"
            ),
            "capabilities",
        ),
        (
            format!(
                "!({has_pod}) || !has({pod}.securityContext) || !has({pod}.securityContext.seccompProfile) || {pod}.securityContext.seccompProfile.type in ['RuntimeDefault', 'Localhost']"
            ),
            "seccomp",
        ),
        (
            format!(
                "!({has_pod}) || !has({pod}.volumes) || {pod}.volumes.all(v, !has(v.hostPath))"
            ),
            "hostPath",
        ),
        (
            format!(
                "!({has_pod}) || ((!has({pod}.hostNetwork) || !{pod}.hostNetwork) && (!has({pod}.hostPID) || !{pod}.hostPID) && (!has({pod}.hostIPC) || !{pod}.hostIPC))"
            ),
            "host namespaces",
        ),
        (
            "!has(object.spec.image) || object.spec.image.startsWith('pulumi/pulumi:')".to_owned(),
            "image",
        ),
    ];
    let count = validations.len();
    let policy: ValidatingAdmissionPolicy = serde_json::from_value(json!({
        "apiVersion": "admissionregistration.k8s.io/v1",
        "kind": "ValidatingAdmissionPolicy",
        "metadata": {"name": "pko-bench-restricted"},
        "spec": {
            "failurePolicy": "Fail",
            "matchConstraints": {"resourceRules": [{
                "apiGroups": ["auto.pulumi.com"],
                "apiVersions": ["*"],
                "operations": ["CREATE", "UPDATE"],
                "resources": ["workspaces"],
            }]},
            "validations": validations
                .iter()
                .map(|(expression, message)| json!({"expression": expression, "message": message}))
                .collect::<Vec<_>>(),
        },
    }))?;
    let binding: ValidatingAdmissionPolicyBinding = serde_json::from_value(json!({
        "apiVersion": "admissionregistration.k8s.io/v1",
        "kind": "ValidatingAdmissionPolicyBinding",
        "metadata": {"name": "pko-bench-restricted"},
        "spec": {
            "policyName": "pko-bench-restricted",
            "validationActions": ["Deny"],
            "matchResources": {"namespaceSelector": {"matchLabels": {VAP_LABEL: "true"}}},
        },
    }))?;
    let client = plane.try_client()?;
    Api::<ValidatingAdmissionPolicy>::all(client.clone())
        .create(&PostParams::default(), &policy)
        .await
        .context("creating the ValidatingAdmissionPolicy")?;
    Api::<ValidatingAdmissionPolicyBinding>::all(client)
        .create(&PostParams::default(), &binding)
        .await
        .context("creating the binding")?;
    Ok(count)
}

const FLOOR_LABEL: &str = "pko-bench.floor";

/// A webhook on the operator's own listener stack (axum-server, rustls, HTTP/2, the
/// connection caps) that reads the body and admits at once, echoing the uid: no parse beyond
/// the uid, no policy. What the apiserver measures for it is the cost of any webhook round
/// trip on this machine; it runs in the bench process.
async fn start_floor_webhook(
    plane: &ControlPlane,
) -> anyhow::Result<tokio::sync::oneshot::Sender<()>> {
    use pko_admission::tls::{Assessment, CertSettings, issue};
    let port = free_port()?;
    let settings = CertSettings::new("unused".into(), "unused".into(), vec!["127.0.0.1".into()]);
    let now = jiff::Timestamp::now().as_second();
    let certs = issue(None, &Assessment::RenewCa("first".into()), &settings, now)?;
    let tls = axum_server::tls_rustls::RustlsConfig::from_config(certs.server_config()?);
    let listener = pko_admission::server::bind(&format!("127.0.0.1:{port}"))?;
    let app = axum::Router::new().route(
        "/validate",
        axum::routing::post(|body: axum::body::Bytes| async move {
            #[derive(serde::Deserialize)]
            struct Head {
                request: Uid,
            }
            #[derive(serde::Deserialize)]
            struct Uid {
                uid: String,
            }
            let uid = serde_json::from_slice::<Head>(&body)
                .map(|h| h.request.uid)
                .unwrap_or_default();
            axum::Json(json!({
                "apiVersion": "admission.k8s.io/v1",
                "kind": "AdmissionReview",
                "response": {"uid": uid, "allowed": true},
            }))
        }),
    );
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    tokio::spawn(pko_admission::server::serve(
        listener,
        app,
        tls,
        pko_admission::server::Bounds::new(Duration::from_secs(1), 64),
        AdmissionMetrics::new(),
        async move {
            let _ = stopped.await;
        },
    ));
    let config: ValidatingWebhookConfiguration = serde_json::from_value(json!({
        "apiVersion": "admissionregistration.k8s.io/v1",
        "kind": "ValidatingWebhookConfiguration",
        "metadata": {"name": "pko-bench-floor"},
        "webhooks": [{
            "name": "floor.pko-bench.dev",
            "clientConfig": {
                "url": format!("https://127.0.0.1:{port}/validate"),
                "caBundle": base64::Engine::encode(
                    &base64::engine::general_purpose::STANDARD,
                    certs.ca_pem.as_bytes(),
                ),
            },
            "rules": [{
                "operations": ["CREATE", "UPDATE"],
                "apiGroups": ["auto.pulumi.com"],
                "apiVersions": ["*"],
                "resources": ["workspaces"],
                "scope": "Namespaced",
            }],
            "namespaceSelector": {"matchLabels": {FLOOR_LABEL: "true"}},
            "matchConditions": [{
                "name": "not-letting-go-of-a-deleted-object",
                "expression": pko_admission::MATCH_CONDITION,
            }],
            "failurePolicy": "Fail",
            "sideEffects": "None",
            "admissionReviewVersions": ["v1"],
            "timeoutSeconds": 10,
        }],
    }))?;
    Api::<ValidatingWebhookConfiguration>::all(plane.try_client()?)
        .create(&PostParams::default(), &config)
        .await
        .context("creating the floor webhook configuration")?;
    Ok(stop)
}

struct Load {
    latencies: Vec<Duration>,
    errors: usize,
    first_error: Option<String>,
    elapsed: Duration,
}

/// Creates Workspaces in `namespace` at `rate` per second for `seconds` (open loop: a create
/// starts on schedule whether or not earlier ones have finished).
async fn load(
    client: &kube::Client,
    namespace: &str,
    prefix: &str,
    rate: f64,
    seconds: f64,
) -> Load {
    let api = workspaces(client.clone(), namespace);
    let count = (rate * seconds).round() as usize;
    let interval = Duration::from_secs_f64(1.0 / rate);
    let start = tokio::time::Instant::now() + Duration::from_millis(50);
    let mut tasks = Vec::with_capacity(count);
    for i in 0..count {
        tokio::time::sleep_until(start + interval.mul_f64(i as f64)).await;
        let api = api.clone();
        let object: DynamicObject =
            match serde_json::from_value(workspace(&format!("{prefix}-{i}"))) {
                Ok(o) => o,
                Err(_) => continue,
            };
        tasks.push(tokio::spawn(async move {
            let began = Instant::now();
            let result = api.create(&PostParams::default(), &object).await;
            (began.elapsed(), result.err().map(|e| e.to_string()))
        }));
    }
    let mut out = Load {
        latencies: Vec::with_capacity(count),
        errors: 0,
        first_error: None,
        elapsed: Duration::ZERO,
    };
    for task in tasks {
        match task.await {
            Ok((latency, None)) => out.latencies.push(latency),
            Ok((_, Some(e))) => {
                out.errors += 1;
                out.first_error.get_or_insert(e);
            }
            Err(e) => {
                out.errors += 1;
                out.first_error.get_or_insert(e.to_string());
            }
        }
    }
    out.elapsed = start.elapsed();
    out.latencies.sort();
    out
}

fn ms(d: Duration) -> String {
    format!("{:.2} ms", d.as_secs_f64() * 1000.0)
}

fn us(d: Duration) -> String {
    format!("{:.0} µs", d.as_secs_f64() * 1_000_000.0)
}

fn signed_ms(a: Duration, b: Duration) -> String {
    let delta = a.as_secs_f64() - b.as_secs_f64();
    format!("{:+.2} ms", delta * 1000.0)
}

/// Times `n` sequential evaluations of `entrypoint` as the webhook runs them: a slot, the hop
/// to the blocking pool, and the evaluation on a pooled instance holding the prepared data.
async fn evaluate_pooled(
    engine: &PolicyEngine,
    entrypoint: &str,
    input: &Value,
    data: &Arc<PolicyData>,
    n: usize,
) -> anyhow::Result<Vec<Duration>> {
    for _ in 0..50 {
        engine.evaluate_with(entrypoint, input, data).await?;
    }
    let mut times = Vec::with_capacity(n);
    for _ in 0..n {
        let began = Instant::now();
        engine.evaluate_with(entrypoint, input, data).await?;
        times.push(began.elapsed());
    }
    times.sort();
    Ok(times)
}

/// Times `n` evaluations on a fresh instance each (instantiate + load data + evaluate).
async fn evaluate_fresh(
    engine: &PolicyEngine,
    entrypoint: &str,
    input: &Value,
    data: &Value,
    n: usize,
) -> anyhow::Result<Vec<Duration>> {
    for _ in 0..10 {
        engine.evaluate(entrypoint, input, data).await?;
    }
    let mut times = Vec::with_capacity(n);
    for _ in 0..n {
        let began = Instant::now();
        engine.evaluate(entrypoint, input, data).await?;
        times.push(began.elapsed());
    }
    times.sort();
    Ok(times)
}

/// Times `n` evaluations on the blocking thread alone (no slot, no hop), in batches of one
/// slot each.
async fn evaluate_in_thread(
    engine: &PolicyEngine,
    entrypoint: &'static str,
    input: &Value,
    data: &Arc<PolicyData>,
    n: usize,
) -> anyhow::Result<Vec<Duration>> {
    let mut times = Vec::with_capacity(n);
    while times.len() < n {
        let batch = (n - times.len()).min(500);
        let slot = engine.slot(Instant::now()).await?;
        let (input, data) = (input.clone(), data.clone());
        let batch_times = slot
            .run(move |evaluator| {
                let mut out = Vec::with_capacity(batch);
                for _ in 0..batch {
                    let began = Instant::now();
                    evaluator.evaluate(entrypoint, &input, &data)?;
                    out.push(began.elapsed());
                }
                Ok::<_, pko_admission::engine::EngineError>(out)
            })
            .await??;
        times.extend(batch_times);
    }
    times.sort();
    Ok(times)
}

/// Times `n` runs of `f`.
fn time_n(n: usize, mut f: impl FnMut()) -> Vec<Duration> {
    let mut times: Vec<Duration> = (0..n)
        .map(|_| {
            let began = Instant::now();
            f();
            began.elapsed()
        })
        .collect();
    times.sort();
    times
}

fn row(section: &mut String, name: &str, times: &[Duration]) -> std::fmt::Result {
    writeln!(
        section,
        "| {name} | {} | {} | {} |",
        us(percentile(times, 0.50)),
        us(percentile(times, 0.99)),
        us(percentile(times, 1.0))
    )
}

/// The in-process section: start-up cost, then evaluations as the webhook runs them, with
/// where their time goes.
async fn in_process(
    section: &mut String,
    args: &Args,
    bundle: &Bundle,
    engine: &PolicyEngine,
    compile: Duration,
) -> anyhow::Result<()> {
    let n = args.evaluations;
    let input = review("team-a");
    let policy = TenancyPolicy::new(
        "team-a",
        TenancyPolicySpec {
            namespaces: Some(vec!["team-a".into()]),
            allowed_service_accounts: Some(vec!["pulumi".into()]),
            allowed_image_prefixes: Some(vec!["pulumi/pulumi:".into()]),
            ..TenancyPolicySpec::default()
        },
    );
    let mut settings = TenancySettings::default();
    settings
        .file_server
        .add("pko-rs-fileserver.pko-rs-system".into(), Some(80));
    let admission = Admission::new(
        engine.clone(),
        Tenancy::fixed(vec![policy], BTreeMap::new(), settings),
        AdmissionMetrics::new(),
        FailurePolicy::Fail,
    );
    let RequestData::Shared(data) = admission.data_for("team-a").await? else {
        bail!("the shared document does not cover team-a");
    };
    let decision = evaluate_pooled(engine, DECISION_ENTRYPOINT, &input, &data, n).await?;
    let defaults = evaluate_pooled(engine, DEFAULTS_ENTRYPOINT, &input, &data, n).await?;
    let fresh_n = n.min(500);
    let fresh = evaluate_fresh(engine, DECISION_ENTRYPOINT, &input, data.value(), fresh_n).await?;
    let in_thread = evaluate_in_thread(engine, DECISION_ENTRYPOINT, &input, &data, n).await?;
    let hop = {
        let mut times = Vec::with_capacity(n);
        for _ in 0..n {
            let began = Instant::now();
            engine.slot(Instant::now()).await?.run(|_| ()).await?;
            times.push(began.elapsed());
        }
        times.sort();
        times
    };
    let mut data_times = Vec::with_capacity(n);
    for _ in 0..n {
        let began = Instant::now();
        let _ = admission.data_for("team-a").await?;
        data_times.push(began.elapsed());
    }
    data_times.sort();
    let result = engine
        .evaluate_with(DECISION_ENTRYPOINT, &input, &data)
        .await?;
    let result_set = serde_json::to_vec(&json!([{ "result": result }]))?;
    let encode = time_n(n, || {
        let _ = serde_json::to_vec(&input);
    });
    let decode = time_n(n, || {
        let _ = serde_json::from_slice::<Value>(&result_set);
    });
    // Start-up again, on its own: compile the module and load one instance.
    let again = Instant::now();
    PolicyEngine::new(bundle, EngineLimits::default())
        .await?
        .close();
    let compile_again = again.elapsed();

    writeln!(section, "## Admission policies: in-process evaluation\n")?;
    writeln!(
        section,
        "opa-wasm on wasmtime. `PolicyEngine::new` (compile the {} KiB policy module, load one \
         instance): {} (again: {}). {n} sequential evaluations of a compliant Workspace with a \
         pod template in a namespace one TenancyPolicy selects, as the webhook runs them: a \
         slot, the hop to the blocking pool, a pooled instance that holds the shared data \
         document (the heap is reset to the mark after the data by `opa_eval`). Load \
         average: {}.\n",
        bundle.wasm.len() / 1024,
        ms(compile),
        ms(compile_again),
        load_average()
    )?;
    writeln!(section, "| evaluation | p50 | p99 | max |")?;
    writeln!(section, "|---|---:|---:|---:|")?;
    row(section, &format!("`{DECISION_ENTRYPOINT}`"), &decision)?;
    row(section, &format!("`{DEFAULTS_ENTRYPOINT}`"), &defaults)?;
    row(
        section,
        &format!("`{DECISION_ENTRYPOINT}`, fresh instance each ({fresh_n} runs)"),
        &fresh,
    )?;
    writeln!(section)?;
    writeln!(
        section,
        "Where the time of a `{DECISION_ENTRYPOINT}` evaluation goes:\n"
    )?;
    writeln!(section, "| part | p50 | p99 | max |")?;
    writeln!(section, "|---|---:|---:|---:|")?;
    row(
        section,
        "data: the shared document for the namespace",
        &data_times,
    )?;
    row(section, "slot + hop to the blocking pool and back", &hop)?;
    row(
        section,
        "evaluation on the pooled instance (in its thread)",
        &in_thread,
    )?;
    row(section, "… of which: input to JSON (host)", &encode)?;
    row(section, "… of which: result from JSON (host)", &decode)?;
    writeln!(section)?;
    Ok(())
}

fn review(namespace: &str) -> Value {
    let mut object = workspace("w");
    object["metadata"]["namespace"] = json!(namespace);
    pko_tests::webhook::workspace_review(namespace, object)
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let _ = rustls::crypto::ring::default_provider().install_default();
    let args = parse_args()?;
    let bundle_path = policy_bundle()?;
    let mut section = String::new();
    writeln!(section, "{BEGIN}")?;

    // In-process evaluation.
    let bundle = Bundle::load(&bundle_path)?;
    let compile_started = Instant::now();
    let engine = PolicyEngine::new(&bundle, EngineLimits::default()).await?;
    let compile = compile_started.elapsed();
    in_process(&mut section, &args, &bundle, &engine, compile).await?;
    engine.close();
    drop(engine);
    if !args.apiserver {
        writeln!(section, "{END}")?;
        write_section(&args.out, &section)?;
        println!("{section}");
        return Ok(());
    }

    // Latency added to a create on a real apiserver.
    // A private plane in a temporary folder of its own, removed when it stops.
    let plane = ControlPlane::start(StartOptions::default()).await?;
    let port = free_port()?;
    let validate_only = Registration::create_on(
        &plane,
        "bench-validate",
        port,
        WebhookOptions {
            mutating: false,
            ..WebhookOptions::default()
        },
    )
    .await?;
    let both =
        Registration::create_on(&plane, "bench-both", port, WebhookOptions::default()).await?;
    let mut operator_args = validate_only.operator_args(&bundle_path);
    operator_args.retain(|a| {
        !a.starts_with("--webhook-validating-configuration=")
            && !a.starts_with("--webhook-mutating-configuration=")
    });
    operator_args.push(format!(
        "--webhook-validating-configuration={},{}",
        validate_only.validating, both.validating
    ));
    operator_args.push(format!(
        "--webhook-mutating-configuration={}",
        both.mutating.clone().unwrap_or_default()
    ));
    let operator = Operator::start(
        &plane,
        OperatorOptions {
            advertised: None,
            args: operator_args,
        },
    )
    .await?;
    validate_only
        .wait_ca_injected(&plane, Duration::from_secs(60))
        .await?;
    both.wait_ca_injected(&plane, Duration::from_secs(60))
        .await?;
    let rules = install_vap(&plane).await?;
    let _floor = start_floor_webhook(&plane).await?;

    let none = plane.namespace("bench-none").await?;
    let vap = plane.namespace("bench-vap").await?;
    let validate = plane.namespace("bench-validate").await?;
    let mutate = plane.namespace("bench-both").await?;
    let floor = plane.namespace("bench-floor").await?;
    pko_tests::webhook::set_namespace_labels(
        &plane,
        &floor,
        [(FLOOR_LABEL.to_owned(), "true".to_owned())].into(),
    )
    .await?;
    pko_tests::webhook::set_namespace_labels(
        &plane,
        &vap,
        [(VAP_LABEL.to_owned(), "true".to_owned())].into(),
    )
    .await?;
    validate_only.enroll(&plane, &validate, &[]).await?;
    both.enroll(&plane, &mutate, &[]).await?;

    let client = plane.try_client()?;
    // Every path is live before measuring: a refused baseline Workspace proves the check runs.
    for ns in [&vap, &validate, &mutate] {
        let api = workspaces(client.clone(), ns);
        let mut bad = workspace("probe");
        bad["spec"]["securityProfile"] = json!("baseline");
        let bad: DynamicObject = serde_json::from_value(bad)?;
        wait_for(
            &format!("admission checks in {ns}"),
            Duration::from_secs(60),
            || {
                let (api, bad) = (api.clone(), bad.clone());
                async move {
                    let dry = PostParams {
                        dry_run: true,
                        ..PostParams::default()
                    };
                    api.create(&dry, &bad).await.is_err().then_some(())
                }
            },
        )
        .await?;
    }

    let configs: [(&str, &String); 5] = [
        ("no admission check", &none),
        ("ValidatingAdmissionPolicy (CEL, in the apiserver)", &vap),
        (
            "webhook that admits at once (same listener, no policy)",
            &floor,
        ),
        ("pko-rs webhook: `/validate`", &validate),
        ("pko-rs webhook: `/mutate` + `/validate`", &mutate),
    ];
    // Warm connections and caches in every path first.
    let warm_rate = args.rates.iter().copied().fold(10.0, f64::max);
    for (i, (_, ns)) in configs.iter().enumerate() {
        let _ = load(&client, ns, &format!("warm{i}"), warm_rate, 1.0).await;
    }
    describe_metrics(&client).await;
    writeln!(section, "## Admission: latency added to a create\n")?;
    writeln!(
        section,
        "Workspace creates (a compliant Workspace with a pod template, stored in etcd), open \
         loop, from one client on the same machine, {ROUNDS} interleaved rounds per rate so every \
         row sees the same mix of machine load; each row its own namespace on the same \
         apiserver. The ValidatingAdmissionPolicy has {rules} CEL validations: the restricted \
         rules and the image allowance, like the Rego policies. The pko-rs rows call the release \
         operator over TLS (`clientConfig.url` on loopback); the mutating row also stores the \
         defaults. The client, kube-apiserver, etcd and the operator share the machine's cores \
         (and, on the project's machine, other builds: see the load average).\n\n\
         Each rate has three tables: the client's latencies; the apiserver's own histograms \
         (its `/metrics` scraped before and after every row's run; p50/p99 are interpolated \
         inside the apiserver's buckets, which are coarse: the webhook histogram has bounds \
         5, 25, 100, 500 ms…, so a value under 5 ms reads as a fraction \
         of 5 ms; the mean, from `_sum`/`_count`, is exact); and the operator's own account of \
         each webhook request (`pko_admission_request_phase_duration_seconds`, \
         `pko_admission_tls_handshakes_total`), mean per request.\n"
    )?;
    for (r, &rate) in args.rates.iter().enumerate() {
        let seconds = args.seconds.max(args.min_creates / rate);
        let (rows, before, after) = measure(
            &client,
            &operator,
            &configs,
            rate,
            seconds,
            &format!("rate{r}"),
        )
        .await;
        writeln!(
            section,
            "### {rate:.0} creates/s, {seconds:.0} s per row (load average {before} → {after})\n"
        )?;
        table(&mut section, &rows)?;
        apiserver_table(&mut section, &rows)?;
        operator_table(&mut section, &rows)?;
    }
    let metrics = operator.metrics_text().await.unwrap_or_default();
    let sum = |prefix: &str| -> f64 {
        metrics
            .lines()
            .filter(|l| l.starts_with(prefix))
            .filter_map(|l| l.rsplit_once(' ').and_then(|(_, v)| v.parse::<f64>().ok()))
            .fold(0.0, |a, b| a + b)
    };
    writeln!(
        section,
        "The operator evaluated the decision policy {:.0} times in this run, with {:.0} \
         evaluation errors (`pko_admission_evaluation_duration_seconds`, \
         `pko_admission_evaluation_errors_total`).\n",
        sum(
            "pko_admission_evaluation_duration_seconds_count{entrypoint=\"pko/admission/decision\"}"
        ),
        sum("pko_admission_evaluation_errors_total"),
    )?;
    writeln!(section, "{END}")?;
    write_section(&args.out, &section)?;
    println!("{section}");
    Ok(())
}

const ROUNDS: usize = 5;

/// One row's results at one rate: the client's latencies and what the apiserver and the
/// operator recorded meanwhile.
struct Row<'a> {
    name: &'a str,
    load: Load,
    reading: Reading,
}

/// Runs every configuration at `rate` for `seconds` in total, in interleaved rounds, scraping
/// the apiserver's and the operator's metrics between runs. Returns the rows and the load
/// average before and after.
async fn measure<'a>(
    client: &kube::Client,
    operator: &Operator,
    configs: &[(&'a str, &String)],
    rate: f64,
    seconds: f64,
    tag: &str,
) -> (Vec<Row<'a>>, String, String) {
    let mut rows: Vec<Row<'a>> = configs
        .iter()
        .map(|(name, _)| Row {
            name,
            load: Load {
                latencies: Vec::new(),
                errors: 0,
                first_error: None,
                elapsed: Duration::ZERO,
            },
            reading: Reading::default(),
        })
        .collect();
    let before = load_average();
    let mut last = Reading::scrape(client, operator).await;
    for round in 0..ROUNDS {
        for (i, (_, ns)) in configs.iter().enumerate() {
            let prefix = format!("{tag}-r{round}-w{i}");
            let result = load(client, ns, &prefix, rate, seconds / ROUNDS as f64).await;
            let now = Reading::scrape(client, operator).await;
            let row = &mut rows[i];
            row.reading.add(&now.since(&last));
            last = now;
            row.load.latencies.extend(result.latencies);
            row.load.errors += result.errors;
            row.load.elapsed += result.elapsed;
            if row.load.first_error.is_none() {
                row.load.first_error = result.first_error;
            }
        }
    }
    let after = load_average();
    for row in &mut rows {
        row.load.latencies.sort();
        if let Some(e) = &row.load.first_error {
            eprintln!("{}: first error: {e}", row.name);
        }
    }
    (rows, before, after)
}

/// The webhook request phases the operator records, in the order they happen.
const PHASES: [&str; 8] = [
    "read", "slot", "parse", "data", "eval", "hop", "respond", "total",
];

/// What one scrape of the apiserver's and the operator's metrics holds (or the difference of
/// two scrapes).
#[derive(Clone, Debug, Default)]
struct Reading {
    histograms: BTreeMap<String, Histogram>,
    counters: BTreeMap<String, f64>,
}

impl Reading {
    async fn scrape(client: &kube::Client, operator: &Operator) -> Reading {
        let api = apiserver_metrics(client).await;
        let op = operator.metrics_text().await.unwrap_or_default();
        let mut out = Reading::default();
        let mut histogram =
            |key: &str, text: &str, family: &str, keep: &dyn Fn(&Labels) -> bool| {
                out.histograms
                    .insert(key.to_owned(), Histogram::scrape(text, family, keep));
            };
        histogram("create", &api, "apiserver_request_duration_seconds", &|l| {
            l.is("verb", "POST") && l.is("resource", "workspaces")
        });
        for (key, kind) in [
            ("webhook/mutate", "admit"),
            ("webhook/validate", "validating"),
        ] {
            histogram(
                key,
                &api,
                "apiserver_admission_webhook_admission_duration_seconds",
                &|l| {
                    l.is("type", kind)
                        && l.is("operation", "CREATE")
                        && l.get("name") != Some("floor.pko-bench.dev")
                },
            );
        }
        histogram(
            "webhook/floor",
            &api,
            "apiserver_admission_webhook_admission_duration_seconds",
            &|l| l.is("name", "floor.pko-bench.dev") && l.is("operation", "CREATE"),
        );
        histogram(
            "vap",
            &api,
            "apiserver_validating_admission_policy_check_duration_seconds",
            &|l| l.is("policy", "pko-bench-restricted"),
        );
        for webhook in ["validate", "mutate"] {
            for phase in PHASES {
                histogram(
                    &format!("{webhook}/{phase}"),
                    &op,
                    "pko_admission_request_phase_duration_seconds",
                    &|l| l.is("webhook", webhook) && l.is("phase", phase),
                );
            }
        }
        let mut counter = |key: &str, value: f64| {
            out.counters.insert(key.to_owned(), value);
        };
        counter(
            "handshakes",
            scrape_sum(&op, "pko_admission_tls_handshakes_total", |_| true),
        );
        for version in ["HTTP/1.1", "HTTP/2.0"] {
            counter(
                version,
                scrape_sum(&op, "pko_admission_requests_total", |l| {
                    l.is("version", version)
                }),
            );
        }
        out
    }

    fn since(&self, before: &Reading) -> Reading {
        Reading {
            histograms: self
                .histograms
                .iter()
                .map(|(k, h)| {
                    let delta = before
                        .histograms
                        .get(k)
                        .map_or_else(|| h.clone(), |b| h.since(b));
                    (k.clone(), delta)
                })
                .collect(),
            counters: self
                .counters
                .iter()
                .map(|(k, v)| {
                    (
                        k.clone(),
                        v - before.counters.get(k).copied().unwrap_or(0.0),
                    )
                })
                .collect(),
        }
    }

    fn add(&mut self, other: &Reading) {
        for (k, h) in &other.histograms {
            self.histograms.entry(k.clone()).or_default().add(h);
        }
        for (k, v) in &other.counters {
            *self.counters.entry(k.clone()).or_default() += v;
        }
    }

    fn histogram(&self, key: &str) -> Histogram {
        self.histograms.get(key).cloned().unwrap_or_default()
    }

    fn counter(&self, key: &str) -> f64 {
        self.counters.get(key).copied().unwrap_or(0.0)
    }
}

/// The apiserver's `/metrics` (the harness's admin credentials may read it), or nothing.
async fn apiserver_metrics(client: &kube::Client) -> String {
    let request = match http::Request::get("/metrics").body(Vec::new()) {
        Ok(request) => request,
        Err(e) => {
            eprintln!("cannot build the /metrics request: {e}");
            return String::new();
        }
    };
    match client.request_text(request).await {
        Ok(text) => text,
        Err(e) => {
            eprintln!("cannot scrape the apiserver's /metrics: {e}");
            String::new()
        }
    }
}

/// Lists the admission histograms the apiserver exposes (on stderr): which ones exist
/// depends on its version.
async fn describe_metrics(client: &kube::Client) {
    let text = apiserver_metrics(client).await;
    for line in text.lines() {
        if let Some(help) = line.strip_prefix("# HELP ")
            && (help.starts_with("apiserver_admission")
                || help.starts_with("apiserver_validating_admission_policy"))
        {
            eprintln!("apiserver metric: {help}");
        }
    }
}

fn table(section: &mut String, rows: &[Row<'_>]) -> std::fmt::Result {
    let base = &rows[0].load.latencies;
    let (base50, base99) = (percentile(base, 0.50), percentile(base, 0.99));
    writeln!(section, "The client's view:\n")?;
    writeln!(
        section,
        "| admission | creates | errors | achieved/s | p50 | p99 | max | p50 vs none | p99 vs none |"
    )?;
    writeln!(section, "|---|---:|---:|---:|---:|---:|---:|---:|---:|")?;
    for row in rows {
        let result = &row.load;
        let (p50, p99) = (
            percentile(&result.latencies, 0.50),
            percentile(&result.latencies, 0.99),
        );
        writeln!(
            section,
            "| {} | {} | {} | {:.0} | {} | {} | {} | {} | {} |",
            row.name,
            result.latencies.len() + result.errors,
            result.errors,
            (result.latencies.len() + result.errors) as f64 / result.elapsed.as_secs_f64(),
            ms(p50),
            ms(p99),
            ms(percentile(&result.latencies, 1.0)),
            signed_ms(p50, base50),
            signed_ms(p99, base99),
        )?;
    }
    writeln!(section)
}

/// Seconds as milliseconds, or `-` for nothing observed.
fn ms_or_dash(seconds: Option<f64>) -> String {
    seconds.map_or_else(|| "-".to_owned(), |s| format!("{:.2} ms", s * 1000.0))
}

/// A bucket-interpolated quantile with the bound of its bucket.
fn quantile_ms(h: &Histogram, q: f64) -> String {
    match h.quantile(q) {
        Some((value, bound)) => format!("{:.2} ms (≤ {:.0})", value * 1000.0, bound * 1000.0),
        None => "-".to_owned(),
    }
}

/// The apiserver's histograms per row: the create as the apiserver timed it, and the check
/// itself (the VAP's CEL, or the webhook call).
fn apiserver_table(section: &mut String, rows: &[Row<'_>]) -> std::fmt::Result {
    writeln!(
        section,
        "The apiserver's view (its histograms; quantiles bucket-interpolated, bucket bound in \
         ms in brackets):\n"
    )?;
    writeln!(
        section,
        "| admission | create: mean | create: p50 | create: p99 | check | calls | check: mean | check: p50 | check: p99 |"
    )?;
    writeln!(section, "|---|---:|---:|---:|---|---:|---:|---:|---:|")?;
    for row in rows {
        let r = &row.reading;
        let create = r.histogram("create");
        let mut checks = Vec::new();
        if r.histogram("vap").count() > 0.0 {
            checks.push(("CEL policy check", r.histogram("vap")));
        }
        if r.histogram("webhook/floor").count() > 0.0 {
            checks.push(("webhook call", r.histogram("webhook/floor")));
        }
        if r.histogram("webhook/mutate").count() > 0.0 {
            checks.push(("`/mutate` call", r.histogram("webhook/mutate")));
        }
        if r.histogram("webhook/validate").count() > 0.0 {
            checks.push(("`/validate` call", r.histogram("webhook/validate")));
        }
        if checks.is_empty() {
            checks.push(("-", Histogram::default()));
        }
        for (i, (check, h)) in checks.iter().enumerate() {
            let head = if i == 0 {
                format!(
                    "{} | {} | {} | {}",
                    row.name,
                    ms_or_dash(create.mean()),
                    quantile_ms(&create, 0.50),
                    quantile_ms(&create, 0.99),
                )
            } else {
                "″ | | | ".to_owned()
            };
            writeln!(
                section,
                "| {head} | {check} | {:.0} | {} | {} | {} |",
                h.count(),
                ms_or_dash(h.mean()),
                quantile_ms(h, 0.50),
                quantile_ms(h, 0.99),
            )?;
        }
    }
    writeln!(section)
}

/// The operator's account of the webhook rows: new TLS connections, the protocol, and the
/// mean time per request of each phase of the handler, next to the apiserver's mean.
fn operator_table(section: &mut String, rows: &[Row<'_>]) -> std::fmt::Result {
    writeln!(
        section,
        "The operator's view of the webhook rows (mean µs per request; `hop`: to the \
         evaluation thread and back, twice per request; `total`: the handler; `outside`: the \
         apiserver's mean for the call minus the handler's, i.e. TLS, HTTP/2 framing, the \
         apiserver's encoding and decoding of the review, and waiting to be scheduled):\n"
    )?;
    writeln!(
        section,
        "| row | call | requests | HTTP/2 | new TLS connections | read | slot | parse | data | eval | hop | respond | total | total p99 | apiserver mean | outside |"
    )?;
    writeln!(
        section,
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
    )?;
    for row in rows {
        let r = &row.reading;
        for (webhook, apiserver) in [
            ("mutate", "webhook/mutate"),
            ("validate", "webhook/validate"),
        ] {
            let total = r.histogram(&format!("{webhook}/total"));
            let requests = total.count();
            if requests == 0.0 {
                continue;
            }
            let per_request = |phase: &str| {
                let h = r.histogram(&format!("{webhook}/{phase}"));
                format!("{:.0}", h.sum / requests * 1e6)
            };
            let api_mean = r.histogram(apiserver).mean();
            let total_mean = total.sum / requests;
            writeln!(
                section,
                "| {} | `/{webhook}` | {requests:.0} | {:.0} | {:.0} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} |",
                row.name,
                r.counter("HTTP/2.0"),
                r.counter("handshakes"),
                per_request("read"),
                per_request("slot"),
                per_request("parse"),
                per_request("data"),
                per_request("eval"),
                per_request("hop"),
                per_request("respond"),
                per_request("total"),
                total
                    .quantile(0.99)
                    .map_or_else(|| "-".to_owned(), |(v, _)| format!("{:.0}", v * 1e6)),
                ms_or_dash(api_mean),
                ms_or_dash(api_mean.map(|m| m - total_mean)),
            )?;
        }
    }
    writeln!(section)
}

/// Replaces this benchmark's section in `path` (or appends it).
fn write_section(path: &PathBuf, section: &str) -> anyhow::Result<()> {
    let current = std::fs::read_to_string(path).unwrap_or_else(|_| "# Benchmarks\n".into());
    let updated = match (current.find(BEGIN), current.find(END)) {
        (Some(begin), Some(end)) if end > begin => format!(
            "{}{}{}",
            &current[..begin],
            section.trim_end(),
            &current[end + END.len()..]
        ),
        _ => format!(
            "{}\n{}",
            current.trim_end_matches('\n').to_owned() + "\n",
            section
        ),
    };
    std::fs::write(path, updated).with_context(|| format!("writing {}", path.display()))
}
