//! The mock's message, complete or streamed.

use bytes::Bytes;
use serde_json::json;

use crate::protocol::TokenUsage;
use crate::protocol::dialect::MockCall;
use crate::protocol::mock::{
    MOCK_OUTPUT_TOKENS, MOCK_REPLY_TEXT, MOCK_STREAM_DELTAS, counted, text_pieces,
};

/// Anthropic's message, as the mock answers it.
#[derive(serde::Serialize)]
struct MessagesReply<'a> {
    id: String,
    #[serde(rename = "type")]
    kind: &'static str,
    role: &'static str,
    model: &'a str,
    content: [TextBlock; 1],
    stop_reason: &'static str,
    stop_sequence: Option<()>,
    usage: MessagesUsage,
}

#[derive(serde::Serialize)]
struct TextBlock {
    #[serde(rename = "type")]
    kind: &'static str,
    text: &'static str,
}

#[derive(serde::Serialize)]
struct MessagesUsage {
    input_tokens: u64,
    output_tokens: u64,
}

/// The complete reply, with its usage.
pub(super) fn reply(call: &MockCall<'_>) -> (Bytes, Option<TokenUsage>) {
    let reply = MessagesReply {
        id: format!("msg_mock_{}", call.serial),
        kind: "message",
        role: "assistant",
        model: call.model,
        content: [TextBlock {
            kind: "text",
            text: MOCK_REPLY_TEXT,
        }],
        stop_reason: "end_turn",
        stop_sequence: None,
        usage: MessagesUsage {
            input_tokens: call.input_tokens,
            output_tokens: MOCK_OUTPUT_TOKENS,
        },
    };
    let bytes = serde_json::to_vec(&reply).expect("a mock reply serialises");
    (Bytes::from(bytes), Some(counted(call.input_tokens)))
}

/// The reply as Anthropic's event stream.
pub(super) fn events(call: &MockCall<'_>) -> Vec<Bytes> {
    let mut events = Vec::new();
    let mut event = |name: &str, data: serde_json::Value| {
        events.push(Bytes::from(format!("event: {name}\ndata: {data}\n\n")));
    };
    event(
        "message_start",
        json!({
            "type": "message_start",
            "message": {
                "id": format!("msg_mock_{}", call.serial), "type": "message", "role": "assistant",
                "model": call.model, "content": [], "stop_reason": null, "stop_sequence": null,
                "usage": { "input_tokens": call.input_tokens, "output_tokens": 1 }
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
    for piece in text_pieces(MOCK_REPLY_TEXT, MOCK_STREAM_DELTAS) {
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
    events
}
