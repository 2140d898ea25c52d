//! Every PKO object in PKO's example and e2e manifests deserializes into our types and
//! re-serializes without losing anything PKO's CRDs would keep, and our CRDs keep (and accept)
//! everything PKO's keep.

use std::collections::BTreeMap;

use serde::Serialize;
use serde::de::DeserializeOwned;
use serde_json::Value;

use super::support::{fixtures_dir, our_crd, reference_crd, schema, yaml_documents_lenient};
use crate::{program, stack, update, workspace};

/// What the apiserver keeps of `value` under `schema`: unknown fields are pruned unless
/// `x-kubernetes-preserve-unknown-fields` is set. Numbers in a Quantity (int-or-string with a
/// pattern) become strings, as k8s-openapi's `Quantity` always serializes them.
fn prune(value: &Value, schema: &Value) -> Value {
    if schema.get("x-kubernetes-preserve-unknown-fields") == Some(&Value::Bool(true))
        && schema.get("properties").is_none()
        && schema.get("additionalProperties").is_none()
        && schema.get("items").is_none()
    {
        return value.clone();
    }
    if schema.get("x-kubernetes-int-or-string") == Some(&Value::Bool(true)) {
        return match value {
            Value::Number(n) if schema.get("pattern").is_some() => Value::String(n.to_string()),
            other => other.clone(),
        };
    }
    match value {
        Value::Object(map) => {
            let props = schema.get("properties").and_then(Value::as_object);
            let additional = schema.get("additionalProperties").filter(|v| v.is_object());
            let mut out = serde_json::Map::new();
            for (key, item) in map {
                if let Some(prop) = props.and_then(|p| p.get(key)) {
                    out.insert(key.clone(), prune(item, prop));
                } else if let Some(ap) = additional {
                    out.insert(key.clone(), prune(item, ap));
                }
            }
            Value::Object(out)
        }
        Value::Array(items) => match schema.get("items") {
            Some(item_schema) => {
                Value::Array(items.iter().map(|i| prune(i, item_schema)).collect())
            }
            None => value.clone(),
        },
        other => other.clone(),
    }
}

/// Type, required-field, enum and minLength checks (the parts of OpenAPI validation a mistake
/// in our schema would most likely break); CEL rules are checked separately.
fn validate(value: &Value, schema: &Value, path: &str, out: &mut Vec<String>) {
    let int_or_string = schema.get("x-kubernetes-int-or-string") == Some(&Value::Bool(true));
    let type_ok = match (schema.get("type").and_then(Value::as_str), value) {
        _ if int_or_string => value.is_string() || value.is_i64() || value.is_u64(),
        (None, _) => true,
        (Some("object"), Value::Object(_))
        | (Some("array"), Value::Array(_))
        | (Some("string"), Value::String(_))
        | (Some("boolean"), Value::Bool(_)) => true,
        (Some("integer"), Value::Number(n)) => n.is_i64() || n.is_u64(),
        (Some("number"), Value::Number(_)) => true,
        _ => false,
    };
    if !type_ok {
        out.push(format!(
            "{path}: {value} does not match type {}",
            schema["type"]
        ));
        return;
    }
    if let Some(allowed) = schema.get("enum").and_then(Value::as_array)
        && !allowed.contains(value)
    {
        out.push(format!("{path}: {value} not in {allowed:?}"));
    }
    if let (Some(min), Some(s)) = (
        schema.get("minLength").and_then(Value::as_u64),
        value.as_str(),
    ) && (s.chars().count() as u64) < min
    {
        out.push(format!("{path}: shorter than {min}"));
    }
    match value {
        Value::Object(map) => {
            for field in schema
                .get("required")
                .and_then(Value::as_array)
                .into_iter()
                .flatten()
            {
                let field = field.as_str().unwrap_or_default();
                let defaulted = schema["properties"][field].get("default").is_some();
                if !map.contains_key(field) && !defaulted {
                    out.push(format!("{path}: required field {field} missing"));
                }
            }
            for (key, item) in map {
                if let Some(prop) = schema["properties"].get(key) {
                    validate(item, prop, &format!("{path}.{key}"), out);
                } else if let Some(ap) =
                    schema.get("additionalProperties").filter(|v| v.is_object())
                {
                    validate(item, ap, &format!("{path}.{key}"), out);
                }
            }
        }
        Value::Array(items) => {
            if let Some(item_schema) = schema.get("items") {
                for (i, item) in items.iter().enumerate() {
                    validate(item, item_schema, &format!("{path}[{i}]"), out);
                }
            }
        }
        _ => {}
    }
}

/// Evaluates our extra CEL rules by hand (no CEL engine in the unit tests).
fn extra_rules_hold(kind: &str, object: &Value) -> Result<(), String> {
    match kind {
        "Stack" => {
            let spec = &object["spec"];
            let sources = ["projectRepo", "fluxSource", "programRef"]
                .into_iter()
                .filter(|k| spec.get(*k).is_some())
                .count();
            if sources > 1 {
                return Err("more than one source".to_owned());
            }
        }
        "Program" => {
            let program = &object["program"];
            for (name, entry) in program["configuration"].as_object().into_iter().flatten() {
                if entry.get("type").is_none() && entry.get("default").is_none() {
                    return Err(format!("configuration {name} has neither type nor default"));
                }
            }
            for (name, resource) in program["resources"].as_object().into_iter().flatten() {
                if resource.get("get").is_some() && resource.get("properties").is_some() {
                    return Err(format!("resource {name} has get and properties"));
                }
            }
        }
        _ => {}
    }
    Ok(())
}

