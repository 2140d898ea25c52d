//! End to end on a real node ([`pko_tests::node`]): kubelet, containerd, CNI, kube-proxy,
//! CoreDNS, controller-manager, scheduler and kube-network-policies, with the images
//! `make image` builds pulled from a private registry.
//!
//! One node serves every test of this module (its start is the costly part); the tests take
//! [`NODE_LOCK`] so one scenario's operator restarts never meet another's.

use std::time::Duration;

use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, PostParams};
use pko_tests::node::{Node, image_layout};
use pko_tests::{serial, wait_for};
use serde_json::json;

/// One scenario at a time on the shared node.
static NODE_LOCK: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

const POD_TIMEOUT: Duration = Duration::from_secs(180);

async fn node() -> &'static Node {
    Node::shared().await.unwrap_or_else(|e| panic!("{e}"))
}

/// The node is Ready and runs a pod from our own agent image (pulled from the node's registry,
/// sandboxed by the pause image the harness builds) to completion.
#[tokio::test]
async fn node_runs_a_pod_from_our_image() {
    let _machine = serial::shared().await;
    let _node = NODE_LOCK.lock().await;
    let node = node().await;
    let ns = node
        .plane()
        .namespace("e2e-smoke")
        .await
        .expect("namespace");
    // A pod of the pause image: sandbox, bridge network and image pulls work.
    idle_pod(node, &ns, "idle").await;
    let agent = node
        .push_layout(
            &image_layout("pko-rs-agent").expect("agent image"),
            "pko-rs-agent",
        )
        .await
        .expect("push the agent image");
    let client = node.plane().client();
    let pods: Api<Pod> = Api::namespaced(client, &ns);
    let pod: Pod = serde_json::from_value(json!({
        "metadata": {"name": "version"},
        "spec": {
            "restartPolicy": "Never",
            "containers": [{
                "name": "agent",
                "image": agent,
                // The image has no entrypoint (PKO's manager runs its own commands in it).
                "command": ["/usr/local/bin/pko-agent", "--version"],
                "securityContext": {"runAsNonRoot": true, "readOnlyRootFilesystem": true,
                    "allowPrivilegeEscalation": false, "capabilities": {"drop": ["ALL"]}},
            }],
        }
    }))
    .expect("pod");
    pods.create(&PostParams::default(), &pod)
        .await
        .expect("create the pod");
    let phase = wait_for("the pod to end", POD_TIMEOUT, || {
        let pods = pods.clone();
        async move {
            let pod = pods.get("version").await.ok()?;
            let phase = pod.status?.phase?;
            matches!(phase.as_str(), "Succeeded" | "Failed").then_some(phase)
        }
    })
    .await
    .unwrap_or_else(|e| {
        panic!(
            "{e}\nkubelet:\n{}\ncontainerd:\n{}",
            node.log_tail("kubelet"),
            node.log_tail("containerd")
        )
    });
    assert_eq!(phase, "Succeeded", "kubelet:\n{}", node.log_tail("kubelet"));
    let logs = pods
        .logs("version", &Default::default())
        .await
        .expect("logs");
    assert!(logs.contains("pko-agent"), "{logs}");
}

/// An idle pod (the pause image) in `ns`, Running.
async fn idle_pod(node: &Node, ns: &str, name: &str) {
    let pods: Api<Pod> = Api::namespaced(node.plane().client(), ns);
    let pod: Pod = serde_json::from_value(json!({
        "metadata": {"name": name},
        "spec": {"containers": [{"name": "idle", "image": node.pause_image(),
            "securityContext": {"runAsNonRoot": true, "allowPrivilegeEscalation": false,
                "capabilities": {"drop": ["ALL"]}}}]}
    }))
    .expect("pod");
    pods.create(&PostParams::default(), &pod)
        .await
        .expect("create");
    wait_for(&format!("pod {ns}/{name} Running"), POD_TIMEOUT, || {
        let pods = pods.clone();
        async move {
            let p = pods.get(name).await.ok()?;
            (p.status?.phase? == "Running").then_some(())
        }
    })
    .await
    .unwrap_or_else(|e| panic!("{e}\nkubelet:\n{}", node.log_tail("kubelet")));
}
