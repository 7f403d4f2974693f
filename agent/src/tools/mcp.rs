//! The tools of an MCP server, offered to the model: the operator names a server
//! (`[tools.NAME] mcp = ["program", "arg"]`), Tandem starts it once over stdio as an MCP client,
//! and each of its tools is `NAME__TOOL`.

use std::sync::Arc;
use std::time::Duration;

use rmcp::ServiceExt;
use rmcp::model::CallToolRequestParams;
use rmcp::service::{RoleClient, RunningService};
use serde_json::{Map, Value};

/// A running MCP server and the tools it lists.
pub struct McpSource {
    name: String,
    service: RunningService<RoleClient, ()>,
    /// `(tool name, description, input schema)`, as the server listed them.
    pub tools: Vec<(String, String, Value)>,
}

impl std::fmt::Debug for McpSource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("McpSource")
            .field("name", &self.name)
            .field("tools", &self.tools.len())
            .finish_non_exhaustive()
    }
}

impl PartialEq for McpSource {
    fn eq(&self, other: &Self) -> bool {
        std::ptr::eq(self, other)
    }
}

/// Why an MCP server could not be started or a call to it failed; each names the server.
#[derive(Debug, thiserror::Error)]
pub enum McpError {
    /// The entry names no program.
    #[error("mcp needs a program: mcp = [\"program\", \"arg\"]")]
    NoProgram,
    /// The program did not start.
    #[error("cannot start the MCP server `{program}`: {source}")]
    Start {
        /// The program.
        program: String,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// It started but did not speak MCP as asked.
    #[error("the MCP server `{program}` did not {what}: {detail}")]
    Protocol {
        /// The program.
        program: String,
        /// What it did not do (`complete the handshake`, `list its tools`).
        what: &'static str,
        /// What went wrong.
        detail: String,
    },
    /// It did not start or list its tools in time.
    #[error("the MCP server `{program}` did not answer within {limit:?}")]
    Slow {
        /// The program.
        program: String,
        /// The time it had.
        limit: Duration,
    },
    /// A call was not answered in time.
    #[error("the MCP server of `{tool}` did not answer within {timeout:?}")]
    CallTimedOut {
        /// The tool entry.
        tool: String,
        /// The time it had.
        timeout: Duration,
    },
    /// The server broke during a call.
    #[error("the MCP server of `{tool}` failed: {detail}")]
    Broke {
        /// The tool entry.
        tool: String,
        /// What went wrong.
        detail: String,
    },
    /// The tool answered with an error of its own (`isError`): its text.
    #[error("{0}")]
    Tool(String),
}

/// How long a server may take to start and list its tools.
const START_LIMIT: Duration = Duration::from_secs(30);

impl McpSource {
    /// Starts `argv` as an MCP server on stdio (its stderr goes to the log) and lists its
    /// tools; the error names the tool entry and what failed.
    pub async fn start(name: &str, argv: &[String]) -> Result<Arc<Self>, McpError> {
        let Some((program, args)) = argv.split_first() else {
            return Err(McpError::NoProgram);
        };
        let mut cmd = tokio::process::Command::new(program);
        cmd.args(args).kill_on_drop(true);
        let (transport, _) = rmcp::transport::TokioChildProcess::builder(cmd)
            .stderr(std::process::Stdio::null())
            .spawn()
            .map_err(|source| McpError::Start {
                program: program.clone(),
                source,
            })?;
        let spoke = |what: &'static str| {
            move |e: &dyn std::fmt::Display| McpError::Protocol {
                program: program.clone(),
                what,
                detail: e.to_string(),
            }
        };
        let started = async {
            let service =
                ().serve(transport)
                    .await
                    .map_err(|e| spoke("complete the handshake")(&e))?;
            let listed = service
                .peer()
                .list_all_tools()
                .await
                .map_err(|e| spoke("list its tools")(&e))?;
            Ok::<_, McpError>((service, listed))
        };
        let (service, listed) =
            tokio::time::timeout(START_LIMIT, started)
                .await
                .map_err(|_| McpError::Slow {
                    program: program.clone(),
                    limit: START_LIMIT,
                })??;
        let tools = listed
            .into_iter()
            .map(|t| {
                (
                    t.name.to_string(),
                    t.description.map(|d| d.to_string()).unwrap_or_default(),
                    Value::Object((*t.input_schema).clone()),
                )
            })
            .collect();
        Ok(Arc::new(Self {
            name: name.to_owned(),
            service,
            tools,
        }))
    }

    /// Calls tool `tool` with `arguments`: its text content, or the error (a tool's own
    /// `isError` answer, or a broken server).
    pub async fn call(
        &self,
        tool: &str,
        arguments: Map<String, Value>,
        timeout: Duration,
    ) -> Result<String, McpError> {
        let params = CallToolRequestParams::new(tool.to_owned()).with_arguments(arguments);
        let result = tokio::time::timeout(timeout, self.service.peer().call_tool(params))
            .await
            .map_err(|_| McpError::CallTimedOut {
                tool: self.name.clone(),
                timeout,
            })?
            .map_err(|e| McpError::Broke {
                tool: self.name.clone(),
                detail: e.to_string(),
            })?;
        let content = serde_json::to_value(&result.content).unwrap_or(Value::Null);
        let text: Vec<String> = content
            .as_array()
            .into_iter()
            .flatten()
            .map(|block| match block.get("text").and_then(Value::as_str) {
                Some(text) => text.to_owned(),
                None => block.to_string(),
            })
            .collect();
        let mut text = text.join("\n");
        if text.is_empty()
            && let Some(structured) = &result.structured_content
        {
            text = structured.to_string();
        }
        if result.is_error == Some(true) {
            Err(McpError::Tool(text))
        } else {
            Ok(text)
        }
    }
}
