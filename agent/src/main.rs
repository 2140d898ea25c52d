//! `pko-agent`: the workspace agent binary (`serve`, `init`, `install-self`, `version`; as
//! `tini`, the workspace container's PID 1). It also takes PKO's agent command lines, so PKO's
//! manager can run it in place of its own agent.
#![allow(
    clippy::disallowed_methods,
    reason = "main reads the environment once and passes the values down"
)]

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{Context, bail};
use clap::{Parser, Subcommand, ValueEnum};
use pko_agent::auth::{Auth, Authenticated, TokenAuth};
use pko_agent::git;
use pko_agent::init::{self, FluxFetch};
use pko_agent::kubeauth::{ApiServer, InCluster, KubeAuth, KubeAuthOptions};
use pko_agent::limits::{self, Limits};
use pko_agent::proto::automation_service_server::AutomationServiceServer;
use pko_agent::pulumi::Cli;
use pko_agent::server::{self, Agent};
use pko_agent::tini;
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

#[derive(Parser, Debug)]
#[command(name = "pko-agent", version, about = "pko-rs workspace agent")]
struct Args {
    /// Log level or RUST_LOG-style filter.
    #[arg(long, global = true, env = "AGENT_LOG_LEVEL", default_value = "info")]
    log_level: String,
    /// Debug logging (PKO's agent flag; the same as --log-level=debug).
    #[arg(short = 'v', long, global = true)]
    verbose: bool,
    /// Kubeconfig of the Kubernetes API that `--auth-mode kube` reviews tokens with (PKO's
    /// agent flag); without it, `$KUBECONFIG`, then the pod's service account.
    #[arg(long, global = true, env = "KUBECONFIG")]
    kubeconfig: Option<String>,
    /// Context of --kubeconfig to use instead of its current context.
    #[arg(long, global = true)]
    context: Option<String>,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Serve the AutomationService over the pulumi CLI.
    Serve(ServeArgs),
    /// Fetch the program into the workspace before `serve` starts.
    Init(InitArgs),
    /// Copy this binary to a path (the bootstrap init container puts it in the shared volume).
    InstallSelf {
        /// Destination file.
        dest: PathBuf,
    },
    /// Print the version (PKO's agent subcommand).
    Version,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum AuthMode {
    /// Require the bearer token given by --auth-token-file / AGENT_AUTH_TOKEN.
    Token,
    /// Accept every call (local development only).
    None,
    /// PKO's: review the caller's token with the Kubernetes API (TokenReview for
    /// --kube-audience, then a SubjectAccessReview for `use` of `workspaces/rpc` of the
    /// workspace); plaintext gRPC.
    Kube,
}

#[derive(clap::Args, Debug)]
struct ServeArgs {
    /// The project folder (holding Pulumi.yaml); symlinks are resolved.
    #[arg(short = 'w', long)]
    workspace: PathBuf,
    #[arg(long, default_value = "0.0.0.0")]
    host: String,
    #[arg(long, default_value_t = pko_agent::DEFAULT_PORT)]
    port: u16,
    #[arg(long, value_enum, default_value = "token")]
    auth_mode: AuthMode,
    /// File holding the bearer token (a mounted Secret key).
    #[arg(long, env = "AGENT_AUTH_TOKEN_FILE")]
    auth_token_file: Option<PathBuf>,
    /// The bearer token itself (prefer --auth-token-file).
    #[arg(long, env = "AGENT_AUTH_TOKEN", hide_env_values = true)]
    auth_token: Option<String>,
    /// `--auth-mode kube`: an audience the caller's token must have (`<ws>.<ns>`); repeatable.
    #[arg(long = "kube-audience")]
    kube_audiences: Vec<String>,
    /// `--auth-mode kube`: the Workspace's namespace (the access review's).
    #[arg(long, env = "WORKSPACE_NAMESPACE")]
    kube_workspace_namespace: Option<String>,
    /// `--auth-mode kube`: the Workspace's name (the access review's).
    #[arg(long, env = "WORKSPACE_NAME")]
    kube_workspace_name: Option<String>,
    /// PEM certificate to serve TLS with (with --tls-key-file); plaintext when absent.
    #[arg(long, env = "AGENT_TLS_CERT_FILE")]
    tls_cert_file: Option<PathBuf>,
    /// PEM private key of --tls-cert-file.
    #[arg(long, env = "AGENT_TLS_KEY_FILE")]
    tls_key_file: Option<PathBuf>,
    /// Skip `pulumi install` at start (PKO passes this; the operator calls Install itself).
    #[arg(long)]
    skip_install: bool,
    /// Select (and create) this stack at start.
    #[arg(short = 's', long)]
    stack: Option<String>,
    /// Secrets provider of a stack created by --stack.
    #[arg(long)]
    secrets_provider: Option<String>,
    /// KEY=VALUE lines added to every pulumi command (the pod's $PULUMI_ENV file), if present.
    #[arg(long)]
    env_file: Option<PathBuf>,
    /// Pulumi CLI log verbosity (0: off).
    #[arg(long, default_value_t = 0)]
    pulumi_log_level: u32,
    /// The pulumi executable.
    #[arg(long, env = "PULUMI_CLI", default_value = "pulumi")]
    pulumi: PathBuf,
    /// The folder the pod's Flux-style source was unpacked into (`init --target-dir`): a new
    /// revision goes there (`UpdateSource`) without a new pod. Without it, it cannot.
    #[arg(long, env = "AGENT_SOURCE_DIR")]
    source_dir: Option<PathBuf>,
    /// Development: replaces the artifact URL's host (PKO's SOURCE_CONTROLLER_LOCALHOST).
    #[arg(long, env = "SOURCE_CONTROLLER_LOCALHOST")]
    source_host: Option<String>,
    /// Seconds an interrupted operation may take to stop before it is killed.
    #[arg(long, default_value_t = 60)]
    cancel_grace_seconds: u64,
    /// Bytes of one log line sent or kept: a line of the CLI's output, or one string of an
    /// engine event (a message the program printed, a property value); longer ones are cut and
    /// end with `… [truncated N bytes]`.
    #[arg(
        long,
        env = "AGENT_MAX_LOG_LINE_BYTES",
        default_value_t = limits::DEFAULT_MAX_LOG_LINE_BYTES as u64,
        value_parser = bound_bytes,
    )]
    max_log_line_bytes: u64,
    /// Bytes of one stack output value (its JSON encoding); a longer value is sent as a string
    /// of its first bytes ending with `… [truncated N bytes]`.
    #[arg(
        long,
        env = "AGENT_MAX_OUTPUT_VALUE_BYTES",
        default_value_t = limits::DEFAULT_MAX_OUTPUT_VALUE_BYTES as u64,
        value_parser = bound_bytes,
    )]
    max_output_value_bytes: u64,
}

