//! Reaching the Kubernetes API from the agent, for the two review calls of `--auth-mode kube`,
//! with the HTTP client the agent already links (no Kubernetes client library: the agent stays
//! small). Where to, and as whom, is found as PKO's agent finds it (controller-runtime's
//! order): `--kubeconfig` (or `$KUBECONFIG`), else the pod's service account (in-cluster).
//!
//! A kubeconfig may give a bearer token (inline or `tokenFile`) or a client certificate, and
//! the server's CA (inline or a file); exec plugins and auth providers are refused with a
//! message saying so. The in-cluster token file is re-read every minute, as client-go does,
//! since the kubelet rotates projected tokens.

use std::path::{Path, PathBuf};
use std::sync::{Mutex, PoisonError};
use std::time::{Duration, Instant};

use base64::Engine;
use serde_json::Value;

/// The service account files the kubelet mounts in every pod.
pub const IN_CLUSTER_DIR: &str = "/var/run/secrets/kubernetes.io/serviceaccount";
/// Each review call gets this long (PKO's webhook request timeout).
const REQUEST_TIMEOUT: Duration = Duration::from_secs(10);
/// A token file is read again after this long.
const TOKEN_REFRESH: Duration = Duration::from_secs(60);
/// Largest answer read from the apiserver (a review is a few KiB).
const MAX_ANSWER_BYTES: usize = 1 << 20;

/// Why the apiserver cannot be reached or configured.
#[derive(Debug, thiserror::Error)]
pub enum ApiError {
    #[error("cannot read {path}: {source}")]
    Read {
        path: String,
        #[source]
        source: std::io::Error,
    },
    #[error("invalid kubeconfig {path}: {detail}")]
    Kubeconfig { path: String, detail: String },
    #[error(
        "no Kubernetes API configured: give --kubeconfig (or KUBECONFIG), or run in a pod (KUBERNETES_SERVICE_HOST and {IN_CLUSTER_DIR})"
    )]
    NotConfigured,
    #[error("invalid TLS settings for the Kubernetes API: {0}")]
    Tls(String),
    #[error("calling the Kubernetes API at {url}: {detail}")]
    Call { url: String, detail: String },
}

/// Where the credentials of a call come from.
#[derive(Debug, Clone)]
enum Bearer {
    None,
    Inline(String),
    /// A file read again every [`TOKEN_REFRESH`].
    File(PathBuf),
}

/// What the environment says about in-cluster access (read in `main`).
#[derive(Debug, Clone, Default)]
pub struct InCluster {
    /// `KUBERNETES_SERVICE_HOST`.
    pub host: Option<String>,
    /// `KUBERNETES_SERVICE_PORT`.
    pub port: Option<String>,
}

/// A configured connection to the apiserver.
pub struct ApiServer {
    base: String,
    http: reqwest::Client,
    bearer: Bearer,
    cached_token: Mutex<Option<(Instant, String)>>,
}

/// An answer: the HTTP status and the JSON body (`Null` when it was not JSON).
#[derive(Debug, Clone)]
pub struct Answer {
    pub status: u16,
    pub body: Value,
}

impl ApiServer {
    /// From `kubeconfig` (with `context`, else its current context) when given, else in-cluster.
    pub fn configure(
        kubeconfig: Option<&Path>,
        context: Option<&str>,
        in_cluster: &InCluster,
    ) -> Result<Self, ApiError> {
        match kubeconfig {
            Some(path) => Self::from_kubeconfig(path, context),
            None => Self::in_cluster(in_cluster, Path::new(IN_CLUSTER_DIR)),
        }
    }

    /// The pod's service account, as the kubelet mounts it under `dir`.
    pub fn in_cluster(env: &InCluster, dir: &Path) -> Result<Self, ApiError> {
        let (Some(host), Some(port)) = (&env.host, &env.port) else {
            return Err(ApiError::NotConfigured);
        };
        let token = dir.join("token");
        if !token.is_file() {
            return Err(ApiError::NotConfigured);
        }
        let ca = read(&dir.join("ca.crt"))?;
        let host = if host.contains(':') {
            format!("[{host}]")
        } else {
            host.clone()
        };
        let tls = Tls {
            ca: Some(ca),
            ..Tls::default()
        };
        Self::build(&format!("https://{host}:{port}"), &tls, Bearer::File(token))
    }

    fn from_kubeconfig(path: &Path, context: Option<&str>) -> Result<Self, ApiError> {
        let invalid = |detail: String| ApiError::Kubeconfig {
            path: path.display().to_string(),
            detail,
        };
        let text = String::from_utf8(read(path)?).map_err(|e| invalid(e.to_string()))?;
        let doc: Value = yaml_serde::from_str(&text).map_err(|e| invalid(e.to_string()))?;
        let base_dir = path.parent().unwrap_or(Path::new("."));
        let chosen = Chosen::of(&doc, context).map_err(invalid)?;
        let server = chosen.cluster["server"]
            .as_str()
            .filter(|s| !s.is_empty())
            .ok_or_else(|| invalid("the cluster has no server".into()))?
            .trim_end_matches('/')
            .to_owned();
        let tls = Tls::from_kubeconfig(chosen.cluster, chosen.user, base_dir).map_err(invalid)?;
        let bearer = bearer_of(chosen.user, base_dir).map_err(invalid)?;
        Self::build(&server, &tls, bearer)
    }

