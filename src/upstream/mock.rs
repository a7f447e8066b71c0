//! The mock upstream: a fixed demonstration reply in the endpoint's own shape, complete or (for
//! `stream: true`) as the protocol's event stream: several text deltas and the final usage. For
//! embeddings, a deterministic unit vector per input (the same input, the same vector). Each
//! protocol writes its own (its dialect's mock reply); this is the service around them.

use std::future::{Ready, ready};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::task::{Context, Poll};

use bytes::Bytes;
use http::{HeaderValue, Request, Response, header};
use tower_service::Service;

use super::UpstreamError;
use crate::call::RoutedCall;
use crate::protocol::TokenUsage;
use crate::protocol::dialect::MockCall;
use crate::reply::UpstreamBody;

pub use crate::protocol::embeddings::MOCK_EMBEDDING_DIMENSIONS;
pub use crate::protocol::mock::MOCK_REPLY_TEXT;

/// Answers every call with [`MOCK_REPLY_TEXT`], touching no network.
#[derive(Debug, Clone, Default)]
pub struct MockUpstream {
    replies: Arc<AtomicU64>,
}

impl MockUpstream {
    /// A mock upstream.
    pub fn new() -> MockUpstream {
        MockUpstream::default()
    }

    /// What the dialect of `routed` is asked for its mock reply to `body`.
    fn asked<'a>(&self, routed: &'a RoutedCall, body: &'a [u8]) -> MockCall<'a> {
        MockCall {
            model: routed.model.name.as_str(),
            body,
            serial: self.replies.fetch_add(1, Ordering::Relaxed) + 1,
            input_tokens: crate::pricing::estimated_input_tokens(body.len()),
            gateway_asks_usage: routed.gateway_asks_usage,
            translation: None,
        }
    }

    /// The complete reply to `body`, with the usage it reports when the mock knows it without
    /// reading its own reply back (the billing layer reads the reply otherwise).
    fn reply(&self, routed: &RoutedCall, body: &[u8]) -> (Bytes, Option<TokenUsage>) {
        let translation = routed.translation();
        let mut call = self.asked(routed, body);
        call.translation = translation.as_deref();
        routed.protocol.dialect().mock_reply(&call)
    }
}

impl<B: AsRef<[u8]>> Service<Request<B>> for MockUpstream {
    type Response = Response<UpstreamBody>;
    type Error = UpstreamError;
    type Future = Ready<Result<Response<UpstreamBody>, UpstreamError>>;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), UpstreamError>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, request: Request<B>) -> Self::Future {
        let Some(routed) = request.extensions().get::<RoutedCall>() else {
            return ready(Err(UpstreamError::transport(
                "mock upstream called without a RoutedCall extension",
            )));
        };
        if routed.stream {
            let call = self.asked(routed, request.body().as_ref());
            let events = routed.protocol.dialect().mock_events(&call);
            let mut response = Response::new(UpstreamBody::event_chunks(events));
            response.headers_mut().insert(
                header::CONTENT_TYPE,
                HeaderValue::from_static("text/event-stream"),
            );
            return ready(Ok(response));
        }
        let (reply, usage) = self.reply(routed, request.body().as_ref());
        let mut response = Response::new(UpstreamBody::complete(reply));
        response.headers_mut().insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/json"),
        );
        if let Some(usage) = usage {
            response.extensions_mut().insert(usage);
        }
        ready(Ok(response))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::protocol::Protocol;

    /// The usage the mock hands the billing layer is what that layer would read from the
    /// reply itself, on every protocol.
    #[test]
    fn the_usage_given_with_a_reply_is_the_usage_the_reply_reports() {
        let catalogue = crate::Catalogue::demo();
        let cases = [
            (
                Protocol::ChatCompletions,
                r#"{"model":"gpt-4o-mini","messages":[{"role":"user","content":"Hello there"}]}"#,
            ),
            (
                Protocol::Messages,
                r#"{"model":"claude-sonnet-4-5","max_tokens":10,"messages":[{"role":"user","content":"Hi"}]}"#,
            ),
            (
                Protocol::Responses,
                r#"{"model":"gpt-4o-mini","input":"A somewhat longer question than the others"}"#,
            ),
        ];
        for (protocol, body) in cases {
            let routed = crate::router::route(&catalogue, protocol, body.as_bytes(), false)
                .expect("a demo model");
            let (reply, usage) = MockUpstream::new().reply(&routed, body.as_bytes());
            let read = crate::protocol::reply_usage(&reply).expect("a JSON object");
            assert_eq!(usage, Some(read), "{protocol:?}");
            assert!(read.input_tokens.is_some_and(|tokens| tokens > 0));
        }
    }
}
