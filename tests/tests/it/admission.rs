//! The admission webhook on the real control plane: the real kube-apiserver calls the real
//! operator binary over TLS (`clientConfig.url` on loopback, CA bundle injected by the
//! operator) for two tenant namespaces.
//!
//! Every test registers its own webhook configurations, scoped to its own namespaces, and its
//! own operator process. Every rule has an allowed and a denied case here; the rules themselves
//! are specified in `policies/*_test.rego`.

use std::collections::BTreeMap;
use std::io::Write;
use std::process::Stdio;
use std::time::Duration;

use k8s_openapi::api::core::v1::Secret;
use kube::api::{Api, DeleteParams, DynamicObject, Patch, PatchParams, PostParams};
use kube::core::{ApiResource, GroupVersionKind};
use pko_tests::operator::{Operator, OperatorOptions};
use pko_tests::webhook::{Registration, WebhookOptions, policy_bundle, set_namespace_labels};
use pko_tests::{ControlPlane, wait_for};
use serde_json::{Value, json};

const WAIT: Duration = Duration::from_secs(60);
const TENANT_LABEL: &str = "pko-tests.tenant";
const DIGEST_OK: &str = "sha256:1111111111111111111111111111111111111111111111111111111111111111";
const DIGEST_OTHER: &str = "2222222222222222222222222222222222222222222222222222222222222222";

/// Two tenant namespaces served by one operator's webhook.
struct Env {
    plane: &'static ControlPlane,
    id: String,
    a: String,
    b: String,
    registration: Registration,
    operator: Operator,
}

impl Env {
    async fn start(options: WebhookOptions, extra_args: &[&str]) -> Env {
        let plane = ControlPlane::shared().await;
        let a = plane.namespace("tenant-a").await.expect("namespace a");
        let b = plane.namespace("tenant-b").await.expect("namespace b");
        // The random suffix of the first namespace names this registration.
        let id = a.rsplit('-').next().unwrap_or("x").to_owned();
        let registration = Registration::create(plane, &id, options)
            .await
            .expect("webhook configurations");
        registration.enroll(plane, &a, &[]).await.expect("enroll a");
        registration
            .enroll(plane, &b, &[(TENANT_LABEL, &format!("b-{id}"))])
            .await
            .expect("enroll b");
        let bundle = policy_bundle().expect("policy bundle");
        let mut args = registration.operator_args(&bundle);
        args.push(format!("--watch-namespace={a}"));
        args.extend(extra_args.iter().map(|s| (*s).to_owned()));
        let operator = Operator::start(
            plane,
            OperatorOptions {
                advertised: None,
                args,
            },
        )
        .await
        .expect("operator starts");
        registration
            .wait_ca_injected(plane, WAIT)
            .await
            .expect("CA bundle injected");
        let env = Env {
            plane,
            id,
            a,
            b,
            registration,
            operator,
        };
        // The apiserver picks up webhook configurations asynchronously: wait until a request
        // that only our webhook refuses is refused.
        let ns = env.a.clone();
        wait_for("the apiserver to call the webhook", WAIT, || {
            let env = &env;
            let ns = ns.clone();
            async move {
                let probe = workspace("probe", json!({"securityProfile": "baseline"}));
                match env.try_create(&ns, &probe, true).await {
                    Err(message) if message.contains("pko-rs") => Some(()),
                    _ => None,
                }
            }
        })
        .await
        .unwrap_or_else(|e| panic!("{e}; operator log:\n{}", env.operator.log_text()));
        env
    }

    fn client(&self) -> kube::Client {
        self.plane.client()
    }

    /// Creates `object` in `namespace` (server-side dry run if `dry_run`); the error is the
    /// apiserver's message.
    async fn try_create(
        &self,
        namespace: &str,
        object: &Value,
        dry_run: bool,
    ) -> Result<DynamicObject, String> {
        let api = dynamic_api(self.client(), namespace, object);
        let obj: DynamicObject =
            serde_json::from_value(object.clone()).map_err(|e| format!("bad fixture: {e}"))?;
        let params = PostParams {
            dry_run,
            ..PostParams::default()
        };
        api.create(&params, &obj).await.map_err(|e| match e {
            kube::Error::Api(status) => status.message,
            other => other.to_string(),
        })
    }

    async fn allowed(&self, namespace: &str, object: &Value) -> DynamicObject {
        match self.try_create(namespace, object, false).await {
            Ok(created) => created,
            Err(message) => panic!(
                "{} {} in {namespace} should be admitted, got: {message}",
                object["kind"], object["metadata"]["name"]
            ),
        }
    }

    /// Asserts that creating `object` is refused by our webhook and that the message names
    /// the rule and the field path.
    async fn denied(&self, namespace: &str, object: &Value, rule: &str, path: &str) -> String {
        match self.try_create(namespace, object, false).await {
            Ok(_) => panic!(
                "{} {} in {namespace} should be denied by {rule} at {path}",
                object["kind"], object["metadata"]["name"]
            ),
            Err(message) => {
                assert!(
                    message
                        .contains("admission webhook \"validate.pko-rs.dev\" denied the request"),
                    "not denied by our webhook: {message}"
                );
                assert!(
                    message.contains(&format!("[{rule}]")) && message.contains(path),
                    "expected [{rule}] at {path} in: {message}"
                );
                message
            }
        }
    }

    /// Server-side dry-run outcome, polled until `expect` holds (tenancy changes apply
    /// through a watch, within milliseconds).
    async fn eventually(&self, what: &str, namespace: &str, object: &Value, expect: Expect) {
        wait_for(what, WAIT, || async {
            let result = self.try_create(namespace, object, true).await;
            let ok = match (&expect, &result) {
                (Expect::Allowed, Ok(_)) => true,
                (Expect::DeniedBy(rule), Err(m)) => m.contains(&format!("[{rule}]")),
                _ => false,
            };
            ok.then_some(())
        })
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    }

