//! [`RateLimit`]: requests per minute per key.
//!
//! Reads [`Caller`] and [`KeyRules`]; a key with an `rpm` that has made that many requests in the
//! current minute is answered `429 {"detail":"请求过于频繁"}` with `Retry-After` (the seconds
//! left in the minute), before anything is read or charged. Minutes are wall-clock minutes, so
//! every gateway counts in the same windows.
//!
//! Where the counts live is the [`RateLimiter`]'s business: in this process
//! ([`RateLimiter::local`]: each gateway instance enforces the limit on its own), or in Redis
//! ([`RateLimiter::redis`], feature `redis`: the limit holds across every instance that shares
//! it). A Redis that cannot be reached does not stop calls: the limiter counts in this process
//! until Redis answers again, and logs both changes.
//!
//! ```
//! use std::{convert::Infallible, sync::Arc};
//! use bytes::Bytes;
//! use http::{Request, Response, StatusCode};
//! use http_body_util::Full;
//! use model_gateway::rate_limit::{RateLimitLayer, RateLimiter};
//! use model_gateway::{AccountId, store::Caller, KeyId, call::KeyRules};
//! use tower::{ServiceBuilder, ServiceExt, service_fn};
//!
//! # #[tokio::main(flavor = "current_thread")] async fn main() {
//! let service = ServiceBuilder::new()
//!     .layer(RateLimitLayer::new(RateLimiter::local()))
//!     .service(service_fn(|_: Request<Full<Bytes>>| async {
//!         Ok::<_, Infallible>(Response::new(Full::<Bytes>::default()))
//!     }));
//!
//! let call = || {
//!     let mut request = Request::post("/v1/messages").body(Full::default()).unwrap();
//!     request.extensions_mut().insert(Caller { account: AccountId(1), key: KeyId(7) });
//!     request.extensions_mut().insert(KeyRules { rpm: Some(2), ..KeyRules::default() });
//!     request
//! };
//! assert_eq!(service.clone().oneshot(call()).await.unwrap().status(), StatusCode::OK);
//! assert_eq!(service.clone().oneshot(call()).await.unwrap().status(), StatusCode::OK);
//! let refused = service.oneshot(call()).await.unwrap();
//! assert_eq!(refused.status(), StatusCode::TOO_MANY_REQUESTS);
//! assert!(refused.headers().contains_key("retry-after"));
//! # }
//! ```

use std::task::{Context, Poll};

use bytes::Bytes;
use http::{Request, Response};
use tower_layer::Layer;
use tower_service::Service;

use crate::call::{Caller, KeyRules};
use crate::error::GatewayError;

mod limiter;

pub use limiter::{Counted, Decision, RateLimiter};

/// Configuration of [`RateLimit`]: where the counts live.
#[derive(Debug, Clone)]
#[must_use]
pub struct RateLimitLayer {
    limiter: RateLimiter,
}

impl RateLimitLayer {
    /// Limits with `limiter`.
    pub fn new(limiter: RateLimiter) -> RateLimitLayer {
        RateLimitLayer { limiter }
    }
}

impl<S> Layer<S> for RateLimitLayer {
    type Service = RateLimit<S>;

    fn layer(&self, inner: S) -> RateLimit<S> {
        RateLimit {
            inner,
            limiter: self.limiter.clone(),
        }
    }
}

/// Middleware that refuses a key's requests past its requests per minute.
#[derive(Debug, Clone)]
pub struct RateLimit<S> {
    inner: S,
    limiter: RateLimiter,
}

crate::macros::inner_service_accessors!(RateLimit, S, inner);

impl<S> RateLimit<S> {
    /// Limits the callers of `inner` with `limiter`.
    pub fn new(inner: S, limiter: RateLimiter) -> RateLimit<S> {
        RateLimitLayer::new(limiter).layer(inner)
    }

    /// A [`RateLimitLayer`] with `limiter`.
    pub fn layer(limiter: RateLimiter) -> RateLimitLayer {
        RateLimitLayer::new(limiter)
    }
}

crate::macros::response_future! {
    /// The future [`RateLimit`] answers with.
    ResponseFuture
}

impl<S, ReqBody, ResBody> Service<Request<ReqBody>> for RateLimit<S>
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

    fn call(&mut self, request: Request<ReqBody>) -> Self::Future {
        let limited = request
            .extensions()
            .get::<KeyRules>()
            .and_then(|rules| rules.rpm)
            .zip(
                request
                    .extensions()
                    .get::<Caller>()
                    .map(|caller| caller.key),
            );
        let mut inner = crate::macros::take_ready(&mut self.inner);
        let Some((rpm, key)) = limited else {
            return ResponseFuture::new(async move { inner.call(request).await });
        };
        let limiter = self.limiter.clone();
        ResponseFuture::new(async move {
            match limiter.check(key, rpm).await {
                Decision::Allowed => inner.call(request).await,
                Decision::Limited { retry_after } => {
                    Ok(GatewayError::RateLimited(retry_after.as_secs().max(1)).into_response())
                }
            }
        })
    }
}
