//! The operator's plugin flags.

use std::path::PathBuf;
use std::time::Duration;

use pko_plugin_host::compiler::{CompileBounds, Compiler, CompilerCommand};
use pko_plugin_host::{HostConfig, LimitOverrides, Limits};

/// What the start-up memory plan gives plugins.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PluginPlan {
    /// Memory every plugin call at once may use together.
    pub memory_budget_bytes: u64,
    /// Each module compiler's data limit.
    pub compile_memory_bytes: u64,
}

/// Plugin settings of the operator.
#[derive(clap::Args, Debug, Clone)]
pub struct PluginArgs {
    /// Run transform plugins (false: ProgramTransforms are ignored and no wasm runs).
    #[arg(
        long = "plugins",
        env = "PLUGINS_ENABLED",
        default_value_t = true,
        action = clap::ArgAction::Set
    )]
    pub plugins_enabled: bool,
    /// The folder `file:///` module URLs may point into (unset: file URLs are refused).
    #[arg(long, env = "PLUGIN_FILE_ROOT")]
    pub plugin_file_root: Option<PathBuf>,
    /// Folder of precompiled modules, reused across restarts (unset: compile at every start).
    #[arg(long, env = "PLUGIN_CACHE_DIR")]
    pub plugin_cache_dir: Option<PathBuf>,
    /// Bytes of precompiled modules kept in --plugin-cache-dir; the least recently used are
    /// evicted (keep it below the volume's size). Sized for interpreters: a Python or
    /// JavaScript plugin compiles to about 40 MB of machine code (a Rust one to under 1 MB).
    #[arg(long, env = "PLUGIN_CACHE_MAX_BYTES", default_value_t = 512 << 20)]
    pub plugin_cache_max_bytes: u64,
    /// Extra PEM CA certificates for https module URLs (the OS's roots are always trusted).
    #[arg(long, env = "PLUGIN_CA_FILE")]
    pub plugin_ca_file: Option<PathBuf>,
    /// Plugin calls running at once.
    #[arg(long, env = "PLUGIN_MAX_CONCURRENT_CALLS", default_value_t = 4)]
    pub plugin_max_concurrent_calls: u32,
    /// Of those, the most one namespace's calls (its Programs' transforms, its
    /// ProgramTransforms' checks) may hold, so one tenant's slow plugins never hold them all; a
    /// call waits for its namespace's share within its own time budget. Default: half of
    /// --plugin-max-concurrent-calls (at least 1).
    #[arg(
        long,
        env = "PLUGIN_MAX_CONCURRENT_CALLS_PER_NAMESPACE",
        value_parser = clap::value_parser!(u32).range(1..),
    )]
    pub plugin_max_concurrent_calls_per_namespace: Option<u32>,
    /// Fuel per call of a plugin that sets no limit.
    #[arg(long, env = "PLUGIN_DEFAULT_FUEL", default_value_t = Limits::DEFAULT.fuel)]
    pub plugin_default_fuel: u64,
    /// Wall-clock budget per call, in milliseconds, of a plugin that sets no limit.
    #[arg(long, env = "PLUGIN_DEFAULT_TIMEOUT_MILLIS", default_value_t = 2000)]
    pub plugin_default_timeout_millis: u64,
    /// Linear memory, in MiB, of a plugin that sets no limit.
    #[arg(long, env = "PLUGIN_DEFAULT_MEMORY_MIB", default_value_t = 64)]
    pub plugin_default_memory_mib: u64,
    /// Output size, in KiB, of a plugin that sets no limit.
    #[arg(long, env = "PLUGIN_DEFAULT_OUTPUT_KIB", default_value_t = 4096)]
    pub plugin_default_output_kib: u64,
    /// Largest module accepted, in bytes.
    #[arg(long, env = "PLUGIN_MAX_MODULE_BYTES", default_value_t = 32 << 20)]
    pub plugin_max_module_bytes: u64,
    /// Module loads (fetch, digest check and compile) at once, for every transform together:
    /// the module bytes held at once are at most this many times --plugin-max-module-bytes,
    /// and as many compilers run. Further loads wait for a slot.
    #[arg(
        long,
        env = "PLUGIN_MAX_CONCURRENT_LOADS",
        default_value_t = 2,
        value_parser = clap::value_parser!(u32).range(1..),
    )]
    pub plugin_max_concurrent_loads: u32,
    /// Of those, the most one namespace's loads (its ProgramTransforms') may hold, so one
    /// tenant's slow module server or slow compiles never hold them all. Default: half of
    /// --plugin-max-concurrent-loads (at least 1).
    #[arg(
        long,
        env = "PLUGIN_MAX_CONCURRENT_LOADS_PER_NAMESPACE",
        value_parser = clap::value_parser!(u32).range(1..),
    )]
    pub plugin_max_concurrent_loads_per_namespace: Option<u32>,
    /// Time one module load (fetch and compile) may take once it has a slot; it then fails
    /// and is retried. A compile still running keeps its slot until its own bound ends it.
    #[arg(long, env = "PLUGIN_LOAD_TIMEOUT_SECONDS", default_value_t = 60)]
    pub plugin_load_timeout_seconds: u64,
    /// Memory, in MiB, one module compile may use. Each compile runs in a child process with
    /// this as its data limit, so a module that makes the compiler grow fails alone
    /// ("compiling the module needs more than …"); the memory plan counts it once per load
    /// slot. Unset: an eighth of the container's memory limit, between 32 and 256 MiB (256
    /// when no limit is known).
    #[arg(
        long,
        env = "PLUGIN_COMPILE_MEMORY_MIB",
        value_parser = clap::value_parser!(u64).range(16..=65536),
    )]
    pub plugin_compile_memory_mib: Option<u64>,
    /// Time one module compile may take; the compiler is then killed and the load retried
    /// later with backoff.
    #[arg(
        long,
        env = "PLUGIN_COMPILE_TIMEOUT_SECONDS",
        default_value_t = CompileBounds::DEFAULT.timeout.as_secs(),
        value_parser = clap::value_parser!(u64).range(1..),
    )]
    pub plugin_compile_timeout_seconds: u64,
    /// Memory, in MiB, every plugin call running at once may use together; each call reserves
    /// its memory cap from it. Unset: half of what the container's memory limit leaves (see
    /// docs/operations.md), or every slot at the ceiling when no limit is known.
    #[arg(long, env = "PLUGIN_MEMORY_BUDGET_MIB")]
    pub plugin_memory_budget_mib: Option<u64>,
}

