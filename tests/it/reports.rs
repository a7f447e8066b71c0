//! The operator's usage report over HTTP: on a generated month of calls (three accounts, two
//! models, two channels, some refunded, some without a cost, some estimated), its JSON and its
//! CSV agree, for every grouping and window, with sums the test makes itself from the ledger's
//! entries; on `SQLite`, `PostgreSQL` and `MariaDB`.

use crate::common;

use std::collections::BTreeMap;
use std::sync::Arc;

use chrono::{DateTime, Duration, TimeZone, Utc};
use common::*;
use model_gateway::admin::AdminToken;
use model_gateway::money::Money;
use model_gateway::protocol::TokenUsage;
use model_gateway::store::{
    CallFailure, CallRecord, CallStatus, CallSuccess, ChargeRequest, OperatorCost,
};
use model_gateway::upstream::MockUpstream;
use model_gateway::{Catalogue, Credits, Gateway, Ledger, Protocol, Upstream};
use sea_orm::ConnectionTrait;
use serde_json::Value;

const TOKEN: &str = "admin-token-for-reports-0123456789";

async fn admin_gateway(db: &TestDb) -> common::Gateway {
    let text = format!(
        "currency = \"USD\"\ncredit_value = 0.01\n{}",
        model_gateway::catalogue::DEMO_CATALOGUE
    );
    let router = Gateway::new(
        db.store.clone(),
        Arc::new(Catalogue::from_toml(&text).unwrap()),
        Upstream::Mock(MockUpstream::new()),
    )
    .admin_token(Some(AdminToken::new(TOKEN).unwrap()))
    .router();
    serve_router(router).await
}

/// When the call of `day` (0 = 2026-11-01), account `account`, `n`th of the day was made.
fn made_at(day: i64, account: i64, n: i64) -> DateTime<Utc> {
    Utc.with_ymd_and_hms(2026, 11, 1, 0, 0, 0).unwrap()
        + Duration::days(day)
        + Duration::hours(account * 3 + n)
}

/// Moves entry `id`'s time to `at`, written as each database keeps it.
async fn made_then(db: &TestDb, id: i64, at: DateTime<Utc>) {
    let connection = db.store.connection();
    let literal = match connection.get_database_backend() {
        sea_orm::DbBackend::MySql => at.format("%Y-%m-%d %H:%M:%S").to_string(),
        _ => at.to_rfc3339_opts(chrono::SecondsFormat::AutoSi, false),
    };
    connection
        .execute_unprepared(&format!(
            "UPDATE mg_calls SET created_at = '{literal}' WHERE id = {id}"
        ))
        .await
        .unwrap();
}

/// A month of calls: each day, each of three accounts makes one to three calls of one of two
/// models, served by one of two channels; every seventh is refunded, every third without a
/// cost, every fifth charged on an estimate. The keys, by account.
async fn a_month_of_calls(db: &TestDb) -> Vec<String> {
    let mut keys = Vec::new();
    for _ in 0..3 {
        keys.push(db.funded_key(1_000_000, 0).await);
    }
    let mut nth = 0_i64;
    for day in 0..30_i64 {
        for (account, key) in keys.iter().enumerate() {
            let account = account as i64;
            let caller = db.caller(key).await;
            for n in 0..(day + account) % 3 + 1 {
                nth += 1;
                let model = if (day + n) % 2 == 0 {
                    CHAT_MODEL
                } else {
                    MESSAGES_MODEL
                };
                let price = 5 + (day * 7 + account * 3 + n) % 11;
                let reserved = db
                    .store
                    .reserve(ChargeRequest::new(
                        caller,
                        Protocol::ChatCompletions,
                        model,
                        Credits::new(price),
                    ))
                    .await
                    .unwrap();
                if nth % 7 == 0 {
                    let failure = CallFailure {
                        upstream_status: Some(500),
                        error: "down".into(),
                    };
                    assert!(db.store.refund(reserved.call, &failure).await.unwrap());
                } else {
                    let success = CallSuccess {
                        upstream_status: 200,
                        channel: Some(["openai", "azure"][((day + n) % 2) as usize].into()),
                        usage: TokenUsage {
                            input_tokens: Some(100 * day + n),
                            output_tokens: Some(10 * n + 1),
                            cache_read_tokens: Some(day),
                            cache_write_tokens: (n == 1).then_some(7),
                            cache_write_1h_tokens: (n == 2).then_some(3),
                            reasoning_tokens: Some(n),
                            estimated: nth % 5 == 0,
                            ..TokenUsage::default()
                        },
                        operator_cost: (nth % 3 != 0).then(|| OperatorCost {
                            cost: Money::from_nanos(1_000_000 * (day + 1) + nth),
                            credit_value: Money::from_nanos(10_000_000),
                        }),
                        ..CallSuccess::default()
                    };
                    assert!(db.store.settle(reserved.call, success).await.unwrap());
                }
                made_then(db, reserved.call.0, made_at(day, account, n)).await;
            }
        }
    }
    keys
}

