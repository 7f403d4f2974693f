//! Ports published through the daemon: which task's sandboxes can be reached, and the signed
//! links a browser uses instead of the token.

use std::collections::HashMap;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use sha2::{Digest, Sha256};
use tandem_executor::{
    BoxFuture, ExecContext, ExecError, ExecOutcome, ExecRequest, Executor, HostStatus, Language,
    Ports, Session, SessionSpec,
};

/// Whose ports: a task's or a session's (`/v1/tasks/{id}` or `/v1/sessions/{id}`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Holder {
    /// A task's sandboxes.
    Task,
    /// An API session's sandbox.
    Session,
}

impl Holder {
    /// The word in its paths.
    pub fn word(self) -> &'static str {
        match self {
            Holder::Task => "tasks",
            Holder::Session => "sessions",
        }
    }
}

/// The open task sandboxes whose ports can be reached, by task id; a task with several (a
/// team) has each, newest first.
#[derive(Clone, Default)]
pub struct PortBook {
    open: Arc<Mutex<HashMap<String, Vec<Entry>>>>,
    next: Arc<AtomicU64>,
    announce: Option<Announce>,
}

/// One open sandbox in the book: its number there, and its ports.
type Entry = (u64, Arc<dyn Ports>);

/// Told of each port a task's code starts listening on, once per sandbox, after the block
/// that left it listening.
pub type Announce = Arc<dyn Fn(u16, Arc<dyn Ports>) + Send + Sync>;

impl PortBook {
    fn add(&self, task: &str, ports: Arc<dyn Ports>) -> u64 {
        let n = self.next.fetch_add(1, Ordering::Relaxed);
        if let Ok(mut open) = self.open.lock() {
            open.entry(task.to_owned())
                .or_default()
                .insert(0, (n, ports));
        }
        n
    }

    fn remove(&self, task: &str, n: u64) {
        if let Ok(mut open) = self.open.lock()
            && let Some(list) = open.get_mut(task)
        {
            list.retain(|(m, _)| *m != n);
            if list.is_empty() {
                open.remove(task);
            }
        }
    }

    /// A book that, after each block, tells `announce` of the ports newly listened on.
    pub fn announcing(announce: Announce) -> Self {
        Self {
            announce: Some(announce),
            ..Self::default()
        }
    }

    /// The ways in to `task`'s open sandboxes, newest first (empty when none is open).
    pub fn of(&self, task: &str) -> Vec<Arc<dyn Ports>> {
        self.open
            .lock()
            .ok()
            .and_then(|open| {
                open.get(task)
                    .map(|l| l.iter().map(|(_, p)| p.clone()).collect())
            })
            .unwrap_or_default()
    }

    /// `executor`, whose sessions are entered here under `task` while they are open.
    pub fn publishing(&self, executor: Arc<dyn Executor>, task: &str) -> Arc<dyn Executor> {
        Arc::new(Publishing {
            inner: executor,
            to: Target::Now(self.clone(), task.to_owned()),
        })
    }

    /// `executor`, whose sessions are entered in the book `late` names once it is set (a
    /// team's executors are made before its task has an id); before, they are not.
    pub fn publishing_late(executor: Arc<dyn Executor>, late: Arc<LateBook>) -> Arc<dyn Executor> {
        Arc::new(Publishing {
            inner: executor,
            to: Target::Late(late),
        })
    }
}

/// The book and task a team's sessions are published under, set once the task has an id.
#[derive(Default)]
pub struct LateBook(std::sync::OnceLock<(PortBook, String)>);

impl LateBook {
    /// Publishes under `task` in `book` from now on (the first call wins).
    pub fn set(&self, book: &PortBook, task: &str) {
        let _ = self.0.set((book.clone(), task.to_owned()));
    }
}

/// Where a [`Publishing`] executor's sessions go.
enum Target {
    Now(PortBook, String),
    Late(Arc<LateBook>),
}

struct Publishing {
    inner: Arc<dyn Executor>,
    to: Target,
}

