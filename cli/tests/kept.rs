//! What `tandem run` made is still there when it ends (issue 48): the files a task made or
//! changed are kept in `./tandem-out/<id>/` (or `--out`) on both roads, in process and
//! through a daemon, on the local executor and in Docker; links and FIFOs the code planted
//! are not followed; an `--out` that cannot be written loses nothing; pictures are shown
//! inline on a terminal that speaks an image protocol, checked by the bytes tmux is sent.

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant};

use sha2::Digest as _;
use tandem_protocol::{Event, EventMsg};
use tandem_tests::{DaemonHarness as Daemon, Reply, ScriptedOpenAi, script};

use crate::e2e::{fence, settings};

const BIN: &str = env!("CARGO_BIN_EXE_tandem");

/// The task, and what the model reads of it with `sales.csv` and `notes.txt` given.
const TASK: &str = "chart the sales";
const TOLD: &str = "chart the sales\n\nFiles in your working directory (the current directory):\n\
                    - sales.csv (24 bytes)\n    month,revenue\n    1,10\n    2,32\n\
                    - notes.txt (6 bytes)\n    alpha";

/// A block that makes a chart (bytes it prints the SHA-256 of), a file in a new directory,
/// changes one given file and leaves the other, and plants a link to a host file, a link to
/// `/` and a FIFO: only the first three may be kept.
const MAKES: &str = "import hashlib, os\n\
data = bytes((i * 7919) % 251 for i in range(40000))\n\
open('chart.png', 'wb').write(data)\n\
os.makedirs('out', exist_ok=True)\n\
open('out/summary.txt', 'w').write('best month: 2\\n')\n\
open('notes.txt', 'a').write('checked\\n')\n\
os.symlink('/etc/passwd', 'leak')\n\
os.symlink('/', 'root')\n\
os.mkfifo('pipe')\n\
print('sha256', hashlib.sha256(data).hexdigest())";

/// What the task given [`inputs`] and running [`MAKES`] must leave, by path.
const KEPT: [&str; 3] = ["chart.png", "notes.txt", "out/summary.txt"];

fn replies() -> Vec<Reply> {
    vec![
        Reply::Text(fence("python", MAKES)),
        Reply::from("Charted.\nTERMINATE"),
    ]
}

/// `sales.csv` and `notes.txt` in a new directory.
fn inputs() -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("sales.csv"), "month,revenue\n1,10\n2,32\n").unwrap();
    std::fs::write(dir.path().join("notes.txt"), "alpha\n").unwrap();
    dir
}

fn file_args(dir: &Path) -> Vec<String> {
    ["sales.csv", "notes.txt"]
        .iter()
        .flat_map(|f| ["--file".to_owned(), dir.join(f).display().to_string()])
        .collect()
}

struct Run {
    code: i32,
    stdout: String,
    stderr: String,
}

/// `tandem run` in process from `cwd`, with `TMPDIR` set to `tmp`.
async fn run_in(cwd: &Path, tmp: &Path, args: &[String], env: &[(&str, &str)]) -> Run {
    let mut cmd = tokio::process::Command::new(BIN);
    cmd.arg("run")
        .args(args)
        .current_dir(cwd)
        .env_remove("OPENAI_API_KEY")
        .env_remove("TANDEM_CONFIG")
        .env_remove("TANDEM_PICTURES")
        .env("XDG_CONFIG_HOME", cwd.join(".config"))
        .env("TANDEM_MODELS_DIR", cwd.join("no-models"))
        .env("TANDEM_HOST", "unix:///nonexistent/tandem.sock")
        .env("TANDEM_MAX_RETRIES", "0")
        .env("NO_COLOR", "1")
        .env("TMPDIR", tmp)
        .envs(env.iter().copied())
        .stdin(Stdio::null())
        .kill_on_drop(true);
    let out = tokio::time::timeout(Duration::from_secs(240), cmd.output())
        .await
        .expect("tandem run hung for 240 s")
        .unwrap();
    Run {
        code: out.status.code().unwrap_or(-1),
        stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
    }
}

