//! The ledger's writes, each run inside a write transaction that the caller opens and commits:
//! alone, or several together (group commit). None of them commits or rolls back by itself, and
//! none leaves a partial write behind when it returns an error, because the caller then rolls
//! the whole transaction back.
//!
//! Account balances go through [`LockedAccounts`]: the first write that touches an account in a
//! transaction locks and reads its row; later writes in the same transaction decide on the
//! balance as tracked in memory (nobody else can change the row while the lock is held), and
//! [`LockedAccounts::write`] stores each account's net change with one guarded `UPDATE` before
//! the transaction commits.

use std::collections::BTreeMap;
use std::collections::btree_map::Entry;

use chrono::Utc;
use sea_orm::sea_query::{Expr, ExprTrait};
use sea_orm::{ColumnTrait, ConnectionTrait, EntityTrait, NotSet, QueryFilter, Set};

use super::entity::{account, call};
use super::group_commit::OwnedCharge;
use super::{balance_of, locked_account, unknown_account};
use crate::credits::{Balance, Credits, Split};
use crate::store::{
    AccountId, CallFailure, CallId, CallStatus, CallSuccess, Reservation, StoreError,
};

/// The accounts a write transaction has locked: their balances as the transaction sees them,
/// and the changes not yet written.
#[derive(Debug, Default)]
pub(super) struct LockedAccounts {
    held: BTreeMap<i64, Held>,
}

#[derive(Debug)]
struct Held {
    balance: Balance,
    change: Balance,
}

impl LockedAccounts {
    /// The account, locked and read on first use in this transaction.
    async fn hold<C: ConnectionTrait>(
        &mut self,
        txn: &C,
        account: AccountId,
    ) -> Result<&mut Held, StoreError> {
        Ok(match self.held.entry(account.0) {
            Entry::Occupied(held) => held.into_mut(),
            Entry::Vacant(slot) => {
                let row = locked_account(txn, account).await?;
                slot.insert(Held {
                    balance: balance_of(&row),
                    change: Balance::default(),
                })
            }
        })
    }

    /// Writes each account's net change with an `UPDATE` guarded so that no bucket goes
    /// negative; its affected-row count must be 1, or the transaction must be rolled back.
    pub(super) async fn write<C: ConnectionTrait>(self, txn: &C) -> Result<(), StoreError> {
        for (account, held) in self.held {
            let Balance {
                subscription,
                topup,
            } = held.change;
            if subscription == Credits::ZERO && topup == Credits::ZERO {
                continue;
            }
            let sub = Expr::col(account::Column::SubscriptionCredits).add(subscription.0);
            let top = Expr::col(account::Column::TopupCredits).add(topup.0);
            let written = account::Entity::update_many()
                .col_expr(account::Column::SubscriptionCredits, sub.clone())
                .col_expr(account::Column::TopupCredits, top.clone())
                .filter(account::Column::Id.eq(account))
                .filter(sub.gte(0))
                .filter(top.gte(0))
                .exec(txn)
                .await?;
            if written.rows_affected != 1 {
                // Unreachable while the row lock holds; refuse rather than over-spend.
                return Err(StoreError::msg(format!(
                    "account {account} changed while locked; batch refused"
                )));
            }
        }
        Ok(())
    }
}

impl Held {
    fn take(&mut self, split: Split) {
        self.balance.subscription.0 -= split.subscription.0;
        self.balance.topup.0 -= split.topup.0;
        self.change.subscription.0 -= split.subscription.0;
        self.change.topup.0 -= split.topup.0;
    }

    fn give_back(&mut self, split: Split) {
        self.balance.subscription.0 += split.subscription.0;
        self.balance.topup.0 += split.topup.0;
        self.change.subscription.0 += split.subscription.0;
        self.change.topup.0 += split.topup.0;
    }
}

/// The pool cannot pay; nothing was written.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Insufficient;

/// Takes the price from the locked account, subscription-first, and inserts the `pending`
/// entry. The debit itself is written by [`LockedAccounts::write`] before the commit.
pub(super) async fn reserve_in<C: ConnectionTrait>(
    txn: &C,
    accounts: &mut LockedAccounts,
    charge: &OwnedCharge,
) -> Result<Result<Reservation, Insufficient>, StoreError> {
    let account = charge.caller.account;
    let held = accounts.hold(txn, account).await?;
    let Some(taken) = held.balance.split_charge(charge.price) else {
        return Ok(Err(Insufficient));
    };
    held.take(taken);
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
    accounts: &mut LockedAccounts,
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
    let held = accounts
        .hold(txn, AccountId(entry.account_id))
        .await
        .map_err(|_| unknown_account(AccountId(entry.account_id)))?;
    held.give_back(Split {
        subscription: Credits(entry.charged_subscription),
        topup: Credits(entry.charged_topup),
    });
    Ok(true)
}
