//! Relays Tandem starts in a sandbox (an exec: `docker exec`, or a pod's exec through the
//! Kubernetes API) and speaks to over the exec's stdin and stdout: one that carries a
//! connection to a port of the sandbox's (published ports), and one that carries the
//! sandbox's connections out to the egress proxy's socket on Tandem's machine (for a sandbox
//! the socket cannot be bound into). Both are Python, which every sandbox image has for the
//! runner.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use tandem_executor::{CancellationToken, Duplex, ExecError};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::UnixStream;
use tokio::net::unix::OwnedWriteHalf;
use tokio::sync::mpsc;

/// An exec's stdout, as the relay writes it.
pub type Output = Box<dyn AsyncRead + Send + Unpin>;
/// An exec's stdin.
pub type Input = Box<dyn AsyncWrite + Send + Unpin>;

/// Both relays make themselves undumpable (`PR_SET_DUMPABLE` 0) first: where they run as the
/// blocks' user (a pod), a block can then neither open their `/proc/<pid>/fd` to write into
/// their streams nor trace them.
///
/// Connects to the port on the sandbox's loopback (IPv4, then IPv6) and carries bytes
/// between it and its stdin and stdout. Its first byte out says how the connection went: 0
/// connected, 1 refused (the reason follows).
const PORT_RELAY: &str = r#"
import os, socket, sys, threading
try:
    import ctypes
    ctypes.CDLL(None).prctl(4, 0, 0, 0, 0)
except Exception:
    pass
port = int(sys.argv[1])
try:
    s = socket.create_connection(("127.0.0.1", port), timeout=10)
except OSError as first:
    try:
        s = socket.create_connection(("::1", port), timeout=10)
    except OSError:
        os.write(1, b"\x01" + str(first).encode())
        sys.exit(1)
s.settimeout(None)
out = sys.stdout.buffer
out.write(b"\x00")
out.flush()
def up():
    try:
        while True:
            data = os.read(0, 1 << 16)
            if not data:
                break
            s.sendall(data)
    except OSError:
        pass
    try:
        s.shutdown(socket.SHUT_WR)
    except OSError:
        pass
threading.Thread(target=up, daemon=True).start()
try:
    while True:
        data = s.recv(1 << 16)
        if not data:
            break
        out.write(data)
        out.flush()
except OSError:
    pass
"#;

/// The argv of the relay to `port`.
pub fn port_argv(port: u16) -> Vec<String> {
    vec![
        "python3".to_owned(),
        "-I".to_owned(),
        "-c".to_owned(),
        PORT_RELAY.to_owned(),
        port.to_string(),
    ]
}

/// How long an exec and its relay get to say whether a port answered, or to list ports.
pub const DIAL_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(30);

/// A connection to `port` through the relay `started` (an exec of [`port_argv`]), within
/// [`DIAL_TIMEOUT`].
pub async fn dial(
    started: impl std::future::Future<Output = Result<(Output, Input), ExecError>>,
    port: u16,
) -> Result<Box<dyn Duplex>, ExecError> {
    let dialled = async {
        let (output, input) = started.await?;
        port_stream(output, input, port).await
    };
    match tokio::time::timeout(DIAL_TIMEOUT, dialled).await {
        Ok(dialled) => dialled,
        Err(_) => Err(ExecError::PortClosed {
            port,
            reason: format!("no answer within {}s", DIAL_TIMEOUT.as_secs()),
        }),
    }
}

/// The argv that prints the sandbox's TCP tables, for [`listening`].
pub fn tables_argv() -> Vec<String> {
    ["cat", "/proc/net/tcp", "/proc/net/tcp6"]
        .map(str::to_owned)
        .to_vec()
}

