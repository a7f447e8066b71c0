//! What key holders and their clients can ask with their own key, the probes, and request ids:
//! the example gateway over real HTTP (mock mode, and before a fake provider for
//! `count_tokens`). None of it is charged or written to the call log.

use crate::common;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use common::fake_provider::{FakeProvider, Fault};
use common::*;
use model_gateway::{Catalogue, Upstream, upstream::MockUpstream};
use serde_json::{Value, json};

async fn get(gateway: &Gateway, path: &str, key: Option<&str>, anthropic: bool) -> Answer {
    let mut request = gateway.client.get(format!("{}{path}", gateway.base));
    if let Some(key) = key {
        request = request.header("x-api-key", key);
    }
    if anthropic {
        request = request.header("anthropic-version", "2023-06-01");
    }
    gateway.send(request).await
}

/// Every key holder's endpoint answers 401 without a key and charges nothing with one.
#[tokio::test]
async fn the_key_holder_endpoints_need_a_key_and_charge_nothing() {
    let db = local_db().await;
    let gateway = start_mock_gateway(&db).await;
    let key = db.funded_key(10, 0).await;
    for path in [
        "/v1/models",
        "/v1/models/gpt-4o-mini",
        "/v1/balance",
        "/v1/calls",
    ] {
        for key in [None, Some("sk-mg-wrong")] {
            let answer = get(&gateway, path, key, false).await;
            assert_eq!(answer.status, 401, "{path}");
            assert_eq!(answer.detail(), "无效的 API Key");
        }
        assert_eq!(
            get(&gateway, path, Some(&key), false).await.status,
            200,
            "{path}"
        );
        assert_eq!(
            get(&gateway, path, Some(&key), true).await.status,
            200,
            "{path}"
        );
    }
    let count = gateway
        .post_x_api_key(
            "/v1/messages/count_tokens",
            &key,
            messages_body(MESSAGES_MODEL),
        )
        .await;
    assert_eq!(count.status, 200);
    let unauthorized = gateway
        .post_x_api_key(
            "/v1/messages/count_tokens",
            "sk-mg-wrong",
            messages_body(MESSAGES_MODEL),
        )
        .await;
    assert_eq!(unauthorized.status, 401);
    assert!(db.calls(&key).await.is_empty());
    assert_eq!(db.balance(&key).await, balance(10, 0));
    db.assert_audit_holds().await;
}

#[tokio::test]
async fn models_are_listed_in_the_openai_shape_with_protocol_and_price() {
    let db = local_db().await;
    let gateway = start_mock_gateway(&db).await;
    let key = db.funded_key(1, 0).await;
    let list = get(&gateway, "/v1/models", Some(&key), false).await.body;
    assert_eq!(list["object"], "list");
    let catalogue = Catalogue::demo();
    let data = list["data"].as_array().unwrap();
    assert_eq!(data.len(), catalogue.models().count());
    for item in data {
        let model = catalogue.model(item["id"].as_str().unwrap()).unwrap();
        assert_eq!(item["object"], "model");
        assert!(item["created"].is_i64() && item["owned_by"].is_string());
        assert_eq!(item["price"], model.pricing.per_call.get());
        assert_eq!(item["protocol"], json!(model.protocol));
    }
    let one = get(&gateway, "/v1/models/gpt-4o-mini", Some(&key), false).await;
    assert_eq!(one.body["id"], "gpt-4o-mini");
    assert_eq!(one.body["price"], CHAT_PRICE);
    let missing = get(&gateway, "/v1/models/no-such-model", Some(&key), false).await;
    assert_eq!(missing.status, 404);
    assert_eq!(missing.detail(), "模型不存在");
}

