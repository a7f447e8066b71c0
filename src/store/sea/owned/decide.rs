//! The owned file's batches and reservations decided at once, on the committer's thread and
//! the callers' tasks (see `super`): a batch applied beside the holds, and a reservation held
//! without one where the rows the committer last read still hold.

use std::sync::Arc;

use rusqlite::{Connection, TransactionBehavior};

use super::state::{SharedHolds, State};
use crate::credits::{Balance, Credits};
use crate::store::rules::alerts;
use crate::store::rules::reserve::{Limited, Payer, decide_reserve};
use crate::store::sea::alerting::Alerting;
use crate::store::sea::commit::jobs::{BatchWriter, Failure, Job, Kept, Reply};
use crate::store::sea::commit::row_cache::RowCache;
use crate::store::sea::commit::sqlite_direct::{apply_in, data_version, store_error};
use crate::store::sea::held::HoldChanges;
use crate::store::sea::writes::{
    KeyChange, KeyRead, Outcome, OwnedCharge, Unabandoned, Wanted, Write,
};
use crate::store::{CallId, Reservation, ReserveError, StoreError};

/// Puts a new committer's connection beside the holds, before its thread starts, so that
/// reservations can be decided at once from the first batch on. The rows cached are
/// forgotten: they were read through another connection, whose `PRAGMA data_version` counts
/// apart from this one's. Returns the committer's writer.
pub(in crate::store::sea) fn install(shared: &Arc<SharedHolds>, connection: Connection) -> Holding {
    let mut state = shared.lock();
    state.connection = Some(connection);
    state.rows.clear();
    Holding(shared.clone())
}

/// The committer's writer on an owned file: its connection kept beside the holds (see
/// [`install`]), each batch applied with [`apply_holding`].
pub(in crate::store::sea) struct Holding(Arc<SharedHolds>);

impl BatchWriter for Holding {
    fn apply(
        &mut self,
        writes: &[&Write],
        alerting: Option<Alerting>,
    ) -> Result<Vec<Outcome>, Failure> {
        apply_holding(writes, &self.0, alerting)
    }

    /// Held for callers that are gone: no guard will end them, and they moved nothing.
    fn end_unclaimed(&mut self, ended: Vec<CallId>) -> Vec<CallId> {
        self.0.lock().holds.apply(HoldChanges {
            ended,
            ..HoldChanges::default()
        });
        Vec::new()
    }
}

/// Applies a batch beside the holds. The state is locked only in memory: to lend the batch
/// the connection and copies of the holds and rows it needs, to say that it is writing, and
/// to take its changes once it has committed. Reservations go on being decided at once
/// meanwhile, except while the batch decides reservations or refunds itself (see
/// [`State::queued`]) or is taking or giving up the write lock (they wait, and are served
/// once it has read the version under the lock or given the connection back: see
/// [`State::waiting`]); the [`SharedHolds`] gate keeps [`Frozen`](super::Frozen) readers out.
pub(in crate::store::sea) fn apply_holding(
    writes: &[&Write],
    shared: &SharedHolds,
    alerting: Option<Alerting>,
) -> Result<Vec<Outcome>, Failure> {
    let _gate = shared.gate_blocking();
    let mut lent = Lent {
        shared,
        connection: shared.lock().connection.take(),
        given_back: false,
    };
    let Some(connection) = lent.connection.as_mut() else {
        return Err(Failure::Statement(StoreError::msg(
            "the committer's connection is gone",
        )));
    };
    let applied = write_beside_holds(connection, writes, shared, alerting);
    let version = data_version(connection).ok();
    // A batch rolled back whose writes will run again alone is not over: its reservations
    // and refunds still hold others back.
    let over = !matches!(applied, Err(Failure::Statement(_))) || writes.len() == 1;
    let mut state = shared.lock();
    if over {
        let taken = (writes.iter())
            .filter(|write| write.holds_back_reservations())
            .count();
        state.queued = state.queued.saturating_sub(taken);
        // In the same step as the batch's holds are taken (below): a keyed reservation's key
        // goes from queued to held, or is free again.
        state.keyed_decided(writes);
    }
    let outcomes = match applied {
        Ok(Written {
            outcomes,
            holds,
            rows,
            accounts,
            keys,
        }) => {
            let mut holds = holds;
            let recorded = std::mem::take(&mut holds.recorded);
            state.holds.apply(holds);
            // In the same step as the calls' holds end: their keys go from running to recorded.
            if let Some(records) = state.records.as_mut() {
                for (account, key) in &recorded {
                    records.add(*account, key.key());
                }
            }
            state.rows.merge(rows);
            state.rows.apply(&accounts);
            state.rows.apply_keys(&keys);
            // Another connection may have committed since this batch did.
            match version {
                Some(version) => {
                    state.rows.check(version);
                }
                None => state.rows.clear(),
            }
            Ok(outcomes)
        }
        Err(failure) => {
            state.rows.clear();
            Err(failure)
        }
    };
    lent.give_back(&mut state);
    outcomes
}

