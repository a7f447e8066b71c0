//! [`Tracked`]: each request on a connection, seen by the server: when its body has been read
//! (work under way), when its response has ended, whether its headers are too large, and its
//! unread body kept until its response has been sent.

use std::convert::Infallible;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};

use bytes::Bytes;
use http::{Request, Response};
use http_body::{Body, Frame, SizeHint};
use http_body_util::Full;
use hyper::body::Incoming;
use tower_service::Service;

use super::connections::Slot;
use crate::call::ClientWrites;
use crate::error::GatewayError;
use tower::BoxError;

/// The service on one connection: the application's service, watched by the server.
#[derive(Debug, Clone)]
pub struct Tracked<S> {
    inner: S,
    slot: Slot,
    max_header_bytes: usize,
    /// The connection's count of flushes, handed to its HTTP/1.1 requests.
    writes: ClientWrites,
    /// The client's address, handed to every request as axum's `ConnectInfo`.
    peer: std::net::SocketAddr,
}

impl<S> Tracked<S> {
    pub(super) fn new(
        inner: S,
        slot: Slot,
        max_header_bytes: usize,
        writes: ClientWrites,
        peer: std::net::SocketAddr,
    ) -> Tracked<S> {
        Tracked {
            inner,
            slot,
            max_header_bytes,
            writes,
            peer,
        }
    }
}

/// What the server and the body share about one request.
#[derive(Debug)]
struct RequestState {
    slot: Slot,
    /// The body was read to its end.
    read: AtomicBool,
    /// A body dropped unread, kept until the response has been sent (see the module docs of
    /// [`super`]).
    parked: Mutex<Option<Incoming>>,
}

/// A request body as the application reads it.
#[derive(Debug)]
pub struct RequestBody {
    inner: Option<Incoming>,
    state: Arc<RequestState>,
}

impl Body for RequestBody {
    type Data = Bytes;
    type Error = hyper::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, hyper::Error>>> {
        let Some(inner) = self.inner.as_mut() else {
            return Poll::Ready(None);
        };
        let polled = Pin::new(inner).poll_frame(cx);
        if let Poll::Ready(None) = polled {
            self.inner = None;
            if !self.state.read.swap(true, Ordering::AcqRel) {
                self.state.slot.request_read();
            }
        }
        polled
    }

    fn is_end_stream(&self) -> bool {
        self.inner.as_ref().is_none_or(Body::is_end_stream)
    }

    fn size_hint(&self) -> SizeHint {
        self.inner
            .as_ref()
            .map_or_else(|| SizeHint::with_exact(0), Body::size_hint)
    }
}

impl Drop for RequestBody {
    fn drop(&mut self) {
        if let Some(unread) = self.inner.take() {
            *self
                .state
                .parked
                .lock()
                .unwrap_or_else(|poisoned| poisoned.into_inner()) = Some(unread);
        }
    }
}

/// A response body as the server sends it; when it ends, the connection's count is updated and
/// an unread request body let go.
#[derive(Debug)]
pub struct TrackedBody<B> {
    inner: Inner<B>,
    state: Option<Arc<RequestState>>,
}

#[derive(Debug)]
enum Inner<B> {
    Service(B),
    Refused(Full<Bytes>),
}

impl<B> TrackedBody<B> {
    fn end(&mut self) {
        if let Some(state) = self.state.take() {
            state
                .slot
                .response_ended(state.read.load(Ordering::Acquire));
            let parked = state
                .parked
                .lock()
                .unwrap_or_else(|poisoned| poisoned.into_inner())
                .take();
            if let Some(unread) = parked {
                tokio::spawn(discard(unread));
            }
        }
    }
}

/// Most of an unread body read and thrown away after its response, and for how long.
const DISCARD_BYTES: usize = 16 * 1024 * 1024;
const DISCARD_TIME: std::time::Duration = std::time::Duration::from_secs(10);

