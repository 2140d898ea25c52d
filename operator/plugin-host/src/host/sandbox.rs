//! What a plugin instance can reach: the linker holding only the granted interfaces, the import
//! allowlist checked at load, the per-call WASI context (no environment, fixed clocks, fixed
//! random), the guest log and the memory limiter.

use std::sync::Arc;
use std::time::Duration;

use wasmtime::component::{Component, HasData, HasSelf, Linker, ResourceTable};
use wasmtime::{Engine, ResourceLimiter};
use wasmtime_wasi::p2::pipe::MemoryOutputPipe;
use wasmtime_wasi::{Deterministic, HostWallClock, WasiCtx, WasiCtxBuilder, WasiCtxView, WasiView};

use super::bindings;
use super::bindings::pko::transform::log::Level;
use crate::errors::PluginError;

/// Interfaces a plugin may import: what a Rust `wasm32-wasip2` guest needs to start (stdio,
/// environment, exit, clocks, random) plus the plugin log. Stdio goes nowhere (stderr is kept
/// for error messages), the environment is empty, clocks are fixed and random is a fixed
/// sequence. Filesystem, sockets, HTTP and everything else are refused at load.
const GRANTED: [(&str, &[&str]); 5] = [
    ("wasi:io", &["error", "poll", "streams"]),
    (
        "wasi:cli",
        &[
            "environment",
            "exit",
            "stdin",
            "stdout",
            "stderr",
            "terminal-input",
            "terminal-output",
            "terminal-stdin",
            "terminal-stdout",
            "terminal-stderr",
        ],
    ),
    ("wasi:clocks", &["wall-clock", "monotonic-clock"]),
    ("wasi:random", &["random", "insecure", "insecure-seed"]),
    ("pko:transform", &["log", "types"]),
];

/// Guest log budget per call; the rest is dropped (with one note).
const LOG_BYTES_PER_CALL: usize = 16 * 1024;
/// Guest stderr kept per call (panic messages end up there).
const STDERR_BYTES: usize = 4 * 1024;
/// Wasm table elements an instance may grow to.
pub(super) const MAX_TABLE_ELEMENTS: usize = 100_000;
/// Core instances, memories and tables per component instance (a Rust guest uses a handful).
pub(super) const MAX_CORE_INSTANCES: u32 = 32;
pub(super) const MAX_MEMORIES: u32 = 4;
pub(super) const MAX_TABLES: u32 = 8;
/// Fixed seed of every random source a plugin sees.
const RANDOM_SEED: [u8; 16] = *b"pko-rs-transform";

/// Per-call store data.
pub(super) struct CallState {
    wasi: WasiCtx,
    table: ResourceTable,
    pub(super) limiter: MemoryLimiter,
    log: GuestLog,
}

impl CallState {
    /// A fresh state for one call, and the pipe that keeps what the guest writes to stderr.
    pub(super) fn new(transform: Arc<str>, memory_bytes: usize) -> (Self, MemoryOutputPipe) {
        let stderr = MemoryOutputPipe::new(STDERR_BYTES);
        let wasi = WasiCtxBuilder::new()
            .stderr(stderr.clone())
            .wall_clock(FixedWallClock)
            .secure_random(Deterministic::new(RANDOM_SEED.to_vec()))
            .insecure_random(Deterministic::new(RANDOM_SEED.to_vec()))
            .insecure_random_seed(u128::from_le_bytes(RANDOM_SEED))
            .build();
        let state = Self {
            wasi,
            table: ResourceTable::new(),
            limiter: MemoryLimiter::new(memory_bytes),
            log: GuestLog {
                transform,
                budget: LOG_BYTES_PER_CALL,
                truncated: false,
            },
        };
        (state, stderr)
    }
}

impl WasiView for CallState {
    fn ctx(&mut self) -> WasiCtxView<'_> {
        WasiCtxView {
            ctx: &mut self.wasi,
            table: &mut self.table,
        }
    }
}

impl bindings::pko::transform::log::Host for CallState {
    fn log(&mut self, level: Level, message: String) {
        self.log.write(level, &message);
    }
}

impl bindings::pko::transform::types::Host for CallState {}

/// Forwards guest log lines to tracing, up to a byte budget per call.
struct GuestLog {
    transform: Arc<str>,
    budget: usize,
    truncated: bool,
}

