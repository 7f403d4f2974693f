//! The channel code in a block calls its task's tools over: one JSON line per call, each
//! answered by one line, on a descriptor the block inherits (never a socket anyone can
//! reach), each call carrying the block's secret.

use std::path::Path;

use tokio::io::{AsyncBufReadExt, AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, BufReader};

pub use tandem_executor::ToolHandler;

/// The Python module code calls tools with (`import tandem_tools`).
pub const MODULE_PY: &str = include_str!("tandem_tools.py");
/// The command a shell block calls tools with (`tandem-tool NAME JSON`).
pub const COMMAND: &str = include_str!("tandem-tool");

/// Longest request line read; a longer one ends the channel.
const MAX_LINE: u64 = 4 << 20;

/// Writes the module and the command into `dir`, for a session's blocks to find on their
/// `PYTHONPATH` and `PATH`.
pub fn install(dir: &Path) -> std::io::Result<()> {
    use std::os::unix::fs::PermissionsExt;
    std::fs::create_dir_all(dir)?;
    std::fs::write(dir.join("tandem_tools.py"), MODULE_PY)?;
    let command = dir.join("tandem-tool");
    std::fs::write(&command, COMMAND)?;
    std::fs::set_permissions(&command, std::fs::Permissions::from_mode(0o755))
}

/// A fresh secret for one block's channel.
pub fn secret() -> String {
    uuid::Uuid::new_v4().simple().to_string()
}

/// Answers the calls on `stream` with `handler` until it closes: each request must carry
/// `token`, or it is refused and the channel closed.
pub async fn serve<S>(stream: S, token: String, handler: ToolHandler)
where
    S: AsyncRead + AsyncWrite + Unpin,
{
    let (read, mut write) = tokio::io::split(stream);
    let mut lines = BufReader::new(read);
    loop {
        let mut line = Vec::new();
        // Through `take`, which reads from the one buffer: nothing past the line is lost.
        match (&mut lines)
            .take(MAX_LINE)
            .read_until(b'\n', &mut line)
            .await
        {
            Ok(0) | Err(_) => return,
            Ok(_) => {}
        }
        if !line.ends_with(b"\n") {
            let _ = write
                .write_all(
                    answer_line(Err("the request is longer than 4 MiB".to_owned())).as_bytes(),
                )
                .await;
            return;
        }
        let (reply, trusted) = match serde_json::from_slice::<Request>(&line) {
            Ok(req) if req.token == token => (
                handler(req.name, req.arguments.get().to_owned()).await,
                true,
            ),
            Ok(_) => (
                Err(
                    "the call carries a wrong token; this channel serves only its own block"
                        .to_owned(),
                ),
                false,
            ),
            Err(e) => (Err(format!("the request is not a call ({e})")), true),
        };
        if write
            .write_all(answer_line(reply).as_bytes())
            .await
            .is_err()
            || !trusted
        {
            return;
        }
    }
}

#[derive(serde::Deserialize)]
struct Request {
    #[serde(default)]
    token: String,
    name: String,
    arguments: Box<serde_json::value::RawValue>,
}

fn answer_line(reply: Result<String, String>) -> String {
    let value = match reply {
        Ok(result) => serde_json::json!({"ok": true, "result": result}),
        Err(error) => serde_json::json!({"ok": false, "error": error}),
    };
    format!("{value}\n")
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;
    use tokio::io::AsyncReadExt;

    #[tokio::test]
    async fn a_call_with_another_token_is_refused_and_the_channel_closed() {
        let (ours, mut theirs) = tokio::net::UnixStream::pair().unwrap();
        let calls = Arc::new(std::sync::Mutex::new(Vec::new()));
        let seen = calls.clone();
        let handler: ToolHandler = Arc::new(move |name, args| {
            seen.lock().unwrap().push((name.clone(), args));
            Box::pin(async move { Ok(format!("ran {name}")) })
        });
        let served = tokio::spawn(serve(ours, "right".to_owned(), handler));
        theirs
            .write_all(b"{\"token\": \"right\", \"name\": \"a\", \"arguments\": {\"x\": 1}}\n")
            .await
            .unwrap();
        theirs
            .write_all(b"{\"token\": \"forged\", \"name\": \"b\", \"arguments\": {}}\n")
            .await
            .unwrap();
        let mut answers = String::new();
        theirs.read_to_string(&mut answers).await.unwrap();
        assert_eq!(
            answers,
            "{\"ok\":true,\"result\":\"ran a\"}\n{\"error\":\"the call carries a wrong token; this channel serves only its own block\",\"ok\":false}\n"
        );
        // The forged call never reached a tool, and the channel is closed after it.
        assert_eq!(
            *calls.lock().unwrap(),
            [("a".to_owned(), "{\"x\": 1}".to_owned())]
        );
        served.await.unwrap();
    }

    #[tokio::test]
    async fn a_line_past_the_cap_ends_the_channel() {
        let (ours, mut theirs) = tokio::net::UnixStream::pair().unwrap();
        let handler: ToolHandler = Arc::new(|_, _| Box::pin(async { Ok(String::new()) }));
        let served = tokio::spawn(serve(ours, "t".to_owned(), handler));
        let writer = tokio::spawn(async move {
            let chunk = vec![b'x'; 1 << 20];
            for _ in 0..5 {
                if theirs.write_all(&chunk).await.is_err() {
                    break;
                }
            }
            let mut answer = String::new();
            let _ = theirs.read_to_string(&mut answer).await;
            answer
        });
        // The channel ends (the answer that says why may be lost with the unread bytes); a
        // server that read on for ever would fail this, not hang it.
        tokio::time::timeout(std::time::Duration::from_secs(60), served)
            .await
            .expect("the channel did not end at the cap")
            .unwrap();
        let answer = writer.await.unwrap();
        assert!(
            answer.is_empty() || answer.contains("longer than 4 MiB"),
            "{answer}"
        );
    }
}
