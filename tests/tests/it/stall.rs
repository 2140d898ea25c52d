//! Names that always make valid objects, and errors that say so, on the real control plane:
//! the apiserver refuses Workspace names its derived objects could not have; a StatefulSet the
//! apiserver refuses stalls the Workspace with the apiserver's message and an Event, retried
//! with backoff until the spec is fixed; a Secret with a dot in its name gets a volume in a
//! stack's workspace; a Stack whose Workspace name would be refused stalls saying why; a Stack
//! whose finalizer is refused stalls once and backs off.

use std::time::{Duration, Instant};

use k8s_openapi::api::apps::v1::StatefulSet;
use k8s_openapi::api::core::v1::Secret;
use k8s_openapi::api::events::v1::Event;
use kube::Api;
use kube::api::{Patch, PatchParams, PostParams};
use pko_api::program::Program;
use pko_api::stack::Stack;
use pko_api::workspace::{self as ws_api, Workspace};
use pko_tests::execution::Execution;
use pko_tests::fixtures::{self, workspace};
use pko_tests::kubelet::Kubelet;
use pko_tests::operator::Operator;
use pko_tests::{ControlPlane, wait_for};
use serde_json::{Value, json};

const WAIT: Duration = Duration::from_secs(120);

struct Env {
    plane: &'static ControlPlane,
    ns: String,
    tmp: tempfile::TempDir,
    _kubelet: Kubelet,
    operator: Operator,
}

async fn env(prefix: &str) -> Env {
    let e = Execution::start(prefix, &[]).await;
    Env {
        plane: e.plane,
        ns: e.ns,
        tmp: e.tmp,
        _kubelet: e.kubelet,
        operator: e.operator,
    }
}

/// The apiserver's message when it refuses to create `ws`, or `None` if it accepts it.
async fn refusal(api: &Api<Workspace>, ws: &Workspace) -> Option<(u16, String)> {
    let dry_run = PostParams {
        dry_run: true,
        ..PostParams::default()
    };
    match api.create(&dry_run, ws).await {
        Ok(_) => None,
        Err(kube::Error::Api(s)) => Some((s.code, s.message.clone())),
        Err(e) => panic!("unexpected error: {e}"),
    }
}

#[tokio::test]
async fn workspace_names_that_would_make_invalid_objects_are_refused() {
    let _machine = pko_tests::serial::shared().await;
    let plane = ControlPlane::shared().await;
    let ns = plane.namespace("ws-names").await.expect("namespace");
    let api: Api<Workspace> = Api::namespaced(plane.client(), &ns);
    for name in ["a.b", "1abc", "db-"] {
        let (code, message) = refusal(&api, &workspace(name, json!({})))
            .await
            .unwrap_or_else(|| panic!("{name} was accepted"));
        assert_eq!(code, 422, "{name}: {message}");
        assert!(
            message.contains(ws_api::NAME_FORMAT_MESSAGE),
            "{name}: {message}"
        );
    }
    let long = "a".repeat(ws_api::NAME_MAX_LENGTH + 1);
    let (code, message) = refusal(&api, &workspace(&long, json!({})))
        .await
        .expect("a 43-character name was accepted");
    assert_eq!(code, 422, "{message}");
    assert!(message.contains(ws_api::NAME_LENGTH_MESSAGE), "{message}");
    // What PKO users name their Workspaces keeps working, up to the longest name.
    for name in ["my-stack", "s3", &"a".repeat(ws_api::NAME_MAX_LENGTH)] {
        assert_eq!(
            refusal(&api, &workspace(name, json!({}))).await,
            None,
            "{name}"
        );
    }
}

/// A condition as (status, reason, message).
type Found = Option<(String, String, String)>;

/// The Workspace's `Stalled` and `Ready` conditions.
fn stalled_and_ready(ws: &Workspace) -> (Found, Found) {
    let conditions = ws
        .status
        .as_ref()
        .map(|s| s.conditions.clone())
        .unwrap_or_default();
    let find = |type_: &str| {
        conditions
            .iter()
            .find(|c| c.type_ == type_)
            .map(|c| (c.status.clone(), c.reason.clone(), c.message.clone()))
    };
    (find("Stalled"), find("Ready"))
}

