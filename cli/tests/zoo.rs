//! The hostile-tree kit: one fixture plants the whole zoo (a tree 100,000 deep, 100,000
//! entries in one directory, links to `/` and to a host file, FIFOs, sparse files, names with
//! terminal escapes and newlines, a mode-000 directory) where a block can write, and each road
//! that touches a workspace is run over it. After each: the daemon answers, the host file is
//! untouched, and the tree is gone where Tandem removes it. A new road gets the same kit.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use serde_json::json;
use tandem_protocol::StopReason;
use tandem_tests::{DaemonHarness as Daemon, Reply, ScriptedOpenAi, script};

const BIN: &str = env!("CARGO_BIN_EXE_tandem");

/// The zoo, as a Python block: planted in the working directory and in `$TMPDIR`, sized by
/// `DEPTH` and `WIDTH`; `HOST` is a file outside every sandbox the links point at. It prints
/// `TMPDIR=<path>` so the test can look there after the session closed.
const ZOO: &str = r#"
import os, stat
DEPTH, WIDTH, HOST, TMP_TOO = {depth}, {width}, {host!r}, {tmp_too}

def plant(base):
    top = os.open(base, os.O_RDONLY | os.O_DIRECTORY)
    # Chains of 1000 made side by side, then each moved into the bottom of the one before:
    # Landlock checks every step of a path, so a chain made in place would cost depth squared.
    os.mkdir("deep", dir_fd=top)
    deep = os.open("deep", os.O_RDONLY | os.O_DIRECTORY, dir_fd=top)
    chains, bottoms = DEPTH // 1000, []
    for c in range(chains):
        os.mkdir("c%d" % c, dir_fd=deep)
        d = os.open("c%d" % c, os.O_RDONLY | os.O_DIRECTORY, dir_fd=deep)
        for _ in range(999):
            os.mkdir("d", dir_fd=d)
            n = os.open("d", os.O_RDONLY | os.O_DIRECTORY, dir_fd=d)
            os.close(d)
            d = n
        bottoms.append(d)
    for c in range(chains - 1, 0, -1):
        os.rename("c%d" % c, "d", src_dir_fd=deep, dst_dir_fd=bottoms[c - 1])
    for d in bottoms:
        os.close(d)
    os.close(deep)
    os.mkdir("wide", dir_fd=top)
    w = os.open("wide", os.O_RDONLY | os.O_DIRECTORY, dir_fd=top)
    for i in range(WIDTH):
        os.close(os.open(str(i), os.O_WRONLY | os.O_CREAT, 0o644, dir_fd=w))
    os.close(w)
    os.symlink("/", "root-link", dir_fd=top)
    os.symlink(HOST, "host-link", dir_fd=top)
    os.mkdir("linkdir-parent", dir_fd=top)
    os.symlink(os.path.dirname(HOST), os.path.join(base, "linkdir-parent", "inner"))
    os.mkfifo("fifo", dir_fd=top)
    for i in range(11):
        with open(os.path.join(base, "sparse-%d" % i), "wb") as f:
            f.truncate((1 << 30) - 4096)
    with open(os.path.join(base, "esc\x1b]0;pwned\x07\x1b[2J\n   9 B  forged.txt"), "w") as f:
        f.write("x")
    os.mkdir("locked", dir_fd=top)
    with open(os.path.join(base, "locked", "f"), "w") as f:
        f.write("x")
    os.chmod(os.path.join(base, "locked"), 0)
    os.close(top)

plant(os.getcwd())
tmp = os.environ.get("TMPDIR", "/tmp")
if TMP_TOO:
    os.mkdir(os.path.join(tmp, "zoo"))
    plant(os.path.join(tmp, "zoo"))
print("TMPDIR=" + tmp)
"#;

