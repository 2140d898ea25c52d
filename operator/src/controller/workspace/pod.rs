//! The objects a Workspace becomes: a headless Service and a one-replica StatefulSet running
//! the agent, named and labelled as PKO's.

use std::collections::BTreeMap;

use k8s_openapi::api::apps::v1::{StatefulSet, StatefulSetSpec, StatefulSetUpdateStrategy};
use k8s_openapi::api::core::v1::{
    Capabilities, Container, ContainerPort, EmptyDirVolumeSource, EnvVar, EnvVarSource,
    ObjectFieldSelector, PodSecurityContext, PodSpec, PodTemplateSpec, Probe,
    ResourceFieldSelector, SeccompProfile, SecretKeySelector, SecretVolumeSource, SecurityContext,
    Service, ServicePort, ServiceSpec, TCPSocketAction, Volume, VolumeMount,
};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{LabelSelector, ObjectMeta, OwnerReference};
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use pko_api::names::is_dns1123_label;
use pko_api::workspace::{SecurityProfile, Workspace, WorkspaceSpec};
use sha2::{Digest, Sha256};

use super::{merge, restricted};
use crate::controller::keys::{
    ENV_IN_POD_ANNOTATION, REVISION_HASH_ANNOTATION, TEMPLATE_SHAPE_ANNOTATION,
    WORKSPACE_COMPONENT_LABEL, WORKSPACE_NAME_LABEL,
};

pub const AGENT_PORT: u16 = pko_agent_api::DEFAULT_PORT;
const SHARE: &str = "/share";
/// Where the fetch container unpacks a fetched source (the project link points into it).
const SOURCE_DIR: &str = "/share/source";
const CREDENTIALS_DIR: &str = "/var/run/pko-agent";
/// Where the agent binary sits in the agent (operator) image.
pub const AGENT_IN_IMAGE: &str = "/usr/local/bin/pko-agent";
const AGENT_IN_SHARE: &str = "/share/pko-agent";
/// PKO's layout: where its bootstrap copies the agent and tini.
const PKO_AGENT_IN_SHARE: &str = "/share/agent";
const PKO_TINI_IN_SHARE: &str = "/share/tini";
const RESTRICTED_UID: i64 = 1000;

/// `<workspace>-workspace`: the StatefulSet, its Service and its pod's name prefix (PKO's).
pub fn workload_name(workspace: &str) -> String {
    format!("{workspace}-workspace")
}

/// The Secret holding the agent's bearer token and TLS key pair.
pub fn credentials_name(workspace: &str) -> String {
    format!("{workspace}-workspace-auth")
}

/// The name the agent's certificate is issued for (and the client checks).
pub fn server_name(workspace: &str, namespace: &str) -> String {
    format!("{}.{namespace}", workload_name(workspace))
}

/// Longest volume name (a DNS-1123 label).
const VOLUME_NAME_MAX: usize = 63;

/// The name of a volume made for object `name` (a Secret, a ConfigMap): `<prefix>-<name>` as
/// PKO names it when that is a valid volume name (a DNS-1123 label). Otherwise (a dot, too long)
/// every other character becomes `-`, the result is cut to fit, and the first 8 hex digits of
/// the SHA-256 of `name` are appended, so two names that read alike stay apart.
pub fn volume_name(prefix: &str, name: &str) -> String {
    let plain = format!("{prefix}-{name}");
    if is_dns1123_label(&plain) {
        return plain;
    }
    let hash = &hex::encode(Sha256::digest(name.as_bytes()))[..8];
    let sanitized: String = plain
        .chars()
        .map(|c| match c.to_ascii_lowercase() {
            c @ ('a'..='z' | '0'..='9') => c,
            _ => '-',
        })
        .take(VOLUME_NAME_MAX - hash.len() - 1)
        .collect();
    let sanitized = sanitized.trim_matches('-');
    if sanitized.is_empty() {
        format!("v-{hash}")
    } else {
        format!("{sanitized}-{hash}")
    }
}

/// Labels of every object of one workspace (also the Service's selector).
pub fn labels(workspace: &str) -> BTreeMap<String, String> {
    BTreeMap::from([
        (WORKSPACE_COMPONENT_LABEL.to_owned(), "workspace".to_owned()),
        (WORKSPACE_NAME_LABEL.to_owned(), workspace.to_owned()),
    ])
}

/// Operator-wide pod settings.
#[derive(Clone, Debug)]
pub struct PodSettings {
    /// Image holding the agent at [`AGENT_IN_IMAGE`] (the operator's own).
    pub agent_image: String,
    pub agent_image_pull_policy: String,
    /// Image holding `/agent` and `/tini` (and `sh`, `cp`, `ln`), for workspaces under PKO's
    /// contract: PKO's image, or pko-rs's agent image.
    pub pko_agent_image: String,
    /// `FLUX_MAX_UNTAR_SIZE_BYTES` passed to the fetch container, if set.
    pub max_artifact_bytes: Option<String>,
    /// Let git fetches trust an SSH host key seen first when the Secret has no `knownHosts`.
    pub git_ssh_accept_new_host_keys: bool,
    /// Where workspace pods exchange GitHub App credentials for installation tokens.
    pub github_api_url: String,
    /// The names of the operator's file server: a flux URL on it must name a Program of the
    /// Workspace's own namespace (the admission rule, applied again here).
    pub file_server: pko_admission::tenancy::FileServerNames,
}

/// How the workspace's agent is laid out in its pod (which contract: `compat.rs`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum AgentLayout {
    /// pko-rs's, with the fingerprint of the workspace's credentials (a re-mint rolls the pod).
    Pinned { credentials_fingerprint: String },
    /// PKO's; `env_in_pod`: `spec.env` goes on the container (the agent cannot take it over
    /// RPC).
    Pko { env_in_pod: bool },
}

impl AgentLayout {
    pub fn pinned(credentials_fingerprint: &str) -> Self {
        Self::Pinned {
            credentials_fingerprint: credentials_fingerprint.to_owned(),
        }
    }
}

/// A pod template that the restricted profile forbids.
#[derive(Debug, thiserror::Error)]
pub enum PodError {
    #[error("the pod template breaks the restricted security profile: {0}")]
    Restricted(String),
    #[error(
        "spec.flux.url points at a Program of namespace {target}; only Programs of namespace {own} may be used"
    )]
    CrossNamespaceProgram { target: String, own: String },
    #[error("spec.flux.url is not a URL the workspace can fetch: {0}")]
    InvalidFluxUrl(String),
    #[error("cannot encode the pod template: {0}")]
    Encode(#[from] serde_json::Error),
    #[error("the Workspace has no uid to own its Service and StatefulSet")]
    NoUid,
}

