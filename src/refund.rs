//! [`RefundOnUpstreamError`]: settle on success, refund on failure.
//!
//! Wraps the upstream service. When the upstream answers 2xx with a JSON body, the call's entry
//! becomes `ok` (with the token usage the reply reports) and the reply goes to the client
//! unchanged. On any failure (connection error, time-out, non-2xx status, unreadable or non-JSON
//! body) the [`Reservation`]'s credits go back to the buckets they came from, the entry becomes
//! `refunded` with the upstream's status and error kept for the operator, and the client gets
//! `502 {"detail":"上游服务暂时不可用"}`.
//!
//! The upstream is any `Service<Request<B>, Response = Response<Bytes>, Error = UpstreamError>`,
//! such as [`Upstream`](crate::Upstream). A panic in it, or no answer within the layer's bound,
//! is a failure like any other: refunded, 502.
//!
//! Credits are never left hanging by a call that stops half-way: if the request future is
//! dropped (the client disconnected, a time-out layer above gave up) before the upstream
//! answered, the reservation is refunded; if the upstream had already answered, the call is
//! settled and billed, because the provider did the work and the reply was ready.
//!
//! A reply goes out only for a call the ledger holds as `ok`. If the settle finds the entry
//! already finished, the entry is read: `ok` (an earlier attempt landed but its answer was lost)
//! is replied; `refunded` (recovery took the call back while the upstream worked) answers 502,
//! and a store that stays unreachable 503, both unbilled.
//!
//! ```
//! use std::sync::Arc;
//! use bytes::Bytes;
//! use http::{Request, Response, StatusCode};
//! use model_gateway::{
//!     Accounts, Bucket, Caller, Credits, KeyId, Ledger, MemoryStore, Protocol, ChargeRequest,
//!     RefundOnUpstreamErrorLayer, UpstreamError,
//! };
//! use tower::{ServiceBuilder, ServiceExt, service_fn};
//!
//! # #[tokio::main(flavor = "current_thread")] async fn main() {
//! let store = Arc::new(MemoryStore::new());
//! let account = store.create_account("demo").await.unwrap();
//! store.grant(account, Bucket::Subscription, Credits(5)).await.unwrap();
//! let caller = Caller { account, key: KeyId(1) };
//! let charge = ChargeRequest { caller, protocol: Protocol::Messages, model: "m", price: Credits(5) };
//! let reservation = store.reserve(charge).await.unwrap();
//!
//! let failing_upstream = service_fn(|_: Request<Bytes>| async {
//!     Err::<Response<Bytes>, _>(UpstreamError::transport("connection refused"))
//! });
//! let service = ServiceBuilder::new()
//!     .layer(RefundOnUpstreamErrorLayer::new(store.clone()))
//!     .service(failing_upstream);
//!
//! let mut request = Request::post("/v1/messages").body(Bytes::new()).unwrap();
//! request.extensions_mut().insert(reservation);
//! let response = service.oneshot(request).await.unwrap();
//! assert_eq!(response.status(), StatusCode::BAD_GATEWAY);
//! assert_eq!(store.balance(account).await.unwrap().subscription, Credits(5));
//! # }
//! ```

use std::convert::Infallible;
use std::future::Future;
use std::panic::AssertUnwindSafe;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http::{Request, Response};
use http_body_util::Full;
use serde::Deserialize;
use tower_layer::Layer;
use tower_service::Service;

use crate::BoxFuture;
use crate::error::GatewayError;
use crate::store::{CallFailure, CallId, CallStatus, CallSuccess, Ledger, Reservation, TokenUsage};
use crate::upstream::{ServedBy, UpstreamError};

/// Default bound on one upstream call, whatever the upstream: beyond it the call is refunded.
/// [`HttpUpstream`](crate::HttpUpstream) keeps its own, shorter deadline
/// ([`DEFAULT_CALL_DEADLINE`](crate::DEFAULT_CALL_DEADLINE)).
pub const DEFAULT_UPSTREAM_BOUND: Duration = Duration::from_secs(330);

