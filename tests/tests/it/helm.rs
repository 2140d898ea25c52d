//! deploy/helm/pko-rs: `helm lint`, one source of truth with the kustomize manifests (release
//! `pko-rs` of the chart renders the objects of `kubectl kustomize deploy/`, and its namespaces
//! scope those of deploy/overlays/namespaced, but for Helm's own labels), and `helm template`
//! accepted by the real apiserver (server-side apply, dry run). Releases side by side, the
//! templated CRDs, cert-manager mode and installs from an OCI registry are in chart.rs.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::process::Command;

use pko_tests::command::run;
use pko_tests::{ControlPlane, repo_root, tool_dir};
use serde::Deserialize;
use serde_json::Value;

const RELEASE_NAMESPACE: &str = "pko-rs-system";

pub(crate) fn chart() -> PathBuf {
    repo_root().join("deploy/helm/pko-rs")
}

pub(crate) fn helm() -> Command {
    let dir = tool_dir("helm").unwrap_or_else(|e| panic!("{e}"));
    let mut cmd = Command::new(dir.join("helm"));
    // No user or machine state: repositories, plugins and caches of the caller stay out.
    let home = std::env::temp_dir().join("pko-rs-helm-home");
    cmd.env("HELM_CONFIG_HOME", home.join("config"))
        .env("HELM_CACHE_HOME", home.join("cache"))
        .env("HELM_DATA_HOME", home.join("data"));
    cmd
}

/// `helm template` of release `pko-rs` of the chart into `namespace` with `sets`
/// (`key=value`).
pub(crate) fn template(namespace: &str, sets: &[&str]) -> String {
    template_release("pko-rs", namespace, sets)
}

/// `helm template` of release `release` of the chart into `namespace` with `sets`.
pub(crate) fn template_release(release: &str, namespace: &str, sets: &[&str]) -> String {
    let mut cmd = helm();
    cmd.args(["template", release])
        .arg(chart())
        .args(["--namespace", namespace]);
    for set in sets {
        cmd.args(["--set", set]);
    }
    run(&mut cmd, None, &format!("helm template {release} {sets:?}"))
}

/// `helm template` of release `pko-rs` of the chart into `namespace` with the values file
/// `values` and `sets` on top.
pub(crate) fn template_with_values(
    namespace: &str,
    values: &std::path::Path,
    sets: &[&str],
) -> String {
    let mut cmd = helm();
    cmd.args(["template", "pko-rs"])
        .arg(chart())
        .args(["--namespace", namespace, "--values"])
        .arg(values);
    for set in sets {
        cmd.args(["--set", set]);
    }
    run(
        &mut cmd,
        None,
        &format!("helm template -f {} {sets:?}", values.display()),
    )
}

/// The labels and annotations only Helm installs have: the release's instance, the chart and
/// app versions, the manager, and the CRDs' keep policy. deploy/ has none of them, and its
/// selectors select by name only (its Deployment's selector cannot change in place).
const HELM_ONLY_KEYS: [&str; 5] = [
    "app.kubernetes.io/instance",
    "app.kubernetes.io/version",
    "app.kubernetes.io/managed-by",
    "helm.sh/chart",
    "helm.sh/resource-policy",
];

/// `v` without [`HELM_ONLY_KEYS`], wherever they are (labels, annotations, selectors), and
/// without the annotations that leaves empty.
fn without_helm_only_keys(v: &mut Value) {
    match v {
        Value::Array(items) => items.iter_mut().for_each(without_helm_only_keys),
        Value::Object(map) => {
            for key in HELM_ONLY_KEYS {
                map.remove(key);
            }
            map.values_mut().for_each(without_helm_only_keys);
            if map
                .get("annotations")
                .and_then(Value::as_object)
                .is_some_and(serde_json::Map::is_empty)
            {
                map.remove("annotations");
            }
        }
        _ => {}
    }
}

/// The chart's image tag deploy/ uses (the chart defaults to its appVersion).
const KUSTOMIZE_TAG: &str = "image.tag=latest";