/// The ports listened on, as the exec `started` (of [`tables_argv`]) prints them, but for
/// sockets of `skip_uid`; within [`DIAL_TIMEOUT`].
pub async fn listening(
    started: impl std::future::Future<Output = Result<(Output, Input), ExecError>>,
    skip_uid: Option<u32>,
) -> Result<Vec<u16>, ExecError> {
    let read = async {
        let (output, _input) = started.await?;
        let mut tables = Vec::new();
        output
            .take(4 << 20)
            .read_to_end(&mut tables)
            .await
            .map_err(|e| ExecError::io("reading the sandbox's port tables", e))?;
        Ok::<_, ExecError>(tables)
    };
    let tables = tokio::time::timeout(DIAL_TIMEOUT, read)
        .await
        .map_err(|_| {
            ExecError::Backend(format!(
                "the sandbox's ports were not listed within {}s",
                DIAL_TIMEOUT.as_secs()
            ))
        })??;
    Ok(listening_ports(&String::from_utf8_lossy(&tables), skip_uid))
}

/// The connection a started [`port_argv`] relay made: the stream both ways, or why there is
/// none.
pub async fn port_stream(
    mut output: Output,
    input: Input,
    port: u16,
) -> Result<Box<dyn Duplex>, ExecError> {
    let mut verdict = [0u8; 1];
    if output.read_exact(&mut verdict).await.is_err() {
        return Err(ExecError::PortClosed {
            port,
            reason: "the relay in the sandbox ended without a word (it needs python3)".to_owned(),
        });
    }
    if verdict[0] != 0 {
        let mut reason = Vec::new();
        let _ = (&mut output).take(4096).read_to_end(&mut reason).await;
        return Err(ExecError::PortClosed {
            port,
            reason: String::from_utf8_lossy(&reason).trim().to_owned(),
        });
    }
    Ok(Box::new(tokio::io::join(output, input)))
}

/// The listening TCP sockets of a Linux network namespace, as `/proc/net/tcp{,6}` list them:
/// the ports of those not owned by `skip_uid` (the runner's own), sorted and deduplicated.
pub fn listening_ports(tables: &str, skip_uid: Option<u32>) -> Vec<u16> {
    let mut ports: Vec<u16> = tables
        .lines()
        .filter_map(|line| {
            let cols: Vec<&str> = line.split_whitespace().collect();
            // sl local_address rem_address st tx:rx tr:when retrnsmt uid ...
            if cols.len() < 8 || cols[3] != "0A" {
                return None;
            }
            let uid: u32 = cols[7].parse().ok()?;
            if Some(uid) == skip_uid {
                return None;
            }
            let (_, port) = cols[1].rsplit_once(':')?;
            u16::from_str_radix(port, 16).ok()
        })
        .collect();
    ports.sort_unstable();
    ports.dedup();
    ports
}

/// Where the egress relay writes the certificates the sandbox trusts: the runner's tmpfs,
/// which blocks read but cannot change.
pub const EGRESS_CA_PATH: &str = "/run/tandem/egress-ca.pem";

/// The egress relay. A frame is its kind (1 byte), a connection's number (4 bytes) and a
/// length (4 bytes), big-endian, then that many bytes. In: `b` the CA bundle (before all
/// else), `d` bytes for a connection, `e` no more bytes for it, `x` it is over. Out: `R`
/// listening, `n` a new connection, `d`, `e`, and `!` an error (text).
const EGRESS_RELAY: &str = r#"
import os, socket, struct, sys, threading
try:
    import ctypes
    ctypes.CDLL(None).prctl(4, 0, 0, 0, 0)
except Exception:
    pass
PORT, CA = int(sys.argv[1]), sys.argv[2]
lock, conns, ended = threading.Lock(), {}, {}
def end(cid, way):
    with lock:
        ways = ended.setdefault(cid, set())
        ways.add(way)
        over = len(ways) == 2
    if over:
        ended.pop(cid, None)
        c = conns.pop(cid, None)
        if c is not None:
            c.close()
