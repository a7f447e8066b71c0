//! A provider's event stream read as the client's dialect, for the calls an upstream
//! translates (see [`protocol::translation`](crate::protocol::translation)).

use std::pin::Pin;
use std::task::{Context, Poll, ready};

use bytes::Bytes;
use http_body::{Body, Frame};

use crate::error::UpstreamError;
use crate::protocol::Protocol;
use crate::protocol::reader::StreamReader;
use crate::protocol::sse::EventSplitter;
use crate::protocol::translation::StreamTranslation;
use crate::reply::{EventStream, ProviderUsage};

/// The provider's stream in, the client's events out, as each provider event completes; the
/// provider's usage read as its own dialect reads it, for the billing layer.
pub(super) struct TranslatedStream {
    chat: EventStream,
    translator: StreamTranslation,
    splitter: EventSplitter,
    provider: StreamReader,
    usage: ProviderUsage,
    /// The largest chat event held unfinished: a provider sending one without end would
    /// otherwise take the gateway's memory here, before the billing layer sees anything.
    max_event: usize,
}

impl TranslatedStream {
    /// `chat`, the stream of a provider speaking `provider`, translated by `translator`; what
    /// the provider reports of its usage kept in `usage`.
    pub(super) fn new(
        chat: EventStream,
        translator: StreamTranslation,
        provider: Protocol,
        usage: ProviderUsage,
        max_event: usize,
    ) -> Self {
        TranslatedStream {
            chat,
            translator,
            splitter: EventSplitter::new(),
            provider: StreamReader::new(provider),
            usage,
            max_event,
        }
    }
}

impl Body for TranslatedStream {
    type Data = Bytes;
    type Error = UpstreamError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, UpstreamError>>> {
        let this = self.get_mut();
        loop {
            let Some(frame) = ready!(Pin::new(&mut this.chat).poll_frame(cx)) else {
                return Poll::Ready(None);
            };
            let Ok(data) = frame?.into_data() else {
                continue;
            };
            // The provider's usage first, so that it is in when the client's last event goes.
            this.splitter.push(&data);
            let raw_before = this.provider.raw_usage_count();
            while let Some(event) = this.splitter.next_event() {
                this.provider.read(&event);
            }
            this.usage.set(this.provider.reported());
            if this.provider.raw_usage_count() != raw_before {
                this.usage.set_raw(this.provider.raw_usage());
            }
            let events = this.translator.push(&data);
            if this.translator.pending() > this.max_event {
                return Poll::Ready(Some(Err(UpstreamError::transport(format!(
                    "the provider's event passed the {} bytes an event may have",
                    this.max_event
                )))));
            }
            if !events.is_empty() {
                return Poll::Ready(Some(Ok(Frame::data(Bytes::from(events)))));
            }
        }
    }
}
