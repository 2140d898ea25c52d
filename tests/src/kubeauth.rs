//! Service accounts, RBAC and tokens for PKO's auth mode on the real apiserver: what a cluster
//! admin sets up (the workspace's service account bound to `system:auth-delegator`, the
//! caller allowed to `use` `workspaces/rpc`) and what the kubelet gives a pod (a token of its
//! service account, here in a kubeconfig since the harness's pods are local processes).

use std::path::{Path, PathBuf};

use k8s_openapi::api::authentication::v1::{TokenRequest, TokenRequestSpec};
use k8s_openapi::api::core::v1::ServiceAccount;
use k8s_openapi::api::rbac::v1::{ClusterRole, ClusterRoleBinding, Role, RoleBinding};
use kube::api::{Api, PostParams};
use kube::{Client, Resource};
use serde_json::json;

use crate::{ControlPlane, HarnessError};

fn object<K: Resource + serde::de::DeserializeOwned>(
    value: serde_json::Value,
) -> Result<K, HarnessError> {
    serde_json::from_value(value).map_err(|e| HarnessError::Missing {
        what: format!("a valid object: {e}"),
    })
}

async fn create<K>(api: &Api<K>, object: &K, what: &str) -> Result<(), HarnessError>
where
    K: Resource + Clone + serde::Serialize + serde::de::DeserializeOwned + std::fmt::Debug,
{
    match api.create(&PostParams::default(), object).await {
        Ok(_) => Ok(()),
        Err(kube::Error::Api(e)) if e.code == 409 => Ok(()),
        Err(e) => Err(HarnessError::kube(format!("creating {what}"), e)),
    }
}

/// Creates the service account `namespace/name` (no controller makes `default` here).
pub async fn service_account(
    client: &Client,
    namespace: &str,
    name: &str,
) -> Result<(), HarnessError> {
    let api: Api<ServiceAccount> = Api::namespaced(client.clone(), namespace);
    let sa = object(json!({"metadata": {"name": name, "namespace": namespace}}))?;
    create(&api, &sa, &format!("service account {namespace}/{name}")).await
}

/// Binds `namespace/name` to `system:auth-delegator` (TokenReview and SubjectAccessReview), as
/// PKO's docs tell users to for every workspace service account.
pub async fn bind_auth_delegator(
    client: &Client,
    namespace: &str,
    name: &str,
) -> Result<(), HarnessError> {
    let api: Api<ClusterRoleBinding> = Api::all(client.clone());
    let binding = object(json!({
        "metadata": {"name": format!("{namespace}:{name}:system:auth-delegator")},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": "system:auth-delegator"},
        "subjects": [{"kind": "ServiceAccount", "namespace": namespace, "name": name}],
    }))?;
    create(&api, &binding, "the auth-delegator binding").await
}

/// Lets `sa_namespace/sa` `use` `workspaces/rpc` of namespace `namespace` (PKO's manager role
/// has it cluster-wide).
pub async fn grant_workspace_rpc(
    client: &Client,
    namespace: &str,
    sa_namespace: &str,
    sa: &str,
) -> Result<(), HarnessError> {
    let name = format!("workspace-rpc-{sa}");
    let roles: Api<Role> = Api::namespaced(client.clone(), namespace);
    let role = object(json!({
        "metadata": {"name": name, "namespace": namespace},
        "rules": [{"apiGroups": ["auto.pulumi.com"], "resources": ["workspaces/rpc"], "verbs": ["use"]}],
    }))?;
    create(&roles, &role, "the workspaces/rpc role").await?;
    let bindings: Api<RoleBinding> = Api::namespaced(client.clone(), namespace);
    let binding = object(json!({
        "metadata": {"name": name, "namespace": namespace},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": name},
        "subjects": [{"kind": "ServiceAccount", "namespace": sa_namespace, "name": sa}],
    }))?;
    create(&bindings, &binding, "the workspaces/rpc binding").await
}

/// Lets `sa_namespace/sa` `use` `workspaces/rpc` in every namespace, as PKO's manager
/// ClusterRole does for its own service account.
pub async fn grant_workspace_rpc_everywhere(
    client: &Client,
    sa_namespace: &str,
    sa: &str,
) -> Result<(), HarnessError> {
    let name = format!("workspace-rpc:{sa_namespace}:{sa}");
    let roles: Api<ClusterRole> = Api::all(client.clone());
    let role = object(json!({
        "metadata": {"name": name},
        "rules": [{"apiGroups": ["auto.pulumi.com"], "resources": ["workspaces/rpc"], "verbs": ["use"]}],
    }))?;
    create(&roles, &role, "the workspaces/rpc cluster role").await?;
    let bindings: Api<ClusterRoleBinding> = Api::all(client.clone());
    let binding = object(json!({
        "metadata": {"name": name},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": name},
        "subjects": [{"kind": "ServiceAccount", "namespace": sa_namespace, "name": sa}],
    }))?;
    create(&bindings, &binding, "the workspaces/rpc cluster binding").await
}

/// A token of `namespace/name` for `audience` (the apiserver's own when `None`), valid for an
/// hour.
pub async fn token(
    client: &Client,
    namespace: &str,
    name: &str,
    audience: Option<&str>,
) -> Result<String, HarnessError> {
    token_for(client, namespace, name, audience, 3600).await
}

/// [`token`] valid for `seconds`.
pub async fn token_for(
    client: &Client,
    namespace: &str,
    name: &str,
    audience: Option<&str>,
    seconds: i64,
) -> Result<String, HarnessError> {
    let api: Api<ServiceAccount> = Api::namespaced(client.clone(), namespace);
    let request = TokenRequest {
        spec: TokenRequestSpec {
            audiences: audience.map(|a| vec![a.to_owned()]).unwrap_or_default(),
            expiration_seconds: Some(seconds),
            bound_object_ref: None,
        },
        ..TokenRequest::default()
    };
    let minted = api
        .create_token_request(name, &PostParams::default(), &request)
        .await
        .map_err(|e| HarnessError::kube(format!("a token of {namespace}/{name}"), e))?;
    Ok(minted.status.map(|s| s.token).unwrap_or_default())
}

/// Writes a kubeconfig for `plane` that authenticates with `token` (what a pod's agent reads
/// where the kubelet would mount its service account) and returns its path.
pub fn kubeconfig_with_token(
    plane: &ControlPlane,
    token: &str,
    path: &Path,
) -> Result<PathBuf, HarnessError> {
    crate::control_plane::write_kubeconfig(
        path,
        &plane.server_url(),
        &plane.ca_path(),
        token,
        "default",
    )?;
    Ok(path.to_path_buf())
}
