//! What only the shared task store does: several daemons claiming from one queue, notices
//! between them, and errors that name the setting (the store kit, `store_kit.rs`, holds both
//! engines to what every store does). PostgreSQL is a real server from the system packages.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tandem_daemon::store::{Change, Fences, Notice, PgStore, TaskStore};
use tandem_protocol::{EventMsg, TaskSpec};
use tandem_tests::Postgres;

fn create(store: &dyn TaskStore, ids: &[String]) {
    let changes: Vec<Change> = ids
        .iter()
        .map(|id| {
            let spec = TaskSpec {
                task: id.clone(),
                ..TaskSpec::default()
            };
            Change::Create(id.clone(), Box::new(spec), 1)
        })
        .collect();
    store.apply(&changes, &Fences::new()).unwrap();
}

fn turn(n: u32) -> EventMsg {
    EventMsg::TurnStarted {
        turn: n,
        agent: None,
    }
}

#[test]
fn daemons_on_one_database_claim_each_queued_task_exactly_once() {
    let url = Postgres::shared().new_database();
    let ids: Vec<String> = (0..300).map(|i| format!("task{i:03}")).collect();
    let daemons: Vec<Arc<PgStore>> = (0..3)
        .map(|_| Arc::new(PgStore::open(&url, "the test's URL", &Default::default()).unwrap()))
        .collect();
    create(daemons[0].as_ref(), &ids);
    let claimed: Arc<Mutex<HashMap<String, Vec<String>>>> = Arc::default();
    std::thread::scope(|s| {
        for (d, store) in daemons.iter().enumerate() {
            for worker in 0..3 {
                let (store, claimed) = (store.clone(), claimed.clone());
                s.spawn(move || {
                    let me = format!("d{d}w{worker}");
                    while let Some(task) = store.claim(&me, 60_000, 1, &[]).unwrap() {
                        claimed
                            .lock()
                            .unwrap()
                            .entry(task.record.id)
                            .or_default()
                            .push(me.clone());
                    }
                });
            }
        }
    });
    let claimed = claimed.lock().unwrap();
    assert_eq!(claimed.len(), ids.len());
    let twice: Vec<_> = claimed.iter().filter(|(_, by)| by.len() != 1).collect();
    assert!(twice.is_empty(), "claimed more than once: {twice:?}");
}

#[test]
fn another_daemon_hears_of_events_queued_tasks_and_cancels() {
    let url = Postgres::shared().new_database();
    let a = PgStore::open(&url, "the test's URL", &Default::default()).unwrap();
    let b = PgStore::open(&url, "the test's URL", &Default::default()).unwrap();
    let (told, heard) = std::sync::mpsc::channel();
    let told = Mutex::new(told);
    b.notices(
        "b",
        Box::new(move |n| {
            let _ = told.lock().unwrap().send(n);
        }),
    )
    .unwrap();
    a.notices("a", Box::new(|_| {})).unwrap();
    // The listener connects in the background, and a notice sent before it listens is
    // missed: a probe is sent until one is heard.
    let mut probes = 0;
    loop {
        create(&a, &[format!("probe{probes}")]);
        probes += 1;
        if heard.recv_timeout(Duration::from_millis(200)) == Ok(Notice::Queued) {
            break;
        }
        assert!(probes < 300, "B never heard a notice");
    }
    while heard.recv_timeout(Duration::from_millis(200)).is_ok() {}
    create(&a, &["t".to_owned()]);
    a.apply(&[Change::Event("t".into(), turn(1), 2)], &Fences::new())
        .unwrap();
    a.request_cancel("t").unwrap();
    let mut got = Vec::new();
    while got.len() < 3 {
        got.push(
            heard
                .recv_timeout(Duration::from_secs(30))
                .expect("a notice"),
        );
    }
    assert_eq!(
        got,
        [
            Notice::Queued,
            Notice::Events("t".into(), 1),
            Notice::Cancel("t".into())
        ]
    );
}

#[test]
fn a_wrong_password_port_or_url_at_start_names_the_setting_and_the_fix() {
    let pg = Postgres::shared();
    let url = pg.new_database();
    let wrong_password = url.replace(tandem_tests::postgres::PASSWORD, "not-the-password");
    let err = PgStore::open(&wrong_password, "[store] url", &Default::default())
        .err()
        .unwrap()
        .to_string();
    assert!(
        err.contains("refused the login")
            && err.contains("check the user and password")
            && err.contains("check [store] url")
            && !err.contains("not-the-password"),
        "{err}"
    );
    let closed = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = closed.local_addr().unwrap().port();
    drop(closed);
    let err = PgStore::open(
        &format!("postgres://postgres:x@127.0.0.1:{port}/db"),
        "TANDEM_STORE_URL",
        &Default::default(),
    )
    .err()
    .unwrap();
    assert!(err.unreachable(), "{err}");
    let text = err.to_string();
    assert!(
        text.contains("cannot reach the database") && text.contains("check TANDEM_STORE_URL"),
        "{text}"
    );
    let err = PgStore::open("postgres://[bad", "--store", &Default::default())
        .err()
        .unwrap()
        .to_string();
    assert!(err.contains("--store is not a PostgreSQL URL"), "{err}");
    let missing = format!(
        "postgres://postgres:{}@127.0.0.1:{}/no_such_db",
        tandem_tests::postgres::PASSWORD,
        pg.port()
    );
    let err = PgStore::open(&missing, "--store", &Default::default())
        .err()
        .unwrap()
        .to_string();
    assert!(
        err.contains("does not exist") && err.contains("createdb"),
        "{err}"
    );
}

#[test]
fn daemons_starting_together_migrate_the_schema_once() {
    let url = Postgres::shared().new_database();
    let opened: Vec<_> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..4)
            .map(|_| {
                s.spawn(|| PgStore::open(&url, "the test's URL", &Default::default()).map(drop))
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for o in opened {
        o.unwrap();
    }
    let version = |url: &str| {
        Postgres::shared().psql(
            url.rsplit('/').next().unwrap(),
            "SELECT version FROM tandem_schema",
        )
    };
    // Each migration ran once: the version is the one a daemon starting alone leaves.
    let alone = Postgres::shared().new_database();
    PgStore::open(&alone, "the test's URL", &Default::default()).unwrap();
    assert_eq!(version(&url), version(&alone));
    assert!(version(&url).parse::<u32>().unwrap() >= 2);
}
