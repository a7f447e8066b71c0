//! Redemption codes: a code grants once whatever the concurrency and however many gateways
//! share the database (on `SQLite`, an owned `SQLite` file, `PostgreSQL` and `MariaDB`, and the
//! memory store); the grant is recorded naming the batch, so the audit balances; unknown, used,
//! expired and revoked codes get one answer; failed attempts are rate-limited per key and per
//! client address; the admin API creates, lists and revokes batches.

use crate::common;

use std::sync::Arc;

use chrono::{Duration, Utc};
use common::*;
use model_gateway::admin::{Admin, AdminToken, NewCodes};
use model_gateway::codes::CodeHash;
use model_gateway::store::{NewCodeBatch, RedemptionCodes};
use model_gateway::{
    AccountId, Accounts, Credits, Gateway, Ledger, MemoryStore, Store, Upstream, credits::Bucket,
    upstream::MockUpstream,
};
use serde_json::json;

const TOKEN: &str = "admin-token-for-tests-0123456789";

fn topup_codes(count: u32, credits: i64) -> NewCodes {
    NewCodes {
        count,
        credits: Credits::new(credits),
        bucket: Bucket::Topup,
        period_days: None,
        expires_at: None,
        label: Some("test".into()),
    }
}

/// Fifty redemptions of one code at once, by two accounts, through `stores` in turn (one
/// store, or two gateways' stores on one database): exactly one grants.
async fn fifty_redeem_one_code<S: Store + 'static>(stores: [Arc<S>; 2]) {
    let admin = Admin::new(stores[0].clone());
    let created = admin.create_codes(&topup_codes(1, 70)).await.unwrap();
    let code = CodeHash::of(&created.codes[0]).unwrap();
    let accounts = [
        stores[0].create_account("first").await.unwrap(),
        stores[1].create_account("second").await.unwrap(),
    ];
    let at = Utc::now();
    let redemptions = (0..50).map(|attempt| {
        let store = stores[attempt % 2].clone();
        let account = accounts[attempt / 25];
        let code = code.clone();
        tokio::spawn(async move { store.redeem_code(account, &code, at).await.unwrap() })
    });
    let redeemed: Vec<_> = futures::future::join_all(redemptions)
        .await
        .into_iter()
        .filter_map(Result::unwrap)
        .collect();
    assert_eq!(
        redeemed.len(),
        1,
        "one code granted {} times",
        redeemed.len()
    );
    let mut total = 0;
    for account in accounts {
        total += stores[0].balance(account).await.unwrap().total().get();
    }
    assert_eq!(total, 70, "the code's credits were granted once");
    assert_eq!(redeemed[0].balance.topup, Credits::new(70));
    for audit in stores[0].audit().await.unwrap() {
        assert!(audit.holds(), "audit failed: {audit:?}");
    }
    let batches = admin.code_batches().await.unwrap();
    assert_eq!(
        (batches.data[0].batch.used, batches.data[0].unused),
        (1, 0),
        "the batch counts the code used"
    );
}

backends!(
    #[multi_thread]
    async fn fifty_concurrent_redemptions_of_one_code_grant_once(db) {
        fifty_redeem_one_code([db.store.clone(), db.store.clone()]).await;
    }
);

backends!(
    #[multi_thread]
    async fn one_code_redeemed_on_two_gateways_sharing_a_database_grants_once(db) {
        let second = db.second_instance().await;
        fifty_redeem_one_code([db.store.clone(), second.store.clone()]).await;
    }
);

