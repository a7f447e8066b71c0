//! The values the storage traits exchange: what a reservation is asked, how a call ended, the
//! call log's record, the errors. A leaf: the traits (`super::traits`), the records
//! (`super::records`) and every backend build on it.

use bytes::Bytes;
use chrono::{DateTime, Utc};
use serde::Serialize;

use crate::call::{AccountId, CallId, Caller, IdempotencyKey, KeyId, KeyRules};
use crate::credits::{Bucket, Credits};
use crate::error::UpstreamError;
use crate::money::Money;
use crate::protocol::{Protocol, ServiceTier, TokenUsage};

/// The largest reply kept for a retry, in bytes. A billed call with a larger reply keeps none,
/// and a retry is told so (409) rather than billed again.
pub const MAX_KEPT_REPLY_BYTES: usize = 1024 * 1024;

/// A billed call's reply, as kept for a retry with the same idempotency key.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KeptReply {
    /// The HTTP status the client got.
    pub status: u16,
    /// Its `Content-Type`, if it had one.
    pub content_type: Option<String>,
    /// The body exactly as the client got it (a stream's events, one after another).
    pub body: Bytes,
}

impl KeptReply {
    /// A reply to keep; `None` if its body is larger than [`MAX_KEPT_REPLY_BYTES`].
    pub fn new(status: u16, content_type: Option<String>, body: Bytes) -> Option<KeptReply> {
        (body.len() <= MAX_KEPT_REPLY_BYTES).then_some(KeptReply {
            status,
            content_type,
            body,
        })
    }
}

/// What [`Ledger::reserve`](crate::store::Ledger::reserve) is asked to charge. Built with
/// [`ChargeRequest::new`] (fields may be added, so it has no struct literal outside the crate):
///
/// ```
/// use model_gateway::{AccountId, Credits, KeyId, Protocol, store::{Caller, ChargeRequest}};
///
/// let caller = Caller { account: AccountId(1), key: KeyId(1) };
/// let charge = ChargeRequest::new(caller, Protocol::ChatCompletions, "gpt-4o-mini", Credits::new(2))
///     .with_request_id(Some("req_1"));
/// assert_eq!(charge.request_id, Some("req_1"));
/// ```
#[derive(Debug, Clone, Copy)]
#[non_exhaustive]
pub struct ChargeRequest<'a> {
    /// Who pays.
    pub caller: Caller,
    /// The endpoint called.
    pub protocol: Protocol,
    /// The model's catalogue name.
    pub model: &'a str,
    /// The name the client called the model by, when it was one of its aliases; kept in the
    /// call log beside [`model`](Self::model).
    pub requested_model: Option<&'a str>,
    /// The model's price.
    pub price: Credits,
    /// The request's id (`x-request-id`), kept in the call log.
    pub request_id: Option<&'a str>,
    /// When the call is made: a subscription whose period ended by then is not spent.
    pub at: DateTime<Utc>,
    /// The call's idempotency key, if the client sent one: at most one call per account and
    /// key is billed (see [`Ledger::reserve`](crate::store::Ledger::reserve)).
    pub idempotency: Option<&'a IdempotencyKey>,
    /// The tools a translated call's translation left out, comma-separated (as the reply's
    /// `x-gateway-dropped-tools` header names them); kept in the call log.
    pub dropped_tools: Option<&'a str>,
}

impl<'a> ChargeRequest<'a> {
    /// A charge of `price` for a call of `model` on `protocol` by `caller`, made now, with no
    /// request id and no idempotency key.
    pub fn new(caller: Caller, protocol: Protocol, model: &'a str, price: Credits) -> Self {
        ChargeRequest {
            caller,
            protocol,
            model,
            requested_model: None,
            price,
            request_id: None,
            at: Utc::now(),
            idempotency: None,
            dropped_tools: None,
        }
    }

    /// The tools a translated call's translation left out, comma-separated.
    pub fn with_dropped_tools(mut self, dropped_tools: Option<&'a str>) -> Self {
        self.dropped_tools = dropped_tools;
        self
    }

    /// The request's id (`x-request-id`), kept in the call log.
    pub fn with_request_id(mut self, request_id: Option<&'a str>) -> Self {
        self.request_id = request_id;
        self
    }

    /// The name the client called the model by, when it was one of its aliases.
    pub fn with_requested_model(mut self, requested_model: Option<&'a str>) -> Self {
        self.requested_model = requested_model;
        self
    }

    /// The time the call is made (a subscription whose period ended by then is not spent).
    pub fn at(mut self, at: DateTime<Utc>) -> Self {
        self.at = at;
        self
    }

