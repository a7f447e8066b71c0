//! The conformance suite fails a store that breaks a rule, and names the rule: toy stores that
//! are the memory store with one fault each (a code that grants twice, a refund given twice, a
//! key limit ignored), and a store that keeps no codes (skipped, and said).

use std::collections::{HashMap, HashSet};
use std::sync::Mutex;

use async_trait::async_trait;
use chrono::{DateTime, Utc};
use model_gateway::MemoryStore;
use model_gateway::codes::CodeHash;
use model_gateway::credits::{Balance, Bucket, Credits};
use model_gateway::events::WebhookEvent;
use model_gateway::keys::{KeyHash, NewApiKey};
use model_gateway::store::conformance::{Conformance, Rule};
use model_gateway::store::*;

/// The one thing a toy store gets wrong.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Fault {
    /// A used code grants its credits again.
    CodeTwice,
    /// A refunded call's price is given back again on a second refund.
    RefundTwice,
    /// A key's spending limit is dropped.
    NoKeyLimits,
    /// Redemption codes are not kept (the traits' defaults): not a fault, a missing capability.
    NoCodes,
}

/// What each code grants.
type Terms = HashMap<CodeHash, (Credits, Bucket)>;

#[derive(Debug)]
struct Toy {
    inner: MemoryStore,
    fault: Fault,
    /// What each code grants, and the codes used.
    codes: Mutex<(Terms, HashSet<CodeHash>)>,
    /// Each call's account and price.
    calls: Mutex<HashMap<CallId, (AccountId, Credits)>>,
}

impl Toy {
    fn new(fault: Fault) -> Toy {
        Toy {
            inner: MemoryStore::new(),
            fault,
            codes: Mutex::default(),
            calls: Mutex::default(),
        }
    }
}

#[async_trait]
impl KeyStore for Toy {
    async fn active_key(&self, key: &KeyHash) -> Result<Option<ActiveKey>, StoreError> {
        self.inner.active_key(key).await
    }
    async fn caller_for_key(&self, key: &KeyHash) -> Result<Option<Caller>, StoreError> {
        self.inner.caller_for_key(key).await
    }
}

#[async_trait]
impl Ledger for Toy {
    async fn reserve(&self, request: ChargeRequest<'_>) -> Result<Reservation, ReserveError> {
        let reservation = self.inner.reserve(request).await?;
        let price = reservation.taken.total();
        self.calls
            .lock()
            .unwrap()
            .insert(reservation.call, (reservation.account, price));
        Ok(reservation)
    }

    async fn refund(&self, call: CallId, failure: &CallFailure) -> Result<bool, StoreError> {
        let refunded = self.inner.refund(call, failure).await?;
        let again = self.calls.lock().unwrap().get(&call).copied();
        match again {
            Some((account, price))
                if !refunded
                    && self.fault == Fault::RefundTwice
                    && self.inner.call_status(call).await? == Some(CallStatus::Refunded) =>
            {
                self.inner.grant(account, Bucket::Topup, price).await?;
                Ok(true)
            }
            _ => Ok(refunded),
        }
    }
    async fn settle(&self, call: CallId, success: CallSuccess) -> Result<bool, StoreError> {
        self.inner.settle(call, success).await
    }
    async fn balance(&self, account: AccountId) -> Result<Balance, StoreError> {
        self.inner.balance(account).await
    }
    async fn charged(&self, call: CallId) -> Result<Option<Credits>, StoreError> {
        self.inner.charged(call).await
    }
    async fn call_status(&self, call: CallId) -> Result<Option<CallStatus>, StoreError> {
        self.inner.call_status(call).await
    }
    async fn forget_idempotent_calls(&self, now: DateTime<Utc>) -> Result<u64, StoreError> {
        self.inner.forget_idempotent_calls(now).await
    }
    async fn stale_reservations(
        &self,
        cutoff: DateTime<Utc>,
        limit: u64,
    ) -> Result<Vec<CallId>, StoreError> {
        self.inner.stale_reservations(cutoff, limit).await
    }
    async fn pending_for_request(
        &self,
        account: AccountId,
        request_id: &str,
    ) -> Result<Vec<CallId>, StoreError> {
        self.inner.pending_for_request(account, request_id).await
    }
}

#[async_trait]
impl Leases for Toy {
    async fn take_lease(
        &self,
        now: DateTime<Utc>,
        ttl: std::time::Duration,
    ) -> Result<Option<LeaseId>, StoreError> {
        self.inner.take_lease(now, ttl).await
    }
    async fn renew_lease(
        &self,
        now: DateTime<Utc>,
        ttl: std::time::Duration,
    ) -> Result<bool, StoreError> {
        self.inner.renew_lease(now, ttl).await
    }
    async fn release_lease(&self) -> Result<(), StoreError> {
        self.inner.release_lease().await
    }
    async fn orphaned_reservations(
        &self,
        now: DateTime<Utc>,
        limit: u64,
    ) -> Result<Vec<CallId>, StoreError> {
        self.inner.orphaned_reservations(now, limit).await
    }
    async fn forget_ended_leases(&self, now: DateTime<Utc>) -> Result<u64, StoreError> {
        self.inner.forget_ended_leases(now).await
    }
}

