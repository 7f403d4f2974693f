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
