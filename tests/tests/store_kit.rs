//! The store kit: every `TaskStore` method held to one behaviour, case by case, on SQLite and
//! on a real PostgreSQL server, as the executor kit holds every executor to one. Each case
//! gets an empty store; a failing case is named with what it saw, and the others still run.
//!
//! Times passed to the store are the real clock's, because PostgreSQL times leases by its own
//! clock (several daemons share it) and SQLite by the one it is given: with the real clock
//! both see the same lapses.

use std::panic::AssertUnwindSafe;
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use tandem_daemon::store::{Change, Fences, PgStore, Store, TaskStore};
use tandem_protocol::{
    Decision, ErrorCode, ErrorInfo, EventMsg, StopReason, TaskSpec, TaskState, Usage,
};
use tandem_tests::Postgres;

/// One case: a name, what it holds the store to, and the check.
type Case = (&'static str, &'static str, fn(&dyn TaskStore));

const CASES: &[Case] = &[
    (
        "create_get_list",
        "a created task is queued, readable by id, and listed in the order asked",
        create_get_list,
    ),
    (
        "events_in_order",
        "events are numbered per task from 1, returned as stored, and read after a seq",
        events_in_order,
    ),
    (
        "usage_and_the_end",
        "usage adds up over assistant messages; the end records why, the error and the time",
        usage_and_the_end,
    ),
    (
        "transition_only_from",
        "a transition moves a task only from the state it names",
        transition_only_from,
    ),
    (
        "pages",
        "pages run newest first and say where the next starts; list_after runs oldest first",
        pages,
    ),
    (
        "counts",
        "counts follow every change, every state present",
        counts,
    ),
    (
        "files_removed",
        "the removal of a task's workspace is recorded",
        files_removed,
    ),
    (
        "claim_order",
        "queued tasks are claimed oldest first, each once, and a claim starts the task",
        claim_order,
    ),
    (
        "lapsed_first",
        "a lapsed lease is claimed before any queued task, the longest lapsed first",
        lapsed_first,
    ),
    (
        "own_tasks_not_claimed",
        "a daemon does not claim a task it still runs; another does",
        own_tasks_not_claimed,
    ),
    (
        "fencing",
        "a lapsed lease is taken over and the old holder's writes are fenced out",
        fencing,
    ),
    (
        "cancel_reaches_holder",
        "a cancel asked before or after a claim reaches the daemon that holds the task",
        cancel_reaches_holder,
    ),
    (
        "decided_once",
        "an approval is decided once, whoever decides first, and never for a finished task",
        decided_once,
    ),
    (
        "interrupt_running",
        "at start-up, a dead daemon's tasks are no longer held by it",
        interrupt_running,
    ),
    (
        "notices_return",
        "asking for notices returns at once",
        notices_return,
    ),
    (
        "first_trace_kept",
        "a task's trace is its first traced run's, whatever later runs or hostile values say",
        first_trace_kept,
    ),
];

/// Runs every case on a store `open` makes for it; panics naming each case that failed.
fn kit(engine: &str, open: impl Fn() -> (Arc<dyn TaskStore>, Option<tempfile::TempDir>)) {
    let mut failed = Vec::new();
    for (name, about, case) in CASES {
        let (store, _guard) = open();
        if std::panic::catch_unwind(AssertUnwindSafe(|| case(store.as_ref()))).is_err() {
            failed.push(format!("{name} ({about})"));
        }
    }
    assert!(
        failed.is_empty(),
        "the {engine} store fails {} of {} store kit cases:\n  {}",
        failed.len(),
        CASES.len(),
        failed.join("\n  ")
    );
}

#[test]
fn sqlite_passes_the_store_kit() {
    kit("SQLite", || {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open(&dir.path().join("tandem.db")).unwrap();
        (Arc::new(store), Some(dir))
    });
}

#[test]
fn postgres_passes_the_store_kit() {
    kit("PostgreSQL", || {
        let url = Postgres::shared().new_database();
        let store = PgStore::open(&url, "the test's URL", &Default::default()).unwrap();
        (Arc::new(store), None)
    });
}

fn now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_millis() as u64
}

fn create(store: &dyn TaskStore, ids: &[&str]) {
    let changes: Vec<Change> = ids
        .iter()
        .map(|id| {
            let spec = TaskSpec {
                task: format!("task {id}"),
                ..TaskSpec::default()
            };
            Change::Create((*id).to_owned(), Box::new(spec), now())
        })
        .collect();
    store.apply(&changes, &Fences::new()).unwrap();
}

