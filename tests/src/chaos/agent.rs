//! A hostile workspace agent: the agent runs in a tenant's pod, so whatever it answers is the
//! tenant's to choose. This stub answers the set-up calls honestly and streams an oversized
//! payload from the operation, to show that the Update fails cleanly (`Failed=True` with a
//! reason, `Complete=True`, run once) and that the operator stays up with bounded memory.
//!
//! The stub is a tonic server in the test process, serving TLS with the credentials the
//! operator minted for the Workspace and checking its bearer token like the real agent; this
//! module also stands in for the kubelet of that one Workspace (no agent process runs).

use std::collections::HashMap;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use futures::{Stream, StreamExt, stream};
use k8s_openapi::api::apps::v1::StatefulSet;
use k8s_openapi::api::core::v1::Secret;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference;
use kube::Client;
use kube::api::{Api, PostParams};
use pko_agent::auth::TokenAuth;
use pko_agent::proto as pb;
use pko_agent::proto::automation_service_server::{AutomationService, AutomationServiceServer};
use pko_api::update::{Update, UpdateSpec, UpdateType};
use pko_api::workspace::{Workspace, WorkspaceSpec, WorkspaceStack};
use pko_operator::controller::workspace::pod;
use prost_types::value::Kind;
use tokio::sync::oneshot;
use tonic::service::interceptor::InterceptedService;
use tonic::transport::{Identity, Server, ServerTlsConfig};
use tonic::{Request, Response, Status};

use crate::kubelet::{
    Revisions, annotate_dev_port, create_pod, revision_of, set_sts_status, write_pod_ready,
};
use crate::{ControlPlane, HarnessError, wait_for};

const MIB: usize = 1024 * 1024;
/// An empty list inside a list on the wire: the item's tag and length, the value's tag and
/// length.
const EMPTY_LIST_WIRE_BYTES: usize = 4;
const WORKSPACE: &str = "hostile";
const STACK: &str = "dev";
/// The version the stub claims: recent enough for everything the operator checks.
const PULUMI_VERSION: &str = "v3.274.1";
/// Set-up waits (the workspace becoming ready).
const SETUP_WAIT: Duration = Duration::from_secs(120);

/// What the stub streams from an operation.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Hostility {
    /// One engine event holding one string of `bytes`, then a successful result.
    HugeEvent { bytes: usize },
    /// A successful result whose stdout is one line of `bytes`.
    HugeLine { bytes: usize },
    /// Events of `each` bytes (each under the message limit) until `total_bytes` were sent,
    /// then a successful result; the operator's budget of event bytes per operation is half
    /// of `total_bytes`.
    Flood { total_bytes: usize, each: usize },
    /// One engine event of `lists` empty lists (4 bytes each on the wire, 64 once decoded),
    /// under the message limit; then a successful result.
    EmptyLists { lists: usize },
}

impl Hostility {
    /// The case's name in a report.
    pub fn name(&self) -> &'static str {
        match self {
            Self::HugeEvent { .. } => "huge-event",
            Self::HugeLine { .. } => "huge-line",
            Self::Flood { .. } => "flood",
            Self::EmptyLists { .. } => "empty-lists",
        }
    }

    /// The payload bytes the case is made to send.
    pub fn payload_bytes(&self) -> usize {
        match *self {
            Self::HugeEvent { bytes } | Self::HugeLine { bytes } => bytes,
            Self::Flood { total_bytes, .. } => total_bytes,
            Self::EmptyLists { lists } => lists * EMPTY_LIST_WIRE_BYTES,
        }
    }
}

/// The sizes of the three cases.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AgentScale {
    pub event_bytes: usize,
    pub line_bytes: usize,
    pub flood_bytes: usize,
    /// Empty lists in the event of the empty-lists case.
    pub empty_lists: usize,
}

impl AgentScale {
    /// Quick enough for every test run, and still well over the 16 MiB message limit.
    pub const SHORT: Self = Self {
        event_bytes: 24 * MIB,
        line_bytes: 40 * MIB,
        flood_bytes: 64 * MIB,
        // 4 MiB on the wire, 64 MiB decoded: twice the bound of one event.
        empty_lists: 1 << 20,
    };
    /// The sizes of the chaos run.
    pub const FULL: Self = Self {
        event_bytes: 300 * MIB,
        line_bytes: 1024 * MIB,
        flood_bytes: 1024 * MIB,
        // Just under the 16 MiB message limit; about 850 MiB once decoded before events were
        // charged by their decoded size.
        empty_lists: 4_000_000,
    };

