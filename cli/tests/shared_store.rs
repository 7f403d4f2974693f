//! Several daemons on one PostgreSQL store (a real server from the system packages): any
//! daemon answers for any task, a task is run by one daemon at a time, a daemon that died or
//! was paused loses its tasks to the others without a block running twice, and the database
//! going away loses nothing.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use serde_json::{Value, json};
use tandem_protocol::{Event, EventMsg, StopReason, TaskState};
use tandem_tests::daemon::block_output;
use tandem_tests::{DaemonHarness as Daemon, Postgres, Reply, Script, ScriptedOpenAi};
use tokio::io::AsyncBufReadExt as _;

const BIN: &str = env!("CARGO_BIN_EXE_tandem");

fn fence(code: &str) -> String {
    format!("```python\n{code}\n```")
}

/// Daemon `name` on store `url`, its model requests sent as `name` (so they can be held).
async fn daemon(server: &ScriptedOpenAi, name: &str, url: &str, lease: f64, extra: &str) -> Daemon {
    let config = format!(
        "[store]\ndaemon = \"{name}\"\nlease_secs = {lease}\n\n[executors.local]\nconfine = \"off\"\n{extra}"
    );
    Daemon::start_with_env(
        BIN.as_ref(),
        &server.base_url_for(name),
        &["--max-concurrent", "4"],
        Some(&config),
        &[("TANDEM_STORE_URL", url)],
    )
    .await
}

/// The tasks daemon `d` runs now, as its `/metrics` says.
async fn running_on(d: &Daemon, name: &str) -> u64 {
    let text = d.text("/metrics").await;
    let prefix = format!("tandem_daemon_tasks{{daemon=\"{name}\"}} ");
    text.lines()
        .find_map(|l| l.strip_prefix(prefix.as_str()))
        .and_then(|n| n.trim().parse().ok())
        .unwrap_or(0)
}

