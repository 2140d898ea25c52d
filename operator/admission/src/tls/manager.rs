//! Managed certificates: the Secret every replica reads and writes, the listener it feeds and
//! the CA bundle patched into the webhook configurations.

use super::*;

pub(super) fn bundle_from_secret(secret: &Secret) -> Option<CertBundle> {
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

pub(super) fn secret_for(
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
