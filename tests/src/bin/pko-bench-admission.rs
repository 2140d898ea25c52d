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
    ValidatingAdmissionPolicy, ValidatingAdmissionPolicyBinding,
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
use pko_tests::webhook::{Registration, WebhookOptions, free_port, policy_bundle};
use pko_tests::{ControlPlane, StartOptions, wait_for};
use serde_json::{Value, json};

const BEGIN: &str = "<!-- admission benchmarks: begin -->";
const END: &str = "<!-- admission benchmarks: end -->";
const VAP_LABEL: &str = "pko-bench.vap";

struct Args {
    out: PathBuf,
    rate: f64,
    seconds: f64,
    evaluations: usize,
    /// Whether to run the section that drives a real apiserver (`--apiserver false`: only the
    /// in-process evaluations).
    apiserver: bool,
}

fn parse_args() -> anyhow::Result<Args> {
    let mut args = Args {
        out: PathBuf::from("docs/benchmarks.md"),
        rate: 200.0,
        seconds: 10.0,
        evaluations: 5000,
        apiserver: true,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let value = it.next().with_context(|| format!("{flag} needs a value"))?;
        match flag.as_str() {
            "--out" => args.out = PathBuf::from(value),
            "--rate" => args.rate = value.parse()?,
            "--seconds" => args.seconds = value.parse()?,
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
            "userInfo": {"username": "alice", "groups": ["system:authenticated"]},
            "object": object,
            "oldObject": null,
            "dryRun": false,
        },
    })
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

    let none = plane.namespace("bench-none").await?;
    let vap = plane.namespace("bench-vap").await?;
    let validate = plane.namespace("bench-validate").await?;
    let mutate = plane.namespace("bench-both").await?;
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

    let configs: [(&str, &String); 4] = [
        ("no admission check", &none),
        ("ValidatingAdmissionPolicy (CEL, in the apiserver)", &vap),
        ("pko-rs webhook: `/validate`", &validate),
        ("pko-rs webhook: `/mutate` + `/validate`", &mutate),
    ];
    // Warm connections and caches in every path first.
    for (i, (_, ns)) in configs.iter().enumerate() {
        let _ = load(&client, ns, &format!("warm{i}"), args.rate, 1.0).await;
    }
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
         (and, on the project's machine, other builds: see the load average).\n"
    )?;
    let mut rates = vec![args.rate];
    if args.rate > 50.0 {
        rates.push(50.0);
    }
    for (r, &rate) in rates.iter().enumerate() {
        let (rows, before, after) =
            measure(&client, &configs, rate, args.seconds, &format!("rate{r}")).await;
        writeln!(
            section,
            "{rate:.0} creates/s, {:.0} s per row (load average {before} → {after}):\n",
            args.seconds
        )?;
        table(&mut section, &rows)?;
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

/// Runs every configuration at `rate` for `seconds` in total, in interleaved rounds. Returns the
/// rows and the load average before and after.
async fn measure<'a>(
    client: &kube::Client,
    configs: &[(&'a str, &String)],
    rate: f64,
    seconds: f64,
    tag: &str,
) -> (Vec<(&'a str, Load)>, String, String) {
    let mut rows: Vec<(&str, Load)> = configs
        .iter()
        .map(|(name, _)| {
            (
                *name,
                Load {
                    latencies: Vec::new(),
                    errors: 0,
                    first_error: None,
                    elapsed: Duration::ZERO,
                },
            )
        })
        .collect();
    let before = load_average();
    for round in 0..ROUNDS {
        for (i, (_, ns)) in configs.iter().enumerate() {
            let prefix = format!("{tag}-r{round}-w{i}");
            let result = load(client, ns, &prefix, rate, seconds / ROUNDS as f64).await;
            let row = &mut rows[i].1;
            row.latencies.extend(result.latencies);
            row.errors += result.errors;
            row.elapsed += result.elapsed;
            if row.first_error.is_none() {
                row.first_error = result.first_error;
            }
        }
    }
    let after = load_average();
    for (name, row) in &mut rows {
        row.latencies.sort();
        if let Some(e) = &row.first_error {
            eprintln!("{name}: first error: {e}");
        }
    }
    (rows, before, after)
}

fn table(section: &mut String, rows: &[(&str, Load)]) -> std::fmt::Result {
    let base = &rows[0].1.latencies;
    let (base50, base99) = (percentile(base, 0.50), percentile(base, 0.99));
    writeln!(
        section,
        "| admission | creates | errors | achieved/s | p50 | p99 | max | p50 vs none | p99 vs none |"
    )?;
    writeln!(section, "|---|---:|---:|---:|---:|---:|---:|---:|---:|")?;
    for (name, result) in rows {
        let (p50, p99) = (
            percentile(&result.latencies, 0.50),
            percentile(&result.latencies, 0.99),
        );
        writeln!(
            section,
            "| {name} | {} | {} | {:.0} | {} | {} | {} | {} | {} |",
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
