//! The statements a batch writes to a `SQLite` file with (see `super::sqlite_direct`): entries
//! inserted and finished, held calls' entries and records, account rows, limited keys, the
//! webhook outbox, each column bound in one place so that every statement agrees.

use chrono::{DateTime, SecondsFormat, Utc};
use rusqlite::types::ToSql;
use rusqlite::{Statement, Transaction};

use super::batch::{EndedHold, Finish, NewEntry};
use crate::credits::Balance;
use crate::events::WebhookEvent;
use crate::protocol::Protocol;
use crate::store::records::DeliveryStatus;
use crate::store::sea::writes::KeyChange;
use crate::store::{AccountId, CallStatus, CallSuccess, IdempotencyKey, StoreError};

/// A `SQLite` error as the store reports it.
pub(in crate::store::sea) fn store_error(error: rusqlite::Error) -> StoreError {
    StoreError::Database(Box::new(error))
}

/// Writes each limited key's spending as the batch leaves it, and the window its limit was
/// told in.
pub(super) fn write_keys(txn: &Transaction<'_>, changes: &[KeyChange]) -> Result<(), StoreError> {
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
pub(super) fn insert_events(
    txn: &Transaction<'_>,
    events: &[WebhookEvent],
) -> Result<(), StoreError> {
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
pub(super) fn timestamp(at: DateTime<Utc>) -> String {
    at.to_rfc3339_opts(SecondsFormat::AutoSi, false)
}

pub(super) fn timestamp_now() -> String {
    timestamp(Utc::now())
}

/// Binds an entry's charge columns from parameter `first` on, in this order: `account_id,
/// key_id, protocol, model, price, charged_subscription, charged_topup, status, created_at,
/// request_id, instance_id, requested_model, dropped_tools`. One place, so the statements that
/// insert entries agree.
pub(super) fn bind_charge(
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
        &charge.dropped_tools,
    ];
    bind_from(statement, first, &columns)
}

/// How many columns [`bind_charge`] binds.
pub(super) const CHARGE_COLUMNS: usize = 13;

/// Binds how an entry ended from parameter `first` on, in this order: `upstream_status,
/// upstream_channel, upstream_error, input_tokens, output_tokens, cache_read_tokens,
/// cache_write_tokens, cache_write_1h_tokens, reasoning_tokens, shortfall, usage_rejected,
/// finished_at, upstream_protocol, cost, credit_value, raw_usage, usage_estimated, service_tier`.
/// One place, so finishing an entry in place and inserting an ended hold's entry agree.
pub(super) fn bind_finish(
    statement: &mut Statement<'_>,
    first: usize,
    finish: &Finish<'_>,
    finished_at: &str,
) -> rusqlite::Result<()> {
    let usage = finish.billed().map(|success| success.usage);
    let shortfall = finish.charged().map_or(0, |(_, shortfall)| shortfall.0);
    let (cost, credit_value, tier, estimated) = finish
        .billed()
        .map_or((None, None, None, false), CallSuccess::economics_columns);
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
        &finish
            .billed()
            .and_then(|success| success.upstream_protocol)
            .map(Protocol::as_str),
        &cost,
        &credit_value,
        &finish
            .billed()
            .and_then(|success| success.raw_usage.as_deref()),
        &estimated,
        &tier,
    ];
    bind_from(statement, first, &columns)
}

/// How many columns [`bind_finish`] binds.
pub(super) const FINISH_COLUMNS: usize = 18;

pub(super) fn bind_from(
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
pub(super) fn insert_ended_holds(
    txn: &Transaction<'_>,
    ended: &[EndedHold<'_>],
) -> Result<(), StoreError> {
    if ended.is_empty() {
        return Ok(());
    }
    let mut statement = txn
        .prepare_cached(
            "INSERT INTO mg_calls (id, account_id, key_id, protocol, model, price, \
             charged_subscription, charged_topup, status, created_at, request_id, instance_id, \
             requested_model, dropped_tools, upstream_status, upstream_channel, upstream_error, \
             input_tokens, output_tokens, cache_read_tokens, cache_write_tokens, \
             cache_write_1h_tokens, reasoning_tokens, shortfall, usage_rejected, finished_at, \
             upstream_protocol, cost, credit_value, raw_usage, usage_estimated, service_tier) \
             VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11, ?12, ?13, ?14, ?15, ?16, ?17, \
             ?18, ?19, ?20, ?21, ?22, ?23, ?24, ?25, ?26, ?27, ?28, ?29, ?30, ?31, ?32)",
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
pub(super) fn insert_records(
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

pub(super) fn insert_entries(
    txn: &Transaction<'_>,
    entries: &[NewEntry<'_>],
    reserved_at: DateTime<Utc>,
) -> Result<Vec<i64>, StoreError> {
    let mut statement = txn
        .prepare_cached(
            "INSERT INTO mg_calls (account_id, key_id, protocol, model, price, \
             charged_subscription, charged_topup, status, created_at, request_id, instance_id, \
             requested_model, dropped_tools) \
             VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11, ?12, ?13)",
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

pub(super) fn finish_entries(
    txn: &Transaction<'_>,
    finished: &[(i64, Finish<'_>)],
) -> Result<(), StoreError> {
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
             upstream_protocol = COALESCE(?15, upstream_protocol), \
             cost = ?16, credit_value = ?17, raw_usage = ?18, usage_estimated = ?19, \
             service_tier = ?20, \
             charged_subscription = COALESCE(?22, charged_subscription), \
             charged_topup = COALESCE(?23, charged_topup), \
             price = COALESCE(?22 + ?23, price) \
             WHERE id = ?1 AND status = ?21",
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
            statement.raw_bind_parameter(
                4 + FINISH_COLUMNS,
                charged.map(|split| split.subscription.0),
            )?;
            statement.raw_bind_parameter(5 + FINISH_COLUMNS, charged.map(|split| split.topup.0))
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

pub(super) fn write_accounts(
    txn: &Transaction<'_>,
    changes: &[(i64, Balance)],
) -> Result<(), StoreError> {
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
