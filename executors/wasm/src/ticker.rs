//! The epoch ticker: one thread per engine that advances wasmtime's epoch while guests run, so
//! that running code yields to the async runtime (where timeouts and cancellation are
//! checked) at every tick. It parks while nothing runs, so an idle daemon does not wake.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::thread::Thread;
use std::time::Duration;

use wasmtime::{Engine, EngineWeak};

/// How often running guests yield; it bounds how late a timeout or cancel can be.
pub(crate) const TICK: Duration = Duration::from_millis(5);

/// Handle to the ticker thread.
pub(crate) struct Ticker {
    active: Arc<AtomicUsize>,
    thread: Thread,
}

impl Ticker {
    /// Starts the thread; it ends shortly after the engine is dropped.
    pub(crate) fn start(engine: &Engine) -> std::io::Result<Self> {
        let active = Arc::new(AtomicUsize::new(0));
        let weak = engine.weak();
        let counter = active.clone();
        let handle = std::thread::Builder::new()
            .name("tandem-wasm-epoch".to_owned())
            .spawn(move || tick(&weak, &counter))?;
        Ok(Self {
            active,
            thread: handle.thread().clone(),
        })
    }

    /// Keeps the ticker running until the returned guard is dropped.
    pub(crate) fn activate(&self) -> Active {
        if self.active.fetch_add(1, Ordering::SeqCst) == 0 {
            self.thread.unpark();
        }
        Active {
            active: self.active.clone(),
        }
    }
}

fn tick(engine: &EngineWeak, active: &AtomicUsize) {
    loop {
        if active.load(Ordering::SeqCst) == 0 {
            // Woken by `activate`; the timeout only notices a dropped engine.
            std::thread::park_timeout(Duration::from_secs(1));
        } else {
            std::thread::sleep(TICK);
        }
        let Some(engine) = engine.upgrade() else {
            return;
        };
        engine.increment_epoch();
    }
}

/// One running guest; the ticker parks once none is left.
pub(crate) struct Active {
    active: Arc<AtomicUsize>,
}

impl Drop for Active {
    fn drop(&mut self) {
        self.active.fetch_sub(1, Ordering::SeqCst);
    }
}
