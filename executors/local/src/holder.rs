//! A session's network of its own: the holder process the fork server starts for it
//! (`forkserver.py`'s `holder`), which keeps the namespace its blocks join, carries the egress
//! relay when the session is behind the proxy, and is the way in to the servers its blocks
//! leave listening. Closing the holder's control socket ends it, and with it those servers.

use std::io::{self, IoSliceMut};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use nix::sys::socket::{
    AddressFamily, ControlMessageOwned, MsgFlags, SockFlag, SockType, recv, recvmsg, send,
    setsockopt, socketpair, sockopt,
};
use tandem_executor::{BoxFuture, Duplex, ExecError, Ports};

use crate::forkserver::ForkServer;

/// How long the holder may take to answer one request before it is taken for stuck.
const ANSWER_LIMIT: Duration = Duration::from_secs(15);

/// One session's holder, by the id its fork server knows it by.
pub(crate) struct Holder {
    /// The id blocks name to join its namespace.
    pub id: u64,
    /// The fork server it belongs to: a restarted server holds none of the old holds.
    pub server: Arc<ForkServer>,
    ctl: Mutex<OwnedFd>,
}

impl Holder {
    /// Starts a holder through `server`, relaying the egress proxy's `egress` socket when
    /// given, or, with `adopt`, keeping the listener for [`Holder::listener`]; blocking. An
    /// error carries the fork server's reason.
    pub(crate) fn start(
        server: &Arc<ForkServer>,
        egress: Option<&std::path::Path>,
        adopt: bool,
    ) -> io::Result<Self> {
        let (ours, theirs) = socketpair(
            AddressFamily::Unix,
            SockType::SeqPacket,
            None,
            SockFlag::SOCK_CLOEXEC,
        )?;
        let timeout = nix::sys::time::TimeVal::new(ANSWER_LIMIT.as_secs() as i64, 0);
        setsockopt(&ours, sockopt::ReceiveTimeout, &timeout)?;
        let id = server.next_hold_id();
        let request = serde_json::json!({"op": "hold", "id": id, "egress": egress, "adopt": adopt});
        server.hold(request.to_string().as_bytes(), theirs)?;
        Ok(Self {
            id,
            server: server.clone(),
            ctl: Mutex::new(ours),
        })
    }

    /// A connection to `port` on the session's loopback, or why there is none; blocking.
    fn dial(&self, port: u16) -> Result<std::net::TcpStream, ExecError> {
        let ctl = self
            .ctl
            .lock()
            .map_err(|_| ExecError::Backend("the session's holder lock is poisoned".into()))?;
        let (fd, text, n) = ask_for_fd(&ctl, &format!("dial {port}"))
            .map_err(|e| ExecError::io("asking the session's holder for a connection", e))?;
        match (fd, text.strip_prefix('!')) {
            (Some(fd), None) if text == "ok" => Ok(std::net::TcpStream::from(fd)),
            (_, Some(reason)) => Err(ExecError::PortClosed {
                port,
                reason: reason.to_owned(),
            }),
            _ if n == 0 => Err(ExecError::Backend(
                "the session's holder has ended (the session is closed)".into(),
            )),
            _ => Err(ExecError::Backend(format!(
                "the session's holder answered {text:?} to a dial"
            ))),
        }
    }

    /// The listener on the session's `127.0.0.1:3128`, for the egress proxy to serve with
    /// no relay between (a holder started with `adopt`); blocking.
    pub(crate) fn listener(&self) -> Result<std::net::TcpListener, ExecError> {
        let ctl = self
            .ctl
            .lock()
            .map_err(|_| ExecError::Backend("the session's holder lock is poisoned".into()))?;
        let (fd, text, _) = ask_for_fd(&ctl, "listener")
            .map_err(|e| ExecError::io("asking the session's holder for its egress listener", e))?;
        match fd {
            Some(fd) if text == "ok" => Ok(std::net::TcpListener::from(fd)),
            _ => Err(ExecError::Backend(format!(
                "the session's holder answered {text:?} when asked for its egress listener"
            ))),
        }
    }

    /// The session's network namespace, open; blocking.
    pub(crate) fn netns(&self) -> Result<OwnedFd, ExecError> {
        let ctl = self
            .ctl
            .lock()
            .map_err(|_| ExecError::Backend("the session's holder lock is poisoned".into()))?;
        let (fd, text, _) = ask_for_fd(&ctl, "netns")
            .map_err(|e| ExecError::io("asking the session's holder for its network", e))?;
        match fd {
            Some(fd) if text == "ok" => Ok(fd),
            _ => Err(ExecError::Backend(format!(
                "the session's holder answered {text:?} when asked for its network"
            ))),
        }
    }

