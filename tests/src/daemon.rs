//! [`DaemonHarness`]: the real `tandem serve` on a temporary socket and state dir, talked to
//! over real HTTP. The end-to-end suites and the daemon benchmark share it.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant};

use serde_json::Value;
use tandem_protocol::{BlockResult, Event, EventMsg, TaskList, TaskView};

/// A daemon process that can be killed and started again on the same state.
pub struct DaemonHarness {
    bin: PathBuf,
    child: Option<tokio::process::Child>,
    /// A daemon killed by [`DaemonHarness::kill9`], not yet waited for: while it is a zombie
    /// its pid and start time still name it, so no other daemon takes it for dead and reaps
    /// its sandboxes before this one restarts.
    killed: Option<tokio::process::Child>,
    /// Removed by the keeper, not `TempDir`'s recursive delete: a block may have left a tree
    /// there deep enough to overflow the test's stack.
    state: tandem_executor_kit::scratch::TempTree,
    base_url: String,
    args: Vec<String>,
    env: Vec<(String, String)>,
    client: reqwest::Client,
}

impl DaemonHarness {
    /// Starts `bin serve` with the local executor (unless `args` names one), `args` added,
    /// pointed at the model server at `base_url`; `config` becomes its `tandem.toml`.
    /// Returns once it answers.
    pub async fn start(bin: &Path, base_url: &str, args: &[&str], config: Option<&str>) -> Self {
        Self::start_with_env(bin, base_url, args, config, &[]).await
    }

    /// [`DaemonHarness::start`] with these variables in the daemon's environment.
    pub async fn start_with_env(
        bin: &Path,
        base_url: &str,
        args: &[&str],
        config: Option<&str>,
        env: &[(&str, &str)],
    ) -> Self {
        let state =
            tandem_executor_kit::scratch::temp_in(&std::env::temp_dir(), "tandem-daemon-").unwrap();
        if let Some(config) = config {
            std::fs::create_dir_all(state.path().join("tandem")).unwrap();
            std::fs::write(state.path().join("tandem/tandem.toml"), config).unwrap();
        }
        let _ = rustls::crypto::ring::default_provider().install_default();
        let client = reqwest::Client::builder()
            .unix_socket(socket_in(state.path()))
            .build()
            .unwrap();
        let mut env: Vec<(String, String)> = env
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        // The daemon suite runs again with its tasks in PostgreSQL: a database of its own for
        // each daemon, kept across its restarts.
        if std::env::var("TANDEM_TEST_STORE").is_ok_and(|s| s == "postgres")
            && !env.iter().any(|(k, _)| k == "TANDEM_STORE_URL")
        {
            let url = tokio::task::spawn_blocking(|| crate::Postgres::shared().new_database())
                .await
                .unwrap();
            env.push(("TANDEM_STORE_URL".to_owned(), url));
        }
        let mut d = Self {
            bin: bin.to_owned(),
            child: None,
            killed: None,
            state,
            base_url: base_url.to_owned(),
            args: args.iter().map(|s| s.to_string()).collect(),
            env,
            client,
        };
        d.spawn().await;
        d
    }

    /// Whether its tasks are in a shared store (PostgreSQL), where a restarted daemon resumes
    /// the tasks it ran rather than leave them interrupted.
    pub fn store_is_shared(&self) -> bool {
        self.env.iter().any(|(k, _)| k == "TANDEM_STORE_URL")
    }

    /// After a restart: `tandem resume ID` when the task is interrupted (a daemon on its own
    /// store leaves it so); on a shared store the daemon has resumed it itself.
    pub async fn resume_after_restart(&self, id: &str) {
        if self.store_is_shared() {
            return;
        }
        let (code, _, err) = self.cli(&["resume", id]).await;
        assert_eq!(code, 0, "{err}");
    }

    /// The state dir (database, token, log).
    pub fn state_dir(&self) -> &Path {
        self.state.path()
    }

    /// The Unix socket.
    pub fn socket(&self) -> PathBuf {
        socket_in(self.state.path())
    }

    /// The socket as `TANDEM_HOST` names it.
    pub fn host(&self) -> String {
        format!("unix://{}", self.socket().display())
    }

    /// The daemon's pid, while it runs.
    pub fn pid(&self) -> u32 {
        self.child.as_ref().and_then(|c| c.id()).unwrap()
    }

