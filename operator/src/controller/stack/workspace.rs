//! The Workspace of a stack (PKO's `setupWorkspace`): typed, then the Stack's
//! `workspaceTemplate` strategically merged on.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::{
    ConfigMapEnvSource, ConfigMapVolumeSource, Container, EnvFromSource, EnvVar, EnvVarSource,
    PodSpec, SecretEnvSource, SecretKeySelector, SecretVolumeSource, Volume, VolumeMount,
};
use kube::ResourceExt;
use pko_api::common::{ResourceRef, ResourceSelectorType};
use pko_api::stack::Stack;
use pko_api::workspace::{
    ConfigItem, ConfigValueFrom, EmbeddedPodTemplateSpec, Workspace, WorkspaceSpec, WorkspaceStack,
};
use serde_json::Value;

use super::outcome::StackError;
use super::source::{WorkspaceSource, own_secret};
use crate::controller::keys::{STACK_COMPONENT_LABEL, STACK_NAME_LABEL};
use crate::controller::kit;
use crate::controller::workspace::{merge, pod};

/// The labels that tie a Workspace or Update to its stack (the controller watches by them).
pub(super) fn labels(name: &str) -> BTreeMap<String, String> {
    BTreeMap::from([
        (STACK_COMPONENT_LABEL.to_owned(), "stack".to_owned()),
        (STACK_NAME_LABEL.to_owned(), name.to_owned()),
    ])
}

/// A reference the pulumi container reads: a literal value or a Secret key.
enum Reference {
    Literal(String),
    Secret { name: String, key: String },
}

fn reference(what: &str, r: &ResourceRef, namespace: &str) -> Result<Reference, String> {
    match r.selector_type {
        ResourceSelectorType::Literal => Ok(Reference::Literal(
            r.literal
                .as_ref()
                .map(|l| l.value.clone())
                .unwrap_or_default(),
        )),
        ResourceSelectorType::Secret => {
            let s = own_secret(what, r, namespace)?;
            Ok(Reference::Secret {
                name: s.name.clone(),
                key: s.key.clone(),
            })
        }
        other => Err(format!(
            "{what}: {other:?} references are not supported (only Literal and Secret)"
        )),
    }
}

fn env_value(name: &str, value: String) -> EnvVar {
    EnvVar {
        name: name.to_owned(),
        value: Some(value),
        value_from: None,
    }
}

fn env_secret(name: &str, secret: String, key: String) -> EnvVar {
    EnvVar {
        name: name.to_owned(),
        value: None,
        value_from: Some(EnvVarSource {
            secret_key_ref: Some(SecretKeySelector {
                name: secret,
                key,
                optional: None,
            }),
            ..Default::default()
        }),
    }
}

fn config_value(key: &str, value: Value, secret: bool) -> ConfigItem {
    ConfigItem {
        key: key.to_owned(),
        value: Some(value),
        secret: secret.then_some(true),
        ..Default::default()
    }
}

fn config_file(key: &str, path: String, json: Option<bool>, secret: bool) -> ConfigItem {
    ConfigItem {
        key: key.to_owned(),
        value_from: Some(ConfigValueFrom {
            path: Some(path),
            json,
            env: None,
        }),
        secret: secret.then_some(true),
        ..Default::default()
    }
}

/// Volumes the pulumi container mounts (ConfigMaps and Secrets config is read from), once each.
#[derive(Default)]
struct Mounts {
    volumes: Vec<Volume>,
    mounts: Vec<VolumeMount>,
}

impl Mounts {
    fn add(&mut self, volume: Volume, dir: &str) {
        if self.volumes.iter().any(|v| v.name == volume.name) {
            return;
        }
        self.mounts.push(VolumeMount {
            name: volume.name.clone(),
            mount_path: dir.to_owned(),
            ..Default::default()
        });
        self.volumes.push(volume);
    }
}

