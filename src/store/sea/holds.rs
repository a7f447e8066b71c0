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

use super::batch::{AccountRead, OwnedCharge};
use crate::credits::{Balance, Split};

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
        row.free_of(self.on(account))
    }

    pub(super) fn ids(&self) -> IdBlock {
        self.ids
    }

    /// Holds `taken` on `account` for a new call, under the next id set aside, if one is left.
    pub(super) fn hold(&mut self, account: i64, charge: &OwnedCharge, taken: Split) -> Option<i64> {
        if self.ids.left() < 1 {
            return None;
        }
        let id = self.ids.next;
        let held = HeldCall {
            account,
            charge: charge.clone(),
            taken,
            reserved_at: Utc::now(),
        };
        let ids = IdBlock {
            next: id + 1,
            end: self.ids.end,
        };
        self.apply(HoldChanges {
            added: vec![(id, held)],
            ended: Vec::new(),
            ids: Some(ids),
        });
        Some(id)
    }

    pub(super) fn len(&self) -> usize {
        self.calls.len()
    }

    /// Applies a committed batch's changes.
    pub(super) fn apply(&mut self, changes: HoldChanges) {
        for (id, held) in changes.added {
            let on = self.accounts.entry(held.account).or_default();
            *on = on.plus(held.taken);
            self.calls.insert(id, held);
        }
        for id in changes.ended {
            let Some(held) = self.calls.remove(&id) else {
                continue;
            };
            if let Some(on) = self.accounts.get_mut(&held.account) {
                *on = on.minus(held.taken);
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

/// The holds, shared by the committer's thread and the store's pool transactions that must
/// see them (a lapse, a keyed reservation, a balance). Whoever holds the lock knows that no
/// batch changes an account's row or its holds meanwhile: the committer holds it for a whole
/// batch, from before its write lock to after its holds are applied. Everyone takes it before
/// the database's write lock, never after, so the two cannot deadlock.
pub(super) type SharedHolds = tokio::sync::Mutex<State>;

/// What the holds' lock guards: the holds, the account rows and keys the committer last read
/// (so that most reservations are decided here, without a batch), and the committer's
/// connection, which is free whenever the lock is.
#[derive(Debug, Default)]
pub(super) struct State {
    pub(super) holds: Holds,
    pub(super) rows: RowCache,
    /// Reservations and refunds queued for the committer that no batch has taken yet. While
    /// there are any, reservations queue behind them instead of being decided at once: an
    /// account's reservations and refunds are decided in the order they arrive.
    pub(super) queued: usize,
    #[cfg(feature = "sqlite")]
    pub(super) connection: Option<rusqlite::Connection>,
}

/// Account rows and key states as the committer last read or wrote them, valid while the
/// committer's connection reports the same `PRAGMA data_version` (which changes when any other
/// connection commits: a grant, a revocation, a lapse, a keyed call, another process).
#[derive(Debug, Default)]
pub(super) struct RowCache {
    version: Option<i64>,
    pub(super) accounts: HashMap<i64, AccountRead>,
    /// Whether each key is active.
    pub(super) keys: HashMap<i64, bool>,
}

impl RowCache {
    /// Keeps the rows if `version` is the one they were read at; otherwise empties the cache
    /// for that version. `true` if they were kept.
    pub(super) fn check(&mut self, version: i64) -> bool {
        if self.version == Some(version) {
            return true;
        }
        self.accounts.clear();
        self.keys.clear();
        self.version = Some(version);
        false
    }

    /// Forgets every row (after a batch whose outcome is unknown).
    pub(super) fn clear(&mut self) {
        self.version = None;
        self.accounts.clear();
        self.keys.clear();
    }

    /// Applies a committed batch's changes to the rows it read.
    pub(super) fn apply(&mut self, changes: &[(i64, Balance)]) {
        for (id, change) in changes {
            if let Some(row) = self.accounts.get_mut(id) {
                row.balance.subscription.0 += change.subscription.0;
                row.balance.topup.0 += change.topup.0;
            }
        }
    }
}
