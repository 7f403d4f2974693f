//! Every way out of a sandbox but the proxy, caught and told. A sandbox behind the proxy has
//! no route of its own; this gives its network one, a TUN device that is its default route
//! for IPv4 and IPv6, whose other end is the daemon. What comes out of it is code that did
//! not go through the proxy (raw TCP, UDP to a resolver, ICMP): each attempt is recorded as
//! a denied connection (rule `proxy_only`) and answered at once, TCP with a reset and the
//! rest with ICMP unreachable, so the code sees "connection refused" instead of waiting.
//! Nothing is ever forwarded: the device's only reader is this module.
//!
//! Every packet is the sandbox's to shape, so each is parsed within its own length and
//! bounds, and what is recorded (and answered) is rate-limited per sandbox.

use std::io;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::time::Instant;

use nix::fcntl::OFlag;
use nix::sys::socket::{AddressFamily, SockFlag, SockType, socket};
use tandem_protocol::net::{NetEvent, NetVerdict};
use tokio::io::unix::AsyncFd;

/// The device's name in each sandbox's network.
pub(crate) const DEVICE: &str = "tandem0";
/// The sandbox's own address on it: RFC 7600's IPv4 dummy address, which names no host.
const V4: Ipv4Addr = Ipv4Addr::new(192, 0, 0, 8);
/// And its IPv6 one, from the unique-local range.
const V6: Ipv6Addr = Ipv6Addr::new(0xfdff, 0, 0, 0, 0, 0, 0, 8);
/// Attempts recorded at once, and recorded per second after; past them a packet is dropped
/// unanswered and unrecorded (counted, and told with the next one recorded).
const BURST: f64 = 64.0;
const PER_SEC: f64 = 16.0;
/// Packets read at once, and per second after, whatever they are; past them the device's
/// queue drops what comes, uncounted.
const READ_BURST: f64 = 1024.0;
const READ_PER_SEC: f64 = 1024.0;

/// Makes the catcher in the network namespace `netns`, on a thread of its own that enters
/// it (and ends there); blocking. `netns` must be a network namespace's own file (a pidfd,
/// which `setns` also takes, is refused), and never this process's or the machine's first
/// one: there its default route would take the machine's traffic.
pub(crate) fn make_in(netns: OwnedFd) -> io::Result<OwnedFd> {
    let refuse = |why: &str| {
        Err(io::Error::new(
            io::ErrorKind::PermissionDenied,
            why.to_owned(),
        ))
    };
    let theirs = nix::sys::stat::fstat(&netns)?;
    let ours = nix::sys::stat::stat("/proc/self/ns/net")?;
    if theirs.st_dev != ours.st_dev || ns_type(&netns) != Some(nix::libc::CLONE_NEWNET) {
        return refuse("the file given is not a network namespace's");
    }
    let first = nix::sys::stat::stat("/proc/1/ns/net").ok();
    if (theirs.st_dev, theirs.st_ino) == (ours.st_dev, ours.st_ino)
        || first.is_some_and(|f| (f.st_dev, f.st_ino) == (theirs.st_dev, theirs.st_ino))
    {
        return refuse(
            "the network namespace given is Tandem's own or the machine's, not a sandbox's",
        );
    }
    std::thread::Builder::new()
        .name("tandem-catch".to_owned())
        .spawn(move || {
            nix::sched::setns(&netns, nix::sched::CloneFlags::CLONE_NEWNET)?;
            make_here()
        })?
        .join()
        .map_err(|_| io::Error::other("the thread making the catcher panicked"))?
}

/// The kind of namespace `fd` is (`NS_GET_NSTYPE`), `None` when it is none.
#[allow(unsafe_code)]
fn ns_type(fd: &OwnedFd) -> Option<nix::libc::c_int> {
    // _IO(0xb7, 0x3) of <linux/nsfs.h>.
    const NS_GET_NSTYPE: nix::libc::c_ulong = 0xb703;
    // SAFETY: the request takes no argument and answers in its return value.
    let kind = unsafe { nix::libc::ioctl(fd.as_raw_fd(), NS_GET_NSTYPE as _) };
    (kind >= 0).then_some(kind)
}

