//! The operator binary refuses, before it starts anything, a configuration whose memory
//! budgets cannot fit the container.
#![allow(
    clippy::disallowed_methods,
    reason = "a test process is configured by its environment (make sets the tool and fixture paths)"
)]

use std::process::Command;

fn operator(args: &[&str]) -> (bool, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_pko-operator"))
        .args(args)
        // Nothing may reach an apiserver: the refusal comes first.
        .env("KUBECONFIG", "/nonexistent/kubeconfig")
        .env_remove("MEMORY_LIMIT")
        .env_remove("PLUGIN_MEMORY_BUDGET_MIB")
        .env_remove("ARTIFACT_CACHE_BYTES")
        .output()
        .expect("operator runs");
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn budgets_over_the_memory_limit_are_refused_with_every_term() {
    let (ok, stderr) = operator(&["--memory-limit=512Mi", "--plugin-memory-budget-mib=512"]);
    assert!(!ok, "{stderr}");
    for part in [
        "container has 512 MiB",
        "plugin budget 512 MiB",
        "artifact cache 128 MiB",
        "--plugin-memory-budget-mib",
    ] {
        assert!(stderr.contains(part), "{part}: {stderr}");
    }
    let (ok, stderr) = operator(&["--memory-limit=lots"]);
    assert!(!ok);
    assert!(stderr.contains("invalid memory quantity"), "{stderr}");
}
