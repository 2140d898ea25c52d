//! The operator's run: [`App::build`] starts every part (watches, the file server, the probes,
//! the admission webhook, the election and the controllers), [`App::run`] waits for a signal
//! or the end of the election and shuts them down within the graceful timeout.

use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::AtomicBool;
use std::time::Duration;

use kube::api::DynamicObject;
use kube::config::{KubeConfigOptions, Kubeconfig};
use kube::discovery::ApiResource;
use kube::{Api, Client};
use pko_api::stack::Stack;
use pko_api::workspace::Workspace;
use pko_operator::artifact::index::ProgramIndex;
use pko_operator::artifact::stored::StoredProgram;
use pko_operator::capability::{self, KeyRing, KeySecret, KeySet, RotationPolicy};
use pko_operator::config::AdvertisedAddress;
use pko_operator::controller::kit::Kit;
use pko_operator::controller::program::ProgramContext;
use pko_operator::egress::EgressPolicy;
use pko_operator::fileserver::{self, FileServer};
use pko_operator::http;
use pko_operator::leader;
use pko_operator::memory;
use pko_operator::metrics::Metrics;
use pko_operator::probes::{self, Readiness};
use pko_operator::rest_metrics::RestMetricsLayer;
use pko_operator::secure_metrics;
use pko_operator::stack_metrics;
use pko_operator::transform::TransformRegistry;
use pko_operator::workspace_metrics;
use tokio::task::{JoinHandle, JoinSet};
use tokio_util::sync::CancellationToken;
use tracing::info;

use crate::RunArgs;
use controllers::{Controllers, elect};

mod controllers;

