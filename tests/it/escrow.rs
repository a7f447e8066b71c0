//! Credit escrow on `PostgreSQL` (`SeaOrmStore::with_escrow`): a call is written once, against an
//! instance's escrow, and every money rule holds as without it: the audit, revocation at once,
//! subscription credits first, lapses, no overdraft with two instances, and the escrow coming
//! back on release and after a crash (lease expiry).

#![cfg(feature = "postgres")]

use crate::common;

use std::sync::Arc;
use std::time::Duration;

use chrono::{DateTime, Utc};
use common::*;
use model_gateway::store::Grant;
use model_gateway::{
    Accounts, Credits, Ledger, Protocol, SeaOrmStore, credits::Bucket, store::CallFailure,
    store::CallStatus, store::CallSuccess, store::Caller, store::ChargeRequest, store::Leases,
    store::Reservation, store::ReserveError,
};
use sea_orm::ConnectionTrait;

const PRICE: i64 = 2;
/// The instances' leases: no test renews them, and a lease that runs out mid-test gives its
/// escrow back to the first call refused for credits (a loaded CI runner once took more than
/// 10 s over a test's 500 calls).
const TTL: Duration = Duration::from_secs(600);

/// What most tests start from: their own `PostgreSQL` schema (`None` when `TEST_POSTGRES_URL`
/// is unset), one escrow instance whose lease was taken `now`, and an account with one key.
type OneInstance = (TestDb, DateTime<Utc>, Arc<SeaOrmStore>, String, Caller);

async fn one_instance(subscription: i64, topup: i64) -> Option<OneInstance> {
    let db = postgres_db().await?;
    let now = Utc::now();
    let instance = escrow_instance(&db, now).await;
    let (key, caller) = funded(&db, subscription, topup).await;
    Some((db, now, instance, key, caller))
}

/// An account with these credits: its key, and who calls with it.
async fn funded(db: &TestDb, subscription: i64, topup: i64) -> (String, Caller) {
    let key = db.funded_key(subscription, topup).await;
    let caller = db.caller(&key).await;
    (key, caller)
}

/// Grants `amount` subscription credits in a period ending an hour after `now`; returns its end.
async fn grant_period(
    db: &TestDb,
    caller: Caller,
    now: DateTime<Utc>,
    amount: i64,
) -> DateTime<Utc> {
    let period_end = now + chrono::Duration::hours(1);
    let grant = Grant {
        period_end: Some(period_end),
        ..Grant::plain(Bucket::Subscription, Credits::new(amount))
    };
    db.store.grant_once(caller.account, grant).await.unwrap();
    period_end
}

/// A gateway instance charging against escrow, holding a lease taken at `now`.
async fn escrow_instance(db: &TestDb, now: DateTime<Utc>) -> Arc<SeaOrmStore> {
    let store = postgres_store(&db.url, db.pg_schema().unwrap())
        .await
        .with_escrow()
        .unwrap();
    store.take_lease(now, TTL).await.unwrap().unwrap();
    Arc::new(store)
}

/// The same, giving back an account's free escrow once no call was held on it for `idle`.
async fn escrow_instance_idle_after(
    db: &TestDb,
    now: DateTime<Utc>,
    idle: Duration,
) -> Arc<SeaOrmStore> {
    let store = postgres_store(&db.url, db.pg_schema().unwrap())
        .await
        .with_escrow_idle_after(idle)
        .unwrap();
    store.take_lease(now, TTL).await.unwrap().unwrap();
    Arc::new(store)
}

async fn reserve(store: &SeaOrmStore, caller: Caller) -> Result<Reservation, ReserveError> {
    store
        .reserve(ChargeRequest::new(
            caller,
            Protocol::ChatCompletions,
            "gpt-4o-mini",
            Credits::new(PRICE),
        ))
        .await
}

/// A call with an idempotency key of its own (`nth`), reserved in the database.
async fn reserve_keyed(
    store: &SeaOrmStore,
    caller: Caller,
    nth: usize,
) -> Result<Reservation, ReserveError> {
    let idempotency =
        model_gateway::call::IdempotencyKey::new(&format!("k{nth}"), "/v1/messages", b"{}")
            .unwrap();
    store
        .reserve(
            ChargeRequest::new(
                caller,
                Protocol::Messages,
                "claude-3-5-haiku",
                Credits::new(PRICE),
            )
            .with_idempotency(Some(&idempotency)),
        )
        .await
}

async fn settle(store: &SeaOrmStore, reservation: &Reservation) -> bool {
    store
        .settle(reservation.call, CallSuccess::default())
        .await
        .unwrap()
}

async fn refund(store: &SeaOrmStore, reservation: &Reservation) -> bool {
    let failure = CallFailure {
        upstream_status: Some(500),
        error: "test".into(),
    };
    store.refund(reservation.call, &failure).await.unwrap()
}

/// `clients` concurrent clients making `calls` calls each, client `i` through instance
/// `i % 2`, each call settled if reserved; returns how many were billed.
async fn charge_from_both(
    instances: &[Arc<SeaOrmStore>; 2],
    caller: Caller,
    clients: usize,
    calls: usize,
) -> i64 {
    let clients: Vec<_> = (0..clients)
        .map(|i| {
            let instance = instances[i % 2].clone();
            tokio::spawn(async move {
                let mut billed = 0;
                for _ in 0..calls {
                    match reserve(&instance, caller).await {
                        Ok(reservation) => {
                            billed += i64::from(settle(&instance, &reservation).await)
                        }
                        Err(ReserveError::InsufficientCredits) => {}
                        Err(error) => panic!("{error}"),
                    }
                }
                billed
            })
        })
        .collect();
    let mut billed = 0;
    for client in clients {
        billed += client.await.unwrap();
    }
    billed
}

/// `clients` concurrent clients on `instance`, each making `calls` calls, every one of which
/// must be reserved and billed.
fn billing_clients(
    instance: &Arc<SeaOrmStore>,
    caller: Caller,
    clients: usize,
    calls: usize,
) -> Vec<tokio::task::JoinHandle<()>> {
    (0..clients)
        .map(|_| {
            let instance = instance.clone();
            tokio::spawn(async move {
                for nth in 0..calls {
                    let reservation = reserve(&instance, caller).await.unwrap();
                    assert!(
                        settle(&instance, &reservation).await,
                        "call {nth} not billed"
                    );
                }
            })
        })
        .collect()
}

