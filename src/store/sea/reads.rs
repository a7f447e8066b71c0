//! What the sea-orm store answers from its rows: active keys, and the call log.

use async_trait::async_trait;
use chrono::Utc;
use sea_orm::sea_query::Expr;
use sea_orm::{ColumnTrait, EntityTrait, QueryFilter, QueryOrder, QuerySelect};

use crate::credits::Credits;
use crate::keys::KeyHash;
use crate::money::Money;
use crate::protocol::{Protocol, ServiceTier};
use crate::store::{
    AccountId, ActiveKey, CallId, CallLog, CallQuery, CallRecord, CallStatus, Caller, DailyUsage,
    KeyId, KeyStore, ReportGroup, ReportQuery, ReportRow, StoreError,
};

use super::accounts;
use super::entity::{api_key, call};
use super::store::SeaOrmStore;

#[async_trait]
impl KeyStore for SeaOrmStore {
    /// Answers from the store's cache of active keys when it can (see [`Ledger::reserve`](crate::store::Ledger::reserve) for
    /// how a key revoked since is refused).
    async fn active_key(&self, key: &KeyHash) -> Result<Option<ActiveKey>, StoreError> {
        if let Some(active) = self.keys.get(key) {
            return Ok(Some(active));
        }
        let found = api_key::Entity::find()
            .filter(api_key::Column::KeyHash.eq(key.as_str()))
            .filter(api_key::Column::RevokedAt.is_null())
            .one(&self.db)
            .await?;
        let Some(row) = found else {
            return Ok(None);
        };
        let active = ActiveKey {
            caller: Caller {
                account: AccountId(row.account_id),
                key: KeyId(row.id),
            },
            rules: accounts::key_rules(&row)?,
        };
        self.keys.remember(key, active.clone());
        Ok(Some(active))
    }
}

fn call_record(row: call::Model) -> Result<CallRecord, StoreError> {
    let protocol = Protocol::parse(&row.protocol)
        .ok_or_else(|| StoreError::msg(format!("unknown protocol {}", row.protocol)))?;
    let status = CallStatus::parse(&row.status)
        .ok_or_else(|| StoreError::msg(format!("unknown status {}", row.status)))?;
    Ok(CallRecord {
        id: CallId(row.id),
        account: AccountId(row.account_id),
        key: KeyId(row.key_id),
        protocol,
        model: row.model,
        requested_model: row.requested_model,
        price: Credits(row.price),
        charged_subscription: Credits(row.charged_subscription),
        charged_topup: Credits(row.charged_topup),
        status,
        upstream_status: row.upstream_status.and_then(|s| u16::try_from(s).ok()),
        channel: row.upstream_channel,
        upstream_protocol: row.upstream_protocol.as_deref().and_then(Protocol::parse),
        dropped_tools: row.dropped_tools,
        upstream_error: row.upstream_error,
        input_tokens: row.input_tokens,
        output_tokens: row.output_tokens,
        cache_read_tokens: row.cache_read_tokens,
        cache_write_tokens: row.cache_write_tokens,
        cache_write_1h_tokens: row.cache_write_1h_tokens,
        reasoning_tokens: row.reasoning_tokens,
        shortfall: Credits(row.shortfall),
        usage_rejected: row.usage_rejected,
        usage_estimated: row.usage_estimated,
        service_tier: row.service_tier.as_deref().and_then(ServiceTier::parse),
        raw_usage: row.raw_usage,
        cost: row.cost.map(Money::from_nanos),
        credit_value: row.credit_value.map(Money::from_nanos),
        margin: CallRecord::margin_of(
            Credits(row.price),
            row.cost.map(Money::from_nanos),
            row.credit_value.map(Money::from_nanos),
        ),
        created_at: row.created_at,
        finished_at: row.finished_at,
        request_id: row.request_id,
    })
}

#[async_trait]
impl CallLog for SeaOrmStore {
    async fn usage(
        &self,
        account: AccountId,
        since: chrono::DateTime<Utc>,
    ) -> Result<Vec<DailyUsage>, StoreError> {
        // The UTC day of a call, as each database writes it.
        let (day, integer) = match self.db.get_database_backend() {
            sea_orm::DbBackend::Postgres => (
                "to_char(created_at AT TIME ZONE 'UTC', 'YYYY-MM-DD')",
                "BIGINT",
            ),
            sea_orm::DbBackend::MySql => ("DATE_FORMAT(created_at, '%Y-%m-%d')", "SIGNED"),
            _ => ("substr(created_at, 1, 10)", "BIGINT"),
        };
        let sum = |of: &str| Expr::cust(format!("CAST(COALESCE(SUM({of}), 0) AS {integer})"));
        type Row = (String, String, i64, i64, i64, i64, i64, i64);
        let rows: Vec<Row> = call::Entity::find()
            .select_only()
            .column_as(Expr::cust(day), "day")
            .column(call::Column::Model)
            .column_as(Expr::cust(format!("CAST(COUNT(*) AS {integer})")), "calls")
            .column_as(sum("price"), "credits")
            .column_as(sum("input_tokens"), "input_tokens")
            .column_as(sum("output_tokens"), "output_tokens")
            .column_as(sum("cache_read_tokens"), "cache_read_tokens")
            .column_as(
                sum("COALESCE(cache_write_tokens, 0) + COALESCE(cache_write_1h_tokens, 0)"),
                "cache_write_tokens",
            )
            .filter(call::Column::AccountId.eq(account.0))
            .filter(call::Column::Status.eq(CallStatus::Ok.as_str()))
            .filter(call::Column::CreatedAt.gte(since))
            .group_by(Expr::cust(day))
            .group_by(call::Column::Model)
            .order_by_asc(Expr::cust(day))
            .order_by_asc(call::Column::Model)
            .into_tuple()
            .all(&self.db)
            .await?;
        Ok(rows
            .into_iter()
            .map(
                |(day, model, calls, credits, input, output, read, written)| DailyUsage {
                    day,
                    model,
                    calls,
                    credits,
                    input_tokens: input,
                    output_tokens: output,
                    cache_read_tokens: read,
                    cache_write_tokens: written,
                },
            )
            .collect())
    }

