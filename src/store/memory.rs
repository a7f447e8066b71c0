//! An in-memory store: for embedding without a database, and the reference model the database
//! backends are tested against. Nothing survives a restart.

use std::collections::{BTreeMap, HashMap};
use std::sync::Mutex;

use async_trait::async_trait;
use chrono::{DateTime, Utc};

use super::{
    AccountAudit, AccountId, AccountQuery, AccountSummary, Accounts, ActiveKey, BalanceOverflow,
    CallFailure, CallId, CallLog, CallQuery, CallRecord, CallStatus, CallSuccess, Caller,
    ChargeRequest, DEFAULT_IDEMPOTENCY_WINDOW, DailyUsage, Grant, Granted, IdempotencyKeyReused,
    KeptReply, KeyId, KeyInfo, KeyRules, KeyStore, KeyedCall, KeyedDecision, Lapse, Ledger,
    Reservation, ReserveError, StoreError, Sums, check_grant_amount, decide_keyed, unknown_account,
    window_cutoff,
};
use crate::credits::{Balance, Bucket, Credits, Split};
use crate::keys::{KeyHash, NewApiKey};
use crate::store::rules::holds;
use crate::store::rules::reserve::{Payer, decide_reserve};

/// A store that keeps everything in one mutex-guarded map; each operation is atomic because it
/// runs entirely under the lock.
#[derive(Debug, Default)]
pub struct MemoryStore {
    state: Mutex<State>,
}

#[derive(Debug, Default)]
struct State {
    balances: HashMap<AccountId, Balance>,
    accounts: BTreeMap<AccountId, AccountRow>,
    keys: HashMap<KeyHash, KeyId>,
    key_rows: BTreeMap<KeyId, KeyInfo>,
    calls: Vec<CallRecord>,
    next_key: i64,
    /// Idempotency records by account and key.
    keyed: HashMap<(AccountId, String), KeyedRow>,
    /// Which record names each keyed call.
    keyed_by_call: HashMap<CallId, (AccountId, String)>,
    /// How long a key holds; `None`: [`DEFAULT_IDEMPOTENCY_WINDOW`].
    idempotency_window: Option<std::time::Duration>,
}

#[derive(Debug)]
struct KeyedRow {
    fingerprint: String,
    call: CallId,
    created_at: DateTime<Utc>,
    reply: Option<KeptReply>,
}

#[derive(Debug)]
struct AccountRow {
    name: String,
    created_at: DateTime<Utc>,
    granted: Sums,
    lapsed: i128,
    subscription_ends_at: Option<DateTime<Utc>>,
    /// Idempotency keys of the grants applied, with what each granted.
    grants_by_key: HashMap<String, (Bucket, Credits)>,
}

impl State {
    fn summary(&self, id: AccountId) -> Option<AccountSummary> {
        let row = self.accounts.get(&id)?;
        Some(AccountSummary {
            id,
            name: row.name.clone(),
            balance: self.balances.get(&id).copied().unwrap_or_default(),
            subscription_ends_at: row.subscription_ends_at,
            created_at: row.created_at,
        })
    }

    /// Takes out what is left of the account's subscription credits, if anything, recording
    /// it as lapsed at `period_end`.
    fn lapse(&mut self, account: AccountId, period_end: DateTime<Utc>) -> Option<Lapse> {
        let balance = self.balances.get_mut(&account)?;
        let amount = balance.subscription;
        if amount <= Credits::ZERO {
            return None;
        }
        balance.subscription = Credits::ZERO;
        self.accounts.get_mut(&account)?.lapsed += i128::from(amount.get());
        Some(Lapse {
            account,
            amount,
            period_end,
        })
    }

    /// Whether the key was revoked (a key this store never saw is not: tests and examples
    /// charge made-up callers).
    fn call(&self, call: CallId) -> Option<&CallRecord> {
        let index = usize::try_from(call.0).ok()?.checked_sub(1)?;
        self.calls.get(index)
    }

    fn idempotency_window(&self) -> std::time::Duration {
        self.idempotency_window
            .unwrap_or(DEFAULT_IDEMPOTENCY_WINDOW)
    }

    /// What a keyed call found under its key.
    fn keyed_call(&self, account: AccountId, key: &str) -> Option<KeyedCall> {
        let row = self.keyed.get(&(account, key.to_owned()))?;
        Some(KeyedCall {
            fingerprint: row.fingerprint.clone(),
            status: self.call(row.call)?.status,
            created_at: row.created_at,
            reply: row.reply.clone(),
        })
    }

