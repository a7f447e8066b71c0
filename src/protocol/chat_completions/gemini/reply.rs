//! A Gemini `GenerateContentResponse` as a chat completion, and Google's usage in chat
//! completions' names.

use serde_json::{Value, json};

use crate::protocol::TokenUsage;
use crate::protocol::chat_completions::messages::chat_usage;

/// Google's `finishReason` as chat completions' `finish_reason` (`tool_calls` where the
/// candidate called functions).
pub(super) fn finish_reason(finish: Option<&str>, called: bool) -> &'static str {
    match finish {
        Some("MAX_TOKENS") => "length",
        Some(
            "SAFETY" | "RECITATION" | "BLOCKLIST" | "PROHIBITED_CONTENT" | "SPII" | "IMAGE_SAFETY",
        ) => "content_filter",
        _ if called => "tool_calls",
        _ => "stop",
    }
}

/// Google's `usageMetadata` as the gateway reads it, and in chat completions' names (read back
/// as the same counts; a report not to be trusted passed on in Google's names).
pub(super) fn usage_of(metadata: &Value) -> (TokenUsage, Value) {
    let read: TokenUsage =
        crate::protocol::reply_usage(json!({ "usageMetadata": metadata }).to_string().as_bytes())
            .unwrap_or_default();
    (read, chat_usage(read, || metadata.clone()))
}

/// The parts of a candidate's content: its text, its thoughts, and its function calls, each
/// given the id `call_{first}`, `call_{first + 1}`, ... where Google gave none.
pub(super) struct Said {
    pub(super) text: String,
    pub(super) thoughts: String,
    pub(super) calls: Vec<Value>,
}

pub(super) fn said(candidate: &Value, first_call: usize) -> Said {
    let mut said = Said {
        text: String::new(),
        thoughts: String::new(),
        calls: Vec::new(),
    };
    for part in candidate["content"]["parts"]
        .as_array()
        .into_iter()
        .flatten()
    {
        if let Some(text) = part["text"].as_str() {
            if part["thought"] == Value::Bool(true) {
                said.thoughts.push_str(text);
            } else {
                said.text.push_str(text);
            }
        } else if let Some(call) = part.get("functionCall") {
            let number = first_call + said.calls.len();
            let id = call["id"]
                .as_str()
                .filter(|id| !id.is_empty())
                .map_or_else(|| format!("call_{number}"), str::to_owned);
            let args = match &call["args"] {
                Value::Null => "{}".to_owned(),
                args => args.to_string(),
            };
            said.calls.push(json!({
                "id": id, "type": "function",
                "function": { "name": call["name"], "arguments": args },
            }));
        }
    }
    said
}

/// The chat completion for the Gemini `reply` to a request for `model`, named `id`, made at
/// `created` (Unix seconds), and the gateway's reading of its usage, read as a Gemini call
/// reads it; `None` when `reply` is not a Gemini response.
pub(super) fn completion_from_response(
    reply: &[u8],
    model: &str,
    id: String,
    created: u64,
) -> Option<(Vec<u8>, TokenUsage)> {
    if reply.trim_ascii_start().first() != Some(&b'{') {
        return None;
    }
    let reply: Value = crate::protocol::read_json(reply).ok()?;
    let candidates = match &reply["candidates"] {
        Value::Array(candidates) => candidates.as_slice(),
        // A prompt Google blocked answers no candidate, only its feedback.
        Value::Null if reply.get("promptFeedback").is_some() => &[],
        _ => return None,
    };
    let (usage, written) = match reply.get("usageMetadata") {
        Some(metadata) => {
            let (read, written) = usage_of(metadata);
            (read, Some(written))
        }
        None => (TokenUsage::default(), None),
    };
    let mut choices = Vec::with_capacity(candidates.len().max(1));
    for (at, candidate) in candidates.iter().enumerate() {
        let said = said(candidate, 0);
        let called = !said.calls.is_empty();
        let mut message = json!({ "role": "assistant", "content": null });
        if !said.text.is_empty() {
            message["content"] = Value::from(said.text);
        }
        if !said.thoughts.is_empty() {
            message["reasoning_content"] = Value::from(said.thoughts);
        }
        if called {
            message["tool_calls"] = Value::Array(said.calls);
        }
        choices.push(json!({
            "index": candidate["index"].as_u64().unwrap_or(at as u64),
            "message": message,
            "finish_reason": finish_reason(candidate["finishReason"].as_str(), called),
        }));
    }
    if choices.is_empty() {
        choices.push(json!({
            "index": 0,
            "message": { "role": "assistant", "content": null },
            "finish_reason": "content_filter",
        }));
    }
    let mut completion = json!({
        "id": id, "object": "chat.completion", "created": created, "model": model,
        "choices": choices,
    });
    if let Some(written) = written {
        completion["usage"] = written;
    }
    Some((
        serde_json::to_vec(&completion).expect("a completion serialises"),
        usage,
    ))
}
