//! End to end on a real node ([`pko_tests::node`]): kubelet, containerd, CNI, kube-proxy,
//! CoreDNS, controller-manager, scheduler and kube-router's NetworkPolicy firewall, with the images
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
    idle_pod(node, &ns, "idle", json!({})).await;
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

/// An idle pod (the pause image) in `ns` with `labels`, Running; its IP.
async fn idle_pod(node: &Node, ns: &str, name: &str, labels: serde_json::Value) -> String {
    let pods: Api<Pod> = Api::namespaced(node.plane().client(), ns);
    let pod: Pod = serde_json::from_value(json!({
        "metadata": {"name": name, "labels": labels},
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
            let status = pods.get(name).await.ok()?.status?;
            (status.phase.as_deref() == Some("Running"))
                .then_some(status.pod_ip)
                .flatten()
        }
    })
    .await
    .unwrap_or_else(|e| panic!("{e}\nkubelet:\n{}", node.log_tail("kubelet")))
}

/// The release namespace of the chart on the node.
const RELEASE_NAMESPACE: &str = "pko-rs-system";
const INSTALL_TIMEOUT: &str = "300s";
const STACK_TIMEOUT: Duration = Duration::from_secs(600);

/// What one `helm install` on the shared node left: the images it runs.
struct Installed {
    /// The workspace image: the agent image with the Kubernetes provider installed in the
    /// user's `~/.pulumi/plugins`, as images that bundle providers do.
    workspace_image: String,
}

static INSTALLED: tokio::sync::OnceCell<Installed> = tokio::sync::OnceCell::const_new();

/// `make image`'s two images pushed to the node's registry, and `helm install` of
/// deploy/helm/pko-rs with the image values pointing there (2 replicas, leader election, the
/// webhook and its certificates, probes), waited for.
async fn installed(node: &'static Node) -> &'static Installed {
    INSTALLED
        .get_or_init(|| async move {
            let operator = node
                .push_layout(&image_layout("pko-rs").expect("operator image"), "pko-rs")
                .await
                .expect("push the operator image");
            let agent_layout = image_layout("pko-rs-agent").expect("agent image");
            node.push_layout(&agent_layout, "pko-rs-agent")
                .await
                .expect("push the agent image");
            let workspace_image = push_workspace_image(node, &agent_layout).await;
            let (repository, tag) = operator.rsplit_once(':').expect("a tag");
            let out = helm(node)
                .args(["install", "pko-rs"])
                .arg(super::helm::chart())
                .args([
                    "--namespace",
                    RELEASE_NAMESPACE,
                    "--create-namespace",
                    "--wait",
                ])
                .args(["--timeout", INSTALL_TIMEOUT])
                .arg(format!("--set=image.repository={repository}"))
                .arg(format!("--set=image.tag={tag}"))
                .arg(format!(
                    "--set=egress.serviceCIDRs={{{}}}",
                    pko_tests::node::SERVICE_CIDR
                ))
                .arg(format!(
                    "--set=egress.podCIDRs={{{}}}",
                    pko_tests::node::POD_CIDR
                ))
                .output()
                .expect("run helm");
            assert!(
                out.status.success(),
                "helm install failed: {}{}\nkubelet:\n{}",
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr),
                node.log_tail("kubelet")
            );
            Installed { workspace_image }
        })
        .await
}

fn helm(node: &Node) -> std::process::Command {
    let dir = pko_tests::tool_dir("helm").unwrap_or_else(|e| panic!("{e}"));
    let mut cmd = std::process::Command::new(dir.join("helm"));
    let home = node.dir().join("helm-home");
    cmd.env("HELM_CONFIG_HOME", home.join("config"))
        .env("HELM_CACHE_HOME", home.join("cache"))
        .env("HELM_DATA_HOME", home.join("data"))
        .env("KUBECONFIG", node.plane().kubeconfig_path());
    cmd
}

/// The agent image plus a layer with the Kubernetes provider under the user's home.
async fn push_workspace_image(node: &Node, agent_layout: &std::path::Path) -> String {
    use pko_tests::node::LayerEntry;
    let pulumi = pko_tests::tool_dir("pulumi").expect("pulumi tools");
    let version = std::fs::read_to_string(pulumi.join("pulumi-resource-kubernetes.version"))
        .expect("the provider's version");
    let provider = std::fs::read(pulumi.join("pulumi-resource-kubernetes")).expect("provider");
    let folder = format!(
        "home/nonroot/.pulumi/plugins/resource-kubernetes-v{}",
        version.trim()
    );
    node.push_image(
        "pko-rs-workspace",
        Some(agent_layout),
        &[
            LayerEntry::dir("home/nonroot/.pulumi", 0o1777, 0),
            LayerEntry::dir("home/nonroot/.pulumi/plugins", 0o1777, 0),
            LayerEntry::dir(&folder, 0o755, 0),
            LayerEntry::file(
                &format!("{folder}/pulumi-resource-kubernetes"),
                0o755,
                provider,
            ),
        ],
        serde_json::Value::Null,
    )
    .await
    .expect("push the workspace image")
}