/// The committer's connection, lent to a batch: back beside the holds when given back or
/// dropped, however the batch ended, and the writes that waited for it served.
struct Lent<'a> {
    shared: &'a SharedHolds,
    connection: Option<Connection>,
    given_back: bool,
}

impl Lent<'_> {
    /// Gives the connection back and serves the writes that waited for it.
    fn give_back(&mut self, state: &mut State) {
        self.given_back = true;
        state.writing = None;
        if let Some(connection) = self.connection.take() {
            if state.connection.is_some() {
                // A new committer installed its own meanwhile (`with_max_batch`): keep that
                // one, and none of the rows read through this one.
                state.rows.clear();
            } else {
                state.connection = Some(connection);
            }
        }
        serve_waiting(state);
    }
}

impl Drop for Lent<'_> {
    fn drop(&mut self) {
        if !self.given_back {
            let mut state = self.shared.lock();
            self.give_back(&mut state);
        }
    }
}

/// What a batch written beside the holds did: its outcomes, its changes to the holds, the rows
/// it read and what it wrote to each account.
struct Written {
    outcomes: Vec<Outcome>,
    holds: HoldChanges,
    rows: RowCache,
    accounts: Vec<(i64, Balance)>,
    keys: Vec<KeyChange>,
}

/// Writes the batch in one transaction under the file's write lock. A settle whose caller gave
/// up on it while the batch waited for the lock (another process writing, a slow disk) is left
/// out: the try is rolled back and the batch written again without it (see
/// [`crate::store::SettleClaim`]); its hold stays until the refund its caller queued ends it.
fn write_beside_holds(
    connection: &mut Connection,
    writes: &[&Write],
    shared: &SharedHolds,
    alerting: Option<Alerting>,
) -> Result<Written, Failure> {
    let statement = Failure::Statement;
    let mut tries = Unabandoned::new(writes);
    loop {
        let batch = tries.batch();
        let txn = connection
            .transaction_with_behavior(TransactionBehavior::Immediate)
            .map_err(|error| statement(store_error(error)))?;
        // Under the write lock: nobody else commits until this batch does.
        let version = data_version(&txn).map_err(statement)?;
        let (holds, mut rows) = {
            let mut state = shared.lock();
            state.rows.check(version);
            state.writing = Some(version);
            serve_waiting(&mut state);
            let holds = state.holds.for_batch(&batch);
            let rows = state.rows.part(&Wanted::of(&batch, Some(&holds)));
            (holds, rows)
        };
        // On an error (or a try to write again) the transaction is dropped, which rolls it
        // back.
        let written = apply_in(&txn, &batch, Some((&holds, &mut rows)), alerting);
        // From its commit (or its rollback) on, another connection may commit too:
        // reservations must ask the file.
        shared.lock().writing = None;
        let (outcomes, holds, accounts, keys) = written.map_err(statement)?;
        if !tries.claimed(&batch) {
            continue;
        }
        // A file's commit that fails wrote nothing: the claims go back.
        txn.commit().map_err(|error| {
            Unabandoned::release(&batch);
            Failure::Commit(store_error(error))
        })?;
        return Ok(Written {
            outcomes: tries.outcomes(outcomes),
            holds,
            rows,
            accounts,
            keys,
        });
    }
}

/// Reserves `charge` at once, from the rows the committer last read, if they are still what
/// the file holds (no other connection has committed since) and hold the caller's account and
/// key, and nothing waiting, queued or frozen must be decided first; `None` queues it
/// ([`State::queue`]). On the caller's task, with the state locked.
///
/// Whether another connection has committed is asked of the committer's connection between
/// batches; while a batch holds the file's write lock nobody else can commit, so the version
/// the batch read stands ([`State::writing`]). For the moment a batch takes or gives up the
/// lock, nobody can tell: the reservation waits, in order, until the committer can
/// ([`State::waiting`]).
pub(super) fn reserve_now(
    state: &mut State,
    charge: &OwnedCharge,
) -> Option<Result<Reservation, ReserveError>> {
    if !state.waiting.is_empty() {
        return None;
    }
    reserve_in_turn(state, charge)
}

