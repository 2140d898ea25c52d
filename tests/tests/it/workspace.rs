//! Workspace controller on the real control plane, with the harness as kubelet running the real
//! agent and pulumi CLI: the agent comes up, stacks are configured over RPC (a config change does
//! not restart the pod), a corrupted artifact and a root pod template are reported.

use std::time::Duration;

use k8s_openapi::api::apps::v1::StatefulSet;
use k8s_openapi::api::core::v1::Service;
use kube::Api;
use kube::api::{Patch, PatchParams, PostParams};
use pko_api::program::Program;
use pko_api::workspace::Workspace;
use pko_tests::execution::Execution;
use pko_tests::fixtures;
use pko_tests::kubelet::Kubelet;
use pko_tests::operator::Operator;
use pko_tests::{ControlPlane, wait_for};
use serde_json::{Value, json};

const WAIT: Duration = Duration::from_secs(90);

struct Env {
    ns: String,
    _operator: Operator,
    kubelet: Kubelet,
    tmp: tempfile::TempDir,
}

async fn env(prefix: &str) -> Env {
    let e = Execution::start(prefix, &[]).await;
    Env {
        ns: e.ns,
        _operator: e.operator,
        kubelet: e.kubelet,
        tmp: e.tmp,
    }
}

/// A Program's artifact (url, digest) once the operator has built it.
async fn program_artifact(ns: &str, name: &str, spec: Value) -> (String, String) {
    let api: Api<Program> = Api::namespaced(ControlPlane::shared().await.client(), ns);
    fixtures::published_program(&api, name, spec, WAIT)
        .await
        .expect("artifact")
}

fn workspace(name: &str, backend: &str, url: &str, digest: &str, greeting: &str) -> Workspace {
    fixtures::workspace(
        name,
        json!({
            "flux": {"url": url, "digest": digest},
            "env": [
                {"name": "PULUMI_BACKEND_URL", "value": format!("file://{backend}")},
                {"name": "PULUMI_CONFIG_PASSPHRASE", "value": fixtures::PASSPHRASE},
            ],
            "stacks": [{"name": "dev", "create": true, "config": [{"key": "greeting", "value": greeting}]}],
        }),
    )
}

fn ready(ws: &Workspace) -> Option<(String, String, String)> {
    let c = ws
        .status
        .as_ref()?
        .conditions
        .iter()
        .find(|c| c.type_ == "Ready")?;
    Some((c.status.clone(), c.reason.clone(), c.message.clone()))
}

async fn wait_ready(
    api: &Api<Workspace>,
    name: &str,
    generation: i64,
    kubelet: &Kubelet,
) -> Workspace {
    let result = wait_for(
        &format!("workspace {name} ready at generation {generation}"),
        WAIT,
        || async {
            let ws = api.get(name).await.ok()?;
            let (status, _, _) = ready(&ws)?;
            (status == "True" && ws.status.as_ref()?.observed_generation == Some(generation))
                .then_some(ws)
        },
    )
    .await;
    match result {
        Ok(ws) => ws,
        Err(e) => {
            let ws = api.get(name).await.ok();
            panic!(
                "{e}; status: {:?}\n{}",
                ws.and_then(|w| w.status),
                kubelet.logs(name)
            )
        }
    }
}

const PROGRAM: &str =
    r#"{"configuration": {"greeting": {"type": "String"}}, "outputs": {"message": "${greeting}"}}"#;