impl GuestLog {
    fn write(&mut self, level: Level, message: &str) {
        if message.len() > self.budget {
            if !self.truncated {
                self.truncated = true;
                tracing::warn!(target: "pko_plugin_host::guest", transform = %self.transform, "plugin log budget exhausted; further lines dropped");
            }
            return;
        }
        self.budget -= message.len();
        let message = escape_controls(message);
        let transform = &*self.transform;
        match level {
            Level::Trace => {
                tracing::trace!(target: "pko_plugin_host::guest", transform, "{message}")
            }
            Level::Debug => {
                tracing::debug!(target: "pko_plugin_host::guest", transform, "{message}")
            }
            Level::Info => tracing::info!(target: "pko_plugin_host::guest", transform, "{message}"),
            Level::Warn => tracing::warn!(target: "pko_plugin_host::guest", transform, "{message}"),
            Level::Error => {
                tracing::error!(target: "pko_plugin_host::guest", transform, "{message}")
            }
        }
    }
}

/// `message` with every control character (newlines, carriage returns, ANSI escapes, C1
/// controls) and Unicode line or paragraph separator written as an escape: in the text log
/// format a guest's line could otherwise end the operator's line and forge the next one.
fn escape_controls(message: &str) -> std::borrow::Cow<'_, str> {
    let unsafe_char = |c: char| c.is_control() || c == '\u{2028}' || c == '\u{2029}';
    if !message.chars().any(unsafe_char) {
        return std::borrow::Cow::Borrowed(message);
    }
    let mut out = String::with_capacity(message.len() + 8);
    for c in message.chars() {
        match c {
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            // Writing to a String cannot fail.
            c if unsafe_char(c) => {
                let _ =
                    std::fmt::Write::write_fmt(&mut out, format_args!("\\u{{{:x}}}", u32::from(c)));
            }
            c => out.push(c),
        }
    }
    std::borrow::Cow::Owned(out)
}

/// Caps the memory of one instance, every linear memory and table of it together (a
/// component may have several), and remembers whether the cap was hit: a refused growth with
/// `Err` traps, and the flag tells that trap apart from others without parsing messages.
pub(super) struct MemoryLimiter {
    max_bytes: usize,
    /// Bytes of every memory and table of the instance so far.
    used: usize,
    pub(super) hit: bool,
}

/// What one table element costs (a reference).
const TABLE_ELEMENT_BYTES: usize = std::mem::size_of::<usize>();

impl MemoryLimiter {
    fn new(max_bytes: usize) -> Self {
        Self {
            max_bytes,
            used: 0,
            hit: false,
        }
    }

    /// Accounts for growing one memory or table by `delta` bytes.
    fn grow(&mut self, delta: usize) -> wasmtime::Result<bool> {
        let total = self.used.saturating_add(delta);
        if total > self.max_bytes {
            self.hit = true;
            return Err(wasmtime::Error::msg(format!(
                "memory limit of {} bytes exceeded (the instance would use {total})",
                self.max_bytes
            )));
        }
        self.used = total;
        Ok(true)
    }
}

impl ResourceLimiter for MemoryLimiter {
    fn memory_growing(
        &mut self,
        current: usize,
        desired: usize,
        _maximum: Option<usize>,
    ) -> wasmtime::Result<bool> {
        self.grow(desired.saturating_sub(current))
    }

    fn table_growing(
        &mut self,
        current: usize,
        desired: usize,
        _maximum: Option<usize>,
    ) -> wasmtime::Result<bool> {
        if desired > MAX_TABLE_ELEMENTS {
            return Ok(false);
        }
        self.grow(
            desired
                .saturating_sub(current)
                .saturating_mul(TABLE_ELEMENT_BYTES),
        )
    }

    fn instances(&self) -> usize {
        MAX_CORE_INSTANCES as usize
    }

    fn tables(&self) -> usize {
        MAX_TABLES as usize
    }

    fn memories(&self) -> usize {
        MAX_MEMORIES as usize
    }
}

/// The wall clock every plugin sees: the Unix epoch, forever.
struct FixedWallClock;

impl HostWallClock for FixedWallClock {
    fn resolution(&self) -> Duration {
        Duration::from_secs(1)
    }

    fn now(&self) -> Duration {
        Duration::ZERO
    }
}

/// The monotonic clock every plugin sees: frozen at zero, and every timer it subscribes to is
/// already due. A plugin therefore cannot wait in a host call (a sleep returns at once): the
/// only way to spend time is to run wasm code, which fuel and the epoch deadline stop. (With
/// real timers, a sleeping guest would hold its slot and thread past any wasm-level deadline.)
struct FrozenMonotonic<'a> {
    table: &'a mut ResourceTable,
}

/// Marker for [`FrozenMonotonic`] in the linker.
struct HasFrozenMonotonic;

impl HasData for HasFrozenMonotonic {
    type Data<'a> = FrozenMonotonic<'a>;
}

/// A timer that has already fired.
struct Due;

#[wasmtime_wasi::async_trait]
impl wasmtime_wasi::p2::Pollable for Due {
    async fn ready(&mut self) {}
}

