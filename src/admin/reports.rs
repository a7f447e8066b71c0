//! The operator's usage report: billed calls in a window, grouped by day, model, channel,
//! account or key, with their tokens by kind, credits, cost and margin; as JSON and as CSV.

use chrono::{DateTime, Duration, NaiveDate, Utc};
use serde::Serialize;

use super::{Admin, AdminError};
use crate::error::GatewayError;
use crate::store::{ReportGroup, ReportQuery, ReportRow, Store};

/// The columns of a report row, in the order the CSV writes them.
pub const REPORT_COLUMNS: [&str; 13] = [
    "group",
    "calls",
    "estimated_calls",
    "input_tokens",
    "output_tokens",
    "cache_read_tokens",
    "cache_write_tokens",
    "cache_write_1h_tokens",
    "reasoning_tokens",
    "credits",
    "costed_calls",
    "cost",
    "margin",
];

/// How far back a report without `from` reaches.
const DEFAULT_DAYS: i64 = 30;

/// A usage report as the API answers it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct UsageReport {
    /// Always `"usage_report"`.
    pub object: &'static str,
    /// The earliest time a call counted was made.
    pub from: DateTime<Utc>,
    /// The time from which calls no longer count.
    pub to: DateTime<Utc>,
    /// How the rows are grouped.
    pub group_by: ReportGroup,
    /// The currency `cost` and `margin` are in, when the catalogue gives cost prices.
    pub currency: Option<String>,
    /// One row per group, in the group's order.
    pub data: Vec<ReportRow>,
    /// Every row summed (its group `"total"`).
    pub total: ReportRow,
}

impl UsageReport {
    /// The report as CSV: a header of [`REPORT_COLUMNS`], a row per group, then the total.
    pub fn csv(&self) -> String {
        let mut text = REPORT_COLUMNS.join(",");
        text.push('\n');
        for row in self.data.iter().chain([&self.total]) {
            let cells = [
                csv_cell(&row.group),
                row.calls.to_string(),
                row.estimated_calls.to_string(),
                row.input_tokens.to_string(),
                row.output_tokens.to_string(),
                row.cache_read_tokens.to_string(),
                row.cache_write_tokens.to_string(),
                row.cache_write_1h_tokens.to_string(),
                row.reasoning_tokens.to_string(),
                row.credits.to_string(),
                row.costed_calls.to_string(),
                row.cost.to_string(),
                row.margin.to_string(),
            ];
            text.push_str(&cells.join(","));
            text.push('\n');
        }
        text
    }
}

/// A CSV cell: quoted when it holds a comma, a quote or a line break (quotes doubled), and
/// with a quote before a leading `=`, `+`, `-` or `@`, which a spreadsheet would run as a
/// formula (a model or channel name is the operator's, but a report travels).
fn csv_cell(text: &str) -> String {
    let formula = text.starts_with(['=', '+', '-', '@']);
    if formula || text.contains([',', '"', '\n', '\r']) {
        let prefix = if formula { "'" } else { "" };
        format!("\"{prefix}{}\"", text.replace('"', "\"\""))
    } else {
        text.to_owned()
    }
}