def send(kind, cid, data=b""):
    frame = memoryview(struct.pack(">cII", kind, cid, len(data)) + data)
    with lock:
        while frame:
            frame = frame[os.write(1, frame):]
def exact(n):
    data = b""
    while len(data) < n:
        chunk = os.read(0, n - len(data))
        if not chunk:
            os._exit(0)
        data += chunk
    return data
def up(cid, c):
    while True:
        try:
            data = c.recv(1 << 16)
        except OSError:
            data = b""
        if not data:
            send(b"e", cid)
            end(cid, "up")
            return
        send(b"d", cid, data)
def accept(listener):
    n = 0
    while True:
        try:
            c, _ = listener.accept()
        except OSError:
            continue
        n += 1
        conns[n] = c
        send(b"n", n)
        threading.Thread(target=up, args=(n, c), daemon=True).start()
kind, _, size = struct.unpack(">cII", exact(9))
bundle = exact(size)
try:
    if kind == b"b" and bundle:
        with open(CA + ".tmp", "wb") as f:
            f.write(bundle)
        os.chmod(CA + ".tmp", 0o644)
        os.rename(CA + ".tmp", CA)
    listener = socket.socket()
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind(("127.0.0.1", PORT))
    listener.listen(256)
except OSError as e:
    send(b"!", 0, str(e).encode())
    sys.exit(1)
threading.Thread(target=accept, args=(listener,), daemon=True).start()
send(b"R", 0)
while True:
    kind, cid, size = struct.unpack(">cII", exact(9))
    data = exact(size)
    c = conns.get(cid)
    if c is None:
        continue
    try:
        if kind == b"d":
            c.sendall(data)
        elif kind == b"e":
            c.shutdown(socket.SHUT_WR)
            end(cid, "down")
        elif kind == b"x":
            conns.pop(cid, None)
            c.close()
    except OSError:
        conns.pop(cid, None)
        c.close()
"#;

/// The argv of the egress relay listening on `port`.
pub fn egress_argv(port: u16) -> Vec<String> {
    vec![
        "python3".to_owned(),
        "-I".to_owned(),
        "-c".to_owned(),
        EGRESS_RELAY.to_owned(),
        port.to_string(),
        EGRESS_CA_PATH.to_owned(),
    ]
}

/// Most connections one relay carries at once (the proxy's own cap on a sandbox is lower).
const MOST_OPEN: usize = 4096;

/// Most bytes of one frame taken from the relay (it sends at most 64 KiB of data a frame;
/// an error's text is short).
const MOST_FRAME: u32 = 1 << 20;

fn frame(kind: u8, id: u32, data: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(9 + data.len());
    out.push(kind);
    out.extend_from_slice(&id.to_be_bytes());
    out.extend_from_slice(&(data.len() as u32).to_be_bytes());
    out.extend_from_slice(data);
    out
}

