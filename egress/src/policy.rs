//! A sandbox's network policy and the decision it gives for one connection.

use std::collections::BTreeMap;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};

use crate::rule::{HostAsked, Rule, RuleError, canonical};

/// What a sandbox may reach, and how much.
#[derive(Clone, Debug, Default)]
pub struct Policy {
    /// Entries that let a connection through.
    pub allow: Vec<Rule>,
    /// Entries that refuse one; a deny wins over any allow.
    pub deny: Vec<Rule>,
    /// Bytes a task may carry, both directions together, over all its connections.
    pub max_bytes: Option<u64>,
    /// Connections a sandbox may hold open at once.
    pub max_connections: Option<u32>,
    /// Connections one block may make, in all (a sandbox's count starts again with each
    /// block).
    pub max_block_connections: Option<u32>,
    /// Names the proxy answers itself instead of asking DNS (tests, and hosts a site pins).
    pub resolve: BTreeMap<String, Vec<IpAddr>>,
}

impl Policy {
    /// A policy from entries as written; the first entry that does not parse is named.
    pub fn parse<A: AsRef<str>, D: AsRef<str>>(
        allow: &[A],
        deny: &[D],
    ) -> Result<Policy, RuleError> {
        Ok(Policy {
            allow: allow
                .iter()
                .map(|e| Rule::parse(e.as_ref()))
                .collect::<Result<_, _>>()?,
            deny: deny
                .iter()
                .map(|e| Rule::parse(e.as_ref()))
                .collect::<Result<_, _>>()?,
            ..Policy::default()
        })
    }

    /// A deny entry that names `host` on `port`, as a refusal: deny wins even over what
    /// needs no allow entry (the package index).
    pub fn denied(&self, host: &HostAsked, port: u16) -> Result<(), Denial> {
        let named = match host {
            HostAsked::Name(name) => self.deny.iter().find(|r| r.names_host(name, port)),
            HostAsked::Addr(addr) => self.deny.iter().find(|r| r.names_addr(*addr, port)),
        };
        match named {
            Some(rule) => Err(Denial::rule(rule, "a deny entry names this host")),
            None => Ok(()),
        }
    }

    /// The decision on a host and port before any name is resolved: a deny by name, or
    /// whether some entry could allow it once the addresses are known.
    pub fn by_name(&self, host: &HostAsked, port: u16) -> Result<(), Denial> {
        if let HostAsked::Name(name) = host
            && let Some(rule) = self.deny.iter().find(|r| r.names_host(name, port))
        {
            return Err(Denial::rule(rule, "a deny entry names this host"));
        }
        let by_name = match host {
            HostAsked::Name(name) => self.allow.iter().any(|r| r.names_host(name, port)),
            HostAsked::Addr(addr) => self.allow.iter().any(|r| r.names_addr(*addr, port)),
        };
        // A name may still be allowed by a CIDR its addresses fall in.
        let by_net = matches!(host, HostAsked::Name(_))
            && self
                .allow
                .iter()
                .any(|r| r.has_port(port) && matches!(r.target, crate::rule::Target::Net(_)));
        if by_name || by_net {
            Ok(())
        } else {
            Err(Denial::default_rule(host, port))
        }
    }

    /// The decision on one address a host resolved to (or was written as): the entry that
    /// allows connecting there, or why not. `own` is every address of the daemon's machine.
    pub fn at_address<'a>(
        &'a self,
        host: &HostAsked,
        addr: IpAddr,
        port: u16,
        own: &[IpAddr],
    ) -> Result<&'a Rule, Denial> {
        let addr = canonical(addr);
        if let Some(rule) = self.deny.iter().find(|r| r.names_addr(addr, port)) {
            return Err(Denial::rule(rule, &format!("a deny entry holds {addr}")));
        }
        let by_net = self.allow.iter().find(|r| r.names_addr(addr, port));
        if let Some(kind) = inside_kind(addr, own)
            && by_net.is_none()
        {
            return Err(Denial {
                rule: "inside_address".to_owned(),
                reason: format!(
                    "{host} is at {addr}, {kind}; only a CIDR in allow that holds {addr} reaches it"
                ),
            });
        }
        if let Some(rule) = by_net {
            return Ok(rule);
        }
        match host {
            HostAsked::Name(name) => self
                .allow
                .iter()
                .find(|r| r.names_host(name, port))
                .ok_or_else(|| Denial::default_rule(host, port)),
            HostAsked::Addr(_) => Err(Denial::default_rule(host, port)),
        }
    }

    /// Every host an entry allows, as the model is told.
    pub fn allowed_hosts(&self) -> Vec<String> {
        self.allow.iter().map(|r| r.text.clone()).collect()
    }
}

