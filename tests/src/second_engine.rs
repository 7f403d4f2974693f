//! A second Docker engine for tests: `dockerd` with its own data root, exec root and pid
//! file, a bridge of its own, listening only on 127.0.0.1 with TLS and client certificates this
//! module makes (with the `openssl` command). It is what a remote host looks like to Tandem.
//! A watchdog shell stops it and removes its directories when the test process ends.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use tandem_executor_docker::TlsFiles;

/// A running second engine.
pub struct SecondEngine {
    /// Where its certificates, data and logs live.
    pub dir: PathBuf,
    /// `tcp://127.0.0.1:PORT`.
    pub url: String,
    /// The client's files that it trusts.
    pub tls: TlsFiles,
    port: u16,
}

fn run(cmd: &mut Command) -> String {
    let out = cmd.output().unwrap_or_else(|e| panic!("{cmd:?}: {e}"));
    assert!(
        out.status.success(),
        "{cmd:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).trim().to_owned()
}

/// A certificate authority, and a certificate it signs for `cn` with `ext`; returns nothing,
/// leaves `{name}.pem` and `{name}-key.pem` in `dir`.
fn sign(dir: &Path, ca: &str, name: &str, cn: &str, ext: &str) {
    let key = dir.join(format!("{name}-key.pem"));
    let csr = dir.join(format!("{name}.csr"));
    run(Command::new("openssl")
        .args(["req", "-newkey", "rsa:2048", "-nodes", "-subj"])
        .arg(format!("/CN={cn}"))
        .arg("-keyout")
        .arg(&key)
        .arg("-out")
        .arg(&csr));
    let ext_file = dir.join(format!("{name}.ext"));
    std::fs::write(&ext_file, ext).unwrap();
    run(Command::new("openssl")
        .args(["x509", "-req", "-days", "3", "-CAcreateserial"])
        .arg("-in")
        .arg(&csr)
        .arg("-CA")
        .arg(dir.join(format!("{ca}.pem")))
        .arg("-CAkey")
        .arg(dir.join(format!("{ca}-key.pem")))
        .arg("-out")
        .arg(dir.join(format!("{name}.pem")))
        .arg("-extfile")
        .arg(&ext_file));
}

/// The bridge every second engine attaches its default network to (the host's `docker0`
/// is the host engine's).
const BRIDGE: &str = "tandem-engine2";

/// A self-signed authority `{name}.pem` / `{name}-key.pem` in `dir`.
pub fn authority(dir: &Path, name: &str) {
    run(Command::new("openssl")
        .args([
            "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "3", "-subj",
        ])
        .arg(format!("/CN={name}"))
        .arg("-keyout")
        .arg(dir.join(format!("{name}-key.pem")))
        .arg("-out")
        .arg(dir.join(format!("{name}.pem"))));
}

/// Client files signed by the authority `ca` in `dir`, named `{name}`.
pub fn client_files(dir: &Path, ca: &str, name: &str) -> TlsFiles {
    sign(dir, ca, name, name, "extendedKeyUsage=clientAuth\n");
    TlsFiles {
        ca: dir.join(format!("{ca}.pem")),
        cert: dir.join(format!("{name}.pem")),
        key: dir.join(format!("{name}-key.pem")),
    }
}

impl SecondEngine {
    /// Starts it and waits (up to a minute) until it answers.
    pub fn start() -> Self {
        let dir = tempfile::Builder::new()
            .prefix("tandem-engine2-")
            .tempdir()
            .unwrap()
            .keep();
        authority(&dir, "ca");
        sign(
            &dir,
            "ca",
            "server",
            "localhost",
            "subjectAltName=IP:127.0.0.1,DNS:localhost\nextendedKeyUsage=serverAuth\n",
        );
        let tls = client_files(&dir, "ca", "client");
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let engine = Self {
            url: format!("tcp://127.0.0.1:{port}"),
            dir,
            tls,
            port,
        };
        engine.launch(true);
        engine
    }

    /// Starts `dockerd` on this engine's directories, under a watchdog that stops it (and
    /// removes the directories, on the first launch's watchdog) once this process is gone.
    fn launch(&self, first: bool) {
        let driver = run(Command::new("docker").args(["info", "--format", "{{.Driver}}"]));
        std::fs::write(self.dir.join("daemon.json"), "{}").unwrap();
        // A bridge of its own: a dockerd told `--bridge=none` deletes the host's `docker0` at
        // start, which the host engine's networked containers need.
        let _ = Command::new("ip")
            .args(["link", "add", BRIDGE, "type", "bridge"])
            .output();
        run(Command::new("ip").args(["addr", "replace", "10.254.254.1/24", "dev", BRIDGE]));
        run(Command::new("ip").args(["link", "set", BRIDGE, "up"]));
        let d = self.dir.display();
        let dockerd = format!(
            "dockerd --config-file {d}/daemon.json --data-root {d}/data --exec-root {d}/exec --pidfile {d}/dockerd.pid --bridge={BRIDGE} --iptables=false --ip-masq=false --storage-driver {driver} -H tcp://127.0.0.1:{port} --tlsverify --tlscacert {d}/ca.pem --tlscert {d}/server.pem --tlskey {d}/server-key.pem",
            port = self.port
        );
        // The watchdog outlives a killed dockerd (the tests kill it on purpose) and ends
        // with the test process.
        let watchdog = format!(
            "{dockerd} >>{d}/dockerd.log 2>&1 &\necho $! > {d}/launched.pid\nwhile kill -0 {test} 2>/dev/null; do sleep 1; done\npid=$(cat {d}/dockerd.pid 2>/dev/null)\n[ -n \"$pid\" ] && kill -TERM $pid 2>/dev/null\nfor i in $(seq 30); do [ -n \"$pid\" ] && kill -0 $pid 2>/dev/null || break; sleep 1; done\n{cleanup}\n",
            test = std::process::id(),
            cleanup = if first {
                // dockerd mounts its data root over itself; the mount outlives it.
                format!(
                    "sleep 2; umount -l {d}/data 2>/dev/null; umount -l {d}/exec 2>/dev/null; rm -rf {d}"
                )
            } else {
                String::new()
            }
        );
        // Started in the background of a shell that returns at once, so that nothing here
        // waits on it and it is no child of this process.
        let started = Command::new("sh")
            .arg("-c")
            .arg(format!("( {watchdog} ) &"))
            .stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .status()
            .expect("sh, to start a second dockerd");
        assert!(started.success(), "the shell that starts dockerd failed");
        let deadline = Instant::now() + Duration::from_secs(60);
        while self
            .cli_status(&["version", "--format", "{{.Server.Version}}"])
            .is_err()
        {
            assert!(
                Instant::now() < deadline,
                "the second dockerd did not answer within 60 s; its log:\n{}",
                std::fs::read_to_string(self.dir.join("dockerd.log")).unwrap_or_default()
            );
            std::thread::sleep(Duration::from_millis(200));
        }
    }

    /// `docker` against this engine.
    pub fn cli(&self, args: &[&str]) -> String {
        self.cli_status(args).unwrap_or_else(|e| panic!("{e}"))
    }

    fn cli_status(&self, args: &[&str]) -> Result<String, String> {
        let out = Command::new("docker")
            .arg("--tlsverify")
            .arg("--tlscacert")
            .arg(&self.tls.ca)
            .arg("--tlscert")
            .arg(&self.tls.cert)
            .arg("--tlskey")
            .arg(&self.tls.key)
            .args(["-H", &self.url])
            .args(args)
            .output()
            .map_err(|e| e.to_string())?;
        if out.status.success() {
            Ok(String::from_utf8_lossy(&out.stdout).trim().to_owned())
        } else {
            Err(format!(
                "docker {args:?} on the second engine: {}",
                String::from_utf8_lossy(&out.stderr)
            ))
        }
    }

    /// Kills the engine at once (SIGKILL): what a machine that dies looks like to Tandem.
    /// Its containers' processes are killed too, so nothing answers for them.
    pub fn kill(&self) {
        // The containers' processes first: their init is pid 1 of their namespace, so the
        // rest go with it.
        let ids = self.cli(&["ps", "-q"]);
        for id in ids.lines() {
            // A container that is not running says 0, and `kill 0` means this process group.
            if let Ok(pid) = self.cli_status(&["inspect", "-f", "{{.State.Pid}}", id])
                && pid.parse::<u32>().is_ok_and(|p| p > 1)
            {
                let _ = Command::new("kill").args(["-KILL", &pid]).status();
            }
        }
        let pid = std::fs::read_to_string(self.dir.join("dockerd.pid")).unwrap_or_default();
        let pid = pid.trim();
        // Its containerd and the containers' shims go with it, as with a machine that dies
        // (the pattern is in their command lines, not in the watchdog's).
        let _ = Command::new("pkill")
            .args([
                "-KILL",
                "-f",
                &format!("{}/exec/containerd/containerd", self.dir.display()),
            ])
            .status();
        if pid.parse::<u32>().is_ok_and(|p| p > 1) {
            let _ = Command::new("kill").args(["-KILL", pid]).status();
        }
        let deadline = Instant::now() + Duration::from_secs(30);
        while self.cli_status(&["version"]).is_ok() && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(100));
        }
        let _ = std::fs::remove_file(self.dir.join("dockerd.pid"));
    }

    /// Starts it again on the same directories (its images are still there).
    pub fn restart(&self) {
        self.launch(false);
    }
}