/// The reference that makes the Workspace the controller of its Service and StatefulSet.
pub fn controller_owner(ws: &Workspace) -> Result<OwnerReference, PodError> {
    crate::controller::kit::controller_owner(ws).ok_or(PodError::NoUid)
}

/// A flux URL on the operator's file server names a Program of the Workspace's namespace, read
/// as the fetcher reads it (defence in depth: admission refuses the others first).
fn check_flux_url(
    url: Option<&str>,
    namespace: &str,
    settings: &PodSettings,
) -> Result<(), PodError> {
    let Some(url) = url.filter(|u| !u.is_empty()) else {
        return Ok(());
    };
    let target = pko_admission::urls::parse_fetch_url(url).map_err(PodError::InvalidFluxUrl)?;
    match target.program_namespace(&settings.file_server) {
        Some(target) if target != namespace => Err(PodError::CrossNamespaceProgram {
            target: target.to_owned(),
            own: namespace.to_owned(),
        }),
        _ => Ok(()),
    }
}

/// PKO's in-memory defaults (PKO applies them on every reconcile too).
pub fn default_image(profile: SecurityProfile) -> &'static str {
    match profile {
        SecurityProfile::Baseline => "pulumi/pulumi:latest",
        SecurityProfile::Restricted => "pulumi/pulumi:latest-nonroot",
    }
}

pub fn desired_service(
    ws: &Workspace,
    name: &str,
    namespace: &str,
    owner: &OwnerReference,
) -> Service {
    let system = labels(name);
    let template = ws
        .spec
        .service_template
        .as_ref()
        .and_then(|t| t.metadata.as_ref());
    let mut all_labels: BTreeMap<String, String> =
        template.map(|m| m.labels.clone()).unwrap_or_default();
    // System labels win: the selector must keep matching.
    all_labels.extend(system.clone());
    let annotations = template
        .map(|m| &m.annotations)
        .filter(|a| !a.is_empty())
        .cloned();
    Service {
        metadata: ObjectMeta {
            name: Some(workload_name(name)),
            namespace: Some(namespace.to_owned()),
            labels: Some(all_labels),
            annotations,
            owner_references: Some(vec![owner.clone()]),
            ..ObjectMeta::default()
        },
        spec: Some(ServiceSpec {
            cluster_ip: Some("None".into()),
            selector: Some(system),
            ports: Some(vec![ServicePort {
                name: Some("grpc".into()),
                port: i32::from(AGENT_PORT),
                target_port: Some(IntOrString::String("grpc".into())),
                protocol: Some("TCP".into()),
                ..ServicePort::default()
            }]),
            ..ServiceSpec::default()
        }),
        status: None,
    }
}

/// Key, in the Secret holding a Workspace's SSH key, of the git server's known_hosts lines.
pub const KNOWN_HOSTS_KEY: &str = "knownHosts";

fn env(name: &str, value: &str) -> EnvVar {
    EnvVar {
        name: name.to_owned(),
        value: Some(value.to_owned()),
        value_from: None,
    }
}

fn secret_env(name: &str, selector: &SecretKeySelector) -> EnvVar {
    EnvVar {
        name: name.to_owned(),
        value: None,
        value_from: Some(EnvVarSource {
            secret_key_ref: Some(selector.clone()),
            ..EnvVarSource::default()
        }),
    }
}

/// A variable the kubelet fills from a field of the pod.
fn field_env(name: &str, field_path: &str) -> EnvVar {
    EnvVar {
        name: name.to_owned(),
        value: None,
        value_from: Some(EnvVarSource {
            field_ref: Some(ObjectFieldSelector {
                field_path: field_path.to_owned(),
                api_version: None,
            }),
            ..EnvVarSource::default()
        }),
    }
}

/// Which source a Workspace has (git > flux > local > project info, as PKO).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum SourceKind {
    Git,
    Flux,
    Local,
    ProjectInfo,
}

/// The fetch init container's env for the Workspace's source; `None` when it has no source.
fn fetch_env(ws: &Workspace, settings: &PodSettings) -> Option<(SourceKind, Vec<EnvVar>)> {
    let spec = &ws.spec;
    if let Some(git) = &spec.git {
        let mut e = vec![
            env("GIT_URL", git.url.as_deref().unwrap_or_default()),
            env("GIT_REVISION", git.ref_.as_deref().unwrap_or_default()),
            env("GIT_DIR", git.dir.as_deref().unwrap_or_default()),
        ];
        if git.shallow == Some(true) {
            e.push(env("GIT_SHALLOW", "true"));
        }
        if settings.git_ssh_accept_new_host_keys {
            e.push(env("GIT_SSH_ACCEPT_NEW_HOST_KEYS", "true"));
        }
        if let Some(auth) = &git.auth {
            let refs = [
                ("GIT_SSH_PRIVATE_KEY", &auth.ssh_private_key),
                ("GIT_USERNAME", &auth.username),
                ("GIT_PASSWORD", &auth.password),
                ("GIT_TOKEN", &auth.token),
            ];
            for (name, sel) in refs {
                if let Some(sel) = sel {
                    e.push(secret_env(name, sel));
                }
            }
            // The server's host keys travel with the key that logs in to it: an optional
            // `knownHosts` key of the same Secret.
            if let Some(key) = &auth.ssh_private_key {
                e.push(secret_env(
                    "GIT_SSH_KNOWN_HOSTS",
                    &SecretKeySelector {
                        name: key.name.clone(),
                        key: KNOWN_HOSTS_KEY.to_owned(),
                        optional: Some(true),
                    },
                ));
            }
            if let Some(app) = &auth.github_app {
                e.push(secret_env("GIT_GITHUB_APP_ID", &app.app_id));
                e.push(secret_env(
                    "GIT_GITHUB_APP_INSTALLATION_ID",
                    &app.installation_id,
                ));
                e.push(secret_env("GIT_GITHUB_APP_PRIVATE_KEY", &app.private_key));
                e.push(env("GIT_GITHUB_API_URL", &settings.github_api_url));
            }
        }
        return Some((SourceKind::Git, e));
    }
    if let Some(flux) = &spec.flux {
        let mut e = vec![
            env("FLUX_URL", flux.url.as_deref().unwrap_or_default()),
            env("FLUX_DIGEST", flux.digest.as_deref().unwrap_or_default()),
            env("FLUX_DIR", flux.dir.as_deref().unwrap_or_default()),
        ];
        if let Some(max) = &settings.max_artifact_bytes {
            e.push(env("FLUX_MAX_UNTAR_SIZE_BYTES", max));
        }
        return Some((SourceKind::Flux, e));
    }
    if let Some(local) = &spec.local {
        let e = vec![env("LOCAL_DIR", local.dir.as_deref().unwrap_or_default())];
        return Some((SourceKind::Local, e));
    }
    if let Some(info) = &spec.project_info {
        let e = vec![
            env("PROJECT_NAME", &info.name),
            env("PROJECT_RUNTIME", &info.runtime),
        ];
        return Some((SourceKind::ProjectInfo, e));
    }
    None
}

