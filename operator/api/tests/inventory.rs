//! Keeps the tenant-input inventory of docs/policies.md true against the generated CRDs
//! (deploy/crds): the inventory names every spec field of every kind, names only fields that
//! exist, and every string a tenant writes that reaches a URL, a request path or a file path
//! is bounded by the schema (a pattern, enum or format, and a maxLength).

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use serde_json::Value;

/// The heading of the inventory's section in docs/policies.md.
const HEADING: &str = "## Tenant input inventory";

/// Strings that reach a URL, an apiserver request path or a file path, as `(kind, field)`.
/// The same list is the inventory's rows marked `path` or `url` in their sink column.
const REACHES_A_PATH: &[(&str, &str)] = &[
    // apiserver request paths
    ("Stack", "spec.fluxSource.sourceRef.apiVersion"),
    ("Stack", "spec.fluxSource.sourceRef.kind"),
    ("Stack", "spec.fluxSource.sourceRef.name"),
    ("Stack", "spec.programRef.name"),
    ("Stack", "spec.gitAuthSecret"),
    ("Stack", "spec.accessTokenSecret"),
    ("Stack", "spec.envSecrets[]"),
    ("Stack", "spec.configRef{}.name"),
    ("Stack", "spec.envRefs{}.secret.name"),
    ("Stack", "spec.secretsRef{}.secret.name"),
    ("Stack", "spec.gitAuth.accessToken.secret.name"),
    ("Stack", "spec.gitAuth.basicAuth.userName.secret.name"),
    ("Stack", "spec.gitAuth.basicAuth.password.secret.name"),
    ("Stack", "spec.gitAuth.sshAuth.sshPrivateKey.secret.name"),
    ("Stack", "spec.gitAuth.sshAuth.password.secret.name"),
    ("Stack", "spec.gitAuth.githubApp.appID.secret.name"),
    ("Stack", "spec.gitAuth.githubApp.installationID.secret.name"),
    ("Stack", "spec.gitAuth.githubApp.privateKey.secret.name"),
    ("Stack", "spec.prerequisites[].name"),
    ("Stack", "spec.serviceAccountName"),
    ("Update", "spec.workspaceName"),
    ("Workspace", "spec.serviceAccountName"),
    ("ProgramTransform", "spec.source.configMap.name"),
    ("ProgramTransform", "spec.source.oci.pullSecretRef.name"),
    (
        "ProgramTransform",
        "spec.verify.cosign.publicKeySecretRef.name",
    ),
    ("ClusterProgramTransform", "spec.source.configMap.name"),
    ("ClusterProgramTransform", "spec.source.configMap.namespace"),
    (
        "ClusterProgramTransform",
        "spec.source.oci.pullSecretRef.name",
    ),
    (
        "ClusterProgramTransform",
        "spec.source.oci.pullSecretRef.namespace",
    ),
    (
        "ClusterProgramTransform",
        "spec.verify.cosign.publicKeySecretRef.name",
    ),
    (
        "ClusterProgramTransform",
        "spec.verify.cosign.publicKeySecretRef.namespace",
    ),
    // outbound URLs
    ("Stack", "spec.projectRepo"),
    ("Stack", "spec.branch"),
    ("Workspace", "spec.git.url"),
    ("Workspace", "spec.git.ref"),
    ("Workspace", "spec.flux.url"),
    ("ProgramTransform", "spec.source.url"),
    ("ProgramTransform", "spec.source.oci.reference"),
    ("ClusterProgramTransform", "spec.source.url"),
    ("ClusterProgramTransform", "spec.source.oci.reference"),
    // file paths
    ("Stack", "spec.repoDir"),
    ("Stack", "spec.fluxSource.dir"),
    ("Workspace", "spec.git.dir"),
    ("Workspace", "spec.flux.dir"),
    ("Workspace", "spec.local.dir"),
    ("Update", "spec.plan"),
];

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// Every served version's schema of every CRD in deploy/crds, as `(kind, schema)`.
fn schemas() -> Vec<(String, Value)> {
    let dir = repo().join("deploy/crds");
    let mut out = Vec::new();
    let mut entries: Vec<_> = std::fs::read_dir(&dir)
        .expect("deploy/crds")
        .map(|e| e.expect("entry").path())
        .filter(|p| p.extension().is_some_and(|e| e == "yaml"))
        .collect();
    entries.sort();
    for path in entries {
        let text = std::fs::read_to_string(&path).expect("CRD file");
        let crd: Value = yaml_serde::from_str(&text).expect("CRD YAML");
        let kind = crd["spec"]["names"]["kind"]
            .as_str()
            .expect("kind")
            .to_owned();
        for version in crd["spec"]["versions"].as_array().expect("versions") {
            out.push((kind.clone(), version["schema"]["openAPIV3Schema"].clone()));
        }
    }
    assert!(out.len() >= 7, "expected every CRD, got {}", out.len());
    out
}

