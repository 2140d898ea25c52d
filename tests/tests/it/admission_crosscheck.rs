//! opa-wasm (the compiled bundle the operator loads) decides exactly like the real `opa eval`
//! on the Rego sources, for every fixture AdmissionReview in `tests/fixtures/admission/`.
//!
//! Also checks, in-process, the engine's limits: an evaluation that runs past its deadline or
//! its memory cap fails with the right error, and the engine keeps evaluating afterwards.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use pko_admission::bundle::{Bundle, DECISION_ENTRYPOINT, DEFAULTS_ENTRYPOINT};
use pko_admission::engine::{EngineError, EngineLimits, PolicyEngine};
use pko_admission::webhook::Decision;
use pko_tests::webhook::policy_bundle;
use pko_tests::{repo_root, tool_dir};
use serde_json::{Value, json};

struct Fixture {
    name: String,
    input: Value,
    data: Value,
    expect: Value,
}

fn fixtures() -> Vec<Fixture> {
    let dir = repo_root().join("tests/fixtures/admission");
    let mut paths: Vec<PathBuf> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("reading {}: {e}", dir.display()))
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|x| x == "json"))
        .collect();
    paths.sort();
    paths
        .into_iter()
        .map(|path| {
            let text = std::fs::read_to_string(&path).expect("fixture readable");
            let mut value: Value =
                serde_json::from_str(&text).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
            Fixture {
                name: path
                    .file_stem()
                    .map(|s| s.to_string_lossy().into_owned())
                    .unwrap_or_default(),
                input: value["input"].take(),
                data: value["data"].take(),
                expect: value["expect"].take(),
            }
        })
        .collect()
}

fn opa() -> PathBuf {
    tool_dir("opa")
        .expect("opa is built (make tools)")
        .join("opa")
}

