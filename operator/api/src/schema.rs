//! Structural OpenAPI schemas for the CRDs, generated from the Rust types with schemars.
//!
//! kube-derive's pipeline (inline everything, then rewrite to a structural schema) loses the
//! identity of the embedded Kubernetes types, and k8s-openapi's schemas lack the markers that
//! Kubernetes' Go types carry (`+listType`, `+listMapKey`, `+mapType`, `+default`, the Quantity
//! pattern, `metav1.Condition`'s limits). PKO's CRDs have those markers, and they change
//! behaviour: list-map keys make server-side apply merge `containers`/`env`/`volumes` by name
//! and reject duplicates, and defaults such as `ports[].protocol: TCP` are applied on admission.
//!
//! So the schema is generated with definitions (`$ref`s), each definition is inlined here while
//! remembering which Kubernetes type it came from, the same transforms kube-derive uses are run,
//! and finally the markers of [`k8s_overlays`] are merged into every node of a known type.

use std::collections::BTreeMap;

use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::JSONSchemaProps;
use schemars::{JsonSchema, generate::SchemaSettings, transform::Transform};
use serde_json::{Map, Value, json};

use crate::Error;

/// Temporary key recording the schemars definition a node was inlined from.
pub(crate) const TYPE_TAG: &str = "x-pko-rs-type";

/// Types whose (long, generic) description is left out where no field describes them, as
/// controller-gen does: Quantity's is 2 KB and appears 40 times per PodSpec.
const TYPES_WITHOUT_DESCRIPTION: [&str; 1] = ["io.k8s.apimachinery.pkg.api.resource.Quantity"];

/// Keys that hold one subschema.
const SUBSCHEMA_KEYS: [&str; 3] = ["items", "additionalProperties", "not"];
/// Keys that hold a list of subschemas.
const SUBSCHEMA_LIST_KEYS: [&str; 3] = ["allOf", "anyOf", "oneOf"];

/// Generates the structural schema of `T` as JSON.
pub fn schema_value_for<T: JsonSchema>() -> Result<Value, Error> {
    let mut root = tagged_schema_for::<T>()?;
    apply_overlays(&mut root, &k8s_overlays());
    strip_schemars_leftovers(&mut root);
    Ok(root)
}

/// The structural schema of `T` before the Kubernetes markers are applied: every node inlined
/// from a definition still carries its definition name under [`TYPE_TAG`].
pub(crate) fn tagged_schema_for<T: JsonSchema>() -> Result<Value, Error> {
    let type_name = T::schema_name().into_owned();
    let to_schema = |value: Value| -> Result<schemars::Schema, Error> {
        value
            .try_into()
            .map_err(|e: serde_json::Error| Error::Schema {
                type_name: type_name.clone(),
                reason: e.to_string(),
            })
    };
    let settings = SchemaSettings::openapi3().with(|s| {
        s.meta_schema = None;
        s.inline_subschemas = false;
        // The transforms run after inlining, below.
        s.transforms.clear();
    });
    let mut root = settings
        .into_generator()
        .into_root_schema_for::<T>()
        .to_value();

    let definitions = take_definitions(&mut root);
    if let Some(obj) = root.as_object_mut() {
        obj.remove("title");
    }
    inline(&mut root, &definitions, &mut Vec::new(), &type_name)?;

    // kube-derive's transforms, in its order: schemars' OpenAPI 3 set (which includes
    // `AddNullable`), then kube's structural rewrites.
    let mut schema = to_schema(root)?;
    for transform in SchemaSettings::openapi3().transforms.iter_mut() {
        transform.transform(&mut schema);
    }
    let mut root = schema.to_value();
    mark_any_json(&mut root);
    let mut schema = to_schema(root)?;
    kube::core::schema::StructuralSchemaRewriter.transform(&mut schema);
    kube::core::schema::OptionalEnum.transform(&mut schema);
    kube::core::schema::OptionalIntOrString.transform(&mut schema);
    Ok(schema.to_value())
}

/// Generates the structural schema of `T` as `JSONSchemaProps`.
pub fn schema_for<T: JsonSchema>() -> Result<JSONSchemaProps, Error> {
    let value = schema_value_for::<T>()?;
    serde_json::from_value(value).map_err(|source| Error::SchemaJson {
        type_name: T::schema_name().into_owned(),
        source,
    })
}

