//! Idempotency keys on calls, through the gateway over real HTTP: a call with an
//! `Idempotency-Key` is billed at most once per account and key. A retry while it runs gets
//! 409, a retry after it was billed gets the same reply again uncharged (marked
//! `idempotent-replayed: true`), the key reused for another request gets 422, and a retry after
//! a refund runs as a new call; on `SQLite`, `PostgreSQL` and `MariaDB`, and across two gateway
//! instances sharing the database.

use crate::common;

use std::sync::Arc;
use std::time::Duration;

use common::fake_provider::{FakeProvider, Fault, StreamEnd};
use common::*;
use model_gateway::recovery::Upkeep;
use model_gateway::{
    Catalogue, Upstream, charge::IDEMPOTENT_REPLAYED_HEADER, router::DEFAULT_MAX_BODY_BYTES,
    store::CallStatus, upstream::MockUpstream,
};
use sea_orm::ConnectionTrait;

/// A keyed POST and everything the test looks at in its answer.
struct Keyed {
    status: u16,
    bytes: bytes::Bytes,
    content_type: Option<String>,
    replayed: bool,
    headers: reqwest::header::HeaderMap,
}

impl Keyed {
    fn detail(&self) -> String {
        let body: serde_json::Value = serde_json::from_slice(&self.bytes).unwrap();
        body["detail"].as_str().unwrap().to_owned()
    }
}

async fn keyed(gateway: &Gateway, path: &str, key: &str, idem: &str, body: &str) -> Keyed {
    keyed_on(
        &gateway.client,
        &gateway.base,
        path,
        key,
        idem,
        body.to_owned(),
    )
    .await
}

async fn keyed_on(
    client: &reqwest::Client,
    base: &str,
    path: &str,
    key: &str,
    idem: &str,
    body: String,
) -> Keyed {
    let response = client
        .post(format!("{base}{path}"))
        .header("authorization", format!("Bearer {key}"))
        .header("content-type", "application/json")
        .header("idempotency-key", idem)
        .body(body)
        .send()
        .await
        .unwrap();
    let headers = response.headers().clone();
    let header = |name: &str| {
        headers
            .get(name)
            .map(|value| value.to_str().unwrap().to_owned())
    };
    Keyed {
        status: response.status().as_u16(),
        content_type: header("content-type"),
        replayed: header(IDEMPOTENT_REPLAYED_HEADER).as_deref() == Some("true"),
        headers: headers.clone(),
        bytes: response.bytes().await.unwrap(),
    }
}

/// How many idempotency records the database holds.
async fn records(db: &TestDb) -> i64 {
    let connection = db.store.connection();
    let row = connection
        .query_one_raw(sea_orm::Statement::from_string(
            connection.get_database_backend(),
            "SELECT COUNT(*) AS n FROM mg_idempotent_calls",
        ))
        .await
        .unwrap()
        .unwrap();
    row.try_get_by_index::<i64>(0).unwrap()
}

/// `test` on each database, then on a `SQLite` file its store owns (where a keyed call whose
/// key has no record is held in memory, and its record written with its entry).
async fn each_database_and_an_owned_file(test: impl AsyncFn(&TestDb)) {
    each_database(&test).await;
    #[cfg(feature = "sqlite")]
    test(&owned_sqlite_db().await).await;
}

