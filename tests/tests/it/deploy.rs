//! deploy/ (kustomize) and the Dockerfile, checked statically and against the real apiserver:
//! the rendered install must be complete and consistent (selectors match the pods, ports
//! exist), apply with server-side apply, give the operator what it needs and no cluster-wide
//! Secret list/watch (SubjectAccessReviews), and pass the `restricted` Pod Security admission.
//!
//! This binary has its own control plane; the apply installs into `pko-rs-system` with its own
//! field manager and `--force-conflicts`, so it never fights the harness over the CRDs.

use std::collections::BTreeMap;
use std::process::Command;
use std::sync::{Mutex, PoisonError};

use k8s_openapi::api::authorization::v1::{
    ResourceAttributes, SubjectAccessReview, SubjectAccessReviewSpec,
};
use k8s_openapi::api::core::v1::Pod;
use kube::Api;
use kube::api::PostParams;
use pko_tests::command::run;
use pko_tests::{ControlPlane, repo_root};
use serde::Deserialize;
use serde_json::{Value, json};

const NAMESPACE: &str = "pko-rs-system";
const SERVICE_ACCOUNT: &str = "pko-rs-operator";
const APPLY_MANAGER: &str = "pko-rs-deploy-test";

/// `kubectl kustomize deploy`, parsed.
fn render(plane: &ControlPlane) -> Vec<Value> {
    let mut cmd = plane.kubectl();
    cmd.arg("kustomize").arg(repo_root().join("deploy"));
    let text = run(&mut cmd, None, "kubectl kustomize deploy");
    yaml_serde::Deserializer::from_str(&text)
        .map(|doc| Value::deserialize(doc).expect("rendered YAML parses"))
        .filter(|v| !v.is_null())
        .collect()
}

fn of_kind<'a>(objects: &'a [Value], kind: &str) -> Vec<&'a Value> {
    objects.iter().filter(|o| o["kind"] == kind).collect()
}

fn named<'a>(objects: &'a [Value], kind: &str, name: &str) -> &'a Value {
    objects
        .iter()
        .find(|o| o["kind"] == kind && o["metadata"]["name"] == name)
        .unwrap_or_else(|| panic!("no {kind} {name} in the rendered install"))
}

fn strings(v: &Value) -> Vec<&str> {
    v.as_array()
        .map(|a| a.iter().filter_map(Value::as_str).collect())
        .unwrap_or_default()
}

/// Whether `labels` satisfies the `matchLabels` of `selector` (an empty selector matches all).
fn matches(selector: &Value, labels: &Value) -> bool {
    selector
        .as_object()
        .map(|m| m.iter().all(|(k, v)| labels.get(k) == Some(v)))
        .unwrap_or(true)
}

