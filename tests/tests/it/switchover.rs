//! A live PKO install switched to pko-rs, on a private control plane, with PKO v2.9.0's real
//! manager and real agent (built from its source by `tools/build.sh pko`): the harness kubelet
//! runs PKO's own workspace pod spec (`bootstrap` copies `/agent` and `/tini`, `fetch` runs
//! `agent init`, `pulumi` runs `agent serve --auth-mode kube`), each pod on an address of its
//! own that PKO's manager finds by DNS, and PKO's agent checks the manager's tokens with the
//! apiserver.
//!
//! Under PKO, Stacks of every source (a Program, a Flux source, a git commit) deploy, and one
//! more Stack's `up` is left running. Then the steps of `docs/migrating-from-pko.md`: PKO
//! stops, pko-rs's CRDs are applied, pko-rs starts. What must hold:
//! - no Stack whose source and spec are unchanged runs an Update;
//! - statuses, outputs Secrets and the Updates PKO ran are kept;
//! - every StatefulSet is adopted and its pod runs (one restart each);
//! - nothing on any object is owned by PKO's field managers, and PKO's Update finalizers go;
//! - the Update in flight is run again by pko-rs to completion;
//! - then an edit of a Program and of a Stack runs exactly one `up` each.

use std::collections::BTreeMap;
use std::time::Duration;

use k8s_openapi::api::apps::v1::StatefulSet;
use k8s_openapi::api::core::v1::{Event, Pod, Secret};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::api::{
    Api, ApiResource, DynamicObject, GroupVersionKind, ListParams, Patch, PatchParams, PostParams,
};
use kube::{Client, Resource, ResourceExt};
use pko_api::program::Program;
use pko_api::stack::Stack;
use pko_api::update::Update;
use pko_api::workspace::Workspace;
use pko_tests::flux::{self, FluxSource};
use pko_tests::gitrepo::GitRepo;
use pko_tests::kubelet::{ApiAccess, Kubelet, KubeletOptions, PodNetwork};
use pko_tests::operator::{Operator, OperatorOptions, operator_binary};
use pko_tests::pko_peer::{self, Peer, PeerBinaries, PeerOptions, RunningPeer};
use pko_tests::{ControlPlane, StartOptions, fifo, fixtures, kubeauth, repo_root, wait_for};
use serde_json::{Value, json};

const WAIT: Duration = Duration::from_secs(180);
/// The Stacks that deploy under PKO, with the message each outputs.
const DEPLOYED: [(&str, &str); 3] = [
    ("prog", "from-program"),
    ("flux", "from-flux"),
    ("git", "from-git"),
];
/// The Stack whose `up` is in flight at the switch.
const IN_FLIGHT: &str = "slow";
/// pko-rs's agent image, as a user names it in PKO's `AGENT_IMAGE` (any name without
/// `pulumi-kubernetes-operator` is an image of ours to the harness kubelet).
const OUR_AGENT_IMAGE: &str = "pko-rs:latest";

/// Reads the file named by config `file`: a named pipe holds the `up` until written to.
const SLOW_PROGRAM: &str = r#"{
  "configuration": {"file": {"type": "String"}},
  "variables": {"content": {"fn::readFile": "${file}"}},
  "outputs": {"content": "${content}"}
}"#;

fn yaml_project(name: &str, message: &str) -> String {
    format!("name: {name}\nruntime: yaml\noutputs:\n  message: {message}\n")
}

/// PKO's field managers on an object: `pulumi-kubernetes-operator` and its `…/<writer>`s.
fn pkos_managers(meta: &ObjectMeta) -> Vec<String> {
    meta.managed_fields
        .iter()
        .flatten()
        .filter_map(|e| e.manager.clone())
        .filter(|m| pko_api::decode::is_pko_manager(m))
        .collect()
}

fn is_true(
    conditions: &[k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition],
    t: &str,
) -> bool {
    conditions
        .iter()
        .any(|c| c.type_ == t && c.status == "True")
}

/// Everything one run needs.
struct Scene {
    plane: ControlPlane,
    client: Client,
    ns: String,
    system: String,
    tmp: tempfile::TempDir,
    kubelet: Kubelet,
    git: GitRepo,
    flux: FluxSource,
    fifo: std::path::PathBuf,
}