/// `pko-agent`'s arguments for the fetch container (no shell needed in the image: the agent
/// makes the project link itself).
fn fetch_args(kind: SourceKind) -> Vec<String> {
    let link = format!("--link={SHARE}/workspace");
    let strings = |list: &[&str]| list.iter().map(|s| (*s).to_owned()).collect::<Vec<_>>();
    match kind {
        SourceKind::Git => {
            let mut args = strings(&[
                "init",
                "--git-url=$(GIT_URL)",
                "--git-revision=$(GIT_REVISION)",
                "--dir=$(GIT_DIR)",
            ]);
            args.insert(1, format!("--target-dir={SOURCE_DIR}"));
            args.push(link);
            args
        }
        SourceKind::Flux => {
            let mut args = strings(&[
                "init",
                "--flux-url=$(FLUX_URL)",
                "--flux-digest=$(FLUX_DIGEST)",
                "--dir=$(FLUX_DIR)",
            ]);
            args.insert(1, format!("--target-dir={SOURCE_DIR}"));
            args.push(link);
            args
        }
        SourceKind::Local => vec!["init".into(), "--local-dir=$(LOCAL_DIR)".into(), link],
        SourceKind::ProjectInfo => vec![
            "init".into(),
            format!("--target-dir={SHARE}/workspace"),
            "--project-name=$(PROJECT_NAME)".into(),
            "--project-runtime=$(PROJECT_RUNTIME)".into(),
        ],
    }
}

/// PKO's fetch script (run by `sh -c` in the agent image); the values come from the env, each
/// quoted, so none is read as shell syntax.
fn pko_fetch_script(kind: SourceKind) -> &'static str {
    match kind {
        SourceKind::Git => {
            "/share/agent init -t /share/source --git-url \"$GIT_URL\" --git-revision \"$GIT_REVISION\" &&\nln -s \"/share/source/$GIT_DIR\" /share/workspace"
        }
        SourceKind::Flux => {
            "/share/agent init -t /share/source --flux-url \"$FLUX_URL\" --flux-digest \"$FLUX_DIGEST\" &&\nln -s \"/share/source/$FLUX_DIR\" /share/workspace"
        }
        SourceKind::Local => "ln -s \"$LOCAL_DIR\" /share/workspace",
        SourceKind::ProjectInfo => {
            "/share/agent init -t /share/workspace --project-name \"$PROJECT_NAME\" --project-runtime \"$PROJECT_RUNTIME\""
        }
    }
}

/// The StatefulSet of a Workspace, with its agent laid out as `layout` says (pko-rs's layout
/// carries the credentials' fingerprint, which changes when they are re-minted, so the pod
/// restarts with the new ones).
pub fn desired_statefulset(
    ws: &Workspace,
    name: &str,
    namespace: &str,
    owner: &OwnerReference,
    settings: &PodSettings,
    layout: &AgentLayout,
) -> Result<StatefulSet, PodError> {
    let spec = &ws.spec;
    check_flux_url(
        spec.flux.as_ref().and_then(|f| f.url.as_deref()),
        namespace,
        settings,
    )?;
    let profile = spec.security_profile.unwrap_or_default();
    let restricted = profile == SecurityProfile::Restricted;
    let base = base_template(ws, name, namespace, settings, profile, layout);
    let mut template = overlay_template(&base, spec, name)?;
    if restricted {
        // The final pod gets the defaults the webhook would have stored and meets every rule
        // it enforces, webhook or not: a pod template cannot make a restricted workspace root.
        let mut merged = serde_json::to_value(&template)?;
        if let Some(pod) = merged.get_mut("spec") {
            restricted::apply_defaults(pod);
            let broken = restricted::violations(pod, "spec");
            if !broken.is_empty() {
                let list: Vec<String> = broken.iter().map(ToString::to_string).collect();
                return Err(PodError::Restricted(list.join("; ")));
            }
        }
        template = serde_json::from_value(merged)?;
    }
    let hash = template_hash(&template, layout)?;
    let mut annotations = BTreeMap::from([(REVISION_HASH_ANNOTATION.to_owned(), hash)]);
    // pko-rs's agent takes a new revision of a Flux-style source in place (`UpdateSource`): the
    // operator replaces the pod itself (`OnDelete`) only when more than that changed.
    let in_place = matches!(layout, AgentLayout::Pinned { .. })
        && source_kind(ws, settings) == Some(SourceKind::Flux);
    if in_place {
        let shape = template_hash(&without_revision(&template), layout)?;
        annotations.insert(TEMPLATE_SHAPE_ANNOTATION.to_owned(), shape);
    }
    if *layout == (AgentLayout::Pko { env_in_pod: true }) {
        annotations.insert(
            ENV_IN_POD_ANNOTATION.to_owned(),
            settings.pko_agent_image.clone(),
        );
    }
    template.metadata.get_or_insert_default().annotations = Some(annotations);

    Ok(StatefulSet {
        metadata: ObjectMeta {
            name: Some(workload_name(name)),
            namespace: Some(namespace.to_owned()),
            labels: Some(labels(name)),
            owner_references: Some(vec![owner.clone()]),
            ..ObjectMeta::default()
        },
        spec: Some(StatefulSetSpec {
            replicas: Some(1),
            pod_management_policy: Some("Parallel".into()),
            service_name: Some(workload_name(name)),
            selector: LabelSelector {
                match_labels: Some(labels(name)),
                match_expressions: None,
            },
            template,
            update_strategy: matches!(layout, AgentLayout::Pinned { .. }).then(|| {
                StatefulSetUpdateStrategy {
                    type_: Some(ON_DELETE.into()),
                    rolling_update: None,
                }
            }),
            ..StatefulSetSpec::default()
        }),
        status: None,
    })
}

/// The update strategy of pko-rs's workspaces: the operator decides when the pod goes (see
/// `rules::rollout`).
pub const ON_DELETE: &str = "OnDelete";

/// A SHA-256 of the typed template as serde_json writes it: fields in the structs' order, maps
/// sorted by key, so the same Workspace hashes alike in any process, and the hash moves exactly
/// when what the pod runs moves (or the credentials do).
fn template_hash(template: &PodTemplateSpec, layout: &AgentLayout) -> Result<String, PodError> {
    let mut h = Sha256::new();
    h.update(serde_json::to_vec(template)?);
    if let AgentLayout::Pinned {
        credentials_fingerprint,
    } = layout
    {
        h.update(credentials_fingerprint.as_bytes());
    }
    Ok(hex::encode(h.finalize())[..16].to_owned())
}

