//! pko-rs admission: the Rego policies of `policies/`, compiled to wasm by `opa build`, run
//! in-process with opa-wasm behind an HTTPS admission webhook.
//!
//! - [`bundle`]: reads the bundle built by `make policies`.
//! - [`engine`]: compiles it once; evaluates on pooled instances that hold the data document,
//!   each evaluation from the same heap state, with a timeout and a memory cap.
//! - [`tenancy`]: the `data.tenancy` document, from watched TenancyPolicies and namespace
//!   labels.
//! - [`webhook`]: `/validate` (deny / warn / dryrun), `/mutate` (defaults) and `/namespaces`.
//! - [`namespaces`]: no namespace deleted under Stacks that still have resources to destroy.
//! - [`tls`]: the operator-managed CA and serving certificate, and the caBundle injection.
//! - [`server`]: the HTTPS listener.
//! - [`conn`]: idle and write timers of one connection, shared with the operator's listeners.
//! - [`metrics`]: decisions, violations, latency, errors, certificate expiry.
//! - [`cli`]: the operator's `--webhook-*` and `--policy-*` flags.

pub mod bundle;
pub mod cli;
pub mod conn;
pub mod engine;
mod errors;
pub mod metrics;
pub mod namespaces;
mod review;
pub mod server;
pub mod tenancy;
pub mod tls;
pub mod urls;
pub mod webhook;

use std::future::Future;
use std::path::PathBuf;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use axum_server::tls_rustls::RustlsConfig;
use kube::Client;
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

pub use bundle::Bundle;
pub use engine::{EngineLimits, PolicyEngine};
pub use metrics::AdmissionMetrics;
pub use tenancy::{Tenancy, TenancySettings};
pub use tls::{CertFiles, CertManager, CertSettings};
pub use webhook::{Admission, FailurePolicy};

