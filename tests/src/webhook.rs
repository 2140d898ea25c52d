//! Registers an operator process as the admission webhook of a few test namespaces.
//!
//! The apiserver calls the webhook by `clientConfig.url` on loopback. Every registration has
//! its own id: the webhook configurations select only namespaces labelled
//! `pko-tests.webhook=<id>`, so tests running in parallel on the shared apiserver never see
//! each other's webhooks, and each test's webhook points at its own operator.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::Duration;

use k8s_openapi::api::admissionregistration::v1::{
    MutatingWebhookConfiguration, ValidatingWebhookConfiguration,
};
use k8s_openapi::api::core::v1::Namespace;
use kube::api::{Api, DeleteParams, Patch, PatchParams, PostParams};
use serde_json::json;

use crate::{ControlPlane, HarnessError, wait_for};

/// Label that scopes a registration's webhooks to its namespaces.
pub const WEBHOOK_LABEL: &str = "pko-tests.webhook";
/// Environment variable naming the policy bundle (set by the Makefile).
pub const BUNDLE_ENV: &str = "PKO_POLICY_BUNDLE";

/// An AdmissionReview of `object` (a Workspace) being created in `namespace` by a tenant, as
/// the apiserver sends it.
pub fn workspace_review(namespace: &str, object: serde_json::Value) -> serde_json::Value {
    json!({
        "apiVersion": "admission.k8s.io/v1",
        "kind": "AdmissionReview",
        "request": {
            "uid": "6a0c6b4e-5d1c-4b8e-9d3e-000000000001",
            "kind": {"group": "auto.pulumi.com", "version": "v1alpha1", "kind": "Workspace"},
            "resource": {"group": "auto.pulumi.com", "version": "v1alpha1", "resource": "workspaces"},
            "name": object["metadata"]["name"].clone(),
            "namespace": namespace,
            "operation": "CREATE",
            "userInfo": {"username": "alice", "groups": ["system:authenticated"]},
            "object": object,
            "oldObject": null,
            "dryRun": false,
        },
    })
}

/// The policy bundle built by `make policies`.
pub fn policy_bundle() -> Result<PathBuf, HarnessError> {
    let missing = |detail: String| HarnessError::Missing {
        what: format!(
            "the admission policy bundle ({detail}); run `make policies`, or `make test`, which \
             sets {BUNDLE_ENV}"
        ),
    };
    let path = std::env::var_os(BUNDLE_ENV)
        .filter(|v| !v.is_empty())
        .map(PathBuf::from)
        .ok_or_else(|| missing(format!("{BUNDLE_ENV} is not set")))?;
    if !path.is_file() {
        return Err(missing(format!("{} does not exist", path.display())));
    }
    Ok(path)
}

/// What a registration covers.
#[derive(Clone, Debug)]
pub struct WebhookOptions {
    /// `failurePolicy` of the validating webhook.
    pub failure_policy: &'static str,
    /// `timeoutSeconds` of both webhooks.
    pub timeout_seconds: i32,
    /// Also register the mutating (defaults) webhook.
    pub mutating: bool,
}

impl Default for WebhookOptions {
    fn default() -> Self {
        Self {
            failure_policy: "Fail",
            timeout_seconds: 10,
            mutating: true,
        }
    }
}

/// A registered webhook: its configurations, its port and the operator flags that serve it.
#[derive(Clone, Debug)]
pub struct Registration {
    pub id: String,
    pub port: u16,
    pub validating: String,
    pub mutating: Option<String>,
    /// Namespace of the operator's certificate Secret.
    pub system_namespace: String,
}

impl Registration {
    /// Creates the webhook configurations (without a caBundle: the operator injects it) for
    /// a free port, and a namespace for the operator's certificate Secret.
    pub async fn create(
        plane: &ControlPlane,
        id: &str,
        options: WebhookOptions,
    ) -> Result<Self, HarnessError> {
        Self::create_on(plane, id, free_port()?, options).await
    }

