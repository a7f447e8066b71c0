//! Chat completions in terms of Google's Gemini API, for a chat-completions call (or a
//! Responses or messages call, through chat completions) on a model whose provider speaks the
//! Gemini API.
//!
//! Pure functions over JSON, with no I/O: [`ChatAsGemini`] turns a chat-completions request into
//! a Gemini request (or names the field that has no equivalent), [`ChatAsGemini::reply`] turns
//! Google's response into a chat completion, and [`GeminiToChat`] turns Google's event stream
//! into chat chunks as its bytes arrive.
//!
//! What translates, and how:
//! - system and developer messages as `systemInstruction`; user messages' text, images and
//!   files given as data URLs (`inlineData`) and `input_audio`; assistant messages' text and
//!   tool calls (`functionCall`, their arguments as `args`); tool messages as `functionResponse`
//!   parts named by the call they answer (a JSON object result as `response`, else
//!   `{"result": ...}`); messages of one role in a row joined into one content;
//! - function `tools` as `functionDeclarations` (their JSON Schema as `parametersJsonSchema`),
//!   `tool_choice` as `functionCallingConfig` (`auto` `AUTO`, `none` `NONE`, `required` `ANY`, a
//!   function `ANY` with it alone allowed);
//! - `max_completion_tokens` or `max_tokens` (else the model's `max_output_tokens`) as
//!   `maxOutputTokens`, `temperature`, `top_p`, `stop`, `n`, the penalties, `seed`, `logprobs`
//!   and `top_logprobs`, `response_format` (JSON, with its schema as `responseJsonSchema`),
//!   `reasoning_effort` as a `thinkingBudget`; `user`, `store`, `metadata`, `service_tier`,
//!   `parallel_tool_calls` and the prompt cache hints are left out;
//! - back: text as `content`, thoughts as `reasoning_content`, function calls as tool calls
//!   (Google's id, else `call_0`, `call_1`, ...); `finishReason` as `finish_reason`
//!   (`MAX_TOKENS` `length`, the safety reasons `content_filter`, else `stop`, or `tool_calls`
//!   with calls); `usageMetadata` as `usage` (see [`crate::protocol::TokenUsage`]);
//! - refused with the field's name: images by URL, audio output, custom tools, and any other
//!   field the Gemini API has no equivalent for; web search follows [`BuiltinTools`].

mod reply;
mod request;
mod stream;
#[cfg(test)]
mod tests;

use serde_json::{Map, Value};

pub use stream::GeminiToChat;

use crate::protocol::translate::Untranslatable;
use crate::protocol::{BuiltinTools, TokenUsage};

/// A chat-completions request's Gemini translation, made once (by the router, which checks it)
/// and sent to each Gemini channel (the model in the call's path).
#[derive(Debug, Clone)]
pub struct ChatAsGemini {
    /// The Gemini request.
    body: Map<String, Value>,
    /// The model the client asked for, which the reply names.
    model: String,
    dropped: Vec<String>,
}

/// A provider's complete reply that is not a Gemini response.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("the provider's reply is not a Gemini response")]
pub struct NotAGeminiResponse;

impl ChatAsGemini {
    /// Translates the chat-completions `request`, its output limit `max_tokens` where it sets
    /// none, its web search dropped or refused as `builtin` says.
    pub fn from_slice_with(
        request: &[u8],
        builtin: BuiltinTools,
        max_tokens: Option<u64>,
    ) -> Result<ChatAsGemini, Untranslatable> {
        let request: Value = crate::protocol::read_json(request).map_err(|_| Untranslatable {
            field: String::new(),
            reason: "the request is not JSON",
        })?;
        let translated = request::gemini_request(&request, builtin, max_tokens)?;
        Ok(ChatAsGemini {
            body: translated.body,
            model: request["model"].as_str().unwrap_or_default().to_owned(),
            dropped: translated.dropped,
        })
    }

    /// The tools the translation left out, by type, in the request's order.
    pub fn dropped_tools(&self) -> &[String] {
        &self.dropped
    }

    /// The Gemini request, serialised.
    pub fn gemini_body(&self) -> Vec<u8> {
        serde_json::to_vec(&self.body).expect("a JSON object serialises")
    }

    /// The chat completion for Google's `reply`, named `id`, made at `created` (Unix seconds),
    /// and the gateway's reading of its usage, read as a Gemini call reads it; `Err` when
    /// `reply` is not a Gemini response.
    pub fn reply(
        &self,
        reply: &[u8],
        id: String,
        created: u64,
    ) -> Result<(Vec<u8>, TokenUsage), NotAGeminiResponse> {
        reply::completion_from_response(reply, &self.model, id, created).ok_or(NotAGeminiResponse)
    }

    /// A translator for Google's stream answering this request, its chunks named `id`.
    pub fn stream(&self, id: String, created: u64) -> GeminiToChat {
        GeminiToChat::new(&self.model, id, created)
    }
}
