//! The service contract over real HTTP, against the example gateway's router on a temporary
//! `SQLite` file with the mock upstream (the refund cases use an upstream that is down).

use crate::common;

use common::*;
use model_gateway::{
    CallLog, Catalogue, Ledger, Protocol, Upstream, credits::Bucket, store::CallStatus,
    upstream::HttpUpstream,
};

#[tokio::test]
async fn both_auth_headers_work_on_both_endpoints() {
    let db = local_db().await;
    let gateway = start_mock_gateway(&db).await;
    let key = db.funded_key(100, 0).await;

    let chat = chat_body(CHAT_MODEL);
    let messages = messages_body(MESSAGES_MODEL);
    assert_eq!(
        gateway.post_bearer(CHAT, &key, chat.clone()).await.status,
        200
    );
    assert_eq!(gateway.post_x_api_key(CHAT, &key, chat).await.status, 200);
    assert_eq!(
        gateway
            .post_bearer(MESSAGES, &key, messages.clone())
            .await
            .status,
        200
    );
    assert_eq!(
        gateway
            .post_x_api_key(MESSAGES, &key, messages)
            .await
            .status,
        200
    );
    assert_eq!(
        db.balance(&key).await,
        balance(100 - 2 * CHAT_PRICE - 2 * MESSAGES_PRICE, 0)
    );
}

#[tokio::test]
async fn missing_unknown_and_revoked_keys_get_401_and_nothing_is_charged() {
    let db = local_db().await;
    let gateway = start_mock_gateway(&db).await;
    let key = db.funded_key(100, 0).await;
    let revoked = db.funded_key(100, 0).await;
    let revoked_account = db.account(&revoked).await;
    revoke(&db, &revoked).await;

    let no_key = gateway
        .send(
            gateway
                .client
                .post(format!("{}{CHAT}", gateway.base))
                .body(chat_body(CHAT_MODEL)),
        )
        .await;
    let answers = [
        no_key,
        gateway.chat(&stranger_key(), CHAT_MODEL).await,
        gateway.messages(&stranger_key(), MESSAGES_MODEL).await,
        gateway.chat(&revoked, CHAT_MODEL).await,
        gateway.messages(&revoked, MESSAGES_MODEL).await,
    ];
    for answer in answers {
        assert_eq!(answer.status, 401, "{answer:?}");
        assert_eq!(answer.detail(), "无效的 API Key");
    }
    assert_eq!(db.balance(&key).await, balance(100, 0));
    assert_eq!(
        db.store.balance(revoked_account).await.unwrap(),
        balance(100, 0)
    );
    let revoked_calls = db.store.recent_calls(revoked_account, 10).await.unwrap();
    assert!(revoked_calls.is_empty());
}

