//! default-tags: merge tags into the resources whose type token starts with a configured prefix.
//!
//! Pure Rust on serde_json, with no plugin bindings, so the same code also runs natively (the
//! benchmark compares the two).

use std::collections::BTreeMap;

use serde::Deserialize;
use serde_json::{Map, Value};

/// Why the plugin refuses.
#[derive(Debug)]
pub enum Error {
    InvalidConfig(String),
}

/// The configuration (`spec.config`).
#[derive(Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Config {
    /// Tags added to every matching resource.
    #[serde(default)]
    pub tags: BTreeMap<String, String>,
    /// Program labels copied into tags: label key → tag key.
    #[serde(default)]
    pub from_labels: BTreeMap<String, String>,
    /// When set, a tag with this key holds the Program's namespace.
    #[serde(default)]
    pub namespace_tag: Option<String>,
    /// Which resources get tags, and where their tags live.
    pub targets: Vec<Target>,
    /// Replace tags the Program already sets (default: the Program's own values win).
    #[serde(default)]
    pub overwrite: bool,
}

/// Resources whose type starts with `type_prefix` keep their tags at `property` (a dotted path
/// under `properties`, e.g. `tags`, `labels` or `metadata.labels`).
#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Target {
    pub type_prefix: String,
    #[serde(default = "default_property")]
    pub property: String,
}

fn default_property() -> String {
    "tags".to_owned()
}

/// Checks a configuration beyond its shape.
pub fn check_config(config: &Config) -> Result<(), Error> {
    if config.targets.is_empty() {
        return Err(Error::InvalidConfig(
            "targets must name at least one type prefix".into(),
        ));
    }
    if config.tags.is_empty() && config.from_labels.is_empty() && config.namespace_tag.is_none() {
        return Err(Error::InvalidConfig(
            "nothing to add: set tags, fromLabels or namespaceTag".into(),
        ));
    }
    for target in &config.targets {
        if target.type_prefix.is_empty() {
            return Err(Error::InvalidConfig(
                "a target has an empty typePrefix".into(),
            ));
        }
        if target.property.split('.').any(str::is_empty) {
            return Err(Error::InvalidConfig(format!(
                "target {:?}: property {:?} is not a dotted path",
                target.type_prefix, target.property
            )));
        }
    }
    Ok(())
}

/// Adds the tags; returns warnings for resources whose tags cannot be merged.
pub fn transform(
    namespace: &str,
    labels: &BTreeMap<String, String>,
    spec: &mut Map<String, Value>,
    config: &Config,
) -> Vec<String> {
    let mut tags = config.tags.clone();
    for (label, tag) in &config.from_labels {
        if let Some(value) = labels.get(label) {
            tags.insert(tag.clone(), value.clone());
        }
    }
    if let Some(key) = &config.namespace_tag {
        tags.insert(key.clone(), namespace.to_owned());
    }
    let mut warnings = Vec::new();
    let Some(Value::Object(resources)) = spec.get_mut("resources") else {
        return warnings;
    };
    for (name, resource) in resources.iter_mut() {
        let Some(resource) = resource.as_object_mut() else {
            continue;
        };
        let type_token = resource
            .get("type")
            .and_then(Value::as_str)
            .unwrap_or_default();
        // The longest matching prefix decides, so `aws:s3` can override `aws:`.
        let Some(target) = config
            .targets
            .iter()
            .filter(|t| type_token.starts_with(&t.type_prefix))
            .max_by_key(|t| t.type_prefix.len())
        else {
            continue;
        };
        // A `get` resource reads existing state: it takes no properties.
        if resource.contains_key("get") {
            continue;
        }
        match tag_map(resource, &target.property) {
            Some(existing) => {
                for (key, value) in &tags {
                    if config.overwrite || !existing.contains_key(key) {
                        existing.insert(key.clone(), Value::String(value.clone()));
                    }
                }
            }
            None => warnings.push(format!(
                "resource {name:?}: properties.{} is not a map (an expression?); tags not added",
                target.property
            )),
        }
    }
    warnings
}

/// The object at `properties.<path>`, created when missing; `None` when something on the way is
/// not an object.
fn tag_map<'a>(
    resource: &'a mut Map<String, Value>,
    path: &str,
) -> Option<&'a mut Map<String, Value>> {
    let mut node = resource
        .entry("properties")
        .or_insert_with(|| Value::Object(Map::new()))
        .as_object_mut()?;
    for part in path.split('.') {
        node = node
            .entry(part)
            .or_insert_with(|| Value::Object(Map::new()))
            .as_object_mut()?;
    }
    Some(node)
}
