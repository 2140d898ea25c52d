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

/// The Workspace spec of a stack, before its template, or a reason the stack's spec is invalid.
pub(super) fn spec(
    stack: &Stack,
    namespace: &str,
    source: WorkspaceSource,
) -> Result<WorkspaceSpec, String> {
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
    let (flux, git) = match source {
        WorkspaceSource::Flux(flux) => (Some(flux), None),
        WorkspaceSource::Git(git) => (None, Some(*git)),
    };
    Ok(WorkspaceSpec {
        service_account_name: spec.service_account_name.clone(),
        flux,
        git,
        env,
        env_from,
        pod_template: Some(EmbeddedPodTemplateSpec {
            metadata: None,
            spec: Some(PodSpec {
                containers: vec![container],
                volumes: mounted.then_some(mounts.volumes),
                ..Default::default()
            }),
        }),
        stacks: vec![WorkspaceStack {
            name: spec.stack.clone(),
            create: Some(spec.use_local_stack_only != Some(true)),
            secrets_provider: spec.secrets_provider.clone(),
            config,
            environment: spec.environment.clone(),
        }],
        ..Default::default()
    })
}

/// The Workspace to apply, named after the stack and controlled by it: the typed object, its
/// spec merged with the stack's `workspaceTemplate` (labels and annotations from the template's
/// metadata; the stack's own labels always win).
pub(super) fn object(
    stack: &Stack,
    namespace: &str,
    spec: WorkspaceSpec,
) -> Result<Value, StackError> {
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
    strip_nulls(&mut ws["spec"]);
    Ok(ws)
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

#[cfg(test)]
mod tests {
    use pko_api::workspace::FluxSource;
    use serde_json::json;

    use super::*;

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

    #[test]
    fn workspace_spec_follows_setup_workspace() {
        let mut s = stack();
        s.spec.backend = Some("file:///state".into());
        s.spec.config.insert("greeting".into(), json!("hi"));
        s.spec.secrets.insert("pw".into(), "x".into());
        s.spec.use_local_stack_only = Some(true);
        let ws = serde_json::to_value(spec(&s, "ns", flux()).expect("spec")).expect("json");
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
        let ws = serde_json::to_value(spec(&s, "ns", flux()).expect("spec")).expect("json");
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
        let base = spec(&s, "ns", flux()).expect("spec");
        let ws = object(&s, "ns", base).expect("object");
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
        assert!(matches!(
            object(&s, "ns", WorkspaceSpec::default()),
            Err(StackError::NoUid(_))
        ));
    }
}
