//! The operator's webhook flags (flattened into its command line).

use std::path::PathBuf;
use std::time::Duration;

use pko_api::duration::parse_go_duration;
use pko_api::tenancy::EnforcementAction;

use crate::tenancy::FileServerNames;
use crate::webhook::ReviewLimits;
use crate::{
    CertSettings, CertSource, EngineLimits, FailurePolicy, TenancySettings, WebhookConfig,
};

/// Errors in the webhook flags.
#[derive(Debug, thiserror::Error)]
pub enum CliError {
    #[error(
        "--webhook-addr is set but no policy bundle is: pass --policy-bundle (or set PKO_POLICY_BUNDLE) to the bundle built by `make policies`"
    )]
    NoBundle,
    #[error(
        "the namespace of the webhook certificate Secret is unknown: pass --webhook-cert-namespace or set POD_NAMESPACE"
    )]
    NoNamespace,
    #[error("--policy-file-server-host {0:?} is not a host[:port]")]
    FileServerHost(String),
    #[error("--policy-file-server-service {0:?} is not <name>.<namespace>")]
    FileServerService(String),
}

/// Admission webhook flags. The webhook is off unless `--webhook-addr` is set.
#[derive(clap::Args, Debug, Clone)]
pub struct WebhookArgs {
    /// Address of the HTTPS admission webhook (`/validate`, `/mutate`), e.g. ":9443". Empty:
    /// no webhook.
    #[arg(long, env = "WEBHOOK_ADDR", default_value = "")]
    pub webhook_addr: String,
    /// The policy bundle built by `make policies` (`opa build -t wasm`).
    #[arg(long, env = "PKO_POLICY_BUNDLE")]
    pub policy_bundle: Option<PathBuf>,
    /// What the webhook answers when a policy cannot be evaluated: Fail (refuse) or Ignore
    /// (admit with a warning). Either way it is logged and counted.
    #[arg(long, env = "POLICY_FAILURE_POLICY", default_value = "Fail")]
    pub policy_failure_policy: FailurePolicy,
    /// Enforcement action of violations in namespaces that no TenancyPolicy selects: deny,
    /// warn or dryrun.
    #[arg(long, env = "POLICY_DEFAULT_ACTION", default_value = "deny", value_parser = parse_action)]
    pub policy_default_action: EnforcementAction,
    /// Time budget of one policy evaluation (a Go duration). Keep it below the
    /// webhook configurations' timeoutSeconds.
    #[arg(long, env = "POLICY_TIMEOUT", default_value = "2s", value_parser = parse_go_duration)]
    pub policy_timeout: Duration,
    /// Linear memory one policy evaluation may use, in MiB.
    #[arg(long, env = "POLICY_MEMORY_MIB", default_value_t = 128)]
    pub policy_memory_mib: usize,
    /// Policy evaluations running at once (each on a blocking thread). Unset: as many as fit in
    /// the memory the container's limit leaves the webhook (see docs/operations.md), 1 to 16;
    /// 4 when no limit is known.
    #[arg(long, env = "POLICY_CONCURRENCY")]
    pub policy_concurrency: Option<usize>,
    /// Requests that may wait for an evaluation slot; more are answered 429 at once.
    #[arg(long, env = "POLICY_MAX_WAITING", default_value_t = 64)]
    pub policy_max_waiting: usize,
    /// Connections the webhook keeps open at once; more are closed as soon as accepted.
    #[arg(long, env = "WEBHOOK_MAX_CONNECTIONS", default_value_t = 128)]
    pub webhook_max_connections: usize,
    /// Connections one client address keeps open at once; more from it are closed as soon as
    /// accepted, so one pod holding connections open cannot lock the apiserver out. Default:
    /// a quarter of --webhook-max-connections.
    #[arg(long, env = "WEBHOOK_MAX_CONNECTIONS_PER_CLIENT")]
    pub webhook_max_connections_per_client: Option<usize>,
    /// MiB of request bodies being read or parsed at once, across connections; a request that
    /// would go over is answered 429. Each body is at most 6 MiB.
    #[arg(long, env = "WEBHOOK_BODY_BUDGET_MIB", default_value_t = 24)]
    pub webhook_body_budget_mib: usize,
    /// Time a request body may take to arrive; a slower one is answered 408.
    #[arg(long, env = "WEBHOOK_BODY_TIMEOUT", default_value = "10s", value_parser = parse_go_duration)]
    pub webhook_body_timeout: Duration,
    /// Slowest rate (KiB/s) a request body may arrive at after its first second; a slower one
    /// is answered 408 ("0": no minimum).
    #[arg(long, env = "WEBHOOK_BODY_MIN_RATE_KIB", default_value_t = 64)]
    pub webhook_body_min_rate_kib: usize,
    /// A connection without a request in flight for this long is closed (HTTP/1 keep-alive
    /// and HTTP/2). Keep it above the apiserver's idle timeout (90 s), which then closes first.
    #[arg(long, env = "WEBHOOK_IDLE_TIMEOUT", default_value = "120s", value_parser = parse_go_duration)]
    pub webhook_idle_timeout: Duration,
    /// A connection whose peer does not read an answer for this long is closed.
    #[arg(long, env = "WEBHOOK_WRITE_TIMEOUT", default_value = "10s", value_parser = parse_go_duration)]
    pub webhook_write_timeout: Duration,
    /// Hosts (`host[:port]`) of the operator's file server in artifact URLs; URLs on them are
    /// checked for cross-namespace Programs. Default: the host of --program-fs-adv-addr.
    #[arg(
        long = "policy-file-server-host",
        env = "POLICY_FILE_SERVER_HOSTS",
        value_delimiter = ','
    )]
    pub policy_file_server_hosts: Vec<String>,
    /// The file server's Service (`<name>.<namespace>`): every DNS name of it, its ClusterIP
    /// and its ports count as the file server in artifact URLs.
    #[arg(long, env = "POLICY_FILE_SERVER_SERVICE")]
    pub policy_file_server_service: Option<String>,
    /// The cluster's DNS domain (for `<svc>.<ns>.svc.<domain>`).
    #[arg(long, env = "CLUSTER_DOMAIN", default_value = "cluster.local")]
    pub cluster_domain: String,
    /// Folder holding tls.crt and tls.key (e.g. a mounted cert-manager Secret). Unset: the
    /// operator manages a CA and a serving certificate in --webhook-cert-secret.
    #[arg(long, env = "WEBHOOK_CERT_DIR")]
    pub webhook_cert_dir: Option<PathBuf>,
    /// Secret holding the operator-managed CA and serving certificate.
    #[arg(
        long,
        env = "WEBHOOK_CERT_SECRET",
        default_value = "pko-rs-webhook-tls"
    )]
    pub webhook_cert_secret: String,
    /// Namespace of that Secret. Default: $POD_NAMESPACE.
    #[arg(long, env = "WEBHOOK_CERT_NAMESPACE")]
    pub webhook_cert_namespace: Option<String>,
    /// Name of the webhook's Service; its DNS names go into the serving certificate.
    #[arg(long, env = "WEBHOOK_SERVICE_NAME", default_value = "pko-rs-webhook")]
    pub webhook_service_name: String,
    /// Extra host names or IP addresses for the serving certificate (e.g. 127.0.0.1 when the
    /// apiserver calls the webhook by URL).
    #[arg(
        long = "webhook-cert-host",
        env = "WEBHOOK_CERT_HOSTS",
        value_delimiter = ','
    )]
    pub webhook_cert_hosts: Vec<String>,
    /// ValidatingWebhookConfigurations whose webhooks get the CA bundle ("" for none).
    #[arg(
        long,
        env = "WEBHOOK_VALIDATING_CONFIGURATIONS",
        default_value = "pko-rs-validating",
        value_delimiter = ','
    )]
    pub webhook_validating_configuration: Vec<String>,
    /// MutatingWebhookConfigurations whose webhooks get the CA bundle ("" for none).
    #[arg(
        long,
        env = "WEBHOOK_MUTATING_CONFIGURATIONS",
        default_value = "pko-rs-mutating",
        value_delimiter = ','
    )]
    pub webhook_mutating_configuration: Vec<String>,
    /// How often the certificate is checked (and renewed) and the CA bundles re-injected.
    #[arg(long, env = "WEBHOOK_CERT_CHECK_INTERVAL", default_value = "60s", value_parser = parse_go_duration)]
    pub webhook_cert_check_interval: Duration,
    /// How long in-flight webhook requests may finish after shutdown starts.
    #[arg(long, env = "WEBHOOK_DRAIN_TIMEOUT", default_value = "10s", value_parser = parse_go_duration)]
    pub webhook_drain_timeout: Duration,
}

