//! Builders of the objects the integration tests create: one per kind, taking what a test
//! varies (a name, a spec) and filling in the rest, plus modifiers that return the object
//! changed (`program(..).labeled(..)`).
//!
//! Test support only: a builder panics when its own JSON does not make a valid object, which is
//! a bug in the test that called it, not a runtime condition.

use std::collections::BTreeMap;
use std::path::Path;

use kube::Resource;
use pko_api::program::Program;
use pko_api::stack::Stack;
use pko_api::update::Update;
use pko_api::workspace::Workspace;
use serde::de::DeserializeOwned;
use serde_json::{Value, json};
use sha2::{Digest, Sha256};

/// The passphrase of the stacks the tests create on a file backend.
pub const PASSPHRASE: &str = "pko-tests";

/// `json` as a `K`, panicking with the kind's name if it is not one.
fn object<K: DeserializeOwned>(kind: &str, json: Value) -> K {
    match serde_json::from_value(json) {
        Ok(object) => object,
        Err(e) => panic!("invalid {kind} fixture: {e}"),
    }
}

/// A Program `name` whose Pulumi YAML is `spec` (the `program` field).
pub fn program(name: &str, spec: Value) -> Program {
    object(
        "Program",
        json!({
            "apiVersion": "pulumi.com/v1",
            "kind": "Program",
            "metadata": {"name": name},
            "program": spec,
        }),
    )
}

/// A Program `name` with one ConfigMap resource: the smallest one that gets an artifact.
pub fn config_map_program(name: &str) -> Program {
    program(
        name,
        json!({"resources": {"r": {"type": "kubernetes:core/v1:ConfigMap"}}}),
    )
}

/// A Stack `name` with `spec`.
pub fn stack(name: &str, spec: Value) -> Stack {
    object(
        "Stack",
        json!({
            "apiVersion": "pulumi.com/v1",
            "kind": "Stack",
            "metadata": {"name": name},
            "spec": spec,
        }),
    )
}

/// A Stack `name` for stack `dev` on the file backend in folder `backend`, with the test
/// passphrase, and `spec`'s fields on top.
pub fn file_backend_stack(name: &str, backend: &Path, spec: Value) -> Stack {
    let base = json!({
        "stack": "dev",
        "backend": format!("file://{}", backend.display()),
        "envRefs": {"PULUMI_CONFIG_PASSPHRASE": {"type": "Literal", "literal": {"value": PASSPHRASE}}},
    });
    stack(name, merged(base, spec))
}

/// A Workspace `name` with `spec`.
pub fn workspace(name: &str, spec: Value) -> Workspace {
    object(
        "Workspace",
        json!({
            "apiVersion": "auto.pulumi.com/v1alpha1",
            "kind": "Workspace",
            "metadata": {"name": name},
            "spec": spec,
        }),
    )
}

/// An Update `name` with `spec`, controlled by the Workspace named `workspace` with `uid`:
/// an Update without a controller owner is canceled, as in PKO.
pub fn update(name: &str, workspace: &str, uid: &str, spec: Value) -> Update {
    object(
        "Update",
        json!({
            "apiVersion": "auto.pulumi.com/v1alpha1",
            "kind": "Update",
            "metadata": {"name": name, "ownerReferences": [controller_of(workspace, uid)]},
            "spec": spec,
        }),
    )
}

/// The controller reference of an Update to the Workspace `workspace` with `uid`.
pub fn controller_of(workspace: &str, uid: &str) -> Value {
    json!({
        "apiVersion": "auto.pulumi.com/v1alpha1", "kind": "Workspace",
        "name": workspace, "uid": uid, "controller": true, "blockOwnerDeletion": true,
    })
}

/// `base` with the top-level fields of `more` added or replaced (both JSON objects; anything
/// else in `more` is ignored).
pub fn merged(mut base: Value, more: Value) -> Value {
    if let (Value::Object(base), Value::Object(more)) = (&mut base, more) {
        base.extend(more);
    }
    base
}

/// Modifiers of any built object.
pub trait Modify: Resource + Sized {
    /// The object with these labels (replacing any it had).
    fn labeled(mut self, labels: &[(&str, &str)]) -> Self {
        let labels: BTreeMap<String, String> = labels
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect();
        self.meta_mut().labels = Some(labels);
        self
    }
}

impl<K: Resource> Modify for K {}

