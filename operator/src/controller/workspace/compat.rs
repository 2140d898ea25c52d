//! Which agent contract a workspace follows, and what its agent can do: the decisions that let
//! pko-rs run PKO's agent (and PKO's pod layout) as well as its own, as pure functions.
//!
//! A Workspace asks for PKO's contract with the annotation [`AGENT_ANNOTATION`]`: pko` (a Stack
//! sets it through `workspaceTemplate.metadata.annotations`); pko-rs's is the default. The
//! agent image is not guessed from its name (mirrors, digests and retags make any such guess
//! wrong sometimes); what the agent can do is asked instead: pko-rs's agent answers the
//! `Capabilities` RPC, PKO's answers `Unimplemented`. The answer is cached per workspace pod.
//!
//! Under PKO's contract the environment (`spec.env`) is pushed over RPC when the agent can take
//! it (pko-rs's agent in PKO's layout), else it goes on the container as PKO puts it: the pod
//! restarts once, and the pod template records which agent image could not take it, so the
//! choice survives an operator restart and is asked again only when the image changes.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::Pod;
use pko_agent_api::features;
use pko_agent_api::proto as pb;

use crate::controller::keys::AGENT_ANNOTATION;

/// The value of [`AGENT_ANNOTATION`] that asks for PKO's contract.
pub const PKO: &str = "pko";
/// The value (or absence) that keeps pko-rs's.
pub const PKO_RS: &str = "pko-rs";

/// How a workspace's agent is run and reached.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum AgentMode {
    /// pko-rs's: `pko-agent install-self`, TLS pinned to the workspace's certificate, a random
    /// token from its Secret.
    #[default]
    PkoRs,
    /// PKO's: `cp /agent /tini /share/`, `sh -c` fetch, `tini agent -- serve --auth-mode kube`,
    /// plaintext gRPC with the operator's service-account token for the workspace's audience.
    Pko,
}

/// The mode a Workspace's annotations ask for; any other value is an error to report.
pub fn agent_mode(annotations: Option<&BTreeMap<String, String>>) -> Result<AgentMode, String> {
    match annotations
        .and_then(|a| a.get(AGENT_ANNOTATION))
        .map(String::as_str)
    {
        None | Some(PKO_RS) | Some("") => Ok(AgentMode::PkoRs),
        Some(PKO) => Ok(AgentMode::Pko),
        Some(other) => Err(format!(
            "annotation {AGENT_ANNOTATION} is {other:?}: it may be {PKO:?} (PKO's agent layout and auth mode) or {PKO_RS:?} (the default)"
        )),
    }
}

/// The audience of the tokens a PKO-mode agent accepts (PKO's `<ws>.<ns>`).
pub fn audience(workspace: &str, namespace: &str) -> String {
    format!("{workspace}.{namespace}")
}

/// What an agent can do beyond PKO v2.9's protocol.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Features {
    /// `SetEnvironmentVariables`.
    pub set_environment_variables: bool,
    /// Answers carry the instance header (a restart is seen as a new instance).
    pub instance_header: bool,
    /// `RefreshRequest.preview_only` is honoured (a refresh that writes no state).
    pub refresh_preview_only: bool,
    /// `PreviewRequest.save_plan` and `UpRequest.plan` are honoured.
    pub update_plans: bool,
    /// `UpdateSource`: a new source revision in the running agent.
    pub update_source: bool,
}

impl Features {
    /// PKO's agent: nothing beyond its protocol.
    pub const PKO: Features = Features {
        set_environment_variables: false,
        instance_header: false,
        refresh_preview_only: false,
        update_plans: false,
        update_source: false,
    };
}

/// What the answer to `Capabilities` says: the features listed, none when the agent does not
/// know the RPC (PKO's). `None` for another failure (the agent could not be asked).
pub fn features(answer: Result<&pb::CapabilitiesResult, tonic::Code>) -> Option<Features> {
    match answer {
        Ok(result) => {
            let has = |f: &str| result.features.iter().any(|x| x == f);
            Some(Features {
                set_environment_variables: has(features::SET_ENVIRONMENT_VARIABLES),
                instance_header: has(features::INSTANCE_HEADER),
                refresh_preview_only: has(features::REFRESH_PREVIEW_ONLY),
                update_plans: has(features::UPDATE_PLANS),
                update_source: has(features::UPDATE_SOURCE),
            })
        }
        Err(tonic::Code::Unimplemented) => Some(Features::PKO),
        Err(_) => None,
    }
}