#[tokio::test]
async fn a_statefulset_the_apiserver_refuses_stalls_the_workspace_and_is_retried_with_backoff() {
    let _machine = pko_tests::serial::shared().await;
    let env = env("ws-refused").await;
    let api: Api<Workspace> = Api::namespaced(env.plane.client(), &env.ns);
    // Valid for the Workspace schema, refused by StatefulSet validation (422): a mount of a
    // volume the pod does not have.
    let spec = json!({
        "podTemplate": {"spec": {"containers": [{
            "name": "pulumi",
            "volumeMounts": [{"name": "cache", "mountPath": "/cache"}],
        }]}},
    });
    let created = Instant::now();
    api.create(&PostParams::default(), &workspace("refused", spec))
        .await
        .expect("create");

    let message = wait_for("the Workspace to stall", WAIT, || async {
        let ws = api.get("refused").await.ok()?;
        match stalled_and_ready(&ws) {
            (Some((status, reason, message)), Some((ready, ready_reason, _)))
                if status == "True" =>
            {
                assert_eq!(reason, "ReconcileError");
                assert_eq!(
                    (ready.as_str(), ready_reason.as_str()),
                    ("False", "ReconcileError")
                );
                Some(message)
            }
            _ => None,
        }
    })
    .await
    .expect("stalled");
    // The apiserver's own words, naming the field and the missing volume.
    assert!(
        message.contains("applying the workspace StatefulSet")
            && message.contains("volumeMounts[0].name")
            && message.contains("cache"),
        "{message}"
    );

    let events: Api<Event> = Api::namespaced(env.plane.client(), &env.ns);
    let notes = wait_for("the ReconcileError Event", WAIT, || async {
        let notes: Vec<String> = events
            .list(&Default::default())
            .await
            .ok()?
            .items
            .into_iter()
            .filter(|e| {
                e.reason.as_deref() == Some("ReconcileError")
                    && e.regarding.as_ref().and_then(|r| r.name.as_deref()) == Some("refused")
            })
            .filter_map(|e| e.note)
            .collect();
        (!notes.is_empty()).then_some(notes)
    })
    .await
    .expect("event");
    assert!(
        notes.iter().all(|n| n.contains("volumeMounts[0].name")),
        "{notes:?}"
    );

    // Attempts are spaced by backoff: after failure n the next one waits at least
    // 2^(n-1)/2 s, so k failures take at least (2^(k-2) - 1)/2 s (one more attempt is allowed
    // for the reconcile the stalled status write itself triggers). A slower machine only
    // makes fewer attempts.
    let series = "pko_reconcile_errors_total{controller=\"workspace\",error=\"kube\"}";
    let attempts = wait_for("four failed attempts", WAIT, || async {
        env.operator.metric(series).await.filter(|n| *n >= 4.0)
    })
    .await
    .expect("attempts");
    let elapsed = created.elapsed().as_secs_f64();
    let most = 2.0 + (2.0 * elapsed + 1.0).log2();
    assert!(
        attempts <= most.floor(),
        "{attempts} failed attempts in {elapsed:.1}s: not backing off (at most {most:.1})"
    );

    // Fixing the spec (a new generation) lets the StatefulSet through and clears the stall.
    let fix = json!({"spec": {"podTemplate": {"spec": {
        "containers": [{"name": "pulumi", "volumeMounts": [{"name": "cache", "mountPath": "/cache"}]}],
        "volumes": [{"name": "cache", "emptyDir": {}}],
    }}}});
    api.patch("refused", &PatchParams::default(), &Patch::Merge(&fix))
        .await
        .expect("fix");
    let statefulsets: Api<StatefulSet> = Api::namespaced(env.plane.client(), &env.ns);
    wait_for("the StatefulSet and no stall", WAIT, || async {
        statefulsets.get_opt("refused-workspace").await.ok()??;
        let ws = api.get("refused").await.ok()?;
        let (stalled, _) = stalled_and_ready(&ws);
        stalled.is_none().then_some(())
    })
    .await
    .expect("healed");
}

