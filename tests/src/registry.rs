//! A real OCI registry (distribution's `registry`, built by `tools/build.sh oci`) on loopback
//! with TLS, and the real `cosign` CLI signing what is pushed to it.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use crate::agent::free_port;
use crate::process::{ChildGuard, spawn_guarded};
use crate::{HarnessError, pki, tool_dir, wait_for};

/// How long the registry may take to answer `/v2/`.
const START_WAIT: Duration = Duration::from_secs(60);

/// A running registry; stopped on drop. Its storage outlives [`Registry::stop`], so
/// [`Registry::start_again`] serves the same content.
pub struct Registry {
    dir: PathBuf,
    port: u16,
    ca_file: PathBuf,
    guard: Option<ChildGuard>,
}

impl Registry {
    /// Starts a registry storing under `dir`, with a certificate for 127.0.0.1 signed by a
    /// CA written to `dir/ca.pem`.
    pub async fn start(dir: &Path) -> Result<Self, HarnessError> {
        Self::start_with(dir, None).await
    }

    /// A registry that answers only to `user` with `password` (basic auth, htpasswd).
    pub async fn start_private(
        dir: &Path,
        user: &str,
        password: &str,
    ) -> Result<Self, HarnessError> {
        Self::start_with(dir, Some((user, password))).await
    }

    async fn start_with(dir: &Path, login: Option<(&str, &str)>) -> Result<Self, HarnessError> {
        std::fs::create_dir_all(dir).map_err(|e| HarnessError::io("registry folder", e))?;
        let pki = pki::generate()?;
        let write = |name: &str, text: &str| -> Result<PathBuf, HarnessError> {
            let path = dir.join(name);
            std::fs::write(&path, text)
                .map_err(|e| HarnessError::io(format!("writing {}", path.display()), e))?;
            Ok(path)
        };
        let ca_file = write("ca.pem", &pki.ca_cert_pem)?;
        let cert = write("cert.pem", &pki.serving_cert_pem)?;
        let key = write("key.pem", &pki.serving_key_pem)?;
        let port = free_port()?;
        let auth = match login {
            Some((user, password)) => {
                let hash = bcrypt::hash(password, 4).map_err(|e| HarnessError::Missing {
                    what: format!("a bcrypt hash: {e}"),
                })?;
                let file = write("htpasswd", &format!("{user}:{hash}\n"))?;
                format!(
                    "auth:\n  htpasswd:\n    realm: pko-tests\n    path: {}\n",
                    file.display()
                )
            }
            None => String::new(),
        };
        write(
            "config.yml",
            &format!(
                "version: 0.1\nlog:\n  level: info\nstorage:\n  filesystem:\n    rootdirectory: {}\n  delete:\n    enabled: true\nhttp:\n  addr: 127.0.0.1:{port}\n  tls:\n    certificate: {}\n    key: {}\n{auth}",
                dir.join("data").display(),
                cert.display(),
                key.display()
            ),
        )?;
        let mut registry = Self {
            dir: dir.to_path_buf(),
            port,
            ca_file,
            guard: None,
        };
        registry.start_again().await?;
        Ok(registry)
    }

    /// Starts the registry again on the same port and storage after [`Registry::stop`].
    pub async fn start_again(&mut self) -> Result<(), HarnessError> {
        let bin = tool_dir("oci")?.join("registry");
        let mut cmd = Command::new(&bin);
        cmd.arg("serve").arg(self.dir.join("config.yml"));
        let guard = spawn_guarded(cmd, "registry", &self.dir.join("registry.log"))?;
        self.guard = Some(guard);
        let http = self.client()?;
        let url = format!("https://127.0.0.1:{}/v2/", self.port);
        wait_for("the registry answers /v2/", START_WAIT, || {
            let (http, url) = (http.clone(), url.clone());
            async move {
                let r = http.get(&url).send().await.ok()?;
                // A private registry answers 401 until asked with credentials.
                (r.status().is_success() || r.status() == 401).then_some(())
            }
        })
        .await
        .map_err(|e| match &self.guard {
            Some(g) => HarnessError::Missing {
                what: format!("a running registry ({e}); its log:\n{}", g.log_tail(30)),
            },
            None => e,
        })
    }

    /// Stops the registry (the storage stays).
    pub fn stop(&mut self) {
        if let Some(mut guard) = self.guard.take() {
            guard.kill();
        }
    }

    /// `127.0.0.1:<port>`.
    pub fn host(&self) -> String {
        format!("127.0.0.1:{}", self.port)
    }

    /// The CA that signed the registry's certificate (PEM file).
    pub fn ca_file(&self) -> &Path {
        &self.ca_file
    }

    /// An https client trusting the registry's CA.
    pub fn client(&self) -> Result<reqwest::Client, HarnessError> {
        let pem =
            std::fs::read(&self.ca_file).map_err(|e| HarnessError::io("reading the CA", e))?;
        let cert = reqwest::Certificate::from_pem(&pem).map_err(|e| HarnessError::Missing {
            what: format!("a usable registry CA: {e}"),
        })?;
        reqwest::Client::builder()
            .add_root_certificate(cert)
            .build()
            .map_err(|e| HarnessError::Missing {
                what: format!("an https client: {e}"),
            })
    }

