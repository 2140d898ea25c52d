//! Reaching workspace agents: per-workspace credentials (bearer token + TLS key pair, minted
//! here, kept in a Secret the pod mounts) and cached gRPC connections.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::Duration;

use k8s_openapi::ByteString;
use k8s_openapi::api::apps::v1::StatefulSet;
use k8s_openapi::api::core::v1::Secret;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference;
use kube::api::{Api, PostParams};
use kube::{Client, ResourceExt};
use pko_agent_api::client::{AgentClient, ConnectError, Target, connect};
use sha2::{Digest, Sha256};

use crate::controller::keys::DEV_PORT_ANNOTATION;
use crate::controller::workspace::pod;

/// Failures to reach an agent.
#[derive(Debug, thiserror::Error)]
pub enum AgentError {
    #[error("cannot read or create the agent credentials {name}: {source}")]
    Credentials {
        name: String,
        #[source]
        source: kube::Error,
    },
    #[error("the agent credentials {0} are incomplete (token, tls.crt, tls.key)")]
    BadCredentials(String),
    #[error("cannot mint a certificate: {0}")]
    Mint(#[from] rcgen::Error),
    #[error("no development port annotation ({DEV_PORT_ANNOTATION}) on {0} yet")]
    NoDevPort(String),
    #[error(transparent)]
    Connect(#[from] ConnectError),
}

/// The agent credentials of one workspace.
#[derive(Clone, Debug)]
pub struct Credentials {
    pub token: String,
    pub cert_pem: Vec<u8>,
    /// Short hash of the certificate: changes when the credentials are re-minted.
    pub fingerprint: String,
}

/// Connections to agents, cached per workspace.
pub struct Agents {
    client: Client,
    localhost: Option<String>,
    cache: Mutex<HashMap<String, (String, AgentClient)>>,
}

impl Agents {
    /// `localhost`: PKO's `WORKSPACE_LOCALHOST` (development): `host:port` sends every call
    /// there; a bare `host` uses the port the development kubelet annotates.
    pub fn new(client: Client, localhost: Option<String>) -> Self {
        Self {
            client,
            localhost: localhost.filter(|l| !l.is_empty()),
            cache: Mutex::new(HashMap::new()),
        }
    }

    /// Reads the workspace's credentials Secret, creating it (owned by the Workspace) if missing.
    pub async fn ensure_credentials(
        &self,
        workspace: &str,
        namespace: &str,
        owner: Option<&OwnerReference>,
    ) -> Result<Credentials, AgentError> {
        let name = pod::credentials_name(workspace);
        let api: Api<Secret> = Api::namespaced(self.client.clone(), namespace);
        let err = |source| AgentError::Credentials {
            name: name.clone(),
            source,
        };
        let secret = match api.get_opt(&name).await.map_err(err)? {
            Some(s) => s,
            None => {
                let minted = mint(workspace, namespace, owner)?;
                match api.create(&PostParams::default(), &minted).await {
                    Ok(s) => s,
                    // Another replica (or a retry) made it first.
                    Err(kube::Error::Api(e)) if e.code == 409 => {
                        api.get(&name).await.map_err(err)?
                    }
                    Err(e) => return Err(err(e)),
                }
            }
        };
        let data = secret.data.unwrap_or_default();
        let field = |k: &str| data.get(k).map(|b| b.0.clone()).filter(|b| !b.is_empty());
        match (field("token"), field("tls.crt"), field("tls.key")) {
            (Some(token), Some(cert), Some(_)) => Ok(Credentials {
                token: String::from_utf8_lossy(&token).trim().to_owned(),
                fingerprint: hex::encode(Sha256::digest(&cert))[..16].to_owned(),
                cert_pem: cert,
            }),
            _ => Err(AgentError::BadCredentials(name)),
        }
    }

    /// The address dialed for a workspace (written to `status.address`).
    pub fn address(
        &self,
        workspace: &str,
        namespace: &str,
        sts: &StatefulSet,
    ) -> Result<String, AgentError> {
        match &self.localhost {
            Some(l) if l.contains(':') => Ok(l.clone()),
            Some(host) => {
                let port = sts
                    .annotations()
                    .get(DEV_PORT_ANNOTATION)
                    .ok_or_else(|| AgentError::NoDevPort(sts.name_any()))?;
                Ok(format!("{host}:{port}"))
            }
            None => Ok(format!(
                "{}.{namespace}:{}",
                pod::workload_name(workspace),
                pod::AGENT_PORT
            )),
        }
    }

    /// A client for the workspace's agent (cached while address and credentials stay).
    pub async fn client(
        &self,
        workspace: &str,
        namespace: &str,
        address: &str,
        credentials: &Credentials,
    ) -> Result<AgentClient, AgentError> {
        let key = format!("{namespace}/{workspace}");
        let identity = format!("{address}|{}", credentials.fingerprint);
        if let Some((id, client)) = self.lock().get(&key)
            && *id == identity
        {
            return Ok(client.clone());
        }
        let client = connect(&Target {
            address: address.to_owned(),
            ca_pem: Some(credentials.cert_pem.clone()),
            server_name: Some(pod::server_name(workspace, namespace)),
            token: Some(credentials.token.clone()),
            connect_timeout: Duration::from_secs(5),
        })
        .await?;
        self.lock().insert(key, (identity, client.clone()));
        Ok(client)
    }

    /// Drops a cached connection (after a transport error).
    pub fn forget(&self, workspace: &str, namespace: &str) {
        self.lock().remove(&format!("{namespace}/{workspace}"));
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, (String, AgentClient)>> {
        self.cache
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

/// A new credentials Secret: a random 256-bit token and a self-signed certificate for the
/// workspace's Service name.
fn mint(
    workspace: &str,
    namespace: &str,
    owner: Option<&OwnerReference>,
) -> Result<Secret, AgentError> {
    let service = pod::workload_name(workspace);
    let names = vec![
        pod::server_name(workspace, namespace),
        format!("{service}.{namespace}.svc"),
        format!("{service}.{namespace}.svc.cluster.local"),
    ];
    let cert = rcgen::generate_simple_self_signed(names)?;
    let token = hex::encode(rand::random::<[u8; 32]>());
    Ok(Secret {
        metadata: kube::api::ObjectMeta {
            name: Some(pod::credentials_name(workspace)),
            namespace: Some(namespace.to_owned()),
            labels: Some(pod::labels(workspace)),
            owner_references: owner.map(|o| vec![o.clone()]),
            ..Default::default()
        },
        type_: Some("Opaque".into()),
        data: Some(
            [
                ("token", token.into_bytes()),
                ("tls.crt", cert.cert.pem().into_bytes()),
                ("tls.key", cert.signing_key.serialize_pem().into_bytes()),
            ]
            .into_iter()
            .map(|(k, v)| (k.to_owned(), ByteString(v)))
            .collect(),
        ),
        ..Default::default()
    })
}
