//! The pko-rs operator binary.
#![allow(
    clippy::disallowed_methods,
    reason = "main reads the environment once and passes the values down"
)]

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use clap::{Parser, Subcommand};
use kube::api::DynamicObject;
use kube::config::{KubeConfigOptions, Kubeconfig};
use kube::discovery::ApiResource;
use kube::{Api, Client};
use pko_api::duration::parse_go_duration;
use pko_api::program::Program;
use pko_api::stack::Stack;
use pko_operator::capability::{self, KeyRing, KeySecret, KeySet, RotationPolicy};
use pko_operator::config::AdvertisedAddress;
use pko_operator::controller::kit::Kit;
use pko_operator::controller::program::{self, ProgramContext};
use pko_operator::fileserver::{self, FileServer};
use pko_operator::http;
use pko_operator::leader::{self, ElectionConfig, Leadership};
use pko_operator::metrics::Metrics;
use pko_operator::probes::{self, Readiness};
use pko_operator::stack_metrics;
use pko_operator::telemetry::{self, LogFormat};
use tokio_util::sync::CancellationToken;
use tracing::info;

/// Flag names follow PKO's where PKO has them, so existing manifests keep working.
#[derive(Parser, Debug)]
#[command(
    name = "pko-operator",
    version,
    about = "Pulumi Kubernetes Operator, in Rust"
)]
#[command(args_conflicts_with_subcommands = true)]
struct Cli {
    #[command(subcommand)]
    command: Option<Command>,
    #[command(flatten)]
    run: RunArgs,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Write the CRD manifests (deploy/crds) generated from the Rust types.
    Crdgen {
        /// Output folder.
        #[arg(long, default_value = "deploy/crds")]
        out: PathBuf,
    },
    /// Run a Program manifest through its transforms offline and print the resulting
    /// Pulumi.yaml (or, with --diff, a unified diff against the untransformed one).
    Render(pko_operator::offline::RenderArgs),
    /// Tools for plugin authors.
    Plugin {
        #[command(subcommand)]
        command: PluginCommand,
    },
}

#[derive(Subcommand, Debug)]
enum PluginCommand {
    /// Run a component against fixture cases: input, config, expected output or error.
    Test(pko_operator::offline::PluginTestArgs),
}