#[tokio::test]
async fn kustomize_renders_a_complete_consistent_install() {
    let _machine = pko_tests::serial::shared().await;
    let plane = ControlPlane::shared_apart().await;
    let objects = render(plane);

    // Every CRD in deploy/crds is part of the install.
    let crds: Vec<&str> = of_kind(&objects, "CustomResourceDefinition")
        .iter()
        .filter_map(|c| c["metadata"]["name"].as_str())
        .collect();
    for crd in [
        "programs.pulumi.com",
        "stacks.pulumi.com",
        "workspaces.auto.pulumi.com",
        "updates.auto.pulumi.com",
    ] {
        assert!(crds.contains(&crd), "{crd} missing from {crds:?}");
    }
    named(&objects, "Namespace", NAMESPACE);
    named(&objects, "ServiceAccount", SERVICE_ACCOUNT);
    named(&objects, "ClusterRole", "pko-rs-operator");
    named(&objects, "Role", "pko-rs-leader-election");

    // The bindings name our service account and roles that exist.
    for kind in ["ClusterRoleBinding", "RoleBinding"] {
        for binding in of_kind(&objects, kind) {
            let role = &binding["roleRef"];
            named(
                &objects,
                role["kind"].as_str().expect("roleRef.kind"),
                role["name"].as_str().expect("roleRef.name"),
            );
            assert!(
                binding["subjects"]
                    .as_array()
                    .is_some_and(|s| s.iter().any(|s| {
                        s["kind"] == "ServiceAccount"
                            && s["name"] == SERVICE_ACCOUNT
                            && s["namespace"] == NAMESPACE
                    })),
                "{binding}"
            );
        }
    }

    // Deployment: 2 replicas, restricted security context, probes, resources, leader election.
    let deployment = named(&objects, "Deployment", "pko-rs-operator");
    assert_eq!(deployment["metadata"]["namespace"], NAMESPACE);
    assert_eq!(deployment["spec"]["replicas"], 2);
    let template = &deployment["spec"]["template"];
    let pod_labels = &template["metadata"]["labels"];
    assert!(matches(
        &deployment["spec"]["selector"]["matchLabels"],
        pod_labels
    ));
    let pod = &template["spec"];
    assert_eq!(pod["serviceAccountName"], SERVICE_ACCOUNT);
    assert_eq!(pod["securityContext"]["runAsNonRoot"], true);
    assert!(pod["securityContext"]["runAsUser"].as_i64().unwrap_or(0) > 0);
    assert_eq!(
        pod["securityContext"]["seccompProfile"]["type"],
        "RuntimeDefault"
    );
    let containers = pod["containers"].as_array().expect("containers");
    assert_eq!(containers.len(), 1);
    let container = &containers[0];
    let security = &container["securityContext"];
    assert_eq!(security["allowPrivilegeEscalation"], false);
    assert_eq!(security["readOnlyRootFilesystem"], true);
    assert_eq!(strings(&security["capabilities"]["drop"]), ["ALL"]);
    let args = strings(&container["args"]);
    assert!(args.contains(&"--leader-elect"), "{args:?}");
    // The operator knows every flag the Deployment passes (clap refuses an unknown one before
    // it reaches `--help`).
    let parsed = Command::new(pko_tests::operator::operator_binary().expect("operator binary"))
        .args(&args)
        .arg("--help")
        .output()
        .expect("run the operator");
    assert!(
        parsed.status.success(),
        "{args:?}: {}",
        String::from_utf8_lossy(&parsed.stderr)
    );
    // Read-only root filesystem: the plugin cache is the one writable mount.
    let cache_dir = args
        .iter()
        .find_map(|a| a.strip_prefix("--plugin-cache-dir="))
        .expect("--plugin-cache-dir");
    let mounts = container["volumeMounts"].as_array().expect("volumeMounts");
    assert!(
        mounts.iter().any(|m| m["mountPath"] == cache_dir),
        "{mounts:?}"
    );
    for probe in ["livenessProbe", "readinessProbe"] {
        assert!(container[probe]["httpGet"]["path"].is_string(), "{probe}");
    }
    assert_eq!(container["readinessProbe"]["httpGet"]["path"], "/readyz");
    assert_eq!(container["livenessProbe"]["httpGet"]["path"], "/healthz");
    assert!(container["resources"]["requests"]["memory"].is_string());
    assert!(container["resources"]["limits"]["memory"].is_string());
    let env: Vec<&str> = container["env"]
        .as_array()
        .map(|e| e.iter().filter_map(|v| v["name"].as_str()).collect())
        .unwrap_or_default();
    assert!(env.contains(&"POD_NAMESPACE") && env.contains(&"POD_NAME"));
    let ports: BTreeMap<&str, i64> = container["ports"]
        .as_array()
        .expect("ports")
        .iter()
        .map(|p| {
            (
                p["name"].as_str().expect("port name"),
                p["containerPort"].as_i64().expect("port"),
            )
        })
        .collect();
    // The ports the flags bind are the ports the container declares.
    for (flag, port) in [
        ("--program-fs-addr=:", "http-fileserver"),
        ("--health-probe-bind-address=:", "http-probes"),
        ("--metrics-bind-address=:", "http-metrics"),
    ] {
        let bound = args
            .iter()
            .find_map(|a| a.strip_prefix(flag))
            .unwrap_or_else(|| panic!("{flag} missing"));
        assert_eq!(
            bound.parse::<i64>().ok(),
            ports.get(port).copied(),
            "{flag}"
        );
    }
    for probe in ["livenessProbe", "readinessProbe"] {
        let port = container[probe]["httpGet"]["port"].as_str().expect("named");
        assert!(ports.contains_key(port), "{probe} port {port}");
    }

    // Services select our pods and target declared ports.
    let services = of_kind(&objects, "Service");
    for name in ["pko-rs-fileserver", "pko-rs-metrics"] {
        named(&objects, "Service", name);
    }
    for service in &services {
        assert!(
            matches(&service["spec"]["selector"], pod_labels),
            "{service}"
        );
        for port in service["spec"]["ports"].as_array().expect("ports") {
            let target = port["targetPort"].as_str().expect("named targetPort");
            assert!(ports.contains_key(target), "{target}");
        }
    }
    // The advertised artifact address is the file-server Service.
    assert!(
        args.contains(&"--program-fs-adv-addr=pko-rs-fileserver.$(POD_NAMESPACE):80"),
        "{args:?}"
    );

    // The NetworkPolicy selects our pods (PKO's does not) and opens declared ports only.
    let policy = named(&objects, "NetworkPolicy", "pko-rs-operator");
    assert!(
        matches(&policy["spec"]["podSelector"]["matchLabels"], pod_labels),
        "{policy}"
    );
    let mut opened = Vec::new();
    for rule in policy["spec"]["ingress"].as_array().expect("ingress") {
        for port in rule["ports"].as_array().expect("ports") {
            let name = port["port"].as_str().expect("named port");
            assert!(ports.contains_key(name), "{name}");
            opened.push(name);
        }
    }
    for port in ports.keys() {
        assert!(opened.contains(port), "{port} not reachable");
    }

    let pdb = named(&objects, "PodDisruptionBudget", "pko-rs-operator");
    assert!(matches(&pdb["spec"]["selector"]["matchLabels"], pod_labels));

    // Aggregated roles extend the built-in ones to our kinds.
    let edit = named(&objects, "ClusterRole", "pko-rs-edit");
    let view = named(&objects, "ClusterRole", "pko-rs-view");
    let labels = |r: &Value, l: &str| r["metadata"]["labels"][l] == "true";
    assert!(labels(edit, "rbac.authorization.k8s.io/aggregate-to-edit"));
    assert!(labels(edit, "rbac.authorization.k8s.io/aggregate-to-admin"));
    assert!(labels(view, "rbac.authorization.k8s.io/aggregate-to-view"));
}

