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
    fn put_archive(
        &mut self,
        archive: &std::path::Path,
        caps: tandem_executor::files::ArchiveCaps,
    ) -> BoxFuture<'_, Result<Vec<tandem_executor::files::ArchivedFile>, ExecError>> {
        match self.inner.as_mut() {
            Some(inner) => inner.put_archive(archive, caps),
            None => tandem_executor_kit::put_in_workspace(None, archive, caps),
        }
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
        format!("exitcode: 0 (execution succeeded)\nYour code printed: one\n{ASK}")
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
        report.starts_with("exitcode: 1 (execution failed)\nYour code printed: one\nTraceback"),
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
            "exitcode: 3 (execution failed)\nYour code printed: half\n",
            &format!("exitcode: 0 (execution succeeded)\nYour code printed: whole\n{ASK}")
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
/// What the pair asks after a clean run that printed something.
const ASK: &str = "If this answers the task, write the answer as `Answer: ...` in one line, then TERMINATE; if not, send the next code.";

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
    // Each load of the kept code adds a line to `loads`: the examples run against it once, on
    // a fork,
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
    // Loaded once in the task's sandbox: by its own run. The examples before it was told ran
    // on a fork, and are not run a second time after it.
    settings.check = Some(tandem_protocol::Check {
        program: Some("n = len(open('loads').readlines())\nassert n == 1, n\n".to_owned()),
        ..tandem_protocol::Check::default()
    });
    let (outcome, events) = h.run(settings, CancellationToken::new()).await;
    assert_eq!(outcome.stop_reason, StopReason::ExamplesHeld);
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
async fn replies_are_judged_on_forks_so_one_that_deletes_the_workspace_spoils_nothing() {
    // The first turn keeps a file; on the second, the agent's reply and one drawn beside it
    // delete files as they load, and are wrong; the third is right and is told.
    let own = "```python\nimport os\nif os.path.exists('keep.txt'):\n    os.remove('keep.txt')\n\ndef add(a, b):\n    return a * b\n\ndef words(s):\n    return s.split()\n```";
    let wipes = "```python\nimport os, shutil\nfor f in os.listdir('.'):\n    shutil.rmtree(f) if os.path.isdir(f) else os.remove(f)\n\ndef add(a, b):\n    return a - b\n\ndef words(s):\n    return s.split()\n```";
    let right =
        "```python\ndef add(a, b):\n    return a + b\n\ndef words(s):\n    return s.split()\n```";
    let h = Harness::new(
        ADD_TASK,
        vec![
            Reply::from("```sh\nmkdir -p data && echo precious > keep.txt && echo deep > data/more.txt\n```"),
            Reply::from(own),
            Reply::from("not asked: the told reply's examples held"),
        ],
    )
    .await;
    // Sampled scripts count turns too: the second turn's is the second.
    for (seed, text) in (2001..).zip([wipes, right]) {
        h.server.set(
            &format!("{ADD_TASK}~{seed}"),
            vec![
                Reply::from("not asked on the first turn"),
                Reply::from(text),
            ],
        );
    }
    let mut settings = TaskSettings::new(ADD_TASK);
    settings.candidates = 3;
    settings.check = Some(tandem_protocol::Check {
        program: Some(
            "assert open('keep.txt').read() == 'precious\\n'\nassert open('data/more.txt').read() == 'deep\\n'\n"
                .to_owned(),
        ),
        ..tandem_protocol::Check::default()
    });
    let (outcome, events) = h.run(settings, CancellationToken::new()).await;
    assert_eq!(outcome.stop_reason, StopReason::ExamplesHeld, "{events:?}");
    assert!(
        events.iter().any(|e| matches!(
            e,
            EventMsg::RepliesDrawn {
                turn: 2,
                drawn: 2,
                chosen: 2,
                ..
            }
        )),
        "{events:?}"
    );
    assert_eq!(
        outcome.check.as_ref().map(|c| c.verdict),
        Some(tandem_protocol::Verdict::Solved),
        "the task's files survived every judged reply: {:?}",
        outcome.check
    );
    // Each judged reply had a sandbox of its own, and every one was closed.
    let (opened, closed) = h.sessions();
    assert_eq!(opened, closed);
    assert!(opened >= 4, "{opened}");
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
    assert_eq!(outcome.stop_reason, StopReason::ExamplesHeld);
    assert_eq!(outcome.turns, 1);
    assert_eq!(h.server.requests().len(), 1);
    assert_eq!(outcome.summary.as_deref(), Some(right));
    // The code that held them is the answer.
    assert_eq!(
        answer_of(&outcome),
        (Some(right), Some(tandem_protocol::AnswerFrom::Model), None)
    );
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
    assert_eq!(outcome.stop_reason, StopReason::ExamplesHeld);
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
        [format!(
            "exitcode: 0 (execution succeeded)\nYour code printed: loaded\n{ASK}"
        )]
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
        "exitcode: 1 (execution failed)\nYour code printed: \nYour reply was cut off inside code block 1, so it was not run. Send the complete code again, in one block."
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
        "exitcode: 0 (execution succeeded)\nYour code printed: x\nBlock 1 (`json`) was not run: it is data or prose, not a program.\nIf this answers the task, write the answer as `Answer: ...` in one line, then DONE; if not, send the next code."
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

/// A task's answer, where it came from, and why it has none, as it finished.
fn answer_of(
    outcome: &tandem_agent::TaskOutcome,
) -> (
    Option<&str>,
    Option<tandem_protocol::AnswerFrom>,
    Option<&str>,
) {
    (
        outcome.answer.as_deref(),
        outcome.answer_from,
        outcome.no_answer.as_deref(),
    )
}

#[tokio::test(flavor = "multi_thread")]
async fn an_output_block_that_matches_what_ran_is_no_complaint_and_ends_the_task() {
    let task = "answers: six times seven";
    let reply = "```python\nprint(6 * 7)\n```\n```output\n42\n```\nThe answer is 42.\nTERMINATE";
    let h = Harness::new(task, vec![Reply::from(reply), Reply::from("not asked")]).await;
    let (outcome, events) = h
        .run(TaskSettings::new(task), CancellationToken::new())
        .await;
    assert_eq!(outcome.stop_reason, StopReason::Terminated);
    assert_eq!(outcome.turns, 1);
    let reports = reports(&outcome);
    assert!(
        !reports[0].contains("was not run") && !reports[0].contains("your reply says"),
        "{reports:?}"
    );
    assert_eq!(
        answer_of(&outcome),
        (
            Some("The answer is 42."),
            Some(tandem_protocol::AnswerFrom::Model),
            None
        )
    );
    // The finished event carries what the outcome does.
    assert!(matches!(
        events.last(),
        Some(EventMsg::TaskFinished { answer: Some(a), answer_from: Some(tandem_protocol::AnswerFrom::Model), .. })
            if a == "The answer is 42."
    ));
}

#[tokio::test(flavor = "multi_thread")]
async fn an_output_block_that_differs_from_what_ran_is_told_side_by_side_and_the_task_goes_on() {
    let task = "answers: apples left";
    let guessed =
        "```python\nprint(12 + 7)\n```\n```output\n20\n```\nSo she has 20 apples.\nTERMINATE";
    let h = Harness::new(
        task,
        vec![Reply::from(guessed), Reply::from("She has 19 apples.")],
    )
    .await;
    let (outcome, _) = h
        .run(TaskSettings::new(task), CancellationToken::new())
        .await;
    let reports = reports(&outcome);
    assert_eq!(outcome.turns, 2, "{reports:?}");
    assert!(
        reports[0].contains("Your code printed 19; your reply says 20.")
            && !reports[0].contains("was not run"),
        "{reports:?}"
    );
    // Told as the model's own output, and asked for the answer in one line.
    assert!(
        reports[0].contains("Your code printed: 19")
            && reports[0].contains("write the answer as `Answer: ...` in one line, then TERMINATE"),
        "{reports:?}"
    );
    assert_eq!(outcome.stop_reason, StopReason::Answered);
    assert_eq!(
        answer_of(&outcome),
        (
            Some("She has 19 apples."),
            Some(tandem_protocol::AnswerFrom::Model),
            None
        )
    );
    // An untagged value is a claim too, never run as a program.
    let task = "answers: untagged claim";
    let h = Harness::new(
        task,
        vec![
            Reply::from("```python\nprint(3 * 3)\n```\n```\n10\n```\nIt is 10. TERMINATE"),
            Reply::from("It is 9."),
        ],
    )
    .await;
    let (outcome, events) = h
        .run(TaskSettings::new(task), CancellationToken::new())
        .await;
    let told = self::reports(&outcome);
    assert!(
        told[0].contains("Your code printed 9; your reply says 10."),
        "{told:?}"
    );
    assert!(events.iter().any(|e| matches!(
        e,
        EventMsg::CodeBlock { index: 2, language: Some(l), .. } if l == "output"
    )));
    assert_eq!(outcome.answer.as_deref(), Some("It is 9."));
}

#[tokio::test(flavor = "multi_thread")]
async fn a_statement_its_code_contradicts_is_told_once_and_the_answer_is_what_ran() {
    let task = "answers: contradicted";
    let h = Harness::new(
        task,
        vec![
            Reply::from("```python\nprint(sum(range(7)))\n```"),
            Reply::from("The answer is 20."),
            Reply::from("I am sure: the answer is 20."),
            Reply::from("not asked"),
        ],
    )
    .await;
    let (outcome, _) = h
        .run(TaskSettings::new(task), CancellationToken::new())
        .await;
    let reports = reports(&outcome);
    assert_eq!(outcome.stop_reason, StopReason::Answered, "{reports:?}");
    assert_eq!(reports.len(), 2, "{reports:?}");
    assert!(
        reports[1].starts_with("Your code printed 21; your reply says 20."),
        "{reports:?}"
    );
    assert_eq!(
        answer_of(&outcome),
        (Some("21"), Some(tandem_protocol::AnswerFrom::Output), None)
    );
    // The summary keeps the model's words.
    assert_eq!(
        outcome.summary.as_deref(),
        Some("I am sure: the answer is 20.")
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn every_stop_has_an_answer_when_code_ran_and_says_why_when_none() {
    // The word said after a clean run: the model's statement.
    let task = "answers: terminated";
    let h = Harness::new(
        task,
        vec![
            Reply::from("```python\nprint(5)\n```"),
            Reply::from("It is 5.\nTERMINATE"),
        ],
    )
    .await;
    let (outcome, _) = h
        .run(TaskSettings::new(task), CancellationToken::new())
        .await;
    assert_eq!(outcome.stop_reason, StopReason::Terminated);
    assert_eq!(
        answer_of(&outcome),
        (
            Some("It is 5."),
            Some(tandem_protocol::AnswerFrom::Model),
            None
        )
    );
    // An answer without the word is `answered`, not `terminated`.
    let task = "answers: answered";
    let h = Harness::new(
        task,
        vec![
            Reply::from("```python\nprint(5)\n```"),
            Reply::from("It is 5."),
        ],
    )
    .await;
    let (outcome, _) = h
        .run(TaskSettings::new(task), CancellationToken::new())
        .await;
    assert_eq!(outcome.stop_reason, StopReason::Answered);
    assert_eq!(outcome.answer.as_deref(), Some("It is 5."));
    // Only the word, code that printed: what the code printed.
    let task = "answers: only the word";
    let h = Harness::new(
        task,
        vec![Reply::from("```python\nprint('done: 8')\n```\nTERMINATE")],
    )
    .await;
    let (outcome, _) = h
        .run(TaskSettings::new(task), CancellationToken::new())
        .await;
    assert_eq!(outcome.stop_reason, StopReason::Terminated);
    assert_eq!(
        answer_of(&outcome),
        (
            Some("done: 8"),
            Some(tandem_protocol::AnswerFrom::Output),
            None
        )
    );
    // The turn limit, with code that printed twice: the last output.
    let task = "answers: turn limit";
    let h = Harness::new(
        task,
        vec![
            Reply::from("```python\nprint(1)\n```"),
            Reply::from("```python\nprint(2)\n```"),
        ],
    )
    .await;
    let mut settings = TaskSettings::new(task);
    settings.max_turns = 2;
    let (outcome, _) = h.run(settings, CancellationToken::new()).await;
    assert_eq!(outcome.stop_reason, StopReason::MaxTurns);
    assert_eq!(
        answer_of(&outcome),
        (Some("2"), Some(tandem_protocol::AnswerFrom::Output), None)
    );
    // The turn limit, where no code ran cleanly: no answer, and why.
    let task = "answers: turn limit, nothing ran";
    let h = Harness::new(
        task,
        vec![
            Reply::from("```python\nprint(1/0)\n```"),
            Reply::from("```python\nraise SystemExit(3)\n```"),
        ],
    )
    .await;
    let mut settings = TaskSettings::new(task);
    settings.max_turns = 2;
    let (outcome, events) = h.run(settings, CancellationToken::new()).await;
    assert_eq!(outcome.stop_reason, StopReason::MaxTurns);
    let (answer, from, why) = answer_of(&outcome);
    assert_eq!((answer, from), (None, None));
    assert!(why.is_some_and(|w| w.contains("max_turns")), "{why:?}");
    assert!(matches!(
        events.last(),
        Some(EventMsg::TaskFinished {
            answer: None,
            no_answer: Some(_),
            ..
        })
    ));
    // Repeated code: what it printed.
    let task = "answers: repeated";
    let same = "```python\nprint(7)\nprint(undefined)\n```";
    let h = Harness::new(
        task,
        vec![
            Reply::from("```python\nprint(7)\n```\nLet me check more."),
            Reply::from(same),
            Reply::from(same),
        ],
    )
    .await;
    let mut settings = TaskSettings::new(task);
    settings.max_turns = 6;
    let (outcome, _) = h.run(settings, CancellationToken::new()).await;
    assert_eq!(outcome.stop_reason, StopReason::Repeated);
    assert_eq!(
        answer_of(&outcome),
        (Some("7"), Some(tandem_protocol::AnswerFrom::Output), None)
    );
    // Code that printed nothing, sent again with the same words: the words are the answer.
    let task = "answers: repeated, nothing printed";
    let quiet = "```python\n# 13:51\n```\nThe train arrives at 13:51.";
    let h = Harness::new(
        task,
        vec![
            Reply::from(quiet),
            Reply::from(quiet),
            Reply::from("not asked"),
        ],
    )
    .await;
    let mut settings = TaskSettings::new(task);
    settings.max_turns = 6;
    let (outcome, _) = h.run(settings, CancellationToken::new()).await;
    assert_eq!(outcome.stop_reason, StopReason::Repeated);
    assert_eq!(
        answer_of(&outcome),
        (
            Some("The train arrives at 13:51."),
            Some(tandem_protocol::AnswerFrom::Model),
            None
        )
    );
    // No code and no statement: no answer, and why.
    let task = "answers: nothing";
    let h = Harness::new(task, vec![Reply::from("TERMINATE")]).await;
    let (outcome, _) = h
        .run(TaskSettings::new(task), CancellationToken::new())
        .await;
    assert_eq!(outcome.stop_reason, StopReason::Terminated);
    let (answer, _, why) = answer_of(&outcome);
    assert_eq!(answer, None);
    assert!(
        why.is_some_and(|w| w.contains("without stating an answer")),
        "{why:?}"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn a_timeout_keeps_the_answer_its_code_printed() {
    let task = "answers: timeout";
    let h = Harness::new(
        task,
        vec![
            Reply::from("```python\nprint(3)\n```\nNow the slow part."),
            Reply::from("```python\nimport time\ntime.sleep(600)\n```"),
        ],
    )
    .await;
    let mut settings = TaskSettings::new(task);
    settings.timeout = Some(Duration::from_secs(20));
    let (outcome, _) = h.run(settings, CancellationToken::new()).await;
    assert_eq!(outcome.stop_reason, StopReason::Timeout);
    assert_eq!(
        answer_of(&outcome),
        (Some("3"), Some(tandem_protocol::AnswerFrom::Output), None)
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn a_value_check_reads_the_answer_line_and_names_both_values() {
    let check = |value: serde_json::Value| tandem_protocol::Check {
        value: Some(value),
        tolerance: Some(0.01),
        ..tandem_protocol::Check::default()
    };
    let run = |task: &'static str, replies: Vec<Reply>, value: serde_json::Value| async move {
        let h = Harness::new(task, replies).await;
        let mut settings = TaskSettings::new(task);
        settings.check = Some(check(value));
        h.run(settings, CancellationToken::new()).await.0
    };
    let solved = run(
        "values: mean",
        vec![
            Reply::from("```python\nprint(round(10 / 3, 4))\n```"),
            Reply::from("The mean is about 3.333.\nAnswer: 3.333"),
        ],
        serde_json::json!(3.33),
    )
    .await;
    let check = solved.check.unwrap();
    assert_eq!(check.verdict, tandem_protocol::Verdict::Solved, "{check:?}");
    assert_eq!(check.printed, Some(true));
    // An answer line its code contradicts is told once; insisted on, the answer is what ran.
    let insisted = run(
        "values: insisted",
        vec![
            Reply::from("```python\nprint(19)\n```"),
            Reply::from("Apples: 19\nAnswer: 20"),
            Reply::from("Answer: 20"),
        ],
        serde_json::json!(19),
    )
    .await;
    assert_eq!(insisted.answer.as_deref(), Some("19"));
    assert_eq!(
        insisted.check.unwrap().verdict,
        tandem_protocol::Verdict::Solved
    );
    // The code printed the value, the answer does not give it: both named, and `printed`.
    let missed = run(
        "values: missed",
        vec![
            Reply::from("```python\nprint('total 19')\nprint('per bag 5')\n```"),
            Reply::from("Answer: 5"),
        ],
        serde_json::json!(19),
    )
    .await;
    let check = missed.check.unwrap();
    assert_eq!(check.verdict, tandem_protocol::Verdict::Unsolved);
    assert_eq!(check.printed, Some(true));
    assert_eq!(check.detail, "expected 19; the answer says \"5\"");
    let never = run(
        "values: never printed",
        vec![Reply::from("It is Tuesday.\nTERMINATE")],
        serde_json::json!("Wednesday"),
    )
    .await;
    let check = never.check.unwrap();
    assert_eq!(check.verdict, tandem_protocol::Verdict::Unsolved);
    assert_eq!(check.printed, Some(false));
    assert_eq!(
        check.detail,
        "expected \"Wednesday\"; the answer says \"It is Tuesday.\""
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn an_answer_from_huge_or_broken_output_is_cut_and_marked() {
    let task = "answers: huge output";
    let code = "```python\nimport sys\nsys.stdout.buffer.write(b'\\xff\\xfe head ' + b'x' * 200000 + b' tail\\n')\n```\nTERMINATE";
    let h = Harness::new(task, vec![Reply::from(code)]).await;
    let (outcome, _) = h
        .run(TaskSettings::new(task), CancellationToken::new())
        .await;
    assert_eq!(outcome.stop_reason, StopReason::Terminated);
    let (answer, from, _) = answer_of(&outcome);
    let answer = answer.unwrap();
    assert_eq!(from, Some(tandem_protocol::AnswerFrom::Output));
    assert!(
        answer.len() <= tandem_agent::grounding::ANSWER_CAP + 64,
        "{}",
        answer.len()
    );
    assert!(
        answer.starts_with("\u{fffd}\u{fffd} head x"),
        "{}",
        &answer[..40]
    );
    assert!(answer.ends_with("x tail") && answer.contains(" bytes cut ...]"));
}
