//! What every wire protocol answers for itself, so that the rooms above ask its [`Dialect`]
//! and never `match` on [`Protocol`]: its route, the envelope of a request (model, stream
//! flag, output limit), what the gateway adds before the upstream, the usage and content of
//! its stream events, its error event, where each upstream kind takes its calls and the
//! headers that upstream kind takes, and the mock's reply.

use std::borrow::Cow;

use bytes::Bytes;
use http::{HeaderMap, HeaderValue};
use serde::Deserialize;
use serde_json::value::RawValue;

use super::sse::{Event, EventKind, StreamState};
use super::translate::Needs;
use super::translation::Translation;
use super::upstream_kind::{HostedOn, ResponsesRoute, UpstreamKind};
use super::{Protocol, TokenUsage, json_string, responses};
use crate::error::GatewayError;

/// One wire protocol. Implemented once per folder under `src/protocol/`; reached through
/// [`Protocol::dialect`].
pub(crate) trait Dialect: Sync {
    /// The protocol this is.
    fn protocol(&self) -> Protocol;

    /// The name the call log stores.
    fn stored_name(&self) -> &'static str;

    /// The path clients call (with `POST`).
    fn path(&self) -> &'static str;

    /// Whether a request to `path` is a call of this protocol. A protocol that puts the model
    /// or the verb in the path matches more than one path.
    fn matches(&self, path: &str) -> bool {
        path == self.path()
    }

    /// The protocol of the catalogue models this endpoint serves.
    fn models(&self) -> Protocol {
        self.protocol()
    }

    /// Whether a reply has output to reserve for (a catalogue model of a protocol without
    /// output needs no `max_output_tokens`).
    fn has_output(&self) -> bool {
        true
    }

    /// Whether each usage report of a stream holds every count so far (Gemini's
    /// `usageMetadata` on every chunk), so that only the last is the provider's report; else
    /// the reports complement each other (Anthropic's `message_start` and `message_delta`).
    fn usage_is_cumulative(&self) -> bool {
        false
    }

