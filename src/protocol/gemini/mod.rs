//! Google's Gemini API: `POST /v1beta/models/{model}:generateContent` and
//! `:streamGenerateContent` (the model and the verb in the path, not the body), at a
//! Gemini-kind upstream's `{base_url}/v1beta/models/{model}:generateContent` or
//! `:streamGenerateContent?alt=sse` with `x-goog-api-key`, the request and the reply passed byte
//! for byte. Usage is Google's `usageMetadata`: `promptTokenCount` with the cached
//! `cachedContentTokenCount` inside it, `toolUsePromptTokenCount` beside it, and
//! `thoughtsTokenCount` beside `candidatesTokenCount` (see
//! [`TokenUsage`]).
//!
//! [`chat`] translates a Gemini request to chat completions for the other providers;
//! [`framing`] answers a stream as Google's JSON array to a client that did not ask `alt=sse`.
//!
//! [`TokenUsage`]: crate::protocol::TokenUsage

pub mod chat;
pub mod framing;
mod mock;
mod stream;
pub(crate) mod usage;

use bytes::Bytes;
use http::{HeaderMap, HeaderName, HeaderValue};
use serde::Deserialize;
use serde_json::value::RawValue;

use super::dialect::{
    Dialect, Envelope, Fields, Metering, MockCall, Model, UpstreamDialect, UpstreamRoute,
    json_headers, pass_headers,
};
use super::sse::{Event, EventKind, StreamState};
use super::translate::Needs;
use super::translation::{ToChat, Translation};
use super::{Protocol, ResponsesRoute, TokenUsage, UpstreamKind};
use crate::error::GatewayError;

/// The Gemini API's dialect.
pub(crate) struct Gemini;

/// Where the Gemini API's models are, on the gateway and at a Gemini-kind upstream.
pub(crate) const MODELS_PATH: &str = "/v1beta/models";

/// Where Google's newer SDKs (`google-genai` 3) call them by default: the API's `v1`.
const V1_MODELS_PATH: &str = "/v1/models";

/// What follows the models' path in a Gemini API `path` (`{model}:{verb}`, or a model's name),
/// on `v1beta` or `v1`.
pub(crate) fn path_target(path: &str) -> Option<&str> {
    path.strip_prefix(MODELS_PATH)
        .or_else(|| path.strip_prefix(V1_MODELS_PATH))?
        .strip_prefix('/')
}

/// Whether `path` is one of the Gemini API's (where Google's clients may send their key as
/// `?key=`, and read Google's error object): under `/v1beta/`, or a model's verb under
/// `/v1/models/` (`/v1/models/{id}` alone is the `OpenAI` and Anthropic lookup).
pub(crate) fn is_gemini_path(path: &str) -> bool {
    path.starts_with("/v1beta/")
        || path
            .strip_prefix("/v1/models/")
            .is_some_and(|target| target.contains(':'))
}

/// Client headers a Gemini-kind provider is passed.
const PASSED_HEADERS: &[&str] = &["traceparent", "tracestate", "x-request-id"];

/// What a call's path asks: `{model}:generateContent` or `{model}:streamGenerateContent`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct PathCall<'a> {
    /// The model, as the path names it.
    pub(crate) model: &'a str,
    /// Whether the verb is `streamGenerateContent`.
    pub(crate) stream: bool,
}

/// The model and verb of a Gemini call's `path`, if it is one (`countTokens` is not a call).
pub(crate) fn path_call(path: &str) -> Option<PathCall<'_>> {
    let (model, verb) = path_target(path)?.rsplit_once(':')?;
    if model.is_empty() || model.contains('/') {
        return None;
    }
    let stream = match verb {
        "generateContent" => false,
        "streamGenerateContent" => true,
        _ => return None,
    };
    Some(PathCall { model, stream })
}

/// The fields of a Gemini request the gateway reads.
#[derive(Deserialize)]
struct GeminiFields<'a> {
    #[serde(borrow, default)]
    contents: Option<&'a RawValue>,
    #[serde(borrow, default, rename = "generationConfig")]
    generation_config: Option<&'a RawValue>,
    #[serde(borrow, default, rename = "cachedContent")]
    cached_content: Option<&'a RawValue>,
}

