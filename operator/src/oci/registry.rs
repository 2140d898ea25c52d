//! The registry side of the distribution API: manifests and blobs by digest, the anonymous
//! bearer-token challenge, and monolithic pushes. Every body read is bounded and every
//! digest checked, whatever the registry says.

use reqwest::header::{ACCEPT, CONTENT_TYPE, HeaderValue, LOCATION, WWW_AUTHENTICATE};
use reqwest::{Method, StatusCode};
use serde::{Deserialize, Serialize};

use super::cosign::{self, PublicKey};
use super::{
    CONFIG_TYPES, LEGACY_LAYER_TYPE, MANIFEST_TYPE, OciError, Reference, WASM_CONFIG_TYPE,
    WASM_LAYER_TYPE, sha256_digest,
};
use crate::egress::{EgressPolicy, Failure};

/// Largest manifest read (the distribution spec's suggested limit is 4 MiB; ours are tiny).
const MAX_MANIFEST_BYTES: u64 = 256 << 10;
/// Largest cosign payload read.
const MAX_PAYLOAD_BYTES: u64 = 64 << 10;
/// Largest token answer read.
const MAX_TOKEN_BYTES: u64 = 64 << 10;
/// Signature layers looked at, at most.
const MAX_SIGNATURES: usize = 16;

/// A content descriptor.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct Descriptor {
    pub media_type: String,
    pub digest: String,
    pub size: u64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub annotations: Option<std::collections::BTreeMap<String, String>>,
}

/// An image manifest (the fields read or written here).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct Manifest {
    pub schema_version: u32,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub media_type: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub artifact_type: Option<String>,
    pub config: Descriptor,
    pub layers: Vec<Descriptor>,
}

/// A module pulled and checked.
#[derive(Debug)]
pub struct Pulled {
    pub module: Vec<u8>,
    /// `sha256:<hex>` of the module bytes.
    pub module_digest: String,
    /// The fingerprint of the key whose signature was accepted, when keys were given.
    pub signed_by: Option<String>,
}

/// What a push wrote.
#[derive(Debug)]
pub struct Pushed {
    pub manifest_digest: String,
    pub module_digest: String,
}

/// A user name and password for a registry.
#[derive(Clone)]
pub struct Credentials {
    pub username: String,
    pub password: String,
}

impl std::fmt::Debug for Credentials {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Never the password, not even in a debug line.
        write!(f, "Credentials({})", self.username)
    }
}

/// What the requests of a session carry, once the registry asked for it.
enum Authorization {
    None,
    Basic,
    Bearer(String),
}

/// One conversation with one repository (a bearer token, once obtained, is reused).
pub struct Session<'a> {
    http: &'a reqwest::Client,
    egress: Option<&'a EgressPolicy>,
    reference: &'a Reference,
    credentials: Option<Credentials>,
    authorization: Authorization,
}

impl<'a> Session<'a> {
    /// `egress`: the rules every address must pass (none for the CLI, run by a person).
    pub fn new(
        http: &'a reqwest::Client,
        egress: Option<&'a EgressPolicy>,
        reference: &'a Reference,
    ) -> Self {
        Self {
            http,
            egress,
            reference,
            credentials: None,
            authorization: Authorization::None,
        }
    }

    /// Sends `credentials` where the registry asks for them (basic auth, or to get a token).
    pub fn with_credentials(mut self, credentials: Option<Credentials>) -> Self {
        self.credentials = credentials;
        self
    }

