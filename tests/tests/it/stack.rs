//! Program → Stack → Workspace → Update → outputs, end to end on the real control plane with the
//! harness as kubelet, the real agent and the real pulumi CLI.

use std::time::Duration;

use k8s_openapi::api::core::v1::{Event, Pod};
use kube::Api;
use kube::api::{DeleteParams, Patch, PatchParams, PostParams};
use pko_api::program::Program;
use pko_api::stack::Stack;
use pko_api::update::Update;
use pko_api::workspace::Workspace;
use pko_tests::execution::Execution;
use pko_tests::fixtures;
use pko_tests::gitrepo::GitRepo;
use pko_tests::kubelet::Kubelet;
use pko_tests::operator::{Operator, OperatorOptions};
use pko_tests::{ControlPlane, wait_for};
use serde_json::{Value, json};

const WAIT: Duration = Duration::from_secs(120);

fn program(message: &str) -> Value {
    json!({
        "configuration": {"greeting": {"type": "String"}, "password": {"type": "String", "default": "pw"}},
        "outputs": {"message": format!("${{greeting}}-{message}"), "token": {"fn::secret": "${password}"}},
    })
}

/// One test's world: a namespace, a file backend, the harness as kubelet and an operator
/// watching that namespace (fields are kept alive until the test ends).
struct Env {
    plane: &'static ControlPlane,
    ns: String,
    tmp: tempfile::TempDir,
    backend: std::path::PathBuf,
    kubelet: Kubelet,
    _operator: Operator,
}

async fn env(prefix: &str) -> Env {
    let e = Execution::start(prefix, &[]).await;
    Env {
        plane: e.plane,
        backend: e.tmp.path().join("backend"),
        ns: e.ns,
        tmp: e.tmp,
        kubelet: e.kubelet,
        _operator: e.operator,
    }
}

/// Creates the Program `name` in `ns`; returns the Programs API of `ns`.
async fn create_program(
    plane: &ControlPlane,
    ns: &str,
    name: &str,
    program: Value,
) -> Api<Program> {
    let programs: Api<Program> = Api::namespaced(plane.client(), ns);
    programs
        .create(&PostParams::default(), &fixtures::program(name, program))
        .await
        .expect("create program");
    programs
}

/// The message of the Stack's `Stalled=True`/`SourceUnavailable` condition, once it has one.
async fn source_unavailable(stacks: &Api<Stack>, name: &str) -> String {
    wait_for(&format!("stack {name} to stall"), WAIT, || async {
        let status = stacks.get(name).await.ok()?.status?;
        status
            .conditions
            .iter()
            .find(|c| c.type_ == "Stalled" && c.status == "True" && c.reason == "SourceUnavailable")
            .map(|c| c.message.clone())
    })
    .await
    .expect("stalled")
}

/// Creates [`fixtures::file_backend_stack`] through `stacks`.
async fn create_stack(stacks: &Api<Stack>, backend: &std::path::Path, name: &str, spec: Value) {
    stacks
        .create(
            &PostParams::default(),
            &fixtures::file_backend_stack(name, backend, spec),
        )
        .await
        .expect("create stack");
}

