//! Runs the `pulumi` CLI, the way the Automation API does: one process per command, with an
//! engine event log (`--event-log`) tailed while an operation runs.

use std::collections::{BTreeMap, VecDeque};
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use serde_json::Value;
use tokio::io::{AsyncBufReadExt, AsyncRead, AsyncReadExt, BufReader};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;
use tracing::{debug, warn};

use crate::limits::{self, BoundedLine, EventLine, EventLines};

/// How much of a command's stdout/stderr is kept (the end of it).
const OUTPUT_LIMIT: usize = 1024 * 1024;
/// How often the event log is read while an operation runs.
const EVENT_POLL: Duration = Duration::from_millis(100);

/// Failures of one CLI command.
#[derive(Debug, thiserror::Error)]
pub enum PulumiError {
    #[error("cannot start {program}: {source}")]
    Spawn {
        program: String,
        #[source]
        source: std::io::Error,
    },
    #[error("{what}: {source}")]
    Io {
        what: String,
        #[source]
        source: std::io::Error,
    },
    #[error("`pulumi {command}` failed ({status}): {detail}")]
    Failed {
        command: String,
        status: String,
        detail: String,
        stdout: String,
        stderr: String,
    },
    #[error("`pulumi {command}` was canceled")]
    Canceled {
        command: String,
        stdout: String,
        stderr: String,
    },
    #[error("unexpected output of `pulumi {command}`: {detail}")]
    Parse { command: String, detail: String },
}

impl PulumiError {
    /// stdout + stderr of a failed command, for pattern matching.
    pub fn output_text(&self) -> String {
        match self {
            Self::Failed { stdout, stderr, .. } | Self::Canceled { stdout, stderr, .. } => {
                format!("{stdout}\n{stderr}")
            }
            other => other.to_string(),
        }
    }
}

/// The output of a finished command.
#[derive(Debug, Default, Clone)]
pub struct Output {
    pub stdout: String,
    pub stderr: String,
}

/// How to run the CLI in one workspace.
#[derive(Debug, Clone)]
pub struct Cli {
    program: PathBuf,
    workdir: PathBuf,
    env: Vec<(String, String)>,
    log_level: u32,
    state_dir: PathBuf,
    cancel_grace: Duration,
    /// Bound of one line of the CLI's output and of one string of an engine event.
    max_line_bytes: usize,
    /// Variables pushed by the operator (`SetEnvironmentVariables`); shared by clones.
    pushed: Arc<Mutex<BTreeMap<String, String>>>,
}

impl Cli {
    /// `program` is the `pulumi` executable (a bare name is looked up on `PATH`); commands run in
    /// `workdir` with `env` added; event logs are written under `state_dir`.
    pub fn new(program: PathBuf, workdir: PathBuf, state_dir: PathBuf) -> Self {
        Self {
            program,
            workdir,
            env: Vec::new(),
            log_level: 0,
            state_dir,
            cancel_grace: Duration::from_secs(60),
            max_line_bytes: limits::DEFAULT_MAX_LOG_LINE_BYTES,
            pushed: Arc::default(),
        }
    }

    /// Replaces the pushed variables; they apply to every later command, over `with_env`'s.
    pub fn set_pushed_env(&self, env: BTreeMap<String, String>) {
        *self.pushed.lock().unwrap_or_else(PoisonError::into_inner) = env;
    }

