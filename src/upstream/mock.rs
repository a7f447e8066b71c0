//! The mock upstream: a fixed demonstration reply in the endpoint's own shape, complete or (for
//! `stream: true`) as the protocol's event stream: several text deltas and the final usage. For
//! embeddings, a deterministic unit vector per input (the same input, the same vector).

use std::future::{Ready, ready};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, LazyLock};
use std::task::{Context, Poll};

use bytes::Bytes;
use http::{HeaderValue, Request, Response, header};
use serde_json::json;
use tower_service::Service;

use super::UpstreamError;
use crate::call::RoutedCall;
use crate::protocol::{Protocol, TokenUsage, responses};
use crate::reply::UpstreamBody;

/// The text of every mock reply.
pub const MOCK_REPLY_TEXT: &str =
    "This is a demo reply from model-gateway's mock upstream; no model was called.";

const MOCK_OUTPUT_TOKENS: u64 = 16;

/// The input tokens the mock reports for a request `body`: the gateway's own estimate from its
/// size, so that token prices can be tried without a provider.
fn mock_input_tokens(body: &[u8]) -> u64 {
    crate::pricing::estimated_input_tokens(body.len())
}

/// A token count as the ledger keeps it.
fn tokens(count: u64) -> i64 {
    i64::try_from(count).unwrap_or(i64::MAX)
}

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

    /// The complete reply to `body`, with the usage it reports when the mock knows it without
    /// reading its own reply back (the billing layer reads the reply otherwise).
    fn reply(&self, routed: &RoutedCall, body: &[u8]) -> (Bytes, Option<TokenUsage>) {
        let (protocol, model) = (routed.protocol, routed.model.name.as_str());
        let to_bytes = |reply: Result<Vec<u8>, serde_json::Error>| {
            Bytes::from(reply.expect("a mock reply serialises"))
        };
        let input_tokens = mock_input_tokens(body);
        let counted = |input, output| TokenUsage {
            input_tokens: Some(tokens(input)),
            output_tokens: Some(tokens(output)),
            ..TokenUsage::default()
        };
        match protocol {
            // The chat reply, as a translating upstream answers it (written from what the mock
            // says, without a chat reply to read back).
            Protocol::Responses => {
                let translation = routed.translation();
                let parsed;
                let echoed = match &translation {
                    Some(translation) => translation.echoed(),
                    None => {
                        parsed = responses::Echoed::of_request(body);
                        &parsed
                    }
                };
                let chat = responses::ChatReply {
                    created: Some(unix_now()),
                    model: Some(model),
                    // Written between quotes as it is: it holds nothing JSON escapes (a test
                    // checks).
                    text: Some(responses::Str::Unescaped(MOCK_REPLY_TEXT)),
                    finish_reason: Some("stop"),
                    usage: Some(responses::Usage::counted(
                        tokens(input_tokens),
                        tokens(MOCK_OUTPUT_TOKENS),
                    )),
                    ..responses::ChatReply::default()
                };
                let reply = responses::write_response(echoed, &chat, &mut responses::Ids::random());
                // The Responses usage says it has no reasoning tokens, rather than nothing.
                let usage = TokenUsage {
                    reasoning_tokens: Some(0),
                    ..counted(input_tokens, MOCK_OUTPUT_TOKENS)
                };
                (Bytes::from(reply), Some(usage))
            }
            Protocol::ChatCompletions => (
                Bytes::from(self.chat_reply(model, input_tokens)),
                Some(counted(input_tokens, MOCK_OUTPUT_TOKENS)),
            ),
            Protocol::Messages => (
                to_bytes(serde_json::to_vec(&self.messages_reply(model, body))),
                Some(counted(input_tokens, MOCK_OUTPUT_TOKENS)),
            ),
            Protocol::Embeddings => (to_bytes(serde_json::to_vec(&embeddings(model, body))), None),
        }
    }

    fn serial(&self) -> u64 {
        self.replies.fetch_add(1, Ordering::Relaxed) + 1
    }

    /// The chat-completions reply ([`ChatReply`]'s JSON, as the test checks), written a piece at
    /// a time: of the reply only the id's number, the time, the model and the token counts
    /// change from call to call, and the rest (the text included) is copied as it was written
    /// once. Serialising the whole reply escaped each key and the text a byte at a time, a
    /// tenth of the instructions the in-memory gateway spent on a call.
    fn chat_reply(&self, model: &str, input_tokens: u64) -> Vec<u8> {
        /// From after the model to the prompt's token count.
        static CHOICES: LazyLock<Vec<u8>> = LazyLock::new(|| {
            let text = serde_json::to_string(MOCK_REPLY_TEXT).expect("a string serialises");
            format!(
                r#","choices":[{{"index":0,"message":{{"role":"assistant","content":{text},"refusal":null}},"logprobs":null,"finish_reason":"stop"}}],"usage":{{"prompt_tokens":"#
            )
            .into_bytes()
        });
        let mut number = itoa::Buffer::new();
        let mut out = Vec::with_capacity(CHOICES.len() + model.len() + 128);
        out.extend_from_slice(br#"{"id":"chatcmpl-mock-"#);
        out.extend_from_slice(number.format(self.serial()).as_bytes());
        out.extend_from_slice(br#"","object":"chat.completion","created":"#);
        out.extend_from_slice(number.format(unix_now()).as_bytes());
        out.extend_from_slice(br#","model":"#);
        serde_json::to_writer(&mut out, model).expect("a string serialises");
        out.extend_from_slice(&CHOICES);
        out.extend_from_slice(number.format(input_tokens).as_bytes());
        out.extend_from_slice(br#","completion_tokens":"#);
        out.extend_from_slice(number.format(MOCK_OUTPUT_TOKENS).as_bytes());
        out.extend_from_slice(br#","total_tokens":"#);
        out.extend_from_slice(number.format(input_tokens + MOCK_OUTPUT_TOKENS).as_bytes());
        out.extend_from_slice(b"}}");
        out
    }

    /// The messages reply.
    fn messages_reply<'a>(&self, model: &'a str, body: &[u8]) -> MessagesReply<'a> {
        MessagesReply {
            id: format!("msg_mock_{}", self.serial()),
            kind: "message",
            role: "assistant",
            model,
            content: [TextBlock {
                kind: "text",
                text: MOCK_REPLY_TEXT,
            }],
            stop_reason: "end_turn",
            stop_sequence: None,
            usage: MessagesUsage {
                input_tokens: mock_input_tokens(body),
                output_tokens: MOCK_OUTPUT_TOKENS,
            },
        }
    }
}

/// Seconds since the Unix epoch, as `created` says it (without the calendar date that
/// `chrono::Utc::now` works out).
fn unix_now() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |since| {
            i64::try_from(since.as_secs()).unwrap_or(i64::MAX)
        })
}

