//! The owned-file mode ([`SeaOrmStore::own_file`](super::SeaOrmStore::own_file)): one gateway
//! owns a `SQLite` file and holds reservations in memory.
//!
//! A reservation written to the database costs a write when the call starts and another when it
//! ends. When one process owns the file, the reservation can instead live in memory: the credits
//! are held against the balance the committer read, and the call's outcome is written once, when
//! it ends: an `ok` entry with its debit, or a `refunded` entry with nothing moved. A crash loses
//! only holds, which moved no money, so recovery has nothing to do for them.
//!
//! A reservation is held at once, on its caller's task, against the rows the committer last
//! read, while those are still what the file holds (`decide`); otherwise the committer decides
//! it in its next batch against the rows it reads under the file's write lock, so what other
//! connections wrote (a grant, a revocation, a lapse from the CLI) is seen by the next
//! reservation. One that arrives while a batch takes or gives up that lock, when nobody can
//! tell, waits in order until the committer can ([`State::waiting`](state::State::waiting)). Only the committer's
//! batches end holds. The store's own transactions that must see the holds still (a lapse
//! leaves held credits in place; a keyed reservation cannot spend them) freeze them
//! ([`SharedHolds::freeze`](state::SharedHolds::freeze)) while they run.

pub(super) mod decide;
pub(super) mod keyed;
mod records;
pub(super) mod state;

use std::path::Path;
use std::sync::Arc;

use super::commit::group_commit::Committer;
use super::commit::group_commit::Writers;
use super::commit::jobs::Asked;
use super::idempotent;
use super::writes::{OwnedCharge, Write};
use crate::credits::Balance;
use crate::store::{
    AccountId, CallFailure, CallId, CallSuccess, Reservation, ReserveError, StoreError,
};
pub(super) use state::{Frozen, SharedHolds};

/// What a store that owns its `SQLite` file keeps.
#[derive(Debug, Clone)]
pub(in crate::store::sea) struct Owned {
    pub(super) holds: Arc<SharedHolds>,
    /// Locked for as long as any clone of the store lives; the kernel lets it go if the
    /// process dies.
    _lock: Arc<std::fs::File>,
}

impl Owned {
    /// Takes `file`'s owner lock (`<file>-owner.lock`).
    ///
    /// # Errors
    ///
    /// The lock file cannot be made, or another store owns the file.
    pub(super) fn lock(file: &Path) -> Result<Owned, StoreError> {
        let lock_path = format!("{}-owner.lock", file.display());
        let lock = std::fs::OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(&lock_path)
            .map_err(|error| StoreError::msg(format!("opening {lock_path}: {error}")))?;
        if let Err(error) = lock.try_lock() {
            return Err(StoreError::msg(format!(
                "another gateway owns {} (its lock {lock_path} is held: {error}); \
                 stop it first, or serve the file shared",
                file.display()
            )));
        }
        Ok(Owned {
            holds: Arc::default(),
            _lock: Arc::new(lock),
        })
    }

    /// How many calls are held now.
    pub(super) fn held_calls(&self) -> usize {
        self.holds.lock().holds.len()
    }

    /// The held calls reserved before `cutoff`.
    pub(super) fn held_before(
        &self,
        cutoff: chrono::DateTime<chrono::Utc>,
    ) -> crate::store::Overdue {
        self.holds.lock().holds.older_than(cutoff)
    }

    /// What `account` has to spend when its row holds `row`, less what is held on it.
    pub(super) fn net(&self, account: AccountId, row: Balance) -> Balance {
        self.holds.lock().holds.net(account, row)
    }

    /// A reservation without an idempotency key: decided at once where the rows the committer
    /// last read still hold ([`decide::reserve_now`]) and no reservation or refund waits for
    /// the committer (which would decide it first); otherwise queued ([`State::queue`](state::State::queue)): by the
    /// committer in its next batch, or, if it arrived while a batch took or gave up the write
    /// lock, at once as soon as the committer can tell the file's version again.
    pub(super) async fn reserve(
        &self,
        committer: &Committer,
        charge: OwnedCharge,
    ) -> Result<Reservation, ReserveError> {
        if let Some(reserved) = decide::reserve_now(&mut self.holds.lock(), &charge) {
            return reserved;
        }
        let slot = committer.slot().await?;
        // Queued under the lock, so that reservations and refunds are decided in the order
        // they took it.
        let answer = {
            let mut state = self.holds.lock();
            if let Some(reserved) = decide::reserve_now(&mut state, &charge) {
                return reserved;
            }
            slot.queue(&mut *state, Asked::reserve(charge))
        };
        answer.wait().await
    }

    /// Settles `call`: queued under the holds' lock, in order with reservations and refunds
    /// (see [`reserve`](Self::reserve)). A keyed call reserved in the database (its key had a
    /// record: see `keyed`) is settled there, with the reply its record keeps; a held one, keyed
    /// or not, by the committer, whose batch writes a keyed one's record.
    pub(super) async fn settle(
        &self,
        to: Writers<'_>,
        call: CallId,
        success: CallSuccess,
    ) -> Result<bool, StoreError> {
        let slot = to.committer.slot().await?;
        let answer = {
            let mut state = self.holds.lock();
            if success.reply.is_some() && state.holds.call(call).is_none() {
                let write = Write::Settle(call, Box::new(success));
                let holds = state.holds.for_batch(&[&write]);
                let Write::Settle(_, success) = write else {
                    unreachable!("built as a settle")
                };
                Err((success, holds))
            } else {
                Ok(slot.queue(&mut *state, Asked::settle(call, success)))
            }
        };
        match answer {
            Ok(answer) => answer.wait().await,
            Err((success, holds)) => {
                idempotent::settle(to.db, call, *success, Some(&holds), to.alerting).await
            }
        }
    }

    /// Refunds `call`, queued under the holds' lock (see [`reserve`](Self::reserve)).
    pub(super) async fn refund(
        &self,
        committer: &Committer,
        call: CallId,
        failure: &CallFailure,
    ) -> Result<bool, StoreError> {
        let slot = committer.slot().await?;
        let answer = {
            let mut state = self.holds.lock();
            let refund = Asked::refund(call, failure.clone());
            slot.queue(&mut *state, refund)
        };
        answer.wait().await
    }
}