/// Removes the definitions that schemars put at `/components/schemas`.
fn take_definitions(root: &mut Value) -> Map<String, Value> {
    let Some(obj) = root.as_object_mut() else {
        return Map::new();
    };
    let Some(Value::Object(mut components)) = obj.remove("components") else {
        return Map::new();
    };
    match components.remove("schemas") {
        Some(Value::Object(defs)) => defs,
        _ => Map::new(),
    }
}

/// Replaces every `$ref` with a copy of its definition (tagged with the definition's name), and
/// every `Option<T>` pattern `anyOf: [T, {type: null}]` with `T` plus `nullable: true`.
fn inline(
    node: &mut Value,
    defs: &Map<String, Value>,
    stack: &mut Vec<String>,
    root_name: &str,
) -> Result<(), Error> {
    let Value::Object(obj) = node else {
        return Ok(());
    };

    if let Some(Value::String(reference)) = obj.remove("$ref") {
        let name = reference
            .rsplit('/')
            .next()
            .unwrap_or(reference.as_str())
            .replace("~1", "/")
            .replace("~0", "~");
        if stack.contains(&name) {
            return Err(Error::Schema {
                type_name: root_name.to_owned(),
                reason: format!("recursive type {name} cannot be inlined"),
            });
        }
        let Some(Value::Object(def)) = defs.get(&name) else {
            return Err(Error::Schema {
                type_name: root_name.to_owned(),
                reason: format!("missing definition {name}"),
            });
        };
        let mut merged = def.clone();
        if TYPES_WITHOUT_DESCRIPTION.contains(&name.as_str()) {
            merged.remove("description");
        }
        merged.insert(TYPE_TAG.to_owned(), Value::String(name.clone()));
        // Siblings of `$ref` (a field's description, extensions) win over the definition's.
        merged.extend(std::mem::take(obj));
        *obj = merged;
        stack.push(name);
        let result = inline(node, defs, stack, root_name);
        stack.pop();
        return result;
    }

    if let Some(Value::Array(variants)) = obj.get("anyOf")
        && variants.len() == 2
        && let Some(null_pos) = variants.iter().position(is_null_schema)
    {
        let Some(Value::Array(mut variants)) = obj.remove("anyOf") else {
            return Ok(());
        };
        let inner = variants.swap_remove(1 - null_pos);
        if let Value::Object(mut inner) = inner {
            // Field-level keys (description, extensions) win over the type's.
            inner.extend(std::mem::take(obj));
            *obj = inner;
        }
        obj.insert("nullable".to_owned(), Value::Bool(true));
        return inline(node, defs, stack, root_name);
    }

    for (key, value) in obj.iter_mut() {
        match key.as_str() {
            "properties" => {
                if let Value::Object(props) = value {
                    for prop in props.values_mut() {
                        inline(prop, defs, stack, root_name)?;
                    }
                }
            }
            k if SUBSCHEMA_KEYS.contains(&k) => inline(value, defs, stack, root_name)?,
            k if SUBSCHEMA_LIST_KEYS.contains(&k) => {
                if let Value::Array(items) = value {
                    for item in items {
                        inline(item, defs, stack, root_name)?;
                    }
                }
            }
            _ => {}
        }
    }
    Ok(())
}

fn is_null_schema(v: &Value) -> bool {
    v.get("type").and_then(Value::as_str) == Some("null")
}

/// Marks schemas that accept any JSON (`serde_json::Value`) with
/// `x-kubernetes-preserve-unknown-fields`, as PKO does for its `apiextensionsv1.JSON` fields;
/// a structural schema has no other way to say "anything".
fn mark_any_json(node: &mut Value) {
    let Value::Object(obj) = node else {
        return;
    };
    for (key, value) in obj.iter_mut() {
        match key.as_str() {
            "properties" => {
                if let Value::Object(props) = value {
                    for prop in props.values_mut() {
                        mark_any_json_at(prop);
                    }
                }
            }
            "items" | "additionalProperties" => mark_any_json_at(value),
            _ => {}
        }
    }
}

