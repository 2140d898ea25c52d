//! The offline commands of the real `pko-operator` binary: `plugin test` (the conformance kit)
//! and `render`. Needs the components built by `make plugins`.

use std::path::Path;
use std::process::{Command, Output};

use k8s_openapi::ByteString;
use k8s_openapi::api::core::v1::ConfigMap;
use kube::api::ObjectMeta;
use pko_tests::operator::operator_binary;
use pko_tests::plugins::{module, plugins_dir, shared_cache_dir};
use pko_tests::repo_root;
use serde_json::{Value, json};

fn run(args: &[&str]) -> Output {
    let binary = operator_binary().expect("pko-operator binary");
    Command::new(binary)
        .args(args)
        .env("RUST_BACKTRACE", "0")
        .env("PLUGIN_CACHE_DIR", shared_cache_dir())
        .output()
        .expect("run pko-operator")
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

#[test]
fn plugin_test_runs_the_fixtures_shipped_with_each_plugin() {
    let _machine = pko_tests::serial::shared_blocking();
    for (dir, name) in [
        ("default-tags", "default_tags"),
        ("naming-policy", "naming_policy"),
        ("resource-allowlist", "resource_allowlist"),
        ("template", "template"),
    ] {
        let cases = repo_root().join("plugins").join(dir).join("tests");
        let wasm = module(name).expect("module").path;
        let out = run(&[
            "plugin",
            "test",
            &cases.display().to_string(),
            "--module",
            &wasm.display().to_string(),
        ]);
        let stdout = text(&out.stdout);
        assert!(out.status.success(), "{dir}: {stdout}{}", text(&out.stderr));
        assert!(stdout.contains(" passed, 0 failed"), "{dir}: {stdout}");
        assert!(!stdout.contains("FAIL"), "{dir}: {stdout}");
    }

    // The wrong module for the cases: every mismatch is reported and the command fails.
    let cases = repo_root().join("plugins/naming-policy/tests");
    let wasm = module("template").expect("module").path;
    let out = run(&[
        "plugin",
        "test",
        &cases.display().to_string(),
        "--module",
        &wasm.display().to_string(),
    ]);
    let stdout = text(&out.stdout);
    assert!(!out.status.success(), "{stdout}");
    assert!(
        stdout.contains("FAIL  every offending key and name is listed"),
        "{stdout}"
    );
    assert!(stdout.contains("expected a rejected error"), "{stdout}");
    assert!(
        text(&out.stderr).contains("case(s) failed"),
        "{}",
        text(&out.stderr)
    );
}

/// A Program, a namespaced transform whose module comes from a ConfigMap manifest, a cluster
/// transform from a file URL selecting the Program's namespace by label, and one selecting
/// nothing.
fn manifests(dir: &Path, trap_policy: Option<&str>) -> std::path::PathBuf {
    let tags = module("default_tags").expect("module");
    let naming = module("naming_policy").expect("module");
    let config_map = ConfigMap {
        metadata: ObjectMeta {
            name: Some("plugins".into()),
            namespace: Some("team-a".into()),
            ..Default::default()
        },
        binary_data: Some([("tags".to_owned(), ByteString(tags.bytes.clone()))].into()),
        ..Default::default()
    };
    let mut docs: Vec<Value> = vec![
        json!({
            "apiVersion": "v1", "kind": "Namespace",
            "metadata": {"name": "team-a", "labels": {"tier": "gold"}},
        }),
        json!({
            "apiVersion": "pulumi.com/v1", "kind": "Program",
            "metadata": {"name": "web", "namespace": "team-a", "labels": {"team": "blue"}},
            "program": {"resources": {"bucket": {"type": "aws:s3/bucket:Bucket", "properties": {"bucket": "logs"}}}},
        }),
        serde_json::to_value(&config_map).expect("configmap json"),
        json!({
            "apiVersion": "pko-rs.dev/v1alpha1", "kind": "ProgramTransform",
            "metadata": {"name": "tags", "namespace": "team-a"},
            "spec": {
                "source": {"configMap": {"name": "plugins", "key": "tags"}},
                "sha256": tags.sha256,
                "priority": 10,
                "config": {"tags": {"managed-by": "pko-rs"}, "fromLabels": {"team": "team"}, "targets": [{"typePrefix": "aws:"}]},
            },
        }),
        json!({
            "apiVersion": "pko-rs.dev/v1alpha1", "kind": "ClusterProgramTransform",
            "metadata": {"name": "naming"},
            "spec": {
                "source": {"url": format!("file://{}", naming.path.display())},
                "sha256": naming.sha256,
                "namespaceSelector": {"matchLabels": {"tier": "gold"}},
                "config": {"mode": "prefix", "nameProperty": "bucket"},
            },
        }),
        json!({
            "apiVersion": "pko-rs.dev/v1alpha1", "kind": "ClusterProgramTransform",
            "metadata": {"name": "elsewhere"},
            "spec": {
                "source": {"url": format!("file://{}", naming.path.display())},
                "sha256": naming.sha256,
                "namespaceSelector": {"matchLabels": {"tier": "free"}},
                "config": {"mode": "prefix"},
            },
        }),
    ];
    if let Some(policy) = trap_policy {
        let trap = module("hostile_trap").expect("module");
        docs.push(json!({
            "apiVersion": "pko-rs.dev/v1alpha1", "kind": "ProgramTransform",
            "metadata": {"name": "broken", "namespace": "team-a"},
            "spec": {
                "source": {"url": format!("file://{}", trap.path.display())},
                "sha256": trap.sha256,
                "priority": 50,
                "failurePolicy": policy,
            },
        }));
    }
    let text: Vec<String> = docs
        .iter()
        .map(|d| serde_json::to_string_pretty(d).expect("json"))
        .collect();
    let path = dir.join("manifests.yaml");
    std::fs::write(&path, text.join("\n---\n")).expect("write manifests");
    path
}

#[test]
fn render_prints_the_transformed_pulumi_yaml_or_a_diff() {
    let _machine = pko_tests::serial::shared_blocking();
    let dir = tempfile::tempdir().expect("tempdir");
    let file = manifests(dir.path(), None);
    let root = plugins_dir().display().to_string();
    let file = file.display().to_string();

    let out = run(&["render", "-f", &file, "--plugin-file-root", &root]);
    let stderr = text(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    let yaml: Value = yaml_serde::from_str(&text(&out.stdout)).expect("Pulumi.yaml");
    assert_eq!(yaml["name"], "web");
    let properties = &yaml["resources"]["bucket"]["properties"];
    assert_eq!(properties["bucket"], "team-a-logs");
    assert_eq!(
        properties["tags"],
        json!({"managed-by": "pko-rs", "team": "blue"})
    );
    // Cluster transform first (priority 0), then the namespaced one (10); `elsewhere` is not
    // selected.
    let applied: Vec<&str> = stderr
        .lines()
        .filter_map(|l| l.strip_prefix("# applied "))
        .map(|l| l.split(' ').next().unwrap_or_default())
        .collect();
    assert_eq!(
        applied,
        [
            "ClusterProgramTransform/naming",
            "ProgramTransform/team-a/tags"
        ],
        "{stderr}"
    );
    assert!(stderr.contains("# artifact digest sha256:"), "{stderr}");

    let out = run(&["render", "-f", &file, "--plugin-file-root", &root, "--diff"]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let diff = text(&out.stdout);
    assert!(
        diff.starts_with("--- Pulumi.yaml (untransformed)\n+++ Pulumi.yaml (transformed)\n"),
        "{diff}"
    );
    assert!(diff.contains("\n-      bucket: logs\n"), "{diff}");
    assert!(diff.contains("\n+      bucket: team-a-logs\n"), "{diff}");
    assert!(diff.contains("\n+        managed-by: pko-rs\n"), "{diff}");
}

#[test]
fn render_reports_a_failing_transform_or_skips_it_under_ignore() {
    let _machine = pko_tests::serial::shared_blocking();
    let dir = tempfile::tempdir().expect("tempdir");
    let root = plugins_dir().display().to_string();

    let file = manifests(dir.path(), Some("Fail")).display().to_string();
    let out = run(&["render", "-f", &file, "--plugin-file-root", &root]);
    let stderr = text(&out.stderr);
    assert!(!out.status.success(), "{}", text(&out.stdout));
    assert!(
        stderr.contains("ProgramTransform/team-a/broken"),
        "{stderr}"
    );
    assert!(stderr.contains("deliberate panic for web"), "{stderr}");

    let file = manifests(dir.path(), Some("Ignore")).display().to_string();
    let out = run(&["render", "-f", &file, "--plugin-file-root", &root]);
    let stderr = text(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    assert!(
        stderr.contains("# skipped ProgramTransform/team-a/broken (failurePolicy Ignore): trap:"),
        "{stderr}"
    );
    let yaml: Value = yaml_serde::from_str(&text(&out.stdout)).expect("Pulumi.yaml");
    assert_eq!(
        yaml["resources"]["bucket"]["properties"]["bucket"],
        "team-a-logs"
    );
}
