//! The mock upstream: a fixed demonstration reply in the endpoint's own shape.

use std::future::{Ready, ready};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::task::{Context, Poll};

use bytes::Bytes;
use http::{HeaderValue, Request, Response, header};
use serde_json::json;
use tower_service::Service;

use super::UpstreamError;
use crate::call::RoutedCall;
use crate::protocol::Protocol;

/// The text of every mock reply.
pub const MOCK_REPLY_TEXT: &str =
    "This is a demo reply from model-gateway's mock upstream; no model was called.";

const MOCK_INPUT_TOKENS: u64 = 12;
const MOCK_OUTPUT_TOKENS: u64 = 16;

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

    fn reply(&self, routed: &RoutedCall) -> serde_json::Value {
        let serial = self.replies.fetch_add(1, Ordering::Relaxed) + 1;
        let model = routed.model.name.as_str();
        match routed.protocol {
            Protocol::ChatCompletions => json!({
                "id": format!("chatcmpl-mock-{serial}"),
                "object": "chat.completion",
                "created": chrono::Utc::now().timestamp(),
                "model": model,
                "choices": [{
                    "index": 0,
                    "message": { "role": "assistant", "content": MOCK_REPLY_TEXT, "refusal": null },
                    "logprobs": null,
                    "finish_reason": "stop"
                }],
                "usage": {
                    "prompt_tokens": MOCK_INPUT_TOKENS,
                    "completion_tokens": MOCK_OUTPUT_TOKENS,
                    "total_tokens": MOCK_INPUT_TOKENS + MOCK_OUTPUT_TOKENS
                }
            }),
            Protocol::Messages => json!({
                "id": format!("msg_mock_{serial}"),
                "type": "message",
                "role": "assistant",
                "model": model,
                "content": [{ "type": "text", "text": MOCK_REPLY_TEXT }],
                "stop_reason": "end_turn",
                "stop_sequence": null,
                "usage": { "input_tokens": MOCK_INPUT_TOKENS, "output_tokens": MOCK_OUTPUT_TOKENS }
            }),
        }
    }
}

impl<B> Service<Request<B>> for MockUpstream {
    type Response = Response<Bytes>;
    type Error = UpstreamError;
    type Future = Ready<Result<Response<Bytes>, UpstreamError>>;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), UpstreamError>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, request: Request<B>) -> Self::Future {
        let Some(routed) = request.extensions().get::<RoutedCall>() else {
            return ready(Err(UpstreamError::transport(
                "mock upstream called without a RoutedCall extension",
            )));
        };
        let mut response = Response::new(Bytes::from(self.reply(routed).to_string()));
        response.headers_mut().insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/json"),
        );
        ready(Ok(response))
    }
}
