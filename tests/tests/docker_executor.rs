//! The Docker executor against the real engine, with the image `scripts/build-sandbox-image.sh`
//! builds (or `TANDEM_DOCKER_IMAGE`). A missing engine or image fails these tests.

use std::sync::Arc;
use std::time::Duration;

use serde_json::Value;
use tandem_executor::{ExitStatus, Limits, SessionSpec};
use tandem_executor_docker::{DockerConfig, DockerExecutor, WorkspaceMode};
use tandem_tests::conformance::{self, run};

fn image() -> String {
    std::env::var("TANDEM_DOCKER_IMAGE").unwrap_or_else(|_| "tandem-sandbox:latest".to_owned())
}

async fn docker_with(config: DockerConfig) -> Arc<DockerExecutor> {
    let docker = DockerExecutor::connect(DockerConfig {
        image: image(),
        pull: false,
        ..config
    })
    .await
    .unwrap_or_else(|e| panic!("these tests need the Docker engine: {e}"));
    docker
        .ensure_image(&|_| {})
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    Arc::new(docker)
}

/// An executor without a warm pool, so every session's container is made for it (and its
/// labels checked); the pool has its own test.
async fn docker() -> Arc<DockerExecutor> {
    docker_with(DockerConfig {
        pool_size: 0,
        ..DockerConfig::default()
    })
    .await
}

