//! Group commit: one task per store applies queued ledger writes (reserve, settle, refund) in
//! batches, one write transaction per batch, so that many calls share one commit (one fsync)
//! instead of paying one each.
//!
//! A batch is applied by [`super::ledger_ops`] with a fixed number of set-based statements,
//! each write decided in queue order exactly as it would be alone, and each is answered only
//! after its batch committed and, where [`super::flush`] says so, was flushed to disk. If a
//! statement fails, the batch is rolled back and each write is run again alone, so one bad
//! write cannot fail its neighbours. If the commit itself fails, its outcome is in doubt, so nothing is rerun: every
//! write in the batch answers a store error, and a reservation that did land stays `pending`
//! until recovery refunds it.

use std::collections::VecDeque;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use sea_orm::{ConnectionTrait, DatabaseConnection, DbBackend};
use tokio::sync::{mpsc, oneshot};

use super::batch::{Outcome, OwnedCharge, Write};
use super::begin_write;
use super::flush::{self, Durability, Flusher};
use super::ledger_ops::apply_in;
use crate::store::{CallFailure, CallId, CallSuccess, Reservation, ReserveError, StoreError};

/// Most ledger writes one transaction carries.
pub const DEFAULT_MAX_BATCH: usize = 64;

/// Writes waiting beyond this make callers wait to queue (back-pressure).
const QUEUE: usize = 4096;

/// A write and where its answer goes.
pub(super) struct Job {
    write: Write,
    reply: Reply,
}

enum Reply {
    Reserve(oneshot::Sender<Result<Reservation, ReserveError>>),
    Finish(oneshot::Sender<Result<bool, StoreError>>),
}

/// The queue to a store's committer task.
#[derive(Debug, Clone)]
pub(super) struct Committer {
    jobs: mpsc::Sender<Job>,
    stats: Arc<Counters>,
}

#[derive(Debug, Default)]
pub(super) struct Counters {
    transactions: AtomicU64,
    writes: AtomicU64,
    rolled_back: AtomicU64,
    pub(super) flushes: AtomicU64,
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
    /// Flushes that made committed batches durable. On a SQLite file and on PostgreSQL a batch
    /// commits without waiting for the disk (so no lock is held through an fsync), and a flusher
    /// beside the committer then makes it durable (an fsync of the WAL file; a synchronous
    /// commit that flushes PostgreSQL's WAL) before the writes that need it are answered:
    /// settles and refunds always, reservations on PostgreSQL. Several batches may share one
    /// flush. Always 0 on MySQL and in-memory SQLite, whose commits are durable when they
    /// return.
    pub flushes: u64,
}

fn stopped() -> StoreError {
    StoreError::msg("the ledger's committer task has stopped (its runtime shut down)")
}

impl Committer {
    /// Starts the committer task on the current Tokio runtime. With `postgres_flusher` its
    /// batches commit asynchronously and a flusher task makes them durable (see
    /// [`super::flush`]); otherwise each commit is durable when it returns.
    pub(super) fn start(
        db: DatabaseConnection,
        max_batch: usize,
        postgres_flusher: bool,
    ) -> Committer {
        let (jobs, queue) = mpsc::channel(QUEUE);
        let stats = Arc::new(Counters::default());
        let durability = if postgres_flusher && db.get_database_backend() == DbBackend::Postgres {
            // Reservations wait for the flush; a failed flush does not halt (see `flush`).
            let (flusher, durability) = Flusher::new(stats.clone(), true, false);
            flush::start_postgres(db.clone(), flusher);
            durability
        } else {
            Durability::AtCommit
        };
        let batches = Batches::new(max_batch, stats.clone(), durability);
        tokio::spawn(run(db, queue, batches));
        Committer { jobs, stats }
    }

    /// Starts the committer on a thread of its own, writing through `connection` to a SQLite
    /// file (see [`super::sqlite_direct`]). The thread ends when the last sender is dropped.
    #[cfg(feature = "sqlite")]
    pub(super) fn start_direct(
        connection: rusqlite::Connection,
        wal: std::fs::File,
        max_batch: usize,
    ) -> Result<Committer, StoreError> {
        let (jobs, queue) = mpsc::channel(QUEUE);
        let stats = Arc::new(Counters::default());
        // Reservations are answered at commit; a failed fsync halts (see `flush`).
        let (flusher, durability) = Flusher::new(stats.clone(), false, true);
        let batches = Batches::new(max_batch, stats.clone(), durability);
        let spawn = |name: &str, work: Box<dyn FnOnce() + Send>| {
            std::thread::Builder::new()
                .name(name.into())
                .spawn(work)
                .map_err(|error| StoreError(Box::new(error)))
        };
        spawn(
            "mg-sqlite-flusher",
            Box::new(move || super::sqlite_direct::flush(wal, flusher)),
        )?;
        spawn(
            "mg-sqlite-committer",
            Box::new(move || super::sqlite_direct::run(connection, queue, batches)),
        )?;
        Ok(Committer { jobs, stats })
    }

