//! `OpenAI`'s embeddings: `POST /v1/embeddings`, never streamed, at an `OpenAI`-kind
//! upstream's `{base_url}/embeddings`.

mod mock;

use bytes::Bytes;

use super::chat_completions::{openai_error_event, read_chat_event};
use super::dialect::{Dialect, Envelope, Fields, MockCall, UpstreamRoute};
use super::sse::{Event, EventKind, StreamState};
use super::{Protocol, ResponsesRoute, TokenUsage, UpstreamKind};
use crate::error::GatewayError;

pub use mock::MOCK_EMBEDDING_DIMENSIONS;

/// Embeddings' dialect.
pub(crate) struct Embeddings;

impl Dialect for Embeddings {
    fn protocol(&self) -> Protocol {
        Protocol::Embeddings
    }

    fn stored_name(&self) -> &'static str {
        "embeddings"
    }

    fn path(&self) -> &'static str {
        "/v1/embeddings"
    }

    fn has_output(&self) -> bool {
        false
    }

    /// `model`, then `input`: a string, or an array of strings or of token arrays. Never
    /// streamed, whatever `stream` says.
    fn envelope<'a>(&self, body: &'a [u8], _: bool) -> Result<Envelope<'a>, GatewayError> {
        let fields = Fields::read(body)?;
        let model = fields.model()?;
        if !fields.has_input() {
            return Err(GatewayError::InvalidInputField);
        }
        Ok(Envelope {
            fields,
            model,
            stream: false,
            continues: None,
            provider_keeps: None,
        })
    }

    fn served_by(&self, kind: UpstreamKind) -> bool {
        kind == UpstreamKind::Openai
    }

    fn upstream(&self, kind: UpstreamKind, _: ResponsesRoute) -> Option<UpstreamRoute> {
        (kind == UpstreamKind::Openai).then_some(UpstreamRoute {
            path: "/embeddings",
            translated: false,
        })
    }

    /// Embeddings never stream; were one to, it would be read as `OpenAI`'s chat stream.
    fn read_event(&self, event: &Event<'_>, state: &mut StreamState) -> EventKind {
        read_chat_event(event, state)
    }

    fn content_text(&self, event: &serde_json::Value, text: &mut String) {
        super::chat_completions::ChatCompletions.content_text(event, text);
    }

    fn error_event(&self, error: &GatewayError, _: u64) -> Bytes {
        openai_error_event(error)
    }

    /// One unit vector per input; the billing layer reads the usage from the reply.
    fn mock_reply(&self, call: &MockCall<'_>) -> (Bytes, Option<TokenUsage>) {
        let reply = serde_json::to_vec(&mock::embeddings(call.model, call.body));
        (Bytes::from(reply.expect("a mock reply serialises")), None)
    }

    /// The router lets no embeddings call stream; a stream without its end is refunded.
    fn mock_events(&self, _: &MockCall<'_>) -> Vec<Bytes> {
        Vec::new()
    }
}