fn ids(tasks: &[tandem_protocol::TaskRecord]) -> Vec<&str> {
    tasks.iter().map(|t| t.id.as_str()).collect()
}

fn turn(n: u32) -> EventMsg {
    EventMsg::TurnStarted {
        turn: n,
        agent: None,
    }
}

fn reply(turn: u32, prompt: u64, completion: u64) -> EventMsg {
    EventMsg::AssistantMessage {
        turn,
        text: format!("reply {turn}"),
        usage: Some(Usage {
            prompt_tokens: prompt,
            completion_tokens: completion,
            estimated: false,
        }),
        tool_calls: Vec::new(),
    }
}

fn finished(turns: u32) -> EventMsg {
    EventMsg::finished(
        StopReason::Error,
        turns,
        Usage::default(),
        5,
        Some(ErrorInfo {
            code: ErrorCode::ModelUnreachable,
            message: "the model server is down".into(),
        }),
    )
}

fn decided(by: &str) -> EventMsg {
    EventMsg::ApprovalDecided {
        turn: 1,
        index: 1,
        n: 1,
        decision: Decision::Approve,
        by: by.to_owned(),
        code: None,
        reason: None,
        rule: None,
    }
}

fn event(store: &dyn TaskStore, id: &str, msg: EventMsg) {
    store
        .apply(&[Change::Event(id.into(), msg, now())], &Fences::new())
        .unwrap();
}

/// Claims a task as `daemon`, which must find one.
fn claim(store: &dyn TaskStore, daemon: &str, lease_ms: u64) -> tandem_daemon::store::Claimed {
    store
        .claim(daemon, lease_ms, now(), &[])
        .unwrap()
        .unwrap_or_else(|| panic!("{daemon} found nothing to claim"))
}

/// Lets the leases given for 1 ms lapse.
fn lapse() {
    std::thread::sleep(Duration::from_millis(30));
}

fn create_get_list(store: &dyn TaskStore) {
    let before = now();
    create(store, &["b", "a", "c"]);
    let a = store.get("a").unwrap().unwrap();
    assert_eq!(
        (a.state, a.spec.task.as_str()),
        (TaskState::Queued, "task a")
    );
    assert!(a.created_ms >= before, "{a:?}");
    assert_eq!(
        (a.turns, a.usage, a.started_ms),
        (0, Usage::default(), None)
    );
    assert!(store.get("nope").unwrap().is_none());
    assert_eq!(ids(&store.list(None).unwrap()), ["b", "a", "c"]);
    assert_eq!(
        ids(&store.list(Some(TaskState::Queued)).unwrap()),
        ["b", "a", "c"]
    );
    assert!(store.list(Some(TaskState::Running)).unwrap().is_empty());
}

fn events_in_order(store: &dyn TaskStore) {
    create(store, &["t", "u"]);
    let applied = store
        .apply(
            &[
                Change::Event("t".into(), turn(1), 10),
                Change::Event("u".into(), turn(1), 11),
                Change::Event("t".into(), turn(2), 12),
            ],
            &Fences::new(),
        )
        .unwrap();
    let told: Vec<(&str, u64, u64)> = applied
        .events
        .iter()
        .map(|(id, e)| (id.as_str(), e.seq, e.at_ms))
        .collect();
    assert_eq!(told, [("t", 1, 10), ("u", 1, 11), ("t", 2, 12)]);
    event(store, "t", turn(3));
    let all = store.events_after("t", 0).unwrap();
    let seqs: Vec<u64> = all.iter().map(|e| e.seq).collect();
    assert_eq!(seqs, [1, 2, 3]);
    assert_eq!(all[1].msg, turn(2));
    let later = store.events_after("t", 2).unwrap();
    assert_eq!((later.len(), later[0].msg.clone()), (1, turn(3)));
    assert!(store.events_after("u", 1).unwrap().is_empty());
    assert!(store.events_after("nope", 0).unwrap().is_empty());
}

