//! The harness as kubelet: the test control plane has no nodes, so this runs workspace pods as
//! local processes.
//!
//! For each workspace StatefulSet in a namespace it: creates the Pod object `<sts>-0`, lays out
//! the pod's volumes in a folder (emptyDir, Secret and ConfigMap volumes), runs the init
//! containers' commands to completion and then the `pulumi` container's command (the agent),
//! with the containers' env resolved as the kubelet does (`$(VAR)` expansion, Secret/ConfigMap
//! keys, field refs) and mount paths mapped to that folder. When the agent listens it marks the
//! StatefulSet and Pod ready and annotates the StatefulSet with the agent's loopback port (read
//! by an operator started with `WORKSPACE_LOCALHOST=127.0.0.1`). A failed init container is
//! reported in the Pod status (as `FallbackToLogsOnError` does) and retried; an agent that dies
//! is restarted; a new pod template revision replaces the pod; a StatefulSet whose Workspace is
//! gone is deleted (standing in for the garbage collector).
//!
//! Images are folders of the files the pods here run from them: pko-rs's images hold the agent
//! at `/usr/local/bin/pko-agent`, `/agent` and `/tini`; PKO's image (any image named
//! `…pulumi-kubernetes-operator…`) holds PKO's real agent (built by `tools/build.sh pko`) at
//! `/agent` and, at `/tini`, pko-rs's agent, which acts as tini when called so (PKO's tini is
//! not built here). Other commands (`cp`, `sh`, `ln`) are the host's; a `sh -c` script has its
//! mount paths mapped like any argument. Each pod gets, as `KUBECONFIG`, a token of its service
//! account where the kubelet would mount one (when that account exists).

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use k8s_openapi::api::apps::v1::StatefulSet;
use k8s_openapi::api::core::v1::{ConfigMap, Container, Pod, Secret, Service};
use kube::api::{Api, DeleteParams, ListParams, Patch, PatchParams, PostParams};
use kube::{Client, ResourceExt};
use pko_api::workspace::Workspace;
use serde_json::{Value, json};
use sha2::{Digest, Sha256};

use crate::agent::{POD_MARKER, agent_binary, free_port, kill_marked};
use crate::kubeauth;
use crate::process::log_tail;
use crate::{ChildGuard, ControlPlane, HarnessError, spawn_guarded, tool_dir};

const COMPONENT_SELECTOR: &str = "auto.pulumi.com/component=workspace";
const DEV_PORT_ANNOTATION: &str = "pko-rs.dev/dev-agent-port";
/// What marks PKO's image (`pulumi/pulumi-kubernetes-operator:v2.9.0`, a mirror of it).
const PKO_IMAGE_NAME: &str = "pulumi-kubernetes-operator";
const INIT_TIMEOUT: Duration = Duration::from_secs(120);
const INIT_RETRY: Duration = Duration::from_secs(10);
const TICK: Duration = Duration::from_millis(300);

/// One "pod": its folder, agent process and what was reported.
struct PodRun {
    revision: String,
    dir: PathBuf,
    agent: Option<ChildGuard>,
    port: u16,
    restarts: i32,
    ready: bool,
    /// When an init container failed, the earliest time to try again.
    retry_at: Option<Instant>,
    /// The next restart of the agent is not reported (no status is written for it).
    unreported_restart: bool,
}

impl Drop for PodRun {
    fn drop(&mut self) {
        if let Some(agent) = self.agent.as_mut() {
            agent.kill();
        }
        kill_marked(&self.dir.display().to_string());
    }
}

#[derive(Default)]
struct State {
    pods: HashMap<String, PodRun>,
}

/// A running kubelet stand-in for one namespace; stops (killing its agents) on drop.
pub struct Kubelet {
    state: Arc<Mutex<State>>,
    task: tokio::task::JoinHandle<()>,
    dir: PathBuf,
}

impl Kubelet {
    /// Starts supervising workspace StatefulSets of `namespace`; pod folders go under `dir`.
    pub fn start(client: Client, namespace: &str, dir: &Path) -> Result<Self, HarnessError> {
        Self::start_with(client, namespace, dir, None)
    }

    /// [`Self::start`] on `plane`, whose pods get a token of their service account (an agent
    /// serving `--auth-mode kube` reviews tokens with it).
    pub fn start_on(
        plane: &ControlPlane,
        namespace: &str,
        dir: &Path,
    ) -> Result<Self, HarnessError> {
        let api = ApiAccess {
            server: plane.server_url(),
            ca: plane.ca_path(),
        };
        Self::start_with(plane.client(), namespace, dir, Some(api))
    }