#[tokio::test]
async fn workspace_runs_the_agent_and_pushes_config_without_restarting_it() {
    let _machine = pko_tests::serial::shared().await;
    let env = env("ws-ready").await;
    let plane = ControlPlane::shared().await;
    let (url, digest) = program_artifact(
        &env.ns,
        "hello",
        serde_json::from_str(PROGRAM).expect("json"),
    )
    .await;
    let backend = env.tmp.path().join("backend").display().to_string();
    let api: Api<Workspace> = Api::namespaced(plane.client(), &env.ns);
    api.create(
        &PostParams::default(),
        &workspace("hello", &backend, &url, &digest, "hi"),
    )
    .await
    .expect("create workspace");
    let ws = wait_ready(&api, "hello", 1, &env.kubelet).await;
    let status = ws.status.expect("status");
    assert_eq!(status.pulumi_version.as_deref(), Some("v3.274.1"));
    assert!(
        status
            .address
            .as_deref()
            .is_some_and(|a| a.starts_with("127.0.0.1:")),
        "{status:?}"
    );
    assert_eq!(
        ready(&api.get("hello").await.expect("get"))
            .expect("ready")
            .1,
        "Succeeded"
    );

    // PKO's objects: StatefulSet and headless Service `<ws>-workspace`, owned by the Workspace.
    let sts: StatefulSet = Api::namespaced(plane.client(), &env.ns)
        .get("hello-workspace")
        .await
        .expect("statefulset");
    let owners = sts.metadata.owner_references.clone().unwrap_or_default();
    assert_eq!(owners.len(), 1);
    assert_eq!(
        (owners[0].kind.as_str(), owners[0].controller),
        ("Workspace", Some(true))
    );
    let pod = sts.spec.expect("spec").template.spec.expect("pod spec");
    let inits: Vec<&str> = pod
        .init_containers
        .as_deref()
        .unwrap_or_default()
        .iter()
        .map(|c| c.name.as_str())
        .collect();
    assert_eq!(inits, ["bootstrap", "fetch"]);
    let pulumi = &pod.containers[0];
    assert_eq!(
        pulumi.image.as_deref(),
        Some("pulumi/pulumi:latest-nonroot")
    );
    assert!(pulumi.readiness_probe.is_some());
    assert_eq!(
        pod.security_context
            .as_ref()
            .and_then(|s| s.run_as_non_root),
        Some(true)
    );
    let svc: Service = Api::namespaced(plane.client(), &env.ns)
        .get("hello-workspace")
        .await
        .expect("service");
    assert_eq!(svc.spec.and_then(|s| s.cluster_ip).as_deref(), Some("None"));

    let stack_config = env
        .tmp
        .path()
        .join("pods/hello-workspace/volumes/share/workspace/Pulumi.dev.yaml");
    let config = std::fs::read_to_string(&stack_config).expect("stack config written by the agent");
    assert!(config.contains("hello:greeting: hi"), "{config}");

    // A config change is pushed over RPC: same agent process, new config.
    let pid = env.kubelet.agent_pid("hello").expect("agent runs");
    api.patch(
        "hello",
        &PatchParams::default(),
        &Patch::Merge(json!({"spec": {"stacks": [{"name": "dev", "create": true, "config": [{"key": "greeting", "value": "bye"}]}]}})),
    )
    .await
    .expect("patch");
    wait_ready(&api, "hello", 2, &env.kubelet).await;
    let config = std::fs::read_to_string(&stack_config).expect("stack config");
    assert!(config.contains("hello:greeting: bye"), "{config}");
    assert_eq!(
        env.kubelet.agent_pid("hello"),
        Some(pid),
        "the pod was not restarted"
    );

    // An env change is pushed too (PKO restarts the pod): a variable from a Secret that does not
    // exist yet holds the workspace not ready, saying which; once it exists, config read from
    // that variable reaches the stack, still without a restart.
    api.patch(
        "hello",
        &PatchParams::default(),
        &Patch::Merge(json!({"spec": {
            "env": [
                {"name": "PULUMI_BACKEND_URL", "value": format!("file://{backend}")},
                {"name": "PULUMI_CONFIG_PASSPHRASE", "value": "pko-tests"},
                {"name": "GREETING", "valueFrom": {"secretKeyRef": {"name": "greeting", "key": "text"}}},
            ],
            "stacks": [{"name": "dev", "create": true, "config": [{"key": "greeting", "valueFrom": {"env": "GREETING"}}]}],
        }})),
    )
    .await
    .expect("patch env");
    let message = wait_for("the missing Secret to be reported", WAIT, || async {
        let (status, reason, message) = ready(&api.get("hello").await.ok()?)?;
        (status == "False" && reason == "EnvironmentUnavailable").then_some(message)
    })
    .await
    .expect("not ready");
    assert!(message.contains("Secret greeting not found"), "{message}");
    let secret: k8s_openapi::api::core::v1::Secret = serde_json::from_value(json!({
        "apiVersion": "v1", "kind": "Secret", "metadata": {"name": "greeting"},
        "stringData": {"text": "from-a-secret"},
    }))
    .expect("secret");
    Api::<k8s_openapi::api::core::v1::Secret>::namespaced(plane.client(), &env.ns)
        .create(&PostParams::default(), &secret)
        .await
        .expect("create secret");
    wait_ready(&api, "hello", 3, &env.kubelet).await;
    let config = std::fs::read_to_string(&stack_config).expect("stack config");
    assert!(config.contains("hello:greeting: from-a-secret"), "{config}");
    assert_eq!(
        env.kubelet.agent_pid("hello"),
        Some(pid),
        "an env change did not restart the pod"
    );

    // A killed agent is restarted by the kubelet and initialized again.
    assert!(env.kubelet.kill_agent("hello"));
    wait_for("a new agent process", WAIT, || async {
        env.kubelet.agent_pid("hello").filter(|p| *p != pid)
    })
    .await
    .expect("restarted");
    wait_ready(&api, "hello", 3, &env.kubelet).await;
}

