//! Events an operator's systems hear about through signed webhooks: what happened, to whom,
//! when. Each has an id (deliveries of one event, retried or repeated, carry the same id, so a
//! receiver that has seen it can ignore it), a type, a time and its data, and is delivered as
//! `POST` JSON `{"id", "type", "created_at", "data"}` with the header
//! `x-gateway-signature: t=<unix seconds>,v1=<hex HMAC-SHA256(secret, "<t>.<body>")>`
//! (Stripe's scheme).
//!
//! A receiver checks the signature over the body exactly as received, and that the time is
//! recent (so a recorded delivery cannot be replayed later):
//!
//! ```
//! use model_gateway::events::{sign, verify};
//!
//! let body = br#"{"id":"evt_1","type":"code.redeemed","created_at":"2026-11-26T12:00:00Z","data":{}}"#;
//! let header = sign("whsec_test", 1_764_158_400, body);
//! assert!(header.starts_with("t=1764158400,v1="));
//! assert!(verify("whsec_test", &header, body, 1_764_158_400 + 60, 300));
//! assert!(!verify("whsec_test", &header, body, 1_764_158_400 + 3600, 300)); // too old
//! assert!(!verify("another secret", &header, body, 1_764_158_400, 300));
//! ```

use chrono::{DateTime, Utc};
use hmac::{Hmac, KeyInit, Mac};
use serde::Serialize;
use serde_json::Value;
use sha2::Sha256;

use crate::call::{AccountId, KeyId, KeyLimit};
use crate::credits::{Balance, Credits};

/// The header a delivery's signature is in.
pub const SIGNATURE_HEADER: &str = "x-gateway-signature";

/// What happened.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
pub enum EventType {
    /// An account's balance fell below its threshold.
    #[serde(rename = "account.balance_low")]
    AccountBalanceLow,
    /// A key spent what its limit allows in the current period.
    #[serde(rename = "key.limit_reached")]
    KeyLimitReached,
    /// Subscription credits lapsed at the end of their period.
    #[serde(rename = "subscription.lapsed")]
    SubscriptionLapsed,
    /// A redemption code was redeemed.
    #[serde(rename = "code.redeemed")]
    CodeRedeemed,
    /// An upstream's circuit breaker opened: it is skipped for a cool-down.
    #[serde(rename = "upstream.breaker_opened")]
    UpstreamBreakerOpened,
    /// An upstream's circuit breaker closed: it answers again.
    #[serde(rename = "upstream.breaker_closed")]
    UpstreamBreakerClosed,
    /// A call cost more than it was charged (its ceiling, or what the account and the key's
    /// limit allowed beyond it): the difference is the operator's.
    #[serde(rename = "call.shortfall")]
    CallShortfall,
}

impl EventType {
    /// Every type.
    pub const ALL: [EventType; 7] = [
        EventType::AccountBalanceLow,
        EventType::KeyLimitReached,
        EventType::SubscriptionLapsed,
        EventType::CodeRedeemed,
        EventType::UpstreamBreakerOpened,
        EventType::UpstreamBreakerClosed,
        EventType::CallShortfall,
    ];

    /// The type named `name` on the wire; `None` for an unknown name.
    pub fn parse(name: &str) -> Option<EventType> {
        EventType::ALL
            .into_iter()
            .find(|kind| kind.as_str() == name)
    }

    /// Its name on the wire (`code.redeemed`, ...).
    pub fn as_str(self) -> &'static str {
        match self {
            EventType::AccountBalanceLow => "account.balance_low",
            EventType::KeyLimitReached => "key.limit_reached",
            EventType::SubscriptionLapsed => "subscription.lapsed",
            EventType::CodeRedeemed => "code.redeemed",
            EventType::UpstreamBreakerOpened => "upstream.breaker_opened",
            EventType::UpstreamBreakerClosed => "upstream.breaker_closed",
            EventType::CallShortfall => "call.shortfall",
        }
    }
}

/// One event, as delivered.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct WebhookEvent {
    /// `evt_` and 24 hex digits; the same for every delivery of this event.
    pub id: String,
    /// What happened.
    #[serde(rename = "type")]
    pub kind: EventType,
    /// When.
    pub created_at: DateTime<Utc>,
    /// About what: the account, key, batch, upstream, amounts.
    pub data: Value,
}

impl WebhookEvent {
    /// A new event of `kind` about `data`, at `at`, with a fresh id.
    pub fn new(kind: EventType, data: Value, at: DateTime<Utc>) -> WebhookEvent {
        let mut random = [0u8; 12];
        getrandom::fill(&mut random).expect("the operating system's random source is available");
        WebhookEvent {
            id: format!("evt_{}", hex::encode(random)),
            kind,
            created_at: at,
            data,
        }
    }