#[tokio::test]
async fn program_to_stack_ready_with_outputs_then_edit_then_destroy_on_delete() {
    let _machine = pko_tests::serial::shared().await;
    let Env {
        plane,
        ns,
        tmp: _tmp,
        backend,
        kubelet,
        _operator,
    } = env("stack-e2e").await;

    let programs = create_program(plane, &ns, "hello", program("world")).await;

    let stacks: Api<Stack> = Api::namespaced(plane.client(), &ns);
    let workspaces: Api<Workspace> = Api::namespaced(plane.client(), &ns);
    create_stack(
        &stacks,
        &backend,
        "hello",
        json!({
            "stack": "dev",
            "programRef": {"name": "hello"},
            "config": {"greeting": "hello"},
            "destroyOnFinalize": true,
        }),
    )
    .await;

    let outputs_with = |expected: &'static str| {
        let stacks = stacks.clone();
        async move {
            wait_for(&format!("stack outputs with {expected}"), WAIT, || async {
                let s = stacks.get("hello").await.ok()?;
                let status = s.status?;
                let ready = status
                    .conditions
                    .iter()
                    .any(|c| c.type_ == "Ready" && c.status == "True");
                (ready && status.outputs.get("message") == Some(&json!(expected))).then_some(status)
            })
            .await
        }
    };
    let status = match outputs_with("hello-world").await {
        Ok(s) => s,
        Err(e) => panic!(
            "{e}: {:?}\n{}",
            stacks.get("hello").await.ok().and_then(|s| s.status),
            kubelet.logs("hello")
        ),
    };
    assert_eq!(status.outputs.get("token"), Some(&json!("[secret]")));
    let last = status.last_update.expect("lastUpdate");
    assert_eq!(
        (last.type_.as_deref(), last.state.as_deref()),
        (Some("up"), Some("succeeded"))
    );
    assert!(status.current_update.is_none());
    assert_eq!(status.project_info.map(|p| p.name), Some("hello".into()));
    let first_update = last.name.expect("update name");
    let pods: Api<Pod> = Api::namespaced(plane.client(), &ns);
    let pod_uid = || async {
        pods.get("hello-workspace-0")
            .await
            .expect("workspace pod")
            .metadata
            .uid
            .expect("pod uid")
    };
    let (first_pod, first_agent) = (pod_uid().await, kubelet.agent_pid("hello"));
    assert!(first_agent.is_some(), "the agent runs");

    // A Program edit (new artifact digest) runs a new Update and the outputs follow; the pod
    // and its agent stay: the agent fetches and verifies the new revision itself.
    programs
        .patch(
            "hello",
            &PatchParams::default(),
            &Patch::Merge(json!({"program": program("again")})),
        )
        .await
        .expect("edit program");
    let status = outputs_with("hello-again")
        .await
        .expect("outputs after the edit");
    assert_ne!(status.last_update.and_then(|l| l.name), Some(first_update));
    assert_eq!(pod_uid().await, first_pod, "the same workspace pod");
    assert_eq!(kubelet.agent_pid("hello"), first_agent, "the same agent");
    let digest = workspaces
        .get("hello")
        .await
        .expect("workspace")
        .spec
        .flux
        .and_then(|f| f.digest)
        .expect("flux digest");
    let fetched = format!("Fetched source {digest} into the running workspace pod");
    let events: Api<Event> = Api::namespaced(plane.client(), &ns);
    let notes = || async {
        let list = events.list(&Default::default()).await.ok()?;
        Some(
            list.items
                .into_iter()
                .filter_map(|e| e.message)
                .collect::<Vec<_>>(),
        )
    };
    let said = wait_for("the in-place revision Event", WAIT, || async {
        notes()
            .await?
            .iter()
            .any(|m| m.starts_with(&fetched))
            .then_some(())
    })
    .await;
    if let Err(e) = said {
        panic!(
            "{e}: no Event starts with {fetched:?}: {:#?}",
            notes().await
        );
    }

    // A deleted current Update does not wedge the stack: the next one runs.
    stacks
        .patch(
            "hello",
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": {"config": {"greeting": "hey"}}})),
        )
        .await
        .expect("edit config");
    let updates: Api<Update> = Api::namespaced(plane.client(), &ns);
    let current = wait_for("a current update", WAIT, || async {
        stacks.get("hello").await.ok()?.status?.current_update?.name
    })
    .await
    .expect("current update");
    let _ = updates.delete(&current, &DeleteParams::default()).await;
    let status = outputs_with("hey-again")
        .await
        .expect("outputs after the lost update");
    assert!(status.last_update.is_some());

    // A change to the pod beyond the source revision replaces the pod (the operator deletes
    // it: the StatefulSet updates `OnDelete`), and the stack is Ready on the new one.
    let before = pod_uid().await;
    stacks
        .patch(
            "hello",
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": {"workspaceTemplate": {"spec": {
                "resources": {"requests": {"cpu": "150m", "memory": "64Mi"}}}}}})),
        )
        .await
        .expect("edit the workspace template");
    wait_for(
        "a new workspace pod with the new resources",
        WAIT,
        || async {
            let pod = pods.get("hello-workspace-0").await.ok()?;
            let cpu = pod
                .spec?
                .containers
                .first()?
                .resources
                .clone()?
                .requests?
                .get("cpu")
                .cloned()?;
            (pod.metadata.uid.as_deref() != Some(before.as_str()) && cpu.0 == "150m").then_some(())
        },
    )
    .await
    .unwrap_or_else(|e| {
        let log = _operator.log_text();
        let tail: Vec<&str> = log.lines().filter(|l| l.contains("hello")).collect();
        panic!(
            "{e}\noperator log:\n{}",
            tail[tail.len().saturating_sub(40)..].join("\n")
        )
    });
    outputs_with("hey-again")
        .await
        .expect("ready on the new pod");

    // Deleting the stack destroys it first (destroyOnFinalize), then the finalizer goes.
    stacks
        .delete("hello", &DeleteParams::default())
        .await
        .expect("delete");
    wait_for("the stack to be gone", WAIT, || async {
        stacks.get_opt("hello").await.ok()?.is_none().then_some(())
    })
    .await
    .unwrap_or_else(|e| {
        panic!(
            "{e}: {:?}",
            futures::executor::block_on(stacks.get_opt("hello"))
                .ok()
                .flatten()
                .and_then(|s| s.status)
        )
    });
    let destroys: Vec<Update> = updates
        .list(&Default::default())
        .await
        .expect("list")
        .items
        .into_iter()
        .filter(|u| {
            u.spec
                .type_
                .is_some_and(|t| serde_json::to_value(t).ok() == Some(json!("destroy")))
        })
        .collect();
    assert_eq!(destroys.len(), 1, "one destroy update ran");
    let d = &destroys[0];
    assert!(
        d.status.as_ref().is_some_and(|s| s
            .conditions
            .iter()
            .any(|c| c.type_ == "Failed" && c.status == "False")),
        "{:?}",
        d.status
    );
}

