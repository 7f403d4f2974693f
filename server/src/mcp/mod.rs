//! Tandem's sandboxes and tasks as a Model Context Protocol server, for the agents people
//! already use: `tandem mcp` serves it over stdio, and the daemon over streamable HTTP at
//! `/mcp` (behind the API's auth).
//!
//! Tools:
//! - `execute_code`: one block in an executor the operator's policy offers; with a
//!   `session_id`, files persist between calls in that session's workspace;
//! - `run_task`: a whole task (the pair, or a team), its events streamed as progress
//!   notifications, its answer and stop reason returned.
//!
//! Resources: each task's transcript, `tandem://tasks/{id}/transcript`.
//!
//! Sessions belong to one MCP connection: they are closed when it ends and after
//! [`SESSION_IDLE`] without use.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use rmcp::handler::server::common::schema_for_type;
use rmcp::model::{
    CallToolRequestParams, CallToolResponse, CallToolResult, ContentBlock, Implementation,
    InitializeResult, ListResourcesResult, ListToolsResult, PaginatedRequestParams,
    ProgressNotificationParam, ReadResourceRequestParams, ReadResourceResponse, ReadResourceResult,
    Resource, ResourceContents, ServerCapabilities, Tool,
};
use rmcp::service::RequestContext;
use rmcp::{ErrorData, RoleServer, ServerHandler, ServiceExt};
use schemars::JsonSchema;
use serde_json::Value;
use tandem_executor::{
    CancellationToken, ExecContext, ExecOutcome, ExecRequest, ExitStatus, Session,
};
use tandem_protocol::{EventMsg, TaskSpec};

use crate::follow::Follower;
use crate::supervisor::{Supervisor, TaskError};
use files::transcript_uri;

/// The largest block `execute_code` takes: every road's.
pub const MAX_CODE_BYTES: usize = crate::plan::MAX_BLOCK_BYTES;
/// How long an `execute_code` session lives unused: every road's.
pub const SESSION_IDLE: Duration = crate::sandbox::IDLE;
/// Most tool calls one connection may have running at once.
const MAX_CALLS: usize = 4;
/// Most MCP connections the daemon serves at once over HTTP.
const MAX_CONNECTIONS: usize = 64;
/// Transcripts `resources/list` shows: the latest tasks.
const LISTED_TASKS: usize = 50;

/// One MCP connection's server.
#[derive(Clone)]
pub struct TandemMcp {
    supervisor: Arc<Supervisor>,
    sessions: Arc<Sessions>,
    calls: Arc<tokio::sync::Semaphore>,
    /// Served over the daemon's HTTP, which serves a session's ports: the answer of a block
    /// that left a server listening links it.
    links_ports: bool,
}

mod files;
mod sessions;
mod task;

pub use sessions::Sessions;

/// `execute_code`'s arguments; the tool's schema is derived from them.
#[derive(Debug, serde::Deserialize, JsonSchema)]
struct ExecuteCodeArgs {
    /// python, sh, javascript, ... (what the executor runs)
    language: String,
    /// The code to run.
    #[schemars(length(max = MAX_CODE_BYTES))]
    code: String,
    /// Files persist between calls with the same id (closed when the connection ends or after 10 minutes unused)
    session_id: Option<String>,
    /// A sandbox the operator offers (default: the daemon's)
    executor: Option<String>,
    /// Wall-clock limit for the block, in seconds (at most the operator's).
    #[schemars(extend("exclusiveMinimum" = 0))]
    timeout_secs: Option<f64>,
    /// Files to place in the workspace before the code runs
    files: Option<Vec<FileArg>>,
    /// Hosts the code may reach through Tandem's egress proxy (`{"allow": ["pypi.test"]}`),
    /// within what the operator allows; for a session, set by its first call
    network: Option<NetworkArg>,
    /// A snapshot (`snap_…`) whose files the workspace starts with; for a session, its
    /// first call's
    from_snapshot: Option<String>,
    /// Volumes (`tandem volume create`) mounted into the sandbox; for a session, its first
    /// call's
    volumes: Option<Vec<VolumeArg>>,
}

