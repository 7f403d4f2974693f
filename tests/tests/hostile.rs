//! The hostile-input suite at the sandbox boundary: each case is what an attacker's code
//! would try, run against every executor it applies to and judged from the host (the file
//! that should not exist, the process that should be gone, the listener that should have
//! heard nothing). The table it measures is pinned in docs/security.md: a change in what
//! holds fails here until the document says so.

use std::net::TcpListener;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use tandem_executor::{
    CancellationToken, ExecContext, ExecOutcome, ExecRequest, Executor, ExitStatus, Language,
    Limits,
};
use tandem_executor_docker::{DockerConfig, DockerExecutor};
use tandem_executor_local::{Confine, LocalConfig, LocalExecutor};
use tandem_executor_wasm::{WasmConfig, WasmExecutor};
use tandem_tests::conformance::{self, run};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    Local,
    Docker,
    /// Docker on a second engine reached over TLS, with volume workspaces: a remote host.
    DockerTls,
    /// Kubernetes pods from docs/deploy/kubernetes/, through the stand-in API server.
    Kubernetes,
    Wasm,
}

/// What a case found. A boundary that should hold and does not is a panic, not a verdict.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Verdict {
    Contained,
    NotApplicable,
    /// The local executor is no boundary: the attack works (measured) or would harm the host
    /// running the tests (not run).
    Escapes,
    NotRun,
}

impl Verdict {
    fn cell(self) -> &'static str {
        match self {
            Self::Contained => "contained",
            Self::NotApplicable => "n/a",
            Self::Escapes => "**no**",
            Self::NotRun => "**no** (not run)",
        }
    }
}

/// Host-side things the cases plant and look at.
struct Host {
    /// Where planted links point; one subdirectory per executor, each must stay empty.
    outside: tempfile::TempDir,
    /// A file only the host should read.
    secrets: tempfile::TempDir,
    secret: String,
    /// A key planted in the host user's `~/.ssh`, removed when the suite ends.
    ssh_key: std::path::PathBuf,
    /// Where a block would write in the host user's home; must never exist.
    home_file: std::path::PathBuf,
}

impl Host {
    fn new() -> Self {
        let home = std::path::PathBuf::from(std::env::var_os("HOME").unwrap());
        let tag = uuid::Uuid::new_v4().simple().to_string();
        let host = Self {
            outside: tempfile::tempdir().unwrap(),
            secrets: tempfile::tempdir().unwrap(),
            secret: format!("host-secret-{tag}"),
            ssh_key: home.join(".ssh").join(format!("tandem-hostile-{tag}")),
            home_file: home.join(format!("tandem-hostile-{tag}")),
        };
        std::fs::write(host.secrets.path().join("secret.txt"), &host.secret).unwrap();
        std::fs::create_dir_all(home.join(".ssh")).unwrap();
        std::fs::write(&host.ssh_key, &host.secret).unwrap();
        for kind in [
            Kind::Local,
            Kind::Docker,
            Kind::DockerTls,
            Kind::Kubernetes,
            Kind::Wasm,
        ] {
            std::fs::create_dir(host.outside.path().join(format!("{kind:?}"))).unwrap();
        }
        host
    }
}

impl Drop for Host {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.ssh_key);
        let _ = std::fs::remove_file(&self.home_file);
    }
}

const CASES: &[&str] = &[
    "links planted for the next block's script",
    "`..` and absolute `# filename:` paths",
    "read host files (by path, through a planted link) and the parent's /proc",
    "reach the host's network",
    "a process that leaves the block's session and environment",
    "fork bomb",
    "memory bomb",
    "disk fill past `file_size_bytes`",
    "50 MB of output",
    "binary output",
    "endless loop",
    "the largest timeout",
    "forged runner frames",
    "kill the runner (`kill -9 -1`)",
    "read `~/.ssh` and `/etc/shadow`",
    "write to the host user's home",
    "`ptrace` a process outside the block",
];

