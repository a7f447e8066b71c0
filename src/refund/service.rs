//! [`RefundOnUpstreamError`]: the service.

use std::convert::Infallible;
use std::future::Future;
use std::panic::AssertUnwindSafe;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http::{HeaderMap, HeaderValue, Request, Response, header};
use tower_service::Service;

use super::body::{BilledStream, ResponseBody, StreamLimits};
use super::guard::{Meter, UnsettledCall};
use super::layer::RefundOnUpstreamErrorLayer;
use crate::call::{
    AccessEntry, ClientWrites, IdempotencyKey, RawUsage, Reservation, RoutedCall, ServedBy, Spoke,
};
use crate::classify::complete_reply;
use crate::error::{GatewayError, UpstreamError};
use crate::pricing::{Metered, estimated_text_tokens};
use crate::protocol::Protocol;
use crate::protocol::TokenUsage;
use crate::reply::{EventStream, Inner, ProviderUsage, UpstreamBody};
use crate::store::rules::usage::{Counted, unreported};
use crate::store::{CallFailure, CallSuccess, KeptReply, Ledger};

/// Middleware around the upstream that turns its outcome into a settle or a refund.
pub struct RefundOnUpstreamError<U> {
    upstream: U,
    ledger: Arc<dyn Ledger>,
    upstream_bound: Duration,
    stream_limits: StreamLimits,
    ledger_timeout: Duration,
    beyond_reservation: bool,
    /// Whether a complete reply's usage says what the call was charged.
    usage_cost: bool,
    /// An upstream that failed `poll_ready` fails the next call (which is refunded) rather than
    /// the whole service: every service the router sees is infallible.
    not_ready: Option<UpstreamError>,
}

impl<U: Clone> Clone for RefundOnUpstreamError<U> {
    fn clone(&self) -> Self {
        RefundOnUpstreamError {
            upstream: self.upstream.clone(),
            ledger: self.ledger.clone(),
            upstream_bound: self.upstream_bound,
            stream_limits: self.stream_limits,
            ledger_timeout: self.ledger_timeout,
            beyond_reservation: self.beyond_reservation,
            usage_cost: self.usage_cost,
            not_ready: None,
        }
    }
}

crate::macros::inner_service_accessors!(RefundOnUpstreamError, U, upstream);

impl<U> RefundOnUpstreamError<U> {
    /// Settles and refunds calls to `upstream` through `ledger`, with the default bounds.
    pub fn new(upstream: U, ledger: Arc<dyn Ledger>) -> RefundOnUpstreamError<U> {
        tower_layer::Layer::layer(&RefundOnUpstreamErrorLayer::new(ledger), upstream)
    }

    pub(super) fn configured(
        upstream: U,
        ledger: Arc<dyn Ledger>,
        upstream_bound: Duration,
        stream_limits: StreamLimits,
        ledger_timeout: Duration,
        beyond_reservation: bool,
    ) -> Self {
        RefundOnUpstreamError {
            upstream,
            ledger,
            upstream_bound,
            stream_limits,
            ledger_timeout,
            beyond_reservation,
            usage_cost: false,
            not_ready: None,
        }
    }

    pub(super) fn with_usage_cost(mut self, on: bool) -> Self {
        self.usage_cost = on;
        self
    }

    /// A [`RefundOnUpstreamErrorLayer`] over `ledger`.
    pub fn layer(ledger: Arc<dyn Ledger>) -> RefundOnUpstreamErrorLayer {
        RefundOnUpstreamErrorLayer::new(ledger)
    }
}

impl<U: std::fmt::Debug> std::fmt::Debug for RefundOnUpstreamError<U> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RefundOnUpstreamError")
            .field("upstream", &self.upstream)
            .finish_non_exhaustive()
    }
}

crate::macros::response_future! {
    /// The future [`RefundOnUpstreamError`] answers with.
    ResponseFuture
}