    /// The key of a complete reply's usage object (where the operator's `usage_cost` adds
    /// what the call cost).
    fn usage_key(&self) -> &'static str {
        "usage"
    }

    /// Checks the fields of a request `body` the gateway reads, in the order the contract
    /// gives (a malformed request is a 400), and returns them. `stream: true` is refused
    /// unless `streaming` is on.
    fn envelope<'a>(&self, body: &'a [u8], streaming: bool) -> Result<Envelope<'a>, GatewayError>;

    /// The envelope of a request `body` sent to `path`: for a protocol that names the model
    /// or the stream in the path, read from both; else the body's [`envelope`](Self::envelope).
    fn envelope_at<'a>(
        &self,
        path: &'a str,
        body: &'a [u8],
        streaming: bool,
    ) -> Result<Envelope<'a>, GatewayError> {
        let _ = path;
        self.envelope(body, streaming)
    }

    /// Whether a request names its model in its body (renamed there for a channel); a protocol
    /// that names it in the path says `false`, and its body goes to the provider untouched.
    fn model_in_body(&self) -> bool {
        true
    }

    /// What a call priced by tokens needs from its envelope: the output it may bring and
    /// whether the gateway asks a stream's usage of the provider.
    fn metering(&self, envelope: &Envelope<'_>, body: &[u8]) -> Result<Metering, GatewayError> {
        let _ = body;
        Ok(Metering {
            output_limit: envelope.fields.output_limit(),
            ..Metering::default()
        })
    }

    /// The request translated for the upstreams that do not speak this protocol, as `needs`
    /// says (`None` when none is needed, or this protocol is never translated), built-in tools
    /// dropped or refused as each kind of upstream says.
    fn translation(
        &self,
        envelope: &Envelope<'_>,
        model_name: &str,
        body: &[u8],
        needs: Needs,
    ) -> Option<Result<Translation, GatewayError>> {
        let _ = (envelope, model_name, body, needs);
        None
    }

    /// Whether an upstream of `kind` serves this protocol (natively or translated).
    fn served_by(&self, kind: UpstreamKind) -> bool;

    /// Where an upstream of `kind` takes this protocol's calls, after its base URL, and
    /// whether the call is translated on its way there and back (`responses` is the
    /// upstream's own setting). `None` where it does not serve it.
    fn upstream(&self, kind: UpstreamKind, responses: ResponsesRoute) -> Option<UpstreamRoute>;

    /// Whether the provider keeps the replies of this protocol, to be continued later (their
    /// owners are then recorded).
    fn provider_keeps_replies(&self) -> bool {
        false
    }

    /// Where an upstream of `kind` counts the tokens of this protocol's request on `model`
    /// (after its base URL); `None` where it does not (the gateway then counts).
    fn count_tokens_path(&self, kind: UpstreamKind, model: &str) -> Option<String> {
        let _ = (kind, model);
        None
    }

    /// The gateway's own count of a request's input tokens (when no provider counts them), or
    /// `400` naming what cannot be counted.
    fn counted_here(&self, body: &[u8]) -> Result<u64, GatewayError> {
        let _ = body;
        Err(GatewayError::UnknownPath)
    }

    /// A token count in this protocol's answer to a count request.
    fn count_reply(&self, tokens: u64) -> serde_json::Value {
        serde_json::json!({ "input_tokens": tokens })
    }

    /// Whether the provider closing a stream in `state` is its normal end: for a protocol
    /// whose streams have no end event of their own once its reply said it finished (Google's,
    /// where each candidate finishes in its own time).
    fn ends_when_closed(&self, state: &StreamState) -> bool {
        let _ = state;
        false
    }

    /// Reads one stream event for billing, keeping its usage in `state`.
    fn read_event(&self, event: &Event<'_>, state: &mut StreamState) -> EventKind;

    /// The text a content event carries (for counting its tokens): what a client reads as
    /// output, joined.
    fn content_text(&self, event: &serde_json::Value, text: &mut String);

    /// The gateway's last event when the provider failed after the stream started, in this
    /// protocol's own error shape; `next_sequence` numbers it where events are numbered.
    fn error_event(&self, error: &GatewayError, next_sequence: u64) -> Bytes;

    /// The mock's complete reply to `call`, with the usage it reports when the mock knows it
    /// without reading its reply back.
    fn mock_reply(&self, call: &MockCall<'_>) -> (Bytes, Option<TokenUsage>);

    /// The mock's reply to `call` as this protocol's event stream, one chunk per event.
    fn mock_events(&self, call: &MockCall<'_>) -> Vec<Bytes>;
}

/// What a provider of this protocol is sent: the headers an upstream that speaks it natively
/// takes. Implemented by the dialects an [`UpstreamKind`] speaks.
pub(crate) trait UpstreamDialect: Sync {
    /// The provider key as the header value it is sent in.
    fn api_key_value(&self, key: &str) -> String;

    /// The headers of a call: the content type, the provider key and the client's headers
    /// this provider takes (everything else, the client's own gateway key first, stays at
    /// the gateway).
    fn headers(&self, client_headers: &HeaderMap, api_key: HeaderValue) -> HeaderMap;

    /// The path, after the upstream's base URL, of a call on `model` at the route `path`, where
    /// this protocol names the model (and the stream) in the path; `None` where the route is
    /// the whole path.
    fn call_path(&self, path: &str, model: &str, stream: bool) -> Option<String> {
        let _ = (path, model, stream);
        None
    }

    /// The body of a call to this protocol's models where a platform hosts them (`on`), made
    /// from the body the provider's own API takes; `None` where it is the same.
    fn hosted_body(&self, body: &[u8], on: HostedOn, client_headers: &HeaderMap) -> Option<Bytes> {
        let _ = (body, on, client_headers);
        None
    }

    /// The headers of a call where a platform hosts this protocol's models: the content type
    /// and the client's headers the platform takes; its credentials are added by the channel.
    fn hosted_headers(&self, on: HostedOn, client_headers: &HeaderMap) -> HeaderMap {
        let _ = (on, client_headers);
        json_headers()
    }
}

/// A call's headers before its key: the content type.
pub(crate) fn json_headers() -> HeaderMap {
    let mut headers = HeaderMap::new();
    headers.insert(
        http::header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    headers
}

/// Copies the client's headers named in `passed` into `headers`.
pub(crate) fn pass_headers(headers: &mut HeaderMap, client: &HeaderMap, passed: &[&'static str]) {
    for name in passed {
        for value in client.get_all(*name) {
            headers.append(http::HeaderName::from_static(name), value.clone());
        }
    }
}

/// Where an upstream takes a protocol's calls.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct UpstreamRoute {
    /// After the upstream's base URL.
    pub(crate) path: &'static str,
    /// Whether the call is translated on its way (to chat completions) and back.
    pub(crate) translated: bool,
}

/// The fields the gateway reads of a request, as a dialect checked them.
pub(crate) struct Envelope<'a> {
    /// Every field read, as the raw JSON text it was written as.
    pub(crate) fields: Fields<'a>,
    /// `model`, a string.
    pub(crate) model: Model<'a>,
    /// Whether the reply streams.
    pub(crate) stream: bool,
    /// The stored reply the call continues, kept by the provider that made it.
    pub(crate) continues: Option<Cow<'a, str>>,
    /// Whether the request lets the provider keep its reply, where the dialect read it.
    pub(crate) provider_keeps: Option<bool>,
}

/// A request's `model`, read once.
#[derive(Debug)]
pub(crate) struct Model<'a> {
    /// As written (it borrows from the body, which places it there); `None` where the path
    /// names the model.
    pub(crate) raw: Option<&'a RawValue>,
    /// The name it gives.
    pub(crate) name: Cow<'a, str>,
}

/// What a call priced by tokens needs of its envelope.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Metering {
    /// The largest output limit the request sets.
    pub(crate) output_limit: Option<u64>,
    /// How many replies it asks for, each up to the output limit.
    pub(crate) replies: u64,
    /// Whether the gateway asks the provider for the stream's usage.
    pub(crate) usage: UsageAsk,
    /// The field that names input the provider keeps (Google's `cachedContent`), which the
    /// request's size does not bound: its reservation holds the model's whole context window.
    pub(crate) kept_input: Option<&'static str>,
}