    /// The cases, in the order they run.
    pub fn cases(&self) -> [Hostility; 4] {
        [
            Hostility::HugeEvent {
                bytes: self.event_bytes,
            },
            Hostility::HugeLine {
                bytes: self.line_bytes,
            },
            Hostility::Flood {
                total_bytes: self.flood_bytes,
                each: MIB,
            },
            Hostility::EmptyLists {
                lists: self.empty_lists,
            },
        ]
    }
}

/// What one case did.
#[derive(Clone, Debug)]
pub struct AgentRow {
    pub case: &'static str,
    /// The Update's name.
    pub update: String,
    /// Payload bytes the stub handed to its transport (the operator may have stopped reading
    /// before all of them).
    pub bytes_sent: u64,
    /// `Failed=True`.
    pub failed: bool,
    pub failed_reason: String,
    pub failed_message: String,
    /// `Complete=True`.
    pub complete: bool,
    /// Operations the stub was asked to run for this case's Update, counted once every case
    /// has run (a retry during a later case still shows).
    pub operation_calls: usize,
    /// `/readyz` answered 200 after the case.
    pub operator_ready: bool,
    /// VmHWM of the operator after the case (the peak since it started).
    pub peak_rss_kib: Option<u64>,
    /// VmRSS of the operator after the case.
    pub rss_kib: Option<u64>,
    /// From creating the Update to seeing it complete.
    pub wall: Duration,
}

impl std::fmt::Display for AgentRow {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let kib = |v: Option<u64>| v.map_or("?".to_owned(), |k| format!("{} MiB", k / 1024));
        write!(
            f,
            "{:<10} sent {:>5} MiB | Failed={} {} Complete={} | calls {} | readyz {} | peak RSS {} (now {}) | {:.1?} | {}",
            self.case,
            self.bytes_sent / MIB as u64,
            self.failed,
            self.failed_reason,
            self.complete,
            self.operation_calls,
            if self.operator_ready { 200 } else { 0 },
            kib(self.peak_rss_kib),
            kib(self.rss_kib),
            self.wall,
            self.failed_message,
        )
    }
}

/// What the stub is told and what it counts.
struct Shared {
    hostility: Mutex<Hostility>,
    /// Operations asked for, by the request's `message` (the Update's name).
    calls: Mutex<HashMap<String, usize>>,
    /// Payload bytes handed to the transport since the case began.
    sent: AtomicU64,
}

impl Shared {
    fn hostility(&self) -> Hostility {
        *self
            .hostility
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }

    fn count(&self, message: Option<String>) {
        *self
            .calls
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .entry(message.unwrap_or_default())
            .or_default() += 1;
    }

    fn calls(&self, update: &str) -> usize {
        self.calls
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .get(update)
            .copied()
            .unwrap_or(0)
    }
}

type RpcStream<T> = Pin<Box<dyn Stream<Item = Result<T, Status>> + Send + 'static>>;

/// The `AutomationService` of the stub.
#[derive(Clone)]
struct StubAgent {
    shared: Arc<Shared>,
}

fn summary() -> pb::StackSummary {
    pb::StackSummary {
        name: STACK.into(),
        ..Default::default()
    }
}

fn succeeded() -> pb::UpdateSummary {
    let now = prost_types::Timestamp::from(std::time::SystemTime::now());
    pb::UpdateSummary {
        start_time: Some(now),
        end_time: Some(now),
        result: "succeeded".into(),
        message: String::new(),
    }
}

/// An engine event as Pulumi prints them: a diagnostic whose message is `bytes` long.
fn diagnostic(sequence: usize, bytes: usize) -> prost_types::Struct {
    let value = |kind| prost_types::Value { kind: Some(kind) };
    let text = |s: String| value(Kind::StringValue(s));
    let diag = prost_types::Struct {
        fields: [
            ("message".to_owned(), text("x".repeat(bytes))),
            ("severity".to_owned(), text("info".into())),
        ]
        .into_iter()
        .collect(),
    };
    prost_types::Struct {
        fields: [
            (
                "sequence".to_owned(),
                value(Kind::NumberValue(sequence as f64)),
            ),
            ("diagnosticEvent".to_owned(), value(Kind::StructValue(diag))),
        ]
        .into_iter()
        .collect(),
    }
}