    /// A variable as commands see it: pushed, else from `with_env`, else the agent's own.
    #[allow(
        clippy::disallowed_methods,
        reason = "the pulumi CLI inherits the agent's environment: this is what it will see"
    )]
    pub fn env_var(&self, name: &str) -> Option<String> {
        let pushed = self
            .pushed
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .get(name)
            .cloned();
        pushed
            .or_else(|| {
                self.env
                    .iter()
                    .rev()
                    .find(|(k, _)| k == name)
                    .map(|(_, v)| v.clone())
            })
            .or_else(|| std::env::var(name).ok())
    }

    fn pushed_env(&self) -> Vec<(String, String)> {
        self.pushed
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .iter()
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect()
    }

    /// Variables added to every command (e.g. from the pod's `$PULUMI_ENV` file).
    pub fn with_env(mut self, env: Vec<(String, String)>) -> Self {
        self.env = env;
        self
    }

    /// `-v=<level> --logtostderr` on every command when non-zero.
    pub fn with_log_level(mut self, level: u32) -> Self {
        self.log_level = level;
        self
    }

    /// How long a canceled operation may take to stop after SIGINT before it is killed.
    pub fn with_cancel_grace(mut self, grace: Duration) -> Self {
        self.cancel_grace = grace;
        self
    }

    /// Lines of the CLI's output, and strings of engine events, longer than this are cut (see
    /// [`crate::limits`]).
    pub fn with_max_line_bytes(mut self, max: usize) -> Self {
        self.max_line_bytes = max;
        self
    }

    pub fn workdir(&self) -> &Path {
        &self.workdir
    }

    /// Where the update plan saved under `id` is kept: with the event logs, so it lasts as long
    /// as this agent process (a restarted agent holds no plan).
    pub fn plan_path(&self, id: &str) -> PathBuf {
        self.state_dir.join("plans").join(format!("{id}.json"))
    }

    #[allow(unsafe_code, reason = "a pre_exec hook; see SAFETY")]
    fn command(&self, args: &[String]) -> tokio::process::Command {
        let mut cmd = tokio::process::Command::new(&self.program);
        cmd.current_dir(&self.workdir)
            .arg("--non-interactive")
            .arg("--color=never");
        if self.log_level > 0 {
            cmd.arg(format!("-v={}", self.log_level))
                .arg("--logtostderr");
        }
        cmd.args(args)
            // An agent must never stop to ask or to check for a newer CLI.
            .env("PULUMI_SKIP_UPDATE_CHECK", "true")
            // `--preview-only` asks nothing, and the CLI refuses it with confirmations skipped.
            .env(
                "PULUMI_SKIP_CONFIRMATIONS",
                if args.iter().any(|a| a == "--preview-only") {
                    "false"
                } else {
                    "true"
                },
            )
            // `--event-log` is offered only with debug commands on (the Automation API sets it too).
            .env("PULUMI_DEBUG_COMMANDS", "true")
            .envs(experimental(args))
            .envs(self.env.iter().map(|(k, v)| (k, v)))
            .envs(self.pushed_env())
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            // A dropped call (client gone) must not leave the CLI running.
            .kill_on_drop(true)
            .process_group(0);
        // If the agent dies (killed container process, OOM), pulumi is asked to stop the way a
        // Ctrl-C does, so it cancels cleanly and unlocks the stack instead of running orphaned.
        // SAFETY: the hook makes one async-signal-safe system call and does not allocate.
        unsafe {
            cmd.pre_exec(|| {
                if libc::prctl(
                    libc::PR_SET_PDEATHSIG,
                    libc::SIGTERM as libc::c_ulong,
                    0,
                    0,
                    0,
                ) == -1
                {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
        cmd
    }

    fn spawn_error(&self, source: std::io::Error) -> PulumiError {
        PulumiError::Spawn {
            program: self.program.display().to_string(),
            source,
        }
    }

    /// Runs a short command to completion; non-zero exit is [`PulumiError::Failed`].
    pub async fn run(&self, args: &[String]) -> Result<Output, PulumiError> {
        let command = redacted(args);
        debug!(%command, "pulumi");
        let out = self
            .command(args)
            .output()
            .await
            .map_err(|e| self.spawn_error(e))?;
        let output = Output {
            stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
            stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
        };
        if out.status.success() {
            Ok(output)
        } else {
            Err(failed(command, out.status.to_string(), output))
        }
    }

    /// Runs a command and parses its stdout as JSON.
    pub async fn run_json(&self, args: &[String]) -> Result<Value, PulumiError> {
        let out = self.run(args).await?;
        serde_json::from_str(out.stdout.trim()).map_err(|e| PulumiError::Parse {
            command: args.join(" "),
            detail: format!("{e}: {}", tail(&out.stdout, 300)),
        })
    }

    /// Runs an engine operation (`up`, `preview`, …) with `--event-log`, sending each engine
    /// event to `events` as it is written. Canceling `cancel`, or dropping the receiver of
    /// `events`, interrupts the CLI (SIGINT: Pulumi stops gracefully and unlocks the stack);
    /// after the grace period the process group is killed.
    pub async fn operation(
        &self,
        args: &[String],
        events: mpsc::Sender<Value>,
        cancel: CancellationToken,
    ) -> Result<Output, PulumiError> {
        let command = redacted(args);
        tokio::fs::create_dir_all(&self.state_dir)
            .await
            .map_err(|e| PulumiError::Io {
                what: format!("creating {}", self.state_dir.display()),
                source: e,
            })?;
        let log_path = self
            .state_dir
            .join(format!("events-{:016x}.jsonl", rand::random::<u64>()));
        // Created here (pulumi truncates and appends to it) so it can be opened for reading.
        let log_file = tokio::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .open(&log_path)
            .await
            .map_err(|e| PulumiError::Io {
                what: format!("creating {}", log_path.display()),
                source: e,
            })?;
        let mut full = args.to_vec();
        full.push("--event-log".into());
        full.push(log_path.display().to_string());
        debug!(%command, "pulumi operation");
        let mut child = self
            .command(&full)
            .spawn()
            .map_err(|e| self.spawn_error(e))?;
        let pid = child.id();
        let max_line = self.max_line_bytes;
        let stdout = tokio::spawn(capture(child.stdout.take(), "stdout", max_line));
        let stderr = tokio::spawn(capture(child.stderr.take(), "stderr", max_line));

        let mut log = EventLog::new(log_file, max_line);
        let mut tick = tokio::time::interval(EVENT_POLL);
        let mut interrupted = false;
        let mut kill_at: Option<tokio::time::Instant> = None;
        let status = loop {
            tokio::select! {
                status = child.wait() => break status,
                _ = tick.tick() => {
                    let gone = log.forward(&events).await;
                    if (gone || cancel.is_cancelled()) && !interrupted {
                        warn!(%command, client_gone = gone, "interrupting pulumi (SIGINT)");
                        interrupted = true;
                        interrupt(pid);
                        kill_at = Some(tokio::time::Instant::now() + self.cancel_grace);
                    }
                    if kill_at.is_some_and(|at| tokio::time::Instant::now() >= at) {
                        warn!(%command, "pulumi did not stop after SIGINT; killing it");
                        kill_group(pid);
                        kill_at = None;
                    }
                }
            }
        };
        let status = status.map_err(|e| PulumiError::Io {
            what: format!("waiting for pulumi {command}"),
            source: e,
        })?;
        log.forward(&events).await;
        let _ = tokio::fs::remove_file(&log_path).await;
        let output = Output {
            stdout: stdout.await.unwrap_or_default(),
            stderr: stderr.await.unwrap_or_default(),
        };
        if interrupted {
            return Err(PulumiError::Canceled {
                command,
                stdout: output.stdout,
                stderr: output.stderr,
            });
        }
        if status.success() {
            Ok(output)
        } else {
            Err(failed(command, status.to_string(), output))
        }
    }
}

fn failed(command: String, status: String, output: Output) -> PulumiError {
    // The CLI prints its diagnosis on stderr, and the failing resource's details on stdout.
    let detail = if output.stderr.trim().is_empty() {
        tail(&output.stdout, 2000)
    } else {
        tail(&output.stderr, 2000)
    };
    PulumiError::Failed {
        command,
        status,
        detail,
        stdout: output.stdout,
        stderr: output.stderr,
    }
}

/// `PULUMI_EXPERIMENTAL=true` for an up that runs an update plan: the CLI (v3.274) offers
/// `up --plan` only then (`preview --save-plan` is offered without it). Other commands run
/// without it.
fn experimental(args: &[String]) -> Option<(&'static str, &'static str)> {
    args.iter()
        .any(|a| a.starts_with("--plan="))
        .then_some(("PULUMI_EXPERIMENTAL", "true"))
}

/// The last `max` bytes of `s` (on a char boundary), trimmed.
pub fn tail(s: &str, max: usize) -> String {
    let s = s.trim();
    if s.len() <= max {
        return s.to_owned();
    }
    let mut start = s.len() - max;
    while !s.is_char_boundary(start) {
        start += 1;
    }
    format!("…{}", &s[start..])
}

#[allow(unsafe_code, reason = "kill(2) of our own child; see SAFETY")]
fn interrupt(pid: Option<u32>) {
    if let Some(pid) = pid.and_then(|p| libc::pid_t::try_from(p).ok()) {
        // SAFETY: plain system call on our own child.
        unsafe { libc::kill(pid, libc::SIGINT) };
    }
}

#[allow(unsafe_code, reason = "kill(2) of our own child's group; see SAFETY")]
fn kill_group(pid: Option<u32>) {
    if let Some(pid) = pid.and_then(|p| libc::pid_t::try_from(p).ok()) {
        // SAFETY: the child leads its own process group (process_group(0)).
        unsafe { libc::kill(-pid, libc::SIGKILL) };
    }
}

/// Reads a pipe to the end, logging each line and keeping the last [`OUTPUT_LIMIT`] bytes. A
/// line longer than `max_line` bytes is cut as it is read, so a huge line is never held whole.
async fn capture(
    pipe: Option<impl AsyncRead + Unpin>,
    stream: &'static str,
    max_line: usize,
) -> String {
    let Some(pipe) = pipe else {
        return String::new();
    };
    let mut reader = BufReader::new(pipe);
    let mut line = BoundedLine::new(max_line);
    let mut kept: VecDeque<String> = VecDeque::new();
    let mut size = 0usize;
    let mut keep = |text: String| {
        debug!(target: "pulumi", stream, "{text}");
        size += text.len() + 1;
        kept.push_back(text);
        while size > OUTPUT_LIMIT {
            match kept.pop_front() {
                Some(old) => size -= old.len() + 1,
                None => break,
            }
        }
    };
    while let Ok(chunk) = reader.fill_buf().await {
        if chunk.is_empty() {
            if !line.is_empty() {
                keep(line.take());
            }
            break;
        }
        let (consumed, ended) = match chunk.iter().position(|b| *b == b'\n') {
            Some(at) => {
                let piece = &chunk[..at];
                line.push(piece.strip_suffix(b"\r").unwrap_or(piece));
                (at + 1, true)
            }
            None => {
                line.push(chunk);
                (chunk.len(), false)
            }
        };
        reader.consume(consumed);
        if ended {
            keep(line.take());
        }
    }
    let mut text = kept.into_iter().collect::<Vec<_>>().join("\n");
    if !text.is_empty() {
        text.push('\n');
    }
    text
}

/// Incremental reader of a JSON-lines event log that another process is appending to.
struct EventLog {
    file: tokio::fs::File,
    lines: EventLines,
    max_string: usize,
}

/// Bytes of the event log read at a time.
const EVENT_READ_CHUNK: usize = 1024 * 1024;

impl EventLog {
    fn new(file: tokio::fs::File, max_string: usize) -> Self {
        Self {
            file,
            lines: EventLines::new(limits::MAX_EVENT_LINE_BYTES),
            max_string,
        }
    }

    /// Sends every complete new line; returns true when the receiver is gone. Reads in
    /// bounded chunks: what pulumi wrote since the last look may be large.
    async fn forward(&mut self, events: &mpsc::Sender<Value>) -> bool {
        let mut chunk = vec![0u8; EVENT_READ_CHUNK];
        loop {
            let read = match self.file.read(&mut chunk).await {
                Ok(0) => break,
                Ok(read) => read,
                Err(e) => {
                    warn!(error = %e, "cannot read the engine event log");
                    break;
                }
            };
            for line in self.lines.push(&chunk[..read]) {
                let Some(event) = self.event(line) else {
                    continue;
                };
                if events.send(event).await.is_err() {
                    return true;
                }
            }
        }
        events.is_closed()
    }

    fn event(&self, line: EventLine) -> Option<Value> {
        let line = match line {
            EventLine::Whole(line) => line,
            EventLine::Dropped { bytes } => {
                warn!(bytes, "dropping an engine event over the line bound");
                return Some(dropped_event(bytes));
            }
        };
        let line = String::from_utf8_lossy(&line);
        let line = line.trim();
        if line.is_empty() {
            return None;
        }
        match serde_json::from_str::<Value>(line) {
            Ok(mut event) => {
                // A diagnostic is a line the program printed; property values can be any
                // size: each is bounded before it travels.
                limits::truncate_strings(&mut event, self.max_string);
                Some(event)
            }
            Err(e) => {
                warn!(error = %e, "skipping an unreadable engine event");
                None
            }
        }
    }
}

/// The warning diagnostic that stands for an engine event too large to read.
fn dropped_event(bytes: usize) -> Value {
    serde_json::json!({
        "diagnosticEvent": {
            "severity": "warning",
            "prefix": "warning: ",
            "color": "never",
            "message": format!(
                "pko-agent: an engine event of {bytes} bytes was dropped: the agent reads at most {} MiB of one event\n",
                limits::MAX_EVENT_LINE_BYTES / (1024 * 1024)
            ),
        }
    })
}

/// A command line as it may be logged or reported: the value of every `--secret key=value`
/// and every `--json=` document (which carries secret config) is replaced, so a secret never
/// reaches a log line, an error or a status.
pub fn redacted(args: &[String]) -> String {
    let mut out = Vec::with_capacity(args.len());
    let mut secret_next = false;
    for arg in args {
        let shown = if secret_next {
            match arg.split_once('=') {
                Some((key, _)) => format!("{key}=[secret]"),
                None => "[secret]".to_owned(),
            }
        } else if arg.starts_with("--json=") {
            "--json=[redacted]".to_owned()
        } else if let Some(value) = arg.strip_prefix("--secret=") {
            match value.split_once('=') {
                Some((key, _)) => format!("--secret={key}=[secret]"),
                None => "--secret=[secret]".to_owned(),
            }
        } else {
            arg.clone()
        };
        secret_next = arg == "--secret";
        out.push(shown);
    }
    out.join(" ")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_an_up_with_a_plan_runs_experimental() {
        let args = |a: &[&str]| a.iter().map(|s| (*s).to_owned()).collect::<Vec<_>>();
        assert_eq!(
            experimental(&args(&["up", "--yes", "--plan=/s/plans/p.json"])),
            Some(("PULUMI_EXPERIMENTAL", "true"))
        );
        assert_eq!(
            experimental(&args(&["preview", "--save-plan=/s/plans/p.json"])),
            None
        );
        assert_eq!(experimental(&args(&["up", "--yes"])), None);
        let cli = Cli::new("pulumi".into(), "/w".into(), "/s".into());
        assert_eq!(cli.plan_path("s-1"), PathBuf::from("/s/plans/s-1.json"));
    }

    /// An event log holding an event line over the bound between two ordinary ones: the
    /// ordinary ones arrive, the long one is a warning saying its size.
    #[tokio::test]
    async fn an_event_line_over_the_bound_is_dropped_with_a_warning() {
        let dir = tempfile::tempdir().expect("tmp");
        let path = dir.path().join("events.jsonl");
        let huge = limits::MAX_EVENT_LINE_BYTES + 10;
        let mut text = String::from("{\"sequence\":1}\n{\"big\":\"");
        text.push_str(&"x".repeat(huge - "{\"big\":\"\"}".len()));
        text.push_str("\"}\n{\"sequence\":3}\n");
        std::fs::write(&path, &text).expect("write");
        let file = tokio::fs::File::open(&path).await.expect("open");
        let mut log = EventLog::new(file, 1024);
        let (tx, mut rx) = mpsc::channel(8);
        assert!(!log.forward(&tx).await);
        drop(tx);
        let mut got = Vec::new();
        while let Some(event) = rx.recv().await {
            got.push(event);
        }
        assert_eq!(got.len(), 3, "{got:?}");
        assert_eq!(got[0], serde_json::json!({"sequence": 1}));
        assert_eq!(got[2], serde_json::json!({"sequence": 3}));
        let message = got[1]
            .pointer("/diagnosticEvent/message")
            .and_then(Value::as_str)
            .expect("a diagnostic");
        assert!(message.contains(&format!("{huge} bytes")), "{message}");
        assert_eq!(got[1]["diagnosticEvent"]["severity"], "warning");
    }

    #[tokio::test]
    async fn captured_lines_are_cut_at_the_bound() {
        let long = format!("{}\r\n", "ä".repeat(50));
        let text = format!("short\n{long}tail without newline");
        let got = capture(Some(text.as_bytes()), "stdout", 11).await;
        let lines: Vec<&str> = got.lines().collect();
        assert_eq!(
            lines,
            vec![
                "short",
                &format!("äääää{}", limits::marker(90)),
                &format!("tail withou{}", limits::marker(9)),
            ]
        );
    }

    #[test]
    fn secrets_never_reach_a_logged_command() {
        let args: Vec<String> = [
            "config",
            "set-all",
            "--path",
            "--secret",
            "app:[\"password\"]=hunter2",
            "--plaintext",
            "app:[\"greeting\"]=hello",
            "--secret=k=v2",
            "--json={\"a\":\"s3\"}",
        ]
        .iter()
        .map(|s| (*s).to_owned())
        .collect();
        let line = redacted(&args);
        for secret in ["hunter2", "v2", "s3"] {
            assert!(!line.contains(secret), "{line}");
        }
        assert!(line.contains("greeting\"]=hello"), "{line}");
        assert!(line.contains("password\"]=[secret]"), "{line}");
    }
}
