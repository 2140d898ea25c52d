//! Stack, Workspace and Update fields that behave as PKO v2.9's, each shown by its effect on
//! the real control plane with the harness as kubelet, the real agent and the real pulumi CLI:
//! a source-less Stack runs the program in its image (PKO's `examples/custom-source`); a
//! Workspace reports `Installing` then `Initializing`; a successful destroy keeps the outputs;
//! a Stack whose Program is gone is destroyed from its last project (PKO #1222); a Stack whose
//! workspace never ran is let go; `updateTemplate.metadata` labels and annotates the Updates;
//! a template's `stacks` and `envFrom` add to the Stack's own.

use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::StreamExt;
use k8s_openapi::api::core::v1::{ConfigMap, Secret};
use kube::Api;
use kube::api::{DeleteParams, Patch, PatchParams, PostParams};
use kube::runtime::watcher;
use pko_api::program::Program;
use pko_api::stack::{Stack, StackStatus};
use pko_api::update::Update;
use pko_api::workspace::Workspace;
use pko_tests::execution::Execution;
use pko_tests::fixtures;
use pko_tests::kubelet::Kubelet;
use pko_tests::wait_for;
use serde_json::json;

const WAIT: Duration = Duration::from_secs(120);
/// A finalizer of the test's own: the Stack stays readable after ours has gone.
const HOLD: &str = "pko-tests.dev/hold";

fn ready(status: &StackStatus) -> bool {
    status
        .conditions
        .iter()
        .any(|c| c.type_ == "Ready" && c.status == "True")
}

/// The Stack's status once it is Ready and `check` holds; panics with the pod logs if not.
async fn ready_stack(
    stacks: &Api<Stack>,
    kubelet: &Kubelet,
    name: &str,
    check: impl Fn(&StackStatus) -> bool,
) -> StackStatus {
    let result = wait_for(&format!("stack {name} to be Ready"), WAIT, || async {
        let status = stacks.get(name).await.ok()?.status?;
        (ready(&status) && check(&status)).then_some(status)
    })
    .await;
    match result {
        Ok(status) => status,
        Err(e) => panic!(
            "{e}: {:?}\n{}",
            stacks.get(name).await.ok().and_then(|s| s.status),
            kubelet.logs(name)
        ),
    }
}

async fn gone<K>(api: &Api<K>, name: &str, kubelet: &Kubelet)
where
    K: kube::Resource + Clone + serde::de::DeserializeOwned + std::fmt::Debug,
{
    wait_for(&format!("{name} to be gone"), WAIT, || async {
        api.get_opt(name).await.ok()?.is_none().then_some(())
    })
    .await
    .unwrap_or_else(|e| panic!("{e}\n{}", kubelet.logs(name)));
}

/// Records the `Ready` reason of every version of the Workspace `name` the apiserver sends;
/// returns once the watch is established, before the Workspace exists, so none is missed.
async fn record_ready_reasons(api: Api<Workspace>, name: &str) -> Arc<Mutex<Vec<String>>> {
    let seen = Arc::new(Mutex::new(Vec::<String>::new()));
    let out = seen.clone();
    let (listed, established) = tokio::sync::oneshot::channel();
    let config = watcher::Config::default().fields(&format!("metadata.name={name}"));
    tokio::spawn(async move {
        let mut listed = Some(listed);
        let mut events = watcher::watcher(api, config).boxed();
        while let Some(event) = events.next().await {
            let ws = match event {
                Ok(watcher::Event::Apply(ws) | watcher::Event::InitApply(ws)) => ws,
                Ok(watcher::Event::InitDone) => {
                    if let Some(listed) = listed.take() {
                        let _ = listed.send(());
                    }
                    continue;
                }
                _ => continue,
            };
            let reason = ws
                .status
                .and_then(|s| s.conditions.into_iter().find(|c| c.type_ == "Ready"))
                .map(|c| c.reason);
            if let Some(reason) = reason {
                let mut seen = seen.lock().unwrap_or_else(|e| e.into_inner());
                if seen.last() != Some(&reason) {
                    seen.push(reason);
                }
            }
        }
    });
    established
        .await
        .expect("the Workspace watch is established");
    out
}