/// The cases a confined local executor newly holds, which an unconfined one fails.
const CONFINEMENT_CASES: [usize; 5] = [2, 3, 14, 15, 16];

fn short() -> Limits {
    Limits {
        wall: Duration::from_secs(20),
        ..Limits::default()
    }
}

/// Fails when `kind`'s blocks (or Tandem on their behalf) made anything in `dir`.
fn nothing_in(dir: &Path, kind: Kind) {
    let names: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    assert_eq!(names, Vec::<String>::new(), "{kind:?} wrote outside");
}

fn processes_with(marker: &str) -> Vec<String> {
    let ps = std::process::Command::new("ps")
        .args(["-eo", "pid,args"])
        .output()
        .unwrap();
    String::from_utf8_lossy(&ps.stdout)
        .lines()
        .filter(|l| l.contains(marker))
        .map(str::to_owned)
        .collect()
}

fn status_text(out: &ExecOutcome) -> String {
    format!(
        "{:?}\nstdout: {}\nstderr: {}",
        out.status,
        out.stdout.to_text(),
        out.stderr.to_text()
    )
}

async fn case(i: usize, kind: Kind, executor: &dyn Executor, host: &Host) -> Verdict {
    let outside = &host.outside.path().join(format!("{kind:?}"));
    let up = format!(
        "{}{}",
        "../".repeat(40),
        outside.display().to_string().trim_start_matches('/')
    );
    match i {
        0 => {
            let mut s = conformance::open(executor, short()).await;
            let plant = format!(
                "import os\nos.symlink('{up}/planted.py', '.tandem-block-2.py')\nos.symlink('{up}', 'out')\nprint('planted')"
            );
            let out = run(&mut *s, "python", &plant).await;
            assert_eq!(
                out.stdout.to_text(),
                "planted\n",
                "{kind:?}: {}",
                status_text(&out)
            );
            let second = run(&mut *s, "python", "print('second')").await;
            assert_eq!(second.stdout.to_text(), "second\n", "{kind:?}");
            run(&mut *s, "python", "# filename: out/x.py\nprint(3)").await;
            run(&mut *s, "python", "# filename: out/new/y.py\nprint(4)").await;
            nothing_in(outside, kind);
            s.close().await.unwrap();
            Verdict::Contained
        }
        1 => {
            let mut s = conformance::open(executor, short()).await;
            for name in [
                "../escape.py".to_owned(),
                "a/../../escape.py".to_owned(),
                format!("{}/escape.py", outside.display()),
            ] {
                let out = run(&mut *s, "python", &format!("# filename: {name}\nprint(1)")).await;
                assert_eq!(out.status, ExitStatus::Exited(1), "{kind:?} {name}");
                assert!(
                    out.stderr
                        .to_text()
                        .contains("must stay inside the workspace"),
                    "{kind:?} {name}: {}",
                    status_text(&out)
                );
            }
            nothing_in(outside, kind);
            s.close().await.unwrap();
            Verdict::Contained
        }
        2 => {
            let mut s = conformance::open(executor, short()).await;
            // By its path, through a link the block plants, and the parent's environment.
            let secret = host.secrets.path().join("secret.txt");
            let code = format!(
                "import os\nos.symlink('{}{}', 'peek')\nfor p in ('{}', 'peek', '/proc/{}/environ'):\n    try:\n        print(open(p, 'rb').read()[:200])\n    except OSError as e:\n        print('denied', type(e).__name__)\ntry:\n    print('fd', os.readlink('/proc/{}/fd/0'))\nexcept OSError as e:\n    print('denied', type(e).__name__)",
                "../".repeat(40),
                secret.display().to_string().trim_start_matches('/'),
                secret.display(),
                std::process::id(),
                std::process::id()
            );
            let out = run(&mut *s, "python", &code).await;
            let text = out.stdout.to_text();
            s.close().await.unwrap();
            assert!(!text.contains(&host.secret), "{kind:?}: {text}");
            assert!(!text.contains("PATH="), "{kind:?}: {text}");
            assert_eq!(text.matches("denied").count(), 4, "{kind:?}: {text}");
            Verdict::Contained
        }
        3 => {
            let listener = TcpListener::bind("127.0.0.1:0").unwrap();
            listener.set_nonblocking(true).unwrap();
            let port = listener.local_addr().unwrap().port();
            let mut s = conformance::open(executor, short()).await;
            let code = format!(
                "try:\n    import socket\n    socket.create_connection(('127.0.0.1', {port}), timeout=2)\n    print('connected')\nexcept Exception as e:\n    print('blocked', type(e).__name__)"
            );
            let out = run(&mut *s, "python", &code).await;
            s.close().await.unwrap();
            let text = out.stdout.to_text();
            assert!(
                text.starts_with("blocked"),
                "{kind:?}: {}",
                status_text(&out)
            );
            assert!(listener.accept().is_err(), "{kind:?} reached the listener");
            Verdict::Contained
        }
        4 => {
            if kind == Kind::Wasm {
                return Verdict::NotApplicable;
            }
            let marker = format!("97{}{}", std::process::id(), kind as u8);
            let mut s = conformance::open(executor, short()).await;
            let out = run(
                &mut *s,
                "sh",
                &format!("setsid env -i sleep {marker} & sleep 0.3; echo started"),
            )
            .await;
            assert_eq!(out.stdout.to_text(), "started\n", "{kind:?}");
            let left = processes_with(&format!("sleep {marker}"));
            s.close().await.unwrap();
            assert_eq!(left, Vec::<String>::new(), "{kind:?}: outlived its block");
            Verdict::Contained
        }
        5 => match kind {
            Kind::Wasm => Verdict::NotApplicable,
            // No process limit applies to the daemon's user (and none at all to root).
            Kind::Local => Verdict::NotRun,
            Kind::Docker | Kind::DockerTls | Kind::Kubernetes => {
                let mut s = conformance::open(executor, short()).await;
                run(&mut *s, "sh", "b() { b | b & }; b").await;
                let ps = run(&mut *s, "sh", "ls -d /proc/[0-9]* | wc -l").await;
                // The block after a fork bomb must find pids to fork: every killed
                // process reaped, not only killed.
                let count: u32 = ps.stdout.to_text().trim().parse().unwrap_or_else(|e| {
                    panic!(
                        "{kind:?}: the block after a fork bomb printed no count ({e}): {:?}, stderr {:?}",
                        ps.status,
                        ps.stderr.to_text()
                    )
                });
                assert!(count <= 6, "{count} processes left");
                s.close().await.unwrap();
                Verdict::Contained
            }
        },
        6 => {
            let limits = Limits {
                memory_bytes: Some(512 << 20),
                ..short()
            };
            let mut s = conformance::open(executor, limits).await;
            let out = run(&mut *s, "python", "b = bytearray(8 << 30)\nprint(len(b))").await;
            assert_ne!(out.status, ExitStatus::Exited(0), "{kind:?}");
            let after = run(&mut *s, "python", "print('fine')").await;
            assert_eq!(after.stdout.to_text(), "fine\n", "{kind:?}");
            s.close().await.unwrap();
            Verdict::Contained
        }
        7 => {
            let limits = Limits {
                file_size_bytes: Some(8 << 20),
                ..short()
            };
            let mut s = conformance::open(executor, limits).await;
            let ws = s.workspace().unwrap().to_owned();
            run(
                &mut *s,
                "python",
                "with open('fill', 'wb') as f:\n    for _ in range(32):\n        f.write(b'x' * (1 << 20))",
            )
            .await;
            let size = std::fs::metadata(ws.join("fill")).map_or(0, |m| m.len());
            s.close().await.unwrap();
            if kind == Kind::Wasm {
                // WASI file writes go through wasmtime's host calls, which apply no size limit.
                assert_eq!(size, 32 << 20);
                return Verdict::Escapes;
            }
            assert!(size <= 8 << 20, "{kind:?} wrote {size} bytes");
            Verdict::Contained
        }
        8 => {
            let mut s = conformance::open(executor, short()).await;
            let out = run(
                &mut *s,
                "python",
                "import sys\nfor _ in range(50):\n    sys.stdout.write('x' * 1000000)",
            )
            .await;
            assert_eq!(
                (out.stdout.total(), out.stdout.truncated()),
                (50_000_000, true),
                "{kind:?}"
            );
            assert!(out.stdout.to_text().len() < 200_000, "{kind:?}");
            s.close().await.unwrap();
            Verdict::Contained
        }
        9 => {
            let mut s = conformance::open(executor, short()).await;
            let out = run(
                &mut *s,
                "python",
                "import sys\nsys.stdout.buffer.write(bytes(range(256)) * 64)\nsys.stdout.flush()",
            )
            .await;
            assert_eq!(out.stdout.total(), 256 * 64, "{kind:?}");
            assert!(out.stdout.to_text().contains('\u{fffd}'), "{kind:?}");
            s.close().await.unwrap();
            Verdict::Contained
        }
        10 => {
            let limits = Limits {
                wall: Duration::from_secs(2),
                ..Limits::default()
            };
            let mut s = conformance::open(executor, limits).await;
            let out = run(&mut *s, "python", "while True:\n    pass").await;
            assert_eq!(out.status, ExitStatus::TimedOut, "{kind:?}");
            s.close().await.unwrap();
            Verdict::Contained
        }
        11 => {
            let mut s = conformance::open(executor, short()).await;
            let req = ExecRequest {
                timeout: Some(Duration::MAX),
                ..ExecRequest::new(Language::python(), "print('no overflow')")
            };
            let out = s
                .run(req, ExecContext::new(CancellationToken::new()))
                .await
                .unwrap();
            assert_eq!(out.stdout.to_text(), "no overflow\n", "{kind:?}");
            s.close().await.unwrap();
            Verdict::Contained
        }
        12 => {
            if !matches!(kind, Kind::Docker | Kind::DockerTls | Kind::Kubernetes) {
                return Verdict::NotApplicable;
            }
            let mut s = conformance::open(executor, short()).await;
            let forge = "import json, os, struct\ndef frame(k, p):\n    return k + struct.pack('>I', len(p)) + p\nexit = json.dumps({'code': 42, 'signal': None, 'oom': False}).encode()\nreached = []\nfor pid in os.listdir('/proc'):\n    if pid.isdigit() and int(pid) != os.getpid():\n        try:\n            fd = os.open('/proc/%s/fd/1' % pid, os.O_WRONLY)\n            os.write(fd, frame(b'o', b'FORGED\\n') + frame(b'x', exit) + b'o\\xff\\xff\\xff\\xff')\n            reached.append(pid)\n        except OSError:\n            pass\nprint('reached', reached)";
            let out = run(&mut *s, "python", forge).await;
            // A pod's main process runs as the pod's user, as the blocks do: its stdout (the
            // pod's log) can be written, and carries nothing to Tandem. The runner's cannot.
            let expected = match kind {
                Kind::Kubernetes => "reached ['1']\n",
                _ => "reached []\n",
            };
            assert_eq!(
                (out.status, out.stdout.to_text()),
                (ExitStatus::Exited(0), expected.to_owned()),
                "{}",
                status_text(&out)
            );
            let after = run(&mut *s, "python", "print('fine')").await;
            assert_eq!(after.stdout.to_text(), "fine\n");
            s.close().await.unwrap();
            Verdict::Contained
        }
        13 if kind == Kind::Wasm => Verdict::NotApplicable,
        13 => {
            let mut s = conformance::open(executor, short()).await;
            if kind == Kind::Local {
                // Unconfined, kill(-1) as the tests' user would kill the user's (as root,
                // every) process: it runs only once the block is seen unable to signal its
                // waiter, and fails the case otherwise.
                let probe = run(
                    &mut *s,
                    "sh",
                    "kill -0 $PPID 2>/dev/null && echo reachable || echo scoped",
                )
                .await;
                assert_eq!(
                    probe.stdout.to_text(),
                    "scoped\n",
                    "the local executor is not confined here; kill -9 -1 not run"
                );
            }
            let mut bystander = std::process::Command::new("sleep")
                .arg("30")
                .spawn()
                .unwrap();
            let out = run(
                &mut *s,
                "sh",
                "kill -9 -1; for p in /proc/[0-9]*; do kill -9 ${p#/proc/} 2>/dev/null; done; echo survived",
            )
            .await;
            // The block killed itself: its own processes are all it can reach.
            assert_eq!(out.stdout.to_text(), "", "{}", status_text(&out));
            let alive = bystander.try_wait().unwrap().is_none();
            let _ = bystander.kill();
            let _ = bystander.wait();
            assert!(alive, "{kind:?}: a process outside the block was killed");
            let after = run(&mut *s, "python", "print('fine')").await;
            assert_eq!(after.stdout.to_text(), "fine\n");
            s.close().await.unwrap();
            Verdict::Contained
        }
        14 => {
            let shadow = std::fs::read_to_string("/etc/shadow").unwrap_or_default();
            let root_line = shadow.lines().next().unwrap_or("root:").to_owned();
            let mut s = conformance::open(executor, short()).await;
            let code = format!(
                "for p in ('{}', '/etc/shadow'):\n    try:\n        print(open(p).read())\n    except OSError as e:\n        print('denied', type(e).__name__)",
                host.ssh_key.display()
            );
            let out = run(&mut *s, "python", &code).await;
            s.close().await.unwrap();
            let text = out.stdout.to_text();
            assert!(!text.contains(&host.secret), "{kind:?} read ~/.ssh: {text}");
            assert!(
                !text.lines().any(|l| l == root_line),
                "{kind:?} read the host's /etc/shadow: {text}"
            );
            Verdict::Contained
        }
        15 => {
            let mut s = conformance::open(executor, short()).await;
            let code = format!(
                "try:\n    open('{}', 'w').write('x')\n    print('wrote')\nexcept OSError as e:\n    print('denied', type(e).__name__)",
                host.home_file.display()
            );
            let out = run(&mut *s, "python", &code).await;
            s.close().await.unwrap();
            assert!(
                !host.home_file.exists(),
                "{kind:?} wrote to the host's home: {}",
                status_text(&out)
            );
            Verdict::Contained
        }
        16 => {
            if kind == Kind::Wasm {
                return Verdict::NotApplicable;
            }
            // Local: the waiter's parent, the fork server, is outside the block; Docker: the
            // block's parent is the runner.
            let code = "import ctypes, os\nlibc = ctypes.CDLL(None, use_errno=True)\ntarget = os.getppid()\ntry:\n    grand = int(open('/proc/%d/stat' % target).read().rsplit(')', 1)[1].split()[1])\n    if grand > 1:\n        target = grand\nexcept OSError:\n    pass\nr = libc.ptrace(16, target, 0, 0)\nif r == 0:\n    libc.ptrace(17, target, 0, 0)\n    print('attached', target)\nelse:\n    print('refused', os.strerror(ctypes.get_errno()))";
            let mut s = conformance::open(executor, short()).await;
            let out = run(&mut *s, "python", code).await;
            s.close().await.unwrap();
            let text = out.stdout.to_text();
            assert!(
                text.starts_with("refused"),
                "{kind:?}: {}",
                status_text(&out)
            );
            Verdict::Contained
        }
        _ => unreachable!(),
    }
}