/// Whether one RBAC rule lets its holder list or watch Secrets.
fn grants_secret_list_or_watch(rule: &Value) -> bool {
    let groups = strings(&rule["apiGroups"]);
    let resources = strings(&rule["resources"]);
    let verbs = strings(&rule["verbs"]);
    (groups.contains(&"") || groups.contains(&"*"))
        && (resources.contains(&"secrets") || resources.contains(&"*"))
        && verbs.iter().any(|v| matches!(*v, "list" | "watch" | "*"))
}

#[test]
fn secret_rule_detector_catches_wildcards() {
    let _machine = pko_tests::serial::shared_blocking();
    assert!(grants_secret_list_or_watch(
        &json!({"apiGroups": [""], "resources": ["secrets"], "verbs": ["get", "list"]})
    ));
    assert!(grants_secret_list_or_watch(
        &json!({"apiGroups": ["*"], "resources": ["*"], "verbs": ["*"]})
    ));
    assert!(!grants_secret_list_or_watch(
        &json!({"apiGroups": [""], "resources": ["secrets"], "verbs": ["get", "create"]})
    ));
    assert!(!grants_secret_list_or_watch(
        &json!({"apiGroups": ["apps"], "resources": ["*"], "verbs": ["list"]})
    ));
}

#[tokio::test]
async fn no_cluster_role_lists_or_watches_secrets() {
    let _machine = pko_tests::serial::shared().await;
    let plane = ControlPlane::shared_apart().await;
    let objects = render(plane);
    let cluster_roles = of_kind(&objects, "ClusterRole");
    assert!(!cluster_roles.is_empty());
    for role in cluster_roles {
        for rule in role["rules"].as_array().into_iter().flatten() {
            assert!(
                !grants_secret_list_or_watch(rule),
                "ClusterRole {} grants list/watch on Secrets: {rule}",
                role["metadata"]["name"]
            );
        }
    }
}

