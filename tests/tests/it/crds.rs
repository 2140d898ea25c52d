//! Our CRDs on the real apiserver: PKO's manifests accepted unchanged, CEL rules enforced with
//! clear messages.

use kube::api::{Api, DynamicObject, PostParams};
use kube::core::{ApiResource, GroupVersionKind};
use pko_tests::{ControlPlane, repo_root};
use serde_json::{Value, json};

fn api_for(plane: &ControlPlane, ns: &str, obj: &Value) -> Api<DynamicObject> {
    let api_version = obj["apiVersion"].as_str().expect("apiVersion");
    let kind = obj["kind"].as_str().expect("kind");
    let (group, version) = api_version.split_once('/').expect("group/version");
    let gvk = GroupVersionKind::gvk(group, version, kind);
    let plural = format!("{}s", kind.to_lowercase());
    let resource = ApiResource::from_gvk_with_plural(&gvk, &plural);
    Api::namespaced_with(plane.client(), ns, &resource)
}

/// Create `obj` and return the apiserver's error message, or None when it was accepted.
async fn create(plane: &ControlPlane, ns: &str, obj: Value) -> Option<String> {
    let api = api_for(plane, ns, &obj);
    let dynamic: DynamicObject = serde_json::from_value(obj).expect("object");
    match api.create(&PostParams::default(), &dynamic).await {
        Ok(_) => None,
        Err(kube::Error::Api(status)) => Some(status.message),
        Err(other) => panic!("unexpected error: {other}"),
    }
}

fn assert_rejected(result: Option<String>, needle: &str) {
    let message =
        result.unwrap_or_else(|| panic!("accepted, expected a rejection with {needle:?}"));
    assert!(message.contains(needle), "{message:?} lacks {needle:?}");
}

#[tokio::test]
async fn program_configuration_needs_type_or_default() {
    let _machine = pko_tests::serial::shared().await;
    let plane = ControlPlane::shared().await;
    let ns = plane.namespace("crd-cfg").await.expect("namespace");
    let bad = json!({
        "apiVersion": "pulumi.com/v1", "kind": "Program",
        "metadata": {"name": "bad"},
        "program": {"configuration": {"region": {}}},
    });
    // Not CEL: `default` is untyped JSON, invisible to CEL, so the schema says anyOf(type, default)
    // and the apiserver names the missing field.
    let message = create(plane, &ns, bad).await.expect("rejected");
    assert!(
        message.contains("program.configuration.region")
            && message.contains("must validate at least one schema (anyOf)")
            && message.contains("type: Required value"),
        "{message}"
    );
    for (name, entry) in [
        ("typed", json!({"type": "String"})),
        ("defaulted", json!({"default": 3})),
    ] {
        let ok = json!({
            "apiVersion": "pulumi.com/v1", "kind": "Program",
            "metadata": {"name": name},
            "program": {"configuration": {"region": entry}},
        });
        assert_eq!(create(plane, &ns, ok).await, None, "{name}");
    }
    let bad_enum = json!({
        "apiVersion": "pulumi.com/v1", "kind": "Program",
        "metadata": {"name": "bad-enum"},
        "program": {"configuration": {"region": {"type": "Map"}}},
    });
    assert_rejected(create(plane, &ns, bad_enum).await, "Unsupported value");
}

#[tokio::test]
async fn program_get_excludes_properties() {
    let _machine = pko_tests::serial::shared().await;
    let plane = ControlPlane::shared().await;
    let ns = plane.namespace("crd-get").await.expect("namespace");
    let bad = json!({
        "apiVersion": "pulumi.com/v1", "kind": "Program",
        "metadata": {"name": "bad"},
        "program": {"resources": {"r": {
            "type": "aws:s3:Bucket", "get": {"id": "b-1"}, "properties": {"x": 1}
        }}},
    });
    let message = create(plane, &ns, bad).await.expect("rejected");
    assert!(
        message.contains("program.resources.r")
            && message.contains("must not validate the schema (not)"),
        "{message}"
    );
    let ok = json!({
        "apiVersion": "pulumi.com/v1", "kind": "Program",
        "metadata": {"name": "ok"},
        "program": {"resources": {"r": {"type": "aws:s3:Bucket", "get": {"id": "b-1"}}}},
    });
    assert_eq!(create(plane, &ns, ok).await, None);
    let empty_type = json!({
        "apiVersion": "pulumi.com/v1", "kind": "Program",
        "metadata": {"name": "empty-type"},
        "program": {"resources": {"r": {"type": ""}}},
    });
    assert_rejected(create(plane, &ns, empty_type).await, "type");
}

