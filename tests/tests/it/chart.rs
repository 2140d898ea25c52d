//! deploy/helm/pko-rs as a conventional chart: names from the release (two releases in one
//! cluster, two of them in one namespace, installed by the real `helm` into a real apiserver,
//! share no object and select none of each other's pods), the CRDs templated (so `helm upgrade`
//! updates them) with `crds.install`/`crds.keep`, the webhook certificate from cert-manager,
//! and the chart pushed to a real OCI registry and installed from there.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;
use std::process::Command;

use pko_tests::command::run;
use pko_tests::registry::Registry;
use pko_tests::{ControlPlane, StartOptions, repo_root};
use serde_json::Value;

use crate::helm::{chart, helm, parse, template_release};

/// A control plane of the test's own with no CRD installed: the first release installs them,
/// and webhook configurations of releases whose pods never run reach no other test.
async fn empty_plane(dir: &Path) -> ControlPlane {
    let crds = dir.join("no-crds");
    std::fs::create_dir_all(&crds).expect("empty CRD folder");
    ControlPlane::start(StartOptions {
        crds_dir: Some(crds),
        ..StartOptions::default()
    })
    .await
    .unwrap_or_else(|e| panic!("{e}"))
}

/// `helm` against `plane`.
fn helm_on(plane: &ControlPlane) -> Command {
    let mut cmd = helm();
    cmd.env("KUBECONFIG", plane.kubeconfig_path());
    cmd
}

/// `helm install` (no --wait: no kubelet runs the pods) of `source` as `release` in
/// `namespace`, with `args` after.
fn install(plane: &ControlPlane, release: &str, namespace: &str, source: &str, args: &[&str]) {
    let mut cmd = helm_on(plane);
    cmd.args(["install", release, source, "--namespace", namespace])
        .arg("--create-namespace")
        .args(args);
    run(&mut cmd, None, &format!("helm install {release} {args:?}"));
}

/// The objects Helm installed for `release`, as it recorded them.
fn manifest(plane: &ControlPlane, release: &str, namespace: &str) -> Vec<Value> {
    let mut cmd = helm_on(plane);
    cmd.args(["get", "manifest", release, "--namespace", namespace]);
    parse(&run(
        &mut cmd,
        None,
        &format!("helm get manifest {release}"),
    ))
}

fn kind(o: &Value) -> &str {
    o["kind"].as_str().unwrap_or_default()
}

fn name(o: &Value) -> &str {
    o["metadata"]["name"].as_str().unwrap_or_default()
}

/// Every object in `objects`, read back from the apiserver (`kubectl get -f -`; fails when
/// one is missing).
fn read_back(plane: &ControlPlane, objects: &[Value]) -> Vec<Value> {
    let list = serde_json::json!({"apiVersion": "v1", "kind": "List", "items": objects});
    let mut cmd = plane.kubectl();
    cmd.args(["get", "-f", "-", "-o", "json"]);
    let out = run(&mut cmd, Some(&list.to_string()), "kubectl get -f -");
    let got: Value = serde_json::from_str(&out).expect("kubectl's JSON");
    match got["items"].as_array() {
        Some(items) => items.clone(),
        None => vec![got],
    }
}

/// Whether `labels` satisfies the `matchLabels`-style `selector`.
fn selects(selector: &Value, labels: &Value) -> bool {
    selector
        .as_object()
        .is_some_and(|m| !m.is_empty() && m.iter().all(|(k, v)| labels.get(k) == Some(v)))
}

