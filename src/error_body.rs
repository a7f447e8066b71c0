//! [`ErrorBodyLayer`]: refusals in the error object each client reads, when the operator says so.
//!
//! Every refusal is built by [`GatewayError::into_response`], which writes the specified
//! `{"detail": ...}` body and leaves the error on the response as an extension. With
//! [`ErrorBody::Compatible`], this layer gives such a response the body of
//! [`GatewayError::compatible_body`] in the shape of the request's protocol
//! ([`ErrorShape::of_request`]): `detail` stays, and the same text is added in the error object
//! that the `OpenAI` or Anthropic SDKs read. With [`ErrorBody::Detail`] (the default) it changes
//! nothing. Answers that are not the gateway's own refusals (a provider's reply) pass untouched.
//!
//! Put it outside every layer whose refusals it should reach; a second instance inside the
//! first (a [`stack`](crate::stack) mounted under a router that has this layer too) leaves the
//! work to the outer one. [`Gateway`](crate::Gateway)'s router mounts its stack on the call
//! endpoints without an outer instance, and puts one around its other endpoints.
//!
//! ```
//! use std::convert::Infallible;
//! use bytes::Bytes;
//! use http::{Request, Response};
//! use model_gateway::{GatewayError, error::ErrorBody, error_body::ErrorBodyLayer};
//! use tower::{ServiceBuilder, ServiceExt, service_fn};
//!
//! # #[tokio::main(flavor = "current_thread")] async fn main() {
//! let service = ServiceBuilder::new()
//!     .layer(ErrorBodyLayer::new(ErrorBody::Compatible))
//!     .service(service_fn(|_: Request<()>| async {
//!         Ok::<Response<Bytes>, Infallible>(GatewayError::InsufficientCredits.into_response())
//!     }));
//!
//! let chat = Request::post("/v1/chat/completions").body(()).unwrap();
//! let answer = service.clone().oneshot(chat).await.unwrap();
//! let body: serde_json::Value = serde_json::from_slice(answer.body()).unwrap();
//! assert_eq!(body["detail"], "积分不足");
//! assert_eq!(body["error"]["message"], "积分不足");
//!
//! let messages = Request::post("/v1/messages").body(()).unwrap();
//! let answer = service.oneshot(messages).await.unwrap();
//! let body: serde_json::Value = serde_json::from_slice(answer.body()).unwrap();
//! assert_eq!(body["type"], "error");
//! assert_eq!(body["error"]["type"], "billing_error");
//! # }
//! ```

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll, ready};

use bytes::Bytes;
use http::{Request, Response, header};
use pin_project_lite::pin_project;
use tower_layer::Layer;
use tower_service::Service;

use crate::error::{ErrorBody, ErrorShape, GatewayError};

/// Configuration of [`ErrorBodyService`]: which body refusals have.
#[derive(Debug, Clone, Copy, Default)]
#[must_use]
pub struct ErrorBodyLayer {
    body: ErrorBody,
}

impl ErrorBodyLayer {
    /// Refusals with `body`.
    pub fn new(body: ErrorBody) -> ErrorBodyLayer {
        ErrorBodyLayer { body }
    }
}

impl<S> Layer<S> for ErrorBodyLayer {
    type Service = ErrorBodyService<S>;

    fn layer(&self, inner: S) -> ErrorBodyService<S> {
        ErrorBodyService {
            inner,
            body: self.body,
        }
    }
}

/// Middleware that writes refusals' bodies as configured; see the module docs.
#[derive(Debug, Clone)]
pub struct ErrorBodyService<S> {
    inner: S,
    body: ErrorBody,
}

crate::macros::inner_service_accessors!(ErrorBodyService, S, inner);

impl<S> ErrorBodyService<S> {
    /// Refusals of `inner` with `body`.
    pub fn new(inner: S, body: ErrorBody) -> ErrorBodyService<S> {
        ErrorBodyService { inner, body }
    }
}

/// On a request: an outer [`ErrorBodyService`] writing compatible bodies has it in hand.
#[derive(Debug, Clone, Copy)]
struct Handled;

impl<S, ReqBody, ResBody> Service<Request<ReqBody>> for ErrorBodyService<S>
where
    S: Service<Request<ReqBody>, Response = Response<ResBody>>,
    ResBody: From<Bytes>,
{
    type Response = Response<ResBody>;
    type Error = S::Error;
    type Future = ResponseFuture<S::Future>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), S::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, mut request: Request<ReqBody>) -> Self::Future {
        let shape = match self.body {
            ErrorBody::Compatible if request.extensions_mut().insert(Handled).is_none() => {
                ErrorShape::of_request(request.uri().path(), request.headers())
            }
            _ => None,
        };
        ResponseFuture {
            inner: self.inner.call(request),
            shape,
        }
    }
}

pin_project! {
    /// The future [`ErrorBodyService`] answers with.
    pub struct ResponseFuture<F> {
        #[pin]
        inner: F,
        // The shape to rewrite refusals in; `None`: leave them as they are.
        shape: Option<ErrorShape>,
    }
}

impl<F> std::fmt::Debug for ResponseFuture<F> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ResponseFuture")
            .field("shape", &self.shape)
            .finish_non_exhaustive()
    }
}

impl<F, B, E> Future for ResponseFuture<F>
where
    F: Future<Output = Result<Response<B>, E>>,
    B: From<Bytes>,
{
    type Output = Result<Response<B>, E>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = self.project();
        let response = ready!(this.inner.poll(cx))?;
        let Some(shape) = *this.shape else {
            return Poll::Ready(Ok(response));
        };
        let Some(refusal) = response.extensions().get::<GatewayError>() else {
            return Poll::Ready(Ok(response));
        };
        let body = refusal.compatible_body(shape);
        let (mut parts, _) = response.into_parts();
        parts.headers.remove(header::CONTENT_LENGTH);
        Poll::Ready(Ok(Response::from_parts(parts, B::from(body))))
    }
}
