//! Files in and out of a daemon's tasks (issue 30): uploads checked entry by entry, a task's
//! workspace listed and read during and after it, pictures as artifacts, and the retention
//! that removes workspaces. Each attack is judged on the host's disk and in what comes back.

use std::path::Path;
use std::time::{Duration, Instant};

use serde_json::{Value, json};
use tandem_protocol::{Event, EventMsg, StopReason, TaskRecord};
use tandem_tests::daemon::block_results;
use tandem_tests::{DaemonHarness as Daemon, Reply, ScriptedOpenAi, script};

const BIN: &str = env!("CARGO_BIN_EXE_tandem");

async fn daemon(server: &ScriptedOpenAi, args: &[&str], config: Option<&str>) -> Daemon {
    Daemon::start(Path::new(BIN), &server.base_url(), args, config).await
}

fn python(code: &str) -> Reply {
    Reply::from(format!("```python\n{code}\n```").as_str())
}

fn sh(code: &str) -> Reply {
    Reply::from(format!("```sh\n{code}\n```").as_str())
}

/// A tar archive of `(path, kind, data, claimed size)` entries, written raw so that it can
/// say anything a hostile client would.
fn archive(entries: &[(&str, tar::EntryType, &[u8], Option<u64>)]) -> Vec<u8> {
    let mut out = Vec::new();
    for (path, kind, data, claimed) in entries {
        let mut header = tar::Header::new_gnu();
        let name = &mut header.as_gnu_mut().unwrap().name;
        name[..path.len()].copy_from_slice(path.as_bytes());
        header.set_entry_type(*kind);
        header.set_mode(0o644);
        header.set_size(claimed.unwrap_or(data.len() as u64));
        if *kind == tar::EntryType::GNUSparse {
            // A terabyte of holes in no bytes at all.
            let gnu = header.as_gnu_mut().unwrap();
            gnu.set_real_size(1 << 40);
            gnu.sparse[0].set_offset(1 << 40);
            gnu.sparse[0].set_length(0);
        }
        if matches!(kind, tar::EntryType::Symlink | tar::EntryType::Link) {
            header.set_link_name("/etc/passwd").unwrap();
        }
        header.set_cksum();
        out.extend_from_slice(header.as_bytes());
        out.extend_from_slice(data);
        out.resize(out.len().div_ceil(512) * 512, 0);
    }
    out.extend_from_slice(&[0u8; 1024]);
    out
}

/// `(status, body)` of `POST /v1/uploads` with `body`.
async fn upload(d: &Daemon, body: Vec<u8>) -> (u16, Value) {
    let resp = d
        .http()
        .post("http://tandem/v1/uploads")
        .header("content-type", "application/x-tar")
        .body(body)
        .send()
        .await
        .unwrap();
    let status = resp.status().as_u16();
    (status, resp.json().await.unwrap_or(Value::Null))
}

/// `(status, headers, bytes)` of `GET path`.
async fn fetch(d: &Daemon, path: &str) -> (u16, reqwest::header::HeaderMap, Vec<u8>) {
    let resp = d
        .http()
        .get(format!("http://tandem{path}"))
        .send()
        .await
        .unwrap();
    let (status, headers) = (resp.status().as_u16(), resp.headers().clone());
    (status, headers, resp.bytes().await.unwrap().to_vec())
}

/// What an `artifact` event says.
#[derive(Clone, Copy, Debug)]
struct Artifact<'a> {
    turn: u32,
    file: &'a str,
    mime: &'a str,
    bytes: u64,
    href: Option<&'a str>,
}

/// Every picture in `events` (`artifact`), in order.
fn artifacts(events: &[Event]) -> Vec<Artifact<'_>> {
    events
        .iter()
        .filter_map(|e| match &e.msg {
            EventMsg::Artifact {
                turn,
                file,
                mime,
                bytes,
                href,
                ..
            } => Some(Artifact {
                turn: *turn,
                file,
                mime,
                bytes: *bytes,
                href: href.as_deref(),
            }),
            _ => None,
        })
        .collect()
}

/// The daemon's tasks (`GET /v1/tasks`).
async fn tasks(d: &Daemon) -> Vec<TaskRecord> {
    d.tasks("/v1/tasks").await.tasks
}

