//! Group commit: one task per store applies queued ledger writes (reserve, settle, refund) in
//! batches, one write transaction per batch, so that many calls share one commit (one fsync)
//! instead of paying one each.
//!
//! A batch is applied by [`super::ledger_ops`] with a fixed number of set-based statements,
//! each write decided in queue order exactly as it would be alone, and each is answered only
//! after its batch committed: durable before the caller hears of it. If a statement fails, the
//! batch is rolled back and each write is run again alone, so one bad write cannot fail its
//! neighbours. If the commit itself fails, its outcome is in doubt, so nothing is rerun: every
//! write in the batch answers a store error, and a reservation that did land stays `pending`
//! until recovery refunds it.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use sea_orm::DatabaseConnection;
use tokio::sync::{mpsc, oneshot};

use super::begin_write;
use super::ledger_ops::{Outcome, OwnedCharge, Write, apply_in};
use crate::store::{CallFailure, CallId, CallSuccess, Reservation, ReserveError, StoreError};

/// Most ledger writes one transaction carries.
pub const DEFAULT_MAX_BATCH: usize = 64;

/// Writes waiting beyond this make callers wait to queue (back-pressure).
const QUEUE: usize = 4096;

/// A write and where its answer goes.
struct Job {
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
struct Counters {
    transactions: AtomicU64,
    writes: AtomicU64,
    rolled_back: AtomicU64,
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
}

fn stopped() -> StoreError {
    StoreError::msg("the ledger's committer task has stopped (its runtime shut down)")
}

impl Committer {
    /// Starts the committer task on the current Tokio runtime.
    pub(super) fn start(db: DatabaseConnection, max_batch: usize) -> Committer {
        let (jobs, queue) = mpsc::channel(QUEUE);
        let stats = Arc::new(Counters::default());
        tokio::spawn(run(db, queue, max_batch, stats.clone()));
        Committer { jobs, stats }
    }

    pub(super) fn stats(&self) -> GroupCommitStats {
        GroupCommitStats {
            transactions: self.stats.transactions.load(Ordering::Relaxed),
            writes: self.stats.writes.load(Ordering::Relaxed),
            rolled_back: self.stats.rolled_back.load(Ordering::Relaxed),
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

async fn run(
    db: DatabaseConnection,
    mut queue: mpsc::Receiver<Job>,
    max_batch: usize,
    stats: Arc<Counters>,
) {
    let mut batch: Vec<Job> = Vec::with_capacity(max_batch);
    while queue.recv_many(&mut batch, max_batch).await > 0 {
        stats.transactions.fetch_add(1, Ordering::Relaxed);
        stats
            .writes
            .fetch_add(batch.len() as u64, Ordering::Relaxed);
        let applied = apply(&db, &stats, batch.iter().map(|job| &job.write).collect()).await;
        match applied {
            Ok(outcomes) => {
                for (job, outcome) in batch.drain(..).zip(outcomes) {
                    job.answer(outcome);
                }
            }
            Err(Failure::Statement(error)) if batch.len() > 1 => {
                tracing::warn!(%error, size = batch.len(), "batch rolled back; running its writes alone");
                for job in batch.drain(..) {
                    match apply(&db, &stats, vec![&job.write]).await {
                        Ok(mut outcome) => job.answer(outcome.pop().expect("one outcome")),
                        Err(Failure::Statement(error) | Failure::Commit(error)) => job.fail(error),
                    }
                }
            }
            Err(Failure::Statement(error)) => {
                if let Some(job) = batch.pop() {
                    job.fail(error);
                }
            }
            Err(Failure::Commit(error)) => {
                tracing::error!(%error, size = batch.len(), "batch commit failed; outcome in doubt");
                for job in batch.drain(..) {
                    job.fail(StoreError::msg(format!("commit failed: {error}")));
                }
            }
        }
    }
}

enum Failure {
    Statement(StoreError),
    Commit(StoreError),
}

/// Applies the writes in one transaction, in order, and commits.
async fn apply(
    db: &DatabaseConnection,
    stats: &Counters,
    writes: Vec<&Write>,
) -> Result<Vec<Outcome>, Failure> {
    let txn = begin_write(db)
        .await
        .map_err(|error| Failure::Statement(error.into()))?;
    match apply_in(&txn, &writes).await {
        Ok(outcomes) => {
            txn.commit()
                .await
                .map_err(|error| Failure::Commit(error.into()))?;
            Ok(outcomes)
        }
        Err(error) => {
            stats.rolled_back.fetch_add(1, Ordering::Relaxed);
            let _ = txn.rollback().await;
            Err(Failure::Statement(error))
        }
    }
}

impl Job {
    fn fail(self, error: StoreError) {
        match self.reply {
            Reply::Reserve(to) => {
                let _ = to.send(Err(ReserveError::Store(error)));
            }
            Reply::Finish(to) => {
                let _ = to.send(Err(error));
            }
        }
    }

    fn answer(self, outcome: Outcome) {
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
