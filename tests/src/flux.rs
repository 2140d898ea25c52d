//! Flux's source kinds on the test plane, which has no Flux.
//!
//! Minimal CRDs, written here rather than Flux's own: the operator reads only a source's kind,
//! version, name and `status.artifact` (`url`, `digest`, `revision`), and Flux's CRD YAML is
//! generated in source-controller's main module (`config/crd`), not in the `api` module the Go
//! module proxy serves (Go types only). The schemas keep every field, so objects look as Flux
//! writes them. `OCIRepository` is served at `v1beta2` (Flux before 2.6) and `v1` (preferred),
//! as Flux serves it, so a Stack may name either version.
//!
//! [`FluxSource`] plays source-controller's artifact server: each revision a tar.gz served over
//! HTTP, which is all a `fluxSource` Stack fetches (PKO's agent and pko-rs's alike).

use std::collections::HashMap;
use std::time::Duration;

use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::api::{Api, ApiResource, DynamicObject, Patch, PatchParams, PostParams};
use serde_json::{Value, json};

use crate::agent::StaticServer;
use crate::{HarnessError, wait_for};

/// Flux's source group.
pub const GROUP: &str = "source.toolkit.fluxcd.io";
/// The `GitRepository` version Stacks here name.
pub const API_VERSION: &str = "source.toolkit.fluxcd.io/v1";

/// A Flux source kind: `(kind, plural, served versions, the stored one)`.
type Kind = (
    &'static str,
    &'static str,
    &'static [&'static str],
    &'static str,
);

const KINDS: [Kind; 2] = [
    ("GitRepository", "gitrepositories", &["v1"], "v1"),
    ("OCIRepository", "ocirepositories", &["v1beta2", "v1"], "v1"),
];

fn crd(&(kind, plural, versions, stored): &Kind) -> Result<CustomResourceDefinition, HarnessError> {
    let versions: Vec<Value> = versions
        .iter()
        .map(|v| {
            json!({
                "name": v, "served": true, "storage": *v == stored,
                "subresources": {"status": {}},
                "schema": {"openAPIV3Schema": {"type": "object", "x-kubernetes-preserve-unknown-fields": true}},
            })
        })
        .collect();
    serde_json::from_value(json!({
        "apiVersion": "apiextensions.k8s.io/v1", "kind": "CustomResourceDefinition",
        "metadata": {"name": format!("{plural}.{GROUP}")},
        "spec": {
            "group": GROUP,
            "names": {"kind": kind, "plural": plural, "singular": kind.to_lowercase(), "listKind": format!("{kind}List")},
            "scope": "Namespaced",
            "versions": versions,
        },
    }))
    .map_err(|e| HarnessError::Missing {
        what: format!("the {kind} CRD: {e}"),
    })
}

/// Installs the `GitRepository` and `OCIRepository` CRDs (idempotent: every test applies the
/// same) and waits until they are established.
pub async fn install_crds(client: kube::Client, wait: Duration) -> Result<(), HarnessError> {
    let crds: Api<CustomResourceDefinition> = Api::all(client);
    for kind in &KINDS {
        let crd = crd(kind)?;
        let name = crd.metadata.name.clone().unwrap_or_default();
        crds.patch(
            &name,
            &PatchParams::apply("pko-tests").force(),
            &Patch::Apply(&crd),
        )
        .await
        .map_err(|e| HarnessError::kube(format!("applying CRD {name}"), e))?;
        wait_for(&format!("CRD {name} to be established"), wait, || async {
            let crd = crds.get(&name).await.ok()?;
            crd.status?
                .conditions?
                .iter()
                .any(|c| c.type_ == "Established" && c.status == "True")
                .then_some(())
        })
        .await?;
    }
    Ok(())
}

/// Flux sources of one kind, at one version, in one namespace.
pub struct Sources {
    pub api: Api<DynamicObject>,
    kind: String,
    api_version: String,
}

impl Sources {
    /// The sources of `kind` at `version` in `namespace`.
    pub fn new(client: kube::Client, namespace: &str, kind: &str, version: &str) -> Self {
        let plural = KINDS
            .iter()
            .find(|k| k.0 == kind)
            .map_or_else(|| format!("{}s", kind.to_lowercase()), |k| k.1.to_owned());
        let api_version = format!("{GROUP}/{version}");
        let resource = ApiResource {
            group: GROUP.into(),
            version: version.into(),
            api_version: api_version.clone(),
            kind: kind.into(),
            plural,
        };
        Self {
            api: Api::namespaced_with(client, namespace, &resource),
            kind: kind.into(),
            api_version,
        }
    }

