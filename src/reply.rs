//! What an upstream answers with: a complete body, or an event stream still arriving.
//!
//! [`RefundOnUpstreamError`](crate::RefundOnUpstreamError) bills a complete body when it
//! arrives, and an event stream when it ends (see `refund`'s streaming body). An upstream that
//! only ever answers complete bodies may answer `Response<Bytes>`: `Bytes` converts into an
//! [`UpstreamBody`].

use std::collections::VecDeque;
use std::convert::Infallible;
use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::Bytes;
use http_body::{Body, Frame, SizeHint};
use http_body_util::BodyExt;
use http_body_util::combinators::UnsyncBoxBody;

use crate::error::UpstreamError;

/// An upstream's reply body: complete, or a server-sent event stream.
pub struct UpstreamBody {
    inner: Inner,
}

/// The two kinds of [`UpstreamBody`], as the billing layer takes them apart.
pub(crate) enum Inner {
    Complete(Bytes),
    Events(EventStream),
}

/// An event stream: its chunks as the provider sent them, or the error that cut it.
pub(crate) type EventStream = UnsyncBoxBody<Bytes, UpstreamError>;

impl UpstreamBody {
    /// A complete reply.
    pub fn complete(bytes: Bytes) -> UpstreamBody {
        UpstreamBody {
            inner: Inner::Complete(bytes),
        }
    }

    /// An event stream still arriving: each chunk as the provider sent it (chunks need not
    /// align with events), ending normally or with the error that cut it.
    pub fn events<B>(body: B) -> UpstreamBody
    where
        B: Body<Data = Bytes, Error = UpstreamError> + Send + 'static,
    {
        UpstreamBody {
            inner: Inner::Events(body.boxed_unsync()),
        }
    }

    /// An event stream of which `received` has already been read from `rest`.
    pub fn events_after<B>(received: Vec<Bytes>, rest: B) -> UpstreamBody
    where
        B: Body<Data = Bytes, Error = UpstreamError> + Send + Unpin + 'static,
    {
        UpstreamBody::events(Prefixed {
            received: received.into(),
            rest,
        })
    }

    /// An event stream whose chunks are all known now (the mock, tests).
    pub fn event_chunks(chunks: impl IntoIterator<Item = Bytes>) -> UpstreamBody {
        UpstreamBody::events(Chunks(chunks.into_iter().collect()).map_err(|never| match never {}))
    }

    /// Whether this is an event stream.
    pub fn is_event_stream(&self) -> bool {
        matches!(self.inner, Inner::Events(_))
    }

    /// The complete reply, if this is one.
    pub fn as_complete(&self) -> Option<&Bytes> {
        match &self.inner {
            Inner::Complete(bytes) => Some(bytes),
            Inner::Events(_) => None,
        }
    }

    pub(crate) fn into_inner(self) -> Inner {
        self.inner
    }
}

impl From<Bytes> for UpstreamBody {
    fn from(bytes: Bytes) -> UpstreamBody {
        UpstreamBody::complete(bytes)
    }
}

impl std::fmt::Debug for UpstreamBody {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match &self.inner {
            Inner::Complete(bytes) => f.debug_tuple("Complete").field(&bytes.len()).finish(),
            Inner::Events(_) => f.write_str("Events"),
        }
    }
}

/// A body of chunks already in memory.
struct Chunks(VecDeque<Bytes>);

impl Body for Chunks {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(
        self: Pin<&mut Self>,
        _cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
        Poll::Ready(
            self.get_mut()
                .0
                .pop_front()
                .map(|chunk| Ok(Frame::data(chunk))),
        )
    }

    fn is_end_stream(&self) -> bool {
        self.0.is_empty()
    }

    fn size_hint(&self) -> SizeHint {
        SizeHint::with_exact(self.0.iter().map(|chunk| chunk.len() as u64).sum())
    }
}

/// Chunks already read from a body, then the rest of it.
struct Prefixed<B> {
    received: VecDeque<Bytes>,
    rest: B,
}

impl<B> Body for Prefixed<B>
where
    B: Body<Data = Bytes> + Unpin,
{
    type Data = Bytes;
    type Error = B::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, B::Error>>> {
        let this = self.get_mut();
        match this.received.pop_front() {
            Some(chunk) => Poll::Ready(Some(Ok(Frame::data(chunk)))),
            None => Pin::new(&mut this.rest).poll_frame(cx),
        }
    }
}

/// The usage a translated stream's provider reported so far, as the provider's own dialect
/// reads it: what the stream is billed by, rather than the usage its translation writes for the
/// client (which the client's dialect may not spell exactly: a count the provider gave as no
/// count, a kind the client's protocol has no name for). Set by the upstream that translates,
/// handed to the billing layer in the response's extensions.
#[derive(Debug, Clone, Default)]
pub(crate) struct ProviderUsage(
    std::sync::Arc<std::sync::Mutex<(Option<crate::protocol::TokenUsage>, Option<String>)>>,
);

impl ProviderUsage {
    /// Records what the provider has reported so far.
    pub(crate) fn set(&self, usage: crate::protocol::TokenUsage) {
        self.0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .0 = Some(usage);
    }

    /// Records the provider's usage objects as it wrote them.
    pub(crate) fn set_raw(&self, raw: Option<String>) {
        self.0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .1 = raw;
    }

    /// What the provider has reported so far, once it has read an event.
    pub(crate) fn get(&self) -> Option<crate::protocol::TokenUsage> {
        self.0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .0
    }

    /// The provider's usage objects as it wrote them, when it has sent any.
    pub(crate) fn raw(&self) -> Option<String> {
        self.0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .1
            .clone()
    }
}