#[tokio::test]
async fn invalid_sources_and_references_stall_with_a_clear_reason_and_reclaim_deletes_the_workspace()
 {
    let _machine = pko_tests::serial::shared().await;
    let Env {
        plane,
        ns,
        tmp: _tmp,
        backend,
        kubelet,
        _operator,
    } = env("stack-stall").await;
    create_program(plane, &ns, "hello", program("world")).await;
    let stacks: Api<Stack> = Api::namespaced(plane.client(), &ns);
    let make = |name: &str, extra: Value| -> Stack {
        let mut spec = json!({"config": {"greeting": "hi"}});
        if let (Value::Object(base), Value::Object(more)) = (&mut spec, extra) {
            base.extend(more);
        }
        fixtures::file_backend_stack(name, &backend, spec)
    };
    let cross_ns = make(
        "cross-ns",
        json!({
            "programRef": {"name": "hello"},
            "envRefs": {"TOKEN": {"type": "Secret", "secret": {"namespace": "kube-system", "name": "s", "key": "k"}}},
        }),
    );
    let git = make(
        "git",
        // Nothing listens on port 1: the branch cannot be resolved.
        json!({"projectRepo": "http://127.0.0.1:1/repo.git", "branch": "main"}),
    );
    let reclaim = make(
        "reclaim",
        json!({"programRef": {"name": "hello"}, "workspaceReclaimPolicy": "Delete"}),
    );
    let dependent = make(
        "dependent",
        json!({"stack": "dep", "programRef": {"name": "hello"}, "prerequisites": [{"name": "reclaim"}]}),
    );
    let orphan = make(
        "orphan",
        json!({"stack": "orphan", "programRef": {"name": "hello"}, "prerequisites": [{"name": "missing"}]}),
    );
    for s in [&cross_ns, &git, &reclaim, &dependent, &orphan] {
        stacks
            .create(&PostParams::default(), s)
            .await
            .expect("create stack");
    }

    let stalled = |name: &'static str| {
        let stacks = stacks.clone();
        async move { pko_tests::fixtures::stalled_stack(&stacks, name, WAIT).await }
    };
    let (reason, message) = stalled("cross-ns").await;
    assert_eq!(reason, "SpecInvalid");
    assert!(
        message.contains("cross-namespace refs are not allowed"),
        "{message}"
    );
    let (reason, message) = stalled("git").await;
    assert_eq!(reason, "SourceUnavailable");
    assert!(
        message.contains("cannot list the refs of http://127.0.0.1:1/repo.git"),
        "{message}"
    );
    let workspaces: Api<pko_api::workspace::Workspace> = Api::namespaced(plane.client(), &ns);
    assert!(
        workspaces.get_opt("cross-ns").await.expect("get").is_none(),
        "a stalled stack makes no workspace, so the reference never reaches a pod"
    );

    // workspaceReclaimPolicy: Delete — the workspace goes once the stack is up to date.
    let result = wait_for(
        "stack reclaim to be Ready without its workspace",
        WAIT,
        || async {
            let status = stacks.get("reclaim").await.ok()?.status?;
            let ready = status
                .conditions
                .iter()
                .any(|c| c.type_ == "Ready" && c.status == "True");
            let gone = workspaces.get_opt("reclaim").await.ok()?.is_none();
            (ready && gone && status.outputs.get("message") == Some(&json!("hi-world")))
                .then_some(())
        },
    )
    .await;
    if let Err(e) = result {
        panic!(
            "{e}: {:?}\n{}",
            stacks.get("reclaim").await.ok().and_then(|s| s.status),
            kubelet.logs("reclaim")
        );
    }

    // Prerequisites: a missing one holds the stack; a satisfied one lets it run.
    let reason = wait_for(
        "stack orphan to wait for its prerequisite",
        WAIT,
        || async {
            let status = stacks.get("orphan").await.ok()?.status?;
            status
                .conditions
                .iter()
                .find(|c| c.type_ == "Reconciling" && c.status == "True")
                .filter(|c| c.reason == "PrerequisiteNotSatisfied")
                .map(|c| c.message.clone())
        },
    )
    .await
    .expect("prerequisite not satisfied");
    assert!(reason.contains("missing"), "{reason}");
    wait_for(
        "stack dependent to be Ready after its prerequisite",
        WAIT,
        || async {
            let status = stacks.get("dependent").await.ok()?.status?;
            status
                .conditions
                .iter()
                .any(|c| c.type_ == "Ready" && c.status == "True")
                .then_some(())
        },
    )
    .await
    .expect("dependent ready");
}

