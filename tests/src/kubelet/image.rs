//! What the container images of a workspace pod hold, for a kubelet with no container runtime:
//! a container's absolute paths are mapped to host paths, those of its volume mounts to the
//! pod's folders and those of its image's files to the binaries the harness built.
//!
//! * Every image has this project's agent at `/usr/local/bin/pko-agent` (the operator image's
//!   bootstrap copies it; any workspace image runs the copy), and, as this project's agent
//!   image has them for PKO's pod layout, at `/agent` and `/tini`.
//! * PKO's agent image (`pulumi/pulumi-kubernetes-operator:<version>`, or any image whose name
//!   holds `pulumi-kubernetes-operator`) has PKO's agent (built by `tools/build.sh pko`) at
//!   `/agent`, and `/tini`.
//!
//! `/tini` is this project's agent called as `tini` (it is tini when called so: the first `--`
//! passed on, signals forwarded, children reaped); PKO's tini is not built here. `/agent` and
//! `/tini` are small scripts that run the real binaries, so what PKO's bootstrap container copies
//! to each pod's share (`cp /agent /tini /share/`) stays small.
//!
//! Paths are mapped wherever a command, an argument, an env value or a shell script names them
//! (`sh -c "/share/agent init -t /share/source …"`): at the start of a word, after `=`, `:` or a
//! quote, and ending the word or followed by `/`.

use std::path::{Path, PathBuf};

use crate::{HarnessError, tool_dir};

/// Where this project's agent sits in its images.
pub const AGENT_IN_IMAGE: &str = "/usr/local/bin/pko-agent";
/// What names PKO's agent image.
pub const PKO_AGENT_IMAGE: &str = "pulumi-kubernetes-operator";

/// The files an image holds beyond the host's: (path in the image, host file).
#[derive(Clone, Debug)]
pub struct ImageFiles {
    /// A container whose image name contains this has the files (`""`: every image).
    pub image_contains: String,
    pub files: Vec<(String, PathBuf)>,
}

/// Every image the kubelet knows; earlier entries win for the same path.
#[derive(Clone, Debug, Default)]
pub(crate) struct Images {
    entries: Vec<ImageFiles>,
}

impl Images {
    /// `extra` first, then PKO's agent image, then this project's agent in every image; the
    /// scripts are written under `dir`.
    pub(crate) fn new(
        extra: Vec<ImageFiles>,
        agent: &Path,
        dir: &Path,
    ) -> Result<Self, HarnessError> {
        let (pko, ours) = (dir.join("pko-agent-image"), dir.join("pko-rs-agent-image"));
        for folder in [&pko, &ours] {
            std::fs::create_dir_all(folder)
                .map_err(|e| HarnessError::io(format!("creating {}", folder.display()), e))?;
        }
        // tini is the agent called by that name.
        let tini = dir.join("tini");
        let _ = std::fs::remove_file(&tini);
        std::os::unix::fs::symlink(agent, &tini)
            .map_err(|e| HarnessError::io(format!("linking {}", tini.display()), e))?;
        let pko_agent = match tool_dir("pko").map(|d| d.join("pko-agent")) {
            Ok(binary) if binary.is_file() => exec_script(&binary),
            Ok(binary) => missing_script(&format!(
                "{} is not built (tools/build.sh pko)",
                binary.display()
            )),
            Err(e) => missing_script(&e.to_string()),
        };
        let mut entries = extra;
        for (folder, agent_script, contains) in [
            (&pko, pko_agent, PKO_AGENT_IMAGE),
            (&ours, exec_script(agent), ""),
        ] {
            let mut files = Vec::new();
            for (name, text) in [("agent", agent_script), ("tini", exec_script(&tini))] {
                write_executable(&folder.join(name), &text)?;
                files.push((format!("/{name}"), folder.join(name)));
            }
            if contains.is_empty() {
                files.insert(0, (AGENT_IN_IMAGE.into(), agent.to_path_buf()));
            }
            entries.push(ImageFiles {
                image_contains: contains.into(),
                files,
            });
        }
        Ok(Self { entries })
    }

    /// The files of `image`, first entry first.
    pub(crate) fn files_of(&self, image: &str) -> Vec<(String, PathBuf)> {
        let mut out: Vec<(String, PathBuf)> = Vec::new();
        for entry in self
            .entries
            .iter()
            .filter(|e| image.contains(&e.image_contains))
        {
            for (path, host) in &entry.files {
                if !out.iter().any(|(p, _)| p == path) {
                    out.push((path.clone(), host.clone()));
                }
            }
        }
        out
    }
}

/// A script that runs `binary` with its arguments (its name as `$0`).
fn exec_script(binary: &Path) -> String {
    format!(
        "#!/bin/sh\nexec {} \"$@\"\n",
        shell_quote(&binary.display().to_string())
    )
}

fn missing_script(why: &str) -> String {
    format!(
        "#!/bin/sh\necho {} >&2\nexit 127\n",
        shell_quote(&format!("the harness has no PKO agent: {why}"))
    )
}

fn shell_quote(s: &str) -> String {
    format!("'{}'", s.replace('\'', r"'\''"))
}

fn write_executable(path: &Path, text: &str) -> Result<(), HarnessError> {
    use std::os::unix::fs::PermissionsExt;
    std::fs::write(path, text)
        .map_err(|e| HarnessError::io(format!("writing {}", path.display()), e))?;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o755))
        .map_err(|e| HarnessError::io(format!("making {} executable", path.display()), e))
}

/// Container paths → host paths, longest first.
#[derive(Clone, Debug, Default)]
pub(crate) struct PathMap {
    entries: Vec<(String, String)>,
}