    /// The client's idempotency key: at most one call per account and key is billed.
    pub fn with_idempotency(mut self, idempotency: Option<&'a IdempotencyKey>) -> Self {
        self.idempotency = idempotency;
        self
    }
}

/// A successful upstream call, recorded when it is settled.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct CallSuccess {
    /// The upstream's HTTP status.
    pub upstream_status: u16,
    /// Token usage, when the reply carries it.
    pub usage: TokenUsage,
    /// The catalogue upstream (channel) that served the call, when the upstream says.
    pub channel: Option<String>,
    /// The protocol that channel spoke (another than the endpoint's when it translated the
    /// call), when the upstream says.
    pub upstream_protocol: Option<Protocol>,
    /// What the call cost, for a model priced by tokens; `None` charges what the reservation
    /// took (a price per call). A cost below the reservation returns the rest in the settle's
    /// write; one above it is charged the reservation, and the entry records the rest as
    /// [`CallRecord::shortfall`] (unless [`beyond_reservation`](Self::beyond_reservation)).
    pub cost: Option<Credits>,
    /// Whether a cost above the reservation may take more than the reservation: what the
    /// account can pay beyond it, within what its key's spending limit still allows. Off by
    /// default: the reservation (the call's ceiling) is the most a call is charged.
    pub beyond_reservation: bool,
    /// Whether the provider's usage report failed the gateway's checks (a count that is not a
    /// whole number, below zero, or beyond what the call could use): the call is then charged its
    /// ceiling, and the entry says so.
    pub usage_rejected: bool,
    /// For a call with an idempotency key, the reply to keep for its retries: written in the
    /// settle's transaction, so it is kept exactly when the call is billed. `None` keeps none
    /// (a retry is then told the call was billed, and is not billed again).
    pub reply: Option<KeptReply>,
    /// Who decides first between the store committing this settle and its caller giving up on
    /// it (see [`SettleClaim`]).
    pub claim: SettleClaim,
    /// What the call cost the operator at the channel that served it, when the catalogue gives
    /// cost prices for it.
    pub operator_cost: Option<OperatorCost>,
    /// The provider's usage object exactly as it reported it (JSON text), when the gateway saw it.
    pub raw_usage: Option<String>,
}

impl CallSuccess {
    /// The columns of the operator's economics, as stored: the cost and the credit's value in
    /// billionths, the tier's name, whether a count was estimated.
    pub(crate) fn economics_columns(
        &self,
    ) -> (Option<i64>, Option<i64>, Option<&'static str>, bool) {
        (
            self.operator_cost.map(|cost| cost.cost.nanos()),
            self.operator_cost.map(|cost| cost.credit_value.nanos()),
            self.usage.service_tier.map(ServiceTier::as_str),
            self.usage.estimated,
        )
    }
}

/// What a call cost the operator, in his currency, and what one credit was worth in it then:
/// the entry's margin is what it was charged at that value, less the cost.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OperatorCost {
    /// What the provider bills the operator for the call.
    pub cost: Money,
    /// What one credit was worth (the catalogue's `credit_value` at the call).
    pub credit_value: Money,
}

/// Decides once between a settle's commit and its caller giving up on it, so that a client
/// told `503` ("nothing charged, retry") is never billed for the reply it did not get.
///
/// The caller of [`Ledger::settle`](crate::store::Ledger::settle) that stops waiting
/// [`abandon`](Self::abandon)s the claim; a store [`claim`](Self::claim)s it just before the
/// commit that writes the settle. Whoever comes first wins: a store that finds it abandoned
/// rolls the settle back (it was never billed, and the caller refunds it); a caller that finds
/// it claimed knows the commit is on its way and treats the call as billed. A store that never
/// claims (the memory store, whose settle cannot be late; an embedder's own) leaves the caller
/// to give up as before. Clones share the one decision; two claims compare equal whatever
/// they hold (the decision is not part of the settle's value).
#[derive(Debug, Clone, Default)]
pub struct SettleClaim(std::sync::Arc<std::sync::atomic::AtomicU8>);

const OPEN: u8 = 0;
const CLAIMED: u8 = 1;
const ABANDONED: u8 = 2;

impl SettleClaim {
    /// Claims the settle for its commit; `false` if its caller has given up on it (the store
    /// must then not commit it).
    pub fn claim(&self) -> bool {
        self.decide(CLAIMED)
    }

    /// Gives up on the settle; `false` if a store has claimed it already (its commit is on its
    /// way: the call is to be treated as billed).
    pub fn abandon(&self) -> bool {
        self.decide(ABANDONED)
    }

