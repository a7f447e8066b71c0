//! [`ResponseBody`]: what the stack answers with, and the streaming body that bills a stream
//! when it ends.
//!
//! A streamed call is decided where its body ends, as tower-http's trace body decides in
//! `poll_frame` and `Drop`:
//! - the provider's final event (`message_stop`, `data: [DONE]`) passes, then the call is
//!   settled with the usage the stream reported, and only then does the client's stream end;
//! - the provider fails after the stream started (the connection is cut, an error event, no
//!   event within the idle time-out, the whole-stream deadline, a panic): the upstream is
//!   dropped, the call refunded, and the client gets one last error event in its protocol's
//!   shape before the stream closes;
//! - the client goes away (the body is dropped): the upstream is dropped with it, so the
//!   provider stops; the call is billed if any content event had been written to the client
//!   (see [`super::delivery`] for what counts), refunded otherwise.
//!
//! The provider's final event goes out as a frame of its own, and the settle waits until the
//! connection has taken the content before it.
//!
//! Events are forwarded whole and unchanged, as soon as each is complete.

use std::convert::Infallible;
use std::future::Future;
use std::panic::AssertUnwindSafe;
use std::pin::Pin;
use std::task::{Context, Poll, ready};
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use http_body::{Body, Frame, SizeHint};
use http_body_util::Full;
use tokio::time::{Instant, Sleep};

use super::delivery::{Delivery, WATCHDOG_GRACE, WatchedCall};
use super::guard::{Outcome, UnsettledCall};
use crate::call::ClientWrites;
use crate::error::{GatewayError, UpstreamError};
use crate::protocol::Protocol;
use crate::protocol::TokenUsage;
use crate::protocol::reader::StreamReader;
use crate::protocol::sse::{EventKind, EventSplitter};
use crate::reply::{EventStream, ProviderUsage};
use crate::store::rules::usage::{Counted, unreported};
use crate::store::{CallFailure, CallSuccess, KeptReply, MAX_KEPT_REPLY_BYTES};

/// What a refund records when the client left a stream before any content reached it.
pub const CLIENT_LEFT_BEFORE_CONTENT: &str =
    "the client went away before any content of the stream reached it";

/// The body of every response the stack gives: complete, or a billed event stream.
pub struct ResponseBody {
    inner: Inner,
}

enum Inner {
    Complete(Full<Bytes>),
    Stream(Box<BilledStream>),
}

impl ResponseBody {
    pub(super) fn stream(stream: BilledStream) -> ResponseBody {
        ResponseBody {
            inner: Inner::Stream(Box::new(stream)),
        }
    }
}

impl From<Bytes> for ResponseBody {
    fn from(bytes: Bytes) -> ResponseBody {
        ResponseBody {
            inner: Inner::Complete(Full::new(bytes)),
        }
    }
}

impl Default for ResponseBody {
    fn default() -> ResponseBody {
        ResponseBody::from(Bytes::new())
    }
}

impl std::fmt::Debug for ResponseBody {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match &self.inner {
            Inner::Complete(_) => f.write_str("ResponseBody::Complete"),
            Inner::Stream(_) => f.write_str("ResponseBody::Stream"),
        }
    }
}

impl Body for ResponseBody {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
        match &mut self.get_mut().inner {
            Inner::Complete(full) => Pin::new(full).poll_frame(cx),
            Inner::Stream(stream) => stream
                .poll_next(cx)
                .map(|data| data.map(|data| Ok(Frame::data(data)))),
        }
    }

    fn is_end_stream(&self) -> bool {
        match &self.inner {
            Inner::Complete(full) => full.is_end_stream(),
            Inner::Stream(stream) => stream.done,
        }
    }

    fn size_hint(&self) -> SizeHint {
        match &self.inner {
            Inner::Complete(full) => full.size_hint(),
            Inner::Stream(_) => SizeHint::default(),
        }
    }
}

/// How long a stream may last and stay quiet.
#[derive(Debug, Clone, Copy)]
pub(super) struct StreamLimits {
    pub(super) deadline: Duration,
    pub(super) idle: Duration,
    /// The largest event, or unfinished tail of one, held from the provider.
    pub(super) max_event: usize,
}

