//! Running one block: write it into the workspace, instantiate the runtime afresh with the
//! workspace preopened, call `_start` under the limits, and classify how it ended.

use std::time::{Duration, Instant};

use tandem_executor::workspace::{filename_directive, resolve_inside};
use tandem_executor::{ExecContext, ExecError, ExecOutcome, ExecRequest, ExitStatus, Stream};
use wasmtime::{InstancePre, ResourceLimiter, Store, Trap};
use wasmtime_wasi::p1::WasiP1Ctx;
use wasmtime_wasi::{FsPerms, I32Exit, WasiCtxBuilder};

use crate::capture::Capture;
use crate::{Runtime, WasmSession};

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

/// A store's data: the guest's WASI context and its memory cap.
pub(crate) struct Guest {
    pub(crate) wasi: WasiP1Ctx,
    cap: MemoryCap,
}

/// Refuses memory growth past the cap (the guest's allocator then fails cleanly, which
/// CPython reports as `MemoryError`) and remembers that it did.
struct MemoryCap {
    max: usize,
    refused: bool,
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
    let Some(runtime) = Runtime::for_language(&req.language) else {
        return Err(ExecError::unsupported(
            &req.language,
            "wasm",
            &session.inner.languages,
        ));
    };
    let prepared = session.inner.prepared(runtime).await?;
    // Unnamed blocks run from a hidden file in the workspace, removed afterwards, so that
    // imports see the files earlier blocks saved.
    let (host_path, transient) = match filename_directive(&req.code) {
        Some(name) => match resolve_inside(&session.workspace, name) {
            Ok(path) => (path, false),
            Err(e) => return Ok(ExecOutcome::refused(&e.to_string())),
        },
        None => {
            let name = format!(
                ".tandem-block-{}.{}",
                session.blocks,
                req.language.extension()
            );
            (session.workspace.join(name), true)
        }
    };
    let Ok(rel) = host_path.strip_prefix(&session.workspace) else {
        return Ok(ExecOutcome::refused("the script path left the workspace"));
    };
    let guest_path = format!("{GUEST_WORKSPACE}/{}", rel.display());
    tokio::fs::write(&host_path, &req.code)
        .await
        .map_err(|e| ExecError::io(format!("writing {}", host_path.display()), e))?;
    let timeout = req.timeout.unwrap_or(session.limits.wall);
    let result = execute(
        session,
        &prepared.pre,
        runtime.argv(&guest_path),
        timeout,
        ctx,
    )
    .await;
    if transient {
        let _ = tokio::fs::remove_file(&host_path).await;
    }
    result
}

/// How the call to `_start` ended.
enum Ended {
    Returned(wasmtime::Result<()>),
    TimedOut,
    Cancelled,
}

async fn execute(
    session: &WasmSession,
    pre: &InstancePre<Guest>,
    argv: Vec<String>,
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
    let mut store = Store::new(
        &inner.engine,
        Guest {
            wasi: wasi.build_p1(),
            cap: MemoryCap {
                max: usize::try_from(max).unwrap_or(usize::MAX),
                refused: false,
            },
        },
    );
    store.limiter(|guest| &mut guest.cap);
    store.set_epoch_deadline(1);
    store.epoch_deadline_async_yield_and_update(1);
    if let Some(fuel) = inner.config.fuel {
        store
            .set_fuel(fuel)
            .and_then(|()| store.fuel_async_yield_interval(Some(FUEL_YIELD_INTERVAL)))
            .map_err(|e| ExecError::Backend(format!("setting the CPU budget failed: {e}")))?;
    }
    let _ticking = inner.ticker.activate();
    let started = Instant::now();
    let ended = tokio::select! {
        biased;
        () = ctx.cancel.cancelled() => Ended::Cancelled,
        () = tokio::time::sleep(timeout) => Ended::TimedOut,
        result = start(pre, &mut store) => Ended::Returned(result),
    };
    let duration = started.elapsed();
    let refused = store.data().cap.refused;
    drop(store);
    let (status, note) = classify(ended, refused);
    if let Some(note) = note {
        stderr.push(format!("\n[tandem] {note}\n").as_bytes());
    }
    Ok(ExecOutcome {
        status,
        stdout: stdout.take(),
        stderr: stderr.take(),
        duration,
    })
}

/// A fresh instance and its `_start`: each block gets clean interpreter state.
async fn start(pre: &InstancePre<Guest>, store: &mut Store<Guest>) -> wasmtime::Result<()> {
    let instance = pre.instantiate_async(&mut *store).await?;
    let entry = instance.get_typed_func::<(), ()>(&mut *store, "_start")?;
    entry.call_async(&mut *store, ()).await
}

const SIGABRT: i32 = 6;
const SIGSEGV: i32 = 11;

/// The status of a run and a one-line note for the model when the guest did not simply exit;
/// never a wasmtime backtrace.
fn classify(ended: Ended, memory_refused: bool) -> (ExitStatus, Option<String>) {
    let error = match ended {
        Ended::Cancelled => return (ExitStatus::Cancelled, None),
        Ended::TimedOut => return (ExitStatus::TimedOut, None),
        Ended::Returned(Ok(())) => return (ExitStatus::Exited(0), None),
        Ended::Returned(Err(e)) => e,
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