#[tokio::test]
async fn a_corrupted_artifact_fails_init_and_the_workspace_says_why() {
    let _machine = pko_tests::serial::shared().await;
    let env = env("ws-digest").await;
    let plane = ControlPlane::shared().await;
    let (url, _) = program_artifact(
        &env.ns,
        "hello",
        serde_json::from_str(PROGRAM).expect("json"),
    )
    .await;
    let wrong = format!("sha256:{}", "ab".repeat(32));
    let backend = env.tmp.path().join("backend").display().to_string();
    let api: Api<Workspace> = Api::namespaced(plane.client(), &env.ns);
    api.create(
        &PostParams::default(),
        &workspace("bad", &backend, &url, &wrong, "hi"),
    )
    .await
    .expect("create workspace");
    let message = wait_for("the init failure in the Ready condition", WAIT, || async {
        let ws = api.get("bad").await.ok()?;
        let (status, _, message) = ready(&ws)?;
        (status == "False" && message.contains("artifact digest mismatch")).then_some(message)
    })
    .await
    .unwrap_or_else(|e| panic!("{e}\n{}", env.kubelet.logs("bad")));
    assert!(message.contains("init container fetch failed"), "{message}");
    assert!(message.contains(&wrong), "{message}");
}

#[tokio::test]
async fn a_root_pod_template_never_reaches_a_pod() {
    let _machine = pko_tests::serial::shared().await;
    let env = env("ws-root").await;
    let plane = ControlPlane::shared().await;
    let api: Api<Workspace> = Api::namespaced(plane.client(), &env.ns);
    let mut ws = workspace(
        "root",
        "/nowhere",
        "http://127.0.0.1:1/x",
        &format!("sha256:{}", "0".repeat(64)),
        "hi",
    );
    ws.spec.pod_template = Some(
        serde_json::from_value(json!({"spec": {"securityContext": {"runAsUser": 0}, "containers": [{"name": "pulumi"}]}}))
            .expect("template"),
    );
    api.create(&PostParams::default(), &ws)
        .await
        .expect("create");
    let ws = wait_for("the Stalled condition", WAIT, || async {
        let ws = api.get("root").await.ok()?;
        let stalled = ws
            .status
            .as_ref()?
            .conditions
            .iter()
            .find(|c| c.type_ == "Stalled")?
            .clone();
        (stalled.status == "True").then_some(stalled)
    })
    .await
    .expect("stalled");
    assert_eq!(ws.reason, "SpecInvalid");
    assert!(
        ws.message
            .contains("spec.securityContext.runAsUser: must not be 0 (root)"),
        "{}",
        ws.message
    );
    let sts: Api<StatefulSet> = Api::namespaced(plane.client(), &env.ns);
    assert!(
        sts.get_opt("root-workspace").await.expect("get").is_none(),
        "no pod template was written"
    );
}

