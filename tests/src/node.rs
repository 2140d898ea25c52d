//! A real Kubernetes node for the end-to-end tests: on a private control plane, a kubelet,
//! containerd (runc, overlayfs), the bridge CNI, kube-proxy (nftables), CoreDNS,
//! kube-controller-manager, kube-scheduler and kube-router's NetworkPolicy controller, all built by
//! `tools/build.sh node`, with images pulled from a private registry.
//!
//! The fast tests keep the harness kubelet (`crate::kubelet`); this node backs the tests that
//! need what only real components do: pods from images, Services and DNS, NetworkPolicies,
//! the namespace controller and the garbage collector.
//!
//! Everything runs inside namespaces of its own ([`Netns`]): etcd and kube-apiserver too, so
//! the apiserver reaches webhook pods and pods reach it through the `kubernetes` Service. The
//! host sees only loopback forwards: the apiserver's and etcd's ports (for the tests), and,
//! the other way, the registry's. Its files live in one temporary folder.
//!
//! Addresses (inside the namespaces only): the node is 10.254.0.1 on loopback, which also
//! holds the default route (so nothing leaves), pods get 10.244.0.0/24 on the bridge `cni0`,
//! Services 10.0.0.0/24 (DNS at 10.0.0.10).

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use k8s_openapi::api::core::v1::{Node as NodeObject, NodeCondition, Service};
use k8s_openapi::api::discovery::v1::EndpointSlice;
use kube::api::{Api, PostParams};
use pko_operator::oci::registry::Session;
use pko_operator::oci::{MANIFEST_TYPE, Reference};
use serde_json::{Value, json};
use sha2::{Digest, Sha256};
use tempfile::TempDir;

use crate::control_plane::InNode;
use crate::netns::{Forward, Netns};
pub use crate::pki::NODE_NAME;
use crate::process::{ChildGuard, spawn_guarded};
use crate::registry::Registry;
use crate::{ControlPlane, HarnessError, StartOptions, tool_dir, wait_for};

/// The node's address inside its namespaces.
pub const NODE_IP: &str = "10.254.0.1";
/// The pods' range (host-local IPAM on the bridge).
pub const POD_CIDR: &str = "10.244.0.0/24";
/// The Services' range (the apiserver's `--service-cluster-ip-range`).
pub const SERVICE_CIDR: &str = "10.0.0.0/24";
/// The cluster DNS Service's address.
pub const DNS_IP: &str = "10.0.0.10";
/// The image tag every image is pushed with.
pub const TAG: &str = "latest";

const READY_TIMEOUT: Duration = Duration::from_secs(180);
const SOCKET_TIMEOUT: Duration = Duration::from_secs(60);
const LOG_LINES: usize = 30;

/// A running node; everything stops on drop.
pub struct Node {
    /// kube-controller-manager, kube-scheduler, containerd, kubelet, kube-proxy, CoreDNS,
    /// kube-router: stopped in reverse order.
    processes: Mutex<Vec<ChildGuard>>,
    plane: ControlPlane,
    registry: Registry,
    /// The registry's port inside the namespaces.
    forwards: Mutex<Vec<Forward>>,
    netns: Arc<Netns>,
    bins: PathBuf,
    dir: PathBuf,
    cgroup_root: String,
    /// The pod sandbox image, which also serves as an idle pod's image.
    pause: String,
    temp: Mutex<Option<TempDir>>,
}

impl std::fmt::Debug for Node {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Node")
            .field("dir", &self.dir)
            .finish_non_exhaustive()
    }
}

impl Node {
    /// Starts the whole node and waits until it is Ready with cluster DNS served. The pod
    /// sandbox image is pushed to the node's registry first.
    pub async fn start() -> Result<Node, HarnessError> {
        let bins = tool_dir("node")?;
        let temp = tempfile::Builder::new()
            .prefix("pko-rs-node-")
            .tempdir()
            .map_err(|e| HarnessError::io("creating the node's folder", e))?;
        let dir = temp.path().to_path_buf();
        let logs = dir.join("logs");
        let netns = Arc::new(Netns::create(&logs).await?);
        network(&netns)?;

        let registry = Registry::start(&dir.join("registry")).await?;
        let registry_port = registry_port(&registry)?;
        let forwards = vec![netns.forward_out(
            SocketAddr::from(([127, 0, 0, 1], registry_port)),
            SocketAddr::from(([127, 0, 0, 1], registry_port)),
        )?];

        let plane = ControlPlane::start(StartOptions {
            dir: Some(dir.join("control-plane")),
            // The CRDs come with what the tests install (the chart templates them).
            crds_dir: Some(dir.join("no-crds")),
            in_node: Some(InNode {
                netns: netns.clone(),
                address: NODE_IP.into(),
            }),
            ..StartOptions::default()
        })
        .await?;
        let cgroup_root = format!("/pko-rs-node-{}", std::process::id());
        let mut node = Node {
            processes: Mutex::new(Vec::new()),
            plane,
            registry,
            forwards: Mutex::new(forwards),
            netns,
            bins,
            dir,
            cgroup_root,
            pause: String::new(),
            temp: Mutex::new(Some(temp)),
        };
        let pause = node.push_pause().await?;
        node.pause = pause.clone();
        node.start_controllers()?;
        node.start_containerd(&pause).await?;
        node.start_kubelet().await?;
        node.start_proxy_and_dns().await?;
        node.start_network_policies().await?;
        node.wait_ready().await?;
        Ok(node)
    }

