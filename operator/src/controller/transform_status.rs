//! Status of ProgramTransforms and ClusterProgramTransforms: `Ready`, the loaded digest, the
//! plugin's name and version, `observedGeneration`, and the reason when not ready.
//!
//! Every replica loads the transforms (see `crate::transform`); this writer runs where the
//! controllers run (the leader) and turns each settled state into the object's status, only
//! when it differs from what the object already says, with an Event on each Ready transition.

use std::sync::Arc;

use k8s_openapi::jiff::Timestamp;
use kube::api::{Patch, PatchParams};
use kube::runtime::events::{Event, EventType, Recorder};
use kube::{Api, Client};
use pko_api::transform::{
    ClusterProgramTransform, PluginStatus, ProgramTransform, READY, TransformStatus,
};
use serde_json::json;
use tokio::sync::broadcast;
use tracing::{debug, warn};

use crate::controller::backoff::{self, Backoff};
use crate::controller::conditions::truncate;
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
    if matches(&current, &desired) {
        return Ok(());
    }
    let was_ready = ready_of(&current);
    let now = Timestamp::now().to_string();
    let transition = current
        .conditions
        .iter()
        .find(|c| c.type_ == READY)
        .filter(|c| (c.status == "True") == desired.ready)
        .map(|c| c.last_transition_time.0.to_string())
        .unwrap_or(now);
    let mut status = json!({
        "observedGeneration": desired.generation,
        "conditions": [{
            "type": READY,
            "status": if desired.ready { "True" } else { "False" },
            "reason": desired.reason,
            "message": desired.message,
            "observedGeneration": desired.generation,
            "lastTransitionTime": transition,
        }],
    });
    if let Some(map) = status.as_object_mut() {
        if let Some(digest) = &desired.digest {
            map.insert("digest".into(), json!(digest));
        }
        if let Some(plugin) = &desired.plugin {
            map.insert("plugin".into(), json!(plugin));
        }
    }
    let params = PatchParams::apply(TRANSFORM_STATUS_MANAGER).force();
    let written = match (&key.kind, &key.namespace) {
        (TransformKind::Namespaced, Some(namespace)) => {
            let api: Api<ProgramTransform> = Api::namespaced(client.clone(), namespace);
            let patch = json!({"apiVersion": "pko-rs.dev/v1alpha1", "kind": "ProgramTransform", "status": status});
            api.patch_status(&key.name, &params, &Patch::Apply(&patch))
                .await
                .map(|_| ())
        }
        _ => {
            let api: Api<ClusterProgramTransform> = Api::all(client.clone());
            let patch = json!({"apiVersion": "pko-rs.dev/v1alpha1", "kind": "ClusterProgramTransform", "status": status});
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
    }
}

fn ready_of(status: &TransformStatus) -> Option<bool> {
    status
        .conditions
        .iter()
        .find(|c| c.type_ == READY)
        .map(|c| c.status == "True")
}

fn matches(current: &TransformStatus, desired: &Desired) -> bool {
    let Some(ready) = current.conditions.iter().find(|c| c.type_ == READY) else {
        return false;
    };
    current.observed_generation == Some(desired.generation)
        && ready.observed_generation == Some(desired.generation)
        && (ready.status == "True") == desired.ready
        && ready.reason == desired.reason
        && ready.message == desired.message
        && current.digest == desired.digest
        && current.plugin == desired.plugin
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
