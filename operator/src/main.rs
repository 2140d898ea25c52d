//! The pko-rs operator binary.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use clap::{Parser, Subcommand};
use kube::config::{KubeConfigOptions, Kubeconfig};
use kube::{Api, Client};
use pko_api::program::Program;
use pko_operator::config::AdvertisedAddress;
use pko_operator::controller::program::{self, ProgramContext};
use pko_operator::fileserver::{self, FileServer, server};
use pko_operator::metrics::Metrics;
use pko_operator::probes::{self, Readiness};
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
    /// Bytes of built artifacts kept in memory for the file server.
    #[arg(long, env = "ARTIFACT_CACHE_BYTES", default_value_t = 256 * 1024 * 1024)]
    artifact_cache_bytes: u64,
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
        None => run(cli.run).await,
    }
}

async fn run(args: RunArgs) -> anyhow::Result<()> {
    telemetry::init(args.log_format, &args.log_level)?;
    // kube and rustls must agree on one crypto provider; ring is the only one linked.
    let _ = rustls::crypto::ring::default_provider().install_default();

    let client = kube_client(&args).await?;
    let metrics = Metrics::new();
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
    let (index, index_driver) =
        fileserver::index::watch(programs.clone(), args.artifact_cache_bytes, metrics.clone());
    let mut tasks = tokio::task::JoinSet::new();
    {
        let stop = shutdown.clone();
        tasks.spawn(async move {
            tokio::select! {
                () = index_driver => {},
                () = stop.cancelled() => {},
            }
        });
    }

    let fs_listener = server::bind(&args.program_fs_addr).await?;
    let fs_app = fileserver::router(FileServer {
        index: index.clone(),
        metrics: metrics.clone(),
    });
    tasks.spawn(server::serve(
        "fileserver",
        fs_listener,
        fs_app,
        server::ServerLimits::default(),
        shutdown.clone().cancelled_owned(),
    ));

    let readiness = Readiness::new(vec![("program cache", index.synced_flag())]);
    let probe_app = probes::router(readiness, metrics.clone());
    let probe_listener = server::bind(&args.health_probe_bind_address).await?;
    tasks.spawn(server::serve(
        "probes",
        probe_listener,
        probe_app.clone(),
        server::ServerLimits::default(),
        shutdown.clone().cancelled_owned(),
    ));
    if args.metrics_bind_address != "0"
        && args.metrics_bind_address != args.health_probe_bind_address
    {
        let listener = server::bind(&args.metrics_bind_address).await?;
        tasks.spawn(server::serve(
            "metrics",
            listener,
            probe_app,
            server::ServerLimits::default(),
            shutdown.clone().cancelled_owned(),
        ));
    }

    let ctx = Arc::new(ProgramContext::new(
        client.clone(),
        advertised,
        index.clone(),
        metrics.clone(),
    ));
    tasks.spawn(program::run(
        programs,
        ctx,
        args.max_concurrent_reconciles,
        shutdown.clone().cancelled_owned(),
    ));

    wait_for_signal().await?;
    info!("shutting down");
    shutdown.cancel();
    // Everything above drains within its own bound; this is the backstop.
    let drained = tokio::time::timeout(Duration::from_secs(30), async {
        while tasks.join_next().await.is_some() {}
    })
    .await;
    if drained.is_err() {
        tracing::warn!("shutdown timed out");
    }
    Ok(())
}

async fn kube_client(args: &RunArgs) -> anyhow::Result<Client> {
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
