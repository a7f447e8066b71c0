//! A chat completion as a messages reply, and chat completions' usage in Anthropic's names.
//!
//! The reply is read once, borrowed (no `Value` is built), and the message written from what
//! was read: this is on the path of every translated call.

use std::borrow::Cow;

use serde::{Deserialize, Serialize};
use serde_json::value::RawValue;
use serde_json::{Map, Value, json};

use crate::protocol::TokenUsage;

/// What the translation reads of a chat completion.
#[derive(Deserialize)]
struct ChatReply<'a> {
    #[serde(borrow)]
    choices: Vec<Choice<'a>>,
    #[serde(borrow, default)]
    usage: Option<&'a RawValue>,
}

#[derive(Deserialize)]
struct Choice<'a> {
    #[serde(borrow, default)]
    message: Option<ChatMessage<'a>>,
    #[serde(borrow, default)]
    finish_reason: Option<Lenient<'a>>,
    /// The stop sequence that ended the reply, where the server says (vLLM and the servers
    /// that follow it: `stop_reason`, the matched string; a token id otherwise).
    #[serde(borrow, default)]
    stop_reason: Option<Lenient<'a>>,
}

#[derive(Deserialize, Default)]
struct ChatMessage<'a> {
    #[serde(borrow, default)]
    content: Option<Lenient<'a>>,
    #[serde(borrow, default)]
    reasoning_content: Option<Lenient<'a>>,
    #[serde(borrow, default)]
    reasoning: Option<Lenient<'a>>,
    #[serde(borrow, default)]
    refusal: Option<Lenient<'a>>,
    #[serde(borrow, default)]
    tool_calls: Option<Vec<ToolCall<'a>>>,
}

#[derive(Deserialize)]
struct ToolCall<'a> {
    #[serde(borrow, default)]
    id: Option<Lenient<'a>>,
    #[serde(borrow, default)]
    function: Option<Function<'a>>,
}

#[derive(Deserialize)]
struct Function<'a> {
    #[serde(borrow, default)]
    name: Option<Lenient<'a>>,
    #[serde(borrow, default)]
    arguments: Option<Lenient<'a>>,
}

/// A field that should be a string: its text, or nothing when it is anything else (a reply
/// with an odd field translates without it rather than failing).
#[derive(Deserialize)]
#[serde(untagged)]
enum Lenient<'a> {
    Text(#[serde(borrow)] Cow<'a, str>),
    Other(serde::de::IgnoredAny),
}

fn text<'s>(field: Option<&'s Lenient<'_>>) -> Option<&'s str> {
    match field? {
        Lenient::Text(text) => Some(text),
        Lenient::Other(_) => None,
    }
}

/// A content block of the message written back.
#[derive(Serialize)]
#[serde(tag = "type", rename_all = "snake_case")]
enum Block<'a> {
    Thinking {
        thinking: &'a str,
        signature: &'static str,
    },
    Text {
        text: &'a str,
    },
    ToolUse {
        id: &'a str,
        name: &'a str,
        input: Input<'a>,
    },
}

/// A tool call's `input`: the provider's arguments as they are, when they are a JSON object.
#[derive(Serialize)]
#[serde(untagged)]
enum Input<'a> {
    Object(&'a RawValue),
    Value(Value),
}

#[derive(Serialize)]
struct Message<'a> {
    id: &'a str,
    #[serde(rename = "type")]
    kind: &'static str,
    role: &'static str,
    model: &'a str,
    content: Vec<Block<'a>>,
    stop_reason: &'static str,
    stop_sequence: Option<&'a str>,
    usage: Value,
}

