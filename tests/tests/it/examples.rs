//! The examples in `examples/`, each applied by a test on the real components, as a user would
//! apply it: the file as it is, through [`fixtures::example`], which changes only what a test
//! must (the namespace, the test servers' URLs, the digests and keys of what the test
//! published, and a file backend for Pulumi Cloud). Each test checks what its example promises,
//! not only that it applied.
//!
//! [`EXAMPLES`] names the test of every file under `examples/`, and
//! [`every_example_is_applied_by_a_test`] keeps it, the tests and `examples/README.md` in step:
//! an example without a test fails it.

use std::path::PathBuf;
use std::process::Stdio;
use std::time::Duration;

use k8s_openapi::api::core::v1::Pod;
use kube::Api;
use kube::api::ListParams;
use pko_api::program::Program;
use pko_api::stack::{Stack, StackStatus};
use pko_api::transform::ProgramTransform;
use pko_api::update::Update;
use pko_operator::controller::program::METADATA_APPLIED;
use pko_tests::execution::Execution;
use pko_tests::flux::{FluxSource, Sources};
use pko_tests::gitrepo::GitRepo;
use pko_tests::operator::{Operator, OperatorOptions};
use pko_tests::plugins::{plugins_dir, shared_cache_dir};
use pko_tests::registry::{Cosign, Registry};
use pko_tests::webhook::{Registration, WebhookOptions, policy_bundle};
use pko_tests::{ControlPlane, fixtures, repo_root, wait_for};
use serde_json::{Value, json};

const WAIT: Duration = Duration::from_secs(180);

/// Every file under `examples/` (but its README) and the test that applies it
/// (`module::test`).
const EXAMPLES: &[(&str, &str)] = &[
    (
        "examples/custom-image/stack.yaml",
        "examples::custom_image_runs_the_workspace_in_the_image_given",
    ),
    (
        "examples/flux-source/stack.yaml",
        "examples::flux_source_deploys_the_sources_artifact",
    ),
    (
        "examples/git-token-auth/stack.yaml",
        "examples::git_token_auth_deploys_from_a_repository_that_needs_the_token",
    ),
    (
        "examples/namespace-scoped/values.yaml",
        "deploy_scope::namespace_scoped_install_runs_a_program_and_a_stack_with_its_roles_only",
    ),
    (
        "examples/program.yaml",
        "program::the_make_run_path_works_end_to_end",
    ),
    (
        "examples/refused.yaml",
        "program::the_make_run_path_works_end_to_end",
    ),
    (
        "examples/stack-prerequisites/stacks.yaml",
        "examples::a_stack_runs_only_after_its_prerequisite_succeeded",
    ),
    (
        "examples/stack.yaml",
        "program::the_make_run_path_works_end_to_end",
    ),
    (
        "examples/tenancy-modes/policies.yaml",
        "examples::tenancy_modes_record_warn_and_refuse",
    ),
    (
        "examples/tenancy-modes/workspace.yaml",
        "examples::tenancy_modes_record_warn_and_refuse",
    ),
    (
        "examples/tenancy.yaml",
        "program::the_make_run_path_works_end_to_end",
    ),
    (
        "examples/transform.yaml",
        "program::the_make_run_path_works_end_to_end",
    ),
    (
        "examples/transforms-oci/transform.yaml",
        "examples::a_signed_oci_transform_is_verified_and_applied",
    ),
    (
        "examples/warned.yaml",
        "program::the_make_run_path_works_end_to_end",
    ),
];

/// The file `make run` (`pko-dev`) applies the top-level examples from.
const MAKE_RUN: &str = "tests/src/bin/pko-dev.rs";

