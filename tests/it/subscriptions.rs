//! Subscription periods: credits granted for a period lapse when it ends (recorded, so the
//! audit balances), top-up credits never do, a renewal replaces what was left, and the end is
//! exact under concurrency: a call made before it may spend the period's credits, a call made
//! at or after it never does. Time is a parameter of every store operation here, so the tests
//! set it; they run on `SQLite`, `PostgreSQL` and `MariaDB`. One test goes through the HTTP API on the
//! real clock.

use crate::common;

use std::sync::Arc;

use chrono::{DateTime, Duration, TimeZone, Utc};
use common::*;
use model_gateway::store::Grant;
use model_gateway::{
    AccountId, Accounts, Balance, Credits, KeyId, Ledger, Protocol, SeaOrmStore, credits::Bucket,
    keys::NewApiKey, store::CallFailure, store::Caller, store::ChargeRequest, store::Reservation,
    store::ReserveError,
};
use serde_json::json;

fn t(seconds: i64) -> DateTime<Utc> {
    Utc.with_ymd_and_hms(2030, 1, 1, 0, 0, 0).unwrap() + Duration::seconds(seconds)
}

async fn account_with_key(store: &SeaOrmStore) -> Caller {
    let account = store.create_account("subscriber").await.unwrap();
    let key = store
        .add_key(account, &NewApiKey::generate())
        .await
        .unwrap();
    Caller { account, key }
}

async fn grant(
    store: &SeaOrmStore,
    account: AccountId,
    bucket: Bucket,
    amount: i64,
    period_end: Option<DateTime<Utc>>,
    at: DateTime<Utc>,
) -> Balance {
    let grant = Grant {
        period_end,
        at,
        ..Grant::plain(bucket, Credits::new(amount))
    };
    store.grant_once(account, grant).await.unwrap().balance
}

/// Grants `amount` subscription credits for a period ending at `end`, granted at `at`.
async fn subscription_period(
    store: &SeaOrmStore,
    account: AccountId,
    amount: i64,
    end: DateTime<Utc>,
    at: DateTime<Utc>,
) -> Balance {
    grant(store, account, Bucket::Subscription, amount, Some(end), at).await
}

/// Records the lapses of periods ended by `at`.
async fn lapse(store: &SeaOrmStore, at: DateTime<Utc>) -> Vec<model_gateway::store::Lapse> {
    store.lapse_ended_subscriptions(at).await.unwrap()
}

/// Asserts the (one) account's books balance with `lapsed` credits lapsed.
async fn assert_books_hold_with_lapsed(store: &SeaOrmStore, lapsed: i128) {
    let audit = store.audit().await.unwrap().remove(0);
    assert_eq!(audit.lapsed, lapsed);
    assert!(audit.holds(), "{audit:?}");
}

async fn reserve(
    store: &SeaOrmStore,
    caller: Caller,
    price: i64,
    at: DateTime<Utc>,
) -> Result<Reservation, ReserveError> {
    store
        .reserve(ChargeRequest::new(caller, Protocol::Messages, "m", Credits::new(price)).at(at))
        .await
}

#[tokio::test]
async fn subscription_credits_lapse_when_their_period_ends_and_top_up_credits_never_do() {
    each_database(async |db| {
        let store = db.store.as_ref();
        let caller = account_with_key(store).await;
        subscription_period(store, caller.account, 10, t(100), t(0)).await;
        grant(store, caller.account, Bucket::Topup, 5, None, t(0)).await;

        let before_end = reserve(store, caller, 3, t(99)).await.unwrap();
        assert_eq!(before_end.taken.subscription, Credits::new(3));
        // At the end, the period's 7 credits are no longer spendable, lapse recorded or not.
        let at_end = reserve(store, caller, 3, t(100)).await.unwrap();
        assert_eq!(
            (at_end.taken.subscription, at_end.taken.topup),
            (Credits::new(0), Credits::new(3))
        );
        assert!(matches!(
            reserve(store, caller, 3, t(101)).await,
            Err(ReserveError::InsufficientCredits)
        ));
        db.assert_audit_holds().await;

        assert!(lapse(store, t(99)).await.is_empty());
        let lapses = lapse(store, t(100)).await;
        assert_eq!(lapses.len(), 1);
        assert_eq!(
            (lapses[0].account, lapses[0].amount, lapses[0].period_end),
            (caller.account, Credits::new(7), t(100))
        );
        assert_eq!(store.balance(caller.account).await.unwrap(), balance(0, 2));
        assert!(lapse(store, t(500)).await.is_empty());
        assert_books_hold_with_lapsed(store, 7).await;
    })
    .await;
}

