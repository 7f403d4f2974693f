//! Following a task on the daemon to its end: its events rendered as they come, Ctrl-C
//! cancelling it there, and its approvals answered at this terminal or said how to decide.

use std::sync::{Arc, Mutex};

use anyhow::Result;
use tandem_protocol::EventMsg;

use crate::approve::answer_on_daemon;
use crate::client::Client;
use crate::exit;
use crate::render::{Mode, Renderer};

/// Follows a task to its end, rendering its events; Ctrl-C cancels it on the daemon.
pub async fn follow(client: &Client, id: &str, mode: Mode) -> Result<u8> {
    let renderer = Arc::new(Mutex::new(Renderer::stdout(mode)));
    Ok(follow_approving(client, id, &renderer, false).await?.code)
}

/// How following a task ended.
pub struct Followed {
    /// The exit code for it.
    pub code: u8,
    /// Whether the task finished (rather than the stream breaking off, or its reader going).
    pub finished: bool,
}

/// [`follow`] into `renderer`, answering the task's approvals at this terminal when
/// `approve`; otherwise a block that waits says how to decide it.
pub async fn follow_approving(
    client: &Client,
    id: &str,
    renderer: &Arc<Mutex<Renderer<std::io::Stdout>>>,
    approve: bool,
) -> Result<Followed> {
    let answer = approve.then(|| answer_on_daemon(client, id));
    if let Ok(mut r) = renderer.lock() {
        r.set_place(format!("on the daemon at {}", client.host));
    }
    let cancel_client_id = id.to_owned();
    let canceller = client.clone();
    let ctrl_c = tokio::spawn(async move {
        if tokio::signal::ctrl_c().await.is_ok() {
            eprintln!(
                "\ntandem: cancelling task {cancel_client_id} (Ctrl-C again to stop watching)"
            );
            let _ = canceller.cancel(&cancel_client_id).await;
            if tokio::signal::ctrl_c().await.is_ok() {
                std::process::exit(i32::from(exit::CANCELLED));
            }
        }
    });
    let r = renderer.clone();
    let last = client
        .events(id, 0, true, &mut |e| {
            if let Ok(mut r) = r.lock() {
                r.event(&e.msg);
            }
            if let EventMsg::ApprovalRequested {
                n,
                language,
                code,
                reason,
                ..
            } = &e.msg
            {
                match &answer {
                    Some(tx) => {
                        let _ = tx.send((*n, language.clone(), code.clone(), reason.clone()));
                    }
                    None => eprintln!(
                        "tandem: block waits for approval {n}: `tandem approve {id} {n}` runs it, `tandem deny {id} {n} --reason WHY` declines it"
                    ),
                }
            }
        })
        .await;
    ctrl_c.abort();
    if renderer.lock().is_ok_and(|r| r.reader_gone()) {
        return Ok(Followed {
            code: exit::DONE,
            finished: false,
        });
    }
    match last?.map(|e| e.msg) {
        Some(EventMsg::TaskFinished { stop_reason, .. }) => Ok(Followed {
            code: exit::for_stop(stop_reason),
            finished: true,
        }),
        _ => {
            // Never silent: the user is told where the task is and how to see the rest.
            eprintln!(
                "tandem: the event stream of task {id} ended before the task did; `tandem logs -f {id}` follows it again"
            );
            Ok(Followed {
                code: exit::FAILED,
                finished: false,
            })
        }
    }
}