    pub(super) fn stats(&self) -> GroupCommitStats {
        GroupCommitStats {
            transactions: self.stats.transactions.load(Ordering::Relaxed),
            writes: self.stats.writes.load(Ordering::Relaxed),
            rolled_back: self.stats.rolled_back.load(Ordering::Relaxed),
            flushes: self.stats.flushes.load(Ordering::Relaxed),
        }
    }

    /// Queues a write with its reply channel and waits for the reply.
    async fn submit<T, E: From<StoreError>>(
        &self,
        write: Write,
        reply: impl FnOnce(oneshot::Sender<Result<T, E>>) -> Reply,
    ) -> Result<T, E> {
        let (answer, answered) = oneshot::channel();
        let job = Job {
            write,
            reply: reply(answer),
        };
        self.jobs.send(job).await.map_err(|_| stopped())?;
        answered.await.map_err(|_| stopped())?
    }

    pub(super) async fn reserve(&self, charge: OwnedCharge) -> Result<Reservation, ReserveError> {
        self.submit(Write::Reserve(charge), Reply::Reserve).await
    }

    pub(super) async fn settle(
        &self,
        call: CallId,
        success: CallSuccess,
    ) -> Result<bool, StoreError> {
        self.submit(Write::Settle(call, success), Reply::Finish)
            .await
    }

    pub(super) async fn refund(
        &self,
        call: CallId,
        failure: CallFailure,
    ) -> Result<bool, StoreError> {
        self.submit(Write::Refund(call, failure), Reply::Finish)
            .await
    }
}

async fn run(db: DatabaseConnection, mut queue: mpsc::Receiver<Job>, mut batches: Batches) {
    while batches.next_alone() || queue.recv_many(&mut batches.current, batches.max).await > 0 {
        let flushed_later = matches!(batches.durability, Durability::Flushed { .. });
        let applied = apply(&db, batches.writes(), flushed_later).await;
        batches.conclude(applied);
    }
}

/// Why a batch's transaction did not commit.
pub(super) enum Failure {
    /// A statement failed; the transaction was rolled back and wrote nothing.
    Statement(StoreError),
    /// The commit failed: whether it wrote is unknown.
    Commit(StoreError),
    /// Nothing was tried: a failed flush stopped the committer (see [`super::flush`]).
    Halted,
}

/// What a committer loop does with each batch, whichever way it writes it: counts it, and
/// answers its writes from the outcome. A batch of several rolled back by a failing statement
/// is not answered; its writes are queued to run again one by one, ahead of anything new.
pub(super) struct Batches {
    current: Vec<Job>,
    alone: VecDeque<Job>,
    max: usize,
    stats: Arc<Counters>,
    durability: Durability,
}

impl Batches {
    fn new(max: usize, stats: Arc<Counters>, durability: Durability) -> Batches {
        Batches {
            current: Vec::with_capacity(max),
            alone: VecDeque::new(),
            max,
            stats,
            durability,
        }
    }

    /// Whether a failed flush has stopped this committer: its batches must not be written.
    pub(super) fn halted(&self) -> bool {
        self.durability.halted()
    }

    /// Takes a write waiting to run alone as the next batch, if there is one.
    pub(super) fn next_alone(&mut self) -> bool {
        match self.alone.pop_front() {
            Some(job) => {
                self.current.push(job);
                true
            }
            None => false,
        }
    }

    /// Receives the next batch on a thread outside the runtime; `false` once every sender is
    /// gone.
    pub(super) fn next_blocking(&mut self, queue: &mut mpsc::Receiver<Job>) -> bool {
        self.next_alone() || queue.blocking_recv_many(&mut self.current, self.max) > 0
    }

    /// The current batch's writes, in queue order.
    pub(super) fn writes(&self) -> Vec<&Write> {
        self.current.iter().map(|job| &job.write).collect()
    }

