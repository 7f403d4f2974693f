//! [`Postgres`]: a real PostgreSQL server from the system packages, made by `initdb` into a
//! temporary directory and run as the `postgres` user on a loopback port, for the tests that
//! keep tasks in it. It can be stopped and started again (a database outage); it dies with
//! the test process, whatever way that ends.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::sync::{Mutex, OnceLock};
use std::time::{Duration, Instant};

/// The superuser's password: TCP logins check it.
pub const PASSWORD: &str = "tandem-test";

/// A PostgreSQL server for tests.
pub struct Postgres {
    dir: tempfile::TempDir,
    port: u16,
    bin: PathBuf,
    keeper: Mutex<mpsc::Sender<(Command, mpsc::Sender<()>)>>,
    next_db: std::sync::atomic::AtomicU32,
}

/// Where the server programs are: `TANDEM_PG_BIN`, else the newest under /usr/lib/postgresql.
pub fn bin_dir() -> PathBuf {
    if let Ok(dir) = std::env::var("TANDEM_PG_BIN") {
        return dir.into();
    }
    let mut found: Vec<PathBuf> = std::fs::read_dir("/usr/lib/postgresql")
        .map(|d| d.flatten().map(|e| e.path().join("bin")).collect())
        .unwrap_or_default();
    found.retain(|p| p.join("initdb").exists());
    found.sort_by_key(|p| {
        p.parent()
            .and_then(|v| v.file_name())
            .and_then(|v| v.to_str())
            .and_then(|v| v.parse::<u32>().ok())
            .unwrap_or(0)
    });
    found.pop().expect(
        "PostgreSQL's server programs are not installed (no /usr/lib/postgresql/*/bin/initdb); run scripts/install-test-tools.sh",
    )
}

/// Runs as the `postgres` user when the tests run as root (the server refuses root).
fn as_owner(cmd: &mut Command, die_with_parent: bool) {
    let owner = nix::unistd::geteuid()
        .is_root()
        .then(|| nix::unistd::User::from_name("postgres").ok().flatten())
        .flatten()
        .map(|u| (u.uid, u.gid));
    // SAFETY: between fork and exec the closure only makes system calls (prctl, setgroups,
    // setgid, setuid); it allocates nothing and takes no lock.
    #[allow(unsafe_code)]
    unsafe {
        cmd.pre_exec(move || {
            if let Some((uid, gid)) = owner {
                nix::unistd::setgroups(&[]).map_err(std::io::Error::from)?;
                nix::unistd::setgid(gid).map_err(std::io::Error::from)?;
                nix::unistd::setuid(uid).map_err(std::io::Error::from)?;
            }
            // After the change of user, which clears it.
            if die_with_parent {
                nix::sys::prctl::set_pdeathsig(nix::sys::signal::Signal::SIGQUIT)
                    .map_err(std::io::Error::from)?;
            }
            Ok(())
        });
    }
}

fn chown_to_owner(path: &Path) {
    if !nix::unistd::geteuid().is_root() {
        return;
    }
    let user = nix::unistd::User::from_name("postgres")
        .unwrap()
        .expect("the postgres user exists (it comes with the postgresql package)");
    nix::unistd::chown(path, Some(user.uid), Some(user.gid)).unwrap();
}

