//! A bound on the endpoints that read or write the ledger outside a call (the key holders'
//! endpoints and the admin API): a database that stops answering makes them `503
//! {"detail":"服务暂时不可用, 请稍后重试"}` within the bound instead of hanging. A request cut
//! off is dropped: a write that had not committed is rolled back. The bound starts once the
//! request's body is read; a body that stalls is `408`, the client's own doing.

use std::convert::Infallible;
use std::task::{Context, Poll};
use std::time::Duration;

use axum::body::Body;
use http::{Request, Response};
use http_body_util::BodyExt;
use tower_layer::Layer;
use tower_service::Service;

use crate::error::GatewayError;

/// Bounds every request of the services it wraps by `timeout`.
#[derive(Debug, Clone, Copy)]
pub(crate) struct LedgerDeadlineLayer {
    pub(crate) timeout: Duration,
}

impl<S> Layer<S> for LedgerDeadlineLayer {
    type Service = LedgerDeadline<S>;

    fn layer(&self, inner: S) -> LedgerDeadline<S> {
        LedgerDeadline {
            inner,
            timeout: self.timeout,
        }
    }
}

/// The service of [`LedgerDeadlineLayer`].
#[derive(Debug, Clone)]
pub(crate) struct LedgerDeadline<S> {
    inner: S,
    timeout: Duration,
}

type ResponseFuture =
    std::pin::Pin<Box<dyn std::future::Future<Output = Result<Response<Body>, Infallible>> + Send>>;

/// The longest a client may take to send the body of a request to these endpoints (small JSON
/// bodies): past it, `408`. The ledger's bound starts once the body is read, so that a client
/// that stalls is told so, not that the database is unavailable.
pub(crate) const BODY_DEADLINE: Duration = crate::router::DEFAULT_BODY_IDLE_TIMEOUT;

/// The largest body these endpoints read (axum's default limit, which their extractors apply
/// again).
const MAX_BODY: usize = 2 * 1024 * 1024;

impl<S> Service<Request<Body>> for LedgerDeadline<S>
where
    S: Service<Request<Body>, Response = Response<Body>, Error = Infallible>
        + Clone
        + Send
        + 'static,
    S::Future: Send + 'static,
{
    type Response = Response<Body>;
    type Error = Infallible;
    type Future = ResponseFuture;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: Request<Body>) -> Self::Future {
        let mut inner = crate::macros::take_ready(&mut self.inner);
        let timeout = self.timeout;
        Box::pin(async move {
            let (parts, body) = request.into_parts();
            let limited = http_body_util::Limited::new(body, MAX_BODY);
            let bytes = match tokio::time::timeout(BODY_DEADLINE, limited.collect()).await {
                Ok(Ok(collected)) => collected.to_bytes(),
                Ok(Err(error)) if error.is::<http_body_util::LengthLimitError>() => {
                    return Ok(GatewayError::PayloadTooLarge.into_response());
                }
                Ok(Err(_)) => return Ok(GatewayError::UnreadableBody.into_response()),
                Err(_) => return Ok(GatewayError::RequestTimeout.into_response()),
            };
            let answer = inner.call(Request::from_parts(parts, Body::from(bytes)));
            match tokio::time::timeout(timeout, answer).await {
                Ok(answer) => answer,
                Err(_) => {
                    tracing::error!(?timeout, "the database did not answer in time");
                    Ok(GatewayError::StoreUnavailable.into_response())
                }
            }
        })
    }
}
