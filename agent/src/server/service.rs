//! The `AutomationService` RPCs: each checks its request, takes the workspace lock when it
//! changes the workspace, and runs the CLI.

use serde_json::Value;
use tonic::{Request, Response, Status};
use tracing::info;

use super::config::{resolve_item, set_all_commands};
use super::operation::RpcStream;
use super::status::{local_summary, permalink, to_status};
use super::{Agent, args, check_name};
use crate::init::{self, FluxFetch, InitError};
use crate::proto as pb;
use crate::proto::automation_service_server::AutomationService;
use crate::pulumi::{Output, tail};
use pko_agent_api::errors::{PLAN_NOT_FOUND, with_error_info};

#[tonic::async_trait]
impl AutomationService for Agent {
    async fn who_am_i(
        &self,
        _request: Request<pb::WhoAmIRequest>,
    ) -> Result<Response<pb::WhoAmIResult>, Status> {
        let who = self
            .inner
            .cli
            .run_json(&args(["whoami", "--json"]))
            .await
            .map_err(|e| to_status("whoami", e))?;
        Ok(self.respond(pb::WhoAmIResult {
            user: who
                .get("user")
                .and_then(Value::as_str)
                .unwrap_or_default()
                .to_owned(),
            organizations: who
                .get("organizations")
                .and_then(Value::as_array)
                .into_iter()
                .flatten()
                .filter_map(Value::as_str)
                .map(str::to_owned)
                .collect(),
            url: who
                .get("url")
                .and_then(Value::as_str)
                .unwrap_or_default()
                .to_owned(),
        }))
    }

    async fn select_stack(
        &self,
        request: Request<pb::SelectStackRequest>,
    ) -> Result<Response<pb::SelectStackResult>, Status> {
        let req = request.into_inner();
        self.select(
            &req.stack_name,
            req.create == Some(true),
            req.secrets_provider.as_deref(),
        )
        .await?;
        if req.skip_summary == Some(true) {
            // Unchecked when this process selected it before: an operation on a stack removed
            // behind it fails with the CLI's "no stack named", which forgets the selection.
            return Ok(self.respond(pb::SelectStackResult { summary: None }));
        }
        let summary = match self.summary().await {
            Ok(summary) => summary,
            Err(s) => {
                // Gone from the backend behind this process: the next selection asks the CLI.
                self.set_stack(None);
                return Err(s);
            }
        };
        Ok(self.respond(pb::SelectStackResult {
            summary: Some(summary),
        }))
    }

    async fn info(
        &self,
        _request: Request<pb::InfoRequest>,
    ) -> Result<Response<pb::InfoResult>, Status> {
        let summary = self.summary().await?;
        Ok(self.respond(pb::InfoResult {
            summary: Some(summary),
        }))
    }

    async fn set_all_config(
        &self,
        request: Request<pb::SetAllConfigRequest>,
    ) -> Result<Response<pb::SetAllConfigResult>, Status> {
        let stack = self.require_stack()?;
        let items = request
            .into_inner()
            .config
            .iter()
            .map(|item| resolve_item(item, |name| self.inner.cli.env_var(name)))
            .collect::<Result<Vec<_>, _>>()?;
        if items.is_empty() {
            return Ok(self.respond(pb::SetAllConfigResult {}));
        }
        let project = self.project()?;
        let _guard = self.inner.lock.lock().await;
        for mut cli_args in set_all_commands(&project.name, &items) {
            cli_args.push(format!("--stack={stack}"));
            self.inner
                .cli
                .run(&cli_args)
                .await
                .map_err(|e| self.stack_failure("config set-all", e))?;
        }
        Ok(self.respond(pb::SetAllConfigResult {}))
    }

