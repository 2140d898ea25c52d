//! Names, scope, categories, versions, subresources and printer columns equal PKO's (the
//! Program's columns but for one documented deviation).

use serde_json::Value;

use super::support::{CRD_FILES, our_crd, reference_crd, version, version_names};

#[test]
fn names_scope_and_categories_equal_pko() {
    for file in CRD_FILES {
        let reference = reference_crd(file);
        let ours = our_crd(file);
        assert_eq!(
            ours["metadata"]["name"], reference["metadata"]["name"],
            "{file}: CRD name"
        );
        for key in ["group", "names", "scope"] {
            assert_eq!(
                ours["spec"][key], reference["spec"][key],
                "{file}: spec.{key}"
            );
        }
        assert_eq!(
            ours["spec"]["names"]["categories"],
            serde_json::json!(["pulumi"])
        );
        assert!(
            ours["spec"]["names"].get("shortNames").is_none(),
            "{file}: no short names"
        );
    }
}

#[test]
fn versions_subresources_and_printer_columns_equal_pko() {
    for file in CRD_FILES {
        let reference = reference_crd(file);
        let ours = our_crd(file);
        assert_eq!(
            version_names(&ours),
            version_names(&reference),
            "{file}: versions"
        );
        for name in version_names(&reference) {
            let (r, o) = (version(&reference, &name), version(&ours, &name));
            for key in ["served", "storage", "subresources"] {
                assert_eq!(
                    o.get(key),
                    r.get(key),
                    "{file} {name}: {key} differs from PKO"
                );
            }
            let mut columns = r.get("additionalPrinterColumns").cloned();
            if file == "pulumi.com_programs.yaml" {
                columns = columns.map(programs_columns);
            }
            assert_eq!(
                o.get("additionalPrinterColumns"),
                columns.as_ref(),
                "{file} {name}: printer columns differ from PKO's (and the Program's deviation)"
            );
        }
    }
}

/// PKO's Program columns with the one deviation (docs/migrating-from-pko.md): a `Ready` column
/// first, as GitOps users read health there, and the artifact URL, which carries a token, only
/// at `-o wide`.
fn programs_columns(pkos: Value) -> Value {
    let mut columns = vec![serde_json::json!({
        "jsonPath": ".status.conditions[?(@.type==\"Ready\")].status",
        "name": "Ready",
        "type": "string",
    })];
    for mut column in pkos.as_array().cloned().unwrap_or_default() {
        if column["name"] == "URL" {
            column["priority"] = serde_json::json!(1);
        }
        columns.push(column);
    }
    Value::Array(columns)
}

/// The deprecated `v1alpha1` Stack warns its users (PKO only says so in the description).
#[test]
fn stack_v1alpha1_is_marked_deprecated() {
    let ours = our_crd("pulumi.com_stacks.yaml");
    assert_eq!(version(&ours, "v1alpha1")["deprecated"], Value::Bool(true));
    assert!(version(&ours, "v1").get("deprecated").is_none());
}