    /// The module of the artifact `digest`, checked: the manifest's digest, its Wasm layout,
    /// the layer's digest and size, and (with `keys`) a cosign signature by one of them.
    pub async fn pull(
        &mut self,
        digest: &str,
        keys: Option<&[PublicKey]>,
        max_module_bytes: u64,
    ) -> Result<Pulled, OciError> {
        let (manifest, _) = self.manifest(digest).await?;
        let manifest = manifest.ok_or_else(|| OciError::Status {
            url: self.reference.url("manifests", digest),
            status: 404,
        })?;
        let layer = wasm_layer(&manifest)?;
        if layer.size > max_module_bytes {
            return Err(OciError::TooLarge {
                what: format!("the module layer ({} bytes)", layer.size),
                limit: max_module_bytes,
            });
        }
        // Signatures first: nothing of an unsigned artifact but its manifest is downloaded.
        let signed_by = match keys {
            Some(keys) => Some(self.verify(digest, keys).await?),
            None => None,
        };
        let module = self
            .blob(
                &layer.digest,
                layer.size.min(max_module_bytes),
                "the module layer",
            )
            .await?;
        Ok(Pulled {
            module,
            module_digest: layer.digest,
            signed_by,
        })
    }

    /// The fingerprint of a trusted key that signed `digest`.
    async fn verify(&mut self, digest: &str, keys: &[PublicKey]) -> Result<String, OciError> {
        let tag = format!("{}.sig", digest.replacen(':', "-", 1));
        let (signatures, _) = self.manifest(&tag).await?;
        let signatures = signatures.ok_or_else(|| {
            OciError::Unsigned(format!(
                "{} has no signature manifest {tag} (sign it with `cosign sign --key`)",
                self.reference.name()
            ))
        })?;
        let mut problems = Vec::new();
        let candidates = signatures
            .layers
            .iter()
            .filter(|l| l.media_type == cosign::PAYLOAD_TYPE)
            .take(MAX_SIGNATURES);
        for layer in candidates {
            let Some(signature) = layer
                .annotations
                .as_ref()
                .and_then(|a| a.get(cosign::SIGNATURE_ANNOTATION))
            else {
                continue;
            };
            if layer.size > MAX_PAYLOAD_BYTES {
                problems.push(format!("payload {} is too large", layer.digest));
                continue;
            }
            let payload = self
                .blob(&layer.digest, layer.size, "a signature payload")
                .await?;
            let Some(key) = cosign::signer(&payload, signature, keys) else {
                continue;
            };
            match cosign::check_payload(&payload, digest) {
                Ok(()) => return Ok(key.fingerprint.clone()),
                Err(e) => problems.push(e.to_string()),
            }
        }
        let mut message = format!(
            "no signature in {tag} verifies with the {} trusted key(s)",
            keys.len()
        );
        for p in problems {
            message.push_str("; ");
            message.push_str(&p);
        }
        Err(OciError::Signature(message))
    }

    /// The manifest at `what` (a digest or a tag) and its digest; `None` when there is none.
    /// A manifest asked for by digest must hash to it.
    pub async fn manifest(&mut self, what: &str) -> Result<(Option<Manifest>, String), OciError> {
        let url = self.reference.url("manifests", what);
        let accept = HeaderValue::from_static(
            "application/vnd.oci.image.manifest.v1+json, application/vnd.docker.distribution.manifest.v2+json",
        );
        let response = self
            .send(Method::GET, &url, |r| r.header(ACCEPT, accept.clone()))
            .await?;
        if response.status() == StatusCode::NOT_FOUND {
            return Ok((None, String::new()));
        }
        let body =
            read_bounded(ok(response, &url)?, MAX_MANIFEST_BYTES, "a manifest", &url).await?;
        let actual = sha256_digest(&body);
        if super::is_digest(what) && actual != what {
            return Err(OciError::Digest {
                what: format!("manifest {}", self.reference.name()),
                expected: what.to_owned(),
                actual,
            });
        }
        let manifest: Manifest = serde_json::from_slice(&body).map_err(|e| {
            OciError::NotWasm(format!(
                "the manifest at {url} is not an image manifest: {e}"
            ))
        })?;
        Ok((Some(manifest), actual))
    }

    /// The blob `digest`, at most `limit` bytes, checked against its digest.
    async fn blob(&mut self, digest: &str, limit: u64, what: &str) -> Result<Vec<u8>, OciError> {
        if !super::is_digest(digest) {
            return Err(OciError::NotWasm(format!(
                "{what} has an unsupported digest {digest:?}"
            )));
        }
        let url = self.reference.url("blobs", digest);
        let response = self.send(Method::GET, &url, |r| r).await?;
        let body = read_bounded(ok(response, &url)?, limit, what, &url).await?;
        let actual = sha256_digest(&body);
        if actual != digest {
            return Err(OciError::Digest {
                what: what.to_owned(),
                expected: digest.to_owned(),
                actual,
            });
        }
        Ok(body)
    }