    fn start_with(
        client: Client,
        namespace: &str,
        dir: &Path,
        api: Option<ApiAccess>,
    ) -> Result<Self, HarnessError> {
        std::fs::create_dir_all(dir)
            .map_err(|e| HarnessError::io(format!("creating {}", dir.display()), e))?;
        let mut env = ImageEnv::new(dir)?;
        env.api = api;
        let state = Arc::new(Mutex::new(State::default()));
        let task = tokio::spawn(run(
            client,
            namespace.to_owned(),
            dir.to_path_buf(),
            env,
            state.clone(),
        ));
        Ok(Self {
            state,
            task,
            dir: dir.to_path_buf(),
        })
    }

    /// SIGKILLs the agent of workspace `workspace` (it is restarted, as a crashed container).
    pub fn kill_agent(&self, workspace: &str) -> bool {
        let mut state = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        let killed = match state
            .pods
            .get_mut(&format!("{workspace}-workspace"))
            .and_then(|p| p.agent.as_mut())
        {
            Some(agent) => {
                agent.kill();
                true
            }
            None => false,
        };
        // The container dies as a whole: the agent and whatever it started.
        if let Some(pod) = state.pods.get(&format!("{workspace}-workspace")) {
            kill_marked(&pod.dir.display().to_string());
        }
        killed
    }

    /// SIGKILLs the agent of workspace `workspace` and restarts it without reporting anything:
    /// the Pod and StatefulSet statuses stay as they were, as when a real kubelet's report of
    /// a container restart has not reached the apiserver yet. What was the agent's `Ready`
    /// stays so; only the agent's own answers (its instance id) tell the new process.
    pub fn restart_agent_unreported(&self, workspace: &str) -> bool {
        {
            let mut state = self.state.lock().unwrap_or_else(PoisonError::into_inner);
            match state.pods.get_mut(&format!("{workspace}-workspace")) {
                Some(pod) => pod.unreported_restart = true,
                None => return false,
            }
        }
        self.kill_agent(workspace)
    }

    /// The agent's pid of workspace `workspace`, if it runs.
    pub fn agent_pid(&self, workspace: &str) -> Option<u32> {
        let state = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        state
            .pods
            .get(&format!("{workspace}-workspace"))
            .and_then(|p| p.agent.as_ref())
            .map(ChildGuard::pid)
    }

    /// The logs (init containers and agent) of workspace `workspace`'s pod, for failure messages.
    pub fn logs(&self, workspace: &str) -> String {
        let dir = self.dir.join(format!("{workspace}-workspace"));
        let mut out = String::new();
        if let Ok(entries) = std::fs::read_dir(&dir) {
            let mut logs: Vec<_> = entries
                .flatten()
                .map(|e| e.path())
                .filter(|p| p.extension().is_some_and(|e| e == "log"))
                .collect();
            logs.sort();
            for log in logs {
                out.push_str(&format!("--- {}\n{}\n", log.display(), log_tail(&log, 60)));
            }
        }
        out
    }
}

impl Drop for Kubelet {
    fn drop(&mut self) {
        self.task.abort();
        let mut state = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        state.pods.clear();
    }
}

/// What the workspace image provides: the pulumi CLI and YAML host on PATH, the Kubernetes
/// provider installed in `~/.pulumi/plugins` (as images that bundle providers do), and no
/// update checks or plugin downloads (the tests are offline); and the files of the agent
/// images, one folder each.
#[derive(Clone)]
struct ImageEnv {
    path: String,
    /// (plugin folder name, binary) of each provider the image has installed.
    providers: Vec<(String, PathBuf)>,
    /// pko-rs's images.
    ours: PathBuf,
    /// PKO's image, when PKO's agent is built.
    pko: Option<PathBuf>,
    /// The apiserver the pods' service-account kubeconfigs name.
    api: Option<ApiAccess>,
}

/// Where the apiserver is, for a pod's kubeconfig.
#[derive(Clone)]
struct ApiAccess {
    server: String,
    ca: PathBuf,
}

/// Makes an image folder: each (path in the image, host file) as a link there, so `cp` copies
/// the file under its name in the image.
fn image_root(root: &Path, files: &[(&str, &Path)]) -> Result<PathBuf, HarnessError> {
    for (inside, host) in files {
        let link = root.join(inside.trim_start_matches('/'));
        if let Some(parent) = link.parent() {
            std::fs::create_dir_all(parent)
                .map_err(|e| HarnessError::io(format!("creating {}", parent.display()), e))?;
        }
        let _ = std::fs::remove_file(&link);
        std::os::unix::fs::symlink(host, &link)
            .map_err(|e| HarnessError::io(format!("linking {}", link.display()), e))?;
    }
    Ok(root.to_path_buf())
}