    /// The registry's log, for failure messages.
    pub fn log_tail(&self) -> String {
        std::fs::read_to_string(self.dir.join("registry.log"))
            .map(|t| {
                let lines: Vec<&str> = t.lines().collect();
                lines[lines.len().saturating_sub(20)..].join("\n")
            })
            .unwrap_or_default()
    }
}

impl Drop for Registry {
    fn drop(&mut self) {
        self.stop();
    }
}

/// What `pko-operator plugin push` printed of what it pushed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Pushed {
    /// The manifest's digest (`sha256:…`), what a reference pins and cosign signs.
    pub manifest: String,
    /// The module's sha256, what a transform's status records once loaded.
    pub module: String,
}

impl Registry {
    /// `pko-operator plugin push` of `module` to `reference` (trusting this registry's CA),
    /// logged in when `login` is given (its password on stdin, as a user would).
    pub fn push_plugin(
        &self,
        module: &Path,
        reference: &str,
        login: Option<(&str, &str)>,
    ) -> Result<Pushed, HarnessError> {
        use std::io::Write;
        use std::process::Stdio;
        let mut cmd = Command::new(crate::operator::operator_binary()?);
        cmd.args(["plugin", "push", "--ca-file"])
            .arg(&self.ca_file)
            .arg(module)
            .arg(reference)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        if let Some((user, _)) = login {
            cmd.args(["--username", user]);
        }
        let mut child = cmd
            .spawn()
            .map_err(|e| HarnessError::io("running plugin push", e))?;
        // Taken either way: stdin is closed once this block ends.
        if let Some(mut stdin) = child.stdin.take()
            && let Some((_, password)) = login
        {
            writeln!(stdin, "{password}")
                .map_err(|e| HarnessError::io("the password on plugin push's stdin", e))?;
        }
        let out = child
            .wait_with_output()
            .map_err(|e| HarnessError::io("plugin push's output", e))?;
        let text = String::from_utf8_lossy(&out.stdout);
        let failed = || HarnessError::Missing {
            what: format!(
                "a successful plugin push ({}): {text}{}",
                out.status,
                String::from_utf8_lossy(&out.stderr)
            ),
        };
        if !out.status.success() {
            return Err(failed());
        }
        let field = |label: &str| {
            text.lines()
                .find_map(|l| l.strip_prefix(label))
                .map(|v| v.trim().to_owned())
                .ok_or_else(failed)
        };
        Ok(Pushed {
            manifest: field("manifest digest:")?,
            module: field("module sha256:")?,
        })
    }
}

/// The `cosign` CLI with a key pair of its own, trusting one registry's CA.
pub struct Cosign {
    bin: PathBuf,
    dir: PathBuf,
    ca_file: PathBuf,
}

/// The password of the test keys (cosign encrypts private keys).
const PASSWORD: &str = "pko-tests";

impl Cosign {
    /// Generates a key pair in `dir` (`cosign.key`, `cosign.pub`).
    pub fn generate(dir: &Path, ca_file: &Path) -> Result<Self, HarnessError> {
        std::fs::create_dir_all(dir.join("home"))
            .map_err(|e| HarnessError::io("cosign folder", e))?;
        let cosign = Self {
            bin: tool_dir("oci")?.join("cosign"),
            dir: dir.to_path_buf(),
            ca_file: ca_file.to_path_buf(),
        };
        cosign.run(&["generate-key-pair"])?;
        Ok(cosign)
    }

    /// The PEM public key.
    pub fn public_key(&self) -> Result<String, HarnessError> {
        std::fs::read_to_string(self.dir.join("cosign.pub"))
            .map_err(|e| HarnessError::io("reading cosign.pub", e))
    }

    /// Signs `name@digest` with the private key, offline (no transparency log).
    pub fn sign(&self, name: &str, digest: &str) -> Result<(), HarnessError> {
        let key = self.dir.join("cosign.key");
        let target = format!("{name}@{digest}");
        self.run(&[
            "sign",
            "--key",
            &key.to_string_lossy(),
            "--tlog-upload=false",
            "--yes",
            &target,
        ])
    }

    fn run(&self, args: &[&str]) -> Result<(), HarnessError> {
        let out = Command::new(&self.bin)
            .args(args)
            .current_dir(&self.dir)
            .env("COSIGN_PASSWORD", PASSWORD)
            .env("SSL_CERT_FILE", &self.ca_file)
            .env("HOME", self.dir.join("home"))
            .env("TUF_ROOT", self.dir.join("home/tuf"))
            .output()
            .map_err(|e| HarnessError::io(format!("running {}", self.bin.display()), e))?;
        if !out.status.success() {
            return Err(HarnessError::Missing {
                what: format!(
                    "a successful `cosign {}` ({}): {}{}",
                    args.join(" "),
                    out.status,
                    String::from_utf8_lossy(&out.stdout),
                    String::from_utf8_lossy(&out.stderr)
                ),
            });
        }
        Ok(())
    }
}
