//! Transform modules as OCI Wasm artifacts in a real registry (distribution's, on loopback with
//! TLS), published with `pko-operator plugin push` and signed with the real `cosign`.

use std::path::Path;

use k8s_openapi::api::core::v1::Secret;
use pko_operator::oci::registry::{Descriptor, Manifest, Session};
use pko_operator::oci::{MANIFEST_TYPE, Reference, cosign as cosign_format};
use pko_tests::registry::{Cosign, Registry};

use super::*;

/// `pko-operator plugin push` of module `module`; returns (manifest digest, module sha256).
fn push(registry: &Registry, module: &str, reference: &str) -> (String, String) {
    push_as(registry, module, reference, None)
}

/// [`push`], logged in as `login` (the password on stdin).
fn push_as(
    registry: &Registry,
    module: &str,
    reference: &str,
    login: Option<(&str, &str)>,
) -> (String, String) {
    let module = plugins_dir().join(format!("{module}.wasm"));
    let pushed = registry
        .push_plugin(&module, reference, login)
        .expect("plugin push");
    (pushed.manifest, pushed.module)
}

fn oci_spec(name: &str, digest: &str, sha256: &str, fetched: &str, rest: Value) -> Value {
    let mut spec = json!({
        "source": {"oci": {"reference": name, "digest": digest}},
        "sha256": sha256,
        "config": {"tags": {"fetched": fetched}, "targets": [{"typePrefix": "aws:"}]},
    });
    merge(&mut spec, rest);
    spec
}

async fn operator_trusting(plane: &ControlPlane, ns: &str, ca: &Path) -> Operator {
    Operator::start(
        plane,
        OperatorOptions {
            advertised: Some(ADVERTISED.into()),
            args: vec![
                format!("--watch-namespace={ns}"),
                format!("--plugin-cache-dir={}", shared_cache_dir().display()),
                format!("--plugin-ca-file={}", ca.display()),
            ],
        },
    )
    .await
    .expect("operator starts")
}

/// The Ready condition of transform `name` once `pred` holds for it: (status, reason, message).
async fn transform_ready(
    api: &Api<ProgramTransform>,
    op: &Operator,
    name: &str,
    what: &str,
    pred: impl Fn(&str, &str, &str) -> bool,
) -> (String, String, String, TransformStatus) {
    let found = wait_for(&format!("{name}: {what}"), WAIT, || async {
        let status = api.get(name).await.ok()?.status?;
        let (s, r, m) = ready_condition(&status)?;
        let owned = (s.to_owned(), r.to_owned(), m.to_owned());
        pred(s, r, m).then_some((owned.0, owned.1, owned.2, status.clone()))
    })
    .await;
    match found {
        Ok(found) => found,
        Err(e) => {
            let last = api.get(name).await.ok().and_then(|t| t.status);
            panic!(
                "{e}; last status: {last:?}\noperator log:\n{}",
                op.log_text()
            )
        }
    }
}

/// Creates transform `name` with `spec`, then waits for it to be refused (`Ready=False`):
/// (reason, message, status).
async fn create_refused(
    api: &Api<ProgramTransform>,
    op: &Operator,
    name: &str,
    spec: Value,
) -> (String, String, TransformStatus) {
    api.create(&PostParams::default(), &transform(name, spec))
        .await
        .expect("transform");
    let (_, reason, message, status) =
        transform_ready(api, op, name, "refused", |s, _, _| s == "False").await;
    (reason, message, status)
}

/// The `fetched` tag the bucket of `name` carries in the artifact served at `generation`.
async fn fetched_tag(
    op: &Operator,
    api: &Api<Program>,
    ns: &str,
    name: &str,
    generation: i64,
) -> Value {
    let artifact = artifact_where(
        api,
        name,
        &format!("artifact of generation {generation}"),
        |a| {
            a["revision"].as_str() == Some(generation.to_string().as_str())
                && a["metadata"].get(METADATA_CHAIN).is_some()
        },
    )
    .await;
    let body = served(
        op,
        ns,
        name,
        generation,
        artifact["digest"].as_str().expect("digest"),
    )
    .await;
    project(&body)["resources"]["bucket"]["properties"]["tags"]["fetched"].clone()
}

