//! Pooled instances answer exactly like fresh ones: nothing of an evaluation (its input, what
//! it allocated, how it failed) reaches the next one, and a new data document is never
//! evaluated with an instance that loaded an older one.
//!
//! Policies are compiled by the real `opa` (`tools/build.sh dir opa`, or PKO_TOOLS_OPA_DIR);
//! the production bundle comes from PKO_POLICY_BUNDLE.
#![allow(
    clippy::disallowed_methods,
    reason = "a test process is configured by its environment (make sets the tool and fixture paths)"
)]

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;
use std::time::Duration;

use pko_admission::bundle::{Bundle, DECISION_ENTRYPOINT, DEFAULTS_ENTRYPOINT};
use pko_admission::engine::{EngineError, EngineLimits, PolicyData, PolicyEngine};
use proptest::prelude::*;
use proptest::test_runner::{Config as ProptestConfig, TestRunner};
use serde_json::{Value, json};

fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

fn opa() -> PathBuf {
    let dir = match std::env::var_os("PKO_TOOLS_OPA_DIR").filter(|v| !v.is_empty()) {
        Some(dir) => PathBuf::from(dir),
        None => {
            let out = Command::new("bash")
                .arg(repo_root().join("tools/build.sh"))
                .args(["dir", "opa"])
                .output()
                .expect("tools/build.sh runs");
            assert!(out.status.success(), "tools/build.sh dir opa failed");
            PathBuf::from(String::from_utf8_lossy(&out.stdout).trim())
        }
    };
    let opa = dir.join("opa");
    assert!(
        opa.is_file(),
        "{} is missing: run `make tools`",
        opa.display()
    );
    opa
}

fn production() -> Bundle {
    let path = match std::env::var_os("PKO_POLICY_BUNDLE").filter(|v| !v.is_empty()) {
        Some(path) => PathBuf::from(path),
        None => panic!(
            "PKO_POLICY_BUNDLE is not set: run `make policies` and export \
             PKO_POLICY_BUNDLE=~/.cache/pko-rs/policies/policies.tar.gz"
        ),
    };
    Bundle::load(&path).expect("bundle loads")
}

/// Echoes what it sees, allocates in proportion to its input, and has two hostile rules: one
/// that runs for far longer than any budget and allocates nothing, one that exhausts memory.
const PROBE: &str = r#"package probe

# Everything an evaluation sees (its data under `doc`: all of `data` would include this rule).
default doc := null

doc := data.doc

echo := {"input": input, "doc": doc}

# Values built from the input: heap objects a leaked heap would keep reachable.
derived := {"keys": [k | some k, _ in input], "total": count(json.marshal(input)), "strings": [upper(s) | some s in input.strings]}

xs := numbers.range(1, 2000)

spin := count([x | some x in xs; some y in xs; some z in xs; x == y; y == z; z != x])

hog := count([x | some x in numbers.range(1, 50000000)])
"#;

const ENTRYPOINTS: [&str; 4] = ["probe/echo", "probe/derived", "probe/spin", "probe/hog"];

fn probe_bundle() -> Bundle {
    let tmp = tempfile::tempdir().expect("tempdir");
    let src = tmp.path().join("src");
    std::fs::create_dir_all(&src).expect("mkdir");
    std::fs::write(src.join("probe.rego"), PROBE).expect("write rego");
    let out = tmp.path().join("bundle.tar.gz");
    let mut build = Command::new(opa());
    build.args(["build", "--target", "wasm"]);
    for e in ENTRYPOINTS {
        build.args(["--entrypoint", e]);
    }
    let status = build
        .arg("--output")
        .arg(&out)
        .arg(&src)
        .status()
        .expect("opa build runs");
    assert!(status.success(), "opa build failed");
    let bytes = std::fs::read(&out).expect("bundle");
    Bundle::with_entrypoints(&bytes, &ENTRYPOINTS).expect("a probe bundle")
}

/// One instance: every pooled evaluation reuses the same one.
fn one_slot(memory_bytes: usize, timeout: Duration) -> EngineLimits {
    EngineLimits {
        concurrency: 1,
        memory_bytes,
        timeout,
        ..EngineLimits::default()
    }
}

fn json_value() -> impl Strategy<Value = Value> {
    let leaf = prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::Bool),
        any::<i32>().prop_map(|n| json!(n)),
        "[a-z]{0,12}".prop_map(Value::String),
    ];
    leaf.prop_recursive(3, 32, 6, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..6).prop_map(Value::Array),
            prop::collection::btree_map("[a-z]{1,6}", inner, 0..6)
                .prop_map(|m| Value::Object(m.into_iter().collect())),
        ]
    })
}