    async fn add_environments(
        &self,
        request: Request<pb::AddEnvironmentsRequest>,
    ) -> Result<Response<pb::AddEnvironmentsResult>, Status> {
        let stack = self.require_stack()?;
        let envs = request.into_inner().environment;
        if envs.is_empty() {
            return Ok(self.respond(pb::AddEnvironmentsResult {}));
        }
        for env in &envs {
            check_name("environment", env)?;
        }
        let mut cli_args = args(["config", "env", "add", "--yes"]);
        cli_args.push(format!("--stack={stack}"));
        cli_args.push("--".into());
        cli_args.extend(envs);
        let _guard = self.inner.lock.lock().await;
        self.inner
            .cli
            .run(&cli_args)
            .await
            .map_err(|e| self.stack_failure("config env add", e))?;
        Ok(self.respond(pb::AddEnvironmentsResult {}))
    }

    async fn set_environment_variables(
        &self,
        request: Request<pb::SetEnvironmentVariablesRequest>,
    ) -> Result<Response<pb::SetEnvironmentVariablesResult>, Status> {
        let env: std::collections::BTreeMap<String, String> =
            request.into_inner().env.into_iter().collect();
        if let Some(bad) = env
            .keys()
            .find(|k| k.is_empty() || k.contains('=') || k.contains('\0'))
        {
            return Err(Status::invalid_argument(format!(
                "invalid environment variable name {bad:?}"
            )));
        }
        if let Some((k, _)) = env.iter().find(|(_, v)| v.contains('\0')) {
            return Err(Status::invalid_argument(format!(
                "the value of {k} contains a NUL byte"
            )));
        }
        // Waits for a running operation: its process keeps the variables it started with.
        let _guard = self.inner.lock.lock().await;
        let names: Vec<&String> = env.keys().collect();
        info!(?names, "environment variables set");
        // The backend may have moved with them: the next selection asks the CLI again.
        self.set_stack(None);
        self.inner.cli.set_pushed_env(env);
        Ok(self.respond(pb::SetEnvironmentVariablesResult {}))
    }

    async fn install(
        &self,
        _request: Request<pb::InstallRequest>,
    ) -> Result<Response<pb::InstallResult>, Status> {
        let _guard = self.inner.lock.lock().await;
        self.inner.cli.run(&args(["install"])).await.map_err(|e| {
            Status::aborted(format!("install failed: {}", tail(&e.to_string(), 2000)))
        })?;
        Ok(self.respond(pb::InstallResult {}))
    }

    type PreviewStream = RpcStream<pb::PreviewStream>;

    async fn preview(
        &self,
        request: Request<pb::PreviewRequest>,
    ) -> Result<Response<Self::PreviewStream>, Status> {
        let req = request.into_inner();
        let mut a = args(["preview", "--diff"]);
        push_opt(&mut a, "parallel", req.parallel);
        push_opt(&mut a, "message", req.message.as_deref());
        push_flag(&mut a, "expect-no-changes", req.expect_no_changes);
        push_each(&mut a, "replace", &req.replace);
        push_each(&mut a, "target", &req.target);
        push_flag(&mut a, "target-dependents", req.target_dependents);
        push_flag(&mut a, "refresh", req.refresh);
        if let Some(id) = req.save_plan.as_deref() {
            let path = self.plan_path(id)?;
            if let Some(dir) = path.parent() {
                tokio::fs::create_dir_all(dir)
                    .await
                    .map_err(|e| Status::internal(format!("creating {}: {e}", dir.display())))?;
            }
            a.push(format!("--save-plan={}", path.display()));
        }
        self.operation(
            "preview",
            a,
            |s| pb::PreviewStream {
                response: Some(pb::preview_stream::Response::Event(s)),
            },
            |agent: Agent, _stack, output: Output, times| async move {
                Ok(pb::PreviewStream {
                    response: Some(pb::preview_stream::Response::Result(pb::PreviewResult {
                        summary: Some(local_summary(&times, "")),
                        permalink: permalink(&output.stdout),
                        project_info: agent.project().ok(),
                        stdout: output.stdout,
                        stderr: output.stderr,
                    })),
                })
            },
        )
    }