impl ImageEnv {
    fn new(dir: &Path) -> Result<Self, HarnessError> {
        let agent = agent_binary()?;
        let ours = image_root(
            &dir.join("images/pko-rs"),
            &[
                ("/usr/local/bin/pko-agent", agent.as_path()),
                ("/agent", agent.as_path()),
                ("/tini", agent.as_path()),
            ],
        )?;
        let pko_agent = tool_dir("pko").ok().map(|d| d.join("pko-agent"));
        let pko = match pko_agent.filter(|a| a.is_file()) {
            Some(pko_agent) => Some(image_root(
                &dir.join("images/pko"),
                &[("/agent", pko_agent.as_path()), ("/tini", agent.as_path())],
            )?),
            None => None,
        };
        let bin = tool_dir("pulumi")?;
        let mut providers = Vec::new();
        let kubernetes = bin.join("pulumi-resource-kubernetes");
        if let Ok(version) = std::fs::read_to_string(bin.join("pulumi-resource-kubernetes.version"))
            && kubernetes.is_file()
        {
            providers.push((
                format!("resource-kubernetes-v{}", version.trim()),
                kubernetes,
            ));
        }
        Ok(Self {
            path: format!(
                "{}:{}",
                bin.display(),
                std::env::var("PATH").unwrap_or_else(|_| "/usr/bin:/bin".into())
            ),
            providers,
            ours,
            pko,
            api: None,
        })
    }

    /// The folder of `image`'s files.
    fn root_of(&self, image: Option<&str>) -> Result<&Path, HarnessError> {
        if image.is_some_and(|i| i.contains(PKO_IMAGE_NAME)) {
            return self.pko.as_deref().ok_or_else(|| HarnessError::Missing {
                what: "PKO's agent (pko-agent in `tools/build.sh dir pko`): run `make tools`"
                    .into(),
            });
        }
        Ok(&self.ours)
    }

    /// Lays the image's providers out in `home` as `pulumi plugin install` does (linked, not
    /// copied: the binary is large).
    fn install_providers(&self, home: &Path) -> Result<(), HarnessError> {
        for (folder, binary) in &self.providers {
            let dir = home.join(".pulumi/plugins").join(folder);
            std::fs::create_dir_all(&dir)
                .map_err(|e| HarnessError::io(format!("creating {}", dir.display()), e))?;
            let link = dir.join(binary.file_name().unwrap_or_default());
            if link.symlink_metadata().is_err() {
                std::os::unix::fs::symlink(binary, &link)
                    .map_err(|e| HarnessError::io(format!("linking {}", link.display()), e))?;
            }
        }
        Ok(())
    }
}

async fn run(
    client: Client,
    namespace: String,
    dir: PathBuf,
    image: ImageEnv,
    state: Arc<Mutex<State>>,
) {
    let sts_api: Api<StatefulSet> = Api::namespaced(client.clone(), &namespace);
    loop {
        let list = sts_api
            .list(&ListParams::default().labels(COMPONENT_SELECTOR))
            .await;
        if let Ok(list) = list {
            let names: Vec<String> = list.items.iter().map(ResourceExt::name_any).collect();
            for sts in list.items {
                if let Err(e) = sync(&client, &namespace, &dir, &image, &state, &sts).await {
                    eprintln!("pko-tests kubelet: {}/{}: {e}", namespace, sts.name_any());
                }
            }
            // StatefulSets that are gone: stop their pods.
            let gone: Vec<String> = {
                let st = state.lock().unwrap_or_else(PoisonError::into_inner);
                st.pods
                    .keys()
                    .filter(|k| !names.contains(k))
                    .cloned()
                    .collect()
            };
            for name in gone {
                state
                    .lock()
                    .unwrap_or_else(PoisonError::into_inner)
                    .pods
                    .remove(&name);
                let pods: Api<Pod> = Api::namespaced(client.clone(), &namespace);
                let _ = pods
                    .delete(&format!("{name}-0"), &DeleteParams::default())
                    .await;
            }
        }
        tokio::time::sleep(TICK).await;
    }
}

/// The pod template's hash, as the StatefulSet controller names revisions.
pub(crate) fn revision_of(sts: &StatefulSet) -> String {
    let template = sts
        .spec
        .as_ref()
        .map(|s| serde_json::to_vec(&s.template).unwrap_or_default())
        .unwrap_or_default();
    hex::encode(Sha256::digest(&template))[..10].to_owned()
}