#[tokio::test]
async fn signed_oci_modules_load_and_unsigned_wrongly_signed_or_tampered_ones_are_refused() {
    let _machine = pko_tests::serial::shared().await;
    let plane = ControlPlane::shared().await;
    let ns = plane.namespace("tf-oci-signed").await.expect("namespace");
    let dir = tempfile::tempdir().expect("tempdir");
    let registry = Registry::start(&dir.path().join("registry"))
        .await
        .expect("registry");
    let trusted = Cosign::generate(&dir.path().join("trusted"), registry.ca_file()).expect("key");
    let other = Cosign::generate(&dir.path().join("other"), registry.ca_file()).expect("key");
    let repo = |r: &str| format!("{}/plugins/{r}", registry.host());

    // Signed with the trusted key, whose public half is in a Secret.
    let (tags_digest, tags_sha) = push(&registry, "default_tags", &format!("{}:v1", repo("tags")));
    trusted.sign(&repo("tags"), &tags_digest).expect("sign");
    let secrets: Api<Secret> = Api::namespaced(plane.client(), &ns);
    let key_secret: Secret = serde_json::from_value(json!({
        "metadata": {"name": "plugin-keys"},
        "stringData": {"cosign.pub": trusted.public_key().expect("pub")},
    }))
    .expect("secret");
    secrets
        .create(&PostParams::default(), &key_secret)
        .await
        .expect("key Secret");

    let op = operator_trusting(plane, &ns, registry.ca_file()).await;
    let programs: Api<Program> = Api::namespaced(plane.client(), &ns);
    let transforms: Api<ProgramTransform> = Api::namespaced(plane.client(), &ns);
    programs
        .create(&PostParams::default(), &program("web", &[], bucket_spec()))
        .await
        .expect("program");
    let verify_secret = json!({"verify": {"cosign": {"publicKeySecretRef": {"name": "plugin-keys", "key": "cosign.pub"}}}});
    transforms
        .create(
            &PostParams::default(),
            &transform(
                "signed",
                oci_spec(&repo("tags"), &tags_digest, &tags_sha, "oci", verify_secret),
            ),
        )
        .await
        .expect("transform");
    assert_eq!(fetched_tag(&op, &programs, &ns, "web", 1).await, "oci");
    let (_, reason, _, status) =
        transform_ready(&transforms, &op, "signed", "Loaded", |s, _, _| s == "True").await;
    assert_eq!(reason, "Loaded");
    assert_eq!(status.digest.as_deref(), Some(tags_sha.as_str()));

    // The refused ones select no Program: only their own status changes.
    let nothing = |more: Value| {
        let mut v = json!({"programSelector": {"matchLabels": {"app": "none"}}});
        merge(&mut v, more);
        v
    };
    let trusted_inline =
        json!({"verify": {"cosign": {"keys": [trusted.public_key().expect("pub")]}}});

    // Unsigned.
    let (naming_digest, naming_sha) = push(&registry, "naming_policy", &repo("naming"));
    let (reason, message, status) = create_refused(
        &transforms,
        &op,
        "unsigned",
        oci_spec(
            &repo("naming"),
            &naming_digest,
            &naming_sha,
            "x",
            nothing(trusted_inline.clone()),
        ),
    )
    .await;
    assert_eq!(reason, "Signature", "{message}");
    assert!(message.contains("no signature manifest"), "{message}");
    assert_eq!(status.digest, None);

    // Signed, but by a key the transform does not trust.
    let (allow_digest, allow_sha) = push(&registry, "resource_allowlist", &repo("allow"));
    other.sign(&repo("allow"), &allow_digest).expect("sign");
    let (reason, message, _) = create_refused(
        &transforms,
        &op,
        "wrong-key",
        oci_spec(
            &repo("allow"),
            &allow_digest,
            &allow_sha,
            "x",
            nothing(trusted_inline.clone()),
        ),
    )
    .await;
    assert_eq!(reason, "Signature", "{message}");
    assert!(
        message.contains("verifies with the 1 trusted key"),
        "{message}"
    );

    // Tampered: the trusted signature of default_tags, its payload rewritten to name the
    // naming_policy artifact, placed where cosign puts that artifact's signatures.
    let http = registry.client().expect("client");
    let tags_ref = Reference::parse(&repo("tags")).expect("ref");
    let mut tags_session = Session::new(&http, None, &tags_ref);
    let (sig_manifest, _) = tags_session
        .manifest(&format!("{}.sig", tags_digest.replacen(':', "-", 1)))
        .await
        .expect("signature manifest");
    let sig_manifest = sig_manifest.expect("signed");
    let layer = sig_manifest.layers[0].clone();
    let payload = http
        .get(format!(
            "https://{}/v2/plugins/tags/blobs/{}",
            registry.host(),
            layer.digest
        ))
        .send()
        .await
        .expect("payload")
        .bytes()
        .await
        .expect("payload bytes");
    let forged = String::from_utf8(payload.to_vec())
        .expect("utf8")
        .replace(&tags_digest, &naming_digest)
        .replace("plugins/tags", "plugins/naming");
    let naming_ref = Reference::parse(&repo("naming")).expect("ref");
    let mut naming_session = Session::new(&http, None, &naming_ref);
    let forged_digest = naming_session
        .push_blob(forged.as_bytes())
        .await
        .expect("blob");
    let config_digest = naming_session.push_blob(b"{}").await.expect("config");
    let forged_manifest = Manifest {
        schema_version: 2,
        media_type: Some(MANIFEST_TYPE.into()),
        artifact_type: None,
        config: Descriptor {
            media_type: "application/vnd.oci.image.config.v1+json".into(),
            digest: config_digest,
            size: 2,
            annotations: None,
        },
        layers: vec![Descriptor {
            media_type: cosign_format::PAYLOAD_TYPE.into(),
            digest: forged_digest,
            size: forged.len() as u64,
            annotations: layer.annotations.clone(),
        }],
    };
    naming_session
        .push_manifest(
            &format!("{}.sig", naming_digest.replacen(':', "-", 1)),
            &serde_json::to_vec(&forged_manifest).expect("json"),
        )
        .await
        .expect("forged signature");
    let (reason, message, _) = create_refused(
        &transforms,
        &op,
        "tampered",
        oci_spec(
            &repo("naming"),
            &naming_digest,
            &naming_sha,
            "x",
            nothing(trusted_inline),
        ),
    )
    .await;
    assert_eq!(reason, "Signature", "{message}");
    assert!(
        message.contains("verifies with the 1 trusted key"),
        "{message}"
    );

    // The signed transform was never disturbed.
    assert_eq!(fetched_tag(&op, &programs, &ns, "web", 1).await, "oci");
    drop(registry);
}