/// Gives a started [`egress_argv`] relay the certificates at `ca_bundle` (written where
/// [`EGRESS_CA_PATH`] says), waits until it listens, then carries its connections to
/// `socket` until `stop` or the exec's end.
pub async fn carry_egress(
    mut output: Output,
    mut input: Input,
    socket: PathBuf,
    ca_bundle: Option<&Path>,
    stop: CancellationToken,
) -> Result<(), ExecError> {
    let bundle = match ca_bundle {
        Some(path) => tokio::fs::read(path)
            .await
            .map_err(|e| ExecError::io("reading the egress proxy's CA bundle", e))?,
        None => Vec::new(),
    };
    input
        .write_all(&frame(b'b', 0, &bundle))
        .await
        .map_err(|e| ExecError::io("sending the CA bundle to the egress relay", e))?;
    input
        .flush()
        .await
        .map_err(|e| ExecError::io("sending the CA bundle to the egress relay", e))?;
    let mut frames = Frames::default();
    let mut chunk = vec![0u8; 1 << 16];
    // Its first frame says whether it listens.
    loop {
        if let Some((kind, _, data)) = frames.next()? {
            if kind == b'R' {
                break;
            }
            return Err(ExecError::Unavailable {
                what: "the egress relay in the sandbox".to_owned(),
                hint: format!(
                    "it did not start: {}",
                    String::from_utf8_lossy(&data).trim()
                ),
            });
        }
        match tokio::time::timeout(crate::READY_LIMIT, output.read(&mut chunk)).await {
            Ok(Ok(0)) | Ok(Err(_)) => {
                return Err(ExecError::Unavailable {
                    what: "the egress relay in the sandbox".to_owned(),
                    hint: "it ended before it listened; the sandbox's image needs python3"
                        .to_owned(),
                });
            }
            Ok(Ok(n)) => frames.push(&chunk[..n]),
            Err(_) => {
                return Err(ExecError::Backend(format!(
                    "the egress relay did not listen within {:?}",
                    crate::READY_LIMIT
                )));
            }
        }
    }
    let (to_relay, mut outgoing) = mpsc::channel::<Vec<u8>>(64);
    let writer = tokio::spawn(async move {
        while let Some(bytes) = outgoing.recv().await {
            if input.write_all(&bytes).await.is_err() || input.flush().await.is_err() {
                break;
            }
        }
    });
    tokio::spawn(async move {
        let mut open: HashMap<u32, Conn> = HashMap::new();
        let carried = async {
            loop {
                while let Some((kind, cid, data)) = frames.next()? {
                    carry(kind, cid, data, &mut open, &socket, &to_relay).await;
                }
                match output.read(&mut chunk).await {
                    Ok(0) | Err(_) => return Ok::<(), ExecError>(()),
                    Ok(n) => frames.push(&chunk[..n]),
                }
            }
        };
        tokio::select! {
            ended = carried => {
                if let Err(e) = ended {
                    tracing::warn!(error = %e, "the egress relay spoke out of turn; its connections are closed");
                }
            }
            () = stop.cancelled() => {}
        }
        for conn in open.into_values() {
            conn.reader.abort();
        }
        writer.abort();
    });
    Ok(())
}

/// One relayed connection, as this side holds it.
struct Conn {
    /// Where the relay's bytes for it go: the proxy's socket.
    to_proxy: Option<OwnedWriteHalf>,
    /// Carries the proxy's answer back as frames.
    reader: tokio::task::JoinHandle<()>,
}

async fn carry(
    kind: u8,
    cid: u32,
    data: Vec<u8>,
    open: &mut HashMap<u32, Conn>,
    socket: &Path,
    to_relay: &mpsc::Sender<Vec<u8>>,
) {
    match kind {
        // A sandbox that holds more connections than the proxy would ever carry gets no more.
        b'n' if open.len() >= MOST_OPEN => {
            let _ = to_relay.send(frame(b'x', cid, &[])).await;
        }
        b'n' => match UnixStream::connect(socket).await {
            Ok(stream) => {
                let (mut from_proxy, to_proxy) = stream.into_split();
                let back = to_relay.clone();
                let reader = tokio::spawn(async move {
                    let mut buf = vec![0u8; 1 << 16];
                    loop {
                        match from_proxy.read(&mut buf).await {
                            Ok(0) | Err(_) => break,
                            Ok(n) => {
                                if back.send(frame(b'd', cid, &buf[..n])).await.is_err() {
                                    return;
                                }
                            }
                        }
                    }
                    let _ = back.send(frame(b'e', cid, &[])).await;
                });
                open.insert(
                    cid,
                    Conn {
                        to_proxy: Some(to_proxy),
                        reader,
                    },
                );
            }
            Err(e) => {
                tracing::debug!(error = %e, "the egress proxy's socket refused a relayed connection");
                let _ = to_relay.send(frame(b'x', cid, &[])).await;
            }
        },
        b'd' => {
            let failed = match open.get_mut(&cid).and_then(|c| c.to_proxy.as_mut()) {
                Some(to_proxy) => to_proxy.write_all(&data).await.is_err(),
                None => false,
            };
            if failed && let Some(conn) = open.remove(&cid) {
                conn.reader.abort();
                let _ = to_relay.send(frame(b'x', cid, &[])).await;
            }
        }
        b'e' => {
            if let Some(mut to_proxy) = open.get_mut(&cid).and_then(|c| c.to_proxy.take()) {
                let _ = to_proxy.shutdown().await;
            }
        }
        _ => {}
    }
    // A connection over both ways is forgotten (the relay closes its end itself).
    open.retain(|_, c| c.to_proxy.is_some() || !c.reader.is_finished());
}

