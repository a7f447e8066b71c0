//! The mock's Gemini reply, complete or streamed (several text chunks, the last with its
//! `finishReason` and the whole `usageMetadata`).

use bytes::Bytes;
use serde_json::json;

use crate::protocol::TokenUsage;
use crate::protocol::dialect::MockCall;
use crate::protocol::mock::{
    MOCK_OUTPUT_TOKENS, MOCK_REPLY_TEXT, MOCK_STREAM_DELTAS, counted, text_pieces,
};

/// A `GenerateContentResponse` carrying `text`, finished (with the whole usage) or not.
fn response(call: &MockCall<'_>, text: &str, finished: bool) -> serde_json::Value {
    let mut candidate = json!({
        "content": { "parts": [{ "text": text }], "role": "model" },
        "index": 0,
    });
    let mut usage = json!({ "promptTokenCount": call.input_tokens });
    if finished {
        candidate["finishReason"] = json!("STOP");
        usage["candidatesTokenCount"] = json!(MOCK_OUTPUT_TOKENS);
        usage["totalTokenCount"] = json!(call.input_tokens + MOCK_OUTPUT_TOKENS);
    }
    json!({
        "candidates": [candidate],
        "usageMetadata": usage,
        "modelVersion": call.model,
        "responseId": format!("mock-{}", call.serial),
    })
}

/// The complete reply, with its usage.
pub(super) fn reply(call: &MockCall<'_>) -> (Bytes, Option<TokenUsage>) {
    let reply = response(call, MOCK_REPLY_TEXT, true);
    let bytes = serde_json::to_vec(&reply).expect("a mock reply serialises");
    (Bytes::from(bytes), Some(counted(call.input_tokens)))
}

/// The reply as Google's server-sent events: each a whole response with a piece of the text.
pub(super) fn events(call: &MockCall<'_>) -> Vec<Bytes> {
    let pieces = text_pieces(MOCK_REPLY_TEXT, MOCK_STREAM_DELTAS);
    let last = pieces.len().saturating_sub(1);
    pieces
        .into_iter()
        .enumerate()
        .map(|(index, piece)| {
            let chunk = response(call, piece, index == last);
            Bytes::from(format!("data: {chunk}\r\n\r\n"))
        })
        .collect()
}