impl WebhookArgs {
    /// The names and ports the file server answers to (`--policy-file-server-host`, else the
    /// advertised `host[:port]`; every DNS name of `--policy-file-server-service`), and that
    /// Service as (name, namespace) so its ClusterIP can be added once known. The webhook and
    /// the Workspace controller judge flux URLs by the same names.
    pub fn file_server_names(
        &self,
        advertised_host: Option<&str>,
    ) -> Result<(FileServerNames, Option<(String, String)>), CliError> {
        let mut names = FileServerNames::default();
        let mut hosts = non_empty(&self.policy_file_server_hosts);
        if hosts.is_empty()
            && let Some(host) = advertised_host.filter(|h| !h.is_empty())
        {
            hosts.push(host.to_owned());
        }
        for entry in &hosts {
            let (host, port) = crate::urls::host_and_port(entry)
                .ok_or_else(|| CliError::FileServerHost(entry.clone()))?;
            names.add(host, Some(port));
        }
        let service = match self.policy_file_server_service.as_deref() {
            Some(service) if !service.trim().is_empty() => {
                let (name, namespace) = service
                    .trim()
                    .split_once('.')
                    .filter(|(n, ns)| !n.is_empty() && !ns.is_empty() && !ns.contains('.'))
                    .ok_or_else(|| CliError::FileServerService(service.to_owned()))?;
                names.add_service(name, namespace, &self.cluster_domain);
                Some((name.to_owned(), namespace.to_owned()))
            }
            _ => None,
        };
        Ok((names, service))
    }

