//! Where a Stack's program comes from, as a Workspace source plus the "commit" that identifies
//! its content.
//!
//! * `programRef`: the Program's artifact (URL + digest) becomes a `flux` source; the digest is
//!   the commit, so a new artifact re-runs the stack even under the same revision (a transform
//!   changed). PKO records the revision instead: see [`Resolved::revision`].
//! * `fluxSource`: any object with a Flux-style `status.artifact`, read here; the kinds of
//!   Flux's group are watched ([`super::flux`]), so polling is a slow fallback for them.
//! * `projectRepo`: a `git` source at a commit SHA. A `branch` is resolved with a refs listing
//!   over HTTP(S) or SSH (no clone, no git binary in the operator) and polled every
//!   `resyncFrequencySeconds`; the workspace pod checks the commit out with its own credentials.
//! * none: the program is already in the workspace image (PKO's `examples/custom-source`:
//!   `workspaceTemplate.spec.local`); the commit is empty, as PKO records it.

use std::time::Duration;

use k8s_openapi::api::core::v1::{Secret, SecretKeySelector};
use kube::api::Api;
use kube::{Client, Resource};
use pko_api::common::ProjectInfo;
use pko_api::common::{ResourceRef, ResourceSelectorType, SecretSelector};
use pko_api::names::{checked_name, is_dns1123_subdomain};
use pko_api::program::{Artifact, Program};
use pko_api::stack::{FLUX_SOURCE_KINDS, FluxSourceReference, Stack};
use pko_api::workspace::{FluxSource, GitAuth, GitHubAppAuth, GitSource};
use pko_git::github_app::AppCredentials;

use super::flux::{self, FluxWatches};
use super::outcome::{Outcome, StackError, Stop};
use super::sync::resync_frequency;
use crate::controller::kit::FromKube;
use crate::controller::program::METADATA_CHAIN;
use crate::controller::takeover::{self, Part};
use crate::controller::workspace::pod::KNOWN_HOSTS_KEY;
use crate::gitremote::{self, HttpAuth, RemoteAuth};
use crate::gitssh::{SshError, SshKey, SshUrl};

/// Where a Workspace gets the program.
#[derive(Debug, Clone, PartialEq)]
pub(super) enum WorkspaceSource {
    Flux(FluxSource),
    // Boxed: its credentials make it much larger than a Flux source.
    Git(Box<GitSource>),
    /// The stack names none: whatever the `workspaceTemplate` gives (a `local` folder).
    Template,
    /// A destroy whose source is gone: a `Pulumi.yaml` written from the stack's
    /// `status.projectInfo` (PKO #1222).
    ProjectInfo(ProjectInfo),
}

/// A usable source.
pub(super) struct Resolved {
    /// The Workspace's `flux` or `git`.
    pub workspace_source: WorkspaceSource,
    /// What identifies the program's content (commit SHA or artifact digest).
    pub commit: String,
    /// What PKO records as the commit for this same content, where that differs from
    /// `commit`: the Program's generation (when no transform shaped the artifact) or the Flux
    /// artifact's revision. A stack PKO deployed at this revision is synced
    /// ([`super::sync::handed_over`]), not run again.
    pub revision: Option<String>,
    /// Poll the source this often (it is read, or its watch may miss a change).
    pub poll: Option<Duration>,
}

impl Resolved {
    /// A source whose content never changes by itself: no commit, no poll.
    fn fixed(workspace_source: WorkspaceSource) -> Self {
        Self {
            workspace_source,
            commit: String::new(),
            revision: None,
            poll: None,
        }
    }
}

/// What a source needs to be read.
pub(super) struct Reader<'a> {
    pub client: &'a Client,
    /// Branch → commit lookups.
    pub git: &'a gitremote::Resolver,
    /// The Flux kinds watched.
    pub flux: &'a FluxWatches,
}

/// A source that cannot be used stalls the stack; `requeue` is when to look again.
fn problem(reason: &'static str, message: String, requeue: Option<Duration>) -> Stop {
    let outcome = Outcome::stalled(reason, message);
    Stop::Status(match requeue {
        Some(after) => outcome.after(after),
        None => outcome,
    })
}

/// A source read, not watched, is looked at again after this long when unavailable.
const UNAVAILABLE_RETRY: Duration = Duration::from_secs(30);

/// The stall reason of a source that cannot be read (now).
pub(super) const SOURCE_UNAVAILABLE: &str = "SourceUnavailable";