/// Every pod selector of a release's objects, with where it is.
fn selectors(objects: &[Value]) -> Vec<(String, Value)> {
    let mut out = Vec::new();
    for o in objects {
        let at = |what: &str| format!("{} {} {what}", kind(o), name(o));
        match kind(o) {
            "Deployment" => {
                out.push((at("selector"), o["spec"]["selector"]["matchLabels"].clone()));
                for c in o["spec"]["template"]["spec"]["topologySpreadConstraints"]
                    .as_array()
                    .into_iter()
                    .flatten()
                {
                    out.push((
                        at("topologySpreadConstraints"),
                        c["labelSelector"]["matchLabels"].clone(),
                    ));
                }
            }
            "Service" => out.push((at("selector"), o["spec"]["selector"].clone())),
            "NetworkPolicy" => out.push((
                at("podSelector"),
                o["spec"]["podSelector"]["matchLabels"].clone(),
            )),
            "PodDisruptionBudget" => {
                out.push((at("selector"), o["spec"]["selector"]["matchLabels"].clone()));
            }
            _ => {}
        }
    }
    out
}

fn pod_labels(objects: &[Value]) -> Value {
    objects
        .iter()
        .find(|o| kind(o) == "Deployment")
        .expect("a Deployment")["spec"]["template"]["metadata"]["labels"]
        .clone()
}

fn args(objects: &[Value]) -> Vec<String> {
    objects
        .iter()
        .find(|o| kind(o) == "Deployment")
        .expect("a Deployment")["spec"]["template"]["spec"]["containers"][0]["args"]
        .as_array()
        .expect("args")
        .iter()
        .filter_map(|a| a.as_str().map(str::to_owned))
        .collect()
}

fn flag<'a>(args: &'a [String], name: &str) -> &'a str {
    let prefix = format!("--{name}=");
    args.iter()
        .find_map(|a| a.strip_prefix(&prefix))
        .unwrap_or_else(|| panic!("no {prefix} in {args:?}"))
}

/// The `resourceNames` of `objects`' Roles and ClusterRoles, for `resource`.
fn granted_names(objects: &[Value], resource: &str) -> BTreeSet<String> {
    objects
        .iter()
        .filter(|o| matches!(kind(o), "Role" | "ClusterRole"))
        .flat_map(|o| o["rules"].as_array().cloned().unwrap_or_default())
        .filter(|r| {
            r["resources"]
                .as_array()
                .is_some_and(|rs| rs.iter().any(|x| x == resource))
        })
        .flat_map(|r| r["resourceNames"].as_array().cloned().unwrap_or_default())
        .filter_map(|n| n.as_str().map(str::to_owned))
        .collect()
}

/// Every name the operator is given (flags) and every reference between objects names an
/// object of this release: Services, webhook configurations, the Lease and the Secrets its
/// Roles grant, the ServiceAccount of every binding and of the pods.
fn assert_self_contained(release: &str, namespace: &str, objects: &[Value]) {
    let has = |k: &str, n: &str| objects.iter().any(|o| kind(o) == k && name(o) == n);
    let args = args(objects);
    let fileserver = flag(&args, "program-fs-adv-addr")
        .strip_suffix(".$(POD_NAMESPACE):80")
        .expect("the file server's Service in the pod's namespace");
    assert!(has("Service", fileserver), "{release}: {fileserver}");
    assert_eq!(
        flag(&args, "policy-file-server-service"),
        format!("{fileserver}.$(POD_NAMESPACE)")
    );
    for (flag_name, k) in [
        ("metrics-service-name", "Service"),
        ("webhook-service-name", "Service"),
        (
            "webhook-validating-configuration",
            "ValidatingWebhookConfiguration",
        ),
        (
            "webhook-mutating-configuration",
            "MutatingWebhookConfiguration",
        ),
    ] {
        let n = flag(&args, flag_name);
        assert!(
            has(k, n),
            "{release}: --{flag_name}={n} is no {k} of the release"
        );
    }
    let leases = granted_names(objects, "leases");
    assert_eq!(
        leases,
        BTreeSet::from([flag(&args, "leader-election-id").to_owned()]),
        "{release}"
    );
    let secrets = granted_names(objects, "secrets");
    for flag_name in ["artifact-keys-secret", "webhook-cert-secret"] {
        assert!(
            secrets.contains(flag(&args, flag_name)),
            "{release}: {secrets:?}"
        );
    }
    for k in [
        "validatingwebhookconfigurations",
        "mutatingwebhookconfigurations",
    ] {
        for n in granted_names(objects, k) {
            assert!(objects.iter().any(|o| name(o) == n), "{release}: {k} {n}");
        }
    }
    for o in objects {
        for hook in o["webhooks"].as_array().into_iter().flatten() {
            let service = &hook["clientConfig"]["service"];
            assert_eq!(service["namespace"], namespace, "{release}");
            assert!(
                has("Service", service["name"].as_str().unwrap_or_default()),
                "{release}: {hook}"
            );
        }
        if matches!(kind(o), "RoleBinding" | "ClusterRoleBinding") {
            let role = &o["roleRef"];
            assert!(
                has(
                    role["kind"].as_str().unwrap_or_default(),
                    role["name"].as_str().unwrap_or_default()
                ),
                "{release}: {o}"
            );
            for subject in o["subjects"].as_array().into_iter().flatten() {
                assert!(
                    has(
                        "ServiceAccount",
                        subject["name"].as_str().unwrap_or_default()
                    ),
                    "{release}: {subject}"
                );
            }
        }
    }
    let deployment = objects
        .iter()
        .find(|o| kind(o) == "Deployment")
        .expect("a Deployment");
    let account = deployment["spec"]["template"]["spec"]["serviceAccountName"]
        .as_str()
        .unwrap_or_default();
    assert!(has("ServiceAccount", account), "{release}: {account}");
}