/// A volume mounted into a sandbox.
#[derive(Debug, serde::Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
struct VolumeArg {
    /// The volume's name
    name: String,
    /// Where the sandbox sees it: inside the workspace (`data`), or absolute (`/data`) on docker
    path: String,
    /// Mounted read-only
    read_only: Option<bool>,
}

impl VolumeArg {
    fn mount(self) -> tandem_protocol::volume::VolumeMount {
        tandem_protocol::volume::VolumeMount {
            name: self.name,
            path: self.path,
            read_only: self.read_only.unwrap_or(false),
        }
    }
}

/// `snapshot`'s arguments.
#[derive(Debug, serde::Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
struct SnapshotArgs {
    /// The session (an execute_code session_id of this connection) whose workspace is kept
    session_id: String,
    /// A name to find it by
    name: Option<String>,
}

/// The hosts a call's code may reach through the egress proxy.
#[derive(Debug, serde::Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
struct NetworkArg {
    /// Entries as `[network] allow` takes them: `host`, `*.domain`, `host:port`, `CIDR[:port]`
    allow: Vec<String>,
}

/// A file given to a call: where it goes and what it holds.
#[derive(Debug, serde::Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
struct FileArg {
    /// Its path in the workspace, relative (`data/sales.csv`)
    path: String,
    /// Its content, when it is text
    text: Option<String>,
    /// Its content, base64-encoded (for binary files)
    base64: Option<String>,
}

/// `run_task`'s arguments; the tool's schema is derived from them.
#[derive(Debug, serde::Deserialize, JsonSchema)]
struct RunTaskArgs {
    /// The task, in words.
    task: String,
    /// A sandbox the operator offers (default: the daemon's)
    executor: Option<String>,
    /// A team of agents, as in the HTTP API (docs/teams.md)
    #[schemars(extend("type" = "object"))]
    team: Option<Value>,
    /// Most turns.
    #[schemars(range(min = 1))]
    max_turns: Option<u32>,
    /// Most prompt tokens the task's model calls may send, all together
    #[schemars(range(min = 1))]
    max_input_tokens: Option<u64>,
    /// Most tokens the task's model may write, all together
    #[schemars(range(min = 1))]
    max_output_tokens: Option<u64>,
    /// Most the task's model calls may cost, at the operator's prices
    #[schemars(extend("exclusiveMinimum" = 0))]
    max_cost: Option<f64>,
    /// A JSON Schema the final answer must end with a value of; the value is the result's
    /// `result`
    #[schemars(extend("type" = "object"))]
    output_schema: Option<Value>,
    /// Files to place in the task's workspace; the model is told what they are
    files: Option<Vec<FileArg>>,
    /// Python blocks share one interpreter whose variables survive (local and docker)
    keep_state: Option<bool>,
    /// Labels the Docker host that runs the task's sandbox must carry ({"gpu": "yes"})
    placement: Option<std::collections::BTreeMap<String, String>>,
    /// How the model's code reaches the sandbox: blocks, tool (the execute_code tool call) or auto
    #[schemars(extend("enum" = ["blocks", "tool", "auto"]))]
    code_via: Option<String>,
    /// When a reply's code first fails the examples the task states, how many replies to choose
    /// among, the model's own with them; the one whose code holds the most is kept
    #[schemars(range(min = 1, max = 8))]
    candidates: Option<u32>,
    /// Tools offered to the model: names of the operator's tools, or command tools defined
    /// here ({name, description, parameters, command}), which run in the task's sandbox
    tools: Option<Vec<Value>>,
    /// How to decide the task was solved, run in its sandbox after it ends and never shown
    /// to its model: {expect, file, contents, program, language} (docs/eval.md)
    #[schemars(extend("type" = "object"))]
    check: Option<Value>,
    /// Hosts the task's code may reach through Tandem's egress proxy (`{"allow":
    /// ["pypi.test"]}`), within what the operator allows
    network: Option<NetworkArg>,
    /// Volumes (`tandem volume create`) mounted into the task's sandboxes
    volumes: Option<Vec<VolumeArg>>,
}