impl Default for Metering {
    fn default() -> Metering {
        Metering {
            kept_input: None,
            output_limit: None,
            replies: 1,
            usage: UsageAsk::Asked,
        }
    }
}

/// Whether a stream's usage must be asked of the provider by the gateway.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum UsageAsk {
    /// The client asked, or the protocol reports usage unasked.
    Asked,
    /// The gateway adds the request (the client set no options of its own).
    GatewayAsks,
    /// The gateway asks over options the client set without asking.
    OverClientsOptions,
}

/// The fields the gateway reads; everything else passes through untouched. Each is kept as the
/// raw JSON text so that a field of the wrong type gets a precise 400, not a generic one.
#[derive(Deserialize, Default)]
pub(crate) struct Fields<'a> {
    #[serde(borrow, default)]
    pub(crate) model: Option<&'a RawValue>,
    #[serde(borrow, default)]
    pub(crate) messages: Option<&'a RawValue>,
    #[serde(borrow, default)]
    pub(crate) max_tokens: Option<&'a RawValue>,
    #[serde(borrow, default)]
    pub(crate) max_completion_tokens: Option<&'a RawValue>,
    #[serde(borrow, default)]
    pub(crate) max_output_tokens: Option<&'a RawValue>,
    /// Chat completions' number of replies, each up to the output limit.
    #[serde(borrow, default)]
    pub(crate) n: Option<&'a RawValue>,
    #[serde(borrow, default)]
    pub(crate) stream: Option<&'a RawValue>,
    #[serde(borrow, default)]
    pub(crate) stream_options: Option<&'a RawValue>,
    #[serde(borrow, default)]
    pub(crate) input: Option<&'a RawValue>,
    #[serde(borrow, default)]
    pub(crate) previous_response_id: Option<&'a RawValue>,
    /// The service tier the client asks for (`OpenAI`'s `default`, `flex`, `priority`;
    /// Anthropic's `auto`, `standard_only`).
    #[serde(borrow, default)]
    pub(crate) service_tier: Option<&'a RawValue>,
    /// A Responses call's whole reading, when its fields came from it: translated from it,
    /// not read again. Boxed: inline, the reading (its items included) made every envelope, a
    /// chat call's too, a struct that reading one copied with `memcpy`.
    #[serde(skip)]
    pub(crate) responses: Option<Box<responses::ReadRequest<'a>>>,
}

