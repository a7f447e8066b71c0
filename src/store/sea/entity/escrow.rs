//! `mg_escrows`: credits an instance moved out of an account's row to charge against (see
//! `SeaOrmStore::with_escrow`). They are still the account's: the balance and the audit count
//! them.

use sea_orm::entity::prelude::*;

/// An escrow row.
#[derive(Clone, Debug, PartialEq, Eq, DeriveEntityModel)]
#[sea_orm(table_name = "mg_escrows")]
pub(crate) struct Model {
    /// Whose credits.
    #[sea_orm(primary_key, auto_increment = false)]
    pub account_id: i64,
    /// The lease of the instance holding them.
    #[sea_orm(primary_key, auto_increment = false)]
    pub instance_id: i64,
    /// Subscription credits in escrow.
    pub subscription_credits: i64,
    /// Top-up credits in escrow.
    pub topup_credits: i64,
}

/// No relations are navigated through the ORM.
#[derive(Copy, Clone, Debug, EnumIter, DeriveRelation)]
pub(crate) enum Relation {}

impl ActiveModelBehavior for ActiveModel {}
