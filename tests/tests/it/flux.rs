//! Flux sources watched per kind, on the real control plane with Flux's `GitRepository` and
//! `OCIRepository` kinds installed (see `pko_tests::flux`): a Stack on each deploys the
//! source's artifact, and a new artifact revision runs each again. The fallback poll of a
//! watched kind is ten minutes, longer than these tests wait, so only the watch can bring the
//! second Update. The `OCIRepository` Stack names `v1beta2` while the operator watches the
//! version the apiserver prefers (`v1`): one watch per kind, whatever version a Stack spells.

use std::time::Duration;

use kube::Api;
use kube::api::PostParams;
use pko_api::program::Program;
use pko_api::stack::Stack;
use pko_api::update::Update;
use pko_tests::execution::Execution;
use pko_tests::flux::Sources;
use pko_tests::{fixtures, wait_for};
use serde_json::json;

const WAIT: Duration = Duration::from_secs(120);

#[tokio::test]
async fn a_new_artifact_of_a_watched_flux_source_runs_its_stacks() {
    let _machine = pko_tests::serial::shared().await;
    let e = Execution::start("flux-watch", &[]).await;
    let (plane, ns, kubelet) = (e.plane, e.ns.clone(), &e.kubelet);
    pko_tests::flux::install_crds(plane.client(), WAIT)
        .await
        .expect("Flux CRDs");
    // Any Flux-style artifact will do: Programs', served by the operator.
    let programs: Api<Program> = Api::namespaced(plane.client(), &ns);
    let mut artifacts = Vec::new();
    for word in ["one", "two"] {
        let spec = json!({"outputs": {"message": format!("from-{word}")}});
        let artifact = fixtures::published_program(&programs, word, spec, WAIT)
            .await
            .expect("artifact");
        artifacts.push(artifact);
    }
    let (one, two) = (&artifacts[0], &artifacts[1]);
    let git = Sources::new(plane.client(), &ns, "GitRepository", "v1");
    let oci = Sources::new(plane.client(), &ns, "OCIRepository", "v1beta2");
    git.create("repo", (&one.0, &one.1, "main@sha1:1111"))
        .await
        .expect("GitRepository");
    oci.create("image", (&one.0, &one.1, "latest@sha256:1111"))
        .await
        .expect("OCIRepository");

    let stacks: Api<Stack> = Api::namespaced(plane.client(), &ns);
    let backend = e.tmp.path().join("backend");
    for (name, stack, api_version, kind, source) in [
        (
            "from-git",
            "git",
            "source.toolkit.fluxcd.io/v1",
            "GitRepository",
            "repo",
        ),
        (
            "from-oci",
            "oci",
            "source.toolkit.fluxcd.io/v1beta2",
            "OCIRepository",
            "image",
        ),
    ] {
        let spec = json!({
            "stack": stack,
            "fluxSource": {"sourceRef": {"apiVersion": api_version, "kind": kind, "name": source}},
        });
        stacks
            .create(
                &PostParams::default(),
                &fixtures::file_backend_stack(name, &backend, spec),
            )
            .await
            .expect("stack");
    }
    let deployed = |name: &'static str, message: &'static str| {
        let stacks = stacks.clone();
        async move {
            wait_for(&format!("{name} to deploy {message}"), WAIT, || async {
                let status = stacks.get(name).await.ok()?.status?;
                let ready = status
                    .conditions
                    .iter()
                    .any(|c| c.type_ == "Ready" && c.status == "True");
                (ready && status.outputs.get("message") == Some(&json!(message))).then_some(status)
            })
            .await
        }
    };
    for name in ["from-git", "from-oci"] {
        if let Err(err) = deployed(name, "from-one").await {
            panic!(
                "{err}: {:?}\n{}\n{}",
                stacks.get(name).await.ok().and_then(|s| s.status),
                kubelet.logs(name),
                e.operator.log_text()
            );
        }
    }
    // Both kinds are watched; the OCIRepository at the version the apiserver prefers (v1),
    // though its Stack names v1beta2.
    let log = wait_for("both kinds to be watched", WAIT, || async {
        let log = e.operator.log_text();
        (log.contains("watching Flux sources")
            && log.contains("GitRepository")
            && log.contains("OCIRepository"))
        .then_some(log)
    })
    .await
    .expect("watches");
    let oci_watch = log
        .lines()
        .find(|l| l.contains("watching Flux sources") && l.contains("OCIRepository"))
        .expect("the OCIRepository watch");
    assert!(oci_watch.contains("v1"), "{oci_watch}");
    assert!(!oci_watch.contains("v1beta2"), "{oci_watch}");

    // New revisions: each stack runs again, within the tests' wait, well before the poll.
    git.set_artifact("repo", (&two.0, &two.1, "main@sha1:2222"))
        .await
        .expect("new git artifact");
    oci.set_artifact("image", (&two.0, &two.1, "latest@sha256:2222"))
        .await
        .expect("new oci artifact");
    for name in ["from-git", "from-oci"] {
        let status = match deployed(name, "from-two").await {
            Ok(status) => status,
            Err(err) => panic!(
                "{err}: {:?}\n{}\n{}",
                stacks.get(name).await.ok().and_then(|s| s.status),
                kubelet.logs(name),
                e.operator.log_text()
            ),
        };
        let last = status.last_update.expect("last update");
        assert_eq!(last.last_successful_commit.as_deref(), Some(two.1.as_str()));
    }
    let updates: Api<Update> = Api::namespaced(plane.client(), &ns);
    let runs = updates.list(&Default::default()).await.expect("updates");
    assert_eq!(runs.items.len(), 4, "two Updates per stack");
}
