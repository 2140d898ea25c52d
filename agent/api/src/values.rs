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

/// Bytes a decoded node is charged: a protobuf `Value` and the `serde_json::Value` made from it
/// are 32 bytes each, and both are alive while an event is converted.
pub const NODE_BYTES: u64 = 64;

/// What the tree of `s` costs in memory once decoded and converted to JSON: [`NODE_BYTES`] per
/// value plus the bytes of its strings and keys; `None` as soon as that passes `limit`.
///
/// The wire size says little: an empty list is 4 bytes on the wire and 64 in memory, so 16 MiB
/// of them would come to 256 MiB and more. The walk allocates only its own stack (one entry per
/// list or struct still to visit, so it is bounded by the nodes it has already charged).
pub fn decoded_size(s: &Struct, limit: u64) -> Option<u64> {
    let mut total: u64 = 0;
    let charge = |n: u64, total: &mut u64| {
        *total = total.saturating_add(n);
        *total <= limit
    };
    let mut structs: Vec<&Struct> = vec![s];
    let mut lists: Vec<&ListValue> = Vec::new();
    loop {
        let values: Box<dyn Iterator<Item = &PbValue>> = if let Some(s) = structs.pop() {
            for k in s.fields.keys() {
                if !charge(k.len() as u64, &mut total) {
                    return None;
                }
            }
            Box::new(s.fields.values())
        } else if let Some(l) = lists.pop() {
            Box::new(l.values.iter())
        } else {
            return Some(total);
        };
        for v in values {
            let own = match &v.kind {
                Some(Kind::StringValue(s)) => s.len() as u64,
                Some(Kind::StructValue(s)) => {
                    structs.push(s);
                    0
                }
                Some(Kind::ListValue(l)) => {
                    lists.push(l);
                    0
                }
                _ => 0,
            };
            if !charge(NODE_BYTES.saturating_add(own), &mut total) {
                return None;
            }
        }
    }
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
    fn the_decoded_size_counts_nodes_not_wire_bytes() {
        let v = json!({"ab": ["xyz", [], {"c": null}]});
        let Value::Object(map) = &v else {
            panic!("object")
        };
        let s = to_struct(map);
        // Keys "ab" and "c" (3 bytes), string "xyz" (3), five values.
        let want = 3 + 3 + 5 * NODE_BYTES;
        assert_eq!(decoded_size(&s, want), Some(want));
        assert_eq!(decoded_size(&s, want - 1), None);

        // A million empty lists: 4 MiB on the wire, over 64 MiB decoded; refused as
        // soon as the limit is passed.
        let many = Struct {
            fields: [(
                "l".to_owned(),
                PbValue {
                    kind: Some(Kind::ListValue(ListValue {
                        values: vec![
                            PbValue {
                                kind: Some(Kind::ListValue(ListValue::default())),
                            };
                            1 << 20
                        ],
                    })),
                },
            )]
            .into_iter()
            .collect(),
        };
        assert!(prost::Message::encoded_len(&many) < (4 << 20) + 64);
        assert_eq!(decoded_size(&many, 64 << 20), None);
        assert!(decoded_size(&many, 128 << 20).is_some());
    }

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