impl Executor for Publishing {
    fn name(&self) -> &str {
        self.inner.name()
    }
    fn languages(&self) -> &[Language] {
        self.inner.languages()
    }
    fn open(&self, spec: SessionSpec) -> BoxFuture<'_, Result<Box<dyn Session>, ExecError>> {
        Box::pin(async move {
            let session = self.inner.open(spec).await?;
            let (book, task) = match &self.to {
                Target::Now(book, task) => (book, task),
                Target::Late(late) => match late.0.get() {
                    Some((book, task)) => (book, task),
                    None => return Ok(session),
                },
            };
            let entry = session.ports().map(|p| book.add(task, p));
            Ok(Box::new(Published {
                inner: Some(session),
                book: book.clone(),
                task: task.clone(),
                entry,
                told: Arc::default(),
            }) as Box<dyn Session>)
        })
    }
    fn supports(&self, language: &Language) -> bool {
        self.inner.supports(language)
    }
    fn health(&self) -> BoxFuture<'_, Result<(), String>> {
        self.inner.health()
    }
    fn keeps_state(&self) -> bool {
        self.inner.keeps_state()
    }
    fn carries_tool_calls(&self) -> bool {
        self.inner.carries_tool_calls()
    }
    fn carries_egress(&self) -> bool {
        self.inner.carries_egress()
    }
    fn mounts_volumes(&self) -> bool {
        self.inner.mounts_volumes()
    }
    fn pools(&self) -> Vec<tandem_executor::PoolStatus> {
        self.inner.pools()
    }
    fn network(&self) -> bool {
        self.inner.network()
    }
    fn hosts(&self) -> Vec<HostStatus> {
        self.inner.hosts()
    }
}

/// A task's session, in the book while it is open.
struct Published {
    inner: Option<Box<dyn Session>>,
    book: PortBook,
    task: String,
    entry: Option<u64>,
    /// The ports already announced.
    told: Arc<Mutex<Vec<u16>>>,
}

impl Published {
    fn leave(&mut self) {
        if let Some(n) = self.entry.take() {
            self.book.remove(&self.task, n);
        }
    }
}

impl Drop for Published {
    fn drop(&mut self) {
        self.leave();
    }
}

impl Session for Published {
    fn run(
        &mut self,
        req: ExecRequest,
        ctx: ExecContext,
    ) -> BoxFuture<'_, Result<ExecOutcome, ExecError>> {
        Box::pin(async move {
            let Some(inner) = self.inner.as_mut() else {
                return Err(ExecError::Backend("the session is closed".to_owned()));
            };
            let ran = inner.run(req, ctx).await?;
            // Asked beside the turn, not in its way: listing costs the engine an exec.
            if let (Some(announce), Some(ports)) = (self.book.announce.clone(), inner.ports()) {
                let told = self.told.clone();
                tokio::spawn(async move {
                    match ports.listening().await {
                        Ok(listening) => {
                            let new: Vec<u16> = match told.lock() {
                                Ok(mut told) => listening
                                    .into_iter()
                                    .filter(|p| {
                                        let new = !told.contains(p);
                                        if new {
                                            told.push(*p);
                                        }
                                        new
                                    })
                                    .collect(),
                                Err(_) => Vec::new(),
                            };
                            for port in new {
                                announce(port, ports.clone());
                            }
                        }
                        Err(e) => tracing::debug!(error = %e, "listing a sandbox's ports failed"),
                    }
                });
            }
            Ok(ran)
        })
    }
    fn workspace(&self) -> Option<&Path> {
        self.inner.as_ref().and_then(|s| s.workspace())
    }
    fn host(&self) -> Option<&str> {
        self.inner.as_ref().and_then(|s| s.host())
    }
    fn pool_wait(&self) -> Option<std::time::Duration> {
        self.inner.as_ref().and_then(|s| s.pool_wait())
    }
    fn ports(&self) -> Option<Arc<dyn Ports>> {
        self.inner.as_ref().and_then(|s| s.ports())
    }
    fn put_archive(
        &mut self,
        archive: &Path,
        caps: tandem_executor::files::ArchiveCaps,
    ) -> BoxFuture<'_, Result<Vec<tandem_executor::files::ArchivedFile>, ExecError>> {
        match self.inner.as_mut() {
            Some(inner) => inner.put_archive(archive, caps),
            None => Box::pin(async { Err(ExecError::Backend("the session is closed".to_owned())) }),
        }
    }
    fn save_state(
        &mut self,
        dest: &Path,
        max_bytes: u64,
        wait: std::time::Duration,
    ) -> BoxFuture<'_, Result<Option<tandem_executor::SavedState>, ExecError>> {
        match self.inner.as_mut() {
            Some(inner) => inner.save_state(dest, max_bytes, wait),
            None => Box::pin(async { Err(ExecError::Backend("the session is closed".to_owned())) }),
        }
    }
    fn close(mut self: Box<Self>) -> BoxFuture<'static, Result<(), ExecError>> {
        // Out of the book before the sandbox goes: no new connection is sent to it.
        self.leave();
        let inner = self.inner.take();
        Box::pin(async move {
            match inner {
                Some(inner) => inner.close().await,
                None => Ok(()),
            }
        })
    }
}

