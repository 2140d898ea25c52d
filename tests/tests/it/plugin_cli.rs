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
        // The Python and JavaScript twins pass their Rust twin's fixtures.
        ("default-tags", "python_example"),
        ("naming-policy", "js_example"),
    ] {
        let cases = repo_root().join("plugins").join(dir).join("tests");
        let wasm = module(name).expect("module").path;
        let stdout = fixtures_pass(&cases, &wasm, dir);
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

/// Copies the files of `from` (recursively, but not `target/` or `__pycache__/`) into `to`.
fn copy_tree(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).expect("mkdir");
    for entry in std::fs::read_dir(from).expect("read_dir") {
        let entry = entry.expect("entry");
        let name = entry.file_name();
        if name == "target" || name == "__pycache__" {
            continue;
        }
        let path = entry.path();
        if path.is_dir() {
            copy_tree(&path, &to.join(&name));
        } else {
            std::fs::copy(&path, to.join(&name)).expect("copy");
        }
    }
}

/// Runs `command`, failing the test with its output when it fails.
fn must(mut command: Command, what: &str) {
    let out = command.output().unwrap_or_else(|e| panic!("{what}: {e}"));
    assert!(
        out.status.success(),
        "{what}: {}{}",
        text(&out.stdout),
        text(&out.stderr)
    );
}

/// `plugin test CASES --module WASM` passes every case; its report.
fn fixtures_pass(cases: &Path, wasm: &Path, what: &str) -> String {
    let out = run(&[
        "plugin",
        "test",
        &cases.display().to_string(),
        "--module",
        &wasm.display().to_string(),
    ]);
    let stdout = text(&out.stdout);
    assert!(
        out.status.success(),
        "{what}: {stdout}{}",
        text(&out.stderr)
    );
    assert!(stdout.contains(" passed, 0 failed"), "{what}: {stdout}");
    stdout
}

/// A plugin author's own repository: the Rust template, copied outside this one with its
/// standalone manifest and the SDK copied beside it, builds into a component that passes the
/// template's fixtures. The build shares `make plugins`' target
/// folder and lock file, so only the SDK and the template are compiled.
#[test]
fn the_rust_template_builds_outside_the_repository() {
    let _machine = pko_tests::serial::shared_blocking();
    let repo = repo_root();
    let outside = tempfile::tempdir().expect("tempdir");
    let dir = outside.path().join("my-plugin");
    copy_tree(&repo.join("plugins/template"), &dir);
    // The SDK copied beside it, as a vendored dependency or a published crate is: nothing of
    // this repository around it.
    let sdk = outside.path().join("pko-transform-sdk");
    copy_tree(&repo.join("plugins/sdk"), &sdk);
    let manifest = std::fs::read_to_string(dir.join("standalone.Cargo.toml"))
        .expect("standalone manifest")
        .replace(
            r#"{ path = "../pko-rs/plugins/sdk" }"#,
            &format!("{{ path = {:?} }}", sdk.display().to_string()),
        );
    assert!(manifest.contains("pko-transform-sdk\" }"), "{manifest}");
    std::fs::write(dir.join("Cargo.toml"), manifest).expect("manifest");
    std::fs::copy(repo.join("plugins/Cargo.lock"), dir.join("Cargo.lock")).expect("lock");
    // The template's toolchain file pins the repository's toolchain: the copy never falls back
    // to the machine's default toolchain (which may lack the target, or be another version).
    let toolchain = std::fs::read_to_string(dir.join("standalone.rust-toolchain.toml"))
        .expect("standalone toolchain file");
    let pinned = std::fs::read_to_string(repo.join("rust-toolchain.toml")).expect("toolchain");
    let channel = |text: &str| {
        text.lines()
            .find(|l| l.starts_with("channel"))
            .map(str::to_owned)
    };
    let pinned_channel = channel(&pinned);
    assert_eq!(
        channel(&toolchain),
        pinned_channel,
        "plugins/template/standalone.rust-toolchain.toml pins another toolchain than rust-toolchain.toml"
    );
    std::fs::write(dir.join("rust-toolchain.toml"), toolchain).expect("toolchain file");
    let release = pinned_channel
        .and_then(|l| l.split('"').nth(1).map(str::to_owned))
        .expect("the pinned channel");
    // A folder per toolchain: artifacts of another compiler are never mixed in.
    let target = plugins_dir()
        .ancestors()
        .nth(2)
        .map(|d| d.join(format!("out-of-tree-{release}")))
        .expect("plugins target dir");
    // rustup's `cargo` on the PATH, as in an author's shell, on the toolchain the copy's file
    // pins (checked equal above). (`$CARGO`, this toolchain's binary itself, would leave each
    // dependency's `rustc` to the machine's default toolchain.)
    let mut cargo = Command::new("cargo");
    cargo
        .current_dir(&dir)
        .args(["build", "--release", "--target", "wasm32-wasip2", "--quiet"])
        .env("CARGO_TARGET_DIR", &target)
        // Every nested rustup call (each crate's rustc, build scripts probing rustc) on the
        // pinned toolchain: run from a registry folder, a rustc would resolve the default one.
        .env("RUSTUP_TOOLCHAIN", &release)
        .env_remove("RUSTC")
        .env_remove("CARGO");
    must(cargo, "cargo build of the template outside the repository");
    // Built by the pinned toolchain: cargo records the `rustc -vV` it used in the target dir.
    let used = std::fs::read_to_string(target.join(".rustc_info.json")).expect("rustc info");
    assert!(
        used.contains(&format!("release: {release}\\n")),
        "the copy was not built by rustc {release}: {used:.600}"
    );
    let wasm = target.join("wasm32-wasip2/release/template.wasm");
    fixtures_pass(&dir.join("tests"), &wasm, "out-of-tree template");
}

