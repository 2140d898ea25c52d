//! The field → test table of docs/execution.md against the CRDs of deploy/crds/: every spec
//! field of Stack, Workspace, Update and Program has a row, every row names a field that exists,
//! and every test a row names exists in tests/tests/it/, so the table cannot claim a test that
//! is not there or leave a field out.
//!
//! Depth rule: a field's own fields are rows too, except under the fields in [`OPAQUE`], whose
//! internals are Kubernetes' types or another kind's: the field itself is a row, its internals
//! are not (they are Kubernetes' own, or have their rows under their own kind).

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

use serde_json::Value;

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// `(kind, CRD file, root of its fields)`: Program keeps its fields under `program`, not `spec`.
const KINDS: [(&str, &str, &str); 4] = [
    ("Stack", "pulumi.com_stacks.yaml", "spec"),
    ("Workspace", "auto.pulumi.com_workspaces.yaml", "spec"),
    ("Update", "auto.pulumi.com_updates.yaml", "spec"),
    ("Program", "pulumi.com_programs.yaml", "program"),
];

/// `(kind, field)` whose internals are not rows: embedded Workspace and Update objects (their
/// fields are the Workspace and Update rows), Kubernetes' own types (PodTemplateSpec, EnvVar,
/// EnvFromSource, ResourceRequirements, SecretKeySelector, object metadata), and PKO's
/// ResourceRef (one value from a Secret, env, file or literal; a row per use of it), and Pulumi
/// YAML's own resource options and `get`, carried into `Pulumi.yaml` as written.
const OPAQUE: &[(&str, &str)] = &[
    ("Stack", "workspaceTemplate"),
    ("Stack", "updateTemplate"),
    ("Stack", "envRefs"),
    ("Stack", "secretsRef"),
    ("Stack", "gitAuth.accessToken"),
    ("Stack", "gitAuth.basicAuth.password"),
    ("Stack", "gitAuth.basicAuth.userName"),
    ("Stack", "gitAuth.githubApp.appID"),
    ("Stack", "gitAuth.githubApp.installationID"),
    ("Stack", "gitAuth.githubApp.privateKey"),
    ("Stack", "gitAuth.sshAuth.password"),
    ("Stack", "gitAuth.sshAuth.sshPrivateKey"),
    ("Workspace", "env"),
    ("Workspace", "envFrom"),
    ("Workspace", "podTemplate"),
    ("Workspace", "resources"),
    ("Workspace", "serviceTemplate.metadata"),
    ("Workspace", "git.auth.githubApp.appID"),
    ("Workspace", "git.auth.githubApp.installationID"),
    ("Workspace", "git.auth.githubApp.privateKey"),
    ("Workspace", "git.auth.password"),
    ("Workspace", "git.auth.sshPrivateKey"),
    ("Workspace", "git.auth.token"),
    ("Workspace", "git.auth.username"),
    ("Program", "resources.*.get"),
    ("Program", "resources.*.options"),
];

/// Every field path of `schema` below `prefix`: `a.b`, `a[].b` in arrays, `a.*.b` in maps.
fn walk(kind: &str, schema: &Value, prefix: &str, out: &mut BTreeSet<String>) {
    let mut schema = schema;
    let mut prefix = prefix.to_owned();
    if let Some(items) = schema.get("items") {
        schema = items;
        prefix.push_str("[]");
    } else if let Some(values) = schema
        .get("additionalProperties")
        .filter(|v| v.get("properties").is_some())
    {
        schema = values;
        prefix.push_str(".*");
    }
    let Some(properties) = schema.get("properties").and_then(Value::as_object) else {
        return;
    };
    for (name, sub) in properties {
        let path = if prefix.is_empty() {
            name.clone()
        } else {
            format!("{prefix}.{name}")
        };
        if !OPAQUE.contains(&(kind, path.as_str())) {
            walk(kind, sub, &path, out);
        }
        out.insert(path);
    }
}

/// `(kind, field)` of every spec field of the served CRDs (the storage version's schema).
fn crd_fields() -> BTreeSet<(String, String)> {
    let mut out = BTreeSet::new();
    for (kind, file, root) in KINDS {
        let text = std::fs::read_to_string(repo().join("deploy/crds").join(file)).expect(file);
        let crd: Value = yaml_serde::from_str(&text).expect("crd yaml");
        let versions = crd["spec"]["versions"].as_array().expect("versions");
        let storage = versions
            .iter()
            .find(|v| v["storage"] == Value::Bool(true))
            .expect("a storage version");
        let schema = &storage["schema"]["openAPIV3Schema"]["properties"][root];
        assert!(schema.is_object(), "{kind}: no {root} in the schema");
        let mut fields = BTreeSet::new();
        walk(kind, schema, "", &mut fields);
        out.extend(fields.into_iter().map(|f| (kind.to_owned(), f)));
    }
    out
}

