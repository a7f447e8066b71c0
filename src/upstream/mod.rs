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

mod http_client;
pub(crate) mod mock;

pub use http_client::HttpUpstream;
pub use mock::MockUpstream;

/// How much of an upstream's error body is kept in the call log.
const ERROR_EXCERPT_CHARS: usize = 512;

/// An upstream call that failed; kept for the operator in the call log, never shown to clients.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{message}")]
pub struct UpstreamError {
    /// The upstream's HTTP status, when it answered.
    pub status: Option<u16>,
    /// What went wrong.
    pub message: String,
}

impl UpstreamError {
    /// The upstream could not be reached or did not answer in time.
    pub fn transport(message: impl Into<String>) -> UpstreamError {
        UpstreamError {
            status: None,
            message: message.into(),
        }
    }

    /// The upstream answered with a non-success status; keeps an excerpt of its body.
    pub fn status(status: u16, body: &[u8]) -> UpstreamError {
        let text = String::from_utf8_lossy(body);
        let excerpt: String = text.chars().take(ERROR_EXCERPT_CHARS).collect();
        UpstreamError {
            status: Some(status),
            message: format!("upstream answered {status}: {excerpt}"),
        }
    }
}

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
