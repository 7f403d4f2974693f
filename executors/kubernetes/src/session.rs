//! One session's claim: make it, wait for its sandbox, exec the runner in its pod, run
//! blocks, delete it.

use std::path::Path;
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, AttachParams, AttachedProcess, DynamicObject, PostParams};
use tandem_executor::{
    BoxFuture, CancellationToken, ExecContext, ExecError, ExecOutcome, ExecRequest, Session,
    SessionSpec,
};
use tandem_executor_kit::scratch;
use tandem_executor_kit::scratch::TempTree;
use tandem_executor_runner::session::{Offer, RunnerSession, Transport};
use tandem_executor_runner::{Conn, Frame, FrameReader, mirror};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use crate::{Held, KubernetesError, KubernetesExecutor, labels, sandboxes_resource};

/// The annotation on a `Sandbox` naming its pod when it is not the sandbox's own name (a pod
/// adopted from a warm pool).
const POD_NAME_ANNOTATION: &str = "agents.x-k8s.io/pod-name";

/// How often a claim is looked at while it waits for its sandbox: soon at first (a warm pod
/// is bound at once), then less often, up to the second.
const POLL_FIRST: Duration = Duration::from_millis(20);
const POLL_MOST: Duration = Duration::from_millis(1000);

/// Largest piece the exec stream buffers in each direction.
const EXEC_BUFFER: usize = 1 << 16;

pub(crate) struct KubeSession {
    executor: KubernetesExecutor,
    /// The claim's name (or the sandbox's, for a session with volumes), which is also how
    /// Tandem knows the session.
    claim: String,
    /// Which of the two it is.
    held: Held,
    /// The pod the sandbox runs in, once bound, and the exec that carries its runner.
    pod: PodRunner,
    /// Its workspace on this machine is the mirror of the pod's.
    runner: RunnerSession,
    owned_workspace: Option<TempTree>,
    /// Ends the egress relay, for a session behind the proxy.
    relay: Option<CancellationToken>,
    closed: bool,
}

/// The pod as the runner session reaches it: the runner is exec'd in it, and the exec that
/// carries it is kept (dropping it ends the stream, and with it the runner).
struct PodRunner {
    exec: PodExec,
    process: Option<AttachedProcess>,
}