/// Stack config: inline values, ConfigMap keys, then secrets (inline and referenced).
fn config(stack: &Stack, namespace: &str, mounts: &mut Mounts) -> Result<Vec<ConfigItem>, String> {
    let spec = &stack.spec;
    let mut config = Vec::new();
    for (key, value) in &spec.config {
        config.push(config_value(key, value.clone(), false));
    }
    for (key, r) in &spec.config_ref {
        let dir = format!(
            "/var/run/configmaps/stacks.pulumi.com/configmaps/{}",
            r.name
        );
        let volume = Volume {
            name: pod::volume_name("configmap", &r.name),
            config_map: Some(ConfigMapVolumeSource {
                name: r.name.clone(),
                ..Default::default()
            }),
            ..Default::default()
        };
        mounts.add(volume, &dir);
        config.push(config_file(key, format!("{dir}/{}", r.key), r.json, false));
    }
    for (key, value) in &spec.secrets {
        config.push(config_value(key, Value::String(value.clone()), true));
    }
    for (key, r) in &spec.secrets_ref {
        match reference(&format!("secretsRef.{key}"), r, namespace)? {
            Reference::Literal(value) => config.push(config_value(key, Value::String(value), true)),
            Reference::Secret { name, key: item } => {
                let dir = format!("/var/run/secrets/stacks.pulumi.com/secrets/{name}");
                let volume = Volume {
                    name: pod::volume_name("secret", &name),
                    secret: Some(SecretVolumeSource {
                        secret_name: Some(name.clone()),
                        ..Default::default()
                    }),
                    ..Default::default()
                };
                mounts.add(volume, &dir);
                config.push(config_file(key, format!("{dir}/{item}"), None, true));
            }
        }
    }
    Ok(config)
}

/// The pulumi container's environment: backend, access token, then `envRefs`.
fn env(stack: &Stack, namespace: &str) -> Result<Vec<EnvVar>, String> {
    let spec = &stack.spec;
    let mut env = Vec::new();
    if let Some(backend) = &spec.backend {
        env.push(env_value("PULUMI_BACKEND_URL", backend.clone()));
    }
    if let Some(secret) = &spec.access_token_secret {
        env.push(env_secret(
            "PULUMI_ACCESS_TOKEN",
            secret.clone(),
            "accessToken".into(),
        ));
    }
    for (name, r) in &spec.env_refs {
        env.push(match reference(&format!("envRefs.{name}"), r, namespace)? {
            Reference::Literal(value) => env_value(name, value),
            Reference::Secret { name: secret, key } => env_secret(name, secret, key),
        });
    }
    Ok(env)
}

/// What the stack itself puts in its Workspace. As in PKO's `setupWorkspace`, the
/// `workspaceTemplate` is merged onto `spec`, and only then are the stack's own `stack` and its
/// `envs`/`envSecrets` (`env_from`) appended: a template's `stacks` and `envFrom` come first
/// and never replace them.
#[derive(Debug)]
pub(super) struct Parts {
    pub spec: WorkspaceSpec,
    pub stack: WorkspaceStack,
    pub env_from: Vec<EnvFromSource>,
}