/// The output settings of `generationConfig` the ceiling reads.
#[derive(Deserialize, Default)]
struct GenerationConfig {
    #[serde(default, rename = "maxOutputTokens")]
    max_output_tokens: Option<serde_json::Value>,
    #[serde(default, rename = "candidateCount")]
    candidate_count: Option<serde_json::Value>,
}

/// The most candidates a request may ask for (Google takes at most 8).
const MAX_CANDIDATES: u64 = 8;

impl Dialect for Gemini {
    fn usage_key(&self) -> &'static str {
        "usageMetadata"
    }

    fn usage_is_cumulative(&self) -> bool {
        true
    }

    fn protocol(&self) -> Protocol {
        Protocol::Gemini
    }

    fn stored_name(&self) -> &'static str {
        "gemini"
    }

    fn path(&self) -> &'static str {
        "/v1beta/models/{model}:generateContent"
    }

    fn matches(&self, path: &str) -> bool {
        path_call(path).is_some()
    }

    fn model_in_body(&self) -> bool {
        false
    }

    /// Only with its path: see [`envelope_at`](Dialect::envelope_at).
    fn envelope<'a>(&self, body: &'a [u8], _: bool) -> Result<Envelope<'a>, GatewayError> {
        let _ = body;
        Err(GatewayError::UnknownPath)
    }

    /// The model and verb from the path, then the body a JSON object with `contents` a list,
    /// then streaming (`streamGenerateContent`) only when it is on.
    fn envelope_at<'a>(
        &self,
        path: &'a str,
        body: &'a [u8],
        streaming: bool,
    ) -> Result<Envelope<'a>, GatewayError> {
        let call = path_call(path).ok_or(GatewayError::UnknownPath)?;
        if body.trim_ascii_start().first() != Some(&b'{') {
            return Err(GatewayError::InvalidJson);
        }
        let fields: GeminiFields<'_> =
            super::read_json(body).map_err(|_| GatewayError::InvalidJson)?;
        if !fields
            .contents
            .is_some_and(|raw| raw.get().starts_with('['))
        {
            return Err(GatewayError::InvalidField {
                field: "contents".into(),
                reason: "须为数组",
            });
        }
        if call.stream && !streaming {
            return Err(GatewayError::StreamingUnsupported);
        }
        Ok(Envelope {
            fields: Fields::default(),
            model: Model {
                raw: None,
                name: call.model.into(),
            },
            stream: call.stream,
            continues: None,
            provider_keeps: None,
        })
    }

    /// `generationConfig.maxOutputTokens` for each of its `candidateCount` candidates, and
    /// `cachedContent`, input the request's size does not bound. A stream reports its usage
    /// unasked.
    fn metering(&self, _: &Envelope<'_>, body: &[u8]) -> Result<Metering, GatewayError> {
        let fields: GeminiFields<'_> =
            super::read_json(body).map_err(|_| GatewayError::InvalidJson)?;
        let config: GenerationConfig = match fields.generation_config {
            Some(raw) => {
                serde_json::from_str(raw.get()).map_err(|_| GatewayError::InvalidField {
                    field: "generationConfig".into(),
                    reason: "须为对象",
                })?
            }
            None => GenerationConfig::default(),
        };
        let output_limit = config
            .max_output_tokens
            .as_ref()
            .and_then(serde_json::Value::as_u64);
        let replies = match &config.candidate_count {
            None | Some(serde_json::Value::Null) => 1,
            Some(count) => match count.as_u64() {
                Some(count @ 1..=MAX_CANDIDATES) => count,
                _ => {
                    return Err(GatewayError::InvalidField {
                        field: "generationConfig.candidateCount".into(),
                        reason: "须为 1 到 8 之间的整数",
                    });
                }
            },
        };
        // Google's stored context, as large as the model takes, billed as cache reads.
        let kept_input = fields
            .cached_content
            .filter(|raw| raw.get() != "null")
            .map(|_| "cachedContent");
        Ok(Metering {
            output_limit,
            replies,
            kept_input,
            ..Metering::default()
        })
    }

    /// Translated to chat completions for both kinds of translating upstream (an Anthropic
    /// one takes that translation on to messages).
    fn translation(
        &self,
        envelope: &Envelope<'_>,
        model_name: &str,
        body: &[u8],
        needs: Needs,
    ) -> Option<Result<Translation, GatewayError>> {
        // Never on to the Gemini API: a Gemini upstream takes the request as it is.
        let onward = Needs {
            to_gemini: None,
            ..needs
        };
        let builtin = onward.strictest_for_chat()?;
        let translated =
            chat::GeminiAsChat::from_slice_with(body, model_name, envelope.stream, builtin)
                .and_then(|chat| {
                    Translation::through_chat(ToChat::Gemini(chat), model_name, onward)
                });
        Some(translated.map_err(GatewayError::from))
    }

    /// Natively by Gemini-kind upstreams; translated to chat completions by `OpenAI`-kind ones,
    /// and through them to messages by Anthropic-kind ones.
    fn served_by(&self, _: UpstreamKind) -> bool {
        true
    }

    fn upstream(&self, kind: UpstreamKind, _: ResponsesRoute) -> Option<UpstreamRoute> {
        Some(match kind {
            UpstreamKind::Gemini => UpstreamRoute {
                path: MODELS_PATH,
                translated: false,
            },
            UpstreamKind::Openai => UpstreamRoute {
                path: "/chat/completions",
                translated: true,
            },
            UpstreamKind::Anthropic => UpstreamRoute {
                path: "/v1/messages",
                translated: true,
            },
        })
    }

    fn count_tokens_path(&self, kind: UpstreamKind, model: &str) -> Option<String> {
        (kind == UpstreamKind::Gemini).then(|| format!("{MODELS_PATH}/{model}:countTokens"))
    }

    /// The text of every part (and each function call and response, as JSON) counted with the
    /// gateway's tokenizer: an estimate, as Google's tokenizer differs.
    fn counted_here(&self, body: &[u8]) -> Result<u64, GatewayError> {
        let request: serde_json::Value =
            super::read_json(body).map_err(|_| GatewayError::InvalidJson)?;
        // `countTokens` takes `contents`, or a whole `generateContentRequest`.
        let request = match request.get("generateContentRequest") {
            Some(inner) => inner,
            None => &request,
        };
        let mut text = String::new();
        let mut parts_of = |content: &serde_json::Value| {
            for part in content["parts"].as_array().into_iter().flatten() {
                stream::part_text(part, &mut text);
            }
        };
        for content in request["contents"].as_array().into_iter().flatten() {
            parts_of(content);
        }
        parts_of(&request["systemInstruction"]);
        let tools = &request["tools"];
        if !tools.is_null() {
            text.push_str(&tools.to_string());
        }
        Ok(super::tokens::counted_text_tokens(&text))
    }

    fn count_reply(&self, tokens: u64) -> serde_json::Value {
        serde_json::json!({ "totalTokens": tokens })
    }

    /// A stream ends when Google closes it once every candidate seen has finished (or the
    /// prompt was blocked): no chunk says the whole reply is done, each candidate finishing in
    /// its own time.
    fn ends_when_closed(&self, state: &StreamState) -> bool {
        !state.finished.is_empty() && state.unfinished.is_empty()
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

impl UpstreamDialect for Gemini {
    fn api_key_value(&self, key: &str) -> String {
        key.to_owned()
    }

    fn headers(&self, client_headers: &HeaderMap, api_key: HeaderValue) -> HeaderMap {
        let mut headers = json_headers();
        headers.insert(HeaderName::from_static("x-goog-api-key"), api_key);
        pass_headers(&mut headers, client_headers, PASSED_HEADERS);
        headers
    }

    /// `{path}/{model}:generateContent`, or `:streamGenerateContent?alt=sse` (the provider's
    /// stream as server-sent events, whatever framing the client asked for).
    fn call_path(&self, path: &str, model: &str, stream: bool) -> Option<String> {
        Some(if stream {
            format!("{path}/{model}:streamGenerateContent?alt=sse")
        } else {
            format!("{path}/{model}:generateContent")
        })
    }
}

#[cfg(test)]
mod tests;
