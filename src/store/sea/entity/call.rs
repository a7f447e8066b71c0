//! `mg_calls`: the call log, one row per charged call, and the ledger's record of what each call
//! took from each bucket.

use sea_orm::entity::prelude::*;

/// A call-log row.
#[derive(Clone, Debug, PartialEq, Eq, DeriveEntityModel)]
#[sea_orm(table_name = "mg_calls")]
pub(crate) struct Model {
    /// Entry id.
    #[sea_orm(primary_key)]
    pub id: i64,
    /// Paying account.
    pub account_id: i64,
    /// Key used.
    pub key_id: i64,
    /// `chat_completions` or `messages`.
    pub protocol: String,
    /// Catalogue model name.
    pub model: String,
    /// The name the client called the model by, when it was an alias.
    pub requested_model: Option<String>,
    /// Price at the time of the call.
    pub price: i64,
    /// Taken from the subscription bucket.
    pub charged_subscription: i64,
    /// Taken from the top-up bucket.
    pub charged_topup: i64,
    /// `pending`, `ok` or `refunded`.
    pub status: String,
    /// Upstream HTTP status.
    pub upstream_status: Option<i32>,
    /// The upstream (channel) that served the call.
    pub upstream_channel: Option<String>,
    /// Upstream failure, for refunded calls.
    pub upstream_error: Option<String>,
    /// Prompt tokens.
    pub input_tokens: Option<i64>,
    /// Completion tokens.
    pub output_tokens: Option<i64>,
    /// Input tokens read from the provider's cache.
    pub cache_read_tokens: Option<i64>,
    /// Input tokens written to the provider's cache for 5 minutes.
    pub cache_write_tokens: Option<i64>,
    /// Input tokens written to the provider's cache for an hour.
    #[sea_orm(column_name = "cache_write_1h_tokens")]
    pub cache_write_1h_tokens: Option<i64>,
    /// Of the output tokens, those spent reasoning.
    pub reasoning_tokens: Option<i64>,
    /// What the cost of a call priced by tokens exceeded what its account could pay.
    pub shortfall: i64,
    /// Whether the provider's usage report failed the gateway's checks (charged the ceiling).
    pub usage_rejected: bool,
    /// Reservation time.
    pub created_at: DateTimeUtc,
    /// Settle or refund time.
    pub finished_at: Option<DateTimeUtc>,
    /// The request's `x-request-id`.
    pub request_id: Option<String>,
    /// The lease of the gateway instance that made the reservation (`mg_instances`).
    pub instance_id: Option<i64>,
    /// The tools a translated call's translation left out, comma-separated.
    pub dropped_tools: Option<String>,
    /// The protocol the channel that served the call spoke, when the upstream said.
    pub upstream_protocol: Option<String>,
    /// What the call cost the operator, in billionths of his currency.
    pub cost: Option<i64>,
    /// What a credit was worth when the call was settled, in billionths of the currency.
    pub credit_value: Option<i64>,
    /// The provider's usage object as it reported it.
    pub raw_usage: Option<String>,
    /// Whether a count the call was charged by is the gateway's own.
    pub usage_estimated: bool,
    /// The service tier the call was priced at.
    pub service_tier: Option<String>,
}

/// No relations are navigated through the ORM.
#[derive(Copy, Clone, Debug, EnumIter, DeriveRelation)]
pub(crate) enum Relation {}

impl ActiveModelBehavior for ActiveModel {}