/// The TUN device of the calling thread's network namespace, up, with the sandbox's
/// addresses, as the default route; its file, non-blocking.
#[allow(unsafe_code)]
fn make_here() -> io::Result<OwnedFd> {
    use nix::libc;
    let tun: OwnedFd = nix::fcntl::open(
        "/dev/net/tun",
        OFlag::O_RDWR | OFlag::O_CLOEXEC | OFlag::O_NONBLOCK,
        nix::sys::stat::Mode::empty(),
    )?;
    let mut req = ifreq();
    // IFF_TUN_EXCL: a device of that name already there is never attached to.
    req.ifr_ifru.ifru_flags =
        (libc::IFF_TUN | libc::IFF_NO_PI | libc::IFF_TUN_EXCL) as libc::c_short;
    ioctl(&tun, libc::TUNSETIFF as libc::c_ulong, &mut req)?;

    let v4 = socket(
        AddressFamily::Inet,
        SockType::Datagram,
        SockFlag::SOCK_CLOEXEC,
        None,
    )?;
    let mut req = ifreq();
    req.ifr_ifru.ifru_addr = sockaddr_v4(V4);
    ioctl(&v4, libc::SIOCSIFADDR, &mut req)?;
    let mut req = ifreq();
    req.ifr_ifru.ifru_netmask = sockaddr_v4(Ipv4Addr::BROADCAST);
    ioctl(&v4, libc::SIOCSIFNETMASK, &mut req)?;
    let mut req = ifreq();
    ioctl(&v4, libc::SIOCGIFFLAGS, &mut req)?;
    // SAFETY: SIOCGIFFLAGS filled the flags member, which SIOCSIFFLAGS reads back.
    unsafe {
        req.ifr_ifru.ifru_flags |= (libc::IFF_UP | libc::IFF_RUNNING) as libc::c_short;
    }
    ioctl(&v4, libc::SIOCSIFFLAGS, &mut req)?;
    // 0.0.0.0/0 through the device (an address's own prefix route is never the default).
    let mut name = [0u8; libc::IFNAMSIZ];
    name[..DEVICE.len()].copy_from_slice(DEVICE.as_bytes());
    let mut route = RtEntry {
        rt_pad1: 0,
        rt_dst: sockaddr_v4(Ipv4Addr::UNSPECIFIED),
        rt_gateway: sockaddr_v4(Ipv4Addr::UNSPECIFIED),
        rt_genmask: sockaddr_v4(Ipv4Addr::UNSPECIFIED),
        rt_flags: libc::RTF_UP,
        rt_pad2: 0,
        rt_pad3: 0,
        rt_pad4: std::ptr::null_mut(),
        rt_metric: 0,
        rt_dev: name.as_mut_ptr().cast(),
        rt_mtu: 0,
        rt_window: 0,
        rt_irtt: 0,
    };
    ioctl(&v4, libc::SIOCADDRT, &mut route)?;

    // IPv6 where the namespace has it (an engine may turn it off in its containers): an
    // address whose prefix is everything is the default route too.
    let _ = std::fs::write(format!("/proc/sys/net/ipv6/conf/{DEVICE}/accept_dad"), "0");
    if let Ok(v6) = socket(
        AddressFamily::Inet6,
        SockType::Datagram,
        SockFlag::SOCK_CLOEXEC,
        None,
    ) {
        let mut req = ifreq();
        if ioctl(&v6, libc::SIOCGIFINDEX, &mut req).is_ok() {
            // SAFETY: SIOCGIFINDEX filled the index member.
            let index = unsafe { req.ifr_ifru.ifru_ifindex };
            let mut addr = libc::in6_ifreq {
                ifr6_addr: libc::in6_addr {
                    s6_addr: V6.octets(),
                },
                ifr6_prefixlen: 0,
                ifr6_ifindex: index,
            };
            let _ = ioctl(&v6, libc::SIOCSIFADDR, &mut addr);
        }
    }
    Ok(tun)
}

