//! `mg_responses`: which account made which response a provider keeps, at which upstream.

use sea_orm::entity::prelude::*;

/// One stored response's owner.
#[derive(Clone, Debug, PartialEq, Eq, DeriveEntityModel)]
#[sea_orm(table_name = "mg_responses")]
pub(crate) struct Model {
    /// The provider's response id.
    #[sea_orm(primary_key, auto_increment = false)]
    pub response_id: String,
    /// The account whose call made it.
    pub account_id: i64,
    /// The catalogue name of the upstream that keeps it.
    pub upstream: String,
    /// When it was recorded.
    pub created_at: DateTimeUtc,
}

/// No relations are navigated through the ORM.
#[derive(Copy, Clone, Debug, EnumIter, DeriveRelation)]
pub(crate) enum Relation {}

impl ActiveModelBehavior for ActiveModel {}
