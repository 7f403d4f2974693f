//! A task's network through the egress proxy, on the CLI in process and on the daemon's API,
//! against servers in a network namespace the test makes (tandem_tests::internet).

use std::time::Duration;

use serde_json::{Value, json};
use tandem_tests::daemon::DaemonHarness;
use tandem_tests::internet::Internet;
use tandem_tests::{Reply, ScriptedOpenAi, script};

use crate::e2e::{fence, tandem};

const FETCH: &str = r#"import urllib.request, urllib.error
print(urllib.request.urlopen("http://files.test/hello", timeout=30).read().decode().splitlines()[0])
try:
    urllib.request.urlopen("http://other.test/", timeout=30)
except urllib.error.HTTPError as e:
    print("other:", e.code)"#;

fn replies() -> Vec<Reply> {
    vec![
        Reply::Text(fence("python", FETCH)),
        Reply::from("Fetched.\n\nTERMINATE"),
    ]
}

/// Each `net` event's host, verdict and rule, sorted: connections are recorded as they end.
fn verdicts<'a>(nets: impl Iterator<Item = &'a Value>) -> Vec<(String, String, String)> {
    let mut out: Vec<(String, String, String)> = nets
        .map(|n| {
            let text = |k: &str| n[k].as_str().unwrap_or_default().to_owned();
            (text("host"), text("verdict"), text("rule"))
        })
        .collect();
    out.sort();
    out
}

/// `tandem serve` with `args` and `config`, its model `server`.
async fn serve(server: &ScriptedOpenAi, args: &[&str], config: Option<&str>) -> DaemonHarness {
    DaemonHarness::start(
        std::path::Path::new(env!("CARGO_BIN_EXE_tandem")),
        &server.base_url(),
        args,
        config,
    )
    .await
}

/// `tandem run --json` in process with `config`, against the model at `url`, on `executor`.
async fn run_json(
    config: &std::path::Path,
    url: &str,
    executor: &str,
    task: &str,
) -> crate::e2e::Output {
    tandem(
        &[
            "run",
            "--json",
            "--config",
            config.to_str().unwrap(),
            "--base-url",
            url,
            "--model",
            "m",
            "-e",
            executor,
            task,
        ],
        &[("TANDEM_MAX_RETRIES", "0")],
        None,
    )
    .await
}

