//! Running one block: write it into the workspace, instantiate the runtime afresh with the
//! workspace preopened, call `_start` under the limits, and classify how it ended.

use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use tandem_executor::{
    ExecContext, ExecError, ExecOutcome, ExecRequest, ExitStatus, PeakScope, Resources, Stream,
};
use tandem_executor_kit::process::{Bounded, bounded};
use tandem_executor_kit::workspace::{BlockScript, write_block_script};
use wasmtime::component::{self, ResourceTable};
use wasmtime::{InstancePre, ResourceLimiter, Store, Trap};
use wasmtime_wasi::p1::WasiP1Ctx;
use wasmtime_wasi::{FsPerms, I32Exit, WasiCtx, WasiCtxBuilder, WasiCtxView, WasiView};

use crate::capture::Capture;
use crate::{Pre, WasmSession};

/// Where the guest sees its session's workspace.
pub(crate) const GUEST_WORKSPACE: &str = "/workspace";

/// Where the guest sees Tandem's support files (read-only).
pub(crate) const GUEST_SUPPORT: &str = "/tandem";

/// The guest's whole environment; nothing comes from the host.
const GUEST_ENV: &[(&str, &str)] = &[
    ("HOME", GUEST_WORKSPACE),
    ("PYTHONPATH", GUEST_SUPPORT),
    ("PYTHONDONTWRITEBYTECODE", "1"),
    ("PYTHONUNBUFFERED", "1"),
];

/// Fuel burnt between yields to the async runtime when a CPU budget is set.
const FUEL_YIELD_INTERVAL: u64 = 10_000_000;

/// Largest table a guest may grow to, in elements.
const TABLE_ELEMENTS_MAX: usize = 1 << 20;

/// A store's data: the guest's WASI context (preview 1, or [`P2`]) and its memory cap.
pub(crate) struct Guest<W> {
    pub(crate) wasi: W,
    cap: MemoryCap,
}

/// A preview 2 guest's WASI state.
pub(crate) struct P2 {
    ctx: WasiCtx,
    table: ResourceTable,
}

impl WasiView for Guest<P2> {
    fn ctx(&mut self) -> WasiCtxView<'_> {
        WasiCtxView {
            ctx: &mut self.wasi.ctx,
            table: &mut self.wasi.table,
        }
    }
}

/// Refuses memory growth past the cap (the guest's allocator then fails cleanly, which
/// CPython reports as `MemoryError`) and remembers that it did.
#[derive(Clone, Copy)]
struct MemoryCap {
    max: usize,
    refused: bool,
    /// The largest linear memory granted: the block's peak, as a fresh store is its own.
    peak: usize,
}

impl ResourceLimiter for MemoryCap {
    fn memory_growing(
        &mut self,
        _current: usize,
        desired: usize,
        _maximum: Option<usize>,
    ) -> wasmtime::Result<bool> {
        if desired > self.max {
            self.refused = true;
            return Ok(false);
        }
        self.peak = self.peak.max(desired);
        Ok(true)
    }

    fn table_growing(
        &mut self,
        _current: usize,
        desired: usize,
        _maximum: Option<usize>,
    ) -> wasmtime::Result<bool> {
        Ok(desired <= TABLE_ELEMENTS_MAX)
    }
}

pub(crate) async fn run_block(
    session: &mut WasmSession,
    req: ExecRequest,
    ctx: ExecContext,
) -> Result<ExecOutcome, ExecError> {
    let Some(runtime) = session.inner.runtime_for(&req.language) else {
        return Err(ExecError::unsupported(
            &req.language,
            "wasm",
            &session.inner.languages,
        ));
    };
    let prepared = session.inner.prepared(runtime).await?;
    let BlockScript {
        path: host_path,
        transient,
    } = match write_block_script(
        &session.workspace,
        &req.code,
        session.blocks,
        req.language.extension(),
    ) {
        Ok(script) => script,
        Err(e) => return Ok(ExecOutcome::refused(&e.to_string())),
    };
    let Ok(rel) = host_path.strip_prefix(&session.workspace) else {
        return Ok(ExecOutcome::refused("the script path left the workspace"));
    };
    let guest_path = format!("{GUEST_WORKSPACE}/{}", rel.display());
    let timeout = req.timeout.unwrap_or(session.limits.wall);
    let result = execute(
        session,
        &prepared.pre,
        runtime.argv(&guest_path),
        &guest_path,
        timeout,
        ctx,
    )
    .await;
    if transient {
        let _ = tokio::fs::remove_file(&host_path).await;
    }
    result
}

/// How a guest run ended.
type Ended = Bounded<wasmtime::Result<i32>>;