/// The regular files beneath `dir`, relative, sorted; a link or FIFO there fails the test.
fn files_under(dir: &Path) -> Vec<String> {
    let mut found = Vec::new();
    let mut todo = vec![dir.to_owned()];
    while let Some(d) = todo.pop() {
        for e in std::fs::read_dir(&d).unwrap() {
            let e = e.unwrap();
            let kind = e.file_type().unwrap();
            let rel = e.path().strip_prefix(dir).unwrap().display().to_string();
            if kind.is_dir() {
                todo.push(e.path());
            } else {
                assert!(kind.is_file(), "{rel} is kept, and is not a regular file");
                found.push(rel);
            }
        }
    }
    found.sort();
    found
}

/// The one directory in `out` (a task's), or a failure naming what is there.
fn only_task_dir(out: &Path) -> PathBuf {
    let dirs: Vec<PathBuf> = std::fs::read_dir(out)
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    assert_eq!(dirs.len(), 1, "{dirs:?}");
    dirs[0].clone()
}

/// Checks a kept task directory: the three files, the chart's bytes the block hashed.
fn check_kept(dir: &Path, stdout: &str, road: &str) {
    assert_eq!(files_under(dir), KEPT, "{road}: {stdout}");
    let chart = std::fs::read(dir.join("chart.png")).unwrap();
    let sum = hex::encode(sha2::Sha256::digest(&chart));
    assert!(
        stdout.contains(&format!("sha256 {sum}")),
        "{road}: the kept chart is not the bytes the block wrote:\n{stdout}"
    );
    assert_eq!(
        std::fs::read_to_string(dir.join("notes.txt")).unwrap(),
        "alpha\nchecked\n",
        "{road}"
    );
    assert_eq!(
        std::fs::read_to_string(dir.join("out/summary.txt")).unwrap(),
        "best month: 2\n"
    );
}