/// A provider's event stream on its way to the client, billed when it ends.
pub(super) struct BilledStream {
    upstream: Option<EventStream>,
    splitter: EventSplitter,
    reader: StreamReader,
    /// The call, shared with its watchdog, and what of the stream the connection took.
    call: WatchedCall,
    /// What a settle records, but for the usage read from the stream.
    success: CallSuccess,
    limits: StreamLimits,
    /// When the whole stream must have ended.
    deadline: Instant,
    /// When the provider last sent a complete event (the idle time-out counts from here).
    last_event: Instant,
    /// Fires at the earlier of the deadline and the idle time-out as they stood when it was
    /// set. An event does not move it (a timer update per event costs more than the rest of
    /// the event's reading); when it fires, it is checked against `last_event` and set again.
    timer: Pin<Box<Sleep>>,
    /// The provider's final event, held back to go out as a frame of its own: once the
    /// connection asks for what follows it, everything before it went through.
    end_event: Option<Bytes>,
    /// The outcome being written, then the last bytes to send, if any.
    finishing: Option<Pin<Box<dyn Future<Output = Option<Bytes>> + Send>>>,
    done: bool,
    /// For a keyed call, the events passed on so far, kept with the settle for its retries;
    /// `None` when not kept (no key, or past [`MAX_KEPT_REPLY_BYTES`]).
    kept: Option<BytesMut>,
    /// Chunks carrying only usage are not passed on: the gateway asked for them, not the
    /// client (see [`RoutedCall::gateway_asks_usage`](crate::RoutedCall::gateway_asks_usage)).
    hide_usage_chunks: bool,
    /// A translated stream's usage as its provider reported it, which the stream is billed by
    /// instead of the usage its translation wrote for the client.
    provider_usage: Option<ProviderUsage>,
    /// Whether each usage object the client is sent says what the call costs so far (the
    /// operator's `usage_cost`): the last one, what it was charged.
    usage_cost: bool,
    /// The protocol of the client's events.
    protocol: Protocol,
}

impl BilledStream {
    /// `writes`: how the client's connection counts what its socket took, if it does.
    pub(super) fn new(
        upstream: EventStream,
        protocol: Protocol,
        mut guard: UnsettledCall,
        success: CallSuccess,
        limits: StreamLimits,
        writes: Option<ClientWrites>,
    ) -> BilledStream {
        guard.if_dropped(Outcome::Refund(CallFailure {
            upstream_status: Some(success.upstream_status),
            error: CLIENT_LEFT_BEFORE_CONTENT.to_owned(),
        }));
        // A call priced by tokens whose client leaves before the provider reports usage is
        // charged for the output it was passed, counted.
        let reader = if guard.is_metered() {
            StreamReader::new(protocol).counting_output()
        } else {
            StreamReader::new(protocol)
        };
        let now = Instant::now();
        let deadline = now + limits.deadline;
        let call = WatchedCall::new(
            guard,
            Delivery::new(writes),
            success.clone(),
            deadline + WATCHDOG_GRACE,
        );
        BilledStream {
            upstream: Some(upstream),
            splitter: EventSplitter::new(),
            reader,
            call,
            success,
            limits,
            deadline,
            last_event: now,
            timer: Box::pin(tokio::time::sleep_until(deadline.min(now + limits.idle))),
            end_event: None,
            finishing: None,
            done: false,
            kept: None,
            hide_usage_chunks: false,
            provider_usage: None,
            usage_cost: false,
            protocol,
        }
    }

    /// Writes what the call costs so far into each usage object the client is sent.
    pub(super) fn write_usage_cost(&mut self) {
        self.usage_cost = true;
    }

    /// Bills the stream by `usage`, its provider's report read in the provider's own dialect
    /// (a translated stream).
    pub(super) fn bill_by(&mut self, usage: ProviderUsage) {
        self.provider_usage = Some(usage);
    }

    /// Leaves out the chunks that carry only usage (the gateway asked for them).
    pub(super) fn hide_usage_chunks(&mut self) {
        self.hide_usage_chunks = true;
    }

    /// Keeps the events passed on, so that the settle can store them for the call's retries.
    pub(super) fn keep_reply(&mut self) {
        self.kept = Some(BytesMut::new());
    }

    fn keep(&mut self, forwarded: &[u8]) {
        if let Some(kept) = &mut self.kept {
            if kept.len() + forwarded.len() > MAX_KEPT_REPLY_BYTES {
                tracing::warn!(
                    "a keyed call's stream is too long to keep; a retry will be told it was billed"
                );
                self.kept = None;
            } else {
                kept.extend_from_slice(forwarded);
            }
        }
    }

