//! The pko-rs operator binary: arguments, the environment, logging; [`app`] runs the operator.

mod app;

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use anyhow::{Context, bail};
use clap::{Parser, Subcommand};
use pko_api::duration::parse_go_duration;
use pko_operator::metrics::ObjectLabels;
use pko_operator::telemetry::{self, LogFormat};

use app::{App, PodEnv};

/// musl's allocator (one lock for every thread) made the shipped static build cost far more
/// CPU than the glibc build on the Program path; jemalloc, chosen by measurement (mimalloc was
/// as fast but held 2-4x the memory), closes that at the glibc build's RSS.
#[cfg(target_env = "musl")]
#[global_allocator]
static GLOBAL: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;

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
    /// Publish a component to a registry as an OCI Wasm artifact; prints its digests.
    Push(pko_operator::oci::push::PushArgs),
    /// The operator's module compiler: a component on stdin, its machine code for this
    /// binary's engine on stdout. The operator runs it as a bounded child process.
    #[command(hide = true)]
    Compile {
        /// Each linear memory's reservation in the operator's engine.
        #[arg(long)]
        memory_reservation_bytes: u64,
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
    /// Loopback address of the admin listener (`GET`/`PUT /log-level`), reached with
    /// `kubectl port-forward`; "0" disables it. Only loopback addresses are taken.
    #[arg(long, default_value = "0")]
    admin_bind_address: String,
    /// Serve /metrics on --metrics-bind-address over HTTPS, to clients whose bearer token the
    /// apiserver authenticates (TokenReview) and whose user may `get` the non-resource URL
    /// /metrics (SubjectAccessReview), as PKO's flag does. Off: plain HTTP, no authentication.
    /// `--metrics-secure` alone means true.
    #[arg(
        long,
        env = "METRICS_SECURE",
        num_args = 0..=1,
        default_value_t = false,
        default_missing_value = "true",
        action = clap::ArgAction::Set
    )]
    metrics_secure: bool,
    /// With --metrics-secure: a folder with the serving certificate (`tls.crt`, `tls.key`, e.g.
    /// a mounted Secret), reloaded when they change. Without it, a self-signed certificate is
    /// made at start.
    #[arg(long, env = "METRICS_CERT_PATH")]
    metrics_cert_path: Option<PathBuf>,
    /// The metrics Service's name (in $POD_NAMESPACE): its DNS names go into the self-signed
    /// metrics certificate. The chart passes its release's name.
    #[arg(long, env = "METRICS_SERVICE_NAME", default_value = "pko-rs-metrics")]
    metrics_service_name: String,
    /// What per-object metric series are labelled with. `names`: each Stack's namespace and
    /// name, each transform object and plugin name (PKO's series). `none`: no namespace, name
    /// or plugin name in any label; the Stack gauges count Stacks and the plugin series are by
    /// transform kind. The installs set `none`, since /metrics readers would otherwise see
    /// every tenant's names.
    #[arg(
        long,
        env = "METRICS_OBJECT_LABELS",
        value_enum,
        default_value = "names"
    )]
    metrics_object_labels: ObjectLabels,
    /// Connections one client address may hold on the file-server, probe and metrics
    /// listeners (each); more from it are closed at once.
    #[arg(
        long,
        env = "LISTENER_MAX_CONNECTIONS_PER_CLIENT",
        default_value_t = 16
    )]
    listener_max_connections_per_client: usize,
    /// Time a client of those listeners gets to send each request's head.
    #[arg(long, env = "LISTENER_HEADER_READ_TIMEOUT", default_value = "10s", value_parser = parse_go_duration)]
    listener_header_read_timeout: Duration,
    /// A connection to those listeners without a request in flight for this long is closed.
    #[arg(long, env = "LISTENER_IDLE_TIMEOUT", default_value = "30s", value_parser = parse_go_duration)]
    listener_idle_timeout: Duration,
    /// A connection to those listeners whose peer does not read an answer for this long is
    /// closed.
    #[arg(long, env = "LISTENER_WRITE_TIMEOUT", default_value = "10s", value_parser = parse_go_duration)]
    listener_write_timeout: Duration,
    /// Namespace-scoped mode: watch and reconcile in these namespaces only (comma-separated).
    /// Nothing cluster-scoped is watched: ClusterProgramTransforms, TenancyPolicies, Namespace
    /// labels and the admission webhook are off. Default: every namespace.
    #[arg(
        long,
        env = "WATCH_NAMESPACES",
        value_delimiter = ',',
        conflicts_with = "watch_namespace"
    )]
    watch_namespaces: Vec<String>,
    /// One namespace's Programs, Stacks, Workspaces and Updates only, with the cluster-scoped
    /// parts still on (PKO's flag; for development and tests, the installs use
    /// --watch-namespaces).
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

fn main() -> anyhow::Result<ExitCode> {
    let cli = Cli::parse();
    // The compiler child starts no runtime: its threads' stacks would count against its
    // memory bound.
    if let Some(Command::Plugin {
        command: PluginCommand::Compile {
            memory_reservation_bytes,
        },
    }) = cli.command
    {
        return Ok(pko_plugin_host::compiler::child_main(
            memory_reservation_bytes,
        ));
    }
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("starting the async runtime")?;
    runtime.block_on(run_command(cli))?;
    Ok(ExitCode::SUCCESS)
}

async fn run_command(cli: Cli) -> anyhow::Result<()> {
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
        Some(Command::Plugin {
            command: PluginCommand::Push(args),
        }) => {
            let (reference, pushed) = pko_operator::oci::push::push(&args).await?;
            print!("{}", pko_operator::oci::push::summary(&reference, &pushed));
            Ok(())
        }
        Some(Command::Plugin {
            command: PluginCommand::Compile { .. },
        }) => bail!("plugin compile runs before the runtime starts"),
        None => run(cli.run).await,
    }
}

fn parse_memory_limit(text: &str) -> Result<u64, String> {
    pko_operator::memory::parse_quantity(text).map_err(|e| e.to_string())
}

/// The pod's identity from the environment, read once here (the only place the process
/// reads its environment itself).
#[allow(
    clippy::disallowed_methods,
    reason = "main reads the environment once and passes the values down"
)]
fn pod_env() -> PodEnv {
    PodEnv {
        hostname: std::env::var("HOSTNAME").ok(),
        pod_name: std::env::var("POD_NAME").ok(),
        pod_namespace: std::env::var("POD_NAMESPACE").ok(),
    }
}

async fn run(args: RunArgs) -> anyhow::Result<()> {
    telemetry::init(args.log_format, &args.log_level)?;
    let app = App::build(args, pod_env()).await?;
    Ok(app.run().await?)
}

impl RunArgs {
    /// The namespaces the namespaced watches cover, and whether anything cluster-scoped is
    /// watched (not with --watch-namespaces: that install has no cluster-wide rights).
    fn scope(&self) -> (pko_operator::scope::WatchScope, bool) {
        use pko_operator::scope::WatchScope;
        let listed = WatchScope::from_names(&self.watch_namespaces);
        if listed != WatchScope::All {
            return (listed, false);
        }
        (WatchScope::from_names(self.watch_namespace.iter()), true)
    }
}