    /// What the daemon has written to stderr, across restarts.
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.state.path().join("daemon.log")).unwrap_or_default()
    }

    /// Starts (again, after a kill) the daemon on the same state; returns once it answers.
    pub async fn spawn(&mut self) {
        // The killed daemon is waited for first, so the new one finds it dead.
        if let Some(mut killed) = self.killed.take() {
            let _ = killed.wait().await;
        }
        // A file, not a pipe: nobody has to drain it for the daemon to keep going.
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.state.path().join("daemon.log"))
            .unwrap();
        let mut cmd = tokio::process::Command::new(&self.bin);
        cmd.arg("serve")
            .arg("--socket")
            .arg(self.socket())
            .arg("--state-dir")
            .arg(self.state.path());
        if !self.args.iter().any(|a| a == "--executor") {
            cmd.args(["--executor", "local"]);
        }
        let child = cmd
            .args(&self.args)
            .env("OPENAI_BASE_URL", &self.base_url)
            .env("TANDEM_MAX_RETRIES", "0")
            .env("XDG_CONFIG_HOME", self.state.path())
            .env_remove("OPENAI_API_KEY")
            .env_remove("TANDEM_MODEL")
            .envs(self.env.iter().map(|(k, v)| (k, v)))
            .stdout(Stdio::null())
            .stderr(log)
            .kill_on_drop(true)
            .spawn()
            .unwrap();
        self.child = Some(child);
        let started = Instant::now();
        loop {
            if let Ok(v) = self.try_get("/healthz").await {
                assert_eq!(v["status"], "ok");
                return;
            }
            assert!(
                started.elapsed() < Duration::from_secs(30),
                "the daemon did not start:\n{}",
                self.log()
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// Runs this daemon's `tandem` binary as a client of it (stdin closed): `(exit code,
    /// stdout, stderr)`.
    pub async fn cli(&self, args: &[&str]) -> (i32, String, String) {
        let out = tokio::process::Command::new(&self.bin)
            .args(args)
            // What `tandem run` keeps goes to ./tandem-out: the state dir, not the source tree.
            .current_dir(self.state_dir())
            .env("TANDEM_HOST", self.host())
            .env("XDG_CONFIG_HOME", self.state_dir())
            .stdin(Stdio::null())
            .output()
            .await
            .unwrap();
        (
            out.status.code().unwrap_or(-1),
            String::from_utf8_lossy(&out.stdout).into_owned(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    }

    /// The HTTP client on the daemon's socket (URLs are `http://tandem/...`).
    pub fn http(&self) -> &reqwest::Client {
        &self.client
    }

    /// `GET path` as JSON, or the transport error.
    pub async fn try_get(&self, path: &str) -> reqwest::Result<Value> {
        self.http()
            .get(format!("http://tandem{path}"))
            .send()
            .await?
            .json()
            .await
    }

    /// `GET path` as JSON.
    pub async fn get(&self, path: &str) -> Value {
        self.try_get(path).await.unwrap()
    }

    /// `(status, body)` of a request with a raw body.
    pub async fn send(
        &self,
        method: reqwest::Method,
        path: &str,
        body: Option<String>,
    ) -> (u16, Value) {
        let mut req = self.http().request(method, format!("http://tandem{path}"));
        if let Some(body) = body {
            req = req.header("content-type", "application/json").body(body);
        }
        let resp = req.send().await.unwrap();
        let status = resp.status().as_u16();
        (status, resp.json().await.unwrap_or(Value::Null))
    }

    /// `POST /v1/sessions` with `spec`: the status and the answer.
    pub async fn open_session(&self, spec: Value) -> (u16, Value) {
        self.send(
            reqwest::Method::POST,
            "/v1/sessions",
            Some(spec.to_string()),
        )
        .await
    }

    /// Runs a Python block in session `id` and returns its result (the request answered 200).
    pub async fn exec_python(&self, id: &str, code: &str) -> Value {
        let (status, ran) = self
            .send(
                reqwest::Method::POST,
                &format!("/v1/sessions/{id}/exec"),
                Some(serde_json::json!({"language": "python", "code": code}).to_string()),
            )
            .await;
        assert_eq!(status, 200, "{ran}");
        ran
    }

    /// Queues a task; returns its id.
    pub async fn submit(&self, spec: Value) -> String {
        let (status, body) = self
            .send(reqwest::Method::POST, "/v1/tasks", Some(spec.to_string()))
            .await;
        assert_eq!(status, 201, "{body}");
        body["id"].as_str().unwrap().to_owned()
    }

    /// `GET /v1/tasks/{id}`, as the protocol's type.
    pub async fn task(&self, id: &str) -> TaskView {
        let raw = self.get(&format!("/v1/tasks/{id}")).await;
        serde_json::from_value(raw.clone())
            .unwrap_or_else(|e| panic!("task {id} is not a TaskView ({e}): {raw}"))
    }

    /// `GET path`, a listing of tasks (`/v1/tasks?...`), as the protocol's type.
    pub async fn tasks(&self, path: &str) -> TaskList {
        let raw = self.get(path).await;
        serde_json::from_value(raw.clone())
            .unwrap_or_else(|e| panic!("{path} is not a TaskList ({e}): {raw}"))
    }

    /// Polls until the task is finished; returns it.
    pub async fn wait_finished(&self, id: &str, limit: Duration) -> TaskView {
        self.wait_state(id, tandem_protocol::TaskState::Finished, limit)
            .await
    }

    /// Polls until the task is in `state`; returns it.
    pub async fn wait_state(
        &self,
        id: &str,
        state: tandem_protocol::TaskState,
        limit: Duration,
    ) -> TaskView {
        let started = Instant::now();
        loop {
            let t = self.task(id).await;
            if t.record.state == state {
                return t;
            }
            assert!(
                started.elapsed() < limit,
                "task {id} never reached {}: {t:?}\n{}",
                state.as_str(),
                self.log()
            );
            tokio::time::sleep(Duration::from_millis(30)).await;
        }
    }

    /// The task's stored events after seq `after`, as the protocol's type.
    pub async fn events(&self, id: &str, after: u64) -> Vec<Event> {
        self.raw_events(id, after)
            .await
            .into_iter()
            .map(|raw| {
                serde_json::from_value(raw.clone())
                    .unwrap_or_else(|e| panic!("not an Event ({e}): {raw}"))
            })
            .collect()
    }

    /// The task's stored events after seq `after`, as the JSON on the wire.
    pub async fn raw_events(&self, id: &str, after: u64) -> Vec<Value> {
        // The header, as browsers and `tandem logs -f` resume.
        let text = self
            .http()
            .get(format!("http://tandem/v1/tasks/{id}/events?follow=false"))
            .header("Last-Event-ID", after.to_string())
            .send()
            .await
            .unwrap()
            .text()
            .await
            .unwrap();
        text.split("\n\n")
            .filter_map(|frame| frame.lines().find_map(|l| l.strip_prefix("data: ")))
            .map(|d| serde_json::from_str(d).unwrap())
            .collect()
    }

    /// The standard output of each block task `id` ran, in order.
    pub async fn block_stdouts(&self, id: &str) -> Vec<String> {
        block_results(&self.events(id, 0).await)
            .into_iter()
            .map(|r| r.stdout.clone())
            .collect()
    }

    /// `GET path` as text.
    pub async fn text(&self, path: &str) -> String {
        self.http()
            .get(format!("http://tandem{path}"))
            .send()
            .await
            .unwrap()
            .text()
            .await
            .unwrap()
    }

    /// `tandem_tasks{state}` from `/metrics`: a cheap count.
    pub async fn count(&self, state: &str) -> u64 {
        let text = self.text("/metrics").await;
        let prefix = format!("tandem_tasks{{state=\"{state}\"}} ");
        text.lines()
            .find_map(|l| l.strip_prefix(prefix.as_str()))
            .and_then(|n| n.trim().parse().ok())
            .unwrap_or(0)
    }

    /// Resident memory of the daemon, MiB.
    pub fn rss_mib(&self) -> f64 {
        let status = std::fs::read_to_string(format!("/proc/{}/status", self.pid())).unwrap();
        let kb: f64 = status
            .lines()
            .find_map(|l| l.strip_prefix("VmRSS:"))
            .and_then(|v| v.split_whitespace().next())
            .and_then(|v| v.parse().ok())
            .unwrap();
        kb / 1024.0
    }

    /// SIGKILL: no chance to clean up.
    pub fn kill9(&mut self) {
        let pid = nix::unistd::Pid::from_raw(self.pid() as i32);
        nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGKILL).unwrap();
        self.killed = self.child.take();
    }

    /// Sends SIGTERM and returns at once; [`DaemonHarness::wait_exit`] waits for the end.
    pub fn sigterm(&self) {
        let pid = nix::unistd::Pid::from_raw(self.pid() as i32);
        nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGTERM).unwrap();
    }

    /// The exit code once the daemon stops (within 60 s).
    pub async fn wait_exit(&mut self) -> Option<i32> {
        let mut child = self.child.take().unwrap();
        tokio::time::timeout(Duration::from_secs(60), child.wait())
            .await
            .expect("the daemon did not stop within 60 s")
            .unwrap()
            .code()
    }

    /// SIGTERM, then the exit code once it stops.
    pub async fn terminate(&mut self) -> Option<i32> {
        let pid = nix::unistd::Pid::from_raw(self.pid() as i32);
        nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGTERM).unwrap();
        let mut child = self.child.take().unwrap();
        tokio::time::timeout(Duration::from_secs(60), child.wait())
            .await
            .expect("the daemon did not stop within 60 s of SIGTERM")
            .unwrap()
            .code()
    }
}

fn socket_in(state: &Path) -> PathBuf {
    state.join("run").join("tandem.sock")
}

/// The result of every block in `events`, in order.
pub fn block_results(events: &[Event]) -> Vec<&BlockResult> {
    events
        .iter()
        .filter_map(|e| match &e.msg {
            EventMsg::ExecResult { result, .. } => Some(result),
            _ => None,
        })
        .collect()
}

/// The live output text of every block in `events` (`exec_output`), in order.
pub fn block_output(events: &[Event]) -> Vec<&str> {
    events
        .iter()
        .filter_map(|e| match &e.msg {
            EventMsg::ExecOutput { text, .. } => Some(text.as_str()),
            _ => None,
        })
        .collect()
}

/// The wire name (`type`) of every event in `events`, in order.
pub fn kinds(events: &[Event]) -> Vec<String> {
    events
        .iter()
        .map(|e| {
            serde_json::to_value(&e.msg)
                .ok()
                .and_then(|v| v["type"].as_str().map(str::to_owned))
                .unwrap_or_default()
        })
        .collect()
}