/// An input object, sometimes with `strings`, sometimes large.
fn input() -> impl Strategy<Value = Value> {
    (
        prop::collection::btree_map("[a-z]{1,6}", json_value(), 0..6),
        prop::option::of(prop::collection::vec("[a-z]{0,8}", 0..8)),
        prop::option::of(0usize..200_000),
    )
        .prop_map(|(fields, strings, padding)| {
            let mut object: serde_json::Map<String, Value> = fields.into_iter().collect();
            if let Some(strings) = strings {
                object.insert("strings".into(), json!(strings));
            }
            if let Some(n) = padding {
                object.insert("padding".into(), json!("p".repeat(n)));
            }
            Value::Object(object)
        })
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime")
}

/// A pooled evaluation and a fresh one of the same entrypoint, input and data agree, whatever
/// ran on the pooled instance before.
async fn same_as_fresh(
    engine: &PolicyEngine,
    entrypoint: &str,
    input: &Value,
    data: &Arc<PolicyData>,
) {
    let pooled = engine
        .evaluate_with(entrypoint, input, data)
        .await
        .expect("pooled evaluation");
    let fresh = engine
        .evaluate(entrypoint, input, data.value())
        .await
        .expect("fresh evaluation");
    assert_eq!(pooled, fresh, "{entrypoint} on {input}");
}

