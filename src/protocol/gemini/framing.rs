//! The Gemini API's other stream framing: `streamGenerateContent` without `alt=sse` answers one
//! JSON array whose elements are the stream's responses, written as they come (`[{...}`,
//! `,\r\n{...}`, then `]`). The gateway asks its providers for server-sent events and bills
//! those; a client that asked for the array gets each event's data as the array's next element.

use bytes::{Bytes, BytesMut};

use crate::protocol::sse::{Event, EventSplitter, event_text};

/// Turns a Gemini event stream into the JSON array framing, chunk by chunk.
#[derive(Debug)]
pub struct JsonArrayFraming {
    splitter: EventSplitter,
    /// Whether the array has been opened (by its first element).
    opened: bool,
}

impl Default for JsonArrayFraming {
    fn default() -> JsonArrayFraming {
        JsonArrayFraming::new()
    }
}

impl JsonArrayFraming {
    /// A stream not yet begun.
    pub fn new() -> JsonArrayFraming {
        JsonArrayFraming {
            splitter: EventSplitter::new(),
            opened: false,
        }
    }

    /// The array text for the complete events in `chunk` (with what came before it): each
    /// event's data as an element. Events without data (comments) are left out.
    pub fn push(&mut self, chunk: &[u8]) -> Bytes {
        self.splitter.push(chunk);
        let mut out = BytesMut::new();
        while let Some(event) = self.splitter.next_event() {
            let text = event_text(&event);
            let data = Event::parse(&text).data;
            if data.trim().is_empty() {
                continue;
            }
            out.extend_from_slice(if self.opened { b",\r\n" } else { b"[" });
            self.opened = true;
            out.extend_from_slice(data.as_bytes());
        }
        out.freeze()
    }

    /// The array's end (the whole array, `[]`, when no event came).
    pub fn finish(&mut self) -> Bytes {
        let end: &'static [u8] = if self.opened { b"]" } else { b"[]" };
        self.opened = true;
        Bytes::from_static(end)
    }
}

/// Whether a `streamGenerateContent` call's `query` asks for server-sent events (`alt=sse`);
/// without it, Google answers the JSON array.
pub fn asks_server_sent_events(query: Option<&str>) -> bool {
    query.is_some_and(|query| {
        form_urlencoded::parse(query.as_bytes())
            .any(|(name, value)| name == "alt" && value == "sse")
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn events_become_the_elements_of_one_array_however_they_are_cut() {
        let events = "data: {\"a\":1}\r\n\r\n: a comment\r\n\r\ndata: {\"b\":[2]}\r\n\r\ndata: {\"c\":\"3\"}\n\n";
        for size in [1, 3, 7, events.len()] {
            let mut framing = JsonArrayFraming::new();
            let mut out = Vec::new();
            for piece in events.as_bytes().chunks(size) {
                out.extend_from_slice(&framing.push(piece));
            }
            out.extend_from_slice(&framing.finish());
            let array: serde_json::Value = serde_json::from_slice(&out).expect("one JSON array");
            assert_eq!(
                array,
                serde_json::json!([{"a": 1}, {"b": [2]}, {"c": "3"}]),
                "cut every {size}"
            );
        }
        assert_eq!(&JsonArrayFraming::new().finish()[..], b"[]");
    }

    #[test]
    fn only_alt_sse_asks_for_events() {
        assert!(asks_server_sent_events(Some("alt=sse")));
        assert!(asks_server_sent_events(Some("key=k&alt=sse")));
        assert!(!asks_server_sent_events(Some("alt=json")));
        assert!(!asks_server_sent_events(Some("key=k")));
        assert!(!asks_server_sent_events(None));
    }
}