fn mark_any_json_at(value: &mut Value) {
    if *value == Value::Bool(true) {
        *value = json!({ "x-kubernetes-preserve-unknown-fields": true });
        return;
    }
    if let Value::Object(obj) = value {
        const CONSTRAINING: [&str; 12] = [
            "type",
            "$ref",
            "properties",
            "items",
            "additionalProperties",
            "allOf",
            "anyOf",
            "oneOf",
            "not",
            "enum",
            "x-kubernetes-int-or-string",
            "x-kubernetes-preserve-unknown-fields",
        ];
        if !CONSTRAINING.iter().any(|k| obj.contains_key(*k)) {
            obj.insert(
                "x-kubernetes-preserve-unknown-fields".to_owned(),
                Value::Bool(true),
            );
        }
    }
    mark_any_json(value);
}

/// Merges the overlay of each tagged node's type into it and removes the tags.
fn apply_overlays(node: &mut Value, overlays: &BTreeMap<String, Value>) {
    let Value::Object(obj) = node else {
        return;
    };
    if let Some(Value::String(name)) = obj.remove(TYPE_TAG)
        && let Some(overlay) = overlays.get(&name)
    {
        deep_merge(obj, overlay);
    }
    for (key, value) in obj.iter_mut() {
        match key.as_str() {
            "properties" => {
                if let Value::Object(props) = value {
                    for prop in props.values_mut() {
                        apply_overlays(prop, overlays);
                    }
                }
            }
            k if SUBSCHEMA_KEYS.contains(&k) => apply_overlays(value, overlays),
            k if SUBSCHEMA_LIST_KEYS.contains(&k) => {
                if let Value::Array(items) = value {
                    for item in items {
                        apply_overlays(item, overlays);
                    }
                }
            }
            _ => {}
        }
    }
}

/// Objects merge key by key; anything else (including `required` lists) is replaced; `null`
/// removes the key.
fn deep_merge(target: &mut Map<String, Value>, overlay: &Value) {
    let Value::Object(overlay) = overlay else {
        return;
    };
    for (key, value) in overlay {
        match (target.get_mut(key), value) {
            (_, Value::Null) => {
                target.remove(key);
            }
            (Some(Value::Object(existing)), Value::Object(_)) => deep_merge(existing, value),
            _ => {
                target.insert(key.clone(), value.clone());
            }
        }
    }
}

/// Drops keys schemars may emit that PKO's CRDs do not have.
fn strip_schemars_leftovers(node: &mut Value) {
    let Value::Object(obj) = node else {
        return;
    };
    obj.remove("title");
    obj.remove(TYPE_TAG);
    obj.remove("examples");
    // schemars marks every `Option` field nullable. PKO's CRDs have no nullable fields, so an
    // explicit `null` is pruned and the field's default applied, as there.
    obj.remove("nullable");
    for (key, value) in obj.iter_mut() {
        match key.as_str() {
            "properties" => {
                if let Value::Object(props) = value {
                    for prop in props.values_mut() {
                        strip_schemars_leftovers(prop);
                    }
                }
            }
            k if SUBSCHEMA_KEYS.contains(&k) => strip_schemars_leftovers(value),
            k if SUBSCHEMA_LIST_KEYS.contains(&k) => {
                if let Value::Array(items) = value {
                    for item in items {
                        strip_schemars_leftovers(item);
                    }
                }
            }
            _ => {}
        }
    }
}