/// The account's row, and the sum of its escrow rows, as stored.
async fn stored(db: &TestDb, caller: Caller) -> ((i64, i64), (i64, i64)) {
    let account = caller.account.0;
    let read = |sql: String| async move {
        let row = db
            .store
            .connection()
            .query_one_raw(sea_orm::Statement::from_string(
                sea_orm::DbBackend::Postgres,
                sql,
            ))
            .await
            .unwrap()
            .unwrap();
        (
            row.try_get_by_index::<i64>(0).unwrap(),
            row.try_get_by_index::<i64>(1).unwrap(),
        )
    };
    let row = read(format!(
        "SELECT subscription_credits, topup_credits FROM mg_accounts WHERE id = {account}"
    ))
    .await;
    let escrowed = read(format!(
        "SELECT CAST(COALESCE(SUM(subscription_credits), 0) AS BIGINT), \
         CAST(COALESCE(SUM(topup_credits), 0) AS BIGINT) FROM mg_escrows WHERE account_id = {account}"
    ))
    .await;
    (row, escrowed)
}

fn count(calls: &[model_gateway::store::CallRecord], status: CallStatus) -> usize {
    calls.iter().filter(|call| call.status == status).count()
}

#[tokio::test]
async fn escrow_bills_each_call_once_and_comes_back_on_release() {
    let Some((db, _, instance, key, caller)) = one_instance(1000, 500).await else {
        return;
    };
    for i in 0..30 {
        let reservation = reserve(&instance, caller).await.unwrap();
        assert_eq!(instance.held_reservations().await, 1);
        if i % 3 == 0 {
            assert!(refund(&instance, &reservation).await);
            assert!(!settle(&instance, &reservation).await, "ended once only");
        } else {
            assert!(settle(&instance, &reservation).await);
            assert!(!refund(&instance, &reservation).await, "ended once only");
        }
    }
    assert_eq!(instance.held_reservations().await, 0);
    let calls = db.calls(&key).await;
    assert_eq!(count(&calls, CallStatus::Ok), 20);
    assert_eq!(count(&calls, CallStatus::Refunded), 10);
    assert_eq!(count(&calls, CallStatus::Pending), 0);
    // 20 billed calls, subscription first.
    let left = balance(1000 - 20 * PRICE, 500);
    assert_eq!(
        db.balance(&key).await,
        left,
        "seen by a store without escrow"
    );
    assert_eq!(instance.balance(caller.account).await.unwrap(), left);
    let (row, escrowed) = stored(&db, caller).await;
    assert!(
        escrowed.0 > 0,
        "the instance took subscription credits into escrow"
    );
    assert_eq!((row.0 + escrowed.0, row.1 + escrowed.1), (960, 500));
    db.assert_audit_holds().await;

    instance.release_lease().await.unwrap();
    assert_eq!(
        stored(&db, caller).await,
        ((960, 500), (0, 0)),
        "all came back"
    );
    db.assert_audit_holds().await;
}

#[tokio::test]
async fn a_crashed_instances_escrow_comes_back_when_its_lease_ends() {
    let Some((db, now, instance, key, caller)) = one_instance(0, 1000).await else {
        return;
    };
    let billed = reserve(&instance, caller).await.unwrap();
    assert!(settle(&instance, &billed).await);
    let _held = reserve(&instance, caller).await.unwrap();
    let _also_held = reserve(&instance, caller).await.unwrap();
    // Two calls held: the balance shown counts them as spent.
    assert_eq!(
        instance.balance(caller.account).await.unwrap(),
        balance(0, 1000 - 3 * PRICE)
    );
    assert_eq!(db.balance(&key).await, balance(0, 1000 - PRICE));
    // The instance dies: no release, no settle.
    drop(instance);

    let (row, escrowed) = stored(&db, caller).await;
    assert!(escrowed.1 > 0, "{row:?} {escrowed:?}");
    let ttl = chrono::Duration::from_std(TTL).unwrap();
    let later = |seconds| now + chrono::Duration::seconds(seconds);
    assert!(
        db.store
            .orphaned_reservations(later(5), 100)
            .await
            .unwrap()
            .is_empty()
    );
    assert!(stored(&db, caller).await.1.1 > 0, "the lease still holds");
    // Its lease ends: recovery gives the escrow back. The held calls have no entries and
    // moved nothing, so there is nothing to refund.
    assert!(
        db.store
            .orphaned_reservations(later(1) + ttl, 100)
            .await
            .unwrap()
            .is_empty()
    );
    assert_eq!(stored(&db, caller).await, ((0, 1000 - PRICE), (0, 0)));
    let calls = db.calls(&key).await;
    assert_eq!(calls.len(), 1);
    assert_eq!(calls[0].status, CallStatus::Ok);
    db.assert_audit_holds().await;
    // Its lease row goes once nothing refers to it.
    assert_eq!(
        db.store.forget_ended_leases(later(1) + ttl).await.unwrap(),
        1
    );
}

#[tokio::test]
async fn a_key_revoked_elsewhere_is_refused_at_once_by_an_escrow_instance() {
    let Some((db, _, instance, key, caller)) = one_instance(1000, 0).await else {
        return;
    };
    let first = reserve(&instance, caller).await.unwrap();
    assert!(settle(&instance, &first).await);
    // Revoked through another store (the admin API, the CLI), with credits still in escrow.
    revoke(&db, &key).await;
    assert!(matches!(
        reserve(&instance, caller).await,
        Err(ReserveError::KeyRevoked)
    ));
    instance.release_lease().await.unwrap();
    assert_eq!(stored(&db, caller).await, ((1000 - PRICE, 0), (0, 0)));
    db.assert_audit_holds().await;
}

#[tokio::test]
async fn subscription_credits_granted_later_are_spent_before_escrowed_topup() {
    let Some((db, _, instance, key, caller)) = one_instance(0, 1000).await else {
        return;
    };
    let topup = reserve(&instance, caller).await.unwrap();
    assert_eq!(topup.taken.topup, Credits::new(PRICE));
    assert!(settle(&instance, &topup).await);
    assert!(
        stored(&db, caller).await.1.1 > 0,
        "top-up credits in escrow"
    );
    grant(&db, &key, Bucket::Subscription, 10).await;
    let subscription = reserve(&instance, caller).await.unwrap();
    assert_eq!(subscription.taken.subscription, Credits::new(PRICE));
    assert!(settle(&instance, &subscription).await);
    assert_eq!(db.balance(&key).await, balance(10 - PRICE, 1000 - PRICE));
    db.assert_audit_holds().await;
    instance.release_lease().await.unwrap();
    assert_eq!(
        stored(&db, caller).await,
        ((10 - PRICE, 1000 - PRICE), (0, 0))
    );
}

