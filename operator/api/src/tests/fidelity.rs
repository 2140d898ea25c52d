//! Every field path and type of PKO's CRDs must exist in ours.

use std::collections::BTreeMap;

use serde_json::Value;

use super::support::{CRD_FILES, our_crd, reference_crd, schema, version_names, walk};

/// What "type" means for the comparison: the OpenAPI `type`, or one of the two markers that
/// stand in for a type in structural schemas.
fn type_facets(node: &Value) -> Vec<String> {
    let mut facets = Vec::new();
    if let Some(t) = node.get("type").and_then(Value::as_str) {
        facets.push(format!("type={t}"));
    }
    for marker in [
        "x-kubernetes-int-or-string",
        "x-kubernetes-preserve-unknown-fields",
    ] {
        if node.get(marker) == Some(&Value::Bool(true)) {
            facets.push(marker.to_owned());
        }
    }
    facets
}

#[test]
fn every_pko_path_and_type_exists_in_our_crds() {
    let expected_counts = BTreeMap::from([
        ("auto.pulumi.com_updates.yaml/v1alpha1", 39),
        ("auto.pulumi.com_workspaces.yaml/v1alpha1", 1387),
        ("pulumi.com_programs.yaml/v1", 56),
        ("pulumi.com_stacks.yaml/v1", 1688),
        ("pulumi.com_stacks.yaml/v1alpha1", 1670),
    ]);
    let mut counts = BTreeMap::new();
    let mut problems = Vec::new();
    for file in CRD_FILES {
        let reference = reference_crd(file);
        let ours = our_crd(file);
        for version in version_names(&reference) {
            assert!(
                version_names(&ours).contains(&version),
                "{file}: version {version} missing"
            );
            let ref_nodes = walk(schema(&reference, &version));
            counts.insert(format!("{file}/{version}"), ref_nodes.len());
            let our_nodes: BTreeMap<String, &Value> =
                walk(schema(&ours, &version)).into_iter().collect();
            for (path, ref_node) in ref_nodes {
                let shown = if path.is_empty() { "<root>" } else { &path };
                let Some(our_node) = our_nodes.get(&path) else {
                    problems.push(format!("{file} {version} {shown}: missing"));
                    continue;
                };
                let ours = type_facets(our_node);
                for facet in type_facets(ref_node) {
                    if !ours.contains(&facet) {
                        problems.push(format!(
                            "{file} {version} {shown}: PKO has {facet}, ours has {ours:?}"
                        ));
                    }
                }
            }
        }
    }
    assert!(
        problems.is_empty(),
        "{} PKO paths/types missing from our CRDs:\n{}",
        problems.len(),
        problems.join("\n")
    );
    let expected: BTreeMap<String, usize> = expected_counts
        .into_iter()
        .map(|(k, v)| (k.to_owned(), v))
        .collect();
    assert_eq!(
        counts, expected,
        "the reference CRDs are not the expected ones"
    );
}
