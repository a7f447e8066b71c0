//! The escrow rows: read and written under their account's lock, given back when their lease
//! has ended, summed by account.

use chrono::{DateTime, Utc};
use sea_orm::sea_query::{Expr, LockType};
use sea_orm::{
    ColumnTrait, ConnectionTrait, DatabaseConnection, EntityTrait, QueryFilter, QuerySelect, Set,
};

use super::state::PotKey;
use crate::credits::{Balance, Credits};
use crate::store::sea::entity::{account, escrow};
use crate::store::sea::rows::balance_of;
use crate::store::sea::writes::unknown_account;
use crate::store::{AccountId, LeaseId, StoreError};

/// An escrow row as stored, locked; zero if there is none.
pub(super) async fn escrow_row<C: ConnectionTrait>(
    txn: &C,
    pot: PotKey,
) -> Result<Balance, StoreError> {
    Ok(escrow::Entity::find_by_id((pot.account.0, pot.lease.0))
        .lock_exclusive()
        .one(txn)
        .await?
        .map(|row| Balance {
            subscription: Credits(row.subscription_credits),
            topup: Credits(row.topup_credits),
        })
        .unwrap_or_default())
}

/// Moves what an escrow row has free of `held` back to its account's row, both locked in
/// `txn` (account first, as every writer of both does); returns what the escrow row keeps.
///
/// The account row is locked `FOR NO KEY UPDATE` here and in a refill: what the update of its
/// credits takes anyway, and exclusive against every other writer, but unlike `FOR UPDATE` it
/// neither waits for nor blocks the `FOR KEY SHARE` locks that the foreign-key checks of
/// entries being inserted (by other instances' batches, for this account) take on it.
pub(super) async fn return_free<C: ConnectionTrait>(
    txn: &C,
    pot: PotKey,
    held: Balance,
) -> Result<Balance, StoreError> {
    let row = account::Entity::find_by_id(pot.account.0)
        .lock(LockType::NoKeyUpdate)
        .one(txn)
        .await?
        .ok_or_else(|| unknown_account(pot.account))?;
    let stored = escrow_row(txn, pot).await?;
    let free = stored.free_of(held);
    let kept = stored.less(free);
    // An empty row (a lapse can leave one) is deleted all the same.
    write_escrow_row(txn, pot, kept).await?;
    if free == Balance::default() {
        return Ok(kept);
    }
    let back = balance_of(&row).and(free);
    account::Entity::update_many()
        .col_expr(
            account::Column::SubscriptionCredits,
            Expr::value(back.subscription.get()),
        )
        .col_expr(account::Column::TopupCredits, Expr::value(back.topup.get()))
        .filter(account::Column::Id.eq(pot.account.0))
        .exec(txn)
        .await?;
    Ok(kept)
}

/// Writes an escrow row (locked by [`escrow_row`]), deleting it when it is empty.
pub(super) async fn write_escrow_row<C: ConnectionTrait>(
    txn: &C,
    pot: PotKey,
    escrowed: Balance,
) -> Result<(), StoreError> {
    if escrowed == Balance::default() {
        escrow::Entity::delete_by_id((pot.account.0, pot.lease.0))
            .exec(txn)
            .await?;
        return Ok(());
    }
    let row = escrow::ActiveModel {
        account_id: Set(pot.account.0),
        instance_id: Set(pot.lease.0),
        subscription_credits: Set(escrowed.subscription.0),
        topup_credits: Set(escrowed.topup.0),
    };
    let on_conflict = sea_orm::sea_query::OnConflict::columns([
        escrow::Column::AccountId,
        escrow::Column::InstanceId,
    ])
    .update_columns([
        escrow::Column::SubscriptionCredits,
        escrow::Column::TopupCredits,
    ])
    .to_owned();
    escrow::Entity::insert(row)
        .on_conflict(on_conflict)
        .exec_without_returning(txn)
        .await?;
    Ok(())
}

/// Gives back to their accounts the escrow rows (of `account`, or of every account) whose
/// lease does not hold at `now` (its instance crashed, stopped without giving back, or lost its
/// lease), each in a transaction of its own. Returns how many rows it gave back. Recovery and a
/// recall may both run it at once: a row is read again under its lock, and one given back is
/// found empty.
///
/// Never the rows of `own_lost`, the leases this process lost while it lived (an outage longer
/// than their time to live): its calls held against them are still under way, and settle from
/// them when they end; the row goes back once it sits idle, as any of its rows does.
pub(in crate::store::sea) async fn give_back_ended(
    db: &DatabaseConnection,
    now: DateTime<Utc>,
    account: Option<AccountId>,
    own_lost: &[i64],
) -> Result<u64, StoreError> {
    let mut query = escrow::Entity::find()
        .select_only()
        .column(escrow::Column::AccountId)
        .column(escrow::Column::InstanceId)
        .filter(escrow::Column::InstanceId.not_in_subquery(crate::store::sea::leases::live(now)))
        .filter(escrow::Column::InstanceId.is_not_in(own_lost.iter().copied()));
    if let Some(account) = account {
        query = query.filter(escrow::Column::AccountId.eq(account.0));
    }
    let ended: Vec<(i64, i64)> = query.into_tuple().all(db).await?;
    let mut given = 0;
    for (account, lease) in ended {
        let pot = PotKey::new(LeaseId(lease), AccountId(account));
        let txn = crate::store::sea::commit::jobs::begin_write(db).await?;
        // A lease that ended is never renewed, and its holder holds nothing that recovery
        // must leave: all of its escrow goes back.
        return_free(&txn, pot, Balance::default()).await?;
        txn.commit().await?;
        tracing::info!(account, lease, "gave back the escrow of a lease that ended");
        given += 1;
    }
    Ok(given)
}
