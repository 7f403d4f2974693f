use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tandem_agent::{ChatModel, EventSink, ModelConfig, TaskSettings, run_task};
use tandem_executor::{
    BoxFuture, CancellationToken, ExecContext, ExecError, ExecOutcome, ExecRequest, Executor,
    Language, Session, SessionSpec,
};
use tandem_executor_local::{LocalConfig, LocalExecutor};
use tandem_protocol::{EventMsg, StopReason};
use tandem_tests::{Reply, ScriptedOpenAi, script};

/// Wraps an executor and counts sessions opened and closed (explicitly or by drop).
struct Counting {
    inner: LocalExecutor,
    opened: Arc<AtomicUsize>,
    closed: Arc<AtomicUsize>,
}

struct CountingSession {
    inner: Option<Box<dyn Session>>,
    closed: Arc<AtomicUsize>,
}

impl Executor for Counting {
    fn name(&self) -> &str {
        "counting"
    }
    fn languages(&self) -> &[Language] {
        self.inner.languages()
    }
    fn open(&self, spec: SessionSpec) -> BoxFuture<'_, Result<Box<dyn Session>, ExecError>> {
        Box::pin(async move {
            let inner = self.inner.open(spec).await?;
            self.opened.fetch_add(1, Ordering::SeqCst);
            Ok(Box::new(CountingSession {
                inner: Some(inner),
                closed: self.closed.clone(),
            }) as Box<dyn Session>)
        })
    }
}

impl Session for CountingSession {
    fn run(
        &mut self,
        req: ExecRequest,
        ctx: ExecContext,
    ) -> BoxFuture<'_, Result<ExecOutcome, ExecError>> {
        Box::pin(async move {
            match self.inner.as_mut() {
                Some(s) => s.run(req, ctx).await,
                None => Err(ExecError::Backend("closed".into())),
            }
        })
    }
    fn workspace(&self) -> Option<&std::path::Path> {
        self.inner.as_ref().and_then(|s| s.workspace())
    }
    fn close(mut self: Box<Self>) -> BoxFuture<'static, Result<(), ExecError>> {
        let inner = self.inner.take();
        let closed = self.closed.clone();
        Box::pin(async move {
            closed.fetch_add(1, Ordering::SeqCst);
            match inner {
                Some(s) => s.close().await,
                None => Ok(()),
            }
        })
    }
}

struct Harness {
    server: ScriptedOpenAi,
    opened: Arc<AtomicUsize>,
    closed: Arc<AtomicUsize>,
    executor: Arc<Counting>,
}

impl Harness {
    async fn new(task: &str, replies: Vec<Reply>) -> Self {
        let server = ScriptedOpenAi::start(script([(task, replies)]))
            .await
            .unwrap();
        let opened = Arc::new(AtomicUsize::new(0));
        let closed = Arc::new(AtomicUsize::new(0));
        let executor = Arc::new(Counting {
            inner: LocalExecutor::new(LocalConfig::default()),
            opened: opened.clone(),
            closed: closed.clone(),
        });
        Self {
            server,
            opened,
            closed,
            executor,
        }
    }

    fn model(&self) -> ChatModel {
        ChatModel::new(ModelConfig {
            base_url: self.server.base_url(),
            max_retries: 0,
            ..ModelConfig::default()
        })
        .unwrap()
    }

    async fn run(
        &self,
        settings: TaskSettings,
        cancel: CancellationToken,
    ) -> (tandem_agent::TaskOutcome, Vec<EventMsg>) {
        let events = Arc::new(Mutex::new(Vec::new()));
        let sink_events = events.clone();
        let sink: EventSink = Arc::new(move |e| sink_events.lock().unwrap().push(e));
        let outcome = run_task(settings, &self.model(), self.executor.clone(), sink, cancel).await;
        let events = events.lock().unwrap().clone();
        (outcome, events)
    }