#[tokio::test]
async fn a_lapse_takes_escrowed_subscription_credits_and_a_call_held_on_them_is_not_billed() {
    let Some((db, now, instance, key, caller)) = one_instance(0, 0).await else {
        return;
    };
    let period_end = grant_period(&db, caller, now, 1000).await;
    let billed = reserve(&instance, caller).await.unwrap();
    assert!(settle(&instance, &billed).await);
    let held = reserve(&instance, caller).await.unwrap();
    assert!(
        stored(&db, caller).await.1.0 > 0,
        "subscription credits in escrow"
    );

    // The period ends while a call is held: everything left lapses, escrow included.
    let lapses = db
        .store
        .lapse_ended_subscriptions(period_end + chrono::Duration::seconds(1))
        .await
        .unwrap();
    assert_eq!(lapses.len(), 1);
    assert_eq!(lapses[0].amount, Credits::new(1000 - PRICE));
    assert_eq!(stored(&db, caller).await, ((0, 0), (0, 0)));
    // The held call's credits are gone: it ends refunded, unbilled.
    assert!(!settle(&instance, &held).await);
    assert_eq!(
        db.store.call_status(held.call).await.unwrap(),
        Some(CallStatus::Refunded)
    );
    assert_eq!(db.balance(&key).await, balance(0, 0));
    db.assert_audit_holds().await;
}

#[tokio::test]
async fn one_batch_ending_a_call_on_lapsed_escrow_and_one_on_whole_escrow_bills_only_the_second() {
    let Some((db, now, instance, lapsing_key, lapsing)) = one_instance(0, 0).await else {
        return;
    };
    let period_end = grant_period(&db, lapsing, now, 1000).await;
    let (whole_key, whole) = funded(&db, 1000, 0).await;
    let on_lapsing = reserve(&instance, lapsing).await.unwrap();
    let on_whole = reserve(&instance, whole).await.unwrap();
    let whole_escrow = stored(&db, whole).await.1;
    assert!(whole_escrow.0 >= PRICE, "{whole_escrow:?}");

    // Another process lapses the first account's period while both calls are held.
    db.store
        .lapse_ended_subscriptions(period_end + chrono::Duration::seconds(1))
        .await
        .unwrap();
    // Both end in one batch (the test's runtime has one thread: both are queued before the
    // writer runs): the lapsed escrow row is short of its debit, the other is not.
    let (lapsed_billed, whole_billed) =
        tokio::join!(settle(&instance, &on_lapsing), settle(&instance, &on_whole));
    assert!(!lapsed_billed);
    assert!(whole_billed);
    assert_eq!(
        db.store.call_status(on_lapsing.call).await.unwrap(),
        Some(CallStatus::Refunded)
    );
    assert_eq!(
        db.store.call_status(on_whole.call).await.unwrap(),
        Some(CallStatus::Ok)
    );
    // Each escrow row moved exactly as its calls ended: the whole one debited once.
    assert_eq!(stored(&db, lapsing).await, ((0, 0), (0, 0)));
    assert_eq!(
        stored(&db, whole).await.1,
        (whole_escrow.0 - PRICE, whole_escrow.1)
    );
    assert_eq!(db.balance(&lapsing_key).await, balance(0, 0));
    assert_eq!(db.balance(&whole_key).await, balance(1000 - PRICE, 0));
    assert_eq!(count(&db.calls(&whole_key).await, CallStatus::Ok), 1);
    db.assert_audit_holds().await;
}

#[tokio::test]
async fn a_lapse_run_by_the_instance_holding_a_call_leaves_the_call_its_credits() {
    let Some((db, now, instance, key, caller)) = one_instance(0, 0).await else {
        return;
    };
    let period_end = grant_period(&db, caller, now, 1000).await;
    let held = reserve(&instance, caller).await.unwrap();

    // The instance itself lapses the period: what its held call takes stays in its escrow.
    let lapses = instance
        .lapse_ended_subscriptions(period_end + chrono::Duration::seconds(1))
        .await
        .unwrap();
    assert_eq!(lapses.len(), 1);
    assert_eq!(lapses[0].amount, Credits::new(1000 - PRICE));
    assert_eq!(stored(&db, caller).await, ((0, 0), (PRICE, 0)));
    // The call was made within the period: it is billed from it.
    assert!(settle(&instance, &held).await);
    assert_eq!(
        db.store.call_status(held.call).await.unwrap(),
        Some(CallStatus::Ok)
    );
    assert_eq!(stored(&db, caller).await, ((0, 0), (0, 0)));
    assert_eq!(db.balance(&key).await, balance(0, 0));
    db.assert_audit_holds().await;
}

#[tokio::test]
async fn subscription_credits_all_in_escrow_lapse_when_their_period_ends() {
    let Some((db, now, instance, key, caller)) = one_instance(0, 10_000).await else {
        return;
    };
    let period_end = grant_period(&db, caller, now, 100).await;
    let billed = reserve(&instance, caller).await.unwrap();
    assert!(settle(&instance, &billed).await);
    // The slice took every subscription credit: the row has none left.
    let ((row_subscription, _), (escrowed_subscription, _)) = stored(&db, caller).await;
    assert_eq!((row_subscription, escrowed_subscription), (0, 100 - PRICE));

    let lapses = db
        .store
        .lapse_ended_subscriptions(period_end + chrono::Duration::seconds(1))
        .await
        .unwrap();
    assert_eq!(lapses.len(), 1);
    assert_eq!(lapses[0].amount, Credits::new(100 - PRICE));
    assert_eq!(stored(&db, caller).await.1.0, 0);
    assert_eq!(db.balance(&key).await, balance(0, 10_000));
    db.assert_audit_holds().await;
}