/// The stack's Workspace parts, or a reason the stack's spec is invalid.
pub(super) fn spec(
    stack: &Stack,
    namespace: &str,
    source: WorkspaceSource,
) -> Result<Parts, String> {
    let spec = &stack.spec;
    let env = env(stack, namespace)?;
    let mut mounts = Mounts::default();
    let config = config(stack, namespace, &mut mounts)?;
    let mounted = !mounts.volumes.is_empty();
    let container = Container {
        name: "pulumi".into(),
        volume_mounts: mounted.then_some(mounts.mounts),
        ..Default::default()
    };
    let env_from = spec
        .envs
        .iter()
        .map(|c| EnvFromSource {
            config_map_ref: Some(ConfigMapEnvSource {
                name: c.clone(),
                optional: None,
            }),
            ..Default::default()
        })
        .chain(spec.env_secrets.iter().map(|s| EnvFromSource {
            secret_ref: Some(SecretEnvSource {
                name: s.clone(),
                optional: None,
            }),
            ..Default::default()
        }))
        .collect();
    let template_stacks = spec
        .workspace_template
        .as_ref()
        .and_then(|t| t.spec.as_ref())
        .map(|t| t.stacks.as_slice())
        .unwrap_or_default();
    if template_stacks
        .iter()
        .any(|s| s.name.as_deref() == Some(spec.stack.as_str()))
    {
        // PKO appends both and the apiserver refuses the Workspace, on every attempt.
        return Err(format!(
            "workspaceTemplate.spec.stacks names the stack's own stack {:?}: the template's stacks are added to it, so list only other stacks there",
            spec.stack
        ));
    }
    let mut ws = WorkspaceSpec {
        service_account_name: spec.service_account_name.clone(),
        env,
        pod_template: Some(EmbeddedPodTemplateSpec {
            metadata: None,
            spec: Some(PodSpec {
                containers: vec![container],
                volumes: mounted.then_some(mounts.volumes),
                ..Default::default()
            }),
        }),
        ..Default::default()
    };
    match source {
        WorkspaceSource::Flux(flux) => ws.flux = Some(flux),
        WorkspaceSource::Git(git) => ws.git = Some(*git),
        WorkspaceSource::ProjectInfo(info) => ws.project_info = Some(info),
        WorkspaceSource::Template => {}
    }
    Ok(Parts {
        spec: ws,
        stack: WorkspaceStack {
            name: spec.stack.clone(),
            create: Some(spec.use_local_stack_only != Some(true)),
            secrets_provider: spec.secrets_provider.clone(),
            config,
            environment: spec.environment.clone(),
        },
        env_from,
    })
}

/// The Workspace to apply, named after the stack and controlled by it: the typed object, its
/// spec merged with the stack's `workspaceTemplate` (labels and annotations from the template's
/// metadata; the stack's own labels always win), then the stack's own stack and `envFrom`
/// appended (see [`Parts`]).
pub(super) fn object(stack: &Stack, namespace: &str, parts: Parts) -> Result<Value, StackError> {
    let Parts {
        spec,
        stack: own,
        env_from,
    } = parts;
    let name = stack.name_any();
    let owner = kit::controller_owner(stack).ok_or(StackError::NoUid("the Stack"))?;
    let mut ws = Workspace::new(&name, spec);
    ws.metadata.namespace = Some(namespace.to_owned());
    ws.metadata.labels = Some(labels(&name));
    ws.metadata.owner_references = Some(vec![owner]);
    let template = stack.spec.workspace_template.as_ref();
    if let Some(meta) = template.and_then(|t| t.metadata.as_ref()) {
        if !meta.labels.is_empty() {
            let mut l = meta.labels.clone();
            l.extend(labels(&name));
            ws.metadata.labels = Some(l);
        }
        if !meta.annotations.is_empty() {
            ws.metadata.annotations = Some(meta.annotations.clone());
        }
    }
    let mut ws = serde_json::to_value(&ws)?;
    if let Some(overlay) = template.and_then(|t| t.spec.as_ref()) {
        merge::merge(&mut ws["spec"], &serde_json::to_value(overlay)?);
    }
    append(&mut ws["spec"], "stacks", [serde_json::to_value(own)?]);
    append(
        &mut ws["spec"],
        "envFrom",
        env_from
            .iter()
            .map(serde_json::to_value)
            .collect::<Result<Vec<_>, _>>()?,
    );
    strip_nulls(&mut ws["spec"]);
    Ok(ws)
}

