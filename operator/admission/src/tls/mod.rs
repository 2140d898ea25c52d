//! The webhook's TLS, managed by the operator: a self-signed CA and a serving certificate
//! (rcgen), kept in a Secret of the operator's namespace, with the CA bundle patched into the
//! operator's own webhook configurations.
//!
//! Every replica runs the same loop: read the Secret, and if it is missing, unparsable, about
//! to expire or lacks a required host name, issue what is needed and write it back with
//! optimistic concurrency (a replica that loses the race adopts the winner's certificate).
//! The serving certificate is renewed `renew_before` its expiry with the same CA, so the
//! apiserver keeps trusting it; the CA is renewed a year before its own expiry and the old one
//! stays in the bundle until it expires, so no replica serves a certificate the apiserver does
//! not trust. A new certificate is swapped into the listener without a restart.
//!
//! With cert-manager (or any other issuer), point `--webhook-cert-dir` at the mounted Secret:
//! [`CertFiles`] reloads it when it changes, and caBundle injection is left to the issuer.

use std::net::IpAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use axum_server::tls_rustls::RustlsConfig;
use k8s_openapi::ByteString;
use k8s_openapi::api::admissionregistration::v1::{
    MutatingWebhookConfiguration, ValidatingWebhookConfiguration,
};
use k8s_openapi::api::core::v1::Secret;
use kube::api::{Api, ObjectMeta, PostParams};
use kube::{Client, Resource};
use rcgen::{
    BasicConstraints, CertificateParams, DistinguishedName, DnType, ExtendedKeyUsagePurpose, IsCa,
    Issuer, KeyPair, KeyUsagePurpose,
};
use rustls::ServerConfig;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use serde::de::DeserializeOwned;
use tracing::{debug, info, warn};

use crate::metrics::AdmissionMetrics;

const TLS_CRT: &str = "tls.crt";
const TLS_KEY: &str = "tls.key";
const CA_CRT: &str = "ca.crt";
const CA_KEY: &str = "ca.key";
/// Attempts of the read-issue-write cycle when replicas race on the Secret.
const WRITE_ATTEMPTS: usize = 5;
/// A CA outlives the serving certificates it signs by at least this much.
const CA_RENEW_BEFORE: Duration = Duration::from_secs(365 * 24 * 3600);

/// Errors of certificate management.
#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    #[error("cannot generate certificates: {0}")]
    Generate(#[from] rcgen::Error),
    #[error("invalid certificate or key: {0}")]
    Pem(String),
    #[error("cannot build the TLS configuration: {0}")]
    Rustls(#[from] rustls::Error),
    #[error("{context}: {source}")]
    Kube {
        context: String,
        #[source]
        source: kube::Error,
    },
    #[error("cannot read {}: {source}", path.display())]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("the certificate Secret kept changing under us ({0} attempts)")]
    Contended(usize),
}

fn kube_err(context: impl Into<String>) -> impl FnOnce(kube::Error) -> TlsError {
    let context = context.into();
    move |source| TlsError::Kube { context, source }
}

/// A serving certificate, its key and the CA bundle that verifies it.
#[derive(Clone, PartialEq, Eq)]
pub struct CertBundle {
    pub cert_pem: String,
    pub key_pem: String,
    /// Every CA still trusted: the current one first, then older ones until they expire.
    pub ca_pem: String,
    /// Key of the current CA (absent when certificates come from files).
    pub ca_key_pem: Option<String>,
}

impl std::fmt::Debug for CertBundle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Never print keys.
        f.debug_struct("CertBundle")
            .field("not_after", &not_after(&self.cert_pem).ok())
            .finish_non_exhaustive()
    }
}

