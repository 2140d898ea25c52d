//! Everything that can go wrong with a plugin, from fetching its bytes to reading its output.

use std::time::Duration;

/// A plugin failure. Cheap to clone: results are cached and shared between the controller and
/// the file server.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PluginError {
    /// The module bytes could not be read from their source.
    #[error("cannot read the module: {0}")]
    Source(String),
    /// The module's signature is missing or does not verify.
    #[error("signature refused: {0}")]
    Signature(String),
    #[error("module sha256 is {actual}, but {expected} is pinned")]
    DigestMismatch { expected: String, actual: String },
    #[error("module is {size} bytes, more than the limit of {limit}")]
    ModuleTooLarge { size: u64, limit: u64 },
    #[error("cannot compile the module: {0}")]
    Compile(String),
    /// The compiler reached its memory bound (the module asks for more than it may).
    #[error(
        "compiling the module needs more than {} MiB (--plugin-compile-memory-mib)",
        .0 >> 20
    )]
    CompileMemory(u64),
    /// The compiler outlasted its deadline and was killed.
    #[error(
        "compiling the module took longer than {}s (--plugin-compile-timeout-seconds)",
        .0.as_secs_f64()
    )]
    CompileTimeout(Duration),
    /// The component imports something the host does not grant.
    #[error("module imports {import}, which plugins are not granted: {why} (allowed: {granted})")]
    ForbiddenImport {
        import: String,
        why: String,
        granted: String,
    },
    /// The plugin called a function of an interface it is denied (the filesystem, the network).
    #[error("{0}")]
    Denied(String),
    /// The component does not implement the plugin world (or another version of it).
    #[error("not a transform plugin: {0}")]
    NotAPlugin(String),
    /// `validate-config` refused the configuration.
    #[error("invalid configuration: {0}")]
    InvalidConfig(String),
    /// The plugin rejected the Program.
    #[error("rejected: {0}")]
    Rejected(String),
    /// The plugin reported an internal error.
    #[error("plugin error: {0}")]
    Internal(String),
    #[error("timed out after {}ms", .0.as_millis())]
    Timeout(Duration),
    #[error("fuel exhausted (limit {0} units)")]
    FuelExhausted(u64),
    #[error("memory limit of {0} bytes exceeded")]
    MemoryLimit(u64),
    /// The plugin's memory cap is more than every plugin call together may use.
    #[error(
        "asks for {asked} bytes of memory, more than the operator's plugin memory budget of {budget} bytes (--plugin-memory-budget-mib)"
    )]
    OverMemoryBudget { asked: u64, budget: u64 },
    /// The guest trapped (a panic, `unreachable`, an out-of-bounds access, a stack overflow).
    #[error("trap: {0}")]
    Trap(String),
    /// The output is not a valid Program spec.
    #[error("invalid output: {0}")]
    InvalidOutput(String),
    #[error("output of {size} bytes exceeds the limit of {limit} bytes")]
    OutputTooLarge { size: u64, limit: u64 },
    /// Every plugin slot stayed busy for the whole call budget.
    #[error("no plugin slot became free within {}ms", .0.as_millis())]
    Busy(Duration),
    /// The calling namespace ran its whole share of the slots for the whole call budget.
    #[error(
        "namespace {namespace} runs its share of {share} plugin calls at once (--plugin-max-concurrent-calls-per-namespace) and none ended within {}ms",
        .waited.as_millis()
    )]
    ShareBusy {
        namespace: String,
        share: u32,
        waited: Duration,
    },
    /// A module load (fetch, digest check, compile) outlasted its budget; a compile still
    /// running keeps its load slot until it ends.
    #[error("loading the module took longer than {}s (--plugin-load-timeout-seconds)", .0.as_secs())]
    LoadTimedOut(Duration),
    /// A failure of the host itself (engine, task, linker).
    #[error("plugin host error: {0}")]
    Host(String),
}

/// The kind of a [`PluginError`], for metrics labels, condition reasons and fixtures.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ErrorKind {
    Source,
    Signature,
    DigestMismatch,
    ModuleTooLarge,
    Compile,
    ForbiddenImport,
    NotAPlugin,
    InvalidConfig,
    Rejected,
    Internal,
    Timeout,
    FuelExhausted,
    MemoryLimit,
    Trap,
    InvalidOutput,
    OutputTooLarge,
    Busy,
    Host,
}

