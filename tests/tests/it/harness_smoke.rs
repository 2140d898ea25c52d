//! Smoke tests of the control-plane harness itself: the shared plane, its kubeconfig, CRD
//! install, namespaces, and that child processes never outlive the tests.

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::Namespace;
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::Api;
use pko_tests::{ControlPlane, StartOptions, process_alive, repo_root, spawn_guarded, wait_for};

/// Set in the child process of `spawned_child_dies_with_parent_process`.
const CHILD_MODE_ENV: &str = "PKO_TESTS_HARNESS_CHILD_MODE";

fn wait_gone(pid: u32, within: Duration) -> bool {
    let deadline = Instant::now() + within;
    while Instant::now() < deadline {
        if !process_alive(pid) {
            return true;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    !process_alive(pid)
}

#[tokio::test]
async fn shared_plane_answers_version() {
    let _machine = pko_tests::serial::shared().await;
    let plane = ControlPlane::shared().await;
    let version = plane.client().apiserver_version().await.expect("/version");
    assert_eq!(version.major, "1");
    assert!(
        plane.server_url().starts_with("https://127.0.0.1:"),
        "{}",
        plane.server_url()
    );
    // Same plane on every call.
    assert!(std::ptr::eq(plane, ControlPlane::shared().await));
}

#[tokio::test]
async fn kubeconfig_works_with_kubectl() {
    let _machine = pko_tests::serial::shared().await;
    let plane = ControlPlane::shared().await;
    let out = plane
        .kubectl()
        .args(["get", "ns", "-o", "name"])
        .output()
        .expect("run kubectl");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "kubectl failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(stdout.lines().any(|l| l == "namespace/default"), "{stdout}");
}

#[tokio::test]
async fn namespaces_are_distinct_and_exist() {
    let _machine = pko_tests::serial::shared().await;
    let plane = ControlPlane::shared().await;
    let a = plane.namespace("smoke").await.expect("namespace a");
    let b = plane.namespace("smoke").await.expect("namespace b");
    assert_ne!(a, b);
    for name in [&a, &b] {
        let (prefix, suffix) = name.rsplit_once('-').expect("suffix");
        assert_eq!(prefix, "smoke");
        assert_eq!(suffix.len(), 6);
        assert!(
            suffix
                .chars()
                .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit())
        );
    }
    let api: Api<Namespace> = Api::all(plane.client());
    for name in [&a, &b] {
        let ns = api.get(name).await.expect("namespace exists");
        let labels = ns.metadata.labels.unwrap_or_default();
        assert_eq!(labels.get("pko-tests").map(String::as_str), Some("true"));
    }
}

/// The CRDs of `deploy/crds` are Established on the shared plane; with none there yet, the
/// PKO v2.9 CRDs from the fixtures are installed instead (including the ~1.5 MB Stack CRD,
/// which must fit etcd's request limit).
#[tokio::test]
async fn crds_are_established() {
    let _machine = pko_tests::serial::shared().await;
    let plane = ControlPlane::shared().await;
    let deploy = repo_root().join("deploy/crds");
    let has_deploy_crds = std::fs::read_dir(&deploy)
        .map(|mut d| d.any(|e| e.is_ok_and(|e| e.path().extension().is_some_and(|x| x == "yaml"))))
        .unwrap_or(false);
    if !has_deploy_crds {
        let fixtures = repo_root().join("tests/fixtures/pko-v2.9-crds");
        assert!(fixtures.is_dir(), "{} is missing", fixtures.display());
        plane
            .install_crds(&fixtures)
            .await
            .expect("install fixture CRDs");
    }
    let api: Api<CustomResourceDefinition> = Api::all(plane.client());
    for name in [
        "programs.pulumi.com",
        "stacks.pulumi.com",
        "workspaces.auto.pulumi.com",
        "updates.auto.pulumi.com",
    ] {
        let crd = api.get(name).await.expect(name);
        let established = crd
            .status
            .and_then(|s| s.conditions)
            .unwrap_or_default()
            .iter()
            .any(|c| c.type_ == "Established" && c.status == "True");
        assert!(established, "{name} is not Established");
    }
    // Installing again is an idempotent apply.
    if has_deploy_crds {
        plane.install_crds(&deploy).await.expect("re-apply");
    }
}

#[tokio::test]
async fn wait_for_names_what_it_waited_for() {
    let _machine = pko_tests::serial::shared().await;
    let err = wait_for("the impossible", Duration::from_millis(100), || async {
        None::<()>
    })
    .await
    .expect_err("must time out");
    assert!(err.to_string().contains("the impossible"), "{err}");
    let value = wait_for("a value", Duration::from_secs(1), || async { Some(7) })
        .await
        .expect("ready at once");
    assert_eq!(value, 7);
}

#[test]
fn dropped_guard_kills_child() {
    let _machine = pko_tests::serial::shared_blocking();
    let dir = tempfile::tempdir().expect("tempdir");
    let mut cmd = Command::new("sleep");
    cmd.arg("1000");
    let guard = spawn_guarded(cmd, "sleep", &dir.path().join("sleep.log")).expect("spawn");
    let pid = guard.pid();
    assert!(process_alive(pid));
    drop(guard);
    assert!(
        wait_gone(pid, Duration::from_secs(2)),
        "sleep {pid} survived its guard"
    );
}

/// Runs this test binary again in a child mode that spawns `sleep` through the harness and
/// then hangs; `kill -9` of that process must take the sleep with it (death signal).
#[test]
fn spawned_child_dies_with_parent_process() {
    let _machine = pko_tests::serial::shared_blocking();
    if let Some(dir) = std::env::var_os(CHILD_MODE_ENV) {
        let mut cmd = Command::new("sleep");
        cmd.arg("1000");
        let log = std::path::Path::new(&dir).join("sleep.log");
        let guard = spawn_guarded(cmd, "sleep", &log).expect("spawn");
        println!("\nCHILD_PID={}", guard.pid());
        // Forget the guard: only the kernel's death signal may stop the sleep.
        std::mem::forget(guard);
        loop {
            std::thread::sleep(Duration::from_secs(60));
        }
    }

    let logs = tempfile::tempdir().expect("tempdir");
    let exe = std::env::current_exe().expect("current exe");
    let mut parent = Command::new(exe)
        .args([
            // The test's full name in the one integration binary (module path, then name).
            "harness_smoke::spawned_child_dies_with_parent_process",
            "--exact",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(CHILD_MODE_ENV, logs.path())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("run the test binary in child mode");
    let stdout = parent.stdout.take().expect("stdout");
    let mut pid = None;
    for line in BufReader::new(stdout).lines() {
        let line = line.expect("read child output");
        // libtest prints the test name on the same line before the output.
        if let Some((_, p)) = line.split_once("CHILD_PID=") {
            pid = Some(p.trim().parse::<u32>().expect("pid"));
            break;
        }
    }
    let pid = pid.expect("child mode printed no PID");
    assert!(process_alive(pid));
    parent.kill().expect("kill -9 the parent");
    parent.wait().expect("reap the parent");
    assert!(
        wait_gone(pid, Duration::from_secs(5)),
        "sleep {pid} outlived its killed parent"
    );
}

/// A private plane starts next to the shared one, in its own folder, and stops on drop.
#[tokio::test]
async fn private_plane_starts_and_stops() {
    let _machine = pko_tests::serial::shared().await;
    let state = tempfile::tempdir().expect("tempdir");
    let dir = state.path().join("plane");
    let plane = ControlPlane::start(StartOptions {
        dir: Some(dir.clone()),
        crds_dir: Some(state.path().join("no-crds")),
        ..StartOptions::default()
    })
    .await
    .expect("start");
    assert_eq!(plane.dir(), dir);
    assert!(plane.kubeconfig_path().is_file());
    plane.client().apiserver_version().await.expect("/version");
    let pids: Vec<u32> = ["etcd", "kube-apiserver"]
        .iter()
        .map(|name| {
            std::fs::read_to_string(dir.join(format!("{name}.pid")))
                .expect("pid file")
                .trim()
                .parse()
                .expect("pid")
        })
        .collect();
    drop(plane);
    for pid in pids {
        assert!(wait_gone(pid, Duration::from_secs(5)), "{pid} survived");
    }
    assert!(
        dir.join("logs/kube-apiserver.log").is_file(),
        "state folder is kept"
    );
}
