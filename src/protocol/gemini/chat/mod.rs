//! Google's Gemini API in terms of chat completions, for a Gemini client (`google-genai`, the
//! Gemini CLI) on a model whose provider speaks chat completions (or, through them, Anthropic's
//! messages).
//!
//! Pure functions over JSON, with no I/O: [`GeminiAsChat`] turns a Gemini request into a
//! chat-completions request (or names the field that has no equivalent),
//! [`GeminiAsChat::reply`] turns the chat completion into a `GenerateContentResponse`, and
//! [`ChatToGemini`] turns a chat event stream into Google's server-sent events as its bytes
//! arrive.
//!
//! What translates, and how:
//! - `systemInstruction` (its text parts joined by lines) as a system message;
//! - user turns: text, `inlineData` (an image as a data URL, a PDF as a `file` part) and
//!   `fileData` (an image at an http(s) address) as content parts; `functionResponse` parts as
//!   `tool` messages before the rest of the turn (their `response` as JSON text), each answering
//!   the function call of its `id`, else the first unanswered one of its `name`;
//! - model turns: text, and `functionCall` parts as `tool_calls` (given an id where Google's
//!   gave none); earlier thoughts are left out (chat completions takes no reasoning back);
//! - `tools.functionDeclarations` as function tools (`parameters`, Google's `OpenAPI` schema, as
//!   JSON Schema: lower-case types, `nullable` as a `null` type; `parametersJsonSchema` as it
//!   is); `toolConfig.functionCallingConfig` as `tool_choice` (`AUTO` and `VALIDATED` `auto`,
//!   `ANY` `required` or the one function `allowedFunctionNames` names, `NONE` `none`);
//! - `generationConfig`: `maxOutputTokens` as `max_tokens`, `temperature`, `topP`,
//!   `stopSequences` as `stop`, `candidateCount` as `n`, `presencePenalty`, `frequencyPenalty`,
//!   `seed`, `responseLogprobs` and `logprobs`, `responseMimeType` `application/json` (with
//!   `responseSchema` or `responseJsonSchema`) as `response_format`, `thinkingConfig` (a level,
//!   or a budget) as `reasoning_effort`; `safetySettings` (Google's own filters) and `topK`
//!   (a sampling setting chat completions has no name for, which the Gemini CLI always sends)
//!   are left out;
//! - back: text as text parts, reasoning as thought parts (when `includeThoughts` asked), tool
//!   calls as `functionCall` parts (with the provider's id); `finish_reason` as `finishReason`
//!   (`length` `MAX_TOKENS`, `content_filter` `SAFETY`, else `STOP`); usage as
//!   `usageMetadata` (cached input inside `promptTokenCount`, reasoning as
//!   `thoughtsTokenCount` beside `candidatesTokenCount`);
//! - refused with the field's name: `cachedContent`, other modalities and MIME types,
//!   parts other than the above (code execution, video or audio data), and Google's own tools
//!   (`googleSearch`, `codeExecution`, `urlContext`, ...) unless the upstream drops them
//!   ([`BuiltinTools::Drop`]).
//!
//! ```
//! use model_gateway::protocol::gemini::chat::GeminiAsChat;
//! use model_gateway::protocol::BuiltinTools;
//! use serde_json::{Value, json};
//!
//! let request = br#"{"systemInstruction":{"parts":[{"text":"Be brief."}]},
//!                    "contents":[{"role":"user","parts":[{"text":"Hi"}]}],
//!                    "generationConfig":{"maxOutputTokens":64}}"#;
//! let translated = GeminiAsChat::from_slice_with(request, "gpt-5-mini", false, BuiltinTools::Refuse).unwrap();
//! let chat: Value = serde_json::from_slice(&translated.chat_body("gpt-5-mini")).unwrap();
//! assert_eq!(chat["messages"][0], json!({ "role": "system", "content": "Be brief." }));
//! assert_eq!(chat["max_tokens"], 64);
//!
//! let reply = br#"{"id":"chatcmpl-1","choices":[{"index":0,"finish_reason":"stop",
//!     "message":{"role":"assistant","content":"Hello!"}}],
//!     "usage":{"prompt_tokens":9,"completion_tokens":2,"prompt_tokens_details":{"cached_tokens":4}}}"#;
//! let (response, _) = translated.reply(reply).unwrap();
//! let response: Value = serde_json::from_slice(&response).unwrap();
//! assert_eq!(response["candidates"][0]["content"]["parts"][0], json!({ "text": "Hello!" }));
//! assert_eq!(response["candidates"][0]["finishReason"], "STOP");
//! assert_eq!(response["usageMetadata"]["promptTokenCount"], 9);
//! assert_eq!(response["usageMetadata"]["cachedContentTokenCount"], 4);
//! ```

mod reply;
mod request;
mod stream;
#[cfg(test)]
mod tests;

use serde_json::{Map, Value};

pub use stream::ChatToGemini;

use crate::protocol::translate::Untranslatable;
use crate::protocol::{BuiltinTools, TokenUsage};

/// A Gemini request's chat-completions translation, made once (by the router, which checks it)
/// and sent to each channel under that channel's name for the model.
#[derive(Debug, Clone)]
pub struct GeminiAsChat {
    /// The chat request without `model`.
    chat: Map<String, Value>,
    /// The model the client asked for, which the reply names.
    model: String,
    /// Whether the client asked for the model's thoughts.
    thoughts: bool,
    dropped: Vec<String>,
}

impl GeminiAsChat {
    /// Translates the Gemini `request` for `model` (which its path named), streamed when
    /// `stream`, with Google's own tools dropped or refused as `builtin` says.
    pub fn from_slice_with(
        request: &[u8],
        model: &str,
        stream: bool,
        builtin: BuiltinTools,
    ) -> Result<GeminiAsChat, Untranslatable> {
        let request: Value = crate::protocol::read_json(request).map_err(|_| Untranslatable {
            field: String::new(),
            reason: "the request is not JSON",
        })?;
        let translated = request::chat_request(&request, stream, builtin)?;
        Ok(GeminiAsChat {
            chat: translated.chat,
            model: model.to_owned(),
            thoughts: translated.include_thoughts,
            dropped: translated.dropped,
        })
    }

    /// The tools the translation left out, by kind, in the request's order.
    pub fn dropped_tools(&self) -> &[String] {
        &self.dropped
    }

    /// The chat-completions request calling `model`, serialised.
    pub fn chat_body(&self, model: &str) -> Vec<u8> {
        crate::protocol::translate::body_with_model(model, &self.chat)
    }

    /// The `GenerateContentResponse` for the chat completion `reply`, and the gateway's
    /// reading of its usage, read as a chat call reads it (so that both ways charge one reply
    /// alike); `None` when `reply` is not a chat completion.
    pub fn reply(&self, reply: &[u8]) -> Option<(Vec<u8>, TokenUsage)> {
        reply::response_from_chat(reply, &self.model, self.thoughts)
    }

    /// A translator for the chat stream answering this request.
    pub fn stream(&self) -> ChatToGemini {
        ChatToGemini::new(&self.model, self.thoughts)
    }
}
