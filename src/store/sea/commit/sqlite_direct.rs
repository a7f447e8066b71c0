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
use rusqlite::types::ToSql;
use rusqlite::{
    Connection, OpenFlags, OptionalExtension, Statement, Transaction, TransactionBehavior,
};

use super::batch::{EndedHold, Entry, Finish, NewEntry, Plan, Reads, split};
use super::flush::Flusher;
use super::jobs::{BatchWriter, Failure, SQLITE_BUSY_TIMEOUT};
use super::row_cache::RowCache;
use crate::credits::{Balance, Credits};
use crate::events::WebhookEvent;
use crate::store::records::DeliveryStatus;
use crate::store::rules::alerts::LimitAlert;
use crate::store::sea::alerting::{Alerting, limit_alert, threshold};
use crate::store::sea::held::{HoldChanges, Holds, IdBlock};
use crate::store::sea::rows::stored_allowance;
use crate::store::sea::writes::{
    AccountRead, KeyChange, KeyRead, Outcome, Unabandoned, Wanted, Write,
};
use crate::store::{AccountId, CallId, CallStatus, IdempotencyKey, StoreError};

pub(in crate::store::sea) fn store_error(error: rusqlite::Error) -> StoreError {
    StoreError::Database(Box::new(error))
}

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

/// Writes each limited key's spending as the batch leaves it, and the window its limit was
/// told in.
fn write_keys(txn: &Transaction<'_>, changes: &[KeyChange]) -> Result<(), StoreError> {
    if changes.is_empty() {
        return Ok(());
    }
    let mut statement = txn
        .prepare_cached(
            "UPDATE mg_api_keys SET limit_spent = ?2, limit_window = ?3, \
             limit_alerted_window = COALESCE(?4, limit_alerted_window) WHERE id = ?1",
        )
        .map_err(store_error)?;
    for change in changes {
        statement
            .execute((change.key, change.spent, change.window, change.told_in))
            .map_err(store_error)?;
    }
    Ok(())
}

/// Inserts the batch's events into the webhook outbox, pending and due at once, as
/// `rows::insert_event` does through sea-orm.
fn insert_events(txn: &Transaction<'_>, events: &[WebhookEvent]) -> Result<(), StoreError> {
    if events.is_empty() {
        return Ok(());
    }
    let mut statement = txn
        .prepare_cached(
            "INSERT INTO mg_webhook_events (event_id, event_type, body, status, attempts, \
             next_attempt_at, created_at) VALUES (?1, ?2, ?3, ?4, 0, ?5, ?5)",
        )
        .map_err(store_error)?;
    for event in events {
        let at = timestamp(event.created_at);
        statement
            .execute((
                &event.id,
                event.kind.as_str(),
                event.body(),
                DeliveryStatus::Pending.as_str(),
                &at,
            ))
            .map_err(store_error)?;
    }
    Ok(())
}

/// The text sea-orm (through sqlx) stores a timestamp as on `SQLite`, so that both write the
/// same thing and compare alike (recovery compares `created_at` with a cut-off).
fn timestamp(at: DateTime<Utc>) -> String {
    at.to_rfc3339_opts(SecondsFormat::AutoSi, false)
}

fn timestamp_now() -> String {
    timestamp(Utc::now())
}

/// Binds an entry's charge columns from parameter `first` on, in this order: `account_id,
/// key_id, protocol, model, price, charged_subscription, charged_topup, status, created_at,
/// request_id, instance_id, requested_model`. One place, so the statements that insert entries
/// agree.
fn bind_charge(
    statement: &mut Statement<'_>,
    first: usize,
    entry: &NewEntry<'_>,
    status: CallStatus,
    created_at: &str,
) -> rusqlite::Result<()> {
    let charge = entry.charge;
    let columns: [&dyn ToSql; CHARGE_COLUMNS] = [
        &entry.account,
        &charge.caller.key.0,
        &charge.protocol.as_str(),
        &charge.model,
        // What the entry holds or, settled, was charged (a reservation holds its price).
        &entry.taken.total().0,
        &entry.taken.subscription.0,
        &entry.taken.topup.0,
        &status.as_str(),
        &created_at,
        &charge.request_id,
        &charge.instance.map(|lease| lease.0),
        &charge.requested_model,
    ];
    bind_from(statement, first, &columns)
}