    pub fn plane(&self) -> &ControlPlane {
        &self.plane
    }

    pub fn registry(&self) -> &Registry {
        &self.registry
    }

    /// The pause image (an idle process, uid 65535): for pods that only need to exist.
    pub fn pause_image(&self) -> &str {
        &self.pause
    }

    pub fn netns(&self) -> &Netns {
        &self.netns
    }

    /// The node's folder (logs in `logs/`).
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// `crictl` against the node's containerd, run inside its namespaces.
    pub fn crictl<I, S>(&self, args: I) -> Result<String, HarnessError>
    where
        I: IntoIterator<Item = S>,
        S: AsRef<std::ffi::OsStr>,
    {
        let mut all: Vec<std::ffi::OsString> = vec![
            self.bins.join("crictl").into(),
            format!("--runtime-endpoint=unix://{}", self.socket().display()).into(),
            format!("--image-endpoint=unix://{}", self.socket().display()).into(),
        ];
        all.extend(args.into_iter().map(|a| a.as_ref().to_owned()));
        self.netns.run(all)
    }

    /// The answer's status line to `GET path` sent to `target` from inside the network
    /// namespace of the pod `namespace/pod` (bash's `/dev/tcp`, run in the node's namespaces
    /// and then the pod's network namespace): what a process of that pod gets, NetworkPolicies
    /// included. An empty string when the connection is refused or cut.
    pub fn http_from_pod(
        &self,
        namespace: &str,
        pod: &str,
        target: SocketAddr,
        path: &str,
    ) -> Result<String, HarnessError> {
        let script = format!(
            "exec 3<>/dev/tcp/{ip}/{port} || exit 0; printf 'GET {path} HTTP/1.0\r\nHost: {ip}\r\n\r\n' >&3; head -n 1 <&3",
            ip = target.ip(),
            port = target.port(),
        );
        let out = self.in_pod_network(namespace, pod, &script)?;
        Ok(out.trim().to_owned())
    }

    /// Whether a TCP connection from the pod `namespace/pod` to `target` is accepted (within
    /// 10 s): NetworkPolicies included, whatever protocol the port speaks.
    pub fn connects_from_pod(
        &self,
        namespace: &str,
        pod: &str,
        target: SocketAddr,
    ) -> Result<bool, HarnessError> {
        let script = format!(
            "timeout 10 bash -c 'exec 3<>/dev/tcp/{ip}/{port}' 2>/dev/null && echo connected; exit 0",
            ip = target.ip(),
            port = target.port(),
        );
        Ok(self.in_pod_network(namespace, pod, &script)?.trim() == "connected")
    }

    /// Runs a bash `script` in the node's namespaces, inside the network namespace of the
    /// pod's sandbox; its output.
    fn in_pod_network(
        &self,
        namespace: &str,
        pod: &str,
        script: &str,
    ) -> Result<String, HarnessError> {
        // --name is a regular expression.
        let name = format!("^{pod}$");
        let id = self.crictl([
            "pods",
            "-q",
            "--state",
            "ready",
            "--namespace",
            namespace,
            "--name",
            &name,
        ])?;
        let id = id.lines().next().unwrap_or_default().trim().to_owned();
        if id.is_empty() {
            return Err(missing(format!("a sandbox of pod {namespace}/{pod}")));
        }
        let inspect: Value = serde_json::from_str(&self.crictl(["inspectp", &id])?)
            .map_err(|e| missing(format!("crictl inspectp JSON: {e}")))?;
        let pid = inspect["info"]["pid"]
            .as_u64()
            .ok_or_else(|| missing(format!("the sandbox pid of {namespace}/{pod}")))?;
        self.netns.run([
            "nsenter",
            &format!("--net=/proc/{pid}/ns/net"),
            "--",
            "timeout",
            "20",
            "bash",
            "-c",
            script,
        ])
    }

    /// The last lines of a component's log (`kubelet`, `containerd`, …), for failure messages.
    pub fn log_tail(&self, component: &str) -> String {
        crate::process::log_tail(
            &self.dir.join("logs").join(format!("{component}.log")),
            LOG_LINES,
        )
    }