/// A tool's arguments as `T`; what does not fit says which argument and why.
fn arguments<T: serde::de::DeserializeOwned>(
    args: serde_json::Map<String, Value>,
) -> Result<T, ErrorData> {
    serde_path_to_error::deserialize(Value::Object(args)).map_err(|e| {
        let inner = e.inner().to_string();
        let message = match inner
            .strip_prefix("missing field `")
            .and_then(|rest| rest.strip_suffix('`'))
        {
            Some(field) => format!("`{field}` is required"),
            None => format!("`{}`: {inner}", e.path()),
        };
        ErrorData::invalid_params(message, None)
    })
}

/// A call that could not be carried out, said as a result the client's model reads.
fn tool_error(text: String) -> CallToolResult {
    CallToolResult::error(vec![ContentBlock::text(text)])
}

fn tools() -> Vec<Tool> {
    vec![
        Tool::new(
            "execute_code",
            "Run one code block in one of Tandem's sandboxes and return its exit code, stdout, stderr, whether output was truncated, and how long it took. Give a session_id to keep files between calls.",
            schema_for_type::<ExecuteCodeArgs>(),
        ),
        Tool::new(
            "run_task",
            "Solve a coding task with Tandem: a model writes code, a sandbox runs it, turn after turn until done. Progress notifications carry the task's events; the result is the final answer and why the task stopped.",
            schema_for_type::<RunTaskArgs>(),
        ),
        Tool::new(
            "snapshot",
            "Keep a copy of a session's workspace (its files) as a snapshot, taken between blocks; returns its id, which execute_code's from_snapshot starts a new session from.",
            schema_for_type::<SnapshotArgs>(),
        ),
    ]
}

impl ServerHandler for TandemMcp {
    fn get_info(&self) -> InitializeResult {
        InitializeResult::new(
            ServerCapabilities::builder()
                .enable_tools()
                .enable_resources()
                .build(),
        )
        .with_server_info(Implementation::new("tandem", env!("CARGO_PKG_VERSION")))
        .with_instructions(
            "execute_code runs code in a sandbox; snapshot keeps a session's files to start others from; run_task solves a whole coding task. Task transcripts are resources.",
        )
    }

    async fn list_tools(
        &self,
        _request: Option<PaginatedRequestParams>,
        _context: RequestContext<RoleServer>,
    ) -> Result<ListToolsResult, ErrorData> {
        Ok(ListToolsResult::with_all_items(tools()))
    }

    async fn call_tool(
        &self,
        request: CallToolRequestParams,
        context: RequestContext<RoleServer>,
    ) -> Result<CallToolResponse, ErrorData> {
        let args = request.arguments.unwrap_or_default();
        let name = request.name.as_ref();
        if !matches!(name, "execute_code" | "run_task" | "snapshot") {
            return Err(ErrorData::invalid_params(
                format!("no tool `{name}`; the tools are execute_code, snapshot and run_task"),
                None,
            ));
        }
        // A call to a tool that exists but cannot be carried out (arguments that fail the
        // schema or the policy, a cap, a sandbox that broke) is a tool result with isError,
        // as the MCP specification asks (SEP-1303): the client's model reads it and can
        // correct itself. Only a call naming no tool is a protocol error.
        let Ok(_call) = self.calls.clone().try_acquire_owned() else {
            return Ok(tool_error(format!(
                "this connection already has {MAX_CALLS} tool calls running; wait for one to end"
            ))
            .into());
        };
        let result = match name {
            "execute_code" => match arguments(args) {
                Ok(args) => self.execute_code(args, &context).await,
                Err(e) => Err(e),
            },
            "snapshot" => match arguments(args) {
                Ok(args) => self.snapshot(args).await,
                Err(e) => Err(e),
            },
            _ => match arguments(args) {
                Ok(args) => self.run_task(args, &context).await,
                Err(e) => Err(e),
            },
        };
        Ok(result
            .unwrap_or_else(|e| tool_error(e.message.into_owned()))
            .into())
    }