/// Whether `stop` says the source cannot be read (as opposed to a spec that is wrong).
pub(super) fn unavailable(stop: &Stop) -> bool {
    matches!(stop, Stop::Status(Outcome::Stalled { reason, .. }) if *reason == SOURCE_UNAVAILABLE)
}

/// A destroy from the stack's last project when its source is gone (PKO #1222): only for a
/// destroy that does not run the program, of a stack whose project is known.
pub(super) fn project_info_fallback(stack: &Stack, deleting: bool) -> Option<Resolved> {
    let spec = &stack.spec;
    let info = stack.status.as_ref()?.project_info.clone()?;
    (deleting
        && spec.destroy_on_finalize == Some(true)
        && spec.preview != Some(true)
        && spec.run_program != Some(true))
    .then(|| Resolved::fixed(WorkspaceSource::ProjectInfo(info)))
}

/// The stack's source; `fresh` skips cached branch lookups (a sync the user asked for). A
/// source that cannot be used ends the reconcile with `Stalled` ([`Stop::Status`]).
pub(super) async fn resolve(
    reader: &Reader<'_>,
    stack: &Stack,
    namespace: &str,
    fresh: bool,
) -> Result<Resolved, Stop> {
    if let Some(repo) = &stack.spec.project_repo {
        return git(reader, stack, namespace, repo, fresh).await;
    }
    if stack.spec.flux_source.is_some() {
        return flux(reader, stack, namespace).await;
    }
    if stack.spec.program_ref.is_some() {
        return program(reader.client, stack, namespace).await;
    }
    sourceless(stack)
}

/// A stack without a source runs the program its workspace image holds (PKO's
/// `examples/custom-source`): its `workspaceTemplate` must say where (`local`, or a `git` or
/// `flux` source of its own), else nothing could run and the stack stalls saying so.
fn sourceless(stack: &Stack) -> Result<Resolved, Stop> {
    let template = stack
        .spec
        .workspace_template
        .as_ref()
        .and_then(|t| t.spec.as_ref());
    let given = template.is_some_and(|t| t.local.is_some() || t.git.is_some() || t.flux.is_some());
    if !given {
        return Err(problem(
            "SpecInvalid",
            "the stack has no source: set projectRepo, fluxSource or programRef, or \
             workspaceTemplate.spec.local (a program in the workspace image)"
                .into(),
            None,
        ));
    }
    Ok(Resolved::fixed(WorkspaceSource::Template))
}

async fn flux(reader: &Reader<'_>, stack: &Stack, namespace: &str) -> Result<Resolved, Stop> {
    let client = reader.client;
    let Some(source) = &stack.spec.flux_source else {
        return Err(problem("SpecInvalid", "no fluxSource".into(), None));
    };
    // The reference becomes a request path: refuse anything but `group/version`, an allowed
    // kind and a DNS-1123 name before any request (PKO's CRDs have no pattern).
    let r = match FluxRef::parse(&source.source_ref) {
        Ok(r) => r,
        Err(reason) => {
            return Err(problem(
                "SpecInvalid",
                format!("fluxSource.sourceRef: {reason}"),
                None,
            ));
        }
    };
    // kube's own pluralization (GitRepository → gitrepositories), as discovery would say.
    // Flux's kinds are watched: a new artifact brings the next reconcile, this read is the
    // fallback. Any other group is only read.
    let poll = match flux::watchable(&source.source_ref.api_version, r.kind) {
        Some(kind) => reader.flux.want(kind),
        None => flux::UNWATCHED_POLL,
    };
    let resource = kube::api::ApiResource::from_gvk(&kube::api::GroupVersionKind::gvk(
        r.group, r.version, r.kind,
    ));
    let api: Api<kube::api::DynamicObject> =
        Api::namespaced_with(client.clone(), namespace, &resource);
    let unavailable = |message: String| {
        Err(problem(
            SOURCE_UNAVAILABLE,
            message,
            Some(UNAVAILABLE_RETRY),
        ))
    };
    let object = match api.get_opt(r.name).await {
        Ok(Some(o)) => o,
        Ok(None) => return unavailable("could not resolve sourceRef".into()),
        Err(e) => return unavailable(format!("could not resolve sourceRef: {e}")),
    };
    let artifact = object.data.pointer("/status/artifact");
    let field = |name: &str| {
        artifact
            .and_then(|a| a.get(name))
            .and_then(|v| v.as_str())
            .map(str::to_owned)
    };
    let (Some(url), Some(digest)) = (field("url"), field("digest")) else {
        return unavailable("Flux source has no artifact".into());
    };
    Ok(Resolved {
        workspace_source: WorkspaceSource::Flux(FluxSource {
            url: Some(url),
            digest: Some(digest.clone()),
            dir: source.dir.clone(),
        }),
        commit: digest,
        revision: field("revision"),
        poll: Some(poll),
    })
}