#[tokio::test]
async fn a_retry_after_a_billed_call_gets_the_same_reply_again_uncharged() {
    each_database_and_an_owned_file(async |db| {
        let gateway = start_mock_gateway(db).await;
        first_keyed_call(db, &gateway).await;
        let key = db.funded_key(0, 20).await;
        for (path, body, price) in [
            (CHAT, chat_body(CHAT_MODEL), CHAT_PRICE),
            (MESSAGES, messages_body(MESSAGES_MODEL), MESSAGES_PRICE),
        ] {
            let idem = format!("retry-{path}");
            let before = db.balance(&key).await.total().get();
            let first = keyed(&gateway, path, &key, &idem, &body).await;
            assert_eq!(first.status, 200, "{:?}", first.bytes);
            assert!(!first.replayed);
            for _ in 0..2 {
                let again = keyed(&gateway, path, &key, &idem, &body).await;
                assert_eq!(again.status, 200);
                assert!(again.replayed, "a replay is marked");
                assert_eq!(again.bytes, first.bytes, "the same reply, byte for byte");
                assert_eq!(again.content_type, first.content_type);
            }
            assert_eq!(db.balance(&key).await.total().get(), before - price);
        }
        let calls = db.calls(&key).await;
        assert_eq!(calls.len(), 2, "one entry per key: {calls:?}");
        assert!(calls.iter().all(|call| call.status == CallStatus::Ok));
        db.assert_audit_holds().await;
    })
    .await;
}

#[tokio::test]
async fn the_key_reused_for_another_request_is_422_and_uncharged() {
    each_database_and_an_owned_file(async |db| {
        let gateway = start_mock_gateway(db).await;
        first_keyed_call(db, &gateway).await;
        let key = db.funded_key(0, 20).await;
        let first = keyed(&gateway, CHAT, &key, "k1", &chat_body(CHAT_MODEL)).await;
        assert_eq!(first.status, 200);
        let other_body = chat_body(CHAT_MODEL).replace("Hello", "Goodbye");
        assert_ne!(other_body, chat_body(CHAT_MODEL));
        // Another body, or the same key on the other endpoint.
        for (path, body) in [
            (CHAT, other_body),
            (MESSAGES, messages_body(MESSAGES_MODEL)),
        ] {
            let reused = keyed(&gateway, path, &key, "k1", &body).await;
            assert_eq!(reused.status, 422);
            assert_eq!(reused.detail(), "Idempotency-Key 已用于另一个不同的请求");
            assert_eq!(reused.headers["x-should-retry"], "false");
        }
        assert_eq!(db.balance(&key).await.total().get(), 20 - CHAT_PRICE);
        assert_eq!(db.calls(&key).await.len(), 1);
        // Keys are per account: another account may use the same one.
        let other = db.funded_key(0, 20).await;
        let theirs = keyed(
            &gateway,
            MESSAGES,
            &other,
            "k1",
            &messages_body(MESSAGES_MODEL),
        )
        .await;
        assert_eq!(theirs.status, 200);
        assert!(!theirs.replayed);
    })
    .await;
}

#[tokio::test]
async fn a_key_that_is_empty_too_long_or_not_ascii_is_a_400_and_uncharged() {
    let db = local_db().await;
    let gateway = start_mock_gateway(&db).await;
    let key = db.funded_key(0, 20).await;
    for idem in [
        String::new(),
        "k".repeat(256),
        "a key".into(),
        "ключ".into(),
    ] {
        let refused = keyed(&gateway, CHAT, &key, &idem, &chat_body(CHAT_MODEL)).await;
        assert_eq!(refused.status, 400, "{idem:?}");
        assert_eq!(
            refused.detail(),
            "Idempotency-Key 须为 1 到 255 个可见 ASCII 字符"
        );
    }
    let longest = keyed(
        &gateway,
        CHAT,
        &key,
        &"k".repeat(255),
        &chat_body(CHAT_MODEL),
    )
    .await;
    assert_eq!(longest.status, 200);
    assert_eq!(db.balance(&key).await.total().get(), 20 - CHAT_PRICE);
}

/// A gateway whose chat model is served by `provider`.
async fn provider_gateway(db: &TestDb, provider: &FakeProvider) -> Gateway {
    let toml = one_upstream_toml("fake", &provider.base, "K", "");
    http_gateway(db, Catalogue::from_toml(&toml).unwrap()).await
}