#[async_trait]
impl CallLog for Toy {
    async fn calls(
        &self,
        account: AccountId,
        query: CallQuery<'_>,
    ) -> Result<Vec<CallRecord>, StoreError> {
        self.inner.calls(account, query).await
    }
    async fn usage(
        &self,
        account: AccountId,
        since: DateTime<Utc>,
    ) -> Result<Vec<DailyUsage>, StoreError> {
        self.inner.usage(account, since).await
    }
    async fn calls_before(
        &self,
        account: AccountId,
        before: Option<CallId>,
        limit: u64,
    ) -> Result<Vec<CallRecord>, StoreError> {
        self.inner.calls_before(account, before, limit).await
    }
    async fn recent_calls(
        &self,
        account: AccountId,
        limit: u64,
    ) -> Result<Vec<CallRecord>, StoreError> {
        self.inner.recent_calls(account, limit).await
    }
}

#[async_trait]
impl Accounts for Toy {
    async fn set_key_rules(
        &self,
        key: KeyId,
        rules: &KeyRules,
    ) -> Result<Option<KeyInfo>, StoreError> {
        let mut rules = rules.clone();
        if self.fault == Fault::NoKeyLimits {
            rules.limit = None;
        }
        self.inner.set_key_rules(key, &rules).await
    }
    async fn create_account(&self, name: &str) -> Result<AccountId, StoreError> {
        self.inner.create_account(name).await
    }
    async fn add_key(&self, account: AccountId, key: &NewApiKey) -> Result<KeyId, StoreError> {
        self.inner.add_key(account, key).await
    }
    async fn revoke_key(&self, key: &KeyHash) -> Result<bool, StoreError> {
        self.inner.revoke_key(key).await
    }
    async fn revoke_key_id(&self, key: KeyId) -> Result<Option<KeyInfo>, StoreError> {
        self.inner.revoke_key_id(key).await
    }
    async fn key_info(&self, key: KeyId) -> Result<Option<KeyInfo>, StoreError> {
        self.inner.key_info(key).await
    }
    async fn keys_of(&self, account: AccountId) -> Result<Vec<KeyInfo>, StoreError> {
        self.inner.keys_of(account).await
    }
    async fn grant_once(
        &self,
        account: AccountId,
        grant: Grant<'_>,
    ) -> Result<Granted, StoreError> {
        self.inner.grant_once(account, grant).await
    }
    async fn grant(
        &self,
        account: AccountId,
        bucket: Bucket,
        amount: Credits,
    ) -> Result<Balance, StoreError> {
        self.inner.grant(account, bucket, amount).await
    }
    async fn set_low_balance(
        &self,
        account: AccountId,
        threshold: Option<Credits>,
    ) -> Result<bool, StoreError> {
        self.inner.set_low_balance(account, threshold).await
    }
    async fn account(&self, account: AccountId) -> Result<Option<AccountSummary>, StoreError> {
        self.inner.account(account).await
    }
    async fn accounts(&self, query: AccountQuery<'_>) -> Result<Vec<AccountSummary>, StoreError> {
        self.inner.accounts(query).await
    }
    async fn account_count(&self) -> Result<u64, StoreError> {
        self.inner.account_count().await
    }
    async fn overdue_reservations(&self, cutoff: DateTime<Utc>) -> Result<Overdue, StoreError> {
        self.inner.overdue_reservations(cutoff).await
    }
    async fn lapse_ended_subscriptions(
        &self,
        now: DateTime<Utc>,
    ) -> Result<Vec<Lapse>, StoreError> {
        self.inner.lapse_ended_subscriptions(now).await
    }
    async fn audit(&self) -> Result<Vec<AccountAudit>, StoreError> {
        self.inner.audit().await
    }
    async fn ready(&self) -> Result<(), StoreError> {
        self.inner.ready().await
    }
}

#[async_trait]
impl ResponseOwners for Toy {
    async fn record_response(&self, owner: &ResponseOwner) -> Result<(), StoreError> {
        self.inner.record_response(owner).await
    }
    async fn response_owner(&self, response_id: &str) -> Result<Option<ResponseOwner>, StoreError> {
        self.inner.response_owner(response_id).await
    }
    async fn forget_responses(&self, before: DateTime<Utc>) -> Result<u64, StoreError> {
        self.inner.forget_responses(before).await
    }
}

#[async_trait]
impl RedemptionCodes for Toy {
    async fn create_code_batch(&self, batch: NewCodeBatch<'_>) -> Result<CodeBatch, StoreError> {
        if self.fault == Fault::NoCodes {
            return Err(StoreError::Unsupported("redemption codes"));
        }
        {
            let mut codes = self.codes.lock().unwrap();
            for code in batch.codes {
                codes.0.insert(code.clone(), (batch.credits, batch.bucket));
            }
        }
        self.inner.create_code_batch(batch).await
    }