/// A Flux source reference whose parts are safe to put in a request path.
#[derive(Debug, PartialEq)]
struct FluxRef<'a> {
    group: &'a str,
    version: &'a str,
    kind: &'static str,
    name: &'a str,
}

impl<'a> FluxRef<'a> {
    fn parse(r: &'a FluxSourceReference) -> Result<Self, String> {
        let Some((group, version)) = r.api_version.split_once('/') else {
            return Err(format!(
                "apiVersion {:?} is not group/version",
                r.api_version
            ));
        };
        if !is_dns1123_subdomain(group) || !is_api_version(version) {
            return Err(format!(
                "apiVersion {:?} is not group/version (a DNS subdomain, then a version such as v1 or v1beta2)",
                r.api_version
            ));
        }
        let Some(kind) = FLUX_SOURCE_KINDS.iter().copied().find(|k| *k == r.kind) else {
            return Err(format!(
                "kind {:?} is not one of {}",
                r.kind,
                FLUX_SOURCE_KINDS.join(", ")
            ));
        };
        if !is_dns1123_subdomain(&r.name) {
            return Err(format!("name {:?} is not a DNS-1123 subdomain", r.name));
        }
        Ok(Self {
            group,
            version,
            kind,
            name: &r.name,
        })
    }
}

/// `v1`, `v2beta3`, `v1alpha1`: Kubernetes' version spelling.
fn is_api_version(s: &str) -> bool {
    let Some(rest) = s.strip_prefix('v') else {
        return false;
    };
    let digits =
        |t: &str| !t.is_empty() && !t.starts_with('0') && t.bytes().all(|c| c.is_ascii_digit());
    let end = rest
        .find(|c: char| !c.is_ascii_digit())
        .unwrap_or(rest.len());
    let (major, tail) = rest.split_at(end);
    if !digits(major) {
        return false;
    }
    tail.is_empty()
        || tail
            .strip_prefix("alpha")
            .or_else(|| tail.strip_prefix("beta"))
            .is_some_and(digits)
}

async fn program(client: &Client, stack: &Stack, namespace: &str) -> Result<Resolved, Stop> {
    let Some(program_ref) = &stack.spec.program_ref else {
        return Err(problem("SpecInvalid", "no programRef".into(), None));
    };
    let name = checked_name("spec.programRef.name", &program_ref.name)
        .map_err(|e| problem("SpecInvalid", e.to_string(), None))?;
    let program = Api::<Program>::namespaced(client.clone(), namespace)
        .get_opt(name)
        .await
        .map_err(StackError::kube("reading the Program"))?;
    // Built by PKO before a switch-over: its URL is PKO's file server, and our own artifact is
    // on its way (the Program controller's write brings the next reconcile).
    if program
        .as_ref()
        .is_some_and(|p| takeover::pko_owns(p.meta(), Part::Status))
    {
        return Err(Stop::Status(
            Outcome::reconciling(
                "StackProcessing",
                "waiting for the Program's artifact to be built again after the switch from PKO",
            )
            .after(UNAVAILABLE_RETRY),
        ));
    }
    let artifact = program
        .as_ref()
        .and_then(|p| p.status.as_ref())
        .and_then(|s| s.artifact.as_ref());
    let untransformed = |a: &&Artifact| {
        a.metadata
            .as_ref()
            .is_none_or(|m| !m.contains_key(METADATA_CHAIN))
    };
    let revision = artifact.filter(untransformed).map(|a| a.revision.clone());
    let artifact = artifact.and_then(|a| a.digest.clone().map(|digest| (a.url.clone(), digest)));
    let Some((url, digest)) = artifact else {
        let message = if program.is_none() {
            "unable to retrieve program for stack"
        } else {
            "Program has no artifact"
        };
        return Err(problem(
            SOURCE_UNAVAILABLE,
            message.into(),
            Some(UNAVAILABLE_RETRY),
        ));
    };
    Ok(Resolved {
        commit: digest.clone(),
        revision,
        workspace_source: WorkspaceSource::Flux(FluxSource {
            url: Some(url),
            digest: Some(digest),
            dir: None,
        }),
        poll: None,
    })
}

