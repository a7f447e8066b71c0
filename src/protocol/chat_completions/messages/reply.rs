//! A messages reply as a chat completion, and Anthropic's usage in chat completions' names.
//!
//! The reply is read once, borrowed, and the completion written from what was read: this is on
//! the path of every translated call.

use std::borrow::Cow;

use serde::{Deserialize, Serialize};
use serde_json::value::RawValue;
use serde_json::{Map, Value, json};

use crate::protocol::TokenUsage;

#[derive(Deserialize)]
struct MessageReply<'a> {
    #[serde(borrow)]
    content: Vec<Block<'a>>,
    #[serde(borrow, default)]
    stop_reason: Option<Cow<'a, str>>,
    #[serde(borrow, default)]
    usage: Option<&'a RawValue>,
}

#[derive(Deserialize)]
struct Block<'a> {
    #[serde(rename = "type", borrow)]
    kind: Cow<'a, str>,
    #[serde(borrow, default)]
    text: Option<Cow<'a, str>>,
    #[serde(borrow, default)]
    thinking: Option<Cow<'a, str>>,
    #[serde(borrow, default)]
    id: Option<Cow<'a, str>>,
    #[serde(borrow, default)]
    name: Option<Cow<'a, str>>,
    #[serde(borrow, default)]
    input: Option<&'a RawValue>,
}

#[derive(Serialize)]
struct Completion<'a> {
    id: String,
    object: &'static str,
    created: u64,
    model: &'a str,
    choices: [Choice<'a>; 1],
    usage: Value,
}

#[derive(Serialize)]
struct Choice<'a> {
    index: u32,
    message: ChatMessage<'a>,
    logprobs: Option<()>,
    finish_reason: &'static str,
}

#[derive(Serialize)]
struct ChatMessage<'a> {
    role: &'static str,
    content: Option<String>,
    refusal: Option<()>,
    #[serde(skip_serializing_if = "Option::is_none")]
    reasoning_content: Option<String>,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    tool_calls: Vec<ToolCall<'a>>,
}

#[derive(Serialize)]
pub(super) struct ToolCall<'a> {
    pub(super) id: &'a str,
    #[serde(rename = "type")]
    pub(super) kind: &'static str,
    pub(super) function: Function<'a>,
}

#[derive(Serialize)]
pub(super) struct Function<'a> {
    pub(super) name: &'a str,
    pub(super) arguments: &'a str,
}

/// The chat completion for the messages `reply` to a request for `model`, named `id`, and
/// the gateway's reading of its usage (as a messages call reads it, so that both ways charge
/// one reply alike); `None` when `reply` is not a message.
pub(super) fn completion_from_message(
    reply: &[u8],
    model: &str,
    id: String,
    created: u64,
) -> Option<(Vec<u8>, TokenUsage)> {
    if reply.trim_ascii_start().first() != Some(&b'{') {
        return None;
    }
    let read: MessageReply<'_> = crate::protocol::read_json(reply).ok()?;
    let (usage, counted) = match read.usage.filter(|usage| usage.get() != "null") {
        Some(raw) => {
            let counted: TokenUsage = serde_json::from_str(raw.get()).ok()?;
            let anthropic = || serde_json::from_str(raw.get()).unwrap_or(Value::Null);
            (chat_usage(counted, anthropic), counted)
        }
        None => (json!({}), TokenUsage::default()),
    };
    let mut text: Option<String> = None;
    let mut reasoning: Option<String> = None;
    let mut tool_calls = Vec::new();
    for block in &read.content {
        match block.kind.as_ref() {
            "text" => text
                .get_or_insert_default()
                .push_str(block.text.as_deref().unwrap_or_default()),
            "thinking" => reasoning
                .get_or_insert_default()
                .push_str(block.thinking.as_deref().unwrap_or_default()),
            "tool_use" => tool_calls.push(ToolCall {
                id: block.id.as_deref().unwrap_or_default(),
                kind: "function",
                function: Function {
                    name: block.name.as_deref().unwrap_or_default(),
                    arguments: block.input.map_or("{}", RawValue::get),
                },
            }),
            // Redacted thinking, and the blocks of Anthropic's own tools (never asked for).
            _ => {}
        }
    }
    let completion = Completion {
        id,
        object: "chat.completion",
        created,
        model,
        choices: [Choice {
            index: 0,
            message: ChatMessage {
                role: "assistant",
                content: text,
                refusal: None,
                reasoning_content: reasoning,
                tool_calls,
            },
            logprobs: None,
            finish_reason: finish_reason(read.stop_reason.as_deref()),
        }],
        usage,
    };
    Some((
        serde_json::to_vec(&completion).expect("a completion serialises"),
        counted,
    ))
}

/// Anthropic's `stop_reason` as a `finish_reason`.
pub(super) fn finish_reason(stop: Option<&str>) -> &'static str {
    match stop {
        Some("max_tokens" | "model_context_window_exceeded") => "length",
        Some("tool_use") => "tool_calls",
        Some("refusal") => "content_filter",
        _ => "stop",
    }
}

/// The usage `read` from Anthropic's `anthropic` in chat completions' names, which the gateway
/// reads back as exactly `read`: `prompt_tokens` the input and the cache reads (inside it, as
/// `OpenAI` counts them, in `prompt_tokens_details.cached_tokens`), the cache writes beside it
/// in Anthropic's names (`cache_creation_input_tokens` and its split), `completion_tokens` the
/// output. A report with a count that is no count is passed on in its own names, so that it is
/// read back as the same report, not trusted.
pub(in crate::protocol::chat_completions) fn chat_usage(
    read: TokenUsage,
    anthropic: impl FnOnce() -> Value,
) -> Value {
    if read.malformed {
        return anthropic();
    }
    let mut usage = Map::new();
    match (read.input_tokens, read.cache_read_tokens) {
        (Some(input), Some(cached)) if cached > 0 => {
            usage.insert(
                "prompt_tokens".into(),
                Value::from(input.saturating_add(cached)),
            );
            usage.insert(
                "prompt_tokens_details".into(),
                json!({ "cached_tokens": cached }),
            );
        }
        (input, cached) => {
            if let Some(input) = input {
                usage.insert("prompt_tokens".into(), Value::from(input));
            }
            if let Some(cached) = cached {
                usage.insert("cache_read_input_tokens".into(), Value::from(cached));
            }
        }
    }
    if let Some(output) = read.output_tokens {
        usage.insert("completion_tokens".into(), Value::from(output));
    }
    if let (Some(prompt), Some(output)) = (usage.get("prompt_tokens"), read.output_tokens) {
        let total = prompt.as_i64().unwrap_or(0).saturating_add(output);
        usage.insert("total_tokens".into(), Value::from(total));
    }
    if let Some(reasoning) = read.reasoning_tokens {
        usage.insert(
            "completion_tokens_details".into(),
            json!({ "reasoning_tokens": reasoning }),
        );
    }
    crate::protocol::translate::write_cache_writes(&read, &mut usage);
    Value::Object(usage)
}
