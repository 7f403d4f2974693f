//! `run_task`: a whole task on the daemon, its events sent as progress, its answer and what it made returned.

use super::files::{MADE_NAMED, MAX_PICTURES, file_uri, image_of, packed};
use super::*;
use tandem_protocol::mcp::{FileRef, PictureRef, RunTaskResult, ToolCallRef};

/// What following a task to its end gathered.
struct Followed {
    /// Its last event.
    finished: EventMsg,
    /// The pictures its blocks drew, in order: path, media type, size.
    drawn: Vec<(String, String, u64)>,
    /// The tools it called, in order.
    called: Vec<ToolCallRef>,
}

impl TandemMcp {
    pub(super) async fn run_task(
        &self,
        args: RunTaskArgs,
        context: &RequestContext<RoleServer>,
    ) -> Result<CallToolResult, ErrorData> {
        let mut spec = self.spec_of(args).await?;
        // The caller's span: the request's `_meta.traceparent` (SEP-414), else the HTTP
        // request's header.
        let from_meta = context
            .meta
            .get_traceparent()
            .and_then(tandem_agent::trace::caller);
        let from_header = || {
            context
                .extensions
                .get::<axum::http::request::Parts>()
                .and_then(|parts| crate::api::traceparent(&parts.headers))
        };
        if let Some(parent) = from_meta.or_else(from_header) {
            spec.traceparent = Some(parent);
        }
        // Subscribed before the task exists, so that none of its events is missed.
        let live = self.supervisor.subscribe();
        let record = self.supervisor.submit(spec).await.map_err(|e| match e {
            TaskError::Invalid(_) | TaskError::NotAllowed(_) | TaskError::Unavailable(_) => {
                ErrorData::invalid_params(e.to_string(), None)
            }
            other => ErrorData::internal_error(other.to_string(), None),
        })?;
        let followed = self.follow(&record.id, live, context).await?;
        self.result_of(&record.id, followed).await
    }

    /// The task `args` ask for, its files received.
    async fn spec_of(&self, args: RunTaskArgs) -> Result<TaskSpec, ErrorData> {
        let mut spec = TaskSpec {
            task: args.task,
            executor: args.executor,
            max_turns: args.max_turns,
            max_input_tokens: args.max_input_tokens,
            max_output_tokens: args.max_output_tokens,
            max_cost: args.max_cost,
            output_schema: args.output_schema,
            keep_state: args.keep_state.unwrap_or(false),
            placement: args.placement.unwrap_or_default(),
            candidates: args.candidates,
            network: args
                .network
                .map(|n| tandem_protocol::net::NetworkRequest { allow: n.allow }),
            volumes: args
                .volumes
                .unwrap_or_default()
                .into_iter()
                .map(super::VolumeArg::mount)
                .collect(),
            code_via: args
                .code_via
                .as_deref()
                .map(str::parse)
                .transpose()
                .map_err(|e: String| ErrorData::invalid_params(e, None))?,
            tools: args
                .tools
                .map(|tools| {
                    tools
                        .into_iter()
                        .map(serde_json::from_value)
                        .collect::<Result<Vec<tandem_protocol::ToolRef>, _>>()
                })
                .transpose()
                .map_err(|e| {
                    ErrorData::invalid_params(
                        format!("tools: each is a tool's name or {{name, command, ...}} (docs/tools.md): {e}"),
                        None,
                    )
                })?,
            ..TaskSpec::default()
        };
        if let Some(files) = args.files.as_deref().filter(|f| !f.is_empty()) {
            let files_of = self.supervisor.files();
            let archive = packed(files, files_of.upload_caps())?;
            let upload = files_of
                .receive(axum::body::Body::from(archive))
                .await
                .map_err(|e| ErrorData::invalid_params(format!("files: {e}"), None))?;
            spec.files = Some(upload.id);
        }
        if let Some(check) = args.check {
            spec.check = Some(serde_json::from_value(check).map_err(|e| {
                ErrorData::invalid_params(format!("check is not a check (docs/eval.md): {e}"), None)
            })?);
        }
        if let Some(team) = args.team {
            spec.team = Some(serde_json::from_value(team).map_err(|e| {
                ErrorData::invalid_params(format!("team is not a team (docs/teams.md): {e}"), None)
            })?);
        }
        Ok(spec)
    }

    /// Follows task `id` to its end, each event sent as progress when the client asked for
    /// it; a client that cancels the call cancels the task.
    async fn follow(
        &self,
        id: &str,
        live: tokio::sync::broadcast::Receiver<Arc<(String, tandem_protocol::Event)>>,
        context: &RequestContext<RoleServer>,
    ) -> Result<Followed, ErrorData> {
        let progress = context.meta.get_progress_token();
        let mut sent = 0u32;
        let (mut drawn, mut called) = (Vec::new(), Vec::new());
        let mut follower = Follower::new(
            self.supervisor.clone(),
            id.to_owned(),
            0,
            Some(live),
            CancellationToken::new(),
        );
        loop {
            let next = tokio::select! {
                () = context.ct.cancelled() => {
                    let _ = self.supervisor.cancel(id).await;
                    return Err(ErrorData::internal_error(format!("task {id} was cancelled by the client"), None));
                }
                next = follower.next() => next,
            };
            let Some(event) = next else {
                return Err(ErrorData::internal_error(
                    "the daemon is shutting down; the task is kept and can be resumed",
                    None,
                ));
            };
            if let Some(token) = &progress {
                sent += 1;
                let message = serde_json::to_string(&event).unwrap_or_default();
                let _ = context
                    .peer
                    .notify_progress(
                        ProgressNotificationParam::new(token.clone(), f64::from(sent))
                            .with_message(message),
                    )
                    .await;
            }
            match event.msg {
                EventMsg::Artifact {
                    file, mime, bytes, ..
                } => drawn.push((file, mime, bytes)),
                EventMsg::ToolResult {
                    name,
                    is_error,
                    duration_ms,
                    ..
                } => called.push(ToolCallRef {
                    name,
                    is_error,
                    duration_ms,
                }),
                finished @ EventMsg::TaskFinished { .. } => {
                    return Ok(Followed {
                        finished,
                        drawn,
                        called,
                    });
                }
                _ => {}
            }
        }
    }