    /// [`abandon`](Self::abandon), waiting up to `grace` for a claim to be
    /// [`release`](Self::release)d first: a caller whose time ran out while a store was trying
    /// a commit that fails for certain gives up rather than treat the call as billed.
    pub async fn abandon_within(&self, grace: std::time::Duration) -> bool {
        let until = tokio::time::Instant::now() + grace;
        loop {
            if self.abandon() {
                return true;
            }
            if tokio::time::Instant::now() >= until {
                return false;
            }
            tokio::time::sleep(std::time::Duration::from_millis(5)).await;
        }
    }

    /// Takes back a claim whose commit failed for certain (nothing was written: a local
    /// `SQLite` file's commit refused, say), so that the caller may still give up on the
    /// settle; `false` if it was not claimed. A commit whose outcome is unknown (its answer
    /// lost on the network) keeps its claim: the call is billed once the settle is written.
    pub fn release(&self) -> bool {
        use std::sync::atomic::Ordering;
        self.0
            .compare_exchange(CLAIMED, OPEN, Ordering::AcqRel, Ordering::Acquire)
            .is_ok()
    }

    fn decide(&self, to: u8) -> bool {
        use std::sync::atomic::Ordering;
        match self
            .0
            .compare_exchange(OPEN, to, Ordering::AcqRel, Ordering::Acquire)
        {
            Ok(_) => true,
            Err(decided) => decided == to,
        }
    }
}

impl PartialEq for SettleClaim {
    fn eq(&self, _: &SettleClaim) -> bool {
        true
    }
}

impl Eq for SettleClaim {}

/// A failed upstream call, recorded when it is refunded; for the operator, never for the client.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CallFailure {
    /// The upstream's HTTP status, when it answered at all.
    pub upstream_status: Option<u16>,
    /// What went wrong (connection error, time-out, an excerpt of the upstream's error body).
    pub error: String,
}

/// Where a call-log entry stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum CallStatus {
    /// Credits reserved, upstream call under way.
    Pending,
    /// Upstream succeeded; the credits are spent.
    Ok,
    /// Upstream failed; the credits went back.
    Refunded,
}

impl CallStatus {
    /// The name stored in the database.
    pub fn as_str(self) -> &'static str {
        match self {
            CallStatus::Pending => "pending",
            CallStatus::Ok => "ok",
            CallStatus::Refunded => "refunded",
        }
    }

    /// Parses the stored name.
    pub fn parse(name: &str) -> Option<CallStatus> {
        match name {
            "pending" => Some(CallStatus::Pending),
            "ok" => Some(CallStatus::Ok),
            "refunded" => Some(CallStatus::Refunded),
            _ => None,
        }
    }
}