/// An engine event of `lists` empty lists.
fn empty_lists(lists: usize) -> prost_types::Struct {
    let value = |kind| prost_types::Value { kind: Some(kind) };
    let empty = value(Kind::ListValue(prost_types::ListValue::default()));
    prost_types::Struct {
        fields: [(
            "diagnosticEvent".to_owned(),
            value(Kind::ListValue(prost_types::ListValue {
                values: vec![empty; lists],
            })),
        )]
        .into_iter()
        .collect(),
    }
}

/// The hostile answer of an operation, built lazily (a flood never holds more than one event)
/// and counted as the transport takes it.
fn hostile_stream<T: Send + 'static>(
    shared: Arc<Shared>,
    event: fn(prost_types::Struct) -> T,
    result: fn(String) -> T,
) -> RpcStream<T> {
    shared.sent.store(0, Ordering::SeqCst);
    if let Hostility::EmptyLists { lists } = shared.hostility() {
        let first = stream::once(async move {
            shared
                .sent
                .fetch_add((lists * EMPTY_LIST_WIRE_BYTES) as u64, Ordering::SeqCst);
            Ok(event(empty_lists(lists)))
        });
        let last = stream::once(async move { Ok(result(String::new())) });
        return Box::pin(first.chain(last));
    }
    let (events, each, stdout) = match shared.hostility() {
        Hostility::HugeEvent { bytes } => (1, bytes, 0),
        Hostility::HugeLine { bytes } => (0, 0, bytes),
        Hostility::Flood { total_bytes, each } => (total_bytes / each.max(1), each, 0),
        Hostility::EmptyLists { .. } => (0, 0, 0),
    };
    let counted = shared.clone();
    let events = stream::iter(0..events).map(move |i| {
        counted.sent.fetch_add(each as u64, Ordering::SeqCst);
        Ok(event(diagnostic(i, each)))
    });
    let last = stream::once(async move {
        shared.sent.fetch_add(stdout as u64, Ordering::SeqCst);
        Ok(result("x".repeat(stdout)))
    });
    Box::pin(events.chain(last))
}

#[tonic::async_trait]
impl AutomationService for StubAgent {
    async fn who_am_i(
        &self,
        _request: Request<pb::WhoAmIRequest>,
    ) -> Result<Response<pb::WhoAmIResult>, Status> {
        Ok(Response::new(pb::WhoAmIResult {
            user: "stub".into(),
            organizations: vec![],
            url: String::new(),
        }))
    }

    async fn select_stack(
        &self,
        _request: Request<pb::SelectStackRequest>,
    ) -> Result<Response<pb::SelectStackResult>, Status> {
        Ok(Response::new(pb::SelectStackResult {
            summary: Some(summary()),
        }))
    }

    async fn info(
        &self,
        _request: Request<pb::InfoRequest>,
    ) -> Result<Response<pb::InfoResult>, Status> {
        Ok(Response::new(pb::InfoResult {
            summary: Some(summary()),
        }))
    }

    async fn set_all_config(
        &self,
        _request: Request<pb::SetAllConfigRequest>,
    ) -> Result<Response<pb::SetAllConfigResult>, Status> {
        Ok(Response::new(pb::SetAllConfigResult {}))
    }

    async fn add_environments(
        &self,
        _request: Request<pb::AddEnvironmentsRequest>,
    ) -> Result<Response<pb::AddEnvironmentsResult>, Status> {
        Ok(Response::new(pb::AddEnvironmentsResult {}))
    }

    async fn install(
        &self,
        _request: Request<pb::InstallRequest>,
    ) -> Result<Response<pb::InstallResult>, Status> {
        Ok(Response::new(pb::InstallResult {}))
    }

    type PreviewStream = RpcStream<pb::PreviewStream>;

    async fn preview(
        &self,
        request: Request<pb::PreviewRequest>,
    ) -> Result<Response<Self::PreviewStream>, Status> {
        self.shared.count(request.into_inner().message);
        Ok(Response::new(hostile_stream(
            self.shared.clone(),
            |e| pb::PreviewStream {
                response: Some(pb::preview_stream::Response::Event(e)),
            },
            |stdout| pb::PreviewStream {
                response: Some(pb::preview_stream::Response::Result(pb::PreviewResult {
                    stdout,
                    summary: Some(succeeded()),
                    ..Default::default()
                })),
            },
        )))
    }