/// A size bound: at least room for some text and the marker, at most one gRPC message.
fn bound_bytes(text: &str) -> Result<u64, String> {
    let n: u64 = text
        .parse()
        .map_err(|_| format!("{text:?} is not a number of bytes"))?;
    let (min, max) = (
        limits::MIN_BOUND_BYTES as u64,
        limits::MAX_MESSAGE_BYTES as u64,
    );
    if (min..=max).contains(&n) {
        Ok(n)
    } else {
        Err(format!(
            "{n} is out of range: between {min} and {max} bytes"
        ))
    }
}

#[derive(clap::Args, Debug)]
struct InitArgs {
    /// Folder to put the source in (replaced); required except with --local-dir.
    #[arg(short = 't', long)]
    target_dir: Option<PathBuf>,
    /// Use a folder already in the image as the source (only --link is made).
    #[arg(long, conflicts_with_all = ["flux_url", "git_url", "project_name"], requires = "link")]
    local_dir: Option<PathBuf>,
    /// URL of a Flux-style tar.gz artifact.
    #[arg(long, requires = "flux_digest", conflicts_with_all = ["git_url", "project_name"])]
    flux_url: Option<String>,
    /// `sha256:<hex>` digest the artifact must have.
    #[arg(long, requires = "flux_url")]
    flux_digest: Option<String>,
    /// Git repository URL, checked out with the image's `git` CLI (credentials from PKO's
    /// `GIT_USERNAME`/`GIT_PASSWORD`/`GIT_TOKEN`/`GIT_SSH_PRIVATE_KEY`/`GIT_GITHUB_APP_ID`/
    /// `GIT_GITHUB_APP_INSTALLATION_ID`/`GIT_GITHUB_APP_PRIVATE_KEY` env, plus
    /// `GIT_SSH_KNOWN_HOSTS` and `GIT_GITHUB_API_URL`).
    #[arg(long, requires = "git_revision", conflicts_with = "project_name")]
    git_url: Option<String>,
    /// Commit SHA, branch or tag to check out.
    #[arg(long, requires = "git_url")]
    git_revision: Option<String>,
    /// Fetch only the one commit when the server allows it.
    #[arg(long, env = "GIT_SHALLOW")]
    git_shallow: bool,
    /// Trust an SSH host key seen for the first time (ssh's `accept-new`) when no known_hosts
    /// is given (`GIT_SSH_KNOWN_HOSTS`); without it an unknown host is refused.
    #[arg(long, env = "GIT_SSH_ACCEPT_NEW_HOST_KEYS")]
    git_ssh_accept_new_host_keys: bool,
    /// The git executable.
    #[arg(long, env = "GIT_CLI", default_value = "git")]
    git: PathBuf,
    /// Write a minimal Pulumi.yaml with this project name (destroy without the source).
    #[arg(long, requires = "project_runtime")]
    project_name: Option<String>,
    #[arg(long, requires = "project_name")]
    project_runtime: Option<String>,
    /// Largest artifact accepted, in bytes (-1: no limit).
    #[arg(long, env = "FLUX_MAX_UNTAR_SIZE_BYTES", default_value_t = init::DEFAULT_MAX_BYTES as i64, allow_negative_numbers = true)]
    max_size_bytes: i64,
    /// Development: replaces the artifact URL's host (PKO's SOURCE_CONTROLLER_LOCALHOST).
    #[arg(long, env = "SOURCE_CONTROLLER_LOCALHOST")]
    source_host: Option<String>,
    /// Make this path a symlink to the project folder (`<target-dir>/<dir>`).
    #[arg(long)]
    link: Option<PathBuf>,
    /// Project folder inside the source.
    #[arg(long, env = "FLUX_DIR")]
    dir: Option<String>,
}

