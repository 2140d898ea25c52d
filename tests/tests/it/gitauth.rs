//! Git credentials against real servers: a GitHub API stand-in over HTTPS that checks the App
//! JWT as GitHub does and issues one installation token, a git server that serves only that
//! token, and Debian's sshd serving a repository to an ed25519 key and a passphrase-protected
//! RSA key. The operator lists branches (no git binary), the static agent checks out (with the
//! image's git and ssh, as a workspace pod does).

use std::path::Path;
use std::time::Duration;

use kube::api::{Api, Patch, PatchParams, PostParams};
use pko_api::stack::Stack;
use pko_api::workspace::Workspace;
use pko_tests::agent::agent_binary;
use pko_tests::execution::Execution;
use pko_tests::githubapi::GithubApi;
use pko_tests::gitrepo::GitRepo;
use pko_tests::sshgit::{PASSPHRASE, SshGit};
use pko_tests::wait_for;
use rustls::pki_types::PrivateKeyDer;
use rustls::pki_types::pem::PemObject;
use serde_json::json;
use tokio::process::Command;

const WAIT: Duration = Duration::from_secs(120);
const PROGRAM: &str = "name: from-git\nruntime: yaml\n";
const APP_ID: &str = "4242";
const INSTALLATION: &str = "77";

fn app_key(file: &str) -> String {
    std::fs::read_to_string(pko_tests::repo_root().join("git/testdata").join(file))
        .expect("App key")
}

/// The public half of the App's key, as GitHub keeps it.
fn app_public_key() -> Vec<u8> {
    let pem = app_key("app-key-pkcs1.pem");
    let PrivateKeyDer::Pkcs1(der) = PrivateKeyDer::from_pem_slice(pem.as_bytes()).expect("pem")
    else {
        panic!("a PKCS#1 key");
    };
    let pair = ring::signature::RsaKeyPair::from_der(der.secret_pkcs1_der()).expect("rsa");
    ring::signature::KeyPair::public_key(&pair)
        .as_ref()
        .to_vec()
}

fn new_token() -> String {
    format!("ghs_{}", hex::encode(rand::random::<[u8; 16]>()))
}

/// `pko-agent init` of `url` at `revision` into `dir/source`, with `env` only (as a pod's
/// fetch container), plus PATH for git and ssh.
async fn init(dir: &Path, url: &str, revision: &str, env: &[(&str, &str)]) -> std::process::Output {
    Command::new(agent_binary().expect("agent binary"))
        .args(["init", "--target-dir"])
        .arg(dir.join("source"))
        .args(["--git-url", url, "--git-revision", revision])
        .env_clear()
        .env("PATH", "/usr/local/bin:/usr/bin:/bin")
        .env("HOME", dir)
        .envs(env.iter().copied())
        .output()
        .await
        .expect("run init")
}