impl KubeSession {
    pub(crate) async fn open(
        executor: KubernetesExecutor,
        spec: SessionSpec,
    ) -> Result<Self, ExecError> {
        let session_id = uuid::Uuid::new_v4().simple().to_string();
        let claim = format!("tandem-{}", &session_id[..12]);
        let (workspace, owned_workspace) =
            scratch::open_workspace(spec.workdir.clone(), &executor.inner.root, "ws-")?;
        let (mut labels, annotations) = executor.claim_metadata(&session_id, &spec);
        // A pod from the warm pool was started without the session's volumes: a session
        // with volumes gets a sandbox of its own, from the pool's template with them mounted.
        let (held, body) = if spec.volumes.is_empty() {
            (
                Held::Claim,
                serde_json::json!({
                    "spec": { "warmPoolRef": { "name": executor.inner.config.warm_pool } }
                }),
            )
        } else {
            // Checked before anything is made: a refused mount leaves no claim behind.
            let template = crate::volumes::pod_template_with(
                &executor.pool_pod_template().await?,
                executor.inner.config.container.as_deref(),
                &spec.volumes,
            )?;
            executor.ensure_volumes(&spec.volumes).await?;
            labels.insert(labels::MADE.to_owned(), "session".to_owned());
            (
                Held::Sandbox,
                serde_json::json!({ "spec": { "podTemplate": template } }),
            )
        };
        let mut object = DynamicObject::new(&claim, &held.resource())
            .within(&executor.inner.config.namespace)
            .data(body);
        object.metadata.labels = Some(labels);
        object.metadata.annotations = Some(annotations);
        // Made on a task of the executor's, watched by `making` until its answer is in: an
        // open dropped while the server makes the claim (its caller went away) must not leave
        // it holding a pod.
        let create = {
            let executor = executor.clone();
            async move {
                executor
                    .request(
                        &format!("creating a {}", held.kind()),
                        executor
                            .held_api(held)
                            .create(&PostParams::default(), &object),
                    )
                    .await
                    .map(|_| ())
            }
        };
        let created = Making::start(&executor, held, &claim, create)
            .await?
            .take()
            .await?;
        if let Err(e) = created {
            if matches!(e, KubernetesError::Unreachable { .. }) {
                // The server may have made the claim and not said so: delete it on the
                // chance, or it holds a pod until Tandem restarts.
                let (executor, claim) = (executor.clone(), claim.clone());
                tokio::spawn(async move {
                    let _ = executor.delete_held(held, &claim).await;
                });
            }
            return Err(match e {
                KubernetesError::Api { reason, .. } if reason.contains("404") => {
                    KubernetesError::NoAgentSandbox {
                        resource: match held {
                            Held::Claim => "sandboxclaims",
                            Held::Sandbox => "sandboxes",
                        },
                        group: match held {
                            Held::Claim => crate::EXTENSIONS_GROUP,
                            Held::Sandbox => crate::SANDBOX_GROUP,
                        },
                        namespace: executor.inner.config.namespace.clone(),
                    }
                    .into()
                }
                e => e.into(),
            });
        }
        let config = &executor.inner.config;
        let mut env = config.env.clone();
        if let Some(egress) = &spec.egress {
            // The pod has no way out of its own: a relay Tandem execs in it carries each
            // connection over the API server's stream to the proxy's socket here.
            env.extend(tandem_executor::egress_env());
            env.extend(egress.env.iter().cloned());
            if egress.ca_bundle.is_some() {
                env.extend(tandem_executor::egress_ca_env(
                    tandem_executor_runner::relay::EGRESS_CA_PATH,
                ));
            }
        }
        let offer = Offer {
            executor: "kubernetes",
            languages: config.languages.clone(),
            env,
            user: config.user.clone(),
        };
        // From here on, dropping the session deletes the claim.
        let mut session = Self {
            pod: PodRunner {
                exec: PodExec {
                    executor: executor.clone(),
                    name: String::new(),
                },
                process: None,
            },
            runner: RunnerSession::new(workspace, true, offer, spec.limits),
            executor,
            claim,
            held,
            owned_workspace,
            relay: None,
            closed: false,
        };
        session.pod.exec.name = match held {
            Held::Claim => wait_bound(&session.executor, &session.claim).await?,
            Held::Sandbox => wait_ready(&session.executor, &session.claim).await?,
        };
        session.runner.start(&mut session.pod).await?;
        if let Some(egress) = &spec.egress {
            let stop = CancellationToken::new();
            session.relay = Some(stop.clone());
            let (output, input) = session
                .pod
                .exec
                .relay(tandem_executor_runner::relay::egress_argv(
                    tandem_executor::EGRESS_PORT,
                ))
                .await?;
            tandem_executor_runner::relay::carry_egress(
                output,
                input,
                egress.socket.clone(),
                egress.ca_bundle.as_deref(),
                stop,
            )
            .await?;
        }
        Ok(session)
    }

    async fn shutdown(&mut self) -> Result<(), ExecError> {
        if let Some(relay) = self.relay.take() {
            relay.cancel();
        }
        self.runner.take_conn();
        self.pod.process = None;
        let deleted = self.executor.delete_held(self.held, &self.claim).await;
        // Only now: a close dropped mid-delete leaves the drop to delete the claim.
        self.closed = true;
        if let Some(ws) = self.owned_workspace.take() {
            scratch::remove_dirs(vec![ws], self.executor.inner.root.clone()).await?;
        }
        deleted.map_err(ExecError::from)
    }
}

/// A claim's making under way on a task of the executor's own, so that the server's answer
/// is always heard: until [`Making::take`] hands the answer over, dropping this (its open was
/// cancelled) deletes the claim once it is made, or may have been.
struct Making {
    executor: KubernetesExecutor,
    held: Held,
    claim: String,
    task: Option<tokio::task::JoinHandle<Result<(), KubernetesError>>>,
}

impl Making {
    /// Starts `create`, unless the executor is shutting down.
    async fn start(
        executor: &KubernetesExecutor,
        held: Held,
        claim: &str,
        create: impl std::future::Future<Output = Result<(), KubernetesError>> + Send + 'static,
    ) -> Result<Self, ExecError> {
        match executor.making(create).await {
            Some(task) => Ok(Self {
                executor: executor.clone(),
                held,
                claim: claim.to_owned(),
                task: Some(task),
            }),
            None => Err(ExecError::Unavailable {
                what: format!("the Kubernetes cluster at {}", executor.inner.url),
                hint: "Tandem is shutting down and opens no new sandboxes; try again on the next daemon".to_owned(),
            }),
        }
    }

