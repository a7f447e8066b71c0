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

use chrono::{DateTime, Utc};
use rusqlite::{Connection, OpenFlags, OptionalExtension, Transaction, TransactionBehavior};

use super::batch::{Entry, Plan, Reads, split};
use super::flush::Flusher;
use super::jobs::{BatchWriter, Failure, SQLITE_BUSY_TIMEOUT};
use super::row_cache::RowCache;
pub(in crate::store::sea) use super::sqlite_writes::store_error;
use super::sqlite_writes::{
    finish_entries, insert_ended_holds, insert_entries, insert_events, insert_records,
    write_accounts, write_keys,
};
use crate::credits::{Balance, Credits};
use crate::store::rules::alerts::LimitAlert;
use crate::store::sea::alerting::{Alerting, limit_alert, threshold};
use crate::store::sea::held::{HoldChanges, Holds, IdBlock};
use crate::store::sea::rows::stored_allowance;
use crate::store::sea::writes::{
    AccountRead, KeyChange, KeyRead, Outcome, Unabandoned, Wanted, Write,
};
use crate::store::{CallId, CallStatus, StoreError};

/// Opens the committer's own connection to a database file the sea-orm pool has migrated, and
/// the WAL file that its flusher syncs.
pub(in crate::store::sea) fn open(file: &Path) -> Result<(Connection, File), StoreError> {
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
    let io = |error: std::io::Error| StoreError::Database(Box::new(error));
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

/// Call ids set aside at a time for held calls (see [`take_ids`]).
const ID_BLOCK: i64 = 4096;

/// Changes whenever another connection has committed to the file since the last call.
pub(in crate::store::sea) fn data_version(connection: &Connection) -> Result<i64, StoreError> {
    connection
        .prepare_cached("PRAGMA data_version")
        .and_then(|mut statement| statement.query_row([], |row| row.get(0)))
        .map_err(store_error)
}

/// The flusher's loop, on its own thread: until the committer is gone, take every batch
/// committed since the last flush, fsync the WAL, answer them.
pub(in crate::store::sea) fn flush(wal: File, mut flusher: Flusher) {
    while flusher.next_blocking() {
        let synced = wal
            .sync_data()
            .map_err(|error| StoreError::Database(Box::new(error)));
        // Reservations on a SQLite file are answered at commit, never here.
        let unclaimed = flusher.conclude(synced);
        debug_assert!(
            unclaimed.is_empty(),
            "a SQLite reservation waited for a flush"
        );
    }
}

/// A batch's outcomes, what it did to the holds, what it wrote to each account, and to each
/// limited key.
pub(in crate::store::sea) type Applied = (
    Vec<Outcome>,
    HoldChanges,
    Vec<(i64, Balance)>,
    Vec<KeyChange>,
);

/// The committer's own connection to a file that no store owns: every reservation is a row.
pub(in crate::store::sea) struct OwnConnection(pub(in crate::store::sea) Connection);

impl BatchWriter for OwnConnection {
    fn apply(
        &mut self,
        writes: &[&Write],
        alerting: Option<Alerting>,
    ) -> Result<Vec<Outcome>, Failure> {
        apply(&mut self.0, writes, alerting)
    }

    /// Rows all: refunded in the next batch.
    fn end_unclaimed(&mut self, unclaimed: Vec<CallId>) -> Vec<CallId> {
        unclaimed
    }
}

/// Applies a batch on a file that no store owns: nothing is held in memory. A settle whose
/// caller gave up on it while the batch waited for the file's write lock is left out: the batch
/// is rolled back and written again without it (see [`crate::store::SettleClaim`]).
pub(in crate::store::sea) fn apply(
    connection: &mut Connection,
    writes: &[&Write],
    alerting: Option<Alerting>,
) -> Result<Vec<Outcome>, Failure> {
    let mut tries = Unabandoned::new(writes);
    loop {
        let batch = tries.batch();
        let txn = connection
            .transaction_with_behavior(TransactionBehavior::Immediate)
            .map_err(|error| Failure::Statement(store_error(error)))?;
        // On an error (or a try to write again) the transaction is dropped, which rolls it back.
        let (outcomes, ..) = apply_in(&txn, &batch, None, alerting).map_err(Failure::Statement)?;
        if tries.claimed(&batch) {
            // A file's commit that fails wrote nothing: the claims go back.
            txn.commit().map_err(|error| {
                Unabandoned::release(&batch);
                Failure::Commit(store_error(error))
            })?;
            return Ok(tries.outcomes(outcomes));
        }
    }
}

pub(in crate::store::sea) fn apply_in(
    txn: &Transaction<'_>,
    writes: &[&Write],
    owned: Option<(&Holds, &mut RowCache)>,
    alerting: Option<Alerting>,
) -> Result<Applied, StoreError> {
    let (holds, mut rows) = owned.unzip();
    let wanted = Wanted::of(writes, holds);
    let entries = read_entries(txn, &wanted)?;
    let reads = Reads {
        accounts: read_accounts(txn, &wanted, &entries, rows.as_deref_mut(), alerting)?,
        keys: read_keys(txn, &wanted.keys_with(&entries), rows, alerting)?,
        entries,
        tell_shortfalls: alerting.is_some_and(|alerting| alerting.shortfalls),
    };
    let plan = Plan::decide(writes, reads, holds, true)?;
    let (ids, changes) = match holds {
        None => (
            insert_entries(txn, &plan.new_entries, plan.now)?,
            HoldChanges::default(),
        ),
        Some(holds) => {
            let (ids, block) = take_ids(txn, holds.ids(), plan.new_entries.len())?;
            let mut changes = plan.hold_changes(&ids, Utc::now());
            // A batch that took no ids leaves the block to the reservations held meanwhile.
            changes.ids = (!ids.is_empty()).then_some(block);
            (ids, changes)
        }
    };
    insert_ended_holds(txn, &plan.ended_holds)?;
    let mut changes = changes;
    changes.recorded = insert_records(txn, &plan.ended_holds)?;
    finish_entries(txn, &plan.finished)?;
    let account_changes = plan.account_changes();
    write_accounts(txn, &account_changes)?;
    let key_changes = plan.key_changes();
    write_keys(txn, &key_changes)?;
    insert_events(txn, &plan.events)?;
    Ok((plan.outcomes(&ids), changes, account_changes, key_changes))
}

/// Ids for `count` new held calls, from `block` while it lasts. A new block starts past the
/// table's id sequence, which is moved past the block's end, so that entries inserted by anyone
/// else (a keyed call, another process) never take an id handed out here.
fn take_ids(
    txn: &Transaction<'_>,
    mut block: IdBlock,
    count: usize,
) -> Result<(Vec<i64>, IdBlock), StoreError> {
    let count = i64::try_from(count).map_err(|_| StoreError::msg("batch too large"))?;
    if block.left() < count {
        let sequence: i64 = txn
            .prepare_cached("SELECT seq FROM sqlite_sequence WHERE name = 'mg_calls'")
            .and_then(|mut statement| statement.query_row([], |row| row.get(0)).optional())
            .map_err(store_error)?
            .unwrap_or(0);
        // What is left of the block is still ours if nobody has taken an id since.
        let start = if block.end > 0 && sequence == block.end - 1 {
            block.next
        } else {
            sequence + 1
        };
        let end = start + count.max(ID_BLOCK);
        let moved = txn
            .prepare_cached("UPDATE sqlite_sequence SET seq = ?1 WHERE name = 'mg_calls'")
            .and_then(|mut statement| statement.execute([end - 1]))
            .map_err(store_error)?;
        if moved == 0 {
            txn.prepare_cached("INSERT INTO sqlite_sequence (name, seq) VALUES ('mg_calls', ?1)")
                .and_then(|mut statement| statement.execute([end - 1]))
                .map_err(store_error)?;
        }
        block = IdBlock { next: start, end };
    }
    let ids = (block.next..block.next + count).collect();
    block.next += count;
    Ok((ids, block))
}

fn read_entries(
    txn: &Transaction<'_>,
    wanted: &Wanted,
) -> Result<BTreeMap<i64, Entry>, StoreError> {
    let mut statement = txn
        .prepare_cached(
            "SELECT account_id, status, charged_subscription, charged_topup, key_id, created_at \
             FROM mg_calls WHERE id = ?1",
        )
        .map_err(store_error)?;
    let mut entries = BTreeMap::new();
    for &id in &wanted.entries {
        let entry = statement
            .query_row([id], |row| {
                let reserved_at: String = row.get(5)?;
                let entry = Entry {
                    account: row.get(0)?,
                    key: row.get(4)?,
                    pending: row.get_ref(1)?.as_str()? == CallStatus::Pending.as_str(),
                    taken: split(row.get(2)?, row.get(3)?),
                    reserved_at: DateTime::<Utc>::UNIX_EPOCH,
                };
                Ok((entry, reserved_at))
            })
            .optional()
            .map_err(store_error)?;
        if let Some((mut entry, reserved_at)) = entry {
            entry.reserved_at = parse_timestamp(&reserved_at)?;
            entries.insert(id, entry);
        }
    }
    Ok(entries)
}

/// The accounts a batch needs, from `rows` where it has them (and into it where not).
fn read_accounts(
    txn: &Transaction<'_>,
    wanted: &Wanted,
    entries: &BTreeMap<i64, Entry>,
    mut rows: Option<&mut RowCache>,
    alerting: Option<Alerting>,
) -> Result<BTreeMap<i64, AccountRead>, StoreError> {
    let mut statement = txn
        .prepare_cached(
            "SELECT subscription_credits, topup_credits, subscription_ends_at, \
             low_balance_credits FROM mg_accounts WHERE id = ?1",
        )
        .map_err(store_error)?;
    let mut accounts = BTreeMap::new();
    for id in wanted.accounts_with(entries) {
        if let Some(&read) = rows.as_deref().and_then(|rows| rows.accounts.get(&id)) {
            accounts.insert(id, read);
            continue;
        }
        let read = statement
            .query_row([id], |row| {
                let balance = Balance {
                    subscription: Credits(row.get(0)?),
                    topup: Credits(row.get(1)?),
                };
                let low_balance: Option<i64> = row.get(3)?;
                Ok((balance, row.get::<_, Option<String>>(2)?, low_balance))
            })
            .optional()
            .map_err(store_error)?;
        if let Some((balance, ends_at, low_balance)) = read {
            let subscription_ends_at = ends_at.as_deref().map(parse_timestamp).transpose()?;
            let read = AccountRead {
                balance,
                subscription_ends_at,
                alert_below: threshold(alerting, low_balance),
            };
            if let Some(rows) = rows.as_deref_mut() {
                rows.accounts.insert(id, read);
            }
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

/// The batch's keys (whether each is active, and a limited key's allowance), from `rows`
/// where it knows them (and into it where not). Nobody else writes while this transaction
/// holds the file's write lock.
fn read_keys(
    txn: &Transaction<'_>,
    wanted: &BTreeSet<i64>,
    mut rows: Option<&mut RowCache>,
    alerting: Option<Alerting>,
) -> Result<BTreeMap<i64, KeyRead>, StoreError> {
    let mut statement = txn
        .prepare_cached(
            "SELECT revoked_at IS NULL, limit_credits, limit_period, limit_spent, limit_window, \
             limit_alerted_window FROM mg_api_keys WHERE id = ?1",
        )
        .map_err(store_error)?;
    let mut keys = BTreeMap::new();
    for &id in wanted {
        if let Some(&read) = rows.as_deref().and_then(|rows| rows.keys.get(&id)) {
            keys.insert(id, read);
            continue;
        }
        let read = statement
            .query_row([id], |row| {
                let period: Option<String> = row.get(2)?;
                Ok(KeyRead {
                    active: row.get(0)?,
                    allowance: stored_allowance(
                        row.get(1)?,
                        period.as_deref(),
                        row.get(3)?,
                        row.get(4)?,
                    ),
                    limit_alert: limit_alert(alerting, row.get(5)?),
                })
            })
            .optional()
            .map_err(store_error)?;
        // An unknown key is as good as revoked: the reservation is refused.
        let read = read.unwrap_or(KeyRead {
            active: false,
            allowance: None,
            limit_alert: LimitAlert::Off,
        });
        if let Some(rows) = rows.as_deref_mut() {
            rows.keys.insert(id, read);
        }
        keys.insert(id, read);
    }
    Ok(keys)
}