    /// Pushes an OCI layout (`index.json`, `blobs/`) as `<registry>/<name>:latest`; returns
    /// the image reference pods use.
    pub async fn push_layout(&self, layout: &Path, name: &str) -> Result<String, HarnessError> {
        let index = read_json(&layout.join("index.json"))?;
        let digest = index["manifests"][0]["digest"]
            .as_str()
            .ok_or_else(|| missing(format!("a manifest in {}/index.json", layout.display())))?
            .to_owned();
        let blob = |digest: &str| -> Result<Vec<u8>, HarnessError> {
            let path = layout.join("blobs").join(digest.replacen(':', "/", 1));
            std::fs::read(&path)
                .map_err(|e| HarnessError::io(format!("reading {}", path.display()), e))
        };
        let manifest = blob(&digest)?;
        let parsed: Value = serde_json::from_slice(&manifest)
            .map_err(|e| missing(format!("a JSON manifest {digest}: {e}")))?;
        let mut blobs = vec![blob(value_str(&parsed["config"]["digest"])?)?];
        for layer in parsed["layers"].as_array().into_iter().flatten() {
            blobs.push(blob(value_str(&layer["digest"])?)?);
        }
        self.push(name, blobs, &manifest).await
    }

    /// Pushes an image of one uncompressed layer holding `files` (see [`LayerEntry`]) on top
    /// of the layers of `base` (an OCI layout) when given; `config` is the image's runtime
    /// config (`Entrypoint`, `User`, `Env`…), the base's when null.
    pub async fn push_image(
        &self,
        name: &str,
        base: Option<&Path>,
        files: &[LayerEntry],
        config: Value,
    ) -> Result<String, HarnessError> {
        let layer = tar_layer(files)?;
        let layer_digest = sha256(&layer);
        let mut blobs = Vec::new();
        let mut layers = Vec::new();
        let mut diff_ids = Vec::new();
        let mut config = config;
        if let Some(base) = base {
            let index = read_json(&base.join("index.json"))?;
            let manifest: Value = read_json(&blob_path(
                base,
                value_str(&index["manifests"][0]["digest"])?,
            ))?;
            let base_config =
                read_json(&blob_path(base, value_str(&manifest["config"]["digest"])?))?;
            for layer in manifest["layers"].as_array().into_iter().flatten() {
                let path = blob_path(base, value_str(&layer["digest"])?);
                blobs.push(
                    std::fs::read(&path)
                        .map_err(|e| HarnessError::io(format!("reading {}", path.display()), e))?,
                );
                layers.push(layer.clone());
            }
            for id in base_config["rootfs"]["diff_ids"]
                .as_array()
                .into_iter()
                .flatten()
            {
                diff_ids.push(id.clone());
            }
            if config.is_null() {
                config = base_config["config"].clone();
            }
        }
        layers.push(json!({
            "mediaType": "application/vnd.oci.image.layer.v1.tar",
            "digest": layer_digest,
            "size": layer.len(),
        }));
        diff_ids.push(json!(layer_digest));
        blobs.push(layer);
        let image_config = serde_json::to_vec(&json!({
            "architecture": "amd64",
            "os": "linux",
            "config": config,
            "rootfs": {"type": "layers", "diff_ids": diff_ids},
        }))
        .map_err(|e| missing(format!("an image config: {e}")))?;
        let manifest = serde_json::to_vec(&json!({
            "schemaVersion": 2,
            "mediaType": MANIFEST_TYPE,
            "config": {
                "mediaType": "application/vnd.oci.image.config.v1+json",
                "digest": sha256(&image_config),
                "size": image_config.len(),
            },
            "layers": layers,
        }))
        .map_err(|e| missing(format!("a manifest: {e}")))?;
        blobs.insert(0, image_config);
        self.push(name, blobs, &manifest).await
    }

    async fn push(
        &self,
        name: &str,
        blobs: Vec<Vec<u8>>,
        manifest: &[u8],
    ) -> Result<String, HarnessError> {
        let image = format!("{}/{name}:{TAG}", self.registry.host());
        let reference =
            Reference::parse(&image).map_err(|e| missing(format!("a reference {image}: {e}")))?;
        let http = self.registry.client()?;
        let mut session = Session::new(&http, None, &reference);
        for blob in blobs {
            session
                .push_blob(&blob)
                .await
                .map_err(|e| missing(format!("a pushed blob of {image}: {e}")))?;
        }
        session
            .push_manifest(TAG, manifest)
            .await
            .map_err(|e| missing(format!("the pushed manifest of {image}: {e}")))?;
        Ok(image)
    }

    /// The pod sandbox image: the `pause` binary `tools/build.sh node` builds.
    async fn push_pause(&self) -> Result<String, HarnessError> {
        let pause = std::fs::read(self.bins.join("pause"))
            .map_err(|e| HarnessError::io("reading the pause binary", e))?;
        self.push_image(
            "pause",
            None,
            &[LayerEntry::file("pause", 0o755, pause)],
            json!({"Entrypoint": ["/pause"], "User": "65535:65535"}),
        )
        .await
    }

    fn spawn(&self, name: &str, program: &Path, args: &[String]) -> Result<(), HarnessError> {
        let mut cmd = self.netns.command(program);
        cmd.args(args);
        let guard = spawn_guarded(
            cmd,
            name,
            &self.dir.join("logs").join(format!("{name}.log")),
        )?;
        self.processes
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .push(guard);
        Ok(())
    }

    fn admin_kubeconfig(&self) -> String {
        self.plane.kubeconfig_path().display().to_string()
    }

    fn pki(&self, file: &str) -> String {
        self.plane
            .dir()
            .join("pki")
            .join(file)
            .display()
            .to_string()
    }

