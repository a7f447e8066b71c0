//! Group commit: one task per store applies queued ledger writes (reserve, settle, refund) in
//! batches, one write transaction per batch, so that many calls share one commit (one fsync)
//! instead of paying one each.
//!
//! Each write's outcome is decided by exactly the logic it has alone ([`super::ledger_ops`]),
//! applied in queue order, and is answered only after its batch committed: durable before the
//! caller hears of it. If a statement fails, the batch is rolled back and each write is run
//! again alone, so one bad write cannot fail its neighbours. If the commit itself fails, its
//! outcome is in doubt, so nothing is rerun: every write in the batch answers a store error, and
//! a reservation that did land stays `pending` until recovery refunds it.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use sea_orm::{DatabaseConnection, DatabaseTransaction};
use tokio::sync::{mpsc, oneshot};

use super::begin_write;
use super::ledger_ops::{Insufficient, LockedAccounts, refund_in, reserve_in, settle_in};
use crate::credits::Credits;
use crate::protocol::Protocol;
use crate::store::{
    CallFailure, CallId, CallSuccess, Caller, ChargeRequest, Reservation, ReserveError, StoreError,
};

/// Most ledger writes one transaction carries.
pub const DEFAULT_MAX_BATCH: usize = 64;

/// Writes waiting beyond this make callers wait to queue (back-pressure).
const QUEUE: usize = 4096;

/// A [`ChargeRequest`] that can wait in a queue.
#[derive(Debug, Clone)]
pub(super) struct OwnedCharge {
    pub(super) caller: Caller,
    pub(super) protocol: Protocol,
    pub(super) model: String,
    pub(super) price: Credits,
}

impl From<ChargeRequest<'_>> for OwnedCharge {
    fn from(request: ChargeRequest<'_>) -> OwnedCharge {
        OwnedCharge {
            caller: request.caller,
            protocol: request.protocol,
            model: request.model.to_owned(),
            price: request.price,
        }
    }
}

enum Job {
    Reserve(
        OwnedCharge,
        oneshot::Sender<Result<Reservation, ReserveError>>,
    ),
    Settle(
        CallId,
        CallSuccess,
        oneshot::Sender<Result<bool, StoreError>>,
    ),
    Refund(
        CallId,
        CallFailure,
        oneshot::Sender<Result<bool, StoreError>>,
    ),
}

/// What one write decided, before its batch committed.
enum Decided {
    Reserved(Result<Reservation, Insufficient>),
    Written(bool),
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
}

/// How the committer has grouped the ledger's writes so far.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GroupCommitStats {
    /// Transactions committed (or attempted) for ledger writes.
    pub transactions: u64,
    /// Ledger writes (reserve, settle, refund) applied.
    pub writes: u64,
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
        }
    }

    /// Queues a job built around its reply channel and waits for the reply.
    async fn submit<T, E: From<StoreError>>(
        &self,
        job: impl FnOnce(oneshot::Sender<Result<T, E>>) -> Job,
    ) -> Result<T, E> {
        let (answer, answered) = oneshot::channel();
        self.jobs.send(job(answer)).await.map_err(|_| stopped())?;
        answered.await.map_err(|_| stopped())?
    }

    pub(super) async fn reserve(&self, charge: OwnedCharge) -> Result<Reservation, ReserveError> {
        self.submit(|answer| Job::Reserve(charge, answer)).await
    }

    pub(super) async fn settle(
        &self,
        call: CallId,
        success: CallSuccess,
    ) -> Result<bool, StoreError> {
        self.submit(|answer| Job::Settle(call, success, answer))
            .await
    }

    pub(super) async fn refund(
        &self,
        call: CallId,
        failure: CallFailure,
    ) -> Result<bool, StoreError> {
        self.submit(|answer| Job::Refund(call, failure, answer))
            .await
    }
}