impl CertBundle {
    /// A rustls server configuration (ring provider, HTTP/2 and HTTP/1.1) for this bundle.
    pub fn server_config(&self) -> Result<Arc<ServerConfig>, TlsError> {
        let certs = CertificateDer::pem_slice_iter(self.cert_pem.as_bytes())
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| TlsError::Pem(format!("serving certificate: {e}")))?;
        let key = PrivateKeyDer::from_pem_slice(self.key_pem.as_bytes())
            .map_err(|e| TlsError::Pem(format!("serving key: {e}")))?;
        let mut config =
            ServerConfig::builder_with_provider(Arc::new(rustls::crypto::ring::default_provider()))
                .with_safe_default_protocol_versions()?
                .with_no_client_auth()
                .with_single_cert(certs, key)?;
        config.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
        Ok(Arc::new(config))
    }

    /// Unix time at which the serving certificate expires.
    pub fn not_after(&self) -> Result<i64, TlsError> {
        not_after(&self.cert_pem)
    }
}

/// What the managed certificates must look like.
#[derive(Clone, Debug)]
pub struct CertSettings {
    /// Namespace and name of the Secret holding the certificates.
    pub namespace: String,
    pub secret_name: String,
    /// Host names and IP addresses the serving certificate must cover, e.g.
    /// `pko-rs-webhook.pko-rs-system.svc`.
    pub hosts: Vec<String>,
    /// ValidatingWebhookConfigurations whose webhooks get the CA bundle.
    pub validating_configurations: Vec<String>,
    /// MutatingWebhookConfigurations whose webhooks get the CA bundle.
    pub mutating_configurations: Vec<String>,
    pub serving_validity: Duration,
    /// Renew the serving certificate this long before it expires.
    pub renew_before: Duration,
    pub ca_validity: Duration,
    /// How often the Secret and the webhook configurations are checked.
    pub check_interval: Duration,
}

impl CertSettings {
    /// Defaults: serving certificates for 90 days renewed 30 days early, a 5-year CA, checks
    /// every minute.
    pub fn new(namespace: String, secret_name: String, hosts: Vec<String>) -> Self {
        Self {
            namespace,
            secret_name,
            hosts,
            validating_configurations: Vec::new(),
            mutating_configurations: Vec::new(),
            serving_validity: Duration::from_secs(90 * 24 * 3600),
            renew_before: Duration::from_secs(30 * 24 * 3600),
            ca_validity: Duration::from_secs(5 * 365 * 24 * 3600),
            check_interval: Duration::from_secs(60),
        }
    }
}

/// What a bundle needs, judged at a point in time.
#[derive(Debug, PartialEq, Eq)]
pub enum Assessment {
    /// Good as it is.
    Valid,
    /// The CA is fine; the serving certificate must be (re)issued, for the given reason.
    RenewServing(String),
    /// A new CA is needed (and so a new serving certificate).
    RenewCa(String),
}

fn unix_now() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| i64::try_from(d.as_secs()).unwrap_or(i64::MAX))
        .unwrap_or(0)
}

fn secs(d: Duration) -> i64 {
    i64::try_from(d.as_secs()).unwrap_or(i64::MAX)
}

fn parse_pem_certs(pem: &str) -> Result<Vec<x509_parser::pem::Pem>, TlsError> {
    let blocks = x509_parser::pem::Pem::iter_from_buffer(pem.as_bytes())
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| TlsError::Pem(e.to_string()))?;
    if blocks.is_empty() {
        return Err(TlsError::Pem("no PEM certificate".into()));
    }
    Ok(blocks)
}

/// Unix expiry time of the first certificate of `pem`.
pub fn not_after(pem: &str) -> Result<i64, TlsError> {
    let blocks = parse_pem_certs(pem)?;
    let cert = blocks[0]
        .parse_x509()
        .map_err(|e| TlsError::Pem(e.to_string()))?;
    Ok(cert.validity().not_after.timestamp())
}