/// The table lists exactly the files under `examples/`; each test exists and its module names
/// the file outside the table (the `make run` test's files are named by `pko-dev`, which it
/// runs);
/// `examples/README.md` links every file.
#[test]
fn every_example_is_applied_by_a_test() {
    let root = repo_root();
    let mut files: Vec<String> = fixtures::files_under(&root.join("examples"))
        .iter()
        .filter_map(|p| p.strip_prefix(&root).ok())
        .map(|p| p.to_string_lossy().into_owned())
        .filter(|p| p != "examples/README.md")
        .collect();
    files.sort();
    let listed: Vec<&str> = EXAMPLES.iter().map(|(f, _)| *f).collect();
    assert_eq!(
        listed, files,
        "EXAMPLES lists exactly the example files, sorted"
    );
    let readme = std::fs::read_to_string(root.join("examples/README.md")).expect("README");
    for (file, test) in EXAMPLES {
        let (module, name) = test.split_once("::").expect("module::test");
        let source = std::fs::read_to_string(root.join(format!("tests/tests/it/{module}.rs")))
            .unwrap_or_else(|e| panic!("{test}: {e}"));
        assert!(
            source.contains(&format!("async fn {name}()")),
            "{file}: no test {test}"
        );
        let applier = if module == "program" {
            std::fs::read_to_string(root.join(MAKE_RUN)).expect("pko-dev")
        } else {
            without_table(&source)
        };
        assert!(applier.contains(file), "{file}: {test} does not name it");
        let relative = file.trim_start_matches("examples/");
        assert!(
            readme.contains(&format!("]({relative})")),
            "examples/README.md does not link {relative}"
        );
    }
}

/// `source` without the [`EXAMPLES`] table (which names every file).
fn without_table(source: &str) -> String {
    match source.split_once("const EXAMPLES: &[(&str, &str)] = &[") {
        Some((before, after)) => {
            let rest = after.split_once("\n];").map_or("", |(_, rest)| rest);
            format!("{before}{rest}")
        }
        None => source.to_owned(),
    }
}

fn path(file: &str) -> PathBuf {
    repo_root().join(file)
}

/// The example `file` applied in `e`'s namespace with `substitutions` (see
/// [`fixtures::example`]), but the objects `skip` refuses.
async fn apply_example(
    e: &Execution,
    file: &str,
    substitutions: &[(&str, &str)],
    skip: impl Fn(&Value) -> bool,
) -> Vec<Value> {
    let backend = e.tmp.path().join("backend");
    let objects = fixtures::example(&path(file), &e.ns, &backend, substitutions)
        .unwrap_or_else(|err| panic!("{file}: {err}"));
    let applied: Vec<Value> = objects.iter().filter(|o| !skip(o)).cloned().collect();
    fixtures::apply_all(e.plane.client(), &e.ns, &applied)
        .await
        .unwrap_or_else(|err| panic!("{file}: {err}"));
    objects
}

/// Waits for Stack `name` of `e` to be Ready with output `message`: its status, or a panic
/// with the stack's status, the pod's and the operator's logs.
async fn deployed(e: &Execution, name: &str, key: &str, value: &Value) -> StackStatus {
    let stacks: Api<Stack> = Api::namespaced(e.plane.client(), &e.ns);
    let found = wait_for(&format!("stack {name} to deploy"), WAIT, || async {
        let status = stacks.get(name).await.ok()?.status?;
        let ready = status
            .conditions
            .iter()
            .any(|c| c.type_ == "Ready" && c.status == "True");
        (ready && status.outputs.get(key) == Some(value)).then_some(status)
    })
    .await;
    match found {
        Ok(status) => status,
        Err(err) => panic!(
            "{err}: {:?}\n{}\n{}",
            stacks.get(name).await.ok().and_then(|s| s.status),
            e.kubelet.logs(name),
            e.operator.log_text()
        ),
    }
}

/// A Pulumi YAML project whose output `message` is `message`.
fn project(message: &str) -> String {
    format!("name: example\nruntime: yaml\noutputs:\n  message: {message}\n")
}