    /// The server's answer; from then on the claim is the caller's to delete.
    async fn take(mut self) -> Result<Result<(), KubernetesError>, ExecError> {
        let Some(task) = self.task.as_mut() else {
            return Err(ExecError::Backend("the claim was taken twice".to_owned()));
        };
        let answer = task.await;
        self.task = None;
        answer.map_err(|e| ExecError::Backend(format!("making the SandboxClaim stopped: {e}")))
    }
}

impl Drop for Making {
    fn drop(&mut self) {
        let Some(task) = self.task.take() else {
            return;
        };
        let (executor, held, claim) = (self.executor.clone(), self.held, self.claim.clone());
        // Without a runtime the task is gone too; shutdown's sweep or the next Tandem reaps.
        if let Ok(rt) = tokio::runtime::Handle::try_current() {
            rt.spawn(async move {
                match task.await {
                    Ok(Ok(())) | Ok(Err(KubernetesError::Unreachable { .. })) => {
                        let _ = executor.delete_held(held, &claim).await;
                    }
                    _ => {}
                }
            });
        }
    }
}

/// Execs in the session's pod; owned, so that copies can run while the session is borrowed.
#[derive(Clone)]
struct PodExec {
    executor: KubernetesExecutor,
    name: String,
}

impl Transport for PodRunner {
    fn name(&self) -> &str {
        &self.exec.name
    }

    fn start(&mut self) -> BoxFuture<'_, Result<Conn, ExecError>> {
        Box::pin(async move {
            let (conn, process) = self.exec.start().await?;
            self.process = Some(process);
            Ok(conn)
        })
    }

    /// Ends the runner's exec; the next block starts another in the same pod.
    fn stop(&mut self) -> BoxFuture<'_, Result<(), ExecError>> {
        self.process = None;
        Box::pin(async { Ok(()) })
    }

    fn unpack(&mut self, archive: std::fs::File) -> BoxFuture<'_, Result<(), ExecError>> {
        Box::pin(async move {
            let (code, errors) = self
                .exec
                .exec_io(
                    &["tar", "-x", "-f", "-", "-C", "/workspace"],
                    Some(archive),
                    None,
                )
                .await?;
            if code != 0 {
                return Err(ExecError::Backend(format!(
                    "copying files into pod `{}` failed (tar exited {code}): {errors}",
                    self.exec.name
                )));
            }
            Ok(())
        })
    }

    fn fetcher(&self) -> Box<dyn mirror::Fetch> {
        Box::new(PodArchives(self.exec.clone()))
    }
}

/// A pod's ports, reached by a relay exec'd in it for each connection.
struct PodPorts(PodExec);

impl tandem_executor::Ports for PodPorts {
    fn dial(
        &self,
        port: u16,
    ) -> BoxFuture<'_, Result<Box<dyn tandem_executor::Duplex>, ExecError>> {
        Box::pin(tandem_executor_runner::relay::dial(
            self.0.relay(tandem_executor_runner::relay::port_argv(port)),
            port,
        ))
    }

    fn listening(&self) -> BoxFuture<'_, Result<Vec<u16>, ExecError>> {
        Box::pin(async move {
            // The pod runs as one user, Tandem's relays too: the egress relay's port is the
            // one left out.
            let mut ports = tandem_executor_runner::relay::listening(
                self.0.relay(tandem_executor_runner::relay::tables_argv()),
                None,
            )
            .await?;
            ports.retain(|p| *p != tandem_executor::EGRESS_PORT);
            Ok(ports)
        })
    }
}

impl PodExec {
    /// Execs `argv` in the pod: its stdout and stdin. Its stderr is read and dropped (a
    /// reader that stops would stall stdout, which shares the stream), and the exec is held
    /// until it ends.
    async fn relay(
        &self,
        argv: Vec<String>,
    ) -> Result<
        (
            tandem_executor_runner::relay::Output,
            tandem_executor_runner::relay::Input,
        ),
        ExecError,
    > {
        let mut process = self
            .executor
            .request(
                "starting a relay in the pod (exec)",
                self.pods()
                    .exec(&self.name, argv, &self.attach_params(true)),
            )
            .await
            .map_err(|e| self.lost(e))?;
        let (Some(stdin), Some(stdout), stderr) =
            (process.stdin(), process.stdout(), process.stderr())
        else {
            return Err(ExecError::Backend(
                "the pod exec gave no stdin or stdout".to_owned(),
            ));
        };
        tokio::spawn(async move {
            if let Some(mut stderr) = stderr {
                let _ = tokio::io::copy(&mut stderr, &mut tokio::io::sink()).await;
            }
            let _ = process.join().await;
        });
        Ok((Box::new(stdout), Box::new(stdin)))
    }

