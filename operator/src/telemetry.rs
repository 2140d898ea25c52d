//! Logging setup: `tracing` with text or JSON output, filtered by a level or `RUST_LOG` directive.
//! The filter can be replaced while the operator runs ([`set_filter`], served on the loopback
//! admin listener), so debugging a live operator needs no restart. A bare level keeps the
//! compiler crates of the plugin runtime (cranelift, regalloc2) at `warn` and the network
//! stacks at `info` at most: their debug output drowns the operator's own.

use std::sync::{Mutex, OnceLock, PoisonError};

use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::util::SubscriberInitExt;
use tracing_subscriber::{EnvFilter, Layer, Registry, reload};

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

/// Crates whose own logs are capped, whatever level is asked for: (crate, most verbose level).
const QUIET: &[(&str, &str)] = &[
    ("cranelift_codegen", "warn"),
    ("cranelift_frontend", "warn"),
    ("cranelift_entity", "warn"),
    ("wasmtime_cranelift", "warn"),
    ("regalloc2", "warn"),
    ("wasmtime", "info"),
    ("wasmtime_environ", "info"),
    ("h2", "info"),
    ("hyper", "info"),
    ("hyper_util", "info"),
    ("rustls", "info"),
    ("tower", "info"),
];

/// The directives a filter stands for: a bare level (`debug`) gets the caps of [`QUIET`] that
/// are stricter than it; anything else (`debug,kube=trace`) is taken as written.
pub fn directives(filter: &str) -> String {
    let filter = filter.trim();
    let Some(level) = rank(filter) else {
        return filter.to_owned();
    };
    let mut out = filter.to_owned();
    for (krate, cap) in QUIET {
        if rank(cap).is_some_and(|cap| cap < level) {
            out.push_str(&format!(",{krate}={cap}"));
        }
    }
    out
}

/// A level's verbosity (higher is more verbose), `None` for anything else.
fn rank(level: &str) -> Option<u8> {
    match level.to_ascii_lowercase().as_str() {
        "off" => Some(0),
        "error" => Some(1),
        "warn" => Some(2),
        "info" => Some(3),
        "debug" => Some(4),
        "trace" => Some(5),
        _ => None,
    }
}

/// The installed filter's reload handle and the filter it was given last, as asked for.
static FILTER: OnceLock<(reload::Handle<EnvFilter, Registry>, Mutex<String>)> = OnceLock::new();

fn parse(filter: &str) -> Result<EnvFilter, TelemetryError> {
    EnvFilter::try_new(directives(filter)).map_err(|source| TelemetryError::Filter {
        filter: filter.to_owned(),
        source,
    })
}

/// Install the global subscriber. `filter` is a level (`info`) or any `RUST_LOG` directive.
pub fn init(format: LogFormat, filter: &str) -> Result<(), TelemetryError> {
    let (env_filter, handle) = reload::Layer::new(parse(filter)?);
    // Colours only on a terminal: `kubectl logs` and log files get plain text.
    let ansi = std::io::IsTerminal::is_terminal(&std::io::stderr());
    let output = tracing_subscriber::fmt::layer()
        .with_ansi(ansi)
        .with_writer(std::io::stderr);
    let output = match format {
        LogFormat::Text => output.boxed(),
        LogFormat::Json => output.json().flatten_event(true).boxed(),
    };
    tracing_subscriber::registry()
        .with(env_filter)
        .with(output)
        .try_init()
        .map_err(|err| TelemetryError::Install(err.to_string()))?;
    if format == LogFormat::Json {
        // The default hook prints plain text, the one line a JSON log pipeline cannot parse.
        std::panic::set_hook(Box::new(log_panic));
    }
    // Only the first subscriber of the process is installed, so only its handle is kept.
    let _ = FILTER.set((handle, Mutex::new(filter.to_owned())));
    Ok(())
}

/// The filter in force, as it was given.
pub fn current_filter() -> Option<String> {
    let (_, given) = FILTER.get()?;
    Some(given.lock().unwrap_or_else(PoisonError::into_inner).clone())
}

/// Replaces the filter in force; an invalid one is refused and the old one kept.
pub fn set_filter(filter: &str) -> Result<(), TelemetryError> {
    let parsed = parse(filter)?;
    let (handle, given) = FILTER
        .get()
        .ok_or_else(|| TelemetryError::Install("no log subscriber is installed".into()))?;
    handle
        .reload(parsed)
        .map_err(|err| TelemetryError::Install(err.to_string()))?;
    *given.lock().unwrap_or_else(PoisonError::into_inner) = filter.to_owned();
    tracing::info!(filter, "log filter replaced");
    Ok(())
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_bare_level_caps_the_noisy_crates_and_a_directive_is_kept() {
        assert_eq!(
            directives("info"),
            "info,cranelift_codegen=warn,cranelift_frontend=warn,cranelift_entity=warn,wasmtime_cranelift=warn,regalloc2=warn"
        );
        let debug = directives("debug");
        assert!(debug.starts_with("debug,cranelift_codegen=warn"), "{debug}");
        assert!(
            debug.contains(",wasmtime=info,") && debug.ends_with(",tower=info"),
            "{debug}"
        );
        assert_eq!(directives("warn"), "warn", "nothing is stricter than warn");
        assert_eq!(directives("debug,kube=trace"), "debug,kube=trace");
        assert_eq!(
            directives(" TRACE "),
            format!("TRACE{}", &directives("trace")[5..])
        );
        assert!(parse("debug").is_ok());
        assert!(parse("debug,=[").is_err());
    }
}
