//! PKO-compatible CRD types.
//!
//! The four kinds of the Pulumi Kubernetes Operator v2.9 (`Program`, `Stack` in `pulumi.com`;
//! `Workspace`, `Update` in `auto.pulumi.com`) with the same wire format and (at least) the same
//! OpenAPI schema as PKO's CRDs, so existing PKO objects and manifests keep working unchanged.
//!
//! The root types are written with [`custom_resource!`](crate::common) rather than
//! `#[derive(CustomResource)]` because the generated CRDs need things the derive cannot express:
//! the `program` top-level key of `Program`, and the list/map markers and defaults that
//! Kubernetes' own types carry in PKO's CRDs (see [`schema`]). They implement the same traits as
//! derived kinds (`kube::Resource`, `HasSpec`, `HasStatus`, `CustomResourceExt`), so they work
//! with `kube::Api`, controllers and reflectors as usual.

pub mod common;
mod crd;
pub mod crdgen;
pub mod decode;
pub mod duration;
pub mod names;
pub mod program;
pub mod schema;
pub mod stack;
pub mod tenancy;
pub mod text;
pub mod transform;
pub mod update;
pub mod workspace;

#[cfg(test)]
#[allow(
    clippy::too_many_lines,
    unreachable_pub,
    reason = "test code: fixtures shared between test modules, scenarios read top to bottom"
)]
mod tests;

pub use common::Condition;
pub use program::Program;
pub use stack::Stack;
pub use tenancy::TenancyPolicy;
pub use transform::{ClusterProgramTransform, ProgramTransform};
pub use update::Update;
pub use workspace::Workspace;

use std::path::PathBuf;

/// Errors of this crate: schema generation, CRD assembly and rendering.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The schema generated for a Rust type could not be turned into a CRD schema.
    #[error("invalid schema generated for {type_name}: {reason}")]
    Schema {
        /// Rust/OpenAPI type whose schema failed.
        type_name: String,
        /// What went wrong.
        reason: String,
    },
    /// The generated schema did not deserialize into `JSONSchemaProps`.
    #[error("generated schema for {type_name} is not a valid JSONSchemaProps: {source}")]
    SchemaJson {
        /// Rust type whose schema failed.
        type_name: String,
        /// Underlying decode error.
        source: serde_json::Error,
    },
    /// Versions of one kind could not be merged into a single CRD.
    #[error("cannot merge CRD versions: {0}")]
    MergeCrds(#[from] kube::core::crd::MergeError),
    /// A CRD could not be rendered as YAML.
    #[error("cannot render {file} as YAML: {source}")]
    Yaml {
        /// Output file name.
        file: String,
        /// Underlying encode error.
        source: yaml_serde::Error,
    },
    /// A rendered CRD could not be written.
    #[error("cannot write {}: {source}", path.display())]
    Io {
        /// Path being written.
        path: PathBuf,
        /// Underlying I/O error.
        source: std::io::Error,
    },
}
