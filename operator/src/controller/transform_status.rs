//! Status of ProgramTransforms and ClusterProgramTransforms: `Ready`, the loaded digest, the
//! plugin's name and version, `observedGeneration`, and the reason when not ready.
//!
//! Every replica loads the transforms (see `crate::transform`); this writer runs where the
//! controllers run (the leader) and turns each settled state into the object's status, only
//! when it differs from what the object already says, with an Event on each Ready transition.

use std::sync::Arc;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition;
use kube::api::{Patch, PatchParams};
use kube::runtime::events::{Event, EventType, Recorder};
use kube::{Api, Client};
use pko_api::transform::{
    ClusterProgramTransform, PluginStatus, ProgramTransform, READY, TransformStatus,
};
use tokio::sync::broadcast;
use tracing::{debug, warn};

use crate::controller::backoff::{self, Backoff};
use crate::controller::conditions::{self, truncate};
use crate::controller::keys::TRANSFORM_STATUS_MANAGER;
use crate::controller::kit::{self, Kit};
use crate::metrics::ErrorLabels;
use crate::transform::{LoadState, Snapshot, TransformKey, TransformKind, TransformRegistry};

const CONTROLLER: &str = "transform";

/// Failures of one status write.
#[derive(Debug, thiserror::Error)]
pub enum TransformStatusError {
    #[error("cannot write the status of {key}: {source}")]
    Write {
        key: String,
        #[source]
        source: kube::Error,
    },
}

/// The status a transform should have.
#[derive(Debug, Clone, PartialEq)]
struct Desired {
    generation: i64,
    ready: bool,
    reason: String,
    message: String,
    digest: Option<String>,
    plugin: Option<PluginStatus>,
}

/// Writes transform status until `shutdown` resolves.
pub async fn run(
    registry: Arc<TransformRegistry>,
    kit: Kit,
    shutdown: impl std::future::Future<Output = ()> + Send,
) {
    let Kit {
        ref client,
        ref metrics,
        ..
    } = kit;
    metrics.init_controller(CONTROLLER, &["status_write"]);
    let recorder = kit.recorder(CONTROLLER);
    // Failed writes per transform; the write is what failed, so it is only logged and retried.
    let retries = Backoff::default();
    let mut triggers = registry.subscribe_status();
    // Everything once at start: the previous leader may have left a status behind.
    let mut pending: Vec<TransformKey> = registry.keys();
    let mut shutdown = std::pin::pin!(shutdown);
    loop {
        for key in std::mem::take(&mut pending) {
            let _measure = kit::measure(metrics, CONTROLLER);
            let key_text = key.to_string();
            if let Err(err) = write(&registry, client, &recorder, &key).await {
                let TransformStatusError::Write { source, .. } = &err;
                let failure = retries.failure(&key_text, None, backoff::classify(source));
                warn!(transform = %key, error = %err, attempts = failure.attempts, "cannot write transform status");
                // The status is what cannot be written: a stall is told by an Event, once.
                if failure.first_stall {
                    let note = format!("cannot write the status: {}", backoff::describe(source));
                    kit::publish_stall(&recorder, &object_ref(&key), "WriteStatus", &note).await;
                }
                metrics
                    .reconcile_errors
                    .get_or_create(&ErrorLabels {
                        controller: CONTROLLER.into(),
                        error: "status_write".into(),
                    })
                    .inc();
                let registry = registry.clone();
                tokio::spawn(async move {
                    tokio::time::sleep(failure.delay).await;
                    registry.retrigger_status(key);
                });
            } else {
                retries.success(&key_text);
            }
        }
        tokio::select! {
            () = &mut shutdown => return,
            received = triggers.recv() => match received {
                Ok(key) => pending.push(key),
                Err(broadcast::error::RecvError::Lagged(_)) => pending = registry.keys(),
                Err(broadcast::error::RecvError::Closed) => return,
            },
        }
        // Take whatever else is queued, without duplicates.
        while let Ok(key) = triggers.try_recv() {
            if !pending.contains(&key) {
                pending.push(key);
            }
        }
    }
}