/// A Program's status as JSON (`null` before the first one).
pub fn status_of(p: &Program) -> Value {
    match p.status.as_ref().map(serde_json::to_value) {
        Some(Ok(status)) => status,
        Some(Err(e)) => panic!("Program status as JSON: {e}"),
        None => Value::Null,
    }
}

/// `sha256:<hex>` of `bytes`, the form of an artifact digest.
pub fn sha256(bytes: &[u8]) -> String {
    format!("sha256:{}", hex::encode(Sha256::digest(bytes)))
}

/// Creates the Program `name` with `spec` through `api`, then waits up to `wait` for its
/// artifact: `(url, digest)`.
pub async fn published_program(
    api: &kube::Api<Program>,
    name: &str,
    spec: Value,
    wait: std::time::Duration,
) -> Result<(String, String), crate::HarnessError> {
    api.create(&kube::api::PostParams::default(), &program(name, spec))
        .await
        .map_err(|e| crate::HarnessError::kube(format!("creating Program {name}"), e))?;
    crate::wait_for(&format!("the artifact of Program {name}"), wait, || async {
        let status = serde_json::to_value(api.get(name).await.ok()?.status?).ok()?;
        let artifact = status.get("artifact")?;
        Some((
            artifact["url"].as_str()?.to_owned(),
            artifact["digest"].as_str()?.to_owned(),
        ))
    })
    .await
}

/// Waits up to `wait` for Stack `name` to be `Stalled=True`; its (reason, message).
pub async fn stalled_stack(
    stacks: &kube::Api<Stack>,
    name: &str,
    wait: std::time::Duration,
) -> (String, String) {
    crate::wait_for(&format!("stack {name} to stall"), wait, || async {
        let status = stacks.get(name).await.ok()?.status?;
        status
            .conditions
            .iter()
            .find(|c| c.type_ == "Stalled" && c.status == "True")
            .map(|c| (c.reason.clone(), c.message.clone()))
    })
    .await
    .expect("stalled")
}

/// A Pulumi YAML `kubernetes:core/v1:ConfigMap` resource labelled `effect: <label>` in the
/// namespace of config `ns`, named by Pulumi, with `data`: what the effect tests count in the
/// test apiserver. Deleted in the background: the test plane has no garbage collector to
/// finish a foreground deletion.
pub fn labelled_config_map(label: &str, data: Value) -> Value {
    json!({
        "type": "kubernetes:core/v1:ConfigMap",
        "properties": {
            "metadata": {"namespace": "${ns}", "labels": {"effect": label},
                "annotations": {"pulumi.com/deletionPropagationPolicy": "background"}},
            "data": data,
        },
    })
}

/// The ConfigMaps labelled `effect: <label>` in `namespace` (see [`labelled_config_map`]).
pub async fn labelled(
    client: kube::Client,
    namespace: &str,
    label: &str,
) -> Vec<k8s_openapi::api::core::v1::ConfigMap> {
    let api: kube::Api<k8s_openapi::api::core::v1::ConfigMap> =
        kube::Api::namespaced(client, namespace);
    match api
        .list(&kube::api::ListParams::default().labels(&format!("effect={label}")))
        .await
    {
        Ok(list) => list.items,
        Err(e) => panic!("listing the ConfigMaps labelled {label}: {e}"),
    }
}

/// Every file under `dir`, recursively (none if it does not exist).
pub fn files_under(dir: &Path) -> Vec<std::path::PathBuf> {
    let mut out = Vec::new();
    for entry in std::fs::read_dir(dir).into_iter().flatten().flatten() {
        let path = entry.path();
        if path.is_dir() {
            out.extend(files_under(&path));
        } else {
            out.push(path);
        }
    }
    out
}

/// Waits up to `wait` for Workspace `name` to be `Ready=True`; it, or a panic with its status
/// and `logs()` (the pod's logs, read only then).
pub async fn ready_workspace(
    api: &kube::Api<Workspace>,
    name: &str,
    wait: std::time::Duration,
    logs: impl FnOnce() -> String,
) -> Workspace {
    let ready = crate::wait_for(&format!("workspace {name} to be ready"), wait, || async {
        let ws = api.get(name).await.ok()?;
        ws.status
            .as_ref()?
            .conditions
            .iter()
            .any(|c| c.type_ == "Ready" && c.status == "True")
            .then_some(ws)
    })
    .await;
    match ready {
        Ok(ws) => ws,
        Err(e) => {
            let status = api.get(name).await.ok().and_then(|w| w.status);
            panic!("{e}; status: {status:?}\n{}", logs())
        }
    }
}

