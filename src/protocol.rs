//! The two wire protocols the gateway speaks.

use serde::{Deserialize, Serialize};

/// Which API style a call uses; decided by the request path.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Protocol {
    /// OpenAI chat completions: `POST /v1/chat/completions`.
    ChatCompletions,
    /// Anthropic messages: `POST /v1/messages`.
    Messages,
}

impl Protocol {
    /// The endpoint path clients call.
    pub fn path(self) -> &'static str {
        match self {
            Protocol::ChatCompletions => "/v1/chat/completions",
            Protocol::Messages => "/v1/messages",
        }
    }

    /// The protocol served at `path`, if any.
    pub fn from_path(path: &str) -> Option<Protocol> {
        match path {
            "/v1/chat/completions" => Some(Protocol::ChatCompletions),
            "/v1/messages" => Some(Protocol::Messages),
            _ => None,
        }
    }

    /// The name stored in the call log.
    pub fn as_str(self) -> &'static str {
        match self {
            Protocol::ChatCompletions => "chat_completions",
            Protocol::Messages => "messages",
        }
    }

    /// Parses the stored name.
    pub fn parse(name: &str) -> Option<Protocol> {
        match name {
            "chat_completions" => Some(Protocol::ChatCompletions),
            "messages" => Some(Protocol::Messages),
            _ => None,
        }
    }
}
