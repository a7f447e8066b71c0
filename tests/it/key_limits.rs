//! Spending limits per key: a key spends at most its limit per period, checked in the write
//! that reserves (so concurrent calls on two gateways cannot pass it), refunds give the
//! allowance back, a new period starts from nothing, the key's own `402` names the limit, and
//! `GET /v1/balance` shows it. On `SQLite` (shared and owned), `PostgreSQL` (with and without
//! escrow), `MariaDB` and the memory store.

use crate::common;

use std::sync::Arc;

use chrono::Utc;
use common::*;
use model_gateway::admin::{Admin, KeyPatch};
use model_gateway::call::{KeyLimit, LimitPeriod};
use model_gateway::store::ReserveError;
use model_gateway::{Accounts, Credits, KeyId, MemoryStore, Store, store::Caller, store::Leases};
use sea_orm::ConnectionTrait;

fn limit(credits: i64, period: LimitPeriod) -> KeyPatch {
    KeyPatch {
        limit: Some(Some(KeyLimit {
            credits: Credits::new(credits),
            period,
        })),
        ..KeyPatch::default()
    }
}

async fn set_limit<S: Store>(store: &Arc<S>, key: KeyId, credits: i64, period: LimitPeriod) {
    Admin::new(store.clone())
        .update_key(key, &limit(credits, period))
        .await
        .unwrap();
}

async fn reserve<S: Store>(
    store: &S,
    caller: Caller,
    price: i64,
) -> Result<model_gateway::store::Reservation, ReserveError> {
    reserve_price(store, caller, price).await
}

/// An account with 1000 credits and a key limited to `credits` a day: its caller.
async fn limited_caller<S: Store>(store: &Arc<S>, credits: i64) -> Caller {
    let created = Admin::new(store.clone())
        .create_account(&model_gateway::admin::NewAccount {
            name: "team".into(),
            subscription: 1000,
            topup: 0,
        })
        .await
        .unwrap();
    set_limit(store, created.key_id, credits, LimitPeriod::Day).await;
    Caller {
        account: created.id,
        key: created.key_id,
    }
}

/// Reservations up to the limit pass, the next is refused with the key's own error; a refund
/// gives its credits back to the allowance.
async fn limit_and_refund<S: Store>(store: Arc<S>) {
    let caller = limited_caller(&store, 10).await;
    let first = reserve(&*store, caller, 4).await.unwrap();
    reserve(&*store, caller, 6).await.unwrap();
    assert!(matches!(
        reserve(&*store, caller, 1).await,
        Err(ReserveError::KeyLimitReached)
    ));
    assert!(store.refund(first.call, &upstream_failure()).await.unwrap());
    let after_refund = reserve(&*store, caller, 4).await;
    assert!(after_refund.is_ok(), "{after_refund:?}");
    assert!(matches!(
        reserve(&*store, caller, 1).await,
        Err(ReserveError::KeyLimitReached)
    ));
    let info = store.key_info(caller.key).await.unwrap().unwrap();
    assert_eq!(info.spent, Credits::new(10));
    assert_eq!(
        store.balance(caller.account).await.unwrap().total(),
        Credits::new(990)
    );
}

backends!(
    async fn a_key_stops_at_its_limit_and_a_refund_gives_the_allowance_back(db) {
        limit_and_refund(db.store.clone()).await;
        db.assert_audit_holds().await;
    }
);

#[cfg(feature = "sqlite")]
#[tokio::test]
async fn on_an_owned_file_a_key_stops_at_its_limit_and_a_refund_gives_it_back() {
    let db = owned_sqlite_db().await;
    limit_and_refund(db.store.clone()).await;
    db.assert_audit_holds().await;
}

#[tokio::test]
async fn in_the_memory_store_a_key_stops_at_its_limit_and_a_refund_gives_it_back() {
    limit_and_refund(Arc::new(MemoryStore::new())).await;
}

/// A store on `db` in escrow mode, holding a lease.
async fn escrow_store(db: &TestDb) -> Arc<model_gateway::SeaOrmStore> {
    let store = Arc::new(
        postgres_store(&db.url, db.pg_schema().unwrap())
            .await
            .with_escrow()
            .unwrap(),
    );
    store
        .take_lease(Utc::now(), std::time::Duration::from_secs(600))
        .await
        .unwrap();
    store
}

