//! `TenancyPolicy` (`pko-rs.dev/v1alpha1`, cluster-scoped): what the tenants of some namespaces
//! may use, and what happens when they do not comply.
//!
//! The admission webhook turns every TenancyPolicy that selects the namespace of a request into
//! the `data.tenancy.policies` document of the Rego policies (see `docs/policies.md`).

#![allow(
    unreachable_pub,
    clippy::too_many_lines,
    reason = "the KubeSchema derive copies each struct into a private module of its own"
)]

use k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelector;
use kube::{CustomResource, KubeSchema};
use serde::{Deserialize, Serialize};

/// API group of the kinds that pko-rs adds to PKO's.
pub const GROUP: &str = "pko-rs.dev";

/// CEL rule on the spec: a policy that selects no namespace is a mistake, not a no-op.
pub const SELECTS_RULE: &str = "has(self.namespaces) || has(self.namespaceSelector)";
/// Message of [`SELECTS_RULE`].
pub const SELECTS_MESSAGE: &str = "select namespaces with namespaces, namespaceSelector or both";
/// CEL rule on `allowedTransformDigests`: hex sha256 digests, with or without `sha256:`.
pub const DIGESTS_RULE: &str = "self.all(d, d.matches('^(sha256:)?[0-9a-fA-F]{64}$'))";
/// Message of [`DIGESTS_RULE`].
pub const DIGESTS_MESSAGE: &str =
    "each digest must be 64 hex characters, optionally prefixed with sha256:";

/// TenancyPolicy says what the tenants of the selected namespaces may use: service accounts,
/// workspace images and transform modules, and whether the namespaces are exempt from the
/// restricted (non-root) policy. Its enforcement action decides what a violation in those
/// namespaces does: deny the request, admit it with a warning, or only record it.
#[derive(CustomResource, KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Default)]
#[kube(
    group = "pko-rs.dev",
    version = "v1alpha1",
    kind = "TenancyPolicy",
    plural = "tenancypolicies",
    shortname = "tp",
    category = "pko-rs",
    status = "TenancyPolicyStatus",
    doc = "TenancyPolicy says what the tenants of the selected namespaces may use and how violations are enforced.",
    // JSON columns: the `printcolumn(...)` form repeats keys, which clippy flags.
    printcolumn = r#"{"name":"Action","type":"string","jsonPath":".spec.enforcementAction"}"#,
    printcolumn = r#"{"name":"Namespaces","type":"string","jsonPath":".spec.namespaces"}"#,
    printcolumn = r#"{"name":"Selected","type":"integer","jsonPath":".status.selectedNamespaces"}"#,
    printcolumn = r#"{"name":"Ready","type":"string","jsonPath":".status.conditions[?(@.type==\"Ready\")].status"}"#,
    printcolumn = r#"{"name":"Age","type":"date","jsonPath":".metadata.creationTimestamp"}"#
)]
#[x_kube(validation = Rule::new(SELECTS_RULE).message(SELECTS_MESSAGE))]
#[serde(rename_all = "camelCase")]
pub struct TenancyPolicySpec {
    /// What a violation in the selected namespaces does: `deny` rejects the request, `warn`
    /// admits it and returns the violations as warnings, `dryrun` admits it and only records
    /// the violations (metric, log, audit annotation). When several policies select a
    /// namespace, a violation of an allowance list takes the action of the policy owning the
    /// list; any other violation takes the strictest action among them.
    #[serde(default)]
    pub enforcement_action: EnforcementAction,
    /// Namespaces selected by name.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub namespaces: Option<Vec<String>>,
    /// Namespaces selected by their labels (in addition to `namespaces`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub namespace_selector: Option<LabelSelector>,
    /// Exempts the selected namespaces from the restricted policy: workspaces may use the
    /// baseline security profile, which runs as root.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub exempt_from_restricted: Option<bool>,
    /// Service accounts that Workspaces and Stacks may name (`default` is always allowed).
    /// Unset: any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub allowed_service_accounts: Option<Vec<String>>,
    /// Prefixes that every workspace and pod-template container image must start with (e.g.
    /// `registry.example.com/team-a/`). Unset: any image.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub allowed_image_prefixes: Option<Vec<String>>,
    /// sha256 digests of the transform modules that ProgramTransforms may load. Unset: any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 1024), inner(length(max = 71)))]
    #[x_kube(validation = Rule::new(DIGESTS_RULE).message(DIGESTS_MESSAGE))]
    pub allowed_transform_digests: Option<Vec<String>>,
    /// Registries (and repository prefixes, e.g. `registry.example.com/team-a`) that
    /// ProgramTransforms may pull OCI modules from; matched on whole path segments. A module
    /// not allowed by digest is allowed when it comes from one of these and, if
    /// `allowedTransformKeys` is set too, is verified with those keys. Unset: by digest only.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 256), inner(length(min = 1, max = 512)))]
    pub allowed_transform_registries: Option<Vec<String>>,
    /// PEM public keys that ProgramTransforms may verify OCI modules with: a transform
    /// allowed this way lists its keys inline under `verify.cosign.keys`, all from this list
    /// (a key in a Secret cannot be checked at admission). Unset: by digest only.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 64), inner(length(min = 1, max = 4096)))]
    pub allowed_transform_keys: Option<Vec<String>>,
}

