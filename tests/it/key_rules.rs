//! Per-key rules on real HTTP: allowed models (403), expiry (401), requests per minute (429),
//! each refusal uncharged and unlogged, each holding on a second gateway sharing the database;
//! rate limits shared through a Redis of the test's own, and the fallback when it stops.

use crate::common;

use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use common::*;
use model_gateway::admin::{Admin, KeyPatch};
use model_gateway::rate_limit::RateLimiter;
use model_gateway::{
    Catalogue, Gateway, KeyId, KeyStore, SeaOrmStore, Upstream, keys::KeyHash,
    upstream::MockUpstream,
};

/// A gateway in mock mode on `store`, counting rates with `limiter`.
async fn gateway_on(store: Arc<SeaOrmStore>, limiter: RateLimiter) -> common::Gateway {
    let router = Gateway::new(
        store,
        Arc::new(Catalogue::demo()),
        Upstream::Mock(MockUpstream::new()),
    )
    .rate_limiter(limiter)
    .router();
    serve_router(router).await
}

async fn key_id(db: &TestDb, key: &str) -> KeyId {
    db.store
        .caller_for_key(&KeyHash::of(key))
        .await
        .unwrap()
        .unwrap()
        .key
}

async fn set_rules(db: &TestDb, key: &str, patch: KeyPatch) {
    let id = key_id(db, key).await;
    Admin::new(db.store.clone())
        .update_key(id, &patch)
        .await
        .unwrap();
}

/// Waits, if need be, so that the next `seconds` fall inside one wall-clock minute: a rate
/// window must not end in the middle of a test.
async fn within_one_minute(seconds: u64) {
    let now = SystemTime::now().duration_since(UNIX_EPOCH).unwrap();
    let left = 60 - now.as_secs() % 60;
    if left <= seconds {
        tokio::time::sleep(Duration::from_secs(left) + Duration::from_millis(100)).await;
    }
}

