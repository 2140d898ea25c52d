//! A write the apiserver refuses (422), as a cluster's own ValidatingAdmissionPolicy would: for
//! tests of how the operator reports what it cannot write.

use k8s_openapi::api::admissionregistration::v1::{
    ValidatingAdmissionPolicy, ValidatingAdmissionPolicyBinding,
};
use kube::Api;
use kube::api::{DeleteParams, PostParams};
use serde_json::json;

use crate::{ControlPlane, HarnessError};

/// What to refuse: `UPDATE`s of `group`'s `resource` (a subresource as `stacks/status`) where
/// the CEL `allowed` is false, answered with `message`.
pub struct Rule<'a> {
    pub group: &'a str,
    pub resource: &'a str,
    pub allowed: &'a str,
    pub message: &'a str,
    /// Only in this namespace (`None`: everywhere).
    pub namespace: Option<&'a str>,
}

/// An installed policy and its binding, both named `name`; removed by [`Refusal::remove`].
pub struct Refusal {
    name: String,
    policies: Api<ValidatingAdmissionPolicy>,
    bindings: Api<ValidatingAdmissionPolicyBinding>,
}

impl Refusal {
    pub async fn install(
        plane: &ControlPlane,
        name: &str,
        rule: Rule<'_>,
    ) -> Result<Self, HarnessError> {
        let client = plane.try_client()?;
        let invalid = |e: serde_json::Error| HarnessError::Missing {
            what: format!("a valid admission policy: {e}"),
        };
        let policy: ValidatingAdmissionPolicy = serde_json::from_value(json!({
            "apiVersion": "admissionregistration.k8s.io/v1",
            "kind": "ValidatingAdmissionPolicy",
            "metadata": {"name": name},
            "spec": {
                "failurePolicy": "Fail",
                "matchConstraints": {"resourceRules": [{
                    "apiGroups": [rule.group], "apiVersions": ["*"],
                    "operations": ["UPDATE"], "resources": [rule.resource],
                }]},
                "validations": [{"expression": rule.allowed, "message": rule.message}],
            },
        }))
        .map_err(invalid)?;
        let mut spec = json!({"policyName": name, "validationActions": ["Deny"]});
        if let Some(ns) = rule.namespace {
            spec["matchResources"] = json!({"namespaceSelector": {
                "matchLabels": {"kubernetes.io/metadata.name": ns},
            }});
        }
        let binding: ValidatingAdmissionPolicyBinding = serde_json::from_value(json!({
            "apiVersion": "admissionregistration.k8s.io/v1",
            "kind": "ValidatingAdmissionPolicyBinding",
            "metadata": {"name": name},
            "spec": spec,
        }))
        .map_err(invalid)?;
        let refusal = Self {
            name: name.to_owned(),
            policies: Api::all(client.clone()),
            bindings: Api::all(client),
        };
        refusal
            .policies
            .create(&PostParams::default(), &policy)
            .await
            .map_err(|e| HarnessError::kube(format!("creating policy {name}"), e))?;
        refusal
            .bindings
            .create(&PostParams::default(), &binding)
            .await
            .map_err(|e| HarnessError::kube(format!("creating binding {name}"), e))?;
        Ok(refusal)
    }

    /// Deletes the binding and the policy (best effort).
    pub async fn remove(self) {
        let _ = self
            .bindings
            .delete(&self.name, &DeleteParams::default())
            .await;
        let _ = self
            .policies
            .delete(&self.name, &DeleteParams::default())
            .await;
    }
}
