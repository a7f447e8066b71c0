//! The in-memory store's state: one mutex-guarded map (see `super`). A leaf that the store's
//! trait implementations share.

use crate::store::rules::lapse::decide_lapse;
use std::collections::BTreeMap;

use foldhash::HashMap;
use std::sync::Mutex;

use chrono::{DateTime, Utc};

use crate::call::{AccountId, CallId, KeyId};
use crate::credits::{Balance, Bucket, Credits};
use crate::keys::KeyHash;
use crate::store::records::{AccountSummary, KeyInfo, Lapse, Sums};
use crate::store::rules::allowance::Allowance;
use crate::store::rules::idempotency::{DEFAULT_IDEMPOTENCY_WINDOW, KeyedCall};
use crate::store::types::{CallRecord, CallStatus, KeptReply};

/// A store that keeps everything in one mutex-guarded map; each operation is atomic because it
/// runs entirely under the lock.
#[derive(Debug, Default)]
pub struct MemoryStore {
    pub(super) state: Mutex<State>,
}

#[derive(Debug, Default)]
pub(super) struct State {
    pub(super) balances: HashMap<AccountId, Balance>,
    pub(super) accounts: BTreeMap<AccountId, AccountRow>,
    pub(super) keys: HashMap<KeyHash, KeyId>,
    pub(super) key_rows: BTreeMap<KeyId, KeyInfo>,
    pub(super) calls: super::call_log::CallLog,
    pub(super) next_key: i64,
    /// Idempotency records by account and key. The client picks the keys, so they are hashed
    /// with std's `SipHash`, whose collisions no client can pick.
    pub(super) keyed: std::collections::HashMap<(AccountId, String), KeyedRow>,
    /// Which record names each keyed call.
    pub(super) keyed_by_call: HashMap<CallId, (AccountId, String)>,
    /// How long a key holds; `None`: [`DEFAULT_IDEMPOTENCY_WINDOW`].
    pub(super) idempotency_window: Option<std::time::Duration>,
    /// Who made each stored response, by its id.
    pub(super) response_owners: HashMap<String, (crate::store::ResponseOwner, DateTime<Utc>)>,
    /// Redemption code batches by id, and each code's batch and state.
    pub(super) code_batches: BTreeMap<i64, crate::store::records::CodeBatch>,
    /// What each limited key spent, in which window of its limit.
    pub(super) spending: HashMap<KeyId, (i64, i64)>,
    pub(super) codes: HashMap<crate::codes::CodeHash, CodeRow>,
}

#[derive(Debug)]
pub(super) struct CodeRow {
    pub(super) batch: i64,
    /// Redeemed or revoked: either way it grants nothing any more.
    pub(super) spent: bool,
}

#[derive(Debug)]
pub(super) struct KeyedRow {
    pub(super) fingerprint: String,
    pub(super) call: CallId,
    pub(super) created_at: DateTime<Utc>,
    pub(super) reply: Option<KeptReply>,
}

#[derive(Debug)]
pub(super) struct AccountRow {
    pub(super) name: String,
    pub(super) created_at: DateTime<Utc>,
    pub(super) granted: Sums,
    pub(super) lapsed: i128,
    pub(super) subscription_ends_at: Option<DateTime<Utc>>,
    /// Its own low-balance threshold (kept, though this store tells no events).
    pub(super) low_balance_credits: Option<Credits>,
    /// Idempotency keys of the grants applied, with what each granted.
    pub(super) grants_by_key: HashMap<String, (Bucket, Credits)>,
}

impl State {
    pub(super) fn summary(&self, id: AccountId) -> Option<AccountSummary> {
        let row = self.accounts.get(&id)?;
        Some(AccountSummary {
            id,
            name: row.name.clone(),
            balance: self.balances.get(&id).copied().unwrap_or_default(),
            subscription_ends_at: row.subscription_ends_at,
            created_at: row.created_at,
            low_balance_credits: row.low_balance_credits,
        })
    }

    /// Takes out what is left of the account's subscription credits, if anything, recording
    /// it as lapsed at `period_end`.
    pub(super) fn lapse(&mut self, account: AccountId, period_end: DateTime<Utc>) -> Option<Lapse> {
        let balance = self.balances.get_mut(&account)?;
        // Nothing is held apart here: a reservation took its credits at once.
        let amount = decide_lapse(balance.subscription, Credits::ZERO, &[]).lapsed;
        if amount <= Credits::ZERO {
            return None;
        }
        balance.subscription = balance.subscription.minus(amount);
        self.accounts.get_mut(&account)?.lapsed += i128::from(amount.get());
        Some(Lapse {
            account,
            amount,
            period_end,
        })
    }

    /// Whether the key was revoked (a key this store never saw is not: tests and examples
    /// charge made-up callers).
    pub(super) fn call(&self, call: CallId) -> Option<&CallRecord> {
        let index = usize::try_from(call.0).ok()?.checked_sub(1)?;
        self.calls.get(index)
    }

    pub(super) fn idempotency_window(&self) -> std::time::Duration {
        self.idempotency_window
            .unwrap_or(DEFAULT_IDEMPOTENCY_WINDOW)
    }

    /// What a keyed call found under its key.
    pub(super) fn keyed_call(&self, account: AccountId, key: &str) -> Option<KeyedCall> {
        let row = self.keyed.get(&(account, key.to_owned()))?;
        Some(KeyedCall {
            fingerprint: row.fingerprint.clone(),
            status: self.call(row.call)?.status,
            created_at: row.created_at,
            reply: row.reply.clone(),
        })
    }

    pub(super) fn key_revoked(&self, key: KeyId) -> bool {
        self.key_rows
            .get(&key)
            .is_some_and(|info| info.revoked_at.is_some())
    }

    /// A limited key's allowance; `None` for a key without a limit.
    pub(super) fn allowance(&self, key: KeyId) -> Option<Allowance> {
        let limit = self.key_rows.get(&key)?.rules.limit?;
        let (spent, window) = self.spending.get(&key).copied().unwrap_or_default();
        Some(Allowance {
            limit,
            spent,
            window,
        })
    }

    /// The key as listed, with what it spent in its limit's current period.
    pub(super) fn key_now(&self, key: KeyId) -> Option<KeyInfo> {
        let mut info = self.key_rows.get(&key)?.clone();
        info.spent = self.allowance(key).map_or(Credits::ZERO, |allowance| {
            Credits::new(allowance.spent_at(Utc::now()))
        });
        Some(info)
    }

    /// Counts `amount` (less than zero: gives it back) against a limited key's allowance for a
    /// call reserved at `reserved_at` (see [`Allowance::record`]); nothing for a key without.
    pub(super) fn record_spending(&mut self, key: KeyId, amount: i64, reserved_at: DateTime<Utc>) {
        if let Some(mut allowance) = self.allowance(key) {
            allowance.record(amount, reserved_at);
            self.spending
                .insert(key, (allowance.spent, allowance.window));
        }
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

    pub(super) fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        // A panic while holding the lock cannot leave a half-applied change: every change is
        // computed first and written in one assignment.
        self.state
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }
}

pub(super) fn pending_call(state: &mut State, call: CallId) -> Option<&mut CallRecord> {
    let index = usize::try_from(call.0).ok()?.checked_sub(1)?;
    state
        .calls
        .get_mut(index)
        .filter(|record| record.status == CallStatus::Pending)
}
