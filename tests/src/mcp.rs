//! [`McpHttp`]: a raw MCP client over the daemon's streamable HTTP endpoint, for tests that
//! must see exactly what goes over the wire (the Python SDK hides errors and retries).
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::sync::atomic::{AtomicU64, Ordering};

use serde_json::{Value, json};

use crate::DaemonHarness;

/// A raw MCP client over the daemon's streamable HTTP endpoint (its Unix socket).
pub struct McpHttp<'a> {
    d: &'a DaemonHarness,
    /// The session id the daemon gave.
    pub session: String,
    next: AtomicU64,
}

impl<'a> McpHttp<'a> {
    /// Initializes a session; `Err` carries what the daemon answered instead.
    pub async fn connect(d: &'a DaemonHarness) -> Result<Self, String> {
        let resp = d
            .http()
            .post("http://tandem/mcp")
            .header("accept", "application/json, text/event-stream")
            .header("content-type", "application/json")
            .body(
                json!({"jsonrpc": "2.0", "id": 0, "method": "initialize", "params": {
                    "protocolVersion": "2025-06-18", "capabilities": {},
                    "clientInfo": {"name": "limits-test", "version": "1"}}})
                .to_string(),
            )
            .send()
            .await
            .map_err(|e| e.to_string())?;
        let session = resp
            .headers()
            .get("mcp-session-id")
            .and_then(|v| v.to_str().ok())
            .map(str::to_owned);
        let status = resp.status();
        let text = resp.text().await.unwrap_or_default();
        let Some(session) = session.filter(|_| status.is_success()) else {
            return Err(format!("{status}: {text}"));
        };
        let mcp = Self {
            d,
            session,
            next: AtomicU64::new(1),
        };
        mcp.post(json!({"jsonrpc": "2.0", "method": "notifications/initialized"}))
            .await;
        Ok(mcp)
    }

    /// Posts one JSON-RPC message; the answer's body.
    pub async fn post(&self, message: Value) -> String {
        self.d
            .http()
            .post("http://tandem/mcp")
            .header("accept", "application/json, text/event-stream")
            .header("content-type", "application/json")
            .header("mcp-session-id", &self.session)
            .body(message.to_string())
            .send()
            .await
            .unwrap()
            .text()
            .await
            .unwrap()
    }

    /// The response to a request: its `result`, or `{"error": ...}`.
    pub async fn request(&self, method: &str, params: Value) -> Value {
        let id = self.next.fetch_add(1, Ordering::SeqCst);
        let text = self
            .post(json!({"jsonrpc": "2.0", "id": id, "method": method, "params": params}))
            .await;
        text.lines()
            .filter_map(|l| l.strip_prefix("data:"))
            .filter_map(|d| serde_json::from_str::<Value>(d.trim()).ok())
            .find(|m| m["id"] == id)
            .map(|m| match m.get("result") {
                Some(result) => result.clone(),
                None => json!({"error": m["error"]}),
            })
            .unwrap_or_else(|| panic!("no response to {method}: {text}"))
    }

    /// `tools/call` of `name` with `arguments`.
    pub async fn call_tool(&self, name: &str, arguments: Value) -> Value {
        self.request("tools/call", json!({"name": name, "arguments": arguments}))
            .await
    }
}

/// The text blocks of a `tools/call` result, one after another.
pub fn text_of(result: &Value) -> String {
    result["content"]
        .as_array()
        .map(|blocks| {
            blocks
                .iter()
                .filter_map(|b| b["text"].as_str())
                .collect::<Vec<_>>()
                .join("\n")
        })
        .unwrap_or_default()
}