/// The zoo's entries that are not regular files, and the kind a read of each is refused as.
const NOT_FILES: [(&str, &str); 5] = [
    ("fifo", "special entry"),
    ("host-link", "symbolic link"),
    ("root-link/etc/passwd", "symbolic link"),
    ("linkdir-parent/inner/host-secret", "symbolic link"),
    ("locked", "directory"),
];

fn zoo(depth: usize, width: usize, host: &Path, tmp_too: bool) -> Reply {
    let code = ZOO
        .replace("{tmp_too}", if tmp_too { "True" } else { "False" })
        .replace("{depth}", &depth.to_string())
        .replace("{width}", &width.to_string())
        .replace("{host!r}", &format!("{:?}", host.display().to_string()));
    Reply::from(format!("```python\n{code}\n```").as_str())
}

/// A file outside every sandbox, root-owned and private as the one the attack overwrote.
fn host_file(dir: &Path) -> PathBuf {
    use std::os::unix::fs::PermissionsExt;
    let file = dir.join("host-secret");
    std::fs::write(&file, b"the host's own").unwrap();
    std::fs::set_permissions(&file, std::fs::Permissions::from_mode(0o600)).unwrap();
    file
}

fn host_untouched(file: &Path) {
    use std::os::unix::fs::PermissionsExt;
    assert_eq!(std::fs::read(file).unwrap(), b"the host's own");
    let mode = std::fs::metadata(file).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode, 0o600);
    let siblings: Vec<_> = std::fs::read_dir(file.parent().unwrap())
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert_eq!(
        siblings,
        [file.file_name().unwrap()],
        "nothing was made beside it"
    );
}

async fn answers(d: &Daemon) {
    let listed = tokio::time::timeout(Duration::from_secs(30), d.try_get("/v1/tasks")).await;
    assert!(
        matches!(listed, Ok(Ok(_))),
        "the daemon no longer answers: {listed:?}\n{}",
        d.log()
    );
}

async fn status_of(d: &Daemon, path: &str) -> (u16, Vec<u8>) {
    let resp = tokio::time::timeout(
        Duration::from_secs(30),
        d.http().get(format!("http://tandem{path}")).send(),
    )
    .await
    .expect("the request hung")
    .unwrap();
    let status = resp.status().as_u16();
    let body = tokio::time::timeout(Duration::from_secs(60), resp.bytes())
        .await
        .expect("the body hung")
        .unwrap();
    (status, body.to_vec())
}