    type RefreshStream = RpcStream<pb::RefreshStream>;

    async fn refresh(
        &self,
        request: Request<pb::RefreshRequest>,
    ) -> Result<Response<Self::RefreshStream>, Status> {
        let req = request.into_inner();
        // `--preview-only` refuses `--skip-preview`, and needs no `--yes` to run unattended.
        let preview_only = req.preview_only == Some(true);
        let mut a = if preview_only {
            args(["refresh", "--preview-only"])
        } else {
            args(["refresh", "--yes", "--skip-preview"])
        };
        push_opt(&mut a, "parallel", req.parallel);
        push_opt(&mut a, "message", req.message.as_deref());
        push_flag(&mut a, "expect-no-changes", req.expect_no_changes);
        push_each(&mut a, "target", &req.target);
        push_flag(&mut a, "run-program", req.run_program);
        self.operation(
            "refresh",
            a,
            |s| pb::RefreshStream {
                response: Some(pb::refresh_stream::Response::Event(s)),
            },
            move |agent: Agent, stack, output: Output, times| async move {
                // A preview leaves no history entry: the last one is another operation's.
                let summary = if preview_only {
                    local_summary(&times, "")
                } else {
                    agent.last_summary(&stack, &times).await
                };
                Ok(pb::RefreshStream {
                    response: Some(pb::refresh_stream::Response::Result(pb::RefreshResult {
                        summary: Some(summary),
                        permalink: permalink(&output.stdout),
                        project_info: agent.project().ok(),
                        stdout: output.stdout,
                        stderr: output.stderr,
                    })),
                })
            },
        )
    }

    type UpStream = RpcStream<pb::UpStream>;

    async fn up(
        &self,
        request: Request<pb::UpRequest>,
    ) -> Result<Response<Self::UpStream>, Status> {
        let req = request.into_inner();
        let mut a = args([
            "up",
            "--yes",
            "--skip-preview",
            "--suppress-progress",
            "--diff",
        ]);
        push_opt(&mut a, "parallel", req.parallel);
        push_opt(&mut a, "message", req.message.as_deref());
        push_flag(&mut a, "expect-no-changes", req.expect_no_changes);
        push_each(&mut a, "replace", &req.replace);
        push_each(&mut a, "target", &req.target);
        push_flag(&mut a, "target-dependents", req.target_dependents);
        push_flag(&mut a, "refresh", req.refresh);
        push_flag(&mut a, "continue-on-error", req.continue_on_error);
        if let Some(id) = req.plan.as_deref() {
            let path = self.plan_path(id)?;
            let held = tokio::fs::metadata(&path).await.is_ok_and(|m| m.is_file());
            if !held {
                let message = format!(
                    "no update plan {id:?} in this workspace (the agent restarted since the preview that saved it); nothing was run"
                );
                return Err(with_error_info(
                    tonic::Code::FailedPrecondition,
                    message,
                    0,
                    PLAN_NOT_FOUND,
                ));
            }
            a.push(format!("--plan={}", path.display()));
        }
        self.operation(
            "up",
            a,
            |s| pb::UpStream {
                response: Some(pb::up_stream::Response::Event(s)),
            },
            |agent: Agent, stack, output: Output, times| async move {
                // Both only read the backend: side by side, one CLI start off the path.
                let (summary, outputs) = tokio::join!(
                    agent.last_summary(&stack, &times),
                    agent.outputs(&stack, times.root_outputs.as_ref())
                );
                let outputs = outputs?;
                Ok(pb::UpStream {
                    response: Some(pb::up_stream::Response::Result(pb::UpResult {
                        summary: Some(summary),
                        permalink: permalink(&output.stdout),
                        outputs,
                        project_info: agent.project().ok(),
                        stdout: output.stdout,
                        stderr: output.stderr,
                    })),
                })
            },
        )
    }