fn main() -> std::process::ExitCode {
    let argv: Vec<std::ffi::OsString> = std::env::args_os().collect();
    // PKO's container command runs `/share/tini /share/agent -- serve …`: this binary copied as
    // `tini` is that PID 1, and needs no runtime of its own.
    if argv.first().is_some_and(|a| tini::invoked_as_tini(a)) {
        let code = tini::main(argv.get(1..).unwrap_or_default());
        return std::process::ExitCode::from(u8::try_from(code).unwrap_or(1));
    }
    // ssh asking for an SSH key's passphrase during a git fetch (see `askpass`).
    #[allow(
        clippy::disallowed_methods,
        reason = "where the process starts: how ssh called this binary"
    )]
    let askpass_file = std::env::var_os(pko_agent::askpass::FILE_ENV);
    if let Some(file) = pko_agent::askpass::requested(&argv, askpass_file) {
        return pko_agent::askpass::answer(std::path::Path::new(&file));
    }
    let args = Args::parse_from(agent_argv(argv));
    let runtime = match tokio::runtime::Runtime::new() {
        Ok(r) => r,
        Err(e) => {
            eprintln!("pko-agent: cannot start the runtime: {e}");
            return std::process::ExitCode::FAILURE;
        }
    };
    match runtime.block_on(run(args)) {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("Error: {e:?}");
            std::process::ExitCode::FAILURE
        }
    }
}

