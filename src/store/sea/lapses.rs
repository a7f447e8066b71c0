//! A subscription's lapse: what is left of its credits taken out of the account's row and
//! its escrow rows, and recorded.

use chrono::{DateTime, Utc};
use sea_orm::sea_query::Expr;
use sea_orm::{
    ActiveModelTrait, ColumnTrait, ConnectionTrait, EntityTrait, NotSet, QueryFilter, QuerySelect,
    Set,
};

use super::entity::{account, escrow, subscription_lapse};
use crate::credits::Credits;
use crate::store::rules::lapse::{PotSubscription, decide_lapse};
use crate::store::{AccountId, Lapse, LeaseId, StoreError};

/// Takes out what is left of a locked account's subscription credits, if anything, recording
/// it as lapsed at `period_end`: from its row and from every escrow row of the account (see
/// [`SeaOrmStore::with_escrow`](super::SeaOrmStore::with_escrow)). What the lapsing store's own calls hold stays: in memory on a
/// file it owns (`held`, see [`SeaOrmStore::own_file`](super::SeaOrmStore::own_file)), and in its escrow rows
/// (`escrow_held`, by lease). Those calls were made within the period, and take it when they
/// end. A call another instance holds against escrowed credits then ends unbilled.
pub(super) async fn lapse<C: ConnectionTrait>(
    txn: &C,
    row: &account::Model,
    period_end: DateTime<Utc>,
    held: Credits,
    escrow_held: &[(LeaseId, Credits)],
) -> Result<Option<Lapse>, StoreError> {
    let escrowed: Vec<escrow::Model> = escrow::Entity::find()
        .filter(escrow::Column::AccountId.eq(row.id))
        .filter(escrow::Column::SubscriptionCredits.gt(0))
        .lock_exclusive()
        .all(txn)
        .await?;
    let pots: Vec<PotSubscription> = escrowed
        .iter()
        .map(|escrowed| PotSubscription {
            in_pot: Credits(escrowed.subscription_credits),
            held_here: escrow_held
                .iter()
                .find(|(lease, _)| lease.0 == escrowed.instance_id)
                .map_or(Credits::ZERO, |(_, held)| *held),
        })
        .collect();
    let plan = decide_lapse(Credits(row.subscription_credits), held, &pots);
    let left = plan.lapsed.get();
    if left <= 0 {
        return Ok(None);
    }
    if plan.from_row > Credits::ZERO {
        let kept_in_row = row.subscription_credits - plan.from_row.get();
        let emptied = account::Entity::update_many()
            .col_expr(
                account::Column::SubscriptionCredits,
                Expr::value(kept_in_row),
            )
            .filter(account::Column::Id.eq(row.id))
            .filter(account::Column::SubscriptionCredits.eq(row.subscription_credits))
            .exec(txn)
            .await?;
        if emptied.rows_affected != 1 {
            return Err(StoreError::msg(format!(
                "account {} changed under its lock",
                row.id
            )));
        }
    }
    for (pot, kept) in escrowed.iter().zip(plan.kept) {
        escrow::Entity::update_many()
            .col_expr(escrow::Column::SubscriptionCredits, Expr::value(kept.get()))
            .filter(escrow::Column::AccountId.eq(row.id))
            .filter(escrow::Column::InstanceId.eq(pot.instance_id))
            .exec(txn)
            .await?;
    }
    subscription_lapse::ActiveModel {
        id: NotSet,
        account_id: Set(row.id),
        amount: Set(left),
        period_end: Set(period_end),
        created_at: Set(Utc::now()),
    }
    .insert(txn)
    .await?;
    Ok(Some(Lapse {
        account: AccountId(row.id),
        amount: Credits(left),
        period_end,
    }))
}
