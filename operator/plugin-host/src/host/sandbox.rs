//! What a plugin instance can reach: the linker holding only the granted interfaces, the import
//! allowlist checked at load, the per-call WASI context (no environment, fixed clocks, fixed
//! random), the guest log and the memory limiter.

use std::sync::Arc;
use std::time::Duration;

use wasmtime::component::{Component, HasData, HasSelf, Linker, ResourceTable};
use wasmtime::{Engine, ResourceLimiter};
use wasmtime_wasi::{Deterministic, HostWallClock, WasiCtx, WasiCtxBuilder, WasiCtxView, WasiView};

use super::bindings;
use super::bindings::pko::transform::log::Level;
use crate::errors::PluginError;

/// How the host answers an interface a plugin imports.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Grant {
    /// Linked to the host's deterministic implementation.
    Served,
    /// Linked to stubs that fail the call, naming the function and why: language runtimes
    /// (CPython under componentize-py, SpiderMonkey under componentize-js) import these whether
    /// or not the plugin uses them, so refusing them at load would refuse every such plugin.
    Denied(&'static str),
}

/// One line of the import allowlist: interfaces of a package, the versions known to link, and
/// how they are answered.
struct Allowed {
    package: &'static str,
    interfaces: &'static [&'static str],
    /// `major.minor` of the versions accepted.
    line: &'static str,
    /// Highest patch accepted: the newest seen from the supported toolchains and tested
    /// (`None`: every patch of the line, for our own package, whose 0.1.x changes are additive).
    max_patch: Option<u32>,
    grant: Grant,
}

/// WASI 0.2 up to the newest patch the supported guest toolchains import: Rust's
/// `wasm32-wasip2` (0.2.x), componentize-py 0.25 (0.2.9), componentize-js 0.23 (0.2.12).
const WASI_MAX_PATCH: Option<u32> = Some(12);
const NO_FILESYSTEM: &str = "plugins have no filesystem";
const NO_NETWORK: &str = "plugins have no network";

/// The import allowlist: what a plugin may import, per interface and version. Stdio goes to the
/// plugin log, the environment and arguments are empty, the clocks are fixed and random is a
/// fixed sequence (see [`CallState::new`]); the filesystem and the network are linked only to
/// fail. Everything else (`wasi:http`, other packages, other versions) is refused at load.
const ALLOWLIST: &[Allowed] = &[
    Allowed {
        package: "wasi:io",
        interfaces: &["error", "poll", "streams"],
        line: "0.2",
        max_patch: WASI_MAX_PATCH,
        grant: Grant::Served,
    },
    Allowed {
        package: "wasi:cli",
        interfaces: &[
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
        line: "0.2",
        max_patch: WASI_MAX_PATCH,
        grant: Grant::Served,
    },
    Allowed {
        package: "wasi:clocks",
        interfaces: &["wall-clock", "monotonic-clock"],
        line: "0.2",
        max_patch: WASI_MAX_PATCH,
        grant: Grant::Served,
    },
    Allowed {
        package: "wasi:random",
        interfaces: &["random", "insecure", "insecure-seed"],
        line: "0.2",
        max_patch: WASI_MAX_PATCH,
        grant: Grant::Served,
    },
    Allowed {
        package: "wasi:filesystem",
        interfaces: &["types", "preopens"],
        line: "0.2",
        max_patch: WASI_MAX_PATCH,
        grant: Grant::Denied(NO_FILESYSTEM),
    },
    Allowed {
        package: "wasi:sockets",
        interfaces: &[
            "network",
            "instance-network",
            "tcp",
            "tcp-create-socket",
            "udp",
            "udp-create-socket",
            "ip-name-lookup",
        ],
        line: "0.2",
        max_patch: WASI_MAX_PATCH,
        grant: Grant::Denied(NO_NETWORK),
    },
    Allowed {
        package: "pko:transform",
        interfaces: &["log", "types"],
        line: "0.1",
        max_patch: None,
        grant: Grant::Served,
    },
];

/// What the allowlist says of one import name (`wasi:io/streams@0.2.6`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum ImportDecision {
    Granted(Grant),
    /// Refused at load, with why.
    Refused(String),
}

