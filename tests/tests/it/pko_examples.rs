//! PKO's own example and e2e manifests (`tests/fixtures/pko-v2.9-examples`) run on the real
//! control plane with the harness as kubelet, the real agent and the real pulumi CLI, offline.
//!
//! [`EXAMPLES`] says of every fixture file whether it runs here (and which test runs it) or why
//! it cannot run offline; `docs/execution.md` ("PKO's examples") carries the same table and
//! [`every_example_is_classified_and_documented`] keeps the three in step.
//!
//! A runnable file is applied as it is, through [`fixtures::localized`]: its objects move to the
//! test's namespace (the harness kubelet and operator serve one each) and a `file:///state/`
//! backend literal points at the test's backend folder (the harness runs pods as host
//! processes); nothing else changes.

use std::time::Duration;

use kube::Api;
use pko_api::program::Program;
use pko_api::stack::{Stack, StackStatus};
use pko_api::workspace::Workspace;
use pko_tests::execution::Execution;
use pko_tests::{fixtures, repo_root, wait_for};
use serde_json::{Value, json};

const WAIT: Duration = Duration::from_secs(180);
const DIR: &str = "tests/fixtures/pko-v2.9-examples";

/// What a fixture file does here.
#[derive(Debug, Clone, Copy)]
enum Outcome {
    /// The test of that name applies it and waits for Ready.
    Runs(&'static str),
    /// Its Programs get artifacts (the test of that name), but its Stacks cannot run: why.
    ProgramOnly(&'static str, &'static str),
    /// It cannot run offline: why.
    Offline(&'static str),
}

use Outcome::{Offline, ProgramOnly, Runs};

const EXAMPLES_REPO: &str = "clones github.com/pulumi/examples, of which nothing is offline \
                             (PKO's source tarball holds no copy)";
const RANDOM: &str = "its program needs the random provider, which the tools cache lacks (a \
                      Terraform-bridged provider: building it from Go modules takes far longer \
                      than the 3 minutes a provider build may add)";
const S3_REPO: &str = "clones github.com/joeduffy/test-s3-op-project (not offline) and creates \
                       AWS S3 resources with AWS credentials on a Pulumi Cloud stack";

/// Every fixture file, and what it does here.
const EXAMPLES: &[(&str, Outcome)] = &[
    (
        "examples_custom-source_stack.yaml",
        Offline(
            "runs a user-built image (localhost:5000/pulumi-and-app) with a Python program \
             baked in (no Python language host here) on a Pulumi Cloud stack",
        ),
    ),
    (
        "examples_custom-workspace_workspace.yaml",
        Offline(
            "clones github.com/pulumi/examples (random-yaml: random provider) and logs in to \
             Pulumi Cloud with an OIDC token",
        ),
    ),
    (
        "examples_flux-source_repository.yaml",
        Offline(
            "a Flux GitRepository of github.com/pulumi/examples: no source-controller and no \
             copy of that repository offline",
        ),
    ),
    ("examples_flux-source_stack.yaml", Offline(EXAMPLES_REPO)),
    ("examples_git-source_stack.yaml", Offline(EXAMPLES_REPO)),
    (
        "examples_preview-demo_stack.yaml",
        ProgramOnly(
            "example_programs_get_artifacts",
            "its program deploys an nginx:1.27-alpine Deployment, which the Kubernetes \
             provider waits to become available: that needs a controller-manager and the \
             nginx image, neither offline; the preview Stack waits on that one",
        ),
    ),
    (
        "examples_program-source_program.yaml",
        ProgramOnly("example_programs_get_artifacts", RANDOM),
    ),
    ("examples_program-source_stack.yaml", Offline(RANDOM)),
    (
        "examples_structured-config_configmap-config.yaml",
        Offline(
            "clones aws-ts-s3-folder from github.com/pulumi/examples, a TypeScript program \
             (no Node.js language host here) using AWS, on a Pulumi Cloud stack",
        ),
    ),
    (
        "examples_structured-config_inline-config.yaml",
        Offline(
            "clones aws-ts-s3-folder from github.com/pulumi/examples, a TypeScript program \
             (no Node.js language host here) using AWS, on a Pulumi Cloud stack",
        ),
    ),
    (
        "operator_e2e_testdata_git-auth-nonroot_manifests.yaml",
        Offline(
            "clones github.com/pulumi/fixtures with a GitHub token ($PULUMI_BOT_TOKEN): not \
             offline",
        ),
    ),
    (
        "operator_e2e_testdata_issue-801_manifests.yaml",
        Offline(
            "its point is an image that cannot be pulled, and the harness kubelet runs every \
             image with the same binaries (no pull can fail); it also clones \
             github.com/pulumi/examples",
        ),
    ),
    (
        "operator_e2e_testdata_issue-801_step2_manifests.yaml",
        Offline(EXAMPLES_REPO),
    ),
    (
        "operator_e2e_testdata_issue-937_manifests.yaml",
        Offline(EXAMPLES_REPO),
    ),
    (
        "operator_e2e_testdata_random-yaml-auth-error_manifests.yaml",
        Offline(
            "a Flux GitRepository of github.com/pulumi/examples: no source-controller and no \
             copy of that repository offline, so the Stack never gets the source its \
             Workspace would fail to authenticate with",
        ),
    ),
    (
        "operator_e2e_testdata_random-yaml-nonroot_manifests.yaml",
        Offline(EXAMPLES_REPO),
    ),
    (
        "operator_e2e_testdata_structured-config-version_manifests.yaml",
        Runs("structured_config_version_runs_to_ready"),
    ),
    (
        "operator_e2e_testdata_structured-config-version_step2_manifests.yaml",
        Runs("structured_config_version_runs_to_ready"),
    ),
    (
        "operator_e2e_testdata_structured-config_manifests.yaml",
        Runs("structured_config_runs_to_ready"),
    ),
    (
        "operator_e2e_testdata_targets_manifests.yaml",
        Offline(RANDOM),
    ),
    (
        "stack-examples_yaml_ext_s3_bucket_stack.yaml",
        Offline(S3_REPO),
    ),
    (
        "stack-examples_yaml_git_auth_with_references.yaml",
        Offline(
            "a template: its repository (https://...private-repo.git), commit and stack are \
             placeholders, and its Secret is not valid YAML",
        ),
    ),
    (
        "stack-examples_yaml_nginx_k8s_stack.yaml",
        Offline(
            "clones kubernetes-ts-nginx from github.com/pulumi/examples, a TypeScript program \
             (no Node.js language host here), on a Pulumi Cloud stack",
        ),
    ),
    ("stack-examples_yaml_s3_bucket_stack.yaml", Offline(S3_REPO)),
    (
        "stack-examples_yaml_s3_bucket_stack_access_token.yaml",
        Offline(S3_REPO),
    ),
    (
        "stack-examples_yaml_s3_bucket_stack_basic_auth.yaml",
        Offline(S3_REPO),
    ),
    (
        "stack-examples_yaml_s3_bucket_stack_ssh.yaml",
        Offline(S3_REPO),
    ),
    (
        "stack-examples_yaml_s3backend_nginx_k8s_stack.yaml",
        Offline(
            "keeps its state in S3 (s3:// backend) with an AWS KMS secrets provider, and clones \
             kubernetes-ts-nginx (TypeScript) from github.com/pulumi/examples",
        ),
    ),
    (
        "stack-examples_yaml_s3backend_s3_bucket_stack.yaml",
        Offline(
            "keeps its state in S3 (s3:// backend) with an AWS KMS secrets provider, and clones \
             github.com/joeduffy/test-s3-op-project (AWS)",
        ),
    ),
];

/// The table covers every fixture file and only those, and `docs/execution.md` names each file
/// with its test (or says it cannot run offline).
#[test]
fn every_example_is_classified_and_documented() {
    let mut files: Vec<String> = std::fs::read_dir(repo_root().join(DIR))
        .expect("examples dir")
        .map(|e| e.expect("entry").file_name().to_string_lossy().into_owned())
        .filter(|name| name.ends_with(".yaml"))
        .collect();
    files.sort();
    let listed: Vec<String> = EXAMPLES.iter().map(|(f, _)| (*f).to_owned()).collect();
    assert_eq!(
        listed, files,
        "EXAMPLES lists exactly the fixture files, sorted"
    );

    let doc = std::fs::read_to_string(repo_root().join("docs/execution.md")).expect("docs");
    let section = doc
        .split("## PKO's examples")
        .nth(1)
        .expect("docs/execution.md has a \"PKO's examples\" section");
    for (file, outcome) in EXAMPLES {
        let row = section
            .lines()
            .find(|l| l.starts_with(&format!("| `{file}`")))
            .unwrap_or_else(|| panic!("no row for {file} in docs/execution.md"));
        let (expected, why) = match outcome {
            Runs(test) => (format!("`pko_examples::{test}`"), "runs"),
            ProgramOnly(test, why) => (format!("`pko_examples::{test}`"), *why),
            Offline(why) => ("cannot run offline".to_owned(), *why),
        };
        assert!(!why.is_empty(), "{file}: say why it cannot run");
        assert!(
            row.contains(&expected),
            "{file}: {row:?} lacks {expected:?}"
        );
    }
}

/// A started execution with the objects of `files` (in order) applied: the environment.
async fn applied(prefix: &str, files: &[&str]) -> Execution {
    let e = Execution::start(prefix, &[]).await;
    let backend = e.tmp.path().join("backend");
    for file in files {
        let objects: Vec<Value> = fixtures::manifest(&repo_root().join(DIR).join(file))
            .expect("manifest")
            .into_iter()
            .filter_map(|o| fixtures::localized(o, &e.ns, &backend))
            .collect();
        fixtures::apply_all(e.plane.client(), &e.ns, &objects)
            .await
            .unwrap_or_else(|err| panic!("{file}: {err}"));
    }
    e
}

/// Waits for Stack `name` of `e` to be Ready at its current generation, its Program `program`
/// to have an artifact and its Workspace to be Ready; the Stack's status, or a panic with the
/// pod's and operator's logs.
async fn ready(e: &Execution, name: &str, program: &str) -> StackStatus {
    let stacks: Api<Stack> = Api::namespaced(e.plane.client(), &e.ns);
    let generation = stacks
        .get(name)
        .await
        .expect("stack")
        .metadata
        .generation
        .expect("generation");
    let status = match fixtures::ready_stack(&stacks, name, generation, WAIT).await {
        Ok(status) => status,
        Err(err) => panic!(
            "{err}: {:?}\n{}\n{}",
            stacks.get(name).await.ok().and_then(|s| s.status),
            e.kubelet.logs(name),
            e.operator.log_text()
        ),
    };
    let programs: Api<Program> = Api::namespaced(e.plane.client(), &e.ns);
    let artifact = fixtures::status_of(&programs.get(program).await.expect("program"));
    assert!(
        artifact["artifact"]["url"].is_string(),
        "Program {program} has no artifact: {artifact}"
    );
    let workspaces: Api<Workspace> = Api::namespaced(e.plane.client(), &e.ns);
    fixtures::ready_workspace(&workspaces, name, WAIT, || e.kubelet.logs(name)).await;
    status
}

fn output<'a>(status: &'a StackStatus, key: &str) -> &'a Value {
    status
        .outputs
        .get(key)
        .unwrap_or_else(|| panic!("no output {key}: {:?}", status.outputs))
}

