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

use std::sync::Arc;

use sea_orm::{ConnectionTrait, DatabaseConnection, DbBackend};
use tokio::sync::{mpsc, oneshot};

use super::batches::Batches;
use super::flush::{self, Durability, FlushRules, Flusher};
#[cfg(feature = "sqlite")]
use super::jobs::BatchWriter;
#[cfg(feature = "sqlite")]
use super::jobs::Kept;
use super::jobs::{Asked, Counters, Failure, GroupCommitStats, Job, begin_write, stopped};
use super::ledger_ops::apply_in;
use crate::store::sea::alerting::{Alerting, EventSettings};
use crate::store::sea::writes::{Outcome, OwnedCharge, Unabandoned, Write};
use crate::store::{CallFailure, CallId, CallSuccess, Reservation, ReserveError, StoreError};

/// Where the ledger's writes go: the committer and the pool.
pub(in crate::store::sea) struct Writers<'a> {
    pub(in crate::store::sea) committer: &'a Committer,
    pub(in crate::store::sea) db: &'a DatabaseConnection,
    /// What the ledger's writes outside the committer are told with.
    pub(in crate::store::sea) alerting: Option<Alerting>,
}

/// Most ledger writes one transaction carries.
pub const DEFAULT_MAX_BATCH: usize = 64;

/// Writes waiting beyond this make callers wait to queue (back-pressure).
const QUEUE: usize = 4096;

/// The queue to a store's committer task.
#[derive(Debug, Clone)]
pub(in crate::store::sea) struct Committer {
    jobs: mpsc::Sender<Job>,
    stats: Arc<Counters>,
}

impl Committer {
    /// Starts the committer task on the current Tokio runtime. With `postgres_flusher` its
    /// batches commit asynchronously and a flusher task makes them durable (see
    /// [`super::flush`]); otherwise each commit is durable when it returns.
    pub(in crate::store::sea) fn start(
        db: DatabaseConnection,
        max_batch: usize,
        postgres_flusher: bool,
        events: Arc<EventSettings>,
    ) -> Committer {
        let (jobs, queue) = mpsc::channel(QUEUE);
        let stats = Arc::new(Counters::default());
        let durability = if postgres_flusher && db.get_database_backend() == DbBackend::Postgres {
            let (flusher, durability) = Flusher::new(stats.clone(), FlushRules::Postgres);
            flush::start_postgres(db.clone(), flusher, jobs.downgrade());
            durability
        } else {
            Durability::AtCommit
        };
        let batches = Batches::new(max_batch, stats.clone(), durability);
        tokio::spawn(run(db, queue, batches, events));
        Committer { jobs, stats }
    }

    /// Starts the committer on a thread of its own, writing to a `SQLite` file through
    /// `writer` (see `BatchWriter`), with `wal` flushed by a thread beside it. The threads
    /// end when the last sender is dropped.
    #[cfg(feature = "sqlite")]
    pub(in crate::store::sea) fn start_direct(
        writer: Box<dyn BatchWriter>,
        wal: std::fs::File,
        max_batch: usize,
        events: Arc<EventSettings>,
    ) -> Result<Committer, StoreError> {
        let (jobs, queue) = mpsc::channel(QUEUE);
        let stats = Arc::new(Counters::default());
        let (flusher, durability) = Flusher::new(stats.clone(), FlushRules::SqliteFile);
        let batches = Batches::new(max_batch, stats.clone(), durability);
        let spawn = |name: &str, work: Box<dyn FnOnce() + Send>| {
            std::thread::Builder::new()
                .name(name.into())
                .spawn(work)
                .map_err(|error| StoreError::Database(Box::new(error)))
        };
        spawn(
            "mg-sqlite-flusher",
            Box::new(move || super::sqlite_direct::flush(wal, flusher)),
        )?;
        spawn(
            "mg-sqlite-committer",
            Box::new(move || run_direct(writer, queue, batches, &events)),
        )?;
        Ok(Committer { jobs, stats })
    }

    pub(in crate::store::sea) fn stats(&self) -> GroupCommitStats {
        self.stats.snapshot()
    }

    /// Whether a failed flush stopped this committer for good: every write is refused.
    pub(in crate::store::sea) fn halted(&self) -> bool {
        self.stats.halted.load(std::sync::atomic::Ordering::Acquire)
    }

    /// Marks the committer stopped, as a failed flush does.
    #[cfg(all(test, feature = "sqlite"))]
    pub(in crate::store::sea) fn halt(&self) {
        self.stats
            .halted
            .store(true, std::sync::atomic::Ordering::Release);
    }

    /// Queues a write; the answer comes on the returned receiver.
    async fn send<T, E>(&self, asked: Asked<T, E>) -> Result<Answer<T, E>, StoreError> {
        let (job, answered) = asked.job();
        self.jobs.send(job).await.map_err(|_| stopped())?;
        Ok(Answer(answered))
    }

    /// Queues a write and waits for the answer.
    async fn submit<T, E: From<StoreError>>(&self, asked: Asked<T, E>) -> Result<T, E> {
        self.send(asked).await?.wait().await
    }

