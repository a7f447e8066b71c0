//! A provider's event stream read as the client's dialect, for the calls an upstream
//! translates (see [`protocol::translation`](crate::protocol::translation)).

use std::pin::Pin;
use std::task::{Context, Poll, ready};

use bytes::Bytes;
use http_body::{Body, Frame};

use crate::error::UpstreamError;
use crate::protocol::translation::StreamTranslation;
use crate::reply::EventStream;

/// The provider's stream in, the client's events out, as each provider event completes.
pub(super) struct TranslatedStream {
    chat: EventStream,
    translator: StreamTranslation,
    /// The largest chat event held unfinished: a provider sending one without end would
    /// otherwise take the gateway's memory here, before the billing layer sees anything.
    max_event: usize,
}

impl TranslatedStream {
    pub(super) fn new(chat: EventStream, translator: StreamTranslation, max_event: usize) -> Self {
        TranslatedStream {
            chat,
            translator,
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