/// An example manifest (`examples/<file>`) as JSON, moved to `namespace`.
fn example(file: &str, namespace: &str) -> serde_json::Value {
    let path = pko_tests::repo_root().join("examples").join(file);
    let text = std::fs::read_to_string(&path).expect("example");
    let mut doc: serde_json::Value = yaml_serde::from_str(&text).expect("example YAML");
    doc["metadata"]["namespace"] = json!(namespace);
    doc
}

/// Creates `doc` (a namespaced object of any kind) with the admin client.
async fn create(node: &Node, doc: &serde_json::Value) {
    let client = node.plane().client();
    let (group, version) = match doc["apiVersion"]
        .as_str()
        .expect("apiVersion")
        .split_once('/')
    {
        Some((g, v)) => (g.to_owned(), v.to_owned()),
        None => (
            String::new(),
            doc["apiVersion"].as_str().unwrap_or_default().to_owned(),
        ),
    };
    let kind = doc["kind"].as_str().expect("kind");
    let gvk = kube::api::GroupVersionKind::gvk(&group, &version, kind);
    let (resource, _) = kube::discovery::pinned_kind(&client, &gvk)
        .await
        .expect("discover the kind");
    let ns = doc["metadata"]["namespace"].as_str().expect("namespace");
    let api: Api<kube::api::DynamicObject> = Api::namespaced_with(client, ns, &resource);
    let object: kube::api::DynamicObject = serde_json::from_value(doc.clone()).expect("object");
    api.create(&PostParams::default(), &object)
        .await
        .unwrap_or_else(|e| panic!("create {kind}: {e}"));
}

/// Waits for a Stack's Ready=True; the last status and the operator's and kubelet's logs
/// otherwise.
async fn stack_ready(node: &Node, ns: &str, name: &str) -> pko_api::stack::Stack {
    let stacks: Api<pko_api::stack::Stack> = Api::namespaced(node.plane().client(), ns);
    let ready = wait_for(&format!("Stack {ns}/{name} Ready"), STACK_TIMEOUT, || {
        let stacks = stacks.clone();
        async move {
            let stack = stacks.get(name).await.ok()?;
            let ready = stack
                .status
                .as_ref()?
                .conditions
                .iter()
                .any(|c| c.type_ == "Ready" && c.status == "True");
            ready.then_some(stack)
        }
    })
    .await;
    match ready {
        Ok(stack) => stack,
        Err(e) => {
            let stack = stacks.get(name).await.ok();
            panic!(
                "{e}\nstatus: {}\npods: {}\nkubelet:\n{}",
                serde_json::to_string_pretty(&stack.map(|s| s.status)).unwrap_or_default(),
                node.crictl(["ps", "-a"]).unwrap_or_else(|e| e.to_string()),
                node.log_tail("kubelet")
            )
        }
    }
}

/// examples/program.yaml and examples/stack.yaml reach Ready on the node: the workspace pod is
/// run by the kubelet from our images (bootstrap from the operator image, the agent and pulumi
/// from the workspace image), fetches the Program's artifact from the operator's file server
/// through its Service's DNS name, and a second Stack's Program creates a real ConfigMap with
/// the Pulumi Kubernetes provider.
#[tokio::test]
async fn examples_reach_ready_and_the_provider_creates_a_configmap() {
    let _machine = serial::shared().await;
    let _node = NODE_LOCK.lock().await;
    let node = node().await;
    let installed = installed(node).await;
    let ns = node
        .plane()
        .namespace("e2e-examples")
        .await
        .expect("namespace");
    create(node, &example("program.yaml", &ns)).await;
    let mut stack = example("stack.yaml", &ns);
    stack["spec"]["backend"] = json!("file:///share");
    stack["spec"]["workspaceTemplate"] = json!({"spec": {"image": installed.workspace_image}});
    create(node, &stack).await;
    let ready = stack_ready(node, &ns, "hello").await;
    let outputs = serde_json::to_value(&ready.status).expect("status");
    assert_eq!(
        outputs["outputs"]["message"],
        json!("Hello from pko-rs, world"),
        "{outputs}"
    );

    // The provider, as the workspace's service account, creates a ConfigMap.
    let binding = json!({
        "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding",
        "metadata": {"name": "workspace-edit", "namespace": ns},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": "edit"},
        "subjects": [{"kind": "ServiceAccount", "name": "default", "namespace": ns}]
    });
    create(node, &binding).await;
    create(
        node,
        &json!({
            "apiVersion": "pulumi.com/v1", "kind": "Program",
            "metadata": {"name": "configmap", "namespace": ns},
            "program": {
                "resources": {"cm": {"type": "kubernetes:core/v1:ConfigMap", "properties": {
                    "metadata": {"name": "made-by-pulumi", "namespace": ns},
                    "data": {"greeting": "hello"}}}},
                "outputs": {"uid": "${cm.metadata.uid}"}
            }
        }),
    )
    .await;
    let mut cm_stack = stack.clone();
    cm_stack["metadata"]["name"] = json!("configmap");
    cm_stack["spec"]["programRef"]["name"] = json!("configmap");
    create(node, &cm_stack).await;
    stack_ready(node, &ns, "configmap").await;
    let cms: Api<k8s_openapi::api::core::v1::ConfigMap> =
        Api::namespaced(node.plane().client(), &ns);
    let cm = cms
        .get("made-by-pulumi")
        .await
        .expect("the ConfigMap pulumi made");
    assert_eq!(
        cm.data
            .unwrap_or_default()
            .get("greeting")
            .map(String::as_str),
        Some("hello")
    );
}

