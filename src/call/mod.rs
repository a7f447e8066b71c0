//! What the layers hand each other about one call, as typed request and response extensions,
//! and the ids they name. Plain data: every layer and upstream may read these, and they know no
//! layer.
//!
//! | Extension       | Added by                                      | Read by                          |
//! |-----------------|-----------------------------------------------|----------------------------------|
//! | [`Caller`]      | [`ApiKeyAuth`](crate::ApiKeyAuth)             | [`CreditCharge`](crate::CreditCharge) |
//! | [`RoutedCall`]  | [`ProtocolRouter`](crate::ProtocolRouter)     | [`CreditCharge`](crate::CreditCharge), the upstream |
//! | [`Reservation`] | [`CreditCharge`](crate::CreditCharge)         | [`RefundOnUpstreamError`](crate::RefundOnUpstreamError) |
//! | [`RequestId`]  | [`RequestIdLayer`](crate::request_id::RequestIdLayer)      | [`CreditCharge`](crate::CreditCharge) (the call log), the log lines |
//! | [`IdempotencyKey`] | [`ProtocolRouter`](crate::ProtocolRouter) | [`CreditCharge`](crate::CreditCharge), [`RefundOnUpstreamError`](crate::RefundOnUpstreamError) |
//! | [`ServedBy`] (response) | [`HttpUpstream`](crate::upstream::HttpUpstream) | [`RefundOnUpstreamError`](crate::RefundOnUpstreamError) |
//! | [`ClientWrites`] | the server ([`crate::server`] for HTTP/1.1)   | [`RefundOnUpstreamError`](crate::RefundOnUpstreamError) (what a stream bills) |
//! | [`AccessEntry`] | [`AccessLog`](crate::access_log::AccessLog) | noted by [`ApiKeyAuth`](crate::ApiKeyAuth) (key prefix), [`ProtocolRouter`](crate::ProtocolRouter) (model), [`RefundOnUpstreamError`](crate::RefundOnUpstreamError) (outcome, credits; a stream's end writes the line) |

use std::ops::Range;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::task::Waker;

use atomic_waker::AtomicWaker;

use bytes::Bytes;
use chrono::{DateTime, Utc};
use http::HeaderValue;
use serde::Serialize;

use crate::catalogue::ModelRoute;
use crate::credits::{Credits, Split};
use crate::pricing::TierReach;
use crate::protocol::translation::Translation;
use crate::protocol::{Protocol, ServiceTier};

mod access;
mod limit;

pub use access::{ACCESS_LOG_TARGET, AccessEntry};
pub use limit::{KeyLimit, LimitPeriod};

/// An account: the owner of one credit pool.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize)]
#[serde(transparent)]
pub struct AccountId(pub i64);

/// One API key of an account.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize)]
#[serde(transparent)]
pub struct KeyId(pub i64);

/// One call-log entry.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize)]
#[serde(transparent)]
pub struct CallId(pub i64);

/// The authenticated caller. Request extension added by [`ApiKeyAuth`](crate::ApiKeyAuth).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Caller {
    /// Whose credits pay.
    pub account: AccountId,
    /// Which key was presented.
    pub key: KeyId,
}

/// What one key may do, beyond spending its account's credits. Request extension added by
/// [`ApiKeyAuth`](crate::ApiKeyAuth) (which refuses an expired key), read by
/// [`ProtocolRouter`](crate::ProtocolRouter) (the models) and
/// [`RateLimit`](crate::rate_limit::RateLimit) (requests per minute).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct KeyRules {
    /// The models the key may call; `None`: every model in the catalogue.
    pub models: Option<Arc<[String]>>,
    /// When the key stops working; `None`: never.
    pub expires_at: Option<DateTime<Utc>>,
    /// Requests per minute the key may make; `None`: no limit.
    pub rpm: Option<u32>,
    /// Credits the key may spend per period; `None`: all its account has. Enforced by the
    /// store, in the write that reserves a call.
    pub limit: Option<KeyLimit>,
}