/// Signs and checks links to a port that work without the token until they expire. The key
/// is made when the daemon starts: a restart ends every link.
pub struct Links {
    key: [u8; 64],
}

impl Default for Links {
    fn default() -> Self {
        let mut key = [0u8; 64];
        for chunk in key.chunks_mut(16) {
            chunk.copy_from_slice(uuid::Uuid::new_v4().as_bytes());
        }
        Self { key }
    }
}

impl Links {
    fn mac(&self, what: &str) -> String {
        // HMAC-SHA256 (RFC 2104) over the link's fields.
        let mut inner = Sha256::new();
        inner.update(self.key.map(|b| b ^ 0x36));
        inner.update(what.as_bytes());
        let mut outer = Sha256::new();
        outer.update(self.key.map(|b| b ^ 0x5c));
        outer.update(inner.finalize());
        hex::encode(outer.finalize())
    }

    fn fields(holder: Holder, id: &str, port: u16, expires: u64) -> String {
        format!("{}/{id}/{port}/{expires}", holder.word())
    }

    /// The link's one path segment for `port` of `id`, good until `expires` (seconds since
    /// the epoch).
    pub fn sign(&self, holder: Holder, id: &str, port: u16, expires: u64) -> String {
        let kind = match holder {
            Holder::Task => 't',
            Holder::Session => 's',
        };
        format!(
            "{kind}.{id}.{port}.{expires}.{}",
            self.mac(&Self::fields(holder, id, port, expires))
        )
    }

    /// What a link segment opens, if it is one of ours and has not expired at `now`; else
    /// why not.
    pub fn check(&self, link: &str, now: u64) -> Result<(Holder, String, u16), &'static str> {
        let parts: Vec<&str> = link.split('.').collect();
        let [kind, id, port, expires, mac] = parts[..] else {
            return Err("it is not a port link");
        };
        let holder = match kind {
            "t" => Holder::Task,
            "s" => Holder::Session,
            _ => return Err("it is not a port link"),
        };
        let (Ok(port), Ok(expires)) = (port.parse::<u16>(), expires.parse::<u64>()) else {
            return Err("it is not a port link");
        };
        let want = self.mac(&Self::fields(holder, id, port, expires));
        if !bool::from(subtle::ConstantTimeEq::ct_eq(
            want.as_bytes(),
            mac.as_bytes(),
        )) {
            return Err("its signature is wrong (links end when the daemon restarts)");
        }
        if expires <= now {
            return Err("it has expired");
        }
        Ok((holder, id.to_owned(), port))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn links_open_only_what_they_name_until_they_expire() {
        let links = Links::default();
        let link = links.sign(Holder::Task, "abc", 8000, 100);
        assert_eq!(
            links.check(&link, 99),
            Ok((Holder::Task, "abc".to_owned(), 8000))
        );
        assert_eq!(links.check(&link, 100), Err("it has expired"));
        // Any field changed breaks the signature.
        for forged in [
            link.replacen("t.", "s.", 1),
            link.replacen(".8000.", ".8001.", 1),
            link.replacen(".100.", ".1000.", 1),
            link.replacen("abc", "abd", 1),
        ] {
            assert!(links.check(&forged, 0).is_err(), "{forged}");
        }
        assert!(Links::default().check(&link, 0).is_err());
        assert!(links.check("t.a.b", 0).is_err());
    }
}