/// Every file beneath `dir`, as paths relative to it (links included, not followed).
fn tree(dir: &Path) -> Vec<String> {
    let mut found = Vec::new();
    let mut stack = vec![dir.to_owned()];
    while let Some(d) = stack.pop() {
        for entry in std::fs::read_dir(&d).into_iter().flatten().flatten() {
            let path = entry.path();
            if entry.file_type().unwrap().is_dir() {
                stack.push(path.clone());
            }
            found.push(path.strip_prefix(dir).unwrap().display().to_string());
        }
    }
    found.sort();
    found
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_csv_uploaded_over_the_api_is_analysed_and_its_chart_comes_back_byte_identical() {
    let csv = "month,revenue\n1,10\n2,32\n3,18\n";
    let told = format!(
        "plot revenue by month\n\nFiles in your working directory (the current directory):\n\
         - data/sales.csv ({} bytes)\n    month,revenue\n    1,10\n    2,32\n    3,18",
        csv.len()
    );
    let code = "import pandas as pd\nimport matplotlib.pyplot as plt\n\
                df = pd.read_csv('data/sales.csv')\nprint(int(df.revenue.sum()))\n\
                df.plot(x='month', y='revenue')\nplt.savefig('chart.png')";
    let server = ScriptedOpenAi::start(script([(
        told.as_str(),
        vec![
            python(code),
            Reply::from("The chart is in chart.png.\nTERMINATE"),
        ],
    )]))
    .await
    .unwrap();
    let d = daemon(&server, &["--executor", "docker"], None).await;
    let (status, up) = upload(
        &d,
        archive(&[(
            "data/sales.csv",
            tar::EntryType::Regular,
            csv.as_bytes(),
            None,
        )]),
    )
    .await;
    assert_eq!(status, 201, "{up}");
    assert_eq!(
        up["files"],
        json!([{"path": "data/sales.csv", "bytes": csv.len()}])
    );
    assert_eq!(up["bytes"], csv.len());
    let id = d
        .submit(json!({"task": "plot revenue by month", "files": up["id"]}))
        .await;
    let record = d.wait_finished(&id, Duration::from_secs(120)).await;
    let events = d.events(&id, 0).await;
    assert_eq!(
        record.record.stop_reason,
        Some(StopReason::Terminated),
        "{record:?}\n{events:#?}"
    );
    // The block read the file it was given.
    let result = block_results(&events)[0];
    assert_eq!(result.stdout, "60\n", "{result:?}");
    // The chart it saved is an artifact with a link, after the block's result.
    let artifacts = artifacts(&events);
    assert_eq!(artifacts.len(), 1, "{events:#?}");
    let chart = artifacts[0];
    assert_eq!(chart.file, "chart.png");
    assert_eq!(chart.mime, "image/png");
    let href = chart.href.unwrap();
    assert_eq!(href, format!("/v1/tasks/{id}/files/chart.png"));
    let (status, headers, png) = fetch(&d, href).await;
    assert_eq!(status, 200);
    assert_eq!(headers["content-type"], "image/png");
    assert_eq!(headers["x-content-type-options"], "nosniff");
    assert!(png.starts_with(b"\x89PNG\r\n\x1a\n"), "not a PNG");
    assert_eq!(png.len() as u64, chart.bytes);
    // Byte for byte what the block wrote, and what the tar of the workspace holds.
    let on_disk = d
        .state_dir()
        .join(format!("files/tasks/{id}/work/chart.png"));
    assert_eq!(std::fs::read(on_disk).unwrap(), png);
    let (status, headers, tarred) = fetch(&d, &format!("/v1/tasks/{id}/files?format=tar")).await;
    assert_eq!(status, 200);
    assert_eq!(headers["content-type"], "application/x-tar");
    let mut from_tar = std::collections::BTreeMap::new();
    for entry in tar::Archive::new(&tarred[..]).entries().unwrap() {
        let mut entry = entry.unwrap();
        let path = entry.path().unwrap().display().to_string();
        let mut data = Vec::new();
        std::io::Read::read_to_end(&mut entry, &mut data).unwrap();
        from_tar.insert(path, data);
    }
    assert_eq!(from_tar["chart.png"], png);
    assert_eq!(from_tar["data/sales.csv"], csv.as_bytes());
    // The list names both, with their sizes.
    let list = d.get(&format!("/v1/tasks/{id}/files")).await;
    let listed: Vec<(&str, u64)> = list["files"]
        .as_array()
        .unwrap()
        .iter()
        .map(|f| (f["path"].as_str().unwrap(), f["bytes"].as_u64().unwrap()))
        .collect();
    assert_eq!(
        listed,
        vec![
            ("chart.png", png.len() as u64),
            ("data/sales.csv", csv.len() as u64)
        ]
    );
    // The CLI reads the same: a list, one file, and the whole workspace.
    let (code, out, err) = d.cli(&["files", &id]).await;
    assert_eq!(code, 0, "{err}");
    assert!(
        out.contains("chart.png") && out.contains("data/sales.csv"),
        "{out}"
    );
    let got = d.state_dir().join("got.png");
    let (code, _, err) = d
        .cli(&[
            "files",
            &id,
            "--get",
            "chart.png",
            "-o",
            got.to_str().unwrap(),
        ])
        .await;
    assert_eq!(code, 0, "{err}");
    assert_eq!(std::fs::read(&got).unwrap(), png);
    let (code, _, err) = d
        .cli(&["files", &id, "--get", "nothing.png", "-o", "/dev/null"])
        .await;
    assert_eq!(code, 2, "{err}");
    assert!(
        err.contains(&format!("task {id} has no file `nothing.png`")),
        "{err}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hostile_uploads_are_refused_by_name_and_write_nothing() {
    use tar::EntryType as T;
    let server = ScriptedOpenAi::start(script([])).await.unwrap();
    let d = daemon(
        &server,
        &[],
        Some("[files]\nmax_upload_mb = 1\nmax_upload_files = 20\n"),
    )
    .await;
    let big = vec![b'x'; (1 << 20) + 1];
    let long_name = vec![b'a'; 900 << 10];
    let cases: Vec<(&str, Vec<u8>, u16, &str)> = vec![
        (
            "a GNU long name of 900 KiB (read whole by a tar reader, before its entry)",
            archive(&[
                ("././@LongLink", T::GNULongName, &long_name, None),
                ("short", T::Regular, b"x", None),
            ]),
            400,
            "a 921600 byte name or extended header; at most 65536 bytes are taken",
        ),
        (
            "a path up and out",
            archive(&[("../escaped", T::Regular, b"x", None)]),
            400,
            "`../escaped` is not a path inside the workspace",
        ),
        (
            "an absolute path",
            archive(&[("/tmp/escaped", T::Regular, b"x", None)]),
            400,
            "`/tmp/escaped` is not a path inside the workspace",
        ),
        (
            "a symbolic link",
            archive(&[("passwd", T::Symlink, b"", None)]),
            400,
            "`passwd` is a symbolic link",
        ),
        (
            "a hard link",
            archive(&[("passwd", T::Link, b"", None)]),
            400,
            "`passwd` is a hard link",
        ),
        (
            "a device",
            archive(&[("null", T::Char, b"", None)]),
            400,
            "`null` is a device",
        ),
        (
            "a FIFO",
            archive(&[("pipe", T::Fifo, b"", None)]),
            400,
            "`pipe` is a FIFO",
        ),
        (
            "a sparse file",
            archive(&[("holes", T::GNUSparse, b"", None)]),
            400,
            "`holes` is a sparse file",
        ),
        (
            "a header claiming a terabyte",
            archive(&[("huge", T::Regular, b"x", Some(1 << 40))]),
            400,
            "over the 1048576 byte limit (at `huge`)",
        ),
        (
            "more bytes than the cap",
            archive(&[("big", T::Regular, &big, None)]),
            400,
            "over the 1048576 byte limit (at `big`)",
        ),
        (
            "more files than the cap",
            {
                let names: Vec<String> = (0..21).map(|i| format!("f{i}")).collect();
                let entries: Vec<_> = names
                    .iter()
                    .map(|n| (n.as_str(), T::Regular, &b"x"[..], None))
                    .collect();
                archive(&entries)
            },
            400,
            "more than 20 entries",
        ),
        (
            "a body far over any archive within the caps",
            vec![0u8; 4 << 20],
            413,
            "over the 1048576 byte limit",
        ),
        (
            "not a tar archive",
            b"this is not a tar archive, only text that goes on long enough".repeat(20),
            400,
            "the upload was refused",
        ),
    ];
    for (what, body, status, says) in cases {
        let (got, answer) = upload(&d, body).await;
        assert_eq!(got, status, "{what}: {answer}");
        let message = answer["error"]["message"].as_str().unwrap_or_default();
        assert!(message.contains(says), "{what}: {message}");
    }
    // Nothing of them is anywhere: not in the uploads, not beside the state dir.
    let files = d.state_dir().join("files");
    assert_eq!(
        tree(&files),
        vec![
            "snapshots",
            "snapshots/blobs",
            "snapshots/snaps",
            "snapshots/tmp",
            "tasks",
            "uploads",
            "volumes"
        ],
        "{:?}",
        tree(&files)
    );
    assert!(!d.state_dir().join("escaped").exists());
    assert!(!Path::new("/tmp/escaped").exists());
    // A task naming an upload that is not there, or a path for one, is refused, and nothing
    // is queued.
    for bad in [
        "0123456789abcdef0123456789abcdef",
        "../../tandem.db",
        "uploads/x",
    ] {
        let (status, body) = d
            .send(
                reqwest::Method::POST,
                "/v1/tasks",
                Some(json!({"task": "t", "files": bad}).to_string()),
            )
            .await;
        assert_eq!(status, 400, "{bad}: {body}");
        let message = body["error"]["message"].as_str().unwrap();
        assert!(
            message.contains(&format!("there is no upload `{bad}`")),
            "{message}"
        );
    }
    assert_eq!(tasks(&d).await, Vec::<TaskRecord>::new());
    // Within the caps, the same daemon takes an upload.
    let (status, up) = upload(&d, archive(&[("ok.txt", T::Regular, b"fine", None)])).await;
    assert_eq!(status, 201, "{up}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reading_a_workspace_follows_no_link_the_code_planted() {
    // The block plants links to the host's files and to the root, and to another task.
    let plant = "mkdir -p sub && echo inside > sub/ok.txt && ln -s /etc/passwd leak.txt \
                 && ln -s / root && ln -s sub subway && echo done";
    let server = ScriptedOpenAi::start(script([
        ("plant", vec![sh(plant), Reply::from("TERMINATE")]),
        (
            "secret",
            vec![sh("echo private > secret.txt"), Reply::from("TERMINATE")],
        ),
    ]))
    .await
    .unwrap();
    let d = daemon(&server, &[], None).await;
    let other = d.submit(json!({"task": "secret"})).await;
    d.wait_finished(&other, Duration::from_secs(60)).await;
    let id = d.submit(json!({"task": "plant"})).await;
    let record = d.wait_finished(&id, Duration::from_secs(60)).await;
    assert_eq!(
        record.record.stop_reason,
        Some(StopReason::Terminated),
        "{record:?}"
    );
    let list = d.get(&format!("/v1/tasks/{id}/files")).await;
    assert_eq!(
        list["files"].as_array().unwrap().len(),
        1,
        "only sub/ok.txt: {list}"
    );
    assert_eq!(list["files"][0]["path"], "sub/ok.txt");
    let passwd = std::fs::read("/etc/passwd").unwrap();
    for path in [
        "leak.txt",
        "root/etc/passwd",
        "subway/ok.txt",
        "..%2F..%2F..%2F..%2F..%2Fetc%2Fpasswd",
        "%2e%2e/%2e%2e/{other}/work/secret.txt",
        "../{other}/work/secret.txt",
        "%2Fetc%2Fpasswd",
    ] {
        let path = path.replace("{other}", &other);
        let (status, _, body) = fetch(&d, &format!("/v1/tasks/{id}/files/{path}")).await;
        let text = String::from_utf8_lossy(&body);
        assert!(status == 404 || status == 400, "{path}: {status} {text}");
        assert!(
            !text.contains("root:") && !text.contains("private"),
            "{path}: {text}"
        );
        assert_ne!(body, passwd);
    }
    let (status, _, body) = fetch(&d, &format!("/v1/tasks/{id}/files/leak.txt")).await;
    assert_eq!(status, 404);
    assert!(
        String::from_utf8_lossy(&body).contains(
            "`leak.txt` cannot be read: `leak.txt` is a symbolic link, not a regular file"
        ),
        "{}",
        String::from_utf8_lossy(&body)
    );
    // The whole workspace as tar carries the real file and none of what the links name.
    let (status, _, tarred) = fetch(&d, &format!("/v1/tasks/{id}/files?format=tar")).await;
    assert_eq!(status, 200);
    let names: Vec<String> = tar::Archive::new(&tarred[..])
        .entries()
        .unwrap()
        .map(|e| e.unwrap().path().unwrap().display().to_string())
        .collect();
    assert_eq!(names, vec!["sub", "sub/ok.txt"]);
    assert!(!String::from_utf8_lossy(&tarred).contains("root:x:0"));
    // A page served from a workspace cannot run in the browser.
    let (status, _, _) = fetch(&d, "/v1/tasks/nosuchtask/files").await;
    assert_eq!(status, 404);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_workspace_served_as_html_or_svg_is_not_run_by_the_browser() {
    let write = "printf '<script>alert(1)</script>' > page.html && \
                 printf '<svg xmlns=\"http://www.w3.org/2000/svg\"><script>alert(1)</script></svg>' > pic.svg && \
                 printf odd > \"$(printf 'd\\303\\251j\\303\\240\\nvu\\042.txt')\"";
    let server = ScriptedOpenAi::start(script([(
        "write",
        vec![sh(write), Reply::from("TERMINATE")],
    )]))
    .await
    .unwrap();
    let d = daemon(&server, &[], None).await;
    let id = d.submit(json!({"task": "write"})).await;
    d.wait_finished(&id, Duration::from_secs(60)).await;
    let (status, headers, _) = fetch(&d, &format!("/v1/tasks/{id}/files/page.html")).await;
    assert_eq!(status, 200);
    assert_eq!(headers["content-type"], "application/octet-stream");
    assert!(
        headers["content-disposition"]
            .to_str()
            .unwrap()
            .starts_with("attachment")
    );
    let (status, headers, _) = fetch(&d, &format!("/v1/tasks/{id}/files/pic.svg")).await;
    assert_eq!(status, 200);
    assert_eq!(headers["content-type"], "image/svg+xml");
    let csp = headers["content-security-policy"].to_str().unwrap();
    assert!(
        csp.contains("sandbox") && csp.contains("default-src 'none'"),
        "{csp}"
    );
    // A name no header can carry as it is still downloads, under a name that can.
    let (status, headers, body) = fetch(
        &d,
        &format!("/v1/tasks/{id}/files/d%C3%A9j%C3%A0%0Avu%22.txt"),
    )
    .await;
    assert_eq!(status, 200, "{}", String::from_utf8_lossy(&body));
    assert_eq!(body, b"odd");
    assert_eq!(
        headers["content-disposition"],
        "inline; filename=\"d_j__vu_.txt\""
    );
    // And the SVG the block wrote was told as a picture.
    let events = d.events(&id, 0).await;
    let pictures: Vec<_> = artifacts(&events)
        .iter()
        .map(|a| a.file.to_owned())
        .collect();
    assert_eq!(pictures, vec!["pic.svg"]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn finished_tasks_files_are_removed_after_their_time_and_the_store_says_so() {
    let server = ScriptedOpenAi::start(script([(
        "write",
        vec![sh("echo kept > out.txt"), Reply::from("TERMINATE")],
    )]))
    .await
    .unwrap();
    let d = daemon(&server, &[], Some("[files]\nkeep_secs = 2\n")).await;
    let id = d.submit(json!({"task": "write"})).await;
    d.wait_finished(&id, Duration::from_secs(60)).await;
    let dir = d.state_dir().join(format!("files/tasks/{id}"));
    let started = Instant::now();
    loop {
        let (status, _, body) = fetch(&d, &format!("/v1/tasks/{id}/files/out.txt")).await;
        if status == 410 {
            let text = String::from_utf8_lossy(&body);
            assert!(text.contains("were removed"), "{text}");
            break;
        }
        assert_eq!(status, 200, "{}", String::from_utf8_lossy(&body));
        assert!(started.elapsed() < Duration::from_secs(60), "never removed");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert!(!dir.exists(), "{}", dir.display());
    let record = d.task(&id).await;
    assert!(record.record.files_removed_ms.is_some(), "{record:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn past_the_space_cap_the_oldest_finished_workspace_goes_first() {
    let server = ScriptedOpenAi::start(script([
        (
            "first",
            vec![
                sh("head -c 700000 /dev/zero > a.bin"),
                Reply::from("TERMINATE"),
            ],
        ),
        (
            "second",
            vec![
                sh("head -c 700000 /dev/zero > b.bin"),
                Reply::from("TERMINATE"),
            ],
        ),
    ]))
    .await
    .unwrap();
    let d = daemon(&server, &[], Some("[files]\nmax_total_mb = 1\n")).await;
    let first = d.submit(json!({"task": "first"})).await;
    d.wait_finished(&first, Duration::from_secs(60)).await;
    let second = d.submit(json!({"task": "second"})).await;
    d.wait_finished(&second, Duration::from_secs(60)).await;
    let started = Instant::now();
    while d.task(&first).await.record.files_removed_ms.is_none() {
        assert!(started.elapsed() < Duration::from_secs(60), "never removed");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    // The newer one stays: the two together were over the cap, one alone is not.
    let (status, _, body) = fetch(&d, &format!("/v1/tasks/{second}/files/b.bin")).await;
    assert_eq!(status, 200);
    assert_eq!(body.len(), 700_000);
    assert!(d.task(&second).await.record.files_removed_ms.is_none());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tandem_submit_and_run_send_their_files_to_the_daemon() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("n.txt"), "21\n").unwrap();
    let told = "double it\n\nFiles in your working directory (the current directory):\n\
                - n.txt (3 bytes)\n    21";
    let server = ScriptedOpenAi::start(script([(
        told,
        vec![
            python("print(2 * int(open('n.txt').read()))"),
            Reply::from("TERMINATE"),
        ],
    )]))
    .await
    .unwrap();
    let d = daemon(&server, &[], None).await;
    let n = dir.path().join("n.txt");
    for command in ["submit", "run"] {
        let mut args = vec![
            command,
            "double it",
            "--file",
            n.to_str().unwrap(),
            "--json",
        ];
        if command == "submit" {
            args.push("--wait");
        }
        let (code, out, err) = d.cli(&args).await;
        assert_eq!(code, 0, "{command}: {err}\n{out}");
        assert!(!err.contains("running in this process"), "{command}: {err}");
        assert!(out.contains(r#""stdout":"42\n""#), "{command}: {out}");
    }
    // Both ran on the daemon.
    assert_eq!(tasks(&d).await.len(), 2);
    // A link in a directory given is sent as a link, and the daemon refuses it by name.
    let linked = dir.path().join("linked");
    std::fs::create_dir(&linked).unwrap();
    std::os::unix::fs::symlink("/", linked.join("root")).unwrap();
    let (code, _, err) = d
        .cli(&["submit", "double it", "--file", linked.to_str().unwrap()])
        .await;
    assert_eq!(code, 2, "{err}");
    assert!(
        err.contains("--file: the upload was refused: `linked/root` is a symbolic link"),
        "{err}"
    );
    assert_eq!(tasks(&d).await.len(), 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mcp_gives_files_to_code_and_tasks_and_returns_their_pictures() {
    use tandem_tests::McpHttp;
    // A 1x1 PNG, as the block copies it: the picture that comes back must be these bytes.
    let png: &[u8] = b"\x89PNG\r\n\x1a\n\0\0\0\rIHDR\0\0\0\x01\0\0\0\x01\x08\x06\0\0\0\x1f\x15\xc4\x89\0\0\0\rIDATx\x9cc\xf8\xff\xff?\0\x05\xfe\x02\xfe\xa7\x35\x81\x84\0\0\0\0IEND\xaeB`\x82";
    let encoded = base64_of(png);
    let told = "copy the dot\n\nFiles in your working directory (the current directory):\n\
                - in/dot.png (69 bytes)\n- note.txt (6 bytes)\n    hello!";
    let server = ScriptedOpenAi::start(script([(
        told,
        vec![
            sh("cp in/dot.png out.png && cat note.txt"),
            Reply::from("Copied.\nTERMINATE"),
        ],
    )]))
    .await
    .unwrap();
    let d = daemon(&server, &[], None).await;
    let mcp = McpHttp::connect(&d).await.unwrap();
    let files = json!([
        {"path": "in/dot.png", "base64": encoded},
        {"path": "note.txt", "text": "hello!"}
    ]);
    // execute_code: the files are there for the block, and what it draws comes back.
    let result = mcp
        .call_tool(
            "execute_code",
            json!({"language": "sh", "code": "cp in/dot.png copy.png && cat note.txt", "files": files}),
        )
        .await;
    assert_eq!(result["isError"], false, "{result}");
    assert_eq!(result["structuredContent"]["stdout"], "hello!");
    let image = &result["content"][1];
    assert_eq!(image["type"], "image", "{result}");
    assert_eq!(image["mimeType"], "image/png");
    assert_eq!(image["data"], encoded);
    // run_task: the same, through a task's workspace.
    let result = mcp
        .call_tool("run_task", json!({"task": "copy the dot", "files": files}))
        .await;
    assert_eq!(result["isError"], false, "{result}");
    let structured = &result["structuredContent"];
    assert_eq!(structured["stop_reason"], "terminated", "{result}");
    let id = structured["task_id"].as_str().unwrap();
    let uri = format!("tandem://tasks/{id}/files/out.png");
    assert_eq!(structured["pictures"][0]["uri"], uri.as_str());
    // What the task made (not the files it was given and left alone) is named, as resources.
    assert_eq!(
        structured["files"],
        json!([{"path": "out.png", "bytes": 69, "uri": uri}]),
        "{result}"
    );
    assert!(
        result["content"][0]["text"]
            .as_str()
            .unwrap()
            .ends_with(&format!("(the task made 1 file: {uri})")),
        "{result}"
    );
    let image = result["content"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["type"] == "image")
        .unwrap_or_else(|| panic!("no image: {result}"));
    assert_eq!(image["data"], encoded);
    // The task's files are resources; a path out of the workspace is not.
    let read = mcp.request("resources/read", json!({"uri": uri})).await;
    assert_eq!(read["contents"][0]["blob"], encoded, "{read}");
    let note = mcp
        .request(
            "resources/read",
            json!({"uri": format!("tandem://tasks/{id}/files/note.txt")}),
        )
        .await;
    assert_eq!(note["contents"][0]["text"], "hello!", "{note}");
    for bad in ["../../../../etc/passwd", "/etc/passwd"] {
        let read = mcp
            .request(
                "resources/read",
                json!({"uri": format!("tandem://tasks/{id}/files/{bad}")}),
            )
            .await;
        assert!(read["error"]["message"].is_string(), "{bad}: {read}");
        assert!(!read.to_string().contains("root:"), "{bad}: {read}");
    }
    // Files that could not be placed are refused by name, and nothing runs.
    for (files, says) in [
        (json!([{"path": "../up.txt", "text": "x"}]), "up.txt"),
        (
            json!([{"path": "a.txt"}]),
            "give exactly one of `text` and `base64`",
        ),
        (
            json!([{"path": "a.bin", "base64": "***"}]),
            "base64 does not decode",
        ),
    ] {
        let result = mcp
            .call_tool(
                "execute_code",
                json!({"language": "sh", "code": "echo ran", "files": files}),
            )
            .await;
        assert_eq!(result["isError"], true, "{result}");
        let text = result["content"][0]["text"].as_str().unwrap();
        assert!(text.contains(says), "{text}");
        assert!(!text.contains("ran"), "{text}");
    }
}

fn base64_of(bytes: &[u8]) -> String {
    const ABC: &[u8] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let mut out = String::new();
    for chunk in bytes.chunks(3) {
        let n = chunk
            .iter()
            .enumerate()
            .fold(0u32, |n, (i, b)| n | u32::from(*b) << (16 - 8 * i));
        for i in 0..4 {
            if i <= chunk.len() {
                out.push(ABC[(n >> (18 - 6 * i) & 63) as usize] as char);
            } else {
                out.push('=');
            }
        }
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_figure_shown_in_a_kept_interpreter_comes_back_as_a_picture() {
    let server = ScriptedOpenAi::start(script([(
        "show it",
        vec![
            python("import matplotlib.pyplot as plt\nplt.plot([1, 3, 2])\nplt.show()"),
            python("plt.figure()\nplt.bar(['a', 'b'], [2, 5])\nplt.show()"),
            Reply::from("TERMINATE"),
        ],
    )]))
    .await
    .unwrap();
    let d = daemon(&server, &["--executor", "docker"], None).await;
    let id = d
        .submit(json!({"task": "show it", "keep_state": true}))
        .await;
    let record = d.wait_finished(&id, Duration::from_secs(120)).await;
    let events = d.events(&id, 0).await;
    assert_eq!(
        record.record.stop_reason,
        Some(StopReason::Terminated),
        "{record:?}\n{events:#?}"
    );
    let shown: Vec<(u32, &str)> = artifacts(&events)
        .into_iter()
        .map(|a| (a.turn, a.file))
        .collect();
    // One figure a turn, each under a name of its own.
    assert_eq!(
        shown,
        vec![(1, "figure-1.png"), (2, "figure-2.png")],
        "{events:#?}"
    );
    for (_, path) in shown {
        let (status, _, png) = fetch(&d, &format!("/v1/tasks/{id}/files/{path}")).await;
        assert_eq!(status, 200);
        assert!(png.starts_with(b"\x89PNG"), "{path}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn what_a_person_sees_of_files_and_pictures() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("n.txt"), "21\n").unwrap();
    let told = "draw it\n\nFiles in your working directory (the current directory):\n\
                - n.txt (3 bytes)\n    21";
    let svg =
        "printf '<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"4\" height=\"4\"/>' > dot.svg";
    let server = ScriptedOpenAi::start(script([(
        told,
        vec![sh(svg), Reply::from("Drawn.\nTERMINATE")],
    )]))
    .await
    .unwrap();
    let d = daemon(&server, &[], None).await;
    let n = dir.path().join("n.txt");
    let (code, transcript, err) = d
        .cli(&["submit", "draw it", "--file", n.to_str().unwrap(), "--wait"])
        .await;
    assert_eq!(code, 0, "{err}");
    let id = tasks(&d).await[0].id.clone();
    let (code, files, err) = d.cli(&["files", &id]).await;
    assert_eq!(code, 0, "{err}");
    let (code, _, refused) = d
        .cli(&["files", &id, "--get", "../n.txt", "-o", "/dev/null"])
        .await;
    assert_eq!(code, 2);
    let mut s = insta::Settings::clone_current();
    s.add_filter(r"cpu \d+\.\d+ s", "cpu [N] s");
    s.add_filter(r"(peak|disk) \d+(\.\d)? [kMGT]?B", "$1 [BYTES]");
    s.add_filter(r"\d+ ms", "[N] ms");
    s.add_filter(r"\d+\.\d s", "[N] s");
    s.add_filter(r"\d+ in / \d+ out tokens", "[N] in / [N] out tokens");
    s.add_filter(r"127\.0\.0\.1:\d+", "127.0.0.1:[PORT]");
    s.add_filter(&id, "[ID]");
    s.add_filter(r"unix://\S+\.sock", "unix://[SOCKET]");
    s.set_prepend_module_to_snapshot(false);
    s.bind(|| {
        insta::assert_snapshot!(
            "files_seen",
            format!("$ tandem submit --file n.txt --wait\n{transcript}\n$ tandem files ID\n{files}\n$ tandem files ID --get ../n.txt\n{refused}")
        )
    });
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_figure_shown_by_a_fresh_docker_block_comes_back_as_a_picture() {
    let server = ScriptedOpenAi::start(script([(
        "show it fresh",
        vec![
            python(
                "import matplotlib.pyplot as plt\nplt.plot([1, 3, 2])\nplt.show()\n\
                 plt.figure()\nplt.bar(['a', 'b'], [2, 5])\nplt.show()\nprint('drawn')",
            ),
            python("import matplotlib.pyplot as plt\nplt.plot([3, 1])\nplt.show()\nraise SystemExit(3)"),
            Reply::from("TERMINATE"),
        ],
    )]))
    .await
    .unwrap();
    let d = daemon(&server, &["--executor", "docker"], None).await;
    let id = d.submit(json!({"task": "show it fresh"})).await;
    let record = d.wait_finished(&id, Duration::from_secs(120)).await;
    let events = d.events(&id, 0).await;
    assert_eq!(
        record.record.stop_reason,
        Some(StopReason::Terminated),
        "{record:?}\n{events:#?}"
    );
    let shown: Vec<(u32, &str)> = artifacts(&events)
        .into_iter()
        .map(|a| (a.turn, a.file))
        .collect();
    assert_eq!(
        shown,
        vec![
            (1, "figure-1.png"),
            (1, "figure-2.png"),
            (2, "figure-3.png")
        ],
        "{events:#?}"
    );
    // The block's own output and exit code are as `python3 script` gives them.
    let results: Vec<(String, Option<i32>)> = block_results(&events)
        .into_iter()
        .map(|r| (r.stdout.clone(), r.exit_code))
        .collect();
    assert_eq!(
        results,
        vec![("drawn\n".to_owned(), Some(0)), (String::new(), Some(3))]
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mcp_run_task_keeps_state_when_asked_and_is_refused_where_it_cannot() {
    use tandem_tests::McpHttp;
    let server = ScriptedOpenAi::start(script([(
        "keep over mcp",
        vec![
            python("x = 6 * 7"),
            python("print(x)"),
            Reply::from("TERMINATE"),
        ],
    )]))
    .await
    .unwrap();
    let d = daemon(&server, &[], None).await;
    let mcp = McpHttp::connect(&d).await.unwrap();
    let result = mcp
        .call_tool(
            "run_task",
            json!({"task": "keep over mcp", "keep_state": true, "executor": "local"}),
        )
        .await;
    assert_eq!(result["isError"], false, "{result}");
    let id = result["structuredContent"]["task_id"]
        .as_str()
        .unwrap()
        .to_owned();
    let events = d.events(&id, 0).await;
    let printed: Vec<&str> = block_results(&events)
        .into_iter()
        .map(|r| r.stdout.as_str())
        .collect();
    assert_eq!(printed, vec!["", "42\n"], "{events:#?}");
    let refused = mcp
        .call_tool(
            "run_task",
            json!({"task": "keep over mcp", "keep_state": true, "executor": "wasm"}),
        )
        .await;
    assert_eq!(refused["isError"], true, "{refused}");
    let text = refused["content"][0]["text"].as_str().unwrap();
    assert!(
        text.contains("keep_state: the wasm executor cannot keep a Python interpreter"),
        "{text}"
    );
}

/// A stand-in for matplotlib's pyplot, given to a task as files: the local executor's Python
/// has no matplotlib here, and what is tested is Tandem's hook, not matplotlib.
const FAKE_PYPLOT: &str = "_open = []\n\
def plot(*a):\n    _open.append(len(_open) + 1)\n\
def show():\n    pass\n\
def get_fignums():\n    return list(_open)\n\
class _Figure:\n    def savefig(self, name):\n        open(name, 'wb').write(b'\\x89PNG\\r\\n\\x1a\\n')\n\
def figure(num=None):\n    return _Figure()\n\
def close(num):\n    _open.remove(num)\n";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_figure_shown_by_a_local_block_fresh_or_kept_comes_back_as_a_picture() {
    let drawn = "import matplotlib.pyplot as plt\nplt.plot([1])\nplt.show()";
    let left_open = "import matplotlib.pyplot as plt\nplt.plot([2])";
    let mut replies = Vec::new();
    for task in ["local fresh", "local kept"] {
        replies.push((
            task,
            vec![python(drawn), python(left_open), Reply::from("TERMINATE")],
        ));
    }
    let entries = [
        (
            "matplotlib/__init__.py",
            tar::EntryType::Regular,
            &b""[..],
            None,
        ),
        (
            "matplotlib/pyplot.py",
            tar::EntryType::Regular,
            FAKE_PYPLOT.as_bytes(),
            None,
        ),
    ];
    let told = |task: &str| {
        format!(
            "{task}\n\nFiles in your working directory (the current directory):\n\
             - matplotlib/__init__.py (0 bytes)\n- matplotlib/pyplot.py ({} bytes)\n    _open = []\n    def plot(*a):\n        _open.append(len(_open) + 1)\n    def show():\n        pass",
            FAKE_PYPLOT.len()
        )
    };
    let script: tandem_tests::Script = replies
        .into_iter()
        .map(|(task, r)| (told(task), r))
        .collect();
    let server = ScriptedOpenAi::start(script).await.unwrap();
    let d = daemon(&server, &[], None).await;
    for (task, keep) in [("local fresh", false), ("local kept", true)] {
        let (status, up) = upload(&d, archive(&entries)).await;
        assert_eq!(status, 201, "{up}");
        let id = d
            .submit(json!({"task": task, "files": up["id"], "keep_state": keep}))
            .await;
        let record = d.wait_finished(&id, Duration::from_secs(60)).await;
        let events = d.events(&id, 0).await;
        assert_eq!(
            record.record.stop_reason,
            Some(StopReason::Terminated),
            "{task}: {record:?}\n{events:#?}"
        );
        // Shown: a picture; drawn and left unshown: none.
        let shown: Vec<(u32, &str)> = artifacts(&events)
            .into_iter()
            .map(|a| (a.turn, a.file))
            .collect();
        assert_eq!(shown, vec![(1, "figure-1.png")], "{task}: {events:#?}");
    }
}

/// Bytes of the regular files the process `pid` holds open, as allocated on disk (a sparse
/// file weighs its blocks, as `du` counts), each file once; and how many of its descriptors
/// name a file called `name`. A temporary file removed while open is counted here too.
fn held_open(pid: u32, name: &str) -> (u64, usize) {
    use std::os::unix::fs::MetadataExt;
    let mut seen = std::collections::HashSet::new();
    let (mut bytes, mut named) = (0, 0);
    for fd in std::fs::read_dir(format!("/proc/{pid}/fd"))
        .unwrap()
        .flatten()
    {
        let Ok(target) = std::fs::read_link(fd.path()) else {
            continue;
        };
        if target.file_name().is_some_and(|n| n == name) {
            named += 1;
        }
        let Ok(meta) = std::fs::metadata(fd.path()) else {
            continue;
        };
        if meta.is_file() && seen.insert((meta.dev(), meta.ino())) {
            bytes += meta.blocks() * 512;
        }
    }
    (bytes, named)
}

/// Asks for `path` and reads its first bytes, then reads no more: the answer, held open.
async fn stall(http: reqwest::Client, path: String) -> reqwest::Response {
    let mut resp = http
        .get(format!("http://tandem{path}"))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200, "{path}");
    let first = resp.chunk().await.unwrap().unwrap();
    assert!(!first.is_empty());
    resp
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stalled_tar_downloads_of_a_sparse_gigabyte_hold_no_disk_and_let_go_when_clients_leave() {
    use tandem_daemon::files::{MAX_PACKS, PACK_STALL};
    let server = ScriptedOpenAi::start(script([
        (
            "sparse",
            vec![
                sh("truncate -s 1G big.bin && echo made"),
                Reply::from("TERMINATE"),
            ],
        ),
        (
            "small",
            vec![sh("echo hi > small.txt"), Reply::from("TERMINATE")],
        ),
    ]))
    .await
    .unwrap();
    let d = daemon(&server, &[], None).await;
    let big = d.submit(json!({"task": "sparse"})).await;
    d.wait_finished(&big, Duration::from_secs(60)).await;
    let events = d.events(&big, 0).await;
    assert_eq!(block_results(&events)[0].stdout, "made\n", "{events:#?}");
    let small = d.submit(json!({"task": "small"})).await;
    d.wait_finished(&small, Duration::from_secs(60)).await;
    let pid = d.pid();
    // Far below one pack of the gigabyte, far above what the daemon holds open otherwise.
    let bound: u64 = 256 << 20;
    let tar = format!("/v1/tasks/{big}/files?format=tar");
    // Eight clients ask for the gigabyte as tar at once, read its first bytes, then stall.
    let asks: Vec<_> = (0..8)
        .map(|_| tokio::spawn(stall(d.http().clone(), tar.clone())))
        .collect();
    let started = Instant::now();
    while !asks.iter().all(|a| a.is_finished()) {
        let (held, _) = held_open(pid, "big.bin");
        assert!(
            held < bound,
            "the daemon holds {held} bytes of files on disk for 8 downloads"
        );
        assert!(
            started.elapsed() < Duration::from_secs(120),
            "the downloads never began"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let mut holders = Vec::new();
    for ask in asks {
        holders.push(ask.await.unwrap());
    }
    let stalled_since = Instant::now();
    // While they hold their answers: the daemon holds no packs on disk, is alive, and serves
    // another client's download in full.
    let (held, reading) = held_open(pid, "big.bin");
    assert!(held < bound, "{held} bytes held for 8 stalled downloads");
    assert!(reading <= 8, "{reading} reads of big.bin");
    assert_eq!(d.get("/healthz").await["status"], "ok");
    let (status, _, tarred) = fetch(&d, &format!("/v1/tasks/{small}/files?format=tar")).await;
    assert_eq!(status, 200);
    let mut archive = tar::Archive::new(&tarred[..]);
    let mut entry = archive.entries().unwrap().next().unwrap().unwrap();
    assert_eq!(entry.path().unwrap().to_str(), Some("small.txt"));
    let mut text = String::new();
    std::io::Read::read_to_string(&mut entry, &mut text).unwrap();
    assert_eq!(text, "hi\n");
    let (status, _, body) = fetch(&d, &format!("/v1/tasks/{small}/files/small.txt")).await;
    assert_eq!((status, body), (200, b"hi\n".to_vec()));
    // Past the daemon's bound on downloads packed at once, one more is refused, saying why
    // and when to come back, rather than wait without end.
    for _ in 8..MAX_PACKS {
        holders.push(stall(d.http().clone(), tar.clone()).await);
    }
    let resp = d
        .http()
        .get(format!("http://tandem{tar}"))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 429);
    assert!(resp.headers().contains_key("retry-after"), "{resp:?}");
    let refusal: Value = resp.json().await.unwrap();
    let message = refusal["error"]["message"].as_str().unwrap();
    assert!(
        message.contains(&format!("{MAX_PACKS} workspace downloads")),
        "{message}"
    );
    let (held, _) = held_open(pid, "big.bin");
    assert!(
        held < bound,
        "{held} bytes held for {MAX_PACKS} stalled downloads"
    );
    // The clients leave: each pack stops at once and gives back its place, well before a
    // stalled one would be cut off.
    drop(holders);
    loop {
        let (held, reading) = held_open(pid, "big.bin");
        if reading == 0 {
            assert!(held < bound, "{held} bytes held after the clients left");
            break;
        }
        assert!(
            stalled_since.elapsed() < PACK_STALL,
            "{reading} packs still read big.bin after their clients left"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // And the whole gigabyte still downloads, as a tar archive.
    let mut resp = d
        .http()
        .get(format!("http://tandem{tar}"))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    let (mut total, mut head, mut tail) = (0u64, Vec::new(), Vec::new());
    while let Some(chunk) = resp.chunk().await.unwrap() {
        if head.len() < 512 {
            head.extend_from_slice(&chunk[..chunk.len().min(512 - head.len())]);
        }
        total += chunk.len() as u64;
        tail.extend_from_slice(&chunk);
        let keep = tail.len().saturating_sub(1024);
        tail.drain(..keep);
    }
    assert!(head.starts_with(b"big.bin\0"), "{:?}", &head[..16]);
    assert_eq!(
        total,
        512 + (1 << 30) + 1024,
        "header, the file, the end blocks"
    );
    assert!(tail.iter().all(|b| *b == 0));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hundred_session_puts_keep_no_upload_and_leave_uploads_to_others() {
    let told = "double it\n\nFiles in your working directory (the current directory):\n\
                - n.txt (3 bytes)\n    21";
    let server = ScriptedOpenAi::start(script([(
        told,
        vec![
            python("print(2 * int(open('n.txt').read()))"),
            Reply::from("TERMINATE"),
        ],
    )]))
    .await
    .unwrap();
    let d = daemon(&server, &[], Some("[policy]\nexecutors = [\"local\"]\n")).await;
    let (status, opened) = d
        .send(
            reqwest::Method::POST,
            "/v1/sessions",
            Some(json!({"executor": "local"}).to_string()),
        )
        .await;
    assert_eq!(status, 201, "{opened}");
    let session = opened["id"].as_str().unwrap();
    for i in 0..100 {
        let body = format!("{i}");
        let resp = d
            .http()
            .post(format!("http://tandem/v1/sessions/{session}/files"))
            .header("content-type", "application/x-tar")
            .body(archive(&[(
                &format!("put/{i}.txt"),
                tar::EntryType::Regular,
                body.as_bytes(),
                None,
            )]))
            .send()
            .await
            .unwrap();
        let status = resp.status().as_u16();
        let answer: Value = resp.json().await.unwrap_or(Value::Null);
        assert_eq!(status, 201, "put {i}: {answer}");
        assert_eq!(answer["files"][0]["path"], format!("put/{i}.txt"));
    }
    // Every file arrived in the session, and nothing of them waits as an upload.
    let listed = d.get(&format!("/v1/sessions/{session}/files")).await;
    let mut paths: Vec<&str> = listed["files"]
        .as_array()
        .unwrap()
        .iter()
        .map(|f| f["path"].as_str().unwrap())
        .collect();
    paths.sort();
    let mut wanted: Vec<String> = (0..100).map(|i| format!("put/{i}.txt")).collect();
    wanted.sort();
    assert_eq!(paths, wanted);
    let (status, _, body) = fetch(&d, &format!("/v1/sessions/{session}/files/put/42.txt")).await;
    assert_eq!((status, body), (200, b"42".to_vec()));
    assert_eq!(
        tree(&d.state_dir().join("files/uploads")),
        Vec::<String>::new()
    );
    // Another client's upload is taken, and a task given it runs.
    let (status, up) = upload(
        &d,
        archive(&[("n.txt", tar::EntryType::Regular, b"21\n", None)]),
    )
    .await;
    assert_eq!(status, 201, "{up}");
    let id = d
        .submit(json!({"task": "double it", "files": up["id"]}))
        .await;
    let record = d.wait_finished(&id, Duration::from_secs(60)).await;
    let events = d.events(&id, 0).await;
    assert_eq!(
        record.record.stop_reason,
        Some(StopReason::Terminated),
        "{record:?}\n{events:#?}"
    );
    assert_eq!(block_results(&events)[0].stdout, "42\n");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stalled_file_downloads_past_the_daemons_blocking_threads_leave_it_serving() {
    // More clients than the daemon has blocking threads (tokio's 512), each reading the first
    // bytes of a file and no more.
    const CLIENTS: usize = 600;
    let server = ScriptedOpenAi::start(script([(
        "write",
        vec![
            sh("truncate -s 16M f.bin && echo hi > small.txt"),
            Reply::from("TERMINATE"),
        ],
    )]))
    .await
    .unwrap();
    let d = daemon(&server, &[], None).await;
    let id = d.submit(json!({"task": "write"})).await;
    d.wait_finished(&id, Duration::from_secs(60)).await;
    let path = format!("/v1/tasks/{id}/files/f.bin");
    let asks: Vec<_> = (0..CLIENTS)
        .map(|_| tokio::spawn(stall(d.http().clone(), path.clone())))
        .collect();
    let started = Instant::now();
    while !asks.iter().all(|a| a.is_finished()) && started.elapsed() < Duration::from_secs(120) {
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // While they hold their answers, the daemon reads its store and serves another file.
    let listed = tokio::time::timeout(Duration::from_secs(30), d.tasks("/v1/tasks"))
        .await
        .unwrap_or_else(|_| {
            panic!("GET /v1/tasks did not answer in 30 s while {CLIENTS} downloads stalled")
        });
    assert_eq!(listed.tasks.len(), 1);
    let small = format!("/v1/tasks/{id}/files/small.txt");
    let (status, _, body) = tokio::time::timeout(Duration::from_secs(30), fetch(&d, &small))
        .await
        .unwrap_or_else(|_| panic!("{small} did not answer in 30 s"));
    assert_eq!((status, body), (200, b"hi\n".to_vec()));
    let began = asks.iter().filter(|a| a.is_finished()).count();
    assert_eq!(began, CLIENTS, "downloads that began");
    let mut holders = Vec::new();
    for ask in asks {
        holders.push(ask.await.unwrap());
    }
    drop(holders);
    assert_eq!(d.get("/healthz").await["status"], "ok");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn uploads_that_stop_sending_give_their_turn_back_and_others_are_told_when_to_return() {
    use tandem_daemon::files::{MAX_RECEIVING, RECEIVE_STALL, RECEIVE_WAIT};
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let server = ScriptedOpenAi::start(script([("unused", vec![Reply::from("TERMINATE")])]))
        .await
        .unwrap();
    let d = daemon(&server, &[], None).await;
    let uploads = d.state_dir().join("files/uploads");
    // As many clients as the daemon receives archives at once start uploads, send one block
    // of a megabyte, then nothing, and keep their connections.
    let mut stalled = Vec::new();
    for _ in 0..MAX_RECEIVING {
        let mut s = tokio::net::UnixStream::connect(d.socket()).await.unwrap();
        s.write_all(
            b"POST /v1/uploads HTTP/1.1\r\nhost: tandem\r\ncontent-type: application/x-tar\r\n\
              content-length: 1048576\r\n\r\n",
        )
        .await
        .unwrap();
        s.write_all(&[0u8; 512]).await.unwrap();
        stalled.push(s);
    }
    // Each is being received once its file is on the daemon's disk.
    let started = Instant::now();
    while tree(&uploads).len() < MAX_RECEIVING {
        assert!(
            started.elapsed() < Duration::from_secs(60),
            "{:?}",
            tree(&uploads)
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // Another client's upload is not left waiting without end: it is refused, told when to
    // come back.
    let fine = archive(&[("ok.txt", tar::EntryType::Regular, b"fine", None)]);
    let asked = d
        .http()
        .post("http://tandem/v1/uploads")
        .header("content-type", "application/x-tar")
        .body(fine.clone())
        .send();
    let resp = tokio::time::timeout(RECEIVE_WAIT + Duration::from_secs(60), asked)
        .await
        .expect("the upload was neither taken nor refused")
        .unwrap();
    assert_eq!(resp.status(), 429);
    assert_eq!(
        resp.headers()["retry-after"],
        RECEIVE_WAIT.as_secs().to_string()
    );
    let refusal: Value = resp.json().await.unwrap();
    let message = refusal["error"]["message"].as_str().unwrap();
    assert!(
        message.contains(&format!("{MAX_RECEIVING} archives")),
        "{message}"
    );
    // The stalled ones are refused, saying why, and leave nothing behind.
    for mut s in stalled {
        let mut answer = Vec::new();
        let read = async {
            let mut buf = [0u8; 4096];
            while !answer.windows(4).any(|w| w == b"\r\n\r\n") {
                let n = s.read(&mut buf).await.unwrap();
                if n == 0 {
                    break;
                }
                answer.extend_from_slice(&buf[..n]);
            }
            let mut rest = vec![0u8; 4096];
            if let Ok(Ok(n)) = tokio::time::timeout(Duration::from_secs(5), s.read(&mut rest)).await
            {
                answer.extend_from_slice(&rest[..n]);
            }
        };
        tokio::time::timeout(RECEIVE_STALL + Duration::from_secs(60), read)
            .await
            .expect("a stalled upload was never refused");
        let text = String::from_utf8_lossy(&answer);
        assert!(text.starts_with("HTTP/1.1 400"), "{text}");
        assert!(text.contains("stalled"), "{text}");
    }
    assert_eq!(tree(&uploads), Vec::<String>::new());
    // Their places are free again.
    let (status, up) = upload(&d, fine).await;
    assert_eq!(status, 201, "{up}");
}