#[tokio::test]
async fn while_the_registry_is_down_the_previous_module_keeps_serving() {
    let _machine = pko_tests::serial::shared().await;
    let plane = ControlPlane::shared().await;
    let ns = plane.namespace("tf-oci-down").await.expect("namespace");
    let dir = tempfile::tempdir().expect("tempdir");
    let mut registry = Registry::start(&dir.path().join("registry"))
        .await
        .expect("registry");
    let name = format!("{}/plugins/tags", registry.host());
    let (digest, sha) = push(&registry, "default_tags", &name);

    let op = operator_trusting(plane, &ns, registry.ca_file()).await;
    let programs: Api<Program> = Api::namespaced(plane.client(), &ns);
    let transforms: Api<ProgramTransform> = Api::namespaced(plane.client(), &ns);
    programs
        .create(&PostParams::default(), &program("web", &[], bucket_spec()))
        .await
        .expect("program");
    transforms
        .create(
            &PostParams::default(),
            &transform("tags", oci_spec(&name, &digest, &sha, "v1", json!({}))),
        )
        .await
        .expect("transform");
    assert_eq!(fetched_tag(&op, &programs, &ns, "web", 1).await, "v1");

    registry.stop();
    let patch = json!({"spec": {"config": {"tags": {"fetched": "v2"}, "targets": [{"typePrefix": "aws:"}]}}});
    transforms
        .patch("tags", &PatchParams::default(), &Patch::Merge(&patch))
        .await
        .expect("patch transform");
    let (_, _, message, status) =
        transform_ready(&transforms, &op, "tags", "ServingPrevious", |s, r, _| {
            s == "False" && r == "ServingPrevious"
        })
        .await;
    assert!(
        message.contains(&registry.host()) && message.contains("keeps serving"),
        "{message}"
    );
    assert_eq!(status.digest.as_deref(), Some(sha.as_str()));

    // A new generation of the Program is still built, with the module (and configuration)
    // that was running.
    let spec = json!({"program": {"resources": {"bucket": {"type": "aws:s3/bucket:Bucket", "properties": {"name": "logs-2"}}}}});
    programs
        .patch("web", &PatchParams::default(), &Patch::Merge(&spec))
        .await
        .expect("patch program");
    assert_eq!(fetched_tag(&op, &programs, &ns, "web", 2).await, "v1");

    registry.start_again().await.expect("registry back");
    transform_ready(&transforms, &op, "tags", "Loaded again", |s, r, _| {
        s == "True" && r == "Loaded"
    })
    .await;
    let artifact = artifact_where(&programs, "web", "built with the new configuration", |a| {
        a["revision"] == "2" && a["metadata"].get(METADATA_CHAIN).is_some()
    })
    .await;
    let tag = wait_for("web serves the v2 tag", WAIT, || async {
        let p = programs.get("web").await.ok()?;
        let a = status_of(&p).get("artifact")?.clone();
        let body = reqwest::get(op.fs_url_of(a.get("url")?.as_str()?))
            .await
            .ok()?
            .bytes()
            .await
            .ok()?;
        let tag = project(&body)["resources"]["bucket"]["properties"]["tags"]["fetched"].clone();
        (tag == "v2").then_some(tag)
    })
    .await
    .unwrap_or_else(|e| panic!("{e}; first artifact {artifact}\nlog:\n{}", op.log_text()));
    assert_eq!(tag, "v2");
}