/// The rows of the field table under `## Fields and their tests` in docs/execution.md:
/// `(kind, field) → test column`.
fn documented() -> BTreeMap<(String, String), String> {
    let doc = std::fs::read_to_string(repo().join("docs/execution.md")).expect("execution.md");
    let start = doc
        .find("\n## Fields and their tests\n")
        .expect("the section `## Fields and their tests`");
    let section = &doc[start + 1..];
    let section = &section[..section[1..].find("\n## ").map_or(section.len(), |i| i + 1)];
    let mut out = BTreeMap::new();
    let mut in_table = false;
    for line in section.lines() {
        if line.starts_with("| kind | field | test |") {
            in_table = true;
            continue;
        }
        if !in_table || line.starts_with("|---") {
            continue;
        }
        if !line.starts_with('|') {
            in_table = false;
            continue;
        }
        let cells: Vec<&str> = line.trim_matches('|').split('|').map(str::trim).collect();
        assert_eq!(cells.len(), 3, "a row of three cells: {line}");
        let key = (cells[0].to_owned(), cells[1].trim_matches('`').to_owned());
        assert!(
            out.insert(key.clone(), cells[2].to_owned()).is_none(),
            "{key:?} has two rows"
        );
    }
    out
}

/// Every `module::name` in backticks in `cell`.
fn tests_named(cell: &str) -> Vec<(String, String)> {
    cell.split('`')
        .skip(1)
        .step_by(2)
        .filter_map(|s| {
            let (module, name) = s.split_once("::")?;
            let plain =
                |s: &str| !s.is_empty() && s.chars().all(|c| c.is_ascii_alphanumeric() || c == '_');
            (plain(module) && plain(name)).then(|| (module.to_owned(), name.to_owned()))
        })
        .collect()
}

/// Whether a test `name` is in `tests/tests/it/<module>.rs`, as a test.
fn test_exists(module: &str, name: &str) -> bool {
    let Ok(text) =
        std::fs::read_to_string(repo().join("tests/tests/it").join(format!("{module}.rs")))
    else {
        return false;
    };
    let lines: Vec<&str> = text.lines().collect();
    lines.iter().enumerate().any(|(i, line)| {
        let line = line.trim_start();
        let is_fn = line.starts_with(&format!("async fn {name}("))
            || line.starts_with(&format!("fn {name}("));
        // The attribute sits above the function, perhaps behind doc comments or other attributes.
        is_fn
            && lines[..i]
                .iter()
                .rev()
                .map(|l| l.trim_start())
                .take_while(|l| l.starts_with("#[") || l.starts_with("///"))
                .any(|l| l.starts_with("#[tokio::test") || l.starts_with("#[test"))
    })
}

#[test]
fn every_spec_field_has_a_row_and_every_row_a_field() {
    let fields = crd_fields();
    let rows = documented();
    let missing: Vec<_> = fields.iter().filter(|f| !rows.contains_key(*f)).collect();
    assert!(
        missing.is_empty(),
        "fields without a row in docs/execution.md: {missing:?}"
    );
    let stale: Vec<_> = rows.keys().filter(|r| !fields.contains(*r)).collect();
    assert!(stale.is_empty(), "rows naming no spec field: {stale:?}");
}

#[test]
fn every_row_says_how_its_field_is_tested_and_names_tests_that_exist() {
    for ((kind, field), cell) in documented() {
        let named = tests_named(&cell);
        let effect =
            !named.is_empty() && !cell.starts_with("shape only") && !cell.starts_with("not tested");
        assert!(
            effect || cell.starts_with("shape only: ") || cell.starts_with("not tested: "),
            "{kind} {field}: a test, `shape only: <test>` or `not tested: <why>`, not {cell:?}"
        );
        if cell.starts_with("shape only") {
            assert!(
                !named.is_empty(),
                "{kind} {field}: shape only names its test"
            );
        }
        for (module, name) in named {
            assert!(
                test_exists(&module, &name),
                "{kind} {field}: no test {module}::{name} in tests/tests/it/{module}.rs"
            );
        }
    }
}

#[test]
fn the_depth_rule_names_fields_that_exist() {
    let fields = crd_fields();
    for (kind, field) in OPAQUE {
        assert!(
            fields.contains(&((*kind).to_owned(), (*field).to_owned())),
            "{kind} {field} in OPAQUE is no field"
        );
    }
}