/// examples/git-token-auth: the repository refuses anonymous requests and takes only the token
/// (as the password of user `git`, as git hosts do); the Stack reaches Ready at the commit with
/// the program's output, its branch listed by the operator and cloned by the workspace with
/// the token from the example's Secret.
#[tokio::test]
async fn git_token_auth_deploys_from_a_repository_that_needs_the_token() {
    let _machine = pko_tests::serial::shared().await;
    let token = format!("glpat-{}", hex::encode(rand::random::<[u8; 12]>()));
    let git_dir = tempfile::tempdir().expect("tmp");
    let repo = GitRepo::start_smart_https(git_dir.path(), Some(("git", &token)))
        .await
        .expect("git repo");
    let commit = repo
        .commit(
            "main",
            &[("hello/Pulumi.yaml", &project("from-private-git"))],
        )
        .expect("commit");
    let e = Execution::start_trusting("ex-gittoken", repo.tls_cert().expect("certificate")).await;
    let url = repo.url();
    apply_example(
        &e,
        "examples/git-token-auth/stack.yaml",
        &[
            ("https://git.example.com/acme/infrastructure.git", &url),
            ("REPLACE_WITH_YOUR_GIT_TOKEN", &token),
        ],
        |_| false,
    )
    .await;
    let status = deployed(
        &e,
        "from-private-git",
        "message",
        &json!("from-private-git"),
    )
    .await;
    let last = status.last_update.expect("last update");
    assert_eq!(
        last.last_successful_commit.as_deref(),
        Some(commit.as_str())
    );
    // Both the operator's listing and the workspace's clone went through the authenticated
    // smart protocol.
    let requests = repo.requests();
    assert!(
        requests.iter().any(|r| r.contains("git-upload-pack")),
        "{requests:?}"
    );
}

/// examples/flux-source: the GitRepository and the Stack as the example has them; the test plays
/// Flux's source-controller (writing the GitRepository's artifact, served over HTTP). The Stack
/// deploys that artifact's program from the example's `dir`.
#[tokio::test]
async fn flux_source_deploys_the_sources_artifact() {
    let _machine = pko_tests::serial::shared().await;
    let e = Execution::start("ex-flux", &[]).await;
    pko_tests::flux::install_crds(e.plane.client(), WAIT)
        .await
        .expect("Flux CRDs");
    let objects = apply_example(&e, "examples/flux-source/stack.yaml", &[], |_| false).await;
    let source = objects
        .iter()
        .find(|o| o["kind"] == "GitRepository")
        .expect("a GitRepository");
    let name = source["metadata"]["name"].as_str().expect("name");
    assert_eq!(source["spec"]["ref"]["branch"], "main");
    let mut served = FluxSource::new();
    let revision = format!("main@sha1:{}", "1".repeat(40));
    let artifact = served
        .publish(&revision, &[("hello/Pulumi.yaml", &project("from-flux"))])
        .await
        .expect("artifact");
    Sources::new(e.plane.client(), &e.ns, "GitRepository", "v1")
        .set_artifact(name, (&artifact.url, &artifact.digest, &revision))
        .await
        .expect("the GitRepository's artifact");
    let status = deployed(&e, "from-flux", "message", &json!("from-flux")).await;
    let last = status.last_update.expect("last update");
    assert_eq!(
        last.last_successful_commit.as_deref(),
        Some(artifact.digest.as_str())
    );
}

/// examples/custom-image: the Stack deploys, and its workspace pod (as the StatefulSet the
/// operator made lays it out; the harness kubelet runs any image with the same binaries)
/// runs the image and the resources the example's workspaceTemplate gives.
#[tokio::test]
async fn custom_image_runs_the_workspace_in_the_image_given() {
    let _machine = pko_tests::serial::shared().await;
    let e = Execution::start("ex-image", &[]).await;
    let objects = apply_example(&e, "examples/custom-image/stack.yaml", &[], |_| false).await;
    let template = objects
        .iter()
        .find(|o| o["kind"] == "Stack")
        .map(|s| s["spec"]["workspaceTemplate"]["spec"].clone())
        .expect("a Stack");
    let image = template["image"].as_str().expect("an image");
    assert!(!image.starts_with("pulumi/"), "a custom image: {image}");
    deployed(
        &e,
        "custom-image",
        "message",
        &json!("deployed from a custom image"),
    )
    .await;
    let pods: Api<Pod> = Api::namespaced(e.plane.client(), &e.ns);
    let pod = pods.get("custom-image-workspace-0").await.expect("pod");
    let spec = pod.spec.expect("pod spec");
    let pulumi = spec
        .containers
        .iter()
        .find(|c| c.name == "pulumi")
        .expect("the pulumi container");
    assert_eq!(pulumi.image.as_deref(), Some(image));
    let requests = serde_json::to_value(pulumi.resources.as_ref().and_then(|r| r.requests.clone()))
        .expect("json");
    assert_eq!(requests, template["resources"]["requests"]);
}

