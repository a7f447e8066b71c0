//! [`Batches`]: what a committer loop does with each batch, whichever way it writes it.

use std::collections::VecDeque;
use std::sync::Arc;
use std::sync::atomic::Ordering;

use tokio::sync::mpsc;

use super::flush::Durability;
use super::jobs::{Counters, Failure, Job};
use crate::store::sea::writes::{Outcome, Write};
use crate::store::{CallId, StoreError};

/// What a committer loop does with each batch, whichever way it writes it: counts it, and
/// answers its writes from the outcome. A batch of several rolled back by a failing statement
/// is not answered; its writes are queued to run again one by one, ahead of anything new.
pub(in crate::store::sea) struct Batches {
    current: Vec<Job>,
    alone: VecDeque<Job>,
    /// Refunds of reservations that landed for callers that were gone, for the next batch.
    unclaimed: Vec<Job>,
    max: usize,
    stats: Arc<Counters>,
    durability: Durability,
    /// When the current batch began to be written.
    started: std::time::Instant,
}

impl Batches {
    pub(in crate::store::sea) fn new(
        max: usize,
        stats: Arc<Counters>,
        durability: Durability,
    ) -> Batches {
        Batches {
            current: Vec::with_capacity(max),
            alone: VecDeque::new(),
            unclaimed: Vec::new(),
            max,
            stats,
            durability,
            started: std::time::Instant::now(),
        }
    }

    /// Whether a failed flush has stopped this committer: its batches must not be written.
    #[cfg(any(test, feature = "sqlite"))]
    pub(in crate::store::sea) fn halted(&self) -> bool {
        self.durability.halted()
    }

    /// Takes, as the next batch, a write waiting to run alone if there is one, or else the
    /// refunds of unclaimed reservations if there are any.
    pub(in crate::store::sea) fn next_alone(&mut self) -> bool {
        if let Some(job) = self.alone.pop_front() {
            self.current.push(job);
            return true;
        }
        if self.unclaimed.is_empty() {
            return false;
        }
        self.current.append(&mut self.unclaimed);
        true
    }

    /// Refunds `calls` in the next batch: reservations written to the database for callers
    /// that were gone when they landed (see [`Job::answer`]). Nobody else knows their ids, so
    /// nothing else would end them before recovery.
    pub(in crate::store::sea) fn refund_unclaimed(&mut self, calls: Vec<CallId>) {
        if !calls.is_empty() {
            tracing::info!(
                calls = calls.len(),
                "refunding reservations whose callers stopped waiting"
            );
        }
        (self.unclaimed).extend(calls.into_iter().map(Job::refund_unclaimed));
    }

    /// Receives the next batch on the runtime; `false` once every sender is gone.
    pub(in crate::store::sea) async fn next(&mut self, queue: &mut mpsc::Receiver<Job>) -> bool {
        self.next_alone() || queue.recv_many(&mut self.current, self.max).await > 0
    }

    /// Whether commits return before they are durable (the flusher makes them so).
    pub(in crate::store::sea) fn flushed_later(&self) -> bool {
        matches!(self.durability, Durability::Flushed { .. })
    }

    /// Receives the next batch on a thread outside the runtime; `false` once every sender is
    /// gone.
    #[cfg(feature = "sqlite")]
    pub(in crate::store::sea) fn next_blocking(&mut self, queue: &mut mpsc::Receiver<Job>) -> bool {
        self.next_alone() || queue.blocking_recv_many(&mut self.current, self.max) > 0
    }

    /// The current batch's writes, in queue order; the batch is being written from now.
    pub(in crate::store::sea) fn writes(&mut self) -> Vec<&Write> {
        self.started = std::time::Instant::now();
        self.current.iter().map(|job| &job.write).collect()
    }