/// One call-log entry as stored.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct CallRecord {
    /// Entry id.
    pub id: CallId,
    /// Paying account.
    pub account: AccountId,
    /// Key used.
    pub key: KeyId,
    /// Endpoint called.
    pub protocol: Protocol,
    /// Catalogue model name.
    pub model: String,
    /// The name the client called the model by, when it was one of the model's aliases.
    pub requested_model: Option<String>,
    /// What the call took: while pending, what its reservation holds (its price, or for a model
    /// priced by tokens the most it can cost); settled, what it was charged (its price, or its
    /// cost less any [`shortfall`](Self::shortfall)); refunded, what went back. Always
    /// `charged_subscription + charged_topup`.
    pub price: Credits,
    /// Credits taken from the subscription bucket.
    pub charged_subscription: Credits,
    /// Credits taken from the top-up bucket.
    pub charged_topup: Credits,
    /// Outcome.
    pub status: CallStatus,
    /// Upstream HTTP status, when it answered.
    pub upstream_status: Option<u16>,
    /// The upstream (channel) that served the call.
    pub channel: Option<String>,
    /// The protocol that channel spoke: another than [`protocol`](Self::protocol) when it
    /// translated the call.
    pub upstream_protocol: Option<Protocol>,
    /// The tools the call's translation left out, comma-separated.
    pub dropped_tools: Option<String>,
    /// Upstream failure, for refunded calls: each channel's failure in the order tried.
    pub upstream_error: Option<String>,
    /// Input tokens reported by the upstream, neither read from nor written to a cache.
    pub input_tokens: Option<i64>,
    /// Output tokens reported by the upstream, reasoning included.
    pub output_tokens: Option<i64>,
    /// Input tokens read from the provider's cache.
    pub cache_read_tokens: Option<i64>,
    /// Input tokens written to the provider's cache for 5 minutes.
    pub cache_write_tokens: Option<i64>,
    /// Input tokens written to the provider's cache for an hour.
    pub cache_write_1h_tokens: Option<i64>,
    /// Of the output tokens, those spent reasoning.
    pub reasoning_tokens: Option<i64>,
    /// What a call priced by tokens cost beyond what its account could pay when it was settled
    /// (its reservation was estimated low): owed to the operator, never taken below zero.
    pub shortfall: Credits,
    /// Whether the provider's usage report failed the gateway's checks, so that the call was
    /// charged its ceiling rather than what the report said (see
    /// [`CallSuccess::usage_rejected`]).
    pub usage_rejected: bool,
    /// Whether a count the entry was charged by is the gateway's own (output counted from what
    /// was passed on, input estimated from the request: a client that left, a stream without
    /// usage) rather than the provider's report.
    pub usage_estimated: bool,
    /// The service tier the call was priced at, when its provider or its client named one.
    pub service_tier: Option<ServiceTier>,
    /// The provider's usage object exactly as it reported it, when the gateway saw it.
    #[serde(serialize_with = "raw_json")]
    pub raw_usage: Option<String>,
    /// What the call cost the operator at the channel that served it, in his currency.
    pub cost: Option<Money>,
    /// What one credit was worth in that currency when the call was settled.
    pub credit_value: Option<Money>,
    /// What the call earned: what it was charged, at [`credit_value`](Self::credit_value), less
    /// its [`cost`](Self::cost) (negative: sold at a loss). `None` without both.
    pub margin: Option<Money>,
    /// When the credits were reserved.
    pub created_at: DateTime<Utc>,
    /// When the call was settled or refunded.
    pub finished_at: Option<DateTime<Utc>>,
    /// The request's id (`x-request-id`), as the client's answer carried it.
    pub request_id: Option<String>,
}

impl CallRecord {
    /// What `price` credits earned at `credit_value` a credit, less `cost`: an entry's margin.
    pub fn margin_of(
        price: Credits,
        cost: Option<Money>,
        credit_value: Option<Money>,
    ) -> Option<Money> {
        Some(credit_value?.times(price).minus(cost?))
    }
}

/// A JSON text kept as written, written into JSON as the value it is (a text that is not
/// JSON, as a string).
fn raw_json<S: serde::Serializer>(raw: &Option<String>, serializer: S) -> Result<S::Ok, S::Error> {
    use serde::Serialize;
    match raw
        .as_deref()
        .map(|text| serde_json::value::RawValue::from_string(text.to_owned()))
    {
        None => serializer.serialize_none(),
        Some(Ok(value)) => value.serialize(serializer),
        Some(Err(_)) => raw.serialize(serializer),
    }
}

