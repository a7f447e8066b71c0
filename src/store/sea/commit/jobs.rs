//! The committer's vocabulary, shared by the writers ([`super::group_commit`],
//! [`super::sqlite_direct`]), the flusher ([`super::flush`]) and [`super::batches`]: a queued
//! write and its reply, the counters, why a batch failed, and how a write transaction begins.
//! It imports none of them.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use sea_orm::{
    DatabaseConnection, DatabaseTransaction, DbErr, SqliteTransactionMode, TransactionOptions,
    TransactionTrait,
};
#[cfg(feature = "sqlite")]
use tokio::sync::mpsc;
use tokio::sync::oneshot;

#[cfg(feature = "sqlite")]
use crate::store::sea::alerting::Alerting;
use crate::store::sea::writes::{Outcome, OwnedCharge, Write};
use crate::store::{CallFailure, CallId, CallSuccess, Reservation, ReserveError, StoreError};

/// A write and where its answer goes.
#[derive(Debug)]
pub(in crate::store::sea) struct Job {
    pub(in crate::store::sea) write: Write,
    pub(in crate::store::sea) reply: Reply,
}

/// A write with room kept for it in the committer's queue, so that it can be sent there later
/// without waiting (see `owned::State::waiting`).
#[cfg(feature = "sqlite")]
#[derive(Debug)]
pub(in crate::store::sea) struct Kept {
    pub(in crate::store::sea) job: Job,
    pub(in crate::store::sea) room: mpsc::OwnedPermit<Job>,
}

#[cfg(feature = "sqlite")]
impl Kept {
    pub(in crate::store::sea) fn send(self) {
        self.room.send(self.job);
    }
}

/// A write paired with the answer its caller waits for, by type: a reservation answers with
/// the reservation, a settle or a refund with whether it ended the call. The committer's
/// callers queue these, so that no write reaches it with another write's kind of reply.
pub(in crate::store::sea) struct Asked<T, E> {
    write: Write,
    reply: fn(oneshot::Sender<Result<T, E>>) -> Reply,
}

impl Asked<Reservation, ReserveError> {
    pub(in crate::store::sea) fn reserve(charge: OwnedCharge) -> Self {
        Asked {
            write: Write::Reserve(charge),
            reply: Reply::Reserve,
        }
    }
}

impl Asked<bool, StoreError> {
    pub(in crate::store::sea) fn settle(call: CallId, success: CallSuccess) -> Self {
        Asked {
            write: Write::Settle(call, Box::new(success)),
            reply: Reply::Finish,
        }
    }

    pub(in crate::store::sea) fn refund(call: CallId, failure: CallFailure) -> Self {
        Asked {
            write: Write::Refund(call, failure),
            reply: Reply::Finish,
        }
    }
}

impl<T, E> Asked<T, E> {
    /// The job to queue, and where its answer will come.
    pub(in crate::store::sea) fn job(self) -> (Job, oneshot::Receiver<Result<T, E>>) {
        let (answer, answered) = oneshot::channel();
        let job = Job {
            write: self.write,
            reply: (self.reply)(answer),
        };
        (job, answered)
    }
}

/// Where a write's answer goes: a reservation, or a settle or refund.
#[derive(Debug)]
pub(in crate::store::sea) enum Reply {
    Reserve(oneshot::Sender<Result<Reservation, ReserveError>>),
    Finish(oneshot::Sender<Result<bool, StoreError>>),
}

/// What a committer has done so far, counted as it goes.
#[derive(Debug, Default)]
pub(in crate::store::sea) struct Counters {
    pub(in crate::store::sea) transactions: AtomicU64,
    pub(in crate::store::sea) writes: AtomicU64,
    pub(in crate::store::sea) rolled_back: AtomicU64,
    pub(in crate::store::sea) flushes: AtomicU64,
    /// A failed flush stopped the committer for good (`SQLite`; see [`super::flush`]).
    pub(in crate::store::sea) halted: AtomicBool,
}

impl Counters {
    pub(in crate::store::sea) fn snapshot(&self) -> GroupCommitStats {
        GroupCommitStats {
            transactions: self.transactions.load(Ordering::Relaxed),
            writes: self.writes.load(Ordering::Relaxed),
            rolled_back: self.rolled_back.load(Ordering::Relaxed),
            flushes: self.flushes.load(Ordering::Relaxed),
        }
    }
}

/// How the committer has grouped the ledger's writes so far.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GroupCommitStats {
    /// Transactions committed (or attempted) for ledger writes.
    pub transactions: u64,
    /// Ledger writes (reserve, settle, refund) applied.
    pub writes: u64,
    /// Transactions rolled back because a statement failed (a batch's writes are then run again
    /// one by one). Valid writes never cause one; a count that grows points at a database
    /// problem.
    pub rolled_back: u64,
    /// Flushes that made committed batches durable. On a `SQLite` file and on `PostgreSQL` a batch
    /// commits without waiting for the disk (so no lock is held through an fsync), and a flusher
    /// beside the committer then makes it durable (an fsync of the WAL file; a synchronous
    /// commit that flushes `PostgreSQL`'s WAL) before the writes that need it are answered:
    /// settles and refunds always, reservations on `PostgreSQL`. Several batches may share one
    /// flush. Always 0 on `MySQL` and in-memory `SQLite`, whose commits are durable when they
    /// return.
    pub flushes: u64,
}