pub(crate) fn parse(text: &str) -> Vec<Value> {
    yaml_serde::Deserializer::from_str(text)
        .map(|doc| Value::deserialize(doc).expect("rendered YAML parses"))
        .filter(|v| !v.is_null())
        .collect()
}

fn kustomize(plane: &ControlPlane, dir: &str) -> Vec<Value> {
    let mut cmd = plane.kubectl();
    cmd.arg("kustomize").arg(repo_root().join(dir));
    parse(&run(&mut cmd, None, &format!("kubectl kustomize {dir}")))
}

/// 1.0 and 1 are one number to the apiserver; YAML parsers keep them apart.
fn normalize_numbers(v: &mut Value) {
    match v {
        Value::Number(n) => {
            if let Some(f) = n.as_f64().filter(|f| f.fract() == 0.0 && n.is_f64()) {
                #[allow(clippy::cast_possible_truncation, reason = "integral, checked above")]
                let i = f as i64;
                *v = Value::from(i);
            }
        }
        Value::Array(items) => items.iter_mut().for_each(normalize_numbers),
        Value::Object(map) => map.values_mut().for_each(normalize_numbers),
        _ => {}
    }
}

/// The objects by (kind, namespace, name), comparable: numbers normalized; the Namespace left
/// out (Helm installs into an existing one, `--create-namespace`); Helm's own labels and
/// annotations left out.
fn comparable(objects: Vec<Value>) -> BTreeMap<(String, String, String), Value> {
    objects
        .into_iter()
        .filter(|o| o["kind"] != "Namespace")
        .map(|mut o| {
            normalize_numbers(&mut o);
            without_helm_only_keys(&mut o);
            let key = (
                o["kind"].as_str().unwrap_or_default().to_owned(),
                o["metadata"]["namespace"]
                    .as_str()
                    .unwrap_or_default()
                    .to_owned(),
                o["metadata"]["name"]
                    .as_str()
                    .unwrap_or_default()
                    .to_owned(),
            );
            (key, o)
        })
        .collect()
}

fn assert_same(chart: Vec<Value>, kustomize: Vec<Value>, what: &str) {
    let (chart, kustomize) = (comparable(chart), comparable(kustomize));
    let only = |a: &BTreeMap<_, Value>, b: &BTreeMap<_, Value>| -> Vec<(String, String, String)> {
        a.keys().filter(|k| !b.contains_key(*k)).cloned().collect()
    };
    assert!(
        only(&chart, &kustomize).is_empty() && only(&kustomize, &chart).is_empty(),
        "{what}: only in the chart: {:?}; only in kustomize: {:?}",
        only(&chart, &kustomize),
        only(&kustomize, &chart)
    );
    for (key, object) in &chart {
        assert_eq!(
            object, &kustomize[key],
            "{what}: {key:?} differs (left: chart, right: kustomize)"
        );
    }
}

#[test]
fn helm_lint_passes_for_each_scope() {
    for sets in [
        &[][..],
        &["scope.mode=namespaces", "scope.namespaces={a,b}"][..],
        &["serviceMonitor.enabled=true", "webhook.enabled=false"][..],
        &["metricsSecure=true", "serviceMonitor.enabled=true"][..],
        &[
            "metricsSecure=true",
            "metricsCertSecret=metrics-tls",
            "serviceMonitor.enabled=true",
        ][..],
        &["webhook.certManager.enabled=true", "crds.install=false"][..],
        &[
            "webhook.certManager.enabled=true",
            "webhook.certManager.issuerRef.name=corp-ca",
            "webhook.certManager.issuerRef.kind=ClusterIssuer",
            "crds.keep=false",
        ][..],
        &[
            "nameOverride=ops",
            "image.registry=registry.example",
            "extraVolumes[0].name=ca",
            "extraVolumes[0].configMap.name=ca",
            "extraVolumeMounts[0].name=ca",
            "extraVolumeMounts[0].mountPath=/etc/ca",
        ][..],
    ] {
        let mut cmd = helm();
        cmd.args(["lint", "--strict", "--namespace", RELEASE_NAMESPACE])
            .arg(chart());
        for set in sets {
            cmd.args(["--set", set]);
        }
        let out = run(&mut cmd, None, &format!("helm lint --strict {sets:?}"));
        assert!(out.contains("0 chart(s) failed"), "{out}");
    }
}