/// The relay's frames as they arrive in pieces.
#[derive(Default)]
struct Frames {
    buf: Vec<u8>,
}

impl Frames {
    fn push(&mut self, bytes: &[u8]) {
        self.buf.extend_from_slice(bytes);
    }

    /// The next whole frame, if one has arrived; an error for one larger than any the
    /// relay sends.
    fn next(&mut self) -> Result<Option<(u8, u32, Vec<u8>)>, ExecError> {
        if self.buf.len() < 9 {
            return Ok(None);
        }
        let id = u32::from_be_bytes([self.buf[1], self.buf[2], self.buf[3], self.buf[4]]);
        let len = u32::from_be_bytes([self.buf[5], self.buf[6], self.buf[7], self.buf[8]]);
        if len > MOST_FRAME {
            return Err(ExecError::Backend(format!(
                "the egress relay sent a frame of {len} bytes, over the {MOST_FRAME} it may"
            )));
        }
        let end = 9 + len as usize;
        if self.buf.len() < end {
            return Ok(None);
        }
        let kind = self.buf[0];
        let data = self.buf[9..end].to_vec();
        self.buf.drain(..end);
        Ok(Some((kind, id, data)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn frames_arrive_whole_from_pieces_and_a_huge_one_is_refused() {
        let mut frames = Frames::default();
        let mut wire = frame(b'd', 7, b"hello");
        wire.extend(frame(b'e', 7, &[]));
        for byte in &wire {
            frames.push(&[*byte]);
        }
        assert_eq!(frames.next().unwrap(), Some((b'd', 7, b"hello".to_vec())));
        assert_eq!(frames.next().unwrap(), Some((b'e', 7, Vec::new())));
        assert_eq!(frames.next().unwrap(), None);
        let mut huge = vec![b'd', 0, 0, 0, 1];
        huge.extend_from_slice(&u32::MAX.to_be_bytes());
        frames.push(&huge);
        assert!(frames.next().is_err());
    }

    #[test]
    fn only_listening_sockets_of_other_users_count() {
        let tables = "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode\n   0: 0100007F:0C38 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 1 1 0000000000000000 100 0 0 10 0\n   1: 0100007F:1F40 00000000:0000 0A 00000000:00000000 00:00000000 00000000 65534        0 2 1 0000000000000000 100 0 0 10 0\n   2: 0100007F:1F40 0100007F:A1B2 01 00000000:00000000 00:00000000 00000000 65534        0 3 1 0000000000000000 100 0 0 10 0\n  sl  local_address                         remote_address                        st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode\n   0: 00000000000000000000000000000000:1F40 00000000000000000000000000000000:0000 0A 00000000:00000000 00:00000000 00000000 65534        0 4 1 0000000000000000 100 0 0 10 0\n   1: 00000000000000000000000000000000:0050 00000000000000000000000000000000:0000 0A 00000000:00000000 00:00000000 00000000 65534        0 5 1 0000000000000000 100 0 0 10 0\n";
        assert_eq!(listening_ports(tables, Some(0)), [80, 8000]);
        assert_eq!(listening_ports(tables, None), [80, 3128, 8000]);
    }
}
