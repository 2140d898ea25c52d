//! Short commands a test runs to the end (helm, kubectl, make, an OCI runtime): their output,
//! or a panic that shows what they printed.

use std::io::Write;
use std::process::{Command, Stdio};

/// Runs `cmd` with `stdin` (if any) written to it and returns its stdout; panics, with both
/// outputs, if it cannot start or exits unsuccessfully. `what` names it in the message.
pub fn run(cmd: &mut Command, stdin: Option<&str>, what: &str) -> String {
    cmd.stdin(if stdin.is_some() {
        Stdio::piped()
    } else {
        Stdio::null()
    })
    .stdout(Stdio::piped())
    .stderr(Stdio::piped());
    let mut child = cmd
        .spawn()
        .unwrap_or_else(|e| panic!("cannot run {what}: {e}"));
    if let (Some(text), Some(mut pipe)) = (stdin, child.stdin.take()) {
        pipe.write_all(text.as_bytes())
            .unwrap_or_else(|e| panic!("writing to {what}: {e}"));
    }
    let out = child
        .wait_with_output()
        .unwrap_or_else(|e| panic!("waiting for {what}: {e}"));
    assert!(
        out.status.success(),
        "{what} failed ({}):\n{}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}
