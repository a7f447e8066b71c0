//! [`RefundOnUpstreamError`]: settle on success, refund on failure.
//!
//! Wraps the upstream service. When the upstream answers 2xx with a JSON body, the call's entry
//! becomes `ok` (with the token usage the reply reports) and the reply goes to the client
//! unchanged. On any failure (connection error, time-out, non-2xx status, unreadable or non-JSON
//! body) the [`Reservation`](crate::store::Reservation)'s credits go back to the buckets they came from, the entry becomes
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
//!     Accounts, Credits, KeyId, Ledger, MemoryStore, Protocol, RefundOnUpstreamErrorLayer,
//!     credits::Bucket, error::UpstreamError, store::Caller, store::ChargeRequest,
//! };
//! use tower::{ServiceBuilder, ServiceExt, service_fn};
//!
//! # #[tokio::main(flavor = "current_thread")] async fn main() {
//! let store = Arc::new(MemoryStore::new());
//! let account = store.create_account("demo").await.unwrap();
//! store.grant(account, Bucket::Subscription, Credits::new(5)).await.unwrap();
//! let caller = Caller { account, key: KeyId(1) };
//! let charge = ChargeRequest::new(caller, Protocol::Messages, "m", Credits::new(5));
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
//! assert_eq!(store.balance(account).await.unwrap().subscription, Credits::new(5));
//! # }
//! ```

mod body;
mod delivery;
mod guard;
mod layer;
mod service;

use std::time::Duration;

pub use crate::call::ClientWrites;
pub use body::{CLIENT_LEFT_BEFORE_CONTENT, ResponseBody};
pub use guard::SETTLE_NOT_WRITTEN;
pub use layer::RefundOnUpstreamErrorLayer;
pub use service::ResponseFuture;
pub use service::{CREDITS_HEADER, RefundOnUpstreamError};

/// Default bound on one upstream call, whatever the upstream: beyond it the call is refunded.
/// [`HttpUpstream`](crate::upstream::HttpUpstream) keeps its own, shorter deadline
/// ([`DEFAULT_CALL_DEADLINE`](crate::catalogue::DEFAULT_CALL_DEADLINE)).
pub const DEFAULT_UPSTREAM_BOUND: Duration = Duration::from_secs(330);

/// What a refund records when the call's future was dropped before the upstream answered.
pub const CANCELLED_BEFORE_ANSWER: &str =
    "cancelled before the upstream answered (the client went away or the request was dropped)";
