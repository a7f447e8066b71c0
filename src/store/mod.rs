//! Storage: the traits an embedder implements over its own database, and the types the layers
//! exchange with it.
//!
//! - [`KeyStore`]: who is calling (key hash → [`Caller`]).
//! - [`Ledger`]: credits: [`reserve`](Ledger::reserve) a call's price and write its `pending`
//!   call-log entry in one transaction, then [`settle`](Ledger::settle) it (`ok`) or
//!   [`refund`](Ledger::refund) it (`refunded`, credits back to the buckets they came from), each
//!   once, guarded by the entry's status.
//! - [`CallLog`]: reading the call log back.
//! - [`Leases`]: which gateway instance serves which reservation, so that recovery refunds a
//!   dead instance's reservations at once and never a live one's.
//! - [`Accounts`]: administration (accounts, keys and their rules, grants, the audit), used by
//!   the admin API and the command line rather than per call.
//!
//! Two implementations ship: [`SeaOrmStore`] (`SQLite`, `PostgreSQL`, `MySQL`/`MariaDB`) and
//! [`MemoryStore`], the reference model the database backends are tested against.

use async_trait::async_trait;
use chrono::{DateTime, Utc};
use serde::Serialize;

pub use crate::call::{AccountId, CallId, Caller, KeyId, KeyRules, Reservation};
use crate::credits::{Balance, Bucket, Credits};
use crate::error::UpstreamError;
use crate::keys::KeyHash;
use crate::protocol::Protocol;
pub use crate::protocol::TokenUsage;

mod memory;
pub(crate) mod outcome;
mod records;
pub(crate) mod rules;
mod sea;

pub use crate::call::IdempotencyKey;
pub use memory::MemoryStore;
pub use outcome::DEFAULT_LEDGER_TIMEOUT;
pub use records::{
    AccountAudit, AccountQuery, AccountSummary, CallQuery, DailyUsage, Grant, Granted,
    IdempotencyKeyReused, KeyInfo, KeyStatus, Lapse, Overdue, Sums,
};
pub use rules::idempotency::{DEFAULT_IDEMPOTENCY_WINDOW, KeptReply, MAX_KEPT_REPLY_BYTES};
pub(crate) use rules::idempotency::{
    KeyedCall, KeyedDecision, decide as decide_keyed, window_cutoff,
};
pub use sea::{
    ChargingMode, DEFAULT_ESCROW_IDLE, DEFAULT_MAX_BATCH, GroupCommitStats, Migrator, SeaOrmStore,
};

/// What [`Ledger::reserve`] is asked to charge.
#[derive(Debug, Clone, Copy)]
pub struct ChargeRequest<'a> {
    /// Who pays.
    pub caller: Caller,
    /// The endpoint called.
    pub protocol: Protocol,
    /// The model's catalogue name.
    pub model: &'a str,
    /// The model's price.
    pub price: Credits,
    /// The request's id (`x-request-id`), kept in the call log.
    pub request_id: Option<&'a str>,
    /// When the call is made: a subscription whose period ended by then is not spent.
    pub at: DateTime<Utc>,
    /// The call's idempotency key, if the client sent one: at most one call per account and
    /// key is billed (see [`Ledger::reserve`]).
    pub idempotency: Option<&'a IdempotencyKey>,
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
    /// For a call with an idempotency key, the reply to keep for its retries: written in the
    /// settle's transaction, so it is kept exactly when the call is billed. `None` keeps none
    /// (a retry is then told the call was billed, and is not billed again).
    pub reply: Option<KeptReply>,
}

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
    /// Price at the time of the call.
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
    /// Upstream failure, for refunded calls: each channel's failure in the order tried.
    pub upstream_error: Option<String>,
    /// Prompt tokens reported by the upstream.
    pub input_tokens: Option<i64>,
    /// Completion tokens reported by the upstream.
    pub output_tokens: Option<i64>,
    /// When the credits were reserved.
    pub created_at: DateTime<Utc>,
    /// When the call was settled or refunded.
    pub finished_at: Option<DateTime<Utc>>,
    /// The request's id (`x-request-id`), as the client's answer carried it.
    pub request_id: Option<String>,
}

