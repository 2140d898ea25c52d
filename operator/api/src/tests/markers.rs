//! The validation and merge markers of PKO's CRDs (list/map types, defaults, required fields,
//! patterns, limits) are the same in ours, apart from the deliberate differences listed here.

use std::collections::BTreeMap;

use serde_json::Value;

use super::support::{CRD_FILES, our_crd, reference_crd, schema, version_names, walk};

/// Keys compared node by node.
const KEYS: [&str; 14] = [
    "required",
    "default",
    "x-kubernetes-list-type",
    "x-kubernetes-list-map-keys",
    "x-kubernetes-map-type",
    "pattern",
    "anyOf",
    "enum",
    "format",
    "minimum",
    "maximum",
    "minLength",
    "maxLength",
    "x-kubernetes-validations",
];

/// Where ours deliberately differs from PKO: (file, version, path, key).
fn allowed(file: &str, path: &str, key: &str, pko: Option<&Value>) -> bool {
    match key {
        // The typed clients need `spec`; PKO objects always have one.
        "required" if path.is_empty() => file != "pulumi.com_programs.yaml" && pko.is_none(),
        // Enums where PKO's Go type is a closed set of constants but the CRD has no enum.
        "enum" if pko.is_none() => {
            matches!(
                path,
                ".spec.securityProfile"
                    | ".spec.workspaceTemplate.spec.securityProfile"
                    | ".spec.type"
                    | ".spec.updateTemplate.spec.type"
            ) || path.ends_with("{}.type")
                || path.ends_with("auth.accessToken.type")
                || path.contains(".gitAuth.")
                // The Flux kinds a reference may name (it becomes a request path).
                || path.ends_with(".fluxSource.sourceRef.kind")
        }
        // Bounds PKO has none of, on strings a tenant writes that reach a request path, a URL
        // or a file path (docs/policies.md, tenant input inventory); any valid name, URL or
        // ref of a PKO object still passes.
        "pattern" | "minLength" | "maxLength" if pko.is_none() => bounded_tenant_string(path),
        // Our extra rules (PKO's CEL rules are checked separately to be kept).
        "x-kubernetes-validations" => true,
        "anyOf" => path == ".program.configuration{}" && pko.is_none(),
        _ => false,
    }
}

/// The fields [`allowed`] lets us bound where PKO does not: names (they become request
/// paths), URLs, git refs and directories.
fn bounded_tenant_string(path: &str) -> bool {
    const SUFFIXES: [&str; 17] = [
        ".fluxSource.sourceRef.apiVersion",
        ".fluxSource.sourceRef.name",
        ".fluxSource.dir",
        ".programRef.name",
        ".prerequisites[].name",
        ".configRef{}.name",
        ".secret.name",
        ".secret.namespace",
        ".spec.gitAuthSecret",
        ".spec.accessTokenSecret",
        ".spec.envSecrets[]",
        ".spec.envs[]",
        ".spec.serviceAccountName",
        ".spec.workspaceName",
        ".spec.projectRepo",
        ".spec.branch",
        ".spec.repoDir",
    ];
    const WORKSPACE: [&str; 6] = [
        ".spec.git.url",
        ".spec.git.ref",
        ".spec.git.dir",
        ".spec.flux.url",
        ".spec.flux.dir",
        ".spec.local.dir",
    ];
    SUFFIXES.iter().chain(&WORKSPACE).any(|s| path.ends_with(s))
}

fn normalized(key: &str, value: Option<&Value>) -> Option<Value> {
    let value = value?.clone();
    // JSONSchemaProps holds `minimum`/`maximum` as f64 (`0.0`); PKO writes `0`.
    if let Some(n) = value.as_f64() {
        return Some(Value::from(n));
    }
    if key == "required" || key == "enum" {
        // Order carries no meaning.
        if let Value::Array(mut items) = value {
            items.sort_by_key(|v| v.to_string());
            return Some(Value::Array(items));
        }
    }
    Some(value)
}

#[test]
fn pko_markers_are_kept() {
    let mut problems = Vec::new();
    for file in CRD_FILES {
        let reference = reference_crd(file);
        let ours = our_crd(file);
        for version in version_names(&reference) {
            let our_nodes: BTreeMap<String, &Value> =
                walk(schema(&ours, &version)).into_iter().collect();
            for (path, ref_node) in walk(schema(&reference, &version)) {
                let Some(our_node) = our_nodes.get(&path) else {
                    continue; // reported by the fidelity test
                };
                for key in KEYS {
                    let pko = normalized(key, ref_node.get(key));
                    let ours = normalized(key, our_node.get(key));
                    if pko != ours && !allowed(file, &path, key, pko.as_ref()) {
                        problems.push(format!(
                            "{file} {version} {path} {key}: PKO {} ours {}",
                            pko.map_or("-".to_owned(), |v| v.to_string()),
                            ours.map_or("-".to_owned(), |v| v.to_string()),
                        ));
                    }
                }
            }
        }
    }
    assert!(
        problems.is_empty(),
        "{} marker differences:\n{}",
        problems.len(),
        problems.join("\n")
    );
}

/// PKO's own CEL rules are kept verbatim.
#[test]
fn pko_cel_rules_are_kept() {
    for file in CRD_FILES {
        let reference = reference_crd(file);
        let ours = our_crd(file);
        for version in version_names(&reference) {
            let our_nodes: BTreeMap<String, &Value> =
                walk(schema(&ours, &version)).into_iter().collect();
            for (path, ref_node) in walk(schema(&reference, &version)) {
                let Some(Value::Array(rules)) = ref_node.get("x-kubernetes-validations") else {
                    continue;
                };
                let our_rules = our_nodes
                    .get(&path)
                    .and_then(|n| n.get("x-kubernetes-validations"))
                    .and_then(Value::as_array)
                    .cloned()
                    .unwrap_or_default();
                for rule in rules {
                    assert!(
                        our_rules.contains(rule),
                        "{file} {version} {path}: PKO rule {rule} missing"
                    );
                }
            }
        }
    }
}
