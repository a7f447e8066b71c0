//! Redemption codes as the operator handles them: create a batch (its codes shown once), list
//! the batches with what is used, revoke what is not.

use chrono::{DateTime, Utc};
use serde::Serialize;

use super::requests::NewCodes;
use super::{Admin, AdminError};
use crate::codes::NewCode;
use crate::credits::{Bucket, Credits};
use crate::error::GatewayError;
use crate::store::{CodeBatch, NewCodeBatch, Store};

/// A batch as listed.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct CodeBatchView {
    /// The batch's id.
    pub batch: i64,
    /// The operator's label.
    pub label: Option<String>,
    /// What each code grants.
    pub credits: Credits,
    /// The bucket it goes to.
    pub bucket: Bucket,
    /// Subscription only: the period a code starts, in days from its redemption.
    pub period_days: Option<u32>,
    /// When the codes stop working; `null`: never.
    pub expires_at: Option<DateTime<Utc>>,
    /// When the batch was made.
    pub created_at: DateTime<Utc>,
    /// How many codes it has.
    pub count: u64,
    /// How many were redeemed.
    pub used: u64,
    /// How many can still be redeemed (none once the batch expired).
    pub unused: u64,
    /// How many unused codes were revoked.
    pub revoked: u64,
}

impl CodeBatchView {
    fn of(batch: CodeBatch, now: DateTime<Utc>) -> CodeBatchView {
        CodeBatchView {
            unused: batch.unused(now),
            batch: batch.id,
            label: batch.label,
            credits: batch.credits,
            bucket: batch.bucket,
            period_days: batch.period_days,
            expires_at: batch.expires_at,
            created_at: batch.created_at,
            count: batch.count,
            used: batch.used,
            revoked: batch.revoked,
        }
    }
}

/// A new batch and its codes, in clear: the only time they are shown.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct CreatedCodes {
    /// The batch, as listed.
    #[serde(flatten)]
    pub batch: CodeBatchView,
    /// The codes.
    pub codes: Vec<String>,
}

/// The batches, newest first.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct CodeBatchList {
    /// Always `"list"`.
    pub object: &'static str,
    /// The batches.
    pub data: Vec<CodeBatchView>,
}

/// Webhook deliveries, newest first.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct DeliveryList {
    /// Always `"list"`.
    pub object: &'static str,
    /// The deliveries: `id`, `event_id`, `type`, `status`, `attempts`, `next_attempt_at`,
    /// `last_status`, `last_error`, `created_at`, `delivered_at`.
    pub data: Vec<crate::store::Delivery>,
}

impl<S: Store> Admin<S> {
    /// The newest webhook deliveries (at most `limit`, default [`DEFAULT_PAGE`](super::DEFAULT_PAGE)),
    /// optionally of one status.
    pub async fn deliveries(
        &self,
        status: Option<crate::store::DeliveryStatus>,
        limit: Option<u64>,
    ) -> Result<DeliveryList, AdminError> {
        let limit = super::page_size(limit);
        Ok(DeliveryList {
            object: "list",
            data: self.store.deliveries(status, limit).await?,
        })
    }

    /// Tries delivery `id` again at once (pending again, whatever it was).
    pub async fn retry_delivery(&self, id: i64) -> Result<crate::store::Delivery, AdminError> {
        Ok(self
            .store
            .retry_delivery(id, Utc::now())
            .await?
            .ok_or(GatewayError::NoSuchDelivery)?)
    }

    /// Creates a batch of codes; the answer holds them in clear, once.
    pub async fn create_codes(&self, new: &NewCodes) -> Result<CreatedCodes, AdminError> {
        let now = Utc::now();
        new.check(now)?;
        let codes: Vec<NewCode> = (0..new.count).map(|_| NewCode::generate()).collect();
        let hashes: Vec<_> = codes.iter().map(NewCode::hash).collect();
        let batch = self
            .store
            .create_code_batch(NewCodeBatch {
                label: new.label.as_deref(),
                credits: new.credits,
                bucket: new.bucket,
                period_days: new.period_days,
                expires_at: new.expires_at,
                codes: &hashes,
                at: now,
            })
            .await?;
        Ok(CreatedCodes {
            batch: CodeBatchView::of(batch, now),
            codes: codes.iter().map(|code| code.reveal().to_owned()).collect(),
        })
    }

    /// Every batch, newest first, with its used and unused counts.
    pub async fn code_batches(&self) -> Result<CodeBatchList, AdminError> {
        let now = Utc::now();
        Ok(CodeBatchList {
            object: "list",
            data: self
                .store
                .code_batches()
                .await?
                .into_iter()
                .map(|batch| CodeBatchView::of(batch, now))
                .collect(),
        })
    }

    /// Revokes the batch's unused codes; those already redeemed stay granted.
    pub async fn revoke_codes(&self, batch: i64) -> Result<CodeBatchView, AdminError> {
        let now = Utc::now();
        let batch = self
            .store
            .revoke_code_batch(batch, now)
            .await?
            .ok_or(GatewayError::NoSuchCodeBatch)?;
        Ok(CodeBatchView::of(batch, now))
    }
}