/// Three releases in one cluster, two of them in one namespace, installed by `helm install`
/// (which refuses to take over an object another release owns): every object of each exists
/// under its own name with the release's labels; no cluster-scoped name is shared but the
/// CRDs' (installed by the first release only); each release's selectors select its own pods
/// and not the others'; every name the operator is given is its own release's. A second
/// release that also installs the CRDs is refused by Helm, naming a CRD.
#[tokio::test]
async fn releases_side_by_side_share_no_object_and_select_only_their_own_pods() {
    let _machine = pko_tests::serial::shared().await;
    let tmp = tempfile::tempdir().expect("tmp");
    let plane = empty_plane(tmp.path()).await;
    let source = chart().display().to_string();
    let releases = [
        ("alpha", "ns-a", &[][..]),
        ("beta", "ns-b", &["--set", "crds.install=false"][..]),
        ("gamma", "ns-a", &["--set", "crds.install=false"][..]),
    ];
    // helm and kubectl run synchronously, as in deploy_scope.rs: the plane's processes are
    // driven by threads of their own, not by this test's runtime.
    let mut installed = BTreeMap::new();
    for (release, namespace, args) in releases {
        install(&plane, release, namespace, &source, args);
        installed.insert(release, (namespace, manifest(&plane, release, namespace)));
    }
    // The CRDs are one release's: a second one installing them is refused.
    let refused = helm_on(&plane)
        .args(["install", "delta", &source, "--namespace", "ns-d"])
        .arg("--create-namespace")
        .output()
        .expect("run helm");
    assert!(!refused.status.success());
    let err = String::from_utf8_lossy(&refused.stderr);
    assert!(
        err.contains("CustomResourceDefinition") && err.contains("cannot be imported"),
        "{err}"
    );

    let mut namespaced: BTreeMap<(String, String, String), &str> = BTreeMap::new();
    let mut cluster: BTreeMap<(String, String), &str> = BTreeMap::new();
    for (release, (namespace, objects)) in &installed {
        assert!(objects.len() > 10, "{release}: {objects:?}");
        assert_eq!(
            objects
                .iter()
                .any(|o| kind(o) == "CustomResourceDefinition"),
            *release == "alpha",
            "only the first release installs the CRDs"
        );
        for live in read_back(&plane, objects) {
            let labels = &live["metadata"]["labels"];
            assert_eq!(labels["app.kubernetes.io/instance"], *release, "{live}");
            assert_eq!(labels["app.kubernetes.io/managed-by"], "Helm", "{live}");
            assert_eq!(
                labels["app.kubernetes.io/name"], "pko-rs-operator",
                "{live}"
            );
            assert!(labels["helm.sh/chart"].is_string(), "{live}");
            assert!(labels["app.kubernetes.io/version"].is_string(), "{live}");
        }
        for o in objects {
            assert!(
                name(o).starts_with(&format!("{release}-pko-rs-"))
                    || kind(o) == "CustomResourceDefinition",
                "{release}: {} {}",
                kind(o),
                name(o)
            );
            match o["metadata"]["namespace"].as_str() {
                Some(ns) => {
                    assert_eq!(ns, *namespace);
                    let key = (kind(o).to_owned(), ns.to_owned(), name(o).to_owned());
                    if let Some(other) = namespaced.insert(key.clone(), *release) {
                        panic!("{key:?} is both {other}'s and {release}'s");
                    }
                }
                None => {
                    let key = (kind(o).to_owned(), name(o).to_owned());
                    if let Some(other) = cluster.insert(key.clone(), *release) {
                        panic!("{key:?} is both {other}'s and {release}'s");
                    }
                }
            }
        }
        assert_self_contained(release, namespace, objects);
    }
    assert!(
        cluster
            .keys()
            .any(|(k, _)| k == "ValidatingWebhookConfiguration"),
        "{cluster:?}"
    );
    for (release, (_, objects)) in &installed {
        for (other, (_, theirs)) in &installed {
            let pods = pod_labels(theirs);
            for (at, selector) in selectors(objects) {
                assert_eq!(
                    selects(&selector, &pods),
                    release == other,
                    "{release}'s {at} ({selector}) against {other}'s pods ({pods})"
                );
            }
        }
    }
}