    /// Whether the webhook runs.
    pub fn enabled(&self) -> bool {
        !(self.webhook_addr.trim().is_empty() || self.webhook_addr == "0")
    }

    /// Request-body limits.
    pub fn review_limits(&self) -> ReviewLimits {
        ReviewLimits {
            body_budget_bytes: self.webhook_body_budget_mib.saturating_mul(1 << 20),
            body_timeout: self.webhook_body_timeout,
            min_body_bytes_per_sec: self.webhook_body_min_rate_kib.saturating_mul(1 << 10),
            ..ReviewLimits::DEFAULT
        }
    }

    /// Memory one evaluation slot holds: the policy instance's cap and a parsed review.
    pub fn per_slot_bytes(&self) -> u64 {
        let memory = self.policy_memory_mib.saturating_mul(1 << 20);
        (memory.saturating_add(self.review_limits().parsed_bytes())) as u64
    }

    /// The webhook configuration, or `None` when `--webhook-addr` is empty. `slots` is the
    /// concurrency the memory plan decided.
    /// `advertised_host` is the file server's advertised `host[:port]`; `pod_namespace` is
    /// `$POD_NAMESPACE`.
    ///
    /// The names of the file server come from [`Self::file_server_names`].
    pub fn config(
        &self,
        advertised_host: Option<&str>,
        pod_namespace: Option<&str>,
        slots: usize,
    ) -> Result<Option<WebhookConfig>, CliError> {
        if !self.enabled() {
            return Ok(None);
        }
        let bundle = self
            .policy_bundle
            .clone()
            .filter(|p| !p.as_os_str().is_empty())
            .ok_or(CliError::NoBundle)?;
        let (file_server, file_server_service) = self.file_server_names(advertised_host)?;
        let certs = match &self.webhook_cert_dir {
            Some(dir) => CertSource::Files(dir.clone()),
            None => {
                let namespace = self
                    .webhook_cert_namespace
                    .clone()
                    .or_else(|| pod_namespace.map(str::to_owned))
                    .filter(|n| !n.is_empty())
                    .ok_or(CliError::NoNamespace)?;
                let service = &self.webhook_service_name;
                let mut hosts = vec![
                    format!("{service}.{namespace}.svc"),
                    format!("{service}.{namespace}.svc.cluster.local"),
                    format!("{service}.{namespace}"),
                ];
                hosts.extend(non_empty(&self.webhook_cert_hosts));
                let mut settings =
                    CertSettings::new(namespace, self.webhook_cert_secret.clone(), hosts);
                settings.validating_configurations =
                    non_empty(&self.webhook_validating_configuration);
                settings.mutating_configurations = non_empty(&self.webhook_mutating_configuration);
                settings.check_interval = self.webhook_cert_check_interval;
                CertSource::Managed(settings)
            }
        };
        Ok(Some(WebhookConfig {
            addr: self.webhook_addr.clone(),
            bundle,
            limits: EngineLimits {
                timeout: self.policy_timeout,
                memory_bytes: self.policy_memory_mib.saturating_mul(1024 * 1024),
                concurrency: slots.max(1),
                max_waiting: self.policy_max_waiting,
            },
            review: self.review_limits(),
            max_connections: self.webhook_max_connections.max(1),
            max_connections_per_client: self.webhook_max_connections_per_client,
            conn: crate::conn::ConnLimits {
                idle_timeout: self.webhook_idle_timeout,
                write_timeout: self.webhook_write_timeout,
            },
            failure_policy: self.policy_failure_policy,
            tenancy: TenancySettings {
                default_action: self.policy_default_action,
                file_server,
            },
            file_server_service,
            certs,
            drain: self.webhook_drain_timeout,
        }))
    }
}