/// The whole zoo on the local executor, through every road the daemon walks: the session's
/// close (its `$TMPDIR`), the file list (CLI and API), downloads of each kind of entry, the
/// tar download, and retention (per-task caps, blocks on disk). The tree is 100,000 deep and 100,000 wide.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_zoo_through_every_road_of_a_local_task() {
    let outside = tempfile::tempdir().unwrap();
    let host = host_file(outside.path());
    let server = ScriptedOpenAi::start(script([
        (
            "plant the zoo",
            vec![zoo(100_000, 100_000, &host, true), Reply::from("TERMINATE")],
        ),
        (
            "a small task",
            vec![
                Reply::from("```sh\nhead -c 300000 /dev/urandom > kept.bin\n```"),
                Reply::from("TERMINATE"),
            ],
        ),
        (
            "a task over its own cap",
            vec![
                // Allocated blocks, written at once: over the cap without writing a
                // gigabyte, each file under a block's 1 GiB file size limit.
                Reply::from("```sh\nfallocate -l 600M big.bin && fallocate -l 600M big2.bin && echo placed\n```"),
                Reply::from("TERMINATE"),
            ],
        ),
    ]))
    .await
    .unwrap();
    // Eleven sparse files of 1 GiB claim 11 GiB: over the total cap, were apparent sizes
    // counted; `max_task_mb` bounds a tar download. The zoo's 100,000 directories hold about
    // 400 MB of blocks, under its cap, so retention leaves the zoo while it is read.
    let listen = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        format!("127.0.0.1:{}", l.local_addr().unwrap().port())
    };
    let token = "zoo-mcp-token-0123456789";
    let d = Daemon::start_with_env(
        Path::new(BIN),
        &server.base_url(),
        &["--executor", "local", "--listen", &listen],
        Some("[files]\nmax_total_mb = 4096\nmax_task_mb = 1024\nkeep_secs = 3600\n[limits]\nwall = 600\ncpu_secs = 600\n[executors.local]\nconfine = \"off\"\n"),
        &[("TANDEM_TOKEN", token)],
    )
    .await;
    let small = d.submit(json!({"task": "a small task"})).await;
    let t = d.wait_finished(&small, Duration::from_secs(120)).await;
    assert_eq!(t.record.stop_reason, Some(StopReason::Terminated), "{t:?}");
    let id = d.submit(json!({"task": "plant the zoo"})).await;
    let t = d.wait_finished(&id, Duration::from_secs(600)).await;
    assert_eq!(
        t.record.stop_reason,
        Some(StopReason::Terminated),
        "{t:?}\n{}",
        d.log()
    );
    answers(&d).await;
    host_untouched(&host);

    // Session close: the block's $TMPDIR, zoo and all, is gone.
    let outs = d.block_stdouts(&id).await;
    let tmp = outs
        .iter()
        .find_map(|s| s.lines().find_map(|l| l.strip_prefix("TMPDIR=")))
        .map(PathBuf::from)
        .unwrap_or_else(|| panic!("no TMPDIR line in {outs:?}"));
    assert!(!tmp.exists(), "{} outlived its session", tmp.display());

    // Listing: bounded (the zoo is over the entry cap), answered, and the daemon serves on.
    let (status, body) = status_of(&d, &format!("/v1/tasks/{id}/files")).await;
    assert!(status >= 400, "{status}");
    let text = String::from_utf8_lossy(&body);
    assert!(text.contains("more than"), "{text}");
    let (code, _, stderr) = d.cli(&["files", &id]).await;
    assert!(code != 0 && stderr.contains("more than"), "{code} {stderr}");
    answers(&d).await;

    // Downloads of what is not a regular file are refused at once, whatever it is.
    for (path, kind) in NOT_FILES {
        let href = tandem_daemon::supervisor::file_href(&id, path);
        let (status, body) = status_of(&d, &href).await;
        let text = String::from_utf8_lossy(&body);
        assert!((400..500).contains(&status), "{path}: {status} {text}");
        assert!(text.contains(kind), "{path}: {text}");
    }
    // The same entries as MCP resources: each refused by its kind, none hangs; a regular
    // file of another task reads.
    let refused = NOT_FILES;
    let mut uris: Vec<String> = refused
        .iter()
        .map(|(path, _)| format!("tandem://tasks/{id}/files/{path}"))
        .collect();
    let kept = format!("tandem://tasks/{small}/files/kept.bin");
    uris.push(kept.clone());
    let mut args = vec![
        "read".to_owned(),
        format!("http://{listen}/mcp"),
        token.to_owned(),
    ];
    args.extend(uris.iter().cloned());
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let seen = crate::mcp::drive(&args, &[]).await;
    for ((_, kind), uri) in refused.iter().zip(&uris) {
        let said = seen[uri].as_str().unwrap_or_default();
        assert!(
            said.starts_with("error: ") && said.contains(kind),
            "{uri}: {said}"
        );
    }
    assert!(
        seen[&kept].as_str().is_some_and(|s| s.starts_with("read ")),
        "{seen}"
    );
    answers(&d).await;
    // A sparse file is read as what it is, and the tar download is refused at the task's caps
    // (its bytes, or the zoo's 100,000 entries, whichever the check before packing meets
    // first) instead of writing gigabytes.
    let (status, body) = status_of(&d, &format!("/v1/tasks/{id}/files?format=tar")).await;
    let text = String::from_utf8_lossy(&body[..body.len().min(4096)]);
    assert!(
        (400..500).contains(&status)
            && (text.contains("over the 1073741824 byte limit")
                || text.contains("more than 100000 entries")),
        "{status} {} bytes: {text}",
        body.len()
    );
    answers(&d).await;

    // Retention: the sparse files weigh their blocks, so they push no other task's files out;
    // a task over its own cap loses its files first. Its removal (a sweep follows each task's
    // end) shows a sweep ran after the zoo's files were there.
    let big = d.submit(json!({"task": "a task over its own cap"})).await;
    d.wait_finished(&big, Duration::from_secs(120)).await;
    let outs = d.block_stdouts(&big).await;
    assert!(outs.iter().any(|o| o.contains("placed")), "{outs:?}");
    let started = Instant::now();
    while d.task(&big).await.record.files_removed_ms.is_none() {
        // A sweep measures every workspace, the zoo's 200,000 entries among them: slow on
        // a loaded machine.
        assert!(
            started.elapsed() < Duration::from_secs(600),
            "the task over its cap kept its files\n{}",
            d.log()
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let (status, body) = status_of(
        &d,
        &tandem_daemon::supervisor::file_href(&small, "kept.bin"),
    )
    .await;
    assert_eq!((status, body.len()), (200, 300_000));
    host_untouched(&host);
}

/// Retention removes a finished task's 100,000-deep workspace (and its mode-000 directory)
/// without recursion; the daemon serves on, and the host file is untouched.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retention_removes_a_deep_workspace_and_the_daemon_serves_on() {
    let outside = tempfile::tempdir().unwrap();
    let host = host_file(outside.path());
    let server = ScriptedOpenAi::start(script([(
        "plant the zoo",
        vec![zoo(100_000, 1_000, &host, false), Reply::from("TERMINATE")],
    )]))
    .await
    .unwrap();
    let d = Daemon::start(
        Path::new(BIN),
        &server.base_url(),
        &["--executor", "local"],
        Some("[files]\nkeep_secs = 1\n[limits]\nwall = 600\ncpu_secs = 600\n[executors.local]\nconfine = \"off\"\n"),
    )
    .await;
    let id = d.submit(json!({"task": "plant the zoo"})).await;
    let t = d.wait_finished(&id, Duration::from_secs(600)).await;
    assert_eq!(
        t.record.stop_reason,
        Some(StopReason::Terminated),
        "{t:?}\n{}",
        d.log()
    );
    let started = Instant::now();
    while d.task(&id).await.record.files_removed_ms.is_none() {
        assert!(
            started.elapsed() < Duration::from_secs(300),
            "never removed\n{}",
            d.log()
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    let dir = d.state_dir().join("files/tasks").join(&id);
    assert!(!dir.exists(), "{}", dir.display());
    answers(&d).await;
    host_untouched(&host);
}

/// A block swaps `x.txt` between a regular file and a FIFO as fast as it can while downloads
/// of it run: each answers (the file's bytes or a refusal), none hangs, and the task list
/// still answers after, so no store slot was held.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fifo_swapped_in_during_downloads_hangs_nothing() {
    let server = ScriptedOpenAi::start(script([(
        "swap",
        vec![
            Reply::from(
                "```python\nimport os, time\nend = time.time() + 12\nwhile time.time() < end:\n    with open('x.txt.tmp', 'w') as f:\n        f.write('regular')\n    os.replace('x.txt.tmp', 'x.txt')\n    os.mkfifo('x.fifo')\n    os.replace('x.fifo', 'x.txt')\n```",
            ),
            Reply::from("TERMINATE"),
        ],
    )]))
    .await
    .unwrap();
    let d = Daemon::start(
        Path::new(BIN),
        &server.base_url(),
        &["--executor", "local"],
        None,
    )
    .await;
    let id = d.submit(json!({"task": "swap"})).await;
    let x = d
        .state_dir()
        .join("files/tasks")
        .join(&id)
        .join("work/x.txt");
    let started = Instant::now();
    while std::fs::symlink_metadata(&x).is_err() {
        assert!(started.elapsed() < Duration::from_secs(60), "never swapped");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let href = tandem_daemon::supervisor::file_href(&id, "x.txt");
    let (mut served, mut refused) = (0, 0);
    for _ in 0..200 {
        let (status, body) = status_of(&d, &href).await;
        match status {
            200 => {
                assert_eq!(body, b"regular");
                served += 1;
            }
            s if (400..500).contains(&s) => refused += 1,
            s => panic!("{s}: {}", String::from_utf8_lossy(&body)),
        }
    }
    assert!(refused > 0, "the FIFO was never met ({served} served)");
    answers(&d).await;
    d.wait_finished(&id, Duration::from_secs(120)).await;
    answers(&d).await;
}

/// Docker, kept state: a block makes a tree 100,000 deep inside the kept interpreter's
/// `.tandem/` and kills the interpreter; at the next Python block the daemon makes `.tandem/`
/// afresh, removing that tree without recursion, and the block runs in a fresh interpreter.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_deep_tree_in_a_docker_kept_interpreters_dir_is_removed_when_it_restarts() {
    let plant = "import os\ntop = os.open('.tandem', os.O_RDONLY | os.O_DIRECTORY)\nos.mkdir('deep', dir_fd=top)\nd = os.open('deep', os.O_RDONLY | os.O_DIRECTORY, dir_fd=top)\nfor _ in range(100000):\n    os.mkdir('d', dir_fd=d)\n    n = os.open('d', os.O_RDONLY | os.O_DIRECTORY, dir_fd=d)\n    os.close(d)\n    d = n\nx = 'kept'\nos._exit(9)\n";
    let server = ScriptedOpenAi::start(script([(
        "kept and deep",
        vec![
            Reply::from(format!("```python\n{plant}```").as_str()),
            Reply::from("```python\nprint('alive', globals().get('x', 'fresh'))\n```"),
            Reply::from("TERMINATE"),
        ],
    )]))
    .await
    .unwrap();
    let d = Daemon::start(
        Path::new(BIN),
        &server.base_url(),
        &["--executor", "docker"],
        Some("[limits]\nwall = 300\ncpu_secs = 300\n"),
    )
    .await;
    let id = d
        .submit(json!({"task": "kept and deep", "keep_state": true}))
        .await;
    let t = d.wait_finished(&id, Duration::from_secs(600)).await;
    assert_eq!(
        t.record.stop_reason,
        Some(StopReason::Terminated),
        "{t:?}\n{}",
        d.log()
    );
    let outs = d.block_stdouts(&id).await;
    assert_eq!(outs.len(), 2, "{outs:?}");
    assert_eq!(outs[1].trim(), "alive fresh", "{outs:?}\n{}", d.log());
    answers(&d).await;
}

/// The zoo where a workspace lives in the sandbox and a mirror of it on this machine is kept
/// up to date after each block: its archive (gigabytes of headers and sparse zeros) is
/// refused at the mirror's bound rather than written out, the task goes on, the file list and
/// tar answer from the mirror, the daemon serves on, and the host file is untouched.
async fn the_zoo_through_a_mirrored_road(executor: &str, config: &str) {
    let outside = tempfile::tempdir().unwrap();
    let host = host_file(outside.path());
    let task = format!("plant the zoo in {executor}");
    let server = ScriptedOpenAi::start(script([(
        task.as_str(),
        vec![
            // Its tmp is the container's own, gone with it.
            zoo(100_000, 100_000, &host, false),
            Reply::from("```python\nimport os\nprint('after', len(os.listdir('wide')))\n```"),
            Reply::from("TERMINATE"),
        ],
    )]))
    .await
    .unwrap();
    let d = Daemon::start(
        Path::new(BIN),
        &server.base_url(),
        &["--executor", executor],
        Some(&format!("[limits]\nwall = 600\ncpu_secs = 600\n{config}")),
    )
    .await;
    let id = d.submit(json!({"task": task})).await;
    let t = d.wait_finished(&id, Duration::from_secs(900)).await;
    assert_eq!(
        t.record.stop_reason,
        Some(StopReason::Terminated),
        "{t:?}\n{}",
        d.log()
    );
    let outs = d.block_stdouts(&id).await;
    assert_eq!(
        outs.get(1).map(|s| s.trim()),
        Some("after 100000"),
        "{outs:?}"
    );
    let log = d.log();
    assert!(
        log.contains("out of the sandbox stopped at 2048 MiB"),
        "the mirror took the zoo's archive whole:\n{log}"
    );
    answers(&d).await;
    let (status, _) = status_of(&d, &format!("/v1/tasks/{id}/files")).await;
    assert!(status < 500, "{status}");
    let (status, _) = status_of(&d, &format!("/v1/tasks/{id}/files?format=tar")).await;
    assert!(status < 500, "{status}");
    answers(&d).await;
    host_untouched(&host);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_zoo_through_the_mirror_of_a_docker_volume() {
    the_zoo_through_a_mirrored_road("docker", "[executors.docker]\nworkspace = \"volume\"\n").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_zoo_through_a_kubernetes_pod_and_its_mirror() {
    let cluster = tandem_tests::kubernetes::FakeCluster::deployed().await;
    let config = format!(
        "[executors.kubernetes]\nurl = \"{}\"\nready_timeout_secs = 60\n",
        cluster.url
    );
    the_zoo_through_a_mirrored_road("kubernetes", &config).await;
    cluster.wait_released().await;
    cluster.stop().await;
}

/// The zoo planted in a volume: removing the volume removes it whole, iteratively, following
/// none of its links; the daemon serves on, and the host file is untouched.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn removing_a_volume_a_block_filled_with_the_zoo_removes_it_and_nothing_else() {
    let outside = tempfile::tempdir().unwrap();
    let host = host_file(outside.path());
    let Reply::Text(planting) = zoo(100_000, 1_000, &host, false) else {
        unreachable!("the zoo is a text reply")
    };
    // The same block, run inside the volume.
    let in_volume = planting.replacen("```python\n", "```python\nimport os\nos.chdir('vol')\n", 1);
    let server = ScriptedOpenAi::start(script([(
        "plant the zoo in a volume",
        vec![Reply::Text(in_volume), Reply::from("TERMINATE")],
    )]))
    .await
    .unwrap();
    let d = Daemon::start(
        Path::new(BIN),
        &server.base_url(),
        &["--executor", "local"],
        Some("[limits]\nwall = 600\ncpu_secs = 600\n[executors.local]\nconfine = \"off\"\n"),
    )
    .await;
    let (code, _, err) = d.cli(&["volume", "create", "zoo"]).await;
    assert_eq!(code, 0, "{err}");
    let id = d
        .submit(json!({"task": "plant the zoo in a volume", "volumes": [{"name": "zoo", "path": "vol"}]}))
        .await;
    let t = d.wait_finished(&id, Duration::from_secs(600)).await;
    assert_eq!(
        t.record.stop_reason,
        Some(StopReason::Terminated),
        "{t:?}\n{}",
        d.log()
    );
    let volume = d.state_dir().join("files/volumes/zoo");
    assert!(
        volume.join("deep").exists(),
        "the zoo was not planted in the volume"
    );
    let (code, out, err) = d.cli(&["volume", "rm", "zoo"]).await;
    assert_eq!(
        (code, out.as_str()),
        (0, "zoo removed\n"),
        "{err}\n{}",
        d.log()
    );
    assert!(!volume.exists(), "{}", volume.display());
    answers(&d).await;
    host_untouched(&host);
}
