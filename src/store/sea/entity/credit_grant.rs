//! `mg_credit_grants`: every credit that enters an account, so that balances can be audited
//! against `grants - charges`.

use sea_orm::entity::prelude::*;

/// A grant row.
#[derive(Clone, Debug, PartialEq, Eq, DeriveEntityModel)]
#[sea_orm(table_name = "mg_credit_grants")]
pub(crate) struct Model {
    /// Grant id.
    #[sea_orm(primary_key)]
    pub id: i64,
    /// Receiving account.
    pub account_id: i64,
    /// `subscription` or `topup`.
    pub bucket: String,
    /// Credits granted, positive.
    pub amount: i64,
    /// When.
    pub created_at: DateTimeUtc,
    /// Why, for the books.
    pub reason: Option<String>,
    /// Unique per account: a grant sent again with the same key is not applied again.
    pub idempotency_key: Option<String>,
}

/// No relations are navigated through the ORM.
#[derive(Copy, Clone, Debug, EnumIter, DeriveRelation)]
pub(crate) enum Relation {}

impl ActiveModelBehavior for ActiveModel {}
