//! Reads module bytes from where a transform says they are: a ConfigMap key (one namespaced
//! `get`, no watch), an `https://` URL, a `file:///` path under the plugin folder, or an OCI
//! artifact (its cosign signature checked first when the transform asks for it). Offline (the
//! `render` command), ConfigMaps come from manifests and modules from a folder, by digest.

use crate::egress::{EgressPolicy, Failure};
use std::collections::HashMap;
use std::path::{Component, Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use crate::oci::registry::{Credentials, Session, docker_config_credentials};
use crate::oci::{OciError, Reference, cosign};
use k8s_openapi::api::core::v1::{ConfigMap, Secret};
use kube::{Api, Client};
use pko_api::names::{checked_name, is_dns1123_label};
use pko_api::transform::{OciSource, ResolvedKeys, ResolvedSource};
use pko_plugin_host::PluginError;
use sha2::{Digest, Sha256};

/// Timeout of one https fetch.
const FETCH_TIMEOUT: Duration = Duration::from_secs(30);
/// Timeout of a whole OCI pull (manifest, signatures, layer).
const OCI_PULL_TIMEOUT: Duration = Duration::from_secs(60);

/// A Secret's or ConfigMap's namespace and name, checked before they go into a GET's path
/// (they come from a transform's spec; an older CRD without the patterns would pass them).
fn checked(namespace: &str, name: &str) -> Result<(), PluginError> {
    if !is_dns1123_label(namespace) {
        return Err(PluginError::Source(format!(
            "namespace {namespace:?} is not a DNS-1123 label"
        )));
    }
    checked_name("name", name).map_err(|e| PluginError::Source(e.to_string()))?;
    Ok(())
}

/// Fetches module bytes.
#[derive(Clone)]
pub struct ModuleFetcher {
    client: Option<Client>,
    file_root: Option<PathBuf>,
    http: Option<reqwest::Client>,
    egress: Arc<EgressPolicy>,
    max_bytes: u64,
    /// Offline: ConfigMaps by (namespace, name).
    config_maps: HashMap<(String, String), ConfigMap>,
    /// Offline: module files by `sha256:<hex>`, used whatever the source says.
    modules: HashMap<String, PathBuf>,
}

/// Failures building the fetcher.
#[derive(Debug, thiserror::Error)]
pub enum FetcherError {
    #[error("cannot read the plugin CA file {}: {source}", path.display())]
    CaFile {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("the plugin CA file {} holds no usable certificate: {source}", path.display())]
    CaCert {
        path: PathBuf,
        source: reqwest::Error,
    },
    #[error("cannot build the https client: {0}")]
    Http(#[source] reqwest::Error),
}

impl ModuleFetcher {
    /// `client`: for ConfigMap sources (none: refused). `file_root`: the only folder `file://`
    /// URLs may point into (none: refused). `ca_file`: extra PEM roots for https.
    pub fn new(
        client: Option<Client>,
        file_root: Option<PathBuf>,
        ca_file: Option<&Path>,
        max_bytes: u64,
        egress: Arc<EgressPolicy>,
    ) -> Result<Self, FetcherError> {
        // The URL is a tenant's (a ProgramTransform): only addresses the egress rules allow.
        let mut builder = egress
            .client_builder(5)
            .timeout(FETCH_TIMEOUT)
            .https_only(true);
        if let Some(path) = ca_file {
            let pem = std::fs::read(path).map_err(|source| FetcherError::CaFile {
                path: path.to_path_buf(),
                source,
            })?;
            for cert in reqwest::Certificate::from_pem_bundle(&pem).map_err(|source| {
                FetcherError::CaCert {
                    path: path.to_path_buf(),
                    source,
                }
            })? {
                builder = builder.add_root_certificate(cert);
            }
        }
        let http = builder.build().map_err(FetcherError::Http)?;
        Ok(Self {
            client,
            file_root: file_root.map(|root| root.canonicalize().unwrap_or(root)),
            http: Some(http),
            egress,
            max_bytes,
            config_maps: HashMap::new(),
            modules: HashMap::new(),
        })
    }

    /// A fetcher with no cluster and no network: `file://` sources under `file_root`,
    /// ConfigMaps from `config_maps`, and any module found in `modules` by digest.
    pub fn offline(
        file_root: Option<PathBuf>,
        max_bytes: u64,
        config_maps: Vec<ConfigMap>,
        modules: HashMap<String, PathBuf>,
    ) -> Self {
        Self {
            client: None,
            file_root,
            http: None,
            egress: Arc::new(EgressPolicy::default()),
            max_bytes,
            config_maps: config_maps
                .into_iter()
                .map(|cm| {
                    let key = (
                        cm.metadata
                            .namespace
                            .clone()
                            .unwrap_or_else(|| "default".into()),
                        cm.metadata.name.clone().unwrap_or_default(),
                    );
                    (key, cm)
                })
                .collect(),
            modules,
        }
    }

    /// The bytes of the module pinned to `sha256`, at most `max_bytes` of them.
    pub async fn fetch(
        &self,
        source: &ResolvedSource,
        sha256: &str,
    ) -> Result<Vec<u8>, PluginError> {
        if let Some(path) = self
            .modules
            .get(&pko_plugin_host::host::normalize_digest(sha256))
        {
            return tokio::fs::read(path)
                .await
                .map_err(|e| PluginError::Source(format!("{}: {e}", path.display())))
                .and_then(|bytes| self.bounded(bytes));
        }
        match source {
            ResolvedSource::ConfigMap {
                namespace,
                name,
                key,
            } => self.config_map(namespace, name, key).await,
            ResolvedSource::Url(url) => match url.strip_prefix("file://") {
                Some(path) => self.file(path).await,
                None => self.https(url, sha256).await,
            },
            ResolvedSource::Oci {
                artifact,
                verify,
                pull_secret,
            } => {
                self.oci(artifact, verify.as_ref(), pull_secret.as_ref())
                    .await
            }
        }
    }

    /// The module of an OCI artifact; with `verify`, only once a trusted key's signature of
    /// the manifest digest is found.
    async fn oci(
        &self,
        artifact: &OciSource,
        verify: Option<&ResolvedKeys>,
        pull_secret: Option<&(String, String)>,
    ) -> Result<Vec<u8>, PluginError> {
        let http = self.http.as_ref().ok_or_else(|| {
            PluginError::Source(
                "OCI modules are not pulled offline (put the module in the module folder)".into(),
            )
        })?;
        let reference = Reference::parse(&artifact.reference)?;
        let keys = match verify {
            Some(keys) => Some(self.keys(keys).await?),
            None => None,
        };
        let credentials = match pull_secret {
            Some((namespace, name)) => Some(self.credentials(namespace, name, &reference).await?),
            None => None,
        };
        let mut session =
            Session::new(http, Some(&self.egress), &reference).with_credentials(credentials);
        // Each request has its own timeout; this bounds the whole conversation (manifest,
        // signatures, layer, tokens) that a slow registry could otherwise stretch.
        let pulled = tokio::time::timeout(
            OCI_PULL_TIMEOUT,
            session.pull(&artifact.digest, keys.as_deref(), self.max_bytes),
        )
        .await
        .map_err(|_| {
            PluginError::Source(format!(
                "{reference}@{}: the pull took more than {}s",
                artifact.digest,
                OCI_PULL_TIMEOUT.as_secs()
            ))
        })??;
        if let Some(key) = &pulled.signed_by {
            tracing::info!(artifact = %reference, digest = %artifact.digest, key = %key, "cosign signature verified");
        }
        Ok(pulled.module)
    }

    /// One Secret, read by name (no list or watch).
    async fn secret(&self, namespace: &str, name: &str) -> Result<Secret, PluginError> {
        let client = self
            .client
            .as_ref()
            .ok_or_else(|| PluginError::Source("Secrets are not read offline".into()))?;
        checked(namespace, name)?;
        let api: Api<Secret> = Api::namespaced(client.clone(), namespace);
        api.get_opt(name)
            .await
            .map_err(|e| PluginError::Source(format!("Secret {namespace}/{name}: {e}")))?
            .ok_or_else(|| PluginError::Source(format!("Secret {namespace}/{name} not found")))
    }

    /// The registry credentials in a `kubernetes.io/dockerconfigjson` Secret.
    async fn credentials(
        &self,
        namespace: &str,
        name: &str,
        reference: &Reference,
    ) -> Result<Credentials, PluginError> {
        let secret = self.secret(namespace, name).await?;
        let config = secret
            .data
            .as_ref()
            .and_then(|d| d.get(".dockerconfigjson"))
            .map(|b| b.0.clone())
            .ok_or_else(|| {
                PluginError::Source(format!(
                    "Secret {namespace}/{name} has no .dockerconfigjson (make it with `kubectl create secret docker-registry`)"
                ))
            })?;
        docker_config_credentials(&config, &reference.registry)
            .map_err(|e| PluginError::Source(format!("Secret {namespace}/{name}: {e}")))?
            .ok_or_else(|| {
                PluginError::Source(format!(
                    "Secret {namespace}/{name} has no credentials for {}",
                    reference.registry
                ))
            })
    }

    /// The trusted public keys of a cosign check.
    async fn keys(&self, keys: &ResolvedKeys) -> Result<Vec<cosign::PublicKey>, PluginError> {
        let text = match keys {
            ResolvedKeys::Inline(pems) => pems.join("\n"),
            ResolvedKeys::Secret {
                namespace,
                name,
                key,
            } => {
                let secret = self.secret(namespace, name).await?;
                let bytes = secret
                    .data
                    .as_ref()
                    .and_then(|d| d.get(key))
                    .map(|b| b.0.clone())
                    .or_else(|| {
                        secret
                            .string_data
                            .as_ref()
                            .and_then(|d| d.get(key))
                            .map(|s| s.clone().into_bytes())
                    })
                    .ok_or_else(|| {
                        PluginError::Source(format!("Secret {namespace}/{name} has no key {key:?}"))
                    })?;
                String::from_utf8(bytes).map_err(|_| {
                    PluginError::Signature(format!(
                        "Secret {namespace}/{name} key {key:?} is not PEM text"
                    ))
                })?
            }
        };
        cosign::parse_keys(&text).map_err(|e: OciError| e.into())
    }

    async fn config_map(
        &self,
        namespace: &str,
        name: &str,
        key: &str,
    ) -> Result<Vec<u8>, PluginError> {
        checked(namespace, name)?;
        let cm = match &self.client {
            Some(client) => {
                let api: Api<ConfigMap> = Api::namespaced(client.clone(), namespace);
                api.get_opt(name).await.map_err(|e| {
                    PluginError::Source(format!("ConfigMap {namespace}/{name}: {e}"))
                })?
            }
            None => self
                .config_maps
                .get(&(namespace.to_owned(), name.to_owned()))
                .cloned(),
        }
        .ok_or_else(|| PluginError::Source(format!("ConfigMap {namespace}/{name} not found")))?;
        if let Some(bytes) = cm.binary_data.as_ref().and_then(|d| d.get(key)) {
            return self.bounded(bytes.0.clone());
        }
        if cm.data.as_ref().is_some_and(|d| d.contains_key(key)) {
            return Err(PluginError::Source(format!(
                "ConfigMap {namespace}/{name} has {key:?} under data, not binaryData (a module is binary: `kubectl create configmap --from-file` puts it under binaryData)"
            )));
        }
        Err(PluginError::Source(format!(
            "ConfigMap {namespace}/{name} has no key {key:?} in binaryData"
        )))
    }

    async fn file(&self, path: &str) -> Result<Vec<u8>, PluginError> {
        let root = self.file_root.as_ref().ok_or_else(|| {
            PluginError::Source(
                "file:// module URLs are disabled (start the operator with --plugin-file-root)"
                    .into(),
            )
        })?;
        let path = Path::new(path);
        // Checked lexically and again after resolving links: no way out of the root.
        if !path.is_absolute() || path.components().any(|c| matches!(c, Component::ParentDir)) {
            return Err(PluginError::Source(format!(
                "file:// URL {} must be an absolute path without ..",
                path.display()
            )));
        }
        let resolved = tokio::fs::canonicalize(path)
            .await
            .map_err(|e| PluginError::Source(format!("{}: {e}", path.display())))?;
        if !resolved.starts_with(root) {
            return Err(PluginError::Source(format!(
                "{} is outside the plugin folder {}",
                path.display(),
                root.display()
            )));
        }
        let meta = tokio::fs::metadata(&resolved)
            .await
            .map_err(|e| PluginError::Source(format!("{}: {e}", path.display())))?;
        if meta.len() > self.max_bytes {
            return Err(PluginError::ModuleTooLarge {
                size: meta.len(),
                limit: self.max_bytes,
            });
        }
        tokio::fs::read(&resolved)
            .await
            .map_err(|e| PluginError::Source(format!("{}: {e}", path.display())))
    }

    /// The module at an https `url`, hashed as it arrives: bytes that are not the pinned
    /// module are refused before anything else reads them.
    async fn https(&self, url: &str, sha256: &str) -> Result<Vec<u8>, PluginError> {
        let http = self.http.as_ref().ok_or_else(|| {
            PluginError::Source("https module URLs are not fetched offline".into())
        })?;
        let parsed = reqwest::Url::parse(url)
            .map_err(|e| PluginError::Source(format!("{url}: not a URL: {e}")))?;
        // The URL is a tenant's and the message reaches its transform's status: the class of
        // a failure only, the detail in the operator's log.
        let failed = |failure: Failure| PluginError::Source(format!("{url}: {failure}"));
        if let Err(refused) = self.egress.check_url(&parsed) {
            return Err(failed(Failure::Refused(refused)));
        }
        let request_err = |e: reqwest::Error| {
            let failure = crate::egress::classify(&e);
            tracing::info!(url, %failure, detail = crate::egress::describe(&e), "module fetch failed");
            failed(failure)
        };
        let response = http
            .get(parsed)
            .send()
            .await
            .and_then(reqwest::Response::error_for_status)
            .map_err(request_err)?;
        if let Some(len) = response.content_length()
            && len > self.max_bytes
        {
            return Err(PluginError::ModuleTooLarge {
                size: len,
                limit: self.max_bytes,
            });
        }
        // Streamed with a running total: a missing or lying Content-Length cannot make us
        // buffer more than the limit.
        let mut body = Vec::new();
        let mut hash = Sha256::new();
        let mut response = response;
        while let Some(chunk) = response.chunk().await.map_err(request_err)? {
            hash.update(&chunk);
            body.extend_from_slice(&chunk);
            if body.len() as u64 > self.max_bytes {
                return Err(PluginError::ModuleTooLarge {
                    size: body.len() as u64,
                    limit: self.max_bytes,
                });
            }
        }
        let actual = format!("sha256:{}", hex::encode(hash.finalize()));
        let expected = pko_plugin_host::host::normalize_digest(sha256);
        if actual != expected {
            return Err(PluginError::DigestMismatch { expected, actual });
        }
        Ok(body)
    }

    fn bounded(&self, bytes: Vec<u8>) -> Result<Vec<u8>, PluginError> {
        if bytes.len() as u64 > self.max_bytes {
            return Err(PluginError::ModuleTooLarge {
                size: bytes.len() as u64,
                limit: self.max_bytes,
            });
        }
        Ok(bytes)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn file_urls_stay_under_the_root() {
        let root = tempfile::tempdir().expect("tempdir");
        let inside = root.path().join("a.wasm");
        std::fs::write(&inside, b"module").expect("write");
        let outside = tempfile::NamedTempFile::new().expect("tmp");
        let offline = |root: Option<PathBuf>, max| {
            ModuleFetcher::offline(root, max, Vec::new(), HashMap::new())
        };
        let fetcher = offline(Some(root.path().canonicalize().expect("root")), 100);
        let url = |p: &Path| ResolvedSource::Url(format!("file://{}", p.display()));
        let sha = "0".repeat(64);
        assert_eq!(
            fetcher.fetch(&url(&inside), &sha).await.expect("inside"),
            b"module"
        );
        let err = fetcher
            .fetch(&url(outside.path()), &sha)
            .await
            .expect_err("outside");
        assert!(
            err.to_string().contains("outside the plugin folder"),
            "{err}"
        );
        let sneaky = root.path().join("../x.wasm");
        let err = fetcher
            .fetch(&url(&sneaky), &sha)
            .await
            .expect_err("dotdot");
        assert!(err.to_string().contains("without .."), "{err}");
        let link = root.path().join("link.wasm");
        std::os::unix::fs::symlink(outside.path(), &link).expect("symlink");
        let err = fetcher
            .fetch(&url(&link), &sha)
            .await
            .expect_err("symlink out");
        assert!(
            err.to_string().contains("outside the plugin folder"),
            "{err}"
        );

        let small = offline(Some(root.path().canonicalize().expect("root")), 3);
        let err = small
            .fetch(&url(&inside), &sha)
            .await
            .expect_err("too large");
        assert!(
            matches!(err, PluginError::ModuleTooLarge { size: 6, limit: 3 }),
            "{err}"
        );

        let disabled = offline(None, 100);
        let err = disabled
            .fetch(&url(&inside), &sha)
            .await
            .expect_err("disabled");
        assert!(err.to_string().contains("--plugin-file-root"), "{err}");
        let err = disabled
            .fetch(
                &ResolvedSource::Url("https://example.invalid/a.wasm".into()),
                &sha,
            )
            .await
            .expect_err("offline https");
        assert!(err.to_string().contains("offline"), "{err}");

        // A module folder answers by digest, whatever the source says.
        let by_digest = ModuleFetcher::offline(
            None,
            100,
            Vec::new(),
            HashMap::from([(format!("sha256:{sha}"), inside.clone())]),
        );
        let bytes = by_digest
            .fetch(
                &ResolvedSource::Url("https://example.invalid/a.wasm".into()),
                &sha,
            )
            .await
            .expect("by digest");
        assert_eq!(bytes, b"module");
    }
}