async fn git(
    reader: &Reader<'_>,
    stack: &Stack,
    namespace: &str,
    repo: &str,
    fresh: bool,
) -> Result<Resolved, Stop> {
    let spec = &stack.spec;
    let invalid = |message: String| problem("SpecInvalid", message, None);
    let set = |v: &Option<String>| v.clone().filter(|s| !s.is_empty());
    let (commit, branch) = match (set(&spec.commit), set(&spec.branch)) {
        (Some(c), None) => (Some(c), None),
        (None, Some(b)) => (None, Some(b)),
        _ => {
            return Err(invalid(
                "projectRepo needs exactly one of commit and branch".into(),
            ));
        }
    };
    let auth = GitCredentials::of(stack, namespace).map_err(invalid)?;
    let commit = match (commit, branch) {
        (Some(commit), _) => commit,
        (None, Some(branch)) => {
            let unavailable = |m: String| problem(SOURCE_UNAVAILABLE, m, Some(UNAVAILABLE_RETRY));
            let remote = auth
                .remote_auth(reader.client, namespace, reader.git, repo)
                .await
                .map_err(unavailable)?;
            reader
                .git
                .resolve(repo, &branch, &remote, fresh)
                .await
                .map_err(|e| unavailable(e.to_string()))?
        }
        (None, None) => return Err(invalid("projectRepo needs a commit or a branch".into())),
    };
    let source = GitSource {
        url: Some(repo.to_owned()),
        ref_: Some(commit.clone()),
        dir: spec.repo_dir.clone(),
        auth: auth.workspace_auth(),
        shallow: spec.shallow,
    };
    Ok(Resolved {
        workspace_source: WorkspaceSource::Git(Box::new(source)),
        commit,
        // PKO records the same SHA.
        revision: None,
        // A pinned commit never changes; a branch is polled.
        poll: spec
            .branch
            .as_ref()
            .filter(|b| !b.is_empty())
            .map(|_| resync_frequency(stack)),
    })
}

/// A Secret key, as a Workspace's `git.auth` selector takes it.
#[derive(Debug, Clone, PartialEq)]
struct KeyRef {
    name: String,
    key: String,
    optional: bool,
}

impl KeyRef {
    fn selector(&self) -> SecretKeySelector {
        SecretKeySelector {
            name: self.name.clone(),
            key: self.key.clone(),
            optional: self.optional.then_some(true),
        }
    }
}

/// A GitHub App's three Secret keys.
#[derive(Debug, Clone, PartialEq)]
struct AppRefs {
    app_id: KeyRef,
    installation_id: KeyRef,
    private_key: KeyRef,
}

/// The stack's git credentials, by reference (values are read only to list a branch's refs).
#[derive(Debug, Default, PartialEq)]
struct GitCredentials {
    ssh_private_key: Option<KeyRef>,
    ssh_password: Option<KeyRef>,
    token: Option<KeyRef>,
    username: Option<KeyRef>,
    password: Option<KeyRef>,
    github_app: Option<AppRefs>,
}