/// Observed state of a TenancyPolicy, written by the operator's leader.
#[derive(Serialize, Deserialize, schemars::JsonSchema, Clone, Debug, PartialEq, Default)]
#[serde(rename_all = "camelCase")]
pub struct TenancyPolicyStatus {
    /// The generation the status describes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,
    /// How many existing namespaces the policy selects now (by name or by labels).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub selected_namespaces: Option<i64>,
    /// `Ready`: `True` (`Accepted`) when the admission webhook applies the whole policy;
    /// `False` with `InvalidNamespaceSelector` when the selector cannot be parsed (it then
    /// selects nothing and only `namespaces` apply).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(extend(
        "x-kubernetes-list-type" = "map",
        "x-kubernetes-list-map-keys" = ["type"],
    ))]
    pub conditions: Vec<crate::common::Condition>,
}

/// What a violation does, as in OPA Gatekeeper.
#[derive(
    Serialize, Deserialize, schemars::JsonSchema, Clone, Copy, Debug, PartialEq, Eq, Default,
)]
#[serde(rename_all = "lowercase")]
pub enum EnforcementAction {
    /// Reject the request with every violation in the message.
    #[default]
    Deny,
    /// Admit the request and return each violation as a warning.
    Warn,
    /// Admit the request; record the violation in a metric, the log and an audit annotation.
    Dryrun,
}

impl EnforcementAction {
    /// The value used in the CRD and in the policy data.
    pub fn as_str(self) -> &'static str {
        match self {
            EnforcementAction::Deny => "deny",
            EnforcementAction::Warn => "warn",
            EnforcementAction::Dryrun => "dryrun",
        }
    }
}

#[cfg(test)]
mod tests {
    use kube::CustomResourceExt;
    use serde_json::{Value, json};

    use super::*;

    fn crd_json() -> Value {
        serde_json::to_value(TenancyPolicy::crd()).expect("CRD serializes")
    }

    #[test]
    fn crd_is_cluster_scoped_in_our_group() {
        let crd = crd_json();
        assert_eq!(crd["metadata"]["name"], "tenancypolicies.pko-rs.dev");
        assert_eq!(crd["spec"]["scope"], "Cluster");
        assert_eq!(crd["spec"]["group"], GROUP);
        assert_eq!(crd["spec"]["versions"][0]["name"], "v1alpha1");
    }

    #[test]
    fn crd_carries_the_rules_and_the_action_enum() {
        let crd = crd_json();
        let spec = &crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"];
        assert_eq!(
            spec["x-kubernetes-validations"][0]["rule"],
            json!(SELECTS_RULE)
        );
        let digests = &spec["properties"]["allowedTransformDigests"];
        assert_eq!(
            digests["x-kubernetes-validations"][0]["rule"],
            json!(DIGESTS_RULE)
        );
        assert_eq!(
            spec["properties"]["enforcementAction"]["enum"],
            json!(["deny", "warn", "dryrun"])
        );
        assert_eq!(spec["properties"]["enforcementAction"]["default"], "deny");
    }

    #[test]
    fn spec_round_trips_with_defaults() {
        let spec: TenancyPolicySpec =
            serde_json::from_value(json!({"namespaces": ["team-a"]})).expect("parses");
        assert_eq!(spec.enforcement_action, EnforcementAction::Deny);
        assert_eq!(
            serde_json::to_value(&spec).expect("serializes"),
            json!({"enforcementAction": "deny", "namespaces": ["team-a"]})
        );
    }
}