/// Whether `spec.env` goes on the container of a workspace whose agent comes from `image`:
/// under pko-rs's contract never (it is pushed); under PKO's when the agent of that image is
/// known not to take it over RPC: learned from this operator's own question when it asked an
/// agent of that image, else from the mark the pod template carries (`marked_image`).
pub fn env_in_pod_spec(
    mode: AgentMode,
    image: &str,
    learned: Option<(&str, Features)>,
    marked_image: Option<&str>,
) -> bool {
    match mode {
        AgentMode::PkoRs => false,
        AgentMode::Pko => match learned {
            Some((learned_image, f)) if learned_image == image => !f.set_environment_variables,
            _ => marked_image == Some(image),
        },
    }
}

/// How the environment reaches the agent this time.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EnvDelivery {
    /// `SetEnvironmentVariables`.
    Rpc,
    /// It is on the container already: nothing to send.
    OnPod,
    /// The agent cannot take it and the pod does not have it: the pod spec gets it (one
    /// restart) before the agent is initialized.
    MoveToPod,
}

/// Decides [`EnvDelivery`] from what the agent can do and whether the pod carries the env.
pub fn env_delivery(features: Features, env_in_pod: bool) -> EnvDelivery {
    match (env_in_pod, features.set_environment_variables) {
        (true, _) => EnvDelivery::OnPod,
        (false, true) => EnvDelivery::Rpc,
        (false, false) => EnvDelivery::MoveToPod,
    }
}

/// The agent's identity for "was it told the workspace already": the instance id it sends,
/// else (PKO's agent sends none) the pod's uid and its agent container's restart count, which
/// change exactly when a new agent process starts.
pub fn instance_of(header: Option<&str>, pod: Option<&Pod>) -> String {
    if let Some(h) = header.filter(|h| !h.is_empty()) {
        return h.to_owned();
    }
    let Some(pod) = pod else {
        return String::new();
    };
    let uid = pod.metadata.uid.as_deref().unwrap_or_default();
    let restarts = pod
        .status
        .as_ref()
        .and_then(|s| s.container_statuses.as_ref())
        .and_then(|c| c.iter().find(|c| c.name == "pulumi"))
        .map_or(0, |c| c.restart_count);
    format!("pod-{uid}-{restarts}")
}

