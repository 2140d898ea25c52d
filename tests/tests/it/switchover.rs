//! A switch-over from PKO v2.9.0's real manager (built from its source by `tools/build.sh pko`)
//! on a private control plane: PKO's CRDs, a Program and a programRef Stack, PKO's manager
//! makes the Workspace, its Service and StatefulSet and writes their statuses; then PKO stops,
//! pko-rs's CRDs are applied and pko-rs starts, as `docs/migrating-from-pko.md` says. Nothing
//! PKO's field managers owned may outlive the switch: not an init container's `args` (our
//! agent refuses PKO's), not PKO's env on the agent, not a status field PKO wrote.

use std::time::Duration;

use k8s_openapi::api::apps::v1::StatefulSet;
use k8s_openapi::api::core::v1::Service;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::api::{ListParams, Patch, PatchParams, PostParams};
use kube::{Api, Resource, ResourceExt};
use pko_api::program::Program;
use pko_api::stack::Stack;
use pko_api::update::Update;
use pko_api::workspace::Workspace;
use pko_tests::kubelet::Kubelet;
use pko_tests::operator::{Operator, OperatorOptions, operator_binary};
use pko_tests::pko_peer::{self, Peer, PeerBinaries};
use pko_tests::{ControlPlane, StartOptions, fixtures, repo_root, tool_dir, wait_for};
use serde_json::json;

const WAIT: Duration = Duration::from_secs(120);

/// PKO's field managers: `pulumi-kubernetes-operator` and its `…/<writer>`s.
fn pkos_managers(meta: &ObjectMeta) -> Vec<String> {
    meta.managed_fields
        .iter()
        .flatten()
        .filter_map(|e| e.manager.clone())
        .filter(|m| m.starts_with("pulumi-kubernetes-operator"))
        .collect()
}

