//! Reservations held in memory, for a `SQLite` file that one gateway owns
//! ([`SeaOrmStore::own_file`](super::SeaOrmStore::own_file)).
//!
//! A reservation written to the database costs a write when the call starts and another when it
//! ends. When one process owns the file, the reservation can instead live here: the credits are
//! held against the balance the committer read, and the call's outcome is written once, when it
//! ends: an `ok` entry with its debit, or a `refunded` entry with nothing moved. A crash loses
//! only holds, which moved no money, so recovery has nothing to do for them.
//!
//! The committer's thread is the only one that changes holds, inside its batches; a batch
//! decides against the account rows it read under the file's write lock, minus what is held on
//! them, so what other connections wrote (a grant, a revocation, a lapse from the CLI) is seen
//! by the next batch. The store's own transactions that must see the holds (a lapse leaves
//! held credits in place; a keyed reservation cannot spend them) hold their lock
//! ([`SharedHolds`]) while they run.

use std::collections::HashMap;

use chrono::{DateTime, Utc};

use super::batch::OwnedCharge;
use crate::credits::{Balance, Credits, Split};

/// A call whose credits are held in memory.
#[derive(Debug, Clone)]
pub(super) struct HeldCall {
    pub(super) account: i64,
    pub(super) charge: OwnedCharge,
    pub(super) taken: Split,
    /// When it was reserved: its entry's `created_at`.
    pub(super) reserved_at: DateTime<Utc>,
}

/// Every held call, what they hold on each account, and the ids set aside for new ones.
#[derive(Debug, Default)]
pub(super) struct Holds {
    calls: HashMap<i64, HeldCall>,
    accounts: HashMap<i64, Balance>,
    ids: IdBlock,
}

/// Call ids set aside for held calls: `next..end`. The file's id sequence has been moved past
/// `end`, so entries inserted by anyone else never take one of them.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub(super) struct IdBlock {
    pub(super) next: i64,
    pub(super) end: i64,
}

impl IdBlock {
    pub(super) fn left(self) -> i64 {
        self.end - self.next
    }
}

/// What one committed batch did to the holds.
#[derive(Debug, Default)]
pub(super) struct HoldChanges {
    pub(super) added: Vec<(i64, HeldCall)>,
    pub(super) ended: Vec<i64>,
    pub(super) ids: Option<IdBlock>,
}

impl Holds {
    pub(super) fn call(&self, call: i64) -> Option<&HeldCall> {
        self.calls.get(&call)
    }

    /// What is held on `account`.
    pub(super) fn on(&self, account: i64) -> Balance {
        self.accounts.get(&account).copied().unwrap_or_default()
    }

    /// `row`, an account's credits as stored, less what is held on it: what it has to spend.
    pub(super) fn net(&self, account: i64, row: Balance) -> Balance {
        let held = self.on(account);
        Balance {
            subscription: Credits(row.subscription.0 - held.subscription.0),
            topup: Credits(row.topup.0 - held.topup.0),
        }
    }

    pub(super) fn ids(&self) -> IdBlock {
        self.ids
    }

    pub(super) fn len(&self) -> usize {
        self.calls.len()
    }

    /// Applies a committed batch's changes.
    pub(super) fn apply(&mut self, changes: HoldChanges) {
        for (id, held) in changes.added {
            let on = self.accounts.entry(held.account).or_default();
            *on = plus(*on, held.taken);
            self.calls.insert(id, held);
        }
        for id in changes.ended {
            let Some(held) = self.calls.remove(&id) else {
                continue;
            };
            if let Some(on) = self.accounts.get_mut(&held.account) {
                *on = minus(*on, held.taken);
                if *on == Balance::default() {
                    self.accounts.remove(&held.account);
                }
            }
        }
        if let Some(ids) = changes.ids {
            self.ids = ids;
        }
    }
}

/// `balance` with `split` added to it.
pub(super) fn plus(balance: Balance, split: Split) -> Balance {
    Balance {
        subscription: Credits(balance.subscription.0 + split.subscription.0),
        topup: Credits(balance.topup.0 + split.topup.0),
    }
}

/// `balance` with `split` taken from it.
pub(super) fn minus(balance: Balance, split: Split) -> Balance {
    Balance {
        subscription: Credits(balance.subscription.0 - split.subscription.0),
        topup: Credits(balance.topup.0 - split.topup.0),
    }
}

/// The holds, shared by the committer's thread and the store's pool transactions that must
/// see them (a lapse, a keyed reservation, a balance). Whoever holds the lock knows that no
/// batch changes an account's row or its holds meanwhile: the committer holds it for a whole
/// batch, from before its write lock to after its holds are applied. Everyone takes it before
/// the database's write lock, never after, so the two cannot deadlock.
pub(super) type SharedHolds = tokio::sync::Mutex<Holds>;