    /// [`Self::create`] for a webhook listening on `port` (several registrations may share
    /// one operator).
    pub async fn create_on(
        plane: &ControlPlane,
        id: &str,
        port: u16,
        options: WebhookOptions,
    ) -> Result<Self, HarnessError> {
        let client = plane.try_client()?;
        let system_namespace = plane.namespace("pko-system").await?;
        let selector = json!({"matchLabels": {WEBHOOK_LABEL: id}});
        let validating = format!("pko-tests-validating-{id}");
        let config: ValidatingWebhookConfiguration = serde_json::from_value(json!({
            "apiVersion": "admissionregistration.k8s.io/v1",
            "kind": "ValidatingWebhookConfiguration",
            "metadata": {"name": validating},
            "webhooks": [{
                "name": "validate.pko-rs.dev",
                "clientConfig": {"url": format!("https://127.0.0.1:{port}/validate")},
                "rules": [{
                    "operations": ["CREATE", "UPDATE"],
                    "apiGroups": ["pulumi.com", "auto.pulumi.com", "pko-rs.dev"],
                    "apiVersions": ["*"],
                    "resources": ["stacks", "workspaces", "programtransforms"],
                    "scope": "Namespaced",
                }],
                "namespaceSelector": selector,
                "matchConditions": [{
                    "name": "not-letting-go-of-a-deleted-object",
                    "expression": pko_admission::MATCH_CONDITION,
                }],
                "failurePolicy": options.failure_policy,
                "sideEffects": "None",
                "admissionReviewVersions": ["v1"],
                "timeoutSeconds": options.timeout_seconds,
            }, {
                // As deploy/webhook/validating.yaml: the registration's namespaces (the
                // selector matches a Namespace's own labels) are not deleted under Stacks
                // still to be destroyed.
                "name": "namespaces.pko-rs.dev",
                "clientConfig": {"url": format!("https://127.0.0.1:{port}/namespaces")},
                "rules": [{
                    "operations": ["DELETE"],
                    "apiGroups": [""],
                    "apiVersions": ["v1"],
                    "resources": ["namespaces"],
                    "scope": "Cluster",
                }],
                "namespaceSelector": selector,
                "matchConditions": [{
                    "name": "not-letting-go-of-a-deleted-object",
                    "expression": pko_admission::MATCH_CONDITION,
                }],
                "failurePolicy": "Ignore",
                "sideEffects": "None",
                "admissionReviewVersions": ["v1"],
                "timeoutSeconds": options.timeout_seconds,
            }],
        }))
        .map_err(|e| HarnessError::Missing {
            what: format!("a valid webhook configuration: {e}"),
        })?;
        Api::<ValidatingWebhookConfiguration>::all(client.clone())
            .create(&PostParams::default(), &config)
            .await
            .map_err(|e| HarnessError::kube(format!("creating {validating}"), e))?;
        let mutating = if options.mutating {
            let name = format!("pko-tests-mutating-{id}");
            let config: MutatingWebhookConfiguration = serde_json::from_value(json!({
                "apiVersion": "admissionregistration.k8s.io/v1",
                "kind": "MutatingWebhookConfiguration",
                "metadata": {"name": name},
                "webhooks": [{
                    "name": "defaults.pko-rs.dev",
                    "clientConfig": {"url": format!("https://127.0.0.1:{port}/mutate")},
                    "rules": [{
                        "operations": ["CREATE", "UPDATE"],
                        "apiGroups": ["auto.pulumi.com"],
                        "apiVersions": ["*"],
                        "resources": ["workspaces"],
                        "scope": "Namespaced",
                    }],
                    "namespaceSelector": selector,
                    "matchConditions": [{
                        "name": "not-letting-go-of-a-deleted-object",
                        "expression": pko_admission::MATCH_CONDITION,
                    }],
                    "failurePolicy": "Fail",
                    "sideEffects": "None",
                    "reinvocationPolicy": "Never",
                    "admissionReviewVersions": ["v1"],
                    "timeoutSeconds": options.timeout_seconds,
                }],
            }))
            .map_err(|e| HarnessError::Missing {
                what: format!("a valid webhook configuration: {e}"),
            })?;
            Api::<MutatingWebhookConfiguration>::all(client)
                .create(&PostParams::default(), &config)
                .await
                .map_err(|e| HarnessError::kube(format!("creating {name}"), e))?;
            Some(name)
        } else {
            None
        };
        Ok(Self {
            id: id.to_owned(),
            port,
            validating,
            mutating,
            system_namespace,
        })
    }

