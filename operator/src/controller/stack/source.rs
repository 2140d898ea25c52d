//! Where a Stack's program comes from, as a Workspace source plus the "commit" that identifies
//! its content.
//!
//! * `programRef`: the Program's artifact (URL + digest) becomes a `flux` source; the digest is
//!   the commit, so a new artifact re-runs the stack even under the same revision.
//! * `fluxSource`: any object with a Flux-style `status.artifact` (read, polled every minute).
//! * `projectRepo`: a `git` source at a commit SHA. A `branch` is resolved with an HTTP refs
//!   listing (no clone, no git binary in the operator) and polled every `resyncFrequencySeconds`;
//!   the workspace pod checks the commit out with its own git CLI and credentials.

use std::time::Duration;

use k8s_openapi::api::core::v1::Secret;
use kube::api::Api;
use pko_api::common::{ResourceRef, ResourceSelectorType, SecretSelector};
use pko_api::program::Program;
use pko_api::stack::Stack;
use serde_json::{Value, json};

use crate::controller::stack::{StackContext, StackError, resync_frequency};
use crate::gitremote::HttpAuth;

/// Why a source cannot be used: (Stalled reason, message, requeue after).
pub type SourceProblem = (&'static str, String, Option<Duration>);

/// A usable source.
pub struct Resolved {
    /// `{"flux": {...}}` or `{"git": {...}}`, merged into the Workspace spec.
    pub workspace_source: Value,
    /// What identifies the program's content (commit SHA or artifact digest).
    pub commit: String,
    /// Poll the source this often (it is read, not watched).
    pub poll: Option<Duration>,
}

/// The stack's source; `fresh` skips cached branch lookups (a sync the user asked for).
pub async fn resolve(
    ctx: &StackContext,
    stack: &Stack,
    namespace: &str,
    fresh: bool,
) -> Result<Result<Resolved, SourceProblem>, StackError> {
    if let Some(repo) = &stack.spec.project_repo {
        return Ok(git(ctx, stack, namespace, repo, fresh).await);
    }
    if stack.spec.flux_source.is_some() {
        return flux(ctx, stack, namespace).await;
    }
    program(ctx, stack, namespace).await
}

async fn flux(
    ctx: &StackContext,
    stack: &Stack,
    namespace: &str,
) -> Result<Result<Resolved, SourceProblem>, StackError> {
    let Some(source) = &stack.spec.flux_source else {
        return Ok(Err(("SpecInvalid", "no fluxSource".into(), None)));
    };
    let r = &source.source_ref;
    let (group, version) = r
        .api_version
        .split_once('/')
        .unwrap_or(("", r.api_version.as_str()));
    // kube's own pluralization (GitRepository → gitrepositories), as discovery would say.
    let resource = kube::api::ApiResource::from_gvk(&kube::api::GroupVersionKind::gvk(
        group, version, &r.kind,
    ));
    let api: Api<kube::api::DynamicObject> =
        Api::namespaced_with(ctx.client.clone(), namespace, &resource);
    let unavailable = |message: String| {
        Ok(Err((
            "SourceUnavailable",
            message,
            Some(Duration::from_secs(30)),
        )))
    };
    let object = match api.get_opt(&r.name).await {
        Ok(Some(o)) => o,
        Ok(None) => return unavailable("could not resolve sourceRef".into()),
        Err(e) => return unavailable(format!("could not resolve sourceRef: {e}")),
    };
    let artifact = object
        .data
        .pointer("/status/artifact")
        .cloned()
        .unwrap_or(Value::Null);
    let (Some(url), Some(digest)) = (artifact["url"].as_str(), artifact["digest"].as_str()) else {
        return unavailable("Flux source has no artifact".into());
    };
    Ok(Ok(Resolved {
        workspace_source: json!({"flux": {"url": url, "digest": digest, "dir": source.dir}}),
        commit: digest.to_owned(),
        poll: Some(Duration::from_secs(60)),
    }))
}

async fn program(
    ctx: &StackContext,
    stack: &Stack,
    namespace: &str,
) -> Result<Result<Resolved, SourceProblem>, StackError> {
    let Some(program_ref) = &stack.spec.program_ref else {
        return Ok(Err((
            "SpecInvalid",
            "the stack has no source (projectRepo, fluxSource or programRef)".into(),
            None,
        )));
    };
    let program = Api::<Program>::namespaced(ctx.client.clone(), namespace)
        .get_opt(&program_ref.name)
        .await
        .map_err(|source| StackError::Kube {
            what: "reading the Program".into(),
            source,
        })?;
    let artifact = program
        .as_ref()
        .and_then(|p| p.status.as_ref())
        .and_then(|s| serde_json::to_value(s).ok())
        .and_then(|s| s.get("artifact").cloned())
        .filter(|a| a.get("url").is_some() && a.get("digest").is_some());
    let Some(artifact) = artifact else {
        let message = if program.is_none() {
            "unable to retrieve program for stack"
        } else {
            "Program has no artifact"
        };
        return Ok(Err((
            "SourceUnavailable",
            message.into(),
            Some(Duration::from_secs(30)),
        )));
    };
    Ok(Ok(Resolved {
        commit: artifact["digest"].as_str().unwrap_or_default().to_owned(),
        workspace_source: json!({"flux": {"url": artifact["url"], "digest": artifact["digest"]}}),
        poll: None,
    }))
}

async fn git(
    ctx: &StackContext,
    stack: &Stack,
    namespace: &str,
    repo: &str,
    fresh: bool,
) -> Result<Resolved, SourceProblem> {
    let spec = &stack.spec;
    let invalid = |message: String| ("SpecInvalid", message, None);
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
            let http = auth
                .http_auth(ctx, namespace)
                .await
                .map_err(|m| ("SourceUnavailable", m, Some(Duration::from_secs(30))))?;
            ctx.git
                .resolve(repo, &branch, http.as_ref(), fresh)
                .await
                .map_err(|e| {
                    (
                        "SourceUnavailable",
                        e.to_string(),
                        Some(Duration::from_secs(30)),
                    )
                })?
        }
        (None, None) => return Err(invalid("projectRepo needs a commit or a branch".into())),
    };
    let mut source =
        json!({"url": repo, "ref": commit, "dir": spec.repo_dir, "shallow": spec.shallow});
    if let Some(selectors) = auth.workspace_auth() {
        source["auth"] = selectors;
    }
    Ok(Resolved {
        workspace_source: json!({ "git": source }),
        commit,
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
    fn selector(&self) -> Value {
        let mut v = json!({"name": self.name, "key": self.key});
        if self.optional {
            v["optional"] = json!(true);
        }
        v
    }
}

/// The stack's git credentials, by reference (values are read only to list a branch's refs).
#[derive(Debug, Default, PartialEq)]
struct GitCredentials {
    ssh_private_key: Option<KeyRef>,
    ssh_password: Option<KeyRef>,
    token: Option<KeyRef>,
    username: Option<KeyRef>,
    password: Option<KeyRef>,
}

impl GitCredentials {
    /// PKO's precedence: `gitAuth` (sshAuth > accessToken > basicAuth), else the deprecated
    /// `gitAuthSecret` (every key optional).
    fn of(stack: &Stack, namespace: &str) -> Result<Self, String> {
        let spec = &stack.spec;
        if let Some(auth) = &spec.git_auth {
            if auth.github_app.is_some() && auth.ssh_auth.is_none() && auth.access_token.is_none() {
                return Err(
                    "gitAuth.githubApp is not supported by pko-rs; use accessToken, basicAuth or sshAuth"
                        .into(),
                );
            }
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
                ssh_password: None,
                token: key("accessToken"),
                username: key("username"),
                password: key("password"),
            });
        }
        Ok(Self::default())
    }

    /// The Workspace's `git.auth`: Secret key selectors the fetch container reads as env.
    fn workspace_auth(&self) -> Option<Value> {
        let mut auth = serde_json::Map::new();
        let mut put = |field: &str, r: &Option<KeyRef>| {
            if let Some(r) = r {
                auth.insert(field.into(), r.selector());
            }
        };
        put("sshPrivateKey", &self.ssh_private_key);
        put("token", &self.token);
        put("username", &self.username);
        // An SSH key's passphrase and a basic-auth password share PKO's `password` field.
        put(
            "password",
            &self.password.clone().or(self.ssh_password.clone()),
        );
        (!auth.is_empty()).then_some(Value::Object(auth))
    }

    /// HTTP credentials for listing refs: a token (as user `git`), else username + password.
    /// Secret values are read here, namespaced and uncached, only when a branch is polled.
    async fn http_auth(
        &self,
        ctx: &StackContext,
        namespace: &str,
    ) -> Result<Option<HttpAuth>, String> {
        let read = |r: Option<KeyRef>| read_key(ctx, namespace, r);
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
pub fn own_secret<'a>(
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
    ctx: &StackContext,
    namespace: &str,
    r: Option<KeyRef>,
) -> Result<Option<String>, String> {
    let Some(r) = r else { return Ok(None) };
    let secret = Api::<Secret>::namespaced(ctx.client.clone(), namespace)
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
    use super::*;

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
            creds.workspace_auth(),
            Some(json!({"token": {"name": "tok", "key": "t"}}))
        );
        let s = stack(
            json!({"stack": "dev", "projectRepo": "https://g/r", "branch": "main",
            "gitAuth": {"sshAuth": {"sshPrivateKey": secret_ref("k", "key"), "password": secret_ref("k", "pass")}, "accessToken": secret_ref("tok", "t")}}),
        );
        assert_eq!(
            GitCredentials::of(&s, "ns")
                .expect("creds")
                .workspace_auth(),
            Some(
                json!({"sshPrivateKey": {"name": "k", "key": "key"}, "password": {"name": "k", "key": "pass"}})
            )
        );
        let s = stack(
            json!({"stack": "dev", "projectRepo": "https://g/r", "branch": "main", "gitAuthSecret": "legacy"}),
        );
        let auth = GitCredentials::of(&s, "ns")
            .expect("creds")
            .workspace_auth()
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
        let app = json!({"appID": secret_ref("a", "id"), "installationID": secret_ref("a", "i"), "privateKey": secret_ref("a", "k")});
        let s = stack(
            json!({"stack": "dev", "projectRepo": "https://g/r", "branch": "main", "gitAuth": {"githubApp": app}}),
        );
        assert!(
            GitCredentials::of(&s, "ns")
                .expect_err("github app")
                .contains("githubApp")
        );
    }
}