    type RefreshStream = RpcStream<pb::RefreshStream>;

    async fn refresh(
        &self,
        request: Request<pb::RefreshRequest>,
    ) -> Result<Response<Self::RefreshStream>, Status> {
        self.shared.count(request.into_inner().message);
        Ok(Response::new(hostile_stream(
            self.shared.clone(),
            |e| pb::RefreshStream {
                response: Some(pb::refresh_stream::Response::Event(e)),
            },
            |stdout| pb::RefreshStream {
                response: Some(pb::refresh_stream::Response::Result(pb::RefreshResult {
                    stdout,
                    summary: Some(succeeded()),
                    ..Default::default()
                })),
            },
        )))
    }

    type UpStream = RpcStream<pb::UpStream>;

    async fn up(
        &self,
        request: Request<pb::UpRequest>,
    ) -> Result<Response<Self::UpStream>, Status> {
        self.shared.count(request.into_inner().message);
        Ok(Response::new(hostile_stream(
            self.shared.clone(),
            |e| pb::UpStream {
                response: Some(pb::up_stream::Response::Event(e)),
            },
            |stdout| pb::UpStream {
                response: Some(pb::up_stream::Response::Result(pb::UpResult {
                    stdout,
                    summary: Some(succeeded()),
                    ..Default::default()
                })),
            },
        )))
    }

    type DestroyStream = RpcStream<pb::DestroyStream>;

    async fn destroy(
        &self,
        request: Request<pb::DestroyRequest>,
    ) -> Result<Response<Self::DestroyStream>, Status> {
        self.shared.count(request.into_inner().message);
        Ok(Response::new(hostile_stream(
            self.shared.clone(),
            |e| pb::DestroyStream {
                response: Some(pb::destroy_stream::Response::Event(e)),
            },
            |stdout| pb::DestroyStream {
                response: Some(pb::destroy_stream::Response::Result(pb::DestroyResult {
                    stdout,
                    summary: Some(succeeded()),
                    ..Default::default()
                })),
            },
        )))
    }

    async fn pulumi_version(
        &self,
        _request: Request<pb::PulumiVersionRequest>,
    ) -> Result<Response<pb::PulumiVersionResult>, Status> {
        Ok(Response::new(pb::PulumiVersionResult {
            version: PULUMI_VERSION.into(),
        }))
    }

    async fn set_environment_variables(
        &self,
        _request: Request<pb::SetEnvironmentVariablesRequest>,
    ) -> Result<Response<pb::SetEnvironmentVariablesResult>, Status> {
        Ok(Response::new(pb::SetEnvironmentVariablesResult {}))
    }

    async fn capabilities(
        &self,
        _request: Request<pb::CapabilitiesRequest>,
    ) -> Result<Response<pb::CapabilitiesResult>, Status> {
        Ok(Response::new(pb::CapabilitiesResult {
            agent: "stub".into(),
            features: vec![pko_agent::features::SET_ENVIRONMENT_VARIABLES.into()],
        }))
    }

    async fn update_source(
        &self,
        _request: Request<pb::UpdateSourceRequest>,
    ) -> Result<Response<pb::UpdateSourceResult>, Status> {
        Err(Status::unimplemented("not listed in its capabilities"))
    }
}

/// The stub serving on a loopback port; stops on drop.
pub struct StubServer {
    pub port: u16,
    shared: Arc<Shared>,
    stop: Option<oneshot::Sender<()>>,
}

impl Drop for StubServer {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
    }
}