/// PKO's `examples/custom-source`: a Stack with no source whose `workspaceTemplate` names a
/// program folder in the workspace image (`local`). It deploys; its Workspace reports PKO's
/// `Installing` then `Initializing` before it is ready; deleting it destroys the stack, and
/// the outputs stay after the destroy (PKO keeps them). Without a template source the stack
/// stalls saying what is missing.
#[tokio::test]
async fn a_sourceless_stack_runs_the_program_in_its_image() {
    let _machine = pko_tests::serial::shared().await;
    let e = Execution::start("fields-local", &[]).await;
    let (plane, ns, kubelet) = (e.plane, e.ns.clone(), &e.kubelet);
    let backend = e.tmp.path().join("backend");
    // The "image": a program folder on the harness's file system.
    let app = e.tmp.path().join("image/app");
    std::fs::create_dir_all(&app).expect("app folder");
    std::fs::write(
        app.join("Pulumi.yaml"),
        "name: baked\nruntime: yaml\nconfiguration:\n  greeting:\n    type: String\noutputs:\n  message: ${greeting}-from-the-image\n",
    )
    .expect("Pulumi.yaml");
    let reasons = record_ready_reasons(Api::namespaced(plane.client(), &ns), "custom-source").await;

    let stacks: Api<Stack> = Api::namespaced(plane.client(), &ns);
    let mut stack = fixtures::file_backend_stack(
        "custom-source",
        &backend,
        json!({
            "config": {"greeting": "hi"},
            "destroyOnFinalize": true,
            "workspaceTemplate": {"spec": {"local": {"dir": app.display().to_string()}}},
        }),
    );
    stack.metadata.finalizers = Some(vec![HOLD.into()]);
    stacks
        .create(&PostParams::default(), &stack)
        .await
        .expect("create stack");
    let status = ready_stack(&stacks, kubelet, "custom-source", |s| {
        s.outputs.get("message") == Some(&json!("hi-from-the-image"))
    })
    .await;
    let last = status.last_update.clone().expect("last update");
    assert_eq!(last.last_successful_commit.unwrap_or_default(), "");
    let workspaces: Api<Workspace> = Api::namespaced(plane.client(), &ns);
    let ws = workspaces.get("custom-source").await.expect("workspace");
    assert!(
        ws.spec.flux.is_none() && ws.spec.git.is_none(),
        "{:?}",
        ws.spec
    );
    assert_eq!(
        ws.spec.local.and_then(|l| l.dir).as_deref(),
        Some(app.to_str().expect("utf-8 path"))
    );
    let seen = reasons.lock().expect("reasons").clone();
    let at = |reason: &str| seen.iter().position(|r| r == reason);
    match (at("Installing"), at("Initializing"), at("Succeeded")) {
        (Some(i), Some(n), Some(s)) => assert!(i < n && n < s, "{seen:?}"),
        _ => panic!("Installing, Initializing, Succeeded not all seen: {seen:?}"),
    }

    // Deleting it destroys the stack; the outputs stay.
    stacks
        .delete("custom-source", &DeleteParams::default())
        .await
        .expect("delete");
    let destroyed = wait_for("the destroy to finish", WAIT, || async {
        let s = stacks.get("custom-source").await.ok()?;
        let ours = s.metadata.finalizers.as_ref()?.iter().any(|f| f != HOLD);
        let last = s.status.as_ref()?.last_update.as_ref()?;
        (!ours && last.type_.as_deref() == Some("destroy")).then(|| s.status.clone())?
    })
    .await
    .unwrap_or_else(|e| panic!("{e}\n{}", kubelet.logs("custom-source")));
    assert_eq!(
        destroyed.last_update.and_then(|l| l.state).as_deref(),
        Some("succeeded")
    );
    assert_eq!(
        destroyed.outputs.get("message"),
        Some(&json!("hi-from-the-image")),
        "a destroy keeps the outputs"
    );
    stacks
        .patch(
            "custom-source",
            &PatchParams::default(),
            &Patch::Merge(json!({"metadata": {"finalizers": null}})),
        )
        .await
        .expect("release");

    // No source and nothing in the template: nothing could run.
    stacks
        .create(
            &PostParams::default(),
            &fixtures::file_backend_stack("nothing", &backend, json!({})),
        )
        .await
        .expect("create stack");
    let (reason, message) = fixtures::stalled_stack(&stacks, "nothing", WAIT).await;
    assert_eq!(reason, "SpecInvalid");
    assert!(message.contains("the stack has no source"), "{message}");
    assert!(workspaces.get_opt("nothing").await.expect("get").is_none());
}