    fn sessions(&self) -> (usize, usize) {
        (
            self.opened.load(Ordering::SeqCst),
            self.closed.load(Ordering::SeqCst),
        )
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn cancel_during_a_block_stops_fast_and_closes_the_sandbox() {
    let task = "cancel: long block";
    let h = Harness::new(task, vec![Reply::from("```sh\necho begin; sleep 60\n```")]).await;
    let cancel = CancellationToken::new();
    let trigger = cancel.clone();
    tokio::spawn(async move {
        tokio::time::sleep(Duration::from_millis(500)).await;
        trigger.cancel();
    });
    let started = Instant::now();
    let (outcome, events) = h.run(TaskSettings::new(task), cancel).await;
    assert!(
        started.elapsed() < Duration::from_secs(3),
        "{:?}",
        started.elapsed()
    );
    assert_eq!(outcome.stop_reason, StopReason::Cancelled);
    assert_eq!(h.sessions(), (1, 1));
    assert!(matches!(
        events.last(),
        Some(EventMsg::TaskFinished {
            stop_reason: StopReason::Cancelled,
            ..
        })
    ));
}

#[tokio::test(flavor = "multi_thread")]
async fn cancel_during_a_model_call_stops_fast() {
    let task = "cancel: slow model";
    let h = Harness::new(
        task,
        vec![Reply::Delayed(
            Duration::from_secs(30),
            Box::new(Reply::from("TERMINATE")),
        )],
    )
    .await;
    let cancel = CancellationToken::new();
    let trigger = cancel.clone();
    tokio::spawn(async move {
        tokio::time::sleep(Duration::from_millis(300)).await;
        trigger.cancel();
    });
    let started = Instant::now();
    let (outcome, _) = h.run(TaskSettings::new(task), cancel).await;
    assert!(started.elapsed() < Duration::from_secs(2));
    assert_eq!(outcome.stop_reason, StopReason::Cancelled);
    assert_eq!(h.sessions(), (0, 0), "no code, no sandbox");
}

#[tokio::test(flavor = "multi_thread")]
async fn task_timeout_is_its_own_stop_reason_and_keeps_the_transcript() {
    let task = "timeout: whole task";
    let h = Harness::new(
        task,
        vec![
            Reply::from("```python\nprint('one')\n```"),
            Reply::from("```sh\nsleep 60\n```"),
        ],
    )
    .await;
    let mut settings = TaskSettings::new(task);
    settings.timeout = Some(Duration::from_secs(2));
    let started = Instant::now();
    let (outcome, _) = h.run(settings, CancellationToken::new()).await;
    assert!(
        started.elapsed() < Duration::from_secs(4),
        "{:?}",
        started.elapsed()
    );
    assert_eq!(outcome.stop_reason, StopReason::Timeout);
    assert_eq!(outcome.turns, 2);
    // system, task, reply 1, report 1, reply 2: the transcript survives the stop.
    assert_eq!(outcome.transcript.len(), 5);
    assert_eq!(
        outcome.transcript[3].content,
        "exitcode: 0 (execution succeeded)\nCode output: one\n"
    );
    assert_eq!(h.sessions(), (1, 1));
}

#[tokio::test(flavor = "multi_thread")]
async fn one_session_per_task_closed_on_error_too() {
    let task = "session: reuse then fail";
    let h = Harness::new(
        task,
        vec![
            Reply::from("```sh\necho a > f\n```"),
            Reply::from("```sh\ncat f\n```"),
            Reply::Error(400, "context length exceeded".into()),
        ],
    )
    .await;
    let (outcome, events) = h
        .run(TaskSettings::new(task), CancellationToken::new())
        .await;
    assert_eq!(outcome.stop_reason, StopReason::Error);
    let error = outcome.error.unwrap();
    assert_eq!(error.code, tandem_protocol::ErrorCode::ModelRequest);
    assert!(
        error.message.contains("context length exceeded"),
        "{}",
        error.message
    );
    let outputs: Vec<_> = events
        .iter()
        .filter_map(|e| match e {
            EventMsg::ExecResult { result, .. } => Some(result.stdout.clone()),
            _ => None,
        })
        .collect();
    assert_eq!(outputs, ["", "a\n"]);
    assert_eq!(h.sessions(), (1, 1));
}

#[tokio::test(flavor = "multi_thread")]
async fn first_failure_stops_the_rest_of_the_reply() {
    let task = "blocks: stop at failure";
    let reply = "```sh\necho one\n```\n```python\nraise ValueError('bad')\n```\n```sh\necho three\n```\n\nTERMINATE";
    // The word came with code that failed, so the model reads the failure and answers again.
    let h = Harness::new(
        task,
        vec![Reply::from(reply), Reply::from("It fails. TERMINATE")],
    )
    .await;
    let (outcome, events) = h
        .run(TaskSettings::new(task), CancellationToken::new())
        .await;
    assert_eq!(outcome.stop_reason, StopReason::Terminated);
    assert_eq!(outcome.turns, 2);
    let statuses: Vec<&str> = events
        .iter()
        .filter_map(|e| match e {
            EventMsg::ExecResult { result, .. } => Some(result.status.as_str()),
            _ => None,
        })
        .collect();
    assert_eq!(statuses, ["exited", "exited", "not_run"]);
    let report = &outcome.transcript[3].content;
    assert!(
        report.starts_with("exitcode: 1 (execution failed)\nCode output: one\nTraceback"),
        "{report}"
    );
    assert!(
        report.ends_with("ValueError: bad\nBlock 3 was not run because an earlier block failed."),
        "{report}"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn code_sent_with_the_word_ends_the_task_only_once_it_ran_cleanly() {
    let task = "word with code: only after a clean run";
    let h = Harness::new(
        task,
        vec![
            Reply::from("```python\nimport sys\nprint('half')\nsys.exit(3)\n```\nDone. TERMINATE"),
            Reply::from("```python\nprint('whole')\n```\nThe answer is whole. TERMINATE"),
            Reply::from("not asked: the task ended after the second reply's run"),
        ],
    )
    .await;
    let (outcome, events) = h
        .run(TaskSettings::new(task), CancellationToken::new())
        .await;
    assert_eq!(outcome.stop_reason, StopReason::Terminated);
    assert_eq!(outcome.turns, 2);
    assert_eq!(
        reports(&outcome),
        [
            "exitcode: 3 (execution failed)\nCode output: half\n",
            "exitcode: 0 (execution succeeded)\nCode output: whole\n"
        ]
    );
    assert_eq!(
        outcome.summary.as_deref(),
        Some("```python\nprint('whole')\n```\nThe answer is whole.")
    );
    let finished = events
        .iter()
        .any(|e| matches!(e, EventMsg::TaskFinished { .. }));
    assert!(finished);
}

/// The executor's reports to the model, in order.
fn reports(outcome: &tandem_agent::TaskOutcome) -> Vec<&str> {
    outcome.transcript[3..]
        .iter()
        .filter(|m| m.role == tandem_protocol::Role::User)
        .map(|m| m.content.as_str())
        .collect()
}

const ADD_TASK: &str = "Write a Python function `add(a, b)`.\n\n    >>> add(2, 3)\n    5\n    >>> add(-1, 1)\n    0\n    >>> words('a b')\n    ['a', 'b']\n\nassert add(10, 5) == 15\n";

/// Wrong on two examples, and it prints while it loads: that output is not the examples' to
/// show.
const ADD_WRONG: &str = "```python\ndef add(a, b):\n    return a + b + (a > 0)\n\ndef words(s):\n    return s.split()\n\nprint('loaded')\n```\nTERMINATE";

#[tokio::test(flavor = "multi_thread")]
async fn the_examples_a_task_states_are_run_against_its_code() {
    let h = Harness::new(
        ADD_TASK,
        vec![
            Reply::from(ADD_WRONG),
            // Right, and silent: the examples are what it shows, so no note of printing nothing.
            Reply::from("```python\ndef add(a, b):\n    return a + b\n\ndef words(s):\n    return s.split()\n```\nTERMINATE"),
            Reply::from("not asked: the examples held"),
        ],
    )
    .await;
    // One reply a turn: what the model reads is the point here, not which reply is kept.
    let mut settings = TaskSettings::new(ADD_TASK);
    settings.candidates = 1;
    let (outcome, _) = h.run(settings, CancellationToken::new()).await;
    assert_eq!(outcome.stop_reason, StopReason::Terminated);
    assert_eq!(outcome.turns, 2);
    insta::assert_snapshot!("stated_examples_reports", reports(&outcome).join("\n---\n"));
}

#[tokio::test(flavor = "multi_thread")]
async fn a_reply_whose_code_fails_the_examples_draws_and_the_one_that_holds_them_is_kept() {
    // Each load of the kept code adds a line to `loads`: the examples run against it once,
    // before it is told, and its executor reads what they said rather than run them again.
    let right = "```python\nopen('loads', 'a').write('x\\n')\n\ndef add(a, b):\n    return a + b\n\ndef words(s):\n    return s.split()\n```";
    // The first reply holds one example of four; the three sampled beside it (seeds 1001
    // to 1003) say no code, do not load, and hold all four.
    let own =
        "```python\ndef add(a, b):\n    return a * b\n\ndef words(s):\n    return s.split()\n```";
    let drawn = [
        "I am sure the code is right.",
        "```python\ndef add(a, b):\n    return (\n```",
        right,
    ];
    let h = Harness::new(
        ADD_TASK,
        vec![
            Reply::from(own),
            Reply::from("not asked: the kept reply's examples held, which ends the task"),
        ],
    )
    .await;
    for (seed, text) in (1001..).zip(drawn) {
        h.server
            .set(&format!("{ADD_TASK}~{seed}"), vec![Reply::from(text)]);
    }
    let mut settings = TaskSettings::new(ADD_TASK);
    settings.candidates = 4;
    // Loaded twice: by the examples before it was told, and by its own run; not a third
    // time by the examples after it.
    settings.check = Some(tandem_protocol::Check {
        program: Some("n = len(open('loads').readlines())\nassert n == 2, n\n".to_owned()),
        ..tandem_protocol::Check::default()
    });
    let (outcome, events) = h.run(settings, CancellationToken::new()).await;
    assert_eq!(outcome.stop_reason, StopReason::Terminated);
    assert_eq!(outcome.turns, 1);
    assert_eq!(
        outcome.check.as_ref().map(|c| c.verdict),
        Some(tandem_protocol::Verdict::Solved),
        "{:?}",
        outcome.check
    );
    let told: Vec<(u32, &str, Option<tandem_protocol::Usage>)> = events
        .iter()
        .filter_map(|e| match e {
            EventMsg::AssistantMessage {
                turn, text, usage, ..
            } => Some((*turn, text.as_str(), *usage)),
            _ => None,
        })
        .collect();
    assert_eq!(told.len(), 1, "one reply told per turn: {told:?}");
    assert_eq!((told[0].0, told[0].1), (1, right));
    let at = |want: fn(&EventMsg) -> bool| events.iter().position(want);
    assert!(
        at(|e| matches!(
            e,
            EventMsg::RepliesDrawn {
                turn: 1,
                drawn: 3,
                chosen: 3,
                held: 4,
                examples: 4
            }
        )) < at(|e| matches!(e, EventMsg::AssistantMessage { .. })),
        "{events:?}"
    );
    let asked = h.server.requests();
    assert_eq!(asked.len(), 4, "the first reply and three drawn");
    // The turn's tokens are those of every reply drawn.
    let completion: u64 = [own]
        .iter()
        .chain(&drawn)
        .map(|r| (r.len() / 4 + 1) as u64)
        .sum();
    assert_eq!(told[0].2.map(|u| u.completion_tokens), Some(completion));
    // The agent's own reply as it would be asked alone, then three sampled.
    let sampling: Vec<(Option<f64>, Option<u64>)> = asked[..4]
        .iter()
        .map(|r| (r.body["temperature"].as_f64(), r.body["seed"].as_u64()))
        .collect();
    assert_eq!(sampling[0], (None, None));
    let mut sampled = sampling[1..].to_vec();
    sampled.sort_by_key(|s| s.1);
    assert_eq!(
        sampled,
        [1001, 1002, 1003].map(|seed| (Some((0.8f32) as f64), Some(seed)))
    );
    let reports = reports(&outcome);
    assert!(
        reports[0].starts_with("exitcode: 0 (execution succeeded)")
            && reports[0].ends_with("The task's examples hold against your code: 4 of 4."),
        "{reports:?}"
    );
    assert_eq!(reports.len(), 1, "{reports:?}");
}

#[tokio::test(flavor = "multi_thread")]
async fn a_task_draws_once_and_the_agents_own_reply_wins_a_tie() {
    // The first reply fails the examples; the two drawn beside it hold as many, so the
    // agent's own is kept. Turn 2 fails them too, and is asked once: a task draws once.
    let same = "```python\ndef add(a, b):\n    return a + b + (a > 0)  # the same\n\ndef words(s):\n    return s.split()\n```";
    // Other code than turn 1's: the same sent again would end the task (`repeated`).
    let again =
        "```python\ndef add(a, b):\n    return a - b\n\ndef words(s):\n    return s.split()\n```";
    let h = Harness::new(
        ADD_TASK,
        vec![
            Reply::from(ADD_WRONG),
            Reply::from(again),
            Reply::from("TERMINATE"),
        ],
    )
    .await;
    for seed in 1001..=1002 {
        h.server
            .set(&format!("{ADD_TASK}~{seed}"), vec![Reply::from(same)]);
    }
    let mut settings = TaskSettings::new(ADD_TASK);
    settings.candidates = 3;
    let (outcome, events) = h.run(settings, CancellationToken::new()).await;
    assert_eq!(outcome.stop_reason, StopReason::Terminated);
    assert_eq!(outcome.turns, 3);
    assert_eq!(outcome.transcript[2].content, ADD_WRONG);
    let drawn: Vec<&EventMsg> = events
        .iter()
        .filter(|e| matches!(e, EventMsg::RepliesDrawn { .. }))
        .collect();
    assert!(
        matches!(
            drawn[..],
            [EventMsg::RepliesDrawn {
                turn: 1,
                drawn: 2,
                chosen: 0,
                held: 2,
                examples: 4
            }]
        ),
        "{drawn:?}"
    );
    assert_eq!(
        h.server.requests().len(),
        3 + 1 + 1,
        "three replies in turn 1, one in turns 2 and 3"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn examples_that_fail_before_the_run_are_run_again_after_it() {
    // The tested block reads a file the reply's first block writes: before the blocks run
    // its examples fail (and draw: the drawn replies are the same), after they run they hold.
    let two = "```python\nopen('k', 'w').write('0')\n```\n```python\ndef add(a, b):\n    return a + b + int(open('k').read())\n\ndef words(s):\n    return s.split()\n```\nTERMINATE";
    let h = Harness::new(ADD_TASK, vec![Reply::from(two)]).await;
    let (outcome, _) = h
        .run(TaskSettings::new(ADD_TASK), CancellationToken::new())
        .await;
    assert_eq!(outcome.stop_reason, StopReason::Terminated);
    let reports = reports(&outcome);
    assert!(
        reports[0].ends_with("The task's examples hold against your code: 4 of 4."),
        "{reports:?}"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn a_clean_run_that_holds_every_example_ends_the_task_without_the_word() {
    let right = "Here it is:\n```python\ndef add(a, b):\n    return a + b\n\ndef words(s):\n    return s.split()\n```";
    let h = Harness::new(
        ADD_TASK,
        vec![
            Reply::from(right),
            Reply::from("not asked: the examples held"),
        ],
    )
    .await;
    let (outcome, _) = h
        .run(TaskSettings::new(ADD_TASK), CancellationToken::new())
        .await;
    assert_eq!(outcome.stop_reason, StopReason::Terminated);
    assert_eq!(outcome.turns, 1);
    assert_eq!(h.server.requests().len(), 1);
    assert_eq!(outcome.summary.as_deref(), Some(right));
    // Examples that do not all hold are not the end: the model reads them and goes on.
    let h = Harness::new(
        ADD_TASK,
        vec![
            Reply::from(ADD_WRONG.trim_end_matches("TERMINATE")),
            Reply::from(right),
            Reply::from("not asked: the examples held"),
        ],
    )
    .await;
    let mut settings = TaskSettings::new(ADD_TASK);
    settings.candidates = 1;
    let (outcome, _) = h.run(settings, CancellationToken::new()).await;
    assert_eq!(outcome.stop_reason, StopReason::Terminated);
    assert_eq!(outcome.turns, 2);
    assert_eq!(h.server.requests().len(), 2);
}

#[tokio::test(flavor = "multi_thread")]
async fn code_sent_again_unchanged_that_runs_the_same_stops_the_task_as_repeated() {
    let task = "divide by zero, twice";
    let failing = "```python\nprint('before')\nprint(1/0)\n```";
    let h = Harness::new(
        task,
        vec![
            Reply::from(failing),
            Reply::from(&*format!("Let me run it again.\n{failing}")),
            Reply::from("not asked: the same failure twice ends the task"),
        ],
    )
    .await;
    let mut settings = TaskSettings::new(task);
    settings.max_turns = 6;
    let (outcome, _) = h.run(settings, CancellationToken::new()).await;
    assert_eq!(outcome.stop_reason, StopReason::Repeated);
    assert_eq!(outcome.turns, 2);
    assert_eq!(h.server.requests().len(), 2);
    let reports = reports(&outcome);
    assert_eq!(reports.len(), 2);
    // The same but for the block file the traceback names, numbered by turn.
    assert_eq!(
        reports[0],
        reports[1].replace(".tandem-block-2.py", ".tandem-block-1.py")
    );
    assert!(reports[0].contains("ZeroDivisionError"), "{reports:?}");
}

#[tokio::test(flavor = "multi_thread")]
async fn a_reply_whose_code_holds_the_examples_draws_nothing() {
    let right = "```python\ndef add(a, b):\n    return a + b\n\ndef words(s):\n    return s.split()\n```\nTERMINATE";
    let h = Harness::new(ADD_TASK, vec![Reply::from(right)]).await;
    let (outcome, events) = h
        .run(TaskSettings::new(ADD_TASK), CancellationToken::new())
        .await;
    assert_eq!(outcome.stop_reason, StopReason::Terminated);
    assert_eq!(h.server.requests().len(), 1);
    assert!(
        !events
            .iter()
            .any(|e| matches!(e, EventMsg::RepliesDrawn { .. }))
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn the_examples_run_only_where_the_approval_policy_lets_them_run_unasked() {
    // A deny rule that only the examples' program matches: the model's blocks run, the
    // program that would run their code again does not.
    let policy = tandem_protocol::approval::ApprovalPolicy {
        deny: vec![tandem_protocol::approval::ApprovalRule {
            name: "no examples".into(),
            pattern: "__tandem_examples__".into(),
        }],
        ..Default::default()
    };
    let gate = tandem_agent::approval::ApprovalGate::new(&policy, None).unwrap();
    let h = Harness::new(
        ADD_TASK,
        vec![Reply::from(ADD_WRONG), Reply::from("not asked")],
    )
    .await;
    let mut settings = TaskSettings::new(ADD_TASK);
    settings.approval = Some(Arc::new(gate));
    let (outcome, _) = h.run(settings, CancellationToken::new()).await;
    assert_eq!(outcome.stop_reason, StopReason::Terminated);
    assert_eq!(outcome.turns, 1);
    assert_eq!(
        reports(&outcome),
        ["exitcode: 0 (execution succeeded)\nCode output: loaded\n"]
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn cut_off_reply_and_termination_in_a_block() {
    let task = "messy: small model";
    let h = Harness::new(
        task,
        vec![
            Reply::from("Here is the code:\n```python\nfor i in range(3):\n    print(i"),
            Reply::from("```python\nprint(3)\n```"),
            Reply::from("```\nTERMINATE\n```"),
        ],
    )
    .await;
    let (outcome, _) = h
        .run(TaskSettings::new(task), CancellationToken::new())
        .await;
    assert_eq!(outcome.stop_reason, StopReason::Terminated);
    assert_eq!(outcome.turns, 3);
    assert_eq!(
        outcome.transcript[3].content,
        "exitcode: 1 (execution failed)\nCode output: \nYour reply was cut off inside code block 1, so it was not run. Send the complete code again, in one block."
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn custom_termination_word_and_data_blocks() {
    let task = "custom: word";
    let h = Harness::new(
        task,
        vec![
            // Before any code ran, so no answer after a clean run ends it either.
            Reply::from("All set. TERMINATE"),
            Reply::from("```json\n{\"a\": 1}\n```\n```python\nprint('x')\n```"),
            Reply::from("Now: DONE"),
        ],
    )
    .await;
    let mut settings = TaskSettings::new(task);
    settings.termination = "DONE".into();
    let (outcome, _) = h.run(settings, CancellationToken::new()).await;
    assert_eq!(outcome.stop_reason, StopReason::Terminated);
    assert_eq!(outcome.turns, 3, "TERMINATE is not the word here");
    assert!(outcome.transcript[3].content.contains("reply with DONE"));
    assert_eq!(
        outcome.transcript[5].content,
        "exitcode: 0 (execution succeeded)\nCode output: x\nBlock 1 (`json`) was not run: it is data or prose, not a program."
    );
    assert_eq!(outcome.summary.as_deref(), Some("Now:"));
}

#[tokio::test(flavor = "multi_thread")]
async fn a_task_continues_from_its_history() {
    let task = "continue from history";
    let h = Harness::new(
        task,
        vec![
            Reply::from("unused: turn 1 is in the history"),
            Reply::from("```python\nprint(6 * 7)\n```"),
            Reply::from("42\nTERMINATE"),
        ],
    )
    .await;
    let mut settings = TaskSettings::new(task);
    settings.max_turns = 3;
    settings.history = vec![
        tandem_protocol::Message::new(tandem_protocol::Role::Assistant, "Let me think."),
        tandem_protocol::Message::new(tandem_protocol::Role::User, "Please write code."),
    ];
    let (outcome, _) = h.run(settings, CancellationToken::new()).await;
    assert_eq!(
        (
            outcome.stop_reason,
            outcome.turns,
            outcome.summary.as_deref()
        ),
        (StopReason::Terminated, 3, Some("42"))
    );
    // The model saw the earlier turns first.
    let first = &h.server.requests_for(task)[0].body["messages"];
    assert_eq!(first[2]["content"], "Let me think.");
    assert_eq!(first[3]["content"], "Please write code.");
    assert_eq!(h.server.requests_for(task).len(), 2);
}
