//! Calls with an idempotency key, on the sea-orm backend: their reservations and settles leave
//! the group commit for one transaction each of their own, on the pool, so that the key's
//! record is read and written in the very transaction that moves the money (the rule is
//! `store::rules::idempotency`'s).
//!
//! - **reserve**: lock the account (as a batch does), check the key is active, read the key's
//!   record and the status of its call (no row lock: see `record`), decide; then reserve through the same statements as a
//!   batch of one ([`ledger_ops::apply_in`]) and insert or repoint the record. Every keyed
//!   reservation of an account waits on that account's lock, on every gateway sharing the
//!   database, so concurrent calls with one key make one reservation.
//! - **settle**: the guarded flip to `ok`, and the reply written into the record, in one
//!   transaction: a billed call's reply is kept exactly when the call is `ok`.
//!
//! Refunds stay in the group commit: a refunded call's record needs no change (its key is free
//! again because the call is `refunded`). Calls without a key never come here, so the charging
//! path is unchanged for them. On a file its store owns, a keyed call whose key has no record
//! does not come here either: it is held, and its batch writes its record
//! (`super::owned::keyed`). The pool's commits are durable when they return (`SQLite`'s
//! `synchronous = FULL`, `PostgreSQL`'s synchronous commit, `MySQL`'s `InnoDB`).

use chrono::{DateTime, Utc};
use sea_orm::sea_query::Expr;
use sea_orm::{
    ActiveValue::{NotSet, Set},
    ColumnTrait, ConnectionTrait, DatabaseConnection, DatabaseTransaction, EntityTrait,
    QueryFilter, QuerySelect,
};

use super::alerting::Alerting;
use super::commit::jobs::begin_write;
use super::commit::ledger_ops;
use super::entity::{api_key, call, idempotent_call};
use super::held::Holds;
use super::rows::locked_account;
use super::writes::{Outcome, OwnedCharge, Write, abandoned_settles};
use crate::store::{
    AccountId, CallId, CallStatus, CallSuccess, IdempotencyKey, KeptReply, KeyedCall,
    KeyedDecision, Reservation, ReserveError, StoreError, decide_keyed, window_cutoff,
};

/// Reserves a keyed call, or answers it from its key's record; see the module docs. Also says
/// whether it inserted the key's record (rather than pointing the one there at the new call).
/// What `holds` hold (a store that owns its file, see `super::owned`) counts as spent; the
/// caller keeps them locked until this returns.
pub(super) async fn reserve(
    db: &DatabaseConnection,
    charge: OwnedCharge,
    key: &IdempotencyKey,
    window: std::time::Duration,
    holds: Option<&Holds>,
    alerting: Option<Alerting>,
) -> Result<(Reservation, bool), ReserveError> {
    let txn = begin_write(db).await?;
    let account = charge.caller.account;
    locked_account(&txn, account).await?;
    if !key_active(&txn, charge.caller.key.0).await? {
        return Err(ReserveError::KeyRevoked);
    }
    let found = record(&txn, account, key.key()).await?;
    let record_id = found.as_ref().map(|(id, _)| *id);
    let at = charge.at;
    if let KeyedDecision::Answer(answer) = decide_keyed(found.map(|(_, c)| c), key, at, window) {
        return Err(answer);
    }
    let write = Write::Reserve(charge);
    let reservation = match ledger_ops::apply_in(&txn, &[&write], holds, alerting)
        .await?
        .pop()
    {
        Some(Outcome::Reserved(reserved)) => reserved?,
        _ => return Err(StoreError::msg("internal: a reservation without its outcome").into()),
    };
    let row = idempotent_call::ActiveModel {
        id: record_id.map_or(NotSet, Set),
        account_id: Set(account.0),
        idem_key: Set(key.key().to_owned()),
        fingerprint: Set(key.fingerprint()),
        call_id: Set(reservation.call.0),
        created_at: Set(at),
        reply_status: Set(None),
        reply_content_type: Set(None),
        reply_body: Set(None),
    };
    match record_id {
        Some(_) => {
            idempotent_call::Entity::update(row).exec(&txn).await?;
        }
        None => {
            idempotent_call::Entity::insert(row).exec(&txn).await?;
        }
    }
    txn.commit().await?;
    Ok((reservation, record_id.is_none()))
}

/// Settles a keyed call and keeps its reply, in one transaction; `false` if it was not
/// pending (nothing written).
/// `holds`: on a file its store owns, what calls held in memory hold on the accounts (a cost
/// above what the call took may take only what they leave free).
pub(super) async fn settle(
    db: &DatabaseConnection,
    call: CallId,
    mut success: CallSuccess,
    holds: Option<&Holds>,
    alerting: Option<Alerting>,
) -> Result<bool, StoreError> {
    let reply = success.reply.take();
    let txn = begin_write(db).await?;
    let write = Write::Settle(call, Box::new(success));
    let settled = matches!(
        ledger_ops::apply_in(&txn, &[&write], holds, alerting)
            .await?
            .pop(),
        Some(Outcome::Finished(true))
    );
    if settled && let Some(reply) = reply {
        keep_reply(&txn, call, reply).await?;
    }
    // Its caller gave up on it while it waited: not billed (see `SettleClaim`).
    if !abandoned_settles(&[&write]).is_empty() {
        txn.rollback().await?;
        return Ok(false);
    }
    let local = db.get_database_backend() == sea_orm::DbBackend::Sqlite;
    txn.commit().await.inspect_err(|_| {
        // A file's commit that fails wrote nothing: the claim goes back (see `SettleClaim`).
        if local && let Write::Settle(_, success) = &write {
            success.claim.release();
        }
    })?;
    Ok(settled)
}