async fn run(
    db: DatabaseConnection,
    mut queue: mpsc::Receiver<Job>,
    max_batch: usize,
    stats: Arc<Counters>,
) {
    let mut batch = Vec::with_capacity(max_batch);
    while queue.recv_many(&mut batch, max_batch).await > 0 {
        stats.transactions.fetch_add(1, Ordering::Relaxed);
        stats
            .writes
            .fetch_add(batch.len() as u64, Ordering::Relaxed);
        if batch.len() == 1 {
            let job = batch.pop().expect("one job");
            run_alone(&db, job).await;
            continue;
        }
        match apply(&db, &batch).await {
            Ok(decided) => {
                for (job, decided) in batch.drain(..).zip(decided) {
                    answer(job, Ok(decided));
                }
            }
            Err(Failure::Statement(error)) => {
                tracing::warn!(%error, size = batch.len(), "batch rolled back; running its writes alone");
                for job in batch.drain(..) {
                    run_alone(&db, job).await;
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

/// Applies every job in one transaction, in order, and commits.
async fn apply(db: &DatabaseConnection, jobs: &[Job]) -> Result<Vec<Decided>, Failure> {
    let txn = begin_write(db)
        .await
        .map_err(|error| Failure::Statement(error.into()))?;
    let mut decided = Vec::with_capacity(jobs.len());
    let mut accounts = LockedAccounts::default();
    for job in jobs {
        match decide(&txn, &mut accounts, job).await {
            Ok(outcome) => decided.push(outcome),
            Err(error) => {
                let _ = txn.rollback().await;
                return Err(Failure::Statement(error));
            }
        }
    }
    if let Err(error) = accounts.write(&txn).await {
        let _ = txn.rollback().await;
        return Err(Failure::Statement(error));
    }
    txn.commit()
        .await
        .map_err(|error| Failure::Commit(error.into()))?;
    Ok(decided)
}

async fn decide(
    txn: &DatabaseTransaction,
    accounts: &mut LockedAccounts,
    job: &Job,
) -> Result<Decided, StoreError> {
    Ok(match job {
        Job::Reserve(charge, _) => Decided::Reserved(reserve_in(txn, accounts, charge).await?),
        Job::Settle(call, success, _) => Decided::Written(settle_in(txn, *call, success).await?),
        Job::Refund(call, failure, _) => {
            Decided::Written(refund_in(txn, accounts, *call, failure).await?)
        }
    })
}

/// One job in a transaction of its own.
async fn run_alone(db: &DatabaseConnection, job: Job) {
    let outcome = async {
        let txn = begin_write(db).await?;
        let mut accounts = LockedAccounts::default();
        let decided = match decide(&txn, &mut accounts, &job).await {
            Ok(decided) => accounts.write(&txn).await.map(|()| decided),
            Err(error) => Err(error),
        };
        match decided {
            Ok(decided) => {
                txn.commit().await?;
                Ok(decided)
            }
            Err(error) => {
                let _ = txn.rollback().await;
                Err(error)
            }
        }
    }
    .await;
    answer(job, outcome);
}

impl Job {
    fn fail(self, error: StoreError) {
        match self {
            Job::Reserve(_, to) => {
                let _ = to.send(Err(ReserveError::Store(error)));
            }
            Job::Settle(_, _, to) | Job::Refund(_, _, to) => {
                let _ = to.send(Err(error));
            }
        }
    }
}

fn answer(job: Job, outcome: Result<Decided, StoreError>) {
    // A caller that stopped waiting (its future was dropped) is not an error here: the write
    // stands, and the call's guard or recovery finishes it.
    match (job, outcome) {
        (job, Err(error)) => job.fail(error),
        (Job::Reserve(_, to), Ok(Decided::Reserved(reserved))) => {
            let _ = to.send(reserved.map_err(|Insufficient| ReserveError::InsufficientCredits));
        }
        (Job::Settle(_, _, to) | Job::Refund(_, _, to), Ok(Decided::Written(written))) => {
            let _ = to.send(Ok(written));
        }
        (job, Ok(_)) => job.fail(StoreError::msg("internal: an outcome of the wrong kind")),
    }
}
