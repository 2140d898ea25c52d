//! Certificates issued elsewhere (cert-manager), read from a mounted folder and reloaded.

use super::*;

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