async fn wait_for(what: &str, limit: Duration, mut done: impl AsyncFnMut() -> bool) {
    let started = Instant::now();
    while !done().await {
        assert!(started.elapsed() < limit, "{what}: not within {limit:?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Whether every task daemon `name` runs waits on the model (its last stored event starts a
/// turn), as daemon `d` reads the store: then none of them has a block that started or is
/// about to (a block starts only once its `code_block` event is stored).
async fn all_wait_on_the_model(d: &Daemon, name: &str) -> bool {
    let running = d.get("/v1/tasks?state=running").await;
    for t in running["tasks"].as_array().unwrap() {
        let id = t["id"].as_str().unwrap();
        if d.task(id).await.daemon.as_deref() != Some(name) {
            continue;
        }
        let events = d.events(id, 0).await;
        if events
            .last()
            .is_none_or(|e| !matches!(e.msg, EventMsg::TurnStarted { .. }))
        {
            return false;
        }
    }
    true
}

/// Task `id`'s events from `d`'s SSE feed after `after`, live, until `stop` says so (or the
/// task's end).
async fn follow(d: &Daemon, id: &str, after: u64, stop: impl Fn(&Event) -> bool) -> Vec<Event> {
    let mut resp = d
        .http()
        .get(format!("http://tandem/v1/tasks/{id}/events"))
        .header("Last-Event-ID", after.to_string())
        .send()
        .await
        .unwrap();
    let (mut buf, mut out) = (String::new(), Vec::new());
    loop {
        let chunk = tokio::time::timeout(Duration::from_secs(60), resp.chunk())
            .await
            .expect("the feed went quiet")
            .unwrap();
        let Some(chunk) = chunk else { return out };
        buf.push_str(&String::from_utf8_lossy(&chunk));
        while let Some(end) = buf.find("\n\n") {
            let frame: String = buf.drain(..end + 2).collect();
            if let Some(data) = frame.lines().find_map(|l| l.strip_prefix("data: ")) {
                let event: Event = serde_json::from_str(data).unwrap();
                let last = stop(&event) || matches!(event.msg, EventMsg::TaskFinished { .. });
                out.push(event);
                if last {
                    return out;
                }
            }
        }
    }
}

fn seqs(events: &[Event]) -> Vec<u64> {
    events.iter().map(|e| e.seq).collect()
}

fn approval_requested(e: &Event) -> bool {
    matches!(e.msg, EventMsg::ApprovalRequested { .. })
}

#[tokio::test(flavor = "multi_thread")]
async fn any_daemon_follows_cancels_and_decides_for_a_task_another_runs() {
    let url = Postgres::shared().new_database();
    let ticking =
        "import time\nfor i in range(4):\n    print('tick', i, flush=True)\n    time.sleep(0.5)";
    let server = ScriptedOpenAi::start(
        [
            (
                "ticks",
                vec![
                    Reply::from(fence(ticking).as_str()),
                    Reply::from("TERMINATE"),
                ],
            ),
            (
                "forever",
                vec![Reply::from(fence("import time\ntime.sleep(600)").as_str())],
            ),
            (
                "gated",
                vec![
                    Reply::from(fence("print('approved')").as_str()),
                    Reply::from("TERMINATE"),
                ],
            ),
            (
                "denied",
                vec![
                    Reply::from(fence("print('never')").as_str()),
                    Reply::from("TERMINATE"),
                ],
            ),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_owned(), v))
        .collect::<Script>(),
    )
    .await
    .unwrap();
    let policy = "\n[approval]\nmode = \"always\"\n";
    // Only A runs at first, so the tasks are A's.
    let a = daemon(&server, "a", &url, 30.0, policy).await;
    let ticks = a.submit(json!({"task": "ticks"})).await;
    let forever = a.submit(json!({"task": "forever"})).await;
    let gated = a.submit(json!({"task": "gated"})).await;
    let denied = a.submit(json!({"task": "denied"})).await;
    wait_for("A holds all four", Duration::from_secs(30), async || {
        running_on(&a, "a").await == 4
    })
    .await;
    let b = daemon(&server, "b", &url, 30.0, policy).await;

    // B follows the task A runs, live: the first tick reaches B while the task still runs.
    let first = follow(&b, &ticks, 0, approval_requested).await;
    assert!(approval_requested(first.last().unwrap()), "{first:?}");
    let (status, body) = b
        .send(
            reqwest::Method::POST,
            &format!("/v1/tasks/{ticks}/approvals/1"),
            Some(json!({"decision": "approve"}).to_string()),
        )
        .await;
    assert_eq!(status, 200, "{body}");
    let upto_tick = follow(&b, &ticks, seqs(&first).last().copied().unwrap(), |e| {
        matches!(e.msg, EventMsg::ExecOutput { .. })
    })
    .await;
    assert!(
        matches!(
            &upto_tick.last().unwrap().msg,
            EventMsg::ExecOutput { text, .. } if text == "tick 0\n"
        ),
        "{upto_tick:?}"
    );
    // Either daemon says which one runs it.
    let t = b.task(&ticks).await;
    assert_eq!(
        (t.record.state, t.daemon.as_deref()),
        (TaskState::Running, Some("a")),
        "{t:?}"
    );
    // Resumed on the other daemon from the last event seen: no gap, no repeat.
    let seen = *seqs(&upto_tick).last().unwrap();
    let rest = follow(&a, &ticks, seen, |_| false).await;
    let mut all = seqs(&first);
    all.extend(seqs(&upto_tick));
    all.extend(seqs(&rest));
    let stored = seqs(&b.events(&ticks, 0).await);
    assert_eq!(all, stored);
    assert!(
        matches!(
            rest.last().unwrap().msg,
            EventMsg::TaskFinished {
                stop_reason: StopReason::Terminated,
                ..
            }
        ),
        "{rest:?}"
    );

    // A decision sent to B reaches the block waiting on A; a denial, its reason.
    let asked = follow(&b, &gated, 0, approval_requested).await;
    assert!(approval_requested(asked.last().unwrap()), "{asked:?}");
    let (status, body) = b
        .send(
            reqwest::Method::POST,
            &format!("/v1/tasks/{gated}/approvals/1"),
            Some(json!({"decision": "approve"}).to_string()),
        )
        .await;
    assert_eq!(status, 200, "{body}");
    let t = b.wait_finished(&gated, Duration::from_secs(60)).await;
    assert_eq!(t.record.stop_reason, Some(StopReason::Terminated), "{t:?}");
    let events = b.events(&gated, 0).await;
    assert!(
        events
            .iter()
            .any(|e| matches!(&e.msg, EventMsg::ExecOutput { text, .. } if text == "approved\n")),
        "{events:?}"
    );
    // Deciding it again, on either daemon, is a conflict.
    let (status, body) = a
        .send(
            reqwest::Method::POST,
            &format!("/v1/tasks/{gated}/approvals/1"),
            Some(json!({"decision": "deny"}).to_string()),
        )
        .await;
    assert_eq!(status, 409, "{body}");

    // A denial sent to B reaches A's task, and the model reads its reason.
    follow(&b, &denied, 0, approval_requested).await;
    let (status, body) = b
        .send(
            reqwest::Method::POST,
            &format!("/v1/tasks/{denied}/approvals/1"),
            Some(json!({"decision": "deny", "reason": "not on a shared box"}).to_string()),
        )
        .await;
    assert_eq!(status, 200, "{body}");
    let t = b.wait_finished(&denied, Duration::from_secs(60)).await;
    assert_eq!(t.record.stop_reason, Some(StopReason::Terminated), "{t:?}");
    let told = server.requests_for("denied")[1]
        .last_message()
        .unwrap()
        .to_owned();
    assert!(told.contains("not on a shared box"), "{told}");
    let events = b.events(&denied, 0).await;
    assert!(
        !events
            .iter()
            .any(|e| matches!(e.msg, EventMsg::ExecOutput { .. })),
        "{events:?}"
    );

    // A cancel sent to B stops the block running on A.
    let asked = follow(&b, &forever, 0, approval_requested).await;
    assert!(approval_requested(asked.last().unwrap()), "{asked:?}");
    let (status, _) = b
        .send(
            reqwest::Method::POST,
            &format!("/v1/tasks/{forever}/approvals/1"),
            Some(json!({"decision": "approve"}).to_string()),
        )
        .await;
    assert_eq!(status, 200);
    follow(&b, &forever, 0, |e| {
        matches!(e.msg, EventMsg::CodeBlock { .. })
    })
    .await;
    let (status, body) = b
        .send(
            reqwest::Method::POST,
            &format!("/v1/tasks/{forever}/cancel"),
            None,
        )
        .await;
    assert_eq!(status, 200, "{body}");
    let t = b.wait_finished(&forever, Duration::from_secs(30)).await;
    assert_eq!(t.record.stop_reason, Some(StopReason::Cancelled), "{t:?}");
    // Which daemon runs what: A ran them (and lets go once their sandboxes are closed), B none.
    wait_for("A lets its tasks go", Duration::from_secs(30), async || {
        running_on(&a, "a").await == 0
    })
    .await;
    assert_eq!(running_on(&b, "b").await, 0);
}

#[tokio::test(flavor = "multi_thread")]
async fn a_paused_daemon_loses_its_task_and_runs_nothing_of_it_when_it_wakes() {
    let url = Postgres::shared().new_database();
    let dir = tempfile::tempdir().unwrap();
    let lines = dir.path().join("lines");
    let block = fence(&format!(
        "with open({:?}, 'a') as f:\n    f.write('ran\\n')",
        lines.display().to_string()
    ));
    let task = "paused mid-call";
    let server = ScriptedOpenAi::start(
        [(
            task.to_owned(),
            vec![
                Reply::Delayed(
                    Duration::from_secs(4),
                    Box::new(Reply::from(block.as_str())),
                ),
                Reply::from("TERMINATE"),
            ],
        )]
        .into_iter()
        .collect(),
    )
    .await
    .unwrap();
    let a = daemon(&server, "a", &url, 2.0, "").await;
    let id = a.submit(json!({"task": task})).await;
    wait_for("A asks the model", Duration::from_secs(30), async || {
        server.requests_for(task).len() == 1
    })
    .await;
    // A stops while its model call is out; its lease lapses and B takes the task over.
    let pid = nix::unistd::Pid::from_raw(a.pid() as i32);
    nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGSTOP).unwrap();
    let b = daemon(&server, "b", &url, 2.0, "").await;
    let t = b.wait_finished(&id, Duration::from_secs(60)).await;
    assert_eq!(t.record.stop_reason, Some(StopReason::Terminated), "{t:?}");
    // A wakes with the reply its call was sent meanwhile, and is fenced out.
    nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGCONT).unwrap();
    wait_for(
        "A sees it lost the task",
        Duration::from_secs(60),
        async || {
            a.log().contains("another daemon holds these tasks now")
                && running_on(&a, "a").await == 0
        },
    )
    .await;
    let ran = std::fs::read_to_string(&lines).unwrap();
    assert_eq!(ran, "ran\n", "the block ran more than once");
    let events = b.events(&id, 0).await;
    let finished = events
        .iter()
        .filter(|e| matches!(e.msg, EventMsg::TaskFinished { .. }))
        .count();
    let results = events
        .iter()
        .filter(|e| matches!(e.msg, EventMsg::ExecResult { .. }))
        .count();
    assert_eq!((finished, results), (1, 1), "{events:#?}");
    assert_eq!(b.task(&id).await.record.state, TaskState::Finished);
}