#[derive(clap::Args, Debug)]
struct RunArgs {
    /// Address the Program file server binds (":9090" = every interface).
    #[arg(long, env = "PROGRAM_FS_ADDR", default_value = ":9090")]
    program_fs_addr: String,
    /// Address written into artifact URLs; derived from --program-fs-addr when empty.
    #[arg(long, env = "PROGRAM_FS_ADV_ADDR")]
    program_fs_adv_addr: Option<String>,
    /// Address of /healthz, /readyz and /metrics.
    #[arg(long, default_value = ":8081")]
    health_probe_bind_address: String,
    /// Extra address serving /metrics ("0" disables it).
    #[arg(long, default_value = "0")]
    metrics_bind_address: String,
    /// Watch Programs in this namespace only (default: every namespace).
    #[arg(long, env = "WATCH_NAMESPACE")]
    watch_namespace: Option<String>,
    /// Kubeconfig file; in-cluster config or $KUBECONFIG when absent.
    #[arg(long, env = "KUBECONFIG")]
    kubeconfig: Option<PathBuf>,
    /// Timeout of each apiserver request, in seconds.
    #[arg(long, env = "KUBE_API_TIMEOUT_SECONDS", default_value_t = 30)]
    kube_api_timeout_seconds: u64,
    /// Reconciles run at once per controller.
    #[arg(long, env = "MAX_CONCURRENT_RECONCILES", default_value_t = 25)]
    max_concurrent_reconciles: u16,
    /// Bytes of built artifacts kept in memory for the file server. Unset: 256 MiB, or a
    /// quarter of the memory limit when that is less.
    #[arg(long, env = "ARTIFACT_CACHE_BYTES")]
    artifact_cache_bytes: Option<u64>,
    /// The container's memory limit (`512Mi`, `1Gi`, bytes), when the cgroup does not say it;
    /// plugin and admission budgets are derived from it (docs/operations.md).
    #[arg(long, env = "MEMORY_LIMIT", value_parser = parse_memory_limit)]
    memory_limit: Option<u64>,
    /// Secret (in --artifact-keys-namespace) holding the keys that sign artifact URLs; every
    /// replica reads it by name, the first one creates it.
    #[arg(
        long,
        env = "ARTIFACT_KEYS_SECRET",
        default_value = "pko-rs-artifact-keys"
    )]
    artifact_keys_secret: String,
    /// Namespace of that Secret. Default: $POD_NAMESPACE. With neither, each process signs with
    /// a key of its own (one replica only: others could not verify its URLs).
    #[arg(long, env = "ARTIFACT_KEYS_NAMESPACE")]
    artifact_keys_namespace: Option<String>,
    /// The leader adds a new artifact URL key when the newest one is this old.
    #[arg(long, env = "ARTIFACT_KEY_MAX_AGE", default_value = "720h", value_parser = parse_go_duration)]
    artifact_key_max_age: Duration,
    /// An old key keeps verifying this long after a newer key started signing, so URLs signed
    /// with it (re-signed at once) stay valid for workspaces already fetching them.
    #[arg(long, env = "ARTIFACT_KEY_OVERLAP", default_value = "24h", value_parser = parse_go_duration)]
    artifact_key_overlap: Duration,
    /// How long the file server waits for this replica's watch before it answers 404 for a
    /// Program, or a generation, that it has not seen yet (a URL just published by the leader).
    #[arg(long, env = "ARTIFACT_PUBLISH_WAIT", default_value = "2s", value_parser = parse_go_duration)]
    artifact_publish_wait: Duration,
    /// Log format (`console` is accepted for PKO's zap encoder name).
    #[arg(
        long,
        alias = "zap-encoder",
        env = "LOG_FORMAT",
        value_enum,
        default_value = "text"
    )]
    log_format: LogFormat,
    /// Log level or RUST_LOG-style filter.
    #[arg(
        long,
        alias = "zap-log-level",
        env = "LOG_LEVEL",
        default_value = "info"
    )]
    log_level: String,
    /// Workspace, Update and Stack controllers.
    #[command(flatten)]
    execution: pko_operator::controller::execution::ExecutionArgs,
    /// Run the controllers only on the replica holding the leader lease; the file server and
    /// probes run on every replica either way. `--leader-elect` alone means true.
    #[arg(
        long,
        env = "LEADER_ELECT",
        num_args = 0..=1,
        default_value_t = false,
        default_missing_value = "true",
        action = clap::ArgAction::Set
    )]
    leader_elect: bool,
    /// Name of the leader-election Lease.
    #[arg(long, env = "LEADER_ELECTION_ID", default_value = "pko-rs-operator")]
    leader_election_id: String,
    /// Namespace of the leader-election Lease; default $POD_NAMESPACE, then the in-cluster
    /// service account's namespace.
    #[arg(long, env = "LEADER_ELECTION_NAMESPACE")]
    leader_election_namespace: Option<String>,
    /// How long a lease stays valid after its last renewal (a Go duration).
    #[arg(long, env = "LEADER_ELECTION_LEASE_DURATION", default_value = "60s", value_parser = parse_go_duration)]
    leader_election_lease_duration: Duration,
    /// The leader renews its lease this long after the last renewal.
    #[arg(long, env = "LEADER_ELECTION_RENEW_DEADLINE", default_value = "45s", value_parser = parse_go_duration)]
    leader_election_renew_deadline: Duration,
    /// Pause after a failed lease request; also the timeout of each lease request.
    #[arg(long, env = "LEADER_ELECTION_RETRY_PERIOD", default_value = "10s", value_parser = parse_go_duration)]
    leader_election_retry_period: Duration,
    /// After SIGTERM: how long in-flight reconciles and requests get to finish.
    #[arg(long, env = "GRACEFUL_SHUTDOWN_TIMEOUT", default_value = "30s", value_parser = parse_go_duration)]
    graceful_shutdown_timeout: Duration,
    #[command(flatten)]
    webhook: pko_admission::cli::WebhookArgs,
    #[command(flatten)]
    plugins: pko_operator::transform::PluginArgs,
    #[command(flatten)]
    egress: pko_operator::egress::EgressArgs,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    match cli.command {
        Some(Command::Crdgen { out }) => {
            pko_api::crdgen::write_all(&out)
                .with_context(|| format!("writing CRDs to {}", out.display()))?;
            println!("wrote CRDs to {}", out.display());
            Ok(())
        }
        Some(Command::Render(args)) => {
            let rendered = pko_operator::offline::render(&args).await?;
            for note in &rendered.notes {
                eprintln!("# {note}");
            }
            print!("{}", rendered.output);
            Ok(())
        }
        Some(Command::Plugin {
            command: PluginCommand::Test(args),
        }) => {
            let results = pko_operator::offline::plugin_test(&args).await?;
            let failed = results.iter().filter(|r| r.outcome.is_err()).count();
            for result in &results {
                match &result.outcome {
                    Ok(()) => println!("ok    {}", result.name),
                    Err(why) => println!(
                        "FAIL  {} ({})\n      {}",
                        result.name,
                        result.file.display(),
                        why.replace('\n', "\n      ")
                    ),
                }
            }
            println!("{} passed, {failed} failed", results.len() - failed);
            if failed > 0 {
                anyhow::bail!("{failed} case(s) failed");
            }
            Ok(())
        }
        None => run(cli.run).await,
    }
}

