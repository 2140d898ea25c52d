//! Whether the agent an Update reaches is the process its Workspace controller initialized. A
//! restarted agent knows neither the environment nor the stacks until the Workspace controller
//! tells it again, and the Workspace can still say `Ready=True` of its predecessor (the
//! kubelet's report of the restart not in yet): an operation started there fails (no backend
//! URL, no access token). Every agent answer carries its instance id; the Workspace controller
//! records the one it initialized on the pod.

use k8s_openapi::api::core::v1::Pod;
use kube::api::Api;
use pko_agent_api::client::AgentClient;
use pko_agent_api::proto as pb;

use super::UpdateError;
use crate::controller::kit::FromKube;
use crate::controller::workspace::compat::Features;
use crate::controller::workspace::{self, compat, pod};

/// What the agent's instance and the Workspace's record say.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum AgentCheck {
    /// The agent is the one the Workspace controller initialized; what it can do.
    Initialized(Features),
    /// It is not (yet): the message says which instance answered and which was initialized.
    NotInitialized(String),
}

/// Asks the agent who it is (`Capabilities`: no Pulumi command runs; PKO's agent answers
/// Unimplemented and sends no id, so its pod's restart count stands for it) and compares it with
/// what the workspace pod records, with the features it lists. `Err` with a message when the
/// agent does not answer.
pub(super) async fn check(
    client: &mut AgentClient,
    kube: &kube::Client,
    namespace: &str,
    ws_name: &str,
) -> Result<Result<AgentCheck, String>, UpdateError> {
    let (header, features) = match client.capabilities(pb::CapabilitiesRequest {}).await {
        Ok(answer) => (
            instance_header(answer.metadata()),
            compat::features(Ok(answer.get_ref())).unwrap_or(Features::PKO),
        ),
        Err(s) if s.code() == tonic::Code::Unimplemented => {
            (instance_header(s.metadata()), Features::PKO)
        }
        Err(s) => return Ok(Err(format!("Capabilities failed: {}", s.message()))),
    };
    let pods: Api<Pod> = Api::namespaced(kube.clone(), namespace);
    let pod_name = format!("{}-0", pod::workload_name(ws_name));
    let pod = pods
        .get_opt(&pod_name)
        .await
        .map_err(UpdateError::kube(format!("reading pod {pod_name}")))?;
    let instance = compat::instance_of(header.as_deref(), pod.as_ref());
    let told = pod.as_ref().and_then(workspace::initialized_instance);
    Ok(Ok(decide(ws_name, &instance, told.as_deref(), features)))
}

fn instance_header(metadata: &tonic::metadata::MetadataMap) -> Option<String> {
    metadata
        .get(pko_agent_api::INSTANCE_HEADER)
        .and_then(|v| v.to_str().ok())
        .map(str::to_owned)
}

/// The agent answering as `instance` may run operations only when it is the one the Workspace
/// controller initialized (`told`).
fn decide(ws_name: &str, instance: &str, told: Option<&str>, features: Features) -> AgentCheck {
    match told {
        Some(told) if !instance.is_empty() && told == instance => AgentCheck::Initialized(features),
        Some(told) => AgentCheck::NotInitialized(format!(
            "waiting for workspace {ws_name} to initialize its agent: instance {instance} answers, {told} was initialized (the agent restarted)"
        )),
        None => AgentCheck::NotInitialized(format!(
            "waiting for workspace {ws_name} to initialize its agent (instance {instance})"
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_the_initialized_instance_runs_operations() {
        assert_eq!(
            decide("ws", "a1", Some("a1"), Features::PKO),
            AgentCheck::Initialized(Features::PKO)
        );
        let restarted = decide("ws", "b2", Some("a1"), Features::PKO);
        assert!(
            matches!(&restarted, AgentCheck::NotInitialized(m) if m.contains("b2") && m.contains("a1")),
            "{restarted:?}"
        );
        assert!(matches!(
            decide("ws", "a1", None, Features::PKO),
            AgentCheck::NotInitialized(_)
        ));
        // An agent whose identity cannot be told (no id, no pod) never matches.
        assert!(matches!(
            decide("ws", "", Some(""), Features::PKO),
            AgentCheck::NotInitialized(_)
        ));
    }
}