/// The Python and JavaScript plugins, copied outside this repository, build with their
/// toolchains alone (componentize-py, componentize-js: no script or file of this repository)
/// and pass their Rust twins' fixtures.
#[test]
fn python_and_javascript_plugins_build_outside_the_repository() {
    let _machine = pko_tests::serial::shared_blocking();
    let repo = repo_root();
    let outside = tempfile::tempdir().expect("tempdir");
    let toolchain = |kind: &str| {
        let out = Command::new(repo.join("tools/guest-plugins.sh"))
            .args(["install", kind])
            .output()
            .expect("install");
        assert!(out.status.success(), "{}", text(&out.stderr));
        let out = Command::new(repo.join("tools/guest-plugins.sh"))
            .args(["dir", kind])
            .output()
            .expect("dir");
        std::path::PathBuf::from(text(&out.stdout).trim())
    };

    let py = outside.path().join("py");
    copy_tree(&repo.join("plugins/python-example"), &py);
    let mut build = Command::new(toolchain("py").join("componentize-py"));
    build
        .current_dir(&py)
        .args([
            "-q",
            "-d",
            "wit",
            "-w",
            "plugin",
            "componentize",
            "app",
            "-p",
            ".",
        ])
        .args(["-o", "my_plugin.wasm"]);
    must(build, "componentize-py outside the repository");
    fixtures_pass(
        &repo.join("plugins/default-tags/tests"),
        &py.join("my_plugin.wasm"),
        "python",
    );

    let js = outside.path().join("js");
    copy_tree(&repo.join("plugins/js-example"), &js);
    let mut build = Command::new(toolchain("js").join("componentize-js"));
    build
        .current_dir(&js)
        .args([
            "plugin.js",
            "--wit",
            "wit",
            "-n",
            "plugin",
            "--disable",
            "http",
        ])
        .args(["fetch-event", "-o", "my_plugin.wasm"]);
    must(build, "componentize-js outside the repository");
    fixtures_pass(
        &repo.join("plugins/naming-policy/tests"),
        &js.join("my_plugin.wasm"),
        "javascript",
    );
}