/// What an executor's `network` setting gives its tasks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Switch {
    /// Never any network, whatever `[network]` or a task asks.
    Off,
    /// The open network, no proxy (unguarded): a task's policy cannot narrow it.
    Open,
    /// Behind the egress proxy, under the task's policy.
    Policy,
}

/// Why a connection was refused: the entry or check that refused it, and in words.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Denial {
    /// The entry (as written) or check that decided; `default` when nothing allowed it.
    pub rule: String,
    /// Why, and what to change.
    pub reason: String,
}

impl Denial {
    fn rule(rule: &Rule, why: &str) -> Denial {
        Denial {
            rule: rule.text.clone(),
            reason: why.to_owned(),
        }
    }

    fn default_rule(host: &HostAsked, port: u16) -> Denial {
        Denial {
            rule: "default".to_owned(),
            reason: format!("no allow entry names {host} on port {port}; add it to allow"),
        }
    }

    /// A check of the proxy's own (not an entry) refused it.
    pub fn check(rule: &str, reason: impl Into<String>) -> Denial {
        Denial {
            rule: rule.to_owned(),
            reason: reason.into(),
        }
    }
}

/// What kind of inside address `addr` is, if it is one: a sandbox reaches none of these
/// through a name, because a name is not the operator saying so.
pub fn inside_kind(addr: IpAddr, own: &[IpAddr]) -> Option<&'static str> {
    let addr = canonical(addr);
    if own.iter().any(|o| canonical(*o) == addr) {
        return Some("an address of the daemon's machine");
    }
    match addr {
        IpAddr::V4(v4) => inside_v4(v4),
        IpAddr::V6(v6) => inside_v6(v6),
    }
}

fn inside_v4(a: Ipv4Addr) -> Option<&'static str> {
    let [o0, o1, ..] = a.octets();
    if a.is_loopback() {
        Some("a loopback address")
    } else if a.is_link_local() {
        Some("a link-local address (the cloud's metadata service lives there)")
    } else if a.is_private() {
        Some("a private address")
    } else if a.is_unspecified() || o0 == 0 {
        Some("an unspecified address")
    } else if o0 == 100 && (o1 & 0xc0) == 64 {
        Some("a shared (carrier-grade NAT) address")
    } else if a.is_multicast() || a.is_broadcast() || o0 >= 240 {
        Some("a multicast or reserved address")
    } else {
        None
    }
}

fn inside_v6(a: Ipv6Addr) -> Option<&'static str> {
    let first = a.segments()[0];
    if a.is_loopback() {
        Some("a loopback address")
    } else if a.is_unspecified() {
        Some("an unspecified address")
    } else if (first & 0xffc0) == 0xfe80 {
        Some("a link-local address")
    } else if (first & 0xfe00) == 0xfc00 {
        Some("a unique-local (private) address")
    } else if a.is_multicast() {
        Some("a multicast address")
    } else if (first & 0xffc0) == 0xfec0 {
        Some("a site-local address")
    } else if a.to_ipv4().is_some_and(|v4| inside_v4(v4).is_some()) && first == 0 {
        // ::a.b.c.d (IPv4-compatible) reaches the same inside address on some stacks.
        Some("an IPv4-compatible form of an inside address")
    } else if first == 0x64 && a.segments()[1] == 0xff9b {
        Some("a NAT64 address, which may lead to an inside IPv4 address")
    } else {
        None
    }
}

/// Where a decided connection goes: the address checked is the address connected to.
#[derive(Clone, Debug)]
pub struct Route {
    /// The address the proxy connects to.
    pub to: SocketAddr,
    /// The entry that allowed it.
    pub rule: String,
}

