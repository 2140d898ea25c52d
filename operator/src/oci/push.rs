//! `pko-operator plugin push`: publishes a module as an OCI Wasm artifact and prints what a
//! transform pins (the manifest digest and the module's sha256).

use std::path::PathBuf;

use super::registry::{Credentials, Pushed, Session};
use super::{OciError, Reference};

/// Arguments of `plugin push`.
#[derive(clap::Args, Debug)]
pub struct PushArgs {
    /// The component (`.wasm`) to publish.
    pub module: PathBuf,
    /// Where: `host[:port]/repository[:tag]` (without a tag, only the digest names it).
    pub reference: String,
    /// Extra PEM CA certificates to trust for the registry (the OS's roots always are).
    #[arg(long)]
    pub ca_file: Option<PathBuf>,
    /// User name for a registry that wants credentials; the password is read from stdin.
    #[arg(long)]
    pub username: Option<String>,
}

/// Failures of `plugin push`.
#[derive(Debug, thiserror::Error)]
pub enum PushError {
    #[error("cannot read {}: {source}", path.display())]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{} holds no usable PEM certificate: {source}", path.display())]
    Ca {
        path: PathBuf,
        source: reqwest::Error,
    },
    #[error("cannot build the https client: {0}")]
    Http(#[source] reqwest::Error),
    #[error(transparent)]
    Oci(#[from] OciError),
}

/// Pushes `args.module` and returns the digests written.
pub async fn push(args: &PushArgs) -> Result<(Reference, Pushed), PushError> {
    let reference = Reference::parse(&args.reference)?;
    let module = tokio::fs::read(&args.module)
        .await
        .map_err(|source| PushError::Read {
            path: args.module.clone(),
            source,
        })?;
    let mut builder = reqwest::Client::builder().https_only(true);
    if let Some(path) = &args.ca_file {
        let pem = tokio::fs::read(path)
            .await
            .map_err(|source| PushError::Read {
                path: path.clone(),
                source,
            })?;
        let certs =
            reqwest::Certificate::from_pem_bundle(&pem).map_err(|source| PushError::Ca {
                path: path.clone(),
                source,
            })?;
        for cert in certs {
            builder = builder.add_root_certificate(cert);
        }
    }
    let http = builder.build().map_err(PushError::Http)?;
    let credentials = match &args.username {
        Some(username) => {
            // One line on stdin, as `docker login --password-stdin` reads it.
            let mut password = String::new();
            std::io::stdin()
                .read_line(&mut password)
                .map_err(|source| PushError::Read {
                    path: PathBuf::from("<stdin>"),
                    source,
                })?;
            Some(Credentials {
                username: username.clone(),
                password: password.trim_end_matches(['\r', '\n']).to_owned(),
            })
        }
        None => None,
    };
    let pushed = Session::new(&http, None, &reference)
        .with_credentials(credentials)
        .push(&module)
        .await?;
    Ok((reference, pushed))
}

/// What to paste into a transform, and how to sign it.
pub fn summary(reference: &Reference, pushed: &Pushed) -> String {
    let name = reference.name();
    format!(
        "pushed {reference}\n\
         manifest digest: {manifest}\n\
         module sha256:   {module}\n\
         \n\
         # in a ProgramTransform:\n\
         spec:\n  source:\n    oci:\n      reference: {name}\n      digest: {manifest}\n  sha256: {module}\n\
         \n\
         # sign it (offline, with a key from `cosign generate-key-pair`):\n\
         cosign sign --key cosign.key --tlog-upload=false {name}@{manifest}\n",
        manifest = pushed.manifest_digest,
        module = pushed.module_digest,
    )
}