    /// Pushes `module` as a Wasm artifact, tagged with the reference's tag (if any).
    pub async fn push(&mut self, module: &[u8]) -> Result<Pushed, OciError> {
        let module_digest = sha256_digest(module);
        let config = serde_json::to_vec(&serde_json::json!({
            "architecture": "wasm",
            "layerDigests": [module_digest],
            "os": "wasip2",
        }))
        .map_err(|e| OciError::NotWasm(e.to_string()))?;
        let manifest = Manifest {
            schema_version: 2,
            media_type: Some(MANIFEST_TYPE.into()),
            artifact_type: Some(WASM_LAYER_TYPE.into()),
            config: Descriptor {
                media_type: WASM_CONFIG_TYPE.into(),
                digest: sha256_digest(&config),
                size: config.len() as u64,
                annotations: None,
            },
            layers: vec![Descriptor {
                media_type: WASM_LAYER_TYPE.into(),
                digest: module_digest.clone(),
                size: module.len() as u64,
                annotations: None,
            }],
        };
        self.push_blob(module).await?;
        self.push_blob(&config).await?;
        let bytes = serde_json::to_vec(&manifest).map_err(|e| OciError::NotWasm(e.to_string()))?;
        let manifest_digest = sha256_digest(&bytes);
        let target = self
            .reference
            .tag
            .clone()
            .unwrap_or_else(|| manifest_digest.clone());
        self.push_manifest(&target, &bytes).await?;
        Ok(Pushed {
            manifest_digest,
            module_digest,
        })
    }

    /// Uploads one blob (monolithic: one POST, one PUT).
    pub async fn push_blob(&mut self, bytes: &[u8]) -> Result<String, OciError> {
        let digest = sha256_digest(bytes);
        let start = self.reference.url("blobs", "uploads/");
        let response = self.send(Method::POST, &start, |r| r).await?;
        let response = ok(response, &start)?;
        let location = response
            .headers()
            .get(LOCATION)
            .and_then(|v| v.to_str().ok())
            .ok_or_else(|| OciError::Unreachable {
                url: start.clone(),
                reason: "the upload answer has no Location".into(),
            })?;
        let mut url = reqwest::Url::parse(&start)
            .and_then(|base| base.join(location))
            .map_err(|e| OciError::Unreachable {
                url: start.clone(),
                reason: format!("bad upload Location {location:?}: {e}"),
            })?;
        url.query_pairs_mut().append_pair("digest", &digest);
        let url = url.to_string();
        let body = bytes.to_vec();
        let response = self
            .send(Method::PUT, &url, |r| {
                r.header(CONTENT_TYPE, "application/octet-stream")
                    .body(body.clone())
            })
            .await?;
        ok(response, &url)?;
        Ok(digest)
    }

    /// Puts a manifest at `target` (a tag or its digest).
    pub async fn push_manifest(&mut self, target: &str, bytes: &[u8]) -> Result<(), OciError> {
        let url = self.reference.url("manifests", target);
        let body = bytes.to_vec();
        let response = self
            .send(Method::PUT, &url, |r| {
                r.header(CONTENT_TYPE, MANIFEST_TYPE).body(body.clone())
            })
            .await?;
        ok(response, &url)?;
        Ok(())
    }

