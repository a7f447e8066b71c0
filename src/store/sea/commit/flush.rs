//! When a committed batch is durable, and so when each of its writes may be answered.
//!
//! With a synchronous commit, a batch is durable when its `COMMIT` returns, but the commit then
//! waits for the disk (an fsync) while it still holds its locks: on `PostgreSQL` the hot account's
//! row lock, which every other gateway instance charging that account waits on; on `SQLite` the
//! database's write lock, which the next batch waits on. So where the database allows it, a
//! batch commits without waiting for the disk and a flusher, beside the committer, makes it
//! durable: each flush covers every batch that committed before it began, since both databases
//! write their log in commit order. Many batches share one flush, and the next batch is written
//! while the disk works.
//!
//! Which writes wait for the flush:
//! - a **settle** or **refund** always does: the client hears of its call (the reply, or the
//!   502) only after its outcome is durable;
//! - a **reservation** does on `PostgreSQL`, whose server can crash and lose a commit while the
//!   gateway goes on holding the reservation. On a `SQLite` file it is answered at commit: its
//!   frames are in the file (in the OS's cache), so only a power loss or an OS crash can undo
//!   it, and that also stops the gateway, with the call not yet answered (no reply, nothing
//!   billed). The settle that follows flushes it with itself.
//!
//! A flush that fails leaves what it covered in doubt, so its writes answer a store error. On
//! `SQLite` the committer then refuses every later write: after a failed fsync Linux may drop the
//! unwritten pages and report the next fsync as a success, so nothing written since could be
//! trusted. On `PostgreSQL` a failed flush is a lost connection (the server itself stops on a
//! failed fsync); a settle retried after it waits for a later flush, which covers the first
//! commit too.
//!
//! The `PostgreSQL` flush writes a WAL message; a store whose role may not (see
//! [`postgres_flush_allowed`]) has no flusher and commits each batch synchronously.

use std::sync::Arc;
use std::sync::atomic::Ordering;

#[cfg(any(feature = "sqlite", feature = "postgres", feature = "mysql"))]
use sea_orm::RuntimeErr;
use sea_orm::{ConnectionTrait, DatabaseConnection, DbErr};
use tokio::sync::mpsc;

use super::jobs::{Counters, Job};
use crate::store::sea::writes::Outcome;
use crate::store::{CallId, StoreError};

/// Writes of one committed batch that wait for a flush, with their outcomes.
pub(in crate::store::sea) type Committed = Vec<(Job, Outcome)>;

/// Most committed batches one flush answers (a bound on one loop turn, not on throughput).
const MOST_BATCHES_PER_FLUSH: usize = 1024;

/// How a committer's batches become durable.
#[derive(Debug)]
pub(in crate::store::sea) enum Durability {
    /// Each commit is durable when it returns: every write is answered then.
    AtCommit,
    /// Commits return before they are durable; the flusher answers the writes that wait.
    Flushed {
        flusher: mpsc::UnboundedSender<Committed>,
        reservations_wait: bool,
        /// Whose `halted` says a failed flush stopped the committer (read only on `SQLite`).
        #[cfg_attr(not(any(test, feature = "sqlite")), allow(dead_code))]
        stats: Arc<Counters>,
    },
}

impl Durability {
    /// Answers each write of a committed batch that may hear its outcome now, and hands the
    /// others to the flusher. Returns the calls reserved for callers that are gone, among
    /// those answered now (see [`Job::answer`]).
    pub(in crate::store::sea) fn answer(
        &self,
        committed: impl Iterator<Item = (Job, Outcome)>,
    ) -> Vec<CallId> {
        let Durability::Flushed {
            flusher,
            reservations_wait,
            ..
        } = self
        else {
            return (committed.filter_map(|(job, outcome)| job.answer(outcome))).collect();
        };
        let mut waiting = Vec::new();
        let mut unclaimed = Vec::new();
        for (job, outcome) in committed {
            if *reservations_wait || !job.is_reservation() {
                waiting.push((job, outcome));
            } else {
                unclaimed.extend(job.answer(outcome));
            }
        }
        if waiting.is_empty() {
            return unclaimed;
        }
        if let Err(mpsc::error::SendError(waiting)) = flusher.send(waiting) {
            for (job, _) in waiting {
                job.fail(StoreError::msg("the ledger's flusher has stopped"));
            }
        }
        unclaimed
    }

