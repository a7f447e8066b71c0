//! Upstreams: the services at the bottom of the stack that produce the reply.
//!
//! An upstream is a `Service<Request<Bytes>, Response = Response<Bytes>, Error = UpstreamError>`
//! that reads the [`RoutedCall`](crate::RoutedCall) extension. Two ship:
//! - [`MockUpstream`]: a fixed demonstration reply in each protocol's shape, no network
//!   (`MOCK_UPSTREAM=1` in the example gateway);
//! - [`HttpUpstream`]: the providers named in the catalogue, over reqwest.
//!
//! [`Upstream`] is either, chosen at start.

use std::task::{Context, Poll};

use bytes::Bytes;
use http::{Request, Response};
use tower_service::Service;

use crate::BoxFuture;
use crate::store::CallFailure;

mod breaker;
mod http_client;
pub(crate) mod mock;

pub use http_client::HttpUpstream;
pub use mock::MockUpstream;

/// How much of an upstream's error body is kept in the call log.
const ERROR_EXCERPT_CHARS: usize = 512;

/// An upstream call that failed. `message` is for the operator (the call log), never for the
/// client; `client_message` is what the client may learn when the provider rejected the request
/// itself.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{message}")]
pub struct UpstreamError {
    /// The upstream's HTTP status, when it answered.
    pub status: Option<u16>,
    /// What went wrong, for the operator.
    pub message: String,
    /// The provider's own explanation of why it refused the request (a 4xx other than 401, 403
    /// and 429), passed on to the client.
    pub client_message: Option<String>,
}

impl UpstreamError {
    /// The upstream could not be reached or did not answer in time.
    pub fn transport(message: impl Into<String>) -> UpstreamError {
        UpstreamError {
            status: None,
            message: message.into(),
            client_message: None,
        }
    }

    /// The upstream answered with a non-success status; keeps an excerpt of its body.
    pub fn status(status: u16, body: &[u8]) -> UpstreamError {
        UpstreamError {
            status: Some(status),
            message: format!("upstream answered {status}: {}", excerpt(body)),
            client_message: None,
        }
    }
}

/// The start of a body as text, for the call log.
pub(crate) fn excerpt(body: &[u8]) -> String {
    String::from_utf8_lossy(body)
        .chars()
        .take(ERROR_EXCERPT_CHARS)
        .collect()
}

/// The upstream (channel) that served a call. Response extension added by [`HttpUpstream`],
/// read by [`RefundOnUpstreamError`](crate::RefundOnUpstreamError) for the call log.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ServedBy(pub String);

impl From<UpstreamError> for CallFailure {
    fn from(error: UpstreamError) -> CallFailure {
        CallFailure {
            upstream_status: error.status,
            error: error.message,
        }
    }
}

/// The mock or the real providers, chosen at start.
#[derive(Debug, Clone)]
pub enum Upstream {
    /// Fixed demonstration replies.
    Mock(MockUpstream),
    /// Real providers over HTTP.
    Http(HttpUpstream),
}

impl Service<Request<Bytes>> for Upstream {
    type Response = Response<Bytes>;
    type Error = UpstreamError;
    type Future = BoxFuture<Result<Response<Bytes>, UpstreamError>>;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), UpstreamError>> {
        // Both variants are always ready: the mock has no resources, reqwest pools internally.
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, request: Request<Bytes>) -> Self::Future {
        match self {
            Upstream::Mock(mock) => Box::pin(mock.call(request)),
            Upstream::Http(http) => http.call(request),
        }
    }
}
