//! Tandem's egress proxy: the one way out of a sandbox with a network policy.
//!
//! A sandbox behind it has no route anywhere else and no resolver (where Tandem manages its
//! network, its only route leads to a catcher that refuses and records what comes out of
//! it, the `catch` module): the proxy reads one request
//! per connection (`CONNECT host:port` for TLS, an absolute `http://` URL otherwise), decides it
//! by the sandbox's [`Policy`], resolves the name itself, checks every address it would connect
//! to (so a name cannot lead inside by DNS rebinding), and carries the bytes, counted against
//! the task's budget. Every connection, allowed or not, becomes one
//! [`NetEvent`](tandem_protocol::net::NetEvent).

pub mod behind;
pub mod broker;
mod catch;
pub mod packages;
pub mod policy;
pub mod proxy;
pub mod rule;
pub mod sni;
mod splice;

use std::net::IpAddr;

pub use behind::Behind;
pub use broker::{Broker, BrokerError, Ca, Secret};
pub use packages::{IndexUrl, Packages};
pub use policy::{Denial, Network, NotGiven, Policy, Switch};
pub use proxy::{Carried, Egress, Extras, Grant, NetSink, PeerGrant, ProxyLimits, SocketGrant};
pub use rule::{Rule, RuleError};

/// Every address of this machine's interfaces: a name never leads a sandbox to one of them.
pub fn own_addresses() -> Vec<IpAddr> {
    let Ok(addrs) = nix::ifaddrs::getifaddrs() else {
        return Vec::new();
    };
    let mut out: Vec<IpAddr> = addrs
        .filter_map(|ifa| {
            let addr = ifa.address?;
            if let Some(v4) = addr.as_sockaddr_in() {
                Some(IpAddr::V4(v4.ip()))
            } else {
                addr.as_sockaddr_in6().map(|v6| IpAddr::V6(v6.ip()))
            }
        })
        .collect();
    out.sort();
    out.dedup();
    out
}