/// Workspaces an operator restart finds initialized.
const RESTARTED: usize = 20;

/// 20 Workspaces become Ready under one operator, each initialized once (`pulumi install`,
/// stack select and config). The operator is stopped and another started: it reconciles every
/// Workspace, finds on each pod what its agent was told (`pko-rs.dev/initialized`), and
/// initializes none again; every Workspace stays Ready. Before, the told state lived in the
/// operator's memory only, and every restart or failover installed every workspace again.
#[tokio::test]
async fn an_operator_restart_initializes_no_workspace_again() {
    let _machine = pko_tests::serial::shared().await;
    let plane = ControlPlane::shared().await;
    let mut e = Execution::start("ws-restart", &[]).await;
    let (url, digest) =
        program_artifact(&e.ns, "hello", serde_json::from_str(PROGRAM).expect("json")).await;
    let api: Api<Workspace> = Api::namespaced(plane.client(), &e.ns);
    let backend = e.tmp.path().join("backend");
    let names: Vec<String> = (0..RESTARTED).map(|i| format!("w{i:02}")).collect();
    for name in &names {
        let ws = workspace(name, &backend.display().to_string(), &url, &digest, name);
        api.create(&PostParams::default(), &ws)
            .await
            .expect("create workspace");
    }
    for name in &names {
        wait_ready(&api, name, 1, &e.kubelet).await;
    }
    let first = e
        .operator
        .log_text()
        .matches("workspace initialized")
        .count();
    assert!(first >= RESTARTED, "each was initialized: {first}");

    e.operator.stop();
    let operator = Operator::start(
        plane,
        pko_tests::operator::OperatorOptions {
            advertised: None,
            args: vec![
                format!("--watch-namespace={}", e.ns),
                "--workspace-localhost=127.0.0.1".into(),
            ],
        },
    )
    .await
    .expect("operator");
    let series = "pko_reconcile_duration_seconds_count{controller=\"workspace\"}";
    wait_for(
        "every Workspace reconciled by the new operator",
        WAIT,
        || async {
            let done = operator.metric(series).await?;
            (done >= RESTARTED as f64).then_some(())
        },
    )
    .await
    .unwrap_or_else(|err| panic!("{err}\n{}", operator.log_text()));
    for name in &names {
        wait_ready(&api, name, 1, &e.kubelet).await;
    }
    let again = operator.log_text().matches("workspace initialized").count();
    assert_eq!(
        again,
        0,
        "initialized again after the restart:\n{}",
        operator.log_text()
    );
}

/// The operator's PATCHes of the workspace's StatefulSet and Service (not their status) in
/// `plane`'s audit log: its applies. Only the operator patches them; the harness kubelet writes
/// the StatefulSet's status subresource.
fn workload_applies(plane: &ControlPlane, ns: &str) -> (usize, usize) {
    let text = std::fs::read_to_string(plane.audit_log()).expect("audit log");
    let mut counts = (0, 0);
    for e in text
        .lines()
        .filter_map(|line| serde_json::from_str::<Value>(line).ok())
    {
        let r = &e["objectRef"];
        if e["stage"] != "ResponseComplete"
            || e["verb"] != "patch"
            || r["namespace"] != ns
            || !r["subresource"].is_null()
        {
            continue;
        }
        match r["resource"].as_str() {
            Some("statefulsets") => counts.0 += 1,
            Some("services") => counts.1 += 1,
            _ => {}
        }
    }
    counts
}

