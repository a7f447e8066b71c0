//! The metrics operators scrape: known traffic through the example gateway, then
//! `install_prometheus`'s text checked counter by counter. (Its own test binary: the recorder
//! is global to the process.)

// Tests, benches and the load test unwrap (a panic is how they fail) and share helpers
// through `pub` items of their own modules.
#![allow(clippy::unwrap_used, unreachable_pub)]

mod common;

use std::collections::BTreeMap;

use common::fake_provider::{FakeProvider, Fault};
use common::*;
use model_gateway::Catalogue;

/// The rendered text as `name{label="value",...}` (labels sorted) -> value.
fn samples(text: &str) -> BTreeMap<String, f64> {
    text.lines()
        .filter(|line| !line.starts_with('#') && !line.is_empty())
        .map(|line| {
            let (series, value) = line.rsplit_once(' ').unwrap();
            let series = match series.split_once('{') {
                Some((name, labels)) => {
                    let mut labels: Vec<&str> = labels.trim_end_matches('}').split(',').collect();
                    labels.sort();
                    format!("{name}{{{}}}", labels.join(","))
                }
                None => series.to_owned(),
            };
            (series, value.parse().unwrap())
        })
        .collect()
}

#[tokio::test]
async fn the_metrics_count_known_traffic() {
    let metrics = model_gateway::telemetry::install_prometheus().unwrap();
    let db = local_db().await;
    let provider = FakeProvider::start().await;
    let ok = r#"{"choices":[],"usage":{"prompt_tokens":1,"completion_tokens":1}}"#;
    let catalogue =
        Catalogue::from_toml(&one_upstream_toml("prov", &provider.base, "K", "")).unwrap();
    let gateway = http_gateway(&db, catalogue).await;
    let key = db.funded_key(3 * CHAT_PRICE, 0).await;

    provider
        .then(Fault::json(200, ok))
        .then(Fault::json(200, ok));
    assert_eq!(gateway.chat(&key, CHAT_MODEL).await.status, 200);
    assert_eq!(gateway.chat(&key, CHAT_MODEL).await.status, 200);
    provider.then(Fault::json(503, r#"{"error":{"message":"down"}}"#));
    assert_eq!(gateway.chat(&key, CHAT_MODEL).await.status, 502);
    assert_eq!(gateway.chat(&key, "no-such-model").await.status, 404);
    let poor = db.funded_key(1, 0).await;
    assert_eq!(gateway.chat(&poor, CHAT_MODEL).await.status, 402);

    let seen = samples(&metrics.render());
    let value = |series: &str| {
        *seen
            .get(series)
            .unwrap_or_else(|| panic!("no {series} in {seen:#?}"))
    };
    let calls = |outcome: &str| {
        value(&format!(
            "mg_calls_total{{model=\"{CHAT_MODEL}\",outcome=\"{outcome}\",protocol=\"chat_completions\"}}"
        ))
    };
    assert_eq!(calls("ok"), 2.0);
    assert_eq!(calls("refunded"), 1.0);
    assert_eq!(
        value(&format!(
            "mg_credits_charged_total{{model=\"{CHAT_MODEL}\"}}"
        )),
        4.0
    );
    assert_eq!(
        value(&format!(
            "mg_credits_refunded_total{{model=\"{CHAT_MODEL}\"}}"
        )),
        2.0
    );
    assert_eq!(
        value("mg_refusals_total{reason=\"insufficient_credits\",status=\"402\"}"),
        1.0
    );
    assert_eq!(
        value("mg_refusals_total{reason=\"model_not_found\",status=\"404\"}"),
        1.0
    );
    assert_eq!(
        value("mg_refusals_total{reason=\"upstream_unavailable\",status=\"502\"}"),
        1.0
    );
    assert_eq!(
        value("mg_upstream_attempts_total{outcome=\"ok\",upstream=\"prov\"}"),
        2.0
    );
    assert_eq!(
        value("mg_upstream_attempts_total{outcome=\"retryable\",upstream=\"prov\"}"),
        1.0
    );
    assert_eq!(value("mg_upstream_seconds_count{upstream=\"prov\"}"), 3.0);
    assert_eq!(value("mg_breaker_open{upstream=\"prov\"}"), 0.0);
    assert_eq!(value("mg_pending_reservations"), 0.0);
    // Three reservations, two settles and a refund went through the ledger's batches.
    assert!(value("mg_ledger_batch_writes_sum") >= 6.0, "{seen:#?}");
    assert!(value("mg_ledger_batch_seconds_count") >= 1.0);
}