    /// Answers the current batch from how its transaction ended.
    pub(super) fn conclude(&mut self, applied: Result<Vec<Outcome>, Failure>) {
        let stats = &self.stats;
        stats.transactions.fetch_add(1, Ordering::Relaxed);
        let size = self.current.len();
        stats.writes.fetch_add(size as u64, Ordering::Relaxed);
        match applied {
            Ok(outcomes) => {
                self.durability.answer(self.current.drain(..).zip(outcomes));
            }
            Err(Failure::Statement(error)) => {
                stats.rolled_back.fetch_add(1, Ordering::Relaxed);
                if size > 1 {
                    tracing::warn!(%error, size, "batch rolled back; running its writes alone");
                    self.alone.extend(self.current.drain(..));
                } else {
                    if let Some(job) = self.current.pop() {
                        job.fail(error);
                    }
                }
            }
            Err(Failure::Commit(error)) => {
                tracing::error!(%error, size, "batch commit failed; outcome in doubt");
                for job in self.current.drain(..) {
                    job.fail(StoreError::msg(format!("commit failed: {error}")));
                }
            }
            Err(Failure::Halted) => {
                for job in self.current.drain(..) {
                    job.fail(StoreError::msg(
                        "an earlier flush of the ledger failed; it takes no writes until the \
                         gateway is restarted",
                    ));
                }
            }
        }
    }
}

/// Applies the writes in one transaction, in order, and commits; with `flushed_later`, the
/// commit does not wait for the disk (PostgreSQL's asynchronous commit): the flusher does.
async fn apply(
    db: &DatabaseConnection,
    writes: Vec<&Write>,
    flushed_later: bool,
) -> Result<Vec<Outcome>, Failure> {
    let txn = begin_write(db)
        .await
        .map_err(|error| Failure::Statement(error.into()))?;
    let applied = async {
        if flushed_later {
            txn.execute_unprepared("SET LOCAL synchronous_commit TO off")
                .await?;
        }
        apply_in(&txn, &writes).await
    };
    match applied.await {
        Ok(outcomes) => {
            txn.commit()
                .await
                .map_err(|error| Failure::Commit(error.into()))?;
            Ok(outcomes)
        }
        Err(error) => {
            let _ = txn.rollback().await;
            Err(Failure::Statement(error))
        }
    }
}

impl Job {
    pub(super) fn is_reservation(&self) -> bool {
        matches!(self.write, Write::Reserve(_))
    }

    pub(super) fn fail(self, error: StoreError) {
        match self.reply {
            Reply::Reserve(to) => {
                let _ = to.send(Err(ReserveError::Store(error)));
            }
            Reply::Finish(to) => {
                let _ = to.send(Err(error));
            }
        }
    }

