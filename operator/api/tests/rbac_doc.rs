//! The RBAC table of docs/operations.md against the Roles and ClusterRole of deploy/rbac/: the
//! same rules, rule by rule and in order, so the table cannot understate what is granted.

use std::path::{Path, PathBuf};

use serde_json::Value;

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// A rule as `(where, group, resources, names, verbs)`, each list sorted.
type Rule = (String, String, Vec<String>, Vec<String>, Vec<String>);

fn sorted(v: impl IntoIterator<Item = String>) -> Vec<String> {
    let mut v: Vec<String> = v.into_iter().collect();
    v.sort();
    v
}

fn strings(v: &Value) -> Vec<String> {
    v.as_array()
        .map(|a| {
            a.iter()
                .filter_map(Value::as_str)
                .map(str::to_owned)
                .collect()
        })
        .unwrap_or_default()
}

/// The operator's own rules in deploy/rbac/ (the aggregated user roles are not its grants).
fn manifest_rules() -> Vec<Rule> {
    let mut out = Vec::new();
    for file in [
        "cluster_role.yaml",
        "leader_election_role.yaml",
        "webhook_role.yaml",
    ] {
        let text = std::fs::read_to_string(repo().join("deploy/rbac").join(file)).expect(file);
        for doc in text.split("\n---") {
            let object: Value = yaml_serde::from_str(doc).expect("RBAC YAML");
            let kind = object["kind"].as_str().unwrap_or_default();
            if kind != "ClusterRole" && kind != "Role" {
                continue;
            }
            let place = match kind {
                "ClusterRole" => "cluster".to_owned(),
                _ => object["metadata"]["namespace"]
                    .as_str()
                    .expect("a Role's namespace")
                    .to_owned(),
            };
            for rule in object["rules"].as_array().expect("rules") {
                let groups = strings(&rule["apiGroups"]);
                assert_eq!(groups.len(), 1, "one API group per rule: {rule}");
                let group = if groups[0].is_empty() {
                    "core".to_owned()
                } else {
                    groups[0].clone()
                };
                let names = strings(&rule["resourceNames"]);
                out.push((
                    place.clone(),
                    group,
                    sorted(strings(&rule["resources"])),
                    sorted(names),
                    sorted(strings(&rule["verbs"])),
                ));
            }
        }
    }
    assert!(out.len() > 10, "the operator's rules were not found");
    out
}

fn cell_list(cell: &str) -> Vec<String> {
    sorted(
        cell.split(',')
            .map(|s| s.trim().trim_matches('`').to_owned())
            .filter(|s| !s.is_empty()),
    )
}

/// The rows of the table under `## RBAC` in docs/operations.md.
fn documented_rules() -> Vec<Rule> {
    let doc = std::fs::read_to_string(repo().join("docs/operations.md")).expect("operations.md");
    let start = doc.find("\n## RBAC\n").expect("the RBAC section");
    let section = &doc[start + 1..];
    let section = &section[..section[1..].find("\n## ").map_or(section.len(), |i| i + 1)];
    let mut out = Vec::new();
    let mut in_table = false;
    for line in section.lines() {
        if line.starts_with("| where | API group | resources | names | verbs |") {
            in_table = true;
            continue;
        }
        if !in_table || line.starts_with("|---") {
            continue;
        }
        if !line.starts_with('|') {
            break;
        }
        let cells: Vec<&str> = line.split('|').map(str::trim).collect();
        assert!(cells.len() >= 7, "a short RBAC row: {line}");
        let names = if cells[4] == "any" {
            Vec::new()
        } else {
            cell_list(cells[4])
        };
        out.push((
            cells[1].trim_matches('`').to_owned(),
            cells[2].trim_matches('`').to_owned(),
            cell_list(cells[3]),
            names,
            cell_list(cells[5]),
        ));
    }
    assert!(!out.is_empty(), "the RBAC table was not found");
    out
}

#[test]
fn the_rbac_table_is_the_manifests_rules() {
    let manifests = manifest_rules();
    let documented = documented_rules();
    for (i, (m, d)) in manifests.iter().zip(&documented).enumerate() {
        assert_eq!(m, d, "rule {} differs (manifest, then table)", i + 1);
    }
    assert_eq!(
        manifests.len(),
        documented.len(),
        "the manifests have {} rules, the table {}",
        manifests.len(),
        documented.len()
    );
}

#[test]
fn the_table_says_secrets_are_granted_in_every_namespace() {
    // The cluster-wide Secret rule is the one the table used to understate ("by name").
    let doc = std::fs::read_to_string(repo().join("docs/operations.md")).expect("operations.md");
    let row = doc
        .lines()
        .find(|l| l.starts_with("| cluster | `core` | secrets |"))
        .expect("the cluster-wide Secrets row");
    assert!(
        row.contains("every Secret in every namespace, the operator's own included"),
        "{row}"
    );
}