fn usage_and_the_end(store: &dyn TaskStore) {
    create(store, &["t"]);
    store
        .apply(
            &[Change::State("t".into(), TaskState::Running, 100)],
            &Fences::new(),
        )
        .unwrap();
    event(store, "t", reply(1, 10, 2));
    event(store, "t", turn(2));
    event(store, "t", reply(2, 30, 4));
    let mid = store.get("t").unwrap().unwrap();
    assert_eq!(
        (mid.state, mid.turns, mid.started_ms),
        (TaskState::Running, 2, Some(100))
    );
    assert_eq!(
        (mid.usage.prompt_tokens, mid.usage.completion_tokens),
        (40, 6)
    );
    store
        .apply(
            &[Change::Event("t".into(), finished(2), 200)],
            &Fences::new(),
        )
        .unwrap();
    let end = store.get("t").unwrap().unwrap();
    assert_eq!(end.state, TaskState::Finished);
    assert_eq!(end.stop_reason, Some(StopReason::Error));
    assert_eq!(
        end.error.as_ref().map(|e| (e.code, e.message.as_str())),
        Some((ErrorCode::ModelUnreachable, "the model server is down"))
    );
    assert_eq!((end.turns, end.finished_ms), (2, Some(200)));
    // The end's own usage does not overwrite the sum of the messages'.
    assert_eq!(
        (end.usage.prompt_tokens, end.usage.completion_tokens),
        (40, 6)
    );
}

fn transition_only_from(store: &dyn TaskStore) {
    create(store, &["t"]);
    assert!(
        store
            .transition("t", TaskState::Queued, TaskState::Running, 50)
            .unwrap()
    );
    assert!(
        !store
            .transition("t", TaskState::Queued, TaskState::Running, 60)
            .unwrap(),
        "moved twice"
    );
    let t = store.get("t").unwrap().unwrap();
    assert_eq!((t.state, t.started_ms), (TaskState::Running, Some(50)));
    assert!(
        store
            .transition("t", TaskState::Running, TaskState::Interrupted, 70)
            .unwrap()
    );
    assert_eq!(
        store.get("t").unwrap().unwrap().started_ms,
        Some(50),
        "a move to another state than running changed the start"
    );
    assert!(
        !store
            .transition("nope", TaskState::Queued, TaskState::Running, 80)
            .unwrap()
    );
}

fn pages(store: &dyn TaskStore) {
    create(store, &["t1", "t2", "t3", "t4", "t5"]);
    store
        .apply(
            &[Change::State("t4".into(), TaskState::Running, 1)],
            &Fences::new(),
        )
        .unwrap();
    let (page, next) = store.page(None, None, 2).unwrap();
    assert_eq!(
        (ids(&page), next.as_deref()),
        (vec!["t5", "t4"], Some("t4"))
    );
    let (page, next) = store.page(None, Some("t4"), 2).unwrap();
    assert_eq!(
        (ids(&page), next.as_deref()),
        (vec!["t3", "t2"], Some("t2"))
    );
    let (page, next) = store.page(None, Some("t2"), 2).unwrap();
    assert_eq!((ids(&page), next), (vec!["t1"], None));
    let (page, next) = store.page(None, None, 5).unwrap();
    assert_eq!(
        (page.len(), next),
        (5, None),
        "a full last page has no next"
    );
    let (page, next) = store.page(None, Some("nope"), 2).unwrap();
    assert!(page.is_empty() && next.is_none(), "an unknown `before`");
    let (page, _) = store.page(Some(TaskState::Queued), None, 10).unwrap();
    assert_eq!(ids(&page), ["t5", "t3", "t2", "t1"]);
    let (page, _) = store.page(None, None, usize::MAX).unwrap();
    assert_eq!(page.len(), 5, "the largest limit");
    assert_eq!(ids(&store.list_after(None, None, 2).unwrap()), ["t1", "t2"]);
    assert_eq!(
        ids(&store.list_after(None, Some("t2"), 2).unwrap()),
        ["t3", "t4"]
    );
    assert_eq!(
        ids(&store
            .list_after(Some(TaskState::Queued), Some("t2"), 9)
            .unwrap()),
        ["t3", "t5"]
    );
    assert!(store.list_after(None, Some("t5"), 9).unwrap().is_empty());
}

fn count_of(store: &dyn TaskStore, state: TaskState) -> u64 {
    let counts = store.counts().unwrap();
    assert_eq!(
        counts.len(),
        TaskState::ALL.len(),
        "every state is counted: {counts:?}"
    );
    counts
        .iter()
        .find(|(s, _)| *s == state)
        .map(|(_, n)| *n)
        .unwrap()
}

fn counts(store: &dyn TaskStore) {
    assert_eq!(count_of(store, TaskState::Queued), 0);
    create(store, &["a", "b", "c"]);
    assert_eq!(count_of(store, TaskState::Queued), 3);
    claim(store, "d", 60_000);
    store
        .transition("b", TaskState::Queued, TaskState::Interrupted, 1)
        .unwrap();
    event(store, "a", finished(1));
    assert_eq!(
        [
            count_of(store, TaskState::Queued),
            count_of(store, TaskState::Running),
            count_of(store, TaskState::Interrupted),
            count_of(store, TaskState::Finished),
        ],
        [1, 0, 1, 1]
    );
}

