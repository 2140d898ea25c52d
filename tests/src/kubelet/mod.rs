//! The harness as kubelet: the test control plane has no nodes, so this runs workspace pods as
//! local processes.
//!
//! For each workspace StatefulSet in a namespace it: creates the Pod object `<sts>-0`, lays out
//! the pod's volumes in a folder (emptyDir, Secret and ConfigMap volumes), runs the init
//! containers' commands to completion and then the `pulumi` container's command (the agent),
//! with the containers' env resolved as the kubelet does (`$(VAR)` expansion, Secret/ConfigMap
//! keys, field and resource refs) and the paths of volume mounts and image files mapped to host
//! paths (and, for mounts under a host folder such as `/var/run/` whose paths the process is
//! only told at run time, made at those paths in a private mount namespace: `mount_script`)
//! (`image.rs`: this project's agent in every image, also at `/agent` and `/tini` as its
//! image has it for PKO's pod layout, and PKO's agent image with PKO's agent at `/agent`, so
//! PKO's own pod spec runs PKO's agent). A failed init container is reported in the
//! Pod status (as `FallbackToLogsOnError` does) and retried; an agent that dies is restarted; a
//! new pod template revision replaces the pod; a StatefulSet scaled to 0 replicas has its pod
//! stopped and deleted (a new one starts when it is scaled up again); a StatefulSet whose
//! Workspace is gone is deleted (standing in for the garbage collector).
//!
//! The pod network ([`PodNetwork`]): by default an agent listens on a free port of 127.0.0.1,
//! announced on the StatefulSet (read by an operator started with `--workspace-localhost`).
//! With [`PodNetwork::Cluster`] each StatefulSet's pod gets an address of its own
//! (`127.a.b.c`, kept across restarts), its agent listens there on the port its spec declares,
//! and the Service's names resolve to it in the [`ClusterDns`] (how PKO's manager, which dials
//! `<ws>-workspace.<ns>:50051`, reaches several agents).
//!
//! With [`KubeletOptions::api`] ([`Kubelet::start_on`]), each pod gets a kubeconfig holding a
//! token of its service account (minted with TokenRequest, as the kubelet projects one) in
//! `KUBECONFIG`: what a process in a pod reaches the apiserver with (an agent serving
//! `--auth-mode kube` checks its callers' tokens with TokenReview and SubjectAccessReview). No
//! controller makes the `default` account here: without it a pod runs with no token; a pod
//! whose named service account does not exist does not start, as in a cluster.

use std::collections::{BTreeMap, HashMap};
use std::net::Ipv4Addr;
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
use crate::cluster_dns::{ClusterDns, random_loopback};
use crate::process::log_tail;
use crate::{ChildGuard, ControlPlane, HarnessError, spawn_guarded, tool_dir};

mod image;
pub use image::{AGENT_IN_IMAGE, ImageFiles, PKO_AGENT_IMAGE};
use image::{Images, PathMap};

const COMPONENT_SELECTOR: &str = "auto.pulumi.com/component=workspace";
const DEV_PORT_ANNOTATION: &str = "pko-rs.dev/dev-agent-port";
const INIT_TIMEOUT: Duration = Duration::from_secs(120);
const INIT_RETRY: Duration = Duration::from_secs(10);
const TICK: Duration = Duration::from_millis(300);
/// The agent port of a container that declares none (PKO's and ours).
const DEFAULT_AGENT_PORT: u16 = 50051;
/// How long a pod's service-account token lives (the kubelet refreshes its projected tokens;
/// a test ends long before).
const TOKEN_SECONDS: i64 = 24 * 3600;

/// How pods are reached.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum PodNetwork {
    /// The agent listens on a free port of 127.0.0.1, announced in the StatefulSet's
    /// `pko-rs.dev/dev-agent-port` annotation (for an operator run with
    /// `--workspace-localhost=127.0.0.1`).
    #[default]
    Loopback,
    /// Each StatefulSet's pod has an address of its own, its agent listens there on the port
    /// its spec declares, and `<service>.<namespace>` resolves to it in the [`ClusterDns`].
    Cluster,
}

/// How the pods' processes reach the apiserver.
#[derive(Clone, Debug)]
pub struct ApiAccess {
    pub server: String,
    pub ca: PathBuf,
}

impl ApiAccess {
    pub fn of(plane: &ControlPlane) -> Self {
        Self {
            server: plane.server_url(),
            ca: plane.ca_path(),
        }
    }
}

/// What a [`Kubelet`] does beyond the defaults.
#[derive(Clone, Debug, Default)]
pub struct KubeletOptions {
    pub network: PodNetwork,
    /// Each pod gets a kubeconfig with its service account's token (`KUBECONFIG`).
    pub api: Option<ApiAccess>,
    /// Image files beyond this project's agent and PKO's agent image (they win).
    pub images: Vec<ImageFiles>,
    /// Certificates (PEM) every image trusts beside the host's, as an image built with a
    /// company CA does: given to containers as `SSL_CERT_FILE` (Go, OpenSSL) and
    /// `GIT_SSL_CAINFO` (git).
    pub trusted_certs: Vec<String>,
    /// Each `pulumi` command a workspace's agent (this project's) runs is logged, one line per
    /// start, for [`Kubelet::pulumi_calls`].
    pub log_pulumi_calls: bool,
}

/// One "pod": its folder, agent process and what was reported.
struct PodRun {
    /// Tells this pod from a later one of the same StatefulSet (a start still running for an
    /// older pod sees it is gone and stops).
    id: u64,
    revision: String,
    /// What it runs: the template it was made from (a pod spec does not change; under
    /// `OnDelete` the StatefulSet's template may have moved on).
    spec: k8s_openapi::api::core::v1::PodSpec,
    dir: PathBuf,
    agent: Option<ChildGuard>,
    /// Where the agent listens.
    ip: Ipv4Addr,
    port: u16,
    restarts: i32,
    ready: bool,
    /// When an init container failed, the earliest time to try again.
    retry_at: Option<Instant>,
    /// The next restart of the agent is not reported (no status is written for it).
    unreported_restart: bool,
    /// The task starting the pod's containers, while it runs.
    starting: Option<tokio::task::AbortHandle>,
}

impl Drop for PodRun {
    fn drop(&mut self) {
        if let Some(start) = self.starting.take() {
            start.abort();
        }
        if let Some(agent) = self.agent.as_mut() {
            agent.kill();
        }
        kill_marked(&self.dir.display().to_string());
    }
}