impl KeyRules {
    /// Whether the key may call `model`.
    pub fn allows(&self, model: &str) -> bool {
        self.models
            .as_ref()
            .is_none_or(|models| models.iter().any(|allowed| allowed == model))
    }

    /// Whether the key has expired at `now`.
    pub fn expired(&self, now: DateTime<Utc>) -> bool {
        self.expires_at.is_some_and(|expires_at| expires_at <= now)
    }

    /// Whether the key has expired now (the clock is read only for a key that expires).
    pub fn expired_now(&self) -> bool {
        self.expires_at
            .is_some_and(|expires_at| expires_at <= Utc::now())
    }
}

/// Credits taken for a call that is under way. Request extension added by
/// [`CreditCharge`](crate::CreditCharge), consumed by
/// [`RefundOnUpstreamError`](crate::RefundOnUpstreamError).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Reservation {
    /// The `pending` call-log entry.
    pub call: CallId,
    /// Whose credits were taken.
    pub account: AccountId,
    /// How many from each bucket.
    pub taken: Split,
}

/// The resolved call. Request extension added by [`ProtocolRouter`](crate::ProtocolRouter).
#[derive(Debug, Clone)]
pub struct RoutedCall {
    /// The endpoint called.
    pub protocol: Protocol,
    /// The catalogue entry: name, price, upstream.
    pub model: Arc<ModelRoute>,
    /// The name the client called the model by, when it was one of its aliases (the call log
    /// keeps it beside the catalogue name).
    pub alias: Option<Arc<str>>,
    /// Whether the client asked for a streamed reply (`stream: true`), which the router lets
    /// through only when streaming is on.
    pub stream: bool,
    /// The upstream (by catalogue name) that alone may serve this call: a Responses call that
    /// continues a stored response goes where that response is kept. `None`: any channel.
    pub upstream: Option<Arc<str>>,
    /// The stored response a Responses call continues (`previous_response_id`), until the
    /// router has found who made it.
    pub(crate) continues: Option<Arc<str>>,
    /// The request's translation for a provider of another dialect, as the router made it to
    /// check that it translates, so that the upstream sends it without doing it again.
    translation: Option<Arc<Translation>>,
    /// Whether a Responses request lets the provider keep its response (`store` not `false`),
    /// as the router read it; `None` when it did not (see
    /// [`kept_by_provider`](Self::kept_by_provider)).
    provider_keeps: Option<bool>,
    /// Input tokens the request holds, estimated from its size (what a token-priced call whose
    /// provider reported no input is charged for).
    pub input_estimate: u64,
    /// The most input tokens the request can hold as a provider counts them (for a
    /// token-priced model's reservation; see [`reservation`](Self::reservation) and
    /// [`input_ceiling_tokens`](crate::pricing::input_ceiling_tokens)).
    pub input_ceiling: u64,
    /// The largest output limit the client set (`max_tokens`, `max_completion_tokens`,
    /// `max_output_tokens`: a provider may follow any of them), if any.
    pub output_limit: Option<u64>,
    /// How many replies the client asked for (`n`), each up to the output limit; 1 unless set.
    pub replies: u64,
    /// The service tier the client asked for (the request's `service_tier`, or the header the
    /// catalogue names in `service_tier_header`); `None`: the provider's choice, any tier.
    pub asked_tier: Option<ServiceTier>,
    /// A chat stream of a token-priced model whose client did not ask for its usage: the
    /// gateway asks the provider for it (`stream_options.include_usage`), and the chunk that
    /// carries it is not passed on (a client that did not ask may not expect a chunk without
    /// choices).
    pub gateway_asks_usage: bool,
    /// Whether the client set `stream_options` of its own (without `include_usage: true`), which
    /// the gateway's request for usage then overrides.
    client_stream_options: bool,
    /// Byte range of the `model` value (with its quotes) in the body the router read, for
    /// renaming it upstream without re-serialising anything else; `None` for a call built by
    /// hand. Private: a range that did not come from the body could cut it anywhere.
    model_span: Option<Range<usize>>,
}

