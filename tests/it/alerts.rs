//! Balance and limit alerts: `account.balance_low` when a reservation takes what an account can
//! spend below its threshold (the default, or its own), once per crossing; `key.limit_reached`
//! when a reservation leaves a key too little of its limit for another call like it, once per
//! window. Each is written in the transaction that reserves, so concurrent calls on two
//! gateways tell it once. On `SQLite` (shared and owned), `PostgreSQL` (with and without
//! escrow) and `MariaDB`.

use crate::common;

use std::sync::Arc;

use chrono::Utc;
use common::*;
use model_gateway::admin::{Admin, KeyPatch, NewAccount};
use model_gateway::call::{KeyLimit, LimitPeriod};
use model_gateway::store::{Caller, EventOutbox, Reservation, ReserveError};
use model_gateway::webhooks::WebhookDispatcher;
use model_gateway::{Accounts, Credits, Ledger, SeaOrmStore};
use serde_json::Value;

/// A store on `db`'s database writing webhook events, telling balances below `threshold`.
async fn alerting_store(db: &TestDb, threshold: i64) -> SeaOrmStore {
    let store = match db.pg_schema() {
        Some(schema) => postgres_store(&db.url, schema).await,
        None => SeaOrmStore::connect(&db.url).await.unwrap(),
    };
    store
        .with_webhook_events()
        .with_low_balance_alert(Credits::new(threshold))
}

/// An owned `SQLite` file whose store writes webhook events, telling balances below
/// `threshold`.
#[cfg(feature = "sqlite")]
async fn owned_alerting_db(threshold: i64) -> (TestDb, tempfile::TempDir) {
    let dir = tempfile::tempdir().unwrap();
    let url = format!(
        "sqlite://{}?mode=rwc",
        dir.path().join("alerts.db").display()
    );
    let store = SeaOrmStore::connect(&url)
        .await
        .unwrap()
        .with_webhook_events()
        .with_low_balance_alert(Credits::new(threshold))
        .own_file()
        .unwrap();
    (TestDb::at(Arc::new(store), url), dir)
}

/// The events of `kind` in `store`'s outbox, oldest first.
async fn events<S: EventOutbox>(store: &S, kind: &str) -> Vec<Value> {
    let mut found: Vec<Value> = store
        .deliveries(None, 1000)
        .await
        .unwrap()
        .into_iter()
        .filter(|delivery| delivery.kind == kind)
        .map(|delivery| serde_json::from_str(&delivery.body).unwrap())
        .collect();
    found.reverse();
    found
}

async fn new_caller(store: &Arc<SeaOrmStore>, topup: i64) -> Caller {
    new_account(store, topup).await.0
}

/// An account with `topup` credits: its first key's caller, and the key in clear.
async fn new_account(store: &Arc<SeaOrmStore>, topup: i64) -> (Caller, String) {
    let created = Admin::new(store.clone())
        .create_account(&NewAccount {
            name: "alerted".into(),
            subscription: 0,
            topup,
        })
        .await
        .unwrap();
    let caller = Caller {
        account: created.id,
        key: created.key_id,
    };
    (caller, created.key)
}

async fn reserve(
    store: &SeaOrmStore,
    caller: Caller,
    price: i64,
) -> Result<Reservation, ReserveError> {
    reserve_price(store, caller, price).await
}

/// A call reserved and billed.
async fn call(store: &SeaOrmStore, caller: Caller, price: i64) {
    let reserved = reserve(store, caller, price).await.unwrap();
    assert!(store.settle(reserved.call, mock_success()).await.unwrap());
}