/// Object names from the release by Helm's usual rules; release `pko-rs` keeps deploy/'s.
#[test]
fn names_follow_the_release_and_the_overrides() {
    for (release, sets, operator, app) in [
        ("pko-rs", &[][..], "pko-rs-operator", "pko-rs-operator"),
        ("ops", &[][..], "ops-pko-rs-operator", "pko-rs-operator"),
        (
            "my-pko-rs",
            &[][..],
            "my-pko-rs-operator",
            "pko-rs-operator",
        ),
        (
            "ops",
            &["nameOverride=pko"][..],
            "ops-pko-operator",
            "pko-operator",
        ),
        (
            "ops",
            &["fullnameOverride=infra"][..],
            "infra-operator",
            "pko-rs-operator",
        ),
    ] {
        let objects = parse(&template_release(release, "op", sets));
        let deployment = objects
            .iter()
            .find(|o| kind(o) == "Deployment")
            .expect("a Deployment");
        assert_eq!(name(deployment), operator, "{release} {sets:?}");
        assert_eq!(
            deployment["spec"]["selector"]["matchLabels"],
            serde_json::json!({
                "app.kubernetes.io/name": app,
                "app.kubernetes.io/instance": release,
            }),
            "{release} {sets:?}"
        );
        let stem = operator.strip_suffix("-operator").expect("suffix");
        for o in &objects {
            assert!(
                name(o).starts_with(&format!("{stem}-")) || kind(o) == "CustomResourceDefinition",
                "{release} {sets:?}: {} {}",
                kind(o),
                name(o)
            );
        }
        assert_self_contained(release, "op", &objects);
    }
    // The longest names stay DNS labels.
    // Helm takes release names of up to 53 characters.
    let long = "a".repeat(53);
    let objects = parse(&template_release(
        &long,
        "op",
        &["grafanaDashboard.enabled=true"],
    ));
    for o in &objects {
        assert!(name(o).len() <= 63, "{}", name(o));
    }
}

