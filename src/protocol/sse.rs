//! Server-sent event streams as the two protocols send them: where each event ends, and what it
//! says (content, usage, the end, an error).
//!
//! The gateway forwards a provider's events byte for byte, whole events at a time: an
//! [`EventSplitter`] finds where each complete event ends in the bytes received so far, and a
//! [`StreamReader`] reads each event once for what billing needs. Neither changes a byte.

use std::borrow::Cow;

use bytes::{Bytes, BytesMut};
use serde::de::{MapAccess, Visitor};
use serde::{Deserialize, Deserializer};
use serde_json::value::RawValue;

use super::dialect::Dialect;
use super::{Protocol, TokenUsage};
use crate::error::GatewayError;

/// Cuts a byte stream into complete events. An event ends at a blank line; lines may end in
/// `\n`, `\r\n` or `\r` (the SSE grammar), and a chunk may end anywhere, even inside a UTF-8
/// character or between the `\r` and `\n` of one line ending.
#[derive(Debug)]
pub(crate) struct EventSplitter {
    buffer: BytesMut,
    /// Where to resume looking for the end of the next event, and whether a line starts there.
    scanned: usize,
    line_start: bool,
}

impl Default for EventSplitter {
    fn default() -> EventSplitter {
        EventSplitter {
            buffer: BytesMut::new(),
            scanned: 0,
            line_start: true,
        }
    }
}

impl EventSplitter {
    /// An empty splitter.
    pub(crate) fn new() -> EventSplitter {
        EventSplitter::default()
    }

    /// Adds received bytes.
    pub(crate) fn push(&mut self, bytes: &[u8]) {
        self.buffer.extend_from_slice(bytes);
    }

    /// The next complete event, with the blank line that ends it, exactly as received.
    pub(crate) fn next_event(&mut self) -> Option<Bytes> {
        let end = self.event_end()?;
        self.scanned = 0;
        self.line_start = true;
        Some(self.buffer.split_to(end).freeze())
    }

    /// Bytes received that do not yet make a complete event.
    pub(crate) fn pending(&self) -> usize {
        self.buffer.len()
    }

    /// Where the first complete event ends (after its blank line), if one is complete.
    fn event_end(&mut self) -> Option<usize> {
        let bytes = &self.buffer[..];
        let (mut i, mut line_start) = (self.scanned, self.line_start);
        while i < bytes.len() {
            // Straight to the next line ending: what comes before it is inside a line.
            match memchr::memchr2(b'\n', b'\r', &bytes[i..]) {
                Some(0) => {}
                Some(inside) => {
                    line_start = false;
                    i += inside;
                }
                None => {
                    line_start = false;
                    i = bytes.len();
                    break;
                }
            }
            let ending = match bytes[i] {
                b'\n' => 1,
                // A `\r` at the end of what arrived may be the first half of `\r\n`: wait.
                _ if i + 1 == bytes.len() => break,
                _ if bytes[i + 1] == b'\n' => 2,
                _ => 1,
            };
            // A line ending at the start of a line is a blank line (but not at the very start).
            if line_start && i > 0 {
                return Some(i + ending);
            }
            line_start = true;
            i += ending;
        }
        (self.scanned, self.line_start) = (i, line_start);
        None
    }
}

/// An event's bytes as text, read lossily where they are not UTF-8 (they are forwarded
/// unchanged all the same); borrowed when they are, as they nearly always are.
pub(crate) fn event_text(event: &[u8]) -> Cow<'_, str> {
    // `from_utf8` checks ASCII a word at a time; `from_utf8_lossy` decodes every character.
    std::str::from_utf8(event).map_or_else(|_| String::from_utf8_lossy(event), Cow::Borrowed)
}

/// The fields of one event that matter here: its `event:` name and its `data:` lines joined.
#[derive(Debug, Default, PartialEq, Eq)]
pub(crate) struct Event<'a> {
    /// The `event:` field, if any.
    pub name: Option<&'a str>,
    /// The `data:` lines, joined with `\n`; borrowed when there is one, as there nearly always
    /// is, so that reading an event allocates nothing.
    pub data: Cow<'a, str>,
}

