//! [`CreditCharge`]: take the price before the upstream is called.
//!
//! Reads [`Caller`] and [`RoutedCall`], asks the [`Ledger`] to reserve the model's price
//! (subscription credits first, then top-up) and write the `pending` call-log entry in one
//! transaction, and adds the [`Reservation`] extension. A pool too small is answered
//! `402 {"detail":"积分不足"}` with nothing written.
//!
//! A call with an [`IdempotencyKey`] (the client's `Idempotency-Key`
//! header) is billed at most once per account and key: a retry while the first call runs gets
//! `409`, a retry after it was billed gets its reply again, uncharged, marked
//! [`IDEMPOTENT_REPLAYED_HEADER`]`: true`, the key reused for another request gets `422`, and a
//! retry after a refund is a new call.
//!
//! ```
//! use std::{convert::Infallible, sync::Arc};
//! use bytes::Bytes;
//! use http::{Request, Response, StatusCode};
//! use http_body_util::Full;
//! use model_gateway::{
//!     Accounts, Catalogue, CreditChargeLayer, Credits, KeyId, Ledger, MemoryStore, Protocol,
//!     call::RoutedCall, credits::Bucket, store::Caller, store::Reservation,
//! };
//! use tower::{ServiceBuilder, ServiceExt, service_fn};
//!
//! # #[tokio::main(flavor = "current_thread")] async fn main() {
//! let store = Arc::new(MemoryStore::new());
//! let account = store.create_account("demo").await.unwrap();
//! store.grant(account, Bucket::Topup, Credits::new(3)).await.unwrap();
//!
//! let service = ServiceBuilder::new()
//!     .layer(CreditChargeLayer::new(store.clone()))
//!     .service(service_fn(|request: Request<Bytes>| async move {
//!         let reservation = request.extensions().get::<Reservation>().unwrap();
//!         Ok::<_, Infallible>(Response::new(Full::<Bytes>::from(reservation.taken.total().to_string())))
//!     }));
//!
//! let call = || {
//!     let mut request = Request::post("/v1/chat/completions").body(Bytes::new()).unwrap();
//!     request.extensions_mut().insert(Caller { account, key: KeyId(1) });
//!     let model = Catalogue::demo().model("gpt-4o-mini").unwrap().clone(); // price 2
//!     request.extensions_mut().insert(RoutedCall::new(Protocol::ChatCompletions, model, false));
//!     request
//! };
//! assert_eq!(service.clone().oneshot(call()).await.unwrap().status(), StatusCode::OK);
//! assert_eq!(service.oneshot(call()).await.unwrap().status(), StatusCode::PAYMENT_REQUIRED);
//! assert_eq!(store.balance(account).await.unwrap().total(), Credits::new(1));
//! # }
//! ```

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http::{HeaderValue, Request, Response, StatusCode, header};
use tower_layer::Layer;
use tower_service::Service;

use crate::call::{IdempotencyKey, RequestId, Reservation, RoutedCall};
use crate::catalogue::ModelRoute;
use crate::error::GatewayError;
use crate::protocol::Protocol;
use crate::store::outcome::{Outcome, finish_later};
use crate::store::{
    CallFailure, CallStatus, Caller, ChargeRequest, DEFAULT_LEDGER_TIMEOUT, KeptReply, Ledger,
    ReserveError, StoreError,
};

/// The header on a reply given again for a retry with the same `Idempotency-Key` (uncharged),
/// as Stripe names it.
pub const IDEMPOTENT_REPLAYED_HEADER: &str = "idempotent-replayed";

/// Configuration of [`CreditCharge`]: the ledger to charge, and how long to wait for it.
#[derive(Debug, Clone)]
#[must_use]
pub struct CreditChargeLayer {
    ledger: Arc<dyn Ledger>,
    timeout: Duration,
}

impl CreditChargeLayer {
    /// Charges through `ledger`.
    pub fn new(ledger: Arc<dyn Ledger>) -> CreditChargeLayer {
        CreditChargeLayer {
            ledger,
            timeout: DEFAULT_LEDGER_TIMEOUT,
        }
    }

    /// How long a reservation may take before the client is answered
    /// `503 {"detail":"服务暂时不可用, 请稍后重试"}` (default [`DEFAULT_LEDGER_TIMEOUT`]). A
    /// reservation that lands after that is refunded at once: the upstream is never called.
    pub fn ledger_timeout(mut self, timeout: Duration) -> CreditChargeLayer {
        self.timeout = timeout;
        self
    }
}

impl<S> Layer<S> for CreditChargeLayer {
    type Service = CreditCharge<S>;

    fn layer(&self, inner: S) -> CreditCharge<S> {
        CreditCharge {
            inner,
            ledger: self.ledger.clone(),
            timeout: self.timeout,
        }
    }
}

/// Middleware that reserves the model's price and adds the [`Reservation`] extension.
#[derive(Debug, Clone)]
pub struct CreditCharge<S> {
    inner: S,
    ledger: Arc<dyn Ledger>,
    timeout: Duration,
}

crate::macros::inner_service_accessors!(CreditCharge, S, inner);