/// A Program's artifact URL once published.
async fn artifact_url(node: &Node, ns: &str, name: &str, generation: i64) -> String {
    let programs: Api<pko_api::program::Program> = Api::namespaced(node.plane().client(), ns);
    wait_for(
        &format!("Program {ns}/{name} published"),
        STACK_TIMEOUT,
        || {
            let programs = programs.clone();
            async move {
                let p = programs.get(name).await.ok()?;
                let status = p.status?;
                (status.observed_generation? >= generation).then_some(())?;
                status.artifact.map(|a| a.url)
            }
        },
    )
    .await
    .expect("artifact")
}

/// `GET path` from the host through a forward to `target` inside the node; the status code.
async fn http_status(node: &Node, target: std::net::SocketAddr, path: &str) -> Option<u16> {
    let port = pko_tests::agent::free_port().ok()?;
    let forward = node.netns().forward_in(port, target).ok()?;
    let url = format!("http://127.0.0.1:{}{path}", forward.local_addr().port());
    let answer = reqwest::Client::new()
        .get(url)
        .timeout(Duration::from_secs(10))
        .send()
        .await
        .ok()?;
    Some(answer.status().as_u16())
}

/// The path and query of an artifact URL.
fn path_of(url: &str) -> String {
    let rest = url.split_once("://").map_or(url, |(_, r)| r);
    rest.find('/')
        .map_or_else(|| "/".to_owned(), |i| rest[i..].to_owned())
}

/// The operator's pods: (name, pod IP).
async fn operator_pods(node: &Node) -> Vec<(String, String)> {
    let pods: Api<Pod> = Api::namespaced(node.plane().client(), RELEASE_NAMESPACE);
    let list = pods
        .list(&kube::api::ListParams::default().labels("app.kubernetes.io/name=pko-rs-operator"))
        .await
        .expect("operator pods");
    list.items
        .into_iter()
        .filter(|p| p.metadata.deletion_timestamp.is_none())
        .filter_map(|p| {
            let ip = p.status.as_ref()?.pod_ip.clone()?;
            Some((p.metadata.name.clone()?, ip))
        })
        .collect()
}

async fn lease_holder(node: &Node) -> Option<String> {
    let leases: Api<k8s_openapi::api::coordination::v1::Lease> =
        Api::namespaced(node.plane().client(), RELEASE_NAMESPACE);
    leases
        .get("pko-rs-operator")
        .await
        .ok()?
        .spec?
        .holder_identity
}

/// The leader's container is killed with `crictl stop`: a new process takes the Lease once it
/// expires and reconciles (a Program edit is published), and the file server answers on the
/// standby the whole time.
#[tokio::test]
async fn the_standby_takes_over_when_the_leader_is_killed() {
    let _machine = serial::shared().await;
    let _node = NODE_LOCK.lock().await;
    let node = node().await;
    installed(node).await;
    let ns = node
        .plane()
        .namespace("e2e-leader")
        .await
        .expect("namespace");
    create(node, &example("program.yaml", &ns)).await;
    let url = artifact_url(node, &ns, "hello", 1).await;
    let holder = wait_for("a leader", STACK_TIMEOUT, || lease_holder(node))
        .await
        .expect("leader");
    let leader = holder.split('_').next().expect("pod name").to_owned();
    let pods = operator_pods(node).await;
    let (standby, standby_ip) = pods
        .iter()
        .find(|(name, _)| *name != leader)
        .cloned()
        .unwrap_or_else(|| panic!("a standby beside {leader}: {pods:?}"));
    let file_server = std::net::SocketAddr::new(standby_ip.parse().expect("ip"), 9090);
    assert_eq!(
        http_status(node, file_server, &path_of(&url)).await,
        Some(200)
    );

    let id = node
        .crictl([
            "ps",
            "-q",
            "--name",
            "operator",
            "--label",
            &format!("io.kubernetes.pod.name={leader}"),
        ])
        .expect("crictl ps");
    let id = id.trim();
    assert!(!id.is_empty(), "no container of {leader}");
    node.crictl(["stop", "--timeout", "0", id])
        .expect("crictl stop");
    assert_eq!(
        http_status(node, file_server, &path_of(&url)).await,
        Some(200),
        "the standby's file server answers while the leader is gone"
    );
    // The kubelet restarts the killed container at once, so two processes wait for the Lease
    // to expire: the standby and the restarted one (a new identity). Whichever renews first
    // leads; the killed process never again.
    let new = wait_for("a new leader", STACK_TIMEOUT, || async {
        let h = lease_holder(node).await?;
        (h != holder).then_some(h)
    })
    .await
    .expect("a new process takes the Lease");
    assert!(
        new.starts_with(&format!("{standby}_")) || new.starts_with(&format!("{leader}_")),
        "{new}"
    );

    // The new leader reconciles: an edit is published, and served.
    let programs: Api<pko_api::program::Program> = Api::namespaced(node.plane().client(), &ns);
    programs
        .patch(
            "hello",
            &kube::api::PatchParams::default(),
            &kube::api::Patch::Merge(
                json!({"program": {"outputs": {"other": "after the failover"}}}),
            ),
        )
        .await
        .expect("edit the Program");
    let url2 = artifact_url(node, &ns, "hello", 2).await;
    assert_ne!(url, url2);
    assert_eq!(
        http_status(node, file_server, &path_of(&url2)).await,
        Some(200)
    );
}