/// How many columns [`bind_charge`] binds.
const CHARGE_COLUMNS: usize = 12;

/// Binds how an entry ended from parameter `first` on, in this order: `upstream_status,
/// upstream_channel, upstream_error, input_tokens, output_tokens, cache_read_tokens,
/// cache_write_tokens, cache_write_1h_tokens, reasoning_tokens, shortfall, usage_rejected,
/// finished_at`. One
/// place, so finishing an entry in place and inserting an ended hold's entry agree.
fn bind_finish(
    statement: &mut Statement<'_>,
    first: usize,
    finish: &Finish<'_>,
    finished_at: &str,
) -> rusqlite::Result<()> {
    let usage = finish.billed().map(|success| success.usage);
    let shortfall = finish.charged().map_or(0, |(_, shortfall)| shortfall.0);
    let columns: [&dyn ToSql; FINISH_COLUMNS] = [
        &finish.upstream_status(),
        &finish
            .billed()
            .and_then(|success| success.channel.as_deref()),
        &finish.error(),
        &usage.and_then(|usage| usage.input_tokens),
        &usage.and_then(|usage| usage.output_tokens),
        &usage.and_then(|usage| usage.cache_read_tokens),
        &usage.and_then(|usage| usage.cache_write_tokens),
        &usage.and_then(|usage| usage.cache_write_1h_tokens),
        &usage.and_then(|usage| usage.reasoning_tokens),
        &shortfall,
        &finish
            .billed()
            .is_some_and(|success| success.usage_rejected),
        &finished_at,
    ];
    bind_from(statement, first, &columns)
}

/// How many columns [`bind_finish`] binds.
const FINISH_COLUMNS: usize = 12;

fn bind_from(
    statement: &mut Statement<'_>,
    first: usize,
    columns: &[&dyn ToSql],
) -> rusqlite::Result<()> {
    for (offset, column) in columns.iter().enumerate() {
        statement.raw_bind_parameter(first + offset, column)?;
    }
    Ok(())
}

/// Inserts the entries of the held calls that ended, finished, under the ids they were given.
fn insert_ended_holds(txn: &Transaction<'_>, ended: &[EndedHold<'_>]) -> Result<(), StoreError> {
    if ended.is_empty() {
        return Ok(());
    }
    let mut statement = txn
        .prepare_cached(
            "INSERT INTO mg_calls (id, account_id, key_id, protocol, model, price, \
             charged_subscription, charged_topup, status, created_at, request_id, instance_id, \
             requested_model, upstream_status, upstream_channel, upstream_error, input_tokens, \
             output_tokens, cache_read_tokens, cache_write_tokens, cache_write_1h_tokens, \
             reasoning_tokens, shortfall, usage_rejected, finished_at) \
             VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11, ?12, ?13, ?14, ?15, ?16, ?17, \
             ?18, ?19, ?20, ?21, ?22, ?23, ?24, ?25)",
        )
        .map_err(store_error)?;
    let now = timestamp_now();
    for EndedHold { call, held, finish } in ended {
        // A billed call's entry records what it was charged; the others', what they held.
        let entry = NewEntry {
            account: held.account.0,
            charge: &held.charge,
            taken: finish.charged().map_or(held.taken, |(charged, _)| charged),
        };
        statement.raw_bind_parameter(1, call).map_err(store_error)?;
        bind_charge(
            &mut statement,
            2,
            &entry,
            finish.status(),
            &timestamp(held.reserved_at),
        )
        .map_err(store_error)?;
        bind_finish(&mut statement, 2 + CHARGE_COLUMNS, finish, &now).map_err(store_error)?;
        statement.raw_execute().map_err(store_error)?;
    }
    Ok(())
}