    fn start_controllers(&self) -> Result<(), HarnessError> {
        let kubeconfig = format!("--kubeconfig={}", self.admin_kubeconfig());
        self.spawn(
            "kube-controller-manager",
            &self.bins.join("kube-controller-manager"),
            &[
                kubeconfig.clone(),
                "--leader-elect=false".into(),
                "--bind-address=127.0.0.1".into(),
                format!("--root-ca-file={}", self.pki("ca.crt")),
                format!("--service-account-private-key-file={}", self.pki("sa.key")),
                "--use-service-account-credentials=false".into(),
                format!("--service-cluster-ip-range={SERVICE_CIDR}"),
                // Namespaces end within a test's wait.
                "--concurrent-namespace-syncs=5".into(),
            ],
        )?;
        self.spawn(
            "kube-scheduler",
            &self.bins.join("kube-scheduler"),
            &[
                kubeconfig,
                "--leader-elect=false".into(),
                "--bind-address=127.0.0.1".into(),
            ],
        )
    }

    fn socket(&self) -> PathBuf {
        self.dir.join("containerd/containerd.sock")
    }

    async fn start_containerd(&self, pause: &str) -> Result<(), HarnessError> {
        let c = self.dir.join("containerd");
        let certs = c.join("certs.d").join(self.registry.host());
        mkdir(&certs)?;
        mkdir(&self.dir.join("cni/net.d"))?;
        write(
            &certs.join("hosts.toml"),
            &format!(
                "server = \"https://{host}\"\n[host.\"https://{host}\"]\n  capabilities = [\"pull\", \"resolve\"]\n  ca = \"{ca}\"\n",
                host = self.registry.host(),
                ca = self.registry.ca_file().display()
            ),
        )?;
        write(
            &self.dir.join("cni/net.d/10-pko-node.conflist"),
            &cni_config(&self.dir),
        )?;
        let config = c.join("config.toml");
        write(
            &config,
            &format!(
                r#"version = 4
root = "{root}"
state = "{state}"
imports = []
disabled_plugins = ["io.containerd.internal.v1.opt", "io.containerd.nri.v1.nri", "io.containerd.snapshotter.v1.blockfile", "io.containerd.snapshotter.v1.erofs", "io.containerd.differ.v1.erofs"]
[plugins.'io.containerd.server.v1.grpc']
  address = "{socket}"
[plugins.'io.containerd.server.v1.ttrpc']
  address = "{socket}.ttrpc"
[plugins.'io.containerd.cri.v1.images']
  snapshotter = "overlayfs"
  [plugins.'io.containerd.cri.v1.images'.pinned_images]
    sandbox = "{pause}"
  [plugins.'io.containerd.cri.v1.images'.registry]
    config_path = "{certs}"
[plugins.'io.containerd.transfer.v1.local']
  config_path = "{certs}"
[plugins.'io.containerd.cri.v1.runtime']
  netns_mounts_under_state_dir = true
  restrict_oom_score_adj = true
  [plugins.'io.containerd.cri.v1.runtime'.containerd]
    default_runtime_name = "runc"
    [plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.runc.options]
        BinaryName = "{runc}"
        Root = "{runc_root}"
        SystemdCgroup = false
  [plugins.'io.containerd.cri.v1.runtime'.cni]
    bin_dirs = ["{cni_bin}"]
    conf_dir = "{cni_conf}"
"#,
                root = c.join("root").display(),
                state = c.join("state").display(),
                socket = self.socket().display(),
                certs = c.join("certs.d").display(),
                runc = runc()?.display(),
                runc_root = c.join("runc").display(),
                cni_bin = self.bins.join("cni").display(),
                cni_conf = self.dir.join("cni/net.d").display(),
            ),
        )?;
        self.spawn(
            "containerd",
            &self.bins.join("containerd"),
            &[format!("--config={}", config.display())],
        )?;
        let socket = self.socket();
        wait_for("containerd's socket", SOCKET_TIMEOUT, || {
            let socket = socket.clone();
            async move { socket.exists().then_some(()) }
        })
        .await
        .map_err(|e| self.failed(e, "containerd"))
    }

