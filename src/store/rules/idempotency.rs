//! Calls billed at most once per idempotency key: the rule every store applies when a
//! reservation carries an [`IdempotencyKey`], and the reply a store keeps for a retry.
//!
//! A keyed call's record is the pair (account, key) → (the request's fingerprint, the call-log
//! entry of the call that holds the key, when it was made, and once it was billed its reply).
//! What a new call with that key gets follows from the entry's status, so there is no second
//! state to keep in step with the ledger:
//!
//! | Record found                       | Answer                                          |
//! |------------------------------------|-------------------------------------------------|
//! | none, or older than the window (its call ended) | a new reservation; the record now names it |
//! | another fingerprint                | [`ReserveError::IdempotencyKeyReused`] (422)     |
//! | its call `pending`                 | [`ReserveError::IdempotentCallRunning`] (409)    |
//! | its call `ok`                      | [`ReserveError::AlreadyAnswered`] with the kept reply (replayed, uncharged) |
//! | its call `refunded`                | a new reservation; the record now names it      |
//!
//! The record is read and written in the transaction that reserves, under the account's lock,
//! so concurrent calls with one key (on any gateway sharing the database) make one reservation.
//! The reply is written in the transaction that settles, so a billed call's reply is kept
//! exactly when the call is `ok`.

#[cfg(test)]
use bytes::Bytes;
use chrono::{DateTime, Utc};

use crate::call::IdempotencyKey;
#[cfg(test)]
use crate::store::types::MAX_KEPT_REPLY_BYTES;
use crate::store::types::{CallStatus, KeptReply, ReserveError};

/// How long a key holds after the call that took it: a retry within it is answered from the
/// record, a call after it is a new call (and takes the key anew). Records older than this are
/// deleted by [`Ledger::forget_idempotent_calls`](crate::store::Ledger::forget_idempotent_calls).
pub const DEFAULT_IDEMPOTENCY_WINDOW: std::time::Duration =
    std::time::Duration::from_secs(24 * 60 * 60);

/// A keyed call's record as a store reads it, under the account's lock.
#[derive(Debug, Clone)]
pub struct KeyedCall {
    /// The request's fingerprint (an [`IdempotencyKey`]'s).
    pub fingerprint: String,
    /// Its call's status.
    pub status: CallStatus,
    /// When the record was made.
    pub created_at: DateTime<Utc>,
    /// The reply kept with its settle, if any.
    pub reply: Option<KeptReply>,
}

/// What a keyed reservation does, given the record under its key.
#[derive(Debug)]
pub enum KeyedDecision {
    /// Reserve as usual, and insert the record or point it at the new call.
    Reserve,
    /// Answer without reserving.
    Answer(ReserveError),
}

/// A record made at or before this moment is past `window` at `now`; `None` when none can be
/// (a window reaching before the earliest time). The one statement of "past its window", for
/// the rule below and for forgetting records.
pub fn window_cutoff(now: DateTime<Utc>, window: std::time::Duration) -> Option<DateTime<Utc>> {
    chrono::Duration::from_std(window)
        .ok()
        .and_then(|window| now.checked_sub_signed(window))
}