/// Inserts the idempotency records of the held keyed calls that the batch ended, naming their
/// entries, with the reply kept for a billed one's retries, as `super::super::idempotent`
/// writes them through sea-orm; returns their accounts and keys. A keyed call held had no
/// record (see `crate::store::sea::owned::keyed`). One refunded gets its record too: its key is
/// free for a retry of the same request, and still refuses another request.
fn insert_records(
    txn: &Transaction<'_>,
    ended: &[EndedHold<'_>],
) -> Result<Vec<(AccountId, IdempotencyKey)>, StoreError> {
    let mut recorded = Vec::new();
    for EndedHold { call, held, finish } in ended {
        let Some(keyed) = &held.charge.keyed else {
            continue;
        };
        let mut statement = txn
            .prepare_cached(
                "INSERT INTO mg_idempotent_calls (account_id, idem_key, fingerprint, call_id, \
                 created_at, reply_status, reply_content_type, reply_body) \
                 VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8)",
            )
            .map_err(store_error)?;
        let reply = finish.billed().and_then(|billed| billed.reply.as_ref());
        statement
            .execute((
                held.account.0,
                keyed.key(),
                keyed.fingerprint(),
                call,
                timestamp(held.charge.at),
                reply.map(|reply| i32::from(reply.status)),
                reply.and_then(|reply| reply.content_type.as_deref()),
                reply.map(|reply| &reply.body[..]),
            ))
            .map_err(store_error)?;
        recorded.push((held.account, keyed.clone()));
    }
    Ok(recorded)
}

fn insert_entries(
    txn: &Transaction<'_>,
    entries: &[NewEntry<'_>],
    reserved_at: DateTime<Utc>,
) -> Result<Vec<i64>, StoreError> {
    let mut statement = txn
        .prepare_cached(
            "INSERT INTO mg_calls (account_id, key_id, protocol, model, price, \
             charged_subscription, charged_topup, status, created_at, request_id, instance_id, \
             requested_model) \
             VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11, ?12)",
        )
        .map_err(store_error)?;
    let now = timestamp(reserved_at);
    let mut ids = Vec::with_capacity(entries.len());
    for entry in entries {
        bind_charge(&mut statement, 1, entry, CallStatus::Pending, &now).map_err(store_error)?;
        statement.raw_execute().map_err(store_error)?;
        ids.push(txn.last_insert_rowid());
    }
    Ok(ids)
}

fn finish_entries(txn: &Transaction<'_>, finished: &[(i64, Finish<'_>)]) -> Result<(), StoreError> {
    let mut finish_entry = txn
        .prepare_cached(
            "UPDATE mg_calls SET status = ?2, upstream_status = ?3, \
             upstream_channel = COALESCE(?4, upstream_channel), \
             upstream_error = COALESCE(?5, upstream_error), \
             input_tokens = COALESCE(?6, input_tokens), \
             output_tokens = COALESCE(?7, output_tokens), \
             cache_read_tokens = COALESCE(?8, cache_read_tokens), \
             cache_write_tokens = COALESCE(?9, cache_write_tokens), \
             cache_write_1h_tokens = COALESCE(?10, cache_write_1h_tokens), \
             reasoning_tokens = COALESCE(?11, reasoning_tokens), shortfall = ?12, \
             usage_rejected = ?13, finished_at = ?14, \
             charged_subscription = COALESCE(?16, charged_subscription), \
             charged_topup = COALESCE(?17, charged_topup), \
             price = COALESCE(?16 + ?17, price) \
             WHERE id = ?1 AND status = ?15",
        )
        .map_err(store_error)?;
    let now = timestamp_now();
    let pending = CallStatus::Pending.as_str();
    for (id, finish) in finished {
        let bind = |statement: &mut Statement<'_>| {
            statement.raw_bind_parameter(1, id)?;
            statement.raw_bind_parameter(2, finish.status().as_str())?;
            bind_finish(statement, 3, finish, &now)?;
            statement.raw_bind_parameter(3 + FINISH_COLUMNS, pending)?;
            let charged = finish.charged().map(|(charged, _)| charged);
            statement.raw_bind_parameter(16, charged.map(|split| split.subscription.0))?;
            statement.raw_bind_parameter(17, charged.map(|split| split.topup.0))
        };
        bind(&mut finish_entry).map_err(store_error)?;
        let changed = finish_entry.raw_execute().map_err(store_error)?;
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