    /// Creates source `name` (a spec as Flux's would be), then gives it the artifact `(url,
    /// digest, revision)`, as Flux's source-controller writes it.
    pub async fn create(
        &self,
        name: &str,
        artifact: (&str, &str, &str),
    ) -> Result<(), HarnessError> {
        let kind = &self.kind;
        let object: DynamicObject = serde_json::from_value(json!({
            "apiVersion": self.api_version, "kind": kind,
            "metadata": {"name": name}, "spec": {"url": "https://example.invalid/repo", "interval": "1m"},
        }))
        .map_err(|e| HarnessError::Missing {
            what: format!("a {kind}: {e}"),
        })?;
        self.api
            .create(&PostParams::default(), &object)
            .await
            .map_err(|e| HarnessError::kube(format!("creating {kind} {name}"), e))?;
        self.set_artifact(name, artifact).await
    }

    /// Writes the artifact `(url, digest, revision)` into source `name`'s status, with the
    /// Ready condition Flux writes beside it.
    pub async fn set_artifact(
        &self,
        name: &str,
        (url, digest, revision): (&str, &str, &str),
    ) -> Result<(), HarnessError> {
        let status = json!({"status": {
            "artifact": {"url": url, "digest": digest, "revision": revision,
                "path": format!("{name}/{revision}.tar.gz"), "lastUpdateTime": "2026-01-01T00:00:00Z"},
            "conditions": [{"type": "Ready", "status": "True", "reason": "Succeeded",
                "message": format!("stored artifact for revision '{revision}'"),
                "lastTransitionTime": "2026-01-01T00:00:00Z"}],
        }});
        self.api
            .patch_status(name, &PatchParams::default(), &Patch::Merge(&status))
            .await
            .map_err(|e| HarnessError::kube(format!("the artifact of {name}"), e))?;
        Ok(())
    }
}

/// Creates `GitRepository` `name` in `namespace` with `artifact` in its status, or gives the
/// existing one that artifact.
pub async fn set_git_repository(
    client: kube::Client,
    namespace: &str,
    name: &str,
    artifact: &Artifact,
) -> Result<(), HarnessError> {
    let git = Sources::new(client, namespace, "GitRepository", "v1");
    let fields = (
        artifact.url.as_str(),
        artifact.digest.as_str(),
        artifact.revision.as_str(),
    );
    let exists = git
        .api
        .get_opt(name)
        .await
        .map_err(|e| HarnessError::kube(format!("reading GitRepository {name}"), e))?
        .is_some();
    if exists {
        git.set_artifact(name, fields).await
    } else {
        git.create(name, fields).await
    }
}

/// A `.tar.gz` of `files` (path → content) at its root, as source-controller packs a revision.
pub fn tarball(files: &[(&str, &str)]) -> Result<Vec<u8>, HarnessError> {
    let io = |e| HarnessError::io("packing a Flux artifact", e);
    let mut tar = tar::Builder::new(flate2::write::GzEncoder::new(
        Vec::new(),
        flate2::Compression::default(),
    ));
    for (path, content) in files {
        let mut header = tar::Header::new_gnu();
        header.set_size(content.len() as u64);
        header.set_mode(0o644);
        header.set_cksum();
        tar.append_data(&mut header, path, content.as_bytes())
            .map_err(io)?;
    }
    tar.into_inner().map_err(io)?.finish().map_err(io)
}

/// What a source's `status.artifact` says of one revision.
#[derive(Clone, Debug)]
pub struct Artifact {
    pub url: String,
    pub digest: String,
    pub revision: String,
}

/// Revisions of one Flux source, served over HTTP.
#[derive(Default)]
pub struct FluxSource {
    /// One server per revision: earlier revisions stay served at their URLs.
    servers: Vec<StaticServer>,
}

impl FluxSource {
    pub fn new() -> Self {
        Self::default()
    }

    /// Serves `files` as revision `revision` (e.g. `main@sha1:<sha>`) and returns its
    /// artifact.
    pub async fn publish(
        &mut self,
        revision: &str,
        files: &[(&str, &str)],
    ) -> Result<Artifact, HarnessError> {
        let bytes = tarball(files)?;
        let digest = crate::fixtures::sha256(&bytes);
        let path = format!("/gitrepository/{}.tar.gz", &digest["sha256:".len()..]);
        let server = StaticServer::start(HashMap::from([(path.clone(), bytes)])).await?;
        let url = server.url(&path);
        self.servers.push(server);
        Ok(Artifact {
            url,
            digest,
            revision: revision.to_owned(),
        })
    }
}