/// Judges `bundle` against `settings` at `now` (unix seconds).
pub fn assess(bundle: &CertBundle, settings: &CertSettings, now: i64) -> Assessment {
    let Some(ca_key) = &bundle.ca_key_pem else {
        return Assessment::RenewCa("no CA key".into());
    };
    if KeyPair::from_pem(ca_key).is_err() {
        return Assessment::RenewCa("the CA key does not parse".into());
    }
    let cas = match parse_pem_certs(&bundle.ca_pem) {
        Ok(cas) => cas,
        Err(e) => return Assessment::RenewCa(format!("the CA does not parse: {e}")),
    };
    let ca = match cas[0].parse_x509() {
        Ok(ca) => ca,
        Err(e) => return Assessment::RenewCa(format!("the CA does not parse: {e}")),
    };
    if ca.validity().not_after.timestamp() - now < secs(CA_RENEW_BEFORE) {
        return Assessment::RenewCa("the CA expires within a year".into());
    }
    if KeyPair::from_pem(&bundle.key_pem).is_err() {
        return Assessment::RenewServing("the serving key does not parse".into());
    }
    let blocks = match parse_pem_certs(&bundle.cert_pem) {
        Ok(blocks) => blocks,
        Err(e) => return Assessment::RenewServing(format!("the serving certificate: {e}")),
    };
    let cert = match blocks[0].parse_x509() {
        Ok(cert) => cert,
        Err(e) => return Assessment::RenewServing(format!("the serving certificate: {e}")),
    };
    if cert.verify_signature(Some(ca.public_key())).is_err() {
        return Assessment::RenewServing("the serving certificate is not signed by the CA".into());
    }
    let remaining = cert.validity().not_after.timestamp() - now;
    if remaining < secs(settings.renew_before) {
        return Assessment::RenewServing(format!("it expires in {remaining} s"));
    }
    let covered = covered_hosts(&cert);
    if let Some(missing) = settings.hosts.iter().find(|h| !host_covered(h, &covered)) {
        return Assessment::RenewServing(format!("it does not cover {missing}"));
    }
    Assessment::Valid
}

fn covered_hosts(cert: &x509_parser::certificate::X509Certificate<'_>) -> Vec<String> {
    use x509_parser::extensions::GeneralName;
    let Ok(Some(san)) = cert.subject_alternative_name() else {
        return Vec::new();
    };
    san.value
        .general_names
        .iter()
        .filter_map(|name| match name {
            GeneralName::DNSName(dns) => Some((*dns).to_owned()),
            GeneralName::IPAddress(bytes) => match bytes.len() {
                4 => <[u8; 4]>::try_from(*bytes)
                    .ok()
                    .map(|b| IpAddr::from(b).to_string()),
                16 => <[u8; 16]>::try_from(*bytes)
                    .ok()
                    .map(|b| IpAddr::from(b).to_string()),
                _ => None,
            },
            _ => None,
        })
        .collect()
}

fn host_covered(host: &str, covered: &[String]) -> bool {
    match host.parse::<IpAddr>() {
        Ok(ip) => covered.iter().any(|c| c.parse::<IpAddr>() == Ok(ip)),
        Err(_) => covered.iter().any(|c| c.eq_ignore_ascii_case(host)),
    }
}

fn distinguished_name(common_name: &str) -> DistinguishedName {
    let mut dn = DistinguishedName::new();
    dn.push(DnType::CommonName, common_name);
    dn.push(DnType::OrganizationName, "pko-rs");
    dn
}

fn offset(now: i64, delta: i64) -> Result<time::OffsetDateTime, TlsError> {
    time::OffsetDateTime::from_unix_timestamp(now.saturating_add(delta))
        .map_err(|e| TlsError::Pem(format!("certificate time out of range: {e}")))
}