    pub(super) fn answer(self, outcome: Outcome) {
        // A caller that stopped waiting (its future was dropped) is not an error here: the write
        // stands, and the call's guard or recovery finishes it.
        match (self.reply, outcome) {
            (Reply::Reserve(to), Outcome::Reserved(reserved)) => {
                let _ = to.send(reserved);
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
    }
}

fn wrong_kind() -> StoreError {
    StoreError::msg("internal: an outcome of the wrong kind")
}

#[cfg(test)]
mod tests {
    //! The answering rule of [`super::super::flush`], driven by hand: no flusher thread, no
    //! database, every step taken by the test.

    use super::*;
    use crate::credits::{Credits, Split};
    use crate::protocol::Protocol;
    use crate::store::{AccountId, CallId, Caller, KeyId};
    use oneshot::error::TryRecvError;

    type Reserved = oneshot::Receiver<Result<Reservation, ReserveError>>;
    type Finished = oneshot::Receiver<Result<bool, StoreError>>;

    fn reservation(call: i64) -> Reservation {
        Reservation {
            call: CallId(call),
            account: AccountId(1),
            taken: Split {
                subscription: Credits(1),
                topup: Credits::ZERO,
            },
        }
    }

    /// A reservation and a settle committed together, as `batches` concludes them.
    fn commit_reserve_and_settle(batches: &mut Batches, call: i64) -> (Reserved, Finished) {
        let (reserve_to, reserved) = oneshot::channel();
        let (settle_to, settled) = oneshot::channel();
        let charge = OwnedCharge {
            caller: Caller {
                account: AccountId(1),
                key: KeyId(1),
            },
            protocol: Protocol::ChatCompletions,
            model: "m".into(),
            price: Credits(1),
        };
        batches.current.push(Job {
            write: Write::Reserve(charge),
            reply: Reply::Reserve(reserve_to),
        });
        batches.current.push(Job {
            write: Write::Settle(CallId(call - 1), CallSuccess::default()),
            reply: Reply::Finish(settle_to),
        });
        let outcomes = vec![
            Outcome::Reserved(Ok(reservation(call))),
            Outcome::Finished(true),
        ];
        batches.conclude(Ok(outcomes));
        (reserved, settled)
    }

    fn flushed_committer(reservations_wait: bool, halt: bool) -> (Batches, Flusher) {
        let stats = Arc::new(Counters::default());
        let (flusher, durability) = Flusher::new(stats.clone(), reservations_wait, halt);
        (Batches::new(64, stats, durability), flusher)
    }

    #[test]
    fn on_sqlite_a_settle_waits_for_the_flush_and_a_reservation_does_not() {
        let (mut batches, mut flusher) = flushed_committer(false, true);
        let (mut reserved, mut settled) = commit_reserve_and_settle(&mut batches, 2);
        assert_eq!(reserved.try_recv().unwrap().unwrap(), reservation(2));
        assert_eq!(settled.try_recv().unwrap_err(), TryRecvError::Empty);

        assert!(flusher.next_blocking());
        assert_eq!(settled.try_recv().unwrap_err(), TryRecvError::Empty);
        flusher.conclude(Ok(()));
        assert!(settled.try_recv().unwrap().unwrap());
    }

    #[test]
    fn on_postgres_a_reservation_waits_for_the_flush_too() {
        let (mut batches, mut flusher) = flushed_committer(true, false);
        let (mut reserved, mut settled) = commit_reserve_and_settle(&mut batches, 2);
        assert_eq!(reserved.try_recv().unwrap_err(), TryRecvError::Empty);
        assert_eq!(settled.try_recv().unwrap_err(), TryRecvError::Empty);

        assert!(flusher.next_blocking());
        flusher.conclude(Ok(()));
        assert_eq!(reserved.try_recv().unwrap().unwrap(), reservation(2));
        assert!(settled.try_recv().unwrap().unwrap());
    }

    #[test]
    fn a_flush_answers_only_what_committed_before_it_began() {
        let (mut batches, mut flusher) = flushed_committer(true, false);
        let (mut first, _) = commit_reserve_and_settle(&mut batches, 2);
        assert!(flusher.next_blocking());
        // Committed while the flush is under way: the flush may not cover it.
        let (mut second, _) = commit_reserve_and_settle(&mut batches, 4);
        flusher.conclude(Ok(()));
        assert!(first.try_recv().unwrap().is_ok());
        assert_eq!(second.try_recv().unwrap_err(), TryRecvError::Empty);

        assert!(flusher.next_blocking());
        flusher.conclude(Ok(()));
        assert_eq!(second.try_recv().unwrap().unwrap(), reservation(4));
    }

    #[test]
    fn a_failed_flush_on_sqlite_fails_its_writes_and_every_later_one() {
        let (mut batches, mut flusher) = flushed_committer(false, true);
        let (_, mut settled) = commit_reserve_and_settle(&mut batches, 2);
        assert!(flusher.next_blocking());
        flusher.conclude(Err(StoreError::msg("EIO")));
        assert!(settled.try_recv().unwrap().is_err());
        assert!(batches.halted());

        let (answer, mut refunded) = oneshot::channel();
        batches.current.push(Job {
            write: Write::Refund(
                CallId(1),
                CallFailure {
                    upstream_status: None,
                    error: "test".into(),
                },
            ),
            reply: Reply::Finish(answer),
        });
        batches.conclude(Err(Failure::Halted));
        assert!(refunded.try_recv().unwrap().is_err());
    }

    #[test]
    fn a_failed_flush_on_postgres_fails_its_writes_but_not_later_ones() {
        let (mut batches, mut flusher) = flushed_committer(true, false);
        let (mut reserved, mut settled) = commit_reserve_and_settle(&mut batches, 2);
        assert!(flusher.next_blocking());
        flusher.conclude(Err(StoreError::msg("connection reset")));
        assert!(reserved.try_recv().unwrap().is_err());
        assert!(settled.try_recv().unwrap().is_err());
        assert!(!batches.halted());
    }
}