const CHAT_REPLY: &str = r#"{"id":"chatcmpl-1","object":"chat.completion","model":"gpt-4o-mini","choices":[{"index":0,"message":{"role":"assistant","content":"Hi"},"finish_reason":"stop"}],"usage":{"prompt_tokens":3,"completion_tokens":1,"total_tokens":4}}"#;

#[tokio::test]
async fn a_retry_while_the_call_runs_is_409_then_gets_the_reply() {
    retry_while_running(&local_db().await, false).await;
}

/// On a file its store owns, the running call is held (it has no entry yet), and the retry is
/// answered from the holds.
#[cfg(feature = "sqlite")]
#[tokio::test]
async fn on_an_owned_file_a_retry_while_the_held_call_runs_is_409_then_gets_the_reply() {
    retry_while_running(&owned_sqlite_db().await, true).await;
}

async fn retry_while_running(db: &TestDb, held: bool) {
    let provider = FakeProvider::start().await;
    let gateway = provider_gateway(db, &provider).await;
    provider.then(Fault::json(200, CHAT_REPLY));
    first_keyed_call(db, &gateway).await;
    provider.then(Fault::json(200, CHAT_REPLY).after(Duration::from_millis(800)));
    let key = db.funded_key(0, 20).await;
    let body = chat_body(CHAT_MODEL);
    let first = {
        let (client, base, key, body) = (
            gateway.client.clone(),
            gateway.base.clone(),
            key.clone(),
            body.clone(),
        );
        tokio::spawn(async move { keyed_on(&client, &base, CHAT, &key, "slow", body).await })
    };
    while provider.requests() < 2 {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let entries = db.calls(&key).await;
    if held {
        assert!(entries.is_empty(), "held, so not yet written: {entries:?}");
    } else {
        assert_eq!(entries[0].status, CallStatus::Pending);
    }
    let running = keyed(&gateway, CHAT, &key, "slow", &body).await;
    assert_eq!(running.status, 409);
    assert_eq!(
        running.detail(),
        "相同 Idempotency-Key 的请求仍在处理中, 请稍后重试"
    );
    assert_eq!(running.headers["retry-after"], "1");
    // Another request under the running call's key: the key is taken by another request.
    let other_body = r#"{"model":"gpt-4o-mini","messages":[{"role":"user","content":"other"}]}"#;
    let reused = keyed(&gateway, CHAT, &key, "slow", other_body).await;
    assert_eq!(reused.status, 422, "{:?}", reused.bytes);
    let first = first.await.unwrap();
    assert_eq!(first.status, 200);
    let after = keyed(&gateway, CHAT, &key, "slow", &body).await;
    assert_eq!((after.status, after.replayed), (200, true));
    assert_eq!(after.bytes, first.bytes);
    assert_eq!(
        provider.requests(),
        2,
        "the provider was called once for the key"
    );
    assert_eq!(db.balance(&key).await.total().get(), 20 - CHAT_PRICE);
    assert_eq!(records(db).await, 2);
    db.assert_audit_holds().await;
}

#[tokio::test]
async fn a_retry_after_a_refund_runs_as_a_new_call() {
    each_database_and_an_owned_file(async |db| {
        let provider = FakeProvider::start().await;
        provider
            .then(Fault::json(200, CHAT_REPLY))
            .then(Fault::json(500, r#"{"error":{"message":"down"}}"#))
            .then(Fault::json(200, CHAT_REPLY));
        let gateway = provider_gateway(db, &provider).await;
        first_keyed_call(db, &gateway).await;
        let key = db.funded_key(0, 20).await;
        let body = chat_body(CHAT_MODEL);
        let failed = keyed(&gateway, CHAT, &key, "after-refund", &body).await;
        assert_eq!(failed.status, 502);
        assert_eq!(db.balance(&key).await.total().get(), 20, "refunded");
        let retried = keyed(&gateway, CHAT, &key, "after-refund", &body).await;
        assert_eq!((retried.status, retried.replayed), (200, false));
        let replayed = keyed(&gateway, CHAT, &key, "after-refund", &body).await;
        assert_eq!((replayed.status, replayed.replayed), (200, true));
        assert_eq!(replayed.bytes, retried.bytes);
        assert_eq!(db.balance(&key).await.total().get(), 20 - CHAT_PRICE);
        let statuses: Vec<_> = db.calls(&key).await.iter().map(|c| c.status).collect();
        assert_eq!(statuses, [CallStatus::Ok, CallStatus::Refunded]);
        assert_eq!(provider.requests(), 3);
        db.assert_audit_holds().await;
    })
    .await;
}

/// Fifty identical keyed calls at once, half through each of two gateways sharing the
/// database, to a provider slow enough that all arrive while the first runs.
#[tokio::test]
async fn fifty_identical_keyed_calls_at_once_are_billed_once() {
    each_database(async |db| {
        let provider = FakeProvider::start().await;
        let second = db.second_instance().await;
        let gateways = [
            provider_gateway(db, &provider).await,
            provider_gateway(&second, &provider).await,
        ];
        fifty_identical_at_once(db, &provider, &gateways).await;
    })
    .await;
}

/// The same on a file its store owns, through its one gateway, once it knows which keys have
/// records (the first keyed call reads them): the first call is held, and the others are
/// answered from the holds, then from its record.
#[cfg(feature = "sqlite")]
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn on_an_owned_file_fifty_identical_keyed_calls_at_once_are_billed_once() {
    let db = owned_sqlite_db().await;
    let provider = FakeProvider::start().await;
    let gateway = provider_gateway(&db, &provider).await;
    provider.then(Fault::json(200, CHAT_REPLY));
    first_keyed_call(&db, &gateway).await;
    fifty_identical_at_once(&db, &provider, &[gateway]).await;
}

/// The same as the very first keyed calls an owned file sees: the first reads which keys have
/// records while the others arrive, and none of them may be held against the key meanwhile.
#[cfg(feature = "sqlite")]
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn on_an_owned_file_fifty_identical_first_keyed_calls_are_billed_once() {
    let db = owned_sqlite_db().await;
    let provider = FakeProvider::start().await;
    let gateway = provider_gateway(&db, &provider).await;
    fifty_identical_at_once(&db, &provider, &[gateway]).await;
}

async fn fifty_identical_at_once(db: &TestDb, provider: &FakeProvider, gateways: &[Gateway]) {
    provider.always(Fault::json(200, CHAT_REPLY).after(Duration::from_millis(300)));
    let before = provider.requests();
    let key = db.funded_key(0, 1_000).await;
    let body = chat_body(CHAT_MODEL);
    let calls: Vec<_> = (0..50)
        .map(|i| {
            let gateway = &gateways[i % gateways.len()];
            let (client, base) = (gateway.client.clone(), gateway.base.clone());
            let (key, body) = (key.clone(), body.clone());
            tokio::spawn(async move { keyed_on(&client, &base, CHAT, &key, "fifty", body).await })
        })
        .collect();
    let mut answers = Vec::new();
    for call in calls {
        answers.push(call.await.unwrap());
    }
    let served: Vec<_> = answers
        .iter()
        .filter(|a| a.status == 200 && !a.replayed)
        .collect();
    assert_eq!(served.len(), 1, "exactly one call ran");
    let mut running = 0;
    for answer in &answers {
        match (answer.status, answer.replayed) {
            (409, false) => running += 1,
            (200, true) | (200, false) => assert_eq!(answer.bytes, served[0].bytes),
            other => panic!("unexpected answer {other:?}: {:?}", answer.bytes),
        }
    }
    assert!(running > 0, "some arrived while it ran");
    assert_eq!(
        provider.requests() - before,
        1,
        "the provider was called once"
    );
    assert_eq!(db.balance(&key).await.total().get(), 1_000 - CHAT_PRICE);
    assert_eq!(db.calls(&key).await.len(), 1);
    db.assert_audit_holds().await;
}

/// The local database, and a `SQLite` file its store owns.
async fn local_and_owned() -> Vec<TestDb> {
    #[allow(unused_mut)]
    let mut dbs = vec![local_db().await];
    #[cfg(feature = "sqlite")]
    dbs.push(owned_sqlite_db().await);
    dbs
}

/// A keyed call of a new account of `db`'s through `gateway`, whose upstream must answer it:
/// on an owned file, the first keyed call reads which keys have records, in the database, so
/// the calls after it are held as calls without a key are.
async fn first_keyed_call(db: &TestDb, gateway: &Gateway) {
    let other = db.funded_key(0, 20).await;
    let warm = keyed(gateway, CHAT, &other, "warm", &chat_body(CHAT_MODEL)).await;
    assert_eq!(warm.status, 200, "{:?}", warm.bytes);
}

#[tokio::test]
async fn a_keyed_stream_is_replayed_as_the_same_events_uncharged() {
    for db in local_and_owned().await {
        keyed_stream_replayed(&db).await;
    }
}

async fn keyed_stream_replayed(db: &TestDb) {
    let gateway = start_gateway(
        db,
        Catalogue::demo().with_streaming(true),
        Upstream::Mock(MockUpstream::new()),
        DEFAULT_MAX_BODY_BYTES,
    )
    .await;
    first_keyed_call(db, &gateway).await;
    let key = db.funded_key(0, 20).await;
    let body =
        r#"{"model":"gpt-4o-mini","stream":true,"messages":[{"role":"user","content":"Hello"}]}"#;
    let first = keyed(&gateway, CHAT, &key, "stream", body).await;
    assert_eq!(first.status, 200);
    assert_eq!(first.content_type.as_deref(), Some("text/event-stream"));
    assert!(first.bytes.ends_with(b"data: [DONE]\n\n"));
    let again = keyed(&gateway, CHAT, &key, "stream", body).await;
    assert_eq!((again.status, again.replayed), (200, true));
    assert_eq!(again.content_type.as_deref(), Some("text/event-stream"));
    assert_eq!(again.bytes, first.bytes, "the same events, byte for byte");
    assert_eq!(db.balance(&key).await.total().get(), 20 - CHAT_PRICE);
    db.assert_audit_holds().await;
}

/// Past the window, the upkeep deletes a record whose call ended, and the key is a new call's.
#[tokio::test]
async fn records_past_their_window_are_forgotten_by_the_upkeep() {
    each_database_and_an_owned_file(async |db| {
        let store = db
            .store
            .as_ref()
            .clone()
            .with_idempotency_window(Duration::from_secs(1));
        let windowed = TestDb::sharing(db, Arc::new(store));
        let gateway = start_mock_gateway(&windowed).await;
        first_keyed_call(db, &gateway).await;
        let key = db.funded_key(0, 20).await;
        let body = chat_body(CHAT_MODEL);
        assert_eq!(keyed(&gateway, CHAT, &key, "old", &body).await.status, 200);
        assert_eq!(
            records(db).await,
            2,
            "the first keyed call's, and this one's"
        );
        tokio::time::sleep(Duration::from_millis(1_100)).await;
        let upkeep = Upkeep::new(windowed.store.clone(), Duration::from_secs(3_600))
            .start()
            .await
            .unwrap();
        assert_eq!(records(db).await, 0, "the first pass forgot it");
        upkeep.stop().await;
        let anew = keyed(&gateway, CHAT, &key, "old", &body).await;
        assert_eq!((anew.status, anew.replayed), (200, false));
        assert_eq!(db.balance(&key).await.total().get(), 20 - 2 * CHAT_PRICE);
    })
    .await;
}

/// A keyed stream whose client left after content reached it: billed (the provider did the
/// work), its reply not kept, so a retry is told so (409) and is not billed again.
#[tokio::test]
async fn a_keyed_stream_its_client_left_is_billed_once_and_its_retry_told_so() {
    for db in local_and_owned().await {
        keyed_stream_left(&db).await;
    }
}

async fn keyed_stream_left(db: &TestDb) {
    const CHAT_DELTA: &str =
        "data: {\"choices\":[{\"index\":0,\"delta\":{\"content\":\"Hi\"}}]}\n\n";
    let provider = FakeProvider::start().await;
    let toml = format!(
        "streaming = true\n{}",
        one_upstream_toml("fake", &provider.base, "K", "")
    );
    let gateway = http_gateway(db, Catalogue::from_toml(&toml).unwrap()).await;
    provider.then(Fault::json(200, CHAT_REPLY));
    first_keyed_call(db, &gateway).await;
    let key = db.funded_key(0, 20).await;
    let body =
        r#"{"model":"gpt-4o-mini","stream":true,"messages":[{"role":"user","content":"Hello"}]}"#;
    provider.then(Fault::sse([CHAT_DELTA]).ending(StreamEnd::Hang));
    let mut response = gateway
        .client
        .post(format!("{}{CHAT}", gateway.base))
        .bearer_auth(&key)
        .header("idempotency-key", "left")
        .body(body)
        .send()
        .await
        .unwrap();
    let mut received = Vec::new();
    while received.len() < CHAT_DELTA.len() {
        received.extend_from_slice(&response.chunk().await.unwrap().unwrap());
    }
    drop(response);
    let started = std::time::Instant::now();
    // Pending: a row, or on an owned file a held call with none yet.
    while db
        .calls(&key)
        .await
        .first()
        .is_none_or(|c| c.status == CallStatus::Pending)
    {
        assert!(started.elapsed() < Duration::from_secs(5), "still pending");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(db.calls(&key).await[0].status, CallStatus::Ok);
    let retry = keyed(&gateway, CHAT, &key, "left", body).await;
    assert_eq!(retry.status, 409);
    assert_eq!(
        retry.detail(),
        "相同 Idempotency-Key 的请求已完成并计费, 但其回复未保存, 无法重放"
    );
    assert_eq!(retry.headers["x-should-retry"], "false");
    assert_eq!(
        provider.requests(),
        2,
        "the first keyed call's, and this one's"
    );
    assert_eq!(db.balance(&key).await.total().get(), 20 - CHAT_PRICE);
    assert_eq!(db.calls(&key).await.len(), 1);
    db.assert_audit_holds().await;
}

/// Keyed calls of many accounts at once, on the three databases: each account's call runs and
/// is billed once, and none is refused because they raced (on `MariaDB`, locking reads of
/// missing records in one index would deadlock two accounts' inserts).
#[tokio::test]
async fn keyed_calls_of_many_accounts_at_once_all_run() {
    each_database_and_an_owned_file(async |db| {
        let gateway = start_mock_gateway(db).await;
        first_keyed_call(db, &gateway).await;
        let mut keys = Vec::new();
        for _ in 0..24 {
            keys.push(db.funded_key(0, 10).await);
        }
        let calls: Vec<_> = keys
            .iter()
            .enumerate()
            .map(|(i, key)| {
                let (client, base) = (gateway.client.clone(), gateway.base.clone());
                let (key, body) = (key.clone(), chat_body(CHAT_MODEL));
                // Half share one key string (keys are per account), half have their own.
                let idem = if i % 2 == 0 {
                    "shared".to_owned()
                } else {
                    format!("own-{i}")
                };
                tokio::spawn(async move { keyed_on(&client, &base, CHAT, &key, &idem, body).await })
            })
            .collect();
        for call in calls {
            let answer = call.await.unwrap();
            assert_eq!(
                (answer.status, answer.replayed),
                (200, false),
                "{:?}",
                answer.bytes
            );
        }
        for key in &keys {
            assert_eq!(db.balance(key).await.total().get(), 10 - CHAT_PRICE);
        }
        db.assert_audit_holds().await;
    })
    .await;
}
