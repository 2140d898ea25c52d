//! deploy/webhook and the webhook's RBAC, applied to the real apiserver (`kubectl apply -k`):
//! the operator may manage its own certificate Secret and its own webhook configurations, and
//! nothing else of either kind.

use std::process::Command;

use k8s_openapi::api::admissionregistration::v1::{
    MutatingWebhookConfiguration, ValidatingWebhookConfiguration,
};
use k8s_openapi::api::authorization::v1::{
    ResourceAttributes, SubjectAccessReview, SubjectAccessReviewSpec,
};
use kube::api::{Api, PostParams};
use pko_tests::{ControlPlane, repo_root};

const NAMESPACE: &str = "pko-rs-system";
const SERVICE_ACCOUNT: &str = "pko-rs-operator";

fn apply(plane: &ControlPlane) {
    let mut cmd: Command = plane.kubectl();
    cmd.args([
        "apply",
        "--server-side",
        "--force-conflicts",
        "--field-manager=pko-tests-webhook",
    ])
    .arg("-k")
    .arg(repo_root().join("deploy"));
    let out = cmd.output().expect("kubectl runs");
    assert!(
        out.status.success(),
        "kubectl apply -k deploy/: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

async fn may(
    api: &Api<SubjectAccessReview>,
    verb: &str,
    group: &str,
    resource: &str,
    namespace: Option<&str>,
    name: Option<&str>,
) -> bool {
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
                namespace: namespace.map(str::to_owned),
                name: name.map(str::to_owned),
                ..ResourceAttributes::default()
            }),
            ..SubjectAccessReviewSpec::default()
        },
        ..SubjectAccessReview::default()
    };
    api.create(&PostParams::default(), &review)
        .await
        .expect("SubjectAccessReview")
        .status
        .is_some_and(|s| s.allowed)
}

#[tokio::test]
async fn webhook_manifests_and_least_privilege() {
    let _machine = pko_tests::serial::shared().await;
    let plane = ControlPlane::shared_apart().await;
    tokio::task::spawn_blocking(move || apply(plane))
        .await
        .expect("apply");
    let client = plane.client();

    // Both configurations: never the operator's own namespace, a timeout above the operator's
    // 2 s evaluation budget, Fail for the tenancy rules.
    let validating = Api::<ValidatingWebhookConfiguration>::all(client.clone())
        .get("pko-rs-validating")
        .await
        .expect("validating configuration");
    let mutating = Api::<MutatingWebhookConfiguration>::all(client.clone())
        .get("pko-rs-mutating")
        .await
        .expect("mutating configuration");
    let v = &validating.webhooks.expect("webhooks")[0];
    let m = &mutating.webhooks.expect("webhooks")[0];
    assert_eq!(v.failure_policy.as_deref(), Some("Fail"));
    assert_eq!(m.failure_policy.as_deref(), Some("Ignore"));
    for (selector, timeout, service) in [
        (
            &v.namespace_selector,
            v.timeout_seconds,
            &v.client_config.service,
        ),
        (
            &m.namespace_selector,
            m.timeout_seconds,
            &m.client_config.service,
        ),
    ] {
        let expressions = selector
            .as_ref()
            .and_then(|s| s.match_expressions.clone())
            .unwrap_or_default();
        assert!(
            expressions
                .iter()
                .any(|e| e.key == "kubernetes.io/metadata.name"
                    && e.operator == "NotIn"
                    && e.values
                        .as_ref()
                        .is_some_and(|v| v.iter().any(|n| n == NAMESPACE))),
            "{expressions:?}"
        );
        assert!(timeout.is_some_and(|t| t > 2 && t <= 10), "{timeout:?}");
        let service = service.as_ref().expect("service reference");
        assert_eq!(service.name, "pko-rs-webhook");
        assert_eq!(service.namespace, NAMESPACE);
    }
    let resources: Vec<String> = v
        .rules
        .iter()
        .flatten()
        .flat_map(|r| r.resources.clone().unwrap_or_default())
        .collect();
    for resource in ["stacks", "workspaces", "programtransforms"] {
        assert!(resources.iter().any(|r| r == resource), "{resources:?}");
    }

    let sar: Api<SubjectAccessReview> = Api::all(client);
    let own = Some(NAMESPACE);
    let tls = Some("pko-rs-webhook-tls");
    let needed = [
        ("get", "", "secrets", own, tls),
        ("update", "", "secrets", own, tls),
        ("create", "", "secrets", own, None),
        ("list", "pko-rs.dev", "tenancypolicies", None, None),
        ("watch", "pko-rs.dev", "tenancypolicies", None, None),
        ("list", "", "namespaces", None, None),
        ("watch", "", "namespaces", None, None),
        (
            "get",
            "admissionregistration.k8s.io",
            "validatingwebhookconfigurations",
            None,
            Some("pko-rs-validating"),
        ),
        (
            "update",
            "admissionregistration.k8s.io",
            "validatingwebhookconfigurations",
            None,
            Some("pko-rs-validating"),
        ),
        (
            "get",
            "admissionregistration.k8s.io",
            "mutatingwebhookconfigurations",
            None,
            Some("pko-rs-mutating"),
        ),
        (
            "update",
            "admissionregistration.k8s.io",
            "mutatingwebhookconfigurations",
            None,
            Some("pko-rs-mutating"),
        ),
    ];
    for (verb, group, resource, namespace, name) in needed {
        assert!(
            may(&sar, verb, group, resource, namespace, name).await,
            "operator may not {verb} {group}/{resource} {namespace:?} {name:?}"
        );
    }
    let denied = [
        // Secrets by name (get/create/delete) are granted by the execution rules (agent
        // credentials, Update outputs in tenant namespaces); listing or watching them never is.
        ("list", "", "secrets", own, None),
        ("watch", "", "secrets", own, None),
        ("list", "", "secrets", None, None),
        ("watch", "", "secrets", Some("team-a"), None),
        ("update", "", "secrets", Some("team-a"), tls),
        (
            "update",
            "admissionregistration.k8s.io",
            "validatingwebhookconfigurations",
            None,
            Some("someone-elses"),
        ),
        (
            "create",
            "admissionregistration.k8s.io",
            "validatingwebhookconfigurations",
            None,
            None,
        ),
        (
            "delete",
            "admissionregistration.k8s.io",
            "mutatingwebhookconfigurations",
            None,
            Some("pko-rs-mutating"),
        ),
        ("create", "pko-rs.dev", "tenancypolicies", None, None),
        ("update", "pko-rs.dev", "tenancypolicies", None, Some("x")),
    ];
    for (verb, group, resource, namespace, name) in denied {
        assert!(
            !may(&sar, verb, group, resource, namespace, name).await,
            "operator may {verb} {group}/{resource} {namespace:?} {name:?}"
        );
    }
}
