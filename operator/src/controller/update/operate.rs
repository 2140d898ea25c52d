//! Running one operation against the workspace's agent: connecting, streaming the engine
//! events (resource-change Events, the summary, the byte budget) and reading a failed RPC.

use std::collections::{BTreeMap, BTreeSet};

use kube::ResourceExt;
use kube::runtime::events::EventType;
use pko_agent_api::client::AgentClient;
use pko_agent_api::proto as pb;
use pko_api::update::{PlanSummary, ResourceChanges, Update, UpdateType};
use pko_api::workspace::Workspace;
use serde_json::Value;

use super::outcome::Outcome;
use super::{
    EVENT_TOO_LARGE, EVENTS_TOO_LARGE, MAX_EVENT_DECODED_BYTES, MAX_RESOURCE_EVENTS, MESSAGE_LIMIT,
    RESPONSE_TOO_LARGE, UpdateContext, stack_name,
};
use crate::agent_client::AgentError;
use crate::controller::conditions;

pub(super) async fn connect(
    ctx: &UpdateContext,
    ws: &Workspace,
    ws_name: &str,
    namespace: &str,
    address: &str,
) -> Result<AgentClient, AgentError> {
    let auth =
        crate::controller::workspace::agent_auth(&ctx.agents, ws, ws_name, namespace).await?;
    ctx.agents.client(ws_name, namespace, address, &auth).await
}

/// URNs kept of the resources a preview-only refresh found changed (all are counted).
pub(super) const MAX_CHANGED_RESOURCES: usize = 20;

/// Counts of resource operations and the errors the engine reported.
#[derive(Default)]
struct EventDigest {
    ops: BTreeMap<String, u64>,
    /// Resources a refresh found changed outside Pulumi, by URN.
    drifted: BTreeSet<String>,
    /// The first changes a preview shows, `<op> <urn>`.
    planned: Vec<String>,
    errors: Vec<String>,
    published: usize,
    /// Decoded bytes of the events received ([`pko_agent_api::values::decoded_size`]).
    bytes: u64,
    /// An event whose decoded size passed [`MAX_EVENT_DECODED_BYTES`] was refused.
    event_too_large: bool,
    /// The bytes allowed (`--max-event-bytes-per-operation`).
    budget: u64,
}

impl EventDigest {
    fn new(budget: u64) -> Self {
        Self {
            budget,
            ..Self::default()
        }
    }

    /// Charges an event's decoded size (before anything is made of it); whether the event is
    /// within its own bound and the operation within its budget.
    fn admit(&mut self, event: &prost_types::Struct) -> bool {
        let Some(size) = pko_agent_api::values::decoded_size(event, MAX_EVENT_DECODED_BYTES) else {
            self.event_too_large = true;
            return false;
        };
        self.bytes = self.bytes.saturating_add(size);
        over_event_budget(self.bytes, self.budget).is_none()
    }

    /// The outcome of an operation stopped by its events' size, if it was.
    fn refusal(&self) -> Option<Outcome> {
        if self.event_too_large {
            return Some(Outcome::failed(
                EVENT_TOO_LARGE,
                format!(
                    "the workspace agent sent an engine event over {} MiB once decoded (each value is charged {} bytes, strings and keys their length); the operation was stopped",
                    MAX_EVENT_DECODED_BYTES >> 20,
                    pko_agent_api::values::NODE_BYTES
                ),
            ));
        }
        over_event_budget(self.bytes, self.budget)
    }

    async fn observe(&mut self, ctx: &UpdateContext, update: &Update, event: &prost_types::Struct) {
        let event = Value::Object(pko_agent_api::values::from_struct(event));
        if let Some(urn) = refreshed_change(&event) {
            self.drifted.insert(urn);
        }
        if let Some(meta) = event.pointer("/resOutputsEvent/metadata") {
            let op = meta["op"].as_str().unwrap_or("same").to_owned();
            if op != "same" && self.published < MAX_RESOURCE_EVENTS {
                self.published += 1;
                let note = format!(
                    "{op} {} ({})",
                    meta["urn"].as_str().unwrap_or_default(),
                    meta["type"].as_str().unwrap_or_default()
                );
                ctx.event(update, EventType::Normal, "ResourceChanged", note)
                    .await;
            }
            if pko_api::update::is_change(&op) && self.planned.len() < MAX_CHANGED_RESOURCES {
                let urn = meta["urn"].as_str().unwrap_or_default();
                self.planned.push(format!("{op} {urn}"));
            }
            *self.ops.entry(op).or_default() += 1;
        }
        if let Some(diag) = event.get("diagnosticEvent")
            && diag["severity"] == "error"
        {
            let message = diag["message"]
                .as_str()
                .unwrap_or_default()
                .trim()
                .to_owned();
            if !message.is_empty() && self.errors.len() < 5 {
                self.errors.push(message);
            }
        }
    }

