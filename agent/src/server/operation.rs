//! One engine operation (preview, refresh, up, destroy) as a stream: a task that owns the
//! workspace lock runs the CLI, forwards its engine events to the client and ends the stream
//! with the result.

use std::pin::Pin;

use futures::Stream;
use serde_json::Value;
use tokio::sync::mpsc;
use tonic::{Code, Response, Status};
use tracing::{info, warn};

use super::Agent;
use super::status::{OpReport, RootOutputs, root_outputs};
use crate::limits::MAX_MESSAGE_BYTES;
use crate::pulumi::Output;
use crate::values;
use pko_agent_api::errors::{RESPONSE_TOO_LARGE, with_error_info};

pub(super) type RpcStream<T> = Pin<Box<dyn Stream<Item = Result<T, Status>> + Send + 'static>>;

/// Events buffered between the CLI and a slow client.
const EVENT_BUFFER: usize = 256;

impl Agent {
    /// Runs one engine operation in a task that owns the workspace lock, streaming its events
    /// through `wrap_event` and its result through `finish`.
    pub(super) fn operation<T, F, Fut>(
        &self,
        kind: &'static str,
        cli_args: Vec<String>,
        wrap_event: fn(prost_types::Struct) -> T,
        finish: F,
    ) -> Result<Response<RpcStream<T>>, Status>
    where
        T: prost::Message + Send + 'static,
        F: FnOnce(Agent, String, Output, OpReport) -> Fut + Send + 'static,
        Fut: std::future::Future<Output = Result<T, Status>> + Send,
    {
        let stack = self.require_stack()?;
        let (tx, rx) = mpsc::channel::<Result<T, Status>>(EVENT_BUFFER);
        let agent = self.clone();
        tokio::spawn(async move {
            let _guard = agent.inner.lock.lock().await;
            let (events_tx, events_rx) = mpsc::channel::<Value>(EVENT_BUFFER);
            let forward = forward_events(kind, wrap_event, events_rx, tx.clone());
            let (result, started) = agent.run_marked(kind, &stack, cli_args, events_tx).await;
            let root_outputs = forward.await.ok().flatten();
            let times = OpReport {
                start: started,
                end: jiff::Timestamp::now(),
                root_outputs,
            };
            let message = match result {
                Ok(output) => finish(agent.clone(), stack, output, times)
                    .await
                    .and_then(|m| within_message_limit(kind, m)),
                Err(e) => Err(agent.stack_failure(kind, e)),
            };
            if let Err(status) = &message {
                warn!(operation = kind, code = ?status.code(), message = status.message(), "operation failed");
            } else {
                info!(operation = kind, "operation finished");
            }
            let _ = tx.send(message).await;
        });
        let stream = tokio_stream::wrappers::ReceiverStream::new(rx);
        Ok(self.respond(Box::pin(stream) as RpcStream<T>))
    }
}

/// Forwards engine events to the client until the CLI stops writing them or the client is
/// gone; dropping `events_rx` then tells the CLI runner to interrupt pulumi. Returns the root
/// stack's outputs from the last outputs event that named them.
fn forward_events<T>(
    kind: &'static str,
    wrap_event: fn(prost_types::Struct) -> T,
    mut events_rx: mpsc::Receiver<Value>,
    forward_tx: mpsc::Sender<Result<T, Status>>,
) -> tokio::task::JoinHandle<Option<RootOutputs>>
where
    T: prost::Message + Send + 'static,
{
    tokio::spawn(async move {
        let mut root = None;
        loop {
            // A blocked program writes no events: notice the client leaving anyway.
            let event = tokio::select! {
                event = events_rx.recv() => event,
                () = forward_tx.closed() => break,
            };
            let Some(event) = event else { break };
            let Value::Object(map) = event else { continue };
            if let Some(outputs) = root_outputs(&map) {
                root = Some(outputs);
            }
            let message = wrap_event(values::to_struct(&map));
            // Its strings are bounded already; only an event of very many of them
            // gets here, and sending it would end the whole stream.
            let size = message.encoded_len();
            if size > MAX_MESSAGE_BYTES {
                warn!(
                    operation = kind,
                    size,
                    limit = MAX_MESSAGE_BYTES,
                    "engine event dropped: over the message limit"
                );
                continue;
            }
            if forward_tx.send(Ok(message)).await.is_err() {
                break;
            }
        }
        root
    })
}

/// `message` when it fits in one gRPC message; else a status that says so (the transport would
/// fail the stream with a bare "encoded message length too large").
fn within_message_limit<T: prost::Message>(kind: &str, message: T) -> Result<T, Status> {
    let size = message.encoded_len();
    if size <= MAX_MESSAGE_BYTES {
        return Ok(message);
    }
    Err(with_error_info(
        Code::OutOfRange,
        format!(
            "the result of {kind} is {size} bytes, over the {MAX_MESSAGE_BYTES}-byte message limit (its outputs or CLI output are too large together; each output value is cut at --max-output-value-bytes)"
        ),
        413,
        RESPONSE_TOO_LARGE,
    ))
}
