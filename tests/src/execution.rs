//! What the execution tests (Workspaces, Updates, Stacks) start from: a namespace of their
//! own, the harness's kubelet running agents there, and an operator watching it.

use crate::ControlPlane;
use crate::kubelet::{ApiAccess, Kubelet, KubeletOptions};
use crate::operator::{Operator, OperatorOptions};

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
        let plane = ControlPlane::shared().await;
        let ns = plane.namespace(prefix).await.expect("namespace");
        let tmp = tempfile::tempdir().expect("tmp");
        std::fs::create_dir_all(tmp.path().join("backend")).expect("backend");
        let kubelet = Kubelet::start_on(plane, &ns, &tmp.path().join("pods")).expect("kubelet");
        Self::with_kubelet(plane, ns, tmp, kubelet, operator_args, env).await
    }

    /// [`Self::start`] whose pods' images trust `certs` (PEM) beside the host's CAs, as an
    /// image built with a company CA does (a test HTTPS server's certificate).
    pub async fn start_trusting(prefix: &str, certs: Vec<String>) -> Self {
        let plane = ControlPlane::shared().await;
        let ns = plane.namespace(prefix).await.expect("namespace");
        let tmp = tempfile::tempdir().expect("tmp");
        std::fs::create_dir_all(tmp.path().join("backend")).expect("backend");
        let options = KubeletOptions {
            api: Some(ApiAccess::of(plane)),
            trusted_certs: certs,
            ..KubeletOptions::default()
        };
        let kubelet = Kubelet::start_with(plane.client(), &ns, &tmp.path().join("pods"), options)
            .expect("kubelet");
        Self::with_kubelet(plane, ns, tmp, kubelet, |_| Vec::new(), &[]).await
    }

    async fn with_kubelet(
        plane: &'static ControlPlane,
        ns: String,
        tmp: tempfile::TempDir,
        kubelet: Kubelet,
        operator_args: impl FnOnce(&str) -> Vec<String>,
        env: &[(&str, &str)],
    ) -> Self {
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
            env,
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
}