fn parse_memory_limit(text: &str) -> Result<u64, String> {
    pko_operator::memory::parse_quantity(text).map_err(|e| e.to_string())
}

/// Shares the container's memory between the artifact cache, plugin calls and admission
/// evaluations; refuses a configuration that cannot fit.
fn memory_plan(args: &RunArgs) -> anyhow::Result<pko_operator::memory::Plan> {
    use pko_operator::memory::{AdmissionDemand, Demands};
    let limit = args
        .memory_limit
        .or_else(pko_operator::memory::cgroup_limit);
    let demands = Demands {
        artifact_cache_bytes: args.artifact_cache_bytes,
        plugin_budget_bytes: if args.plugins.plugins_enabled {
            args.plugins.plugin_memory_budget_mib.map(|m| m << 20)
        } else {
            Some(0)
        },
        plugin_default_bytes: args.plugins.default_memory_bytes(),
        plugin_unlimited_bytes: args.plugins.unlimited_memory_budget_bytes(),
        admission: args.webhook.enabled().then(|| AdmissionDemand {
            per_slot_bytes: args.webhook.per_slot_bytes(),
            fixed_bytes: args.webhook.review_limits().body_budget_bytes as u64,
            slots: args.webhook.policy_concurrency,
        }),
    };
    Ok(pko_operator::memory::plan(limit, &demands)?)
}