#[tokio::test]
async fn a_hot_accounts_slices_grow_and_never_pass_an_eighth_of_its_credits() {
    let Some((db, _, instance, rich_key, rich)) = one_instance(0, 1_000_000).await else {
        return;
    };
    // 16 clients, 25 calls each: each refill comes within 250 ms of the last one even on a
    // loaded machine. The escrow row is sampled meanwhile.
    let clients = billing_clients(&instance, rich, 16, 25);
    let mut most_escrowed = 0;
    while !clients.iter().all(tokio::task::JoinHandle::is_finished) {
        most_escrowed = most_escrowed.max(stored(&db, rich).await.1.1);
    }
    for client in clients {
        client.await.unwrap();
    }
    // A 64-call slice, and what the 16 clients' calls in flight hold, make at most 80 calls.
    assert!(
        most_escrowed > (64 + 16) * PRICE,
        "at most {most_escrowed} credits in escrow: the slice never grew past 64 calls"
    );
    assert!(most_escrowed < 1024 * PRICE, "{most_escrowed}");
    assert_eq!(
        db.balance(&rich_key).await,
        balance(0, 1_000_000 - 400 * PRICE)
    );

    // An account with 300 calls' worth: its slice is an eighth of that, not 64 calls.
    let (_, modest) = funded(&db, 0, 300 * PRICE).await;
    let reservation = reserve(&instance, modest).await.unwrap();
    assert!(settle(&instance, &reservation).await);
    assert_eq!(stored(&db, modest).await.1.1, 300 * PRICE / 8 - PRICE);
    db.assert_audit_holds().await;
}

#[tokio::test]
async fn two_escrow_instances_never_overdraw_an_account() {
    let Some(db) = postgres_db().await else {
        return;
    };
    const CREDITS: i64 = 1214;
    let now = Utc::now();
    let instances = [
        escrow_instance(&db, now).await,
        escrow_instance(&db, now).await,
    ];
    let (key, caller) = funded(&db, 14, CREDITS - 14).await;
    // 40 clients, 20 calls each, half through each instance: 800 calls on 607 calls' worth.
    let billed = charge_from_both(&instances, caller, 40, 20).await;
    assert!(
        billed * PRICE <= CREDITS,
        "billed {billed} calls of {PRICE} on {CREDITS} credits"
    );
    assert_eq!(count(&db.calls(&key).await, CallStatus::Ok) as i64, billed);
    let left = CREDITS - billed * PRICE;
    assert_eq!(db.balance(&key).await.total(), Credits::new(left));
    db.assert_audit_holds().await;
    for instance in &instances {
        instance.release_lease().await.unwrap();
    }
    let ((subscription, topup), escrowed) = stored(&db, caller).await;
    assert_eq!(escrowed, (0, 0));
    assert_eq!(subscription + topup, left);
    // What was left unspent was in escrow when the other instance ran out: per instance, at
    // most what it took at its last refill (an eighth of what the account had then), and less
    // than a call's price in the row.
    assert!(
        left < 2 * (CREDITS / 8) + PRICE,
        "{left} credits left unspent"
    );
    db.assert_audit_holds().await;
}

#[tokio::test]
async fn an_account_running_low_is_charged_in_the_database_and_refused_only_when_it_cannot_pay() {
    let Some(db) = postgres_db().await else {
        return;
    };
    let now = Utc::now();
    let instances = [
        escrow_instance(&db, now).await,
        escrow_instance(&db, now).await,
    ];
    // 50 calls' worth: too little for escrow.
    let (_, caller) = funded(&db, 60, 40).await;
    let billed = charge_from_both(&instances, caller, 10, 6).await;
    assert_eq!(billed, 50, "every credit spent, none twice");
    assert_eq!(
        stored(&db, caller).await,
        ((0, 0), (0, 0)),
        "no escrow taken"
    );
    db.assert_audit_holds().await;
}

#[tokio::test]
async fn an_escrowed_calls_entry_records_what_its_call_was_and_how_it_ended() {
    let Some((db, _, instance, key, caller)) = one_instance(1000, 0).await else {
        return;
    };
    let request = |request_id| {
        ChargeRequest::new(
            caller,
            Protocol::Messages,
            "claude-3-5-haiku",
            Credits::new(PRICE),
        )
        .with_request_id(Some(request_id))
        .with_requested_model(Some("claude-3-5-haiku-20241022"))
    };
    let billed = instance.reserve(request("req-billed")).await.unwrap();
    let success = CallSuccess {
        upstream_status: 200,
        usage: model_gateway::store::TokenUsage {
            input_tokens: Some(3),
            output_tokens: Some(4),
            ..Default::default()
        },
        channel: Some("primary".into()),
        cost: None,
        reply: None,
        ..Default::default()
    };
    assert!(instance.settle(billed.call, success).await.unwrap());
    let failed = instance.reserve(request("req-failed")).await.unwrap();
    assert!(refund(&instance, &failed).await);

    let calls = db.calls(&key).await;
    let entry = |id| calls.iter().find(|call| call.id == id).unwrap();
    let ok = entry(billed.call);
    assert_eq!(ok.status, CallStatus::Ok);
    assert_eq!(ok.protocol, Protocol::Messages);
    assert_eq!(ok.model, "claude-3-5-haiku");
    assert_eq!(
        ok.requested_model.as_deref(),
        Some("claude-3-5-haiku-20241022")
    );
    assert_eq!(ok.key, caller.key);
    assert_eq!(ok.charged_subscription, Credits::new(PRICE));
    assert_eq!(ok.upstream_status, Some(200));
    assert_eq!(ok.channel.as_deref(), Some("primary"));
    assert_eq!((ok.input_tokens, ok.output_tokens), (Some(3), Some(4)));
    assert_eq!(ok.request_id.as_deref(), Some("req-billed"));
    assert!(ok.finished_at.unwrap() >= ok.created_at);
    let refunded = entry(failed.call);
    assert_eq!(refunded.status, CallStatus::Refunded);
    assert_eq!(refunded.upstream_status, Some(500));
    assert_eq!(refunded.upstream_error.as_deref(), Some("test"));
    assert_eq!(refunded.channel, None);
    assert_eq!(refunded.request_id.as_deref(), Some("req-failed"));
    assert_eq!(
        refunded.requested_model.as_deref(),
        Some("claude-3-5-haiku-20241022")
    );
    assert_eq!(db.balance(&key).await, balance(1000 - PRICE, 0));
}

#[tokio::test]
async fn an_instance_whose_lease_has_ended_reserves_in_the_database() {
    let Some(db) = postgres_db().await else {
        return;
    };
    // Its lease ended before its first call (its database was out of reach, say).
    let instance = escrow_instance(
        &db,
        Utc::now() - chrono::Duration::from_std(TTL).unwrap() - chrono::Duration::seconds(60),
    )
    .await;
    let (_, caller) = funded(&db, 1000, 0).await;
    let reservation = reserve(&instance, caller).await.unwrap();
    assert_eq!(instance.held_reservations().await, 0);
    assert_eq!(
        db.store.call_status(reservation.call).await.unwrap(),
        Some(CallStatus::Pending),
        "reserved in the database"
    );
    assert!(settle(&instance, &reservation).await);
    assert_eq!(stored(&db, caller).await, ((1000 - PRICE, 0), (0, 0)));
    db.assert_audit_holds().await;
}

