//! What the execution tests (Workspaces, Updates, Stacks) start from: a namespace of their
//! own, the harness's kubelet running agents there, and an operator watching it.

use std::time::Duration;

use kube::Api;
use pko_api::stack::{Stack, StackStatus};

use crate::kubelet::{ApiAccess, Kubelet, KubeletOptions};
use crate::operator::{Operator, OperatorOptions};
use crate::{ControlPlane, wait_for};

/// A started execution environment.
pub struct Execution {
    pub plane: &'static ControlPlane,
    pub ns: String,
    /// Holds `backend/` (a `file://` state backend, created empty) and `pods/` (the kubelet's).
    pub tmp: tempfile::TempDir,
    pub kubelet: Kubelet,
    pub operator: Operator,
}

impl Execution {
    /// A namespace named after `prefix`, its kubelet, and an operator watching it (workspace
    /// agents reached on loopback) with `operator_args` added.
    pub async fn start(prefix: &str, operator_args: &[&str]) -> Self {
        Self::start_with(prefix, |_| {
            operator_args.iter().map(|a| (*a).to_owned()).collect()
        })
        .await
    }

    /// [`Self::start`] with the operator's extra arguments made from the namespace's name.
    pub async fn start_with(prefix: &str, operator_args: impl FnOnce(&str) -> Vec<String>) -> Self {
        Self::start_with_env(prefix, operator_args, &[]).await
    }

    /// [`Self::start_with`] with `env` added to the operator's environment (e.g.
    /// `SSL_CERT_FILE` for a test server's CA).
    pub async fn start_with_env(
        prefix: &str,
        operator_args: impl FnOnce(&str) -> Vec<String>,
        env: &[(&str, &str)],
    ) -> Self {
        Self::start_full(prefix, operator_args, env, None).await
    }

    /// [`Self::start`] with `cert` (PEM, e.g. a test git server's) trusted by the operator
    /// (`SSL_CERT_FILE`) and by every pod's images.
    pub async fn start_trusting(prefix: &str, cert: &str) -> Self {
        Self::start_full(prefix, |_| Vec::new(), &[], Some(cert)).await
    }

    /// [`Self::start`] whose kubelet logs every `pulumi` command the agents run
    /// ([`Kubelet::pulumi_calls`]).
    pub async fn start_logging_pulumi(prefix: &str) -> Self {
        let options = KubeletOptions {
            log_pulumi_calls: true,
            ..KubeletOptions::default()
        };
        Self::start_full_with(prefix, |_| Vec::new(), &[], None, options).await
    }

    async fn start_full(
        prefix: &str,
        operator_args: impl FnOnce(&str) -> Vec<String>,
        env: &[(&str, &str)],
        cert: Option<&str>,
    ) -> Self {
        Self::start_full_with(prefix, operator_args, env, cert, KubeletOptions::default()).await
    }

    async fn start_full_with(
        prefix: &str,
        operator_args: impl FnOnce(&str) -> Vec<String>,
        env: &[(&str, &str)],
        cert: Option<&str>,
        options: KubeletOptions,
    ) -> Self {
        let plane = ControlPlane::shared().await;
        let ns = plane.namespace(prefix).await.expect("namespace");
        let tmp = tempfile::tempdir().expect("tmp");
        std::fs::create_dir_all(tmp.path().join("backend")).expect("backend");
        let options = KubeletOptions {
            api: Some(ApiAccess::of(plane)),
            trusted_certs: cert.map(str::to_owned).into_iter().collect(),
            ..options
        };
        let kubelet = Kubelet::start_with(plane.client(), &ns, &tmp.path().join("pods"), options)
            .expect("kubelet");
        let cert_file = tmp.path().join("trusted.pem");
        let mut env: Vec<(&str, &str)> = env.to_vec();
        let cert_path = cert_file.display().to_string();
        if let Some(cert) = cert {
            std::fs::write(&cert_file, cert).expect("trusted certificate");
            env.push(("SSL_CERT_FILE", &cert_path));
        }
        let operator = Operator::start_with_env(
            plane,
            OperatorOptions {
                advertised: None,
                args: [
                    format!("--watch-namespace={ns}"),
                    "--workspace-localhost=127.0.0.1".into(),
                ]
                .into_iter()
                .chain(operator_args(&ns))
                .collect(),
            },
            &env,
        )
        .await
        .expect("operator");
        Self {
            plane,
            ns,
            tmp,
            kubelet,
            operator,
        }
    }

    /// Stack `name`'s status, once it has one.
    pub async fn stack_status(&self, name: &str) -> Option<StackStatus> {
        let stacks: Api<Stack> = Api::namespaced(self.plane.client(), &self.ns);
        stacks.get(name).await.ok()?.status
    }

    /// Waits up to `timeout` for what `check` finds in Stack `name`'s status, showing the
    /// status and the workspace's logs when it never comes.
    pub async fn until_stack<T>(
        &self,
        name: &str,
        what: &str,
        timeout: Duration,
        check: impl Fn(&StackStatus) -> Option<T>,
    ) -> T {
        let found = wait_for(what, timeout, || async {
            let status = self.stack_status(name).await?;
            check(&status)
        })
        .await;
        match found {
            Ok(found) => found,
            Err(e) => panic!(
                "{e}: {:?}\n{}",
                self.stack_status(name).await,
                self.kubelet.logs(name)
            ),
        }
    }
}
