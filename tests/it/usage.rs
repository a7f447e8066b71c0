//! `GET /v1/usage`: billed calls and credits per UTC day and model, summed by the database, for
//! an account with no calls, for calls through the gateway on every database, and for an
//! account with 100,000 calls over 40 days.

use crate::common;

use chrono::Utc;
use common::*;
use model_gateway::{
    Accounts, CallLog, Credits, KeyStore, Ledger, Protocol, keys::KeyHash, store::CallFailure,
    store::CallSuccess, store::ChargeRequest,
};

async fn usage(gateway: &common::Gateway, key: &str, query: &str) -> Answer {
    gateway
        .send(
            gateway
                .client
                .get(format!("{}/v1/usage{query}", gateway.base))
                .bearer_auth(key),
        )
        .await
}

#[tokio::test]
async fn an_account_without_calls_has_an_empty_usage_window() {
    let db = local_db().await;
    let gateway = start_mock_gateway(&db).await;
    let key = db.funded_key(10, 0).await;
    let answer = usage(&gateway, &key, "").await;
    assert_eq!(answer.status, 200);
    assert_eq!(answer.body["days"], 30);
    assert_eq!(answer.body["data"], serde_json::json!([]));
    let since = (Utc::now().date_naive() - chrono::Duration::days(29)).to_string();
    assert_eq!(answer.body["since"], since);
    for bad in ["?days=0", "?days=367", "?days=x"] {
        assert_eq!(usage(&gateway, &key, bad).await.status, 400, "{bad}");
    }
    assert_eq!(usage(&gateway, "sk-mg-nobody", "").await.status, 401);
}

/// Billed calls count; refunded ones do not.
async fn usage_counts_billed_calls_per_model(db: &TestDb) {
    let key = db.funded_key(100, 0).await;
    let caller = db
        .store
        .caller_for_key(&KeyHash::of(&key))
        .await
        .unwrap()
        .unwrap();
    let mut made = Vec::new();
    for (model, price, billed) in [
        ("a", 2, true),
        ("a", 2, true),
        ("b", 5, true),
        ("b", 5, false),
    ] {
        let reservation = db
            .store
            .reserve(ChargeRequest::new(
                caller,
                Protocol::ChatCompletions,
                model,
                Credits::new(price),
            ))
            .await
            .unwrap();
        if billed {
            assert!(
                db.store
                    .settle(reservation.call, CallSuccess::default())
                    .await
                    .unwrap()
            );
        } else {
            let failure = CallFailure {
                upstream_status: Some(500),
                error: "x".into(),
            };
            assert!(db.store.refund(reservation.call, &failure).await.unwrap());
        }
        made.push(reservation.call);
    }
    let today = Utc::now().date_naive();
    let since = today.and_time(chrono::NaiveTime::MIN).and_utc();
    let rows = db.store.usage(caller.account, since).await.unwrap();
    let seen: Vec<_> = rows
        .iter()
        .map(|row| (row.day.as_str(), row.model.as_str(), row.calls, row.credits))
        .collect();
    let day = today.to_string();
    assert_eq!(seen, [(day.as_str(), "a", 2, 4), (day.as_str(), "b", 1, 5)]);
    let tomorrow = since + chrono::Duration::days(1);
    assert!(
        db.store
            .usage(caller.account, tomorrow)
            .await
            .unwrap()
            .is_empty()
    );
    let other = db.store.create_account("other").await.unwrap();
    assert!(db.store.usage(other, since).await.unwrap().is_empty());
}

#[tokio::test]
async fn usage_is_summed_per_day_and_model_on_every_database() {
    each_database(usage_counts_billed_calls_per_model).await;
}

/// On `SQLite`, whose SQL the bulk insert is written in.
#[cfg(feature = "sqlite")]
#[tokio::test]
async fn an_account_with_100_000_calls_gets_its_window_and_pages() {
    use sea_orm::ConnectionTrait;

    let db = sqlite_db().await;
    let gateway = start_mock_gateway(&db).await;
    let key = db.funded_key(10, 0).await;
    let account = db.account(&key).await;
    let caller = db
        .store
        .caller_for_key(&KeyHash::of(&key))
        .await
        .unwrap()
        .unwrap();
    // 100,000 billed calls, spread over the last 40 days (2,500 a day), two models.
    let insert = format!(
        "WITH RECURSIVE n(i) AS (SELECT 0 UNION ALL SELECT i + 1 FROM n WHERE i < 99999) \
         INSERT INTO mg_calls (account_id, key_id, protocol, model, price, charged_subscription, \
         charged_topup, status, created_at) \
         SELECT {}, {}, 'chat_completions', CASE WHEN (i / 40) % 2 = 0 THEN 'gpt-4o-mini' ELSE 'gpt-4o' END, \
         3, 3, 0, 'ok', strftime('%Y-%m-%dT%H:%M:%S+00:00', 'now', '-' || (i % 40) || ' days') FROM n",
        account.0, caller.key.0
    );
    db.store
        .connection()
        .execute_unprepared(&insert)
        .await
        .unwrap();

    let answer = usage(&gateway, &key, "?days=30").await;
    assert_eq!(answer.status, 200);
    let rows = answer.body["data"].as_array().unwrap();
    assert_eq!(rows.len(), 60, "30 days, two models");
    let calls: i64 = rows.iter().map(|row| row["calls"].as_i64().unwrap()).sum();
    let credits: i64 = rows
        .iter()
        .map(|row| row["credits"].as_i64().unwrap())
        .sum();
    assert_eq!((calls, credits), (75_000, 225_000));
    assert!(rows.iter().all(|row| row["calls"] == 1250));

    let page = gateway
        .send(
            gateway
                .client
                .get(format!("{}/v1/calls?limit=20", gateway.base))
                .bearer_auth(&key),
        )
        .await;
    assert_eq!(page.body["data"].as_array().unwrap().len(), 20);
    assert_eq!(page.body["has_more"], true);
}