    async fn list_resources(
        &self,
        _request: Option<PaginatedRequestParams>,
        _context: RequestContext<RoleServer>,
    ) -> Result<ListResourcesResult, ErrorData> {
        // The newest tasks only, read off the async workers like every other store call.
        let page = self
            .supervisor
            .off_thread(|sup| sup.store().page(None, None, LISTED_TASKS))
            .await
            .map_err(|e| ErrorData::internal_error(e.to_string(), None))?;
        let (tasks, _) = page.map_err(|e| ErrorData::internal_error(e.to_string(), None))?;
        let resources = tasks
            .into_iter()
            .take(LISTED_TASKS)
            .map(|t| {
                let name: String = t.spec.task.chars().take(80).collect();
                Resource::new(transcript_uri(&t.id), name)
                    .with_description(format!(
                        "the transcript of task {} ({})",
                        t.id,
                        t.state.as_str()
                    ))
                    .with_mime_type("text/markdown")
            })
            .collect();
        Ok(ListResourcesResult::with_all_items(resources))
    }

    async fn read_resource(
        &self,
        request: ReadResourceRequestParams,
        _context: RequestContext<RoleServer>,
    ) -> Result<ReadResourceResponse, ErrorData> {
        if let Some((id, path)) = request
            .uri
            .strip_prefix("tandem://tasks/")
            .and_then(|rest| rest.split_once("/files/"))
        {
            return self.read_file(id, path, &request.uri).await;
        }
        let id = request
            .uri
            .strip_prefix("tandem://tasks/")
            .and_then(|rest| rest.strip_suffix("/transcript"))
            .ok_or_else(|| {
                ErrorData::resource_not_found(
                    format!(
                        "no resource {}; transcripts are tandem://tasks/ID/transcript, files tandem://tasks/ID/files/PATH",
                        request.uri
                    ),
                    None,
                )
            })?;
        // Off the async workers, as the API reads the store: a read may wait on the writer's
        // commit.
        let wanted = id.to_owned();
        let read = self
            .supervisor
            .off_thread(move |sup| {
                let record = sup.store().get(&wanted)?;
                Ok::<_, crate::StoreError>(match record {
                    Some(record) => Some((sup.store().events_after(&wanted, 0)?, record)),
                    None => None,
                })
            })
            .await
            .map_err(|e| ErrorData::internal_error(e.to_string(), None))?
            .map_err(|e| ErrorData::internal_error(e.to_string(), None))?;
        let (events, record) =
            read.ok_or_else(|| ErrorData::resource_not_found(format!("no task {id}"), None))?;
        let messages = self.supervisor.transcript(&record, &events);
        let mut text = format!("# Task {id}\n\n{}\n", record.spec.task);
        for m in messages {
            let who = m
                .name
                .clone()
                .unwrap_or_else(|| format!("{:?}", m.role).to_lowercase());
            text.push_str(&format!("\n## {who}\n\n{}\n", m.content));
        }
        Ok(ReadResourceResult::new(vec![
            ResourceContents::text(text, request.uri.clone()).with_mime_type("text/markdown"),
        ])
        .into())
    }
}

