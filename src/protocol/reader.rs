//! A protocol's event stream read for billing, event by event, through its dialect: the usage
//! reported so far, and, for a call priced by tokens, the output passed on, counted.

use bytes::Bytes;

use super::dialect::Dialect;
use super::sse::{Event, EventKind, StreamState, event_text};
use super::{Protocol, TokenUsage};
use crate::error::GatewayError;

/// Reads a protocol's events in order and keeps what billing needs: the usage reported so far,
/// and, for a call priced by tokens, the output it passed on, counted.
#[derive(Clone)]
pub(crate) struct StreamReader {
    dialect: &'static dyn Dialect,
    state: StreamState,
    /// Output tokens in the content read so far, when counted (see [`counting_output`]).
    ///
    /// [`counting_output`]: Self::counting_output
    counted_output: Option<u64>,
    /// The stream's normal end was read.
    ended: bool,
    /// Each usage object the provider sent, as it wrote it, in order (the last alone where
    /// each holds every count so far).
    raw_usage: Vec<String>,
    /// How many usage objects were read.
    raw_usage_seen: usize,
}

impl std::fmt::Debug for StreamReader {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StreamReader")
            .field("protocol", &self.dialect.protocol())
            .field("state", &self.state)
            .field("counted_output", &self.counted_output)
            .field("ended", &self.ended)
            .finish()
    }
}

impl StreamReader {
    /// A reader for `protocol`'s events.
    pub(crate) fn new(protocol: Protocol) -> StreamReader {
        StreamReader {
            dialect: protocol.dialect(),
            state: StreamState::default(),
            counted_output: None,
            ended: false,
            raw_usage: Vec::new(),
            raw_usage_seen: 0,
        }
    }

    /// Counts the output of the content events read (see [`usage`](Self::usage)).
    pub(crate) fn counting_output(mut self) -> StreamReader {
        self.counted_output = Some(0);
        self
    }

    /// Reads one complete event.
    pub(crate) fn read(&mut self, event: &[u8]) -> EventKind {
        let text = event_text(event);
        let event = Event::parse(&text);
        self.state.usage_only = false;
        let before = self.state.usage;
        let kind = self.dialect.read_event(&event, &mut self.state);
        if self.state.usage != before
            && let Some(raw) = super::usage_object_in(&event.data, self.dialect.usage_key())
        {
            if self.dialect.usage_is_cumulative() {
                self.raw_usage.clear();
            }
            self.raw_usage.push(raw.to_owned());
            self.raw_usage_seen += 1;
        }
        match kind {
            EventKind::End => self.ended = true,
            EventKind::Content => {
                if let Some(counted) = &mut self.counted_output {
                    let text = content_text(self.dialect, &event.data);
                    *counted += super::tokens::counted_text_tokens(&text);
                }
            }
            EventKind::Error(_) | EventKind::Other => {}
        }
        kind
    }

    /// Whether the last event read was a chat chunk carrying only usage, as a provider sends
    /// when asked for it (`stream_options.include_usage`).
    pub(crate) fn usage_only(&self) -> bool {
        self.state.usage_only
    }

    /// The usage the stream has reported so far, as the provider reported it. What is charged
    /// when the output was not reported is the store's rule (`store::rules::usage`), from this,
    /// [`counted_output`](Self::counted_output) and [`ended`](Self::ended).
    pub(crate) fn reported(&self) -> TokenUsage {
        self.state.usage
    }

    /// How many usage objects the provider has sent (a number that changes when
    /// [`raw_usage`](Self::raw_usage) does).
    pub(crate) fn raw_usage_count(&self) -> usize {
        self.raw_usage_seen
    }

    /// The usage the provider reported, as it wrote it: its one usage object, or each of them
    /// in order as a JSON array (Anthropic reports in `message_start` and `message_delta`).
    pub(crate) fn raw_usage(&self) -> Option<String> {
        match self.raw_usage.as_slice() {
            [] => None,
            [one] => Some(one.clone()),
            many => Some(format!("[{}]", many.join(","))),
        }
    }

