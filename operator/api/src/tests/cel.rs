//! The admission rules beyond PKO are present where intended. Every CEL rule only refers to
//! fields that exist at its node and are visible to CEL (so the apiserver compiles it), and
//! does not iterate (so it stays far below the CRD CEL cost limits).
//!
//! The two Program rules are structural-schema junctors instead of CEL, because the fields
//! they test are untyped and the apiserver hides untyped fields from CEL (see `program.rs`).

use serde_json::{Value, json};

use super::support::{CRD_FILES, our_crd, schema, version_names, walk};
use crate::stack::{
    APPROVAL_PREVIEW_MESSAGE, APPROVAL_PREVIEW_RULE, GIT_REVISION_MESSAGE, GIT_REVISION_RULE,
    NAME_LENGTH_MESSAGE, NAME_LENGTH_RULE, SOURCE_EXCLUSIVITY_MESSAGE, SOURCE_EXCLUSIVITY_RULE,
};

fn rules_at(file: &str, version: &str, path: &str) -> Vec<(String, String)> {
    node(file, version, path)
        .get("x-kubernetes-validations")
        .and_then(Value::as_array)
        .map(|rules| {
            rules
                .iter()
                .map(|r| {
                    (
                        r["rule"].as_str().unwrap_or_default().to_owned(),
                        r["message"].as_str().unwrap_or_default().to_owned(),
                    )
                })
                .collect()
        })
        .unwrap_or_default()
}

fn node(file: &str, version: &str, path: &str) -> Value {
    let crd = our_crd(file);
    walk(schema(&crd, version))
        .into_iter()
        .find(|(p, _)| p == path)
        .map(|(_, n)| n.clone())
        .unwrap_or_else(|| panic!("{file} {version}: no node {path}"))
}

#[test]
fn program_configuration_entry_needs_type_or_default() {
    let entry = node("pulumi.com_programs.yaml", "v1", ".program.configuration{}");
    assert_eq!(
        entry["anyOf"],
        json!([{ "required": ["type"] }, { "required": ["default"] }])
    );
    assert!(entry["properties"]["type"].is_object() && entry["properties"]["default"].is_object());
}

#[test]
fn program_resource_get_excludes_properties() {
    let resource = node("pulumi.com_programs.yaml", "v1", ".program.resources{}");
    assert_eq!(
        resource["not"],
        json!({ "required": ["get", "properties"] })
    );
    assert!(resource["properties"]["get"].is_object());
    assert!(resource["properties"]["properties"].is_object());
}

#[test]
fn stack_sources_are_mutually_exclusive_in_both_versions() {
    for version in ["v1", "v1alpha1"] {
        let rules = rules_at("pulumi.com_stacks.yaml", version, ".spec");
        assert_eq!(
            rules,
            [
                (
                    SOURCE_EXCLUSIVITY_RULE.to_owned(),
                    SOURCE_EXCLUSIVITY_MESSAGE.to_owned()
                ),
                (
                    GIT_REVISION_RULE.to_owned(),
                    GIT_REVISION_MESSAGE.to_owned()
                ),
                (
                    APPROVAL_PREVIEW_RULE.to_owned(),
                    APPROVAL_PREVIEW_MESSAGE.to_owned()
                ),
            ],
            "{version}"
        );
    }
}

#[test]
fn stack_v1_name_length_rule_is_pkos() {
    assert_eq!(
        rules_at("pulumi.com_stacks.yaml", "v1", ""),
        [(NAME_LENGTH_RULE.to_owned(), NAME_LENGTH_MESSAGE.to_owned())]
    );
    assert!(rules_at("pulumi.com_stacks.yaml", "v1alpha1", "").is_empty());
}

#[test]
fn workspace_names_are_checked_at_the_root() {
    use crate::workspace as ws;
    assert_eq!(
        rules_at("auto.pulumi.com_workspaces.yaml", "v1alpha1", ""),
        [
            (
                ws::NAME_LENGTH_RULE.to_owned(),
                ws::NAME_LENGTH_MESSAGE.to_owned()
            ),
            (
                ws::NAME_FORMAT_RULE.to_owned(),
                ws::NAME_FORMAT_MESSAGE.to_owned()
            ),
        ]
    );
    assert!(ws::NAME_LENGTH_RULE.ends_with(&ws::NAME_MAX_LENGTH.to_string()));
}

/// Whether the apiserver exposes a field with this schema to CEL (mirrors `SchemaDeclType` of
/// k8s.io/apiserver: untyped schemas, and lists/maps of them, are hidden).
fn cel_visible(schema: &Value) -> bool {
    if schema.get("x-kubernetes-int-or-string") == Some(&Value::Bool(true)) {
        return true;
    }
    match schema.get("type").and_then(Value::as_str) {
        Some("array") => schema.get("items").is_some_and(cel_visible),
        Some("object") => match schema.get("additionalProperties").filter(|v| v.is_object()) {
            Some(values) => cel_visible(values),
            None => true,
        },
        Some(_) => true,
        None => false,
    }
}

#[test]
fn cel_visibility_matches_the_apiserver() {
    // The reasons the Program rules cannot be CEL.
    let config = node("pulumi.com_programs.yaml", "v1", ".program.configuration{}");
    assert!(cel_visible(&config["properties"]["type"]));
    assert!(!cel_visible(&config["properties"]["default"]));
    let resource = node("pulumi.com_programs.yaml", "v1", ".program.resources{}");
    assert!(cel_visible(&resource["properties"]["get"]));
    assert!(!cel_visible(&resource["properties"]["properties"]));
}

/// The identifiers that follow `self.` in a rule.
fn self_fields(rule: &str) -> Vec<String> {
    rule.match_indices("self.")
        .map(|(i, m)| {
            rule[i + m.len()..]
                .chars()
                .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
                .collect()
        })
        .collect()
}

#[test]
fn every_rule_refers_to_existing_fields_and_does_not_iterate() {
    let mut count = 0;
    for file in CRD_FILES {
        let crd = our_crd(file);
        for version in version_names(&crd) {
            for (path, node) in walk(schema(&crd, &version)) {
                let Some(rules) = node
                    .get("x-kubernetes-validations")
                    .and_then(Value::as_array)
                else {
                    continue;
                };
                for rule in rules {
                    count += 1;
                    let text = rule["rule"].as_str().unwrap_or_default();
                    assert!(
                        rule["message"].as_str().is_some_and(|m| !m.is_empty()),
                        "{file} {version} {path}: rule {text} has no message"
                    );
                    for field in self_fields(text) {
                        let visible = if path.is_empty() && field == "metadata" {
                            true // name and generateName are always visible at the root
                        } else {
                            node["properties"].get(&field).is_some_and(cel_visible)
                        };
                        assert!(
                            visible,
                            "{file} {version} {path}: rule {text} uses {field}, which CEL cannot see"
                        );
                    }
                    for macro_ in [".all(", ".exists(", ".exists_one(", ".map(", ".filter("] {
                        assert!(
                            !text.contains(macro_),
                            "{file} {version} {path}: rule {text} iterates"
                        );
                    }
                }
            }
        }
    }
    // Stack: source exclusivity, git revision and approval-or-preview in v1 and v1alpha1,
    // name length in v1; Workspace: name length and format.
    assert_eq!(count, 9, "expected 9 CEL rules in total");
}