#[test]
fn an_unknown_scope_is_refused() {
    let mut cmd = helm();
    cmd.args(["template", "pko-rs"])
        .arg(chart())
        .args(["--set", "scope.mode=namespace"]);
    let out = cmd.output().expect("run helm");
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("scope.mode must be cluster or namespaces"),
        "{err}"
    );
}

#[tokio::test]
async fn chart_defaults_render_the_kustomize_install() {
    let _machine = pko_tests::serial::shared().await;
    let plane = ControlPlane::shared().await;
    let chart = parse(&template(RELEASE_NAMESPACE, &[KUSTOMIZE_TAG]));
    assert_same(
        chart,
        kustomize(plane, "deploy"),
        "chart defaults vs deploy/",
    );
}

#[tokio::test]
async fn chart_namespaces_scope_renders_the_namespaced_overlay() {
    let _machine = pko_tests::serial::shared().await;
    let plane = ControlPlane::shared().await;
    let chart = parse(&template(
        RELEASE_NAMESPACE,
        &["scope.mode=namespaces", "crds.install=false", KUSTOMIZE_TAG],
    ));
    assert_same(
        chart,
        kustomize(plane, "deploy/overlays/namespaced"),
        "chart scope=namespaces vs deploy/overlays/namespaced",
    );
}

/// `path` relative to `from` (both absolute): kustomize takes no absolute paths.
fn relative(path: &std::path::Path, from: &std::path::Path) -> PathBuf {
    let depth = from.components().count().saturating_sub(1);
    let mut out: PathBuf = std::iter::repeat_n("..", depth).collect();
    out.extend(path.components().skip(1));
    out
}

#[tokio::test]
async fn chart_secure_metrics_renders_the_base_with_the_secure_metrics_component() {
    let _machine = pko_tests::serial::shared().await;
    let plane = ControlPlane::shared().await;
    let chart = parse(&template(
        RELEASE_NAMESPACE,
        &["metricsSecure=true", KUSTOMIZE_TAG],
    ));
    // An install's own kustomization: deploy/ plus the component.
    let install = tempfile::tempdir().expect("tmp");
    let root = repo_root().canonicalize().expect("repo root");
    let from = install.path().canonicalize().expect("tmp");
    let base = relative(&root.join("deploy"), &from);
    let component = relative(&root.join("deploy/components/secure-metrics"), &from);
    std::fs::write(
        install.path().join("kustomization.yaml"),
        format!(
            "apiVersion: kustomize.config.k8s.io/v1beta1\nkind: Kustomization\nresources: [{}]\ncomponents: [{}]\n",
            base.display(),
            component.display()
        ),
    )
    .expect("kustomization");
    let mut cmd = plane.kubectl();
    cmd.arg("kustomize").arg(install.path());
    let kustomized = parse(&run(
        &mut cmd,
        None,
        "kubectl kustomize of deploy/ + secure-metrics",
    ));
    assert_same(
        chart,
        kustomized,
        "chart metricsSecure=true vs deploy/ + deploy/components/secure-metrics",
    );
}

