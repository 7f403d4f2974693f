//! Snapshots of sandboxes' workspaces through the daemon: taken between blocks, resumed any
//! number of times, forked, and refused cleanly when unknown, damaged or over the quota.

use std::path::Path;

use serde_json::{Value, json};
use tandem_tests::daemon::DaemonHarness;
use tandem_tests::{ScriptedOpenAi, script};

async fn start(server: &ScriptedOpenAi, executor: &str, config: Option<&str>) -> DaemonHarness {
    DaemonHarness::start(
        Path::new(env!("CARGO_BIN_EXE_tandem")),
        &server.base_url(),
        &["--executor", executor],
        config,
    )
    .await
}

async fn open(d: &DaemonHarness, spec: Value) -> String {
    let (status, session) = d
        .send(
            reqwest::Method::POST,
            "/v1/sessions",
            Some(spec.to_string()),
        )
        .await;
    assert_eq!(status, 201, "{session}");
    session["id"].as_str().unwrap().to_owned()
}

async fn exec(d: &DaemonHarness, session: &str, code: &str) -> String {
    let (status, ran) = d
        .send(
            reqwest::Method::POST,
            &format!("/v1/sessions/{session}/exec"),
            Some(json!({"language": "python", "code": code}).to_string()),
        )
        .await;
    assert_eq!(status, 200, "{ran}");
    assert_eq!(ran["exit_code"], 0, "{ran}");
    ran["stdout"].as_str().unwrap().to_owned()
}

async fn snapshot(d: &DaemonHarness, session: &str, name: Option<&str>) -> Value {
    let body = name.map(|n| json!({"name": n}).to_string());
    let (status, record) = d
        .send(
            reqwest::Method::POST,
            &format!("/v1/sessions/{session}/snapshot"),
            body,
        )
        .await;
    assert_eq!(status, 201, "{record}");
    record
}

/// `count` sessions forked from `snap`, by id.
async fn fork(d: &DaemonHarness, snap: &str, count: u64) -> Vec<String> {
    let (status, forked) = d
        .send(
            reqwest::Method::POST,
            &format!("/v1/snapshots/{snap}/fork"),
            Some(json!({"count": count}).to_string()),
        )
        .await;
    assert_eq!(status, 201, "{forked}");
    forked["sessions"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| s["id"].as_str().unwrap().to_owned())
        .collect()
}

/// Every file of the workspace (not Tandem's own), with its bytes and executable bit, and
/// every directory: what must survive a snapshot exactly.
const TREE: &str = "import os, hashlib\nfor root, dirs, files in sorted(os.walk('.')):\n    dirs.sort()\n    if root.startswith('./.tandem'):\n        continue\n    for d in dirs:\n        if not d.startswith('.tandem'):\n            print('dir', os.path.join(root, d))\n    for f in sorted(files):\n        if f.startswith('.tandem'):\n            continue\n        p = os.path.join(root, f)\n        if os.path.islink(p) or not os.path.isfile(p):\n            print('other', p)\n            continue\n        print('file', p, os.access(p, os.X_OK), hashlib.sha256(open(p, 'rb').read()).hexdigest()[:12])\n";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sessions_snapshot_resumes_five_times_and_forks_four_ways_with_every_file_exact() {
    for executor in ["local", "docker"] {
        snapshots_resume_and_fork(executor).await;
    }
}