/// A Stack whose workspace pod template runs as root is refused at admission by the
/// chart's webhook, naming the field and the rule.
#[tokio::test]
async fn a_root_pod_template_is_refused() {
    let _machine = serial::shared().await;
    let _node = NODE_LOCK.lock().await;
    let node = node().await;
    installed(node).await;
    let ns = node.plane().namespace("e2e-root").await.expect("namespace");
    let mut stack = example("stack.yaml", &ns);
    stack["spec"]["workspaceTemplate"] = json!({"spec": {"podTemplate": {"spec": {
        "securityContext": {"runAsUser": 0}, "containers": [{"name": "pulumi"}]}}}});
    let client = node.plane().client();
    let stacks: Api<pko_api::stack::Stack> = Api::namespaced(client, &ns);
    let object: pko_api::stack::Stack = serde_json::from_value(stack).expect("stack");
    let err = stacks
        .create(&PostParams::default(), &object)
        .await
        .expect_err("a root pod template is refused");
    let text = err.to_string();
    assert!(text.contains("runAsUser"), "{text}");
    assert!(text.contains("must not be 0 (root)"), "{text}");
}

/// `crictl inspect` of the pulumi container of the workspace pod in `ns`.
fn inspect_pulumi_container(node: &Node, ns: &str) -> serde_json::Value {
    let id = node
        .crictl([
            "ps",
            "-q",
            "--name",
            "pulumi",
            "--label",
            &format!("io.kubernetes.pod.namespace={ns}"),
        ])
        .expect("crictl ps");
    let id = id
        .lines()
        .next()
        .expect("a pulumi container")
        .trim()
        .to_owned();
    serde_json::from_str(&node.crictl(["inspect", &id]).expect("crictl inspect")).expect("json")
}

/// The pulumi container of the workspace pod in `ns`, as the runtime runs it: (uid of the
/// runtime spec, read-only root, the `Uid:` line of its process).
fn pulumi_container(node: &Node, ns: &str) -> (u64, bool, String) {
    let inspect = inspect_pulumi_container(node, ns);
    let spec = &inspect["info"]["runtimeSpec"];
    let uid = spec["process"]["user"]["uid"].as_u64().expect("uid");
    let readonly = spec["root"]["readonly"].as_bool().unwrap_or(false);
    let pid = inspect["info"]["pid"].as_u64().expect("pid");
    let status = node
        .netns()
        .run(["cat", &format!("/proc/{pid}/status")])
        .expect("the process's status");
    let uid_line = status
        .lines()
        .find(|l| l.starts_with("Uid:"))
        .unwrap_or_default()
        .to_owned();
    (uid, readonly, uid_line)
}

/// What the kubelet gave the pulumi container of the workspace pod in `ns`, read where the
/// process lives: its memory cgroup's limit and its CPU cgroup's shares and quota (cgroup v1,
/// the node's), and the subject of the service account token mounted in it.
fn pulumi_container_as_run(node: &Node, ns: &str) -> (u64, u64, i64, String) {
    let inspect = inspect_pulumi_container(node, ns);
    let pid = inspect["info"]["pid"].as_u64().expect("pid");
    let cat = |path: String| {
        node.netns()
            .run(["cat", &path])
            .unwrap_or_else(|e| panic!("{path}: {e}"))
            .trim()
            .to_owned()
    };
    let cgroups = cat(format!("/proc/{pid}/cgroup"));
    // `<id>:<controller>[,<controller>…]:<path>`
    let cgroup_of = |controller: &str| {
        cgroups
            .lines()
            .find_map(|l| {
                let mut parts = l.splitn(3, ':');
                let (_, controllers, path) = (parts.next()?, parts.next()?, parts.next()?);
                controllers
                    .split(',')
                    .any(|c| c == controller)
                    .then(|| format!("/sys/fs/cgroup/{controller}{path}"))
            })
            .unwrap_or_else(|| panic!("no {controller} cgroup in {cgroups}"))
    };
    let memory = cat(format!("{}/memory.limit_in_bytes", cgroup_of("memory")));
    let cpu = cgroup_of("cpu");
    let shares = cat(format!("{cpu}/cpu.shares"));
    let quota = cat(format!("{cpu}/cpu.cfs_quota_us"));
    let token = cat(format!(
        "/proc/{pid}/root/var/run/secrets/kubernetes.io/serviceaccount/token"
    ));
    use base64::Engine;
    let claims = token
        .split('.')
        .nth(1)
        .and_then(|p| {
            base64::engine::general_purpose::URL_SAFE_NO_PAD
                .decode(p)
                .ok()
        })
        .and_then(|p| serde_json::from_slice::<serde_json::Value>(&p).ok())
        .expect("a JWT");
    (
        memory.parse().expect("a memory limit"),
        shares.parse().expect("cpu shares"),
        quota.parse().expect("a cpu quota"),
        claims["sub"].as_str().unwrap_or_default().to_owned(),
    )
}