/// The answer when the committer is gone.
pub(in crate::store::sea) fn stopped() -> StoreError {
    StoreError::msg("the ledger's committer task has stopped (its runtime shut down)")
}

/// Why a batch's transaction did not commit.
pub(in crate::store::sea) enum Failure {
    /// A statement failed; the transaction was rolled back and wrote nothing.
    Statement(StoreError),
    /// The commit failed: whether it wrote is unknown.
    Commit(StoreError),
    /// Nothing was tried: a failed flush stopped the committer (see [`super::flush`]).
    #[cfg_attr(not(feature = "sqlite"), allow(dead_code))]
    Halted,
}

/// What the call log says of a reservation the store refunds because its caller never learned
/// of it: the caller had stopped waiting when it landed (see [`Job::answer`]), or was answered
/// a store error (a failed flush: see `Flusher::conclude`).
pub(in crate::store::sea) const CALLER_GONE: &str = "refunded by the store: its caller never learned of it \
     (the caller stopped waiting, or was answered a store error)";

impl Job {
    /// A refund of `call`, reserved in the database for a caller that never learned of it;
    /// nobody waits for its answer.
    pub(in crate::store::sea) fn refund_unclaimed(call: CallId) -> Job {
        let (answer, _) = oneshot::channel();
        let failure = CallFailure {
            upstream_status: None,
            error: CALLER_GONE.to_owned(),
        };
        Job {
            write: Write::Refund(call, failure),
            reply: Reply::Finish(answer),
        }
    }

    pub(in crate::store::sea) fn is_reservation(&self) -> bool {
        matches!(self.write, Write::Reserve(_))
    }

    pub(in crate::store::sea) fn fail(self, error: StoreError) {
        match self.reply {
            Reply::Reserve(to) => {
                let _ = to.send(Err(ReserveError::Store(error)));
            }
            Reply::Finish(to) => {
                let _ = to.send(Err(error));
            }
        }
    }

    /// Answers the write's caller. A caller that stopped waiting (its future was dropped) is
    /// not an error here: the write stands. A call reserved for a caller that is gone has no
    /// guard to end it, so it is returned: a held one is let go by the committer
    /// (`group_commit::run_direct`); one written to the database is refunded by the committer in
    /// its next batch ([`Job::refund_unclaimed`]). ([`CreditCharge`](crate::CreditCharge)
    /// never leaves one behind: it finishes a reservation whose request was dropped and
    /// refunds it itself; see [`Ledger::reserve`].)
    ///
    /// [`Ledger::reserve`]: crate::Ledger::reserve
    pub(in crate::store::sea) fn answer(self, outcome: Outcome) -> Option<CallId> {
        match (self.reply, outcome) {
            (Reply::Reserve(to), Outcome::Reserved(reserved)) => {
                if let Err(Ok(unclaimed)) = to.send(reserved) {
                    return Some(unclaimed.call);
                }
            }
            (Reply::Finish(to), Outcome::Finished(finished)) => {
                let _ = to.send(Ok(finished));
            }
            (Reply::Reserve(to), Outcome::Finished(_)) => {
                let _ = to.send(Err(ReserveError::Store(wrong_kind())));
            }
            (Reply::Finish(to), Outcome::Reserved(_)) => {
                let _ = to.send(Err(wrong_kind()));
            }
        }
        None
    }
}

/// A write answered with another kind's outcome: never, as a batch answers each write from its
/// own decision, in order (`Batch::outcomes`); a debug build stops at once.
fn wrong_kind() -> StoreError {
    if cfg!(debug_assertions) {
        panic!("a write answered with an outcome of another kind");
    }
    StoreError::msg("internal: an outcome of the wrong kind")
}

/// How long a `SQLite` connection waits for another writer before giving up. Writers hold the lock
/// for one short transaction, so reaching this means the database is stuck, not busy.
#[cfg(feature = "sqlite")]
pub(in crate::store::sea) const SQLITE_BUSY_TIMEOUT: std::time::Duration =
    std::time::Duration::from_secs(30);

/// A transaction that writes: on `SQLite` it takes the write lock at `BEGIN`, so that what it reads
/// cannot change before it writes (a deferred transaction would fail to upgrade).
pub(in crate::store::sea) async fn begin_write(
    db: &DatabaseConnection,
) -> Result<DatabaseTransaction, DbErr> {
    db.begin_with_options(TransactionOptions {
        sqlite_transaction_mode: Some(SqliteTransactionMode::Immediate),
        ..TransactionOptions::default()
    })
    .await
}

/// How a `SQLite` file's committer writes a batch: through a connection of its own
/// (`super::sqlite_direct::OwnConnection`), or through one kept beside an owned file's holds,
/// which decides reservations in memory (`crate::store::sea::owned`).
#[cfg(feature = "sqlite")]
pub(in crate::store::sea) trait BatchWriter: Send + 'static {
    /// Writes `writes` in one transaction: each write's outcome, in order.
    fn apply(
        &mut self,
        writes: &[&Write],
        alerting: Option<Alerting>,
    ) -> Result<Vec<Outcome>, Failure>;

    /// Ends the reservations whose callers stopped waiting before their batch was answered:
    /// those this writer holds in memory end here (they moved nothing); the rest, returned,
    /// are rows, refunded in the next batch.
    fn end_unclaimed(&mut self, unclaimed: Vec<CallId>) -> Vec<CallId>;
}