    /// Whether a failed flush has stopped the committer for good (see the module docs).
    #[cfg(any(test, feature = "sqlite"))]
    pub(in crate::store::sea) fn halted(&self) -> bool {
        match self {
            Durability::AtCommit => false,
            Durability::Flushed { stats, .. } => stats.halted.load(Ordering::Acquire),
        }
    }
}

/// Each database's rules for its flusher (see the module docs).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(in crate::store::sea) enum FlushRules {
    /// `PostgreSQL`: reservations wait for the flush too; a failed flush does not halt.
    Postgres,
    /// A `SQLite` file: reservations are answered at commit; a failed fsync halts the committer.
    SqliteFile,
}

/// The flusher's side: where committed writes arrive, and how a flush is concluded.
pub(in crate::store::sea) struct Flusher {
    queue: mpsc::UnboundedReceiver<Committed>,
    stats: Arc<Counters>,
    halt_on_failure: bool,
    waiting: Vec<Committed>,
}

impl Flusher {
    /// A flusher and the committer's [`Durability`] that feeds it, by the database's `rules`.
    pub(in crate::store::sea) fn new(
        stats: Arc<Counters>,
        rules: FlushRules,
    ) -> (Flusher, Durability) {
        let reservations_wait = rules == FlushRules::Postgres;
        let halt_on_failure = rules == FlushRules::SqliteFile;
        let (sender, queue) = mpsc::unbounded_channel();
        let durability = Durability::Flushed {
            flusher: sender,
            reservations_wait,
            stats: stats.clone(),
        };
        let flusher = Flusher {
            queue,
            stats,
            halt_on_failure,
            waiting: Vec::new(),
        };
        (flusher, durability)
    }

    /// Waits, on a thread outside the runtime, for committed writes; `false` once the committer
    /// is gone and everything was answered.
    #[cfg(any(test, feature = "sqlite"))]
    pub(in crate::store::sea) fn next_blocking(&mut self) -> bool {
        self.queue
            .blocking_recv_many(&mut self.waiting, MOST_BATCHES_PER_FLUSH)
            > 0
    }

    /// Waits for committed writes; `false` once the committer is gone and everything was
    /// answered.
    async fn next(&mut self) -> bool {
        self.queue
            .recv_many(&mut self.waiting, MOST_BATCHES_PER_FLUSH)
            .await
            > 0
    }

    /// Answers everything taken by the last `next` from how the flush that began after it
    /// ended. Returns the reservations to refund: those whose callers are gone (see
    /// [`Job::answer`]) and, if the flush failed, those whose callers were just told so (their
    /// commit stands, but nobody will call the upstream for them or end them). Only
    /// reservations on `PostgreSQL` wait for a flush, so on a `SQLite` file there are none.
    pub(in crate::store::sea) fn conclude(
        &mut self,
        flushed: Result<(), StoreError>,
    ) -> Vec<CallId> {
        self.stats.flushes.fetch_add(1, Ordering::Relaxed);
        match flushed {
            Ok(()) => {
                let answered = self.waiting.drain(..).flatten();
                answered
                    .filter_map(|(job, outcome)| job.answer(outcome))
                    .collect()
            }
            Err(error) => {
                if self.halt_on_failure {
                    self.stats.halted.store(true, Ordering::Release);
                }
                tracing::error!(%error, halted = self.halt_on_failure, "ledger flush failed; its writes are in doubt");
                let mut refused = Vec::new();
                for (job, outcome) in self.waiting.drain(..).flatten() {
                    if let Outcome::Reserved(Ok(reservation)) = &outcome {
                        refused.push(reservation.call);
                    }
                    job.fail(StoreError::msg(format!("flush failed: {error}")));
                }
                refused
            }
        }
    }
}

