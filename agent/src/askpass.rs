//! The agent as ssh's `SSH_ASKPASS`: ssh asks a program for an SSH key's passphrase, so a
//! passphrase-protected key works with the image's own `ssh` and no terminal. `git` runs with
//! `SSH_ASKPASS` set to this binary and [`FILE_ENV`] naming a 0600 file that holds the
//! passphrase (in the fetch's staging folder, removed with it); ssh passes both on, and the
//! binary, started that way, prints the file and exits.

use std::ffi::OsString;
use std::io::Write;

/// Names the passphrase file; only ever set on the git commands of a fetch.
pub const FILE_ENV: &str = "PKO_AGENT_ASKPASS_FILE";

/// The passphrase file when this process was started by ssh as its askpass program (ssh gives
/// one argument: the prompt).
pub fn requested(argv: &[OsString], file: Option<OsString>) -> Option<OsString> {
    file.filter(|f| !f.is_empty() && argv.len() == 2)
}

/// Prints the passphrase of `file` on stdout, as ssh reads it (one line).
pub fn answer(file: &std::path::Path) -> std::process::ExitCode {
    let Ok(passphrase) = std::fs::read_to_string(file) else {
        return std::process::ExitCode::FAILURE;
    };
    let line = passphrase.trim_end_matches(['\n', '\r']);
    let mut out = std::io::stdout();
    if writeln!(out, "{line}").and_then(|()| out.flush()).is_err() {
        return std::process::ExitCode::FAILURE;
    }
    std::process::ExitCode::SUCCESS
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_sshs_call_with_the_file_set_is_an_askpass_request() {
        let prompt = vec![
            OsString::from("agent"),
            OsString::from("Enter passphrase: "),
        ];
        assert_eq!(
            requested(&prompt, Some("/s/passphrase".into())),
            Some("/s/passphrase".into())
        );
        assert_eq!(requested(&prompt, None), None);
        assert_eq!(requested(&prompt, Some("".into())), None);
        let serve = vec![
            OsString::from("agent"),
            OsString::from("serve"),
            OsString::from("--workspace"),
        ];
        assert_eq!(requested(&serve, Some("/s/passphrase".into())), None);
    }
}
