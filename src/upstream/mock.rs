//! The mock upstream: a fixed demonstration reply in the endpoint's own shape, complete or (for
//! `stream: true`) as the protocol's event stream: several text deltas and the final usage.

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
use crate::reply::UpstreamBody;

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

/// How many pieces the mock's streamed text comes in.
const MOCK_STREAM_DELTAS: usize = 4;

impl MockUpstream {
    /// The demonstration reply as `routed.protocol`'s event stream, one chunk per event.
    fn events(&self, routed: &RoutedCall, include_usage: bool) -> Vec<Bytes> {
        let serial = self.replies.fetch_add(1, Ordering::Relaxed) + 1;
        let model = routed.model.name.as_str();
        let pieces = text_pieces(MOCK_REPLY_TEXT, MOCK_STREAM_DELTAS);
        let mut events = Vec::new();
        match routed.protocol {
            Protocol::Messages => {
                let mut event = |name: &str, data: serde_json::Value| {
                    events.push(Bytes::from(format!("event: {name}\ndata: {data}\n\n")));
                };
                event(
                    "message_start",
                    json!({
                        "type": "message_start",
                        "message": {
                            "id": format!("msg_mock_{serial}"), "type": "message", "role": "assistant",
                            "model": model, "content": [], "stop_reason": null, "stop_sequence": null,
                            "usage": { "input_tokens": MOCK_INPUT_TOKENS, "output_tokens": 1 }
                        }
                    }),
                );
                event(
                    "content_block_start",
                    json!({
                        "type": "content_block_start", "index": 0,
                        "content_block": { "type": "text", "text": "" }
                    }),
                );
                event("ping", json!({ "type": "ping" }));
                for piece in pieces {
                    event(
                        "content_block_delta",
                        json!({
                            "type": "content_block_delta", "index": 0,
                            "delta": { "type": "text_delta", "text": piece }
                        }),
                    );
                }
                event(
                    "content_block_stop",
                    json!({ "type": "content_block_stop", "index": 0 }),
                );
                event(
                    "message_delta",
                    json!({
                        "type": "message_delta",
                        "delta": { "stop_reason": "end_turn", "stop_sequence": null },
                        "usage": { "output_tokens": MOCK_OUTPUT_TOKENS }
                    }),
                );
                event("message_stop", json!({ "type": "message_stop" }));
            }
            Protocol::ChatCompletions => {
                let created = chrono::Utc::now().timestamp();
                let mut chunk = |choices: serde_json::Value, usage: serde_json::Value| {
                    let data = json!({
                        "id": format!("chatcmpl-mock-{serial}"), "object": "chat.completion.chunk",
                        "created": created, "model": model, "choices": choices, "usage": usage
                    });
                    events.push(Bytes::from(format!("data: {data}\n\n")));
                };
                let delta = |delta: serde_json::Value, finish: serde_json::Value| json!([{ "index": 0, "delta": delta, "logprobs": null, "finish_reason": finish }]);
                chunk(
                    delta(json!({ "role": "assistant", "content": "" }), json!(null)),
                    json!(null),
                );
                for piece in pieces {
                    chunk(delta(json!({ "content": piece }), json!(null)), json!(null));
                }
                chunk(delta(json!({}), json!("stop")), json!(null));
                if include_usage {
                    chunk(
                        json!([]),
                        json!({
                            "prompt_tokens": MOCK_INPUT_TOKENS,
                            "completion_tokens": MOCK_OUTPUT_TOKENS,
                            "total_tokens": MOCK_INPUT_TOKENS + MOCK_OUTPUT_TOKENS
                        }),
                    );
                }
                events.push(Bytes::from_static(b"data: [DONE]\n\n"));
            }
        }
        events
    }
}

/// `text` cut into `count` pieces at character boundaries.
fn text_pieces(text: &str, count: usize) -> Vec<&str> {
    let size = text.len().div_ceil(count);
    let mut pieces = Vec::with_capacity(count);
    let mut rest = text;
    while !rest.is_empty() {
        let mut cut = size.min(rest.len());
        while !rest.is_char_boundary(cut) {
            cut += 1;
        }
        let (piece, tail) = rest.split_at(cut);
        pieces.push(piece);
        rest = tail;
    }
    pieces
}

/// Whether an `OpenAI` request asks for the usage chunk (`stream_options.include_usage`).
fn wants_usage_chunk(body: &[u8]) -> bool {
    #[derive(serde::Deserialize)]
    struct Request {
        stream_options: Option<StreamOptions>,
    }
    #[derive(serde::Deserialize)]
    struct StreamOptions {
        include_usage: Option<bool>,
    }
    serde_json::from_slice::<Request>(body)
        .ok()
        .and_then(|request| request.stream_options?.include_usage)
        .unwrap_or(false)
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
            let include_usage = wants_usage_chunk(request.body().as_ref());
            let events = self.events(routed, include_usage);
            let mut response = Response::new(UpstreamBody::event_chunks(events));
            response.headers_mut().insert(
                header::CONTENT_TYPE,
                HeaderValue::from_static("text/event-stream"),
            );
            return ready(Ok(response));
        }
        let mut response = Response::new(UpstreamBody::complete(Bytes::from(
            self.reply(routed).to_string(),
        )));
        response.headers_mut().insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/json"),
        );
        ready(Ok(response))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn text_pieces_put_together_are_the_text() {
        for text in [MOCK_REPLY_TEXT, "你好, 世界! 🌍", "a"] {
            let pieces = text_pieces(text, MOCK_STREAM_DELTAS);
            assert!(pieces.len() <= MOCK_STREAM_DELTAS, "{pieces:?}");
            assert_eq!(pieces.concat(), text);
        }
        assert!(text_pieces(MOCK_REPLY_TEXT, MOCK_STREAM_DELTAS).len() > 1);
    }
}
