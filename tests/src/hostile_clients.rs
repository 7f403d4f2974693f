//! The hostile-client kit: one set of inputs a hostile API client sends, and every road a
//! client's structure reaches the daemon by, so that each input is tried on each road. The
//! suite that runs it (`cli/tests/hostile_clients.rs`) asserts the daemon's liveness and
//! another client's service after each. A new endpoint joins by adding a [`Road`].
//!
//! Inputs are JSON text, not values: some (100,000 levels deep) cannot be held as a
//! `serde_json::Value` without the recursion they are there to provoke.

use serde_json::{Value, json};

/// A hostile value, as JSON text.
#[derive(Clone, Debug)]
pub struct Hostile {
    /// What it is, for a failure's message.
    pub name: &'static str,
    /// The JSON text.
    pub json: String,
}

/// `n` definitions, each a `$ref` to the next: JSON depth 4 however long the chain, so the
/// parser's nesting limit never sees it.
pub fn ref_chain(n: usize) -> Value {
    let mut defs = serde_json::Map::new();
    for i in 0..n {
        defs.insert(
            format!("d{i}"),
            json!({"$ref": format!("#/$defs/d{}", i + 1)}),
        );
    }
    defs.insert(format!("d{n}"), json!({"type": "integer"}));
    json!({
        "type": "object",
        "properties": {"a": {"$ref": "#/$defs/d0"}},
        "required": ["a"],
        "$defs": defs,
    })
}

/// Two definitions naming each other.
pub fn ref_cycle() -> Value {
    json!({
        "type": "object",
        "properties": {"a": {"$ref": "#/$defs/x"}},
        "$defs": {"x": {"$ref": "#/$defs/y"}, "y": {"$ref": "#/$defs/x"}},
    })
}

/// `levels` of `anyOf` of two arrays, each holding the next level by `$ref` (so the schema
/// grows by a line a level, 5.7 KB at 30): every bracket a forced call opens doubles what a
/// grammar keeps alive.
pub fn alternatives_bomb(levels: usize) -> Value {
    let mut defs = serde_json::Map::new();
    for i in 0..levels {
        let next = json!({"$ref": format!("#/$defs/l{}", i + 1)});
        defs.insert(
            format!("l{i}"),
            json!({"anyOf": [
                {"type": "array", "items": next, "minItems": 1},
                {"type": "array", "items": next, "minItems": 1},
            ]}),
        );
    }
    defs.insert(format!("l{levels}"), json!({"type": "integer"}));
    json!({
        "type": "object",
        "properties": {"a": {"$ref": "#/$defs/l0"}},
        "required": ["a"],
        "$defs": defs,
    })
}

/// Every hostile input of the kit.
pub fn inputs() -> Vec<Hostile> {
    let deep = 100_000;
    vec![
        Hostile {
            name: "arrays 100,000 deep",
            json: format!("{}{}", "[".repeat(deep), "]".repeat(deep)),
        },
        Hostile {
            name: "objects 100,000 deep",
            json: format!("{}1{}", "{\"a\":".repeat(deep), "}".repeat(deep)),
        },
        Hostile {
            name: "a 24,000-link $ref chain",
            json: ref_chain(24_000).to_string(),
        },
        Hostile {
            name: "a $ref cycle",
            json: ref_cycle().to_string(),
        },
        Hostile {
            name: "30 levels of anyOf",
            json: alternatives_bomb(30).to_string(),
        },
        Hostile {
            name: "a 200,000-character name",
            json: Value::String("n".repeat(200_000)).to_string(),
        },
        Hostile {
            name: "a 3 MiB string",
            json: Value::String("s".repeat(3 << 20)).to_string(),
        },
        Hostile {
            name: "a number past u64",
            json: "184467440737095516160000".to_owned(),
        },
        Hostile {
            name: "the largest u64",
            json: u64::MAX.to_string(),
        },
        Hostile {
            name: "a negative number",
            json: "-1".to_owned(),
        },
        Hostile {
            name: "1e999",
            json: "1e999".to_owned(),
        },
        Hostile {
            name: "a lone surrogate",
            json: "\"\\ud800\"".to_owned(),
        },
        Hostile {
            name: "control characters",
            json: Value::String("\u{1b}]52;c;aGk=\u{7}\n\r\u{0}".to_owned()).to_string(),
        },
        Hostile {
            name: "null",
            json: "null".to_owned(),
        },
        Hostile {
            name: "an object of 50,000 keys",
            json: Value::Object((0..50_000).map(|i| (format!("k{i}"), json!(i))).collect())
                .to_string(),
        },
    ]
}

/// How a road is reached.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Via {
    /// An HTTP request on the daemon's API.
    Http(&'static str, &'static str),
    /// A `tools/call` over the daemon's MCP endpoint.
    Mcp(&'static str),
}

/// A road a client's structure takes into the daemon, with the hostile value in one place.
#[derive(Clone, Copy, Debug)]
pub struct Road {
    /// What it is, for a failure's message.
    pub name: &'static str,
    /// Where it goes.
    pub via: Via,
    /// The body (or the tool call's arguments), with `{}` where the hostile value goes.
    pub template: &'static str,
}

impl Road {
    /// The body with `hostile` in its place.
    pub fn body(&self, hostile: &Hostile) -> String {
        self.template.replacen("{}", &hostile.json, 1)
    }
}

/// The task text every road's task asks; a scripted model answers it with the word alone.
pub const TASK: &str = "hostile client kit";