fn registry_secret(name: &str, host: &str, user: &str, password: &str) -> Secret {
    use base64::Engine;
    let auth = base64::engine::general_purpose::STANDARD.encode(format!("{user}:{password}"));
    let config = json!({"auths": {format!("https://{host}"): {"auth": auth}}}).to_string();
    serde_json::from_value(json!({
        "metadata": {"name": name},
        "type": "kubernetes.io/dockerconfigjson",
        "stringData": {".dockerconfigjson": config},
    }))
    .expect("secret")
}

#[tokio::test]
async fn a_private_registry_is_pulled_from_with_the_pull_secret_only() {
    let _machine = pko_tests::serial::shared().await;
    let plane = ControlPlane::shared().await;
    let ns = plane.namespace("tf-oci-private").await.expect("namespace");
    let dir = tempfile::tempdir().expect("tempdir");
    let (user, password) = ("plugins", "s3cret-pw");
    let registry = Registry::start_private(&dir.path().join("registry"), user, password)
        .await
        .expect("registry");
    let name = format!("{}/team-a/tags", registry.host());
    let (digest, sha) = push_as(&registry, "default_tags", &name, Some((user, password)));

    let secrets: Api<Secret> = Api::namespaced(plane.client(), &ns);
    for secret in [
        registry_secret("registry-creds", &registry.host(), user, password),
        registry_secret("wrong-creds", &registry.host(), user, "not-it"),
        registry_secret("other-registry", "registry.example.com", user, password),
    ] {
        secrets
            .create(&PostParams::default(), &secret)
            .await
            .expect("pull Secret");
    }
    let op = operator_trusting(plane, &ns, registry.ca_file()).await;
    let programs: Api<Program> = Api::namespaced(plane.client(), &ns);
    let transforms: Api<ProgramTransform> = Api::namespaced(plane.client(), &ns);
    programs
        .create(&PostParams::default(), &program("web", &[], bucket_spec()))
        .await
        .expect("program");

    let with_secret = |secret: Option<&str>, selects: bool| {
        let mut spec = oci_spec(&name, &digest, &sha, "private", json!({}));
        if let Some(secret) = secret {
            spec["source"]["oci"]["pullSecretRef"] = json!({"name": secret});
        }
        if !selects {
            spec["programSelector"] = json!({"matchLabels": {"app": "none"}});
        }
        spec
    };
    let refused = [
        (
            "anonymous",
            None,
            "wants credentials (set source.oci.pullSecretRef)",
        ),
        (
            "wrong-password",
            Some("wrong-creds"),
            "refused the credentials of \"plugins\"",
        ),
        ("no-entry", Some("other-registry"), "has no credentials for"),
        ("missing-secret", Some("absent"), "not found"),
    ];
    for (transform_name, secret, _) in refused {
        transforms
            .create(
                &PostParams::default(),
                &transform(transform_name, with_secret(secret, false)),
            )
            .await
            .expect("transform");
    }
    for (transform_name, _, needle) in refused {
        let (_, reason, message, _) =
            transform_ready(&transforms, &op, transform_name, "refused", |s, _, _| {
                s == "False"
            })
            .await;
        assert_eq!(reason, "Source", "{transform_name}: {message}");
        assert!(message.contains(needle), "{transform_name}: {message}");
        assert!(
            !message.contains(password),
            "{transform_name} shows the password: {message}"
        );
    }

    transforms
        .create(
            &PostParams::default(),
            &transform("tags", with_secret(Some("registry-creds"), true)),
        )
        .await
        .expect("transform");
    assert_eq!(fetched_tag(&op, &programs, &ns, "web", 1).await, "private");
    assert!(
        !op.log_text().contains(password),
        "the operator logged the password"
    );
}
