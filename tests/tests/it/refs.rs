//! A Stack's references cannot be bent into another request, on the real apiserver. With
//! pko-rs's CRDs the apiserver refuses an injection corpus (path, query, fragment,
//! percent-encoded, dot segments, other kinds) in `fluxSource.sourceRef`, `programRef` and
//! `prerequisites` at create. With PKO v2.9's Stack CRD, which has no pattern there (a cluster
//! switching over keeps it until the CRDs are applied), the same Stacks are stored; the
//! operator, with every right there is, stalls each with `SpecInvalid`, and the apiserver's
//! audit log shows that it sent no request for any of them: nothing outside the Stack's
//! namespace, no watch, no Secret. A well-formed reference in the same run is looked up, which
//! shows that the log would record such a request.

use std::path::Path;
use std::time::Duration;

use kube::Api;
use kube::api::PostParams;
use pko_api::stack::Stack;
use pko_tests::operator::{Operator, OperatorOptions};
use pko_tests::{ControlPlane, StartOptions, fixtures, repo_root, wait_for};
use serde_json::{Value, json};

const WAIT: Duration = Duration::from_secs(120);
/// The user the operator runs as (impersonated, with every right) so its requests can be
/// told apart in the audit log.
const OPERATOR_USER: &str = "pko-flux-ref-probe";
const FLUX_V1: &str = "source.toolkit.fluxcd.io/v1";

/// The Secret holding the keys that sign artifact URLs.
const KEY_SECRET: &str = "pko-rs-artifact-keys";

/// `(apiVersion, kind, name)` a hostile tenant might write; `{victim}` is another namespace,
/// `{keys}` the operator's own.
fn corpus(victim: &str, keys: &str) -> Vec<(String, String, String)> {
    let fill = |s: &str| s.replace("{victim}", victim).replace("{keys}", keys);
    let t = |a: &str, k: &str, n: &str| (fill(a), fill(k), fill(n));
    vec![
        // The measured one: the rest of a path and a query after the version.
        t(
            "pulumi.com/v1/namespaces/{victim}/programs/secret-prog?x=",
            "Program",
            "anything",
        ),
        t(
            "v1/namespaces/kube-system/secrets/x?",
            "GitRepository",
            "anything",
        ),
        t(
            "/v1/namespaces/{keys}/secrets/pko-rs-artifact-keys?",
            "GitRepository",
            "anything",
        ),
        t(
            "source.toolkit.fluxcd.io/v1?watch=true&x=",
            "GitRepository",
            "anything",
        ),
        t("source.toolkit.fluxcd.io/v1#", "GitRepository", "anything"),
        t("source.toolkit.fluxcd.io%2fv1", "GitRepository", "anything"),
        t(
            "source.toolkit.fluxcd.io/../../api/v1/namespaces/{victim}/secrets",
            "GitRepository",
            "x",
        ),
        t(
            FLUX_V1,
            "GitRepository",
            "../../../{victim}/gitrepositories/src",
        ),
        t(FLUX_V1, "GitRepository", "src?watch=true"),
        t(FLUX_V1, "GitRepository", "src#x"),
        t(FLUX_V1, "GitRepository", "src%2f..%2f.."),
        t(FLUX_V1, "GitRepository/../../secrets", "src"),
        // Kinds that are no Flux source: the operator's own objects, Secrets.
        t("pulumi.com/v1", "Program", "secret-prog"),
        t("v1", "Secret", KEY_SECRET),
        t("Source.Toolkit.FluxCD.io/v1", "GitRepository", "src"),
    ]
}

/// Names that would bend a request path, for `programRef` and `prerequisites`.
fn bent_names(victim: &str) -> Vec<String> {
    [
        "../../../namespaces/{victim}/programs/secret-prog",
        "secret-prog/../../../{victim}/programs/secret-prog",
        "x?watch=true",
        "x#y",
        "x%2f..%2f..%2f{victim}",
        "..",
        "Secret-Prog",
    ]
    .iter()
    .map(|n| n.replace("{victim}", victim))
    .collect()
}