/// PKO #1222: a Program and its `destroyOnFinalize` Stack deleted together. The Program goes
/// first; the Stack's destroy then runs from its recorded project (`status.projectInfo`): a
/// Workspace with only `projectInfo` (no fetch), and the real ConfigMap the program made is
/// deleted. Before, the Stack stalled `SourceUnavailable` and kept its finalizer for ever.
#[tokio::test]
async fn a_stack_whose_program_is_gone_is_destroyed_from_its_last_project() {
    let _machine = pko_tests::serial::shared().await;
    let e = Execution::start("fields-gone", &[]).await;
    let (plane, ns, kubelet) = (e.plane, e.ns.clone(), &e.kubelet);
    let programs: Api<Program> = Api::namespaced(plane.client(), &ns);
    programs
        .create(
            &PostParams::default(),
            &fixtures::program(
                "configmap",
                json!({"resources": {"cm": {
                    "type": "kubernetes:core/v1:ConfigMap",
                    "properties": {
                        "metadata": {"name": "made-by-pulumi", "namespace": ns,
                            "annotations": {"pulumi.com/deletionPropagationPolicy": "background"}},
                        "data": {"greeting": "hello"},
                    },
                }}}),
            ),
        )
        .await
        .expect("program");
    let stacks: Api<Stack> = Api::namespaced(plane.client(), &ns);
    stacks
        .create(
            &PostParams::default(),
            &fixtures::file_backend_stack(
                "cm",
                &e.tmp.path().join("backend"),
                json!({
                    "programRef": {"name": "configmap"},
                    "envRefs": {
                        "PULUMI_CONFIG_PASSPHRASE": {"type": "Literal", "literal": {"value": fixtures::PASSPHRASE}},
                        "KUBECONFIG": {"type": "Literal", "literal": {"value": plane.kubeconfig_path().display().to_string()}},
                    },
                    "destroyOnFinalize": true,
                }),
            ),
        )
        .await
        .expect("stack");
    let config_maps: Api<ConfigMap> = Api::namespaced(plane.client(), &ns);
    let status = ready_stack(&stacks, kubelet, "cm", |s| s.project_info.is_some()).await;
    let project = status.project_info.expect("project");
    assert!(
        config_maps
            .get_opt("made-by-pulumi")
            .await
            .expect("get")
            .is_some()
    );

    programs
        .delete("configmap", &DeleteParams::default())
        .await
        .expect("delete program");
    gone(&programs, "configmap", kubelet).await;
    stacks
        .delete("cm", &DeleteParams::default())
        .await
        .expect("delete stack");
    wait_for("the Stack and its ConfigMap to be gone", WAIT, || async {
        let stack_gone = stacks.get_opt("cm").await.ok()?.is_none();
        let cm_gone = config_maps.get_opt("made-by-pulumi").await.ok()?.is_none();
        (stack_gone && cm_gone).then_some(())
    })
    .await
    .unwrap_or_else(|e| panic!("{e}\n{}", kubelet.logs("cm")));
    // No garbage collector here: the Workspace the destroy ran in is still there to read.
    let ws = Api::<Workspace>::namespaced(plane.client(), &ns)
        .get("cm")
        .await
        .expect("workspace");
    assert!(ws.spec.flux.is_none(), "{:?}", ws.spec.flux);
    let info = ws.spec.project_info.expect("projectInfo source");
    assert_eq!((info.name, info.runtime), (project.name, project.runtime));
}