    /// The next bytes for the client: whole events, then the final event, then possibly a last
    /// error event.
    fn poll_next(&mut self, cx: &mut Context<'_>) -> Poll<Option<Bytes>> {
        loop {
            if let Some(finishing) = &mut self.finishing {
                let last = ready!(finishing.as_mut().poll(cx));
                self.finishing = None;
                self.done = true;
                if last.is_some() {
                    return Poll::Ready(last);
                }
            }
            if self.done {
                return Poll::Ready(None);
            }
            {
                let mut call = self.call.lock();
                call.delivery.asked();
                call.confirm();
                if call.guard.is_none() {
                    // The watchdog ended the call: the client took nothing for too long.
                    drop(call);
                    self.upstream = None;
                    self.done = true;
                    return Poll::Ready(None);
                }
            }
            if self.upstream.is_none() {
                // The provider's stream ended: its final event goes out, then the call is
                // settled once the connection has taken all the content before it.
                if let Some(end_event) = self.end_event.take() {
                    self.call.lock().delivery.handed(None);
                    return Poll::Ready(Some(end_event));
                }
                if !self.content_taken(cx) {
                    return Poll::Pending;
                }
                self.settle();
                continue;
            }
            if let Some(reason) = self.timed_out(cx) {
                self.fail(reason);
                continue;
            }
            let Some(upstream) = self.upstream.as_mut() else {
                continue;
            };
            let polled =
                std::panic::catch_unwind(AssertUnwindSafe(|| Pin::new(upstream).poll_frame(cx)));
            match polled {
                Err(_) => self.fail("the upstream's stream panicked".to_owned()),
                Ok(Poll::Pending) => return Poll::Pending,
                Ok(Poll::Ready(Some(Ok(frame)))) => {
                    if let Ok(data) = frame.into_data()
                        && let Some((events, content)) = self.take_events(&data)
                    {
                        let usage = content.then(|| self.usage());
                        self.call.lock().delivery.handed(usage);
                        return Poll::Ready(Some(events));
                    }
                }
                Ok(Poll::Ready(Some(Err(error)))) => self.fail(error_text(error)),
                Ok(Poll::Ready(None)) if self.splitter.pending() == 0 && self.reader.closed() => {
                    // Its normal end, for a protocol whose streams end when they close: settled
                    // once the connection has taken what came before.
                    self.upstream = None;
                }
                Ok(Poll::Ready(None)) => {
                    let cut = match self.splitter.pending() {
                        0 => "the stream ended before its final event".to_owned(),
                        n => format!("the stream ended inside an event ({n} bytes unfinished)"),
                    };
                    self.fail(cut);
                }
            }
        }
    }

    /// Whether the connection has taken every content frame handed on; if not, a wake-up is
    /// arranged for when it may have.
    fn content_taken(&self, cx: &mut Context<'_>) -> bool {
        let mut call = self.call.lock();
        if call.delivery.all_taken() {
            return true;
        }
        call.delivery.wake_when_taken(cx.waker());
        // Taken between the first look and the registration?
        call.confirm();
        call.delivery.all_taken()
    }

    /// Why the stream must stop, if it passed its deadline or the provider has been quiet for
    /// the idle time-out; otherwise the timer is set to wake the stream when one may have come.
    fn timed_out(&mut self, cx: &mut Context<'_>) -> Option<String> {
        while self.timer.as_mut().poll(cx).is_ready() {
            let now = Instant::now();
            if now >= self.deadline {
                let deadline = self.limits.deadline;
                return Some(format!("the stream passed its deadline of {deadline:?}"));
            }
            let quiet_until = self.last_event + self.limits.idle;
            if now >= quiet_until {
                let idle = self.limits.idle;
                return Some(format!("no event from the provider for {idle:?}"));
            }
            self.timer.as_mut().reset(quiet_until.min(self.deadline));
        }
        None
    }

