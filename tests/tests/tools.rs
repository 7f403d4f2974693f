//! Tools through the turn loop, in-process, against the scripted server over real HTTP: the
//! `execute_code` tool, users' command and HTTP tools in a local session, every way a call goes
//! wrong, streamed pieces, text fallbacks and approval; each with the exact messages Tandem
//! sends back.

use std::sync::{Arc, Mutex};
use std::time::Duration;

/// What the pair asks after a clean run that printed something.
const ASK: &str = "If this answers the task, write the answer as `Answer: ...` in one line, then TERMINATE; if not, send the next code.";

use futures::future::BoxFuture;
use serde_json::{Value, json};
use tandem_agent::tools::{Catalog, Offered, resolve};
use tandem_agent::{
    ApprovalGate, Approver, Ask, ChatModel, EventSink, ModelConfig, Ruling, TaskSettings, run_task,
};
use tandem_executor::CancellationToken;
use tandem_executor_local::{LocalConfig, LocalExecutor};
use tandem_protocol::{
    ApprovalPolicy, CodeVia, Decision, EventMsg, Message, Role, StopReason, ToolDef, ToolReply,
};
use tandem_tests::{Reply, ScriptedOpenAi, call, script};

fn model(server: &ScriptedOpenAi, stream: bool) -> ChatModel {
    ChatModel::new(ModelConfig {
        base_url: server.base_url(),
        max_retries: 0,
        stream,
        ..ModelConfig::default()
    })
    .unwrap()
}

struct Ran {
    outcome: tandem_agent::TaskOutcome,
    events: Vec<EventMsg>,
    requests: Vec<Value>,
}

async fn run(task: &str, replies: Vec<Reply>, settings: impl FnOnce(&mut TaskSettings)) -> Ran {
    run_on(task, replies, true, settings).await
}

async fn run_on(
    task: &str,
    replies: Vec<Reply>,
    stream: bool,
    settings: impl FnOnce(&mut TaskSettings),
) -> Ran {
    let executor = Arc::new(LocalExecutor::new(LocalConfig::default()));
    run_with(task, replies, stream, executor, settings).await
}

async fn run_with(
    task: &str,
    replies: Vec<Reply>,
    stream: bool,
    executor: Arc<dyn tandem_executor::Executor>,
    settings: impl FnOnce(&mut TaskSettings),
) -> Ran {
    let server = ScriptedOpenAi::start(script([(task, replies)]))
        .await
        .unwrap();
    let mut s = TaskSettings::new(task);
    s.code_via = CodeVia::Tool;
    s.max_turns = 6;
    settings(&mut s);
    let events = Arc::new(Mutex::new(Vec::new()));
    let into = events.clone();
    let sink: EventSink = Arc::new(move |e| into.lock().unwrap().push(e));
    let outcome = run_task(
        s,
        &model(&server, stream),
        executor,
        sink,
        CancellationToken::new(),
    )
    .await;
    let requests = server
        .requests_for(task)
        .into_iter()
        .map(|r| r.body)
        .collect();
    let events = events.lock().unwrap().clone();
    Ran {
        outcome,
        events,
        requests,
    }
}

fn code(id: &str, language: &str, code: &str) -> (String, String, String) {
    call(
        id,
        "execute_code",
        &json!({"language": language, "code": code}).to_string(),
    )
}

/// The messages of a request after the system prompt and the task.
fn said(request: &Value) -> Vec<Value> {
    request["messages"].as_array().unwrap()[2..].to_vec()
}

fn tool_message(id: &str, content: &str) -> Value {
    json!({"role": "tool", "content": content, "tool_call_id": id})
}

#[tokio::test]
async fn code_runs_as_a_tool_call_and_is_answered_with_one_tool_message() {
    let task = "tools: execute_code";
    for stream in [true, false] {
        let call = code("call_1", "python", "print(6 * 7)");
        let ran = run_on(
            task,
            vec![
                Reply::Calls(String::new(), vec![call.clone()]),
                Reply::from("42\nTERMINATE"),
            ],
            stream,
            |_| {},
        )
        .await;
        assert_eq!(ran.outcome.stop_reason, StopReason::Terminated, "{stream}");
        assert_eq!(ran.outcome.summary.as_deref(), Some("42"));
        // The tool as the model is offered it: the executor's languages, code and filename.
        let first = &ran.requests[0];
        let tools = first["tools"].as_array().unwrap();
        assert_eq!(tools.len(), 1);
        assert_eq!(tools[0]["type"], "function");
        assert_eq!(tools[0]["function"]["name"], "execute_code");
        assert_eq!(
            tools[0]["function"]["parameters"]["required"],
            json!(["language", "code"])
        );
        assert_eq!(
            tools[0]["function"]["parameters"]["properties"]["language"]["enum"],
            json!(["python", "sh", "javascript"])
        );
        assert_eq!(first["tool_choice"], "auto");
        // One tool: nothing to say about parallel calls.
        assert!(first.get("parallel_tool_calls").is_none());
        assert!(
            first["messages"][0]["content"]
                .as_str()
                .unwrap()
                .ends_with("- Run code by calling the `execute_code` tool; its result is the program's exit code and output.")
        );
        // What Tandem sent back: the call as it was made, then its one answer.
        assert_eq!(
            said(&ran.requests[1]),
            [
                json!({"role": "assistant", "content": "", "tool_calls": [
                    {"id": "call_1", "type": "function", "function": {"name": "execute_code", "arguments": call.2}}
                ]}),
                tool_message(
                    "call_1",
                    "exitcode: 0 (execution succeeded)\nYour code printed: 42\n"
                ),
            ]
        );
        // Seen as events: the call, its block, its result, and the executor's answer.
        let kinds: Vec<&str> = ran
            .events
            .iter()
            .filter_map(|e| match e {
                EventMsg::ToolCall { .. } => Some("tool_call"),
                EventMsg::CodeBlock { .. } => Some("code_block"),
                EventMsg::ExecResult { .. } => Some("exec_result"),
                EventMsg::ToolResult { .. } => Some("tool_result"),
                EventMsg::ExecutorMessage { .. } => Some("executor_message"),
                _ => None,
            })
            .collect();
        assert_eq!(
            kinds,
            [
                "tool_call",
                "code_block",
                "exec_result",
                "tool_result",
                "executor_message"
            ]
        );
        assert!(ran.events.iter().any(|e| matches!(e,
            EventMsg::ToolResult { id, name, is_error: false, index: 1, .. }
                if id == "call_1" && name == "execute_code")));
        // The transcript holds the call and its answer as the model saw them.
        let transcript = &ran.outcome.transcript;
        assert_eq!(transcript[2].tool_calls.len(), 1);
        assert_eq!(transcript[3].role, Role::Tool);
        assert_eq!(transcript[3].tool_call_id.as_deref(), Some("call_1"));
    }
}