#[tokio::test]
async fn a_key_limited_to_some_models_is_refused_the_others_with_403_uncharged() {
    let db = local_db().await;
    let gateway = start_mock_gateway(&db).await;
    let key = db.funded_key(100, 0).await;
    let only_chat = KeyPatch {
        models: Some(Some(vec![CHAT_MODEL.into()])),
        ..KeyPatch::default()
    };
    set_rules(&db, &key, only_chat).await;

    assert_eq!(gateway.chat(&key, CHAT_MODEL).await.status, 200);
    let refused = gateway.messages(&key, MESSAGES_MODEL).await;
    assert_eq!(
        (refused.status, refused.detail()),
        (403, "该 API Key 无权使用此模型")
    );
    // 404 comes first: an unknown model is unknown whatever the key.
    let unknown = gateway.chat(&key, "no-such-model").await;
    assert_eq!(unknown.status, 404);
    assert_eq!(db.balance(&key).await, balance(100 - CHAT_PRICE, 0));
    assert_eq!(db.calls(&key).await.len(), 1, "the refusal wrote no entry");

    // The key sees only its models.
    let models = gateway
        .send(
            gateway
                .client
                .get(format!("{}/v1/models", gateway.base))
                .bearer_auth(&key),
        )
        .await;
    let ids: Vec<_> = models.body["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|model| model["id"].as_str().unwrap())
        .collect();
    assert_eq!(ids, [CHAT_MODEL]);
    let hidden = gateway
        .send(
            gateway
                .client
                .get(format!("{}/v1/models/{MESSAGES_MODEL}", gateway.base))
                .bearer_auth(&key),
        )
        .await;
    assert_eq!(hidden.status, 404);
    db.assert_audit_holds().await;
}

#[tokio::test]
async fn a_key_limited_to_a_model_may_call_it_by_an_alias_and_no_other() {
    let db = local_db().await;
    let gateway = start_mock_gateway(&db).await;
    let haiku_only = db.funded_key(100, 0).await;
    let chat_only = db.funded_key(100, 0).await;
    for (key, model) in [(&haiku_only, MESSAGES_MODEL), (&chat_only, CHAT_MODEL)] {
        let patch = KeyPatch {
            models: Some(Some(vec![model.into()])),
            ..KeyPatch::default()
        };
        set_rules(&db, key, patch).await;
    }
    let alias = "claude-haiku-4-5-20251001";
    assert_eq!(gateway.messages(&haiku_only, alias).await.status, 200);
    let refused = gateway.messages(&chat_only, alias).await;
    assert_eq!(
        (refused.status, refused.detail()),
        (403, "该 API Key 无权使用此模型")
    );
    assert_eq!(
        db.balance(&haiku_only).await,
        balance(100 - MESSAGES_PRICE, 0)
    );
    assert_eq!(db.balance(&chat_only).await, balance(100, 0));
}

#[tokio::test]
async fn a_model_refusal_comes_before_the_credit_check() {
    let db = local_db().await;
    let gateway = start_mock_gateway(&db).await;
    let broke = db.funded_key(0, 0).await;
    set_rules(
        &db,
        &broke,
        KeyPatch {
            models: Some(Some(vec![CHAT_MODEL.into()])),
            ..KeyPatch::default()
        },
    )
    .await;
    assert_eq!(gateway.messages(&broke, MESSAGES_MODEL).await.status, 403);
    assert_eq!(gateway.chat(&broke, CHAT_MODEL).await.status, 402);
}

#[tokio::test]
async fn an_expired_key_is_401_and_a_key_expiring_later_works() {
    let db = local_db().await;
    let gateway = start_mock_gateway(&db).await;
    let key = db.funded_key(100, 0).await;
    let expiring = |at: chrono::DateTime<chrono::Utc>| KeyPatch {
        expires_at: Some(Some(at)),
        ..KeyPatch::default()
    };
    set_rules(
        &db,
        &key,
        expiring(chrono::Utc::now() + chrono::Duration::hours(1)),
    )
    .await;
    assert_eq!(gateway.chat(&key, CHAT_MODEL).await.status, 200);

    set_rules(
        &db,
        &key,
        expiring(chrono::Utc::now() - chrono::Duration::seconds(1)),
    )
    .await;
    for answer in [
        gateway.chat(&key, CHAT_MODEL).await,
        gateway.messages(&key, MESSAGES_MODEL).await,
    ] {
        assert_eq!((answer.status, answer.detail()), (401, "无效的 API Key"));
    }
    let balance_read = gateway
        .send(
            gateway
                .client
                .get(format!("{}/v1/balance", gateway.base))
                .bearer_auth(&key),
        )
        .await;
    assert_eq!(balance_read.status, 401);
    assert_eq!(db.balance(&key).await, balance(100 - CHAT_PRICE, 0));
    assert_eq!(db.calls(&key).await.len(), 1);
}

#[tokio::test]
async fn a_key_over_its_requests_per_minute_gets_429_with_retry_after_uncharged() {
    let db = local_db().await;
    let gateway = start_mock_gateway(&db).await;
    let key = db.funded_key(100, 0).await;
    let other = db.funded_key(100, 0).await;
    set_rules(
        &db,
        &key,
        KeyPatch {
            rpm: Some(Some(3)),
            ..KeyPatch::default()
        },
    )
    .await;
    within_one_minute(10).await;
    for _ in 0..3 {
        assert_eq!(gateway.chat(&key, CHAT_MODEL).await.status, 200);
    }
    let refused = gateway
        .client
        .post(format!("{}{CHAT}", gateway.base))
        .bearer_auth(&key)
        .body(chat_body(CHAT_MODEL))
        .send()
        .await
        .unwrap();
    assert_eq!(refused.status(), 429);
    assert_eq!(refused.headers()["x-should-retry"], "true");
    let retry_after: u64 = refused.headers()["retry-after"]
        .to_str()
        .unwrap()
        .parse()
        .unwrap();
    assert!((1..=60).contains(&retry_after), "{retry_after}");
    let body: serde_json::Value = refused.json().await.unwrap();
    assert_eq!(body["detail"], "请求过于频繁");
    assert_eq!(gateway.messages(&key, MESSAGES_MODEL).await.status, 429);
    assert_eq!(
        gateway.chat(&other, CHAT_MODEL).await.status,
        200,
        "keys count apart"
    );

    assert_eq!(db.balance(&key).await, balance(100 - 3 * CHAT_PRICE, 0));
    assert_eq!(db.calls(&key).await.len(), 3);
    db.assert_audit_holds().await;
}

#[tokio::test]
async fn rules_set_on_one_gateway_hold_on_a_second_sharing_the_database() {
    let db = local_db().await;
    let first = start_mock_gateway(&db).await;
    // The second gateway trusts remembered rules for a short while, as every store does.
    let second_store = db
        .second_instance()
        .await
        .store
        .as_ref()
        .clone()
        .with_key_rules_ttl(Duration::from_millis(200));
    let second = gateway_on(Arc::new(second_store), RateLimiter::local()).await;
    let key = db.funded_key(100, 0).await;
    assert_eq!(second.messages(&key, MESSAGES_MODEL).await.status, 200);

    set_rules(
        &db,
        &key,
        KeyPatch {
            models: Some(Some(vec![CHAT_MODEL.into()])),
            ..KeyPatch::default()
        },
    )
    .await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    for gateway in [&first, &second] {
        assert_eq!(gateway.messages(&key, MESSAGES_MODEL).await.status, 403);
        assert_eq!(gateway.chat(&key, CHAT_MODEL).await.status, 200);
    }

    set_rules(
        &db,
        &key,
        KeyPatch {
            expires_at: Some(Some(chrono::Utc::now())),
            ..KeyPatch::default()
        },
    )
    .await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    for gateway in [&first, &second] {
        assert_eq!(gateway.chat(&key, CHAT_MODEL).await.status, 401);
    }
    assert_eq!(
        db.balance(&key).await,
        balance(100 - MESSAGES_PRICE - 2 * CHAT_PRICE, 0)
    );
    db.assert_audit_holds().await;
}

/// A Redis server of the test's own on a free port, stopped when dropped.
struct OwnRedis {
    child: Child,
    url: String,
}

impl OwnRedis {
    fn start() -> Option<OwnRedis> {
        let port = free_address().rsplit(':').next().unwrap().to_owned();
        let spawned = Command::new("redis-server")
            .args(["--port", &port, "--save", "", "--appendonly", "no"])
            .args(["--bind", "127.0.0.1"])
            .stdout(Stdio::null())
            .spawn();
        let child = match spawned {
            Ok(child) => child,
            Err(_) if std::env::var_os("CI").is_some() => {
                panic!("redis-server must be installed when CI is set")
            }
            Err(error) => {
                eprintln!("redis-server cannot be started ({error}); skipping");
                return None;
            }
        };
        let address = format!("127.0.0.1:{port}");
        for _ in 0..100 {
            if std::net::TcpStream::connect(&address).is_ok() {
                return Some(OwnRedis {
                    child,
                    url: format!("redis://{address}/0"),
                });
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        panic!("redis-server did not listen on {address}");
    }

    fn stop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for OwnRedis {
    fn drop(&mut self) {
        self.stop();
    }
}

#[tokio::test]
async fn rate_limits_hold_across_two_gateways_through_redis_and_per_gateway_when_it_stops() {
    let Some(mut redis) = OwnRedis::start() else {
        return;
    };
    let db = local_db().await;
    let prefix = format!("{}:", unique_name());
    let limiters = [
        RateLimiter::redis(&redis.url, prefix.clone()).unwrap(),
        RateLimiter::redis(&redis.url, prefix).unwrap(),
    ];
    let second_store = db.second_instance().await.store.clone();
    let gateways = [
        gateway_on(db.store.clone(), limiters[0].clone()).await,
        gateway_on(second_store, limiters[1].clone()).await,
    ];
    let key = db.funded_key(1000, 0).await;
    set_rules(
        &db,
        &key,
        KeyPatch {
            rpm: Some(Some(4)),
            ..KeyPatch::default()
        },
    )
    .await;
    within_one_minute(15).await;

    // Four calls spread over both gateways use up the minute for both.
    let mut statuses = Vec::new();
    for round in 0..6 {
        statuses.push(gateways[round % 2].chat(&key, CHAT_MODEL).await.status);
    }
    assert_eq!(statuses, [200, 200, 200, 200, 429, 429]);
    assert!(limiters.iter().all(RateLimiter::shared));

    // Redis stops: calls go on, each gateway counting on its own.
    redis.stop();
    let mut after = Vec::new();
    for _ in 0..5 {
        after.push(gateways[0].chat(&key, CHAT_MODEL).await.status);
    }
    assert_eq!(after, [200, 200, 200, 200, 429]);
    assert!(!limiters[0].shared());
    assert_eq!(gateways[1].chat(&key, CHAT_MODEL).await.status, 200);
    assert_eq!(db.balance(&key).await, balance(1000 - 9 * CHAT_PRICE, 0));
    assert_eq!(db.calls(&key).await.len(), 9);
    db.assert_audit_holds().await;
}

/// Far dates (past 2038, where a 32-bit `TIMESTAMP` ends) are kept as set on every database:
/// a key's expiry and a subscription's period end.
#[tokio::test]
async fn dates_past_2038_are_kept_on_every_database() {
    use model_gateway::store::Grant;
    use model_gateway::{Accounts, Credits, credits::Bucket};

    each_database(async |db| {
        let far = chrono::DateTime::parse_from_rfc3339("2999-01-01T00:00:00Z")
            .unwrap()
            .to_utc();
        let key = db.funded_key(0, 1).await;
        let key_id = db.store.keys_of(db.account(&key).await).await.unwrap()[0].id;
        let rules = model_gateway::call::KeyRules {
            expires_at: Some(far),
            ..model_gateway::call::KeyRules::default()
        };
        let info = db
            .store
            .set_key_rules(key_id, &rules)
            .await
            .unwrap()
            .unwrap();
        assert_eq!(info.rules.expires_at, Some(far));
        let grant = Grant {
            period_end: Some(far),
            ..Grant::plain(Bucket::Subscription, Credits::new(5))
        };
        db.store
            .grant_once(db.account(&key).await, grant)
            .await
            .unwrap();
        let summary = db
            .store
            .account(db.account(&key).await)
            .await
            .unwrap()
            .unwrap();
        assert_eq!(summary.subscription_ends_at, Some(far));
    })
    .await;
}