/// The rule of the table in the module docs.
pub fn decide(
    found: Option<KeyedCall>,
    key: &IdempotencyKey,
    now: DateTime<Utc>,
    window: std::time::Duration,
) -> KeyedDecision {
    let Some(found) = found else {
        return KeyedDecision::Reserve;
    };
    // A running call keeps its key however long it runs: its outcome is not known yet.
    let past_window = window_cutoff(now, window).is_some_and(|cutoff| found.created_at <= cutoff);
    if found.status != CallStatus::Pending && past_window {
        return KeyedDecision::Reserve;
    }
    if found.fingerprint != key.fingerprint() {
        return KeyedDecision::Answer(ReserveError::IdempotencyKeyReused);
    }
    match found.status {
        CallStatus::Pending => KeyedDecision::Answer(ReserveError::IdempotentCallRunning),
        CallStatus::Ok => KeyedDecision::Answer(ReserveError::AlreadyAnswered(found.reply)),
        CallStatus::Refunded => KeyedDecision::Reserve,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn found(status: CallStatus, fingerprint: &str, age_secs: i64) -> KeyedCall {
        KeyedCall {
            fingerprint: fingerprint.to_owned(),
            status,
            created_at: Utc::now() - chrono::Duration::seconds(age_secs),
            reply: KeptReply::new(200, None, Bytes::from_static(b"{}")),
        }
    }

    fn decide_now(found: Option<KeyedCall>, key: &IdempotencyKey) -> KeyedDecision {
        decide(found, key, Utc::now(), DEFAULT_IDEMPOTENCY_WINDOW)
    }

    #[test]
    fn each_row_of_the_table() {
        let key = IdempotencyKey::new("k", "/v1/messages", b"{}").unwrap();
        let same = key.fingerprint();
        let day = 24 * 60 * 60;
        assert!(matches!(decide_now(None, &key), KeyedDecision::Reserve));
        assert!(matches!(
            decide_now(Some(found(CallStatus::Ok, "other", 5)), &key),
            KeyedDecision::Answer(ReserveError::IdempotencyKeyReused)
        ));
        assert!(matches!(
            decide_now(Some(found(CallStatus::Pending, &same, 5)), &key),
            KeyedDecision::Answer(ReserveError::IdempotentCallRunning)
        ));
        assert!(matches!(
            decide_now(Some(found(CallStatus::Ok, &same, 5)), &key),
            KeyedDecision::Answer(ReserveError::AlreadyAnswered(Some(_)))
        ));
        assert!(matches!(
            decide_now(Some(found(CallStatus::Refunded, &same, 5)), &key),
            KeyedDecision::Reserve
        ));
        // Past the window, even another request may take the key; a running call keeps it.
        assert!(matches!(
            decide_now(Some(found(CallStatus::Ok, "other", day + 1)), &key),
            KeyedDecision::Reserve
        ));
        assert!(matches!(
            decide_now(Some(found(CallStatus::Pending, &same, day + 1)), &key),
            KeyedDecision::Answer(ReserveError::IdempotentCallRunning)
        ));
    }

    #[test]
    fn a_window_longer_than_time_keeps_every_key() {
        let key = IdempotencyKey::new("k", "/v1/messages", b"{}").unwrap();
        let huge = std::time::Duration::from_secs(u64::MAX);
        let ended = found(CallStatus::Ok, "other", 10 * 365 * 24 * 60 * 60);
        assert!(matches!(
            decide(Some(ended), &key, Utc::now(), huge),
            KeyedDecision::Answer(ReserveError::IdempotencyKeyReused)
        ));
        assert_eq!(window_cutoff(Utc::now(), huge), None);
    }

    #[test]
    fn a_reply_over_the_limit_is_not_kept() {
        let big = Bytes::from(vec![b'x'; MAX_KEPT_REPLY_BYTES + 1]);
        assert!(KeptReply::new(200, None, big).is_none());
        let fits = Bytes::from(vec![b'x'; MAX_KEPT_REPLY_BYTES]);
        assert!(KeptReply::new(200, None, fits).is_some());
    }

    #[test]
    fn keys_are_checked_and_fingerprints_tell_requests_apart() {
        assert!(IdempotencyKey::new("", "/p", b"").is_none());
        assert!(IdempotencyKey::new("a b", "/p", b"").is_none());
        assert!(IdempotencyKey::new(&"k".repeat(256), "/p", b"").is_none());
        let key = |path, body| IdempotencyKey::new("k", path, body).unwrap().fingerprint();
        assert_eq!(key("/p", b"{}"), key("/p", b"{}"));
        assert_ne!(key("/p", b"{}"), key("/p", b"{ }"));
        assert_ne!(key("/p", b"{}"), key("/q", b"{}"));
    }
}