/// The root a tenant writes: `spec`, or Program's `program`.
fn root(kind: &str) -> &'static str {
    if kind == "Program" { "program" } else { "spec" }
}

/// The schema at `field` (`a.b[].c{}.d`), descending through items and additionalProperties.
fn resolve<'a>(schema: &'a Value, field: &str) -> Option<&'a Value> {
    let mut at = schema;
    for segment in field.split('.') {
        let name = segment.trim_end_matches("[]").trim_end_matches("{}");
        at = at.get("properties")?.get(name)?;
        let mut rest = &segment[name.len()..];
        while !rest.is_empty() {
            if let Some(r) = rest.strip_prefix("[]") {
                at = at.get("items")?;
                rest = r;
            } else if let Some(r) = rest.strip_prefix("{}") {
                at = at.get("additionalProperties")?;
                rest = r;
            } else {
                return None;
            }
        }
    }
    Some(at)
}

/// The inventory's rows as `(kind, field)`: the first two cells, both in backticks.
fn inventory() -> Vec<(String, String)> {
    let doc = std::fs::read_to_string(repo().join("docs/policies.md")).expect("docs/policies.md");
    let start = doc.find(HEADING).expect("the inventory section");
    let section = &doc[start + HEADING.len()..];
    let section = &section[..section.find("\n## ").unwrap_or(section.len())];
    let mut rows = Vec::new();
    for line in section.lines() {
        let cells: Vec<&str> = line.split('|').map(str::trim).collect();
        if cells.len() < 4 || !cells[1].starts_with('`') {
            continue;
        }
        let kind = cells[1].trim_matches('`');
        // The fields are the cell's code spans; words around them are commentary.
        for (i, field) in cells[2].split('`').enumerate() {
            if i % 2 == 1 {
                rows.push((kind.to_owned(), field.to_owned()));
            }
        }
    }
    assert!(
        rows.len() > 50,
        "the inventory table was not found or is short"
    );
    rows
}

#[test]
fn the_inventory_names_every_spec_field_and_only_fields_that_exist() {
    let rows = inventory();
    let mut missing = BTreeSet::new();
    let mut unknown = BTreeSet::new();
    for (kind, schema) in schemas() {
        let root = root(&kind);
        let fields = schema["properties"][root]["properties"]
            .as_object()
            .map(|m| m.keys().cloned().collect::<Vec<_>>())
            .unwrap_or_default();
        assert!(!fields.is_empty(), "{kind} has no {root} fields");
        for field in fields {
            let named = format!("{root}.{field}");
            let covered = rows.iter().any(|(k, f)| {
                k == &kind
                    && (f == &named
                        || f.starts_with(&format!("{named}."))
                        || f.starts_with(&format!("{named}["))
                        || f.starts_with(&format!("{named}{{")))
            });
            if !covered {
                missing.insert(format!("{kind} {named}"));
            }
        }
        for (k, f) in &rows {
            let f = f.trim_end_matches(".*");
            if k == &kind && resolve(&schema, f).is_none() {
                unknown.insert(format!("{k} {f}"));
            }
        }
    }
    for (k, _) in &rows {
        assert!(
            schemas().iter().any(|(kind, _)| kind == k)
                || ["Secret", "ConfigMap", "answer"].contains(&k.as_str()),
            "the inventory names an unknown kind {k}"
        );
    }
    assert!(
        missing.is_empty(),
        "fields the inventory does not name: {missing:#?}"
    );
    assert!(
        unknown.is_empty(),
        "fields the inventory names that do not exist: {unknown:#?}"
    );
}

#[test]
fn every_string_that_reaches_a_path_is_bounded_by_the_schema() {
    let rows = inventory();
    let schemas = schemas();
    let mut unbounded = Vec::new();
    for (kind, field) in REACHES_A_PATH {
        assert!(
            rows.iter().any(|(k, f)| k == kind && f == field),
            "the inventory has no row for {kind} {field}"
        );
        let mut seen = false;
        for (k, schema) in &schemas {
            if k != kind {
                continue;
            }
            let at = resolve(schema, field).unwrap_or_else(|| panic!("{kind} {field} resolves"));
            seen = true;
            assert_eq!(at["type"], "string", "{kind} {field}");
            let shaped = ["pattern", "enum", "format"]
                .iter()
                .any(|k| at.get(k).is_some());
            let bounded = at.get("maxLength").is_some() || at.get("enum").is_some();
            if !(shaped && bounded) {
                unbounded.push(format!("{kind} {field}"));
            }
        }
        assert!(seen, "{kind} is not a CRD");
    }
    unbounded.dedup();
    assert!(
        unbounded.is_empty(),
        "strings that reach a URL or a path without a pattern/enum/format and a maxLength:\n{}",
        unbounded.join("\n")
    );
}