pub(crate) fn docker_cli(args: &[&str]) -> String {
    let out = std::process::Command::new("docker")
        .args(args)
        .output()
        .expect("the docker CLI");
    assert!(
        out.status.success(),
        "docker {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).trim().to_owned()
}

fn containers_labelled(label: &str) -> Vec<String> {
    docker_cli(&["ps", "-aq", "--filter", &format!("label={label}")])
        .lines()
        .map(str::to_owned)
        .collect()
}

/// A session labelled with `task`, as the daemon opens them.
async fn open_for_task(executor: &DockerExecutor, task: &str) -> Box<dyn tandem_executor::Session> {
    tandem_executor::Executor::open(
        executor,
        SessionSpec {
            labels: vec![("tandem.task".to_owned(), task.to_owned())],
            ..Default::default()
        },
    )
    .await
    .unwrap()
}

/// A session whose workspace is the kept directory `dir`.
async fn open_in(
    executor: &DockerExecutor,
    dir: &std::path::Path,
) -> Box<dyn tandem_executor::Session> {
    tandem_executor::Executor::open(
        executor,
        SessionSpec {
            workdir: Some(dir.to_owned()),
            ..Default::default()
        },
    )
    .await
    .unwrap()
}

#[tokio::test(flavor = "multi_thread")]
async fn docker_executor_passes_the_conformance_suite() {
    conformance::all(docker().await, &[]).await;
}

/// An executor whose sessions' workspaces are volumes, without a warm pool.
async fn docker_with_volumes() -> Arc<DockerExecutor> {
    docker_with(DockerConfig {
        pool_size: 0,
        workspace: WorkspaceMode::Volume,
        ..DockerConfig::default()
    })
    .await
}

/// The same suite with each session's workspace in a volume of its own, copied in and out
/// as tar through the engine's API: what a remote engine gets.
#[tokio::test(flavor = "multi_thread")]
async fn docker_executor_with_volume_workspaces_passes_the_conformance_suite() {
    let docker = docker_with_volumes().await;
    conformance::all(docker, &[]).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn session_containers_are_hardened_by_default() {
    let executor = docker().await;
    let task = format!("hardening-{}", std::process::id());
    let mut s = open_for_task(&executor, &task).await;
    let ws = s.workspace().unwrap().to_owned();
    // The workspace is world-writable for the blocks' user, so its parent keeps other host
    // users out.
    {
        use std::os::unix::fs::{MetadataExt, PermissionsExt};
        let parent = std::fs::metadata(ws.parent().unwrap()).unwrap();
        assert_eq!(parent.permissions().mode() & 0o777, 0o700);
        assert_eq!(parent.uid(), std::fs::metadata("/proc/self").unwrap().uid());
    }
    let ids = containers_labelled(&format!("tandem.task={task}"));
    assert_eq!(ids.len(), 1, "{ids:?}");
    let inspect: Value = serde_json::from_str(&docker_cli(&["inspect", &ids[0]])).unwrap();
    let c = &inspect[0];
    let host = &c["HostConfig"];
    assert_eq!(host["NetworkMode"], "none");
    assert_eq!(host["CapDrop"], serde_json::json!(["ALL"]));
    assert_eq!(
        host["SecurityOpt"],
        serde_json::json!(["no-new-privileges"])
    );
    assert_eq!(host["ReadonlyRootfs"], true);
    assert_eq!(
        host["Tmpfs"],
        serde_json::json!({
            "/tmp": "rw,nosuid,nodev,size=67108864,mode=1777",
            "/run/tandem": "rw,exec,nosuid,nodev,size=1m,mode=0755",
        })
    );
    // The runner is root with three capabilities; blocks run as 65534 with none (below).
    assert_eq!(c["Config"]["User"], "0:0");
    assert_eq!(
        host["CapAdd"],
        serde_json::json!(["SETUID", "SETGID", "KILL"])
    );
    assert_eq!(host["PidsLimit"], 256);
    assert_eq!(host["Memory"], 512 << 20);
    assert_eq!(host["MemorySwap"], 512 << 20);
    assert_eq!(host["NanoCpus"], 1_000_000_000);
    assert_eq!(host["Init"], true);
    assert_eq!(host["Privileged"], false);
    // The workspace is the only host path inside; no docker socket.
    assert_eq!(
        host["Binds"],
        serde_json::json!([format!("{}:/workspace:rw", ws.display())])
    );
    let mounts: Vec<&str> = c["Mounts"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m["Source"].as_str().unwrap())
        .collect();
    assert_eq!(mounts, [ws.to_str().unwrap()]);
    let mut env: Vec<&str> = c["Config"]["Env"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_str().unwrap())
        .collect();
    env.sort();
    assert_eq!(
        env,
        [
            "HOME=/workspace",
            "LANG=C.UTF-8",
            "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
            "TMPDIR=/tmp",
            "XDG_CACHE_HOME=/tmp/.cache"
        ]
    );
    let labels = c["Config"]["Labels"].as_object().unwrap();
    assert_eq!(labels["tandem.task"], task.as_str());
    assert!(
        labels["tandem.daemon"]
            .as_str()
            .unwrap()
            .starts_with("tandem-")
    );
    assert_eq!(labels["tandem.session"].as_str().unwrap().len(), 32);
    assert!(
        labels["tandem.owner"]
            .as_str()
            .unwrap()
            .contains(&format!("/{}:", std::process::id()))
    );
    // What the code sees agrees with the configuration.
    let out = run(&mut *s, "sh", "id -u; cat /proc/self/status | grep -c CapEff:.0000000000000000; grep NoNewPrivs /proc/self/status").await;
    assert_eq!(out.stdout.to_text(), "65534\n1\nNoNewPrivs:\t1\n");
    s.close().await.unwrap();
    assert_eq!(
        containers_labelled(&format!("tandem.task={task}")),
        Vec::<String>::new()
    );
    assert!(!ws.exists(), "the temporary workspace outlived the session");
}

/// The host's own address on the default bridge (docker0), which a container with a network
/// could reach: the configured gateway, else the subnet's first address, as Docker assigns it.
fn bridge_gateway() -> String {
    let config: Value = serde_json::from_str(&docker_cli(&[
        "network",
        "inspect",
        "bridge",
        "--format",
        "{{json .IPAM.Config}}",
    ]))
    .unwrap();
    if let Some(gw) = config[0]["Gateway"].as_str().filter(|g| !g.is_empty()) {
        return gw.to_owned();
    }
    let subnet = config[0]["Subnet"]
        .as_str()
        .expect("the bridge network's subnet");
    let base: std::net::Ipv4Addr = subnet.split('/').next().unwrap().parse().unwrap();
    std::net::Ipv4Addr::from(u32::from(base) + 1).to_string()
}

#[tokio::test(flavor = "multi_thread")]
async fn hostile_blocks_leave_the_session_usable() {
    let executor = docker().await;
    let mut s = conformance::open(
        &*executor,
        Limits {
            // Generous: on a loaded machine the 4 GiB allocation is starved of CPU long
            // before the memory limit stops it, and the outcome is what is checked.
            wall: Duration::from_secs(30),
            file_size_bytes: Some(100 << 20),
            ..Limits::default()
        },
    )
    .await;
    let listener = std::net::TcpListener::bind("0.0.0.0:0").unwrap();
    listener.set_nonblocking(true).unwrap();
    let port = listener.local_addr().unwrap().port();
    let gateway = bridge_gateway();
    let connect = format!(
        "import socket\nfor host, port in (('{gateway}', 2375), ('{gateway}', {port}), ('127.0.0.1', {port})):\n    try:\n        socket.create_connection((host, port), timeout=2)\n        print('connected', host, port)\n    except OSError as e:\n        print('blocked', host, port, type(e).__name__)"
    );
    let cases: Vec<(&str, &str, String)> = vec![
        ("fork bomb", "sh", "b() { b | b & }; b".to_owned()),
        ("4 GiB allocation", "python", "b = bytearray(4 << 30)\nprint(len(b))".to_owned()),
        ("fill /tmp", "sh", "dd if=/dev/zero of=/tmp/fill bs=1M count=500 2>&1 | grep -o 'No space left on device'".to_owned()),
        ("fill /workspace", "sh", "dd if=/dev/zero of=/workspace/fill bs=1M count=500; ls -l fill | cut -d' ' -f5; rm -f fill".to_owned()),
        ("100 MB of stdout", "sh", "head -c 100000000 /dev/zero | tr '\\0' x".to_owned()),
        ("kill -9 -1", "sh", "kill -9 -1".to_owned()),
        ("read init's environment", "sh", "tr '\\0' '\\n' < /proc/1/environ | cut -d= -f1 | sort | tr '\\n' ' '".to_owned()),
        ("connect out", "python", connect),
        ("write outside /workspace", "sh", "for f in /etc/x /usr/x /x /root/x; do touch $f 2>/dev/null && echo wrote $f; done; echo checked".to_owned()),
    ];
    for (name, lang, code) in &cases {
        let out = run(&mut *s, lang, code).await;
        let text = out.stdout.to_text();
        match *name {
            "fork bomb" => {
                // Nothing of it is left: the container holds only init, the runner and
                // this check's own processes (it filled all 256 pids before kill(-1)).
                let ps = run(&mut *s, "sh", "ls -d /proc/[0-9]* | wc -l").await;
                let count: u32 = ps.stdout.to_text().trim().parse().unwrap_or_else(|e| {
                    panic!("{name}: the next block printed no count ({e}): {ps:?}")
                });
                assert!(count <= 6, "{name}: {count} processes left");
            }
            "4 GiB allocation" => {
                assert_eq!(out.status, ExitStatus::OutOfMemory, "{name}: {out:?}")
            }
            "fill /tmp" => assert!(text.contains("No space left on device"), "{name}: {text}"),
            "fill /workspace" => assert_eq!(
                (out.status, text.lines().last()),
                (ExitStatus::Exited(0), Some("104857600")),
                "{name}: {out:?}"
            ),
            "100 MB of stdout" => assert_eq!(
                (out.status, out.stdout.total(), out.stdout.truncated()),
                (ExitStatus::Exited(0), 100_000_000, true),
                "{name}"
            ),
            // Init and the runner are another user's processes: nothing of theirs is readable.
            "read init's environment" => assert_eq!(text, "", "{name}"),
            "connect out" => assert_eq!(
                text,
                format!(
                    "blocked {gateway} 2375 OSError\nblocked {gateway} {port} OSError\nblocked 127.0.0.1 {port} ConnectionRefusedError\n"
                ),
                "{name}"
            ),
            "write outside /workspace" => assert_eq!(text, "checked\n", "{name}"),
            _ => {}
        }
        let after = run(&mut *s, "python", "print('still fine')").await;
        assert_eq!(
            (after.status, after.stdout.to_text()),
            (ExitStatus::Exited(0), "still fine\n".to_owned()),
            "the session broke after: {name}"
        );
    }
    assert!(
        listener.accept().is_err(),
        "a block reached the test's listener"
    );
    s.close().await.unwrap();
}

#[tokio::test(flavor = "multi_thread")]
async fn a_missing_image_names_the_offline_way_to_make_one() {
    let executor = DockerExecutor::connect(DockerConfig {
        image: "tandem-no-such-image:1".to_owned(),
        pull: true,
        ..DockerConfig::default()
    })
    .await
    .unwrap();
    let err = executor
        .ensure_image(&|_| {})
        .await
        .unwrap_err()
        .to_string();
    assert!(
        err.starts_with(
            "docker image `tandem-no-such-image:1` is not present and pulling it failed: "
        ) && err.contains("scripts/build-sandbox-image.sh"),
        "{err}"
    );
}

/// Ids of the containers whose `tandem.session` label is set, with their names.
fn session_containers() -> Vec<(String, String)> {
    docker_cli(&[
        "ps",
        "-a",
        "--filter",
        "label=tandem.session",
        "--no-trunc",
        "--format",
        "{{.ID}} {{.Names}}",
    ])
    .lines()
    .filter_map(|l| l.split_once(' '))
    .map(|(id, name)| (id.to_owned(), name.to_owned()))
    .collect()
}

async fn wait_for_pool(executor: &DockerExecutor, n: usize) {
    let started = std::time::Instant::now();
    while executor.pooled().len() < n {
        assert!(
            started.elapsed() < Duration::from_secs(60),
            "the pool did not fill"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// An executor whose warm pool (`config`'s) has filled to `pool_size`.
async fn warm_pool(config: DockerConfig) -> Arc<DockerExecutor> {
    let size = config.pool_size;
    let executor = docker_with(config).await;
    executor.warm_up();
    wait_for_pool(&executor, size).await;
    executor
}

#[tokio::test(flavor = "multi_thread")]
async fn a_burst_larger_than_the_pool_waits_in_line_grows_it_and_it_shrinks_when_idle() {
    use tandem_executor::Executor;
    let executor = warm_pool(DockerConfig {
        pool_size: 1,
        pool_max: 4,
        pool_idle_secs: 3,
        ..DockerConfig::default()
    })
    .await;
    // Six at once against a pool of one: each is served by the pool, the first at once and
    // the rest in line, none starting a container of its own; each says how long it waited.
    let opens = (0..6).map(|_| executor.open(SessionSpec::default()));
    let mut sessions: Vec<_> = futures::future::join_all(opens)
        .await
        .into_iter()
        .map(|s| s.unwrap())
        .collect();
    let waits: Vec<Duration> = sessions.iter().map(|s| s.pool_wait().unwrap()).collect();
    assert_eq!(waits.iter().filter(|w| w.is_zero()).count(), 1, "{waits:?}");
    let status = executor.pool_status();
    assert_eq!((status.hits, status.misses), (1, 5), "{status:?}");
    assert!(status.waited_ms > 0, "{status:?}");
    for s in &mut sessions {
        assert_eq!(
            run(&mut **s, "python", "print(1)").await.stdout.to_text(),
            "1\n"
        );
    }
    // Grown by the demand, ahead of the next burst, and no further than pool_max.
    wait_for_pool(&executor, 4).await;
    assert!(executor.pool_status().target <= 4);
    for s in sessions {
        s.close().await.unwrap();
    }
    // Idle: back to pool_size.
    let started = std::time::Instant::now();
    while executor.pooled().len() > 1 {
        assert!(
            started.elapsed() < Duration::from_secs(60),
            "the pool did not shrink: {:?}",
            executor.pool_status()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let status = executor.pool_status();
    assert_eq!((status.target, status.ready), (1, 1), "{status:?}");
    assert_eq!(executor.pools(), vec![status]);
    executor.shutdown().await;
}

/// Sessions that stop waiting for the pool leave the containers started for them; the pool
/// keeps no more of them than `pool_max`, at once, not when it next shrinks.
#[tokio::test(flavor = "multi_thread")]
async fn containers_started_for_sessions_that_stopped_waiting_are_kept_only_up_to_pool_max() {
    use tandem_executor::Executor;
    let executor = warm_pool(DockerConfig {
        pool_size: 1,
        pool_max: 1,
        pool_idle_secs: 600,
        ..DockerConfig::default()
    })
    .await;
    let first = executor.open(SessionSpec::default()).await.unwrap();
    let waiting: Vec<_> = (0..4)
        .map(|_| {
            let executor = executor.clone();
            tokio::spawn(async move { executor.open(SessionSpec::default()).await })
        })
        .collect();
    let started = std::time::Instant::now();
    while executor.pool_status().waiting < 4 {
        assert!(
            started.elapsed() < Duration::from_secs(60),
            "{:?}",
            executor.pool_status()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    for open in &waiting {
        open.abort();
    }
    // Every container started for them has come and been handed on or removed.
    let started = std::time::Instant::now();
    loop {
        let status = executor.pool_status();
        if status.starting == 0 && executor.pooled().len() == 1 && status.ready == 1 {
            break;
        }
        assert!(
            started.elapsed() < Duration::from_secs(120) && executor.pooled().len() <= 1,
            "the pool holds more than pool_max: {status:?} {:?}",
            executor.pooled()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // Settled: nothing more arrives to be kept.
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert_eq!(executor.pooled().len(), 1, "{:?}", executor.pool_status());
    first.close().await.unwrap();
    executor.shutdown().await;
}

/// A session closed while others wait in line for the pool: its processes die at close, and
/// its container, whose removal would slow their starts, is removed once they are served.
#[tokio::test(flavor = "multi_thread")]
async fn a_sandbox_closed_while_others_wait_for_the_pool_is_removed_once_they_are_served() {
    let executor = warm_pool(DockerConfig {
        pool_size: 1,
        pool_max: 1,
        pool_idle_secs: 60,
        ..DockerConfig::default()
    })
    .await;
    let task = format!("closing-{}", std::process::id());
    let mut first = open_for_task(&executor, &task).await;
    let (id, _) = session_containers()
        .into_iter()
        .find(|(_, name)| name.starts_with(&format!("tandem-{task}-")))
        .expect("a container named after the task");
    let out = run(
        &mut *first,
        "python",
        "import subprocess; subprocess.Popen(['sleep', '600'], start_new_session=True); print('left')",
    )
    .await;
    assert_eq!(out.stdout.to_text(), "left\n");
    // Six opens against an empty pool of one wait for containers started four at a time:
    // two rounds of starts, while the close below is one request to the runner.
    let later = format!("{task}-served");
    let waiting: Vec<_> = (0..6)
        .map(|_| {
            let (executor, later) = (Arc::clone(&executor), later.clone());
            tokio::spawn(async move { open_for_task(&executor, &later).await })
        })
        .collect();
    let started = std::time::Instant::now();
    while executor.pool_status().waiting == 0 {
        assert!(
            started.elapsed() < Duration::from_secs(60),
            "no open waited"
        );
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    first.close().await.unwrap();
    let status = executor.pool_status();
    assert_eq!(status.closing, 1, "{status:?}");
    // Still there, and nothing of the user's runs in it.
    assert!(session_containers().iter().any(|(c, _)| *c == id));
    let top = docker_cli(&["top", &id, "-eo", "pid,user,args"]);
    assert!(!top.contains("sleep 600"), "{top}");
    let mut served = Vec::new();
    for open in waiting {
        served.push(open.await.unwrap());
    }
    let started = std::time::Instant::now();
    while executor.pool_status().closing > 0 || session_containers().iter().any(|(c, _)| *c == id) {
        assert!(
            started.elapsed() < Duration::from_secs(60),
            "the closed container was not removed: {:?}",
            executor.pool_status()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    for s in &mut served {
        assert_eq!(
            run(&mut **s, "python", "print(1)").await.stdout.to_text(),
            "1\n"
        );
    }
    // Closed with no one waiting: removed before close returns. (Other tests' containers
    // run beside these; the task's name tells these apart.)
    for s in served {
        s.close().await.unwrap();
    }
    assert_eq!(executor.pool_status().closing, 0);
    let left: Vec<(String, String)> = session_containers()
        .into_iter()
        .filter(|(_, name)| name.starts_with(&format!("tandem-{later}-")))
        .collect();
    assert_eq!(left, Vec::new());
    executor.shutdown().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn warm_pool_serves_sessions_and_never_reuses_a_container() {
    let executor = warm_pool(DockerConfig {
        pool_size: 2,
        ..DockerConfig::default()
    })
    .await;
    let before = executor.pooled();
    let task = format!("pool-{}", std::process::id());
    let mut s = open_for_task(&executor, &task).await;
    // The session got a container that was already running, now named after its task.
    let (id, name) = session_containers()
        .into_iter()
        .find(|(_, name)| name.starts_with(&format!("tandem-{task}-")))
        .expect("a container named after the task");
    assert!(before.contains(&id), "{name} was not taken from the pool");
    let out = run(
        &mut *s,
        "python",
        "open('f', 'w').write('x'); print('pooled')",
    )
    .await;
    assert_eq!(out.stdout.to_text(), "pooled\n");
    s.close().await.unwrap();
    // Used once, then gone; the pool refills with new containers.
    wait_for_pool(&executor, 2).await;
    let now: Vec<String> = session_containers().into_iter().map(|(id, _)| id).collect();
    assert!(!now.contains(&id), "a used container was kept");
    // A session the pool cannot serve (a kept workdir) still opens, cold.
    let dir = tempfile::tempdir().unwrap();
    let mut s = open_in(&executor, dir.path()).await;
    let out = run(&mut *s, "sh", "echo kept > k.txt; cat k.txt").await;
    assert_eq!(out.stdout.to_text(), "kept\n");
    s.close().await.unwrap();
    assert_eq!(
        std::fs::read_to_string(dir.path().join("k.txt")).unwrap(),
        "kept\n"
    );
    wait_for_pool(&executor, 2).await;
    let pooled = executor.pooled();
    executor.shutdown().await;
    let left: Vec<String> = session_containers()
        .into_iter()
        .map(|(id, _)| id)
        .filter(|id| pooled.contains(id))
        .collect();
    assert_eq!(
        left,
        Vec::<String>::new(),
        "shutdown left pooled containers"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn a_kept_workdir_keeps_the_hosts_files_and_gets_its_mode_back() {
    use std::os::unix::fs::PermissionsExt;
    let executor = docker().await;
    let dir = tempfile::tempdir().unwrap();
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    let kept = dir.path().join("keep.txt");
    std::fs::write(&kept, "the host's\n").unwrap();
    std::fs::set_permissions(&kept, std::fs::Permissions::from_mode(0o644)).unwrap();
    let mut s = open_in(&executor, dir.path()).await;
    // The block is another user: it cannot write the host's file, so it tries to replace it
    // by renaming its own over it, and to remove it.
    let out = run(
        &mut *s,
        "sh",
        "echo planted > p; mv -f p keep.txt; rm -f keep.txt; ls",
    )
    .await;
    s.close().await.unwrap();
    assert_eq!(
        std::fs::read_to_string(&kept).unwrap(),
        "the host's\n",
        "the block replaced the host's file: {}",
        out.stderr.to_text()
    );
    // Its own files it still makes, and the directory has its mode back.
    assert_eq!(
        std::fs::read_to_string(dir.path().join("p")).unwrap(),
        "planted\n"
    );
    let mode = std::fs::metadata(dir.path()).unwrap().permissions().mode() & 0o7777;
    assert_eq!(mode, 0o755, "the workdir was left {mode:o}");
}

/// The names of the volumes labelled `label`.
fn volumes_labelled(label: &str) -> Vec<String> {
    docker_cli(&["volume", "ls", "-q", "--filter", &format!("label={label}")])
        .lines()
        .map(str::to_owned)
        .collect()
}

/// The regular files under `dir`, relative, sorted.
fn files_under(dir: &std::path::Path) -> Vec<String> {
    let mut found: Vec<String> = tandem_executor_kit::archive::list(dir, 10_000)
        .unwrap()
        .into_iter()
        .map(|f| f.path.display().to_string())
        .collect();
    found.sort();
    found
}

#[tokio::test(flavor = "multi_thread")]
async fn a_volume_workspace_is_seeded_from_the_host_and_its_mirror_follows_every_block() {
    let docker = docker_with_volumes().await;
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("seed.txt"), "from the host").unwrap();
    let task = format!("volume-{}", std::process::id());
    let mut s = tandem_executor::Executor::open(
        &*docker,
        SessionSpec {
            workdir: Some(dir.path().to_owned()),
            labels: vec![("tandem.task".to_owned(), task.clone())],
            ..Default::default()
        },
    )
    .await
    .unwrap();
    let label = format!("tandem.task={task}");
    let [container] = containers_labelled(&label).try_into().unwrap();
    let mounts: Value = serde_json::from_str(&docker_cli(&[
        "inspect",
        "-f",
        "{{json .Mounts}}",
        &container,
    ]))
    .unwrap();
    assert_eq!(mounts[0]["Type"], "volume", "{mounts}");
    assert_eq!(
        mounts.as_array().map(Vec::len),
        Some(1),
        "no bind mount: {mounts}"
    );
    assert_eq!(volumes_labelled(&label).len(), 1);

    // Seeded, and the blocks' user owns what was put there.
    let out = run(
        &mut *s,
        "python",
        "print(open('seed.txt').read())\nopen('seed.txt', 'a').write(' and back')",
    )
    .await;
    assert_eq!(
        out.stdout.to_text(),
        "from the host\n",
        "{}",
        out.stderr.to_text()
    );
    assert_eq!(
        std::fs::read_to_string(dir.path().join("seed.txt")).unwrap(),
        "from the host and back"
    );

    // Small changes come inline from the runner; a private directory, a link to the host's
    // /etc and a FIFO are there too.
    let out = run(
        &mut *s,
        "sh",
        "mkdir -p a/b private && echo one > a/b/one.txt && echo gone > gone.txt && echo s > private/secret.txt && chmod 700 private && ln -s /etc etc-link && mkfifo pipe",
    )
    .await;
    assert_eq!(
        out.status,
        ExitStatus::Exited(0),
        "{}",
        out.stderr.to_text()
    );
    assert_eq!(
        files_under(dir.path()),
        ["a/b/one.txt", "gone.txt", "private/secret.txt", "seed.txt"]
    );
    assert_eq!(
        std::fs::read_to_string(dir.path().join("a/b/one.txt")).unwrap(),
        "one\n"
    );
    assert!(std::fs::symlink_metadata(dir.path().join("etc-link")).is_err());

    // A file too large to come inline is copied through the engine's archive call.
    let out = run(
        &mut *s,
        "python",
        "open('large.bin', 'wb').write(bytes(range(256)) * 1200)",
    )
    .await;
    assert_eq!(
        out.status,
        ExitStatus::Exited(0),
        "{}",
        out.stderr.to_text()
    );
    assert_eq!(
        std::fs::read(dir.path().join("large.bin")).unwrap(),
        (0..=255u8).cycle().take(256 * 1200).collect::<Vec<u8>>()
    );

    // Too many changes come out as one archive of the whole workspace; a removal, a rename
    // and a directory that became a file are followed.
    let out = run(
        &mut *s,
        "sh",
        "rm gone.txt && mv a/b/one.txt a/uno.txt && rm -r a/b && echo file > a/b && for i in $(seq 1 70); do echo $i > many-$i.txt; done",
    )
    .await;
    assert_eq!(
        out.status,
        ExitStatus::Exited(0),
        "{}",
        out.stderr.to_text()
    );
    let files = files_under(dir.path());
    assert!(files.contains(&"a/uno.txt".to_owned()), "{files:?}");
    assert!(files.contains(&"a/b".to_owned()), "{files:?}");
    assert!(!files.contains(&"gone.txt".to_owned()), "{files:?}");
    assert_eq!(files.iter().filter(|f| f.starts_with("many-")).count(), 70);
    assert_eq!(
        std::fs::read_to_string(dir.path().join("many-7.txt")).unwrap(),
        "7\n"
    );

    // A file put in while the session runs reaches the sandbox.
    let archive = dir.path().join("../put.tar");
    {
        let mut b = tar::Builder::new(std::fs::File::create(&archive).unwrap());
        let mut h = tar::Header::new_gnu();
        h.set_size(3);
        h.set_mode(0o600);
        h.set_uid(0);
        b.append_data(&mut h, "later.txt", &b"new"[..]).unwrap();
        let mut h = tar::Header::new_gnu();
        h.set_size(2);
        h.set_mode(0o600);
        h.set_uid(0);
        b.append_data(&mut h, "fresh/dir/in.txt", &b"in"[..])
            .unwrap();
        b.finish().unwrap();
    }
    s.put_archive(&archive, Default::default()).await.unwrap();
    let _ = std::fs::remove_file(&archive);
    let out = run(
        &mut *s,
        "python",
        "print(open('later.txt').read())\nopen('later.txt', 'w').write('mine')\nopen('fresh/dir/mine.txt', 'w').write(open('fresh/dir/in.txt').read())",
    )
    .await;
    assert_eq!(out.stdout.to_text(), "new\n", "{}", out.stderr.to_text());
    // The directories the new files came in are the blocks' user's too.
    assert_eq!(
        std::fs::read_to_string(dir.path().join("fresh/dir/mine.txt")).unwrap(),
        "in",
        "{}",
        out.stderr.to_text()
    );

    s.close().await.unwrap();
    assert!(containers_labelled(&label).is_empty());
    assert!(
        volumes_labelled(&label).is_empty(),
        "the volume goes with the session"
    );
    assert_eq!(
        std::fs::read_to_string(dir.path().join("later.txt")).unwrap(),
        "mine"
    );
}
