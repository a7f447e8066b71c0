//! The ledger's writes, each run inside a write transaction that the caller opens and commits:
//! alone, or several together (group commit). None of them commits or rolls back by itself, and
//! none leaves a partial write behind when it returns an error, because the caller then rolls
//! the whole transaction back.

use chrono::Utc;
use sea_orm::sea_query::{Expr, ExprTrait};
use sea_orm::{ColumnTrait, ConnectionTrait, EntityTrait, NotSet, QueryFilter, Set};

use super::entity::{account, call};
use super::group_commit::OwnedCharge;
use super::{balance_of, locked_account, unknown_account};
use crate::store::{CallFailure, CallId, CallStatus, CallSuccess, Reservation, StoreError};

/// The pool cannot pay; nothing was written.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Insufficient;

/// Reads the account under a lock, takes the price subscription-first with a guarded `UPDATE`
/// whose affected-row count decides, and inserts the `pending` entry.
pub(super) async fn reserve_in<C: ConnectionTrait>(
    txn: &C,
    charge: &OwnedCharge,
) -> Result<Result<Reservation, Insufficient>, StoreError> {
    let account = charge.caller.account;
    let row = locked_account(txn, account).await?;
    let Some(taken) = balance_of(&row).split_charge(charge.price) else {
        return Ok(Err(Insufficient));
    };
    let debited = account::Entity::update_many()
        .col_expr(
            account::Column::SubscriptionCredits,
            Expr::col(account::Column::SubscriptionCredits).sub(taken.subscription.0),
        )
        .col_expr(
            account::Column::TopupCredits,
            Expr::col(account::Column::TopupCredits).sub(taken.topup.0),
        )
        .filter(account::Column::Id.eq(account.0))
        .filter(account::Column::SubscriptionCredits.gte(taken.subscription.0))
        .filter(account::Column::TopupCredits.gte(taken.topup.0))
        .exec(txn)
        .await?;
    if debited.rows_affected != 1 {
        // Unreachable while the row lock holds; refuse rather than over-spend if it does not.
        return Err(StoreError::msg(
            "account balance changed during reservation",
        ));
    }
    let entry = call::ActiveModel {
        id: NotSet,
        account_id: Set(account.0),
        key_id: Set(charge.caller.key.0),
        protocol: Set(charge.protocol.as_str().to_owned()),
        model: Set(charge.model.clone()),
        price: Set(charge.price.0),
        charged_subscription: Set(taken.subscription.0),
        charged_topup: Set(taken.topup.0),
        status: Set(CallStatus::Pending.as_str().to_owned()),
        upstream_status: Set(None),
        upstream_channel: Set(None),
        upstream_error: Set(None),
        input_tokens: Set(None),
        output_tokens: Set(None),
        created_at: Set(Utc::now()),
        finished_at: Set(None),
    };
    let call = call::Entity::insert(entry).exec(txn).await?.last_insert_id;
    Ok(Ok(Reservation {
        call: CallId(call),
        account,
        taken,
    }))
}

/// Marks a `pending` entry `ok`; `false` if it was not pending.
pub(super) async fn settle_in<C: ConnectionTrait>(
    txn: &C,
    call: CallId,
    success: &CallSuccess,
) -> Result<bool, StoreError> {
    let settled = call::Entity::update_many()
        .col_expr(call::Column::Status, Expr::value(CallStatus::Ok.as_str()))
        .col_expr(
            call::Column::UpstreamStatus,
            Expr::value(i32::from(success.upstream_status)),
        )
        .col_expr(
            call::Column::UpstreamChannel,
            Expr::value(success.channel.clone()),
        )
        .col_expr(
            call::Column::InputTokens,
            Expr::value(success.usage.input_tokens),
        )
        .col_expr(
            call::Column::OutputTokens,
            Expr::value(success.usage.output_tokens),
        )
        .col_expr(call::Column::FinishedAt, Expr::value(Utc::now()))
        .filter(call::Column::Id.eq(call.0))
        .filter(call::Column::Status.eq(CallStatus::Pending.as_str()))
        .exec(txn)
        .await?;
    Ok(settled.rows_affected == 1)
}

/// Flips a `pending` entry to `refunded` and, only if that changed it, credits each bucket back
/// what the call took from it; `false`, writing nothing, if it was not pending.
pub(super) async fn refund_in<C: ConnectionTrait>(
    txn: &C,
    call: CallId,
    failure: &CallFailure,
) -> Result<bool, StoreError> {
    let marked = call::Entity::update_many()
        .col_expr(
            call::Column::Status,
            Expr::value(CallStatus::Refunded.as_str()),
        )
        .col_expr(
            call::Column::UpstreamStatus,
            Expr::value(failure.upstream_status.map(i32::from)),
        )
        .col_expr(
            call::Column::UpstreamError,
            Expr::value(failure.error.clone()),
        )
        .col_expr(call::Column::FinishedAt, Expr::value(Utc::now()))
        .filter(call::Column::Id.eq(call.0))
        .filter(call::Column::Status.eq(CallStatus::Pending.as_str()))
        .exec(txn)
        .await?;
    if marked.rows_affected != 1 {
        return Ok(false);
    }
    let entry = call::Entity::find_by_id(call.0)
        .one(txn)
        .await?
        .ok_or_else(|| StoreError::msg(format!("call {} vanished during refund", call.0)))?;
    let credited = account::Entity::update_many()
        .col_expr(
            account::Column::SubscriptionCredits,
            Expr::col(account::Column::SubscriptionCredits).add(entry.charged_subscription),
        )
        .col_expr(
            account::Column::TopupCredits,
            Expr::col(account::Column::TopupCredits).add(entry.charged_topup),
        )
        .filter(account::Column::Id.eq(entry.account_id))
        .exec(txn)
        .await?;
    if credited.rows_affected != 1 {
        return Err(unknown_account(crate::store::AccountId(entry.account_id)));
    }
    Ok(true)
}
