//! A chat-completions event stream, as billing reads it, and the gateway's error event in it.

use bytes::Bytes;
use serde::de::{SeqAccess, Visitor};
use serde::{Deserialize, Deserializer};

use crate::error::GatewayError;
use crate::protocol::TokenUsage;
use crate::protocol::sse::{
    DeltaHasContent, ErrorObject, Event, EventKind, StreamState, take_text,
};

/// Reads one chat chunk: `data: [DONE]` ends the stream, a chunk whose choices carry a delta
/// is content, an `error` object a failure, and `usage` is kept.
pub(crate) fn read_chat_event(event: &Event<'_>, state: &mut StreamState) -> EventKind {
    #[derive(Deserialize)]
    struct Chunk {
        #[serde(default)]
        choices: ChoicesHaveContent,
        usage: Option<TokenUsage>,
        error: Option<ErrorObject>,
        service_tier: Option<String>,
    }
    let data = event.data.trim();
    if data == "[DONE]" {
        return EventKind::End;
    }
    if data.is_empty() {
        return EventKind::Other;
    }
    let Ok(chunk) = serde_json::from_str::<Chunk>(data) else {
        return EventKind::Other;
    };
    if let Some(error) = chunk.error {
        return EventKind::Error(error.describe());
    }
    if let Some(usage) = chunk.usage {
        state.merge(crate::protocol::served_at(
            usage,
            chunk.service_tier.as_deref(),
        ));
        if chunk.choices.1 {
            state.usage_only();
        }
    }
    if chunk.choices.0 {
        EventKind::Content
    } else {
        EventKind::Other
    }
}

/// The output a chat chunk carries: text, reasoning, a refusal, a tool call's name and
/// arguments or a custom tool's input.
pub(super) fn content_text(event: &serde_json::Value, text: &mut String) {
    for choice in event["choices"].as_array().into_iter().flatten() {
        let delta = &choice["delta"];
        for field in ["content", "reasoning_content", "reasoning", "refusal"] {
            take_text(text, &delta[field]);
        }
        for call in delta["tool_calls"].as_array().into_iter().flatten() {
            take_text(text, &call["function"]["name"]);
            take_text(text, &call["function"]["arguments"]);
            take_text(text, &call["custom"]["name"]);
            take_text(text, &call["custom"]["input"]);
        }
    }
}

/// `OpenAI`'s error chunk, with the contract's text and the error's type.
pub(crate) fn openai_error_event(error: &GatewayError) -> Bytes {
    let event = format!(
        "data: {}\n\n",
        serde_json::json!({
            "error": {
                "message": error.detail(),
                "type": error.openai_type(),
                "code": null,
            },
        })
    );
    Bytes::from(event)
}

/// Whether a chat chunk's `choices` carry content: a `delta` field other than `role` whose
/// value is not empty (the first chunk usually carries only `role` and an empty `content`).
/// Read as the chunk is parsed, without building the choices. The second field: there are no
/// choices (a chunk carrying only usage).
#[derive(Debug)]
struct ChoicesHaveContent(bool, bool);

impl Default for ChoicesHaveContent {
    /// No `choices` at all: no content, no choices.
    fn default() -> Self {
        ChoicesHaveContent(false, true)
    }
}

impl<'de> Deserialize<'de> for ChoicesHaveContent {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        #[derive(Deserialize)]
        struct Choice {
            delta: Option<DeltaHasContent>,
        }
        struct Choices;
        impl<'de> Visitor<'de> for Choices {
            type Value = ChoicesHaveContent;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("a list of choices")
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut choices: A) -> Result<Self::Value, A::Error> {
                let (mut content, mut none) = (false, true);
                while let Some(choice) = choices.next_element::<Choice>()? {
                    content |= choice.delta.is_some_and(|delta| delta.0);
                    none = false;
                }
                Ok(ChoicesHaveContent(content, none))
            }
        }
        deserializer.deserialize_seq(Choices)
    }
}
