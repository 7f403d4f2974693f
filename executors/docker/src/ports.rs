//! A session container's relays (`tandem_executor_runner::relay`), started by the engine in
//! the container (`docker exec`, as root, so that a block can neither signal them nor have
//! the runner's end-of-block sweep take them): the way in to its TCP ports, which works
//! whatever the container's network and on an engine reached over TLS, and, on such an
//! engine, the way out to the egress proxy.

use std::path::PathBuf;

use bollard::Docker;
use bollard::container::LogOutput;
use bollard::exec::{CreateExecOptions, StartExecResults};
use futures::StreamExt;
use tandem_executor::{BoxFuture, CancellationToken, Duplex, ExecError, Ports};
use tandem_executor_runner::relay;

use crate::engine;

/// Starts `argv` in container `id` as root: its stdout (stderr dropped) and stdin.
async fn exec(
    docker: &Docker,
    id: &str,
    argv: Vec<String>,
    what: &str,
) -> Result<(relay::Output, relay::Input), ExecError> {
    let exec = docker
        .create_exec(
            id,
            CreateExecOptions {
                cmd: Some(argv),
                user: Some("0".to_owned()),
                attach_stdin: Some(true),
                attach_stdout: Some(true),
                attach_stderr: Some(true),
                ..Default::default()
            },
        )
        .await
        .map_err(engine(what))?;
    let StartExecResults::Attached { output, input } = docker
        .start_exec(&exec.id, None)
        .await
        .map_err(engine(what))?
    else {
        return Err(ExecError::Backend(format!(
            "{what}: the engine started it detached"
        )));
    };
    let stdout = output.filter_map(|item| async move {
        match item {
            Ok(LogOutput::StdOut { message }) => Some(Ok(message)),
            Ok(_) => None,
            Err(e) => Some(Err(std::io::Error::other(e))),
        }
    });
    Ok((
        Box::new(tokio_util::io::StreamReader::new(Box::pin(stdout))),
        Box::new(input),
    ))
}

/// One session container's ports.
pub(crate) struct DockerPorts {
    pub(crate) docker: Docker,
    pub(crate) id: String,
}

impl Ports for DockerPorts {
    fn dial(&self, port: u16) -> BoxFuture<'_, Result<Box<dyn Duplex>, ExecError>> {
        Box::pin(relay::dial(
            exec(
                &self.docker,
                &self.id,
                relay::port_argv(port),
                "starting a relay to the session's port",
            ),
            port,
        ))
    }

    fn listening(&self) -> BoxFuture<'_, Result<Vec<u16>, ExecError>> {
        // The runner's own listener (the egress relay's) is root's; blocks never are.
        Box::pin(relay::listening(
            exec(
                &self.docker,
                &self.id,
                relay::tables_argv(),
                "listing the session's listening ports",
            ),
            Some(0),
        ))
    }
}

/// Starts the egress relay in container `id`, listening on `port`, and carries its
/// connections to `socket` until `stop`; returns once it listens.
pub(crate) async fn egress(
    docker: &Docker,
    id: &str,
    port: u16,
    socket: PathBuf,
    ca_bundle: Option<&std::path::Path>,
    stop: CancellationToken,
) -> Result<(), ExecError> {
    let (output, input) = exec(
        docker,
        id,
        relay::egress_argv(port),
        "starting the egress relay in the session container",
    )
    .await?;
    relay::carry_egress(output, input, socket, ca_bundle, stop).await
}

/// The variable naming a container whose egress listener Tandem opens in its network
/// namespace: its value is the session's id, which the runner's `/proc/<pid>/environ` must
/// show before Tandem enters that namespace (a PID from the engine names a process of this
/// machine only when both see one PID namespace).
pub(crate) const NETNS_MARK: &str = "TANDEM_EGRESS_NETNS";