#[tokio::test]
async fn a_flux_source_object_is_fetched_verified_and_deployed() {
    let _machine = pko_tests::serial::shared().await;
    pko_tests::flux::install_crds(ControlPlane::shared().await.client(), WAIT)
        .await
        .expect("Flux CRDs");
    let Env {
        plane,
        ns,
        tmp: _tmp,
        backend,
        kubelet,
        _operator,
    } = env("stack-flux").await;
    // Any Flux-style artifact will do: a Program's, served by the operator.
    let programs = create_program(plane, &ns, "src", program("flux")).await;
    let artifact = wait_for("the program artifact", WAIT, || async {
        let s = serde_json::to_value(programs.get("src").await.ok()?.status?).ok()?;
        s.get("artifact").cloned()
    })
    .await
    .expect("artifact");
    let resource = kube::api::ApiResource {
        group: "source.toolkit.fluxcd.io".into(),
        version: "v1".into(),
        api_version: "source.toolkit.fluxcd.io/v1".into(),
        kind: "GitRepository".into(),
        plural: "gitrepositories".into(),
    };
    let repos: Api<kube::api::DynamicObject> = Api::namespaced_with(plane.client(), &ns, &resource);
    let repo: kube::api::DynamicObject = serde_json::from_value(json!({
        "apiVersion": "source.toolkit.fluxcd.io/v1", "kind": "GitRepository",
        "metadata": {"name": "repo"}, "spec": {"url": "https://example.invalid/repo.git"},
    }))
    .expect("repo");
    repos
        .create(&PostParams::default(), &repo)
        .await
        .expect("create repo");
    repos
        .patch_status(
            "repo",
            &PatchParams::default(),
            &Patch::Merge(json!({"status": {"artifact": {
                "url": artifact["url"], "digest": artifact["digest"], "revision": "main@sha1:abc",
                "path": "x", "lastUpdateTime": "2026-01-01T00:00:00Z",
            }}})),
        )
        .await
        .expect("repo status");

    let stacks: Api<Stack> = Api::namespaced(plane.client(), &ns);
    create_stack(
        &stacks,
        &backend,
        "from-flux",
        json!({
            "stack": "dev",
            "fluxSource": {"sourceRef": {"apiVersion": "source.toolkit.fluxcd.io/v1", "kind": "GitRepository", "name": "repo"}},
            "config": {"greeting": "hi"},
        }),
    )
    .await;
    let result = wait_for("the flux-sourced stack to be Ready", WAIT, || async {
        let status = stacks.get("from-flux").await.ok()?.status?;
        let ready = status
            .conditions
            .iter()
            .any(|c| c.type_ == "Ready" && c.status == "True");
        (ready && status.outputs.get("message") == Some(&json!("hi-flux"))).then_some(())
    })
    .await;
    if let Err(e) = result {
        panic!(
            "{e}: {:?}\n{}",
            stacks.get("from-flux").await.ok().and_then(|s| s.status),
            kubelet.logs("from-flux")
        );
    }
}

fn git_program(message: &str) -> String {
    format!(
        "name: from-git\nruntime: yaml\nconfiguration:\n  greeting:\n    type: String\noutputs:\n  message: ${{greeting}}-{message}\n"
    )
}

