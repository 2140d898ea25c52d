//! Decoders that a tenant's nesting cannot turn into a failed list or watch.
//!
//! serde_json refuses a document nested deeper than 128 levels, and kube decodes a whole list
//! (or watch line) at once: one object past the limit fails the list, so a controller never
//! starts. Two places let a tenant nest without bound:
//!
//! * `metadata.managedFields`: the apiserver mirrors every field of the object there, one level
//!   deeper than the field itself. [`object_meta`] keeps who wrote what (manager, operation,
//!   subresource) and skips the field sets (serde_json skips an ignored value iteratively, with
//!   no depth limit); the one reader of field sets fetches them on its own.
//! * free-form values (Stack outputs): [`tolerant_values`] captures each value as raw text and
//!   decodes it on its own, with a fresh depth budget; a value still too deep is kept as its JSON
//!   text (a string), so the object decodes and the value is not lost.

use std::collections::BTreeMap;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::{
    ManagedFieldsEntry, ObjectMeta, OwnerReference, Time,
};
use serde::{Deserialize, Deserializer};
use serde_json::Value;
use serde_json::value::RawValue;

/// The deepest nesting a tenant's document (a Program's `program:`, a Stack's config value, an
/// output) may have. Far below serde_json's 128, so the object that carries it (a list item
/// inside a watch event inside `managedFields`) stays decodable.
pub const MAX_DOCUMENT_DEPTH: usize = 64;

/// `ObjectMeta` as the apiserver sends it, `managedFields` without their field sets (see the
/// module docs).
#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct WireMeta {
    #[serde(default)]
    annotations: Option<BTreeMap<String, String>>,
    #[serde(default)]
    creation_timestamp: Option<Time>,
    #[serde(default)]
    deletion_grace_period_seconds: Option<i64>,
    #[serde(default)]
    deletion_timestamp: Option<Time>,
    #[serde(default)]
    finalizers: Option<Vec<String>>,
    #[serde(default)]
    generate_name: Option<String>,
    #[serde(default)]
    generation: Option<i64>,
    #[serde(default)]
    labels: Option<BTreeMap<String, String>>,
    #[serde(default)]
    managed_fields: Option<Vec<WireManager>>,
    #[serde(default)]
    name: Option<String>,
    #[serde(default)]
    namespace: Option<String>,
    #[serde(default)]
    owner_references: Option<Vec<OwnerReference>>,
    #[serde(default)]
    resource_version: Option<String>,
    #[serde(default)]
    self_link: Option<String>,
    #[serde(default)]
    uid: Option<String>,
}

/// A `managedFields` entry without `fieldsV1`.
#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct WireManager {
    #[serde(default)]
    api_version: Option<String>,
    #[serde(default)]
    manager: Option<String>,
    #[serde(default)]
    operation: Option<String>,
    #[serde(default)]
    subresource: Option<String>,
    #[serde(default)]
    time: Option<Time>,
}

/// Decodes `metadata` with `managedFields` stripped of their field sets (the apiserver mirrors
/// a tenant's nesting there). Use with `#[serde(deserialize_with = ...)]`.
pub fn object_meta<'de, D: Deserializer<'de>>(de: D) -> Result<ObjectMeta, D::Error> {
    let m = WireMeta::deserialize(de)?;
    Ok(ObjectMeta {
        annotations: m.annotations,
        creation_timestamp: m.creation_timestamp,
        deletion_grace_period_seconds: m.deletion_grace_period_seconds,
        deletion_timestamp: m.deletion_timestamp,
        finalizers: m.finalizers,
        generate_name: m.generate_name,
        generation: m.generation,
        labels: m.labels,
        managed_fields: m.managed_fields.map(|entries| {
            entries
                .into_iter()
                .map(|e| ManagedFieldsEntry {
                    api_version: e.api_version,
                    fields_type: None,
                    fields_v1: None,
                    manager: e.manager,
                    operation: e.operation,
                    subresource: e.subresource,
                    time: e.time,
                })
                .collect()
        }),
        name: m.name,
        namespace: m.namespace,
        owner_references: m.owner_references,
        resource_version: m.resource_version,
        self_link: m.self_link,
        uid: m.uid,
    })
}

/// PKO's field manager, and the prefix of its status writers' (`…/stack-status`).
pub const PKO_MANAGER: &str = "pulumi-kubernetes-operator";

/// Whether `manager` is one of PKO's (`pulumi-kubernetes-operator` or `…/<writer>`): after a
/// switch-over their entries are the only ones a controller reads (to take them over).
pub fn is_pko_manager(manager: &str) -> bool {
    manager == PKO_MANAGER
        || manager
            .strip_prefix(PKO_MANAGER)
            .is_some_and(|rest| rest.starts_with('/'))
}