/// The store could not do what was asked (database unreachable, a constraint violated, ...).
#[derive(Debug, thiserror::Error)]
#[error("store error: {0}")]
pub struct StoreError(#[source] pub Box<dyn std::error::Error + Send + Sync>);

impl StoreError {
    /// A store error with a plain message.
    pub fn msg(message: impl Into<String>) -> StoreError {
        StoreError(message.into().into())
    }
}

/// Why a reservation was not made. Nothing was written in either case.
#[derive(Debug, thiserror::Error)]
pub enum ReserveError {
    /// Both buckets together hold less than the price.
    #[error("insufficient credits")]
    InsufficientCredits,
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

/// Key lookup.
#[async_trait]
pub trait KeyStore: Send + Sync + std::fmt::Debug {
    /// The key and its rules; `None` for an unknown or revoked key (an expired one is returned,
    /// and refused by [`ApiKeyAuth`](crate::ApiKeyAuth)). May answer from a cache:
    /// [`Ledger::reserve`] is what refuses a key revoked since, and rules changed on another
    /// gateway are seen within the cache's lifetime.
    async fn active_key(&self, key: &KeyHash) -> Result<Option<ActiveKey>, StoreError>;

    /// The caller a key belongs to; `None` for an unknown or revoked key.
    async fn caller_for_key(&self, key: &KeyHash) -> Result<Option<Caller>, StoreError> {
        Ok(self.active_key(key).await?.map(|key| key.caller))
    }
}

/// The credit ledger.
#[async_trait]
pub trait Ledger: Send + Sync + std::fmt::Debug {
    /// Takes `request.price` from the caller's pool, subscription credits first, and writes a
    /// `pending` call-log entry, atomically: either both happen or neither. Two reservations never
    /// spend the same credit, whatever the concurrency. Refuses with
    /// [`ReserveError::KeyRevoked`], writing nothing, when the caller's key is no longer active,
    /// checked in the same transaction.
    ///
    /// With an [`idempotency`](ChargeRequest::idempotency) key, the key's record is read and
    /// written in the same transaction, so at most one call per account and key is billed
    /// within the store's window ([`DEFAULT_IDEMPOTENCY_WINDOW`]): a retry is answered with
    /// [`ReserveError::IdempotentCallRunning`], [`ReserveError::AlreadyAnswered`] or
    /// [`ReserveError::IdempotencyKeyReused`], reserving nothing; a key whose call was refunded
    /// reserves anew. The rule is in the module `store::idempotency`; a store of an embedder's
    /// that ignores the key bills every retry.
    ///
    /// A reserve future dropped before it answers may still have reserved (its write was
    /// already on its way). [`SeaOrmStore`] refunds such a reservation
    /// itself when it was written in a batch, but not a keyed one (written in a transaction of
    /// its own), and another store may not at all, leaving it `pending` until recovery.
    /// [`CreditCharge`](crate::CreditCharge) never drops one: a request dropped meanwhile has
    /// its reservation finished on a spawned task and refunded. A caller of its own should do
    /// the same.
    async fn reserve(&self, request: ChargeRequest<'_>) -> Result<Reservation, ReserveError>;

    /// Marks a `pending` call `ok`. Returns `false`, changing nothing, if it was not pending.
    async fn settle(&self, call: CallId, success: CallSuccess) -> Result<bool, StoreError>;

    /// Returns a `pending` call's credits to the buckets they came from and marks it `refunded`,
    /// in one transaction guarded by the status. Returns `false`, changing nothing, if it was not
    /// pending, so a second refund of the same call moves no credits.
    async fn refund(&self, call: CallId, failure: &CallFailure) -> Result<bool, StoreError>;

    /// The account's credits, bucket by bucket.
    async fn balance(&self, account: AccountId) -> Result<Balance, StoreError>;

    /// A call-log entry's status; `None` if there is no such entry. A settle that finds its
    /// entry no longer `pending` asks this to learn whether the call was billed (an earlier
    /// attempt whose answer was lost) or refunded meanwhile.
    async fn call_status(&self, call: CallId) -> Result<Option<CallStatus>, StoreError>;

    /// Deletes the idempotency records older than the store's window at `now` whose calls are
    /// no longer `pending`; returns how many. Run now and then (as [`Upkeep`](crate::Upkeep)
    /// does) to bound their storage.
    async fn forget_idempotent_calls(&self, now: DateTime<Utc>) -> Result<u64, StoreError> {
        let _ = now;
        Ok(0)
    }

    /// Calls still `pending` that were reserved before `cutoff`, oldest first, at most `limit`,
    /// leaving out those whose instance's lease still holds ([`Leases`]): a live instance's
    /// reservations are never stale, however old.
    async fn stale_reservations(
        &self,
        cutoff: DateTime<Utc>,
        limit: u64,
    ) -> Result<Vec<CallId>, StoreError>;

    /// `account`'s `pending` entries made for the request `request_id` (`x-request-id`): where
    /// to look for a reservation whose answer was lost (the store failed, perhaps after it
    /// committed), so that it is refunded rather than left held by no call.
    async fn pending_for_request(
        &self,
        account: AccountId,
        request_id: &str,
    ) -> Result<Vec<CallId>, StoreError>;
}

/// A gateway instance's lease on the database; each reservation records the lease it was made
/// under.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize)]
#[serde(transparent)]
pub struct LeaseId(pub i64);

/// Instance leases: how recovery knows that the process serving a reservation is dead instead
/// of guessing it from the reservation's age.
///
/// A serving gateway takes a lease ([`take_lease`](Leases::take_lease)) and renews it well
/// within its time to live ([`renew_lease`](Leases::renew_lease)); every reservation the store
/// makes meanwhile records it. A reservation whose lease no longer holds belongs to no live
/// call: [`orphaned_reservations`](Leases::orphaned_reservations) finds those for recovery,
/// however young, and [`Ledger::stale_reservations`] (the age rule, the backstop) never
/// returns a reservation whose lease still holds, however old.
///
/// The defaults keep no leases: a store whose reservations die with its process (the memory
/// store) needs none, and an embedder's store without them is recovered by the age rule alone.
#[async_trait]
pub trait Leases: Send + Sync + std::fmt::Debug {
    /// Takes a new lease for this process, holding until `now + ttl`; the reservations this
    /// store makes from then on record it. `None`: this store keeps no leases.
    async fn take_lease(
        &self,
        now: DateTime<Utc>,
        ttl: std::time::Duration,
    ) -> Result<Option<LeaseId>, StoreError> {
        let _ = (now, ttl);
        Ok(None)
    }

    /// Extends the store's lease to `now + ttl` if it still holds. `false`: it had ended
    /// (expired, or ended by another instance's recovery) and cannot be revived, or there is
    /// none; reservations record no lease until a new one is taken.
    async fn renew_lease(
        &self,
        now: DateTime<Utc>,
        ttl: std::time::Duration,
    ) -> Result<bool, StoreError> {
        let _ = (now, ttl);
        Ok(false)
    }

    /// Ends the store's lease (a clean stop): whatever of it is still pending is recovered at
    /// once by any instance.
    async fn release_lease(&self) -> Result<(), StoreError> {
        Ok(())
    }

    /// Reservations still `pending` that were made under a lease that no longer holds at `now`,
    /// oldest first, at most `limit`.
    async fn orphaned_reservations(
        &self,
        now: DateTime<Utc>,
        limit: u64,
    ) -> Result<Vec<CallId>, StoreError> {
        let _ = (now, limit);
        Ok(Vec::new())
    }

    /// Deletes the leases that ended before `now` and have nothing pending; returns how many.
    async fn forget_ended_leases(&self, now: DateTime<Utc>) -> Result<u64, StoreError> {
        let _ = now;
        Ok(0)
    }
}

/// Reading the call log.
#[async_trait]
pub trait CallLog: Send + Sync + std::fmt::Debug {
    /// One page of the account's call log, newest first, as `query` says.
    async fn calls(
        &self,
        account: AccountId,
        query: CallQuery<'_>,
    ) -> Result<Vec<CallRecord>, StoreError>;

    /// The account's billed (`ok`) calls since `since`, per UTC day and model, oldest day
    /// first: summed by the database, not by reading every call.
    async fn usage(
        &self,
        account: AccountId,
        since: DateTime<Utc>,
    ) -> Result<Vec<DailyUsage>, StoreError>;

    /// The account's entries older than `before` (all of them when `None`), newest first, at
    /// most `limit`.
    async fn calls_before(
        &self,
        account: AccountId,
        before: Option<CallId>,
        limit: u64,
    ) -> Result<Vec<CallRecord>, StoreError> {
        let query = CallQuery {
            before,
            limit,
            ..CallQuery::default()
        };
        self.calls(account, query).await
    }

    /// The account's newest entries, newest first.
    async fn recent_calls(
        &self,
        account: AccountId,
        limit: u64,
    ) -> Result<Vec<CallRecord>, StoreError> {
        self.calls_before(account, None, limit).await
    }
}

/// Administration: accounts, keys and grants.
#[async_trait]
pub trait Accounts: Send + Sync + std::fmt::Debug {
    /// Creates an account with empty buckets.
    async fn create_account(&self, name: &str) -> Result<AccountId, StoreError>;

    /// Stores a key for the account (hash and display prefix only).
    async fn add_key(
        &self,
        account: AccountId,
        key: &crate::NewApiKey,
    ) -> Result<KeyId, StoreError>;

    /// Refuses the key from now on. Returns `false` if no active key had that hash.
    async fn revoke_key(&self, key: &KeyHash) -> Result<bool, StoreError>;

    /// Refuses the key from now on; `None` if there is no such key. Revoking a revoked key
    /// changes nothing.
    async fn revoke_key_id(&self, key: KeyId) -> Result<Option<KeyInfo>, StoreError>;

    /// Replaces the key's rules; `None` if there is no such key.
    async fn set_key_rules(
        &self,
        key: KeyId,
        rules: &KeyRules,
    ) -> Result<Option<KeyInfo>, StoreError>;

    /// One key; `None` if there is no such key.
    async fn key_info(&self, key: KeyId) -> Result<Option<KeyInfo>, StoreError>;

    /// The account's keys, oldest first.
    async fn keys_of(&self, account: AccountId) -> Result<Vec<KeyInfo>, StoreError>;

    /// Adds credits to one bucket, recording the grant (and its reason) in the ledger, at most
    /// once per idempotency key and account. `amount` must be positive. A key already used for
    /// another grant is refused with [`IdempotencyKeyReused`].
    async fn grant_once(&self, account: AccountId, grant: Grant<'_>)
    -> Result<Granted, StoreError>;

    /// Adds credits to one bucket, recording the grant in the ledger. `amount` must be positive.
    async fn grant(
        &self,
        account: AccountId,
        bucket: Bucket,
        amount: Credits,
    ) -> Result<Balance, StoreError> {
        let granted = self
            .grant_once(account, Grant::plain(bucket, amount))
            .await?;
        Ok(granted.balance)
    }

    /// One account; `None` if there is no such account.
    async fn account(&self, account: AccountId) -> Result<Option<AccountSummary>, StoreError>;

    /// One page of accounts, as `query` says.
    async fn accounts(&self, query: AccountQuery<'_>) -> Result<Vec<AccountSummary>, StoreError>;

    /// How many accounts exist.
    async fn account_count(&self) -> Result<u64, StoreError>;

    /// Reservations reserved before `cutoff` (the longest a call can take, ago) and still not
    /// ended: `pending` entries, whichever instance's, and the calls this store holds in memory
    /// (an owned `SQLite` file's, an escrow instance's). For the audit.
    async fn overdue_reservations(&self, cutoff: DateTime<Utc>) -> Result<Overdue, StoreError>;

    /// Takes out the subscription credits of every account whose period ended by `now`,
    /// recording each as a [`Lapse`]; once per period (credits refunded into an ended period
    /// lapse on the next pass). Calls never spend them meanwhile: reservations judge the end
    /// themselves.
    async fn lapse_ended_subscriptions(&self, now: DateTime<Utc>)
    -> Result<Vec<Lapse>, StoreError>;

    /// Checks every account: granted credits minus the charges of `ok` and `pending` calls
    /// (and, for subscriptions, minus what lapsed) must equal the balance, bucket by bucket,
    /// and no bucket may be negative.
    async fn audit(&self) -> Result<Vec<AccountAudit>, StoreError>;

    /// Whether the store can be reached now (for a readiness probe). The default says yes.
    async fn ready(&self) -> Result<(), StoreError> {
        Ok(())
    }
}

/// Everything the gateway and its tools need from one backend.
pub trait Store: KeyStore + Ledger + CallLog + Accounts + Leases {}

impl<T: KeyStore + Ledger + CallLog + Accounts + Leases> Store for T {}

/// Refuses a grant of zero or fewer credits before it reaches any backend.
/// A grant refused because it would take a bucket, or the account's total, past
/// [`Credits::MAX`]. Carried inside the [`StoreError`] that [`Accounts::grant`] returns
/// (`error.0.downcast_ref::<BalanceOverflow>()`); nothing was written.
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

impl From<BalanceOverflow> for StoreError {
    fn from(overflow: BalanceOverflow) -> StoreError {
        StoreError(Box::new(overflow))
    }
}

/// The error for a write or a reservation on an account that does not exist.
pub(crate) fn unknown_account(account: AccountId) -> StoreError {
    StoreError::msg(format!("unknown account {}", account.0))
}

pub(crate) fn check_grant_amount(amount: Credits) -> Result<(), StoreError> {
    if amount.get() > 0 {
        Ok(())
    } else {
        Err(StoreError::msg(format!(
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