async fn execute(
    session: &WasmSession,
    pre: &Pre,
    argv: Vec<String>,
    guest_path: &str,
    timeout: Duration,
    ctx: ExecContext,
) -> Result<ExecOutcome, ExecError> {
    let inner = &session.inner;
    let limits = &session.limits;
    let stdout = Capture::new(Stream::Stdout, limits.output_bytes, ctx.sink.clone());
    let stderr = Capture::new(Stream::Stderr, limits.output_bytes, ctx.sink.clone());
    let mut wasi = WasiCtxBuilder::new();
    wasi.args(&argv)
        .envs(GUEST_ENV)
        .stdout(stdout.clone())
        .stderr(stderr.clone())
        .preopened_dir(&session.workspace, GUEST_WORKSPACE, FsPerms::ReadWrite)
        .and_then(|w| w.preopened_dir(&inner.support, GUEST_SUPPORT, FsPerms::ReadOnly))
        .map_err(|e| {
            ExecError::Backend(format!(
                "cannot open the workspace {} for the guest: {e}",
                session.workspace.display()
            ))
        })?;
    let max = limits.memory_bytes.map_or(inner.config.memory_bytes, |m| {
        m.min(inner.config.memory_bytes)
    });
    let cap = MemoryCap {
        max: usize::try_from(max).unwrap_or(usize::MAX),
        refused: false,
        peak: 0,
    };
    let cpu = Arc::new(AtomicU64::new(0));
    let _ticking = inner.ticker.activate();
    let started = Instant::now();
    let (ended, cap) = match pre {
        Pre::Module(pre) => {
            let mut store = new_store(session, wasi.build_p1(), cap)?;
            let run = CpuTimed::new(start_command(pre, &mut store), cpu.clone());
            let ended = supervise(run, timeout, &ctx).await;
            (ended, store.data().cap)
        }
        Pre::Component(pre) => {
            let p2 = P2 {
                ctx: wasi.build(),
                table: ResourceTable::new(),
            };
            let mut store = new_store(session, p2, cap)?;
            let run = CpuTimed::new(call_run(pre, &mut store, guest_path), cpu.clone());
            let ended = supervise(run, timeout, &ctx).await;
            (ended, store.data().cap)
        }
    };
    let duration = started.elapsed();
    let (status, note) = classify(ended, cap.refused);
    if let Some(note) = note {
        stderr.push(format!("\n[tandem] {note}\n").as_bytes());
    }
    Ok(ExecOutcome {
        status,
        stdout: stdout.take(),
        stderr: stderr.take(),
        duration,
        resources: Some(Resources {
            cpu_secs: Some(cpu.load(Ordering::Relaxed) as f64 / 1e9),
            peak_memory_bytes: Some(u64::try_from(cap.peak).unwrap_or(u64::MAX)),
            peak_memory_scope: Some(PeakScope::Block),
            source: Some("wasmtime".to_owned()),
            unavailable: Some(
                "bytes written are not counted for WASM blocks (their files are the host's, written through WASI)"
                    .to_owned(),
            ),
            ..Resources::default()
        }),
    })
}

/// A future whose polls are timed by the polling thread's CPU clock: the guest runs only
/// inside them, so their sum is its CPU time (plus wasmtime's own, a small part).
struct CpuTimed<F> {
    inner: Pin<Box<F>>,
    spent: Arc<AtomicU64>,
}

impl<F> CpuTimed<F> {
    fn new(inner: F, spent: Arc<AtomicU64>) -> Self {
        Self {
            inner: Box::pin(inner),
            spent,
        }
    }
}

fn thread_cpu_ns() -> u64 {
    nix::time::clock_gettime(nix::time::ClockId::CLOCK_THREAD_CPUTIME_ID).map_or(0, |t| {
        u64::try_from(t.tv_sec()).unwrap_or(0) * 1_000_000_000
            + u64::try_from(t.tv_nsec()).unwrap_or(0)
    })
}

impl<F: Future> Future for CpuTimed<F> {
    type Output = F::Output;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<F::Output> {
        let before = thread_cpu_ns();
        let polled = self.inner.as_mut().poll(cx);
        let spent = thread_cpu_ns().saturating_sub(before);
        self.spent.fetch_add(spent, Ordering::Relaxed);
        polled
    }
}

/// A store with the memory cap, epoch yields and the optional fuel budget.
fn new_store<W: Send>(
    session: &WasmSession,
    wasi: W,
    cap: MemoryCap,
) -> Result<Store<Guest<W>>, ExecError> {
    let inner = &session.inner;
    let mut store = Store::new(&inner.engine, Guest { wasi, cap });
    store.limiter(|guest| &mut guest.cap);
    store.set_epoch_deadline(1);
    store.epoch_deadline_async_yield_and_update(1);
    if let Some(fuel) = inner.config.fuel {
        store
            .set_fuel(fuel)
            .and_then(|()| store.fuel_async_yield_interval(Some(FUEL_YIELD_INTERVAL)))
            .map_err(|e| ExecError::Backend(format!("setting the CPU budget failed: {e}")))?;
    }
    Ok(store)
}