impl<U, ReqBody, UpstreamReply> Service<Request<ReqBody>> for RefundOnUpstreamError<U>
where
    U: Service<Request<ReqBody>, Response = Response<UpstreamReply>, Error = UpstreamError>
        + Clone
        + Send
        + 'static,
    U::Future: Send,
    UpstreamReply: Into<UpstreamBody>,
    ReqBody: Send + 'static,
{
    type Response = Response<ResponseBody>;
    type Error = Infallible;
    type Future = ResponseFuture<Result<Response<ResponseBody>, Infallible>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        if self.not_ready.is_none() {
            match self.upstream.poll_ready(cx) {
                Poll::Pending => return Poll::Pending,
                Poll::Ready(Ok(())) => {}
                Poll::Ready(Err(error)) => self.not_ready = Some(error),
            }
        }
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, request: Request<ReqBody>) -> Self::Future {
        // The guard exists from here on, so even a future dropped before its first poll
        // returns its credits.
        let routed = request.extensions().get::<RoutedCall>();
        let protocol = routed.map(|routed| routed.protocol);
        let model = routed.map(|routed| routed.model.clone());
        let access = request.extensions().get::<AccessEntry>().cloned();
        let hide_usage_chunks = routed.is_some_and(|routed| routed.gateway_asks_usage);
        let unsettled = request
            .extensions()
            .get::<Reservation>()
            .map(|reservation| {
                let meter = Meter {
                    model,
                    protocol: protocol.unwrap_or(Protocol::ChatCompletions),
                    credits: reservation.taken.total().get(),
                    charged_at: std::time::Instant::now(),
                    access: access.clone(),
                    shortfall: 0,
                    usage_rejected: false,
                };
                let metered = routed
                    .filter(|routed| routed.model.pricing.is_metered())
                    .map(|routed| Metered {
                        pricing: routed.model.pricing,
                        input_estimate: routed.input_estimate,
                        reserved: reservation.taken.total(),
                        input_bound: routed.input_bound(),
                        output_bound: routed.output_ceiling(),
                        asked_tier: routed.asked_tier,
                    });
                UnsettledCall::new(
                    self.ledger.clone(),
                    reservation.call,
                    meter,
                    self.ledger_timeout,
                )
                .metered(metered, self.beyond_reservation)
                .asked_tier(routed.and_then(|routed| routed.asked_tier))
            });
        // A keyed call's reply is kept with its settle, for the client's retries.
        let keep_reply = request.extensions().get::<IdempotencyKey>().is_some();
        let writes = request.extensions().get::<ClientWrites>().cloned();
        let not_ready = self.not_ready.take();
        let bound = self.upstream_bound;
        let limits = self.stream_limits;
        let usage_cost = self.usage_cost.then_some(protocol).flatten();
        let stream_usage_cost = self.usage_cost;
        let mut upstream = crate::macros::take_ready(&mut self.upstream);
        ResponseFuture::new(async move {
            let Some(mut unsettled) = unsettled else {
                tracing::error!("RefundOnUpstreamError needs CreditCharge outside it");
                return Ok(GatewayError::Misconfigured.into_response());
            };
            let upstream_call = async move {
                match not_ready {
                    Some(error) => Err(error),
                    None => upstream.call(request).await,
                }
            };
            let outcome =
                match crate::time_limit::within(bound, CatchPanic::new(upstream_call)).await {
                    Ok(Ok(outcome)) => outcome.map(|reply| reply.map(Into::into)),
                    Ok(Err(panic)) => {
                        tracing::error!(call = unsettled.call.0, %panic, "the upstream panicked");
                        Err(UpstreamError::transport(format!(
                            "the upstream panicked: {panic}"
                        )))
                    }
                    Err(_) => Err(UpstreamError::transport(format!(
                        "no answer within the gateway's bound of {bound:?}"
                    ))),
                };
            match judge(outcome) {
                Ok(Judged::Complete(mut reply, mut success)) => {
                    if unsettled.is_metered() {
                        // Output not reported: what the reply holds, counted roughly.
                        let counted = Counted {
                            output: Some(estimated_text_tokens(reply.body().len())),
                            ended: true,
                        };
                        success.usage = unreported(success.usage, counted);
                    }
                    if keep_reply {
                        success.reply = kept(&reply);
                    }
                    match unsettled.settle(success).await {
                        Ok(()) => {
                            let credits = unsettled.credits();
                            reply
                                .headers_mut()
                                .insert(CREDITS_HEADER, HeaderValue::from(credits));
                            if let Some(protocol) = usage_cost
                                && let Some(written) = crate::protocol::with_usage_cost(
                                    protocol,
                                    reply.body(),
                                    credits,
                                    &unsettled.billed_usage(),
                                )
                            {
                                reply.headers_mut().remove(http::header::CONTENT_LENGTH);
                                *reply.body_mut() = Bytes::from(written);
                            }
                            Ok(reply.map(ResponseBody::from))
                        }
                        // Not billed, so the reply is not handed out either.
                        Err(unbilled) => Ok(unbilled.into_response()),
                    }
                }
                Ok(Judged::Stream(mut parts, events, success)) => {
                    let Some(protocol) = protocol else {
                        tracing::error!(
                            "a stream needs ProtocolRouter outside RefundOnUpstreamError"
                        );
                        let failure = CallFailure {
                            upstream_status: Some(success.upstream_status),
                            error: "misconfigured: a stream without a RoutedCall".to_owned(),
                        };
                        unsettled.refund(failure).await;
                        return Ok(GatewayError::Misconfigured.into_response());
                    };
                    event_stream_headers(&mut parts.headers);
                    if let Some(access) = &access {
                        access.stream_follows();
                    }
                    let provider_usage = parts.extensions.remove::<ProviderUsage>();
                    let mut stream =
                        BilledStream::new(events, protocol, unsettled, success, limits, writes);
                    if let Some(usage) = provider_usage {
                        stream.bill_by(usage);
                    }
                    if keep_reply {
                        stream.keep_reply();
                    }
                    if hide_usage_chunks {
                        stream.hide_usage_chunks();
                    }
                    if stream_usage_cost {
                        stream.write_usage_cost();
                    }
                    Ok(Response::from_parts(parts, ResponseBody::stream(stream)))
                }
                Err((failure, client_message)) => {
                    tracing::warn!(
                        call = unsettled.call.0,
                        status = failure.upstream_status,
                        error = %failure.error,
                        "upstream failed; refunding"
                    );
                    let refusal = match client_message {
                        _ if !unsettled.refund(failure).await => GatewayError::StoreUnavailable,
                        Some(message) => GatewayError::UpstreamRejected(message),
                        None => GatewayError::UpstreamUnavailable,
                    };
                    Ok(refusal.into_response())
                }
            }
        })
    }
}