impl StubServer {
    /// Serves TLS with `cert_pem`/`key_pem`, accepting only `token`.
    pub async fn start(
        cert_pem: Vec<u8>,
        key_pem: Vec<u8>,
        token: String,
        hostility: Hostility,
    ) -> Result<Self, HarnessError> {
        let shared = Arc::new(Shared {
            hostility: Mutex::new(hostility),
            calls: Mutex::new(HashMap::new()),
            sent: AtomicU64::new(0),
        });
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .map_err(|e| HarnessError::io("binding the stub agent", e))?;
        let port = listener
            .local_addr()
            .map_err(|e| HarnessError::io("the stub agent's address", e))?
            .port();
        let tls = ServerTlsConfig::new().identity(Identity::from_pem(cert_pem, key_pem));
        let mut builder = Server::builder()
            .tls_config(tls)
            .map_err(|e| HarnessError::io("the stub agent's TLS", std::io::Error::other(e)))?;
        // The point is to send what the operator must refuse: no bound on this side.
        let service = InterceptedService::new(
            AutomationServiceServer::new(StubAgent {
                shared: shared.clone(),
            })
            .max_encoding_message_size(usize::MAX),
            TokenAuth::new(Some(token)),
        );
        let (stop, stopped) = oneshot::channel::<()>();
        let serve = builder.add_service(service).serve_with_incoming_shutdown(
            tokio_stream::wrappers::TcpListenerStream::new(listener),
            async {
                let _ = stopped.await;
            },
        );
        tokio::spawn(async move {
            if let Err(e) = serve.await {
                eprintln!("pko-tests stub agent: {e}");
            }
        });
        Ok(Self {
            port,
            shared,
            stop: Some(stop),
        })
    }

    /// What the next operation streams.
    pub fn set_hostility(&self, hostility: Hostility) {
        *self
            .shared
            .hostility
            .lock()
            .unwrap_or_else(PoisonError::into_inner) = hostility;
    }

    /// Operations asked for with `message` = `update`.
    pub fn calls(&self, update: &str) -> usize {
        self.shared.calls(update)
    }

    /// Payload bytes handed to the transport in the last operation.
    pub fn sent(&self) -> u64 {
        self.shared.sent.load(Ordering::SeqCst)
    }
}

/// Reads the agent credentials the operator minted for `workspace` and starts the stub with them.
async fn start_stub(
    client: &Client,
    namespace: &str,
    workspace: &str,
) -> Result<StubServer, HarnessError> {
    let secrets: Api<Secret> = Api::namespaced(client.clone(), namespace);
    let name = pod::credentials_name(workspace);
    let data = wait_for(
        &format!("the agent credentials {namespace}/{name}"),
        SETUP_WAIT,
        || async {
            let data = secrets.get_opt(&name).await.ok()??.data?;
            let field = |k: &str| data.get(k).map(|b| b.0.clone());
            Some((field("token")?, field("tls.crt")?, field("tls.key")?))
        },
    )
    .await?;
    let (token, cert, key) = data;
    StubServer::start(
        cert,
        key,
        String::from_utf8_lossy(&token).trim().to_owned(),
        Hostility::HugeEvent { bytes: 0 },
    )
    .await
}

/// The kubelet's part for one workspace whose "agent" is the stub on `port`: the Pod exists and
/// is ready, the StatefulSet is ready and names the port.
async fn stand_in_kubelet(
    client: &Client,
    namespace: &str,
    workspace: &str,
    port: u16,
) -> Result<(), HarnessError> {
    let statefulsets: Api<StatefulSet> = Api::namespaced(client.clone(), namespace);
    let sts_name = pod::workload_name(workspace);
    let sts = wait_for(
        &format!("the StatefulSet {namespace}/{sts_name}"),
        SETUP_WAIT,
        || async { statefulsets.get_opt(&sts_name).await.ok()? },
    )
    .await?;
    let pod_name = format!("{sts_name}-0");
    let template = sts
        .spec
        .as_ref()
        .map(|s| s.template.clone())
        .unwrap_or_default();
    create_pod(
        client,
        namespace,
        &pod_name,
        &sts_name,
        &revision_of(&sts),
        &template,
    )
    .await?;
    let current = annotate_dev_port(client, namespace, &sts_name, port).await?;
    write_pod_ready(client, namespace, &pod_name, true, 0).await?;
    set_sts_status(
        client,
        namespace,
        &sts_name,
        current.metadata.generation.unwrap_or(0),
        Revisions::same(&revision_of(&current)),
        true,
    )
    .await
}

/// The status of condition `type_`: (`status == "True"`, reason, message).
fn condition(update: &Update, type_: &str) -> Option<(bool, String, String)> {
    update
        .status
        .as_ref()?
        .conditions
        .iter()
        .find(|c| c.type_ == type_)
        .map(|c| (c.status == "True", c.reason.clone(), c.message.clone()))
}

/// How long one case may take to complete: generous, as the operator (a debug build, on a
/// loaded machine) reads up to the whole payload.
fn case_timeout(hostility: &Hostility) -> Duration {
    Duration::from_secs(120 + (hostility.payload_bytes() / (4 * MIB)) as u64)
}