/// `OpenAI`'s chat completion, as the mock answers it (written a piece at a time by
/// [`MockUpstream::chat_reply`]).
#[cfg(test)]
#[derive(serde::Serialize)]
struct ChatReply<'a> {
    id: String,
    object: &'static str,
    created: i64,
    model: &'a str,
    choices: [ChatChoice; 1],
    usage: ChatUsage,
}

#[cfg(test)]
#[derive(serde::Serialize)]
struct ChatChoice {
    index: u32,
    message: ChatMessage,
    logprobs: Option<()>,
    finish_reason: &'static str,
}

#[cfg(test)]
#[derive(serde::Serialize)]
struct ChatMessage {
    role: &'static str,
    content: &'static str,
    refusal: Option<()>,
}

#[cfg(test)]
#[derive(serde::Serialize)]
struct ChatUsage {
    prompt_tokens: u64,
    completion_tokens: u64,
    total_tokens: u64,
}

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

/// How many pieces the mock's streamed text comes in.
const MOCK_STREAM_DELTAS: usize = 4;

impl MockUpstream {
    /// The demonstration reply as `protocol`'s event stream, one chunk per event (per chat
    /// event for Responses, translated as a translating upstream does).
    fn events(
        &self,
        protocol: Protocol,
        model: &str,
        body: &[u8],
        input_tokens: u64,
        gateway_asks_usage: bool,
    ) -> Vec<Bytes> {
        // Asked by the client, or by the gateway on the client's behalf (as a provider would
        // read the request the gateway sends).
        let include_usage = gateway_asks_usage || wants_usage_chunk(body);
        let serial = self.serial();
        let pieces = text_pieces(MOCK_REPLY_TEXT, MOCK_STREAM_DELTAS);
        let mut events = Vec::new();
        match protocol {
            Protocol::Responses => {
                let echoed = responses::Echoed::of_request(body);
                let chat = format!(
                    r#"{{"model":"{model}","stream":true,"stream_options":{{"include_usage":true}}}}"#
                );
                let mut translator =
                    responses::StreamTranslator::repeating(echoed, responses::Ids::random());
                let chat = self.events(
                    Protocol::ChatCompletions,
                    model,
                    chat.as_bytes(),
                    input_tokens,
                    false,
                );
                for chunk in chat {
                    let translated = translator.push(&chunk);
                    if !translated.is_empty() {
                        events.push(Bytes::from(translated));
                    }
                }
            }
            // The router lets no embeddings call stream; a stream without its end is refunded.
            Protocol::Embeddings => {}
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
                            "usage": { "input_tokens": input_tokens, "output_tokens": 1 }
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
                let created = unix_now();
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
                            "prompt_tokens": input_tokens,
                            "completion_tokens": MOCK_OUTPUT_TOKENS,
                            "total_tokens": input_tokens + MOCK_OUTPUT_TOKENS
                        }),
                    );
                }
                events.push(Bytes::from_static(b"data: [DONE]\n\n"));
            }
        }
        events
    }
}