impl<S> CreditCharge<S> {
    /// Charges calls to `inner` through `ledger`.
    pub fn new(inner: S, ledger: Arc<dyn Ledger>) -> CreditCharge<S> {
        CreditChargeLayer::new(ledger).layer(inner)
    }

    /// A [`CreditChargeLayer`] over `ledger`.
    pub fn layer(ledger: Arc<dyn Ledger>) -> CreditChargeLayer {
        CreditChargeLayer::new(ledger)
    }
}

crate::macros::response_future! {
    /// The future [`CreditCharge`] answers with.
    ResponseFuture
}

impl<S, ReqBody, ResBody> Service<Request<ReqBody>> for CreditCharge<S>
where
    S: Service<Request<ReqBody>, Response = Response<ResBody>> + Clone + Send + 'static,
    S::Future: Send,
    ReqBody: Send + 'static,
    ResBody: From<Bytes>,
{
    type Response = Response<ResBody>;
    type Error = S::Error;
    type Future = ResponseFuture<Result<Response<ResBody>, S::Error>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), S::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, mut request: Request<ReqBody>) -> Self::Future {
        let caller = request.extensions().get::<Caller>().copied();
        let routed = request.extensions().get::<RoutedCall>().cloned();
        let request_id = request.extensions().get::<RequestId>().cloned();
        let idempotency = request.extensions().get::<IdempotencyKey>().cloned();
        let ledger = self.ledger.clone();
        let timeout = self.timeout;
        let mut inner = crate::macros::take_ready(&mut self.inner);
        ResponseFuture::new(async move {
            let (Some(caller), Some(routed)) = (caller, routed) else {
                tracing::error!("CreditCharge needs ApiKeyAuth and ProtocolRouter outside it");
                return Ok(GatewayError::Misconfigured.into_response());
            };
            let counted_as = (routed.model.clone(), routed.protocol);
            let asked = (caller, request_id.clone());
            let reserving =
                ReservationUnderWay::new(ledger.clone(), counted_as, asked, async move {
                    let dropped = routed.dropped_tools();
                    let charge = ChargeRequest {
                        at: chrono::Utc::now(),
                        caller,
                        protocol: routed.protocol,
                        model: &routed.model.name,
                        requested_model: routed.alias.as_deref(),
                        price: routed.reservation(),
                        request_id: request_id.as_ref().map(RequestId::as_str),
                        idempotency: idempotency.as_ref(),
                        dropped_tools: dropped.as_deref(),
                    };
                    ledger.reserve(charge).await
                });
            // Dropped at the time-out, the reservation goes on and is refunded if it lands.
            let Ok(reserved) = crate::time_limit::within(timeout, reserving).await else {
                tracing::error!(?timeout, "the ledger did not answer a reservation in time");
                return Ok(GatewayError::StoreUnavailable.into_response());
            };
            match reserved {
                Ok(reservation) => {
                    request.extensions_mut().insert(reservation);
                    inner.call(request).await
                }
                Err(ReserveError::InsufficientCredits) => {
                    Ok(GatewayError::InsufficientCredits.into_response())
                }
                Err(ReserveError::KeyLimitReached) => {
                    Ok(GatewayError::KeyLimitReached.into_response())
                }
                Err(ReserveError::KeyRevoked) => Ok(GatewayError::InvalidApiKey.into_response()),
                Err(ReserveError::IdempotentCallRunning) => {
                    Ok(GatewayError::IdempotentCallRunning.into_response())
                }
                Err(ReserveError::IdempotencyKeyReused) => {
                    Ok(GatewayError::IdempotencyKeyReused.into_response())
                }
                Err(ReserveError::AlreadyAnswered(Some(reply))) => Ok(replayed(reply)),
                Err(ReserveError::AlreadyAnswered(None)) => {
                    Ok(GatewayError::IdempotentReplyNotKept.into_response())
                }
                Err(ReserveError::Store(error)) => {
                    tracing::error!(%error, "reservation failed; nothing charged");
                    Ok(GatewayError::StoreUnavailable.into_response())
                }
            }
        })
    }
}

/// What a reservation's call-log entry says when the request was dropped (its client went away,
/// or a time-out above gave up) while its credits were being reserved: the reservation is
/// finished anyway and refunded at once, and the upstream is never called.
pub const CANCELLED_WHILE_RESERVING: &str = "cancelled while its credits were being reserved \
     (the client went away or the request was dropped); the upstream was not called";

type Reserving = Pin<Box<dyn Future<Output = Result<Reservation, ReserveError>> + Send>>;

/// A reservation under way. Answered with a store error, it looks for its entry in case the
/// commit landed with its answer lost ([`refund_if_it_landed`]). Dropped before it is answered
/// (its request was dropped), it is not abandoned: a reservation the ledger is writing may land after its caller is gone, and nobody
/// would then end it, so its credits would stay taken and its entry `pending` until recovery.
/// Instead the reservation is driven to its end on a spawned task and refunded there. A call
/// that is not dropped costs nothing more than the box.
struct ReservationUnderWay {
    ledger: Arc<dyn Ledger>,
    /// The model and endpoint the metrics count the call under, if it is refunded here.
    counted_as: (Arc<ModelRoute>, Protocol),
    /// Who asked, and the request's id: where to look for a reservation whose answer was lost.
    asked: (Caller, Option<RequestId>),
    reserving: Option<Reserving>,
}