fn text(out: &std::process::Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

#[tokio::test]
async fn init_checks_out_with_a_github_app_installation_token() {
    let _machine = pko_tests::serial::shared().await;
    let tmp = tempfile::tempdir().expect("tmp");
    let token = new_token();
    let repo = GitRepo::start(&tmp.path().join("git"), Some(("x-access-token", &token)))
        .await
        .expect("git repo");
    let commit = repo
        .commit("main", &[("Pulumi.yaml", PROGRAM)])
        .expect("commit");
    let api = GithubApi::start(APP_ID, INSTALLATION, app_public_key(), &token)
        .await
        .expect("GitHub API");
    let ca = tmp.path().join("ca.pem");
    std::fs::write(&ca, &api.ca_pem).expect("ca");
    let ca = ca.display().to_string();
    let api_url = api.url();
    // GitHub hands out PKCS#1 keys; a key converted to PKCS#8 works the same.
    for (n, key) in ["app-key-pkcs1.pem", "app-key-pkcs8.pem"]
        .iter()
        .enumerate()
    {
        let dir = tmp.path().join(format!("ws{n}"));
        let key = app_key(key);
        let out = init(
            &dir,
            &repo.url(),
            "main",
            &[
                ("GIT_GITHUB_APP_ID", APP_ID),
                ("GIT_GITHUB_APP_INSTALLATION_ID", INSTALLATION),
                ("GIT_GITHUB_APP_PRIVATE_KEY", &key),
                ("GIT_GITHUB_API_URL", &api_url),
                ("SSL_CERT_FILE", &ca),
            ],
        )
        .await;
        assert!(out.status.success(), "{}", text(&out));
        assert_eq!(
            std::fs::read_to_string(dir.join("source/Pulumi.yaml")).expect("checked out"),
            PROGRAM
        );
        assert!(!text(&out).contains(&token), "the token is never logged");
        assert!(text(&out).contains(&commit), "{}", text(&out));
    }
    assert_eq!(api.seen().issued, 2, "{:?}", api.seen());

    // Another App id: GitHub refuses the JWT; the refusal is the message, the token absent.
    let out = init(
        &tmp.path().join("wrong-app"),
        &repo.url(),
        "main",
        &[
            ("GIT_GITHUB_APP_ID", "4243"),
            ("GIT_GITHUB_APP_INSTALLATION_ID", INSTALLATION),
            ("GIT_GITHUB_APP_PRIVATE_KEY", &app_key("app-key-pkcs1.pem")),
            ("GIT_GITHUB_API_URL", &api_url),
            ("SSL_CERT_FILE", &ca),
        ],
    )
    .await;
    assert!(!out.status.success());
    let message = text(&out);
    assert!(
        message.contains("HTTP 401") && message.contains("Integration not found"),
        "{message}"
    );
    assert_eq!(api.seen().issued, 2);
    // Without the App, the repository is not served.
    let out = init(&tmp.path().join("anonymous"), &repo.url(), "main", &[]).await;
    assert!(!out.status.success(), "{}", text(&out));
}

#[tokio::test]
async fn init_checks_out_over_ssh_with_a_passphrase_and_refuses_a_wrong_host_key() {
    let _machine = pko_tests::serial::shared().await;
    let tmp = tempfile::tempdir().expect("tmp");
    let repo = GitRepo::start(&tmp.path().join("git"), None)
        .await
        .expect("git repo");
    let commit = repo
        .commit("main", &[("Pulumi.yaml", PROGRAM)])
        .expect("commit");
    let sshd = SshGit::start(&tmp.path().join("sshd")).await.expect("sshd");
    let url = sshd.url(&repo);
    let known = sshd.known_hosts().expect("known hosts");
    let (key, encrypted) = (sshd.key().expect("key"), sshd.encrypted_key().expect("key"));
    for (name, env) in [
        (
            "key",
            vec![
                ("GIT_SSH_PRIVATE_KEY", key.as_str()),
                ("GIT_SSH_KNOWN_HOSTS", &known),
            ],
        ),
        (
            "passphrase",
            vec![
                ("GIT_SSH_PRIVATE_KEY", encrypted.as_str()),
                ("GIT_PASSWORD", PASSPHRASE),
                ("GIT_SSH_KNOWN_HOSTS", &known),
            ],
        ),
    ] {
        let dir = tmp.path().join(name);
        let out = init(&dir, &url, &commit, &env).await;
        assert!(
            out.status.success(),
            "{name}: {}\n{}",
            text(&out),
            sshd.log()
        );
        assert_eq!(
            std::fs::read_to_string(dir.join("source/Pulumi.yaml")).expect("checked out"),
            PROGRAM
        );
    }
    // A wrong passphrase, and a server whose key is not the one known: refused, saying why.
    let out = init(
        &tmp.path().join("wrong-passphrase"),
        &url,
        &commit,
        &[
            ("GIT_SSH_PRIVATE_KEY", &encrypted),
            ("GIT_PASSWORD", "not it"),
            ("GIT_SSH_KNOWN_HOSTS", &known),
        ],
    )
    .await;
    assert!(!out.status.success(), "{}", text(&out));
    let wrong = sshd.wrong_known_hosts().expect("wrong known hosts");
    let out = init(
        &tmp.path().join("wrong-host"),
        &url,
        &commit,
        &[
            ("GIT_SSH_PRIVATE_KEY", &key),
            ("GIT_SSH_KNOWN_HOSTS", &wrong),
        ],
    )
    .await;
    assert!(!out.status.success());
    assert!(
        text(&out).contains("host key is not trusted"),
        "{}",
        text(&out)
    );
    assert!(!tmp.path().join("wrong-host/source").exists());
}

async fn secret(plane: &kube::Client, ns: &str, name: &str, data: serde_json::Value) {
    let secret: k8s_openapi::api::core::v1::Secret = serde_json::from_value(json!({
        "apiVersion": "v1", "kind": "Secret", "metadata": {"name": name}, "stringData": data,
    }))
    .expect("secret");
    Api::<k8s_openapi::api::core::v1::Secret>::namespaced(plane.clone(), ns)
        .create(&PostParams::default(), &secret)
        .await
        .expect("create secret");
}

fn secret_ref(name: &str, key: &str) -> serde_json::Value {
    json!({"type": "Secret", "secret": {"name": name, "key": key}})
}

/// The commit the operator resolved for `name`'s branch (its Workspace's `git.ref`).
async fn resolved(workspaces: &Api<Workspace>, name: &str, commit: &str) -> Result<(), String> {
    wait_for(&format!("workspace {name} at {commit}"), WAIT, || async {
        let ws = workspaces.get(name).await.ok()?;
        (ws.spec.git?.ref_.as_deref() == Some(commit)).then_some(())
    })
    .await
    .map_err(|e| e.to_string())
}

#[tokio::test]
async fn the_operator_tracks_branches_over_ssh_and_with_a_github_app() {
    let _machine = pko_tests::serial::shared().await;
    let files = tempfile::tempdir().expect("tmp");
    let token = new_token();
    let api = GithubApi::start(APP_ID, INSTALLATION, app_public_key(), &token)
        .await
        .expect("GitHub API");
    let ca = files.path().join("ca.pem");
    std::fs::write(&ca, &api.ca_pem).expect("ca");
    let ca = ca.display().to_string();
    let api_url = api.url();
    let e = Execution::start_with_env(
        "gitauth",
        |_| vec![format!("--github-api-url={api_url}")],
        &[("SSL_CERT_FILE", &ca)],
    )
    .await;
    let client = e.plane.client();
    let app_repo = GitRepo::start(
        &files.path().join("app-git"),
        Some(("x-access-token", &token)),
    )
    .await
    .expect("git repo");
    let app_first = app_repo
        .commit("main", &[("Pulumi.yaml", PROGRAM)])
        .expect("commit");
    let ssh_repo = GitRepo::start(&files.path().join("ssh-git"), None)
        .await
        .expect("git repo");
    let ssh_commit = ssh_repo
        .commit("main", &[("Pulumi.yaml", PROGRAM)])
        .expect("commit");
    let sshd = SshGit::start(&files.path().join("sshd"))
        .await
        .expect("sshd");
    let known = sshd.known_hosts().expect("known hosts");
    secret(
        &client,
        &e.ns,
        "app",
        json!({"id": APP_ID, "installation": INSTALLATION, "key": app_key("app-key-pkcs1.pem")}),
    )
    .await;
    secret(
        &client,
        &e.ns,
        "ssh",
        json!({"key": sshd.key().expect("key"), "knownHosts": known}),
    )
    .await;
    secret(
        &client,
        &e.ns,
        "ssh-pass",
        json!({"key": sshd.encrypted_key().expect("key"), "pass": PASSPHRASE, "knownHosts": known}),
    )
    .await;
    secret(&client, &e.ns, "ssh-wrong", json!({"key": sshd.key().expect("key"), "knownHosts": sshd.wrong_known_hosts().expect("wrong")})).await;

    let stacks: Api<Stack> = Api::namespaced(client.clone(), &e.ns);
    let ssh_url = sshd.url(&ssh_repo);
    let app = json!({"githubApp": {"appID": secret_ref("app", "id"), "installationID": secret_ref("app", "installation"), "privateKey": secret_ref("app", "key")}});
    for (name, url, auth) in [
        ("app", app_repo.url(), app),
        (
            "ssh-key",
            ssh_url.clone(),
            json!({"sshAuth": {"sshPrivateKey": secret_ref("ssh", "key")}}),
        ),
        (
            "ssh-pass",
            ssh_url.clone(),
            json!({"sshAuth": {"sshPrivateKey": secret_ref("ssh-pass", "key"), "password": secret_ref("ssh-pass", "pass")}}),
        ),
        (
            "ssh-wrong",
            ssh_url.clone(),
            json!({"sshAuth": {"sshPrivateKey": secret_ref("ssh-wrong", "key")}}),
        ),
    ] {
        let spec = json!({"stack": name, "projectRepo": url, "branch": "main", "gitAuth": auth});
        let stack =
            pko_tests::fixtures::file_backend_stack(name, &e.tmp.path().join("backend"), spec);
        stacks
            .create(&PostParams::default(), &stack)
            .await
            .expect("create stack");
    }

    let workspaces: Api<Workspace> = Api::namespaced(client.clone(), &e.ns);
    let status = |name: &'static str| {
        let stacks = stacks.clone();
        async move { format!("{:?}", stacks.get(name).await.ok().and_then(|s| s.status)) }
    };
    for (name, commit) in [
        ("app", &app_first),
        ("ssh-key", &ssh_commit),
        ("ssh-pass", &ssh_commit),
    ] {
        if let Err(err) = resolved(&workspaces, name, commit).await {
            panic!("{err}: {}\n{}", status(name).await, sshd.log());
        }
    }
    // The App's credentials travel to the workspace by reference.
    let ws = workspaces.get("app").await.expect("workspace");
    assert_eq!(
        serde_json::to_value(ws.spec.git.and_then(|g| g.auth)).expect("json"),
        json!({"githubApp": {"appID": {"name": "app", "key": "id"}, "installationID": {"name": "app", "key": "installation"}, "privateKey": {"name": "app", "key": "key"}}})
    );

    // A host key other than the one known: the stack stalls saying so.
    let message = wait_for("ssh-wrong to stall", WAIT, || async {
        let status = stacks.get("ssh-wrong").await.ok()?.status?;
        status
            .conditions
            .iter()
            .find(|c| c.type_ == "Stalled" && c.status == "True" && c.reason == "SourceUnavailable")
            .map(|c| c.message.clone())
    })
    .await
    .expect("stalled");
    assert!(
        message.contains("does not match the one knownHosts lists"),
        "{message}"
    );
    assert!(
        workspaces
            .get_opt("ssh-wrong")
            .await
            .expect("get")
            .is_none()
    );

    // A new commit is found with the cached token: one token for both lookups.
    let app_second = app_repo
        .commit("main", &[("Pulumi.yaml", PROGRAM)])
        .expect("commit");
    stacks
        .patch(
            "app",
            &PatchParams::default(),
            &Patch::Merge(json!({"metadata": {"annotations": {"pulumi.com/reconciliation-request": "again"}}})),
        )
        .await
        .expect("request a sync");
    if let Err(err) = resolved(&workspaces, "app", &app_second).await {
        panic!("{err}: {}", status("app").await);
    }
    let seen = api.seen();
    assert_eq!(seen.issued, 1, "{seen:?}");
    assert!(seen.refused.is_empty(), "{seen:?}");
}