impl PathMap {
    pub(crate) fn new(entries: impl IntoIterator<Item = (String, PathBuf)>) -> Self {
        let mut entries: Vec<(String, String)> = entries
            .into_iter()
            .map(|(c, h)| (c.trim_end_matches('/').to_owned(), h.display().to_string()))
            .filter(|(c, _)| c.starts_with('/') && c.len() > 1)
            .collect();
        entries.sort_by_key(|(c, _)| std::cmp::Reverse(c.len()));
        Self { entries }
    }

    /// `text` with every container path it names mapped.
    pub(crate) fn map(&self, text: &str) -> String {
        let mut out = String::with_capacity(text.len());
        let mut i = 0;
        let bytes = text.as_bytes();
        while i < text.len() {
            let starts_word = bytes[i] == b'/' && (i == 0 || is_before_path(bytes[i - 1]));
            let hit = starts_word
                .then(|| {
                    self.entries.iter().find(|(c, _)| {
                        text[i..].starts_with(c.as_str())
                            && bytes
                                .get(i + c.len())
                                .is_none_or(|b| *b == b'/' || is_after_path(*b))
                    })
                })
                .flatten();
            match hit {
                Some((c, h)) => {
                    out.push_str(h);
                    i += c.len();
                }
                None => {
                    let ch = text[i..].chars().next().unwrap_or_default();
                    out.push(ch);
                    i += ch.len_utf8().max(1);
                }
            }
        }
        out
    }
}

fn is_before_path(b: u8) -> bool {
    b.is_ascii_whitespace() || matches!(b, b'"' | b'\'' | b'=' | b':' | b'(' | b';' | b'`' | b',')
}

fn is_after_path(b: u8) -> bool {
    b.is_ascii_whitespace()
        || matches!(
            b,
            b'"' | b'\'' | b';' | b'&' | b'|' | b')' | b'`' | b',' | b':'
        )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn map() -> PathMap {
        PathMap::new([
            ("/share".to_owned(), PathBuf::from("/pods/p/volumes/share")),
            ("/agent".to_owned(), PathBuf::from("/images/pko/agent")),
            ("/tini".to_owned(), PathBuf::from("/images/pko/tini")),
        ])
    }

    #[test]
    fn paths_are_mapped_in_words_flags_and_scripts() {
        let m = map();
        assert_eq!(
            m.map("cp /agent /tini /share/"),
            "cp /images/pko/agent /images/pko/tini /pods/p/volumes/share/"
        );
        assert_eq!(
            m.map("--workspace=/share/workspace"),
            "--workspace=/pods/p/volumes/share/workspace"
        );
        assert_eq!(
            m.map("\n/share/agent init -t /share/source &&\nln -s \"/share/source/$FLUX_DIR\" /share/workspace\n"),
            "\n/pods/p/volumes/share/agent init -t /pods/p/volumes/share/source &&\nln -s \"/pods/p/volumes/share/source/$FLUX_DIR\" /pods/p/volumes/share/workspace\n"
        );
    }

    #[test]
    fn what_only_looks_like_a_path_stays() {
        let m = map();
        for text in [
            "http://127.0.0.1:8080/share/x",
            "/shared/x",
            "/agents",
            "file:///share",
            "/usr/share",
            "x/agent",
        ] {
            assert_eq!(m.map(text), text);
        }
    }

    #[test]
    fn images_have_their_files_and_the_agent_everywhere() {
        let dir = tempfile::tempdir().expect("tmp");
        let images = Images::new(
            vec![ImageFiles {
                image_contains: "ours".into(),
                files: vec![("/agent".into(), PathBuf::from("/x/ours"))],
            }],
            Path::new("/bin/pko-agent"),
            dir.path(),
        )
        .expect("images");
        let paths = |image: &str| -> Vec<String> {
            images.files_of(image).into_iter().map(|(p, _)| p).collect()
        };
        let pko = "pulumi/pulumi-kubernetes-operator:v2.9.0";
        assert_eq!(paths(pko), ["/agent", "/tini", AGENT_IN_IMAGE]);
        assert_eq!(
            paths("pulumi/pulumi:3-nonroot"),
            [AGENT_IN_IMAGE, "/agent", "/tini"]
        );
        let host = |image: &str, path: &str| {
            let files = images.files_of(image);
            files
                .iter()
                .find(|(p, _)| p == path)
                .map(|(_, h)| h.clone())
                .expect("file")
        };
        assert_ne!(host(pko, "/agent"), host("pko-rs-agent:latest", "/agent"));
        assert_eq!(
            images.files_of("ours:1")[0].1,
            PathBuf::from("/x/ours"),
            "an extra entry wins"
        );
        // Every /tini runs the agent by the name tini.
        for image in [pko, "pko-rs-agent:latest"] {
            let script = std::fs::read_to_string(host(image, "/tini")).expect("tini");
            assert!(script.contains(&dir.path().join("tini").display().to_string()));
        }
        assert_eq!(
            std::fs::read_link(dir.path().join("tini")).expect("link"),
            PathBuf::from("/bin/pko-agent")
        );
    }

    #[test]
    fn a_script_runs_its_binary_with_every_argument() {
        let dir = tempfile::tempdir().expect("tmp");
        let script = dir.path().join("agent");
        write_executable(&script, &exec_script(Path::new("/bin/echo"))).expect("script");
        let out = std::process::Command::new(&script)
            .args(["--", "serve", "x y"])
            .output()
            .expect("run");
        assert_eq!(String::from_utf8_lossy(&out.stdout), "-- serve x y\n");
    }
}