    async fn start_kubelet(&self) -> Result<(), HarnessError> {
        let k = self.dir.join("kubelet");
        mkdir(&k)?;
        // The kubelet's own cgroups under a root of this node's, in every v1 hierarchy.
        for controller in cgroup_controllers() {
            mkdir(&controller.join(self.cgroup_root.trim_start_matches('/')))?;
        }
        let kubeconfig = k.join("kubeconfig");
        write(
            &kubeconfig,
            &format!(
                "apiVersion: v1\nkind: Config\nclusters:\n- name: node\n  cluster:\n    server: {server}\n    certificate-authority: {ca}\nusers:\n- name: kubelet\n  user:\n    client-certificate: {cert}\n    client-key: {key}\ncontexts:\n- name: node\n  context:\n    cluster: node\n    user: kubelet\ncurrent-context: node\n",
                server = self.plane.server_url(),
                ca = self.pki("ca.crt"),
                cert = self.pki("node-client.crt"),
                key = self.pki("node-client.key"),
            ),
        )?;
        let config = k.join("config.yaml");
        write(
            &config,
            &format!(
                r#"apiVersion: kubelet.config.k8s.io/v1beta1
kind: KubeletConfiguration
authentication:
  anonymous:
    enabled: true
  webhook:
    enabled: false
authorization:
  mode: AlwaysAllow
cgroupDriver: cgroupfs
cgroupRoot: {cgroup_root}
containerRuntimeEndpoint: unix://{socket}
clusterDNS: [{DNS_IP}]
clusterDomain: cluster.local
failSwapOn: false
resolvConf: ""
readOnlyPort: 0
healthzBindAddress: 127.0.0.1
podLogsDir: {logs}
serializeImagePulls: false
imageGCHighThresholdPercent: 100
imageGCLowThresholdPercent: 99
evictionHard:
  memory.available: 1Mi
  nodefs.available: 256Mi
  nodefs.inodesFree: 1%
  imagefs.available: 256Mi
"#,
                cgroup_root = self.cgroup_root,
                socket = self.socket().display(),
                logs = k.join("pod-logs").display(),
            ),
        )?;
        self.spawn(
            "kubelet",
            &self.bins.join("kubelet"),
            &[
                format!("--config={}", config.display()),
                format!("--kubeconfig={}", kubeconfig.display()),
                format!("--root-dir={}", k.join("root").display()),
                format!("--cert-dir={}", k.join("pki").display()),
                format!("--hostname-override={NODE_NAME}"),
                format!("--node-ip={NODE_IP}"),
            ],
        )?;
        let nodes: Api<NodeObject> = Api::all(self.plane.try_client()?);
        wait_for("the node to register", READY_TIMEOUT, || {
            let nodes = nodes.clone();
            async move { nodes.get_opt(NODE_NAME).await.ok().flatten().map(|_| ()) }
        })
        .await
        .map_err(|e| self.failed(e, "kubelet"))
    }

    async fn start_proxy_and_dns(&self) -> Result<(), HarnessError> {
        let p = self.dir.join("kube-proxy");
        mkdir(&p)?;
        let config = p.join("config.yaml");
        write(
            &config,
            &format!(
                r#"apiVersion: kubeproxy.config.k8s.io/v1alpha1
kind: KubeProxyConfiguration
mode: nftables
clientConnection:
  kubeconfig: {kubeconfig}
hostnameOverride: {NODE_NAME}
clusterCIDR: {POD_CIDR}
healthzBindAddress: 127.0.0.1:10256
metricsBindAddress: 127.0.0.1:10249
conntrack:
  maxPerCore: 0
  min: 0
  tcpEstablishedTimeout: 0s
  tcpCloseWaitTimeout: 0s
"#,
                kubeconfig = self.admin_kubeconfig()
            ),
        )?;
        self.spawn(
            "kube-proxy",
            &self.bins.join("kube-proxy"),
            &[format!("--config={}", config.display())],
        )?;

        let corefile = self.dir.join("coredns/Corefile");
        mkdir(&self.dir.join("coredns"))?;
        write(
            &corefile,
            &format!(
                ".:53 {{\n    errors\n    health 127.0.0.1:8080\n    ready 127.0.0.1:8181\n    kubernetes cluster.local in-addr.arpa ip6.arpa {{\n        kubeconfig {kubeconfig} pko-tests\n        pods insecure\n        fallthrough in-addr.arpa ip6.arpa\n    }}\n    cache 5\n}}\n",
                kubeconfig = self.admin_kubeconfig()
            ),
        )?;
        self.spawn(
            "coredns",
            &self.bins.join("coredns"),
            &[format!("-conf={}", corefile.display())],
        )?;
        self.dns_service().await
    }

    /// `kube-system/kube-dns` at [`DNS_IP`], served by CoreDNS on the node's address.
    async fn dns_service(&self) -> Result<(), HarnessError> {
        let client = self.plane.try_client()?;
        let service: Service = serde_json::from_value(json!({
            "metadata": {"name": "kube-dns", "namespace": "kube-system",
                "labels": {"k8s-app": "kube-dns"}},
            "spec": {"clusterIP": DNS_IP, "ports": [
                {"name": "dns", "port": 53, "protocol": "UDP", "targetPort": 53},
                {"name": "dns-tcp", "port": 53, "protocol": "TCP", "targetPort": 53}]}
        }))
        .map_err(|e| missing(format!("a DNS Service: {e}")))?;
        let slice: EndpointSlice = serde_json::from_value(json!({
            "metadata": {"name": "kube-dns-node", "namespace": "kube-system",
                "labels": {"kubernetes.io/service-name": "kube-dns",
                    "endpointslice.kubernetes.io/managed-by": "pko-tests"}},
            "addressType": "IPv4",
            "endpoints": [{"addresses": [NODE_IP], "conditions": {"ready": true}}],
            "ports": [{"name": "dns", "port": 53, "protocol": "UDP"},
                {"name": "dns-tcp", "port": 53, "protocol": "TCP"}]
        }))
        .map_err(|e| missing(format!("a DNS EndpointSlice: {e}")))?;
        let pp = PostParams::default();
        // The namespace appears when the apiserver's own controllers have made it.
        let services: Api<Service> = Api::namespaced(client.clone(), "kube-system");
        wait_for("the kube-dns Service", READY_TIMEOUT, || {
            let (services, service, pp) = (services.clone(), service.clone(), pp.clone());
            async move {
                match services.create(&pp, &service).await {
                    Ok(_) => Some(()),
                    Err(kube::Error::Api(s)) if s.is_already_exists() => Some(()),
                    Err(_) => None,
                }
            }
        })
        .await?;
        Api::<EndpointSlice>::namespaced(client, "kube-system")
            .create(&pp, &slice)
            .await
            .map_err(|e| HarnessError::kube("creating the DNS EndpointSlice", e))?;
        Ok(())
    }