impl Scene {
    async fn new() -> Self {
        let pko = pko_tests::tool_dir("pko").expect("PKO's manager and agent (tools/build.sh pko)");
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
        pko_peer::install_manager_identity(&client, &system)
            .await
            .expect("PKO's service account");
        // PKO's docs: the workspace's account may review its callers' tokens.
        kubeauth::service_account(&client, &ns, "default")
            .await
            .expect("workspace service account");
        kubeauth::bind_auth_delegator(&client, &ns, "default")
            .await
            .expect("workspace service account's auth-delegator binding");
        flux::install_crds(client.clone(), WAIT)
            .await
            .expect("Flux CRDs");
        let tmp = tempfile::tempdir().expect("tmp");
        std::fs::create_dir_all(tmp.path().join("backend")).expect("backend");
        // PKO takes https (and ssh) repositories only: the workspace images trust the server.
        let git = GitRepo::start_smart_https(&tmp.path().join("git"), None)
            .await
            .expect("git server");
        let kubelet = Kubelet::start_with(
            client.clone(),
            &ns,
            &tmp.path().join("pods"),
            KubeletOptions {
                network: PodNetwork::Cluster,
                api: Some(ApiAccess::of(&plane)),
                trusted_certs: git.tls_cert().map(str::to_owned).into_iter().collect(),
                ..KubeletOptions::default()
            },
        )
        .expect("kubelet");
        let fifo = tmp.path().join("slow.fifo");
        fifo::make(&fifo).expect("fifo");
        Self {
            plane,
            client,
            ns,
            system,
            tmp,
            kubelet,
            git,
            flux: FluxSource::new(),
            fifo,
        }
    }

    fn api<K>(&self) -> Api<K>
    where
        K: Resource<Scope = k8s_openapi::NamespaceResourceScope>,
        K::DynamicType: Default,
    {
        Api::namespaced(self.client.clone(), &self.ns)
    }

    fn backend(&self) -> std::path::PathBuf {
        self.tmp.path().join("backend")
    }

    async fn start_pko(&self) -> RunningPeer {
        self.start_pko_with(None).await
    }

    /// PKO's manager, laying its workspace pods out with `agent_image` (its own when `None`).
    async fn start_pko_with(&self, agent_image: Option<&str>) -> RunningPeer {
        let pko = pko_tests::tool_dir("pko").expect("PKO");
        let bins = PeerBinaries {
            pko_rs: operator_binary().expect("pko-operator"),
            pko_rs_crds: repo_root().join("deploy/crds"),
            pko_manager: pko.join("pko-manager"),
            pko_crds: pko.join("crds"),
        };
        pko_peer::start_with(
            Peer::Pko,
            &bins,
            &self.plane,
            &self.system,
            &self.tmp.path().join("pko.log"),
            &PeerOptions {
                cluster_dns: true,
                agent_image: agent_image.map(str::to_owned),
                ..PeerOptions::default()
            },
        )
        .await
        .expect("PKO's manager")
    }

    /// The Programs, the Flux source, the git repository and the four Stacks.
    async fn create_sources_and_stacks(&mut self) {
        let programs: Api<Program> = self.api();
        let pp = PostParams::default();
        programs
            .create(
                &pp,
                &fixtures::program("prog", json!({"outputs": {"message": "from-program"}})),
            )
            .await
            .expect("program");
        programs
            .create(
                &pp,
                &fixtures::program("slow", serde_json::from_str(SLOW_PROGRAM).expect("json")),
            )
            .await
            .expect("slow program");
        let artifact = self
            .flux
            .publish(
                &format!("main@sha1:{}", "a".repeat(40)),
                &[("Pulumi.yaml", &yaml_project("flux", "from-flux"))],
            )
            .await
            .expect("flux artifact");
        flux::set_git_repository(self.client.clone(), &self.ns, "repo", &artifact)
            .await
            .expect("GitRepository");
        let commit = self
            .git
            .commit(
                "main",
                &[("Pulumi.yaml", &yaml_project("gitprog", "from-git"))],
            )
            .expect("commit");
        let backend = self.backend();
        let stacks: Api<Stack> = self.api();
        for (name, source) in [
            ("prog", json!({"programRef": {"name": "prog"}})),
            (
                "flux",
                json!({"fluxSource": {"sourceRef": {"apiVersion": flux::API_VERSION, "kind": "GitRepository", "name": "repo"}}}),
            ),
            (
                "git",
                json!({"projectRepo": self.git.url(), "commit": commit}),
            ),
            (
                IN_FLIGHT,
                json!({"programRef": {"name": "slow"}, "config": {"file": self.fifo.display().to_string()}}),
            ),
        ] {
            stacks
                .create(&pp, &fixtures::file_backend_stack(name, &backend, source))
                .await
                .expect("stack");
        }
    }

    /// Stack `name` once Ready with `message` as its output (any output with `None`).
    async fn deployed(&self, name: &str, message: Option<&str>, what: &str) -> Stack {
        let stacks: Api<Stack> = self.api();
        let found = wait_for(what, WAIT, || async {
            let stack = stacks.get(name).await.ok()?;
            let status = stack.status.as_ref()?;
            let succeeded = status
                .last_update
                .as_ref()
                .is_some_and(|l| l.state.as_deref() == Some("succeeded"));
            let outputs = message.is_none_or(|m| status.outputs.get("message") == Some(&json!(m)));
            (is_true(&status.conditions, "Ready") && succeeded && outputs).then_some(stack)
        })
        .await;
        match found {
            Ok(stack) => stack,
            Err(e) => panic!(
                "{e}: {:?}\n{}",
                stacks.get(name).await.ok().and_then(|s| s.status),
                self.kubelet.logs(name)
            ),
        }
    }