/// Applies deploy/ once to the plane apart (the tests below share the result).
fn apply_once(plane: &ControlPlane) {
    static APPLIED: Mutex<bool> = Mutex::new(false);
    let mut applied = APPLIED.lock().unwrap_or_else(PoisonError::into_inner);
    if *applied {
        return;
    }
    let mut cmd = plane.kubectl();
    cmd.args(["apply", "--server-side", "--force-conflicts"])
        .arg(format!("--field-manager={APPLY_MANAGER}"))
        .arg("-k")
        .arg(repo_root().join("deploy"));
    let out = run(&mut cmd, None, "kubectl apply --server-side -k deploy/");
    assert!(
        out.contains("deployment.apps/pko-rs-operator serverside-applied"),
        "{out}"
    );
    *applied = true;
}

async fn apply(plane: &'static ControlPlane) {
    // kubectl is a blocking child process; keep the test runtime free meanwhile.
    tokio::task::spawn_blocking(move || apply_once(plane))
        .await
        .expect("apply task");
}

/// (verb, API group, resource[/subresource], namespace, name) of one access check.
type Access<'a> = (&'a str, &'a str, &'a str, Option<&'a str>, Option<&'a str>);

/// Whether the operator's service account may do `verb` on `resource`.
async fn may(
    api: &Api<SubjectAccessReview>,
    verb: &str,
    group: &str,
    resource: &str,
    namespace: Option<&str>,
    name: Option<&str>,
) -> bool {
    let (resource, subresource) = match resource.split_once('/') {
        Some((r, s)) => (r, Some(s.to_owned())),
        None => (resource, None),
    };
    let review = SubjectAccessReview {
        spec: SubjectAccessReviewSpec {
            user: Some(format!(
                "system:serviceaccount:{NAMESPACE}:{SERVICE_ACCOUNT}"
            )),
            groups: Some(vec![
                "system:serviceaccounts".into(),
                format!("system:serviceaccounts:{NAMESPACE}"),
                "system:authenticated".into(),
            ]),
            resource_attributes: Some(ResourceAttributes {
                verb: Some(verb.into()),
                group: Some(group.into()),
                resource: Some(resource.into()),
                subresource,
                namespace: namespace.map(str::to_owned),
                name: name.map(str::to_owned),
                ..ResourceAttributes::default()
            }),
            ..SubjectAccessReviewSpec::default()
        },
        ..SubjectAccessReview::default()
    };
    let answer = api
        .create(&PostParams::default(), &review)
        .await
        .expect("SubjectAccessReview");
    answer.status.is_some_and(|s| s.allowed)
}