/// The response header of a complete reply that says what the call was charged, in credits.
pub const CREDITS_HEADER: &str = "x-gateway-credits";

/// A complete reply to keep for an idempotent call's retries (`None` if too large).
fn kept(reply: &Response<Bytes>) -> Option<KeptReply> {
    let content_type = reply
        .headers()
        .get(header::CONTENT_TYPE)
        .and_then(|value| value.to_str().ok())
        .map(str::to_owned);
    let kept = KeptReply::new(reply.status().as_u16(), content_type, reply.body().clone());
    if kept.is_none() {
        tracing::warn!(
            bytes = reply.body().len(),
            "a keyed call's reply is too large to keep; a retry will be told it was billed"
        );
    }
    kept
}

/// The headers of a stream passed on: an event stream, never cached or buffered on the way.
fn event_stream_headers(headers: &mut HeaderMap) {
    headers.remove(header::CONTENT_LENGTH);
    headers.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("text/event-stream"),
    );
    headers.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    headers.insert("x-accel-buffering", HeaderValue::from_static("no"));
}

/// Turns a panic while polling the inner future into an error value.
struct CatchPanic<F> {
    inner: Pin<Box<F>>,
}

impl<F: Future> CatchPanic<F> {
    fn new(inner: F) -> CatchPanic<F> {
        CatchPanic {
            inner: Box::pin(inner),
        }
    }
}

