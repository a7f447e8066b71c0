//! A batch written through sea-orm, with the same handful of set-based statements whatever its
//! size, inside one write transaction that the caller opens and commits:
//!
//! 1. lock the entries that its settles and refunds finish (`SELECT ... FOR UPDATE`, id order);
//! 2. read which of its callers' keys are still active: revocation is checked here, in the
//!    transaction that reserves, so a key answered from the key cache cannot spend once revoked;
//! 3. take ids for its reservations (`PostgreSQL`: from the sequence);
//! 4. lock the accounts that its reservations and refunds touch (id order, so two gateway
//!    instances never wait on each other in a cycle), as late as possible; then read again, under
//!    lock, the keys with a spending limit, whose allowance the batch changes (accounts before
//!    keys, in every transaction: a keyed reservation locks its account first too); and decide
//!    every write in queue order ([`Plan::decide`]);
//! 5. write: one `INSERT` for the new `pending` entries, one `UPDATE ... WHERE status =
//!    'pending'` for the finished ones, one `UPDATE` for the accounts' net changes, each
//!    checked to touch exactly the rows it must (and the `CHECK (bucket >= 0)` constraints
//!    behind the accounts' guard).
//!
//! Nothing here commits or rolls back. On an error the caller rolls the whole transaction back,
//! so no partial batch is ever written.

use std::collections::{BTreeMap, BTreeSet};

use chrono::{DateTime, Utc};
use sea_orm::sea_query::{CaseStatement, Expr, ExprTrait};
use sea_orm::{
    ColumnTrait, ConnectionTrait, DbBackend, EntityTrait, QueryFilter, QueryOrder, QuerySelect,
    Set, Statement,
};

use super::batch::{Entry, Finish, NewEntry, Plan, Reads, split};
use crate::credits::{Balance, Credits};
use crate::store::sea::alerting::{Alerting, limit_alert, threshold};
use crate::store::sea::entity::{account, api_key, call};
use crate::store::sea::held::Holds;
use crate::store::sea::rows::insert_event;
use crate::store::sea::rows::stored_allowance;
use crate::store::sea::writes::{AccountRead, KeyChange, KeyRead, Outcome, Wanted, Write};
use crate::store::{CallStatus, StoreError};

/// Applies `writes` in order inside `txn`; see the module documentation. What `holds` hold
/// (see [`crate::store::sea::held`]) counts as spent.
pub(in crate::store::sea) async fn apply_in<C: ConnectionTrait>(
    txn: &C,
    writes: &[&Write],
    holds: Option<&Holds>,
    alerting: Option<Alerting>,
) -> Result<Vec<Outcome>, StoreError> {
    let wanted = Wanted::of(writes, holds);
    let entries = lock_entries(txn, &wanted.entries).await?;
    let keys = read_keys(txn, &wanted.keys_with(&entries), alerting).await?;
    // Everything that does not need the accounts comes before their lock, which other gateway
    // instances charging the same account wait on. An id a refused reservation leaves unused
    // is a gap in the sequence, nothing more.
    let ids = new_ids(txn, wanted.reservations).await?;
    let accounts = lock_accounts(txn, wanted.accounts_with(&entries), alerting).await?;
    let keys = lock_limited_keys(txn, keys, alerting).await?;
    let reads = Reads {
        entries,
        accounts,
        keys,
        tell_shortfalls: alerting.is_some_and(|alerting| alerting.shortfalls),
    };
    let plan = Plan::decide(writes, reads, holds, false)?;
    let ids = insert_entries(txn, &plan.new_entries, ids, plan.now).await?;
    finish_entries(txn, &plan.finished).await?;
    write_accounts(txn, &plan.account_changes()).await?;
    write_keys(txn, &plan.key_changes()).await?;
    for event in &plan.events {
        insert_event(txn, event).await?;
    }
    Ok(plan.outcomes(&ids))
}

