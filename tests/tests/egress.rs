//! A Docker sandbox behind the egress proxy, against servers in a network namespace the test
//! makes: what its policy allows answers with no flags in the code, and everything else
//! (another host, its address, raw TCP around the proxy, UDP, a resolver) does not. Through
//! the proxy, from inside the sandbox, each way past the policy an attacker tries (another
//! port, an IP literal, IPv6, the metadata address, a name resolving to the machine itself
//! or to a private address, a `Host` that differs from the target, a tunnel whose TLS names
//! another host) is refused and recorded as a denied connection naming its rule.

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

# Through the proxy, each a way an attacker tries past the policy.
def asked(url):
    try:
        urllib.request.urlopen(url, timeout=20)
        return "reached"
    except urllib.error.HTTPError as e:
        return "%d %s" % (e.code, e.headers.get("X-Tandem-Rule"))
for what, url in [
    ("other port", "http://files.test:8080/"),
    ("ip literal", "http://ADDR/"),
    ("ipv6", "http://[2001:db8::1]/"),
    ("metadata via proxy", "http://169.254.169.254/latest/meta-data/"),
    ("own address", "http://own.test/"),
    ("rebinding", "http://rebind.test/"),
]:
    print(what + ":", asked(url))

def head_of(sock):
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(1)
        if not chunk:
            break
        data += chunk
    lines = data.decode("latin-1").split("\r\n")
    rule = [l.split(":", 1)[1].strip() for l in lines if l.lower().startswith("x-tandem-rule:")]
    return lines[0].split(" ")[1] if lines[0] else "closed", rule[0] if rule else None
for what, head in [
    ("host mismatch", b"GET http://files.test/hello HTTP/1.1\r\nHost: other.test\r\n\r\n"),
    ("loopback via proxy", b"GET http://127.0.0.1:9999/ HTTP/1.1\r\nHost: 127.0.0.1:9999\r\n\r\n"),
]:
    c = socket.create_connection(("127.0.0.1", 3128), timeout=20)
    c.sendall(head)
    print(what + ":", *head_of(c))
    c.close()

# A tunnel to an allowed host whose TLS names another: with no SNI check the handshake
# (unverified, so a certificate for files.test would do) gets through.
import ssl
c = socket.create_connection(("127.0.0.1", 3128), timeout=20)
c.sendall(b"CONNECT files.test:443 HTTP/1.1\r\nHost: files.test:443\r\n\r\n")
print("connect:", *head_of(c))
ctx = ssl.create_default_context()
ctx.check_hostname = False
ctx.verify_mode = ssl.CERT_NONE
try:
    t = ctx.wrap_socket(c, server_hostname="other.test")
    t.sendall(b"GET /hello HTTP/1.1\r\nHost: other.test\r\n\r\n")
    print("sni:", "reached" if t.recv(100) else "closed")
except (ssl.SSLError, OSError) as e:
    print("sni: refused", type(e).__name__)
"#;

/// Opens a session of `executor` behind a proxy allowing `files.test`, as the daemon does
/// (offering a listener in the sandbox's own network), runs the probe in it, and checks what
/// it reached and what the proxy recorded; `open` sees the session while it is open and
/// says whether the probe runs once more.
async fn probe_behind_the_proxy(executor: &dyn tandem_executor::Executor, caught: bool) {
    probe_and_look(executor, caught, || false).await;
}