    /// Execs the runner in the pod and waits for it to say it is ready: its connection,
    /// and the exec that carries it.
    async fn start(&self) -> Result<(Conn, AttachedProcess), ExecError> {
        let user = self.executor.inner.config.user.as_str();
        let argv = [
            "python3",
            "-I",
            "-c",
            tandem_executor_runner::BOOT,
            user,
            "volume",
        ];
        let mut process = self
            .executor
            .request(
                "starting Tandem's runner in the pod (exec)",
                self.pods()
                    .exec(&self.name, argv, &self.attach_params(true)),
            )
            .await
            .map_err(|e| self.lost(e))?;
        let (Some(mut stdin), Some(stdout), Some(stderr)) =
            (process.stdin(), process.stdout(), process.stderr())
        else {
            return Err(ExecError::Backend(
                "the pod exec gave no stdin, stdout or stderr".to_owned(),
            ));
        };
        stdin
            .write_all(&tandem_executor_runner::boot_payload())
            .await
            .map_err(|e| ExecError::io("sending the runner to the pod", e))?;
        let (mut conn, reader) = Conn::new(Box::pin(stdin));
        tokio::spawn(read_frames(stdout, stderr, reader));
        match conn.ready().await {
            Ok(Ok(())) => Ok((conn, process)),
            Ok(Err(other)) => Err(ExecError::Unavailable {
                what: format!("Tandem's runner in pod `{}`", self.name),
                hint: format!(
                    "it did not start ({}); the sandbox template's image needs python3 on its PATH",
                    match other {
                        Some(Frame::Error(e)) => e,
                        Some(f) => format!("unexpected {f:?}"),
                        None => "the exec ended".to_owned(),
                    }
                ),
            }),
            Err(_) => Err(ExecError::Backend(format!(
                "Tandem's runner in pod `{}` did not get ready within {:?}",
                self.name,
                tandem_executor_runner::READY_LIMIT
            ))),
        }
    }

    fn pods(&self) -> Api<Pod> {
        Api::namespaced(
            self.executor.inner.client.clone(),
            &self.executor.inner.config.namespace,
        )
    }

    fn attach_params(&self, stdin: bool) -> AttachParams {
        let mut params = AttachParams::default()
            .stdin(stdin)
            .stdout(true)
            .stderr(true);
        if let Some(container) = &self.executor.inner.config.container {
            params = params.container(container.as_str());
        }
        params.max_stdin_buf_size = Some(EXEC_BUFFER);
        params.max_stdout_buf_size = Some(EXEC_BUFFER);
        params.max_stderr_buf_size = Some(EXEC_BUFFER);
        params
    }

    /// An API failure while the session runs: the pod is lost when the API server is gone
    /// or the claim is; otherwise the failure as it is.
    fn lost(&self, e: KubernetesError) -> ExecError {
        match e {
            KubernetesError::Unreachable { reason, .. } => ExecError::Lost {
                host: self.executor.inner.config.label(),
                reason,
            },
            KubernetesError::Api { reason, .. } if reason.contains("NotFound") => ExecError::Lost {
                host: self.executor.inner.config.label(),
                reason: format!("pod `{}` is gone: {reason}", self.name),
            },
            e => e.into(),
        }
    }

