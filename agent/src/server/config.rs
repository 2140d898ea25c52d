//! Stack configuration: the items of `SetAllConfig` resolved inside the agent (literal, from
//! an environment variable or a file) and turned into `config set-all` arguments.

use serde_json::{Map, Value, json};
use tonic::Status;

use super::args;
use crate::proto::{self as pb, config_item, config_value_from};
use crate::values;

/// A config item resolved to a value inside the agent.
pub(super) struct Resolved {
    key: String,
    path: bool,
    secret: bool,
    value: Value,
}

/// `env` looks a variable up as a Pulumi command would see it.
pub(super) fn resolve_item(
    item: &pb::ConfigItem,
    env: impl Fn(&str) -> Option<String>,
) -> Result<Resolved, Status> {
    let value = match &item.v {
        Some(config_item::V::Value(v)) => values::from_pb(v),
        Some(config_item::V::ValueFrom(from)) => {
            let raw = match &from.f {
                Some(config_value_from::F::Env(name)) => env(name).ok_or_else(|| {
                    Status::invalid_argument(format!(
                        "config {}: environment variable {name} is not set",
                        item.key
                    ))
                })?,
                Some(config_value_from::F::Path(path)) => {
                    std::fs::read_to_string(path).map_err(|e| {
                        Status::invalid_argument(format!(
                            "config {}: cannot read {path}: {e}",
                            item.key
                        ))
                    })?
                }
                None => {
                    return Err(Status::invalid_argument(format!(
                        "config {}: value_from names neither env nor path",
                        item.key
                    )));
                }
            };
            if from.json == Some(true) {
                serde_json::from_str(&raw).map_err(|e| {
                    Status::invalid_argument(format!("config {}: invalid JSON: {e}", item.key))
                })?
            } else {
                Value::String(raw)
            }
        }
        None => {
            return Err(Status::invalid_argument(format!(
                "config {}: no value",
                item.key
            )));
        }
    };
    Ok(Resolved {
        key: item.key.clone(),
        path: item.path == Some(true),
        secret: item.secret == Some(true),
        value,
    })
}

/// `config set-all` arguments for `items` in project `project`.
///
/// Structured values (objects, arrays, JSON from a file/env) need `--json` (CLI ≥ 3.202), which
/// cannot express property paths; plain values use `--path` with non-path keys quoted so a dot
/// in a key is not read as a path separator.
pub(super) fn set_all_args(project: &str, items: &[Resolved]) -> Result<Vec<String>, Status> {
    let namespaced = |key: &str| {
        if key.contains(':') {
            key.to_owned()
        } else {
            format!("{project}:{key}")
        }
    };
    let structured = items
        .iter()
        .any(|i| matches!(i.value, Value::Object(_) | Value::Array(_)));
    let mut out = args(["config", "set-all"]);
    if structured {
        if let Some(i) = items.iter().find(|i| i.path) {
            return Err(Status::invalid_argument(format!(
                "config {}: path keys cannot be combined with structured values",
                i.key
            )));
        }
        let mut doc = Map::new();
        for i in items {
            let entry = match &i.value {
                Value::Object(_) | Value::Array(_) => json!({
                    "value": i.value.to_string(),
                    "objectValue": i.value,
                    "secret": i.secret,
                }),
                scalar => json!({
                    "value": values::scalar_text(scalar).unwrap_or_default(),
                    "secret": i.secret,
                }),
            };
            doc.insert(namespaced(&i.key), entry);
        }
        out.push(format!("--json={}", Value::Object(doc)));
        return Ok(out);
    }
    out.push("--path".into());
    for i in items {
        let key = if i.path {
            namespaced(&i.key)
        } else {
            let (ns, name) = match i.key.split_once(':') {
                Some((ns, name)) => (ns.to_owned(), name.to_owned()),
                None => (project.to_owned(), i.key.clone()),
            };
            format!("{ns}:[{}]", Value::String(name))
        };
        let text = values::scalar_text(&i.value).unwrap_or_default();
        let flag = if i.secret { "--secret" } else { "--plaintext" };
        out.push(flag.into());
        out.push(format!("{key}={text}"));
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use tonic::Code;

    use super::*;

    fn item(key: &str, path: bool, secret: bool, value: Value) -> Resolved {
        Resolved {
            key: key.into(),
            path,
            secret,
            value,
        }
    }

    #[test]
    fn plain_config_uses_path_mode_with_quoted_keys() {
        let a = set_all_args(
            "proj",
            &[
                item("a.b", false, false, json!("x")),
                item("list[0]", true, false, json!(1)),
                item("aws:region", false, true, json!("eu")),
            ],
        )
        .expect("args");
        assert_eq!(
            a,
            vec![
                "config",
                "set-all",
                "--path",
                "--plaintext",
                "proj:[\"a.b\"]=x",
                "--plaintext",
                "proj:list[0]=1",
                "--secret",
                "aws:[\"region\"]=eu",
            ]
        );
    }

    #[test]
    fn structured_config_uses_json_mode() {
        let a = set_all_args(
            "proj",
            &[
                item("obj", false, false, json!({"k": [1, 2]})),
                item("n", false, true, json!(3)),
            ],
        )
        .expect("args");
        let doc: Value = serde_json::from_str(a[2].trim_start_matches("--json=")).expect("json");
        assert_eq!(doc["proj:obj"]["objectValue"], json!({"k": [1, 2]}));
        assert_eq!(doc["proj:n"], json!({"value": "3", "secret": true}));
        let err = set_all_args(
            "proj",
            &[
                item("obj", false, false, json!([1])),
                item("p.q", true, false, json!("x")),
            ],
        )
        .expect_err("path + structured");
        assert_eq!(err.code(), Code::InvalidArgument);
    }
}
