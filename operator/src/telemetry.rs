//! Logging setup: `tracing` with text or JSON output, filtered by a level or `RUST_LOG` directive.

use tracing_subscriber::EnvFilter;

/// Log output format.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum LogFormat {
    /// Human-readable lines (PKO's `console` encoder).
    #[value(alias = "console")]
    Text,
    /// One JSON object per line.
    Json,
}

/// Errors while installing the global subscriber.
#[derive(Debug, thiserror::Error)]
pub enum TelemetryError {
    #[error("invalid log filter {filter:?}: {source}")]
    Filter {
        filter: String,
        #[source]
        source: tracing_subscriber::filter::ParseError,
    },
    #[error("cannot install the log subscriber: {0}")]
    Install(String),
}

/// Install the global subscriber. `filter` is a level (`info`) or any `RUST_LOG` directive.
pub fn init(format: LogFormat, filter: &str) -> Result<(), TelemetryError> {
    let env_filter = EnvFilter::try_new(filter).map_err(|source| TelemetryError::Filter {
        filter: filter.to_owned(),
        source,
    })?;
    // Colours only on a terminal: `kubectl logs` and log files get plain text.
    let ansi = std::io::IsTerminal::is_terminal(&std::io::stderr());
    let builder = tracing_subscriber::fmt()
        .with_env_filter(env_filter)
        .with_ansi(ansi)
        .with_writer(std::io::stderr);
    let result = match format {
        LogFormat::Text => builder.try_init(),
        LogFormat::Json => builder.json().flatten_event(true).try_init(),
    };
    result.map_err(|err| TelemetryError::Install(err.to_string()))
}
