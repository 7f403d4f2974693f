//! One entry of a network policy: a host, a wildcard of subdomains, or a CIDR, with a port.

use std::fmt;
use std::net::IpAddr;

use ipnet::IpNet;

/// An entry of `allow` or `deny` that does not parse, named with what is wrong.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[error("network entry {entry:?}: {why}")]
pub struct RuleError {
    /// The entry as written.
    pub entry: String,
    /// What is wrong with it and what to write instead.
    pub why: String,
}

/// What an entry names.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Target {
    /// One host name, lower case, with no trailing dot.
    Host(String),
    /// Every subdomain of this name (not the name itself).
    Subdomains(String),
    /// Every address in this network (a bare address is a /32 or /128).
    Net(IpNet),
}

/// One parsed entry: what it names and on which port.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Rule {
    /// The entry as written, which events name.
    pub text: String,
    /// What it names.
    pub target: Target,
    /// The one port it names; `None` means 80 and 443.
    pub port: Option<u16>,
}

/// The ports an entry without one names.
pub const DEFAULT_PORTS: [u16; 2] = [80, 443];

/// The longest host name DNS allows.
const MAX_NAME: usize = 253;

impl Rule {
    /// Parses `host`, `*.host`, `host:port`, `a.b.c.d[/len][:port]` or `[v6[/len]]:port`.
    pub fn parse(entry: &str) -> Result<Rule, RuleError> {
        let fail = |why: &str| RuleError {
            entry: entry.to_owned(),
            why: why.to_owned(),
        };
        let text = entry.trim();
        if text.is_empty() {
            return Err(fail("empty: write a host, *.domain or a CIDR"));
        }
        let (body, port) = split_port(text).map_err(|why| fail(&why))?;
        if body.is_empty() {
            return Err(fail("no host before the port"));
        }
        let target = if let Some(net) = parse_net(body).map_err(|why| fail(&why))? {
            Target::Net(net)
        } else if let Some(rest) = body.strip_prefix("*.") {
            Target::Subdomains(host_name(rest).map_err(|why| fail(&why))?)
        } else if body.contains('*') {
            return Err(fail(
                "a wildcard may only be a whole first label, as in *.example.com",
            ));
        } else {
            Target::Host(host_name(body).map_err(|why| fail(&why))?)
        };
        Ok(Rule {
            text: text.to_owned(),
            target,
            port,
        })
    }

    /// Whether this entry names `port`.
    pub fn has_port(&self, port: u16) -> bool {
        match self.port {
            Some(p) => p == port,
            None => DEFAULT_PORTS.contains(&port),
        }
    }

    /// Whether this entry names the host `name` (a name, never an address) on `port`.
    pub fn names_host(&self, name: &str, port: u16) -> bool {
        self.has_port(port)
            && match &self.target {
                Target::Host(h) => h == name,
                Target::Subdomains(d) => name
                    .strip_suffix(d.as_str())
                    .is_some_and(|head| head.len() > 1 && head.ends_with('.')),
                Target::Net(_) => false,
            }
    }

    /// Whether this entry is a network holding `addr` on `port`.
    pub fn names_addr(&self, addr: IpAddr, port: u16) -> bool {
        self.has_port(port)
            && match &self.target {
                Target::Net(net) => net.contains(&canonical(addr)),
                _ => false,
            }
    }
}

impl fmt::Display for Rule {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.text)
    }
}

/// An IPv4 address written as IPv6 (`::ffff:a.b.c.d`) is the IPv4 address: checks see one form.
pub fn canonical(addr: IpAddr) -> IpAddr {
    match addr {
        IpAddr::V6(v6) => v6
            .to_ipv4_mapped()
            .map(IpAddr::V4)
            .unwrap_or(IpAddr::V6(v6)),
        v4 => v4,
    }
}

/// Splits `body:port` (or `[v6]:port`) from an entry.
fn split_port(text: &str) -> Result<(&str, Option<u16>), String> {
    if let Some(rest) = text.strip_prefix('[') {
        let Some((inside, after)) = rest.split_once(']') else {
            return Err("an opening [ with no closing ]".to_owned());
        };
        return match after {
            "" => Ok((inside, None)),
            _ => match after.strip_prefix(':') {
                Some(p) => Ok((inside, Some(port_of(p)?))),
                None => Err(format!("{after:?} after ]: write [address]:port")),
            },
        };
    }
    // A bare IPv6 address or network has more than one colon and no port.
    if text.matches(':').count() > 1 {
        return Ok((text, None));
    }
    match text.rsplit_once(':') {
        Some((body, p)) => Ok((body, Some(port_of(p)?))),
        None => Ok((text, None)),
    }
}

fn port_of(p: &str) -> Result<u16, String> {
    match p.parse::<u32>() {
        Ok(0) => Err("port 0 names no port".to_owned()),
        Ok(n) => u16::try_from(n).map_err(|_| format!("port {n} is over 65535")),
        Err(_) => Err(format!("{p:?} is not a port number")),
    }
}