#[derive(Default)]
struct State {
    pods: HashMap<String, PodRun>,
    /// With the cluster network: each StatefulSet's pod address, kept across its pods.
    addresses: HashMap<String, Ipv4Addr>,
    next_id: u64,
}

/// What every pod of one kubelet shares.
struct Node {
    client: Client,
    namespace: String,
    root: PathBuf,
    image: ImageEnv,
    options: KubeletOptions,
    state: Arc<Mutex<State>>,
}

impl Node {
    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Runs `f` on pod `id` of StatefulSet `sts`, if it is still the current one.
    fn with_pod<R>(&self, sts: &str, id: u64, f: impl FnOnce(&mut PodRun) -> R) -> Option<R> {
        let mut state = self.state();
        state.pods.get_mut(sts).filter(|p| p.id == id).map(f)
    }

    fn current(&self, sts: &str, id: u64) -> bool {
        self.with_pod(sts, id, |_| ()).is_some()
    }
}

/// A running kubelet stand-in for one namespace; stops (killing its agents) on drop.
pub struct Kubelet {
    node: Arc<Node>,
    task: tokio::task::JoinHandle<()>,
}

/// The current agent pid of each workspace, readable while the kubelet runs.
#[derive(Clone)]
pub struct AgentPids(Arc<Node>);

impl AgentPids {
    /// The agent's pid of workspace `workspace`, if it runs now.
    pub fn pid(&self, workspace: &str) -> Option<u32> {
        let state = self.0.state();
        state
            .pods
            .get(&format!("{workspace}-workspace"))
            .and_then(|p| p.agent.as_ref())
            .map(ChildGuard::pid)
    }
}

impl Kubelet {
    /// Starts supervising workspace StatefulSets of `namespace`; pod folders go under `dir`.
    pub fn start(client: Client, namespace: &str, dir: &Path) -> Result<Self, HarnessError> {
        Self::start_with(client, namespace, dir, KubeletOptions::default())
    }

    /// [`Self::start`] on `plane`, whose pods get a token of their service account (an agent
    /// serving `--auth-mode kube` reviews tokens with it).
    pub fn start_on(
        plane: &ControlPlane,
        namespace: &str,
        dir: &Path,
    ) -> Result<Self, HarnessError> {
        let options = KubeletOptions {
            api: Some(ApiAccess::of(plane)),
            ..KubeletOptions::default()
        };
        Self::start_with(plane.client(), namespace, dir, options)
    }

    /// [`Self::start`] with a pod network, API access and images of `options`.
    pub fn start_with(
        client: Client,
        namespace: &str,
        dir: &Path,
        options: KubeletOptions,
    ) -> Result<Self, HarnessError> {
        std::fs::create_dir_all(dir)
            .map_err(|e| HarnessError::io(format!("creating {}", dir.display()), e))?;
        if options.network == PodNetwork::Cluster {
            ClusterDns::shared()?;
        }
        let image = ImageEnv::new(&options, &dir.join(".images"))?;
        let node = Arc::new(Node {
            client,
            namespace: namespace.to_owned(),
            root: dir.to_path_buf(),
            image,
            options,
            state: Arc::default(),
        });
        let task = tokio::spawn(run(node.clone()));
        Ok(Self { node, task })
    }

    /// SIGKILLs the agent of workspace `workspace` (it is restarted, as a crashed container).
    pub fn kill_agent(&self, workspace: &str) -> bool {
        let mut state = self.node.state();
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
            let mut state = self.node.state();
            match state.pods.get_mut(&format!("{workspace}-workspace")) {
                Some(pod) => pod.unreported_restart = true,
                None => return false,
            }
        }
        self.kill_agent(workspace)
    }

    /// The agent's pid of workspace `workspace`, if it runs.
    pub fn agent_pid(&self, workspace: &str) -> Option<u32> {
        self.agents().pid(workspace)
    }

    /// Looks up the agents' pids from another thread, as pods come and go (a rolled pod runs
    /// a new agent process).
    pub fn agents(&self) -> AgentPids {
        AgentPids(self.node.clone())
    }

    /// The `pulumi` commands workspace `workspace`'s agents ran so far, every pod of it, in
    /// order, each as `<unix time> <arguments>` (with [`KubeletOptions::log_pulumi_calls`]).
    pub fn pulumi_calls(&self, workspace: &str) -> Vec<String> {
        let log = pulumi_calls_log(&self.node.root, &format!("{workspace}-workspace"));
        std::fs::read_to_string(log)
            .unwrap_or_default()
            .lines()
            .map(str::to_owned)
            .collect()
    }

    /// Where the agent of workspace `workspace` listens, once it does.
    pub fn agent_address(&self, workspace: &str) -> Option<(Ipv4Addr, u16)> {
        let state = self.node.state();
        state
            .pods
            .get(&format!("{workspace}-workspace"))
            .filter(|p| p.ready)
            .map(|p| (p.ip, p.port))
    }

    /// The logs (init containers and agent) of workspace `workspace`'s pod, for failure messages.
    pub fn logs(&self, workspace: &str) -> String {
        let dir = self.node.root.join(format!("{workspace}-workspace"));
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
        let mut state = self.node.state();
        state.pods.clear();
        if self.node.options.network == PodNetwork::Cluster
            && let Ok(dns) = ClusterDns::shared()
        {
            for sts in state.addresses.keys() {
                dns.remove_service(sts, &self.node.namespace);
            }
        }
    }
}

/// Names the file a logging `pulumi` appends to (see [`KubeletOptions::log_pulumi_calls`]).
const PULUMI_CALLS_ENV: &str = "PKO_TEST_PULUMI_CALLS";

/// The log of StatefulSet `sts`'s `pulumi` commands: beside the pod folders, so it outlives a
/// pod.
fn pulumi_calls_log(root: &Path, sts: &str) -> PathBuf {
    root.join(format!("{sts}.pulumi-calls"))
}

/// What the workspace image provides: the pulumi CLI and YAML host on PATH, the Kubernetes
/// provider installed in `~/.pulumi/plugins` (as images that bundle providers do), and no
/// update checks or plugin downloads (the tests are offline); plus the files of the images
/// the kubelet knows (`image.rs`).
struct ImageEnv {
    path: String,
    /// The `pulumi` CLI.
    pulumi: PathBuf,
    images: Images,
    /// The trust store of every image, when it has more than the host's.
    ca_bundle: Option<PathBuf>,
    /// (plugin folder name, binary) of each provider the image has installed.
    providers: Vec<(String, PathBuf)>,
}

