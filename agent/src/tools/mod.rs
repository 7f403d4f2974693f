//! The tools an assistant is offered and what runs each: `execute_code` (the executor
//! itself), a `command` run inside the task's sandbox session, or an operator's HTTP
//! endpoint. Checking a call's arguments is here too.

pub mod calls;
pub mod dispatch;
pub mod mcp;

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use serde_json::{Map, Value, json};
use tandem_executor::Language;
use tandem_protocol::tools::{EXECUTE_CODE, valid_tool_name};
use tandem_protocol::{CodeVia, ToolCall, ToolDef, ToolRef};

use crate::chat::ToolOffer;

/// What runs a tool.
#[derive(Clone, Debug, PartialEq)]
pub enum Runs {
    /// The executor: the call's `code` runs as a block.
    Code,
    /// A program run in the task's session with the arguments on stdin.
    Command(Vec<String>),
    /// An HTTP endpoint the arguments are POSTed to.
    Http(String),
    /// A tool of a running MCP server, by its own name there.
    Mcp(Arc<mcp::McpSource>, String),
}

/// One tool as the model is offered it.
#[derive(Clone, Debug, PartialEq)]
pub struct Tool {
    /// Its name.
    pub name: String,
    /// What it does.
    pub description: String,
    /// A JSON Schema of its arguments.
    pub parameters: Value,
    /// What runs it.
    pub runs: Runs,
    /// Longest a call may take; `None` for a command is the block timeout.
    pub timeout: Option<Duration>,
}

/// The tools of one assistant, and how its code reaches the executor.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct ToolBox {
    tools: Vec<Tool>,
    /// How code is run: blocks, the `execute_code` tool, or either.
    pub code_via: CodeVia,
    /// What the model is offered with each request, made once.
    offer: Option<ToolOffer>,
}

/// Why a tool list cannot be used.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum ToolError {
    /// A name the operator does not offer.
    #[error("tool `{name}` is not offered here; the operator's tools are: {offered}")]
    Unknown {
        /// The name asked for.
        name: String,
        /// The operator's tools, comma-separated (or `none`).
        offered: String,
    },
    /// A definition that is not allowed or not complete.
    #[error("tool `{name}`: {why}")]
    Invalid {
        /// The tool's name.
        name: String,
        /// What is wrong and what to do.
        why: String,
    },
}

/// The operator's tools, as `[tools.NAME]` in `tandem.toml` gives them.
pub type Catalog = BTreeMap<String, ToolDef>;

/// The operator's tools ready to offer: the definitions, and the MCP servers among them,
/// started.
#[derive(Clone, Debug, Default)]
pub struct Offered {
    defs: Catalog,
    servers: BTreeMap<String, Arc<mcp::McpSource>>,
}

impl From<Catalog> for Offered {
    /// Definitions with no MCP server among them (one there offers no tool).
    fn from(defs: Catalog) -> Self {
        Self {
            defs,
            servers: BTreeMap::new(),
        }
    }
}

impl Offered {
    /// Checks every definition and starts each MCP server, listing its tools.
    pub async fn start(defs: Catalog) -> Result<Self, ToolError> {
        let mut servers = BTreeMap::new();
        for (name, def) in &defs {
            match &def.mcp {
                Some(argv) => {
                    let invalid = |why: String| ToolError::Invalid {
                        name: name.clone(),
                        why,
                    };
                    if def.command.is_some() || def.url.is_some() {
                        return Err(invalid("give one of command, url and mcp".to_owned()));
                    }
                    let source = mcp::McpSource::start(name, argv)
                        .await
                        .map_err(|e| invalid(e.to_string()))?;
                    servers.insert(name.clone(), source);
                }
                None => {
                    check_def(name, def, true)?;
                }
            }
        }
        Ok(Self { defs, servers })
    }

    /// The names a task can ask for, comma-separated (or `none`).
    fn names(&self) -> String {
        let mut names: Vec<String> = Vec::new();
        for name in self.defs.keys() {
            match self.servers.get(name) {
                Some(source) => {
                    names.extend(source.tools.iter().map(|t| format!("{name}__{}", t.0)));
                }
                None => names.push(name.clone()),
            }
        }
        if names.is_empty() {
            "none".to_owned()
        } else {
            names.join(", ")
        }
    }