#[tokio::test]
async fn a_call_made_before_the_end_keeps_its_credits_and_its_refund_after_the_end_lapses() {
    each_database(async |db| {
        let store = db.store.as_ref();
        let caller = account_with_key(store).await;
        subscription_period(store, caller.account, 10, t(100), t(0)).await;
        let call = reserve(store, caller, 4, t(50)).await.unwrap();
        let lapses = lapse(store, t(120)).await;
        assert_eq!(
            lapses[0].amount,
            Credits::new(6),
            "the call's 4 were not taken from it"
        );

        let failure = CallFailure {
            upstream_status: Some(503),
            error: "down".into(),
        };
        assert!(store.refund(call.call, &failure).await.unwrap());
        // Back in the ended period: not spendable, and lapsed on the next pass.
        assert_eq!(store.balance(caller.account).await.unwrap(), balance(4, 0));
        assert!(matches!(
            reserve(store, caller, 1, t(121)).await,
            Err(ReserveError::InsufficientCredits)
        ));
        db.assert_audit_holds().await;
        let again = lapse(store, t(130)).await;
        assert_eq!(again[0].amount, Credits::new(4));
        assert_eq!(store.balance(caller.account).await.unwrap(), balance(0, 0));
        assert_books_hold_with_lapsed(store, 10).await;
    })
    .await;
}

#[tokio::test]
async fn a_renewal_replaces_what_was_left_with_the_next_periods_credits() {
    each_database(async |db| {
        let store = db.store.as_ref();
        let caller = account_with_key(store).await;
        subscription_period(store, caller.account, 10, t(100), t(0)).await;
        reserve(store, caller, 4, t(10)).await.unwrap();
        // Renewed early: the 6 left of this period lapse, the next period's 10 replace them.
        let renewed = subscription_period(store, caller.account, 10, t(200), t(90)).await;
        assert_eq!(renewed, balance(10, 0));
        let account = store.account(caller.account).await.unwrap().unwrap();
        assert_eq!(account.subscription_ends_at, Some(t(200)));
        assert_eq!(
            reserve(store, caller, 2, t(150))
                .await
                .unwrap()
                .taken
                .subscription,
            Credits::new(2)
        );
        // A grant without a period adds to the running period and ends with it.
        grant(store, caller.account, Bucket::Subscription, 5, None, t(160)).await;
        assert_eq!(store.balance(caller.account).await.unwrap(), balance(13, 0));
        let lapses = lapse(store, t(200)).await;
        assert_eq!(lapses[0].amount, Credits::new(13));
        // One into an ended period starts credits that never lapse.
        grant(store, caller.account, Bucket::Subscription, 3, None, t(300)).await;
        let account = store.account(caller.account).await.unwrap().unwrap();
        assert_eq!(account.subscription_ends_at, None);
        assert!(lapse(store, t(10_000)).await.is_empty());
        let audit = store.audit().await.unwrap().remove(0);
        assert_eq!(audit.lapsed, 6 + 13);
        assert!(audit.holds(), "{audit:?}");
    })
    .await;
}

#[tokio::test]
async fn the_end_is_exact_under_concurrency() {
    each_database(async |db| {
        let store = db.store.clone();
        let caller = account_with_key(&store).await;
        grant(
            &store,
            caller.account,
            Bucket::Subscription,
            30,
            Some(t(100)),
            t(0),
        )
        .await;
        grant(&store, caller.account, Bucket::Topup, 40, None, t(0)).await;
        // Forty calls of 1 credit, half made just before the end and half at it, racing a
        // lapse pass at the end.
        let calls = (0..40).map(|i| {
            let store = store.clone();
            let at = if i % 2 == 0 { t(99) } else { t(100) };
            tokio::spawn(async move { (at, reserve(&store, caller, 1, at).await) })
        });
        let racing_lapse = {
            let store = store.clone();
            tokio::spawn(async move { lapse(&store, t(100)).await })
        };
        let mut from_subscription = 0;
        for call in futures::future::join_all(calls).await {
            let (at, reserved) = call.unwrap();
            let Ok(reservation) = reserved else {
                panic!("40 top-up credits alone cover 40 calls: {reserved:?}");
            };
            if at >= t(100) {
                assert_eq!(
                    reservation.taken.subscription,
                    Credits::new(0),
                    "spent after the end"
                );
            }
            from_subscription += reservation.taken.subscription.get();
        }
        let lapsed: i64 = racing_lapse
            .await
            .unwrap()
            .iter()
            .map(|l| l.amount.get())
            .sum();
        assert!(
            from_subscription <= 20,
            "only calls before the end spend the period"
        );
        let after = lapse(&store, t(100)).await;
        let lapsed = lapsed + after.iter().map(|l| l.amount.get()).sum::<i64>();
        assert_eq!(
            from_subscription + lapsed,
            30,
            "every period credit spent or lapsed once"
        );
        assert_eq!(
            store.balance(caller.account).await.unwrap().subscription,
            Credits::new(0)
        );
        db.assert_audit_holds().await;
    })
    .await;
}