#[tokio::test]
async fn after_a_lapse_and_a_new_period_calls_are_billed_from_the_new_periods_credits() {
    let Some((db, now, instance, key, caller)) = one_instance(0, 0).await else {
        return;
    };
    let period_end = now + chrono::Duration::hours(1);
    let period = |end, amount| Grant {
        period_end: Some(end),
        ..Grant::plain(Bucket::Subscription, Credits::new(amount))
    };
    db.store
        .grant_once(caller.account, period(period_end, 1000))
        .await
        .unwrap();
    let first = reserve(&instance, caller).await.unwrap();
    assert!(settle(&instance, &first).await);
    assert!(
        stored(&db, caller).await.1.0 > 0,
        "subscription credits in escrow"
    );
    // The period ends with no call held, and a new one begins: the instance's escrow still
    // remembers the old period's credits, which the lapse took.
    db.store
        .lapse_ended_subscriptions(period_end + chrono::Duration::seconds(1))
        .await
        .unwrap();
    db.store
        .grant_once(
            caller.account,
            period(period_end + chrono::Duration::days(30), 500),
        )
        .await
        .unwrap();
    let next = reserve(&instance, caller).await.unwrap();
    assert_eq!(next.taken.subscription, Credits::new(PRICE));
    assert!(settle(&instance, &next).await, "billed from the new period");
    assert_eq!(db.balance(&key).await, balance(500 - PRICE, 0));
    db.assert_audit_holds().await;
}

/// A renewal granted by another instance to the same period end lapses what was left, this
/// instance's escrowed subscription credits too, and leaves the period as it was: the escrow
/// sees the lapse, and its next call is billed from the renewal, not held on the credits the
/// lapse took (it went unbilled before the escrow compared lapses, not period ends alone).
#[tokio::test]
async fn after_a_renewal_to_the_same_period_end_calls_are_billed_from_the_renewal() {
    let Some((db, now, instance, key, caller)) = one_instance(0, 0).await else {
        return;
    };
    let period_end = grant_period(&db, caller, now, 1000).await;
    let first = reserve(&instance, caller).await.unwrap();
    assert!(settle(&instance, &first).await);
    assert!(
        stored(&db, caller).await.1.0 > 0,
        "subscription credits in escrow"
    );
    let renewal = Grant {
        period_end: Some(period_end),
        ..Grant::plain(Bucket::Subscription, Credits::new(500))
    };
    let granted = db.store.grant_once(caller.account, renewal).await.unwrap();
    assert_eq!(granted.lapsed, Credits::new(1000 - PRICE));
    assert_eq!(stored(&db, caller).await, ((500, 0), (0, 0)));
    for _ in 0..3 {
        let next = reserve(&instance, caller).await.unwrap();
        assert_eq!(next.taken.subscription, Credits::new(PRICE));
        assert!(settle(&instance, &next).await, "billed from the renewal");
    }
    assert_eq!(db.balance(&key).await, balance(500 - 3 * PRICE, 0));
    assert_eq!(count(&db.calls(&key).await, CallStatus::Ok), 4);
    db.assert_audit_holds().await;
}

#[tokio::test]
async fn calls_held_while_a_keyed_call_gives_the_escrow_back_are_all_billed() {
    let Some((db, _, instance, key, caller)) = one_instance(20_000, 0).await else {
        return;
    };
    // 16 clients of unkeyed calls on the escrow, and beside them keyed calls, each of which
    // first gives back the subscription credits the escrow has free.
    let unkeyed = billing_clients(&instance, caller, 16, 40);
    let mut billed = 0;
    for nth in 0..30 {
        let reservation = reserve_keyed(&instance, caller, nth).await.unwrap();
        billed += i64::from(settle(&instance, &reservation).await);
    }
    assert_eq!(billed, 30, "every keyed call billed");
    for client in unkeyed {
        client.await.unwrap();
    }
    let calls = db.calls(&key).await;
    assert_eq!(count(&calls, CallStatus::Ok), 16 * 40 + 30);
    assert_eq!(
        db.balance(&key).await,
        balance(20_000 - (16 * 40 + 30) * PRICE, 0)
    );
    db.assert_audit_holds().await;
}

#[tokio::test]
async fn an_idle_accounts_escrow_comes_back_for_other_instances_to_spend() {
    let Some(db) = postgres_db().await else {
        return;
    };
    const IDLE: Duration = Duration::from_secs(1);
    const SLICED: ((i64, i64), (i64, i64)) = ((0, 875), (0, 123));
    const GIVEN_BACK: ((i64, i64), (i64, i64)) = ((0, 998), (0, 0));
    let now = Utc::now();
    let first = escrow_instance_idle_after(&db, now, IDLE).await;
    let second = escrow_instance(&db, now).await;
    // 500 calls' worth: the first instance's one call takes a slice of an eighth of it.
    let (key, caller) = funded(&db, 0, 1000).await;
    let (_, hot) = funded(&db, 0, 1000).await;
    let before_the_call = std::time::Instant::now();
    let reservation = reserve(&first, caller).await.unwrap();
    assert!(settle(&first, &reservation).await);
    let after_the_call = stored(&db, caller).await;
    // The idle look cannot give the slice back sooner than IDLE after the call was held; a
    // machine stalled longer than that (a loaded CI runner) may already see it given back.
    if before_the_call.elapsed() < IDLE {
        assert_eq!(after_the_call, SLICED, "the call took a slice into escrow");
    } else {
        assert!(
            [SLICED, GIVEN_BACK].contains(&after_the_call),
            "{after_the_call:?}"
        );
    }
    // Another account is charged on the first instance all along: its escrow stays.
    let charging = {
        let first = first.clone();
        tokio::spawn(async move {
            loop {
                let reservation = reserve(&first, hot).await.unwrap();
                assert!(settle(&first, &reservation).await);
                tokio::time::sleep(Duration::from_millis(40)).await;
            }
        })
    };
    let deadline = std::time::Instant::now() + 20 * IDLE;
    while stored(&db, caller).await != GIVEN_BACK {
        assert!(
            std::time::Instant::now() < deadline,
            "the idle escrow never came back: {:?}",
            stored(&db, caller).await
        );
        tokio::time::sleep(IDLE / 4).await;
    }
    // Not given back and taken again: its row is as its first slice left it.
    assert_eq!(
        stored(&db, hot).await.0,
        (0, 875),
        "the escrow of an account charged meanwhile stays"
    );
    charging.abort();
    // The second instance can spend every credit left.
    let mut billed = 0;
    while let Ok(reservation) = reserve(&second, caller).await {
        billed += i64::from(settle(&second, &reservation).await);
    }
    assert_eq!(billed, 499);
    assert_left_after_release(&db, &key, caller, &[&first, &second], 0).await;
}