    /// kube-router's NetworkPolicy controller alone (no routing, no service proxy: the bridge
    /// and kube-proxy do those): iptables filter rules and ipsets, so it needs no nftables
    /// `queue` statement. Started once its top-level chains exist, so a policy created after
    /// the node is Ready is enforced as soon as kube-router has synced it.
    async fn start_network_policies(&self) -> Result<(), HarnessError> {
        self.spawn(
            "kube-router",
            &self.bins.join("kube-router"),
            &[
                format!("--kubeconfig={}", self.admin_kubeconfig()),
                format!("--hostname-override={NODE_NAME}"),
                "--run-firewall=true".into(),
                "--run-router=false".into(),
                "--run-service-proxy=false".into(),
                "--run-loadbalancer=false".into(),
                format!("--service-cluster-ip-range={SERVICE_CIDR}"),
                "--health-port=0".into(),
                "--metrics-port=0".into(),
                "--v=2".into(),
            ],
        )?;
        let netns = self.netns.clone();
        wait_for("kube-router's firewall chains", READY_TIMEOUT, || {
            let netns = netns.clone();
            async move {
                netns
                    .run(["iptables", "-S", "KUBE-ROUTER-FORWARD"])
                    .ok()
                    .map(|_| ())
            }
        })
        .await
        .map_err(|e| self.failed(e, "kube-router"))
    }

    async fn wait_ready(&self) -> Result<(), HarnessError> {
        let nodes: Api<NodeObject> = Api::all(self.plane.try_client()?);
        let verdict = wait_for("the node to be Ready", READY_TIMEOUT, || {
            let nodes = nodes.clone();
            async move {
                let node = nodes.get_opt(NODE_NAME).await.ok().flatten()?;
                readiness(&node.status?.conditions?)
            }
        })
        .await
        .map_err(|e| self.failed(e, "kubelet"))?;
        verdict.map_err(|pressure| {
            missing(format!(
                "the node reports {pressure}, so it would evict or refuse the tests' pods; free space where the node keeps its files:\n{}",
                free_space(&self.dir)
            ))
        })
    }

    /// `e` with the end of `component`'s log.
    fn failed(&self, e: HarnessError, component: &str) -> HarnessError {
        missing(format!(
            "{e}; {component}'s log:\n{}",
            self.log_tail(component)
        ))
    }

    /// Stops every process (the namespaces' holder takes every container, shim and
    /// control-plane process with it), removes the node's cgroups and its folder. Idempotent.
    pub fn shutdown(&self) {
        let mut processes = self
            .processes
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        while let Some(mut p) = processes.pop() {
            p.kill();
        }
        drop(processes);
        self.forwards
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clear();
        self.netns.stop();
        // runc makes the root in the unified hierarchy too.
        for hierarchy in cgroup_controllers()
            .into_iter()
            .chain([PathBuf::from("/sys/fs/cgroup/unified")])
        {
            remove_cgroup(&hierarchy.join(self.cgroup_root.trim_start_matches('/')));
        }
        let temp = self
            .temp
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take();
        // PKO_TESTS_KEEP_STATE=1 keeps the logs and state for a look after the run.
        if std::env::var_os("PKO_TESTS_KEEP_STATE").is_some_and(|v| v == "1")
            && let Some(temp) = temp
        {
            eprintln!("pko-tests: node state kept in {}", temp.keep().display());
        }
    }

    /// The node shared by the tests of this binary: started on first call, on a thread of its
    /// own (see [`ControlPlane::shared`]); stopped when the test binary exits.
    pub async fn shared() -> Result<&'static Node, HarnessError> {
        SHARED_INIT.call_once(|| {
            let spawned = std::thread::Builder::new()
                .name("pko-tests-shared-node".into())
                .spawn(|| {
                    let result = match tokio::runtime::Builder::new_current_thread()
                        .enable_all()
                        .build()
                    {
                        Ok(rt) => rt.block_on(Node::start()).map_err(|e| e.to_string()),
                        Err(e) => Err(format!("cannot build a tokio runtime: {e}")),
                    };
                    if result.is_ok() {
                        // SAFETY: registers a plain `extern "C"` function.
                        unsafe { libc::atexit(stop_shared_at_exit) };
                    }
                    let _ = SHARED.set(result);
                    SHARED_SET.notify_waiters();
                });
            if let Err(e) = spawned {
                let _ = SHARED.set(Err(format!("cannot start the node's thread: {e}")));
            }
        });
        loop {
            let notified = SHARED_SET.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            if let Some(result) = SHARED.get() {
                return result
                    .as_ref()
                    .map_err(|e| HarnessError::Shared(format!("the node: {e}")));
            }
            notified.await;
        }
    }
}

