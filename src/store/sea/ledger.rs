//! [`Ledger`] on the sea-orm store: each charging mode's reserve, settle and refund.

use async_trait::async_trait;
use chrono::Utc;
use sea_orm::{ColumnTrait, Condition, EntityTrait, QueryFilter, QuerySelect};

use crate::credits::{Balance, Credits};
use crate::store::{
    AccountId, CallFailure, CallId, CallStatus, CallSuccess, ChargeRequest, LeaseId, Ledger,
    Reservation, ReserveError, StoreError,
};

use super::entity::{account, call};
use super::rows::{balance_of, pending_ids};
use super::store::SeaOrmStore;
use super::writes::{OwnedCharge, unknown_account};
use super::{idempotent, leases};

#[async_trait]
impl Ledger for SeaOrmStore {
    async fn reserve(&self, request: ChargeRequest<'_>) -> Result<Reservation, ReserveError> {
        let mut charge = OwnedCharge::from(request);
        charge.instance = self.lease.for_reservation()?.map(LeaseId);
        // The keyed paths' futures are boxed apart: inline, they made this future (which
        // `async_trait` moves to the heap on every call) about 16 KB where a plain call's own
        // needs a tenth of that.
        let reserved = match request.idempotency {
            #[cfg(feature = "sqlite")]
            Some(key) if let super::mode::Mode::OwnedFile(owned) = &self.mode => {
                let window = self.idempotency_window;
                Box::pin(owned.reserve_keyed(self.writers(), charge, key, window)).await
            }
            Some(key) => {
                Box::pin(async {
                    // Held reservations count as spent: none may change while this one is decided.
                    let holds = self.freeze_holds().await;
                    let window = self.idempotency_window;
                    let alerting = self.events.alerting();
                    // `as_deref` turns an owned file's frozen guard into `&Holds`; in builds
                    // without `sqlite`, `Frozen` is already `&Holds`.
                    #[allow(clippy::needless_option_as_deref)]
                    let reserve = || {
                        let holds = holds.as_deref();
                        let reserved = idempotent::reserve(
                            &self.db,
                            charge.clone(),
                            key,
                            window,
                            holds,
                            alerting,
                        );
                        async move { reserved.await.map(|(reservation, _)| reservation) }
                    };
                    self.mode.reserve_keyed(&charge, reserve).await
                })
                .await
            }
            None => self.mode.reserve(self.writers(), charge).await,
        };
        if let Err(ReserveError::KeyRevoked) = reserved {
            self.keys.forget_id(request.caller.key);
        }
        reserved
    }

    async fn settle(&self, call: CallId, success: CallSuccess) -> Result<bool, StoreError> {
        self.mode.settle(self.writers(), call, success).await
    }

    async fn forget_idempotent_calls(&self, now: chrono::DateTime<Utc>) -> Result<u64, StoreError> {
        #[cfg(feature = "sqlite")]
        if let super::mode::Mode::OwnedFile(owned) = &self.mode {
            return owned
                .forget_keyed(&self.db, now, self.idempotency_window)
                .await;
        }
        idempotent::forget(&self.db, now, self.idempotency_window).await
    }

    async fn refund(&self, call: CallId, failure: &CallFailure) -> Result<bool, StoreError> {
        self.mode.refund(self.writers(), call, failure).await
    }

    async fn pending_for_request(
        &self,
        account: AccountId,
        request_id: &str,
    ) -> Result<Vec<CallId>, StoreError> {
        let which = Condition::all()
            .add(call::Column::AccountId.eq(account.0))
            .add(call::Column::RequestId.eq(request_id));
        pending_ids(&self.db, which, call::Column::Id, None).await
    }

    async fn charged(&self, call: CallId) -> Result<Option<Credits>, StoreError> {
        let price: Option<i64> = call::Entity::find_by_id(call.0)
            .select_only()
            .column(call::Column::Price)
            .filter(call::Column::Status.eq(CallStatus::Ok.as_str()))
            .into_tuple()
            .one(&self.db)
            .await?;
        Ok(price.map(Credits))
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
        let which = Condition::all()
            .add(call::Column::CreatedAt.lt(cutoff))
            .add(leases::unprotected(Utc::now()));
        pending_ids(&self.db, which, call::Column::CreatedAt, Some(limit)).await
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
            return Ok(holds.net(account, row().await?));
        }
        self.with_escrow_of(&self.db, account, row().await?).await
    }
}