/// Opens the egress proxy's listener on the loopback of container `id` itself, in its
/// network namespace, and hands it to the proxy: the container's connections then reach the
/// proxy with no relay copying them. The namespace is entered on a thread made for it, which
/// ends there; the listener stays in the namespace it was made in.
pub(crate) async fn egress_in_netns(
    docker: &Docker,
    id: &str,
    session: &str,
    adopt: &tandem_executor::EgressAdopt,
) -> Result<(), String> {
    let pid = docker
        .inspect_container(id, None)
        .await
        .map_err(|e| format!("inspecting the container: {e}"))?
        .state
        .and_then(|s| s.pid)
        .filter(|pid| *pid > 0)
        .ok_or("the engine gave no process for the container")?;
    let mark = format!("{NETNS_MARK}={session}");
    let (tx, rx) = tokio::sync::oneshot::channel();
    std::thread::Builder::new()
        .name("tandem-netns".to_owned())
        .spawn(move || {
            let _ = tx.send(listen_in(pid, &mark));
        })
        .map_err(|e| format!("starting a thread to enter the namespace: {e}"))?;
    match rx
        .await
        .map_err(|_| "the namespace's thread ended without an answer".to_owned())??
    {
        (Some(listener), ns) => {
            adopt
                .adopt(listener)
                .map_err(|e| format!("serving the listener: {e}"))?;
            // Its other ways out are caught and told. Without it the container still has
            // no route: what it tries is refused, only not seen.
            let adopt = adopt.clone();
            match tokio::task::spawn_blocking(move || adopt.catch(ns)).await {
                Ok(Ok(())) => {}
                Ok(Err(e)) => {
                    tracing::warn!(error = %e, "the container's attempts around the egress proxy will be refused but not recorded");
                }
                Err(e) => tracing::warn!(error = %e, "catching the container's other traffic"),
            }
            Ok(())
        }
        // The container's network is the one the listener was opened in: it serves on.
        (None, _) => Ok(()),
    }
}

/// On a thread of its own (it stays in the namespace): checks that `pid` is the container's
/// runner by `mark` in its environment, enters its network namespace, and listens there;
/// `None` when the namespace already has the listener (the port is taken before any block
/// runs only by the proxy's own); with the namespace, open.
fn listen_in(
    pid: i64,
    mark: &str,
) -> Result<(Option<std::net::TcpListener>, std::os::fd::OwnedFd), String> {
    use nix::fcntl::{OFlag, openat};
    use nix::sys::stat::Mode;
    use std::io::Read as _;
    let dir = std::fs::File::open(format!("/proc/{pid}"))
        .map_err(|e| format!("opening /proc/{pid}: {e}"))?;
    // Both read beneath the one handle: a process that ended and whose PID was taken again
    // leaves the handle pointing at nothing, never at the newcomer.
    let open = |name: &str| {
        openat(
            &dir,
            name,
            OFlag::O_RDONLY | OFlag::O_CLOEXEC,
            Mode::empty(),
        )
        .map(std::fs::File::from)
        .map_err(|e| format!("opening /proc/{pid}/{name}: {e}"))
    };
    let mut environ = Vec::new();
    open("environ")?
        .take(1 << 20)
        .read_to_end(&mut environ)
        .map_err(|e| format!("reading /proc/{pid}/environ: {e}"))?;
    if !environ.split(|b| *b == 0).any(|v| v == mark.as_bytes()) {
        return Err(format!(
            "process {pid} is not the container's runner as this process sees it (another PID namespace?)"
        ));
    }
    let ns = open("ns/net")?;
    nix::sched::setns(&ns, nix::sched::CloneFlags::CLONE_NEWNET)
        .map_err(|e| format!("entering the container's network namespace: {e}"))?;
    match std::net::TcpListener::bind((std::net::Ipv4Addr::LOCALHOST, tandem_executor::EGRESS_PORT))
    {
        Ok(listener) => Ok((Some(listener), ns.into())),
        Err(e) if e.kind() == std::io::ErrorKind::AddrInUse => Ok((None, ns.into())),
        Err(e) => Err(format!("listening in the container: {e}")),
    }
}