/// [`forget`], in one transaction that lists what it deletes: the account and key of each
/// record (for a store that counts the records, see `super::owned::keyed`).
#[cfg_attr(not(feature = "sqlite"), allow(dead_code))] // for an owned file only
pub(super) async fn forget_listed(
    db: &DatabaseConnection,
    now: DateTime<Utc>,
    window: std::time::Duration,
) -> Result<Vec<(AccountId, String)>, StoreError> {
    let Some(cutoff) = window_cutoff(now, window) else {
        return Ok(Vec::new());
    };
    let txn = begin_write(db).await?;
    let listed: Vec<(i64, i64, String)> = idempotent_call::Entity::find()
        .select_only()
        .column(idempotent_call::Column::Id)
        .column(idempotent_call::Column::AccountId)
        .column(idempotent_call::Column::IdemKey)
        .filter(idempotent_call::Column::CreatedAt.lte(cutoff))
        .filter(idempotent_call::Column::CallId.in_subquery(ended_calls()))
        .into_tuple()
        .all(&txn)
        .await?;
    let mut deleted = Vec::with_capacity(listed.len());
    // In slices, so that no statement binds more values than a database takes.
    for slice in listed.chunks(500) {
        let ids = slice.iter().map(|(id, ..)| *id);
        idempotent_call::Entity::delete_many()
            .filter(idempotent_call::Column::Id.is_in(ids))
            .exec(&txn)
            .await?;
        deleted.extend((slice.iter()).map(|(_, account, key)| (AccountId(*account), key.clone())));
    }
    txn.commit().await?;
    Ok(deleted)
}

/// The calls that have ended, as a subquery.
fn ended_calls() -> sea_orm::sea_query::SelectStatement {
    sea_orm::sea_query::Query::select()
        .column(call::Column::Id)
        .from(call::Entity)
        .and_where(call::Column::Status.ne(CallStatus::Pending.as_str()))
        .to_owned()
}

/// Deletes the records older than `window` at `now` whose calls have ended.
pub(super) async fn forget(
    db: &DatabaseConnection,
    now: DateTime<Utc>,
    window: std::time::Duration,
) -> Result<u64, StoreError> {
    let Some(cutoff) = window_cutoff(now, window) else {
        return Ok(0);
    };
    let deleted = idempotent_call::Entity::delete_many()
        .filter(idempotent_call::Column::CreatedAt.lte(cutoff))
        .filter(idempotent_call::Column::CallId.in_subquery(ended_calls()))
        .exec(db)
        .await?;
    Ok(deleted.rows_affected)
}

/// Whether `key` may reserve (it exists and is not revoked).
pub(super) async fn key_active<C: ConnectionTrait>(txn: &C, key: i64) -> Result<bool, StoreError> {
    let active = api_key::Entity::find_by_id(key)
        .select_only()
        .column(api_key::Column::Id)
        .filter(api_key::Column::RevokedAt.is_null())
        .into_tuple::<i64>()
        .one(txn)
        .await?;
    Ok(active.is_some())
}

/// The key's record and its call's status. Read without a row lock: the account's lock, taken
/// first, already orders every keyed reservation of the account, and reads made after it see
/// what the one before committed (on `MySQL` the transaction's snapshot is taken at its first
/// plain read, after that lock). A locking read would also lock the gap where a missing record
/// would go, and on `MariaDB` two accounts inserting into one gap then deadlock.
async fn record(
    txn: &DatabaseTransaction,
    account: AccountId,
    key: &str,
) -> Result<Option<(i64, KeyedCall)>, StoreError> {
    let Some(row) = idempotent_call::Entity::find()
        .filter(idempotent_call::Column::AccountId.eq(account.0))
        .filter(idempotent_call::Column::IdemKey.eq(key))
        .one(txn)
        .await?
    else {
        return Ok(None);
    };
    let status: Option<String> = call::Entity::find_by_id(row.call_id)
        .select_only()
        .column(call::Column::Status)
        .into_tuple()
        .one(txn)
        .await?;
    let status = status
        .as_deref()
        .and_then(CallStatus::parse)
        .ok_or_else(|| {
            StoreError::msg(format!(
                "idempotency record {} names call {} with no valid status",
                row.id, row.call_id
            ))
        })?;
    let reply = match (row.reply_status, row.reply_body) {
        (Some(status), Some(body)) => Some(KeptReply {
            status: u16::try_from(status).unwrap_or(200),
            content_type: row.reply_content_type,
            body: body.into(),
        }),
        _ => None,
    };
    let found = KeyedCall {
        fingerprint: row.fingerprint,
        status,
        created_at: row.created_at,
        reply,
    };
    Ok(Some((row.id, found)))
}

async fn keep_reply(
    txn: &DatabaseTransaction,
    call: CallId,
    reply: KeptReply,
) -> Result<(), StoreError> {
    idempotent_call::Entity::update_many()
        .col_expr(
            idempotent_call::Column::ReplyStatus,
            Expr::value(i32::from(reply.status)),
        )
        .col_expr(
            idempotent_call::Column::ReplyContentType,
            Expr::value(reply.content_type),
        )
        .col_expr(
            idempotent_call::Column::ReplyBody,
            Expr::value(reply.body.to_vec()),
        )
        .filter(idempotent_call::Column::CallId.eq(call.0))
        .exec(txn)
        .await?;
    Ok(())
}
