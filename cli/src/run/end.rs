//! What both drivers do around a task: the transcript, the pictures read from a workspace,
//! Ctrl-C, and what was kept of the files the task made.

use std::path::PathBuf;
use std::sync::{Arc, Mutex};

use tandem_executor::CancellationToken;
use tandem_protocol::EventMsg;

use super::workspace::OwnWorkspace;
use crate::exit;
use crate::render::{Mode, PictureSource, Pictures, Renderer};

/// What a task run in this process leaves to keep: its own workspace, the files it was given
/// (packed), and where what it made goes.
pub(super) struct Kept {
    /// The archive of the files the task was given.
    pub(super) packed: PathBuf,
    /// Where the files it made go.
    pub(super) out: PathBuf,
    /// Its workspace.
    pub(super) own: OwnWorkspace,
    /// The task's id.
    pub(super) id: String,
    /// Most bytes kept.
    pub(super) max: u64,
    /// The same, as the flag gave it.
    pub(super) max_mb: u64,
}

/// Copies what the task made out of its workspace, says what was kept, and gives the run's
/// exit code: the task's `code`, or [`exit::NOT_KEPT`].
pub(super) async fn keep_here(
    task: Kept,
    renderer: &Mutex<Renderer<std::io::Stdout>>,
    code: u8,
) -> u8 {
    let Kept {
        packed: inputs,
        out,
        own,
        id,
        max,
        max_mb,
    } = task;
    let (ws, task) = (own.path.clone(), id.clone());
    let kept = tokio::task::spawn_blocking(move || {
        let given = std::fs::File::open(&inputs)
            .ok()
            .map(|f| tandem_executor_kit::made::Given::of_archive(std::io::BufReader::new(f)))
            .transpose()
            .map_err(|e| format!("cannot read back the files the task was given: {e}"))?
            .unwrap_or_default();
        let made = tandem_executor_kit::made::made(&ws, &given, crate::keep::MADE_SCAN)
            .map_err(|e| format!("cannot list what the task made: {e}"))?;
        let made = made.into_iter().map(crate::keep::Made::from).collect();
        Ok::<_, String>(crate::keep::from_workspace(&ws, made, &out, &task, max))
    })
    .await
    .map_err(|e| format!("keeping the task's files stopped: {e}"))
    .and_then(|k| k)
    .unwrap_or_else(|e| crate::keep::Kept {
        not_kept: Some(e),
        ..Default::default()
    });
    let left = if kept.whole() {
        own.remove();
        None
    } else {
        Some(own.keep(&id))
    };
    let how = match &left {
        Some(dir) => format!(
            "raise it to keep them; the whole workspace stays in {}",
            dir.display()
        ),
        None => "raise it to keep them".to_owned(),
    };
    let code = report_kept(renderer, &kept, max_mb, &how, code);
    if kept.lost_any()
        && let Some(dir) = &left
    {
        eprintln!(
            "tandem: nothing is lost: the task's whole workspace stays in {}",
            dir.display()
        );
    }
    code
}

/// Says what was kept of a task's files and what could not be, and gives the run's exit
/// code: the task's own, or [`exit::NOT_KEPT`] when it was done but a file it made was not
/// kept.
pub(super) fn report_kept(
    renderer: &Mutex<Renderer<std::io::Stdout>>,
    kept: &crate::keep::Kept,
    max_mb: u64,
    how: &str,
    code: u8,
) -> u8 {
    if let Ok(mut r) = renderer.lock() {
        r.kept(kept, max_mb, how);
    }
    if let Some(why) = &kept.not_kept {
        eprintln!("tandem: {why}");
    }
    for (file, why) in &kept.failed {
        eprintln!("tandem: could not keep {}: {why}", file.shown());
    }
    if kept.lost_any() && code == exit::DONE {
        exit::NOT_KEPT
    } else {
        code
    }
}

/// Pictures read from `workspace`, a host directory, as a download reads them.
pub(crate) fn workspace_pictures(workspace: PathBuf) -> crate::render::PictureSource {
    Box::new(move |file, _| {
        use std::io::Read as _;
        let (f, size) = tandem_executor_kit::archive::read(&workspace, file).ok()?;
        if size > crate::picture::MAX_BYTES {
            return None;
        }
        let mut data = Vec::new();
        f.take(size).read_to_end(&mut data).ok()?;
        Some(data)
    })
}

/// The transcript on standard output, as both roads write it: JSON lines, or for a person
/// with a header naming `place` and pictures from `source` where the terminal shows them.
pub(super) fn renderer(
    json: bool,
    no_pictures: bool,
    source: Option<PictureSource>,
    place: Option<&str>,
) -> Arc<Mutex<Renderer<std::io::Stdout>>> {
    let mode = Mode::json(json);
    let pictures = source.and_then(|s| Pictures::for_stdout(no_pictures, mode, s));
    let mut renderer = Renderer::stdout(mode).pictures(pictures);
    if let Some(place) = place {
        renderer.set_place(place);
    }
    Arc::new(Mutex::new(renderer))
}

/// The event sink that writes a task run in this process to `renderer`; when nobody reads
/// it any more (`| head`), the task is cancelled and cleans up.
pub(super) fn transcript(
    renderer: &Arc<Mutex<Renderer<std::io::Stdout>>>,
    cancel: &CancellationToken,
) -> tandem_agent::EventSink {
    let (sink_renderer, cancel) = (renderer.clone(), cancel.clone());
    Arc::new(move |msg: EventMsg| {
        if let Ok(mut r) = sink_renderer.lock() {
            r.event(&msg);
            if r.error.is_some() {
                cancel.cancel();
            }
        }
    })
}

/// First Ctrl-C cancels cleanly (sandbox closed); a second one exits at once.
pub fn spawn_ctrl_c(cancel: CancellationToken) {
    tokio::spawn(async move {
        if tokio::signal::ctrl_c().await.is_ok() {
            eprintln!("\ntandem: cancelling (Ctrl-C again to quit at once)");
            cancel.cancel();
            if tokio::signal::ctrl_c().await.is_ok() {
                std::process::exit(i32::from(exit::CANCELLED));
            }
        }
    });
}