/// The operator's `--max-event-bytes-per-operation` in a run at `scale`.
pub fn event_budget(scale: &AgentScale) -> usize {
    (scale.flood_bytes / 2).max(1)
}

/// Runs the three hostile cases of `scale` against a fresh operator watching a namespace of its
/// own; one row per case.
pub async fn hostile_agent(
    plane: &ControlPlane,
    scale: &AgentScale,
) -> Result<Vec<AgentRow>, HarnessError> {
    let ns = plane.namespace("chaos-agent").await?;
    let client = plane.client();
    let operator = super::start_operator(
        plane,
        vec![
            format!("--watch-namespace={ns}"),
            "--workspace-localhost=127.0.0.1".into(),
            // Half the flood, so the flood trips it at any scale (at FULL it is the default,
            // 512 MiB).
            format!("--max-event-bytes-per-operation={}", event_budget(scale)),
        ],
    )
    .await?;

    let workspaces: Api<Workspace> = Api::namespaced(client.clone(), &ns);
    let workspace = Workspace::new(
        WORKSPACE,
        WorkspaceSpec {
            stacks: vec![WorkspaceStack {
                name: STACK.into(),
                create: Some(true),
                ..Default::default()
            }],
            ..Default::default()
        },
    );
    workspaces
        .create(&PostParams::default(), &workspace)
        .await
        .map_err(|e| HarnessError::kube("creating the Workspace", e))?;
    let stub = start_stub(&client, &ns, WORKSPACE).await?;
    stand_in_kubelet(&client, &ns, WORKSPACE, stub.port).await?;
    let ready = wait_for("the workspace to be ready", SETUP_WAIT, || async {
        let ws = workspaces.get(WORKSPACE).await.ok()?;
        let s = ws.status?;
        (s.observed_generation == ws.metadata.generation
            && s.conditions
                .iter()
                .any(|c| c.type_ == "Ready" && c.status == "True"))
        .then_some(())
    })
    .await;
    if let Err(e) = ready {
        let status = workspaces.get(WORKSPACE).await.ok().and_then(|w| w.status);
        return Err(HarnessError::Missing {
            what: format!(
                "a ready Workspace ({e}): {status:?}; operator log:\n{}",
                tail(&operator.log_text(), 40)
            ),
        });
    }

    let updates: Api<Update> = Api::namespaced(client.clone(), &ns);
    let workspace_uid = workspaces
        .get(WORKSPACE)
        .await
        .map_err(|e| HarnessError::kube("reading the Workspace", e))?
        .metadata
        .uid
        .unwrap_or_default();
    let workspace_owner: OwnerReference =
        serde_json::from_value(crate::fixtures::controller_of(WORKSPACE, &workspace_uid)).map_err(
            |e| HarnessError::Missing {
                what: format!("an owner reference: {e}"),
            },
        )?;
    let mut rows = Vec::new();
    for hostility in scale.cases() {
        stub.set_hostility(hostility);
        let name = format!("{}-{}", hostility.name(), rows.len());
        let mut update = Update::new(
            &name,
            UpdateSpec {
                workspace_name: Some(WORKSPACE.into()),
                stack_name: Some(STACK.into()),
                type_: Some(UpdateType::Up),
                // Names the Update in the stub's count of operations.
                message: Some(name.clone()),
                ..Default::default()
            },
        );
        // Controlled by its Workspace, or it is canceled (as in PKO).
        update.metadata.owner_references = Some(vec![workspace_owner.clone()]);
        let started = Instant::now();
        updates
            .create(&PostParams::default(), &update)
            .await
            .map_err(|e| HarnessError::kube(format!("creating Update {name}"), e))?;
        let done = wait_for(
            &format!("Update {name} to complete"),
            case_timeout(&hostility),
            || async {
                let u = updates.get(&name).await.ok()?;
                condition(&u, "Complete")
                    .is_some_and(|(complete, _, _)| complete)
                    .then_some(u)
            },
        )
        .await;
        let wall = started.elapsed();
        let done = match done {
            Ok(u) => u,
            Err(e) => {
                let status = updates.get(&name).await.ok().and_then(|u| u.status);
                return Err(HarnessError::Missing {
                    what: format!(
                        "a completed Update {name} ({e}): {status:?}; operator log:\n{}",
                        tail(&operator.log_text(), 40)
                    ),
                });
            }
        };
        let (failed, failed_reason, failed_message) =
            condition(&done, "Failed").unwrap_or_default();
        let operator_ready = match reqwest::get(operator.probe_url("/readyz")).await {
            Ok(resp) => resp.status().is_success(),
            Err(_) => false,
        };
        rows.push(AgentRow {
            case: hostility.name(),
            update: name.clone(),
            bytes_sent: stub.sent(),
            failed,
            failed_reason,
            failed_message,
            complete: true,
            operation_calls: 0,
            operator_ready,
            peak_rss_kib: operator.peak_rss_kib(),
            rss_kib: operator.rss_kib(),
            wall,
        });
    }
    // Counted last, so an Update run again while a later case ran is seen.
    for row in &mut rows {
        row.operation_calls = stub.calls(&row.update);
    }
    Ok(rows)
}

