//! Grants on the sea-orm backend: credits added to an account's bucket under its row's lock,
//! once per idempotency key, and with a redemption code claimed in the same transaction.

use chrono::{DateTime, Utc};
use sea_orm::sea_query::{Expr, ExprTrait};
use sea_orm::{
    ActiveModelTrait, ColumnTrait, ConnectionTrait, DatabaseTransaction, EntityTrait, NotSet,
    QueryFilter, Set,
};

use super::entity::{account, code, credit_grant};
use super::lapses::lapse;
use super::rows::{balance_of, insert_event, locked_account, moment_value};
use super::store::SeaOrmStore;
use crate::codes::CodeHash;
use crate::credits::{Bucket, Credits};
use crate::events::{EventType, WebhookEvent};
use crate::store::{
    AccountId, BalanceOverflow, Grant, Granted, IdempotencyKeyReused, StoreError,
    check_grant_amount,
};

impl SeaOrmStore {
    /// Applies a grant (see [`Accounts::grant_once`](crate::store::Accounts::grant_once)); with a code to `claim`, only if the code
    /// is claimed for the account in the same transaction (`None` when it is not: unknown,
    /// used or revoked, perhaps by a concurrent redemption).
    pub(super) async fn grant_claiming(
        &self,
        account: AccountId,
        grant: Grant<'_>,
        claim: Option<(&CodeHash, &WebhookEvent)>,
    ) -> Result<Option<Granted>, StoreError> {
        let Grant {
            bucket,
            amount,
            reason,
            idempotency_key,
            period_end,
            at,
        } = grant;
        check_grant_amount(amount)?;
        // Held calls must not change while a new period lapses the old one's credits (a call
        // held against escrow meanwhile may count on credits the lapse takes: it ends unbilled).
        let holds = self.freeze_holds().await;
        let _writes = self.mode.pause_escrow_writes().await;
        let held = holds
            .as_ref()
            .map(|holds| holds.on(account))
            .unwrap_or_default();
        // What the account has to spend once its row reads `row`.
        let net = async |txn: &DatabaseTransaction, row: &account::Model| match &holds {
            Some(holds) => Ok(holds.net(account, balance_of(row))),
            None => self.with_escrow_of(txn, account, balance_of(row)).await,
        };
        let txn = self.begin_write().await?;
        // Grants to one account queue on its row from here, so that the key check below and
        // the grant it allows cannot interleave with another grant's.
        let before = locked_account(&txn, account).await?;
        if let Some(key) = idempotency_key {
            let earlier = credit_grant::Entity::find()
                .filter(credit_grant::Column::AccountId.eq(account.0))
                .filter(credit_grant::Column::IdempotencyKey.eq(key))
                .one(&txn)
                .await?;
            if let Some(earlier) = earlier {
                let balance = net(&txn, &before).await?;
                txn.rollback().await?;
                if earlier.bucket != bucket.as_str() || earlier.amount != amount.get() {
                    return Err(StoreError::IdempotencyKeyReused(IdempotencyKeyReused {
                        key: key.to_owned(),
                    }));
                }
                return Ok(Some(Granted {
                    balance,
                    applied: false,
                    lapsed: Credits::ZERO,
                }));
            }
        }
        // The code is claimed under the account's lock, last: a concurrent redemption of the
        // same code waits for this transaction on the code's row, then finds it used.
        if let Some((code, redeemed)) = claim {
            if !claim_code(&txn, code, account, at).await? {
                txn.rollback().await?;
                return Ok(None);
            }
            if self.events.writes(EventType::CodeRedeemed) {
                insert_event(&txn, redeemed).await?;
            }
        }
        // A subscription grant with a period, or into a period that has ended, starts a new
        // period: what was left lapses first.
        let ended = before.subscription_ends_at.is_some_and(|end| end <= at);
        let new_period = bucket == Bucket::Subscription && (period_end.is_some() || ended);
        // A grant past the largest balance is refused by the guarded update below, and the
        // roll-back undoes the lapse too.
        let mut lapsed = Credits::ZERO;
        if new_period {
            let end = before.subscription_ends_at.unwrap_or(at);
            lapsed = lapse(
                &txn,
                &before,
                end,
                held.subscription,
                &self.mode.escrow_held(account),
            )
            .await?
            .map_or(Credits::ZERO, |lapse| lapse.amount);
            account::Entity::update_many()
                .col_expr(
                    account::Column::SubscriptionEndsAt,
                    Expr::value(moment_value(txn.get_database_backend(), period_end)),
                )
                .filter(account::Column::Id.eq(account.0))
                .exec(&txn)
                .await?;
        }
        let (column, other) = match bucket {
            Bucket::Subscription => (
                account::Column::SubscriptionCredits,
                account::Column::TopupCredits,
            ),
            Bucket::Topup => (
                account::Column::TopupCredits,
                account::Column::SubscriptionCredits,
            ),
        };
        // Neither the bucket nor the total may pass the largest balance; written so that no
        // step of the check can overflow itself (every bucket is >= 0).
        let room = Credits::MAX.get() - amount.get();
        let credited = account::Entity::update_many()
            .col_expr(column, Expr::col(column).add(amount.get()))
            .filter(account::Column::Id.eq(account.0))
            .filter(Expr::col(column).lte(room))
            .filter(Expr::col(other).lte(Expr::val(room).sub(Expr::col(column))))
            .exec(&txn)
            .await?;
        if credited.rows_affected != 1 {
            txn.rollback().await?;
            return Err(BalanceOverflow {
                account,
                bucket,
                amount,
            }
            .into());
        }
        credit_grant::ActiveModel {
            id: NotSet,
            account_id: Set(account.0),
            bucket: Set(bucket.as_str().to_owned()),
            amount: Set(amount.get()),
            created_at: Set(Utc::now()),
            reason: Set(reason.map(str::to_owned)),
            idempotency_key: Set(idempotency_key.map(str::to_owned)),
        }
        .insert(&txn)
        .await?;
        let balance = net(&txn, &locked_account(&txn, account).await?).await?;
        txn.commit().await?;
        Ok(Some(Granted {
            balance,
            applied: true,
            lapsed,
        }))
    }
}

/// Marks the code redeemed by `account` at `at` if it is neither redeemed nor revoked; whether
/// it was.
async fn claim_code(
    txn: &DatabaseTransaction,
    code: &CodeHash,
    account: AccountId,
    at: DateTime<Utc>,
) -> Result<bool, StoreError> {
    let backend = txn.get_database_backend();
    let claimed = code::Entity::update_many()
        .col_expr(
            code::Column::RedeemedAt,
            Expr::value(moment_value(backend, Some(at))),
        )
        .col_expr(code::Column::AccountId, Expr::value(account.0))
        .filter(code::Column::CodeHash.eq(code.as_str()))
        .filter(code::Column::RedeemedAt.is_null())
        .filter(code::Column::RevokedAt.is_null())
        .exec(txn)
        .await?;
    Ok(claimed.rows_affected == 1)
}
