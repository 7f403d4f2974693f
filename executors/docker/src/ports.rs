//! A session container's relays (`tandem_executor_runner::relay`), started by the engine in
//! the container (`docker exec`, as root, so that a block can neither signal them nor have
//! the runner's end-of-block sweep take them): the way in to its TCP ports, which works
//! whatever the container's network and on an engine reached over TLS, and, on such an
//! engine, the way out to the egress proxy.

use std::path::PathBuf;
use std::time::Duration;

use bollard::Docker;
use bollard::container::LogOutput;
use bollard::exec::{CreateExecOptions, StartExecResults};
use futures::StreamExt;
use tandem_executor::{BoxFuture, CancellationToken, Duplex, ExecError, Ports};
use tandem_executor_runner::relay;

use crate::engine;

/// How long the engine and a relay get to say whether a port answered.
const DIAL_TIMEOUT: Duration = Duration::from_secs(30);

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
        Box::pin(async move {
            let dialled = async {
                let (output, input) = exec(
                    &self.docker,
                    &self.id,
                    relay::port_argv(port),
                    "starting a relay to the session's port",
                )
                .await?;
                relay::port_stream(output, input, port).await
            };
            match tokio::time::timeout(DIAL_TIMEOUT, dialled).await {
                Ok(dialled) => dialled,
                Err(_) => Err(ExecError::PortClosed {
                    port,
                    reason: format!("no answer within {}s", DIAL_TIMEOUT.as_secs()),
                }),
            }
        })
    }

    fn listening(&self) -> BoxFuture<'_, Result<Vec<u16>, ExecError>> {
        Box::pin(async move {
            let read = async {
                let (mut output, _input) = exec(
                    &self.docker,
                    &self.id,
                    vec![
                        "cat".to_owned(),
                        "/proc/net/tcp".to_owned(),
                        "/proc/net/tcp6".to_owned(),
                    ],
                    "listing the session's listening ports",
                )
                .await?;
                let mut tables = Vec::new();
                tokio::io::AsyncReadExt::read_to_end(
                    &mut tokio::io::AsyncReadExt::take(&mut output, 4 << 20),
                    &mut tables,
                )
                .await
                .map_err(|e| ExecError::io("reading the session's port tables", e))?;
                Ok::<_, ExecError>(tables)
            };
            let tables = tokio::time::timeout(DIAL_TIMEOUT, read)
                .await
                .map_err(|_| {
                    ExecError::Backend(format!(
                        "the engine did not list the session's ports within {}s",
                        DIAL_TIMEOUT.as_secs()
                    ))
                })??;
            // The runner's own listener (the egress relay's) is root's; blocks never are.
            Ok(relay::listening_ports(
                &String::from_utf8_lossy(&tables),
                Some(0),
            ))
        })
    }
}

/// Starts the egress relay in container `id`, listening on `port`, and carries its
/// connections to `socket` until `stop`; returns once it listens.
pub(crate) async fn egress(
    docker: &Docker,
    id: &str,
    port: u16,
    socket: PathBuf,
    bundle: Vec<u8>,
    stop: CancellationToken,
) -> Result<(), ExecError> {
    let (output, input) = exec(
        docker,
        id,
        relay::egress_argv(port),
        "starting the egress relay in the session container",
    )
    .await?;
    relay::carry_egress(output, input, socket, bundle, stop).await
}