async fn lock_entries<C: ConnectionTrait>(
    txn: &C,
    ids: &BTreeSet<i64>,
) -> Result<BTreeMap<i64, Entry>, StoreError> {
    if ids.is_empty() {
        return Ok(BTreeMap::new());
    }
    type Row = (i64, i64, i64, String, i64, i64, DateTime<Utc>);
    let rows: Vec<Row> = call::Entity::find()
        .select_only()
        .columns([
            call::Column::Id,
            call::Column::AccountId,
            call::Column::KeyId,
            call::Column::Status,
            call::Column::ChargedSubscription,
            call::Column::ChargedTopup,
            call::Column::CreatedAt,
        ])
        .filter(call::Column::Id.is_in(ids.iter().copied()))
        .order_by_asc(call::Column::Id)
        .lock_exclusive()
        .into_tuple()
        .all(txn)
        .await?;
    Ok(rows
        .into_iter()
        .map(
            |(id, account, key, status, subscription, topup, reserved_at)| {
                let entry = Entry {
                    account,
                    key,
                    pending: status == CallStatus::Pending.as_str(),
                    taken: split(subscription, topup),
                    reserved_at,
                };
                (id, entry)
            },
        )
        .collect())
}

async fn lock_accounts<C: ConnectionTrait>(
    txn: &C,
    ids: BTreeSet<i64>,
    alerting: Option<Alerting>,
) -> Result<BTreeMap<i64, AccountRead>, StoreError> {
    if ids.is_empty() {
        return Ok(BTreeMap::new());
    }
    type Row = (i64, i64, i64, Option<DateTime<Utc>>, Option<i64>);
    let rows: Vec<Row> = account::Entity::find()
        .select_only()
        .columns([
            account::Column::Id,
            account::Column::SubscriptionCredits,
            account::Column::TopupCredits,
            account::Column::SubscriptionEndsAt,
            account::Column::LowBalanceCredits,
        ])
        .filter(account::Column::Id.is_in(ids))
        .order_by_asc(account::Column::Id)
        .lock_exclusive()
        .into_tuple()
        .all(txn)
        .await?;
    Ok(rows
        .into_iter()
        .map(
            |(id, subscription, topup, subscription_ends_at, low_balance)| {
                let balance = Balance {
                    subscription: Credits(subscription),
                    topup: Credits(topup),
                };
                let read = AccountRead {
                    balance,
                    subscription_ends_at,
                    alert_below: threshold(alerting, low_balance),
                };
                (id, read)
            },
        )
        .collect())
}

/// A key row's columns that a batch reads.
type KeyRow = (
    i64,
    Option<DateTime<Utc>>,
    Option<i64>,
    Option<String>,
    i64,
    i64,
    Option<i64>,
);

const KEY_COLUMNS: [api_key::Column; 7] = [
    api_key::Column::Id,
    api_key::Column::RevokedAt,
    api_key::Column::LimitCredits,
    api_key::Column::LimitPeriod,
    api_key::Column::LimitSpent,
    api_key::Column::LimitWindow,
    api_key::Column::LimitAlertedWindow,
];

fn key_read(row: KeyRow, alerting: Option<Alerting>) -> (i64, KeyRead) {
    let (id, revoked_at, credits, period, spent, window, told_in) = row;
    let read = KeyRead {
        active: revoked_at.is_none(),
        allowance: stored_allowance(credits, period.as_deref(), spent, window),
        limit_alert: limit_alert(alerting, told_in),
    };
    (id, read)
}

/// The batch's keys: whether each is active, and the allowance of those with a spending
/// limit (read again under lock by [`lock_limited_keys`]).
async fn read_keys<C: ConnectionTrait>(
    txn: &C,
    ids: &BTreeSet<i64>,
    alerting: Option<Alerting>,
) -> Result<BTreeMap<i64, KeyRead>, StoreError> {
    if ids.is_empty() {
        return Ok(BTreeMap::new());
    }
    let rows: Vec<KeyRow> = api_key::Entity::find()
        .select_only()
        .columns(KEY_COLUMNS)
        .filter(api_key::Column::Id.is_in(ids.iter().copied()))
        .into_tuple()
        .all(txn)
        .await?;
    Ok(rows
        .into_iter()
        .map(|row| key_read(row, alerting))
        .collect())
}