impl RoutedCall {
    /// A resolved call built by hand (the router builds its own, knowing where `model` sits in
    /// the body).
    pub fn new(protocol: Protocol, model: Arc<ModelRoute>, stream: bool) -> RoutedCall {
        RoutedCall {
            protocol,
            model,
            alias: None,
            stream,
            upstream: None,
            continues: None,
            translation: None,
            provider_keeps: None,
            input_estimate: 0,
            input_ceiling: 0,
            output_limit: None,
            replies: 1,
            asked_tier: None,
            gateway_asks_usage: false,
            client_stream_options: false,
            model_span: None,
        }
    }

    /// What the call's reservation holds: the model's price per call, or, for a model priced by
    /// tokens, the most the call can cost ([`Pricing::ceiling`](crate::pricing::Pricing::ceiling)):
    /// its [`input_ceiling`](Self::input_ceiling), and its
    /// [`output_ceiling`](Self::output_ceiling), at the dearest tier it can reach
    /// ([`asked_tier`](Self::asked_tier), else any).
    pub fn reservation(&self) -> Credits {
        self.model.pricing.ceiling_reaching(
            self.input_ceiling,
            self.output_ceiling(),
            self.tier_reach(),
        )
    }

    /// The tiers the call can be served at.
    pub fn tier_reach(&self) -> TierReach {
        self.asked_tier.map_or(TierReach::Any, TierReach::Asked)
    }

    /// The most output the call can bring: the client's largest output limit, or else the
    /// model's `max_output_tokens`, for each reply asked for.
    pub fn output_ceiling(&self) -> u64 {
        self.output_limit
            .or(self.model.max_output_tokens.map(u64::from))
            .unwrap_or(0)
            .saturating_mul(self.replies.max(1))
    }

    /// The most input a provider's report for this call may claim: the model's context window,
    /// else the call's [`input_ceiling`](Self::input_ceiling).
    pub fn input_bound(&self) -> u64 {
        self.model
            .context_window
            .map_or(self.input_ceiling, u64::from)
    }

    /// The call as the router resolved it from a body, `model` at `span` in it (by `alias`, if
    /// the client used one).
    pub(crate) fn from_body(
        protocol: Protocol,
        model: Arc<ModelRoute>,
        alias: Option<Arc<str>>,
        stream: bool,
        span: Option<Range<usize>>,
    ) -> RoutedCall {
        RoutedCall {
            model_span: span,
            alias,
            ..RoutedCall::new(protocol, model, stream)
        }
    }

    /// The request's translation, when the router made it (a call on a model with a channel
    /// that translates it), from the request's body.
    pub(crate) fn translation(&self) -> Option<Arc<Translation>> {
        self.translation.clone()
    }

    /// The tools the call's translation left out, comma-separated (a name holding a comma left
    /// out), if any: what the call log keeps.
    pub fn dropped_tools(&self) -> Option<String> {
        let translation = self.translation.as_ref()?;
        let names: Vec<&str> = translation
            .dropped_tools()
            .into_iter()
            .filter(|name| !name.contains(','))
            .collect();
        (!names.is_empty()).then(|| names.join(", "))
    }

    /// Whether the Responses request `body` (this call's) lets the provider keep its response:
    /// as the router read it, or else read from `body`.
    pub(crate) fn kept_by_provider(&self, body: &[u8]) -> bool {
        self.provider_keeps
            .unwrap_or_else(|| crate::protocol::responses::kept_by_provider(body))
    }

    /// Keeps what the router read of the request's `store` (see
    /// [`kept_by_provider`](Self::kept_by_provider)).
    pub(crate) fn keep_provider_keeps(&mut self, keeps: bool) {
        self.provider_keeps = Some(keeps);
    }

    /// Keeps the request's translation (see [`translation`](Self::translation)).
    pub(crate) fn keep_translation(&mut self, translation: Translation) {
        self.translation = Some(Arc::new(translation));
    }

