//! What the HTTP API asks of the pool: a session opened from its spec, and a block's run
//! as the events it sends (`/v1/sessions/{id}/exec`, `/v1/exec`): its output as it comes,
//! its tool calls for the client to answer, then its result.

use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};

use tandem_executor::{CancellationToken, ExecContext, ExecRequest, Stream};
use tandem_protocol::session::{ExecEvent, ExecSpec, SessionInfo, SessionSpec};
use tandem_protocol::{ApiErrorCode, ApiErrorDetail, OutputStream};
use tokio::sync::{mpsc, oneshot};

use super::{Claim, OpenAsk, Opened, Owner, Pool, Refusal};

/// A snapshot made ready to place in a new sandbox.
pub struct Restored {
    /// Its files, as a tar archive removed when dropped.
    pub tar: tempfile::TempPath,
    /// Whether it holds a kept interpreter's globals.
    pub keeps_state: bool,
}

/// Most tool calls of one block that wait for their client at once.
const MAX_WAITING_CALLS: usize = 64;

impl Pool {
    /// Opens a session as the API's `spec` asks, for the API's clients.
    pub async fn open_session(&self, spec: SessionSpec) -> Result<SessionInfo, Refusal> {
        let restored = match spec.from_snapshot.as_deref() {
            Some(_) if spec.files.is_some() => {
                return Err(Refusal::invalid(
                    "`files` and `from_snapshot` both fill the workspace; send one (POST /v1/sessions/ID/files adds files after)",
                ));
            }
            Some(snap) => Some(self.restored(snap).await?),
            None => None,
        };
        let files = match &restored {
            Some(r) => Some(r.tar.to_path_buf()),
            None => self.upload(spec.files.as_deref())?,
        };
        let ask = OpenAsk {
            restores_state: restored.as_ref().is_some_and(|r| r.keeps_state),
            executor: spec.executor,
            keep_state: spec.keep_state,
            tools: spec.tools.into_iter().map(|t| t.name).collect(),
            idle_timeout_secs: spec.idle_timeout_secs,
            limits: spec.limits,
            files,
            network: spec.network,
            volumes: spec.volumes,
        };
        // The archive is placed as the sandbox opens, and removed after.
        let opened = self.open(Owner::Api, None, ask).await;
        drop(restored);
        Ok(opened?.info())
    }

    /// The snapshot `snap` as a tar archive, every file checked against its hash; removed
    /// when dropped.
    pub async fn restored(&self, snap: &str) -> Result<Restored, Refusal> {
        let files = self.supervisor.files().clone();
        let snap = snap.to_owned();
        tokio::task::spawn_blocking(move || {
            let store = files.snapshots();
            let record = store.get(&snap).map_err(super::snapshot_refusal)?;
            let tar = store
                .restore_tar(&snap, &files.scratch(), None)
                .map_err(super::snapshot_refusal)?;
            Ok(Restored {
                tar,
                keeps_state: record.state_bytes > 0,
            })
        })
        .await
        .map_err(|e| {
            Refusal::new(
                ApiErrorCode::Internal,
                format!("restoring the snapshot: {e}"),
            )
        })?
    }

    /// Opens `count` sessions from the snapshot `snap` at once, each with its files: all of
    /// them, or none (those opened are closed again when one fails).
    pub async fn fork(
        &self,
        snap: &str,
        count: usize,
        executor: Option<String>,
    ) -> Result<Vec<SessionInfo>, Refusal> {
        let restored = self.restored(snap).await?;
        let opens = (0..count).map(|_| {
            let ask = OpenAsk {
                executor: executor.clone(),
                files: Some(restored.tar.to_path_buf()),
                restores_state: restored.keeps_state,
                ..OpenAsk::default()
            };
            self.open(Owner::Api, None, ask)
        });
        let opened = futures::future::join_all(opens).await;
        drop(restored);
        let mut sessions = Vec::new();
        let mut failed = None;
        for result in opened {
            match result {
                Ok(o) => sessions.push(o),
                Err(e) => failed = failed.or(Some(e)),
            }
        }
        if let Some(e) = failed {
            for o in sessions {
                let _ = self.close(Owner::Api, o.id()).await;
            }
            return Err(e);
        }
        Ok(sessions.iter().map(|o| o.info()).collect())
    }