impl PluginArgs {
    /// The memory cap of a plugin that sets none, as the host will apply it.
    pub fn default_memory_bytes(&self) -> u64 {
        (self.plugin_default_memory_mib << 20).min(Limits::CEILING.memory_bytes)
    }

    /// The budget when nothing limits memory: every slot at the ceiling.
    pub fn unlimited_memory_budget_bytes(&self) -> u64 {
        u64::from(self.plugin_max_concurrent_calls.max(1)) * Limits::CEILING.memory_bytes
    }

    /// The host settings these flags describe (defaults are capped by the host's ceilings),
    /// with the memory budget and compiler memory the start-up plan decided. `operator`: this
    /// binary, which compiles modules as a child (`plugin compile`).
    pub fn host_config(&self, plan: &PluginPlan, operator: PathBuf) -> HostConfig {
        let memory_budget_bytes = plan.memory_budget_bytes;
        let ceiling = Limits::CEILING;
        HostConfig {
            memory_budget_bytes,
            max_concurrent_calls: self.plugin_max_concurrent_calls.max(1),
            max_concurrent_calls_per_namespace: self
                .plugin_max_concurrent_calls_per_namespace
                .unwrap_or_else(|| {
                    pko_plugin_host::host::default_share(self.plugin_max_concurrent_calls.max(1))
                }),
            default_limits: Limits {
                fuel: self.plugin_default_fuel,
                timeout: Duration::from_millis(self.plugin_default_timeout_millis),
                memory_bytes: self.plugin_default_memory_mib << 20,
                output_bytes: self.plugin_default_output_kib << 10,
            }
            .with(&LimitOverrides::default(), &ceiling),
            ceiling,
            cache_dir: self.plugin_cache_dir.clone(),
            cache_max_bytes: self.plugin_cache_max_bytes,
            max_module_bytes: self.plugin_max_module_bytes,
            compiler: Compiler::Child {
                command: CompilerCommand {
                    program: operator,
                    args: vec!["plugin".into(), "compile".into()],
                },
                bounds: CompileBounds {
                    memory_bytes: plan.compile_memory_bytes,
                    timeout: Duration::from_secs(self.plugin_compile_timeout_seconds),
                },
            },
        }
    }
}