    /// The Updates of Stack `stack`, by name.
    async fn updates_of(&self, stack: &str) -> Vec<Update> {
        let updates: Api<Update> = self.api();
        let mut list = updates
            .list(&ListParams::default().labels(&format!("pulumi.com/stack-name={stack}")))
            .await
            .expect("updates")
            .items;
        list.sort_by_key(ResourceExt::name_any);
        list
    }

    /// PKO's managers left on any object of the namespace, by kind and name.
    async fn pkos_leftovers(&self) -> Vec<String> {
        let kinds = [
            ("pulumi.com", "v1", "Program"),
            ("pulumi.com", "v1", "Stack"),
            ("auto.pulumi.com", "v1alpha1", "Workspace"),
            ("auto.pulumi.com", "v1alpha1", "Update"),
            ("apps", "v1", "StatefulSet"),
            ("", "v1", "Service"),
            ("", "v1", "Pod"),
            ("", "v1", "Secret"),
            ("", "v1", "ConfigMap"),
        ];
        let mut left = Vec::new();
        for (group, version, kind) in kinds {
            let resource = ApiResource::from_gvk(&GroupVersionKind::gvk(group, version, kind));
            let api: Api<DynamicObject> =
                Api::namespaced_with(self.client.clone(), &self.ns, &resource);
            for object in api.list(&ListParams::default()).await.expect("list").items {
                let managers = pkos_managers(object.meta());
                if !managers.is_empty() {
                    left.push(format!("{kind} {}: {managers:?}", object.name_any()));
                }
            }
        }
        left
    }
}

/// What PKO left of a deployed Stack: its last Update and the outputs Secret it wrote.
struct Deployed {
    last_update: String,
    updates: Vec<String>,
    secret: (String, BTreeMap<String, Vec<u8>>),
    /// `status.outputs` as PKO left them.
    outputs: BTreeMap<String, Value>,
}

