//! Bedrock's streamed replies: AWS's binary event-stream framing (a length prelude, headers,
//! the payload, and a CRC-32 over the prelude and over the whole frame, checked by the AWS
//! SDK's own decoder), each `chunk` event carrying one of Anthropic's stream events as base64.
//! Decoded into the server-sent events Anthropic's own API sends, so that everything above
//! reads a Bedrock stream as it reads Anthropic's. An exception frame (throttling, a model
//! error) is the stream's failure: before any event, the channel's (another may serve the
//! call); after, a cut.

use std::pin::Pin;
use std::task::{Context, Poll, ready};

use aws_smithy_eventstream::frame::{DecodedFrame, MessageFrameDecoder};
use aws_smithy_types::event_stream::Message;
use base64::Engine as _;
use bytes::{Bytes, BytesMut};
use http_body::{Body, Frame};
use serde::Deserialize;

use crate::error::UpstreamError;
use crate::reply::EventStream;

/// Bedrock's stream in, Anthropic's events out.
pub(super) struct Decoded {
    frames: EventStream,
    buffer: BytesMut,
    decoder: MessageFrameDecoder,
    /// The largest frame held unfinished.
    max_frame: usize,
}

impl Decoded {
    pub(super) fn new(frames: EventStream, max_event: usize) -> Decoded {
        Decoded {
            frames,
            buffer: BytesMut::new(),
            decoder: MessageFrameDecoder::new(),
            // A frame carries an event as base64 in JSON: a third more, and its framing.
            max_frame: max_event.saturating_mul(2),
        }
    }

    /// Every complete frame in the buffer, as events.
    fn decode(&mut self) -> Result<Vec<u8>, UpstreamError> {
        let mut events = Vec::new();
        loop {
            match self.decoder.decode_frame(&mut self.buffer) {
                Ok(DecodedFrame::Complete(message)) => event(&message, &mut events)?,
                Ok(DecodedFrame::Incomplete) => break,
                Err(error) => {
                    return Err(UpstreamError::transport(format!(
                        "Bedrock sent a frame that does not decode: {error}"
                    )));
                }
            }
        }
        if self.buffer.len() > self.max_frame {
            return Err(UpstreamError::transport(format!(
                "Bedrock's frame passed the {} bytes a frame may have",
                self.max_frame
            )));
        }
        Ok(events)
    }
}

/// A header's text value.
fn header<'a>(message: &'a Message, name: &str) -> Option<&'a str> {
    let header = message
        .headers()
        .iter()
        .find(|header| header.name().as_str() == name)?;
    Some(header.value().as_string().ok()?.as_str())
}

/// Appends the event `message` carries to `events`, or says why the stream failed.
fn event(message: &Message, events: &mut Vec<u8>) -> Result<(), UpstreamError> {
    #[derive(Deserialize)]
    struct Chunk {
        bytes: String,
    }
    #[derive(Deserialize)]
    struct Kind {
        #[serde(rename = "type")]
        kind: String,
    }
    #[derive(Deserialize)]
    struct Exception {
        message: Option<String>,
        #[serde(rename = "Message")]
        capital: Option<String>,
    }
    let payload = message.payload();
    match header(message, ":message-type") {
        Some("event") => {}
        Some("exception") => {
            let kind = header(message, ":exception-type").unwrap_or("exception");
            let text = serde_json::from_slice::<Exception>(payload)
                .ok()
                .and_then(|exception| exception.message.or(exception.capital))
                .unwrap_or_default();
            return Err(UpstreamError::transport(format!("Bedrock: {kind}: {text}")));
        }
        _ => {
            let code = header(message, ":error-code").unwrap_or("error");
            let text = header(message, ":error-message").unwrap_or_default();
            return Err(UpstreamError::transport(format!("Bedrock: {code}: {text}")));
        }
    }
    if header(message, ":event-type") != Some("chunk") {
        return Ok(());
    }
    let unreadable = || UpstreamError::transport("Bedrock sent a chunk that is not an event");
    let chunk: Chunk = serde_json::from_slice(payload).map_err(|_| unreadable())?;
    let data = base64::engine::general_purpose::STANDARD
        .decode(chunk.bytes)
        .map_err(|_| unreadable())?;
    let kind: Kind = serde_json::from_slice(&data).map_err(|_| unreadable())?;
    events.extend_from_slice(b"event: ");
    events.extend_from_slice(kind.kind.as_bytes());
    events.extend_from_slice(b"\ndata: ");
    // Line breaks in JSON are white space between its tokens (never inside a string): an
    // event's data stays on one line.
    events.extend(data.iter().map(|&byte| match byte {
        b'\n' | b'\r' => b' ',
        other => other,
    }));
    events.extend_from_slice(b"\n\n");
    Ok(())
}

