//! The call log and administration of the in-memory store.

use foldhash::{HashMap, HashMapExt};

use async_trait::async_trait;
use chrono::{DateTime, Utc};

use super::state::{AccountRow, MemoryStore, State};
use crate::call::{AccountId, KeyId, KeyRules};
use crate::credits::{Balance, Bucket, Credits};
use crate::keys::{KeyHash, NewApiKey};
use crate::store::records::{
    AccountAudit, AccountQuery, AccountSummary, CallQuery, DailyUsage, Grant, Granted, KeyInfo,
    Lapse, Overdue, ReportQuery, ReportRow, Sums,
};
use crate::store::traits::{Accounts, CallLog};
use crate::store::types::{
    BalanceOverflow, CallRecord, CallStatus, IdempotencyKeyReused, StoreError, check_grant_amount,
    unknown_account,
};

#[async_trait]
impl CallLog for MemoryStore {
    async fn usage(
        &self,
        account: AccountId,
        since: DateTime<Utc>,
    ) -> Result<Vec<DailyUsage>, StoreError> {
        Ok(self.daily_usage(account, since))
    }

    async fn usage_report(&self, query: ReportQuery) -> Result<Vec<ReportRow>, StoreError> {
        Ok(ReportRow::from_calls(&query, &self.lock().calls))
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
        let mut days: std::collections::BTreeMap<(String, String), DailyUsage> =
            std::collections::BTreeMap::new();
        for call in &self.lock().calls {
            if call.account == account && call.status == CallStatus::Ok && call.created_at >= since
            {
                let day = call.created_at.format("%Y-%m-%d").to_string();
                let sums = days
                    .entry((day.clone(), call.model.clone()))
                    .or_insert_with(|| DailyUsage {
                        day,
                        model: call.model.clone(),
                        calls: 0,
                        credits: 0,
                        input_tokens: 0,
                        output_tokens: 0,
                        cache_read_tokens: 0,
                        cache_write_tokens: 0,
                    });
                let count = |tokens: Option<i64>| tokens.unwrap_or(0);
                sums.calls += 1;
                sums.credits += call.price.get();
                sums.input_tokens += count(call.input_tokens);
                sums.output_tokens += count(call.output_tokens);
                sums.cache_read_tokens += count(call.cache_read_tokens);
                sums.cache_write_tokens +=
                    count(call.cache_write_tokens) + count(call.cache_write_1h_tokens);
            }
        }
        days.into_values().collect()
    }
}

#[async_trait]
impl Accounts for MemoryStore {
    async fn overdue_reservations(&self, cutoff: DateTime<Utc>) -> Result<Overdue, StoreError> {
        let state = self.lock();
        let mut overdue = Overdue::default();
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
                low_balance_credits: None,
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
                spent: Credits::ZERO,
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
        let Some(info) = state.key_rows.get_mut(&key) else {
            return Ok(None);
        };
        info.rules = rules.clone();
        Ok(state.key_now(key))
    }

    async fn key_info(&self, key: KeyId) -> Result<Option<KeyInfo>, StoreError> {
        Ok(self.lock().key_now(key))
    }

    async fn keys_of(&self, account: AccountId) -> Result<Vec<KeyInfo>, StoreError> {
        let state = self.lock();
        Ok(state
            .key_rows
            .values()
            .filter(|info| info.account == account)
            .filter_map(|info| state.key_now(info.id))
            .collect())
    }

    async fn grant_once(
        &self,
        account: AccountId,
        grant: Grant<'_>,
    ) -> Result<Granted, StoreError> {
        self.lock().grant(account, grant)
    }

    async fn set_low_balance(
        &self,
        account: AccountId,
        threshold: Option<Credits>,
    ) -> Result<bool, StoreError> {
        let mut state = self.lock();
        let Some(row) = state.accounts.get_mut(&account) else {
            return Ok(false);
        };
        row.low_balance_credits = threshold;
        Ok(true)
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
        let mut short: HashMap<AccountId, i128> = HashMap::new();
        for call in &state.calls {
            if call.status != CallStatus::Refunded {
                let sums = charged.entry(call.account).or_default();
                sums.add(Bucket::Subscription, call.charged_subscription);
                sums.add(Bucket::Topup, call.charged_topup);
                *short.entry(call.account).or_default() += i128::from(call.shortfall.get());
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
                shortfall: short.get(id).copied().unwrap_or_default(),
            })
            .collect())
    }
}

impl State {
    /// Applies a grant (see [`Accounts::grant_once`]).
    pub(super) fn grant(
        &mut self,
        account: AccountId,
        grant: Grant<'_>,
    ) -> Result<Granted, StoreError> {
        check_grant_amount(grant.amount)?;
        let state = self;
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
                return Err(StoreError::IdempotencyKeyReused(IdempotencyKeyReused {
                    key: key.to_owned(),
                }));
            }
            return Ok(Granted {
                balance,
                applied: false,
                lapsed: Credits::ZERO,
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
        let lapsed = if new_period {
            (state.lapse(account, ends_at.unwrap_or(grant.at)))
                .map_or(Credits::ZERO, |lapse| lapse.amount)
        } else {
            Credits::ZERO
        };
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
            lapsed,
        })
    }
}