/// Appends `items` to the list `field` of `spec` (made when missing or `null`).
fn append(spec: &mut Value, field: &str, items: impl IntoIterator<Item = Value>) {
    let mut items = items.into_iter().peekable();
    if items.peek().is_none() {
        return;
    }
    let Some(spec) = spec.as_object_mut() else {
        return;
    };
    let list = spec
        .entry(field)
        .or_insert_with(|| Value::Array(Vec::new()));
    if !list.is_array() {
        *list = Value::Array(Vec::new());
    }
    if let Value::Array(list) = list {
        list.extend(items);
    }
}

/// Drops `null` members: what a template's `null` (a deletion) or an unset config value leaves.
pub(super) fn strip_nulls(v: &mut Value) {
    match v {
        Value::Object(map) => {
            map.retain(|_, v| !v.is_null());
            map.values_mut().for_each(strip_nulls);
        }
        Value::Array(items) => items.iter_mut().for_each(strip_nulls),
        _ => {}
    }
}

/// What this process last applied to a Workspace: the object (as a digest) and the
/// Workspace it got back.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) struct Applied {
    digest: u64,
    uid: Option<String>,
    generation: Option<i64>,
}

impl Applied {
    pub(super) fn new(desired: &Value, result: &Workspace) -> Self {
        Self {
            digest: digest(desired),
            uid: result.metadata.uid.clone(),
            generation: result.metadata.generation,
        }
    }

    /// Whether applying `desired` again would change nothing on `observed` (the watched
    /// Workspace): the same object was applied last, to this Workspace, whose spec nobody
    /// changed since (its generation is the one the apply returned), and it still carries the
    /// labels and owner reference applied. Such an apply is a no-op write, which a stack
    /// waiting for its workspace would otherwise send on every reconcile (each Workspace
    /// status change brings one; ~6 per `up`, measured by pko-bench-stacks' audit trace). The
    /// observed spec cannot be compared with `desired` itself: the apiserver adds the CRD's
    /// defaults to it.
    pub(super) fn covers(&self, desired: &Value, observed: &Workspace) -> bool {
        let meta = &observed.metadata;
        let within = |key: &str, have: Value| match (&desired["metadata"][key], have) {
            (Value::Null, _) => true,
            (Value::Object(want), Value::Object(have)) => {
                want.iter().all(|(k, v)| have.get(k) == Some(v))
            }
            (Value::Array(want), Value::Array(have)) => want.iter().all(|v| have.contains(v)),
            _ => false,
        };
        let json = |v: Result<Value, serde_json::Error>| v.unwrap_or(Value::Null);
        meta.deletion_timestamp.is_none()
            && self.digest == digest(desired)
            && self.uid.is_some()
            && self.uid == meta.uid
            && self.generation.is_some()
            && self.generation == meta.generation
            && within("labels", json(serde_json::to_value(&meta.labels)))
            && within("annotations", json(serde_json::to_value(&meta.annotations)))
            && within(
                "ownerReferences",
                json(serde_json::to_value(&meta.owner_references)),
            )
    }
}

fn digest(value: &Value) -> u64 {
    use std::hash::{DefaultHasher, Hash, Hasher};
    let mut hasher = DefaultHasher::new();
    value.to_string().hash(&mut hasher);
    hasher.finish()
}

/// [`Applied`] per Workspace (namespace, name), in memory: after a restart, the first
/// reconcile of each stack applies.
#[derive(Default)]
pub(super) struct AppliedWorkspaces(std::sync::Mutex<BTreeMap<(String, String), Applied>>);

impl AppliedWorkspaces {
    fn lock(&self) -> std::sync::MutexGuard<'_, BTreeMap<(String, String), Applied>> {
        self.0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    pub(super) fn get(&self, namespace: &str, name: &str) -> Option<Applied> {
        self.lock()
            .get(&(namespace.to_owned(), name.to_owned()))
            .cloned()
    }

    /// A Stack let go: its entry goes, so the map holds only live stacks.
    pub(super) fn forget(&self, namespace: &str, name: &str) {
        self.lock().remove(&(namespace.to_owned(), name.to_owned()));
    }

