//! `mg_instances`: the leases of the gateway instances serving on this database.

use sea_orm::entity::prelude::*;

/// A lease row.
#[derive(Clone, Debug, PartialEq, Eq, DeriveEntityModel)]
#[sea_orm(table_name = "mg_instances")]
pub(crate) struct Model {
    /// Lease id, recorded on each reservation made under it.
    #[sea_orm(primary_key)]
    pub id: i64,
    /// The holder's host name, for the operator.
    pub host: String,
    /// The holder's process id, for the operator.
    pub pid: i64,
    /// When the lease was taken.
    pub started_at: DateTimeUtc,
    /// Until when it holds unless renewed.
    pub expires_at: DateTimeUtc,
}

/// No relations are navigated through the ORM.
#[derive(Copy, Clone, Debug, EnumIter, DeriveRelation)]
pub(crate) enum Relation {}

impl ActiveModelBehavior for ActiveModel {}