/// The store could not do what was asked. Callers match the kind: the refusals (the last
/// four) wrote nothing and are the caller's to fix; [`Database`](StoreError::Database) is an
/// outage or a fault, worth a retry or a 503.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum StoreError {
    /// The database failed, could not be reached, or answered what the store cannot read.
    #[error("store error: {0}")]
    Database(#[source] Box<dyn std::error::Error + Send + Sync>),
    /// A grant would take a balance past [`Credits::MAX`].
    #[error(transparent)]
    BalanceOverflow(#[from] BalanceOverflow),
    /// A grant's idempotency key was already used for a different grant.
    #[error(transparent)]
    IdempotencyKeyReused(#[from] IdempotencyKeyReused),
    /// No account has this id.
    #[error("unknown account {}", .0.0)]
    UnknownAccount(AccountId),
    /// An argument the store cannot take (a grant that is not positive, an `rpm` too large).
    #[error("invalid argument: {0}")]
    Invalid(String),
    /// A capability this store does not have (redemption codes, webhook events): the traits'
    /// defaults answer it, and the conformance suite skips what answers it.
    #[error("this store has no {0}")]
    Unsupported(&'static str),
}

impl StoreError {
    /// A database failure described by `message`.
    pub fn msg(message: impl Into<String>) -> StoreError {
        StoreError::Database(message.into().into())
    }

    /// A database failure caused by `error`.
    pub fn database(error: impl std::error::Error + Send + Sync + 'static) -> StoreError {
        StoreError::Database(Box::new(error))
    }
}

/// Why a reservation was not made. Nothing was written in any case. More kinds may come:
/// match with a `_` arm.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ReserveError {
    /// Both buckets together hold less than the price.
    #[error("insufficient credits")]
    InsufficientCredits,
    /// The caller's key has spent what its limit allows in the current period
    /// ([`KeyRules::limit`](crate::call::KeyRules::limit)); checked in the reserving write.
    #[error("the API key's spending limit is reached")]
    KeyLimitReached,
    /// The caller's key was revoked (or is unknown) when the reservation ran. Stores check this
    /// inside the reserving transaction, so a key lookup answered from a cache cannot let a
    /// revoked key spend.
    #[error("the API key is revoked")]
    KeyRevoked,
    /// The idempotency key's call is still running.
    #[error("a call with this idempotency key is still running")]
    IdempotentCallRunning,
    /// The idempotency key was used for a different request (path or body) within the window.
    #[error("the idempotency key was used for a different request")]
    IdempotencyKeyReused,
    /// The idempotency key's call was billed: its reply, to answer again uncharged (`None`: it
    /// was not kept, being too large or the client having left a stream).
    #[error("the call with this idempotency key was already answered")]
    AlreadyAnswered(Option<KeptReply>),
    /// The store failed.
    #[error(transparent)]
    Store(#[from] StoreError),
}

/// A key that authenticates: whose it is, and its rules.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ActiveKey {
    /// Who pays.
    pub caller: Caller,
    /// What the key may do.
    pub rules: KeyRules,
}

/// A gateway instance's lease on the database; each reservation records the lease it was made
/// under.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize)]
#[serde(transparent)]
pub struct LeaseId(pub i64);

/// Who made a response that a provider keeps (the Responses API's stored responses), and at
/// which upstream: so that it is reached again only by that account, at that upstream.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ResponseOwner {
    /// The provider's response id (`resp_...`).
    pub response_id: String,
    /// The account whose call made it.
    pub account: AccountId,
    /// The catalogue name of the upstream that made and keeps it.
    pub upstream: String,
}

/// A grant refused because it would take a bucket, or the account's total, past
/// [`Credits::MAX`]. Carried inside the [`StoreError`] that [`Accounts::grant`](crate::store::Accounts::grant) returns
/// ([`StoreError::BalanceOverflow`]); nothing was written.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "granting {amount} {bucket} credits to account {account} would take its balance past the largest \
     value a balance can hold ({max}); nothing was granted",
    account = .account.0, bucket = .bucket.as_str(), max = Credits::MAX
)]
pub struct BalanceOverflow {
    /// The account.
    pub account: AccountId,
    /// The bucket the grant was for.
    pub bucket: Bucket,
    /// The amount refused.
    pub amount: Credits,
}

/// A grant whose idempotency key the account already used for a different grant (another
/// bucket or amount). Carried as [`StoreError::IdempotencyKeyReused`] by what
/// [`Accounts::grant_once`](crate::store::Accounts::grant_once) returns; nothing was written.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "idempotency key {key:?} was used for a different grant on this account; nothing was granted"
)]
pub struct IdempotencyKeyReused {
    /// The key.
    pub key: String,
}

/// The error for a write or a reservation on an account that does not exist.
pub(crate) fn unknown_account(account: AccountId) -> StoreError {
    StoreError::UnknownAccount(account)
}

pub(crate) fn check_grant_amount(amount: Credits) -> Result<(), StoreError> {
    if amount.get() > 0 {
        Ok(())
    } else {
        Err(StoreError::Invalid(format!(
            "a grant must be positive, got {amount}"
        )))
    }
}

impl From<UpstreamError> for CallFailure {
    fn from(error: UpstreamError) -> CallFailure {
        CallFailure {
            upstream_status: error.status,
            error: error.message,
        }
    }
}

#[cfg(test)]
mod settle_claim_tests {
    use std::time::Duration;

    use super::SettleClaim;

    #[test]
    fn the_first_to_decide_wins_and_a_claim_released_may_still_be_given_up() {
        let claim = SettleClaim::default();
        assert!(claim.claim());
        assert!(claim.claim(), "a second claim agrees");
        assert!(!claim.abandon(), "claimed: billed");
        assert!(claim.release());
        assert!(!claim.release(), "released once");
        assert!(claim.abandon());
        assert!(!claim.claim(), "given up: never written");
    }

    #[tokio::test]
    async fn a_caller_out_of_time_waits_briefly_for_a_failed_commit_to_give_its_claim_back() {
        let claim = SettleClaim::default();
        assert!(claim.claim());
        assert!(
            !claim.abandon_within(Duration::from_millis(30)).await,
            "a commit still under way: billed"
        );
        let store = claim.clone();
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(20)).await;
            store.release();
        });
        assert!(claim.abandon_within(Duration::from_secs(5)).await);
        assert!(!claim.claim());
    }
}