/// The CRDs of deploy/crds, templated: each one as written there (but for Helm's labels and,
/// with crds.keep, the keep policy); none with crds.install=false.
#[test]
fn crds_are_templated_from_deploy_crds_kept_and_optional() {
    let mut files = BTreeMap::new();
    for entry in std::fs::read_dir(repo_root().join("deploy/crds")).expect("deploy/crds") {
        let path = entry.expect("entry").path();
        for crd in parse(&std::fs::read_to_string(&path).expect("CRD file")) {
            files.insert(name(&crd).to_owned(), crd);
        }
    }
    assert_eq!(files.len(), 7, "{:?}", files.keys());
    let crds = |sets: &[&str]| -> BTreeMap<String, Value> {
        parse(&template_release("pko-rs", "op", sets))
            .into_iter()
            .filter(|o| kind(o) == "CustomResourceDefinition")
            .map(|o| (name(&o).to_owned(), o))
            .collect()
    };
    let kept = crds(&[]);
    assert_eq!(
        kept.keys().collect::<Vec<_>>(),
        files.keys().collect::<Vec<_>>()
    );
    for (n, crd) in &kept {
        assert_eq!(
            crd["metadata"]["annotations"]["helm.sh/resource-policy"], "keep",
            "{n}"
        );
        assert_eq!(
            crd["metadata"]["labels"]["app.kubernetes.io/instance"],
            "pko-rs"
        );
        let mut bare = crd.clone();
        let meta = bare["metadata"].as_object_mut().expect("metadata");
        meta.remove("labels");
        meta.remove("annotations");
        assert_eq!(&bare, &files[n], "{n} differs from deploy/crds");
    }
    for (n, crd) in crds(&["crds.keep=false"]) {
        assert!(crd["metadata"]["annotations"].is_null(), "{n}: {crd}");
    }
    assert!(crds(&["crds.install=false"]).is_empty());
}

/// Minimal CRDs of cert-manager's Issuer and Certificate (any spec), so the apiserver takes the
/// chart's objects of those kinds; cert-manager itself does not run here.
fn cert_manager_crds(dir: &Path) {
    std::fs::create_dir_all(dir).expect("folder");
    for (plural, kind) in [("issuers", "Issuer"), ("certificates", "Certificate")] {
        std::fs::write(
            dir.join(format!("{plural}.yaml")),
            format!(
                "apiVersion: apiextensions.k8s.io/v1\nkind: CustomResourceDefinition\nmetadata:\n  name: {plural}.cert-manager.io\nspec:\n  group: cert-manager.io\n  scope: Namespaced\n  names:\n    plural: {plural}\n    singular: {singular}\n    kind: {kind}\n    listKind: {kind}List\n  versions:\n    - name: v1\n      served: true\n      storage: true\n      schema:\n        openAPIV3Schema:\n          type: object\n          x-kubernetes-preserve-unknown-fields: true\n",
                singular = kind.to_lowercase(),
            ),
        )
        .expect("write CRD");
    }
}

