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
        LogFormat::Json => builder.json().flatten_event(true).try_init().inspect(|()| {
            // The default hook prints plain text, the one line a JSON log pipeline cannot parse.
            std::panic::set_hook(Box::new(log_panic));
        }),
    };
    result.map_err(|err| TelemetryError::Install(err.to_string()))
}

/// A panic as one ERROR event (with the backtrace when `RUST_BACKTRACE` asks for it).
fn log_panic(info: &std::panic::PanicHookInfo<'_>) {
    let payload = info
        .payload_as_str()
        .unwrap_or("(a payload that is not a string)");
    let location = info
        .location()
        .map(|l| format!("{}:{}:{}", l.file(), l.line(), l.column()))
        .unwrap_or_default();
    let current = std::thread::current();
    let thread = current.name().unwrap_or("unnamed");
    let backtrace = std::backtrace::Backtrace::capture();
    if backtrace.status() == std::backtrace::BacktraceStatus::Captured {
        tracing::error!(target: "panic", thread, location, %backtrace, "panicked: {payload}");
    } else {
        tracing::error!(target: "panic", thread, location, "panicked: {payload}");
    }
}