impl<'a> Event<'a> {
    /// Parses the text of one complete event as [`EventSplitter`] returns it (read lossily
    /// where it is not UTF-8: it is forwarded unchanged). Comments (`:` lines) and other fields
    /// are skipped.
    pub(crate) fn parse(text: &'a str) -> Event<'a> {
        let mut parsed = Event::default();
        let mut data_lines = 0;
        let mut start = 0;
        // Lines end at `\n` or `\r` (a `\r\n` leaves an empty line between, which says nothing).
        let ends = memchr::memchr2_iter(b'\n', b'\r', text.as_bytes()).chain([text.len()]);
        for end in ends {
            let line = &text[start..end];
            start = end + 1;
            let (field, value) = match memchr::memchr(b':', line.as_bytes()) {
                Some(colon) => {
                    let value = &line[colon + 1..];
                    (&line[..colon], value.strip_prefix(' ').unwrap_or(value))
                }
                None => (line, ""),
            };
            match field {
                "event" => parsed.name = Some(value),
                "data" => {
                    if data_lines == 0 {
                        parsed.data = Cow::Borrowed(value);
                    } else {
                        let data = parsed.data.to_mut();
                        data.push('\n');
                        data.push_str(value);
                    }
                    data_lines += 1;
                }
                _ => {}
            }
        }
        parsed
    }
}

/// What one event means for billing.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum EventKind {
    /// Part of the reply: text, a tool call, thinking. Once one reached the client, the call is
    /// billed even if the client leaves.
    Content,
    /// The stream's normal end: Anthropic `message_stop`, `OpenAI` `data: [DONE]`.
    End,
    /// The provider reports a failure inside the stream, with its message.
    Error(String),
    /// Anything else: metadata, pings, usage.
    Other,
}

/// What a stream has reported so far, kept by its dialect's
/// [`read_event`](super::dialect::Dialect::read_event).
#[derive(Debug, Clone, Default)]
pub(crate) struct StreamState {
    usage: TokenUsage,
    /// The Responses API numbers its events; the next number, for an event the gateway adds.
    next_sequence: u64,
    /// The last event read was a chat chunk that carries only usage (no choices).
    usage_only: bool,
}

impl StreamState {
    /// Keeps a usage report: a later report of a kind is the whole count so far.
    pub(crate) fn merge(&mut self, usage: TokenUsage) {
        self.usage = self.usage.merged(usage);
    }

    /// Notes an event numbered `sequence`, so that the gateway's own event comes after it.
    pub(crate) fn numbered(&mut self, sequence: u64) {
        self.next_sequence = self.next_sequence.max(sequence + 1);
    }

    /// Marks the event read as one that carries only usage.
    pub(crate) fn usage_only(&mut self) {
        self.usage_only = true;
    }
}

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
        let kind = self.dialect.read_event(&event, &mut self.state);
        match kind {
            EventKind::End => self.ended = true,
            EventKind::Content => {
                if let Some(counted) = &mut self.counted_output {
                    let text = content_text(self.dialect, &event.data);
                    *counted += crate::pricing::counted_text_tokens(&text);
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

    /// The usage the stream has reported so far. When output is counted: before the stream's
    /// end, the larger of the output reported and the output counted (a provider reports its
    /// final count only at the end); at the end, the output counted if none was reported. A
    /// count of the gateway's own is marked [`TokenUsage::estimated`].
    pub(crate) fn usage(&self) -> TokenUsage {
        let mut usage = self.state.usage;
        if let Some(counted) = self.counted_output {
            let counted = i64::try_from(counted).unwrap_or(i64::MAX);
            let use_count = match usage.output_tokens {
                None => true,
                Some(reported) => !self.ended && counted > reported,
            };
            if use_count {
                usage.output_tokens = Some(counted);
                usage.estimated = true;
            }
        }
        usage
    }

    /// The gateway's last event when the provider failed after the stream started: see
    /// [`Dialect::error_event`]. A stream's events have no `{"detail"}` form, so this is the
    /// same whichever [`ErrorBody`](crate::error::ErrorBody) the operator chose.
    pub(crate) fn error_event(&self, error: &GatewayError) -> Bytes {
        self.dialect.error_event(error, self.state.next_sequence)
    }
}

/// A provider's error object in a stream (`{"type": ..., "message": ...}`).
#[derive(Deserialize)]
pub(crate) struct ErrorObject {
    #[serde(rename = "type")]
    kind: Option<String>,
    message: Option<String>,
}

impl ErrorObject {
    /// `type: message`, or whichever of them was given.
    pub(crate) fn describe(self) -> String {
        match (self.kind, self.message) {
            (Some(kind), Some(message)) => format!("{kind}: {message}"),
            (kind, message) => message.or(kind).unwrap_or_default(),
        }
    }
}

/// Whether a chat choice's `delta`, or a messages block or block delta, carries content: a field
/// other than `role` and `type` whose value is not empty. Read as the event is parsed, without
/// building the object.
pub(crate) struct DeltaHasContent(pub(crate) bool);

impl<'de> Deserialize<'de> for DeltaHasContent {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct Delta;
        impl<'de> Visitor<'de> for Delta {
            type Value = DeltaHasContent;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("a delta object")
            }
            fn visit_map<A: MapAccess<'de>>(self, mut fields: A) -> Result<Self::Value, A::Error> {
                let mut content = false;
                while let Some(field) = fields.next_key::<&'de str>()? {
                    let value: &'de RawValue = fields.next_value()?;
                    content |= !matches!(field, "role" | "type")
                        && !matches!(value.get(), "null" | "\"\"" | "[]" | "{}");
                }
                Ok(DeltaHasContent(content))
            }
        }
        deserializer.deserialize_map(Delta)
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