    /// Output tokens in the content read so far, when counted (see
    /// [`counting_output`](Self::counting_output)).
    pub(crate) fn counted_output(&self) -> Option<u64> {
        self.counted_output
    }

    /// Whether the stream's normal end was read.
    pub(crate) fn ended(&self) -> bool {
        self.ended
    }

    /// The provider closed the stream: whether that is its normal end (see
    /// [`Dialect::ends_when_closed`]), which is then taken as read.
    pub(crate) fn closed(&mut self) -> bool {
        if self.dialect.ends_when_closed(&self.state) {
            self.ended = true;
        }
        self.ended
    }

    /// The gateway's last event when the provider failed after the stream started: see
    /// [`Dialect::error_event`]. A stream's events have no `{"detail"}` form, so this is the
    /// same whichever [`ErrorBody`](crate::error::ErrorBody) the operator chose.
    pub(crate) fn error_event(&self, error: &GatewayError) -> Bytes {
        self.dialect.error_event(error, self.state.next_sequence)
    }
}

/// The text a content event carries: what a client reads as output (text, reasoning, a
/// refusal, a tool call's name and arguments or a custom tool's input), joined, for counting
/// its tokens.
fn content_text(dialect: &dyn Dialect, data: &str) -> String {
    let Ok(event) = serde_json::from_str::<serde_json::Value>(data) else {
        return String::new();
    };
    let mut text = String::new();
    dialect.content_text(&event, &mut text);
    text
}