#[tokio::test]
async fn server_side_apply_gives_the_operator_least_privilege() {
    let _machine = pko_tests::serial::shared().await;
    let plane = ControlPlane::shared_apart().await;
    apply(plane).await;
    let api: Api<SubjectAccessReview> = Api::all(plane.client());
    let lease = Some("pko-rs-operator");
    let own = Some(NAMESPACE);
    let tenant = Some("team-a");

    let needed: &[Access] = &[
        // Program watch (file server, every replica) and controller.
        ("list", "pulumi.com", "programs", None, None),
        ("watch", "pulumi.com", "programs", None, None),
        ("get", "pulumi.com", "programs", tenant, None),
        ("patch", "pulumi.com", "programs/status", tenant, None),
        // Stack gauges (every replica).
        ("list", "pulumi.com", "stacks", None, None),
        ("watch", "pulumi.com", "stacks", None, None),
        // Flux sources: read, and watched per kind (cluster-wide for this install).
        (
            "get",
            "source.toolkit.fluxcd.io",
            "gitrepositories",
            tenant,
            None,
        ),
        (
            "list",
            "source.toolkit.fluxcd.io",
            "gitrepositories",
            None,
            None,
        ),
        (
            "watch",
            "source.toolkit.fluxcd.io",
            "ocirepositories",
            None,
            None,
        ),
        (
            "watch",
            "source.toolkit.fluxcd.io",
            "externalartifacts",
            None,
            None,
        ),
        // Events from the controllers.
        ("create", "events.k8s.io", "events", tenant, None),
        ("patch", "events.k8s.io", "events", tenant, None),
        // The leader Lease.
        ("create", "coordination.k8s.io", "leases", own, None),
        ("get", "coordination.k8s.io", "leases", own, lease),
        ("patch", "coordination.k8s.io", "leases", own, lease),
        ("update", "coordination.k8s.io", "leases", own, lease),
        // The artifact URL keys: created once, read by every replica, rotated by the leader.
        ("create", "", "secrets", own, None),
        ("get", "", "secrets", own, Some("pko-rs-artifact-keys")),
        ("patch", "", "secrets", own, Some("pko-rs-artifact-keys")),
        // The file server's Service, for its ClusterIP in the URL rule.
        ("get", "", "services", own, Some("pko-rs-fileserver")),
    ];
    for &(verb, group, resource, namespace, name) in needed {
        assert!(
            may(&api, verb, group, resource, namespace, name).await,
            "operator may not {verb} {group}/{resource} in {namespace:?} ({name:?})"
        );
    }
    let denied: &[Access] = &[
        // No cluster-wide Secret list/watch (PKO caches every Secret in the cluster).
        ("list", "", "secrets", None, None),
        ("watch", "", "secrets", None, None),
        ("list", "", "secrets", tenant, None),
        ("watch", "", "secrets", own, None),
        // Leases: only our own, only in our namespace.
        (
            "get",
            "coordination.k8s.io",
            "leases",
            Some("kube-system"),
            lease,
        ),
        (
            "patch",
            "coordination.k8s.io",
            "leases",
            own,
            Some("someone-else"),
        ),
        ("delete", "coordination.k8s.io", "leases", own, lease),
        // Users' objects are theirs to delete; RBAC is not ours to grant.
        ("delete", "pulumi.com", "programs", tenant, None),
        ("delete", "pulumi.com", "stacks", tenant, None),
        // Flux's sources are read, never written.
        (
            "patch",
            "source.toolkit.fluxcd.io",
            "gitrepositories",
            tenant,
            None,
        ),
        (
            "create",
            "rbac.authorization.k8s.io",
            "clusterrolebindings",
            None,
            None,
        ),
        (
            "create",
            "rbac.authorization.k8s.io",
            "rolebindings",
            tenant,
            None,
        ),
    ];
    for &(verb, group, resource, namespace, name) in denied {
        assert!(
            !may(&api, verb, group, resource, namespace, name).await,
            "operator may {verb} {group}/{resource} in {namespace:?} ({name:?})"
        );
    }
}

#[tokio::test]
async fn operator_pod_passes_restricted_pod_security() {
    let _machine = pko_tests::serial::shared().await;
    let plane = ControlPlane::shared_apart().await;
    apply(plane).await;
    let objects = render(plane);
    let deployment = named(&objects, "Deployment", "pko-rs-operator");
    let template = &deployment["spec"]["template"];
    // The namespace enforces `restricted`; a server-side dry run of the Deployment's pod runs
    // the Pod Security admission without needing a kubelet.
    let pod: Pod = serde_json::from_value(json!({
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "pko-rs-operator-dry-run", "labels": template["metadata"]["labels"]},
        "spec": template["spec"],
    }))
    .expect("pod from template");
    let pods: Api<Pod> = Api::namespaced(plane.client(), NAMESPACE);
    let params = PostParams {
        dry_run: true,
        ..PostParams::default()
    };
    pods.create(&params, &pod)
        .await
        .expect("the operator pod is admitted under restricted Pod Security");

    // And a pod that is not restricted is refused there, so the check above means something.
    let mut loose = serde_json::to_value(&pod).expect("pod json");
    loose["spec"]["containers"][0]["securityContext"]["allowPrivilegeEscalation"] = json!(true);
    let loose: Pod = serde_json::from_value(loose).expect("pod");
    let refused = pods.create(&params, &loose).await;
    assert!(
        refused.is_err(),
        "Pod Security admission did not refuse a privileged pod"
    );
}

/// Recipe lines `make -n <target>` would run, with `vars` set as on its command line.
fn make_dry_run(target: &str, vars: &[String]) -> String {
    let mut cmd = Command::new("make");
    cmd.current_dir(repo_root())
        .arg("-n")
        .arg(target)
        .args(vars)
        .env_remove("CARGO_TARGET_DIR")
        .env_remove("MAKEFLAGS")
        // As in an image build: nothing from the developer's environment.
        .env_remove("PKO_PLUGINS_DIR")
        .env_remove("PKO_POLICY_BUNDLE")
        .env_remove("PKO_TOOLS_CACHE")
        .env_remove("PKO_AGENT_BINARY");
    run(&mut cmd, None, &format!("make -n {target}"))
}