/// The sums of one group, as the test makes them from the entries.
#[derive(Debug, Default, PartialEq, Eq)]
struct Sums {
    calls: i64,
    estimated_calls: i64,
    tokens: [i64; 6],
    credits: i64,
    costed_calls: i64,
    cost: i64,
    margin: i64,
}

fn group_of(call: &CallRecord, group_by: &str) -> String {
    match group_by {
        "day" => call.created_at.format("%Y-%m-%d").to_string(),
        "model" => call.model.clone(),
        "channel" => call.channel.clone().unwrap_or_default(),
        "account" => call.account.0.to_string(),
        "key" => call.key.0.to_string(),
        other => panic!("{other}"),
    }
}

fn expected(
    calls: &[CallRecord],
    group_by: &str,
    from: DateTime<Utc>,
    to: DateTime<Utc>,
) -> BTreeMap<String, Sums> {
    let mut groups: BTreeMap<String, Sums> = BTreeMap::new();
    for call in calls {
        if call.status != CallStatus::Ok || call.created_at < from || call.created_at >= to {
            continue;
        }
        let sums = groups.entry(group_of(call, group_by)).or_default();
        sums.calls += 1;
        sums.estimated_calls += i64::from(call.usage_estimated);
        let kinds = [
            call.input_tokens,
            call.output_tokens,
            call.cache_read_tokens,
            call.cache_write_tokens,
            call.cache_write_1h_tokens,
            call.reasoning_tokens,
        ];
        for (sum, count) in sums.tokens.iter_mut().zip(kinds) {
            *sum += count.unwrap_or(0);
        }
        sums.credits += call.price.get();
        if let Some(cost) = call.cost {
            sums.costed_calls += 1;
            sums.cost += cost.nanos();
            // A cent a credit.
            sums.margin += call.price.get() * 10_000_000 - cost.nanos();
        }
    }
    groups
}

/// A row's sums, each read by `int` (a count) or `money` (an amount, in billionths).
fn sums_by(int: impl Fn(&str) -> i64, money: impl Fn(&str) -> i64) -> Sums {
    Sums {
        calls: int("calls"),
        estimated_calls: int("estimated_calls"),
        tokens: [
            "input_tokens",
            "output_tokens",
            "cache_read_tokens",
            "cache_write_tokens",
            "cache_write_1h_tokens",
            "reasoning_tokens",
        ]
        .map(&int),
        credits: int("credits"),
        costed_calls: int("costed_calls"),
        cost: money("cost"),
        margin: money("margin"),
    }
}

fn sums_of_json(row: &Value) -> Sums {
    sums_by(
        |name| {
            row[name]
                .as_i64()
                .unwrap_or_else(|| panic!("{name}: {row}"))
        },
        // Read from the number's own text: exact.
        |name| row[name].to_string().parse::<Money>().unwrap().nanos(),
    )
}

fn sums_of_csv(header: &[&str], cells: &[&str]) -> Sums {
    let cell = |name: &str| cells[header.iter().position(|column| *column == name).unwrap()];
    sums_by(
        |name| cell(name).parse().unwrap(),
        |name| cell(name).parse::<Money>().unwrap().nanos(),
    )
}