/// PKO's structured-config e2e: inline objects, arrays, numbers and booleans and a ConfigMap's
/// JSON and text reach the program as typed config (the program outputs them).
#[tokio::test]
async fn structured_config_runs_to_ready() {
    let _machine = pko_tests::serial::shared().await;
    let e = applied(
        "pko-ex-structured",
        &["operator_e2e_testdata_structured-config_manifests.yaml"],
    )
    .await;
    let status = ready(&e, "structured-config", "structured-config").await;
    assert_eq!(output(&status, "simpleString"), &json!("hello-world"));
    assert_eq!(
        output(&status, "databaseConfig"),
        &json!({"host": "db.example.com", "port": 5432, "database": "myapp", "ssl": true,
                "maxConnections": 100})
    );
    assert_eq!(
        output(&status, "allowedRegions"),
        &json!(["us-west-2", "us-east-1", "eu-west-1"])
    );
    assert_eq!(output(&status, "maxRetries"), &json!(3));
    assert_eq!(output(&status, "timeout"), &json!(30.5));
    assert_eq!(output(&status, "enableCaching"), &json!(true));
    assert_eq!(output(&status, "debugMode"), &json!(false));
    let oauth = output(&status, "oauth");
    assert_eq!(oauth["clientId"], "my-client-id");
    assert_eq!(oauth["scopes"], json!(["read", "write"]));
    assert_eq!(
        oauth["endpoints"]["authorize"],
        "https://auth.example.com/authorize"
    );
    let settings = output(&status, "appSettings");
    assert_eq!(settings["apiEndpoint"], "https://api.example.com");
    assert_eq!(settings["timeout"], json!(30));
    assert_eq!(settings["retryEnabled"], json!(true));
    assert_eq!(
        settings["features"],
        json!({"authentication": true, "rateLimit": 1000})
    );
    assert_eq!(settings["regions"], json!(["us-west-1", "us-east-1"]));
    assert_eq!(output(&status, "appVersion"), &json!("v1.2.3"));
}