impl GitCredentials {
    /// PKO's precedence: `gitAuth` (sshAuth > accessToken > githubApp > basicAuth), else the
    /// deprecated `gitAuthSecret` (every key optional).
    fn of(stack: &Stack, namespace: &str) -> Result<Self, String> {
        let spec = &stack.spec;
        if let Some(auth) = &spec.git_auth {
            let key = |what: &str, r: &ResourceRef| key_ref(what, r, namespace);
            if let Some(ssh) = &auth.ssh_auth {
                return Ok(Self {
                    ssh_private_key: Some(key(
                        "gitAuth.sshAuth.sshPrivateKey",
                        &ssh.ssh_private_key,
                    )?),
                    ssh_password: ssh
                        .password
                        .as_ref()
                        .map(|p| key("gitAuth.sshAuth.password", p))
                        .transpose()?,
                    ..Self::default()
                });
            }
            if let Some(token) = &auth.access_token {
                return Ok(Self {
                    token: Some(key("gitAuth.accessToken", token)?),
                    ..Self::default()
                });
            }
            if let Some(app) = &auth.github_app {
                return Ok(Self {
                    github_app: Some(AppRefs {
                        app_id: key("gitAuth.githubApp.appID", &app.app_id)?,
                        installation_id: key(
                            "gitAuth.githubApp.installationID",
                            &app.installation_id,
                        )?,
                        private_key: key("gitAuth.githubApp.privateKey", &app.private_key)?,
                    }),
                    ..Self::default()
                });
            }
            if let Some(basic) = &auth.basic_auth {
                return Ok(Self {
                    username: Some(key("gitAuth.basicAuth.userName", &basic.user_name)?),
                    password: Some(key("gitAuth.basicAuth.password", &basic.password)?),
                    ..Self::default()
                });
            }
            return Ok(Self::default());
        }
        if let Some(secret) = spec.git_auth_secret.as_ref().filter(|s| !s.is_empty()) {
            let key = |k: &str| {
                Some(KeyRef {
                    name: secret.clone(),
                    key: k.into(),
                    optional: true,
                })
            };
            return Ok(Self {
                ssh_private_key: key("sshPrivateKey"),
                // PKO's one `password` key: the SSH key's passphrase too.
                ssh_password: key("password"),
                token: key("accessToken"),
                username: key("username"),
                password: key("password"),
                github_app: None,
            });
        }
        Ok(Self::default())
    }

    /// The Workspace's `git.auth`: Secret key selectors the fetch container reads as env.
    fn workspace_auth(&self) -> Option<GitAuth> {
        let selector = |r: &Option<KeyRef>| r.as_ref().map(KeyRef::selector);
        let auth = GitAuth {
            ssh_private_key: selector(&self.ssh_private_key),
            token: selector(&self.token),
            username: selector(&self.username),
            // An SSH key's passphrase and a basic-auth password share PKO's `password` field.
            password: selector(&self.password.clone().or(self.ssh_password.clone())),
            github_app: self.github_app.as_ref().map(|app| GitHubAppAuth {
                app_id: app.app_id.selector(),
                installation_id: app.installation_id.selector(),
                private_key: app.private_key.selector(),
            }),
        };
        (auth != GitAuth::default()).then_some(auth)
    }

    /// Credentials for listing the refs of `url`: over SSH the key, its passphrase and the
    /// `knownHosts` of the key's Secret; over HTTP(S) see [`Self::http_auth`]. Secret values are
    /// read here, namespaced and uncached, only when a branch is polled.
    async fn remote_auth(
        &self,
        client: &Client,
        namespace: &str,
        git: &gitremote::Resolver,
        url: &str,
    ) -> Result<RemoteAuth, String> {
        match SshUrl::parse(url) {
            Err(SshError::NotSsh) => {}
            // The lookup reports a malformed URL.
            Err(_) => return Ok(RemoteAuth::None),
            Ok(_) => {
                let read = |r: Option<KeyRef>| read_key(client, namespace, r);
                let Some(private_key) = read(self.ssh_private_key.clone()).await? else {
                    return Ok(RemoteAuth::Ssh {
                        key: None,
                        known_hosts: None,
                    });
                };
                let known_hosts = self.ssh_private_key.as_ref().map(|r| KeyRef {
                    name: r.name.clone(),
                    key: KNOWN_HOSTS_KEY.to_owned(),
                    optional: true,
                });
                return Ok(RemoteAuth::Ssh {
                    key: Some(SshKey {
                        private_key,
                        passphrase: read(self.ssh_password.clone()).await?,
                    }),
                    known_hosts: read(known_hosts).await?,
                });
            }
        }
        if let Some(app) = &self.github_app {
            let read = |r: &KeyRef| read_key(client, namespace, Some(r.clone()));
            let (id, installation, key) = (
                read(&app.app_id).await?.unwrap_or_default(),
                read(&app.installation_id).await?.unwrap_or_default(),
                read(&app.private_key).await?.unwrap_or_default(),
            );
            let creds = AppCredentials::new(&id, &installation, &key)
                .map_err(|e| format!("gitAuth.githubApp: {e}"))?;
            let auth = git.github_token(&creds).await.map_err(|e| e.to_string())?;
            return Ok(RemoteAuth::Http(auth));
        }
        Ok(self
            .http_auth(client, namespace)
            .await?
            .map_or(RemoteAuth::None, RemoteAuth::Http))
    }