/// `struct rtentry` of <linux/route.h>, which the libc crate leaves out on glibc.
#[repr(C)]
struct RtEntry {
    rt_pad1: nix::libc::c_ulong,
    rt_dst: nix::libc::sockaddr,
    rt_gateway: nix::libc::sockaddr,
    rt_genmask: nix::libc::sockaddr,
    rt_flags: nix::libc::c_ushort,
    rt_pad2: nix::libc::c_short,
    rt_pad3: nix::libc::c_ulong,
    rt_pad4: *mut nix::libc::c_void,
    rt_metric: nix::libc::c_short,
    rt_dev: *mut nix::libc::c_char,
    rt_mtu: nix::libc::c_ulong,
    rt_window: nix::libc::c_ulong,
    rt_irtt: nix::libc::c_ushort,
}

/// A zeroed `ifreq` naming [`DEVICE`].
#[allow(unsafe_code)]
fn ifreq() -> nix::libc::ifreq {
    // SAFETY: ifreq is plain data (a name and a union of plain data); all zeroes is valid.
    let mut req: nix::libc::ifreq = unsafe { std::mem::zeroed() };
    for (to, from) in req.ifr_name.iter_mut().zip(DEVICE.bytes()) {
        *to = from as nix::libc::c_char;
    }
    req
}

fn sockaddr_v4(addr: Ipv4Addr) -> nix::libc::sockaddr {
    let mut data = [0 as nix::libc::c_char; 14];
    for (to, from) in data[2..6].iter_mut().zip(addr.octets()) {
        *to = from as nix::libc::c_char;
    }
    nix::libc::sockaddr {
        sa_family: nix::libc::AF_INET as nix::libc::sa_family_t,
        sa_data: data,
    }
}

/// One ioctl whose argument is `arg`, a struct the kernel reads (and may fill).
#[allow(unsafe_code)]
fn ioctl<T>(fd: &impl AsRawFd, request: nix::libc::c_ulong, arg: &mut T) -> io::Result<()> {
    // SAFETY: every caller passes the struct the request is defined with, alive for the call.
    let r = unsafe { nix::libc::ioctl(fd.as_raw_fd(), request as _, std::ptr::from_mut(arg)) };
    if r < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(())
    }
}

/// Reads what comes out of `tun` until either of `stops` (the session's end, a later
/// catcher for the same session) or the device goes, passing each attempt to `record` and
/// answering it. The fd keeps the namespace alive: a stop is what ends a watcher.
#[allow(unsafe_code)]
pub(crate) async fn watch(
    tun: OwnedFd,
    record: impl Fn(NetEvent),
    stops: [tokio_util::sync::CancellationToken; 2],
) {
    // SAFETY: the AsyncFd owns the OwnedFd, which stays open (and the same descriptor) until
    // the AsyncFd is dropped.
    let Ok(tun) = (unsafe { AsyncFd::register(tun) }) else {
        return;
    };
    let mut buf = vec![0u8; 65_536];
    let mut recorded = Bucket::new(BURST, PER_SEC);
    // Every packet read costs a token of its own, noise included: what the daemon spends
    // on a sandbox's packets is bounded whatever they are.
    let mut reads = Bucket::new(READ_BURST, READ_PER_SEC);
    loop {
        let ready = tokio::select! {
            () = stops[0].cancelled() => return,
            () = stops[1].cancelled() => return,
            ready = tun.readable() => ready,
        };
        let Ok(mut guard) = ready else { return };
        loop {
            if reads.take().is_none() {
                // Past the bound the device's own queue drops what comes; the select above
                // sees a stop before the next read.
                drop(guard);
                tokio::time::sleep(std::time::Duration::from_secs_f64(1.0 / READ_PER_SEC)).await;
                break;
            }
            let n = match nix::unistd::read(tun.get_ref().as_fd(), &mut buf) {
                Ok(n) => n,
                Err(nix::errno::Errno::EAGAIN) => {
                    guard.clear_ready();
                    break;
                }
                Err(nix::errno::Errno::EINTR) => continue,
                // The device is gone.
                Err(_) => return,
            };
            let Some(seen) = look(&buf[..n]) else {
                continue;
            };
            let Some(untold) = recorded.take() else {
                continue;
            };
            if let Some(answer) = &seen.answer {
                let _ = nix::unistd::write(tun.get_ref(), answer);
            }
            record(seen.event(untold));
        }
    }
}