/// PKO's structured-config-version e2e, both steps applied in turn: the Stack is Ready at the
/// second step's generation with the structured config as outputs. The first step's stall
/// (an image older than v3.202.0) is not played: the harness runs one pulumi CLI for every
/// image tag, and the agent reports that CLI's version.
#[tokio::test]
async fn structured_config_version_runs_to_ready() {
    let _machine = pko_tests::serial::shared().await;
    let e = applied(
        "pko-ex-cfgversion",
        &[
            "operator_e2e_testdata_structured-config-version_manifests.yaml",
            "operator_e2e_testdata_structured-config-version_step2_manifests.yaml",
        ],
    )
    .await;
    let stacks: Api<Stack> = Api::namespaced(e.plane.client(), &e.ns);
    let stack = stacks
        .get("structured-config-version")
        .await
        .expect("stack");
    let image = stack
        .spec
        .workspace_template
        .as_ref()
        .and_then(|t| serde_json::to_value(t).ok())
        .map(|t| t["spec"]["image"].clone());
    assert_eq!(
        image,
        Some(json!("pulumi/pulumi:3.202.0-nonroot")),
        "step 2 applied"
    );
    let status = ready(&e, "structured-config-version", "structured-config-version").await;
    assert_eq!(
        output(&status, "databaseConfig"),
        &json!({"host": "localhost", "port": 5432})
    );
    assert_eq!(
        output(&status, "regions"),
        &json!(["us-west-2", "us-east-1"])
    );
}