    /// Runs one block in the API's session `id`, its events sent as they come. `streamed`:
    /// whether a client reads them as they come and so can answer tool calls.
    pub async fn exec(
        self: &Arc<Self>,
        id: &str,
        spec: ExecSpec,
        streamed: bool,
    ) -> Result<mpsc::UnboundedReceiver<ExecEvent>, Refusal> {
        if spec.executor.is_some() || spec.files.is_some() || spec.network.is_some() {
            return Err(Refusal::invalid(
                "`executor`, `files` and `network` are for POST /v1/exec; a session's were set when it was opened (POST /v1/sessions/ID/files adds files)",
            ));
        }
        let opened = self.get(Owner::Api, id)?;
        let request = self.supervisor.planner().check_block(
            &**opened.sandbox(),
            &spec.language,
            spec.code,
            spec.timeout_secs,
        )?;
        let cancel = CancellationToken::new();
        let claim = opened.claim(cancel.clone())?;
        let (tx, rx) = mpsc::unbounded_channel();
        let pool = self.clone();
        tokio::spawn(async move {
            let ended = pool
                .run(&claim, request, cancel, tx.clone(), streamed)
                .await;
            drop(claim);
            let last = match ended {
                Ok(result) => ExecEvent::Result { result },
                Err(error) => {
                    // A sandbox that broke is not run in again: it is closed, and the client
                    // told to open another.
                    let _ = pool.close(Owner::Api, opened.id()).await;
                    ExecEvent::Error { error }
                }
            };
            let _ = tx.send(last);
        });
        Ok(rx)
    }

    /// Runs one block in a sandbox of its own, opened for it and closed after: `POST /v1/exec`.
    pub async fn exec_once(
        self: &Arc<Self>,
        spec: ExecSpec,
    ) -> Result<mpsc::UnboundedReceiver<ExecEvent>, Refusal> {
        let (_, sandbox) = self
            .supervisor
            .planner()
            .block_executor(spec.executor.as_deref())?;
        let request = self.supervisor.planner().check_block(
            &*sandbox,
            &spec.language,
            spec.code,
            spec.timeout_secs,
        )?;
        let files = self.upload(spec.files.as_deref())?;
        let ask = OpenAsk {
            executor: spec.executor,
            files,
            network: spec.network,
            ..OpenAsk::default()
        };
        let opened = self.open_for_one(ask, "exec").await?;
        let cancel = CancellationToken::new();
        let claim = opened.claim(cancel.clone())?;
        let (tx, rx) = mpsc::unbounded_channel();
        let pool = self.clone();
        tokio::spawn(async move {
            let ended = pool.run(&claim, request, cancel, tx.clone(), false).await;
            drop(claim);
            opened.close().await;
            let _ = tx.send(match ended {
                Ok(result) => ExecEvent::Result { result },
                Err(error) => ExecEvent::Error { error },
            });
        });
        Ok(rx)
    }

    /// The archive of the upload `files` names, if it names one that is here.
    pub fn upload(&self, files: Option<&str>) -> Result<Option<std::path::PathBuf>, Refusal> {
        let Some(upload) = files else {
            return Ok(None);
        };
        self.supervisor
            .files()
            .upload_archive(upload)
            .map(Some)
            .ok_or_else(|| {
                Refusal::invalid(format!(
                    "`files` names no upload here: `{}`; POST a tar archive to /v1/uploads first",
                    tandem_protocol::files::shown(upload)
                ))
            })
    }