impl<'a> Fields<'a> {
    /// The tiers the request can be served at: the one its `service_tier` names (`None`: no
    /// word, `auto`, or one the gateway does not know, which any tier may answer).
    pub(crate) fn asked_tier(&self) -> Option<crate::protocol::ServiceTier> {
        let raw = self.service_tier?;
        crate::protocol::ServiceTier::asked(&super::json_string(raw)?).flatten()
    }

    /// The fields of a body that must be a JSON object.
    pub(crate) fn read(body: &'a [u8]) -> Result<Fields<'a>, GatewayError> {
        // serde would also accept an array for a struct; requests are objects.
        if body.trim_ascii_start().first() != Some(&b'{') {
            return Err(GatewayError::InvalidJson);
        }
        super::read_json(body).map_err(|_| GatewayError::InvalidJson)
    }

    /// `model`, which must be a string.
    pub(crate) fn model(&self) -> Result<Model<'a>, GatewayError> {
        let raw = self.model.ok_or(GatewayError::InvalidModelField)?;
        let name = json_string(raw).ok_or(GatewayError::InvalidModelField)?;
        Ok(Model {
            raw: Some(raw),
            name,
        })
    }

    /// `stream`: absent, `false` or `null` for a complete reply; `true` only when streaming is
    /// on.
    pub(crate) fn stream(&self, streaming: bool) -> Result<bool, GatewayError> {
        match self.stream.map(RawValue::get) {
            None | Some("false") | Some("null") => Ok(false),
            Some("true") if streaming => Ok(true),
            Some("true") => Err(GatewayError::StreamingUnsupported),
            Some(_) => Err(GatewayError::InvalidStreamField),
        }
    }

    /// Whether `messages` is a list.
    pub(crate) fn has_messages(&self) -> bool {
        self.messages.is_some_and(|raw| raw.get().starts_with('['))
    }

    /// Whether `input` is a string or a list.
    pub(crate) fn has_input(&self) -> bool {
        self.input
            .is_some_and(|raw| raw.get().starts_with(['"', '[']))
    }

    /// The output limit a request sets: the largest of the ones it gives as whole numbers.
    /// Each protocol has its own name, and a provider may follow any of them (vLLM follows
    /// `max_completion_tokens` over `max_tokens`), so the ceiling covers the one that lets
    /// the most through. A value a provider would refuse is refused there, and refunded.
    pub(crate) fn output_limit(&self) -> Option<u64> {
        [
            self.max_tokens,
            self.max_completion_tokens,
            self.max_output_tokens,
        ]
        .into_iter()
        .flatten()
        .filter_map(|raw| serde_json::from_str::<u64>(raw.get()).ok())
        .max()
    }

    /// The envelope of these fields once the dialect has checked them (`model` among them),
    /// with `stream` checked last.
    pub(crate) fn into_envelope(
        self,
        model: Model<'a>,
        streaming: bool,
    ) -> Result<Envelope<'a>, GatewayError> {
        let stream = self.stream(streaming)?;
        Ok(Envelope {
            fields: self,
            model,
            stream,
            continues: None,
            provider_keeps: None,
        })
    }
}

/// What the mock is asked.
pub(crate) struct MockCall<'a> {
    /// The model called (its catalogue name).
    pub(crate) model: &'a str,
    /// The request, as the upstream would receive it.
    pub(crate) body: &'a [u8],
    /// The mock's count of replies, for their ids.
    pub(crate) serial: u64,
    /// The input tokens the mock reports (the gateway's own estimate from the request's
    /// size, so that token prices can be tried without a provider).
    pub(crate) input_tokens: u64,
    /// Whether the gateway asked the stream's usage on the client's behalf.
    pub(crate) gateway_asks_usage: bool,
    /// The request's translation, when the router made it.
    pub(crate) translation: Option<&'a Translation>,
}