    /// Operator flags that serve this registration with operator-managed certificates.
    pub fn operator_args(&self, bundle: &std::path::Path) -> Vec<String> {
        vec![
            format!("--webhook-addr=127.0.0.1:{}", self.port),
            format!("--policy-bundle={}", bundle.display()),
            format!("--webhook-cert-namespace={}", self.system_namespace),
            "--webhook-cert-host=127.0.0.1".to_owned(),
            format!("--webhook-validating-configuration={}", self.validating),
            format!(
                "--webhook-mutating-configuration={}",
                self.mutating.clone().unwrap_or_default()
            ),
            "--webhook-cert-check-interval=1s".to_owned(),
        ]
    }

    /// Labels `namespace` so this registration's webhooks apply to it (plus `extra` labels).
    pub async fn enroll(
        &self,
        plane: &ControlPlane,
        namespace: &str,
        extra: &[(&str, &str)],
    ) -> Result<(), HarnessError> {
        let mut labels = BTreeMap::from([(WEBHOOK_LABEL.to_owned(), self.id.clone())]);
        for (k, v) in extra {
            labels.insert((*k).to_owned(), (*v).to_owned());
        }
        set_namespace_labels(plane, namespace, labels).await
    }

    /// Waits until the operator has injected a CA bundle into every configuration.
    pub async fn wait_ca_injected(
        &self,
        plane: &ControlPlane,
        timeout: Duration,
    ) -> Result<Vec<u8>, HarnessError> {
        let client = plane.try_client()?;
        let validating = Api::<ValidatingWebhookConfiguration>::all(client.clone());
        let mutating = Api::<MutatingWebhookConfiguration>::all(client);
        wait_for(
            "the CA bundle in the webhook configurations",
            timeout,
            || {
                let (validating, mutating) = (validating.clone(), mutating.clone());
                async move {
                    let v = validating.get(&self.validating).await.ok()?;
                    let bundle = v.webhooks?.first()?.client_config.ca_bundle.clone()?;
                    if let Some(name) = &self.mutating {
                        let m = mutating.get(name).await.ok()?;
                        let other = m.webhooks?.first()?.client_config.ca_bundle.clone()?;
                        if other != bundle {
                            return None;
                        }
                    }
                    (!bundle.0.is_empty()).then_some(bundle.0)
                }
            },
        )
        .await
    }

    /// Deletes the webhook configurations (best effort).
    pub async fn remove(&self, plane: &ControlPlane) {
        let Ok(client) = plane.try_client() else {
            return;
        };
        let _ = Api::<ValidatingWebhookConfiguration>::all(client.clone())
            .delete(&self.validating, &DeleteParams::default())
            .await;
        if let Some(name) = &self.mutating {
            let _ = Api::<MutatingWebhookConfiguration>::all(client)
                .delete(name, &DeleteParams::default())
                .await;
        }
    }
}

/// Replaces the labels of `namespace` with `labels` (plus the harness's own label).
pub async fn set_namespace_labels(
    plane: &ControlPlane,
    namespace: &str,
    mut labels: BTreeMap<String, String>,
) -> Result<(), HarnessError> {
    let api: Api<Namespace> = Api::all(plane.try_client()?);
    labels.insert(crate::NAMESPACE_LABEL.to_owned(), "true".to_owned());
    let current = api
        .get(namespace)
        .await
        .map_err(|e| HarnessError::kube(format!("reading namespace {namespace}"), e))?;
    // A JSON merge patch with null removes the labels that are not wanted any more.
    let mut patch_labels = serde_json::Map::new();
    for key in current.metadata.labels.unwrap_or_default().keys() {
        patch_labels.insert(key.clone(), serde_json::Value::Null);
    }
    for (k, v) in labels {
        patch_labels.insert(k, serde_json::Value::String(v));
    }
    api.patch(
        namespace,
        &PatchParams::default(),
        &Patch::Merge(json!({"metadata": {"labels": patch_labels}})),
    )
    .await
    .map_err(|e| HarnessError::kube(format!("labelling namespace {namespace}"), e))?;
    Ok(())
}

pub use crate::agent::free_port;
