//! Upstreams: the services at the bottom of the stack that produce the reply.
//!
//! An upstream is a `Service<Request<Bytes>, Response = Response<Bytes>, Error = UpstreamError>`
//! that reads the [`RoutedCall`] extension. Two ship:
//! - [`MockUpstream`]: a fixed demonstration reply in each protocol's shape, no network
//!   (`MOCK_UPSTREAM=1` in the example gateway);
//! - [`HttpUpstream`]: the providers named in the catalogue, over reqwest.
//!
//! [`Upstream`] is either, chosen at start.

use std::sync::Arc;
use std::task::{Context, Poll};

use bytes::Bytes;
use http::{HeaderMap, Request, Response};
use tower_service::Service;

use crate::call::RoutedCall;
use crate::store::ResponseOwners;

mod beside;
mod breaker;
mod channel;
mod channels;
mod failover;
mod hosted;
mod http_client;
pub(crate) mod mock;
mod translated;
mod transport;

pub use crate::call::ServedBy;
pub use crate::error::UpstreamError;
pub use crate::protocol::reply_usage;
pub use crate::reply::UpstreamBody;
pub use http_client::HttpUpstream;
pub use mock::{MOCK_EMBEDDING_DIMENSIONS, MOCK_REPLY_TEXT, MockUpstream};

crate::macros::response_future! {
    /// The future [`Upstream`] and [`HttpUpstream`] answer with.
    ResponseFuture
}

/// The mock or the real providers, chosen at start.
#[derive(Debug, Clone)]
pub enum Upstream {
    /// Fixed demonstration replies.
    Mock(MockUpstream),
    /// Real providers over HTTP.
    Http(HttpUpstream),
}

impl Upstream {
    /// Calls the upstreams `catalogue` names from now on (see [`HttpUpstream::reload`]); the
    /// mock has none.
    pub fn reload(&self, catalogue: &crate::catalogue::Catalogue) -> Result<(), reqwest::Error> {
        match self {
            Upstream::Mock(_) => Ok(()),
            Upstream::Http(http) => http.reload(catalogue),
        }
    }

    /// Counts the tokens of a messages or Gemini request, as `POST /v1/messages/count_tokens`
    /// and `:countTokens` do: at
    /// the provider, or, for the mock, a plausible estimate (a token per four bytes of the
    /// body). Free: it is not a call.
    pub async fn count_tokens(
        &self,
        routed: &RoutedCall,
        client_headers: &HeaderMap,
        body: &Bytes,
    ) -> Result<Response<Bytes>, UpstreamError> {
        match self {
            Upstream::Mock(_) => {
                let estimate = (body.len() / 4).max(1) as u64;
                let answer = routed.protocol.dialect().count_reply(estimate);
                let mut response = Response::new(Bytes::from(answer.to_string()));
                response.headers_mut().insert(
                    http::header::CONTENT_TYPE,
                    http::HeaderValue::from_static("application/json"),
                );
                Ok(response)
            }
            Upstream::Http(http) => http.count_tokens(routed, client_headers, body).await,
        }
    }

    /// The same upstream recording who made each response a native Responses upstream keeps
    /// (see [`HttpUpstream::remembering_responses`]); the mock keeps none.
    #[must_use]
    pub fn remembering_responses(self, owners: Arc<dyn ResponseOwners>) -> Upstream {
        match self {
            Upstream::Http(http) => Upstream::Http(http.remembering_responses(owners)),
            mock => mock,
        }
    }

    /// Records the breakers' turns in `events` (see [`HttpUpstream::reporting_breakers`]); the
    /// mock has none.
    #[must_use]
    pub fn reporting_breakers(self, events: Arc<dyn crate::store::EventOutbox>) -> Upstream {
        match self {
            Upstream::Http(http) => Upstream::Http(http.reporting_breakers(events)),
            mock => mock,
        }
    }

    /// Passes a request about a stored response to the upstream that keeps it (see
    /// [`HttpUpstream::stored_response`]); the mock keeps none, and answers `None`.
    pub async fn stored_response(
        &self,
        upstream: &str,
        method: http::Method,
        path_and_query: &str,
        client_headers: &HeaderMap,
    ) -> Option<Result<Response<Bytes>, UpstreamError>> {
        match self {
            Upstream::Mock(_) => None,
            Upstream::Http(http) => Some(
                http.stored_response(upstream, method, path_and_query, client_headers)
                    .await,
            ),
        }
    }
}

impl Service<Request<Bytes>> for Upstream {
    type Response = Response<UpstreamBody>;
    type Error = UpstreamError;
    type Future = ResponseFuture<Result<Response<UpstreamBody>, UpstreamError>>;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), UpstreamError>> {
        // Both variants are always ready: the mock has no resources, reqwest pools internally.
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, request: Request<Bytes>) -> Self::Future {
        match self {
            Upstream::Mock(mock) => ResponseFuture::new(mock.call(request)),
            Upstream::Http(http) => http.call(request),
        }
    }
}