#[tokio::test]
async fn a_git_branch_is_deployed_with_credentials_and_a_new_commit_redeploys() {
    let _machine = pko_tests::serial::shared().await;
    let Env {
        plane,
        ns,
        tmp,
        backend,
        kubelet,
        _operator,
    } = env("stack-git").await;
    let repo = GitRepo::start(&tmp.path().join("git"), Some(("pko", "s3cret")))
        .await
        .expect("git repo");
    let first = repo
        .commit("main", &[("app/Pulumi.yaml", &git_program("one"))])
        .expect("first commit");
    let secrets: Api<k8s_openapi::api::core::v1::Secret> = Api::namespaced(plane.client(), &ns);
    let creds: k8s_openapi::api::core::v1::Secret = serde_json::from_value(json!({
        "apiVersion": "v1", "kind": "Secret", "metadata": {"name": "git-creds"},
        "stringData": {"user": "pko", "password": "s3cret"},
    }))
    .expect("secret");
    secrets
        .create(&PostParams::default(), &creds)
        .await
        .expect("create secret");

    let stacks: Api<Stack> = Api::namespaced(plane.client(), &ns);
    for (name, branch, password_key) in [
        ("tracked", "main", "password"),
        ("no-branch", "does-not-exist", "password"),
        ("bad-creds", "main", "user"),
    ] {
        let spec = json!({
            "stack": name,
            "projectRepo": repo.url(), "branch": branch, "repoDir": "app",
            "gitAuth": {"basicAuth": {
                "userName": {"type": "Secret", "secret": {"name": "git-creds", "key": "user"}},
                "password": {"type": "Secret", "secret": {"name": "git-creds", "key": password_key}},
            }},
            "config": {"greeting": "hi"},
        });
        create_stack(&stacks, &backend, name, spec).await;
    }

    let deployed = |message: &'static str, commit: String| {
        let stacks = stacks.clone();
        async move {
            wait_for(&format!("stack tracked at {commit}"), WAIT, || async {
                let status = stacks.get("tracked").await.ok()?.status?;
                let ready = status
                    .conditions
                    .iter()
                    .any(|c| c.type_ == "Ready" && c.status == "True");
                let last = status.last_update.as_ref()?;
                (ready
                    && status.outputs.get("message") == Some(&json!(message))
                    && last.last_successful_commit.as_deref() == Some(commit.as_str()))
                .then_some(())
            })
            .await
        }
    };
    if let Err(e) = deployed("hi-one", first.clone()).await {
        panic!(
            "{e}: {:?}\n{}",
            stacks.get("tracked").await.ok().and_then(|s| s.status),
            kubelet.logs("tracked")
        );
    }
    let workspaces: Api<pko_api::workspace::Workspace> = Api::namespaced(plane.client(), &ns);
    let ws = workspaces.get("tracked").await.expect("workspace");
    let git = ws.spec.git.expect("a git workspace source");
    assert_eq!(
        git.ref_.as_deref(),
        Some(first.as_str()),
        "pinned to the resolved commit"
    );
    assert_eq!(git.dir.as_deref(), Some("app"));
    let auth = serde_json::to_value(git.auth.expect("auth")).expect("json");
    assert_eq!(
        auth,
        json!({"username": {"name": "git-creds", "key": "user"}, "password": {"name": "git-creds", "key": "password"}}),
        "credentials travel by reference, never by value"
    );

    // A new commit on the branch is found (here on a sync request, instead of the next poll).
    let second = repo
        .commit("main", &[("app/Pulumi.yaml", &git_program("two"))])
        .expect("second commit");
    stacks
        .patch(
            "tracked",
            &PatchParams::default(),
            &Patch::Merge(
                json!({"metadata": {"annotations": {"pulumi.com/reconciliation-request": "now"}}}),
            ),
        )
        .await
        .expect("request a sync");
    if let Err(e) = deployed("hi-two", second).await {
        panic!(
            "{e}: {:?}\n{}",
            stacks.get("tracked").await.ok().and_then(|s| s.status),
            kubelet.logs("tracked")
        );
    }

    // A branch that does not exist, or credentials the server refuses: Stalled, saying which.
    for (name, expected) in [
        ("no-branch", "no branch or tag \"does-not-exist\""),
        (
            "bad-creds",
            "authentication required or refused; check the git credentials",
        ),
    ] {
        let message = source_unavailable(&stacks, name).await;
        assert!(message.contains(expected), "{name}: {message}");
    }
    assert!(
        repo.requests().iter().all(|p| p.starts_with("/repo.git/")),
        "{:?}",
        repo.requests()
    );
}