/// Deserializes `object` as `K`, re-serializes it and returns the result.
fn round_trip<K: DeserializeOwned + Serialize>(object: &Value) -> Result<Value, String> {
    let typed: K = serde_json::from_value(object.clone()).map_err(|e| e.to_string())?;
    serde_json::to_value(&typed).map_err(|e| e.to_string())
}

#[test]
fn pko_examples_round_trip_and_validate() {
    let crds: BTreeMap<&str, (Value, Value)> = [
        ("pulumi.com/Program", "pulumi.com_programs.yaml"),
        ("pulumi.com/Stack", "pulumi.com_stacks.yaml"),
        (
            "auto.pulumi.com/Workspace",
            "auto.pulumi.com_workspaces.yaml",
        ),
        ("auto.pulumi.com/Update", "auto.pulumi.com_updates.yaml"),
    ]
    .into_iter()
    .map(|(k, file)| (k, (reference_crd(file), our_crd(file))))
    .collect();

    let dir = fixtures_dir().join("pko-v2.9-examples");
    let mut files: Vec<_> = std::fs::read_dir(&dir)
        .expect("examples dir")
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|e| e == "yaml"))
        .collect();
    files.sort();

    let mut seen = BTreeMap::<String, usize>::new();
    let mut problems = Vec::new();
    for path in &files {
        let file = path
            .file_name()
            .map(|f| f.to_string_lossy().into_owned())
            .unwrap_or_default();
        let text = std::fs::read_to_string(path).expect("read example");
        for (raw, parsed) in yaml_documents_lenient(&text) {
            let object = match parsed {
                Ok(object) => object,
                Err(e) => {
                    // Only PKO objects matter here; a broken Secret next to them does not.
                    let pko = raw.lines().any(|l| {
                        l.starts_with("apiVersion: pulumi.com/")
                            || l.starts_with("apiVersion: auto.pulumi.com/")
                    });
                    if pko {
                        problems.push(format!("{file}: PKO object does not parse: {e}"));
                    }
                    continue;
                }
            };
            let api_version = object["apiVersion"].as_str().unwrap_or_default();
            let kind = object["kind"].as_str().unwrap_or_default();
            let (group, version) = api_version.split_once('/').unwrap_or(("", api_version));
            let Some((reference, ours)) = crds.get(format!("{group}/{kind}").as_str()) else {
                continue;
            };
            *seen.entry(format!("{api_version}/{kind}")).or_default() += 1;
            let spec_key = if kind == "Program" { "program" } else { "spec" };
            let name = format!("{file} {kind}/{}", object["metadata"]["name"]);

            let result = match (kind, version) {
                ("Program", "v1") => round_trip::<program::Program>(&object),
                ("Stack", "v1") => round_trip::<stack::Stack>(&object),
                ("Stack", "v1alpha1") => round_trip::<stack::v1alpha1::Stack>(&object),
                ("Workspace", "v1alpha1") => round_trip::<workspace::Workspace>(&object),
                ("Update", "v1alpha1") => round_trip::<update::Update>(&object),
                _ => Err(format!("unexpected {api_version} {kind}")),
            };
            let reserialized = match result {
                Ok(v) => v,
                Err(e) => {
                    problems.push(format!("{name}: does not deserialize: {e}"));
                    continue;
                }
            };
            if reserialized["apiVersion"] != object["apiVersion"]
                || reserialized["kind"] != object["kind"]
            {
                problems.push(format!("{name}: apiVersion/kind not preserved"));
            }

            let pko_schema = &schema(reference, version)["properties"][spec_key];
            let our_schema = &schema(ours, version)["properties"][spec_key];
            let kept_by_pko = prune(&object[spec_key], pko_schema);
            let kept_by_us = prune(&object[spec_key], our_schema);
            if kept_by_us != kept_by_pko {
                problems.push(format!(
                    "{name}: our CRD keeps {kept_by_us} but PKO's keeps {kept_by_pko}"
                ));
            }
            let ours_after_trip = prune(&reserialized[spec_key], pko_schema);
            if ours_after_trip != kept_by_pko {
                problems.push(format!(
                    "{name}: {spec_key} changed in the round trip:\n  before {kept_by_pko}\n  after  {ours_after_trip}"
                ));
            }

            let mut invalid = Vec::new();
            validate(&object, schema(ours, version), "", &mut invalid);
            problems.extend(invalid.into_iter().map(|p| format!("{name}: invalid: {p}")));
            if let Err(e) = extra_rules_hold(kind, &object) {
                problems.push(format!("{name}: violates our CEL rules: {e}"));
            }
        }
    }
    assert!(problems.is_empty(), "{}", problems.join("\n"));
    let total: usize = seen.values().sum();
    assert!(
        seen.contains_key("pulumi.com/v1/Program")
            && seen.contains_key("pulumi.com/v1/Stack")
            && seen.contains_key("auto.pulumi.com/v1alpha1/Workspace"),
        "examples not found: {seen:?}"
    );
    assert!(total >= 25, "only {total} PKO objects found: {seen:?}");
}
