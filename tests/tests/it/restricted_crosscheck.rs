//! One rule set, two enforcers: the admission webhook (the compiled `policies/defaults.rego` and
//! `policies/restricted.rego`, evaluated by opa-wasm as the operator loads them) and the
//! Workspace controller (`controller/workspace/restricted.rs`, which also guards namespace-scoped
//! installs, where no webhook runs). On every pod template of
//! `tests/fixtures/restricted-corpus.json` both must store the same defaults and then find the
//! same violations (code, path and message), and the controller must refuse exactly the
//! templates the corpus says are refused, on the final pod it builds.

use std::collections::BTreeSet;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference;
use pko_admission::bundle::{Bundle, DECISION_ENTRYPOINT, DEFAULTS_ENTRYPOINT};
use pko_admission::engine::{EngineLimits, PolicyEngine};
use pko_admission::webhook::Decision;
use pko_api::workspace::Workspace;
use pko_operator::controller::workspace::pod::{self, PodError, PodSettings};
use pko_operator::controller::workspace::restricted;
use pko_tests::repo_root;
use pko_tests::webhook::{policy_bundle, workspace_review};
use serde_json::{Value, json};

/// (code, path, message) of each violation.
type Found = BTreeSet<(String, String, String)>;

fn corpus() -> Vec<Value> {
    let path = repo_root().join("tests/fixtures/restricted-corpus.json");
    let text = std::fs::read_to_string(&path)
        .unwrap_or_else(|e| panic!("reading {}: {e}", path.display()));
    serde_json::from_str(&text).expect("corpus JSON")
}

/// A Workspace with `template` being created in a namespace no TenancyPolicy selects.
fn review(template: &Value) -> Value {
    workspace_review(
        "team-a",
        json!({
            "apiVersion": "auto.pulumi.com/v1alpha1",
            "kind": "Workspace",
            "metadata": {"name": "w", "namespace": "team-a", "uid": "11111111-0000-4000-8000-000000000001"},
            "spec": {"securityProfile": "restricted", "podTemplate": template},
        }),
    )
}

fn data() -> Value {
    json!({"tenancy": {"defaultAction": "deny", "fileServer": {"hosts": [], "ports": []}, "policies": []}})
}

/// What admission does: the defaulting patch, applied, then the restricted violations.
async fn admission(engine: &PolicyEngine, name: &str, template: &Value) -> (Value, Found) {
    let mut input = review(template);
    let patch = engine
        .evaluate(DEFAULTS_ENTRYPOINT, &input, &data())
        .await
        .unwrap_or_else(|e| panic!("{name}: defaults: {e}"));
    let patch: json_patch::Patch =
        serde_json::from_value(patch).unwrap_or_else(|e| panic!("{name}: patch: {e}"));
    json_patch::patch(&mut input["request"]["object"], &patch)
        .unwrap_or_else(|e| panic!("{name}: applying the patch: {e}"));
    let decision = engine
        .evaluate(DECISION_ENTRYPOINT, &input, &data())
        .await
        .unwrap_or_else(|e| panic!("{name}: decision: {e}"));
    let decision: Decision = serde_json::from_value(decision).expect("decision document");
    let found = decision
        .violations
        .into_iter()
        .filter(|v| v.policy == "restricted")
        .map(|v| (v.code, v.path, v.message))
        .collect();
    let pod = input["request"]["object"]["spec"]["podTemplate"]["spec"].clone();
    (pod, found)
}

/// What the Workspace controller does with the template's pod on its own.
fn controller(template: &Value) -> (Value, Found) {
    let mut pod = template["spec"].clone();
    restricted::apply_defaults(&mut pod);
    let found = restricted::violations(&pod, "spec.podTemplate.spec")
        .into_iter()
        .map(|v| (v.code.to_owned(), v.path, v.message))
        .collect();
    (pod, found)
}

/// The controller's answer on the final pod: the template merged over the operator's own.
fn statefulset(template: &Value) -> Result<(), PodError> {
    let ws: Workspace = serde_json::from_value(json!({
        "apiVersion": "auto.pulumi.com/v1alpha1",
        "kind": "Workspace",
        "metadata": {"name": "w", "namespace": "team-a", "uid": "u"},
        "spec": {"securityProfile": "restricted", "podTemplate": template},
    }))
    .expect("a typed Workspace");
    let settings = PodSettings {
        agent_image: "pko-rs:latest".into(),
        agent_image_pull_policy: "IfNotPresent".into(),
        pko_agent_image: "pulumi/pulumi-kubernetes-operator:v2.9.0".into(),
        max_artifact_bytes: None,
        git_ssh_accept_new_host_keys: false,
        github_api_url: "https://api.github.com".into(),
        file_server: pko_admission::tenancy::FileServerNames::default(),
    };
    pod::desired_statefulset(
        &ws,
        "w",
        "team-a",
        &OwnerReference::default(),
        &settings,
        &pod::AgentLayout::pinned("fp"),
    )
    .map(|_| ())
}

#[tokio::test]
async fn the_controller_and_the_admission_policies_agree_on_every_pod() {
    let bundle = Bundle::load(&policy_bundle().expect("policy bundle")).expect("bundle loads");
    let engine = PolicyEngine::new(&bundle, EngineLimits::default())
        .await
        .expect("engine");
    let corpus = corpus();
    assert!(corpus.len() >= 40, "only {} cases", corpus.len());
    let mut codes_seen = BTreeSet::new();
    for case in &corpus {
        let name = case["name"].as_str().expect("name");
        let template = &case["podTemplate"];
        let expect: BTreeSet<String> =
            serde_json::from_value(case["expect"].clone()).expect("expect");

        let (admitted_pod, by_admission) = admission(&engine, name, template).await;
        let (defaulted_pod, by_controller) = controller(template);
        assert_eq!(
            defaulted_pod, admitted_pod,
            "{name}: the controller's defaults differ from the webhook's"
        );
        assert_eq!(
            by_controller, by_admission,
            "{name}: the controller and the admission policy disagree"
        );
        let codes: BTreeSet<String> = by_admission.iter().map(|(c, _, _)| c.clone()).collect();
        assert_eq!(codes, expect, "{name}: not what the corpus says");

        match statefulset(template) {
            Ok(()) => assert!(expect.is_empty(), "{name}: the final pod was built"),
            Err(PodError::Restricted(message)) => {
                assert!(!expect.is_empty(), "{name}: refused: {message}");
                for code in &expect {
                    assert!(
                        by_admission
                            .iter()
                            .any(|(c, _, m)| c == code && message.contains(m.as_str())),
                        "{name}: the refusal does not explain {code}: {message}"
                    );
                }
            }
            Err(other) => panic!("{name}: {other}"),
        }
        codes_seen.extend(codes);
    }
    // Every rule of restricted.rego but the profile switch (not a pod rule) is exercised.
    let rules = std::fs::read_to_string(repo_root().join("policies/restricted.rego"))
        .expect("restricted.rego");
    let declared: BTreeSet<String> = rules
        .lines()
        .filter_map(|l| l.trim().strip_prefix('"')?.strip_suffix("\","))
        .filter(|c| c.chars().all(|ch| ch.is_ascii_lowercase() || ch == '-'))
        .filter(|c| *c != "baseline-profile")
        .map(str::to_owned)
        .collect();
    assert!(declared.len() >= 14, "rules read: {declared:?}");
    assert_eq!(codes_seen, declared, "rules the corpus never breaks");
}