impl wasmtime_wasi::p2::bindings::clocks::monotonic_clock::Host for FrozenMonotonic<'_> {
    fn now(&mut self) -> wasmtime::Result<u64> {
        Ok(0)
    }

    fn resolution(&mut self) -> wasmtime::Result<u64> {
        Ok(1)
    }

    fn subscribe_instant(
        &mut self,
        _when: u64,
    ) -> wasmtime::Result<wasmtime::component::Resource<wasmtime_wasi::p2::DynPollable>> {
        let due = self.table.push(Due)?;
        wasmtime_wasi::p2::subscribe(self.table, due)
    }

    fn subscribe_duration(
        &mut self,
        _duration: u64,
    ) -> wasmtime::Result<wasmtime::component::Resource<wasmtime_wasi::p2::DynPollable>> {
        let due = self.table.push(Due)?;
        wasmtime_wasi::p2::subscribe(self.table, due)
    }
}

/// Marker for the `wasi:io` bindings, which only need the resource table.
struct HasIo;

impl HasData for HasIo {
    type Data<'a> = &'a mut ResourceTable;
}

/// Only the granted interfaces are linked: a module importing anything else cannot be
/// instantiated even if the import check were bypassed.
pub(super) fn linker(engine: &Engine) -> wasmtime::Result<Linker<CallState>> {
    use wasmtime_wasi::cli::{WasiCli, WasiCliView};
    use wasmtime_wasi::clocks::{WasiClocks, WasiClocksView};
    use wasmtime_wasi::p2::bindings::{cli, clocks, io, random};
    use wasmtime_wasi::random::WasiRandom;

    let mut linker = Linker::<CallState>::new(engine);
    let l = &mut linker;
    // The async bindings: calls run on the caller's task, where the blocking ones would try
    // to start a runtime inside the runtime.
    io::error::add_to_linker::<CallState, HasIo>(l, |t| &mut t.table)?;
    io::poll::add_to_linker::<CallState, HasIo>(l, |t| &mut t.table)?;
    io::streams::add_to_linker::<CallState, HasIo>(l, |t| &mut t.table)?;
    clocks::wall_clock::add_to_linker::<CallState, WasiClocks>(l, CallState::clocks)?;
    clocks::monotonic_clock::add_to_linker::<CallState, HasFrozenMonotonic>(l, |t| {
        FrozenMonotonic {
            table: &mut t.table,
        }
    })?;
    random::random::add_to_linker::<CallState, WasiRandom>(l, |t| t.wasi.random())?;
    random::insecure::add_to_linker::<CallState, WasiRandom>(l, |t| t.wasi.random())?;
    random::insecure_seed::add_to_linker::<CallState, WasiRandom>(l, |t| t.wasi.random())?;
    cli::exit::add_to_linker::<CallState, WasiCli>(l, CallState::cli)?;
    cli::environment::add_to_linker::<CallState, WasiCli>(l, CallState::cli)?;
    cli::stdin::add_to_linker::<CallState, WasiCli>(l, CallState::cli)?;
    cli::stdout::add_to_linker::<CallState, WasiCli>(l, CallState::cli)?;
    cli::stderr::add_to_linker::<CallState, WasiCli>(l, CallState::cli)?;
    cli::terminal_input::add_to_linker::<CallState, WasiCli>(l, CallState::cli)?;
    cli::terminal_output::add_to_linker::<CallState, WasiCli>(l, CallState::cli)?;
    cli::terminal_stdin::add_to_linker::<CallState, WasiCli>(l, CallState::cli)?;
    cli::terminal_stdout::add_to_linker::<CallState, WasiCli>(l, CallState::cli)?;
    cli::terminal_stderr::add_to_linker::<CallState, WasiCli>(l, CallState::cli)?;
    bindings::Plugin::add_to_linker::<CallState, HasSelf<CallState>>(l, |t| t)?;
    Ok(linker)
}

/// Every import must be a granted interface; the first one that is not is named.
pub(super) fn check_imports(component: &Component, engine: &Engine) -> Result<(), PluginError> {
    for (name, _) in component.component_type().imports(engine) {
        if !is_granted(name) {
            return Err(PluginError::ForbiddenImport {
                import: name.to_owned(),
                granted: granted_list(),
            });
        }
    }
    Ok(())
}

/// `wasi:io/streams@0.2.6` → granted when the package and interface are listed (any version of
/// the package's major line: 0.2.x for WASI, 0.1.x for ours).
fn is_granted(import: &str) -> bool {
    let (path, version) = match import.split_once('@') {
        Some((path, version)) => (path, Some(version)),
        None => (import, None),
    };
    let Some((package, interface)) = path.split_once('/') else {
        return false;
    };
    let Some((_, interfaces)) = GRANTED.iter().find(|(p, _)| *p == package) else {
        return false;
    };
    let line_ok = match (package, version) {
        ("pko:transform", Some(v)) => v.starts_with("0.1."),
        (_, Some(v)) => v.starts_with("0.2."),
        (_, None) => false,
    };
    line_ok && interfaces.contains(&interface)
}