    fn build(base: &str, tls: &Tls, bearer: Bearer) -> Result<Self, ApiError> {
        let mut builder = reqwest::Client::builder()
            .timeout(REQUEST_TIMEOUT)
            .connect_timeout(REQUEST_TIMEOUT)
            // The apiserver is named exactly; a proxy from the environment is not ours to use.
            .no_proxy()
            .tls_built_in_root_certs(false);
        if let Some(ca) = &tls.ca {
            for cert in reqwest::Certificate::from_pem_bundle(ca)
                .map_err(|e| ApiError::Tls(e.to_string()))?
            {
                builder = builder.add_root_certificate(cert);
            }
        }
        if let Some(pem) = &tls.identity {
            let identity =
                reqwest::Identity::from_pem(pem).map_err(|e| ApiError::Tls(e.to_string()))?;
            builder = builder.identity(identity);
        }
        if tls.insecure {
            builder = builder.danger_accept_invalid_certs(true);
        }
        let http = builder.build().map_err(|e| ApiError::Tls(e.to_string()))?;
        Ok(Self {
            base: base.to_owned(),
            http,
            bearer,
            cached_token: Mutex::new(None),
        })
    }

    fn token(&self) -> Result<Option<String>, ApiError> {
        match &self.bearer {
            Bearer::None => Ok(None),
            Bearer::Inline(t) => Ok(Some(t.clone())),
            Bearer::File(path) => {
                let mut cached = self
                    .cached_token
                    .lock()
                    .unwrap_or_else(PoisonError::into_inner);
                if let Some((at, token)) = cached.as_ref()
                    && at.elapsed() < TOKEN_REFRESH
                {
                    return Ok(Some(token.clone()));
                }
                let token = String::from_utf8_lossy(&read(path)?).trim().to_owned();
                *cached = Some((Instant::now(), token.clone()));
                Ok(Some(token))
            }
        }
    }

    /// POSTs `body` to `path` (e.g. `/apis/authentication.k8s.io/v1/tokenreviews`).
    pub async fn post(&self, path: &str, body: &Value) -> Result<Answer, ApiError> {
        let url = format!("{}{path}", self.base);
        let call = |detail: String| ApiError::Call {
            url: url.clone(),
            detail,
        };
        let mut request = self
            .http
            .post(&url)
            .header("content-type", "application/json")
            .header("accept", "application/json")
            .body(serde_json::to_vec(body).map_err(|e| call(e.to_string()))?);
        if let Some(token) = self.token()? {
            request = request.bearer_auth(token);
        }
        let mut response = request.send().await.map_err(|e| call(chain(&e)))?;
        let status = response.status().as_u16();
        let mut bytes = Vec::new();
        while let Some(chunk) = response.chunk().await.map_err(|e| call(chain(&e)))? {
            if bytes.len() + chunk.len() > MAX_ANSWER_BYTES {
                return Err(call(format!("answer over {MAX_ANSWER_BYTES} bytes")));
            }
            bytes.extend_from_slice(&chunk);
        }
        let body = serde_json::from_slice(&bytes).unwrap_or(Value::Null);
        Ok(Answer { status, body })
    }
}

fn chain(e: &dyn std::error::Error) -> String {
    pko_agent_api::client::error_chain(e)
}

fn read(path: &Path) -> Result<Vec<u8>, ApiError> {
    std::fs::read(path).map_err(|source| ApiError::Read {
        path: path.display().to_string(),
        source,
    })
}

/// The user of a context that names none.
static NO_USER: Value = Value::Null;

/// The cluster and user a kubeconfig's context names.
struct Chosen<'a> {
    cluster: &'a Value,
    user: &'a Value,
}

impl<'a> Chosen<'a> {
    fn of(doc: &'a Value, context: Option<&str>) -> Result<Self, String> {
        let named = |list: &str, name: &str, field: &str| -> Result<&'a Value, String> {
            doc[list]
                .as_array()
                .and_then(|items| items.iter().find(|i| i["name"] == name))
                .map(|i| &i[field])
                .ok_or_else(|| format!("no {field} named {name:?}"))
        };
        let context_name = match context {
            Some(c) => c.to_owned(),
            None => doc["current-context"]
                .as_str()
                .filter(|c| !c.is_empty())
                .ok_or("no current-context (give --context)")?
                .to_owned(),
        };
        let ctx = named("contexts", &context_name, "context")?;
        let cluster_name = ctx["cluster"]
            .as_str()
            .ok_or("the context has no cluster")?;
        let cluster = named("clusters", cluster_name, "cluster")?;
        let user = match ctx["user"].as_str() {
            Some(u) if !u.is_empty() => named("users", u, "user")?,
            _ => &NO_USER,
        };
        Ok(Self { cluster, user })
    }
}

