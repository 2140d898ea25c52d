//! The reconcile's decisions that need no apiserver and no agent: whether the StatefulSet is
//! ready, what a failed init container says, whether the agent's Pulumi can take the config,
//! whether the agent must be told the workspace again, and whether the workload must be applied.

use k8s_openapi::api::apps::v1::StatefulSet;
use k8s_openapi::api::core::v1::Pod;
use pko_api::workspace::{ConfigItem, WorkspaceSpec};
use serde_json::Value;

use super::pod;
use crate::controller::keys::{
    INITIALIZED, RECONFIGURED, SOURCE_UPDATED, STACK_COMPONENT_LABEL, TEMPLATE_SHAPE_ANNOTATION,
};
use crate::controller::takeover::{self, Part};

/// A Stack's Workspace whose spec PKO's Stack controller applied (a switch-over): its Stack
/// applies it again with this operator's source, and the Workspace controller waits for that.
pub(super) fn waits_for_its_stack(ws: &pko_api::workspace::Workspace) -> bool {
    let stacks = ws
        .metadata
        .labels
        .as_ref()
        .and_then(|l| l.get(STACK_COMPONENT_LABEL))
        .is_some_and(|v| v == "stack");
    stacks && takeover::pko_owns(&ws.metadata, Part::Main)
}

/// What this process last applied as a Workspace's Service and StatefulSet.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct AppliedWorkload {
    /// A digest of the applied Service, as built.
    pub(crate) service: u64,
    /// A digest of the applied StatefulSet, as built.
    pub(crate) statefulset: u64,
    /// The StatefulSet's `metadata.generation` the apply returned.
    pub(crate) generation: Option<i64>,
}

/// Which of the workload's objects must be applied.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct MustApply {
    pub(super) service: bool,
    pub(super) statefulset: bool,
}

/// What must be applied again: not what this process applied as it is now, still there, and
/// (the StatefulSet) whose live spec has not changed since (its generation moves with any spec
/// change, whoever made it). Status updates do not count, so a Ready pod costs no apply, and a
/// pod template change (a new program, a new image) applies the StatefulSet alone.
pub(super) fn must_apply(
    last: Option<&AppliedWorkload>,
    service: u64,
    statefulset: u64,
    live_generation: Option<i64>,
    service_present: bool,
) -> MustApply {
    match last {
        Some(last) => MustApply {
            service: last.service != service || !service_present,
            statefulset: last.statefulset != statefulset
                || live_generation.is_none()
                || live_generation != last.generation,
        },
        None => MustApply {
            service: true,
            statefulset: true,
        },
    }
}

/// Structured config (objects, arrays, JSON values) needs `config set-all --json`.
pub(super) const STRUCTURED_CONFIG_MIN_VERSION: (u64, u64, u64) = (3, 202, 0);

/// The messages of a pod on its way (see [`not_ready`]).
pub(super) const STS_UNOBSERVED: &str = "waiting for the StatefulSet to be observed";
pub(super) const POD_UPDATING: &str = "the workspace pod is being updated";
pub(super) const POD_STARTING: &str = "waiting for the workspace pod to be ready";

/// Why a StatefulSet is not ready yet, or `None` when it is (PKO's rule). Under `OnDelete`
/// (pko-rs's layout) the revisions are the operator's to compare, pod by pod ([`rollout`]).
pub(super) fn not_ready(sts: &StatefulSet) -> Option<(&'static str, String)> {
    let generation = sts.metadata.generation;
    let Some(status) = &sts.status else {
        return Some(("RollingUpdate", STS_UNOBSERVED.into()));
    };
    let rolled_by_controller = !on_delete(sts);
    if status.observed_generation != generation
        || rolled_by_controller
            && status.update_revision.is_some()
            && status.update_revision != status.current_revision
    {
        return Some(("RollingUpdate", POD_UPDATING.into()));
    }
    if status.available_replicas.unwrap_or(0) < 1 {
        return Some(("WaitingForReplicas", POD_STARTING.into()));
    }
    None
}

/// Whether the StatefulSet leaves replacing its pod to the operator.
pub(super) fn on_delete(sts: &StatefulSet) -> bool {
    sts.spec
        .as_ref()
        .and_then(|s| s.update_strategy.as_ref())
        .and_then(|u| u.type_.as_deref())
        == Some(pod::ON_DELETE)
}