    type DestroyStream = RpcStream<pb::DestroyStream>;

    async fn destroy(
        &self,
        request: Request<pb::DestroyRequest>,
    ) -> Result<Response<Self::DestroyStream>, Status> {
        let req = request.into_inner();
        let remove = req.remove == Some(true);
        let mut a = args(["destroy", "--yes", "--skip-preview"]);
        push_opt(&mut a, "parallel", req.parallel);
        push_opt(&mut a, "message", req.message.as_deref());
        push_each(&mut a, "target", &req.target);
        push_flag(&mut a, "target-dependents", req.target_dependents);
        push_flag(&mut a, "refresh", req.refresh);
        push_flag(&mut a, "continue-on-error", req.continue_on_error);
        push_flag(&mut a, "remove", req.remove);
        push_flag(&mut a, "run-program", req.run_program);
        self.operation(
            "destroy",
            a,
            |s| pb::DestroyStream {
                response: Some(pb::destroy_stream::Response::Event(s)),
            },
            move |agent: Agent, stack, output: Output, times| async move {
                let summary = if remove {
                    // The stack and its history are gone.
                    agent.set_stack(None);
                    local_summary(&times, "")
                } else {
                    agent.last_summary(&stack, &times).await
                };
                Ok(pb::DestroyStream {
                    response: Some(pb::destroy_stream::Response::Result(pb::DestroyResult {
                        summary: Some(summary),
                        permalink: permalink(&output.stdout),
                        project_info: agent.project().ok(),
                        stdout: output.stdout,
                        stderr: output.stderr,
                    })),
                })
            },
        )
    }

    async fn capabilities(
        &self,
        _request: Request<pb::CapabilitiesRequest>,
    ) -> Result<Response<pb::CapabilitiesResult>, Status> {
        Ok(self.respond(pb::CapabilitiesResult {
            agent: format!("pko-agent {}", crate::VERSION),
            features: pko_agent_api::features::ALL
                .iter()
                .map(|f| (*f).to_owned())
                .collect(),
        }))
    }

    async fn update_source(
        &self,
        request: Request<pb::UpdateSourceRequest>,
    ) -> Result<Response<pb::UpdateSourceResult>, Status> {
        let req = request.into_inner();
        let Some(source) = &self.inner.source else {
            return Err(Status::failed_precondition(
                "this agent was started without a source folder (--source-dir, AGENT_SOURCE_DIR): its source cannot be replaced, its pod must be",
            ));
        };
        let invalid = |e: InitError| Status::invalid_argument(e.to_string());
        let project = init::project_dir(&source.root, Some(&req.dir)).map_err(invalid)?;
        // The CLI runs in the folder this agent started in (its path keys the CLI's workspace
        // state), so a source whose project folder is elsewhere needs a new pod.
        let workdir = self.inner.cli.workdir();
        if project != workdir && std::fs::canonicalize(&project).ok().as_deref() != Some(workdir) {
            return Err(Status::invalid_argument(format!(
                "dir {:?}: the project folder would be {}, but this agent serves {}",
                req.dir,
                project.display(),
                workdir.display()
            )));
        }
        let max_bytes = match req.max_size_bytes {
            None => Some(init::DEFAULT_MAX_BYTES),
            Some(n) => u64::try_from(n).ok(),
        };
        let fetch = FluxFetch {
            url: req.url.clone(),
            digest: req.digest.clone(),
            max_bytes,
            host_override: source.host_override.clone(),
        };
        // Waits for a running operation, and keeps the next one out until the source is whole.
        let _guard = self.inner.lock.lock().await;
        if init::same_digest(init::current_digest(&source.root).as_deref(), &req.digest) {
            return Ok(self.respond(pb::UpdateSourceResult { changed: false }));
        }
        init::fetch_flux(&fetch, &source.root)
            .await
            .map_err(|e| match e {
                e @ (InitError::BadDigest(_) | InitError::BadUrl { .. } | InitError::BadDir(_)) => {
                    invalid(e)
                }
                e => Status::unavailable(format!("fetching {}: {e}", req.url)),
            })?;
        // The stack's config files were in the old source: the next selection runs the CLI, as
        // in a new pod.
        self.set_stack(None);
        let project = self.project()?;
        info!(digest = %req.digest, project = %project.name, "source updated");
        Ok(self.respond(pb::UpdateSourceResult { changed: true }))
    }

