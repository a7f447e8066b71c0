//! Anthropic's messages in terms of chat completions, for a messages call on a model whose
//! provider speaks only chat completions (Claude Code on GPT, `DeepSeek`, Qwen, a local model).
//!
//! Pure functions over JSON, with no I/O: [`MessagesAsChat`] turns a messages request into a
//! chat-completions request (or names the field that has no equivalent), [`MessagesAsChat::reply`]
//! turns the chat completion into a `message`, and [`ChatToMessages`] turns a chat event stream
//! into Anthropic's event sequence as its bytes arrive.
//!
//! What translates, and how:
//! - `system` (a string, or text blocks joined by blank lines) as a system message;
//! - user turns: text, images (base64 as a data URL, or a URL) and documents (a PDF as a `file`
//!   part, plain text as text) as content parts; `tool_result` blocks as `tool` messages before
//!   the rest of the turn (the images a tool returned follow in a user message: chat
//!   completions' tool messages take text only);
//! - assistant turns: text, and `tool_use` blocks as `tool_calls`; earlier `thinking` is left
//!   out (chat completions takes no reasoning back);
//! - `tools` (`input_schema` as `parameters`), `tool_choice` (`auto`, `any` as `required`,
//!   `tool` as a named function, `none`), `disable_parallel_tool_use` as
//!   `parallel_tool_calls: false`; `max_tokens`, `temperature`, `top_p`; `stop_sequences` as
//!   `stop`; `thinking` with a budget as `reasoning_effort`; `metadata.user_id` as `user`;
//!   `output_config.effort` as `reasoning_effort` and `output_config.format` (a JSON schema) as
//!   `response_format`; system messages among the turns (Claude Code sends one) as system
//!   messages; `stream` (the usage always asked: the call is billed by it); `service_tier` and
//!   `context_management` are hints for Anthropic's servers and dropped;
//! - back: reasoning (`reasoning_content`, or `reasoning`) as a `thinking` block, text as a
//!   `text` block, tool calls as `tool_use` blocks; `finish_reason` as `stop_reason` (`stop` as
//!   `end_turn`, or as `stop_sequence` with the sequence where the server names the one it
//!   matched, as vLLM does in `stop_reason`; `length` as `max_tokens`, `tool_calls` as
//!   `tool_use`, `content_filter` as `refusal`); usage in Anthropic's names (see
//!   [`ChatToMessages`] for streams);
//! - refused with the field's name: `top_k`, `container`, `mcp_servers`, and any other field
//!   chat completions has no equivalent for; blocks other than the above; Anthropic's own tools
//!   (a tool with a `type`, such as `web_search_20250305`), unless the upstream drops them
//!   ([`BuiltinTools::Drop`]).
//!
//! ```
//! use model_gateway::protocol::messages::MessagesAsChat;
//! use serde_json::{Value, json};
//!
//! let request = br#"{"model":"claude-sonnet-5-5","max_tokens":64,"system":"Be brief.",
//!                    "messages":[{"role":"user","content":"Hi"}]}"#;
//! let translated = MessagesAsChat::from_slice(request).unwrap();
//! let chat: Value = serde_json::from_slice(&translated.chat_body("gpt-5-mini")).unwrap();
//! assert_eq!(chat["messages"][0], json!({ "role": "system", "content": "Be brief." }));
//! assert_eq!(chat["max_tokens"], 64);
//!
//! let reply = br#"{"id":"chatcmpl-1","choices":[{"index":0,"finish_reason":"stop",
//!     "message":{"role":"assistant","content":"Hello!"}}],
//!     "usage":{"prompt_tokens":9,"completion_tokens":2,"prompt_tokens_details":{"cached_tokens":4}}}"#;
//! let (message, _) = translated.reply(reply, "msg_1").unwrap();
//! let message: Value = serde_json::from_slice(&message).unwrap();
//! assert_eq!(message["content"][0], json!({ "type": "text", "text": "Hello!" }));
//! assert_eq!(message["stop_reason"], "end_turn");
//! assert_eq!(message["usage"]["input_tokens"], 5);
//! assert_eq!(message["usage"]["cache_read_input_tokens"], 4);
//! ```

mod count;
mod reply;
mod request;
mod stream;
#[cfg(test)]
mod tests;

use serde_json::{Map, Value};

pub use count::local_input_tokens;
pub use stream::ChatToMessages;

use crate::protocol::translate::Untranslatable;
use crate::protocol::{BuiltinTools, TokenUsage};

/// A messages request's chat-completions translation, made once (by the router, which checks
/// it) and sent to each channel under that channel's name for the model.
#[derive(Debug, Clone)]
pub struct MessagesAsChat {
    /// The chat request without `model`.
    chat: Map<String, Value>,
    /// The model the client asked for, which the reply names.
    model: String,
    dropped: Vec<String>,
}

impl MessagesAsChat {
    /// Translates the messages `request`, refusing Anthropic's own tools.
    pub fn from_slice(request: &[u8]) -> Result<MessagesAsChat, Untranslatable> {
        MessagesAsChat::from_slice_with(request, BuiltinTools::Refuse)
    }

    /// [`MessagesAsChat::from_slice`], with Anthropic's own tools dropped or refused as
    /// `builtin` says.
    pub fn from_slice_with(
        request: &[u8],
        builtin: BuiltinTools,
    ) -> Result<MessagesAsChat, Untranslatable> {
        let request: Value = serde_json::from_slice(request).map_err(|_| Untranslatable {
            field: String::new(),
            reason: "the request is not JSON",
        })?;
        MessagesAsChat::new_with(&request, builtin)
    }

    /// Translates the messages `request` already read.
    pub fn new_with(
        request: &Value,
        builtin: BuiltinTools,
    ) -> Result<MessagesAsChat, Untranslatable> {
        let (chat, dropped) = request::chat_request(request, builtin)?;
        Ok(MessagesAsChat {
            chat,
            model: request["model"].as_str().unwrap_or_default().to_owned(),
            dropped,
        })
    }

    /// The tools the translation left out, by type, in the request's order.
    pub fn dropped_tools(&self) -> &[String] {
        &self.dropped
    }

    /// The chat-completions request calling `model`, serialised.
    pub fn chat_body(&self, model: &str) -> Vec<u8> {
        crate::protocol::translate::body_with_model(model, &self.chat)
    }

    /// The `message` for the chat completion `reply`, named `id`, and the gateway's reading
    /// of its usage, read as a chat call reads it (so that both ways charge one reply alike);
    /// `Err` when `reply` is not a chat completion.
    pub fn reply(&self, reply: &[u8], id: &str) -> Result<(Vec<u8>, TokenUsage), NotAChatReply> {
        reply::message_from_chat(reply, &self.model, id).ok_or(NotAChatReply)
    }

    /// A translator for the chat stream answering this request, its message named `id`.
    pub fn stream(&self, id: String) -> ChatToMessages {
        ChatToMessages::new(&self.model, id)
    }
}

/// A provider's complete reply that is not a chat completion.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("the provider's reply is not a chat completion")]
pub struct NotAChatReply;

/// A message id as Anthropic's look: `msg_` and 24 random letters and digits.
pub(crate) fn message_id() -> String {
    let mut id = String::with_capacity(28);
    id.push_str("msg_");
    id.extend(std::iter::repeat_with(fastrand::alphanumeric).take(24));
    id
}