#[tokio::test]
async fn malformed_requests_get_400_with_a_detail_and_are_not_charged() {
    let db = local_db().await;
    let gateway = start_mock_gateway(&db).await;
    let key = db.funded_key(100, 0).await;

    let cases: &[(&str, &str)] = &[
        (CHAT, "this is not json"),
        (CHAT, r#"{"model":"gpt-4o-mini","messages":[]"#),
        (CHAT, r#"{"messages":[{"role":"user","content":"hi"}]}"#),
        (CHAT, r#"{"model":42,"messages":[]}"#),
        (CHAT, r#"{"model":"gpt-4o-mini"}"#),
        (
            CHAT,
            r#"{"model":"gpt-4o-mini","messages":{"role":"user"}}"#,
        ),
        (
            CHAT,
            r#"{"model":"gpt-4o-mini","messages":[],"stream":true}"#,
        ),
        (MESSAGES, r#"{"model":"claude-haiku-4-5","messages":[]}"#),
        (
            MESSAGES,
            r#"{"model":"claude-haiku-4-5","max_tokens":16,"messages":[],"stream":true}"#,
        ),
        (MESSAGES, "[]"),
        (MESSAGES, ""),
    ];
    for (path, body) in cases {
        let answer = gateway.post_bearer(path, &key, *body).await;
        assert_eq!(answer.status, 400, "{path} {body}: {answer:?}");
        assert!(!answer.detail().is_empty());
    }
    let stream = gateway
        .post_bearer(
            CHAT,
            &key,
            r#"{"model":"gpt-4o-mini","messages":[],"stream":true}"#,
        )
        .await;
    assert!(stream.detail().contains("stream"), "{stream:?}");
    assert_eq!(db.balance(&key).await, balance(100, 0));
    assert!(db.calls(&key).await.is_empty());
}

#[tokio::test]
async fn a_body_over_the_limit_gets_413_and_is_not_charged() {
    let db = local_db().await;
    let gateway = start_gateway(
        &db,
        Catalogue::demo(),
        Upstream::Mock(model_gateway::upstream::MockUpstream::new()),
        1024,
    )
    .await;
    let key = db.funded_key(100, 0).await;
    let big = serde_json::json!({
        "model": CHAT_MODEL,
        "messages": [{ "role": "user", "content": "x".repeat(4096) }]
    })
    .to_string();
    let answer = gateway.post_bearer(CHAT, &key, big).await;
    assert_eq!(answer.status, 413);
    assert_eq!(answer.detail(), "请求体过大");
    // Just under the limit is fine.
    assert_eq!(gateway.chat(&key, CHAT_MODEL).await.status, 200);
    assert_eq!(db.balance(&key).await, balance(100 - CHAT_PRICE, 0));
}

#[tokio::test]
async fn wrong_method_gets_405_and_unknown_path_gets_404() {
    let db = local_db().await;
    let gateway = start_mock_gateway(&db).await;
    let key = db.funded_key(100, 0).await;

    for path in [CHAT, MESSAGES] {
        let answer = gateway
            .send(
                gateway
                    .client
                    .get(format!("{}{path}", gateway.base))
                    .bearer_auth(&key),
            )
            .await;
        assert_eq!(answer.status, 405, "{path}");
        assert!(!answer.detail().is_empty());
    }
    let unknown = gateway
        .post_bearer("/v1/completions", &key, chat_body(CHAT_MODEL))
        .await;
    assert_eq!(unknown.status, 404);
    assert_eq!(unknown.detail(), "接口不存在");
    assert_eq!(db.balance(&key).await, balance(100, 0));
}

#[tokio::test]
async fn unknown_models_and_models_of_the_other_protocol_get_404_both_ways() {
    let db = local_db().await;
    let gateway = start_mock_gateway(&db).await;
    let key = db.funded_key(100, 0).await;

    let answers = [
        gateway.chat(&key, "no-such-model").await,
        gateway.messages(&key, "no-such-model").await,
        // A messages-family model on the chat endpoint, and the other way round.
        gateway.chat(&key, MESSAGES_MODEL).await,
        gateway.messages(&key, CHAT_MODEL).await,
    ];
    for answer in answers {
        assert_eq!(answer.status, 404, "{answer:?}");
        assert_eq!(answer.detail(), "模型不存在");
    }
    assert_eq!(db.balance(&key).await, balance(100, 0));
    assert!(db.calls(&key).await.is_empty());
}

#[tokio::test]
async fn insufficient_credits_get_402_and_leave_the_balance_untouched() {
    let db = local_db().await;
    let gateway = start_mock_gateway(&db).await;
    let key = db.funded_key(1, 1).await; // 2 credits: enough for chat (2), not for messages (3)

    let refused = gateway.messages(&key, MESSAGES_MODEL).await;
    assert_eq!(refused.status, 402);
    assert_eq!(refused.detail(), "积分不足");
    assert_eq!(db.balance(&key).await, balance(1, 1));
    assert!(db.calls(&key).await.is_empty());

    assert_eq!(gateway.chat(&key, CHAT_MODEL).await.status, 200);
    let empty = gateway.chat(&key, CHAT_MODEL).await;
    assert_eq!((empty.status, empty.detail()), (402, "积分不足"));
    assert_eq!(db.balance(&key).await, balance(0, 0));
}

#[tokio::test]
async fn the_checks_come_in_order_401_400_404_402() {
    let db = local_db().await;
    let gateway = start_mock_gateway(&db).await;
    let broke = db.funded_key(0, 0).await;

    // Malformed and unknown model and broke: 400 wins; without a key: 401 wins.
    let bad = r#"{"model":"no-such-model","messages":"x"}"#;
    assert_eq!(
        gateway.post_bearer(CHAT, &stranger_key(), bad).await.status,
        401
    );
    assert_eq!(gateway.post_bearer(CHAT, &broke, bad).await.status, 400);
    // Unknown model and broke: 404.
    assert_eq!(gateway.chat(&broke, "no-such-model").await.status, 404);
    assert_eq!(gateway.chat(&broke, CHAT_MODEL).await.status, 402);
}

#[tokio::test]
async fn subscription_credits_are_spent_first_and_a_price_can_split_across_buckets() {
    let db = local_db().await;
    let gateway = start_mock_gateway(&db).await;
    let key = db.funded_key(3, 10).await;

    for _ in 0..3 {
        assert_eq!(gateway.chat(&key, CHAT_MODEL).await.status, 200);
    }
    assert_eq!(db.balance(&key).await, balance(0, 10 - 3));
    let mut calls = db.calls(&key).await;
    calls.reverse(); // oldest first
    let taken: Vec<(i64, i64)> = calls
        .iter()
        .map(|c| (c.charged_subscription.get(), c.charged_topup.get()))
        .collect();
    assert_eq!(taken, [(2, 0), (1, 1), (0, 2)]);
    db.assert_audit_holds().await;
}

#[tokio::test]
async fn a_successful_call_is_logged_ok_with_its_price_protocol_and_usage() {
    let db = local_db().await;
    let gateway = start_mock_gateway(&db).await;
    let key = db.funded_key(100, 0).await;

    assert_eq!(gateway.messages(&key, MESSAGES_MODEL).await.status, 200);
    let calls = db.calls(&key).await;
    assert_eq!(calls.len(), 1);
    let call = &calls[0];
    assert_eq!(call.status, CallStatus::Ok);
    assert_eq!(call.protocol, Protocol::Messages);
    assert_eq!(call.model, MESSAGES_MODEL);
    assert_eq!(call.price.get(), MESSAGES_PRICE);
    assert_eq!(call.upstream_status, Some(200));
    // The mock reports the input as the gateway estimates it from the request, a token per
    // four bytes.
    assert!(
        call.input_tokens.is_some_and(|tokens| tokens > 0),
        "{call:?}"
    );
    assert_eq!(call.output_tokens, Some(16));
    assert!(call.finished_at.is_some());
}

/// A catalogue whose models point at a port where nothing listens.
fn catalogue_with_dead_upstreams() -> Catalogue {
    let port = {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        listener.local_addr().unwrap().port()
    }; // the listener is closed here, so connections are refused
    Catalogue::from_toml(&format!(
        r#"
        [[upstreams]]
        name = "dead-openai"
        kind = "openai"
        base_url = "http://127.0.0.1:{port}/v1"
        api_key_env = "UNUSED"
        [[upstreams]]
        name = "dead-anthropic"
        kind = "anthropic"
        base_url = "http://127.0.0.1:{port}"
        api_key_env = "UNUSED"
        [[models]]
        name = "{CHAT_MODEL}"
        protocol = "chat_completions"
        price = {CHAT_PRICE}
        upstream = "dead-openai"
        [[models]]
        name = "{MESSAGES_MODEL}"
        protocol = "messages"
        price = {MESSAGES_PRICE}
        upstream = "dead-anthropic"
        "#
    ))
    .unwrap()
}

#[tokio::test]
async fn an_upstream_failure_answers_502_and_returns_each_credit_to_its_bucket() {
    let db = local_db().await;
    let catalogue = catalogue_with_dead_upstreams();
    let upstream = HttpUpstream::with_keys(&catalogue, |_| Some("provider-key".into())).unwrap();
    let gateway = start_gateway(&db, catalogue, Upstream::Http(upstream), 1 << 20).await;
    let key = db.funded_key(1, 10).await;

    for answer in [
        gateway.chat(&key, CHAT_MODEL).await,
        gateway.messages(&key, MESSAGES_MODEL).await,
    ] {
        assert_eq!(answer.status, 502, "{answer:?}");
        assert_eq!(answer.detail(), "上游服务暂时不可用");
    }
    assert_eq!(db.balance(&key).await, balance(1, 10));
    let calls = db.calls(&key).await;
    assert_eq!(calls.len(), 2);
    for call in &calls {
        assert_eq!(call.status, CallStatus::Refunded);
        assert_eq!(call.upstream_status, None);
        let error = call.upstream_error.as_deref().unwrap();
        assert!(error.contains("connection failed"), "{error}");
        assert!(!error.contains("provider-key"), "{error}");
    }
    // The split was real: the price took the 1 subscription credit and the rest from top-up.
    assert_eq!(
        (
            calls[1].charged_subscription.get(),
            calls[1].charged_topup.get()
        ),
        (1, CHAT_PRICE - 1)
    );
    db.assert_audit_holds().await;
}

#[tokio::test]
async fn a_missing_provider_key_fails_the_call_without_contacting_anyone_and_refunds() {
    let db = local_db().await;
    let catalogue = catalogue_with_dead_upstreams();
    let upstream = HttpUpstream::with_keys(&catalogue, |_| None).unwrap();
    let gateway = start_gateway(&db, catalogue, Upstream::Http(upstream), 1 << 20).await;
    let key = db.funded_key(10, 0).await;

    assert_eq!(gateway.chat(&key, CHAT_MODEL).await.status, 502);
    assert_eq!(db.balance(&key).await, balance(10, 0));
    let calls = db.calls(&key).await;
    assert!(
        calls[0]
            .upstream_error
            .as_deref()
            .unwrap()
            .contains("UNUSED is not set")
    );
}

#[tokio::test]
async fn one_key_and_one_pool_serve_both_protocols() {
    let db = local_db().await;
    let gateway = start_mock_gateway(&db).await;
    let key = db.funded_key(CHAT_PRICE, 0).await;
    grant(&db, &key, Bucket::Topup, MESSAGES_PRICE).await;

    assert_eq!(gateway.chat(&key, CHAT_MODEL).await.status, 200);
    assert_eq!(gateway.messages(&key, MESSAGES_MODEL).await.status, 200);
    assert_eq!(db.balance(&key).await, balance(0, 0));
    assert_eq!(gateway.chat(&key, CHAT_MODEL).await.status, 402);
    assert_eq!(gateway.messages(&key, MESSAGES_MODEL).await.status, 402);
    let protocols: Vec<_> = db.calls(&key).await.iter().map(|c| c.protocol).collect();
    assert_eq!(protocols, [Protocol::Messages, Protocol::ChatCompletions]);
}

#[tokio::test]
async fn mock_replies_have_each_protocols_shape_and_name_the_requested_model() {
    let db = local_db().await;
    let gateway = start_mock_gateway(&db).await;
    let key = db.funded_key(100, 0).await;

    let chat = gateway.chat(&key, "deepseek-chat").await.body;
    assert_eq!(chat["object"], "chat.completion");
    assert_eq!(chat["model"], "deepseek-chat");
    assert!(chat["id"].is_string() && chat["created"].is_i64());
    assert_eq!(chat["choices"][0]["message"]["role"], "assistant");
    assert_eq!(chat["choices"][0]["finish_reason"], "stop");
    let usage = &chat["usage"];
    assert_eq!(
        usage["total_tokens"].as_i64(),
        Some(
            usage["prompt_tokens"].as_i64().unwrap() + usage["completion_tokens"].as_i64().unwrap()
        )
    );

    let messages = gateway.messages(&key, "claude-sonnet-4-5").await.body;
    assert_eq!(messages["type"], "message");
    assert_eq!(messages["role"], "assistant");
    assert_eq!(messages["model"], "claude-sonnet-4-5");
    assert_eq!(messages["content"][0]["type"], "text");
    assert_eq!(messages["stop_reason"], "end_turn");
    assert!(
        messages["usage"]["input_tokens"].is_i64() && messages["usage"]["output_tokens"].is_i64()
    );
}

#[tokio::test]
async fn operator_commands_create_grant_and_report() {
    let db = local_db().await;
    let admin = db.admin();
    let new = model_gateway::admin::NewAccount {
        name: "alice".into(),
        subscription: 5,
        topup: 7,
    };
    let created = admin.create_account(&new).await.unwrap();
    let key = created.key.as_str();
    assert!(key.starts_with(model_gateway::keys::KEY_PREFIX));
    let account = admin.account_of_key(key).await.unwrap();
    assert_eq!(account, created.id);
    let balance = admin.add_credits(account, 1, 2).await.unwrap();
    assert_eq!(
        serde_json::to_value(balance).unwrap(),
        serde_json::json!({ "subscription": 6, "topup": 9, "total": 15, "subscription_ends_at": null })
    );
    assert!(admin.add_credits(account, -1, 0).await.is_err());
    assert!(admin.account_of_key(&stranger_key()).await.is_err());
    db.assert_audit_holds().await;
}

#[tokio::test]
async fn the_stack_serves_on_bare_hyper_without_axum() {
    use hyper_util::rt::TokioIo;
    use hyper_util::service::TowerToHyperService;

    let db = local_db().await;
    let key = db.funded_key(10, 0).await;
    let service = model_gateway::stack(
        db.store.clone(),
        std::sync::Arc::new(Catalogue::demo()),
        model_gateway::router::DEFAULT_MAX_BODY_BYTES,
        Upstream::Mock(model_gateway::upstream::MockUpstream::new()),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let base = format!("http://{}", listener.local_addr().unwrap());
    let server = tokio::spawn(async move {
        loop {
            let (stream, _) = listener.accept().await.unwrap();
            let service = TowerToHyperService::new(service.clone());
            tokio::spawn(async move {
                hyper::server::conn::http1::Builder::new()
                    .serve_connection(TokioIo::new(stream), service)
                    .await
            });
        }
    });

    let client = reqwest::Client::new();
    let ok = client
        .post(format!("{base}{CHAT}"))
        .bearer_auth(&key)
        .body(chat_body(CHAT_MODEL))
        .send()
        .await
        .unwrap();
    assert_eq!(ok.status(), 200);
    let refused = client
        .post(format!("{base}{MESSAGES}"))
        .header("x-api-key", &key)
        .body(messages_body(CHAT_MODEL))
        .send()
        .await
        .unwrap();
    assert_eq!(refused.status(), 404);
    assert_eq!(refused.text().await.unwrap(), r#"{"detail":"模型不存在"}"#);
    assert_eq!(db.balance(&key).await, balance(10 - CHAT_PRICE, 0));
    server.abort();
}

#[tokio::test]
async fn mock_mode_creates_one_demo_account_on_an_empty_database_only() {
    let db = local_db().await;
    let demo = db
        .admin()
        .ensure_demo_account()
        .await
        .unwrap()
        .expect("created");
    assert_eq!(
        db.balance(&demo.key).await,
        balance(model_gateway::admin::DEMO_SUBSCRIPTION_CREDITS, 0)
    );
    assert!(db.admin().ensure_demo_account().await.unwrap().is_none());
}