/// Kubernetes markers of k8s-openapi types, keyed by schemars definition name; each value is
/// deep-merged into every schema node of that type (`null` removes a key).
///
/// They mirror the `+listType`/`+listMapKey`/`+mapType`/`+default`/`+optional` and validation
/// markers of `k8s.io/api` and `k8s.io/apimachinery` v0.34 that controller-gen emits into PKO's
/// CRDs (the `markers` test compares every node with PKO's).
#[allow(
    clippy::too_many_lines,
    reason = "a table: one line per marker of the Kubernetes types PKO's CRDs embed"
)]
pub fn k8s_overlays() -> BTreeMap<String, Value> {
    let mut o = Overlays::default();
    o.default_value(core("AzureDiskVolumeSource"), "fsType", json!("ext4"));
    o.default_value(core("AzureDiskVolumeSource"), "readOnly", json!(false));
    o.list_atomic(core("Capabilities"), &["add", "drop"]);
    o.list_atomic(core("CephFSVolumeSource"), &["monitors"]);
    o.default_value(core("ConfigMapEnvSource"), "name", json!(""));
    o.map_atomic(core("ConfigMapEnvSource"));
    o.required(core("ConfigMapEnvSource"), &[]);
    o.default_value(core("ConfigMapKeySelector"), "name", json!(""));
    o.map_atomic(core("ConfigMapKeySelector"));
    o.required(core("ConfigMapKeySelector"), &["key"]);
    o.default_value(core("ConfigMapProjection"), "name", json!(""));
    o.map_atomic(core("ConfigMapProjection"));
    o.required(core("ConfigMapProjection"), &[]);
    o.list_atomic(core("ConfigMapProjection"), &["items"]);
    o.default_value(core("ConfigMapVolumeSource"), "name", json!(""));
    o.map_atomic(core("ConfigMapVolumeSource"));
    o.required(core("ConfigMapVolumeSource"), &[]);
    o.list_atomic(core("ConfigMapVolumeSource"), &["items"]);
    o.list_map(core("Container"), "env", &["name"]);
    o.list_map(core("Container"), "ports", &["containerPort", "protocol"]);
    o.list_map(core("Container"), "volumeDevices", &["devicePath"]);
    o.list_map(core("Container"), "volumeMounts", &["mountPath"]);
    o.list_atomic(
        core("Container"),
        &[
            "args",
            "command",
            "envFrom",
            "resizePolicy",
            "restartPolicyRules",
        ],
    );
    o.default_value(core("ContainerPort"), "protocol", json!("TCP"));
    o.list_set(core("ContainerRestartRuleOnExitCodes"), "values");
    o.list_atomic(core("DownwardAPIProjection"), &["items"]);
    o.list_atomic(core("DownwardAPIVolumeSource"), &["items"]);
    o.list_map(core("EphemeralContainer"), "env", &["name"]);
    o.list_map(
        core("EphemeralContainer"),
        "ports",
        &["containerPort", "protocol"],
    );
    o.list_map(core("EphemeralContainer"), "volumeDevices", &["devicePath"]);
    o.list_map(core("EphemeralContainer"), "volumeMounts", &["mountPath"]);
    o.list_atomic(
        core("EphemeralContainer"),
        &[
            "args",
            "command",
            "envFrom",
            "resizePolicy",
            "restartPolicyRules",
        ],
    );
    o.list_atomic(core("ExecAction"), &["command"]);
    o.list_atomic(core("FCVolumeSource"), &["targetWWNs", "wwids"]);
    o.default_value(core("FileKeySelector"), "optional", json!(false));
    o.map_atomic(core("FileKeySelector"));
    o.default_value(core("GRPCAction"), "service", json!(""));
    o.list_atomic(core("HTTPGetAction"), &["httpHeaders"]);
    o.list_atomic(core("HostAlias"), &["hostnames"]);
    o.default_value(
        core("ISCSIVolumeSource"),
        "iscsiInterface",
        json!("default"),
    );
    o.list_atomic(core("ISCSIVolumeSource"), &["portals"]);
    o.default_value(core("LocalObjectReference"), "name", json!(""));
    o.map_atomic(core("LocalObjectReference"));
    o.required(core("LocalObjectReference"), &[]);
    o.list_atomic(
        core("NodeAffinity"),
        &["preferredDuringSchedulingIgnoredDuringExecution"],
    );
    o.map_atomic(core("NodeSelector"));
    o.list_atomic(core("NodeSelector"), &["nodeSelectorTerms"]);
    o.list_atomic(core("NodeSelectorRequirement"), &["values"]);
    o.map_atomic(core("NodeSelectorTerm"));
    o.list_atomic(
        core("NodeSelectorTerm"),
        &["matchExpressions", "matchFields"],
    );
    o.map_atomic(core("ObjectFieldSelector"));
    o.list_atomic(core("PersistentVolumeClaimSpec"), &["accessModes"]);
    o.list_atomic(
        core("PodAffinity"),
        &[
            "preferredDuringSchedulingIgnoredDuringExecution",
            "requiredDuringSchedulingIgnoredDuringExecution",
        ],
    );
    o.list_atomic(
        core("PodAffinityTerm"),
        &["matchLabelKeys", "mismatchLabelKeys", "namespaces"],
    );
    o.list_atomic(
        core("PodAntiAffinity"),
        &[
            "preferredDuringSchedulingIgnoredDuringExecution",
            "requiredDuringSchedulingIgnoredDuringExecution",
        ],
    );
    o.list_atomic(
        core("PodDNSConfig"),
        &["nameservers", "options", "searches"],
    );
    o.list_atomic(
        core("PodSecurityContext"),
        &["supplementalGroups", "sysctls"],
    );
    o.list_map(core("PodSpec"), "containers", &["name"]);
    o.list_map(core("PodSpec"), "ephemeralContainers", &["name"]);
    o.list_map(core("PodSpec"), "hostAliases", &["ip"]);
    o.list_map(core("PodSpec"), "imagePullSecrets", &["name"]);
    o.list_map(core("PodSpec"), "initContainers", &["name"]);
    o.field(
        core("PodSpec"),
        "nodeSelector",
        json!({"x-kubernetes-map-type": "atomic"}),
    );
    o.list_map(core("PodSpec"), "resourceClaims", &["name"]);
    o.list_map(core("PodSpec"), "schedulingGates", &["name"]);
    o.list_map(
        core("PodSpec"),
        "topologySpreadConstraints",
        &["topologyKey", "whenUnsatisfiable"],
    );
    o.list_map(core("PodSpec"), "volumes", &["name"]);
    o.list_atomic(core("PodSpec"), &["readinessGates", "tolerations"]);
    o.list_atomic(core("ProjectedVolumeSource"), &["sources"]);
    o.default_value(
        core("RBDVolumeSource"),
        "keyring",
        json!("/etc/ceph/keyring"),
    );
    o.default_value(core("RBDVolumeSource"), "pool", json!("rbd"));
    o.default_value(core("RBDVolumeSource"), "user", json!("admin"));
    o.list_atomic(core("RBDVolumeSource"), &["monitors"]);
    o.map_atomic(core("ResourceFieldSelector"));
    o.list_map(core("ResourceRequirements"), "claims", &["name"]);
    o.default_value(core("ScaleIOVolumeSource"), "fsType", json!("xfs"));
    o.default_value(
        core("ScaleIOVolumeSource"),
        "storageMode",
        json!("ThinProvisioned"),
    );
    o.default_value(core("SecretEnvSource"), "name", json!(""));
    o.map_atomic(core("SecretEnvSource"));
    o.required(core("SecretEnvSource"), &[]);
    o.default_value(core("SecretKeySelector"), "name", json!(""));
    o.map_atomic(core("SecretKeySelector"));
    o.required(core("SecretKeySelector"), &["key"]);
    o.default_value(core("SecretProjection"), "name", json!(""));
    o.map_atomic(core("SecretProjection"));
    o.required(core("SecretProjection"), &[]);
    o.list_atomic(core("SecretProjection"), &["items"]);
    o.list_atomic(core("SecretVolumeSource"), &["items"]);
    o.list_atomic(core("TopologySpreadConstraint"), &["matchLabelKeys"]);
    o.map_atomic(core("TypedLocalObjectReference"));
    o.merge("io.k8s.apimachinery.pkg.api.resource.Quantity", json!({"pattern": "^(\\+|-)?(([0-9]+(\\.[0-9]*)?)|(\\.[0-9]+))(([KMGTPE]i)|[numkMGTPE]|([eE](\\+|-)?(([0-9]+(\\.[0-9]*)?)|(\\.[0-9]+))))?$", "anyOf": [{"type": "integer"}, {"type": "string"}]}));
    o.field(meta("Condition"), "message", json!({"maxLength": 32768}));
    o.field(
        meta("Condition"),
        "observedGeneration",
        json!({"minimum": 0}),
    );
    o.field(meta("Condition"), "reason", json!({"pattern": "^[A-Za-z]([A-Za-z0-9_,:]*[A-Za-z0-9_])?$", "minLength": 1, "maxLength": 1024}));
    o.field(
        meta("Condition"),
        "status",
        json!({"enum": ["True", "False", "Unknown"]}),
    );
    o.field(meta("Condition"), "type", json!({"pattern": "^([a-z0-9]([-a-z0-9]*[a-z0-9])?(\\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])$", "maxLength": 316}));
    o.map_atomic(meta("LabelSelector"));
    o.list_atomic(meta("LabelSelector"), &["matchExpressions"]);
    o.list_atomic(meta("LabelSelectorRequirement"), &["values"]);
    o.merge(
        "io.k8s.apimachinery.pkg.util.intstr.IntOrString",
        json!({"anyOf": [{"type": "integer"}, {"type": "string"}]}),
    );
    // controller-gen keeps only these fields of an embedded ObjectMeta (the PVC template of an
    // ephemeral volume); the apiserver would ignore the others there anyway.
    o.merge(
        meta("ObjectMeta"),
        json!({ "properties": {
            "creationTimestamp": null,
            "deletionGracePeriodSeconds": null,
            "deletionTimestamp": null,
            "generateName": null,
            "generation": null,
            "managedFields": null,
            "ownerReferences": null,
            "resourceVersion": null,
            "selfLink": null,
            "uid": null,
        }}),
    );
    o.0
}

