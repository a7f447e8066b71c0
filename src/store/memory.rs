//! An in-memory store: for embedding without a database, and the reference model the database
//! backends are tested against. Nothing survives a restart.

use std::collections::{HashMap, HashSet};
use std::sync::Mutex;

use async_trait::async_trait;
use chrono::Utc;

use super::{
    AccountId, Accounts, BalanceOverflow, CallFailure, CallId, CallLog, CallRecord, CallStatus,
    CallSuccess, Caller, ChargeRequest, KeyId, KeyStore, Ledger, Reservation, ReserveError,
    StoreError, check_grant_amount,
};
use crate::credits::{Balance, Bucket, Credits};
use crate::keys::{KeyHash, NewApiKey};

/// A store that keeps everything in one mutex-guarded map; each operation is atomic because it
/// runs entirely under the lock.
#[derive(Debug, Default)]
pub struct MemoryStore {
    state: Mutex<State>,
}

#[derive(Debug, Default)]
struct State {
    balances: HashMap<AccountId, Balance>,
    keys: HashMap<KeyHash, (Caller, bool)>,
    revoked: HashSet<KeyId>,
    calls: Vec<CallRecord>,
    next_key: i64,
}

impl MemoryStore {
    /// An empty store.
    pub fn new() -> MemoryStore {
        MemoryStore::default()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        // A panic while holding the lock cannot leave a half-applied change: every change is
        // computed first and written in one assignment.
        self.state
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }
}

fn unknown_account(account: AccountId) -> StoreError {
    StoreError::msg(format!("unknown account {}", account.0))
}

#[async_trait]
impl KeyStore for MemoryStore {
    async fn caller_for_key(&self, key: &KeyHash) -> Result<Option<Caller>, StoreError> {
        Ok(self
            .lock()
            .keys
            .get(key)
            .filter(|(_, active)| *active)
            .map(|(caller, _)| *caller))
    }
}

#[async_trait]
impl Ledger for MemoryStore {
    async fn reserve(&self, request: ChargeRequest<'_>) -> Result<Reservation, ReserveError> {
        let mut state = self.lock();
        if state.revoked.contains(&request.caller.key) {
            return Err(ReserveError::KeyRevoked);
        }
        let account = request.caller.account;
        let balance = state
            .balances
            .get_mut(&account)
            .ok_or_else(|| unknown_account(account))?;
        let taken = balance
            .split_charge(request.price)
            .ok_or(ReserveError::InsufficientCredits)?;
        balance.subscription.0 -= taken.subscription.0;
        balance.topup.0 -= taken.topup.0;
        let call = CallId(state.calls.len() as i64 + 1);
        state.calls.push(CallRecord {
            id: call,
            account,
            key: request.caller.key,
            protocol: request.protocol,
            model: request.model.to_owned(),
            price: request.price,
            charged_subscription: taken.subscription,
            charged_topup: taken.topup,
            status: CallStatus::Pending,
            upstream_status: None,
            channel: None,
            upstream_error: None,
            input_tokens: None,
            output_tokens: None,
            created_at: Utc::now(),
            finished_at: None,
            request_id: request.request_id.map(str::to_owned),
        });
        Ok(Reservation {
            call,
            account,
            taken,
        })
    }

    async fn settle(&self, call: CallId, success: CallSuccess) -> Result<bool, StoreError> {
        let mut state = self.lock();
        let Some(record) = pending_call(&mut state, call) else {
            return Ok(false);
        };
        record.status = CallStatus::Ok;
        record.upstream_status = Some(success.upstream_status);
        record.channel = success.channel;
        record.input_tokens = success.usage.input_tokens;
        record.output_tokens = success.usage.output_tokens;
        record.finished_at = Some(Utc::now());
        Ok(true)
    }

    async fn call_status(&self, call: CallId) -> Result<Option<CallStatus>, StoreError> {
        let state = self.lock();
        let index = usize::try_from(call.0)
            .ok()
            .and_then(|id| id.checked_sub(1));
        Ok(index
            .and_then(|index| state.calls.get(index))
            .map(|record| record.status))
    }