/// A network (`a.b.c.d/len`, `v6/len`) or a bare address; `None` when it is a name.
fn parse_net(body: &str) -> Result<Option<IpNet>, String> {
    if let Some((addr, len)) = body.split_once('/') {
        let addr: IpAddr = addr
            .parse()
            .map_err(|_| format!("{addr:?} before / is not an address"))?;
        let len: u8 = len
            .parse()
            .map_err(|_| format!("{len:?} after / is not a prefix length"))?;
        let net = IpNet::new(canonical(addr), canonical_len(addr, len))
            .map_err(|_| format!("/{len} is longer than the address"))?;
        if net.network() != canonical(addr) {
            return Err(format!(
                "the CIDR has host bits set: write {} instead",
                net.trunc()
            ));
        }
        return Ok(Some(net));
    }
    match body.parse::<IpAddr>() {
        Ok(addr) => Ok(Some(IpNet::from(canonical(addr)))),
        Err(_) => Ok(None),
    }
}

/// A prefix written over `::ffff:a.b.c.d` counts the IPv4 part only once the address is canonical.
fn canonical_len(addr: IpAddr, len: u8) -> u8 {
    match (addr, canonical(addr)) {
        (IpAddr::V6(_), IpAddr::V4(_)) => len.saturating_sub(96),
        _ => len,
    }
}

/// Checks and lower-cases a host name.
fn host_name(name: &str) -> Result<String, String> {
    let name = name.strip_suffix('.').unwrap_or(name).to_ascii_lowercase();
    if name.is_empty() {
        return Err("no domain after *.".to_owned());
    }
    if name.len() > MAX_NAME {
        return Err(format!("a host name is at most {MAX_NAME} characters"));
    }
    for label in name.split('.') {
        if label.is_empty() || label.len() > 63 {
            return Err("every label of a host name has 1 to 63 characters".to_owned());
        }
        if label.starts_with('-') || label.ends_with('-') {
            return Err(format!("the label {label:?} starts or ends with -"));
        }
        if let Some(c) = label
            .chars()
            .find(|c| !(c.is_ascii_alphanumeric() || *c == '-' || *c == '_'))
        {
            return Err(format!("{c:?} cannot be in a host name"));
        }
    }
    Ok(name)
}

/// A host as a client asked for it: lower case, no trailing dot, an address in one form.
pub fn normalize_host(host: &str) -> Result<HostAsked, String> {
    let bare = host
        .strip_prefix('[')
        .and_then(|h| h.strip_suffix(']'))
        .unwrap_or(host);
    if let Ok(addr) = bare.parse::<IpAddr>() {
        return Ok(HostAsked::Addr(canonical(addr)));
    }
    host_name(bare).map(HostAsked::Name)
}

/// The host part of a request.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum HostAsked {
    /// A name the proxy resolves.
    Name(String),
    /// An address literal.
    Addr(IpAddr),
}

impl fmt::Display for HostAsked {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            HostAsked::Name(n) => f.write_str(n),
            HostAsked::Addr(a) => write!(f, "{a}"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn why(entry: &str) -> String {
        match Rule::parse(entry) {
            Ok(rule) => panic!("{entry:?} parsed as {rule:?}"),
            Err(e) => e.to_string(),
        }
    }

    #[test]
    fn entries_parse_to_what_they_name() {
        let r = Rule::parse("PyPI.test.").unwrap();
        assert_eq!(r.target, Target::Host("pypi.test".into()));
        assert!(r.names_host("pypi.test", 443) && r.names_host("pypi.test", 80));
        assert!(!r.names_host("pypi.test", 8080));
        let r = Rule::parse("*.example.com").unwrap();
        assert!(r.names_host("a.example.com", 443));
        assert!(r.names_host("a.b.example.com", 80));
        assert!(!r.names_host("example.com", 443));
        assert!(!r.names_host("badexample.com", 443));
        let r = Rule::parse("api.example.com:8443").unwrap();
        assert!(r.names_host("api.example.com", 8443) && !r.names_host("api.example.com", 443));
        let r = Rule::parse("203.0.113.0/24:8080").unwrap();
        assert!(r.names_addr("203.0.113.9".parse().unwrap(), 8080));
        assert!(r.names_addr("::ffff:203.0.113.9".parse().unwrap(), 8080));
        assert!(!r.names_addr("203.0.114.9".parse().unwrap(), 8080));
        assert!(!r.names_host("203.0.113.9", 8080));
        let r = Rule::parse("10.1.2.3").unwrap();
        assert_eq!(r.target, Target::Net("10.1.2.3/32".parse().unwrap()));
        let r = Rule::parse("[2001:db8::1]:443").unwrap();
        assert!(r.names_addr("2001:db8::1".parse().unwrap(), 443));
        let r = Rule::parse("2001:db8::/32").unwrap();
        assert!(r.names_addr("2001:db8:5::1".parse().unwrap(), 80));
    }

    #[test]
    fn bad_entries_are_named_with_what_is_wrong() {
        assert!(why("*.").contains("no domain after *."));
        assert!(why("a.com:70000").contains("over 65535"));
        assert!(why("a.com:0").contains("port 0"));
        assert!(why("10.0.0.1/8").contains("host bits set: write 10.0.0.0/8"));
        assert!(why("").contains("empty"));
        assert!(why(":443").contains("no host"));
        assert!(why("a.*.com").contains("wildcard"));
        assert!(why("a b.com").contains("cannot be in a host name"));
        assert!(why("10.0.0.0/33").contains("longer than the address"));
        assert!(why("[::1").contains("no closing ]"));
        assert!(why(&format!("{}.com", "a".repeat(64))).contains("1 to 63"));
    }
}