async fn write(
    registry: &TransformRegistry,
    client: &Client,
    recorder: &Recorder,
    key: &TransformKey,
) -> Result<(), TransformStatusError> {
    let Some(snapshot) = registry.snapshot(key) else {
        return Ok(());
    };
    let Some(desired) = desired(&snapshot) else {
        // Still loading: the load settling triggers another write.
        return Ok(());
    };
    let current = snapshot.status.clone().unwrap_or_default();
    let status = desired_status(&current, &desired);
    if unchanged(&current, &status) {
        return Ok(());
    }
    let was_ready = ready_of(&current);
    let params = PatchParams::apply(TRANSFORM_STATUS_MANAGER).force();
    let written = match (&key.kind, &key.namespace) {
        (TransformKind::Namespaced, Some(namespace)) => {
            let api: Api<ProgramTransform> = Api::namespaced(client.clone(), namespace);
            let patch = kit::StatusPatch::new::<ProgramTransform>(&status);
            api.patch_status(&key.name, &params, &Patch::Apply(&patch))
                .await
                .map(|_| ())
        }
        _ => {
            let api: Api<ClusterProgramTransform> = Api::all(client.clone());
            let patch = kit::StatusPatch::new::<ClusterProgramTransform>(&status);
            api.patch_status(&key.name, &params, &Patch::Apply(&patch))
                .await
                .map(|_| ())
        }
    };
    match written {
        Ok(()) => {}
        // Deleted meanwhile: nothing to report.
        Err(kube::Error::Api(e)) if e.code == 404 => return Ok(()),
        Err(source) => {
            return Err(TransformStatusError::Write {
                key: key.to_string(),
                source,
            });
        }
    }
    debug!(transform = %key, ready = desired.ready, reason = %desired.reason, "transform status written");
    if was_ready != Some(desired.ready) {
        let event = Event {
            type_: if desired.ready {
                EventType::Normal
            } else {
                EventType::Warning
            },
            reason: if desired.ready {
                "TransformReady".into()
            } else {
                format!("Transform{}", desired.reason)
            },
            note: Some(truncate(&desired.message, 1000)),
            action: "LoadModule".into(),
            secondary: None,
        };
        let reference = object_ref(key);
        if let Err(err) = recorder.publish(&event, &reference).await {
            warn!(error = %err, "cannot publish event");
        }
    }
    Ok(())
}

fn desired(snapshot: &Snapshot) -> Option<Desired> {
    let generation = snapshot.generation;
    if let Some(error) = &snapshot.selector_error {
        return Some(Desired {
            generation,
            ready: false,
            reason: "InvalidSelector".into(),
            message: truncate(error, 1000),
            digest: None,
            plugin: None,
        });
    }
    match &snapshot.state {
        LoadState::Loading => None,
        LoadState::Ready(module) => {
            let info = module.info();
            Some(Desired {
                generation,
                ready: true,
                reason: "Loaded".into(),
                message: format!(
                    "plugin {} {} loaded ({}); configuration accepted",
                    info.name,
                    info.version,
                    module.digest()
                ),
                digest: Some(module.digest().to_owned()),
                plugin: Some(PluginStatus {
                    name: info.name.clone(),
                    version: info.version.clone(),
                    description: info.description.clone(),
                }),
            })
        }
        LoadState::Failed(err) => Some(Desired {
            generation,
            ready: false,
            reason: err.kind().camel().to_owned(),
            message: truncate(&err.to_string(), 1000),
            digest: None,
            plugin: None,
        }),
        LoadState::Previous { previous, error } => {
            let info = previous.module.info();
            Some(Desired {
                generation,
                ready: false,
                reason: "ServingPrevious".into(),
                message: truncate(
                    &format!(
                        "the new module cannot be fetched ({error}); the previous one, plugin {} {} ({}), keeps serving until it can",
                        info.name,
                        info.version,
                        previous.module.digest()
                    ),
                    1000,
                ),
                digest: Some(previous.module.digest().to_owned()),
                plugin: Some(PluginStatus {
                    name: info.name.clone(),
                    version: info.version.clone(),
                    description: info.description.clone(),
                }),
            })
        }
    }
}

fn ready_of(status: &TransformStatus) -> Option<bool> {
    status
        .conditions
        .iter()
        .find(|c| c.type_ == READY)
        .map(|c| c.status == "True")
}

/// The status written for `desired`: the Ready condition keeps its transition time while its
/// status does not change.
fn desired_status(current: &TransformStatus, desired: &Desired) -> TransformStatus {
    // Only Ready is this field manager's: other conditions stay out of the apply.
    let mut list: Vec<Condition> = conditions::get(&current.conditions, READY)
        .cloned()
        .into_iter()
        .collect();
    conditions::set(
        &mut list,
        READY,
        desired.ready,
        &desired.reason,
        &desired.message,
        Some(desired.generation),
    );
    TransformStatus {
        observed_generation: Some(desired.generation),
        conditions: list,
        digest: desired.digest.clone(),
        plugin: desired.plugin.clone(),
    }
}

/// Whether writing `desired` would change nothing but the transition time.
fn unchanged(current: &TransformStatus, desired: &TransformStatus) -> bool {
    current.observed_generation == desired.observed_generation
        && conditions::same(
            ready_only(&current.conditions),
            ready_only(&desired.conditions),
        )
        && current.digest == desired.digest
        && current.plugin == desired.plugin
}

/// The `Ready` condition alone (other conditions are not this writer's).
fn ready_only(list: &[Condition]) -> &[Condition] {
    conditions::get(list, READY)
        .map(std::slice::from_ref)
        .unwrap_or_default()
}