    pub(super) fn set(&self, namespace: &str, name: &str, applied: Applied) {
        self.lock()
            .insert((namespace.to_owned(), name.to_owned()), applied);
    }
}

#[cfg(test)]
mod tests {
    use pko_api::workspace::FluxSource;
    use serde_json::json;

    use super::*;

    fn watched(generation: i64, uid: &str, spec: Value, labels: Value) -> Workspace {
        serde_json::from_value(json!({
            "apiVersion": "auto.pulumi.com/v1alpha1", "kind": "Workspace",
            "metadata": {"name": "s", "namespace": "ns", "uid": uid, "generation": generation,
                "labels": labels,
                "ownerReferences": [{"apiVersion": "pulumi.com/v1", "kind": "Stack", "name": "s",
                    "uid": "u-s", "controller": true, "blockOwnerDeletion": true}]},
            "spec": spec,
        }))
        .expect("workspace")
    }

    #[test]
    fn a_workspace_applied_and_unchanged_since_is_not_applied_again() {
        let owner = json!([{"apiVersion": "pulumi.com/v1", "kind": "Stack", "name": "s",
            "uid": "u-s", "controller": true, "blockOwnerDeletion": true}]);
        let labels = json!({"pulumi.com/component": "stack", "pulumi.com/stack-name": "s"});
        let desired = json!({"metadata": {"name": "s", "labels": labels, "ownerReferences": owner},
            "spec": {"stacks": [{"name": "dev"}]}});
        // The apiserver's defaults on the spec it returns.
        let defaulted = json!({"serviceAccountName": "default", "securityProfile": "restricted",
            "stacks": [{"name": "dev"}]});
        let result = watched(2, "u-w", defaulted.clone(), labels.clone());
        let last = Applied::new(&desired, &result);
        assert!(last.covers(&desired, &result), "as applied");
        let more_labels =
            json!({"pulumi.com/component": "stack", "pulumi.com/stack-name": "s", "team": "a"});
        assert!(last.covers(&desired, &watched(2, "u-w", defaulted.clone(), more_labels)));
        let mut other = desired.clone();
        other["spec"]["stacks"][0]["name"] = json!("prod");
        assert!(!last.covers(&other, &result), "another object to apply");
        assert!(
            !last.covers(
                &desired,
                &watched(3, "u-w", defaulted.clone(), labels.clone())
            ),
            "the spec changed since (by anyone)"
        );
        assert!(
            !last.covers(&desired, &watched(2, "u-other", defaulted.clone(), labels)),
            "another Workspace of the same name"
        );
        let unlabelled = json!({"pulumi.com/component": "stack"});
        assert!(
            !last.covers(&desired, &watched(2, "u-w", defaulted.clone(), unlabelled)),
            "a label of ours removed"
        );
        let mut deleting = result.clone();
        deleting.metadata.deletion_timestamp =
            Some(k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(
                k8s_openapi::jiff::Timestamp::now(),
            ));
        assert!(!last.covers(&desired, &deleting), "being deleted");
    }

    fn stack() -> Stack {
        let mut s: Stack = serde_json::from_value(json!({
            "apiVersion": "pulumi.com/v1", "kind": "Stack",
            "metadata": {"name": "s", "namespace": "ns", "uid": "u-1"},
            "spec": {"stack": "dev", "programRef": {"name": "p"}},
        }))
        .expect("stack");
        s.metadata.generation = Some(1);
        s
    }

    fn flux() -> WorkspaceSource {
        WorkspaceSource::Flux(FluxSource {
            url: Some("u".into()),
            digest: Some("d".into()),
            dir: None,
        })
    }

    /// The Workspace JSON the stack applies, as its spec.
    fn applied(s: &Stack, source: WorkspaceSource) -> Value {
        let parts = spec(s, "ns", source).expect("spec");
        object(s, "ns", parts).expect("object")["spec"].clone()
    }

