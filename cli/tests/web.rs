//! The web page in a real browser: headless Chromium from the system packages, driven over
//! WebDriver, against the real daemon over TCP and the scripted model server. Screenshots go
//! to `$TANDEM_SCREENSHOTS` (default: a `tandem-screenshots` dir under the temp dir).

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use serde_json::{Value, json};
use tandem_daemon::store::{Change, Store};
use tandem_protocol::{
    BlockResult, BlockStatus, CodeVia, EventMsg, OutputStream, StopReason, TaskSpec, Usage,
};
use tandem_tests::{Browser, DaemonHarness as Daemon, Reply, Script, ScriptedOpenAi, script};

fn free_addr() -> String {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    listener.local_addr().unwrap().to_string()
}

fn shots() -> PathBuf {
    let dir = std::env::var_os("TANDEM_SCREENSHOTS")
        .map(PathBuf::from)
        .unwrap_or_else(|| std::env::temp_dir().join("tandem-screenshots"));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

async fn shot(b: &Browser, name: &str) {
    let png = b.screenshot().await;
    assert!(png.starts_with(b"\x89PNG"), "not a PNG");
    std::fs::write(shots().join(name), png).unwrap();
}

async fn start_tcp(server: &ScriptedOpenAi, config: &str) -> (Daemon, String, String) {
    let addr = free_addr();
    let d = Daemon::start(
        Path::new(env!("CARGO_BIN_EXE_tandem")),
        &server.base_url(),
        &["--listen", &addr],
        Some(config),
    )
    .await;
    let token = std::fs::read_to_string(d.state_dir().join("token"))
        .unwrap()
        .trim()
        .to_owned();
    (d, addr, token)
}

/// Opens the page and gives it the token, as a person does once per tab.
async fn sign_in(b: &Browser, addr: &str, token: &str) {
    b.goto(&format!("http://{addr}/")).await;
    b.wait(
        "the token form",
        "return !document.getElementById('token-form').hidden",
        LIMIT,
    )
    .await;
    b.type_into("#token", token).await;
    b.click("#token-submit").await;
    b.wait(
        "the task list",
        "return document.getElementById('token-form').hidden && document.getElementById('task-text')",
        LIMIT,
    )
    .await;
}

const STATE: &str = "return document.getElementById('task-state').textContent";
const LIMIT: Duration = Duration::from_secs(30);

/// Submits the form (already filled but for the task text); the new task's id, once the
/// page has gone to the task's own link.
async fn submit(b: &Browser, task: &str) -> String {
    b.type_into("#task-text", task).await;
    b.click("#submit").await;
    let path = b
        .wait(
            "the task's own page",
            "return location.pathname.startsWith('/tasks/') && location.pathname",
            LIMIT,
        )
        .await;
    path.as_str()
        .unwrap()
        .trim_start_matches("/tasks/")
        .to_owned()
}

/// Opens the task list and waits for its form.
async fn open_list(b: &Browser, addr: &str) {
    b.goto(&format!("http://{addr}/")).await;
    b.wait(
        "the task list",
        "return document.getElementById('task-text')",
        LIMIT,
    )
    .await;
}

/// Waits until the task's end is on the page.
async fn wait_complete(b: &Browser, what: &str) {
    b.wait(
        what,
        "return document.getElementById('transcript').dataset.complete === 'true'",
        LIMIT,
    )
    .await;
}

/// Fails when the page is wider than a 390 px window.
async fn fits_a_phone(b: &Browser, what: &str) {
    b.resize(390, 844).await;
    let overflow = b
        .run(
            "return document.documentElement.scrollWidth - window.innerWidth",
            json!([]),
        )
        .await;
    assert!(
        overflow.as_i64().unwrap() <= 0,
        "{what} scrolls sideways at 390 px: {overflow}"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn the_page_submits_streams_approves_and_cancels_and_model_markup_stays_text() {
    let task = "web: approve me";
    let xss = "Look <script>window.__xss = 1</script><img src=x onerror=\"window.__xss = 2\"> here";
    let first = format!("{xss}\n```python\nprint('hello from the page')\n```");
    let other = "web: cancel me";
    let edited = "web: edit then deny";
    let server = ScriptedOpenAi::start(script([
        (
            task,
            vec![
                // Slow enough to be seen streaming, by a browser polled over WebDriver on a
                // loaded machine (each of its five pieces 400 ms after the last).
                Reply::Trickle(Duration::from_millis(400), first),
                "All done.\nTERMINATE".into(),
            ],
        ),
        (other, vec![Reply::from("```python\nprint('never')\n```")]),
        (
            edited,
            vec![
                Reply::from("```python\nprint(6 * 7)\n```"),
                Reply::from("```python\nprint('second')\n```"),
                "Understood.\nTERMINATE".into(),
            ],
        ),
    ]))
    .await
    .unwrap();
    let (d, addr, token) = start_tcp(&server, "[approval]\nmode = \"always\"\n").await;
    let b = Browser::start(1280, 900).await;
    sign_in(&b, &addr, &token).await;
    assert_eq!(
        b.run("return sessionStorage.getItem('tandem.token')", json!([]))
            .await,
        json!(token)
    );

    let id = submit(&b, task).await;
    // The reply streams in: part of it shows before the whole.
    let partial = b
        .wait(
            "streamed text",
            "const t = document.querySelector('.assistant-text'); return t && t.textContent",
            LIMIT,
        )
        .await;
    b.wait(
        "the approval card",
        "return document.querySelector('.approval .approve')",
        LIMIT,
    )
    .await;
    let whole = b
        .run(
            "return document.querySelector('.assistant-text').textContent",
            json!([]),
        )
        .await;
    let (partial, whole) = (partial.as_str().unwrap(), whole.as_str().unwrap());
    assert!(
        partial.len() < whole.len() && whole.starts_with(partial.trim_end()),
        "not streamed: {partial:?} then {whole:?}"
    );
    // The model's markup is characters on the page: no element made of it, nothing ran.
    assert!(whole.contains(xss), "{whole}");
    let made = b
        .run(
            "return document.querySelectorAll('#transcript img, #transcript script').length",
            json!([]),
        )
        .await;
    assert_eq!(made, json!(0));
    b.wait(
        "the waiting state",
        &format!("{STATE} === 'awaiting_approval'"),
        LIMIT,
    )
    .await;
    // The README's picture: the whole task, from its title to the waiting block.
    b.resize(1280, 1060).await;
    b.run("window.scrollTo(0, 0)", json!([])).await;
    shot(&b, "task-awaiting-approval.png").await;
    b.resize(1280, 900).await;

    b.click(".approval .approve").await;
    wait_complete(&b, "the task's end").await;
    b.wait(
        "the finished state",
        &format!("{STATE} === 'finished'"),
        LIMIT,
    )
    .await;
    let output = b
        .run(
            "return [...document.querySelectorAll('.output')].map(o => o.textContent).join('')",
            json!([]),
        )
        .await;
    assert!(
        output.as_str().unwrap().contains("hello from the page"),
        "{output}"
    );
    assert_eq!(
        b.run("return typeof window.__xss", json!([])).await,
        json!("undefined")
    );
    assert!(
        !b.run("return location.href", json!([]))
            .await
            .as_str()
            .unwrap()
            .contains(&token),
        "the token is never in a URL"
    );
    let t = d.task(&id).await;
    assert_eq!(t.record.stop_reason, Some(StopReason::Terminated));
    shot(&b, "task.png").await;
    fits_a_phone(&b, "the task page").await;
    shot(&b, "task-phone.png").await;
    b.resize(1280, 900).await;

    // Another task, cancelled while its block waits.
    open_list(&b, &addr).await;
    submit(&b, other).await;
    b.wait(
        "the approval card",
        "return document.querySelector('.approval .approve')",
        LIMIT,
    )
    .await;
    b.click("#cancel").await;
    b.wait(
        "the finished state",
        &format!("{STATE} === 'finished'"),
        LIMIT,
    )
    .await;
    let stop = b
        .run(
            "return document.getElementById('task-stop').textContent",
            json!([]),
        )
        .await;
    assert_eq!(stop, json!("cancelled"));

    // Edited on the page, then denied with a reason the model hears.
    open_list(&b, &addr).await;
    submit(&b, edited).await;
    let card = |n: u32, part: &str| format!(".approval[data-n=\"{n}\"] {part}");
    b.wait(
        "the first card",
        &format!(
            "return document.querySelector('{}')",
            card(1, ".approve-edited")
        ),
        LIMIT,
    )
    .await;
    b.run(
        &format!(
            "document.querySelector('{}').value = 'print(6 * 9)'",
            card(1, ".approval-code")
        ),
        json!([]),
    )
    .await;
    b.click(&card(1, ".approve-edited")).await;
    b.wait(
        "the second card",
        &format!("return document.querySelector('{}')", card(2, ".deny")),
        LIMIT,
    )
    .await;
    b.type_into(&card(2, ".approval-reason"), "not needed")
        .await;
    b.click(&card(2, ".deny")).await;
    wait_complete(&b, "the end").await;
    let output = b
        .run(
            "return [...document.querySelectorAll('.output')].map(o => o.textContent).join('|')",
            json!([]),
        )
        .await;
    assert!(output.as_str().unwrap().contains("54"), "{output}");
    let requests = server.requests_for(edited);
    let told = requests[2].last_message().unwrap_or_default().to_owned();
    assert!(
        told.contains("the user declined to run this block: not needed"),
        "{told}"
    );
    // The list shows the tasks, live, with their states.
    b.goto(&format!("http://{addr}/")).await;
    let rows = b
        .wait(
            "three rows",
            "const r = [...document.querySelectorAll('.task-row')]; return r.length === 3 && r.map(x => x.querySelector('.state').textContent + ' ' + x.querySelector('.stop').textContent)",
            LIMIT,
        )
        .await;
    assert_eq!(
        rows,
        json!([
            "finished terminated",
            "finished cancelled",
            "finished terminated"
        ])
    );
    shot(&b, "list.png").await;
    // Live: a task submitted elsewhere appears without a reload.
    d.submit(json!({ "task": "web: submitted elsewhere" }))
        .await;
    b.wait(
        "the new row, live",
        "return document.querySelectorAll('.task-row').length === 4",
        LIMIT,
    )
    .await;
    // The form takes an executor and a team file, which the daemon turns into the task's team.
    b.wait(
        "the executors",
        "return document.querySelector('#executor option[value=local]')",
        LIMIT,
    )
    .await;
    b.click("#executor option[value=local]").await;
    let team_file = Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples/teams/review.toml");
    b.type_into(
        "#team-file",
        &team_file.canonicalize().unwrap().display().to_string(),
    )
    .await;
    let id = submit(&b, "web: a team").await;
    let t = d.task(&id).await;
    assert_eq!(t.record.spec.task, "web: a team");
    assert_eq!(t.record.spec.executor.as_deref(), Some("local"));
    // `agents` is left out of the JSON when empty: an object there is a non-empty map.
    assert!(
        t.record
            .spec
            .team
            .as_ref()
            .is_some_and(|team| !team.agents.is_empty()),
        "{t:?}"
    );
    b.goto(&format!("http://{addr}/")).await;
    b.wait(
        "five rows",
        "return document.querySelectorAll('.task-row').length === 5",
        LIMIT,
    )
    .await;
    fits_a_phone(&b, "the list").await;
    shot(&b, "list-phone.png").await;
    b.quit().await;
}

/// A store with `tasks` finished tasks and one whose transcript is `events` events long;
/// returns that task's id.
fn fill_store(path: &Path, tasks: usize, events: usize) -> String {
    let store = Store::open(path).unwrap();
    let now = 1_700_000_000_000;
    let finished = |turns| EventMsg::TaskFinished {
        stop_reason: StopReason::Terminated,
        turns,
        usage: Usage::default(),
        elapsed_ms: 1000,
        error: None,
        summary: Some("42".to_owned()),
        check: None,
        cost: None,
        budget: None,
        result: None,
        answer: None,
        answer_from: None,
        no_answer: None,
    };
    let spec = |task: String| {
        Box::new(TaskSpec {
            task,
            ..TaskSpec::default()
        })
    };
    let mut batch = Vec::new();
    for i in 0..tasks {
        let id = format!("bulk{i:06}");
        batch.push(Change::Create(
            id.clone(),
            spec(format!("task number {i}")),
            now + i as u64,
        ));
        batch.push(Change::Event(id, finished(1), now + i as u64));
        if batch.len() >= 2000 {
            store.apply(&batch).unwrap();
            batch.clear();
        }
    }
    let big = "bigtranscript".to_owned();
    batch.push(Change::Create(
        big.clone(),
        spec("a long task".to_owned()),
        now + tasks as u64,
    ));
    let mut msgs = vec![EventMsg::TaskStarted {
        task: "a long task".to_owned(),
        model: "m".to_owned(),
        base_url: "http://127.0.0.1:1/v1".to_owned(),
        executor: "local".to_owned(),
        trace: None,
    }];
    let mut turn = 0;
    // Ten events a turn, as a real one: streamed text, the reply, a block, its output.
    while msgs.len() + 10 < events {
        turn += 1;
        msgs.push(EventMsg::TurnStarted { turn, agent: None });
        for piece in ["Let me ", "compute it ", "with code."] {
            msgs.push(EventMsg::AssistantDelta {
                turn,
                text: piece.to_owned(),
            });
        }
        let code = format!("print({turn} * 2)");
        msgs.push(EventMsg::AssistantMessage {
            turn,
            text: format!("Let me compute it with code.\n```python\n{code}\n```"),
            usage: None,
            tool_calls: Vec::new(),
        });
        msgs.push(EventMsg::CodeBlock {
            turn,
            index: 1,
            language: Some("python".to_owned()),
            code,
        });
        let out = format!("{}\n", turn * 2);
        msgs.push(EventMsg::ExecOutput {
            turn,
            index: 1,
            stream: OutputStream::Stdout,
            text: out.clone(),
        });
        msgs.push(EventMsg::ExecOutput {
            turn,
            index: 1,
            stream: OutputStream::Stderr,
            text: "a warning\n".to_owned(),
        });
        msgs.push(EventMsg::ExecResult {
            turn,
            index: 1,
            result: BlockResult {
                language: Some("python".to_owned()),
                status: BlockStatus::Exited,
                exit_code: Some(0),
                stdout: out.clone(),
                stderr: "a warning\n".to_owned(),
                truncated: false,
                duration_ms: 7,
                resources: None,
            },
        });
        msgs.push(EventMsg::ExecutorMessage {
            turn,
            text: format!("exitcode: 0 (execution succeeded)\nYour code printed: {out}"),
            tool_results: Vec::new(),
        });
    }
    while msgs.len() + 1 < events {
        msgs.push(EventMsg::TurnStarted {
            turn: turn + 1,
            agent: None,
        });
    }
    msgs.push(finished(turn));
    for m in msgs {
        batch.push(Change::Event(big.clone(), m, now));
    }
    // A team task whose `refine` chat is nested in the top team.
    let team = "nestedteam";
    batch.push(Change::Create(
        team.to_owned(),
        spec("a team task".to_owned()),
        now + tasks as u64 + 1,
    ));
    let said = |turn, agent: &str, text: &str| {
        [
            EventMsg::TurnStarted {
                turn,
                agent: Some(agent.to_owned()),
            },
            EventMsg::AssistantMessage {
                turn,
                text: text.to_owned(),
                usage: None,
                tool_calls: Vec::new(),
            },
        ]
    };
    let mut team_msgs = vec![EventMsg::TaskStarted {
        task: "a team task".to_owned(),
        model: "m".to_owned(),
        base_url: "http://127.0.0.1:1/v1".to_owned(),
        executor: "team".to_owned(),
        trace: None,
    }];
    team_msgs.extend(said(1, "team/writer", "a draft"));
    team_msgs.extend(said(2, "team/refine/critic", "too long"));
    team_msgs.extend(said(3, "team/refine/editor", "shorter"));
    team_msgs.push(EventMsg::TeamEnded {
        agent: "team/refine".to_owned(),
        by: "critic said STOP".to_owned(),
    });
    team_msgs.extend(said(4, "team/writer", "final"));
    team_msgs.push(finished(4));
    for m in team_msgs {
        batch.push(Change::Event(team.to_owned(), m, now));
    }
    store.apply(&batch).unwrap();
    big
}

#[tokio::test(flavor = "multi_thread")]
async fn ten_thousand_tasks_and_a_five_thousand_event_transcript_stay_usable() {
    let server = ScriptedOpenAi::start(Script::new()).await.unwrap();
    let (mut d, addr, token) = start_tcp(&server, "").await;
    d.terminate().await;
    let big = fill_store(&d.state_dir().join("tandem.db"), 10_000, 5_000);
    d.spawn().await;
    assert_eq!(d.count("finished").await, 10_002);
    let stored = d.events(&big, 0).await;
    assert_eq!(stored.len(), 5_000);

    let b = Browser::start(1280, 900).await;
    sign_in(&b, &addr, &token).await;
    // A fresh load of the list, token already given: the first page only, from the server.
    b.goto(&format!("http://{addr}/")).await;
    let list_ms = b
        .wait(
            "the first page",
            "return window.tandemTiming && window.tandemTiming.listRendered",
            LIMIT,
        )
        .await;
    let rows = b
        .run(
            "return document.querySelectorAll('.task-row').length",
            json!([]),
        )
        .await;
    assert_eq!(rows, json!(50));
    b.click("#load-more").await;
    b.wait(
        "the second page",
        "return document.querySelectorAll('.task-row').length === 100",
        LIMIT,
    )
    .await;

    let started = Instant::now();
    b.goto(&format!("http://{addr}/tasks/{big}")).await;
    let timing: Value = b
        .wait(
            "the whole transcript",
            "const t = window.tandemTiming; return t && t.complete && t",
            LIMIT,
        )
        .await;
    let wall = started.elapsed();
    let render_ms = timing["complete"].as_f64().unwrap() - timing["start"].as_f64().unwrap();
    let blocks = b
        .run(
            "return document.querySelectorAll('#transcript .code-block').length",
            json!([]),
        )
        .await;
    assert_eq!(
        blocks.as_u64().unwrap(),
        499,
        "every turn's block is on the page"
    );
    shot(&b, "long-transcript.png").await;
    // The baseline, in the same browser: 5000 bare text rows put on a page and laid out.
    let bare_ms = b
        .run(
            "const t0 = performance.now(); const f = document.createDocumentFragment(); \
             for (let i = 0; i < 5000; i++) { const d = document.createElement('div'); \
             d.textContent = 'event ' + i; f.append(d); } \
             const host = document.createElement('div'); host.append(f); \
             document.body.append(host); void document.body.offsetHeight; \
             const ms = performance.now() - t0; host.remove(); return ms",
            json!([]),
        )
        .await;
    // The figures docs/benchmarks.md records; a bound far above them only catches a page
    // that has become quadratic.
    let bare_ms = bare_ms.as_f64().unwrap();
    eprintln!(
        "web: list of 10001 tasks, first page on screen {:.0} ms after navigation; \
         5000-event transcript rendered in {render_ms:.0} ms (page start to task_finished \
         shown), {:.0} ms wall including the page load; 5000 bare text rows {bare_ms:.0} ms \
         ({:.1}x)",
        list_ms.as_f64().unwrap(),
        wall.as_secs_f64() * 1000.0,
        render_ms / bare_ms.max(0.1)
    );
    assert!(render_ms < 10_000.0, "{render_ms} ms");

    // A nested team's turns are folded under its path; the top team's are not.
    b.goto(&format!("http://{addr}/tasks/nestedteam")).await;
    wait_complete(&b, "the team transcript").await;
    let folded = b
        .run(
            "return [...document.querySelectorAll('#transcript details.nested')].map(d => \
             [d.open, d.querySelector('summary').textContent, \
              [...d.querySelectorAll('.speaker')].map(s => s.textContent)])",
            json!([]),
        )
        .await;
    assert_eq!(
        folded,
        json!([[false, "team/refine · 2 turns", ["critic", "editor"]]])
    );
    let top = b
        .run(
            "return [...document.querySelectorAll('#transcript > .turn .speaker, #transcript > section.turn .speaker')].map(s => s.textContent)",
            json!([]),
        )
        .await;
    assert_eq!(top, json!(["writer", "writer"]));
    b.quit().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn the_page_is_served_without_the_token_under_a_strict_policy_and_the_api_is_not() {
    let server = ScriptedOpenAi::start(Script::new()).await.unwrap();
    let (d, addr, token) = start_tcp(&server, "").await;
    let http = reqwest::Client::new();
    for (path, kind) in [
        ("/", "text/html; charset=utf-8"),
        ("/tasks/anything", "text/html; charset=utf-8"),
        ("/assets/app.js", "text/javascript; charset=utf-8"),
        ("/assets/app.css", "text/css; charset=utf-8"),
    ] {
        let resp = http
            .get(format!("http://{addr}{path}"))
            .send()
            .await
            .unwrap();
        assert_eq!(resp.status(), 200, "{path}");
        let h = resp.headers();
        assert_eq!(h["content-type"], kind, "{path}");
        assert_eq!(
            h["content-security-policy"],
            "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; img-src 'self' data: blob:; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
        );
        assert_eq!(h["x-content-type-options"], "nosniff");
        let body = resp.text().await.unwrap();
        assert!(!body.contains(&token), "the page never carries the token");
    }
    // The page holds no data: without the token, the API it calls answers 401.
    for path in ["/v1/tasks?limit=50", "/v1/executors", "/v1/tasks/x/events"] {
        let resp = http
            .get(format!("http://{addr}{path}"))
            .send()
            .await
            .unwrap();
        assert_eq!(resp.status(), 401, "{path}");
    }
    // A page that only inserts text, and no inline script for the policy to need.
    let html = d.text("/").await;
    assert!(!html.contains("<script>") && !html.contains(" style=") && !html.contains(" onclick="));
    let js = d.text("/assets/app.js").await;
    for sink in [
        "innerHTML",
        "outerHTML",
        "insertAdjacentHTML",
        "document.write",
        "eval(",
    ] {
        assert!(!js.contains(sink), "app.js uses {sink}");
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn the_page_uploads_a_file_and_shows_the_chart_the_task_drew() {
    let csv = "month,revenue\n1,10\n2,32\n3,18\n";
    let told = format!(
        "web: plot it\n\nFiles in your working directory (the current directory):\n\
         - sales.csv ({} bytes)\n    month,revenue\n    1,10\n    2,32\n    3,18",
        csv.len()
    );
    let code = "import pandas as pd\nimport matplotlib.pyplot as plt\n\
                df = pd.read_csv('sales.csv')\ndf.plot(x='month', y='revenue')\n\
                plt.savefig('chart.png')\nprint(len(df))\n\
                open('bad\\x1b[2J\\nname.txt', 'w').write('x')";
    let server = ScriptedOpenAi::start(script([(
        told.as_str(),
        vec![
            Reply::from(format!("```python\n{code}\n```").as_str()),
            Reply::from("Here is the chart.\nTERMINATE"),
        ],
    )]))
    .await
    .unwrap();
    let addr = free_addr();
    let d = Daemon::start(
        Path::new(env!("CARGO_BIN_EXE_tandem")),
        &server.base_url(),
        &["--listen", &addr, "--executor", "docker"],
        Some(""),
    )
    .await;
    let token = std::fs::read_to_string(d.state_dir().join("token"))
        .unwrap()
        .trim()
        .to_owned();
    let data = tempfile::tempdir().unwrap();
    let file = data.path().join("sales.csv");
    std::fs::write(&file, csv).unwrap();
    let b = Browser::start(1280, 1000).await;
    sign_in(&b, &addr, &token).await;
    // The file input takes a path, as a person picking the file does.
    b.type_into("#data-files", file.to_str().unwrap()).await;
    b.click("#keep-state").await;
    let id = submit(&b, "web: plot it").await;
    wait_complete(&b, "the task's end").await;
    let drawn = b
        .wait(
            "the chart, loaded",
            "const img = document.querySelector('figure.artifact img'); \
             return img && img.complete && img.naturalWidth > 0 && [img.naturalWidth, img.naturalHeight, img.alt]",
            LIMIT,
        )
        .await;
    // matplotlib's default figure: 6.4 x 4.8 inches at 100 dpi.
    assert_eq!(drawn, json!([640, 480, "chart.png"]));
    let files = b
        .wait(
            "the file list",
            "const items = [...document.querySelectorAll('#file-list a')].map((a) => a.textContent); \
             return items.length >= 3 && items",
            LIMIT,
        )
        .await;
    // A name the code chose shows escaped, on one line, as the CLI shows it.
    assert_eq!(
        files,
        json!(["bad\\u{1b}[2J\\u{a}name.txt", "chart.png", "sales.csv"])
    );
    b.run(
        "document.querySelector('figure.artifact').scrollIntoView()",
        json!([]),
    )
    .await;
    shot(&b, "task-with-chart.png").await;
    // What the page shows is the task's own file.
    let t = d.task(&id).await;
    assert_eq!(t.record.stop_reason, Some(StopReason::Terminated), "{t:?}");
    // The form's box asked for a kept interpreter, and the task had one.
    assert!(t.record.spec.keep_state, "{t:?}");
    b.quit().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn the_page_asks_for_tool_calls_and_shows_each_call_with_its_answer() {
    let task = "web: tools";
    let server = ScriptedOpenAi::start(script([(
        task,
        vec![
            Reply::Calls(
                String::new(),
                vec![
                    tandem_tests::call("c1", "wc", r#"{"text": "one two three"}"#),
                    tandem_tests::call(
                        "c2",
                        "execute_code",
                        r#"{"language": "python", "code": "print(6 * 7)"}"#,
                    ),
                ],
            ),
            Reply::from("3 and 42.\nTERMINATE"),
        ],
    )]))
    .await
    .unwrap();
    let addr = free_addr();
    // Traces to a port where nothing listens: the spans are dropped, the task keeps its trace id.
    let config = "[telemetry]\nendpoint = \"http://127.0.0.1:9\"\nexport_timeout_secs = 1\n\n[model.prices.\"gpt-4o-mini\"]\ninput = 1.0\noutput = 1.0\n\n[tools.wc]\ncommand = [\"python3\", \"-c\", \"import json, sys; print(len(json.load(sys.stdin)['text'].split()))\"]\n";
    let d = Daemon::start(
        Path::new(env!("CARGO_BIN_EXE_tandem")),
        &server.base_url(),
        &["--listen", &addr],
        Some(config),
    )
    .await;
    let token = std::fs::read_to_string(d.state_dir().join("token"))
        .unwrap()
        .trim()
        .to_owned();
    let b = Browser::start(1280, 1000).await;
    sign_in(&b, &addr, &token).await;
    b.run(
        "document.querySelector('#code-via').value = 'tool'",
        json!([]),
    )
    .await;
    // A schema that is not JSON is named before anything is sent.
    b.type_into("#output-schema", "{not json").await;
    b.type_into("#task-text", task).await;
    b.click("#submit").await;
    let error = b
        .wait(
            "the schema's error",
            "const e = document.querySelector('#submit-error').textContent; return e && e",
            LIMIT,
        )
        .await;
    assert!(
        error
            .as_str()
            .is_some_and(|e| e.starts_with("Output schema is not JSON")),
        "{error}"
    );
    b.run(
        "document.querySelector('#output-schema').value = ''; document.querySelector('#task-text').value = ''",
        json!([]),
    )
    .await;
    b.type_into("#max-input-tokens", "100000").await;
    b.type_into("#max-output-tokens", "5000").await;
    b.type_into("#max-cost", "0.5").await;
    b.type_into("#candidates", "3").await;
    let id = submit(&b, task).await;
    wait_complete(&b, "the task's end").await;
    let calls = b
        .wait(
            "both calls, answered",
            "const cards = [...document.querySelectorAll('.tool-call')]; \
             return cards.length === 2 && cards.every((c) => c.querySelector('.result')) && \
               cards.map((c) => [c.querySelector('.lang').textContent, \
                 (c.querySelector('pre.output') || {}).textContent || null, \
                 c.querySelector('.result').textContent.split(' · ')[0]])",
            LIMIT,
        )
        .await;
    assert_eq!(
        calls,
        json!([
            ["call wc", "3\n", "answered"],
            ["call execute_code", null, "answered"]
        ])
    );
    // The execute_code call's code and output are its block's, and its result line says
    // what it used.
    let block = b
        .run(
            "const b = document.querySelector('.code-block'); return [b.querySelector('code').textContent, b.querySelector('pre.output').textContent, b.querySelector('.result').textContent]",
            json!([]),
        )
        .await;
    let block = block.as_array().cloned().unwrap_or_default();
    assert_eq!(
        block.get(..2),
        Some(&[json!("print(6 * 7)"), json!("42\n")][..]),
        "{block:?}"
    );
    let result = block.get(2).and_then(|r| r.as_str()).unwrap_or_default();
    assert!(
        result.starts_with("exited 0 · ")
            && result.contains(" · cpu ")
            && result.contains(" · peak "),
        "{result}"
    );
    let t = d.task(&id).await;
    assert_eq!(t.record.spec.code_via, Some(CodeVia::Tool), "{t:?}");
    assert_eq!(t.record.spec.candidates, Some(3), "{t:?}");
    // The task's header names its trace.
    let trace = t.record.trace_id.clone().expect("a trace id");
    let meta = b
        .wait(
            "the trace in the header",
            "const m = document.querySelector('#task-meta').textContent; return m.includes('trace ') && m",
            LIMIT,
        )
        .await;
    assert!(
        meta.as_str()
            .is_some_and(|m| m.ends_with(&format!("trace {trace}"))),
        "{meta}"
    );
    // The budgets the form was given are the task's.
    let spec = &t.record.spec;
    assert_eq!(
        (spec.max_input_tokens, spec.max_output_tokens, spec.max_cost),
        (Some(100_000), Some(5000), Some(0.5)),
        "{t:?}"
    );
    b.quit().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn the_page_lists_the_docker_hosts_and_places_a_task_by_label() {
    let task = "web: placed";
    let server = ScriptedOpenAi::start(script([(
        task,
        vec![
            Reply::from("```python\nprint('on a')\n```"),
            Reply::from("TERMINATE"),
        ],
    )]))
    .await
    .unwrap();
    let image =
        std::env::var("TANDEM_DOCKER_IMAGE").unwrap_or_else(|_| "tandem-sandbox:latest".to_owned());
    let config = format!(
        "[executors.docker]\nimage = \"{image}\"\npull = false\npool_size = 0\n\n\
         [[executors.docker.hosts]]\nname = \"a\"\nurl = \"unix:///var/run/docker.sock\"\ncapacity = 3\nlabels = {{ zone = \"a\" }}\n\n\
         [[executors.docker.hosts]]\nname = \"b\"\nurl = \"tcp://127.0.0.1:1\"\nlabels = {{ zone = \"b\" }}\n"
    );
    let (d, addr, token) = start_tcp(&server, &config).await;
    let b = Browser::start(1280, 1000).await;
    sign_in(&b, &addr, &token).await;
    let hosts = b
        .wait(
            "the hosts under the executor",
            "const l = document.getElementById('hosts'); \
             return !l.hidden && !document.getElementById('placement-row').hidden && \
               [...l.children].map((li) => [li.className, li.textContent.split(' · ').slice(0, 2).join(' · ')])",
            LIMIT,
        )
        .await;
    assert_eq!(
        hosts,
        json!([
            ["host-up", "docker host a · up"],
            [
                "host-down",
                "docker host b · down: tcp connect error: Connection refused (os error 111)"
            ]
        ])
    );
    shot(&b, "docker-hosts.png").await;
    b.run(
        "document.querySelector('#executor').value = 'docker'; document.querySelector('#placement').value = 'zone=a'",
        json!([]),
    )
    .await;
    let id = submit(&b, task).await;
    wait_complete(&b, "the placed task's end").await;
    let t = d.task(&id).await;
    assert_eq!(
        t.record.spec.placement,
        std::collections::BTreeMap::from([("zone".to_owned(), "a".to_owned())]),
        "{t:?}"
    );
    let out = b
        .run(
            "return document.querySelector('.code-block pre.output').textContent",
            json!([]),
        )
        .await;
    assert_eq!(out, json!("on a\n"));
    b.quit().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn the_page_shows_what_the_embedded_models_engine_does() {
    let models = crate::embedded::models_dir();
    let addr = free_addr();
    let d = Daemon::start_with_env(
        Path::new(env!("CARGO_BIN_EXE_tandem")),
        "http://127.0.0.1:9/v1",
        &["--listen", &addr],
        Some("[model]\nprovider = \"embedded\"\nmodel = \"qwen2.5-coder-0.5b\"\ncontext_tokens = 2048\ncache_tokens = 4096\n"),
        &[("TANDEM_MODELS_DIR", models.as_str())],
    )
    .await;
    let token = std::fs::read_to_string(d.state_dir().join("token"))
        .unwrap()
        .trim()
        .to_owned();
    let b = Browser::start(1280, 900).await;
    sign_in(&b, &addr, &token).await;
    let line = "const l = document.getElementById('engine'); return !l.hidden && l.textContent";
    let idle = b.wait("the engine's line", line, LIMIT).await;
    assert_eq!(
        idle,
        json!(
            "Model engine: 0 live, 0 waiting, 0 kept · batch of 0 (0 tokens) · 0.0 tokens/s generated, 0.0 read · cache 0 of 4096 tokens · 0 evictions, 0 pauses"
        )
    );
    // A conversation the model answers is then kept in its cache, and the line says so.
    let resp = reqwest::Client::new()
        .post(format!("http://{addr}/v1/chat/completions"))
        .bearer_auth(&token)
        .json(&json!({"messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 4}))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    let kept = b
        .wait(
            "the kept conversation on the line",
            "const t = document.getElementById('engine').textContent; return t.includes(', 1 kept') && t",
            LIMIT,
        )
        .await;
    let kept = kept.as_str().unwrap();
    assert!(
        kept.starts_with("Model engine: 0 live, 0 waiting, 1 kept"),
        "{kept}"
    );
    assert!(!kept.contains("cache 0 of"), "{kept}");
    shot(&b, "engine.png").await;
}

#[tokio::test(flavor = "multi_thread")]
async fn the_page_says_which_drawn_reply_was_kept_and_that_the_same_code_came_again() {
    let drawing = "web: draw. Write `add(a, b)`.\n\n    >>> add(2, 3)\n    5\n";
    let resending = "web: send the same code again";
    // The model's own reply fails the example; the third sampled beside it holds it.
    let own = "```python\ndef add(a, b):\n    return a * b\n```";
    let right = "```python\ndef add(a, b):\n    return a + b\n```";
    let again = "```python\nprint('the same')\n```";
    let server = ScriptedOpenAi::start(script([
        (drawing, vec![Reply::from(own)]),
        (
            resending,
            vec![
                Reply::from(again),
                Reply::from(again),
                "not asked: the same code ran the same".into(),
            ],
        ),
    ]))
    .await
    .unwrap();
    let drawn = ["No code needed.", "I am sure it is right.", right];
    for (seed, text) in (1001..).zip(drawn) {
        server.set(&format!("{drawing}~{seed}"), vec![Reply::from(text)]);
    }
    let (d, addr, token) = start_tcp(&server, "").await;
    let drew = d
        .submit(json!({"task": drawing, "executor": "local"}))
        .await;
    let resent = d
        .submit(json!({"task": resending, "executor": "local"}))
        .await;
    let b = Browser::start(1280, 900).await;
    sign_in(&b, &addr, &token).await;

    b.goto(&format!("http://{addr}/tasks/{drew}")).await;
    wait_complete(&b, "the drawing task's end").await;
    // The note on the draw, the replies told (only the kept one), and the summary's title.
    let seen = b
        .run(
            "const texts = (q) => [...document.querySelectorAll(q)].map(n => n.textContent); return [texts('.drawn'), texts('.assistant-text'), texts('#summary h3')]",
            json!([]),
        )
        .await;
    assert_eq!(
        seen,
        json!([
            [
                "the task's examples do not all hold against its code: drew 3 more replies; kept drawn reply 3, which holds 1 of 1"
            ],
            [right],
            ["done: the task's examples hold"]
        ])
    );
    shot(&b, "drawn.png").await;

    b.goto(&format!("http://{addr}/tasks/{resent}")).await;
    wait_complete(&b, "the resending task's end").await;
    let seen = b
        .run(
            "return [document.querySelector('#summary h3').textContent, document.getElementById('task-stop').textContent, document.getElementById('task-stop').title]",
            json!([]),
        )
        .await;
    assert_eq!(
        seen,
        json!([
            "the same code sent again",
            "repeated",
            "the same code sent again"
        ])
    );
    // A task that stopped without a statement answers with what its code printed, marked.
    let answer = b
        .run(
            "return [document.querySelector('#summary .answer-from').textContent, document.querySelector('#summary .answer').textContent]",
            json!([]),
        )
        .await;
    assert_eq!(answer, json!(["answer: what the code printed", "the same"]));
    assert_eq!(
        d.task(&resent).await.record.stop_reason,
        Some(StopReason::Repeated)
    );
    assert_eq!(server.requests_for(resending).len(), 2);
    shot(&b, "repeated.png").await;
}

#[tokio::test(flavor = "multi_thread")]
async fn the_page_asks_for_hosts_and_shows_each_connection_and_a_refusal_names_the_host() {
    let net = tandem_tests::internet::Internet::new();
    net.http_server(80);
    let task = "web: fetch files.test";
    let fetch = "import urllib.request, urllib.error\n\
                 print(urllib.request.urlopen('http://files.test/hello', timeout=30).read().decode().splitlines()[0])\n\
                 try:\n    urllib.request.urlopen('http://other.test/', timeout=30)\n\
                 except urllib.error.HTTPError as e:\n    print('other:', e.code)\n";
    let server = ScriptedOpenAi::start(script([(
        task,
        vec![
            Reply::Text(format!("```python\n{fetch}```")),
            Reply::from("Fetched.\n\nTERMINATE"),
        ],
    )]))
    .await
    .unwrap();
    let config = format!(
        "[network]\nallow = [\"files.test\"]\nresolve = {{ \"files.test\" = [\"{}\"] }}\n",
        net.addr
    );
    let (d, addr, token) = start_tcp(&server, &config).await;
    let b = Browser::start(1280, 1000).await;
    sign_in(&b, &addr, &token).await;
    // Outside what the daemon allows: the form says so, naming the host.
    b.run(
        "document.querySelector('#executor').value = 'docker'; document.querySelector('#allow-hosts').value = 'evil.test'",
        json!([]),
    )
    .await;
    b.type_into("#task-text", task).await;
    b.click("#submit").await;
    let said = b
        .wait(
            "the refusal",
            "const e = document.getElementById('submit-error'); return e.textContent.includes('evil.test') && e.textContent",
            LIMIT,
        )
        .await;
    assert!(
        said.as_str().unwrap_or_default().contains("evil.test"),
        "{said}"
    );
    // Within it: the task's sandbox reaches the host, and each connection is shown.
    b.run(
        "document.querySelector('#allow-hosts').value = 'files.test'; document.querySelector('#task-text').value = ''",
        json!([]),
    )
    .await;
    let id = submit(&b, task).await;
    wait_complete(&b, "the task's end").await;
    let t = d.task(&id).await;
    assert_eq!(
        t.record.spec.network.as_ref().map(|n| n.allow.clone()),
        Some(vec!["files.test".to_owned()])
    );
    let mut lines: Vec<String> = b
        .run(
            "return [...document.querySelectorAll('.net')].map((n) => n.textContent)",
            json!([]),
        )
        .await
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_str().unwrap_or_default().to_owned())
        .collect();
    lines.sort();
    assert_eq!(lines.len(), 2, "{lines:?}");
    assert!(
        lines[0].starts_with("net: files.test:80 allowed by files.test"),
        "{lines:?}"
    );
    assert!(
        lines[1].starts_with("net: other.test:80 denied (rule default)"),
        "{lines:?}"
    );
    shot(&b, "network.png").await;
    b.quit().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn the_page_links_a_tasks_open_port_and_the_served_page_cannot_read_the_token() {
    let task = "web: serve on 8000";
    let server = crate::ports::serving_model(task).await;
    let (d, addr, token) = start_tcp(&server, "").await;
    let b = Browser::start(1280, 1000).await;
    sign_in(&b, &addr, &token).await;
    // Docker publishes ports; the local executor ends a server with its block.
    b.wait(
        "the docker executor",
        "return document.querySelector('#executor option[value=docker]')",
        LIMIT,
    )
    .await;
    b.run(
        "document.querySelector('#executor').value = 'docker'",
        json!([]),
    )
    .await;
    let id = submit(&b, task).await;
    // Once the first block has left the server listening, the page links its port.
    b.wait(
        "the open port's link",
        "const a = document.querySelector('#port-list a[data-port=\"8000\"]'); return a && !document.getElementById('ports').hidden && a.textContent",
        Duration::from_secs(120),
    )
    .await;
    shot(&b, "port-link.png").await;
    b.click("#port-list a[data-port=\"8000\"]").await;
    let link = b
        .wait(
            "the signed link",
            "return document.querySelector('#port-list a[data-port=\"8000\"]').dataset.link",
            LIMIT,
        )
        .await;
    let link = link.as_str().unwrap().to_owned();
    assert!(link.starts_with("/v1/ports/"), "{link}");
    // The link opens the server's page with no token; that page runs in an origin of its
    // own, where the daemon's page keeps nothing it can read.
    b.goto(&format!("http://{addr}{link}done")).await;
    let body = b
        .wait(
            "the server's page",
            "return document.body && document.body.innerText",
            LIMIT,
        )
        .await;
    assert!(
        body.as_str()
            .unwrap()
            .starts_with("hello from the sandbox\npath /done\nauthorization None"),
        "{body}"
    );
    let storage = b
        .run(
            "try { return 'read: ' + sessionStorage.getItem('tandem.token'); } catch (e) { return 'refused: ' + e.name; }",
            json!([]),
        )
        .await;
    assert_eq!(storage, "refused: SecurityError");
    let cookie = b
        .run(
            "try { return 'read: ' + document.cookie; } catch (e) { return 'refused: ' + e.name; }",
            json!([]),
        )
        .await;
    assert_eq!(cookie, "refused: SecurityError");
    d.wait_finished(&id, Duration::from_secs(300)).await;
    let printed = d.block_stdouts(&id).await.join("");
    assert!(
        printed.contains("visited\n") && !printed.contains("never"),
        "{printed}"
    );
    b.quit().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn the_page_snapshots_a_finished_task_and_starts_a_new_task_from_it() {
    let server = ScriptedOpenAi::start(script([
        (
            "web: make the data",
            vec![
                Reply::from("```sh\necho 42 > answer.txt\n```"),
                Reply::from("Made.\nTERMINATE"),
            ],
        ),
        // The task from the snapshot is told of its files, so it is scripted for any text.
        (
            "*",
            vec![
                Reply::from("```python\nprint(open('answer.txt').read().strip())\n```"),
                Reply::from("Read.\nTERMINATE"),
            ],
        ),
    ]))
    .await
    .unwrap();
    let (d, addr, token) = start_tcp(&server, "").await;
    let b = Browser::start(1280, 1000).await;
    sign_in(&b, &addr, &token).await;
    let first = submit(&b, "web: make the data").await;
    wait_complete(&b, "the first task's end").await;
    b.wait(
        "the snapshot button, enabled",
        "return !document.getElementById('snapshot').disabled",
        LIMIT,
    )
    .await;
    b.click("#snapshot").await;
    let snap = b
        .wait(
            "the snapshot taken",
            "const p = document.getElementById('snapshot-taken'); return !p.hidden && p.dataset.id",
            LIMIT,
        )
        .await;
    let snap = snap.as_str().unwrap().to_owned();
    assert!(snap.starts_with("snap_"), "{snap}");
    let record = d.get(&format!("/v1/snapshots/{snap}")).await;
    assert_eq!(record["source"]["id"], first.as_str(), "{record}");
    shot(&b, "task-snapshot.png").await;

    open_list(&b, &addr).await;
    b.wait(
        "the snapshot among those to start from",
        &format!(
            "return [...document.querySelectorAll('#from-snapshot option')].some((o) => o.value === '{snap}')"
        ),
        LIMIT,
    )
    .await;
    b.run(
        &format!("document.querySelector('#from-snapshot').value = '{snap}'"),
        json!([]),
    )
    .await;
    let second = submit(&b, "web: read the data").await;
    wait_complete(&b, "the second task's end").await;
    assert_eq!(d.block_stdouts(&second).await, ["42\n"]);
    b.quit().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn the_page_mounts_a_volume_a_task_writes_into() {
    let server = ScriptedOpenAi::start(script([(
        "web: keep the answer",
        vec![
            Reply::from("```sh\necho 42 > data/answer.txt\n```"),
            Reply::from("Kept.\nTERMINATE"),
        ],
    )]))
    .await
    .unwrap();
    let (d, addr, token) = start_tcp(&server, "").await;
    let (status, made) = d
        .send(
            reqwest::Method::POST,
            "/v1/volumes",
            Some(json!({"name": "webdata"}).to_string()),
        )
        .await;
    assert_eq!(status, 201, "{made}");
    let b = Browser::start(1280, 1000).await;
    sign_in(&b, &addr, &token).await;
    b.type_into("#volumes", "webdata:data").await;
    let id = submit(&b, "web: keep the answer").await;
    wait_complete(&b, "the task's end").await;
    let task = d.get(&format!("/v1/tasks/{id}")).await;
    assert_eq!(task["spec"]["volumes"][0]["name"], "webdata", "{task}");
    assert_eq!(
        std::fs::read_to_string(d.state_dir().join("files/volumes/webdata/answer.txt")).unwrap(),
        "42\n"
    );
    b.quit().await;
}
