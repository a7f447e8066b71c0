//! `mg_accounts`: one credit pool per account, bucket by bucket. `CHECK`s keep both buckets
//! non-negative whatever the code does.

use sea_orm::entity::prelude::*;

/// An account row.
#[derive(Clone, Debug, PartialEq, Eq, DeriveEntityModel)]
#[sea_orm(table_name = "mg_accounts")]
pub(crate) struct Model {
    /// Account id.
    #[sea_orm(primary_key)]
    pub id: i64,
    /// Operator's label.
    pub name: String,
    /// Subscription credits left.
    pub subscription_credits: i64,
    /// Top-up credits left.
    pub topup_credits: i64,
    /// Creation time.
    pub created_at: DateTimeUtc,
    /// When the subscription credits stop being spendable and lapse; `NULL`: never.
    pub subscription_ends_at: Option<DateTimeUtc>,
    /// Below how many credits its balance is told (`account.balance_low`); `NULL`: the
    /// store's default.
    pub low_balance_credits: Option<i64>,
}

/// No relations are navigated through the ORM.
#[derive(Copy, Clone, Debug, EnumIter, DeriveRelation)]
pub(crate) enum Relation {}

impl ActiveModelBehavior for ActiveModel {}