/// `template` without the source revision: the fetch container's `FLUX_URL` and `FLUX_DIGEST`
/// emptied (a new Program generation changes both, and nothing else).
fn without_revision(template: &PodTemplateSpec) -> PodTemplateSpec {
    let mut t = template.clone();
    let fetch = t
        .spec
        .iter_mut()
        .flat_map(|s| s.init_containers.iter_mut().flatten())
        .filter(|c| c.name == "fetch");
    for container in fetch {
        for var in container.env.iter_mut().flatten() {
            if var.name == "FLUX_URL" || var.name == "FLUX_DIGEST" {
                var.value = None;
            }
        }
    }
    t
}

/// Which kind of source the Workspace's pod fetches.
fn source_kind(ws: &Workspace, settings: &PodSettings) -> Option<SourceKind> {
    fetch_env(ws, settings).map(|(kind, _)| kind)
}

/// The pod template the operator generates, before the Workspace's own template.
fn base_template(
    ws: &Workspace,
    name: &str,
    namespace: &str,
    settings: &PodSettings,
    profile: SecurityProfile,
    layout: &AgentLayout,
) -> PodTemplateSpec {
    let spec = &ws.spec;
    let image = spec
        .image
        .clone()
        .filter(|i| !i.is_empty())
        .unwrap_or_else(|| default_image(profile).to_owned());
    let (container_security, pod_security) =
        security_contexts(profile == SecurityProfile::Restricted);
    let parts = Parts {
        ws,
        settings,
        image: &image,
        share_mount: VolumeMount {
            name: "share".into(),
            mount_path: SHARE.into(),
            ..VolumeMount::default()
        },
        security: container_security,
    };
    let (init_containers, pulumi) = match layout {
        AgentLayout::Pinned { .. } => (init_containers(&parts), pulumi_container(&parts)),
        AgentLayout::Pko { env_in_pod } => (
            pko_init_containers(&parts),
            pko_pulumi_container(&parts, name, namespace, *env_in_pod),
        ),
    };
    let service_account = spec
        .service_account_name
        .as_deref()
        .filter(|s| !s.is_empty())
        .unwrap_or(pko_api::workspace::DEFAULT_SERVICE_ACCOUNT_NAME);
    let mut volumes = vec![Volume {
        name: "share".into(),
        empty_dir: Some(EmptyDirVolumeSource::default()),
        ..Volume::default()
    }];
    if let AgentLayout::Pinned { .. } = layout {
        volumes.push(Volume {
            name: "agent-credentials".into(),
            secret: Some(SecretVolumeSource {
                secret_name: Some(credentials_name(name)),
                default_mode: Some(0o440),
                ..SecretVolumeSource::default()
            }),
            ..Volume::default()
        });
    }
    PodTemplateSpec {
        metadata: Some(ObjectMeta {
            labels: Some(labels(name)),
            ..ObjectMeta::default()
        }),
        spec: Some(PodSpec {
            service_account_name: Some(service_account.to_owned()),
            security_context: Some(pod_security),
            termination_grace_period_seconds: Some(600),
            init_containers: Some(init_containers),
            containers: vec![pulumi],
            volumes: Some(volumes),
            ..PodSpec::default()
        }),
    }
}

/// What every container of the generated pod is made from.
struct Parts<'a> {
    ws: &'a Workspace,
    settings: &'a PodSettings,
    /// The workspace image (the `pulumi` container's).
    image: &'a str,
    share_mount: VolumeMount,
    security: SecurityContext,
}

fn runtime_default_seccomp() -> Option<SeccompProfile> {
    Some(SeccompProfile {
        type_: "RuntimeDefault".into(),
        localhost_profile: None,
    })
}

/// The containers' and the pod's security contexts of a workspace pod.
fn security_contexts(restricted: bool) -> (SecurityContext, PodSecurityContext) {
    if !restricted {
        let pod = PodSecurityContext {
            seccomp_profile: runtime_default_seccomp(),
            ..PodSecurityContext::default()
        };
        return (SecurityContext::default(), pod);
    }
    let container = SecurityContext {
        allow_privilege_escalation: Some(false),
        run_as_non_root: Some(true),
        capabilities: Some(Capabilities {
            drop: Some(vec!["ALL".into()]),
            add: None,
        }),
        seccomp_profile: runtime_default_seccomp(),
        ..SecurityContext::default()
    };
    let pod = PodSecurityContext {
        run_as_non_root: Some(true),
        run_as_user: Some(RESTRICTED_UID),
        run_as_group: Some(RESTRICTED_UID),
        // Lets the non-root user read the mounted credentials and write volumes.
        fs_group: Some(RESTRICTED_UID),
        seccomp_profile: runtime_default_seccomp(),
        ..PodSecurityContext::default()
    };
    (container, pod)
}

/// The init containers: the agent copied to the shared volume, then the program fetched (when
/// the workspace has a source).
fn init_containers(parts: &Parts<'_>) -> Vec<Container> {
    let (settings, spec) = (parts.settings, &parts.ws.spec);
    let mut init_containers = vec![Container {
        name: "bootstrap".into(),
        image: Some(settings.agent_image.clone()),
        image_pull_policy: Some(settings.agent_image_pull_policy.clone()),
        command: Some(vec![
            AGENT_IN_IMAGE.into(),
            "install-self".into(),
            AGENT_IN_SHARE.into(),
        ]),
        volume_mounts: Some(vec![parts.share_mount.clone()]),
        security_context: Some(parts.security.clone()),
        ..Container::default()
    }];
    if let Some((kind, fetch_env)) = fetch_env(parts.ws, settings) {
        let mut command = vec![AGENT_IN_SHARE.to_owned()];
        command.extend(fetch_args(kind));
        init_containers.push(Container {
            name: "fetch".into(),
            image: Some(parts.image.to_owned()),
            image_pull_policy: spec.image_pull_policy.clone(),
            command: Some(command),
            env: Some(fetch_env),
            volume_mounts: Some(vec![parts.share_mount.clone()]),
            security_context: Some(parts.security.clone()),
            // The kubelet keeps the end of the log as the termination message: a failed fetch
            // (digest mismatch, …) then explains itself in the pod status.
            termination_message_policy: Some("FallbackToLogsOnError".into()),
            ..Container::default()
        });
    }
    init_containers
}