    /// `account.balance_low`: what `account` can spend, `spendable`, fell below `threshold`.
    pub(crate) fn balance_low(
        account: AccountId,
        spendable: Balance,
        threshold: Credits,
        at: DateTime<Utc>,
    ) -> WebhookEvent {
        let data = serde_json::json!({
            "account": account,
            "subscription": spendable.subscription,
            "topup": spendable.topup,
            "total": spendable.total(),
            "threshold": threshold,
        });
        WebhookEvent::new(EventType::AccountBalanceLow, data, at)
    }

    /// `call.shortfall`: `call` of `key` of `account` cost `cost` and was charged `charged`
    /// (`usage_rejected`: on a usage report the gateway did not trust).
    pub(crate) fn shortfall(
        caller: crate::call::Caller,
        call: crate::call::CallId,
        cost: Credits,
        charged: Credits,
        usage_rejected: bool,
        at: DateTime<Utc>,
    ) -> WebhookEvent {
        let data = serde_json::json!({
            "account": caller.account,
            "key": caller.key,
            "call": call.0,
            "cost": cost,
            "charged": charged,
            "shortfall": cost.get() - charged.get(),
            "usage_rejected": usage_rejected,
        });
        WebhookEvent::new(EventType::CallShortfall, data, at)
    }

    /// `key.limit_reached`: `key` of `account` has spent `spent` of its `limit` in the window
    /// of `at`, too little being left for another call like the one just reserved.
    pub(crate) fn limit_reached(
        account: AccountId,
        key: KeyId,
        limit: KeyLimit,
        spent: Credits,
        at: DateTime<Utc>,
    ) -> WebhookEvent {
        let data = serde_json::json!({
            "account": account,
            "key": key,
            "limit": limit,
            "spent": spent,
            "resets_at": limit.period.window_end(limit.period.window(at)),
        });
        WebhookEvent::new(EventType::KeyLimitReached, data, at)
    }

    /// The body delivered: `{"id", "type", "created_at", "data"}`.
    pub fn body(&self) -> String {
        serde_json::to_string(self).expect("an event serializes")
    }
}

fn mac(secret: &str, timestamp: i64, body: &[u8]) -> Hmac<Sha256> {
    let mut mac =
        <Hmac<Sha256> as KeyInit>::new_from_slice(secret.as_bytes()).expect("HMAC takes any key");
    mac.update(timestamp.to_string().as_bytes());
    mac.update(b".");
    mac.update(body);
    mac
}

/// The signature header's value for `body` sent at `timestamp` (unix seconds):
/// `t=<timestamp>,v1=<hex HMAC-SHA256(secret, "<timestamp>.<body>")>`.
pub fn sign(secret: &str, timestamp: i64, body: &[u8]) -> String {
    let signature = hex::encode(mac(secret, timestamp, body).finalize().into_bytes());
    format!("t={timestamp},v1={signature}")
}

/// Whether `header` signs `body` with `secret` (compared in constant time), at a time no more
/// than `tolerance_secs` from `now` (unix seconds).
pub fn verify(secret: &str, header: &str, body: &[u8], now: i64, tolerance_secs: i64) -> bool {
    let mut timestamp = None;
    let mut signatures = Vec::new();
    for part in header.split(',') {
        match part.trim().split_once('=') {
            Some(("t", value)) => timestamp = value.parse::<i64>().ok(),
            Some(("v1", value)) => signatures.extend(hex::decode(value).ok()),
            _ => {}
        }
    }
    let Some(timestamp) = timestamp else {
        return false;
    };
    if (now - timestamp).abs() > tolerance_secs {
        return false;
    }
    signatures
        .iter()
        .any(|signature| mac(secret, timestamp, body).verify_slice(signature).is_ok())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_event_is_delivered_as_id_type_time_and_data() {
        let at = DateTime::parse_from_rfc3339("2026-11-26T12:00:00Z")
            .unwrap()
            .with_timezone(&Utc);
        let event = WebhookEvent::new(EventType::CodeRedeemed, serde_json::json!({"batch": 3}), at);
        assert!(event.id.starts_with("evt_") && event.id.len() == 28);
        let body: Value = serde_json::from_str(&event.body()).unwrap();
        assert_eq!(body["type"], "code.redeemed");
        assert_eq!(body["created_at"], "2026-11-26T12:00:00Z");
        assert_eq!(body["data"]["batch"], 3);
        assert_eq!(body.as_object().unwrap().len(), 4);
    }

    #[test]
    fn a_signature_is_refused_for_another_body_or_a_bad_header() {
        let header = sign("s", 100, b"body");
        assert!(verify("s", &header, b"body", 100, 0));
        assert!(!verify("s", &header, b"Body", 100, 0));
        assert!(!verify("s", "v1=00", b"body", 100, 0));
        assert!(!verify("s", "t=100,v1=zz", b"body", 100, 0));
    }
}