/// A Ready workspace's reconciles read its StatefulSet and Service and write neither (the
/// operator used to apply both on every reconcile); what is changed or deleted behind the
/// operator's back is applied again: a StatefulSet scaled to 0 by someone else is back at 1,
/// a deleted Service is made again.
#[tokio::test]
async fn a_ready_workspace_is_not_applied_again_until_its_workload_is_changed() {
    let _machine = pko_tests::serial::shared().await;
    let tmp = tempfile::tempdir().expect("tmp");
    let plane = ControlPlane::start(pko_tests::StartOptions {
        audit_log: true,
        ..pko_tests::StartOptions::default()
    })
    .await
    .unwrap_or_else(|e| panic!("{e}"));
    let ns = plane.namespace("ws-quiet").await.expect("namespace");
    let kubelet = Kubelet::start_with(
        plane.client(),
        &ns,
        &tmp.path().join("pods"),
        pko_tests::kubelet::KubeletOptions {
            api: Some(pko_tests::kubelet::ApiAccess::of(&plane)),
            ..Default::default()
        },
    )
    .expect("kubelet");
    let operator = Operator::start(
        &plane,
        pko_tests::operator::OperatorOptions {
            advertised: None,
            args: vec![
                format!("--watch-namespace={ns}"),
                "--workspace-localhost=127.0.0.1".into(),
            ],
        },
    )
    .await
    .expect("operator");
    let programs: Api<Program> = Api::namespaced(plane.client(), &ns);
    let (url, digest) = fixtures::published_program(
        &programs,
        "hello",
        serde_json::from_str(PROGRAM).expect("json"),
        WAIT,
    )
    .await
    .expect("artifact");
    let backend = tmp.path().join("backend");
    std::fs::create_dir_all(&backend).expect("backend");
    let api: Api<Workspace> = Api::namespaced(plane.client(), &ns);
    let ws = workspace("quiet", &backend.display().to_string(), &url, &digest, "hi");
    api.create(&PostParams::default(), &ws)
        .await
        .expect("create workspace");
    wait_ready(&api, "quiet", 1, &kubelet).await;

    let reconciled = "pko_reconcile_duration_seconds_count{controller=\"workspace\"}";
    let poke = |i: usize| {
        let api = api.clone();
        let operator = &operator;
        async move {
            let before = operator.metric(reconciled).await.unwrap_or_default();
            api.patch(
                "quiet",
                &PatchParams::default(),
                &Patch::Merge(
                    json!({"metadata": {"annotations": {"example.com/poke": i.to_string()}}}),
                ),
            )
            .await
            .expect("poke");
            wait_for("the poke to be reconciled", WAIT, || async {
                (operator.metric(reconciled).await? > before).then_some(())
            })
            .await
            .unwrap_or_else(|e| panic!("{e}\n{}", operator.log_text()));
        }
    };
    let applied = workload_applies(&plane, &ns);
    assert!(
        applied.0 >= 1 && applied.1 >= 1,
        "applied once: {applied:?}"
    );
    for i in 0..3 {
        poke(i).await;
    }
    wait_ready(&api, "quiet", 1, &kubelet).await;
    assert_eq!(
        workload_applies(&plane, &ns),
        applied,
        "reconciles of a Ready workspace applied its workload again"
    );

    let name = "quiet-workspace";
    let statefulsets: Api<StatefulSet> = Api::namespaced(plane.client(), &ns);
    statefulsets
        .patch(
            name,
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": {"replicas": 0}})),
        )
        .await
        .expect("scale to 0 behind the operator's back");
    wait_for("the StatefulSet scaled back to 1", WAIT, || async {
        let sts = statefulsets.get(name).await.ok()?;
        (sts.spec?.replicas == Some(1)).then_some(())
    })
    .await
    .unwrap_or_else(|e| panic!("{e}\n{}", operator.log_text()));

    let services: Api<Service> = Api::namespaced(plane.client(), &ns);
    let deleted_uid = services.get(name).await.expect("the Service").metadata.uid;
    services
        .delete(name, &Default::default())
        .await
        .expect("delete the Service");
    // A reconcile already on its way (the pod is starting again) may make it again before any
    // read sees it gone: the new uid is what tells.
    poke(3).await;
    wait_for("the Service made again", WAIT, || async {
        let made = services.get_opt(name).await.ok()??;
        (made.metadata.uid != deleted_uid).then_some(())
    })
    .await
    .unwrap_or_else(|e| panic!("{e}\n{}", operator.log_text()));
    wait_ready(&api, "quiet", 1, &kubelet).await;
}
