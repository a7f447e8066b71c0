//! A bound on the endpoints that read or write the ledger outside a call (the key holders'
//! endpoints and the admin API): a database that stops answering makes them `503
//! {"detail":"服务暂时不可用, 请稍后重试"}` within the bound instead of hanging. A request cut
//! off is dropped: a write that had not committed is rolled back.

use std::convert::Infallible;
use std::task::{Context, Poll};
use std::time::Duration;

use axum::body::Body;
use http::{Request, Response};
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

impl<S, ReqBody> Service<Request<ReqBody>> for LedgerDeadline<S>
where
    S: Service<Request<ReqBody>, Response = Response<Body>, Error = Infallible>,
    S::Future: Send + 'static,
{
    type Response = Response<Body>;
    type Error = Infallible;
    type Future = ResponseFuture;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: Request<ReqBody>) -> Self::Future {
        let answer = self.inner.call(request);
        let timeout = self.timeout;
        Box::pin(async move {
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