#[tokio::test]
async fn stack_sources_are_mutually_exclusive_and_names_short() {
    let _machine = pko_tests::serial::shared().await;
    let plane = ControlPlane::shared().await;
    let ns = plane.namespace("crd-stack").await.expect("namespace");
    for version in ["v1", "v1alpha1"] {
        let two_sources = json!({
            "apiVersion": format!("pulumi.com/{version}"), "kind": "Stack",
            "metadata": {"name": format!("two-{version}")},
            "spec": {
                "stack": "dev",
                "projectRepo": "https://example.com/repo.git", "branch": "main",
                "programRef": {"name": "p"},
            },
        });
        assert_rejected(create(plane, &ns, two_sources).await, "mutually exclusive");
        let flux_and_program = json!({
            "apiVersion": format!("pulumi.com/{version}"), "kind": "Stack",
            "metadata": {"name": format!("fp-{version}")},
            "spec": {
                "stack": "dev",
                "fluxSource": {"sourceRef": {"apiVersion": "source.toolkit.fluxcd.io/v1", "kind": "GitRepository", "name": "r"}},
                "programRef": {"name": "p"},
            },
        });
        assert_rejected(
            create(plane, &ns, flux_and_program).await,
            "mutually exclusive",
        );
        for (suffix, revision) in [
            ("none", json!({})),
            (
                "both",
                json!({"commit": "0123456789012345678901234567890123456789", "branch": "main"}),
            ),
            ("empty", json!({"branch": ""})),
        ] {
            let mut spec = json!({"stack": "dev", "projectRepo": "https://example.com/repo.git"});
            spec.as_object_mut()
                .expect("object")
                .extend(revision.as_object().cloned().unwrap_or_default());
            let git = json!({
                "apiVersion": format!("pulumi.com/{version}"), "kind": "Stack",
                "metadata": {"name": format!("git-{suffix}-{version}")},
                "spec": spec,
            });
            assert_rejected(
                create(plane, &ns, git).await,
                "exactly one of commit and branch",
            );
        }
        let branch_only = json!({
            "apiVersion": format!("pulumi.com/{version}"), "kind": "Stack",
            "metadata": {"name": format!("git-branch-{version}")},
            "spec": {"stack": "dev", "projectRepo": "https://example.com/repo.git", "branch": "main", "commit": ""},
        });
        assert_eq!(create(plane, &ns, branch_only).await, None, "{version}");
        let one = json!({
            "apiVersion": format!("pulumi.com/{version}"), "kind": "Stack",
            "metadata": {"name": format!("one-{version}")},
            "spec": {"stack": "dev", "programRef": {"name": "p"}},
        });
        assert_eq!(create(plane, &ns, one).await, None, "{version}");
    }
    let long = json!({
        "apiVersion": "pulumi.com/v1", "kind": "Stack",
        "metadata": {"name": "a".repeat(43)},
        "spec": {"stack": "dev", "programRef": {"name": "p"}},
    });
    assert_rejected(
        create(plane, &ns, long).await,
        "Stack name must be no more than 42 characters in length.",
    );
    let exactly = json!({
        "apiVersion": "pulumi.com/v1", "kind": "Stack",
        "metadata": {"name": "a".repeat(42)},
        "spec": {"stack": "dev", "programRef": {"name": "p"}},
    });
    assert_eq!(create(plane, &ns, exactly).await, None);
    let missing_stack = json!({
        "apiVersion": "pulumi.com/v1", "kind": "Stack",
        "metadata": {"name": "nostack"},
        "spec": {"programRef": {"name": "p"}},
    });
    assert_rejected(create(plane, &ns, missing_stack).await, "stack");
}

/// `spec.approval` gates ups, which a `preview` stack never runs: the CRD refuses the pair, and
/// accepts the gate alone (or with `preview: false`) and a bad `Update.spec.plan` not at all.
#[tokio::test]
async fn approval_is_refused_with_preview() {
    let _machine = pko_tests::serial::shared().await;
    let plane = ControlPlane::shared().await;
    let ns = plane.namespace("crd-approval").await.expect("namespace");
    let stack = |name: &str, extra: serde_json::Value| {
        let mut spec = json!({"stack": "dev", "programRef": {"name": "p"}});
        spec.as_object_mut()
            .expect("object")
            .extend(extra.as_object().cloned().unwrap_or_default());
        json!({
            "apiVersion": "pulumi.com/v1", "kind": "Stack",
            "metadata": {"name": name}, "spec": spec,
        })
    };
    assert_rejected(
        create(
            plane,
            &ns,
            stack("both", json!({"approval": {}, "preview": true})),
        )
        .await,
        "set approval or preview, not both",
    );
    for (name, extra) in [
        ("gated", json!({"approval": {}})),
        (
            "required",
            json!({"approval": {"required": true}, "preview": false}),
        ),
        ("off", json!({"approval": {"required": false}})),
    ] {
        assert_eq!(create(plane, &ns, stack(name, extra)).await, None, "{name}");
    }
    let bad_plan = json!({
        "apiVersion": "auto.pulumi.com/v1alpha1", "kind": "Update",
        "metadata": {"name": "u"},
        "spec": {"workspaceName": "w", "type": "up", "plan": "../etc/passwd"},
    });
    assert_rejected(create(plane, &ns, bad_plan).await, "spec.plan");
}