/// Decides one import against [`ALLOWLIST`]: a pure function of the name.
pub(super) fn decide(import: &str) -> ImportDecision {
    let Some((path, version)) = import.split_once('@') else {
        return ImportDecision::Refused("an unversioned import".into());
    };
    let Some((package, interface)) = path.split_once('/') else {
        return ImportDecision::Refused("not an interface of a package".into());
    };
    let Some(entry) = ALLOWLIST
        .iter()
        .find(|a| a.package == package && a.interfaces.contains(&interface))
    else {
        return ImportDecision::Refused("not an interface plugins are granted".into());
    };
    let patch = version
        .strip_prefix(entry.line)
        .and_then(|rest| rest.strip_prefix('.'))
        .and_then(|patch| patch.parse::<u32>().ok());
    match (patch, entry.max_patch) {
        (Some(patch), Some(max)) if patch <= max => ImportDecision::Granted(entry.grant),
        (Some(_), None) => ImportDecision::Granted(entry.grant),
        _ => ImportDecision::Refused(format!(
            "version {version} is not one this host links ({}.{})",
            entry.line,
            entry
                .max_patch
                .map_or_else(|| "x".to_owned(), |max| format!("0-{max}"))
        )),
    }
}

/// Guest log budget per call (log lines, stdout and stderr together); the rest is dropped
/// (with one note).
const LOG_BYTES_PER_CALL: usize = 16 * 1024;
/// What is kept of each of stdout and stderr per call: their lines go to the guest log after
/// the call, and stderr's also into a trap's message (a panic or a traceback ends up there).
const CAPTURE_BYTES: usize = 16 * 1024;
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

/// What a call's guest wrote to stdout and stderr.
pub(super) struct Output {
    pub(super) stdout: Captured,
    pub(super) stderr: Captured,
}

impl CallState {
    /// A fresh state for one call, and what keeps the guest's stdout and stderr. The
    /// environment and the arguments are empty (the builder's default), stdin is empty.
    pub(super) fn new(transform: Arc<str>, memory_bytes: usize) -> (Self, Output) {
        let output = Output {
            stdout: Captured::default(),
            stderr: Captured::default(),
        };
        let wasi = WasiCtxBuilder::new()
            .stdout(output.stdout.clone())
            .stderr(output.stderr.clone())
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
        (state, output)
    }

    /// Writes what the guest printed to the guest log, a line at a time (stdout at info,
    /// stderr at warn), within the call's log budget.
    pub(super) fn log_output(&mut self, output: &Output) {
        for (captured, level) in [(&output.stdout, Level::Info), (&output.stderr, Level::Warn)] {
            let bytes = captured.contents();
            let text = String::from_utf8_lossy(&bytes);
            for line in text.lines().filter(|l| !l.trim().is_empty()) {
                self.log.write(level, line);
            }
        }
    }
}

/// A guest's stdout or stderr: keeps the first [`CAPTURE_BYTES`] and drops the rest, and is
/// always ready, so a chatty guest neither blocks nor sees its writes fail.
#[derive(Clone, Default)]
pub(super) struct Captured(Arc<std::sync::Mutex<Vec<u8>>>);

impl Captured {
    pub(super) fn contents(&self) -> Vec<u8> {
        self.lock().clone()
    }

