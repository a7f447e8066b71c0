//! Anthropic's messages: `POST /v1/messages`, at an Anthropic-kind upstream's
//! `{base_url}/v1/messages` with `x-api-key` and `anthropic-version`, or translated to chat
//! completions for an `OpenAI`-kind upstream (see [`MessagesAsChat`]).

pub(crate) mod chat;
mod hosted;
mod mock;
mod stream;

pub use chat::{ChatToMessages, MessagesAsChat, NotAChatReply, local_input_tokens};

use bytes::Bytes;
use http::{HeaderMap, HeaderName, HeaderValue};

use super::dialect::{
    Dialect, Envelope, Fields, MockCall, UpstreamDialect, UpstreamRoute, json_headers, pass_headers,
};
use super::sse::{Event, EventKind, StreamState};
use super::translate::Needs;
use super::translation::{ToChat, Translation};
use super::{BuiltinTools, HostedOn, Protocol, ResponsesRoute, TokenUsage, UpstreamKind};
use crate::error::GatewayError;

/// Messages' dialect.
pub(crate) struct Messages;

/// `anthropic-version` sent when the client sent none.
pub(crate) const DEFAULT_ANTHROPIC_VERSION: &str = "2023-06-01";

/// Client headers an Anthropic-kind provider is passed (besides `anthropic-version`).
const PASSED_HEADERS: &[&str] = &[
    "anthropic-beta",
    "idempotency-key",
    "traceparent",
    "tracestate",
    "x-request-id",
];

impl Dialect for Messages {
    fn protocol(&self) -> Protocol {
        Protocol::Messages
    }

    fn stored_name(&self) -> &'static str {
        "messages"
    }

    fn path(&self) -> &'static str {
        "/v1/messages"
    }

    /// `model`, then `messages` a list, then `max_tokens` a whole number above zero, then
    /// `stream`.
    fn envelope<'a>(&self, body: &'a [u8], streaming: bool) -> Result<Envelope<'a>, GatewayError> {
        let fields = Fields::read(body)?;
        let model = fields.model()?;
        if !fields.has_messages() {
            return Err(GatewayError::InvalidMessagesField);
        }
        let max_tokens = fields.max_tokens.ok_or(GatewayError::InvalidMaxTokens)?;
        match serde_json::from_str::<u64>(max_tokens.get()) {
            Ok(tokens) if tokens > 0 => {}
            _ => return Err(GatewayError::InvalidMaxTokens),
        }
        fields.into_envelope(model, streaming)
    }

    fn translation(
        &self,
        _: &Envelope<'_>,
        model_name: &str,
        body: &[u8],
        needs: Needs,
    ) -> Option<Result<Translation, GatewayError>> {
        let builtin = needs.strictest_for_chat()?;
        // Never on to messages: an Anthropic upstream takes the request as it is.
        let onward = Needs {
            to_messages: None,
            ..needs
        };
        let translated = MessagesAsChat::from_slice_with(body, builtin)
            .and_then(|chat| Translation::through_chat(ToChat::Messages(chat), model_name, onward));
        Some(translated.map_err(GatewayError::from))
    }

    /// Natively by Anthropic-kind upstreams, translated to chat completions by `OpenAI`-kind
    /// ones, and through them to the Gemini API by Gemini-kind ones.
    fn served_by(&self, _: UpstreamKind) -> bool {
        true
    }

    fn upstream(&self, kind: UpstreamKind, _: ResponsesRoute) -> Option<UpstreamRoute> {
        match kind {
            UpstreamKind::Anthropic => Some(UpstreamRoute {
                path: "/v1/messages",
                translated: false,
            }),
            UpstreamKind::Openai => Some(UpstreamRoute {
                path: "/chat/completions",
                translated: true,
            }),
            UpstreamKind::Gemini => Some(UpstreamRoute {
                path: super::gemini::MODELS_PATH,
                translated: true,
            }),
        }
    }

    fn count_tokens_path(&self, kind: UpstreamKind, _: &str) -> Option<String> {
        (kind == UpstreamKind::Anthropic).then(|| "/v1/messages/count_tokens".to_owned())
    }

    /// The count of its translation to chat completions (see [`chat::local_input_tokens`]).
    fn counted_here(&self, body: &[u8]) -> Result<u64, GatewayError> {
        let translated = chat::MessagesAsChat::from_slice_with(body, BuiltinTools::Drop)?;
        Ok(chat::local_input_tokens(&translated))
    }

    fn read_event(&self, event: &Event<'_>, state: &mut StreamState) -> EventKind {
        stream::read_event(event, state)
    }

    fn content_text(&self, event: &serde_json::Value, text: &mut String) {
        stream::content_text(event, text);
    }

    fn error_event(&self, error: &GatewayError, _: u64) -> Bytes {
        stream::error_event(error)
    }

    fn mock_reply(&self, call: &MockCall<'_>) -> (Bytes, Option<TokenUsage>) {
        mock::reply(call)
    }

    fn mock_events(&self, call: &MockCall<'_>) -> Vec<Bytes> {
        mock::events(call)
    }
}

impl UpstreamDialect for Messages {
    fn api_key_value(&self, key: &str) -> String {
        key.to_owned()
    }

    fn headers(&self, client_headers: &HeaderMap, api_key: HeaderValue) -> HeaderMap {
        let mut headers = json_headers();
        headers.insert(HeaderName::from_static("x-api-key"), api_key);
        let version = client_headers
            .get("anthropic-version")
            .cloned()
            .unwrap_or(HeaderValue::from_static(DEFAULT_ANTHROPIC_VERSION));
        headers.insert(HeaderName::from_static("anthropic-version"), version);
        pass_headers(&mut headers, client_headers, PASSED_HEADERS);
        headers
    }

    fn hosted_body(&self, body: &[u8], on: HostedOn, client_headers: &HeaderMap) -> Option<Bytes> {
        hosted::body(body, on, client_headers)
    }

    fn hosted_headers(&self, on: HostedOn, client_headers: &HeaderMap) -> HeaderMap {
        let mut headers = json_headers();
        // Bedrock takes the beta flags in the body (see `hosted`); Vertex as Anthropic does.
        let passed = match on {
            HostedOn::Bedrock => &PASSED_HEADERS[1..],
            HostedOn::Vertex => PASSED_HEADERS,
        };
        pass_headers(&mut headers, client_headers, passed);
        headers
    }
}