#[tokio::test]
async fn a_stack_pko_made_is_taken_over_with_nothing_of_pkos_left() {
    let _machine = pko_tests::serial::shared().await;
    let pko = tool_dir("pko").expect("PKO's manager (tools/build.sh pko)");
    let plane = ControlPlane::start(StartOptions {
        crds_dir: Some(pko.join("crds")),
        ..StartOptions::default()
    })
    .await
    .expect("control plane with PKO's CRDs");
    let client = plane.client();
    let ns = plane.namespace("switch").await.expect("namespace");
    let system = plane
        .namespace("pko-system")
        .await
        .expect("system namespace");
    let tmp = tempfile::tempdir().expect("tmp");
    let backend = tmp.path().join("backend");
    std::fs::create_dir_all(&backend).expect("backend");

    let bins = PeerBinaries {
        pko_rs: operator_binary().expect("pko-operator"),
        pko_rs_crds: repo_root().join("deploy/crds"),
        pko_manager: pko.join("pko-manager"),
        pko_crds: pko.join("crds"),
    };
    let mut manager = pko_peer::start(
        Peer::Pko,
        &bins,
        &plane,
        &system,
        &tmp.path().join("pko.log"),
        None,
    )
    .await
    .expect("PKO's manager");

    let programs: Api<Program> = Api::namespaced(client.clone(), &ns);
    programs
        .create(
            &PostParams::default(),
            &fixtures::program(
                "hello",
                json!({"outputs": {"message": "hello"}, "resources": {}}),
            ),
        )
        .await
        .expect("program");
    let stacks: Api<Stack> = Api::namespaced(client.clone(), &ns);
    stacks
        .create(
            &PostParams::default(),
            &fixtures::file_backend_stack(
                "hello",
                &backend,
                json!({"programRef": {"name": "hello"}}),
            ),
        )
        .await
        .expect("stack");

    // Under PKO: the StatefulSet with PKO's init container `args`, and statuses PKO wrote.
    let statefulsets: Api<StatefulSet> = Api::namespaced(client.clone(), &ns);
    let workspaces: Api<Workspace> = Api::namespaced(client.clone(), &ns);
    let pkos_sts = wait_for("PKO's workspace StatefulSet", WAIT, || async {
        let sts = statefulsets.get_opt("hello-workspace").await.ok()??;
        let init = sts
            .spec
            .as_ref()?
            .template
            .spec
            .as_ref()?
            .init_containers
            .clone()?;
        init.iter()
            .any(|c| c.args.as_ref().is_some_and(|a| !a.is_empty()))
            .then_some(sts)
    })
    .await
    .unwrap_or_else(|e| panic!("{e}\n{}", manager.log_tail(40)));
    assert!(!pkos_managers(pkos_sts.meta()).is_empty());
    let managers = || async {
        let ws = workspaces.get_opt("hello").await.ok().flatten();
        let stack = stacks.get("hello").await.ok();
        let program = programs.get("hello").await.ok();
        (
            ws.map(|o| pkos_managers(o.meta())),
            stack.map(|o| (pkos_managers(o.meta()), o.status)),
            program.map(|o| pkos_managers(o.meta())),
        )
    };
    let written = wait_for("the statuses PKO writes", WAIT, || async {
        let ws = workspaces.get_opt("hello").await.ok()??;
        let stack = stacks.get("hello").await.ok()?;
        let program = programs.get("hello").await.ok()?;
        let written = |meta: &ObjectMeta, writer: &str| {
            pkos_managers(meta)
                .iter()
                .any(|m| m == &format!("pulumi-kubernetes-operator/{writer}"))
        };
        (written(ws.meta(), "workspace-status")
            && written(stack.meta(), "stack-status")
            && written(program.meta(), "program-status"))
        .then_some(())
    })
    .await;
    if let Err(e) = written {
        panic!("{e}: {:?}\n{}", managers().await, manager.log_tail(40));
    }

    // The switch: PKO stops, our CRDs replace its CRDs, pko-rs starts.
    manager.stop(Duration::from_secs(10));
    // What PKO records once its `up` of the Program's generation succeeded (its agent pods are
    // not run here): the revision as the commit, the outputs. Written as PKO's status writer.
    let stack = stacks.get("hello").await.expect("stack");
    let program = programs.get("hello").await.expect("program");
    let revision = program
        .status
        .as_ref()
        .and_then(|s| s.artifact.as_ref())
        .map(|a| a.revision.clone())
        .expect("PKO's artifact");
    let now = "2026-01-01T00:00:00Z";
    let pkos_status = json!({
        "apiVersion": "pulumi.com/v1", "kind": "Stack",
        "status": {
            "observedGeneration": stack.metadata.generation,
            "outputs": {"message": "hello"},
            "lastUpdate": {
                "generation": stack.metadata.generation, "reconcileRequest": "",
                "name": "hello-pko1", "type": "up", "state": "succeeded",
                "message": "", "lastAttemptedCommit": revision,
                "lastSuccessfulCommit": revision, "lastResyncTime": now, "failures": 0,
            },
            "conditions": [
                {"type": "Ready", "status": "True", "reason": "ProcessingCompleted",
                 "message": "the stack has been processed and is up to date",
                 "lastTransitionTime": now},
                {"type": "Stalled", "status": "True", "reason": "SourceUnavailable",
                 "message": "left by PKO", "lastTransitionTime": now},
            ],
        },
    });
    stacks
        .patch_status(
            "hello",
            &PatchParams::apply("pulumi-kubernetes-operator/stack-status").force(),
            &Patch::Apply(&pkos_status),
        )
        .await
        .expect("PKO's Stack status");
    plane
        .install_crds(&repo_root().join("deploy/crds"))
        .await
        .expect("pko-rs's CRDs");
    let kubelet = Kubelet::start(client.clone(), &ns, &tmp.path().join("pods")).expect("kubelet");
    let operator = Operator::start(
        &plane,
        OperatorOptions {
            advertised: None,
            args: vec![
                format!("--watch-namespace={ns}"),
                "--workspace-localhost=127.0.0.1".into(),
            ],
        },
    )
    .await
    .expect("operator");

    // The revision PKO deployed is recorded as our artifact's digest, and nothing runs.
    let digest = wait_for("pko-rs's artifact of the same generation", WAIT, || async {
        let program = programs.get("hello").await.ok()?;
        let ours = pkos_managers(program.meta()).is_empty();
        let artifact = program.status?.artifact?;
        (ours && artifact.revision == revision).then_some(artifact.digest?)
    })
    .await
    .expect("artifact");
    let adopted = wait_for("the Stack to adopt PKO's revision", WAIT, || async {
        let stack = stacks.get("hello").await.ok()?;
        let status = stack.status.as_ref()?;
        let last = status.last_update.as_ref()?;
        let ready = status
            .conditions
            .iter()
            .any(|c| c.type_ == "Ready" && c.status == "True");
        (ready && last.last_successful_commit.as_deref() == Some(digest.as_str())).then_some(stack)
    })
    .await;
    let updates: Api<Update> = Api::namespaced(client.clone(), &ns);
    let names = || async {
        let list = updates.list(&ListParams::default()).await.expect("updates");
        list.items.iter().map(|u| u.name_any()).collect::<Vec<_>>()
    };
    if let Err(e) = adopted {
        panic!(
            "{e}: {:?}\n{}",
            stacks.get("hello").await.ok().and_then(|s| s.status),
            operator.log_text()
        );
    }
    assert_eq!(
        names().await,
        Vec::<String>::new(),
        "an Update for what PKO deployed"
    );
    let stack = stacks.get("hello").await.expect("stack");
    assert_eq!(
        stack.status.as_ref().and_then(|s| s.outputs.get("message")),
        Some(&json!("hello")),
        "PKO's outputs are kept"
    );

    // Nothing of PKO's is left on the objects, and what only PKO set is gone.
    // The adopted StatefulSet loses what only PKO set: the init container's `args` (our agent
    // refuses PKO's) and PKO's AGENT_MEMLIMIT (ours takes its limits from flags).
    let pkos_leftovers = |sts: &StatefulSet| -> Vec<String> {
        let Some(pod) = sts.spec.as_ref().and_then(|s| s.template.spec.as_ref()) else {
            return vec!["no pod spec".into()];
        };
        let args = pod
            .init_containers
            .iter()
            .flatten()
            .filter(|c| c.args.is_some())
            .map(|c| format!("args of init container {}", c.name));
        let env = pod
            .containers
            .iter()
            .flat_map(|c| c.env.iter().flatten().map(move |e| (c, e)))
            .filter(|(_, e)| e.name == "AGENT_MEMLIMIT")
            .map(|(c, e)| format!("{} on container {}", e.name, c.name));
        args.chain(env).collect()
    };
    let clean = wait_for("the StatefulSet rid of what PKO set", WAIT, || async {
        let sts = statefulsets.get("hello-workspace").await.ok()?;
        pkos_leftovers(&sts).is_empty().then_some(())
    })
    .await;
    if let Err(e) = clean {
        let sts = statefulsets.get("hello-workspace").await.expect("sts");
        panic!("{e}: {:?}\n{}", pkos_leftovers(&sts), operator.log_text());
    }
    let services: Api<Service> = Api::namespaced(client.clone(), &ns);
    let left = || async {
        let sts = statefulsets.get("hello-workspace").await.ok()?;
        let svc = services.get("hello-workspace").await.ok()?;
        let ws = workspaces.get("hello").await.ok()?;
        let stack = stacks.get("hello").await.ok()?;
        let program = programs.get("hello").await.ok()?;
        Some(
            [
                ("StatefulSet", pkos_managers(sts.meta())),
                ("Service", pkos_managers(svc.meta())),
                ("Workspace", pkos_managers(ws.meta())),
                ("Stack", pkos_managers(stack.meta())),
                ("Program", pkos_managers(program.meta())),
            ]
            .into_iter()
            .filter(|(_, managers)| !managers.is_empty())
            .collect::<Vec<_>>(),
        )
    };
    let rid = wait_for("every object to be rid of PKO's managers", WAIT, || async {
        left().await.filter(Vec::is_empty)
    })
    .await;
    if let Err(e) = rid {
        panic!("{e}: {:?}", left().await);
    }
    let conditions = &stack.status.as_ref().expect("status").conditions;
    for c in conditions {
        if c.type_ != "Ready" {
            assert_ne!(
                c.status, "True",
                "{c:?} beside Ready=True: a condition PKO left"
            );
        }
    }

    assert_eq!(
        names().await,
        Vec::<String>::new(),
        "an Update while taking over"
    );

    // A Program edit then runs exactly one `up`, through the adopted workspace.
    programs
        .patch(
            "hello",
            &PatchParams::default(),
            &Patch::Merge(json!({"program": {"outputs": {"message": "edited"}}})),
        )
        .await
        .expect("edit");
    let edited = wait_for("the edit deployed", WAIT, || async {
        let status = stacks.get("hello").await.ok()?.status?;
        let ready = status
            .conditions
            .iter()
            .any(|c| c.type_ == "Ready" && c.status == "True");
        (ready && status.outputs.get("message") == Some(&json!("edited"))).then_some(())
    })
    .await;
    if let Err(e) = edited {
        panic!("{e}\n{}\n{}", kubelet.logs("hello"), operator.log_text());
    }
    assert_eq!(
        names().await.len(),
        1,
        "one Update for one edit: {:?}",
        names().await
    );
}