/// Dimensions of a mock embedding when the request does not ask for `dimensions`: those of
/// `OpenAI`'s `text-embedding-3-small`, which retrieval pipelines often assume.
pub const MOCK_EMBEDDING_DIMENSIONS: usize = 1536;

/// The most `dimensions` the mock gives.
const MAX_MOCK_EMBEDDING_DIMENSIONS: usize = 4096;

/// `OpenAI`'s embeddings reply for a request `body`: one unit vector per input (a string, a
/// token array, or each item of an array of them), the same for the same input; as floats, or
/// as base64 of little-endian `f32`s when `encoding_format` says `base64` (as the SDKs ask).
/// Usage counts a token per four bytes of text, or the tokens given.
fn embeddings(model: &str, body: &[u8]) -> serde_json::Value {
    #[derive(serde::Deserialize)]
    struct Asked {
        #[serde(default)]
        input: serde_json::Value,
        dimensions: Option<usize>,
        encoding_format: Option<String>,
    }
    let asked: Asked = serde_json::from_slice(body).unwrap_or(Asked {
        input: serde_json::Value::Null,
        dimensions: None,
        encoding_format: None,
    });
    let inputs: Vec<&serde_json::Value> = match &asked.input {
        serde_json::Value::Array(items) if items.iter().all(serde_json::Value::is_number) => {
            vec![&asked.input]
        }
        serde_json::Value::Array(items) => items.iter().collect(),
        one => vec![one],
    };
    let dimensions = asked
        .dimensions
        .unwrap_or(MOCK_EMBEDDING_DIMENSIONS)
        .clamp(1, MAX_MOCK_EMBEDDING_DIMENSIONS);
    let base64 = asked.encoding_format.as_deref() == Some("base64");
    let mut tokens = 0;
    let data: Vec<serde_json::Value> = inputs
        .iter()
        .enumerate()
        .map(|(index, input)| {
            tokens += match input {
                serde_json::Value::Array(ids) => ids.len(),
                text => (text.as_str().map_or(0, str::len) / 4).max(1),
            };
            let vector = unit_vector(input.to_string().as_bytes(), dimensions);
            let embedding = if base64 {
                use base64::Engine;
                let bytes: Vec<u8> = vector.iter().flat_map(|x| x.to_le_bytes()).collect();
                json!(base64::engine::general_purpose::STANDARD.encode(bytes))
            } else {
                json!(vector)
            };
            json!({ "object": "embedding", "index": index, "embedding": embedding })
        })
        .collect();
    json!({
        "object": "list",
        "data": data,
        "model": model,
        "usage": { "prompt_tokens": tokens, "total_tokens": tokens }
    })
}