    /// Sends a request; on a bearer challenge, gets an anonymous token once and sends again.
    async fn send(
        &mut self,
        method: Method,
        url: &str,
        build: impl Fn(reqwest::RequestBuilder) -> reqwest::RequestBuilder,
    ) -> Result<reqwest::Response, OciError> {
        for attempt in 0..2 {
            let mut request = build(self.http.request(method.clone(), url));
            request = match (&self.authorization, &self.credentials) {
                (Authorization::Bearer(token), _) => request.bearer_auth(token),
                (Authorization::Basic, Some(c)) => {
                    request.basic_auth(&c.username, Some(&c.password))
                }
                _ => request,
            };
            let response = self.checked(request, url).await?;
            if response.status() != StatusCode::UNAUTHORIZED {
                return Ok(response);
            }
            if attempt == 1 {
                return Err(OciError::Auth(format!(
                    "{url}: the registry refused {}",
                    match &self.credentials {
                        Some(c) => format!("the credentials of {:?}", c.username),
                        None => "an anonymous token".to_owned(),
                    }
                )));
            }
            let challenge = response
                .headers()
                .get(WWW_AUTHENTICATE)
                .and_then(|v| v.to_str().ok())
                .map(str::to_owned)
                .ok_or_else(|| OciError::Auth(format!("{url}: 401 without a challenge")))?;
            self.authorization = if challenge.trim_start().starts_with("Basic") {
                if self.credentials.is_none() {
                    return Err(OciError::Auth(format!(
                        "{url}: the registry wants credentials (set source.oci.pullSecretRef)"
                    )));
                }
                Authorization::Basic
            } else {
                Authorization::Bearer(self.token_for(&challenge).await?)
            };
        }
        Err(OciError::Auth(format!("{url}: unauthorized")))
    }

    async fn checked(
        &self,
        request: reqwest::RequestBuilder,
        url: &str,
    ) -> Result<reqwest::Response, OciError> {
        if let Some(egress) = self.egress {
            let parsed = reqwest::Url::parse(url).map_err(|e| OciError::Unreachable {
                url: url.to_owned(),
                reason: e.to_string(),
            })?;
            egress
                .check_url(&parsed)
                .map_err(|refused| OciError::Request {
                    url: url.to_owned(),
                    failure: Failure::Refused(refused),
                    detail: format!("refused: {refused}"),
                })?;
        }
        request.send().await.map_err(|e| request_error(url, &e))
    }

    /// An anonymous pull token from a `Bearer realm=…,service=…,scope=…` challenge.
    async fn token_for(&self, challenge: &str) -> Result<String, OciError> {
        let params = bearer_params(challenge)
            .ok_or_else(|| OciError::Auth(format!("unsupported challenge {challenge:?}")))?;
        let realm = params
            .iter()
            .find(|(k, _)| k == "realm")
            .map(|(_, v)| v.clone())
            .ok_or_else(|| OciError::Auth("the challenge has no realm".into()))?;
        let mut url = reqwest::Url::parse(&realm)
            .map_err(|e| OciError::Auth(format!("realm {realm:?}: {e}")))?;
        if url.scheme() != "https" {
            return Err(OciError::Auth(format!("realm {realm:?} is not https")));
        }
        for (k, v) in params
            .iter()
            .filter(|(k, _)| k == "service" || k == "scope")
        {
            url.query_pairs_mut().append_pair(k, v);
        }
        let text = url.to_string();
        let mut request = self.http.get(url);
        if let Some(c) = &self.credentials {
            request = request.basic_auth(&c.username, Some(&c.password));
        }
        let response = self.checked(request, &text).await?;
        let body = read_bounded(ok(response, &text)?, MAX_TOKEN_BYTES, "a token", &text).await?;
        #[derive(Deserialize)]
        struct Token {
            token: Option<String>,
            access_token: Option<String>,
        }
        let token: Token = serde_json::from_slice(&body)
            .map_err(|e| OciError::Auth(format!("{text}: not a token answer: {e}")))?;
        token
            .token
            .or(token.access_token)
            .filter(|t| !t.is_empty())
            .ok_or_else(|| OciError::Auth(format!("{text}: no token in the answer")))
    }
}

