//! The namespace-scoped install, on a real apiserver: the operator runs as its service account
//! (impersonated) with only the Roles the chart renders with the example values of
//! `examples/namespace-scoped/values.yaml` (`scope.mode=namespaces`), watches two namespaces, and a Program and a Stack work end to end. The apiserver's audit log then shows
//! that none of the service account's requests was forbidden and none listed or watched across
//! the cluster.

use std::collections::BTreeSet;
use std::time::Duration;

use kube::Api;
use kube::api::PostParams;
use pko_api::program::Program;
use pko_api::stack::Stack;
use pko_tests::StartOptions;
use pko_tests::fixtures;
use pko_tests::kubelet::Kubelet;
use pko_tests::operator::{Operator, OperatorOptions};
use pko_tests::{ControlPlane, repo_root, wait_for};
use serde_json::{Value, json};

use crate::helm::{parse, template_with_values};

const WAIT: Duration = Duration::from_secs(180);
const SERVICE_ACCOUNT: &str = "pko-rs-operator";

/// Every (group, resource, verb, name) a rule grants; `None` for any name.
fn grants(rule: &Value) -> BTreeSet<(String, String, String, Option<String>)> {
    let list = |key: &str| -> Vec<String> {
        rule[key]
            .as_array()
            .map(|a| {
                a.iter()
                    .filter_map(Value::as_str)
                    .map(str::to_owned)
                    .collect()
            })
            .unwrap_or_default()
    };
    let names: Vec<Option<String>> = match list("resourceNames") {
        names if names.is_empty() => vec![None],
        names => names.into_iter().map(Some).collect(),
    };
    let mut out = BTreeSet::new();
    for group in list("apiGroups") {
        for resource in list("resources") {
            for verb in list("verbs") {
                for name in &names {
                    out.insert((group.clone(), resource.clone(), verb.clone(), name.clone()));
                }
            }
        }
    }
    out
}

fn yaml_docs(path: &str) -> Vec<Value> {
    let path = repo_root().join(path);
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    parse(&text)
}

/// The namespaced overlay's Role grants nothing the cluster-wide ClusterRole does not: the
/// two are written apart, and this keeps them from drifting in what they allow.
#[test]
fn namespaced_role_grants_a_subset_of_the_cluster_role() {
    let cluster: BTreeSet<_> = yaml_docs("deploy/rbac/cluster_role.yaml")[0]["rules"]
        .as_array()
        .expect("rules")
        .iter()
        .flat_map(grants)
        .collect();
    let role = yaml_docs("deploy/overlays/namespaced/role.yaml")
        .into_iter()
        .find(|o| o["kind"] == "Role")
        .expect("Role");
    let scoped: BTreeSet<_> = role["rules"]
        .as_array()
        .expect("rules")
        .iter()
        .flat_map(grants)
        .collect();
    let extra: Vec<_> = scoped.difference(&cluster).collect();
    assert!(extra.is_empty(), "the Role grants more: {extra:?}");
    // And it leaves out only what is cluster-scoped.
    let left_out: BTreeSet<&str> = cluster
        .difference(&scoped)
        .map(|(_, resource, _, _)| resource.as_str())
        .collect();
    assert_eq!(
        left_out,
        BTreeSet::from([
            "clusterprogramtransforms",
            "clusterprogramtransforms/status",
            "mutatingwebhookconfigurations",
            "namespaces",
            "tenancypolicies",
            "tenancypolicies/status",
            "validatingwebhookconfigurations",
        ])
    );
}

/// The plane's admin kubeconfig, impersonating `user`.
fn impersonating_kubeconfig(plane: &ControlPlane, user: &str, out: &std::path::Path) {
    let text = std::fs::read_to_string(plane.kubeconfig_path()).expect("kubeconfig");
    let mut config: Value = yaml_serde::from_str(&text).expect("kubeconfig parses");
    for entry in config["users"].as_array_mut().expect("users") {
        entry["user"]["as"] = json!(user);
    }
    std::fs::write(out, yaml_serde::to_string(&config).expect("kubeconfig")).expect("write");
}

/// The example values of a namespace-scoped install, which the test installs with.
const EXAMPLE_VALUES: &str = "examples/namespace-scoped/values.yaml";

