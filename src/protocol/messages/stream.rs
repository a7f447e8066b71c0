//! A messages event stream, as billing reads it, and the gateway's error event in it.

use bytes::Bytes;
use serde::Deserialize;

use crate::error::GatewayError;
use crate::protocol::TokenUsage;
use crate::protocol::sse::{
    DeltaHasContent, ErrorObject, Event, EventKind, StreamState, take_text,
};

/// Reads one event: usage in `message_start` and `message_delta`, content in a block that
/// opens or grows with something in it, `message_stop` the end, `error` a failure.
pub(super) fn read_event(event: &Event<'_>, state: &mut StreamState) -> EventKind {
    #[derive(Deserialize)]
    struct Data<'a> {
        #[serde(rename = "type")]
        kind: Option<&'a str>,
        message: Option<Message>,
        usage: Option<TokenUsage>,
        error: Option<ErrorObject>,
        content_block: Option<DeltaHasContent>,
        delta: Option<DeltaHasContent>,
    }
    #[derive(Deserialize)]
    struct Message {
        usage: Option<TokenUsage>,
    }
    let data: Option<Data<'_>> = serde_json::from_str(&event.data).ok();
    let name = event.name.or(data.as_ref().and_then(|data| data.kind));
    let Some(name) = name else {
        return EventKind::Other;
    };
    match name {
        "message_start" => {
            if let Some(usage) = data.and_then(|data| data.message?.usage) {
                state.merge(usage);
            }
            EventKind::Other
        }
        "message_delta" => {
            if let Some(usage) = data.and_then(|data| data.usage) {
                state.merge(usage);
            }
            EventKind::Other
        }
        // A block that opens empty (`"text": ""`) is not content yet; a tool call's opens
        // with its name.
        "content_block_start" | "content_block_delta" => {
            let block = data.and_then(|data| data.content_block.or(data.delta));
            if block.is_none_or(|block| block.0) {
                EventKind::Content
            } else {
                EventKind::Other
            }
        }
        "message_stop" => EventKind::End,
        "error" => EventKind::Error(
            data.and_then(|data| data.error)
                .map_or_else(|| event.data.to_string(), ErrorObject::describe),
        ),
        _ => EventKind::Other,
    }
}

/// The output a messages event carries: text, a tool call's name and input, thinking.
pub(super) fn content_text(event: &serde_json::Value, text: &mut String) {
    for block in [&event["delta"], &event["content_block"]] {
        for field in ["text", "partial_json", "thinking", "name"] {
            take_text(text, &block[field]);
        }
    }
}

/// Anthropic's `error` event, with the contract's text and the error's type.
pub(super) fn error_event(error: &GatewayError) -> Bytes {
    let event = format!(
        "event: error\ndata: {}\n\n",
        serde_json::json!({
            "type": "error",
            "error": { "type": error.anthropic_type(), "message": error.detail() },
        })
    );
    Bytes::from(event)
}