/// What `run --json` says it kept (`file_saved`): each file, its size, where it went.
fn saved(stdout: &str) -> Vec<(String, u64, String)> {
    stdout
        .lines()
        .filter_map(|l| serde_json::from_str::<Event>(l).ok())
        .filter_map(|e| match e.msg {
            EventMsg::FileSaved { file, bytes, to } => Some((file, bytes, to)),
            _ => None,
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn what_a_run_made_is_kept_in_process_on_local_and_docker() {
    let server = ScriptedOpenAi::start(script([(TOLD, replies())]))
        .await
        .unwrap();
    let given = inputs();
    for executor in ["local", "docker"] {
        let cwd = tempfile::tempdir().unwrap();
        let tmp = tempfile::tempdir().unwrap();
        let mut args = vec![
            "--base-url".to_owned(),
            server.base_url(),
            "--model".to_owned(),
            "m".to_owned(),
            "-e".to_owned(),
            executor.to_owned(),
        ];
        args.extend(file_args(given.path()));
        args.push(TASK.to_owned());
        let run = run_in(cwd.path(), tmp.path(), &args, &[]).await;
        assert_eq!(run.code, 0, "{executor}: {}\n{}", run.stdout, run.stderr);
        let task_dir = only_task_dir(&cwd.path().join("tandem-out"));
        check_kept(&task_dir, &run.stdout, executor);
        let id = task_dir.file_name().unwrap().to_str().unwrap().to_owned();
        // The transcript ends by naming the directory and each file, with its size.
        let tail: Vec<&str> = run
            .stdout
            .lines()
            .skip_while(|l| !l.starts_with("── done"))
            .collect();
        let mut s = settings();
        s.add_filter(&id, "[ID]");
        s.bind(|| insta::assert_snapshot!("kept_in_process", tail.join("\n")));
        // Nothing followed out: the host's files are as they were, and the workspace is gone.
        assert!(
            std::fs::read_dir(tmp.path()).unwrap().next().is_none(),
            "{executor}: the workspace was left in TMPDIR"
        );
        assert_eq!(
            std::fs::read_to_string(given.path().join("notes.txt")).unwrap(),
            "alpha\n"
        );
    }
    // --json: a file_saved event for each file, with where it went.
    let cwd = tempfile::tempdir().unwrap();
    let out = cwd.path().join("elsewhere");
    let mut args = vec![
        "--json".to_owned(),
        "--base-url".to_owned(),
        server.base_url(),
        "--out".to_owned(),
        out.display().to_string(),
    ];
    args.extend(file_args(given.path()));
    args.push(TASK.to_owned());
    let run = run_in(
        cwd.path(),
        cwd.path(),
        &args,
        &[("TANDEM_EXECUTOR", "local")],
    )
    .await;
    assert_eq!(run.code, 0, "{}", run.stderr);
    let task_dir = only_task_dir(&out);
    let saved = saved(&run.stdout);
    let want: Vec<(String, u64, String)> = KEPT
        .iter()
        .map(|f| {
            let to = task_dir.join(f);
            let bytes = std::fs::metadata(&to).unwrap().len();
            (f.to_string(), bytes, to.display().to_string())
        })
        .collect();
    assert_eq!(saved, want, "{}", run.stdout);
    // The events come after the task's end.
    let last = run.stdout.lines().last().unwrap();
    assert!(last.contains("file_saved"), "{last}");
    // --out - keeps nothing, and --workdir keeps the workspace itself, as before.
    let cwd = tempfile::tempdir().unwrap();
    let work = cwd.path().join("work");
    for extra in [
        vec!["--out".to_owned(), "-".to_owned()],
        vec!["--workdir".to_owned(), work.display().to_string()],
    ] {
        let mut args = vec!["--base-url".to_owned(), server.base_url()];
        args.extend(extra);
        args.extend(file_args(given.path()));
        args.push(TASK.to_owned());
        let run = run_in(
            cwd.path(),
            cwd.path(),
            &args,
            &[("TANDEM_EXECUTOR", "local")],
        )
        .await;
        assert_eq!(run.code, 0, "{}", run.stderr);
        assert!(!run.stdout.contains("files kept"), "{}", run.stdout);
        assert!(!cwd.path().join("tandem-out").exists());
    }
    assert!(work.join("chart.png").is_file());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn what_a_run_made_on_a_daemon_is_fetched_the_same_way() {
    let server = ScriptedOpenAi::start(script([(TOLD, replies())]))
        .await
        .unwrap();
    let given = inputs();
    // A Docker volume's files come back through the daemon's mirror of it.
    let volume = "[executors.docker]\nworkspace = \"volume\"\n";
    for (executor, config) in [("local", None), ("docker", None), ("docker", Some(volume))] {
        let d = Daemon::start(
            Path::new(BIN),
            &server.base_url(),
            &["--executor", executor],
            config,
        )
        .await;
        let mut args: Vec<String> = vec!["run".to_owned()];
        args.extend(file_args(given.path()));
        args.push(TASK.to_owned());
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let (code, stdout, stderr) = d.cli(&args).await;
        assert_eq!(code, 0, "{executor}: {stdout}\n{stderr}");
        assert!(stdout.contains("on the daemon at"), "{stdout}");
        let task_dir = only_task_dir(&d.state_dir().join("tandem-out"));
        check_kept(&task_dir, &stdout, executor);
        let id = task_dir.file_name().unwrap().to_str().unwrap().to_owned();
        // The daemon's list says which files were given and left alone.
        let list = d.get(&format!("/v1/tasks/{id}/files")).await;
        let given_ones: Vec<&str> = list["files"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|f| f["given"] == true)
            .map(|f| f["path"].as_str().unwrap())
            .collect();
        assert_eq!(given_ones, vec!["sales.csv"], "{list}");
        // The two roads end alike.
        let tail: Vec<&str> = stdout
            .lines()
            .skip_while(|l| !l.starts_with("── done"))
            .collect();
        let mut s = settings();
        s.add_filter(&id, "[ID]");
        s.bind(|| insta::assert_snapshot!("kept_in_process", tail.join("\n")));
        // Over the cap the user set: nothing fetched, and told how.
        let mut args: Vec<String> = vec!["run".into(), "--out-max-mb".into(), "0".into()];
        args.extend(file_args(given.path()));
        args.push(TASK.to_owned());
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let (code, stdout, stderr) = d.cli(&args).await;
        assert_eq!(code, 0, "{executor}: {stdout}\n{stderr}");
        // Below the line of what was not kept, the answer again, the transcript's last.
        let told = stdout.lines().rev().nth(2).unwrap();
        assert_eq!(
            stdout.lines().rev().nth(1),
            Some("── answer ──"),
            "{stdout}"
        );
        assert!(
            told.starts_with("── 3 files (39.1 KiB) not kept, over --out-max-mb 0: `tandem files ")
                && told.ends_with(" --tar -o files.tar` fetches them all ──"),
            "{stdout}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_run_that_made_nothing_says_nothing_and_makes_nothing() {
    let server = ScriptedOpenAi::start(script([(
        "print only",
        vec![
            Reply::Text(fence("python", "print(6 * 7)")),
            Reply::from("TERMINATE"),
        ],
    )]))
    .await
    .unwrap();
    let cwd = tempfile::tempdir().unwrap();
    let args = vec![
        "--base-url".to_owned(),
        server.base_url(),
        "print only".to_owned(),
    ];
    let run = run_in(
        cwd.path(),
        cwd.path(),
        &args,
        &[("TANDEM_EXECUTOR", "local")],
    )
    .await;
    assert_eq!(run.code, 0, "{}", run.stderr);
    // The transcript ends with the end and the answer, and names no file kept.
    let tail: Vec<&str> = run.stdout.trim_end().lines().rev().take(3).collect();
    assert_eq!(tail[0], "42", "{}", run.stdout);
    assert!(tail[1].starts_with("── answer"), "{}", run.stdout);
    assert!(tail[2].starts_with("── done"), "{}", run.stdout);
    assert!(!run.stdout.contains("files kept"), "{}", run.stdout);
    assert!(!cwd.path().join("tandem-out").exists());
    assert!(run.stderr.is_empty(), "{}", run.stderr);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_out_that_cannot_be_written_is_named_after_the_answer_and_loses_nothing() {
    let server = ScriptedOpenAi::start(script([(TOLD, replies())]))
        .await
        .unwrap();
    let given = inputs();
    let cwd = tempfile::tempdir().unwrap();
    let tmp = tempfile::tempdir().unwrap();
    // A file where a directory must be: refused even for root.
    let blocked = cwd.path().join("a-file");
    std::fs::write(&blocked, "").unwrap();
    let out = blocked.join("kept");
    let mut args = vec![
        "--base-url".to_owned(),
        server.base_url(),
        "--out".to_owned(),
        out.display().to_string(),
    ];
    args.extend(file_args(given.path()));
    args.push(TASK.to_owned());
    let run = run_in(
        cwd.path(),
        tmp.path(),
        &args,
        &[("TANDEM_EXECUTOR", "local")],
    )
    .await;
    assert_eq!(run.code, 5, "{}\n{}", run.stdout, run.stderr);
    // The answer was told first.
    assert!(run.stdout.contains("Charted."), "{}", run.stdout);
    assert!(run.stdout.contains("── done · 2 turns"), "{}", run.stdout);
    let named = run
        .stderr
        .lines()
        .find(|l| l.starts_with("tandem: cannot make "))
        .unwrap_or_else(|| panic!("{}", run.stderr));
    assert!(
        named.starts_with(&format!("tandem: cannot make {}/", out.display()))
            && named.ends_with("give --out a directory you can write (or --out - to keep nothing)"),
        "{}",
        run.stderr
    );
    // The whole workspace is kept where it is said to be, the chart in it.
    let kept = run
        .stderr
        .lines()
        .find_map(|l| {
            l.strip_prefix("tandem: nothing is lost: the task's whole workspace stays in ")
        })
        .unwrap_or_else(|| panic!("{}", run.stderr));
    assert!(
        kept.starts_with(&tmp.path().display().to_string()),
        "{kept}"
    );
    assert!(Path::new(kept).join("chart.png").is_file());
    assert!(Path::new(kept).join("leak").is_symlink());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn past_the_size_cap_the_rest_is_named_and_the_workspace_stays() {
    let server = ScriptedOpenAi::start(script([(TOLD, replies())]))
        .await
        .unwrap();
    let given = inputs();
    let cwd = tempfile::tempdir().unwrap();
    let tmp = tempfile::tempdir().unwrap();
    let mut args = vec![
        "--base-url".to_owned(),
        server.base_url(),
        "--out-max-mb".to_owned(),
        "0".to_owned(),
    ];
    args.extend(file_args(given.path()));
    args.push(TASK.to_owned());
    let run = run_in(
        cwd.path(),
        tmp.path(),
        &args,
        &[("TANDEM_EXECUTOR", "local")],
    )
    .await;
    // The cap is the user's choice: no failure.
    assert_eq!(run.code, 0, "{}\n{}", run.stdout, run.stderr);
    assert_eq!(
        run.stdout.lines().rev().nth(1),
        Some("── answer ──"),
        "{}",
        run.stdout
    );
    let last = run.stdout.lines().rev().nth(2).unwrap();
    let kept = last
        .strip_prefix("── 3 files (39.1 KiB) not kept, over --out-max-mb 0: raise it to keep them; the whole workspace stays in ")
        .and_then(|rest| rest.strip_suffix(" ──"))
        .unwrap_or_else(|| panic!("{}", run.stdout));
    assert!(Path::new(kept).join("out/summary.txt").is_file());
}

/// A tmux session running `command` in `dir` once `go` exists, with every byte the command
/// writes to its terminal piped to `raw`.
struct Pane {
    session: String,
    raw: PathBuf,
    done: PathBuf,
}

impl Pane {
    fn start(dir: &Path, command: &str, env: &[(&str, String)]) -> Self {
        let session = format!("tandem-kept-{}", uuid::Uuid::new_v4().simple());
        let (raw, done, go) = (dir.join("raw.bin"), dir.join("done"), dir.join("go"));
        let script = format!(
            "while [ ! -e {go} ]; do sleep 0.05; done; {command}; echo $? > {done}; sleep 60",
            go = go.display(),
            done = done.display()
        );
        let mut args: Vec<String> = ["new-session", "-d", "-s", &session, "-x", "150", "-y", "50"]
            .iter()
            .map(|s| s.to_string())
            .collect();
        args.extend(["-c".to_owned(), dir.display().to_string()]);
        for (k, v) in env {
            args.extend(["-e".to_owned(), format!("{k}={v}")]);
        }
        args.push(script);
        let pane = Self { session, raw, done };
        pane.tmux(&args.iter().map(String::as_str).collect::<Vec<_>>());
        let pipe = format!("cat > {}", pane.raw.display());
        pane.tmux(&["pipe-pane", "-O", "-t", &pane.session, &pipe]);
        std::fs::write(go, "").unwrap();
        pane
    }

    fn tmux(&self, args: &[&str]) -> String {
        // A server of its own: tests that start and end tmux servers at once never meet a
        // shared one as it exits.
        let out = std::process::Command::new("tmux")
            .args(["-L", &self.session])
            .args(args)
            .output()
            .unwrap();
        assert!(out.status.success(), "tmux {args:?}: {out:?}");
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    /// Waits for the command to end: its exit code and the raw bytes it wrote.
    fn finish(&self) -> (String, Vec<u8>) {
        let started = Instant::now();
        while !self.done.exists() {
            assert!(
                started.elapsed() < Duration::from_secs(120),
                "the command never ended:\n{}",
                self.tmux(&["capture-pane", "-p", "-t", &self.session])
            );
            std::thread::sleep(Duration::from_millis(50));
        }
        // What the pane wrote last reaches the pipe after the command ends: wait for the
        // transcript's last rule there, not for a fixed time.
        let started = Instant::now();
        while !String::from_utf8_lossy(&std::fs::read(&self.raw).unwrap_or_default())
            .contains("── done")
        {
            assert!(
                started.elapsed() < Duration::from_secs(30),
                "the pane's output never reached the pipe"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
        let code = std::fs::read_to_string(&self.done)
            .unwrap()
            .trim()
            .to_owned();
        (code, std::fs::read(&self.raw).unwrap_or_default())
    }
}

impl Drop for Pane {
    fn drop(&mut self) {
        let _ = std::process::Command::new("tmux")
            .args(["-L", &self.session, "kill-server"])
            .status();
    }
}

/// The base64 payload of the kitty graphics escapes in `raw`, as tmux is sent them
/// (wrapped for passthrough, escapes doubled), decoded.
fn kitty_picture(raw: &[u8]) -> Option<Vec<u8>> {
    use base64::Engine as _;
    let text = String::from_utf8_lossy(raw).replace("\x1b\x1b", "\x1b");
    let mut b64 = String::new();
    let mut found = false;
    for part in text.split("\x1b_G").skip(1) {
        let body = part.split("\x1b\\").next()?;
        let (keys, payload) = body.split_once(';')?;
        found |= keys.contains("f=100");
        b64.push_str(payload);
    }
    found.then(|| base64::engine::general_purpose::STANDARD.decode(b64).ok())?
}

/// The pixels of `png`, as RGBA.
fn rgba(png: &[u8]) -> Vec<u8> {
    let mut decoder = png::Decoder::new(std::io::Cursor::new(png));
    decoder.set_transformations(png::Transformations::ALPHA | png::Transformations::STRIP_16);
    let mut reader = decoder.read_info().unwrap();
    let mut buf = vec![0; reader.output_buffer_size().unwrap()];
    let frame = reader.next_frame(&mut buf).unwrap();
    buf.truncate(frame.buffer_size());
    buf
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_picture_is_shown_inline_on_a_terminal_that_speaks_kitty_or_sixel() {
    // A real 2x2 PNG, written by the block; the terminal must be sent its pixels (in a PNG
    // made anew, never the sandbox's bytes).
    let png: &[u8] = &[
        0x89, 0x50, 0x4e, 0x47, 0x0d, 0x0a, 0x1a, 0x0a, 0x00, 0x00, 0x00, 0x0d, 0x49, 0x48, 0x44,
        0x52, 0x00, 0x00, 0x00, 0x02, 0x00, 0x00, 0x00, 0x02, 0x08, 0x02, 0x00, 0x00, 0x00, 0xfd,
        0xd4, 0x9a, 0x73, 0x00, 0x00, 0x00, 0x10, 0x49, 0x44, 0x41, 0x54, 0x78, 0x9c, 0x63, 0xf8,
        0xcf, 0x00, 0x04, 0xff, 0x19, 0x20, 0x14, 0x00, 0x1b, 0xf2, 0x03, 0xfd, 0xd6, 0x96, 0xf2,
        0x2b, 0x00, 0x00, 0x00, 0x00, 0x49, 0x45, 0x4e, 0x44, 0xae, 0x42, 0x60, 0x82,
    ];
    let code = format!("open('chart.png', 'wb').write(bytes({:?}))", png.to_vec());
    let server = ScriptedOpenAi::start(script([(
        "draw",
        vec![
            Reply::Text(fence("python", &code)),
            Reply::from("TERMINATE"),
        ],
    )]))
    .await
    .unwrap();
    let env = |pictures: &str| {
        vec![
            ("OPENAI_BASE_URL", server.base_url()),
            ("TANDEM_EXECUTOR", "local".to_owned()),
            ("TANDEM_MAX_RETRIES", "0".to_owned()),
            ("TANDEM_HOST", "unix:///nonexistent/tandem.sock".to_owned()),
            ("TANDEM_MODELS_DIR", "/nonexistent".to_owned()),
            ("TANDEM_PICTURES", pictures.to_owned()),
            ("XDG_CONFIG_HOME", "/nonexistent".to_owned()),
        ]
    };
    for (flags, asked, shown) in [
        ("", "kitty", true),
        ("", "sixel", true),
        ("--no-pictures", "kitty", false),
        ("", "none", false),
    ] {
        let dir = tempfile::tempdir().unwrap();
        let pane = Pane::start(dir.path(), &format!("{BIN} run {flags} draw"), &env(asked));
        let (code, raw) = pane.finish();
        let text = String::from_utf8_lossy(&raw);
        assert_eq!(code, "0", "{text}");
        assert!(
            text.contains("picture chart.png · image/png · 73 B"),
            "{text}"
        );
        let picture = kitty_picture(&raw);
        if shown && asked == "kitty" {
            // Inside tmux, wrapped to pass through to the terminal.
            assert!(
                text.contains("\x1bPtmux;\x1b\x1b_Gf=100,a=T,q=2,c=40,r=20,"),
                "{text:?}"
            );
            assert_eq!(
                picture.as_deref().map(rgba),
                Some(rgba(png)),
                "{flags} {asked}"
            );
        } else if shown {
            // The two columns, red then blue, as sixels two pixels high.
            assert!(
                text.contains("\x1bPtmux;\x1b\x1bP0;1q\"1;1;2;2#0;2;0;0;0")
                    && text.contains("#180B?$#5?B-\x1b\x1b\\\x1b\\"),
                "{text:?}"
            );
        } else {
            assert!(
                !text.contains("_G") && !text.contains("\x1bP"),
                "{flags} {asked}: {text:?}"
            );
        }
        // Kept, as everywhere.
        let kept = only_task_dir(&dir.path().join("tandem-out"));
        assert_eq!(std::fs::read(kept.join("chart.png")).unwrap(), png);
    }
    // Through a daemon, the picture is fetched from it as the transcript comes to it.
    let d = Daemon::start(
        Path::new(BIN),
        &server.base_url(),
        &["--executor", "local"],
        None,
    )
    .await;
    let dir = tempfile::tempdir().unwrap();
    let mut on_daemon = env("kitty");
    on_daemon.retain(|(k, _)| *k != "TANDEM_HOST");
    on_daemon.push(("TANDEM_HOST", d.host()));
    let pane = Pane::start(dir.path(), &format!("{BIN} run draw"), &on_daemon);
    let (code, raw) = pane.finish();
    let text = String::from_utf8_lossy(&raw);
    assert_eq!(code, "0", "{text}");
    assert!(text.contains("on the daemon at"), "{text}");
    assert_eq!(
        kitty_picture(&raw).as_deref().map(rgba),
        Some(rgba(png)),
        "{text:?}"
    );
    let kept = only_task_dir(&dir.path().join("tandem-out"));
    assert_eq!(std::fs::read(kept.join("chart.png")).unwrap(), png);
    // Not a terminal: the path only, whatever is asked.
    let cwd = tempfile::tempdir().unwrap();
    let args = vec![
        "--base-url".to_owned(),
        server.base_url(),
        "draw".to_owned(),
    ];
    let run = run_in(
        cwd.path(),
        cwd.path(),
        &args,
        &[("TANDEM_EXECUTOR", "local"), ("TANDEM_PICTURES", "kitty")],
    )
    .await;
    assert_eq!(run.code, 0, "{}", run.stderr);
    assert!(run.stdout.contains("picture chart.png"), "{}", run.stdout);
    assert!(!run.stdout.contains('\x1b'), "{:?}", run.stdout);
}

/// A block that draws a valid PNG 1 x 200,000 pixels (a few hundred bytes of compressed
/// rows), then 24 sparse 8 MiB files named `.png`, and prints a window title, a screen clear,
/// an OSC 8 link and a C1 CSI on both streams.
const FLOODS: &str = r"import struct, sys, zlib
def chunk(kind, data):
    return struct.pack('>I', len(data)) + kind + data + struct.pack('>I', zlib.crc32(kind + data))
rows = b''.join(b'\x00' + bytes([y % 256]) for y in range(200000))
open('a_tall.png', 'wb').write(b'\x89PNG\r\n\x1a\n' + chunk(b'IHDR', struct.pack('>IIBBBBB', 1, 200000, 8, 0, 0, 0, 0)) + chunk(b'IDAT', zlib.compress(rows, 9)) + chunk(b'IEND', b''))
for i in range(24):
    with open(f'p{i:02}.png', 'wb') as f:
        f.truncate(8 << 20)
hostile = '\x1b]0;pwned\x07\x1b[2J\u009b2J\x1b]8;;https://evil.example/\x1b\\link\x1b]8;;\x1b\\'
print(hostile)
print(hostile, file=sys.stderr)";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hostile_reply_and_a_flood_of_pictures_reach_the_terminal_inert_and_bounded() {
    let reply = format!(
        "Copy this \x1b]52;c;cm0gLXJmIH4K\x07 and \x1b[2J\u{9b}2J\u{9d}0;title\u{9c} go.\n{}",
        fence("python", FLOODS)
    );
    let server = ScriptedOpenAi::start(script([(
        "flood",
        vec![Reply::Text(reply), Reply::from("TERMINATE")],
    )]))
    .await
    .unwrap();
    let dir = tempfile::tempdir().unwrap();
    let ws = dir.path().join("ws");
    std::fs::create_dir(&ws).unwrap();
    let env = vec![
        ("OPENAI_BASE_URL", server.base_url()),
        ("TANDEM_EXECUTOR", "local".to_owned()),
        ("TANDEM_MAX_RETRIES", "0".to_owned()),
        ("TANDEM_HOST", "unix:///nonexistent/tandem.sock".to_owned()),
        ("TANDEM_MODELS_DIR", "/nonexistent".to_owned()),
        ("TANDEM_PICTURES", "kitty".to_owned()),
        ("XDG_CONFIG_HOME", "/nonexistent".to_owned()),
    ];
    let command = format!("{BIN} run --workdir {} flood", ws.display());
    let pane = Pane::start(dir.path(), &command, &env);
    let (code, raw) = pane.finish();
    let text = String::from_utf8_lossy(&raw);
    assert_eq!(code, "0", "{text}");
    // The 24 files were made, 8 MiB each: the terminal was sent far less than one of them.
    assert_eq!(
        std::fs::metadata(ws.join("p23.png")).unwrap().len(),
        8 << 20
    );
    assert!(raw.len() < 1 << 20, "{} bytes", raw.len());
    for sequence in [
        "\x1b]52", "\x1b]0;", "\x1b]8;", "\x1b[2J", "\u{9b}", "\u{9d}", "\x07",
    ] {
        assert!(!text.contains(sequence), "{sequence:?} in {text:?}");
    }
    assert!(
        text.contains("Copy this \\u{1b}]52;c;cm0gLXJmIH4K\\u{7} and \\u{1b}[2J\\u{9b}2J"),
        "{text:?}"
    );
    assert!(
        text.contains("\\u{1b}]0;pwned\\u{7}\\u{1b}[2J\\u{9b}2J\\u{1b}]8;;https://evil.example/"),
        "{text:?}"
    );
    // The tall picture is drawn once, scaled into the box both ways; the files that only
    // say they are PNGs are not sent, and the note says what was left out.
    assert_eq!(text.matches("\x1b_Gf=100").count(), 1, "{text:?}");
    assert!(text.contains("_Gf=100,a=T,q=2,c=1,r=20,"), "{text:?}");
    let sent = kitty_picture(&raw).unwrap();
    let mut decoder = png::Decoder::new(std::io::Cursor::new(sent));
    decoder.set_transformations(png::Transformations::IDENTITY);
    let (w, h) = decoder.read_info().unwrap().info().size();
    assert!(w <= 320 && h <= 320, "{w} x {h}");
    assert!(
        text.contains(
            "24 pictures not drawn: 3 not a PNG that decodes within 4096 x 4096 pixels; 21 past the 4 a block may draw"
        ),
        "{text:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_file_the_out_cannot_hold_is_named_and_the_others_are_kept() {
    let server = ScriptedOpenAi::start(script([(TOLD, replies())]))
        .await
        .unwrap();
    let given = inputs();
    let cwd = tempfile::tempdir().unwrap();
    let tmp = tempfile::tempdir().unwrap();
    // A file system of 16 KiB: the 39 KiB chart cannot be held, the two small files can.
    let out = cwd.path().join("small");
    std::fs::create_dir(&out).unwrap();
    let mounted = std::process::Command::new("mount")
        .args(["-t", "tmpfs", "-o", "size=16k", "tmpfs"])
        .arg(&out)
        .status()
        .unwrap();
    assert!(mounted.success(), "this test mounts a tmpfs, as root");
    struct Unmount<'a>(&'a Path);
    impl Drop for Unmount<'_> {
        fn drop(&mut self) {
            let _ = std::process::Command::new("umount").arg(self.0).status();
        }
    }
    let _unmount = Unmount(&out);
    let mut args = vec![
        "--base-url".to_owned(),
        server.base_url(),
        "--out".to_owned(),
        out.display().to_string(),
    ];
    args.extend(file_args(given.path()));
    args.push(TASK.to_owned());
    let run = run_in(
        cwd.path(),
        tmp.path(),
        &args,
        &[("TANDEM_EXECUTOR", "local")],
    )
    .await;
    assert_eq!(run.code, 5, "{}\n{}", run.stdout, run.stderr);
    let task_dir = only_task_dir(&out);
    // What could be held is kept, and no part of the chart passes for it.
    assert_eq!(files_under(&task_dir), ["notes.txt", "out/summary.txt"]);
    assert!(
        run.stderr
            .contains("tandem: could not keep chart.png: No space left on device"),
        "{}",
        run.stderr
    );
    // The transcript lists what was kept; the whole workspace is left and named.
    assert!(
        run.stdout
            .contains("      14 B  notes.txt\n      14 B  out/summary.txt\n── answer ──\n"),
        "{}",
        run.stdout
    );
    let kept = run
        .stderr
        .lines()
        .find_map(|l| {
            l.strip_prefix("tandem: nothing is lost: the task's whole workspace stays in ")
        })
        .unwrap_or_else(|| panic!("{}", run.stderr));
    let chart = std::fs::read(Path::new(kept).join("chart.png")).unwrap();
    assert_eq!(chart.len(), 40_000);
}