    /// The body to send upstream: the client's bytes, with `model` replaced by `upstream_model`
    /// (a channel's name for the model) when there is one, else by the catalogue name when the
    /// client called the model by an alias. Nothing else is touched when the router read this
    /// body; a call built by hand has its body re-serialised with the new `model` (a body that
    /// is not a JSON object goes as it is).
    pub fn upstream_body(&self, body: &Bytes, upstream_model: Option<&str>) -> Bytes {
        let renamed = self.renamed_body(body, upstream_model);
        if self.gateway_asks_usage {
            if self.client_stream_options {
                return usage_asked_over(&renamed);
            }
            return usage_asked(&renamed);
        }
        renamed
    }

    /// The gateway asks for the stream's usage over the client's own `stream_options` (which
    /// did not ask for it): see [`gateway_asks_usage`](Self::gateway_asks_usage).
    pub(crate) fn ask_usage_over_clients_options(&mut self) {
        self.gateway_asks_usage = true;
        self.client_stream_options = true;
    }

    fn renamed_body(&self, body: &Bytes, upstream_model: Option<&str>) -> Bytes {
        if !self.protocol.dialect().model_in_body() {
            return body.clone();
        }
        let by_alias = self.alias.is_some().then_some(self.model.name.as_str());
        let Some(upstream_model) = upstream_model.or(by_alias) else {
            return body.clone();
        };
        let span = self.model_span.clone().filter(|span| {
            body.get(span.clone())
                .is_some_and(|value| value.first() == Some(&b'"'))
        });
        let Some(span) = span else {
            return renamed_by_parsing(body, upstream_model);
        };
        self.splice(body, span, upstream_model)
    }

    fn splice(&self, body: &Bytes, span: Range<usize>, upstream_model: &str) -> Bytes {
        let quoted = serde_json::to_string(upstream_model).expect("a string serialises");
        let mut renamed = Vec::with_capacity(body.len() + quoted.len());
        renamed.extend_from_slice(&body[..span.start]);
        renamed.extend_from_slice(quoted.as_bytes());
        renamed.extend_from_slice(&body[span.end..]);
        Bytes::from(renamed)
    }
}

/// A chat request `body` (an object with fields, that has no `stream_options`) asking for the
/// stream's usage: `"stream_options":{"include_usage":true}` as its first field.
fn usage_asked(body: &Bytes) -> Bytes {
    let Some(open) = body.iter().position(|byte| *byte == b'{') else {
        return body.clone();
    };
    const ASKED: &[u8] = br#""stream_options":{"include_usage":true},"#;
    let mut asked = Vec::with_capacity(body.len() + ASKED.len());
    asked.extend_from_slice(&body[..=open]);
    asked.extend_from_slice(ASKED);
    asked.extend_from_slice(&body[open + 1..]);
    Bytes::from(asked)
}

/// A chat request `body` whose `stream_options` did not ask for the stream's usage, asking for
/// it (`include_usage` set to `true`, its other options kept), re-serialised: only for a client
/// that set options of its own, so the common request keeps its bytes.
fn usage_asked_over(body: &Bytes) -> Bytes {
    let Ok(serde_json::Value::Object(mut object)) = serde_json::from_slice(body) else {
        return body.clone();
    };
    let options = object
        .entry("stream_options")
        .or_insert_with(|| serde_json::Value::Object(serde_json::Map::new()));
    if !options.is_object() {
        *options = serde_json::Value::Object(serde_json::Map::new());
    }
    if let Some(options) = options.as_object_mut() {
        options.insert("include_usage".into(), true.into());
    }
    serde_json::to_vec(&object).map_or_else(|_| body.clone(), Bytes::from)
}

/// `body` with its `model` set to `model`, re-serialised; as it is if it is not a JSON object.
fn renamed_by_parsing(body: &Bytes, model: &str) -> Bytes {
    match serde_json::from_slice::<serde_json::Value>(body) {
        Ok(serde_json::Value::Object(mut object)) => {
            object.insert("model".into(), model.into());
            serde_json::to_vec(&object).map_or_else(|_| body.clone(), Bytes::from)
        }
        _ => body.clone(),
    }
}

