//! The CLI as a client of `tandem serve`: submit, tasks, show, logs, cancel, resume, and
//! `run` through the daemon.

use std::path::PathBuf;
use std::time::Duration;

use anyhow::{Context, Result, anyhow, bail};
use futures::StreamExt;
use serde_json::Value;
use tandem_protocol::{
    ApiErrorBody, ApiErrorCode, ApiErrorDetail, Event, EventMsg, TaskRecord, TaskSpec,
};

/// `--host`, shared by the client commands.
#[derive(Debug, Default, Clone, clap::Args)]
pub struct HostFlag {
    /// Daemon to talk to: unix:///path/to.sock (or /path/to.sock) or tcp://host:port [default: the default socket]
    #[arg(long, env = "TANDEM_HOST")]
    pub host: Option<String>,
}

/// A connection to a daemon.
#[derive(Clone)]
pub struct Client {
    http: reqwest::Client,
    base: String,
    token: Option<String>,
    /// Where it looked, for messages.
    pub host: String,
}

impl Client {
    /// The picture at `href`, downloaded whole while the caller waits (a transcript is
    /// written from a synchronous callback; the download waits there, on this worker only);
    /// `None` when it cannot be had or is larger than a picture may be.
    pub fn picture(&self, href: &str) -> Option<Vec<u8>> {
        tokio::task::block_in_place(|| {
            tokio::runtime::Handle::current().block_on(async move {
                let mut resp = self.download(href).await.ok()?;
                let mut data = Vec::new();
                while let Some(chunk) = resp.chunk().await.ok()? {
                    data.extend_from_slice(&chunk);
                    if data.len() as u64 > crate::picture::MAX_BYTES {
                        return None;
                    }
                }
                Some(data)
            })
        })
    }

    /// The daemon named by `--host` (or `TANDEM_HOST`), or the default socket.
    pub fn new(flag: &HostFlag) -> Result<Self> {
        let host = flag
            .host
            .clone()
            .filter(|h| !h.is_empty())
            .unwrap_or_else(|| {
                let state = crate::serve::default_state_dir();
                format!("unix://{}", crate::serve::default_socket(&state).display())
            });
        // A socket's path is what people type; it means the same as unix://PATH.
        let host = if host.starts_with('/') {
            format!("unix://{host}")
        } else {
            host
        };
        let builder = reqwest::Client::builder().connect_timeout(Duration::from_secs(5));
        if let Some(path) = host.strip_prefix("unix://") {
            let http = builder
                .unix_socket(PathBuf::from(path))
                .build()
                .context("cannot build the HTTP client")?;
            Ok(Self {
                http,
                base: "http://tandem".to_owned(),
                token: None,
                host,
            })
        } else if let Some(addr) = host.strip_prefix("tcp://") {
            let http = builder.build().context("cannot build the HTTP client")?;
            let token = crate::serve::token(&crate::serve::default_state_dir(), None)?;
            Ok(Self {
                http,
                base: format!("http://{addr}"),
                token,
                host,
            })
        } else {
            bail!("--host `{host}` is neither unix:///path (or /path) nor tcp://host:port")
        }
    }

    fn request(&self, method: reqwest::Method, path: &str) -> reqwest::RequestBuilder {
        let req = self.http.request(method, format!("{}{path}", self.base));
        match &self.token {
            Some(t) => req.bearer_auth(t),
            None => req,
        }
    }

    fn unreachable(&self, e: &reqwest::Error) -> anyhow::Error {
        anyhow!(
            "no Tandem daemon answers at {} ({}); start one with `tandem serve`, or point --host / TANDEM_HOST at a running one",
            self.host,
            root_cause(e)
        )
    }

    /// Whether a daemon answers, within a short time.
    pub async fn reachable(&self) -> bool {
        let req = self
            .request(reqwest::Method::GET, "/healthz")
            .timeout(Duration::from_secs(2));
        matches!(req.send().await, Ok(r) if r.status().is_success())
    }

    /// Sends a request and returns the JSON answer, or the API's error ([`Refused`]).
    async fn call(
        &self,
        method: reqwest::Method,
        path: &str,
        body: Option<&Value>,
    ) -> Result<Value> {
        let mut req = self.request(method, path);
        if let Some(body) = body {
            req = req.json(body);
        }
        let resp = req.send().await.map_err(|e| self.unreachable(&e))?;
        self.answer(resp).await
    }

