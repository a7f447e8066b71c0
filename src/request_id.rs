//! [`RequestIdLayer`]: every request gets an id, and every answer carries it.
//!
//! The id is the client's own `x-request-id` when it is sane (1 to 128 visible ASCII
//! characters), else a new one (`req_` and 32 hexadecimal digits), which replaces the client's
//! header so that the provider is sent the same id. The layer adds the [`RequestId`] extension
//! (the call log keeps it), sets `x-request-id` on the answer and the same id as `request-id`
//! (what the Anthropic SDKs read into an error's `request_id`), and runs the request inside a
//! `request` tracing span with the id, so every log line of the request names it. A request
//! that already has a [`RequestId`] (an outer instance of this layer) keeps it.
//!
//! ```
//! use std::convert::Infallible;
//! use bytes::Bytes;
//! use http::{Request, Response};
//! use http_body_util::Full;
//! use model_gateway::{call::RequestId, request_id::RequestIdLayer};
//! use tower::{ServiceBuilder, ServiceExt, service_fn};
//!
//! # #[tokio::main(flavor = "current_thread")] async fn main() {
//! let service = ServiceBuilder::new()
//!     .layer(RequestIdLayer::new())
//!     .service(service_fn(|request: Request<Full<Bytes>>| async move {
//!         let id = request.extensions().get::<RequestId>().unwrap().to_string();
//!         Ok::<_, Infallible>(Response::new(Full::<Bytes>::from(id)))
//!     }));
//!
//! let sent = Request::get("/").header("x-request-id", "abc-123").body(Full::default()).unwrap();
//! let answer = service.clone().oneshot(sent).await.unwrap();
//! assert_eq!(answer.headers()["x-request-id"], "abc-123");
//! assert_eq!(answer.headers()["request-id"], "abc-123");
//!
//! let unsent = Request::get("/").body(Full::default()).unwrap();
//! let answer = service.oneshot(unsent).await.unwrap();
//! assert!(answer.headers()["x-request-id"].to_str().unwrap().starts_with("req_"));
//! # }
//! ```

use std::task::{Context, Poll};

use http::{HeaderName, Request, Response};
use tower_layer::Layer;
use tower_service::Service;
use tracing::Instrument;

use crate::call::RequestId;

/// The header that carries the id.
pub const REQUEST_ID_HEADER: HeaderName = HeaderName::from_static("x-request-id");

/// The same id under the name the Anthropic SDKs read (`request-id`), on every answer.
pub const ANTHROPIC_REQUEST_ID_HEADER: HeaderName = HeaderName::from_static("request-id");

/// Configuration of [`RequestIdService`] (none yet).
#[derive(Debug, Clone, Default)]
#[must_use]
pub struct RequestIdLayer {
    _private: (),
}

impl RequestIdLayer {
    /// The layer.
    pub fn new() -> RequestIdLayer {
        RequestIdLayer::default()
    }
}

impl<S> Layer<S> for RequestIdLayer {
    type Service = RequestIdService<S>;

    fn layer(&self, inner: S) -> RequestIdService<S> {
        RequestIdService { inner }
    }
}

/// Middleware that gives each request an id; see the module docs.
#[derive(Debug, Clone)]
pub struct RequestIdService<S> {
    inner: S,
}

crate::macros::response_future! {
    /// The future [`RequestIdService`] answers with.
    ResponseFuture
}

crate::macros::inner_service_accessors!(RequestIdService, S, inner);

impl<S> RequestIdService<S> {
    /// Gives every request to `inner` an id.
    pub fn new(inner: S) -> RequestIdService<S> {
        RequestIdService { inner }
    }
}

impl<S, ReqBody, ResBody> Service<Request<ReqBody>> for RequestIdService<S>
where
    S: Service<Request<ReqBody>, Response = Response<ResBody>> + Clone + Send + 'static,
    S::Future: Send,
    ReqBody: Send + 'static,
{
    type Response = Response<ResBody>;
    type Error = S::Error;
    type Future = ResponseFuture<Result<Response<ResBody>, S::Error>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), S::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, mut request: Request<ReqBody>) -> Self::Future {
        // An outer instance already gave the request its id, its span and its answer's header.
        if request.extensions().get::<RequestId>().is_some() {
            return ResponseFuture::new(self.inner.call(request));
        }
        let id = request
            .headers()
            .get(&REQUEST_ID_HEADER)
            .and_then(RequestId::from_client)
            .unwrap_or_else(RequestId::generate);
        request
            .headers_mut()
            .insert(REQUEST_ID_HEADER, id.header_value().clone());
        request.extensions_mut().insert(id.clone());
        let span = tracing::info_span!("request", request_id = %id);
        let future = span.in_scope(|| self.inner.call(request));
        ResponseFuture::new(
            async move {
                let mut response = future.await?;
                let headers = response.headers_mut();
                headers.insert(REQUEST_ID_HEADER, id.header_value().clone());
                headers.insert(ANTHROPIC_REQUEST_ID_HEADER, id.header_value().clone());
                Ok(response)
            }
            .instrument(span),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::HeaderValue;

    #[test]
    fn only_sane_client_ids_are_kept() {
        let id = |bytes: &[u8]| RequestId::from_client(&HeaderValue::from_bytes(bytes).unwrap());
        assert_eq!(id(b"abc-123_XYZ.~").unwrap().as_str(), "abc-123_XYZ.~");
        assert!(id(b"").is_none());
        assert!(id(b"has space").is_none());
        assert!(id("ünïcode".as_bytes()).is_none());
        assert!(id(&[b'a'; 129]).is_none());
        assert!(id(&[b'a'; 128]).is_some());
    }

    #[test]
    fn the_inner_service_can_be_reached_and_taken_back() {
        let mut service = RequestIdService::new(vec![1]);
        service.get_mut().push(2);
        assert_eq!(service.get_ref(), &[1, 2]);
        assert_eq!(service.into_inner(), vec![1, 2]);
    }

    #[test]
    fn new_ids_differ_and_look_alike() {
        let (one, two) = (RequestId::generate(), RequestId::generate());
        assert_ne!(one, two);
        assert!(
            one.as_str().starts_with("req_") && one.as_str().len() == 36,
            "{one}"
        );
        assert!(one.as_str()[4..].bytes().all(|b| b.is_ascii_hexdigit()));
    }
}
