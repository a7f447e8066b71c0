//! The storage traits an embedder implements over its own database (see `super`).

use async_trait::async_trait;
use chrono::{DateTime, Utc};

use super::records::{
    AccountAudit, AccountQuery, AccountSummary, Attempted, CallQuery, CodeBatch, DailyUsage,
    Delivery, DeliveryStatus, Grant, Granted, KeyInfo, Lapse, NewCodeBatch, Overdue, Redeemed,
    ReportQuery, ReportRow,
};
use super::types::{
    ActiveKey, CallFailure, CallRecord, CallStatus, CallSuccess, ChargeRequest, LeaseId,
    ReserveError, ResponseOwner, StoreError,
};
use crate::call::{AccountId, CallId, Caller, KeyId, KeyRules, Reservation};
use crate::codes::CodeHash;
use crate::credits::{Balance, Bucket, Credits};
use crate::keys::KeyHash;

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
    /// within the store's window ([`DEFAULT_IDEMPOTENCY_WINDOW`](crate::store::DEFAULT_IDEMPOTENCY_WINDOW)): a retry is answered with
    /// [`ReserveError::IdempotentCallRunning`], [`ReserveError::AlreadyAnswered`] or
    /// [`ReserveError::IdempotencyKeyReused`], reserving nothing; a key whose call was refunded
    /// reserves anew. The rule is in the module `store::idempotency`; a store of an embedder's
    /// that ignores the key bills every retry.
    ///
    /// A reserve future dropped before it answers may still have reserved (its write was
    /// already on its way). [`SeaOrmStore`](crate::store::SeaOrmStore) refunds such a reservation
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

    /// What a settled (`ok`) entry was charged; `None` if there is no such entry, it is not
    /// settled, or the store cannot say (the default). Read after a settle that may have charged
    /// less than its cost (see [`CallSuccess::beyond_reservation`](crate::store::CallSuccess::beyond_reservation)),
    /// so that what the client and the metrics are told is what the ledger charged.
    async fn charged(&self, call: CallId) -> Result<Option<Credits>, StoreError> {
        let _ = call;
        Ok(None)
    }

    /// A call-log entry's status; `None` if there is no such entry. A settle that finds its
    /// entry no longer `pending` asks this to learn whether the call was billed (an earlier
    /// attempt whose answer was lost) or refunded meanwhile.
    async fn call_status(&self, call: CallId) -> Result<Option<CallStatus>, StoreError>;

    /// Deletes the idempotency records older than the store's window at `now` whose calls are
    /// no longer `pending`; returns how many. Run now and then (as [`Upkeep`](crate::recovery::Upkeep)
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

    /// Every account's billed calls made in `query`'s window, summed by its group (tokens by
    /// kind, credits, the operator's cost and margin), in the group's order: summed by the
    /// database, not by reading every call.
    async fn usage_report(&self, query: ReportQuery) -> Result<Vec<ReportRow>, StoreError> {
        let _ = query;
        Err(StoreError::Unsupported("usage reports"))
    }

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
        key: &crate::keys::NewApiKey,
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
    /// another grant is refused with [`IdempotencyKeyReused`](crate::store::IdempotencyKeyReused).
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

    /// Sets the account's own low-balance threshold: `account.balance_low` is told when a
    /// reservation takes what it can spend below it (zero: never); `None` goes back to the
    /// store's default. `false` if there is no such account.
    async fn set_low_balance(
        &self,
        account: AccountId,
        threshold: Option<Credits>,
    ) -> Result<bool, StoreError>;

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

/// Which account made which of the responses a provider keeps (the Responses API's
/// `previous_response_id` and `/v1/responses/{id}`), so that only that account reaches them,
/// and only at the upstream that keeps them.
///
/// The defaults keep nothing: with a store that keeps no owners, every stored response is
/// unknown (`404`), never another account's.
#[async_trait]
pub trait ResponseOwners: Send + Sync + std::fmt::Debug {
    /// Records who made a response. Recording the same id again changes nothing.
    async fn record_response(&self, owner: &ResponseOwner) -> Result<(), StoreError> {
        let _ = owner;
        Ok(())
    }

    /// Who made the response `response_id`, if it was recorded.
    async fn response_owner(&self, response_id: &str) -> Result<Option<ResponseOwner>, StoreError> {
        let _ = response_id;
        Ok(None)
    }

