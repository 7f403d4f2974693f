//! Tools as data: functions offered to the model, the calls it makes and their answers
//! (docs/tools.md).

use serde::{Deserialize, Serialize};

/// How an assistant's code reaches the executor.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum CodeVia {
    /// Fenced code blocks in the reply's prose.
    #[default]
    Blocks,
    /// Native tool calls of the `execute_code` tool; a server that cannot take tools fails.
    Tool,
    /// The `execute_code` tool when the server takes tools, fenced blocks otherwise.
    Auto,
}

impl CodeVia {
    /// The snake_case name used on the wire and in flags.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Blocks => "blocks",
            Self::Tool => "tool",
            Self::Auto => "auto",
        }
    }
}

impl std::str::FromStr for CodeVia {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "blocks" => Ok(Self::Blocks),
            "tool" => Ok(Self::Tool),
            "auto" => Ok(Self::Auto),
            other => Err(format!(
                "code_via must be blocks, tool or auto, got `{other}`"
            )),
        }
    }
}

/// The name of the built-in tool that runs code in the task's session.
pub const EXECUTE_CODE: &str = "execute_code";

/// One tool: what the model is told of it and what runs it. Exactly one of `command`, `url`
/// and `mcp` says what runs it.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ToolDef {
    /// What it does, for the model.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub description: Option<String>,
    /// A JSON Schema of its arguments (an object); none takes any object.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub parameters: Option<serde_json::Value>,
    /// A program and its arguments, run inside the task's sandbox session (never through a
    /// shell) with the call's arguments as JSON on stdin; its stdout is the result.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub command: Option<Vec<String>>,
    /// An HTTP endpoint the arguments are POSTed to as JSON; its body is the result. Only
    /// the operator can configure one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub url: Option<String>,
    /// An MCP server, started over stdio on the daemon's host, whose tools are offered as
    /// `NAME__TOOL`. Only the operator can configure one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mcp: Option<Vec<String>>,
    /// Longest a call may take, in seconds (a command's block timeout otherwise).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub timeout_secs: Option<u64>,
}

/// A tool a task or a team's agent asks for: an operator's tool by name, or one it defines
/// itself (a `command` run in its own sandbox).
#[derive(Clone, Debug, PartialEq, Serialize)]
#[serde(untagged)]
pub enum ToolRef {
    /// One of the operator's `[tools.NAME]`.
    Name(String),
    /// A tool defined here.
    Def(NamedTool),
}

impl<'de> Deserialize<'de> for ToolRef {
    /// A name, or a definition whose mistakes are named (an untagged enum would only say that
    /// nothing matched).
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        use serde::de::Error;
        match serde_json::Value::deserialize(d)? {
            serde_json::Value::String(name) => Ok(Self::Name(name)),
            def @ serde_json::Value::Object(_) => serde_json::from_value(def)
                .map(Self::Def)
                .map_err(D::Error::custom),
            other => Err(D::Error::custom(format!(
                "a tool is an operator's tool's name or {{\"name\", \"command\", ...}}, not {other}"
            ))),
        }
    }
}

/// A tool defined in a task or a team file. Its fields are its own, not a flattened
/// [`ToolDef`]: a task may not name `mcp`, and an unknown field must be refused by name.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NamedTool {
    /// Its name, as the model calls it (letters, digits, `_` and `-`).
    pub name: String,
    /// What it does, for the model.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub description: Option<String>,
    /// A JSON Schema of its arguments.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub parameters: Option<serde_json::Value>,
    /// A program and its arguments, run inside the task's sandbox session.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub command: Option<Vec<String>>,
    /// An HTTP endpoint: refused in a task or a team file, where only an operator's may be.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub url: Option<String>,
    /// Longest a call may take, in seconds.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub timeout_secs: Option<u64>,
}

impl NamedTool {
    /// Its definition, without the name.
    pub fn def(&self) -> ToolDef {
        ToolDef {
            description: self.description.clone(),
            parameters: self.parameters.clone(),
            command: self.command.clone(),
            url: self.url.clone(),
            mcp: None,
            timeout_secs: self.timeout_secs,
        }
    }
}

/// Whether `name` can name a tool: 1 to 64 letters, digits, `_` or `-`, as the chat APIs
/// require.
pub fn valid_tool_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 64
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
}

/// A call the model made.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ToolCall {
    /// The call's id, which its answer names.
    pub id: String,
    /// The tool called.
    pub name: String,
    /// Its arguments, as the model wrote them (JSON text, not always valid).
    pub arguments: String,
}

/// The answer to one [`ToolCall`].
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ToolReply {
    /// The call's id.
    pub id: String,
    /// The tool called.
    pub name: String,
    /// What the model reads.
    pub content: String,
}

/// The OpenAI wire shape of an assistant message's `tool_calls`.
pub(crate) mod wire_calls {
    use super::ToolCall;
    use serde::{Deserialize, Deserializer, Serialize, Serializer};

    #[derive(Serialize, Deserialize)]
    struct Wire {
        id: String,
        #[serde(rename = "type", default = "function")]
        kind: String,
        function: Function,
    }

    #[derive(Serialize, Deserialize)]
    struct Function {
        name: String,
        arguments: String,
    }

    fn function() -> String {
        "function".to_owned()
    }

    pub fn serialize<S: Serializer>(calls: &[ToolCall], s: S) -> Result<S::Ok, S::Error> {
        calls
            .iter()
            .map(|c| Wire {
                id: c.id.clone(),
                kind: function(),
                function: Function {
                    name: c.name.clone(),
                    arguments: c.arguments.clone(),
                },
            })
            .collect::<Vec<_>>()
            .serialize(s)
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<ToolCall>, D::Error> {
        Ok(Vec::<Wire>::deserialize(d)?
            .into_iter()
            .map(|w| ToolCall {
                id: w.id,
                name: w.function.name,
                arguments: w.function.arguments,
            })
            .collect())
    }
}