/// Creates Update `name` with `spec` (`workspaceName` and `stackName` added) under Workspace
/// `workspace` (its controller) and waits up to `wait` for it to complete: its status, or a
/// panic with `logs()`.
pub async fn completed_update(
    client: kube::Client,
    ns: &str,
    (workspace, stack): (&str, &str),
    name: &str,
    spec: Value,
    wait: std::time::Duration,
    logs: impl FnOnce() -> String,
) -> pko_api::update::UpdateStatus {
    let workspaces: kube::Api<Workspace> = kube::Api::namespaced(client.clone(), ns);
    let uid = workspaces
        .get(workspace)
        .await
        .expect("workspace")
        .metadata
        .uid
        .expect("uid");
    let spec = merged(
        json!({"workspaceName": workspace, "stackName": stack}),
        spec,
    );
    let updates: kube::Api<Update> = kube::Api::namespaced(client, ns);
    updates
        .create(
            &kube::api::PostParams::default(),
            &update(name, workspace, &uid, spec),
        )
        .await
        .expect("create update");
    let done = crate::wait_for(&format!("update {name} to complete"), wait, || async {
        let status = updates.get(name).await.ok()?.status?;
        status
            .conditions
            .iter()
            .any(|c| c.type_ == "Complete" && c.status == "True")
            .then_some(status)
    })
    .await;
    match done {
        Ok(status) => status,
        Err(e) => {
            let status = updates.get(name).await.ok().and_then(|u| u.status);
            panic!("{e}: {status:?}\n{}", logs())
        }
    }
}

/// The outputs of a completed Update (its outputs Secret, each value JSON); empty without one.
pub async fn update_outputs(
    client: kube::Client,
    ns: &str,
    status: &pko_api::update::UpdateStatus,
) -> BTreeMap<String, Value> {
    let Some(name) = status.outputs.as_deref() else {
        return BTreeMap::new();
    };
    let secrets: kube::Api<k8s_openapi::api::core::v1::Secret> = kube::Api::namespaced(client, ns);
    let secret = secrets.get(name).await.expect("outputs secret");
    secret
        .data
        .unwrap_or_default()
        .into_iter()
        .map(|(k, v)| {
            let value = serde_json::from_slice(&v.0).unwrap_or(Value::Null);
            (k, value)
        })
        .collect()
}

/// The objects of a multi-document YAML manifest at `path`, in order (documents that are empty
/// or not objects with an `apiVersion` are left out).
pub fn manifest(path: &Path) -> Result<Vec<Value>, crate::HarnessError> {
    let text = std::fs::read_to_string(path)
        .map_err(|e| crate::HarnessError::io(format!("reading {}", path.display()), e))?;
    Ok(text
        .split("\n---")
        .filter_map(|doc| yaml_serde::from_str::<Value>(doc).ok())
        .filter(|doc| doc.get("apiVersion").is_some_and(Value::is_string))
        .collect())
}

/// The kinds of a manifest that are not namespaced (the rest are).
const CLUSTER_KINDS: &[&str] = &[
    "Namespace",
    "ClusterRole",
    "ClusterRoleBinding",
    "TenancyPolicy",
    "ClusterProgramTransform",
];

/// `object` of a PKO manifest made to run in the test namespace `ns` with its file state in
/// `backend`, or `None` for a Namespace (the test's own stands in for it). Only what the test
/// plane forces is changed:
/// - every namespaced object, and every ServiceAccount a binding names, moves to `ns` (the
///   harness kubelet and operator serve one namespace each);
/// - a cluster-scoped object gets `-<ns>` on its name, so two runs never share one;
/// - a Stack's `file:///...` `PULUMI_BACKEND_URL` literal points at `backend`: the harness runs
///   pods as host processes and maps a volume's path only where a word starts with it, so a
///   `file://` URL naming the volume's mount path would be the host's own folder.
pub fn localized(mut object: Value, ns: &str, backend: &Path) -> Option<Value> {
    let kind = object["kind"].as_str().unwrap_or_default().to_owned();
    if kind == "Namespace" {
        return None;
    }
    if CLUSTER_KINDS.contains(&kind.as_str()) {
        let name = object["metadata"]["name"].as_str().unwrap_or_default();
        object["metadata"]["name"] = json!(format!("{name}-{ns}"));
    } else {
        object["metadata"]["namespace"] = json!(ns);
    }
    if let Some(subjects) = object.get_mut("subjects").and_then(Value::as_array_mut) {
        for subject in subjects {
            if subject["kind"] == "ServiceAccount" {
                subject["namespace"] = json!(ns);
            }
        }
    }
    if kind == "Stack"
        && let Some(url) = object
            .pointer_mut("/spec/envRefs/PULUMI_BACKEND_URL/literal/value")
            .filter(|v| v.as_str().is_some_and(|s| s.starts_with("file:///")))
    {
        *url = json!(format!("file://{}", backend.display()));
    }
    Some(object)
}