    /// HTTP credentials for listing refs: a token (as user `git`), else username + password.
    async fn http_auth(
        &self,
        client: &Client,
        namespace: &str,
    ) -> Result<Option<HttpAuth>, String> {
        let read = |r: Option<KeyRef>| read_key(client, namespace, r);
        if let Some(token) = read(self.token.clone()).await? {
            return Ok(Some(HttpAuth {
                username: "git".into(),
                password: token,
            }));
        }
        let username = read(self.username.clone()).await?;
        let password = read(self.password.clone()).await?;
        Ok(username
            .zip(password)
            .map(|(username, password)| HttpAuth { username, password }))
    }
}

/// The Secret a `type: Secret` reference names, refused when it lies in another namespace
/// (PKO's deprecated `secret.namespace`). `what` names the field in the error.
pub(super) fn own_secret<'a>(
    what: &str,
    r: &'a ResourceRef,
    namespace: &str,
) -> Result<&'a SecretSelector, String> {
    let s = r
        .secret
        .as_ref()
        .ok_or_else(|| format!("{what}: secret selector missing"))?;
    if s.namespace
        .as_deref()
        .is_some_and(|n| !n.is_empty() && n != namespace)
    {
        return Err(format!("{what}: cross-namespace refs are not allowed"));
    }
    // The name goes into a Secret GET (git credentials) or the Workspace's pod spec.
    checked_name(&format!("{what}: secret.name"), &s.name).map_err(|e| e.to_string())?;
    Ok(s)
}

fn key_ref(what: &str, r: &ResourceRef, namespace: &str) -> Result<KeyRef, String> {
    if r.selector_type != ResourceSelectorType::Secret {
        return Err(format!(
            "{what}: only Secret references are supported for git credentials"
        ));
    }
    let s = own_secret(what, r, namespace)?;
    Ok(KeyRef {
        name: s.name.clone(),
        key: s.key.clone(),
        optional: false,
    })
}

async fn read_key(
    client: &Client,
    namespace: &str,
    r: Option<KeyRef>,
) -> Result<Option<String>, String> {
    let Some(r) = r else { return Ok(None) };
    let secret = Api::<Secret>::namespaced(client.clone(), namespace)
        .get_opt(&r.name)
        .await
        .map_err(|e| format!("cannot read git credentials from Secret {}: {e}", r.name))?;
    let value = secret
        .and_then(|s| s.data)
        .and_then(|mut d| d.remove(&r.key))
        .map(|b| {
            String::from_utf8_lossy(&b.0)
                .trim_end_matches('\n')
                .to_owned()
        });
    match value {
        Some(v) => Ok(Some(v)),
        None if r.optional => Ok(None),
        None => Err(format!("Secret {} has no key {:?}", r.name, r.key)),
    }
}

#[cfg(test)]
mod tests {
    use serde_json::{Value, json};

    use super::*;

    fn flux_ref(api_version: &str, kind: &str, name: &str) -> FluxSourceReference {
        FluxSourceReference {
            api_version: api_version.into(),
            kind: kind.into(),
            name: name.into(),
        }
    }

    fn stack_of(spec: Value, status: Value) -> Stack {
        serde_json::from_value(json!({
            "apiVersion": "pulumi.com/v1", "kind": "Stack",
            "metadata": {"name": "s", "namespace": "ns"},
            "spec": spec, "status": status,
        }))
        .expect("stack")
    }

    #[test]
    fn a_sourceless_stack_needs_a_program_in_its_template() {
        let bare = stack_of(json!({"stack": "dev"}), Value::Null);
        let Err(Stop::Status(Outcome::Stalled {
            reason, message, ..
        })) = sourceless(&bare)
        else {
            panic!("no source at all stalls");
        };
        assert_eq!(reason, "SpecInvalid");
        assert!(
            message.contains("workspaceTemplate.spec.local"),
            "{message}"
        );
        let local = stack_of(
            json!({"stack": "dev", "workspaceTemplate": {"spec": {"local": {"dir": "/app"}}}}),
            Value::Null,
        );
        let resolved = sourceless(&local).expect("the image's program");
        assert_eq!(resolved.workspace_source, WorkspaceSource::Template);
        assert_eq!(resolved.commit, "");
        assert_eq!(resolved.poll, None);
    }

