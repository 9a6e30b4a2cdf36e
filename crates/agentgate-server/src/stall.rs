//! A connection's writes are bounded in time: a client that stops reading
//! (a stalled event-stream reader, a slow-read attack on a large answer)
//! is cut off after [`WRITE_STALL`] instead of holding its connection, its
//! place under the connection cap and the response's memory forever.
//!
//! hyper has no write timeout, and a body it cannot write is never polled
//! again, so no timer above the socket can see the stall: this wrapper
//! sits between hyper and the socket and fails a write that has waited
//! [`WRITE_STALL`] for the peer to take bytes. hyper then closes the
//! connection, which drops the response (and an event stream's follower).
//!
//! A peer that vanished without a word (half-open: a cable pulled, a NAT
//! entry dropped) never acknowledges what is sent, and the kernel's send
//! buffer takes an idle stream's keep-alive lines for a long time before a
//! write would wait; `TCP_USER_TIMEOUT` ([`UNACKED_LIMIT`]) makes the
//! kernel drop such a connection.

use std::future::Future as _;
use std::io;
use std::pin::Pin;
use std::task::{Context, Poll};

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;
use tokio::time::Sleep;

use crate::limits::{UNACKED_LIMIT, WRITE_STALL};

/// A socket whose writes fail after waiting [`WRITE_STALL`] for room.
pub(crate) struct StallBounded<T> {
    inner: T,
    /// Armed when a write first waits; disarmed by any write that proceeds.
    stalled: Option<Pin<Box<Sleep>>>,
}

impl<T> StallBounded<T> {
    pub(crate) fn new(inner: T) -> Self {
        Self {
            inner,
            stalled: None,
        }
    }

    /// A write is waiting: `Ready(error)` once it has waited
    /// [`WRITE_STALL`], else `Pending` (the timer wakes the task).
    fn waiting(&mut self, cx: &mut Context<'_>) -> Poll<io::Error> {
        let timer = self
            .stalled
            .get_or_insert_with(|| Box::pin(tokio::time::sleep(WRITE_STALL)));
        match timer.as_mut().poll(cx) {
            Poll::Ready(()) => Poll::Ready(io::Error::new(
                io::ErrorKind::TimedOut,
                format!("the client took no bytes for {WRITE_STALL:?}"),
            )),
            Poll::Pending => Poll::Pending,
        }
    }

    /// Passes a write's outcome on, bounding how long it may wait.
    fn bound<R>(
        &mut self,
        cx: &mut Context<'_>,
        polled: Poll<io::Result<R>>,
    ) -> Poll<io::Result<R>> {
        match polled {
            Poll::Pending => self.waiting(cx).map(Err),
            ready => {
                self.stalled = None;
                ready
            }
        }
    }
}

impl<T: AsyncRead + Unpin> AsyncRead for StallBounded<T> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_read(cx, buf)
    }
}

impl<T: AsyncWrite + Unpin> AsyncWrite for StallBounded<T> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let polled = Pin::new(&mut self.inner).poll_write(cx, buf);
        self.bound(cx, polled)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let polled = Pin::new(&mut self.inner).poll_write_vectored(cx, bufs);
        self.bound(cx, polled)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let polled = Pin::new(&mut self.inner).poll_flush(cx);
        self.bound(cx, polled)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let polled = Pin::new(&mut self.inner).poll_shutdown(cx);
        self.bound(cx, polled)
    }
}

/// Asks the kernel to drop `stream` once data it sent stays unacknowledged
/// for [`UNACKED_LIMIT`] (Linux; elsewhere the write bound alone applies).
pub(crate) fn limit_unacked(stream: &TcpStream) {
    #[cfg(target_os = "linux")]
    if let Err(error) = socket2::SockRef::from(stream).set_tcp_user_timeout(Some(UNACKED_LIMIT)) {
        tracing::debug!(%error, "cannot set TCP_USER_TIMEOUT");
    }
    #[cfg(not(target_os = "linux"))]
    let _ = (stream, UNACKED_LIMIT);
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use tokio::io::AsyncWriteExt as _;

    use super::*;

    /// A write into a pipe nobody reads fails `TimedOut` once it has
    /// waited [`WRITE_STALL`], and not before; a pipe that is read never
    /// fails.
    #[tokio::test(start_paused = true)]
    async fn a_write_nobody_takes_fails_after_the_stall_bound() {
        let (near, mut far) = tokio::io::duplex(1024);
        let mut bounded = StallBounded::new(near);
        bounded.write_all(&[7; 1024]).await.unwrap(); // fills the pipe
        let started = tokio::time::Instant::now();
        let error = bounded.write_all(&[7; 16]).await.unwrap_err();
        assert_eq!(error.kind(), io::ErrorKind::TimedOut);
        assert_eq!(started.elapsed(), WRITE_STALL);

        // Read, and the same socket writes again: the timer is disarmed.
        let mut sink = vec![0; 1024];
        tokio::io::AsyncReadExt::read_exact(&mut far, &mut sink)
            .await
            .unwrap();
        bounded.write_all(&[7; 512]).await.unwrap();
    }
}