    /// Runs `argv` in the pod with `input` on its stdin and its stdout into `output`;
    /// returns its exit code and the start of its stderr.
    async fn exec_io(
        &self,
        argv: &[&str],
        input: Option<std::fs::File>,
        output: Option<(&mut tokio::fs::File, u64)>,
    ) -> Result<(i32, String), ExecError> {
        let mut process = self
            .executor
            .request(
                "running a command in the pod (exec)",
                self.pods().exec(
                    &self.name,
                    argv.to_vec(),
                    &self.attach_params(input.is_some()),
                ),
            )
            .await
            .map_err(|e| self.lost(e))?;
        let status = process.take_status();
        let (stdin, stdout, stderr) = (process.stdin(), process.stdout(), process.stderr());
        let io = |e| ExecError::io("copying files through the pod exec", e);
        // Fed on its own: a command that exits before reading all its input (a failing
        // `tar -x`) must not leave the copy waiting on a stream nobody reads.
        let feeder = tokio::spawn(async move {
            if let (Some(mut stdin), Some(input)) = (stdin, input) {
                let mut input = tokio::fs::File::from_std(input);
                tokio::io::copy(&mut input, &mut stdin).await?;
                stdin.shutdown().await?;
            }
            Ok::<_, std::io::Error>(())
        });
        let drain = async {
            if let Some(mut stdout) = stdout {
                match output {
                    Some((out, max)) => {
                        let copied =
                            tokio::io::copy(&mut (&mut stdout).take(max.saturating_add(1)), out)
                                .await?;
                        if copied > max {
                            return Err(std::io::Error::new(
                                std::io::ErrorKind::FileTooLarge,
                                format!("over {max} bytes"),
                            ));
                        }
                    }
                    None => {
                        tokio::io::copy(&mut stdout, &mut tokio::io::sink()).await?;
                    }
                }
            }
            Ok::<_, std::io::Error>(())
        };
        // The start is kept for the message; the rest is read and dropped, since a reader that
        // stops would stall the exec's stdout with it.
        let errors = async {
            let mut text = Vec::new();
            if let Some(mut stderr) = stderr {
                (&mut stderr).take(4096).read_to_end(&mut text).await?;
                tokio::io::copy(&mut stderr, &mut tokio::io::sink()).await?;
            }
            Ok::<_, std::io::Error>(String::from_utf8_lossy(&text).trim().to_owned())
        };
        // Whichever fails first ends the copy: an output over its bound is not read further
        // (dropping the exec stops the command that writes it).
        let waited = tokio::time::timeout(Duration::from_secs(300), async {
            tokio::try_join!(drain, errors)
        })
        .await;
        let (drained, errors) = match waited {
            Ok(Ok(((), errors))) => (Ok(()), Ok(errors)),
            Ok(Err(e)) => (Err(e), Ok(String::new())),
            Err(_) => {
                feeder.abort();
                return Err(ExecError::Backend(
                    "a copy through the pod exec took over 300 s".to_owned(),
                ));
            }
        };
        let fed = if feeder.is_finished() {
            feeder
                .await
                .map_err(|e| ExecError::Backend(format!("feeding the pod exec stopped: {e}")))?
        } else {
            // The command is over and never read the rest; its status says how it ended.
            feeder.abort();
            Ok(())
        };
        drained.map_err(io)?;
        let errors = errors.map_err(io)?;
        if let Err(e) = fed {
            tracing::debug!(error = %e, "the pod exec stopped reading its input");
        }
        let status = match status {
            Some(status) => tokio::time::timeout(Duration::from_secs(30), status)
                .await
                .ok()
                .flatten(),
            None => None,
        };
        Ok((exit_code(status.as_ref()), errors))
    }
}

/// Waits for the claim to be bound to a ready sandbox; returns the sandbox's pod.
async fn wait_bound(executor: &KubernetesExecutor, claim_name: &str) -> Result<String, ExecError> {
    let config = &executor.inner.config;
    let claims = executor.claims();
    let deadline = Instant::now() + config.ready_timeout;
    let mut poll = POLL_FIRST;
    let sandbox = loop {
        let claim = executor
            .request("reading the SandboxClaim", claims.get_opt(claim_name))
            .await?;
        let Some(claim) = claim else {
            return Err(ExecError::Backend(format!(
                "the SandboxClaim `{}` was deleted before it got a sandbox",
                claim_name
            )));
        };
        if let Some(name) = bound_sandbox(&claim) {
            break name;
        }
        if Instant::now() > deadline {
            // A pool that is not there is the likeliest reason; say so when it is.
            executor.check().await?;
            return Err(ExecError::Backend(format!(
                "the SandboxClaim `{}` got no ready sandbox from warm pool `{}` within {:?}; see `kubectl describe sandboxclaim {} -n {}`",
                claim_name, config.warm_pool, config.ready_timeout, claim_name, config.namespace
            )));
        }
        tokio::time::sleep(poll).await;
        poll = (poll * 2).min(POLL_MOST);
    };
    let sandboxes: Api<DynamicObject> = Api::namespaced_with(
        executor.inner.client.clone(),
        &config.namespace,
        &sandboxes_resource(),
    );
    let found = executor
        .request("reading the Sandbox", sandboxes.get_opt(&sandbox))
        .await?;
    let pod = found
        .and_then(|s| s.metadata.annotations)
        .and_then(|a| a.get(POD_NAME_ANNOTATION).cloned())
        .unwrap_or(sandbox);
    tracing::debug!(claim = %claim_name, %pod, "claim bound");
    Ok(pod)
}

