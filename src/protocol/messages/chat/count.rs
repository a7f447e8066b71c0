//! `count_tokens` for a messages model whose providers speak only chat completions (none of
//! them counts a messages request): counted by the gateway, from the request's translation.

use serde_json::Value;

use super::MessagesAsChat;
use crate::protocol::tokens::{counted_text_tokens, estimated_text_tokens};

/// Tokens an image is counted as: Anthropic's count for an image of about 1.15 megapixels, the
/// largest it takes without resizing (the gateway does not decode images).
pub(crate) const IMAGE_TOKENS: u64 = 1_600;

/// Tokens each message adds beside its content (its role and delimiters), as `OpenAI` counts.
const PER_MESSAGE: u64 = 4;

/// The input tokens of the messages request `translated` is the translation of: its text
/// counted with the gateway's tokenizer (see
/// [`counted_text_tokens`]), each image as 1,600 tokens, a file from its size, and the tool
/// definitions and calls from their JSON. An estimate: each provider's tokenizer differs.
pub fn local_input_tokens(translated: &MessagesAsChat) -> u64 {
    let mut tokens = 0u64;
    if let Some(Value::Array(messages)) = translated.chat.get("messages") {
        for message in messages {
            tokens += PER_MESSAGE;
            tokens += content_tokens(&message["content"]);
            if let Some(calls) = message.get("tool_calls") {
                tokens += counted_text_tokens(&calls.to_string());
            }
        }
    }
    if let Some(tools) = translated.chat.get("tools") {
        tokens += counted_text_tokens(&tools.to_string());
    }
    tokens
}

fn content_tokens(content: &Value) -> u64 {
    match content {
        Value::String(text) => counted_text_tokens(text),
        Value::Array(parts) => parts
            .iter()
            .map(|part| match part["type"].as_str() {
                Some("text") => counted_text_tokens(part["text"].as_str().unwrap_or_default()),
                Some("image_url") => IMAGE_TOKENS,
                // Base64: three bytes of the file in four characters.
                Some("file") => estimated_text_tokens(
                    part["file"]["file_data"].as_str().map_or(0, str::len) / 4 * 3,
                ),
                _ => 0,
            })
            .sum(),
        _ => 0,
    }
}