/// 100 credits, told below 50, at 10 credits a call: told once the balance reaches 40, not again
/// while it stays below; refunds bring it back to 50 and the next call tells it again; the
/// account's own threshold replaces the default, and zero tells nothing.
async fn balance_crossings(store: Arc<SeaOrmStore>) {
    let caller = new_caller(&store, 100).await;
    for _ in 0..5 {
        call(&store, caller, 10).await;
    }
    assert!(events(&*store, "account.balance_low").await.is_empty());
    let sixth = reserve(&store, caller, 10).await.unwrap();
    let told = events(&*store, "account.balance_low").await;
    assert_eq!(told.len(), 1, "{told:?}");
    assert_eq!(told[0]["data"]["account"], caller.account.0);
    assert_eq!(told[0]["data"]["total"], 40);
    assert_eq!(told[0]["data"]["topup"], 40);
    assert_eq!(told[0]["data"]["threshold"], 50);
    let seventh = reserve(&store, caller, 10).await.unwrap();
    assert_eq!(events(&*store, "account.balance_low").await.len(), 1);

    // Back to 50 by refunds, then below again: a new crossing.
    assert!(
        store
            .refund(seventh.call, &upstream_failure())
            .await
            .unwrap()
    );
    assert!(store.refund(sixth.call, &upstream_failure()).await.unwrap());
    assert_eq!(
        store.balance(caller.account).await.unwrap().total(),
        Credits::new(50)
    );
    call(&store, caller, 10).await;
    assert_eq!(events(&*store, "account.balance_low").await.len(), 2);

    // The account's own threshold: zero tells nothing; 25 tells the crossing from 30 to 20.
    assert!(
        store
            .set_low_balance(caller.account, Some(Credits::ZERO))
            .await
            .unwrap()
    );
    call(&store, caller, 10).await;
    assert_eq!(events(&*store, "account.balance_low").await.len(), 2);
    assert!(
        store
            .set_low_balance(caller.account, Some(Credits::new(25)))
            .await
            .unwrap()
    );
    assert_eq!(
        store
            .account(caller.account)
            .await
            .unwrap()
            .unwrap()
            .low_balance_credits,
        Some(Credits::new(25))
    );
    call(&store, caller, 10).await;
    let told = events(&*store, "account.balance_low").await;
    assert_eq!(told.len(), 3);
    assert_eq!(told[2]["data"]["total"], 20);
    assert_eq!(told[2]["data"]["threshold"], 25);

    // A refused call tells nothing.
    assert!(matches!(
        reserve(&store, caller, 500).await,
        Err(ReserveError::InsufficientCredits)
    ));
    assert_eq!(events(&*store, "account.balance_low").await.len(), 3);
}

backends!(
    async fn a_balance_falling_below_its_threshold_is_told_once_per_crossing(db) {
        balance_crossings(Arc::new(alerting_store(&db, 50).await)).await;
        db.assert_audit_holds().await;
    }
);

#[cfg(feature = "sqlite")]
#[tokio::test]
async fn on_an_owned_file_a_balance_falling_below_its_threshold_is_told_once_per_crossing() {
    let (db, _dir) = owned_alerting_db(50).await;
    balance_crossings(db.store.clone()).await;
    db.assert_audit_holds().await;
}

async fn set_limit(store: &Arc<SeaOrmStore>, caller: Caller, credits: i64) {
    let patch = KeyPatch {
        limit: Some(Some(KeyLimit {
            credits: Credits::new(credits),
            period: LimitPeriod::Day,
        })),
        ..KeyPatch::default()
    };
    Admin::new(store.clone())
        .update_key(caller.key, &patch)
        .await
        .unwrap();
}

/// A key allowed 10 a day, at 3 credits a call: the third call leaves 1, too little for
/// another, and is told; calls, refusals, a refund and the limit reached again in the same
/// window tell nothing more; the same limit set again keeps that; a new limit is told again
/// once reached.
async fn limit_reached(store: Arc<SeaOrmStore>) {
    let caller = new_caller(&store, 1000).await;
    set_limit(&store, caller, 10).await;
    for _ in 0..2 {
        call(&store, caller, 3).await;
    }
    assert!(events(&*store, "key.limit_reached").await.is_empty());
    let third = reserve(&store, caller, 3).await.unwrap();
    let told = events(&*store, "key.limit_reached").await;
    assert_eq!(told.len(), 1, "{told:?}");
    let data = &told[0]["data"];
    assert_eq!(data["account"], caller.account.0);
    assert_eq!(data["key"], caller.key.0);
    assert_eq!(data["limit"]["credits"], 10);
    assert_eq!(data["limit"]["period"], "day");
    assert_eq!(data["spent"], 9);
    assert!(data["resets_at"].as_str().unwrap() > Utc::now().to_rfc3339().as_str());

    // In the same window: nothing more, whatever happens.
    call(&store, caller, 1).await;
    assert!(matches!(
        reserve(&store, caller, 1).await,
        Err(ReserveError::KeyLimitReached)
    ));
    assert!(store.refund(third.call, &upstream_failure()).await.unwrap());
    call(&store, caller, 3).await;
    assert_eq!(events(&*store, "key.limit_reached").await.len(), 1);
    set_limit(&store, caller, 10).await;
    assert!(matches!(
        reserve(&store, caller, 1).await,
        Err(ReserveError::KeyLimitReached)
    ));
    assert_eq!(events(&*store, "key.limit_reached").await.len(), 1);

    // A higher limit, reached: told again.
    set_limit(&store, caller, 12).await;
    call(&store, caller, 2).await;
    let told = events(&*store, "key.limit_reached").await;
    assert_eq!(told.len(), 2, "{told:?}");
    assert_eq!(told[1]["data"]["limit"]["credits"], 12);
    assert_eq!(told[1]["data"]["spent"], 12);
}