    #[test]
    fn workspace_spec_follows_setup_workspace() {
        let mut s = stack();
        s.spec.backend = Some("file:///state".into());
        s.spec.config.insert("greeting".into(), json!("hi"));
        s.spec.secrets.insert("pw".into(), "x".into());
        s.spec.use_local_stack_only = Some(true);
        let ws = applied(&s, flux());
        assert_eq!(ws["flux"], json!({"url": "u", "digest": "d"}));
        assert_eq!(
            ws["env"][0],
            json!({"name": "PULUMI_BACKEND_URL", "value": "file:///state"})
        );
        assert_eq!(ws["stacks"][0]["create"], false);
        assert_eq!(
            ws["stacks"][0]["config"][0],
            json!({"key": "greeting", "value": "hi"})
        );
        assert_eq!(
            ws["stacks"][0]["config"][1],
            json!({"key": "pw", "value": "x", "secret": true})
        );
        assert_eq!(
            ws["podTemplate"],
            json!({"spec": {"containers": [{"name": "pulumi"}]}})
        );
        s.spec.env_refs.insert(
            "X".into(),
            ResourceRef {
                selector_type: ResourceSelectorType::Env,
                filesystem: None,
                env: None,
                secret: None,
                literal: None,
            },
        );
        let err = spec(&s, "ns", flux()).expect_err("Env refs are refused");
        assert!(err.contains("not supported"), "{err}");
    }

    #[test]
    fn referenced_config_is_mounted_once_and_env_is_referenced() {
        let mut s = stack();
        s.spec
            .secrets_ref
            .insert("a".into(), ResourceRef::secret("creds", "a"));
        s.spec
            .secrets_ref
            .insert("b".into(), ResourceRef::secret("creds", "b"));
        s.spec
            .env_refs
            .insert("TOKEN".into(), ResourceRef::secret("creds", "t"));
        s.spec.access_token_secret = Some("pulumi".into());
        s.spec.env_secrets = vec!["more".into()];
        let ws = applied(&s, flux());
        let pod = &ws["podTemplate"]["spec"];
        assert_eq!(pod["volumes"].as_array().map(Vec::len), Some(1));
        assert_eq!(
            pod["containers"][0]["volumeMounts"][0]["mountPath"],
            "/var/run/secrets/stacks.pulumi.com/secrets/creds"
        );
        assert_eq!(pod["volumes"][0]["secret"], json!({"secretName": "creds"}));
        assert_eq!(
            ws["stacks"][0]["config"][1],
            json!({"key": "b", "valueFrom": {"path": "/var/run/secrets/stacks.pulumi.com/secrets/creds/b"}, "secret": true})
        );
        assert_eq!(
            ws["env"],
            json!([
                {"name": "PULUMI_ACCESS_TOKEN", "valueFrom": {"secretKeyRef": {"name": "pulumi", "key": "accessToken"}}},
                {"name": "TOKEN", "valueFrom": {"secretKeyRef": {"name": "creds", "key": "t"}}},
            ])
        );
        assert_eq!(ws["envFrom"], json!([{"secretRef": {"name": "more"}}]));
    }