async fn sync(
    client: &Client,
    namespace: &str,
    root: &Path,
    image: &ImageEnv,
    state: &Arc<Mutex<State>>,
    sts: &StatefulSet,
) -> Result<(), HarnessError> {
    let name = sts.name_any();
    // Garbage collection stand-in: the owning Workspace is gone.
    if let Some(owner) = sts
        .owner_references()
        .iter()
        .find(|o| o.kind == "Workspace")
    {
        let workspaces: Api<Workspace> = Api::namespaced(client.clone(), namespace);
        let alive = workspaces
            .get_opt(&owner.name)
            .await
            .map_err(|e| HarnessError::kube("reading the owner Workspace", e))?
            .is_some_and(|w| w.metadata.uid.as_deref() == Some(owner.uid.as_str()));
        if !alive {
            let dp = DeleteParams::background();
            let _ = Api::<StatefulSet>::namespaced(client.clone(), namespace)
                .delete(&name, &dp)
                .await;
            let _ = Api::<Service>::namespaced(client.clone(), namespace)
                .delete(&name, &dp)
                .await;
            let _ = Api::<Secret>::namespaced(client.clone(), namespace)
                .delete(&format!("{name}-auth"), &dp)
                .await;
            return Ok(());
        }
    }
    let revision = revision_of(sts);
    let generation = sts.metadata.generation.unwrap_or(0);
    let (current, agent_died, retry_due) = {
        let mut st = state.lock().unwrap_or_else(PoisonError::into_inner);
        match st.pods.get_mut(&name) {
            Some(p) => {
                let died = p
                    .agent
                    .as_mut()
                    .is_some_and(|a| matches!(a.try_wait(), Ok(Some(_))));
                let retry = p.retry_at.is_some_and(|t| Instant::now() >= t);
                (Some(p.revision.clone()), died, retry)
            }
            None => (None, false, false),
        }
    };
    let pod_name = format!("{name}-0");
    let template = sts
        .spec
        .as_ref()
        .map(|s| s.template.clone())
        .unwrap_or_default();
    let pod_spec = template.spec.clone().unwrap_or_default();

    if current.as_deref() != Some(&revision) {
        // A new pod: fresh folder, fresh Pod object.
        let dir = root.join(&name);
        state
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .pods
            .remove(&name);
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir)
            .map_err(|e| HarnessError::io(format!("creating {}", dir.display()), e))?;
        set_sts_status(client, namespace, &name, generation, &revision, false).await?;
        create_pod(client, namespace, &pod_name, &name, &revision, &template).await?;
        state
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .pods
            .insert(
                name.clone(),
                PodRun {
                    revision: revision.clone(),
                    dir: dir.clone(),
                    agent: None,
                    port: free_port()?,
                    restarts: 0,
                    ready: false,
                    retry_at: Some(Instant::now()),
                    unreported_restart: false,
                },
            );
        return start_pod(client, namespace, &pod_name, &name, &pod_spec, image, state).await;
    }
    if retry_due {
        return start_pod(client, namespace, &pod_name, &name, &pod_spec, image, state).await;
    }
    if agent_died {
        let reported = {
            let mut st = state.lock().unwrap_or_else(PoisonError::into_inner);
            match st.pods.get_mut(&name) {
                Some(p) if p.unreported_restart => {
                    p.unreported_restart = false;
                    p.agent = None;
                    false
                }
                Some(p) => {
                    p.agent = None;
                    p.ready = false;
                    p.restarts += 1;
                    true
                }
                None => true,
            }
        };
        if reported {
            set_sts_status(client, namespace, &name, generation, &revision, false).await?;
            set_pod_ready(client, namespace, &pod_name, false, state, &name, None).await?;
        }
        // Restart the container (its folder, the emptyDir, is kept).
        return start_agent(client, namespace, &pod_name, &name, &pod_spec, image, state).await;
    }
    // Keep observedGeneration current (the operator re-applies the StatefulSet).
    let ready = {
        let st = state.lock().unwrap_or_else(PoisonError::into_inner);
        st.pods.get(&name).is_some_and(|p| p.ready)
    };
    let observed = sts.status.as_ref().and_then(|s| s.observed_generation);
    if ready && observed != Some(generation) {
        set_sts_status(client, namespace, &name, generation, &revision, true).await?;
    }
    Ok(())
}

pub(crate) async fn set_sts_status(
    client: &Client,
    namespace: &str,
    name: &str,
    generation: i64,
    revision: &str,
    ready: bool,
) -> Result<(), HarnessError> {
    let n = i32::from(ready);
    let rev = format!("{name}-{revision}");
    let patch = json!({"status": {
        "observedGeneration": generation,
        "replicas": 1,
        "readyReplicas": n,
        "availableReplicas": n,
        "currentReplicas": 1,
        "updatedReplicas": 1,
        "currentRevision": rev,
        "updateRevision": rev,
    }});
    Api::<StatefulSet>::namespaced(client.clone(), namespace)
        .patch_status(name, &PatchParams::default(), &Patch::Merge(&patch))
        .await
        .map_err(|e| HarnessError::kube("writing the StatefulSet status", e))?;
    Ok(())
}