    /// The tools entry `name` gives: one, or an MCP server's every tool (`SERVER__TOOL`
    /// gives one of them).
    fn entry(&self, name: &str) -> Option<Result<Vec<Tool>, ToolError>> {
        let (server, only) = match name.split_once("__") {
            Some((server, tool)) if self.servers.contains_key(server) => (server, Some(tool)),
            _ => (name, None),
        };
        if let Some(source) = self.servers.get(server) {
            let timeout = self
                .defs
                .get(server)
                .and_then(|d| d.timeout_secs)
                .map(Duration::from_secs);
            let tools: Vec<Tool> = source
                .tools
                .iter()
                .filter(|(tool, _, _)| only.is_none_or(|o| o == tool))
                .map(|(tool, description, schema)| Tool {
                    name: format!("{server}__{tool}"),
                    description: description.clone(),
                    parameters: schema.clone(),
                    runs: Runs::Mcp(source.clone(), tool.clone()),
                    timeout,
                })
                .collect();
            return (!tools.is_empty() || only.is_none()).then_some(Ok(tools));
        }
        self.defs
            .get(name)
            .map(|def| check_def(name, def, true).map(|t| vec![t]))
    }
}

/// Checks one definition; `operator` says whether it came from the operator (who alone may
/// give a URL).
pub fn check_def(name: &str, def: &ToolDef, operator: bool) -> Result<Tool, ToolError> {
    let invalid = |why: String| ToolError::Invalid {
        name: name.to_owned(),
        why,
    };
    if !valid_tool_name(name) {
        return Err(invalid(
            "a tool's name is 1 to 64 letters, digits, `_` or `-`".to_owned(),
        ));
    }
    if name == EXECUTE_CODE {
        return Err(invalid(format!(
            "`{EXECUTE_CODE}` is the executor's own tool; set code_via to offer it"
        )));
    }
    if def.mcp.is_some() {
        return Err(invalid(if operator {
            "an MCP server's tools come from the running server (Offered::start)".to_owned()
        } else {
            "an MCP server can be configured only by the operator, as [tools.NAME] mcp = [...] in tandem.toml".to_owned()
        }));
    }
    let runs = match (&def.command, &def.url) {
        (Some(argv), None) => {
            if argv.first().is_none_or(|a| a.is_empty()) {
                return Err(invalid(
                    "command needs a program: command = [\"prog\", \"arg\"]".to_owned(),
                ));
            }
            Runs::Command(argv.clone())
        }
        (None, Some(url)) => {
            if !operator {
                return Err(invalid(
                    "an HTTP tool can be configured only by the operator, as [tools.NAME] in tandem.toml; a task or a team file may define command tools, which run in its sandbox".to_owned(),
                ));
            }
            if !(url.starts_with("http://") || url.starts_with("https://")) {
                return Err(invalid(format!(
                    "url `{url}` must start with http:// or https://"
                )));
            }
            Runs::Http(url.clone())
        }
        (Some(_), Some(_)) => {
            return Err(invalid("give command or url, not both".to_owned()));
        }
        (None, None) => {
            return Err(invalid(
                "say what runs it: command = [\"prog\", ...] (in the sandbox) or url = \"http://...\" (operator only)".to_owned(),
            ));
        }
    };
    let parameters = def
        .parameters
        .clone()
        .unwrap_or_else(|| json!({"type": "object"}));
    if !parameters.is_object() || parameters.get("type").is_some_and(|t| t != "object") {
        return Err(invalid(
            "parameters must be a JSON Schema of an object ({\"type\": \"object\", \"properties\": {...}})".to_owned(),
        ));
    }
    crate::schema::bounded(&parameters).map_err(|e| invalid(format!("parameters {e}")))?;
    Ok(Tool {
        name: name.to_owned(),
        description: def.description.clone().unwrap_or_default(),
        parameters,
        runs,
        timeout: def.timeout_secs.map(Duration::from_secs),
    })
}