impl ReservationUnderWay {
    fn new(
        ledger: Arc<dyn Ledger>,
        counted_as: (Arc<ModelRoute>, Protocol),
        asked: (Caller, Option<RequestId>),
        reserving: impl Future<Output = Result<Reservation, ReserveError>> + Send + 'static,
    ) -> ReservationUnderWay {
        ReservationUnderWay {
            ledger,
            counted_as,
            asked,
            reserving: Some(Box::pin(reserving)),
        }
    }
}

impl Future for ReservationUnderWay {
    type Output = Result<Reservation, ReserveError>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let Some(reserving) = self.reserving.as_mut() else {
            return Poll::Ready(Err(ReserveError::Store(StoreError::msg(
                "a reservation was polled after it was answered",
            ))));
        };
        let answered = std::task::ready!(reserving.as_mut().poll(cx));
        self.reserving = None;
        if let Err(ReserveError::Store(_)) = answered {
            let (caller, request_id) = self.asked.clone();
            refund_if_it_landed(self.ledger.clone(), caller, request_id);
        }
        Poll::Ready(answered)
    }
}

impl Drop for ReservationUnderWay {
    fn drop(&mut self) {
        let Some(reserving) = self.reserving.take() else {
            return;
        };
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            tracing::error!("no runtime to finish a dropped reservation; left for recovery");
            return;
        };
        let ledger = self.ledger.clone();
        let (model, protocol) = self.counted_as.clone();
        let (caller, request_id) = self.asked.clone();
        runtime.spawn(async move {
            let reservation = match reserving.await {
                Ok(reservation) => reservation,
                // Its answer may have been lost with a commit that landed.
                Err(ReserveError::Store(_)) => {
                    refund_if_it_landed(ledger, caller, request_id);
                    return;
                }
                Err(_) => return,
            };
            let failure = CallFailure {
                upstream_status: None,
                error: CANCELLED_WHILE_RESERVING.to_owned(),
            };
            let call = reservation.call;
            let credits = reservation.taken.total().get();
            finish_later(ledger, call, Outcome::Refund(failure), move |status| {
                tracing::info!(
                    call = call.0,
                    ?status,
                    "a reservation whose request was dropped ended"
                );
                // Counted as the ledger has it, like every call that reached the upstream.
                if let Some(status @ (CallStatus::Ok | CallStatus::Refunded)) = status {
                    let settled = status == CallStatus::Ok;
                    crate::telemetry::call_ended(&model.name, protocol.as_str(), settled, credits);
                }
            });
        });
    }
}

/// What a reservation's entry says when the store failed as it was written (the connection cut
/// just after the commit, say) and the entry was found afterwards: its client was answered 503,
/// so it is refunded.
pub const RESERVATION_ANSWER_LOST: &str = "the store failed as this reservation was written \
     and its client was answered 503; found afterwards by its request id and refunded";

/// After a reservation failed in the store, which may have committed it all the same (its answer
/// lost with the connection): looks, until the store answers, for `caller`'s pending entry of
/// this request and refunds it, so that no credit stays held by a call that was refused. Needs
/// the request's id ([`RequestIdLayer`](crate::request_id::RequestIdLayer) sets one).
fn refund_if_it_landed(ledger: Arc<dyn Ledger>, caller: Caller, request_id: Option<RequestId>) {
    let Some(request_id) = request_id else {
        return;
    };
    let Ok(runtime) = tokio::runtime::Handle::try_current() else {
        return;
    };
    runtime.spawn(async move {
        let mut pause = std::time::Duration::from_millis(250);
        let found = loop {
            match ledger
                .pending_for_request(caller.account, request_id.as_str())
                .await
            {
                Ok(found) => break found,
                Err(_) => {
                    tokio::time::sleep(pause).await;
                    pause = (pause * 2).min(std::time::Duration::from_secs(5));
                }
            }
        };
        for call in found {
            tracing::warn!(
                call = call.0,
                "a reservation whose answer was lost is refunded"
            );
            let failure = CallFailure {
                upstream_status: None,
                error: RESERVATION_ANSWER_LOST.to_owned(),
            };
            finish_later(ledger.clone(), call, Outcome::Refund(failure), |_| {});
        }
    });
}

/// A kept reply given again, uncharged, marked as such.
fn replayed<B: From<Bytes>>(reply: KeptReply) -> Response<B> {
    crate::telemetry::replayed();
    let mut response = Response::new(B::from(reply.body));
    *response.status_mut() = StatusCode::from_u16(reply.status).unwrap_or(StatusCode::OK);
    let headers = response.headers_mut();
    if let Some(content_type) = reply
        .content_type
        .and_then(|value| HeaderValue::from_str(&value).ok())
    {
        headers.insert(header::CONTENT_TYPE, content_type);
    }
    headers.insert(IDEMPOTENT_REPLAYED_HEADER, HeaderValue::from_static("true"));
    response
}