/// Waits for a sandbox Tandem made to be ready; returns its pod.
async fn wait_ready(executor: &KubernetesExecutor, name: &str) -> Result<String, ExecError> {
    let config = &executor.inner.config;
    let sandboxes = executor.held_api(Held::Sandbox);
    let deadline = Instant::now() + config.ready_timeout;
    let mut poll = POLL_FIRST;
    loop {
        let Some(sandbox) = executor
            .request("reading the Sandbox", sandboxes.get_opt(name))
            .await?
        else {
            return Err(ExecError::Backend(format!(
                "the Sandbox `{name}` was deleted before it was ready"
            )));
        };
        if ready(&sandbox) {
            let pod = sandbox
                .metadata
                .annotations
                .and_then(|a| a.get(POD_NAME_ANNOTATION).cloned())
                .unwrap_or_else(|| name.to_owned());
            tracing::debug!(sandbox = %name, %pod, "sandbox ready");
            return Ok(pod);
        }
        if Instant::now() > deadline {
            let why = condition_message(&sandbox).unwrap_or_default();
            return Err(ExecError::Backend(format!(
                "the Sandbox `{name}` (a session with volumes) was not ready within {:?}{why}; a volume's PersistentVolumeClaim may be unbound: see `kubectl describe sandbox {name} -n {}` and `kubectl get pvc -n {}`",
                config.ready_timeout, config.namespace, config.namespace
            )));
        }
        tokio::time::sleep(poll).await;
        poll = (poll * 2).min(POLL_MOST);
    }
}

/// Whether an object's status has its `Ready` condition true.
fn ready(object: &DynamicObject) -> bool {
    object.data["status"]["conditions"]
        .as_array()
        .into_iter()
        .flatten()
        .any(|c| c["type"] == "Ready" && c["status"] == "True")
}

/// `: ` and what the `Ready` condition says, when it says something.
fn condition_message(object: &DynamicObject) -> Option<String> {
    object.data["status"]["conditions"]
        .as_array()?
        .iter()
        .find(|c| c["type"] == "Ready")
        .and_then(|c| c["message"].as_str())
        .filter(|m| !m.is_empty())
        .map(|m| format!(" ({m})"))
}

/// Copies paths out of the pod with `tar` over exec.
struct PodArchives(PodExec);

impl mirror::Fetch for PodArchives {
    fn fetch(
        &mut self,
        path: String,
        max_bytes: u64,
    ) -> BoxFuture<'_, Result<Option<std::fs::File>, ExecError>> {
        Box::pin(async move {
            use tokio::io::AsyncSeekExt;
            let io = |e| ExecError::io("copying the workspace out", e);
            let (dir, name) = match path.rsplit_once('/') {
                Some(("", name)) => ("/", name),
                Some((dir, name)) => (dir, name),
                None => ("/", path.as_str()),
            };
            let mut out = tokio::fs::File::from_std(tempfile::tempfile().map_err(io)?);
            // Exit 3: the path is gone, which is not a failure.
            let script = "cd \"$1\" 2>/dev/null && [ -e \"$2\" -o -L \"$2\" ] || exit 3; exec tar -c -f - -- \"$2\"";
            let copied = self
                .0
                .exec_io(
                    &["sh", "-c", script, "sh", dir, name],
                    None,
                    Some((&mut out, max_bytes)),
                )
                .await;
            let (code, errors) = match copied {
                Err(ExecError::Io { source, .. })
                    if source.kind() == std::io::ErrorKind::FileTooLarge =>
                {
                    return Err(mirror::over_max(&path, max_bytes));
                }
                other => other?,
            };
            match code {
                0 => {}
                3 => return Ok(None),
                _ => {
                    return Err(ExecError::Backend(format!(
                        "copying `{path}` out of pod `{}` failed (tar exited {code}): {errors}",
                        self.0.name
                    )));
                }
            }
            out.flush().await.map_err(io)?;
            out.rewind().await.map_err(io)?;
            Ok(Some(out.into_std().await))
        })
    }
}