/// The `message` for the chat completion `reply` to a request for `model`, and the gateway's
/// reading of its usage (as a chat call reads it, so that both ways charge one reply alike);
/// `None` when `reply` is not a chat completion.
pub(super) fn message_from_chat(
    reply: &[u8],
    model: &str,
    id: &str,
) -> Option<(Vec<u8>, TokenUsage)> {
    if reply.trim_ascii_start().first() != Some(&b'{') {
        return None;
    }
    let read: ChatReply<'_> = crate::protocol::read_json(reply).ok()?;
    let (usage, counted) = match read.usage.filter(|usage| usage.get() != "null") {
        Some(raw) => {
            let counted: TokenUsage = serde_json::from_str(raw.get()).ok()?;
            let chat = || serde_json::from_str(raw.get()).unwrap_or(Value::Null);
            (written_usage(counted, chat), counted)
        }
        // No counts: the gateway estimates them, as for an untranslated reply without usage.
        None => (
            json!({ "input_tokens": null, "output_tokens": null }),
            TokenUsage::default(),
        ),
    };
    let choice = read.choices.first()?;
    let empty = ChatMessage::default();
    let message = choice.message.as_ref().unwrap_or(&empty);
    let mut content = Vec::new();
    let reasoning = text(message.reasoning_content.as_ref())
        .or(text(message.reasoning.as_ref()))
        .filter(|text| !text.is_empty());
    if let Some(thinking) = reasoning {
        content.push(Block::Thinking {
            thinking,
            signature: "",
        });
    }
    for said in [&message.content, &message.refusal] {
        if let Some(text) = text(said.as_ref()).filter(|text| !text.is_empty()) {
            content.push(Block::Text { text });
        }
    }
    for call in message.tool_calls.iter().flatten() {
        let function = call.function.as_ref();
        let arguments = text(function.and_then(|f| f.arguments.as_ref())).unwrap_or_default();
        content.push(Block::ToolUse {
            id: text(call.id.as_ref()).unwrap_or_default(),
            name: text(function.and_then(|f| f.name.as_ref())).unwrap_or_default(),
            input: tool_input_raw(arguments),
        });
    }
    let matched = stop_sequence(
        text(choice.finish_reason.as_ref()),
        text(choice.stop_reason.as_ref()),
    );
    let message = Message {
        id,
        kind: "message",
        role: "assistant",
        model,
        content,
        stop_reason: stop_reason(text(choice.finish_reason.as_ref()), matched),
        stop_sequence: matched,
        usage,
    };
    Some((
        serde_json::to_vec(&message).expect("a message serialises"),
        counted,
    ))
}

/// The reasoning a reasoning model returned beside its reply (in a stream's delta), where
/// providers put it.
pub(super) fn reasoning_of(message: &Value) -> Option<&str> {
    ["reasoning_content", "reasoning"]
        .into_iter()
        .find_map(|field| message[field].as_str())
        .filter(|text| !text.is_empty())
}

/// A tool call's arguments as the `input` object: as written, when they are a JSON object;
/// `{}` when empty; else kept as text under `_raw`, so nothing is lost.
fn tool_input_raw(arguments: &str) -> Input<'_> {
    if arguments.trim().is_empty() {
        return Input::Value(json!({}));
    }
    match serde_json::from_str::<&RawValue>(arguments) {
        Ok(raw) if raw.get().starts_with('{') => Input::Object(raw),
        _ => Input::Value(json!({ "_raw": arguments })),
    }
}

/// The stop sequence a reply that finished with `stop` ended on, where the server named it
/// (`stop_reason`, vLLM's; chat completions itself does not say).
pub(super) fn stop_sequence<'a>(finish: Option<&str>, matched: Option<&'a str>) -> Option<&'a str> {
    matched.filter(|_| finish == Some("stop"))
}

/// Chat completions' `finish_reason` as a `stop_reason`: `stop_sequence` when the server named
/// the stop sequence that `matched`.
pub(super) fn stop_reason(finish: Option<&str>, matched: Option<&str>) -> &'static str {
    if matched.is_some() {
        return "stop_sequence";
    }
    match finish {
        Some("length") => "max_tokens",
        Some("tool_calls" | "function_call") => "tool_use",
        Some("content_filter") => "refusal",
        _ => "end_turn",
    }
}

/// Chat completions' `usage` in Anthropic's names, and the gateway's reading of it (see
/// [`written_usage`]).
pub(super) fn anthropic_usage(chat: &Value) -> (Value, TokenUsage) {
    let read: TokenUsage = serde_json::from_value(chat.clone()).unwrap_or(TokenUsage {
        malformed: true,
        ..TokenUsage::default()
    });
    (written_usage(read, || chat.clone()), read)
}

/// The usage `read` from chat completions' `chat` in Anthropic's names, which the gateway
/// reads back as exactly `read`: input outside the cache (`OpenAI` counts cached input inside
/// `prompt_tokens`), cache reads, cache writes of each duration, output, and the reasoning
/// among the output (as `output_tokens_details.reasoning_tokens`, which Anthropic's usage has
/// no name for). A report with a count that is no count is passed on in its own names, so
/// that it is read back as the same report, not trusted.
fn written_usage(read: TokenUsage, chat: impl FnOnce() -> Value) -> Value {
    if read.malformed {
        return chat();
    }
    // Only the counts reported: a count of 0 where there was none would be billed as 0
    // rather than estimated.
    let mut usage = Map::new();
    usage.insert("input_tokens".into(), json!(read.input_tokens));
    crate::protocol::translate::write_cache_writes(&read, &mut usage);
    if let Some(tokens) = read.cache_read_tokens {
        usage.insert("cache_read_input_tokens".into(), Value::from(tokens));
    }
    usage.insert("output_tokens".into(), json!(read.output_tokens));
    if let Some(reasoning) = read.reasoning_tokens {
        usage.insert(
            "output_tokens_details".into(),
            json!({ "reasoning_tokens": reasoning }),
        );
    }
    Value::Object(usage)
}