    async fn refund(&self, call: CallId, failure: &CallFailure) -> Result<bool, StoreError> {
        let mut state = self.lock();
        let Some(record) = pending_call(&mut state, call) else {
            return Ok(false);
        };
        record.status = CallStatus::Refunded;
        record.upstream_status = failure.upstream_status;
        record.upstream_error = Some(failure.error.clone());
        record.finished_at = Some(Utc::now());
        let (account, subscription, topup) = (
            record.account,
            record.charged_subscription,
            record.charged_topup,
        );
        let balance = state.balances.entry(account).or_default();
        balance.subscription.0 += subscription.0;
        balance.topup.0 += topup.0;
        Ok(true)
    }

    async fn stale_reservations(
        &self,
        cutoff: chrono::DateTime<Utc>,
        limit: u64,
    ) -> Result<Vec<CallId>, StoreError> {
        let limit = usize::try_from(limit).unwrap_or(usize::MAX);
        Ok(self
            .lock()
            .calls
            .iter()
            .filter(|c| c.status == CallStatus::Pending && c.created_at < cutoff)
            .take(limit)
            .map(|c| c.id)
            .collect())
    }

    async fn balance(&self, account: AccountId) -> Result<Balance, StoreError> {
        self.lock()
            .balances
            .get(&account)
            .copied()
            .ok_or_else(|| unknown_account(account))
    }
}

fn pending_call(state: &mut State, call: CallId) -> Option<&mut CallRecord> {
    let index = usize::try_from(call.0).ok()?.checked_sub(1)?;
    state
        .calls
        .get_mut(index)
        .filter(|record| record.status == CallStatus::Pending)
}

#[async_trait]
impl CallLog for MemoryStore {
    async fn calls_before(
        &self,
        account: AccountId,
        before: Option<CallId>,
        limit: u64,
    ) -> Result<Vec<CallRecord>, StoreError> {
        let limit = usize::try_from(limit).unwrap_or(usize::MAX);
        Ok(self
            .lock()
            .calls
            .iter()
            .rev()
            .filter(|record| record.account == account)
            .filter(|record| before.is_none_or(|before| record.id < before))
            .take(limit)
            .cloned()
            .collect())
    }
}

#[async_trait]
impl Accounts for MemoryStore {
    async fn create_account(&self, _name: &str) -> Result<AccountId, StoreError> {
        let mut state = self.lock();
        let account = AccountId(state.balances.len() as i64 + 1);
        state.balances.insert(account, Balance::default());
        Ok(account)
    }

    async fn add_key(&self, account: AccountId, key: &NewApiKey) -> Result<KeyId, StoreError> {
        let mut state = self.lock();
        if !state.balances.contains_key(&account) {
            return Err(unknown_account(account));
        }
        state.next_key += 1;
        let id = KeyId(state.next_key);
        state
            .keys
            .insert(key.hash(), (Caller { account, key: id }, true));
        Ok(id)
    }

    async fn revoke_key(&self, key: &KeyHash) -> Result<bool, StoreError> {
        let mut state = self.lock();
        let revoked = match state.keys.get_mut(key) {
            Some((caller, active)) if *active => {
                *active = false;
                caller.key
            }
            _ => return Ok(false),
        };
        state.revoked.insert(revoked);
        Ok(true)
    }

    async fn grant(
        &self,
        account: AccountId,
        bucket: Bucket,
        amount: Credits,
    ) -> Result<Balance, StoreError> {
        check_grant_amount(amount)?;
        let mut state = self.lock();
        let balance = state
            .balances
            .get_mut(&account)
            .ok_or_else(|| unknown_account(account))?;
        *balance = balance
            .checked_grant(bucket, amount)
            .ok_or(BalanceOverflow {
                account,
                bucket,
                amount,
            })?;
        Ok(*balance)
    }

    async fn account_count(&self) -> Result<u64, StoreError> {
        Ok(self.lock().balances.len() as u64)
    }
}