/// examples/transforms-oci: the test publishes the default-tags plugin to its registry with
/// `pko-operator plugin push` and signs it with cosign, then applies the example with the
/// reference, digests and public key that gave. The transform is Loaded at the module's
/// digest (pulled by digest, signature verified) and the selected Program's artifact records it
/// as applied.
#[tokio::test]
async fn a_signed_oci_transform_is_verified_and_applied() {
    let _machine = pko_tests::serial::shared().await;
    let plane = ControlPlane::shared().await;
    let dir = tempfile::tempdir().expect("tmp");
    let registry = Registry::start(&dir.path().join("registry"))
        .await
        .expect("registry");
    let repository = format!("{}/platform/plugins/default-tags", registry.host());
    let pushed = registry
        .push_plugin(
            &plugins_dir().join("default_tags.wasm"),
            &format!("{repository}:v1"),
            None,
        )
        .expect("plugin push");
    let (digest, sha256) = (pushed.manifest, pushed.module);
    let cosign = Cosign::generate(&dir.path().join("cosign"), registry.ca_file()).expect("key");
    cosign.sign(&repository, &digest).expect("sign");
    let public_key = cosign.public_key().expect("public key");

    let e_ns = plane.namespace("ex-oci").await.expect("namespace");
    let op = Operator::start(
        plane,
        OperatorOptions {
            advertised: None,
            args: vec![
                format!("--watch-namespace={e_ns}"),
                format!("--plugin-cache-dir={}", shared_cache_dir().display()),
                format!("--plugin-ca-file={}", registry.ca_file().display()),
            ],
        },
    )
    .await
    .expect("operator");
    let backend = dir.path().join("backend");
    let file = "examples/transforms-oci/transform.yaml";
    let objects = fixtures::example(
        &path(file),
        &e_ns,
        &backend,
        &[
            (
                "registry.example.com/platform/plugins/default-tags",
                &repository,
            ),
            ("sha256:MANIFEST_DIGEST_FROM_PLUGIN_PUSH", &digest),
            ("sha256:MODULE_SHA256_FROM_PLUGIN_PUSH", &sha256),
            ("REPLACE_WITH_YOUR_COSIGN_PUBLIC_KEY", public_key.trim()),
        ],
    )
    .unwrap_or_else(|err| panic!("{file}: {err}"));
    fixtures::apply_all(plane.client(), &e_ns, &objects)
        .await
        .unwrap_or_else(|err| panic!("{file}: {err}"));

    let transforms: Api<ProgramTransform> = Api::namespaced(plane.client(), &e_ns);
    let loaded = wait_for("the transform to load", WAIT, || async {
        let status = transforms.get("default-tags").await.ok()?.status?;
        let ready = status
            .conditions
            .iter()
            .find(|c| c.type_ == "Ready" && c.status == "True")?;
        (ready.reason == "Loaded").then_some(status)
    })
    .await
    .unwrap_or_else(|err| {
        panic!("{err}\n{}\n{}", op.log_text(), registry.log_tail());
    });
    assert_eq!(loaded.digest.as_deref(), Some(sha256.as_str()));
    let programs: Api<Program> = Api::namespaced(plane.client(), &e_ns);
    let applied = wait_for("the transform in the artifact", WAIT, || async {
        let status = fixtures::status_of(&programs.get("labelled").await.ok()?);
        let applied = status["artifact"]["metadata"][METADATA_APPLIED].as_str()?;
        let applied: Vec<Value> = serde_json::from_str(applied).ok()?;
        (!applied.is_empty()).then_some(applied)
    })
    .await
    .unwrap_or_else(|err| panic!("{err}\n{}", op.log_text()));
    let names: Vec<&str> = applied
        .iter()
        .filter_map(|a| a["transform"].as_str())
        .collect();
    assert!(
        names.iter().any(|n| n.ends_with("default-tags")),
        "{applied:?}"
    );
}

