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

mod files;
mod manager;
mod pki;

pub use files::CertFiles;
pub use manager::CertManager;
pub use pki::{Assessment, assess, issue, not_after};

fn unix_now() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| i64::try_from(d.as_secs()).unwrap_or(i64::MAX))
        .unwrap_or(0)
}

fn secs(d: Duration) -> i64 {
    i64::try_from(d.as_secs()).unwrap_or(i64::MAX)
}

#[cfg(test)]
mod tests {
    use super::manager::{bundle_from_secret, secret_for};
    use super::pki::*;
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