    /// The ports listened on in the session now, sorted, the relay's left out; blocking.
    fn listening(&self) -> Result<Vec<u16>, ExecError> {
        let ctl = self
            .ctl
            .lock()
            .map_err(|_| ExecError::Backend("the session's holder lock is poisoned".into()))?;
        let gone =
            |e: nix::Error| ExecError::io("asking the session's holder for its ports", e.into());
        send(ctl.as_raw_fd(), b"list", MsgFlags::empty()).map_err(gone)?;
        let mut buf = vec![0u8; 1 << 20];
        let n = recv(ctl.as_raw_fd(), &mut buf, MsgFlags::empty()).map_err(gone)?;
        let mut ports: Vec<u16> = serde_json::from_slice(&buf[..n]).map_err(|_| {
            ExecError::Backend(format!(
                "the session's holder answered {:?} to a listing",
                String::from_utf8_lossy(&buf[..n.min(200)])
            ))
        })?;
        ports.sort_unstable();
        ports.dedup();
        Ok(ports)
    }
}

/// Sends `ask` on the holder's control socket and reads its answer: the descriptor that came
/// with it, its text, and its length (0: the holder has ended).
fn ask_for_fd(ctl: &OwnedFd, ask: &str) -> io::Result<(Option<OwnedFd>, String, usize)> {
    send(ctl.as_raw_fd(), ask.as_bytes(), MsgFlags::empty())?;
    let mut buf = [0u8; 512];
    let mut space = nix::cmsg_space!([std::os::fd::RawFd; 1]);
    let mut iov = [IoSliceMut::new(&mut buf)];
    let msg = recvmsg::<()>(
        ctl.as_raw_fd(),
        &mut iov,
        Some(&mut space),
        MsgFlags::MSG_CMSG_CLOEXEC,
    )?;
    let mut fd = None;
    for cmsg in msg.cmsgs()? {
        if let ControlMessageOwned::ScmRights(fds) = cmsg {
            for raw in fds {
                // SAFETY: the kernel just installed this descriptor in this process for
                // this message; nothing else owns it.
                #[allow(unsafe_code)]
                let owned = unsafe { OwnedFd::from_raw_fd(raw) };
                fd.get_or_insert(owned);
            }
        }
    }
    let n = msg.bytes;
    let text = String::from_utf8_lossy(&buf[..n]).into_owned();
    Ok((fd, text, n))
}

/// Where a session's holder is in its life.
pub(crate) enum Slot {
    /// None yet: it starts with the session's first block.
    Waiting,
    Open(Arc<Holder>),
    /// It could not start; blocks run without one (and, without one, are not behind the proxy).
    Failed(String),
    Closed,
}

/// The slot a session and its [`LocalPorts`] share.
pub(crate) type SharedSlot = Arc<Mutex<Slot>>;

/// Ends the session's holder when the session goes, closed or dropped.
pub(crate) struct HolderGuard(pub SharedSlot);

impl Drop for HolderGuard {
    fn drop(&mut self) {
        if let Ok(mut slot) = self.0.lock() {
            *slot = Slot::Closed;
        }
    }
}

/// The way in to a local session's ports, through its holder.
pub(crate) struct LocalPorts(pub SharedSlot);

impl LocalPorts {
    fn holder(&self, port: u16) -> Result<Arc<Holder>, ExecError> {
        let slot = self
            .0
            .lock()
            .map_err(|_| ExecError::Backend("the session's holder lock is poisoned".into()))?;
        match &*slot {
            Slot::Open(holder) => Ok(holder.clone()),
            Slot::Waiting => Err(ExecError::PortClosed {
                port,
                reason: "no block has run in the session yet".into(),
            }),
            Slot::Failed(why) => Err(ExecError::Unavailable {
                what: "the session's ports".into(),
                hint: format!("its network of its own did not start: {why}"),
            }),
            Slot::Closed => Err(ExecError::Backend("the session is closed".into())),
        }
    }
}

impl Ports for LocalPorts {
    fn dial(&self, port: u16) -> BoxFuture<'_, Result<Box<dyn Duplex>, ExecError>> {
        Box::pin(async move {
            let holder = self.holder(port)?;
            let stream = tokio::task::spawn_blocking(move || holder.dial(port))
                .await
                .map_err(|e| {
                    ExecError::Backend(format!("dialling the session's port failed: {e}"))
                })??;
            stream
                .set_nonblocking(true)
                .and_then(|()| tokio::net::TcpStream::from_std(stream))
                .map(|s| Box::new(s) as Box<dyn Duplex>)
                .map_err(|e| ExecError::io("taking the connection to the session's port", e))
        })
    }

    fn listening(&self) -> BoxFuture<'_, Result<Vec<u16>, ExecError>> {
        Box::pin(async move {
            let holder = match self.holder(0) {
                Ok(holder) => holder,
                Err(ExecError::PortClosed { .. }) => return Ok(Vec::new()),
                Err(e) => return Err(e),
            };
            tokio::task::spawn_blocking(move || holder.listening())
                .await
                .map_err(|e| {
                    ExecError::Backend(format!("listing the session's ports failed: {e}"))
                })?
        })
    }
}