static SHARED: std::sync::OnceLock<Result<Node, String>> = std::sync::OnceLock::new();
static SHARED_INIT: std::sync::Once = std::sync::Once::new();
static SHARED_SET: std::sync::LazyLock<tokio::sync::Notify> =
    std::sync::LazyLock::new(tokio::sync::Notify::new);

extern "C" fn stop_shared_at_exit() {
    if let Some(Ok(node)) = SHARED.get() {
        node.shutdown();
    }
}

impl Drop for Node {
    fn drop(&mut self) {
        self.shutdown();
    }
}

/// Where `make image` leaves the OCI layouts (`$PKO_IMAGE_DIR`, else the cache's `images`).
pub fn image_dir() -> PathBuf {
    match std::env::var_os("PKO_IMAGE_DIR").filter(|v| !v.is_empty()) {
        Some(dir) => PathBuf::from(dir),
        None => {
            PathBuf::from(std::env::var_os("HOME").unwrap_or_default()).join(".cache/pko-rs/images")
        }
    }
}

/// An OCI layout `make image` wrote (`pko-rs`, `pko-rs-agent`), or an error saying so.
pub fn image_layout(name: &str) -> Result<PathBuf, HarnessError> {
    let layout = image_dir().join(name);
    if !layout.join("index.json").is_file() {
        return Err(missing(format!(
            "the OCI layout {}: run `make image`",
            layout.display()
        )));
    }
    Ok(layout)
}

/// The node's network: its address on loopback, and the default route there too, so nothing
/// routed ever leaves the namespace (the kernel has no dummy links); forwarding and bridged
/// traffic through netfilter, as kube-proxy and NetworkPolicies need. `/run` is a tmpfs of the
/// node's own.
fn network(netns: &Netns) -> Result<(), HarnessError> {
    netns.run(["ip", "addr", "add", &format!("{NODE_IP}/32"), "dev", "lo"])?;
    // With the node's address as the source: a connection to a Service (the apiserver to a
    // webhook) is translated to a pod address after the route was chosen, and a loopback
    // source would then be dropped as martian.
    netns.run(["ip", "route", "add", "default", "dev", "lo", "src", NODE_IP])?;
    netns.run(["sysctl", "-qw", "net.ipv4.ip_forward=1"])?;
    // Bridged pod-to-pod traffic through netfilter (Service replies, NetworkPolicies).
    netns.run(["sysctl", "-qw", "net.bridge.bridge-nf-call-iptables=1"])?;
    netns.run(["mount", "-t", "tmpfs", "-o", "mode=755", "tmpfs", "/run"])?;
    Ok(())
}

fn cni_config(dir: &Path) -> String {
    json!({
        "cniVersion": "1.0.0",
        "name": "pko-node",
        "plugins": [
            {
                "type": "bridge",
                "bridge": "cni0",
                "isGateway": true,
                "ipMasq": false,
                "hairpinMode": true,
                "ipam": {
                    "type": "host-local",
                    "ranges": [[{"subnet": POD_CIDR}]],
                    "routes": [{"dst": "0.0.0.0/0"}],
                    "dataDir": dir.join("cni/ipam").display().to_string(),
                },
            },
            {"type": "portmap", "capabilities": {"portMappings": true}, "backend": "nftables"},
        ],
    })
    .to_string()
}

/// The v1 hierarchies (`/sys/fs/cgroup/<controller>`), the systemd one included.
fn cgroup_controllers() -> Vec<PathBuf> {
    let Ok(entries) = std::fs::read_dir("/sys/fs/cgroup") else {
        return Vec::new();
    };
    entries
        .filter_map(Result::ok)
        .map(|e| e.path())
        .filter(|p| p.join("cgroup.procs").exists() && !p.join("cgroup.controllers").exists())
        .filter(|p| !p.is_symlink())
        .collect()
}

/// Removes a cgroup folder and its children, deepest first (a cgroup is removed with rmdir).
fn remove_cgroup(path: &Path) {
    if let Ok(entries) = std::fs::read_dir(path) {
        for entry in entries.filter_map(Result::ok) {
            if entry.file_type().is_ok_and(|t| t.is_dir()) {
                remove_cgroup(&entry.path());
            }
        }
    }
    let _ = std::fs::remove_dir(path);
}

fn runc() -> Result<PathBuf, HarnessError> {
    for dir in ["/usr/sbin", "/usr/bin", "/usr/local/sbin", "/usr/local/bin"] {
        let path = Path::new(dir).join("runc");
        if path.is_file() {
            return Ok(path);
        }
    }
    Err(missing(
        "runc (`tools/build.sh node` installs it from Debian)".into(),
    ))
}