    #[test]
    fn only_a_destroy_without_the_program_falls_back_to_the_last_project() {
        let info = json!({"projectInfo": {"name": "p", "runtime": "yaml"}});
        let spec = json!({"stack": "dev", "programRef": {"name": "p"}, "destroyOnFinalize": true});
        let s = stack_of(spec.clone(), info.clone());
        let resolved = project_info_fallback(&s, true).expect("fallback");
        assert_eq!(
            resolved.workspace_source,
            WorkspaceSource::ProjectInfo(ProjectInfo {
                name: "p".into(),
                runtime: "yaml".into()
            })
        );
        assert!(project_info_fallback(&s, false).is_none(), "not deleting");
        assert!(
            project_info_fallback(&stack_of(spec.clone(), Value::Null), true).is_none(),
            "no project recorded"
        );
        for (field, value) in [
            ("destroyOnFinalize", false),
            ("preview", true),
            ("runProgram", true),
        ] {
            let mut other = spec.clone();
            other[field] = json!(value);
            assert!(
                project_info_fallback(&stack_of(other, info.clone()), true).is_none(),
                "{field}: {value}"
            );
        }
        let gone = problem(SOURCE_UNAVAILABLE, "gone".into(), None);
        assert!(unavailable(&gone));
        assert!(!unavailable(&problem("SpecInvalid", "bad".into(), None)));
    }

    #[test]
    fn flux_references_that_would_bend_the_request_path_are_refused() {
        let good = "source.toolkit.fluxcd.io/v1";
        for (api_version, kind, name) in [
            (
                "pulumi.com/v1/namespaces/team-b/programs/secret-prog?x=",
                "Program",
                "p",
            ),
            (
                "pulumi.com/v1/namespaces/team-b/programs/secret-prog?x=",
                "GitRepository",
                "p",
            ),
            (
                "source.toolkit.fluxcd.io/v1?watch=true",
                "GitRepository",
                "p",
            ),
            ("source.toolkit.fluxcd.io/v1#x", "GitRepository", "p"),
            ("source.toolkit.fluxcd.io%2Fv1", "GitRepository", "p"),
            ("source.toolkit.fluxcd.io/v1%3F", "GitRepository", "p"),
            ("../v1", "GitRepository", "p"),
            ("v1", "Secret", "p"),
            ("source.toolkit.fluxcd.io/v01", "GitRepository", "p"),
            ("source.toolkit.fluxcd.io/v1gamma1", "GitRepository", "p"),
            (good, "Secret", "p"),
            (good, "Program", "p"),
            (good, "gitrepository", "p"),
            (good, "GitRepository", "../x"),
            (good, "GitRepository", "x/y"),
            (good, "GitRepository", "x?watch=true"),
            (good, "GitRepository", "x%2Fy"),
            (good, "GitRepository", "x#y"),
            (good, "GitRepository", ""),
            (good, "GitRepository", "Upper"),
            (good, "GitRepository", &"a".repeat(254)),
        ] {
            let r = flux_ref(api_version, kind, name);
            assert!(FluxRef::parse(&r).is_err(), "{r:?} accepted");
        }
    }

    #[test]
    fn flux_references_of_every_flux_source_kind_are_accepted() {
        for (api_version, kind) in [
            ("source.toolkit.fluxcd.io/v1", "GitRepository"),
            ("source.toolkit.fluxcd.io/v1beta2", "OCIRepository"),
            ("source.toolkit.fluxcd.io/v1", "Bucket"),
            ("source.toolkit.fluxcd.io/v1", "HelmChart"),
            ("source.toolkit.fluxcd.io/v1", "HelmRepository"),
            ("source.toolkit.fluxcd.io/v1alpha1", "ExternalArtifact"),
        ] {
            let r = flux_ref(api_version, kind, "my-repo.v2");
            let parsed = FluxRef::parse(&r).expect("accepted");
            assert_eq!(parsed.name, "my-repo.v2");
            assert_eq!(Some(parsed.group), api_version.split('/').next());
        }
    }

    /// The Workspace's `git.auth`, as it goes on the wire.
    fn wire(auth: Option<GitAuth>) -> Option<Value> {
        auth.map(|a| serde_json::to_value(a).expect("auth"))
    }

    fn stack(spec: Value) -> Stack {
        serde_json::from_value(json!({
            "apiVersion": "pulumi.com/v1", "kind": "Stack",
            "metadata": {"name": "s", "namespace": "ns"}, "spec": spec,
        }))
        .expect("stack")
    }

    fn secret_ref(name: &str, key: &str) -> Value {
        json!({"type": "Secret", "secret": {"name": name, "key": key}})
    }