/// The objects of the example manifest `path` (in `examples/`) made to run in a test, as the
/// file is but for what a test must change:
/// - in every string value, each `(placeholder, value)` of `substitutions` (what a user edits:
///   a repository URL, a token, a registry host, a digest) is replaced; a placeholder found
///   nowhere is an error, so an example and its test cannot drift apart;
/// - then as [`localized`]: namespaced objects move to `ns`, cluster-scoped ones get `-<ns>`
///   on their name;
/// - a Stack logging in to Pulumi Cloud (`envRefs.PULUMI_ACCESS_TOKEN`) keeps its state in the
///   file backend `backend` instead, with the test passphrase (the tests are offline).
pub fn example(
    path: &Path,
    ns: &str,
    backend: &Path,
    substitutions: &[(&str, &str)],
) -> Result<Vec<Value>, crate::HarnessError> {
    let mut used = vec![false; substitutions.len()];
    let objects = manifest(path)?
        .into_iter()
        .map(|mut object| {
            substitute(&mut object, substitutions, &mut used);
            object
        })
        .filter_map(|object| localized(object, ns, backend))
        .map(|object| off_the_cloud(object, backend))
        .collect();
    match substitutions.iter().zip(&used).find(|(_, used)| !**used) {
        Some(((placeholder, _), _)) => Err(crate::HarnessError::Missing {
            what: format!("{placeholder:?} in {}", path.display()),
        }),
        None => Ok(objects),
    }
}

/// Replaces each placeholder of `substitutions` in every string of `value`, marking in `used`
/// those found.
fn substitute(value: &mut Value, substitutions: &[(&str, &str)], used: &mut [bool]) {
    match value {
        Value::String(text) => {
            for ((placeholder, replacement), used) in substitutions.iter().zip(used.iter_mut()) {
                if text.contains(placeholder) {
                    *text = text.replace(placeholder, replacement);
                    *used = true;
                }
            }
        }
        Value::Array(items) => items
            .iter_mut()
            .for_each(|v| substitute(v, substitutions, used)),
        Value::Object(map) => map
            .values_mut()
            .for_each(|v| substitute(v, substitutions, used)),
        _ => {}
    }
}

/// A Stack with `envRefs.PULUMI_ACCESS_TOKEN` on the file backend `backend` with the test
/// passphrase instead; any other object as it is.
fn off_the_cloud(mut object: Value, backend: &Path) -> Value {
    let Some(env) = object
        .pointer_mut("/spec/envRefs")
        .and_then(Value::as_object_mut)
    else {
        return object;
    };
    if env.remove("PULUMI_ACCESS_TOKEN").is_none() {
        return object;
    }
    env.insert(
        "PULUMI_CONFIG_PASSPHRASE".into(),
        json!({"type": "Literal", "literal": {"value": PASSPHRASE}}),
    );
    object["spec"]["backend"] = json!(format!("file://{}", backend.display()));
    object
}

/// Applies `objects` (server-side, as `kubectl apply --server-side --force-conflicts` would):
/// each namespaced one in `ns`, the others cluster-wide.
pub async fn apply_all(
    client: kube::Client,
    ns: &str,
    objects: &[Value],
) -> Result<(), crate::HarnessError> {
    use kube::api::{ApiResource, DynamicObject, Patch, PatchParams};
    use kube::core::GroupVersionKind;
    for object in objects {
        let (api_version, kind) = (
            object["apiVersion"].as_str().unwrap_or_default(),
            object["kind"].as_str().unwrap_or_default(),
        );
        let (group, version) = api_version.split_once('/').unwrap_or(("", api_version));
        let resource = ApiResource::from_gvk(&GroupVersionKind::gvk(group, version, kind));
        let api: kube::Api<DynamicObject> = if CLUSTER_KINDS.contains(&kind) {
            kube::Api::all_with(client.clone(), &resource)
        } else {
            kube::Api::namespaced_with(client.clone(), ns, &resource)
        };
        let name = object["metadata"]["name"].as_str().unwrap_or_default();
        api.patch(
            name,
            &PatchParams::apply("pko-tests").force(),
            &Patch::Apply(object),
        )
        .await
        .map_err(|e| crate::HarnessError::kube(format!("applying {kind} {name}"), e))?;
    }
    Ok(())
}

