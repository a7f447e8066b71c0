//! Redemption codes on the sea-orm backend. A code is claimed by a guarded update of its row
//! (`... WHERE redeemed_at IS NULL AND revoked_at IS NULL`) in the transaction of its grant,
//! after the account's row is locked: a code grants once, whatever the concurrency and however
//! many gateways share the database.

use async_trait::async_trait;
use chrono::{DateTime, Utc};
use sea_orm::sea_query::{Expr, ExprTrait};
use sea_orm::{
    ActiveModelTrait, ColumnTrait, EntityTrait, NotSet, QueryFilter, QueryOrder, QuerySelect, Set,
    TransactionTrait,
};

use super::entity::{code, code_batch};
use super::rows::moment_value;
use super::store::SeaOrmStore;
use crate::call::AccountId;
use crate::codes::CodeHash;
use crate::credits::{Bucket, Credits};
use crate::events::{EventType, WebhookEvent};
use crate::store::records::{CodeBatch, NewCodeBatch, Redeemed, redemption_reason};
use crate::store::rules::codes::{CodeState, redeemable};
use crate::store::traits::RedemptionCodes;
use crate::store::types::{StoreError, check_grant_amount};

/// Codes written per statement (`SQLite` takes at most 32,766 parameters).
const CODES_PER_INSERT: usize = 1000;

/// Per batch: how many codes, how many redeemed, how many revoked.
type Counts = (i64, i64, i64, i64);

fn listed(row: code_batch::Model, counts: Option<Counts>) -> Result<CodeBatch, StoreError> {
    let (_, count, used, revoked) = counts.unwrap_or_default();
    let number = |n: i64| u64::try_from(n).unwrap_or_default();
    Ok(CodeBatch {
        id: row.id,
        bucket: Bucket::parse(&row.bucket)
            .ok_or_else(|| StoreError::msg(format!("batch {}: unknown bucket", row.id)))?,
        label: row.label,
        credits: Credits(row.credits),
        period_days: row.period_days.and_then(|days| u32::try_from(days).ok()),
        expires_at: row.expires_at,
        created_at: row.created_at,
        count: number(count),
        used: number(used),
        revoked: number(revoked),
    })
}

impl SeaOrmStore {
    /// The counts of the batches whose id is in `only` (every batch when `None`).
    async fn code_counts(&self, only: Option<i64>) -> Result<Vec<Counts>, StoreError> {
        let mut select = code::Entity::find()
            .select_only()
            .column(code::Column::BatchId)
            .column_as(Expr::col(code::Column::CodeHash).count(), "count")
            .column_as(Expr::col(code::Column::RedeemedAt).count(), "used")
            .column_as(Expr::col(code::Column::RevokedAt).count(), "revoked")
            .group_by(code::Column::BatchId);
        if let Some(batch) = only {
            select = select.filter(code::Column::BatchId.eq(batch));
        }
        Ok(select.into_tuple::<Counts>().all(&self.db).await?)
    }

    async fn one_batch(&self, batch: i64) -> Result<Option<CodeBatch>, StoreError> {
        let Some(row) = code_batch::Entity::find_by_id(batch).one(&self.db).await? else {
            return Ok(None);
        };
        let counts = self.code_counts(Some(batch)).await?.pop();
        listed(row, counts).map(Some)
    }
}

#[async_trait]
impl RedemptionCodes for SeaOrmStore {
    async fn create_code_batch(&self, batch: NewCodeBatch<'_>) -> Result<CodeBatch, StoreError> {
        check_grant_amount(batch.credits)?;
        let period_days = batch
            .period_days
            .map(i32::try_from)
            .transpose()
            .map_err(|_| StoreError::Invalid("period_days is too large".into()))?;
        let txn = self.db.begin().await?;
        let row = code_batch::ActiveModel {
            id: NotSet,
            label: Set(batch.label.map(str::to_owned)),
            credits: Set(batch.credits.get()),
            bucket: Set(batch.bucket.as_str().to_owned()),
            period_days: Set(period_days),
            expires_at: Set(batch.expires_at),
            created_at: Set(batch.at),
        }
        .insert(&txn)
        .await?;
        for chunk in batch.codes.chunks(CODES_PER_INSERT) {
            code::Entity::insert_many(chunk.iter().map(|hash| code::ActiveModel {
                code_hash: Set(hash.as_str().to_owned()),
                batch_id: Set(row.id),
                redeemed_at: Set(None),
                account_id: Set(None),
                revoked_at: Set(None),
            }))
            .exec_without_returning(&txn)
            .await?;
        }
        txn.commit().await?;
        let count = batch.codes.len() as i64;
        listed(row, Some((0, count, 0, 0)))
    }

    async fn code_batches(&self) -> Result<Vec<CodeBatch>, StoreError> {
        let rows = code_batch::Entity::find()
            .order_by_desc(code_batch::Column::Id)
            .all(&self.db)
            .await?;
        let counts: std::collections::HashMap<i64, Counts> = self
            .code_counts(None)
            .await?
            .into_iter()
            .map(|counts| (counts.0, counts))
            .collect();
        rows.into_iter()
            .map(|row| {
                let counts = counts.get(&row.id).copied();
                listed(row, counts)
            })
            .collect()
    }

    async fn revoke_code_batch(
        &self,
        batch: i64,
        at: DateTime<Utc>,
    ) -> Result<Option<CodeBatch>, StoreError> {
        if code_batch::Entity::find_by_id(batch)
            .one(&self.db)
            .await?
            .is_none()
        {
            return Ok(None);
        }
        code::Entity::update_many()
            .col_expr(
                code::Column::RevokedAt,
                Expr::value(moment_value(self.db.get_database_backend(), Some(at))),
            )
            .filter(code::Column::BatchId.eq(batch))
            .filter(code::Column::RedeemedAt.is_null())
            .filter(code::Column::RevokedAt.is_null())
            .exec(&self.db)
            .await?;
        self.one_batch(batch).await
    }

    async fn redeem_code(
        &self,
        account: AccountId,
        code: &CodeHash,
        at: DateTime<Utc>,
    ) -> Result<Option<Redeemed>, StoreError> {
        // A first look, to learn the batch's terms (they never change) and to refuse what is
        // plainly spent without a write; the claim in the grant's transaction decides.
        let Some(row) = code::Entity::find_by_id(code.as_str().to_owned())
            .one(&self.db)
            .await?
        else {
            return Ok(None);
        };
        let Some(batch) = code_batch::Entity::find_by_id(row.batch_id)
            .one(&self.db)
            .await?
        else {
            return Ok(None);
        };
        let terms = CodeState {
            used: row.redeemed_at.is_some(),
            revoked: row.revoked_at.is_some(),
            expires_at: batch.expires_at,
        };
        if !redeemable(terms, at) {
            return Ok(None);
        }
        let batch = listed(batch, None)?;
        let reason = redemption_reason(batch.id);
        let grant = batch.grant(&reason, at);
        let data = serde_json::json!({
            "account": account,
            "batch": batch.id,
            "label": batch.label,
            "credits": batch.credits,
            "bucket": batch.bucket,
        });
        let redeemed = WebhookEvent::new(EventType::CodeRedeemed, data, at);
        let granted = self
            .grant_claiming(account, grant, Some((code, &redeemed)))
            .await?;
        Ok(granted.map(|granted| Redeemed {
            batch: batch.id,
            credits: batch.credits,
            bucket: batch.bucket,
            balance: granted.balance,
            lapsed: granted.lapsed,
        }))
    }
}
