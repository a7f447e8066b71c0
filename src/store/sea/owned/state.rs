//! The owned file's shared holds: what the committer's thread, the callers' tasks and the
//! store's pool transactions share (see `super`).

use std::collections::VecDeque;

use super::super::held::Holds;
use super::super::writes::{OwnedCharge, Write};
use crate::store::IdempotencyKey;
use crate::store::sea::commit::group_commit::Queue;
use crate::store::sea::commit::jobs::Kept;
use crate::store::sea::commit::row_cache::RowCache;

/// The holds, shared by the committer's thread, the callers' tasks and the store's pool
/// transactions that must see them still (a lapse, a keyed reservation, a grant).
///
/// Two locks, so that no caller waits behind a batch's statements:
/// - `state`, a synchronous mutex held only while holds, rows and counters are read or
///   changed in memory (a reservation decided at once holds it for a few microseconds; the
///   committer twice per batch, never through a statement). A fair async mutex here made a
///   convoy: each waiter, once handed the lock, held it until a busy worker got round to
///   running it, and everyone queued behind that delay too (see BENCHMARKS.md).
/// - `gate`, an async mutex that the committer takes for each batch and that [`Frozen`] takes
///   for a pool transaction which must see the holds unchanged throughout. Everyone takes it
///   before the database's write lock, never after, so the two cannot deadlock.
#[derive(Debug, Default)]
pub(in crate::store::sea) struct SharedHolds {
    state: std::sync::Mutex<State>,
    gate: tokio::sync::Mutex<()>,
}

impl SharedHolds {
    /// The state, locked. Hold the guard only for work in memory, and never across an await.
    pub(in crate::store::sea) fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        // A panic while it was held left nothing half-changed that the ledger relies on: holds
        // and rows change only after a batch has committed, each in one step.
        self.state
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// For the committer: held through a batch, so that no [`Frozen`] reader runs meanwhile.
    #[cfg_attr(not(feature = "sqlite"), allow(dead_code))] // taken by `sqlite_direct` only
    pub(in crate::store::sea) fn gate_blocking(&self) -> tokio::sync::MutexGuard<'_, ()> {
        self.gate.blocking_lock()
    }

    /// The holds as they stand, kept from changing until the guard is dropped: the committer
    /// writes no batch and no reservation is held at once meanwhile (they wait for the
    /// committer, in order). Take it before a write transaction, never inside one.
    pub(in crate::store::sea) async fn freeze(&self) -> Frozen<'_> {
        let gate = self.gate.lock().await;
        let holds = {
            let mut state = self.lock();
            state.frozen += 1;
            state.holds.clone()
        };
        Frozen {
            shared: self,
            holds,
            _gate: gate,
        }
    }
}

/// The holds as they stood when [`SharedHolds::freeze`] returned, and still stand while this
/// lives.
pub(in crate::store::sea) struct Frozen<'a> {
    shared: &'a SharedHolds,
    holds: Holds,
    _gate: tokio::sync::MutexGuard<'a, ()>,
}

impl std::ops::Deref for Frozen<'_> {
    type Target = Holds;

    fn deref(&self) -> &Holds {
        &self.holds
    }
}

impl Drop for Frozen<'_> {
    fn drop(&mut self) {
        let mut state = self.shared.lock();
        state.frozen = state.frozen.saturating_sub(1);
    }
}

/// What the holds' state lock guards: the holds, the account rows and keys the committer last
/// read (so that most reservations are decided here, without a batch), and the committer's
/// connection, which is here whenever no batch is being written.
#[derive(Debug, Default)]
pub(in crate::store::sea) struct State {
    pub(in crate::store::sea) holds: Holds,
    pub(in crate::store::sea) rows: RowCache,
    /// Reservations and refunds queued for the committer whose batch has not yet ended. While
    /// there are any, reservations queue behind them instead of being decided at once: an
    /// account's reservations and refunds are decided in the order they arrive, and a batch
    /// that decides reservations or refunds sees holds that do not change under it.
    pub(in crate::store::sea) queued: usize,
    /// How many [`Frozen`] guards are alive; while any is, reservations queue.
    pub(in crate::store::sea) frozen: usize,
    /// Reservations that arrived while a batch was taking or giving up the file's write lock,
    /// when nobody can tell whether another connection has committed, and the reservations
    /// that arrived after them: they wait here, in order, for the committer to know the file's
    /// version again (under the lock, or once it has given the lock up), which then decides
    /// each at once as if it had just arrived, or sends it on to a batch. Sending them to a
    /// batch straight away kept their place too, but held back every reservation after them
    /// until that batch ended (see BENCHMARKS.md). A refund arriving meanwhile sends them on
    /// first ([`State::queue`]).
    pub(in crate::store::sea) waiting: VecDeque<Kept>,
    /// While a batch holds the file's write lock: the file's version (`PRAGMA data_version`)
    /// that the committer read under it. Nobody else can commit until the batch does, so the
    /// rows read at that version stay true without asking the connection, which the batch is
    /// using. `None` while no batch holds the lock, or once it is about to commit.
    pub(in crate::store::sea) writing: Option<i64>,
    #[cfg(feature = "sqlite")]
    pub(in crate::store::sea) connection: Option<rusqlite::Connection>,
    /// Which idempotency keys have a record in the file, once read (see `super::keyed`):
    /// `None` until the first keyed call that needs the file reads them.
    pub(in crate::store::sea) records: Option<super::records::RecordIndex>,
    /// Keyed reservations sent to the committer whose batch has not yet ended, or being
    /// decided in the file (see `super::keyed`): their keys are taken, as by a running call,
    /// until the call is held or refused.
    pub(in crate::store::sea) keyed_queued: Vec<(crate::store::AccountId, IdempotencyKey)>,
}