/// Every PKO example and e2e manifest of our kinds is accepted unchanged (server-side dry run).
#[tokio::test]
async fn pko_examples_are_accepted_unchanged() {
    let _machine = pko_tests::serial::shared().await;
    let plane = ControlPlane::shared().await;
    let ns = plane.namespace("crd-examples").await.expect("namespace");
    let dir = repo_root().join("tests/fixtures/pko-v2.9-examples");
    let mut checked = 0;
    let mut entries: Vec<_> = std::fs::read_dir(&dir)
        .expect("examples dir")
        .map(|e| e.expect("entry").path())
        .filter(|p| p.extension().is_some_and(|e| e == "yaml"))
        .collect();
    entries.sort();
    for path in entries {
        let text = std::fs::read_to_string(&path).expect("read");
        for doc in text.split("\n---") {
            let Ok(value) = yaml_serde::from_str::<Value>(doc) else {
                continue;
            };
            let Some(api_version) = value["apiVersion"].as_str() else {
                continue;
            };
            if !(api_version.starts_with("pulumi.com/")
                || api_version.starts_with("auto.pulumi.com/"))
            {
                continue;
            }
            let mut obj = value.clone();
            obj["metadata"]["namespace"] = json!(ns);
            let api = api_for(plane, &ns, &obj);
            let dynamic: DynamicObject = serde_json::from_value(obj).expect("object");
            // A dry-run create, as `kubectl create` would send it: one PKO example sets a field
            // PKO's own CRD lacks (spec.git.revision), which the apiserver prunes with a warning
            // here, exactly as it does for PKO's CRD.
            let params = PostParams {
                dry_run: true,
                ..PostParams::default()
            };
            let name = dynamic.metadata.name.clone().expect("name");
            let result = api.create(&params, &dynamic).await;
            assert!(
                result.is_ok(),
                "{}: {name}: {:?}",
                path.display(),
                result.err()
            );
            checked += 1;
        }
    }
    assert!(checked >= 20, "only {checked} PKO objects found");
}

#[tokio::test]
async fn transform_module_sources_are_one_of_three_and_signatures_need_oci() {
    let _machine = pko_tests::serial::shared().await;
    let plane = ControlPlane::shared().await;
    let ns = plane.namespace("crd-oci").await.expect("namespace");
    let sha = "ab".repeat(32);
    let digest = format!("sha256:{}", "cd".repeat(32));
    let key = "-----BEGIN PUBLIC KEY-----\nAAAA\n-----END PUBLIC KEY-----\n";
    let transform = |name: &str, spec: Value| json!({"apiVersion": "pko-rs.dev/v1alpha1", "kind": "ProgramTransform", "metadata": {"name": name}, "spec": spec});
    let oci =
        |reference: &str, digest: &str| json!({"oci": {"reference": reference, "digest": digest}});

    let ok = create(
        plane,
        &ns,
        transform(
            "signed",
            json!({"source": oci("registry.example.com:5000/team-a/tags:v1", &digest), "sha256": sha, "verify": {"cosign": {"keys": [key]}}}),
        ),
    )
    .await;
    assert_eq!(ok, None);
    assert_rejected(
        create(
            plane,
            &ns,
            transform(
                "two",
                json!({"source": {"url": "https://x.example/a.wasm", "oci": {"reference": "r.example/a", "digest": digest}}, "sha256": sha}),
            ),
        )
        .await,
        "set exactly one of configMap, url and oci",
    );
    assert_rejected(
        create(
            plane,
            &ns,
            transform(
                "verify-url",
                json!({"source": {"url": "https://x.example/a.wasm"}, "sha256": sha, "verify": {"cosign": {"keys": [key]}}}),
            ),
        )
        .await,
        "verify applies to source.oci only",
    );
    assert_rejected(
        create(
            plane,
            &ns,
            transform(
                "both-keys",
                json!({"source": oci("r.example/a", &digest), "sha256": sha, "verify": {"cosign": {"keys": [key], "publicKeySecretRef": {"name": "k", "key": "cosign.pub"}}}}),
            ),
        )
        .await,
        "set exactly one of publicKeySecretRef and keys",
    );
    for reference in [
        "https://r.example/a",
        "r.example/a@sha256:00",
        "r.example/A",
        "r.example",
    ] {
        assert_rejected(
            create(
                plane,
                &ns,
                transform(
                    "bad-ref",
                    json!({"source": oci(reference, &digest), "sha256": sha}),
                ),
            )
            .await,
            "reference must be host[:port]/repository[:tag]",
        );
    }
    assert_rejected(
        create(
            plane,
            &ns,
            transform(
                "foreign-pull-secret",
                json!({"source": {"oci": {"reference": "r.example/a", "digest": digest, "pullSecretRef": {"name": "creds", "namespace": "kube-system"}}}, "sha256": sha}),
            ),
        )
        .await,
        "a ProgramTransform reads its pull Secret from its own namespace",
    );
    assert_rejected(
        create(
            plane,
            &ns,
            transform(
                "bad-digest",
                json!({"source": oci("r.example/a", "sha256:AB"), "sha256": sha}),
            ),
        )
        .await,
        "digest must be sha256: and 64 lowercase hex characters",
    );
}