const PROGRAM: &str = r#"{"configuration": {"greeting": {"type": "String"}, "password": {"type": "String"}},
    "outputs": {"message": "${greeting}-world", "token": {"fn::secret": "${password}"}}}"#;

fn stack(env: &Env, name: &str, extra: Value) -> Stack {
    let spec = json!({"programRef": {"name": "hello"}, "config": {"greeting": "hi"}});
    fixtures::file_backend_stack(
        name,
        &env.tmp.path().join("backend"),
        fixtures::merged(spec, extra),
    )
}

#[tokio::test]
async fn a_dotted_secret_gets_a_volume_and_a_dotted_stack_name_stalls() {
    let _machine = pko_tests::serial::shared().await;
    let env = env("stack-names").await;
    let client = env.plane.client();
    let programs: Api<Program> = Api::namespaced(client.clone(), &env.ns);
    let program = fixtures::program(
        "hello",
        serde_json::from_str::<Value>(PROGRAM).expect("json"),
    );
    programs
        .create(&PostParams::default(), &program)
        .await
        .expect("create program");
    let secrets: Api<Secret> = Api::namespaced(client.clone(), &env.ns);
    let secret: Secret = serde_json::from_value(json!({
        "apiVersion": "v1", "kind": "Secret", "metadata": {"name": "db.creds"},
        "stringData": {"password": "s3cret"},
    }))
    .expect("secret");
    secrets
        .create(&PostParams::default(), &secret)
        .await
        .expect("create secret");

    let stacks: Api<Stack> = Api::namespaced(client.clone(), &env.ns);
    let password = json!({"secretsRef": {"password": {"type": "Secret", "secret": {"name": "db.creds", "key": "password"}}}});
    for s in [
        stack(&env, "creds", password.clone()),
        stack(&env, "a.b", password),
    ] {
        stacks
            .create(&PostParams::default(), &s)
            .await
            .expect("create stack");
    }

    // Without the sanitised volume name (`secret-db.creds` is not a DNS-1123 label) the
    // apiserver refuses this StatefulSet.
    let statefulsets: Api<StatefulSet> = Api::namespaced(client.clone(), &env.ns);
    let result = wait_for("the StatefulSet of stack creds", WAIT, || async {
        statefulsets.get_opt("creds-workspace").await.ok()?
    })
    .await;
    let sts = match result {
        Ok(sts) => sts,
        Err(e) => panic!(
            "{e}: {:?}",
            Api::<Workspace>::namespaced(client.clone(), &env.ns)
                .get_opt("creds")
                .await
                .ok()
                .flatten()
                .and_then(|w| w.status)
        ),
    };
    let pod = sts.spec.expect("spec").template.spec.expect("pod spec");
    let volume = pod
        .volumes
        .unwrap_or_default()
        .into_iter()
        .find(|v| v.secret.as_ref().and_then(|s| s.secret_name.as_deref()) == Some("db.creds"))
        .expect("the Secret's volume");
    let hashed = volume
        .name
        .strip_prefix("secret-db-creds-")
        .unwrap_or_else(|| panic!("volume name {}", volume.name));
    assert!(
        hashed.len() == 8 && hashed.chars().all(|c| c.is_ascii_hexdigit()),
        "{}",
        volume.name
    );
    let mounted = pod.containers[0]
        .volume_mounts
        .clone()
        .unwrap_or_default()
        .into_iter()
        .any(|m| {
            m.name == volume.name
                && m.mount_path == "/var/run/secrets/stacks.pulumi.com/secrets/db.creds"
        });
    assert!(mounted, "the volume is mounted where the config reads it");

    // `a.b` is a valid Stack name but not a valid Workspace name: stalled, no Workspace.
    let (reason, message) = pko_tests::fixtures::stalled_stack(&stacks, "a.b", WAIT).await;
    assert_eq!(reason, "SpecInvalid");
    assert!(
        message.contains("Workspace would be named a.b")
            && message.contains(ws_api::NAME_FORMAT_MESSAGE),
        "{message}"
    );
    let workspaces: Api<Workspace> = Api::namespaced(client, &env.ns);
    assert!(workspaces.get_opt("a.b").await.expect("get").is_none());
}

