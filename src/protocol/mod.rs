//! The wire protocols the gateway speaks (`OpenAI`'s chat completions, responses and embeddings,
//! Anthropic's messages), and what their replies say: token usage and the provider's own error message. Its
//! `sse` module (inside the crate) reads their event streams.

use serde::{Deserialize, Serialize};

pub mod responses;
pub(crate) mod sse;

/// Which API style a call uses; decided by the request path. More may come: match with a `_`
/// arm.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
#[non_exhaustive]
pub enum Protocol {
    /// `OpenAI` chat completions: `POST /v1/chat/completions`.
    ChatCompletions,
    /// Anthropic messages: `POST /v1/messages`.
    Messages,
    /// `OpenAI` embeddings: `POST /v1/embeddings`, never streamed.
    Embeddings,
    /// `OpenAI` responses: `POST /v1/responses`, served by the chat-completions models.
    Responses,
}

impl Protocol {
    /// The endpoint path clients call.
    pub fn path(self) -> &'static str {
        match self {
            Protocol::ChatCompletions => "/v1/chat/completions",
            Protocol::Messages => "/v1/messages",
            Protocol::Embeddings => "/v1/embeddings",
            Protocol::Responses => "/v1/responses",
        }
    }

    /// The protocol served at `path`, if any.
    pub fn from_path(path: &str) -> Option<Protocol> {
        match path {
            "/v1/chat/completions" => Some(Protocol::ChatCompletions),
            "/v1/messages" => Some(Protocol::Messages),
            "/v1/embeddings" => Some(Protocol::Embeddings),
            "/v1/responses" => Some(Protocol::Responses),
            _ => None,
        }
    }

    /// The name stored in the call log.
    pub fn as_str(self) -> &'static str {
        match self {
            Protocol::ChatCompletions => "chat_completions",
            Protocol::Messages => "messages",
            Protocol::Embeddings => "embeddings",
            Protocol::Responses => "responses",
        }
    }

    /// The protocol of the catalogue models this endpoint serves: the chat-completions models
    /// also answer `/v1/responses`.
    pub fn models_protocol(self) -> Protocol {
        match self {
            Protocol::Responses => Protocol::ChatCompletions,
            other => other,
        }
    }

    /// Parses the stored name.
    pub fn parse(name: &str) -> Option<Protocol> {
        match name {
            "chat_completions" => Some(Protocol::ChatCompletions),
            "messages" => Some(Protocol::Messages),
            "embeddings" => Some(Protocol::Embeddings),
            "responses" => Some(Protocol::Responses),
            _ => None,
        }
    }
}

/// Token counts as the upstream reported them. Reads both protocols' names (`input_tokens` or
/// `prompt_tokens`, `output_tokens` or `completion_tokens`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct TokenUsage {
    /// Prompt (input) tokens.
    #[serde(alias = "prompt_tokens")]
    pub input_tokens: Option<i64>,
    /// Completion (output) tokens.
    #[serde(alias = "completion_tokens")]
    pub output_tokens: Option<i64>,
}

/// Token usage from a reply of either protocol; `None` if the body is not a JSON object.
pub fn reply_usage(body: &[u8]) -> Option<TokenUsage> {
    #[derive(Deserialize)]
    struct Reply {
        #[serde(default)]
        usage: Option<TokenUsage>,
    }
    if body.trim_ascii_start().first() != Some(&b'{') {
        return None;
    }
    let reply: Reply = serde_json::from_slice(body).ok()?;
    Some(reply.usage.unwrap_or_default())
}

/// Longest provider message passed on to a client.
const CLIENT_MESSAGE_CHARS: usize = 300;

/// The provider's own error message: `{"error":{"message":...}}` (both `OpenAI` and Anthropic),
/// `{"error":"..."}` or `{"message":"..."}`.
pub(crate) fn provider_message(body: &[u8]) -> Option<String> {
    #[derive(Deserialize)]
    #[serde(untagged)]
    enum ErrorField {
        Text(String),
        Object { message: String },
    }
    #[derive(Deserialize)]
    struct ErrorBody {
        error: Option<ErrorField>,
        message: Option<String>,
    }
    let parsed: ErrorBody = serde_json::from_slice(body).ok()?;
    let message = match parsed.error {
        Some(ErrorField::Text(text)) | Some(ErrorField::Object { message: text }) => text,
        None => parsed.message?,
    };
    let message = message.trim();
    (!message.is_empty()).then(|| message.chars().take(CLIENT_MESSAGE_CHARS).collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn usage_is_read_from_both_reply_shapes() {
        let chat = br#"{"usage":{"prompt_tokens":3,"completion_tokens":4,"total_tokens":7}}"#;
        assert_eq!(
            reply_usage(chat),
            Some(TokenUsage {
                input_tokens: Some(3),
                output_tokens: Some(4)
            })
        );
        let messages = br#"{"type":"message","usage":{"input_tokens":5,"output_tokens":6}}"#;
        assert_eq!(
            reply_usage(messages),
            Some(TokenUsage {
                input_tokens: Some(5),
                output_tokens: Some(6)
            })
        );
        assert_eq!(reply_usage(b"{}"), Some(TokenUsage::default()));
    }

    #[test]
    fn provider_messages_are_read_from_both_error_shapes() {
        let openai =
            br#"{"error":{"message":"Invalid 'messages[0].role'","type":"invalid_request_error"}}"#;
        assert_eq!(
            provider_message(openai).as_deref(),
            Some("Invalid 'messages[0].role'")
        );
        let anthropic = br#"{"type":"error","error":{"type":"invalid_request_error","message":"max_tokens: too large"}}"#;
        assert_eq!(
            provider_message(anthropic).as_deref(),
            Some("max_tokens: too large")
        );
        assert_eq!(
            provider_message(br#"{"message":"plain"}"#).as_deref(),
            Some("plain")
        );
        assert_eq!(provider_message(b"<html>"), None);
    }
}