impl ErrorKind {
    /// Every kind, in declaration order.
    pub const ALL: [ErrorKind; 18] = [
        Self::Source,
        Self::Signature,
        Self::DigestMismatch,
        Self::ModuleTooLarge,
        Self::Compile,
        Self::ForbiddenImport,
        Self::NotAPlugin,
        Self::InvalidConfig,
        Self::Rejected,
        Self::Internal,
        Self::Timeout,
        Self::FuelExhausted,
        Self::MemoryLimit,
        Self::Trap,
        Self::InvalidOutput,
        Self::OutputTooLarge,
        Self::Busy,
        Self::Host,
    ];

    /// kebab-case name, as in metrics labels and fixture files (`fuel-exhausted`).
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Source => "source",
            Self::Signature => "signature",
            Self::DigestMismatch => "digest-mismatch",
            Self::ModuleTooLarge => "module-too-large",
            Self::Compile => "compile",
            Self::ForbiddenImport => "forbidden-import",
            Self::NotAPlugin => "not-a-plugin",
            Self::InvalidConfig => "invalid-config",
            Self::Rejected => "rejected",
            Self::Internal => "internal",
            Self::Timeout => "timeout",
            Self::FuelExhausted => "fuel-exhausted",
            Self::MemoryLimit => "memory-limit",
            Self::Trap => "trap",
            Self::InvalidOutput => "invalid-output",
            Self::OutputTooLarge => "output-too-large",
            Self::Busy => "busy",
            Self::Host => "host",
        }
    }

    /// CamelCase name, for condition reasons (`FuelExhausted`).
    pub fn camel(self) -> &'static str {
        match self {
            Self::Source => "Source",
            Self::Signature => "Signature",
            Self::DigestMismatch => "DigestMismatch",
            Self::ModuleTooLarge => "ModuleTooLarge",
            Self::Compile => "Compile",
            Self::ForbiddenImport => "ForbiddenImport",
            Self::NotAPlugin => "NotAPlugin",
            Self::InvalidConfig => "InvalidConfig",
            Self::Rejected => "Rejected",
            Self::Internal => "Internal",
            Self::Timeout => "Timeout",
            Self::FuelExhausted => "FuelExhausted",
            Self::MemoryLimit => "MemoryLimit",
            Self::Trap => "Trap",
            Self::InvalidOutput => "InvalidOutput",
            Self::OutputTooLarge => "OutputTooLarge",
            Self::Busy => "Busy",
            Self::Host => "Host",
        }
    }

    /// Parses [`Self::as_str`].
    pub fn parse(s: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|k| k.as_str() == s)
    }

    /// Failures that depend on timing or load rather than on the module and its input: the
    /// same call may succeed later, so their results are never cached for long.
    pub fn is_transient(self) -> bool {
        matches!(self, Self::Timeout | Self::Busy | Self::Host | Self::Source)
    }
}

impl PluginError {
    pub fn kind(&self) -> ErrorKind {
        match self {
            Self::Source(_) | Self::LoadTimedOut(_) => ErrorKind::Source,
            Self::Signature(_) => ErrorKind::Signature,
            Self::DigestMismatch { .. } => ErrorKind::DigestMismatch,
            Self::ModuleTooLarge { .. } => ErrorKind::ModuleTooLarge,
            Self::Compile(_) | Self::CompileMemory(_) => ErrorKind::Compile,
            // Time depends on the machine's load: retried, like a call's timeout.
            Self::CompileTimeout(_) => ErrorKind::Timeout,
            Self::ForbiddenImport { .. } | Self::Denied(_) => ErrorKind::ForbiddenImport,
            Self::NotAPlugin(_) => ErrorKind::NotAPlugin,
            Self::InvalidConfig(_) => ErrorKind::InvalidConfig,
            Self::Rejected(_) => ErrorKind::Rejected,
            Self::Internal(_) => ErrorKind::Internal,
            Self::Timeout(_) => ErrorKind::Timeout,
            Self::FuelExhausted(_) => ErrorKind::FuelExhausted,
            Self::MemoryLimit(_) | Self::OverMemoryBudget { .. } => ErrorKind::MemoryLimit,
            Self::Trap(_) => ErrorKind::Trap,
            Self::InvalidOutput(_) => ErrorKind::InvalidOutput,
            Self::OutputTooLarge { .. } => ErrorKind::OutputTooLarge,
            Self::Busy(_) | Self::ShareBusy { .. } => ErrorKind::Busy,
            Self::Host(_) => ErrorKind::Host,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kinds_round_trip_and_are_distinct() {
        let mut seen = std::collections::HashSet::new();
        for kind in ErrorKind::ALL {
            assert_eq!(ErrorKind::parse(kind.as_str()), Some(kind));
            assert!(seen.insert(kind.camel()));
            assert_eq!(kind.camel().to_lowercase(), kind.as_str().replace('-', ""));
        }
    }
}