impl Postgres {
    /// One server for the whole test process, started on first use.
    pub fn shared() -> &'static Postgres {
        static SHARED: OnceLock<Postgres> = OnceLock::new();
        SHARED.get_or_init(|| Postgres::start(false))
    }

    /// A new server of its own; `durable` keeps fsync on (benchmarks), else it is off.
    pub fn start(durable: bool) -> Self {
        let bin = bin_dir();
        let dir = tempfile::Builder::new()
            .prefix("tandem-pg")
            .tempdir()
            .unwrap();
        chown_to_owner(dir.path());
        let pwfile = dir.path().join("pw");
        std::fs::write(&pwfile, PASSWORD).unwrap();
        chown_to_owner(&pwfile);
        let out = {
            let mut cmd = Command::new(bin.join("initdb"));
            cmd.arg("-D")
                .arg(dir.path().join("data"))
                .args([
                    "-U",
                    "postgres",
                    "--auth-local=trust",
                    "--auth-host=scram-sha-256",
                ])
                .arg(format!("--pwfile={}", pwfile.display()))
                .args(["-E", "UTF8", "--no-sync"])
                .stdin(Stdio::null());
            as_owner(&mut cmd, false);
            cmd.output().unwrap()
        };
        assert!(
            out.status.success(),
            "initdb failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        // One thread owns the server process for its whole life: the server is told to die
        // with that thread, which lives until the server is dropped (or the process ends).
        let (keeper, commands) = mpsc::channel::<(Command, mpsc::Sender<()>)>();
        std::thread::spawn(move || {
            let mut child: Option<Child> = None;
            for (mut cmd, done) in commands {
                if let Some(mut c) = child.take() {
                    // SIGINT: a fast shutdown.
                    let _ = nix::sys::signal::kill(
                        nix::unistd::Pid::from_raw(c.id() as i32),
                        nix::sys::signal::Signal::SIGINT,
                    );
                    let _ = c.wait();
                }
                if cmd.get_program() != "true" {
                    child = Some(cmd.spawn().unwrap());
                }
                let _ = done.send(());
            }
            if let Some(mut c) = child.take() {
                let _ = c.kill();
                let _ = c.wait();
            }
        });
        let pg = Self {
            dir,
            port,
            bin,
            keeper: Mutex::new(keeper),
            next_db: std::sync::atomic::AtomicU32::new(0),
        };
        pg.start_again(durable);
        pg
    }

    fn command(&self, cmd: Command) {
        let (done, wait) = mpsc::channel();
        self.keeper.lock().unwrap().send((cmd, done)).unwrap();
        wait.recv().unwrap();
    }

    /// Starts the server (again, after [`Postgres::stop`]) and waits until it answers.
    pub fn start_again(&self, durable: bool) {
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.dir.path().join("server.log"))
            .unwrap();
        let mut cmd = Command::new(self.bin.join("postgres"));
        cmd.arg("-D")
            .arg(self.dir.path().join("data"))
            .args(["-p", &self.port.to_string()])
            .arg("-k")
            .arg(self.dir.path())
            .args([
                "-c",
                "listen_addresses=127.0.0.1",
                "-c",
                "max_connections=300",
            ])
            .args(["-c", if durable { "fsync=on" } else { "fsync=off" }])
            .args([
                "-c",
                if durable {
                    "synchronous_commit=on"
                } else {
                    "synchronous_commit=off"
                },
            ])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log);
        as_owner(&mut cmd, true);
        self.command(cmd);
        let started = Instant::now();
        while !self.answers() {
            assert!(
                started.elapsed() < Duration::from_secs(60),
                "PostgreSQL did not start:\n{}",
                self.log()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// Stops the server (a fast shutdown: clients are cut off).
    pub fn stop(&self) {
        self.command(Command::new("true"));
    }

    fn answers(&self) -> bool {
        Command::new(self.bin.join("pg_isready"))
            .args(["-h", "127.0.0.1", "-p", &self.port.to_string(), "-q"])
            .status()
            .is_ok_and(|s| s.success())
    }

    /// What the server logged.
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("server.log")).unwrap_or_default()
    }

    /// The loopback port.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// The URL of database `db` as the superuser.
    pub fn url(&self, db: &str) -> String {
        format!(
            "postgres://postgres:{PASSWORD}@127.0.0.1:{}/{db}",
            self.port
        )
    }

    /// Runs `sql` in database `db` with psql; its output.
    pub fn psql(&self, db: &str, sql: &str) -> String {
        let out = Command::new(self.bin.join("psql"))
            .args([
                "-h",
                "127.0.0.1",
                "-p",
                &self.port.to_string(),
                "-U",
                "postgres",
            ])
            .args([
                "-d",
                db,
                "-X",
                "-A",
                "-t",
                "-v",
                "ON_ERROR_STOP=1",
                "-c",
                sql,
            ])
            .env("PGPASSWORD", PASSWORD)
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "psql {sql}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).trim().to_owned()
    }

    /// A new empty database; its URL.
    pub fn new_database(&self) -> String {
        let n = self
            .next_db
            .fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        let name = format!("t{}_{n}", std::process::id());
        self.psql("postgres", &format!("CREATE DATABASE {name}"));
        self.url(&name)
    }
}

impl Drop for Postgres {
    fn drop(&mut self) {
        self.stop();
    }
}