#[tokio::test]
async fn models_are_listed_in_the_anthropic_shape_and_paginate_both_ways() {
    let db = local_db().await;
    let gateway = start_mock_gateway(&db).await;
    let key = db.funded_key(1, 0).await;
    let all = get(&gateway, "/v1/models?limit=100", Some(&key), true)
        .await
        .body;
    assert_eq!(all["has_more"], false);
    let ids: Vec<String> = all["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|item| {
            assert_eq!(item["type"], "model");
            assert!(item["display_name"].is_string() && item["created_at"].is_string());
            item["id"].as_str().unwrap().to_owned()
        })
        .collect();
    assert_eq!(ids.len(), Catalogue::demo().models().count());
    assert_eq!(all["first_id"], ids[0].as_str());
    assert_eq!(all["last_id"], ids[ids.len() - 1].as_str());

    // Forwards one at a time with after_id, then back with before_id.
    let mut walked = Vec::new();
    let mut path = "/v1/models?limit=1".to_owned();
    loop {
        let page = get(&gateway, &path, Some(&key), true).await.body;
        let data = page["data"].as_array().unwrap();
        assert_eq!(data.len(), 1);
        walked.push(data[0]["id"].as_str().unwrap().to_owned());
        if page["has_more"] == false {
            break;
        }
        path = format!(
            "/v1/models?limit=1&after_id={}",
            page["last_id"].as_str().unwrap()
        );
    }
    assert_eq!(walked, ids);
    let last = &ids[ids.len() - 1];
    let back = get(
        &gateway,
        &format!("/v1/models?limit=2&before_id={last}"),
        Some(&key),
        true,
    )
    .await;
    let back_ids: Vec<_> = back.body["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|i| i["id"].clone())
        .collect();
    assert_eq!(
        back_ids,
        [json!(ids[ids.len() - 3]), json!(ids[ids.len() - 2])]
    );
    assert_eq!(back.body["has_more"], true);
    let one = get(&gateway, "/v1/models/claude-haiku-4-5", Some(&key), true)
        .await
        .body;
    assert_eq!(
        (one["type"].as_str(), one["id"].as_str()),
        (Some("model"), Some("claude-haiku-4-5"))
    );
    let bad = get(&gateway, "/v1/models?limit=lots", Some(&key), true).await;
    assert_eq!(bad.status, 400);
}

#[tokio::test]
async fn the_balance_is_the_keys_accounts() {
    let db = local_db().await;
    let gateway = start_mock_gateway(&db).await;
    let key = db.funded_key(7, 5).await;
    gateway.chat(&key, CHAT_MODEL).await;
    let answer = get(&gateway, "/v1/balance", Some(&key), false).await;
    assert_eq!(
        answer.body,
        json!({ "subscription": 5, "topup": 5, "total": 10, "subscription_ends_at": null })
    );
}

/// Two accounts call; each sees only its own entries, newest first, a page at a time, with the
/// request id its answer carried.
#[tokio::test]
async fn the_call_log_shows_only_the_accounts_own_calls_a_page_at_a_time() {
    let db = local_db().await;
    let gateway = start_mock_gateway(&db).await;
    let (mine, theirs) = (db.funded_key(100, 0).await, db.funded_key(100, 0).await);
    let mut my_request_ids = Vec::new();
    for i in 0..5 {
        let response = gateway
            .client
            .post(format!("{}{CHAT}", gateway.base))
            .bearer_auth(&mine)
            .header("x-request-id", format!("mine-{i}"))
            .body(chat_body(CHAT_MODEL))
            .send()
            .await
            .unwrap();
        assert_eq!(
            response.headers()["x-request-id"],
            format!("mine-{i}").as_str()
        );
        my_request_ids.push(format!("mine-{i}"));
        gateway.messages(&theirs, MESSAGES_MODEL).await;
    }
    let mut seen = Vec::new();
    let mut path = "/v1/calls?limit=2".to_owned();
    loop {
        let page = get(&gateway, &path, Some(&mine), false).await.body;
        for entry in page["data"].as_array().unwrap() {
            assert_eq!(
                entry["model"], CHAT_MODEL,
                "another account's entry: {entry}"
            );
            assert_eq!(entry["status"], "ok");
            seen.push((
                entry["id"].as_i64().unwrap(),
                entry["request_id"].as_str().unwrap().to_owned(),
            ));
        }
        match page["next_before"].as_i64() {
            Some(before) if page["has_more"] == true => {
                path = format!("/v1/calls?limit=2&before={before}")
            }
            _ => break,
        }
    }
    assert_eq!(seen.len(), 5);
    assert!(
        seen.windows(2).all(|pair| pair[0].0 > pair[1].0),
        "newest first: {seen:?}"
    );
    let request_ids: Vec<_> = seen.iter().rev().map(|(_, id)| id.clone()).collect();
    assert_eq!(request_ids, my_request_ids);
    let theirs_log = get(&gateway, "/v1/calls?limit=100", Some(&theirs), false)
        .await
        .body;
    assert!(
        theirs_log["data"]
            .as_array()
            .unwrap()
            .iter()
            .all(|e| e["model"] == MESSAGES_MODEL)
    );
}