/// PKO's init containers, from the PKO-contract agent image: `cp /agent /tini /share/`, then the
/// fetch script (`sh -c`), both as `args` of the image (PKO's image and pko-rs's agent image
/// have no entrypoint).
fn pko_init_containers(parts: &Parts<'_>) -> Vec<Container> {
    let settings = parts.settings;
    let from_agent_image = |name: &str, args: Vec<String>| Container {
        name: name.into(),
        image: Some(settings.pko_agent_image.clone()),
        image_pull_policy: Some(settings.agent_image_pull_policy.clone()),
        args: Some(args),
        volume_mounts: Some(vec![parts.share_mount.clone()]),
        security_context: Some(parts.security.clone()),
        ..Container::default()
    };
    let strings = |list: &[&str]| list.iter().map(|s| (*s).to_owned()).collect::<Vec<_>>();
    let mut init_containers = vec![from_agent_image(
        "bootstrap",
        strings(&["cp", "/agent", "/tini", "/share/"]),
    )];
    if let Some((kind, fetch_env)) = fetch_env(parts.ws, settings) {
        let mut fetch = from_agent_image("fetch", strings(&["sh", "-c", pko_fetch_script(kind)]));
        fetch.env = Some(fetch_env);
        fetch.termination_message_policy = Some("FallbackToLogsOnError".into());
        init_containers.push(fetch);
    }
    init_containers
}

/// The container running the agent (and Pulumi).
fn pulumi_container(parts: &Parts<'_>) -> Container {
    let spec = &parts.ws.spec;
    let mut command = vec![
        AGENT_IN_SHARE.to_owned(),
        "serve".into(),
        format!("--workspace={SHARE}/workspace"),
        "--skip-install".into(),
        format!("--env-file={SHARE}/.env"),
        format!("--auth-token-file={CREDENTIALS_DIR}/token"),
        format!("--tls-cert-file={CREDENTIALS_DIR}/tls.crt"),
        format!("--tls-key-file={CREDENTIALS_DIR}/tls.key"),
    ];
    if let Some(level) = spec.pulumi_log_level.filter(|l| *l > 0) {
        command.push(format!("--pulumi-log-level={level}"));
    }
    let mut container = agent_container(parts, command, false);
    // Where a new source revision goes (`UpdateSource`); an env var, not a flag, so an agent
    // that predates it starts all the same (and its pod is replaced instead).
    if source_kind(parts.ws, parts.settings) == Some(SourceKind::Flux) {
        container
            .env
            .get_or_insert_default()
            .push(env("AGENT_SOURCE_DIR", SOURCE_DIR));
    }
    container
        .volume_mounts
        .get_or_insert_default()
        .push(VolumeMount {
            name: "agent-credentials".into(),
            mount_path: CREDENTIALS_DIR.into(),
            read_only: Some(true),
            ..VolumeMount::default()
        });
    container
}

/// PKO's agent container: `tini agent -- serve` with PKO's flags, checking the operator's token
/// with the Kubernetes API for the workspace's audience.
fn pko_pulumi_container(
    parts: &Parts<'_>,
    name: &str,
    namespace: &str,
    env_in_pod: bool,
) -> Container {
    let spec = &parts.ws.spec;
    let mut command: Vec<String> = [
        PKO_TINI_IN_SHARE,
        PKO_AGENT_IN_SHARE,
        "--",
        "serve",
        "--workspace",
        "/share/workspace",
        "--skip-install",
        "--env-file",
        "/share/.env",
        "--auth-mode",
        "kube",
        "--kube-audience",
    ]
    .iter()
    .map(|s| (*s).to_owned())
    .collect();
    command.push(super::compat::audience(name, namespace));
    command.extend([
        "--kube-workspace-namespace".to_owned(),
        namespace.to_owned(),
        "--kube-workspace-name".to_owned(),
        name.to_owned(),
    ]);
    if let Some(level) = spec.pulumi_log_level.filter(|l| *l > 0) {
        command.extend(["--pulumi-log-level".to_owned(), level.to_string()]);
    }
    let mut container = agent_container(parts, command, env_in_pod);
    // PKO's: the agent's own memory limit, from the container's request.
    container.env.get_or_insert_default().push(EnvVar {
        name: "AGENT_MEMLIMIT".into(),
        value: None,
        value_from: Some(EnvVarSource {
            resource_field_ref: Some(ResourceFieldSelector {
                container_name: Some("pulumi".into()),
                resource: "requests.memory".into(),
                divisor: None,
            }),
            ..EnvVarSource::default()
        }),
    });
    container
}

/// What both agent containers share; `all_env`: every variable of `spec.env` goes on the
/// container, not only those the kubelet alone can resolve.
fn agent_container(parts: &Parts<'_>, command: Vec<String>, all_env: bool) -> Container {
    let spec = &parts.ws.spec;
    // The rest of `env` is pushed to the agent (see `env.rs`): changing it restarts nothing.
    let mut pulumi_env: Vec<EnvVar> = spec
        .env
        .iter()
        .filter(|v| all_env || !super::env::is_pushed(v))
        .cloned()
        .collect();
    pulumi_env.push(field_env("POD_NAMESPACE", "metadata.namespace"));
    pulumi_env.push(field_env("POD_SA_NAME", "spec.serviceAccountName"));
    let mut resources = spec.resources.clone().unwrap_or_default();
    if resources.requests.as_ref().is_none_or(BTreeMap::is_empty) {
        resources.requests = Some(BTreeMap::from([
            ("cpu".to_owned(), Quantity("100m".into())),
            ("memory".to_owned(), Quantity("64Mi".into())),
        ]));
    }
    Container {
        name: "pulumi".into(),
        image: Some(parts.image.to_owned()),
        image_pull_policy: spec.image_pull_policy.clone(),
        command: Some(command),
        working_dir: Some(format!("{SHARE}/workspace")),
        ports: Some(vec![ContainerPort {
            name: Some("grpc".into()),
            container_port: i32::from(AGENT_PORT),
            protocol: Some("TCP".into()),
            ..ContainerPort::default()
        }]),
        env: Some(pulumi_env),
        env_from: Some(spec.env_from.clone()).filter(|e| !e.is_empty()),
        resources: Some(resources),
        volume_mounts: Some(vec![parts.share_mount.clone()]),
        security_context: Some(parts.security.clone()),
        // Ready once the agent listens (PKO has no probe, so the operator dials too early).
        readiness_probe: Some(Probe {
            tcp_socket: Some(TCPSocketAction {
                port: IntOrString::String("grpc".into()),
                host: None,
            }),
            period_seconds: Some(5),
            timeout_seconds: Some(2),
            failure_threshold: Some(3),
            ..Probe::default()
        }),
        ..Container::default()
    }
}

