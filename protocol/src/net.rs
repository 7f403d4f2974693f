//! What a sandbox's network did: one record per connection its egress proxy saw.

use serde::{Deserialize, Serialize};

/// Whether the egress proxy let a connection through.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum NetVerdict {
    /// The policy allowed it and the proxy carried it.
    Allowed,
    /// The proxy refused it; `rule` names why.
    Denied,
}

/// One connection a sandbox asked its egress proxy for, once it is over.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct NetEvent {
    /// The host asked for: a name, or an address when the code asked for one.
    pub host: String,
    /// The port asked for.
    pub port: u16,
    /// Allowed or denied.
    pub verdict: NetVerdict,
    /// The policy entry that decided (`default` when no entry allowed it), or the check that
    /// refused it (`sni`, `host_header`, `max_bytes`, `max_connections`, `inside_address`…).
    pub rule: String,
    /// Why, in words, when it was denied or cut short.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
    /// Bytes the sandbox sent through it.
    #[serde(default)]
    pub bytes_out: u64,
    /// Bytes the sandbox received through it.
    #[serde(default)]
    pub bytes_in: u64,
    /// How long it lasted, from the request to its end.
    #[serde(default)]
    pub ms: u64,
    /// Whether the proxy added a credential the sandbox never holds.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub brokered: bool,
}

/// What a task or session asks of the network.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NetworkRequest {
    /// Entries as `[network] allow` takes them: `host`, `*.domain`, `host:port`, `CIDR[:port]`.
    #[serde(default)]
    pub allow: Vec<String>,
}

impl NetEvent {
    /// The connection on one line, as the transcript and MCP's text show it: what was
    /// reached, or what refused it and the rule to change.
    pub fn line(&self) -> String {
        let host = if self.host.is_empty() {
            // Refused before it asked for anywhere (a bound met on arrival, a request that
            // could not be read).
            "a connection".to_owned()
        } else if self.host.contains(':') {
            format!("[{}]:{}", self.host, self.port)
        } else {
            format!("{}:{}", self.host, self.port)
        };
        match self.verdict {
            NetVerdict::Allowed => format!(
                "net: {host} allowed by {}{}, {} B out, {} B in, {} ms",
                self.rule,
                if self.brokered {
                    ", credential added"
                } else {
                    ""
                },
                self.bytes_out,
                self.bytes_in,
                self.ms
            ),
            NetVerdict::Denied => format!(
                "net: {host} denied (rule {}): {}",
                self.rule,
                self.reason.as_deref().unwrap_or("refused")
            ),
        }
    }
}
