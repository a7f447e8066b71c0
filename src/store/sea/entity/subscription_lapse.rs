//! `mg_subscription_lapses`: subscription credits left when their period ended, taken out of
//! the account, so that the audit can count them.

use sea_orm::entity::prelude::*;

/// A lapse row.
#[derive(Clone, Debug, PartialEq, Eq, DeriveEntityModel)]
#[sea_orm(table_name = "mg_subscription_lapses")]
pub(crate) struct Model {
    /// Lapse id.
    #[sea_orm(primary_key)]
    pub id: i64,
    /// The account.
    pub account_id: i64,
    /// Subscription credits that lapsed, positive.
    pub amount: i64,
    /// The end of the period they belonged to.
    pub period_end: DateTimeUtc,
    /// When the lapse was recorded.
    pub created_at: DateTimeUtc,
}

/// No relations are navigated through the ORM.
#[derive(Copy, Clone, Debug, EnumIter, DeriveRelation)]
pub(crate) enum Relation {}

impl ActiveModelBehavior for ActiveModel {}