    pub(in crate::store::sea) async fn reserve(
        &self,
        charge: OwnedCharge,
    ) -> Result<Reservation, ReserveError> {
        self.submit(Asked::reserve(charge)).await
    }

    #[cfg(feature = "sqlite")]
    /// Room in the queue for one write, taken before the holds' state is locked (the lock is
    /// never held across an await); [`Slot::queue`] then queues the write under the lock. The
    /// room is kept with the write if it waits beside the holds before going to the committer.
    pub(in crate::store::sea) async fn slot(&self) -> Result<Slot, StoreError> {
        let room = (self.jobs.clone().reserve_owned().await).map_err(|_| stopped())?;
        Ok(Slot(room))
    }

    pub(in crate::store::sea) async fn settle(
        &self,
        call: CallId,
        success: CallSuccess,
    ) -> Result<bool, StoreError> {
        self.submit(Asked::settle(call, success)).await
    }

    pub(in crate::store::sea) async fn refund(
        &self,
        call: CallId,
        failure: CallFailure,
    ) -> Result<bool, StoreError> {
        self.submit(Asked::refund(call, failure)).await
    }
}

#[cfg(feature = "sqlite")]
/// Room for one write in a committer's queue (see [`Committer::slot`]).
pub(in crate::store::sea) struct Slot(mpsc::OwnedPermit<Job>);

/// Where a write queued under its caller's lock waits its turn to enter the committer's queue
/// (an owned file's holds: `crate::store::sea::owned`).
#[cfg(feature = "sqlite")]
pub(in crate::store::sea) trait Queue {
    /// Keeps `kept` until its turn.
    fn queue(&mut self, kept: Kept);
}

#[cfg(feature = "sqlite")]
impl Slot {
    /// Queues `write` while its caller holds the lock on `state`, so that an account's
    /// writes on an owned file are decided in the order they took the lock. The caller lets
    /// the lock go before waiting for the answer.
    pub(in crate::store::sea) fn queue<T, E>(
        self,
        state: &mut impl Queue,
        asked: Asked<T, E>,
    ) -> Answer<T, E> {
        let (job, answered) = asked.job();
        state.queue(Kept { job, room: self.0 });
        Answer(answered)
    }
}

/// The answer to a queued write, once its batch is written.
pub(in crate::store::sea) struct Answer<T, E>(oneshot::Receiver<Result<T, E>>);

impl<T, E: From<StoreError>> Answer<T, E> {
    pub(in crate::store::sea) async fn wait(self) -> Result<T, E> {
        self.0.await.map_err(|_| stopped())?
    }
}

async fn run(
    db: DatabaseConnection,
    mut queue: mpsc::Receiver<Job>,
    mut batches: Batches,
    events: Arc<EventSettings>,
) {
    while batches.next(&mut queue).await {
        let flushed_later = batches.flushed_later();
        let alerting = events.alerting();
        let applied = apply(&db, batches.writes(), flushed_later, alerting).await;
        let unclaimed = batches.conclude(applied);
        batches.refund_unclaimed(unclaimed);
    }
}

/// Applies the writes in one transaction, in order, and commits; with `flushed_later`, the
/// commit does not wait for the disk (`PostgreSQL`'s asynchronous commit): the flusher does. A
/// settle whose caller gave up on it while the batch waited (a lock, a silent database) is left
/// out: the batch is rolled back and written again without it (see
/// [`crate::store::SettleClaim`]).
async fn apply(
    db: &DatabaseConnection,
    writes: Vec<&Write>,
    flushed_later: bool,
    alerting: Option<Alerting>,
) -> Result<Vec<Outcome>, Failure> {
    let mut tries = Unabandoned::new(&writes);
    loop {
        let batch = tries.batch();
        let txn = begin_write(db)
            .await
            .map_err(|error| Failure::Statement(error.into()))?;
        let applied = async {
            if flushed_later {
                txn.execute_unprepared("SET LOCAL synchronous_commit TO off")
                    .await?;
            }
            apply_in(&txn, &batch, None, alerting).await
        };
        match applied.await {
            Ok(outcomes) if tries.claimed(&batch) => {
                txn.commit()
                    .await
                    .map_err(|error| Failure::Commit(error.into()))?;
                return Ok(tries.outcomes(outcomes));
            }
            Ok(_) => {
                let _ = txn.rollback().await;
            }
            Err(error) => {
                let _ = txn.rollback().await;
                return Err(Failure::Statement(error));
            }
        }
    }
}

/// The committer's loop on a `SQLite` file, on its own thread: until every sender is gone,
/// take a batch, write it in one transaction through `writer`, answer it.
#[cfg(feature = "sqlite")]
fn run_direct(
    mut writer: Box<dyn BatchWriter>,
    mut queue: mpsc::Receiver<Job>,
    mut batches: Batches,
    events: &EventSettings,
) {
    while batches.next_blocking(&mut queue) {
        let applied = if batches.halted() {
            Err(Failure::Halted)
        } else {
            writer.apply(&batches.writes(), events.alerting())
        };
        let unclaimed = batches.conclude(applied);
        if !unclaimed.is_empty() {
            let rows = writer.end_unclaimed(unclaimed);
            batches.refund_unclaimed(rows);
        }
    }
}