/// Whether `outer` names every host and port `inner` names.
pub fn covers(outer: &Rule, inner: &Rule) -> bool {
    use crate::rule::{DEFAULT_PORTS, Target};
    let ports = match (outer.port, inner.port) {
        (None, None) => true,
        (None, Some(p)) => DEFAULT_PORTS.contains(&p),
        (Some(a), Some(b)) => a == b,
        (Some(_), None) => false,
    };
    let under = |name: &str, domain: &str| {
        name.strip_suffix(domain)
            .is_some_and(|head| head.len() > 1 && head.ends_with('.'))
    };
    ports
        && match (&outer.target, &inner.target) {
            (Target::Host(a), Target::Host(b)) => a == b,
            (Target::Subdomains(d), Target::Host(h)) => under(h, d),
            (Target::Subdomains(d), Target::Subdomains(e)) => e == d || under(e, d),
            (Target::Net(n), Target::Net(m)) => n.contains(m),
            _ => false,
        }
}

/// Why a task does not get the network it asked for.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum NotGiven {
    /// An entry does not parse.
    #[error(transparent)]
    Entry(RuleError),
    /// The operator does not allow it; the message names the host and the setting.
    #[error("{0}")]
    Outside(String),
}

/// How a task's own `network` request meets the operator's settings.
#[derive(Clone, Debug, Default)]
pub struct Network {
    /// `[network]`: the policy of a task that asks for none, and the deny list, budgets and
    /// pinned names of every task.
    pub base: Option<Policy>,
    /// `[policy] network_allow`: what a client may ask for; `None` means only what `base`
    /// already allows.
    pub bound: Option<Vec<Rule>>,
    /// The operator's own road (`tandem run` in its process): a request needs no bound.
    pub own: bool,
}