/// `kubectl apply --dry-run=server -n namespace -f -` of `object`: (success, stdout and
/// stderr). A server-side dry run goes through admission every time (a plain apply of an
/// unchanged object sends nothing), so it can be repeated until a policy applies.
fn kubectl_apply(plane: &ControlPlane, namespace: &str, object: &Value) -> (bool, String) {
    use std::io::Write;
    let mut child = plane
        .kubectl()
        .args(["apply", "--dry-run=server", "-n", namespace, "-f", "-"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("kubectl");
    if let Some(mut stdin) = child.stdin.take() {
        stdin
            .write_all(object.to_string().as_bytes())
            .expect("kubectl stdin");
    }
    let out = child.wait_with_output().expect("kubectl output");
    (
        out.status.success(),
        format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        ),
    )
}

/// examples/tenancy-modes: the three policies on three namespaces of the test, under the
/// operator's webhook, and the example Workspace applied in each with kubectl (server-side dry
/// runs, see [`kubectl_apply`]): in the dryrun
/// one it is admitted silently and the violation is counted and logged, in the warn one it is
/// admitted with the violation as a kubectl warning, in the deny one it is refused with the
/// violation's message.
#[tokio::test]
async fn tenancy_modes_record_warn_and_refuse() {
    let _machine = pko_tests::serial::shared().await;
    let plane = ControlPlane::shared().await;
    let mut namespaces = Vec::new();
    for prefix in ["ex-sandbox", "ex-staging", "ex-production"] {
        namespaces.push(plane.namespace(prefix).await.expect("namespace"));
    }
    let (sandbox, staging, production) = (&namespaces[0], &namespaces[1], &namespaces[2]);
    let id = production.rsplit('-').next().unwrap_or("x").to_owned();
    let registration = Registration::create(plane, &format!("ex-{id}"), WebhookOptions::default())
        .await
        .expect("webhook configurations");
    for ns in &namespaces {
        registration.enroll(plane, ns, &[]).await.expect("enroll");
    }
    let mut args = registration.operator_args(&policy_bundle().expect("policy bundle"));
    args.push(format!("--watch-namespace={production}"));
    let op = Operator::start(
        plane,
        OperatorOptions {
            advertised: None,
            args,
        },
    )
    .await
    .expect("operator");
    registration
        .wait_ca_injected(plane, WAIT)
        .await
        .expect("CA bundle injected");

    let backend = std::env::temp_dir();
    let policies = fixtures::example(
        &path("examples/tenancy-modes/policies.yaml"),
        production,
        &backend,
        &[
            ("sandbox", sandbox),
            ("staging", staging),
            ("production", production),
        ],
    )
    .expect("policies");
    let actions: Vec<&str> = policies
        .iter()
        .filter_map(|p| p["spec"]["enforcementAction"].as_str())
        .collect();
    assert_eq!(actions, ["dryrun", "warn", "deny"]);
    fixtures::apply_all(plane.client(), production, &policies)
        .await
        .expect("apply policies");
    let workspace = |ns: &str| {
        fixtures::example(
            &path("examples/tenancy-modes/workspace.yaml"),
            ns,
            &backend,
            &[],
        )
        .expect("workspace")
        .remove(0)
    };
    let image = workspace(sandbox)["spec"]["image"]
        .as_str()
        .expect("image")
        .to_owned();

    // deny: refused, saying which image, where, and under which policy. Policies apply
    // through a watch: polled until they do.
    let refusal = wait_for("production to refuse", WAIT, || async {
        let (ok, text) = kubectl_apply(plane, production, &workspace(production));
        (!ok && text.contains("[isolation/image]")).then_some(text)
    })
    .await
    .unwrap_or_else(|e| panic!("{e}\n{}", op.log_text()));
    assert!(
        refusal.contains("denied the request")
            && refusal.contains(&format!(
                "image {image} is not allowed in namespace {production}"
            )),
        "{refusal}"
    );

    // warn: admitted, with the violation as a warning.
    let warned = wait_for("staging to warn", WAIT, || async {
        let (ok, text) = kubectl_apply(plane, staging, &workspace(staging));
        (ok && text.contains("Warning:")).then_some(text)
    })
    .await
    .unwrap_or_else(|e| panic!("{e}\n{}", op.log_text()));
    assert!(
        warned.contains("[isolation/image]") && warned.contains(&image),
        "{warned}"
    );

    // dryrun: admitted without a word to the client, counted and logged.
    let series =
        "pko_admission_violations_total{policy=\"isolation\",code=\"image\",action=\"dryrun\"}";
    // (Before the operator has seen the sandbox policy, no image list applies there: admitted
    // and not counted; polled until counted.)
    let admitted = wait_for("sandbox to admit and count", WAIT, || async {
        let (ok, text) = kubectl_apply(plane, sandbox, &workspace(sandbox));
        let counted = op.metric(series).await.unwrap_or(0.0) >= 1.0;
        (ok && counted).then_some(text)
    })
    .await
    .unwrap_or_else(|e| {
        panic!("{e}\n{}", op.log_text());
    });
    assert!(!admitted.contains("Warning"), "{admitted}");
    assert!(
        op.log_text().contains("dryrun violation (admitted)"),
        "{}",
        op.log_text()
    );

    let api = Api::<kube::api::DynamicObject>::all_with(
        plane.client(),
        &kube::core::ApiResource::from_gvk_with_plural(
            &kube::core::GroupVersionKind::gvk("pko-rs.dev", "v1alpha1", "TenancyPolicy"),
            "tenancypolicies",
        ),
    );
    for policy in &policies {
        if let Some(name) = policy["metadata"]["name"].as_str() {
            let _ = api.delete(name, &Default::default()).await;
        }
    }
    registration.remove(plane).await;
}

/// examples/stack-prerequisites, applied without the prerequisite's Stack first: `app` waits
/// (Reconciling, PrerequisiteNotSatisfied, naming `network`) and runs nothing. Once the
/// `network` Stack is applied and has succeeded, `app` runs and deploys.
#[tokio::test]
async fn a_stack_runs_only_after_its_prerequisite_succeeded() {
    let _machine = pko_tests::serial::shared().await;
    let e = Execution::start("ex-prereq", &[]).await;
    let file = "examples/stack-prerequisites/stacks.yaml";
    let is_network_stack = |o: &Value| o["kind"] == "Stack" && o["metadata"]["name"] == "network";
    let objects = apply_example(&e, file, &[], is_network_stack).await;
    let app = objects
        .iter()
        .find(|o| o["kind"] == "Stack" && o["metadata"]["name"] == "app")
        .expect("the app Stack");
    assert_eq!(app["spec"]["prerequisites"][0]["name"], "network");

    let stacks: Api<Stack> = Api::namespaced(e.plane.client(), &e.ns);
    let waiting = wait_for("app to wait for network", WAIT, || async {
        let status = stacks.get("app").await.ok()?.status?;
        status
            .conditions
            .iter()
            .find(|c| {
                c.type_ == "Reconciling"
                    && c.status == "True"
                    && c.reason == "PrerequisiteNotSatisfied"
            })
            .map(|c| c.message.clone())
    })
    .await
    .unwrap_or_else(|err| panic!("{err}\n{}", e.operator.log_text()));
    assert!(waiting.contains("network"), "{waiting}");
    let updates: Api<Update> = Api::namespaced(e.plane.client(), &e.ns);
    let of_app = || async {
        updates
            .list(&ListParams::default().labels("pulumi.com/stack-name=app"))
            .await
            .expect("updates")
            .items
    };
    assert!(of_app().await.is_empty(), "app ran before its prerequisite");

    let network: Vec<Value> = objects.into_iter().filter(is_network_stack).collect();
    fixtures::apply_all(e.plane.client(), &e.ns, &network)
        .await
        .expect("the network Stack");
    deployed(&e, "network", "subnet", &json!("10.0.1.0/24")).await;
    deployed(&e, "app", "message", &json!("deployed after the network")).await;
    assert!(!of_app().await.is_empty());
}
