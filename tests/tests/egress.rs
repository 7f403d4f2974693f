//! A Docker sandbox behind the egress proxy, against servers in a network namespace the test
//! makes: what its policy allows answers with no flags in the code, and everything else
//! (another host, its address, raw TCP around the proxy, UDP, a resolver) does not.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use tandem_egress::{Carried, Egress, Grant, NetSink, Policy, ProxyLimits};
use tandem_executor::{EgressSocket, ExecContext, ExecRequest, ExitStatus, Language, SessionSpec};
use tandem_executor_docker::{DockerConfig, DockerExecutor};
use tandem_protocol::net::{NetEvent, NetVerdict};
use tandem_tests::internet::Internet;
use tokio_util::sync::CancellationToken;

#[derive(Default)]
struct Events(Mutex<Vec<NetEvent>>);

impl NetSink for Events {
    fn record(&self, event: NetEvent) {
        self.0.lock().unwrap().push(event);
    }
}

const PROBE: &str = r#"
import socket, urllib.request, urllib.error
print("allowed:", urllib.request.urlopen("http://files.test/hello", timeout=20).read().decode().splitlines()[0])
try:
    urllib.request.urlopen("http://other.test/", timeout=20)
    print("other: reached")
except urllib.error.HTTPError as e:
    print("other:", e.code, e.headers.get("X-Tandem-Rule"))
for what, target in [("raw tcp", ("ADDR", 9000)), ("metadata", ("169.254.169.254", 80))]:
    try:
        socket.create_connection(target, timeout=5)
        print(what + ": reached")
    except OSError as e:
        print(what + ": refused", type(e).__name__)
try:
    socket.getaddrinfo("files.test", 80)
    print("dns: resolved")
except OSError as e:
    print("dns: none")
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
try:
    s.sendto(b"x", ("ADDR", 53))
    print("udp: sent")
except OSError as e:
    print("udp: refused", type(e).__name__)
"#;

/// Opens a session of `executor` behind a proxy allowing `files.test`, as the daemon does
/// (offering a listener in the sandbox's own network), runs the probe in it, and checks what
/// it reached and what the proxy recorded; `open` sees the session while it is open and
/// says whether the probe runs once more.
async fn probe_behind_the_proxy(executor: &dyn tandem_executor::Executor) {
    probe_and_look(executor, || false).await;
}

