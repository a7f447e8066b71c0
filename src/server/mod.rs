//! A front door that slow and greedy clients cannot take down: the HTTP server the example
//! gateway runs, for any service of [`RequestBody`] requests (an axum `Router`, the
//! [`stack`](crate::stack), your own).
//!
//! It is hyper (HTTP/1.1 and HTTP/2, cleartext) with these limits added:
//! - **request headers** must arrive within [`ServerLimits::header_timeout`] (hyper closes the
//!   connection otherwise);
//! - **connections** are limited ([`ServerLimits::max_connections`], by default derived from
//!   the process's file limit, whose soft value [`raise_file_limit`] lifts to the hard one). At
//!   the limit a new connection still gets in: the connection that has gone longest without
//!   completing a request (idle, reading headers or still sending a body) is closed to make
//!   room. Connections whose request is under way are never closed for this. If every
//!   connection is busy, the new one is closed at once;
//! - a connection that completes no request for [`ServerLimits::idle_timeout`] is closed
//!   (idle keep-alive, and HTTP/2 connections that only hold streams open);
//! - headers larger than [`ServerLimits::max_header_bytes`] are answered
//!   `431 {"detail"}`; hyper itself answers larger ones (above its read buffer) and malformed
//!   request lines with an empty 431 or 400, which no hook lets us change;
//! - each request carries the client's address as axum's `ConnectInfo<SocketAddr>` (what
//!   failed redemptions of codes are counted by);
//! - on HTTP/1.1, each request carries the connection's [`ClientWrites`], so that a stream is
//!   billed only for content its socket accepted (see
//!   [`RefundOnUpstreamError`](crate::RefundOnUpstreamError));
//! - a request refused before its body was read (401, 404, 413) is answered intact on HTTP/2
//!   too: its unread body is kept until the response has been sent, so the stream ends with
//!   the response rather than a reset that makes clients drop it.
//!
//! Request bodies (time-outs, the memory budget) are bounded where they are read, in
//! [`ProtocolRouter`](crate::ProtocolRouter).
//!
//! Any [`TcpListener`] will do; [`bind`] makes one whose queue of connections not yet accepted
//! holds a burst of clients connecting at once ([`DEFAULT_LISTEN_BACKLOG`]).
//!
//! ```no_run
//! use std::convert::Infallible;
//! use model_gateway::server::{DEFAULT_LISTEN_BACKLOG, RequestBody, ServerLimits, bind, serve};
//! use tower::service_fn;
//!
//! # #[tokio::main] async fn main() -> std::io::Result<()> {
//! let listener = bind("127.0.0.1:8080", DEFAULT_LISTEN_BACKLOG).await?;
//! let hello = service_fn(|_request: http::Request<RequestBody>| async {
//!     Ok::<_, Infallible>(http::Response::new(http_body_util::Full::new(bytes::Bytes::from("hi"))))
//! });
//! serve(listener, hello, ServerLimits::default(), std::future::pending()).await
//! # }
//! ```

mod connections;
mod track;
mod writes;

use std::convert::Infallible;
use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::{Request, Response};
use http_body::Body;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use tokio::net::{TcpListener, TcpSocket, ToSocketAddrs};
use tower_service::Service;

use crate::call::ClientWrites;
use connections::Connections;
use tower::BoxError;
pub use track::{RequestBody, ResponseFuture, Tracked, TrackedBody};
use writes::CountedFlushes;

/// Default time a client has to send a request's headers.
pub const DEFAULT_HEADER_TIMEOUT: Duration = Duration::from_secs(15);

/// Default time a connection may go without completing a request.
pub const DEFAULT_IDLE_TIMEOUT: Duration = Duration::from_secs(60);

/// Default largest header block answered by the service (larger ones get `431 {"detail"}`).
pub const DEFAULT_MAX_HEADER_BYTES: usize = 64 * 1024;

/// Default length of a listener's queue of connections the kernel has completed and the server
/// not yet accepted (see [`bind`]).
pub const DEFAULT_LISTEN_BACKLOG: u32 = 4096;

/// File descriptors kept back from the connection limit for everything else the process opens
/// (database connections, the `SQLite` file, log files).
const RESERVED_FILES: u64 = 64;

/// The server's limits. Build with [`ServerLimits::default`] and change what you need.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct ServerLimits {
    /// Time a client has to send a request's headers (HTTP/1.1).
    pub header_timeout: Duration,
    /// Time a connection may go without completing a request before it is closed.
    pub idle_timeout: Duration,
    /// Most client connections at once.
    pub max_connections: usize,
    /// Largest header block the service sees; larger ones are answered 431.
    pub max_header_bytes: usize,
}

impl Default for ServerLimits {
    /// The defaults, with the connection limit derived from the process's file limit as it is
    /// now (call [`raise_file_limit`] first to derive it from the raised one).
    fn default() -> ServerLimits {
        ServerLimits {
            header_timeout: DEFAULT_HEADER_TIMEOUT,
            idle_timeout: DEFAULT_IDLE_TIMEOUT,
            max_connections: connections_for_file_limit(file_limit()),
            max_header_bytes: DEFAULT_MAX_HEADER_BYTES,
        }
    }
}

