//! [`AccessLogLayer`]: one log line per request, refused ones included.
//!
//! The layer adds an [`AccessEntry`] to each request, which the layers inside note what they
//! learn in (the key's display prefix, the model, the call's outcome and credits), and writes
//! the entry as one `INFO` line of target [`ACCESS_LOG_TARGET`]
//! when the answer leaves: with the request id, method, path, status, duration, and a refusal's
//! reason. Where no subscriber takes those lines (`RUST_LOG` filters them out), it notes
//! nothing. A stream billed when it ends is written at its end, with its whole duration and
//! what it was charged. Put it inside [`RequestIdLayer`](crate::request_id::RequestIdLayer),
//! whose id the line carries, and outside the layers whose refusals it should count; a second
//! instance inside the first leaves the line to the outer one.
//!
//! ```
//! use std::convert::Infallible;
//! use bytes::Bytes;
//! use http::{Request, Response};
//! use model_gateway::{GatewayError, access_log::AccessLogLayer, request_id::RequestIdLayer};
//! use tower::{ServiceBuilder, ServiceExt, service_fn};
//!
//! # #[tokio::main(flavor = "current_thread")] async fn main() {
//! // Logs `INFO model_gateway::access: request request_id="req_…" method="POST"
//! // path="/v1/messages" status=401 duration_ms=0.01 error="invalid_api_key"`.
//! let service = ServiceBuilder::new()
//!     .layer(RequestIdLayer::new())
//!     .layer(AccessLogLayer::new())
//!     .service(service_fn(|_: Request<()>| async {
//!         Ok::<Response<Bytes>, Infallible>(GatewayError::InvalidApiKey.into_response())
//!     }));
//! let answer = service.oneshot(Request::post("/v1/messages").body(()).unwrap()).await.unwrap();
//! assert_eq!(answer.status(), 401);
//! # }
//! ```

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll, ready};

use http::{Request, Response};
use pin_project_lite::pin_project;
use tower_layer::Layer;
use tower_service::Service;

use crate::call::{ACCESS_LOG_TARGET, AccessEntry, RequestId};
use crate::error::GatewayError;

/// Configuration of [`AccessLog`] (none yet).
#[derive(Debug, Clone, Default)]
#[must_use]
pub struct AccessLogLayer {
    _private: (),
}

impl AccessLogLayer {
    /// The layer.
    pub fn new() -> AccessLogLayer {
        AccessLogLayer::default()
    }
}

impl<S> Layer<S> for AccessLogLayer {
    type Service = AccessLog<S>;

    fn layer(&self, inner: S) -> AccessLog<S> {
        AccessLog { inner }
    }
}

/// Middleware that writes one access-log line per request; see the module docs.
#[derive(Debug, Clone)]
pub struct AccessLog<S> {
    inner: S,
}

crate::macros::inner_service_accessors!(AccessLog, S, inner);

impl<S> AccessLog<S> {
    /// Logs the requests to `inner`.
    pub fn new(inner: S) -> AccessLog<S> {
        AccessLog { inner }
    }
}

impl<S, ReqBody, ResBody> Service<Request<ReqBody>> for AccessLog<S>
where
    S: Service<Request<ReqBody>, Response = Response<ResBody>>,
{
    type Response = Response<ResBody>;
    type Error = S::Error;
    type Future = ResponseFuture<S::Future>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), S::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, mut request: Request<ReqBody>) -> Self::Future {
        // An outer instance writes this request's line; with the lines filtered out (or no
        // subscriber at all) nothing is noted.
        let logged = tracing::enabled!(target: ACCESS_LOG_TARGET, tracing::Level::INFO);
        let entry = if !logged || request.extensions().get::<AccessEntry>().is_some() {
            None
        } else {
            let entry = AccessEntry::new(
                request.extensions().get::<RequestId>().cloned(),
                request.method().clone(),
                request.uri().clone(),
            );
            request.extensions_mut().insert(entry.clone());
            Some(entry)
        };
        ResponseFuture {
            inner: self.inner.call(request),
            entry,
        }
    }
}

pin_project! {
    /// The future [`AccessLog`] answers with.
    pub struct ResponseFuture<F> {
        #[pin]
        inner: F,
        // Dropped unanswered (the client went away), the entry's last holder writes the line.
        entry: Option<AccessEntry>,
    }
}

impl<F> std::fmt::Debug for ResponseFuture<F> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ResponseFuture").finish_non_exhaustive()
    }
}

impl<F, B, E> Future for ResponseFuture<F>
where
    F: Future<Output = Result<Response<B>, E>>,
{
    type Output = Result<Response<B>, E>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = self.project();
        let answer = ready!(this.inner.poll(cx));
        if let (Some(entry), Ok(response)) = (this.entry.take(), &answer) {
            let refusal = response.extensions().get::<GatewayError>();
            entry.answered(response.status(), refusal.map(GatewayError::reason));
        }
        Poll::Ready(answer)
    }
}
