//! Reading and writing rows the same way on every database: a moment as a value each backend
//! keeps whole, an account's balance from its row, the row locked. A leaf beside the entities.

use chrono::Utc;
use sea_orm::{ConnectionTrait, EntityTrait, QuerySelect};

use super::entity::account;
use super::writes::unknown_account;
use crate::credits::{Balance, Credits};
use crate::store::{AccountId, StoreError};

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