    /// Sends the tar archive at `archive` to `POST /v1/uploads`; what the daemon kept.
    pub async fn upload(
        &self,
        archive: &std::path::Path,
    ) -> Result<tandem_protocol::files::Upload> {
        let file = tokio::fs::File::open(archive)
            .await
            .with_context(|| format!("cannot read {}", archive.display()))?;
        let body =
            reqwest::Body::wrap_stream(tokio_util::io::ReaderStream::with_capacity(file, 1 << 20));
        let resp = self
            .request(reqwest::Method::POST, "/v1/uploads")
            .header(reqwest::header::CONTENT_TYPE, "application/x-tar")
            .body(body)
            .send()
            .await
            .map_err(|e| self.unreachable(&e))?;
        let value = self.answer(resp).await?;
        typed(value, "an upload")
    }

    /// `GET path` as a byte stream, for files; an error answer is the API's error.
    pub async fn download(&self, path: &str) -> Result<reqwest::Response> {
        let resp = self
            .request(reqwest::Method::GET, path)
            .send()
            .await
            .map_err(|e| self.unreachable(&e))?;
        if resp.status().is_success() {
            return Ok(resp);
        }
        self.answer(resp)
            .await
            .and_then(|_| Err(anyhow!("the daemon answered with no file")))
    }

    /// The JSON of a successful answer, or the API's error ([`Refused`]).
    async fn answer(&self, resp: reqwest::Response) -> Result<Value> {
        let status = resp.status();
        let value: Value = resp
            .json()
            .await
            .with_context(|| format!("the daemon at {} sent a bad answer", self.host))?;
        if status.is_success() {
            return Ok(value);
        }
        Err(match refusal(value) {
            Some(error) => Refused {
                code: error.code,
                message: error.message,
            },
            None => Refused {
                code: ApiErrorCode::Other,
                message: format!("the daemon answered {status}"),
            },
        }
        .into())
    }

    /// `GET path` as JSON.
    pub async fn get(&self, path: &str) -> Result<Value> {
        self.call(reqwest::Method::GET, path, None).await
    }

    /// `DELETE path`, as JSON.
    pub async fn delete(&self, path: &str) -> Result<Value> {
        self.call(reqwest::Method::DELETE, path, None).await
    }

    /// `POST path` with no body, as JSON.
    pub async fn post(&self, path: &str) -> Result<Value> {
        self.call(reqwest::Method::POST, path, None).await
    }

    /// `POST path` with a JSON body, as JSON.
    pub async fn post_json(&self, path: &str, body: &Value) -> Result<Value> {
        self.call(reqwest::Method::POST, path, Some(body)).await
    }

    /// Queues a task; returns its id.
    pub async fn submit(&self, spec: &TaskSpec) -> Result<String> {
        let body = serde_json::to_value(spec)?;
        let task = self
            .call(reqwest::Method::POST, "/v1/tasks", Some(&body))
            .await?;
        let task: TaskRecord = typed(task, "a task")?;
        Ok(task.id)
    }

    /// Asks the daemon to cancel a task.
    pub async fn cancel(&self, id: &str) -> Result<Value> {
        self.call(
            reqwest::Method::POST,
            &format!("/v1/tasks/{id}/cancel"),
            None,
        )
        .await
    }