/// The tools `refs` asks for, out of the operator's `offered`: a name must be the
/// operator's (an MCP server's name gives all its tools, `SERVER__TOOL` one); a definition may
/// only be a command (it runs in the sandbox). `None` gives every tool the operator offers.
pub fn resolve(refs: Option<&[ToolRef]>, offered: &Offered) -> Result<Vec<Tool>, ToolError> {
    let mut tools: Vec<Tool> = Vec::new();
    let mut add = |found: Vec<Tool>| -> Result<(), ToolError> {
        for tool in found {
            if tools.iter().any(|t| t.name == tool.name) {
                return Err(ToolError::Invalid {
                    name: tool.name,
                    why: "named twice".to_owned(),
                });
            }
            tools.push(tool);
        }
        Ok(())
    };
    match refs {
        None => {
            for name in offered.defs.keys() {
                if let Some(found) = offered.entry(name) {
                    add(found?)?;
                }
            }
        }
        Some(refs) => {
            for r in refs {
                match r {
                    ToolRef::Name(name) => {
                        let found = offered.entry(name).ok_or_else(|| ToolError::Unknown {
                            name: name.clone(),
                            offered: offered.names(),
                        })?;
                        add(found?)?;
                    }
                    ToolRef::Def(named) => {
                        add(vec![check_def(&named.name, &named.def(), false)?])?;
                    }
                }
            }
        }
    }
    Ok(tools)
}

impl ToolBox {
    /// A box of `tools`; with `code_via` other than blocks, `execute_code` in `languages`
    /// first.
    pub fn new(mut tools: Vec<Tool>, code_via: CodeVia, languages: &[Language]) -> Self {
        if code_via != CodeVia::Blocks {
            let names: Vec<&str> = languages
                .iter()
                .filter(|l| !l.is_data())
                .map(Language::as_str)
                .collect();
            tools.insert(
                0,
                Tool {
                    name: EXECUTE_CODE.to_owned(),
                    description: format!(
                        "Run code in the task's sandbox and get its exit code and output. Files persist between calls; {}.",
                        "print what you need to see"
                    ),
                    parameters: json!({
                        "type": "object",
                        "properties": {
                            "language": {"type": "string", "enum": names, "description": "The code's language."},
                            "code": {"type": "string", "description": "The complete program to run."},
                            "filename": {"type": "string", "description": "Save the code under this path in the workspace before running it."},
                        },
                        "required": ["language", "code"],
                        "additionalProperties": false,
                    }),
                    runs: Runs::Code,
                    timeout: None,
                },
            );
        }
        let offer = (!tools.is_empty()).then(|| ToolOffer {
            tools: tools
                .iter()
                .map(|t| {
                    json!({
                        "type": "function",
                        "function": {
                            "name": t.name,
                            "description": t.description,
                            "parameters": t.parameters,
                        }
                    })
                })
                .collect(),
            required: false,
            optional: code_via == CodeVia::Auto,
        });
        Self {
            tools,
            code_via,
            offer,
        }
    }

    /// Whether it holds no tool.
    pub fn is_empty(&self) -> bool {
        self.tools.is_empty()
    }

    /// Its tools, in the order they are offered.
    pub fn tools(&self) -> &[Tool] {
        &self.tools
    }

    /// The tool called `name`.
    pub fn get(&self, name: &str) -> Option<&Tool> {
        self.tools.iter().find(|t| t.name == name)
    }

    /// What the model is offered with each request; `None` when there is nothing.
    pub fn offer(&self) -> Option<&ToolOffer> {
        self.offer.as_ref()
    }

    /// The tool `call` names and its arguments, checked against its parameters; else what
    /// the model is told, naming the problem and quoting the arguments.
    pub fn check(&self, call: &ToolCall) -> Result<(&Tool, Map<String, Value>), CallError> {
        // Small models call the language (`python`) for `execute_code` in it.
        if self.get(&call.name).is_none()
            && let Some(code) = self.get(EXECUTE_CODE)
            && let Some(languages) = code.parameters["properties"]["language"]["enum"].as_array()
            && languages
                .iter()
                .any(|l| *l == Language::new(&call.name).as_str())
            && let Ok(Value::Object(mut args)) = serde_json::from_str::<Value>(&call.arguments)
        {
            args.entry("language")
                .or_insert_with(|| Value::String(Language::new(&call.name).to_string()));
            let as_code = ToolCall {
                name: EXECUTE_CODE.to_owned(),
                arguments: Value::Object(args).to_string(),
                ..call.clone()
            };
            return self.check(&as_code);
        }
        let Some(tool) = self.get(&call.name) else {
            let names: Vec<&str> = self.tools.iter().map(|t| t.name.as_str()).collect();
            return Err(CallError::NoSuchTool {
                name: call.name.clone(),
                tools: if names.is_empty() {
                    "none".to_owned()
                } else {
                    names.join(", ")
                },
            });
        };
        Ok((tool, tool.arguments(&call.arguments)?))
    }
}