    async fn redeem_code(
        &self,
        account: AccountId,
        code: &CodeHash,
        at: DateTime<Utc>,
    ) -> Result<Option<Redeemed>, StoreError> {
        if self.fault == Fault::NoCodes {
            return Ok(None);
        }
        let redeemed = self.inner.redeem_code(account, code, at).await?;
        let (terms, used) = {
            let mut codes = self.codes.lock().unwrap();
            let terms = codes.0.get(code).copied();
            let used = !codes.1.insert(code.clone());
            (terms, used)
        };
        match (redeemed, terms) {
            (None, Some((credits, bucket))) if used && self.fault == Fault::CodeTwice => {
                let balance = self.inner.grant(account, bucket, credits).await?;
                let mut again = self.inner.redeem_code(account, code, at).await?;
                // The memory store refuses it; the toy grants it anyway and says it did.
                if again.is_none() {
                    again = Some(redeemed_again(credits, bucket, balance));
                }
                Ok(again)
            }
            (redeemed, _) => Ok(redeemed),
        }
    }
    async fn code_batches(&self) -> Result<Vec<CodeBatch>, StoreError> {
        self.inner.code_batches().await
    }
    async fn revoke_code_batch(
        &self,
        batch: i64,
        at: DateTime<Utc>,
    ) -> Result<Option<CodeBatch>, StoreError> {
        self.inner.revoke_code_batch(batch, at).await
    }
}

#[async_trait]
impl EventOutbox for Toy {
    async fn record_event(&self, event: &WebhookEvent) -> Result<(), StoreError> {
        self.inner.record_event(event).await
    }
    async fn claim_deliveries(
        &self,
        now: DateTime<Utc>,
        hold: std::time::Duration,
        limit: u64,
    ) -> Result<Vec<Delivery>, StoreError> {
        self.inner.claim_deliveries(now, hold, limit).await
    }
    async fn attempted(&self, id: i64, attempt: &Attempted) -> Result<(), StoreError> {
        self.inner.attempted(id, attempt).await
    }
    async fn deliveries(
        &self,
        status: Option<DeliveryStatus>,
        limit: u64,
    ) -> Result<Vec<Delivery>, StoreError> {
        self.inner.deliveries(status, limit).await
    }
    async fn retry_delivery(
        &self,
        id: i64,
        now: DateTime<Utc>,
    ) -> Result<Option<Delivery>, StoreError> {
        self.inner.retry_delivery(id, now).await
    }
}

/// The `Redeemed` a toy answers for a code it should have refused.
fn redeemed_again(credits: Credits, bucket: Bucket, balance: Balance) -> Redeemed {
    Redeemed {
        batch: 0,
        credits,
        bucket,
        balance,
        lapsed: Credits::ZERO,
    }
}

async fn violation(fault: Fault) -> model_gateway::store::conformance::Violation {
    Conformance::new()
        .cases(256)
        .check(|| async move { Toy::new(fault) })
        .await
        .expect_err("a toy store with a fault fails the suite")
}

#[tokio::test(flavor = "current_thread")]
async fn a_store_that_lets_a_code_grant_twice_fails_the_suite_on_the_codes_rule() {
    let violation = violation(Fault::CodeTwice).await;
    assert_eq!(violation.rule, Rule::Codes, "{violation}");
    // Shrunk to the two redemptions that show it, and what needs them.
    assert!(violation.steps.len() <= 3, "{violation}");
    assert!(
        violation.to_string().contains("the rule Codes"),
        "{violation}"
    );
}

#[tokio::test(flavor = "current_thread")]
async fn a_store_that_refunds_twice_fails_the_suite_on_the_refund_rule() {
    let violation = violation(Fault::RefundTwice).await;
    assert!(matches!(violation.rule, Rule::Refund), "{violation}");
}

#[tokio::test(flavor = "current_thread")]
async fn a_store_that_ignores_key_limits_fails_the_suite_on_the_key_limit_rule() {
    let violation = violation(Fault::NoKeyLimits).await;
    assert_eq!(violation.rule, Rule::KeyLimit, "{violation}");
}

#[tokio::test(flavor = "current_thread")]
async fn a_store_without_codes_passes_and_the_suite_says_it_skipped_them() {
    let report = Conformance::new()
        .cases(32)
        .check(|| async { Toy::new(Fault::NoCodes) })
        .await
        .unwrap_or_else(|violation| panic!("{violation}"));
    assert!(
        report
            .skipped
            .iter()
            .any(|skipped| skipped.starts_with("redemption codes")),
        "{report}"
    );
    assert!(
        report.to_string().contains("skipped: redemption codes"),
        "{report}"
    );
}

/// A failing sequence replays: the same steps fail the same rule again.
#[tokio::test(flavor = "current_thread")]
async fn a_reported_sequence_replays_to_the_same_rule() {
    let violation = violation(Fault::CodeTwice).await;
    let again = Conformance::new()
        .replay(|| async { Toy::new(Fault::CodeTwice) }, &violation.steps)
        .await
        .expect_err("the same steps fail again");
    assert_eq!(again.rule, violation.rule);
    Conformance::new()
        .replay(|| async { MemoryStore::new() }, &violation.steps)
        .await
        .expect("the memory store passes them");
}
