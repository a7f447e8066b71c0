//! Key lookups and the ledger of the in-memory store.

use async_trait::async_trait;
use chrono::{DateTime, Utc};

use super::state::{KeyedRow, MemoryStore, pending_call};
use crate::call::{AccountId, CallId, Caller, Reservation};
use crate::credits::{Balance, Credits, Split};
use crate::keys::KeyHash;
use crate::store::rules::holds;
use crate::store::rules::idempotency::{KeyedDecision, decide as decide_keyed, window_cutoff};
use crate::store::rules::reserve::{Limited, Payer, decide_reserve};
use crate::store::rules::settle::{Beyond, decide_settle};
use crate::store::traits::{KeyStore, Leases, Ledger, ResponseOwners};
use crate::store::types::{
    ActiveKey, CallFailure, CallRecord, CallStatus, CallSuccess, ChargeRequest, ReserveError,
    ResponseOwner, StoreError, unknown_account,
};

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
impl Leases for MemoryStore {}

#[async_trait]
impl ResponseOwners for MemoryStore {
    async fn record_response(&self, owner: &ResponseOwner) -> Result<(), StoreError> {
        let mut state = self.lock();
        state
            .response_owners
            .entry(owner.response_id.clone())
            .or_insert_with(|| (owner.clone(), Utc::now()));
        Ok(())
    }

    async fn response_owner(&self, response_id: &str) -> Result<Option<ResponseOwner>, StoreError> {
        let state = self.lock();
        Ok(state
            .response_owners
            .get(response_id)
            .map(|(owner, _)| owner.clone()))
    }

    async fn forget_responses(&self, before: DateTime<Utc>) -> Result<u64, StoreError> {
        let mut state = self.lock();
        let had = state.response_owners.len();
        state
            .response_owners
            .retain(|_, (_, recorded)| *recorded >= before);
        Ok((had - state.response_owners.len()) as u64)
    }
}

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
        let created_at = Utc::now();
        let limited = state
            .allowance(request.caller.key)
            .map(|allowance| Limited {
                allowance,
                held: Credits::ZERO,
                at: created_at,
            });
        let taken = decide_reserve(key_active, limited, payer, request.at, request.price)
            .map_err(|refusal| refusal.into_error(account))?;
        let Some(balance) = state.balances.get_mut(&account) else {
            unreachable!("decide_reserve found the account")
        };
        *balance = holds::take(*balance, taken);
        state.record_spending(request.caller.key, request.price.get(), created_at);
        let call = CallId(state.calls.len() as i64 + 1);
        state.calls.push(CallRecord {
            id: call,
            account,
            key: request.caller.key,
            protocol: request.protocol,
            model: request.model.to_owned(),
            requested_model: request.requested_model.map(str::to_owned),
            price: request.price,
            charged_subscription: taken.subscription,
            charged_topup: taken.topup,
            status: CallStatus::Pending,
            upstream_status: None,
            channel: None,
            upstream_protocol: None,
            dropped_tools: request.dropped_tools.map(str::to_owned),
            upstream_error: None,
            input_tokens: None,
            output_tokens: None,
            cache_read_tokens: None,
            cache_write_tokens: None,
            cache_write_1h_tokens: None,
            reasoning_tokens: None,
            shortfall: Credits::ZERO,
            usage_rejected: false,
            usage_estimated: false,
            service_tier: None,
            raw_usage: None,
            cost: None,
            credit_value: None,
            margin: None,
            created_at,
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
        let now = Utc::now();
        let Some(record) = pending_call(&mut state, call) else {
            return Ok(false);
        };
        let (account, key, reserved_at) = (record.account, record.key, record.created_at);
        let taken = Split {
            subscription: record.charged_subscription,
            topup: record.charged_topup,
        };
        let ends_at = state
            .accounts
            .get(&account)
            .and_then(|row| row.subscription_ends_at);
        let balance = state.balances.get(&account).copied().unwrap_or_default();
        // What the reservation took is gone from the balance already: the rest is free.
        let free = balance.free_of(Balance::default()).spendable(ends_at, now);
        let key_room = state
            .allowance(key)
            .map(|allowance| allowance.room(Credits::ZERO, reserved_at, now));
        let beyond = Beyond::of(success.beyond_reservation, key_room);
        let settled = decide_settle(taken, success.cost, free, beyond);
        if let Some(balance) = state.balances.get_mut(&account) {
            *balance = holds::take(holds::give_back(*balance, settled.returned), settled.extra);
        }
        let change = settled.charged.total().get() - taken.total().get();
        state.record_spending(key, change, reserved_at);
        let Some(record) = pending_call(&mut state, call) else {
            unreachable!("the entry was pending a moment ago, under the same lock")
        };
        record.price = settled.charged.total();
        record.charged_subscription = settled.charged.subscription;
        record.charged_topup = settled.charged.topup;
        record.shortfall = settled.shortfall;
        record.usage_rejected = success.usage_rejected;
        record.status = CallStatus::Ok;
        record.upstream_status = Some(success.upstream_status);
        record.channel = success.channel;
        record.upstream_protocol = success.upstream_protocol;
        let usage = success.usage;
        record.input_tokens = usage.input_tokens;
        record.output_tokens = usage.output_tokens;
        record.cache_read_tokens = usage.cache_read_tokens;
        record.cache_write_tokens = usage.cache_write_tokens;
        record.cache_write_1h_tokens = usage.cache_write_1h_tokens;
        record.reasoning_tokens = usage.reasoning_tokens;
        record.usage_estimated = usage.estimated;
        record.service_tier = usage.service_tier;
        record.raw_usage = success.raw_usage;
        record.cost = success.operator_cost.map(|cost| cost.cost);
        record.credit_value = success.operator_cost.map(|cost| cost.credit_value);
        record.margin = CallRecord::margin_of(record.price, record.cost, record.credit_value);
        record.finished_at = Some(now);
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

    async fn charged(&self, call: CallId) -> Result<Option<Credits>, StoreError> {
        let state = self.lock();
        Ok(state
            .call(call)
            .filter(|record| record.status == CallStatus::Ok)
            .map(|record| record.price))
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
        let (key, reserved_at) = (record.key, record.created_at);
        state.record_spending(key, -(subscription.get() + topup.get()), reserved_at);
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