/// Writes what a batch settling `lost` from its escrow row (top-up credits) writes, as if it
/// committed but its reply never came back: its entry, and the row's debit.
async fn commit_unanswered(db: &TestDb, caller: Caller, lost: &Reservation) {
    let (account, call, key_id) = (caller.account.0, lost.call.0, caller.key.0);
    db.store
        .connection()
        .execute_unprepared(&format!(
            "INSERT INTO mg_calls (id, account_id, key_id, protocol, model, price, \
             charged_subscription, charged_topup, status, upstream_status, created_at, \
             finished_at, instance_id) SELECT {call}, {account}, {key_id}, 'chat_completions', \
             'gpt-4o-mini', {PRICE}, 0, {PRICE}, 'ok', 200, now(), now(), instance_id \
             FROM mg_escrows WHERE account_id = {account}; \
             UPDATE mg_escrows SET topup_credits = topup_credits - {PRICE} \
             WHERE account_id = {account}"
        ))
        .await
        .unwrap();
}

/// An escrow instance, an account of 500 calls' worth (its key, who calls), and two calls held
/// on it: `lost`, which a batch settled and committed without its reply coming back (see
/// [`commit_unanswered`]), and one beside it.
async fn a_batch_committed_unanswered(
    db: &TestDb,
) -> (Arc<SeaOrmStore>, String, Caller, Reservation, Reservation) {
    let instance = escrow_instance(db, Utc::now()).await;
    let (key, caller) = funded(db, 0, 1000).await;
    let lost = reserve(&instance, caller).await.unwrap();
    let beside = reserve(&instance, caller).await.unwrap();
    commit_unanswered(db, caller, &lost).await;
    (instance, key, caller, lost, beside)
}

/// The account has `left` top-up credits, the instances give its escrow back on release, and
/// the audit holds before and after.
async fn assert_left_after_release(
    db: &TestDb,
    key: &str,
    caller: Caller,
    instances: &[&SeaOrmStore],
    left: i64,
) {
    assert_eq!(db.balance(key).await, balance(0, left));
    db.assert_audit_holds().await;
    for instance in instances {
        instance.release_lease().await.unwrap();
    }
    assert_eq!(stored(db, caller).await, ((0, left), (0, 0)));
    db.assert_audit_holds().await;
}

#[tokio::test]
async fn a_settle_retried_after_its_batch_committed_unanswered_is_billed_once() {
    let Some(db) = postgres_db().await else {
        return;
    };
    // A batch settled `lost` and committed, but its reply never came back (the connection
    // dropped); the caller retries.
    let (instance, key, caller, lost, beside) = a_batch_committed_unanswered(&db).await;
    let refunded = reserve(&instance, caller).await.unwrap();
    // The retry, and a call ending beside it in the same batch.
    let (retried, other) = tokio::join!(
        instance.settle(lost.call, CallSuccess::default()),
        instance.settle(beside.call, CallSuccess::default())
    );
    assert!(retried.unwrap(), "the retried settle finds its call billed");
    assert!(other.unwrap(), "the call beside it is billed");
    assert!(refund(&instance, &refunded).await);
    assert_eq!(instance.held_reservations().await, 0);
    // The instance knows what its escrow has left: spending past it refills, and no call is
    // held on credits the escrow no longer has.
    for _ in 0..70 {
        let reservation = reserve(&instance, caller).await.unwrap();
        assert!(settle(&instance, &reservation).await);
    }
    let billed = 72;
    let calls = db.calls(&key).await;
    assert_eq!(count(&calls, CallStatus::Ok), billed);
    assert_eq!(count(&calls, CallStatus::Refunded), 1);
    let left = 1000 - billed as i64 * PRICE;
    assert_left_after_release(&db, &key, caller, &[&instance], left).await;
}

#[tokio::test]
async fn calls_held_after_a_batch_committed_unanswered_and_unreadable_are_billed_once() {
    let Some(db) = postgres_db().await else {
        return;
    };
    // 500 calls' worth; the escrow row holds 62 of them after the first call. A batch settling
    // `lost` and the call beside it committed `lost`'s debit but its reply was lost, and the
    // entries it wrote cannot be read back either (the call log's `status` is out of reach):
    // both settles fail, and the instance cannot tell what its escrow row holds.
    let (instance, key, caller, lost, beside) = a_batch_committed_unanswered(&db).await;
    let calls_log =
        |from: &str, to: &str| format!("ALTER TABLE mg_calls RENAME COLUMN {from} TO {to}");
    let connection = db.store.connection();
    connection
        .execute_unprepared(&calls_log("status", "status_out_of_reach"))
        .await
        .unwrap();
    let (first, second) = tokio::join!(
        instance.settle(lost.call, CallSuccess::default()),
        instance.settle(beside.call, CallSuccess::default())
    );
    connection
        .execute_unprepared(&calls_log("status_out_of_reach", "status"))
        .await
        .unwrap();
    assert!(first.is_err() && second.is_err(), "{first:?} {second:?}");
    // Meanwhile the instance takes 150 calls, past at least one refill of its row (each slice
    // holds at most an eighth of what is left, 62 calls' worth at first): none is held on
    // the debit it did not see, so each is billed.
    for nth in 0..150 {
        let reservation = reserve(&instance, caller).await.unwrap();
        assert!(settle(&instance, &reservation).await, "call {nth} billed");
    }
    // The callers retry: `lost` finds its entry, `beside` is written now. Then every credit
    // left is spent.
    assert!(
        settle(&instance, &lost).await,
        "the lost batch's call is billed"
    );
    assert!(
        settle(&instance, &beside).await,
        "the call beside it is billed"
    );
    let mut billed = 152;
    while let Ok(reservation) = reserve(&instance, caller).await {
        assert!(
            settle(&instance, &reservation).await,
            "call {billed} billed"
        );
        billed += 1;
    }
    assert_eq!(billed, 500);
    assert_eq!(instance.held_reservations().await, 0);
    let calls = db.calls(&key).await;
    assert_eq!(count(&calls, CallStatus::Ok), 500);
    assert_left_after_release(&db, &key, caller, &[&instance], 0).await;
}