/// What a refund records when the call's future was dropped before the upstream answered.
pub const CANCELLED_BEFORE_ANSWER: &str =
    "cancelled before the upstream answered (the client went away or the request was dropped)";

/// Configuration of [`RefundOnUpstreamError`]: the ledger that settles and refunds, and the
/// longest an upstream may take.
#[derive(Clone)]
#[must_use]
pub struct RefundOnUpstreamErrorLayer {
    ledger: Arc<dyn Ledger>,
    upstream_bound: Duration,
}

impl RefundOnUpstreamErrorLayer {
    /// Settles and refunds through `ledger`.
    pub fn new(ledger: Arc<dyn Ledger>) -> RefundOnUpstreamErrorLayer {
        RefundOnUpstreamErrorLayer {
            ledger,
            upstream_bound: DEFAULT_UPSTREAM_BOUND,
        }
    }

    /// Refunds a call whose upstream has not answered within `bound`. With every call bounded,
    /// a reservation still `pending` after the bound plus a margin belongs to no live call,
    /// which is what makes [`recover_stale_reservations`](crate::recover_stale_reservations)
    /// safe beside running gateways.
    pub fn upstream_bound(mut self, bound: Duration) -> RefundOnUpstreamErrorLayer {
        self.upstream_bound = bound;
        self
    }
}

impl std::fmt::Debug for RefundOnUpstreamErrorLayer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RefundOnUpstreamErrorLayer")
            .finish_non_exhaustive()
    }
}

impl<U> Layer<U> for RefundOnUpstreamErrorLayer {
    type Service = RefundOnUpstreamError<U>;

    fn layer(&self, upstream: U) -> RefundOnUpstreamError<U> {
        RefundOnUpstreamError {
            upstream,
            ledger: self.ledger.clone(),
            upstream_bound: self.upstream_bound,
            not_ready: None,
        }
    }
}

/// Middleware around the upstream that turns its outcome into a settle or a refund.
pub struct RefundOnUpstreamError<U> {
    upstream: U,
    ledger: Arc<dyn Ledger>,
    upstream_bound: Duration,
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
            not_ready: None,
        }
    }
}