/// Errors while starting the webhook.
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    #[error(transparent)]
    Bundle(#[from] bundle::BundleError),
    #[error(transparent)]
    Engine(#[from] engine::EngineError),
    #[error(transparent)]
    Tls(#[from] tls::TlsError),
    #[error(transparent)]
    Server(#[from] server::ServerError),
}

/// Where the serving certificate comes from.
pub enum CertSource {
    /// Managed by the operator in a Secret (see [`tls`]).
    Managed(CertSettings),
    /// Files in a folder (cert-manager), polled for changes.
    Files(PathBuf),
}

/// Everything the webhook needs to start.
pub struct WebhookConfig {
    /// Listen address, e.g. `:9443`.
    pub addr: String,
    pub bundle: PathBuf,
    pub limits: EngineLimits,
    pub review: webhook::ReviewLimits,
    /// Connections kept open at once.
    pub max_connections: usize,
    /// Connections one client address keeps open at once (`None`: a quarter of the cap).
    pub max_connections_per_client: Option<usize>,
    /// Idle and write timers of each connection.
    pub conn: conn::ConnLimits,
    pub failure_policy: FailurePolicy,
    pub tenancy: TenancySettings,
    /// The file server's Service (name, namespace): its ClusterIP and ports are added to
    /// `tenancy.file_server` at start.
    pub file_server_service: Option<(String, String)>,
    pub certs: CertSource,
    /// How long in-flight requests may finish after shutdown starts.
    pub drain: Duration,
}

/// The CEL `matchConditions` expression of every pko-rs webhook (deploy/webhook/*.yaml): an
/// UPDATE of an object being deleted that leaves its spec alone (finalizers being removed)
/// skips the webhook, so clean-up never depends on the operator running. The policies check
/// everything else, a changed spec on a deleted object included.
pub const MATCH_CONDITION: &str = "!(request.operation == 'UPDATE' && has(object.metadata.deletionTimestamp) && oldObject != null && has(object.spec) && has(oldObject.spec) && object.spec == oldObject.spec)";

/// A task of the webhook, to be spawned by the caller.
pub type Task = Pin<Box<dyn Future<Output = ()> + Send>>;

/// A started webhook: its readiness flags and the tasks to spawn.
pub struct Started {
    /// Set once the tenancy watches have listed everything. Requests are answered before
    /// that with what is known; readiness waits for it.
    pub tenancy_synced: Arc<AtomicBool>,
    /// Set once the listener serves with a certificate.
    pub serving: Arc<AtomicBool>,
    /// The tenancy watch, the HTTPS listener and the certificate loop; each ends after
    /// `shutdown` is cancelled (the listener after draining).
    pub tasks: Vec<Task>,
}

/// Loads and compiles the policies, obtains the certificate (and injects its CA bundle),
/// binds the listener, and returns the tasks to run. Fails early on anything that would make
/// the webhook unusable: a missing or invalid bundle, a taken port, no certificate.
/// The ClusterIPs and ports of the file server's Service: URLs may name it by address too.
async fn add_service_addresses(
    client: &Client,
    name: &str,
    namespace: &str,
    names: &mut tenancy::FileServerNames,
) {
    let services: kube::Api<k8s_openapi::api::core::v1::Service> =
        kube::Api::namespaced(client.clone(), namespace);
    match services.get_opt(name).await {
        Ok(Some(service)) => {
            let spec = service.spec.unwrap_or_default();
            let ips = spec
                .cluster_ips
                .unwrap_or_default()
                .into_iter()
                .chain(spec.cluster_ip);
            for ip in ips.filter(|ip| !ip.is_empty() && ip != "None") {
                if let Some((host, _)) =
                    urls::host_and_port(&ip).or_else(|| urls::host_and_port(&format!("[{ip}]")))
                {
                    names.add(host, None);
                }
            }
            for port in spec.ports.unwrap_or_default() {
                if let Ok(port) = u16::try_from(port.port) {
                    names.add_port(port);
                }
            }
        }
        Ok(None) => {
            warn!(service = %format!("{namespace}/{name}"), "the file server's Service does not exist; its ClusterIP is not checked")
        }
        Err(e) => {
            warn!(service = %format!("{namespace}/{name}"), error = %e, "cannot read the file server's Service; its ClusterIP is not checked")
        }
    }
}

pub async fn start(
    client: Client,
    config: WebhookConfig,
    metrics: AdmissionMetrics,
    shutdown: CancellationToken,
) -> Result<Started, StartError> {
    let bundle = Bundle::load(&config.bundle)?;
    let engine = PolicyEngine::new(&bundle, config.limits).await?;
    info!(
        bundle = %config.bundle.display(),
        digest = engine.digest(),
        "admission policies loaded"
    );
    let mut settings = config.tenancy.clone();
    if let Some((name, namespace)) = &config.file_server_service {
        add_service_addresses(&client, name, namespace, &mut settings.file_server).await;
    }
    info!(hosts = ?settings.file_server.hosts, ports = ?settings.file_server.ports, "artifact URLs on these addresses are checked for cross-namespace Programs");
    let (tenancy, tenancy_driver) = Tenancy::watch(client.clone(), settings);
    let tenancy_synced = tenancy.synced_flag();
    let admission = Arc::new(
        Admission::with_limits(
            engine.clone(),
            tenancy,
            metrics.clone(),
            config.failure_policy,
            config.review,
        )
        .with_namespace_guard(namespaces::NamespaceGuard::new(client.clone())),
    );
    let listener = server::bind(&config.addr)?;

    let mut tasks: Vec<Task> = Vec::new();
    {
        let stop = shutdown.clone();
        tasks.push(Box::pin(async move {
            tokio::select! {
                () = tenancy_driver => {},
                () = stop.cancelled() => {},
            }
        }));
    }
    let tls = match config.certs {
        CertSource::Managed(settings) => {
            let manager = Arc::new(CertManager::new(client, settings, metrics.clone()));
            let certs = manager.ensure().await?;
            // The configurations may not exist yet; the certificate loop retries.
            if let Err(e) = manager.inject_ca_bundle(&certs.ca_pem).await {
                warn!(error = %e, "injecting the CA bundle failed; retrying in the background");
            }
            let tls = RustlsConfig::from_config(certs.server_config()?);
            record_expiry(&metrics, &certs);
            tasks.push(Box::pin(manager.run(
                tls.clone(),
                certs,
                shutdown.clone().cancelled_owned(),
            )));
            tls
        }
        CertSource::Files(dir) => {
            let files = CertFiles::new(&dir);
            let certs = files.load()?;
            let tls = RustlsConfig::from_config(certs.server_config()?);
            record_expiry(&metrics, &certs);
            tasks.push(Box::pin(files.run(
                tls.clone(),
                certs,
                FILE_POLL_INTERVAL,
                metrics.clone(),
                shutdown.clone().cancelled_owned(),
            )));
            tls
        }
    };
    let serving = Arc::new(AtomicBool::new(true));
    {
        let serving = serving.clone();
        let app = webhook::router(admission);
        let served = server::serve(
            listener,
            app,
            tls,
            {
                let mut bounds = server::Bounds::new(config.drain, config.max_connections);
                if let Some(per_client) = config.max_connections_per_client {
                    bounds.max_connections_per_client = per_client.max(1);
                }
                bounds.conn = config.conn;
                bounds
            },
            metrics.clone(),
            shutdown.cancelled_owned(),
        );
        tasks.push(Box::pin(async move {
            served.await;
            serving.store(false, Ordering::Release);
            // Whatever still runs after the drain is stopped at its next tick.
            engine.close();
        }));
    }
    Ok(Started {
        tenancy_synced,
        serving,
        tasks,
    })
}

/// How often mounted certificate files are checked for a new version.
const FILE_POLL_INTERVAL: Duration = Duration::from_secs(10);

fn record_expiry(metrics: &AdmissionMetrics, certs: &tls::CertBundle) {
    if let Ok(expiry) = certs.not_after() {
        metrics.certificate_expiry.set(expiry);
    }
}
