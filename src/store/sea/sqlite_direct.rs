//! A batch written to a `SQLite` file by calling `SQLite` directly, on the committer's own thread.
//!
//! Through sqlx, every statement is handed to a worker thread and its answer handed back; on
//! this workload those hand-offs (two thread wake-ups each), not `SQLite`, were where the time
//! went, and a batch needs several statements. Here the committer owns a connection to the same
//! file on a thread of its own (rusqlite, statements prepared once and kept), so a whole batch
//! runs without a hand-off: one wake-up to start it, one per answer.
//!
//! It is an ordinary `SQLite` connection: `BEGIN IMMEDIATE` takes the file's write lock as every
//! other writer does (the sea-orm pool for grants and keys, another process on the same file),
//! with the same WAL mode and busy time-out. Each statement works on one row; the decisions are
//! [`Plan::decide`]'s, as for every backend. Reads (balances, call log, audit, key lookups)
//! stay on the sea-orm pool.
//!
//! Its commits do not wait for the disk (`synchronous = NORMAL`: `SQLite` writes the WAL frames
//! but does not fsync them); a second thread, the flusher, fsyncs the WAL file and only then
//! are the batch's settles and refunds answered (see [`super::flush`]). That is what
//! `synchronous = FULL` does at each commit, moved off the write lock and shared by every batch
//! committed meanwhile. Checkpoints still sync the WAL before and the database file after, as
//! `SQLite` does in both modes, so a flushed batch stays durable when the WAL is reused.

use std::collections::{BTreeMap, BTreeSet};
use std::fs::File;
use std::path::Path;

use chrono::{DateTime, SecondsFormat, Utc};
use rusqlite::{Connection, OpenFlags, OptionalExtension, Transaction, TransactionBehavior};
use tokio::sync::mpsc;

use super::batch::{
    AccountRead, Entry, Finish, NewEntry, Outcome, Plan, Reads, Wanted, Write, split,
};
use super::batches::Batches;
use super::flush::Flusher;
use super::jobs::{Failure, Job, SQLITE_BUSY_TIMEOUT};
use crate::credits::{Balance, Credits};
use crate::store::{CallStatus, StoreError};

fn store_error(error: rusqlite::Error) -> StoreError {
    StoreError(Box::new(error))
}

/// Opens the committer's own connection to a database file the sea-orm pool has migrated, and
/// the WAL file that its flusher syncs.
pub(super) fn open(file: &Path) -> Result<(Connection, File), StoreError> {
    let flags = OpenFlags::SQLITE_OPEN_READ_WRITE | OpenFlags::SQLITE_OPEN_NO_MUTEX;
    let connection = Connection::open_with_flags(file, flags).map_err(store_error)?;
    connection
        .busy_timeout(SQLITE_BUSY_TIMEOUT)
        .map_err(store_error)?;
    // Durable at the flusher's fsync instead of at each commit; see the module docs.
    connection
        .pragma_update(None, "synchronous", "NORMAL")
        .map_err(store_error)?;
    connection
        .pragma_update(None, "foreign_keys", "ON")
        .map_err(store_error)?;
    let mode: String = connection
        .pragma_update_and_check(None, "journal_mode", "WAL", |row| row.get(0))
        .map_err(store_error)?;
    if !mode.eq_ignore_ascii_case("wal") {
        return Err(StoreError::msg(format!(
            "SQLite refused WAL mode (journal_mode is {mode})"
        )));
    }
    let wal = open_wal(&connection)?;
    Ok((connection, wal))
}

/// The database's WAL file, which `SQLite` keeps (same file, same inode) while any connection,
/// such as the committer's own, has the database open. Its directory entry is synced once here,
/// as `SQLite` does when it creates the file.
fn open_wal(connection: &Connection) -> Result<File, StoreError> {
    let database = connection
        .path()
        .filter(|path| !path.is_empty())
        .ok_or_else(|| StoreError::msg("the SQLite committer needs a database file"))?;
    let io = |error: std::io::Error| StoreError(Box::new(error));
    let wal = File::open(format!("{database}-wal")).map_err(io)?;
    wal.sync_all().map_err(io)?;
    if let Some(directory) = Path::new(database).parent() {
        let directory = if directory.as_os_str().is_empty() {
            Path::new(".")
        } else {
            directory
        };
        File::open(directory)
            .and_then(|d| d.sync_all())
            .map_err(io)?;
    }
    Ok(wal)
}