fn core(name: &str) -> String {
    format!("io.k8s.api.core.v1.{name}")
}

fn meta(name: &str) -> String {
    format!("io.k8s.apimachinery.pkg.apis.meta.v1.{name}")
}

/// Builder of [`k8s_overlays`].
#[derive(Default)]
struct Overlays(BTreeMap<String, Value>);

impl Overlays {
    /// Merges `patch` into the overlay of `ty`, keeping `null`s (they remove keys later).
    fn merge(&mut self, ty: impl Into<String>, patch: Value) {
        fn merge_keeping_nulls(target: &mut Value, patch: Value) {
            match (target, patch) {
                (Value::Object(target), Value::Object(patch)) => {
                    for (key, value) in patch {
                        match target.get_mut(&key) {
                            Some(existing) if existing.is_object() && value.is_object() => {
                                merge_keeping_nulls(existing, value);
                            }
                            _ => {
                                target.insert(key, value);
                            }
                        }
                    }
                }
                (target, patch) => *target = patch,
            }
        }
        let entry = self.0.entry(ty.into()).or_insert_with(|| json!({}));
        merge_keeping_nulls(entry, patch);
    }

    fn field(&mut self, ty: impl Into<String>, field: &str, patch: Value) {
        self.merge(ty, json!({ "properties": { field: patch } }));
    }