/// Whether an apply was refused because the live StatefulSet still has the `rollingUpdate` of
/// its former `RollingUpdate` strategy (the apiserver's 422 names the field).
pub(super) fn rolling_update_left(code: u16, message: &str) -> bool {
    code == 422 && message.contains("spec.updateStrategy.rollingUpdate")
}

/// The label the StatefulSet controller puts on each pod: the revision it was made from.
const REVISION_LABEL: &str = "controller-revision-hash";

/// What becomes of the workspace pod once the StatefulSet's template has moved.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Rollout {
    /// The pod runs the template (or there is no pod yet; or the StatefulSet controller rolls
    /// pods itself, as under PKO's layout): readiness decides.
    Current,
    /// The pod differs from the template by the source revision alone: its agent takes the new
    /// revision, and the pod stays.
    NewRevision,
    /// The pod runs an older template: it is deleted, and the StatefulSet makes a new one.
    Replace,
}

/// Compares the pod with the StatefulSet's template (pko-rs's layout, `OnDelete`). Called once
/// the StatefulSet's status has seen its generation (else [`not_ready`] says so first).
pub(super) fn rollout(sts: &StatefulSet, pod: Option<&Pod>) -> Rollout {
    let Some(pod) = pod else {
        return Rollout::Current;
    };
    if !on_delete(sts) {
        return Rollout::Current;
    }
    let update = sts
        .status
        .as_ref()
        .and_then(|s| s.update_revision.as_deref());
    let made_from = pod
        .metadata
        .labels
        .as_ref()
        .and_then(|l| l.get(REVISION_LABEL))
        .map(String::as_str);
    if update.is_none() || made_from == update {
        return Rollout::Current;
    }
    let shape = |annotations: Option<&std::collections::BTreeMap<String, String>>| {
        annotations
            .and_then(|a| a.get(TEMPLATE_SHAPE_ANNOTATION))
            .cloned()
    };
    let wanted = shape(
        sts.spec
            .as_ref()
            .and_then(|s| s.template.metadata.as_ref())
            .and_then(|m| m.annotations.as_ref()),
    );
    if wanted.is_some() && wanted == shape(pod.metadata.annotations.as_ref()) {
        Rollout::NewRevision
    } else {
        Rollout::Replace
    }
}

/// A failed init container of `pod`, as the kubelet reports it.
pub(super) fn init_failure(pod: &Pod) -> Option<String> {
    let statuses = pod.status.as_ref()?.init_container_statuses.as_ref()?;
    statuses.iter().find_map(|s| {
        let state = s.state.as_ref()?;
        let terminated = state
            .terminated
            .as_ref()
            .or_else(|| s.last_state.as_ref()?.terminated.as_ref())
            .filter(|t| t.exit_code != 0)?;
        let message = terminated
            .message
            .as_deref()
            .map(str::trim)
            .filter(|m| !m.is_empty())
            .unwrap_or("no message");
        Some(format!(
            "init container {} failed (exit code {}): {}",
            s.name, terminated.exit_code, message
        ))
    })
}

pub(super) fn parse_version(v: &str) -> Option<(u64, u64, u64)> {
    let core = v.trim().trim_start_matches('v');
    let core = core.split(['-', '+']).next()?;
    let mut parts = core.split('.').map(|p| p.parse::<u64>().ok());
    Some((
        parts.next()??,
        parts.next()??,
        parts.next().flatten().unwrap_or(0),
    ))
}

fn structured(item: &ConfigItem) -> bool {
    matches!(item.value, Some(Value::Object(_) | Value::Array(_)))
        || item
            .value_from
            .as_ref()
            .is_some_and(|f| f.json == Some(true))
}