/// A call's `Idempotency-Key` with the fingerprint of the request it came with. Request
/// extension added by [`ProtocolRouter`](crate::ProtocolRouter) when the client sent the
/// header; [`CreditCharge`](crate::CreditCharge) bills at most one call per account and key
/// (see [`Ledger::reserve`](crate::Ledger::reserve)), and
/// [`RefundOnUpstreamError`](crate::RefundOnUpstreamError) keeps the reply for a retry.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct IdempotencyKey {
    key: Arc<str>,
    fingerprint: [u8; 32],
}

impl IdempotencyKey {
    /// The request header that carries it.
    pub const HEADER: &'static str = "idempotency-key";

    /// The longest key accepted, in bytes (Stripe's and the SDKs' keys are far shorter).
    pub const MAX_LEN: usize = 255;

    /// The key `key` for a request to `path` with `body`; `None` if the key is empty, longer
    /// than [`MAX_LEN`](Self::MAX_LEN) or not visible ASCII. The fingerprint is the SHA-256 of
    /// the path and the body exactly as sent, so a retry of the same request matches and any
    /// other request does not.
    pub fn new(key: &str, path: &str, body: &[u8]) -> Option<IdempotencyKey> {
        let sane = |key: &str| {
            (1..=Self::MAX_LEN).contains(&key.len()) && key.bytes().all(|b| b.is_ascii_graphic())
        };
        if !sane(key) {
            return None;
        }
        use sha2::Digest;
        let mut hasher = sha2::Sha256::new();
        hasher.update(path.as_bytes());
        hasher.update([0]);
        hasher.update(body);
        Some(IdempotencyKey {
            key: Arc::from(key),
            fingerprint: hasher.finalize().into(),
        })
    }

    /// The key as the client sent it.
    pub fn key(&self) -> &str {
        &self.key
    }

    /// The request's fingerprint, as 64 hexadecimal digits (how the stores keep it).
    pub fn fingerprint(&self) -> String {
        hex::encode(self.fingerprint)
    }

    /// The key, shared (for a store that keeps it in memory while its call runs).
    #[cfg_attr(not(feature = "sqlite"), allow(dead_code))] // an owned SQLite file's
    pub(crate) fn shared_key(&self) -> Arc<str> {
        Arc::clone(&self.key)
    }
}

/// How far a client's connection has written what it was handed to its socket. Request
/// extension added by the server, for HTTP/1.1 ([`crate::server`] adds it); read by
/// [`RefundOnUpstreamError`](crate::RefundOnUpstreamError), which then bills a stream whose
/// client goes away only for content the socket accepted.
///
/// A server adds one per connection and calls [`flushed`](Self::flushed) each time the
/// connection has handed everything it held to its socket (hyper's HTTP/1.1 flushes its socket
/// only once its write buffer is empty). Without it (HTTP/2, or a server that does not count),
/// a stream's content counts as written once the server has asked for the frame after it: on
/// hyper's HTTP/2 that is once the flow-control window has let it through.
#[derive(Debug, Clone, Default)]
pub struct ClientWrites(Arc<Flushes>);

#[derive(Debug, Default)]
struct Flushes {
    count: AtomicU64,
    /// The response body waiting for the next flush (HTTP/1.1 writes one response at a time).
    waiting: AtomicWaker,
}

impl ClientWrites {
    /// A new count, for a new connection.
    pub fn new() -> ClientWrites {
        ClientWrites::default()
    }

    /// The connection has handed everything it held to its socket.
    pub fn flushed(&self) {
        self.0.count.fetch_add(1, Ordering::Release);
        self.0.waiting.wake();
    }

    /// How many times [`flushed`](Self::flushed) has been called: a frame handed to the
    /// connection when this said `n` is in the socket once it says more than `n`.
    pub fn flushes(&self) -> u64 {
        self.0.count.load(Ordering::Acquire)
    }

    /// Wakes `waker` at the next flush (one waiter at a time: the response being written).
    pub fn wake_at_next_flush(&self, waker: &Waker) {
        self.0.waiting.register(waker);
    }
}