async fn probe_and_look(executor: &dyn tandem_executor::Executor, open: impl FnOnce() -> bool) {
    let net = Internet::new();
    net.http_server(80);
    net.echo_server(9000);
    let egress = Egress::new(ProxyLimits::default(), tandem_egress::own_addresses());
    let mut policy = Policy::parse(&["files.test"], &[] as &[&str]).unwrap();
    policy.resolve.insert("files.test".into(), vec![net.addr]);
    let events = Arc::new(Events::default());
    let dir = tempfile::tempdir().unwrap();
    {
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o711)).unwrap();
    }
    let socket = dir.path().join("proxy.sock");
    let grant = egress
        .listen_unix(
            &socket,
            Grant::new(
                Arc::new(policy),
                Arc::new(Carried::default()),
                events.clone(),
            ),
        )
        .unwrap();
    assert!(
        executor.carries_egress(),
        "{} cannot go behind the proxy",
        executor.name()
    );
    let mut session = executor
        .open(SessionSpec {
            egress: Some(EgressSocket {
                socket: grant.path().to_owned(),
                env: Vec::new(),
                ca_bundle: None,
                adopt: Some(grant.adopter()),
            }),
            ..Default::default()
        })
        .await
        .unwrap();
    let name = executor.name();
    let mut open = Some(open);
    let mut rounds = 0;
    loop {
        let outcome = session
            .run(
                ExecRequest {
                    timeout: Some(Duration::from_secs(120)),
                    ..ExecRequest::new(
                        Language::python(),
                        PROBE.replace("ADDR", &net.addr.to_string()),
                    )
                },
                ExecContext::new(CancellationToken::new()),
            )
            .await
            .unwrap();
        let out = outcome.stdout.to_text();
        assert_eq!(
            outcome.status,
            ExitStatus::Exited(0),
            "{name}: {out}\n{}",
            outcome.stderr.to_text()
        );
        assert!(
            out.contains("allowed: seen: GET /hello HTTP/1.1"),
            "{name}: {out}"
        );
        assert!(out.contains("other: 403 default"), "{name}: {out}");
        assert!(out.contains("raw tcp: refused"), "{name}: {out}");
        assert!(out.contains("metadata: refused"), "{name}: {out}");
        assert!(out.contains("dns: none"), "{name}: {out}");
        assert!(out.contains("udp: refused"), "{name}: {out}");
        rounds += 1;
        if !open.take().is_some_and(|look| look()) {
            break;
        }
    }
    session.close().await.unwrap();

    // Connections are recorded as they end, which need not be the order they were made in.
    let mut got = events.0.lock().unwrap().clone();
    got.sort_by(|a, b| a.host.cmp(&b.host));
    assert_eq!(got.len(), 2 * rounds, "{name}: {got:?}");
    for (i, e) in got.iter().enumerate() {
        let want = if i < rounds {
            ("files.test", NetVerdict::Allowed, "files.test")
        } else {
            ("other.test", NetVerdict::Denied, "default")
        };
        assert_eq!((e.host.as_str(), e.verdict, e.rule.as_str()), want);
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn a_docker_sandbox_behind_the_proxy_reaches_what_its_policy_allows_and_nothing_else() {
    let docker = DockerExecutor::connect(DockerConfig {
        image: std::env::var("TANDEM_DOCKER_IMAGE")
            .unwrap_or_else(|_| "tandem-sandbox:latest".to_owned()),
        pull: false,
        pool_size: 0,
        ..DockerConfig::default()
    })
    .await
    .unwrap_or_else(|e| panic!("these tests need the Docker engine: {e}"));
    probe_behind_the_proxy(&docker).await;
}

/// On an engine on this machine, the container's `127.0.0.1:3128` is a listener this process
/// opened in the container's network namespace: no process in the container holds it, so no
/// relay copies the sandbox's connections (and a block cannot take its place).
#[tokio::test(flavor = "multi_thread")]
async fn a_local_containers_way_out_is_the_proxys_own_listener_in_its_network() {
    let daemon_id = format!("egress-netns-{}", std::process::id());
    let docker = DockerExecutor::connect(DockerConfig {
        image: std::env::var("TANDEM_DOCKER_IMAGE")
            .unwrap_or_else(|_| "tandem-sandbox:latest".to_owned()),
        pull: false,
        pool_size: 0,
        daemon_id: daemon_id.clone(),
        ..DockerConfig::default()
    })
    .await
    .unwrap_or_else(|e| panic!("these tests need the Docker engine: {e}"));
    probe_and_look(&docker, || {
        let run = |program: &str, args: &[&str]| {
            let out = std::process::Command::new(program)
                .args(args)
                .output()
                .unwrap_or_else(|e| panic!("{program}: {e}"));
            String::from_utf8_lossy(&out.stdout).trim().to_owned()
        };
        let filter = format!("label=tandem.daemon={daemon_id}");
        let id = run("docker", &["ps", "-q", "--filter", &filter]);
        assert_eq!(id.lines().count(), 1, "containers: {id:?}");
        let pid = run("docker", &["inspect", "-f", "{{.State.Pid}}", &id]);
        let held = run(
            "nsenter",
            &["-t", &pid, "-n", "ss", "-Hltnp", "sport = :3128"],
        );
        assert!(
            held.contains(&format!("pid={},", std::process::id())) && !held.contains("python"),
            "the container's 3128 is not this process's own listener: {held:?}"
        );
        // Killed, the container is started again for the next block, in a network of its
        // own: the listener is opened there again, and the probe (run once more) holds.
        assert_eq!(run("docker", &["kill", &id]), id);
        true
    })
    .await;
}

#[tokio::test(flavor = "multi_thread")]
async fn a_confined_local_block_behind_the_proxy_reaches_what_its_policy_allows_and_nothing_else() {
    let local =
        tandem_executor_local::LocalExecutor::new(tandem_executor_local::LocalConfig::default());
    // The session's network is held by a process of its fork server's, a descendant of this
    // one; its 127.0.0.1:3128 is a listener the holder handed this process, which no process
    // in that network holds any more (no relay copies the block's connections).
    probe_and_look(&local, || {
        let ours = std::process::id();
        let own_net = std::fs::read_link("/proc/self/ns/net").unwrap();
        let mut nets = std::collections::HashMap::new();
        for entry in std::fs::read_dir("/proc").unwrap().flatten() {
            let Some(pid) = entry
                .file_name()
                .to_str()
                .and_then(|n| n.parse::<u32>().ok())
            else {
                continue;
            };
            let (mut at, mut ours_too) = (pid, false);
            for _ in 0..64 {
                match tandem_tests::parent_of(at) {
                    Some(p) if p == ours => {
                        ours_too = true;
                        break;
                    }
                    Some(p) if p > 1 => at = p,
                    _ => break,
                }
            }
            let net = std::fs::read_link(format!("/proc/{pid}/ns/net")).ok();
            if let Some(net) = net.filter(|n| ours_too && *n != own_net) {
                nets.entry(net).or_insert(pid);
            }
        }
        let held: Vec<String> = nets
            .values()
            .map(|pid| {
                let out = std::process::Command::new("nsenter")
                    .args([
                        "-t",
                        &pid.to_string(),
                        "-n",
                        "ss",
                        "-Hltnp",
                        "sport = :3128",
                    ])
                    .output()
                    .expect("nsenter");
                String::from_utf8_lossy(&out.stdout).trim().to_owned()
            })
            .filter(|l| !l.is_empty())
            .collect();
        assert!(
            !held.is_empty(),
            "no session network with a 3128 listener among {nets:?}"
        );
        for line in &held {
            assert!(
                line.contains(&format!("pid={ours},")) && !line.contains("python"),
                "a session's 3128 is not this process's own listener: {line:?}"
            );
        }
        false
    })
    .await;
}

#[tokio::test(flavor = "multi_thread")]
async fn a_sandbox_on_a_docker_host_over_tls_goes_out_through_its_relay_to_the_proxy() {
    let engine = tandem_tests::second_engine::shared().await;
    let _held = tandem_tests::second_engine::EXCLUSIVE.read().await;
    let remote = DockerExecutor::connect(engine.config("b"))
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    probe_behind_the_proxy(&remote).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn a_kubernetes_pod_goes_out_through_its_relay_to_the_proxy_and_nowhere_else() {
    // The stand-in applies docs/deploy/kubernetes/'s NetworkPolicy as a real plugin would:
    // the pod has no network of its own, and the relay over the exec stream is its way out.
    let cluster = tandem_tests::kubernetes::FakeCluster::deployed().await;
    let executor = cluster.executor().await;
    probe_behind_the_proxy(&executor).await;
    cluster.wait_released().await;
    cluster.stop().await;
}