    /// Reads the complete events in `data` (with what came before), and returns those to pass
    /// on, and whether any of them is content. Stops at the stream's end (its final event is
    /// held back) or an error event (the outcome is then being written).
    fn take_events(&mut self, data: &[u8]) -> Option<(Bytes, bool)> {
        self.splitter.push(data);
        let mut forward: Option<BytesMut> = None;
        let mut first: Option<Bytes> = None;
        let mut content = false;
        while let Some(mut event) = self.splitter.next_event() {
            if first.is_none() {
                self.last_event = Instant::now();
            }
            let usage_objects = self.reader.raw_usage_count();
            let kind = self.reader.read(&event);
            if self.usage_cost && self.reader.raw_usage_count() != usage_objects {
                event = self.with_cost_so_far(event);
            }
            match kind {
                EventKind::Error(message) => {
                    self.fail(format!("the provider sent an error event: {message}"));
                    break;
                }
                EventKind::End => {
                    self.keep(&event);
                    self.upstream = None;
                    self.end_event = Some(event);
                    break;
                }
                EventKind::Content => content = true,
                EventKind::Other if self.hide_usage_chunks && self.reader.usage_only() => continue,
                EventKind::Other => {}
            }
            self.keep(&event);
            match (&mut first, &mut forward) {
                (None, _) => first = Some(event),
                (Some(head), None) => {
                    let mut joined = BytesMut::from(&head[..]);
                    joined.extend_from_slice(&event);
                    forward = Some(joined);
                }
                (Some(_), Some(joined)) => joined.extend_from_slice(&event),
            }
        }
        // An event never finished (or one too large) would grow without bound.
        if self.upstream.is_some() && self.splitter.pending() > self.limits.max_event {
            let max = self.limits.max_event;
            self.fail(format!(
                "the provider's event passed the {max} bytes an event may have"
            ));
        }
        forward
            .map(BytesMut::freeze)
            .or(first)
            .map(|events| (events, content))
    }

    /// `event`, which carries a usage object, with what the call costs so far written into it.
    fn with_cost_so_far(&self, event: Bytes) -> Bytes {
        let usage = self.usage();
        let priced = self
            .call
            .lock()
            .guard
            .as_ref()
            .map(|guard| guard.charge_if_ended(&usage));
        let Some((credits, usage)) = priced else {
            return event;
        };
        crate::protocol::event_with_usage_cost(self.protocol, &event, credits, &usage)
            .map_or(event, Bytes::from)
    }

    /// What the stream is charged for so far: the usage reported, completed with the output
    /// counted where the provider's count is missing (the store's rule).
    fn usage(&self) -> TokenUsage {
        let counted = Counted {
            output: self.reader.counted_output(),
            ended: self.reader.ended(),
        };
        let reported = self
            .provider_usage
            .as_ref()
            .and_then(ProviderUsage::get)
            .unwrap_or_else(|| self.reader.reported());
        unreported(reported, counted)
    }

    fn success_so_far(&self) -> CallSuccess {
        // A translated stream's raw usage is its provider's, not its translation's.
        let raw_usage = match &self.provider_usage {
            Some(provider) => provider.raw(),
            None => self.reader.raw_usage(),
        };
        CallSuccess {
            usage: self.usage(),
            raw_usage,
            ..self.success.clone()
        }
    }

    /// The stream ended normally and its content was taken: settle, then end the client's
    /// stream.
    fn settle(&mut self) {
        let mut success = self.success_so_far();
        success.reply = self.kept.take().and_then(|kept| {
            let event_stream = Some("text/event-stream".to_owned());
            KeptReply::new(self.success.upstream_status, event_stream, kept.freeze())
        });
        let Some(mut guard) = self.call.lock().guard.take() else {
            return;
        };
        self.finishing = Some(Box::pin(async move {
            if let Err(unbilled) = guard.settle_delivered(success).await {
                tracing::error!(call = guard.call.0, %unbilled, "a finished stream was not billed in time");
            }
            None
        }));
    }

    /// The provider failed after the stream started: drop it, refund, and tell the client.
    fn fail(&mut self, reason: String) {
        self.upstream = None;
        let Some(mut guard) = self.call.lock().guard.take() else {
            return;
        };
        tracing::warn!(call = guard.call.0, %reason, "stream failed; refunding");
        let failure = CallFailure {
            upstream_status: Some(self.success.upstream_status),
            error: reason,
        };
        let reader = self.reader.clone();
        self.finishing = Some(Box::pin(async move {
            let detail = if guard.refund(failure).await {
                GatewayError::UpstreamUnavailable
            } else {
                GatewayError::StoreUnavailable
            };
            Some(reader.error_event(&detail))
        }));
    }
}

fn error_text(error: UpstreamError) -> String {
    format!("the provider's stream failed: {}", error.message)
}