backends!(
    async fn a_key_reaching_its_limit_is_told_once_per_window(db) {
        limit_reached(Arc::new(alerting_store(&db, 0).await)).await;
        db.assert_audit_holds().await;
    }
);

#[cfg(feature = "sqlite")]
#[tokio::test]
async fn on_an_owned_file_a_key_reaching_its_limit_is_told_once_per_window() {
    let (db, _dir) = owned_alerting_db(0).await;
    limit_reached(db.store.clone()).await;
    db.assert_audit_holds().await;
}

/// 128 calls at once through two gateways on one account of 300 credits, told below 150, with
/// a key allowed 200 a day at 2 credits a call: 100 are billed, and each alert is told once.
async fn many_calls_tell_once(first: &TestDb, second: &TestDb) {
    let (caller, key) = new_account(&first.store, 300).await;
    set_limit(&first.store, caller, 200).await;
    let gateways = [
        start_mock_gateway(first).await,
        start_mock_gateway(second).await,
    ];
    let calls = (0..128).map(|n| {
        let gateway = &gateways[n % 2];
        let key = key.clone();
        async move { gateway.chat(&key, CHAT_MODEL).await.status }
    });
    let answers = futures::future::join_all(calls).await;
    let billed = answers.iter().filter(|status| **status == 200).count();
    assert_eq!(billed, 100, "{answers:?}");
    assert!(answers.iter().all(|status| [200, 402].contains(status)));
    let low = events(&*first.store, "account.balance_low").await;
    assert_eq!(low.len(), 1, "{low:?}");
    assert_eq!(low[0]["data"]["threshold"], 150);
    let total = low[0]["data"]["total"].as_i64().unwrap();
    assert!((0..150).contains(&total), "told at {total}");
    let reached = events(&*first.store, "key.limit_reached").await;
    assert_eq!(reached.len(), 1, "{reached:?}");
    assert_eq!(reached[0]["data"]["spent"], 200);
    first.assert_audit_holds().await;
}

backends!(
    #[multi_thread]
    async fn concurrent_calls_on_two_gateways_tell_each_alert_once(db) {
        let first = TestDb::sharing(&db, Arc::new(alerting_store(&db, 150).await));
        let second = TestDb::sharing(&db, Arc::new(alerting_store(&db, 150).await));
        many_calls_tell_once(&first, &second).await;
    }
);

#[cfg(feature = "sqlite")]
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_calls_on_an_owned_file_tell_each_alert_once() {
    let (db, _dir) = owned_alerting_db(150).await;
    many_calls_tell_once(&db, &db).await;
}

#[cfg(feature = "postgres")]
async fn escrow_alerting_store(db: &TestDb, threshold: i64) -> Arc<SeaOrmStore> {
    use model_gateway::store::Leases;
    let store = alerting_store(db, threshold).await.with_escrow().unwrap();
    store
        .take_lease(Utc::now(), std::time::Duration::from_secs(600))
        .await
        .unwrap();
    Arc::new(store)
}

#[cfg(feature = "postgres")]
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_calls_on_two_escrow_gateways_tell_each_alert_once() {
    let Some(db) = postgres_db().await else {
        return;
    };
    let first = TestDb::sharing(&db, escrow_alerting_store(&db, 150).await);
    let second = TestDb::sharing(&db, escrow_alerting_store(&db, 150).await);
    many_calls_tell_once(&first, &second).await;
    drop((first, second));
    db.drop_schema().await;
}

/// With escrow, a refill leaves the threshold in the account's row (here above the 256 calls'
/// worth below which an account gets no escrow): the balance crosses it only through a
/// reservation in the database, which tells it, once, just below.
#[cfg(feature = "postgres")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_escrow_a_balance_falling_below_its_threshold_is_told_once() {
    let Some(db) = postgres_db().await else {
        return;
    };
    let store = escrow_alerting_store(&db, 6000).await;
    let caller = new_caller(&store, 8000).await;
    for _ in 0..110 {
        call(&store, caller, 20).await;
    }
    assert_eq!(store.held_reservations().await, 0);
    let told = events(&*store, "account.balance_low").await;
    assert_eq!(told.len(), 1, "{told:?}");
    let total = told[0]["data"]["total"].as_i64().unwrap();
    assert!((5980..6000).contains(&total), "told at {total}");
    assert_eq!(
        store.balance(caller.account).await.unwrap().total(),
        Credits::new(5800)
    );
    db.assert_audit_holds().await;
    drop(store);
    db.drop_schema().await;
}