    /// What a refresh found changed: the count, and the first URNs in order.
    fn changes(&self) -> ResourceChanges {
        ResourceChanges {
            count: i64::try_from(self.drifted.len()).unwrap_or(i64::MAX),
            resources: self
                .drifted
                .iter()
                .take(MAX_CHANGED_RESOURCES)
                .cloned()
                .collect(),
        }
    }

    /// What a preview's plan would do: the count of each operation, and its first changes.
    fn plan(&self) -> PlanSummary {
        PlanSummary {
            counts: self
                .ops
                .iter()
                .map(|(op, n)| (op.clone(), i64::try_from(*n).unwrap_or(i64::MAX)))
                .collect(),
            changes: self.planned.clone(),
        }
    }

    fn summary(&self) -> String {
        if self.ops.is_empty() {
            return "no resource changes".into();
        }
        self.ops
            .iter()
            .map(|(op, n)| format!("{op}: {n}"))
            .collect::<Vec<_>>()
            .join(", ")
    }
}

macro_rules! stream_op {
    ($ctx:expr, $update:expr, $digest:expr, $call:expr, $module:ident) => {{
        let mut stream = match $call.await {
            Ok(s) => s.into_inner(),
            Err(s) => return Err(s),
        };
        let mut result = None;
        while let Some(msg) = stream.message().await? {
            match msg.response {
                // Past the budget the call is dropped, which stops the operation in the agent.
                Some(pb::$module::Response::Event(e)) if !$digest.admit(&e) => {
                    return Err(tonic::Status::resource_exhausted(
                        "engine events over budget",
                    ));
                }
                Some(pb::$module::Response::Event(e)) => $digest.observe($ctx, $update, &e).await,
                Some(pb::$module::Response::Result(r)) => result = Some(r),
                None => {}
            }
        }
        result
            .ok_or_else(|| tonic::Status::unknown("the agent closed the stream without a result"))?
    }};
}

pub(super) async fn operate(
    ctx: &UpdateContext,
    update: &Update,
    mut client: AgentClient,
) -> Outcome {
    let stack = stack_name(update);
    if let Err(s) = client
        .select_stack(pb::SelectStackRequest {
            stack_name: stack.clone(),
            create: Some(true),
            secrets_provider: None,
            // Never read here; it costs the agent a `stack ls`.
            skip_summary: Some(true),
        })
        .await
    {
        return status_outcome(ctx, update, &s);
    }
    let mut digest = EventDigest::new(ctx.max_event_bytes);
    let result = run_operation(ctx, update, &mut client, &mut digest).await;
    match result {
        Ok(mut outcome) => {
            if update.spec.preview_only == Some(true) {
                outcome.changes = Some(digest.changes());
            }
            if update.spec.plan.is_some() && update.spec.type_ == Some(UpdateType::Preview) {
                outcome.plan = Some(digest.plan());
            }
            let changes = digest.summary();
            outcome.message = match &outcome.summary {
                Some(s) if !s.message.is_empty() => format!("{}: {changes}", s.message),
                _ => changes,
            };
            outcome
        }
        Err(s) => {
            let mut outcome = digest
                .refusal()
                .unwrap_or_else(|| status_outcome(ctx, update, &s));
            if !digest.errors.is_empty() {
                outcome.message =
                    format!("{} (engine: {})", outcome.message, digest.errors.join("; "));
            }
            outcome.message = conditions::truncate(&outcome.message, MESSAGE_LIMIT);
            outcome
        }
    }
}