    async fn apply_tenancy(&self, name: &str, spec: Value) {
        let api = Api::<DynamicObject>::all_with(self.client(), &tenancy_resource());
        let object: DynamicObject = serde_json::from_value(json!({
            "apiVersion": "pko-rs.dev/v1alpha1",
            "kind": "TenancyPolicy",
            "metadata": {"name": name},
            "spec": spec,
        }))
        .expect("TenancyPolicy");
        api.patch(
            name,
            &PatchParams::apply("pko-tests").force(),
            &Patch::Apply(&object),
        )
        .await
        .unwrap_or_else(|e| panic!("applying TenancyPolicy {name}: {e}"));
    }

    async fn cleanup(&self) {
        let api = Api::<DynamicObject>::all_with(self.client(), &tenancy_resource());
        for suffix in ["a", "b", "images"] {
            let _ = api
                .delete(&format!("{}-{suffix}", self.id), &DeleteParams::default())
                .await;
        }
        self.registration.remove(self.plane).await;
    }

    /// `kubectl create --dry-run=server` of `object`: (success, stderr).
    fn kubectl_create(&self, namespace: &str, object: &Value) -> (bool, String) {
        let mut child = self
            .plane
            .kubectl()
            .args(["create", "--dry-run=server", "-n", namespace, "-f", "-"])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("kubectl runs");
        if let Some(mut stdin) = child.stdin.take() {
            stdin
                .write_all(object.to_string().as_bytes())
                .expect("kubectl stdin");
        }
        let out = child.wait_with_output().expect("kubectl output");
        (
            out.status.success(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    }

    async fn metric(&self, series: &str) -> f64 {
        self.operator.metric(series).await.unwrap_or(0.0)
    }
}

enum Expect {
    Allowed,
    DeniedBy(&'static str),
}

fn tenancy_resource() -> ApiResource {
    ApiResource::from_gvk_with_plural(
        &GroupVersionKind::gvk("pko-rs.dev", "v1alpha1", "TenancyPolicy"),
        "tenancypolicies",
    )
}

fn dynamic_api(client: kube::Client, namespace: &str, object: &Value) -> Api<DynamicObject> {
    let api_version = object["apiVersion"].as_str().unwrap_or_default();
    let (group, version) = api_version.split_once('/').unwrap_or(("", api_version));
    let kind = object["kind"].as_str().unwrap_or_default();
    let plural = match kind {
        "Workspace" => "workspaces",
        "Stack" => "stacks",
        "ProgramTransform" => "programtransforms",
        "Program" => "programs",
        other => panic!("no plural for {other}"),
    };
    let resource =
        ApiResource::from_gvk_with_plural(&GroupVersionKind::gvk(group, version, kind), plural);
    Api::namespaced_with(client, namespace, &resource)
}

fn workspace(name: &str, spec: Value) -> Value {
    json!({
        "apiVersion": "auto.pulumi.com/v1alpha1",
        "kind": "Workspace",
        "metadata": {"name": name},
        "spec": spec,
    })
}

fn stack(name: &str, spec: Value) -> Value {
    let mut full = json!({"stack": "dev"});
    if let (Some(full), Value::Object(extra)) = (full.as_object_mut(), spec) {
        full.extend(extra);
    }
    json!({
        "apiVersion": "pulumi.com/v1",
        "kind": "Stack",
        "metadata": {"name": name},
        "spec": full,
    })
}

fn transform(name: &str, sha256: &str) -> Value {
    json!({
        "apiVersion": "pko-rs.dev/v1alpha1",
        "kind": "ProgramTransform",
        "metadata": {"name": name},
        "spec": {"source": {"configMap": {"name": "modules", "key": "tags.wasm"}}, "sha256": sha256},
    })
}

/// A P-256 public key as `cosign generate-key-pair` writes it.
const PLUGIN_KEY: &str = "-----BEGIN PUBLIC KEY-----\nMFkwEwYHKoZIzj0CAQYIKoZIzj0DAQcDQgAEqj9RNIZ00Bm+g8JOWNI9jk8U1L3S\nkdvDTfkCNxpe9wR32hA7chX98gqgBuJN/XSsV58AOQr+yz/I5oxUkJrTwA==\n-----END PUBLIC KEY-----\n";

fn oci_transform(name: &str, reference: &str) -> Value {
    json!({
        "apiVersion": "pko-rs.dev/v1alpha1",
        "kind": "ProgramTransform",
        "metadata": {"name": name},
        "spec": {
            "source": {"oci": {"reference": reference, "digest": format!("sha256:{}", "2".repeat(64))}},
            "sha256": DIGEST_OTHER,
            "verify": {"cosign": {"keys": [PLUGIN_KEY]}},
        },
    })
}

fn good_pod() -> Value {
    json!({
        "securityContext": {"runAsNonRoot": true, "seccompProfile": {"type": "RuntimeDefault"}},
        "containers": [{
            "name": "pulumi",
            "securityContext": {"allowPrivilegeEscalation": false, "capabilities": {"drop": ["ALL"]}},
        }],
    })
}

/// `value` with the JSON pointer `pointer` set to `new`, creating objects on the way.
fn with(mut value: Value, pointer: &str, new: Value) -> Value {
    let mut target = &mut value;
    let parts: Vec<&str> = pointer.trim_start_matches('/').split('/').collect();
    for (i, part) in parts.iter().enumerate() {
        let last = i + 1 == parts.len();
        target = match target {
            Value::Array(items) => {
                let index: usize = part.parse().expect("array index");
                &mut items[index]
            }
            other => {
                if !other.is_object() {
                    *other = json!({});
                }
                let map = other.as_object_mut().expect("object");
                if last {
                    map.insert((*part).to_owned(), new);
                    return value;
                }
                map.entry((*part).to_owned()).or_insert_with(|| json!({}))
            }
        };
        if last {
            *target = new;
            return value;
        }
    }
    value
}

fn pod_workspace(name: &str, pod: Value) -> Value {
    workspace(name, json!({"podTemplate": {"spec": pod}}))
}

#[tokio::test]
async fn restricted_rules_on_the_real_apiserver() {
    let _machine = pko_tests::serial::shared().await;
    let env = Env::start(WebhookOptions::default(), &[]).await;
    let (a, b) = (env.a.clone(), env.b.clone());
    // Tenant b is exempt from the restricted policy, selected by its label.
    env.apply_tenancy(
        &format!("{}-b", env.id),
        json!({
            "namespaceSelector": {"matchLabels": {TENANT_LABEL: format!("b-{}", env.id)}},
            "exemptFromRestricted": true,
        }),
    )
    .await;
    let pod = good_pod();
    let p = "spec.podTemplate.spec";

    env.allowed(&a, &pod_workspace("compliant", pod.clone()))
        .await;
    env.allowed(&a, &workspace("no-template", json!({}))).await;

    // baseline-profile
    env.denied(
        &a,
        &workspace("baseline", json!({"securityProfile": "baseline"})),
        "restricted/baseline-profile",
        "spec.securityProfile",
    )
    .await;
    env.eventually(
        "the exemption of tenant b",
        &b,
        &workspace("baseline", json!({"securityProfile": "baseline"})),
        Expect::Allowed,
    )
    .await;
    env.allowed(
        &b,
        &workspace("baseline", json!({"securityProfile": "baseline"})),
    )
    .await;

    // run-as-non-root
    env.denied(
        &a,
        &pod_workspace(
            "non-root-false",
            with(pod.clone(), "/securityContext/runAsNonRoot", json!(false)),
        ),
        "restricted/run-as-non-root",
        &format!("{p}.securityContext.runAsNonRoot"),
    )
    .await;
    env.allowed(
        &a,
        &pod_workspace(
            "non-root-in-container",
            with(
                with(
                    pod.clone(),
                    "/securityContext",
                    json!({"seccompProfile": {"type": "RuntimeDefault"}}),
                ),
                "/containers/0/securityContext/runAsNonRoot",
                json!(true),
            ),
        ),
    )
    .await;

    // run-as-user-root
    env.denied(
        &a,
        &pod_workspace(
            "root-user",
            with(pod.clone(), "/securityContext/runAsUser", json!(0)),
        ),
        "restricted/run-as-user-root",
        &format!("{p}.securityContext.runAsUser"),
    )
    .await;
    env.allowed(
        &a,
        &pod_workspace(
            "user-1000",
            with(pod.clone(), "/securityContext/runAsUser", json!(1000)),
        ),
    )
    .await;

    // privilege-escalation (init containers too)
    let mut escalating = pod.clone();
    escalating["initContainers"] = json!([{
        "name": "fetch",
        "securityContext": {"allowPrivilegeEscalation": true, "capabilities": {"drop": ["ALL"]}},
    }]);
    env.denied(
        &a,
        &pod_workspace("escalation", escalating),
        "restricted/privilege-escalation",
        &format!("{p}.initContainers[0].securityContext.allowPrivilegeEscalation"),
    )
    .await;
    let mut init_ok = pod.clone();
    init_ok["initContainers"] = json!([{"name": "fetch"}]);
    env.allowed(&a, &pod_workspace("init-defaulted", init_ok))
        .await;

    // privileged
    env.denied(
        &a,
        &pod_workspace(
            "privileged",
            with(
                pod.clone(),
                "/containers/0/securityContext/privileged",
                json!(true),
            ),
        ),
        "restricted/privileged",
        &format!("{p}.containers[0].securityContext.privileged"),
    )
    .await;
    env.allowed(
        &a,
        &pod_workspace(
            "not-privileged",
            with(
                pod.clone(),
                "/containers/0/securityContext/privileged",
                json!(false),
            ),
        ),
    )
    .await;

    // capabilities
    env.denied(
        &a,
        &pod_workspace(
            "sys-admin",
            with(
                pod.clone(),
                "/containers/0/securityContext/capabilities/add",
                json!(["SYS_ADMIN"]),
            ),
        ),
        "restricted/capabilities",
        &format!("{p}.containers[0].securityContext.capabilities.add[0]"),
    )
    .await;
    env.allowed(
        &a,
        &pod_workspace(
            "bind-service",
            with(
                pod.clone(),
                "/containers/0/securityContext/capabilities/add",
                json!(["NET_BIND_SERVICE"]),
            ),
        ),
    )
    .await;

    // seccomp
    env.denied(
        &a,
        &pod_workspace(
            "unconfined",
            with(
                pod.clone(),
                "/securityContext/seccompProfile/type",
                json!("Unconfined"),
            ),
        ),
        "restricted/seccomp",
        &format!("{p}.securityContext.seccompProfile.type"),
    )
    .await;
    env.allowed(
        &a,
        &pod_workspace(
            "localhost-profile",
            with(
                pod.clone(),
                "/securityContext/seccompProfile",
                json!({"type": "Localhost", "localhostProfile": "profiles/pulumi.json"}),
            ),
        ),
    )
    .await;

    // host-path
    env.denied(
        &a,
        &pod_workspace(
            "host-path",
            with(
                pod.clone(),
                "/volumes",
                json!([{"name": "sock", "hostPath": {"path": "/var/run/docker.sock"}}]),
            ),
        ),
        "restricted/host-path",
        &format!("{p}.volumes[0].hostPath"),
    )
    .await;
    env.allowed(
        &a,
        &pod_workspace(
            "empty-dir",
            with(
                pod.clone(),
                "/volumes",
                json!([{"name": "tmp", "emptyDir": {}}]),
            ),
        ),
    )
    .await;

    // host-namespaces
    env.denied(
        &a,
        &pod_workspace(
            "host-network",
            with(pod.clone(), "/hostNetwork", json!(true)),
        ),
        "restricted/host-namespaces",
        &format!("{p}.hostNetwork"),
    )
    .await;
    env.allowed(
        &a,
        &pod_workspace(
            "own-network",
            with(pod.clone(), "/hostNetwork", json!(false)),
        ),
    )
    .await;

    // Stacks: the workspace template is checked for explicit bad values.
    env.denied(
        &a,
        &stack(
            "root-stack",
            json!({"workspaceTemplate": {"spec": {"podTemplate": {"spec": with(pod.clone(), "/securityContext/runAsUser", json!(0))}}}}),
        ),
        "restricted/run-as-user-root",
        "spec.workspaceTemplate.spec.podTemplate.spec.securityContext.runAsUser",
    )
    .await;
    env.denied(
        &a,
        &stack(
            "baseline-stack",
            json!({"workspaceTemplate": {"spec": {"securityProfile": "baseline"}}}),
        ),
        "restricted/baseline-profile",
        "spec.workspaceTemplate.spec.securityProfile",
    )
    .await;
    env.allowed(
        &a,
        &stack(
            "compliant-stack",
            json!({"workspaceTemplate": {"spec": {"podTemplate": {"spec": {"containers": [{"name": "pulumi", "env": [{"name": "X", "value": "1"}]}]}}}}}),
        ),
    )
    .await;
    env.allowed(
        &b,
        &stack(
            "baseline-stack",
            json!({"workspaceTemplate": {"spec": {"securityProfile": "baseline"}}}),
        ),
    )
    .await;

    // A denial lists every violation with its path.
    let message = env
        .denied(
            &a,
            &pod_workspace(
                "many",
                with(
                    with(pod.clone(), "/hostPID", json!(true)),
                    "/securityContext/runAsUser",
                    json!(0),
                ),
            ),
            "restricted/host-namespaces",
            &format!("{p}.hostPID"),
        )
        .await;
    assert!(
        message.contains("violates 2 pko-rs admission policy rules")
            && message.contains(&format!("{p}.securityContext.runAsUser")),
        "{message}"
    );
    env.cleanup().await;
}

#[tokio::test]
async fn isolation_rules_on_the_real_apiserver() {
    let _machine = pko_tests::serial::shared().await;
    let env = Env::start(WebhookOptions::default(), &[]).await;
    let (a, b) = (env.a.clone(), env.b.clone());
    env.apply_tenancy(
        &format!("{}-a", env.id),
        json!({
            "namespaces": [a],
            "allowedServiceAccounts": ["pulumi"],
            "allowedImagePrefixes": ["pulumi/pulumi:"],
            "allowedTransformDigests": [DIGEST_OK],
            "allowedTransformRegistries": ["registry.team-a.example/plugins"],
            "allowedTransformKeys": [PLUGIN_KEY],
        }),
    )
    .await;
    env.apply_tenancy(
        &format!("{}-b", env.id),
        json!({
            "namespaceSelector": {"matchLabels": {TENANT_LABEL: format!("b-{}", env.id)}},
            "allowedServiceAccounts": ["deployer"],
        }),
    )
    .await;
    env.eventually(
        "tenant a's service-account allowance",
        &a,
        &workspace("sa-probe", json!({"serviceAccountName": "admin"})),
        Expect::DeniedBy("isolation/service-account"),
    )
    .await;
    env.eventually(
        "tenant b's service-account allowance",
        &b,
        &workspace("sa-probe", json!({"serviceAccountName": "pulumi"})),
        Expect::DeniedBy("isolation/service-account"),
    )
    .await;

    // cross-namespace-secret
    let secret_ref = |ns: &str| json!({"type": "Secret", "secret": {"namespace": ns, "name": "creds", "key": "token"}});
    env.denied(
        &a,
        &stack(
            "foreign-secret",
            json!({"envRefs": {"TOKEN": secret_ref(&b)}}),
        ),
        "isolation/cross-namespace-secret",
        "spec.envRefs.TOKEN.secret.namespace",
    )
    .await;
    env.denied(
        &a,
        &stack(
            "foreign-git-secret",
            json!({"gitAuth": {"basicAuth": {"userName": secret_ref(&a), "password": secret_ref("kube-system")}}}),
        ),
        "isolation/cross-namespace-secret",
        "spec.gitAuth.basicAuth.password.secret.namespace",
    )
    .await;
    env.allowed(
        &a,
        &stack("own-secret", json!({"envRefs": {"TOKEN": secret_ref(&a)}, "secretsRef": {"S": {"type": "Secret", "secret": {"name": "s", "key": "k"}}}})),
    )
    .await;

    // operator-local-ref
    env.denied(
        &a,
        &stack(
            "env-ref",
            json!({"gitAuth": {"accessToken": {"type": "Env", "env": {"name": "GITHUB_TOKEN"}}}}),
        ),
        "isolation/operator-local-ref",
        "spec.gitAuth.accessToken.type",
    )
    .await;
    env.allowed(
        &a,
        &stack(
            "literal-ref",
            json!({"envRefs": {"X": {"type": "Literal", "literal": {"value": "1"}}}}),
        ),
    )
    .await;

    // cross-namespace-program: URLs on this operator's file server.
    let url = |ns: &str| {
        format!(
            "http://127.0.0.1:{}/programs/{ns}/hello/1",
            env.operator.fs_port
        )
    };
    env.denied(
        &a,
        &workspace(
            "foreign-program",
            json!({"flux": {"url": url(&b), "digest": "sha256:00"}}),
        ),
        "isolation/cross-namespace-program",
        "spec.flux.url",
    )
    .await;
    env.denied(
        &a,
        &stack(
            "foreign-program",
            json!({"workspaceTemplate": {"spec": {"flux": {"url": url(&b)}}}}),
        ),
        "isolation/cross-namespace-program",
        "spec.workspaceTemplate.spec.flux.url",
    )
    .await;
    env.allowed(
        &a,
        &workspace(
            "own-program",
            json!({"flux": {"url": url(&a), "digest": "sha256:00"}}),
        ),
    )
    .await;
    env.allowed(
        &a,
        &workspace(
            "other-server",
            json!({"flux": {"url": format!("https://artifacts.example.com/programs/{b}/x/1")}}),
        ),
    )
    .await;

    // service-account: each namespace has its own allowance.
    env.denied(
        &a,
        &workspace("admin-sa", json!({"serviceAccountName": "admin"})),
        "isolation/service-account",
        "spec.serviceAccountName",
    )
    .await;
    env.denied(
        &a,
        &stack("admin-sa", json!({"serviceAccountName": "admin"})),
        "isolation/service-account",
        "spec.serviceAccountName",
    )
    .await;
    env.allowed(
        &a,
        &workspace("pulumi-sa", json!({"serviceAccountName": "pulumi"})),
    )
    .await;
    env.allowed(
        &b,
        &workspace("deployer-sa", json!({"serviceAccountName": "deployer"})),
    )
    .await;
    env.denied(
        &b,
        &workspace("pulumi-sa", json!({"serviceAccountName": "pulumi"})),
        "isolation/service-account",
        "spec.serviceAccountName",
    )
    .await;

    // image
    env.denied(
        &a,
        &workspace("evil-image", json!({"image": "evil.example/pulumi:latest"})),
        "isolation/image",
        "spec.image",
    )
    .await;
    env.denied(
        &a,
        &pod_workspace(
            "sidecar-image",
            with(
                good_pod(),
                "/containers/0/image",
                json!("docker.io/library/busybox"),
            ),
        ),
        "isolation/image",
        "spec.podTemplate.spec.containers[0].image",
    )
    .await;
    env.allowed(
        &a,
        &workspace(
            "pulumi-image",
            json!({"image": "pulumi/pulumi:3.150.0-nonroot"}),
        ),
    )
    .await;
    env.allowed(
        &b,
        &workspace("any-image", json!({"image": "evil.example/pulumi:latest"})),
    )
    .await;

    // transform-module
    env.denied(
        &a,
        &transform("unknown-module", DIGEST_OTHER),
        "isolation/transform-module",
        "spec.sha256",
    )
    .await;
    env.allowed(&a, &transform("known-module", DIGEST_OK)).await;
    env.allowed(&b, &transform("any-module", DIGEST_OTHER))
        .await;
    // ... or an OCI artifact of an allowed registry, verified with an allowed key.
    env.allowed(
        &a,
        &oci_transform("registry-module", "registry.team-a.example/plugins/tags:v2"),
    )
    .await;
    env.denied(
        &a,
        &oci_transform("lookalike-module", "registry.team-a.example/plugins-x/tags"),
        "isolation/transform-module",
        "spec.sha256",
    )
    .await;
    let mut unverified = oci_transform("unverified-module", "registry.team-a.example/plugins/tags");
    unverified["spec"]
        .as_object_mut()
        .map(|spec| spec.remove("verify"));
    env.denied(&a, &unverified, "isolation/transform-module", "spec.sha256")
        .await;
    env.cleanup().await;
}

#[tokio::test]
async fn defaults_are_stored_at_admission() {
    let _machine = pko_tests::serial::shared().await;
    let env = Env::start(WebhookOptions::default(), &[]).await;
    let created = env
        .allowed(
            &env.a,
            &pod_workspace(
                "defaulted",
                json!({"containers": [{"name": "pulumi"}], "initContainers": [{"name": "fetch", "securityContext": {"runAsUser": 1000}}]}),
            ),
        )
        .await;
    let spec = &created.data["spec"];
    assert_eq!(spec["securityProfile"], "restricted");
    assert_eq!(
        spec["resources"]["requests"],
        json!({"cpu": "100m", "memory": "64Mi"})
    );
    let pod = &spec["podTemplate"]["spec"];
    assert_eq!(
        pod["securityContext"],
        json!({"runAsNonRoot": true, "seccompProfile": {"type": "RuntimeDefault"}})
    );
    assert_eq!(
        pod["containers"][0]["securityContext"],
        json!({"allowPrivilegeEscalation": false, "capabilities": {"drop": ["ALL"]}})
    );
    assert_eq!(
        pod["initContainers"][0]["securityContext"],
        json!({"runAsUser": 1000, "allowPrivilegeEscalation": false, "capabilities": {"drop": ["ALL"]}})
    );
    // Explicit values are kept; a limit stands in for a missing request.
    let kept = env
        .allowed(
            &env.a,
            &workspace(
                "explicit",
                json!({"resources": {"requests": {"cpu": "2"}, "limits": {"memory": "1Gi"}}}),
            ),
        )
        .await;
    assert_eq!(
        kept.data["spec"]["resources"],
        json!({"requests": {"cpu": "2"}, "limits": {"memory": "1Gi"}})
    );
    // The stored object is what the apiserver returns later too.
    let api = dynamic_api(env.client(), &env.a, &workspace("defaulted", json!({})));
    let stored = api.get("defaulted").await.expect("stored workspace");
    assert_eq!(stored.data["spec"], created.data["spec"]);
    env.cleanup().await;
}

#[tokio::test]
async fn warn_dryrun_and_live_tenancy_changes() {
    let _machine = pko_tests::serial::shared().await;
    let env = Env::start(WebhookOptions::default(), &[]).await;
    let (a, b) = (env.a.clone(), env.b.clone());
    let policy_a = format!("{}-a", env.id);
    let baseline = workspace("baseline", json!({"securityProfile": "baseline"}));

    // warn: admitted, with the violation as a warning that reaches kubectl.
    env.apply_tenancy(
        &policy_a,
        json!({"namespaces": [a], "enforcementAction": "warn"}),
    )
    .await;
    env.eventually("warn to apply", &a, &baseline, Expect::Allowed)
        .await;
    let (ok, stderr) = env.kubectl_create(&a, &baseline);
    assert!(ok, "warned request should be admitted: {stderr}");
    assert!(
        stderr.contains("Warning: pko-rs policy: spec.securityProfile:")
            && stderr.contains("[restricted/baseline-profile]"),
        "kubectl stderr: {stderr}"
    );

    // dryrun: admitted silently, recorded in the metrics and the log.
    let series = "pko_admission_violations_total{policy=\"restricted\",code=\"baseline-profile\",action=\"dryrun\"}";
    let before = env.metric(series).await;
    env.apply_tenancy(
        &policy_a,
        json!({"namespaces": [a], "enforcementAction": "dryrun"}),
    )
    .await;
    wait_for("dryrun to apply", WAIT, || async {
        let (ok, stderr) = env.kubectl_create(&a, &baseline);
        (ok && !stderr.contains("Warning")).then_some(())
    })
    .await
    .expect("dryrun admits without warnings");
    assert!(
        env.metric(series).await > before,
        "dryrun violation not counted"
    );
    assert!(
        env.operator
            .log_text()
            .contains("dryrun violation (admitted)"),
        "dryrun violation not logged"
    );

    // deny again: the denial message reaches kubectl.
    env.apply_tenancy(
        &policy_a,
        json!({"namespaces": [a], "enforcementAction": "deny"}),
    )
    .await;
    env.eventually(
        "deny to apply",
        &a,
        &baseline,
        Expect::DeniedBy("restricted/baseline-profile"),
    )
    .await;
    let (ok, stderr) = env.kubectl_create(&a, &baseline);
    assert!(!ok, "denied request admitted");
    assert!(
        stderr.contains("denied the request")
            && stderr.contains(
                "spec.securityProfile: the baseline security profile runs the workspace as root"
            ),
        "kubectl stderr: {stderr}"
    );

    // Allowance lists change live.
    let evil = workspace("evil", json!({"image": "evil.example/pulumi"}));
    env.apply_tenancy(
        &policy_a,
        json!({"namespaces": [a], "allowedImagePrefixes": ["pulumi/"]}),
    )
    .await;
    env.eventually(
        "the image list",
        &a,
        &evil,
        Expect::DeniedBy("isolation/image"),
    )
    .await;
    env.apply_tenancy(
        &policy_a,
        json!({"namespaces": [a], "allowedImagePrefixes": ["pulumi/", "evil.example/"]}),
    )
    .await;
    env.eventually("the longer image list", &a, &evil, Expect::Allowed)
        .await;

    // A second policy on the same namespace with its own action: its list warns, the
    // namespace's own rules still deny.
    let images = format!("{}-images", env.id);
    env.apply_tenancy(
        &images,
        json!({"namespaces": [a], "enforcementAction": "warn", "allowedImagePrefixes": ["registry.example/"]}),
    )
    .await;
    wait_for("the second policy to warn", WAIT, || async {
        let (ok, stderr) = env.kubectl_create(&a, &evil);
        (ok && stderr.contains("[isolation/image]")).then_some(())
    })
    .await
    .expect("image warning from the second policy");

    // Label selectors follow namespace labels live: b is exempt only while labelled.
    env.apply_tenancy(
        &format!("{}-b", env.id),
        json!({
            "namespaceSelector": {"matchLabels": {TENANT_LABEL: format!("b-{}", env.id)}},
            "exemptFromRestricted": true,
        }),
    )
    .await;
    env.eventually("b's exemption", &b, &baseline, Expect::Allowed)
        .await;
    set_namespace_labels(
        env.plane,
        &b,
        BTreeMap::from([(pko_tests::webhook::WEBHOOK_LABEL.to_owned(), env.id.clone())]),
    )
    .await
    .expect("relabel b");
    env.eventually(
        "b to lose its exemption with its label",
        &b,
        &baseline,
        Expect::DeniedBy("restricted/baseline-profile"),
    )
    .await;
    env.cleanup().await;
}

/// A Workspace whose AdmissionReview is far larger than the 1 MiB the policy may use.
fn oversized_workspace(name: &str) -> Value {
    workspace(
        name,
        json!({"env": [{"name": "BIG", "value": "x".repeat(1_500_000)}]}),
    )
}

#[tokio::test]
async fn failing_evaluation_follows_the_failure_policy() {
    let _machine = pko_tests::serial::shared().await;
    // Only the memory cap may fail the evaluation: the evaluation budget and the apiserver's
    // webhook timeout (its maximum) are far above what the evaluation needs, so a slow machine
    // cannot turn the memory error into a timeout.
    let options = WebhookOptions {
        timeout_seconds: 30,
        ..WebhookOptions::default()
    };
    // Fail: the request is refused with the reason; the operator keeps serving.
    let env = Env::start(
        options.clone(),
        &["--policy-memory-mib=1", "--policy-timeout=25s"],
    )
    .await;
    let message = env
        .try_create(&env.a, &oversized_workspace("big"), true)
        .await
        .expect_err("refused under failure policy Fail");
    assert!(
        message.contains("could not evaluate its admission policies")
            && message.contains("failure policy Fail"),
        "{message}"
    );
    assert!(
        env.metric("pko_admission_evaluation_errors_total{entrypoint=\"pko/admission/decision\",error=\"memory\"}")
            .await
            >= 1.0
            || env
                .metric("pko_admission_evaluation_errors_total{entrypoint=\"pko/defaults/patch\",error=\"memory\"}")
                .await
                >= 1.0,
        "evaluation error not counted:\n{}",
        env.operator.metrics_text().await.unwrap_or_default()
    );
    assert!(env.operator.log_text().contains("policy evaluation failed"));
    env.allowed(&env.a, &workspace("small", json!({}))).await;
    env.cleanup().await;

    // Ignore: admitted with a warning; the operator keeps serving.
    let env = Env::start(
        options,
        &[
            "--policy-memory-mib=1",
            "--policy-timeout=25s",
            "--policy-failure-policy=Ignore",
        ],
    )
    .await;
    let (ok, stderr) = env.kubectl_create(&env.a, &oversized_workspace("big"));
    assert!(ok, "admitted under failure policy Ignore: {stderr}");
    assert!(stderr.contains("failure policy Ignore"), "{stderr}");
    env.denied(
        &env.a,
        &workspace("baseline", json!({"securityProfile": "baseline"})),
        "restricted/baseline-profile",
        "spec.securityProfile",
    )
    .await;
    env.cleanup().await;
}

#[tokio::test]
async fn certificates_are_managed_and_rotated() {
    let _machine = pko_tests::serial::shared().await;
    let env = Env::start(WebhookOptions::default(), &[]).await;
    let secrets: Api<Secret> = Api::namespaced(env.client(), &env.registration.system_namespace);
    let secret = secrets
        .get("pko-rs-webhook-tls")
        .await
        .expect("certificate Secret");
    assert_eq!(secret.type_.as_deref(), Some("kubernetes.io/tls"));
    let data = secret.data.expect("data");
    for key in ["tls.crt", "tls.key", "ca.crt", "ca.key"] {
        assert!(data.contains_key(key), "{key} missing");
    }
    let first_ca = env
        .registration
        .wait_ca_injected(env.plane, WAIT)
        .await
        .expect("CA bundle");
    assert_eq!(first_ca, data["ca.crt"].0);

    // Losing the Secret: the operator issues a new CA, re-injects it, reloads its listener,
    // and the apiserver keeps calling the webhook.
    secrets
        .delete("pko-rs-webhook-tls", &DeleteParams::default())
        .await
        .expect("delete Secret");
    let registration = env.registration.clone();
    wait_for("a new CA in the webhook configurations", WAIT, || async {
        let bundle = registration.wait_ca_injected(env.plane, WAIT).await.ok()?;
        (bundle != first_ca).then_some(())
    })
    .await
    .expect("rotated CA injected");
    env.eventually(
        "the webhook to answer with the new certificate",
        &env.a,
        &workspace("after-rotation", json!({"securityProfile": "baseline"})),
        Expect::DeniedBy("restricted/baseline-profile"),
    )
    .await;
    env.allowed(&env.a, &workspace("after-rotation", json!({})))
        .await;
    assert!(
        env.metric("pko_admission_certificate_rotations_total")
            .await
            >= 1.0,
        "rotation not counted"
    );
    env.cleanup().await;
}

/// The leader reports each TenancyPolicy's reach: how many namespaces it selects (names and
/// labels, following namespace changes), and a selector the webhook cannot use.
#[tokio::test]
async fn tenancy_policy_status_counts_namespaces_and_reports_a_bad_selector() {
    let _machine = pko_tests::serial::shared().await;
    let env = Env::start(WebhookOptions::default(), &[]).await;
    let name = format!("{}-a", env.id);
    let label = format!("b-{}", env.id);
    env.apply_tenancy(
        &name,
        json!({"namespaces": [env.a], "namespaceSelector": {"matchLabels": {TENANT_LABEL: label}}}),
    )
    .await;
    let api = Api::<DynamicObject>::all_with(env.client(), &tenancy_resource());
    let status_where = |what: &'static str, pred: fn(&Value) -> bool| {
        let api = api.clone();
        let name = name.clone();
        async move {
            wait_for(what, WAIT, || async {
                let p = api.get(&name).await.ok()?;
                let status = p.data.get("status")?.clone();
                pred(&status).then_some(status)
            })
            .await
            .unwrap_or_else(|e| panic!("{e}"))
        }
    };
    let ready = |s: &Value| -> (String, String) {
        let c = s["conditions"]
            .as_array()
            .and_then(|c| c.iter().find(|c| c["type"] == "Ready"))
            .cloned()
            .unwrap_or_default();
        (
            c["status"].as_str().unwrap_or_default().to_owned(),
            c["reason"].as_str().unwrap_or_default().to_owned(),
        )
    };
    // tenant-a by name, tenant-b by its label.
    let status = status_where("two namespaces selected", |s| s["selectedNamespaces"] == 2).await;
    assert_eq!(ready(&status), ("True".into(), "Accepted".into()));

    // A third namespace that gets the label is counted.
    let c = env.plane.namespace("tenant-c").await.expect("namespace c");
    set_namespace_labels(
        env.plane,
        &c,
        BTreeMap::from([(TENANT_LABEL.to_owned(), label.clone())]),
    )
    .await
    .expect("label c");
    status_where("three namespaces selected", |s| {
        s["selectedNamespaces"] == 3
    })
    .await;

    // A selector the webhook cannot parse selects nothing: the status says so.
    env.apply_tenancy(
        &name,
        json!({"namespaces": [env.a], "namespaceSelector": {"matchExpressions": [{"key": TENANT_LABEL, "operator": "Near", "values": ["x"]}]}}),
    )
    .await;
    let status = status_where("the invalid selector reported", |s| {
        s["conditions"]
            .as_array()
            .is_some_and(|c| c.iter().any(|c| c["reason"] == "InvalidNamespaceSelector"))
    })
    .await;
    assert_eq!(status["selectedNamespaces"], 1, "{status}");
    assert_eq!(
        ready(&status),
        ("False".into(), "InvalidNamespaceSelector".into())
    );
    env.cleanup().await;
}

/// A TenancyPolicy status the apiserver refuses (here a ValidatingAdmissionPolicy on the
/// status subresource, 422): there is no status to say so in, so a Warning Event with the
/// apiserver's words tells it.
#[tokio::test]
async fn a_refused_tenancy_status_is_told_by_an_event() {
    let _machine = pko_tests::serial::shared().await;
    use k8s_openapi::api::events::v1::Event;
    use pko_tests::refusal::{Refusal, Rule};
    let env = Env::start(WebhookOptions::default(), &[]).await;
    let name = format!("{}-a", env.id);
    let refusal = Refusal::install(
        env.plane,
        &format!("pko-tests-refuse-status-{}", env.id),
        Rule {
            group: "pko-rs.dev",
            resource: "tenancypolicies/status",
            allowed: &format!("object.metadata.name != '{name}'"),
            message: "this status stays as it is (pko-tests)",
            namespace: None,
        },
    )
    .await
    .expect("refusal");
    // The refusal is in force once a status update of the policy is refused (a dry run).
    env.apply_tenancy(&name, json!({"namespaces": [env.a]}))
        .await;
    let tenancy = Api::<DynamicObject>::all_with(env.client(), &tenancy_resource());
    wait_for("the status refusal", WAIT, || async {
        let dry_run = PatchParams {
            dry_run: true,
            ..PatchParams::default()
        };
        let patch = json!({"status": {"selectedNamespaces": 7}});
        match tenancy
            .patch_status(&name, &dry_run, &Patch::Merge(&patch))
            .await
        {
            Err(kube::Error::Api(s)) if s.code == 422 => Some(()),
            _ => None,
        }
    })
    .await
    .expect("refused");
    // A spec change the status must follow.
    env.apply_tenancy(&name, json!({"namespaces": [env.a, env.b]}))
        .await;

    let events: Api<Event> = Api::all(env.client());
    let note = wait_for("the ReconcileError Event", WAIT, || async {
        events
            .list(&Default::default())
            .await
            .ok()?
            .items
            .into_iter()
            .find(|e| {
                e.reason.as_deref() == Some("ReconcileError")
                    && e.regarding.as_ref().and_then(|r| r.name.as_deref()) == Some(name.as_str())
            })
            .and_then(|e| e.note)
    })
    .await
    .expect("event");
    assert!(note.contains("this status stays as it is"), "{note}");

    refusal.remove().await;
    env.cleanup().await;
}

/// Issue: an object being deleted skipped every check, so a tenant could hold an allowed
/// ProgramTransform with its own finalizer, delete it, then point it at any module. Now the
/// checks are skipped only while the spec stays the same; and removing finalizers needs no
/// webhook at all (`matchConditions`), so clean-up works with the operator stopped.
#[tokio::test]
async fn deleted_objects_are_checked_until_let_go_and_let_go_without_the_operator() {
    let _machine = pko_tests::serial::shared().await;
    let mut env = Env::start(WebhookOptions::default(), &[]).await;
    let a = env.a.clone();
    env.apply_tenancy(
        &format!("{}-a", env.id),
        json!({"namespaces": [a], "allowedTransformDigests": [DIGEST_OK]}),
    )
    .await;
    env.eventually(
        "tenant a's transform allowance",
        &a,
        &transform("probe", DIGEST_OTHER),
        Expect::DeniedBy("isolation/transform-module"),
    )
    .await;
    let held = with(
        transform("held", DIGEST_OK),
        "/metadata/finalizers",
        json!(["tenant.example/hold"]),
    );
    env.allowed(&a, &held).await;
    let api = dynamic_api(env.client(), &a, &held);
    api.delete("held", &DeleteParams::default())
        .await
        .expect("delete (kept by the finalizer)");
    let being_deleted = api.get("held").await.expect("still there");
    assert!(being_deleted.metadata.deletion_timestamp.is_some());

    // The finalizer trick: a new module on the object being deleted is refused.
    let swap = json!({"spec": {
        "sha256": format!("sha256:{DIGEST_OTHER}"),
        "source": {"url": "https://evil.example/module.wasm", "configMap": null},
    }});
    let refused = api
        .patch("held", &PatchParams::default(), &Patch::Merge(&swap))
        .await
        .expect_err("a changed spec on a deleted object is checked");
    let message = refused.to_string();
    assert!(
        message.contains("[isolation/transform-module]") && message.contains("spec.sha256"),
        "{message}"
    );

    // With the operator stopped (the webhook unreachable, failure policy Fail), objects can
    // still be let go: a Stack with a finalizer is deleted once its finalizers are removed.
    let stuck = with(
        stack("stuck", json!({})),
        "/metadata/finalizers",
        // Not the operator's own finalizer, so only this test lets it go.
        json!(["tenant.example/hold"]),
    );
    env.allowed(&a, &stuck).await;
    let stacks = dynamic_api(env.client(), &a, &stuck);
    stacks
        .delete("stuck", &DeleteParams::default())
        .await
        .expect("delete the stack");
    env.operator.stop();
    // The webhook is really down: any other write of a Stack is refused.
    wait_for("writes to fail without the webhook", WAIT, || async {
        let probe = stack("probe-down", json!({}));
        env.try_create(&a, &probe, true).await.err()
    })
    .await
    .expect("the webhook is down");
    stacks
        .patch(
            "stuck",
            &PatchParams::default(),
            &Patch::Merge(json!({"metadata": {"finalizers": null}})),
        )
        .await
        .expect("finalizers removed without the webhook");
    api.patch(
        "held",
        &PatchParams::default(),
        &Patch::Merge(json!({"metadata": {"finalizers": null}})),
    )
    .await
    .expect("the transform let go without the webhook");
    for (api, name) in [(&stacks, "stuck"), (&api, "held")] {
        wait_for(&format!("{name} to be gone"), WAIT, || async {
            api.get_opt(name).await.ok()?.is_none().then_some(())
        })
        .await
        .expect("gone");
    }
    env.cleanup().await;
}

/// A namespace holding a Stack that still has resources to destroy (`destroyOnFinalize`, the
/// operator's finalizer on it) is not deleted: the apiserver's DELETE is refused with what to
/// run first, then with what to wait for while the Stack is being destroyed, and passes once
/// the Stack is gone. The Stacks are in a namespace no controller of this operator watches,
/// so only the test moves them along.
#[tokio::test]
async fn a_namespace_is_not_deleted_under_stacks_still_to_destroy() {
    let _machine = pko_tests::serial::shared().await;
    let env = Env::start(WebhookOptions::default(), &[]).await;
    let b = env.b.clone();
    let namespaces: Api<k8s_openapi::api::core::v1::Namespace> = Api::all(env.client());
    let delete_namespace = || {
        let namespaces = namespaces.clone();
        let b = b.clone();
        async move {
            namespaces
                .delete(&b, &DeleteParams::default())
                .await
                .map(|_| ())
                .map_err(|e| match e {
                    kube::Error::Api(status) => status.message,
                    other => other.to_string(),
                })
        }
    };
    // Without destroyOnFinalize nothing would be lost: such a Stack holds nothing back, and
    // neither does one the operator never took on (no finalizer).
    env.allowed(&b, &stack("plain", json!({}))).await;
    let destroying = with(
        stack("destroying", json!({"destroyOnFinalize": true})),
        "/metadata/finalizers",
        json!([pko_api::stack::STACK_FINALIZER]),
    );
    env.allowed(&b, &destroying).await;

    let refused = delete_namespace().await.expect_err("refused");
    assert!(
        refused.contains("namespaces.pko-rs.dev")
            && refused.contains("spec.destroyOnFinalize")
            && refused.contains(&format!("kubectl delete stacks --all -n {b}")),
        "{refused}"
    );
    let live = namespaces.get(&b).await.expect("namespace");
    assert!(
        live.metadata.deletion_timestamp.is_none(),
        "not terminating"
    );

    // Being destroyed: the namespace waits for it.
    let stacks = dynamic_api(env.client(), &b, &destroying);
    stacks
        .delete("destroying", &DeleteParams::default())
        .await
        .expect("delete the stack (kept by its finalizer)");
    let refused = delete_namespace()
        .await
        .expect_err("refused while destroying");
    assert!(
        refused.contains(&format!("kubectl wait --for=delete stacks --all -n {b}")),
        "{refused}"
    );

    // Destroyed (the operator lets its finalizer go): the namespace goes.
    stacks
        .patch(
            "destroying",
            &PatchParams::default(),
            &Patch::Merge(json!({"metadata": {"finalizers": null}})),
        )
        .await
        .expect("let the stack go");
    wait_for("the stack gone", WAIT, || async {
        stacks
            .get_opt("destroying")
            .await
            .ok()?
            .is_none()
            .then_some(())
    })
    .await
    .expect("gone");
    delete_namespace()
        .await
        .expect("the namespace deletion passes");
    let terminating = namespaces.get(&b).await.expect("namespace");
    assert!(terminating.metadata.deletion_timestamp.is_some());
    env.cleanup().await;
}