/// Why a tool call cannot run as the model sent it; its text is what the model is told,
/// naming the problem and quoting the arguments.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CallError {
    /// No tool has that name.
    #[error("error: there is no tool `{name}`; the tools are: {tools}.")]
    NoSuchTool {
        /// The name called.
        name: String,
        /// The tools there are, listed.
        tools: String,
    },
    /// The arguments are not JSON.
    #[error(
        "error: the arguments of `{tool}` are not valid JSON ({why}); send a JSON object. They were: {quoted}"
    )]
    NotJson {
        /// The tool called.
        tool: String,
        /// The parser's complaint.
        why: String,
        /// The arguments as sent, cut.
        quoted: String,
    },
    /// The arguments are JSON but not an object.
    #[error(
        "error: the arguments of `{tool}` must be a JSON object, not {kind}. They were: {quoted}"
    )]
    NotObject {
        /// The tool called.
        tool: String,
        /// What they are instead.
        kind: &'static str,
        /// The arguments as sent, cut.
        quoted: String,
    },
    /// The arguments do not meet the tool's parameters.
    #[error(
        "error: the arguments of `{tool}` do not match its parameters: {why}. They were: {quoted}"
    )]
    Mismatch {
        /// The tool called.
        tool: String,
        /// The first place they differ.
        why: Mismatch,
        /// The arguments as sent, cut.
        quoted: String,
    },
}

/// Where a value first fails its JSON Schema, by path (`arguments.code` is required).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct Mismatch(pub String);

impl Tool {
    /// `text` as this tool's arguments: a JSON object that meets its parameters; else what
    /// the model is told, naming the problem and quoting the arguments.
    pub fn arguments(&self, text: &str) -> Result<Map<String, Value>, CallError> {
        let quoted = quote(text);
        let tool = self.name.clone();
        let json = if text.trim().is_empty() { "{}" } else { text };
        let value: Value = match serde_json::from_str(json) {
            Ok(value) => value,
            Err(e) => {
                return Err(CallError::NotJson {
                    tool,
                    why: e.to_string(),
                    quoted,
                });
            }
        };
        if !value.is_object() {
            return Err(CallError::NotObject {
                tool,
                kind: kind(&value),
                quoted,
            });
        }
        if let Err(why) = conforms(&value, &self.parameters, "arguments") {
            return Err(CallError::Mismatch { tool, why, quoted });
        }
        // An object, as checked above.
        Ok(match value {
            Value::Object(args) => args,
            _ => Map::new(),
        })
    }
}

/// The arguments as the model is shown them: in backticks, cut to 300 characters.
fn quote(arguments: &str) -> String {
    let flat: String = arguments.chars().take(300).collect();
    if flat.len() < arguments.len() {
        format!("`{flat}…` ({} bytes)", arguments.len())
    } else {
        format!("`{flat}`")
    }
}