#[tokio::test]
async fn a_live_pko_install_switches_to_pko_rs_with_no_unneeded_update() {
    let _machine = pko_tests::serial::shared().await;
    let mut scene = Scene::new().await;
    let mut pko = scene.start_pko().await;
    scene.create_sources_and_stacks().await;

    // Under PKO: every Stack of a finished source deployed by PKO's agent, and one `up` held.
    let mut before: BTreeMap<&str, Deployed> = BTreeMap::new();
    for (name, message) in DEPLOYED {
        // PKO's Stack controller can mark a Stack Ready before its Update's outputs Secret is
        // in its cache, and then keeps `status.outputs` empty (seen under load); the outputs
        // are checked in the Secret PKO's Update wrote, and pko-rs must keep the status as is.
        let stack = scene
            .deployed(name, None, &format!("Stack {name} deployed by PKO"))
            .await;
        let pkos_outputs = stack
            .status
            .as_ref()
            .map(|s| s.outputs.clone())
            .unwrap_or_default();
        let last = stack
            .status
            .and_then(|s| s.last_update)
            .and_then(|l| l.name)
            .expect("PKO's last Update");
        let update: Update = scene.api().get(&last).await.expect("PKO's Update");
        let outputs = update
            .status
            .and_then(|s| s.outputs)
            .expect("an outputs Secret");
        let secret: Secret = scene.api().get(&outputs).await.expect("outputs Secret");
        let written = secret
            .data
            .as_ref()
            .and_then(|d| d.get("message"))
            .map(|v| String::from_utf8_lossy(&v.0).into_owned());
        assert_eq!(
            written,
            Some(json!(message).to_string()),
            "{name}: {outputs}"
        );
        let data = secret
            .data
            .unwrap_or_default()
            .into_iter()
            .map(|(k, v)| (k, v.0))
            .collect();
        let updates = scene
            .updates_of(name)
            .await
            .iter()
            .map(ResourceExt::name_any)
            .collect();
        before.insert(
            name,
            Deployed {
                last_update: last,
                updates,
                secret: (outputs, data),
                outputs: pkos_outputs,
            },
        );
    }
    let programs: Api<Program> = scene.api();
    let pkos_artifact = programs
        .get("prog")
        .await
        .expect("Program prog")
        .status
        .and_then(|s| s.artifact)
        .expect("PKO's artifact of prog");
    let held = wait_for("PKO's update of the slow Stack to run", WAIT, || async {
        let updates = scene.updates_of(IN_FLIGHT).await;
        let update = updates.first()?;
        let status = update.status.as_ref()?;
        is_true(&status.conditions, "Progressing").then(|| update.name_any())
    })
    .await
    .unwrap_or_else(|e| {
        panic!(
            "{e}\n{}\n{}",
            pko.log_tail(40),
            scene.kubelet.logs(IN_FLIGHT)
        )
    });
    let statefulsets: Api<StatefulSet> = scene.api();
    let pkos_statefulsets = statefulsets
        .list(&ListParams::default())
        .await
        .expect("sts")
        .items;
    assert_eq!(pkos_statefulsets.len(), 4, "one workspace per Stack");

    // The switch, as docs/migrating-from-pko.md says: PKO stops, pko-rs's CRDs, pko-rs starts.
    pko.stop(Duration::from_secs(30));
    scene
        .plane
        .install_crds(&repo_root().join("deploy/crds"))
        .await
        .expect("pko-rs's CRDs");
    let operator = Operator::start_with_cluster_dns(&scene.plane, OperatorOptions::default())
        .await
        .expect("pko-rs");
    let failed =
        |what: String| -> ! { panic!("{what}\n--- pko-rs\n{}", tail(&operator.log_text(), 80)) };

    // Every StatefulSet adopted: our agent in the pod, which runs, and its Workspace Ready.
    let workspaces: Api<Workspace> = scene.api();
    let pods: Api<Pod> = scene.api();
    for sts in &pkos_statefulsets {
        let name = sts.name_any();
        let ws = name.trim_end_matches("-workspace").to_owned();
        let adopted = wait_for(&format!("{name} adopted and running"), WAIT, || async {
            let sts = statefulsets.get(&name).await.ok()?;
            let pulumi = sts
                .spec
                .as_ref()?
                .template
                .spec
                .as_ref()?
                .containers
                .iter()
                .find(|c| c.name == "pulumi")?
                .clone();
            let ours = pulumi.command.as_ref()?.first()? == "/share/pko-agent";
            let status = sts.status.as_ref()?;
            let rolled = status.observed_generation == sts.metadata.generation
                && status.ready_replicas == Some(1)
                && status.current_revision == status.update_revision;
            let pod = pods.get(&format!("{name}-0")).await.ok()?;
            let pod_ready = pod
                .status
                .as_ref()?
                .conditions
                .iter()
                .flatten()
                .any(|c| c.type_ == "Ready" && c.status == "True");
            let workspace = workspaces.get(&ws).await.ok()?;
            let ws_status = workspace.status.as_ref()?;
            let ws_ready = ws_status.observed_generation == workspace.metadata.generation
                && is_true(&ws_status.conditions, "Ready");
            (ours && rolled && pod_ready && ws_ready).then_some(())
        })
        .await;
        if let Err(e) = adopted {
            failed(format!("{e}\n{}", scene.kubelet.logs(&ws)));
        }
    }

    // The Stacks PKO deployed are synced as they are: PKO's revision adopted, no Update.
    let stacks: Api<Stack> = scene.api();
    for (name, _) in DEPLOYED {
        let synced = wait_for(&format!("Stack {name} synced by pko-rs"), WAIT, || async {
            let stack = stacks.get(name).await.ok()?;
            let status = stack.status.as_ref()?;
            let ours = pkos_managers(stack.meta()).is_empty();
            let current = status.observed_generation == stack.metadata.generation;
            (ours && current && is_true(&status.conditions, "Ready")).then_some(stack)
        })
        .await
        .unwrap_or_else(|e| failed(format!("{e}")));
        let status = synced.status.expect("status");
        let kept = &before[name];
        assert_eq!(
            status.last_update.as_ref().and_then(|l| l.name.as_deref()),
            Some(kept.last_update.as_str()),
            "Stack {name}: PKO's last Update is its last"
        );
        assert_eq!(
            status.outputs, kept.outputs,
            "Stack {name}: PKO's outputs kept"
        );
        assert!(status.current_update.is_none(), "Stack {name}: {status:?}");
        for c in &status.conditions {
            assert!(
                c.type_ == "Ready" || c.status != "True",
                "Stack {name}: {c:?} beside Ready"
            );
        }
    }
    // What the sync above rests on: pko-rs's artifact of the unchanged Program has other bytes
    // than PKO's (file modes, gzip, YAML emitter), so prog was synced by PKO's revision, and
    // not because the digests happen to agree.
    let ours = wait_for("pko-rs's artifact of prog", WAIT, || async {
        let program = programs.get("prog").await.ok()?;
        let artifact = program.status?.artifact?;
        (artifact.url != pkos_artifact.url).then_some(artifact)
    })
    .await
    .unwrap_or_else(|e| failed(format!("{e}")));
    assert_eq!(ours.revision, pkos_artifact.revision, "the same generation");
    assert!(
        ours.digest.is_some() && ours.digest != pkos_artifact.digest,
        "the same bytes as PKO's: {ours:?} {pkos_artifact:?}"
    );
    let adopted_events = |events: Vec<Event>| {
        events
            .iter()
            .filter(|e| e.reason.as_deref() == Some("RevisionAdopted"))
            .filter_map(|e| e.involved_object.name.clone())
            .collect::<Vec<_>>()
    };
    let events: Api<Event> = scene.api();
    let adopted = wait_for("RevisionAdopted events", WAIT, || async {
        let names = adopted_events(events.list(&ListParams::default()).await.ok()?.items);
        (names.contains(&"prog".to_owned()) && names.contains(&"flux".to_owned())).then_some(names)
    })
    .await
    .unwrap_or_else(|e| failed(format!("{e}")));
    assert!(
        !adopted.contains(&"git".to_owned()),
        "a git commit needs no adoption"
    );

    // The Update in flight: run again by pko-rs on the adopted workspace, then completed.
    let resumed = wait_for("the in-flight Update run again by pko-rs", WAIT, || async {
        let update: Update = scene.api().get(&held).await.ok()?;
        let ours = pkos_managers(update.meta()).is_empty();
        let status = update.status?;
        (ours && is_true(&status.conditions, "Progressing")).then_some(())
    })
    .await;
    if let Err(e) = resumed {
        let update: Option<Update> = scene.api().get(&held).await.ok();
        failed(format!("{e}: {:?}", update.and_then(|u| u.status)));
    }
    assert!(
        fifo::write_within(&scene.fifo, "let go", WAIT).await,
        "the resumed up never read its file"
    );
    let slow = wait_for(
        "the slow Stack deployed by its resumed Update",
        WAIT,
        || async {
            let status = stacks.get(IN_FLIGHT).await.ok()?.status?;
            let last = status.last_update.as_ref()?;
            (is_true(&status.conditions, "Ready")
                && last.name.as_deref() == Some(held.as_str())
                && last.state.as_deref() == Some("succeeded")
                && status.outputs.get("content") == Some(&json!("let go")))
            .then_some(())
        },
    )
    .await;
    if let Err(e) = slow {
        failed(format!(
            "{e}: {:?}\n{}",
            stacks.get(IN_FLIGHT).await.ok().and_then(|s| s.status),
            scene.kubelet.logs(IN_FLIGHT)
        ));
    }
    assert_eq!(
        scene
            .updates_of(IN_FLIGHT)
            .await
            .iter()
            .map(ResourceExt::name_any)
            .collect::<Vec<_>>(),
        vec![held.clone()],
        "the in-flight Update is the one run again"
    );

    // History kept: PKO's Updates and their outputs Secrets, unchanged, none added.
    for (name, kept) in &before {
        let now: Vec<String> = scene
            .updates_of(name)
            .await
            .iter()
            .map(ResourceExt::name_any)
            .collect();
        assert_eq!(
            now, kept.updates,
            "Stack {name}: an Update after the switch"
        );
        let secret: Secret = scene
            .api()
            .get(&kept.secret.0)
            .await
            .expect("outputs Secret");
        let data: BTreeMap<String, Vec<u8>> = secret
            .data
            .unwrap_or_default()
            .into_iter()
            .map(|(k, v)| (k, v.0))
            .collect();
        assert_eq!(data, kept.secret.1, "Stack {name}: outputs Secret changed");
    }
    // PKO's finalizers released, and nothing of PKO's managers left anywhere.
    let clean = wait_for("no PKO finalizer or field manager left", WAIT, || async {
        let updates: Api<Update> = scene.api();
        let finalizers: Vec<String> = updates
            .list(&ListParams::default())
            .await
            .ok()?
            .items
            .iter()
            .filter(|u| {
                u.finalizers()
                    .iter()
                    .any(|f| f == "finalizer.stack.pulumi.com")
            })
            .map(ResourceExt::name_any)
            .collect();
        let left = scene.pkos_leftovers().await;
        (finalizers.is_empty() && left.is_empty()).then_some(())
    })
    .await;
    if let Err(e) = clean {
        failed(format!("{e}: {:?}", scene.pkos_leftovers().await));
    }

    // Edits after the switch: a Program, and a Stack's source commit: one `up` each.
    programs
        .patch(
            "prog",
            &PatchParams::default(),
            &Patch::Merge(json!({"program": {"outputs": {"message": "edited-program"}}})),
        )
        .await
        .expect("edit the Program");
    let commit = scene
        .git
        .commit(
            "main",
            &[("Pulumi.yaml", &yaml_project("gitprog", "edited-git"))],
        )
        .expect("commit");
    stacks
        .patch(
            "git",
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": {"commit": commit}})),
        )
        .await
        .expect("edit the Stack");
    scene
        .deployed("prog", Some("edited-program"), "the Program edit deployed")
        .await;
    scene
        .deployed("git", Some("edited-git"), "the Stack edit deployed")
        .await;
    for (name, _) in DEPLOYED {
        let now = scene.updates_of(name).await.len();
        let edited = usize::from(name != "flux");
        assert_eq!(
            now,
            before[name].updates.len() + edited,
            "Stack {name}: one Update per edit"
        );
    }
    drop(operator);
    roll_back_to_pko(&scene, &before_rollback(&scene).await).await;
}

