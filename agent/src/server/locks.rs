//! Stack locks left behind: the in-flight marker each operation writes, and releasing the
//! lock of an earlier agent of this workspace that died during an operation.

use std::path::Path;

use serde_json::Value;
use tokio::sync::mpsc;
use tracing::{info, warn};

use super::{Agent, args};
use crate::inflight::{self, Inflight};
use crate::pulumi::{Output, PulumiError};

impl Agent {
    /// Runs the CLI for one operation on `stack` under the in-flight marker: first releases the
    /// lock of a crashed earlier run, and runs again once when the stack turns out locked by a
    /// dead predecessor pod. Returns the result and when the operation started. Called with
    /// the workspace lock held.
    pub(super) async fn run_marked(
        &self,
        kind: &'static str,
        stack: &str,
        cli_args: Vec<String>,
        events_tx: mpsc::Sender<Value>,
    ) -> (Result<Output, PulumiError>, jiff::Timestamp) {
        let project = self.inner.cli.workdir().to_path_buf();
        self.release_lock_of_crashed_run(&project).await;
        let marker = Inflight {
            operation: kind.to_owned(),
            stack: stack.to_owned(),
            instance: self.inner.instance.clone(),
        };
        if let Err(e) = inflight::write(&project, &marker) {
            // Only crash recovery depends on it; the operation itself can go on.
            warn!(error = %e, "operation marker not written");
        }
        let started = jiff::Timestamp::now();
        info!(operation = kind, %stack, "operation started");
        let mut full = cli_args;
        full.push(format!("--stack={stack}"));
        let cancel = self.inner.shutdown.child_token();
        let mut result = self
            .inner
            .cli
            .operation(&full, events_tx.clone(), cancel.clone())
            .await;
        let retry = match &result {
            Err(e) => self.release_stale_locks_of_this_pod(stack, e).await,
            Ok(_) => false,
        };
        if retry {
            result = self.inner.cli.operation(&full, events_tx, cancel).await;
        } else {
            // The forwarder ends when the last sender is gone.
            drop(events_tx);
        }
        // The CLI has ended (it unlocked the stack), whatever the result.
        inflight::clear(&project);
        (result, started)
    }

    /// Releases the stack lock left by an earlier agent of this workspace that died during an
    /// operation (see [`crate::inflight`]). Called with the workspace lock held, so no operation
    /// of ours is running.
    async fn release_lock_of_crashed_run(&self, project: &Path) {
        let Some(previous) = inflight::read(project) else {
            return;
        };
        if previous.instance == self.inner.instance {
            // Our own marker: a previous operation of this process ended without clearing it.
            inflight::clear(project);
            return;
        }
        let cancel = args(["cancel", "--yes", "--stack", &previous.stack]);
        match self.inner.cli.run(&cancel).await {
            Ok(_) => warn!(
                operation = %previous.operation,
                stack = %previous.stack,
                agent = %previous.instance,
                "released the stack lock left by an agent that stopped during an operation"
            ),
            Err(e) => warn!(
                stack = %previous.stack,
                error = %e,
                "could not release the lock left by an interrupted operation"
            ),
        }
        inflight::clear(project);
    }

    /// After an operation refused because the stack is locked: when every lock was taken on
    /// this pod's host before this agent started (a predecessor pod with this name died
    /// mid-operation, and its marker went with its volume), releases them and says to run again. Called with the workspace lock
    /// held, so none of them is ours.
    async fn release_stale_locks_of_this_pod(&self, stack: &str, err: &PulumiError) -> bool {
        let Some(host) = inflight::hostname() else {
            return false;
        };
        if !inflight::stale_locks_of(&err.output_text(), &host, self.inner.started) {
            return false;
        }
        let cancel = args(["cancel", "--yes", "--stack", stack]);
        match self.inner.cli.run(&cancel).await {
            Ok(_) => {
                warn!(%stack, %host, "released stack locks left by an earlier pod of this workspace; running again");
                true
            }
            Err(e) => {
                warn!(%stack, error = %e, "could not release stale stack locks");
                false
            }
        }
    }
}
