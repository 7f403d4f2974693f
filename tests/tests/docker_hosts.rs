//! Sandboxes on more than one engine: the system engine and a second `dockerd` this binary
//! starts, reached over TLS with certificates it makes (tandem_tests::second_engine). The
//! second engine is a remote host as far as Tandem can tell: its workspaces are volumes, and
//! files travel as tar through its API.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tandem_agent::{ChatModel, EventSink, ModelConfig, TaskSettings, run_task};
use tandem_executor::{CancellationToken, Executor, SessionSpec};
use tandem_executor_docker::{DockerConfig, DockerExecutor, DockerFleet, HostSpec, WorkspaceMode};
use tandem_protocol::{BlockStatus, EventMsg, StopReason};
use tandem_tests::conformance;

use crate::docker_executor::docker_cli;
use tandem_tests::second_engine::{self, EXCLUSIVE, SecondEngine};
use tandem_tests::{ScriptedOpenAi, script, texts};

/// The system engine as host `a`, with volume workspaces like the remote one.
fn system(name: &str) -> DockerConfig {
    DockerConfig {
        name: name.to_owned(),
        image: second_engine::image(),
        pull: false,
        pool_size: 0,
        workspace: WorkspaceMode::Volume,
        ..DockerConfig::default()
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn a_tls_host_passes_the_conformance_suite() {
    let engine = second_engine::shared().await;
    let _held = EXCLUSIVE.read().await;
    let remote = DockerExecutor::connect(engine.config("b"))
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    conformance::all(Arc::new(remote), &[]).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn a_wrong_certificate_is_a_clear_error_naming_the_host() {
    let engine = second_engine::shared().await;
    let _held = EXCLUSIVE.read().await;
    let dir = tempfile::tempdir().unwrap();
    second_engine::authority(dir.path(), "rogue-ca");
    let rogue = second_engine::client_files(dir.path(), "rogue-ca", "rogue");
    // Tandem does not trust the engine's certificate; then the engine does not trust Tandem's.
    let cases = [
        (rogue.clone(), "certificate"),
        (
            tandem_executor_docker::TlsFiles {
                ca: engine.tls.ca.clone(),
                ..rogue
            },
            "",
        ),
    ];
    for (tls, says) in cases {
        let Err(e) = DockerExecutor::connect(DockerConfig {
            tls: Some(tls),
            ..engine.config("b-wrong")
        })
        .await
        else {
            panic!("a client with the wrong certificates was let in");
        };
        let text = e.to_string();
        assert!(
            text.starts_with(&format!(
                "cannot reach the Docker engine `b-wrong` at {}: ",
                engine.url
            )),
            "{text}"
        );
        assert!(text.contains(says), "{text}");
        assert!(text.ends_with("check the host's TLS files: its `ca` must have signed the engine's certificate, and the engine must trust `cert` (and `key`)"), "{text}");
    }
}

/// Every container and volume of `engine` (the system one when `None`) that a Tandem made.
fn leftovers(engine: Option<&SecondEngine>, label: &str) -> Vec<String> {
    let filter = format!("label={label}");
    let ps = ["ps", "-aq", "--filter", &filter];
    let volumes = ["volume", "ls", "-q", "--filter", &filter];
    let (a, b) = match engine {
        Some(e) => (e.cli(&ps), e.cli(&volumes)),
        None => (docker_cli(&ps), docker_cli(&volumes)),
    };
    a.lines().chain(b.lines()).map(str::to_owned).collect()
}

async fn until(what: &str, mut check: impl AsyncFnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(120);
    while !check().await {
        assert!(Instant::now() < deadline, "{what}: not within 120 s");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn sessions_spread_over_two_hosts_and_a_task_whose_host_dies_carries_on_on_the_other() {
    let engine = second_engine::shared().await;
    let _held = EXCLUSIVE.write().await;
    // The fleet brings the image to a host that lacks it.
    let image = second_engine::image();
    engine.cli(&["rmi", "-f", &image]);
    let host = |config: DockerConfig, zone: &str| HostSpec {
        config,
        capacity: 2,
        labels: BTreeMap::from([("zone".to_owned(), zone.to_owned())]),
    };
    let fleet = DockerFleet::connect(
        vec![host(engine.config("b"), "b"), host(system("a"), "a")],
        Duration::from_millis(300),
    )
    .await
    .unwrap_or_else(|e| panic!("{e}"));
    assert!(
        !engine.cli(&["images", "-q", &image]).is_empty(),
        "the image was not copied to the host that lacked it"
    );

    // Four sessions fill both hosts, two each; a fifth finds both full.
    let tag = format!("spread-{}", std::process::id());
    let label = format!("tandem.task={tag}");
    let spec = |placement: &[(&str, &str)]| SessionSpec {
        labels: vec![("tandem.task".to_owned(), tag.clone())],
        placement: placement
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect(),
        ..Default::default()
    };
    let mut open = Vec::new();
    for _ in 0..4 {
        open.push(fleet.open(spec(&[])).await.unwrap());
    }
    let count = |e: Option<&SecondEngine>| {
        leftovers(e, &label)
            .iter()
            .filter(|id| !id.starts_with("tandem-ws-"))
            .count()
    };
    assert_eq!((count(Some(engine)), count(None)), (2, 2));
    let loads: Vec<(String, usize)> = fleet
        .hosts()
        .into_iter()
        .map(|h| (h.name, h.sessions))
        .collect();
    assert_eq!(loads, [("b".to_owned(), 2), ("a".to_owned(), 2)]);
    let Err(full) = fleet.open(spec(&[])).await else {
        panic!("a fifth session fit in two hosts of two");
    };
    assert_eq!(
        full.to_string(),
        "a Docker host for this session is not available: b: full (2 of 2); a: full (2 of 2); wait for a host to come back or a session to end, or add capacity in [[executors.docker.hosts]]"
    );
    for s in open.drain(..) {
        s.close().await.unwrap();
    }
    // Placement picks by label.
    let s = fleet.open(spec(&[("zone", "a")])).await.unwrap();
    assert_eq!((count(Some(engine)), count(None)), (0, 1));
    s.close().await.unwrap();
    let Err(nowhere) = fleet.open(spec(&[("zone", "c")])).await else {
        panic!("a session was placed on a host without its label");
    };
    assert!(
        nowhere
            .to_string()
            .starts_with("a Docker host for this session with labels zone=c is not available: b: no label zone=c; a: no label zone=c"),
        "{nowhere}"
    );
    assert!(leftovers(Some(engine), &label).is_empty());
    assert!(leftovers(None, &label).is_empty());

    // A task starts on b (both are empty; b comes first), writes a file, and b dies while
    // its second block runs: the block runs again on a, from the file the first one left.
    let task = format!("carry on {tag}");
    let server = ScriptedOpenAi::start(script([(
        task.as_str(),
        texts(&[
            "```python\nopen('state.txt', 'w').write('kept from b')\nprint('wrote')\n```",
            "```python\nimport time\nprint(open('state.txt').read(), flush=True)\ntime.sleep(3)\nprint('slept')\n```",
            "Done. TERMINATE",
        ]),
    )]))
    .await
    .unwrap();
    let model = ChatModel::new(ModelConfig {
        base_url: server.base_url(),
        max_retries: 0,
        ..ModelConfig::default()
    })
    .unwrap();
    let mut settings = TaskSettings::new(task.as_str());
    settings.max_turns = 5;
    settings.session = spec(&[]);
    let events = Arc::new(Mutex::new(Vec::new()));
    let (seen_tx, mut seen) = tokio::sync::mpsc::unbounded_channel();
    let into = events.clone();
    let sink: EventSink = Arc::new(move |e: EventMsg| {
        if let EventMsg::ExecOutput { turn: 2, text, .. } = &e
            && text.contains("kept from b")
        {
            let _ = seen_tx.send(());
        }
        into.lock().unwrap().push(e);
    });
    let executor: Arc<dyn Executor> = Arc::new(fleet.clone());
    let running = tokio::spawn(async move {
        run_task(settings, &model, executor, sink, CancellationToken::new()).await
    });
    tokio::time::timeout(Duration::from_secs(120), seen.recv())
        .await
        .expect("the second block did not start within 120 s");
    assert_eq!(
        (count(Some(engine)), count(None)),
        (1, 0),
        "the task began on b"
    );
    tokio::task::spawn_blocking(move || engine.kill())
        .await
        .unwrap();
    let outcome = tokio::time::timeout(Duration::from_secs(180), running)
        .await
        .expect("the task did not end within 180 s after its host died")
        .unwrap();
    let events = events.lock().unwrap().clone();
    assert_eq!(outcome.stop_reason, StopReason::Terminated, "{events:#?}");
    let lost: Vec<(u32, String)> = events
        .iter()
        .filter_map(|e| match e {
            EventMsg::SandboxLost { turn, host, .. } => Some((*turn, host.clone())),
            _ => None,
        })
        .collect();
    assert_eq!(lost, [(2, "b".to_owned())]);
    let second: Vec<_> = events
        .iter()
        .filter_map(|e| match e {
            EventMsg::ExecResult {
                turn: 2, result, ..
            } => Some(result.clone()),
            _ => None,
        })
        .collect();
    assert_eq!(second.len(), 1, "{second:?}");
    assert_eq!(second[0].status, BlockStatus::Exited);
    assert_eq!(second[0].stdout, "kept from b\nslept\n");
    let b = fleet.hosts().into_iter().find(|h| h.name == "b").unwrap();
    assert!(!b.up, "{b:?}");
    assert!(
        leftovers(None, &label).is_empty(),
        "the session on a was not removed"
    );

    // b comes back: what the lost session left there is removed.
    tokio::task::spawn_blocking(move || engine.restart())
        .await
        .unwrap();
    until("host b back up", async || {
        fleet.probe().await;
        fleet.hosts().iter().all(|h| h.up)
    })
    .await;
    assert_eq!(leftovers(Some(engine), &label), Vec::<String>::new());
    fleet.shutdown().await;
}
