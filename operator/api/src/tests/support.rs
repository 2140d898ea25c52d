//! Loading of the PKO fixtures and schema walking shared by the tests.

use std::path::PathBuf;
use std::sync::OnceLock;

use serde::Deserialize;
use serde_json::Value;

/// `tests/fixtures` of the workspace.
pub fn fixtures_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures")
}

/// The documents of a multi-document YAML text (split at `---` lines), each parsed on its own
/// so one malformed document does not hide the others. PKO's
/// `stack-examples/yaml/git_auth_with_references.yaml` has a Secret that is not valid YAML.
pub fn yaml_documents_lenient(text: &str) -> Vec<(String, Result<Value, String>)> {
    let mut docs = vec![String::new()];
    for line in text.lines() {
        if line.trim_end() == "---" || line.starts_with("--- ") {
            docs.push(String::new());
        } else if let Some(doc) = docs.last_mut() {
            doc.push_str(line);
            doc.push('\n');
        }
    }
    docs.into_iter()
        .filter(|d| {
            d.lines()
                .any(|l| !l.trim().is_empty() && !l.trim_start().starts_with('#'))
        })
        .map(|d| {
            let parsed = yaml_serde::from_str::<Value>(&d).map_err(|e| e.to_string());
            (d, parsed)
        })
        .collect()
}

/// `deploy/crds` of the workspace.
pub fn deploy_crds_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../deploy/crds")
}

/// Every YAML document of a file, as JSON.
pub fn yaml_documents(path: &std::path::Path) -> Vec<Value> {
    let text = std::fs::read_to_string(path)
        .unwrap_or_else(|e| panic!("cannot read {}: {e}", path.display()));
    yaml_serde::Deserializer::from_str(&text)
        .map(|doc| {
            Value::deserialize(doc)
                .unwrap_or_else(|e| panic!("cannot parse {}: {e}", path.display()))
        })
        .filter(|v| !v.is_null())
        .collect()
}

/// PKO's CRD stored in `file` (e.g. `pulumi.com_stacks.yaml`).
pub fn reference_crd(file: &str) -> Value {
    let path = fixtures_dir().join("pko-v2.9-crds").join(file);
    yaml_documents(&path)
        .into_iter()
        .next()
        .unwrap_or_else(|| panic!("{} is empty", path.display()))
}

/// Our CRD for `file`, as JSON (generated once per test binary: it takes seconds unoptimized).
pub fn our_crd(file: &str) -> Value {
    static CRDS: OnceLock<Vec<(String, Value)>> = OnceLock::new();
    let crds = CRDS.get_or_init(|| {
        crate::crdgen::crds()
            .into_iter()
            .map(|(name, crd)| (name, serde_json::to_value(crd).expect("CRD serializes")))
            .collect()
    });
    crds.iter()
        .find(|(name, _)| name == file)
        .map(|(_, crd)| crd.clone())
        .unwrap_or_else(|| panic!("no generated CRD named {file}"))
}

/// The CRD files PKO ships, which we ship too.
pub const CRD_FILES: [&str; 4] = [
    "auto.pulumi.com_updates.yaml",
    "auto.pulumi.com_workspaces.yaml",
    "pulumi.com_programs.yaml",
    "pulumi.com_stacks.yaml",
];

/// The `versions[]` entry named `version` of a CRD.
pub fn version<'a>(crd: &'a Value, version: &str) -> &'a Value {
    crd["spec"]["versions"]
        .as_array()
        .and_then(|vs| vs.iter().find(|v| v["name"] == version))
        .unwrap_or_else(|| panic!("CRD {} has no version {version}", crd["metadata"]["name"]))
}

/// The names of the versions of a CRD.
pub fn version_names(crd: &Value) -> Vec<String> {
    crd["spec"]["versions"]
        .as_array()
        .map(|vs| {
            vs.iter()
                .filter_map(|v| v["name"].as_str().map(str::to_owned))
                .collect()
        })
        .unwrap_or_default()
}

/// The openAPIV3Schema of a version.
pub fn schema<'a>(crd: &'a Value, name: &str) -> &'a Value {
    &version(crd, name)["schema"]["openAPIV3Schema"]
}

/// Every schema node reachable from `schema` through `properties` (`.name`), `items` (`[]`)
/// and `additionalProperties` (`{}`), with its path; the root has the empty path.
pub fn walk(schema: &Value) -> Vec<(String, &Value)> {
    fn go<'a>(node: &'a Value, path: String, out: &mut Vec<(String, &'a Value)>) {
        out.push((path.clone(), node));
        if let Some(props) = node.get("properties").and_then(Value::as_object) {
            for (name, prop) in props {
                go(prop, format!("{path}.{name}"), out);
            }
        }
        if let Some(items) = node.get("items").filter(|v| v.is_object()) {
            go(items, format!("{path}[]"), out);
        }
        if let Some(ap) = node.get("additionalProperties").filter(|v| v.is_object()) {
            go(ap, format!("{path}{{}}"), out);
        }
    }
    let mut out = Vec::new();
    go(schema, String::new(), &mut out);
    out
}