impl<U> RefundOnUpstreamError<U> {
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

impl<U, ReqBody> Service<Request<ReqBody>> for RefundOnUpstreamError<U>
where
    U: Service<Request<ReqBody>, Response = Response<Bytes>, Error = UpstreamError>
        + Clone
        + Send
        + 'static,
    U::Future: Send,
    ReqBody: Send + 'static,
{
    type Response = Response<Full<Bytes>>;
    type Error = Infallible;
    type Future = BoxFuture<Result<Response<Full<Bytes>>, Infallible>>;

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
        let unsettled = request
            .extensions()
            .get::<Reservation>()
            .map(|reservation| UnsettledCall::new(self.ledger.clone(), reservation.call));
        let not_ready = self.not_ready.take();
        let bound = self.upstream_bound;
        let clone = self.upstream.clone();
        let mut upstream = std::mem::replace(&mut self.upstream, clone);
        Box::pin(async move {
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
            let outcome = match tokio::time::timeout(bound, CatchPanic::new(upstream_call)).await {
                Ok(Ok(outcome)) => outcome,
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
                Ok((reply, success)) => match unsettled.settle(success).await {
                    Ok(()) => Ok(reply.map(Full::new)),
                    // Not billed, so the reply is not handed out either.
                    Err(unbilled) => Ok(unbilled.into_response()),
                },
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

/// A reservation whose outcome is not written yet. If it is dropped unwritten (the request
/// future was dropped because the client went away or a time-out above gave up, or a panic
/// unwound through it), the outcome is still written, on a spawned task: a refund if the
/// upstream had not answered, a settle if it had. Settle and refund are guarded by the
/// entry's status, so writing twice (a drop during a write) changes nothing the second time.
struct UnsettledCall {
    ledger: Arc<dyn Ledger>,
    call: CallId,
    /// The upstream's success, once it answered: a client that leaves after that is billed.
    answered: Option<CallSuccess>,
    written: bool,
}

impl UnsettledCall {
    fn new(ledger: Arc<dyn Ledger>, call: CallId) -> UnsettledCall {
        UnsettledCall {
            ledger,
            call,
            answered: None,
            written: false,
        }
    }

    /// Settles. `Ok` once the call is billed; otherwise the reply must not be handed out, and
    /// the error says why: the store stayed unreachable through every retry (the entry stays
    /// `pending` until recovery refunds it), or the call was refunded meanwhile.
    async fn settle(&mut self, success: CallSuccess) -> Result<(), GatewayError> {
        self.answered = Some(success.clone());
        let (ledger, call) = (self.ledger.clone(), self.call);
        let settled = with_retries(call, "settle", || ledger.settle(call, success.clone())).await;
        self.written = true;
        match settled {
            Some(true) => Ok(()),
            // Not `pending` any more: billed by an earlier attempt whose answer was lost, or
            // refunded meanwhile (by recovery, if its age is shorter than this call lasted).
            // Only a billed call may have its reply.
            Some(false) => match with_retries(call, "read", || ledger.call_status(call)).await {
                Some(Some(CallStatus::Ok)) => Ok(()),
                Some(status) => {
                    tracing::error!(
                        call = call.0,
                        ?status,
                        "the call was finished by someone else while its upstream answered \
                         (a recovery age shorter than the call?); its reply is withheld"
                    );
                    Err(GatewayError::UpstreamUnavailable)
                }
                None => Err(GatewayError::StoreUnavailable),
            },
            None => Err(GatewayError::StoreUnavailable),
        }
    }

    /// Refunds; `false` if the store stayed unreachable through every retry. A refund that
    /// finds its entry no longer `pending` is done: its credits are back, or were never to be.
    async fn refund(&mut self, failure: CallFailure) -> bool {
        let (ledger, call) = (self.ledger.clone(), self.call);
        let refunded = with_retries(call, "refund", || ledger.refund(call, &failure)).await;
        self.written = true;
        refunded.is_some()
    }
}

impl Drop for UnsettledCall {
    fn drop(&mut self) {
        if self.written {
            return;
        }
        let (ledger, call, answered) = (self.ledger.clone(), self.call, self.answered.take());
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            tracing::error!(
                call = call.0,
                "no runtime to finish a dropped call; left for recovery"
            );
            return;
        };
        runtime.spawn(async move {
            let written = match answered {
                Some(success) => ledger.settle(call, success).await,
                None => {
                    let failure = CallFailure {
                        upstream_status: None,
                        error: CANCELLED_BEFORE_ANSWER.to_owned(),
                    };
                    ledger.refund(call, &failure).await
                }
            };
            if let Err(error) = written {
                tracing::error!(call = call.0, %error, "finishing a dropped call failed; left for recovery");
            }
        });
    }
}

/// Pauses between attempts to write an outcome while the store is unreachable (a dropped
/// connection is replaced by the pool within these).
const WRITE_RETRY_PAUSES: [Duration; 3] = [
    Duration::from_millis(50),
    Duration::from_millis(250),
    Duration::from_secs(1),
];

/// Runs a settle, a refund or a read until the store answers; `None` if it never does. Settles
/// and refunds are guarded by the entry's status, so repeating one whose first attempt did land
/// changes nothing. An entry whose write never lands stays `pending`, and recovery refunds it
/// later.
async fn with_retries<F, Fut, T>(call: CallId, what: &str, mut write: F) -> Option<T>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<T, crate::StoreError>>,
{
    for pause in WRITE_RETRY_PAUSES.iter().map(Some).chain([None]) {
        match write().await {
            Ok(answer) => return Some(answer),
            Err(error) => {
                tracing::error!(call = call.0, %error, "{what} failed");
                match pause {
                    Some(pause) => tokio::time::sleep(*pause).await,
                    None => {
                        tracing::error!(call = call.0, "{what} given up after retries");
                        return None;
                    }
                }
            }
        }
    }
    None
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

/// Decides whether an upstream outcome is a success worth paying for. A failure comes with
/// what the client may be told of it.
fn judge(
    outcome: Result<Response<Bytes>, UpstreamError>,
) -> Result<(Response<Bytes>, CallSuccess), (CallFailure, Option<String>)> {
    let mut reply = match outcome {
        Ok(reply) => reply,
        Err(error) => {
            let client_message = error.client_message.clone();
            return Err((error.into(), client_message));
        }
    };
    let status = reply.status();
    if !status.is_success() {
        return Err((
            UpstreamError::status(status.as_u16(), reply.body()).into(),
            None,
        ));
    }
    // An upstream that already parsed the reply says so; otherwise parse it here.
    let usage = match reply.extensions_mut().remove::<TokenUsage>() {
        Some(usage) => usage,
        None => reply_usage(reply.body()).ok_or_else(|| {
            let failure = CallFailure {
                upstream_status: Some(status.as_u16()),
                error: "upstream answered with a body that is not a JSON object".to_owned(),
            };
            (failure, None)
        })?,
    };
    let channel = reply
        .extensions_mut()
        .remove::<ServedBy>()
        .map(|served| served.0);
    Ok((
        reply,
        CallSuccess {
            upstream_status: status.as_u16(),
            usage,
            channel,
        },
    ))
}

/// Token usage from a reply of either protocol; `None` if the body is not a JSON object.
pub fn reply_usage(body: &[u8]) -> Option<TokenUsage> {
    #[derive(Deserialize)]
    struct Reply {
        #[serde(default)]
        usage: Option<Usage>,
    }
    #[derive(Deserialize)]
    struct Usage {
        #[serde(alias = "prompt_tokens")]
        input_tokens: Option<i64>,
        #[serde(alias = "completion_tokens")]
        output_tokens: Option<i64>,
    }
    if body.trim_ascii_start().first() != Some(&b'{') {
        return None;
    }
    let reply: Reply = serde_json::from_slice(body).ok()?;
    Some(
        reply
            .usage
            .map_or_else(TokenUsage::default, |usage| TokenUsage {
                input_tokens: usage.input_tokens,
                output_tokens: usage.output_tokens,
            }),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn usage_is_read_from_both_reply_shapes() {
        let chat = br#"{"usage":{"prompt_tokens":3,"completion_tokens":4,"total_tokens":7}}"#;
        assert_eq!(
            reply_usage(chat),
            Some(TokenUsage {
                input_tokens: Some(3),
                output_tokens: Some(4)
            })
        );
        let messages = br#"{"type":"message","usage":{"input_tokens":5,"output_tokens":6}}"#;
        assert_eq!(
            reply_usage(messages),
            Some(TokenUsage {
                input_tokens: Some(5),
                output_tokens: Some(6)
            })
        );
        assert_eq!(reply_usage(b"{}"), Some(TokenUsage::default()));
    }

    #[test]
    fn a_body_that_is_not_a_json_object_is_a_failure() {
        assert_eq!(reply_usage(b"<html>oops</html>"), None);
        assert_eq!(reply_usage(b"[1,2]"), None);
        let reply = Response::new(Bytes::from_static(b"not json"));
        assert!(judge(Ok(reply)).is_err());
    }

    #[test]
    fn a_non_2xx_reply_is_a_failure_that_keeps_the_status() {
        let mut reply = Response::new(Bytes::from_static(br#"{"error":"overloaded"}"#));
        *reply.status_mut() = http::StatusCode::TOO_MANY_REQUESTS;
        let failure = judge(Ok(reply)).unwrap_err();
        assert_eq!(failure.0.upstream_status, Some(429));
        assert!(failure.0.error.contains("overloaded"));
    }
}