/// The gateway's last event for `protocol`: see [`Dialect::error_event`].
#[cfg(test)]
pub(crate) fn error_event(protocol: Protocol, error: &GatewayError, next_sequence: u64) -> Bytes {
    protocol.dialect().error_event(error, next_sequence)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_providers_usage_objects_are_kept_as_written_wherever_its_protocol_puts_them() {
        let mut messages = StreamReader::new(Protocol::Messages);
        messages.read(b"event: message_start\ndata: {\"type\":\"message_start\",\"message\":{\"id\":\"m\",\"usage\":{\"input_tokens\":25,  \"output_tokens\":1}}}\n\n");
        messages.read(b"event: ping\ndata: {\"type\":\"ping\"}\n\n");
        messages.read(b"event: message_delta\ndata: {\"type\":\"message_delta\",\"delta\":{},\"usage\":{\"output_tokens\":15}}\n\n");
        assert_eq!(
            messages.raw_usage().as_deref(),
            Some(r#"[{"input_tokens":25,  "output_tokens":1},{"output_tokens":15}]"#)
        );
        let mut chat = StreamReader::new(Protocol::ChatCompletions);
        chat.read(b"data: {\"choices\":[{\"index\":0,\"delta\":{\"content\":\"Hi\"}}]}\n\n");
        assert_eq!(chat.raw_usage(), None);
        chat.read(
            b"data: {\"choices\":[],\"usage\":{\"prompt_tokens\":9,\"completion_tokens\":3}}\n\n",
        );
        assert_eq!(
            chat.raw_usage().as_deref(),
            Some(r#"{"prompt_tokens":9,"completion_tokens":3}"#)
        );
        let mut responses = StreamReader::new(Protocol::Responses);
        responses.read(b"event: response.completed\ndata: {\"type\":\"response.completed\",\"sequence_number\":5,\"response\":{\"usage\":{\"input_tokens\":7,\"output_tokens\":2}}}\n\n");
        assert_eq!(
            responses.raw_usage().as_deref(),
            Some(r#"{"input_tokens":7,"output_tokens":2}"#)
        );
        let mut gemini = StreamReader::new(Protocol::Gemini);
        gemini.read(b"data: {\"candidates\":[{\"content\":{\"parts\":[{\"text\":\"H\"}]},\"index\":0}],\"usageMetadata\":{\"promptTokenCount\":5}}\r\n\r\n");
        gemini.read(b"data: {\"candidates\":[{\"content\":{\"parts\":[{\"text\":\"Hi\"}]},\"index\":0,\"finishReason\":\"STOP\"}],\"usageMetadata\":{\"promptTokenCount\":5,\"candidatesTokenCount\":1}}\r\n\r\n");
        assert_eq!(
            gemini.raw_usage().as_deref(),
            Some(r#"{"promptTokenCount":5,"candidatesTokenCount":1}"#)
        );
    }

    #[test]
    fn chat_choices_without_content_are_not_content() {
        let mut reader = StreamReader::new(Protocol::ChatCompletions);
        for chunk in [
            &b"data: {\"choices\":[{\"index\":0,\"delta\":{\"role\":\"assistant\",\"content\":null,\"tool_calls\":[]}}]}\n\n"[..],
            b"data: {\"choices\":[{\"index\":0,\"delta\":null,\"finish_reason\":\"stop\"}]}\n\n",
            b"data: {\"choices\":[{\"index\":0,\"delta\":{}},{\"index\":1}]}\n\n",
        ] {
            assert_eq!(reader.read(chunk), EventKind::Other, "{chunk:?}");
        }
        let second_choice = b"data: {\"choices\":[{\"index\":0,\"delta\":{}},{\"index\":1,\"delta\":{\"content\":\"x\"}}]}\n\n";
        assert_eq!(reader.read(second_choice), EventKind::Content);
    }

    #[test]
    fn messages_events_report_usage_content_and_the_end() {
        let mut reader = StreamReader::new(Protocol::Messages);
        let start = b"event: message_start\ndata: {\"type\":\"message_start\",\"message\":{\"usage\":{\"input_tokens\":25,\"output_tokens\":1}}}\n\n";
        assert_eq!(reader.read(start), EventKind::Other);
        assert_eq!(
            reader.read(b"event: ping\ndata: {\"type\": \"ping\"}\n\n"),
            EventKind::Other
        );
        let delta = b"event: content_block_delta\ndata: {\"type\":\"content_block_delta\",\"index\":0,\"delta\":{\"type\":\"text_delta\",\"text\":\"Hi\"}}\n\n";
        assert_eq!(reader.read(delta), EventKind::Content);
        let end = b"event: message_delta\ndata: {\"type\":\"message_delta\",\"delta\":{\"stop_reason\":\"end_turn\"},\"usage\":{\"output_tokens\":15}}\n\n";
        assert_eq!(reader.read(end), EventKind::Other);
        assert_eq!(
            reader.read(b"event: message_stop\ndata: {\"type\":\"message_stop\"}\n\n"),
            EventKind::End
        );
        assert_eq!(
            reader.reported(),
            TokenUsage {
                input_tokens: Some(25),
                output_tokens: Some(15),
                ..Default::default()
            }
        );
    }

    #[test]
    fn a_messages_block_that_opens_empty_is_not_content_and_a_tool_call_is() {
        let mut reader = StreamReader::new(Protocol::Messages);
        for empty in [
            &b"event: content_block_start\ndata: {\"type\":\"content_block_start\",\"index\":0,\"content_block\":{\"type\":\"text\",\"text\":\"\"}}\n\n"[..],
            b"event: content_block_start\ndata: {\"type\":\"content_block_start\",\"index\":0,\"content_block\":{\"type\":\"thinking\",\"thinking\":\"\",\"signature\":\"\"}}\n\n",
            b"event: content_block_delta\ndata: {\"type\":\"content_block_delta\",\"index\":0,\"delta\":{\"type\":\"text_delta\",\"text\":\"\"}}\n\n",
        ] {
            assert_eq!(reader.read(empty), EventKind::Other, "{empty:?}");
        }
        let tool = b"event: content_block_start\ndata: {\"type\":\"content_block_start\",\"index\":1,\"content_block\":{\"type\":\"tool_use\",\"id\":\"toolu_1\",\"name\":\"get_weather\",\"input\":{}}}\n\n";
        assert_eq!(reader.read(tool), EventKind::Content);
        let text = b"event: content_block_start\ndata: {\"type\":\"content_block_start\",\"index\":0,\"content_block\":{\"type\":\"text\",\"text\":\"Hi\"}}\n\n";
        assert_eq!(reader.read(text), EventKind::Content);
        // A block event the reader cannot make out is counted as content, as before.
        let odd = b"event: content_block_delta\ndata: not json\n\n";
        assert_eq!(reader.read(odd), EventKind::Content);
    }

    #[test]
    fn a_messages_error_event_is_a_failure_with_its_message() {
        let mut reader = StreamReader::new(Protocol::Messages);
        let error = b"event: error\ndata: {\"type\":\"error\",\"error\":{\"type\":\"overloaded_error\",\"message\":\"Overloaded\"}}\n\n";
        assert_eq!(
            reader.read(error),
            EventKind::Error("overloaded_error: Overloaded".into())
        );
    }

    #[test]
    fn chat_chunks_report_content_usage_errors_and_done() {
        let mut reader = StreamReader::new(Protocol::ChatCompletions);
        let role = b"data: {\"choices\":[{\"index\":0,\"delta\":{\"role\":\"assistant\",\"content\":\"\"}}]}\n\n";
        assert_eq!(reader.read(role), EventKind::Other);
        let text = b"data: {\"choices\":[{\"index\":0,\"delta\":{\"content\":\"Hi\"}}]}\n\n";
        assert_eq!(reader.read(text), EventKind::Content);
        let tool = b"data: {\"choices\":[{\"index\":0,\"delta\":{\"tool_calls\":[{\"index\":0,\"function\":{\"arguments\":\"{\"}}]}}]}\n\n";
        assert_eq!(reader.read(tool), EventKind::Content);
        let usage = b"data: {\"choices\":[],\"usage\":{\"prompt_tokens\":9,\"completion_tokens\":3,\"total_tokens\":12}}\n\n";
        assert_eq!(reader.read(usage), EventKind::Other);
        assert_eq!(reader.reported().output_tokens, Some(3));
        assert_eq!(reader.read(b"data: [DONE]\n\n"), EventKind::End);
        let error =
            b"data: {\"error\":{\"message\":\"server overloaded\",\"type\":\"server_error\"}}\n\n";
        assert_eq!(
            reader.read(error),
            EventKind::Error("server_error: server overloaded".into())
        );
    }

    /// A client that leaves mid-stream is charged the output it was passed, counted: a custom
    /// tool's input (a coding agent's patch) counts as a function's arguments do.
    #[test]
    fn the_output_counted_from_a_chat_stream_includes_tool_calls_of_both_kinds() {
        let mut reader = StreamReader::new(Protocol::ChatCompletions).counting_output();
        let chunks: [&[u8]; 4] = [
            b"data: {\"choices\":[{\"delta\":{\"tool_calls\":[{\"index\":0,\"type\":\"custom\",\"custom\":{\"name\":\"apply_patch\",\"input\":\"\"}}]}}]}\n\n",
            b"data: {\"choices\":[{\"delta\":{\"tool_calls\":[{\"index\":0,\"custom\":{\"input\":\"*** Begin Patch\\n\"}}]}}]}\n\n",
            b"data: {\"choices\":[{\"delta\":{\"tool_calls\":[{\"index\":1,\"function\":{\"name\":\"sh\",\"arguments\":\"{\\\"a\\\":1}\"}}]}}]}\n\n",
            b"data: {\"choices\":[{\"delta\":{\"content\":\"Done.\"}}]}\n\n",
        ];
        for chunk in chunks {
            assert_eq!(reader.read(chunk), EventKind::Content);
        }
        // Each event's text, joined, is counted.
        let expected = ["apply_patch", "*** Begin Patch\n", "sh{\"a\":1}", "Done."]
            .map(crate::protocol::tokens::counted_text_tokens)
            .iter()
            .sum::<u64>();
        assert_eq!(reader.counted_output(), Some(expected));
        assert_eq!(reader.reported().output_tokens, None, "nothing reported");
        assert!(!reader.ended());
    }

    #[test]
    fn responses_events_report_content_usage_failures_and_the_end() {
        let mut reader = StreamReader::new(Protocol::Responses);
        let event = |name: &str, data: &str| format!("event: {name}\ndata: {data}\n\n");
        let read = |reader: &mut StreamReader, name: &str, data: &str| {
            reader.read(event(name, data).as_bytes())
        };
        let created =
            r#"{"type":"response.created","sequence_number":0,"response":{"id":"r","usage":null}}"#;
        assert_eq!(
            read(&mut reader, "response.created", created),
            EventKind::Other
        );
        let message = r#"{"type":"response.output_item.added","sequence_number":1,"item":{"type":"message"}}"#;
        assert_eq!(
            read(&mut reader, "response.output_item.added", message),
            EventKind::Other
        );
        let empty = r#"{"type":"response.output_text.delta","sequence_number":2,"delta":""}"#;
        assert_eq!(
            read(&mut reader, "response.output_text.delta", empty),
            EventKind::Other
        );
        let text = r#"{"type":"response.output_text.delta","sequence_number":3,"delta":"Hi"}"#;
        assert_eq!(
            read(&mut reader, "response.output_text.delta", text),
            EventKind::Content
        );
        let thought =
            r#"{"type":"response.reasoning_text.delta","sequence_number":3,"delta":"hm"}"#;
        assert_eq!(
            read(&mut reader, "response.reasoning_text.delta", thought),
            EventKind::Content
        );
        let call = r#"{"type":"response.output_item.added","sequence_number":4,"item":{"type":"function_call","name":"f"}}"#;
        assert_eq!(
            read(&mut reader, "response.output_item.added", call),
            EventKind::Content
        );
        let completed = r#"{"type":"response.completed","sequence_number":5,"response":{"usage":{"input_tokens":7,"output_tokens":2}}}"#;
        assert_eq!(
            read(&mut reader, "response.completed", completed),
            EventKind::End
        );
        assert_eq!(
            reader.reported(),
            TokenUsage {
                input_tokens: Some(7),
                output_tokens: Some(2),
                ..Default::default()
            }
        );
        let failed = r#"{"type":"response.failed","sequence_number":6,"response":{"error":{"code":"server_error","message":"boom"}}}"#;
        assert_eq!(
            read(&mut reader, "response.failed", failed),
            EventKind::Error("boom".into())
        );
        let error =
            r#"{"type":"error","sequence_number":7,"code":"server_error","message":"down"}"#;
        assert_eq!(
            read(&mut reader, "error", error),
            EventKind::Error("server_error: down".into())
        );
        // The gateway's error event follows the last event passed on, not the failures.
        let own = reader.error_event(&GatewayError::UpstreamUnavailable);
        let own: serde_json::Value = serde_json::from_str(
            Event::parse(std::str::from_utf8(&own).unwrap())
                .data
                .as_ref(),
        )
        .unwrap();
        assert_eq!(own["sequence_number"], 6);
        assert_eq!(own["type"], "error");
    }

    #[test]
    fn the_gateways_error_events_parse_as_each_protocol_expects() {
        let mut messages = StreamReader::new(Protocol::Messages);
        let failed = GatewayError::UpstreamUnavailable;
        assert_eq!(
            messages.read(&error_event(Protocol::Messages, &failed, 0)),
            EventKind::Error("api_error: 上游服务暂时不可用".into())
        );
        let mut chat = StreamReader::new(Protocol::ChatCompletions);
        assert_eq!(
            chat.read(&error_event(Protocol::ChatCompletions, &failed, 0)),
            EventKind::Error("api_error: 上游服务暂时不可用".into())
        );
    }
}