/// The ServiceMonitor of a secure install scrapes over HTTPS with Prometheus's token, verifying
/// a mounted certificate with its CA and not verifying a self-signed one; a certificate
/// Secret without metricsSecure is refused.
#[test]
fn the_service_monitor_follows_secure_metrics() {
    let monitor = |sets: &[&str]| {
        parse(&template(RELEASE_NAMESPACE, sets))
            .into_iter()
            .find(|o| o["kind"] == "ServiceMonitor")
            .expect("service monitor")["spec"]["endpoints"][0]
            .clone()
    };
    let plain = monitor(&["serviceMonitor.enabled=true"]);
    assert_eq!(plain["port"], "http-metrics");
    assert!(plain.get("scheme").is_none(), "{plain}");
    let secure = monitor(&["serviceMonitor.enabled=true", "metricsSecure=true"]);
    assert_eq!(secure["port"], "https-metrics");
    assert_eq!(secure["scheme"], "https");
    assert_eq!(
        secure["bearerTokenFile"],
        "/var/run/secrets/kubernetes.io/serviceaccount/token"
    );
    assert_eq!(secure["tlsConfig"]["insecureSkipVerify"], true);
    let mounted = monitor(&[
        "serviceMonitor.enabled=true",
        "metricsSecure=true",
        "metricsCertSecret=metrics-tls",
    ]);
    assert_eq!(mounted["tlsConfig"]["ca"]["secret"]["name"], "metrics-tls");
    assert_eq!(
        mounted["tlsConfig"]["serverName"],
        format!("pko-rs-metrics.{RELEASE_NAMESPACE}.svc")
    );
    assert!(mounted["tlsConfig"].get("insecureSkipVerify").is_none());
    let args = deployment_args(&["metricsSecure=true", "metricsCertSecret=metrics-tls"]);
    assert!(
        args.contains(&"--metrics-cert-path=/etc/pko-rs/metrics-tls".to_owned()),
        "{args:?}"
    );

    let mut cmd = helm();
    cmd.args(["template", "pko-rs"])
        .arg(chart())
        .args(["--set", "metricsCertSecret=metrics-tls"]);
    let out = cmd.output().expect("run helm");
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("metricsCertSecret needs metricsSecure: true"),
        "{err}"
    );
}

#[test]
fn namespaces_scope_has_no_cluster_scoped_object_but_the_crds() {
    let objects = parse(&template(
        "op",
        &["scope.mode=namespaces", "scope.namespaces={a,b}"],
    ));
    let cluster: Vec<&Value> = objects
        .iter()
        .filter(|o| o["metadata"]["namespace"].is_null() && o["kind"] != "CustomResourceDefinition")
        .collect();
    assert!(cluster.is_empty(), "cluster-scoped objects: {cluster:?}");
    let roles: std::collections::BTreeSet<(&str, &str)> = objects
        .iter()
        .filter(|o| o["kind"] == "Role" || o["kind"] == "RoleBinding")
        .filter(|o| o["metadata"]["name"] == "pko-rs-operator")
        .map(|o| {
            (
                o["kind"].as_str().unwrap_or_default(),
                o["metadata"]["namespace"].as_str().unwrap_or_default(),
            )
        })
        .collect();
    assert_eq!(
        roles,
        [
            ("Role", "a"),
            ("RoleBinding", "a"),
            ("Role", "b"),
            ("RoleBinding", "b")
        ]
        .into()
    );
    let deployment = objects
        .iter()
        .find(|o| o["kind"] == "Deployment")
        .expect("deployment");
    let args = deployment["spec"]["template"]["spec"]["containers"][0]["args"]
        .as_array()
        .expect("args");
    assert!(
        args.contains(&Value::from("--watch-namespaces=a,b")),
        "{args:?}"
    );
    assert!(
        !args
            .iter()
            .any(|a| a.as_str().is_some_and(|a| a.starts_with("--webhook"))),
        "{args:?}"
    );
}

/// `kubectl apply --server-side --dry-run=server` of `text`: the apiserver validates every
/// object against its schema (CRDs included) without storing anything.
pub(crate) fn dry_run(plane: &ControlPlane, text: &str, what: &str) -> String {
    let mut cmd = plane.kubectl();
    cmd.args([
        "apply",
        "--server-side",
        "--dry-run=server",
        "--force-conflicts",
        "--field-manager=pko-rs-helm-test",
        "-f",
        "-",
    ]);
    run(&mut cmd, Some(text), what)
}

