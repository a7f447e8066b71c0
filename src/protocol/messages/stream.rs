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
        /// Bedrock's own count, on its `message_stop`.
        #[serde(rename = "amazon-bedrock-invocationMetrics")]
        bedrock_metrics: Option<InvocationMetrics>,
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
        "message_stop" => {
            if let Some(metrics) = data.and_then(|data| data.bedrock_metrics) {
                metrics.keep(state);
            }
            EventKind::End
        }
        "error" => EventKind::Error(
            data.and_then(|data| data.error)
                .map_or_else(|| event.data.to_string(), ErrorObject::describe),
        ),
        _ => EventKind::Other,
    }
}

/// Bedrock's count of a call's tokens (`amazon-bedrock-invocationMetrics`), on the last event
/// of a stream it hosts: what Bedrock bills.
#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct InvocationMetrics {
    input_token_count: Option<serde_json::Value>,
    output_token_count: Option<serde_json::Value>,
    cache_read_input_token_count: Option<serde_json::Value>,
    cache_write_input_token_count: Option<serde_json::Value>,
}

impl InvocationMetrics {
    /// Kept in `state`: its input and output counts are Bedrock's bill and replace the
    /// events'; its cache counts only fill in what the events did not report (they split
    /// cache writes by duration, these do not).
    fn keep(self, state: &mut StreamState) {
        let reported = state.usage;
        let had_writes =
            reported.cache_write_tokens.is_some() || reported.cache_write_1h_tokens.is_some();
        let mut usage = serde_json::Map::new();
        let mut put = |name: &str, count: Option<serde_json::Value>| {
            if let Some(count) = count {
                usage.insert(name.to_owned(), count);
            }
        };
        put("input_tokens", self.input_token_count);
        put("output_tokens", self.output_token_count);
        if reported.cache_read_tokens.is_none() {
            put("cache_read_input_tokens", self.cache_read_input_token_count);
        }
        if !had_writes {
            put(
                "cache_creation_input_tokens",
                self.cache_write_input_token_count,
            );
        }
        // Read as any usage object is, so that a count that is no count is judged the same.
        if let Ok(usage) = serde_json::from_value::<TokenUsage>(serde_json::Value::Object(usage)) {
            state.merge(usage);
        }
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

#[cfg(test)]
mod tests {
    use super::*;

    fn read(state: &mut StreamState, name: &'static str, data: &str) -> EventKind {
        read_event(
            &Event {
                name: Some(name),
                data: data.into(),
            },
            state,
        )
    }

    #[test]
    fn bedrocks_metrics_are_its_bill_of_input_and_output_and_fill_in_the_cache() {
        let mut state = StreamState::default();
        let start = r#"{"type":"message_start","message":{"usage":{"input_tokens":10,"output_tokens":1,"cache_creation":{"ephemeral_5m_input_tokens":0,"ephemeral_1h_input_tokens":4},"cache_creation_input_tokens":4}}}"#;
        read(&mut state, "message_start", start);
        read(
            &mut state,
            "message_delta",
            r#"{"type":"message_delta","usage":{"output_tokens":6}}"#,
        );
        let stop = r#"{"type":"message_stop","amazon-bedrock-invocationMetrics":{"inputTokenCount":11,"outputTokenCount":7,"cacheReadInputTokenCount":3,"cacheWriteInputTokenCount":4,"invocationLatency":5}}"#;
        assert!(matches!(
            read(&mut state, "message_stop", stop),
            EventKind::End
        ));
        let usage = state.usage;
        assert_eq!(
            (usage.input_tokens, usage.output_tokens),
            (Some(11), Some(7))
        );
        assert_eq!(usage.cache_read_tokens, Some(3), "filled in");
        // The events split the writes by duration: kept, not counted again at 5 minutes.
        assert_eq!(
            (usage.cache_write_tokens, usage.cache_write_1h_tokens),
            (Some(0), Some(4))
        );
        assert!(!usage.malformed);
    }

    #[test]
    fn a_metric_that_is_no_count_makes_the_report_untrusted() {
        let mut state = StreamState::default();
        let stop = r#"{"type":"message_stop","amazon-bedrock-invocationMetrics":{"inputTokenCount":-1,"outputTokenCount":"7"}}"#;
        read(&mut state, "message_stop", stop);
        assert!(state.usage.malformed);
    }
}