    /// Streams a task's events after `after` to `on_event` until the task ends (or, without
    /// `follow`, until the stored ones are out), reconnecting with `Last-Event-ID` when the
    /// connection breaks. Returns the last event.
    pub async fn events(
        &self,
        id: &str,
        mut after: u64,
        follow: bool,
        on_event: &mut dyn FnMut(&Event),
    ) -> Result<Option<Event>> {
        let mut last: Option<Event> = None;
        let mut failures = 0u32;
        loop {
            let path = format!(
                "/v1/tasks/{id}/events{}",
                if follow { "" } else { "?follow=false" }
            );
            let resp = self
                .request(reqwest::Method::GET, &path)
                .header("Last-Event-ID", after.to_string())
                .send()
                .await;
            let resp = match resp {
                Ok(r) if r.status().is_success() => r,
                Ok(r) => {
                    let status = r.status();
                    let value: Value = r.json().await.unwrap_or_default();
                    bail!(
                        "{}",
                        refusal(value)
                            .map_or_else(|| format!("the daemon answered {status}"), |e| e.message)
                    );
                }
                Err(e) if failures < 10 && last.is_some() => {
                    failures += 1;
                    tracing::debug!(error = %e, "reconnecting to the event stream");
                    tokio::time::sleep(Duration::from_millis(200 * u64::from(failures))).await;
                    continue;
                }
                Err(e) => return Err(self.unreachable(&e)),
            };
            // eventsource-stream decodes whole frames, so a character split across two reads
            // arrives whole, and keep-alive comments never surface.
            let mut frames = events_of(resp.bytes_stream());
            let mut broke = false;
            while let Some(frame) = frames.next().await {
                let event = match frame {
                    Ok(Some(event)) => event,
                    Ok(None) => continue,
                    Err(StreamBroke) => {
                        broke = true;
                        break;
                    }
                };
                let event = event?;
                after = event.seq;
                failures = 0;
                on_event(&event);
                let done = matches!(event.msg, EventMsg::TaskFinished { .. });
                last = Some(event);
                if done {
                    return Ok(last);
                }
            }
            if !follow || (!broke && last.is_none()) {
                return Ok(last);
            }
            // The stream ended before the task did: the connection broke, or the daemon
            // restarted. Pick up after the last event seen.
            failures += 1;
            if failures > 10 {
                bail!(
                    "lost the event stream of task {id} at {} and could not reconnect",
                    self.host
                );
            }
            tokio::time::sleep(Duration::from_millis(200 * u64::from(failures))).await;
        }
    }
}

fn root_cause(e: &(dyn std::error::Error + 'static)) -> String {
    let mut cause: &dyn std::error::Error = e;
    while let Some(next) = cause.source() {
        cause = next;
    }
    cause.to_string()
}

/// An error answer from the daemon: its code and message.
#[derive(Debug)]
pub struct Refused {
    pub code: ApiErrorCode,
    pub message: String,
}

/// A daemon's answer as the wire type it is (`what` names it in the error).
pub fn typed<T: serde::de::DeserializeOwned>(value: Value, what: &str) -> Result<T> {
    serde_json::from_value(value)
        .with_context(|| format!("the daemon sent {what} this tandem cannot read"))
}

/// What an error answer says, when it is one.
fn refusal(value: Value) -> Option<ApiErrorDetail> {
    serde_json::from_value::<ApiErrorBody>(value)
        .ok()
        .map(|b| b.error)
}

impl std::fmt::Display for Refused {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.message)
    }
}

impl std::error::Error for Refused {}

/// The connection under an event stream broke (the daemon went away or restarted).
#[derive(Debug)]
struct StreamBroke;

/// The protocol events of an SSE body: `Ok(None)` for a frame with no data, `Err` when the
/// connection broke.
fn events_of<S, B, E>(
    body: S,
) -> impl futures::Stream<Item = std::result::Result<Option<Result<Event>>, StreamBroke>>
where
    S: futures::Stream<Item = std::result::Result<B, E>>,
    B: AsRef<[u8]>,
{
    use eventsource_stream::Eventsource;
    body.eventsource().map(|frame| match frame {
        Err(_) => Err(StreamBroke),
        Ok(frame) if frame.data.is_empty() => Ok(None),
        Ok(frame) => Ok(Some(
            serde_json::from_str::<Event>(&frame.data)
                .with_context(|| format!("the daemon sent a bad event: {}", frame.data)),
        )),
    })
}

#[cfg(test)]
mod tests {
    use futures::StreamExt;

    use super::*;

    #[tokio::test]
    async fn a_character_split_across_reads_arrives_whole() {
        let frame = "id: 1\nevent: exec_output\ndata: {\"seq\":1,\"at_ms\":0,\"type\":\"exec_output\",\"turn\":1,\"index\":1,\"stream\":\"stdout\",\"text\":\"café\"}\n\n: keep-alive\n\n";
        let bytes = frame.as_bytes();
        // Cut inside the two bytes of `é`.
        let cut = frame.find('é').unwrap() + 1;
        let chunks = vec![
            Ok::<_, std::io::Error>(bytes[..cut].to_vec()),
            Ok(bytes[cut..].to_vec()),
        ];
        let events: Vec<_> = events_of(futures::stream::iter(chunks)).collect().await;
        assert_eq!(events.len(), 1, "{events:?}");
        let Ok(Some(Ok(event))) = &events[0] else {
            panic!("{events:?}");
        };
        assert!(
            matches!(&event.msg, EventMsg::ExecOutput { text, .. } if text == "café"),
            "{event:?}"
        );
    }
}
