//! Canonical JSON: the form in which specs and configurations reach plugins and fingerprints.

use serde_json::{Map, Value};

/// A copy of `value` with object keys sorted at every depth (arrays keep their order).
pub fn canonical(value: &Value) -> Value {
    match value {
        Value::Object(map) => {
            let mut keys: Vec<&String> = map.keys().collect();
            keys.sort();
            let mut out = Map::with_capacity(map.len());
            for key in keys {
                if let Some(v) = map.get(key) {
                    out.insert(key.clone(), canonical(v));
                }
            }
            Value::Object(out)
        }
        Value::Array(items) => Value::Array(items.iter().map(canonical).collect()),
        other => other.clone(),
    }
}

/// `value` as compact JSON text with sorted keys: equal values give equal text.
pub fn canonical_string(value: &Value) -> String {
    // Serializing a `Value` cannot fail (its keys are strings).
    serde_json::to_string(&canonical(value)).unwrap_or_default()
}

/// What kind of JSON value this is, for messages.
pub fn kind(value: &Value) -> &'static str {
    match value {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    #[test]
    fn key_order_does_not_matter() {
        let a: Value =
            serde_json::from_str(r#"{"b":1,"a":{"z":[2,1],"y":null}}"#).unwrap_or_default();
        let b = json!({"a": {"y": null, "z": [2, 1]}, "b": 1});
        assert_eq!(canonical_string(&a), canonical_string(&b));
        assert_eq!(canonical_string(&a), r#"{"a":{"y":null,"z":[2,1]},"b":1}"#);
    }
}