fn flux_stack(
    name: &str,
    backend: &Path,
    (api_version, kind, source): &(String, String, String),
) -> Stack {
    fixtures::file_backend_stack(
        name,
        backend,
        json!({"fluxSource": {"sourceRef": {"apiVersion": api_version, "kind": kind, "name": source}}}),
    )
}

#[tokio::test]
async fn flux_source_references_that_bend_a_path_are_refused_by_the_crd() {
    let _machine = pko_tests::serial::shared().await;
    let plane = ControlPlane::shared().await;
    let ns = plane.namespace("flux-crd").await.expect("namespace");
    let stacks: Api<Stack> = Api::namespaced(plane.client(), &ns);
    let dry_run = PostParams {
        dry_run: true,
        ..PostParams::default()
    };
    let backend = Path::new("/nonexistent");
    for (i, reference) in corpus("victim", "keys").iter().enumerate() {
        match stacks
            .create(&dry_run, &flux_stack(&format!("s{i}"), backend, reference))
            .await
        {
            Err(kube::Error::Api(s)) => assert_eq!(s.code, 422, "{reference:?}: {}", s.message),
            other => panic!("{reference:?} was not refused: {other:?}"),
        }
    }
    let good = (
        FLUX_V1.to_owned(),
        "OCIRepository".to_owned(),
        "src".to_owned(),
    );
    stacks
        .create(&dry_run, &flux_stack("good", backend, &good))
        .await
        .expect("a well-formed reference is accepted");
    for name in bent_names("victim") {
        for spec in [
            json!({"programRef": {"name": name}}),
            json!({"programRef": {"name": "p"}, "prerequisites": [{"name": name}]}),
        ] {
            let stack = fixtures::file_backend_stack("s", backend, spec.clone());
            match stacks.create(&dry_run, &stack).await {
                Err(kube::Error::Api(s)) => assert_eq!(s.code, 422, "{spec}: {}", s.message),
                other => panic!("{spec} was not refused: {other:?}"),
            }
        }
    }
}

/// The plane's admin kubeconfig, impersonating `user` in `system:masters`.
fn impersonating_kubeconfig(plane: &ControlPlane, user: &str, out: &Path) {
    let text = std::fs::read_to_string(plane.kubeconfig_path()).expect("kubeconfig");
    let mut config: Value = yaml_serde::from_str(&text).expect("kubeconfig parses");
    for entry in config["users"].as_array_mut().expect("users") {
        entry["user"]["as"] = json!(user);
        entry["user"]["as-groups"] = json!(["system:masters"]);
    }
    std::fs::write(out, yaml_serde::to_string(&config).expect("kubeconfig")).expect("write");
}

/// deploy/crds with PKO v2.9's Stack CRD in place of ours.
fn crds_with_pkos_stack(out: &Path) {
    std::fs::create_dir_all(out).expect("crds dir");
    for entry in std::fs::read_dir(repo_root().join("deploy/crds")).expect("deploy/crds") {
        let path = entry.expect("entry").path();
        let name = path.file_name().expect("file name");
        if path.extension().is_some_and(|x| x == "yaml") && name != "pulumi.com_stacks.yaml" {
            std::fs::copy(&path, out.join(name)).expect("copy CRD");
        }
    }
    std::fs::copy(
        repo_root().join("tests/fixtures/pko-v2.9-crds/pulumi.com_stacks.yaml"),
        out.join("pulumi.com_stacks.yaml"),
    )
    .expect("copy PKO's Stack CRD");
}

/// The operator's requests in the audit log: `(verb, requestURI, namespace)`.
fn operator_requests(plane: &ControlPlane) -> Vec<(String, String, Option<String>)> {
    let text = std::fs::read_to_string(plane.audit_log()).expect("audit log");
    text.lines()
        .filter_map(|line| serde_json::from_str::<Value>(line).ok())
        .filter(|e| e["stage"] == "ResponseComplete" || e["stage"] == "ResponseStarted")
        .filter(|e| e["impersonatedUser"]["username"] == OPERATOR_USER)
        .map(|e| {
            (
                e["verb"].as_str().unwrap_or_default().to_owned(),
                e["requestURI"].as_str().unwrap_or_default().to_owned(),
                e["objectRef"]["namespace"].as_str().map(str::to_owned),
            )
        })
        .collect()
}