#[tokio::test(flavor = "multi_thread")]
async fn a_follower_on_another_daemon_outlasts_a_database_restart_and_misses_nothing() {
    // A server of its own: this test stops it.
    let pg = Postgres::start(false);
    let url = pg.new_database();
    let ticking =
        "import time\nfor i in range(12):\n    print('tick', i, flush=True)\n    time.sleep(0.5)";
    let server = ScriptedOpenAi::start(
        [(
            "through it".to_owned(),
            vec![
                Reply::from(fence(ticking).as_str()),
                Reply::from("TERMINATE"),
            ],
        )]
        .into_iter()
        .collect(),
    )
    .await
    .unwrap();
    let a = daemon(&server, "a", &url, 30.0, "").await;
    let id = a.submit(json!({"task": "through it"})).await;
    let b = daemon(&server, "b", &url, 30.0, "").await;
    let follower = {
        let (host, id) = (b.socket(), id.clone());
        tokio::spawn(async move {
            let client = reqwest::Client::builder()
                .unix_socket(host)
                .build()
                .unwrap();
            let mut resp = client
                .get(format!("http://tandem/v1/tasks/{id}/events"))
                .send()
                .await
                .unwrap();
            let mut text = String::new();
            while let Ok(Some(chunk)) = tokio::time::timeout(Duration::from_secs(90), resp.chunk())
                .await
                .expect("the feed went quiet")
            {
                text.push_str(&String::from_utf8_lossy(&chunk));
                if text.contains("\"type\":\"task_finished\"") {
                    break;
                }
            }
            text
        })
    };
    // Down for 5 s while the block ticks on A. B, which runs nothing, refuses a submit
    // meanwhile, and takes them again once the database is back.
    follow(&b, &id, 0, |e| matches!(e.msg, EventMsg::ExecOutput { .. })).await;
    tokio::task::block_in_place(|| pg.stop());
    let submit = async |d: &Daemon| {
        let body = json!({"task": "later"}).to_string();
        d.send(reqwest::Method::POST, "/v1/tasks", Some(body)).await
    };
    let (status, body) = submit(&b).await;
    assert_eq!(
        (status, &body["error"]["code"]),
        (503, &json!("store_unavailable")),
        "{body}"
    );
    tokio::time::sleep(Duration::from_secs(5)).await;
    tokio::task::block_in_place(|| pg.start_again(false));
    wait_for(
        "B takes submits again",
        Duration::from_secs(30),
        async || submit(&b).await.0 == 201,
    )
    .await;
    let text = follower.await.unwrap();
    assert!(
        text.contains("\"type\":\"task_finished\""),
        "the follower on B stopped before the task's end:\n{text}"
    );
    let seen: Vec<u64> = text
        .split("\n\n")
        .filter_map(|f| f.lines().find_map(|l| l.strip_prefix("data: ")))
        .map(|d| {
            serde_json::from_str::<Value>(d).unwrap()["seq"]
                .as_u64()
                .unwrap()
        })
        .collect();
    let stored = seqs(&a.events(&id, 0).await);
    assert_eq!(seen, stored, "the follower on B missed or repeated events");
    let events = a.events(&id, 0).await;
    let out: String = block_output(&events).concat();
    let want: String = (0..12).map(|i| format!("tick {i}\n")).collect();
    assert_eq!(out, want, "A's events were not all kept, in order");
}