/// Decodes a map of free-form values one value at a time (see the module docs): a value too
/// deep for serde_json is kept as its JSON text.
pub fn tolerant_values<'de, D: Deserializer<'de>>(
    de: D,
) -> Result<BTreeMap<String, Value>, D::Error> {
    let raw = BTreeMap::<String, Box<RawValue>>::deserialize(de)?;
    Ok(raw
        .into_iter()
        .map(|(k, v)| {
            let value = bounded_value(v.get()).unwrap_or_else(|| Value::String(v.get().to_owned()));
            (k, value)
        })
        .collect())
}

/// `text` decoded, if it is nested no deeper than [`MAX_DOCUMENT_DEPTH`].
pub fn bounded_value(text: &str) -> Option<Value> {
    (json_depth(text) <= MAX_DOCUMENT_DEPTH)
        .then(|| serde_json::from_str(text).ok())
        .flatten()
}

/// How deeply `text` (JSON) nests arrays and objects, counted without recursion (a scalar is 0,
/// `{}` and `[]` are 1). Brackets inside strings do not count.
pub fn json_depth(text: impl AsRef<[u8]>) -> usize {
    let (mut depth, mut deepest, mut in_string, mut escaped) = (0usize, 0usize, false, false);
    for &b in text.as_ref() {
        if in_string {
            match b {
                _ if escaped => escaped = false,
                b'\\' => escaped = true,
                b'"' => in_string = false,
                _ => {}
            }
            continue;
        }
        match b {
            b'"' => in_string = true,
            b'{' | b'[' => {
                depth += 1;
                deepest = deepest.max(depth);
            }
            b'}' | b']' => depth = depth.saturating_sub(1),
            _ => {}
        }
    }
    deepest
}

/// How deeply a decoded value nests (same count as [`json_depth`]), without recursion.
pub fn value_depth(value: &Value) -> usize {
    let mut stack = vec![(value, 0usize)];
    let mut deepest = 0;
    while let Some((v, d)) = stack.pop() {
        let children: Box<dyn Iterator<Item = &Value>> = match v {
            Value::Array(a) => Box::new(a.iter()),
            Value::Object(o) => Box::new(o.values()),
            _ => continue,
        };
        deepest = deepest.max(d + 1);
        stack.extend(children.map(|c| (c, d + 1)));
    }
    deepest
}

#[cfg(test)]
mod tests {
    use super::*;

    fn nested(depth: usize) -> String {
        format!("{}1{}", "{\"a\":".repeat(depth), "}".repeat(depth))
    }

    #[test]
    fn depth_counts_brackets_outside_strings() {
        assert_eq!(json_depth("1"), 0);
        assert_eq!(json_depth("{}"), 1);
        assert_eq!(json_depth(r#"{"a":[1,{"b":"}}{{[\"["}]}"#), 3);
        assert_eq!(json_depth(nested(10_000)), 10_000);
        let v: Value = serde_json::from_str(&nested(100)).unwrap();
        assert_eq!(value_depth(&v), 100);
        assert_eq!(value_depth(&Value::Null), 0);
    }

    #[derive(Deserialize)]
    struct Obj {
        #[serde(deserialize_with = "object_meta")]
        metadata: ObjectMeta,
        #[serde(default, deserialize_with = "tolerant_values")]
        outputs: BTreeMap<String, Value>,
    }

    #[test]
    fn managed_fields_and_deep_values_do_not_fail_the_object() {
        // As the apiserver sends a Program 120 deep: managedFields mirror it one level deeper,
        // inside a list item of a list (past serde_json's 128).
        let deep = nested(200);
        let list = format!(
            r#"{{"items":[{{"metadata":{{"name":"p","namespace":"ns","generation":3,
            "managedFields":[{{"manager":"kubectl","fieldsV1":{deep}}}]}},
            "outputs":{{"ok":{{"x":[1]}},"deep":{deep}}}}}]}}"#
        );
        #[derive(Deserialize)]
        struct List {
            items: Vec<Obj>,
        }
        let list: List = serde_json::from_str(&list).unwrap();
        let obj = &list.items[0];
        assert_eq!(obj.metadata.name.as_deref(), Some("p"));
        assert_eq!(obj.metadata.generation, Some(3));
        let managers = obj
            .metadata
            .managed_fields
            .as_ref()
            .expect("who wrote what");
        assert_eq!(managers[0].manager.as_deref(), Some("kubectl"));
        assert_eq!(managers[0].fields_v1, None, "the field sets are skipped");
        assert_eq!(obj.outputs["ok"], serde_json::json!({"x": [1]}));
        assert_eq!(obj.outputs["deep"], Value::String(deep));
    }
}
