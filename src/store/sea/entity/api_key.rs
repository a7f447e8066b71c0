//! `mg_api_keys`: keys are stored as their SHA-256 only, plus a display prefix.

use sea_orm::entity::prelude::*;

/// An API key row.
#[derive(Clone, Debug, PartialEq, Eq, DeriveEntityModel)]
#[sea_orm(table_name = "mg_api_keys")]
pub(crate) struct Model {
    /// Key id.
    #[sea_orm(primary_key)]
    pub id: i64,
    /// Owning account.
    pub account_id: i64,
    /// SHA-256 of the key, lowercase hex.
    #[sea_orm(unique)]
    pub key_hash: String,
    /// The first characters of the key, to tell keys apart.
    pub display_prefix: String,
    /// Set when the key is revoked; a revoked key is refused.
    pub revoked_at: Option<DateTimeUtc>,
    /// Creation time.
    pub created_at: DateTimeUtc,
    /// The models the key may call, as a JSON array of names; `NULL`: all.
    pub models: Option<String>,
    /// When the key stops working; `NULL`: never.
    pub expires_at: Option<DateTimeUtc>,
    /// Requests per minute; `NULL`: no limit.
    pub rpm: Option<i32>,
    /// Credits the key may spend per period; `NULL`: no limit.
    pub limit_credits: Option<i64>,
    /// `day`, `week`, `month` or `none`; set with `limit_credits`.
    pub limit_period: Option<String>,
    /// What the key has spent (reserved and not refunded) in window `limit_window`.
    pub limit_spent: i64,
    /// The window `limit_spent` counts in ([`LimitPeriod::window`](crate::call::LimitPeriod::window)).
    pub limit_window: i64,
    /// The window in which `key.limit_reached` was last written; `NULL`: never.
    pub limit_alerted_window: Option<i64>,
}

/// No relations are navigated through the ORM.
#[derive(Copy, Clone, Debug, EnumIter, DeriveRelation)]
pub(crate) enum Relation {}

impl ActiveModelBehavior for ActiveModel {}