/// A unit vector of `dimensions` drawn from `seed`'s SHA-256: the same seed, the same vector.
fn unit_vector(seed: &[u8], dimensions: usize) -> Vec<f32> {
    use sha2::Digest;
    let digest = sha2::Sha256::digest(seed);
    let mut rng = fastrand::Rng::with_seed(u64::from_le_bytes(
        digest[..8].try_into().expect("a SHA-256 has 32 bytes"),
    ));
    let raw: Vec<f32> = (0..dimensions).map(|_| rng.f32() * 2.0 - 1.0).collect();
    let norm = raw
        .iter()
        .map(|x| x * x)
        .sum::<f32>()
        .sqrt()
        .max(f32::MIN_POSITIVE);
    raw.iter().map(|x| x / norm).collect()
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
        let (protocol, model) = (routed.protocol, routed.model.name.as_str());
        if routed.stream {
            let body = request.body().as_ref();
            let input_tokens = mock_input_tokens(body);
            let asked = routed.gateway_asks_usage;
            let events = self.events(protocol, model, body, input_tokens, asked);
            let mut response = Response::new(UpstreamBody::event_chunks(events));
            response.headers_mut().insert(
                header::CONTENT_TYPE,
                HeaderValue::from_static("text/event-stream"),
            );
            return ready(Ok(response));
        }
        let (reply, usage) = self.reply(routed, request.body().as_ref());
        let mut response = Response::new(UpstreamBody::complete(reply));
        response.headers_mut().insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/json"),
        );
        if let Some(usage) = usage {
            response.extensions_mut().insert(usage);
        }
        ready(Ok(response))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The usage the mock hands the billing layer is what that layer would read from the
    /// reply itself, on every protocol.
    #[test]
    fn the_usage_given_with_a_reply_is_the_usage_the_reply_reports() {
        let catalogue = crate::Catalogue::demo();
        let cases = [
            (
                Protocol::ChatCompletions,
                r#"{"model":"gpt-4o-mini","messages":[{"role":"user","content":"Hello there"}]}"#,
            ),
            (
                Protocol::Messages,
                r#"{"model":"claude-sonnet-4-5","max_tokens":10,"messages":[{"role":"user","content":"Hi"}]}"#,
            ),
            (
                Protocol::Responses,
                r#"{"model":"gpt-4o-mini","input":"A somewhat longer question than the others"}"#,
            ),
        ];
        for (protocol, body) in cases {
            let routed = crate::router::route(&catalogue, protocol, body.as_bytes(), false)
                .expect("a demo model");
            let (reply, usage) = MockUpstream::new().reply(&routed, body.as_bytes());
            let read = crate::protocol::reply_usage(&reply).expect("a JSON object");
            assert_eq!(usage, Some(read), "{protocol:?}");
            assert!(read.input_tokens.is_some_and(|tokens| tokens > 0));
        }
    }

    /// The chat reply written a piece at a time is the typed reply's JSON, byte for byte.
    #[test]
    fn the_chat_reply_is_written_as_its_type_serialises() {
        let mock = MockUpstream::new();
        for (model, input_tokens) in [("gpt-4o-mini", 7), ("a \"quoted\" 模型", 0), ("m", 1 << 40)]
        {
            let before = unix_now();
            let written = mock.chat_reply(model, input_tokens);
            let after = unix_now();
            let serial = mock.replies.load(Ordering::Relaxed);
            let typed = |created| ChatReply {
                id: format!("chatcmpl-mock-{serial}"),
                object: "chat.completion",
                created,
                model,
                choices: [ChatChoice {
                    index: 0,
                    message: ChatMessage {
                        role: "assistant",
                        content: MOCK_REPLY_TEXT,
                        refusal: None,
                    },
                    logprobs: None,
                    finish_reason: "stop",
                }],
                usage: ChatUsage {
                    prompt_tokens: input_tokens,
                    completion_tokens: MOCK_OUTPUT_TOKENS,
                    total_tokens: input_tokens + MOCK_OUTPUT_TOKENS,
                },
            };
            assert!(
                [before, after]
                    .iter()
                    .any(|&created| serde_json::to_vec(&typed(created)).unwrap() == written),
                "{}",
                String::from_utf8_lossy(&written)
            );
        }
    }

    /// The Responses reply writes the text between quotes as it is.
    #[test]
    fn the_reply_text_holds_nothing_json_escapes() {
        assert_eq!(
            serde_json::to_string(MOCK_REPLY_TEXT).unwrap(),
            format!("\"{MOCK_REPLY_TEXT}\"")
        );
    }

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