/// webhook.certManager: a Certificate for the webhook Service's names (from a self-signed
/// Issuer the chart makes, or the issuer given), its Secret mounted where --webhook-cert-dir
/// reads it, the CA injector's annotation on both webhook configurations, and no CA bundle
/// patching by the operator (no such flag, no such right). The apiserver takes it all
/// (server-side dry run, with cert-manager's CRDs in place).
#[tokio::test]
async fn cert_manager_mode_issues_mounts_and_injects_the_webhook_certificate() {
    let _machine = pko_tests::serial::shared().await;
    let plane = ControlPlane::shared().await;
    let ns = plane.namespace("helm-cm").await.expect("namespace");
    let text = template_release(
        "cm",
        &ns,
        &["webhook.certManager.enabled=true", "crds.install=false"],
    );
    let objects = parse(&text);
    let of = |k: &str| -> Vec<&Value> { objects.iter().filter(|o| kind(o) == k).collect() };
    let issuer = of("Issuer");
    assert_eq!(issuer.len(), 1);
    assert_eq!(name(issuer[0]), "cm-pko-rs-webhook");
    assert!(issuer[0]["spec"]["selfSigned"].is_object());
    let certificate = of("Certificate");
    assert_eq!(certificate.len(), 1);
    let spec = &certificate[0]["spec"];
    assert_eq!(spec["secretName"], "cm-pko-rs-webhook-cert");
    assert_eq!(
        spec["dnsNames"],
        serde_json::json!([
            format!("cm-pko-rs-webhook.{ns}.svc"),
            format!("cm-pko-rs-webhook.{ns}.svc.cluster.local"),
        ])
    );
    assert_eq!(spec["issuerRef"]["name"], "cm-pko-rs-webhook");
    assert_eq!(spec["issuerRef"]["kind"], "Issuer");
    let service = &objects
        .iter()
        .find(|o| kind(o) == "ValidatingWebhookConfiguration")
        .expect("validating")["webhooks"][0]["clientConfig"]["service"];
    assert_eq!(service["name"], "cm-pko-rs-webhook");
    for k in [
        "ValidatingWebhookConfiguration",
        "MutatingWebhookConfiguration",
    ] {
        let config = of(k);
        assert_eq!(
            config[0]["metadata"]["annotations"]["cert-manager.io/inject-ca-from"],
            format!("{ns}/cm-pko-rs-webhook"),
            "{k}"
        );
    }
    let flags = args(&objects);
    assert_eq!(flag(&flags, "webhook-cert-dir"), "/etc/pko-rs/webhook-tls");
    assert!(
        !flags.iter().any(|a| a.starts_with("--webhook-cert-secret")
            || a.starts_with("--webhook-validating-configuration")
            || a.starts_with("--webhook-mutating-configuration")),
        "{flags:?}"
    );
    let pod = &objects
        .iter()
        .find(|o| kind(o) == "Deployment")
        .expect("deployment")["spec"]["template"]["spec"];
    let volume = pod["volumes"]
        .as_array()
        .expect("volumes")
        .iter()
        .find(|v| v["name"] == "webhook-tls")
        .expect("the certificate's volume");
    assert_eq!(volume["secret"]["secretName"], "cm-pko-rs-webhook-cert");
    let mount = pod["containers"][0]["volumeMounts"]
        .as_array()
        .expect("mounts")
        .iter()
        .find(|m| m["name"] == "webhook-tls")
        .expect("the certificate's mount");
    assert_eq!(mount["mountPath"], "/etc/pko-rs/webhook-tls");
    for k in [
        "validatingwebhookconfigurations",
        "mutatingwebhookconfigurations",
    ] {
        assert!(granted_names(&objects, k).is_empty(), "{k}");
    }
    // Without cert-manager: no Issuer or Certificate, no annotation, the operator patches.
    let own = parse(&template_release("cm", &ns, &["crds.install=false"]));
    assert!(
        !own.iter()
            .any(|o| matches!(kind(o), "Issuer" | "Certificate"))
    );
    assert!(
        own.iter()
            .all(|o| o["metadata"]["annotations"]["cert-manager.io/inject-ca-from"].is_null())
    );
    assert!(
        !args(&own)
            .iter()
            .any(|a| a.starts_with("--webhook-cert-dir"))
    );
    // An issuer of one's own: no Issuer from the chart.
    let given = parse(&template_release(
        "cm",
        &ns,
        &[
            "webhook.certManager.enabled=true",
            "webhook.certManager.issuerRef.name=corp-ca",
            "webhook.certManager.issuerRef.kind=ClusterIssuer",
            "crds.install=false",
        ],
    ));
    assert!(!given.iter().any(|o| kind(o) == "Issuer"));
    let issuer_ref = &given
        .iter()
        .find(|o| kind(o) == "Certificate")
        .expect("certificate")["spec"]["issuerRef"];
    assert_eq!(
        issuer_ref,
        &serde_json::json!({"name": "corp-ca", "kind": "ClusterIssuer", "group": "cert-manager.io"})
    );

    let tmp = tempfile::tempdir().expect("tmp");
    cert_manager_crds(tmp.path());
    plane
        .install_crds(tmp.path())
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let out = tokio::task::spawn_blocking(move || {
        crate::helm::dry_run(plane, &text, "dry run of cert-manager mode")
    })
    .await
    .expect("dry run task");
    for applied in [
        "certificate.cert-manager.io/cm-pko-rs-webhook serverside-applied (server dry run)",
        "issuer.cert-manager.io/cm-pko-rs-webhook serverside-applied (server dry run)",
        "validatingwebhookconfiguration.admissionregistration.k8s.io/cm-pko-rs-validating serverside-applied (server dry run)",
        "deployment.apps/cm-pko-rs-operator serverside-applied (server dry run)",
    ] {
        assert!(out.contains(applied), "{applied}: {out}");
    }
}