impl ImageEnv {
    fn new(options: &KubeletOptions, dir: &Path) -> Result<Self, HarnessError> {
        let extra = options.images.clone();
        let ca_bundle = if options.trusted_certs.is_empty() {
            None
        } else {
            std::fs::create_dir_all(dir)
                .map_err(|e| HarnessError::io(format!("creating {}", dir.display()), e))?;
            let mut bundle =
                std::fs::read_to_string("/etc/ssl/certs/ca-certificates.crt").unwrap_or_default();
            for cert in &options.trusted_certs {
                bundle.push('\n');
                bundle.push_str(cert);
            }
            let path = dir.join("ca-bundle.pem");
            std::fs::write(&path, bundle)
                .map_err(|e| HarnessError::io(format!("writing {}", path.display()), e))?;
            Some(path)
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
            pulumi: bin.join("pulumi"),
            images: Images::new(extra, &agent_binary()?, dir)?,
            ca_bundle,
            providers,
        })
    }

    /// A `pulumi` that appends the time and its arguments to the file named by
    /// [`PULUMI_CALLS_ENV`], then runs the image's CLI (written once, in `root`).
    fn pulumi_wrapper(&self, root: &Path) -> Result<PathBuf, HarnessError> {
        let path = root.join("pulumi-logging-calls");
        if path.is_file() {
            return Ok(path);
        }
        let script = format!(
            "#!/bin/sh\nprintf '%s %s\\n' \"$(date +%s.%N)\" \"$*\" >> \"${PULUMI_CALLS_ENV}\"\nexec '{}' \"$@\"\n",
            self.pulumi.display()
        );
        // Pods start concurrently: each writes its own file and the rename is atomic.
        let write = || -> std::io::Result<()> {
            use std::io::Write as _;
            use std::os::unix::fs::PermissionsExt;
            let mut tmp = tempfile::NamedTempFile::new_in(root)?;
            tmp.write_all(script.as_bytes())?;
            tmp.as_file()
                .set_permissions(std::fs::Permissions::from_mode(0o755))?;
            tmp.persist(&path).map_err(|e| e.error)?;
            Ok(())
        };
        write().map_err(|e| HarnessError::io(format!("writing {}", path.display()), e))?;
        Ok(path)
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

async fn run(node: Arc<Node>) {
    let sts_api: Api<StatefulSet> = Api::namespaced(node.client.clone(), &node.namespace);
    loop {
        let list = sts_api
            .list(&ListParams::default().labels(COMPONENT_SELECTOR))
            .await;
        // Pods deleted by someone else (PKO deletes a pod it failed to annotate) come back, as
        // the StatefulSet controller brings them back.
        let pods_api = Api::<Pod>::namespaced(node.client.clone(), &node.namespace);
        let pods = pods_api
            .list_metadata(&ListParams::default().labels(COMPONENT_SELECTOR))
            .await
            .map(|l| {
                l.items
                    .iter()
                    .map(|p| (p.name_any(), p.metadata.deletion_timestamp.is_some()))
                    .collect::<Vec<_>>()
            });
        if let (Ok(list), Ok(pods)) = (list, pods) {
            let names: Vec<String> = list.items.iter().map(ResourceExt::name_any).collect();
            // A pod being deleted (the operator replaces a pod of an `OnDelete` StatefulSet):
            // its containers stop, then the kubelet removes it, as a real one does.
            for (pod, _) in pods.iter().filter(|(_, deleting)| *deleting) {
                let sts = pod.strip_suffix("-0").unwrap_or(pod);
                let stopped = node.state().pods.remove(sts);
                if let Some(run) = stopped {
                    let dir = run.dir.clone();
                    drop(run);
                    let _ = std::fs::remove_dir_all(&dir);
                }
                let _ = pods_api
                    .delete(pod, &DeleteParams::default().grace_period(0))
                    .await;
            }
            for sts in list.items {
                let pod = format!("{}-0", sts.name_any());
                let has_pod = pods.iter().any(|(p, deleting)| *p == pod && !deleting);
                if let Err(e) = sync(&node, &sts, has_pod).await {
                    eprintln!(
                        "pko-tests kubelet: {}/{}: {e}",
                        node.namespace,
                        sts.name_any()
                    );
                }
            }
            // StatefulSets that are gone: stop their pods.
            let gone: Vec<String> = node
                .state()
                .pods
                .keys()
                .filter(|k| !names.contains(k))
                .cloned()
                .collect();
            for name in gone {
                let removed = {
                    let mut state = node.state();
                    state.addresses.remove(&name);
                    state.pods.remove(&name)
                };
                drop(removed);
                if node.options.network == PodNetwork::Cluster
                    && let Ok(dns) = ClusterDns::shared()
                {
                    dns.remove_service(&name, &node.namespace);
                }
                let pods: Api<Pod> = Api::namespaced(node.client.clone(), &node.namespace);
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

/// Garbage collection stand-in: deletes the StatefulSet (and its Service and agent
/// credentials) when its owning Workspace is gone; true when it did.
async fn collected(node: &Node, sts: &StatefulSet) -> Result<bool, HarnessError> {
    let Some(owner) = sts
        .owner_references()
        .iter()
        .find(|o| o.kind == "Workspace")
    else {
        return Ok(false);
    };
    let (client, namespace, name) = (&node.client, node.namespace.as_str(), sts.name_any());
    let workspaces: Api<Workspace> = Api::namespaced(client.clone(), namespace);
    let alive = workspaces
        .get_opt(&owner.name)
        .await
        .map_err(|e| HarnessError::kube("reading the owner Workspace", e))?
        .is_some_and(|w| w.metadata.uid.as_deref() == Some(owner.uid.as_str()));
    if alive {
        return Ok(false);
    }
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
    Ok(true)
}

/// What a StatefulSet's pod needs now.
enum Needed {
    /// A new pod (first one, or a new template revision).
    NewPod,
    /// Its init containers again (one failed earlier).
    Retry(u64),
    /// Its agent again (it died).
    Restart(u64),
    /// Its agent again, with no status written for the restart.
    RestartUnreported(u64),
    /// Nothing but keeping the status current.
    Nothing { ready: bool },
}

async fn sync(node: &Arc<Node>, sts: &StatefulSet, has_pod: bool) -> Result<(), HarnessError> {
    if collected(node, sts).await? {
        return Ok(());
    }
    if sts.spec.as_ref().and_then(|s| s.replicas) == Some(0) {
        return scaled_to_zero(node, sts, has_pod).await;
    }
    let name = sts.name_any();
    let revision = revision_of(sts);
    let generation = sts.metadata.generation.unwrap_or(0);
    // `OnDelete`: a new template replaces no pod; a deleted pod comes back from it.
    let on_delete = sts
        .spec
        .as_ref()
        .and_then(|s| s.update_strategy.as_ref())
        .and_then(|u| u.type_.as_deref())
        == Some("OnDelete");
    let mut made_from = revision.clone();
    let needed = {
        let mut state = node.state();
        match state.pods.get_mut(&name) {
            Some(p)
                if (p.revision == revision || on_delete)
                    && (has_pod || p.starting.as_ref().is_some_and(|t| !t.is_finished())) =>
            {
                made_from = p.revision.clone();
                let busy = p.starting.as_ref().is_some_and(|t| !t.is_finished());
                let died = !busy
                    && p.agent
                        .as_mut()
                        .is_some_and(|a| matches!(a.try_wait(), Ok(Some(_))));
                if busy {
                    Needed::Nothing { ready: false }
                } else if p.retry_at.is_some_and(|t| Instant::now() >= t) {
                    Needed::Retry(p.id)
                } else if died && p.unreported_restart {
                    p.unreported_restart = false;
                    p.agent = None;
                    Needed::RestartUnreported(p.id)
                } else if died {
                    p.agent = None;
                    p.ready = false;
                    p.restarts += 1;
                    Needed::Restart(p.id)
                } else {
                    Needed::Nothing { ready: p.ready }
                }
            }
            _ => Needed::NewPod,
        }
    };
    let pod_name = format!("{name}-0");
    let template = sts
        .spec
        .as_ref()
        .map(|s| s.template.clone())
        .unwrap_or_default();
    let pod_spec = template.spec.clone().unwrap_or_default();
    let (client, namespace) = (&node.client, node.namespace.as_str());
    match needed {
        Needed::NewPod => {
            // A new pod: fresh folder, fresh Pod object.
            let dir = node.root.join(&name);
            let old = node.state().pods.remove(&name);
            drop(old);
            let _ = std::fs::remove_dir_all(&dir);
            std::fs::create_dir_all(&dir)
                .map_err(|e| HarnessError::io(format!("creating {}", dir.display()), e))?;
            let revisions = Revisions::same(&revision);
            set_sts_status(client, namespace, &name, generation, revisions, false).await?;
            create_pod(client, namespace, &pod_name, &name, &revision, &template).await?;
            let (ip, port) = address_of(node, &name, &pod_spec)?;
            let id = {
                let mut state = node.state();
                state.next_id += 1;
                let id = state.next_id;
                state.pods.insert(
                    name.clone(),
                    PodRun {
                        id,
                        revision: revision.clone(),
                        spec: pod_spec.clone(),
                        dir: dir.clone(),
                        agent: None,
                        ip,
                        port,
                        restarts: 0,
                        ready: false,
                        retry_at: None,
                        unreported_restart: false,
                        starting: None,
                    },
                );
                id
            };
            spawn_start(node, &name, id, pod_spec, true);
        }
        Needed::Retry(id) => spawn_start(node, &name, id, own_spec(node, &name, id)?, true),
        Needed::Restart(id) => {
            let revisions = Revisions {
                current: &made_from,
                update: &revision,
            };
            set_sts_status(client, namespace, &name, generation, revisions, false).await?;
            let restarts = node.with_pod(&name, id, |p| p.restarts).unwrap_or(0);
            write_pod_status(client, namespace, &pod_name, not_ready(restarts)).await?;
            // The container starts again (its folder, the emptyDir, is kept).
            spawn_start(node, &name, id, own_spec(node, &name, id)?, false);
        }
        Needed::RestartUnreported(id) => {
            spawn_start(node, &name, id, own_spec(node, &name, id)?, false);
        }
        Needed::Nothing { ready } => {
            // Keep observedGeneration current (the operator re-applies the StatefulSet).
            let observed = sts.status.as_ref().and_then(|s| s.observed_generation);
            if ready && observed != Some(generation) {
                let revisions = Revisions {
                    current: &made_from,
                    update: &revision,
                };
                set_sts_status(client, namespace, &name, generation, revisions, true).await?;
            }
        }
    }
    Ok(())
}

/// The spec pod `id` of `sts` was made with.
fn own_spec(
    node: &Node,
    sts: &str,
    id: u64,
) -> Result<k8s_openapi::api::core::v1::PodSpec, HarnessError> {
    node.with_pod(sts, id, |p| p.spec.clone())
        .ok_or_else(|| HarnessError::Missing {
            what: format!("the running pod of {sts}"),
        })
}

/// A StatefulSet scaled to 0 replicas, as its controller and the kubelet handle it: the pod is
/// stopped (its agent and whatever it started killed, its folder, the emptyDir, gone with it)
/// and deleted, and the status says 0 replicas. Scaled up again, it gets a new pod.
async fn scaled_to_zero(
    node: &Arc<Node>,
    sts: &StatefulSet,
    has_pod: bool,
) -> Result<(), HarnessError> {
    let name = sts.name_any();
    let stopped = node.state().pods.remove(&name);
    if let Some(pod) = stopped {
        let dir = pod.dir.clone();
        drop(pod);
        let _ = std::fs::remove_dir_all(&dir);
    }
    let (client, namespace) = (&node.client, node.namespace.as_str());
    if node.options.network == PodNetwork::Cluster
        && let Ok(dns) = ClusterDns::shared()
    {
        dns.remove_service(
            &spec_service_name(client, namespace, &name).await?,
            namespace,
        );
    }
    if has_pod {
        let _ = Api::<Pod>::namespaced(client.clone(), namespace)
            .delete(
                &format!("{name}-0"),
                &DeleteParams::default().grace_period(0),
            )
            .await;
    }
    let generation = sts.metadata.generation.unwrap_or(0);
    let status = sts.status.as_ref();
    if status.and_then(|s| s.observed_generation) == Some(generation)
        && status.is_some_and(|s| s.replicas == 0)
    {
        return Ok(());
    }
    let rev = format!("{name}-{}", revision_of(sts));
    let patch = json!({"status": {
        "observedGeneration": generation,
        "replicas": 0,
        "readyReplicas": 0,
        "availableReplicas": 0,
        "currentReplicas": 0,
        "updatedReplicas": 0,
        "currentRevision": rev,
        "updateRevision": rev,
    }});
    Api::<StatefulSet>::namespaced(client.clone(), namespace)
        .patch_status(&name, &PatchParams::default(), &Patch::Merge(&patch))
        .await
        .map_err(|e| HarnessError::kube("writing the StatefulSet status", e))?;
    Ok(())
}

/// Where the agent of StatefulSet `sts` listens: a free port of 127.0.0.1, or (cluster
/// network) the StatefulSet's own address and the port the `pulumi` container declares.
fn address_of(
    node: &Node,
    sts: &str,
    spec: &k8s_openapi::api::core::v1::PodSpec,
) -> Result<(Ipv4Addr, u16), HarnessError> {
    if node.options.network == PodNetwork::Loopback {
        return Ok((Ipv4Addr::LOCALHOST, free_port()?));
    }
    let port = spec
        .containers
        .iter()
        .find(|c| c.name == "pulumi")
        .and_then(|c| c.ports.as_ref())
        .and_then(|ports| ports.first())
        .and_then(|p| u16::try_from(p.container_port).ok())
        .unwrap_or(DEFAULT_AGENT_PORT);
    let mut state = node.state();
    if let Some(ip) = state.addresses.get(sts) {
        return Ok((*ip, port));
    }
    // An address nobody on this machine listens on at that port.
    for _ in 0..64 {
        let ip = random_loopback();
        if std::net::TcpListener::bind((ip, port)).is_ok() {
            state.addresses.insert(sts.to_owned(), ip);
            return Ok((ip, port));
        }
    }
    Err(HarnessError::Missing {
        what: format!("a free loopback address for the pod of {sts}"),
    })
}

/// Starts the pod's containers in a task of their own (init containers first when `init`),
/// so one slow pod holds up no other.
fn spawn_start(
    node: &Arc<Node>,
    sts: &str,
    id: u64,
    spec: k8s_openapi::api::core::v1::PodSpec,
    init: bool,
) {
    let task = {
        let (node, sts) = (node.clone(), sts.to_owned());
        tokio::spawn(async move {
            let started = if init {
                start_pod(&node, &sts, id, &spec).await
            } else {
                start_agent(&node, &sts, id, &spec).await
            };
            if let Err(e) = started {
                eprintln!("pko-tests kubelet: {}/{sts}: {e}", node.namespace);
            }
        })
    };
    let handle = task.abort_handle();
    if node
        .with_pod(sts, id, |p| {
            p.retry_at = None;
            p.starting = Some(handle.clone());
        })
        .is_none()
    {
        handle.abort();
    }
}

/// The revision a StatefulSet's pod was made from, and its template's (apart only under
/// `OnDelete`, until the pod is deleted).
#[derive(Clone, Copy)]
pub(crate) struct Revisions<'a> {
    pub(crate) current: &'a str,
    pub(crate) update: &'a str,
}

impl<'a> Revisions<'a> {
    /// A pod made from the template.
    pub(crate) fn same(revision: &'a str) -> Self {
        Self {
            current: revision,
            update: revision,
        }
    }
}

pub(crate) async fn set_sts_status(
    client: &Client,
    namespace: &str,
    name: &str,
    generation: i64,
    revisions: Revisions<'_>,
    ready: bool,
) -> Result<(), HarnessError> {
    let n = i32::from(ready);
    let updated = i32::from(revisions.current == revisions.update);
    let patch = json!({"status": {
        "observedGeneration": generation,
        "replicas": 1,
        "readyReplicas": n,
        "availableReplicas": n,
        "currentReplicas": 1,
        "updatedReplicas": updated,
        "currentRevision": format!("{name}-{}", revisions.current),
        "updateRevision": format!("{name}-{}", revisions.update),
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

/// A kubeconfig for the pod's service account, as the token the kubelet projects into a pod
/// (`None` without API access, or when the `default` account, which no controller makes here,
/// does not exist). A missing named service account is an error: the pod cannot start.
async fn pod_kubeconfig(
    node: &Node,
    spec: &k8s_openapi::api::core::v1::PodSpec,
    dir: &Path,
) -> Result<Option<PathBuf>, String> {
    let Some(api) = &node.options.api else {
        return Ok(None);
    };
    let account = spec
        .service_account_name
        .clone()
        .filter(|s| !s.is_empty())
        .unwrap_or_else(|| "default".into());
    let minted =
        crate::kubeauth::token_for(&node.client, &node.namespace, &account, None, TOKEN_SECONDS)
            .await;
    let token = match minted {
        Err(HarnessError::Kube {
            source: kube::Error::Api(e),
            ..
        }) if e.code == 404 && account == "default" => return Ok(None),
        minted => minted.map_err(|e| format!("serviceaccount {account:?}: {e}"))?,
    };
    let path = dir.join("kubeconfig");
    crate::control_plane::write_kubeconfig(&path, &api.server, &api.ca, &token, &node.namespace)
        .map_err(|e| e.to_string())?;
    Ok(Some(path))
}

/// Reports init container `c` failed with `message` and schedules a retry.
async fn init_failed(
    node: &Node,
    sts: &str,
    id: u64,
    statuses: &mut Vec<Value>,
    c: &Container,
    code: i32,
    message: String,
) -> Result<(), HarnessError> {
    statuses.push(json!({
        "name": c.name, "ready": false, "restartCount": 0, "image": c.image, "imageID": "",
        "state": {"terminated": {"exitCode": code, "reason": "Error", "message": message}},
    }));
    write_pod_status(
        &node.client,
        &node.namespace,
        &format!("{sts}-0"),
        json!({
            "phase": "Pending",
            "initContainerStatuses": statuses,
            "conditions": [{"type": "Ready", "status": "False", "reason": "PodInitializing"}],
        }),
    )
    .await?;
    node.with_pod(sts, id, |p| p.retry_at = Some(Instant::now() + INIT_RETRY));
    Ok(())
}

/// Runs the init containers, then the agent.
async fn start_pod(
    node: &Node,
    sts: &str,
    id: u64,
    spec: &k8s_openapi::api::core::v1::PodSpec,
) -> Result<(), HarnessError> {
    let Some(dir) = node.with_pod(sts, id, |p| p.dir.clone()) else {
        return Ok(());
    };
    let (client, namespace) = (&node.client, node.namespace.as_str());
    let pod_name = format!("{sts}-0");
    let volumes = lay_out_volumes(client, namespace, spec, &dir).await?;
    let mut statuses = Vec::new();
    let kubeconfig = match pod_kubeconfig(node, spec, &dir).await {
        Ok(k) => k,
        Err(message) => {
            // As the kubelet: no token, no container.
            let first = spec
                .init_containers
                .as_deref()
                .unwrap_or_default()
                .first()
                .or(spec.containers.first())
                .cloned()
                .unwrap_or_default();
            return init_failed(node, sts, id, &mut statuses, &first, 1, message).await;
        }
    };
    for c in spec.init_containers.as_deref().unwrap_or_default() {
        let run = Run {
            pod_name: &pod_name,
            spec,
            volumes: &volumes,
            dir: &dir,
            kubeconfig: kubeconfig.as_deref(),
        };
        let (cmd, _) = container_command(node, &run, c).await?;
        let log = dir.join(format!("init-{}.log", c.name));
        let mut guard = spawn_guarded(cmd, &format!("init {}", c.name), &log)?;
        let deadline = Instant::now() + INIT_TIMEOUT;
        let status = loop {
            if let Ok(Some(status)) = guard.try_wait() {
                break Some(status);
            }
            if Instant::now() > deadline || !node.current(sts, id) {
                guard.kill();
                break None;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        };
        if !node.current(sts, id) {
            return Ok(());
        }
        let code = status.and_then(|s| s.code()).unwrap_or(137);
        if code != 0 {
            let message = log_tail(&log, 20);
            return init_failed(node, sts, id, &mut statuses, c, code, message).await;
        }
        statuses.push(json!({
            "name": c.name, "ready": true, "restartCount": 0, "image": c.image, "imageID": "",
            "state": {"terminated": {"exitCode": 0, "reason": "Completed"}},
        }));
    }
    write_pod_status(
        client,
        namespace,
        &pod_name,
        json!({
            "phase": "Running",
            "initContainerStatuses": statuses,
        }),
    )
    .await?;
    start_agent(node, sts, id, spec).await
}

/// What one container of a pod runs with.
struct Run<'a> {
    pod_name: &'a str,
    spec: &'a k8s_openapi::api::core::v1::PodSpec,
    volumes: &'a HashMap<String, PathBuf>,
    dir: &'a Path,
    kubeconfig: Option<&'a Path>,
}

/// Starts the `pulumi` container's command and marks everything ready once it listens.
async fn start_agent(
    node: &Node,
    sts: &str,
    id: u64,
    spec: &k8s_openapi::api::core::v1::PodSpec,
) -> Result<(), HarnessError> {
    let Some((dir, ip, port)) = node.with_pod(sts, id, |p| (p.dir.clone(), p.ip, p.port)) else {
        return Ok(());
    };
    let Some(container) = spec.containers.iter().find(|c| c.name == "pulumi") else {
        return Ok(());
    };
    let (client, namespace) = (&node.client, node.namespace.as_str());
    let pod_name = format!("{sts}-0");
    let volumes = lay_out_volumes(client, namespace, spec, &dir).await?;
    let kubeconfig = dir.join("kubeconfig");
    let run = Run {
        pod_name: &pod_name,
        spec,
        volumes: &volumes,
        dir: &dir,
        kubeconfig: kubeconfig.is_file().then_some(kubeconfig.as_path()),
    };
    let (mut cmd, _) = container_command(node, &run, container).await?;
    match node.options.network {
        PodNetwork::Loopback => {
            cmd.args(["--host", "127.0.0.1", "--port", &port.to_string()]);
        }
        // The pod's own address; the port is the one the pod spec declares.
        PodNetwork::Cluster => {
            cmd.args(["--host", &ip.to_string()]);
        }
    }
    let log = dir.join("agent.log");
    let mut guard = spawn_guarded(cmd, "workspace agent", &log)?;
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        if let Ok(Some(_)) = guard.try_wait() {
            // Crashed at start: reported as not ready; restarted at the next tick.
            node.with_pod(sts, id, |p| p.agent = Some(guard));
            return Ok(());
        }
        if !node.current(sts, id) {
            return Ok(());
        }
        if tokio::net::TcpStream::connect((ip, port)).await.is_ok() {
            break;
        }
        if Instant::now() > deadline {
            return Err(HarnessError::Missing {
                what: format!(
                    "the agent of {sts} listening on {ip}:{port}; log:\n{}",
                    log_tail(&log, 30)
                ),
            });
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let Some((restarts, made_from)) = node.with_pod(sts, id, |p| {
        p.agent = Some(guard);
        p.ready = true;
        (p.restarts, p.revision.clone())
    }) else {
        return Ok(());
    };
    let current = match node.options.network {
        PodNetwork::Loopback => annotate_dev_port(client, namespace, sts, port).await?,
        PodNetwork::Cluster => {
            let service = spec_service_name(client, namespace, sts).await?;
            ClusterDns::shared()?.set_service(&service, namespace, ip);
            Api::<StatefulSet>::namespaced(client.clone(), namespace)
                .get(sts)
                .await
                .map_err(|e| HarnessError::kube("reading the StatefulSet", e))?
        }
    };
    let revision = revision_of(&current);
    write_pod_ready_at(client, namespace, &pod_name, true, restarts, ip).await?;
    set_sts_status(
        client,
        namespace,
        sts,
        current.metadata.generation.unwrap_or(0),
        Revisions {
            current: &made_from,
            update: &revision,
        },
        true,
    )
    .await
}

/// The headless Service a StatefulSet's pod answers for (`spec.serviceName`, else its name).
async fn spec_service_name(
    client: &Client,
    namespace: &str,
    sts: &str,
) -> Result<String, HarnessError> {
    let current = Api::<StatefulSet>::namespaced(client.clone(), namespace)
        .get(sts)
        .await
        .map_err(|e| HarnessError::kube("reading the StatefulSet", e))?;
    Ok(current
        .spec
        .and_then(|s| s.service_name)
        .filter(|s| !s.is_empty())
        .unwrap_or_else(|| sts.to_owned()))
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

/// The status of a pod whose one container (`pulumi`) is ready, or crash-looping.
pub(crate) async fn write_pod_ready(
    client: &Client,
    namespace: &str,
    pod_name: &str,
    ready: bool,
    restarts: i32,
) -> Result<(), HarnessError> {
    write_pod_ready_at(
        client,
        namespace,
        pod_name,
        ready,
        restarts,
        Ipv4Addr::LOCALHOST,
    )
    .await
}

fn not_ready(restarts: i32) -> Value {
    json!({
        "phase": "Running",
        "conditions": [{"type": "Ready", "status": "False"}, {"type": "ContainersReady", "status": "False"}],
        "containerStatuses": [{
            "name": "pulumi", "ready": false, "restartCount": restarts, "image": "", "imageID": "",
            "started": false, "state": {"waiting": {"reason": "CrashLoopBackOff"}},
        }],
    })
}

async fn write_pod_ready_at(
    client: &Client,
    namespace: &str,
    pod_name: &str,
    ready: bool,
    restarts: i32,
    ip: Ipv4Addr,
) -> Result<(), HarnessError> {
    let mut status = not_ready(restarts);
    status["podIP"] = json!(ip.to_string());
    if ready {
        let flag = "True";
        status["conditions"] =
            json!([{"type": "Ready", "status": flag}, {"type": "ContainersReady", "status": flag}]);
        status["containerStatuses"][0]["ready"] = json!(true);
        status["containerStatuses"][0]["started"] = json!(true);
        status["containerStatuses"][0]["state"] = json!({"running": {}});
    }
    write_pod_status(client, namespace, pod_name, status).await
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

/// A `resourceFieldRef`'s value, as the kubelet gives it: memory in bytes, CPU in whole
/// cores rounded up (divisor 1); `None` when the container sets no such resource.
fn resource_field(
    spec: &k8s_openapi::api::core::v1::PodSpec,
    own: &Container,
    selector: &k8s_openapi::api::core::v1::ResourceFieldSelector,
) -> Option<String> {
    let container = match selector.container_name.as_deref().filter(|n| !n.is_empty()) {
        Some(name) => spec.containers.iter().find(|c| c.name == name)?,
        None => own,
    };
    let (kind, resource) = selector.resource.split_once('.')?;
    let resources = container.resources.as_ref()?;
    let quantities = match kind {
        "requests" => resources.requests.as_ref()?,
        "limits" => resources.limits.as_ref()?,
        _ => return None,
    };
    let quantity = quantities.get(resource)?;
    match resource {
        "memory" | "ephemeral-storage" => quantity_bytes(&quantity.0).map(|b| b.to_string()),
        "cpu" => {
            let millis = match quantity.0.strip_suffix('m') {
                Some(m) => m.parse::<u64>().ok()?,
                None => quantity.0.parse::<u64>().ok()?.saturating_mul(1000),
            };
            Some(millis.div_ceil(1000).to_string())
        }
        _ => None,
    }
}

/// A quantity such as `64Mi` or `1G` in bytes.
fn quantity_bytes(q: &str) -> Option<u64> {
    let split = q.find(|c: char| !c.is_ascii_digit()).unwrap_or(q.len());
    let (number, suffix) = q.split_at(split);
    let number: u64 = number.parse().ok()?;
    let factor: u64 = match suffix {
        "" => 1,
        "Ki" => 1 << 10,
        "Mi" => 1 << 20,
        "Gi" => 1 << 30,
        "Ti" => 1 << 40,
        "k" => 1_000,
        "M" => 1_000_000,
        "G" => 1_000_000_000,
        "T" => 1_000_000_000_000,
        _ => return None,
    };
    number.checked_mul(factor)
}

/// The command of a container, with env resolved and the paths of mounts and image files
/// mapped to host paths.
async fn container_command(
    node: &Node,
    run: &Run<'_>,
    c: &Container,
) -> Result<(Command, Vec<(String, String)>), HarnessError> {
    let (client, namespace, image) = (&node.client, node.namespace.as_str(), &node.image);
    let mounts = c
        .volume_mounts
        .as_deref()
        .unwrap_or_default()
        .iter()
        .filter_map(|m| {
            run.volumes
                .get(&m.name)
                .map(|p| (m.mount_path.clone(), p.clone()))
        });
    let files = image
        .images
        .files_of(c.image.as_deref().unwrap_or_default());
    let paths = PathMap::new(mounts.chain(files));
    let home = run.dir.join("home");
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
        (POD_MARKER.into(), run.dir.display().to_string()),
    ];
    if let Some(kubeconfig) = run.kubeconfig {
        env.push(("KUBECONFIG".into(), kubeconfig.display().to_string()));
    }
    if node.options.log_pulumi_calls
        && let Some(sts) = run.dir.file_name().and_then(|n| n.to_str())
    {
        let wrapper = image.pulumi_wrapper(&node.root)?;
        env.push(("PULUMI_CLI".into(), wrapper.display().to_string()));
        let log = pulumi_calls_log(&node.root, sts);
        env.push((PULUMI_CALLS_ENV.into(), log.display().to_string()));
    }
    if let Some(bundle) = &image.ca_bundle {
        for name in ["SSL_CERT_FILE", "GIT_SSL_CAINFO"] {
            env.push((name.into(), bundle.display().to_string()));
        }
    }
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
                        "metadata.name" => Some(run.pod_name.to_owned()),
                        "spec.serviceAccountName" => run.spec.service_account_name.clone(),
                        _ => None,
                    }
                } else if let Some(r) = &from.resource_field_ref {
                    resource_field(run.spec, c, r)
                } else {
                    None
                }
            }
            (None, None) => Some(String::new()),
        };
        if let Some(v) = value {
            set(&mut env, e.name.clone(), paths.map(&v));
        }
    }
    let mut argv: Vec<String> = c.command.clone().unwrap_or_default();
    argv.extend(c.args.clone().unwrap_or_default());
    let argv: Vec<String> = argv.iter().map(|a| paths.map(&expand(a, &env))).collect();
    let Some((program, rest)) = argv.split_first() else {
        return Err(HarnessError::Missing {
            what: format!("a command in container {}", c.name),
        });
    };
    let mounted = mounts_by_path(&c.volume_mounts.clone().unwrap_or_default(), run.volumes);
    let mut cmd = match mount_script(&mounted, &run.dir.join("mounts")) {
        // Paths the process is told at run time (the agent reads config files at the paths
        // the operator sends it) cannot be mapped: the mounts are made where they are named.
        Some(script) => {
            let mut cmd = Command::new(UNSHARE);
            cmd.args(["--mount", "--propagation", "private", "--", "/bin/sh", "-c"])
                .arg(script)
                .arg("sh")
                .arg(program)
                .args(rest);
            cmd
        }
        None => {
            let mut cmd = Command::new(program);
            cmd.args(rest);
            cmd
        }
    };
    cmd.env_clear().envs(env.iter().map(|(k, v)| (k, v)));
    let workdir = c
        .working_dir
        .as_deref()
        .map(|w| paths.map(w))
        .map(PathBuf::from)
        .filter(|p| p.is_dir())
        .unwrap_or_else(|| run.dir.to_path_buf());
    cmd.current_dir(workdir);
    Ok((cmd, env))
}

/// Where `unshare` is (util-linux).
const UNSHARE: &str = "/usr/bin/unshare";

/// A container's volume mounts as (path in the container, host folder).
fn mounts_by_path(
    mounts: &[k8s_openapi::api::core::v1::VolumeMount],
    volumes: &HashMap<String, PathBuf>,
) -> Vec<(String, PathBuf)> {
    mounts
        .iter()
        .filter_map(|m| {
            let host = volumes.get(&m.name)?;
            let path = match &m.sub_path {
                Some(sub) if !sub.is_empty() => host.join(sub),
                _ => host.clone(),
            };
            Some((m.mount_path.clone(), path))
        })
        .collect()
}

/// A shell script that, in a private mount namespace, makes each mount whose path does not
/// exist on the host under an existing folder other than `/` (`/var/run/...`, where the
/// operator mounts config and secrets) appear at that path: the folder is overlaid (the host's
/// content stays visible, nothing is written to it; `scratch` holds the overlay's layers) and
/// the volume bound on the new path. Then it runs its arguments. `None` when no mount needs it
/// (the rest are reached by path mapping).
fn mount_script(mounts: &[(String, PathBuf)], scratch: &Path) -> Option<String> {
    let mut overlaid: Vec<PathBuf> = Vec::new();
    let mut lines = Vec::new();
    for (path, host) in mounts {
        let target = Path::new(path);
        if !target.is_absolute() || target.exists() {
            continue;
        }
        let Some(base) = target
            .ancestors()
            .skip(1)
            .find(|a| a.is_dir())
            .and_then(|a| a.canonicalize().ok())
        else {
            continue;
        };
        if base == Path::new("/") {
            continue;
        }
        if !overlaid.contains(&base) {
            let layer = scratch.join(overlaid.len().to_string());
            let (upper, work) = (layer.join("upper"), layer.join("work"));
            if std::fs::create_dir_all(&upper).is_err() || std::fs::create_dir_all(&work).is_err() {
                continue;
            }
            let base_q = shell_words(&base.display().to_string());
            lines.push(format!(
                "mount -t overlay overlay -o {} {base_q}",
                shell_words(&format!(
                    "lowerdir={},upperdir={},workdir={}",
                    base.display(),
                    upper.display(),
                    work.display()
                ))
            ));
            overlaid.push(base);
        }
        let (target_q, host_q) = (shell_words(path), shell_words(&host.display().to_string()));
        lines.push(format!(
            "mkdir -p {target_q} && mount --bind {host_q} {target_q}"
        ));
    }
    if lines.is_empty() {
        return None;
    }
    lines.push("exec \"$@\"".into());
    Some(lines.join(" &&\n"))
}

/// `s` quoted for `sh`.
fn shell_words(s: &str) -> String {
    format!("'{}'", s.replace('\'', "'\\''"))
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

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::api::core::v1::{PodSpec, ResourceFieldSelector, ResourceRequirements};
    use k8s_openapi::apimachinery::pkg::api::resource::Quantity;

    #[test]
    fn only_mounts_missing_under_a_host_folder_are_made_in_a_mount_namespace() {
        let scratch = tempfile::tempdir().expect("tmp");
        let none = mount_script(
            &[
                ("/share".into(), PathBuf::from("/pods/p/volumes/share")),
                ("/tmp".into(), PathBuf::from("/pods/p/volumes/tmp")),
            ],
            scratch.path(),
        );
        assert_eq!(none, None, "at the root, or existing: mapped by path");
        // A host folder, standing in for `/var/run`.
        let run = scratch.path().join("run");
        std::fs::create_dir_all(&run).expect("run");
        let at = |p: &str| run.join(p).display().to_string();
        let script = mount_script(
            &[
                (
                    at("configmaps/x/cm"),
                    PathBuf::from("/pods/p/volumes/configmap-cm"),
                ),
                (at("secrets/x/s"), PathBuf::from("/pods/p/volumes/secret-s")),
            ],
            &scratch.path().join("layers"),
        )
        .expect("a script");
        assert_eq!(
            script.matches("mount -t overlay").count(),
            1,
            "one overlay per host folder: {script}"
        );
        assert!(
            script.contains(&format!(
                "mount --bind '/pods/p/volumes/secret-s' '{}'",
                at("secrets/x/s")
            )),
            "{script}"
        );
        assert!(script.ends_with("exec \"$@\""), "{script}");
    }

    #[test]
    fn resource_fields_are_given_as_the_kubelet_gives_them() {
        let pulumi = Container {
            name: "pulumi".into(),
            resources: Some(ResourceRequirements {
                requests: Some(BTreeMap::from([
                    ("memory".to_owned(), Quantity("64Mi".into())),
                    ("cpu".to_owned(), Quantity("100m".into())),
                ])),
                ..ResourceRequirements::default()
            }),
            ..Container::default()
        };
        let spec = PodSpec {
            containers: vec![pulumi.clone()],
            ..PodSpec::default()
        };
        let field = |container: &str, resource: &str| {
            resource_field(
                &spec,
                &Container::default(),
                &ResourceFieldSelector {
                    container_name: Some(container.into()),
                    resource: resource.into(),
                    divisor: None,
                },
            )
        };
        assert_eq!(
            field("pulumi", "requests.memory").as_deref(),
            Some("67108864")
        );
        assert_eq!(field("pulumi", "requests.cpu").as_deref(), Some("1"));
        assert_eq!(field("pulumi", "limits.memory"), None);
        assert_eq!(field("other", "requests.memory"), None);
        assert_eq!(quantity_bytes("1G"), Some(1_000_000_000));
        assert_eq!(quantity_bytes("1.5Gi"), None);
    }
}