#[tokio::test(flavor = "multi_thread")]
async fn three_daemons_run_every_block_once_through_a_kill_9_and_a_database_outage() {
    const TASKS: usize = 1000;
    // A server of its own: this test stops it.
    let pg = Postgres::start(false);
    let url = pg.new_database();
    let dir = tempfile::tempdir().unwrap();
    let lines = dir.path().join("lines");
    let script: Script = (0..TASKS)
        .map(|i| {
            // The line first, then a little work, so the load lasts through the kill and
            // the outage.
            let block = fence(&format!(
                "import time\nwith open({:?}, 'a') as f:\n    f.write('{i}\\n')\ntime.sleep(0.05)",
                lines.display().to_string()
            ));
            (
                format!("line {i}"),
                vec![Reply::from(block.as_str()), Reply::from("TERMINATE")],
            )
        })
        .collect();
    let server = ScriptedOpenAi::start(script).await.unwrap();
    let mut daemons = Vec::new();
    // Long enough that a loaded machine does not let a live daemon's leases lapse; the
    // outage below outlasts it.
    for name in ["a", "b", "c"] {
        daemons.push(daemon(&server, name, &url, 8.0, "").await);
    }
    // Submitted side by side, so the queue is deep while the blocks run.
    let ids: Vec<String> = {
        use futures::StreamExt;
        let daemons = &daemons;
        futures::stream::iter((0..TASKS).map(|i| async move {
            daemons[i % 3]
                .submit(json!({"task": format!("line {i}")}))
                .await
        }))
        .buffered(16)
        .collect()
        .await
    };
    let finished = async |d: &Daemon| d.count("finished").await;
    wait_for("a fifth done", Duration::from_secs(120), async || {
        finished(&daemons[1]).await >= (TASKS / 5) as u64
    })
    .await;
    // kill -9 of A mid-load, once every task it runs waits on the model: as many of A's
    // requests are held as A runs tasks (so no reply is on its way to any of them, and no
    // block can start), and the store agrees (each one's last event starts a turn). A block
    // a kill cuts off is not run again:
    // daemon::kill_9_then_restart_keeps_every_task_and_resumes_the_interrupted.
    server.hold("a");
    wait_for(
        "A's tasks all wait on the model",
        Duration::from_secs(60),
        async || {
            let held = server.held("a") as u64;
            held > 0
                && held == running_on(&daemons[0], "a").await
                && all_wait_on_the_model(&daemons[1], "a").await
        },
    )
    .await;
    let done_at_kill = finished(&daemons[1]).await;
    let held_by_a = server.held("a");
    daemons[0].kill9();
    server.release("a");
    wait_for("half done", Duration::from_secs(120), async || {
        finished(&daemons[1]).await >= (TASKS / 2) as u64
    })
    .await;
    // The database stops for 10 s under load: a submit meanwhile is a clear 503.
    let done_at_outage = finished(&daemons[1]).await;
    assert!(
        done_at_outage < TASKS as u64,
        "the load was over before the outage"
    );
    tokio::task::block_in_place(|| pg.stop());
    let stopped = Instant::now();
    let (status, body) = daemons[1]
        .send(
            reqwest::Method::POST,
            "/v1/tasks",
            Some(json!({"task": "during the outage"}).to_string()),
        )
        .await;
    assert_eq!(status, 503, "{body}");
    assert_eq!(body["error"]["code"], "store_unavailable", "{body}");
    tokio::time::sleep(Duration::from_secs(10).saturating_sub(stopped.elapsed())).await;
    tokio::task::block_in_place(|| pg.start_again(false));
    wait_for(
        "every task finished",
        Duration::from_secs(300),
        async || finished(&daemons[1]).await == TASKS as u64,
    )
    .await;
    for id in &ids {
        let t = daemons[2].task(id).await;
        assert_eq!(t.record.stop_reason, Some(StopReason::Terminated), "{t:?}");
    }
    let mut counts: BTreeMap<usize, usize> = BTreeMap::new();
    for line in std::fs::read_to_string(&lines).unwrap().lines() {
        *counts.entry(line.parse().unwrap()).or_default() += 1;
    }
    let missing: Vec<usize> = (0..TASKS).filter(|i| !counts.contains_key(i)).collect();
    let twice: Vec<(&usize, &usize)> = counts.iter().filter(|(_, n)| **n != 1).collect();
    assert!(
        missing.is_empty() && twice.is_empty(),
        "blocks that never ran: {missing:?}; blocks that ran more than once: {twice:?}"
    );
    // The live daemons kept their tasks' events through the outage and stored them after.
    let log = daemons[1].log() + &daemons[2].log();
    assert!(!log.contains("panicked"), "{log}");
    assert!(
        log.contains("the task database is unreachable")
            && log.contains("the task database is back"),
        "{log}"
    );
    eprintln!(
        "{TASKS} tasks: A was killed with {held_by_a} tasks waiting on the model and {done_at_kill} done; the database stopped with {done_at_outage} done; {} leases were taken from a live daemon after the outage",
        log.matches("another daemon holds these tasks now").count()
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn store_migrate_moves_a_daemons_tasks_into_postgres_where_another_daemon_serves_them() {
    let server = ScriptedOpenAi::start(
        (0..3)
            .map(|i| {
                (
                    format!("old {i}"),
                    vec![
                        Reply::from(fence(&format!("print({i})")).as_str()),
                        Reply::from("TERMINATE"),
                    ],
                )
            })
            .collect(),
    )
    .await
    .unwrap();
    let mut old = Daemon::start(BIN.as_ref(), &server.base_url(), &[], None).await;
    let mut ids = Vec::new();
    for i in 0..3 {
        let id = old.submit(json!({"task": format!("old {i}")})).await;
        old.wait_finished(&id, Duration::from_secs(60)).await;
        ids.push(id);
    }
    let db = old.state_dir().join("tandem.db");
    let url = Postgres::shared().new_database();
    let migrate = async |old: &Daemon| {
        let from = db.to_str().unwrap();
        old.cli(&["store", "migrate", "--from", from, "--to", &url])
            .await
    };
    // Refused while the daemon runs: it would go on writing the file.
    let (code, _, err) = migrate(&old).await;
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("stop it before moving its tasks"), "{err}");
    old.terminate().await;
    let (code, out, err) = migrate(&old).await;
    assert_eq!(code, 0, "{err}");
    assert!(out.starts_with("moved 3 tasks ("), "{out}");
    assert!(!out.contains(tandem_tests::postgres::PASSWORD), "{out}");
    // Again: nothing doubles.
    let (code, out, _) = migrate(&old).await;
    assert_eq!(code, 0);
    assert!(
        out.contains("moved 0 tasks") && out.contains("3 were there already"),
        "{out}"
    );
    let new = daemon(&server, "new", &url, 30.0, "").await;
    for id in &ids {
        let before = old_events(&db, id);
        let after = new.events(id, 0).await;
        assert_eq!(after.len(), before, "{id}");
        assert_eq!(
            new.task(id).await.record.stop_reason,
            Some(StopReason::Terminated)
        );
    }
}

/// How many events task `id` has in the SQLite file.
fn old_events(db: &std::path::Path, id: &str) -> usize {
    let store = tandem_daemon::Store::open(db).unwrap();
    store.events_after(id, 0).unwrap().len()
}

#[tokio::test(flavor = "multi_thread")]
async fn a_wrong_store_url_or_password_stops_serve_naming_the_setting() {
    let pg = Postgres::shared();
    let wrong = pg
        .new_database()
        .replace(tandem_tests::postgres::PASSWORD, "wrong-password");
    // The same URL with no password: it comes from PGPASSWORD, never the command line.
    let bare = wrong.replace(":wrong-password@", "@");
    let state = tempfile::tempdir().unwrap();
    for (how, env, args) in [
        ("TANDEM_STORE_URL", Some(wrong.as_str()), vec![]),
        ("--store", None, vec!["--store", bare.as_str()]),
    ] {
        let mut cmd = tokio::process::Command::new(BIN);
        cmd.args(["serve", "--executor", "local", "--state-dir"])
            .arg(state.path())
            .args(&args)
            .env("XDG_CONFIG_HOME", state.path())
            .env("PGPASSWORD", "wrong-password")
            .env_remove("TANDEM_STORE_URL");
        if let Some(url) = env {
            cmd.env("TANDEM_STORE_URL", url);
        }
        let out = tokio::time::timeout(Duration::from_secs(60), cmd.output())
            .await
            .unwrap()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{err}");
        assert!(
            err.contains("refused the login")
                && err.contains(&format!("check {how}"))
                && !err.contains("wrong-password"),
            "{err}"
        );
    }
}

/// The store's password is in no command line and no help text: `--store` with one is
/// refused before anything connects, `serve --help` does not print TANDEM_STORE_URL's value,
/// and a password from `[store] password_file` opens the store.
#[tokio::test(flavor = "multi_thread")]
async fn the_store_password_stays_out_of_argv_and_help() {
    let pg = Postgres::shared();
    let url = pg.new_database();
    let password = tandem_tests::postgres::PASSWORD;
    let state = tempfile::tempdir().unwrap();
    let run = |args: Vec<String>, envs: Vec<(&'static str, String)>| {
        let mut cmd = tokio::process::Command::new(BIN);
        cmd.args(&args)
            .env("XDG_CONFIG_HOME", state.path())
            .env_remove("TANDEM_STORE_URL")
            .env_remove("PGPASSWORD");
        for (k, v) in envs {
            cmd.env(k, v);
        }
        async move {
            tokio::time::timeout(Duration::from_secs(60), cmd.output())
                .await
                .unwrap()
                .unwrap()
        }
    };
    let help = run(
        vec!["serve".into(), "--help".into()],
        vec![("TANDEM_STORE_URL", url.clone())],
    )
    .await;
    let text = String::from_utf8_lossy(&help.stdout);
    assert!(text.contains("TANDEM_STORE_URL"), "{text}");
    assert!(!text.contains(password), "{text}");
    let state_dir = state.path().to_string_lossy().into_owned();
    let refused = run(
        vec![
            "serve".into(),
            "--executor".into(),
            "local".into(),
            "--state-dir".into(),
            state_dir.clone(),
            "--store".into(),
            url.clone(),
        ],
        vec![],
    )
    .await;
    let err = String::from_utf8_lossy(&refused.stderr);
    assert_eq!(refused.status.code(), Some(2), "{err}");
    assert!(
        err.contains("--store carries a password") && !err.contains(password),
        "{err}"
    );
    // A password file: the daemon comes up on the store (then is stopped).
    let secret = state.path().join("pg-password");
    std::fs::write(&secret, format!("{password}\n")).unwrap();
    let config_dir = state.path().join("tandem");
    std::fs::create_dir_all(&config_dir).unwrap();
    std::fs::write(
        config_dir.join("tandem.toml"),
        format!("[store]\npassword_file = \"{}\"\n", secret.display()),
    )
    .unwrap();
    let bare = url.replace(&format!(":{password}@"), "@");
    let mut daemon = tokio::process::Command::new(BIN)
        .args([
            "serve",
            "--executor",
            "local",
            "--state-dir",
            &state_dir,
            "--store",
            &bare,
        ])
        .env("XDG_CONFIG_HOME", state.path())
        .env_remove("TANDEM_STORE_URL")
        .env_remove("PGPASSWORD")
        .stderr(std::process::Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let stderr = daemon.stderr.take().unwrap();
    let mut lines = tokio::io::BufReader::new(stderr).lines();
    let opened = tokio::time::timeout(Duration::from_secs(60), async {
        while let Ok(Some(line)) = lines.next_line().await {
            if line.contains("tasks are kept in PostgreSQL") {
                return Ok(line);
            }
            if line.contains("error") {
                return Err(line);
            }
        }
        Err("the daemon ended".to_owned())
    })
    .await
    .unwrap();
    let line = opened.unwrap();
    assert!(!line.contains(password), "{line}");
    let cmdline = std::fs::read(format!("/proc/{}/cmdline", daemon.id().unwrap())).unwrap();
    assert!(!String::from_utf8_lossy(&cmdline).contains(password));
    daemon.kill().await.unwrap();
}

/// Two daemons on one store, and a client that races them: every interrupted task is resumed
/// sixteen times at once, half through each daemon, then cancelled through both. One resume
/// of each wins, the task's next turn is asked of the model once (by one daemon), and it ends
/// cancelled once.
#[tokio::test(flavor = "multi_thread")]
async fn racing_resumes_and_cancels_through_two_daemons_run_each_task_once() {
    let pg = Postgres::shared();
    let url = pg.new_database();
    let sleeper = || Reply::from(fence("import time\ntime.sleep(60)").as_str());
    let tasks: Vec<String> = (0..4).map(|i| format!("raced {i}")).collect();
    let script: Script = tasks
        .iter()
        .map(|t| (t.clone(), vec![sleeper(), sleeper(), sleeper()]))
        .collect();
    let server = ScriptedOpenAi::start(script).await.unwrap();
    let start = |name: &'static str| {
        let config = format!(
            "[store]\ndaemon = \"{name}\"\nlease_secs = 4\n\n[executors.local]\nconfine = \"off\"\n"
        );
        let (server, url) = (&server, url.clone());
        async move {
            Daemon::start_with_env(
                BIN.as_ref(),
                &server.base_url_for(name),
                &["--max-concurrent", "4", "--grace", "0.5"],
                Some(&config),
                &[("TANDEM_STORE_URL", url.as_str())],
            )
            .await
        }
    };
    let mut a = start("a").await;
    let mut b = start("b").await;
    let mut ids = Vec::new();
    for (i, task) in tasks.iter().enumerate() {
        let d = if i % 2 == 0 { &a } else { &b };
        ids.push(d.submit(json!({"task": task, "max_turns": 10})).await);
    }
    // Each is in its first block when both daemons stop: interrupted, resumable.
    for task in &tasks {
        wait_for(
            "every task in its block",
            Duration::from_secs(60),
            async || !server.requests_for(task).is_empty(),
        )
        .await;
    }
    for id in &ids {
        wait_for("every block started", Duration::from_secs(60), async || {
            a.events(id, 0)
                .await
                .iter()
                .any(|e| matches!(e.msg, EventMsg::CodeBlock { .. }))
        })
        .await;
    }
    assert_eq!(a.terminate().await, Some(0), "{}", a.log());
    assert_eq!(b.terminate().await, Some(0), "{}", b.log());
    a.spawn().await;
    b.spawn().await;
    for id in &ids {
        let t = a.task(id).await;
        assert_eq!(t.record.state, TaskState::Interrupted, "{t:?}");
    }
    let asked: BTreeMap<&String, usize> = tasks
        .iter()
        .map(|t| (t, server.requests_for(t).len()))
        .collect();
    let sockets = [a.socket(), b.socket()];
    let answers = futures::future::join_all(ids.iter().flat_map(|id| {
        let sockets = sockets.clone();
        (0..16).map(move |n| {
            let client = reqwest::Client::builder()
                .unix_socket(sockets[n % 2].clone())
                .build()
                .unwrap();
            let (url, id) = (format!("http://tandem/v1/tasks/{id}/resume"), id.clone());
            async move { (id, client.post(url).send().await.unwrap().status().as_u16()) }
        })
    }))
    .await;
    for id in &ids {
        let mut codes: Vec<u16> = answers
            .iter()
            .filter(|(of, _)| of == id)
            .map(|(_, status)| *status)
            .collect();
        codes.sort_unstable();
        assert_eq!(codes, [[200].as_slice(), &[409; 15]].concat(), "{id}");
    }
    // The resumed task asks for its next turn, once, of one daemon.
    for task in &tasks {
        wait_for(
            "the next turn asked for",
            Duration::from_secs(60),
            async || server.requests_for(task).len() > asked[task],
        )
        .await;
    }
    // Cancels through both daemons at once: each task ends once, cancelled.
    let paths: Vec<String> = ids
        .iter()
        .map(|id| format!("/v1/tasks/{id}/cancel"))
        .collect();
    let cancels = paths
        .iter()
        .flat_map(|path| [&a, &b].map(|d| d.send(reqwest::Method::POST, path, None)));
    futures::future::join_all(cancels).await;
    for id in &ids {
        let t = b.wait_finished(id, Duration::from_secs(60)).await;
        assert_eq!(t.record.stop_reason, Some(StopReason::Cancelled), "{t:?}");
        let finished = b
            .events(id, 0)
            .await
            .iter()
            .filter(|e| matches!(e.msg, EventMsg::TaskFinished { .. }))
            .count();
        assert_eq!(finished, 1, "{id} ended {finished} times");
    }
    for task in &tasks {
        assert_eq!(
            server.requests_for(task).len(),
            asked[task] + 1,
            "{task} was run on after its resume more than once"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_snapshot_taken_on_one_daemon_resumes_on_another_sharing_the_store_and_files() {
    let url = Postgres::shared().new_database();
    let server = ScriptedOpenAi::start(Script::default()).await.unwrap();
    let files = tempfile::tempdir().unwrap();
    let extra = format!(
        "[files]\ndir = \"{}\"\n\n[policy]\nexecutors = [\"local\"]\n",
        files.path().display()
    );
    let a = daemon(&server, "a", &url, 5.0, &extra).await;
    let b = daemon(&server, "b", &url, 5.0, &extra).await;
    let (status, first) = a
        .open_session(json!({"executor": "local", "keep_state": true}))
        .await;
    assert_eq!(status, 201, "{first}");
    let first = first["id"].as_str().unwrap().to_owned();
    a.exec_python(
        &first,
        "open('notes.txt', 'w').write('from a')\ntotal = 41 + 1",
    )
    .await;
    let (status, record) = a
        .send(
            reqwest::Method::POST,
            &format!("/v1/sessions/{first}/snapshot"),
            None,
        )
        .await;
    assert_eq!(status, 201, "{record}");
    let snap = record["id"].as_str().unwrap().to_owned();
    // The other daemon lists it, and opens a session from it with its files and globals.
    let listed = b.get("/v1/snapshots").await;
    assert!(listed.to_string().contains(&snap), "{listed}");
    let (status, second) = b
        .open_session(json!({"executor": "local", "from_snapshot": snap}))
        .await;
    assert_eq!(status, 201, "{second}");
    let second = second["id"].as_str().unwrap().to_owned();
    assert_eq!(
        b.exec_python(&second, "print(open('notes.txt').read(), total)")
            .await["stdout"],
        "from a 42\n"
    );
}