/// The command line without a `--` right before the subcommand (`agent -- serve …`, which a
/// tini that keeps its separator passes on).
fn agent_argv(mut argv: Vec<std::ffi::OsString>) -> Vec<std::ffi::OsString> {
    if argv.get(1).is_some_and(|a| a == "--") {
        argv.remove(1);
    }
    argv
}

async fn run(args: Args) -> anyhow::Result<()> {
    let level = if args.verbose {
        "debug"
    } else {
        args.log_level.as_str()
    };
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_new(level).context("invalid --log-level")?,
        )
        .with_writer(std::io::stderr)
        .with_ansi(false)
        .init();
    // rustls needs one process-wide crypto provider; ring is the one linked.
    let _ = rustls::crypto::ring::default_provider().install_default();
    let kube = KubeAccess {
        kubeconfig: args.kubeconfig.as_deref().and_then(first_kubeconfig),
        context: args.context.clone(),
        in_cluster: InCluster {
            host: std::env::var("KUBERNETES_SERVICE_HOST").ok(),
            port: std::env::var("KUBERNETES_SERVICE_PORT").ok(),
        },
        pod_service_account: std::env::var("POD_NAMESPACE")
            .ok()
            .zip(std::env::var("POD_SA_NAME").ok()),
    };
    match args.command {
        Command::Serve(a) => serve(a, kube).await,
        Command::Init(a) => run_init(a).await,
        Command::InstallSelf { dest } => install_self(&dest),
        Command::Version => {
            println!("pko-agent {}", pko_agent::VERSION);
            Ok(())
        }
    }
}

/// Where `--auth-mode kube` finds the Kubernetes API (read from the command line and the
/// environment in `main`).
struct KubeAccess {
    kubeconfig: Option<PathBuf>,
    context: Option<String>,
    in_cluster: InCluster,
    pod_service_account: Option<(String, String)>,
}

/// The first file of a `KUBECONFIG`-style list that exists (client-go merges them; one file
/// with the cluster and credentials is what an agent needs).
fn first_kubeconfig(list: &str) -> Option<PathBuf> {
    let paths: Vec<PathBuf> = std::env::split_paths(list)
        .filter(|p| !p.as_os_str().is_empty())
        .collect();
    paths
        .iter()
        .find(|p| p.is_file())
        .or(paths.first())
        .cloned()
}

fn install_self(dest: &Path) -> anyhow::Result<()> {
    let me = std::env::current_exe().context("locating this binary")?;
    if let Some(parent) = dest.parent() {
        std::fs::create_dir_all(parent)
            .with_context(|| format!("creating {}", parent.display()))?;
    }
    std::fs::copy(&me, dest).with_context(|| format!("copying to {}", dest.display()))?;
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(dest, std::fs::Permissions::from_mode(0o755))
        .with_context(|| format!("making {} executable", dest.display()))?;
    println!("installed {}", dest.display());
    Ok(())
}

async fn run_init(a: InitArgs) -> anyhow::Result<()> {
    let max_bytes = u64::try_from(a.max_size_bytes).ok();
    if let (Some(local), Some(link)) = (&a.local_dir, &a.link) {
        let target = init::link_workspace(local, None, link)?;
        info!(link = %link.display(), target = %target.display(), "workspace linked");
        return Ok(());
    }
    let Some(target_dir) = a.target_dir.clone() else {
        bail!("--target-dir is required");
    };
    if let (Some(url), Some(digest)) = (&a.flux_url, &a.flux_digest) {
        let fetch = FluxFetch {
            url: url.clone(),
            digest: digest.clone(),
            max_bytes,
            host_override: a.source_host.clone(),
        };
        init::fetch_flux(&fetch, &target_dir)
            .await
            .with_context(|| format!("fetching {url}"))?;
        info!(target = %target_dir.display(), "source ready");
    } else if let (Some(name), Some(runtime)) = (&a.project_name, &a.project_runtime) {
        init::write_project(&target_dir, name, runtime)?;
        info!(target = %target_dir.display(), "project file written");
    } else if let (Some(url), Some(revision)) = (&a.git_url, &a.git_revision) {
        let fetch = git::GitFetch {
            url: url.clone(),
            revision: revision.clone(),
            shallow: a.git_shallow,
            auth: git::GitAuth {
                ssh_accept_new_host_keys: a.git_ssh_accept_new_host_keys,
                ..git::GitAuth::from_env()
            },
            program: a.git.clone(),
        };
        let commit = git::clone(&fetch, &target_dir)
            .await
            .with_context(|| format!("checking out {revision} of {url}"))?;
        info!(target = %target_dir.display(), %commit, "source ready");
    } else {
        bail!("one of --flux-url, --git-url or --project-name is required");
    }
    if let Some(link) = &a.link {
        let target = init::link_workspace(&target_dir, a.dir.as_deref(), link)?;
        info!(link = %link.display(), target = %target.display(), "workspace linked");
    }
    Ok(())
}

