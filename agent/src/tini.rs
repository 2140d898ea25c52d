//! `tini`: the agent binary as the workspace container's PID 1.
//!
//! PKO's manager starts the workspace container as `/share/tini /share/agent -- serve …`, with
//! both files copied from the agent image by its bootstrap container. A shell-less pulumi image
//! has no init of its own, so the agent image's `/tini` is this binary (the same file under
//! another name): invoked as `tini`, it does what tini does for that command line. It starts
//! the program as its child, forwards the signals a container runtime sends (so SIGTERM reaches
//! the agent, which interrupts pulumi cleanly), reaps every process that ends up its child
//! (pulumi's plugins and language hosts orphaned by a crash), and exits with the program's
//! status (128 + the signal's number when a signal ended it).
//!
//! The command line is tini's: options (`-s`, `-g`, `-v`, `-w`, `-l`, `-p SIGNAL`,
//! `-e EXIT_CODE`, `-h`, `--version`) may come anywhere before a `--`, which ends them and is
//! dropped; the first other word is the program, the rest its arguments. So `tini prog -- a b`
//! runs `prog a b`, as tini's option parser (GNU getopt, which permutes) makes of it.

use std::ffi::{OsStr, OsString};
use std::process::Command;

/// What the command line asks for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TiniArgs {
    /// The program and its arguments.
    pub program: Vec<OsString>,
    /// `-g`: signals go to the child's whole process group.
    pub group: bool,
    /// `-e CODE`: these exit codes of the child count as 0.
    pub remap_to_zero: Vec<i32>,
}

/// A command line tini refuses, or one that only asks for help or the version.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TiniParse {
    Run(TiniArgs),
    /// Print this and exit 0 (`-h`, `--version`, `-l`).
    Print(String),
    /// Print this to stderr and exit 1.
    Refuse(String),
}

const USAGE: &str =
    "usage: tini [-h] [-s] [-g] [-v] [-w] [-l] [-p SIGNAL] [-e EXIT_CODE] PROGRAM [-- ARGS]";

/// Parses tini's command line (without its own name).
pub fn parse(args: &[OsString]) -> TiniParse {
    let mut program = Vec::new();
    let mut group = false;
    let mut remap_to_zero = Vec::new();
    let mut words = args.iter();
    while let Some(word) = words.next() {
        let Some(text) = word.to_str() else {
            program.push(word.clone());
            continue;
        };
        match text {
            "--" => {
                program.extend(words.by_ref().cloned());
                break;
            }
            "--version" => return TiniParse::Print(format!("tini (pko-agent {})", crate::VERSION)),
            "-h" => return TiniParse::Print(USAGE.to_owned()),
            "-l" => return TiniParse::Print("pko-agent as tini: Apache-2.0".to_owned()),
            "-s" | "-v" | "-vv" | "-vvv" | "-w" => {}
            "-g" => group = true,
            "-p" => {
                // The parent-death signal: the runtime kills the container as a whole anyway.
                if words.next().is_none() {
                    return TiniParse::Refuse(format!("-p needs a signal\n{USAGE}"));
                }
            }
            "-e" => match words.next().and_then(|c| c.to_str()?.parse::<i32>().ok()) {
                Some(code) if (0..=255).contains(&code) => remap_to_zero.push(code),
                _ => return TiniParse::Refuse(format!("-e needs an exit code (0-255)\n{USAGE}")),
            },
            option if option.starts_with('-') && option.len() > 1 => {
                return TiniParse::Refuse(format!("unknown option {option:?}\n{USAGE}"));
            }
            _ => program.push(word.clone()),
        }
    }
    if program.is_empty() {
        return TiniParse::Refuse(format!("no program to run\n{USAGE}"));
    }
    TiniParse::Run(TiniArgs {
        program,
        group,
        remap_to_zero,
    })
}

/// Whether this process was invoked as `tini` (its file name, as the bootstrap copies it).
pub fn invoked_as_tini(argv0: &OsStr) -> bool {
    std::path::Path::new(argv0)
        .file_name()
        .is_some_and(|n| n == "tini")
}

/// The signals passed on to the child; SIGCHLD wakes the reaper.
const FORWARDED: [libc::c_int; 8] = [
    libc::SIGTERM,
    libc::SIGINT,
    libc::SIGHUP,
    libc::SIGQUIT,
    libc::SIGUSR1,
    libc::SIGUSR2,
    libc::SIGWINCH,
    libc::SIGCONT,
];

/// Runs tini's command line to the end; returns the exit code.
pub fn main(args: &[OsString]) -> i32 {
    let run = match parse(args) {
        TiniParse::Run(run) => run,
        TiniParse::Print(text) => {
            println!("{text}");
            return 0;
        }
        TiniParse::Refuse(text) => {
            eprintln!("tini: {text}");
            return 1;
        }
    };
    match supervise(&run) {
        Ok(code) if run.remap_to_zero.contains(&code) => 0,
        Ok(code) => code,
        Err(e) => {
            eprintln!("tini: {e}");
            1
        }
    }
}

