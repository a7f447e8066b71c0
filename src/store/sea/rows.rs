//! Reading and writing rows the same way on every database: a moment as a value each backend
//! keeps whole, an account's balance from its row, the row locked, a key's limit from its row, an
//! event into the outbox. A leaf beside the entities.

use std::collections::HashMap;

use chrono::Utc;
use sea_orm::sea_query::IntoCondition;
use sea_orm::{
    ColumnTrait, ConnectionTrait, EntityTrait, NotSet, QueryFilter, QueryOrder, QuerySelect, Set,
};

use super::entity::{account, call, escrow, webhook_event};
use super::writes::unknown_account;
use crate::call::{KeyLimit, LimitPeriod};
use crate::credits::{Balance, Credits};
use crate::events::WebhookEvent;
use crate::store::records::DeliveryStatus;
use crate::store::rules::allowance::Allowance;
use crate::store::{AccountId, CallId, CallStatus, StoreError};

/// A moment as a statement value that every backend keeps whole. On `MySQL` it is a plain
/// `DATETIME` in UTC: sqlx sends a `DateTime<Utc>` as a `TIMESTAMP`, which `MariaDB` stores as
/// `NULL` past 2038-01-19 (a key's expiry or a subscription's end set that far would vanish).
pub(super) fn moment_value(
    backend: sea_orm::DbBackend,
    at: Option<chrono::DateTime<Utc>>,
) -> sea_orm::Value {
    match backend {
        sea_orm::DbBackend::MySql => at.map(|at| at.naive_utc()).into(),
        _ => at.into(),
    }
}

/// An account row's balance with its escrowed credits (see [`SeaOrmStore::with_escrow`]).
/// Saturates: a total past the largest balance is reported by the audit, not wrapped.
pub(super) fn with_escrowed(row: Balance, escrowed: Balance) -> Balance {
    Balance {
        subscription: Credits(row.subscription.0.saturating_add(escrowed.subscription.0)),
        topup: Credits(row.topup.0.saturating_add(escrowed.topup.0)),
    }
}

/// An account row's balance.
pub(super) fn balance_of(row: &account::Model) -> Balance {
    Balance {
        subscription: Credits(row.subscription_credits),
        topup: Credits(row.topup_credits),
    }
}

/// An account row, locked for the rest of `txn`.
pub(super) async fn locked_account<C: ConnectionTrait>(
    txn: &C,
    account: AccountId,
) -> Result<account::Model, StoreError> {
    account::Entity::find_by_id(account.0)
        .lock_exclusive()
        .one(txn)
        .await?
        .ok_or_else(|| unknown_account(account))
}

/// What every escrow row holds, by account (of `accounts`, or of all). Any database's schema
/// has the table; only escrow on `PostgreSQL` (`super::escrow`) fills it.
pub(super) async fn escrowed<C: ConnectionTrait>(
    db: &C,
    accounts: Option<&[i64]>,
) -> Result<HashMap<i64, Balance>, StoreError> {
    let mut query = escrow::Entity::find();
    if let Some(accounts) = accounts {
        query = query.filter(escrow::Column::AccountId.is_in(accounts.iter().copied()));
    }
    let mut sums: HashMap<i64, Balance> = HashMap::new();
    for row in query.all(db).await? {
        let sum = sums.entry(row.account_id).or_default();
        *sum = with_escrowed(
            *sum,
            Balance {
                subscription: Credits(row.subscription_credits),
                topup: Credits(row.topup_credits),
            },
        );
    }
    Ok(sums)
}

/// `account`'s balance when its row holds `row`: that with its escrowed credits, which are the
/// account's whichever instance holds them.
pub(super) async fn with_escrow_rows<C: ConnectionTrait>(
    conn: &C,
    account: AccountId,
    row: Balance,
) -> Result<Balance, StoreError> {
    let escrowed = escrowed(conn, Some(&[account.0])).await?;
    Ok(with_escrowed(
        row,
        escrowed.get(&account.0).copied().unwrap_or_default(),
    ))
}

/// The ids of the `pending` entries that `which` picks, ordered by `order`, at most `limit`:
/// the one query behind recovery's two rules and the lookup of a lost reservation.
pub(super) async fn pending_ids<C: ConnectionTrait>(
    db: &C,
    which: impl IntoCondition,
    order: call::Column,
    limit: Option<u64>,
) -> Result<Vec<CallId>, StoreError> {
    let ids: Vec<i64> = call::Entity::find()
        .select_only()
        .column(call::Column::Id)
        .filter(call::Column::Status.eq(CallStatus::Pending.as_str()))
        .filter(which)
        .order_by_asc(order)
        .limit(limit)
        .into_tuple()
        .all(db)
        .await?;
    Ok(ids.into_iter().map(CallId).collect())
}

/// A key's spending limit as its row stores it (`limit_credits`, `limit_period`).
pub(in crate::store::sea) fn stored_limit(
    credits: Option<i64>,
    period: Option<&str>,
) -> Option<KeyLimit> {
    Some(KeyLimit {
        credits: Credits(credits?),
        period: LimitPeriod::parse(period?)?,
    })
}

/// A limited key's allowance as its row stores it.
pub(in crate::store::sea) fn stored_allowance(
    credits: Option<i64>,
    period: Option<&str>,
    spent: i64,
    window: i64,
) -> Option<Allowance> {
    Some(Allowance {
        limit: stored_limit(credits, period)?,
        spent,
        window,
    })
}

/// Inserts `event` into the outbox, pending and due at once, in `db` (a transaction, so that
/// it is written with what caused it).
pub(in crate::store::sea) async fn insert_event<C: ConnectionTrait>(
    db: &C,
    event: &WebhookEvent,
) -> Result<(), StoreError> {
    let row = webhook_event::ActiveModel {
        id: NotSet,
        event_id: Set(event.id.clone()),
        event_type: Set(event.kind.as_str().to_owned()),
        body: Set(event.body()),
        status: Set(DeliveryStatus::Pending.as_str().to_owned()),
        attempts: Set(0),
        next_attempt_at: Set(event.created_at),
        last_status: Set(None),
        last_error: Set(None),
        created_at: Set(event.created_at),
        delivered_at: Set(None),
    };
    webhook_event::Entity::insert(row).exec(db).await?;
    Ok(())
}