/// `KEY=VALUE` lines (optionally `export `, quotes, `#` comments), as godotenv reads them.
fn read_env_file(path: &Path) -> anyhow::Result<Vec<(String, String)>> {
    let text = match std::fs::read_to_string(path) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(e).with_context(|| format!("reading {}", path.display())),
    };
    Ok(text
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty() && !l.starts_with('#'))
        .filter_map(|l| {
            let l = l.strip_prefix("export ").unwrap_or(l);
            let (k, v) = l.split_once('=')?;
            let v = v.trim();
            let v = v
                .strip_prefix('"')
                .and_then(|v| v.strip_suffix('"'))
                .or_else(|| v.strip_prefix('\'').and_then(|v| v.strip_suffix('\'')))
                .unwrap_or(v);
            Some((k.trim().to_owned(), v.to_owned()))
        })
        .collect())
}

async fn serve(a: ServeArgs, kube: KubeAccess) -> anyhow::Result<()> {
    let workdir = std::fs::canonicalize(&a.workspace)
        .with_context(|| format!("workspace {}", a.workspace.display()))?;
    let auth = auth_of(&a, &kube)?;
    let env = match &a.env_file {
        Some(path) => read_env_file(path)?,
        None => Vec::new(),
    };
    let limits = Limits {
        max_log_line_bytes: usize::try_from(a.max_log_line_bytes)
            .context("--max-log-line-bytes")?,
        max_output_value_bytes: usize::try_from(a.max_output_value_bytes)
            .context("--max-output-value-bytes")?,
    };
    let cli = Cli::new(
        a.pulumi.clone(),
        workdir.clone(),
        server::default_state_dir(),
    )
    .with_env(env)
    .with_log_level(a.pulumi_log_level)
    .with_cancel_grace(Duration::from_secs(a.cancel_grace_seconds))
    .with_max_line_bytes(limits.max_log_line_bytes);
    let project = server::project_info(&workdir)?;
    info!(project = %project.name, runtime = %project.runtime, workspace = %workdir.display(), "workspace");

    let shutdown = CancellationToken::new();
    let source = a.source_dir.clone().map(|root| server::SourceDir {
        root,
        host_override: a.source_host.clone(),
    });
    let agent = Agent::new(cli.clone(), shutdown.clone(), limits, source);
    agent.prefetch_version();
    if !a.skip_install {
        cli.run(&["install".to_owned()])
            .await
            .context("pulumi install")?;
    }
    if let Some(stack) = &a.stack {
        agent
            .select(stack, true, a.secrets_provider.as_deref())
            .await
            .map_err(|s| anyhow::anyhow!("selecting stack {stack}: {}", s.message()))?;
    }

    let addr: SocketAddr = format!("{}:{}", a.host, a.port)
        .parse()
        .or_else(|_| format!("[{}]:{}", a.host, a.port).parse())
        .with_context(|| format!("invalid --host/--port {}:{}", a.host, a.port))?;
    let mut builder = tonic::transport::Server::builder();
    match (&a.tls_cert_file, &a.tls_key_file) {
        (Some(cert), Some(key)) => {
            let cert =
                std::fs::read(cert).with_context(|| format!("reading {}", cert.display()))?;
            let key = std::fs::read(key).with_context(|| format!("reading {}", key.display()))?;
            let identity = tonic::transport::Identity::from_pem(cert, key);
            builder = builder
                .tls_config(tonic::transport::ServerTlsConfig::new().identity(identity))
                .context("configuring TLS")?;
        }
        (None, None) => warn!("serving plaintext gRPC (no --tls-cert-file)"),
        _ => bail!("--tls-cert-file and --tls-key-file go together"),
    }
    let listener = tokio::net::TcpListener::bind(addr)
        .await
        .with_context(|| format!("listening on {addr}"))?;
    let local = listener.local_addr().context("listener address")?;
    info!(address = %local, instance = agent.instance(), "serving");
    let service = Authenticated::new(
        AutomationServiceServer::new(agent)
            .max_decoding_message_size(limits::MAX_MESSAGE_BYTES)
            .max_encoding_message_size(limits::MAX_MESSAGE_BYTES),
        std::sync::Arc::new(auth),
    );

    let stop = shutdown.clone();
    let signals = tokio::spawn(async move {
        wait_for_signal().await;
        info!("stopping: interrupting running operations");
        stop.cancel();
    });
    let incoming = tokio_stream::wrappers::TcpListenerStream::new(listener);
    builder
        .add_service(service)
        .serve_with_incoming_shutdown(incoming, shutdown.clone().cancelled_owned())
        .await
        .context("serving gRPC")?;
    signals.abort();
    info!("stopped");
    Ok(())
}

