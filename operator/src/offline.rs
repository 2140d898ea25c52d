//! Offline commands for plugin authors and platform teams:
//!
//! - `render`: runs a Program manifest through the transforms that would select it (the same
//!   selection, order, limits and artifact code as the operator) and prints the resulting
//!   `Pulumi.yaml`, or a unified diff against the untransformed one.
//! - `plugin test DIR`: runs a component against fixture cases (see
//!   [`pko_plugin_host::conformance`]): the conformance kit, for plugins written in any language.

use std::collections::HashMap;
use std::io::Read;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use k8s_openapi::api::core::v1::{ConfigMap, Namespace};
use pko_api::program::Program;
use pko_api::transform::{ClusterProgramTransform, ProgramTransform};
use pko_plugin_host::chain::Chain;
use pko_plugin_host::{CallSite, HostConfig, PluginHost, PluginMetrics, conformance};
use serde::Deserialize;
use serde_json::Value;
use sha2::{Digest, Sha256};

use crate::artifact::PROJECT_FILE;
use crate::artifact::index::{Built, build_program};
use crate::artifact::stored::StoredProgram;
use crate::transform::{ModuleFetcher, TransformRegistry};

/// Failures of the offline commands.
#[derive(Debug, thiserror::Error)]
pub enum CliError {
    #[error("cannot read {}: {source}", path.display())]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{}: {message}", path.display())]
    Manifest { path: PathBuf, message: String },
    #[error("{0}")]
    Input(String),
    #[error("cannot start the plugin host: {0}")]
    Host(#[source] pko_plugin_host::PluginError),
    #[error("cannot load {}: {source}", path.display())]
    Module {
        path: PathBuf,
        source: pko_plugin_host::PluginError,
    },
    #[error("transform failed: {0}")]
    Build(#[from] crate::artifact::index::BuildError),
    #[error(transparent)]
    Conformance(#[from] conformance::ConformanceError),
    #[error("cannot read the built artifact: {0}")]
    Artifact(std::io::Error),
}

/// `render` arguments.
#[derive(clap::Args, Debug, Clone)]
pub struct RenderArgs {
    /// Manifest files (YAML, several documents each; `-` for stdin) holding the Program and
    /// the ProgramTransforms, ClusterProgramTransforms, ConfigMaps and Namespaces to use.
    #[arg(short = 'f', long = "filename", required = true)]
    pub files: Vec<PathBuf>,
    /// The Program to render when the manifests hold several.
    #[arg(long)]
    pub program: Option<String>,
    /// Namespace of a Program whose manifest names none.
    #[arg(long, default_value = "default")]
    pub namespace: String,
    /// Folder of `.wasm` modules, matched to transforms by sha256 whatever their source says.
    #[arg(long)]
    pub module_dir: Option<PathBuf>,
    /// Folder `file:///` module URLs may point into.
    #[arg(long)]
    pub plugin_file_root: Option<PathBuf>,
    /// Print a unified diff against the untransformed Pulumi.yaml instead of the result.
    #[arg(long)]
    pub diff: bool,
    /// Folder of precompiled modules, reused across runs.
    #[arg(long, env = "PLUGIN_CACHE_DIR")]
    pub plugin_cache_dir: Option<PathBuf>,
}

/// `plugin test` arguments.
#[derive(clap::Args, Debug, Clone)]
pub struct PluginTestArgs {
    /// Folder of fixture cases (`*.yaml`, `*.yml`, `*.json`).
    pub dir: PathBuf,
    /// The component to test (default: the only `.wasm` file in DIR).
    #[arg(long)]
    pub module: Option<PathBuf>,
    /// Folder of precompiled modules, reused across runs.
    #[arg(long, env = "PLUGIN_CACHE_DIR")]
    pub plugin_cache_dir: Option<PathBuf>,
}

/// What `render` produced: the text to print and notes for stderr.
#[derive(Debug, Clone)]
pub struct Rendered {
    pub output: String,
    pub notes: Vec<String>,
}

/// The `render` command.
pub async fn render(args: &RenderArgs) -> Result<Rendered, CliError> {
    let mut objects = Objects::default();
    for path in &args.files {
        objects.read(path)?;
    }
    let mut program = pick_program(&objects.programs, args.program.as_deref())?;
    if program.metadata.namespace.is_none() {
        program.metadata.namespace = Some(args.namespace.clone());
    }
    // Offline objects have no generation or uid; the chain does not depend on them.
    program.metadata.generation.get_or_insert(1);
    program.metadata.uid.get_or_insert_with(|| "offline".into());
    for t in &mut objects.transforms {
        if t.metadata.namespace.is_none() {
            t.metadata.namespace = Some(args.namespace.clone());
        }
    }
    for cm in &mut objects.config_maps {
        if cm.metadata.namespace.is_none() {
            cm.metadata.namespace = Some(args.namespace.clone());
        }
    }
    let modules = match &args.module_dir {
        Some(dir) => modules_by_digest(dir)?,
        None => HashMap::new(),
    };
    let host = host(args.plugin_cache_dir.clone())?;
    let fetcher = ModuleFetcher::offline(
        args.plugin_file_root.clone(),
        host.config().max_module_bytes,
        objects.config_maps,
        modules,
    );
    let registry = TransformRegistry::new(host.clone(), fetcher);
    registry.load_offline(&objects.transforms, &objects.clusters, &objects.namespaces);
    let stored =
        StoredProgram::from_program(&program).map_err(|e| CliError::Input(e.to_string()))?;
    let chain = registry
        .chain_for(&stored)
        .await
        .map_err(|e| CliError::Input(e.to_string()))?;

    let transformed = build_program(
        &program.metadata,
        program.program.clone(),
        &chain,
        Some(&host),
    )
    .await?;
    let mut notes = notes(&chain, &transformed);
    let yaml = project_file(&transformed)?;
    let output = if args.diff {
        let plain = build_program(
            &program.metadata,
            program.program.clone(),
            &Chain::default(),
            None,
        )
        .await?;
        let before = project_file(&plain)?;
        let diff = similar::TextDiff::from_lines(&before, &yaml);
        let text = diff
            .unified_diff()
            .context_radius(3)
            .header(
                &format!("{PROJECT_FILE} (untransformed)"),
                &format!("{PROJECT_FILE} (transformed)"),
            )
            .to_string();
        if text.is_empty() {
            notes.push("the transforms change nothing".into());
        }
        text
    } else {
        yaml
    };
    Ok(Rendered { output, notes })
}

fn host(cache_dir: Option<PathBuf>) -> Result<PluginHost, CliError> {
    let config = HostConfig {
        cache_dir,
        ..HostConfig::default()
    };
    PluginHost::new(config, PluginMetrics::new()).map_err(CliError::Host)
}

fn notes(chain: &Chain, built: &Built) -> Vec<String> {
    let mut notes = Vec::new();
    if chain.is_empty() {
        notes.push("no transform selects this Program".into());
    }
    for applied in &built.chain.applied {
        notes.push(format!(
            "applied {} ({} {}, fuel {})",
            applied.id, applied.plugin, applied.module, applied.fuel
        ));
        for warning in &applied.warnings {
            notes.push(format!("warning from {}: {warning}", applied.id));
        }
    }
    for skipped in &built.chain.skipped {
        notes.push(format!(
            "skipped {} (failurePolicy Ignore): {}",
            skipped.id, skipped.error
        ));
    }
    notes.push(format!("artifact digest {}", built.artifact.digest));
    notes
}

/// The `Pulumi.yaml` inside a built artifact: what a workspace would get.
fn project_file(built: &Built) -> Result<String, CliError> {
    let gz = flate2::read::GzDecoder::new(&built.artifact.bytes[..]);
    let mut archive = tar::Archive::new(gz);
    for entry in archive.entries().map_err(CliError::Artifact)? {
        let mut entry = entry.map_err(CliError::Artifact)?;
        let is_project = entry
            .path()
            .map(|p| p.as_os_str() == PROJECT_FILE)
            .unwrap_or(false);
        if is_project {
            let mut text = String::new();
            entry
                .read_to_string(&mut text)
                .map_err(CliError::Artifact)?;
            return Ok(text);
        }
    }
    Err(CliError::Artifact(std::io::Error::other(
        "the artifact holds no Pulumi.yaml",
    )))
}

/// The objects found in the manifests.
#[derive(Default)]
struct Objects {
    programs: Vec<Program>,
    transforms: Vec<ProgramTransform>,
    clusters: Vec<ClusterProgramTransform>,
    config_maps: Vec<ConfigMap>,
    namespaces: Vec<Namespace>,
}

impl Objects {
    fn read(&mut self, path: &Path) -> Result<(), CliError> {
        let text = if path.as_os_str() == "-" {
            let mut text = String::new();
            std::io::stdin()
                .read_to_string(&mut text)
                .map_err(|source| CliError::Read {
                    path: path.to_path_buf(),
                    source,
                })?;
            text
        } else {
            std::fs::read_to_string(path).map_err(|source| CliError::Read {
                path: path.to_path_buf(),
                source,
            })?
        };
        let bad = |message: String| CliError::Manifest {
            path: path.to_path_buf(),
            message,
        };
        for (index, document) in yaml_serde::Deserializer::from_str(&text).enumerate() {
            let value =
                Value::deserialize(document).map_err(|e| bad(format!("document {index}: {e}")))?;
            if value.is_null() {
                continue;
            }
            let field = |k: &str| {
                value
                    .get(k)
                    .and_then(Value::as_str)
                    .unwrap_or_default()
                    .to_owned()
            };
            let (api, kind) = (field("apiVersion"), field("kind"));
            let parse_err = |e: serde_json::Error| bad(format!("document {index} ({kind}): {e}"));
            match (api.as_str(), kind.as_str()) {
                ("pulumi.com/v1", "Program") => self
                    .programs
                    .push(serde_json::from_value(value).map_err(parse_err)?),
                ("pko-rs.dev/v1alpha1", "ProgramTransform") => self
                    .transforms
                    .push(serde_json::from_value(value).map_err(parse_err)?),
                ("pko-rs.dev/v1alpha1", "ClusterProgramTransform") => self
                    .clusters
                    .push(serde_json::from_value(value).map_err(parse_err)?),
                ("v1", "ConfigMap") => self
                    .config_maps
                    .push(serde_json::from_value(value).map_err(parse_err)?),
                ("v1", "Namespace") => self
                    .namespaces
                    .push(serde_json::from_value(value).map_err(parse_err)?),
                // Other objects (Stacks, Secrets, …) often share the file: not ours to use.
                _ => {}
            }
        }
        Ok(())
    }
}

fn pick_program(programs: &[Program], name: Option<&str>) -> Result<Program, CliError> {
    let names = || {
        programs
            .iter()
            .filter_map(|p| p.metadata.name.clone())
            .collect::<Vec<_>>()
            .join(", ")
    };
    match name {
        Some(name) => programs
            .iter()
            .find(|p| p.metadata.name.as_deref() == Some(name))
            .cloned()
            .ok_or_else(|| {
                CliError::Input(format!("no Program named {name:?} (found: {})", names()))
            }),
        None => match programs {
            [one] => Ok(one.clone()),
            [] => Err(CliError::Input("the manifests hold no Program".into())),
            _ => Err(CliError::Input(format!(
                "the manifests hold several Programs ({}): choose one with --program",
                names()
            ))),
        },
    }
}

/// `sha256:<hex>` → path of every `.wasm` file in `dir`.
fn modules_by_digest(dir: &Path) -> Result<HashMap<String, PathBuf>, CliError> {
    let read = |source| CliError::Read {
        path: dir.to_path_buf(),
        source,
    };
    let mut out = HashMap::new();
    for entry in std::fs::read_dir(dir).map_err(read)? {
        let path = entry.map_err(read)?.path();
        if path.extension().and_then(|e| e.to_str()) != Some("wasm") {
            continue;
        }
        let bytes = std::fs::read(&path).map_err(|source| CliError::Read {
            path: path.clone(),
            source,
        })?;
        out.insert(
            format!("sha256:{}", hex::encode(Sha256::digest(&bytes))),
            path,
        );
    }
    Ok(out)
}

/// The `plugin test` command: one result per case.
pub async fn plugin_test(args: &PluginTestArgs) -> Result<Vec<conformance::CaseResult>, CliError> {
    let module_path = match &args.module {
        Some(path) => path.clone(),
        None => {
            let found: Vec<PathBuf> = modules_by_digest(&args.dir)?.into_values().collect();
            match found.as_slice() {
                [one] => one.clone(),
                [] => {
                    return Err(CliError::Input(format!(
                        "no .wasm file in {}: pass --module",
                        args.dir.display()
                    )));
                }
                _ => {
                    return Err(CliError::Input(format!(
                        "several .wasm files in {}: pass --module",
                        args.dir.display()
                    )));
                }
            }
        }
    };
    let bytes = std::fs::read(&module_path).map_err(|source| CliError::Read {
        path: module_path.clone(),
        source,
    })?;
    let digest = hex::encode(Sha256::digest(&bytes));
    let host = host(args.plugin_cache_dir.clone())?;
    let module = host
        .load(bytes, &digest, &CallSite::new("plugin-test"))
        .await
        .map_err(|source| CliError::Module {
            path: module_path.clone(),
            source,
        })?;
    let module: Arc<pko_plugin_host::Module> = module;
    Ok(conformance::run_dir(&host, &module, &args.dir).await?)
}