async fn run_operation(
    ctx: &UpdateContext,
    update: &Update,
    client: &mut AgentClient,
    digest: &mut EventDigest,
) -> Result<Outcome, tonic::Status> {
    let spec = &update.spec;
    let ok = Outcome::ended;
    match spec.type_.unwrap_or(UpdateType::Up) {
        UpdateType::Preview => {
            let r = stream_op!(
                ctx,
                update,
                digest,
                client.preview(pb::PreviewRequest {
                    parallel: spec.parallel,
                    message: spec.message.clone(),
                    expect_no_changes: spec.expect_no_changes,
                    replace: spec.replace.clone(),
                    target: spec.target.clone(),
                    target_dependents: spec.target_dependents,
                    policy_pack: vec![],
                    refresh: spec.refresh,
                    // Sent only to an agent that lists the feature (checked before).
                    save_plan: spec.plan.clone(),
                }),
                preview_stream
            );
            Ok(ok(r.summary, r.permalink, r.project_info))
        }
        UpdateType::Up => {
            let r = stream_op!(
                ctx,
                update,
                digest,
                client.up(pb::UpRequest {
                    parallel: spec.parallel,
                    message: spec.message.clone(),
                    expect_no_changes: spec.expect_no_changes,
                    replace: spec.replace.clone(),
                    target: spec.target.clone(),
                    target_dependents: spec.target_dependents,
                    policy_pack: vec![],
                    refresh: spec.refresh,
                    continue_on_error: spec.continue_on_error,
                    plan: spec.plan.clone(),
                }),
                up_stream
            );
            let mut outcome = ok(r.summary, r.permalink, r.project_info);
            outcome.outputs = Some(r.outputs);
            Ok(outcome)
        }
        UpdateType::Refresh => {
            let r = stream_op!(
                ctx,
                update,
                digest,
                client.refresh(pb::RefreshRequest {
                    parallel: spec.parallel,
                    message: spec.message.clone(),
                    expect_no_changes: spec.expect_no_changes,
                    target: spec.target.clone(),
                    // Sent only to an agent that lists the feature (checked before the
                    // operation starts): PKO's would ignore it and write the state.
                    preview_only: spec.preview_only.filter(|p| *p),
                    run_program: spec.run_program,
                }),
                refresh_stream
            );
            Ok(ok(r.summary, r.permalink, r.project_info))
        }
        UpdateType::Destroy => {
            let r = stream_op!(
                ctx,
                update,
                digest,
                client.destroy(pb::DestroyRequest {
                    parallel: spec.parallel,
                    message: spec.message.clone(),
                    target: spec.target.clone(),
                    target_dependents: spec.target_dependents,
                    refresh: spec.refresh,
                    continue_on_error: spec.continue_on_error,
                    remove: spec.remove,
                    run_program: spec.run_program,
                }),
                destroy_stream
            );
            Ok(ok(r.summary, r.permalink, r.project_info))
        }
    }
}

/// The URN of a resource an engine event of a refresh shows changed outside Pulumi. A step's
/// result is in its outputs event, where the engine gives a refresh step the operation it
/// amounts to (`update` or `delete` when the resource changed or is gone, `same` otherwise);
/// an engine that still says `refresh` there is read by comparing the recorded outputs with the
/// refreshed ones. The stack itself and providers are not resources that drift.
fn refreshed_change(event: &Value) -> Option<String> {
    let meta = event.pointer("/resOutputsEvent/metadata")?;
    let urn = meta["urn"].as_str()?;
    let type_ = meta["type"].as_str().unwrap_or_default();
    if type_ == "pulumi:pulumi:Stack" || type_.starts_with("pulumi:providers:") {
        return None;
    }
    let changed = match meta["op"].as_str().unwrap_or("same") {
        "same" | "read" | "discard" => false,
        "refresh" => {
            meta["new"].is_null() || meta.pointer("/old/outputs") != meta.pointer("/new/outputs")
        }
        _ => true,
    };
    changed.then(|| urn.to_owned())
}