/// `keys` with the limited ones read again under an exclusive lock (id order), once their
/// accounts are locked: what they spent as the last writer left it. Every writer of a key's
/// allowance locks the key's account first, so this never waits in a cycle.
async fn lock_limited_keys<C: ConnectionTrait>(
    txn: &C,
    mut keys: BTreeMap<i64, KeyRead>,
    alerting: Option<Alerting>,
) -> Result<BTreeMap<i64, KeyRead>, StoreError> {
    let limited: Vec<i64> = (keys.iter())
        .filter(|(_, read)| read.allowance.is_some())
        .map(|(id, _)| *id)
        .collect();
    if limited.is_empty() {
        return Ok(keys);
    }
    let locked: Vec<KeyRow> = api_key::Entity::find()
        .select_only()
        .columns(KEY_COLUMNS)
        .filter(api_key::Column::Id.is_in(limited))
        .order_by_asc(api_key::Column::Id)
        .lock_exclusive()
        .into_tuple()
        .all(txn)
        .await?;
    keys.extend(locked.into_iter().map(|row| key_read(row, alerting)));
    Ok(keys)
}

/// Writes each limited key's spending as the batch leaves it, and the window its limit was
/// told in (the rows are locked).
async fn write_keys<C: ConnectionTrait>(txn: &C, changed: &[KeyChange]) -> Result<(), StoreError> {
    for change in changed {
        let mut update = api_key::Entity::update_many()
            .col_expr(api_key::Column::LimitSpent, Expr::value(change.spent))
            .col_expr(api_key::Column::LimitWindow, Expr::value(change.window));
        if let Some(window) = change.told_in {
            update = update.col_expr(api_key::Column::LimitAlertedWindow, Expr::value(window));
        }
        update
            .filter(api_key::Column::Id.eq(change.key))
            .exec(txn)
            .await?;
    }
    Ok(())
}

/// Inserts the new `pending` entries and returns their ids, in order.
async fn insert_entries<C: ConnectionTrait>(
    txn: &C,
    entries: &[NewEntry<'_>],
    ids: Option<Vec<i64>>,
    now: DateTime<Utc>,
) -> Result<Vec<i64>, StoreError> {
    if entries.is_empty() {
        return Ok(Vec::new());
    }
    let row = |entry: &NewEntry<'_>, id: Option<i64>| call::ActiveModel {
        id: id.map_or(sea_orm::NotSet, Set),
        account_id: Set(entry.account),
        key_id: Set(entry.charge.caller.key.0),
        protocol: Set(entry.charge.protocol.as_str().to_owned()),
        model: Set(entry.charge.model.clone()),
        requested_model: Set(entry.charge.requested_model.clone()),
        price: Set(entry.charge.price.0),
        charged_subscription: Set(entry.taken.subscription.0),
        charged_topup: Set(entry.taken.topup.0),
        status: Set(CallStatus::Pending.as_str().to_owned()),
        upstream_status: Set(None),
        upstream_channel: Set(None),
        upstream_error: Set(None),
        input_tokens: Set(None),
        output_tokens: Set(None),
        // Written when the call is settled.
        cache_read_tokens: sea_orm::NotSet,
        cache_write_tokens: sea_orm::NotSet,
        cache_write_1h_tokens: sea_orm::NotSet,
        reasoning_tokens: sea_orm::NotSet,
        shortfall: sea_orm::NotSet,
        usage_rejected: sea_orm::NotSet,
        created_at: Set(now),
        finished_at: Set(None),
        request_id: Set(entry.charge.request_id.clone()),
        instance_id: Set(entry.charge.instance.map(|lease| lease.0)),
        dropped_tools: Set(entry.charge.dropped_tools.clone()),
        upstream_protocol: sea_orm::NotSet,
        cost: sea_orm::NotSet,
        credit_value: sea_orm::NotSet,
        raw_usage: sea_orm::NotSet,
        usage_estimated: sea_orm::NotSet,
        service_tier: sea_orm::NotSet,
    };
    let Some(mut ids) = ids else {
        // No way to know a multi-row insert's ids here: one insert per entry.
        let mut ids = Vec::with_capacity(entries.len());
        for entry in entries {
            let inserted = call::Entity::insert(row(entry, None)).exec(txn).await?;
            ids.push(inserted.last_insert_id);
        }
        return Ok(ids);
    };
    if ids.len() < entries.len() {
        return Err(StoreError::msg("fewer ids than new entries"));
    }
    ids.truncate(entries.len());
    let rows = entries
        .iter()
        .zip(&ids)
        .map(|(entry, id)| row(entry, Some(*id)));
    let inserted = call::Entity::insert_many(rows)
        .exec_without_returning(txn)
        .await?;
    if inserted != entries.len() as u64 {
        return Err(StoreError::msg(format!(
            "inserted {inserted} of {} call-log entries",
            entries.len()
        )));
    }
    Ok(ids)
}