/// A `destroyOnFinalize` Stack whose workspace cannot run (here a root pod template, which the
/// Workspace refuses) never ran an update: deleting it lets it go at once, as PKO does, with no
/// Update made. A Stack deleted while its source is unavailable and with no project recorded
/// stalls saying how to let it go.
#[tokio::test]
async fn a_stack_whose_workspace_never_ran_is_let_go() {
    let _machine = pko_tests::serial::shared().await;
    let e = Execution::start("fields-never", &[]).await;
    let (plane, ns, kubelet) = (e.plane, e.ns.clone(), &e.kubelet);
    let backend = e.tmp.path().join("backend");
    let programs: Api<Program> = Api::namespaced(plane.client(), &ns);
    programs
        .create(
            &PostParams::default(),
            &fixtures::program("hello", json!({"outputs": {"message": "hi"}})),
        )
        .await
        .expect("program");
    let stacks: Api<Stack> = Api::namespaced(plane.client(), &ns);
    stacks
        .create(
            &PostParams::default(),
            &fixtures::file_backend_stack(
                "root",
                &backend,
                json!({
                    "programRef": {"name": "hello"},
                    "destroyOnFinalize": true,
                    "workspaceTemplate": {"spec": {"podTemplate": {"spec": {
                        "securityContext": {"runAsUser": 0}, "containers": [{"name": "pulumi"}]}}}},
                }),
            ),
        )
        .await
        .expect("stack");
    let (reason, message) = fixtures::stalled_stack(&stacks, "root", WAIT).await;
    assert_eq!(reason, "WorkspaceFailed", "{message}");
    stacks
        .delete("root", &DeleteParams::default())
        .await
        .expect("delete");
    gone(&stacks, "root", kubelet).await;
    let updates: Api<Update> = Api::namespaced(plane.client(), &ns);
    let made = updates.list(&Default::default()).await.expect("updates");
    assert!(made.items.is_empty(), "no Update: {:?}", made.items);

    // A missing Program and nothing recorded: it cannot be destroyed, and the stall says how
    // to let it go.
    stacks
        .create(
            &PostParams::default(),
            &fixtures::file_backend_stack(
                "orphan",
                &backend,
                json!({"programRef": {"name": "missing"}, "destroyOnFinalize": true}),
            ),
        )
        .await
        .expect("stack");
    fixtures::stalled_stack(&stacks, "orphan", WAIT).await;
    stacks
        .delete("orphan", &DeleteParams::default())
        .await
        .expect("delete");
    let message = wait_for("the stall to say how to let go", WAIT, || async {
        let status = stacks.get("orphan").await.ok()?.status?;
        status
            .conditions
            .iter()
            .find(|c| c.type_ == "Stalled" && c.message.contains("kubectl patch stack orphan"))
            .map(|c| (c.reason.clone(), c.message.clone()))
    })
    .await
    .expect("let-go hint");
    assert_eq!(message.0, "SourceUnavailable", "{}", message.1);
    stacks
        .patch(
            "orphan",
            &PatchParams::default(),
            &Patch::Merge(json!({"metadata": {"finalizers": null}})),
        )
        .await
        .expect("let go");
    gone(&stacks, "orphan", kubelet).await;
}

/// Every file under `dir` named `name`.
fn find(dir: &Path, name: &str) -> Vec<std::path::PathBuf> {
    let mut out = Vec::new();
    for entry in std::fs::read_dir(dir).into_iter().flatten().flatten() {
        let path = entry.path();
        if path.is_dir() {
            out.extend(find(&path, name));
        } else if path.file_name().is_some_and(|n| n == name) {
            out.push(path);
        }
    }
    out
}