/// A failed RPC as an outcome: PKO's `PulumiErrorInfo` reason when attached, a clear reason when
/// the agent went away, `Unknown` otherwise.
fn status_outcome(ctx: &UpdateContext, update: &Update, s: &tonic::Status) -> Outcome {
    if let Some(info) = pko_agent_api::errors::error_info(s) {
        return Outcome::failed(&info.reason, s.message().to_owned());
    }
    if let Some(outcome) = too_large(s) {
        return outcome;
    }
    let text = s.message().to_ascii_lowercase();
    let lost = matches!(s.code(), tonic::Code::Unavailable | tonic::Code::Cancelled)
        || [
            "transport",
            "connection",
            "broken pipe",
            "stream closed",
            "h2 protocol",
            "error reading a body",
        ]
        .iter()
        .any(|p| text.contains(p));
    if lost {
        if let Some(ws) = &update.spec.workspace_name
            && let Some(ns) = update.namespace()
        {
            ctx.agents.forget(ws, &ns);
        }
        return Outcome::failed(
            "AgentUnavailable",
            format!(
                "the connection to the workspace agent was lost during the operation ({:?}: {})",
                s.code(),
                s.message()
            ),
        );
    }
    let message = if s.message().is_empty() {
        "An unknown error occurred".to_owned()
    } else {
        s.message().to_owned()
    };
    Outcome::failed("Unknown", message)
}

/// An answer the transport refused for its size (over 16 MiB, either end): the operation may
/// have run, but its result cannot be had, so running it again would not help.
fn too_large(s: &tonic::Status) -> Option<Outcome> {
    let refused =
        s.code() == tonic::Code::OutOfRange || s.message().contains("message length too large");
    refused.then(|| {
        Outcome::failed(
            RESPONSE_TOO_LARGE,
            format!(
                "an answer of the workspace agent is over the {} MiB message limit: {}",
                pko_agent_api::MAX_MESSAGE_BYTES / (1024 * 1024),
                s.message()
            ),
        )
    })
}