#[tokio::test]
async fn a_destroy_in_a_terminating_namespace_stalls_and_says_how_to_let_go() {
    let _machine = pko_tests::serial::shared().await;
    let Env {
        plane,
        ns,
        tmp: _tmp,
        backend,
        kubelet,
        _operator,
    } = env("stack-ns-gone").await;
    create_program(plane, &ns, "hello", program("world")).await;
    let stacks: Api<Stack> = Api::namespaced(plane.client(), &ns);
    create_stack(
        &stacks,
        &backend,
        "doomed",
        json!({
            "stack": "dev", "programRef": {"name": "hello"},
            "config": {"greeting": "hi"},
            "destroyOnFinalize": true, "workspaceReclaimPolicy": "Delete",
        }),
    )
    .await;
    let workspaces: Api<pko_api::workspace::Workspace> = Api::namespaced(plane.client(), &ns);
    let deployed = wait_for(
        "the stack deployed and its workspace reclaimed",
        WAIT,
        || async {
            let status = stacks.get("doomed").await.ok()?.status?;
            let ready = status
                .conditions
                .iter()
                .any(|c| c.type_ == "Ready" && c.status == "True");
            let gone = workspaces.get_opt("doomed").await.ok()?.is_none();
            (ready && gone).then_some(())
        },
    )
    .await;
    if let Err(e) = deployed {
        panic!(
            "{e}: {:?}\n{}",
            stacks.get("doomed").await.ok().and_then(|s| s.status),
            kubelet.logs("doomed")
        );
    }

    // The namespace goes (this plane has no namespace controller, so it stays Terminating and
    // the test deletes the stack as that controller would).
    let namespaces: Api<k8s_openapi::api::core::v1::Namespace> = Api::all(plane.client());
    namespaces
        .delete(&ns, &DeleteParams::default())
        .await
        .expect("delete namespace");
    stacks
        .delete("doomed", &DeleteParams::default())
        .await
        .expect("delete stack");
    let message = wait_for(
        "the stack to stall on the terminating namespace",
        WAIT,
        || async {
            let status = stacks.get("doomed").await.ok()?.status?;
            status
                .conditions
                .iter()
                .find(|c| {
                    c.type_ == "Stalled" && c.status == "True" && c.reason == "NamespaceTerminating"
                })
                .map(|c| c.message.clone())
        },
    )
    .await
    .expect("stalled");
    assert!(
        message.contains(&format!("namespace {ns} is being deleted"))
            && message.contains(&format!("kubectl patch stack doomed -n {ns}")),
        "{message}"
    );
    // The advice works: without the finalizer the stack goes.
    stacks
        .patch(
            "doomed",
            &PatchParams::default(),
            &Patch::Merge(json!({"metadata": {"finalizers": null}})),
        )
        .await
        .expect("remove the finalizer");
    wait_for("the stack to be gone", WAIT, || async {
        stacks.get_opt("doomed").await.ok()?.is_none().then_some(())
    })
    .await
    .expect("gone");
}

/// A real provider against the real control plane: the Pulumi Kubernetes provider creates a
/// ConfigMap, updates it in place when the config changes, and deletes it when the Stack goes
/// with `destroyOnFinalize`.
#[tokio::test]
async fn a_real_resource_is_created_updated_and_destroyed() {
    let _machine = pko_tests::serial::shared().await;
    let Env {
        plane,
        ns,
        tmp: _tmp,
        backend,
        kubelet,
        _operator,
    } = env("stack-k8s").await;
    create_program(
        plane,
        &ns,
        "configmap",
        json!({
            "configuration": {"greeting": {"type": "String"}},
            "resources": {"cm": {
                "type": "kubernetes:core/v1:ConfigMap",
                "properties": {
                    // This plane has no garbage collector to finish a foreground deletion.
                    "metadata": {"name": "made-by-pulumi", "namespace": ns,
                        "annotations": {"pulumi.com/deletionPropagationPolicy": "background"}},
                    "data": {"greeting": "${greeting}"},
                },
            }},
            "outputs": {"uid": "${cm.metadata.uid}"},
        }),
    )
    .await;
    let stacks: Api<Stack> = Api::namespaced(plane.client(), &ns);
    create_stack(
        &stacks,
        &backend,
        "cm",
        json!({
            "stack": "dev", "programRef": {"name": "configmap"},
            "envRefs": {
                "PULUMI_CONFIG_PASSPHRASE": {"type": "Literal", "literal": {"value": "pko-tests"}},
                "KUBECONFIG": {"type": "Literal", "literal": {"value": plane.kubeconfig_path().display().to_string()}},
                // Data changes patch the ConfigMap instead of replacing it.
                "PULUMI_K8S_ENABLE_CONFIGMAP_MUTABLE": {"type": "Literal", "literal": {"value": "true"}},
            },
            "config": {"greeting": "hello"},
            "destroyOnFinalize": true,
        }),
    )
    .await;
    let config_maps: Api<k8s_openapi::api::core::v1::ConfigMap> =
        Api::namespaced(plane.client(), &ns);
    let deployed = |greeting: &'static str| {
        let (stacks, config_maps) = (stacks.clone(), config_maps.clone());
        async move {
            wait_for(
                &format!("the ConfigMap to say {greeting}"),
                WAIT,
                || async {
                    let status = stacks.get("cm").await.ok()?.status?;
                    let ready = status
                        .conditions
                        .iter()
                        .any(|c| c.type_ == "Ready" && c.status == "True");
                    let cm = config_maps.get_opt("made-by-pulumi").await.ok()??;
                    let data = cm.data.clone().unwrap_or_default();
                    (ready && data.get("greeting").map(String::as_str) == Some(greeting))
                        .then_some((cm, status))
                },
            )
            .await
        }
    };
    let (created, status) = match deployed("hello").await {
        Ok(found) => found,
        Err(e) => panic!(
            "{e}: {:?}\n{}",
            stacks.get("cm").await.ok().and_then(|s| s.status),
            kubelet.logs("cm")
        ),
    };
    let uid = created.metadata.uid.clone().expect("uid");
    assert_eq!(status.outputs.get("uid"), Some(&json!(uid)));

    // A config change updates the object in place (same uid).
    stacks
        .patch(
            "cm",
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": {"config": {"greeting": "bye"}}})),
        )
        .await
        .expect("edit config");
    let (updated, _) = match deployed("bye").await {
        Ok(found) => found,
        Err(e) => panic!(
            "{e}: {:?}\n{}",
            stacks.get("cm").await.ok().and_then(|s| s.status),
            kubelet.logs("cm")
        ),
    };
    assert_eq!(updated.metadata.uid.as_deref(), Some(uid.as_str()));

    // Deleting the Stack destroys the resource, then the finalizer goes.
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
}