/// [`reserve_now`] for a reservation whose turn it is: nothing waits before it.
fn reserve_in_turn(
    state: &mut State,
    charge: &OwnedCharge,
) -> Option<Result<Reservation, ReserveError>> {
    let version = version_for_now(state)?;
    decide_now(state, version, charge)
}

/// The file's version, for a reservation that may be decided at once: `None` while anything
/// queued or frozen must be decided first, or while nobody can tell (see [`reserve_now`]).
fn version_for_now(state: &State) -> Option<i64> {
    if state.queued > 0 || state.frozen > 0 {
        return None;
    }
    match (&state.connection, state.writing) {
        (Some(connection), _) => data_version(connection).ok(),
        (None, writing) => writing,
    }
}

/// Serves the reservations that waited while a batch took or gave up the write lock
/// ([`State::waiting`]), in the order they arrived, now that the committer can tell the file's
/// version again: each is decided at once if it could be were it arriving now; the first that
/// cannot, and every one after it, go to the committer. One whose caller has gone (its future
/// was dropped: the client went away) is dropped too, so that it holds nothing that no guard
/// would ever end.
fn serve_waiting(state: &mut State) {
    if state.waiting.is_empty() {
        return;
    }
    // Read once for all of them: each arrived before this read, so whatever another
    // connection committed before it began is seen, as a reservation decided on arrival
    // would see it.
    let version = version_for_now(state);
    while let Some(Kept { job, room }) = state.waiting.pop_front() {
        let job = match job {
            Job {
                write: Write::Reserve(charge),
                reply: Reply::Reserve(answer),
            } if answer.is_closed() => {
                state.keyed_unqueued(&charge);
                continue;
            }
            Job {
                write: Write::Reserve(charge),
                reply: Reply::Reserve(answer),
            } => match version
                .filter(|_| state.queued == 0)
                .and_then(|version| decide_now(state, version, &charge))
            {
                Some(reserved) => {
                    // Held or refused: a keyed one's key is the hold's now, or free.
                    state.keyed_unqueued(&charge);
                    // As with a batch's answers (`Job::answer`), a caller that stopped waiting
                    // is not an error here.
                    let _ = answer.send(reserved);
                    continue;
                }
                None => Job {
                    write: Write::Reserve(charge),
                    reply: Reply::Reserve(answer),
                },
            },
            job => job,
        };
        state.send(Kept { job, room });
    }
}

fn decide_now(
    state: &mut State,
    version: i64,
    charge: &OwnedCharge,
) -> Option<Result<Reservation, ReserveError>> {
    if !state.rows.check(version) {
        return None;
    }
    // A key or an account not in the cached rows is decided by a batch, which reads them.
    let key = *state.rows.keys.get(&charge.caller.key.0)?;
    let key_active = key.active;
    let now = chrono::Utc::now();
    let limited = key.allowance.map(|allowance| Limited {
        allowance,
        // Calls of a window that has ended count in theirs, not in this one.
        held: (state.holds).on_key_in(charge.caller.key, allowance.limit.period, now),
        at: now,
    });
    let account = charge.caller.account;
    let row = if key_active {
        Some(*state.rows.accounts.get(&account.0)?)
    } else {
        None
    };
    let payer = row.map(|row| Payer {
        balance: row.balance,
        held: state.holds.on(account),
        subscription_ends_at: row.subscription_ends_at,
    });
    let taken = match decide_reserve(key_active, limited, payer, charge.at, charge.price) {
        Ok(taken) => taken,
        Err(refusal) => return Some(Err(refusal.into_error(account))),
    };
    let alert_below = row.and_then(|row| row.alert_below);
    if told(alert_below, payer, limited, key, charge) {
        // Its batch writes the event in the transaction that records the call.
        return None;
    }
    let call = state.holds.hold(account, charge, taken)?;
    Some(Ok(Reservation {
        call,
        account,
        taken,
    }))
}

/// Whether holding `charge` would be told (its account's balance falling below its threshold,
/// its key's limit reached): then its batch holds it, and writes the event with it.
fn told(
    alert_below: Option<Credits>,
    payer: Option<Payer>,
    limited: Option<Limited>,
    key: KeyRead,
    charge: &OwnedCharge,
) -> bool {
    let low = payer.is_some_and(|payer| {
        let before = payer.free(charge.at).total();
        let after = Credits(before.get() - charge.price.get());
        alerts::falls_below(alert_below, before, after)
    });
    let limit = limited.is_some_and(|limited| {
        let held = Credits(limited.held.get() + charge.price.get());
        key.limit_alert
            .due(&limited.allowance, held, charge.price, limited.at)
    });
    low || limit
}
