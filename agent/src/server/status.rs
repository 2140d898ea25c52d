//! What the CLI reports, as the service's messages: the stack summary, the last update's
//! summary, the outputs with secrets marked, the permalink, and CLI failures as gRPC statuses.

use std::collections::BTreeSet;

use serde_json::{Value, json};
use tonic::{Code, Status};
use tracing::warn;

use super::{Agent, args};
use crate::limits;
use crate::proto as pb;
use crate::pulumi::PulumiError;
use pko_agent_api::errors::with_error_info;

impl Agent {
    pub(super) async fn summary(&self) -> Result<pb::StackSummary, Status> {
        let stack = self.require_stack()?;
        let list = self
            .inner
            .cli
            .run_json(&args(["stack", "ls", "--json"]))
            .await
            .map_err(|e| to_status("stack ls", e))?;
        let entry = list
            .as_array()
            .into_iter()
            .flatten()
            .find(|s| {
                s.get("name")
                    .and_then(Value::as_str)
                    .is_some_and(|n| same_stack(n, &stack))
            })
            .ok_or_else(|| Status::not_found(format!("stack {stack} not found")))?;
        Ok(pb::StackSummary {
            name: entry
                .get("name")
                .and_then(Value::as_str)
                .unwrap_or(&stack)
                .to_owned(),
            last_update: entry
                .get("lastUpdate")
                .and_then(Value::as_str)
                .and_then(timestamp),
            update_in_progress: entry
                .get("updateInProgress")
                .and_then(Value::as_bool)
                .unwrap_or(false),
            resource_count: entry
                .get("resourceCount")
                .and_then(Value::as_i64)
                .and_then(|n| i32::try_from(n).ok()),
            url: entry.get("url").and_then(Value::as_str).map(str::to_owned),
        })
    }

    /// Outputs of the stack as `stack output --json` shows them, with secrets marked: by the
    /// operation's own outputs event when it names the same outputs, else by a masked
    /// `stack output` (a secret shows as "[secret]" there, the Automation API's rule).
    pub(super) async fn outputs(
        &self,
        stack: &str,
        root: Option<&RootOutputs>,
    ) -> Result<std::collections::HashMap<String, pb::OutputValue>, Status> {
        let cli = &self.inner.cli;
        let stack_flag = format!("--stack={stack}");
        let plain = cli
            .run_json(&args([
                "stack",
                "output",
                "--json",
                "--show-secrets",
                &stack_flag,
            ]))
            .await
            .map_err(|e| to_status("stack output", e))?;
        let Value::Object(plain) = plain else {
            return Ok(std::collections::HashMap::new());
        };
        let secret: BTreeSet<String> = match root {
            Some(root)
                if plain.len() == root.names.len()
                    && plain.keys().all(|k| root.names.contains(k)) =>
            {
                root.secret.clone()
            }
            _ => {
                let masked = cli
                    .run_json(&args(["stack", "output", "--json", &stack_flag]))
                    .await
                    .map_err(|e| to_status("stack output", e))?;
                plain
                    .iter()
                    .filter(|(key, value)| {
                        masked.get(key.as_str()) == Some(&json!("[secret]"))
                            && **value != json!("[secret]")
                    })
                    .map(|(key, _)| key.clone())
                    .collect()
            }
        };
        let mut outputs = std::collections::HashMap::new();
        for (key, value) in plain {
            let secret = secret.contains(&key);
            let (bytes, cut) =
                limits::output_value(&value, self.inner.limits.max_output_value_bytes);
            if cut {
                warn!(
                    output = %key,
                    limit = self.inner.limits.max_output_value_bytes,
                    "stack output value truncated"
                );
            }
            outputs.insert(
                key,
                pb::OutputValue {
                    value: bytes,
                    secret,
                },
            );
        }
        Ok(outputs)
    }

    /// The last history entry of the stack as an `UpdateSummary`; the local times when the
    /// backend keeps no history entry (e.g. after `destroy --remove`).
    pub(super) async fn last_summary(&self, stack: &str, times: &OpReport) -> pb::UpdateSummary {
        let history = self
            .inner
            .cli
            .run_json(&args([
                "stack",
                "history",
                "--json",
                "--page-size=1",
                &format!("--stack={stack}"),
            ]))
            .await;
        let entry = history
            .ok()
            .and_then(|h| h.as_array().and_then(|a| a.first().cloned()));
        match entry {
            Some(e) => pb::UpdateSummary {
                start_time: e
                    .get("startTime")
                    .and_then(Value::as_str)
                    .and_then(timestamp)
                    .or_else(|| Some(pb_time(times.start))),
                end_time: e
                    .get("endTime")
                    .and_then(Value::as_str)
                    .and_then(timestamp)
                    .or_else(|| Some(pb_time(times.end))),
                result: e
                    .get("result")
                    .and_then(Value::as_str)
                    .unwrap_or("succeeded")
                    .to_owned(),
                message: e
                    .get("message")
                    .and_then(Value::as_str)
                    .unwrap_or_default()
                    .to_owned(),
            },
            None => local_summary(times, ""),
        }
    }
}

/// What the agent saw of one operation: its wall-clock bounds, and the root stack's outputs as
/// its engine events showed them.
pub struct OpReport {
    pub(super) start: jiff::Timestamp,
    pub(super) end: jiff::Timestamp,
    pub(super) root_outputs: Option<RootOutputs>,
}

/// The root stack's top-level output names from an operation's outputs event, and which of
/// them are secret. Events carry secrets as the engine's secret signature (value masked), so
/// one `stack output --show-secrets` then gives every value with its secrecy: no second,
/// masked `stack output` to compare against.
#[derive(Debug, Default, PartialEq)]
pub(super) struct RootOutputs {
    names: BTreeSet<String>,
    secret: BTreeSet<String>,
}