backends!(
    /// Every grouping, over the whole month and over three days of it.
    async fn the_usage_report_agrees_with_the_ledger_on_a_generated_month(db) {
        let gateway = admin_gateway(&db).await;
        let keys = a_month_of_calls(&db).await;
        let mut calls = Vec::new();
        for key in &keys {
            calls.extend(db.calls(key).await);
        }
        assert!(calls.len() > 150, "{} calls", calls.len());
        let month = (made_at(0, 0, 0), made_at(30, 0, 0));
        let three_days = (made_at(9, 0, 0), made_at(12, 0, 0));
        for (window, query) in [
            (month, "from=2026-11-01&to=2026-11-30"),
            (three_days, "from=2026-11-10&to=2026-11-12"),
        ] {
            for group_by in ["day", "model", "channel", "account", "key"] {
                let want = expected(&calls, group_by, window.0, window.1);
                let path = format!(
                    "{}/admin/reports/usage?{query}&group_by={group_by}",
                    gateway.base
                );
                let json = gateway
                    .send(gateway.client.get(&path).bearer_auth(TOKEN))
                    .await;
                assert_eq!(json.status, 200, "{}", json.body);
                assert_eq!(json.body["currency"], "USD");
                assert_eq!(json.body["group_by"], group_by);
                let got: BTreeMap<String, Sums> = json.body["data"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .map(|row| (row["group"].as_str().unwrap().to_owned(), sums_of_json(row)))
                    .collect();
                assert_eq!(got, want, "JSON by {group_by} ({query})");
                let total = sums_of_json(&json.body["total"]);
                assert_eq!(total.calls, want.values().map(|sums| sums.calls).sum::<i64>());
                assert_eq!(total.cost, want.values().map(|sums| sums.cost).sum::<i64>());
                assert_eq!(total.margin, want.values().map(|sums| sums.margin).sum::<i64>());

                let csv = gateway
                    .send(
                        gateway
                            .client
                            .get(&path)
                            .bearer_auth(TOKEN)
                            .header("accept", "text/csv"),
                    )
                    .await;
                assert_eq!(csv.status, 200);
                assert!(csv.headers["content-type"].to_str().unwrap().starts_with("text/csv"));
                let text = std::str::from_utf8(&csv.bytes).unwrap();
                let mut lines = text.lines();
                let header: Vec<&str> = lines.next().unwrap().split(',').collect();
                let mut rows: Vec<(String, Sums)> = lines
                    .map(|line| {
                        let cells: Vec<&str> = line.split(',').collect();
                        (cells[0].to_owned(), sums_of_csv(&header, &cells))
                    })
                    .collect();
                let (last, csv_total) = rows.pop().unwrap();
                assert_eq!(last, "total");
                assert_eq!(csv_total, total, "the CSV's total is the JSON's");
                let got: BTreeMap<String, Sums> = rows.into_iter().collect();
                assert_eq!(got, want, "CSV by {group_by} ({query})");
            }
        }
        // The whole month by day: thirty days, each with calls.
        let by_day = expected(&calls, "day", month.0, month.1);
        assert_eq!(by_day.len(), 30);
    }
);

/// A window or grouping the report cannot take is refused by field, uncharged of anything.
#[tokio::test]
async fn a_report_query_that_means_nothing_is_refused_by_field() {
    let db = local_db().await;
    let gateway = admin_gateway(&db).await;
    for (query, field) in [
        ("from=tomorrow", "from"),
        ("group_by=week", "group_by"),
        ("from=2026-11-05&to=2026-11-01", "from"),
    ] {
        let answer = gateway
            .send(
                gateway
                    .client
                    .get(format!("{}/admin/reports/usage?{query}", gateway.base))
                    .bearer_auth(TOKEN),
            )
            .await;
        assert_eq!(answer.status, 400, "{query}: {}", answer.body);
        assert!(
            answer.body["detail"].as_str().unwrap().contains(field),
            "{query}: {}",
            answer.body
        );
    }
    let unauthorised = gateway
        .send(
            gateway
                .client
                .get(format!("{}/admin/reports/usage", gateway.base)),
        )
        .await;
    assert_eq!(unauthorised.status, 401);
}