/// Every road of the daemon's API and MCP a client structure reaches. Chat completions need
/// a daemon that serves its model: [`CHAT_ROADS`].
pub const ROADS: &[Road] = &[
    Road {
        name: "a task's text",
        via: Via::Http("POST", "/v1/tasks"),
        template: r#"{"task": {}}"#,
    },
    Road {
        name: "a task's output_schema",
        via: Via::Http("POST", "/v1/tasks"),
        template: r#"{"task": "hostile client kit", "output_schema": {}}"#,
    },
    Road {
        name: "a task's command tool's parameters",
        via: Via::Http("POST", "/v1/tasks"),
        template: r#"{"task": "hostile client kit", "tools": [{"name": "t", "command": ["true"], "parameters": {}}]}"#,
    },
    Road {
        name: "a task's command tool's name",
        via: Via::Http("POST", "/v1/tasks"),
        template: r#"{"task": "hostile client kit", "tools": [{"name": {}, "command": ["true"]}]}"#,
    },
    Road {
        name: "a task's max_turns",
        via: Via::Http("POST", "/v1/tasks"),
        template: r#"{"task": "hostile client kit", "max_turns": {}}"#,
    },
    Road {
        name: "a task's limits",
        via: Via::Http("POST", "/v1/tasks"),
        template: r#"{"task": "hostile client kit", "limits": {}}"#,
    },
    Road {
        name: "a task's team",
        via: Via::Http("POST", "/v1/tasks"),
        template: r#"{"task": "hostile client kit", "team": {}}"#,
    },
    Road {
        name: "a task's traceparent",
        via: Via::Http("POST", "/v1/tasks"),
        template: r#"{"task": "hostile client kit", "traceparent": {}}"#,
    },
    Road {
        name: "a team file to parse",
        via: Via::Http("POST", "/v1/teams/parse"),
        template: r#"{"team": {}}"#,
    },
    Road {
        name: "a session's executor",
        via: Via::Http("POST", "/v1/sessions"),
        template: r#"{"executor": {}}"#,
    },
    Road {
        name: "a session's limits",
        via: Via::Http("POST", "/v1/sessions"),
        template: r#"{"limits": {}}"#,
    },
    Road {
        name: "a session's tools",
        via: Via::Http("POST", "/v1/sessions"),
        template: r#"{"tools": [{"name": {}}]}"#,
    },
    Road {
        name: "a session's volumes",
        via: Via::Http("POST", "/v1/sessions"),
        template: r#"{"volumes": {}}"#,
    },
    Road {
        name: "a session's from_snapshot",
        via: Via::Http("POST", "/v1/sessions"),
        template: r#"{"from_snapshot": {}}"#,
    },
    Road {
        name: "a task's volumes",
        via: Via::Http("POST", "/v1/tasks"),
        template: r#"{"task": "hostile client kit", "volumes": [{"name": "v", "path": {}}]}"#,
    },
    Road {
        name: "a volume's name",
        via: Via::Http("POST", "/v1/volumes"),
        template: r#"{"name": {}}"#,
    },
    Road {
        name: "a volume's quota",
        via: Via::Http("POST", "/v1/volumes"),
        template: r#"{"name": "kit", "max_mb": {}}"#,
    },
    Road {
        name: "a fork's count",
        via: Via::Http("POST", "/v1/snapshots/snap_nothere/fork"),
        template: r#"{"count": {}}"#,
    },
    Road {
        name: "MCP execute_code's volumes",
        via: Via::Mcp("execute_code"),
        template: r#"{"language": "python", "code": "print(1)", "volumes": {}}"#,
    },
    Road {
        name: "a block's code on /v1/exec",
        via: Via::Http("POST", "/v1/exec"),
        template: r#"{"language": "python", "code": {}}"#,
    },
    Road {
        name: "a block's timeout on /v1/exec",
        via: Via::Http("POST", "/v1/exec"),
        template: r#"{"language": "python", "code": "print(1)", "timeout_secs": {}}"#,
    },
    Road {
        name: "MCP run_task's output_schema",
        via: Via::Mcp("run_task"),
        template: r#"{"task": "hostile client kit", "output_schema": {}}"#,
    },
    Road {
        name: "MCP run_task's tools",
        via: Via::Mcp("run_task"),
        template: r#"{"task": "hostile client kit", "tools": [{"name": "t", "command": ["true"], "parameters": {}}]}"#,
    },
    Road {
        name: "MCP execute_code's code",
        via: Via::Mcp("execute_code"),
        template: r#"{"language": "python", "code": {}}"#,
    },
];

/// The roads of `/v1/chat/completions`, for a daemon that serves its embedded model.
pub const CHAT_ROADS: &[Road] = &[
    Road {
        name: "a forced call's tool parameters",
        via: Via::Http("POST", "/v1/chat/completions"),
        template: r#"{"messages": [{"role": "user", "content": "Call the tool."}], "max_tokens": 24, "tool_choice": "required", "tools": [{"type": "function", "function": {"name": "t", "parameters": {}}}]}"#,
    },
    Road {
        name: "an offered tool's parameters",
        via: Via::Http("POST", "/v1/chat/completions"),
        template: r#"{"messages": [{"role": "user", "content": "Hi."}], "max_tokens": 8, "tools": [{"type": "function", "function": {"name": "t", "parameters": {}}}]}"#,
    },
    Road {
        name: "a message's content",
        via: Via::Http("POST", "/v1/chat/completions"),
        template: r#"{"messages": [{"role": "user", "content": {}}], "max_tokens": 8}"#,
    },
    Road {
        name: "max_tokens",
        via: Via::Http("POST", "/v1/chat/completions"),
        template: r#"{"messages": [{"role": "user", "content": "Hi."}], "max_tokens": {}}"#,
    },
];
