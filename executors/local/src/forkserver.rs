//! A warm Python interpreter that forks a process per block (see `forkserver.py`).
//!
//! A fresh `python3` spends most of its 10–50 ms start-up in `site` and encodings; forking
//! an interpreter that already did that costs about a millisecond. Each block still gets
//! its own process, session, rlimits, environment and working directory.

use std::io::{self, IoSlice};
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::Mutex;

use nix::fcntl::OFlag;
use nix::sys::socket::{
    AddressFamily, ControlMessage, MsgFlags, SockFlag, SockType, recv, sendmsg, socketpair,
};

const SERVER: &str = include_str!("forkserver.py");

/// Read ends of a launched block's pipes.
pub(crate) struct Launched {
    pub stdout: OwnedFd,
    pub stderr: OwnedFd,
    /// Receives two lines of decimal text: the block's pid once it leads its own session,
    /// then its raw wait status; EOF once every process it started is dead.
    pub status: OwnedFd,
}

pub(crate) struct ForkServer {
    ctl: Mutex<OwnedFd>,
    child: Mutex<Child>,
    /// The next id for a session's holder.
    holds: std::sync::atomic::AtomicU64,
}

impl ForkServer {
    /// Starts the server with `env` as its whole environment; with `no_network`, the server
    /// leaves the network (a user and network namespace of its own) before its first fork.
    pub(crate) fn start(
        python: &Path,
        env: &[(String, String)],
        no_network: bool,
    ) -> io::Result<Self> {
        let (ours, theirs) = socketpair(
            AddressFamily::Unix,
            SockType::SeqPacket,
            None,
            SockFlag::SOCK_CLOEXEC,
        )?;
        let theirs_raw = theirs.as_raw_fd();
        let mut cmd = Command::new(python);
        // Named first, as `ps` shows it; the prelude is defined before the server runs.
        let program = format!(
            "# Tandem's Python fork server: the prelude, then forkserver.py\n{}\n{SERVER}",
            tandem_executor_kit::PYTHON_PRELUDE
        );
        cmd.args(["-c", &program]);
        if no_network {
            cmd.arg("--no-network");
        }
        cmd.env_clear()
            .envs(env.iter().map(|(k, v)| (k, v)))
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null());
        // SAFETY: between fork and exec only dup2/fcntl run, which are async-signal-safe; they put
        // the server's end of the socket at fd 3 without the close-on-exec flag.
        #[allow(unsafe_code)]
        unsafe {
            cmd.pre_exec(move || {
                let ok = if theirs_raw == 3 {
                    nix::libc::fcntl(3, nix::libc::F_SETFD, 0) == 0
                } else {
                    nix::libc::dup2(theirs_raw, 3) == 3
                };
                if ok {
                    Ok(())
                } else {
                    Err(io::Error::last_os_error())
                }
            });
        }
        let child = cmd.spawn()?;
        drop(theirs);
        Ok(Self {
            ctl: Mutex::new(ours),
            child: Mutex::new(child),
            holds: std::sync::atomic::AtomicU64::new(1),
        })
    }

    /// Starts a block; blocking (run it off the async workers). `ruleset`, a Landlock
    /// ruleset, goes with the request for its waiter to apply, and `tools`, the block's end
    /// of its tools channel, for the block to inherit.
    pub(crate) fn launch(
        &self,
        request: &[u8],
        ruleset: Option<&OwnedFd>,
        tools: Option<&OwnedFd>,
    ) -> io::Result<Launched> {
        let (out_r, out_w) = nix::unistd::pipe2(OFlag::O_CLOEXEC)?;
        let (err_r, err_w) = nix::unistd::pipe2(OFlag::O_CLOEXEC)?;
        let (st_r, st_w) = nix::unistd::pipe2(OFlag::O_CLOEXEC)?;
        let ctl = self
            .ctl
            .lock()
            .map_err(|_| io::Error::other("fork server lock poisoned"))?;
        let mut fds = vec![out_w.as_raw_fd(), err_w.as_raw_fd(), st_w.as_raw_fd()];
        fds.extend(ruleset.map(AsRawFd::as_raw_fd));
        // Last, where the server looks for it when the request says there is one.
        fds.extend(tools.map(AsRawFd::as_raw_fd));
        sendmsg::<()>(
            ctl.as_raw_fd(),
            &[IoSlice::new(request)],
            &[ControlMessage::ScmRights(&fds)],
            MsgFlags::empty(),
            None,
        )?;
        drop((out_w, err_w, st_w));
        let mut reply = [0u8; 32];
        let n = recv(ctl.as_raw_fd(), &mut reply, MsgFlags::empty())?;
        // The reply is the waiter's pid; nothing (or garbage) means the server died.
        std::str::from_utf8(&reply[..n])
            .ok()
            .and_then(|s| s.trim().parse::<u32>().ok())
            .ok_or_else(|| io::Error::other("the Python fork server stopped answering"))?;
        Ok(Launched {
            stdout: out_r,
            stderr: err_r,
            status: st_r,
        })
    }

    /// An id for a new session's holder, unique for this server.
    pub(crate) fn next_hold_id(&self) -> u64 {
        self.holds
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed)
    }

    /// Starts a session's holder (`request`, an `op: hold` line) whose control socket is
    /// `theirs`; blocking. An error carries the server's reason.
    pub(crate) fn hold(&self, request: &[u8], theirs: OwnedFd) -> io::Result<()> {
        let ctl = self
            .ctl
            .lock()
            .map_err(|_| io::Error::other("fork server lock poisoned"))?;
        sendmsg::<()>(
            ctl.as_raw_fd(),
            &[IoSlice::new(request)],
            &[ControlMessage::ScmRights(&[theirs.as_raw_fd()])],
            MsgFlags::empty(),
            None,
        )?;
        drop(theirs);
        let mut reply = [0u8; 1024];
        let n = recv(ctl.as_raw_fd(), &mut reply, MsgFlags::empty())?;
        match &reply[..n] {
            b"ok" => Ok(()),
            [] => Err(io::Error::other("the Python fork server stopped answering")),
            text => Err(io::Error::other(
                String::from_utf8_lossy(text.strip_prefix(b"!").unwrap_or(text)).into_owned(),
            )),
        }
    }

    /// Whether the server process is still running.
    pub(crate) fn alive(&self) -> bool {
        self.child
            .lock()
            .is_ok_and(|mut c| matches!(c.try_wait(), Ok(None)))
    }
}

impl Drop for ForkServer {
    fn drop(&mut self) {
        if let Ok(mut child) = self.child.lock() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// Decodes a raw `waitpid` status.
pub(crate) fn decode_wait_status(raw: i32) -> tandem_executor::ExitStatus {
    let signal = raw & 0x7f;
    if signal == 0 {
        tandem_executor::ExitStatus::Exited((raw >> 8) & 0xff)
    } else {
        tandem_executor::ExitStatus::Signaled(signal)
    }
}