#[tokio::test]
async fn count_tokens_in_mock_mode_estimates_and_refuses_chat_models() {
    let db = local_db().await;
    let gateway = start_mock_gateway(&db).await;
    let key = db.funded_key(10, 0).await;
    let count = gateway
        .post_x_api_key(
            "/v1/messages/count_tokens",
            &key,
            messages_body(MESSAGES_MODEL),
        )
        .await;
    assert!(
        count.body["input_tokens"].as_u64().unwrap() > 0,
        "{:?}",
        count.body
    );
    let chat = gateway
        .post_x_api_key("/v1/messages/count_tokens", &key, chat_body(CHAT_MODEL))
        .await;
    assert_eq!(chat.status, 404);
    assert_eq!(chat.detail(), "模型不存在");
    let broken = gateway
        .post_x_api_key("/v1/messages/count_tokens", &key, "not json")
        .await;
    assert_eq!(broken.status, 400);
    assert!(db.calls(&key).await.is_empty());
    assert_eq!(db.balance(&key).await, balance(10, 0));
}

#[tokio::test]
async fn count_tokens_is_answered_by_the_models_provider_as_it_answered() {
    let db = local_db().await;
    let provider = FakeProvider::start().await;
    let toml = format!(
        "[[upstreams]]\nname = \"anthropic\"\nkind = \"anthropic\"\nbase_url = \"{}\"\napi_key_env = \"K\"\n\
         [[models]]\nname = \"{MESSAGES_MODEL}\"\nprotocol = \"messages\"\nprice = {MESSAGES_PRICE}\nupstream = \"anthropic\"\nupstream_model = \"claude-haiku-4-5-20251001\"\n",
        provider.base
    );
    let catalogue = Catalogue::from_toml(&toml).unwrap();
    let gateway = http_gateway(&db, catalogue).await;
    let key = db.funded_key(10, 0).await;
    provider.then(Fault::json(200, r#"{"input_tokens":1234}"#));
    let count = gateway
        .send(
            gateway
                .client
                .post(format!("{}/v1/messages/count_tokens", gateway.base))
                .header("x-api-key", &key)
                .header("anthropic-beta", "token-counting-2024-11-01")
                .header("x-request-id", "count-1")
                .body(messages_body(MESSAGES_MODEL)),
        )
        .await;
    assert_eq!(
        (count.status, count.body.clone()),
        (200, json!({ "input_tokens": 1234 }))
    );
    let seen = provider.last();
    assert_eq!(seen.target, "/v1/messages/count_tokens");
    assert_eq!(seen.header("x-api-key"), Some("sk-provider"));
    assert_eq!(
        seen.header("anthropic-beta"),
        Some("token-counting-2024-11-01")
    );
    assert_eq!(seen.header("x-request-id"), Some("count-1"));
    let sent: Value = serde_json::from_slice(&seen.body).unwrap();
    assert_eq!(sent["model"], "claude-haiku-4-5-20251001");
    // The provider's refusal is passed on as it came.
    provider.then(Fault::json(400, r#"{"type":"error","error":{"type":"invalid_request_error","message":"messages: required"}}"#));
    let refused = gateway
        .post_x_api_key(
            "/v1/messages/count_tokens",
            &key,
            json!({ "model": MESSAGES_MODEL }).to_string(),
        )
        .await;
    assert_eq!(refused.status, 400);
    assert_eq!(refused.body["error"]["message"], "messages: required");
    assert!(db.calls(&key).await.is_empty());
}

#[tokio::test]
async fn probes_answer_without_a_key() {
    let db = local_db().await;
    let gateway = start_mock_gateway(&db).await;
    for path in ["/health", "/ready", "/"] {
        let answer = get(&gateway, path, None, false).await;
        assert_eq!(answer.status, 200, "{path}");
    }
    let head = gateway
        .client
        .head(format!("{}/", gateway.base))
        .send()
        .await
        .unwrap();
    assert_eq!(head.status(), 200);
}

#[tokio::test]
async fn a_query_string_does_not_change_routing() {
    let db = local_db().await;
    let gateway = start_mock_gateway(&db).await;
    let key = db.funded_key(10, 0).await;
    let answer = gateway
        .post_x_api_key(
            "/v1/messages?beta=true",
            &key,
            messages_body(MESSAGES_MODEL),
        )
        .await;
    assert_eq!(answer.status, 200);
    assert_eq!(answer.body["type"], "message");
    assert_eq!(db.balance(&key).await, balance(10 - MESSAGES_PRICE, 0));
}

/// Every answer carries an id: the client's own if sane, else a new one that differs each time;
/// refusals too. The provider is sent the same id.
#[tokio::test]
async fn every_answer_carries_a_request_id_and_the_provider_is_sent_it() {
    let db = local_db().await;
    let provider = FakeProvider::start().await;
    provider.always(Fault::json(
        200,
        r#"{"choices":[],"usage":{"prompt_tokens":1,"completion_tokens":1}}"#,
    ));
    let catalogue = Catalogue::from_toml(&one_upstream_toml("p", &provider.base, "K", "")).unwrap();
    let gateway = http_gateway(&db, catalogue).await;
    let key = db.funded_key(10, 0).await;
    let call = |id: Option<&str>, path: &str, key: &str| {
        let mut request = gateway
            .client
            .post(format!("{}{path}", gateway.base))
            .bearer_auth(key)
            .body(chat_body(CHAT_MODEL));
        if let Some(id) = id {
            request = request.header("x-request-id", id);
        }
        request.send()
    };
    let mine = call(Some("client-chosen-1"), CHAT, &key).await.unwrap();
    assert_eq!(mine.headers()["x-request-id"], "client-chosen-1");
    assert_eq!(
        provider.last().header("x-request-id"),
        Some("client-chosen-1")
    );
    assert_eq!(
        db.calls(&key).await[0].request_id.as_deref(),
        Some("client-chosen-1")
    );

    let made = call(None, CHAT, &key).await.unwrap();
    let id = made.headers()["x-request-id"].to_str().unwrap().to_owned();
    assert!(id.starts_with("req_") && id.len() == 36, "{id}");
    assert_eq!(provider.last().header("x-request-id"), Some(id.as_str()));
    assert_eq!(
        db.calls(&key).await[0].request_id.as_deref(),
        Some(id.as_str())
    );

    let long = "x".repeat(200);
    let replaced = call(Some(&long), CHAT, &key).await.unwrap();
    let replaced = replaced.headers()["x-request-id"]
        .to_str()
        .unwrap()
        .to_owned();
    assert!(replaced.starts_with("req_") && replaced != id);
    for (path, key) in [(CHAT, "sk-mg-wrong"), ("/nowhere", key.as_str())] {
        let refused = call(None, path, key).await.unwrap();
        assert!(refused.status().is_client_error());
        assert!(
            refused.headers()["x-request-id"]
                .to_str()
                .unwrap()
                .starts_with("req_")
        );
    }
}

/// `/ready` answers 503 while the database cannot be reached and 200 once it can again;
/// `/health` stays 200. `PostgreSQL` is reached through a proxy this test opens and closes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ready_turns_503_while_the_database_is_unreachable_and_back() {
    let Some(url) = postgres_url() else {
        return;
    };
    let db = postgres_db().await.unwrap();
    let server = url
        .split('@')
        .nth(1)
        .unwrap()
        .split('/')
        .next()
        .unwrap()
        .to_owned();
    let proxy = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let proxied = url.replace(&server, &proxy.local_addr().unwrap().to_string());
    let open = Arc::new(AtomicBool::new(true));
    let connections = Arc::new(std::sync::Mutex::new(Vec::<tokio::task::AbortHandle>::new()));
    {
        let (open, connections) = (open.clone(), connections.clone());
        tokio::spawn(async move {
            while let Ok((mut client, _)) = proxy.accept().await {
                if !open.load(Ordering::SeqCst) {
                    continue; // dropped: the database looks unreachable
                }
                let server = server.clone();
                let task = tokio::spawn(async move {
                    if let Ok(mut upstream) = tokio::net::TcpStream::connect(&server).await {
                        let _ = tokio::io::copy_bidirectional(&mut client, &mut upstream).await;
                    }
                });
                connections.lock().unwrap().push(task.abort_handle());
            }
        });
    }
    let store = Arc::new(postgres_store(&proxied, db.pg_schema().unwrap()).await);
    let through_proxy = TestDb::sharing(&db, store);
    let gateway = start_mock_gateway(&through_proxy).await;
    assert_eq!(get(&gateway, "/ready", None, false).await.status, 200);

    open.store(false, Ordering::SeqCst);
    for connection in connections.lock().unwrap().drain(..) {
        connection.abort();
    }
    let down = get(&gateway, "/ready", None, false).await;
    assert_eq!(down.status, 503);
    assert!(!down.detail().is_empty());
    assert_eq!(get(&gateway, "/health", None, false).await.status, 200);

    open.store(true, Ordering::SeqCst);
    let mut back = 0;
    for _ in 0..50 {
        back = get(&gateway, "/ready", None, false).await.status;
        if back == 200 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert_eq!(back, 200, "ready again once the database can be reached");
    drop(gateway);
    db.drop_schema().await;
}

/// A `count_tokens` body of `bytes` bytes: a messages request padded to that size.
fn padded_messages_body(bytes: usize) -> String {
    let padding = "x".repeat(bytes);
    format!(
        r#"{{"model":"{MESSAGES_MODEL}","max_tokens":8,"messages":[{{"role":"user","content":"{padding}"}}]}}"#
    )
}

/// Findings 5 and 6 of the fault run: `count_tokens` bodies go through the calls' limits (the
/// largest body, and the cap for a key that cannot pay for any model), and each refusal is a
/// `{"detail"}` 413, not axum's plain text.
#[tokio::test]
async fn count_tokens_bodies_are_read_within_the_calls_limits() {
    let db = local_db().await;
    let limits = model_gateway::router::BodyLimits::new(3 << 20).unfunded_max_bytes(64 * 1024);
    let router = model_gateway::Gateway::new(
        db.store.clone(),
        Arc::new(Catalogue::demo()),
        Upstream::Mock(MockUpstream::new()),
    )
    .body_limits(limits)
    .router();
    let gateway = serve_router(router).await;
    let funded = db.funded_key(10, 0).await;
    let unfunded = db.funded_key(0, 0).await;
    let path = "/v1/messages/count_tokens";

    let over = gateway
        .post_x_api_key(path, &funded, padded_messages_body(4 << 20))
        .await;
    assert_eq!(over.status, 413);
    assert_eq!(over.detail(), "请求体过大");

    let fits = gateway
        .post_x_api_key(path, &funded, padded_messages_body(2 << 20))
        .await;
    assert_eq!(
        fits.status, 200,
        "a body over axum's 2 MiB but within the limit: {fits:?}"
    );

    let unpaid = gateway
        .post_x_api_key(path, &unfunded, padded_messages_body(128 * 1024))
        .await;
    assert_eq!(
        unpaid.status, 413,
        "a key that cannot pay sends at most the unfunded size"
    );
    assert_eq!(unpaid.detail(), "请求体过大");
    // A doubt of the fault run, decided: counting is free, but not for a key that cannot pay
    // for a call of the model (it had a free line to the provider).
    let small = gateway
        .post_x_api_key(path, &unfunded, messages_body(MESSAGES_MODEL))
        .await;
    assert_eq!(small.status, 402);
    assert_eq!(small.detail(), "积分不足");
    let funded_small = gateway
        .post_x_api_key(path, &funded, messages_body(MESSAGES_MODEL))
        .await;
    assert_eq!(funded_small.status, 200);
    assert!(
        db.calls(&funded).await.is_empty(),
        "counting is not charged"
    );
}

/// A doubt of the fault run, decided: the key holders' `/v1/calls` gives a refunded call's
/// reason in terms they can act on, never the operator's record (the provider's body, the
/// channel's and variables' names), which the admin API keeps whole.
#[tokio::test]
async fn key_holders_read_why_a_call_was_refunded_but_not_the_operators_record() {
    let db = local_db().await;
    let provider = FakeProvider::start().await;
    provider.always(Fault::json(
        500,
        r#"{"error":{"message":"backend pool-7 down, see OPS_SECRET_ENV"}}"#,
    ));
    let toml = one_upstream_toml("internal-channel", &provider.base, "K", "");
    let gateway = http_gateway(&db, Catalogue::from_toml(&toml).unwrap()).await;
    let key = db.funded_key(10, 0).await;
    assert_eq!(gateway.chat(&key, CHAT_MODEL).await.status, 502);

    let log = get(&gateway, "/v1/calls", Some(&key), false).await;
    let entry = &log.body["data"][0];
    assert_eq!(entry["status"], "refunded");
    assert_eq!(entry["upstream_error"], "上游服务暂时不可用, 已退款");
    let text = log.body.to_string();
    assert!(
        !text.contains("pool-7") && !text.contains("OPS_SECRET_ENV"),
        "{text}"
    );

    let operators = db.calls(&key).await.remove(0).upstream_error.unwrap();
    assert!(
        operators.contains("pool-7"),
        "the operator keeps the record: {operators}"
    );
}