/// A report's window and grouping as the API's query gives them: `from` and `to` a day
/// (`YYYY-MM-DD`, both days included) or an RFC 3339 time (`to` excluded); without `to`, now;
/// without `from`, 30 days before `to`; `group_by` one of [`ReportGroup`]'s names, `day` by
/// default.
pub fn report_query(
    from: Option<&str>,
    to: Option<&str>,
    group_by: Option<&str>,
    now: DateTime<Utc>,
) -> Result<ReportQuery, GatewayError> {
    let time = |field: &'static str, text: &str, day_end: bool| {
        if let Ok(day) = NaiveDate::parse_from_str(text, "%Y-%m-%d") {
            let day = if day_end { day.succ_opt() } else { Some(day) };
            if let Some(start) = day.and_then(|day| day.and_hms_opt(0, 0, 0)) {
                return Ok(start.and_utc());
            }
        }
        DateTime::parse_from_rfc3339(text)
            .map(|time| time.with_timezone(&Utc))
            .map_err(|_| GatewayError::InvalidField {
                field: field.into(),
                reason: "必须是日期 (YYYY-MM-DD) 或 RFC 3339 时间",
            })
    };
    let to = match to {
        Some(text) => time("to", text, true)?,
        None => now,
    };
    let from = match from {
        Some(text) => time("from", text, false)?,
        None => to - Duration::days(DEFAULT_DAYS),
    };
    if from >= to {
        return Err(GatewayError::InvalidField {
            field: "from".into(),
            reason: "必须早于 to",
        });
    }
    let group_by = match group_by {
        None => ReportGroup::Day,
        Some(name) => ReportGroup::parse(name).ok_or(GatewayError::InvalidField {
            field: "group_by".into(),
            reason: "必须是 day, model, channel, account 或 key",
        })?,
    };
    Ok(ReportQuery { from, to, group_by })
}

impl<S: Store> Admin<S> {
    /// The usage report for `query`: every account's billed calls in its window, by its group.
    pub async fn usage_report(&self, query: ReportQuery) -> Result<UsageReport, AdminError> {
        let data = self.store.usage_report(query).await?;
        let total = ReportRow::total("total", &data);
        let currency = self
            .catalogue
            .as_ref()
            .and_then(|catalogue| catalogue.current().currency().map(str::to_owned));
        Ok(UsageReport {
            object: "usage_report",
            from: query.from,
            to: query.to,
            group_by: query.group_by,
            currency,
            data,
            total,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(text: &str) -> DateTime<Utc> {
        DateTime::parse_from_rfc3339(text)
            .unwrap()
            .with_timezone(&Utc)
    }

    #[test]
    fn days_include_both_ends_and_times_exclude_the_end() {
        let now = at("2026-12-07T12:00:00Z");
        let query = report_query(Some("2026-11-01"), Some("2026-11-30"), None, now).unwrap();
        assert_eq!(
            (query.from, query.to, query.group_by),
            (
                at("2026-11-01T00:00:00Z"),
                at("2026-12-01T00:00:00Z"),
                ReportGroup::Day
            )
        );
        let query = report_query(
            Some("2026-11-01T08:00:00+08:00"),
            Some("2026-11-02T00:00:00Z"),
            Some("channel"),
            now,
        )
        .unwrap();
        assert_eq!(query.from, at("2026-11-01T00:00:00Z"));
        assert_eq!(query.to, at("2026-11-02T00:00:00Z"));
        assert_eq!(query.group_by, ReportGroup::Channel);
        let query = report_query(None, None, Some("key"), now).unwrap();
        assert_eq!((query.from, query.to), (now - Duration::days(30), now));
    }

    #[test]
    fn a_window_or_grouping_that_means_nothing_is_refused_by_field() {
        let now = Utc::now();
        let field = |error: GatewayError| match error {
            GatewayError::InvalidField { field, .. } => field.into_owned(),
            other => panic!("{other:?}"),
        };
        for (from, to, group, named) in [
            (Some("yesterday"), None, None, "from"),
            (None, Some("2026-13-01"), None, "to"),
            (Some("2026-11-02"), Some("2026-11-01"), None, "from"),
            (None, None, Some("week"), "group_by"),
        ] {
            let refused = report_query(from, to, group, now).unwrap_err();
            assert_eq!(field(refused), named);
        }
    }

    #[test]
    fn csv_cells_are_quoted_where_they_must_be_and_never_run_as_formulas() {
        assert_eq!(csv_cell("gpt-4o"), "gpt-4o");
        assert_eq!(csv_cell("a,b"), "\"a,b\"");
        assert_eq!(csv_cell("say \"hi\""), "\"say \"\"hi\"\"\"");
        assert_eq!(csv_cell("=SUM(A1)"), "\"'=SUM(A1)\"");
    }
}
