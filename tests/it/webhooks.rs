//! Signed webhook events: written to the outbox with what caused them (a redemption, a lapse)
//! or beside it (an upstream's breaker), delivered to a real HTTP receiver that checks every
//! signature; a receiver that is down for a while then gets every event, each id accepted once;
//! an operator retries a delivery by hand through the admin API.

use crate::common;

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::body::Bytes;
use axum::http::{HeaderMap, StatusCode};
use chrono::Utc;
use common::fake_provider::{FakeProvider, Fault};
use common::*;
use model_gateway::admin::{AdminToken, NewCodes};
use model_gateway::codes::CodeHash;
use model_gateway::events::{SIGNATURE_HEADER, verify};
use model_gateway::store::{DeliveryStatus, EventOutbox, Grant, RedemptionCodes};
use model_gateway::webhooks::WebhookDispatcher;
use model_gateway::{Accounts, Credits, Gateway, Ledger, SeaOrmStore, credits::Bucket};
use serde_json::Value;

const SECRET: &str = "whsec_test_secret";
const TOKEN: &str = "admin-token-for-tests-0123456789";

/// A webhook receiver over real HTTP: it answers `503` to the first `down_for` requests, then
/// `200`, and keeps every request it accepted with whether its signature held.
#[derive(Clone, Default)]
pub struct Receiver {
    state: Arc<Mutex<ReceiverState>>,
}

#[derive(Default)]
struct ReceiverState {
    down_for: usize,
    /// How long it takes to answer.
    delay: Duration,
    seen: usize,
    /// Each accepted body, by event id, with whether its signature was good.
    accepted: Vec<(String, Value, bool)>,
}

impl Receiver {
    /// Serves on an ephemeral port; its URL.
    pub async fn start(&self, down_for: usize) -> String {
        self.state.lock().unwrap().down_for = down_for;
        let state = self.state.clone();
        let app = axum::Router::new().route(
            "/hooks",
            axum::routing::post(move |headers: HeaderMap, body: Bytes| {
                let state = state.clone();
                async move {
                    let delay = state.lock().unwrap().delay;
                    tokio::time::sleep(delay).await;
                    let mut state = state.lock().unwrap();
                    state.seen += 1;
                    if state.seen <= state.down_for {
                        return StatusCode::SERVICE_UNAVAILABLE;
                    }
                    let signature = headers
                        .get(SIGNATURE_HEADER)
                        .and_then(|value| value.to_str().ok())
                        .unwrap_or_default();
                    let good = verify(SECRET, signature, &body, Utc::now().timestamp(), 300);
                    let event: Value = serde_json::from_slice(&body).unwrap();
                    let id = event["id"].as_str().unwrap().to_owned();
                    state.accepted.push((id, event, good));
                    StatusCode::OK
                }
            }),
        );
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}/hooks", listener.local_addr().unwrap());
        tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
        url
    }

    /// Answers each request after `delay`.
    pub fn slow(&self, delay: Duration) {
        self.state.lock().unwrap().delay = delay;
    }

    pub fn accepted(&self) -> Vec<(String, Value, bool)> {
        self.state.lock().unwrap().accepted.clone()
    }

    fn requests(&self) -> usize {
        self.state.lock().unwrap().seen
    }
}

/// A second store on the test's database, writing webhook events.
async fn events_store(db: &TestDb) -> Arc<SeaOrmStore> {
    let store = match db.pg_schema() {
        Some(schema) => postgres_store(&db.url, schema).await,
        None => SeaOrmStore::connect(&db.url).await.unwrap(),
    };
    Arc::new(store.with_webhook_events())
}