fn non_empty(values: &[String]) -> Vec<String> {
    values
        .iter()
        .map(|v| v.trim().to_owned())
        .filter(|v| !v.is_empty())
        .collect()
}

fn parse_action(s: &str) -> Result<EnforcementAction, String> {
    match s {
        "deny" => Ok(EnforcementAction::Deny),
        "warn" => Ok(EnforcementAction::Warn),
        "dryrun" => Ok(EnforcementAction::Dryrun),
        other => Err(format!("unknown action {other:?} (deny, warn or dryrun)")),
    }
}

#[cfg(test)]
mod tests {
    use clap::Parser;

    use super::*;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        webhook: WebhookArgs,
    }

    #[test]
    fn off_by_default() {
        let cli = Cli::parse_from(["x"]);
        assert!(cli.webhook.config(None, None, 4).expect("ok").is_none());
    }

    #[test]
    fn managed_certificates_cover_the_service_and_extra_hosts() {
        let cli = Cli::parse_from([
            "x",
            "--webhook-addr=127.0.0.1:9443",
            "--policy-bundle=/b.tar.gz",
            "--webhook-cert-host=127.0.0.1",
            "--policy-timeout=500ms",
            "--policy-default-action=warn",
            "--webhook-validating-configuration=a,b",
        ]);
        let config = cli
            .webhook
            .config(Some("fs.ns:80"), Some("pko-rs-system"), 4)
            .expect("ok")
            .expect("on");
        assert_eq!(config.limits.timeout, Duration::from_millis(500));
        assert_eq!(config.tenancy.default_action, EnforcementAction::Warn);
        assert_eq!(config.tenancy.file_server.hosts, vec!["fs.ns"]);
        assert_eq!(config.tenancy.file_server.ports, vec![80]);
        match config.certs {
            CertSource::Managed(settings) => {
                assert_eq!(settings.namespace, "pko-rs-system");
                assert!(
                    settings
                        .hosts
                        .contains(&"pko-rs-webhook.pko-rs-system.svc".to_owned())
                );
                assert!(settings.hosts.contains(&"127.0.0.1".to_owned()));
                assert_eq!(settings.validating_configurations, vec!["a", "b"]);
                assert_eq!(settings.mutating_configurations, vec!["pko-rs-mutating"]);
            }
            CertSource::Files(_) => panic!("expected managed certificates"),
        }
    }

    #[test]
    fn missing_inputs_are_named() {
        let mut args = Cli::parse_from(["x", "--webhook-addr=:9443"]).webhook;
        // PKO_POLICY_BUNDLE may be set in the test environment.
        args.policy_bundle = None;
        assert!(matches!(
            args.config(None, Some("ns"), 4),
            Err(CliError::NoBundle)
        ));
        let cli = Cli::parse_from(["x", "--webhook-addr=:9443", "--policy-bundle=/b"]);
        assert!(matches!(
            cli.webhook.config(None, None, 4),
            Err(CliError::NoNamespace)
        ));
    }

    /// The flags take Go durations, with the parser's reason when refused.
    #[test]
    fn durations() {
        let timeout = |value: &str| {
            Cli::try_parse_from(["x", &format!("--policy-timeout={value}")])
                .map(|cli| cli.webhook.policy_timeout)
                .map_err(|e| e.to_string())
        };
        assert_eq!(timeout("250ms"), Ok(Duration::from_millis(250)));
        assert_eq!(timeout("1m30s"), Ok(Duration::from_secs(90)));
        assert_eq!(timeout("1.5s"), Ok(Duration::from_millis(1500)));
        let missing = timeout("3").expect_err("no unit");
        assert!(missing.contains("missing unit"), "{missing}");
        let unknown = timeout("2 days").expect_err("unknown unit");
        assert!(unknown.contains("unknown unit"), "{unknown}");
    }
}