/// PKO's merge orders and `updateTemplate.metadata`: the passphrase reaches pulumi only
/// through the Stack's `envSecrets` while the template has an `envFrom` of its own (which
/// PKO's order puts first, replacing nothing); the template's `stacks` are added before the
/// Stack's own (both initialised: the extra stack exists in the backend); the Updates carry
/// the template's labels and annotations beside the Stack's own labels.
#[tokio::test]
async fn templates_add_to_the_stacks_own_fields_as_in_pko() {
    let _machine = pko_tests::serial::shared().await;
    let e = Execution::start("fields-merge", &[]).await;
    let (plane, ns, kubelet) = (e.plane, e.ns.clone(), &e.kubelet);
    let backend = e.tmp.path().join("backend");
    let secrets: Api<Secret> = Api::namespaced(plane.client(), &ns);
    let secret: Secret = serde_json::from_value(json!({
        "metadata": {"name": "passphrase"},
        "stringData": {"PULUMI_CONFIG_PASSPHRASE": fixtures::PASSPHRASE},
    }))
    .expect("secret");
    secrets
        .create(&PostParams::default(), &secret)
        .await
        .expect("secret");
    let config_maps: Api<ConfigMap> = Api::namespaced(plane.client(), &ns);
    let cm: ConfigMap = serde_json::from_value(json!({
        "metadata": {"name": "template-env"}, "data": {"FROM_TEMPLATE": "1"},
    }))
    .expect("config map");
    config_maps
        .create(&PostParams::default(), &cm)
        .await
        .expect("config map");
    let programs: Api<Program> = Api::namespaced(plane.client(), &ns);
    programs
        .create(
            &PostParams::default(),
            &fixtures::program(
                "hello",
                json!({"outputs": {"message": "hi", "token": {"fn::secret": "s3cret"}}}),
            ),
        )
        .await
        .expect("program");
    let stacks: Api<Stack> = Api::namespaced(plane.client(), &ns);
    stacks
        .create(
            &PostParams::default(),
            &fixtures::file_backend_stack(
                "merged",
                &backend,
                json!({
                    "programRef": {"name": "hello"},
                    // The passphrase comes only from the Secret.
                    "envRefs": {},
                    "envSecrets": ["passphrase"],
                    "workspaceTemplate": {"spec": {
                        "envFrom": [{"configMapRef": {"name": "template-env"}}],
                        "stacks": [{"name": "extra", "create": true}],
                    }},
                    "updateTemplate": {"metadata": {
                        "labels": {"team": "a", "pulumi.com/stack-name": "hijack"},
                        "annotations": {"example.com/note": "from the template"},
                    }},
                }),
            ),
        )
        .await
        .expect("stack");
    let status = ready_stack(&stacks, kubelet, "merged", |s| {
        s.outputs.get("message") == Some(&json!("hi"))
    })
    .await;
    assert_eq!(status.outputs.get("token"), Some(&json!("[secret]")));

    let ws = Api::<Workspace>::namespaced(plane.client(), &ns)
        .get("merged")
        .await
        .expect("workspace");
    let env_from = serde_json::to_value(&ws.spec.env_from).expect("json");
    assert_eq!(
        env_from,
        json!([{"configMapRef": {"name": "template-env"}}, {"secretRef": {"name": "passphrase"}}])
    );
    let names: Vec<&str> = ws.spec.stacks.iter().map(|s| s.name.as_str()).collect();
    assert_eq!(names, ["extra", "dev"]);
    assert!(
        !find(&backend, "extra.json").is_empty(),
        "the template's stack was created in the backend"
    );

    let update_name = status.last_update.and_then(|l| l.name).expect("update");
    let update = Api::<Update>::namespaced(plane.client(), &ns)
        .get(&update_name)
        .await
        .expect("update");
    let labels = update.metadata.labels.unwrap_or_default();
    assert_eq!(labels.get("team").map(String::as_str), Some("a"));
    assert_eq!(
        labels.get("pulumi.com/stack-name").map(String::as_str),
        Some("merged"),
        "the stack's own labels win"
    );
    let annotations = update.metadata.annotations.unwrap_or_default();
    assert_eq!(
        annotations.get("example.com/note").map(String::as_str),
        Some("from the template")
    );
}
