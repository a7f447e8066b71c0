//! `mg_codes`: one redemption code (its hash), and whether it was redeemed or revoked.

use sea_orm::entity::prelude::*;

/// One code.
#[derive(Clone, Debug, PartialEq, Eq, DeriveEntityModel)]
#[sea_orm(table_name = "mg_codes")]
pub(crate) struct Model {
    /// SHA-256 of the code's canonical form, hex.
    #[sea_orm(primary_key, auto_increment = false)]
    pub code_hash: String,
    /// Its batch.
    pub batch_id: i64,
    /// When it was redeemed.
    pub redeemed_at: Option<DateTimeUtc>,
    /// By which account.
    pub account_id: Option<i64>,
    /// When it was revoked, unused.
    pub revoked_at: Option<DateTimeUtc>,
}

/// No relations are navigated through the ORM.
#[derive(Copy, Clone, Debug, EnumIter, DeriveRelation)]
pub(crate) enum Relation {}

impl ActiveModelBehavior for ActiveModel {}