/// The key and value that mark a secret in the engine's JSON (its `resource.SecretSig`).
const SECRET_SIG_KEY: &str = "4dabf18193072939515e22adb298388d";
const SECRET_SIG: &str = "1b47061264138c4ac30d75fd1eb44270";

/// The root stack's outputs when `event` is its `resOutputsEvent` (the engine sends one at the
/// end of every `up`, changed or not).
pub(super) fn root_outputs(event: &serde_json::Map<String, Value>) -> Option<RootOutputs> {
    let meta = event.get("resOutputsEvent")?.get("metadata")?;
    if meta.get("type").and_then(Value::as_str) != Some(ROOT_STACK_TYPE) {
        return None;
    }
    let new = meta.get("new")?;
    // A component a program names like the root would have a parent.
    if new
        .get("parent")
        .and_then(Value::as_str)
        .is_some_and(|p| !p.is_empty())
    {
        return None;
    }
    let outputs = new.get("outputs")?.as_object()?;
    let is_secret = |v: &Value| v.get(SECRET_SIG_KEY).and_then(Value::as_str) == Some(SECRET_SIG);
    Some(RootOutputs {
        names: outputs.keys().cloned().collect(),
        secret: outputs
            .iter()
            .filter(|(_, v)| is_secret(v))
            .map(|(k, _)| k.clone())
            .collect(),
    })
}

const ROOT_STACK_TYPE: &str = "pulumi:pulumi:Stack";

pub(super) fn local_summary(times: &OpReport, message: &str) -> pb::UpdateSummary {
    pb::UpdateSummary {
        start_time: Some(pb_time(times.start)),
        end_time: Some(pb_time(times.end)),
        result: "succeeded".into(),
        message: message.into(),
    }
}

fn pb_time(t: jiff::Timestamp) -> prost_types::Timestamp {
    prost_types::Timestamp {
        seconds: t.as_second(),
        nanos: t.subsec_nanosecond(),
    }
}

fn timestamp(text: &str) -> Option<prost_types::Timestamp> {
    text.parse::<jiff::Timestamp>().ok().map(pb_time)
}

/// `dev` and `org/project/dev` name the same stack.
fn same_stack(listed: &str, wanted: &str) -> bool {
    listed == wanted
        || listed.rsplit('/').next() == Some(wanted)
        || wanted.rsplit('/').next() == Some(listed)
}

/// A CLI failure as a gRPC status, with PKO's `PulumiErrorInfo` detail when the cause is known.
pub fn to_status(op: &str, err: PulumiError) -> Status {
    match &err {
        PulumiError::Canceled { .. } => return Status::cancelled(format!("{op} was canceled")),
        PulumiError::Spawn { .. } | PulumiError::Io { .. } => {
            return Status::unavailable(format!("{op} failed: {err}"));
        }
        _ => {}
    }
    let message = match &err {
        PulumiError::Failed { detail, .. } => format!("{op} failed: {detail}"),
        other => format!("{op} failed: {other}"),
    };
    let text = err.output_text().to_ascii_lowercase();
    let info = if text.contains("another update is currently in progress")
        || text.contains("the stack is currently locked")
    {
        Some((409, "UpdateConflict"))
    } else if text.contains("invalid access token") {
        Some((401, "InvalidAccessToken"))
    } else {
        None
    };
    match info {
        Some((code, reason)) => with_error_info(Code::Unknown, message, code, reason),
        None => Status::unknown(message),
    }
}

/// The Pulumi Cloud link the CLI prints (`View in Browser: …` / `View Live: …`); DIY backends
/// print none.
pub(super) fn permalink(stdout: &str) -> Option<String> {
    stdout.lines().find_map(|line| {
        let line = line.trim();
        [
            "View in Browser (Ctrl+O): ",
            "View in Browser: ",
            "View Live: ",
        ]
        .iter()
        .find_map(|p| line.strip_prefix(p))
        .map(|url| url.trim().to_owned())
        .filter(|url| url.starts_with("http"))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_root_stacks_outputs_event_names_its_secrets() {
        let event = |ty: &str, parent: &str| {
            json!({"resOutputsEvent": {"metadata": {"type": ty, "new": {
                "parent": parent,
                "outputs": {
                    "plain": "hello",
                    "obj": {"a": 1},
                    "sec": {SECRET_SIG_KEY: SECRET_SIG, "ciphertext": "[secret]"},
                    "fake": {SECRET_SIG_KEY: "something else"},
                }
            }}}})
        };
        let root = |v: Value| match v {
            Value::Object(map) => root_outputs(&map),
            _ => None,
        };
        let names = ["fake", "obj", "plain", "sec"].map(String::from);
        assert_eq!(
            root(event(ROOT_STACK_TYPE, "")),
            Some(RootOutputs {
                names: names.into_iter().collect(),
                secret: BTreeSet::from(["sec".to_owned()]),
            })
        );
        // A resource's outputs, or a component typed like the root, say nothing of the stack's.
        assert_eq!(root(event("kubernetes:core/v1:ConfigMap", "")), None);
        assert_eq!(
            root(event(ROOT_STACK_TYPE, "urn:pulumi:dev::p::x::parent")),
            None
        );
        assert_eq!(root(json!({"summaryEvent": {}})), None);
    }

    #[test]
    fn permalink_is_found() {
        assert_eq!(
            permalink("x\n    View in Browser (Ctrl+O): https://app.pulumi.com/o/p/s/updates/1\n"),
            Some("https://app.pulumi.com/o/p/s/updates/1".into())
        );
        assert_eq!(permalink("no link"), None);
    }
}