/// At most `burst` at once, `per_sec` a second after.
struct Bucket {
    tokens: f64,
    burst: f64,
    per_sec: f64,
    at: Instant,
    dropped: u64,
}

impl Bucket {
    fn new(burst: f64, per_sec: f64) -> Bucket {
        Bucket {
            tokens: burst,
            burst,
            per_sec,
            at: Instant::now(),
            dropped: 0,
        }
    }

    /// `Some(n)` when this one may go, `n` being how many were dropped since the last.
    fn take(&mut self) -> Option<u64> {
        self.take_at(Instant::now())
    }

    /// [`Bucket::take`] at `now`.
    fn take_at(&mut self, now: Instant) -> Option<u64> {
        self.tokens = (self.tokens + now.duration_since(self.at).as_secs_f64() * self.per_sec)
            .min(self.burst);
        self.at = now;
        if self.tokens < 1.0 {
            self.dropped += 1;
            return None;
        }
        self.tokens -= 1.0;
        Some(std::mem::take(&mut self.dropped))
    }
}

/// The protocols an attempt is told by.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Proto {
    Tcp,
    Udp,
    Icmp,
    Other(u8),
}

/// One packet that left the sandbox, and what answers it.
#[derive(Debug, PartialEq, Eq)]
struct Seen {
    proto: Proto,
    to: IpAddr,
    port: u16,
    answer: Option<Vec<u8>>,
}

impl Seen {
    fn event(&self, untold: u64) -> NetEvent {
        let to = match self.to {
            IpAddr::V6(a) => format!("[{a}]"),
            IpAddr::V4(a) => a.to_string(),
        };
        let mut reason = match self.proto {
            Proto::Tcp => format!(
                "TCP to {to}:{} that did not go through the egress proxy: a sandbox reaches hosts only with HTTP and HTTPS through the proxy (HTTP_PROXY, HTTPS_PROXY)",
                self.port
            ),
            Proto::Udp => format!(
                "UDP to {to}:{}: a sandbox sends no UDP (the egress proxy resolves names)",
                self.port
            ),
            Proto::Icmp => format!("ICMP to {to}: a sandbox sends no ICMP"),
            Proto::Other(n) => format!(
                "IP protocol {n} to {to}: a sandbox reaches hosts only with HTTP and HTTPS through the egress proxy"
            ),
        };
        if untold > 0 {
            reason.push_str(&format!(
                "; at least {untold} more such attempts just before it were not recorded"
            ));
        }
        NetEvent {
            host: self.to.to_string(),
            port: self.port,
            verdict: NetVerdict::Denied,
            rule: "proxy_only".to_owned(),
            reason: Some(reason),
            bytes_out: 0,
            bytes_in: 0,
            ms: 0,
            brokered: false,
        }
    }
}

const TCP: u8 = 6;
const UDP: u8 = 17;
const ICMP: u8 = 1;
const ICMPV6: u8 = 58;
const IGMP: u8 = 2;
const SYN: u8 = 0x02;
const RST: u8 = 0x04;
const ACK: u8 = 0x10;