    fn push(&self, bytes: &[u8]) {
        let mut buffer = self.lock();
        let room = CAPTURE_BYTES.saturating_sub(buffer.len());
        buffer.extend_from_slice(&bytes[..bytes.len().min(room)]);
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Vec<u8>> {
        // A plain buffer: still consistent if a holder panicked.
        self.0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

impl wasmtime_wasi::cli::IsTerminal for Captured {
    fn is_terminal(&self) -> bool {
        false
    }
}

impl wasmtime_wasi::cli::StdoutStream for Captured {
    fn p2_stream(&self) -> Box<dyn wasmtime_wasi::p2::OutputStream> {
        Box::new(self.clone())
    }

    fn async_stream(&self) -> Box<dyn tokio::io::AsyncWrite + Send + Sync> {
        Box::new(self.clone())
    }
}

/// Bytes a write may carry (what WASI streams usually grant).
const WRITE_PERMIT: usize = 64 << 10;

#[wasmtime_wasi::async_trait]
impl wasmtime_wasi::p2::OutputStream for Captured {
    fn write(&mut self, bytes: bytes::Bytes) -> wasmtime_wasi::p2::StreamResult<()> {
        self.push(&bytes);
        Ok(())
    }

    fn flush(&mut self) -> wasmtime_wasi::p2::StreamResult<()> {
        Ok(())
    }

    fn check_write(&mut self) -> wasmtime_wasi::p2::StreamResult<usize> {
        Ok(WRITE_PERMIT)
    }
}

#[wasmtime_wasi::async_trait]
impl wasmtime_wasi::p2::Pollable for Captured {
    async fn ready(&mut self) {}
}

impl tokio::io::AsyncWrite for Captured {
    fn poll_write(
        self: std::pin::Pin<&mut Self>,
        _cx: &mut std::task::Context<'_>,
        buf: &[u8],
    ) -> std::task::Poll<std::io::Result<usize>> {
        self.push(buf);
        std::task::Poll::Ready(Ok(buf.len()))
    }

    fn poll_flush(
        self: std::pin::Pin<&mut Self>,
        _cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::task::Poll::Ready(Ok(()))
    }

    fn poll_shutdown(
        self: std::pin::Pin<&mut Self>,
        _cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::task::Poll::Ready(Ok(()))
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

/// Every import must be on the allowlist; the first one that is not is named, with why.
pub(super) fn check_imports(component: &Component, engine: &Engine) -> Result<(), PluginError> {
    for (name, _) in component.component_type().imports(engine) {
        if let ImportDecision::Refused(why) = decide(name) {
            return Err(PluginError::ForbiddenImport {
                import: name.to_owned(),
                why,
                granted: allowlist_summary(),
            });
        }
    }
    Ok(())
}

/// `linker` plus, for each denied interface `component` imports, stubs of its functions that
/// fail the call with a [`DeniedCall`] naming the function, and stand-ins for the resources it
/// defines (never created: only the denied functions could make one). Only what the component
/// imports is stubbed, under the exact names and versions it imports.
pub(super) fn with_denied_stubs(
    linker: &Linker<CallState>,
    component: &Component,
    engine: &Engine,
) -> wasmtime::Result<Linker<CallState>> {
    use wasmtime::component::types::ComponentItem;
    use wasmtime::component::{ResourceType, Val};

    let mut linker = linker.clone();
    // A resource another interface defines shows up again where it is `use`d (an `eq` bound):
    // that alias must not be defined twice, so the resources seen so far are remembered.
    let mut seen: Vec<ResourceType> = Vec::new();
    for (name, item) in component.component_type().imports(engine) {
        let ComponentItem::ComponentInstance(instance) = item.ty else {
            continue;
        };
        let denied = match decide(name) {
            ImportDecision::Granted(Grant::Denied(why)) => Some(why),
            _ => None,
        };
        let mut stubs = match denied {
            Some(_) => Some(linker.instance(name)?),
            None => None,
        };
        for (export, item) in instance.exports(engine) {
            match item.ty {
                ComponentItem::Resource(ty) => {
                    if seen.contains(&ty) {
                        continue;
                    }
                    seen.push(ty);
                    if let Some(stubs) = stubs.as_mut() {
                        stubs.resource(
                            export,
                            ResourceType::host::<DeniedResource>(),
                            |_, _| Ok(()),
                        )?;
                    }
                }
                ComponentItem::ComponentFunc(_) => {
                    if let (Some(stubs), Some(why)) = (stubs.as_mut(), denied) {
                        let function = format!("{name}#{export}");
                        stubs.func_new(
                            export,
                            move |_, _, _: &[Val], _: &mut [Val]| -> wasmtime::Result<()> {
                                Err(wasmtime::Error::new(DeniedCall {
                                    function: function.clone(),
                                    why,
                                }))
                            },
                        )?;
                    }
                }
                _ => {}
            }
        }
    }
    Ok(linker)
}

/// The host type of a denied interface's resources (none is ever created).
struct DeniedResource;

/// A plugin called a function of a denied interface: the call fails with this.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("the plugin called {function}: {why}")]
pub(super) struct DeniedCall {
    pub(super) function: String,
    pub(super) why: &'static str,
}

/// The allowlist in one line, for messages: `wasi:io/{error,poll,streams}@0.2.0-12 …`.
fn allowlist_summary() -> String {
    ALLOWLIST
        .iter()
        .map(|a| {
            let patches = a
                .max_patch
                .map_or_else(|| "x".to_owned(), |max| format!("0-{max}"));
            let denied = match a.grant {
                Grant::Served => "",
                Grant::Denied(_) => " (denied)",
            };
            format!(
                "{}/{{{}}}@{}.{patches}{denied}",
                a.package,
                a.interfaces.join(","),
                a.line
            )
        })
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
    fn stdout_and_stderr_reach_the_guest_log_bounded() {
        let (mut state, output) = CallState::new(Arc::from("team-a/t"), 1 << 20);
        output.stdout.push(b"hello from print\n\n");
        output
            .stderr
            .push(b"Traceback (most recent call last):\n  boom\n");
        // Past its capacity a stream keeps nothing more, and never fails the writer.
        output.stderr.push(&vec![b'x'; CAPTURE_BYTES * 2]);
        assert_eq!(output.stderr.contents().len(), CAPTURE_BYTES);
        let mut stream = output.stdout.clone();
        assert_eq!(
            wasmtime_wasi::p2::OutputStream::check_write(&mut stream).ok(),
            Some(WRITE_PERMIT)
        );
        let out = text_log(|| state.log_output(&output));
        let lines: Vec<&str> = out.lines().collect();
        assert!(
            lines[0].contains("INFO") && lines[0].contains("hello from print"),
            "{out}"
        );
        assert!(
            lines[1].contains("WARN") && lines[1].contains("Traceback"),
            "{out}"
        );
        assert!(
            lines[2].contains("WARN") && lines[2].contains("  boom"),
            "{out}"
        );
        // The 32 KiB line is over the call's 16 KiB log budget: dropped, with one note.
        assert!(out.contains("plugin log budget exhausted"), "{out}");
        assert!(!out.contains("xxxx"), "{out}");
    }

    #[test]
    fn the_allowlist_decides_per_interface_and_version() {
        use Grant::{Denied, Served};
        for (import, grant) in [
            ("wasi:io/streams@0.2.6", Served),
            ("wasi:io/error@0.2.0", Served),
            ("wasi:io/poll@0.2.12", Served),
            ("wasi:cli/environment@0.2.6", Served),
            ("wasi:cli/terminal-stdout@0.2.9", Served),
            ("wasi:clocks/wall-clock@0.2.6", Served),
            ("wasi:clocks/monotonic-clock@0.2.12", Served),
            ("wasi:random/insecure-seed@0.2.4", Served),
            ("wasi:random/random@0.2.9", Served),
            ("pko:transform/log@0.1.0", Served),
            ("pko:transform/types@0.1.3", Served),
            // What componentize-py and componentize-js components import besides: linked,
            // but every call fails.
            ("wasi:filesystem/preopens@0.2.9", Denied(NO_FILESYSTEM)),
            ("wasi:filesystem/types@0.2.12", Denied(NO_FILESYSTEM)),
            ("wasi:sockets/tcp@0.2.9", Denied(NO_NETWORK)),
            ("wasi:sockets/instance-network@0.2.9", Denied(NO_NETWORK)),
            ("wasi:sockets/ip-name-lookup@0.2.0", Denied(NO_NETWORK)),
        ] {
            assert_eq!(decide(import), ImportDecision::Granted(grant), "{import}");
        }
        for (refused, why) in [
            ("wasi:http/outgoing-handler@0.2.6", "not an interface"),
            ("wasi:http/types@0.2.10", "not an interface"),
            ("wasi:filesystem/other@0.2.6", "not an interface"),
            ("wasi:keyvalue/store@0.2.0-draft", "not an interface"),
            ("wasi:io/streams@0.3.0", "version 0.3.0"),
            ("wasi:io/streams@0.2.13", "version 0.2.13"),
            ("wasi:io/streams@0.2.1-rc", "version 0.2.1-rc"),
            ("wasi:io/streams", "unversioned"),
            ("pko:transform/log@0.2.0", "version 0.2.0"),
            ("pko:transform/secrets@0.1.0", "not an interface"),
            ("env", "unversioned"),
            ("pkg@1.0.0", "not an interface of a package"),
        ] {
            match decide(refused) {
                ImportDecision::Refused(reason) => {
                    assert!(reason.contains(why), "{refused}: {reason}")
                }
                other => panic!("{refused}: {other:?}"),
            }
        }
        let summary = allowlist_summary();
        assert!(
            summary.contains("wasi:io/{error,poll,streams}@0.2.0-12"),
            "{summary}"
        );
        assert!(
            summary.contains("wasi:filesystem/{types,preopens}@0.2.0-12 (denied)"),
            "{summary}"
        );
        assert!(
            summary.contains("pko:transform/{log,types}@0.1.x"),
            "{summary}"
        );
    }
}