/// The alerts reach a receiver signed, like every event.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn alerts_are_delivered_signed() {
    let db = local_db().await;
    let store = Arc::new(alerting_store(&db, 5).await);
    let caller = new_caller(&store, 10).await;
    set_limit(&store, caller, 6).await;
    for _ in 0..3 {
        call(&store, caller, 2).await;
    }
    let receiver = crate::webhooks::Receiver::default();
    let url = receiver.start(0).await;
    let dispatcher = WebhookDispatcher::new(store.clone(), url, "whsec_test_secret").unwrap();
    assert_eq!(dispatcher.deliver_due().await.unwrap(), 2);
    let accepted = receiver.accepted();
    let mut kinds: Vec<_> = accepted
        .iter()
        .map(|(_, event, good)| {
            assert!(good, "a signature did not hold");
            event["type"].as_str().unwrap().to_owned()
        })
        .collect();
    kinds.sort();
    assert_eq!(kinds, ["account.balance_low", "key.limit_reached"]);
}

/// `PATCH /admin/accounts/{id}` sets and clears an account's own threshold.
#[tokio::test]
async fn the_admin_api_sets_an_accounts_own_threshold() {
    let db = local_db().await;
    let store = Arc::new(alerting_store(&db, 0).await);
    let token = "admin-token-for-tests-0123456789";
    let router = model_gateway::Gateway::new(
        store.clone(),
        Arc::new(model_gateway::Catalogue::demo()),
        model_gateway::Upstream::Mock(model_gateway::upstream::MockUpstream::new()),
    )
    .admin_token(Some(model_gateway::admin::AdminToken::new(token).unwrap()))
    .router();
    let gateway = serve_router(router).await;
    let caller = new_caller(&store, 10).await;
    let patch = |id: String, body: &'static str| {
        gateway
            .client
            .patch(format!("{}/admin/accounts/{id}", gateway.base))
            .bearer_auth(token)
            .header("content-type", "application/json")
            .body(body)
    };
    let id = caller.account.0.to_string();
    let set = gateway
        .send(patch(id.clone(), r#"{"low_balance_credits": 7}"#))
        .await;
    assert_eq!(set.status, 200, "{:?}", set.body);
    assert_eq!(set.body["low_balance_credits"], 7);
    let shown = store.account(caller.account).await.unwrap().unwrap();
    assert_eq!(shown.low_balance_credits, Some(Credits::new(7)));
    let cleared = gateway
        .send(patch(id.clone(), r#"{"low_balance_credits": null}"#))
        .await;
    assert_eq!(cleared.status, 200);
    assert!(cleared.body["low_balance_credits"].is_null());
    let negative = gateway
        .send(patch(id.clone(), r#"{"low_balance_credits": -1}"#))
        .await;
    assert_eq!(negative.status, 400);
    assert!(
        negative.detail().contains("low_balance_credits"),
        "{}",
        negative.detail()
    );
    let unknown = gateway.send(patch(id, r#"{"low_balance": 1}"#)).await;
    assert_eq!(unknown.status, 400);
    let missing = gateway
        .send(patch("999999".into(), r#"{"low_balance_credits": 1}"#))
        .await;
    assert_eq!(missing.status, 404);
}

/// The example's command line sets and clears an account's own threshold as the API does.
#[cfg(feature = "sqlite")]
#[tokio::test]
async fn the_command_line_sets_an_accounts_own_threshold() {
    use crate::admin::cli_json;
    let db = sqlite_db().await;
    let caller = new_caller(&db.store, 10).await;
    let id = caller.account.0.to_string();
    let set = cli_json(
        &db,
        &["accounts", "update", &id, "--low-balance-credits", "4"],
    );
    assert_eq!(set["low_balance_credits"], 4);
    let shown = db.store.account(caller.account).await.unwrap().unwrap();
    assert_eq!(shown.low_balance_credits, Some(Credits::new(4)));
    let cleared = cli_json(&db, &["accounts", "update", &id, "--default-low-balance"]);
    assert!(cleared["low_balance_credits"].is_null(), "{cleared}");
}