    #[test]
    fn the_object_is_owned_by_the_stack_and_takes_its_template() {
        let mut s = stack();
        s.spec.workspace_template = Some(
            serde_json::from_value(json!({
                "metadata": {"labels": {"team": "a", STACK_COMPONENT_LABEL: "hijack"}, "annotations": {"x": "y"}},
                "spec": {"image": "img", "podTemplate": {"spec": {"containers": [{"name": "pulumi", "image": "p"}]}}},
            }))
            .expect("template"),
        );
        let parts = spec(&s, "ns", flux()).expect("spec");
        let ws = object(&s, "ns", parts).expect("object");
        assert_eq!(ws["apiVersion"], "auto.pulumi.com/v1alpha1");
        assert_eq!(ws["kind"], "Workspace");
        assert_eq!(
            ws["metadata"]["ownerReferences"],
            json!([{"apiVersion": "pulumi.com/v1", "kind": "Stack", "name": "s", "uid": "u-1", "controller": true, "blockOwnerDeletion": true}])
        );
        assert_eq!(
            ws["metadata"]["labels"],
            json!({"team": "a", STACK_COMPONENT_LABEL: "stack", STACK_NAME_LABEL: "s"})
        );
        assert_eq!(ws["metadata"]["annotations"], json!({"x": "y"}));
        assert_eq!(ws["spec"]["image"], "img");
        assert_eq!(
            ws["spec"]["podTemplate"]["spec"]["containers"],
            json!([{"name": "pulumi", "image": "p"}])
        );
        assert_eq!(ws["spec"]["flux"], json!({"url": "u", "digest": "d"}));
        s.metadata.uid = None;
        let parts = spec(&s, "ns", flux()).expect("spec");
        assert!(matches!(object(&s, "ns", parts), Err(StackError::NoUid(_))));
    }

    // PKO's `setupWorkspace`: the template is merged first, then the stack's own stack and its
    // envs/envSecrets are appended, so a template's `stacks` and `envFrom` add to them.
    #[test]
    fn template_stacks_and_env_from_come_first_and_replace_nothing() {
        let mut s = stack();
        s.spec.envs = vec!["cm-a".into()];
        s.spec.env_secrets = vec!["sec-b".into()];
        s.spec.workspace_template = Some(
            serde_json::from_value(json!({"spec": {
                "envFrom": [{"configMapRef": {"name": "cm-c"}}],
                "env": [{"name": "EXTRA", "value": "1"}],
                "stacks": [{"name": "extra", "create": true}],
            }}))
            .expect("template"),
        );
        s.spec.backend = Some("file:///state".into());
        let ws = applied(&s, flux());
        assert_eq!(
            ws["envFrom"],
            json!([
                {"configMapRef": {"name": "cm-c"}},
                {"configMapRef": {"name": "cm-a"}},
                {"secretRef": {"name": "sec-b"}},
            ])
        );
        let names: Vec<&str> = ws["stacks"]
            .as_array()
            .expect("stacks")
            .iter()
            .filter_map(|s| s["name"].as_str())
            .collect();
        assert_eq!(names, ["extra", "dev"]);
        // env merges by name, the template's first (strategic merge).
        assert_eq!(ws["env"][0]["name"], "EXTRA");
        assert_eq!(ws["env"][1]["name"], "PULUMI_BACKEND_URL");
        // The template naming the stack's own stack is refused, not doubled.
        s.spec.workspace_template = Some(
            serde_json::from_value(json!({"spec": {"stacks": [{"name": "dev", "create": false}]}}))
                .expect("template"),
        );
        let err = spec(&s, "ns", flux()).expect_err("same stack twice");
        assert!(err.contains("workspaceTemplate.spec.stacks"), "{err}");
    }

    #[test]
    fn a_sourceless_stack_takes_the_template_source_and_a_destroy_its_project() {
        let mut s = stack();
        s.spec.program_ref = None;
        s.spec.workspace_template = Some(
            serde_json::from_value(json!({"spec": {"image": "app", "local": {"dir": "/app"}}}))
                .expect("template"),
        );
        let ws = applied(&s, WorkspaceSource::Template);
        assert_eq!(ws["local"], json!({"dir": "/app"}));
        assert!(ws.get("flux").is_none() && ws.get("git").is_none());
        s.spec.workspace_template = None;
        let info = pko_api::common::ProjectInfo {
            name: "p".into(),
            runtime: "yaml".into(),
        };
        let ws = applied(&s, WorkspaceSource::ProjectInfo(info));
        assert_eq!(ws["projectInfo"], json!({"name": "p", "runtime": "yaml"}));
        assert!(ws.get("flux").is_none());
        assert_eq!(ws["stacks"][0]["name"], "dev");
    }
}