    fn key_revoked(&self, key: KeyId) -> bool {
        self.key_rows
            .get(&key)
            .is_some_and(|info| info.revoked_at.is_some())
    }
}

impl MemoryStore {
    /// An empty store.
    pub fn new() -> MemoryStore {
        MemoryStore::default()
    }

    /// The same store holding idempotency keys for `window` after their call (default
    /// [`DEFAULT_IDEMPOTENCY_WINDOW`]).
    pub fn with_idempotency_window(self, window: std::time::Duration) -> MemoryStore {
        self.lock().idempotency_window = Some(window);
        self
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        // A panic while holding the lock cannot leave a half-applied change: every change is
        // computed first and written in one assignment.
        self.state
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }
}

#[async_trait]
impl KeyStore for MemoryStore {
    async fn active_key(&self, key: &KeyHash) -> Result<Option<ActiveKey>, StoreError> {
        let state = self.lock();
        Ok(state
            .keys
            .get(key)
            .and_then(|id| state.key_rows.get(id))
            .filter(|info| info.revoked_at.is_none())
            .map(|info| ActiveKey {
                caller: Caller {
                    account: info.account,
                    key: info.id,
                },
                rules: info.rules.clone(),
            }))
    }
}

/// Everything in this store dies with its process: there is no other instance to tell.
impl super::Leases for MemoryStore {}

#[async_trait]
impl Ledger for MemoryStore {
    async fn reserve(&self, request: ChargeRequest<'_>) -> Result<Reservation, ReserveError> {
        let mut state = self.lock();
        let key_active = !state.key_revoked(request.caller.key);
        let account = request.caller.account;
        // A revoked key is refused before its idempotency record is read.
        if key_active && let Some(key) = request.idempotency {
            let found = state.keyed_call(account, key.key());
            let window = state.idempotency_window();
            if let KeyedDecision::Answer(answer) = decide_keyed(found, key, request.at, window) {
                return Err(answer);
            }
        }
        let ends_at = state
            .accounts
            .get(&account)
            .and_then(|row| row.subscription_ends_at);
        let payer = state
            .balances
            .get(&account)
            .map(|balance| Payer::unheld(*balance, ends_at));
        let taken = decide_reserve(key_active, payer, request.at, request.price)
            .map_err(|refusal| refusal.into_error(account))?;
        let Some(balance) = state.balances.get_mut(&account) else {
            unreachable!("decide_reserve found the account")
        };
        *balance = holds::take(*balance, taken);
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
        if let Some(key) = request.idempotency {
            let name = (account, key.key().to_owned());
            let row = KeyedRow {
                fingerprint: key.fingerprint(),
                call,
                created_at: request.at,
                reply: None,
            };
            if let Some(replaced) = state.keyed.insert(name.clone(), row) {
                state.keyed_by_call.remove(&replaced.call);
            }
            state.keyed_by_call.insert(call, name);
        }
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
        if let Some(name) = state.keyed_by_call.get(&call).cloned()
            && let Some(row) = state.keyed.get_mut(&name)
        {
            row.reply = success.reply;
        }
        Ok(true)
    }

    async fn forget_idempotent_calls(&self, now: DateTime<Utc>) -> Result<u64, StoreError> {
        let mut state = self.lock();
        let Some(cutoff) = window_cutoff(now, state.idempotency_window()) else {
            return Ok(0);
        };
        let expired: Vec<_> = state
            .keyed
            .iter()
            .filter(|(_, row)| {
                row.created_at <= cutoff
                    && state
                        .call(row.call)
                        .is_some_and(|call| call.status != CallStatus::Pending)
            })
            .map(|(name, row)| (name.clone(), row.call))
            .collect();
        for (name, call) in &expired {
            state.keyed.remove(name);
            state.keyed_by_call.remove(call);
        }
        Ok(expired.len() as u64)
    }