#[tokio::test]
async fn helm_template_applies_with_server_side_dry_run() {
    let _machine = pko_tests::serial::shared().await;
    let plane = ControlPlane::shared().await;
    let op = plane.namespace("helm-op").await.expect("namespace");
    let a = plane.namespace("helm-a").await.expect("namespace");
    let b = plane.namespace("helm-b").await.expect("namespace");
    let cluster = template(
        &op,
        &[
            "replicas=3",
            "logFormat=text",
            "webhook.failurePolicy=Ignore",
            "leaderElection.leaseDuration=90s",
            "metricsSecure=true",
            "metricsCertSecret=metrics-tls",
        ],
    );
    let scoped = format!("scope.namespaces={{{a},{b}}}");
    let namespaced = template(&op, &["scope.mode=namespaces", &scoped]);
    let (plane2, op2) = (plane, op.clone());
    let outputs = tokio::task::spawn_blocking(move || {
        (
            dry_run(plane2, &cluster, "dry run of the cluster scope"),
            dry_run(plane2, &namespaced, "dry run of the namespaces scope"),
        )
    })
    .await
    .expect("dry run task");
    assert!(
        outputs
            .0
            .contains("deployment.apps/pko-rs-operator serverside-applied (server dry run)"),
        "{}",
        outputs.0
    );
    assert!(
        outputs.0.contains(
            "validatingwebhookconfiguration.admissionregistration.k8s.io/pko-rs-validating"
        ),
        "{}",
        outputs.0
    );
    assert!(
        outputs
            .1
            .contains("role.rbac.authorization.k8s.io/pko-rs-operator serverside-applied"),
        "{}",
        outputs.1
    );
    assert!(!outputs.1.contains("clusterrole"), "{}", outputs.1);
    // A dry run stores nothing.
    let deployments: kube::Api<k8s_openapi::api::apps::v1::Deployment> =
        kube::Api::namespaced(plane.client(), &op2);
    assert!(
        deployments
            .get_opt("pko-rs-operator")
            .await
            .expect("get")
            .is_none()
    );
}

/// The operator knows every flag the chart's Deployment passes, whatever the values (clap
/// refuses an unknown flag before it reaches `--help`).
#[test]
fn the_operator_accepts_the_charts_arguments() {
    for sets in [
        &[][..],
        &[
            "scope.mode=namespaces",
            "scope.namespaces={a,b}",
            "logLevel=debug",
            "image.tag=v1",
            "leaderElection.id=other",
            "leaderElection.leaseDuration=90s",
            "leaderElection.renewDeadline=60s",
            "leaderElection.retryPeriod=5s",
            "pluginCache.enabled=false",
            "extraArgs={--max-concurrent-reconciles=50}",
        ][..],
        &["leaderElection.enabled=false", "webhook.enabled=false"][..],
        &["metricsSecure=true", "metricsCertSecret=metrics-tls"][..],
        &["webhook.certManager.enabled=true", "fullnameOverride=ops"][..],
        &[
            "egress.denyPrivateRanges=false",
            "egress.serviceCIDRs={10.96.0.0/12,fd00:10:96::/112}",
            "egress.podCIDRs={10.244.0.0/16}",
            "egress.extraDenyCIDRs={192.0.2.7}",
            "egress.extraMetadataAddresses={203.0.113.9,fd00:ec2::254}",
            "egress.useEnvProxy=true",
        ][..],
    ] {
        let objects = parse(&template(RELEASE_NAMESPACE, sets));
        let deployment = objects
            .iter()
            .find(|o| o["kind"] == "Deployment")
            .expect("deployment");
        let args: Vec<&str> = deployment["spec"]["template"]["spec"]["containers"][0]["args"]
            .as_array()
            .expect("args")
            .iter()
            .filter_map(Value::as_str)
            .collect();
        let parsed = Command::new(pko_tests::operator::operator_binary().expect("operator binary"))
            .args(&args)
            .arg("--help")
            .output()
            .expect("run the operator");
        assert!(
            parsed.status.success(),
            "{sets:?} → {args:?}: {}",
            String::from_utf8_lossy(&parsed.stderr)
        );
    }
}

