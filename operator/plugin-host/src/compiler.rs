//! Compiling a module in a child process, under a memory and a time bound.
//!
//! A module is a tenant's bytes, and Cranelift's memory and time grow with what the module
//! declares, not with its size on the wire: a few MiB of one huge function can ask for
//! gigabytes. In the operator's own process nothing could stop such a compile (a thread cannot
//! be cancelled, and the container's OOM killer would take the whole operator). So the
//! operator runs the compiler as a child (its own binary, `plugin compile`) with
//! `RLIMIT_DATA` set before it starts and a deadline after which it is killed; the child
//! writes the serialized machine code to its stdout and the parent deserializes it.
//!
//! The child's engine is built from the same settings as the parent's (see
//! [`crate::host::child_engine`]), and wasmtime checks the settings again when the parent
//! deserializes, so code from another configuration is refused, never run.

use std::ffi::OsString;
use std::io::{Read, Write};
use std::os::unix::process::ExitStatusExt;
use std::path::PathBuf;
use std::process::{ExitCode, ExitStatus, Stdio};
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};

use crate::errors::PluginError;

/// How the operator starts the compiler: a program and the arguments before the bounds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CompilerCommand {
    pub program: PathBuf,
    pub args: Vec<OsString>,
}

/// What one compile may use.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CompileBounds {
    /// `RLIMIT_DATA` of the child: its heap and every private writable mapping.
    pub memory_bytes: u64,
    /// Wall-clock time from start to exit; the child is killed after it.
    pub timeout: Duration,
}

impl CompileBounds {
    /// `--plugin-compile-memory-mib` and `--plugin-compile-timeout-seconds` defaults.
    pub const DEFAULT: Self = Self {
        memory_bytes: 256 << 20,
        timeout: Duration::from_secs(30),
    };
}

/// Where modules are compiled.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Compiler {
    /// In this process, unbounded: for tools that run one author's own modules (`plugin
    /// test`, `render`, benchmarks). The operator never uses it.
    InProcess,
    /// In a child process started with `command`, within `bounds`.
    Child {
        command: CompilerCommand,
        bounds: CompileBounds,
    },
}

/// Compile threads in the child: each thread's stack counts against `RLIMIT_DATA`, so the
/// bound must not shrink with the node's core count.
const CHILD_THREADS: usize = 2;
/// Bytes of the child's stderr kept for the error message.
const STDERR_KEPT: usize = 4096;
/// Exit code of a child whose module does not compile (the reason on stderr).
const EXIT_INVALID: i32 = 3;
/// Exit code of a child that ran out of memory with a recoverable error.
const EXIT_NO_MEMORY: i32 = 4;

/// How a compile in a child ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum ChildOutcome {
    Compiled,
    /// The module is not valid wasm, or uses something the engine does not support.
    Invalid(String),
    /// The child reached its memory bound.
    OutOfMemory,
    /// The deadline passed and the child was killed.
    TimedOut,
    /// Anything else: killed by someone else (the container's OOM killer), a crash.
    Failed(String),
}

/// Reads how the child ended from its status and stderr; `timed_out` when the parent killed
/// it at the deadline.
pub(crate) fn outcome(status: ExitStatus, stderr: &str, timed_out: bool) -> ChildOutcome {
    if timed_out {
        return ChildOutcome::TimedOut;
    }
    let last_line = stderr.trim().lines().last().unwrap_or("").trim().to_owned();
    // Rust's allocator reports a failed allocation on stderr and aborts.
    if stderr.contains("memory allocation of") || status.code() == Some(EXIT_NO_MEMORY) {
        return ChildOutcome::OutOfMemory;
    }
    match (status.code(), status.signal()) {
        (Some(0), _) => ChildOutcome::Compiled,
        (Some(EXIT_INVALID), _) => ChildOutcome::Invalid(stderr.trim().to_owned()),
        (Some(code), _) => ChildOutcome::Failed(format!("exited with code {code}: {last_line}")),
        (None, Some(libc::SIGKILL)) => ChildOutcome::Failed(
            "killed (SIGKILL): the container may be out of memory; raise its limit or lower --plugin-max-concurrent-loads".into(),
        ),
        (None, Some(signal)) => {
            ChildOutcome::Failed(format!("killed by signal {signal}: {last_line}"))
        }
        (None, None) => ChildOutcome::Failed("ended without a status".into()),
    }
}