fn registry_port(registry: &Registry) -> Result<u16, HarnessError> {
    registry
        .host()
        .rsplit(':')
        .next()
        .and_then(|p| p.parse().ok())
        .ok_or_else(|| missing(format!("a port in the registry's host {}", registry.host())))
}

fn missing(what: String) -> HarnessError {
    HarnessError::Missing { what }
}

fn mkdir(path: &Path) -> Result<(), HarnessError> {
    std::fs::create_dir_all(path)
        .map_err(|e| HarnessError::io(format!("creating {}", path.display()), e))
}

fn write(path: &Path, text: &str) -> Result<(), HarnessError> {
    std::fs::write(path, text)
        .map_err(|e| HarnessError::io(format!("writing {}", path.display()), e))
}

fn read_json(path: &Path) -> Result<Value, HarnessError> {
    let text = std::fs::read(path)
        .map_err(|e| HarnessError::io(format!("reading {}", path.display()), e))?;
    serde_json::from_slice(&text).map_err(|e| missing(format!("JSON in {}: {e}", path.display())))
}

fn blob_path(layout: &Path, digest: &str) -> PathBuf {
    layout.join("blobs").join(digest.replacen(':', "/", 1))
}

fn value_str(v: &Value) -> Result<&str, HarnessError> {
    v.as_str()
        .ok_or_else(|| missing(format!("a string, not {v}")))
}

fn sha256(bytes: &[u8]) -> String {
    format!("sha256:{}", hex::encode(Sha256::digest(bytes)))
}

/// One entry of a layer [`Node::push_image`] makes: a folder (no content) or a file, at a path
/// relative to `/`. Folders a base image has must not be repeated: the new entry's owner and
/// mode would replace theirs.
pub struct LayerEntry {
    pub path: String,
    pub mode: u32,
    pub uid: u64,
    pub content: Option<Vec<u8>>,
}

impl LayerEntry {
    pub fn file(path: &str, mode: u32, content: Vec<u8>) -> Self {
        Self {
            path: path.into(),
            mode,
            uid: 0,
            content: Some(content),
        }
    }

    pub fn dir(path: &str, mode: u32, uid: u64) -> Self {
        Self {
            path: path.into(),
            mode,
            uid,
            content: None,
        }
    }
}

/// An uncompressed layer of `entries`, in their order.
fn tar_layer(entries: &[LayerEntry]) -> Result<Vec<u8>, HarnessError> {
    let mut builder = tar::Builder::new(Vec::new());
    let io = |e: std::io::Error| HarnessError::io("writing an image layer", e);
    for entry in entries {
        let mut header = tar::Header::new_gnu();
        header.set_mode(entry.mode);
        header.set_uid(entry.uid);
        header.set_gid(entry.uid);
        header.set_mtime(0);
        match &entry.content {
            Some(content) => {
                header.set_entry_type(tar::EntryType::Regular);
                header.set_size(content.len() as u64);
                builder
                    .append_data(&mut header, &entry.path, content.as_slice())
                    .map_err(io)?;
            }
            None => {
                header.set_entry_type(tar::EntryType::Directory);
                header.set_size(0);
                builder
                    .append_data(&mut header, &entry.path, std::io::empty())
                    .map_err(io)?;
            }
        }
    }
    builder.into_inner().map_err(io)
}

/// A node's readiness from its conditions: `Ok` once Ready, `Err` naming a pressure condition
/// at once (the kubelet is Ready under pressure, yet evicts and refuses pods), `None` not yet.
fn readiness(conditions: &[NodeCondition]) -> Option<Result<(), String>> {
    if let Some(c) = conditions
        .iter()
        .find(|c| c.type_.ends_with("Pressure") && c.status == "True")
    {
        let message = c.message.as_deref().unwrap_or_default();
        return Some(Err(format!("{}: {message}", c.type_)));
    }
    conditions
        .iter()
        .any(|c| c.type_ == "Ready" && c.status == "True")
        .then_some(Ok(()))
}

/// `df -h` of `dir`, or why it could not be run.
fn free_space(dir: &Path) -> String {
    match std::process::Command::new("df").arg("-h").arg(dir).output() {
        Ok(out) => String::from_utf8_lossy(&out.stdout).into_owned(),
        Err(e) => format!("df: {e}"),
    }
}

#[cfg(test)]
mod readiness_tests {
    use super::*;

    fn condition(type_: &str, status: &str) -> NodeCondition {
        NodeCondition {
            type_: type_.into(),
            status: status.into(),
            message: Some(format!("{type_} is {status}")),
            ..NodeCondition::default()
        }
    }

    #[test]
    fn a_node_under_pressure_fails_at_once_and_a_ready_one_passes() {
        assert_eq!(readiness(&[condition("Ready", "False")]), None);
        assert_eq!(
            readiness(&[
                condition("DiskPressure", "False"),
                condition("Ready", "True")
            ]),
            Some(Ok(()))
        );
        let pressed = readiness(&[
            condition("Ready", "True"),
            condition("DiskPressure", "True"),
        ]);
        assert_eq!(
            pressed,
            Some(Err("DiskPressure: DiskPressure is True".into()))
        );
    }
}