/// Updates per Stack, before the rollback.
async fn before_rollback(scene: &Scene) -> BTreeMap<&'static str, usize> {
    let mut counts = BTreeMap::new();
    for name in DEPLOYED.iter().map(|(n, _)| *n).chain([IN_FLIGHT]) {
        counts.insert(name, scene.updates_of(name).await.len());
    }
    counts
}

/// The rollback of `docs/migrating-from-pko.md`, with pko-rs stopped: its Workspaces deleted
/// (PKO applies its own without forcing, and pko-rs's fields would conflict), the Programs'
/// artifacts cleared, PKO's CRDs, PKO started. PKO makes every workspace again; the Stacks whose source is a Program or a Flux
/// source run `up` once (pko-rs recorded the artifact digest, PKO compares the revision), a git
/// Stack none.
async fn roll_back_to_pko(scene: &Scene, before: &BTreeMap<&'static str, usize>) {
    let workspaces: Api<Workspace> = scene.api();
    workspaces
        .delete_collection(
            &kube::api::DeleteParams::default(),
            &ListParams::default().labels("pulumi.com/component=stack"),
        )
        .await
        .expect("delete the Workspaces");
    let statefulsets: Api<StatefulSet> = scene.api();
    wait_for("the workspace StatefulSets gone", WAIT, || async {
        statefulsets
            .list(&ListParams::default())
            .await
            .ok()?
            .items
            .is_empty()
            .then_some(())
    })
    .await
    .expect("StatefulSets deleted with their Workspaces");
    // The Programs' artifacts name pko-rs's file server, gone with it: PKO's Stack controller
    // could build a workspace from one before PKO's Program controller writes its own, and
    // then waits on that workspace forever. Cleared, a Stack waits for PKO's artifact.
    let programs: Api<Program> = scene.api();
    for program in programs
        .list(&ListParams::default())
        .await
        .expect("programs")
        .items
    {
        programs
            .patch_status(
                &program.name_any(),
                &PatchParams::default(),
                &Patch::Merge(json!({"status": {"artifact": null}})),
            )
            .await
            .expect("clear the artifact");
    }
    let pko_crds = pko_tests::tool_dir("pko").expect("PKO").join("crds");
    scene
        .plane
        .install_crds(&pko_crds)
        .await
        .expect("PKO's CRDs");
    let pko = scene.start_pko().await;
    // The slow Stack runs again under PKO: its program reads the pipe once more.
    let fifo = scene.fifo.clone();
    let feeder = tokio::spawn(async move { fifo::write_within(&fifo, "let go", WAIT).await });
    let stacks: Api<Stack> = scene.api();
    let expected = [
        ("prog", "message", "edited-program"),
        ("flux", "message", "from-flux"),
        ("git", "message", "edited-git"),
        (IN_FLIGHT, "content", "let go"),
    ];
    for (name, key, value) in expected {
        let back = wait_for(
            &format!("Stack {name} Ready under PKO again"),
            WAIT,
            || async {
                let stack = stacks.get(name).await.ok()?;
                let status = stack.status.as_ref()?;
                let pkos = !pkos_managers(stack.meta()).is_empty();
                let succeeded = status
                    .last_update
                    .as_ref()
                    .is_some_and(|l| l.state.as_deref() == Some("succeeded"));
                let current = status.observed_generation == stack.metadata.generation;
                (pkos
                    && current
                    && succeeded
                    && is_true(&status.conditions, "Ready")
                    && status.outputs.get(key) == Some(&json!(value)))
                .then_some(())
            },
        )
        .await;
        if let Err(e) = back {
            panic!(
                "{e}: {:?}\n--- PKO\n{}\n{}",
                stacks.get(name).await.ok().and_then(|s| s.status),
                pko.log_tail(40),
                scene.kubelet.logs(name)
            );
        }
        let runs = usize::from(name != "git");
        let updates = scene.updates_of(name).await;
        let ran = updates.len();
        if name == IN_FLIGHT {
            if ran > before[name] + 1 {
                // Left in the test's output so the next such run says why PKO retried.
                for u in &updates {
                    eprintln!(
                        "switch-over: Update {} of {name}, made {:?}: {:?}",
                        u.name_any(),
                        u.metadata.creation_timestamp,
                        u.status
                    );
                }
                eprintln!("--- PKO\n{}", pko.log_tail(60));
            }
            // Its program reads the pipe again, so PKO must run it: at least once, and Ready
            // above with the value it read. PKO took two Updates for it once in three runs
            // (a retry of PKO's own, not traced yet); the other Stacks' counts are the check
            // that pko-rs's records spare PKO every unneeded `up`.
            assert!(
                ran > before[name],
                "Stack {name}: PKO ran it again after the rollback ({ran} Updates, {} before)",
                before[name]
            );
        } else {
            assert_eq!(
                ran,
                before[name] + runs,
                "Stack {name}: Updates PKO ran after the rollback"
            );
        }
    }
    assert!(feeder.await.unwrap_or(false), "PKO's up of the slow Stack");
    // Every workspace is PKO's again: its pod runs PKO's agent.
    for sts in statefulsets
        .list(&ListParams::default())
        .await
        .expect("sts")
        .items
    {
        let command = sts
            .spec
            .and_then(|s| s.template.spec)
            .and_then(|p| p.containers.into_iter().find(|c| c.name == "pulumi"))
            .and_then(|c| c.command)
            .unwrap_or_default();
        assert_eq!(command.first().map(String::as_str), Some("/share/tini"));
    }
}