impl<F: Future> Future for CatchPanic<F> {
    type Output = Result<F::Output, String>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let inner = self.inner.as_mut();
        match std::panic::catch_unwind(AssertUnwindSafe(|| inner.poll(cx))) {
            Ok(Poll::Ready(output)) => Poll::Ready(Ok(output)),
            Ok(Poll::Pending) => Poll::Pending,
            Err(payload) => {
                let text = payload
                    .downcast_ref::<&str>()
                    .map(|text| (*text).to_owned())
                    .or_else(|| payload.downcast_ref::<String>().cloned())
                    .unwrap_or_else(|| "a non-text panic".to_owned());
                Poll::Ready(Err(text))
            }
        }
    }
}

/// An upstream's answer worth paying for.
enum Judged {
    /// A complete reply, billed now.
    Complete(Response<Bytes>, CallSuccess),
    /// An event stream, billed when it ends; the usage is read from its events.
    Stream(http::response::Parts, EventStream, CallSuccess),
}

/// Decides whether an upstream outcome is a success worth paying for (see [`crate::classify`]).
/// A failure comes with what the client may be told of it.
fn judge(
    outcome: Result<Response<UpstreamBody>, UpstreamError>,
) -> Result<Judged, (CallFailure, Option<String>)> {
    let failed = |error: UpstreamError| {
        let client_message = error.client_message.clone();
        (CallFailure::from(error), client_message)
    };
    let (mut parts, body) = outcome.map_err(failed)?.into_parts();
    let status = parts.status;
    let channel = parts.extensions.remove::<ServedBy>().map(|served| served.0);
    let upstream_protocol = parts.extensions.remove::<Spoke>().map(|spoke| spoke.0);
    let raw_usage = parts.extensions.remove::<RawUsage>().map(|raw| raw.0);
    let success = |usage, raw_usage| CallSuccess {
        upstream_status: status.as_u16(),
        usage,
        channel,
        upstream_protocol,
        cost: None,
        reply: None,
        beyond_reservation: false,
        usage_rejected: false,
        claim: Default::default(),
        operator_cost: None,
        raw_usage,
    };
    match body.into_inner() {
        Inner::Complete(body) => {
            // An upstream that already parsed the reply says so; otherwise classify it here.
            let (usage, raw_usage) = match parts.extensions.remove::<TokenUsage>() {
                Some(usage) if status.is_success() => (usage, raw_usage),
                _ => complete_reply(status, &body).map_err(failed)?,
            };
            Ok(Judged::Complete(
                Response::from_parts(parts, body),
                success(usage, raw_usage),
            ))
        }
        Inner::Events(_) if !status.is_success() => Err(failed(UpstreamError {
            status: Some(status.as_u16()),
            message: format!("answered {status} with an event stream"),
            client_message: None,
        })),
        Inner::Events(events) => Ok(Judged::Stream(
            parts,
            events,
            success(TokenUsage::default(), raw_usage),
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn judge_reply(reply: Response<Bytes>) -> Result<Judged, (CallFailure, Option<String>)> {
        judge(Ok(reply.map(UpstreamBody::from)))
    }

    #[test]
    fn a_body_that_is_not_a_json_object_is_a_failure() {
        let reply = Response::new(Bytes::from_static(b"not json"));
        assert!(judge_reply(reply).is_err());
    }

    #[test]
    fn a_non_2xx_reply_is_a_failure_that_keeps_the_status() {
        let mut reply = Response::new(Bytes::from_static(br#"{"error":"overloaded"}"#));
        *reply.status_mut() = http::StatusCode::TOO_MANY_REQUESTS;
        let Err(failure) = judge_reply(reply) else {
            panic!("a 429 was judged billable")
        };
        assert_eq!(failure.0.upstream_status, Some(429));
        assert!(failure.0.error.contains("overloaded"));
    }
}