    async fn usage_report(&self, query: ReportQuery) -> Result<Vec<ReportRow>, StoreError> {
        let backend = self.db.get_database_backend();
        let (day, integer, text) = match backend {
            sea_orm::DbBackend::Postgres => (
                "to_char(created_at AT TIME ZONE 'UTC', 'YYYY-MM-DD')",
                "BIGINT",
                "TEXT",
            ),
            sea_orm::DbBackend::MySql => ("DATE_FORMAT(created_at, '%Y-%m-%d')", "SIGNED", "CHAR"),
            _ => ("substr(created_at, 1, 10)", "BIGINT", "TEXT"),
        };
        let group = match query.group_by {
            ReportGroup::Day => day.to_owned(),
            ReportGroup::Model => "model".to_owned(),
            ReportGroup::Channel => "COALESCE(upstream_channel, '')".to_owned(),
            ReportGroup::Account => format!("CAST(account_id AS {text})"),
            ReportGroup::Key => format!("CAST(key_id AS {text})"),
        };
        let sum = |of: &str| Expr::cust(format!("CAST(COALESCE(SUM({of}), 0) AS {integer})"));
        let costed = "cost IS NOT NULL AND credit_value IS NOT NULL";
        #[derive(sea_orm::FromQueryResult)]
        struct Sums {
            report_group: String,
            calls: i64,
            estimated_calls: i64,
            input_tokens: i64,
            output_tokens: i64,
            cache_read_tokens: i64,
            cache_write_tokens: i64,
            cache_write_1h_tokens: i64,
            reasoning_tokens: i64,
            credits: i64,
            costed_calls: i64,
            cost: i64,
            margin: i64,
        }
        let rows: Vec<Sums> = call::Entity::find()
            .select_only()
            .column_as(Expr::cust(group.clone()), "report_group")
            .column_as(Expr::cust(format!("CAST(COUNT(*) AS {integer})")), "calls")
            .column_as(
                sum("CASE WHEN usage_estimated THEN 1 ELSE 0 END"),
                "estimated_calls",
            )
            .column_as(sum("input_tokens"), "input_tokens")
            .column_as(sum("output_tokens"), "output_tokens")
            .column_as(sum("cache_read_tokens"), "cache_read_tokens")
            .column_as(sum("cache_write_tokens"), "cache_write_tokens")
            .column_as(sum("cache_write_1h_tokens"), "cache_write_1h_tokens")
            .column_as(sum("reasoning_tokens"), "reasoning_tokens")
            .column_as(sum("price"), "credits")
            .column_as(
                sum("CASE WHEN cost IS NOT NULL THEN 1 ELSE 0 END"),
                "costed_calls",
            )
            .column_as(sum("cost"), "cost")
            .column_as(
                sum(&format!(
                    "CASE WHEN {costed} THEN price * credit_value - cost ELSE 0 END"
                )),
                "margin",
            )
            .filter(call::Column::Status.eq(CallStatus::Ok.as_str()))
            .filter(call::Column::CreatedAt.gte(query.from))
            .filter(call::Column::CreatedAt.lt(query.to))
            .group_by(Expr::cust(group))
            .into_model::<Sums>()
            .all(&self.db)
            .await?;
        let mut rows: Vec<ReportRow> = rows
            .into_iter()
            .map(|row| ReportRow {
                group: row.report_group,
                calls: row.calls,
                estimated_calls: row.estimated_calls,
                input_tokens: row.input_tokens,
                output_tokens: row.output_tokens,
                cache_read_tokens: row.cache_read_tokens,
                cache_write_tokens: row.cache_write_tokens,
                cache_write_1h_tokens: row.cache_write_1h_tokens,
                reasoning_tokens: row.reasoning_tokens,
                credits: row.credits,
                costed_calls: row.costed_calls,
                cost: Money::from_nanos(row.cost),
                margin: Money::from_nanos(row.margin),
            })
            .collect();
        // The group's order as Rust compares it, whatever the database's collation.
        rows.sort_by(|a, b| a.group.cmp(&b.group));
        Ok(rows)
    }

    async fn calls(
        &self,
        account: AccountId,
        query: CallQuery<'_>,
    ) -> Result<Vec<CallRecord>, StoreError> {
        let mut select = call::Entity::find().filter(call::Column::AccountId.eq(account.0));
        if let Some(before) = query.before {
            select = select.filter(call::Column::Id.lt(before.0));
        }
        if let Some(status) = query.status {
            select = select.filter(call::Column::Status.eq(status.as_str()));
        }
        if let Some(model) = query.model {
            select = select.filter(call::Column::Model.eq(model));
        }
        select
            .order_by_desc(call::Column::Id)
            .limit(query.limit)
            .all(&self.db)
            .await?
            .into_iter()
            .map(call_record)
            .collect()
    }
}