#[tokio::test]
async fn with_escrow_a_limited_keys_calls_are_held_to_the_limit() {
    let Some(db) = postgres_db().await else {
        return;
    };
    limit_and_refund(escrow_store(&db).await).await;
    db.assert_audit_holds().await;
    db.drop_schema().await;
}

/// Moves what a key spent into the window before, as if its period had ended.
async fn end_the_period(db: &TestDb, key: KeyId) {
    let connection = db.store.connection();
    let backend = connection.get_database_backend();
    let sql = match backend {
        sea_orm::DbBackend::Postgres => {
            "UPDATE mg_api_keys SET limit_window = limit_window - 1 WHERE id = $1"
        }
        _ => "UPDATE mg_api_keys SET limit_window = limit_window - 1 WHERE id = ?",
    };
    connection
        .execute_raw(sea_orm::Statement::from_sql_and_values(
            backend,
            sql,
            [key.0.into()],
        ))
        .await
        .unwrap();
}

backends!(
    async fn a_new_period_starts_from_nothing(db) {
        let caller = limited_caller(&db.store, 10).await;
        reserve(&*db.store, caller, 10).await.unwrap();
        assert!(matches!(
            reserve(&*db.store, caller, 1).await,
            Err(ReserveError::KeyLimitReached)
        ));
        // What was spent now belongs to the period before: the store reads the key again in
        // its next write, and the allowance is whole. (That a refund of an ended period's call
        // gives nothing back to the new one is the rule's own test, `rules::allowance`.)
        end_the_period(&db, caller.key).await;
        reserve(&*db.store, caller, 10).await.unwrap();
        assert!(matches!(
            reserve(&*db.store, caller, 1).await,
            Err(ReserveError::KeyLimitReached)
        ));
        let info = db.store.key_info(caller.key).await.unwrap().unwrap();
        assert_eq!(info.spent, Credits::new(10));
        db.assert_audit_holds().await;
    }
);

#[cfg(feature = "sqlite")]
#[tokio::test]
async fn on_an_owned_file_a_new_period_starts_from_nothing() {
    use model_gateway::Ledger;
    let db = owned_sqlite_db().await;
    let caller = limited_caller(&db.store, 10).await;
    let first = reserve(&*db.store, caller, 10).await.unwrap();
    assert!(db.store.settle(first.call, mock_success()).await.unwrap());
    assert!(matches!(
        reserve(&*db.store, caller, 1).await,
        Err(ReserveError::KeyLimitReached)
    ));
    end_the_period(&db, caller.key).await;
    let second = reserve(&*db.store, caller, 10).await.unwrap();
    assert!(matches!(
        reserve(&*db.store, caller, 1).await,
        Err(ReserveError::KeyLimitReached)
    ));
    assert!(db.store.settle(second.call, mock_success()).await.unwrap());
    assert_eq!(
        db.store.key_info(caller.key).await.unwrap().unwrap().spent,
        Credits::new(10)
    );
    db.assert_audit_holds().await;
}

/// 64 calls at once through two gateways sharing the database, on a key allowed 40 credits
/// (20 calls): exactly 20 are billed, the rest refused with the key's own `402`.
async fn sixty_four_calls_on_two_gateways(first: &TestDb, second: &TestDb) {
    let key = first.funded_key(1000, 0).await;
    let caller = first.caller(&key).await;
    set_limit(&first.store, caller.key, 40, LimitPeriod::Day).await;
    let gateways = [
        start_mock_gateway(first).await,
        start_mock_gateway(second).await,
    ];
    let calls = (0..64).map(|n| {
        let gateway = &gateways[n % 2];
        let key = key.clone();
        async move { gateway.chat(&key, CHAT_MODEL).await }
    });
    let answers = futures::future::join_all(calls).await;
    let billed = answers.iter().filter(|answer| answer.status == 200).count();
    let refused: Vec<_> = answers
        .iter()
        .filter(|answer| answer.status != 200)
        .collect();
    assert_eq!(billed, 20, "{billed} calls billed under a 40-credit limit");
    assert!(
        refused
            .iter()
            .all(|answer| answer.status == 402 && answer.detail() == "API Key 额度已用尽"),
        "{:?}",
        refused
            .iter()
            .map(|a| (a.status, a.body.clone()))
            .collect::<Vec<_>>()
    );
    assert_eq!(first.balance(&key).await.total(), Credits::new(1000 - 40));
    let info = first.store.key_info(caller.key).await.unwrap().unwrap();
    assert_eq!(info.spent, Credits::new(40));
    first.assert_audit_holds().await;
}