/// Makes every transaction committed before it durable on `PostgreSQL`: a transaction that writes
/// a (transactional, logical-decoding) WAL message and commits synchronously flushes the WAL up
/// to its own commit record, and so every asynchronous commit before it. The message is the
/// least WAL a transaction can write that needs no table and no privilege; a logical-decoding
/// consumer sees it with the prefix `model-gateway` and can ignore it. One statement, so a
/// failure cannot leave the pooled connection inside an open transaction. Its commit waits as
/// the server's `synchronous_commit` says (with synchronous standbys, for them too), except that
/// `off` is raised to `local` for this one commit: a flush that does not flush would acknowledge
/// charges a crash can undo.
const POSTGRES_FLUSH: &str = "SELECT set_config('synchronous_commit', \
     CASE current_setting('synchronous_commit') WHEN 'off' THEN 'local' \
     ELSE current_setting('synchronous_commit') END, true), \
     pg_logical_emit_message(true, 'model-gateway', 'flush')";

/// The database's own code for `error` (its SQLSTATE), when it gave one.
fn error_code(error: &DbErr) -> Option<String> {
    // sea-orm has sqlx errors only when built with a database driver.
    #[cfg(any(feature = "sqlite", feature = "postgres", feature = "mysql"))]
    if let DbErr::Exec(RuntimeErr::SqlxError(sqlx)) | DbErr::Query(RuntimeErr::SqlxError(sqlx)) =
        error
    {
        return sqlx
            .as_database_error()
            .and_then(|error| error.code())
            .map(|code| code.into_owned());
    }
    #[cfg(not(any(feature = "sqlite", feature = "postgres", feature = "mysql")))]
    let _ = error;
    None
}

/// Whether this database lets the store's role write the flush (see [`POSTGRES_FLUSH`]), tried
/// once when the store connects. Where it may not (`EXECUTE` on `pg_logical_emit_message`
/// revoked, or a PostgreSQL-compatible server without the function), `false`: the committer
/// then commits each batch synchronously, as durable and slower under contention, instead of
/// failing every charged call. Any other error (the server is unreachable, say) is returned.
pub(in crate::store::sea) async fn postgres_flush_allowed(
    db: &DatabaseConnection,
) -> Result<bool, StoreError> {
    let Err(error) = db.execute_unprepared(POSTGRES_FLUSH).await else {
        return Ok(true);
    };
    let code = error_code(&error);
    // insufficient_privilege, undefined_function
    if matches!(code.as_deref(), Some("42501" | "42883")) {
        tracing::warn!(
            %error,
            "the ledger cannot write its flush message; its batches will commit synchronously"
        );
        return Ok(false);
    }
    Err(error.into())
}

/// Starts the `PostgreSQL` flusher on the current Tokio runtime, on the store's pool, for the
/// committer whose queue is `jobs`: the refunds of reservations whose callers never learned
/// of them go there (see [`Flusher::conclude`]). A weak sender, so that the committer still ends once the
/// store's own senders are gone.
pub(in crate::store::sea) fn start_postgres(
    db: DatabaseConnection,
    mut flusher: Flusher,
    jobs: mpsc::WeakSender<Job>,
) {
    tokio::spawn(async move {
        while flusher.next().await {
            let flushed = db.execute_unprepared(POSTGRES_FLUSH).await;
            let unclaimed = flusher.conclude(flushed.map(drop).map_err(StoreError::from));
            refund_unclaimed(&jobs, unclaimed).await;
        }
    });
}

/// Queues a refund of each of `calls` to the committer; if it is gone, they stay `pending`
/// until recovery refunds them.
async fn refund_unclaimed(jobs: &mpsc::WeakSender<Job>, calls: Vec<CallId>) {
    if calls.is_empty() {
        return;
    }
    let Some(jobs) = jobs.upgrade() else {
        tracing::warn!(
            calls = calls.len(),
            "the committer is gone; unclaimed reservations are left for recovery"
        );
        return;
    };
    tracing::info!(
        calls = calls.len(),
        "refunding reservations whose callers never learned of them"
    );
    for call in calls {
        if jobs.send(Job::refund_unclaimed(call)).await.is_err() {
            return;
        }
    }
}