fn tail(text: &str, lines: usize) -> String {
    let all: Vec<&str> = text.lines().collect();
    all[all.len().saturating_sub(lines)..].join("\n")
}

/// The processes whose parent is `pid`.
fn children(pid: u32) -> Vec<u32> {
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    entries
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
        .filter(|child| {
            // `pid (comm) state ppid …`: comm may hold spaces, so read after its `)`.
            std::fs::read_to_string(format!("/proc/{child}/stat"))
                .ok()
                .and_then(|stat| {
                    let rest = stat.rsplit_once(')')?.1;
                    rest.split_whitespace().nth(1)?.parse::<u32>().ok()
                })
                == Some(pid)
        })
        .collect()
}

/// The other direction of agent driving: PKO v2.9's real manager, its `AGENT_IMAGE` set to
/// pko-rs's agent image, lays out its own workspace pod (`cp /agent /tini /share/`, `agent
/// init` in `sh -c`, `tini agent -- serve --auth-mode kube`) and drives pko-rs's agent binary
/// through an `up` to success with outputs, calling it with its service account's tokens,
/// which our agent reviews with the apiserver. Then an Update of type refresh with
/// `runProgram`: PKO sends that in `RefreshRequest` field 5, and our agent must run the
/// program (the program reads a named pipe, which a refresh that does not run it never opens).
#[tokio::test]
async fn pkos_real_manager_drives_our_agent_through_one_up() {
    let _machine = pko_tests::serial::shared().await;
    let scene = Scene::new().await;
    let pko = scene.start_pko_with(Some(OUR_AGENT_IMAGE)).await;
    let name = "ours";
    let programs: Api<Program> = scene.api();
    let pp = PostParams::default();
    programs
        .create(
            &pp,
            &fixtures::program(name, serde_json::from_str(SLOW_PROGRAM).expect("json")),
        )
        .await
        .expect("program");
    let stacks: Api<Stack> = scene.api();
    let stack = fixtures::file_backend_stack(
        name,
        &scene.backend(),
        json!({"programRef": {"name": name}, "config": {"file": scene.fifo.display().to_string()}}),
    );
    stacks.create(&pp, &stack).await.expect("stack");
    let fail = |what: String| -> ! {
        panic!(
            "{what}\n--- PKO\n{}\n--- pod\n{}",
            pko.log_tail(40),
            scene.kubelet.logs(name)
        )
    };

    // The up: our agent runs the program, which reads the pipe once.
    if !fifo::write_within(&scene.fifo, "from our agent", WAIT).await {
        fail("the up never ran the program".into());
    }
    let deployed = wait_for(
        "the Stack deployed by PKO through our agent",
        WAIT,
        || async {
            let status = stacks.get(name).await.ok()?.status?;
            let last = status.last_update.as_ref()?;
            (is_true(&status.conditions, "Ready")
                && last.state.as_deref() == Some("succeeded")
                && status.outputs.get("content") == Some(&json!("from our agent")))
            .then_some(())
        },
    )
    .await;
    if let Err(e) = deployed {
        fail(format!(
            "{e}: {:?}",
            stacks.get(name).await.ok().and_then(|s| s.status)
        ));
    }
    let updates = scene.updates_of(name).await;
    assert_eq!(updates.len(), 1, "one Update: {updates:?}");
    let up = &updates[0];
    assert_eq!(
        up.spec.type_.as_ref().map(|t| json!(t)),
        Some(json!("up")),
        "{up:?}"
    );
    let status = up.status.as_ref().expect("the Update's status");
    assert!(is_true(&status.conditions, "Complete"), "{status:?}");
    assert!(!is_true(&status.conditions, "Failed"), "{status:?}");
    let secret: Secret = scene
        .api()
        .get(status.outputs.as_deref().expect("an outputs Secret"))
        .await
        .expect("the outputs Secret");
    let content = secret
        .data
        .unwrap_or_default()
        .remove("content")
        .map(|v| String::from_utf8_lossy(&v.0).into_owned());
    assert_eq!(content.as_deref(), Some(r#""from our agent""#));

    // The pod is PKO's layout with our image, and the process serving is our agent's binary.
    let statefulsets: Api<StatefulSet> = scene.api();
    let sts = statefulsets
        .get(&format!("{name}-workspace"))
        .await
        .expect("PKO's StatefulSet");
    let pod = sts.spec.and_then(|s| s.template.spec).expect("pod spec");
    let images: Vec<&str> = pod
        .init_containers
        .iter()
        .flatten()
        .filter_map(|c| c.image.as_deref())
        .collect();
    assert_eq!(images, [OUR_AGENT_IMAGE, OUR_AGENT_IMAGE], "{pod:?}");
    let pulumi = pod
        .containers
        .iter()
        .find(|c| c.name == "pulumi")
        .expect("pulumi container");
    let argv: Vec<String> = pulumi
        .command
        .iter()
        .flatten()
        .chain(pulumi.args.iter().flatten())
        .cloned()
        .collect();
    assert!(
        argv.windows(2).any(|w| w == ["--auth-mode", "kube"]),
        "{argv:?}"
    );
    let ours = std::fs::canonicalize(pko_tests::agent::agent_binary().expect("agent"))
        .expect("our agent binary");
    let tini = scene.kubelet.agent_pid(name).expect("the pod's PID 1");
    let served_by: Vec<std::path::PathBuf> = children(tini)
        .into_iter()
        .filter_map(|pid| std::fs::read_link(format!("/proc/{pid}/exe")).ok())
        .collect();
    assert!(
        served_by.contains(&ours),
        "tini's children {served_by:?}: none is our agent {ours:?}"
    );

    // A refresh with runProgram, as PKO sends it.
    let workspace: Workspace = scene.api().get(name).await.expect("PKO's Workspace");
    let refresh = fixtures::update(
        "refresh-run-program",
        name,
        &workspace.uid().expect("uid"),
        json!({"workspaceName": name, "stackName": "dev", "type": "refresh", "runProgram": true}),
    );
    let updates: Api<Update> = scene.api();
    updates.create(&pp, &refresh).await.expect("the refresh");
    if !fifo::write_within(&scene.fifo, "from our agent", WAIT).await {
        fail("the refresh with runProgram never ran the program".into());
    }
    let done = wait_for("the refresh complete", WAIT, || async {
        let status = updates.get("refresh-run-program").await.ok()?.status?;
        is_true(&status.conditions, "Complete").then_some(status)
    })
    .await
    .unwrap_or_else(|e| fail(format!("{e}")));
    assert!(!is_true(&done.conditions, "Failed"), "{done:?}");
}

/// PKO's Program status writer landing after pko-rs has the Program in its store (PKO's
/// manager still stopping while pko-rs starts, as in a rolling switch, or PKO's last write
/// reaching pko-rs's watch after its list): pko-rs takes that entry over too, though the write
/// changes nothing but status, which on its own never brings a Program reconcile.
#[tokio::test]
async fn a_program_status_pko_writes_after_pko_rs_started_is_taken_over() {
    let plane = ControlPlane::start(StartOptions::default())
        .await
        .expect("control plane");
    let ns = plane.namespace("late-pko").await.expect("namespace");
    let operator = Operator::start(
        &plane,
        OperatorOptions {
            advertised: None,
            args: vec![format!("--watch-namespace={ns}")],
        },
    )
    .await
    .expect("pko-rs");
    let programs: Api<Program> = Api::namespaced(plane.client(), &ns);
    programs
        .create(
            &PostParams::default(),
            &fixtures::program("late", json!({"outputs": {"message": "late"}})),
        )
        .await
        .expect("program");
    let ours = wait_for("pko-rs's artifact", WAIT, || async {
        let program = programs.get("late").await.ok()?;
        let artifact = program.status?.artifact?;
        artifact.digest.is_some().then_some(artifact)
    })
    .await
    .expect("artifact");
    // What PKO's Program controller applies: its own artifact, as its status writer.
    let pkos = json!({
        "apiVersion": "pulumi.com/v1", "kind": "Program",
        "status": {
            "observedGeneration": 1,
            "artifact": {
                "path": "programs/late/1", "revision": "1",
                "url": "http://pulumi-kubernetes-operator.pulumi-kubernetes-operator/programs/late/1.tar.gz",
                "digest": "sha256:0000000000000000000000000000000000000000000000000000000000000000",
                "lastUpdateTime": "2026-01-01T00:00:00Z",
            },
        },
    });
    programs
        .patch_status(
            "late",
            &PatchParams::apply("pulumi-kubernetes-operator/program-status").force(),
            &Patch::Apply(&pkos),
        )
        .await
        .expect("PKO's status write");
    let taken = wait_for("PKO's status writer taken over", WAIT, || async {
        let program = programs.get("late").await.ok()?;
        let artifact = program.status.as_ref()?.artifact.as_ref()?;
        (pkos_managers(program.meta()).is_empty() && artifact.url == ours.url).then_some(())
    })
    .await;
    if let Err(e) = taken {
        panic!(
            "{e}: {:?}\n{}",
            programs
                .get("late")
                .await
                .ok()
                .map(|p| (pkos_managers(p.meta()), p.status.and_then(|s| s.artifact))),
            tail(&operator.log_text(), 40)
        );
    }
}