impl Body for Decoded {
    type Data = Bytes;
    type Error = UpstreamError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, UpstreamError>>> {
        let this = self.get_mut();
        loop {
            let Some(frame) = ready!(Pin::new(&mut this.frames).poll_frame(cx)) else {
                if this.buffer.is_empty() {
                    return Poll::Ready(None);
                }
                this.buffer.clear();
                return Poll::Ready(Some(Err(UpstreamError::transport(
                    "Bedrock's stream ended inside a frame",
                ))));
            };
            let Ok(data) = frame?.into_data() else {
                continue;
            };
            this.buffer.extend_from_slice(&data);
            let events = this.decode()?;
            if !events.is_empty() {
                return Poll::Ready(Some(Ok(Frame::data(Bytes::from(events)))));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use aws_smithy_eventstream::frame::write_message_to;
    use aws_smithy_types::event_stream::{Header, HeaderValue};
    use http_body_util::BodyExt;

    use super::*;

    fn message(headers: &[(&'static str, &'static str)], payload: &[u8]) -> Vec<u8> {
        let headers = headers
            .iter()
            .map(|(name, value)| Header::new(*name, HeaderValue::String((*value).into())))
            .collect();
        let mut frame = Vec::new();
        write_message_to(
            &Message::new_from_parts(headers, payload.to_vec()),
            &mut frame,
        )
        .expect("a frame");
        frame
    }

    fn chunk(event: &str) -> Vec<u8> {
        let bytes = base64::engine::general_purpose::STANDARD.encode(event);
        let payload = serde_json::json!({ "bytes": bytes }).to_string();
        message(
            &[(":message-type", "event"), (":event-type", "chunk")],
            payload.as_bytes(),
        )
    }

    /// The frames `pieces` carry, in the pieces they arrive in, decoded to the end.
    async fn decoded(pieces: Vec<Vec<u8>>) -> Result<String, String> {
        let chunks: Vec<Result<Frame<Bytes>, UpstreamError>> = pieces
            .into_iter()
            .map(|piece| Ok(Frame::data(Bytes::from(piece))))
            .collect();
        let body = http_body_util::StreamBody::new(futures::stream::iter(chunks)).boxed_unsync();
        let mut decoded = Decoded::new(body, 1 << 20);
        let mut text = String::new();
        while let Some(frame) = decoded.frame().await {
            let frame = frame.map_err(|error| error.message)?;
            text.push_str(&String::from_utf8_lossy(&frame.into_data().expect("data")));
        }
        Ok(text)
    }

    #[tokio::test]
    async fn chunks_become_anthropics_events_however_the_frames_are_cut() {
        let mut bytes = chunk(r#"{"type":"message_start","message":{}}"#);
        bytes.extend(chunk("{\"type\":\"message_stop\",\n\"x\":1}"));
        let expected = "event: message_start\ndata: {\"type\":\"message_start\",\"message\":{}}\n\n\
                        event: message_stop\ndata: {\"type\":\"message_stop\", \"x\":1}\n\n";
        for size in [1, 7, bytes.len()] {
            let pieces = bytes.chunks(size).map(<[u8]>::to_vec).collect();
            assert_eq!(decoded(pieces).await.as_deref(), Ok(expected), "{size}");
        }
    }

    #[tokio::test]
    async fn a_frame_whose_checksum_does_not_match_fails_the_stream() {
        let mut bytes = chunk(r#"{"type":"ping"}"#);
        let last = bytes.len() - 6;
        bytes[last] ^= 1;
        let error = decoded(vec![bytes]).await.expect_err("refused");
        assert!(error.contains("does not decode"), "{error}");
    }

    #[tokio::test]
    async fn an_exception_frame_and_a_stream_ending_inside_a_frame_fail_it() {
        let exception = message(
            &[
                (":message-type", "exception"),
                (":exception-type", "throttlingException"),
            ],
            br#"{"message":"Too many requests"}"#,
        );
        assert_eq!(
            decoded(vec![exception]).await,
            Err("Bedrock: throttlingException: Too many requests".to_owned())
        );
        let whole = chunk(r#"{"type":"ping"}"#);
        let error = decoded(vec![whole[..whole.len() - 1].to_vec()]).await;
        assert_eq!(
            error,
            Err("Bedrock's stream ended inside a frame".to_owned())
        );
    }
}