#[cfg(feature = "sqlite")]
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn fifty_concurrent_redemptions_on_an_owned_file_grant_once() {
    let db = owned_sqlite_db().await;
    fifty_redeem_one_code([db.store.clone(), db.store.clone()]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn fifty_concurrent_redemptions_in_the_memory_store_grant_once() {
    let store = Arc::new(MemoryStore::new());
    fifty_redeem_one_code([store.clone(), store]).await;
}

backends!(
    async fn unknown_used_expired_and_revoked_codes_grant_nothing(db) {
        let store = &db.store;
        let account = store.create_account("holder").await.unwrap();
        let now = Utc::now();
        let codes: Vec<_> = (0..4)
            .map(|_| model_gateway::codes::NewCode::generate())
            .collect();
        let hashes: Vec<_> = codes.iter().map(|code| code.hash()).collect();
        let batch = |codes, expires_at| NewCodeBatch {
            label: None,
            credits: Credits::new(10),
            bucket: Bucket::Topup,
            period_days: None,
            expires_at,
            codes,
            at: now,
        };
        let live = store
            .create_code_batch(batch(&hashes[..2], None))
            .await
            .unwrap();
        let ends = now + Duration::seconds(60);
        store
            .create_code_batch(batch(&hashes[2..3], Some(ends)))
            .await
            .unwrap();
        // Used: the first code, once.
        assert!(store.redeem_code(account, &hashes[0], now).await.unwrap().is_some());
        assert!(store.redeem_code(account, &hashes[0], now).await.unwrap().is_none());
        // Revoked: the second; the first stays redeemed.
        let revoked = store.revoke_code_batch(live.id, now).await.unwrap().unwrap();
        assert_eq!((revoked.used, revoked.revoked), (1, 1));
        assert!(store.redeem_code(account, &hashes[1], now).await.unwrap().is_none());
        // Expired: at and after the batch's end.
        assert!(store.redeem_code(account, &hashes[2], ends).await.unwrap().is_none());
        // Unknown: a code never stored.
        assert!(store.redeem_code(account, &hashes[3], now).await.unwrap().is_none());
        assert_eq!(store.balance(account).await.unwrap().total(), Credits::new(10));
        assert!(store.revoke_code_batch(live.id + 99, now).await.unwrap().is_none());
        db.assert_audit_holds().await;
    }
);

backends!(
    async fn a_redemption_is_a_grant_naming_its_batch(db) {
        let admin = db.admin();
        let created = admin.create_codes(&topup_codes(1, 25)).await.unwrap();
        let account = db.store.create_account("holder").await.unwrap();
        let code = CodeHash::of(&created.codes[0]).unwrap();
        let redeemed = db
            .store
            .redeem_code(account, &code, Utc::now())
            .await
            .unwrap()
            .unwrap();
        assert_eq!(redeemed.batch, created.batch.batch.id);
        let reasons = grant_reasons(&db, account).await;
        assert_eq!(
            reasons,
            [format!("redemption code, batch {}", created.batch.batch.id)]
        );
        db.assert_audit_holds().await;
    }
);

/// The reasons recorded with the account's grants.
async fn grant_reasons(db: &TestDb, account: AccountId) -> Vec<String> {
    use sea_orm::{ConnectionTrait, Statement};
    let connection = db.store.connection();
    let backend = connection.get_database_backend();
    let sql = match backend {
        sea_orm::DbBackend::Postgres => "SELECT reason FROM mg_credit_grants WHERE account_id = $1",
        _ => "SELECT reason FROM mg_credit_grants WHERE account_id = ?",
    };
    connection
        .query_all_raw(Statement::from_sql_and_values(
            backend,
            sql,
            [account.0.into()],
        ))
        .await
        .unwrap()
        .iter()
        .map(|row| row.try_get::<String>("", "reason").unwrap())
        .collect()
}

/// A subscription code starts a period from its redemption; a second one redeemed within it
/// replaces the period (a renewal does not add up), and says what of the first lapsed
/// (`lapsed`), so that the key holder is told; a top-up code lapses nothing.
async fn a_subscription_code_starts_a_period_and_says_what_lapsed<S: Store + 'static>(
    store: Arc<S>,
) {
    let admin = Admin::new(store.clone());
    let codes = NewCodes {
        bucket: Bucket::Subscription,
        period_days: Some(30),
        ..topup_codes(2, 300)
    };
    let created = admin.create_codes(&codes).await.unwrap();
    let topup = admin.create_codes(&topup_codes(1, 40)).await.unwrap();
    let account = store.create_account("subscriber").await.unwrap();
    let at = Utc::now();
    let redeem = async |code: &str| {
        (store.redeem_code(account, &CodeHash::of(code).unwrap(), at))
            .await
            .unwrap()
            .unwrap()
    };
    assert_eq!(redeem(&created.codes[0]).await.lapsed, Credits::ZERO);
    let summary = store.account(account).await.unwrap().unwrap();
    assert_eq!(summary.balance.subscription, Credits::new(300));
    let ends = summary.subscription_ends_at.expect("a period was started");
    let days = (ends - at).num_seconds() as f64 / 86_400.0;
    assert!((days - 30.0).abs() < 0.001, "the period is {days} days");

    assert_eq!(redeem(&topup.codes[0]).await.lapsed, Credits::ZERO);
    let renewed = redeem(&created.codes[1]).await;
    assert_eq!(
        renewed.lapsed,
        Credits::new(300),
        "the first period's credits"
    );
    assert_eq!(renewed.balance, balance(300, 40));
}

backends!(
    async fn a_subscription_code_starts_a_period_from_its_redemption(db) {
        a_subscription_code_starts_a_period_and_says_what_lapsed(db.store.clone()).await;
    }
);

#[tokio::test]
async fn in_the_memory_store_a_subscription_code_says_what_lapsed() {
    a_subscription_code_starts_a_period_and_says_what_lapsed(Arc::new(MemoryStore::new())).await;
}

/// The example gateway in mock mode with the admin API on.
async fn admin_gateway(db: &TestDb) -> common::Gateway {
    let router = Gateway::new(
        db.store.clone(),
        Arc::new(model_gateway::Catalogue::demo()),
        Upstream::Mock(MockUpstream::new()),
    )
    .admin_token(Some(AdminToken::new(TOKEN).unwrap()))
    .router();
    serve_router(router).await
}

async fn admin_send(gateway: &common::Gateway, method: reqwest::Method, path: &str) -> Answer {
    let request = gateway
        .client
        .request(method, format!("{}{path}", gateway.base))
        .bearer_auth(TOKEN);
    gateway.send(request).await
}

async fn redeem(gateway: &common::Gateway, key: &str, code: &str) -> Answer {
    let request = gateway
        .client
        .post(format!("{}/v1/redeem", gateway.base))
        .bearer_auth(key)
        .json(&json!({ "code": code }));
    gateway.send(request).await
}

#[tokio::test]
async fn an_operator_sells_a_batch_and_a_key_holder_redeems_a_code() {
    let db = local_db().await;
    let gateway = admin_gateway(&db).await;
    let request = gateway
        .client
        .post(format!("{}/admin/codes", gateway.base))
        .bearer_auth(TOKEN)
        .json(
            &json!({"count": 3, "credits": 40, "bucket": "topup", "label": "launch",
            "expires_at": (Utc::now() + Duration::days(7)).to_rfc3339()}),
        );
    let created = gateway.send(request).await;
    assert_eq!(created.status, 201, "{:?}", created.body);
    let batch = created.body["batch"].as_i64().unwrap();
    let codes: Vec<String> = serde_json::from_value(created.body["codes"].clone()).unwrap();
    assert_eq!(codes.len(), 3);
    assert_eq!(created.body["label"], "launch");

    let key = db.funded_key(5, 0).await;
    let redeemed = redeem(&gateway, &key, &codes[0].to_lowercase()).await;
    assert_eq!(redeemed.status, 200, "{:?}", redeemed.body);
    assert_eq!(redeemed.body["credits"], 40);
    assert_eq!(redeemed.body["bucket"], "topup");
    assert_eq!(redeemed.body["balance"]["total"], 45);
    assert_eq!(redeemed.body["balance"]["topup"], 40);
    assert_eq!(db.balance(&key).await, balance(5, 40));
    assert_eq!(redeemed.body["lapsed"], 0);

    let again = redeem(&gateway, &key, &codes[0]).await;
    assert_eq!((again.status, again.detail()), (400, "兑换码无效"));

    let listed = admin_send(&gateway, reqwest::Method::GET, "/admin/codes").await;
    assert_eq!(listed.status, 200);
    let item = &listed.body["data"][0];
    assert_eq!(
        (item["batch"].as_i64(), &item["used"], &item["unused"]),
        (Some(batch), &json!(1), &json!(2))
    );

    let path = format!("/admin/codes/{batch}/revoke");
    let revoked = admin_send(&gateway, reqwest::Method::POST, &path).await;
    assert_eq!(revoked.status, 200, "{:?}", revoked.body);
    assert_eq!(
        (
            &revoked.body["used"],
            &revoked.body["unused"],
            &revoked.body["revoked"]
        ),
        (&json!(1), &json!(0), &json!(2))
    );
    let revoked_code = redeem(&gateway, &key, &codes[1]).await;
    assert_eq!(
        (revoked_code.status, revoked_code.detail()),
        (400, "兑换码无效")
    );
    assert_eq!(revoked_code.body, json!({"detail": "兑换码无效"}));

    let unknown_batch =
        admin_send(&gateway, reqwest::Method::POST, "/admin/codes/999/revoke").await;
    assert_eq!(
        (unknown_batch.status, unknown_batch.detail()),
        (404, "兑换码批次不存在")
    );
    let bad = gateway
        .send(
            gateway
                .client
                .post(format!("{}/admin/codes", gateway.base))
                .bearer_auth(TOKEN)
                .json(&json!({"count": 1, "credits": 5, "bucket": "gold"})),
        )
        .await;
    assert_eq!(bad.status, 400);
    assert!(bad.detail().contains("bucket"), "{}", bad.detail());
    assert_eq!(db.balance(&key).await, balance(5, 40));
    db.assert_audit_holds().await;

    // A subscription code starts a new period: the key holder is told what of the current
    // one lapsed.
    let monthly = NewCodes {
        bucket: Bucket::Subscription,
        period_days: Some(30),
        ..topup_codes(1, 100)
    };
    let monthly = db.admin().create_codes(&monthly).await.unwrap();
    let renewed = redeem(&gateway, &key, &monthly.codes[0]).await;
    assert_eq!(renewed.status, 200, "{:?}", renewed.body);
    assert_eq!(renewed.body["lapsed"], 5);
    assert_eq!(renewed.body["balance"]["subscription"], 100);
    assert_eq!(db.balance(&key).await, balance(100, 40));
    db.assert_audit_holds().await;
}

#[tokio::test]
async fn every_invalid_code_gets_the_same_answer_and_a_bad_body_is_named() {
    let db = local_db().await;
    let gateway = admin_gateway(&db).await;
    let key = db.funded_key(1, 0).await;
    let mut answers = Vec::new();
    for code in ["MG-00000-00000-00000-00000-00000", "not a code", ""] {
        let answer = redeem(&gateway, &key, code).await;
        answers.push((answer.status, answer.body));
    }
    assert!(
        answers
            .iter()
            .all(|answer| *answer == (400, json!({"detail": "兑换码无效"}))),
        "{answers:?}"
    );
    let no_code = gateway
        .send(
            gateway
                .client
                .post(format!("{}/v1/redeem", gateway.base))
                .bearer_auth(&key)
                .json(&json!({"coupon": "x"})),
        )
        .await;
    assert_eq!(no_code.status, 400);
    assert!(no_code.detail().contains("code"), "{}", no_code.detail());
    let stranger = redeem(
        &gateway,
        &stranger_key(),
        "MG-00000-00000-00000-00000-00000",
    )
    .await;
    assert_eq!(stranger.status, 401);
    assert_eq!(db.balance(&key).await, balance(1, 0));
}

#[tokio::test]
async fn failed_redemptions_are_limited_per_key_and_per_client_address() {
    let db = local_db().await;
    let gateway = admin_gateway(&db).await;
    let created = db.admin().create_codes(&topup_codes(1, 9)).await.unwrap();
    let first = db.funded_key(1, 0).await;
    let wrong = "MG-00000-00000-00000-00000-00000";
    for _ in 0..model_gateway::key_holder::FAILED_REDEMPTIONS_PER_KEY {
        assert_eq!(redeem(&gateway, &first, wrong).await.status, 400);
    }
    // The key's failures are used up: even a good code waits for the next minute.
    let limited = redeem(&gateway, &first, &created.codes[0]).await;
    assert_eq!(limited.status, 429, "{:?}", limited.body);
    assert_eq!(limited.detail(), "请求过于频繁");
    assert_eq!(db.balance(&first).await, balance(1, 0));

    // Another key is not held back by the first one's failures...
    let second = db.funded_key(1, 0).await;
    let redeemed = redeem(&gateway, &second, &created.codes[0]).await;
    assert_eq!(redeemed.status, 200, "{:?}", redeemed.body);
    // ... but the address is, once it has failed often enough with any keys.
    let per_address = model_gateway::key_holder::FAILED_REDEMPTIONS_PER_ADDRESS;
    let per_key = model_gateway::key_holder::FAILED_REDEMPTIONS_PER_KEY;
    let mut failed = per_key;
    while failed < per_address {
        let key = db.funded_key(1, 0).await;
        for _ in 0..per_key.min(per_address - failed) {
            assert_eq!(redeem(&gateway, &key, wrong).await.status, 400);
            failed += 1;
        }
    }
    let fresh = db.funded_key(1, 0).await;
    assert_eq!(redeem(&gateway, &fresh, wrong).await.status, 429);
}

#[tokio::test]
async fn a_success_does_not_use_up_the_limit() {
    let db = local_db().await;
    let gateway = admin_gateway(&db).await;
    let per_key = model_gateway::key_holder::FAILED_REDEMPTIONS_PER_KEY;
    let created = db
        .admin()
        .create_codes(&topup_codes(per_key + 2, 1))
        .await
        .unwrap();
    let key = db.funded_key(1, 0).await;
    for code in &created.codes {
        let answer = redeem(&gateway, &key, code).await;
        assert_eq!(answer.status, 200, "{:?}", answer.body);
    }
    assert_eq!(db.balance(&key).await, balance(1, i64::from(per_key) + 2));
}

/// The example's command line sells, lists and revokes as the API does.
#[cfg(feature = "sqlite")]
#[tokio::test]
async fn the_command_line_sells_lists_and_revokes_codes() {
    use crate::admin::cli_json;
    let db = sqlite_db().await;
    let gateway = admin_gateway(&db).await;
    let created = cli_json(
        &db,
        &[
            "codes",
            "create",
            "--count",
            "2",
            "--credits",
            "30",
            "--bucket",
            "subscription",
            "--period-days",
            "30",
            "--label",
            "cli",
        ],
    );
    let batch = created["batch"].as_i64().unwrap();
    assert_eq!(created["period_days"], 30);
    let code = created["codes"][0].as_str().unwrap().to_owned();
    let key = db.funded_key(0, 1).await;
    assert_eq!(redeem(&gateway, &key, &code).await.status, 200);
    assert_eq!(db.balance(&key).await, balance(30, 1));
    let listed = cli_json(&db, &["codes", "list"]);
    assert_eq!(
        (&listed["data"][0]["used"], &listed["data"][0]["unused"]),
        (&json!(1), &json!(1))
    );
    let revoked = cli_json(&db, &["codes", "revoke", &batch.to_string()]);
    assert_eq!(
        (&revoked["unused"], &revoked["revoked"]),
        (&json!(0), &json!(1))
    );
}