    fn list_atomic(&mut self, ty: impl Into<String>, fields: &[&str]) {
        let ty = ty.into();
        for field in fields {
            self.field(
                ty.clone(),
                field,
                json!({ "x-kubernetes-list-type": "atomic" }),
            );
        }
    }

    fn list_set(&mut self, ty: impl Into<String>, field: &str) {
        self.field(ty, field, json!({ "x-kubernetes-list-type": "set" }));
    }

    fn list_map(&mut self, ty: impl Into<String>, field: &str, keys: &[&str]) {
        self.field(
            ty,
            field,
            json!({ "x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": keys }),
        );
    }

    fn default_value(&mut self, ty: impl Into<String>, field: &str, value: Value) {
        self.field(ty, field, json!({ "default": value }));
    }

    fn map_atomic(&mut self, ty: impl Into<String>) {
        self.merge(ty, json!({ "x-kubernetes-map-type": "atomic" }));
    }

    /// Replaces the `required` list; an empty list removes it.
    fn required(&mut self, ty: impl Into<String>, fields: &[&str]) {
        let required = if fields.is_empty() {
            Value::Null
        } else {
            json!(fields)
        };
        self.merge(ty, json!({ "required": required }));
    }
}

/// Schema of a map whose values may be any JSON, written like PKO's schemaless fields
/// (`x-kubernetes-preserve-unknown-fields` on the map itself).
pub fn any_object(_: &mut schemars::SchemaGenerator) -> schemars::Schema {
    schemars::json_schema!({
        "type": "object",
        "x-kubernetes-preserve-unknown-fields": true,
    })
}