/// `count` ids for new entries, taken before they are inserted, where the database allows it:
/// `PostgreSQL` hands out sequence values (never reused, whoever else inserts); `SQLite` is read
/// under the write lock this transaction holds since `BEGIN IMMEDIATE`, so nobody else can
/// insert until it commits. `None` on `MySQL`, whose auto-increment values are not reserved
/// ahead.
async fn new_ids<C: ConnectionTrait>(
    txn: &C,
    count: usize,
) -> Result<Option<Vec<i64>>, StoreError> {
    if count == 0 {
        return Ok(Some(Vec::new()));
    }
    let count = i64::try_from(count).map_err(|_| StoreError::msg("batch too large"))?;
    let backend = txn.get_database_backend();
    Ok(Some(match backend {
        DbBackend::Postgres => {
            let sql = "SELECT nextval(pg_get_serial_sequence('mg_calls', 'id')) \
                       FROM generate_series(1, $1::bigint)";
            let rows = txn
                .query_all_raw(Statement::from_sql_and_values(backend, sql, [count.into()]))
                .await?;
            let ids = rows
                .iter()
                .map(|row| row.try_get_by_index::<i64>(0))
                .collect::<Result<Vec<_>, _>>()?;
            if ids.len() as i64 != count {
                return Err(StoreError::msg("the sequence gave too few ids"));
            }
            ids
        }
        DbBackend::Sqlite => {
            // With AUTOINCREMENT, `sqlite_sequence` remembers ids above today's largest.
            let sql = "SELECT MAX(top) FROM (SELECT MAX(id) AS top FROM mg_calls \
                       UNION ALL SELECT seq FROM sqlite_sequence WHERE name = 'mg_calls')";
            let row = txn
                .query_one_raw(Statement::from_string(backend, sql))
                .await?;
            let top: Option<i64> = match row {
                Some(row) => row.try_get_by_index(0)?,
                None => None,
            };
            let first = top.unwrap_or(0) + 1;
            (first..first + count).collect()
        }
        _ => return Ok(None),
    }))
}