fn files_removed(store: &dyn TaskStore) {
    create(store, &["t"]);
    assert_eq!(store.get("t").unwrap().unwrap().files_removed_ms, None);
    store.files_removed("t", 77).unwrap();
    assert_eq!(store.get("t").unwrap().unwrap().files_removed_ms, Some(77));
    // A task that is not there is no error: retention may race a purge.
    store.files_removed("nope", 78).unwrap();
}

fn claim_order(store: &dyn TaskStore) {
    create(store, &["b", "a", "c"]);
    event(store, "a", turn(1));
    let first = claim(store, "d", 60_000);
    assert_eq!((first.record.id.as_str(), first.epoch), ("b", 1));
    assert_eq!(first.record.state, TaskState::Running);
    assert!(first.record.started_ms.is_some(), "{:?}", first.record);
    assert!(!first.cancel);
    let second = claim(store, "d", 60_000);
    assert_eq!(second.record.id, "a");
    let told: Vec<_> = second.events.iter().map(|e| e.msg.clone()).collect();
    assert_eq!(told, [turn(1)], "a claim brings the task's past");
    assert_eq!(claim(store, "e", 60_000).record.id, "c");
    assert!(store.claim("e", 60_000, now(), &[]).unwrap().is_none());
    assert_eq!(store.owner("a", now()).unwrap().as_deref(), Some("d"));
    assert_eq!(store.owner("c", now()).unwrap().as_deref(), Some("e"));
}

fn lapsed_first(store: &dyn TaskStore) {
    create(store, &["early", "late"]);
    let early = claim(store, "a", 60_000);
    let late = claim(store, "a", 60_000);
    assert_eq!(
        (early.record.id.as_str(), late.record.id.as_str()),
        ("early", "late")
    );
    create(store, &["waiting"]);
    // `late` lapses first, `early` after it: the one that lapsed longest ago is claimed
    // first, whatever the order the tasks were asked in.
    store
        .renew("a", &[("late".into(), late.epoch)], 1, now())
        .unwrap();
    lapse();
    store
        .renew("a", &[("early".into(), early.epoch)], 1, now())
        .unwrap();
    lapse();
    let got: Vec<String> = (0..3)
        .map(|_| claim(store, "b", 60_000).record.id)
        .collect();
    assert_eq!(got, ["late", "early", "waiting"]);
    let again = store.get("late").unwrap().unwrap();
    assert_eq!(again.state, TaskState::Running);
    assert_eq!(
        again.started_ms, late.record.started_ms,
        "a takeover is not a new start"
    );
}

fn own_tasks_not_claimed(store: &dyn TaskStore) {
    create(store, &["t"]);
    let held = claim(store, "a", 60_000);
    assert!(
        store.claim("b", 60_000, now(), &[]).unwrap().is_none(),
        "a held task was claimed"
    );
    store
        .renew("a", &[("t".into(), held.epoch)], 1, now())
        .unwrap();
    lapse();
    assert!(
        store
            .claim("a", 60_000, now(), &["t".to_owned()])
            .unwrap()
            .is_none(),
        "a daemon claimed a task it runs"
    );
    assert_eq!(claim(store, "b", 60_000).epoch, held.epoch + 1);
}

fn fencing(store: &dyn TaskStore) {
    create(store, &["t"]);
    let a = claim(store, "a", 60_000);
    assert_eq!(a.epoch, 1);
    assert!(
        store
            .renew("a", &[("t".into(), 1)], 1, now())
            .unwrap()
            .lost
            .is_empty()
    );
    lapse();
    assert!(store.owner("t", now()).unwrap().is_none(), "a lapsed owner");
    let b = claim(store, "b", 60_000);
    assert_eq!((b.record.id.as_str(), b.epoch), ("t", 2));
    let fence = |e| Fences::from([("t".to_owned(), e)]);
    let refused = store
        .apply(&[Change::Event("t".into(), turn(9), now())], &fence(1))
        .unwrap();
    assert_eq!(
        (refused.events.len(), refused.fenced),
        (0, vec!["t".to_owned()])
    );
    let kept = store
        .apply(&[Change::Event("t".into(), turn(2), now())], &fence(2))
        .unwrap();
    assert!(kept.fenced.is_empty());
    let events = store.events_after("t", 0).unwrap();
    assert_eq!(events.len(), 1, "{events:?}");
    assert_eq!(events[0].msg, turn(2));
    assert_eq!(
        store
            .renew("a", &[("t".into(), 1)], 60_000, now())
            .unwrap()
            .lost,
        ["t"]
    );
    assert!(
        store
            .renew("b", &[("t".into(), 2)], 60_000, now())
            .unwrap()
            .lost
            .is_empty()
    );
    assert_eq!(store.owner("t", now()).unwrap().as_deref(), Some("b"));
}