/// Waits up to `wait` for Stack `name` to be `Ready=True` at generation `generation` or later;
/// its status.
pub async fn ready_stack(
    stacks: &kube::Api<Stack>,
    name: &str,
    generation: i64,
    wait: std::time::Duration,
) -> Result<pko_api::stack::StackStatus, crate::HarnessError> {
    crate::wait_for(&format!("stack {name} to be ready"), wait, || async {
        let status = stacks.get(name).await.ok()?.status?;
        let ready = status.observed_generation.is_some_and(|g| g >= generation)
            && status
                .conditions
                .iter()
                .any(|c| c.type_ == "Ready" && c.status == "True");
        ready.then_some(status)
    })
    .await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_example_gets_the_tests_values_and_backend() {
        let dir = tempfile::tempdir().expect("tmp");
        let file = dir.path().join("example.yaml");
        std::fs::write(
            &file,
            "# a comment naming https://git.example.com/a.git\n\
             apiVersion: pulumi.com/v1\nkind: Stack\nmetadata: {name: s, namespace: default}\n\
             spec:\n  projectRepo: https://git.example.com/a.git\n  envRefs:\n\
             \x20   PULUMI_ACCESS_TOKEN: {type: Secret, secret: {name: p, key: t}}\n\
             ---\napiVersion: pko-rs.dev/v1alpha1\nkind: TenancyPolicy\n\
             metadata: {name: team}\nspec: {namespaces: [team-a]}\n",
        )
        .expect("write");
        let backend = Path::new("/tmp/t/backend");
        let objects = example(
            &file,
            "t",
            backend,
            &[
                ("https://git.example.com/a.git", "https://127.0.0.1:1/a.git"),
                ("team-a", "t"),
            ],
        )
        .expect("example");
        assert_eq!(objects[0]["metadata"]["namespace"], "t");
        assert_eq!(
            objects[0]["spec"]["projectRepo"],
            "https://127.0.0.1:1/a.git"
        );
        assert_eq!(objects[0]["spec"]["backend"], "file:///tmp/t/backend");
        assert_eq!(
            objects[0]["spec"]["envRefs"],
            json!({"PULUMI_CONFIG_PASSPHRASE": {"type": "Literal", "literal": {"value": PASSPHRASE}}})
        );
        assert_eq!(objects[1]["metadata"]["name"], "team-t");
        assert_eq!(objects[1]["metadata"].get("namespace"), None);
        assert_eq!(objects[1]["spec"]["namespaces"], json!(["t"]));
        // A placeholder the file does not hold (only its comment does) is an error.
        let err = example(&file, "t", backend, &[("git.example.com/b", "x")]);
        assert!(err.is_err(), "{err:?}");
    }

    #[test]
    fn a_manifest_moves_to_the_test_namespace_and_backend() {
        let backend = Path::new("/tmp/t/backend");
        assert_eq!(
            localized(
                json!({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "a"}}),
                "t",
                backend
            ),
            None
        );
        let binding = json!({
            "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding",
            "metadata": {"name": "a:system:auth-delegator"},
            "subjects": [{"kind": "ServiceAccount", "name": "a", "namespace": "a"}],
        });
        let binding = localized(binding, "t", backend).expect("kept");
        assert_eq!(binding["metadata"]["name"], "a:system:auth-delegator-t");
        assert_eq!(binding["metadata"].get("namespace"), None);
        assert_eq!(binding["subjects"][0]["namespace"], "t");
        let stack = json!({
            "apiVersion": "pulumi.com/v1", "kind": "Stack",
            "metadata": {"name": "s", "namespace": "a"},
            "spec": {"envRefs": {
                "PULUMI_BACKEND_URL": {"type": "Literal", "literal": {"value": "file:///state/"}},
                "PULUMI_CONFIG_PASSPHRASE": {"type": "Literal", "literal": {"value": "test"}},
            }},
        });
        let stack = localized(stack, "t", backend).expect("kept");
        assert_eq!(stack["metadata"]["namespace"], "t");
        assert_eq!(
            stack["spec"]["envRefs"]["PULUMI_BACKEND_URL"]["literal"]["value"],
            "file:///tmp/t/backend"
        );
        assert_eq!(
            stack["spec"]["envRefs"]["PULUMI_CONFIG_PASSPHRASE"]["literal"]["value"],
            "test"
        );
    }
}
