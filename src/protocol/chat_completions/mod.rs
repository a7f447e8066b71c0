//! `OpenAI`'s chat completions: `POST /v1/chat/completions`, at an `OpenAI`-kind upstream's
//! `{base_url}/chat/completions` with `Authorization: Bearer`.

pub mod gemini;
pub mod messages;
mod mock;
mod stream;

use bytes::Bytes;
use http::{HeaderMap, HeaderValue, header};
use serde::Deserialize;
use serde_json::value::RawValue;

use super::dialect::{
    Dialect, Envelope, Fields, Metering, MockCall, UpstreamDialect, UpstreamRoute, UsageAsk,
    json_headers, pass_headers,
};
use super::sse::{Event, EventKind, StreamState};
use super::translate::{Needs, Untranslatable};
use super::translation::Translation;
use super::{Protocol, ResponsesRoute, TokenUsage, UpstreamKind};
use crate::error::GatewayError;

pub(crate) use mock::chat_events;
pub(crate) use stream::{openai_error_event, read_chat_event};

/// Chat completions' dialect.
pub(crate) struct ChatCompletions;

/// Client headers an `OpenAI`-kind provider is passed.
const PASSED_HEADERS: &[&str] = &[
    "openai-organization",
    "openai-project",
    "openai-beta",
    "idempotency-key",
    "traceparent",
    "tracestate",
    "x-request-id",
];

/// The most replies a request may ask for (`n`): `OpenAI` takes up to 128.
const MAX_REPLIES: u64 = 128;

impl Dialect for ChatCompletions {
    fn protocol(&self) -> Protocol {
        Protocol::ChatCompletions
    }

    fn stored_name(&self) -> &'static str {
        "chat_completions"
    }

    fn path(&self) -> &'static str {
        "/v1/chat/completions"
    }

    /// `model`, then `messages` a list, then `stream`.
    fn envelope<'a>(&self, body: &'a [u8], streaming: bool) -> Result<Envelope<'a>, GatewayError> {
        let fields = Fields::read(body)?;
        let model = fields.model()?;
        if !fields.has_messages() {
            return Err(GatewayError::InvalidMessagesField);
        }
        fields.into_envelope(model, streaming)
    }

    /// A chat stream reports its usage only when asked, and a token-priced call is billed on
    /// it: the gateway asks whatever the client set, and keeps the usage chunk from a client
    /// that did not ask for it.
    fn metering(&self, envelope: &Envelope<'_>, body: &[u8]) -> Result<Metering, GatewayError> {
        let fields = &envelope.fields;
        let usage = match fields.stream_options {
            _ if !envelope.stream => UsageAsk::Asked,
            // Absent, or `null` (which reads as absent): a field of the gateway's own is added
            // only where the client has none, so that no parser takes the client's.
            None if memchr::memmem::find(body, b"\"stream_options\"").is_some() => {
                UsageAsk::OverClientsOptions
            }
            None => UsageAsk::GatewayAsks,
            Some(options) if !asks_usage(options) => UsageAsk::OverClientsOptions,
            Some(_) => UsageAsk::Asked,
        };
        Ok(Metering {
            output_limit: fields.output_limit(),
            replies: replies(fields.n)?,
            usage,
            kept_input: None,
        })
    }

    fn translation(
        &self,
        _: &Envelope<'_>,
        _: &str,
        body: &[u8],
        needs: Needs,
    ) -> Option<Result<Translation, GatewayError>> {
        if needs.to_messages.is_none() && needs.to_gemini.is_none() {
            return None;
        }
        let messages = needs.to_messages.map(|builtin| {
            messages::ChatAsMessages::from_slice_with(body, builtin, needs.max_output_tokens)
        });
        let gemini = needs.to_gemini.map(|builtin| {
            gemini::ChatAsGemini::from_slice_with(body, builtin, needs.max_output_tokens)
        });
        let translated = (|| {
            Ok(Translation {
                chat: None,
                messages: messages.transpose()?,
                gemini: gemini.transpose()?,
            })
        })();
        Some(translated.map_err(|untranslatable: Untranslatable| untranslatable.into()))
    }

    /// Natively by `OpenAI`-kind upstreams, translated to messages by Anthropic-kind ones and
    /// to the Gemini API by Gemini-kind ones.
    fn served_by(&self, _: UpstreamKind) -> bool {
        true
    }

    fn upstream(&self, kind: UpstreamKind, _: ResponsesRoute) -> Option<UpstreamRoute> {
        match kind {
            UpstreamKind::Openai => Some(UpstreamRoute {
                path: "/chat/completions",
                translated: false,
            }),
            UpstreamKind::Anthropic => Some(UpstreamRoute {
                path: "/v1/messages",
                translated: true,
            }),
            UpstreamKind::Gemini => Some(UpstreamRoute {
                path: super::gemini::MODELS_PATH,
                translated: true,
            }),
        }
    }

    fn read_event(&self, event: &Event<'_>, state: &mut StreamState) -> EventKind {
        read_chat_event(event, state)
    }

    fn content_text(&self, event: &serde_json::Value, text: &mut String) {
        stream::content_text(event, text);
    }

    fn error_event(&self, error: &GatewayError, _: u64) -> Bytes {
        openai_error_event(error)
    }

    fn mock_reply(&self, call: &MockCall<'_>) -> (Bytes, Option<TokenUsage>) {
        mock::reply(call)
    }

    fn mock_events(&self, call: &MockCall<'_>) -> Vec<Bytes> {
        chat_events(call)
    }
}

impl UpstreamDialect for ChatCompletions {
    fn api_key_value(&self, key: &str) -> String {
        format!("Bearer {key}")
    }

    fn headers(&self, client_headers: &HeaderMap, api_key: HeaderValue) -> HeaderMap {
        let mut headers = json_headers();
        headers.insert(header::AUTHORIZATION, api_key);
        pass_headers(&mut headers, client_headers, PASSED_HEADERS);
        headers
    }
}

/// Hints of a chat request for `OpenAI`'s own servers that another provider's protocol has no
/// use for: a translation drops them.
pub(crate) const OPENAI_HINTS: &[&str] = &[
    "store",
    "metadata",
    "service_tier",
    "prompt_cache_key",
    "prompt_cache_retention",
    "verbosity",
    "stream_options",
    "parallel_tool_calls",
];

/// A `data:` URL's media type and base64 data.
pub(crate) fn data_url(url: &str) -> Option<(&str, &str)> {
    url.strip_prefix("data:")?.split_once(";base64,")
}

/// Whether a chat request's `stream_options` ask for the stream's usage (`include_usage: true`).
fn asks_usage(options: &RawValue) -> bool {
    #[derive(Deserialize)]
    struct Options {
        include_usage: Option<bool>,
    }
    serde_json::from_str::<Options>(options.get())
        .is_ok_and(|options| options.include_usage == Some(true))
}

/// How many replies a request asks for: `n` as a whole number from 1 to [`MAX_REPLIES`], 1 when
/// absent or `null`; anything else is `400` (a provider could honour a value the gateway read
/// otherwise, bringing output its ceiling did not hold).
fn replies(n: Option<&RawValue>) -> Result<u64, GatewayError> {
    match n.map(RawValue::get) {
        None | Some("null") => Ok(1),
        Some(raw) => match serde_json::from_str::<u64>(raw) {
            Ok(n) if (1..=MAX_REPLIES).contains(&n) => Ok(n),
            _ => Err(GatewayError::InvalidReplies),
        },
    }
}