/// Blocks the signals it handles (so they queue for `sigtimedwait`), starts the program with
/// an empty signal mask, then forwards and reaps until the program has ended.
#[allow(
    unsafe_code,
    reason = "signal masks, sigtimedwait, waitpid and kill; see SAFETY"
)]
fn supervise(run: &TiniArgs) -> std::io::Result<i32> {
    let Some((program, rest)) = run.program.split_first() else {
        return Ok(1);
    };
    // SAFETY: a zeroed sigset_t is a valid argument to sigemptyset, which initialises it.
    let mut set: libc::sigset_t = unsafe { std::mem::zeroed() };
    // SAFETY: `set` is a valid, initialised sigset_t owned by this frame; the calls only
    // change this thread's mask (no other thread exists yet in tini mode).
    unsafe {
        libc::sigemptyset(&mut set);
        libc::sigaddset(&mut set, libc::SIGCHLD);
        for sig in FORWARDED {
            libc::sigaddset(&mut set, sig);
        }
        if libc::pthread_sigmask(libc::SIG_BLOCK, &set, std::ptr::null_mut()) != 0 {
            return Err(std::io::Error::last_os_error());
        }
        // Orphans of the program (pulumi's plugins) become ours to reap even when we are not
        // PID 1 (tini's -s, always on here).
        libc::prctl(libc::PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0);
    }
    let mut command = Command::new(program);
    command.args(rest);
    if run.group {
        std::os::unix::process::CommandExt::process_group(&mut command, 0);
    }
    // The program starts with no signal blocked: the mask set above is tini's alone (a child
    // inherits its parent's mask, and the agent would never see SIGTERM).
    // SAFETY: the hook makes async-signal-safe calls on a local set and allocates nothing.
    unsafe {
        std::os::unix::process::CommandExt::pre_exec(&mut command, || {
            let mut empty: libc::sigset_t = std::mem::zeroed();
            libc::sigemptyset(&mut empty);
            if libc::pthread_sigmask(libc::SIG_SETMASK, &empty, std::ptr::null_mut()) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    let child = command.spawn().map_err(|e| {
        std::io::Error::new(
            e.kind(),
            format!("cannot run {}: {e}", program.to_string_lossy()),
        )
    })?;
    let child_pid = libc::pid_t::try_from(child.id()).unwrap_or(libc::pid_t::MAX);
    let timeout = libc::timespec {
        tv_sec: 1,
        tv_nsec: 0,
    };
    loop {
        // SAFETY: `set` is initialised; a null siginfo pointer is allowed.
        let sig = unsafe { libc::sigtimedwait(&set, std::ptr::null_mut(), &timeout) };
        if sig > 0 && sig != libc::SIGCHLD {
            let target = if run.group { -child_pid } else { child_pid };
            // SAFETY: kill(2) of our own child (or its group) with a signal we were sent.
            unsafe { libc::kill(target, sig) };
        }
        if let Some(code) = reap(child_pid) {
            return Ok(code);
        }
    }
}

/// Reaps every child that has ended; the program's exit code once it has.
#[allow(unsafe_code, reason = "waitpid; see SAFETY")]
fn reap(child_pid: libc::pid_t) -> Option<i32> {
    let mut ended = None;
    loop {
        let mut status: libc::c_int = 0;
        // SAFETY: waitpid with a valid pointer to a local; WNOHANG never blocks.
        let pid = unsafe { libc::waitpid(-1, &mut status, libc::WNOHANG) };
        if pid <= 0 {
            return ended;
        }
        if pid == child_pid {
            ended = Some(if libc::WIFEXITED(status) {
                libc::WEXITSTATUS(status)
            } else if libc::WIFSIGNALED(status) {
                128 + libc::WTERMSIG(status)
            } else {
                1
            });
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn words(list: &[&str]) -> Vec<OsString> {
        list.iter().map(OsString::from).collect()
    }

    fn program(parsed: TiniParse) -> Vec<String> {
        match parsed {
            TiniParse::Run(run) => run
                .program
                .iter()
                .map(|w| w.to_string_lossy().into_owned())
                .collect(),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn pkos_command_line_runs_the_agent_without_the_separator() {
        let argv = words(&[
            "/share/agent",
            "--",
            "serve",
            "--workspace",
            "/share/workspace",
            "--auth-mode",
            "kube",
        ]);
        assert_eq!(
            program(parse(&argv)),
            [
                "/share/agent",
                "serve",
                "--workspace",
                "/share/workspace",
                "--auth-mode",
                "kube"
            ]
        );
    }

    #[test]
    fn options_anywhere_before_the_separator_are_tinis() {
        let argv = words(&["-s", "prog", "-g", "--", "-g", "x"]);
        match parse(&argv) {
            TiniParse::Run(run) => {
                assert!(run.group);
                assert_eq!(run.program, words(&["prog", "-g", "x"]));
            }
            other => panic!("{other:?}"),
        }
        assert_eq!(program(parse(&words(&["--", "prog", "a"]))), ["prog", "a"]);
        match parse(&words(&["-e", "143", "prog"])) {
            TiniParse::Run(run) => assert_eq!(run.remap_to_zero, [143]),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn bad_command_lines_are_refused() {
        let cases: [&[&str]; 5] = [&[], &["-x", "prog"], &["-e"], &["-e", "999", "p"], &["--"]];
        for bad in cases {
            assert!(
                matches!(parse(&words(bad)), TiniParse::Refuse(_)),
                "{bad:?}"
            );
        }
        assert!(matches!(parse(&words(&["--version"])), TiniParse::Print(_)));
    }

    #[test]
    fn invoked_by_file_name() {
        assert!(invoked_as_tini(OsStr::new("/share/tini")));
        assert!(invoked_as_tini(OsStr::new("tini")));
        assert!(!invoked_as_tini(OsStr::new("/share/agent")));
        assert!(!invoked_as_tini(OsStr::new("/usr/bin/tini-static")));
    }
}