/// An operation whose engine events came to `received` bytes (decoded), over the `budget` of one
/// operation: an agent streaming without end (each event under the message limit) would hold
/// an operation slot and the operator's CPU for as long as it likes.
fn over_event_budget(received: u64, budget: u64) -> Option<Outcome> {
    (received > budget).then(|| {
        Outcome::failed(
            EVENTS_TOO_LARGE,
            format!(
                "the workspace agent streamed over {} MiB ({budget} bytes) of engine events in one operation, the most allowed (--max-event-bytes-per-operation); the operation was stopped",
                budget / (1024 * 1024)
            ),
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_answer_over_the_message_limit_is_response_too_large() {
        for status in [
            tonic::Status::out_of_range(
                "Error, decoded message length too large: found 17000000 bytes, the limit is: 16777216 bytes",
            ),
            tonic::Status::internal("Error, encoded message length too large: found 1 bytes"),
        ] {
            let outcome = too_large(&status).expect("too large");
            assert!(!outcome.succeeded);
            assert_eq!(outcome.reason, "ResponseTooLarge");
            assert!(
                outcome.message.contains("16 MiB") && outcome.message.contains(status.message()),
                "{}",
                outcome.message
            );
        }
        assert!(too_large(&tonic::Status::unavailable("connection reset")).is_none());
        assert!(too_large(&tonic::Status::unknown("up failed")).is_none());
    }

    #[test]
    fn events_past_the_budget_of_an_operation_fail_it() {
        assert!(over_event_budget(0, 1).is_none());
        assert!(over_event_budget(32 << 20, 32 << 20).is_none());
        let outcome = over_event_budget((32 << 20) + 1, 32 << 20).expect("over");
        assert!(!outcome.succeeded);
        assert_eq!(outcome.reason, "EventsTooLarge");
        assert!(
            outcome.message.contains("32 MiB (33554432 bytes)")
                && outcome.message.contains("--max-event-bytes-per-operation"),
            "{}",
            outcome.message
        );

        // Each event decodes to 40 + 7 + 64 = 111 bytes.
        let mut digest = EventDigest::new(250);
        let event = prost_types::Struct {
            fields: [(
                "message".to_owned(),
                prost_types::Value {
                    kind: Some(prost_types::value::Kind::StringValue("x".repeat(40))),
                },
            )]
            .into_iter()
            .collect(),
        };
        assert!(digest.admit(&event));
        assert!(digest.admit(&event));
        assert!(!digest.admit(&event), "{} bytes", digest.bytes);
        assert_eq!(digest.refusal().expect("over").reason, "EventsTooLarge");
    }

    #[test]
    fn an_event_of_many_empty_lists_is_refused_by_its_decoded_size() {
        use prost_types::value::Kind;
        use prost_types::{ListValue, Value as PbValue};
        // 4 MiB on the wire (4 bytes a list), 64 MiB once decoded.
        let empty = PbValue {
            kind: Some(Kind::ListValue(ListValue::default())),
        };
        let event = prost_types::Struct {
            fields: [(
                "diagnosticEvent".to_owned(),
                PbValue {
                    kind: Some(Kind::ListValue(ListValue {
                        values: vec![empty; 1 << 20],
                    })),
                },
            )]
            .into_iter()
            .collect(),
        };
        assert!(prost::Message::encoded_len(&event) < (4 << 20) + 64);
        let mut digest = EventDigest::new(DEFAULT_BUDGET);
        assert!(!digest.admit(&event));
        let outcome = digest.refusal().expect("refused");
        assert!(!outcome.succeeded);
        assert_eq!(outcome.reason, "EventTooLarge");
        assert!(
            outcome.message.contains("once decoded"),
            "{}",
            outcome.message
        );
    }

    const DEFAULT_BUDGET: u64 = super::super::DEFAULT_MAX_EVENT_BYTES_PER_OPERATION;

    fn outputs_event(op: &str, type_: &str, old: Value, new: Value) -> Value {
        serde_json::json!({"resOutputsEvent": {"metadata": {
            "op": op, "urn": format!("urn:pulumi:dev::p::{type_}::r"), "type": type_,
            "old": old, "new": new,
        }, "planning": true}})
    }

    #[test]
    fn a_refresh_names_the_resources_it_found_changed_or_gone() {
        use serde_json::json;
        let cm = "kubernetes:core/v1:ConfigMap";
        let state = |v: &str| json!({"outputs": {"data": {"v": v}}});
        let urn = Some("urn:pulumi:dev::p::kubernetes:core/v1:ConfigMap::r".to_owned());
        // What the engine reports for a refresh step: the operation it amounts to.
        assert_eq!(
            refreshed_change(&outputs_event("update", cm, state("a"), state("b"))),
            urn
        );
        assert_eq!(
            refreshed_change(&outputs_event("delete", cm, state("a"), Value::Null)),
            urn
        );
        assert_eq!(
            refreshed_change(&outputs_event("same", cm, state("a"), state("a"))),
            None
        );
        // An engine that says `refresh`: the states tell.
        assert_eq!(
            refreshed_change(&outputs_event("refresh", cm, state("a"), state("b"))),
            urn
        );
        assert_eq!(
            refreshed_change(&outputs_event("refresh", cm, state("a"), Value::Null)),
            urn
        );
        assert_eq!(
            refreshed_change(&outputs_event("refresh", cm, state("a"), state("a"))),
            None
        );
        // The stack and providers do not drift; a step's first event is not its result.
        for type_ in ["pulumi:pulumi:Stack", "pulumi:providers:kubernetes"] {
            assert_eq!(
                refreshed_change(&outputs_event("update", type_, state("a"), state("b"))),
                None
            );
        }
        let pre = json!({"resourcePreEvent": {"metadata": {"op": "refresh", "urn": "urn:x",
            "type": cm, "old": state("a"), "new": null}}});
        assert_eq!(refreshed_change(&pre), None);
    }

    #[test]
    fn a_digest_lists_each_changed_resource_once_and_counts_them_all() {
        let mut digest = EventDigest::new(DEFAULT_BUDGET);
        for i in 0..25 {
            digest.drifted.insert(format!("urn:{i:02}"));
        }
        digest.drifted.insert("urn:00".into());
        let changes = digest.changes();
        assert_eq!(changes.count, 25);
        assert_eq!(changes.resources.len(), MAX_CHANGED_RESOURCES);
        assert_eq!(changes.resources[0], "urn:00");
    }
}