fn kind(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(n) if n.is_i64() || n.is_u64() => "an integer",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

/// Whether `value` meets `schema`: the JSON Schema keywords tool definitions use (`type`,
/// `properties`, `required`, `additionalProperties`, `items`, `enum`, `const`, `minimum`,
/// `maximum`, `minLength`, `maxLength`, `minItems`, `maxItems`, `anyOf`, `oneOf`); others
/// are not checked. The error names the path (`arguments.code`).
pub fn conforms(value: &Value, schema: &Value, at: &str) -> Result<(), Mismatch> {
    conforms_at(value, schema, at).map_err(Mismatch)
}

/// [`conforms`], its error the message alone.
fn conforms_at(value: &Value, schema: &Value, at: &str) -> Result<(), String> {
    let Some(schema) = schema.as_object() else {
        return Ok(());
    };
    if let Some(t) = schema.get("type") {
        let types: Vec<&str> = match t {
            Value::String(s) => vec![s.as_str()],
            Value::Array(list) => list.iter().filter_map(Value::as_str).collect(),
            _ => Vec::new(),
        };
        let fits = |t: &str| match t {
            "object" => value.is_object(),
            "array" => value.is_array(),
            "string" => value.is_string(),
            "boolean" => value.is_boolean(),
            "null" => value.is_null(),
            "number" => value.is_number(),
            "integer" => value.as_f64().is_some_and(|f| f.fract() == 0.0),
            _ => true,
        };
        if !types.is_empty() && !types.iter().any(|t| fits(t)) {
            return Err(format!(
                "`{at}` must be {}, not {}",
                types.join(" or "),
                kind(value)
            ));
        }
    }
    if let Some(Value::Array(allowed)) = schema.get("enum")
        && !allowed.contains(value)
    {
        let list: Vec<String> = allowed.iter().map(Value::to_string).collect();
        return Err(format!("`{at}` must be one of {}", list.join(", ")));
    }
    if let Some(c) = schema.get("const")
        && c != value
    {
        return Err(format!("`{at}` must be {c}"));
    }
    if let Some(n) = value.as_f64() {
        if let Some(min) = schema.get("minimum").and_then(Value::as_f64)
            && n < min
        {
            return Err(format!("`{at}` must be at least {min}"));
        }
        if let Some(max) = schema.get("maximum").and_then(Value::as_f64)
            && n > max
        {
            return Err(format!("`{at}` must be at most {max}"));
        }
    }
    if let Some(s) = value.as_str() {
        let len = s.chars().count() as u64;
        if let Some(min) = schema.get("minLength").and_then(Value::as_u64)
            && len < min
        {
            return Err(format!("`{at}` must be at least {min} characters"));
        }
        if let Some(max) = schema.get("maxLength").and_then(Value::as_u64)
            && len > max
        {
            return Err(format!("`{at}` must be at most {max} characters"));
        }
    }
    if let Some(items) = value.as_array() {
        let len = items.len() as u64;
        if let Some(min) = schema.get("minItems").and_then(Value::as_u64)
            && len < min
        {
            return Err(format!("`{at}` must have at least {min} items"));
        }
        if let Some(max) = schema.get("maxItems").and_then(Value::as_u64)
            && len > max
        {
            return Err(format!("`{at}` must have at most {max} items"));
        }
        if let Some(item) = schema.get("items") {
            for (i, v) in items.iter().enumerate() {
                conforms_at(v, item, &format!("{at}[{i}]"))?;
            }
        }
    }
    if let Some(map) = value.as_object() {
        let properties = schema.get("properties").and_then(Value::as_object);
        if let Some(Value::Array(required)) = schema.get("required") {
            for name in required.iter().filter_map(Value::as_str) {
                if !map.contains_key(name) {
                    return Err(format!("`{at}.{name}` is required"));
                }
            }
        }
        for (name, v) in map {
            match properties.and_then(|p| p.get(name)) {
                Some(sub) => conforms_at(v, sub, &format!("{at}.{name}"))?,
                None => match schema.get("additionalProperties") {
                    Some(Value::Bool(false)) => {
                        let known: Vec<&String> =
                            properties.map(|p| p.keys().collect()).unwrap_or_default();
                        return Err(format!(
                            "`{at}.{name}` is not a parameter (they are: {})",
                            known
                                .iter()
                                .map(|k| k.as_str())
                                .collect::<Vec<_>>()
                                .join(", ")
                        ));
                    }
                    Some(sub @ Value::Object(_)) => conforms_at(v, sub, &format!("{at}.{name}"))?,
                    _ => {}
                },
            }
        }
    }
    for (key, all) in [("anyOf", false), ("oneOf", true)] {
        if let Some(Value::Array(options)) = schema.get(key) {
            let fits = options
                .iter()
                .filter(|s| conforms_at(value, s, at).is_ok())
                .count();
            if fits == 0 || (all && fits > 1) {
                return Err(format!("`{at}` matches {fits} of the {key} choices"));
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn boxed() -> ToolBox {
        let wc = ToolDef {
            description: Some("count words".into()),
            parameters: Some(json!({
                "type": "object",
                "properties": {"text": {"type": "string"}, "max": {"type": "integer", "minimum": 1}},
                "required": ["text"],
            })),
            command: Some(vec!["wc".into(), "-w".into()]),
            ..ToolDef::default()
        };
        let tools = vec![check_def("wc", &wc, false).unwrap_or_else(|e| panic!("{e}"))];
        ToolBox::new(tools, CodeVia::Tool, &[Language::python(), Language::sh()])
    }

    fn call(name: &str, arguments: &str) -> ToolCall {
        ToolCall {
            id: "c1".into(),
            name: name.into(),
            arguments: arguments.into(),
        }
    }

    #[test]
    fn every_bad_call_is_an_error_the_model_reads() {
        let b = boxed();
        let err = |name, args| {
            b.check(&call(name, args))
                .err()
                .map(|e| e.to_string())
                .unwrap_or_default()
        };
        assert_eq!(
            err("nope", "{}"),
            "error: there is no tool `nope`; the tools are: execute_code, wc."
        );
        assert!(
            err("wc", "{\"text\": ").starts_with(
                "error: the arguments of `wc` are not valid JSON (EOF while parsing a value at line 1 column 9); send a JSON object. They were: `{\"text\": `"
            ),
            "{}",
            err("wc", "{\"text\": ")
        );
        assert_eq!(
            err("wc", "[1, 2]"),
            "error: the arguments of `wc` must be a JSON object, not an array. They were: `[1, 2]`"
        );
        assert_eq!(
            err("wc", "{\"max\": 0.5, \"text\": \"a\"}"),
            "error: the arguments of `wc` do not match its parameters: `arguments.max` must be integer, not a number. They were: `{\"max\": 0.5, \"text\": \"a\"}`"
        );
        assert_eq!(
            err("wc", "{}"),
            "error: the arguments of `wc` do not match its parameters: `arguments.text` is required. They were: `{}`"
        );
        assert_eq!(
            err("execute_code", r#"{"language": "ruby", "code": "1"}"#),
            "error: the arguments of `execute_code` do not match its parameters: `arguments.language` must be one of \"python\", \"sh\". They were: `{\"language\": \"ruby\", \"code\": \"1\"}`"
        );
        let long = format!("{{\"text\": \"{}\"", "x".repeat(500));
        assert!(err("wc", &long).ends_with(&format!("…` ({} bytes)", long.len())));
        assert!(b.check(&call("wc", r#"{"text": "a b"}"#)).is_ok());
        // A call of the language itself is `execute_code` in it.
        let (tool, args) = b
            .check(&call("py", r#"{"code": "print(1)"}"#))
            .unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(
            (tool.name.as_str(), args["language"].as_str()),
            ("execute_code", Some("python"))
        );
        // No arguments at all is an empty object.
        assert!(
            b.check(&call("wc", ""))
                .err()
                .map(|e| e.to_string())
                .unwrap_or_default()
                .contains("`arguments.text` is required")
        );
    }

    #[test]
    fn a_task_names_only_the_operators_tools_and_defines_only_commands() {
        let mut catalog = Catalog::new();
        catalog.insert(
            "weather".into(),
            ToolDef {
                url: Some("http://127.0.0.1:9/w".into()),
                ..ToolDef::default()
            },
        );
        let named = |n: &str| ToolRef::Name(n.to_owned());
        let catalog = Offered::from(catalog);
        assert!(resolve(Some(&[named("weather")]), &catalog).is_ok());
        assert_eq!(
            resolve(Some(&[named("shell")]), &catalog)
                .err()
                .map(|e| e.to_string()),
            Some("tool `shell` is not offered here; the operator's tools are: weather".to_owned())
        );
        let url = ToolRef::Def(tandem_protocol::tools::NamedTool {
            name: "fetch".into(),
            description: None,
            parameters: None,
            command: None,
            url: Some("http://169.254.169.254/".into()),
            timeout_secs: None,
        });
        assert!(
            resolve(Some(&[url]), &catalog)
                .err()
                .map(|e| e.to_string())
                .unwrap_or_default()
                .starts_with("tool `fetch`: an HTTP tool can be configured only by the operator")
        );
        assert_eq!(resolve(None, &catalog).map(|t| t.len()), Ok(1));
    }
}
