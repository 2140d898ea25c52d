//! A real git server over SSH on loopback for git-source tests: Debian's OpenSSH `sshd` (its
//! own config, host key and authorized keys in a temporary folder, nothing of the machine's)
//! serves the bare repository of a [`GitRepo`] to the user running the tests, who logs in with
//! one of two client keys made here by `ssh-keygen`: an ed25519 key without a passphrase and an
//! RSA key with one. `make test-deps` installs `openssh-server` and `git` when missing.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use crate::gitrepo::GitRepo;
use crate::{ChildGuard, HarnessError, spawn_guarded, wait_for};

/// The passphrase of [`SshGit::encrypted_key`].
pub const PASSPHRASE: &str = "correct horse battery staple";

pub struct SshGit {
    pub port: u16,
    pub user: String,
    dir: PathBuf,
    _sshd: ChildGuard,
}

fn run(program: &str, args: &[&str]) -> Result<String, HarnessError> {
    let out = Command::new(program).args(args).output().map_err(|e| {
        HarnessError::io(format!("running {program} (make test-deps installs it)"), e)
    })?;
    if !out.status.success() {
        return Err(HarnessError::io(
            format!("{program} {}", args.join(" ")),
            std::io::Error::other(String::from_utf8_lossy(&out.stderr).into_owned()),
        ));
    }
    Ok(String::from_utf8_lossy(&out.stdout).trim().to_owned())
}

fn keygen(file: &Path, kind: &str, passphrase: &str) -> Result<(), HarnessError> {
    let file = file.display().to_string();
    let mut args = vec![
        "-q",
        "-t",
        kind,
        "-N",
        passphrase,
        "-C",
        "pko-tests",
        "-f",
        &file,
    ];
    if kind == "rsa" {
        args.extend(["-b", "2048"]);
    }
    run("ssh-keygen", &args).map(|_| ())
}

fn read(path: &Path) -> Result<String, HarnessError> {
    std::fs::read_to_string(path)
        .map_err(|e| HarnessError::io(format!("reading {}", path.display()), e))
}

impl SshGit {
    /// sshd on a free loopback port, under `dir`, ready for connections.
    pub async fn start(dir: &Path) -> Result<Self, HarnessError> {
        std::fs::create_dir_all(dir)
            .map_err(|e| HarnessError::io(format!("creating {}", dir.display()), e))?;
        let sshd = ["/usr/sbin/sshd", "/usr/bin/sshd"]
            .into_iter()
            .find(|p| Path::new(p).exists())
            .ok_or(HarnessError::Missing {
                what: "sshd (openssh-server; make test-deps installs it)".into(),
            })?;
        // sshd's privilege separation folder (Debian's packages create it at boot only).
        let _ = std::fs::create_dir_all("/run/sshd");
        for (name, kind, pass) in [
            ("host_key", "ed25519", ""),
            ("other_host_key", "ed25519", ""),
            ("client_key", "ed25519", ""),
            ("client_key_encrypted", "rsa", PASSPHRASE),
        ] {
            keygen(&dir.join(name), kind, pass)?;
        }
        let authorized = format!(
            "{}\n{}\n",
            read(&dir.join("client_key.pub"))?,
            read(&dir.join("client_key_encrypted.pub"))?
        );
        std::fs::write(dir.join("authorized_keys"), authorized)
            .map_err(|e| HarnessError::io("writing authorized_keys", e))?;
        let user = run("id", &["-un"])?;
        let port = {
            let l = std::net::TcpListener::bind("127.0.0.1:0")
                .map_err(|e| HarnessError::io("picking a port for sshd", e))?;
            l.local_addr()
                .map_err(|e| HarnessError::io("picking a port for sshd", e))?
                .port()
        };
        let config = format!(
            "Port {port}\nListenAddress 127.0.0.1\nHostKey {d}/host_key\nPidFile {d}/sshd.pid\n\
             AuthorizedKeysFile {d}/authorized_keys\nStrictModes no\nUsePAM no\n\
             PasswordAuthentication no\nKbdInteractiveAuthentication no\nPubkeyAuthentication yes\n\
             PermitRootLogin prohibit-password\nAllowUsers {user}\nLogLevel VERBOSE\n",
            d = dir.display()
        );
        let config_path = dir.join("sshd_config");
        std::fs::write(&config_path, config)
            .map_err(|e| HarnessError::io("writing sshd_config", e))?;
        let mut cmd = Command::new(sshd);
        cmd.arg("-D").arg("-e").arg("-f").arg(&config_path);
        let guard = spawn_guarded(cmd, "sshd", &dir.join("sshd.log"))?;
        wait_for("sshd to listen", Duration::from_secs(30), || async move {
            tokio::net::TcpStream::connect(("127.0.0.1", port))
                .await
                .ok()
                .map(|_| ())
        })
        .await?;
        Ok(Self {
            port,
            user,
            dir: dir.to_path_buf(),
            _sshd: guard,
        })
    }

    /// The `ssh://` URL of `repo` on this server.
    pub fn url(&self, repo: &GitRepo) -> String {
        format!(
            "ssh://{}@127.0.0.1:{}{}",
            self.user,
            self.port,
            repo.bare().display()
        )
    }

    /// known_hosts lines that trust this server's host key.
    pub fn known_hosts(&self) -> Result<String, HarnessError> {
        self.known_hosts_of("host_key.pub")
    }

    /// known_hosts lines that name this server with another key (a server that changed its
    /// key, or an impostor).
    pub fn wrong_known_hosts(&self) -> Result<String, HarnessError> {
        self.known_hosts_of("other_host_key.pub")
    }

    fn known_hosts_of(&self, file: &str) -> Result<String, HarnessError> {
        let public = read(&self.dir.join(file))?;
        let mut fields = public.split_whitespace();
        let (kind, key) = (
            fields.next().unwrap_or_default(),
            fields.next().unwrap_or_default(),
        );
        Ok(format!("[127.0.0.1]:{} {kind} {key}\n", self.port))
    }

    /// The ed25519 client key (OpenSSH format, no passphrase).
    pub fn key(&self) -> Result<String, HarnessError> {
        read(&self.dir.join("client_key"))
    }

    /// The RSA client key, encrypted with [`PASSPHRASE`].
    pub fn encrypted_key(&self) -> Result<String, HarnessError> {
        read(&self.dir.join("client_key_encrypted"))
    }

    /// What sshd logged.
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.join("sshd.log")).unwrap_or_default()
    }
}
