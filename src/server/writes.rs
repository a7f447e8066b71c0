//! [`CountedFlushes`]: a connection's socket, counting the flushes that tell a stream what its
//! client took (see [`ClientWrites`]).

use std::io::IoSlice;
use std::pin::Pin;
use std::task::{Context, Poll};

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

use crate::call::ClientWrites;

/// `inner`, with every completed flush counted in `writes`. hyper's HTTP/1.1 flushes its socket
/// only once it has written out all it held, so a count that moved shows that every byte handed
/// to it before is in the socket.
#[derive(Debug)]
pub(super) struct CountedFlushes<T> {
    inner: T,
    writes: ClientWrites,
}

impl<T> CountedFlushes<T> {
    pub(super) fn new(inner: T, writes: ClientWrites) -> CountedFlushes<T> {
        CountedFlushes { inner, writes }
    }
}

impl<T: AsyncRead + Unpin> AsyncRead for CountedFlushes<T> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_read(cx, buf)
    }
}

impl<T: AsyncWrite + Unpin> AsyncWrite for CountedFlushes<T> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        let flushed = Pin::new(&mut self.inner).poll_flush(cx);
        if let Poll::Ready(Ok(())) = flushed {
            self.writes.flushed();
        }
        flushed
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}