async fn executors() -> (
    Vec<(Kind, Arc<dyn Executor>)>,
    tandem_tests::kubernetes::FakeCluster,
) {
    let docker = DockerExecutor::connect(DockerConfig {
        image: std::env::var("TANDEM_DOCKER_IMAGE")
            .unwrap_or_else(|_| "tandem-sandbox:latest".to_owned()),
        pull: false,
        pool_size: 0,
        ..DockerConfig::default()
    })
    .await
    .unwrap_or_else(|e| panic!("the hostile suite needs the Docker engine: {e}"));
    docker.ensure_image(&|_| {}).await.unwrap();
    let second = tandem_tests::second_engine::shared().await;
    let remote = DockerExecutor::connect(second.config("b"))
        .await
        .unwrap_or_else(|e| panic!("the hostile suite needs the second engine: {e}"));
    let wasm = WasmExecutor::new(WasmConfig::from_env(&|k| std::env::var_os(k))).unwrap();
    for (runtime, result) in wasm.warm().await {
        result.unwrap_or_else(|e| panic!("{}: {e}", runtime.file_name()));
    }
    let cluster = tandem_tests::kubernetes::FakeCluster::deployed().await;
    let kubernetes = cluster.executor().await;
    let executors = vec![
        (
            Kind::Local,
            Arc::new(LocalExecutor::new(LocalConfig::default())) as Arc<dyn Executor>,
        ),
        (Kind::Docker, Arc::new(docker)),
        (Kind::DockerTls, Arc::new(remote)),
        (Kind::Kubernetes, Arc::new(kubernetes)),
        (Kind::Wasm, Arc::new(wasm)),
    ];
    (executors, cluster)
}