async fn redeemed_codes(store: &Arc<SeaOrmStore>, count: u32) {
    let admin = model_gateway::admin::Admin::new(store.clone());
    let created = admin
        .create_codes(&NewCodes {
            count,
            credits: Credits::new(10),
            bucket: Bucket::Topup,
            period_days: None,
            expires_at: None,
            label: Some("hooks".into()),
        })
        .await
        .unwrap();
    let account = store.create_account("buyer").await.unwrap();
    for code in &created.codes {
        store
            .redeem_code(account, &CodeHash::of(code).unwrap(), Utc::now())
            .await
            .unwrap()
            .unwrap();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_receiver_down_for_a_while_then_gets_every_event_once_signed() {
    let db = local_db().await;
    let store = events_store(&db).await;
    // Three redemptions, and a subscription period that ends and lapses.
    redeemed_codes(&store, 3).await;
    let account = store.create_account("subscriber").await.unwrap();
    let grant = Grant {
        period_end: Some(Utc::now() - chrono::Duration::seconds(1)),
        at: Utc::now() - chrono::Duration::seconds(2),
        ..Grant::plain(Bucket::Subscription, Credits::new(7))
    };
    store.grant_once(account, grant).await.unwrap();
    let lapses = store.lapse_ended_subscriptions(Utc::now()).await.unwrap();
    assert_eq!(lapses.len(), 1);
    let written = store.deliveries(None, 100).await.unwrap();
    assert_eq!(written.len(), 4, "one event per redemption and per lapse");

    let receiver = Receiver::default();
    let url = receiver.start(5).await;
    let dispatcher = WebhookDispatcher::new(store.clone(), url, SECRET)
        .unwrap()
        .backoff(Duration::from_millis(40))
        .poll_every(Duration::from_millis(20));
    let running = dispatcher.spawn();
    wait_for("every event to be delivered", async || {
        store
            .deliveries(Some(DeliveryStatus::Delivered), 100)
            .await
            .unwrap()
            .len()
            == 4
    })
    .await;
    running.abort();
    let accepted = receiver.accepted();
    assert!(receiver.requests() >= 5 + 4, "the receiver was down first");
    assert!(
        accepted.iter().all(|(_, _, good)| *good),
        "a signature did not hold"
    );
    let mut by_id: HashMap<String, Vec<Value>> = HashMap::new();
    for (id, event, _) in accepted {
        by_id.entry(id).or_default().push(event);
    }
    let ids: std::collections::BTreeSet<_> = written.iter().map(|d| d.event_id.clone()).collect();
    assert_eq!(
        by_id
            .keys()
            .cloned()
            .collect::<std::collections::BTreeSet<_>>(),
        ids
    );
    for (id, copies) in &by_id {
        assert!(
            copies.windows(2).all(|pair| pair[0] == pair[1]),
            "{id} changed between copies"
        );
    }
    let kinds: Vec<_> = by_id
        .values()
        .map(|copies| copies[0]["type"].as_str().unwrap().to_owned())
        .collect();
    assert_eq!(
        kinds.iter().filter(|kind| *kind == "code.redeemed").count(),
        3
    );
    assert_eq!(
        kinds
            .iter()
            .filter(|kind| *kind == "subscription.lapsed")
            .count(),
        1
    );
    let lapsed = by_id
        .values()
        .map(|copies| &copies[0])
        .find(|event| event["type"] == "subscription.lapsed")
        .unwrap();
    assert_eq!(lapsed["data"]["credits"], 7);
    assert_eq!(lapsed["data"]["account"], account.0);
    let redeemed = by_id
        .values()
        .map(|copies| &copies[0])
        .find(|event| event["type"] == "code.redeemed")
        .unwrap();
    assert_eq!(redeemed["data"]["credits"], 10);
    assert_eq!(redeemed["data"]["bucket"], "topup");
    for delivery in store.deliveries(None, 100).await.unwrap() {
        assert_eq!(delivery.status, DeliveryStatus::Delivered);
        assert_eq!(delivery.last_status, Some(200));
    }
}

backends!(
    /// Two instances on one database and a receiver that takes most of an attempt's time-out
    /// to answer: each event is sent once (the adversarial run: 20 events, 35 requests, as an
    /// instance claimed 32 under one hold and the other took the rest again when it ran out).
    #[multi_thread]
    async fn two_instances_send_each_event_once_to_a_slow_receiver(db) {
        let (first, second) = (events_store(&db).await, events_store(&db).await);
        redeemed_codes(&first, 20).await;
        let receiver = Receiver::default();
        receiver.slow(Duration::from_millis(150));
        let url = receiver.start(0).await;
        let dispatcher = |store: &Arc<SeaOrmStore>| {
            WebhookDispatcher::new(store.clone(), url.clone(), SECRET)
                .unwrap()
                .timeout(Duration::from_millis(200))
                .poll_every(Duration::from_millis(10))
                .spawn()
        };
        let running = [dispatcher(&first), dispatcher(&second)];
        wait_for("every event to be delivered", async || {
            first
                .deliveries(Some(DeliveryStatus::Delivered), 100)
                .await
                .unwrap()
                .len()
                == 20
        })
        .await;
        // Long enough for a hold that ran out to be taken again.
        tokio::time::sleep(Duration::from_millis(1_500)).await;
        for task in running {
            task.abort();
        }
        let accepted = receiver.accepted();
        let ids: std::collections::BTreeSet<_> = accepted.iter().map(|(id, ..)| id).collect();
        assert_eq!((ids.len(), accepted.len(), receiver.requests()), (20, 20, 20));
    }
);

#[tokio::test]
async fn a_store_without_webhooks_records_no_events() {
    let db = local_db().await;
    redeemed_codes(&db.store, 1).await;
    assert!(db.store.deliveries(None, 10).await.unwrap().is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn breakers_opening_and_closing_are_events_and_an_operator_retries_a_delivery() {
    let db = local_db().await;
    let store = events_store(&db).await;
    let events_db = TestDb::sharing(&db, store.clone());
    let provider = FakeProvider::start().await;
    let catalogue = model_gateway::Catalogue::from_toml(&one_upstream_toml(
        "flaky",
        &provider.base,
        "FLAKY_KEY",
        "breaker_failures = 1\nbreaker_cooldown_secs = 1",
    ))
    .unwrap();
    let upstream = model_gateway::upstream::HttpUpstream::with_keys(&catalogue, |_| {
        Some("sk-provider".into())
    })
    .unwrap();
    let router = Gateway::new(
        store.clone(),
        Arc::new(catalogue),
        model_gateway::Upstream::Http(upstream),
    )
    .admin_token(Some(AdminToken::new(TOKEN).unwrap()))
    .router();
    let gateway = serve_router(router).await;
    let key = events_db.funded_key(100, 0).await;
    provider.then(Fault::json(500, r#"{"error":{"message":"down"}}"#));
    assert_eq!(gateway.chat(&key, CHAT_MODEL).await.status, 502);
    tokio::time::sleep(Duration::from_millis(1100)).await;
    provider.always(Fault::json(
        200,
        r#"{"id":"c","object":"chat.completion","model":"m","choices":[{"index":0,"message":{"role":"assistant","content":"Hi"},"finish_reason":"stop"}],"usage":{"prompt_tokens":1,"completion_tokens":1,"total_tokens":2}}"#,
    ));
    assert_eq!(gateway.chat(&key, CHAT_MODEL).await.status, 200);
    wait_for("both breaker events to be recorded", async || {
        store.deliveries(None, 10).await.unwrap().len() == 2
    })
    .await;
    let recorded = store.deliveries(None, 10).await.unwrap();
    let kinds: Vec<_> = recorded.iter().rev().map(|d| d.kind.as_str()).collect();
    assert_eq!(
        kinds,
        ["upstream.breaker_opened", "upstream.breaker_closed"]
    );
    let body: Value = serde_json::from_str(&recorded[0].body).unwrap();
    assert_eq!(body["data"]["upstream"], "flaky");

    // Delivered, then retried by hand: the same event, with the same id, once more.
    let receiver = Receiver::default();
    let url = receiver.start(0).await;
    let dispatcher = WebhookDispatcher::new(store.clone(), url, SECRET).unwrap();
    assert_eq!(dispatcher.deliver_due().await.unwrap(), 2);
    let listed = gateway
        .send(
            gateway
                .client
                .get(format!(
                    "{}/admin/webhooks/deliveries?status=delivered",
                    gateway.base
                ))
                .bearer_auth(TOKEN),
        )
        .await;
    assert_eq!(listed.status, 200, "{:?}", listed.body);
    let first = &listed.body["data"][0];
    assert_eq!(first["status"], "delivered");
    assert_eq!(first["attempts"], 1);
    let retried = gateway
        .send(
            gateway
                .client
                .post(format!(
                    "{}/admin/webhooks/deliveries/{}/retry",
                    gateway.base, first["id"]
                ))
                .bearer_auth(TOKEN),
        )
        .await;
    assert_eq!(retried.status, 200, "{:?}", retried.body);
    assert_eq!(retried.body["status"], "pending");
    assert_eq!(dispatcher.deliver_due().await.unwrap(), 1);
    let accepted = receiver.accepted();
    assert_eq!(accepted.len(), 3);
    assert_eq!(
        accepted
            .iter()
            .filter(|(id, _, _)| id == first["event_id"].as_str().unwrap())
            .count(),
        2
    );
    let missing = gateway
        .send(
            gateway
                .client
                .post(format!(
                    "{}/admin/webhooks/deliveries/999/retry",
                    gateway.base
                ))
                .bearer_auth(TOKEN),
        )
        .await;
    assert_eq!(missing.status, 404);
}

/// A settle that charges less than the call cost (its ceiling, by default) tells the operator:
/// a `call.shortfall` event with the cost, the charge and the difference, written in the
/// settle's transaction; a settle within its reservation tells nothing.
async fn assert_a_shortfall_is_told(store: Arc<SeaOrmStore>) {
    let account = store.create_account("metered").await.unwrap();
    let key = model_gateway::keys::NewApiKey::generate();
    let key = store.add_key(account, &key).await.unwrap();
    store
        .grant(account, Bucket::Topup, Credits::new(10_000))
        .await
        .unwrap();
    let caller = model_gateway::store::Caller { account, key };
    let settle = async |cost: i64| {
        let reserved = reserve_price(store.as_ref(), caller, 5).await.unwrap();
        let success = model_gateway::store::CallSuccess {
            upstream_status: 200,
            cost: Some(Credits::new(cost)),
            ..Default::default()
        };
        assert!(store.settle(reserved.call, success).await.unwrap());
        reserved.call
    };
    settle(3).await;
    let short = settle(50).await;
    let told: Vec<Value> = store
        .deliveries(None, 100)
        .await
        .unwrap()
        .into_iter()
        .filter(|delivery| delivery.kind == "call.shortfall")
        .map(|delivery| serde_json::from_str(&delivery.body).unwrap())
        .collect();
    assert_eq!(told.len(), 1, "{told:?}");
    let data = &told[0]["data"];
    assert_eq!(data["call"], short.0);
    assert_eq!(data["account"], account.0);
    assert_eq!(
        (&data["cost"], &data["charged"], &data["shortfall"]),
        (
            &serde_json::json!(50),
            &serde_json::json!(5),
            &serde_json::json!(45)
        )
    );
    assert_eq!(
        store.balance(account).await.unwrap().total(),
        Credits::new(10_000 - 3 - 5)
    );
}

backends!(
    async fn a_call_charged_less_than_it_cost_is_told_as_a_shortfall(db) {
        assert_a_shortfall_is_told(events_store(&db).await).await;
    }
);

/// The same for a call held in `PostgreSQL` escrow: its event is written in the one statement
/// that writes its entry and debits the escrow.
#[cfg(feature = "postgres")]
#[tokio::test]
async fn a_call_held_in_escrow_charged_less_than_it_cost_is_told_as_a_shortfall() {
    let Some(db) = postgres_db().await else {
        return;
    };
    let store = postgres_store(&db.url, db.pg_schema().unwrap())
        .await
        .with_webhook_events()
        .with_escrow()
        .unwrap();
    model_gateway::store::Leases::take_lease(&store, Utc::now(), Duration::from_secs(600))
        .await
        .unwrap()
        .unwrap();
    let store = Arc::new(store);
    assert_a_shortfall_is_told(store.clone()).await;
    assert_eq!(store.held_reservations().await, 0);
    db.assert_audit_holds().await;
    db.drop_schema().await;
}