/// How calls are checked, from `--auth-mode` and its flags.
fn auth_of(a: &ServeArgs, kube: &KubeAccess) -> anyhow::Result<Auth> {
    match a.auth_mode {
        AuthMode::None => {
            warn!("--auth-mode none: every caller is accepted");
            Ok(Auth::None)
        }
        AuthMode::Token => {
            let token = match (&a.auth_token_file, &a.auth_token) {
                (Some(file), _) => std::fs::read_to_string(file)
                    .with_context(|| format!("reading the token {}", file.display()))?,
                (None, Some(token)) => token.clone(),
                (None, None) => {
                    bail!("--auth-mode token needs --auth-token-file or AGENT_AUTH_TOKEN")
                }
            };
            if token.trim().is_empty() {
                bail!("the bearer token is empty");
            }
            Ok(Auth::Token(TokenAuth::new(Some(token))))
        }
        AuthMode::Kube => {
            let options = KubeAuthOptions {
                audiences: a.kube_audiences.clone(),
                workspace_namespace: a.kube_workspace_namespace.clone().unwrap_or_default(),
                workspace_name: a.kube_workspace_name.clone().unwrap_or_default(),
                pod_service_account: kube.pod_service_account.clone(),
            };
            // PKO's agent refuses to start without these, with the same messages.
            if options.audiences.iter().all(|x| x.trim().is_empty()) {
                bail!("--kube-audience is required when auth mode is kubernetes");
            }
            if options.workspace_namespace.is_empty() {
                bail!("--kube-workspace-namespace is required when auth mode is kubernetes");
            }
            if options.workspace_name.is_empty() {
                bail!("--kube-workspace-name is required when auth mode is kubernetes");
            }
            let api = ApiServer::configure(
                kube.kubeconfig.as_deref(),
                kube.context.as_deref(),
                &kube.in_cluster,
            )
            .context("unable to load the kubeconfig")?;
            info!(
                audiences = ?options.audiences,
                workspace = %format!("{}/{}", options.workspace_namespace, options.workspace_name),
                "activated the Kubernetes authorization mode"
            );
            Ok(Auth::Kube(Box::new(KubeAuth::new(api, options))))
        }
    }
}

async fn wait_for_signal() {
    let term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate());
    match term {
        Ok(mut term) => {
            tokio::select! {
                _ = term.recv() => {},
                _ = tokio::signal::ctrl_c() => {},
            }
        }
        Err(_) => {
            let _ = tokio::signal::ctrl_c().await;
        }
    }
}