impl Network {
    /// The policy for a task that asks for `asked` (`None`: it asks for nothing), or why a
    /// client may not have it; `Ok(None)` is no network at all.
    pub fn for_task(&self, asked: Option<&[String]>) -> Result<Option<Policy>, NotGiven> {
        let Some(asked) = asked else {
            return Ok(self.base.clone());
        };
        let asked: Vec<Rule> = asked
            .iter()
            .map(|e| Rule::parse(e))
            .collect::<Result<_, _>>()
            .map_err(NotGiven::Entry)?;
        if !self.own {
            let bound: &[Rule] = match (&self.bound, &self.base) {
                (Some(bound), _) => bound,
                (None, Some(base)) => &base.allow,
                (None, None) => {
                    return Err(NotGiven::Outside("this daemon gives sandboxes no network: an operator allows hosts under [network] allow or [policy] network_allow in its config".to_owned()));
                }
            };
            if let Some(out) = asked.iter().find(|a| !bound.iter().any(|b| covers(b, a))) {
                let key = if self.bound.is_some() {
                    "[policy] network_allow"
                } else {
                    "[network] allow"
                };
                let offered: Vec<&str> = bound.iter().map(|r| r.text.as_str()).collect();
                return Err(NotGiven::Outside(format!(
                    "network host {out} is outside what this daemon allows ({}); ask for hosts within it, or an operator adds it to {key}",
                    if offered.is_empty() {
                        "nothing".to_owned()
                    } else {
                        offered.join(", ")
                    }
                )));
            }
        }
        let base = self.base.clone().unwrap_or_default();
        Ok(Some(Policy {
            allow: asked,
            ..base
        }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rule::normalize_host;

    fn policy(allow: &[&str], deny: &[&str]) -> Policy {
        Policy::parse(allow, deny).unwrap()
    }

    fn host(h: &str) -> HostAsked {
        normalize_host(h).unwrap()
    }

    #[test]
    fn deny_wins_and_nothing_allowed_is_default() {
        let p = policy(&["*.example.com"], &["evil.example.com"]);
        assert_eq!(
            p.by_name(&host("evil.example.com"), 443).unwrap_err().rule,
            "evil.example.com"
        );
        assert!(p.by_name(&host("ok.example.com"), 443).is_ok());
        assert_eq!(
            p.by_name(&host("other.org"), 443).unwrap_err().rule,
            "default"
        );
        assert_eq!(
            p.by_name(&host("ok.example.com"), 22).unwrap_err().rule,
            "default"
        );
    }

    #[test]
    fn a_name_never_reaches_an_inside_address_unless_a_cidr_names_it() {
        let p = policy(&["files.test"], &[]);
        let own: Vec<IpAddr> = vec!["192.0.2.2".parse().unwrap()];
        for inside in [
            "127.0.0.1",
            "169.254.169.254",
            "10.1.2.3",
            "172.16.0.1",
            "192.168.1.1",
            "100.64.0.1",
            "0.0.0.0",
            "::1",
            "fe80::1",
            "fd00::5",
            "::ffff:10.0.0.1",
            "192.0.2.2",
        ] {
            let d = p
                .at_address(&host("files.test"), inside.parse().unwrap(), 443, &own)
                .unwrap_err();
            assert_eq!(d.rule, "inside_address", "{inside}");
        }
        assert!(
            p.at_address(
                &host("files.test"),
                "203.0.113.5".parse().unwrap(),
                443,
                &own
            )
            .is_ok()
        );
        let p = policy(&["files.test", "10.9.0.0/16:8000"], &[]);
        assert_eq!(
            p.at_address(&host("files.test"), "10.9.1.1".parse().unwrap(), 8000, &own)
                .unwrap()
                .text,
            "10.9.0.0/16:8000"
        );
        // The literal of an allowed name's address is not the name.
        let p = policy(&["files.test"], &[]);
        assert_eq!(
            p.by_name(&host("203.0.113.5"), 443).unwrap_err().rule,
            "default"
        );
    }
}

#[cfg(test)]
mod network_tests {
    use super::*;

    fn rules(entries: &[&str]) -> Vec<Rule> {
        entries.iter().map(|e| Rule::parse(e).unwrap()).collect()
    }

    fn asked(entries: &[&str]) -> Vec<String> {
        entries.iter().map(|e| (*e).to_owned()).collect()
    }

    #[test]
    fn a_client_only_narrows_what_the_operator_allows() {
        let net = Network {
            base: Some(
                Policy::parse(&["*.example.com", "pypi.test"], &["bad.example.com"]).unwrap(),
            ),
            bound: None,
            own: false,
        };
        let got = net
            .for_task(Some(&asked(&["api.example.com:443"])))
            .unwrap()
            .unwrap();
        assert_eq!(got.allowed_hosts(), ["api.example.com:443"]);
        assert_eq!(got.deny.len(), 1, "the operator's deny list stays");
        let why = net
            .for_task(Some(&asked(&["evil.test"])))
            .unwrap_err()
            .to_string();
        assert!(
            why.contains("network host evil.test is outside") && why.contains("[network] allow"),
            "{why}"
        );
        assert!(net.for_task(Some(&asked(&["pypi.test:8080"]))).is_err());
        assert_eq!(net.for_task(None).unwrap().unwrap().allow.len(), 2);
        let bounded = Network {
            bound: Some(rules(&["10.0.0.0/8"])),
            ..net.clone()
        };
        assert!(
            bounded
                .for_task(Some(&asked(&["10.1.0.0/16:8080"])))
                .is_err()
        );
        assert!(bounded.for_task(Some(&asked(&["10.1.0.0/16"]))).is_ok());
        let why = bounded
            .for_task(Some(&asked(&["api.example.com"])))
            .unwrap_err()
            .to_string();
        assert!(why.contains("[policy] network_allow"), "{why}");
        let none = Network::default();
        assert!(none.for_task(None).unwrap().is_none());
        assert!(
            none.for_task(Some(&asked(&["a.test"])))
                .unwrap_err()
                .to_string()
                .contains("no network")
        );
        let own = Network {
            own: true,
            ..Network::default()
        };
        assert_eq!(
            own.for_task(Some(&asked(&["a.test"])))
                .unwrap()
                .unwrap()
                .allowed_hosts(),
            ["a.test"]
        );
        assert!(matches!(
            own.for_task(Some(&asked(&["*."]))),
            Err(NotGiven::Entry(_))
        ));
    }
}