    /// The call's result: the answer and how the task ended, in words for the client's model
    /// and as [`RunTaskResult`], with the last pictures it drew as images.
    async fn result_of(&self, id: &str, followed: Followed) -> Result<CallToolResult, ErrorData> {
        let Followed {
            finished:
                EventMsg::TaskFinished {
                    stop_reason,
                    turns,
                    error,
                    check,
                    cost,
                    budget,
                    result,
                    answer,
                    answer_from,
                    no_answer,
                    ..
                },
            drawn,
            called,
        } = followed
        else {
            return Err(ErrorData::internal_error(
                "the task ended without its last event",
                None,
            ));
        };
        let structured = RunTaskResult {
            task_id: id.to_owned(),
            stop_reason,
            turns,
            answer,
            answer_from,
            no_answer,
            check: check.map(|c| *c),
            cost,
            budget: budget.map(|b| *b),
            result: result.map(|r| *r),
            error,
            transcript: transcript_uri(id),
            pictures: drawn
                .iter()
                .map(|(path, mime, bytes)| PictureRef {
                    path: path.clone(),
                    mime: mime.clone(),
                    bytes: *bytes,
                    uri: file_uri(id, path),
                })
                .collect(),
            files: self.made(id).await,
            tool_calls: called,
        };
        let mut content = vec![ContentBlock::text(told(&structured))];
        // The last version of each picture, as the task left it.
        let mut seen = std::collections::HashSet::new();
        let last: Vec<_> = drawn
            .iter()
            .rev()
            .filter(|(path, _, _)| seen.insert(path.clone()))
            .take(MAX_PICTURES)
            .collect();
        for (path, mime, _) in last.into_iter().rev() {
            let read = self.supervisor.files().open(id, path);
            if let Ok((file, len)) = read
                && let Some(image) = image_of(file, len, mime)
            {
                content.push(image);
            }
        }
        let mut result = CallToolResult::success(content);
        result.structured_content = serde_json::to_value(&structured).ok();
        Ok(result)
    }

    /// What task `id` made stays in its workspace, as resources: the files it was not given
    /// (or changed), named so the agent can read them.
    async fn made(&self, id: &str) -> Vec<FileRef> {
        let (files_of, task) = (self.supervisor.files().clone(), id.to_owned());
        tokio::task::spawn_blocking(move || files_of.list(&task))
            .await
            .ok()
            .and_then(Result::ok)
            .map(|list| {
                list.files
                    .into_iter()
                    .filter(|f| {
                        !f.given
                            && !tandem_executor_kit::archive::is_tandems(std::path::Path::new(
                                &f.path,
                            ))
                    })
                    .map(|f| FileRef {
                        uri: file_uri(id, &f.path),
                        path: f.path,
                        bytes: f.bytes,
                    })
                    .collect()
            })
            .unwrap_or_default()
    }
}

/// The result in words, for the client's model.
fn told(r: &RunTaskResult) -> String {
    let (id, uri, turns, stop_reason) = (&r.task_id, &r.transcript, r.turns, r.stop_reason);
    let text = match (&r.answer, &r.error) {
        (_, Some(e)) => format!("task {id} failed: {}\n(transcript: {uri})", e.message),
        (Some(answer), None) => {
            let from = match r.answer_from {
                Some(tandem_protocol::AnswerFrom::Output) => {
                    "; the answer is what its code printed"
                }
                _ => "",
            };
            format!(
                "{answer}\n\n(task {id}: {} after {turns} turns{from}; transcript: {uri})",
                stop_reason.as_str()
            )
        }
        (None, None) => {
            let why = r
                .no_answer
                .as_deref()
                .map(|w| format!("; no answer: {w}"))
                .unwrap_or_default();
            format!(
                "task {id} ended: {} after {turns} turns{why} (transcript: {uri})",
                stop_reason.as_str()
            )
        }
    };
    let text = match &r.budget {
        Some(b) => format!("{text}\n({})", b.message()),
        None => text,
    };
    match r.files.len() {
        0 => text,
        n => format!(
            "{text}\n(the task made {n} file{}: {})",
            if n == 1 { "" } else { "s" },
            r.files
                .iter()
                .take(MADE_NAMED)
                .map(|f| f.uri.as_str())
                .collect::<Vec<_>>()
                .join(", ")
                + if n > MADE_NAMED { ", ..." } else { "" }
        ),
    }
}
