//! Redemption codes in the in-memory store: a code is claimed and its grant applied under the
//! one lock, so it grants once.

use async_trait::async_trait;
use chrono::{DateTime, Utc};

use super::state::{CodeRow, MemoryStore};
use crate::call::AccountId;
use crate::codes::CodeHash;
use crate::store::records::{CodeBatch, NewCodeBatch, Redeemed, redemption_reason};
use crate::store::rules::codes::{CodeState, redeemable};
use crate::store::traits::RedemptionCodes;
use crate::store::types::{StoreError, check_grant_amount};

#[async_trait]
impl RedemptionCodes for MemoryStore {
    async fn create_code_batch(&self, batch: NewCodeBatch<'_>) -> Result<CodeBatch, StoreError> {
        check_grant_amount(batch.credits)?;
        let mut state = self.lock();
        if batch
            .codes
            .iter()
            .any(|code| state.codes.contains_key(code))
        {
            return Err(StoreError::Invalid("a code is already stored".into()));
        }
        let id = state
            .code_batches
            .keys()
            .next_back()
            .map_or(1, |last| last + 1);
        let listed = CodeBatch {
            id,
            label: batch.label.map(str::to_owned),
            credits: batch.credits,
            bucket: batch.bucket,
            period_days: batch.period_days,
            expires_at: batch.expires_at,
            created_at: batch.at,
            count: batch.codes.len() as u64,
            used: 0,
            revoked: 0,
        };
        state.code_batches.insert(id, listed.clone());
        for code in batch.codes {
            state.codes.insert(
                code.clone(),
                CodeRow {
                    batch: id,
                    spent: false,
                },
            );
        }
        Ok(listed)
    }

    async fn code_batches(&self) -> Result<Vec<CodeBatch>, StoreError> {
        Ok(self.lock().code_batches.values().rev().cloned().collect())
    }

    async fn revoke_code_batch(
        &self,
        batch: i64,
        at: DateTime<Utc>,
    ) -> Result<Option<CodeBatch>, StoreError> {
        let _ = at;
        let mut state = self.lock();
        if !state.code_batches.contains_key(&batch) {
            return Ok(None);
        }
        let mut revoked = 0;
        for code in state.codes.values_mut() {
            if code.batch == batch && !code.spent {
                code.spent = true;
                revoked += 1;
            }
        }
        let listed = state
            .code_batches
            .get_mut(&batch)
            .expect("checked above, under the same lock");
        listed.revoked += revoked;
        Ok(Some(listed.clone()))
    }

    async fn redeem_code(
        &self,
        account: AccountId,
        code: &CodeHash,
        at: DateTime<Utc>,
    ) -> Result<Option<Redeemed>, StoreError> {
        let mut state = self.lock();
        let Some(row) = state.codes.get(code) else {
            return Ok(None);
        };
        let batch = state.code_batches[&row.batch].clone();
        // A revoked code is marked spent here.
        let terms = CodeState {
            used: row.spent,
            revoked: false,
            expires_at: batch.expires_at,
        };
        if !redeemable(terms, at) {
            return Ok(None);
        }
        let reason = redemption_reason(batch.id);
        let granted = state.grant(account, batch.grant(&reason, at))?;
        // The grant succeeded: only now is the code spent.
        if let Some(row) = state.codes.get_mut(code) {
            row.spent = true;
        }
        if let Some(listed) = state.code_batches.get_mut(&batch.id) {
            listed.used += 1;
        }
        Ok(Some(Redeemed {
            batch: batch.id,
            credits: batch.credits,
            bucket: batch.bucket,
            balance: granted.balance,
            lapsed: granted.lapsed,
        }))
    }
}

/// The memory store records no webhook events (the defaults).
#[async_trait]
impl crate::store::traits::EventOutbox for MemoryStore {}