fn granted_list() -> String {
    GRANTED
        .iter()
        .map(|(package, interfaces)| format!("{package}/{{{}}}", interfaces.join(",")))
        .collect::<Vec<_>>()
        .join(" ")
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The log lines the text format writes while `f` runs.
    fn text_log(f: impl FnOnce()) -> String {
        #[derive(Clone, Default)]
        struct Buffer(Arc<std::sync::Mutex<Vec<u8>>>);
        impl std::io::Write for Buffer {
            fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
                self.0
                    .lock()
                    .unwrap_or_else(std::sync::PoisonError::into_inner)
                    .extend_from_slice(b);
                Ok(b.len())
            }
            fn flush(&mut self) -> std::io::Result<()> {
                Ok(())
            }
        }
        let buffer = Buffer::default();
        let writer = buffer.clone();
        let subscriber = tracing_subscriber::fmt()
            .with_ansi(false)
            .with_max_level(tracing::Level::TRACE)
            .with_writer(move || writer.clone())
            .finish();
        tracing::subscriber::with_default(subscriber, f);
        let bytes = buffer
            .0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone();
        String::from_utf8(bytes).expect("UTF-8 log")
    }

    #[test]
    fn a_guest_log_line_cannot_forge_operator_lines() {
        let mut log = GuestLog {
            transform: Arc::from("team-a/t"),
            budget: 1 << 20,
            truncated: false,
        };
        let forged = "ok\n2026-01-01T00:00:00Z  INFO pko_operator: fake\r\x1b[2K\u{2028}x\u{85}y";
        let out = text_log(|| {
            for level in [Level::Info, Level::Warn, Level::Error] {
                log.write(level, forged);
            }
        });
        let lines: Vec<&str> = out.lines().collect();
        assert_eq!(lines.len(), 3, "{out}");
        for line in lines {
            assert!(line.contains("pko_plugin_host::guest"), "{line}");
            assert!(line.contains("ok\\n2026-01-01T00:00:00Z  INFO pko_operator: fake\\r\\u{1b}[2K\\u{2028}x\\u{85}y"), "{line}");
            assert!(!line.chars().any(|c| c.is_control()), "{line:?}");
        }
        assert_eq!(escape_controls("plain line"), "plain line");
    }

    #[test]
    fn the_memory_cap_covers_every_memory_and_table_of_an_instance() {
        let mut limiter = MemoryLimiter::new(100 << 20);
        // Two memories of 60 MiB: each alone is under the cap, together they are not.
        assert!(matches!(
            limiter.memory_growing(0, 60 << 20, None),
            Ok(true)
        ));
        assert!(limiter.memory_growing(0, 60 << 20, None).is_err());
        assert!(limiter.hit);
        // Growth counts only what is added; tables count too.
        let mut limiter = MemoryLimiter::new(100 << 20);
        assert!(matches!(
            limiter.memory_growing(0, 50 << 20, None),
            Ok(true)
        ));
        assert!(matches!(
            limiter.memory_growing(50 << 20, 90 << 20, None),
            Ok(true)
        ));
        assert!(matches!(limiter.table_growing(0, 1000, None), Ok(true)));
        assert_eq!(limiter.used, (90 << 20) + 1000 * TABLE_ELEMENT_BYTES);
        assert!(matches!(
            limiter.table_growing(0, MAX_TABLE_ELEMENTS + 1, None),
            Ok(false)
        ));
        assert!(limiter.memory_growing(90 << 20, 100 << 20, None).is_err());
        assert!(!limiter.hit || limiter.used <= 100 << 20);
    }

    #[test]
    fn grants_what_a_rust_guest_needs_and_nothing_else() {
        for ok in [
            "wasi:io/streams@0.2.6",
            "wasi:io/error@0.2.0",
            "wasi:cli/environment@0.2.6",
            "wasi:cli/terminal-stdout@0.2.6",
            "wasi:clocks/wall-clock@0.2.6",
            "wasi:random/insecure-seed@0.2.4",
            "pko:transform/log@0.1.0",
            "pko:transform/types@0.1.3",
        ] {
            assert!(is_granted(ok), "{ok}");
        }
        for refused in [
            "wasi:filesystem/preopens@0.2.6",
            "wasi:filesystem/types@0.2.6",
            "wasi:sockets/tcp@0.2.6",
            "wasi:http/outgoing-handler@0.2.6",
            "wasi:io/streams@0.3.0",
            "wasi:io/streams",
            "pko:transform/log@0.2.0",
            "pko:transform/secrets@0.1.0",
            "env",
        ] {
            assert!(!is_granted(refused), "{refused}");
        }
    }
}