/// Reads and throws away the rest of a body whose request was answered without it, so that a
/// client still sending it finishes and reads the answer (an HTTP/2 stream reset instead makes
/// some clients drop the answer). Past [`DISCARD_BYTES`] or [`DISCARD_TIME`] it is dropped.
async fn discard(mut unread: Incoming) {
    use http_body_util::BodyExt;
    let mut read = 0;
    let _ = tokio::time::timeout(DISCARD_TIME, async {
        while read < DISCARD_BYTES {
            match unread.frame().await {
                Some(Ok(frame)) => read += frame.data_ref().map_or(0, |data| data.len()),
                _ => break,
            }
        }
    })
    .await;
}

impl<B> Drop for TrackedBody<B> {
    fn drop(&mut self) {
        self.end();
    }
}

impl<B> Body for TrackedBody<B>
where
    B: Body<Data = Bytes> + Unpin,
    B::Error: Into<BoxError>,
{
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let polled = match &mut self.inner {
            Inner::Service(body) => Pin::new(body).poll_frame(cx).map_err(Into::into),
            Inner::Refused(full) => Pin::new(full)
                .poll_frame(cx)
                .map_err(|never: Infallible| match never {}),
        };
        if let Poll::Ready(None) = polled {
            self.end();
        }
        polled
    }

    fn is_end_stream(&self) -> bool {
        match &self.inner {
            Inner::Service(body) => body.is_end_stream(),
            Inner::Refused(full) => full.is_end_stream(),
        }
    }

    fn size_hint(&self) -> SizeHint {
        match &self.inner {
            Inner::Service(body) => body.size_hint(),
            Inner::Refused(full) => full.size_hint(),
        }
    }
}

/// The bytes a request's head takes: target and headers, as on the wire.
fn head_bytes<B>(request: &Request<B>) -> usize {
    let target = request
        .uri()
        .path_and_query()
        .map_or(1, |target| target.as_str().len());
    request
        .headers()
        .iter()
        .map(|(name, value)| name.as_str().len() + value.len() + 4)
        .sum::<usize>()
        + target
}

crate::macros::response_future! {
    /// The future [`Tracked`] answers with.
    ResponseFuture
}

impl<S, B> Service<Request<Incoming>> for Tracked<S>
where
    S: Service<Request<RequestBody>, Response = Response<B>, Error = Infallible>
        + Clone
        + Send
        + 'static,
    S::Future: Send + 'static,
    B: Body<Data = Bytes> + Send + Unpin + 'static,
    B::Error: Into<BoxError>,
{
    type Response = Response<TrackedBody<B>>;
    type Error = Infallible;
    type Future = ResponseFuture<Result<Self::Response, Infallible>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: Request<Incoming>) -> Self::Future {
        self.slot.request_started();
        let state = Arc::new(RequestState {
            slot: self.slot.clone(),
            read: AtomicBool::new(false),
            parked: Mutex::new(None),
        });
        if head_bytes(&request) > self.max_header_bytes {
            // Dropped unread: parked until the 431 has been sent.
            drop(RequestBody {
                inner: Some(request.into_body()),
                state: state.clone(),
            });
            let (parts, refusal) = GatewayError::HeadersTooLarge
                .into_response::<Full<Bytes>>()
                .into_parts();
            let tracked = TrackedBody {
                inner: Inner::Refused(refusal),
                state: Some(state),
            };
            return ResponseFuture::new(std::future::ready(Ok(Response::from_parts(
                parts, tracked,
            ))));
        }
        let mut request = request.map(|body| RequestBody {
            inner: Some(body),
            state: state.clone(),
        });
        request
            .extensions_mut()
            .insert(axum::extract::ConnectInfo(self.peer));
        // On HTTP/2 a flush says nothing of one stream: its frames wait for their own window.
        if request.version() < http::Version::HTTP_2 {
            request.extensions_mut().insert(self.writes.clone());
        }
        let mut inner = crate::macros::take_ready(&mut self.inner);
        ResponseFuture::new(async move {
            let response = inner.call(request).await?;
            Ok(response.map(|body| TrackedBody {
                inner: Inner::Service(body),
                state: Some(state),
            }))
        })
    }
}