/// The condition message of a call the agent refused under PKO's auth mode, saying what to fix;
/// `None` when the failure is not a refusal.
pub fn refusal(
    code: tonic::Code,
    message: &str,
    workspace_service_account: &str,
    operator_service_account: Option<&str>,
) -> Option<String> {
    let operator = operator_service_account.unwrap_or("the operator's service account");
    match code {
        tonic::Code::Unauthenticated
            if message.contains("TokenReview API is unavailable")
                || message.contains("SubjectAccessReview API is unavailable") =>
        {
            Some(format!(
                "the workspace agent cannot review the operator's token ({message}): bind the workspace's service account {workspace_service_account} to the ClusterRole system:auth-delegator"
            ))
        }
        tonic::Code::Unauthenticated => Some(format!(
            "the workspace agent refused the token of {operator} ({message}): the token must be minted for the workspace's audience"
        )),
        tonic::Code::PermissionDenied => Some(format!(
            "the workspace agent denied {operator} ({message}): grant it the verb use on workspaces/rpc (group auto.pulumi.com)"
        )),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn the_annotation_chooses_the_contract() {
        let with = |v: &str| BTreeMap::from([(AGENT_ANNOTATION.to_owned(), v.to_owned())]);
        assert_eq!(agent_mode(None), Ok(AgentMode::PkoRs));
        assert_eq!(agent_mode(Some(&BTreeMap::new())), Ok(AgentMode::PkoRs));
        assert_eq!(agent_mode(Some(&with("pko-rs"))), Ok(AgentMode::PkoRs));
        assert_eq!(agent_mode(Some(&with("pko"))), Ok(AgentMode::Pko));
        let err = agent_mode(Some(&with("PKO"))).expect_err("refused");
        assert!(err.contains("may be \"pko\""), "{err}");
        assert_eq!(audience("ws", "ns"), "ws.ns");
    }

    #[test]
    fn pkos_agent_is_told_by_its_unimplemented_answer() {
        let ours = pb::CapabilitiesResult {
            agent: "pko-agent 0.1.0".into(),
            features: vec![
                "set-environment-variables".into(),
                "instance-header".into(),
                "refresh-preview-only".into(),
                "update-source".into(),
                "from-the-future".into(),
            ],
        };
        assert_eq!(
            features(Ok(&ours)),
            Some(Features {
                set_environment_variables: true,
                instance_header: true,
                refresh_preview_only: true,
                update_plans: false,
                update_source: true,
            })
        );
        assert_eq!(
            features(Err(tonic::Code::Unimplemented)),
            Some(Features::PKO)
        );
        assert_eq!(features(Err(tonic::Code::Unavailable)), None);
        assert_eq!(features(Err(tonic::Code::Unauthenticated)), None);
    }

    #[test]
    fn the_environment_moves_to_the_pod_once_and_stays() {
        let pko = Features::PKO;
        let ours = Features {
            set_environment_variables: true,
            instance_header: true,
            refresh_preview_only: true,
            update_plans: true,
            update_source: true,
        };
        // pko-rs's contract: always pushed.
        assert!(!env_in_pod_spec(
            AgentMode::PkoRs,
            "img",
            Some(("img", pko)),
            Some("img")
        ));
        // Nothing known yet: pushed first.
        assert!(!env_in_pod_spec(AgentMode::Pko, "pko:2.9", None, None));
        // PKO's agent answered: on the pod; and a restarted operator reads the mark.
        assert!(env_in_pod_spec(
            AgentMode::Pko,
            "pko:2.9",
            Some(("pko:2.9", pko)),
            None
        ));
        assert!(env_in_pod_spec(
            AgentMode::Pko,
            "pko:2.9",
            None,
            Some("pko:2.9")
        ));
        // Another image: asked again (what was learned was about another agent).
        assert!(!env_in_pod_spec(
            AgentMode::Pko,
            "ours",
            Some(("pko:2.9", pko)),
            Some("pko:2.9")
        ));
        assert!(!env_in_pod_spec(
            AgentMode::Pko,
            "ours",
            Some(("ours", ours)),
            None
        ));

        assert_eq!(env_delivery(ours, false), EnvDelivery::Rpc);
        assert_eq!(env_delivery(pko, false), EnvDelivery::MoveToPod);
        assert_eq!(env_delivery(pko, true), EnvDelivery::OnPod);
        assert_eq!(env_delivery(ours, true), EnvDelivery::OnPod);
    }

    #[test]
    fn an_agent_without_an_instance_id_is_known_by_its_pod_and_restarts() {
        let pod: Pod = serde_json::from_value(json!({
            "metadata": {"uid": "u-1"},
            "status": {"containerStatuses": [
                {"name": "sidecar", "restartCount": 7, "ready": true, "image": "", "imageID": ""},
                {"name": "pulumi", "restartCount": 2, "ready": true, "image": "", "imageID": ""}
            ]}
        }))
        .expect("pod");
        assert_eq!(instance_of(Some("abc"), Some(&pod)), "abc");
        assert_eq!(instance_of(None, Some(&pod)), "pod-u-1-2");
        assert_eq!(instance_of(Some(""), Some(&pod)), "pod-u-1-2");
        assert_eq!(instance_of(None, None), "");
    }

    #[test]
    fn refusals_say_what_to_fix() {
        let delegator = refusal(
            tonic::Code::Unauthenticated,
            "TokenReview API is unavailable",
            "ns/pulumi",
            Some("sys/op"),
        )
        .expect("refusal");
        assert!(delegator.contains("bind the workspace's service account ns/pulumi to the ClusterRole system:auth-delegator"), "{delegator}");
        let audience = refusal(
            tonic::Code::Unauthenticated,
            "unauthenticated",
            "ns/pulumi",
            Some("sys/op"),
        )
        .expect("refusal");
        assert!(
            audience.contains("refused the token of sys/op"),
            "{audience}"
        );
        let denied = refusal(
            tonic::Code::PermissionDenied,
            "forbidden",
            "ns/pulumi",
            None,
        )
        .expect("refusal");
        assert!(denied.contains("use on workspaces/rpc"), "{denied}");
        assert_eq!(
            refusal(tonic::Code::Unavailable, "x", "ns/pulumi", None),
            None
        );
    }
}