/// The credentials for `registry` in a `.dockerconfigjson` document (`auths` keyed by host,
/// with or without a scheme or path, each with `auth` = base64 `user:password` or
/// `username` and `password`).
pub fn docker_config_credentials(
    config: &[u8],
    registry: &str,
) -> Result<Option<Credentials>, OciError> {
    use base64::Engine;
    #[derive(Deserialize)]
    struct Config {
        #[serde(default)]
        auths: std::collections::BTreeMap<String, Entry>,
    }
    #[derive(Deserialize)]
    struct Entry {
        auth: Option<String>,
        username: Option<String>,
        password: Option<String>,
    }
    let config: Config = serde_json::from_slice(config)
        .map_err(|e| OciError::Auth(format!("not a .dockerconfigjson document: {e}")))?;
    let host_of = |key: &str| {
        let key = key.trim();
        let key = key
            .strip_prefix("https://")
            .or_else(|| key.strip_prefix("http://"))
            .unwrap_or(key);
        key.split('/')
            .next()
            .unwrap_or_default()
            .to_ascii_lowercase()
    };
    let Some(entry) = config
        .auths
        .iter()
        .find(|(key, _)| host_of(key) == registry)
        .map(|(_, e)| e)
    else {
        return Ok(None);
    };
    if let (Some(username), Some(password)) = (&entry.username, &entry.password) {
        return Ok(Some(Credentials {
            username: username.clone(),
            password: password.clone(),
        }));
    }
    let auth = entry
        .auth
        .as_deref()
        .ok_or_else(|| OciError::Auth(format!("the entry for {registry} has no auth")))?;
    let decoded = base64::engine::general_purpose::STANDARD
        .decode(auth.trim())
        .ok()
        .and_then(|b| String::from_utf8(b).ok())
        .ok_or_else(|| OciError::Auth(format!("the auth of {registry} is not base64 text")))?;
    let (username, password) = decoded
        .split_once(':')
        .ok_or_else(|| OciError::Auth(format!("the auth of {registry} is not user:password")))?;
    Ok(Some(Credentials {
        username: username.to_owned(),
        password: password.to_owned(),
    }))
}

/// The single Wasm layer of an artifact manifest.
pub fn wasm_layer(manifest: &Manifest) -> Result<Descriptor, OciError> {
    if !CONFIG_TYPES.contains(&manifest.config.media_type.as_str()) {
        return Err(OciError::NotWasm(format!(
            "config media type {:?}, expected {WASM_CONFIG_TYPE}",
            manifest.config.media_type
        )));
    }
    match manifest.layers.as_slice() {
        [layer] if [WASM_LAYER_TYPE, LEGACY_LAYER_TYPE].contains(&layer.media_type.as_str()) => {
            Ok(layer.clone())
        }
        [layer] => Err(OciError::NotWasm(format!(
            "layer media type {:?}, expected {WASM_LAYER_TYPE}",
            layer.media_type
        ))),
        layers => Err(OciError::NotWasm(format!(
            "{} layers, expected exactly one {WASM_LAYER_TYPE} layer",
            layers.len()
        ))),
    }
}

/// `key="value"` pairs of a Bearer challenge.
fn bearer_params(challenge: &str) -> Option<Vec<(String, String)>> {
    let rest = challenge.trim().strip_prefix("Bearer ")?;
    let mut params = Vec::new();
    let mut rest = rest.trim();
    while !rest.is_empty() {
        let (key, after) = rest.split_once('=')?;
        let after = after.strip_prefix('"')?;
        let end = after.find('"')?;
        params.push((key.trim().to_owned(), after[..end].to_owned()));
        rest = after[end + 1..].trim_start_matches([',', ' ']);
    }
    Some(params)
}

/// A failed request: its class, and the client's words (for the CLI and the operator's log).
fn request_error(url: &str, err: &reqwest::Error) -> OciError {
    OciError::Request {
        url: url.to_owned(),
        failure: crate::egress::classify(err),
        detail: crate::egress::describe(err),
    }
}

fn ok(response: reqwest::Response, url: &str) -> Result<reqwest::Response, OciError> {
    if response.status().is_success() {
        Ok(response)
    } else {
        Err(OciError::Status {
            url: url.to_owned(),
            status: response.status().as_u16(),
        })
    }
}