/// The operator's arguments in the chart's Deployment rendered with `sets`.
fn deployment_args(sets: &[&str]) -> Vec<String> {
    let objects = parse(&template(RELEASE_NAMESPACE, sets));
    let deployment = objects
        .iter()
        .find(|o| o["kind"] == "Deployment")
        .expect("deployment");
    deployment["spec"]["template"]["spec"]["containers"][0]["args"]
        .as_array()
        .expect("args")
        .iter()
        .filter_map(|a| a.as_str().map(str::to_owned))
        .collect()
}

/// The egress rules the operator builds from `args`' `--egress-deny-cidr`.
fn egress_of(args: &[String]) -> pko_operator::egress::EgressPolicy {
    let cidrs: Vec<&str> = args
        .iter()
        .filter_map(|a| a.strip_prefix("--egress-deny-cidr="))
        .flat_map(|list| list.split(','))
        .collect();
    assert!(!cidrs.is_empty(), "no --egress-deny-cidr in {args:?}");
    pko_operator::egress::EgressPolicy::from_args(&pko_operator::egress::EgressArgs {
        deny_cidrs: cidrs
            .iter()
            .map(|c| pko_operator::egress::parse_cidr(c).expect("a CIDR the operator takes"))
            .collect(),
        ..Default::default()
    })
}

/// Issue 23: deploy/ and the chart set no `--egress-deny-cidr`, so tenants' URLs reached the
/// cluster's Services and Pods. A fresh install denies the Service and Pod ranges of the common
/// distributions; with the private ranges opened, the cluster's own must be given.
#[test]
fn a_fresh_install_denies_the_cluster_ranges_and_opening_them_needs_the_clusters_own() {
    use pko_operator::egress::Refused;
    let defaults = egress_of(&deployment_args(&[]));
    for addr in [
        "10.96.0.1",     // kubeadm, kind: Services
        "10.244.3.7",    // flannel, kind: Pods
        "10.42.0.9",     // k3s Pods
        "10.43.0.1",     // k3s Services
        "10.100.0.1",    // EKS Services
        "172.20.0.10",   // EKS Services (the other default)
        "10.0.0.10",     // AKS Services
        "192.168.12.4",  // Calico's default pool
        "100.64.0.10",   // shared range (GKE's non-RFC 1918 option, carrier NAT)
        "fd00:10:96::1", // kind, IPv6 Services
    ] {
        let ip: std::net::IpAddr = addr.parse().expect("ip");
        assert_eq!(defaults.check(ip), Err(Refused::Cluster), "{addr}");
    }
    assert_eq!(defaults.check("140.82.112.3".parse().expect("ip")), Ok(()));

    // Private ranges open: exactly the cluster's own ranges and the extra ones are denied.
    let args = deployment_args(&[
        "egress.denyPrivateRanges=false",
        "egress.serviceCIDRs={10.96.0.0/12}",
        "egress.podCIDRs={10.244.0.0/16}",
        "egress.extraDenyCIDRs={192.168.7.0/24}",
    ]);
    let own = egress_of(&args);
    for (addr, denied) in [
        ("10.96.0.1", true),
        ("10.244.1.1", true),
        ("192.168.7.9", true),
        ("10.1.2.3", false),
        ("192.168.8.1", false),
    ] {
        let ip: std::net::IpAddr = addr.parse().expect("ip");
        assert_eq!(own.check(ip).is_err(), denied, "{addr}: {args:?}");
    }
    assert!(
        !args.iter().any(|a| a == "--egress-use-env-proxy"),
        "{args:?}"
    );

    // Opened without the cluster's ranges: helm refuses, saying what to set.
    for sets in [
        &["egress.denyPrivateRanges=false"][..],
        &[
            "egress.denyPrivateRanges=false",
            "egress.serviceCIDRs={10.96.0.0/12}",
        ][..],
    ] {
        let mut cmd = helm();
        cmd.args(["template", "pko-rs"]).arg(chart());
        for set in sets {
            cmd.args(["--set", set]);
        }
        let out = cmd.output().expect("run helm");
        assert!(!out.status.success(), "{sets:?}");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(
            err.contains("egress.serviceCIDRs and egress.podCIDRs must both be set"),
            "{sets:?}: {err}"
        );
    }
}