    async fn pending_for_request(
        &self,
        account: AccountId,
        request_id: &str,
    ) -> Result<Vec<CallId>, StoreError> {
        let state = self.lock();
        Ok(state
            .calls
            .iter()
            .filter(|call| {
                call.account == account
                    && call.status == CallStatus::Pending
                    && call.request_id.as_deref() == Some(request_id)
            })
            .map(|call| call.id)
            .collect())
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
        *balance = holds::give_back(
            *balance,
            Split {
                subscription,
                topup,
            },
        );
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
    async fn usage(
        &self,
        account: AccountId,
        since: DateTime<Utc>,
    ) -> Result<Vec<DailyUsage>, StoreError> {
        Ok(self.daily_usage(account, since))
    }

    async fn calls(
        &self,
        account: AccountId,
        query: CallQuery<'_>,
    ) -> Result<Vec<CallRecord>, StoreError> {
        let limit = usize::try_from(query.limit).unwrap_or(usize::MAX);
        Ok(self
            .lock()
            .calls
            .iter()
            .rev()
            .filter(|record| record.account == account)
            .filter(|record| query.before.is_none_or(|before| record.id < before))
            .filter(|record| query.status.is_none_or(|status| record.status == status))
            .filter(|record| query.model.is_none_or(|model| record.model == model))
            .take(limit)
            .cloned()
            .collect())
    }
}

impl MemoryStore {
    fn daily_usage(&self, account: AccountId, since: DateTime<Utc>) -> Vec<DailyUsage> {
        let mut days: std::collections::BTreeMap<(String, String), (i64, i64)> =
            std::collections::BTreeMap::new();
        for call in &self.lock().calls {
            if call.account == account && call.status == CallStatus::Ok && call.created_at >= since
            {
                let day = call.created_at.format("%Y-%m-%d").to_string();
                let sums = days.entry((day, call.model.clone())).or_default();
                sums.0 += 1;
                sums.1 += call.price.get();
            }
        }
        days.into_iter()
            .map(|((day, model), (calls, credits))| DailyUsage {
                day,
                model,
                calls,
                credits,
            })
            .collect()
    }
}

#[async_trait]
impl Accounts for MemoryStore {
    async fn overdue_reservations(
        &self,
        cutoff: DateTime<Utc>,
    ) -> Result<super::Overdue, StoreError> {
        let state = self.lock();
        let mut overdue = super::Overdue::default();
        for call in state
            .calls
            .iter()
            .filter(|call| call.status == CallStatus::Pending && call.created_at < cutoff)
        {
            overdue.calls += 1;
            overdue.credits +=
                i128::from(call.charged_subscription.get()) + i128::from(call.charged_topup.get());
        }
        Ok(overdue)
    }

    async fn create_account(&self, name: &str) -> Result<AccountId, StoreError> {
        let mut state = self.lock();
        let account = AccountId(state.balances.len() as i64 + 1);
        state.balances.insert(account, Balance::default());
        state.accounts.insert(
            account,
            AccountRow {
                name: name.to_owned(),
                created_at: Utc::now(),
                granted: Sums::default(),
                lapsed: 0,
                subscription_ends_at: None,
                grants_by_key: HashMap::new(),
            },
        );
        Ok(account)
    }

    async fn add_key(&self, account: AccountId, key: &NewApiKey) -> Result<KeyId, StoreError> {
        let mut state = self.lock();
        if !state.balances.contains_key(&account) {
            return Err(unknown_account(account));
        }
        state.next_key += 1;
        let id = KeyId(state.next_key);
        state.keys.insert(key.hash(), id);
        state.key_rows.insert(
            id,
            KeyInfo {
                id,
                account,
                prefix: key.display_prefix().to_owned(),
                rules: KeyRules::default(),
                created_at: Utc::now(),
                revoked_at: None,
            },
        );
        Ok(id)
    }

    async fn revoke_key(&self, key: &KeyHash) -> Result<bool, StoreError> {
        let mut state = self.lock();
        let Some(&id) = state.keys.get(key) else {
            return Ok(false);
        };
        match state.key_rows.get_mut(&id) {
            Some(info) if info.revoked_at.is_none() => {
                info.revoked_at = Some(Utc::now());
                Ok(true)
            }
            _ => Ok(false),
        }
    }

    async fn revoke_key_id(&self, key: KeyId) -> Result<Option<KeyInfo>, StoreError> {
        let mut state = self.lock();
        Ok(state.key_rows.get_mut(&key).map(|info| {
            info.revoked_at.get_or_insert_with(Utc::now);
            info.clone()
        }))
    }

    async fn set_key_rules(
        &self,
        key: KeyId,
        rules: &KeyRules,
    ) -> Result<Option<KeyInfo>, StoreError> {
        let mut state = self.lock();
        Ok(state.key_rows.get_mut(&key).map(|info| {
            info.rules = rules.clone();
            info.clone()
        }))
    }

    async fn key_info(&self, key: KeyId) -> Result<Option<KeyInfo>, StoreError> {
        Ok(self.lock().key_rows.get(&key).cloned())
    }

    async fn keys_of(&self, account: AccountId) -> Result<Vec<KeyInfo>, StoreError> {
        Ok(self
            .lock()
            .key_rows
            .values()
            .filter(|info| info.account == account)
            .cloned()
            .collect())
    }

