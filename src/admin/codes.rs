//! Redemption codes as the operator handles them: create a batch (its codes shown once), list
//! the batches with what is used, revoke what is not.

use chrono::{DateTime, Utc};
use serde::Serialize;

use super::requests::NewCodes;
use super::{Admin, AdminError};
use crate::codes::NewCode;
use crate::error::GatewayError;
use crate::store::{CodeBatch, NewCodeBatch, Store};

/// A batch as listed: `batch` (its id), `label`, `credits`, `bucket`, `period_days`,
/// `expires_at`, `created_at`, `count`, `used`, `revoked`, and `unused`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct CodeBatchView {
    /// The batch as the store lists it.
    #[serde(flatten)]
    pub batch: CodeBatch,
    /// How many can still be redeemed (none once the batch expired).
    pub unused: u64,
}

impl CodeBatchView {
    fn of(batch: CodeBatch, now: DateTime<Utc>) -> CodeBatchView {
        CodeBatchView {
            unused: batch.unused(now),
            batch,
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