#[tokio::test]
async fn escrow_given_back_idle_between_calls_loses_and_bills_no_credit() {
    let Some(db) = postgres_db().await else {
        return;
    };
    // Idle escrow is looked for every 10 ms, and clients pause up to 15 ms between calls: pots
    // are given back while calls arrive on them, on both instances, until the account runs out.
    const IDLE: Duration = Duration::from_millis(10);
    const CREDITS: i64 = 3000;
    let now = Utc::now();
    let instances = [
        escrow_instance_idle_after(&db, now, IDLE).await,
        escrow_instance_idle_after(&db, now, IDLE).await,
    ];
    let (key, caller) = funded(&db, 2200, CREDITS - 2200).await;
    let clients: Vec<_> = (0..12u64)
        .map(|client| {
            let instance = instances[client as usize % 2].clone();
            tokio::spawn(async move {
                let (mut billed, mut refunded) = (0, 0);
                for nth in 0..160u64 {
                    match reserve(&instance, caller).await {
                        Ok(reservation) if nth % 5 == 4 => {
                            assert!(refund(&instance, &reservation).await, "refund {nth}");
                            refunded += 1;
                        }
                        Ok(reservation) => {
                            assert!(settle(&instance, &reservation).await, "settle {nth}");
                            billed += 1;
                        }
                        Err(ReserveError::InsufficientCredits) => {}
                        Err(error) => panic!("{error}"),
                    }
                    let pause = (client * 7 + nth * 3) % 16;
                    tokio::time::sleep(Duration::from_millis(pause)).await;
                }
                (billed, refunded)
            })
        })
        .collect();
    let (mut billed, mut refunded) = (0, 0);
    for client in clients {
        let (b, r) = client.await.unwrap();
        billed += b;
        refunded += r;
    }
    assert!(
        billed * PRICE <= CREDITS,
        "billed {billed} calls on {CREDITS} credits"
    );
    db.assert_audit_holds().await;
    // Both instances idle: every escrow comes back, and what is left can all be spent.
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    while stored(&db, caller).await.1 != (0, 0) {
        assert!(
            std::time::Instant::now() < deadline,
            "idle escrow never came back: {:?}",
            stored(&db, caller).await
        );
        tokio::time::sleep(IDLE).await;
    }
    while let Ok(reservation) = reserve(&instances[0], caller).await {
        assert!(settle(&instances[0], &reservation).await);
        billed += 1;
    }
    assert_eq!(billed * PRICE, CREDITS, "every credit spent, none twice");
    let calls = db.calls(&key).await;
    assert_eq!(count(&calls, CallStatus::Ok) as i64, billed);
    assert_eq!(count(&calls, CallStatus::Refunded) as i64, refunded);
    assert_left_after_release(&db, &key, caller, &[&instances[0], &instances[1]], 0).await;
}

/// Calls through `instance`, one at a time, each settled, until one is refused for credits;
/// returns how many were billed.
async fn spend_until_refused(instance: &SeaOrmStore, caller: Caller, keyed: bool) -> usize {
    let mut billed = 0;
    loop {
        let reserved = if keyed {
            reserve_keyed(instance, caller, billed).await
        } else {
            reserve(instance, caller).await
        };
        match reserved {
            Ok(reservation) => {
                assert!(settle(instance, &reservation).await);
                billed += 1;
            }
            Err(ReserveError::InsufficientCredits) => return billed,
            Err(error) => panic!("{error}"),
        }
    }
}

/// Two escrow instances that give back no idle escrow (only a recall can bring it), and an
/// account of 500 calls' worth of which the first instance has billed one and holds one
/// throughout, on a slice of an eighth of the account: its key, who calls, the held call and
/// the two instances.
async fn escrow_held_by_the_first_of_two(
    db: &TestDb,
) -> (String, Caller, Reservation, [Arc<SeaOrmStore>; 2]) {
    const NEVER: Duration = Duration::from_secs(3600);
    let now = Utc::now();
    let first = escrow_instance_idle_after(db, now, NEVER).await;
    let second = escrow_instance_idle_after(db, now, NEVER).await;
    let (key, caller) = funded(db, 0, 1000).await;
    let reservation = reserve(&first, caller).await.unwrap();
    assert!(settle(&first, &reservation).await);
    let held = reserve(&first, caller).await.unwrap();
    assert_eq!(stored(db, caller).await, ((0, 875), (0, 123)));
    (key, caller, held, [first, second])
}

/// The second instance has spent every credit but the held call's: the held call is billed,
/// nothing is left, the audit holds, and the escrow comes back on release.
async fn assert_all_spent_but_the_held_call(
    db: &TestDb,
    key: &str,
    caller: Caller,
    held: &Reservation,
    instances: &[Arc<SeaOrmStore>; 2],
) {
    assert_eq!(
        stored(db, caller).await,
        ((0, 0), (0, 2)),
        "the held call's credits stay in the first instance's escrow"
    );
    assert!(settle(&instances[0], held).await, "the held call is billed");
    let calls = db.calls(key).await;
    assert_eq!(count(&calls, CallStatus::Ok), 500);
    assert_left_after_release(db, key, caller, &[&instances[0], &instances[1]], 0).await;
}

/// The second instance spends the row, then what the first gives back when recalled (with
/// keyed calls or not): every credit but the held call's.
async fn assert_a_call_refused_recalls_what_another_instance_holds(keyed: bool) {
    let Some(db) = postgres_db().await else {
        return;
    };
    let (key, caller, held, instances) = escrow_held_by_the_first_of_two(&db).await;
    let billed = spend_until_refused(&instances[1], caller, keyed).await;
    assert_eq!(
        billed, 498,
        "every credit not held spent through the second instance (keyed calls: {keyed})"
    );
    assert_all_spent_but_the_held_call(&db, &key, caller, &held, &instances).await;
}

#[tokio::test]
async fn a_call_refused_for_credits_another_instance_holds_recalls_them() {
    assert_a_call_refused_recalls_what_another_instance_holds(false).await;
}

#[tokio::test]
async fn a_keyed_call_refused_for_credits_another_instance_holds_recalls_them() {
    assert_a_call_refused_recalls_what_another_instance_holds(true).await;
}

