//! A chat-completions event stream read as the Responses API's, for the Responses calls of an
//! upstream that translates (see [`protocol::responses`](crate::protocol::responses)).

use std::pin::Pin;
use std::task::{Context, Poll, ready};

use bytes::Bytes;
use http_body::{Body, Frame};

use crate::error::UpstreamError;
use crate::protocol::responses::StreamTranslator;
use crate::reply::EventStream;

/// The provider's chat stream in, the Responses events out, as each chat event completes.
pub(super) struct ChatAsResponses {
    chat: EventStream,
    translator: StreamTranslator,
    /// The largest chat event held unfinished: a provider sending one without end would
    /// otherwise take the gateway's memory here, before the billing layer sees anything.
    max_event: usize,
}

impl ChatAsResponses {
    pub(super) fn new(chat: EventStream, translator: StreamTranslator, max_event: usize) -> Self {
        ChatAsResponses {
            chat,
            translator,
            max_event,
        }
    }
}

impl Body for ChatAsResponses {
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