#[tokio::test]
async fn the_operator_sends_no_request_for_a_bent_flux_source_reference() {
    let _machine = pko_tests::serial::shared().await;
    let tmp = tempfile::tempdir().expect("tmp");
    let crds = tmp.path().join("crds");
    crds_with_pkos_stack(&crds);
    let plane = ControlPlane::start(StartOptions {
        audit_log: true,
        crds_dir: Some(crds),
        ..StartOptions::default()
    })
    .await
    .unwrap_or_else(|e| panic!("{e}"));
    let tenant = plane.namespace("flux-a").await.expect("namespace");
    let victim = plane.namespace("flux-b").await.expect("namespace");
    let keys = plane.namespace("flux-keys").await.expect("namespace");
    let programs: Api<pko_api::program::Program> = Api::namespaced(plane.client(), &victim);
    programs
        .create(
            &PostParams::default(),
            &fixtures::config_map_program("secret-prog"),
        )
        .await
        .expect("the victim's Program");

    let kubeconfig = tmp.path().join("operator-kubeconfig");
    impersonating_kubeconfig(&plane, OPERATOR_USER, &kubeconfig);
    let mut operator = Operator::start(
        &plane,
        OperatorOptions {
            advertised: None,
            args: vec![
                format!("--kubeconfig={}", kubeconfig.display()),
                format!("--watch-namespace={tenant}"),
                format!("--artifact-keys-namespace={keys}"),
                "--workspace-localhost=127.0.0.1".into(),
            ],
        },
    )
    .await
    .unwrap_or_else(|e| panic!("operator: {e}"));

    let backend = tmp.path().join("backend");
    let stacks: Api<Stack> = Api::namespaced(plane.client(), &tenant);
    let corpus = corpus(&victim, &keys);
    for (i, reference) in corpus.iter().enumerate() {
        stacks
            .create(
                &PostParams::default(),
                &flux_stack(&format!("bent-{i}"), &backend, reference),
            )
            .await
            .unwrap_or_else(|e| panic!("PKO's CRD stores {reference:?}: {e}"));
    }
    // The tenant's own Program, so a Stack with a bent prerequisite gets past its source.
    Api::<pko_api::program::Program>::namespaced(plane.client(), &tenant)
        .create(&PostParams::default(), &fixtures::config_map_program("own"))
        .await
        .expect("the tenant's Program");
    let names = bent_names(&victim);
    for (i, name) in names.iter().enumerate() {
        for (kind, spec) in [
            ("program", json!({"programRef": {"name": name}})),
            (
                "prereq",
                json!({"programRef": {"name": "own"}, "prerequisites": [{"name": name}]}),
            ),
        ] {
            stacks
                .create(
                    &PostParams::default(),
                    &fixtures::file_backend_stack(&format!("{kind}-{i}"), &backend, spec),
                )
                .await
                .unwrap_or_else(|e| panic!("PKO's CRD stores {kind} {name:?}: {e}"));
        }
    }
    let control = (
        FLUX_V1.to_owned(),
        "GitRepository".to_owned(),
        "src".to_owned(),
    );
    stacks
        .create(
            &PostParams::default(),
            &flux_stack("control", &backend, &control),
        )
        .await
        .expect("the control Stack");

    // Waits for `Stalled` with `reason` (a Stack may first stall on a Program that has no
    // artifact yet); the last status is in the error.
    let stalled = |name: String, reason: &'static str| {
        let stacks = stacks.clone();
        async move {
            let found = wait_for(
                &format!("stack {name} to stall with {reason}"),
                WAIT,
                || async {
                    let status = stacks.get(&name).await.ok()?.status?;
                    status
                        .conditions
                        .iter()
                        .find(|c| c.type_ == "Stalled" && c.status == "True" && c.reason == reason)
                        .map(|c| c.message.clone())
                },
            )
            .await;
            match found {
                Ok(message) => Ok(message),
                Err(e) => {
                    let last = stacks.get(&name).await.ok().and_then(|s| s.status);
                    Err(format!("{e}; last status: {last:?}"))
                }
            }
        }
    };
    for (i, reference) in corpus.iter().enumerate() {
        let message = match stalled(format!("bent-{i}"), "SpecInvalid").await {
            Ok(m) => m,
            Err(e) => panic!("{reference:?}: {e}\n{}", operator.log_text()),
        };
        assert!(message.contains("fluxSource.sourceRef"), "{message}");
    }
    for (i, name) in names.iter().enumerate() {
        for (kind, field) in [
            ("program", "spec.programRef.name"),
            ("prereq", "spec.prerequisites[].name"),
        ] {
            let message = match stalled(format!("{kind}-{i}"), "SpecInvalid").await {
                Ok(m) => m,
                Err(e) => panic!("{kind} {name:?}: {e}\n{}", operator.log_text()),
            };
            assert!(message.contains(field), "{message}");
        }
    }
    // The control is looked up in its own namespace (there is no Flux here, so it is
    // unavailable, never invalid).
    let lookup =
        format!("/apis/source.toolkit.fluxcd.io/v1/namespaces/{tenant}/gitrepositories/src");
    let looked_up = wait_for("the control's lookup in the audit log", WAIT, || async {
        operator_requests(&plane)
            .iter()
            .any(|(verb, uri, _)| verb == "get" && uri.starts_with(&lookup))
            .then_some(())
    })
    .await;
    if let Err(e) = looked_up {
        panic!(
            "{e}\n{:?}\n{}",
            operator_requests(&plane),
            operator.log_text()
        );
    }
    stalled("control".into(), "SourceUnavailable")
        .await
        .expect("the control stalls as unavailable");

    // The operator's own: its key Secret, read and created by exact path at start.
    let key_get = format!("/api/v1/namespaces/{keys}/secrets/{KEY_SECRET}");
    let key_create = format!("/api/v1/namespaces/{keys}/secrets?");
    // Discovery of Flux's group (to watch the control's kind; there is no Flux here, so no
    // watch starts): cluster-level reads of the API's own description, no object.
    let discovery = |verb: &str, uri: &str| {
        let path = uri.split('?').next().unwrap_or_default();
        verb == "get"
            && !path.contains("/namespaces/")
            && (path == "/apis"
                || path == "/apis/source.toolkit.fluxcd.io"
                || path
                    .strip_prefix("/apis/source.toolkit.fluxcd.io/")
                    .is_some_and(|v| !v.contains('/')))
    };
    let own = |verb: &str, uri: &str| {
        (verb == "get" && uri == key_get)
            || (verb == "create" && uri == key_create)
            || discovery(verb, uri)
    };
    let requests = operator_requests(&plane);
    let bent: Vec<_> = requests
        .iter()
        .filter(|(verb, uri, _)| !own(verb, uri))
        .filter(|(_, uri, namespace)| {
            let path = uri.split('?').next().unwrap_or_default();
            namespace.as_deref().is_some_and(|ns| ns != tenant)
                || uri.contains(&victim)
                || uri.contains("kube-system")
                || uri.contains("secret-prog")
                || uri.contains(KEY_SECRET)
                || uri.contains("?x=")
                || uri.contains("&x=")
                || path.contains('%')
                || path.contains("..")
                || path.contains('#')
                || (uri.contains("source.toolkit.fluxcd.io") && !uri.starts_with(&lookup))
                || (namespace.is_none()
                    && (path.contains("/secrets") || path.contains("/programs")))
        })
        .collect();
    assert!(
        bent.is_empty(),
        "requests a tenant's reference steered: {bent:#?}\n{}",
        operator.log_text()
    );
    assert!(operator.exited().is_none(), "the operator exited");
}