    #[test]
    fn git_auth_precedence_and_workspace_selectors() {
        let s = stack(
            json!({"stack": "dev", "projectRepo": "https://g/r", "branch": "main",
            "gitAuth": {"accessToken": secret_ref("tok", "t"), "basicAuth": {"userName": secret_ref("b", "u"), "password": secret_ref("b", "p")}}}),
        );
        let creds = GitCredentials::of(&s, "ns").expect("creds");
        assert_eq!(
            wire(creds.workspace_auth()),
            Some(json!({"token": {"name": "tok", "key": "t"}}))
        );
        let s = stack(
            json!({"stack": "dev", "projectRepo": "https://g/r", "branch": "main",
            "gitAuth": {"sshAuth": {"sshPrivateKey": secret_ref("k", "key"), "password": secret_ref("k", "pass")}, "accessToken": secret_ref("tok", "t")}}),
        );
        assert_eq!(
            wire(
                GitCredentials::of(&s, "ns")
                    .expect("creds")
                    .workspace_auth()
            ),
            Some(
                json!({"sshPrivateKey": {"name": "k", "key": "key"}, "password": {"name": "k", "key": "pass"}})
            )
        );
        let s = stack(
            json!({"stack": "dev", "projectRepo": "https://g/r", "branch": "main", "gitAuthSecret": "legacy"}),
        );
        let auth = wire(
            GitCredentials::of(&s, "ns")
                .expect("creds")
                .workspace_auth(),
        )
        .expect("auth");
        assert_eq!(
            auth["token"],
            json!({"name": "legacy", "key": "accessToken", "optional": true})
        );
        assert_eq!(
            GitCredentials::of(
                &stack(json!({"stack": "dev", "projectRepo": "https://g/r", "branch": "main"})),
                "ns"
            )
            .expect("none")
            .workspace_auth(),
            None
        );
    }

    #[test]
    fn unusable_credentials_are_refused_with_the_field() {
        let cross =
            json!({"type": "Secret", "secret": {"name": "t", "key": "k", "namespace": "other"}});
        let s = stack(
            json!({"stack": "dev", "projectRepo": "https://g/r", "branch": "main", "gitAuth": {"accessToken": cross}}),
        );
        let err = GitCredentials::of(&s, "ns").expect_err("cross-namespace");
        assert!(
            err.contains("gitAuth.accessToken") && err.contains("cross-namespace"),
            "{err}"
        );
        let literal = json!({"type": "Literal", "literal": {"value": "x"}});
        let s = stack(
            json!({"stack": "dev", "projectRepo": "https://g/r", "branch": "main", "gitAuth": {"accessToken": literal}}),
        );
        assert!(GitCredentials::of(&s, "ns").is_err());
        let app = json!({"appID": literal, "installationID": secret_ref("a", "i"), "privateKey": secret_ref("a", "k")});
        let s = stack(
            json!({"stack": "dev", "projectRepo": "https://g/r", "branch": "main", "gitAuth": {"githubApp": app}}),
        );
        let err = GitCredentials::of(&s, "ns").expect_err("literal app id");
        assert!(err.contains("gitAuth.githubApp.appID"), "{err}");
    }

    #[test]
    fn a_github_app_goes_to_the_workspace_by_reference() {
        let app = json!({"appID": secret_ref("app", "id"), "installationID": secret_ref("app", "inst"), "privateKey": secret_ref("app", "key")});
        // PKO's order: a token wins over the App, the App over basic auth.
        let s = stack(
            json!({"stack": "dev", "projectRepo": "https://g/r", "branch": "main",
            "gitAuth": {"githubApp": app, "basicAuth": {"userName": secret_ref("b", "u"), "password": secret_ref("b", "p")}}}),
        );
        assert_eq!(
            wire(
                GitCredentials::of(&s, "ns")
                    .expect("creds")
                    .workspace_auth()
            ),
            Some(json!({"githubApp": {
                "appID": {"name": "app", "key": "id"},
                "installationID": {"name": "app", "key": "inst"},
                "privateKey": {"name": "app", "key": "key"}}}))
        );
        let s = stack(
            json!({"stack": "dev", "projectRepo": "https://g/r", "branch": "main",
            "gitAuth": {"githubApp": app, "accessToken": secret_ref("tok", "t")}}),
        );
        assert_eq!(
            wire(
                GitCredentials::of(&s, "ns")
                    .expect("creds")
                    .workspace_auth()
            ),
            Some(json!({"token": {"name": "tok", "key": "t"}}))
        );
    }
}