/// PKO's retry rules and count: failures back off (capped by `retryMaxBackoffDurationSeconds`);
/// the first failure of a run counts 0, so the stack stalls after the fourth failure in a row
/// ("failed 3 times", PKO's words); a spec change runs it again. After a success, a failure in
/// the same generation counts 1 (PKO counts on from the success), so the stack stalls after
/// three.
#[tokio::test]
async fn repeated_failures_stall_the_stack_until_the_spec_changes() {
    let _machine = pko_tests::serial::shared().await;
    let Env {
        plane,
        ns,
        tmp,
        backend,
        kubelet,
        _operator,
    } = env("stack-retry").await;
    create_program(
        plane,
        &ns,
        "reader",
        json!({
            "configuration": {"file": {"type": "String"}},
            "variables": {"content": {"fn::readFile": "${file}"}},
            "outputs": {"content": "${content}"},
        }),
    )
    .await;
    let good = tmp.path().join("content.txt");
    std::fs::write(&good, "read\n").expect("file");
    let stacks: Api<Stack> = Api::namespaced(plane.client(), &ns);
    create_stack(
        &stacks,
        &backend,
        "retry",
        json!({
            "stack": "dev", "programRef": {"name": "reader"},
            "config": {"file": tmp.path().join("missing.txt").display().to_string()},
            "retryMaxBackoffDurationSeconds": 1,
        }),
    )
    .await;
    let stalled = wait_for(
        "the stack to stall after repeated failures",
        WAIT,
        || async {
            let status = stacks.get("retry").await.ok()?.status?;
            let c = status
                .conditions
                .iter()
                .find(|c| c.type_ == "Stalled" && c.status == "True")?;
            Some((c.reason.clone(), c.message.clone(), status.last_update?))
        },
    )
    .await;
    let (reason, message, last) = match stalled {
        Ok(found) => found,
        Err(e) => panic!(
            "{e}: {:?}\n{}",
            stacks.get("retry").await.ok().and_then(|s| s.status),
            kubelet.logs("retry")
        ),
    };
    assert_eq!(reason, "UpdateFailed");
    assert!(
        message.contains("up failed 3 times; not retrying until the spec or source changes"),
        "{message}"
    );
    assert_eq!(last.failures, Some(3));
    assert!(
        last.message
            .as_deref()
            .is_some_and(|m| m.contains("missing.txt")),
        "{last:?}"
    );
    let updates: Api<Update> = Api::namespaced(plane.client(), &ns);
    let runs = updates
        .list(&Default::default())
        .await
        .expect("updates")
        .items
        .len();
    assert_eq!(runs, 4, "one Update per attempt");

    // Fixing the spec runs it again, and it succeeds.
    stacks
        .patch(
            "retry",
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": {"config": {"file": good.display().to_string()}}})),
        )
        .await
        .expect("fix config");
    wait_for("the fixed stack to be Ready", WAIT, || async {
        let status = stacks.get("retry").await.ok()?.status?;
        let ready = status
            .conditions
            .iter()
            .any(|c| c.type_ == "Ready" && c.status == "True");
        (ready && status.outputs.get("content") == Some(&json!("read\n"))).then_some(())
    })
    .await
    .unwrap_or_else(|e| panic!("{e}\n{}", kubelet.logs("retry")));

    // A new program that fails, in the same stack generation as the success: counted from it.
    let programs: Api<Program> = Api::namespaced(plane.client(), &ns);
    programs
        .patch(
            "reader",
            &PatchParams::default(),
            &Patch::Merge(
                json!({"program": {"variables": {"content": {"fn::readFile": "${file}.gone"}}}}),
            ),
        )
        .await
        .expect("break the program");
    let first = wait_for("the first failure after the success", WAIT, || async {
        let last = stacks.get("retry").await.ok()?.status?.last_update?;
        (last.state.as_deref() == Some("failed")).then_some(last)
    })
    .await
    .unwrap_or_else(|e| panic!("{e}\n{}", kubelet.logs("retry")));
    assert_eq!(first.failures, Some(1), "{first:?}");
    let (reason, message) = fixtures::stalled_stack(&stacks, "retry", WAIT).await;
    assert_eq!(reason, "UpdateFailed");
    assert!(message.contains("up failed 3 times"), "{message}");
    let runs = updates
        .list(&Default::default())
        .await
        .expect("updates")
        .items
        .len();
    assert_eq!(runs, 4 + 1 + 3, "three failures after the success");
}

