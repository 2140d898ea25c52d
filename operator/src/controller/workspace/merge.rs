//! Strategic merge of a pod template overlay onto the generated pod template, on JSON.
//!
//! Kubernetes' strategic merge patch, reduced to what pod templates need: objects merge key by
//! key, `null` deletes, lists with a merge key (containers by `name`, volume mounts by
//! `mountPath`, …) merge item by item, every other list is replaced. Order follows PKO: for
//! merged lists the overlay's items come first, except init containers, where the generated
//! ones stay first (PKO's `$setElementOrder/initContainers`) so the agent is bootstrapped before
//! any user init container runs.

use serde_json::{Map, Value};

/// Merge key of the list under `field`, as in the Kubernetes API's patch strategy markers.
fn merge_key(field: &str) -> Option<&'static str> {
    match field {
        "containers"
        | "initContainers"
        | "ephemeralContainers"
        | "volumes"
        | "env"
        | "imagePullSecrets"
        | "resourceClaims" => Some("name"),
        "readinessGates" => Some("conditionType"),
        "volumeMounts" => Some("mountPath"),
        "volumeDevices" => Some("devicePath"),
        "ports" => Some("containerPort"),
        "hostAliases" => Some("ip"),
        "topologySpreadConstraints" => Some("topologyKey"),
        _ => None,
    }
}

/// Merges `overlay` into `base` (both JSON objects of the same kind).
pub fn merge(base: &mut Value, overlay: &Value) {
    merge_field(None, base, overlay);
}

fn merge_field(field: Option<&str>, base: &mut Value, overlay: &Value) {
    match (base, overlay) {
        (Value::Object(b), Value::Object(o)) => merge_objects(b, o),
        (Value::Array(b), Value::Array(o)) => match field.and_then(merge_key) {
            Some(key) => {
                let keep_base_first = field == Some("initContainers");
                *b = merge_lists(std::mem::take(b), o, key, keep_base_first);
            }
            None => *b = o.clone(),
        },
        (b, o) => *b = o.clone(),
    }
}

fn merge_objects(base: &mut Map<String, Value>, overlay: &Map<String, Value>) {
    for (k, v) in overlay {
        if v.is_null() {
            base.remove(k);
            continue;
        }
        match base.get_mut(k) {
            Some(existing) => merge_field(Some(k), existing, v),
            None => {
                base.insert(k.clone(), v.clone());
            }
        }
    }
}

fn merge_lists(
    base: Vec<Value>,
    overlay: &[Value],
    key: &str,
    keep_base_first: bool,
) -> Vec<Value> {
    let key_of = |v: &Value| v.get(key).cloned();
    let mut base: Vec<Option<Value>> = base.into_iter().map(Some).collect();
    let mut merged_overlay = Vec::new();
    for item in overlay {
        let found = key_of(item).and_then(|k| {
            base.iter()
                .position(|b| b.as_ref().is_some_and(|b| key_of(b).as_ref() == Some(&k)))
        });
        match found {
            Some(i) => {
                let mut b = base[i].take().unwrap_or(Value::Null);
                merge_field(None, &mut b, item);
                if keep_base_first {
                    base[i] = Some(b);
                } else {
                    merged_overlay.push(b);
                }
            }
            None => merged_overlay.push(item.clone()),
        }
    }
    let rest = base.into_iter().flatten();
    if keep_base_first {
        rest.chain(merged_overlay).collect()
    } else {
        merged_overlay.into_iter().chain(rest).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn names(v: &Value) -> Vec<&str> {
        v.as_array()
            .into_iter()
            .flatten()
            .filter_map(|c| c.get("name").and_then(Value::as_str))
            .collect()
    }

    // PKO's TestMergePodTemplateSpec cases.
    #[test]
    fn container_env_merges_overlay_first() {
        let mut base = json!({"spec": {"containers": [{"name": "pulumi", "env": [{"name": "FOO", "value": "1"}]}]}});
        merge(
            &mut base,
            &json!({"spec": {"containers": [{"name": "pulumi", "env": [{"name": "BAR", "value": "2"}]}]}}),
        );
        assert_eq!(names(&base["spec"]["containers"][0]["env"]), ["BAR", "FOO"]);
    }

    #[test]
    fn extra_container_comes_first() {
        let mut base = json!({"spec": {"containers": [{"name": "pulumi"}]}});
        merge(
            &mut base,
            &json!({"spec": {"containers": [{"name": "extra"}]}}),
        );
        assert_eq!(names(&base["spec"]["containers"]), ["extra", "pulumi"]);
    }

    #[test]
    fn init_containers_keep_generated_ones_first() {
        let mut base =
            json!({"spec": {"initContainers": [{"name": "bootstrap"}, {"name": "fetch"}]}});
        merge(
            &mut base,
            &json!({"spec": {"initContainers": [{"name": "overlay"}, {"name": "fetch", "image": "x"}, {"name": "another"}]}}),
        );
        assert_eq!(
            names(&base["spec"]["initContainers"]),
            ["bootstrap", "fetch", "overlay", "another"]
        );
        assert_eq!(base["spec"]["initContainers"][1]["image"], "x");
    }

    #[test]
    fn mounts_merge_by_path_and_other_lists_are_replaced_and_null_deletes() {
        let mut base = json!({"spec": {
            "containers": [{"name": "pulumi", "volumeMounts": [{"name": "share", "mountPath": "/share"}], "args": ["a"]}],
            "nodeSelector": {"a": "b"},
        }});
        merge(
            &mut base,
            &json!({"spec": {
                "containers": [{"name": "pulumi", "volumeMounts": [{"name": "test", "mountPath": "/test"}], "args": ["b"]}],
                "nodeSelector": null,
            }}),
        );
        let c = &base["spec"]["containers"][0];
        assert_eq!(c["volumeMounts"].as_array().map(Vec::len), Some(2));
        assert_eq!(c["args"], json!(["b"]));
        assert!(base["spec"].get("nodeSelector").is_none());
    }
}