/// Compiles `wasm` in a child started with `command`, within `bounds`; returns the
/// serialized component. `memory_reservation`: the parent engine's, so both engines agree.
pub(crate) async fn compile_in_child(
    command: &CompilerCommand,
    bounds: CompileBounds,
    memory_reservation: u64,
    wasm: Vec<u8>,
) -> Result<Vec<u8>, PluginError> {
    let mut cmd = child_command(command, bounds, memory_reservation);
    let mut child = cmd
        .spawn()
        .map_err(|e| PluginError::Host(format!("cannot start the compiler: {e}")))?;
    let (Some(mut stdin), Some(mut stdout), Some(mut stderr)) =
        (child.stdin.take(), child.stdout.take(), child.stderr.take())
    else {
        return Err(PluginError::Host("the compiler has no pipes".into()));
    };
    // The machine code is a few times the wasm; the child cannot produce more than its
    // memory bound, and the parent reads no more than that either.
    let out_cap = bounds.memory_bytes;
    let feed = async move {
        // A child that exits early closes the pipe: its status says why.
        let _ = stdin.write_all(&wasm).await;
    };
    let read_out = async move {
        let mut out = Vec::new();
        let read = (&mut stdout).take(out_cap + 1).read_to_end(&mut out).await;
        // A child writing past the cap then fails on a closed pipe instead of blocking.
        drop(stdout);
        read.map(|_| out)
    };
    let read_err = async move {
        let mut err = Vec::new();
        let _ = (&mut stderr)
            .take(STDERR_KEPT as u64)
            .read_to_end(&mut err)
            .await;
        // The rest is drained, so the child never blocks on a full stderr pipe either.
        let _ = tokio::io::copy(&mut stderr, &mut tokio::io::sink()).await;
        err
    };
    let io = async move {
        let (_, out, err) = tokio::join!(feed, read_out, read_err);
        (out, err)
    };
    let run = async {
        let (out, err) = io.await;
        let status = child.wait().await;
        (out, err, status)
    };
    let finished = tokio::time::timeout(bounds.timeout, run).await;
    let (out, err, status, timed_out) = match finished {
        Ok((out, err, status)) => (out, err, status, false),
        Err(_) => {
            let _ = child.kill().await;
            (Ok(Vec::new()), Vec::new(), child.wait().await, true)
        }
    };
    let status =
        status.map_err(|e| PluginError::Host(format!("cannot wait for the compiler: {e}")))?;
    if out.as_ref().is_ok_and(|o| o.len() as u64 > out_cap) {
        return Err(PluginError::Host(
            "the compiler wrote more than its memory bound".into(),
        ));
    }
    let stderr = String::from_utf8_lossy(&err);
    match outcome(status, &stderr, timed_out) {
        ChildOutcome::Compiled => {
            out.map_err(|e| PluginError::Host(format!("cannot read the compiler: {e}")))
        }
        ChildOutcome::Invalid(reason) => Err(PluginError::Compile(reason)),
        ChildOutcome::OutOfMemory => Err(PluginError::CompileMemory(bounds.memory_bytes)),
        ChildOutcome::TimedOut => Err(PluginError::CompileTimeout(bounds.timeout)),
        ChildOutcome::Failed(reason) => Err(PluginError::Host(format!("the compiler {reason}"))),
    }
}