    /// Answers the current batch from how its transaction ended. Returns the calls it reserved
    /// for callers that are gone (see [`Job::answer`]).
    pub(in crate::store::sea) fn conclude(
        &mut self,
        applied: Result<Vec<Outcome>, Failure>,
    ) -> Vec<CallId> {
        let stats = &self.stats;
        stats.transactions.fetch_add(1, Ordering::Relaxed);
        let size = self.current.len();
        stats.writes.fetch_add(size as u64, Ordering::Relaxed);
        crate::telemetry::ledger_batch(size, self.started.elapsed().as_secs_f64());
        match applied {
            Ok(outcomes) => {
                return self.durability.answer(self.current.drain(..).zip(outcomes));
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
        Vec::new()
    }
}

#[cfg(test)]
mod tests {
    //! The answering rule of [`crate::store::flush`], driven by hand: no flusher thread, no
    //! database, every step taken by the test.

    use super::*;
    use crate::credits::{Credits, Split};
    use crate::protocol::Protocol;
    use crate::store::sea::commit::flush::{FlushRules, Flusher};
    use crate::store::sea::commit::jobs::Reply;
    use crate::store::sea::writes::OwnedCharge;
    use crate::store::{AccountId, CallId, Caller, KeyId};
    use crate::store::{CallFailure, Reservation, ReserveError};
    use oneshot::error::TryRecvError;
    use tokio::sync::oneshot;

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
            requested_model: None,
            dropped_tools: None,
            price: Credits(1),
            request_id: None,
            at: chrono::Utc::now(),
            instance: None,
            keyed: None,
        };
        batches.current.push(Job {
            write: Write::Reserve(charge),
            reply: Reply::Reserve(reserve_to),
        });
        batches.current.push(Job {
            write: Write::Settle(CallId(call - 1), Box::default()),
            reply: Reply::Finish(settle_to),
        });
        let outcomes = vec![
            Outcome::Reserved(Ok(reservation(call))),
            Outcome::Finished(true),
        ];
        batches.conclude(Ok(outcomes));
        (reserved, settled)
    }

    fn flushed_committer(rules: FlushRules) -> (Batches, Flusher) {
        let stats = Arc::new(Counters::default());
        let (flusher, durability) = Flusher::new(stats.clone(), rules);
        (Batches::new(64, stats, durability), flusher)
    }

    #[test]
    fn on_sqlite_a_settle_waits_for_the_flush_and_a_reservation_does_not() {
        let (mut batches, mut flusher) = flushed_committer(FlushRules::SqliteFile);
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
        let (mut batches, mut flusher) = flushed_committer(FlushRules::Postgres);
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
        let (mut batches, mut flusher) = flushed_committer(FlushRules::Postgres);
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
        let (mut batches, mut flusher) = flushed_committer(FlushRules::SqliteFile);
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
    fn a_reservation_whose_caller_is_gone_is_handed_back_by_the_flush_to_be_refunded() {
        let (mut batches, mut flusher) = flushed_committer(FlushRules::Postgres);
        let (reserved, _settled) = commit_reserve_and_settle(&mut batches, 2);
        let (mut kept, _) = commit_reserve_and_settle(&mut batches, 4);
        drop(reserved);
        assert!(flusher.next_blocking());
        assert_eq!(flusher.conclude(Ok(())), [CallId(2)]);
        assert_eq!(kept.try_recv().unwrap().unwrap(), reservation(4));
    }

    #[test]
    fn a_failed_flush_on_postgres_hands_back_its_reservations_to_be_refunded() {
        let (mut batches, mut flusher) = flushed_committer(FlushRules::Postgres);
        let (mut reserved, _) = commit_reserve_and_settle(&mut batches, 2);
        assert!(flusher.next_blocking());
        // The caller is told the reservation failed, so nobody will end it but a refund;
        // the settle of call 1 is not a reservation and is not handed back.
        assert_eq!(
            flusher.conclude(Err(StoreError::msg("connection reset"))),
            [CallId(2)]
        );
        assert!(reserved.try_recv().unwrap().is_err());
    }

    #[test]
    fn a_failed_flush_on_postgres_fails_its_writes_but_not_later_ones() {
        let (mut batches, mut flusher) = flushed_committer(FlushRules::Postgres);
        let (mut reserved, mut settled) = commit_reserve_and_settle(&mut batches, 2);
        assert!(flusher.next_blocking());
        flusher.conclude(Err(StoreError::msg("connection reset")));
        assert!(reserved.try_recv().unwrap().is_err());
        assert!(settled.try_recv().unwrap().is_err());
        assert!(!batches.halted());
    }
}