/// The chart rendered into `release_ns` with the values of [`EXAMPLE_VALUES`], its namespaces
/// replaced by `watched` (the example's do not exist here).
fn example_install(release_ns: &str, watched: &[&str]) -> Vec<Value> {
    let values = repo_root().join(EXAMPLE_VALUES);
    let example: Value = yaml_serde::from_str(&std::fs::read_to_string(&values).expect("values"))
        .expect("values parse");
    assert_eq!(example["scope"]["mode"], "namespaces", "{EXAMPLE_VALUES}");
    assert!(
        example["scope"]["namespaces"].is_array(),
        "{EXAMPLE_VALUES}"
    );
    let scoped = format!("scope.namespaces={{{}}}", watched.join(","));
    parse(&template_with_values(release_ns, &values, &[&scoped]))
}

/// Applies `rendered`'s RBAC objects (the ServiceAccount, its Roles and RoleBindings) for
/// `watched`; nothing else of the chart is needed by an operator running outside.
fn apply_chart_rbac(plane: &ControlPlane, rendered: &[Value], watched: &[&str]) {
    let objects: Vec<Value> = rendered
        .iter()
        .filter(|o| {
            matches!(
                o["kind"].as_str(),
                Some("ServiceAccount" | "Role" | "RoleBinding")
            )
        })
        .cloned()
        .collect();
    assert!(
        objects.iter().filter(|o| o["kind"] == "Role").count() >= watched.len() + 2,
        "{objects:?}"
    );
    let list = json!({"apiVersion": "v1", "kind": "List", "items": objects});
    let mut cmd = plane.kubectl();
    cmd.args([
        "apply",
        "--server-side",
        "--field-manager=pko-rs-scope-test",
        "-f",
        "-",
    ])
    .stdin(std::process::Stdio::piped())
    .stdout(std::process::Stdio::piped())
    .stderr(std::process::Stdio::piped());
    let mut child = cmd.spawn().expect("kubectl");
    {
        use std::io::Write;
        let mut stdin = child.stdin.take().expect("stdin");
        stdin
            .write_all(list.to_string().as_bytes())
            .expect("write stdin");
    }
    let out = child.wait_with_output().expect("kubectl apply");
    assert!(
        out.status.success(),
        "kubectl apply of the chart's RBAC: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// One audit event of the service account: what it asked and what it got.
#[derive(Debug)]
struct Request {
    verb: String,
    uri: String,
    namespace: Option<String>,
    code: i64,
}

fn requests_of(plane: &ControlPlane, user: &str) -> Vec<Request> {
    let text = std::fs::read_to_string(plane.audit_log()).expect("audit log");
    text.lines()
        .filter_map(|line| serde_json::from_str::<Value>(line).ok())
        .filter(|e| e["impersonatedUser"]["username"] == user || e["user"]["username"] == user)
        .map(|e| Request {
            verb: e["verb"].as_str().unwrap_or_default().to_owned(),
            uri: e["requestURI"].as_str().unwrap_or_default().to_owned(),
            namespace: e["objectRef"]["namespace"].as_str().map(str::to_owned),
            code: e["responseStatus"]["code"].as_i64().unwrap_or_default(),
        })
        .collect()
}

#[tokio::test]
async fn namespace_scoped_install_runs_a_program_and_a_stack_with_its_roles_only() {
    let _machine = pko_tests::serial::shared().await;
    let plane = ControlPlane::start(StartOptions {
        audit_log: true,
        ..StartOptions::default()
    })
    .await
    .unwrap_or_else(|e| panic!("{e}"));
    let op = plane.namespace("scope-op").await.expect("namespace");
    let a = plane.namespace("scope-a").await.expect("namespace");
    let b = plane.namespace("scope-b").await.expect("namespace");
    let rendered = example_install(&op, &[&a, &b]);
    apply_chart_rbac(&plane, &rendered, &[&a, &b]);
    // The operator runs outside, with the flags the chart gives its Deployment for the scope.
    let watch = format!("--watch-namespaces={a},{b}");
    let deployment = rendered
        .iter()
        .find(|o| o["kind"] == "Deployment")
        .expect("a Deployment");
    assert!(
        deployment["spec"]["template"]["spec"]["containers"][0]["args"]
            .as_array()
            .is_some_and(|args| args.iter().any(|a| a.as_str() == Some(watch.as_str()))),
        "{deployment}"
    );

    let tmp = tempfile::tempdir().expect("tmp");
    let user = format!("system:serviceaccount:{op}:{SERVICE_ACCOUNT}");
    let kubeconfig = tmp.path().join("operator-kubeconfig");
    impersonating_kubeconfig(&plane, &user, &kubeconfig);
    let backend = tmp.path().join("backend");
    std::fs::create_dir_all(&backend).expect("backend");
    let kubelet = Kubelet::start(plane.client(), &a, &tmp.path().join("pods")).expect("kubelet");
    let operator = Operator::start(
        &plane,
        OperatorOptions {
            advertised: None,
            args: vec![
                format!("--kubeconfig={}", kubeconfig.display()),
                watch,
                "--leader-elect".into(),
                format!("--leader-election-namespace={op}"),
                format!("--artifact-keys-namespace={op}"),
                "--workspace-localhost=127.0.0.1".into(),
            ],
        },
    )
    .await
    .unwrap_or_else(|e| panic!("operator starts as {user}: {e}"));

    // A Program in each watched namespace gets its artifact; the Stack in `a` runs it.
    let programs_b: Api<Program> = Api::namespaced(plane.client(), &b);
    programs_b
        .create(
            &PostParams::default(),
            &fixtures::config_map_program("other"),
        )
        .await
        .expect("program in b");
    let programs_a: Api<Program> = Api::namespaced(plane.client(), &a);
    programs_a
        .create(
            &PostParams::default(),
            &fixtures::program("hello", json!({"outputs": {"message": "hello-scoped"}})),
        )
        .await
        .expect("program in a");
    let stacks: Api<Stack> = Api::namespaced(plane.client(), &a);
    stacks
        .create(
            &PostParams::default(),
            &fixtures::file_backend_stack(
                "hello",
                &backend,
                json!({"programRef": {"name": "hello"}}),
            ),
        )
        .await
        .expect("stack");
    let ready = wait_for("the stack's outputs", WAIT, || async {
        let status = stacks.get("hello").await.ok()?.status?;
        let ready = status
            .conditions
            .iter()
            .any(|c| c.type_ == "Ready" && c.status == "True");
        (ready && status.outputs.get("message") == Some(&json!("hello-scoped"))).then_some(())
    })
    .await;
    if let Err(e) = ready {
        panic!(
            "{e}: {:?}\n{}\n--- operator ---\n{}",
            stacks.get("hello").await.ok().and_then(|s| s.status),
            kubelet.logs("hello"),
            operator.log_text()
        );
    }
    wait_for("an artifact for the Program in b", WAIT, || async {
        let p = programs_b.get("other").await.ok()?;
        let status = serde_json::to_value(p).ok()?["status"].clone();
        status["artifact"]["url"].as_str().map(str::to_owned)
    })
    .await
    .unwrap_or_else(|e| panic!("{e}\n{}", operator.log_text()));

    let log = operator.log_text();
    assert!(
        log.contains("namespace-scoped: watching these namespaces only"),
        "{log}"
    );
    let requests = requests_of(&plane, &user);
    assert!(
        requests.iter().any(|r| r.verb == "watch"),
        "no request of {user} in the audit log"
    );
    let forbidden: Vec<&Request> = requests.iter().filter(|r| r.code == 403).collect();
    assert!(forbidden.is_empty(), "forbidden requests: {forbidden:#?}");
    let cluster_wide: Vec<&Request> = requests
        .iter()
        .filter(|r| {
            matches!(r.verb.as_str(), "list" | "watch")
                && (r.namespace.is_none() || !r.uri.contains("/namespaces/"))
        })
        .collect();
    assert!(
        cluster_wide.is_empty(),
        "cluster-wide list/watch: {cluster_wide:#?}"
    );
    // Only the watched namespaces and the operator's own one are touched.
    let touched: BTreeSet<&str> = requests
        .iter()
        .filter_map(|r| r.namespace.as_deref())
        .collect();
    let allowed = BTreeSet::from([a.as_str(), b.as_str(), op.as_str()]);
    assert!(touched.is_subset(&allowed), "{touched:?}");
    assert!(touched.contains(b.as_str()), "{touched:?}");
    drop(operator);
}