/// The value a finished entry gets in one column, or `None` to keep what it has.
type FinishValue = fn(&Finish<'_>) -> Option<Expr>;

/// Finishes the settled and refunded entries with one `UPDATE`, each row's values chosen by
/// its id; guarded by `status = 'pending'` and checked to change every one of them.
async fn finish_entries<C: ConnectionTrait>(
    txn: &C,
    finished: &[(i64, Finish<'_>)],
) -> Result<(), StoreError> {
    if finished.is_empty() {
        return Ok(());
    }
    let now: DateTime<Utc> = Utc::now();
    let mut update = call::Entity::update_many()
        .col_expr(call::Column::FinishedAt, Expr::value(now))
        .filter(call::Column::Id.is_in(finished.iter().map(|(id, _)| *id)))
        .filter(call::Column::Status.eq(CallStatus::Pending.as_str()));
    let columns: [(call::Column, FinishValue); 21] = [
        (call::Column::Status, |finish| {
            Some(Expr::value(finish.status().as_str()))
        }),
        (call::Column::UpstreamStatus, |finish| {
            Some(Expr::value(finish.upstream_status()))
        }),
        (call::Column::UpstreamChannel, |finish| {
            finish
                .billed()
                .map(|success| Expr::value(success.channel.clone()))
        }),
        (call::Column::UpstreamProtocol, |finish| {
            finish.billed().map(|success| {
                Expr::value(success.upstream_protocol.map(|protocol| protocol.as_str()))
            })
        }),
        (call::Column::UpstreamError, |finish| {
            finish.error().map(|error| Expr::value(error.to_owned()))
        }),
        (call::Column::Cost, |finish| {
            finish
                .billed()
                .map(|success| Expr::value(success.economics_columns().0))
        }),
        (call::Column::CreditValue, |finish| {
            finish
                .billed()
                .map(|success| Expr::value(success.economics_columns().1))
        }),
        (call::Column::ServiceTier, |finish| {
            finish
                .billed()
                .map(|success| Expr::value(success.economics_columns().2))
        }),
        (call::Column::UsageEstimated, |finish| {
            finish
                .billed()
                .map(|success| Expr::value(success.usage.estimated))
        }),
        (call::Column::RawUsage, |finish| {
            finish
                .billed()
                .map(|success| Expr::value(success.raw_usage.clone()))
        }),
        (call::Column::InputTokens, |finish| {
            finish
                .billed()
                .map(|success| Expr::value(success.usage.input_tokens))
        }),
        (call::Column::OutputTokens, |finish| {
            finish
                .billed()
                .map(|success| Expr::value(success.usage.output_tokens))
        }),
        (call::Column::CacheReadTokens, |finish| {
            finish
                .billed()
                .map(|success| Expr::value(success.usage.cache_read_tokens))
        }),
        (call::Column::CacheWriteTokens, |finish| {
            finish
                .billed()
                .map(|success| Expr::value(success.usage.cache_write_tokens))
        }),
        (call::Column::CacheWrite1hTokens, |finish| {
            finish
                .billed()
                .map(|success| Expr::value(success.usage.cache_write_1h_tokens))
        }),
        (call::Column::ReasoningTokens, |finish| {
            finish
                .billed()
                .map(|success| Expr::value(success.usage.reasoning_tokens))
        }),
        // What a settle charged: its cost may differ from what the reservation took.
        (call::Column::ChargedSubscription, |finish| {
            finish
                .charged()
                .map(|(charged, _)| Expr::value(charged.subscription.0))
        }),
        (call::Column::ChargedTopup, |finish| {
            finish
                .charged()
                .map(|(charged, _)| Expr::value(charged.topup.0))
        }),
        // The entry's price is what it was charged (`charged_adds_up_to_price` holds).
        (call::Column::Price, |finish| {
            finish
                .charged()
                .map(|(charged, _)| Expr::value(charged.total().0))
        }),
        (call::Column::Shortfall, |finish| {
            finish
                .charged()
                .map(|(_, shortfall)| Expr::value(shortfall.0))
        }),
        // Written only where it is so: the column's default says the rest.
        (call::Column::UsageRejected, |finish| {
            finish
                .billed()
                .filter(|success| success.usage_rejected)
                .map(|_| Expr::value(true))
        }),
    ];
    for (column, value) in columns {
        let mut case = CaseStatement::new();
        let mut arms = 0;
        for (id, finish) in finished {
            if let Some(value) = value(finish) {
                case = case.case(call::Column::Id.eq(*id), value);
                arms += 1;
            }
        }
        if arms > 0 {
            update = update.col_expr(column, case.finally(Expr::col(column)).into());
        }
    }
    let changed = update.exec(txn).await?.rows_affected;
    if changed != finished.len() as u64 {
        // Unreachable while the row locks hold; refuse rather than guess.
        return Err(StoreError::msg(format!(
            "finished {changed} of {} locked pending entries; batch refused",
            finished.len()
        )));
    }
    Ok(())
}

/// Writes each locked account's net change with one `UPDATE`, guarded so that no bucket goes
/// negative; it must change every account it names, or the transaction is rolled back.
async fn write_accounts<C: ConnectionTrait>(
    txn: &C,
    changed: &[(i64, Balance)],
) -> Result<(), StoreError> {
    if changed.is_empty() {
        return Ok(());
    }
    let delta = |bucket: fn(&Balance) -> Credits| -> Expr {
        changed
            .iter()
            .fold(CaseStatement::new(), |case, (id, change)| {
                case.case(account::Column::Id.eq(*id), bucket(change).0)
            })
            .finally(0)
            .into()
    };
    let sub = Expr::col(account::Column::SubscriptionCredits).add(delta(|b| b.subscription));
    let top = Expr::col(account::Column::TopupCredits).add(delta(|b| b.topup));
    let written = account::Entity::update_many()
        .col_expr(account::Column::SubscriptionCredits, sub.clone())
        .col_expr(account::Column::TopupCredits, top.clone())
        .filter(account::Column::Id.is_in(changed.iter().map(|(id, _)| *id)))
        .filter(sub.gte(0))
        .filter(top.gte(0))
        .exec(txn)
        .await?
        .rows_affected;
    if written != changed.len() as u64 {
        // Unreachable while the row locks hold; refuse rather than over-spend.
        return Err(StoreError::msg(format!(
            "wrote {written} of {} locked accounts; batch refused",
            changed.len()
        )));
    }
    Ok(())
}
