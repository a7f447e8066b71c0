//! The wire format an upstream speaks, named in its catalogue entry, and the dialect that is.

use serde::Deserialize;

use super::Protocol;

/// The wire format an upstream speaks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum UpstreamKind {
    /// `POST {base_url}/chat/completions` (and `{base_url}/embeddings`) with `Authorization:
    /// Bearer`.
    Openai,
    /// `POST {base_url}/v1/messages` with `x-api-key` and `anthropic-version`.
    Anthropic,
    /// Google's Gemini API: `POST {base_url}/v1beta/models/{model}:generateContent` (and
    /// `:streamGenerateContent?alt=sse`) with `x-goog-api-key`.
    Gemini,
}

impl UpstreamKind {
    /// The protocol an upstream of this kind speaks for conversations.
    pub(crate) fn protocol(self) -> Protocol {
        match self {
            UpstreamKind::Openai => Protocol::ChatCompletions,
            UpstreamKind::Anthropic => Protocol::Messages,
            UpstreamKind::Gemini => Protocol::Gemini,
        }
    }

    /// Whether an upstream of this kind serves `protocol`: `OpenAI`'s chat completions,
    /// responses (natively or translated) and embeddings, or Anthropic's messages.
    pub fn serves(self, protocol: Protocol) -> bool {
        protocol.dialect().served_by(self)
    }
}

/// A cloud platform hosting a provider's models under its own paths and credentials, where
/// the body the provider's own API takes differs (the model named in the path, the API version
/// in the body).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum HostedOn {
    /// Amazon Bedrock.
    #[cfg_attr(not(feature = "bedrock"), allow(dead_code))]
    Bedrock,
    /// Google Vertex AI.
    #[cfg_attr(not(feature = "vertex"), allow(dead_code))]
    Vertex,
}

/// How an `OpenAI`-kind upstream serves `POST /v1/responses` (`responses` in its catalogue
/// entry).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ResponsesRoute {
    /// The request is translated to chat completions and the reply (or stream) back (see
    /// [`protocol::responses`](crate::protocol::responses)): works with every
    /// chat-completions provider. The default.
    #[default]
    Translate,
    /// The provider serves the Responses API itself (`OpenAI`, Azure): the request goes to
    /// `{base_url}/responses` and the reply comes back byte for byte.
    Native,
}

/// What an upstream that translates a call does with the tools that run inside a provider's
/// own API and have no equivalent on the protocol it speaks (the Responses API's built-in
/// tools: web search, file search, code interpreter, computer use, image generation, MCP and
/// the like): `builtin_tools` in its catalogue entry.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum BuiltinTools {
    /// Left out of the translated request, and named in the reply's
    /// `x-gateway-dropped-tools` header (never silently): the call goes on without them. The
    /// default, since agents such as Codex send one by default.
    #[default]
    Drop,
    /// Refused: `400`, naming the tool, before anything is charged.
    Refuse,
}