#[tokio::test(flavor = "multi_thread")]
async fn every_case_against_every_executor_matches_the_security_table() {
    let host = Host::new();
    let _engine = tandem_tests::second_engine::EXCLUSIVE.read().await;
    let (executors, cluster) = executors().await;
    // Executors side by side, cases one after another within each; a case that breaks is
    // reported with every other one, not instead of them.
    let columns = futures::future::join_all(executors.iter().map(|(kind, executor)| {
        let host = &host;
        async move {
            let mut column = Vec::new();
            for (i, name) in CASES.iter().enumerate() {
                let run = std::panic::AssertUnwindSafe(case(i, *kind, executor.as_ref(), host));
                column.push(
                    futures::FutureExt::catch_unwind(run)
                        .await
                        .map_err(|_| format!("{kind:?}: {name}")),
                );
            }
            column
        }
    }))
    .await;
    let broken: Vec<&String> = columns
        .iter()
        .flatten()
        .filter_map(|c| c.as_ref().err())
        .collect();
    assert!(
        broken.is_empty(),
        "boundaries that did not hold: {broken:#?}"
    );
    let columns: Vec<Vec<Verdict>> = columns
        .into_iter()
        .map(|c| c.into_iter().flatten().collect())
        .collect();
    // Every session the cases opened deleted its claim, and with it its pod.
    assert_eq!(
        cluster.objects("sandboxclaims"),
        Vec::<serde_json::Value>::new()
    );
    cluster.stop().await;
    let mut table = "| case | local | docker | docker, TLS host | kubernetes | wasm |\n|---|---|---|---|---|---|\n"
        .to_owned();
    for (i, name) in CASES.iter().enumerate() {
        let cells: Vec<&str> = columns.iter().map(|c| c[i].cell()).collect();
        table.push_str(&format!("| {name} | {} |\n", cells.join(" | ")));
    }
    let doc =
        std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("../docs/security.md"))
            .unwrap();
    assert!(
        doc.contains(&table),
        "docs/security.md does not hold the measured table; put this one there:\n\n{table}"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn the_confinement_cases_catch_an_unconfined_local_executor() {
    // The same cases against local with confinement off: each must find the escape, so a
    // confined local executor that passes them holds because of its confinement.
    let host = Host::new();
    let unconfined = LocalExecutor::new(LocalConfig {
        confine: Confine::Off,
        ..LocalConfig::default()
    });
    for i in CONFINEMENT_CASES {
        let run = std::panic::AssertUnwindSafe(case(i, Kind::Local, &unconfined, &host));
        assert!(
            futures::FutureExt::catch_unwind(run).await.is_err(),
            "case `{}` did not catch an unconfined local executor",
            CASES[i]
        );
    }
}