/// `caught`: whether the daemon manages the sandbox's network, and so catches and records
/// what goes around the proxy (an engine on this machine, the local executor, as root);
/// elsewhere the sandbox has no route at all, and such attempts fail unseen.
async fn probe_and_look(
    executor: &dyn tandem_executor::Executor,
    caught: bool,
    open: impl FnOnce() -> bool,
) {
    let net = Internet::new();
    net.http_server(80);
    net.https_server(443, &["files.test"]);
    net.echo_server(9000);
    let own = tandem_egress::own_addresses();
    // One of this machine's own addresses, not loopback: where the daemon's API and the
    // host's other services listen.
    let host_addr = *own
        .iter()
        .find(|a| a.is_ipv4() && !a.is_loopback())
        .expect("this machine has a non-loopback IPv4 address");
    let egress = Egress::new(ProxyLimits::default(), own);
    // Allowed by name, each resolving inside: the machine itself, and a private address (as
    // a name re-bound after it was allowed would).
    let mut policy =
        Policy::parse(&["files.test", "own.test", "rebind.test"], &[] as &[&str]).unwrap();
    policy.resolve.insert("files.test".into(), vec![net.addr]);
    policy.resolve.insert("own.test".into(), vec![host_addr]);
    policy
        .resolve
        .insert("rebind.test".into(), vec!["10.0.0.1".parse().unwrap()]);
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
        // Caught, a connection around the proxy is refused at once (a reset), and a
        // datagram leaves the block's socket only to be recorded and dropped.
        let (tcp, udp) = if caught {
            ("refused ConnectionRefusedError", "udp: sent")
        } else {
            ("refused", "udp: refused")
        };
        assert!(out.contains(&format!("raw tcp: {tcp}")), "{name}: {out}");
        assert!(out.contains(&format!("metadata: {tcp}")), "{name}: {out}");
        assert!(out.contains("dns: none"), "{name}: {out}");
        assert!(out.contains(udp), "{name}: {out}");
        for line in [
            "other port: 403 default",
            "ip literal: 403 default",
            "ipv6: 403 default",
            "metadata via proxy: 403 default",
            "own address: 403 inside_address",
            "rebinding: 403 inside_address",
            "host mismatch: 403 host_header",
            "loopback via proxy: 403 default",
            "connect: 200 None",
            "sni: refused",
        ] {
            assert!(out.contains(line), "{name}: no {line:?} in\n{out}");
        }
        rounds += 1;
        if !open.take().is_some_and(|look| look()) {
            break;
        }
    }
    session.close().await.unwrap();

    // Connections are recorded as they end, which need not be the order they were made in;
    // every attempt through the proxy is one event, and each refusal names its rule.
    let addr = net.addr.to_string();
    let around = [
        (addr.as_str(), 9000, NetVerdict::Denied, "proxy_only"),
        ("169.254.169.254", 80, NetVerdict::Denied, "proxy_only"),
        (addr.as_str(), 53, NetVerdict::Denied, "proxy_only"),
    ];
    let one_round = [
        ("files.test", 80, NetVerdict::Allowed, "files.test"),
        ("other.test", 80, NetVerdict::Denied, "default"),
        ("files.test", 8080, NetVerdict::Denied, "default"),
        (addr.as_str(), 80, NetVerdict::Denied, "default"),
        ("2001:db8::1", 80, NetVerdict::Denied, "default"),
        ("169.254.169.254", 80, NetVerdict::Denied, "default"),
        ("own.test", 80, NetVerdict::Denied, "inside_address"),
        ("rebind.test", 80, NetVerdict::Denied, "inside_address"),
        ("files.test", 80, NetVerdict::Denied, "host_header"),
        ("127.0.0.1", 9999, NetVerdict::Denied, "default"),
        ("files.test", 443, NetVerdict::Denied, "sni"),
    ];
    let mut want: Vec<(String, u16, NetVerdict, String)> = (0..rounds)
        .flat_map(|_| one_round.iter().chain(around.iter().filter(|_| caught)))
        .map(|(h, p, v, r)| (h.to_string(), *p, *v, r.to_string()))
        .collect();
    let mut got: Vec<(String, u16, NetVerdict, String)> = events
        .0
        .lock()
        .unwrap()
        .iter()
        // The resolver getaddrinfo asks (whatever the sandbox's resolv.conf names) is
        // caught too, but its address is the machine's.
        .filter(|e| !(e.rule == "proxy_only" && e.port == 53 && e.host != addr))
        .map(|e| (e.host.clone(), e.port, e.verdict, e.rule.clone()))
        .collect();
    want.sort_by(|a, b| (&a.0, a.1, &a.3).cmp(&(&b.0, b.1, &b.3)));
    got.sort_by(|a, b| (&a.0, a.1, &a.3).cmp(&(&b.0, b.1, &b.3)));
    assert_eq!(got, want, "{name}");
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
    probe_behind_the_proxy(&docker, true).await;
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
    probe_and_look(&docker, true, || {
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
    probe_and_look(&local, true, || {
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
    probe_behind_the_proxy(&remote, false).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn a_kubernetes_pod_goes_out_through_its_relay_to_the_proxy_and_nowhere_else() {
    // The stand-in applies docs/deploy/kubernetes/'s NetworkPolicy as a real plugin would:
    // the pod has no network of its own, and the relay over the exec stream is its way out.
    let cluster = tandem_tests::kubernetes::FakeCluster::deployed().await;
    let executor = cluster.executor().await;
    probe_behind_the_proxy(&executor, false).await;
    cluster.wait_released().await;
    cluster.stop().await;
}

/// A task's executors (a team's agents) each go behind the proxy on their own, and share one
/// count of what they carried: `max_bytes` bounds the task, not each of them.
#[tokio::test(flavor = "multi_thread")]
async fn the_executors_of_one_task_share_its_max_bytes() {
    use tandem_executor::Executor;
    let net = Internet::new();
    let root = tempfile::tempdir().unwrap();
    std::fs::write(root.path().join("big.bin"), vec![7u8; 300_000]).unwrap();
    net.file_server(80, root.path().to_owned());
    let egress = Egress::new(ProxyLimits::default(), tandem_egress::own_addresses());
    let mut policy = Policy::parse(&["files.test"], &[] as &[&str]).unwrap();
    policy.resolve.insert("files.test".into(), vec![net.addr]);
    policy.max_bytes = Some(500_000);
    let policy = Arc::new(policy);
    let carried = Arc::new(Carried::default());
    let events = Arc::new(Events::default());
    let local: Arc<dyn Executor> = Arc::new(tandem_executor_local::LocalExecutor::new(
        tandem_executor_local::LocalConfig::default(),
    ));
    let fetch = "import urllib.request\ntry:\n    print(len(urllib.request.urlopen('http://files.test/big.bin', timeout=30).read()))\nexcept Exception as e:\n    print('cut:', type(e).__name__)\n";
    for (agent, want) in [("coder", "300000\n"), ("reviewer", "cut: ")] {
        let behind = tandem_egress::Behind::new(
            local.clone(),
            egress.clone(),
            policy.clone(),
            events.clone(),
        )
        .sharing(carried.clone());
        let mut session = behind.open(SessionSpec::default()).await.unwrap();
        let out = session
            .run(
                ExecRequest {
                    timeout: Some(Duration::from_secs(120)),
                    ..ExecRequest::new(Language::python(), fetch)
                },
                ExecContext::new(CancellationToken::new()),
            )
            .await
            .unwrap();
        let printed = out.stdout.to_text();
        assert!(
            printed.starts_with(want),
            "{agent}: {printed}\n{}",
            out.stderr.to_text()
        );
        session.close().await.unwrap();
    }
    // The one count is the task's: both downloads are in it.
    assert!(carried.get() >= 500_000, "{}", carried.get());
}

/// A block that floods the way around the proxy is recorded at a bounded rate, and the
/// record says how many went unrecorded; the daemon reads no faster than it records.
#[tokio::test(flavor = "multi_thread")]
async fn a_flood_around_the_proxy_is_recorded_at_a_bounded_rate() {
    use tandem_executor::Executor;
    let net = Internet::new();
    let egress = Egress::new(ProxyLimits::default(), tandem_egress::own_addresses());
    let policy = Arc::new(Policy::parse(&["files.test"], &[] as &[&str]).unwrap());
    let events = Arc::new(Events::default());
    let local: Arc<dyn Executor> = Arc::new(tandem_executor_local::LocalExecutor::new(
        tandem_executor_local::LocalConfig::default(),
    ));
    let behind = tandem_egress::Behind::new(local, egress, policy, events.clone());
    let mut session = behind.open(SessionSpec::default()).await.unwrap();
    let flood = format!(
        "import socket, time\ns = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)\nt = time.time()\nfor i in range(5000):\n    try:\n        s.sendto(b'x', ('{}', 1000 + i))\n    except OSError:\n        pass\ntime.sleep(1)\nprint('sent in', round(time.time() - t, 1))\n",
        net.addr
    );
    let started = std::time::Instant::now();
    let out = session
        .run(
            ExecRequest {
                timeout: Some(Duration::from_secs(120)),
                ..ExecRequest::new(Language::python(), flood)
            },
            ExecContext::new(CancellationToken::new()),
        )
        .await
        .unwrap();
    assert!(
        out.stdout.to_text().starts_with("sent in"),
        "{}",
        out.stderr.to_text()
    );
    // A last datagram, after the flood, is recorded and tells what went unrecorded.
    let last = format!(
        "import socket, time\ntime.sleep(1)\nsocket.socket(socket.AF_INET, socket.SOCK_DGRAM).sendto(b'x', ('{}', 53))\ntime.sleep(0.5)\n",
        net.addr
    );
    session
        .run(
            ExecRequest::new(Language::python(), last),
            ExecContext::new(CancellationToken::new()),
        )
        .await
        .unwrap();
    let secs = started.elapsed().as_secs_f64();
    session.close().await.unwrap();
    let got = events.0.lock().unwrap().clone();
    let caught: Vec<_> = got.iter().filter(|e| e.rule == "proxy_only").collect();
    assert!(
        caught.len() >= 64 && (caught.len() as f64) <= 64.0 + 16.0 * secs + 2.0,
        "{} recorded in {secs:.1} s",
        caught.len()
    );
    assert!(
        caught.iter().any(|e| e
            .reason
            .as_deref()
            .is_some_and(|r| r.contains("more such attempts just before it were not recorded"))),
        "{caught:?}"
    );
}