/// What `packet` (an IP packet, as the sandbox's kernel sent it) attempted, and the answer
/// that refuses it; `None` for what is no attempt (the kernel's own upkeep, a fragment,
/// anything that does not parse).
fn look(packet: &[u8]) -> Option<Seen> {
    match packet.first()? >> 4 {
        4 => look_v4(packet),
        6 => look_v6(packet),
        _ => None,
    }
}

fn look_v4(p: &[u8]) -> Option<Seen> {
    let ihl = usize::from(p.first()? & 0x0f) * 4;
    let total = usize::from(u16::from_be_bytes([*p.get(2)?, *p.get(3)?]));
    if ihl < 20 || total < ihl || total > p.len() {
        return None;
    }
    let p = &p[..total];
    // A later fragment carries no ports; the first is looked at.
    let frag = u16::from_be_bytes([p[6], p[7]]) & 0x1fff;
    if frag != 0 {
        return None;
    }
    let src: [u8; 4] = p[12..16].try_into().ok()?;
    let dst: [u8; 4] = p[16..20].try_into().ok()?;
    let to = Ipv4Addr::from(dst);
    if to.is_multicast() || to.is_broadcast() || p[9] == IGMP {
        return None;
    }
    let body = &p[ihl..];
    let reply = |proto: u8, payload: Vec<u8>| {
        let mut ip = vec![0x45, 0, 0, 0, 0, 0, 0x40, 0, 64, proto, 0, 0];
        ip.extend_from_slice(&dst);
        ip.extend_from_slice(&src);
        let len = u16::try_from(20 + payload.len()).unwrap_or(u16::MAX);
        ip[2..4].copy_from_slice(&len.to_be_bytes());
        let sum = checksum(&[&ip]);
        ip[10..12].copy_from_slice(&sum.to_be_bytes());
        ip.extend_from_slice(&payload);
        ip
    };
    // ICMP destination unreachable with `code`, quoting the header and 8 bytes.
    let unreachable = |code: u8| {
        let quoted = &p[..(ihl + 8).min(p.len())];
        let mut icmp = vec![3, code, 0, 0, 0, 0, 0, 0];
        icmp.extend_from_slice(quoted);
        let sum = checksum(&[&icmp]);
        icmp[2..4].copy_from_slice(&sum.to_be_bytes());
        reply(ICMP, icmp)
    };
    let (proto, port, how) = attempt(p[9], body, ICMP, 8)?;
    let answer = how.map(|how| match how {
        Answer::Reset(rst) => {
            let mut pseudo = Vec::with_capacity(12);
            pseudo.extend_from_slice(&dst);
            pseudo.extend_from_slice(&src);
            pseudo.extend_from_slice(&[0, TCP, 0, 20]);
            reply(TCP, with_sum(rst, &pseudo, 16))
        }
        // Port unreachable; communication administratively prohibited.
        Answer::PortUnreachable => unreachable(3),
        Answer::Prohibited => unreachable(13),
    });
    Some(Seen {
        proto,
        to: IpAddr::V4(to),
        port,
        answer,
    })
}

