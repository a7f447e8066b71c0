//! `mg_webhook_events`: one webhook event and its delivery.

use sea_orm::entity::prelude::*;

/// One event in the outbox.
#[derive(Clone, Debug, PartialEq, Eq, DeriveEntityModel)]
#[sea_orm(table_name = "mg_webhook_events")]
pub(crate) struct Model {
    /// Outbox row.
    #[sea_orm(primary_key)]
    pub id: i64,
    /// `evt_...`, the same on every delivery.
    #[sea_orm(unique)]
    pub event_id: String,
    /// `code.redeemed`, ...
    pub event_type: String,
    /// The JSON body delivered, exactly.
    #[sea_orm(column_type = "Text")]
    pub body: String,
    /// `pending`, `delivered` or `failed`.
    pub status: String,
    /// Attempts made.
    pub attempts: i32,
    /// When it is tried next (and until when a dispatcher holds it).
    pub next_attempt_at: DateTimeUtc,
    /// The endpoint's last status.
    pub last_status: Option<i32>,
    /// Why the last attempt failed.
    #[sea_orm(column_type = "Text", nullable)]
    pub last_error: Option<String>,
    /// When the event was written.
    pub created_at: DateTimeUtc,
    /// When the endpoint accepted it.
    pub delivered_at: Option<DateTimeUtc>,
}

/// No relations are navigated through the ORM.
#[derive(Copy, Clone, Debug, EnumIter, DeriveRelation)]
pub(crate) enum Relation {}

impl ActiveModelBehavior for ActiveModel {}