pub(crate) async fn create_pod(
    client: &Client,
    namespace: &str,
    pod_name: &str,
    sts: &str,
    revision: &str,
    template: &k8s_openapi::api::core::v1::PodTemplateSpec,
) -> Result<(), HarnessError> {
    let pods: Api<Pod> = Api::namespaced(client.clone(), namespace);
    if pods
        .get_opt(pod_name)
        .await
        .map_err(|e| HarnessError::kube("reading the pod", e))?
        .is_some()
    {
        let _ = pods
            .delete(pod_name, &DeleteParams::default().grace_period(0))
            .await;
        for _ in 0..50 {
            if pods.get_opt(pod_name).await.ok().flatten().is_none() {
                break;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
    let mut labels: BTreeMap<String, String> = template
        .metadata
        .as_ref()
        .and_then(|m| m.labels.clone())
        .unwrap_or_default();
    labels.insert(
        "controller-revision-hash".into(),
        format!("{sts}-{revision}"),
    );
    let mut pod = Pod {
        metadata: kube::api::ObjectMeta {
            name: Some(pod_name.to_owned()),
            namespace: Some(namespace.to_owned()),
            labels: Some(labels),
            annotations: template
                .metadata
                .as_ref()
                .and_then(|m| m.annotations.clone()),
            ..Default::default()
        },
        spec: template.spec.clone(),
        status: None,
    };
    if let Some(spec) = pod.spec.as_mut() {
        spec.node_name = Some("pko-tests-kubelet".into());
    }
    pods.create(&PostParams::default(), &pod)
        .await
        .map_err(|e| HarnessError::kube("creating the workspace pod", e))?;
    Ok(())
}

/// Runs the init containers, then the agent.
async fn start_pod(
    client: &Client,
    namespace: &str,
    pod_name: &str,
    sts: &str,
    spec: &k8s_openapi::api::core::v1::PodSpec,
    image: &ImageEnv,
    state: &Arc<Mutex<State>>,
) -> Result<(), HarnessError> {
    let dir = {
        let mut st = state.lock().unwrap_or_else(PoisonError::into_inner);
        match st.pods.get_mut(sts) {
            Some(p) => {
                p.retry_at = None;
                p.dir.clone()
            }
            None => return Ok(()),
        }
    };
    let volumes = lay_out_volumes(client, namespace, spec, &dir).await?;
    let mut statuses = Vec::new();
    for c in spec.init_containers.as_deref().unwrap_or_default() {
        let (cmd, _) =
            container_command(client, namespace, pod_name, spec, c, &volumes, &dir, image).await?;
        let log = dir.join(format!("init-{}.log", c.name));
        let mut guard = spawn_guarded(cmd, &format!("init {}", c.name), &log)?;
        let deadline = Instant::now() + INIT_TIMEOUT;
        let status = loop {
            if let Ok(Some(status)) = guard.try_wait() {
                break Some(status);
            }
            if Instant::now() > deadline {
                guard.kill();
                break None;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        };
        let code = status.and_then(|s| s.code()).unwrap_or(137);
        if code != 0 {
            let message = log_tail(&log, 20);
            statuses.push(json!({
                "name": c.name, "ready": false, "restartCount": 0, "image": c.image, "imageID": "",
                "state": {"terminated": {"exitCode": code, "reason": "Error", "message": message}},
            }));
            write_pod_status(client, namespace, pod_name, json!({
                "phase": "Pending",
                "initContainerStatuses": statuses,
                "conditions": [{"type": "Ready", "status": "False", "reason": "PodInitializing"}],
            }))
            .await?;
            let mut st = state.lock().unwrap_or_else(PoisonError::into_inner);
            if let Some(p) = st.pods.get_mut(sts) {
                p.retry_at = Some(Instant::now() + INIT_RETRY);
            }
            return Ok(());
        }
        statuses.push(json!({
            "name": c.name, "ready": true, "restartCount": 0, "image": c.image, "imageID": "",
            "state": {"terminated": {"exitCode": 0, "reason": "Completed"}},
        }));
    }
    write_pod_status(
        client,
        namespace,
        pod_name,
        json!({
            "phase": "Running",
            "initContainerStatuses": statuses,
        }),
    )
    .await?;
    start_agent(client, namespace, pod_name, sts, spec, image, state).await
}

/// Starts the `pulumi` container's command and marks everything ready once it listens.
async fn start_agent(
    client: &Client,
    namespace: &str,
    pod_name: &str,
    sts: &str,
    spec: &k8s_openapi::api::core::v1::PodSpec,
    image: &ImageEnv,
    state: &Arc<Mutex<State>>,
) -> Result<(), HarnessError> {
    let (dir, port) = {
        let st = state.lock().unwrap_or_else(PoisonError::into_inner);
        match st.pods.get(sts) {
            Some(p) => (p.dir.clone(), p.port),
            None => return Ok(()),
        }
    };
    let Some(container) = spec.containers.iter().find(|c| c.name == "pulumi") else {
        return Ok(());
    };
    let volumes = lay_out_volumes(client, namespace, spec, &dir).await?;
    let (mut cmd, _) = container_command(
        client, namespace, pod_name, spec, container, &volumes, &dir, image,
    )
    .await?;
    cmd.args(["--host", "127.0.0.1", "--port", &port.to_string()]);
    let log = dir.join("agent.log");
    let mut guard = spawn_guarded(cmd, "workspace agent", &log)?;
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        if let Ok(Some(_)) = guard.try_wait() {
            // Crashed at start: reported as not ready; retried at the next tick.
            let mut st = state.lock().unwrap_or_else(PoisonError::into_inner);
            if let Some(p) = st.pods.get_mut(sts) {
                p.agent = Some(guard);
                p.restarts += 1;
            }
            return Ok(());
        }
        if tokio::net::TcpStream::connect(("127.0.0.1", port))
            .await
            .is_ok()
        {
            break;
        }
        if Instant::now() > deadline {
            return Err(HarnessError::Missing {
                what: format!(
                    "the agent of {sts} listening on {port}; log:\n{}",
                    log_tail(&log, 30)
                ),
            });
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    {
        let mut st = state.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(p) = st.pods.get_mut(sts) {
            p.agent = Some(guard);
            p.ready = true;
        }
    }
    let current = annotate_dev_port(client, namespace, sts, port).await?;
    let revision = revision_of(&current);
    set_pod_ready(client, namespace, pod_name, true, state, sts, Some(port)).await?;
    set_sts_status(
        client,
        namespace,
        sts,
        current.metadata.generation.unwrap_or(0),
        &revision,
        true,
    )
    .await
}

/// Tells an operator started with `--workspace-localhost=<host>` the loopback port of the
/// StatefulSet's agent; returns the StatefulSet as patched.
pub(crate) async fn annotate_dev_port(
    client: &Client,
    namespace: &str,
    sts: &str,
    port: u16,
) -> Result<StatefulSet, HarnessError> {
    let patch = json!({"metadata": {"annotations": {DEV_PORT_ANNOTATION: port.to_string()}}});
    Api::<StatefulSet>::namespaced(client.clone(), namespace)
        .patch(sts, &PatchParams::default(), &Patch::Merge(&patch))
        .await
        .map_err(|e| HarnessError::kube("annotating the StatefulSet", e))
}

async fn set_pod_ready(
    client: &Client,
    namespace: &str,
    pod_name: &str,
    ready: bool,
    state: &Arc<Mutex<State>>,
    sts: &str,
    _port: Option<u16>,
) -> Result<(), HarnessError> {
    let restarts = state
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
        .pods
        .get(sts)
        .map(|p| p.restarts)
        .unwrap_or(0);
    write_pod_ready(client, namespace, pod_name, ready, restarts).await
}

/// The status of a pod whose one container (`pulumi`) is ready, or crash-looping.
pub(crate) async fn write_pod_ready(
    client: &Client,
    namespace: &str,
    pod_name: &str,
    ready: bool,
    restarts: i32,
) -> Result<(), HarnessError> {
    let flag = if ready { "True" } else { "False" };
    write_pod_status(client, namespace, pod_name, json!({
        "phase": "Running",
        "podIP": "127.0.0.1",
        "conditions": [{"type": "Ready", "status": flag}, {"type": "ContainersReady", "status": flag}],
        "containerStatuses": [{
            "name": "pulumi", "ready": ready, "restartCount": restarts, "image": "", "imageID": "",
            "started": ready,
            "state": if ready { json!({"running": {}}) } else { json!({"waiting": {"reason": "CrashLoopBackOff"}}) },
        }],
    }))
    .await
}

async fn write_pod_status(
    client: &Client,
    namespace: &str,
    pod_name: &str,
    status: Value,
) -> Result<(), HarnessError> {
    Api::<Pod>::namespaced(client.clone(), namespace)
        .patch_status(
            pod_name,
            &PatchParams::default(),
            &Patch::Merge(&json!({"status": status})),
        )
        .await
        .map_err(|e| HarnessError::kube("writing the pod status", e))?;
    Ok(())
}

/// Volume name → host folder; Secret and ConfigMap volumes are written out.
async fn lay_out_volumes(
    client: &Client,
    namespace: &str,
    spec: &k8s_openapi::api::core::v1::PodSpec,
    dir: &Path,
) -> Result<HashMap<String, PathBuf>, HarnessError> {
    let mut out = HashMap::new();
    for v in spec.volumes.as_deref().unwrap_or_default() {
        let path = dir.join("volumes").join(&v.name);
        std::fs::create_dir_all(&path)
            .map_err(|e| HarnessError::io(format!("creating {}", path.display()), e))?;
        let files: BTreeMap<String, Vec<u8>> = if let Some(s) = &v.secret {
            let name = s.secret_name.clone().unwrap_or_default();
            Api::<Secret>::namespaced(client.clone(), namespace)
                .get_opt(&name)
                .await
                .map_err(|e| HarnessError::kube(format!("reading Secret {name}"), e))?
                .and_then(|s| s.data)
                .unwrap_or_default()
                .into_iter()
                .map(|(k, v)| (k, v.0))
                .collect()
        } else if let Some(c) = &v.config_map {
            let name = c.name.clone();
            Api::<ConfigMap>::namespaced(client.clone(), namespace)
                .get_opt(&name)
                .await
                .map_err(|e| HarnessError::kube(format!("reading ConfigMap {name}"), e))?
                .and_then(|c| c.data)
                .unwrap_or_default()
                .into_iter()
                .map(|(k, v)| (k, v.into_bytes()))
                .collect()
        } else {
            BTreeMap::new()
        };
        for (k, data) in files {
            let file = path.join(&k);
            std::fs::write(&file, data)
                .map_err(|e| HarnessError::io(format!("writing {}", file.display()), e))?;
        }
        out.insert(v.name.clone(), path);
    }
    Ok(out)
}

/// The command of a container, with env resolved and mount paths mapped to the pod folder.
#[allow(clippy::too_many_arguments)]
async fn container_command(
    client: &Client,
    namespace: &str,
    pod_name: &str,
    spec: &k8s_openapi::api::core::v1::PodSpec,
    c: &Container,
    volumes: &HashMap<String, PathBuf>,
    dir: &Path,
    image: &ImageEnv,
) -> Result<(Command, Vec<(String, String)>), HarnessError> {
    let mut mounts: Vec<(String, PathBuf)> = c
        .volume_mounts
        .as_deref()
        .unwrap_or_default()
        .iter()
        .filter_map(|m| {
            volumes
                .get(&m.name)
                .map(|p| (m.mount_path.clone(), p.clone()))
        })
        .collect();
    mounts.sort_by_key(|(m, _)| std::cmp::Reverse(m.len()));
    let map_path = |s: &str| -> String {
        for (mount, host) in &mounts {
            if s == mount || s.starts_with(&format!("{mount}/")) {
                return format!("{}{}", host.display(), &s[mount.len()..]);
            }
            if let Some((flag, value)) = s.split_once('=')
                && (value == mount || value.starts_with(&format!("{mount}/")))
            {
                return format!("{flag}={}{}", host.display(), &value[mount.len()..]);
            }
        }
        s.to_owned()
    };
    let home = dir.join("home");
    std::fs::create_dir_all(&home).map_err(|e| HarnessError::io("creating HOME", e))?;
    image.install_providers(&home)?;
    let mut env: Vec<(String, String)> = vec![
        ("PATH".into(), image.path.clone()),
        ("HOME".into(), home.display().to_string()),
        // The CLI finds its home from the user database, not $HOME: the image user's home here.
        (
            "PULUMI_HOME".into(),
            home.join(".pulumi").display().to_string(),
        ),
        ("PULUMI_SKIP_UPDATE_CHECK".into(), "true".into()),
        (
            "PULUMI_DISABLE_AUTOMATIC_PLUGIN_ACQUISITION".into(),
            "true".into(),
        ),
        (POD_MARKER.into(), dir.display().to_string()),
    ];
    let set = |env: &mut Vec<(String, String)>, k: String, v: String| {
        env.retain(|(name, _)| *name != k);
        env.push((k, v));
    };
    for from in c.env_from.as_deref().unwrap_or_default() {
        let prefix = from.prefix.clone().unwrap_or_default();
        if let Some(r) = &from.config_map_ref {
            let data = Api::<ConfigMap>::namespaced(client.clone(), namespace)
                .get_opt(&r.name)
                .await
                .map_err(|e| HarnessError::kube("reading an envFrom ConfigMap", e))?
                .and_then(|c| c.data)
                .unwrap_or_default();
            for (k, v) in data {
                set(&mut env, format!("{prefix}{k}"), v);
            }
        }
        if let Some(r) = &from.secret_ref {
            let data = Api::<Secret>::namespaced(client.clone(), namespace)
                .get_opt(&r.name)
                .await
                .map_err(|e| HarnessError::kube("reading an envFrom Secret", e))?
                .and_then(|s| s.data)
                .unwrap_or_default();
            for (k, v) in data {
                set(
                    &mut env,
                    format!("{prefix}{k}"),
                    String::from_utf8_lossy(&v.0).into_owned(),
                );
            }
        }
    }
    for e in c.env.as_deref().unwrap_or_default() {
        let value = match (&e.value, &e.value_from) {
            (Some(v), _) => Some(expand(v, &env)),
            (None, Some(from)) => {
                if let Some(r) = &from.secret_key_ref {
                    Api::<Secret>::namespaced(client.clone(), namespace)
                        .get_opt(&r.name)
                        .await
                        .map_err(|e| HarnessError::kube("reading a secretKeyRef", e))?
                        .and_then(|s| s.data)
                        .and_then(|d| {
                            d.get(&r.key)
                                .map(|b| String::from_utf8_lossy(&b.0).into_owned())
                        })
                } else if let Some(r) = &from.config_map_key_ref {
                    Api::<ConfigMap>::namespaced(client.clone(), namespace)
                        .get_opt(&r.name)
                        .await
                        .map_err(|e| HarnessError::kube("reading a configMapKeyRef", e))?
                        .and_then(|c| c.data)
                        .and_then(|d| d.get(&r.key).cloned())
                } else if let Some(f) = &from.field_ref {
                    match f.field_path.as_str() {
                        "metadata.namespace" => Some(namespace.to_owned()),
                        "metadata.name" => Some(pod_name.to_owned()),
                        "spec.serviceAccountName" => spec.service_account_name.clone(),
                        _ => None,
                    }
                } else {
                    None
                }
            }
            (None, None) => Some(String::new()),
        };
        if let Some(v) = value {
            set(&mut env, e.name.clone(), map_path(&v));
        }
    }
    if let Some(kubeconfig) = service_account_kubeconfig(client, namespace, spec, dir, image).await
    {
        set(
            &mut env,
            "KUBECONFIG".into(),
            kubeconfig.display().to_string(),
        );
    }
    let root = image.root_of(c.image.as_deref())?;
    let in_image = |s: String| -> String {
        let file = root.join(s.trim_start_matches('/'));
        if s.starts_with('/') && file.symlink_metadata().is_ok() {
            file.display().to_string()
        } else {
            s
        }
    };
    let mut argv: Vec<String> = c.command.clone().unwrap_or_default();
    argv.extend(c.args.clone().unwrap_or_default());
    let mut argv: Vec<String> = argv
        .iter()
        .map(|a| in_image(map_path(&expand(a, &env))))
        .collect();
    // `sh -c SCRIPT`: the script's paths are the container's too.
    if argv.len() >= 3 && argv[0] == "sh" && argv[1] == "-c" {
        argv[2] = map_script(&argv[2], &mounts);
    }
    let Some((program, rest)) = argv.split_first() else {
        return Err(HarnessError::Missing {
            what: format!("a command in container {}", c.name),
        });
    };
    let mut cmd = Command::new(program);
    cmd.args(rest)
        .env_clear()
        .envs(env.iter().map(|(k, v)| (k, v)));
    let workdir = c
        .working_dir
        .as_deref()
        .map(map_path)
        .map(PathBuf::from)
        .filter(|p| p.is_dir())
        .unwrap_or_else(|| dir.to_path_buf());
    cmd.current_dir(workdir);
    Ok((cmd, env))
}

/// A kubeconfig with a token of the pod's service account, where the kubelet would mount the
/// account's token (none when the account does not exist: no test asked for it).
async fn service_account_kubeconfig(
    client: &Client,
    namespace: &str,
    spec: &k8s_openapi::api::core::v1::PodSpec,
    dir: &Path,
    image: &ImageEnv,
) -> Option<PathBuf> {
    let api = image.api.as_ref()?;
    let account = spec.service_account_name.as_deref().unwrap_or("default");
    let token = kubeauth::token(client, namespace, account, None)
        .await
        .ok()?;
    let path = dir.join("serviceaccount.kubeconfig");
    crate::control_plane::write_kubeconfig(&path, &api.server, &api.ca, &token).ok()?;
    Some(path)
}

/// The mount paths of a shell script mapped to the pod folder: each place a mount path stands
/// as a whole path (followed by `/`, a quote, a space or the end).
fn map_script(script: &str, mounts: &[(String, PathBuf)]) -> String {
    let mut out = script.to_owned();
    for (mount, host) in mounts {
        let mut mapped = String::new();
        let mut rest = out.as_str();
        while let Some(i) = rest.find(mount.as_str()) {
            let before = rest[..i].chars().last();
            let after = rest[i + mount.len()..].chars().next();
            let starts = before.is_none_or(|c| !(c.is_alphanumeric() || c == '/' || c == '.'));
            let ends = after.is_none_or(|c| matches!(c, '/' | '"' | '\'' | ' ' | '\n' | '\t'));
            mapped.push_str(&rest[..i]);
            if starts && ends {
                mapped.push_str(&host.display().to_string());
            } else {
                mapped.push_str(mount);
            }
            rest = &rest[i + mount.len()..];
        }
        mapped.push_str(rest);
        out = mapped;
    }
    out
}

/// Kubernetes' `$(VAR)` expansion (`$$` escapes); unknown references stay as they are.
fn expand(s: &str, env: &[(String, String)]) -> String {
    let mut out = String::new();
    let mut rest = s;
    while let Some(i) = rest.find('$') {
        out.push_str(&rest[..i]);
        let after = &rest[i + 1..];
        if let Some(tail) = after.strip_prefix('$') {
            out.push('$');
            rest = tail;
        } else if let Some(inner) = after.strip_prefix('(')
            && let Some(end) = inner.find(')')
        {
            let name = &inner[..end];
            match env.iter().rev().find(|(k, _)| k == name) {
                Some((_, v)) => out.push_str(v),
                None => out.push_str(&format!("$({name})")),
            }
            rest = &inner[end + 1..];
        } else {
            out.push('$');
            rest = after;
        }
    }
    out.push_str(rest);
    out
}