async fn snapshots_resume_and_fork(executor: &str) {
    let server = ScriptedOpenAi::start(script([])).await.unwrap();
    let d = start(&server, executor, None).await;
    let first = open(&d, json!({})).await;
    exec(
        &d,
        &first,
        "import os\nos.makedirs('data/deep/er', exist_ok=True)\nopen('data/deep/er/a.csv', 'w').write('x,y\\n1,2\\n')\nopen('empty.txt', 'w').close()\nos.makedirs('nothing_inside')\nopen('run.sh', 'w').write('#!/bin/sh\\necho ran\\n')\nos.chmod('run.sh', 0o755)\nopen('blob.bin', 'wb').write(bytes(range(256)) * 4096)\nos.symlink('/etc/passwd', 'planted')\nos.mkfifo('pipe')\nopen('counter.txt', 'w').write('0')",
    )
    .await;
    let before = exec(&d, &first, TREE).await;
    let record = snapshot(&d, &first, Some("setup")).await;
    let snap = record["id"].as_str().unwrap().to_owned();
    assert_eq!(record["name"], "setup");
    assert_eq!(record["source"]["kind"], "session");
    let skipped: Vec<&str> = record["not_saved"]
        .as_array()
        .unwrap()
        .iter()
        .map(|n| n["name"].as_str().unwrap())
        .collect();
    assert_eq!(skipped, ["pipe", "planted"], "{record}");
    assert_eq!(d.get(&format!("/v1/snapshots/{snap}")).await, record);

    // Five cycles: resume, change, snapshot; each sees exactly what the last one kept.
    let mut current = snap.clone();
    let mut tree = before
        .lines()
        .filter(|l| !l.contains("pipe") && !l.contains("planted"))
        .collect::<Vec<_>>()
        .join("\n");
    for cycle in 1..=5 {
        let session = open(&d, json!({"from_snapshot": current})).await;
        let now = exec(&d, &session, TREE).await;
        assert_eq!(now.trim_end(), tree.trim_end(), "{executor}, cycle {cycle}");
        let count = exec(
            &d,
            &session,
            "n = int(open('counter.txt').read()) + 1\nopen('counter.txt', 'w').write(str(n))\nopen('cycle%d.txt' % n, 'w').write('c' * n)\nprint(n)",
        )
        .await;
        assert_eq!(count.trim(), cycle.to_string(), "{executor}");
        tree = exec(&d, &session, TREE).await;
        let record = snapshot(&d, &session, None).await;
        // Only what changed is new to the store.
        assert!(
            record["added_bytes"].as_u64().unwrap() < 100,
            "{executor}: {record}"
        );
        current = record["id"].as_str().unwrap().to_owned();
        d.send(
            reqwest::Method::DELETE,
            &format!("/v1/sessions/{session}"),
            None,
        )
        .await;
    }

    // Four forks of the first snapshot, each changing the same file its own way.
    let forks = fork(&d, &snap, 4).await;
    assert_eq!(forks.len(), 4);
    for (i, fork) in forks.iter().enumerate() {
        exec(
            &d,
            fork,
            &format!("open('data/deep/er/a.csv', 'a').write('fork {i}\\n')"),
        )
        .await;
    }
    for (i, fork) in forks.iter().enumerate() {
        let seen = exec(&d, fork, "print(open('data/deep/er/a.csv').read(), end='')").await;
        assert_eq!(seen, format!("x,y\n1,2\nfork {i}\n"), "{executor}");
    }

    // The largest number, one too many, none, and a name too long: 400 naming the field.
    for body in [
        json!({"count": u64::MAX}),
        json!({"count": 17}),
        json!({"count": 0}),
        json!({}),
    ] {
        let (status, answer) = d
            .send(
                reqwest::Method::POST,
                &format!("/v1/snapshots/{snap}/fork"),
                Some(body.to_string()),
            )
            .await;
        assert_eq!(status, 400, "{body}: {answer}");
        assert!(answer.to_string().contains("count"), "{body}: {answer}");
    }
    let (status, answer) = d
        .send(
            reqwest::Method::POST,
            &format!("/v1/sessions/{first}/snapshot"),
            Some(json!({"name": "n".repeat(129)}).to_string()),
        )
        .await;
    assert_eq!(status, 400, "{answer}");
    assert!(answer.to_string().contains("name"), "{answer}");

    // Unknown: 404 naming it, wherever it is named.
    let (status, body) = d
        .send(
            reqwest::Method::POST,
            "/v1/sessions",
            Some(json!({"from_snapshot": "snap_missing"}).to_string()),
        )
        .await;
    assert_eq!(status, 404, "{body}");
    assert!(body.to_string().contains("snap_missing"), "{body}");
    for (method, path) in [
        (reqwest::Method::GET, "/v1/snapshots/snap_missing"),
        (reqwest::Method::DELETE, "/v1/snapshots/snap_missing"),
        (reqwest::Method::POST, "/v1/snapshots/snap_missing/fork"),
    ] {
        let body = (method == reqwest::Method::POST).then(|| json!({"count": 1}).to_string());
        let (status, answer) = d.send(method, path, body).await;
        assert_eq!(status, 404, "{path}: {answer}");
        assert!(answer.to_string().contains("snap_missing"), "{answer}");
    }

    // The CLI: create prints the id, ls lists it, show names it, rm removes it.
    let (code, out, err) = d
        .cli(&["snapshot", "create", &first, "--name", "cli"])
        .await;
    assert_eq!(code, 0, "{err}");
    let made = out.trim().to_owned();
    assert!(made.starts_with("snap_"), "{out}");
    let (code, out, _) = d.cli(&["snapshot", "ls"]).await;
    assert_eq!(code, 0);
    assert!(out.contains(&made) && out.contains("\"cli\""), "{out}");
    let (code, out, _) = d.cli(&["snapshot", "show", &made]).await;
    assert_eq!(code, 0);
    assert!(out.contains("not saved: pipe"), "{out}");
    let (code, _, _) = d.cli(&["snapshot", "rm", &made]).await;
    assert_eq!(code, 0);
    let (code, _, err) = d.cli(&["snapshot", "show", &made]).await;
    assert_ne!(code, 0);
    assert!(err.contains(&made), "{err}");
    let (code, _, err) = d.cli(&["snapshot", "create", "no-such-thing"]).await;
    assert_ne!(code, 0);
    assert!(err.contains("no-such-thing"), "{err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_finished_tasks_workspace_is_snapshotted_and_the_quota_and_damage_are_refused() {
    let task = "snapshots: make a file";
    let later = "snapshots: read the file";
    let server = ScriptedOpenAi::start(script([
        (
            task,
            vec![
                tandem_tests::Reply::Text(crate::e2e::fence(
                    "python",
                    "open('made.txt', 'w').write('by the task')",
                )),
                tandem_tests::Reply::from("Done.\n\nTERMINATE"),
            ],
        ),
        // Its task text gains the list of the files it was given.
        (
            "*",
            vec![
                tandem_tests::Reply::Text(crate::e2e::fence(
                    "python",
                    "print(open('made.txt').read())",
                )),
                tandem_tests::Reply::from("Read.\n\nTERMINATE"),
            ],
        ),
    ]))
    .await
    .unwrap();
    let d = start(&server, "local", Some("[snapshots]\nmax_count = 2\n")).await;
    let id = d.submit(json!({"task": task})).await;
    d.wait_finished(&id, std::time::Duration::from_secs(120))
        .await;
    let (status, record) = d
        .send(
            reqwest::Method::POST,
            &format!("/v1/tasks/{id}/snapshot"),
            Some(json!({"name": "task"}).to_string()),
        )
        .await;
    assert_eq!(status, 201, "{record}");
    assert_eq!(record["source"]["kind"], "task");
    let snap = record["id"].as_str().unwrap().to_owned();
    let session = open(&d, json!({"from_snapshot": snap})).await;
    assert_eq!(
        exec(&d, &session, "print(open('made.txt').read())").await,
        "by the task\n"
    );
    // A task starts from it too, through the daemon's CLI road.
    let (code, out, err) = d
        .cli(&["submit", "--from", &snap, "--model", "m", later])
        .await;
    assert_eq!(code, 0, "{err}");
    let next = out.trim().to_owned();
    let view = d
        .wait_finished(&next, std::time::Duration::from_secs(120))
        .await;
    assert_eq!(
        d.block_stdouts(&next).await.join(""),
        "by the task\n",
        "{view:?}"
    );
    let (status, body) = d
        .send(
            reqwest::Method::POST,
            "/v1/tasks",
            Some(json!({"task": later, "from_snapshot": "snap_gone"}).to_string()),
        )
        .await;
    assert_eq!(status, 404, "{body}");
    assert!(body.to_string().contains("snap_gone"), "{body}");
    // Not on this machine's own road: snapshots are a daemon's.
    let (code, _, err) = d.cli(&["run", "--local", "--from", &snap, later]).await;
    assert_eq!(code, 2, "{err}");
    assert!(
        err.contains("--from") && err.contains("tandem serve"),
        "{err}"
    );
    // The second fits; the third is past max_count, refused naming it.
    snapshot(&d, &session, None).await;
    let (status, body) = d
        .send(
            reqwest::Method::POST,
            &format!("/v1/sessions/{session}/snapshot"),
            None,
        )
        .await;
    assert_eq!(status, 409, "{body}");
    assert!(body.to_string().contains("[snapshots] max_count"), "{body}");

    // Damaged content: the restore is refused with the reason, and no session opens.
    let blobs = d.state_dir().join("files/snapshots/blobs");
    for shard in std::fs::read_dir(&blobs).unwrap() {
        for blob in std::fs::read_dir(shard.unwrap().path()).unwrap() {
            std::fs::write(blob.unwrap().path(), "tampered").unwrap();
        }
    }
    let open_before = d.get("/v1/sessions").await["sessions"]
        .as_array()
        .unwrap()
        .len();
    let (status, body) = d
        .send(
            reqwest::Method::POST,
            "/v1/sessions",
            Some(json!({"from_snapshot": snap}).to_string()),
        )
        .await;
    assert_eq!(status, 409, "{body}");
    assert!(body.to_string().contains("is damaged"), "{body}");
    assert_eq!(
        d.get("/v1/sessions").await["sessions"]
            .as_array()
            .unwrap()
            .len(),
        open_before
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_mcp_session_is_snapshotted_and_another_starts_from_it() {
    let server = ScriptedOpenAi::start(script([])).await.unwrap();
    let d = start(&server, "local", None).await;
    let mcp = tandem_tests::mcp::McpHttp::connect(&d).await.unwrap();
    let ran = mcp
        .call_tool(
            "execute_code",
            json!({"language": "python", "code": "open('notes.txt', 'w').write('kept')", "session_id": "a"}),
        )
        .await;
    assert_eq!(ran["structuredContent"]["exit_code"], 0, "{ran}");
    let taken = mcp
        .call_tool("snapshot", json!({"session_id": "a", "name": "mcp"}))
        .await;
    let snap = taken["structuredContent"]["id"]
        .as_str()
        .unwrap_or_else(|| panic!("{taken}"))
        .to_owned();
    assert!(
        tandem_tests::mcp::text_of(&taken)
            .starts_with(&format!("snapshot {snap} of session a: 1 files")),
        "{taken}"
    );
    let read = mcp
        .call_tool(
            "execute_code",
            json!({"language": "python", "code": "print(open('notes.txt').read())", "session_id": "b", "from_snapshot": snap}),
        )
        .await;
    assert_eq!(read["structuredContent"]["stdout"], "kept\n", "{read}");
    let missing = mcp
        .call_tool(
            "execute_code",
            json!({"language": "python", "code": "print(1)", "from_snapshot": "snap_nowhere"}),
        )
        .await;
    assert_eq!(missing["isError"], true, "{missing}");
    assert!(missing.to_string().contains("snap_nowhere"), "{missing}");
    let unknown = mcp
        .call_tool("snapshot", json!({"session_id": "never-opened"}))
        .await;
    assert_eq!(unknown["isError"], true, "{unknown}");
}

/// Runs `code` in `session`, answering its whole result.
async fn exec_result(d: &DaemonHarness, session: &str, code: &str) -> Value {
    let (status, ran) = d
        .send(
            reqwest::Method::POST,
            &format!("/v1/sessions/{session}/exec"),
            Some(json!({"language": "python", "code": code}).to_string()),
        )
        .await;
    assert_eq!(status, 200, "{ran}");
    ran
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_kept_interpreters_globals_are_snapshotted_resumed_and_forked_and_never_loaded_by_the_daemon()
 {
    for executor in ["local", "docker"] {
        kept_globals_last(executor).await;
    }
}

async fn kept_globals_last(executor: &str) {
    let server = ScriptedOpenAi::start(script([])).await.unwrap();
    let d = start(&server, executor, None).await;
    let first = open(&d, json!({"keep_state": true})).await;
    // With cloudpickle or dill where the sandbox's Python runs, what is defined in a block
    // is saved too.
    let extra = exec(
        &d,
        &first,
        "import importlib.util as u\nprint(any(u.find_spec(n) for n in ('cloudpickle', 'dill')))\ndel u",
    )
    .await
        == "True\n";
    // `evil` pickles to a call that writes a file wherever it is loaded.
    exec(
        &d,
        &first,
        "import collections, os\nimport math as m\nx = 41\ndata = {'a': [1, 2.5, 'three'], 'b': (None, b'\\x00\\xff')}\ncounter = collections.Counter('hello')\nf = lambda: 1\ndef g():\n    return 2\nclass Evil:\n    def __reduce__(self):\n        return (os.system, ('echo loaded > loaded-here.txt',))\nevil = Evil()\ngen = (i for i in range(3))",
    )
    .await;
    let record = snapshot(&d, &first, Some("globals")).await;
    let snap = record["id"].as_str().unwrap().to_owned();
    let saved: Vec<&str> = record["saved"]
        .as_array()
        .unwrap()
        .iter()
        .map(|n| n.as_str().unwrap())
        .collect();
    let (want_saved, want_not): (&[&str], &[&str]) = if extra {
        (
            &[
                "collections",
                "os",
                "m",
                "x",
                "data",
                "counter",
                "f",
                "g",
                "Evil",
                "evil",
            ],
            &["gen"],
        )
    } else {
        (
            &["collections", "os", "m", "x", "data", "counter", "evil"],
            &["f", "g", "Evil", "gen"],
        )
    };
    assert_eq!(saved, want_saved, "{executor}: {record}");
    let not_saved: Vec<(&str, &str)> = record["not_saved"]
        .as_array()
        .unwrap()
        .iter()
        .map(|n| (n["name"].as_str().unwrap(), n["why"].as_str().unwrap()))
        .collect();
    let names: Vec<&str> = not_saved.iter().map(|(n, _)| *n).collect();
    assert_eq!(names, want_not, "{executor}: {record}");
    if !extra {
        assert!(not_saved[1].1.contains("defined in a block"), "{record}");
    }
    assert!(
        not_saved.last().unwrap().1.contains("generator"),
        "{record}"
    );
    assert!(record["state_bytes"].as_u64().unwrap() > 0, "{record}");

    // Resumed five times, each changing a value and snapshotted again.
    let mut current = snap.clone();
    for cycle in 1..=5 {
        let session = open(&d, json!({"from_snapshot": current})).await;
        let ran = exec_result(
            &d,
            &session,
            "x += 1\ndata['a'].append(x)\nprint(x, data, counter['l'], round(m.pi, 3), sorted(collections.Counter('aab').items()))",
        )
        .await;
        assert_eq!(ran["exit_code"], 0, "{executor}: {ran}");
        let mut appended = vec!["1".to_owned(), "2.5".to_owned(), "'three'".to_owned()];
        appended.extend((1..=cycle).map(|c| (41 + c).to_string()));
        assert_eq!(
            ran["stdout"].as_str().unwrap(),
            format!(
                "{} {{'a': [{}], 'b': (None, b'\\x00\\xff')}} 2 3.142 [('a', 2), ('b', 1)]\n",
                41 + cycle,
                appended.join(", ")
            ),
            "{executor}, cycle {cycle}: {ran}"
        );
        let told = ran["stderr"].as_str().unwrap();
        assert!(
            told.contains("[tandem] restored from the snapshot: collections, os, m, x"),
            "{executor}: {ran}"
        );
        // What the first snapshot could not keep is told on its restore.
        assert_eq!(
            told.contains("gen (not saved:"),
            cycle == 1,
            "{executor}: {ran}"
        );
        assert_eq!(
            told.contains("g (not saved:"),
            cycle == 1 && !extra,
            "{executor}: {ran}"
        );
        let record = snapshot(&d, &session, None).await;
        current = record["id"].as_str().unwrap().to_owned();
        d.send(
            reqwest::Method::DELETE,
            &format!("/v1/sessions/{session}"),
            None,
        )
        .await;
    }
    // The payload ran where the globals were loaded, in the sandboxes, never in the daemon.
    assert!(!d.state_dir().join("loaded-here.txt").exists());

    // Four forks change the same global their own ways; each sees only its own.
    let forks = fork(&d, &snap, 4).await;
    for (i, fork) in forks.iter().enumerate() {
        exec(&d, fork, &format!("x = {i}\ndata['a'] = ['fork {i}']")).await;
    }
    for (i, fork) in forks.iter().enumerate() {
        let seen = exec(
            &d,
            fork,
            "print(x, data['a'], os.path.exists('loaded-here.txt'))",
        )
        .await;
        assert_eq!(seen, format!("{i} ['fork {i}'] True\n"), "{executor}");
    }
    assert!(!d.state_dir().join("loaded-here.txt").exists());
}

/// Polls session `id` until its `state` is `want`, for at most two minutes.
async fn wait_session_state(d: &DaemonHarness, id: &str, want: &str) -> Value {
    let mut last = Value::Null;
    for _ in 0..600 {
        last = d.get(&format!("/v1/sessions/{id}")).await;
        if last["state"] == want {
            return last;
        }
        tokio::time::sleep(std::time::Duration::from_millis(200)).await;
    }
    panic!("session {id} never became {want}: {last}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idle_session_is_paused_and_its_next_block_resumes_it_across_a_daemon_restart() {
    for executor in ["local", "docker"] {
        paused_and_resumed(executor).await;
    }
}

async fn paused_and_resumed(executor: &str) {
    let server = ScriptedOpenAi::start(script([])).await.unwrap();
    let config = "[sessions]\npause_after_secs = 1\n";
    let mut d = start(&server, executor, Some(config)).await;
    let id = open(&d, json!({"keep_state": true})).await;
    let info = d.get(&format!("/v1/sessions/{id}")).await;
    assert_eq!(info["state"], "running", "{info}");
    // Where its sandbox is: the container's name on Docker, the workspace's path on local.
    let whereabouts = exec(
        &d,
        &id,
        &format!(
            "import os, socket\nrows = [1, 2, 3]\nopen('notes.txt', 'w').write('kept')\nos.chmod('notes.txt', 0o755)\nprint({})",
            if executor == "docker" {
                "socket.gethostname()"
            } else {
                "os.getcwd()"
            }
        ),
    )
    .await;
    let whereabouts = whereabouts.trim().to_owned();
    let paused = wait_session_state(&d, &id, "paused").await;
    assert_eq!(paused["blocks"], 1, "{paused}");
    // Its sandbox is gone: no container of it runs, nothing of it uses memory.
    if executor == "docker" {
        let inspect = std::process::Command::new("docker")
            .args(["inspect", &whereabouts])
            .output()
            .unwrap();
        assert!(
            !inspect.status.success(),
            "container {whereabouts} is still there"
        );
    } else {
        assert!(
            !Path::new(&whereabouts).exists(),
            "workspace {whereabouts} is still there"
        );
    }
    // A paused session's snapshot is the daemon's own: not listed, not removable.
    let listed = d.get("/v1/snapshots").await;
    assert_eq!(listed["snapshots"], json!([]), "{listed}");
    let kept: Value = serde_json::from_slice(
        &std::fs::read(d.state_dir().join(format!("files/paused/{id}.json"))).unwrap(),
    )
    .unwrap();
    let snap = kept["snapshot"].as_str().unwrap();
    let (status, refused) = d
        .send(
            reqwest::Method::DELETE,
            &format!("/v1/snapshots/{snap}"),
            None,
        )
        .await;
    assert_eq!(status, 409, "{refused}");
    assert!(refused.to_string().contains(&id), "{refused}");

    // The daemon stops and starts again: the session is still paused, and still there. A
    // paused session of another daemon sharing the files directory is not taken back.
    d.terminate().await;
    assert!(!kept["daemon"].as_str().unwrap().is_empty(), "{kept}");
    let mut theirs = kept.clone();
    theirs["id"] = json!("theirs");
    theirs["daemon"] = json!("another-daemon");
    std::fs::write(
        d.state_dir().join("files/paused/theirs.json"),
        theirs.to_string(),
    )
    .unwrap();
    d.spawn().await;
    let (status, _) = d
        .send(reqwest::Method::GET, "/v1/sessions/theirs", None)
        .await;
    assert_eq!(status, 404);
    let after = d.get(&format!("/v1/sessions/{id}")).await;
    assert_eq!(after["state"], "paused", "{after}");
    assert_eq!(after["keep_state"], true, "{after}");

    // Its next block resumes it, with its files and globals as they were.
    let ran = exec_result(
        &d,
        &id,
        "rows.append(4)\nprint(rows, open('notes.txt').read(), os.access('notes.txt', os.X_OK))",
    )
    .await;
    assert_eq!(ran["exit_code"], 0, "{ran}");
    assert_eq!(ran["stdout"], "[1, 2, 3, 4] kept True\n", "{ran}");
    let info = d.get(&format!("/v1/sessions/{id}")).await;
    assert!(
        info["state"] == "running" || info["state"] == "paused",
        "{info}"
    );
    assert_eq!(info["blocks"], 2, "{info}");

    // Paused again, then closed: what it was saved as goes with it.
    wait_session_state(&d, &id, "paused").await;
    let (status, _) = d
        .send(reqwest::Method::DELETE, &format!("/v1/sessions/{id}"), None)
        .await;
    assert_eq!(status, 200);
    let (status, _) = d
        .send(reqwest::Method::GET, &format!("/v1/sessions/{id}"), None)
        .await;
    assert_eq!(status, 404);
    let store = d.state_dir().join("files/snapshots/snaps");
    let left = std::fs::read_dir(&store).map(|r| r.count()).unwrap_or(0);
    assert_eq!(
        left, 0,
        "{executor}: a closed paused session's snapshot is removed"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kept_globals_past_the_stores_room_are_refused_and_nothing_is_kept() {
    let server = ScriptedOpenAi::start(script([])).await.unwrap();
    let d = start(&server, "local", Some("[snapshots]\nmax_mb = 1\n")).await;
    let id = open(&d, json!({"keep_state": true})).await;
    exec(&d, &id, "big = b'x' * (4 << 20)").await;
    let (status, refused) = d
        .send(
            reqwest::Method::POST,
            &format!("/v1/sessions/{id}/snapshot"),
            None,
        )
        .await;
    assert_eq!(status, 409, "{refused}");
    assert!(
        refused.to_string().contains("globals pickle to more than"),
        "{refused}"
    );
    let store = d.state_dir().join("files/snapshots");
    for part in ["snaps", "tmp"] {
        let left: Vec<_> = std::fs::read_dir(store.join(part))
            .unwrap()
            .flatten()
            .map(|e| e.file_name())
            .collect();
        assert!(left.is_empty(), "{part}: {left:?}");
    }
    // The interpreter lives on: the global is still there.
    assert_eq!(exec(&d, &id, "print(len(big))").await, "4194304\n");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn what_a_task_installed_on_one_docker_host_is_there_when_a_task_resumes_its_snapshot_on_another()
 {
    let engine = tandem_tests::second_engine::shared().await;
    let _held = tandem_tests::second_engine::EXCLUSIVE.read().await;
    let install = "snapshots: install on a";
    let server = ScriptedOpenAi::start(script([
        (
            install,
            vec![
                tandem_tests::Reply::Text(crate::e2e::fence(
                    "python",
                    // What `pip install --user` leaves: a module in the user's site-packages,
                    // which lives in the workspace (HOME).
                    "import os, site\nd = site.getusersitepackages()\nos.makedirs(d, exist_ok=True)\nopen(os.path.join(d, 'tandempkg.py'), 'w').write('VALUE = 42\\n')\nopen('run.sh', 'w').write('echo ran')\nos.chmod('run.sh', 0o755)\nprint(d.startswith(os.getcwd()))",
                )),
                tandem_tests::Reply::from("Installed.\n\nTERMINATE"),
            ],
        ),
        (
            "*",
            vec![
                tandem_tests::Reply::Text(crate::e2e::fence(
                    "python",
                    "import os, tandempkg\nprint(tandempkg.VALUE, os.access('run.sh', os.X_OK))",
                )),
                tandem_tests::Reply::from("Imported.\n\nTERMINATE"),
            ],
        ),
    ]))
    .await
    .unwrap();
    let image = tandem_tests::second_engine::image();
    let config = format!(
        r#"
[executors.docker]
image = "{image}"
pull = false
pool_size = 0

[[executors.docker.hosts]]
name = "a"
url = "unix:///var/run/docker.sock"
labels = {{ zone = "a" }}

[[executors.docker.hosts]]
name = "b"
url = "{url}"
ca = "{ca}"
cert = "{cert}"
key = "{key}"
workspace = "volume"
labels = {{ zone = "b" }}
"#,
        url = engine.url,
        ca = engine.tls.ca.display(),
        cert = engine.tls.cert.display(),
        key = engine.tls.key.display(),
    );
    let d = start(&server, "docker", Some(&config)).await;
    let first = d
        .submit(json!({"task": install, "placement": {"zone": "a"}}))
        .await;
    let view = d
        .wait_finished(&first, std::time::Duration::from_secs(120))
        .await;
    assert_eq!(d.block_stdouts(&first).await, ["True\n"], "{view:?}");
    let (status, record) = d
        .send(
            reqwest::Method::POST,
            &format!("/v1/tasks/{first}/snapshot"),
            None,
        )
        .await;
    assert_eq!(status, 201, "{record}");
    let snap = record["id"].as_str().unwrap();
    // Resumed on the other engine, over TLS: the snapshot is copied there, checked, and the
    // installed module imports.
    let since = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs()
        - 1;
    let second = d
        .submit(json!({"task": "snapshots: import on b", "placement": {"zone": "b"}, "from_snapshot": snap}))
        .await;
    let view = d
        .wait_finished(&second, std::time::Duration::from_secs(120))
        .await;
    assert_eq!(d.block_stdouts(&second).await, ["42 True\n"], "{view:?}");
    let until = (std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs()
        + 1)
    .to_string();
    let made = engine.cli(&[
        "events",
        "--since",
        &since.to_string(),
        "--until",
        &until,
        "--filter",
        "type=container",
        "--filter",
        "event=create",
        "--format",
        "{{.Actor.Attributes.name}}",
    ]);
    assert!(
        made.contains("tandem-"),
        "no container was made on b: {made:?}"
    );
}