impl Session for KubeSession {
    fn run(
        &mut self,
        req: ExecRequest,
        ctx: ExecContext,
    ) -> BoxFuture<'_, Result<ExecOutcome, ExecError>> {
        Box::pin(self.runner.run(&mut self.pod, req, ctx))
    }

    fn workspace(&self) -> Option<&Path> {
        Some(&self.runner.workspace)
    }

    fn ports(&self) -> Option<std::sync::Arc<dyn tandem_executor::Ports>> {
        Some(std::sync::Arc::new(PodPorts(self.pod.exec.clone())))
    }

    fn put_archive(
        &mut self,
        archive: &Path,
        caps: tandem_executor_kit::archive::ArchiveCaps,
    ) -> BoxFuture<'_, Result<Vec<tandem_executor_kit::archive::ArchivedFile>, ExecError>> {
        Box::pin(
            self.runner
                .put_archive(&mut self.pod, archive.to_owned(), caps),
        )
    }

    fn close(mut self: Box<Self>) -> BoxFuture<'static, Result<(), ExecError>> {
        Box::pin(async move { self.shutdown().await })
    }
}

impl Drop for KubeSession {
    fn drop(&mut self) {
        if let Some(relay) = self.relay.take() {
            relay.cancel();
        }
        if self.closed {
            return;
        }
        // Dropped without close (a cancelled task, a failed open): delete the claim in the
        // background; if the process exits first, the next Tandem reaps it.
        let (executor, held) = (self.executor.clone(), self.held);
        let claim = self.claim.clone();
        let ws = self.owned_workspace.take();
        self.runner.take_conn();
        self.pod.process = None;
        if let Ok(rt) = tokio::runtime::Handle::try_current() {
            rt.spawn(async move {
                let _ = executor.delete_held(held, &claim).await;
                drop(ws);
            });
        }
    }
}

/// The sandbox a claim is bound to, once the claim says it is ready.
fn bound_sandbox(claim: &DynamicObject) -> Option<String> {
    if !ready(claim) {
        return None;
    }
    let name = claim
        .data
        .get("status")?
        .get("sandbox")?
        .get("name")?
        .as_str()?;
    (!name.is_empty()).then(|| name.to_owned())
}

/// The exit code an exec's status reports: 0 on success, the `ExitCode` cause on a non-zero
/// exit, -1 when it says nothing usable.
fn exit_code(status: Option<&k8s_openapi::apimachinery::pkg::apis::meta::v1::Status>) -> i32 {
    let Some(status) = status else {
        return -1;
    };
    if status.status.as_deref() == Some("Success") {
        return 0;
    }
    status
        .details
        .as_ref()
        .and_then(|d| d.causes.as_ref())
        .and_then(|causes| {
            causes
                .iter()
                .find(|c| c.reason.as_deref() == Some("ExitCode"))
                .and_then(|c| c.message.as_deref()?.parse().ok())
        })
        .unwrap_or(-1)
}

/// Feeds what the exec'd runner writes to its connection.
async fn read_frames(
    mut stdout: impl tokio::io::AsyncRead + Unpin,
    mut stderr: impl tokio::io::AsyncRead + Unpin,
    mut reader: FrameReader,
) {
    let (mut out, mut err) = (vec![0u8; EXEC_BUFFER], vec![0u8; 4096]);
    let mut err_open = true;
    loop {
        tokio::select! {
            read = stdout.read(&mut out) => match read {
                Ok(0) | Err(_) => return,
                Ok(n) => if !reader.stdout(&out[..n]) { return },
            },
            read = stderr.read(&mut err), if err_open => match read {
                Ok(0) | Err(_) => err_open = false,
                Ok(n) => if !reader.stderr(&err[..n]) { return },
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::claims_resource;

    #[test]
    fn a_claim_is_bound_when_ready_with_a_sandbox() {
        let mut claim = DynamicObject::new("c", &claims_resource());
        assert_eq!(bound_sandbox(&claim), None);
        claim.data = serde_json::json!({"status": {
            "sandbox": {"name": "sb"},
            "conditions": [{"type": "Ready", "status": "False"}]
        }});
        assert_eq!(bound_sandbox(&claim), None);
        claim.data["status"]["conditions"][0]["status"] = "True".into();
        assert_eq!(bound_sandbox(&claim).as_deref(), Some("sb"));
    }
}
