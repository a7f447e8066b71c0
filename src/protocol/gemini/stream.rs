//! A Gemini event stream (`streamGenerateContent?alt=sse`: each event a whole
//! `GenerateContentResponse`), as billing reads it, and the gateway's error event in it.

use bytes::Bytes;
use serde::Deserialize;
use serde::de::IgnoredAny;

use super::usage::UsageMetadata;
use crate::error::GatewayError;
use crate::protocol::TokenUsage;
use crate::protocol::sse::{Event, EventKind, StreamState, take_text};

/// One chunk, as far as billing reads it.
#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct Chunk {
    #[serde(default)]
    candidates: Vec<Candidate>,
    usage_metadata: Option<UsageMetadata>,
    prompt_feedback: Option<PromptFeedback>,
    error: Option<GoogleError>,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct Candidate {
    content: Option<Content>,
    finish_reason: Option<String>,
    index: Option<u64>,
}

#[derive(Deserialize)]
struct Content {
    #[serde(default)]
    parts: Vec<Part>,
}

/// A part: content when it carries text or any other output (a function call, code, data).
#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct Part {
    text: Option<String>,
    function_call: Option<IgnoredAny>,
    executable_code: Option<IgnoredAny>,
    code_execution_result: Option<IgnoredAny>,
    inline_data: Option<IgnoredAny>,
}

impl Part {
    fn is_content(&self) -> bool {
        self.text.as_deref().is_some_and(|text| !text.is_empty())
            || self.function_call.is_some()
            || self.executable_code.is_some()
            || self.code_execution_result.is_some()
            || self.inline_data.is_some()
    }
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct PromptFeedback {
    block_reason: Option<String>,
}

/// Google's error object: `{"code": 500, "message": ..., "status": "INTERNAL"}`.
#[derive(Deserialize)]
struct GoogleError {
    status: Option<String>,
    message: Option<String>,
}

/// Reads one chunk: its `usageMetadata` (the whole count so far), content in a part with
/// something in it, which candidates have finished (the stream's end is Google closing it once
/// all have: see `Dialect::ends_when_closed`), and an `error` object a failure.
pub(super) fn read_event(event: &Event<'_>, state: &mut StreamState) -> EventKind {
    let Ok(chunk) = serde_json::from_str::<Chunk>(&event.data) else {
        return EventKind::Other;
    };
    if let Some(error) = chunk.error {
        return EventKind::Error(match (error.status, error.message) {
            (Some(status), Some(message)) => format!("{status}: {message}"),
            (status, message) => message.or(status).unwrap_or_default(),
        });
    }
    if let Some(usage) = chunk.usage_metadata {
        state.merge(TokenUsage::from(usage));
    }
    for candidate in &chunk.candidates {
        let index = candidate.index.unwrap_or(0);
        if candidate.finish_reason.is_some() {
            state.unfinished.retain(|open| *open != index);
            if !state.finished.contains(&index) {
                state.finished.push(index);
            }
        } else if !state.finished.contains(&index) && !state.unfinished.contains(&index) {
            state.unfinished.push(index);
        }
    }
    if chunk.candidates.is_empty()
        && chunk
            .prompt_feedback
            .is_some_and(|feedback| feedback.block_reason.is_some())
    {
        // A blocked prompt answers no candidate: that is the whole reply.
        state.finished.push(0);
    }
    let content = chunk.candidates.iter().any(|candidate| {
        candidate
            .content
            .as_ref()
            .is_some_and(|content| content.parts.iter().any(Part::is_content))
    });
    if content {
        EventKind::Content
    } else {
        EventKind::Other
    }
}

/// The output a chunk carries: its parts' text, and each function call's name and arguments.
pub(super) fn content_text(event: &serde_json::Value, text: &mut String) {
    let Some(candidates) = event["candidates"].as_array() else {
        return;
    };
    for candidate in candidates {
        let Some(parts) = candidate["content"]["parts"].as_array() else {
            continue;
        };
        for part in parts {
            part_text(part, text);
        }
    }
}

/// A part's text, and a function call's or response's name and JSON.
pub(super) fn part_text(part: &serde_json::Value, text: &mut String) {
    take_text(text, &part["text"]);
    for (field, value) in [("functionCall", "args"), ("functionResponse", "response")] {
        let call = &part[field];
        take_text(text, &call["name"]);
        if !call[value].is_null() {
            text.push_str(&call[value].to_string());
        }
    }
}

/// Google's error object as a last event, with the contract's text.
pub(super) fn error_event(error: &GatewayError) -> Bytes {
    let event = format!(
        "data: {}\r\n\r\n",
        serde_json::json!({
            "error": {
                "code": error.status().as_u16(),
                "message": error.detail(),
                "status": error.google_status(),
            }
        })
    );
    Bytes::from(event)
}