/// Runs the guest until it ends, times out or is cancelled. The guest yields at every epoch
/// tick, which is when the timeout and the cancel token get their chance.
async fn supervise(
    run: impl Future<Output = wasmtime::Result<i32>>,
    timeout: Duration,
    ctx: &ExecContext,
) -> Ended {
    bounded(run, timeout, &ctx.cancel).await
}

/// A fresh instance of a command and its `_start`: each block gets clean interpreter state.
async fn start_command(
    pre: &InstancePre<Guest<WasiP1Ctx>>,
    store: &mut Store<Guest<WasiP1Ctx>>,
) -> wasmtime::Result<i32> {
    let instance = pre.instantiate_async(&mut *store).await?;
    let entry = instance.get_typed_func::<(), ()>(&mut *store, "_start")?;
    entry.call_async(&mut *store, ()).await?;
    Ok(0)
}

/// A fresh instance of the pre-initialised component, told to run `path`.
async fn call_run(
    pre: &component::InstancePre<Guest<P2>>,
    store: &mut Store<Guest<P2>>,
    path: &str,
) -> wasmtime::Result<i32> {
    let instance = pre.instantiate_async(&mut *store).await?;
    let run = instance.get_typed_func::<(&str,), (i32,)>(&mut *store, "run")?;
    let (code,) = run.call_async(&mut *store, (path,)).await?;
    Ok(code)
}

const SIGABRT: i32 = 6;
const SIGSEGV: i32 = 11;

/// The status of a run and a one-line note for the model when the guest did not simply exit;
/// never a wasmtime backtrace.
fn classify(ended: Ended, memory_refused: bool) -> (ExitStatus, Option<String>) {
    let error = match ended {
        Ended::Cancelled => return (ExitStatus::Cancelled, None),
        Ended::TimedOut => return (ExitStatus::TimedOut, None),
        Ended::Finished(Ok(code)) => return (ExitStatus::Exited(code), None),
        Ended::Finished(Err(e)) => e,
    };
    if let Some(exit) = error.downcast_ref::<I32Exit>() {
        return (ExitStatus::Exited(exit.0), None);
    }
    let oom = || {
        (
            ExitStatus::OutOfMemory,
            Some("the program ran out of memory (the WASM memory cap was reached)".to_owned()),
        )
    };
    match error.downcast_ref::<Trap>() {
        Some(Trap::OutOfFuel) => (
            ExitStatus::TimedOut,
            Some("the program used up its CPU budget (wasmtime fuel)".to_owned()),
        ),
        Some(Trap::Interrupt) => (ExitStatus::TimedOut, None),
        Some(Trap::StackOverflow) => (
            ExitStatus::Signaled(SIGSEGV),
            Some("the program overflowed its stack (wasm trap: call stack exhausted)".to_owned()),
        ),
        Some(_) | None if memory_refused => oom(),
        Some(Trap::UnreachableCodeReached) => (
            ExitStatus::Signaled(SIGABRT),
            Some("the program aborted (wasm trap: unreachable instruction)".to_owned()),
        ),
        Some(trap) => (
            ExitStatus::Signaled(SIGSEGV),
            Some(format!("the program crashed ({trap})")),
        ),
        // Only the outermost message: the rest is a wasmtime backtrace.
        None => (
            ExitStatus::Signaled(SIGABRT),
            Some(format!("the WASM runtime stopped the program: {error}")),
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn returned(error: impl std::error::Error + Send + Sync + 'static) -> Ended {
        Ended::Finished(Err(wasmtime::Error::new(error)))
    }

    #[test]
    fn traps_become_outcomes_with_a_note() {
        assert_eq!(
            classify(returned(I32Exit(7)), false),
            (ExitStatus::Exited(7), None)
        );
        assert_eq!(
            classify(Ended::Finished(Ok(3)), false).0,
            ExitStatus::Exited(3)
        );
        let (status, note) = classify(returned(Trap::OutOfFuel), false);
        assert_eq!(status, ExitStatus::TimedOut);
        assert!(note.unwrap().contains("CPU budget"));
        let (status, note) = classify(returned(Trap::StackOverflow), true);
        assert_eq!(status, ExitStatus::Signaled(SIGSEGV));
        assert!(note.unwrap().contains("stack"));
        assert_eq!(
            classify(returned(Trap::UnreachableCodeReached), true).0,
            ExitStatus::OutOfMemory
        );
        assert_eq!(
            classify(returned(Trap::UnreachableCodeReached), false).0,
            ExitStatus::Signaled(SIGABRT)
        );
        let (status, note) = classify(returned(Trap::MemoryOutOfBounds), false);
        assert_eq!(status, ExitStatus::Signaled(SIGSEGV));
        assert_eq!(
            note.as_deref(),
            Some("the program crashed (wasm trap: out of bounds memory access)")
        );
        assert_eq!(
            classify(Ended::Cancelled, true),
            (ExitStatus::Cancelled, None)
        );
    }
}
