//! Conversions between JSON and protobuf's `Struct`/`Value`, and config-item resolution.

use prost_types::value::Kind;
use prost_types::{ListValue, Struct, Value as PbValue};
use serde_json::{Map, Number, Value};

/// A JSON value as a protobuf `Value`.
pub fn to_pb(value: &Value) -> PbValue {
    let kind = match value {
        Value::Null => Kind::NullValue(0),
        Value::Bool(b) => Kind::BoolValue(*b),
        Value::Number(n) => Kind::NumberValue(n.as_f64().unwrap_or(0.0)),
        Value::String(s) => Kind::StringValue(s.clone()),
        Value::Array(items) => Kind::ListValue(ListValue {
            values: items.iter().map(to_pb).collect(),
        }),
        Value::Object(map) => Kind::StructValue(to_struct(map)),
    };
    PbValue { kind: Some(kind) }
}

/// A JSON object as a protobuf `Struct`.
pub fn to_struct(map: &Map<String, Value>) -> Struct {
    Struct {
        fields: map.iter().map(|(k, v)| (k.clone(), to_pb(v))).collect(),
    }
}

/// A protobuf `Value` as JSON. Whole numbers come back as integers (protobuf has only doubles).
pub fn from_pb(value: &PbValue) -> Value {
    match &value.kind {
        None | Some(Kind::NullValue(_)) => Value::Null,
        Some(Kind::BoolValue(b)) => Value::Bool(*b),
        Some(Kind::NumberValue(n)) => number(*n),
        Some(Kind::StringValue(s)) => Value::String(s.clone()),
        Some(Kind::ListValue(list)) => Value::Array(list.values.iter().map(from_pb).collect()),
        Some(Kind::StructValue(s)) => Value::Object(from_struct(s)),
    }
}

/// A protobuf `Struct` as a JSON object.
pub fn from_struct(s: &Struct) -> Map<String, Value> {
    s.fields
        .iter()
        .map(|(k, v)| (k.clone(), from_pb(v)))
        .collect()
}

fn number(n: f64) -> Value {
    // 2^53: every integer below it is exact in an f64.
    if n.fract() == 0.0 && n.abs() < 9_007_199_254_740_992.0 {
        Value::Number(Number::from(n as i64))
    } else {
        Number::from_f64(n).map_or(Value::Null, Value::Number)
    }
}

/// The text Pulumi stores for a scalar config value (config values are strings on the CLI).
pub fn scalar_text(value: &Value) -> Option<String> {
    match value {
        Value::String(s) => Some(s.clone()),
        Value::Bool(b) => Some(b.to_string()),
        Value::Number(n) => Some(n.to_string()),
        Value::Null => Some(String::new()),
        Value::Array(_) | Value::Object(_) => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn json_round_trips_through_protobuf() {
        let v = json!({"a": 1, "b": [true, null, "x", 1.5], "c": {"d": -3}});
        let Value::Object(map) = &v else {
            panic!("object")
        };
        assert_eq!(Value::Object(from_struct(&to_struct(map))), v);
    }

    #[test]
    fn scalars_become_config_text() {
        assert_eq!(scalar_text(&json!(42)).as_deref(), Some("42"));
        assert_eq!(scalar_text(&json!(true)).as_deref(), Some("true"));
        assert_eq!(scalar_text(&json!("s")).as_deref(), Some("s"));
        assert_eq!(scalar_text(&json!([1])), None);
    }
}