/// TLS settings of a kubeconfig: the CA, a client identity (certificate + key PEM), or none.
#[derive(Default)]
struct Tls {
    ca: Option<Vec<u8>>,
    identity: Option<Vec<u8>>,
    insecure: bool,
}

impl Tls {
    fn from_kubeconfig(cluster: &Value, user: &Value, dir: &Path) -> Result<Self, String> {
        let ca = data_or_file(
            cluster,
            "certificate-authority-data",
            "certificate-authority",
            dir,
        )?;
        let cert = data_or_file(user, "client-certificate-data", "client-certificate", dir)?;
        let key = data_or_file(user, "client-key-data", "client-key", dir)?;
        let identity = match (cert, key) {
            (Some(mut cert), Some(key)) => {
                cert.push(b'\n');
                cert.extend(key);
                Some(cert)
            }
            (None, None) => None,
            _ => {
                return Err("a client certificate needs its key, and a key its certificate".into());
            }
        };
        Ok(Self {
            ca,
            identity,
            insecure: cluster["insecure-skip-tls-verify"] == true,
        })
    }
}

/// `<data key>` (base64) or the file `<file key>` names (relative to the kubeconfig).
fn data_or_file(
    section: &Value,
    data_key: &str,
    file_key: &str,
    dir: &Path,
) -> Result<Option<Vec<u8>>, String> {
    if let Some(data) = section[data_key].as_str().filter(|d| !d.is_empty()) {
        return base64::engine::general_purpose::STANDARD
            .decode(data.trim())
            .map(Some)
            .map_err(|e| format!("{data_key}: {e}"));
    }
    match section[file_key].as_str().filter(|f| !f.is_empty()) {
        Some(file) => std::fs::read(dir.join(file))
            .map(Some)
            .map_err(|e| format!("{file_key} {file}: {e}")),
        None => Ok(None),
    }
}

fn bearer_of(user: &Value, dir: &Path) -> Result<Bearer, String> {
    if !user["exec"].is_null() || !user["auth-provider"].is_null() {
        return Err(
            "exec plugins and auth providers are not supported: use a token, a token file or a client certificate"
                .into(),
        );
    }
    if let Some(token) = user["token"].as_str().filter(|t| !t.is_empty()) {
        return Ok(Bearer::Inline(token.to_owned()));
    }
    if let Some(file) = user["tokenFile"].as_str().filter(|f| !f.is_empty()) {
        return Ok(Bearer::File(dir.join(file)));
    }
    Ok(Bearer::None)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_kubeconfig_gives_the_server_the_context_and_the_credentials() {
        let dir = tempfile::tempdir().expect("dir");
        let token_file = dir.path().join("token");
        std::fs::write(&token_file, "from-file\n").expect("token");
        let config = r#"
apiVersion: v1
kind: Config
current-context: b
clusters:
- name: one
  cluster: {server: "https://127.0.0.1:6443/", insecure-skip-tls-verify: true}
contexts:
- name: a
  context: {cluster: one, user: inline}
- name: b
  context: {cluster: one, user: file}
users:
- name: inline
  user: {token: abc}
- name: file
  user: {tokenFile: token}
- name: plugin
  user: {exec: {command: aws}}
"#;
        let path = dir.path().join("config");
        std::fs::write(&path, config).expect("config");
        let api = ApiServer::from_kubeconfig(&path, None).expect("configured");
        assert_eq!(api.base, "https://127.0.0.1:6443");
        assert_eq!(api.token().expect("token").as_deref(), Some("from-file"));
        let api = ApiServer::from_kubeconfig(&path, Some("a")).expect("configured");
        assert_eq!(api.token().expect("token").as_deref(), Some("abc"));
        let err = ApiServer::from_kubeconfig(&path, Some("nope"))
            .err()
            .expect("no such context");
        assert!(
            err.to_string().contains("no context named \"nope\""),
            "{err}"
        );

        let doc: Value = yaml_serde::from_str(config).expect("yaml");
        let plugin = doc["users"][2]["user"].clone();
        let refused = bearer_of(&plugin, dir.path()).expect_err("exec refused");
        assert!(refused.contains("exec plugins"), "{refused}");
    }

    #[test]
    fn in_cluster_needs_the_service_and_the_mounted_account() {
        let dir = tempfile::tempdir().expect("dir");
        let env = InCluster {
            host: Some("10.0.0.1".into()),
            port: Some("443".into()),
        };
        assert!(matches!(
            ApiServer::in_cluster(&env, dir.path()),
            Err(ApiError::NotConfigured)
        ));
        assert!(matches!(
            ApiServer::in_cluster(&InCluster::default(), dir.path()),
            Err(ApiError::NotConfigured)
        ));
    }
}