/// The upstream (channel) that served a call. Response extension added by [`HttpUpstream`](crate::upstream::HttpUpstream),
/// read by [`RefundOnUpstreamError`](crate::RefundOnUpstreamError) for the call log.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ServedBy(pub String);

/// The provider's usage object exactly as it reported it (JSON text), before any translation.
/// Response extension added by [`HttpUpstream`](crate::upstream::HttpUpstream) for a complete
/// reply, read by [`RefundOnUpstreamError`](crate::RefundOnUpstreamError) for the call log.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RawUsage(pub String);

/// The protocol the upstream that served a call spoke: another than the call's endpoint when it
/// translated the call. Response extension added by [`HttpUpstream`](crate::upstream::HttpUpstream)
/// beside [`ServedBy`]; the call log keeps it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Spoke(pub Protocol);

/// The id of one request: the client's own `x-request-id` when it sent a sane one, else a new
/// one. Request extension added by [`RequestIdLayer`](crate::request_id::RequestIdLayer); the answer
/// carries it as `x-request-id`, the call log keeps it, and the provider is sent it.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct RequestId(HeaderValue);

impl RequestId {
    /// Longest client-chosen id kept; a longer one is replaced.
    pub const MAX_LEN: usize = 128;

    /// The client's id, if it is sane: 1 to [`MAX_LEN`](Self::MAX_LEN) visible ASCII
    /// characters.
    pub fn from_client(value: &HeaderValue) -> Option<RequestId> {
        let bytes = value.as_bytes();
        let sane = !bytes.is_empty()
            && bytes.len() <= RequestId::MAX_LEN
            && bytes.iter().all(u8::is_ascii_graphic);
        sane.then(|| RequestId(value.clone()))
    }

    /// A new id: `req_` and 32 random hexadecimal digits.
    pub fn generate() -> RequestId {
        let mut id = *b"req_00000000000000000000000000000000";
        // Sixteen random bytes as 32 hexadecimal digits after the prefix; cannot fail.
        let _ = hex::encode_to_slice(fastrand::u128(..).to_be_bytes(), &mut id[4..]);
        RequestId(HeaderValue::from_bytes(&id).expect("ASCII letters and digits"))
    }

    /// The id as text.
    pub fn as_str(&self) -> &str {
        // Only visible ASCII is ever kept.
        self.0.to_str().unwrap_or_default()
    }

    /// The id as the header value that carries it.
    pub fn header_value(&self) -> &HeaderValue {
        &self.0
    }
}

impl std::fmt::Display for RequestId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::catalogue::Catalogue;

    fn model() -> Arc<ModelRoute> {
        Catalogue::demo().model("gpt-4o-mini").unwrap().clone()
    }

    #[test]
    fn a_routed_body_has_only_its_model_renamed() {
        let body = Bytes::from_static(br#"{"z":1,  "model" : "gpt-4o-mini","a":[2]}"#);
        let start = body
            .windows(13)
            .position(|w| w == b"\"gpt-4o-mini\"")
            .unwrap();
        let routed = RoutedCall::from_body(
            Protocol::ChatCompletions,
            model(),
            None,
            false,
            Some(start..start + 13),
        );
        assert_eq!(
            routed.upstream_body(&body, Some("gpt-4o-mini-2024")),
            Bytes::from_static(br#"{"z":1,  "model" : "gpt-4o-mini-2024","a":[2]}"#)
        );
        assert_eq!(routed.upstream_body(&body, None), body);
    }

    #[test]
    fn a_hand_built_call_renames_by_parsing_and_never_cuts_the_body() {
        let routed = RoutedCall::new(Protocol::ChatCompletions, model(), false);
        let body = Bytes::from_static(br#"{"model":"gpt-4o-mini","messages":[]}"#);
        let renamed: serde_json::Value =
            serde_json::from_slice(&routed.upstream_body(&body, Some("other"))).unwrap();
        assert_eq!(
            renamed,
            serde_json::json!({"model": "other", "messages": []})
        );
        let not_json = Bytes::from_static(b"not json");
        assert_eq!(routed.upstream_body(&not_json, Some("other")), not_json);
    }
}
