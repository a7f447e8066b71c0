//! A chat completion as a messages reply, and chat completions' usage in Anthropic's names.

use serde_json::{Map, Value, json};

use crate::protocol::TokenUsage;

/// The `message` for the chat completion `reply` to a request for `model`; `None` when `reply`
/// is not a chat completion.
pub(super) fn message_from_chat(reply: &Value, model: &str, id: &str) -> Option<Value> {
    let choice = reply.get("choices")?.as_array()?.first()?;
    let message = &choice["message"];
    let mut content = Vec::new();
    if let Some(thinking) = reasoning_of(message) {
        content.push(json!({ "type": "thinking", "thinking": thinking, "signature": "" }));
    }
    if let Some(text) = message["content"].as_str().filter(|text| !text.is_empty()) {
        content.push(json!({ "type": "text", "text": text }));
    }
    if let Some(refusal) = message["refusal"].as_str().filter(|text| !text.is_empty()) {
        content.push(json!({ "type": "text", "text": refusal }));
    }
    for call in message["tool_calls"].as_array().into_iter().flatten() {
        let function = &call["function"];
        content.push(json!({
            "type": "tool_use",
            "id": call["id"].as_str().unwrap_or_default(),
            "name": function["name"].as_str().unwrap_or_default(),
            "input": tool_input(function["arguments"].as_str().unwrap_or_default()),
        }));
    }
    let usage = match reply.get("usage").filter(|usage| usage.is_object()) {
        Some(chat) => anthropic_usage(chat).0,
        // No counts: the gateway estimates them, as for an untranslated reply without usage.
        None => json!({ "input_tokens": null, "output_tokens": null }),
    };
    let message = json!({
        "id": id,
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": content,
        "stop_reason": stop_reason(choice["finish_reason"].as_str()),
        "stop_sequence": null,
        "usage": usage,
    });
    Some(message)
}

/// The reasoning a reasoning model returned beside its reply, where providers put it.
pub(super) fn reasoning_of(message: &Value) -> Option<&str> {
    ["reasoning_content", "reasoning"]
        .into_iter()
        .find_map(|field| message[field].as_str())
        .filter(|text| !text.is_empty())
}

/// A tool call's arguments as the `input` object: parsed, or, when the provider wrote
/// something that is not a JSON object, kept as text under `_raw` so nothing is lost.
pub(super) fn tool_input(arguments: &str) -> Value {
    if arguments.trim().is_empty() {
        return json!({});
    }
    match serde_json::from_str::<Value>(arguments) {
        Ok(input @ Value::Object(_)) => input,
        _ => json!({ "_raw": arguments }),
    }
}

/// Chat completions' `finish_reason` as a `stop_reason`.
pub(super) fn stop_reason(finish: Option<&str>) -> &'static str {
    match finish {
        Some("length") => "max_tokens",
        Some("tool_calls" | "function_call") => "tool_use",
        Some("content_filter") => "refusal",
        _ => "end_turn",
    }
}

/// Chat completions' `usage` in Anthropic's names, and the gateway's reading of it, which
/// the translated usage reads back as exactly: input outside the cache (`OpenAI` counts cached
/// input inside `prompt_tokens`), cache reads, cache writes of each duration, output, and the
/// reasoning among the output (as `output_tokens_details.reasoning_tokens`, which Anthropic's
/// usage has no name for). A report with a count that is no count is passed on in its own
/// names, so that it is read back as the same report, not trusted.
pub(super) fn anthropic_usage(chat: &Value) -> (Value, TokenUsage) {
    let read: TokenUsage = serde_json::from_value(chat.clone()).unwrap_or(TokenUsage {
        malformed: true,
        ..TokenUsage::default()
    });
    if read.malformed {
        return (chat.clone(), read);
    }
    // Only the counts reported: a count of 0 where there was none would be billed as 0
    // rather than estimated.
    let mut usage = Map::new();
    usage.insert("input_tokens".into(), json!(read.input_tokens));
    if read.cache_write_tokens.is_some() || read.cache_write_1h_tokens.is_some() {
        let total = read
            .cache_write_tokens
            .unwrap_or(0)
            .saturating_add(read.cache_write_1h_tokens.unwrap_or(0));
        usage.insert("cache_creation_input_tokens".into(), Value::from(total));
        let mut split = Map::new();
        if let Some(tokens) = read.cache_write_tokens {
            split.insert("ephemeral_5m_input_tokens".into(), Value::from(tokens));
        }
        if let Some(tokens) = read.cache_write_1h_tokens {
            split.insert("ephemeral_1h_input_tokens".into(), Value::from(tokens));
        }
        usage.insert("cache_creation".into(), Value::Object(split));
    }
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
    (Value::Object(usage), read)
}