/// The process ids of the connections on which this test's instances listen for recalls,
/// once there are `count` of them that are not among `old` (waits up to 10 s).
async fn recall_listeners(db: &TestDb, count: usize, old: &[i32]) -> Vec<i32> {
    let sql = format!(
        "SELECT pid FROM pg_stat_activity WHERE application_name = '{}' \
         AND query LIKE 'LISTEN%'",
        db.pg_schema().unwrap()
    );
    for _ in 0..200 {
        let rows = db
            .store
            .connection()
            .query_all_raw(sea_orm::Statement::from_string(
                sea_orm::DbBackend::Postgres,
                sql.clone(),
            ))
            .await
            .unwrap();
        let pids: Vec<i32> = rows
            .iter()
            .map(|row| row.try_get_by_index::<i32>(0).unwrap())
            .filter(|pid| !old.contains(pid))
            .collect();
        if pids.len() == count {
            return pids;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    panic!("{count} new recall listeners did not appear");
}

#[tokio::test]
async fn an_instance_whose_listening_connection_was_cut_listens_again_and_answers_recalls() {
    let Some(db) = postgres_db().await else {
        return;
    };
    let (key, caller, held, instances) = escrow_held_by_the_first_of_two(&db).await;
    // Both instances' listening connections are ended by the server, as a restart of it or a
    // network fault would end them.
    let listening = recall_listeners(&db, 2, &[]).await;
    for pid in &listening {
        db.store
            .connection()
            .execute_unprepared(&format!("SELECT pg_terminate_backend({pid})"))
            .await
            .unwrap();
    }
    recall_listeners(&db, 2, &listening).await;
    let billed = spend_until_refused(&instances[1], caller, false).await;
    assert_eq!(billed, 498, "the first instance answered the recall");
    assert_all_spent_but_the_held_call(&db, &key, caller, &held, &instances).await;
}

#[tokio::test]
async fn a_call_refused_for_credits_a_crashed_instance_holds_gets_them_back_at_once() {
    let Some(db) = postgres_db().await else {
        return;
    };
    for keyed in [false, true] {
        let crashed = escrow_instance(&db, Utc::now()).await;
        let (key, caller) = funded(&db, 0, 1000).await;
        let reservation = reserve(&crashed, caller).await.unwrap();
        assert!(settle(&crashed, &reservation).await);
        assert_eq!(stored(&db, caller).await, ((0, 875), (0, 123)));
        // The instance dies (no release), and its lease runs out before recovery's next round.
        drop(crashed);
        db.store
            .connection()
            .execute_unprepared("UPDATE mg_instances SET expires_at = now() - interval '1 second'")
            .await
            .unwrap();
        // Calls through another instance spend the row; the one refused then brings back the
        // dead lease's escrow, and the calls after it spend that too.
        let instance = escrow_instance(&db, Utc::now()).await;
        let billed = spend_until_refused(&instance, caller, keyed).await;
        assert_eq!(billed, 499, "keyed: {keyed}");
        instance.release_lease().await.unwrap();
        assert_eq!(stored(&db, caller).await, ((0, 0), (0, 0)));
        let calls = db.calls(&key).await;
        assert_eq!(count(&calls, CallStatus::Ok), 500);
    }
    db.assert_audit_holds().await;
}

/// An escrow instance unreachable for longer than its lease, then back: its own recovery
/// leaves the escrow its calls under way are held against (the adversarial run's finding 8,
/// under escrow: the lost lease's escrow went back at once, and its calls ended unbilled).
/// They are billed from it when they end, and the row goes back once it sits idle.
#[tokio::test]
async fn an_instance_back_from_an_outage_longer_than_its_lease_bills_its_own_calls() {
    let Some(db) = postgres_db().await else {
        return;
    };
    let now = Utc::now();
    let instance = escrow_instance_idle_after(&db, now, Duration::from_millis(50)).await;
    let (key, caller) = funded(&db, 0, 1000).await;
    let serving = reserve(&instance, caller).await.unwrap();
    assert_eq!(instance.held_reservations().await, 1);
    // The database was out of reach past the lease: the renewal finds it ended.
    let ended = now + chrono::Duration::from_std(TTL).unwrap() + chrono::Duration::seconds(1);
    assert!(!instance.renew_lease(ended, TTL).await.unwrap());
    instance.take_lease(Utc::now(), TTL).await.unwrap().unwrap();

    // Its own recovery, as its upkeep runs it when the database is back, and a call refused
    // for credits (which gives back ended leases' escrow): its own row stays.
    assert!(
        instance
            .orphaned_reservations(ended, 100)
            .await
            .unwrap()
            .is_empty()
    );
    assert!(
        stored(&db, caller).await.1.1 > 0,
        "its escrow was given back"
    );

    assert!(settle(&instance, &serving).await, "its own call unbilled");
    let calls = db.calls(&key).await;
    assert_eq!(calls.len(), 1);
    assert_eq!(calls[0].status, CallStatus::Ok);
    // Idle, the row goes back.
    let started = std::time::Instant::now();
    while stored(&db, caller).await.1 != (0, 0) {
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "never given back"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(stored(&db, caller).await, ((0, 1000 - PRICE), (0, 0)));
    db.assert_audit_holds().await;
}

/// A settle its caller gave up on before the writer of endings claimed it (see `SettleClaim`)
/// is not written: the call stays held until its caller's refund ends it, unbilled; one the
/// writer claimed first is billed, whatever its caller does after.
#[tokio::test]
async fn a_settle_given_up_before_the_writer_claims_it_is_refunded_whole() {
    let Some((db, _now, instance, key, caller)) = one_instance(0, 1000).await else {
        return;
    };
    let abandoned = reserve(&instance, caller).await.unwrap();
    let success = CallSuccess::default();
    assert!(success.claim.abandon());
    assert!(!instance.settle(abandoned.call, success).await.unwrap());
    assert_eq!(instance.held_reservations().await, 1, "still held");
    assert!(refund(&instance, &abandoned).await);

    let claimed = reserve(&instance, caller).await.unwrap();
    let success = CallSuccess::default();
    assert!(
        instance
            .settle(claimed.call, success.clone())
            .await
            .unwrap()
    );
    assert!(!success.claim.abandon(), "billed: the writer claimed it");

    let calls = db.calls(&key).await;
    assert_eq!(count(&calls, CallStatus::Refunded), 1, "{calls:?}");
    assert_eq!(count(&calls, CallStatus::Ok), 1, "{calls:?}");
    instance.release_lease().await.unwrap();
    assert_eq!(stored(&db, caller).await, ((0, 1000 - PRICE), (0, 0)));
    db.assert_audit_holds().await;
}