/// Issues what `assessment` asks for, keeping what is still good in `current`.
pub fn issue(
    current: Option<&CertBundle>,
    assessment: &Assessment,
    settings: &CertSettings,
    now: i64,
) -> Result<CertBundle, TlsError> {
    // Reuse the CA when only the serving certificate needs renewing.
    let reused = match (assessment, current) {
        (Assessment::RenewServing(_) | Assessment::Valid, Some(bundle)) => {
            match &bundle.ca_key_pem {
                Some(key) => Some((bundle.ca_pem.clone(), KeyPair::from_pem(key)?, key.clone())),
                None => None,
            }
        }
        _ => None,
    };
    let (ca_pem, ca_key, ca_key_pem) = match reused {
        Some(ca) => ca,
        None => {
            let key = KeyPair::generate()?;
            let mut params = CertificateParams::default();
            params.distinguished_name = distinguished_name("pko-rs-webhook-ca");
            params.is_ca = IsCa::Ca(BasicConstraints::Constrained(0));
            params.key_usages = vec![
                KeyUsagePurpose::KeyCertSign,
                KeyUsagePurpose::CrlSign,
                KeyUsagePurpose::DigitalSignature,
            ];
            params.not_before = offset(now, -3600)?;
            params.not_after = offset(now, secs(settings.ca_validity))?;
            let cert = params.self_signed(&key)?;
            // Keep the previous CAs that are still valid: replicas may serve their
            // certificates until they pick up the new Secret.
            let mut pem = cert.pem();
            if let Some(old) = current {
                for block in parse_pem_certs(&old.ca_pem).unwrap_or_default() {
                    let still_valid = block
                        .parse_x509()
                        .map(|c| c.validity().not_after.timestamp() > now)
                        .unwrap_or(false);
                    if still_valid {
                        pem.push_str(&pem_encode("CERTIFICATE", &block.contents));
                    }
                }
            }
            let key_pem = key.serialize_pem();
            (pem, key, key_pem)
        }
    };
    let first_ca = parse_pem_certs(&ca_pem)?
        .into_iter()
        .next()
        .ok_or_else(|| TlsError::Pem("empty CA bundle".into()))?;
    let ca_expiry = first_ca
        .parse_x509()
        .map_err(|e| TlsError::Pem(e.to_string()))?
        .validity()
        .not_after
        .timestamp();
    let issuer =
        Issuer::from_ca_cert_der(&CertificateDer::from(first_ca.contents.clone()), ca_key)?;

    let serving_key = KeyPair::generate()?;
    let mut params = CertificateParams::new(settings.hosts.clone())?;
    params.distinguished_name = distinguished_name(
        settings
            .hosts
            .first()
            .map(String::as_str)
            .unwrap_or("pko-rs-webhook"),
    );
    params.key_usages = vec![
        KeyUsagePurpose::DigitalSignature,
        KeyUsagePurpose::KeyEncipherment,
    ];
    params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
    params.use_authority_key_identifier_extension = true;
    params.not_before = offset(now, -3600)?;
    // Never past the CA's own expiry.
    params.not_after = offset(now, secs(settings.serving_validity).min(ca_expiry - now))?;
    let cert = params.signed_by(&serving_key, &issuer)?;
    Ok(CertBundle {
        cert_pem: cert.pem(),
        key_pem: serving_key.serialize_pem(),
        ca_pem,
        ca_key_pem: Some(ca_key_pem),
    })
}

fn pem_encode(label: &str, der: &[u8]) -> String {
    const ALPHABET: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let mut b64 = String::with_capacity(der.len().div_ceil(3) * 4);
    for chunk in der.chunks(3) {
        let n = chunk
            .iter()
            .enumerate()
            .fold(0u32, |acc, (i, b)| acc | (u32::from(*b) << (16 - 8 * i)));
        for i in 0..4 {
            if i <= chunk.len() {
                b64.push(char::from(ALPHABET[((n >> (18 - 6 * i)) & 63) as usize]));
            } else {
                b64.push('=');
            }
        }
    }
    let mut out = format!("-----BEGIN {label}-----\n");
    for line in b64.as_bytes().chunks(64) {
        out.push_str(&String::from_utf8_lossy(line));
        out.push('\n');
    }
    out.push_str(&format!("-----END {label}-----\n"));
    out
}

fn bundle_from_secret(secret: &Secret) -> Option<CertBundle> {
    let data = secret.data.as_ref()?;
    let text = |key: &str| {
        data.get(key)
            .and_then(|b| String::from_utf8(b.0.clone()).ok())
    };
    Some(CertBundle {
        cert_pem: text(TLS_CRT)?,
        key_pem: text(TLS_KEY)?,
        ca_pem: text(CA_CRT)?,
        ca_key_pem: text(CA_KEY),
    })
}