/// Why the agent's Pulumi `version` cannot take the stacks' config, or `None` when it can.
pub(super) fn unsupported_config(spec: &WorkspaceSpec, version: &str) -> Option<String> {
    let needs_structured = spec.stacks.iter().flat_map(|s| &s.config).any(structured);
    if !needs_structured
        || parse_version(version).is_some_and(|v| v >= STRUCTURED_CONFIG_MIN_VERSION)
    {
        return None;
    }
    Some(format!(
        "structured configuration needs Pulumi CLI v{}.{}.{} or later; the workspace has {version}",
        STRUCTURED_CONFIG_MIN_VERSION.0,
        STRUCTURED_CONFIG_MIN_VERSION.1,
        STRUCTURED_CONFIG_MIN_VERSION.2
    ))
}

/// What an agent was told: it is told again when any part changes (a restarted agent has a new
/// instance id and remembers nothing).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Initialized {
    pub(super) instance: String,
    pub(super) generation: i64,
    pub(super) env_digest: String,
    /// The source revision it was given over RPC (`UpdateSource`); `None` when it serves the one
    /// its pod fetched.
    pub(super) source: Option<String>,
}

impl Initialized {
    /// The pod annotation's value: the agent instance, the generation, the environment digest,
    /// and the source revision when one was given.
    pub(super) fn annotation(&self) -> String {
        let mut text = format!("{} {} {}", self.instance, self.generation, self.env_digest);
        if let Some(source) = &self.source {
            text.push(' ');
            text.push_str(source);
        }
        text
    }

    /// Reads [`Self::annotation`]; `None` for anything else (PKO's `"true"` included: an agent
    /// PKO initialized is not ours).
    pub(super) fn from_annotation(text: &str) -> Option<Self> {
        let mut parts = text.split(' ');
        let (instance, generation, env_digest) = (parts.next()?, parts.next()?, parts.next()?);
        let source = parts.next();
        if parts.next().is_some()
            || instance.is_empty()
            || env_digest.is_empty()
            || source.is_some_and(str::is_empty)
        {
            return None;
        }
        Some(Self {
            instance: instance.to_owned(),
            generation: generation.parse().ok()?,
            env_digest: env_digest.to_owned(),
            source: source.map(str::to_owned),
        })
    }
}

/// Whether the agent must be given the source revision `wanted` (under [`Rollout::NewRevision`]):
/// not when the same agent was given it already.
pub(super) fn needs_revision(done: Option<&Initialized>, wanted: &Initialized) -> bool {
    wanted.source.is_some()
        && done.is_none_or(|d| d.instance != wanted.instance || d.source != wanted.source)
}

/// What the agent still has to be told.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Initialization {
    /// It was told all of it.
    UpToDate,
    /// A new agent: the environment, the install, the stacks.
    Fresh,
    /// The same agent, told something else before: the environment and the stacks.
    Reconfigure,
}

/// Compares what the agent was last told (`done`) with what it should know (`wanted`).
pub(super) fn initialization(done: Option<&Initialized>, wanted: &Initialized) -> Initialization {
    match done {
        Some(d) if d == wanted => Initialization::UpToDate,
        Some(d) if d.instance == wanted.instance => Initialization::Reconfigure,
        _ => Initialization::Fresh,
    }
}