fn look_v6(p: &[u8]) -> Option<Seen> {
    if p.len() < 40 {
        return None;
    }
    let len = usize::from(u16::from_be_bytes([p[4], p[5]]));
    if 40 + len > p.len() {
        return None;
    }
    let p = &p[..40 + len];
    let src: [u8; 16] = p[8..24].try_into().ok()?;
    let dst: [u8; 16] = p[24..40].try_into().ok()?;
    let to = Ipv6Addr::from(dst);
    if to.is_multicast() || to.is_unspecified() {
        return None;
    }
    let body = &p[40..];
    let pseudo = |next: u8, len: usize| {
        let mut pseudo = Vec::with_capacity(40);
        pseudo.extend_from_slice(&dst);
        pseudo.extend_from_slice(&src);
        pseudo.extend_from_slice(&u32::try_from(len).unwrap_or(0).to_be_bytes());
        pseudo.extend_from_slice(&[0, 0, 0, next]);
        pseudo
    };
    let reply = |next: u8, payload: Vec<u8>| {
        let mut ip = vec![0x60, 0, 0, 0];
        let len = u16::try_from(payload.len()).unwrap_or(u16::MAX);
        ip.extend_from_slice(&len.to_be_bytes());
        ip.extend_from_slice(&[next, 64]);
        ip.extend_from_slice(&dst);
        ip.extend_from_slice(&src);
        ip.extend_from_slice(&payload);
        ip
    };
    let unreachable = |code: u8| {
        let quoted = &p[..48.min(p.len())];
        let mut icmp = vec![1, code, 0, 0, 0, 0, 0, 0];
        icmp.extend_from_slice(quoted);
        let icmp = with_sum(icmp, &pseudo(ICMPV6, 8 + quoted.len()), 2);
        reply(ICMPV6, icmp)
    };
    let (proto, port, how) = attempt(p[6], body, ICMPV6, 128)?;
    let answer = how.map(|how| match how {
        Answer::Reset(rst) => reply(TCP, with_sum(rst, &pseudo(TCP, 20), 16)),
        // Port unreachable; communication with the destination administratively prohibited.
        Answer::PortUnreachable => unreachable(4),
        Answer::Prohibited => unreachable(1),
    });
    Some(Seen {
        proto,
        to: IpAddr::V6(to),
        port,
        answer,
    })
}

/// How an attempt is refused, whichever IP version carried it.
enum Answer {
    /// A TCP reset: this header, its checksum still to be filled in.
    Reset(Vec<u8>),
    /// ICMP port unreachable, for UDP.
    PortUnreachable,
    /// ICMP "prohibited", for an echo request.
    Prohibited,
}

/// What the payload `body` of protocol `next` attempted (`icmp` and `echo` being the IP
/// version's ICMP protocol and echo request type), and how it is refused; `None` for what is
/// no attempt.
fn attempt(next: u8, body: &[u8], icmp: u8, echo: u8) -> Option<(Proto, u16, Option<Answer>)> {
    match next {
        TCP => {
            let (port, rst) = tcp_reset(body)?;
            Some((Proto::Tcp, port, Some(Answer::Reset(rst))))
        }
        UDP if body.len() >= 8 => Some((
            Proto::Udp,
            u16::from_be_bytes([body[2], body[3]]),
            Some(Answer::PortUnreachable),
        )),
        // An echo request; the kernel's own ICMP (errors, neighbour discovery) is no attempt.
        n if n == icmp && body.first() == Some(&echo) => {
            Some((Proto::Icmp, 0, Some(Answer::Prohibited)))
        }
        n if n == icmp || n == UDP => None,
        n => Some((Proto::Other(n), 0, None)),
    }
}

/// The port a connection's first TCP segment was sent to, and the reset that refuses it (a
/// header with its checksum left zero); `None` for any other segment (nothing attempted that
/// the answer to its SYN did not already end) or one that does not parse.
fn tcp_reset(body: &[u8]) -> Option<(u16, Vec<u8>)> {
    if body.len() < 20 {
        return None;
    }
    let port = u16::from_be_bytes([body[2], body[3]]);
    let flags = body[13];
    if flags & SYN == 0 || flags & ACK != 0 {
        return None;
    }
    let seq = u32::from_be_bytes([body[4], body[5], body[6], body[7]]);
    let mut h = vec![0u8; 20];
    h[0..2].copy_from_slice(&body[2..4]);
    h[2..4].copy_from_slice(&body[0..2]);
    h[8..12].copy_from_slice(&seq.wrapping_add(1).to_be_bytes());
    h[12] = 5 << 4;
    h[13] = RST | ACK;
    Some((port, h))
}

