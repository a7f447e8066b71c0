//! Who made each stored response (`mg_responses`): written once per response a provider keeps,
//! read when a client refers to one.

use async_trait::async_trait;
use chrono::{DateTime, Utc};
use sea_orm::sea_query::OnConflict;
use sea_orm::{ColumnTrait, EntityTrait, QueryFilter, Set};

use super::entity::response;
use super::store::SeaOrmStore;
use crate::call::AccountId;
use crate::store::{ResponseOwner, ResponseOwners, StoreError};

#[async_trait]
impl ResponseOwners for SeaOrmStore {
    async fn record_response(&self, owner: &ResponseOwner) -> Result<(), StoreError> {
        let row = response::ActiveModel {
            response_id: Set(owner.response_id.clone()),
            account_id: Set(owner.account.0),
            upstream: Set(owner.upstream.clone()),
            created_at: Set(chrono::Utc::now()),
        };
        // The first record stands: an id is never handed to another account.
        response::Entity::insert(row)
            .on_conflict(
                // `_on` names the key, which `MySQL` needs to say "nothing".
                OnConflict::column(response::Column::ResponseId)
                    .do_nothing_on([response::Column::ResponseId])
                    .to_owned(),
            )
            .try_insert()
            .exec(&self.db)
            .await
            .map(|_| ())
            .map_err(StoreError::database)
    }

    async fn response_owner(&self, response_id: &str) -> Result<Option<ResponseOwner>, StoreError> {
        let row = response::Entity::find_by_id(response_id.to_owned())
            .one(&self.db)
            .await
            .map_err(StoreError::database)?;
        Ok(row.map(|row| ResponseOwner {
            response_id: row.response_id,
            account: AccountId(row.account_id),
            upstream: row.upstream,
        }))
    }

    async fn forget_responses(&self, before: DateTime<Utc>) -> Result<u64, StoreError> {
        response::Entity::delete_many()
            .filter(response::Column::CreatedAt.lt(before))
            .exec(&self.db)
            .await
            .map(|deleted| deleted.rows_affected)
            .map_err(StoreError::database)
    }
}
