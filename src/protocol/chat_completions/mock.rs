//! The mock's chat completion, complete or streamed.

use std::sync::LazyLock;

use bytes::Bytes;
use serde_json::json;

use crate::protocol::TokenUsage;
use crate::protocol::dialect::MockCall;
use crate::protocol::mock::{
    MOCK_OUTPUT_TOKENS, MOCK_REPLY_TEXT, MOCK_STREAM_DELTAS, counted, text_pieces, unix_now,
};

/// The complete reply, with its usage.
pub(super) fn reply(call: &MockCall<'_>) -> (Bytes, Option<TokenUsage>) {
    let reply = chat_reply(call.model, call.serial, call.input_tokens);
    (Bytes::from(reply), Some(counted(call.input_tokens)))
}

/// The chat-completions reply ([`ChatReply`]'s JSON, as the test checks), written a piece at
/// a time: of the reply only the id's number, the time, the model and the token counts
/// change from call to call, and the rest (the text included) is copied as it was written
/// once. Serialising the whole reply escaped each key and the text a byte at a time, a
/// tenth of the instructions the in-memory gateway spent on a call.
fn chat_reply(model: &str, serial: u64, input_tokens: u64) -> Vec<u8> {
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
    out.extend_from_slice(number.format(serial).as_bytes());
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

/// The reply as a chat stream: a role chunk, the text in pieces, the finish, the usage chunk
/// when the client or the gateway asked for it (as a provider would read the request the
/// gateway sends), and `[DONE]`.
pub(crate) fn chat_events(call: &MockCall<'_>) -> Vec<Bytes> {
    let include_usage = call.gateway_asks_usage || wants_usage_chunk(call.body);
    let (model, serial, input_tokens) = (call.model, call.serial, call.input_tokens);
    let created = unix_now();
    let mut events = Vec::new();
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
    for piece in text_pieces(MOCK_REPLY_TEXT, MOCK_STREAM_DELTAS) {
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
    events
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

#[cfg(test)]
mod tests {
    use super::*;

    /// `OpenAI`'s chat completion, as the mock answers it (written a piece at a time by
    /// [`chat_reply`]).
    #[derive(serde::Serialize)]
    struct ChatReply<'a> {
        id: String,
        object: &'static str,
        created: i64,
        model: &'a str,
        choices: [ChatChoice; 1],
        usage: ChatUsage,
    }

    #[derive(serde::Serialize)]
    struct ChatChoice {
        index: u32,
        message: ChatMessage,
        logprobs: Option<()>,
        finish_reason: &'static str,
    }

    #[derive(serde::Serialize)]
    struct ChatMessage {
        role: &'static str,
        content: &'static str,
        refusal: Option<()>,
    }

    #[derive(serde::Serialize)]
    struct ChatUsage {
        prompt_tokens: u64,
        completion_tokens: u64,
        total_tokens: u64,
    }

    /// The chat reply written a piece at a time is the typed reply's JSON, byte for byte.
    #[test]
    fn the_chat_reply_is_written_as_its_type_serialises() {
        for (serial, (model, input_tokens)) in
            [("gpt-4o-mini", 7), ("a \"quoted\" 模型", 0), ("m", 1 << 40)]
                .into_iter()
                .enumerate()
        {
            let serial = serial as u64 + 1;
            let before = unix_now();
            let written = chat_reply(model, serial, input_tokens);
            let after = unix_now();
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
}
