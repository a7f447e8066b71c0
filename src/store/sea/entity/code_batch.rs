//! `mg_code_batches`: the terms of a batch of redemption codes.

use sea_orm::entity::prelude::*;

/// One batch.
#[derive(Clone, Debug, PartialEq, Eq, DeriveEntityModel)]
#[sea_orm(table_name = "mg_code_batches")]
pub(crate) struct Model {
    /// Batch id.
    #[sea_orm(primary_key)]
    pub id: i64,
    /// The operator's label.
    pub label: Option<String>,
    /// Credits each code grants, positive.
    pub credits: i64,
    /// `subscription` or `topup`.
    pub bucket: String,
    /// Subscription only: the period a code starts, in days.
    pub period_days: Option<i32>,
    /// When the codes stop working.
    pub expires_at: Option<DateTimeUtc>,
    /// When the batch was made.
    pub created_at: DateTimeUtc,
}

/// No relations are navigated through the ORM.
#[derive(Copy, Clone, Debug, EnumIter, DeriveRelation)]
pub(crate) enum Relation {}

impl ActiveModelBehavior for ActiveModel {}