/// A restricted workspace (the default profile) with a read-only root filesystem reaches
/// Ready: runc runs its pulumi container as uid 1000 on a read-only root. The Workspace's
/// `serviceAccountName`, `resources` and `imagePullPolicy` are what the kubelet ran it with:
/// the token mounted in the container is the account's, its cgroups have the limits and the
/// requests' CPU shares, and the image the fetch container pulled is not pulled again for it
/// (`IfNotPresent`; the apiserver's default for this `:latest` image is `Always`).
#[tokio::test]
async fn a_restricted_workspace_runs_as_1000_on_a_read_only_root() {
    let _machine = serial::shared().await;
    let _node = NODE_LOCK.lock().await;
    let node = node().await;
    let installed = installed(node).await;
    let ns = node
        .plane()
        .namespace("e2e-restricted")
        .await
        .expect("namespace");
    create(node, &example("program.yaml", &ns)).await;
    create(
        node,
        &json!({"apiVersion": "v1", "kind": "ServiceAccount",
            "metadata": {"name": "deployer", "namespace": ns}}),
    )
    .await;
    let resources = json!({"requests": {"cpu": "150m", "memory": "200Mi"},
        "limits": {"cpu": "2", "memory": "1Gi"}});
    let mut stack = example("stack.yaml", &ns);
    stack["spec"]["backend"] = json!("file:///share");
    stack["spec"]["workspaceTemplate"] = json!({"spec": {
        "image": installed.workspace_image,
        "serviceAccountName": "deployer",
        // Not the apiserver's default for a `:latest` image (`Always`).
        "imagePullPolicy": "IfNotPresent",
        "resources": resources,
        // On a read-only root, pulumi's home and /tmp must be volumes (pulumi writes its
        // workspace settings and login there); the Program needs no plugin from the image.
        "podTemplate": {"spec": {
            "volumes": [{"name": "pulumi-home", "emptyDir": {}}, {"name": "tmp", "emptyDir": {}}],
            "containers": [{"name": "pulumi",
                "securityContext": {"readOnlyRootFilesystem": true},
                "volumeMounts": [{"name": "pulumi-home", "mountPath": "/home/nonroot/.pulumi"},
                    {"name": "tmp", "mountPath": "/tmp"}]}]}}}});
    create(node, &stack).await;
    stack_ready(node, &ns, "hello").await;
    let (uid, readonly, status) = pulumi_container(node, &ns);
    assert_eq!(uid, 1000);
    assert!(readonly, "the root filesystem is read-only");
    assert!(status.split_whitespace().nth(1) == Some("1000"), "{status}");

    // The pod as the apiserver has it.
    let client = node.plane().client();
    let pod = Api::<Pod>::namespaced(client.clone(), &ns)
        .get("hello-workspace-0")
        .await
        .expect("the workspace pod");
    let pod = serde_json::to_value(&pod).expect("json");
    assert_eq!(pod["spec"]["serviceAccountName"], "deployer");
    let containers = pod["spec"]["containers"].as_array().expect("containers");
    let pulumi = containers
        .iter()
        .find(|c| c["name"] == "pulumi")
        .expect("the pulumi container");
    assert_eq!(pulumi["resources"], resources);
    assert_eq!(pulumi["imagePullPolicy"], "IfNotPresent");
    // As the kubelet ran it.
    let (memory, shares, quota, subject) = pulumi_container_as_run(node, &ns);
    assert_eq!(memory, 1 << 30, "the memory limit");
    // 150m: 150 * 1024 / 1000 shares; 2 CPUs: twice the default 100ms period.
    assert_eq!(shares, 153, "the CPU request's shares");
    assert_eq!(quota, 200_000, "the CPU limit's quota");
    assert_eq!(subject, format!("system:serviceaccount:{ns}:deployer"));
    // `IfNotPresent`: the fetch container pulled the image, the pulumi container finds it
    // there (with `Always`, the default for this `:latest` image, it is pulled again).
    let events: Api<k8s_openapi::api::core::v1::Event> = Api::namespaced(client, &ns);
    let pulled = wait_for("the pulumi container's Pulled event", POD_TIMEOUT, || {
        let events = events.clone();
        async move {
            events
                .list(
                    &kube::api::ListParams::default()
                        .fields("involvedObject.name=hello-workspace-0,reason=Pulled"),
                )
                .await
                .ok()?
                .items
                .into_iter()
                .find(|e| {
                    e.involved_object.field_path.as_deref() == Some("spec.containers{pulumi}")
                })
                .and_then(|e| e.message)
        }
    })
    .await
    .expect("a Pulled event");
    assert!(pulled.ends_with("already present on machine"), "{pulled}");
}

