//! Stack configuration: the items of `SetAllConfig` resolved inside the agent (literal, from
//! an environment variable or a file) and turned into `config set-all` arguments.

use serde_json::{Map, Value, json};
use tonic::Status;

use super::args;
use crate::proto::{self as pb, config_item, config_value_from};
use crate::values;

/// A config item resolved to a value inside the agent.
#[derive(Clone)]
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

/// The `pulumi config set-all` invocations for `items` in project `project`, run in order.
///
/// Plain values use `--path`, with non-path keys quoted so a dot in a key is not read as a path
/// separator. Structured values (objects, arrays, JSON from a file/env) need `--json` (CLI ≥
/// 3.202), which cannot express property paths, so path items then go in a second `--path`
/// call after it (PKO drops their `path` there, setting a literal key instead).
pub(super) fn set_all_commands(project: &str, items: &[Resolved]) -> Vec<Vec<String>> {
    let structured = items
        .iter()
        .any(|i| matches!(i.value, Value::Object(_) | Value::Array(_)));
    if !structured {
        return vec![path_command(project, items)];
    }
    let (paths, literal): (Vec<_>, Vec<_>) = items.iter().cloned().partition(|i| i.path);
    let mut doc = Map::new();
    for i in &literal {
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
        doc.insert(namespaced(project, &i.key), entry);
    }
    let mut json_command = args(["config", "set-all"]);
    json_command.push(format!("--json={}", Value::Object(doc)));
    let mut commands = vec![json_command];
    if !paths.is_empty() {
        commands.push(path_command(project, &paths));
    }
    commands
}

/// A key in the project's namespace unless it names its own (`aws:region`).
fn namespaced(project: &str, key: &str) -> String {
    if key.contains(':') {
        key.to_owned()
    } else {
        format!("{project}:{key}")
    }
}

/// One `set-all --path` call: path items as property paths, the others quoted as literal keys.
fn path_command(project: &str, items: &[Resolved]) -> Vec<String> {
    let mut out = args(["config", "set-all", "--path"]);
    for i in items {
        let key = if i.path {
            namespaced(project, &i.key)
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
    out
}

#[cfg(test)]
mod tests {
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
        let a = set_all_commands(
            "proj",
            &[
                item("a.b", false, false, json!("x")),
                item("list[0]", true, false, json!(1)),
                item("aws:region", false, true, json!("eu")),
            ],
        );
        assert_eq!(
            a,
            vec![vec![
                "config",
                "set-all",
                "--path",
                "--plaintext",
                "proj:[\"a.b\"]=x",
                "--plaintext",
                "proj:list[0]=1",
                "--secret",
                "aws:[\"region\"]=eu",
            ]]
        );
    }

    #[test]
    fn structured_config_uses_json_mode() {
        let commands = set_all_commands(
            "proj",
            &[
                item("obj", false, false, json!({"k": [1, 2]})),
                item("n", false, true, json!(3)),
            ],
        );
        let [a] = commands.as_slice() else {
            panic!("one call: {commands:?}")
        };
        let doc: Value = serde_json::from_str(a[2].trim_start_matches("--json=")).expect("json");
        assert_eq!(doc["proj:obj"]["objectValue"], json!({"k": [1, 2]}));
        assert_eq!(doc["proj:n"], json!({"value": "3", "secret": true}));
    }

    #[test]
    fn path_items_beside_structured_values_follow_in_a_path_call() {
        let commands = set_all_commands(
            "proj",
            &[
                item("p.q", true, false, json!("x")),
                item("obj", false, false, json!([1])),
                item("a.b", false, true, json!("y")),
            ],
        );
        assert_eq!(commands.len(), 2, "{commands:?}");
        let doc: Value =
            serde_json::from_str(commands[0][2].trim_start_matches("--json=")).expect("json");
        assert_eq!(
            doc,
            json!({"proj:obj": {"value": "[1]", "objectValue": [1], "secret": false},
                   "proj:a.b": {"value": "y", "secret": true}})
        );
        assert_eq!(
            commands[1],
            vec!["config", "set-all", "--path", "--plaintext", "proj:p.q=x"]
        );
    }
}