/// Merges the Workspace's pod template over `base`, then puts back what the operator needs
/// whatever the template says. The merge itself is a strategic merge on JSON (`merge.rs`):
/// the typed base goes out to JSON once and the merged result comes back typed.
fn overlay_template(
    base: &PodTemplateSpec,
    spec: &WorkspaceSpec,
    name: &str,
) -> Result<PodTemplateSpec, PodError> {
    let mut template = match &spec.pod_template {
        Some(overlay) => {
            let mut merged = serde_json::to_value(base)?;
            merge::merge(&mut merged, &serde_json::to_value(overlay)?);
            serde_json::from_value(merged)?
        }
        None => base.clone(),
    };
    // System labels win over the template's, so the Service keeps selecting the pod.
    template
        .metadata
        .get_or_insert_default()
        .labels
        .get_or_insert_default()
        .extend(labels(name));
    // Lets user init containers hand variables to the agent (PKO's PULUMI_ENV).
    if let Some(pod) = template.spec.as_mut() {
        let init = pod.init_containers.iter_mut().flatten();
        for c in init.chain(pod.containers.iter_mut()) {
            let e = c.env.get_or_insert_default();
            e.retain(|v| v.name != "PULUMI_ENV");
            e.push(env("PULUMI_ENV", &format!("{SHARE}/.env")));
        }
    }
    Ok(template)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::{Value, json};

    fn ws(spec: Value) -> Workspace {
        serde_json::from_value(json!({
            "apiVersion": "auto.pulumi.com/v1alpha1", "kind": "Workspace",
            "metadata": {"name": "w", "namespace": "ns", "uid": "u"},
            "spec": spec,
        }))
        .expect("workspace")
    }

    fn settings() -> PodSettings {
        PodSettings {
            file_server: pko_admission::tenancy::FileServerNames::default(),
            agent_image: "agent:1".into(),
            agent_image_pull_policy: "IfNotPresent".into(),
            pko_agent_image: "pko:2.9".into(),
            max_artifact_bytes: None,
            git_ssh_accept_new_host_keys: false,
            github_api_url: pko_git::github_app::DEFAULT_API_URL.into(),
        }
    }

    #[test]
    fn a_flux_url_on_the_file_server_must_name_the_workspaces_namespace() {
        let settings = PodSettings {
            file_server: pko_admission::tenancy::FileServerNames {
                hosts: vec!["fs.sys".into()],
                ports: vec![80],
            },
            ..settings()
        };
        let build = |url: &str| {
            let spec = json!({"flux": {"url": url, "digest": "sha256:00"}});
            desired_statefulset(
                &ws(spec),
                "w",
                "ns",
                &OwnerReference::default(),
                &settings,
                &AgentLayout::pinned("fp"),
            )
        };
        for url in [
            "http://fs.sys/programs/other/p/1",
            "HTTP://FS.SYS.:80/x/../programs/%6Fther/p/1",
            "http://fs.sys//programs//other/p/1?ns=ns",
        ] {
            match build(url) {
                Err(PodError::CrossNamespaceProgram { target, own }) => {
                    assert_eq!((target.as_str(), own.as_str()), ("other", "ns"), "{url}");
                }
                other => panic!("{url}: {other:?}"),
            }
        }
        assert!(matches!(
            build("http://[::1/x"),
            Err(PodError::InvalidFluxUrl(_))
        ));
        for url in [
            "http://fs.sys/programs/ns/p/1?digest=sha256:00&token=k1.x",
            "http://elsewhere/programs/other/p/1",
            "http://fs.sys:8080/programs/other/p/1",
        ] {
            assert!(build(url).is_ok(), "{url}");
        }
    }

    fn sts(spec: Value) -> Value {
        let sts = desired_statefulset(
            &ws(spec),
            "w",
            "ns",
            &OwnerReference::default(),
            &settings(),
            &AgentLayout::pinned("fp"),
        )
        .expect("sts");
        serde_json::to_value(sts).expect("json")
    }

    fn pod(spec: Value) -> Value {
        sts(spec)["spec"]["template"]["spec"].clone()
    }

    fn container<'a>(pod: &'a Value, list: &str, name: &str) -> &'a Value {
        pod[list]
            .as_array()
            .and_then(|l| l.iter().find(|c| c["name"] == name))
            .unwrap_or(&Value::Null)
    }

    fn env_of(c: &Value, name: &str) -> Option<String> {
        c["env"]
            .as_array()?
            .iter()
            .find(|e| e["name"] == name)
            .map(|e| e["value"].as_str().unwrap_or_default().to_owned())
    }

    const FLUX: &str =
        r#"{"flux": {"url": "http://src/a.tar.gz", "digest": "sha256:00", "dir": "random-yaml"}}"#;

    // PKO's workspace_controller_test cases that apply to the generated objects.
    #[test]
    fn images_service_account_env_and_resources() {
        let p = pod(json!({}));
        let pulumi = container(&p, "containers", "pulumi");
        assert_eq!(pulumi["image"], "pulumi/pulumi:latest-nonroot");
        assert_eq!(p["serviceAccountName"], "default");
        assert_eq!(
            pulumi["resources"],
            json!({"requests": {"cpu": "100m", "memory": "64Mi"}})
        );
        assert_eq!(
            container(&p, "initContainers", "bootstrap")["image"],
            "agent:1"
        );

        let p = pod(json!({
            "image": "test/pulumi:v3.42.0",
            "serviceAccountName": "test",
            "env": [
                {"name": "FOO", "value": "BAR"},
                {"name": "NODE", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}},
            ],
            "envFrom": [{"configMapRef": {"name": "test"}}],
            "resources": {"requests": {"cpu": "1", "memory": "1Gi"}},
        }));
        let pulumi = container(&p, "containers", "pulumi");
        assert_eq!(pulumi["image"], "test/pulumi:v3.42.0");
        assert_eq!(p["serviceAccountName"], "test");
        // PKO puts FOO on the container; here it is pushed to the agent (no restart on change),
        // and only what the kubelet must resolve stays.
        assert_eq!(env_of(pulumi, "FOO"), None);
        assert!(
            pulumi["env"]
                .as_array()
                .is_some_and(|e| e.iter().any(|v| v["name"] == "NODE"))
        );
        assert_eq!(pulumi["envFrom"][0]["configMapRef"]["name"], "test");
        assert_eq!(
            pulumi["resources"],
            json!({"requests": {"cpu": "1", "memory": "1Gi"}})
        );
    }

    #[test]
    fn security_profiles() {
        let flux: Value = serde_json::from_str(FLUX).expect("json");
        let mut baseline = flux.clone();
        baseline["securityProfile"] = json!("baseline");
        let p = pod(baseline);
        assert!(p["securityContext"].get("runAsNonRoot").is_none());
        assert_eq!(
            container(&p, "containers", "pulumi")["image"],
            "pulumi/pulumi:latest"
        );
        let p = pod(flux);
        assert_eq!(p["securityContext"]["runAsNonRoot"], true);
        for (list, name) in [
            ("containers", "pulumi"),
            ("initContainers", "fetch"),
            ("initContainers", "bootstrap"),
        ] {
            let sc = &container(&p, list, name)["securityContext"];
            assert_eq!(sc["allowPrivilegeEscalation"], false, "{name}");
            assert_eq!(sc["capabilities"]["drop"], json!(["ALL"]), "{name}");
        }
    }

    #[test]
    fn sources_become_fetch_env() {
        let p = pod(serde_json::from_str(FLUX).expect("json"));
        let fetch = container(&p, "initContainers", "fetch");
        assert_eq!(
            env_of(fetch, "FLUX_URL").as_deref(),
            Some("http://src/a.tar.gz")
        );
        assert_eq!(env_of(fetch, "FLUX_DIGEST").as_deref(), Some("sha256:00"));
        assert_eq!(env_of(fetch, "FLUX_DIR").as_deref(), Some("random-yaml"));
        let p = pod(json!({"git": {"url": "https://g/r.git", "ref": "abc", "dir": "d"}}));
        let fetch = container(&p, "initContainers", "fetch");
        assert_eq!(env_of(fetch, "GIT_URL").as_deref(), Some("https://g/r.git"));
        assert_eq!(env_of(fetch, "GIT_REVISION").as_deref(), Some("abc"));
        assert_eq!(env_of(fetch, "GIT_DIR").as_deref(), Some("d"));
        let p = pod(json!({"local": {"dir": "/app"}}));
        let fetch = container(&p, "initContainers", "fetch");
        assert_eq!(env_of(fetch, "LOCAL_DIR").as_deref(), Some("/app"));
        assert!(fetch["command"].as_array().is_some_and(|c| !c.is_empty()));
        let p = pod(json!({"projectInfo": {"name": "myproject", "runtime": "yaml"}}));
        let fetch = container(&p, "initContainers", "fetch");
        let command = fetch["command"].to_string();
        assert!(command.contains("--project-name") && command.contains("--project-runtime"));
        assert_eq!(env_of(fetch, "PROJECT_NAME").as_deref(), Some("myproject"));
    }

    #[test]
    fn an_ssh_key_brings_the_known_hosts_of_its_secret() {
        let spec = json!({"git": {"url": "git@g:r.git", "ref": "abc",
            "auth": {"sshPrivateKey": {"name": "deploy-key", "key": "id"}}}});
        let p = pod(spec.clone());
        let fetch = container(&p, "initContainers", "fetch");
        let var = |name: &str| {
            fetch["env"]
                .as_array()
                .and_then(|e| e.iter().find(|v| v["name"] == name))
                .cloned()
                .unwrap_or(Value::Null)
        };
        assert_eq!(
            var("GIT_SSH_KNOWN_HOSTS")["valueFrom"]["secretKeyRef"],
            json!({"name": "deploy-key", "key": "knownHosts", "optional": true})
        );
        assert_eq!(var("GIT_SSH_ACCEPT_NEW_HOST_KEYS"), Value::Null);
        let settings = PodSettings {
            git_ssh_accept_new_host_keys: true,
            ..settings()
        };
        let sts = desired_statefulset(
            &ws(spec),
            "w",
            "ns",
            &OwnerReference::default(),
            &settings,
            &AgentLayout::pinned("fp"),
        )
        .expect("statefulset");
        let sts = serde_json::to_value(sts).expect("json");
        let p = &sts["spec"]["template"]["spec"];
        assert_eq!(
            env_of(
                container(p, "initContainers", "fetch"),
                "GIT_SSH_ACCEPT_NEW_HOST_KEYS"
            )
            .as_deref(),
            Some("true")
        );
        let p = pod(json!({"git": {"url": "https://g/r.git", "ref": "abc"}}));
        assert_eq!(
            env_of(
                container(&p, "initContainers", "fetch"),
                "GIT_SSH_KNOWN_HOSTS"
            ),
            None
        );
    }

    #[test]
    fn pod_template_log_level_and_pulumi_env() {
        let p = pod(json!({
            "pulumiLogLevel": 11,
            "podTemplate": {"spec": {
                "initContainers": [{"name": "test", "image": "busybox"}],
                "containers": [{"name": "pulumi", "volumeMounts": [{"name": "test", "mountPath": "/test"}]}],
                "volumes": [{"name": "test", "secret": {"secretName": "test"}}],
            }},
        }));
        let names = |list: &str| -> Vec<String> {
            p[list]
                .as_array()
                .into_iter()
                .flatten()
                .map(|c| c["name"].as_str().unwrap_or_default().to_owned())
                .collect()
        };
        assert_eq!(names("initContainers"), ["bootstrap", "test"]);
        assert_eq!(names("containers"), ["pulumi"]);
        assert_eq!(names("volumes"), ["test", "share", "agent-credentials"]);
        let pulumi = container(&p, "containers", "pulumi");
        let mounts: Vec<&str> = pulumi["volumeMounts"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|m| m["mountPath"].as_str())
            .collect();
        assert_eq!(mounts, ["/test", "/share", "/var/run/pko-agent"]);
        assert!(
            pulumi["command"]
                .to_string()
                .contains("--pulumi-log-level=11")
        );
        assert_eq!(
            env_of(container(&p, "initContainers", "test"), "PULUMI_ENV").as_deref(),
            Some("/share/.env")
        );
        assert!(
            !pod(json!({}))["containers"][0]["command"]
                .to_string()
                .contains("--pulumi-log-level")
        );
    }

    #[test]
    fn the_hash_ignores_stacks_but_not_the_image() {
        let hash = |spec: Value| {
            sts(spec)["spec"]["template"]["metadata"]["annotations"][REVISION_HASH_ANNOTATION]
                .clone()
        };
        let a = hash(json!({"stacks": [{"name": "dev", "config": [{"key": "a", "value": "1"}]}]}));
        let b = hash(json!({"stacks": [{"name": "dev", "config": [{"key": "a", "value": "2"}]}]}));
        let c = hash(json!({"image": "other"}));
        assert_eq!(a, b);
        assert_ne!(a, c);
    }

    #[test]
    fn service_template_labels_do_not_override_system_labels() {
        let w = ws(json!({"serviceTemplate": {"metadata": {
            "labels": {"team": "a", WORKSPACE_COMPONENT_LABEL: "hijack"},
            "annotations": {"x": "y"},
        }}}));
        let svc = serde_json::to_value(desired_service(&w, "w", "ns", &OwnerReference::default()))
            .expect("json");
        assert_eq!(
            svc["metadata"]["labels"][WORKSPACE_COMPONENT_LABEL],
            "workspace"
        );
        assert_eq!(svc["metadata"]["labels"]["team"], "a");
        assert_eq!(svc["metadata"]["annotations"]["x"], "y");
        assert_eq!(svc["spec"]["selector"], json!(labels("w")));
    }

    #[test]
    fn volume_names_are_dns_labels_that_keep_names_apart() {
        // What PKO names them, when valid.
        assert_eq!(volume_name("secret", "db-creds"), "secret-db-creds");
        assert_eq!(volume_name("configmap", "cfg"), "configmap-cfg");
        let dotted = volume_name("secret", "db.creds");
        assert!(dotted.starts_with("secret-db-creds-"), "{dotted}");
        assert!(is_dns1123_label(&dotted));
        // Names that sanitise alike get different hashes.
        assert_ne!(dotted, volume_name("secret", "db-creds"));
        assert_ne!(dotted, volume_name("secret", "db.creds."));
        assert_ne!(
            volume_name("secret", "a.b-c"),
            volume_name("secret", "a-b.c")
        );
        // Long names (a Secret name may have 253 characters) are cut, still apart.
        let long_a = format!("{}a", "x".repeat(252));
        let long_b = format!("{}b", "x".repeat(252));
        for n in [&long_a, &long_b] {
            let v = volume_name("secret", n);
            assert!(is_dns1123_label(&v), "{v}");
            assert_eq!(v.len(), 63);
        }
        assert_ne!(
            volume_name("secret", &long_a),
            volume_name("secret", &long_b)
        );
        // Stable: the pod template (and its hash) does not change between reconciles.
        assert_eq!(dotted, volume_name("secret", "db.creds"));
        assert!(is_dns1123_label(&volume_name("x", "...")));
        assert!(!is_dns1123_label("-a") && !is_dns1123_label("a-") && !is_dns1123_label(""));
    }

    #[test]
    fn restricted_pods_cannot_be_made_root() {
        for template in [
            json!({"spec": {"securityContext": {"runAsUser": 0}}}),
            json!({"spec": {"hostNetwork": true}}),
            json!({"spec": {"containers": [{"name": "pulumi", "securityContext": {"privileged": true}}]}}),
            json!({"spec": {"volumes": [{"name": "h", "hostPath": {"path": "/"}}]}}),
        ] {
            let err = desired_statefulset(
                &ws(json!({"podTemplate": template})),
                "w",
                "ns",
                &OwnerReference::default(),
                &settings(),
                &AgentLayout::pinned("fp"),
            )
            .expect_err("refused");
            assert!(matches!(err, PodError::Restricted(_)), "{err}");
        }
        // The baseline profile allows root.
        desired_statefulset(
            &ws(json!({"securityProfile": "baseline", "podTemplate": {"spec": {"securityContext": {"runAsUser": 0}}}})),
            "w", "ns", &OwnerReference::default(), &settings(), &AgentLayout::pinned("fp"),
        )
        .expect("baseline");
    }

    #[test]
    fn pkos_layout_is_the_one_pkos_manager_makes() {
        let spec = json!({
            "flux": {"url": "http://src/a.tar.gz", "digest": "sha256:00", "dir": "d"},
            "env": [{"name": "PULUMI_BACKEND_URL", "value": "file:///state"}],
            "pulumiLogLevel": 3,
        });
        let build = |env_in_pod| {
            let sts = desired_statefulset(
                &ws(spec.clone()),
                "w",
                "ns",
                &OwnerReference::default(),
                &settings(),
                &AgentLayout::Pko { env_in_pod },
            )
            .expect("sts");
            serde_json::to_value(sts).expect("json")
        };
        let sts = build(false);
        let p = &sts["spec"]["template"]["spec"];
        let bootstrap = container(p, "initContainers", "bootstrap");
        assert_eq!(bootstrap["image"], "pko:2.9");
        assert_eq!(
            bootstrap["args"],
            json!(["cp", "/agent", "/tini", "/share/"])
        );
        assert_eq!(bootstrap["command"], Value::Null);
        let fetch = container(p, "initContainers", "fetch");
        assert_eq!(fetch["image"], "pko:2.9");
        assert_eq!(fetch["args"][0], "sh");
        assert_eq!(fetch["args"][1], "-c");
        assert_eq!(
            fetch["args"][2],
            "/share/agent init -t /share/source --flux-url \"$FLUX_URL\" --flux-digest \"$FLUX_DIGEST\" &&\nln -s \"/share/source/$FLUX_DIR\" /share/workspace"
        );
        assert_eq!(
            env_of(fetch, "FLUX_URL").as_deref(),
            Some("http://src/a.tar.gz")
        );
        let pulumi = container(p, "containers", "pulumi");
        assert_eq!(
            pulumi["command"],
            json!([
                "/share/tini",
                "/share/agent",
                "--",
                "serve",
                "--workspace",
                "/share/workspace",
                "--skip-install",
                "--env-file",
                "/share/.env",
                "--auth-mode",
                "kube",
                "--kube-audience",
                "w.ns",
                "--kube-workspace-namespace",
                "ns",
                "--kube-workspace-name",
                "w",
                "--pulumi-log-level",
                "3"
            ])
        );
        // No credentials: the agent reviews the operator's token.
        assert_eq!(p["volumes"].as_array().map(Vec::len), Some(1));
        assert_eq!(pulumi["volumeMounts"].as_array().map(Vec::len), Some(1));
        let memlimit = pulumi["env"]
            .as_array()
            .and_then(|e| e.iter().find(|v| v["name"] == "AGENT_MEMLIMIT"))
            .expect("AGENT_MEMLIMIT");
        assert_eq!(
            memlimit["valueFrom"]["resourceFieldRef"],
            json!({"containerName": "pulumi", "resource": "requests.memory"})
        );
        assert_eq!(env_of(pulumi, "PULUMI_ENV").as_deref(), Some("/share/.env"));
        // The environment is pushed…
        assert_eq!(env_of(pulumi, "PULUMI_BACKEND_URL"), None);
        let annotations = &sts["spec"]["template"]["metadata"]["annotations"];
        assert_eq!(annotations[ENV_IN_POD_ANNOTATION], Value::Null);
        // …or, for an agent that cannot take it, on the container, with the image remembered.
        let on_pod = build(true);
        let pulumi = container(&on_pod["spec"]["template"]["spec"], "containers", "pulumi");
        assert_eq!(
            env_of(pulumi, "PULUMI_BACKEND_URL").as_deref(),
            Some("file:///state")
        );
        let marked = &on_pod["spec"]["template"]["metadata"]["annotations"];
        assert_eq!(marked[ENV_IN_POD_ANNOTATION], "pko:2.9");
        assert_ne!(
            marked[REVISION_HASH_ANNOTATION],
            annotations[REVISION_HASH_ANNOTATION]
        );
    }

    #[test]
    fn pkos_layout_writes_a_project_file_with_pkos_flags() {
        let info = desired_statefulset(
            &ws(json!({"projectInfo": {"name": "p", "runtime": "yaml"}})),
            "w",
            "ns",
            &OwnerReference::default(),
            &settings(),
            &AgentLayout::Pko { env_in_pod: false },
        )
        .expect("sts");
        let info = serde_json::to_value(info).expect("json");
        let fetch = container(&info["spec"]["template"]["spec"], "initContainers", "fetch");
        assert_eq!(
            fetch["args"][2],
            "/share/agent init -t /share/workspace --project-name \"$PROJECT_NAME\" --project-runtime \"$PROJECT_RUNTIME\""
        );
    }
}