/// The connection limit for a process that may open `files` files: each client connection may
/// hold one upstream connection too (a stream), and 64 are kept for the rest (database
/// connections, the `SQLite` file, logs).
pub fn connections_for_file_limit(files: u64) -> usize {
    let per_client = 2;
    (files.saturating_sub(RESERVED_FILES) / per_client).max(16) as usize
}

/// Raises the soft limit on open files to the hard limit; returns the limit now in force.
pub fn raise_file_limit() -> u64 {
    match rlimit::increase_nofile_limit(u64::MAX) {
        Ok(limit) => limit,
        Err(error) => {
            tracing::warn!(%error, "could not raise the open-file limit");
            file_limit()
        }
    }
}

/// The soft limit on open files (a generous guess where the OS does not say).
fn file_limit() -> u64 {
    rlimit::getrlimit(rlimit::Resource::NOFILE).map_or(1024, |(soft, _)| soft)
}

/// Binds a listener on the first of `address`'s addresses that binds, with a queue of `backlog`
/// connections the kernel has completed and the server not yet accepted.
///
/// A client that connects while the queue is full is not refused: its connection attempt is
/// dropped, and its system tries again only a second later. [`TcpListener::bind`]'s queue
/// holds 128 (the standard library's value), which a burst of clients connecting at once (a
/// fleet reconnecting after a restart, a load balancer's warm-up) can overflow; the OS caps
/// `backlog` (on Linux at `net.core.somaxconn`, 4096 by default since Linux 5.4). As with
/// [`TcpListener::bind`], the address may be reused at once after a restart (Unix).
pub async fn bind(address: impl ToSocketAddrs, backlog: u32) -> std::io::Result<TcpListener> {
    let mut last_error = None;
    for address in tokio::net::lookup_host(address).await? {
        match listen_on(address, backlog) {
            Ok(listener) => return Ok(listener),
            Err(error) => last_error = Some(error),
        }
    }
    Err(last_error.unwrap_or_else(|| {
        std::io::Error::new(
            std::io::ErrorKind::InvalidInput,
            "the address resolved to no address to bind",
        )
    }))
}

fn listen_on(address: SocketAddr, backlog: u32) -> std::io::Result<TcpListener> {
    let socket = if address.is_ipv4() {
        TcpSocket::new_v4()?
    } else {
        TcpSocket::new_v6()?
    };
    #[cfg(unix)]
    socket.set_reuseaddr(true)?;
    socket.bind(address)?;
    socket.listen(backlog)
}

/// Serves `service` on `listener` with `limits` until `shutdown` completes, then stops
/// accepting, lets the requests under way finish, and returns.
pub async fn serve<S, B>(
    listener: TcpListener,
    service: S,
    limits: ServerLimits,
    shutdown: impl Future<Output = ()>,
) -> std::io::Result<()>
where
    S: Service<Request<RequestBody>, Response = Response<B>, Error = Infallible>
        + Clone
        + Send
        + 'static,
    S::Future: Send + 'static,
    B: Body<Data = Bytes> + Send + Unpin + 'static,
    B::Error: Into<BoxError>,
{
    let connections = Connections::new(limits.max_connections);
    let reaper = tokio::spawn(connections.clone().close_idle(limits.idle_timeout));
    let (stop, stopping) = tokio::sync::watch::channel(false);
    let mut builder = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new());
    builder
        .http1()
        .timer(TokioTimer::new())
        .header_read_timeout(limits.header_timeout)
        .max_buf_size(limits.max_header_bytes.max(8192) * 4);
    builder.http2().timer(TokioTimer::new());
    let builder = Arc::new(builder);
    tokio::pin!(shutdown);
    loop {
        let (stream, peer) = tokio::select! {
            () = &mut shutdown => break,
            accepted = listener.accept() => match accepted {
                Ok(accepted) => accepted,
                Err(error) => {
                    // Out of file handles or a connection reset before it was accepted: wait a
                    // little rather than spin.
                    tracing::warn!(%error, "accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
        };
        let Some(slot) = connections.admit() else {
            drop(stream);
            continue;
        };
        let _ = stream.set_nodelay(true);
        let writes = ClientWrites::new();
        let service = Tracked::new(
            service.clone(),
            slot.clone(),
            limits.max_header_bytes,
            writes.clone(),
            peer,
        );
        let builder = builder.clone();
        let stopping = stopping.clone();
        tokio::spawn(async move {
            let connection = builder.serve_connection_with_upgrades(
                TokioIo::new(CountedFlushes::new(stream, writes)),
                hyper_util::service::TowerToHyperService::new(service),
            );
            tokio::pin!(connection);
            tokio::select! {
                _ = connection.as_mut() => {}
                () = slot.evicted() => {}
                () = stop_requested(stopping) => {
                    connection.as_mut().graceful_shutdown();
                    let _ = connection.await;
                }
            }
            slot.close();
        });
    }
    drop(listener);
    let _ = stop.send(true);
    reaper.abort();
    connections.wait_until_empty().await;
    Ok(())
}

/// Completes once a stop has been asked for through `stopping`.
async fn stop_requested(mut stopping: tokio::sync::watch::Receiver<bool>) {
    loop {
        if *stopping.borrow_and_update() {
            return;
        }
        if stopping.changed().await.is_err() {
            // The server is gone without asking; the connection runs to its end.
            std::future::pending::<()>().await;
        }
    }
}
