//! `mg_idempotent_calls`: which call holds each account's idempotency key, and the reply kept
//! for its retries once it is billed.

use sea_orm::entity::prelude::*;

/// An idempotency record.
#[derive(Clone, Debug, PartialEq, Eq, DeriveEntityModel)]
#[sea_orm(table_name = "mg_idempotent_calls")]
pub(crate) struct Model {
    /// Record id.
    #[sea_orm(primary_key)]
    pub id: i64,
    /// The account; unique with `idem_key`.
    pub account_id: i64,
    /// The client's `Idempotency-Key`.
    pub idem_key: String,
    /// SHA-256 of the request's path and body, in hex.
    pub fingerprint: String,
    /// The call-log entry of the call holding the key.
    pub call_id: i64,
    /// When that call was reserved.
    pub created_at: DateTimeUtc,
    /// The kept reply's status, once the call is billed.
    pub reply_status: Option<i32>,
    /// The kept reply's `Content-Type`.
    pub reply_content_type: Option<String>,
    /// The kept reply's body.
    pub reply_body: Option<Vec<u8>>,
}

/// No relations are navigated through the ORM.
#[derive(Copy, Clone, Debug, EnumIter, DeriveRelation)]
pub(crate) enum Relation {}

impl ActiveModelBehavior for ActiveModel {}