/// The key of `db`'s only account made by `funded_key`.
async fn caller_of(db: &TestDb, key: &str) -> Caller {
    let key_id: KeyId = model_gateway::KeyStore::caller_for_key(
        db.store.as_ref(),
        &model_gateway::keys::KeyHash::of(key),
    )
    .await
    .unwrap()
    .unwrap()
    .key;
    Caller {
        account: db.account(key).await,
        key: key_id,
    }
}

#[tokio::test]
async fn periods_granted_through_the_api_end_on_the_real_clock() {
    let db = local_db().await;
    let router = model_gateway::Gateway::new(
        db.store.clone(),
        Arc::new(model_gateway::Catalogue::demo()),
        model_gateway::Upstream::Mock(model_gateway::upstream::MockUpstream::new()),
    )
    .admin_token(Some(
        model_gateway::admin::AdminToken::new("admin-token-for-tests-0123456789").unwrap(),
    ))
    .router();
    let gateway = serve_router(router).await;
    let key = db.funded_key(0, 2).await;
    let caller = caller_of(&db, &key).await;
    let grants = format!(
        "{}/admin/accounts/{}/grants",
        gateway.base, caller.account.0
    );
    let ends_at = Utc::now() + Duration::seconds(2);
    let granted = gateway
        .send(
            gateway
                .client
                .post(&grants)
                .bearer_auth("admin-token-for-tests-0123456789")
                .json(&json!({"bucket": "subscription", "credits": 10, "ends_at": ends_at.to_rfc3339()})),
        )
        .await;
    assert_eq!(granted.status, 200, "{:?}", granted.body);
    assert_eq!(granted.body["balance"]["subscription"], 10);
    let shown_end: DateTime<Utc> = granted.body["balance"]["subscription_ends_at"]
        .as_str()
        .unwrap()
        .parse()
        .unwrap();
    assert_eq!(shown_end.timestamp(), ends_at.timestamp());
    let topup_period = gateway
        .send(
            gateway
                .client
                .post(&grants)
                .bearer_auth("admin-token-for-tests-0123456789")
                .json(&json!({"bucket": "topup", "credits": 1, "period_days": 30})),
        )
        .await;
    assert_eq!(topup_period.status, 400);
    assert!(topup_period.detail().contains("period_days"));

    let balance_url = format!("{}/v1/balance", gateway.base);
    let read = async || {
        gateway
            .send(gateway.client.get(&balance_url).bearer_auth(&key))
            .await
    };
    let during = read().await;
    assert_eq!(during.body["subscription"], 10);
    assert_eq!(
        during.body["subscription_ends_at"],
        granted.body["balance"]["subscription_ends_at"]
    );
    assert_eq!(gateway.chat(&key, CHAT_MODEL).await.status, 200);

    tokio::time::sleep(
        (ends_at - Utc::now()).to_std().unwrap_or_default() + std::time::Duration::from_millis(100),
    )
    .await;
    let after = read().await;
    assert_eq!(
        (
            after.body["subscription"].clone(),
            after.body["topup"].clone()
        ),
        (json!(0), json!(2))
    );
    assert_eq!(
        gateway.chat(&key, CHAT_MODEL).await.status,
        200,
        "paid from top-up"
    );
    assert_eq!(
        gateway.chat(&key, CHAT_MODEL).await.status,
        402,
        "the period's credits are gone"
    );
    let calls = db.calls(&key).await;
    assert_eq!(calls[0].charged_topup, Credits::new(CHAT_PRICE));
    assert_eq!(calls[1].charged_subscription, Credits::new(CHAT_PRICE));
    lapse(&db.store, Utc::now()).await;
    assert_eq!(db.balance(&key).await, balance(0, 0));
    db.assert_audit_holds().await;
}

#[tokio::test]
async fn a_renewal_past_the_largest_balance_is_refused_and_lapses_nothing() {
    each_database(async |db| {
        let store = db.store.as_ref();
        let caller = account_with_key(store).await;
        subscription_period(store, caller.account, 5, t(100), t(0)).await;
        grant(
            store,
            caller.account,
            Bucket::Topup,
            i64::MAX - 5,
            None,
            t(0),
        )
        .await;
        let renewal = Grant {
            period_end: Some(t(200)),
            at: t(50),
            ..Grant::plain(Bucket::Subscription, Credits::new(6))
        };
        let refused = store.grant_once(caller.account, renewal).await.unwrap_err();
        assert!(
            matches!(
                refused,
                model_gateway::store::StoreError::BalanceOverflow(_)
            ),
            "{refused}"
        );
        assert_eq!(
            store.balance(caller.account).await.unwrap(),
            balance(5, i64::MAX - 5)
        );
        let account = store.account(caller.account).await.unwrap().unwrap();
        assert_eq!(
            account.subscription_ends_at,
            Some(t(100)),
            "the period is unchanged"
        );
        assert_books_hold_with_lapsed(store, 0).await;
    })
    .await;
}