fn object_ref(key: &TransformKey) -> k8s_openapi::api::core::v1::ObjectReference {
    let kind = key.kind.as_str();
    k8s_openapi::api::core::v1::ObjectReference {
        api_version: Some("pko-rs.dev/v1alpha1".into()),
        kind: Some(kind.into()),
        name: Some(key.name.clone()),
        namespace: key.namespace.clone(),
        ..Default::default()
    }
}

#[cfg(test)]
mod tests {
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
    use serde_json::json;

    use super::*;

    fn time(text: &str) -> Time {
        Time(text.parse().unwrap())
    }

    fn loaded(generation: i64) -> Desired {
        Desired {
            generation,
            ready: true,
            reason: "Loaded".into(),
            message: "plugin p 1.0 loaded".into(),
            digest: Some("sha256:m".into()),
            plugin: Some(PluginStatus {
                name: "p".into(),
                version: "1.0".into(),
                description: String::new(),
            }),
        }
    }

    fn failed(generation: i64) -> Desired {
        Desired {
            generation,
            ready: false,
            reason: "Compile".into(),
            message: "cannot compile the module: x".into(),
            digest: None,
            plugin: None,
        }
    }

    /// The status of generation 2 as written an hour ago.
    fn written() -> TransformStatus {
        let mut status = desired_status(&TransformStatus::default(), &loaded(2));
        status.conditions[0].last_transition_time = time("2025-01-01T00:00:00Z");
        status
    }

    #[test]
    fn the_same_state_again_is_unchanged_and_keeps_its_time() {
        let current = written();
        let status = desired_status(&current, &loaded(2));
        assert!(unchanged(&current, &status));
        assert_eq!(status, current);
    }

    #[test]
    fn a_new_generation_is_written_with_the_old_transition_time() {
        let current = written();
        let status = desired_status(&current, &loaded(3));
        assert!(!unchanged(&current, &status));
        assert_eq!(status.observed_generation, Some(3));
        assert_eq!(status.conditions[0].observed_generation, Some(3));
        assert_eq!(
            status.conditions[0].last_transition_time,
            time("2025-01-01T00:00:00Z")
        );
    }

    #[test]
    fn a_failure_drops_digest_and_plugin_and_moves_the_transition_time() {
        let current = written();
        let status = desired_status(&current, &failed(2));
        assert!(!unchanged(&current, &status));
        assert_eq!((status.digest.clone(), status.plugin.clone()), (None, None));
        let ready = &status.conditions[0];
        assert_eq!(
            (ready.status.as_str(), ready.reason.as_str()),
            ("False", "Compile")
        );
        assert!(ready.last_transition_time > time("2025-01-01T00:00:00Z"));
    }

    #[test]
    fn unchanged_needs_every_owned_field_current() {
        let base = written();
        for stale in [
            TransformStatus {
                observed_generation: Some(1),
                ..base.clone()
            },
            TransformStatus {
                digest: Some("sha256:other".into()),
                ..base.clone()
            },
            TransformStatus {
                plugin: None,
                ..base.clone()
            },
            TransformStatus {
                conditions: vec![],
                ..base.clone()
            },
            TransformStatus {
                conditions: vec![Condition {
                    message: "other".into(),
                    ..base.conditions[0].clone()
                }],
                ..base.clone()
            },
            TransformStatus {
                conditions: vec![Condition {
                    observed_generation: Some(1),
                    ..base.conditions[0].clone()
                }],
                ..base.clone()
            },
        ] {
            assert!(!unchanged(&stale, &base), "{stale:?}");
        }
        // A condition of another type is neither compared nor written.
        let mut other = base.clone();
        other.conditions.push(Condition {
            type_: "Other".into(),
            ..base.conditions[0].clone()
        });
        assert!(unchanged(&other, &base));
        assert_eq!(desired_status(&other, &loaded(2)).conditions.len(), 1);
    }

    #[test]
    fn the_patch_sets_what_it_set_before() {
        let status = written();
        let body =
            serde_json::to_value(kit::StatusPatch::new::<ProgramTransform>(&status)).unwrap();
        assert_eq!(
            body,
            json!({
                "apiVersion": "pko-rs.dev/v1alpha1",
                "kind": "ProgramTransform",
                "status": {
                    "observedGeneration": 2,
                    "conditions": [{
                        "type": "Ready",
                        "status": "True",
                        "reason": "Loaded",
                        "message": "plugin p 1.0 loaded",
                        "observedGeneration": 2,
                        "lastTransitionTime": "2025-01-01T00:00:00Z",
                    }],
                    "digest": "sha256:m",
                    "plugin": {"name": "p", "version": "1.0"},
                },
            })
        );
        let failed = desired_status(&TransformStatus::default(), &failed(1));
        let body = serde_json::to_value(kit::StatusPatch::new::<ClusterProgramTransform>(&failed))
            .unwrap();
        assert_eq!(body["kind"], "ClusterProgramTransform");
        assert!(body["status"].get("digest").is_none());
        assert!(body["status"].get("plugin").is_none());
    }
}