#[test]
fn dockerfile_builds_with_make_and_copies_only_make_outputs() {
    let _machine = pko_tests::serial::shared_blocking();
    let text = std::fs::read_to_string(repo_root().join("Dockerfile")).expect("Dockerfile");
    // Join continuation lines.
    let joined = text.replace("\\\n", " ");
    let lines: Vec<&str> = joined
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty() && !l.starts_with('#'))
        .collect();

    let stages: Vec<&str> = lines
        .iter()
        .filter(|l| l.starts_with("FROM "))
        .copied()
        .collect();
    assert!(stages.len() >= 2, "multi-stage: {stages:?}");

    // Every RUN of the build is `make <target> VAR=value…`.
    let mut outputs = String::new();
    let runs: Vec<&str> = lines
        .iter()
        .filter(|l| l.starts_with("RUN "))
        .copied()
        .collect();
    assert!(!runs.is_empty());
    for run_line in runs {
        let command = run_line
            .split_whitespace()
            .skip(1)
            .skip_while(|w| w.starts_with("--mount="))
            .collect::<Vec<_>>();
        assert_eq!(command.first(), Some(&"make"), "{run_line}");
        let target = command.get(1).expect("a make target");
        let vars: Vec<String> = command[2..].iter().map(|s| s.to_string()).collect();
        assert!(vars.iter().all(|v| v.contains('=')), "{run_line}");
        outputs.push_str(&make_dry_run(target, &vars));
    }

    // Every file copied from a build stage is written by one of those targets.
    let copies: Vec<&str> = lines
        .iter()
        .filter(|l| l.starts_with("COPY --from="))
        .copied()
        .collect();
    assert!(!copies.is_empty());
    for copy in copies {
        // COPY --from=stage [--chown=…] sources… destination
        let words: Vec<&str> = copy
            .split_whitespace()
            .filter(|w| !w.starts_with("--"))
            .collect();
        let sources = &words[1..words.len() - 1];
        for source in sources {
            assert!(
                outputs
                    .lines()
                    .any(|l| l.starts_with("install ") && l.ends_with(&format!(" {source}"))),
                "{source} is not written by the make targets the Dockerfile runs:\n{outputs}"
            );
        }
    }
    // The release binary comes from the locked workspace.
    assert!(
        outputs.contains("cargo build --locked --release -p pko-operator"),
        "{outputs}"
    );

    // Runtime stage: numeric non-root user, no build tools.
    let last_stage = joined
        .rsplit_once("\nFROM ")
        .map(|(_, s)| s)
        .expect("runtime stage");
    let user = last_stage
        .lines()
        .find_map(|l| l.trim().strip_prefix("USER "))
        .expect("USER in the runtime stage");
    let (uid, gid) = user.trim().split_once(':').expect("uid:gid");
    let uid: u32 = uid.parse().expect("numeric uid");
    let _: u32 = gid.parse().expect("numeric gid");
    assert_ne!(uid, 0, "runs as root");
    assert!(!last_stage.contains("\nRUN "), "runtime stage runs nothing");
}

/// Both webhook configurations skip the webhook exactly for an object being deleted whose spec
/// stays the same (the condition the test harness registers too, so the behaviour tests run
/// it on the real apiserver).
#[test]
fn webhooks_let_go_of_deleted_objects_without_the_operator() {
    let _machine = pko_tests::serial::shared_blocking();
    for file in [
        "deploy/webhook/validating.yaml",
        "deploy/webhook/mutating.yaml",
    ] {
        let text = std::fs::read_to_string(repo_root().join(file)).expect("webhook manifest");
        let config: Value = yaml_serde::from_str(&text).expect("yaml");
        for webhook in config["webhooks"].as_array().expect("webhooks") {
            let conditions = webhook["matchConditions"]
                .as_array()
                .expect("matchConditions");
            assert_eq!(conditions.len(), 1, "{file}");
            assert_eq!(
                conditions[0]["expression"].as_str(),
                Some(pko_admission::MATCH_CONDITION),
                "{file}"
            );
        }
    }
}