/// The Programs of the examples whose Stacks cannot run offline still get artifacts (the
/// operator publishes a Program whatever its providers).
#[tokio::test]
async fn example_programs_get_artifacts() {
    let _machine = pko_tests::serial::shared().await;
    let files: Vec<&str> = EXAMPLES
        .iter()
        .filter(|(_, o)| matches!(o, ProgramOnly(..)))
        .map(|(f, _)| *f)
        .collect();
    let e = Execution::start("pko-ex-programs", &[]).await;
    let backend = e.tmp.path().join("backend");
    let mut names = Vec::new();
    for file in &files {
        let programs: Vec<Value> = fixtures::manifest(&repo_root().join(DIR).join(file))
            .expect("manifest")
            .into_iter()
            .filter(|o| o["kind"] == "Program")
            .filter_map(|o| fixtures::localized(o, &e.ns, &backend))
            .collect();
        names.extend(
            programs
                .iter()
                .filter_map(|p| p["metadata"]["name"].as_str().map(str::to_owned)),
        );
        fixtures::apply_all(e.plane.client(), &e.ns, &programs)
            .await
            .unwrap_or_else(|err| panic!("{file}: {err}"));
    }
    assert_eq!(names.len(), files.len(), "one Program per file: {names:?}");
    let programs: Api<Program> = Api::namespaced(e.plane.client(), &e.ns);
    for name in names {
        wait_for(&format!("the artifact of Program {name}"), WAIT, || async {
            let status = fixtures::status_of(&programs.get(&name).await.ok()?);
            status["artifact"]["url"].as_str().map(str::to_owned)
        })
        .await
        .unwrap_or_else(|err| panic!("{err}\n{}", e.operator.log_text()));
    }
}
