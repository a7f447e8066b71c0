//! Server-sent event streams as the two protocols send them: where each event ends, and what it
//! says (content, usage, the end, an error).
//!
//! The gateway forwards a provider's events byte for byte, whole events at a time: an
//! [`EventSplitter`] finds where each complete event ends in the bytes received so far, and a
//! [`StreamReader`](super::reader::StreamReader) reads each event once for what billing needs. Neither changes a byte.

use std::borrow::Cow;

use bytes::{Bytes, BytesMut};
use serde::de::{MapAccess, Visitor};
use serde::{Deserialize, Deserializer};
use serde_json::value::RawValue;

use super::TokenUsage;

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
    pub(super) usage: TokenUsage,
    /// The Responses API numbers its events; the next number, for an event the gateway adds.
    pub(super) next_sequence: u64,
    /// The last event read was a chat chunk that carries only usage (no choices).
    pub(super) usage_only: bool,
    /// For a reply of several parts that each say when they finish and no end event of its
    /// own (Gemini's candidates and their `finishReason`): the parts seen that have not
    /// finished, and whether any has (the provider closing the stream when every part seen has
    /// finished is its normal end).
    pub(super) unfinished: Vec<u64>,
    pub(super) finished: Vec<u64>,
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

/// Appends the string `value` holds, if it is one, to `text`.
pub(crate) fn take_text(text: &mut String, value: &serde_json::Value) {
    if let Some(piece) = value.as_str() {
        text.push_str(piece);
    }
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
}