/// `header` with its checksum (at `at`) over `pseudo` and itself filled in.
fn with_sum(mut header: Vec<u8>, pseudo: &[u8], at: usize) -> Vec<u8> {
    let sum = checksum(&[pseudo, &header]);
    header[at..at + 2].copy_from_slice(&sum.to_be_bytes());
    header
}

/// The Internet checksum over the concatenation of `parts` (each but the last of even
/// length).
fn checksum(parts: &[&[u8]]) -> u16 {
    let mut sum: u32 = 0;
    for part in parts {
        let mut words = part.chunks_exact(2);
        for w in &mut words {
            sum += u32::from(u16::from_be_bytes([w[0], w[1]]));
        }
        if let [last] = words.remainder() {
            sum += u32::from(*last) << 8;
        }
    }
    while sum >> 16 != 0 {
        sum = (sum & 0xffff) + (sum >> 16);
    }
    !(sum as u16)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn v4_packet(proto: u8, dst: [u8; 4], body: &[u8]) -> Vec<u8> {
        let mut p = vec![0x45, 0, 0, 0, 0, 1, 0x40, 0, 64, proto, 0, 0, 192, 0, 0, 8];
        p.extend_from_slice(&dst);
        let len = (20 + body.len()) as u16;
        p[2..4].copy_from_slice(&len.to_be_bytes());
        let sum = checksum(&[&p]);
        p[10..12].copy_from_slice(&sum.to_be_bytes());
        p.extend_from_slice(body);
        p
    }

    fn syn(dport: u16) -> Vec<u8> {
        let mut t = vec![0u8; 20];
        t[0..2].copy_from_slice(&40000u16.to_be_bytes());
        t[2..4].copy_from_slice(&dport.to_be_bytes());
        t[4..8].copy_from_slice(&0x1234_5678u32.to_be_bytes());
        t[12] = 5 << 4;
        t[13] = SYN;
        t
    }

    #[test]
    fn a_syn_is_an_attempt_answered_with_a_reset_that_checks() {
        let p = v4_packet(TCP, [203, 0, 113, 2], &syn(9000));
        let seen = look(&p).unwrap();
        assert_eq!(
            (seen.proto, seen.to, seen.port),
            (Proto::Tcp, IpAddr::from([203, 0, 113, 2]), 9000)
        );
        let a = seen.answer.unwrap();
        assert_eq!(a.len(), 40);
        // From where it went, to who sent it.
        assert_eq!(
            (&a[12..16], &a[16..20]),
            (&[203, 0, 113, 2][..], &[192, 0, 0, 8][..])
        );
        assert_eq!(checksum(&[&a[..20]]), 0, "IP header checksum");
        let mut pseudo = a[12..20].to_vec();
        pseudo.extend_from_slice(&[0, TCP, 0, 20]);
        assert_eq!(checksum(&[&pseudo, &a[20..]]), 0, "TCP checksum");
        let t = &a[20..];
        assert_eq!(u16::from_be_bytes([t[0], t[1]]), 9000);
        assert_eq!(u16::from_be_bytes([t[2], t[3]]), 40000);
        assert_eq!(u32::from_be_bytes([t[8], t[9], t[10], t[11]]), 0x1234_5679);
        assert_eq!(t[13], RST | ACK);
    }

    #[test]
    fn udp_gets_port_unreachable_quoting_it_and_noise_is_no_attempt() {
        let mut udp = vec![0u8; 12];
        udp[2..4].copy_from_slice(&53u16.to_be_bytes());
        udp[4..6].copy_from_slice(&12u16.to_be_bytes());
        let p = v4_packet(UDP, [10, 0, 2, 3], &udp);
        let seen = look(&p).unwrap();
        assert_eq!((seen.proto, seen.port), (Proto::Udp, 53));
        let a = seen.answer.unwrap();
        assert_eq!((a[9], a[20], a[21]), (ICMP, 3, 3));
        assert_eq!(checksum(&[&a[20..]]), 0, "ICMP checksum");
        assert_eq!(&a[28..48], &p[..20], "the original header, quoted");
        // Multicast, IGMP, a later fragment, a segment that opens nothing, garbage: nothing.
        assert_eq!(look(&v4_packet(UDP, [224, 0, 0, 251], &udp)), None);
        assert_eq!(look(&v4_packet(IGMP, [10, 0, 0, 1], &udp)), None);
        let mut frag = v4_packet(UDP, [10, 0, 2, 3], &udp);
        frag[7] = 1;
        assert_eq!(look(&frag), None);
        let mut ack = syn(80);
        ack[13] = ACK;
        assert_eq!(look(&v4_packet(TCP, [10, 0, 0, 1], &ack)), None);
        for junk in [
            &[][..],
            &[0x45],
            &[0x45, 0, 0xff, 0xff],
            &[0x60; 39],
            &[0x4f; 60],
        ] {
            assert_eq!(look(junk), None, "{junk:?}");
        }
    }

    #[test]
    fn an_ipv6_syn_is_refused_with_a_reset_that_checks() {
        let mut p = vec![0x60, 0, 0, 0, 0, 20, TCP, 64];
        p.extend_from_slice(&V6.octets());
        let dst: Ipv6Addr = "2001:db8::1".parse().unwrap();
        p.extend_from_slice(&dst.octets());
        p.extend_from_slice(&syn(443));
        let seen = look(&p).unwrap();
        assert_eq!((seen.to, seen.port), (IpAddr::V6(dst), 443));
        assert_eq!(seen.event(0).host, "2001:db8::1");
        let a = seen.answer.unwrap();
        let mut pseudo = a[8..40].to_vec();
        pseudo.extend_from_slice(&[0, 0, 0, 20, 0, 0, 0, TCP]);
        assert_eq!(checksum(&[&pseudo, &a[40..]]), 0, "TCP checksum");
    }

    #[test]
    fn the_daemons_own_network_is_never_given_a_catcher() {
        let own: OwnedFd = nix::fcntl::open(
            "/proc/self/ns/net",
            OFlag::O_RDONLY | OFlag::O_CLOEXEC,
            nix::sys::stat::Mode::empty(),
        )
        .unwrap();
        let refused = make_in(own).unwrap_err().to_string();
        assert_eq!(
            refused,
            "the network namespace given is Tandem's own or the machine's, not a sandbox's"
        );
        // A pidfd, which setns takes as well, naming this very process.
        #[allow(unsafe_code)]
        // SAFETY: pidfd_open of this process; a descriptor it answers is owned here.
        let pidfd = unsafe { nix::libc::syscall(nix::libc::SYS_pidfd_open, std::process::id(), 0) };
        if pidfd >= 0 {
            use std::os::fd::FromRawFd;
            #[allow(unsafe_code)]
            // SAFETY: a fresh descriptor the kernel just gave this process.
            let pidfd = unsafe { OwnedFd::from_raw_fd(pidfd as i32) };
            let refused = make_in(pidfd).unwrap_err().to_string();
            assert_eq!(refused, "the file given is not a network namespace's");
        }
        assert!(
            !std::path::Path::new(&format!("/sys/class/net/{DEVICE}")).exists(),
            "a catcher was made in this process's network"
        );
    }

    #[test]
    fn a_flood_is_recorded_at_a_bounded_rate_and_the_rest_counted() {
        let mut b = Bucket::new(BURST, PER_SEC);
        let start = b.at;
        // 1,000 at once: the burst goes, the rest are counted.
        let taken = (0..1000).filter_map(|_| b.take_at(start)).count();
        assert_eq!((taken, b.dropped), (64, 936));
        // Half a second on, eight more go, and the first tells of what was dropped.
        let later = start + std::time::Duration::from_millis(500);
        assert_eq!(b.take_at(later), Some(936));
        let more = (0..100).filter_map(|_| b.take_at(later)).count();
        assert_eq!(more, 7);
    }
}