/// The chart's alert rules: `promtool check rules` takes them, `promtool test rules` shows
/// each alert firing on the series that should fire it (after its `for`) and not on healthy
/// ones, and `prometheusRule.enabled=true` installs exactly those groups with the given labels.
#[test]
fn prometheus_rules_pass_promtool_and_the_chart_installs_them() {
    let promtool = pko_tests::promtool::promtool().unwrap_or_else(|e| panic!("{e}"));
    let rules = chart().join("files/prometheus-rules.yaml");
    run(
        Command::new(&promtool).args(["check", "rules"]).arg(&rules),
        None,
        "promtool check rules",
    );
    run(
        Command::new(&promtool)
            .args(["test", "rules"])
            .arg(repo_root().join("tests/fixtures/monitoring/prometheus-rules-test.yaml")),
        None,
        "promtool test rules",
    );
    let file: Value = yaml_serde::from_str(&std::fs::read_to_string(&rules).expect("rules"))
        .expect("rules parse");
    let rendered = parse(&template(
        RELEASE_NAMESPACE,
        &[
            "prometheusRule.enabled=true",
            "prometheusRule.labels.release=kps",
        ],
    ));
    let rule = rendered
        .iter()
        .find(|o| o["kind"] == "PrometheusRule")
        .expect("a PrometheusRule");
    assert_eq!(rule["spec"]["groups"], file["groups"]);
    assert_eq!(rule["metadata"]["namespace"], RELEASE_NAMESPACE);
    assert_eq!(rule["metadata"]["labels"]["release"], "kps");
    let off = parse(&template(RELEASE_NAMESPACE, &[]));
    assert!(
        !off.iter().any(|o| o["kind"] == "PrometheusRule"),
        "off by default"
    );
}

/// `grafanaDashboard.enabled=true` puts files/grafana-dashboard.json, unchanged, in a ConfigMap
/// with the sidecar's label, in the namespace asked for; off by default. Its panels are
/// evaluated over a real operator's scrapes in dashboards.rs.
#[test]
fn the_grafana_dashboard_is_installed_as_written() {
    let file: Value = serde_json::from_str(
        &std::fs::read_to_string(chart().join("files/grafana-dashboard.json")).expect("dashboard"),
    )
    .expect("dashboard JSON");
    let rendered = parse(&template(
        RELEASE_NAMESPACE,
        &[
            "grafanaDashboard.enabled=true",
            "grafanaDashboard.namespace=monitoring",
        ],
    ));
    let cm = rendered
        .iter()
        .find(|o| o["kind"] == "ConfigMap" && o["metadata"]["name"] == "pko-rs-grafana-dashboard")
        .expect("the dashboard ConfigMap");
    assert_eq!(cm["metadata"]["namespace"], "monitoring");
    assert_eq!(cm["metadata"]["labels"]["grafana_dashboard"], "1");
    let embedded: Value =
        serde_json::from_str(cm["data"]["pko-rs.json"].as_str().expect("data")).expect("JSON");
    assert_eq!(embedded, file);
    let off = parse(&template(RELEASE_NAMESPACE, &[]));
    assert!(
        !off.iter()
            .any(|o| o["metadata"]["name"] == "pko-rs-grafana-dashboard"),
        "off by default"
    );
}

/// values.schema.json: a misspelt value or one of the wrong type is refused by name, rather
/// than passing silently (the chart ignored unknown keys).
#[test]
fn a_misspelt_or_mistyped_value_is_refused_by_name() {
    for (set, named) in [
        ("replica=3", "'replica' not allowed"),
        ("serviceMonitor.enable=true", "'enable' not allowed"),
        (
            "egress.serviceCIDR={10.96.0.0/12}",
            "'serviceCIDR' not allowed",
        ),
        ("image.pullPolicy=Sometimes", "pullPolicy"),
        ("replicas=0", "replicas"),
        ("crds.instal=false", "'instal' not allowed"),
        ("webhook.certManager.issuerRef.kind=Isuer", "kind"),
        ("image.registy=registry.example", "'registy' not allowed"),
        ("nameOverride=Not_A_Name", "nameOverride"),
    ] {
        let out = helm()
            .args(["template", "pko-rs"])
            .arg(chart())
            .args(["--set", set])
            .output()
            .expect("run helm");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{set} was taken");
        assert!(err.contains(named), "{set}: {err}");
    }
}