fn secret_for(
    bundle: &CertBundle,
    settings: &CertSettings,
    resource_version: Option<String>,
) -> Secret {
    let mut data = std::collections::BTreeMap::new();
    data.insert(
        TLS_CRT.to_owned(),
        ByteString(bundle.cert_pem.clone().into_bytes()),
    );
    data.insert(
        TLS_KEY.to_owned(),
        ByteString(bundle.key_pem.clone().into_bytes()),
    );
    data.insert(
        CA_CRT.to_owned(),
        ByteString(bundle.ca_pem.clone().into_bytes()),
    );
    if let Some(key) = &bundle.ca_key_pem {
        data.insert(CA_KEY.to_owned(), ByteString(key.clone().into_bytes()));
    }
    Secret {
        metadata: ObjectMeta {
            name: Some(settings.secret_name.clone()),
            namespace: Some(settings.namespace.clone()),
            resource_version,
            labels: Some(std::collections::BTreeMap::from([(
                "app.kubernetes.io/managed-by".to_owned(),
                "pko-rs".to_owned(),
            )])),
            ..ObjectMeta::default()
        },
        type_: Some("kubernetes.io/tls".to_owned()),
        data: Some(data),
        ..Secret::default()
    }
}

/// Keeps the Secret, the listener and the webhook configurations in step.
pub struct CertManager {
    secrets: Api<Secret>,
    validating: Api<ValidatingWebhookConfiguration>,
    mutating: Api<MutatingWebhookConfiguration>,
    settings: CertSettings,
    metrics: AdmissionMetrics,
}

impl CertManager {
    pub fn new(client: Client, settings: CertSettings, metrics: AdmissionMetrics) -> Self {
        Self {
            secrets: Api::namespaced(client.clone(), &settings.namespace),
            validating: Api::all(client.clone()),
            mutating: Api::all(client),
            settings,
            metrics,
        }
    }

    pub fn settings(&self) -> &CertSettings {
        &self.settings
    }

    /// The current bundle from the Secret, issued (and written) first if it needs to be.
    pub async fn ensure(&self) -> Result<CertBundle, TlsError> {
        let name = &self.settings.secret_name;
        for _ in 0..WRITE_ATTEMPTS {
            let existing = self.secrets.get_opt(name).await.map_err(kube_err(format!(
                "reading Secret {}/{name}",
                self.settings.namespace
            )))?;
            let current = existing.as_ref().and_then(bundle_from_secret);
            let now = unix_now();
            let assessment = match &current {
                Some(bundle) => assess(bundle, &self.settings, now),
                None => Assessment::RenewCa("no certificate yet".into()),
            };
            if let (Assessment::Valid, Some(bundle)) = (&assessment, &current) {
                return Ok(bundle.clone());
            }
            info!(secret = %name, reason = ?assessment, "issuing webhook certificates");
            let bundle = issue(current.as_ref(), &assessment, &self.settings, now)?;
            let written = match existing {
                Some(secret) => {
                    let rv = secret.meta().resource_version.clone();
                    self.secrets
                        .replace(
                            name,
                            &PostParams::default(),
                            &secret_for(&bundle, &self.settings, rv),
                        )
                        .await
                }
                None => {
                    self.secrets
                        .create(
                            &PostParams::default(),
                            &secret_for(&bundle, &self.settings, None),
                        )
                        .await
                }
            };
            match written {
                Ok(_) => {
                    self.metrics.certificate_rotations.inc();
                    return Ok(bundle);
                }
                // Another replica wrote first: read its certificate on the next round.
                Err(kube::Error::Api(status)) if status.code == 409 => {
                    debug!(secret = %name, "certificate Secret changed concurrently; rereading");
                }
                Err(e) => {
                    return Err(kube_err(format!(
                        "writing Secret {}/{name}",
                        self.settings.namespace
                    ))(e));
                }
            }
        }
        Err(TlsError::Contended(WRITE_ATTEMPTS))
    }

