//! What the upkeep asks of the sea-orm store: its instance lease, and the reservations of
//! instances that stopped.

use async_trait::async_trait;
use chrono::Utc;

use super::leases;
use super::store::SeaOrmStore;
use crate::store::LeaseId;
use crate::store::{CallId, StoreError};

#[async_trait]
impl crate::store::Leases for SeaOrmStore {
    async fn take_lease(
        &self,
        now: chrono::DateTime<Utc>,
        ttl: std::time::Duration,
    ) -> Result<Option<LeaseId>, StoreError> {
        leases::take(&self.db, self.sqlite_file.as_deref(), &self.lease, now, ttl)
            .await
            .map(Some)
    }

    async fn renew_lease(
        &self,
        now: chrono::DateTime<Utc>,
        ttl: std::time::Duration,
    ) -> Result<bool, StoreError> {
        leases::renew(&self.db, &self.lease, now, ttl).await
    }

    async fn release_lease(&self) -> Result<(), StoreError> {
        self.mode.release(self.lease.current().map(LeaseId)).await?;
        leases::release(&self.db, &self.lease).await
    }

    async fn orphaned_reservations(
        &self,
        now: chrono::DateTime<Utc>,
        limit: u64,
    ) -> Result<Vec<CallId>, StoreError> {
        leases::end_dead_holders(&self.db, self.sqlite_file.as_deref(), &self.lease, now).await?;
        // Never the calls this process still serves under a lease it lost (an outage longer
        // than the lease), nor the escrow they are held against: they settle or refund
        // themselves when they end.
        let own_lost = self.lease.lost();
        // Escrow held under an ended lease goes back to its accounts before its calls are
        // refunded.
        #[cfg(feature = "postgres")]
        super::escrow::give_back_ended(&self.db, now, None, &own_lost).await?;
        leases::orphaned(&self.db, now, limit, &own_lost).await
    }

    async fn forget_ended_leases(&self, now: chrono::DateTime<Utc>) -> Result<u64, StoreError> {
        leases::forget_ended(&self.db, now).await
    }
}