/// The body, refused as soon as it passes `limit` (a missing or lying Content-Length cannot
/// make us buffer more).
async fn read_bounded(
    mut response: reqwest::Response,
    limit: u64,
    what: &str,
    url: &str,
) -> Result<Vec<u8>, OciError> {
    let too_large = || OciError::TooLarge {
        what: format!("{what} at {url}"),
        limit,
    };
    if response.content_length().is_some_and(|len| len > limit) {
        return Err(too_large());
    }
    let mut body = Vec::new();
    while let Some(chunk) = response.chunk().await.map_err(|e| request_error(url, &e))? {
        body.extend_from_slice(&chunk);
        if body.len() as u64 > limit {
            return Err(too_large());
        }
    }
    Ok(body)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn manifest(config: &str, layers: &[&str]) -> Manifest {
        let d = |t: &str| Descriptor {
            media_type: t.into(),
            digest: format!("sha256:{}", "0".repeat(64)),
            size: 1,
            annotations: None,
        };
        Manifest {
            schema_version: 2,
            media_type: Some(MANIFEST_TYPE.into()),
            artifact_type: None,
            config: d(config),
            layers: layers.iter().map(|t| d(t)).collect(),
        }
    }

    #[test]
    fn only_single_layer_wasm_artifacts_are_modules() {
        assert!(wasm_layer(&manifest(WASM_CONFIG_TYPE, &[WASM_LAYER_TYPE])).is_ok());
        assert!(wasm_layer(&manifest(WASM_CONFIG_TYPE, &[LEGACY_LAYER_TYPE])).is_ok());
        let image = manifest(
            "application/vnd.oci.image.config.v1+json",
            &["application/vnd.oci.image.layer.v1.tar+gzip"],
        );
        assert!(
            wasm_layer(&image)
                .unwrap_err()
                .to_string()
                .contains("config media type")
        );
        let two = manifest(WASM_CONFIG_TYPE, &[WASM_LAYER_TYPE, WASM_LAYER_TYPE]);
        assert!(
            wasm_layer(&two)
                .unwrap_err()
                .to_string()
                .contains("2 layers")
        );
        let none = manifest(WASM_CONFIG_TYPE, &[]);
        assert!(wasm_layer(&none).is_err());
    }

    #[test]
    fn docker_configs_give_the_registry_s_credentials() {
        let config = br#"{"auths": {
            "https://Registry.Example.com:5000/v1/": {"auth": "dXNlcjpwYTpzcw=="},
            "other.example": {"username": "u2", "password": "p2"}
        }}"#;
        let c = docker_config_credentials(config, "registry.example.com:5000")
            .expect("parses")
            .expect("found");
        assert_eq!(
            (c.username.as_str(), c.password.as_str()),
            ("user", "pa:ss")
        );
        let c = docker_config_credentials(config, "other.example")
            .expect("parses")
            .expect("found");
        assert_eq!((c.username.as_str(), c.password.as_str()), ("u2", "p2"));
        assert!(
            docker_config_credentials(config, "registry.example.com")
                .expect("parses")
                .is_none()
        );
        assert!(docker_config_credentials(b"not json", "x").is_err());
        assert!(docker_config_credentials(br#"{"auths": ["x"]}"#, "x").is_err());
        assert!(docker_config_credentials(br#"{"auths": {"x": {"auth": "!!"}}}"#, "x").is_err());
        assert!(!format!("{c:?}").contains("p2"));
    }

    #[test]
    fn bearer_challenges_are_parsed() {
        let p = bearer_params(
            r#"Bearer realm="https://auth.example/token",service="registry.example",scope="repository:a/b:pull""#,
        )
        .expect("parsed");
        assert_eq!(
            p,
            [
                ("realm".to_owned(), "https://auth.example/token".to_owned()),
                ("service".to_owned(), "registry.example".to_owned()),
                ("scope".to_owned(), "repository:a/b:pull".to_owned()),
            ]
        );
        assert!(bearer_params(r#"Basic realm="x""#).is_none());
        assert!(bearer_params(r#"Bearer realm="unterminated"#).is_none());
    }
}