    async fn pulumi_version(
        &self,
        _request: Request<pb::PulumiVersionRequest>,
    ) -> Result<Response<pb::PulumiVersionResult>, Status> {
        let version = self.version().await?;
        Ok(self.respond(pb::PulumiVersionResult {
            version: version.clone(),
        }))
    }
}

impl Agent {
    /// `pulumi version`, run once per process.
    async fn version(&self) -> Result<&String, Status> {
        self.inner
            .version
            .get_or_try_init(|| async {
                let out = self
                    .inner
                    .cli
                    .run(&args(["version"]))
                    .await
                    .map_err(|e| to_status("version", e))?;
                Ok::<_, Status>(out.stdout.trim().to_owned())
            })
            .await
    }

    /// Starts `pulumi version` in the background: an operator asks it first on a new pod, and
    /// the answer is then ready (or under way) instead of one more CLI start on the path of
    /// the pod's first operation. A failure here is asked again by the RPC.
    pub fn prefetch_version(&self) {
        let agent = self.clone();
        tokio::spawn(async move {
            let _ = agent.version().await;
        });
    }

    /// The file of the update plan `id`, a checked name (it becomes a file name).
    fn plan_path(&self, id: &str) -> Result<std::path::PathBuf, Status> {
        check_plan_id(id)?;
        Ok(self.inner.cli.plan_path(id))
    }
}

/// Longest plan ID: with `.json` it stays a file name (255 bytes on Linux file systems).
const MAX_PLAN_ID: usize = 240;

/// A plan ID is one file name in the plans directory: letters, digits, '-', '_' and '.', not
/// starting with '.' or '-' (no `..`, no hidden file, no flag), at most [`MAX_PLAN_ID`] bytes.
fn check_plan_id(id: &str) -> Result<(), Status> {
    let ok = !id.is_empty()
        && id.len() <= MAX_PLAN_ID
        && !id.starts_with(['.', '-'])
        && id
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.'));
    if ok {
        Ok(())
    } else {
        Err(Status::invalid_argument(format!(
            "plan {:?} is not a valid plan ID: at most {MAX_PLAN_ID} letters, digits, '-', '_' and '.', not starting with '.' or '-'",
            crate::limits::truncate(id, 64)
        )))
    }
}

fn push_opt(out: &mut Vec<String>, flag: &str, value: Option<impl ToString>) {
    if let Some(v) = value {
        out.push(format!("--{flag}={}", v.to_string()));
    }
}

fn push_flag(out: &mut Vec<String>, flag: &str, on: Option<bool>) {
    if on == Some(true) {
        out.push(format!("--{flag}"));
    }
}

fn push_each(out: &mut Vec<String>, flag: &str, values: &[String]) {
    for v in values {
        out.push(format!("--{flag}={v}"));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_plan_id_is_one_plain_file_name() {
        for good in ["s-18c3f", "stack_1.2", &"a".repeat(MAX_PLAN_ID)] {
            assert!(check_plan_id(good).is_ok(), "{good}");
        }
        for bad in [
            "",
            ".",
            "..",
            ".hidden",
            "-flag",
            "a/b",
            "../etc/passwd",
            "a b",
            "a\0b",
            "é",
            &"a".repeat(MAX_PLAN_ID + 1),
        ] {
            assert!(check_plan_id(bad).is_err(), "{bad:?}");
        }
    }
}