    /// Puts `ca_pem` into every webhook of our configurations; a configuration that does not
    /// exist yet is skipped (the next check retries). Returns how many were changed.
    pub async fn inject_ca_bundle(&self, ca_pem: &str) -> Result<usize, TlsError> {
        let mut changed = 0;
        for name in &self.settings.validating_configurations {
            changed += inject(&self.validating, name, ca_pem, |c| {
                c.webhooks
                    .iter_mut()
                    .flatten()
                    .map(|w| &mut w.client_config.ca_bundle)
                    .collect()
            })
            .await?;
        }
        for name in &self.settings.mutating_configurations {
            changed += inject(&self.mutating, name, ca_pem, |c| {
                c.webhooks
                    .iter_mut()
                    .flatten()
                    .map(|w| &mut w.client_config.ca_bundle)
                    .collect()
            })
            .await?;
        }
        Ok(changed)
    }

    /// Checks every `check_interval` until `shutdown`: renews the certificate when needed,
    /// swaps it into `tls`, and re-injects the CA bundle (someone may have re-applied the
    /// manifests with an empty one).
    pub async fn run(
        self: Arc<Self>,
        tls: RustlsConfig,
        mut current: CertBundle,
        shutdown: impl std::future::Future<Output = ()>,
    ) {
        let mut shutdown = std::pin::pin!(shutdown);
        let mut tick = tokio::time::interval(self.settings.check_interval);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                () = &mut shutdown => return,
                _ = tick.tick() => {}
            }
            match self.ensure().await {
                Ok(bundle) if bundle != current => match bundle.server_config() {
                    Ok(config) => {
                        tls.reload_from_config(config);
                        if let Ok(expiry) = bundle.not_after() {
                            self.metrics.certificate_expiry.set(expiry);
                        }
                        info!("webhook serving certificate reloaded");
                        current = bundle;
                    }
                    Err(e) => {
                        warn!(error = %e, "new webhook certificate is unusable; keeping the old one")
                    }
                },
                Ok(_) => {}
                Err(e) => warn!(error = %e, "checking the webhook certificate failed; retrying"),
            }
            if let Err(e) = self.inject_ca_bundle(&current.ca_pem).await {
                warn!(error = %e, "injecting the CA bundle failed; retrying");
            }
        }
    }
}

async fn inject<K>(
    api: &Api<K>,
    name: &str,
    ca_pem: &str,
    bundles: impl Fn(&mut K) -> Vec<&mut Option<ByteString>>,
) -> Result<usize, TlsError>
where
    K: Resource + Clone + DeserializeOwned + serde::Serialize + std::fmt::Debug,
{
    let wanted = ByteString(ca_pem.as_bytes().to_vec());
    for _ in 0..WRITE_ATTEMPTS {
        let Some(mut config) = api
            .get_opt(name)
            .await
            .map_err(kube_err(format!("reading webhook configuration {name}")))?
        else {
            debug!(configuration = %name, "webhook configuration not found yet");
            return Ok(0);
        };
        let mut stale = false;
        for bundle in bundles(&mut config) {
            if bundle.as_ref() != Some(&wanted) {
                *bundle = Some(wanted.clone());
                stale = true;
            }
        }
        if !stale {
            return Ok(0);
        }
        // `replace` carries the resourceVersion we read: a concurrent edit makes it fail.
        match api.replace(name, &PostParams::default(), &config).await {
            Ok(_) => {
                info!(configuration = %name, "CA bundle injected");
                return Ok(1);
            }
            Err(kube::Error::Api(status)) if status.code == 409 => continue,
            Err(e) => {
                return Err(kube_err(format!("updating webhook configuration {name}"))(
                    e,
                ));
            }
        }
    }
    Err(TlsError::Contended(WRITE_ATTEMPTS))
}

/// Certificates from files (`tls.crt`, `tls.key`, optional `ca.crt`), e.g. a cert-manager
/// Secret mounted as a volume; reloaded when they change.
pub struct CertFiles {
    dir: PathBuf,
}

impl CertFiles {
    pub fn new(dir: &Path) -> Self {
        Self {
            dir: dir.to_path_buf(),
        }
    }

