//! A chat completion as a Gemini `GenerateContentResponse`, and chat completions' usage as
//! Google's `usageMetadata`.

use serde_json::{Map, Value, json};

use crate::protocol::TokenUsage;

/// Chat completions' `finish_reason` as Google's `finishReason`.
pub(super) fn finish_reason(finish: Option<&str>) -> &'static str {
    match finish {
        Some("length") => "MAX_TOKENS",
        Some("content_filter") => "SAFETY",
        _ => "STOP",
    }
}

/// A tool call as a `functionCall` part: its arguments as the `args` object (`{}` when empty;
/// kept as text under `_raw` when they are not a JSON object, so nothing is lost).
pub(super) fn function_call(id: &str, name: &str, arguments: &str) -> Value {
    let args = if arguments.trim().is_empty() {
        json!({})
    } else {
        match serde_json::from_str::<Value>(arguments) {
            Ok(object @ Value::Object(_)) => object,
            _ => json!({ "_raw": arguments }),
        }
    };
    let mut call = json!({ "name": name, "args": args });
    if !id.is_empty() {
        call["id"] = Value::from(id);
    }
    json!({ "functionCall": call })
}

/// The usage `read` as Google writes it: the prompt with its cached part inside it, the
/// thoughts beside the candidates (read back as the same counts). Only the counts reported.
pub(super) fn usage_metadata(read: &TokenUsage) -> Value {
    let mut usage = Map::new();
    // The prompt with its cached part inside it, where an input count was given.
    if let Some(prompt) = read.input_tokens.and(read.all_input_tokens()) {
        usage.insert("promptTokenCount".into(), Value::from(prompt));
    }
    if let Some(cached) = read.cache_read_tokens {
        usage.insert("cachedContentTokenCount".into(), Value::from(cached));
    }
    // Google's thoughts are output: without an output count there is none to split.
    if let Some(output) = read.output_tokens {
        let thoughts = read.reasoning_tokens.unwrap_or(0);
        usage.insert(
            "candidatesTokenCount".into(),
            Value::from(output.saturating_sub(thoughts).max(0)),
        );
        if let Some(thoughts) = read.reasoning_tokens {
            usage.insert("thoughtsTokenCount".into(), Value::from(thoughts));
        }
    }
    let total = read
        .all_input_tokens()
        .unwrap_or(0)
        .saturating_add(read.output_tokens.unwrap_or(0));
    usage.insert("totalTokenCount".into(), Value::from(total));
    Value::Object(usage)
}

/// The response for the chat completion `reply` to a request for `model`, named `id`, with
/// the reasoning as thought parts when `thoughts`; and the gateway's reading of its usage, as
/// a chat call reads it. `None` when `reply` is not a chat completion.
pub(super) fn response_from_chat(
    reply: &[u8],
    model: &str,
    thoughts: bool,
) -> Option<(Vec<u8>, TokenUsage)> {
    if reply.trim_ascii_start().first() != Some(&b'{') {
        return None;
    }
    let reply: Value = crate::protocol::read_json(reply).ok()?;
    let choices = reply["choices"].as_array()?;
    let read: TokenUsage = match &reply["usage"] {
        Value::Null => TokenUsage::default(),
        usage => serde_json::from_value(usage.clone()).unwrap_or(TokenUsage {
            malformed: true,
            ..TokenUsage::default()
        }),
    };
    let mut candidates = Vec::with_capacity(choices.len());
    for (at, choice) in choices.iter().enumerate() {
        let message = &choice["message"];
        let mut parts = Vec::new();
        let reasoning = ["reasoning_content", "reasoning"]
            .into_iter()
            .find_map(|field| message[field].as_str())
            .filter(|text| !text.is_empty());
        if let Some(reasoning) = reasoning.filter(|_| thoughts) {
            parts.push(json!({ "text": reasoning, "thought": true }));
        }
        for field in ["content", "refusal"] {
            if let Some(text) = message[field].as_str().filter(|text| !text.is_empty()) {
                parts.push(json!({ "text": text }));
            }
        }
        for call in message["tool_calls"].as_array().into_iter().flatten() {
            let function = &call["function"];
            parts.push(function_call(
                call["id"].as_str().unwrap_or_default(),
                function["name"].as_str().unwrap_or_default(),
                function["arguments"].as_str().unwrap_or_default(),
            ));
        }
        candidates.push(json!({
            "content": { "role": "model", "parts": parts },
            "finishReason": finish_reason(choice["finish_reason"].as_str()),
            "index": choice["index"].as_u64().unwrap_or(at as u64),
        }));
    }
    let mut response = json!({ "candidates": candidates, "modelVersion": model });
    if !reply["usage"].is_null() && !read.malformed {
        response["usageMetadata"] = usage_metadata(&read);
    }
    if let Some(id) = reply["id"].as_str() {
        response["responseId"] = Value::from(id);
    }
    Some((
        serde_json::to_vec(&response).expect("a response serialises"),
        read,
    ))
}