/// The test binary's one second engine, started on first use with the sandbox image copied
/// into it by Tandem (`DockerExecutor::load_image_from`, export from the system engine and
/// import here). Tests that kill or restart it take [`EXCLUSIVE`] for writing; the others
/// hold it for reading while they use the engine.
pub async fn shared() -> &'static SecondEngine {
    static ENGINE: tokio::sync::OnceCell<SecondEngine> = tokio::sync::OnceCell::const_new();
    ENGINE
        .get_or_init(|| async {
            let engine = tokio::task::spawn_blocking(SecondEngine::start)
                .await
                .expect("starting the second engine");
            let image = image();
            let system = tandem_executor_docker::DockerExecutor::connect(
                tandem_executor_docker::DockerConfig {
                    image: image.clone(),
                    pull: false,
                    pool_size: 0,
                    ..Default::default()
                },
            )
            .await
            .unwrap_or_else(|e| panic!("the system engine: {e}"));
            let remote = tandem_executor_docker::DockerExecutor::connect(engine.config("b"))
                .await
                .unwrap_or_else(|e| panic!("the second engine: {e}"));
            if !remote.image_present().await.unwrap_or(false) {
                remote
                    .load_image_from(&system)
                    .await
                    .unwrap_or_else(|e| panic!("loading the image into the second engine: {e}"));
            }
            engine
        })
        .await
}

/// Held for reading while a test uses [`shared`], for writing while one kills it.
pub static EXCLUSIVE: tokio::sync::RwLock<()> = tokio::sync::RwLock::const_new(());

/// The sandbox image the tests use.
pub fn image() -> String {
    std::env::var("TANDEM_DOCKER_IMAGE").unwrap_or_else(|_| "tandem-sandbox:latest".to_owned())
}

impl SecondEngine {
    /// A Docker executor's settings for this engine, named `name`: TLS, volume workspaces,
    /// the test image, no warm pool.
    pub fn config(&self, name: &str) -> tandem_executor_docker::DockerConfig {
        tandem_executor_docker::DockerConfig {
            name: name.to_owned(),
            host: self.url.clone(),
            tls: Some(self.tls.clone()),
            workspace: tandem_executor_docker::WorkspaceMode::Volume,
            image: image(),
            pull: false,
            pool_size: 0,
            ..Default::default()
        }
    }
}