/// The reason and note of the Event that says the agent was told the workspace.
pub(super) fn initialized_note(
    fresh: bool,
    revision: Option<&str>,
    workspace: &str,
    generation: i64,
) -> (&'static str, String) {
    if let Some(revision) = revision {
        let note = format!(
            "Fetched source {revision} into the running workspace pod {}-0 and initialized it",
            pod::workload_name(workspace)
        );
        (SOURCE_UPDATED, note)
    } else if fresh {
        let note = format!(
            "Initialized workspace pod {}-0",
            pod::workload_name(workspace)
        );
        (INITIALIZED, note)
    } else {
        let note = format!(
            "Configured the environment and stacks of generation {generation} without restarting the pod"
        );
        (RECONFIGURED, note)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn the_workload_is_applied_again_only_when_it_or_its_live_spec_changed() {
        let last = AppliedWorkload {
            service: 5,
            statefulset: 7,
            generation: Some(3),
        };
        let apply = |service, statefulset| MustApply {
            service,
            statefulset,
        };
        assert_eq!(
            must_apply(None, 5, 7, Some(3), true),
            apply(true, true),
            "nothing applied here"
        );
        assert_eq!(
            must_apply(Some(&last), 5, 7, Some(3), true),
            apply(false, false),
            "unchanged"
        );
        assert_eq!(
            must_apply(Some(&last), 5, 8, Some(3), true),
            apply(false, true),
            "the pod template changed, the Service did not"
        );
        assert_eq!(
            must_apply(Some(&last), 6, 7, Some(3), true),
            apply(true, false),
            "the Service changed"
        );
        assert_eq!(
            must_apply(Some(&last), 5, 7, Some(4), true),
            apply(false, true),
            "someone changed the spec"
        );
        assert_eq!(
            must_apply(Some(&last), 5, 7, None, true),
            apply(false, true),
            "the StatefulSet is gone"
        );
        assert_eq!(
            must_apply(Some(&last), 5, 7, Some(3), false),
            apply(true, false),
            "the Service is gone"
        );
    }

    fn sts(status: Value) -> StatefulSet {
        serde_json::from_value(json!({"metadata": {"generation": 2}, "status": status}))
            .expect("statefulset")
    }

    #[test]
    fn only_a_stacks_workspace_pko_applied_waits_for_its_stack() {
        let ws = |labels: Value, manager: &str| -> pko_api::workspace::Workspace {
            serde_json::from_value(json!({
                "apiVersion": "auto.pulumi.com/v1alpha1", "kind": "Workspace",
                "metadata": {"name": "w", "labels": labels,
                    "managedFields": [{"manager": manager, "operation": "Apply"}]},
                "spec": {},
            }))
            .expect("workspace")
        };
        let stacks = json!({"pulumi.com/component": "stack"});
        assert!(waits_for_its_stack(&ws(
            stacks.clone(),
            "pulumi-kubernetes-operator"
        )));
        assert!(!waits_for_its_stack(&ws(stacks, "pko-rs")));
        // A Workspace of its own (no Stack) is taken over by the Workspace controller.
        assert!(!waits_for_its_stack(&ws(
            json!({}),
            "pulumi-kubernetes-operator"
        )));
    }

    #[test]
    fn what_an_agent_was_told_round_trips_through_the_pod_annotation() {
        let told = Initialized {
            instance: "3f2a".into(),
            generation: 7,
            env_digest: "sha256:ab".into(),
            source: None,
        };
        assert_eq!(
            Initialized::from_annotation(&told.annotation()),
            Some(told.clone())
        );
        let given = Initialized {
            source: Some("sha256:cd".into()),
            ..told.clone()
        };
        assert_eq!(given.annotation(), "3f2a 7 sha256:ab sha256:cd");
        assert_eq!(
            Initialized::from_annotation(&given.annotation()),
            Some(given.clone())
        );
        for other in ["true", "", "a 1", "a x b", "a 1 b c d", "a 1 b ", " 1 b"] {
            assert_eq!(Initialized::from_annotation(other), None, "{other:?}");
        }
        // The same agent told the same: nothing to do after a restart of the operator.
        assert_eq!(
            initialization(
                Initialized::from_annotation(&told.annotation()).as_ref(),
                &told
            ),
            Initialization::UpToDate
        );
    }

    #[test]
    fn versions_compare() {
        assert_eq!(parse_version("v3.274.1"), Some((3, 274, 1)));
        assert!(parse_version("v3.197.0").is_some_and(|v| v < STRUCTURED_CONFIG_MIN_VERSION));
        assert!(
            parse_version("3.202.0-alpha.1").is_some_and(|v| v >= STRUCTURED_CONFIG_MIN_VERSION)
        );
        assert_eq!(parse_version("garbage"), None);
    }

    #[test]
    fn a_statefulset_is_ready_once_observed_rolled_and_available() {
        let unobserved: StatefulSet =
            serde_json::from_value(json!({"metadata": {"generation": 1}})).expect("statefulset");
        assert_eq!(
            not_ready(&unobserved),
            Some((
                "RollingUpdate",
                "waiting for the StatefulSet to be observed".into()
            ))
        );
        let old = sts(json!({"replicas": 1, "observedGeneration": 1}));
        assert_eq!(not_ready(&old).map(|r| r.0), Some("RollingUpdate"));
        let rolling = sts(json!({"replicas": 1, "observedGeneration": 2,
            "updateRevision": "b", "currentRevision": "a", "availableReplicas": 1}));
        assert_eq!(
            not_ready(&rolling),
            Some(("RollingUpdate", "the workspace pod is being updated".into()))
        );
        let waiting = sts(json!({"replicas": 1, "observedGeneration": 2}));
        assert_eq!(not_ready(&waiting).map(|r| r.0), Some("WaitingForReplicas"));
        let ready = sts(json!({"replicas": 1, "observedGeneration": 2,
            "updateRevision": "a", "currentRevision": "a", "availableReplicas": 1}));
        assert_eq!(not_ready(&ready), None);
    }

    #[test]
    fn a_failed_init_container_is_named_with_its_exit_code() {
        let pod: Pod = serde_json::from_value(json!({"status": {"initContainerStatuses": [
            {"name": "ok", "image": "i", "imageID": "", "ready": true, "restartCount": 0,
             "state": {"terminated": {"exitCode": 0}}},
            {"name": "fetch", "image": "i", "imageID": "", "ready": false, "restartCount": 2,
             "state": {"waiting": {"reason": "CrashLoopBackOff"}},
             "lastState": {"terminated": {"exitCode": 3, "message": " bad digest\n"}}},
        ]}}))
        .expect("pod");
        assert_eq!(
            init_failure(&pod).as_deref(),
            Some("init container fetch failed (exit code 3): bad digest")
        );
        let silent: Pod = serde_json::from_value(json!({"status": {"initContainerStatuses": [
            {"name": "fetch", "image": "i", "imageID": "", "ready": false, "restartCount": 0,
             "state": {"terminated": {"exitCode": 1, "message": "  "}}},
        ]}}))
        .expect("pod");
        assert_eq!(
            init_failure(&silent).as_deref(),
            Some("init container fetch failed (exit code 1): no message")
        );
        assert_eq!(init_failure(&Pod::default()), None);
    }

    #[test]
    fn structured_config_needs_a_recent_pulumi() {
        let spec = |config: Value| -> WorkspaceSpec {
            serde_json::from_value(json!({"stacks": [{"name": "dev", "config": config}]}))
                .expect("spec")
        };
        let plain = spec(json!([{"key": "a", "value": "x"}]));
        let object = spec(json!([{"key": "a", "value": {"b": 1}}]));
        let json_from = spec(json!([{"key": "a", "valueFrom": {"env": "A", "json": true}}]));
        assert_eq!(unsupported_config(&plain, "v3.100.0"), None);
        assert_eq!(unsupported_config(&object, "v3.202.0"), None);
        assert_eq!(
            unsupported_config(&object, "v3.201.9").as_deref(),
            Some(
                "structured configuration needs Pulumi CLI v3.202.0 or later; the workspace has v3.201.9"
            )
        );
        assert!(unsupported_config(&json_from, "unknown").is_some());
    }

    #[test]
    fn the_agent_is_told_again_when_anything_it_knows_changes() {
        let wanted = Initialized {
            instance: "a".into(),
            generation: 3,
            env_digest: "d".into(),
            source: None,
        };
        assert_eq!(initialization(None, &wanted), Initialization::Fresh);
        assert_eq!(
            initialization(Some(&wanted.clone()), &wanted),
            Initialization::UpToDate
        );
        let older = Initialized {
            generation: 2,
            ..wanted.clone()
        };
        assert_eq!(
            initialization(Some(&older), &wanted),
            Initialization::Reconfigure
        );
        let restarted = Initialized {
            instance: "b".into(),
            ..wanted.clone()
        };
        assert_eq!(
            initialization(Some(&restarted), &wanted),
            Initialization::Fresh
        );
        assert_eq!(
            initialized_note(true, None, "ws", 3),
            (
                "Initialized",
                format!("Initialized workspace pod {}-0", pod::workload_name("ws"))
            )
        );
        assert_eq!(
            initialized_note(false, None, "ws", 3),
            (
                "Reconfigured",
                "Configured the environment and stacks of generation 3 without restarting the pod"
                    .into()
            )
        );
        assert_eq!(
            initialized_note(true, Some("sha256:2"), "ws", 3),
            (
                "SourceUpdated",
                "Fetched source sha256:2 into the running workspace pod ws-workspace-0 and initialized it"
                    .into()
            )
        );
    }

    fn on_delete_sts(update_revision: &str, shape: Option<&str>) -> StatefulSet {
        let annotations = shape.map_or(json!({}), |s| json!({TEMPLATE_SHAPE_ANNOTATION: s}));
        serde_json::from_value(json!({
            "metadata": {"generation": 2},
            "spec": {"selector": {}, "serviceName": "s", "updateStrategy": {"type": "OnDelete"},
                     "template": {"metadata": {"annotations": annotations}}},
            "status": {"replicas": 1, "observedGeneration": 2, "availableReplicas": 1,
                       "currentRevision": "ws-a", "updateRevision": update_revision},
        }))
        .expect("statefulset")
    }

    fn pod_of(revision: &str, shape: Option<&str>) -> Pod {
        let annotations = shape.map_or(json!({}), |s| json!({TEMPLATE_SHAPE_ANNOTATION: s}));
        serde_json::from_value(json!({"metadata": {
            "labels": {"controller-revision-hash": revision}, "annotations": annotations}}))
        .expect("pod")
    }

    #[test]
    fn a_pod_stays_when_only_the_source_revision_moved() {
        let shaped = on_delete_sts("ws-b", Some("s1"));
        // Made from the template: nothing to do, and readiness is not held up by the revisions
        // the StatefulSet controller leaves apart under OnDelete.
        assert_eq!(
            rollout(&shaped, Some(&pod_of("ws-b", Some("s1")))),
            Rollout::Current
        );
        assert_eq!(not_ready(&shaped), None);
        assert_eq!(rollout(&shaped, None), Rollout::Current);
        // An older template of the same shape: a new revision for the running agent.
        assert_eq!(
            rollout(&shaped, Some(&pod_of("ws-a", Some("s1")))),
            Rollout::NewRevision
        );
        // Anything else moved, or the pod predates the shape: a new pod.
        assert_eq!(
            rollout(&shaped, Some(&pod_of("ws-a", Some("s0")))),
            Rollout::Replace
        );
        assert_eq!(
            rollout(&shaped, Some(&pod_of("ws-a", None))),
            Rollout::Replace
        );
        let unshaped = on_delete_sts("ws-b", None);
        assert_eq!(
            rollout(&unshaped, Some(&pod_of("ws-a", None))),
            Rollout::Replace
        );
        // The StatefulSet controller rolls PKO's layout itself.
        let rolling = sts(json!({"replicas": 1, "observedGeneration": 2,
            "updateRevision": "ws-b", "currentRevision": "ws-a", "availableReplicas": 1}));
        assert_eq!(
            rollout(&rolling, Some(&pod_of("ws-a", None))),
            Rollout::Current
        );
    }

    #[test]
    fn a_former_rolling_update_is_told_from_other_refusals() {
        let refused = r#"StatefulSet.apps "w-workspace" is invalid: spec.updateStrategy.rollingUpdate: Invalid value: {"Partition":0,"MaxUnavailable":null}: only allowed for updateStrategy 'RollingUpdate'"#;
        assert!(rolling_update_left(422, refused));
        assert!(!rolling_update_left(409, refused));
        assert!(!rolling_update_left(
            422,
            "spec.template.spec.containers[0].image: Required value"
        ));
    }

    #[test]
    fn a_revision_is_given_once_per_agent() {
        let wanted = Initialized {
            instance: "a".into(),
            generation: 3,
            env_digest: "d".into(),
            source: Some("sha256:2".into()),
        };
        assert!(needs_revision(None, &wanted));
        assert!(!needs_revision(Some(&wanted), &wanted));
        let before = Initialized {
            source: Some("sha256:1".into()),
            generation: 2,
            ..wanted.clone()
        };
        assert!(needs_revision(Some(&before), &wanted));
        // A restarted agent serves what is on disk, which it is asked about again.
        let restarted = Initialized {
            instance: "b".into(),
            ..wanted.clone()
        };
        assert!(needs_revision(Some(&restarted), &wanted));
        let fetched_by_pod = Initialized {
            source: None,
            ..wanted.clone()
        };
        assert!(!needs_revision(Some(&wanted), &fetched_by_pod));
    }
}