backends!(
    #[multi_thread]
    async fn sixty_four_concurrent_calls_on_two_gateways_never_pass_a_key_limit(db) {
        let second = db.second_instance().await;
        sixty_four_calls_on_two_gateways(&db, &second).await;
    }
);

#[cfg(feature = "sqlite")]
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn sixty_four_concurrent_calls_on_an_owned_file_never_pass_a_key_limit() {
    let db = owned_sqlite_db().await;
    sixty_four_calls_on_two_gateways(&db, &db).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn sixty_four_concurrent_calls_on_two_escrow_gateways_never_pass_a_key_limit() {
    let Some(db) = postgres_db().await else {
        return;
    };
    let escrow = |db: &TestDb| {
        let (url, schema) = (db.url.clone(), db.pg_schema().unwrap().to_owned());
        async move {
            let store = postgres_store(&url, &schema).await.with_escrow().unwrap();
            store
                .take_lease(Utc::now(), std::time::Duration::from_secs(600))
                .await
                .unwrap();
            Arc::new(store)
        }
    };
    let first = TestDb::sharing(&db, escrow(&db).await);
    let second = TestDb::sharing(&db, escrow(&db).await);
    sixty_four_calls_on_two_gateways(&first, &second).await;
    drop((first, second));
    db.drop_schema().await;
}

#[tokio::test]
async fn the_balance_shows_the_keys_limit_and_the_admin_api_sets_and_lifts_it() {
    let db = local_db().await;
    let gateway = start_mock_gateway(&db).await;
    let key = db.funded_key(100, 0).await;
    let caller = db.caller(&key).await;
    let patched = db
        .admin()
        .update_key(
            caller.key,
            &KeyPatch::from_json(&serde_json::json!({"limit": {"credits": 5, "period": "month"}}))
                .unwrap(),
        )
        .await
        .unwrap();
    let shown = serde_json::to_value(&patched).unwrap();
    assert_eq!(shown["limit"]["credits"], 5);
    assert_eq!(shown["limit"]["period"], "month");
    assert_eq!(gateway.chat(&key, CHAT_MODEL).await.status, 200);
    assert_eq!(gateway.chat(&key, CHAT_MODEL).await.status, 200);
    let refused = gateway.chat(&key, CHAT_MODEL).await;
    assert_eq!(
        (refused.status, refused.detail()),
        (402, "API Key 额度已用尽")
    );
    let balance = gateway
        .send(
            gateway
                .client
                .get(format!("{}/v1/balance", gateway.base))
                .bearer_auth(&key),
        )
        .await;
    let key_limit = &balance.body["key_limit"];
    assert_eq!(key_limit["credits"], 5);
    assert_eq!(key_limit["period"], "month");
    assert_eq!(key_limit["spent"], 4);
    let resets_at = chrono::DateTime::parse_from_rfc3339(key_limit["resets_at"].as_str().unwrap())
        .unwrap()
        .with_timezone(&Utc);
    assert_eq!(
        Some(resets_at),
        LimitPeriod::Month.window_end(LimitPeriod::Month.window(Utc::now()))
    );
    assert_eq!(balance.body["total"], 96);
    // Another key of the same account is not held back by this one's limit.
    let other = db.admin().create_key(caller.account).await.unwrap();
    assert_eq!(gateway.chat(&other.key, CHAT_MODEL).await.status, 200);
    let without = gateway
        .send(
            gateway
                .client
                .get(format!("{}/v1/balance", gateway.base))
                .bearer_auth(&other.key),
        )
        .await;
    assert!(
        without.body.get("key_limit").is_none(),
        "{:?}",
        without.body
    );
    // Lifted: the key calls again.
    db.admin()
        .update_key(
            caller.key,
            &KeyPatch::from_json(&serde_json::json!({"limit": null})).unwrap(),
        )
        .await
        .unwrap();
    assert_eq!(gateway.chat(&key, CHAT_MODEL).await.status, 200);
    db.assert_audit_holds().await;
}

/// The example's command line sets and lifts a key's limit as the API does.
#[cfg(feature = "sqlite")]
#[tokio::test]
async fn the_command_line_sets_and_lifts_a_keys_limit() {
    use crate::admin::cli_json;
    let db = sqlite_db().await;
    let key = db.funded_key(10, 0).await;
    let id = db.caller(&key).await.key.0.to_string();
    let set = cli_json(
        &db,
        &[
            "keys",
            "update",
            "--id",
            &id,
            "--limit-credits",
            "6",
            "--limit-period",
            "week",
        ],
    );
    assert_eq!(set["limit"]["credits"], 6);
    assert_eq!(set["limit"]["period"], "week");
    assert_eq!(set["limit"]["spent"], 0);
    let lifted = cli_json(&db, &["keys", "update", "--id", &id, "--no-limit"]);
    assert!(lifted["limit"].is_null(), "{lifted}");
}

/// What a settle whose cost passes its reservation moves, for a key limited to 100 a day on an
/// account of 1000 (the adversarial run's finding: a 33-credit reservation settled at 2,000
/// spent 2,000 of the key's 100). By default the reservation is the most a call is charged; when
/// the operator lets a call be charged beyond it, the key's limit still bounds it. Either way
/// the rest is the entry's shortfall, and the next reservation is judged on what was counted.
async fn a_settle_never_passes_the_keys_limit<S: Store>(store: Arc<S>) {
    let settle = |_call, beyond_reservation| model_gateway::store::CallSuccess {
        upstream_status: 200,
        cost: Some(Credits::new(2_000)),
        beyond_reservation,
        ..Default::default()
    };
    // The default: charged the reservation.
    let capped = limited_caller(&store, 100).await;
    let reserved = reserve(&*store, capped, 33).await.unwrap();
    assert!(
        store
            .settle(reserved.call, settle(reserved.call, false))
            .await
            .unwrap()
    );
    let info = store.key_info(capped.key).await.unwrap().unwrap();
    assert_eq!(info.spent, Credits::new(33));
    assert_eq!(
        store.balance(capped.account).await.unwrap().total(),
        Credits::new(967)
    );
    let entry = store
        .recent_calls(capped.account, 10)
        .await
        .unwrap()
        .remove(0);
    assert_eq!(
        (entry.price, entry.shortfall),
        (Credits::new(33), Credits::new(1_967))
    );

    // Beyond the reservation: up to what the key's limit leaves (67 more), never past it.
    let limited = limited_caller(&store, 100).await;
    let reserved = reserve(&*store, limited, 33).await.unwrap();
    assert!(
        store
            .settle(reserved.call, settle(reserved.call, true))
            .await
            .unwrap()
    );
    let info = store.key_info(limited.key).await.unwrap().unwrap();
    assert_eq!(info.spent, Credits::new(100));
    assert_eq!(
        store.balance(limited.account).await.unwrap().total(),
        Credits::new(900)
    );
    let entry = store
        .recent_calls(limited.account, 10)
        .await
        .unwrap()
        .remove(0);
    assert_eq!(
        (entry.price, entry.shortfall),
        (Credits::new(100), Credits::new(1_900))
    );
    assert!(matches!(
        reserve(&*store, limited, 1).await,
        Err(ReserveError::KeyLimitReached)
    ));
    // The audit counts what each account's calls cost beyond their charges, beside its books.
    let audits = store.audit().await.unwrap();
    let short = |account| {
        let audit = audits
            .iter()
            .find(|audit| audit.account == account)
            .unwrap();
        assert!(audit.holds(), "{audit:?}");
        audit.shortfall
    };
    assert_eq!(
        (short(capped.account), short(limited.account)),
        (1_967, 1_900)
    );
}

backends!(
    async fn a_settle_beyond_its_reservation_never_passes_the_keys_limit(db) {
        a_settle_never_passes_the_keys_limit(db.store.clone()).await;
        db.assert_audit_holds().await;
    }
);

#[cfg(feature = "sqlite")]
#[tokio::test]
async fn on_an_owned_file_a_settle_beyond_its_reservation_never_passes_the_keys_limit() {
    let db = owned_sqlite_db().await;
    a_settle_never_passes_the_keys_limit(db.store.clone()).await;
    db.assert_audit_holds().await;
}

#[tokio::test]
async fn in_the_memory_store_a_settle_beyond_its_reservation_never_passes_the_keys_limit() {
    a_settle_never_passes_the_keys_limit(Arc::new(MemoryStore::new())).await;
}

#[tokio::test]
async fn with_escrow_a_settle_beyond_its_reservation_never_passes_the_keys_limit() {
    let Some(db) = postgres_db().await else {
        return;
    };
    a_settle_never_passes_the_keys_limit(escrow_store(&db).await).await;
    db.assert_audit_holds().await;
    db.drop_schema().await;
}