async fn namespace_gone(node: &Node, ns: &str) {
    let namespaces: Api<k8s_openapi::api::core::v1::Namespace> = Api::all(node.plane().client());
    wait_for(&format!("namespace {ns} gone"), STACK_TIMEOUT, || {
        let namespaces = namespaces.clone();
        async move {
            match namespaces.get_opt(ns).await {
                Ok(None) => Some(()),
                _ => None,
            }
        }
    })
    .await
    .unwrap_or_else(|e| {
        panic!(
            "{e}\nkube-controller-manager:\n{}",
            node.log_tail("kube-controller-manager")
        )
    });
}

/// A namespace holding a Ready `destroyOnFinalize` Stack whose program made a ConfigMap in
/// another namespace.
async fn doomed_stack(node: &Node, installed: &Installed, prefix: &str) -> (String, String) {
    let ns = node.plane().namespace(prefix).await.expect("namespace");
    let keep = node
        .plane()
        .namespace(&format!("{prefix}-keep"))
        .await
        .expect("namespace");
    create(node, &json!({
        "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding",
        "metadata": {"name": "workspace-edit", "namespace": keep},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": "edit"},
        "subjects": [{"kind": "ServiceAccount", "name": "default", "namespace": ns}]
    }))
    .await;
    create(
        node,
        &json!({
            "apiVersion": "pulumi.com/v1", "kind": "Program",
            "metadata": {"name": "hello", "namespace": ns},
            "program": {"resources": {"cm": {"type": "kubernetes:core/v1:ConfigMap", "properties": {
                "metadata": {"name": "doomed", "namespace": keep}, "data": {"a": "b"}}}}}
        }),
    )
    .await;
    let mut stack = example("stack.yaml", &ns);
    stack["spec"]["backend"] = json!("file:///share");
    stack["spec"]["workspaceTemplate"] = json!({"spec": {"image": installed.workspace_image}});
    create(node, &stack).await;
    stack_ready(node, &ns, "hello").await;
    let cms: Api<k8s_openapi::api::core::v1::ConfigMap> =
        Api::namespaced(node.plane().client(), &keep);
    assert!(cms.get_opt("doomed").await.expect("get").is_some());
    (ns, keep)
}

