//! Ports published through the daemon: a server a block leaves running in a Docker sandbox,
//! reached over the daemon's TCP API behind its token (or a signed link), in HTTP and in
//! WebSocket, and only while its sandbox lives.

use std::path::Path;
use std::time::{Duration, Instant};

use futures::{SinkExt, StreamExt};
use serde_json::json;
use tandem_tests::daemon::DaemonHarness;
use tandem_tests::{Reply, ScriptedOpenAi, script};
use tokio_tungstenite::tungstenite::Message;
use tokio_tungstenite::tungstenite::client::IntoClientRequest;

use crate::e2e::fence;

/// An HTTP server on port 8000 that says what it was asked (path, and the headers Tandem
/// must drop or add), echoes WebSocket messages on any upgrade, notes `/done` in the file
/// `served`, and logs every request to the stderr of the block that started it.
pub(crate) const APP: &str = r#"import base64, hashlib, http.server, socketserver, struct, sys
class H(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    def do_GET(self):
        if self.headers.get("Upgrade", "").lower() == "websocket":
            return self.echo()
        if self.path.startswith("/done"):
            open("served", "w").close()
        body = ("hello from the sandbox\npath %s\nauthorization %s\nprefix %s\n" % (
            self.path, self.headers.get("Authorization"), self.headers.get("X-Forwarded-Prefix"))).encode()
        self.send_response(200)
        self.send_header("Content-Type", "text/plain")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
    def echo(self):
        key = self.headers["Sec-WebSocket-Key"] + "258EAFA5-E914-47DA-95CA-C5AB0DC85B11"
        self.send_response(101)
        self.send_header("Upgrade", "websocket")
        self.send_header("Connection", "Upgrade")
        self.send_header("Sec-WebSocket-Accept", base64.b64encode(hashlib.sha1(key.encode()).digest()).decode())
        self.end_headers()
        self.wfile.flush()
        self.close_connection = True
        while True:
            head = self.rfile.read(2)
            if len(head) < 2:
                return
            op, n = head[0] & 15, head[1] & 127
            if n == 126:
                n = struct.unpack(">H", self.rfile.read(2))[0]
            elif n == 127:
                n = struct.unpack(">Q", self.rfile.read(8))[0]
            mask = self.rfile.read(4) if head[1] & 128 else b"\0\0\0\0"
            data = bytes(b ^ mask[i % 4] for i, b in enumerate(self.rfile.read(n)))
            if op == 8:
                self.wfile.write(b"\x88\x00")
                self.wfile.flush()
                return
            if op in (1, 2):
                if n < 126:
                    size = bytes([n])
                elif n < 65536:
                    size = bytes([126]) + struct.pack(">H", n)
                else:
                    size = bytes([127]) + struct.pack(">Q", n)
                self.wfile.write(bytes([128 | op]) + size + data)
                self.wfile.flush()
    def log_message(self, *args):
        sys.stderr.write("request %s\n" % (args,))
        sys.stderr.flush()
class S(socketserver.ThreadingMixIn, http.server.HTTPServer):
    daemon_threads = True
    allow_reuse_address = True
S(("127.0.0.1", 8000), H).serve_forever()
"#;

/// The block that starts [`APP`] in the background and ends once it listens.
pub(crate) fn start_app() -> String {
    format!(
        "import socket, subprocess, sys, time\nwith open('app.py', 'w') as f:\n    f.write({APP:?})\nsubprocess.Popen([sys.executable, 'app.py'])\nfor _ in range(400):\n    try:\n        socket.create_connection(('127.0.0.1', 8000), timeout=1).close()\n        break\n    except OSError:\n        time.sleep(0.05)\nprint('serving on 8000')"
    )
}

/// A model that answers `task` with [`start_app`], then a block that waits (under a minute,
/// the default block timeout) for the test to visit `/done`, then ends.
pub(crate) async fn serving_model(task: &str) -> ScriptedOpenAi {
    let wait_for_visit = "import os, time\nfor _ in range(1100):\n    if os.path.exists('served'):\n        break\n    time.sleep(0.05)\nprint('visited' if os.path.exists('served') else 'never visited')";
    ScriptedOpenAi::start(script([(
        task,
        vec![
            Reply::Text(fence("python", &start_app())),
            Reply::Text(fence("python", wait_for_visit)),
            Reply::from("Served.\n\nTERMINATE"),
        ],
    )]))
    .await
    .unwrap()
}

async fn start(server: &ScriptedOpenAi, executor: &str) -> (DaemonHarness, String, String) {
    let addr = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .to_string();
    let daemon = DaemonHarness::start(
        Path::new(env!("CARGO_BIN_EXE_tandem")),
        &server.base_url(),
        &["--listen", &addr, "--executor", executor],
        None,
    )
    .await;
    let token = std::fs::read_to_string(daemon.state_dir().join("token"))
        .unwrap()
        .trim()
        .to_owned();
    (daemon, addr, token)
}

/// `GET http://addr{path}` over TCP, with the token or without: (status, headers, body).
async fn get(
    addr: &str,
    path: &str,
    token: Option<&str>,
) -> (u16, reqwest::header::HeaderMap, String) {
    let client = reqwest::Client::builder()
        .redirect(reqwest::redirect::Policy::none())
        .build()
        .unwrap();
    let mut req = client.get(format!("http://{addr}{path}"));
    if let Some(token) = token {
        req = req.bearer_auth(token);
    }
    let resp = req.send().await.unwrap();
    let (status, headers) = (resp.status().as_u16(), resp.headers().clone());
    (status, headers, resp.text().await.unwrap())
}

/// A WebSocket at `path` through the daemon says back what it is sent.
async fn websocket_echoes(addr: &str, path: &str, token: &str) {
    let mut request = format!("ws://{addr}{path}").into_client_request().unwrap();
    request
        .headers_mut()
        .insert("authorization", format!("Bearer {token}").parse().unwrap());
    let (mut ws, answer) = tokio::time::timeout(
        Duration::from_secs(60),
        tokio_tungstenite::connect_async(request),
    )
    .await
    .expect("the WebSocket handshake timed out")
    .expect("the WebSocket handshake failed");
    assert_eq!(answer.status().as_u16(), 101);
    for said in ["ping", &"x".repeat(70_000)] {
        ws.send(Message::text(said)).await.unwrap();
        let heard = tokio::time::timeout(Duration::from_secs(60), ws.next())
            .await
            .expect("no echo within a minute")
            .expect("the socket closed")
            .unwrap();
        assert_eq!(heard.into_text().unwrap().as_str(), said);
    }
    ws.close(None).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_a_session_leaves_running_is_served_behind_the_token_and_by_a_signed_link() {
    a_sessions_server_is_served("docker").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_a_local_session_leaves_running_is_served_and_kept_from_other_sessions() {
    a_sessions_server_is_served("local").await;
}

async fn a_sessions_server_is_served(executor: &str) {
    let server = ScriptedOpenAi::start(script([])).await.unwrap();
    let (daemon, addr, token) = start(&server, executor).await;
    let (status, session) = daemon
        .send(reqwest::Method::POST, "/v1/sessions", Some("{}".to_owned()))
        .await;
    assert_eq!(status, 201, "{session}");
    let sid = session["id"].as_str().unwrap().to_owned();
    let (status, ran) = daemon
        .send(
            reqwest::Method::POST,
            &format!("/v1/sessions/{sid}/exec"),
            Some(json!({"language": "python", "code": start_app()}).to_string()),
        )
        .await;
    assert_eq!(status, 200, "{ran}");
    assert_eq!(ran["stdout"], "serving on 8000\n", "{ran}");
    // A later block finds it still serving: it outlived its block.
    let (_, ran) = daemon
        .send(
            reqwest::Method::POST,
            &format!("/v1/sessions/{sid}/exec"),
            Some(json!({"language": "python", "code": "import urllib.request\nprint(urllib.request.urlopen('http://127.0.0.1:8000/again').read().decode().splitlines()[0])"}).to_string()),
        )
        .await;
    assert_eq!(ran["stdout"], "hello from the sandbox\n", "{ran}");

    let port = format!("/v1/sessions/{sid}/ports/8000");
    // Listed: the server's port, and none of Tandem's own.
    assert_eq!(
        daemon.get(&format!("/v1/sessions/{sid}/ports")).await,
        json!({"ports": [{"port": 8000, "path": format!("{port}/")}]})
    );
    // Without the token: 401, and the server is not asked.
    let (status, _, body) = get(&addr, &format!("{port}/"), None).await;
    assert_eq!(status, 401, "{body}");
    // With it: the server's answer, which never saw the token, in an origin of its own.
    let (status, headers, body) = get(&addr, &format!("{port}/a/b?c=d"), Some(&token)).await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(
        body,
        format!("hello from the sandbox\npath /a/b?c=d\nauthorization None\nprefix {port}/\n")
    );
    assert!(
        headers["content-security-policy"]
            .to_str()
            .unwrap()
            .starts_with("sandbox "),
        "{headers:?}"
    );
    // The bare port gets its slash, for the server's relative links.
    let (status, headers, _) = get(&addr, &port, Some(&token)).await;
    assert_eq!(status, 308);
    assert_eq!(headers["location"], format!("{port}/").as_str());
    // Many requests, after the block that started the server has long ended: its logging to
    // that block's stderr must not fail it.
    for i in 0..20 {
        let (status, _, body) = get(&addr, &format!("{port}/n{i}"), Some(&token)).await;
        assert_eq!(status, 200, "request {i}: {body}");
    }
    websocket_echoes(&addr, &format!("{port}/ws"), &token).await;

    // A port nothing listens on: 502, naming the port.
    let (status, _, body) = get(
        &addr,
        &format!("/v1/sessions/{sid}/ports/8001/"),
        Some(&token),
    )
    .await;
    assert_eq!(status, 502, "{body}");
    assert!(body.contains("port 8001"), "{body}");
    // Not a port: 400.
    let (status, _, body) = get(
        &addr,
        &format!("/v1/sessions/{sid}/ports/70000/"),
        Some(&token),
    )
    .await;
    assert_eq!(status, 400, "{body}");

    // A signed link opens the port without the token, and nothing else.
    let (status, link) = daemon
        .send(
            reqwest::Method::POST,
            &format!("/v1/sessions/{sid}/links"),
            Some(json!({"port": 8000, "ttl_secs": 600}).to_string()),
        )
        .await;
    assert_eq!(status, 200, "{link}");
    let url = link["url"].as_str().unwrap().to_owned();
    let (status, _, body) = get(&addr, &format!("{url}page"), None).await;
    assert_eq!(status, 200, "{body}");
    assert!(
        body.starts_with("hello from the sandbox\npath /page\n"),
        "{body}"
    );
    let forged = url.replacen(".8000.", ".8001.", 1);
    let (status, _, body) = get(&addr, &forged, None).await;
    assert_eq!(status, 401, "{body}");
    assert!(body.contains("signature"), "{body}");
    let (status, body) = daemon
        .send(
            reqwest::Method::POST,
            &format!("/v1/sessions/{sid}/links"),
            Some(json!({"port": 8000, "ttl_secs": 0}).to_string()),
        )
        .await;
    assert_eq!(status, 400, "{body}");

    // Another session's sandbox cannot reach this one's server.
    let (_, other) = daemon
        .send(reqwest::Method::POST, "/v1/sessions", Some("{}".to_owned()))
        .await;
    let other = other["id"].as_str().unwrap().to_owned();
    let (_, ran) = daemon
        .send(
            reqwest::Method::POST,
            &format!("/v1/sessions/{other}/exec"),
            Some(json!({"language": "python", "code": "import socket\ntry:\n    socket.create_connection(('127.0.0.1', 8000), timeout=5)\n    print('reached')\nexcept OSError as e:\n    print('refused')"}).to_string()),
        )
        .await;
    assert_eq!(ran["stdout"], "refused\n", "{ran}");
    // ...and has a port 8000 of its own: each server answers only through its session.
    let (_, ran) = daemon
        .send(
            reqwest::Method::POST,
            &format!("/v1/sessions/{other}/exec"),
            Some(json!({"language": "python", "code": start_app()}).to_string()),
        )
        .await;
    assert_eq!(ran["stdout"], "serving on 8000\n", "{ran}");
    let (status, _, body) = get(
        &addr,
        &format!("/v1/sessions/{other}/ports/8000/done"),
        Some(&token),
    )
    .await;
    assert_eq!(status, 200, "{body}");
    for (session, visited) in [(&other, "True"), (&sid, "False")] {
        let (_, ran) = daemon
            .send(
                reqwest::Method::POST,
                &format!("/v1/sessions/{session}/exec"),
                Some(json!({"language": "python", "code": "import os\nprint(os.path.exists('served'))"}).to_string()),
            )
            .await;
        assert_eq!(ran["stdout"], format!("{visited}\n"), "{session}: {ran}");
    }

    // Closed: the port, and the link, are gone.
    let (status, _) = daemon
        .send(
            reqwest::Method::DELETE,
            &format!("/v1/sessions/{sid}"),
            None,
        )
        .await;
    assert_eq!(status, 200);
    let (status, _, body) = get(&addr, &format!("{port}/"), Some(&token)).await;
    assert_eq!(status, 404, "{body}");
    let (status, _, body) = get(&addr, &url, None).await;
    assert_eq!(status, 404, "{body}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tasks_server_is_published_while_the_task_runs_and_gone_when_it_ends() {
    a_tasks_server_is_published("docker").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_local_tasks_server_is_published_while_the_task_runs_and_gone_when_it_ends() {
    a_tasks_server_is_published("local").await;
}

async fn a_tasks_server_is_published(executor: &str) {
    let task = "ports: serve on 8000";
    let server = serving_model(task).await;
    let (daemon, addr, token) = start(&server, executor).await;
    let id = daemon.submit(json!({"task": task})).await;
    let port = format!("/v1/tasks/{id}/ports/8000");
    // Reached as soon as the first block said it serves.
    let started = Instant::now();
    loop {
        let printed = daemon.block_stdouts(&id).await.join("");
        if printed.contains("serving on 8000") {
            break;
        }
        assert!(
            started.elapsed() < Duration::from_secs(300),
            "the server never started: {printed}\n{}",
            daemon.log()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let (status, _, body) = get(&addr, &format!("{port}/"), None).await;
    assert_eq!(status, 401, "{body}");
    assert_eq!(
        daemon.get(&format!("/v1/tasks/{id}/ports")).await["ports"][0]["port"],
        8000
    );
    let (status, _, body) = get(&addr, &format!("{port}/x"), Some(&token)).await;
    assert_eq!(status, 200, "{body}");
    assert!(
        body.starts_with("hello from the sandbox\npath /x\n"),
        "{body}"
    );
    websocket_echoes(&addr, &format!("{port}/ws"), &token).await;
    let (status, link) = daemon
        .send(
            reqwest::Method::POST,
            &format!("/v1/tasks/{id}/links"),
            Some(json!({"port": 8000}).to_string()),
        )
        .await;
    assert_eq!(status, 200, "{link}");
    let url = link["url"].as_str().unwrap().to_owned();
    // The visit the task's second block waits for.
    let (status, _, body) = get(&addr, &format!("{url}done"), None).await;
    assert_eq!(status, 200, "{body}");
    daemon.wait_finished(&id, Duration::from_secs(300)).await;
    let printed = daemon.block_stdouts(&id).await.join("");
    assert!(
        printed.contains("visited\n") && !printed.contains("never"),
        "{printed}"
    );
    // Its sandbox is gone, and its port with it.
    let (status, _, body) = get(&addr, &format!("{port}/"), Some(&token)).await;
    assert_eq!(status, 404, "{body}");
    let (status, _, body) = get(&addr, &url, None).await;
    assert_eq!(status, 404, "{body}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tandem_run_in_process_prints_a_loopback_link_when_a_port_opens_and_serves_it_while_it_runs()
 {
    use tokio::io::AsyncBufReadExt;

    let _ = rustls::crypto::ring::default_provider().install_default();
    let task = "ports: serve on 8000 here";
    let server = serving_model(task).await;
    let home = tempfile::tempdir().unwrap();
    let mut child = tokio::process::Command::new(env!("CARGO_BIN_EXE_tandem"))
        .args([
            "run",
            "-e",
            "docker",
            "--base-url",
            &server.base_url(),
            "--model",
            "m",
            "--out",
            "-",
            task,
        ])
        .current_dir(home.path())
        .env_remove("OPENAI_API_KEY")
        .env_remove("TANDEM_CONFIG")
        .env("XDG_CONFIG_HOME", home.path())
        .env("TANDEM_MODELS_DIR", home.path().join("no-models"))
        .env("TANDEM_HOST", "unix:///nonexistent/tandem.sock")
        .env("NO_COLOR", "1")
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let mut lines = tokio::io::BufReader::new(child.stderr.take().unwrap()).lines();
    let url = tokio::time::timeout(Duration::from_secs(300), async {
        while let Some(line) = lines.next_line().await.unwrap() {
            if let Some(rest) = line.strip_prefix("tandem: port 8000 is open: ") {
                return rest.split_whitespace().next().unwrap().to_owned();
            }
        }
        panic!("tandem ended without telling of port 8000");
    })
    .await
    .expect("no port was told within 300 s");
    assert!(url.starts_with("http://127.0.0.1:"), "{url}");
    // The link's path is the only way in: the bare address serves nothing.
    let base = url
        .trim_end_matches('/')
        .rsplit_once('/')
        .unwrap()
        .0
        .to_owned();
    let bare = reqwest::get(format!("{base}/done")).await.unwrap();
    assert_eq!(bare.status().as_u16(), 404);
    let page = reqwest::get(format!("{url}done")).await.unwrap();
    assert_eq!(page.status().as_u16(), 200);
    let body = page.text().await.unwrap();
    assert!(
        body.starts_with("hello from the sandbox\npath /done\n"),
        "{body}"
    );
    let rest = tokio::spawn(async move {
        let mut all = String::new();
        while let Ok(Some(line)) = lines.next_line().await {
            all.push_str(&line);
            all.push('\n');
        }
        all
    });
    let out = tokio::time::timeout(Duration::from_secs(300), child.wait_with_output())
        .await
        .expect("tandem hung")
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{stdout}\n{}", rest.await.unwrap());
    // The block's output, not its code (which names both words).
    assert!(stdout.contains("\nvisited\n── exit 0"), "{stdout}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_mcp_session_whose_block_leaves_a_server_is_answered_with_a_link_to_its_port() {
    let server = ScriptedOpenAi::start(script([])).await.unwrap();
    let (daemon, addr, _token) = start(&server, "docker").await;
    let mcp = tandem_tests::mcp::McpHttp::connect(&daemon).await.unwrap();
    let ran = mcp
        .call_tool(
            "execute_code",
            json!({"language": "python", "code": start_app(), "session_id": "web", "executor": "docker"}),
        )
        .await;
    let text = tandem_tests::mcp::text_of(&ran);
    let link = text
        .lines()
        .find_map(|l| l.strip_prefix("port 8000 is listening: the daemon serves it at "))
        .and_then(|rest| rest.split_whitespace().next())
        .unwrap_or_else(|| panic!("no link to port 8000: {ran}"))
        .to_owned();
    // The link opens the MCP connection's session, with no token.
    let (status, _, body) = get(&addr, &format!("{link}mcp"), None).await;
    assert_eq!(status, 200, "{body}");
    assert!(
        body.starts_with("hello from the sandbox\npath /mcp\n"),
        "{body}"
    );
    // A block that leaves no server gets no such line.
    let again = mcp
        .call_tool(
            "execute_code",
            json!({"language": "python", "code": "print(2)", "session_id": "other", "executor": "docker"}),
        )
        .await;
    assert!(!again.to_string().contains("is listening"), "{again}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_team_tasks_server_is_published_like_a_pairs() {
    let task = "ports: a team serves on 8000";
    let wait_for_visit = "import os, time\nfor _ in range(1100):\n    if os.path.exists('served'):\n        break\n    time.sleep(0.05)\nprint('visited' if os.path.exists('served') else 'never visited')";
    let server = ScriptedOpenAi::start(
        [
            (
                format!("{task}#coder"),
                vec![
                    Reply::Text(fence("python", &start_app())),
                    Reply::Text(fence("python", wait_for_visit)),
                ],
            ),
            (
                format!("{task}#reviewer"),
                vec![Reply::from("Go on."), Reply::from("It served. APPROVED")],
            ),
        ]
        .into_iter()
        .collect(),
    )
    .await
    .unwrap();
    let (daemon, addr, token) = start(&server, "local").await;
    let id = daemon
        .submit(json!({"task": task, "team": {
            "team": {"kind": "chat", "agents": ["coder", "runner", "reviewer"],
                     "termination": {"any": [{"mention": "APPROVED", "agents": ["reviewer"]}, {"max_turns": 12}]}},
            "agents": {"coder": {"kind": "assistant", "instructions": "coder"},
                       "runner": {"kind": "executor"},
                       "reviewer": {"kind": "assistant", "instructions": "reviewer"}}}}))
        .await;
    let started = Instant::now();
    while !daemon
        .block_stdouts(&id)
        .await
        .join("")
        .contains("serving on 8000")
    {
        assert!(
            started.elapsed() < Duration::from_secs(300),
            "the team's server never started\n{}",
            daemon.log()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(
        daemon.get(&format!("/v1/tasks/{id}/ports")).await["ports"][0]["port"],
        8000
    );
    let port = format!("/v1/tasks/{id}/ports/8000");
    let (status, _, body) = get(&addr, &format!("{port}/done"), Some(&token)).await;
    assert_eq!(status, 200, "{body}");
    daemon.wait_finished(&id, Duration::from_secs(300)).await;
    let printed = daemon.block_stdouts(&id).await.join("");
    assert!(
        printed.contains("visited\n") && !printed.contains("never"),
        "{printed}"
    );
    let (status, _, body) = get(&addr, &format!("{port}/"), Some(&token)).await;
    assert_eq!(status, 404, "{body}");
}

/// The next session's network namespace is made ahead of it by a spare holder, which takes
/// its session's word from a socket of the fork server's; a block hunts its descriptors for
/// that socket and, finding one, asks it for a namespace of its own. It must find none, and
/// the next session still gets its holder.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_local_block_cannot_reach_the_spare_holder_of_the_next_session() {
    let server = ScriptedOpenAi::start(script([])).await.unwrap();
    let (daemon, _addr, _token) = start(&server, "local").await;
    let hunt = r#"
import json, os, socket
kinds = []
for name in sorted(os.listdir("/proc/self/fd"), key=int):
    try:
        s = socket.socket(fileno=os.dup(int(name)))
    except OSError:
        continue
    kind = s.getsockopt(socket.SOL_SOCKET, socket.SO_TYPE)
    kinds.append(kind)
    if kind == socket.SOCK_SEQPACKET:
        a, b = socket.socketpair()
        s.settimeout(5)
        try:
            socket.send_fds(s, [json.dumps({"id": "forged", "egress": None}).encode()], [a.fileno()])
            msg, fds, _, _ = socket.recv_fds(s, 4096, 2)
            print("answered", msg, len(fds))
        except OSError as e:
            print("refused", e)
print("sockets", kinds)
"#;
    let mut printed = Vec::new();
    for _ in 0..2 {
        let (status, session) = daemon.open_session(json!({})).await;
        assert_eq!(status, 201, "{session}");
        let sid = session["id"].as_str().unwrap().to_owned();
        // The first block makes the session's holder; the spare is started after it.
        for code in ["print('first')", hunt, start_app().as_str()] {
            let ran = daemon.exec_python(&sid, code).await;
            printed.push(ran["stdout"].as_str().unwrap_or_default().to_owned());
        }
        // Each session's server is in a namespace of its own: the same port serves in both.
        assert_eq!(
            daemon.get(&format!("/v1/sessions/{sid}/ports")).await["ports"][0]["port"],
            8000,
            "{printed:?}"
        );
    }
    assert_eq!(
        printed,
        [
            "first\n",
            "sockets []\n",
            "serving on 8000\n",
            "first\n",
            "sockets []\n",
            "serving on 8000\n"
        ],
        "{}",
        daemon.log()
    );
}