#[test]
fn random_sequences_on_a_reused_instance_answer_like_fresh_instances() {
    let rt = runtime();
    let engine = rt
        .block_on(PolicyEngine::new(
            &probe_bundle(),
            one_slot(256 << 20, Duration::from_secs(3600)),
        ))
        .expect("engine");
    let data = PolicyData::new(json!({"doc": {"tenancy": {"policies": [{"name": "p"}]}}}));
    let mut runner = TestRunner::new(ProptestConfig {
        cases: 48,
        ..ProptestConfig::default()
    });
    let steps = prop::collection::vec((input(), prop::bool::ANY), 1..12);
    runner
        .run(&steps, |steps| {
            rt.block_on(async {
                for (input, echo) in &steps {
                    let entrypoint = if *echo { "probe/echo" } else { "probe/derived" };
                    same_as_fresh(&engine, entrypoint, input, &data).await;
                }
            });
            assert_eq!(engine.pooled(), 1, "the one instance went back to the pool");
            Ok(())
        })
        .expect("pooled evaluations match fresh ones");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_heap_is_reset_before_every_evaluation() {
    let engine = PolicyEngine::new(
        &probe_bundle(),
        one_slot(256 << 20, Duration::from_secs(3600)),
    )
    .await
    .expect("engine");
    let data = PolicyData::new(json!({}));
    // Each evaluation allocates a few MiB (the input, parsed, and what `derived` builds); if
    // one evaluation's heap were kept, the memory would grow by as much every time.
    let big = json!({"strings": vec!["s".repeat(1000); 1000], "padding": "p".repeat(1 << 20)});
    let first = engine
        .evaluate_with("probe/derived", &big, &data)
        .await
        .expect("evaluation");
    let after_one = engine.pooled_memory();
    assert_eq!(after_one.len(), 1);
    for _ in 0..40 {
        let again = engine
            .evaluate_with("probe/derived", &big, &data)
            .await
            .expect("evaluation");
        assert_eq!(again, first);
    }
    assert_eq!(
        engine.pooled_memory(),
        after_one,
        "memory after 41 evaluations equals memory after one"
    );
    // A small input after a large one sees only itself.
    let small = json!({"a": 1});
    let echoed = engine
        .evaluate_with("probe/echo", &small, &data)
        .await
        .expect("evaluation");
    assert_eq!(echoed, json!({"input": {"a": 1}, "doc": null}));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_instance_that_ran_out_of_memory_is_dropped_and_the_next_answers_like_a_fresh_one() {
    // Only the memory cap can stop `hog`: the deadline is out of reach.
    let engine = PolicyEngine::new(
        &probe_bundle(),
        one_slot(16 << 20, Duration::from_secs(3600)),
    )
    .await
    .expect("engine");
    let data = PolicyData::new(json!({"doc": 1}));
    let input = json!({"strings": ["a", "b"], "n": 3});
    same_as_fresh(&engine, "probe/derived", &input, &data).await;
    assert_eq!(engine.pooled(), 1);
    for round in 0..3 {
        let err = engine
            .evaluate_with("probe/hog", &json!({"round": round}), &data)
            .await
            .expect_err("over the memory cap");
        assert!(matches!(err, EngineError::Memory(_)), "{err}");
        assert_eq!(engine.pooled(), 0, "the failed instance is not pooled");
        same_as_fresh(&engine, "probe/echo", &input, &data).await;
        same_as_fresh(&engine, "probe/derived", &input, &data).await;
        assert_eq!(engine.pooled(), 1);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_instance_stopped_by_its_deadline_is_dropped_and_the_next_answers_like_a_fresh_one() {
    // `spin` never ends within any budget and allocates nothing: only the deadline stops it.
    // The others end far within it on any machine.
    let engine = PolicyEngine::new(&probe_bundle(), one_slot(256 << 20, Duration::from_secs(2)))
        .await
        .expect("engine");
    let data = PolicyData::new(json!({"doc": 2}));
    let input = json!({"strings": ["x"], "k": {"v": [1, 2, 3]}});
    same_as_fresh(&engine, "probe/echo", &input, &data).await;
    let err = engine
        .evaluate_with("probe/spin", &input, &data)
        .await
        .expect_err("stopped");
    assert!(matches!(err, EngineError::Timeout(_)), "{err}");
    // The stopped evaluation's thread drops its instance once the interrupt lands.
    while engine.running() > 0 {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(engine.pooled(), 0, "the stopped instance is not pooled");
    same_as_fresh(&engine, "probe/derived", &input, &data).await;
    same_as_fresh(&engine, "probe/echo", &input, &data).await;
    assert_eq!(engine.pooled(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn new_data_is_never_evaluated_with_an_instance_of_older_data() {
    let engine = PolicyEngine::new(
        &probe_bundle(),
        one_slot(256 << 20, Duration::from_secs(3600)),
    )
    .await
    .expect("engine");
    let input = json!({});
    for n in 0..5 {
        let data = PolicyData::new(json!({"doc": {"generation": n}}));
        for _ in 0..3 {
            let seen = engine
                .evaluate_with("probe/echo", &input, &data)
                .await
                .expect("evaluation");
            assert_eq!(seen["doc"], json!({"generation": n}));
        }
    }
    assert_eq!(engine.pooled(), 1, "instances of older data leave the pool");
}

/// Reviews of the production bundle: compliant or not, in namespaces with or without a
/// TenancyPolicy, Workspaces and Stacks.
fn review() -> impl Strategy<Value = Value> {
    (
        prop::sample::select(vec!["team-a", "team-b", ""]),
        prop::sample::select(vec!["pulumi/pulumi:3", "evil/x", "registry.example/p"]),
        prop::option::of(any::<bool>()),
        prop::option::of(0i64..2000),
        prop::sample::select(vec!["Workspace", "Stack"]),
    )
        .prop_map(|(namespace, image, non_root, user, kind)| {
            let mut security = serde_json::Map::new();
            if let Some(non_root) = non_root {
                security.insert("runAsNonRoot".into(), json!(non_root));
            }
            if let Some(user) = user {
                security.insert("runAsUser".into(), json!(user));
            }
            let spec = json!({
                "image": image,
                "podTemplate": {"spec": {
                    "securityContext": security,
                    "containers": [{"name": "pulumi", "image": image}],
                }},
            });
            let (group, spec) = if kind == "Stack" {
                ("pulumi.com", json!({"workspaceTemplate": {"spec": spec}}))
            } else {
                ("auto.pulumi.com", spec)
            };
            json!({
                "apiVersion": "admission.k8s.io/v1",
                "kind": "AdmissionReview",
                "request": {
                    "uid": "1", "operation": "CREATE", "namespace": namespace,
                    "kind": {"group": group, "version": "v1", "kind": kind},
                    "object": {"metadata": {"name": "w", "namespace": namespace}, "spec": spec},
                },
            })
        })
}

#[test]
fn production_policies_on_a_reused_instance_answer_like_fresh_instances() {
    let rt = runtime();
    let engine = rt
        .block_on(PolicyEngine::new(
            &production(),
            one_slot(256 << 20, Duration::from_secs(3600)),
        ))
        .expect("engine");
    let data = PolicyData::new(json!({"tenancy": {
        "defaultAction": "warn",
        "fileServer": {"hosts": ["fs.example"], "ports": [80]},
        "policies": [{
            "name": "team-a", "action": "deny", "namespaces": ["team-a"],
            "exemptFromRestricted": false, "allowedImagePrefixes": ["pulumi/pulumi:"],
        }],
    }}));
    let mut runner = TestRunner::new(ProptestConfig {
        cases: 32,
        ..ProptestConfig::default()
    });
    let steps = prop::collection::vec((review(), prop::bool::ANY), 1..10);
    runner
        .run(&steps, |steps| {
            rt.block_on(async {
                for (review, validate) in &steps {
                    let entrypoint = if *validate {
                        DECISION_ENTRYPOINT
                    } else {
                        DEFAULTS_ENTRYPOINT
                    };
                    same_as_fresh(&engine, entrypoint, review, &data).await;
                }
            });
            Ok(())
        })
        .expect("pooled evaluations match fresh ones");
}