fn tail(text: &str, lines: usize) -> String {
    let all: Vec<&str> = text.lines().collect();
    all[all.len().saturating_sub(lines)..].join("\n")
}

/// The hostile-agent figures as a report section, with the invariants checked: each case
/// fails its Update once with a reason naming the size problem, and the operator stays up
/// within its memory limit.
pub async fn section(
    plane: &ControlPlane,
    scale: &super::Scale,
) -> Result<super::Section, HarnessError> {
    use super::{MEMORY_LIMIT_MIB, Row, mib};
    let rows = hostile_agent(plane, &scale.agent).await?;
    let mut section = super::Section {
        title:
            "A hostile agent: a huge event, a huge line, a flood of events, an event of empty lists"
                .into(),
        setup: format!(
            "A stub agent (TLS with the operator-minted credentials, token checked) answers \
             the set-up calls honestly, then each Update's operation streams: one engine event \
             of {} MiB; a result whose stdout is one line of {} MiB; events of 1 MiB until {} \
             MiB (the operator's `--max-event-bytes-per-operation` is half that); one event \
             of {} empty lists ({} MiB on the wire, {} MiB at 64 bytes a value once decoded). \
             The operator's message limit is 16 MiB.",
            scale.agent.event_bytes / MIB,
            scale.agent.line_bytes / MIB,
            scale.agent.flood_bytes / MIB,
            scale.agent.empty_lists,
            scale.agent.empty_lists * EMPTY_LIST_WIRE_BYTES / MIB,
            scale.agent.empty_lists * 64 / MIB,
        ),
        ..super::Section::default()
    };
    for row in &rows {
        section.rows.push(Row::new(
            format!("{}: sent, outcome, operations run", row.case),
            format!(
                "{} MiB, Failed {} ({}), {}",
                row.bytes_sent / MIB as u64,
                row.failed_reason,
                if row.complete {
                    "Complete"
                } else {
                    "not Complete"
                },
                row.operation_calls
            ),
            "Failed with a size reason, Complete, run once",
        ));
        section.rows.push(Row::new(
            format!("{}: time to Failed, operator peak RSS", row.case),
            format!(
                "{:.2} s, {}",
                row.wall.as_secs_f64(),
                mib(row.peak_rss_kib.unwrap_or(0))
            ),
            &format!("recorded; peak < {MEMORY_LIMIT_MIB} MiB"),
        ));
        let (reason, says) = match row.case {
            "flood" => ("EventsTooLarge", "--max-event-bytes-per-operation"),
            "empty-lists" => ("EventTooLarge", "once decoded"),
            _ => ("ResponseTooLarge", "16 MiB message limit"),
        };
        section.check(
            row.complete && row.failed && row.failed_reason == reason,
            || format!("{}: expected Failed {reason} and Complete: {row}", row.case),
        );
        section.check(row.failed_message.contains(says), || {
            format!("{}: the message does not name {says}: {row}", row.case)
        });
        section.check(row.operation_calls == 1, || {
            format!(
                "{}: the operation ran {} times",
                row.case, row.operation_calls
            )
        });
        section.check(row.operator_ready, || {
            format!("{}: the operator did not answer /readyz after it", row.case)
        });
        section.check(
            row.peak_rss_kib
                .is_some_and(|peak| peak < MEMORY_LIMIT_MIB * 1024),
            || format!("{}: peak RSS over the limit: {row}", row.case),
        );
    }
    section.check(rows.len() == 4, || {
        format!("{} cases ran, not 4", rows.len())
    });
    Ok(section)
}
