//! [`Ledger`] on the sea-orm store: each charging mode's reserve, settle and refund.

use async_trait::async_trait;
use chrono::Utc;
use sea_orm::{ColumnTrait, EntityTrait, QueryFilter, QueryOrder, QuerySelect};

use crate::credits::Balance;
use crate::store::{
    AccountId, CallFailure, CallId, CallStatus, CallSuccess, ChargeRequest, Ledger, Reservation,
    ReserveError, StoreError,
};

use super::entity::{account, call};
use super::jobs::Reply;
use super::rows::balance_of;
use super::writes::{OwnedCharge, Write, unknown_account};
use super::{SeaOrmStore, idempotent, leases};

#[async_trait]
impl Ledger for SeaOrmStore {
    async fn reserve(&self, request: ChargeRequest<'_>) -> Result<Reservation, ReserveError> {
        let mut charge = OwnedCharge::from(request);
        charge.instance = self.lease.for_reservation()?;
        let reserved = match request.idempotency {
            Some(key) => {
                // Held reservations count as spent: none may change while this one is decided.
                let holds = self.freeze_holds().await;
                let window = self.idempotency_window;
                let account = charge.caller.account.0;
                // A keyed call is reserved in the database: subscription credits in this
                // instance's escrow go back first, to be spent before the row's top-up credits.
                if let (Some(escrow), Some(lease)) = (&self.escrow, charge.instance)
                    && escrow.has_free_subscription(lease, account)
                {
                    escrow.give_back(lease, Some(account)).await?;
                }
                let reserve =
                    || idempotent::reserve(&self.db, charge.clone(), key, window, holds.as_deref());
                let mut reserved = reserve().await;
                if let (Err(ReserveError::InsufficientCredits), Some(escrow), Some(lease)) =
                    (&reserved, &self.escrow, charge.instance)
                {
                    // The account's credits may be in this instance's escrow: give back what is
                    // free there and try once more; then in other instances' (an escrow instance
                    // owns no file, so nothing is frozen while they are recalled).
                    escrow.give_back(lease, Some(account)).await?;
                    reserved = reserve().await;
                    if let Err(ReserveError::InsufficientCredits) = reserved
                        && escrow.recall(account, lease).await?
                    {
                        reserved = reserve().await;
                    }
                }
                reserved
            }
            None => self.reserve_unkeyed(charge).await,
        };
        if let Err(ReserveError::KeyRevoked) = reserved {
            self.keys.forget_id(request.caller.key);
        }
        reserved
    }

    async fn settle(&self, call: CallId, success: CallSuccess) -> Result<bool, StoreError> {
        if let Some(escrow) = self.escrow.as_ref().filter(|escrow| escrow.holds(call)) {
            return escrow.settle(call, success).await;
        }
        let Some(owned) = &self.owned else {
            if success.reply.is_some() {
                return idempotent::settle(&self.db, call, success).await;
            }
            return self.committer.settle(call, success).await;
        };
        // Queued under the holds' lock, in order with reservations and refunds (see
        // `reserve_unkeyed`).
        let slot = self.committer.slot().await?;
        let answer = {
            let mut state = owned.holds.lock();
            // A keyed call, reserved in the database: a held one has no key, and so no record
            // to keep its reply in, and the committer settles it.
            if success.reply.is_some() && state.holds.call(call.0).is_none() {
                Err(success)
            } else {
                Ok(slot.queue(&mut state, Write::Settle(call, success), Reply::Finish))
            }
        };
        match answer {
            Ok(answer) => answer.wait().await,
            Err(success) => idempotent::settle(&self.db, call, success).await,
        }
    }

    async fn forget_idempotent_calls(&self, now: chrono::DateTime<Utc>) -> Result<u64, StoreError> {
        idempotent::forget(&self.db, now, self.idempotency_window).await
    }

    async fn refund(&self, call: CallId, failure: &CallFailure) -> Result<bool, StoreError> {
        if let Some(escrow) = self.escrow.as_ref().filter(|escrow| escrow.holds(call)) {
            return escrow.refund(call, failure).await;
        }
        if let Some(owned) = &self.owned {
            // Queued under the holds' lock: see `reserve_unkeyed`.
            let slot = self.committer.slot().await?;
            let answer = {
                let mut state = owned.holds.lock();
                let refund = Write::Refund(call, failure.clone());
                slot.queue(&mut state, refund, Reply::Finish)
            };
            return answer.wait().await;
        }
        self.committer.refund(call, failure.clone()).await
    }

    async fn pending_for_request(
        &self,
        account: AccountId,
        request_id: &str,
    ) -> Result<Vec<CallId>, StoreError> {
        let ids: Vec<i64> = call::Entity::find()
            .select_only()
            .column(call::Column::Id)
            .filter(call::Column::AccountId.eq(account.0))
            .filter(call::Column::Status.eq(CallStatus::Pending.as_str()))
            .filter(call::Column::RequestId.eq(request_id))
            .into_tuple()
            .all(&self.db)
            .await?;
        Ok(ids.into_iter().map(CallId).collect())
    }

    async fn call_status(&self, call: CallId) -> Result<Option<CallStatus>, StoreError> {
        let status: Option<String> = call::Entity::find_by_id(call.0)
            .select_only()
            .column(call::Column::Status)
            .into_tuple()
            .one(&self.db)
            .await?;
        status
            .map(|status| {
                CallStatus::parse(&status)
                    .ok_or_else(|| StoreError::msg(format!("unknown status {status}")))
            })
            .transpose()
    }

    async fn stale_reservations(
        &self,
        cutoff: chrono::DateTime<Utc>,
        limit: u64,
    ) -> Result<Vec<CallId>, StoreError> {
        let ids: Vec<i64> = call::Entity::find()
            .select_only()
            .column(call::Column::Id)
            .filter(call::Column::Status.eq(CallStatus::Pending.as_str()))
            .filter(call::Column::CreatedAt.lt(cutoff))
            .filter(leases::unprotected(Utc::now()))
            .order_by_asc(call::Column::CreatedAt)
            .limit(limit)
            .into_tuple()
            .all(&self.db)
            .await?;
        Ok(ids.into_iter().map(CallId).collect())
    }

    async fn balance(&self, account: AccountId) -> Result<Balance, StoreError> {
        let row = async || {
            account::Entity::find_by_id(account.0)
                .one(&self.db)
                .await?
                .map(|row| balance_of(&row))
                .ok_or_else(|| unknown_account(account))
        };
        if let Some(holds) = self.freeze_holds().await {
            return Ok(holds.net(account.0, row().await?));
        }
        self.with_escrow_of(&self.db, account, row().await?).await
    }
}