/// Why the operator could not start, or stopped on its own.
#[derive(Debug, thiserror::Error)]
pub(crate) enum AppError {
    #[error(transparent)]
    Memory(#[from] memory::MemoryError),
    #[error("reading kubeconfig {}", path.display())]
    ReadKubeconfig {
        path: PathBuf,
        #[source]
        source: kube::config::KubeconfigError,
    },
    #[error("loading kubeconfig {}", path.display())]
    LoadKubeconfig {
        path: PathBuf,
        #[source]
        source: kube::config::KubeconfigError,
    },
    #[error("no kubeconfig given and no in-cluster config found")]
    InferConfig(#[source] kube::config::InferConfigError),
    #[error("building the Kubernetes client")]
    Client(#[source] kube::Error),
    #[error(transparent)]
    Transforms(#[from] pko_operator::transform::TransformError),
    #[error("loading the artifact URL keys")]
    Keys(#[source] capability::CapabilityError),
    #[error(transparent)]
    Listen(#[from] http::ServerError),
    #[error(transparent)]
    WebhookArgs(#[from] pko_admission::cli::CliError),
    #[error(transparent)]
    Webhook(#[from] pko_admission::StartError),
    #[error("--leader-elect needs --leader-election-namespace (or $POD_NAMESPACE)")]
    NoLeaseNamespace,
    #[error(
        "--metrics-secure needs a --metrics-bind-address of its own (e.g. :8443): the probe listener stays plain HTTP for the kubelet"
    )]
    SecureMetricsAddress,
    #[error(transparent)]
    SecureMetrics(#[from] pko_operator::secure_metrics::SecureMetricsError),
    #[error(transparent)]
    Admin(#[from] pko_operator::admin::AdminError),
    #[error(transparent)]
    Election(#[from] leader::LeaderError),
    #[error("installing the SIGTERM handler")]
    SigtermHandler(#[source] std::io::Error),
    #[error("waiting for Ctrl-C")]
    CtrlC(#[source] std::io::Error),
    #[error("leader election ended unexpectedly")]
    ElectionEnded,
}

/// What the process environment says about the pod; main reads it.
#[derive(Debug, Clone, Default)]
pub(crate) struct PodEnv {
    /// `$HOSTNAME`.
    pub hostname: Option<String>,
    /// `$POD_NAME`: Events and the leader identity report it.
    pub pod_name: Option<String>,
    /// `$POD_NAMESPACE`.
    pub pod_namespace: Option<String>,
}

/// The started operator, waiting to be stopped.
pub(crate) struct App {
    shutdown: CancellationToken,
    /// The lease is released only after the controllers stop, hence its own stop token.
    election_stop: CancellationToken,
    election_task: Option<JoinHandle<()>>,
    controllers_task: JoinHandle<()>,
    readiness: Readiness,
    /// Watches and listeners, each ending after `shutdown`.
    tasks: JoinSet<()>,
    graceful_shutdown_timeout: Duration,
}

/// The watches every replica runs, and what the rest is built on.
struct Watches {
    egress: Arc<EgressPolicy>,
    transforms: Option<Arc<TransformRegistry>>,
    index: Arc<ProgramIndex>,
    stacks_synced: Arc<AtomicBool>,
}

/// What the servers report to the controllers.
struct Served {
    readiness: Readiness,
    file_server: pko_admission::tenancy::FileServerNames,
    tenancy_status: bool,
}

impl App {
    /// Starts every part; an error means the configuration cannot work (or the apiserver
    /// stayed unreachable), before any controller ran.
    pub(crate) async fn build(args: RunArgs, env: PodEnv) -> Result<Self, AppError> {
        let memory = memory_plan(&args)?;
        info!("{}", memory.describe());
        // kube and rustls must agree on one crypto provider; ring is the only one linked.
        let _ = rustls::crypto::ring::default_provider().install_default();

        let admission_metrics = pko_admission::AdmissionMetrics::new();
        let metrics = Metrics::with_extra(args.metrics_object_labels, |registry| {
            admission_metrics.register(registry);
        });
        let client = kube_client(&args, None, &metrics).await?;
        let shutdown = CancellationToken::new();
        let advertised = AdvertisedAddress::resolve(
            &args.program_fs_addr,
            args.program_fs_adv_addr.as_deref(),
            env.hostname.as_deref(),
        );
        info!(advertised = advertised.as_str(), "artifact URLs");

        let (scope, cluster) = args.scope();
        if !cluster {
            info!(
                namespaces = ?scope.each(),
                "namespace-scoped: watching these namespaces only; ClusterProgramTransforms, TenancyPolicies, Namespace labels and the admission webhook are off"
            );
        }
        let mut tasks = JoinSet::new();
        let watches = Watches::start(&args, &client, &metrics, &memory, &shutdown, &mut tasks)?;
        let (key_secret, keys) =
            artifact_keys(&args, &client, &env, &watches.index, &shutdown, &mut tasks).await?;
        let served = serve(
            &args,
            &env,
            &client,
            &metrics,
            &admission_metrics,
            &memory,
            &advertised,
            &watches,
            &keys,
            &shutdown,
            &mut tasks,
        )
        .await?;

        let kit = Kit::new(client.clone(), metrics.clone(), env.pod_name.clone());
        let ctx = Arc::new(ProgramContext::new(
            &kit,
            advertised,
            watches.index.clone(),
            keys,
        ));
        let election_stop = CancellationToken::new();
        let (leadership, election_task) = elect(&args, &env, &metrics, &election_stop).await?;
        let controllers = Controllers {
            kit,
            ctx,
            concurrency: args.max_concurrent_reconciles,
            execution_args: {
                // The operator's service account lives in its own namespace unless told.
                let mut execution = args.execution.clone();
                if execution.service_account_namespace.is_none() {
                    execution.service_account_namespace = env.pod_namespace.clone();
                }
                execution
            },
            scope,
            egress: watches.egress,
            file_server: served.file_server,
            transforms: watches.transforms,
            tenancy_status: served.tenancy_status,
            key_secret,
            rotation: RotationPolicy {
                max_age: args.artifact_key_max_age,
                overlap: args.artifact_key_overlap,
            },
        };
        let controllers_task = tokio::spawn(leader::run_while_leader(
            leadership,
            shutdown.clone(),
            args.graceful_shutdown_timeout,
            move |stop| controllers.start(stop),
        ));
        Ok(Self {
            shutdown,
            election_stop,
            election_task,
            controllers_task,
            readiness: served.readiness,
            tasks,
            graceful_shutdown_timeout: args.graceful_shutdown_timeout,
        })
    }

    /// Runs until SIGTERM, Ctrl-C or the end of the election, then stops the controllers, the
    /// election and the rest, each within the graceful shutdown timeout.
    pub(crate) async fn run(mut self) -> Result<(), AppError> {
        let election_died = tokio::select! {
            signal = wait_for_signal() => { signal?; false }
            () = task_ended(&mut self.election_task) => true,
        };
        info!("shutting down");
        self.readiness.start_draining();
        self.shutdown.cancel();
        let deadline = tokio::time::Instant::now() + self.graceful_shutdown_timeout;
        if tokio::time::timeout_at(deadline, self.controllers_task)
            .await
            .is_err()
        {
            tracing::warn!("controllers did not stop within the graceful shutdown timeout");
        }
        self.election_stop.cancel();
        if let Some(task) = self.election_task {
            // The election task bounds the release itself; this is the backstop.
            let _ = tokio::time::timeout(Duration::from_secs(10), task).await;
        }
        // Listeners and watches drain within their own bounds; this is the backstop.
        let mut tasks = self.tasks;
        let drained = tokio::time::timeout_at(deadline, async {
            while tasks.join_next().await.is_some() {}
        })
        .await;
        if drained.is_err() {
            tracing::warn!("shutdown timed out");
        }
        if election_died {
            return Err(AppError::ElectionEnded);
        }
        Ok(())
    }
}

/// Runs `fut` in `tasks` until it ends or `stop` is cancelled.
fn spawn_until(
    tasks: &mut JoinSet<()>,
    stop: &CancellationToken,
    fut: impl Future<Output = ()> + Send + 'static,
) {
    let stop = stop.clone();
    tasks.spawn(async move {
        tokio::select! {
            () = fut => {},
            () = stop.cancelled() => {},
        }
    });
}

impl Watches {
    /// The Program watch (with the transforms it uses) and the Stack gauges, on every replica.
    fn start(
        args: &RunArgs,
        client: &Client,
        metrics: &Metrics,
        memory: &memory::Plan,
        shutdown: &CancellationToken,
        tasks: &mut JoinSet<()>,
    ) -> Result<Self, AppError> {
        let (scope, cluster) = args.scope();
        let programs: Vec<Api<StoredProgram>> = scope.apis(client);
        // Where the operator may connect for a tenant's URL (git refs, https modules).
        let egress = Arc::new(EgressPolicy::from_args(&args.egress));
        // Transform plugins, on every replica: each file server runs the chains too.
        let transforms = if args.plugins.plugins_enabled {
            Some(TransformRegistry::from_args(
                &args.plugins,
                client.clone(),
                metrics.plugins.clone(),
                egress.clone(),
                pko_operator::transform::PluginPlan {
                    memory_budget_bytes: memory.plugin_budget_bytes,
                    compile_memory_bytes: memory.compile_memory_bytes,
                },
            )?)
        } else {
            None
        };
        let (index, index_driver) = pko_operator::artifact::index::watch(
            programs,
            pko_operator::artifact::index::IndexOptions {
                cache_bytes: memory.artifact_cache_bytes,
                publish_wait: args.artifact_publish_wait,
            },
            metrics.clone(),
            transforms.clone(),
        );
        if let Some(transforms) = &transforms {
            let driver = transforms
                .clone()
                .run(client.clone(), scope.clone(), cluster);
            spawn_until(tasks, shutdown, driver);
        }
        spawn_until(tasks, shutdown, index_driver);

        // Stack gauges: a watch on every replica, like the Program watch above.
        let stack_resource = ApiResource::erase::<Stack>(&());
        let stacks: Vec<Api<DynamicObject>> = scope.apis_with(client, &stack_resource);
        let (stacks_synced, stacks_driver) = stack_metrics::watch(stacks, metrics.clone());
        spawn_until(tasks, shutdown, stacks_driver);
        // `workspaces_idle`: likewise a watch on every replica.
        let workspace_resource = ApiResource::erase::<Workspace>(&());
        let workspaces: Vec<Api<DynamicObject>> = scope.apis_with(client, &workspace_resource);
        spawn_until(
            tasks,
            shutdown,
            workspace_metrics::watch(workspaces, metrics.clone()),
        );
        Ok(Self {
            egress,
            transforms,
            index,
            stacks_synced,
        })
    }
}

/// Artifact URL keys: read (or created) before the file server can verify a single URL, and
/// kept fresh from their Secret when there is one.
async fn artifact_keys(
    args: &RunArgs,
    client: &Client,
    env: &PodEnv,
    index: &Arc<ProgramIndex>,
    shutdown: &CancellationToken,
    tasks: &mut JoinSet<()>,
) -> Result<(Option<KeySecret>, KeyRing), AppError> {
    let key_secret = args
        .artifact_keys_namespace
        .clone()
        .or_else(|| env.pod_namespace.clone())
        .filter(|n| !n.is_empty())
        .map(|namespace| KeySecret::new(client.clone(), &namespace, &args.artifact_keys_secret));
    let keys = match &key_secret {
        Some(secret) => KeyRing::new(load_keys(secret).await?),
        None => {
            tracing::warn!(
                "no --artifact-keys-namespace or $POD_NAMESPACE: artifact URLs are signed with a key of this process only; run one replica"
            );
            KeyRing::new(KeySet::ephemeral(capability::unix_now()))
        }
    };
    if let Some(secret) = key_secret.clone() {
        let (ring, index, stop) = (keys.clone(), index.clone(), shutdown.clone());
        tasks.spawn(capability::refresh(
            secret,
            ring,
            move || index.resync(),
            stop,
        ));
    }
    Ok((key_secret, keys))
}

/// The file server, the admission webhook and the probe (and metrics) listeners, on every
/// replica.
#[allow(
    clippy::too_many_arguments,
    reason = "the parts built before; a struct of them would only rename the list"
)]
async fn serve(
    args: &RunArgs,
    env: &PodEnv,
    client: &Client,
    metrics: &Metrics,
    admission_metrics: &pko_admission::AdmissionMetrics,
    memory: &memory::Plan,
    advertised: &AdvertisedAddress,
    watches: &Watches,
    keys: &KeyRing,
    shutdown: &CancellationToken,
    tasks: &mut JoinSet<()>,
) -> Result<Served, AppError> {
    let fs_listener = http::bind(&args.program_fs_addr).await?;
    let fs_app = fileserver::router(FileServer {
        index: watches.index.clone(),
        metrics: metrics.clone(),
        keys: keys.clone(),
    });
    tasks.spawn(http::serve(
        "fileserver",
        fs_listener,
        fs_app,
        listener_limits(args),
        shutdown.clone().cancelled_owned(),
    ));

    let mut checks = vec![
        ("program cache", watches.index.synced_flag()),
        ("stack cache", watches.stacks_synced.clone()),
    ];
    if let Some(transforms) = &watches.transforms {
        checks.push(("transforms", transforms.synced_flag()));
    }
    // Admission webhook, on every replica: policies, tenancy data and its own certificate.
    let fs_host = advertised.as_str().split_once("://").map(|(_, host)| host);
    let webhook_config = args.webhook.config(
        fs_host,
        env.pod_namespace.as_deref(),
        memory.admission_slots,
    )?;
    // A webhook configuration is cluster-scoped, and so are the TenancyPolicies it enforces.
    let webhook_config = if args.scope().1 {
        webhook_config
    } else {
        if webhook_config.is_some() {
            info!(
                "namespace-scoped: the admission webhook is off (its --webhook-* flags are ignored)"
            );
        }
        None
    };
    // The Workspace controller judges flux URLs by the same file-server names as the webhook.
    let (file_server, _) = args.webhook.file_server_names(fs_host)?;
    // TenancyPolicies matter only to the webhook; their status is reported where it runs.
    let tenancy_status = webhook_config.is_some();
    if let Some(config) = webhook_config {
        let started = pko_admission::start(
            client.clone(),
            config,
            admission_metrics.clone(),
            shutdown.clone(),
        )
        .await?;
        checks.push(("tenancy policies", started.tenancy_synced));
        checks.push(("admission webhook", started.serving));
        for task in started.tasks {
            tasks.spawn(task);
        }
    }
    let readiness = Readiness::new(checks);
    serve_probes(args, env, client, &readiness, metrics, shutdown, tasks).await?;
    Ok(Served {
        readiness,
        file_server,
        tenancy_status,
    })
}

/// /healthz, /readyz and /metrics, and /metrics alone on its own address when one is given
/// (over HTTPS, for authorized clients only, with --metrics-secure).
async fn serve_probes(
    args: &RunArgs,
    env: &PodEnv,
    client: &Client,
    readiness: &Readiness,
    metrics: &Metrics,
    shutdown: &CancellationToken,
    tasks: &mut JoinSet<()>,
) -> Result<(), AppError> {
    // With a metrics address of its own, the probe listener serves the probes alone: the
    // kubelet's slots are never taken by scrapers or by slow readers of /metrics.
    let separate_metrics = args.metrics_bind_address != "0"
        && args.metrics_bind_address != args.health_probe_bind_address;
    if args.metrics_secure && !separate_metrics {
        return Err(AppError::SecureMetricsAddress);
    }
    if let Some(addr) = pko_operator::admin::address(&args.admin_bind_address)? {
        let listener = http::bind(&addr.to_string()).await?;
        tasks.spawn(http::serve(
            "admin",
            listener,
            pko_operator::admin::router(),
            listener_limits(args),
            shutdown.clone().cancelled_owned(),
        ));
    }
    let probe_app = probes::router(readiness.clone(), metrics.clone(), !separate_metrics);
    let probe_listener = http::bind(&args.health_probe_bind_address).await?;
    tasks.spawn(http::serve(
        "probes",
        probe_listener,
        probe_app,
        listener_limits(args),
        shutdown.clone().cancelled_owned(),
    ));
    if args.metrics_secure {
        let (tls, reload) = secure_metrics::certificate(
            args.metrics_cert_path.as_ref(),
            metrics_hosts(env, &args.metrics_service_name),
        )?;
        if let Some(reload) = reload {
            tasks.spawn(reload.run(Duration::from_secs(30), shutdown.clone().cancelled_owned()));
        }
        let auth = Arc::new(secure_metrics::MetricsAuth::new(
            client.clone(),
            secure_metrics::Ttls::default(),
        ));
        let listener = http::bind(&args.metrics_bind_address).await?;
        tasks.spawn(http::serve_tls(
            "metrics",
            listener,
            secure_metrics::router(metrics.clone(), auth),
            listener_limits(args),
            tls,
            shutdown.clone().cancelled_owned(),
        ));
    } else if separate_metrics {
        let listener = http::bind(&args.metrics_bind_address).await?;
        tasks.spawn(http::serve(
            "metrics",
            listener,
            probes::router(readiness.clone(), metrics.clone(), true),
            listener_limits(args),
            shutdown.clone().cancelled_owned(),
        ));
    }
    Ok(())
}

/// Names a self-signed metrics certificate covers: the pod, the metrics Service `service`,
/// loopback.
fn metrics_hosts(env: &PodEnv, service: &str) -> Vec<String> {
    let mut hosts = vec!["localhost".to_owned(), "127.0.0.1".to_owned()];
    hosts.extend(
        env.pod_name
            .clone()
            .or_else(|| env.hostname.clone())
            .filter(|n| !n.is_empty()),
    );
    if let Some(ns) = env.pod_namespace.as_deref().filter(|n| !n.is_empty()) {
        hosts.push(format!("{service}.{ns}.svc"));
        hosts.push(format!("{service}.{ns}.svc.cluster.local"));
    }
    hosts
}

/// The limits of the file-server, probe and metrics listeners, from the `--listener-*` flags.
fn listener_limits(args: &RunArgs) -> http::ServerLimits {
    http::ServerLimits {
        header_read_timeout: args.listener_header_read_timeout,
        max_connections_per_client: args.listener_max_connections_per_client.max(1),
        conn: pko_admission::conn::ConnLimits {
            idle_timeout: args.listener_idle_timeout,
            write_timeout: args.listener_write_timeout,
        },
        ..http::ServerLimits::default()
    }
}

/// Shares the container's memory between the artifact cache, plugin calls and admission
/// evaluations; refuses a configuration that cannot fit.
fn memory_plan(args: &RunArgs) -> Result<memory::Plan, AppError> {
    use memory::{AdmissionDemand, Demands};
    let limit = args.memory_limit.or_else(memory::cgroup_limit);
    let demands = Demands {
        artifact_cache_bytes: args.artifact_cache_bytes,
        plugin_budget_bytes: if args.plugins.plugins_enabled {
            args.plugins.plugin_memory_budget_mib.map(|m| m << 20)
        } else {
            Some(0)
        },
        plugin_default_bytes: args.plugins.default_memory_bytes(),
        plugin_unlimited_bytes: args.plugins.unlimited_memory_budget_bytes(),
        admission: (args.webhook.enabled() && args.scope().1).then(|| AdmissionDemand {
            per_slot_bytes: args.webhook.per_slot_bytes(),
            fixed_bytes: args.webhook.review_limits().body_budget_bytes as u64,
            slots: args.webhook.policy_concurrency,
        }),
        compile_slots: if args.plugins.plugins_enabled {
            u64::from(args.plugins.plugin_max_concurrent_loads)
        } else {
            0
        },
        compile_memory_bytes: args.plugins.plugin_compile_memory_mib.map(|m| m << 20),
    };
    Ok(memory::plan(limit, &demands)?)
}

/// The artifact URL keys, retried while the apiserver is not reachable yet.
async fn load_keys(secret: &KeySecret) -> Result<KeySet, AppError> {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    let mut delay = Duration::from_millis(200);
    loop {
        match secret.load_or_create(capability::unix_now()).await {
            Ok(keys) => return Ok(keys),
            Err(err) if tokio::time::Instant::now() + delay < deadline => {
                tracing::warn!(error = %err, "artifact URL keys not readable yet; retrying");
                tokio::time::sleep(delay).await;
                delay = (delay * 2).min(Duration::from_secs(5));
            }
            Err(err) => return Err(AppError::Keys(err)),
        }
    }
}

/// Resolves when `task` ends; never when there is none.
async fn task_ended(task: &mut Option<JoinHandle<()>>) {
    match task {
        Some(handle) => {
            let _ = handle.await;
        }
        None => std::future::pending().await,
    }
}

/// A client for `args`; `request_timeout` bounds every request: its response headers, then each
/// wait for more of the body (not for watches, which stay open for minutes by design).
///
/// Not kube's `read_timeout`: that one times the socket, so a pooled keep-alive connection
/// idle for that long is closed under a request about to reuse it, which then fails with
/// `SendRequest` (the lease client, idle between renewals, hit exactly that).
async fn kube_client(
    args: &RunArgs,
    request_timeout: Option<Duration>,
    metrics: &Metrics,
) -> Result<Client, AppError> {
    let mut config = match &args.kubeconfig {
        Some(path) => {
            let kubeconfig =
                Kubeconfig::read_from(path).map_err(|source| AppError::ReadKubeconfig {
                    path: path.clone(),
                    source,
                })?;
            kube::Config::from_custom_kubeconfig(kubeconfig, &KubeConfigOptions::default())
                .await
                .map_err(|source| AppError::LoadKubeconfig {
                    path: path.clone(),
                    source,
                })?
        }
        None => kube::Config::infer().await.map_err(AppError::InferConfig)?,
    };
    let timeout = Duration::from_secs(args.kube_api_timeout_seconds);
    config.write_timeout = Some(timeout);
    config.connect_timeout = Some(timeout);
    // Outermost: each request counts once, with the answer its caller got.
    let counted = RestMetricsLayer::new(metrics.runtime.rest.clone(), &config.cluster_url);
    let builder = kube::client::ClientBuilder::try_from(config).map_err(AppError::Client)?;
    Ok(match request_timeout {
        Some(bound) => builder
            .with_layer(&tower_http::timeout::ResponseBodyTimeoutLayer::new(bound))
            .with_layer(&tower::timeout::TimeoutLayer::new(bound))
            .with_layer(&counted)
            .build(),
        None => builder.with_layer(&counted).build(),
    })
}

async fn wait_for_signal() -> Result<(), AppError> {
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
        .map_err(AppError::SigtermHandler)?;
    tokio::select! {
        _ = term.recv() => {},
        result = tokio::signal::ctrl_c() => result.map_err(AppError::CtrlC)?,
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A release's metrics Service, not a fixed name, is in the self-signed certificate.
    #[test]
    fn the_metrics_certificate_names_the_service_it_is_given() {
        let env = PodEnv {
            hostname: None,
            pod_name: Some("op-0".into()),
            pod_namespace: Some("team".into()),
        };
        let hosts = metrics_hosts(&env, "ops-pko-rs-metrics");
        assert!(hosts.contains(&"ops-pko-rs-metrics.team.svc".to_owned()));
        assert!(hosts.contains(&"ops-pko-rs-metrics.team.svc.cluster.local".to_owned()));
        assert!(!hosts.iter().any(|h| h.starts_with("pko-rs-metrics")));
    }
}