/// Deleting a namespace that holds a `destroyOnFinalize` Stack, with the operator running:
/// the webhook refuses the DELETE (a terminating namespace could run no destroy) and prints
/// the command to run first; run as printed, it destroys the stack's resources, and the
/// namespace deletion then passes and the namespace is gone.
#[tokio::test]
async fn a_namespace_holding_a_stack_to_destroy_goes_after_the_printed_command() {
    let _machine = serial::shared().await;
    let _node = NODE_LOCK.lock().await;
    let node = node().await;
    let installed = installed(node).await;
    let (ns, keep) = doomed_stack(node, installed, "e2e-nsdel").await;
    let namespaces: Api<k8s_openapi::api::core::v1::Namespace> = Api::all(node.plane().client());
    let refused = match namespaces
        .delete(&ns, &kube::api::DeleteParams::default())
        .await
    {
        Err(kube::Error::Api(status)) => status.message,
        other => panic!("the namespace deletion was not refused: {other:?}"),
    };
    let command = refused
        .split_once("`kubectl ")
        .and_then(|(_, rest)| rest.split_once('`'))
        .map(|(command, _)| command)
        .unwrap_or_else(|| panic!("no kubectl command in {refused:?}"));
    let mut args: Vec<String> = command.split_whitespace().map(str::to_owned).collect();
    // The printed command waits for the destroy; the test bounds that wait.
    args.push(format!("--timeout={}s", STACK_TIMEOUT.as_secs()));
    let mut kubectl = node.plane().kubectl();
    kubectl.args(&args);
    let out = tokio::task::spawn_blocking(move || kubectl.output())
        .await
        .expect("kubectl thread")
        .expect("kubectl");
    assert!(
        out.status.success(),
        "kubectl {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let cms: Api<k8s_openapi::api::core::v1::ConfigMap> =
        Api::namespaced(node.plane().client(), &keep);
    wait_for("the stack's ConfigMap destroyed", STACK_TIMEOUT, || {
        let cms = cms.clone();
        async move { cms.get_opt("doomed").await.ok()?.is_none().then_some(()) }
    })
    .await
    .expect("the stack's resources destroyed");
    namespaces
        .delete(&ns, &kube::api::DeleteParams::default())
        .await
        .expect("the namespace deletion passes once its stacks are destroyed");
    namespace_gone(node, &ns).await;
}

/// With the operator stopped, a namespace holding a Stack waits on its finalizer; the
/// documented patch (the one the NamespaceTerminating message prints) lets it go.
#[tokio::test]
async fn with_the_operator_stopped_the_documented_patch_lets_a_namespace_go() {
    let _machine = serial::shared().await;
    let _node = NODE_LOCK.lock().await;
    let node = node().await;
    let installed = installed(node).await;
    let deployments: Api<k8s_openapi::api::apps::v1::Deployment> =
        Api::namespaced(node.plane().client(), RELEASE_NAMESPACE);
    let scale = |replicas: i32| {
        let deployments = deployments.clone();
        async move {
            deployments
                .patch(
                    "pko-rs-operator",
                    &kube::api::PatchParams::default(),
                    &kube::api::Patch::Merge(json!({"spec": {"replicas": replicas}})),
                )
                .await
                .expect("scale the operator");
        }
    };
    let (ns, _keep) = {
        // Made with the operator running, then the operator is stopped before the delete.
        let ns = node
            .plane()
            .namespace("e2e-nsstop")
            .await
            .expect("namespace");
        create(node, &example("program.yaml", &ns)).await;
        let mut stack = example("stack.yaml", &ns);
        stack["spec"]["backend"] = json!("file:///share");
        stack["spec"]["workspaceTemplate"] = json!({"spec": {"image": installed.workspace_image}});
        create(node, &stack).await;
        stack_ready(node, &ns, "hello").await;
        (ns, ())
    };
    scale(0).await;
    // Gone, not only terminating: a pod in its grace period still reconciles (and would put
    // the finalizer back on a Stack not yet deleted).
    let pods: Api<Pod> = Api::namespaced(node.plane().client(), RELEASE_NAMESPACE);
    wait_for("the operator's pods gone", STACK_TIMEOUT, || {
        let pods = pods.clone();
        async move {
            let params =
                kube::api::ListParams::default().labels("app.kubernetes.io/name=pko-rs-operator");
            pods.list(&params)
                .await
                .ok()?
                .items
                .is_empty()
                .then_some(())
        }
    })
    .await
    .expect("operator stopped");
    let namespaces: Api<k8s_openapi::api::core::v1::Namespace> = Api::all(node.plane().client());
    namespaces
        .delete(&ns, &kube::api::DeleteParams::default())
        .await
        .expect("delete the namespace");
    // A person patches the Stack they see Terminating: the namespace controller deletes it.
    let stacks: Api<pko_api::stack::Stack> = Api::namespaced(node.plane().client(), &ns);
    wait_for(
        "the Stack deleted by the namespace controller",
        STACK_TIMEOUT,
        || {
            let stacks = stacks.clone();
            async move {
                let stack = stacks.get_opt("hello").await.ok()??;
                stack.metadata.deletion_timestamp.map(|_| ())
            }
        },
    )
    .await
    .expect("the Stack terminating");
    // The documented patch, as a person runs it.
    let out = node
        .plane()
        .kubectl()
        .args(["patch", "stack", "hello", "-n", &ns, "--type=merge", "-p"])
        .arg(r#"{"metadata":{"finalizers":null}}"#)
        .output()
        .expect("kubectl");
    let patched = out.status.success();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    scale(2).await;
    assert!(patched, "kubectl patch: {text}");
    namespace_gone(node, &ns).await;
    wait_for("the operator back", STACK_TIMEOUT, || async {
        (operator_pods(node).await.len() == 2).then_some(())
    })
    .await
    .expect("operator back");
}

/// The workspace pod's IP in `ns` (one workspace there).
async fn workspace_pod_ip(node: &Node, ns: &str) -> String {
    let pods: Api<Pod> = Api::namespaced(node.plane().client(), ns);
    let list = pods
        .list(&kube::api::ListParams::default().labels("auto.pulumi.com/component=workspace"))
        .await
        .expect("workspace pods");
    list.items
        .into_iter()
        .find_map(|p| p.status?.pod_ip)
        .unwrap_or_else(|| panic!("a workspace pod with an IP in {ns}"))
}

/// Waits until a connection from pod `ns/pod` to `target` is accepted (`open`) or refused.
async fn wait_reachable(
    node: &Node,
    ns: &str,
    pod: &str,
    target: std::net::SocketAddr,
    open: bool,
) {
    let what = if open { "reaches" } else { "is refused" };
    wait_for(
        &format!("{ns}/{pod} {what} {target}"),
        POD_TIMEOUT,
        || async move {
            let connects = node.connects_from_pod(ns, pod, target).expect("probe");
            (connects == open).then_some(())
        },
    )
    .await
    .unwrap_or_else(|e| panic!("{e}\nkube-router:\n{}", node.log_tail("kube-router")));
}

/// The NetworkPolicies `deploy/` ships, enforced by the node (kube-router), and the artifact
/// tokens, keep tenants apart:
/// - a pod in another namespace reaches a workspace's agent port until the namespace gets
///   `deploy/examples/workspace_network_policy.yaml`, then no longer, while the operator still
///   does (an edit of the Program is deployed through the policy);
/// - the chart's policy admits workspace pods to the file server and nobody else (an unlabelled
///   pod is refused on that port while it reaches the probes port of the same pod);
/// - a workspace-labelled pod of tenant B gets B's artifact through the Service and is refused
///   A's, with B's token on A's path and with none.
#[tokio::test]
async fn network_policies_and_tokens_keep_tenants_apart() {
    let _machine = serial::shared().await;
    let _node = NODE_LOCK.lock().await;
    let node = node().await;
    let installed = installed(node).await;
    let a = node
        .plane()
        .namespace("e2e-tenant-a")
        .await
        .expect("namespace");
    let b = node
        .plane()
        .namespace("e2e-tenant-b")
        .await
        .expect("namespace");
    create(node, &example("program.yaml", &a)).await;
    create(node, &example("program.yaml", &b)).await;
    let mut stack = example("stack.yaml", &a);
    stack["spec"]["backend"] = json!("file:///share");
    stack["spec"]["workspaceTemplate"] = json!({"spec": {"image": installed.workspace_image}});
    create(node, &stack).await;
    let url_a = path_of(&artifact_url(node, &a, "hello", 1).await);
    let url_b = path_of(&artifact_url(node, &b, "hello", 1).await);
    idle_pod(
        node,
        &b,
        "workspace-like",
        json!({"auto.pulumi.com/component": "workspace"}),
    )
    .await;
    idle_pod(node, &b, "stranger", json!({})).await;
    stack_ready(node, &a, "hello").await;

    // The agent port: open without a policy, closed with the shipped one, to everyone but the
    // operator.
    let agent =
        std::net::SocketAddr::new(workspace_pod_ip(node, &a).await.parse().expect("ip"), 50051);
    wait_reachable(node, &b, "stranger", agent, true).await;
    let mut policy: serde_json::Value = yaml_serde::from_str(
        &std::fs::read_to_string(
            pko_tests::repo_root().join("deploy/examples/workspace_network_policy.yaml"),
        )
        .expect("the example policy"),
    )
    .expect("policy YAML");
    policy["metadata"]["namespace"] = json!(a);
    create(node, &policy).await;
    wait_reachable(node, &b, "stranger", agent, false).await;
    wait_reachable(node, &b, "workspace-like", agent, false).await;
    let programs: Api<pko_api::program::Program> = Api::namespaced(node.plane().client(), &a);
    programs
        .patch(
            "hello",
            &kube::api::PatchParams::default(),
            &kube::api::Patch::Merge(json!({"program": {"outputs": {"policy": "applied"}}})),
        )
        .await
        .expect("edit the Program");
    let stacks: Api<pko_api::stack::Stack> = Api::namespaced(node.plane().client(), &a);
    wait_for(
        "the edit deployed through the policy",
        STACK_TIMEOUT,
        || {
            let stacks = stacks.clone();
            async move {
                let stack = stacks.get("hello").await.ok()?;
                let status = serde_json::to_value(stack.status?).ok()?;
                (status["outputs"]["policy"] == json!("applied")).then_some(())
            }
        },
    )
    .await
    .unwrap_or_else(|e| panic!("{e}\noperator pods: {:?}", node.crictl(["ps", "-a"])));

    // The file server port: workspace pods only; the probes port of the same pod: anyone.
    let (_, operator_ip) = operator_pods(node)
        .await
        .into_iter()
        .next()
        .expect("an operator pod");
    let operator_ip: std::net::IpAddr = operator_ip.parse().expect("ip");
    let probes = std::net::SocketAddr::new(operator_ip, 8081);
    let file_port = std::net::SocketAddr::new(operator_ip, 9090);
    wait_reachable(node, &b, "stranger", probes, true).await;
    wait_reachable(node, &b, "stranger", file_port, false).await;
    wait_reachable(node, &b, "workspace-like", file_port, true).await;

    // Through the Service, from the workspace-labelled pod: B's own artifact, not A's.
    let services: Api<k8s_openapi::api::core::v1::Service> =
        Api::namespaced(node.plane().client(), RELEASE_NAMESPACE);
    let ip = services
        .get("pko-rs-fileserver")
        .await
        .expect("file server Service")
        .spec
        .and_then(|s| s.cluster_ip)
        .expect("cluster IP");
    let server = std::net::SocketAddr::new(ip.parse().expect("ip"), 80);
    let own = node
        .http_from_pod(&b, "workspace-like", server, &url_b)
        .expect("probe");
    assert!(own.contains(" 200"), "B's own artifact: {own:?}");
    let b_token = url_b.split_once('?').map(|(_, q)| q).unwrap_or_default();
    let a_path = url_a.split_once('?').map_or(url_a.as_str(), |(p, _)| p);
    for path in [format!("{a_path}?{b_token}"), a_path.to_owned()] {
        let answer = node
            .http_from_pod(&b, "workspace-like", server, &path)
            .expect("probe");
        assert!(answer.contains(" 404"), "{path}: {answer:?}");
    }
    assert!(
        node.http_from_pod(&b, "stranger", server, &url_b)
            .expect("probe")
            .is_empty(),
        "the file server's Service answers an unlabelled pod"
    );
}
