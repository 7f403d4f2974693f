//! `tandem store`: the daemon's task store, outside a daemon: moving tasks from the SQLite
//! file to PostgreSQL.

use std::path::PathBuf;

use anyhow::{Context, Result, bail};
use tandem_daemon::store::PgStore;
use tandem_daemon::{Store, TaskState};

/// What to do with a store.
#[derive(Debug, clap::Subcommand)]
pub enum StoreAction {
    /// Copy a daemon's tasks and their events from its SQLite file into PostgreSQL (tasks
    /// already there are left as they are, so it can run again)
    Migrate {
        /// The SQLite file: a state dir's tandem.db
        #[arg(long, value_name = "FILE")]
        from: PathBuf,
        /// postgres://USER@HOST:PORT/DATABASE; the password comes from PGPASSWORD or
        /// ~/.pgpass (or TANDEM_STORE_URL holds the whole URL), never the command line
        #[arg(
            long,
            value_name = "URL",
            env = "TANDEM_STORE_URL",
            hide_env_values = true
        )]
        to: String,
    },
}

/// Runs `tandem store ACTION`.
pub fn store(action: StoreAction) -> Result<u8> {
    match action {
        StoreAction::Migrate { from, to } => migrate(&from, &to),
    }
}

fn migrate(from: &std::path::Path, to: &str) -> Result<u8> {
    if !from.is_file() {
        bail!(
            "--from {}: no such file; name a state dir's tandem.db (the default state dir is $XDG_STATE_HOME/tandem)",
            from.display()
        );
    }
    // A daemon writing the file would go on after the copy, and its tasks would be in both.
    if let Some(dir) = from.parent() {
        let lock = dir.join("lock");
        if let Ok(file) = std::fs::File::open(&lock)
            && let Err((_, errno)) =
                nix::fcntl::Flock::lock(file, nix::fcntl::FlockArg::LockExclusiveNonblock)
            && errno == nix::errno::Errno::EWOULDBLOCK
        {
            bail!(
                "a daemon is running on {} (it holds {}); stop it before moving its tasks",
                dir.display(),
                lock.display()
            );
        }
    }
    let source = Store::open(from).with_context(|| format!("cannot open {}", from.display()))?;
    let target =
        PgStore::open(to, "--to", &secrets(None)?).context("cannot open the PostgreSQL store")?;
    let mut tasks = Vec::new();
    for task in source.list(None)? {
        let events = source.events_after(&task.id, 0)?;
        tasks.push((task, events));
    }
    let running = tasks
        .iter()
        .filter(|(t, _)| matches!(t.state, TaskState::Running | TaskState::AwaitingApproval))
        .count();
    let done = target.import(tasks)?;
    println!(
        "moved {} tasks ({} events) from {} to {}",
        done.tasks,
        done.events,
        from.display(),
        target.shown()
    );
    if done.present > 0 {
        println!(
            "{} were there already and were left as they are",
            done.present
        );
    }
    if running > 0 {
        println!(
            "{running} were running when their daemon stopped: they are interrupted; `tandem resume ID` continues one"
        );
    }
    Ok(crate::exit::DONE)
}

/// Whether the PostgreSQL URL `url` carries a password (`postgres://user:password@...`).
pub fn has_password(url: &str) -> bool {
    url.parse::<tokio_postgres::Config>()
        .is_ok_and(|c| c.get_password().is_some())
}

/// Where the store's password may come from when its URL has none: `password_file` (the
/// `[store]` key), else `PGPASSWORD`; and the libpq password file (`PGPASSFILE`, else
/// `~/.pgpass`). Read at the binary's edge, once.
pub fn secrets(
    password_file: Option<&std::path::Path>,
) -> Result<tandem_daemon::store::StoreSecrets> {
    let password = match password_file {
        Some(path) => Some(
            std::fs::read_to_string(path)
                .with_context(|| {
                    format!(
                        "[store] password_file {}: cannot read it; make it a file holding the password alone, readable by this user",
                        path.display()
                    )
                })?
                .trim_end_matches(['\n', '\r'])
                .to_owned(),
        ),
        None => crate::config::pg_password_env(),
    };
    let pgpass = crate::config::pg_pass_file();
    Ok(tandem_daemon::store::StoreSecrets { password, pgpass })
}