/// The pod's scheduling and metadata values reach the Deployment (and the ServiceAccount's
/// annotations, for cloud workload identity), the apiserver takes the result, and the
/// container's memory limit reaches the operator as MEMORY_LIMIT through the Downward API.
#[tokio::test]
async fn scheduling_metadata_and_env_values_reach_the_pod() {
    let _machine = pko_tests::serial::shared().await;
    let plane = ControlPlane::shared().await;
    let ns = plane.namespace("helm-pod").await.expect("namespace");
    let sets = [
        "nodeSelector.disk=ssd",
        "tolerations[0].key=dedicated",
        "tolerations[0].operator=Exists",
        "tolerations[0].effect=NoSchedule",
        "affinity.nodeAffinity.requiredDuringSchedulingIgnoredDuringExecution.nodeSelectorTerms[0].matchExpressions[0].key=zone",
        "affinity.nodeAffinity.requiredDuringSchedulingIgnoredDuringExecution.nodeSelectorTerms[0].matchExpressions[0].operator=Exists",
        "priorityClassName=system-cluster-critical",
        "podAnnotations.example\\.com/a=b",
        "podLabels.team=platform",
        "imagePullSecrets[0].name=regcred",
        "serviceAccount.annotations.eks\\.amazonaws\\.com/role-arn=arn:aws:iam::1:role/pko",
        "extraEnv[0].name=HTTPS_PROXY",
        "extraEnv[0].value=http://proxy:3128",
    ];
    let text = template(&ns, &sets);
    let objects = parse(&text);
    let deployment = objects
        .iter()
        .find(|o| o["kind"] == "Deployment")
        .expect("deployment");
    let pod = &deployment["spec"]["template"];
    assert_eq!(pod["spec"]["nodeSelector"]["disk"], "ssd");
    assert_eq!(pod["spec"]["tolerations"][0]["key"], "dedicated");
    assert_eq!(
        pod["spec"]["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
            [0]["matchExpressions"][0]["key"],
        "zone"
    );
    assert_eq!(pod["spec"]["priorityClassName"], "system-cluster-critical");
    assert_eq!(pod["metadata"]["annotations"]["example.com/a"], "b");
    assert_eq!(pod["metadata"]["labels"]["team"], "platform");
    assert_eq!(
        pod["metadata"]["labels"]["app.kubernetes.io/name"], "pko-rs-operator",
        "the selector's label stays"
    );
    assert_eq!(pod["spec"]["imagePullSecrets"][0]["name"], "regcred");
    let env = pod["spec"]["containers"][0]["env"].as_array().expect("env");
    let named = |name: &str| env.iter().find(|e| e["name"] == name).cloned();
    assert_eq!(
        named("HTTPS_PROXY").expect("extraEnv")["value"],
        "http://proxy:3128"
    );
    assert_eq!(
        named("MEMORY_LIMIT").expect("MEMORY_LIMIT")["valueFrom"]["resourceFieldRef"]["resource"],
        "limits.memory"
    );
    let account = objects
        .iter()
        .find(|o| o["kind"] == "ServiceAccount")
        .expect("service account");
    assert_eq!(
        account["metadata"]["annotations"]["eks.amazonaws.com/role-arn"],
        "arn:aws:iam::1:role/pko"
    );
    let out = tokio::task::spawn_blocking(move || {
        dry_run(plane, &text, "dry run with scheduling values")
    })
    .await
    .expect("dry run task");
    assert!(
        out.contains("deployment.apps/pko-rs-operator serverside-applied"),
        "{out}"
    );
}
