//! `OpenAI`'s chat completions in terms of Anthropic's messages, for a chat-completions (or,
//! composed with [`responses`](crate::protocol::responses), a Responses) call on a model whose
//! provider speaks only messages: the OpenAI SDKs, the Agents SDK and Codex on Claude.
//!
//! Pure functions over JSON, with no I/O: [`ChatAsMessages`] turns a chat-completions request
//! into a messages request (or names the field that has no equivalent),
//! [`ChatAsMessages::reply`] turns the message into a chat completion, and [`MessagesToChat`]
//! turns a messages event stream into chat completion chunks as its bytes arrive.
//!
//! What translates, and how:
//! - system and developer messages before the first turn as `system` blocks (a later one as a
//!   system turn); user text, images (a data URL as base64, else by URL) and PDF files (as a
//!   `document`); assistant text and `tool_calls` as `tool_use` blocks; `tool` messages as
//!   `tool_result` blocks of a user turn; consecutive turns of one role joined;
//! - function `tools` (`parameters` as `input_schema`), `tool_choice` (`required` as `any`, a
//!   function as `tool`), `parallel_tool_calls: false` as `disable_parallel_tool_use`;
//!   `max_completion_tokens` or `max_tokens` as `max_tokens` (Anthropic requires one: else the
//!   model's `max_output_tokens`, else 8,192); `temperature` (0 to 1, Anthropic's range),
//!   `top_p`; `stop` as `stop_sequences`; `user` or `safety_identifier` as
//!   `metadata.user_id`; `reasoning_effort` as extended thinking with a budget below the
//!   output limit; `response_format` with a JSON schema as `output_config.format`; `stream`;
//! - back: text as `content`, thinking as `reasoning_content`, `tool_use` blocks as
//!   `tool_calls`; `stop_reason` as `finish_reason`; usage in chat completions' names
//!   (`prompt_tokens` with the cache reads inside it, as `OpenAI` counts them; cache writes
//!   beside it in Anthropic's names);
//! - dropped as hints: `store`, `metadata`, `service_tier`, `prompt_cache_key`,
//!   `prompt_cache_retention`, `verbosity`, `modalities`; `n: 1`, `logprobs: false` and zero
//!   penalties are the defaults;
//! - refused with the field's name: custom tools, `n` above 1, `logprobs`, penalties, `seed`,
//!   `logit_bias`, `audio`, `prediction`, `response_format: json_object`, a temperature above
//!   1, parts other than text, images and data files, and any other field; web search
//!   (`web_search_options`) is dropped or refused as the upstream's `builtin_tools` says.

mod reply;
mod request;
mod stream;
#[cfg(test)]
mod tests;

use serde_json::{Map, Value};

pub(in crate::protocol::chat_completions) use reply::chat_usage;
pub use stream::MessagesToChat;

use crate::protocol::translate::Untranslatable;
use crate::protocol::{BuiltinTools, TokenUsage};

/// A chat-completions request's messages translation, made once (by the router, which checks
/// it) and sent to each Anthropic channel under that channel's name for the model.
#[derive(Debug, Clone)]
pub struct ChatAsMessages {
    /// The messages request without `model`.
    messages: Map<String, Value>,
    /// The model the client asked for, which the reply names.
    model: String,
    dropped: Vec<String>,
}

/// A provider's complete reply that is not a message.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("the provider's reply is not a message")]
pub struct NotAMessage;

impl ChatAsMessages {
    /// Translates the chat-completions `request`, its output limit `max_tokens` where it sets
    /// none, its built-in web search dropped or refused as `builtin` says.
    pub fn new_with(
        request: &Value,
        builtin: BuiltinTools,
        max_tokens: Option<u64>,
    ) -> Result<ChatAsMessages, Untranslatable> {
        let translated = request::messages_request(request, builtin, max_tokens)?;
        Ok(ChatAsMessages {
            messages: translated.body,
            model: request["model"].as_str().unwrap_or_default().to_owned(),
            dropped: translated.dropped,
        })
    }

    /// [`ChatAsMessages::new_with`] from the request's bytes.
    pub fn from_slice_with(
        request: &[u8],
        builtin: BuiltinTools,
        max_tokens: Option<u64>,
    ) -> Result<ChatAsMessages, Untranslatable> {
        let request: Value = serde_json::from_slice(request).map_err(|_| Untranslatable {
            field: String::new(),
            reason: "the request is not JSON",
        })?;
        ChatAsMessages::new_with(&request, builtin, max_tokens)
    }

    /// The tools the translation left out, by type, in the request's order.
    pub fn dropped_tools(&self) -> &[String] {
        &self.dropped
    }

    /// The messages request calling `model`, serialised.
    pub fn messages_body(&self, model: &str) -> Vec<u8> {
        crate::protocol::translate::body_with_model(model, &self.messages)
    }

    /// The chat completion for the message `reply`, named `id`, made at `created` (Unix
    /// seconds), and the gateway's reading of its usage, read as a messages call reads it;
    /// `Err` when `reply` is not a message.
    pub fn reply(
        &self,
        reply: &[u8],
        id: String,
        created: u64,
    ) -> Result<(Vec<u8>, TokenUsage), NotAMessage> {
        reply::completion_from_message(reply, &self.model, id, created).ok_or(NotAMessage)
    }

    /// A translator for the messages stream answering this request, its chunks named `id`.
    pub fn stream(&self, id: String, created: u64) -> MessagesToChat {
        MessagesToChat::new(&self.model, id, created)
    }
}

/// A chat completion id as `OpenAI`'s look: `chatcmpl-` and 29 random letters and digits.
pub(crate) fn completion_id() -> String {
    let mut id = String::with_capacity(38);
    id.push_str("chatcmpl-");
    id.extend(std::iter::repeat_with(fastrand::alphanumeric).take(29));
    id
}