    async fn run(
        &self,
        claim: &Claim,
        request: ExecRequest,
        cancel: CancellationToken,
        tx: mpsc::UnboundedSender<ExecEvent>,
        streamed: bool,
    ) -> Result<tandem_protocol::BlockResult, ApiErrorDetail> {
        let broken = |message: String| ApiErrorDetail {
            code: ApiErrorCode::ExecutorUnavailable,
            message,
        };
        // Like a task's block, it takes one of the daemon's execution slots while it runs.
        let stop = cancel.clone();
        let _slot = tokio::select! {
            slot = self.supervisor.execution_slot(&cancel) => slot.map_err(|e| broken(e.to_string()))?,
            () = tx.closed() => { stop.cancel(); return Err(broken("the client went away".to_owned())); }
        };
        let opened = claim.opened();
        let mut guard = claim.session().await.map_err(|r| ApiErrorDetail {
            code: r.code,
            message: r.message,
        })?;
        let Some(session) = guard.as_mut() else {
            return Err(ApiErrorDetail {
                code: ApiErrorCode::NotFound,
                message: format!("session `{}` was closed; open another", opened.id()),
            });
        };
        let mut ctx = ExecContext::new(cancel.clone()).with_sink(sink(tx.clone()));
        if !opened.tools().is_empty() {
            ctx = ctx.with_tools(handler(opened, tx.clone(), streamed));
        }
        let language = request.language.clone();
        let net = opened.net_route();
        if let Some(route) = net {
            route.take_bytes();
            route.route_to(Some(tx.clone()));
        }
        let run = session.run(request, ctx);
        tokio::pin!(run);
        // A client that stops reading cancels its block: nobody would see its result.
        let outcome = tokio::select! {
            outcome = &mut run => outcome,
            () = tx.closed() => { cancel.cancel(); run.await }
        };
        let mut bytes = None;
        if let Some(route) = net {
            route.settle(std::time::Duration::from_secs(2)).await;
            route.route_to(None);
            bytes = Some(route.take_bytes());
        }
        match outcome {
            Ok(mut outcome) => {
                if let Some((bytes_in, bytes_out)) = bytes {
                    let r = outcome.resources.get_or_insert_with(Default::default);
                    r.net_bytes_in = Some(bytes_in);
                    r.net_bytes_out = Some(bytes_out);
                }
                if let Some(r) = &outcome.resources {
                    opened.add_resources(r);
                    self.supervisor.metrics.resources(opened.executor(), r);
                }
                Ok(tandem_agent::blocks::to_result(&language, outcome))
            }
            Err(e) => Err(broken(format!(
                "the sandbox failed: {e}; the session was closed, open another"
            ))),
        }
    }
}

/// The block's output as events; a character split between two pieces is sent whole with
/// the second.
fn sink(tx: mpsc::UnboundedSender<ExecEvent>) -> tandem_executor::OutputSink {
    let pending: Arc<Mutex<[Vec<u8>; 2]>> = Arc::default();
    Arc::new(move |stream: Stream, bytes: &[u8]| {
        let (which, slot) = match stream {
            Stream::Stdout => (OutputStream::Stdout, 0),
            Stream::Stderr => (OutputStream::Stderr, 1),
        };
        let Ok(mut pending) = pending.lock() else {
            return;
        };
        let buf = &mut pending[slot];
        buf.extend_from_slice(bytes);
        let whole = tandem_executor::complete_utf8(buf);
        if whole == 0 {
            return;
        }
        let text = String::from_utf8_lossy(&buf[..whole]).into_owned();
        buf.drain(..whole);
        let _ = tx.send(ExecEvent::Output {
            stream: which,
            text,
        });
    })
}

/// Answers a block's tool calls by asking the client that follows its run.
fn handler(
    opened: &Arc<Opened>,
    tx: mpsc::UnboundedSender<ExecEvent>,
    streamed: bool,
) -> tandem_executor_kit::toolchannel::ToolHandler {
    let opened = Arc::downgrade(opened);
    Arc::new(
        move |name: String,
              arguments: String|
              -> futures::future::BoxFuture<'static, Result<String, String>> {
            let opened = opened.clone();
            let tx = tx.clone();
            Box::pin(async move {
                let opened = opened.upgrade().ok_or("the session was closed")?;
                if !opened.tools().contains(&name) {
                    return Err(format!(
                        "no tool `{name}` in this session; its tools are: {}",
                        opened.tools().join(", ")
                    ));
                }
                if !streamed {
                    return Err("tool calls are answered only when the block's run is read as a stream (Accept: application/x-ndjson)".to_owned());
                }
                let arguments = serde_json::from_str(&arguments)
                    .unwrap_or(serde_json::Value::String(arguments));
                let call = format!("call_{}", opened.next_call.fetch_add(1, Ordering::Relaxed));
                let (answer, answered) = oneshot::channel();
                {
                    let mut calls = opened.calls.lock().map_err(|_| "a lock was poisoned")?;
                    if calls.len() >= MAX_WAITING_CALLS {
                        return Err(format!(
                            "{MAX_WAITING_CALLS} tool calls already wait for their answers"
                        ));
                    }
                    calls.insert(call.clone(), answer);
                }
                tx.send(ExecEvent::ToolCall {
                    call,
                    name,
                    arguments,
                })
                .map_err(|_| "the client went away".to_owned())?;
                answered
                    .await
                    .map_err(|_| "the block ended before the client answered".to_owned())?
            })
        },
    )
}