fn cancel_reaches_holder(store: &dyn TaskStore) {
    create(store, &["before", "after"]);
    store.request_cancel("before").unwrap();
    let b = claim(store, "d", 60_000);
    assert_eq!((b.record.id.as_str(), b.cancel), ("before", true));
    let a = claim(store, "d", 60_000);
    assert!(!a.cancel);
    let held = [
        ("before".to_owned(), b.epoch),
        ("after".to_owned(), a.epoch),
    ];
    assert_eq!(
        store.renew("d", &held, 60_000, now()).unwrap().cancel,
        ["before"]
    );
    store.request_cancel("after").unwrap();
    let renewed = store.renew("d", &held, 60_000, now()).unwrap();
    assert_eq!(renewed.cancel, ["before", "after"]);
    assert!(renewed.lost.is_empty());
    // Asking for a task that is not there is no error.
    store.request_cancel("nope").unwrap();
}

fn decided_once(store: &dyn TaskStore) {
    create(store, &["t", "done"]);
    let first = store.decide("t", 1, &decided("user"), 5).unwrap();
    assert_eq!(first.map(|e| (e.seq, e.msg)), Some((1, decided("user"))));
    assert!(
        store
            .decide("t", 1, &decided("timeout"), 6)
            .unwrap()
            .is_none(),
        "decided twice"
    );
    let stored = store.events_after("t", 0).unwrap();
    assert_eq!(stored.len(), 1);
    assert_eq!(stored[0].msg, decided("user"));
    assert!(
        store
            .decide("nope", 1, &decided("user"), 6)
            .unwrap()
            .is_none()
    );
    event(store, "done", finished(1));
    assert!(
        store
            .decide("done", 1, &decided("user"), 7)
            .unwrap()
            .is_none(),
        "decided for a finished task"
    );
}

fn interrupt_running(store: &dyn TaskStore) {
    create(store, &["mine", "theirs", "queued"]);
    let mine = claim(store, "dead", 60_000);
    let theirs = claim(store, "alive", 60_000);
    assert_eq!(
        (mine.record.id.as_str(), theirs.record.id.as_str()),
        ("mine", "theirs")
    );
    store.interrupt_running("dead").unwrap();
    // A store one daemon owns interrupts the task; a shared one ends its lease so that any
    // daemon resumes it at once. Either way the dead daemon holds it no longer.
    assert_eq!(store.owner("mine", now()).unwrap(), None);
    assert_eq!(
        store.get("queued").unwrap().unwrap().state,
        TaskState::Queued
    );
    let after = store.get("mine").unwrap().unwrap().state;
    assert!(
        matches!(after, TaskState::Interrupted | TaskState::Running),
        "{after:?}"
    );
}

fn notices_return(store: &dyn TaskStore) {
    store.notices("d", Box::new(|_| {})).unwrap();
    create(store, &["t"]);
    assert!(store.get("t").unwrap().is_some());
}

fn started(trace: Option<&str>) -> EventMsg {
    EventMsg::TaskStarted {
        task: "t".to_owned(),
        model: "m".to_owned(),
        base_url: "http://127.0.0.1:1/v1".to_owned(),
        executor: "local".to_owned(),
        trace: trace.map(str::to_owned),
    }
}

fn first_trace_kept(store: &dyn TaskStore) {
    create(store, &["t"]);
    // Untraced, and values that are not a traceparent, leave no trace id.
    for trace in [
        None,
        Some("garbage"),
        Some("00-xyz-00f067aa0ba902b7-01"),
        Some("00-4bf92f3577b34da6a3ce929d0e0e4736'; DROP TABLE tasks; --"),
    ] {
        event(store, "t", started(trace));
    }
    assert_eq!(store.get("t").unwrap().unwrap().trace_id, None);
    let first = "4bf92f3577b34da6a3ce929d0e0e4736";
    event(
        store,
        "t",
        started(Some(&format!("00-{first}-00f067aa0ba902b7-01"))),
    );
    // A resumed run's start names its own span: the task's trace stays the first's.
    event(
        store,
        "t",
        started(Some(
            "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
        )),
    );
    assert_eq!(
        store.get("t").unwrap().unwrap().trace_id.as_deref(),
        Some(first)
    );
    assert_eq!(
        store.list(None).unwrap()[0].trace_id.as_deref(),
        Some(first)
    );
}
