//! A guest's stdout or stderr, captured straight into a bounded [`CaptureBuffer`] and the live
//! sink, with no pipe or reader task in between.

use std::io;
use std::pin::Pin;
use std::sync::{Arc, Mutex, PoisonError};
use std::task::{Context, Poll};

use bytes::Bytes;
use tandem_executor::{CaptureBuffer, Captured, OutputSink, Stream};
use wasmtime_wasi::cli::{IsTerminal, StdoutStream};
use wasmtime_wasi::p2::{OutputStream, Pollable, StreamResult};

/// How much the guest may write per `check_write`; WASI splits bigger writes.
const WRITE_BUDGET: usize = 1 << 20;

/// One captured stream; clones share the buffer (WASI asks for a stream per descriptor).
#[derive(Clone)]
pub(crate) struct Capture {
    stream: Stream,
    sink: OutputSink,
    buffer: Arc<Mutex<CaptureBuffer>>,
}

impl Capture {
    pub(crate) fn new(stream: Stream, cap: usize, sink: OutputSink) -> Self {
        Self {
            stream,
            sink,
            buffer: Arc::new(Mutex::new(CaptureBuffer::new(cap))),
        }
    }

    /// Appends bytes, passing the part within the cap on to the live sink.
    pub(crate) fn push(&self, data: &[u8]) {
        let live = self
            .buffer
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .push(data);
        if live > 0 {
            (self.sink)(self.stream, &data[..live]);
        }
    }

    /// What was captured; the stream is empty afterwards.
    pub(crate) fn take(&self) -> Captured {
        let mut buffer = self.buffer.lock().unwrap_or_else(PoisonError::into_inner);
        std::mem::replace(&mut *buffer, CaptureBuffer::new(0)).finish()
    }
}

impl IsTerminal for Capture {
    fn is_terminal(&self) -> bool {
        false
    }
}

impl StdoutStream for Capture {
    fn async_stream(&self) -> Box<dyn tokio::io::AsyncWrite + Send + Sync> {
        Box::new(self.clone())
    }

    fn p2_stream(&self) -> Box<dyn OutputStream> {
        Box::new(self.clone())
    }
}

impl OutputStream for Capture {
    fn write(&mut self, bytes: Bytes) -> StreamResult<()> {
        self.push(&bytes);
        Ok(())
    }

    fn flush(&mut self) -> StreamResult<()> {
        Ok(())
    }

    fn check_write(&mut self) -> StreamResult<usize> {
        Ok(WRITE_BUDGET)
    }
}

#[wasmtime_wasi::async_trait]
impl Pollable for Capture {
    async fn ready(&mut self) {}
}

impl tokio::io::AsyncWrite for Capture {
    fn poll_write(
        self: Pin<&mut Self>,
        _cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        self.push(buf);
        Poll::Ready(Ok(buf.len()))
    }

    fn poll_flush(self: Pin<&mut Self>, _cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Poll::Ready(Ok(()))
    }

    fn poll_shutdown(self: Pin<&mut Self>, _cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Poll::Ready(Ok(()))
    }
}