#[tokio::test]
async fn every_bad_call_is_an_answer_the_model_reads_and_the_rest_still_run() {
    let task = "tools: bad calls";
    let ran = run(
        task,
        vec![
            Reply::Calls(
                "First a block.\n```python\nprint('fenced')\n```".to_owned(),
                vec![
                    call("a", "execute_code", r#"{"language": "python", "code": "#),
                    call("b", "execute_code", r#"["print(1)"]"#),
                    call("c", "execute_code", r#"{"language": "python"}"#),
                    call("d", "rm_rf", r#"{}"#),
                    code("e", "python", "print('still runs')"),
                ],
            ),
            Reply::from("TERMINATE"),
        ],
        |_| {},
    )
    .await;
    assert_eq!(ran.outcome.stop_reason, StopReason::Terminated);
    let back = said(&ran.requests[1]);
    assert_eq!(back.len(), 7, "{back:#?}");
    assert_eq!(back[0]["tool_calls"].as_array().unwrap().len(), 5);
    assert_eq!(
        back[1..6].to_vec(),
        [
            tool_message(
                "a",
                "error: the arguments of `execute_code` are not valid JSON (EOF while parsing a value at line 1 column 31); send a JSON object. They were: `{\"language\": \"python\", \"code\": `"
            ),
            tool_message(
                "b",
                "error: the arguments of `execute_code` must be a JSON object, not an array. They were: `[\"print(1)\"]`"
            ),
            tool_message(
                "c",
                "error: the arguments of `execute_code` do not match its parameters: `arguments.code` is required. They were: `{\"language\": \"python\"}`"
            ),
            tool_message(
                "d",
                "error: there is no tool `rm_rf`; the tools are: execute_code."
            ),
            tool_message(
                "e",
                "exitcode: 0 (execution succeeded)\nYour code printed: still runs\n"
            ),
        ]
    );
    // The fenced block ran too, and its report follows the answers.
    assert_eq!(
        back[6],
        json!({"role": "user", "name": "executor", "content": "exitcode: 0 (execution succeeded)\nYour code printed: fenced\n"})
    );
    let errors = ran
        .events
        .iter()
        .filter(|e| matches!(e, EventMsg::ToolResult { is_error: true, .. }))
        .count();
    assert_eq!(errors, 4);
}

#[tokio::test]
async fn streamed_pieces_join_by_index_across_escapes_and_surrogate_pairs() {
    let task = "tools: pieces";
    // Two calls whose pieces interleave; the second one's code is split inside `\"`, inside
    // `\n` and between the halves of a surrogate pair.
    let deltas = [
        r#"{"tool_calls": [{"index": 1, "id": "second", "type": "function", "function": {"name": "execute_code", "arguments": "{\"language\": \"python\", \"code\": \"print(\\"}}]}"#,
        r#"{"tool_calls": [{"index": 0, "id": "first", "type": "function", "function": {"name": "execute_code", "arguments": "{\"language\": \"sh\", "}}]}"#,
        r#"{"tool_calls": [{"index": 1, "function": {"arguments": "\"caf\u00e9 \ud83c"}}]}"#,
        r#"{"tool_calls": [{"index": 0, "function": {"arguments": "\"code\": \"echo one\"}"}}]}"#,
        r#"{"tool_calls": [{"index": 1, "function": {"arguments": "\udf89\\\")\\"}}]}"#,
        r#"{"tool_calls": [{"index": 1, "function": {"arguments": "nprint(2)\"}"}}]}"#,
    ]
    .map(str::to_owned)
    .to_vec();
    let ran = run(
        task,
        vec![Reply::Deltas(deltas), Reply::from("TERMINATE")],
        |_| {},
    )
    .await;
    let back = said(&ran.requests[1]);
    assert_eq!(
        back[0]["tool_calls"],
        json!([
            {"id": "first", "type": "function", "function": {"name": "execute_code", "arguments": "{\"language\": \"sh\", \"code\": \"echo one\"}"}},
            {"id": "second", "type": "function", "function": {"name": "execute_code", "arguments": "{\"language\": \"python\", \"code\": \"print(\\\"café 🎉\\\")\\nprint(2)\"}"}},
        ])
    );
    assert_eq!(
        back[1..],
        [
            tool_message(
                "first",
                "exitcode: 0 (execution succeeded)\nYour code printed: one\n"
            ),
            tool_message(
                "second",
                "exitcode: 0 (execution succeeded)\nYour code printed: café 🎉\n2\n"
            ),
        ]
    );
}

fn wc_tool() -> ToolDef {
    ToolDef {
        description: Some("Count the words of a text.".to_owned()),
        parameters: Some(json!({
            "type": "object",
            "properties": {"text": {"type": "string"}},
            "required": ["text"],
        })),
        command: Some(vec![
            "python3".to_owned(),
            "-c".to_owned(),
            "import json, sys\nargs = json.load(sys.stdin)\nif args['text'] == 'fail':\n    sys.exit('no words here')\nprint(len(args['text'].split()))".to_owned(),
        ]),
        ..ToolDef::default()
    }
}

fn catalog(entries: &[(&str, ToolDef)]) -> Offered {
    entries
        .iter()
        .map(|(n, d)| ((*n).to_owned(), d.clone()))
        .collect::<Catalog>()
        .into()
}

#[tokio::test]
async fn a_command_tool_runs_in_the_session_and_parallel_calls_fall_back_when_refused() {
    let task = "tools: command";
    let words = call("w1", "wc", r#"{"text": "one two three"}"#);
    let fails = call("w2", "wc", r#"{"text": "fail"}"#);
    // The server refuses parallel_tool_calls: asked again without it, and not sent again.
    let ran = run(
        task,
        vec![
            Reply::Refuses(
                "parallel_tool_calls".to_owned(),
                Box::new(Reply::Calls(String::new(), vec![words, fails])),
            ),
            Reply::Refuses(
                "parallel_tool_calls".to_owned(),
                Box::new(Reply::from("3 words. TERMINATE")),
            ),
        ],
        |s| {
            s.tools = resolve(None, &catalog(&[("wc", wc_tool())])).unwrap();
        },
    )
    .await;
    assert_eq!(ran.outcome.stop_reason, StopReason::Terminated);
    assert_eq!(ran.requests.len(), 3);
    assert_eq!(ran.requests[0]["parallel_tool_calls"], true);
    assert!(ran.requests[1].get("parallel_tool_calls").is_none());
    assert!(ran.requests[2].get("parallel_tool_calls").is_none());
    let names: Vec<&str> = ran.requests[0]["tools"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t["function"]["name"].as_str().unwrap())
        .collect();
    assert_eq!(names, ["execute_code", "wc"]);
    assert_eq!(
        said(&ran.requests[2])[1..],
        [
            tool_message("w1", "3\n"),
            tool_message(
                "w2",
                "error: tool `wc` failed (exit code 1):\nno words here"
            ),
        ]
    );
}

#[tokio::test]
async fn auto_falls_back_to_blocks_when_the_server_refuses_tools() {
    let task = "tools: auto";
    let ran = run(
        task,
        vec![
            Reply::Refuses(
                "tools".to_owned(),
                Box::new(Reply::from("```python\nprint(7)\n```")),
            ),
            Reply::Refuses("tools".to_owned(), Box::new(Reply::from("7 TERMINATE"))),
        ],
        |s| s.code_via = CodeVia::Auto,
    )
    .await;
    assert_eq!(ran.outcome.stop_reason, StopReason::Terminated);
    assert_eq!(ran.requests.len(), 3);
    assert!(ran.requests[0].get("tools").is_some());
    assert!(ran.requests[1].get("tools").is_none());
    assert!(ran.requests[2].get("tools").is_none());
    assert_eq!(
        said(&ran.requests[2])[1]["content"],
        format!("exitcode: 0 (execution succeeded)\nYour code printed: 7\n{ASK}")
    );
    // Asked for tool calls only, a server that refuses tools fails the task, by name.
    let ran = run(
        "tools: tool refused",
        vec![Reply::Refuses(
            "tools".to_owned(),
            Box::new(Reply::from("TERMINATE")),
        )],
        |_| {},
    )
    .await;
    assert_eq!(ran.outcome.stop_reason, StopReason::Error);
    let error = ran.outcome.error.unwrap().message;
    assert!(error.contains("tools"), "{error}");
}

#[tokio::test]
async fn calls_written_as_text_run_and_the_same_call_repeated_is_stopped() {
    let task = "tools: text and loops";
    let text_call = "<tool_call>\n{\"name\": \"execute_code\", \"arguments\": {\"language\": \"python\", \"code\": \"print(5)\"}}\n</tool_call>";
    let same = || Reply::Calls(String::new(), vec![code("same", "python", "print(1)")]);
    let ran = run(
        task,
        vec![
            Reply::from(text_call),
            same(),
            same(),
            same(),
            same(),
            Reply::from("TERMINATE"),
        ],
        |_| {},
    )
    .await;
    assert_eq!(ran.outcome.stop_reason, StopReason::Terminated);
    // A call written as text is answered as text: there is no id to answer.
    assert_eq!(
        said(&ran.requests[1])[1],
        json!({"role": "user", "name": "executor", "content": "Result of tool `execute_code`:\nexitcode: 0 (execution succeeded)\nYour code printed: 5\n"})
    );
    let last = said(&ran.requests[5]);
    assert_eq!(
        last[last.len() - 1],
        tool_message(
            "same",
            "error: not run: `execute_code` was called with these same arguments 3 times in a row, and its answer will not change. Take another way, or give your answer."
        )
    );
}

/// Denies every request and remembers what it was asked.
struct Denier(Mutex<Vec<Ask>>);

impl Approver for Denier {
    fn decide<'a>(
        &'a self,
        ask: Ask,
        _timeout: Duration,
        _cancel: &'a CancellationToken,
    ) -> BoxFuture<'a, Option<Ruling>> {
        self.0.lock().unwrap().push(ask);
        Box::pin(async {
            Some(Ruling {
                decision: Decision::Deny,
                code: None,
                reason: Some("not today".to_owned()),
                by: "user".to_owned(),
            })
        })
    }
}

#[tokio::test]
async fn tool_calls_are_asked_about_and_denied_by_name() {
    let task = "tools: approval";
    let denier = Arc::new(Denier(Mutex::new(Vec::new())));
    let policy = ApprovalPolicy {
        ask_tools: vec!["wc".to_owned()],
        deny_tools: vec!["erase".to_owned()],
        ..ApprovalPolicy::default()
    };
    let gate = ApprovalGate::new(&policy, None)
        .unwrap()
        .with_approver(denier.clone());
    let erase = ToolDef {
        command: Some(vec!["true".to_owned()]),
        ..ToolDef::default()
    };
    let ran = run(
        task,
        vec![
            Reply::Calls(
                String::new(),
                vec![
                    call("w", "wc", r#"{"text": "a b"}"#),
                    call("e", "erase", r#"{}"#),
                    code("c", "python", "print('code is not asked about')"),
                ],
            ),
            Reply::from("TERMINATE"),
        ],
        |s| {
            s.approval = Some(Arc::new(gate));
            s.tools = resolve(None, &catalog(&[("wc", wc_tool()), ("erase", erase)])).unwrap();
        },
    )
    .await;
    assert_eq!(
        said(&ran.requests[1])[1..],
        [
            tool_message(
                "w",
                "error: not run: the user declined to run this call: not today. Do not call it again unchanged."
            ),
            tool_message(
                "e",
                "error: not run: the operator's approval policy does not allow this call (deny rule `deny_tools erase`). Do not call it again unchanged."
            ),
            tool_message(
                "c",
                "exitcode: 0 (execution succeeded)\nYour code printed: code is not asked about\n"
            ),
        ]
    );
    let asked = denier.0.lock().unwrap().clone();
    assert_eq!(asked.len(), 1);
    assert_eq!(
        (asked[0].language.as_str(), asked[0].code.as_str()),
        ("tool", r#"{"text":"a b"}"#)
    );
    assert_eq!(
        asked[0].reason,
        "calls of tool `wc` are asked about (ask_tools)"
    );
}

#[tokio::test]
async fn a_resumed_task_sends_its_calls_and_answers_as_they_were() {
    let task = "tools: resume";
    let call = code("r1", "python", "print(1)");
    let mut assistant = Message::new(Role::Assistant, "");
    assistant.tool_calls = vec![tandem_protocol::ToolCall {
        id: call.0.clone(),
        name: call.1.clone(),
        arguments: call.2.clone(),
    }];
    let answer = Message::tool(&ToolReply {
        id: "r1".to_owned(),
        name: "execute_code".to_owned(),
        content: "exitcode: 0 (execution succeeded)\nYour code printed: 1\n".to_owned(),
    });
    let ran = run(
        task,
        vec![Reply::from("unused"), Reply::from("1 TERMINATE")],
        |s| s.history = vec![assistant, answer],
    )
    .await;
    assert_eq!(ran.outcome.stop_reason, StopReason::Terminated);
    assert_eq!(ran.requests.len(), 1);
    assert_eq!(
        said(&ran.requests[0]),
        [
            json!({"role": "assistant", "content": "", "tool_calls": [
                {"id": "r1", "type": "function", "function": {"name": "execute_code", "arguments": call.2}}
            ]}),
            tool_message(
                "r1",
                "exitcode: 0 (execution succeeded)\nYour code printed: 1\n"
            ),
        ]
    );
}

#[tokio::test]
async fn code_in_a_confined_local_block_calls_the_tasks_tools_over_its_own_channel() {
    let task = "tools: from code";
    let python = "import tandem_tools\nprint(tandem_tools.call('wc', text='one two three'))\nprint(tandem_tools.wc({'text': 'a b'}))\ntry:\n    tandem_tools.call('wc', text=7)\nexcept tandem_tools.ToolError as e:\n    print('refused:', e)\ntry:\n    tandem_tools.call('execute_code', language='sh', code='id')\nexcept tandem_tools.ToolError as e:\n    print('refused:', e)\n";
    let sh = "tandem-tool wc '{\"text\": \"x y z w\"}'\necho '{\"text\": \"from stdin\"}' | tandem-tool wc\ntandem-tool nope '{}' || echo \"exit $?\"";
    let ran = run(
        task,
        vec![
            Reply::from(format!("```python\n{python}```\n```sh\n{sh}\n```").as_str()),
            Reply::from("TERMINATE"),
        ],
        |s| {
            s.code_via = CodeVia::Auto;
            s.tools = resolve(None, &catalog(&[("wc", wc_tool())])).unwrap();
        },
    )
    .await;
    assert_eq!(ran.outcome.stop_reason, StopReason::Terminated);
    let report = said(&ran.requests[1])[1]["content"]
        .as_str()
        .unwrap()
        .to_owned();
    assert_eq!(
        report,
        format!(
            "exitcode: 0 (execution succeeded)\nYour code printed: 3\n\n2\n\nrefused: error: the arguments of `wc` do not match its parameters: `arguments.text` must be string, not an integer. They were: `{{\"text\": 7}}`\nrefused: error: `execute_code` cannot be called from code: run the code directly\n4\n2\nexit 1\ntandem-tool: error: there is no tool `nope`; the tools are: execute_code, wc.\n{ASK}"
        )
    );
    // Each call is seen as the block's: its index, a made-up id, its result.
    let results: Vec<(u32, String, bool)> = ran
        .events
        .iter()
        .filter_map(|e| match e {
            EventMsg::ToolResult {
                index,
                name,
                is_error,
                ..
            } => Some((*index, name.clone(), *is_error)),
            _ => None,
        })
        .collect();
    assert_eq!(
        results,
        [
            (1, "wc".to_owned(), false),
            (1, "wc".to_owned(), false),
            (1, "wc".to_owned(), true),
            (1, "execute_code".to_owned(), true),
            (2, "wc".to_owned(), false),
            (2, "wc".to_owned(), false),
            (2, "nope".to_owned(), true),
        ]
    );
}

#[tokio::test]
async fn a_block_cannot_reach_another_sessions_tools() {
    // Task A holds a tool only it has, in a block that waits while B's block looks for A's
    // channel: in its own environment, in every process's descriptors and environment. B
    // starts only once A's block has its channel (it printed), and A is stopped after B.
    let holder =
        "import os, time\nprint(os.environ['TANDEM_TOOLS_FD'], flush=True)\ntime.sleep(600)\n";
    let thief = r#"import os
import tandem_tools
found = []
for pid in os.listdir('/proc'):
    if not pid.isdigit() or int(pid) == os.getpid():
        continue
    try:
        env = open('/proc/%s/environ' % pid, 'rb').read()
        if b'TANDEM_TOOLS_TOKEN' in env:
            found.append('environ of %s' % pid)
    except OSError:
        pass
    try:
        for fd in os.listdir('/proc/%s/fd' % pid):
            try:
                f = os.open('/proc/%s/fd/%s' % (pid, fd), os.O_RDWR)
                os.close(f)
                found.append('fd %s of %s' % (fd, pid))
            except OSError:
                pass
    except OSError:
        pass
try:
    print(tandem_tools.call('secret_of_a'))
except tandem_tools.ToolError as e:
    print('refused:', e)
print('reached:', found)
"#;
    let secret = ToolDef {
        command: Some(vec!["echo".to_owned(), "the secret".to_owned()]),
        ..ToolDef::default()
    };
    let server = ScriptedOpenAi::start(script([(
        "tools: holder",
        vec![Reply::from(format!("```python\n{holder}```").as_str())],
    )]))
    .await
    .unwrap();
    let mut settings = TaskSettings::new("tools: holder");
    settings.tools = resolve(None, &catalog(&[("secret_of_a", secret)])).unwrap();
    let (holding, mut held) = tokio::sync::watch::channel(false);
    let a_events = Arc::new(Mutex::new(Vec::new()));
    let into = a_events.clone();
    let sink: EventSink = Arc::new(move |e| {
        if matches!(e, EventMsg::ExecOutput { .. }) {
            let _ = holding.send(true);
        }
        into.lock().unwrap().push(e);
    });
    let stop = CancellationToken::new();
    let (holder_model, holder_stop) = (model(&server, true), stop.clone());
    let a = tokio::spawn(async move {
        let executor = Arc::new(LocalExecutor::new(LocalConfig::default()));
        run_task(settings, &holder_model, executor, sink, holder_stop).await
    });
    held.wait_for(|printed| *printed).await.unwrap();
    let b = run(
        "tools: thief",
        vec![
            Reply::from(format!("```python\n{thief}```").as_str()),
            Reply::from("TERMINATE"),
        ],
        |s| {
            s.code_via = CodeVia::Blocks;
            s.tools = resolve(None, &catalog(&[("wc", wc_tool())])).unwrap();
        },
    )
    .await;
    stop.cancel();
    let a = a.await.unwrap();
    assert_eq!(a.stop_reason, StopReason::Cancelled);
    let report = said(&b.requests[1])[1]["content"]
        .as_str()
        .unwrap()
        .to_owned();
    assert_eq!(
        report,
        format!(
            "exitcode: 0 (execution succeeded)\nYour code printed: refused: error: there is no tool `secret_of_a`; the tools are: wc.\nreached: []\n{ASK}"
        )
    );
    // A's tool was never called, by anyone.
    let a_events = a_events.lock().unwrap();
    assert!(
        !a_events
            .iter()
            .any(|e| matches!(e, EventMsg::ToolCall { .. })),
        "{a_events:?}"
    );
}

/// The Docker executor on the system engine with the test image, no warm pool.
async fn docker() -> tandem_executor_docker::DockerExecutor {
    tandem_executor_docker::DockerExecutor::connect(tandem_executor_docker::DockerConfig {
        image: std::env::var("TANDEM_DOCKER_IMAGE")
            .unwrap_or_else(|_| "tandem-sandbox:latest".to_owned()),
        pull: false,
        pool_size: 0,
        ..Default::default()
    })
    .await
    .unwrap_or_else(|e| panic!("this test needs the Docker engine: {e}"))
}

#[tokio::test(flavor = "multi_thread")]
async fn code_in_a_docker_block_with_the_network_off_calls_tools_through_the_runner() {
    let docker = docker().await;
    let python = "import socket, tandem_tools\ntry:\n    socket.create_connection(('1.1.1.1', 53), timeout=2)\n    print('network: on')\nexcept OSError:\n    print('network: off')\nprint(tandem_tools.call('wc', text='one two three'))\n";
    // The module is the runner's: a block cannot change what later blocks import.
    let sh = "tandem-tool wc '{\"text\": \"a b\"}'\n(echo x > /run/tandem/tools/tandem_tools.py) 2>/dev/null || echo 'tools: read-only'";
    let ran = run_with(
        "tools: docker",
        vec![
            Reply::from(format!("```python\n{python}```\n```sh\n{sh}\n```").as_str()),
            Reply::from("TERMINATE"),
        ],
        true,
        Arc::new(docker),
        |s| {
            s.code_via = CodeVia::Blocks;
            s.tools = resolve(None, &catalog(&[("wc", wc_tool())])).unwrap();
        },
    )
    .await;
    assert_eq!(
        ran.outcome.stop_reason,
        StopReason::Terminated,
        "{:?}",
        ran.outcome.error
    );
    assert_eq!(
        said(&ran.requests[1])[1]["content"],
        format!(
            "exitcode: 0 (execution succeeded)\nYour code printed: network: off\n3\n\n2\ntools: read-only\n{ASK}"
        )
    );
}

/// An HTTP endpoint that answers no request until `expected` have arrived, then answers each
/// with its body in capitals: two calls finish only if they run at the same time.
async fn meeting_point(expected: usize) -> (String, Arc<Mutex<Vec<String>>>) {
    use axum::routing::post;
    let seen = Arc::new(Mutex::new(Vec::new()));
    let barrier = Arc::new(tokio::sync::Barrier::new(expected));
    let (seen2, barrier2) = (seen.clone(), barrier.clone());
    let app = axum::Router::new().route(
        "/tool",
        post(move |body: String| {
            let (seen, barrier) = (seen2.clone(), barrier2.clone());
            async move {
                seen.lock().unwrap().push(body.clone());
                barrier.wait().await;
                body.to_uppercase()
            }
        }),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        let _ = axum::serve(listener, app).await;
    });
    (format!("http://{addr}/tool"), seen)
}

#[tokio::test]
async fn an_operators_http_tools_run_side_by_side_and_a_failing_one_is_an_answer() {
    let task = "tools: http";
    let (url, seen) = meeting_point(2).await;
    let http = |url: &str| ToolDef {
        url: Some(url.to_owned()),
        timeout_secs: Some(20),
        ..ToolDef::default()
    };
    let ran = run(
        task,
        vec![
            Reply::Calls(
                String::new(),
                vec![
                    call("h1", "shout", r#"{"word": "one"}"#),
                    call("h2", "shout", r#"{"word": "two"}"#),
                    call("h3", "down", r#"{}"#),
                ],
            ),
            Reply::from("TERMINATE"),
        ],
        |s| {
            s.tools = resolve(
                None,
                &catalog(&[
                    ("shout", http(&url)),
                    ("down", http("http://127.0.0.1:9/nothing-listens")),
                ]),
            )
            .unwrap();
        },
    )
    .await;
    assert_eq!(ran.outcome.stop_reason, StopReason::Terminated);
    let back = said(&ran.requests[1]);
    assert_eq!(back[1], tool_message("h1", r#"{"WORD":"ONE"}"#));
    assert_eq!(back[2], tool_message("h2", r#"{"WORD":"TWO"}"#));
    let down = back[3]["content"].as_str().unwrap();
    assert!(
        down.starts_with("error: tool `down` failed: the endpoint did not answer ("),
        "{down}"
    );
    assert_eq!(seen.lock().unwrap().len(), 2);
}

/// The Python MCP SDK's environment (`scripts/fetch-mcp-client.sh`), whose server side
/// plays an operator's MCP server.
fn mcp_python() -> std::path::PathBuf {
    let venv = std::env::var_os("TANDEM_MCP_CLIENT_VENV")
        .map(std::path::PathBuf::from)
        .unwrap_or_else(|| {
            std::path::PathBuf::from(std::env::var_os("HOME").unwrap())
                .join(".cache/tandem/mcp-client")
        });
    let python = venv.join("bin/python");
    assert!(
        python.exists(),
        "no MCP SDK at {}: run scripts/fetch-mcp-client.sh",
        venv.display()
    );
    python
}

const MCP_SERVER: &str = r#"
from mcp.server.mcpserver import MCPServer

app = MCPServer("calc")

@app.tool()
def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b

@app.tool()
def fail(why: str) -> str:
    """Always fails."""
    raise ValueError(why)

app.run()
"#;

#[tokio::test]
async fn an_mcp_servers_tools_are_offered_called_by_the_model_and_from_code() {
    let dir = tempfile::tempdir().unwrap();
    let script_path = dir.path().join("calc.py");
    std::fs::write(&script_path, MCP_SERVER).unwrap();
    let mut defs = Catalog::new();
    defs.insert(
        "calc".to_owned(),
        ToolDef {
            mcp: Some(vec![
                mcp_python().display().to_string(),
                script_path.display().to_string(),
            ]),
            ..ToolDef::default()
        },
    );
    let offered = Offered::start(defs).await.unwrap();
    let tools = resolve(None, &offered).unwrap();
    let names: Vec<&str> = tools.iter().map(|t| t.name.as_str()).collect();
    assert_eq!(names, ["calc__add", "calc__fail"]);
    // One of them by name; an unknown one names what there is.
    let one = resolve(
        Some(&[tandem_protocol::ToolRef::Name("calc__add".to_owned())]),
        &offered,
    )
    .unwrap();
    assert_eq!(one.len(), 1);
    assert_eq!(
        resolve(
            Some(&[tandem_protocol::ToolRef::Name("calc__mul".to_owned())]),
            &offered
        )
        .err()
        .map(|e| e.to_string()),
        Some(
            "tool `calc__mul` is not offered here; the operator's tools are: calc__add, calc__fail"
                .to_owned()
        )
    );
    let code = "import tandem_tools\nprint(tandem_tools.call('calc__add', a=40, b=2))\n";
    let ran = run(
        "tools: mcp",
        vec![
            Reply::Calls(
                format!("```python\n{code}```"),
                vec![
                    call("m1", "calc__add", r#"{"a": 2, "b": 3}"#),
                    call("m2", "calc__fail", r#"{"why": "on purpose"}"#),
                    call("m3", "calc__add", r#"{"a": "two"}"#),
                ],
            ),
            Reply::from("TERMINATE"),
        ],
        |s| s.tools = tools,
    )
    .await;
    assert_eq!(ran.outcome.stop_reason, StopReason::Terminated);
    let back = said(&ran.requests[1]);
    assert_eq!(back[1], tool_message("m1", "5"));
    let failed = back[2]["content"].as_str().unwrap();
    assert!(
        // (The SDK tells no more than that the tool raised.)
        failed.starts_with("error: tool `calc__fail` failed: ") && failed.contains("fail"),
        "{failed}"
    );
    // The server's own schema is checked before anything is sent.
    let bad = back[3]["content"].as_str().unwrap();
    assert!(bad.contains("do not match its parameters"), "{bad}");
    // The block's code called the same server over its channel.
    assert_eq!(
        back[4],
        json!({"role": "user", "name": "executor", "content": "exitcode: 0 (execution succeeded)\nYour code printed: 42\n"})
    );
}

#[tokio::test]
async fn code_in_a_kept_interpreter_calls_tools_block_after_block() {
    let task = "tools: kept";
    let first =
        "import tandem_tools\ncounts = [tandem_tools.call('wc', text='a b')]\nprint(counts)\n";
    let second = "counts.append(tandem_tools.wc(text='x y z'))\nprint(counts)\n";
    let ran = run(
        task,
        vec![
            Reply::from(format!("```python\n{first}```").as_str()),
            Reply::from(format!("```python\n{second}```").as_str()),
            Reply::from("TERMINATE"),
        ],
        |s| {
            s.code_via = CodeVia::Blocks;
            s.session.keep_state = true;
            s.tools = resolve(None, &catalog(&[("wc", wc_tool())])).unwrap();
        },
    )
    .await;
    assert_eq!(
        ran.outcome.stop_reason,
        StopReason::Terminated,
        "{:?}",
        ran.outcome.error
    );
    // The interpreter kept its variables, and each block's calls were its own.
    let last = said(&ran.requests[2]);
    assert_eq!(
        last[3]["content"],
        format!("exitcode: 0 (execution succeeded)\nYour code printed: ['2\\n', '3\\n']\n{ASK}")
    );
    let turns: Vec<u32> = ran
        .events
        .iter()
        .filter_map(|e| match e {
            EventMsg::ToolResult { turn, .. } => Some(*turn),
            _ => None,
        })
        .collect();
    assert_eq!(turns, [1, 2]);
}

#[tokio::test(flavor = "multi_thread")]
async fn code_in_a_kept_docker_interpreter_calls_tools_through_the_runner() {
    let docker = docker().await;
    let first = "import tandem_tools\nkept = tandem_tools.call('wc', text='a b')\n";
    let second = "print(kept, tandem_tools.call('wc', text='x y z'))\n";
    let ran = run_with(
        "tools: kept docker",
        vec![
            Reply::from(format!("```python\n{first}```").as_str()),
            Reply::from(format!("```python\n{second}```").as_str()),
            Reply::from("TERMINATE"),
        ],
        true,
        Arc::new(docker),
        |s| {
            s.code_via = CodeVia::Blocks;
            s.session.keep_state = true;
            s.tools = resolve(None, &catalog(&[("wc", wc_tool())])).unwrap();
        },
    )
    .await;
    assert_eq!(
        ran.outcome.stop_reason,
        StopReason::Terminated,
        "{:?}",
        ran.outcome.error
    );
    assert_eq!(
        said(&ran.requests[2])[3]["content"],
        format!("exitcode: 0 (execution succeeded)\nYour code printed: 2\n 3\n\n{ASK}")
    );
}

#[tokio::test]
async fn a_400_for_something_else_does_not_teach_that_parallel_calls_are_refused() {
    let server = ScriptedOpenAi::start(script([
        (
            "tools: a 400",
            vec![Reply::Error(400, "the prompt is too long".to_owned())],
        ),
        ("tools: after it", vec![Reply::from("TERMINATE")]),
    ]))
    .await
    .unwrap();
    // One model for both tasks, as a daemon keeps one per server and model.
    let model = model(&server, true);
    let executor: Arc<dyn tandem_executor::Executor> =
        Arc::new(LocalExecutor::new(LocalConfig::default()));
    for task in ["tools: a 400", "tools: after it"] {
        let mut s = TaskSettings::new(task);
        s.code_via = CodeVia::Tool;
        s.tools = resolve(None, &catalog(&[("wc", wc_tool())])).unwrap();
        run_task(
            s,
            &model,
            executor.clone(),
            Arc::new(|_| {}),
            CancellationToken::new(),
        )
        .await;
    }
    let sent = |task: &str| -> Vec<bool> {
        server
            .requests_for(task)
            .iter()
            .map(|r| r.body.get("parallel_tool_calls").is_some())
            .collect()
    };
    // Asked once with it and once without; both failed, so nothing was learnt.
    assert_eq!(sent("tools: a 400"), [true, false]);
    assert_eq!(sent("tools: after it"), [true]);
}

#[tokio::test]
async fn calls_a_real_small_model_wrote_are_run_as_calls() {
    // Qwen2.5-Coder-1.5B under llama.cpp's server, asked to use a tool and then Python, wrote
    // both calls as JSON objects one after the other in a `python` fence, and named the
    // language instead of `execute_code`.
    let reply = "```python\n{\n    \"name\": \"wc\",\n    \"arguments\": {\n        \"text\": \"the quick brown fox jumps\"\n    }\n}\n{\n    \"name\": \"python\",\n    \"arguments\": {\n        \"code\": \"print(17*23)\"\n    }\n}\n```";
    let ran = run(
        "tools: a small model's calls",
        vec![Reply::from(reply), Reply::from("5 and 391. TERMINATE")],
        |s| s.tools = resolve(None, &catalog(&[("wc", wc_tool())])).unwrap(),
    )
    .await;
    assert_eq!(ran.outcome.stop_reason, StopReason::Terminated);
    assert_eq!(
        said(&ran.requests[1])[1]["content"],
        "Result of tool `wc`:\n5\n\n\nResult of tool `execute_code`:\nexitcode: 0 (execution succeeded)\nYour code printed: 391\n"
    );
    // The fenced JSON itself was not run as a Python block.
    let blocks = ran
        .events
        .iter()
        .filter(|e| matches!(e, EventMsg::CodeBlock { .. }))
        .count();
    assert_eq!(blocks, 1, "only the call's own block");
}

#[tokio::test]
async fn the_commands_one_block_calls_share_one_second_session() {
    let tmpdir = ToolDef {
        command: Some(vec![
            "python3".to_owned(),
            "-c".to_owned(),
            "import os; print(os.environ['TMPDIR'])".to_owned(),
        ]),
        ..ToolDef::default()
    };
    let code = "import os, tandem_tools\nseen = {tandem_tools.call('tmpdir') for _ in range(3)}\nprint(len(seen), os.environ['TMPDIR'] + '\\n' in seen)\n";
    let ran = run(
        "tools: one second session",
        vec![
            Reply::from(format!("```python\n{code}```").as_str()),
            Reply::from("TERMINATE"),
        ],
        |s| {
            s.code_via = CodeVia::Blocks;
            s.tools = resolve(None, &catalog(&[("tmpdir", tmpdir)])).unwrap();
        },
    )
    .await;
    // Three calls, one session beside the block's own (whose scratch is another).
    assert_eq!(
        said(&ran.requests[1])[1]["content"],
        format!("exitcode: 0 (execution succeeded)\nYour code printed: 1 False\n{ASK}")
    );
}

/// Approves every call with an edit: the arguments it is given, in turn.
struct Editor(Mutex<Vec<&'static str>>);

impl Approver for Editor {
    fn decide<'a>(
        &'a self,
        _ask: Ask,
        _timeout: Duration,
        _cancel: &'a CancellationToken,
    ) -> BoxFuture<'a, Option<Ruling>> {
        let edit = self.0.lock().unwrap().remove(0);
        Box::pin(async move {
            Some(Ruling {
                decision: Decision::Approve,
                code: Some(edit.to_owned()),
                reason: None,
                by: "user".to_owned(),
            })
        })
    }
}

#[tokio::test]
async fn a_persons_edit_of_a_calls_arguments_is_checked_like_the_models() {
    let editor = Arc::new(Editor(Mutex::new(vec![
        r#"{"text": 7}"#,
        r#"{"text": "a b c d"}"#,
    ])));
    let policy = ApprovalPolicy {
        ask_tools: vec!["wc".to_owned()],
        ..ApprovalPolicy::default()
    };
    let gate = ApprovalGate::new(&policy, None)
        .unwrap()
        .with_approver(editor);
    let ran = run(
        "tools: edited",
        vec![
            Reply::Calls(
                String::new(),
                vec![
                    call("e1", "wc", r#"{"text": "x"}"#),
                    call("e2", "wc", r#"{"text": "y"}"#),
                ],
            ),
            Reply::from("TERMINATE"),
        ],
        |s| {
            s.approval = Some(Arc::new(gate));
            s.tools = resolve(None, &catalog(&[("wc", wc_tool())])).unwrap();
        },
    )
    .await;
    assert_eq!(
        said(&ran.requests[1])[1..],
        [
            tool_message(
                "e1",
                "error: the arguments of `wc` do not match its parameters: `arguments.text` must be string, not an integer. They were: `{\"text\": 7}`"
            ),
            tool_message("e2", "4\n"),
        ]
    );
}