async fn run(args: RunArgs) -> anyhow::Result<()> {
    telemetry::init(args.log_format, &args.log_level)?;
    let memory = memory_plan(&args)?;
    info!("{}", memory.describe());
    // kube and rustls must agree on one crypto provider; ring is the only one linked.
    let _ = rustls::crypto::ring::default_provider().install_default();

    let client = kube_client(&args, None).await?;
    let admission_metrics = pko_admission::AdmissionMetrics::new();
    let metrics = Metrics::with_extra(|registry| admission_metrics.register(registry));
    let shutdown = CancellationToken::new();
    let hostname = std::env::var("HOSTNAME").ok();
    let advertised = AdvertisedAddress::resolve(
        &args.program_fs_addr,
        args.program_fs_adv_addr.as_deref(),
        hostname.as_deref(),
    );
    info!(advertised = advertised.as_str(), "artifact URLs");

    let programs: Api<Program> = match args.watch_namespace.as_deref().filter(|n| !n.is_empty()) {
        Some(namespace) => Api::namespaced(client.clone(), namespace),
        None => Api::all(client.clone()),
    };
    // Where the operator may connect for a tenant's URL (git refs, https modules).
    let egress = Arc::new(pko_operator::egress::EgressPolicy::from_args(&args.egress));
    // Transform plugins, on every replica: each file server runs the chains too.
    let transforms = if args.plugins.plugins_enabled {
        Some(pko_operator::transform::TransformRegistry::from_args(
            &args.plugins,
            client.clone(),
            metrics.plugins.clone(),
            egress.clone(),
            memory.plugin_budget_bytes,
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
    let mut tasks = tokio::task::JoinSet::new();
    if let Some(transforms) = &transforms {
        let driver = transforms.clone().run(
            client.clone(),
            args.watch_namespace.clone().filter(|n| !n.is_empty()),
        );
        let stop = shutdown.clone();
        tasks.spawn(async move {
            tokio::select! {
                () = driver => {},
                () = stop.cancelled() => {},
            }
        });
    }
    {
        let stop = shutdown.clone();
        tasks.spawn(async move {
            tokio::select! {
                () = index_driver => {},
                () = stop.cancelled() => {},
            }
        });
    }

    // Stack gauges: a watch on every replica, like the Program watch above.
    let stack_resource = ApiResource::erase::<Stack>(&());
    let stacks: Api<DynamicObject> = match args.watch_namespace.as_deref().filter(|n| !n.is_empty())
    {
        Some(namespace) => Api::namespaced_with(client.clone(), namespace, &stack_resource),
        None => Api::all_with(client.clone(), &stack_resource),
    };
    let (stacks_synced, stacks_driver) = stack_metrics::watch(stacks, metrics.clone());
    {
        let stop = shutdown.clone();
        tasks.spawn(async move {
            tokio::select! {
                () = stacks_driver => {},
                () = stop.cancelled() => {},
            }
        });
    }

    // Artifact URL keys: read (or created) before the file server can verify a single URL.
    let key_secret = args
        .artifact_keys_namespace
        .clone()
        .or_else(|| std::env::var("POD_NAMESPACE").ok())
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

    let fs_listener = http::bind(&args.program_fs_addr).await?;
    let fs_app = fileserver::router(FileServer {
        index: index.clone(),
        metrics: metrics.clone(),
        keys: keys.clone(),
    });
    tasks.spawn(http::serve(
        "fileserver",
        fs_listener,
        fs_app,
        http::ServerLimits::default(),
        shutdown.clone().cancelled_owned(),
    ));

    let mut checks = vec![
        ("program cache", index.synced_flag()),
        ("stack cache", stacks_synced),
    ];
    if let Some(transforms) = &transforms {
        checks.push(("transforms", transforms.synced_flag()));
    }
    // Admission webhook, on every replica: policies, tenancy data and its own certificate.
    let fs_host = advertised.as_str().split_once("://").map(|(_, host)| host);
    let pod_namespace = std::env::var("POD_NAMESPACE").ok();
    let webhook_config =
        args.webhook
            .config(fs_host, pod_namespace.as_deref(), memory.admission_slots)?;
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
    let probe_app = probes::router(readiness.clone(), metrics.clone());
    let probe_listener = http::bind(&args.health_probe_bind_address).await?;
    tasks.spawn(http::serve(
        "probes",
        probe_listener,
        probe_app.clone(),
        http::ServerLimits::default(),
        shutdown.clone().cancelled_owned(),
    ));
    if args.metrics_bind_address != "0"
        && args.metrics_bind_address != args.health_probe_bind_address
    {
        let listener = http::bind(&args.metrics_bind_address).await?;
        tasks.spawn(http::serve(
            "metrics",
            listener,
            probe_app,
            http::ServerLimits::default(),
            shutdown.clone().cancelled_owned(),
        ));
    }

    // The pod's name is read once: Events and the leader identity report it.
    let pod_name = std::env::var("POD_NAME").ok();
    let kit = Kit::new(client.clone(), metrics.clone(), pod_name.clone());
    let ctx = Arc::new(ProgramContext::new(&kit, advertised, index.clone(), keys));
    let rotation = RotationPolicy {
        max_age: args.artifact_key_max_age,
        overlap: args.artifact_key_overlap,
    };
    // The lease is released only after the controllers stop, hence its own stop token.
    let election_stop = CancellationToken::new();
    let (leadership, mut election_task) = if args.leader_elect {
        let name = pod_name.as_deref().filter(|n| !n.is_empty());
        let config = election_config(&args, name.or(hostname.as_deref()))?;
        let lease_client =
            kube_client(&args, Some(config.retry_period.max(Duration::from_secs(1)))).await?;
        let (leadership, task) =
            leader::spawn_election(lease_client, config, metrics.clone(), election_stop.clone())?;
        (leadership, Some(task))
    } else {
        metrics.leader.set(1);
        (Leadership::always(), None)
    };
    let concurrency = args.max_concurrent_reconciles;
    // Every controller runs here, on the leader only, and stops when leadership ends.
    let execution_args = args.execution.clone();
    let execution_namespace = args.watch_namespace.clone().filter(|n| !n.is_empty());
    let controllers = move |stop: CancellationToken| {
        let ctx = ctx.clone();
        let execution = pko_operator::controller::execution::run(
            kit.clone(),
            execution_namespace.clone(),
            execution_args.clone(),
            concurrency,
            pko_operator::controller::execution::TenantBounds {
                egress: egress.clone(),
                file_server: file_server.clone(),
            },
            stop.clone(),
        );
        let transform_status = transforms.clone().map(|registry| {
            pko_operator::controller::transform_status::run(
                registry,
                kit.clone(),
                stop.clone().cancelled_owned(),
            )
        });
        let tenancy = tenancy_status.then(|| {
            pko_operator::controller::tenancy::run(
                Arc::new(pko_operator::controller::tenancy::TenancyContext::new(&kit)),
                stop.clone().cancelled_owned(),
            )
        });
        let rotate = key_secret
            .clone()
            .map(|secret| capability::rotate(secret, rotation, stop.clone()));
        async move {
            if let Some(rotate) = rotate {
                tokio::spawn(rotate);
            }
            let programs = program::run(ctx, concurrency, stop.cancelled_owned());
            let programs = async move {
                match tenancy {
                    Some(tenancy) => {
                        tokio::join!(programs, execution, tenancy);
                    }
                    None => {
                        tokio::join!(programs, execution);
                    }
                }
            };
            match transform_status {
                Some(status) => {
                    tokio::join!(programs, status);
                }
                None => programs.await,
            }
        }
    };
    let controllers_task = tokio::spawn(leader::run_while_leader(
        leadership,
        shutdown.clone(),
        args.graceful_shutdown_timeout,
        controllers,
    ));

    let election_died = tokio::select! {
        signal = wait_for_signal() => { signal?; false }
        () = task_ended(&mut election_task) => true,
    };
    info!("shutting down");
    readiness.start_draining();
    shutdown.cancel();
    let deadline = tokio::time::Instant::now() + args.graceful_shutdown_timeout;
    if tokio::time::timeout_at(deadline, controllers_task)
        .await
        .is_err()
    {
        tracing::warn!("controllers did not stop within the graceful shutdown timeout");
    }
    election_stop.cancel();
    if let Some(task) = election_task {
        // The election task bounds the release itself; this is the backstop.
        let _ = tokio::time::timeout(Duration::from_secs(10), task).await;
    }
    // Listeners and watches drain within their own bounds; this is the backstop.
    let drained = tokio::time::timeout_at(deadline, async {
        while tasks.join_next().await.is_some() {}
    })
    .await;
    if drained.is_err() {
        tracing::warn!("shutdown timed out");
    }
    if election_died {
        anyhow::bail!("leader election ended unexpectedly");
    }
    Ok(())
}

/// The artifact URL keys, retried while the apiserver is not reachable yet.
async fn load_keys(secret: &KeySecret) -> anyhow::Result<KeySet> {
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
            Err(err) => return Err(err).context("loading the artifact URL keys"),
        }
    }
}

/// Resolves when `task` ends; never when there is none.
async fn task_ended(task: &mut Option<tokio::task::JoinHandle<()>>) {
    match task {
        Some(handle) => {
            let _ = handle.await;
        }
        None => std::future::pending().await,
    }
}

/// `name`: the pod's name, else the host's, in the holder identity.
fn election_config(args: &RunArgs, name: Option<&str>) -> anyhow::Result<ElectionConfig> {
    let namespace = args
        .leader_election_namespace
        .clone()
        .filter(|n| !n.is_empty())
        .or_else(|| {
            std::env::var("POD_NAMESPACE")
                .ok()
                .filter(|n| !n.is_empty())
        })
        .or_else(|| {
            std::fs::read_to_string("/var/run/secrets/kubernetes.io/serviceaccount/namespace")
                .ok()
                .map(|n| n.trim().to_owned())
                .filter(|n| !n.is_empty())
        })
        .context("--leader-elect needs --leader-election-namespace (or $POD_NAMESPACE)")?;
    let config = ElectionConfig {
        lease_name: args.leader_election_id.clone(),
        namespace,
        identity: leader::default_identity(name),
        lease_duration: args.leader_election_lease_duration,
        renew_deadline: args.leader_election_renew_deadline,
        retry_period: args.leader_election_retry_period,
    };
    config.timings()?;
    Ok(config)
}

/// A client for `args`; `read_timeout` bounds every response (not for watches).
async fn kube_client(args: &RunArgs, read_timeout: Option<Duration>) -> anyhow::Result<Client> {
    let mut config = match &args.kubeconfig {
        Some(path) => {
            let kubeconfig = Kubeconfig::read_from(path)
                .with_context(|| format!("reading kubeconfig {}", path.display()))?;
            kube::Config::from_custom_kubeconfig(kubeconfig, &KubeConfigOptions::default())
                .await
                .with_context(|| format!("loading kubeconfig {}", path.display()))?
        }
        None => kube::Config::infer()
            .await
            .context("no kubeconfig given and no in-cluster config found")?,
    };
    let timeout = Duration::from_secs(args.kube_api_timeout_seconds);
    // No read timeout: watches stay open for minutes by design.
    config.write_timeout = Some(timeout);
    config.connect_timeout = Some(timeout);
    if let Some(read_timeout) = read_timeout {
        config.read_timeout = Some(read_timeout);
    }
    Client::try_from(config).context("building the Kubernetes client")
}

async fn wait_for_signal() -> anyhow::Result<()> {
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
        .context("installing the SIGTERM handler")?;
    tokio::select! {
        _ = term.recv() => {},
        result = tokio::signal::ctrl_c() => result.context("waiting for Ctrl-C")?,
    }
    Ok(())
}
