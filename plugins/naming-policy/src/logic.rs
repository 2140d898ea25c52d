//! naming-policy: prefix resource names with the Program's namespace, or reject names that do
//! not match a pattern.
//!
//! Pure Rust on serde_json and regex-lite, with no plugin bindings, so the same code also runs
//! natively (the benchmark compares the two).

use regex_lite::Regex;
use serde::Deserialize;
use serde_json::{Map, Value};

/// Why the plugin refuses.
#[derive(Debug)]
pub enum Error {
    InvalidConfig(String),
    Rejected(String),
}

/// What the policy does.
#[derive(Debug, Default, Deserialize, Clone, Copy, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub enum Mode {
    /// Prefix literal names with `<namespace><separator>`.
    #[default]
    Prefix,
    /// Reject the Program when a name does not match `pattern`.
    Enforce,
}

/// The configuration (`spec.config`).
#[derive(Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Config {
    #[serde(default)]
    pub mode: Mode,
    /// Property holding the physical name, a dotted path under `properties` (default `name`;
    /// `metadata.name` for Kubernetes resources).
    #[serde(default = "default_name_property")]
    pub name_property: String,
    /// Only resources whose type starts with one of these (default: every resource).
    #[serde(default)]
    pub type_prefixes: Vec<String>,
    /// Between the namespace and the name (prefix mode).
    #[serde(default = "default_separator")]
    pub separator: String,
    /// Prefix mode: set `<namespace><separator><resource key>` where no name is given, instead
    /// of leaving the resource to Pulumi's auto-naming.
    #[serde(default)]
    pub set_when_missing: bool,
    /// Enforce mode: resource keys and literal names must match this regular expression.
    #[serde(default)]
    pub pattern: Option<String>,
}

fn default_name_property() -> String {
    "name".to_owned()
}

fn default_separator() -> String {
    "-".to_owned()
}

/// A checked configuration.
pub struct Policy {
    config: Config,
    pattern: Option<Regex>,
}

/// Checks a configuration and compiles its pattern.
pub fn policy(config: Config) -> Result<Policy, Error> {
    if config.name_property.split('.').any(str::is_empty) {
        return Err(Error::InvalidConfig(format!(
            "nameProperty {:?} is not a dotted path",
            config.name_property
        )));
    }
    let pattern = match (&config.mode, &config.pattern) {
        (Mode::Enforce, None) => {
            return Err(Error::InvalidConfig("mode enforce needs a pattern".into()));
        }
        (Mode::Prefix, Some(_)) => {
            return Err(Error::InvalidConfig(
                "pattern is only used by mode enforce".into(),
            ));
        }
        (_, Some(raw)) => Some(
            Regex::new(raw).map_err(|e| Error::InvalidConfig(format!("pattern {raw:?}: {e}")))?,
        ),
        (_, None) => None,
    };
    Ok(Policy { config, pattern })
}

/// Applies the policy; returns warnings, or the rejection naming every offender.
pub fn transform(
    namespace: &str,
    spec: &mut Map<String, Value>,
    policy: &Policy,
) -> Result<Vec<String>, Error> {
    let config = &policy.config;
    let mut warnings = Vec::new();
    let mut offenders = Vec::new();
    let Some(Value::Object(resources)) = spec.get_mut("resources") else {
        return Ok(warnings);
    };
    let prefix = format!("{namespace}{}", config.separator);
    for (key, resource) in resources.iter_mut() {
        let Some(resource) = resource.as_object_mut() else {
            continue;
        };
        let type_token = resource
            .get("type")
            .and_then(Value::as_str)
            .unwrap_or_default();
        if !config.type_prefixes.is_empty()
            && !config
                .type_prefixes
                .iter()
                .any(|p| type_token.starts_with(p))
        {
            continue;
        }
        if resource.contains_key("get") {
            continue;
        }
        match (config.mode, &policy.pattern) {
            (Mode::Enforce, Some(pattern)) => {
                if !pattern.is_match(key) {
                    offenders.push(format!("resource key {key:?}"));
                }
                if let Some(Value::String(name)) = name_at(resource, &config.name_property)
                    && !is_expression(name)
                    && !pattern.is_match(name)
                {
                    offenders.push(format!(
                        "resource {key:?} name {name:?} (properties.{})",
                        config.name_property
                    ));
                }
            }
            _ => match name_at_mut(resource, &config.name_property) {
                Ok(Value::String(name)) if is_expression(name) => warnings.push(format!(
                    "resource {key:?}: properties.{} is an expression; not prefixed",
                    config.name_property
                )),
                Ok(Value::String(name)) => {
                    if !name.starts_with(&prefix) {
                        *name = format!("{prefix}{name}");
                    }
                }
                Ok(_) => warnings.push(format!(
                    "resource {key:?}: properties.{} is not a string; not prefixed",
                    config.name_property
                )),
                Err(Missing) => {
                    if config.set_when_missing
                        && !set_at(resource, &config.name_property, format!("{prefix}{key}"))
                    {
                        warnings.push(format!(
                            "resource {key:?}: cannot set properties.{}",
                            config.name_property
                        ));
                    }
                }
            },
        }
    }
    if offenders.is_empty() {
        Ok(warnings)
    } else {
        let pattern = config.pattern.as_deref().unwrap_or_default();
        Err(Error::Rejected(format!(
            "{} name(s) do not match {pattern:?}: {}",
            offenders.len(),
            offenders.join(", ")
        )))
    }
}

fn is_expression(s: &str) -> bool {
    s.contains("${")
}

fn name_at<'a>(resource: &'a Map<String, Value>, path: &str) -> Option<&'a Value> {
    let mut node = resource.get("properties")?;
    for part in path.split('.') {
        node = node.get(part)?;
    }
    Some(node)
}

/// The name is not set (as opposed to set to something that is not a string).
struct Missing;

fn name_at_mut<'a>(
    resource: &'a mut Map<String, Value>,
    path: &str,
) -> Result<&'a mut Value, Missing> {
    let mut node = resource.get_mut("properties").ok_or(Missing)?;
    for part in path.split('.') {
        node = node.get_mut(part).ok_or(Missing)?;
    }
    Ok(node)
}

/// Sets `properties.<path>`, creating objects on the way; false when something on the way is
/// not an object.
fn set_at(resource: &mut Map<String, Value>, path: &str, value: String) -> bool {
    let mut node = resource
        .entry("properties")
        .or_insert_with(|| Value::Object(Map::new()));
    let parts: Vec<&str> = path.split('.').collect();
    let Some((leaf, parents)) = parts.split_last() else {
        return false;
    };
    for part in parents {
        let Some(map) = node.as_object_mut() else {
            return false;
        };
        node = map
            .entry(*part)
            .or_insert_with(|| Value::Object(Map::new()));
    }
    match node.as_object_mut() {
        Some(map) => {
            map.insert((*leaf).to_owned(), Value::String(value));
            true
        }
        None => false,
    }
}