fn events_of(stdout: &str, kind: &str) -> Vec<Value> {
    stdout
        .lines()
        .filter_map(|l| serde_json::from_str::<Value>(l).ok())
        .filter(|v| v["type"] == kind)
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn run_in_process_reaches_an_allowed_host_from_docker_and_local_and_records_each_connection()
{
    let net = Internet::new();
    net.http_server(80);
    let task = "network: fetch files.test";
    let server = ScriptedOpenAi::start(script([(task, replies())]))
        .await
        .unwrap();
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("tandem.toml");
    std::fs::write(
        &config,
        format!(
            "[network]\nresolve = {{ \"files.test\" = [\"{}\"] }}\n",
            net.addr
        ),
    )
    .unwrap();
    let url = server.base_url();
    for executor in ["docker", "local"] {
        let out = tandem(
            &[
                "run",
                "--json",
                "--config",
                config.to_str().unwrap(),
                "--base-url",
                &url,
                "--model",
                "m",
                "-e",
                executor,
                "--allow-host",
                "files.test",
                task,
            ],
            &[("TANDEM_MAX_RETRIES", "0")],
            None,
        )
        .await;
        assert_eq!(out.code, 0, "{executor}: {}\n{}", out.stdout, out.stderr);
        let results = events_of(&out.stdout, "exec_result");
        let printed = results[0]["result"]["stdout"].as_str().unwrap_or_default();
        assert!(
            printed.contains("seen: GET /hello HTTP/1.1") && printed.contains("other: 403"),
            "{printed}"
        );
        // Each connection is recorded when it ends, so the two may come in either order.
        let net_events = events_of(&out.stdout, "net");
        assert_eq!(
            verdicts(net_events.iter()),
            [
                (
                    "files.test".to_owned(),
                    "allowed".to_owned(),
                    "files.test".to_owned()
                ),
                (
                    "other.test".to_owned(),
                    "denied".to_owned(),
                    "default".to_owned()
                )
            ],
            "{net_events:?}"
        );
        // The block's result counts what went through the proxy (a connection told after
        // the result counts with the next block, so only the field is sure to be there).
        assert!(
            results[0]["result"]["resources"]["net_bytes_in"].is_u64(),
            "{executor}: {}",
            results[0]
        );
        // The model was told which hosts it may reach.
        let asked = server.requests();
        assert!(
            asked.iter().any(|r| r.body.to_string().contains(
                "reach these hosts over HTTP and HTTPS, and nothing else on the network: files.test"
            )),
            "the system prompt does not name the allowed hosts"
        );
    }

    // doctor says what applies.
    let doctor = tandem(&["doctor", "--config", config.to_str().unwrap()], &[], None).await;
    assert!(
        doctor.stdout.contains("network:   nothing allowed unless a task asks (--allow-host) through Tandem's egress proxy"),
        "{}",
        doctor.stdout
    );

    // A bad entry is refused before anything runs, naming it.
    let out = tandem(
        &["run", "--base-url", &url, "--allow-host", "*.", task],
        &[],
        None,
    )
    .await;
    assert_eq!(out.code, 2, "{}", out.stderr);
    assert!(out.stderr.contains("no domain after *."), "{}", out.stderr);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_daemon_gives_a_client_only_what_its_operator_allows() {
    let net = Internet::new();
    net.http_server(80);
    let task = "network: fetch files.test";
    let server = ScriptedOpenAi::start(script([(task, replies())]))
        .await
        .unwrap();
    let config = format!(
        "[network]\nallow = [\"files.test\", \"*.example.com\"]\nresolve = {{ \"files.test\" = [\"{}\"] }}\n",
        net.addr
    );
    let daemon = serve(&server, &["--executor", "docker"], Some(&config)).await;
    // Outside [network] allow: refused with 400, naming the host and the setting.
    let (status, body) = daemon
        .send(
            reqwest::Method::POST,
            "/v1/tasks",
            Some(json!({"task": task, "network": {"allow": ["evil.test"]}}).to_string()),
        )
        .await;
    assert_eq!(status, 400, "{body}");
    let said = body.to_string();
    assert!(
        said.contains("evil.test") && said.contains("[network] allow"),
        "{said}"
    );
    // An entry that does not parse: 400, named.
    let (status, body) = daemon
        .send(
            reqwest::Method::POST,
            "/v1/tasks",
            Some(json!({"task": task, "network": {"allow": ["a.test:70000"]}}).to_string()),
        )
        .await;
    assert_eq!(status, 400, "{body}");
    assert!(body.to_string().contains("over 65535"), "{body}");
    // Within it: the task's sandbox reaches the host, and the events say so.
    let id = daemon
        .submit(json!({"task": task, "network": {"allow": ["files.test"]}}))
        .await;
    daemon.wait_finished(&id, Duration::from_secs(300)).await;
    let events = daemon.raw_events(&id, 0).await;
    let nets: Vec<&Value> = events.iter().filter(|e| e["type"] == "net").collect();
    assert_eq!(
        verdicts(nets.iter().copied()),
        [
            (
                "files.test".to_owned(),
                "allowed".to_owned(),
                "files.test".to_owned()
            ),
            (
                "other.test".to_owned(),
                "denied".to_owned(),
                "default".to_owned()
            )
        ],
        "{events:?}"
    );
    let printed = daemon.block_stdouts(&id).await.join("");
    assert!(printed.contains("seen: GET /hello"), "{printed}");

    // A session without a task: the same bound, and each connection streamed as a line.
    let (status, body) = daemon
        .send(
            reqwest::Method::POST,
            "/v1/exec",
            Some(json!({"language": "python", "code": "print(1)", "network": {"allow": ["evil.test"]}}).to_string()),
        )
        .await;
    assert_eq!(status, 400, "{body}");
    assert!(body.to_string().contains("evil.test"), "{body}");
    let (status, session) = daemon
        .send(
            reqwest::Method::POST,
            "/v1/sessions",
            Some(json!({"network": {"allow": ["files.test"]}}).to_string()),
        )
        .await;
    assert_eq!(status, 201, "{session}");
    let sid = session["id"].as_str().unwrap();
    let streamed = daemon
        .http()
        .post(format!("http://tandem/v1/sessions/{sid}/exec"))
        .header("accept", "application/x-ndjson")
        .json(&json!({"language": "python", "code": FETCH}))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    let lines: Vec<Value> = streamed
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let nets: Vec<&Value> = lines.iter().filter(|l| l["type"] == "net").collect();
    assert_eq!(
        verdicts(nets.iter().copied()),
        [
            (
                "files.test".to_owned(),
                "allowed".to_owned(),
                "files.test".to_owned()
            ),
            (
                "other.test".to_owned(),
                "denied".to_owned(),
                "default".to_owned()
            )
        ],
        "{streamed}"
    );
    let last = lines.last().unwrap();
    assert_eq!(last["type"], "result", "{streamed}");
    assert!(
        last["result"]["stdout"]
            .as_str()
            .unwrap()
            .contains("seen: GET /hello"),
        "{streamed}"
    );
}

const INSTALL: &str = r#"import importlib, site, subprocess, sys
r = subprocess.run([sys.executable, "-m", "pip", "install", "tandemdemo"], capture_output=True, text=True)
print("pip exit", r.returncode)
if r.returncode:
    print(r.stdout[-3000:], r.stderr[-3000:])
sys.path.append(site.getusersitepackages())
importlib.invalidate_caches()
import tandemdemo
print("value", tandemdemo.VALUE)"#;

/// Index requests for files and pages: what reached the stand-in index.
/// Runs `task` in process on `executor` and checks its first block printed each of `says`
/// and that every connection it made was the package cache's.
async fn installs_through_the_cache(
    config: &std::path::Path,
    url: &str,
    executor: &str,
    task: &str,
    says: &[&str],
) {
    let out = run_json(config, url, executor, task).await;
    assert_eq!(out.code, 0, "{executor}: {}\n{}", out.stdout, out.stderr);
    let results = events_of(&out.stdout, "exec_result");
    let printed = results[0]["result"]["stdout"].as_str().unwrap_or_default();
    assert!(
        says.iter().all(|s| printed.contains(s)),
        "{executor}: {printed}\n{}",
        results[0]["result"]["stderr"]
    );
    let nets = events_of(&out.stdout, "net");
    assert!(
        !nets.is_empty()
            && nets
                .iter()
                .all(|n| n["rule"] == "packages" && n["verdict"] == "allowed"),
        "{executor}: {nets:?}"
    );
}

fn reached(seen: &std::sync::Mutex<Vec<String>>) -> Vec<String> {
    seen.lock().unwrap().clone()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pip_installs_from_the_operators_index_through_the_cache_and_a_second_task_asks_the_index_nothing()
 {
    let net = Internet::new();
    let index = tempfile::tempdir().unwrap();
    let sha =
        tandem_tests::packages::build_index(index.path(), "tandemdemo", "1.0", "VALUE = 42\n");
    let seen = net.file_server(80, index.path().to_owned());
    let task = "network: install tandemdemo";
    let server = ScriptedOpenAi::start(script([(
        task,
        vec![
            Reply::Text(fence("python", INSTALL)),
            Reply::from("Installed.\n\nTERMINATE"),
        ],
    )]))
    .await
    .unwrap();
    let dir = tempfile::tempdir().unwrap();
    let cache = dir.path().join("cache");
    let config = dir.path().join("tandem.toml");
    std::fs::write(
        &config,
        format!(
            "[network]\nresolve = {{ \"pypi.test\" = [\"{}\"] }}\n[network.packages]\npython = \"http://pypi.test/simple/\"\ncache_dir = \"{}\"\n",
            net.addr,
            cache.display()
        ),
    )
    .unwrap();
    let url = server.base_url();
    for (i, executor) in ["docker", "local", "docker"].into_iter().enumerate() {
        let before = reached(&seen).len();
        installs_through_the_cache(&config, &url, executor, task, &["pip exit 0", "value 42"])
            .await;
        let asked = reached(&seen);
        if i == 0 {
            // The first install reached the index for the page and the wheel, once each.
            assert!(
                asked
                    .iter()
                    .any(|l| l.starts_with("GET /simple/tandemdemo/"))
                    && asked
                        .iter()
                        .any(|l| l.starts_with("GET /packages/tandemdemo-1.0-py3-none-any.whl")),
                "{asked:?}"
            );
        } else {
            // Every later task, on either executor, from the cache alone.
            assert_eq!(
                asked.len(),
                before,
                "{executor} reached the index: {asked:?}"
            );
        }
    }
    // The wheel is kept under its hash, checked against the index's.
    assert!(cache.join("files").join(&sha).is_file());
    // The model was told it may install packages.
    assert!(
        server.requests().iter().any(|r| r
            .body
            .to_string()
            .contains("You may install Python packages")),
        "the system prompt does not say packages can be installed"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_file_that_does_not_match_its_index_hash_is_neither_kept_nor_served() {
    let net = Internet::new();
    let index = tempfile::tempdir().unwrap();
    tandem_tests::packages::build_index(index.path(), "tandemdemo", "1.0", "VALUE = 42\n");
    // The index's page keeps the old hash; the file is swapped for another.
    let page = std::fs::read_to_string(index.path().join("simple/tandemdemo/index.html")).unwrap();
    let other = tempfile::tempdir().unwrap();
    tandem_tests::packages::build_index(other.path(), "tandemdemo", "1.0", "VALUE = 666\n");
    std::fs::copy(
        other
            .path()
            .join("packages/tandemdemo-1.0-py3-none-any.whl"),
        index
            .path()
            .join("packages/tandemdemo-1.0-py3-none-any.whl"),
    )
    .unwrap();
    std::fs::write(index.path().join("simple/tandemdemo/index.html"), page).unwrap();
    let _seen = net.file_server(80, index.path().to_owned());
    let task = "network: install a swapped tandemdemo";
    let server = ScriptedOpenAi::start(script([(
        task,
        vec![
            Reply::Text(fence("python", INSTALL)),
            Reply::from("It failed.\n\nTERMINATE"),
        ],
    )]))
    .await
    .unwrap();
    let dir = tempfile::tempdir().unwrap();
    let cache = dir.path().join("cache");
    let config = dir.path().join("tandem.toml");
    std::fs::write(
        &config,
        format!(
            "[network]\nresolve = {{ \"pypi.test\" = [\"{}\"] }}\n[network.packages]\npython = \"http://pypi.test/simple/\"\ncache_dir = \"{}\"\n",
            net.addr,
            cache.display()
        ),
    )
    .unwrap();
    let out = run_json(&config, &server.base_url(), "local", task).await;
    let results = events_of(&out.stdout, "exec_result");
    let printed = results[0]["result"]["stdout"].as_str().unwrap_or_default();
    assert!(
        !printed.contains("pip exit 0") && !printed.contains("value 666"),
        "{printed}"
    );
    let nets = events_of(&out.stdout, "net");
    assert!(
        nets.iter().any(|n| n["verdict"] == "denied"
            && n["rule"] == "packages"
            && n["reason"]
                .as_str()
                .unwrap_or_default()
                .contains("does not match its index's hash")),
        "{nets:?}"
    );
    assert_eq!(std::fs::read_dir(cache.join("files")).unwrap().count(), 0);
}

/// Looks for the brokered values everywhere a block can look, without holding either whole
/// in its own code or files.
const HUNT: &str = r#"import glob, os, urllib.request, urllib.error
values = ["sek" + "rit-" + str(6 * 20 + 3), "plain" + "-val-" + str(400 + 56)]
r = urllib.request.urlopen("https://api.test/whoami", timeout=30).read().decode()
print("https:", r.splitlines()[0])
print("https echo masked:", "authorization: " + "*" * 17 in r.lower())
r = urllib.request.urlopen("http://plain.test/x", timeout=30).read().decode()
print("plain:", r.splitlines()[0])
r = urllib.request.urlopen("https://api.test/redirect-to/other.test", timeout=30).read().decode()
print("redirected:", r.splitlines()[0], "carried:", "authorization" in r.lower())
found = []
for k, v in os.environ.items():
    if any(x in v for x in values):
        found.append("env " + k)
for p in glob.glob("/proc/*/environ") + glob.glob("/proc/*/cmdline"):
    try:
        data = open(p, "rb").read().decode("latin-1")
    except OSError:
        continue
    if any(x in data for x in values):
        found.append(p)
keys = []
roots = [os.environ.get("HOME", "."), "/tmp", "/run"] + [os.path.dirname(os.environ.get("SSL_CERT_FILE", "/x/y"))]
for root in roots:
    for dirpath, dirs, files in os.walk(root):
        for f in files:
            p = os.path.join(dirpath, f)
            try:
                data = open(p, "rb").read(1 << 20).decode("latin-1")
            except OSError:
                continue
            if any(x in data for x in values):
                found.append(p)
            if "PRIVATE" + " KEY" in data:
                keys.append(p)
print("found:", found)
print("keys:", keys)"#;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_brokered_header_reaches_its_host_and_the_sandbox_never_holds_it() {
    let net = Internet::new();
    let (test_ca, api_seen) = net.https_server(443, &["api.test"]);
    let plain_seen = net.http_server(80);
    let task = "network: call the api with a brokered token";
    let server = ScriptedOpenAi::start(script([(
        task,
        vec![
            Reply::Text(fence("python", HUNT)),
            Reply::from("Called.\n\nTERMINATE"),
        ],
    )]))
    .await
    .unwrap();
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("test-ca.pem"), &test_ca).unwrap();
    std::fs::write(dir.path().join("plain-token"), "plain-val-456\n").unwrap();
    let config = dir.path().join("tandem.toml");
    let a = net.addr;
    std::fs::write(
        &config,
        format!(
            r#"[network]
allow = ["api.test", "plain.test", "other.test"]
resolve = {{ "api.test" = ["{a}"], "plain.test" = ["{a}"], "other.test" = ["{a}"] }}
upstream_ca = ["{d}/test-ca.pem"]
ca_dir = "{d}/egress-ca"

[network.secrets.api]
host = "api.test"
header = "Authorization"
value_env = "TANDEM_TEST_API_TOKEN"

[network.secrets.plain]
host = "plain.test"
header = "X-Api-Key"
value_file = "{d}/plain-token"
"#,
            d = dir.path().display()
        ),
    )
    .unwrap();
    let url = server.base_url();
    for executor in ["docker", "local"] {
        let before = api_seen.heads().len();
        let out = tandem(
            &[
                "run",
                "--json",
                "--config",
                config.to_str().unwrap(),
                "--base-url",
                &url,
                "--model",
                "m",
                "-e",
                executor,
                task,
            ],
            &[
                ("TANDEM_MAX_RETRIES", "0"),
                ("TANDEM_TEST_API_TOKEN", "Bearer sekrit-123"),
                // Every log line Tandem and its libraries write at debug, searched below.
                ("RUST_LOG", "debug"),
            ],
            None,
        )
        .await;
        assert_eq!(out.code, 0, "{executor}: {}\n{}", out.stdout, out.stderr);
        let results = events_of(&out.stdout, "exec_result");
        let printed = results[0]["result"]["stdout"].as_str().unwrap_or_default();
        let stderr = results[0]["result"]["stderr"].as_str().unwrap_or_default();
        for line in [
            "https: seen: GET /whoami HTTP/1.1",
            "https echo masked: True",
            "plain: seen: GET /x HTTP/1.1",
            "redirected: seen: GET / HTTP/1.1 carried: False",
            "found: []",
            "keys: []",
        ] {
            assert!(
                printed.contains(line),
                "{executor}: no {line:?} in\n{printed}\n{stderr}"
            );
        }
        // The hosts got the headers; the other host, after the redirect, did not.
        let heads = api_seen.heads();
        assert!(
            heads[before..]
                .iter()
                .any(|h| h.contains("authorization: Bearer sekrit-123")
                    || h.contains("Authorization: Bearer sekrit-123")),
            "{heads:?}"
        );
        let plain = plain_seen.heads();
        assert!(
            plain.iter().any(|h| h.contains("X-Api-Key: plain-val-456")),
            "{plain:?}"
        );
        assert!(
            plain
                .iter()
                .filter(|h| h.starts_with("GET / "))
                .all(|h| !h.to_ascii_lowercase().contains("authorization")),
            "{plain:?}"
        );
        // Events say a secret was added, and never its value; nor does the transcript, nor
        // the log (stderr, at debug).
        let nets = events_of(&out.stdout, "net");
        assert!(
            nets.iter()
                .any(|n| n["host"] == "api.test" && n["brokered"] == true),
            "{nets:?}"
        );
        assert!(!out.stdout.contains("sekrit-123") && !out.stderr.contains("sekrit-123"));
        assert!(!out.stdout.contains("plain-val-456") && !out.stderr.contains("plain-val-456"));
    }
    // Each connection is a span under the task's, in the trace a caller asked for.
    let collector = tandem_tests::otlp::Collector::start().await;
    let trace = "4bf92f3577b34da6a3ce929d0e0e4736";
    let endpoint = collector.grpc_endpoint();
    let out = tandem(
        &[
            "run",
            "--json",
            "--config",
            config.to_str().unwrap(),
            "--base-url",
            &url,
            "--model",
            "m",
            "-e",
            "docker",
            task,
        ],
        &[
            ("TANDEM_MAX_RETRIES", "0"),
            ("TANDEM_TEST_API_TOKEN", "Bearer sekrit-123"),
            ("OTEL_EXPORTER_OTLP_ENDPOINT", endpoint.as_str()),
            ("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc"),
            ("TRACEPARENT", &format!("00-{trace}-00f067aa0ba902b7-01")),
        ],
        None,
    )
    .await;
    assert_eq!(out.code, 0, "{}", out.stderr);
    let spans = collector
        .trace(trace, Duration::from_secs(20), |spans| {
            spans.iter().any(|s| s.name == "egress api.test")
                && spans.iter().any(|s| s.name == "egress other.test")
        })
        .await;
    let api = spans.iter().find(|s| s.name == "egress api.test").unwrap();
    assert_eq!(api.text("tandem.net.verdict"), Some("allowed"), "{api:?}");
    assert_eq!(
        api.attributes["tandem.net.brokered"],
        json!(true),
        "{api:?}"
    );
    assert!(
        api.int("tandem.net.bytes_in").is_some_and(|n| n > 0),
        "{api:?}"
    );
    assert!(
        spans
            .iter()
            .all(|s| !format!("{:?}", s.attributes).contains("sekrit-123")),
        "a span holds the value"
    );

    // The model was told which hosts carry credentials, never the values.
    let asked: Vec<String> = server
        .requests()
        .iter()
        .map(|r| r.body.to_string())
        .collect();
    assert!(
        asked.iter().any(|b| b.contains("api.test (api)")),
        "{asked:?}"
    );
    assert!(asked.iter().all(|b| !b.contains("sekrit-123")));
    // The CA's key stays in the daemon's directory, for its owner only.
    use std::os::unix::fs::PermissionsExt;
    let mode = std::fs::metadata(dir.path().join("egress-ca/ca.key"))
        .unwrap()
        .permissions()
        .mode();
    assert_eq!(mode & 0o077, 0, "{mode:o}");

    // doctor names each header, its host and where its value comes from, never the value.
    let doctor = tandem(&["doctor", "--config", config.to_str().unwrap()], &[], None).await;
    assert!(
        doctor.stdout.contains("headers added at the egress: Authorization on api.test (api, from $TANDEM_TEST_API_TOKEN, which is not set)")
            && doctor.stdout.contains("X-Api-Key on plain.test (plain, from "),
        "{}",
        doctor.stdout
    );
    assert!(!doctor.stdout.contains("plain-val-456"));

    // A secret whose value is missing is named at start.
    let out = tandem(
        &[
            "run",
            "--config",
            config.to_str().unwrap(),
            "--base-url",
            &url,
            task,
        ],
        &[],
        None,
    )
    .await;
    assert_ne!(out.code, 0);
    assert!(
        out.stderr.contains("[network.secrets.api]")
            && out.stderr.contains("TANDEM_TEST_API_TOKEN"),
        "{}",
        out.stderr
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_mcp_client_asks_for_a_network_within_the_operators_on_execute_code_and_run_task() {
    let net = Internet::new();
    net.http_server(80);
    let task = "network: fetch files.test";
    let server = ScriptedOpenAi::start(script([(task, replies())]))
        .await
        .unwrap();
    let config = format!(
        "[network]\nallow = [\"files.test\"]\nresolve = {{ \"files.test\" = [\"{}\"] }}\n",
        net.addr
    );
    let daemon = serve(&server, &["--executor", "docker"], Some(&config)).await;
    let mcp = tandem_tests::mcp::McpHttp::connect(&daemon).await.unwrap();
    // execute_code: the allowed host answers, the other is refused, each told as a line.
    let ran = mcp
        .call_tool(
            "execute_code",
            json!({"language": "python", "code": FETCH, "network": {"allow": ["files.test"]}}),
        )
        .await;
    let text = tandem_tests::mcp::text_of(&ran);
    assert!(
        text.contains("seen: GET /hello") && text.contains("other: 403"),
        "{ran}"
    );
    assert!(
        text.contains("net: files.test:80 allowed") && text.contains("net: other.test:80 denied"),
        "{text}"
    );
    // A session's connections are counted on /metrics too, by executor and verdict.
    let metrics = daemon
        .http()
        .get("http://tandem/metrics")
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    for line in [
        "tandem_net_connections_total{executor=\"docker\",verdict=\"allowed\"} 1",
        "tandem_net_connections_total{executor=\"docker\",verdict=\"denied\"} 1",
    ] {
        assert!(
            metrics.lines().any(|l| l == line),
            "{line} not in:\n{metrics}"
        );
    }
    // Outside the operator's: refused, naming the host.
    let refused = mcp
        .call_tool(
            "execute_code",
            json!({"language": "python", "code": "print(1)", "network": {"allow": ["evil.test"]}}),
        )
        .await;
    assert!(refused.to_string().contains("evil.test"), "{refused}");
    // run_task: the task's sandbox gets the network it asked for, and its events say so.
    let done = mcp
        .call_tool(
            "run_task",
            json!({"task": task, "network": {"allow": ["files.test"]}}),
        )
        .await;
    let id = done["structuredContent"]["task_id"]
        .as_str()
        .unwrap_or_else(|| panic!("{done}"))
        .to_owned();
    let events = daemon.raw_events(&id, 0).await;
    let nets: Vec<&Value> = events.iter().filter(|e| e["type"] == "net").collect();
    assert_eq!(
        verdicts(nets.iter().copied()),
        [
            (
                "files.test".to_owned(),
                "allowed".to_owned(),
                "files.test".to_owned()
            ),
            (
                "other.test".to_owned(),
                "denied".to_owned(),
                "default".to_owned()
            )
        ],
        "{events:?}"
    );
    let refused = mcp
        .call_tool(
            "run_task",
            json!({"task": task, "network": {"allow": ["evil.test"]}}),
        )
        .await;
    assert!(refused.to_string().contains("evil.test"), "{refused}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_executors_network_setting_decides_what_its_tasks_get_and_doctor_says_why() {
    let task = "network: fetch files.test";
    let server = ScriptedOpenAi::start(script([(task, replies())]))
        .await
        .unwrap();
    let url = server.base_url();
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("tandem.toml");
    // false: never any network, whatever a task asks; named with the setting to change.
    std::fs::write(
        &config,
        "[executors.local]\nnetwork = false\n[executors.docker]\nnetwork = true\n",
    )
    .unwrap();
    for (executor, said) in [("local", "network = false"), ("docker", "network = true")] {
        let out = tandem(
            &[
                "run",
                "--config",
                config.to_str().unwrap(),
                "--base-url",
                &url,
                "-e",
                executor,
                "--allow-host",
                "files.test",
                task,
            ],
            &[],
            None,
        )
        .await;
        assert_ne!(out.code, 0, "{executor}: {}", out.stdout);
        assert!(
            out.stderr.contains(said)
                && out.stderr.contains(&format!("[executors.{executor}]"))
                && out.stderr.contains("network = \"policy\""),
            "{executor}: {}",
            out.stderr
        );
        // No request reached the model: the task was refused before it started.
        assert!(server.requests().is_empty());
    }
    // WASM has no switch and no way out: a task with a network is refused, naming the
    // executors that have one.
    let out = tandem(
        &[
            "run",
            "--config",
            config.to_str().unwrap(),
            "--base-url",
            &url,
            "-e",
            "wasm",
            "--allow-host",
            "files.test",
            task,
        ],
        &[],
        None,
    )
    .await;
    assert_ne!(out.code, 0, "wasm: {}", out.stdout);
    assert!(
        out.stderr
            .contains("use the docker, kubernetes or confined local executor"),
        "wasm: {}",
        out.stderr
    );
    assert!(server.requests().is_empty());
    let doctor = tandem(&["doctor", "--config", config.to_str().unwrap()], &[], None).await;
    assert!(
        doctor.stdout.contains("docker: the open network, unguarded (no proxy, no policy) (network set in [executors.docker]); local: never any network (network set in [executors.local]); wasm: never any network (no switch: a task with a network is refused on it)"),
        "{}",
        doctor.stdout
    );
    // Unset: policy, said as the default.
    std::fs::write(&config, "").unwrap();
    let doctor = tandem(&["doctor", "--config", config.to_str().unwrap()], &[], None).await;
    assert!(
        doctor.stdout.contains(
            "docker: behind the egress proxy when [network] or a task names hosts (the default)"
        ),
        "{}",
        doctor.stdout
    );
    // A value that is none of the three is named with what it may be.
    std::fs::write(&config, "[executors.docker]\nnetwork = \"open\"\n").unwrap();
    let out = tandem(&["doctor", "--config", config.to_str().unwrap()], &[], None).await;
    assert!(
        out.stderr.contains("network = \"open\"") && out.stderr.contains("\"policy\""),
        "{}\n{}",
        out.stdout,
        out.stderr
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_index_that_is_down_gives_pip_its_own_error_and_the_task_goes_on() {
    // A namespace with nothing listening: the index refuses every connection.
    let net = Internet::new();
    let task = "network: install from an index that is down";
    let server = ScriptedOpenAi::start(script([(
        task,
        vec![
            Reply::Text(fence("python", INSTALL)),
            Reply::from("The index is down.\n\nTERMINATE"),
        ],
    )]))
    .await
    .unwrap();
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("tandem.toml");
    std::fs::write(
        &config,
        format!(
            "[network]\nresolve = {{ \"pypi.test\" = [\"{}\"] }}\n[network.packages]\npython = \"http://pypi.test/simple/\"\ncache_dir = \"{}\"\n",
            net.addr,
            dir.path().join("cache").display()
        ),
    )
    .unwrap();
    let out = run_json(&config, &server.base_url(), "local", task).await;
    assert_eq!(out.code, 0, "{}\n{}", out.stdout, out.stderr);
    let results = events_of(&out.stdout, "exec_result");
    let printed = results[0]["result"]["stdout"].as_str().unwrap_or_default();
    // pip's own words reach the model, and the task ran its second turn.
    assert!(
        printed.contains("pip exit 1")
            && printed.contains("No matching distribution found for tandemdemo"),
        "{printed}"
    );
    let nets = events_of(&out.stdout, "net");
    assert!(
        nets.iter().any(|n| n["verdict"] == "denied"
            && n["rule"] == "packages"
            && n["reason"]
                .as_str()
                .unwrap_or_default()
                .contains("refused the connection")),
        "{nets:?}"
    );
    assert_eq!(events_of(&out.stdout, "assistant_message").len(), 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_https_index_is_cached_too_answered_inside_tls_with_the_daemons_ca() {
    let net = Internet::new();
    let index = tempfile::tempdir().unwrap();
    let sha =
        tandem_tests::packages::build_index(index.path(), "tandemdemo", "1.0", "VALUE = 42\n");
    let (test_ca, seen) = net.https_file_server(443, index.path().to_owned(), &["pypi.test"]);
    let task = "network: install tandemdemo over https";
    let server = ScriptedOpenAi::start(script([(
        task,
        vec![
            Reply::Text(fence("python", INSTALL)),
            Reply::from("Installed.\n\nTERMINATE"),
        ],
    )]))
    .await
    .unwrap();
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("test-ca.pem"), &test_ca).unwrap();
    let config = dir.path().join("tandem.toml");
    std::fs::write(
        &config,
        format!(
            "[network]\nresolve = {{ \"pypi.test\" = [\"{a}\"] }}\nupstream_ca = [\"{d}/test-ca.pem\"]\nca_dir = \"{d}/egress-ca\"\n[network.packages]\npython = \"https://pypi.test/simple/\"\ncache_dir = \"{d}/cache\"\n",
            a = net.addr,
            d = dir.path().display()
        ),
    )
    .unwrap();
    let url = server.base_url();
    for (i, executor) in ["docker", "local"].into_iter().enumerate() {
        let before = reached(&seen).len();
        let out = run_json(&config, &url, executor, task).await;
        assert_eq!(out.code, 0, "{executor}: {}\n{}", out.stdout, out.stderr);
        let results = events_of(&out.stdout, "exec_result");
        let printed = results[0]["result"]["stdout"].as_str().unwrap_or_default();
        assert!(
            printed.contains("pip exit 0") && printed.contains("value 42"),
            "{executor}: {printed}\n{}",
            results[0]["result"]["stderr"]
        );
        let nets = events_of(&out.stdout, "net");
        assert!(
            !nets.is_empty()
                && nets.iter().all(|n| n["rule"] == "packages"
                    && n["verdict"] == "allowed"
                    && n["port"] == 443),
            "{executor}: {nets:?}"
        );
        let asked = reached(&seen);
        if i == 0 {
            assert!(
                asked
                    .iter()
                    .any(|l| l.starts_with("GET /packages/tandemdemo-1.0-py3-none-any.whl")),
                "{asked:?}"
            );
        } else {
            assert_eq!(
                asked.len(),
                before,
                "{executor} reached the index: {asked:?}"
            );
        }
    }
    assert!(dir.path().join("cache/files").join(&sha).is_file());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tandem_exec_puts_its_block_behind_the_proxy_with_allow_host() {
    let net = Internet::new();
    net.http_server(80);
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("tandem.toml");
    std::fs::write(
        &config,
        format!(
            "[network]\nresolve = {{ \"files.test\" = [\"{}\"] }}\n",
            net.addr
        ),
    )
    .unwrap();
    for executor in ["docker", "local"] {
        let out = tandem(
            &[
                "exec",
                "--config",
                config.to_str().unwrap(),
                "-e",
                executor,
                "--lang",
                "python",
                "--allow-host",
                "files.test",
            ],
            &[],
            Some(FETCH),
        )
        .await;
        assert_eq!(out.code, 0, "{executor}: {}\n{}", out.stdout, out.stderr);
        assert!(
            out.stdout.contains("seen: GET /hello HTTP/1.1") && out.stdout.contains("other: 403"),
            "{executor}: {}",
            out.stdout
        );
        assert!(
            out.stderr
                .contains("tandem: net: files.test:80 allowed by files.test")
                && out
                    .stderr
                    .contains("tandem: net: other.test:80 denied (rule default)"),
            "{executor}: {}",
            out.stderr
        );
    }
    // Without --allow-host, [network] (which allows nothing here) is the block's policy.
    let out = tandem(
        &[
            "exec",
            "--config",
            config.to_str().unwrap(),
            "-e",
            "local",
            "--lang",
            "python",
        ],
        &[],
        Some(FETCH),
    )
    .await;
    assert_ne!(out.code, 0, "{}", out.stdout);
    assert!(
        out.stderr
            .contains("tandem: net: files.test:80 denied (rule default)"),
        "{}",
        out.stderr
    );
    // An executor whose network is false refuses the flag, naming the setting.
    std::fs::write(&config, "[executors.local]\nnetwork = false\n").unwrap();
    let out = tandem(
        &[
            "exec",
            "--config",
            config.to_str().unwrap(),
            "-e",
            "local",
            "--lang",
            "python",
            "--allow-host",
            "files.test",
        ],
        &[],
        Some(FETCH),
    )
    .await;
    assert_ne!(out.code, 0);
    assert!(out.stderr.contains("network = false"), "{}", out.stderr);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn npm_installs_from_the_operators_registry_through_the_cache_and_a_second_task_asks_it_nothing()
 {
    let net = Internet::new();
    let registry = tempfile::tempdir().unwrap();
    // A real package, packed by npm itself, and the document a registry serves for it.
    let source = tempfile::tempdir().unwrap();
    std::fs::write(
        source.path().join("package.json"),
        r#"{"name": "tandemdemo", "version": "1.0.0", "main": "index.js"}"#,
    )
    .unwrap();
    std::fs::write(
        source.path().join("index.js"),
        "module.exports = { VALUE: 42 };\n",
    )
    .unwrap();
    let tarballs = registry.path().join("tarballs");
    std::fs::create_dir(&tarballs).unwrap();
    let packed = std::process::Command::new("npm")
        .args(["pack", "--json", "--pack-destination"])
        .arg(&tarballs)
        .current_dir(source.path())
        .env("npm_config_cache", source.path().join(".npm"))
        .output()
        .expect("npm runs (nodejs and npm are installed by .ci/run)");
    assert!(packed.status.success(), "{packed:?}");
    let packed: Value = serde_json::from_slice(&packed.stdout).unwrap();
    let integrity = packed[0]["integrity"].as_str().unwrap().to_owned();
    let file = packed[0]["filename"].as_str().unwrap().to_owned();
    let packument = json!({
        "name": "tandemdemo",
        "dist-tags": {"latest": "1.0.0"},
        "versions": {"1.0.0": {
            "name": "tandemdemo",
            "version": "1.0.0",
            "main": "index.js",
            "dist": {"tarball": format!("http://npm.test/tarballs/{file}"), "integrity": integrity},
        }},
    });
    std::fs::write(registry.path().join("tandemdemo"), packument.to_string()).unwrap();
    let seen = net.file_server(80, registry.path().to_owned());
    let task = "network: npm install tandemdemo";
    let install = "npm install tandemdemo > npm.log 2>&1; echo \"npm exit $?\"; tail -5 npm.log\nnode -e \"console.log('value', require('tandemdemo').VALUE)\"";
    let server = ScriptedOpenAi::start(script([(
        task,
        vec![
            Reply::Text(fence("sh", install)),
            Reply::from("Installed.\n\nTERMINATE"),
        ],
    )]))
    .await
    .unwrap();
    let dir = tempfile::tempdir().unwrap();
    let cache = dir.path().join("cache");
    let config = dir.path().join("tandem.toml");
    std::fs::write(
        &config,
        format!(
            "[network]\nresolve = {{ \"npm.test\" = [\"{}\"] }}\n[network.packages]\nnpm = \"http://npm.test/\"\ncache_dir = \"{}\"\n",
            net.addr,
            cache.display()
        ),
    )
    .unwrap();
    let url = server.base_url();
    // The sandbox image has no Node.js: the confined local executor runs the machine's npm.
    for i in 0..2 {
        let before = reached(&seen).len();
        installs_through_the_cache(&config, &url, "local", task, &["npm exit 0", "value 42"]).await;
        let asked = reached(&seen);
        if i == 0 {
            assert!(
                asked.iter().any(|l| l.starts_with("GET /tandemdemo "))
                    && asked
                        .iter()
                        .any(|l| l.starts_with(&format!("GET /tarballs/{file} "))),
                "{asked:?}"
            );
        } else {
            assert_eq!(
                asked.len(),
                before,
                "the registry was asked again: {asked:?}"
            );
        }
    }
    // The tarball is kept under its sha512, checked against the registry's integrity.
    let kept: Vec<String> = std::fs::read_dir(cache.join("npm").join("files"))
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    assert!(
        kept.len() == 1 && kept[0].starts_with("sha512-"),
        "{kept:?}"
    );
    assert!(
        server.requests().iter().any(|r| r
            .body
            .to_string()
            .contains("You may install Node.js packages")),
        "the system prompt does not say npm packages can be installed"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_proxy_that_cannot_start_leaves_no_sandbox_a_network_and_says_why() {
    let server = ScriptedOpenAi::start(script([])).await.unwrap();
    let dir = tempfile::tempdir().unwrap();
    // The CA's directory is beneath a file: the machine will not make it.
    let blocked = dir.path().join("not-a-dir");
    std::fs::write(&blocked, "").unwrap();
    let token = dir.path().join("token");
    std::fs::write(&token, "Bearer t0k3n\n").unwrap();
    let config = format!(
        "[policy]\nnetwork_allow = [\"files.test\"]\n[network]\nca_dir = \"{}/ca\"\n[network.secrets.api]\nhost = \"api.test\"\nheader = \"Authorization\"\nvalue_file = \"{}\"\n",
        blocked.display(),
        token.display()
    );
    let d = serve(&server, &[], Some(&config)).await;
    // The daemon serves; /v1/executors says why no sandbox gets a network.
    let listed = d.get("/v1/executors").await;
    let local = listed["executors"]
        .as_array()
        .unwrap()
        .iter()
        .find(|e| e["name"] == "local")
        .unwrap_or_else(|| panic!("{listed}"));
    let said = local["network"].as_str().unwrap_or_default();
    assert!(
        said.starts_with("no network policy: the egress proxy is not running (the egress CA in ")
            && said.contains("set [network] ca_dir"),
        "{listed}"
    );
    // A block that asks for a host is refused with the reason, and so is one that does not:
    // with a [network] section every sandbox goes behind the proxy. Neither is ever given
    // an open network.
    let (status, refused) = d
        .send(
            reqwest::Method::POST,
            "/v1/exec",
            Some(
                json!({"language": "python", "code": "print(1)", "network": {"allow": ["files.test"]}})
                    .to_string(),
            ),
        )
        .await;
    assert!(
        status >= 400
            && refused
                .to_string()
                .contains("the egress proxy is not running (the egress CA in "),
        "{status} {refused}"
    );
    let (status, refused) = d
        .send(
            reqwest::Method::POST,
            "/v1/exec",
            Some(json!({"language": "python", "code": "print(1)"}).to_string()),
        )
        .await;
    assert!(
        status == 503
            && refused
                .to_string()
                .contains("the egress proxy is not running (the egress CA in "),
        "{status} {refused}"
    );
    // The daemon itself serves on.
    assert_eq!(d.get("/healthz").await["status"], "ok");
    // doctor says so too.
    let file = dir.path().join("tandem.toml");
    std::fs::write(&file, &config).unwrap();
    let doctor = tandem(&["doctor", "--config", file.to_str().unwrap()], &[], None).await;
    assert!(
        doctor
            .stdout
            .contains("the egress proxy cannot start: the egress CA in "),
        "{}",
        doctor.stdout
    );
}

/// The clients code reaches for, with no flags: `curl`, Python's `requests` and `git clone`,
/// over HTTP and over HTTPS, which the proxy answers with the daemon's CA for a host it adds
/// a header for (the sandbox trusts that CA through its environment alone).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn curl_requests_and_git_reach_an_allowed_host_with_no_flags_over_http_and_https() {
    let net = Internet::new();
    let root = tempfile::tempdir().unwrap();
    std::fs::write(root.path().join("hello"), "hello from files.test\n").unwrap();
    // A repository git clones over its "dumb" HTTP protocol: plain files.
    let git = |args: &[&str], at: &std::path::Path| {
        let out = std::process::Command::new("git")
            .args(args)
            .current_dir(at)
            .env("GIT_AUTHOR_NAME", "t")
            .env("GIT_AUTHOR_EMAIL", "t@t")
            .env("GIT_COMMITTER_NAME", "t")
            .env("GIT_COMMITTER_EMAIL", "t@t")
            .output()
            .expect("git");
        assert!(
            out.status.success(),
            "git {args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    };
    let work = tempfile::tempdir().unwrap();
    git(&["init", "-q", "-b", "main"], work.path());
    std::fs::write(work.path().join("README"), "cloned through the proxy\n").unwrap();
    git(&["add", "README"], work.path());
    git(&["commit", "-q", "-m", "one"], work.path());
    let bare = root.path().join("repo.git");
    git(
        &[
            "clone",
            "-q",
            "--bare",
            work.path().to_str().unwrap(),
            bare.to_str().unwrap(),
        ],
        root.path(),
    );
    git(&["update-server-info"], &bare);
    net.file_server(80, root.path().to_owned());
    let (test_ca, _) = net.https_file_server(443, root.path().to_owned(), &["files.test"]);

    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("test-ca.pem"), &test_ca).unwrap();
    std::fs::write(dir.path().join("token"), "t0k3n\n").unwrap();
    let config = dir.path().join("tandem.toml");
    std::fs::write(
        &config,
        format!(
            "[network]\nallow = [\"files.test\"]\nresolve = {{ \"files.test\" = [\"{a}\"] }}\nupstream_ca = [\"{d}/test-ca.pem\"]\nca_dir = \"{d}/egress-ca\"\n\n[network.secrets.files]\nhost = \"files.test\"\nheader = \"X-Token\"\nvalue_file = \"{d}/token\"\n",
            a = net.addr,
            d = dir.path().display()
        ),
    )
    .unwrap();
    const CLIENTS: &str = r#"
echo "curl http: $(curl -sS http://files.test/hello)"
echo "curl https: $(curl -sS https://files.test/hello)"
python3 -c '
import requests
for scheme in ("http", "https"):
    print("requests %s: %s" % (scheme, requests.get(scheme + "://files.test/hello", timeout=30).text.strip()))
'
git clone -q http://files.test/repo.git by-http && echo "git http: $(cat by-http/README)"
git clone -q https://files.test/repo.git by-https && echo "git https: $(cat by-https/README)"
"#;
    for executor in ["docker", "local"] {
        let out = tandem(
            &[
                "exec",
                "--config",
                config.to_str().unwrap(),
                "-e",
                executor,
                "--lang",
                "sh",
            ],
            &[],
            Some(CLIENTS),
        )
        .await;
        for line in [
            "curl http: hello from files.test",
            "curl https: hello from files.test",
            "requests http: hello from files.test",
            "requests https: hello from files.test",
            "git http: cloned through the proxy",
            "git https: cloned through the proxy",
        ] {
            assert!(
                out.stdout.contains(line),
                "{executor}: no {line:?} in\n{}\n{}",
                out.stdout,
                out.stderr
            );
        }
        assert_eq!(out.code, 0, "{executor}: {}", out.stderr);
    }
}

/// `[policy] network_allow` is what a client may ask for, beyond `[network] allow`: a task
/// submitted with `tandem submit --allow-host` within it reaches its host; one outside it is
/// refused with 400 naming the host and the setting, from the CLI and the API alike.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn network_allow_bounds_what_a_client_asks_for_and_submit_asks_with_allow_host() {
    let net = Internet::new();
    net.http_server(80);
    let task = "network: fetch files.test";
    let server = ScriptedOpenAi::start(script([(task, replies())]))
        .await
        .unwrap();
    let config = format!(
        "[policy]\nnetwork_allow = [\"files.test\", \"*.example.com\"]\n[network]\nresolve = {{ \"files.test\" = [\"{}\"] }}\n",
        net.addr
    );
    let d = serve(&server, &["--executor", "docker"], Some(&config)).await;
    let (code, out, err) = d
        .cli(&["submit", "--json", "--allow-host", "evil.test", task])
        .await;
    assert_ne!(code, 0, "{out}");
    assert!(
        err.contains("evil.test") && err.contains("network_allow"),
        "{err}"
    );
    let (status, body) = d
        .send(
            reqwest::Method::POST,
            "/v1/tasks",
            Some(json!({"task": task, "network": {"allow": ["api.example.org"]}}).to_string()),
        )
        .await;
    assert_eq!(status, 400, "{body}");
    assert!(
        body.to_string().contains("api.example.org") && body.to_string().contains("network_allow"),
        "{body}"
    );
    let (code, out, err) = d
        .cli(&["submit", "--json", "--allow-host", "files.test", task])
        .await;
    assert_eq!(code, 0, "{out}\n{err}");
    let id = serde_json::from_str::<Value>(out.trim())
        .ok()
        .and_then(|v| v["id"].as_str().map(str::to_owned))
        .unwrap_or_else(|| panic!("no id in {out}"));
    d.wait_finished(&id, Duration::from_secs(300)).await;
    let events = d.raw_events(&id, 0).await;
    let nets: Vec<&Value> = events.iter().filter(|e| e["type"] == "net").collect();
    assert_eq!(
        verdicts(nets.iter().copied()),
        [
            (
                "files.test".to_owned(),
                "allowed".to_owned(),
                "files.test".to_owned()
            ),
            (
                "other.test".to_owned(),
                "denied".to_owned(),
                "default".to_owned()
            )
        ],
        "{events:?}"
    );
}

/// A block whose import fails is told how to install the module when the operator's index
/// is reachable; installed in a block of its own, the next block imports it with no path
/// set by hand.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_import_is_told_how_to_install_it_and_the_next_block_imports_it() {
    let net = Internet::new();
    let index = tempfile::tempdir().unwrap();
    tandem_tests::packages::build_index(index.path(), "tandemdemo", "1.0", "VALUE = 42\n");
    net.file_server(80, index.path().to_owned());
    let task = "network: use tandemdemo";
    let server = ScriptedOpenAi::start(script([(
        task,
        vec![
            Reply::Text(fence("python", "import tandemdemo")),
            Reply::Text(fence(
                "python",
                "import subprocess, sys\nprint('pip exit', subprocess.run([sys.executable, '-m', 'pip', 'install', '-q', 'tandemdemo']).returncode)",
            )),
            Reply::Text(fence(
                "python",
                "import tandemdemo\nprint('value', tandemdemo.VALUE)",
            )),
            Reply::from("It is 42.\n\nTERMINATE"),
        ],
    )]))
    .await
    .unwrap();
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("tandem.toml");
    std::fs::write(
        &config,
        format!(
            "[network]\nresolve = {{ \"pypi.test\" = [\"{}\"] }}\n[network.packages]\npython = \"http://pypi.test/simple/\"\ncache_dir = \"{}/cache\"\n",
            net.addr,
            dir.path().display()
        ),
    )
    .unwrap();
    for executor in ["docker", "local"] {
        let out = run_json(&config, &server.base_url(), executor, task).await;
        assert_eq!(out.code, 0, "{executor}: {}\n{}", out.stdout, out.stderr);
        let results = events_of(&out.stdout, "exec_result");
        let printed: Vec<&str> = results
            .iter()
            .map(|r| r["result"]["stdout"].as_str().unwrap_or_default())
            .collect();
        assert_eq!(
            printed,
            ["", "pip exit 0\n", "value 42\n"],
            "{executor}: {results:?}"
        );
        let told = server.requests_for(task).iter().any(|r| {
            r.body
                .to_string()
                .contains("`tandemdemo` is not installed, and can be: run `pip install tandemdemo`")
        });
        assert!(told, "{executor}: the model was not told how to install it");
    }
}

/// `max_connections` and `max_bytes` from tandem.toml hold against a block in a real
/// sandbox: two connections held open leave no room for a third, and a download past the
/// task's bytes is cut.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn max_connections_and_max_bytes_from_the_config_hold_in_a_sandbox() {
    let net = Internet::new();
    let root = tempfile::tempdir().unwrap();
    std::fs::write(root.path().join("hello"), "hello\n").unwrap();
    std::fs::write(root.path().join("big.bin"), vec![1u8; 500_000]).unwrap();
    net.file_server(80, root.path().to_owned());
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("tandem.toml");
    std::fs::write(
        &config,
        format!(
            "[network]\nallow = [\"files.test\"]\nresolve = {{ \"files.test\" = [\"{}\"] }}\nmax_connections = 2\nmax_bytes = 200000\n",
            net.addr
        ),
    )
    .unwrap();
    const FLOOD: &str = r#"import select, socket, time, urllib.request
socks = []
for _ in range(3):
    s = socket.create_connection(("127.0.0.1", 3128), timeout=20)
    s.sendall(b"GET http://files.test/hello HTTP/1.1\r\nHost: files.te")
    socks.append(s)
# Whichever the proxy takes last is refused at once; the other two wait for the rest of their
# request (until the proxy's 10 s for a head).
ready, _, _ = select.select(socks, [], [], 8)
said = [s.recv(400).decode("latin-1") for s in ready]
print("refused:", len(ready), ["403 Forbidden" in a and "max_connections" in a for a in said])
for s in socks:
    s.close()
time.sleep(0.5)
try:
    print("flood:", len(urllib.request.urlopen("http://files.test/big.bin", timeout=30).read()))
except Exception as e:
    print("flood cut:", type(e).__name__)
"#;
    for executor in ["docker", "local"] {
        let out = tandem(
            &[
                "exec",
                "--config",
                config.to_str().unwrap(),
                "-e",
                executor,
                "--lang",
                "python",
            ],
            &[],
            Some(FLOOD),
        )
        .await;
        assert!(
            out.stdout.contains("refused: 1 [True]") && out.stdout.contains("flood cut: "),
            "{executor}: {}\n{}",
            out.stdout,
            out.stderr
        );
        assert!(
            out.stderr
                .contains("net: a connection denied (rule max_connections)")
                && out.stderr.contains("(rule max_bytes)"),
            "{executor}: {}",
            out.stderr
        );
    }
}
