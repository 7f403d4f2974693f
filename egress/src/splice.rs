//! A connection's bytes carried between two sockets through a pipe in the kernel
//! (`splice(2)`): the proxy never copies them into its own memory, and a bulk transfer costs
//! it a wake-up per pipe's worth. Used where neither side needs the bytes looked at: a
//! tunnel, and a forwarded request with no secret to scrub from its answers.

use std::future::Future;
use std::io;
use std::os::fd::{AsFd, OwnedFd};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use nix::fcntl::{FcntlArg, OFlag, SpliceFFlags, fcntl, splice};
use tokio::io::Interest;
use tokio::net::{TcpStream, UnixStream};

/// A socket the proxy can splice from and to, with Tokio's readiness.
pub(crate) trait Socket: AsFd + Send + Sync {
    /// Waits until `interest` may succeed.
    fn wait(&self, interest: Interest) -> impl Future<Output = io::Result<()>> + Send;
    /// Runs `f` on the socket, clearing its readiness when `f` would block.
    fn attempt<R>(&self, interest: Interest, f: impl FnOnce() -> io::Result<R>) -> io::Result<R>;
    /// Writes what it can of `buf` without waiting.
    fn write_now(&self, buf: &[u8]) -> io::Result<usize>;
}

macro_rules! socket {
    ($t:ty) => {
        impl Socket for $t {
            async fn wait(&self, interest: Interest) -> io::Result<()> {
                self.ready(interest).await.map(|_| ())
            }
            fn attempt<R>(
                &self,
                interest: Interest,
                f: impl FnOnce() -> io::Result<R>,
            ) -> io::Result<R> {
                self.try_io(interest, f)
            }
            fn write_now(&self, buf: &[u8]) -> io::Result<usize> {
                self.try_write(buf)
            }
        }
    };
}
socket!(TcpStream);
socket!(UnixStream);

/// Why one way of a spliced connection stopped early.
#[derive(Debug)]
pub(crate) enum Stop {
    /// Nothing came or went for the idle time.
    Idle,
    /// The task's budget would be passed; the bytes that would pass it are not sent.
    Budget,
    /// A socket failed.
    Failed,
}

/// The most a pipe holds and a splice moves at once.
const PIPE_BYTES: usize = 1 << 20;

/// A pipe for one way, as large as the system lets an unprivileged pipe be up to
/// [`PIPE_BYTES`].
pub(crate) fn pipe() -> io::Result<(OwnedFd, OwnedFd)> {
    let (r, w) = nix::unistd::pipe2(OFlag::O_CLOEXEC | OFlag::O_NONBLOCK)?;
    // A smaller pipe (the default 64 KiB) works, with more wake-ups.
    let _ = fcntl(&w, FcntlArg::F_SETPIPE_SZ(PIPE_BYTES as i32));
    Ok((r, w))
}

/// Carries `from`'s bytes to `to` through `pipe` until `from` ends (then `to`'s writing
/// side is shut), counting them in `count`; `take` is asked before bytes are sent on.
pub(crate) async fn one_way<A: Socket, B: Socket>(
    from: &A,
    to: &B,
    pipe: (OwnedFd, OwnedFd),
    count: &AtomicU64,
    idle: Duration,
    take: impl Fn(usize) -> bool,
) -> Result<(), Stop> {
    let (pipe_r, pipe_w) = pipe;
    let flags = SpliceFFlags::SPLICE_F_MOVE | SpliceFFlags::SPLICE_F_NONBLOCK;
    loop {
        // The pipe is empty here, so a splice that would block waits on `from` alone.
        let n = loop {
            match tokio::time::timeout(idle, from.wait(Interest::READABLE)).await {
                Err(_) => return Err(Stop::Idle),
                Ok(Err(_)) => break 0,
                Ok(Ok(())) => {}
            }
            match from.attempt(Interest::READABLE, || {
                splice(from.as_fd(), None, &pipe_w, None, PIPE_BYTES, flags)
                    .map_err(io::Error::from)
            }) {
                Ok(n) => break n,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => continue,
                Err(_) => break 0,
            }
        };
        if n == 0 {
            let _ = nix::sys::socket::shutdown(
                std::os::fd::AsRawFd::as_raw_fd(&to.as_fd()),
                nix::sys::socket::Shutdown::Write,
            );
            return Ok(());
        }
        if !take(n) {
            return Err(Stop::Budget);
        }
        count.fetch_add(n as u64, Ordering::Relaxed);
        let mut left = n;
        while left > 0 {
            match tokio::time::timeout(idle, to.wait(Interest::WRITABLE)).await {
                Err(_) => return Err(Stop::Idle),
                Ok(Err(_)) => return Err(Stop::Failed),
                Ok(Ok(())) => {}
            }
            match to.attempt(Interest::WRITABLE, || {
                splice(&pipe_r, None, to.as_fd(), None, left, flags).map_err(io::Error::from)
            }) {
                Ok(0) => return Err(Stop::Failed),
                Ok(m) => left -= m,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
                Err(_) => return Err(Stop::Failed),
            }
        }
    }
}

/// Writes all of `bytes` to `to`.
pub(crate) async fn write_all<B: Socket>(to: &B, mut bytes: &[u8]) -> io::Result<()> {
    while !bytes.is_empty() {
        to.wait(Interest::WRITABLE).await?;
        match to.write_now(bytes) {
            Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
            Ok(n) => bytes = &bytes[n..],
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};

    /// 8 MiB go through the pipe and arrive whole and in order; the far end is shut for
    /// writing once the near one ends.
    #[tokio::test]
    async fn bytes_go_through_the_pipe_whole_and_the_end_is_passed_on() {
        let (mut writer, from) = UnixStream::pair().unwrap();
        let (to, mut reader) = UnixStream::pair().unwrap();
        let sent: Vec<u8> = (0..8u32 << 20).map(|i| (i % 251) as u8).collect();
        let count = AtomicU64::new(0);
        let carried = one_way(
            &from,
            &to,
            pipe().unwrap(),
            &count,
            Duration::from_secs(60),
            |_| true,
        );
        let write = async {
            writer.write_all(&sent).await.unwrap();
            writer.shutdown().await.unwrap();
        };
        let mut got = Vec::new();
        let read = reader.read_to_end(&mut got);
        let (carried, (), read) = tokio::join!(carried, write, read);
        carried.unwrap();
        read.unwrap();
        assert_eq!(got.len(), sent.len());
        assert!(got == sent, "the bytes changed on the way");
        assert_eq!(count.load(Ordering::Relaxed), sent.len() as u64);
    }

    /// A chunk the budget refuses is not sent on, and the way stops saying so.
    #[tokio::test]
    async fn a_chunk_past_the_budget_is_not_sent() {
        let (mut writer, from) = UnixStream::pair().unwrap();
        let (to, mut reader) = UnixStream::pair().unwrap();
        writer.write_all(&[7u8; 1000]).await.unwrap();
        let count = AtomicU64::new(0);
        let stopped = one_way(
            &from,
            &to,
            pipe().unwrap(),
            &count,
            Duration::from_secs(60),
            |_| false,
        )
        .await;
        assert!(matches!(stopped, Err(Stop::Budget)), "{stopped:?}");
        drop(to);
        let mut got = Vec::new();
        reader.read_to_end(&mut got).await.unwrap();
        assert!(got.is_empty(), "{} bytes passed the budget", got.len());
        assert_eq!(count.load(Ordering::Relaxed), 0);
    }
}