/// `preview: true` runs previews only, and deleting such a stack destroys nothing.
#[tokio::test]
async fn a_preview_stack_previews_and_is_deleted_without_a_destroy() {
    let _machine = pko_tests::serial::shared().await;
    let Env {
        plane,
        ns,
        tmp: _tmp,
        backend,
        kubelet,
        _operator,
    } = env("stack-preview").await;
    create_program(plane, &ns, "hello", program("world")).await;
    let stacks: Api<Stack> = Api::namespaced(plane.client(), &ns);
    create_stack(
        &stacks,
        &backend,
        "preview",
        json!({
            "stack": "dev", "programRef": {"name": "hello"},
            "config": {"greeting": "hi"},
            "preview": true, "destroyOnFinalize": true,
        }),
    )
    .await;
    let last = wait_for("the preview to succeed", WAIT, || async {
        let status = stacks.get("preview").await.ok()?.status?;
        let ready = status
            .conditions
            .iter()
            .any(|c| c.type_ == "Ready" && c.status == "True");
        let last = status.last_update?;
        (ready && last.state.as_deref() == Some("succeeded")).then_some(last)
    })
    .await
    .unwrap_or_else(|e| panic!("{e}\n{}", kubelet.logs("preview")));
    assert_eq!(last.type_.as_deref(), Some("preview"));

    stacks
        .delete("preview", &DeleteParams::default())
        .await
        .expect("delete");
    wait_for("the preview stack to be gone", WAIT, || async {
        stacks
            .get_opt("preview")
            .await
            .ok()?
            .is_none()
            .then_some(())
    })
    .await
    .expect("gone");
    let updates: Api<Update> = Api::namespaced(plane.client(), &ns);
    let types: Vec<String> = updates
        .list(&Default::default())
        .await
        .expect("updates")
        .items
        .iter()
        .filter_map(|u| u.spec.type_.and_then(|t| serde_json::to_value(t).ok()))
        .filter_map(|v| v.as_str().map(str::to_owned))
        .collect();
    assert!(
        types.iter().all(|t| t == "preview"),
        "only previews ran: {types:?}"
    );
}

/// Issue: branch tracking fetched `<repo>/info/refs` from any address a tenant named, and
/// copied the start of a bad answer into the Stack's status (SSRF with the result shown
/// back). Under the production egress rules a loopback repository is refused before any
/// connection; where it is allowed, a bad answer is named by its class, never repeated.
#[tokio::test]
async fn branch_lookups_refuse_forbidden_addresses_and_never_echo_an_answer() {
    let _machine = pko_tests::serial::shared().await;
    const SECRET: &str = "METADATA-SECRET-4f1c";
    let plane = ControlPlane::shared().await;
    let server = pko_tests::agent::StaticServer::start(std::collections::HashMap::from([(
        "/repo/info/refs?service=git-upload-pack".to_owned(),
        format!("{SECRET} token=abc\n").into_bytes(),
    )]))
    .await
    .expect("server");
    let tmp = tempfile::tempdir().expect("tmp");
    for (prefix, egress, expected) in [
        // Production rules: loopback is refused.
        (
            "stack-egress",
            Some("--egress-deny-cidr=192.0.2.0/24"),
            "its address is a loopback address",
        ),
        // Loopback allowed (the harness default): the answer is not a refs listing.
        ("stack-echo", None, "not a git refs listing"),
    ] {
        let ns = plane.namespace(prefix).await.expect("namespace");
        let mut args = vec![format!("--watch-namespace={ns}")];
        args.extend(egress.map(str::to_owned));
        let _op = Operator::start(
            plane,
            OperatorOptions {
                advertised: None,
                args,
            },
        )
        .await
        .expect("operator");
        let stacks: Api<Stack> = Api::namespaced(plane.client(), &ns);
        let spec = json!({"projectRepo": server.url("/repo"), "branch": "main"});
        create_stack(&stacks, tmp.path(), "tracked", spec).await;
        let message = source_unavailable(&stacks, "tracked").await;
        assert!(message.contains(expected), "{prefix}: {message}");
        assert!(!message.contains(SECRET), "{prefix}: {message}");
        let events = plane
            .kubectl()
            .args(["get", "events", "-n", &ns, "-o", "json"])
            .output()
            .expect("kubectl");
        assert!(
            !String::from_utf8_lossy(&events.stdout).contains(SECRET),
            "{prefix}: an Event repeats the answer"
        );
    }
}