/// `opa eval` of both entrypoints on the Rego sources, with the same data and input.
fn opa_eval(opa: &Path, dir: &Path, fixture: &Fixture) -> Value {
    let input = dir.join(format!("{}-input.json", fixture.name));
    let data = dir.join(format!("{}-data.json", fixture.name));
    std::fs::write(&input, fixture.input.to_string()).expect("write input");
    std::fs::write(&data, fixture.data.to_string()).expect("write data");
    let out = Command::new(opa)
        .args([
            "eval",
            "--format",
            "json",
            "--ignore",
            "*_test.rego",
            "--data",
        ])
        .arg(repo_root().join("policies"))
        .arg("--data")
        .arg(&data)
        .arg("--input")
        .arg(&input)
        .arg(r#"{"decision": data.pko.admission.decision, "patch": data.pko.defaults.patch}"#)
        .output()
        .expect("opa runs");
    assert!(
        out.status.success(),
        "opa eval failed on {}: {}",
        fixture.name,
        String::from_utf8_lossy(&out.stderr)
    );
    let result: Value = serde_json::from_slice(&out.stdout).expect("opa JSON");
    result["result"][0]["expressions"][0]["value"].clone()
}

#[tokio::test]
async fn opa_wasm_agrees_with_opa_eval_on_every_fixture() {
    let _machine = pko_tests::serial::shared().await;
    let bundle = Bundle::load(&policy_bundle().expect("policy bundle")).expect("bundle loads");
    let engine = PolicyEngine::new(&bundle, EngineLimits::default())
        .await
        .expect("engine");
    let opa = opa();
    let tmp = tempfile::tempdir().expect("tempdir");
    let fixtures = fixtures();
    assert!(fixtures.len() >= 30, "only {} fixtures", fixtures.len());
    for fixture in &fixtures {
        let decision = engine
            .evaluate(DECISION_ENTRYPOINT, &fixture.input, &fixture.data)
            .await
            .unwrap_or_else(|e| panic!("{}: opa-wasm decision: {e}", fixture.name));
        let patch = engine
            .evaluate(DEFAULTS_ENTRYPOINT, &fixture.input, &fixture.data)
            .await
            .unwrap_or_else(|e| panic!("{}: opa-wasm patch: {e}", fixture.name));
        let wasm = json!({"decision": decision, "patch": patch});
        let reference = opa_eval(&opa, tmp.path(), fixture);
        assert_eq!(
            wasm, reference,
            "{}: opa-wasm and opa eval disagree",
            fixture.name
        );

        // The fixture still shows what it says it shows.
        let typed: Decision = serde_json::from_value(decision).expect("decision document");
        let mut codes: Vec<String> = typed.violations.iter().map(|v| v.code.clone()).collect();
        codes.sort();
        codes.dedup();
        let expected: Vec<String> =
            serde_json::from_value(fixture.expect["codes"].clone()).expect("expect.codes");
        assert_eq!(typed.allowed, fixture.expect["allowed"], "{}", fixture.name);
        assert_eq!(codes, expected, "{}", fixture.name);
        assert_eq!(
            patch.as_array().map(Vec::len),
            fixture.expect["patchOps"].as_u64().map(|n| n as usize),
            "{}: {patch}",
            fixture.name
        );
        for v in &typed.violations {
            assert!(
                !v.path.is_empty() && !v.message.is_empty(),
                "{}: {v:?}",
                fixture.name
            );
        }
    }
}

/// A policy that computes for far longer than any budget.
/// A runaway that allocates nothing while it runs: three nested scans of one small array and
/// comparisons between bound values (no constant, no arithmetic, nothing collected), so only the
/// deadline can stop it, never the memory cap, on any machine.
const SLOW_POLICY: &str = r#"package slow

xs := numbers.range(1, 2000)

result := count([x | some x in xs; some y in xs; some z in xs; x == y; y == z; z != x])
"#;

fn build_bundle(dir: &Path, rego: &str, entrypoint: &str) -> Bundle {
    let src = dir.join("src");
    std::fs::create_dir_all(&src).expect("mkdir");
    std::fs::write(src.join("policy.rego"), rego).expect("write rego");
    let out = dir.join("bundle.tar.gz");
    let status = Command::new(opa())
        .args([
            "build",
            "--target",
            "wasm",
            "--entrypoint",
            entrypoint,
            "--output",
        ])
        .arg(&out)
        .arg(&src)
        .status()
        .expect("opa build runs");
    assert!(status.success(), "opa build failed");
    let bytes = std::fs::read(&out).expect("bundle");
    Bundle::with_entrypoints(&bytes, &[entrypoint]).expect("a test bundle")
}

// One thread: if an evaluation ran on it, nothing else could run until it ended.
#[tokio::test(flavor = "current_thread")]
async fn runaway_evaluations_are_stopped_and_the_engine_keeps_working() {
    let _machine = pko_tests::serial::shared().await;
    let tmp = tempfile::tempdir().expect("tempdir");
    let bundle = build_bundle(tmp.path(), SLOW_POLICY, "slow/result");
    // Each limit test trips only its own limit: here the memory cap is far above anything the
    // loop could use, and the loop allocates nothing anyway.
    let timeout = Duration::from_millis(200);
    let limits = EngineLimits {
        timeout,
        memory_bytes: 1024 * 1024 * 1024,
        ..EngineLimits::default()
    };
    let engine = PolicyEngine::new(&bundle, limits).await.expect("engine");
    // A task on the same (only) runtime thread counts how often it runs while the runaway
    // evaluation is in progress: the wasm runs on the blocking pool, so the thread stays free
    // for probes and lease renewals.
    let ticks = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let ticker = {
        let ticks = ticks.clone();
        tokio::spawn(async move {
            loop {
                ticks.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                tokio::task::yield_now().await;
            }
        })
    };
    let started = Instant::now();
    let err = engine
        .evaluate("slow/result", &json!({}), &json!({}))
        .await
        .expect_err("runaway evaluation stopped");
    let ran = ticks.load(std::sync::atomic::Ordering::SeqCst);
    ticker.abort();
    assert!(matches!(err, EngineError::Timeout(_)), "{err}");
    assert!(
        ran > 0,
        "the runtime thread was blocked during the evaluation"
    );
    // Stopped by the deadline, not by running to the end (no upper bound: machine speed).
    assert!(started.elapsed() >= timeout, "{:?}", started.elapsed());

    // Closing the engine stops a running evaluation at its next tick, whatever its deadline.
    let patient = PolicyEngine::new(
        &bundle,
        EngineLimits {
            timeout: Duration::from_secs(3600),
            ..limits
        },
    )
    .await
    .expect("engine");
    let running = {
        let engine = patient.clone();
        tokio::spawn(async move { engine.evaluate("slow/result", &json!({}), &json!({})).await })
    };
    while patient.running() == 0 {
        tokio::task::yield_now().await;
    }
    patient.close();
    let err = running
        .await
        .expect("task")
        .expect_err("closed engine stops its evaluations");
    assert!(matches!(err, EngineError::Closed), "{err}");

    // The production bundle under a memory cap too small for a large review fails with a
    // memory error, and the same engine then evaluates a normal review.
    let production = Bundle::load(&policy_bundle().expect("policy bundle")).expect("bundle");
    let engine = PolicyEngine::new(
        &production,
        EngineLimits {
            memory_bytes: 1024 * 1024,
            // Only the memory cap may stop this one, however slow the machine.
            timeout: Duration::from_secs(3600),
            ..EngineLimits::default()
        },
    )
    .await
    .expect("engine");
    let review = |value: Value| {
        json!({
            "apiVersion": "admission.k8s.io/v1",
            "kind": "AdmissionReview",
            "request": {
                "uid": "1", "operation": "CREATE", "namespace": "a",
                "kind": {"group": "auto.pulumi.com", "version": "v1alpha1", "kind": "Workspace"},
                "object": {"metadata": {"name": "w"}, "spec": value},
            },
        })
    };
    let big = review(json!({"env": [{"name": "X", "value": "x".repeat(2_000_000)}]}));
    let err = engine
        .evaluate(DECISION_ENTRYPOINT, &big, &json!({}))
        .await
        .expect_err("over the memory cap");
    assert!(matches!(err, EngineError::Memory(_)), "{err}");
    let ok = engine
        .evaluate(DECISION_ENTRYPOINT, &review(json!({})), &json!({}))
        .await
        .expect("normal evaluation after a failure");
    assert_eq!(ok["allowed"], true);
}