/// The committer's loop, on its own thread: until every sender is gone, take a batch, write it
/// in one transaction, answer it.
pub(super) fn run(
    mut connection: Connection,
    mut queue: mpsc::Receiver<Job>,
    mut batches: Batches,
) {
    while batches.next_blocking(&mut queue) {
        let applied = if batches.halted() {
            Err(Failure::Halted)
        } else {
            apply(&mut connection, &batches.writes())
        };
        batches.conclude(applied);
    }
}

/// The flusher's loop, on its own thread: until the committer is gone, take every batch
/// committed since the last flush, fsync the WAL, answer them.
pub(super) fn flush(wal: File, mut flusher: Flusher) {
    while flusher.next_blocking() {
        let synced = wal.sync_data().map_err(|error| StoreError(Box::new(error)));
        flusher.conclude(synced);
    }
}

fn apply(connection: &mut Connection, writes: &[&Write]) -> Result<Vec<Outcome>, Failure> {
    let txn = connection
        .transaction_with_behavior(TransactionBehavior::Immediate)
        .map_err(|error| Failure::Statement(store_error(error)))?;
    // On an error the transaction is dropped, which rolls it back.
    let outcomes = apply_in(&txn, writes).map_err(Failure::Statement)?;
    txn.commit()
        .map_err(|error| Failure::Commit(store_error(error)))?;
    Ok(outcomes)
}

fn apply_in(txn: &Transaction<'_>, writes: &[&Write]) -> Result<Vec<Outcome>, StoreError> {
    let wanted = Wanted::of(writes);
    let entries = read_entries(txn, &wanted)?;
    let reads = Reads {
        accounts: read_accounts(txn, &wanted, &entries)?,
        active_keys: active_keys(txn, &wanted)?,
        entries,
    };
    let plan = Plan::decide(writes, reads)?;
    let ids = insert_entries(txn, &plan.new_entries)?;
    finish_entries(txn, &plan.finished)?;
    write_accounts(txn, &plan.account_changes())?;
    Ok(plan.outcomes(&ids))
}

fn read_entries(
    txn: &Transaction<'_>,
    wanted: &Wanted,
) -> Result<BTreeMap<i64, Entry>, StoreError> {
    let mut statement = txn
        .prepare_cached(
            "SELECT account_id, status, charged_subscription, charged_topup \
             FROM mg_calls WHERE id = ?1",
        )
        .map_err(store_error)?;
    let mut entries = BTreeMap::new();
    for &id in &wanted.entries {
        let entry = statement
            .query_row([id], |row| {
                Ok(Entry {
                    account: row.get(0)?,
                    pending: row.get_ref(1)?.as_str()? == CallStatus::Pending.as_str(),
                    taken: split(row.get(2)?, row.get(3)?),
                })
            })
            .optional()
            .map_err(store_error)?;
        if let Some(entry) = entry {
            entries.insert(id, entry);
        }
    }
    Ok(entries)
}

fn read_accounts(
    txn: &Transaction<'_>,
    wanted: &Wanted,
    entries: &BTreeMap<i64, Entry>,
) -> Result<BTreeMap<i64, AccountRead>, StoreError> {
    let mut statement = txn
        .prepare_cached(
            "SELECT subscription_credits, topup_credits, subscription_ends_at \
             FROM mg_accounts WHERE id = ?1",
        )
        .map_err(store_error)?;
    let mut accounts = BTreeMap::new();
    for id in wanted.accounts_with(entries) {
        let read = statement
            .query_row([id], |row| {
                let balance = Balance {
                    subscription: Credits(row.get(0)?),
                    topup: Credits(row.get(1)?),
                };
                Ok((balance, row.get::<_, Option<String>>(2)?))
            })
            .optional()
            .map_err(store_error)?;
        if let Some((balance, ends_at)) = read {
            let subscription_ends_at = ends_at.as_deref().map(parse_timestamp).transpose()?;
            let read = AccountRead {
                balance,
                subscription_ends_at,
            };
            accounts.insert(id, read);
        }
    }
    Ok(accounts)
}

/// A timestamp as sea-orm (through sqlx) stores it on `SQLite`.
fn parse_timestamp(text: &str) -> Result<DateTime<Utc>, StoreError> {
    DateTime::parse_from_rfc3339(text)
        .or_else(|_| DateTime::parse_from_str(text, "%Y-%m-%d %H:%M:%S%.f%:z"))
        .map(|at| at.with_timezone(&Utc))
        .map_err(|error| StoreError::msg(format!("unreadable timestamp {text:?}: {error}")))
}