    async fn grant_once(
        &self,
        account: AccountId,
        grant: Grant<'_>,
    ) -> Result<Granted, StoreError> {
        check_grant_amount(grant.amount)?;
        let mut state = self.lock();
        let balance = *state
            .balances
            .get(&account)
            .ok_or_else(|| unknown_account(account))?;
        let row = state
            .accounts
            .get(&account)
            .ok_or_else(|| unknown_account(account))?;
        if let Some(key) = grant.idempotency_key
            && let Some(&earlier) = row.grants_by_key.get(key)
        {
            if earlier != (grant.bucket, grant.amount) {
                return Err(StoreError(Box::new(IdempotencyKeyReused {
                    key: key.to_owned(),
                })));
            }
            return Ok(Granted {
                balance,
                applied: false,
            });
        }
        let ends_at = row.subscription_ends_at;
        let ended = ends_at.is_some_and(|end| end <= grant.at);
        let new_period =
            grant.bucket == Bucket::Subscription && (grant.period_end.is_some() || ended);
        let from = if new_period {
            Balance {
                subscription: Credits::ZERO,
                ..balance
            }
        } else {
            balance
        };
        let granted = from
            .checked_grant(grant.bucket, grant.amount)
            .ok_or(BalanceOverflow {
                account,
                bucket: grant.bucket,
                amount: grant.amount,
            })?;
        if new_period {
            state.lapse(account, ends_at.unwrap_or(grant.at));
        }
        state.balances.insert(account, granted);
        let row = state
            .accounts
            .get_mut(&account)
            .ok_or_else(|| unknown_account(account))?;
        if new_period {
            row.subscription_ends_at = grant.period_end;
        }
        row.granted.add(grant.bucket, grant.amount);
        if let Some(key) = grant.idempotency_key {
            row.grants_by_key
                .insert(key.to_owned(), (grant.bucket, grant.amount));
        }
        Ok(Granted {
            balance: granted,
            applied: true,
        })
    }

    async fn account(&self, account: AccountId) -> Result<Option<AccountSummary>, StoreError> {
        Ok(self.lock().summary(account))
    }

    async fn accounts(&self, query: AccountQuery<'_>) -> Result<Vec<AccountSummary>, StoreError> {
        let state = self.lock();
        let limit = usize::try_from(query.limit).unwrap_or(usize::MAX);
        let matches = |id: AccountId, row: &AccountRow| {
            query.search.is_none_or(|search| {
                row.name.to_lowercase().contains(&search.to_lowercase())
                    || state.key_rows.values().any(|key| {
                        key.account == id && !search.is_empty() && key.prefix.starts_with(search)
                    })
            })
        };
        Ok(state
            .accounts
            .iter()
            .filter(|(id, _)| query.after.is_none_or(|after| **id > after))
            .filter(|(id, row)| matches(**id, row))
            .take(limit)
            .filter_map(|(id, _)| state.summary(*id))
            .collect())
    }

    async fn account_count(&self) -> Result<u64, StoreError> {
        Ok(self.lock().balances.len() as u64)
    }

    async fn lapse_ended_subscriptions(
        &self,
        now: DateTime<Utc>,
    ) -> Result<Vec<Lapse>, StoreError> {
        let mut state = self.lock();
        let ended: Vec<(AccountId, DateTime<Utc>)> = state
            .accounts
            .iter()
            .filter_map(|(id, row)| Some((*id, row.subscription_ends_at?)))
            .filter(|(_, end)| *end <= now)
            .collect();
        Ok(ended
            .into_iter()
            .filter_map(|(account, end)| state.lapse(account, end))
            .collect())
    }

    async fn audit(&self) -> Result<Vec<AccountAudit>, StoreError> {
        let state = self.lock();
        let mut charged: HashMap<AccountId, Sums> = HashMap::new();
        for call in &state.calls {
            if call.status != CallStatus::Refunded {
                let sums = charged.entry(call.account).or_default();
                sums.add(Bucket::Subscription, call.charged_subscription);
                sums.add(Bucket::Topup, call.charged_topup);
            }
        }
        Ok(state
            .accounts
            .iter()
            .map(|(id, row)| AccountAudit {
                account: *id,
                granted: row.granted,
                lapsed: row.lapsed,
                charged: charged.get(id).copied().unwrap_or_default(),
                balance: state.balances.get(id).copied().unwrap_or_default(),
            })
            .collect())
    }
}