/// Serves MCP over this process's stdin and stdout until the client goes; its sessions are
/// closed then.
pub async fn serve_stdio(supervisor: Arc<Supervisor>) -> Result<(), String> {
    let stop = CancellationToken::new();
    let pool = crate::sandbox::Pool::new(supervisor, stop.clone());
    let server = TandemMcp::new(pool);
    let sessions = server.sessions();
    let served = async {
        let running = server
            .serve(rmcp::transport::stdio())
            .await
            .map_err(|e| format!("the MCP client did not start a session: {e}"))?;
        running
            .waiting()
            .await
            .map(|_| ())
            .map_err(|e| e.to_string())
    }
    .await;
    sessions.close_all().await;
    stop.cancel();
    served
}

/// MCP over streamable HTTP, one [`TandemMcp`] per MCP session, for the API's `/mcp`.
pub fn http_service(
    pool: Arc<crate::sandbox::Pool>,
    shutdown: CancellationToken,
) -> rmcp::transport::streamable_http_server::StreamableHttpService<
    TandemMcp,
    rmcp::transport::streamable_http_server::session::local::LocalSessionManager,
> {
    use rmcp::transport::streamable_http_server::{
        StreamableHttpServerConfig, StreamableHttpService, session::local::LocalSessionManager,
    };
    let mut sessions = LocalSessionManager::default();
    sessions.session_config.keep_alive = Some(SESSION_IDLE);
    // The API's own auth (the socket's permissions, or the bearer token) guards /mcp; a
    // Host check would refuse a daemon reached by its name.
    let config = StreamableHttpServerConfig::default()
        .disable_allowed_hosts()
        .with_cancellation_token(shutdown.child_token());
    let live = Arc::new(AtomicUsize::new(0));
    StreamableHttpService::new(
        move || {
            // Each connection holds sessions and calls; past the cap a new one is refused
            // (idle ones close after SESSION_IDLE and free their place).
            if live.fetch_add(1, Ordering::SeqCst) >= MAX_CONNECTIONS {
                live.fetch_sub(1, Ordering::SeqCst);
                return Err(std::io::Error::other(format!(
                    "the daemon already serves {MAX_CONNECTIONS} MCP connections; close one or wait for an idle one to time out"
                )));
            }
            Ok(TandemMcp::counted(pool.clone(), Some(live.clone())))
        },
        Arc::new(sessions),
        config,
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn the_schemas_are_derived_from_the_arguments_the_tools_parse() {
        let tools = tools();
        let execute = serde_json::to_value(&*tools[0].input_schema).unwrap();
        let mut required: Vec<&str> = execute["required"]
            .as_array()
            .unwrap()
            .iter()
            .filter_map(Value::as_str)
            .collect();
        required.sort_unstable();
        assert_eq!(required, ["code", "language"], "{execute}");
        let props = &execute["properties"];
        assert_eq!(props["code"]["maxLength"], MAX_CODE_BYTES, "{execute}");
        assert_eq!(props["timeout_secs"]["exclusiveMinimum"], 0, "{execute}");
        assert!(
            props["session_id"]["description"]
                .as_str()
                .is_some_and(|d| d.contains("persist")),
            "{execute}"
        );
        let run = serde_json::to_value(&*tools[1].input_schema).unwrap();
        assert_eq!(run["required"], json!(["task"]), "{run}");
        assert_eq!(run["properties"]["max_turns"]["minimum"], 1, "{run}");
    }

    #[test]
    fn arguments_that_do_not_fit_name_the_argument() {
        let parse = |v: Value| {
            arguments::<ExecuteCodeArgs>(v.as_object().cloned().unwrap())
                .map(|_| ())
                .map_err(|e| e.message.into_owned())
        };
        assert_eq!(
            parse(json!({"language": "python"})),
            Err("`code` is required".to_owned())
        );
        let wrong = parse(json!({"language": 5, "code": "x"})).unwrap_err();
        assert!(
            wrong.starts_with("`language`: invalid type: integer `5`"),
            "{wrong}"
        );
        assert_eq!(parse(json!({"language": "sh", "code": "x"})), Ok(()));
    }
}