    /// Forgets the owners recorded before `before` (the upkeep passes
    /// [`RESPONSE_RETENTION`](crate::store::RESPONSE_RETENTION) ago); returns how many.
    async fn forget_responses(&self, before: DateTime<Utc>) -> Result<u64, StoreError> {
        let _ = before;
        Ok(0)
    }
}

/// Redemption codes: batches an operator sells, each code redeemed for credits once.
///
/// The defaults keep none: creating a batch answers [`StoreError::Unsupported`], and every code
/// is unknown.
#[async_trait]
pub trait RedemptionCodes: Send + Sync + std::fmt::Debug {
    /// Stores a batch and its codes' hashes; returns it as listed.
    async fn create_code_batch(&self, batch: NewCodeBatch<'_>) -> Result<CodeBatch, StoreError> {
        let _ = batch;
        Err(StoreError::Unsupported("redemption codes"))
    }

    /// Every batch, newest first, with its used and revoked counts.
    async fn code_batches(&self) -> Result<Vec<CodeBatch>, StoreError> {
        Ok(Vec::new())
    }

    /// Revokes the batch's unused codes at `at`; `None` if there is no such batch.
    async fn revoke_code_batch(
        &self,
        batch: i64,
        at: DateTime<Utc>,
    ) -> Result<Option<CodeBatch>, StoreError> {
        let _ = (batch, at);
        Ok(None)
    }

    /// Redeems the code for `account` at `at`: marks it used and grants its credits (recorded
    /// as a grant naming the batch) in one transaction, so that a code grants once, whatever
    /// the concurrency and however many gateways share the store. `None`, changing nothing,
    /// for a code that is unknown, used, revoked or expired, without saying which.
    async fn redeem_code(
        &self,
        account: AccountId,
        code: &CodeHash,
        at: DateTime<Utc>,
    ) -> Result<Option<Redeemed>, StoreError> {
        let _ = (account, code, at);
        Ok(None)
    }
}

/// The outbox of webhook events: each written once (an event a ledger write causes, such as a
/// redemption or a lapse, in that write's transaction), then delivered at least once by a
/// [`WebhookDispatcher`](crate::webhooks::WebhookDispatcher), surviving restarts.
///
/// The defaults keep nothing: no event is recorded or delivered, and the list of deliveries
/// answers [`StoreError::Unsupported`].
#[async_trait]
pub trait EventOutbox: Send + Sync + std::fmt::Debug {
    /// Records an event that no ledger write caused (an upstream's breaker), to deliver.
    async fn record_event(&self, event: &crate::events::WebhookEvent) -> Result<(), StoreError> {
        let _ = event;
        Ok(())
    }

    /// Pending deliveries due at `now`, oldest first, at most `limit`, each claimed until
    /// `now + hold` (another dispatcher does not take it meanwhile; one whose dispatcher died
    /// is taken again after it).
    async fn claim_deliveries(
        &self,
        now: DateTime<Utc>,
        hold: std::time::Duration,
        limit: u64,
    ) -> Result<Vec<Delivery>, StoreError> {
        let _ = (now, hold, limit);
        Ok(Vec::new())
    }

    /// Records how an attempt at delivery `id` ended.
    async fn attempted(&self, id: i64, attempt: &Attempted) -> Result<(), StoreError> {
        let _ = (id, attempt);
        Ok(())
    }

    /// The newest deliveries, optionally of one status, at most `limit`.
    async fn deliveries(
        &self,
        status: Option<DeliveryStatus>,
        limit: u64,
    ) -> Result<Vec<Delivery>, StoreError> {
        let _ = (status, limit);
        Err(StoreError::Unsupported("webhook events"))
    }

    /// Makes delivery `id` pending again, due at `now` (an operator's retry); `None` if there is
    /// no such delivery.
    async fn retry_delivery(
        &self,
        id: i64,
        now: DateTime<Utc>,
    ) -> Result<Option<Delivery>, StoreError> {
        let _ = (id, now);
        Ok(None)
    }
}

/// Everything the gateway and its tools need from one backend.
pub trait Store:
    KeyStore + Ledger + CallLog + Accounts + Leases + ResponseOwners + RedemptionCodes + EventOutbox
{
}

impl<
    T: KeyStore
        + Ledger
        + CallLog
        + Accounts
        + Leases
        + ResponseOwners
        + RedemptionCodes
        + EventOutbox,
> Store for T
{
}