/// `helm package`, `helm push` to a real OCI registry (TLS on loopback), and `helm install
/// oci://…` of it into an empty cluster, as users install charts now: the release's
/// Deployment and the CRDs (packaged through files/crds, with the keep policy) exist, and
/// `helm upgrade` updates the CRDs.
#[tokio::test]
async fn the_chart_installs_from_an_oci_registry() {
    let _machine = pko_tests::serial::shared().await;
    let tmp = tempfile::tempdir().expect("tmp");
    let registry = Registry::start(&tmp.path().join("registry"))
        .await
        .expect("registry");
    let plane = empty_plane(tmp.path()).await;
    let packaged = tmp.path().join("packaged");
    std::fs::create_dir_all(&packaged).expect("folder");
    let version = {
        let text = std::fs::read_to_string(chart().join("Chart.yaml")).expect("Chart.yaml");
        let meta: Value = yaml_serde::from_str(&text).expect("Chart.yaml parses");
        meta["version"].as_str().expect("version").to_owned()
    };
    let archive = packaged.join(format!("pko-rs-{version}.tgz"));
    let oci = format!("oci://{}/charts", registry.host());
    // Synchronous, as above.
    let mut cmd = helm();
    cmd.arg("package")
        .arg(chart())
        .arg("--destination")
        .arg(&packaged);
    run(&mut cmd, None, "helm package");
    let mut cmd = helm();
    cmd.arg("push")
        .arg(&archive)
        .arg(&oci)
        .arg("--ca-file")
        .arg(registry.ca_file());
    run(&mut cmd, None, "helm push");
    let ca = registry.ca_file().display().to_string();
    install(
        &plane,
        "pko-rs",
        "pko-rs-system",
        &format!("{oci}/pko-rs"),
        &["--version", &version, "--ca-file", &ca],
    );
    let deployments: kube::Api<k8s_openapi::api::apps::v1::Deployment> =
        kube::Api::namespaced(plane.client(), "pko-rs-system");
    let deployment = deployments
        .get("pko-rs-operator")
        .await
        .expect("the release's Deployment");
    let labels = deployment.metadata.labels.unwrap_or_default();
    assert_eq!(
        labels.get("helm.sh/chart").map(String::as_str),
        Some(format!("pko-rs-{version}").as_str())
    );
    let crds: kube::Api<
        k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition,
    > = kube::Api::all(plane.client());
    for n in [
        "stacks.pulumi.com",
        "programs.pulumi.com",
        "tenancypolicies.pko-rs.dev",
    ] {
        let crd = crds.get(n).await.unwrap_or_else(|e| panic!("{n}: {e}"));
        assert_eq!(
            crd.metadata
                .annotations
                .unwrap_or_default()
                .get("helm.sh/resource-policy")
                .map(String::as_str),
            Some("keep"),
            "{n}"
        );
    }
    // The CRDs are the release's: `helm upgrade` changes them (crds/ would never be touched).
    let mut cmd = helm_on(&plane);
    cmd.args(["upgrade", "pko-rs", &format!("{oci}/pko-rs")])
        .args(["--namespace", "pko-rs-system", "--version", &version])
        .args(["--ca-file", &ca, "--set", "crds.keep=false"]);
    run(&mut cmd, None, "helm upgrade");
    let stacks = crds.get("stacks.pulumi.com").await.expect("stacks CRD");
    assert!(
        !stacks
            .metadata
            .annotations
            .unwrap_or_default()
            .contains_key("helm.sh/resource-policy"),
        "the upgrade updated the CRD"
    );
}