impl State {
    /// Queues a write for the committer. A reservation waits in [`State::waiting`] behind
    /// those already there, or if it would be decided at once but for a batch taking or
    /// giving up the write lock. Any other write is sent; one that can change what a
    /// reservation is decided against (a refund) first sends every waiting reservation
    /// ahead of it, so that each is decided before it, as they arrived. A settle does not
    /// change what a reservation can take (its credits stay spent), and the calls it ends are
    /// never among the waiting ones, so it goes straight past them.
    pub(in crate::store::sea) fn queue(&mut self, kept: Kept) {
        match kept.job.write {
            Write::Reserve(_)
                if !self.waiting.is_empty()
                    || (self.queued == 0 && self.frozen == 0 && self.version_unknown()) =>
            {
                self.waiting.push_back(kept);
            }
            ref write => {
                if write.holds_back_reservations() {
                    while let Some(waiting) = self.waiting.pop_front() {
                        self.send(waiting);
                    }
                }
                self.send(kept);
            }
        }
    }

    /// Sends a write to the committer, counted in [`State::queued`] if it holds back
    /// reservations.
    pub(in crate::store::sea) fn send(&mut self, kept: Kept) {
        if kept.job.write.holds_back_reservations() {
            self.queued += 1;
        }
        kept.send();
    }

    /// Whether `key` of `account` is taken by a keyed reservation sent to the committer.
    pub(in crate::store::sea) fn keyed_queued(
        &self,
        account: crate::store::AccountId,
        key: &str,
    ) -> Option<&IdempotencyKey> {
        (self.keyed_queued.iter())
            .find(|(queued, keyed)| *queued == account && keyed.key() == key)
            .map(|(_, keyed)| keyed)
    }

    /// Frees the keys of the keyed reservations among `writes`, whose batch has ended.
    pub(in crate::store::sea) fn keyed_decided(&mut self, writes: &[&Write]) {
        if self.keyed_queued.is_empty() {
            return;
        }
        for write in writes {
            if let Write::Reserve(charge) = write {
                self.keyed_unqueued(charge);
            }
        }
    }

    /// Frees the key of `charge`, a keyed reservation queued and now decided (held, refused,
    /// or let go with its caller), if it has one.
    pub(in crate::store::sea) fn keyed_unqueued(&mut self, charge: &OwnedCharge) {
        if let Some(keyed) = &charge.keyed {
            self.keyed_untake(charge.caller.account, keyed.key());
        }
    }

    /// Frees `key` of `account`, marked taken in [`State::keyed_queued`].
    pub(in crate::store::sea) fn keyed_untake(
        &mut self,
        account: crate::store::AccountId,
        key: &str,
    ) {
        if let Some(at) = (self.keyed_queued.iter())
            .position(|(queued, keyed)| *queued == account && keyed.key() == key)
        {
            self.keyed_queued.swap_remove(at);
        }
    }

    /// Whether a batch has the committer's connection and does not hold the file's write lock
    /// with a version read under it: it is taking the lock, or has given it up.
    fn version_unknown(&self) -> bool {
        #[cfg(feature = "sqlite")]
        return self.connection.is_none() && self.writing.is_none();
        #[cfg(not(feature = "sqlite"))]
        false
    }
}

impl Queue for State {
    fn queue(&mut self, kept: Kept) {
        State::queue(self, kept);
    }
}