#[allow(unsafe_code, reason = "a pre_exec hook; see SAFETY")]
fn child_command(
    command: &CompilerCommand,
    bounds: CompileBounds,
    memory_reservation: u64,
) -> tokio::process::Command {
    let mut cmd = tokio::process::Command::new(&command.program);
    cmd.args(&command.args)
        .arg(format!("--memory-reservation-bytes={memory_reservation}"))
        // Nothing of the operator's environment (tokens, proxies) reaches the child.
        .env_clear()
        .env("RAYON_NUM_THREADS", CHILD_THREADS.to_string())
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true);
    let limit = libc::rlimit {
        rlim_cur: bounds.memory_bytes,
        rlim_max: bounds.memory_bytes,
    };
    // SAFETY: between fork and exec the hook makes only async-signal-safe system calls on
    // values computed before the fork, and allocates nothing: the memory bound holds from the
    // child's first instruction, and the child dies with the operator.
    unsafe {
        cmd.pre_exec(move || {
            if libc::setrlimit(libc::RLIMIT_DATA, &limit) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    cmd
}

/// The child's side (`pko-operator plugin compile --memory-reservation-bytes=<n>`): reads a
/// component from stdin, writes its serialized machine code to stdout. Runs before any async
/// runtime starts: every thread's stack counts against the memory bound.
pub fn child_main(memory_reservation: u64) -> ExitCode {
    // The first to be killed when the container runs short, not the operator beside it.
    let _ = std::fs::write("/proc/self/oom_score_adj", "1000");
    let mut wasm = Vec::new();
    if let Err(e) = std::io::stdin().lock().read_to_end(&mut wasm) {
        return fail(EXIT_INVALID, &format!("cannot read the module: {e}"));
    }
    let compiled = crate::host::child_engine(memory_reservation)
        .and_then(|engine| engine.precompile_component(&wasm));
    match compiled {
        Ok(code) => match std::io::stdout().lock().write_all(&code) {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => fail(1, &format!("cannot write the machine code: {e}")),
        },
        Err(e) => {
            let text = format!("{e:#}");
            let no_memory = e.chain().any(|cause| {
                cause
                    .downcast_ref::<std::io::Error>()
                    .is_some_and(|io| io.raw_os_error() == Some(libc::ENOMEM))
            }) || text.contains("os error 12");
            fail(
                if no_memory {
                    EXIT_NO_MEMORY
                } else {
                    EXIT_INVALID
                },
                &text,
            )
        }
    }
}

fn fail(code: i32, message: &str) -> ExitCode {
    let _ = writeln!(std::io::stderr(), "{message}");
    ExitCode::from(u8::try_from(code).unwrap_or(1))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn exited(code: i32) -> ExitStatus {
        ExitStatus::from_raw(code << 8)
    }

    fn signaled(signal: i32) -> ExitStatus {
        ExitStatus::from_raw(signal)
    }

    #[test]
    fn a_child_outcome_is_read_from_its_status_and_stderr() {
        assert_eq!(outcome(exited(0), "", false), ChildOutcome::Compiled);
        assert_eq!(
            outcome(exited(EXIT_INVALID), "failed to parse\n", false),
            ChildOutcome::Invalid("failed to parse".into())
        );
        assert_eq!(
            outcome(
                signaled(libc::SIGABRT),
                "memory allocation of 1048576 bytes failed\n",
                false
            ),
            ChildOutcome::OutOfMemory
        );
        assert_eq!(
            outcome(
                exited(EXIT_NO_MEMORY),
                "Cannot allocate memory (os error 12)",
                false
            ),
            ChildOutcome::OutOfMemory
        );
        // The parent's kill at the deadline is a timeout, whatever the status says.
        assert_eq!(
            outcome(signaled(libc::SIGKILL), "", true),
            ChildOutcome::TimedOut
        );
        assert!(matches!(
            outcome(signaled(libc::SIGKILL), "", false),
            ChildOutcome::Failed(m) if m.contains("out of memory")
        ));
        assert!(matches!(
            outcome(signaled(libc::SIGSEGV), "boom\n", false),
            ChildOutcome::Failed(m) if m.contains("signal 11") && m.contains("boom")
        ));
        assert!(matches!(
            outcome(exited(1), "a\nlast words\n", false),
            ChildOutcome::Failed(m) if m.contains("code 1: last words")
        ));
    }

    fn shell(script: &str) -> CompilerCommand {
        CompilerCommand {
            program: "/bin/sh".into(),
            args: vec!["-c".into(), script.into(), "sh".into()],
        }
    }

    const BOUNDS: CompileBounds = CompileBounds {
        memory_bytes: 64 << 20,
        timeout: Duration::from_secs(600),
    };

    #[tokio::test]
    async fn a_child_past_its_deadline_is_killed_and_reported() {
        let dir = tempfile::tempdir().expect("tmp");
        let pid_file = dir.path().join("pid");
        // A child that never ends on its own: only the deadline stops it.
        let cmd = shell(&format!("echo $$ > {}; exec sleep 600", pid_file.display()));
        let bounds = CompileBounds {
            timeout: Duration::from_millis(200),
            ..BOUNDS
        };
        let err = compile_in_child(&cmd, bounds, 0, vec![0; 16])
            .await
            .expect_err("killed");
        assert_eq!(err, PluginError::CompileTimeout(Duration::from_millis(200)));
        let pid = std::fs::read_to_string(&pid_file).expect("pid");
        let alive = std::path::Path::new(&format!("/proc/{}", pid.trim())).exists();
        assert!(!alive, "the child was reaped");
    }

    #[tokio::test]
    async fn the_child_gets_the_bound_the_reservation_and_no_environment() {
        let cmd = shell(
            "cat >/dev/null; printf '%s|%s|%s|%s' \"$(ulimit -d)\" \"$1\" \"${HOME:-none}\" \"$RAYON_NUM_THREADS\"",
        );
        let out = compile_in_child(&cmd, BOUNDS, 123, vec![0; 1 << 20])
            .await
            .expect("runs");
        // `ulimit -d` counts KiB.
        assert_eq!(
            String::from_utf8_lossy(&out),
            format!("{}|--memory-reservation-bytes=123|none|2", 64 << 10)
        );
    }

    #[tokio::test]
    async fn a_refused_module_and_a_crash_are_told_apart() {
        let invalid = shell("cat >/dev/null; echo 'not a component' >&2; exit 3");
        assert_eq!(
            compile_in_child(&invalid, BOUNDS, 0, vec![1, 2, 3]).await,
            Err(PluginError::Compile("not a component".into()))
        );
        let crash = shell("kill -SEGV $$");
        assert!(matches!(
            compile_in_child(&crash, BOUNDS, 0, vec![1, 2, 3]).await,
            Err(PluginError::Host(m)) if m.contains("signal 11")
        ));
        // More output than the bound allows is refused, not buffered.
        let flood = shell("cat >/dev/null; head -c 70000000 /dev/zero");
        assert!(matches!(
            compile_in_child(&flood, BOUNDS, 0, vec![]).await,
            Err(PluginError::Host(m)) if m.contains("more than its memory bound")
        ));
    }
}