/// Appends the string `value` holds, if it is one, to `text`.
pub(crate) fn take_text(text: &mut String, value: &serde_json::Value) {
    if let Some(piece) = value.as_str() {
        text.push_str(piece);
    }
}

/// The gateway's last event for `protocol`: see [`Dialect::error_event`].
#[cfg(test)]
pub(crate) fn error_event(protocol: Protocol, error: &GatewayError, next_sequence: u64) -> Bytes {
    protocol.dialect().error_event(error, next_sequence)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn split_all(chunks: &[&[u8]]) -> Vec<Bytes> {
        let mut splitter = EventSplitter::new();
        let mut events = Vec::new();
        for chunk in chunks {
            splitter.push(chunk);
            while let Some(event) = splitter.next_event() {
                events.push(event);
            }
        }
        events
    }

    #[test]
    fn events_end_at_a_blank_line_with_any_line_ending() {
        for stream in [
            &b"data: a\n\ndata: b\n\n"[..],
            b"data: a\r\n\r\ndata: b\r\n\r\n",
        ] {
            let events = split_all(&[stream]);
            assert_eq!(events.len(), 2, "{stream:?}");
            assert_eq!(events.concat(), stream);
        }
        // A lone `\r` at the end may be half of `\r\n`: the event is complete only once the
        // next byte shows it is not.
        let events = split_all(&[b"data: a\r\rdata: b\r\r", b"d"]);
        assert_eq!(events, [&b"data: a\r\r"[..], b"data: b\r\r"]);
    }

    #[test]
    fn an_event_cut_anywhere_is_put_back_together_unchanged() {
        let stream = "event: content_block_delta\r\ndata: {\"text\":\"你好\"}\r\n\r\nevent: ping\r\ndata: {}\r\n\r\n".as_bytes();
        for cut in 0..stream.len() {
            let events = split_all(&[&stream[..cut], &stream[cut..]]);
            assert_eq!(events.len(), 2, "cut at {cut}");
            assert_eq!(events.concat(), stream, "cut at {cut}");
        }
        let byte_by_byte: Vec<&[u8]> = stream.chunks(1).collect();
        assert_eq!(split_all(&byte_by_byte).concat(), stream);
    }

    #[test]
    fn an_incomplete_event_is_held_back() {
        let mut splitter = EventSplitter::new();
        splitter.push(b"data: {\"a\":1}\n");
        assert_eq!(splitter.next_event(), None);
        assert_eq!(splitter.pending(), 14);
        splitter.push(b"\n");
        assert_eq!(
            splitter.next_event().as_deref(),
            Some(&b"data: {\"a\":1}\n\n"[..])
        );
    }

    #[test]
    fn an_events_data_lines_are_joined_and_one_line_is_borrowed() {
        let event = Event::parse("event: message_delta\r\ndata: {\"a\":\r\ndata: 1}\r\n\r\n");
        assert_eq!(event.name, Some("message_delta"));
        assert_eq!(event.data, "{\"a\":\n1}");
        let one = Event::parse(": comment\ndata:{\"a\":1}\nid: 7\n\n");
        assert_eq!((one.name, &one.data), (None, &Cow::Borrowed("{\"a\":1}")));
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
            reader.usage(),
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
        assert_eq!(reader.usage().output_tokens, Some(3));
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
            .map(crate::pricing::counted_text_tokens)
            .iter()
            .sum::<u64>();
        let usage = reader.usage();
        assert_eq!(usage.output_tokens, Some(i64::try_from(expected).unwrap()));
        assert!(usage.estimated);
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
            reader.usage(),
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