    pub fn load(&self) -> Result<CertBundle, TlsError> {
        let read = |name: &str| {
            let path = self.dir.join(name);
            std::fs::read_to_string(&path).map_err(|source| TlsError::Io { path, source })
        };
        let bundle = CertBundle {
            cert_pem: read(TLS_CRT)?,
            key_pem: read(TLS_KEY)?,
            ca_pem: read(CA_CRT).unwrap_or_default(),
            ca_key_pem: None,
        };
        // Fail now, not at the first handshake.
        bundle.server_config()?;
        Ok(bundle)
    }

    /// Polls the files every `interval` and swaps a changed certificate into `tls`.
    pub async fn run(
        self,
        tls: RustlsConfig,
        mut current: CertBundle,
        interval: Duration,
        metrics: AdmissionMetrics,
        shutdown: impl std::future::Future<Output = ()>,
    ) {
        let mut shutdown = std::pin::pin!(shutdown);
        let mut tick = tokio::time::interval(interval);
        loop {
            tokio::select! {
                () = &mut shutdown => return,
                _ = tick.tick() => {}
            }
            match self.load() {
                Ok(bundle) if bundle != current => {
                    if let Ok(config) = bundle.server_config() {
                        tls.reload_from_config(config);
                        metrics.certificate_rotations.inc();
                        if let Ok(expiry) = bundle.not_after() {
                            metrics.certificate_expiry.set(expiry);
                        }
                        info!(dir = %self.dir.display(), "webhook serving certificate reloaded");
                        current = bundle;
                    }
                }
                Ok(_) => {}
                // Mid-rotation files can be briefly inconsistent; keep serving the old one.
                Err(e) => debug!(error = %e, "webhook certificate files not loadable yet"),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn settings() -> CertSettings {
        CertSettings::new(
            "pko-rs-system".into(),
            "pko-rs-webhook-tls".into(),
            vec![
                "pko-rs-webhook.pko-rs-system.svc".into(),
                "127.0.0.1".into(),
            ],
        )
    }

    const DAY: i64 = 24 * 3600;

    #[test]
    fn issued_bundle_is_valid_and_serves() {
        let s = settings();
        let now = unix_now();
        let bundle = issue(None, &Assessment::RenewCa("new".into()), &s, now).expect("issue");
        assert_eq!(assess(&bundle, &s, now), Assessment::Valid);
        bundle.server_config().expect("rustls accepts it");
        let expiry = bundle.not_after().expect("expiry");
        assert!((expiry - (now + 90 * DAY)).abs() < 5, "{expiry}");
    }

    #[test]
    fn serving_certificate_is_renewed_early_with_the_same_ca() {
        let s = settings();
        let now = unix_now();
        let bundle = issue(None, &Assessment::RenewCa("new".into()), &s, now).expect("issue");
        let later = now + 61 * DAY;
        let assessment = assess(&bundle, &s, later);
        assert!(
            matches!(assessment, Assessment::RenewServing(_)),
            "{assessment:?}"
        );
        let renewed = issue(Some(&bundle), &assessment, &s, later).expect("renew");
        assert_eq!(renewed.ca_pem, bundle.ca_pem);
        assert_ne!(renewed.cert_pem, bundle.cert_pem);
        assert_eq!(assess(&renewed, &s, later), Assessment::Valid);
    }

    #[test]
    fn new_hosts_need_a_new_serving_certificate() {
        let s = settings();
        let now = unix_now();
        let bundle = issue(None, &Assessment::RenewCa("new".into()), &s, now).expect("issue");
        let mut more = s.clone();
        more.hosts.push("::1".into());
        assert!(matches!(
            assess(&bundle, &more, now),
            Assessment::RenewServing(_)
        ));
    }

    #[test]
    fn ca_rotation_keeps_the_old_ca_in_the_bundle() {
        let s = settings();
        let now = unix_now();
        let bundle = issue(None, &Assessment::RenewCa("new".into()), &s, now).expect("issue");
        let late = now + 4 * 365 * DAY + 10 * DAY;
        let assessment = assess(&bundle, &s, late);
        assert!(
            matches!(assessment, Assessment::RenewCa(_)),
            "{assessment:?}"
        );
        let rotated = issue(Some(&bundle), &assessment, &s, late).expect("rotate");
        let cas = parse_pem_certs(&rotated.ca_pem).expect("bundle");
        assert_eq!(cas.len(), 2, "new CA followed by the old one");
        assert!(rotated.ca_pem.ends_with(bundle.ca_pem.trim_start()));
        assert_eq!(assess(&rotated, &s, late), Assessment::Valid);
    }

    #[test]
    fn broken_secrets_are_replaced() {
        let s = settings();
        let now = unix_now();
        let good = issue(None, &Assessment::RenewCa("new".into()), &s, now).expect("issue");
        let mut no_key = good.clone();
        no_key.ca_key_pem = None;
        assert!(matches!(assess(&no_key, &s, now), Assessment::RenewCa(_)));
        let mut garbage = good.clone();
        garbage.cert_pem = "garbage".into();
        assert!(matches!(
            assess(&garbage, &s, now),
            Assessment::RenewServing(_)
        ));
        // A serving certificate from another CA is not trusted by our bundle.
        let other = issue(None, &Assessment::RenewCa("new".into()), &s, now).expect("issue");
        let mut mixed = good.clone();
        mixed.cert_pem = other.cert_pem;
        mixed.key_pem = other.key_pem;
        assert!(matches!(
            assess(&mixed, &s, now),
            Assessment::RenewServing(_)
        ));
    }

    #[test]
    fn pem_encoding_round_trips() {
        let s = settings();
        let bundle =
            issue(None, &Assessment::RenewCa("new".into()), &s, unix_now()).expect("issue");
        let blocks = parse_pem_certs(&bundle.ca_pem).expect("parse");
        let again = pem_encode("CERTIFICATE", &blocks[0].contents);
        assert_eq!(again, bundle.ca_pem);
    }

    #[tokio::test]
    async fn certificate_files_load_and_reload() {
        let s = settings();
        let first = issue(None, &Assessment::RenewCa("new".into()), &s, unix_now()).expect("issue");
        let dir = tempfile::tempdir().expect("tempdir");
        let write = |b: &CertBundle| {
            std::fs::write(dir.path().join(TLS_CRT), &b.cert_pem).expect("crt");
            std::fs::write(dir.path().join(TLS_KEY), &b.key_pem).expect("key");
        };
        let files = CertFiles::new(dir.path());
        assert!(matches!(files.load(), Err(TlsError::Io { .. })));
        write(&first);
        let loaded = files.load().expect("loads");
        assert_eq!(loaded.cert_pem, first.cert_pem);
        assert_eq!(loaded.ca_key_pem, None);

        // A new certificate on disk is picked up by the polling loop.
        let tls = RustlsConfig::from_config(loaded.server_config().expect("config"));
        let metrics = AdmissionMetrics::new();
        let stop = tokio_util::sync::CancellationToken::new();
        let task = tokio::spawn(CertFiles::new(dir.path()).run(
            tls,
            loaded,
            Duration::from_millis(20),
            metrics.clone(),
            stop.clone().cancelled_owned(),
        ));
        let second =
            issue(None, &Assessment::RenewCa("new".into()), &s, unix_now()).expect("issue");
        write(&second);
        let deadline = std::time::Instant::now() + Duration::from_secs(5);
        while metrics.certificate_rotations.get() == 0 && std::time::Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        assert_eq!(metrics.certificate_rotations.get(), 1);
        stop.cancel();
        task.await.expect("loop ends");
    }

    #[test]
    fn secrets_round_trip() {
        let s = settings();
        let bundle =
            issue(None, &Assessment::RenewCa("new".into()), &s, unix_now()).expect("issue");
        let secret = secret_for(&bundle, &s, None);
        assert_eq!(secret.type_.as_deref(), Some("kubernetes.io/tls"));
        assert_eq!(bundle_from_secret(&secret), Some(bundle));
    }
}
