//! What the layers hand each other about one call, as typed request and response extensions,
//! and the ids they name. Plain data: every layer and upstream may read these, and they know no
//! layer.
//!
//! | Extension       | Added by                                      | Read by                          |
//! |-----------------|-----------------------------------------------|----------------------------------|
//! | [`Caller`]      | [`ApiKeyAuth`](crate::ApiKeyAuth)             | [`CreditCharge`](crate::CreditCharge) |
//! | [`RoutedCall`]  | [`ProtocolRouter`](crate::ProtocolRouter)     | [`CreditCharge`](crate::CreditCharge), the upstream |
//! | [`Reservation`] | [`CreditCharge`](crate::CreditCharge)         | [`RefundOnUpstreamError`](crate::RefundOnUpstreamError) |
//! | [`RequestId`]  | [`RequestIdLayer`](crate::RequestIdLayer)      | [`CreditCharge`](crate::CreditCharge) (the call log), the log lines |
//! | [`ServedBy`] (response) | [`HttpUpstream`](crate::HttpUpstream) | [`RefundOnUpstreamError`](crate::RefundOnUpstreamError) |

use std::ops::Range;
use std::sync::Arc;

use bytes::Bytes;
use chrono::{DateTime, Utc};
use http::HeaderValue;
use serde::Serialize;

use crate::catalogue::ModelRoute;
use crate::credits::Split;
use crate::protocol::Protocol;

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
    /// Whether the client asked for a streamed reply (`stream: true`), which the router lets
    /// through only when streaming is on.
    pub stream: bool,
    /// Byte range of the `model` value (with its quotes) in the body, for renaming it upstream
    /// without re-serialising anything else.
    pub model_span: Range<usize>,
}

impl RoutedCall {
    /// The body to send upstream: the client's bytes, with `model` replaced by `upstream_model`
    /// (a channel's name for the model) when there is one. Nothing else is touched.
    pub fn upstream_body(&self, body: &Bytes, upstream_model: Option<&str>) -> Bytes {
        let Some(upstream_model) = upstream_model else {
            return body.clone();
        };
        let quoted = serde_json::to_string(upstream_model).expect("a string serialises");
        let mut renamed = Vec::with_capacity(body.len() + quoted.len());
        renamed.extend_from_slice(&body[..self.model_span.start]);
        renamed.extend_from_slice(quoted.as_bytes());
        renamed.extend_from_slice(&body[self.model_span.end..]);
        Bytes::from(renamed)
    }
}

/// The upstream (channel) that served a call. Response extension added by [`HttpUpstream`](crate::HttpUpstream),
/// read by [`RefundOnUpstreamError`](crate::RefundOnUpstreamError) for the call log.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ServedBy(pub String);

/// The id of one request: the client's own `x-request-id` when it sent a sane one, else a new
/// one. Request extension added by [`RequestIdLayer`](crate::RequestIdLayer); the answer
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