/// A Stack whose finalizer the apiserver will not let go (here a ValidatingAdmissionPolicy
/// refusing it, 422): deleting it stalls it once, with the apiserver's words, and attempts
/// back off instead of rewriting the status (each write would trigger the next attempt at
/// once). Once the refusal is gone, the Stack goes.
#[tokio::test]
async fn a_stack_whose_finalizer_is_refused_stalls_once_and_backs_off() {
    let _machine = pko_tests::serial::shared().await;
    use pko_tests::refusal::{Refusal, Rule};
    let env = env("stack-keep").await;
    let client = env.plane.client();
    let refusal = Refusal::install(
        env.plane,
        &format!("pko-tests-keep-finalizers-{}", env.ns),
        Rule {
            group: "pulumi.com",
            resource: "stacks",
            allowed: "!has(oldObject.metadata.finalizers) || (has(object.metadata.finalizers) && object.metadata.finalizers.size() >= oldObject.metadata.finalizers.size())",
            message: "finalizers stay (pko-tests)",
            namespace: Some(&env.ns),
        },
    )
    .await
    .expect("refusal");

    let stacks: Api<Stack> = Api::namespaced(client.clone(), &env.ns);
    stacks
        .create(&PostParams::default(), &stack(&env, "kept", json!({})))
        .await
        .expect("create");
    wait_for("the finalizer", WAIT, || async {
        let s = stacks.get("kept").await.ok()?;
        s.metadata
            .finalizers
            .is_some_and(|f| f.iter().any(|f| f == "finalizer.stack.pulumi.com"))
            .then_some(())
    })
    .await
    .expect("finalizer");
    // The policy is in force once it refuses a removal itself (its cache fills in the
    // background); a dry run, so a removal let through changes nothing.
    wait_for("the policy to refuse", WAIT, || async {
        let patch = json!({"metadata": {"finalizers": null}});
        let dry_run = PatchParams {
            dry_run: true,
            ..PatchParams::default()
        };
        match stacks.patch("kept", &dry_run, &Patch::Merge(&patch)).await {
            Err(kube::Error::Api(s)) if s.code == 422 => Some(()),
            _ => None,
        }
    })
    .await
    .expect("refused");

    let deleted = Instant::now();
    stacks
        .delete("kept", &Default::default())
        .await
        .expect("delete");
    // (Before the delete it is stalled for its missing Program; that is not this stall.)
    let message = wait_for("the Stack to stall on the refusal", WAIT, || async {
        let status = stacks.get("kept").await.ok()?.status?;
        status
            .conditions
            .iter()
            .find(|c| c.type_ == "Stalled" && c.status == "True" && c.reason == "ReconcileError")
            .map(|c| c.message.clone())
    })
    .await
    .expect("stalled");
    assert!(message.contains("finalizers stay"), "{message}");

    // As for the Workspace above: k failures take at least (2^(k-2) - 1)/2 s. Rewriting the
    // status on every attempt would make them as fast as the apiserver answers.
    let series = "pko_reconcile_errors_total{controller=\"stack\",error=\"reconcile\"}";
    let attempts = wait_for("four failed attempts", WAIT, || async {
        env.operator.metric(series).await.filter(|n| *n >= 4.0)
    })
    .await
    .expect("attempts");
    let elapsed = deleted.elapsed().as_secs_f64();
    let most = 2.0 + (2.0 * elapsed + 1.0).log2();
    assert!(
        attempts <= most.floor(),
        "{attempts} failed attempts in {elapsed:.1}s: not backing off (at most {most:.1})"
    );

    // The refusal gone, a change to the Stack brings the next attempt, and the Stack goes.
    refusal.remove().await;
    wait_for("the Stack to go", WAIT, || async {
        let touch = json!({"metadata": {"annotations": {"pko-tests/touch": deleted.elapsed().as_millis().to_string()}}});
        match stacks
            .patch("kept", &PatchParams::default(), &Patch::Merge(&touch))
            .await
        {
            Err(kube::Error::Api(s)) if s.code == 404 => Some(()),
            _ => stacks.get_opt("kept").await.ok()?.is_none().then_some(()),
        }
    })
    .await
    .expect("gone");
}
