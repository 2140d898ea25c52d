//! The generated schemas are structural (as the apiserver requires for `apiextensions.k8s.io/v1`)
//! and survive the round trip through `JSONSchemaProps` without losing keys.

use serde_json::Value;

use super::support::{CRD_FILES, our_crd, schema, version_names};
use crate::schema::{schema_for, schema_value_for};

const JUNCTORS: [&str; 4] = ["allOf", "anyOf", "oneOf", "not"];

fn is_true(node: &Value, key: &str) -> bool {
    node.get(key) == Some(&Value::Bool(true))
}

fn check(node: &Value, path: &str, out: &mut Vec<String>) {
    let int_or_string = is_true(node, "x-kubernetes-int-or-string");
    let preserve = is_true(node, "x-kubernetes-preserve-unknown-fields");
    let type_ = node.get("type").and_then(Value::as_str);
    if type_.is_none() && !int_or_string && !preserve {
        out.push(format!("{path}: no type"));
    }
    if node.get("$ref").is_some() {
        out.push(format!("{path}: $ref"));
    }
    for junctor in JUNCTORS {
        let Some(sub) = node.get(junctor) else {
            continue;
        };
        // Allowed: int-or-string's `anyOf: [{type: integer}, {type: string}]`, and junctors
        // that only state `required` lists of fields the node declares.
        let int_or_string_pattern = int_or_string
            && junctor == "anyOf"
            && sub == &serde_json::json!([{ "type": "integer" }, { "type": "string" }]);
        let required_only = |s: &Value| {
            s.as_object().is_some_and(|o| {
                o.len() == 1
                    && o.get("required")
                        .and_then(Value::as_array)
                        .is_some_and(|fields| {
                            fields.iter().all(|f| {
                                node["properties"]
                                    .get(f.as_str().unwrap_or_default())
                                    .is_some()
                            })
                        })
            })
        };
        let requirements = match sub {
            Value::Array(items) => junctor != "not" && items.iter().all(required_only),
            single => junctor == "not" && required_only(single),
        };
        let ok = int_or_string_pattern || requirements;
        if !ok {
            out.push(format!("{path}: {junctor} {sub}"));
        }
    }
    if node.get("properties").is_some() && node.get("additionalProperties").is_some() {
        out.push(format!("{path}: properties and additionalProperties"));
    }
    if let Some(ap) = node.get("additionalProperties")
        && !ap.is_object()
    {
        out.push(format!("{path}: additionalProperties {ap}"));
    }
    if type_ == Some("array") && node.get("items").is_none() {
        out.push(format!("{path}: array without items"));
    }
    if let Some(list_type) = node.get("x-kubernetes-list-type").and_then(Value::as_str) {
        let items = &node["items"];
        match list_type {
            "map" => {
                let keys = node["x-kubernetes-list-map-keys"]
                    .as_array()
                    .cloned()
                    .unwrap_or_default();
                if keys.is_empty() {
                    out.push(format!("{path}: list-type map without keys"));
                }
                let required = items["required"].as_array().cloned().unwrap_or_default();
                for key in keys {
                    let key_schema = &items["properties"][key.as_str().unwrap_or_default()];
                    if !key_schema.is_object() {
                        out.push(format!("{path}: map key {key} not a property"));
                    } else if !required.contains(&key) && key_schema.get("default").is_none() {
                        out.push(format!(
                            "{path}: map key {key} neither required nor defaulted"
                        ));
                    }
                }
            }
            "set" => {
                if matches!(items["type"].as_str(), Some("object" | "array")) {
                    out.push(format!("{path}: set of non-scalars"));
                }
            }
            "atomic" => {}
            other => out.push(format!("{path}: unknown list type {other}")),
        }
    }
    if let Some(required) = node.get("required").and_then(Value::as_array) {
        for field in required {
            if node["properties"]
                .get(field.as_str().unwrap_or_default())
                .is_none()
            {
                out.push(format!("{path}: required {field} is not a property"));
            }
        }
    }
    if let Some(props) = node.get("properties").and_then(Value::as_object) {
        for (name, prop) in props {
            check(prop, &format!("{path}.{name}"), out);
        }
    }
    if let Some(items) = node.get("items") {
        check(items, &format!("{path}[]"), out);
    }
    if let Some(ap) = node.get("additionalProperties").filter(|v| v.is_object()) {
        check(ap, &format!("{path}{{}}"), out);
    }
}

#[test]
fn schemas_are_structural() {
    let mut problems = Vec::new();
    for file in CRD_FILES {
        let crd = our_crd(file);
        for version in version_names(&crd) {
            let root = schema(&crd, &version);
            assert_eq!(
                root["properties"]["metadata"],
                serde_json::json!({ "type": "object" })
            );
            let mut out = Vec::new();
            check(root, "", &mut out);
            problems.extend(out.into_iter().map(|p| format!("{file} {version} {p}")));
        }
    }
    assert!(
        problems.is_empty(),
        "not structural:\n{}",
        problems.join("\n")
    );
}

/// Numbers compared by value (`JSONSchemaProps` holds `minimum` as f64).
fn normalize(value: &mut Value) {
    match value {
        Value::Number(n) => {
            if let Some(f) = n.as_f64() {
                *value = Value::from(f);
            }
        }
        Value::Array(items) => items.iter_mut().for_each(normalize),
        Value::Object(map) => map.values_mut().for_each(normalize),
        _ => {}
    }
}

fn assert_lossless<T: schemars::JsonSchema>() {
    let mut generated = schema_value_for::<T>().expect("schema");
    let mut typed =
        serde_json::to_value(schema_for::<T>().expect("JSONSchemaProps")).expect("serialize");
    normalize(&mut generated);
    normalize(&mut typed);
    assert_eq!(
        generated,
        typed,
        "{}: keys lost in JSONSchemaProps",
        T::schema_name()
    );
}

#[test]
fn schemas_survive_jsonschemaprops() {
    assert_lossless::<crate::program::ProgramSpec>();
    assert_lossless::<crate::program::ProgramStatus>();
    assert_lossless::<crate::stack::StackSpec>();
    assert_lossless::<crate::stack::StackStatus>();
    assert_lossless::<crate::stack::v1alpha1::StackStatus>();
    assert_lossless::<crate::workspace::WorkspaceSpec>();
    assert_lossless::<crate::workspace::WorkspaceStatus>();
    assert_lossless::<crate::update::UpdateSpec>();
    assert_lossless::<crate::update::UpdateStatus>();
}