fn active_keys(txn: &Transaction<'_>, wanted: &Wanted) -> Result<BTreeSet<i64>, StoreError> {
    let mut statement = txn
        .prepare_cached("SELECT 1 FROM mg_api_keys WHERE id = ?1 AND revoked_at IS NULL")
        .map_err(store_error)?;
    let mut active = BTreeSet::new();
    for &id in &wanted.keys {
        if statement.exists([id]).map_err(store_error)? {
            active.insert(id);
        }
    }
    Ok(active)
}

/// The text sea-orm (through sqlx) stores a timestamp as on `SQLite`, so that both write the
/// same thing and compare alike (recovery compares `created_at` with a cut-off).
fn timestamp_now() -> String {
    Utc::now().to_rfc3339_opts(SecondsFormat::AutoSi, false)
}

fn insert_entries(txn: &Transaction<'_>, entries: &[NewEntry<'_>]) -> Result<Vec<i64>, StoreError> {
    let mut statement = txn
        .prepare_cached(
            "INSERT INTO mg_calls (account_id, key_id, protocol, model, price, \
             charged_subscription, charged_topup, status, created_at, request_id, instance_id) \
             VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11)",
        )
        .map_err(store_error)?;
    let now = timestamp_now();
    let mut ids = Vec::with_capacity(entries.len());
    for entry in entries {
        let charge = entry.charge;
        statement
            .execute(rusqlite::params![
                entry.account,
                charge.caller.key.0,
                charge.protocol.as_str(),
                charge.model,
                charge.price.0,
                entry.taken.subscription.0,
                entry.taken.topup.0,
                CallStatus::Pending.as_str(),
                now,
                charge.request_id,
                charge.instance,
            ])
            .map_err(store_error)?;
        ids.push(txn.last_insert_rowid());
    }
    Ok(ids)
}

fn finish_entries(txn: &Transaction<'_>, finished: &[(i64, Finish<'_>)]) -> Result<(), StoreError> {
    let mut settle = txn
        .prepare_cached(
            "UPDATE mg_calls SET status = ?2, upstream_status = ?3, upstream_channel = ?4, \
             input_tokens = ?5, output_tokens = ?6, finished_at = ?7 \
             WHERE id = ?1 AND status = ?8",
        )
        .map_err(store_error)?;
    let mut refund = txn
        .prepare_cached(
            "UPDATE mg_calls SET status = ?2, upstream_status = ?3, upstream_error = ?4, \
             finished_at = ?5 WHERE id = ?1 AND status = ?6",
        )
        .map_err(store_error)?;
    let now = timestamp_now();
    let pending = CallStatus::Pending.as_str();
    for (id, finish) in finished {
        let changed = match finish {
            Finish::Settled(success) => settle.execute(rusqlite::params![
                id,
                CallStatus::Ok.as_str(),
                success.upstream_status,
                success.channel,
                success.usage.input_tokens,
                success.usage.output_tokens,
                now,
                pending,
            ]),
            Finish::Refunded(failure) => refund.execute(rusqlite::params![
                id,
                CallStatus::Refunded.as_str(),
                failure.upstream_status,
                failure.error,
                now,
                pending,
            ]),
        }
        .map_err(store_error)?;
        if changed != 1 {
            // Unreachable while the write lock holds; refuse rather than guess.
            return Err(StoreError::msg(format!(
                "entry {id} was not pending when finished; batch refused"
            )));
        }
    }
    Ok(())
}

fn write_accounts(txn: &Transaction<'_>, changes: &[(i64, Balance)]) -> Result<(), StoreError> {
    let mut statement = txn
        .prepare_cached(
            "UPDATE mg_accounts SET subscription_credits = subscription_credits + ?2, \
             topup_credits = topup_credits + ?3 \
             WHERE id = ?1 AND subscription_credits + ?2 >= 0 AND topup_credits + ?3 >= 0",
        )
        .map_err(store_error)?;
    for (id, change) in changes {
        let written = statement
            .execute([*id, change.subscription.0, change.topup.0])
            .map_err(store_error)?;
        if written != 1 {
            // Unreachable while the write lock holds; refuse rather than over-spend.
            return Err(StoreError::msg(format!(
                "account {id} could not take its change; batch refused"
            )));
        }
    }
    Ok(())
}
